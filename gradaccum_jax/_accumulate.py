"""The accumulation transformation: ``accumulate`` and its state."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._checks import (
  NumMicrobatches,
  check_num_microbatches,
  check_same_structure,
  check_scheduled_k,
  check_trainable,
  check_weight,
)
from gradaccum_jax._noise import (
  NoiseScaleState,
  add_noise,
  after_window,
  init_state,
  open_sums,
  with_sums,
)
from gradaccum_jax._parts import Weighting, add_gradients, mean_of, sq_norm

Params = optax.Params
Updates = optax.Updates
OptState = optax.OptState


class AccumulateState(NamedTuple):
  """State of :func:`accumulate`.

  Attributes:
    micro_step: micro-batches accumulated in the open window (int32).
    count: windows closed so far, applied or voided (int32).
    num_skipped: windows voided because their gradient was not finite or
      their total weight was zero (int32). ``count - num_skipped`` windows
      moved the parameters.
    updated: whether the last call closed a window and moved the parameters
      (bool). Read it with :func:`has_updated`.
    acc_grads: the weighted sum ``sum_i w_i g_i`` of the open window, in
      ``accum_dtype``, with the structure of the parameters. Leaves kept in a
      float narrower than float32 (float16, bfloat16) hold the running weighted
      mean ``sum_i w_i g_i / sum_i w_i`` instead, so that it stays
      representable where the sum would overflow. Zeros when no window is
      open (``micro_step == 0``): every call that closes a window clears it,
      and a donated :func:`train_step` does not read it then.
    acc_weight: the summed weight ``sum_i w_i`` of the open window (float32).
    inner_state: the state of the inner optimizer, which only changes when a
      window is applied.
    loss_scale: a :class:`LossScaleState` with dynamic loss scaling
      (``accumulate(..., loss_scale=ga.DynamicLossScale())``), else None.
    noise_scale: a :class:`NoiseScaleState` with the gradient noise scale
      estimate (``accumulate(..., noise_scale_ema=0.99)``), else None.
  """

  micro_step: jax.Array
  count: jax.Array
  num_skipped: jax.Array
  updated: jax.Array
  acc_grads: Updates
  acc_weight: jax.Array
  inner_state: OptState
  loss_scale: LossScaleState | None = None
  noise_scale: NoiseScaleState | None = None


class MicroStepState(NamedTuple):
  """State of a :func:`micro_step`: an :class:`AccumulateState` and the open window's loss sums.

  Every mode takes it (``tx.update``, :func:`train_step`, :func:`flush` total the device slots
  and drop the loss sums), and :func:`micro_step` takes theirs.

  Attributes:
    accumulate: the :class:`AccumulateState`, as ``tx.init(params)`` makes it, except with a
      mesh: ``acc_grads``, ``acc_weight`` and the open-window noise sums (``sq_sum``, ``num``,
      ``examples``) have a leading axis of ``D`` slots, one per data-parallel device, sharded
      over the data axes; the window's sums are their total.
    loss_sum: :math:`\\sum_i w_i L_i` over the open window (float32; ``(D,)`` with a mesh).
    aux_sum: with ``has_aux``, the open window's aux sums (a leading ``D`` axis with a mesh).
    window_start: with ``has_state``, the model state as the open window found it, which a
      voided window restores; None until the first call.
  """

  accumulate: AccumulateState
  loss_sum: jax.Array
  aux_sum: Any = None
  window_start: Any = None


def slot_totals(state: Any) -> Any:
  """The :class:`AccumulateState` of ``state`` (a :class:`MicroStepState` is unwrapped, its
  device slots summed: they have a leading axis iff ``acc_weight`` does); others unchanged."""
  if not isinstance(state, MicroStepState):
    return state
  acc = state.accumulate
  if jnp.ndim(acc.acc_weight) == 0:
    return acc
  total = lambda x: jnp.sum(x, axis=0)  # noqa: E731
  acc = acc._replace(acc_grads=jax.tree.map(total, acc.acc_grads), acc_weight=total(acc.acc_weight))
  noise = jax.tree.map(total, open_sums(acc.noise_scale))
  return acc._replace(noise_scale=with_sums(acc.noise_scale, noise))


class LossScaleState(NamedTuple):
  """State of dynamic loss scaling: the scale and the applied windows since it last changed."""

  scale: jax.Array  # float32
  good_windows: jax.Array  # int32


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """Dynamic loss scaling for float16 training, updated once per window.

  The loss is multiplied by ``scale`` before differentiation (``ga.train_step``
  does it; in streaming mode differentiate ``loss * state.loss_scale.scale``),
  and the accumulated gradient is divided by it before the inner optimizer. The
  scale is constant within a window. A window whose gradient overflows (Inf or
  NaN) is skipped and the scale divided by ``factor`` (not below
  ``min_scale``); after ``period`` applied windows in a row it is multiplied by
  ``factor``.

  Attributes:
    initial_scale: the scale to start from.
    period: applied windows without overflow before the scale grows.
    factor: how much the scale shrinks or grows at a time.
    min_scale: the scale never goes below this.
  """

  initial_scale: float = 2.0**15
  period: int = 2000
  factor: float = 2.0
  min_scale: float = 1.0

  def __post_init__(self):
    if not (self.initial_scale > 0 and self.min_scale > 0 and self.factor > 1 and self.period >= 1):
      raise ValueError(
        f"DynamicLossScale needs initial_scale > 0, min_scale > 0, factor > 1 and period >= 1,"
        f" got {self}."
      )

  def init(self) -> LossScaleState:
    return LossScaleState(jnp.asarray(self.initial_scale, jnp.float32), jnp.zeros((), jnp.int32))

  def next(self, state: LossScaleState, finite: jax.Array, nonempty: jax.Array) -> LossScaleState:
    grown = state.good_windows + 1 >= self.period
    scale = jnp.where(
      finite,
      jnp.where(grown, state.scale * self.factor, state.scale),
      jnp.maximum(state.scale / self.factor, self.min_scale),
    )
    good = jnp.where(finite & ~grown, state.good_windows + 1, 0)
    # An empty window (total weight 0) says nothing about overflow.
    return LossScaleState(
      jnp.where(nonempty, scale, state.scale).astype(jnp.float32),
      jnp.where(nonempty, good, state.good_windows).astype(jnp.int32),
    )


def has_updated(state: AccumulateState) -> jax.Array:
  """Whether the call that returned ``state`` closed a window and moved params.

  False on micro-steps inside a window and on windows voided for non-finite
  gradients or zero total weight.

  Args:
    state: an :class:`AccumulateState`.

  Returns:
    A boolean scalar array.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> tx = ga.accumulate(optax.sgd(0.1), num_microbatches=2)
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> _, state = tx.update(jnp.ones(3), state, params)
    >>> bool(ga.has_updated(state))
    False
    >>> _, state = tx.update(jnp.ones(3), state, params)
    >>> bool(ga.has_updated(state))
    True
  """
  state = state.accumulate if isinstance(state, MicroStepState) else state
  if not isinstance(state, AccumulateState):
    raise TypeError(
      f"has_updated expects an AccumulateState, got {type(state).__name__}."
      " Pass the state returned by ga.accumulate(...).init/update, not the"
      " inner optimizer's state."
    )
  return state.updated


def accum_dtype_for(like: Any, accum_dtype: Any) -> Any:
  """The accumulator's dtype for a leaf like ``like``: ``accum_dtype``'s precision, complex
  for a complex leaf (complex64 for float32); the leaf's own dtype if ``accum_dtype`` is None."""
  dtype = jnp.result_type(like)
  if accum_dtype is None:
    return dtype
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return jnp.promote_types(accum_dtype, jnp.complex64)
  return accum_dtype


