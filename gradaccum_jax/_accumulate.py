"""The accumulation transformation: ``accumulate`` and its state."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._checks import (
  NumMicrobatches,
  check_decay,
  check_migrated,
  check_num_microbatches,
  check_same_structure,
  check_scheduled_k,
  check_trainable,
  check_weight,
)
from gradaccum_jax._noise import (
  NoiseScaleState,
  NoiseUnit,
  add_noise,
  after_window,
  init_state,
)
from gradaccum_jax._parts import (
  PLAIN_SUMS,
  add_gradients,
  counted,
  keeps_running_means,
  mean_of,
  over_slots,
  refuse_overwritten,
  sq_norm,
  zeros_accumulator,
)
from gradaccum_jax._sharding import on_the_params_mesh, with_types_of

Params = optax.Params
Updates = optax.Updates
OptState = optax.OptState


class AccumulateState(NamedTuple):
  """State of :func:`accumulate`.

  Attributes:
    micro_step: micro-batches in the open window (int32).
    count: windows closed, applied or voided (int32); ``num_skipped``: of them voided.
    updated: whether the last call closed a window and moved the params (:func:`has_updated`).
    acc_grads: the open window's :math:`\\sum_i w_i g_i` in ``accum_dtype`` (a leaf narrower
      than float32: the running weighted mean); zeros when no window is open.
    acc_weight: the open window's :math:`\\sum_i w_i` (float32).
    inner_state: the inner optimizer's state, changed only by an applied window.
    loss_scale, noise_scale: a :class:`LossScaleState` and a :class:`NoiseScaleState` where on.
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
  """State of a :func:`micro_step`; it answers every :class:`AccumulateState` field (the sums
  totalled over the device slots), and every mode takes it.

  Attributes:
    accumulate: an :class:`AccumulateState`; on a mesh its sums have a leading axis of ``D``
      slots, one per data-parallel device, whose total is the window's.
    loss_sum, aux_sum: the open window's loss and aux sums (with the same slots).
    window_start: with ``has_state``, the model state a voided window restores.
    parts: the open window's parts of registered units, by name (docs/architecture.md).
  """

  accumulate: AccumulateState
  loss_sum: jax.Array
  aux_sum: Any = None
  window_start: Any = None
  parts: Any = None


# The units of the sums an AccumulateState holds in device slots in a MicroStepState.
_SLOTTED = {"sums": PLAIN_SUMS, "noise": NoiseUnit(False)}


def _field(name: str) -> property:
  """``name`` of a :class:`MicroStepState`: its device slots' total (that field's alone)."""

  def read(state: MicroStepState) -> Any:
    acc = state.accumulate
    if name not in ("acc_grads", "acc_weight", "noise_scale") or jnp.ndim(acc.acc_weight) == 0:
      return getattr(acc, name)  # the counters, or sums without device slots
    if name == "acc_weight" or name == "acc_grads" and not keeps_running_means(acc.acc_grads):
      return jax.tree.map(lambda x: jnp.sum(x, axis=0), getattr(acc, name))
    unit = _SLOTTED["noise" if name == "noise_scale" else "sums"]
    return getattr(_totalled(acc, {unit.name: unit}), name)

  return property(read)


for _name in AccumulateState._fields:
  setattr(MicroStepState, _name, _field(_name))
del _name


def _totalled(acc: AccumulateState, units: dict) -> AccumulateState:
  parts = over_slots(units, {n: u.held(acc) for n, u in units.items()})
  for name, unit in units.items():
    acc = unit.hold(acc, parts[name])
  return acc


def slot_totals(state: Any) -> Any:
  """The :class:`AccumulateState` of any mode's ``state``, device slots totalled."""
  if not isinstance(state, MicroStepState):
    return state
  acc = state.accumulate
  return acc if jnp.ndim(acc.acc_weight) == 0 else _totalled(acc, _SLOTTED)


