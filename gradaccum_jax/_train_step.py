"""The fused step: scan the micro-batches, then close the window once, in one jitted program."""

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
  check_real_microbatches,
  check_same_structure,
)
from gradaccum_jax._memory import gathered
from gradaccum_jax._microbatch import MicrobatchedGrad
from gradaccum_jax._options import Options, make_options
from gradaccum_jax._parts import (
  Inputs,
  keep_if_voided,
  keeps_running_means,
  merge_gradients,
  overwritten,
)
from gradaccum_jax._sharding import place_params


def train_step(
  loss_fn: Callable[..., Any],
  tx: optax.GradientTransformationExtraArgs,
  *,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  donate: bool = False,
  jit: bool = True,
  has_state: bool = False,
  batchnorm: str = "sequential",
  batchnorm_momentum: float | None = None,
  compute_dtype: Any = None,
  mesh: Any = None,
  data_axis: str | tuple[str, ...] | None = None,
  param_specs: Any = None,
  gather_params: str = "once",
  memory_budget_bytes: int | None = None,
  grads_in_place: bool = True,
  aux_reduce: Any = None,
  window_stats: Callable[..., Any] | None = None,
  window_stats_reduce: Any = None,
  unroll: int | str = 1,
) -> Callable[..., tuple[optax.Params, AccumulateState, dict[str, Any]]]:
  r"""A jitted step that accumulates a whole window and updates the params once.

  ``step(params, state, batch, rng=None)`` splits ``batch`` into the ``k`` micro-batches of
  ``tx = ga.accumulate(inner, k)`` (rows ``i, i + k, ...``), scans their weighted gradients into
  ``state``'s fp32 accumulator and closes the window as the ``k``-th ``tx.update`` would: one
  ``inner`` update on :math:`G = \sum_i w_i g_i / \sum_i w_i`, in one XLA program holding one
  micro-batch's activations; ``state`` may be any mode's. Meshes: docs/data_parallel.md.

  Args:
    loss_fn, has_aux, has_state: as in :func:`value_and_grad`; with ``has_state`` the step
      takes and returns ``model_state`` after ``params``.
    tx: made by :func:`accumulate` with an int ``num_microbatches``.
    weight_fn, window_stats, window_stats_reduce, batchnorm, batchnorm_momentum, compute_dtype:
      as in :func:`value_and_grad`. donate, jit: donate ``params`` and ``state``; jit (default).
    mesh, data_axis, param_specs, gather_params, memory_budget_bytes: data parallel over
      ``mesh``'s ``data_axis``, FSDP params and how they are gathered (the budget: "auto"'s).
    aux_reduce: each aux leaf's window reducer (docs/usage.md): ``"mean"`` (weighted; floats'),
      ``"sum"`` (integers'), ``"max"``, ``"min"`` or ``"last"``; a name or an aux pytree prefix.
    grads_in_place: where JAX can (0.11+), the backward pass adds into the accumulator
      (docs/models.md); False: each gradient summed in the scan's carry.
    unroll: micro-batches per trip of the loop, or ``"auto"``: the most that fit (choosing_k.md).

  Returns:
    ``step(params, state, batch, rng=None, *, num_real_microbatches=None) -> (params, state,
    metrics)`` with ``"loss"``, ``"grad_norm"``, ``"weight"``, ``"updated"`` (and ``"aux"``,
    noise-scale estimates); ``num_real_microbatches=m`` uses micro-batches 0..m-1 (docs/usage.md).

  Raises:
    TypeError, ValueError: for a bad ``tx``, mesh, batch size, ``state`` or ``param_specs``.

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
  opts = make_options(
    "train_step", loss_fn, has_aux=has_aux, weight_fn=weight_fn, has_state=has_state,
    batchnorm=batchnorm, batchnorm_momentum=batchnorm_momentum, compute_dtype=compute_dtype,
    mesh=mesh, data_axis=data_axis, param_specs=param_specs, gather_params=gather_params,
    memory_budget_bytes=memory_budget_bytes, grads_in_place=grads_in_place,
    aux_reduce=aux_reduce, window_stats=window_stats,
    window_stats_reduce=window_stats_reduce, unroll=unroll,
  )  # fmt: skip

  def build(o: Options, jit: bool = True):
    fused = fused_step(o, acc, donated=donate and jit)

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

  return gathered(build, opts, jit)


class JitStep:
  """A jitted step that checks ``num_real_microbatches`` and passes it as int32, so ints and
  arrays of every value share one program; the rest (``lower``, ...) is the jitted function's.
  ``calls_compiled``: a program compiled from ``lower`` runs on the same arguments (no nnx.jit)."""

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


def fused_step(opts: Options, tx: Accumulate, donated: bool = False) -> Callable[..., Any]:
  """``fused(params, model_state, state, batch, rng, num_real) -> (params, model_state, state,
  metrics)``: one window, scanned and closed; ``donated``: params and state are donated."""
  acc = tx.settings
  opts = acc.options(opts)
  k = tx.fixed_num_microbatches(opts.where)
  mg = MicrobatchedGrad(opts, k, noise_sums=acc.noise_scale_ema is not None)
  dp = opts.parallel

  def fused(params, model_state, state, batch, rng, num_real):
    state = acc.check_state(state)
    # Params partly overwritten (fp8 variables): the optimizer trains the rest, as Flax's
    # TrainState trains the variables' "params" collection
    ov = overwritten(params, opts.where)
    trained, kept = (params, None) if ov is None else ov.split(params)
    check_same_structure(trained, state.acc_grads, "params" if ov is None else "the trained params")
    num_real = check_real_microbatches(num_real, k)
    scale = None if state.loss_scale is None else state.loss_scale.scale
    # The scan adds onto the state's accumulator (zeros, or a streaming window's sums), in its
    # buffer when donated, so a window holds one accumulator. A running mean restarts from 0.
    seeded = not keeps_running_means(state.acc_grads)
    init = state.acc_grads if seeded else jax.tree.map(jnp.zeros_like, state.acc_grads)
    inputs = Inputs(params, batch, rng, model_state, scale, num_real)
    window = mg.sums(inputs, init, seeded, overwrite=ov)
    sums = window.sums
    if seeded:  # close writes the new zeros (donated: over the sums, after the update)
      acc_grads, cleared = sums.grads, None
    else:
      acc_grads, cleared = merge_open_window(state, sums.grads, sums.weight, donated)
    weight = state.acc_weight + sums.weight
    # The other sums the state holds (the noise scale's) merged into the open window's.
    for unit, part in zip(mg.summed_units(init)[1:], window.parts[1:], strict=False):
      state = unit.hold(state, unit.merge(unit.held(state), part))
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
      new = keep_if_voided(new_state.updated, window.overwrite, kept)
      new_params = ov.join(params, new_params, new)
    # A voided window restores float model state (statistics), counters advance; None stays None.
    new_model_state = keep_if_voided(new_state.updated, window.model_state, model_state)
    metrics = window_metrics(closed, loss, aux, sums.weight, opts.loss.has_aux, scale)
    metrics.update(terms, **(window.before or {}), updated=new_state.updated)
    return new_params, new_model_state, new_state, metrics

  return fused


def merge_open_window(
  state: AccumulateState, grads: Any, weight: jax.Array, donated: bool
) -> tuple[Any, Any]:
  """``(grads plus the sums of a window left open by streaming calls, the new accumulator's
  zeros)``. ``donated``: merged in a branch (``_accumulate.apply_if``) that runs only when a
  window is open; otherwise the accumulator holds zeros and passes through (XLA copies nothing)."""
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
