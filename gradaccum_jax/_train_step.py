"""The fused entry points: a whole window in one program (``train_step``), or its loss and
gradient (``value_and_grad``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._accumulate import (
  MEAN_GRADIENT,
  Accumulate,
  AccumulateState,
  apply_if,
  as_accumulate,
  window_metrics,
)
from gradaccum_jax._checks import (
  check_num_microbatches,
  check_real_microbatches,
  check_same_structure,
)
from gradaccum_jax._memory import gathered
from gradaccum_jax._microbatch import Core
from gradaccum_jax._options import OPTIONS, Config, takes
from gradaccum_jax._parts import (
  Inputs,
  keep_if_voided,
  keeps_running_means,
  mean_of,
  merge_gradients,
  overwritten,
  zeros_accumulator,
)
from gradaccum_jax._sharding import place_params


@takes(*OPTIONS)
def train_step(
  loss_fn: Callable[..., Any], tx: optax.GradientTransformationExtraArgs, *, donate: bool = False,
  jit: bool = True, **options: Any,
) -> Callable[..., tuple[optax.Params, AccumulateState, dict[str, Any]]]:  # fmt: skip
  r"""A jitted step that accumulates a whole window and updates the params once.

  ``step(params, state, batch, rng=None)`` scans the ``k`` micro-batches of ``tx =
  ga.accumulate(inner, k)`` (rows ``i, i + k, ...``) into ``state``'s accumulator and applies
  ``inner`` once to :math:`G = \sum_i w_i g_i / \sum_i w_i`, in one XLA program that holds one
  micro-batch's activations; ``state`` may be any mode's (docs/usage.md).

  Args:
    loss_fn: ``loss_fn(params, microbatch[, rng])``, the micro-batch's mean loss (a dict of
      them: terms, docs/usage.md).
    tx: made by :func:`accumulate` with an int ``num_microbatches``.
    donate: donate ``params`` and ``state`` (the update writes over them).
    jit: return the step jitted (default), or traceable.

  Returns:
    ``step(params, state, batch, rng=None, *, num_real_microbatches=None) -> (params, state,
    metrics)``; ``metrics``: ``"loss"``, ``"grad_norm"``, ``"weight"``, ``"updated"``, and
    ``"aux"``, noise-scale estimates, ``"window_stats"``, ``"term_weights"`` where on.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> loss_fn = lambda w, batch: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> tx = ga.accumulate(optax.adam(1e-2), num_microbatches=4)
    >>> params, batch = jnp.zeros(3), {"x": jnp.ones((32, 3)), "y": jnp.ones(32)}
    >>> params, state, metrics = ga.train_step(loss_fn, tx)(params, tx.init(params), batch)
    >>> float(metrics["loss"]), int(state.count)
    (1.0, 1)
  """
  acc = as_accumulate(tx)
  k = acc.fixed_num_microbatches("train_step")
  has_state = bool(options.get("has_state"))

  def build(config: Config, jit: bool = True):
    fused = fused_step(config, acc, donated=donate and jit)

    def step_with_state(params, model_state, state, batch, rng=None, *, num_real_microbatches=None):
      return fused(params, model_state, state, batch, rng, num_real_microbatches)

    def step(params, state, batch, rng=None, *, num_real_microbatches=None):
      params, _, state, metrics = fused(params, None, state, batch, rng, num_real_microbatches)
      return params, state, metrics

    step = step_with_state if has_state else step
    if not jit:
      return step
    donated = tuple(range(3 if has_state else 2)) if donate else ()
    return JitStep(jax.jit(step, donate_argnums=donated), lambda args: k)

  return gathered(build, Config.make("train_step", loss_fn, **options), jit)


class JitStep:
  """A jitted step that checks ``num_real_microbatches`` and passes it as int32, so ints and arrays
  of every value share one program; the rest (``lower``, ...) is the jitted function's."""

  def __init__(self, jitted: Callable[..., Any], k: Callable[..., int], calls_compiled=True):
    self._jitted, self._k, self.calls_compiled = jitted, k, calls_compiled

  def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The checked ``num_real_microbatches`` of a call's ``kwargs``."""
    num_real = kwargs.get("num_real_microbatches")
    return None if num_real is None else check_real_microbatches(num_real, self._k(args))

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    kwargs["num_real_microbatches"] = self.check(args, kwargs)
    return self._jitted(*args, **kwargs)

  def num_microbatches(self, args: tuple[Any, ...]) -> int:
    """``k`` of the transformation a call with ``args`` passes."""
    return self._k(args)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._jitted, name)