class LossScaleState(NamedTuple):
  """The loss scale and the windows applied since it last changed."""

  scale: jax.Array  # float32
  good_windows: jax.Array  # int32


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """Dynamic loss scaling for float16, once per window: the loss times ``scale`` (in streaming
  mode differentiate ``loss * state.loss_scale.scale``), the window's gradient divided by it;
  an overflow skips the window and divides it by ``factor``, ``period`` good windows multiply it."""

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
    finite_scale = jnp.where(grown, state.scale * self.factor, state.scale)
    scale = jnp.where(finite, finite_scale, jnp.maximum(state.scale / self.factor, self.min_scale))
    good = jnp.where(finite & ~grown, state.good_windows + 1, 0)
    # An empty window (total weight 0) says nothing about overflow.
    return LossScaleState(
      jnp.where(nonempty, scale, state.scale).astype(jnp.float32),
      jnp.where(nonempty, good, state.good_windows).astype(jnp.int32),
    )


def has_updated(state: AccumulateState) -> jax.Array:
  """Whether the call that returned ``state`` (any mode's) closed a window and moved params.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> tx = ga.accumulate(optax.sgd(0.1), num_microbatches=2)
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> _, state = tx.update(jnp.ones(3), state, params)
    >>> bool(ga.has_updated(state))
    False
  """
  if not isinstance(state, AccumulateState | MicroStepState):
    raise TypeError(
      f"has_updated expects an AccumulateState, got {type(state).__name__}: pass the state"
      " returned by ga.accumulate(...).init/update, not the inner optimizer's state."
    )
  nnx = sys.modules.get("flax.nnx")  # nnx.Optimizer wraps the state's leaves
  if nnx is not None and isinstance(state.updated, nnx.Variable):
    return state.updated[...]
  return state.updated


class Closed(NamedTuple):
  """What closing a window gives its callers."""

  out: Any  # the new params, or (mode "cond") the updates
  state: AccumulateState  # after the window, its accumulator cleared or as it was
  grad_norm: jax.Array  # the norm of the window's mean gradient
  metrics: dict[str, jax.Array]  # what else the window reports (the noise scale's)


class _WeightedMean:
  """How a window is normalized by default: ``sum_i w_i g_i / sum_i w_i``, void (zero or non-finite
  total weight) kept out."""

  def window(self, acc_grads: Any, weight: jax.Array, count: jax.Array) -> tuple:
    """``(whether the window is nonempty, the sums, the normalizer)``."""
    del count
    nonempty = jnp.isfinite(weight) & (weight > 0)
    return nonempty, acc_grads, jnp.where(nonempty, weight, 0.0)


def _mean(acc_grads: Updates, weight: jax.Array, scale: Any, grad_like: Updates) -> Updates:
  """The window's mean gradient, typed as ``grad_like``; made at each use, which XLA fuses."""
  mean = mean_of(acc_grads, weight, scale)
  return jax.tree.map(lambda m, g: m.astype(jnp.result_type(g)), mean, grad_like)


def _inner_update(inner, mean_fn, mode, params, inner_state, extra_args) -> Callable[..., Any]:
  """``(params, inner_state) -> (updates, inner_state)``: ``inner`` on the window's mean."""
  made = None

  def update(params, inner_state):
    mean = mean_fn() if made is None else made
    return inner_update(inner, mean, inner_state, params, extra_args)

  # In place, an update with matrix products (muon's Newton-Schulz) reads a mean made once
  # before its branch; an elementwise one (adam) reads it fused (docs/benchmarks.md).
  if mode == "in_place" and has_matrix_products(update, params, inner_state):
    made = jax.lax.optimization_barrier(mean_fn())
  return update


