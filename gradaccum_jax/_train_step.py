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
  add_noise_window,
  as_accumulate,
  noise_estimates,
  noise_scale,
  run_if,
)
from gradaccum_jax._checks import check_real_microbatches, check_same_structure
from gradaccum_jax._microbatch import MicrobatchedGrad
from gradaccum_jax._options import Options, make_options
from gradaccum_jax._parts import NoiseSums, keep_if_voided, keeps_running_means, merge_gradients
from gradaccum_jax._sharding import AutoGatherStep, place_params


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
) -> Callable[..., tuple[optax.Params, AccumulateState, dict[str, Any]]]:
  r"""A jitted step that accumulates a whole window and updates the params once.

  ``step(params, state, batch, rng=None)`` splits ``batch`` into the ``k``
  micro-batches of ``tx = ga.accumulate(inner, k)`` (micro-batch ``i`` holds
  rows ``i, i + k, ...``), scans their weighted gradients into the fp32
  accumulator of ``state`` with :func:`value_and_grad`'s machinery, then
  closes the window exactly as the ``k``-th streaming ``tx.update`` would: one
  ``inner`` update on :math:`G = \sum_i w_i g_i / \sum_i w_i`. The whole
  cycle is one XLA program, its peak memory that of one micro-batch plus the
  accumulator. ``state`` is ``tx.init(params)``, the same type as in streaming
  mode, so the two modes, checkpoints and resumption mix freely; micro-batches
  already accumulated by streaming calls (a window left open) are included in
  the window this step closes.

  Args:
    loss_fn: ``loss_fn(params, microbatch)`` or, when ``step`` gets ``rng=``,
      ``loss_fn(params, microbatch, rng)``, returning the scalar mean loss over
      the micro-batch, or ``(loss, aux)`` with ``has_aux``.
    tx: a transformation made by :func:`accumulate` with an int
      ``num_microbatches``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    weight_fn: ``weight_fn(microbatch) -> scalar`` weight (e.g. number of
      non-padding tokens); ``None`` weighs micro-batches equally.
    donate: donate ``params`` and ``state`` to the step, so XLA updates them in
      place (halves their memory; the arrays passed in are then invalid).
    jit: return the step jitted (default) or as a plain traceable function, to
      be called inside your own ``jax.jit``, ``shard_map`` or ``lax.scan``.
    has_state: ``loss_fn(params, model_state, microbatch[, rng])`` returns
      ``(loss, new_model_state)`` (or ``(loss, (aux, new_model_state))``); the
      step is then ``step(params, model_state, state, batch, rng=None) ->
      (params, model_state, state, metrics)``. A voided window (see
      :func:`accumulate`) returns the float leaves of the model state as they
      were (running statistics); integer leaves (counters) advance.
    batchnorm, batchnorm_momentum, compute_dtype: as in
      :func:`value_and_grad`.
    mesh: a ``jax.sharding.Mesh`` to train data-parallel over (see below).
    data_axis: the mesh axis, or tuple of axes, the batch's leading dimension
      is sharded over; ``"data"`` by default. Needs ``mesh``.
    param_specs: with ``mesh``, the params' layout: ``None`` (replicated) or
      a ``PartitionSpec`` / pytree prefix of the params with ``PartitionSpec``
      leaves sharding at most one dimension of each param over data axes
      (FSDP/ZeRO style, e.g. ``P("data")`` on the leading dimension). Other
      mesh axes (tensor parallelism, e.g. ``P(None, "model")`` or
      ``P("data", "model")`` on a ``("data", "model")`` mesh) are left to
      GSPMD inside ``loss_fn``; one dimension cannot mix data and model axes.
    gather_params: with ``param_specs``, how params sharded over data axes
      are gathered: ``"once"`` (default: gathered before the scan and kept
      for the window, a full-size local accumulator, the gradients
      reduce-scattered once after it), ``"per_microbatch"`` (kept sharded:
      every micro-batch gathers them and reduce-scatters its gradient into a
      sharded accumulator; ``1/D`` params and accumulator memory during the
      window for ``k`` times the communication) or ``"auto"`` (both are
      compiled, nothing runs, and ``"once"`` is used if its compiled memory
      per device fits ``memory_budget_bytes``, else ``"per_microbatch"``; the
      step then has ``step.chosen_gather_params(*args)`` and
      ``step.gather_params_bytes(*args)``). Needs ``mesh``.
    memory_budget_bytes: the per-device budget of ``gather_params="auto"``;
      by default the device's ``memory_stats()["bytes_limit"]`` (as
      :func:`auto_microbatch` reads it), which CPU devices do not report.

  Data parallelism: with ``mesh``, the scan runs under ``jax.shard_map``. Each
  device splits its own ``B / D`` rows (``D`` devices on ``data_axis``) into
  the ``k`` micro-batches with the same strided rule, so its micro-batch ``i``
  is exactly its share of the global micro-batch ``i``, and accumulates their
  gradients with no collective inside the loop (params and accumulator are
  cast to device-varying, so differentiating replicated params inserts no
  ``psum``). After the loop the sums are reduced once, the gradients of
  replicated params, the loss, the weight (with ``weight_fn``) and the aux
  sums in one ``psum``, which XLA emits as one all-reduce whatever ``k``. The
  window is closed outside the ``shard_map`` on the reduced gradient. Weights
  are global: ``weight_fn`` is called on each device's micro-batch and the
  normalizer is the sum over all devices and micro-batches, so for a token
  count the result equals the single-device step on the whole batch (as for
  any weight that adds up over rows). Unweighted, each device's micro-batch
  weighs ``1 / D``, so the global micro-batch weighs 1 and ``metrics["weight"]``
  is ``k``, as on one device (a window left open by streaming calls mixes in
  correctly). ``B`` must be a multiple of ``D x k``. ``rng`` is folded with
  the device index (on the data axes) before the micro-batch index
  (``fold_in(fold_in(rng, d), i)``), so devices draw different keys.
  With ``has_state``, every device threads the model state through its own
  micro-batches (BatchNorm sees per-device micro-batches of ``b / D`` rows),
  and after the loop float leaves are averaged over the devices
  (``pmean``: running BatchNorm statistics) and integer leaves take their
  maximum (counters, equal on all devices). Call the step under ``jit`` (the
  default), not inside your own ``shard_map``.

  Layouts, memory and communication per window, for ``P`` parameter bytes:

  - replicated params (``param_specs=None``): every device holds the params,
    the optimizer state, the fp32 accumulator of ``state`` and one full
    local accumulator during the window (with ``donate`` the
    scan adds into the state's, so there is one); one all-reduce of ``P`` (ring: about
    ``2P`` bytes sent per device) per window, against ``k`` for a plain
    ``jit`` of a scan (GSPMD reduces inside the loop) or for PyTorch DDP
    without ``no_sync``. The inner optimizer runs replicated.
  - sharded params (``param_specs``): params, optimizer state and
    ``state.acc_grads`` are stored ``1/D`` per device; the params are
    all-gathered once before the scan and stay gathered for the window, the
    local accumulator is full size, and after the loop one reduce-scatter
    per sharded param returns each device its ``1/D`` share of the summed
    gradient: ``P`` gathered plus ``P`` reduce-scattered per window, the
    bytes of one all-reduce, independent of ``k``. The inner optimizer runs on
    the shards (GSPMD; a global-norm clip adds a scalar all-reduce). PyTorch
    FSDP under ``no_sync`` likewise keeps full-size gradients between
    micro-steps; without it, and DeepSpeed ZeRO-2, reduce-scatter every
    micro-step (``k`` times the traffic, ``1/D`` gradient memory), and
    ZeRO-3/FSDP full sharding re-gathers the params for every forward and
    backward pass (``2k`` all-gathers, ``1/D`` params memory). The trade here
    is full-size params and accumulator during the window for ``k`` times
    less communication (``gather_params="once"``).
  - ``gather_params="per_microbatch"``: params, optimizer state and the
    local accumulator (with ``donate``, the state's own)
    stay ``1/D`` per device through the window; every
    micro-batch all-gathers the params inside the loop and reduce-scatters
    its gradient into the sharded accumulator: ``k`` times ``P`` gathered
    and ``P`` reduce-scattered per window (FSDP full sharding, ZeRO-3), for
    a peak of the sharded state, one micro-batch's activations and the
    gathered params of one micro-batch. ``"auto"`` compiles both and keeps
    ``"once"`` when it fits the budget.
  - model axes (tensor parallelism): the ``shard_map`` is manual over the
    data axes only, so a param sharded ``P(None, "model")`` stays sharded
    over ``"model"`` inside ``loss_fn`` (GSPMD), and its gradient is
    all-reduced over the data axes once per window. A param sharded over
    both (``P("data", "model")``) is gathered over the data axes by GSPMD
    before the scan (``"once"``) or by a ``psum`` of its padded shard per
    micro-batch, and its gradient all-reduced over them and sliced (XLA's
    partitioner would replicate it over ``"model"`` for a manual all-gather
    or reduce-scatter): twice the bytes of a reduce-scatter.

  Make the state with ``tx.init`` on the params already placed with their
  sharding (its ``zeros_like`` keeps it), or ``jax.device_put`` it; the new
  params and accumulator are constrained to ``param_specs``.

  Short windows: ``step(..., num_real_microbatches=m)`` (an int or an int32
  scalar, ``1 <= m <= k``; changing it does not recompile) computes and counts
  only micro-batches ``0..m-1`` and closes the window: the result equals the
  step of ``ga.accumulate(inner, m)`` on those rows. The others are not
  computed (the loop runs ``m`` times). Micro-batch ``i`` holds rows ``i, i +
  k, ...``, so to lay out ``n = m * b`` real rows (``b = B / k``) put real row
  ``j`` of micro-batch ``i`` at index ``i + j * k``, e.g. ``x.reshape(m, b,
  ...)`` padded to ``(k, b, ...)``, then ``.swapaxes(0, 1).reshape(B, ...)``.
  Inner optimizers that take ``value=`` or ``grad=`` (e.g.
  ``optax.contrib.reduce_on_plateau``) get the window's mean loss and mean
  gradient.

  Returns:
    ``step(params, state, batch, rng=None, *, num_real_microbatches=None) ->
    (params, state, metrics)``, where
    ``metrics`` holds ``"loss"`` (weighted mean over the batch), ``"grad_norm"``
    (global norm of the accumulated mean gradient, before ``inner``),
    ``"weight"`` (total weight of the batch), ``"updated"`` (whether the params
    moved; False for a voided window), with ``has_aux``, ``"aux"`` (float
    leaves averaged with the weights, integer leaves summed) and, with
    ``ga.accumulate(..., noise_scale_ema=d)``, ``"noise_scale"`` (the simple
    noise scale from the moving averages, :func:`noise_scale` of the new
    state), ``"grad_sq_norm_est"`` and ``"trace_sigma_est"`` (this window's
    unbiased estimates of the squared true gradient norm and of the trace of
    the per-example gradient covariance; NaN with fewer than 2 micro-batches
    of positive weight). Unweighted, the examples per micro-batch are its
    rows.

  Raises:
    TypeError: if ``tx`` is not from :func:`accumulate`, or its
      ``num_microbatches`` is a schedule.
    ValueError: if ``mesh`` lacks ``data_axis``. At the first call, for a
      batch whose size is not divisible by ``k`` (by devices x ``k`` with
      ``mesh``) or whose leaves differ in leading dimension, a ``state`` that
      does not match ``params``, or ``param_specs`` that do not fit the
      params.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> tx = ga.accumulate(optax.adam(1e-2), num_microbatches=4)
    >>> step = ga.train_step(loss_fn, tx)
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> batch = {"x": jnp.ones((32, 3)), "y": jnp.ones(32)}
    >>> params, state, metrics = step(params, state, batch)
    >>> float(metrics["loss"]), int(state.count)
    (1.0, 1)
  """
  acc = as_accumulate(tx)
  k = acc.fixed_num_microbatches("train_step")
  opts = make_options(
    "train_step",
    loss_fn,
    has_aux=has_aux,
    weight_fn=weight_fn,
    has_state=has_state,
    batchnorm=batchnorm,
    batchnorm_momentum=batchnorm_momentum,
    compute_dtype=compute_dtype,
    mesh=mesh,
    data_axis=data_axis,
    param_specs=param_specs,
    gather_params=gather_params,
    memory_budget_bytes=memory_budget_bytes,
  )
  if gather_params == "auto":
    if not jit:
      raise ValueError("train_step: gather_params='auto' compiles the step, so it needs jit=True.")
    steps = {
      g: wrap_step(
        fused_step(opts.with_gather(g), acc, in_place=donate),
        has_state=opts.has_state, donate=donate, jit=True, k=lambda args: k,
      )
      for g in ("once", "per_microbatch")
    }  # fmt: skip
    return AutoGatherStep(steps, opts.parallel.budget)
  fused = fused_step(opts, acc, in_place=donate and jit)
  return wrap_step(fused, has_state=opts.has_state, donate=donate, jit=jit, k=lambda args: k)