def fused_step(config: Config, tx: Accumulate, donated: bool = False) -> Callable[..., Any]:
  """``fused(params, model_state, state, batch, rng, num_real) -> (params, model_state, state,
  metrics)``: one window, scanned and closed; ``donated``: params and state are donated."""
  acc = tx.settings
  k = tx.fixed_num_microbatches(config.where)
  core = Core.make(config, k, acc)
  dp = config.mesh

  def fused(params, model_state, state, batch, rng, num_real):
    state = acc.check_state(state)
    # Params partly overwritten (fp8 variables): the optimizer trains the rest, as Flax's
    # TrainState trains the variables' "params" collection
    ov = overwritten(params, config.where)
    trained, kept = (params, None) if ov is None else ov.split(params)
    check_same_structure(trained, state.acc_grads, "params" if ov is None else "the trained params")
    num_real = check_real_microbatches(num_real, k)
    scale = None if state.loss_scale is None else state.loss_scale.scale
    # The scan adds onto the state's accumulator (zeros, or a streaming window's sums), in its
    # buffer when donated, so a window holds one accumulator. A running mean restarts from 0.
    seeded = not keeps_running_means(state.acc_grads)
    init = state.acc_grads if seeded else jax.tree.map(jnp.zeros_like, state.acc_grads)
    window = core.sums(Inputs(params, batch, rng, model_state, scale, num_real), init, seeded, ov)
    sums = window.sums
    if seeded:  # close writes the new zeros (donated: over the sums, after the update)
      acc_grads, cleared = sums.grads, None
    else:
      acc_grads, cleared = merge_open_window(state, sums.grads, sums.weight, donated)
    weight = state.acc_weight + sums.weight
    for name, unit in core.summed_units(init).items():  # other open sums (the noise scale's)
      if name != "sums":
        state = unit.hold(state, unit.merge(unit.held(state), window.parts[name]))
    loss, aux, terms = window.means()
    extra = {"value": loss, "grad": MEAN_GRADIENT}
    mode = "in_place" if donated else "select"
    closed = acc.close(
      acc_grads, weight, state, trained, trained, extra, mode=mode, norm_by_rows=dp is None
    )
    new_state = closed.state

    def placed(tree):  # as the trained params are sharded
      if ov is None:
        return place_params(dp, tree)
      return ov.split(place_params(dp, ov.join(params, tree, kept)))[0]

    cleared = new_state.acc_grads if cleared is None else cleared
    new_state = new_state._replace(acc_grads=placed(cleared))
    new_params = placed(closed.out)
    if ov is not None:  # written over the old values once per window, kept if it is voided
      new_params = ov.join(
        params, new_params, keep_if_voided(new_state.updated, window.overwrite, kept)
      )
    # A voided window restores float model state (statistics), counters advance; None stays None.
    new_model_state = keep_if_voided(new_state.updated, window.model_state, model_state)
    metrics = window_metrics(closed, loss, aux, sums.weight, config.loss.has_aux, scale)
    metrics.update(terms, **(window.before or {}), **core.metrics(window))
    return new_params, new_model_state, new_state, dict(metrics, updated=new_state.updated)

  return fused


def merge_open_window(
  state: AccumulateState, grads: Any, weight: jax.Array, donated: bool
) -> tuple[Any, Any]:
  """``(grads plus the sums of a window left open by streaming calls, the new accumulator's
  zeros)``."""
  if not donated:
    merged = merge_gradients(state.acc_grads, state.acc_weight, grads, weight)
    return merged, jax.tree.map(jnp.zeros_like, state.acc_grads)
  is_open = state.micro_step > 0

  def merge(carry):
    grads, acc = carry
    merged = merge_gradients(acc, state.acc_weight, grads, weight)
    # A select XLA cannot fold (``is_open`` holds here), so the zeros are written over ``acc``
    # after the merge reads it; plain zeros made XLA copy it first (tests/test_program.py).
    return merged, jax.tree.map(lambda m: jnp.where(is_open, jnp.zeros_like(m), m), merged)

  return apply_if(is_open, merge, (grads, state.acc_grads))