def has_matrix_products(fn: Callable[..., Any], *args: Any) -> bool:
  """Whether ``fn(*args)`` computes a ``dot_general`` at any depth (traced, not run)."""

  def holds(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        return True
      for value in eqn.params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
          sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
          if hasattr(sub, "eqns") and holds(sub):
            return True
    return False

  return holds(jax.make_jaxpr(fn)(*args).jaxpr)


@dataclasses.dataclass(frozen=True, eq=False)
class Accumulator:
  """One ``accumulate`` transformation: its settings, ``init``, ``update``, ``flush`` and
  :meth:`close`, the one place that decides what a window does."""

  inner: optax.GradientTransformationExtraArgs
  num_microbatches: NumMicrobatches
  accum_dtype: Any
  skip_nonfinite: bool
  loss_scale: DynamicLossScale | None = None
  noise_scale_ema: float | None = None
  privacy: Any = None  # a _privacy.Privacy (ga.dp_accumulate), else None

  @property
  def normalizer(self) -> Any:
    """How a window's sums become its mean (:class:`_WeightedMean`, or DP's)."""
    return _WeightedMean() if self.privacy is None else self.privacy

  def init(self, params: Params) -> AccumulateState:
    state = AccumulateState(
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
    return on_the_params_mesh(state, params)

  def window_size(self, count: jax.Array) -> jax.Array | int:
    k = self.num_microbatches
    return k if isinstance(k, int) else jnp.maximum(check_scheduled_k(k(count)), 1)

  def check_state(self, state: Any) -> AccumulateState:
    """``state`` (any mode's, slots totalled), if it has every part this uses."""
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
    self, acc_grads: Updates, acc_weight: jax.Array, state: AccumulateState,
    params: Params | None, grad_like: Updates, extra_args: dict[str, Any], *,
    mode: str = "select", norm_by_rows: bool = False,
  ) -> Closed:  # fmt: skip
    """One inner update on the window's mean, kept out as ``mode`` (:data:`CLOSE_MODES`) says
    for a void window or (``skip_nonfinite``, loss scaling) a non-finite mean, counted in
    ``num_skipped``; ``norm_by_rows``: :func:`_parts.sq_norm`'s."""
    scale = None if state.loss_scale is None else state.loss_scale.scale
    nonempty, summed, weight = self.normalizer.window(acc_grads, acc_weight, state.count)
    mean_fn = functools.partial(_mean, summed, weight, scale, grad_like)  # at each use
    # One reduction gives the norm and the finiteness check (a norm > 1.8e19 counts non-finite).
    sq = jnp.where(nonempty, sq_norm(mean_fn(), norm_by_rows), 0.0)
    loss_scale = state.loss_scale
    if self.skip_nonfinite or self.loss_scale is not None:
      ok = nonempty & jnp.isfinite(sq)
      if self.loss_scale is not None:
        loss_scale = self.loss_scale.next(state.loss_scale, jnp.isfinite(sq), nonempty)
    else:  # True, but only after the norm: a flag known earlier made XLA copy acc_grads
      ok = nonempty & (sq != -1.0)

    inner = _inner_update(self.inner, mean_fn, mode, params, state.inner_state, extra_args)
    updates, inner_state, cleared = _CLOSERS[mode](ok, inner, acc_grads, params, state.inner_state)
    noise, metrics = after_window(
      state.noise_scale, self.noise_scale_ema, acc_grads, acc_weight, ok, scale
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
      noise_scale=noise,
    )
    return Closed(updates, new_state, jnp.sqrt(sq), metrics)

  def update(
    self, grads: Updates, state: AccumulateState, params: Params | None = None, *,
    weight: Any = None, **extra_args: Any,
  ) -> tuple[Updates, AccumulateState]:  # fmt: skip
    state = self.check_state(state)
    refuse_overwritten(grads, "grads", "tx.update")
    check_same_structure(grads, state.acc_grads, "grads")
    check_trainable(grads, "grads")
    weighted = weight is not None
    w = jnp.ones((), jnp.float32) if weight is None else check_weight(weight)
    noise = NoiseUnit(weighted)  # its sums held in the state
    if state.noise_scale is not None:
      sums = add_noise(noise.held(state), sq_norm(grads), None if weight is None else w, 1.0)
      state = noise.hold(state, sums)
    held = state._replace(
      micro_step=optax.safe_increment(state.micro_step),
      updated=jnp.zeros((), bool),
      acc_grads=add_gradients(state.acc_grads, grads, w, state.acc_weight, weighted),
      acc_weight=state.acc_weight + counted(w, weighted),
    )
    k = self.num_microbatches
    closes = (isinstance(k, int) and k == 1) or held.micro_step >= self.window_size(state.count)
    return _close_if(self, closes, held, params, grads if params is None else params, extra_args)

  def flush(
    self, state: AccumulateState, params: Params | None, extra_args: dict[str, Any]
  ) -> tuple[Updates, AccumulateState]:
    if self.privacy is not None:
      raise ValueError(
        "ga.flush: a DP transformation (ga.dp_accumulate) divides every window's noisy sum by"
        " expected_batch_size, so a window closed early would be a different mechanism than the"
        " one accounted for (docs/privacy.md). Let every window close at k micro-batches: with"
        " Poisson sampling pad a short batch (weight_fn 0) instead of flushing it."
      )
    state = self.check_state(state)
    held = state._replace(updated=jnp.zeros((), bool))
    grad_like = state.acc_grads if params is None else params
    return _close_if(self, state.micro_step > 0, held, params, grad_like, extra_args)


def _close_if(accumulator: Accumulator, closes, state, params, grad_like, extra_args):
  """``(updates, state)``: closed if ``closes``, in a ``lax.cond`` (reverse-differentiable)
  whose branches only read the accumulator; its zeros are written after."""

  def close(state):
    acc, weight = state.acc_grads, state.acc_weight
    closed = accumulator.close(acc, weight, state, params, grad_like, extra_args, mode="cond")
    return jnp.ones((), bool), closed.out, closed.state

  def hold(state):
    return jnp.zeros((), bool), zeros_like_output(close, state)[1], state

  if closes is True:
    closed, updates, state = close(state)
  else:
    closed, updates, state = jax.lax.cond(closes, close, hold, state)
  acc = jax.tree.map(lambda a: jnp.where(closed, jnp.zeros_like(a), a), state.acc_grads)
  return updates, state._replace(acc_grads=acc)


def _in_place(ok, inner, acc_grads, params, inner_state):
  """The new params and inner state over the donated old ones (:func:`apply_if`); the zeros a
  broadcast of its flag, written after the update has read the sums, in their buffer."""

  def run(carry):
    updates, state = inner(*carry)
    return _applied(carry[0], updates), state

  done, out = apply_if(ok, run, (params, inner_state), with_done=True)
  cleared = jax.tree.map(lambda a: jnp.broadcast_to(done.astype(a.dtype), a.shape), acc_grads)
  return *out, cleared


def _in_cond(ok, inner, acc_grads, params, inner_state, apply=False):
  """Updates or zeros (``apply``: the new or old params) and the inner state, in a ``lax.cond``."""

  def run(carry):
    updates, state = inner(*carry)
    return (_applied(carry[0], updates) if apply else updates), state

  def keep(carry):
    return (carry[0] if apply else zeros_like_output(inner, *carry)[0]), carry[1]

  return *jax.lax.cond(ok, run, keep, (params, inner_state)), acc_grads


def _in_selects(ok, inner, acc_grads, params, inner_state):
  """The new params (old for a voided window) and inner state by selects (undonated)."""
  updates, new_inner = inner(params, inner_state)
  new_params = _applied(params, updates)
  new_params = jax.tree.map(lambda p, new: jnp.where(ok, new, p), params, new_params)
  new_inner = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_inner, inner_state)
  return new_params, new_inner, jax.tree.map(jnp.zeros_like, acc_grads)