def _on_the_params_mesh(state: Any, params: Params) -> Any:
  """``state`` with every concrete array that is not on the params' mesh (the counters, the
  inner optimizer's own ``count``) placed there, replicated: a checkpoint restored onto
  ``tx.init(params)``'s shardings then finds every leaf on one set of devices."""
  meshes = [
    x.sharding.mesh
    for x in jax.tree.leaves(params)
    if isinstance(x, jax.Array)
    and not isinstance(x, jax.core.Tracer)
    and isinstance(x.sharding, jax.sharding.NamedSharding)
  ]
  if not meshes:
    return state
  replicated = jax.sharding.NamedSharding(meshes[0], jax.sharding.PartitionSpec())

  def place(x):
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
      return x
    if isinstance(x.sharding, jax.sharding.NamedSharding):
      return x
    return jax.device_put(x, replicated)

  return jax.tree.map(place, state)


def zeros_accumulator(params: Params, accum_dtype: Any) -> Updates:
  """Zeros like ``params`` (shapes and shardings), in ``accum_dtype`` (the params' dtypes if
  None): an accumulator for sharded params is sharded like them, as optax's own state is."""
  return jax.tree.map(lambda p: jnp.zeros_like(p, accum_dtype_for(p, accum_dtype)), params)


@dataclasses.dataclass(frozen=True, eq=False)
class _Accumulator:
  """Settings of one ``accumulate`` transformation; ``init``/``update`` are its methods."""

  inner: optax.GradientTransformationExtraArgs
  num_microbatches: NumMicrobatches
  accum_dtype: Any
  skip_nonfinite: bool
  loss_scale: DynamicLossScale | None = None
  noise_scale_ema: float | None = None

  def init(self, params: Params) -> AccumulateState:
    return _on_the_params_mesh(self._init(params), params)

  def _init(self, params: Params) -> AccumulateState:
    return AccumulateState(
      micro_step=jnp.zeros((), jnp.int32),
      count=jnp.zeros((), jnp.int32),
      num_skipped=jnp.zeros((), jnp.int32),
      updated=jnp.zeros((), bool),
      acc_grads=zeros_accumulator(params, self.accum_dtype),
      acc_weight=jnp.zeros((), jnp.float32),
      inner_state=self.inner.init(params),
      loss_scale=None if self.loss_scale is None else self.loss_scale.init(),
      noise_scale=None if self.noise_scale_ema is None else init_state(),
    )

  def window_size(self, count: jax.Array) -> jax.Array | int:
    k = self.num_microbatches
    if isinstance(k, int):
      return k
    return jnp.maximum(check_scheduled_k(k(count)), 1)

  def check_state(self, state: Any) -> AccumulateState:
    """``state`` if it is an :class:`AccumulateState` with every part this transformation uses
    (a :class:`MicroStepState`'s, its device slots summed)."""
    state = slot_totals(state)
    if not isinstance(state, AccumulateState):
      raise TypeError(
        "state must be tx.init(params) of this ga.accumulate transformation (an"
        f" AccumulateState from tx.init), got {type(state).__name__}."
      )
    for feature, field, setting in (
      ("loss_scale", "loss_scale", self.loss_scale),
      ("noise_scale_ema", "noise_scale", self.noise_scale_ema),
    ):
      if setting is not None and getattr(state, field) is None:
        raise ValueError(
          f"This transformation has {feature}={setting!r}, but the state has no {field}"
          f" (it was made without it). Upgrade a saved state with"
          f" state._replace({field}=tx.init(params).{field})."
        )
    return state

  def close(
    self,
    acc_grads: Updates,
    acc_weight: jax.Array,
    state: AccumulateState,
    params: Params | None,
    grad_like: Updates,
    extra_args: dict[str, Any],
    apply: bool = False,
    in_place: bool = False,
    norm_by_rows: bool = False,
    branch: bool = False,
  ) -> tuple[Updates, AccumulateState, jax.Array]:
    """Closes a window: one inner update on ``acc_grads / acc_weight``.

    Returns the updates (with ``apply``: the new params, the updates applied to ``params``
    where they are made, so no zero updates are written for a voided window), the new state
    and the global norm of the mean gradient (float32). A
    window with zero or non-finite total weight, or a non-finite mean gradient when
    ``skip_nonfinite`` or loss scaling is on, is voided: zero updates, inner state kept. With
    loss scaling, ``acc_grads`` holds scaled gradients. The inner optimizer's update takes
    effect at most once, and only on a window that is applied.
    One reduction, the squared norm of the mean, gives both the norm and the finiteness check
    (a norm past float32's range, above 1.8e19, counts as non-finite).

    ``in_place`` (with ``apply``, for params and state donated to the step): the inner update
    runs in a loop of 0 or 1 trips, which writes the new params and inner state over the old
    ones. Selects between new and old values (the default, best without donation, where the
    results go to new buffers anyway) keep the old values alive while the new ones are
    written, so under donation XLA first copies the inner state (adam's ``mu`` and ``nu``).

    ``branch`` (streaming calls, which close inside a ``lax.cond``; without ``apply``): a
    voided window is decided by a ``lax.cond`` too, whose kept branch passes the inner state
    through:
    reverse-differentiable, and no select keeps the old inner state beside the new. The new
    state's ``acc_grads`` is then ``acc_grads`` itself, for the caller to clear after its
    ``lax.cond`` (:func:`clear_after`): a branch that only reads the accumulator lets XLA keep
    it in the state's buffer, where writing its zeros there would make it copy the sums.

    ``norm_by_rows``: the norm sums each matrix by rows first (:func:`sq_norm`), for a step
    whose arrays are not sharded over a mesh.
    """
    nonempty = jnp.isfinite(acc_weight) & (acc_weight > 0)
    scale = None if state.loss_scale is None else state.loss_scale.scale

    def mean_fn():  # a function, so that XLA fuses the mean into each of its uses
      mean = mean_of(acc_grads, jnp.where(nonempty, acc_weight, 0.0), scale)
      return jax.tree.map(lambda m, g: m.astype(jnp.result_type(g)), mean, grad_like)

    sq = jnp.where(nonempty, sq_norm(mean_fn(), norm_by_rows), 0.0)
    ok = nonempty
    loss_scale = state.loss_scale
    if self.skip_nonfinite or self.loss_scale is not None:
      finite = jnp.isfinite(sq)
      ok = ok & finite
      if self.loss_scale is not None:
        loss_scale = self.loss_scale.next(state.loss_scale, finite, nonempty)

    if apply and in_place:

      def run(carry):
        p, inner = carry
        updates, inner = self._inner_update(mean_fn(), inner, p, extra_args)
        return jax.tree.map(lambda p, u: p + u.astype(p.dtype), p, updates), inner

      done, (updates, inner_state) = loop_once_if(
        ok, run, (params, state.inner_state), with_done=True
      )
      # Zeros (``done`` is False), written once the update has read the sums: a caller that
      # scanned into a donated accumulator gets them in its buffer, not a copy of it.
      cleared = jax.tree.map(lambda a: jnp.broadcast_to(done.astype(a.dtype), a.shape), acc_grads)
    elif branch:

      def run(carry):
        p, inner = carry
        return self._inner_update(mean_fn(), inner, p, extra_args)

      def keep(carry):
        shapes = jax.eval_shape(run, carry)[0]
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), carry[1]

      updates, inner_state = jax.lax.cond(ok, run, keep, (params, state.inner_state))
      cleared = acc_grads
    else:
      cleared = jax.tree.map(jnp.zeros_like, acc_grads)
      updates, inner_state = self._inner_update(mean_fn(), state.inner_state, params, extra_args)
      if apply:  # the new params, or the old ones for a voided window
        updates = jax.tree.map(
          lambda p, u: jnp.where(ok, p + u.astype(p.dtype), p), params, updates
        )
      else:
        updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
      inner_state = jax.tree.map(
        lambda new, old: jnp.where(ok, new, old), inner_state, state.inner_state
      )
    new_state = AccumulateState(
      micro_step=jnp.zeros((), jnp.int32),
      count=optax.safe_increment(state.count),
      num_skipped=jnp.where(ok, state.num_skipped, optax.safe_increment(state.num_skipped)),
      updated=ok,
      acc_grads=cleared,
      acc_weight=jnp.zeros((), jnp.float32),
      inner_state=inner_state,
      loss_scale=loss_scale,
      noise_scale=None
      if state.noise_scale is None
      else after_window(state.noise_scale, self.noise_scale_ema, acc_grads, acc_weight, ok, scale),
    )
    return updates, new_state, jnp.sqrt(sq)

  def _closer(self, params, grad_like, extra_args):
    """``close(state) -> (updates, state)`` on the state's open window (a ``lax.cond`` branch)."""

    def close(state):
      acc, weight = state.acc_grads, state.acc_weight
      return self.close(acc, weight, state, params, grad_like, extra_args, branch=True)[:2]

    return close

  def _inner_update(self, mean, inner_state, params, extra_args):
    """``inner.update`` on the window's mean gradient, with errors that say what ga passes."""
    extra_args = {k: (mean if v is MEAN_GRADIENT else v) for k, v in extra_args.items()}
    try:
      return self.inner.update(mean, inner_state, params, **extra_args)
    except ValueError as e:
      if params is not None or "params" not in str(e):
        raise
      raise ValueError(
        f"The inner optimizer of ga.accumulate needs the params ({e}). Pass them to every"
        " call: tx.update(grads, state, params) (ga.flush(tx, state, params) too)."
      ) from e
    except TypeError as e:
      if "value_fn" in str(e):
        raise TypeError(
          "The inner optimizer needs value_fn= (a line search, e.g. optax.lbfgs), which would"
          " re-evaluate the loss over the whole window at new params: ga cannot provide it."
          " Use an optimizer without a line search, or a fixed learning rate."
        ) from e
      if "'value'" in str(e) or "'grad'" in str(e):
        raise TypeError(
          f"The inner optimizer needs extra arguments ({e}). ga.train_step and ga.micro_step"
          " pass the window's mean loss as value= and its mean gradient as grad=. In streaming"
          " mode pass them to every tx.update call, e.g. tx.update(g, state, params,"
          " value=mean_loss_so_far): under jit a call cannot know whether it closes the"
          " window, and only the closing call's value reaches the inner optimizer."
        ) from e
      raise

  def update(
    self,
    grads: Updates,
    state: AccumulateState,
    params: Params | None = None,
    *,
    weight: Any = None,
    **extra_args: Any,
  ) -> tuple[Updates, AccumulateState]:
    state = self.check_state(state)
    check_same_structure(grads, state.acc_grads, "grads")
    check_trainable(grads, "grads")
    wt = _UNWEIGHTED if weight is None else _WEIGHTED
    w = jnp.ones((), jnp.float32) if weight is None else check_weight(weight)
    acc = add_gradients(state.acc_grads, grads, w, state.acc_weight, wt)
    acc_weight = state.acc_weight + wt.total(w)
    if state.noise_scale is not None:
      state = state._replace(
        noise_scale=add_noise(state.noise_scale, sq_norm(grads), None if weight is None else w, 1.0)
      )
    micro_step = optax.safe_increment(state.micro_step)
    grad_like = grads if params is None else params

    held = state._replace(
      micro_step=micro_step, updated=jnp.zeros((), bool), acc_grads=acc, acc_weight=acc_weight
    )

    close = self._closer(params, grad_like, extra_args)

    k = self.num_microbatches
    if isinstance(k, int) and k == 1:
      return clear_after(jnp.ones((), bool), *close(held))
    closes = micro_step >= self.window_size(state.count)
    return clear_after(*jax.lax.cond(closes, _flagged(close), _holder(close), held))

  def flush(
    self, state: AccumulateState, params: Params | None, extra_args: dict[str, Any]
  ) -> tuple[Updates, AccumulateState]:
    """Closes the open window now; an empty one (no micro-step) changes nothing."""
    state = self.check_state(state)
    grad_like = state.acc_grads if params is None else params

    close = self._closer(params, grad_like, extra_args)

    held = state._replace(updated=jnp.zeros((), bool))
    closes = state.micro_step > 0
    return clear_after(*jax.lax.cond(closes, _flagged(close), _holder(close), held))