@takes(*(n for n in OPTIONS if n != "memory_budget_bytes"))
def value_and_grad(
  loss_fn: Callable[..., Any], num_microbatches: int, *, accum_dtype: Any = jnp.float32,
  **options: Any,
) -> Callable[..., Any]:  # fmt: skip
  r"""Like ``jax.value_and_grad`` over a whole batch, computed one micro-batch at a time.

  A ``lax.scan`` over the ``k`` micro-batches of :func:`microbatch` sums their weighted losses
  and gradients, holding one micro-batch's activations: :math:`L = \sum_i w_i L_i / \sum_i w_i`
  and :math:`G = \sum_i w_i \nabla L_i / \sum_i w_i` (``w_i`` 1, or ``weight_fn``'s).

  Args:
    loss_fn: ``loss_fn(params, microbatch[, rng])``, the micro-batch's mean loss.
    num_microbatches: ``k``, a positive int that divides the batch size.
    accum_dtype: the accumulator's dtype (float32; ``None``: the gradients').

  Returns:
    ``(params, batch, rng=None, *, num_real_microbatches=None) -> (loss, grads)``, shaped as
    ``jax.value_and_grad``'s with ``has_aux``; with ``has_state``, ``model_state`` after
    ``params`` and ``(loss, new_model_state)``. Call it under jit.

  Examples:
    >>> import jax, jax.numpy as jnp, gradaccum_jax as ga
    >>> loss_fn = lambda w, batch: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> batch = {"x": jnp.arange(16.0).reshape(8, 2) / 8, "y": jnp.ones(8)}
    >>> w = jnp.array([0.5, -0.5])
    >>> loss, grads = ga.value_and_grad(loss_fn, num_microbatches=4)(w, batch)
    >>> ref_loss, ref_grads = jax.value_and_grad(loss_fn)(w, batch)
    >>> bool(jnp.allclose(loss, ref_loss)), bool(jnp.allclose(grads, ref_grads))
    (True, True)
  """
  k = check_num_microbatches(num_microbatches, allow_schedule=False)
  accum_dtype = None if accum_dtype is None else jnp.dtype(accum_dtype)
  for name, instead in (("gather_params", "'once' or 'per_microbatch'"), ("unroll", "an int")):
    if isinstance(options.get(name), str) and options[name] == "auto":
      raise ValueError(
        f"value_and_grad: {name}='auto' compiles each candidate, which needs the jitted step of"
        f" ga.train_step; pass {instead}."
      )
  config = Config.make("value_and_grad", loss_fn, **options)
  core = Core.make(config, k)

  def vg_state(params, model_state, batch, rng=None, *, num_real_microbatches=None):
    num_real = check_real_microbatches(num_real_microbatches, k)
    # params partly overwritten (fp8): that part's "gradient" is its window's new value
    ov = overwritten(params, "value_and_grad")
    trained = params if ov is None else ov.split(params)[0]
    inputs = Inputs(params, batch, rng, model_state, None, num_real)
    w = core.sums(inputs, zeros_accumulator(trained, accum_dtype), overwrite=ov)
    mean = mean_of(w.sums.grads, w.sums.weight)
    grads = jax.tree.map(lambda a, p: a.astype(jnp.result_type(p)), mean, trained)
    grads = grads if ov is None else ov.join(params, grads, w.overwrite)
    loss, aux, _ = w.means()
    return config.loss.pack(loss, aux, w.model_state), grads

  def vg(params, batch, rng=None, *, num_real_microbatches=None):
    return vg_state(params, None, batch, rng, num_real_microbatches=num_real_microbatches)

  return vg_state if config.loss.has_state else vg