# How a window is closed, by the caller's layout (docs/architecture.md, "Closing a window").
_CLOSERS = {
  "select": _in_selects,
  "in_place": _in_place,
  "cond": _in_cond,
  "cond_apply": functools.partial(_in_cond, apply=True),
}
CLOSE_MODES = tuple(_CLOSERS)


def inner_update(inner, mean, inner_state, params, extra_args):
  """``inner.update`` on the window's mean gradient, with errors that say what ga passes."""
  extra_args = {k: (mean if v is MEAN_GRADIENT else v) for k, v in extra_args.items()}
  try:
    return inner.update(mean, inner_state, params, **extra_args)
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
        f"The inner optimizer needs extra arguments ({e}). ga.train_step and ga.micro_step pass"
        " the window's mean loss as value= and its mean gradient as grad=. In streaming mode"
        " pass them to every tx.update call, e.g. tx.update(g, state, params, value=mean_loss):"
        " under jit a call cannot know if it closes the window; the closing call's value is used."
      ) from e
    raise


def window_metrics(closed: Closed, loss: Any, aux: Any, weight: jax.Array, has_aux: bool,
                   scale: jax.Array | None) -> dict[str, Any]:  # fmt: skip
  """The metrics every mode reports for a window it closes (``"updated"`` aside)."""
  metrics = dict(loss=loss, grad_norm=closed.grad_norm, weight=weight)
  if has_aux:
    metrics["aux"] = aux
  if scale is not None:
    metrics["loss_scale"] = scale
  return metrics | closed.metrics