def wrap_step(
  fused: Callable[..., Any], *, has_state: bool, donate: bool, jit: bool, k: Callable[..., int]
):
  """The public signature around ``fused``: with or without model state, jitted or not."""
  if has_state:

    def step_with_state(params, model_state, state, batch, rng=None, *, num_real_microbatches=None):
      return fused(params, model_state, state, batch, rng, num_real_microbatches)

    step, donate_argnums = step_with_state, (0, 1, 2)
  else:

    def step(params, state, batch, rng=None, *, num_real_microbatches=None):
      new_params, _, new_state, metrics = fused(
        params, None, state, batch, rng, num_real_microbatches
      )
      return new_params, new_state, metrics

    donate_argnums = (0, 1)
  if not jit:
    return step
  return JitStep(jax.jit(step, donate_argnums=donate_argnums if donate else ()), k)


class JitStep:
  """A jitted step that checks ``num_real_microbatches`` before the call and passes it as an
  int32 array, so Python ints and arrays of every value share one compiled program.

  Everything else (``lower``, ``trace``, ...) is the jitted function's.
  """

  def __init__(self, jitted: Callable[..., Any], k: Callable[[tuple[Any, ...]], int]):
    self._jitted, self._k = jitted, k

  def __call__(self, *args: Any, num_real_microbatches: Any = None, **kwargs: Any) -> Any:
    if num_real_microbatches is not None:
      num_real_microbatches = check_real_microbatches(num_real_microbatches, self._k(args))
    return self._jitted(*args, num_real_microbatches=num_real_microbatches, **kwargs)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._jitted, name)


