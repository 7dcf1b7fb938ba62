"""Streaming accumulation: one jitted call per micro-batch, one reduction per window."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax._accumulate import (
  MEAN_GRADIENT,
  Accumulate,
  AccumulateState,
  MicroStepState,
  as_accumulate,
  slot_totals,
  window_metrics,
  zeros_like_output,
)
from gradaccum_jax._checks import (
  check_batch,
  check_trainable,
  is_inexact,
)
from gradaccum_jax._equivalence import HOW, CheckWindow, copies, host_arguments
from gradaccum_jax._microbatch import Core, Objective, microbatch
from gradaccum_jax._options import Config, takes
from gradaccum_jax._parts import (
  Inputs,
  Micro,
  Static,
  keep_if_voided,
  over_slots,
  refuse_overwritten,
  window_means,
)
from gradaccum_jax._sharding import Devices, Slots, place_params


def _held(units: dict, state: MicroStepState) -> dict:
  """The open window's parts in ``state``, by unit name (``unit.held``)."""
  return {name: unit.held(state) for name, unit in units.items()}


def _holding(units: dict, state: MicroStepState, parts: dict) -> MicroStepState:
  """``state`` holding ``parts`` as its open window's (``unit.hold``)."""
  for name, unit in units.items():
    state = unit.hold(state, parts[name])
  return state


class MicroStepLayout:
  """How a :class:`MicroStep` lays out its state: any mode's state checked and moved into it
  (on a mesh, the sums in device slots: ``_sharding.Slots``), the aux sums made."""

  def __init__(self, acc: Any, config: Config, slots: Slots, units: Callable[[Any], dict]):
    self._acc, self._loss, self.slots, self._units = acc, config.loss, slots, units
    self._reducers = config.loss.aux

  def check(self, state: Any) -> MicroStepState:
    if isinstance(state, AccumulateState):
      state = MicroStepState(state, jnp.zeros((), jnp.float32))
    if not isinstance(state, MicroStepState):
      raise TypeError(
        "state must be tx.init(params), step.init(params) or the state a ga step returned,"
        f" got {type(state).__name__}."
      )
    self._acc.check_state(state.accumulate)
    return state

  def place(self, state, params, microbatch, model_state, rng) -> MicroStepState:
    """``state`` (any mode's, from any mesh) in this layout: saved device slots totalled into
    the first slot, the aux sums and registered units' parts made where the state has none."""
    state = self.check(state)
    acc = state.accumulate.acc_grads
    registered = {n: u for n, u in self._units(acc).items() if n not in ("sums", "noise")}
    if (self._loss.has_aux and state.aux_sum is None) or (registered and state.parts is None):
      key = None if rng is None else jax.random.key(0)
      loss, aux, _ = jax.eval_shape(self._loss.call, params, model_state, microbatch, key)
      if self._loss.has_aux and state.aux_sum is None:
        state = state._replace(aux_sum=self._reducers.init(aux))
      if registered and state.parts is None:  # empty, as a window starts them
        like = Micro(loss, aux, acc, jnp.zeros((), jnp.float32), model_state)
        state = state._replace(parts={n: u.init(acc, like) for n, u in registered.items()})
    weight = state.accumulate.acc_weight
    slots = jnp.shape(weight)[0] if jnp.ndim(weight) else None
    if slots == (None if self.slots.dp is None else self.slots.devices):
      return state
    units = self._units(state.accumulate.acc_grads)
    parts = _held(units, state)
    if slots is not None:  # saved slots combined
      parts = over_slots(units, parts)
    return _holding(units, state, self.slots.first(units, parts, params, self._reducers))

  def convert(self, state: Any, like: MicroStepState) -> MicroStepState:
    """``state`` in the layout of ``like`` (:meth:`MicroStep.convert_state`)."""
    state = self.check(state)
    saved, mine = (jax.tree.structure(slot_totals(t).acc_grads) for t in (state, like))
    if saved != mine:
      raise ValueError(
        "convert_state: the saved state's accumulator does not match this step's:\n"
        f"  saved: {saved}\n  this step: {mine}"
      )
    if (state.accumulate.noise_scale is None) != (like.accumulate.noise_scale is None):
      raise ValueError("convert_state: the saved state and this step differ in noise_scale.")
    if state.aux_sum is None and like.aux_sum is not None:  # empty, shaped as one slot
      one = like.aux_sum if self.slots.dp is None else jax.tree.map(lambda x: x[0], like.aux_sum)
      state = state._replace(aux_sum=self._reducers.init(one))
    if state.parts is None and like.parts is not None:  # empty, shaped as one slot
      one = like.parts if self.slots.dp is None else jax.tree.map(lambda x: x[0], like.parts)
      units = self._units(like.accumulate.acc_grads)
      state = state._replace(parts={n: units[n].empty(p) for n, p in one.items()})
    return self.place(state, slot_totals(like).acc_grads, None, None, None)


