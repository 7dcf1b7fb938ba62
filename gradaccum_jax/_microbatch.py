"""Splitting a batch into micro-batches and summing their weighted gradients in a ``lax.scan``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax._accumulate import (
  check_num_microbatches,
  check_weight,
  sq_norm,
  weighted_add,
  zeros_accumulator,
)
from gradaccum_jax._model_state import ModelStatePlan, check_batchnorm, check_state_like
from gradaccum_jax._sharding import make_data_parallel, sharded_sums, to_varying


def check_batch(batch: Any, num_microbatches: int) -> int:
  """Returns the batch size B, after checking every leaf has it and k divides it."""
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise ValueError(
      "batch has no array leaves; pass a pytree of arrays with a leading batch axis."
    )
  sizes = {}
  for path, x in leaves:
    shape = jnp.shape(x)
    name = jax.tree_util.keystr(path) or "batch"
    if not shape:
      raise ValueError(
        f"batch leaf {name} is a scalar; every batch leaf needs a leading batch"
        " dimension (pass constants through a closure or the params instead)."
      )
    sizes[name] = shape[0]
  if len(set(sizes.values())) > 1:
    listing = ", ".join(f"{name}: {size}" for name, size in sizes.items())
    raise ValueError(
      f"batch leaves have different leading (batch) dimensions: {listing}. Every"
      " leaf must have the same batch size B on axis 0."
    )
  batch_size = next(iter(sizes.values()))
  k = num_microbatches
  if batch_size % k:
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    shown = divisors if len(divisors) <= 12 else divisors[:6] + ["..."] + divisors[-3:]
    raise ValueError(
      f"batch size B={batch_size} is not divisible by num_microbatches k={k}."
      f" Use a batch size that is a multiple of {k}, or a k that divides"
      f" {batch_size} (divisors: {', '.join(map(str, shown))})."
    )
  return batch_size


def microbatch(batch: Any, index: jax.Array | int, num_microbatches: int) -> Any:
  """Micro-batch ``index`` of ``batch``: the rows ``index, index + k, index + 2k, ...``.

  The strided choice keeps a batch that is sharded on its leading axis in
  place: every micro-batch takes ``b / D`` rows from each of ``D`` devices, so
  no row crosses devices. The reshape to ``(b, k, ...)`` is free (no copy);
  only the ``b`` selected rows are gathered, one micro-batch at a time.
  """
  k = num_microbatches

  def take(x):
    x = jnp.asarray(x)
    x = x.reshape((x.shape[0] // k, k) + x.shape[1:])
    return jax.lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False)

  return jax.tree.map(take, batch)


class Sums(NamedTuple):
  """Weighted sums over the micro-batches of one batch."""

  grads: Any  # sum_i w_i g_i, added to the initial accumulator
  weight: jax.Array  # sum_i w_i over this batch's micro-batches (float32)
  loss: jax.Array  # sum_i w_i L_i (float32)
  aux: Any  # float leaves: sum_i w_i aux_i; integer leaves: sum_i aux_i
  model_state: Any  # the model state after the window (None without has_state)
  loss_like: Any  # jax.ShapeDtypeStruct of one micro-batch's loss
  aux_like: Any  # ... and of its aux
  # With noise_scale: (sum_i w_i |g_i|^2, micro-batches of positive weight, examples), float32
  noise: Any = None


def _is_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _cast_floats(tree: Any, dtype: Any) -> Any:
  return jax.tree.map(lambda x: x.astype(dtype) if _is_float(x) else x, tree)


@dataclasses.dataclass(frozen=True)
class MicrobatchedGrad:
  """A loss function and how to sum its gradients over micro-batches."""

  loss_fn: Callable[..., Any]
  num_microbatches: int
  has_aux: bool
  weight_fn: Callable[[Any], Any] | None
  has_state: bool = False
  batchnorm: str = "sequential"
  batchnorm_momentum: float | None = None
  compute_dtype: Any = None
  data_parallel: Any = None  # a _sharding.DataParallel: scan per device, reduce once
  vary_axes: tuple[str, ...] = ()  # inside shard_map: the axes to make the carry vary over
  noise_scale: bool = False  # also sum w_i |g_i|^2 for the gradient noise scale (Sums.noise)

  def __post_init__(self):
    check_batchnorm(self.batchnorm, self.batchnorm_momentum, self.has_state)

  def _parse(self, out: Any) -> tuple[Any, Any, Any]:
    """Splits loss_fn's output into (loss, aux, new_model_state)."""
    what = "(loss, aux)" if self.has_aux else "loss"
    if self.has_state:
      what = "(loss, (aux, new_model_state))" if self.has_aux else "(loss, new_model_state)"
    if self.has_aux or self.has_state:
      if not (isinstance(out, tuple | list) and len(out) == 2):
        flags = " and ".join(
          n for n, f in (("has_aux", self.has_aux), ("has_state", self.has_state)) if f
        )
        raise TypeError(
          f"With {flags}=True, loss_fn must return a pair {what}, got {type(out).__name__}."
        )
      loss, rest = out
      if self.has_state and self.has_aux:
        if not (isinstance(rest, tuple | list) and len(rest) == 2):
          raise TypeError(f"With has_aux and has_state, loss_fn must return {what}.")
        aux, new_state = rest
      elif self.has_state:
        aux, new_state = None, rest
      else:
        aux, new_state = rest, None
    elif isinstance(out, tuple | list):
      raise TypeError(
        f"loss_fn returned a {type(out).__name__} of length {len(out)}; if it returns"
        " (loss, aux), pass has_aux=True (and has_state=True for (loss, new_model_state))."
      )
    else:
      loss, aux, new_state = out, None, None
    if not (hasattr(loss, "shape") or isinstance(loss, int | float)):
      raise TypeError(f"loss_fn must return a scalar array, got {type(loss).__name__}.")
    if jnp.shape(loss) != ():
      hint = "" if self.has_aux else " If it returns (loss, aux), pass has_aux=True."
      raise ValueError(
        "loss_fn must return a scalar: the mean loss over its micro-batch; got"
        f" shape {jnp.shape(loss)}.{hint}"
      )
    return loss, aux, new_state

  def _objective(self, params, model_state, mb, key, scale):
    """(loss * scale in float32, (loss, aux, new_model_state)): what is differentiated."""
    if self.compute_dtype is not None:
      params = _cast_floats(params, self.compute_dtype)
    args = (params, model_state, mb) if self.has_state else (params, mb)
    out = self.loss_fn(*args) if key is None else self.loss_fn(*args, key)
    loss, aux, new_state = self._parse(out)
    if self.has_state:
      check_state_like(new_state, model_state)
    scaled = loss.astype(jnp.float32) if scale is None else loss.astype(jnp.float32) * scale
    return scaled, (loss, aux, new_state)

  def sums(
    self,
    params: Any,
    batch: Any,
    rng: jax.Array | None,
    acc_init: Any,
    model_state: Any = None,
    scale: jax.Array | None = None,
  ) -> Sums:
    """Scans the micro-batches, adding ``w_i * scale * g_i`` to ``acc_init``."""
    if self.data_parallel is not None:
      return sharded_sums(self, params, batch, rng, acc_init, model_state, scale)
    k = self.num_microbatches
    batch_size = check_batch(batch, k)
    grad_fn = jax.value_and_grad(self._objective, has_aux=True)
    if self.vary_axes:  # per-device gradients: no psum of the cotangents inside the loop
      params = to_varying(params, self.vary_axes)
    plan = (
      ModelStatePlan.make(model_state, self.batchnorm, self.batchnorm_momentum)
      if self.has_state
      else None
    )

    def one(i, carried_state):
      mb = microbatch(batch, i, k)
      key = None if rng is None else jax.random.fold_in(rng, i)
      start = None if plan is None else plan.for_microbatch(carried_state, model_state)
      (_, (loss, aux, new_state)), grads = grad_fn(params, start, mb, key, scale)
      if self.weight_fn is None:
        w = None
      else:
        w = check_weight(self.weight_fn(mb), "the value of weight_fn(microbatch)")
      return loss, aux, new_state, grads, w

    loss_like, aux_like, _, _, _ = jax.eval_shape(one, 0, model_state)
    aux0 = jax.tree.map(
      lambda s: jnp.zeros(s.shape, jnp.float32 if _is_float(s) else _int_acc_dtype(s)),
      aux_like,
    )

    def body(carry, i):
      acc, weight, loss_sum, aux_sum, mstate, stats, noise = carry
      loss, aux, new_state, grads, w = one(i, mstate)
      if noise is not None:  # sum_i w_i |g_i|^2 and, weighted, the micro-batches of weight > 0
        sq = sq_norm(grads)
        if w is None:
          noise = (noise[0] + sq, None)
        else:
          noise = (noise[0] + jnp.where(w > 0, w * sq, 0.0), noise[1] + (w > 0).astype(jnp.float32))
      acc = weighted_add(acc, grads, w)
      loss_sum = weighted_add(loss_sum, loss, w)
      aux_sum = jax.tree.map(
        lambda a, x: (
          weighted_add(a, x, w)
          if _is_float(x)
          else a + (x.astype(a.dtype) if w is None else jnp.where(w > 0, x, 0).astype(a.dtype))
        ),
        aux_sum,
        aux,
      )
      if w is not None:
        weight = weight + jnp.where(w > 0, w, 0.0)
      if plan is not None:
        stats = plan.add(stats, new_state, model_state)
      return (acc, weight, loss_sum, aux_sum, new_state, stats, noise), None

    # Unweighted, the total weight is the constant k: nothing to carry.
    weight0 = None if self.weight_fn is None else jnp.zeros((), jnp.float32)
    stats0 = None if plan is None else plan.stats0(model_state)
    noise0 = None
    if self.noise_scale:
      noise0 = (
        jnp.zeros((), jnp.float32),
        None if self.weight_fn is None else jnp.zeros((), jnp.float32),
      )
    init = (acc_init, weight0, jnp.zeros((), jnp.float32), aux0, model_state, stats0, noise0)
    if self.vary_axes:
      init = to_varying(init, self.vary_axes)
    (acc, weight, loss_sum, aux_sum, mstate, stats, noise), _ = jax.lax.scan(
      body, init, jnp.arange(k)
    )
    if noise is not None:  # unweighted: k micro-batches of b = B / k examples
      noise = (
        (noise[0], jnp.asarray(k, jnp.float32), jnp.asarray(batch_size, jnp.float32))
        if weight is None
        else (noise[0], noise[1], weight)
      )
    if weight is None:
      weight = jnp.asarray(k, jnp.float32)
    if plan is not None:
      mstate = plan.finish(mstate, stats, model_state, k)
    return Sums(acc, weight, loss_sum, aux_sum, mstate, loss_like, aux_like, noise)

  def means(self, sums: Sums) -> tuple[jax.Array, Any]:
    """The weighted mean loss and aux, in the dtypes ``loss_fn`` returned."""
    loss = safe_mean(sums.loss, sums.weight).astype(sums.loss_like.dtype)
    aux = jax.tree.map(
      lambda a, like: safe_mean(a, sums.weight).astype(like.dtype) if _is_float(like) else a,
      sums.aux,
      sums.aux_like,
    )
    return loss, aux

  def output(self, loss: jax.Array, aux: Any, model_state: Any) -> Any:
    """The value part in the shape loss_fn returns it."""
    if self.has_state:
      return (loss, (aux, model_state)) if self.has_aux else (loss, model_state)
    return (loss, aux) if self.has_aux else loss