def fused_step(opts: Options, tx: Accumulate, in_place: bool = False) -> Callable[..., Any]:
  """``fused(params, model_state, state, batch, rng, num_real) -> (params, model_state, state,
  metrics)``: one window, scanned and closed; the core every fused front end calls.

  ``in_place``: the params and state are donated to the step (see ``_Accumulator.close``).
  """
  acc = tx.settings
  k = tx.fixed_num_microbatches("train_step")
  mg = MicrobatchedGrad(opts, k, noise_scale=acc.noise_scale_ema is not None)
  dp = opts.parallel

  def fused(params, model_state, state, batch, rng, num_real):
    state = acc.check_state(state)
    check_same_structure(params, state.acc_grads, "params")
    num_real = check_real_microbatches(num_real, k)
    scale = None if state.loss_scale is None else state.loss_scale.scale
    # The scan adds onto the state's accumulator (zeros, or a window left open by streaming
    # calls): donated, in that buffer, so a window holds one accumulator; undonated, XLA copies
    # it into the loop's carry, as it would write zeros. A running mean restarts from zero.
    seeded = not keeps_running_means(state.acc_grads)
    init = state.acc_grads if seeded else jax.tree.map(jnp.zeros_like, state.acc_grads)
    window = mg.sums(params, batch, rng, init, model_state, scale, num_real, in_buffer=seeded)
    sums = window.sums
    if seeded:  # close writes the new zeros (donated: over the sums, after the update)
      acc_grads, cleared = sums.grads, None
    else:
      acc_grads, cleared = merge_open_window(state, sums.grads, sums.weight, in_place)
    weight = state.acc_weight + sums.weight
    if isinstance(window.noise, NoiseSums):  # add this batch's sums to the open window's
      state = state._replace(noise_scale=add_noise_window(state.noise_scale, window.noise))
    loss, aux = window.means()
    extra = {"value": loss, "grad": MEAN_GRADIENT}
    new_params, new_state, grad_norm = acc.close(
      acc_grads, weight, state, params, params, extra, apply=True, in_place=in_place,
      norm_by_rows=dp is None,
    )  # fmt: skip
    if cleared is not None:
      new_state = new_state._replace(acc_grads=cleared)
    new_params = place_params(dp, new_params)
    if dp is not None:
      new_state = new_state._replace(acc_grads=place_params(dp, new_state.acc_grads))
    new_model_state = None
    if opts.has_state:  # a voided window restores float state (statistics); counters advance
      new_model_state = keep_if_voided(new_state.updated, window.model_state, model_state)
    metrics = window_metrics(window, acc_grads, weight, grad_norm, state, new_state, opts)
    return new_params, new_model_state, new_state, metrics

  return fused