class MicroStep:
  """What :func:`micro_step` returns: call it once per micro-batch; ``init`` makes its state."""

  def __init__(self, config: Config, tx: Accumulate, *, donate: bool, jit: bool):
    self.tx, self._acc, self._config = tx, tx.settings, config
    dp = config.mesh
    self._slots = Slots(dp)
    self._core = Core.make(config, 1, self._acc)
    units = self._core.held_units  # of the open window's parts (acc_grads -> units)
    self._layout = MicroStepLayout(self._acc, config, self._slots, units)
    self.mesh = None if dp is None else dp.mesh
    self.data_axis = None if dp is None else dp.axes
    self.has_state = config.loss.has_state
    donate_argnums = ((0, 1, 2) if self.has_state else (0, 1)) if donate else ()
    fn = self._call_with_state if self.has_state else self._call
    self._fn = jax.jit(fn, donate_argnums=donate_argnums) if jit else fn
    # Donated, the closing branch writes the params over the donated ones.
    self._end = CallEnd(self._acc, self._slots, config, donate and jit, units)

  def init(
    self, params: Any, microbatch: Any = None, model_state: Any = None, rng: Any = None
  ) -> MicroStepState:
    """The empty state in this step's layout (``tx.init(params)`` will do, at one compile more)."""
    if self._config.loss.has_aux and microbatch is None:
      raise ValueError(
        "micro_step(..., has_aux=True): pass a micro-batch to init, step.init(params,"
        " microbatch) (ShapeDtypeStructs will do), so the aux sums get their shapes."
      )
    state = self._layout.place(self._acc.init(params), params, microbatch, model_state, rng)
    if self.has_state and model_state is not None:
      state = state._replace(window_start=jax.tree.map(jnp.copy, model_state))
    return state

  def to_accumulate_state(self, state: MicroStepState) -> AccumulateState:
    """The state as ``tx.init`` lays it out: the device slots summed (the open window's loss
    and aux sums dropped), as ``tx.update``, :func:`train_step` and :func:`flush` take it."""
    return slot_totals(self._layout.check(state))

  def convert_state(self, state: Any, like: MicroStepState) -> MicroStepState:
    """``state`` (any mode's, from any mesh or none) in the layout of ``like``
    (``step.init(params)``), as the step's first call would move it: the saved slots totalled
    into the first slot (exact)."""
    return self._layout.convert(state, like)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self._fn(*args, **kwargs)

  def check_window(self, step, loss_fn, params, state, batch) -> CheckWindow:
    """One window on the ``k`` micro-batches of ``batch`` (``ga.check_step``)."""
    if self.has_state:
      raise ValueError(
        "check_step runs a ga.micro_step as step(params, state, microbatch), and compares it with"
        " a loss without model state; this one has has_state=True. Check the same loss with"
        " ga.micro_step(..., has_state=False) (model state fixed, e.g. BatchNorm in eval mode)."
      )
    if batch is None:
      raise TypeError(f"batch is missing: {HOW}")
    host = host_arguments(params, state, batch)
    k = self.tx.num_microbatches
    k = k if isinstance(k, int) else max(int(k(np.asarray(state.count))), 1)
    check_batch(batch, k)
    new, new_state, metrics = copies((params, state)) + (None,)
    for i in range(k):
      new, new_state, metrics = self(new, new_state, microbatch(batch, i, k))
    return CheckWindow.after(host, loss_fn, new, new_state, metrics)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """The jitted call's ``lower`` (for compiled memory and HLO)."""
    return self._fn.lower(*args, **kwargs)

  def _call(self, params, state, microbatch, rng=None):
    new_params, _, new_state, metrics = self._step(params, None, state, microbatch, rng)
    return new_params, new_state, metrics

  def _call_with_state(self, params, model_state, state, microbatch, rng=None):
    return self._step(params, model_state, state, microbatch, rng)

  def _step(self, params, model_state, state, microbatch, rng):
    check_trainable(params, where="micro_step")
    refuse_overwritten(params, "params", "micro_step")
    state = self._layout.place(state, params, microbatch, model_state, rng)
    acc_state, slots = state.accumulate, self._slots
    slots.check_rows(check_batch(microbatch, 1))
    scale = None if acc_state.loss_scale is None else acc_state.loss_scale.scale
    if self.has_state:  # the model state a voided window restores: as the window found it
      saved = model_state if state.window_start is None else state.window_start
      start = keep_if_voided(acc_state.micro_step == 0, model_state, saved)  # its float leaves
      state = state._replace(window_start=start)
    units = self._end.units(state.accumulate.acc_grads)
    own = _held(units, state)
    inputs = Inputs(params, microbatch, rng, model_state, scale)
    new, (new_model_state, static) = slots.local(self._local, inputs, own)
    like, in_place = static.value
    # Added to the slots outside the shard_map: added inside, XLA:CPU fused the add into the
    # select that clears the slots after the lax.cond, then copied them (tests/test_memory.py).
    parts = {n: u.merge(own[n], new[n]) for n, u in units.items()}  # by each's rule
    if in_place:  # the micro-batch's gradient was added into the accumulator itself
      parts["sums"] = parts["sums"]._replace(grads=new["sums"].grads)
    state = _holding(units, state, parts)
    return self._end(params, new_model_state, state, like)

  def _local(self, inputs: Inputs, own: tuple, axes: tuple):
    """The micro-batch's parts, a device's shares shaped as ``own`` (a slot's, the sums first),
    the new model state and a ``Static((loss and aux shapes, whether the gradient was added
    into the accumulator))``."""

    # Donated, without a mesh, where it can, the backward pass adds into the state's accumulator
    # in its buffer (undonated that buffer is copied first: 0.37 A more than the carried path on
    # the LM of tests/test_memory.py); otherwise the micro-batch's sums start from zeros.
    def loss():  # traced only for a weighted step
      p, mb, rng, model_state, _, _ = inputs
      objective = Objective(self._config.loss, self._config.precision, "micro_step")
      return jax.eval_shape(lambda: objective(p, model_state, mb, rng, None)[1][0])

    grads = own["sums"].grads
    units = self._core.units(inputs.model_state, grads)
    why = self._core.carried_because(inputs.params, grads, units, None, loss)
    why = "streaming" if why is None and not (self._end.donated and not axes) else why
    acc = grads if why is None else jax.tree.map(jnp.zeros_like, grads)
    w = self._core.window(inputs, acc, devices=Devices(axes), carried=why, units=units)
    # Each device's share (unweighted, its micro-batch weighs 1 / D): the slots add up to the
    # window; the other parts (the model state) reduced over the devices, not kept in slots.
    devices, held = self._slots.devices, set(own)
    shares = {n: units[n].share(w.parts[n], devices) for n in held}
    rest = {n: p for n, p in w.parts.items() if n not in held}
    rest = Devices(axes).reduce({n: units[n] for n in rest}, rest)
    return shares, (rest.get("model_state"), Static.shapes((w.loss_like, w.aux_like), why is None))