def _int_acc_dtype(s: Any) -> Any:
  return jnp.int32 if jnp.result_type(s) == jnp.bool_ else jnp.result_type(s)


def safe_mean(total: jax.Array, weight: jax.Array) -> jax.Array:
  """``total / weight``, and 0 where the weight is 0."""
  return jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1.0), 0.0)


def value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  accum_dtype: Any = jnp.float32,
  has_state: bool = False,
  batchnorm: str = "sequential",
  batchnorm_momentum: float | None = None,
  compute_dtype: Any = None,
  mesh: Any = None,
  data_axis: str | tuple[str, ...] | None = None,
  param_specs: Any = None,
) -> Callable[..., Any]:
  r"""Like ``jax.value_and_grad`` over a whole batch, computed one micro-batch at a time.

  The batch (any pytree whose leaves share a leading axis ``B``) is split into
  ``k = num_microbatches`` micro-batches of ``b = B / k`` rows; micro-batch
  ``i`` holds rows ``i, i + k, i + 2k, ...`` (a strided split, so a batch
  sharded on its leading axis never moves between devices). A
  ``jax.lax.scan`` computes the loss and gradient of each in turn and sums
  them into one accumulator of ``accum_dtype``; peak activation memory is
  that of one micro-batch. With weights ``w_i`` (1, or
  ``weight_fn(microbatch)``) the result is

  .. math::
    L = \frac{\sum_i w_i L_i}{\sum_i w_i}, \qquad
    G = \frac{\sum_i w_i \nabla L_i}{\sum_i w_i},

  so when ``loss_fn`` is the mean over the non-padding tokens of its
  micro-batch and ``weight_fn`` counts them, ``L`` is the token-level mean
  over the whole batch (not a mean of per-micro-batch means). A micro-batch of
  weight 0 contributes nothing, even a NaN; if all weights are 0 the loss,
  gradients and float aux are 0.

  Args:
    loss_fn: ``loss_fn(params, microbatch)`` (or ``loss_fn(params,
      microbatch, rng)`` when the returned function is called with ``rng=``)
      returning the scalar mean loss over the micro-batch, or ``(loss, aux)``
      with ``has_aux``.
    num_microbatches: ``k``, a positive int that divides the batch size.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``. Float aux leaves are
      averaged with the same weights; integer and bool leaves are summed over
      the micro-batches of positive weight (e.g. counts of correct
      predictions).
    weight_fn: ``weight_fn(microbatch) -> scalar`` weight of a micro-batch,
      e.g. its number of non-padding tokens; ``None`` weighs all equally.
    accum_dtype: dtype of the gradient accumulator (float32 by default);
      ``None`` uses the gradients' dtype. Gradients are returned in the
      params' dtype.
    has_state: whether ``loss_fn(params, model_state, microbatch[, rng])``
      takes a mutable model state (flax ``batch_stats``, counters) and returns
      ``(loss, new_model_state)`` (``(loss, (aux, new_model_state))`` with
      ``has_aux``). The state flows through the micro-batches as ``batchnorm``
      says; the function then takes ``(params, model_state, batch, rng=None)``.
    batchnorm: with ``has_state``, how BatchNorm running statistics (pairs of
      leaves named ``mean`` and ``var``) are updated. ``"sequential"``: each
      micro-batch updates them in turn (k running-average updates per window,
      i.e. ghost batch norm with ghost size b). ``"per_window"``: each
      micro-batch starts from the window's statistics and they are updated once
      with the pooled mean and variance of the whole window (the variance of
      the micro-batch means included; micro-batches count equally, whatever
      their weight). ``"frozen"``: left unchanged (fine-tuning). In every mode
      the normalization itself uses each micro-batch's own statistics when the
      model is in training mode: exact large-batch BatchNorm would need the
      whole batch's activations at once. Prefer GroupNorm or LayerNorm, which
      are per-example and so exact under accumulation, when you can.
    batchnorm_momentum: the momentum ``m`` of the running averages (``new = m
      * old + (1 - m) * batch_stat``; flax's default is 0.99); needed by
      ``"per_window"``.
    compute_dtype: if set (e.g. ``jnp.bfloat16``), float params are cast to it
      before ``loss_fn`` sees them; gradients still come back in the params'
      dtype (fp32 master weights) and are accumulated in ``accum_dtype``.
    mesh: a ``jax.sharding.Mesh`` to accumulate data-parallel over: every
      device splits its own rows of the batch into the ``k`` micro-batches and
      accumulates locally, with no collective inside the loop, and the sums are
      reduced once after it. The global batch size must be a multiple of
      (devices on ``data_axis``) x ``k``; the result equals the single-device
      one (see :func:`train_step` for the details and the trade-offs). Call
      the function under ``jax.jit``, not inside your own ``shard_map``.
    data_axis: the mesh axis (or tuple of axes) the batch's leading dimension
      is sharded over; ``"data"`` by default. Needs ``mesh``.
    param_specs: a ``PartitionSpec`` or a pytree prefix of the params with
      ``PartitionSpec`` leaves: the params are sharded (FSDP/ZeRO style) over
      data axes, gathered once before the scan, and the gradients are
      reduce-scattered into this sharding once after it. ``None``: the params
      are replicated. Needs ``mesh``.

  Returns:
    A function ``(params, batch, rng=None) -> (loss, grads)``, or ``((loss,
    aux), grads)`` with ``has_aux``; with ``has_state``, ``(params,
    model_state, batch, rng=None) -> ((loss, new_model_state), grads)`` or
    ``((loss, (aux, new_model_state)), grads)``. Micro-batch ``i`` gets the
    key ``jax.random.fold_in(rng, i)`` (with ``mesh``, ``rng`` is first
    folded with the device's index on the data axes).

  Raises:
    TypeError, ValueError: eagerly for a bad ``num_microbatches``, or a
      ``mesh`` that lacks ``data_axis``; at call
      (trace) time when the batch size is not divisible by ``k`` (by
      devices x ``k`` with ``mesh``), when batch
      leaves have different leading dimensions, or when the loss or a weight
      is not a scalar.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import gradaccum_jax as ga
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> batch = {"x": jnp.arange(16.0).reshape(8, 2) / 8, "y": jnp.ones(8)}
    >>> w = jnp.array([0.5, -0.5])
    >>> loss, grads = ga.value_and_grad(loss_fn, num_microbatches=4)(w, batch)
    >>> ref_loss, ref_grads = jax.value_and_grad(loss_fn)(w, batch)
    >>> bool(jnp.allclose(loss, ref_loss)), bool(jnp.allclose(grads, ref_grads))
    (True, True)
  """
  k = check_num_microbatches(num_microbatches, allow_schedule=False)
  if accum_dtype is not None:
    accum_dtype = jnp.dtype(accum_dtype)
  dp = make_data_parallel(mesh, data_axis, param_specs, "value_and_grad")
  mg = MicrobatchedGrad(
    loss_fn,
    k,
    bool(has_aux),
    weight_fn,
    has_state=bool(has_state),
    batchnorm=batchnorm,
    batchnorm_momentum=batchnorm_momentum,
    compute_dtype=compute_dtype,
    data_parallel=dp,
  )

  def compute(params, model_state, batch, rng):
    s = mg.sums(params, batch, rng, zeros_accumulator(params, accum_dtype), model_state)
    grads = jax.tree.map(
      lambda a, p: safe_mean(a, s.weight).astype(jnp.result_type(p)), s.grads, params
    )
    loss, aux = mg.means(s)
    return mg.output(loss, aux, s.model_state), grads

  if has_state:

    def vg_state(params, model_state, batch, rng=None):
      return compute(params, model_state, batch, rng)

    return vg_state

  def vg(params, batch, rng=None):
    return compute(params, None, batch, rng)

  return vg