def merge_open_window(
  state: AccumulateState, grads: Any, weight: jax.Array, in_place: bool
) -> tuple[Any, Any]:
  """``(the window's gradient sums, the accumulator for the new state)``: ``grads`` (of total
  weight ``weight``) with the sums of a window left open by streaming calls added, and zeros.

  ``in_place`` (the state donated): the state's accumulator is only read and cleared when a
  window is open (``state.micro_step > 0``); otherwise it holds zeros (every window that
  closes clears it) and passes through a loop of 0 trips untouched, where reading it and
  writing the new zeros over it made XLA copy it first. Without donation the output is a new
  buffer anyway, and a loop would hold a copy of the accumulator.
  """

  if not in_place:
    merged = merge_gradients(state.acc_grads, state.acc_weight, grads, weight)
    return merged, jax.tree.map(jnp.zeros_like, state.acc_grads)
  is_open = state.micro_step > 0

  def merge(carry):
    grads, acc = carry
    merged = merge_gradients(acc, state.acc_weight, grads, weight)
    # The zeros are a select on ``merged`` that XLA cannot fold (``is_open`` holds whenever
    # this runs), so the write over ``acc`` follows the merge's read of it. With plain zeros
    # XLA copied the accumulator first, and the copies' buffers, though the loop seldom runs,
    # took temp memory and slowed the micro-batch loop (tests/test_program.py).
    return merged, jax.tree.map(lambda m: jnp.where(is_open, jnp.zeros_like(m), m), merged)

  return run_if(is_open, merge, (grads, state.acc_grads))


def window_metrics(window, acc_grads, weight, grad_norm, state, new_state, opts) -> dict:
  """The metrics of a closed window (see :func:`train_step`)."""
  scale = None if state.loss_scale is None else state.loss_scale.scale
  loss, aux = window.means()
  metrics = {
    "loss": loss,
    "grad_norm": grad_norm,
    "weight": window.sums.weight,
    "updated": new_state.updated,
  }
  if opts.loss.has_aux:
    metrics["aux"] = aux
  if scale is not None:
    metrics["loss_scale"] = scale
  if isinstance(window.noise, NoiseSums):
    g2, trace = noise_estimates(acc_grads, weight, state.noise_scale, scale)
    metrics["noise_scale"] = noise_scale(new_state)
    metrics["grad_sq_norm_est"], metrics["trace_sigma_est"] = g2, trace
  return metrics