def clear_after(closed: Any, updates: Updates, state: AccumulateState) -> tuple[Any, Any]:
  """``(updates, state)`` with the accumulator zeroed where a window ``closed``: a select
  after the ``lax.cond`` that read it, written in place over the sums. ``closed`` comes out
  of the ``lax.cond`` (:func:`_flagged`): a predicate XLA knew before it would let it hoist
  the select above the branch, which then reads a copy of the sums."""
  acc = jax.tree.map(lambda a: jnp.where(closed, jnp.zeros_like(a), a), state.acc_grads)
  return updates, state._replace(acc_grads=acc)


def _holder(close: Any) -> Any:
  """The other branch of ``lax.cond(closes, close, ...)``: zero updates shaped as ``close``'s,
  the state passed through (a ``lax.cond``, so that the call is reverse-differentiable; with
  the state donated XLA passes it through in place)."""

  def hold(state: AccumulateState) -> tuple[Any, Updates, AccumulateState]:
    shape = jax.eval_shape(close, state)[0]
    return jnp.zeros((), bool), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape), state

  return hold


def _flagged(fn: Any) -> Any:
  """``fn`` returning ``(True, *fn(...))``: a branch of a ``lax.cond`` that says it ran."""
  return lambda *args: (jnp.ones((), bool), *fn(*args))


