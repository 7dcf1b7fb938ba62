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
  weighted_add,
  zeros_accumulator,
)


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
  loss_like: Any  # jax.ShapeDtypeStruct of one micro-batch's loss
  aux_like: Any  # ... and of its aux


def _is_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


@dataclasses.dataclass(frozen=True)
class MicrobatchedGrad:
  """A loss function and how to sum its gradients over micro-batches."""

  loss_fn: Callable[..., Any]
  num_microbatches: int
  has_aux: bool
  weight_fn: Callable[[Any], Any] | None

  def _loss_and_aux(self, params, mb, key):
    out = self.loss_fn(params, mb) if key is None else self.loss_fn(params, mb, key)
    if self.has_aux:
      if not (isinstance(out, tuple | list) and len(out) == 2):
        raise TypeError(
          f"With has_aux=True, loss_fn must return a pair (loss, aux), got {type(out).__name__}."
        )
      loss, aux = out
    elif isinstance(out, tuple | list):
      raise TypeError(
        f"loss_fn returned a {type(out).__name__} of length {len(out)}; if it returns"
        " (loss, aux), pass has_aux=True."
      )
    else:
      loss, aux = out, None
    if not (hasattr(loss, "shape") or isinstance(loss, int | float)):
      raise TypeError(f"loss_fn must return a scalar array, got {type(loss).__name__}.")
    if jnp.shape(loss) != ():
      hint = "" if self.has_aux else " If it returns (loss, aux), pass has_aux=True."
      raise ValueError(
        "loss_fn must return a scalar: the mean loss over its micro-batch; got"
        f" shape {jnp.shape(loss)}.{hint}"
      )
    return loss, aux

  def sums(
    self,
    params: Any,
    batch: Any,
    rng: jax.Array | None,
    acc_init: Any,
  ) -> Sums:
    """Scans the micro-batches, adding ``w_i g_i`` to ``acc_init``."""
    k = self.num_microbatches
    check_batch(batch, k)
    grad_fn = jax.value_and_grad(self._loss_and_aux, has_aux=True)

    def one(i):
      mb = microbatch(batch, i, k)
      key = None if rng is None else jax.random.fold_in(rng, i)
      (loss, aux), grads = grad_fn(params, mb, key)
      if self.weight_fn is None:
        w = None
      else:
        w = check_weight(self.weight_fn(mb), "the value of weight_fn(microbatch)")
      return loss, aux, grads, w

    loss_like, aux_like, _, _ = jax.eval_shape(one, 0)
    aux0 = jax.tree.map(
      lambda s: jnp.zeros(s.shape, jnp.float32 if _is_float(s) else _int_acc_dtype(s)),
      aux_like,
    )

    def body(carry, i):
      acc, weight, loss_sum, aux_sum = carry
      loss, aux, grads, w = one(i)
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
      return (acc, weight, loss_sum, aux_sum), None

    # Unweighted, the total weight is the constant k: nothing to carry.
    weight0 = None if self.weight_fn is None else jnp.zeros((), jnp.float32)
    init = (acc_init, weight0, jnp.zeros((), jnp.float32), aux0)
    (acc, weight, loss_sum, aux_sum), _ = jax.lax.scan(body, init, jnp.arange(k))
    if weight is None:
      weight = jnp.asarray(k, jnp.float32)
    return Sums(acc, weight, loss_sum, aux_sum, loss_like, aux_like)

  def means(self, sums: Sums) -> tuple[jax.Array, Any]:
    """The weighted mean loss and aux, in the dtypes ``loss_fn`` returned."""
    loss = safe_mean(sums.loss, sums.weight).astype(sums.loss_like.dtype)
    aux = jax.tree.map(
      lambda a, like: safe_mean(a, sums.weight).astype(like.dtype) if _is_float(like) else a,
      sums.aux,
      sums.aux_like,
    )
    return loss, aux


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

  Returns:
    A function ``(params, batch, rng=None) -> (loss, grads)``, or ``((loss,
    aux), grads)`` with ``has_aux``. Micro-batch ``i`` gets the key
    ``jax.random.fold_in(rng, i)``.

  Raises:
    TypeError, ValueError: eagerly for a bad ``num_microbatches``; at call
      (trace) time when the batch size is not divisible by ``k``, when batch
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
  mg = MicrobatchedGrad(loss_fn, k, bool(has_aux), weight_fn)

  def vg(params, batch, rng=None):
    s = mg.sums(params, batch, rng, zeros_accumulator(params, accum_dtype))
    grads = jax.tree.map(
      lambda a, p: safe_mean(a, s.weight).astype(jnp.result_type(p)), s.grads, params
    )
    loss, aux = mg.means(s)
    return ((loss, aux) if has_aux else loss), grads

  return vg