def _applied(params: Params, updates: Updates) -> Params:
  return jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, updates)


def zeros_like_output(fn: Any, *args: Any) -> Any:
  """Zeros shaped, typed and sharded as ``fn(*args)``'s output (traced, not run)."""
  return jax.tree.map(jnp.zeros_like, jax.eval_shape(fn, *args))


def apply_if(pred: jax.Array, fn: Any, carry: Any, *, with_done: bool = False) -> Any:
  """``fn(carry)`` if ``pred`` else ``carry``, in a ``lax.cond`` whose other branch passes the
  carry through (donated buffers updated in place); ``with_done``: also a False from both
  branches, which XLA does not know, to write zeros after it."""

  def run(c):
    return jnp.zeros((), bool), with_types_of(fn(c), c)

  def keep(c):
    return pred, c  # pred is False here

  out = jax.lax.cond(pred, run, keep, carry)
  return out if with_done else out[1]


# Stands for the window's mean gradient in the extra arguments the fused step gives ``close``.
MEAN_GRADIENT = object()


class Accumulate(optax.GradientTransformationExtraArgs):
  """What :func:`accumulate` returns: an ``optax.GradientTransformationExtraArgs`` with its
  settings as attributes (``num_microbatches``, ``inner``, ``accum_dtype``, ...)."""

  # A NamedTuple (init, update), as optax's; the settings ride beside its two fields (in copies,
  # pickles and pytrees too: they are its node's data).
  settings: Accumulator

  def __new__(cls, init: Any, update: Any, settings: Accumulator) -> Accumulate:
    tx = super().__new__(cls, init, update)
    tx.settings = settings
    return tx

  def __getnewargs__(self) -> tuple[Any, Any, Accumulator]:
    return (self.init, self.update, self.settings)

  num_microbatches = property(lambda self: self.settings.num_microbatches)
  inner = property(lambda self: self.settings.inner)
  accum_dtype = property(lambda self: self.settings.accum_dtype)
  skip_nonfinite = property(lambda self: self.settings.skip_nonfinite)
  loss_scale = property(lambda self: self.settings.loss_scale)
  noise_scale_ema = property(lambda self: self.settings.noise_scale_ema)
  privacy = property(lambda self: self.settings.privacy)

  def fixed_num_microbatches(self, where: str) -> int:
    return check_num_microbatches(self.num_microbatches, allow_schedule=False, where=where)