def loop_once_if(pred: jax.Array, fn: Any, carry: Any, *, with_done: bool = False) -> Any:
  """``fn(carry)`` if ``pred``, else ``carry``: a ``while_loop`` of 0 or 1 trips.

  The donated fused step closes its window in one: the loop updates its carry (params, inner
  state) in place, where a ``jnp.where`` between the new and the old state keeps the old one
  alive and copies it. Not reverse-differentiable; the streaming calls close in a ``lax.cond``
  whose branches only read the accumulator (:func:`clear_after`).

  ``with_done``: returns ``(done, result)``, ``done`` the loop's predicate at its exit: always
  False, but XLA does not know it, so a select on it is an operation that follows the loop.
  """

  def body(c):
    return jnp.zeros((), bool), _with_types_of(fn(c[1]), c[1])

  out = jax.lax.while_loop(lambda c: c[0], body, (pred, carry))
  return out if with_done else out[1]


def _with_types_of(tree: Any, like: Any) -> Any:
  """``tree`` resharded where a leaf's sharding type differs from ``like``'s (on an explicit
  mesh, a loop's carry must keep its type: an inner state laid out replicated, updated from
  gradients sharded like the params, comes out sharded)."""

  def cast(x, ref):
    want = getattr(jax.typeof(ref), "sharding", None)
    axis_types = getattr(getattr(want, "mesh", None), "axis_types", ())
    if not any(t == jax.sharding.AxisType.Explicit for t in axis_types):
      return x  # no sharding in the types
    if jax.typeof(x).sharding.spec == want.spec:
      return x
    return jax.reshard(x, want)

  return jax.tree.map(cast, tree, like)