@dataclasses.dataclass(frozen=True)
class CallEnd:
  """How a :class:`MicroStep` call ends: the window closed if this micro-batch completes it,
  else held (``donated``: params and state are donated)."""

  acc: Any  # the Accumulator
  slots: Slots
  config: Config
  donated: bool
  units: Callable[[Any], dict]  # acc_grads -> the open window's units (summed_units)

  def __call__(self, params, new_model_state, state, like):
    """``(new params, model state, state, metrics)``, the partial sums cleared where it closed;
    ``like``: one micro-batch's loss and aux (for the means' dtypes)."""
    # Held unless the window closes, in a lax.cond (reverse-differentiable) whose branches
    # only read the partial sums; they are cleared after it, in place (as in _close_if).
    # Donated, the closing branch writes the new params over the old ones (the plain step's
    # memory); else it returns updates, applied after the lax.cond as tx.update's are (the
    # new params in the branch's outputs then hold 0.7 A more on the LM: tests/test_memory.py).
    acc, donated = self.acc, self.donated
    mode = "cond_apply" if donated else "cond"
    emit = state.accumulate.micro_step + 1 >= acc.window_size(state.accumulate.count)

    units = self.units(state.accumulate.acc_grads)

    def close(params, new_model_state, state):
      return jnp.ones((), bool), *self.close(mode, units, params, new_model_state, state, like)

    def hold(params, new_model_state, state):  # the params or zero updates, the sums, NaNs
      closed, _, _, _, metrics = zeros_like_output(close, params, new_model_state, state)
      kept = params if donated else jax.tree.map(jnp.zeros_like, params)  # typed as params
      acc_state = state.accumulate
      acc_state = acc_state._replace(
        micro_step=optax.safe_increment(acc_state.micro_step), updated=closed
      )
      nan = jax.tree.map(lambda m: m if not is_inexact(m) else jnp.full_like(m, jnp.nan), metrics)
      return closed, kept, new_model_state, state._replace(accumulate=acc_state), nan

    closed, out, new_model_state, state, metrics = jax.lax.cond(
      emit, close, hold, params, new_model_state, state
    )
    own = _held(units, state)
    start = {n: u.empty(own[n]) for n, u in units.items()}
    empty = jax.tree.map(lambda x, e: jnp.where(closed, e, x), own, start)
    new_params = place_params(self.slots.dp, out if donated else optax.apply_updates(params, out))
    # The counters' metrics read after the branch: with them among its outputs too, XLA:CPU
    # copied adam's mu and nu in the branch that holds (2 A more; tests/test_memory.py).
    acc_state = state.accumulate
    metrics = {**metrics, "updated": acc_state.updated, "micro_step": acc_state.micro_step}
    return new_params, new_model_state, _holding(units, state, empty), metrics

  def close(self, mode, units, params, new_model_state, state, like):
    """The call that closes the window: the slots reduced, one inner update
    (:data:`CLOSE_MODES` ``mode``: "cond_apply" applies it, donated), the metrics."""
    own = _held(units, state)
    totals = self.slots.reduce(params, units, own)
    acc_state = _holding(units, state, totals).accumulate  # the window's (its noise sums)
    sums = totals["sums"]
    loss, aux = window_means(sums, *like, self.config.loss.aux)
    extra = {"value": loss, "grad": MEAN_GRADIENT}
    closed = self.acc.close(sums.grads, sums.weight, acc_state, params, params, extra, mode=mode)
    # The partial sums as they were: the caller clears them after its lax.cond.
    new_state = _holding(units, state._replace(accumulate=closed.state), own)
    scale = None if acc_state.loss_scale is None else acc_state.loss_scale.scale
    metrics = window_metrics(closed, loss, aux, sums.weight, self.config.loss.has_aux, scale)
    for name, unit in units.items():  # what registered units report
      metrics.update(unit.metrics(totals[name]))
    if state.window_start is not None:  # a voided window restores float state as it found it
      new_model_state = keep_if_voided(closed.state.updated, new_model_state, state.window_start)
    return closed.out, new_model_state, new_state, metrics