jax.tree_util.register_pytree_node(
  Accumulate, lambda tx: ((tx.init, tx.update), tx.settings), lambda s, c: Accumulate(*c, s)
)


def accumulate(
  inner: optax.GradientTransformation,
  num_microbatches: NumMicrobatches | None = None,
  *,
  accum_dtype: Any = jnp.float32,
  skip_nonfinite: bool = True,
  loss_scale: DynamicLossScale | None = None,
  noise_scale_ema: float | None = None,
  **unexpected: Any,
) -> Accumulate:
  r"""Accumulates gradients over ``num_microbatches`` calls, then applies ``inner`` once.

  Each ``update`` adds a micro-batch gradient :math:`g_i` of weight :math:`w_i` (``weight=``,
  e.g. its tokens; 1 by default); the ``k``-th applies ``inner`` once to
  :math:`G = \sum_i w_i g_i / \sum_i w_i`, the others return zero updates. Put clipping,
  schedules and weight decay inside ``inner``: they see ``G`` and count windows
  (docs/semantics.md).

  Args:
    inner: the optimizer applied once per window.
    num_microbatches: ``k``, or (streaming only) a schedule ``count -> k``.
    accum_dtype: the accumulator's dtype (float32; None: the gradients'); narrower floats keep
      the running weighted mean.
    skip_nonfinite: void a window whose mean gradient is not finite (a zero total weight always
      voids it): zero updates, inner state kept, ``num_skipped`` counted.
    loss_scale: a :class:`DynamicLossScale` for float16, or None.
    noise_scale_ema: the decay of the gradient noise scale's averages (:func:`noise_scale`).

  Returns:
    An :class:`Accumulate` whose state is an :class:`AccumulateState`; ``update(grads, state,
    params=None, *, weight=None, **extra_args)`` passes ``extra_args`` to ``inner``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> tx = ga.accumulate(optax.sgd(1.0), num_microbatches=2)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> _, state = tx.update(jnp.array([1.0, 1.0]), state, weight=1.0)
    >>> updates, state = tx.update(jnp.array([4.0, 4.0]), state, weight=3.0)
    >>> updates, int(state.count)  # -(1*1 + 3*4) / (1 + 3)
    (Array([-3.25, -3.25], dtype=float32), 1)
  """
  check_migrated(unexpected)
  if isinstance(inner, optax.MultiSteps):
    raise TypeError(
      "inner is an optax.MultiSteps, which accumulates by itself: pass the optimizer it wraps,"
      " optax.MultiSteps(opt, every_k_schedule=k) becomes ga.accumulate(opt, num_microbatches=k)."
    )
  k = check_num_microbatches(num_microbatches, allow_schedule=True)
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation, got {type(inner).__name__}.")
  accum_dtype = None if accum_dtype is None else jnp.dtype(accum_dtype)
  if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
    raise TypeError(f"loss_scale must be a ga.DynamicLossScale or None, got {loss_scale!r}.")
  if noise_scale_ema is not None:
    example = "0.99; 0 keeps only the last window"
    noise_scale_ema = check_decay(noise_scale_ema, "noise_scale_ema", example)
  acc = Accumulator(
    inner=optax.with_extra_args_support(inner),
    num_microbatches=k,
    accum_dtype=accum_dtype,
    skip_nonfinite=bool(skip_nonfinite),
    loss_scale=loss_scale,
    noise_scale_ema=noise_scale_ema,
  )
  return Accumulate(acc.init, acc.update, acc)


def as_accumulate(tx: Any, what: str = "tx") -> Accumulate:
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
  r"""Closes the open window now, with the ``m < k`` micro-batches accumulated so far.

  For the end of an epoch: ``inner`` is applied once to their weighted mean; an empty window
  changes nothing. Jit-able.

  Args:
    tx: made by :func:`accumulate`; state: its state (any mode's).
    params: for ``inner``, as in ``tx.update``, with any ``extra_args`` keywords.

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