_UNWEIGHTED = Weighting(None)
_WEIGHTED = Weighting(check_weight)

# Stands for the window's mean gradient in the extra arguments the fused step gives ``close``.
MEAN_GRADIENT = object()


class Accumulate(optax.GradientTransformationExtraArgs):
  """What :func:`accumulate` returns: an ``optax.GradientTransformationExtraArgs`` whose
  settings are attributes (``num_microbatches``, ``inner``, ``accum_dtype``,
  ``skip_nonfinite``, ``loss_scale``, ``noise_scale_ema``)."""

  __slots__ = ()

  @property
  def settings(self) -> _Accumulator:
    return self.update.__self__

  num_microbatches = property(lambda self: self.settings.num_microbatches)
  inner = property(lambda self: self.settings.inner)
  accum_dtype = property(lambda self: self.settings.accum_dtype)
  skip_nonfinite = property(lambda self: self.settings.skip_nonfinite)
  loss_scale = property(lambda self: self.settings.loss_scale)
  noise_scale_ema = property(lambda self: self.settings.noise_scale_ema)

  def fixed_num_microbatches(self, where: str) -> int:
    """``k``, or a TypeError naming ``where`` if ``num_microbatches`` is a schedule."""
    k = self.num_microbatches
    if not isinstance(k, int):
      raise TypeError(
        f"{where} needs a fixed int number of micro-batches per window, but this"
        f" ga.accumulate has the schedule num_microbatches={k!r}. Pass an int to"
        " ga.accumulate, drive a schedule with tx.update (streaming mode), or use"
        " ga.ramp_train_step."
      )
    return k