@takes("has_aux", "weight_fn", "has_state", "mesh", "data_axis", "param_specs", "grads_in_place",
       "aux_reduce")  # fmt: skip
def micro_step(
  loss_fn: Callable[..., Any], tx: Accumulate, *, donate: bool = False, jit: bool = True,
  **options: Any,
) -> MicroStep:  # fmt: skip
  r"""A jitted step per micro-batch: ``k`` calls are one :func:`train_step` window.

  For a data loader that yields micro-batches: ``step(params, state, microbatch, rng=None)``
  adds its :math:`w_i g_i` and :math:`w_i L_i` to the sums in ``state`` (any mode's); the call
  that completes the window of ``tx`` applies ``inner`` once to :math:`G = \sum_i w_i g_i /
  \sum_i w_i` in a ``lax.cond``. With ``mesh`` each device adds to its own slot, reduced once
  per window (docs/data_parallel.md).

  Args:
    loss_fn: as in :func:`train_step`.
    tx: made by :func:`accumulate` (``num_microbatches`` may be a schedule).
    donate, jit: donate ``params``, ``state`` (and ``model_state``); jit the step.

  Returns:
    A :class:`MicroStep`, ``step(params, state, microbatch, rng=None) -> (params, state,
    metrics)`` with a ``MicroStepState``; ``metrics``: ``"updated"``, ``"micro_step"``, and for
    the closing call ``"loss"``, ``"grad_norm"``, ``"weight"`` (NaN on the others).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> loss_fn = lambda w, mb: jnp.mean((mb["x"] @ w - mb["y"]) ** 2)
    >>> tx = ga.accumulate(optax.sgd(0.1), num_microbatches=2)
    >>> step, params = ga.micro_step(loss_fn, tx), jnp.zeros(3)
    >>> state = tx.init(params)
    >>> for i in range(2):
    ...   mb = {"x": jnp.ones((4, 3)), "y": jnp.full(4, 1.0 + i)}
    ...   params, state, metrics = step(params, state, mb)
    >>> bool(metrics["updated"]), float(metrics["loss"])  # the mean of 1 and 4
    (True, 2.5)
  """
  tx = as_accumulate(tx)
  config = Config.make("micro_step", loss_fn, **options)
  return MicroStep(config, tx, donate=bool(donate), jit=bool(jit))