def accumulate(
  inner: optax.GradientTransformation,
  num_microbatches: NumMicrobatches,
  *,
  accum_dtype: Any = jnp.float32,
  skip_nonfinite: bool = True,
  loss_scale: DynamicLossScale | None = None,
  noise_scale_ema: float | None = None,
) -> Accumulate:
  r"""Accumulates gradients over ``num_microbatches`` calls, then applies ``inner`` once.

  Each call to ``update`` adds one micro-batch gradient ``g_i`` with weight
  ``w_i`` (1 by default, or the ``weight=`` keyword, e.g. the number of
  tokens in the micro-batch) to an accumulator. The ``k``-th call closes the
  window: ``inner`` is applied once to the weighted mean

  .. math::
    G = \frac{\sum_i w_i g_i}{\sum_i w_i},

  cast to the parameters' dtype, and its updates are returned; the other
  calls return zero updates. For a mean loss this is exactly the update of
  one batch ``k`` times larger. The inner optimizer, its counters and its
  schedules see one step per window, and it is evaluated once per window
  (and not at all for a voided one), not on every micro-step and masked as in
  ``optax.MultiSteps``; a call that does not close the window does not copy
  the inner optimizer's state. The window closes in a ``lax.cond``, so
  ``jax.grad`` goes through ``update`` and :func:`flush` (meta-gradients).

  Put everything that should see the accumulated gradient *inside*
  ``inner`` (clipping, schedules via ``optax.inject_hyperparams``, weight
  decay): a transformation chained after ``accumulate`` sees the zero
  updates of every micro-step.

  Args:
    inner: the optimizer to apply once per window.
    num_microbatches: micro-batches per window ``k``: a positive int, or (in
      streaming mode only) a schedule ``count -> int`` of the number of
      windows closed so far.
    accum_dtype: dtype of the accumulator, float32 by default whatever the
      gradients' dtype; ``None`` accumulates in the gradients' dtype. Complex
      gradients accumulate in the complex type of that precision (complex64
      for float32). An accumulator narrower than float32 keeps the running
      weighted mean (updated in float32), not the sum; it cannot be used with
      ``mesh=``.
    skip_nonfinite: if True, a window whose mean gradient has a NaN or Inf
      (from any of its micro-batches) is voided: zero updates, inner state
      unchanged, ``num_skipped`` incremented. A window whose total weight is
      zero is always voided.
    loss_scale: a :class:`DynamicLossScale` for float16 training: the state
      carries the scale (``state.loss_scale.scale``), ``train_step`` scales the
      loss by it, the accumulated gradient is unscaled before ``inner``, and a
      window that overflows is skipped and the scale lowered, once per window.
    noise_scale_ema: the decay ``d`` in ``[0, 1)`` (e.g. 0.99) of moving
      averages of the gradient noise scale estimate, or ``None`` (off: nothing
      extra is computed or stored). See below and :func:`noise_scale`.

  Gradient noise scale: the spread of a window's micro-batch gradients gives
  unbiased estimates of :math:`|G|^2` and :math:`\mathrm{tr}\Sigma` for one squared
  norm per micro-batch; their moving averages give :func:`noise_scale`
  (derivation, weights and data parallelism: docs/noise_scale.md).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`AccumulateState`. ``update(grads, state, params=None, *,
    weight=None, **extra_args)`` forwards ``extra_args`` to ``inner``.

  Raises:
    TypeError, ValueError: for a ``num_microbatches`` that is not a positive
      int or a schedule, or a ``noise_scale_ema`` outside ``[0, 1)``; in
      ``update``, for grads whose structure or shapes
      differ from the params, or a non-scalar ``weight``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> tx = ga.accumulate(optax.sgd(1.0), num_microbatches=2)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> for g in (jnp.array([1.0, 0.0]), jnp.array([3.0, 2.0])):
    ...   updates, state = tx.update(g, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params  # -1.0 * mean of the two gradients
    Array([-2., -1.], dtype=float32)
    >>> int(state.count), int(state.micro_step)
    (1, 0)

    Token-weighted micro-batches give the token-level mean of the window:

    >>> state = tx.init(params)
    >>> _, state = tx.update(jnp.array([1.0, 1.0]), state, weight=1.0)
    >>> updates, state = tx.update(jnp.array([4.0, 4.0]), state, weight=3.0)
    >>> updates  # -(1*1 + 3*4) / (1 + 3)
    Array([-3.25, -3.25], dtype=float32)

  References:
    Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
    <https://arxiv.org/abs/1706.02677>`_, 2017.

    McCandlish et al., `An Empirical Model of Large-Batch Training
    <https://arxiv.org/abs/1812.06162>`_, 2018.
  """
  k = check_num_microbatches(num_microbatches, allow_schedule=True)
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation, got {type(inner).__name__}.")
  if accum_dtype is not None:
    accum_dtype = jnp.dtype(accum_dtype)
  if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
    raise TypeError(f"loss_scale must be a ga.DynamicLossScale or None, got {loss_scale!r}.")
  if noise_scale_ema is not None:
    if isinstance(noise_scale_ema, bool) or not isinstance(noise_scale_ema, numbers.Real):
      raise TypeError(
        f"noise_scale_ema must be a float decay in [0, 1) (e.g. 0.99) or None, got"
        f" {noise_scale_ema!r} of type {type(noise_scale_ema).__name__}."
      )
    if not 0.0 <= noise_scale_ema < 1.0:
      raise ValueError(
        f"noise_scale_ema must be a decay in [0, 1) (e.g. 0.99; 0 keeps only the last"
        f" window), got {noise_scale_ema!r}."
      )
    noise_scale_ema = float(noise_scale_ema)
  acc = _Accumulator(
    inner=optax.with_extra_args_support(inner),
    num_microbatches=k,
    accum_dtype=accum_dtype,
    skip_nonfinite=bool(skip_nonfinite),
    loss_scale=loss_scale,
    noise_scale_ema=noise_scale_ema,
  )
  return Accumulate(acc.init, acc.update)


def as_accumulate(tx: Any, what: str = "tx") -> Accumulate:
  """``tx`` if it is made by :func:`accumulate`, else a TypeError that says how to make one."""
  if not isinstance(tx, Accumulate):
    raise TypeError(
      f"{what} must be made by ga.accumulate(inner, num_microbatches), got"
      f" {type(tx).__name__}. Wrap your optimizer: tx = ga.accumulate(optax.adam(1e-3), k);"
      " put clipping and schedules inside `inner`."
    )
  return tx


def flush(
  tx: Accumulate, state: AccumulateState, params: Params | None = None, **extra_args: Any
) -> tuple[Updates, AccumulateState]:
  r"""Closes the open window now, with the micro-batches accumulated so far.

  For the end of an epoch or a data file: ``inner`` is applied once to the
  weighted mean :math:`G = \sum_i w_i g_i / \sum_i w_i` of the ``m < k``
  micro-batches that streaming ``tx.update`` calls (or an open window of the
  fused steps) have accumulated, exactly the update of one batch made of
  them, and the next window starts empty. A window with no micro-batch gives
  zero updates and the state unchanged (not counted as a step). Jit-able:
  ``m`` may be traced.

  Args:
    tx: a transformation made by :func:`accumulate`.
    state: its :class:`AccumulateState`.
    params: the params, for inner optimizers that need them (weight decay).
    **extra_args: forwarded to ``inner``.

  Returns:
    ``(updates, state)``, as the closing ``tx.update`` would return them.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> tx = ga.accumulate(optax.sgd(1.0), num_microbatches=4)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> for g in (jnp.array([1.0, 0.0]), jnp.array([3.0, 2.0])):  # only 2 of 4
    ...   _, state = tx.update(g, state, params)
    >>> updates, state = ga.flush(tx, state, params)
    >>> updates, int(state.count), int(state.micro_step)
    (Array([-2., -1.], dtype=float32), 1, 0)
  """
  return as_accumulate(tx).settings.flush(state, params, extra_args)
