"""Checks of user input, each written once and called at the boundary of the public functions."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# An int, or a schedule ``count -> int`` (``count``: windows closed so far).
NumMicrobatches = int | Callable[[jax.Array], Any]


def is_inexact(x: Any) -> bool:
  """Whether ``x`` is a float or complex array (or Python number)."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def check_num_microbatches(
  num_microbatches: Any, *, allow_schedule: bool, where: str = "A fused step"
) -> NumMicrobatches:
  """Validates ``num_microbatches``: a positive int (or, if allowed, a schedule; if not, the
  TypeError names ``where``)."""
  if callable(num_microbatches) and not isinstance(num_microbatches, type):
    if allow_schedule:
      return num_microbatches
    raise TypeError(
      f"{where} needs a fixed int number of micro-batches per window, got the schedule"
      f" {num_microbatches=}. Pass an int to ga.accumulate, drive a schedule with tx.update"
      " (streaming mode), or use ga.ramp_train_step."
    )
  if isinstance(num_microbatches, bool) or not hasattr(num_microbatches, "__index__"):
    raise TypeError(
      f"{num_microbatches=} must be a positive int (micro-batches per optimizer step)."
    )
  k = operator.index(num_microbatches)
  if k <= 0:
    raise ValueError(f"{num_microbatches=} must be a positive int, got {k}.")
  return k


def check_scheduled_k(value: Any) -> jax.Array:
  """The value of a ``num_microbatches`` schedule as an int32 scalar (a float is refused)."""
  try:
    arr = jnp.asarray(value)
  except TypeError:
    arr = None
  if arr is None or arr.shape != () or not jnp.issubdtype(arr.dtype, jnp.integer):
    raise TypeError(
      f"The num_microbatches schedule returned {value!r}"
      f"{'' if arr is None else f' ({arr.dtype}{list(arr.shape)})'}; it must return a positive"
      " int scalar (e.g. jnp.int32), the micro-batches of the window."
    )
  if not isinstance(arr, jax.core.Tracer) and int(arr) < 1:
    raise ValueError(
      f"The num_microbatches schedule returned {int(arr)}; it must return a positive int."
    )
  return arr.astype(jnp.int32)


def check_batch(batch: Any, num_microbatches: int) -> int:
  """Returns the batch size B, after checking every leaf has it, B > 0 and k divides it."""
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise ValueError(
      "batch has no array leaves; pass a pytree of arrays with a leading batch axis."
    )
  sizes = {jax.tree_util.keystr(path) or "batch": jnp.shape(x) for path, x in leaves}
  for name, shape in sizes.items():
    if not shape:
      raise ValueError(
        f"batch leaf {name} is a scalar; every batch leaf needs a leading batch dimension (pass"
        " constants through a closure or the params instead)."
      )
  sizes = {name: shape[0] for name, shape in sizes.items()}
  if len(set(sizes.values())) > 1:
    listing = ", ".join(f"{name}: {size}" for name, size in sizes.items())
    raise ValueError(
      f"batch leaves have different leading (batch) dimensions: {listing}. Every leaf must have"
      " the same batch size B on axis 0."
    )
  batch_size, k = next(iter(sizes.values())), num_microbatches
  if batch_size == 0:
    raise ValueError(
      "The batch is empty (batch size B=0): a window needs at least one row per micro-batch."
      " Skip empty batches in the data pipeline."
    )
  if batch_size % k:
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    shown = divisors if len(divisors) <= 12 else divisors[:6] + ["..."] + divisors[-3:]
    raise ValueError(
      f"batch size B={batch_size} is not divisible by num_microbatches k={k}. Use a batch size"
      f" that is a multiple of {k}, or a k that divides {batch_size} (divisors:"
      f" {', '.join(map(str, shown))})."
    )
  return batch_size


def check_weight(weight: Any, what: str = "weight") -> jax.Array:
  """A scalar float32 weight, or an error naming what gave it and its shape."""
  if not (hasattr(weight, "shape") or isinstance(weight, int | float)):
    raise TypeError(
      f"{what} must be a scalar number (the examples or tokens in the micro-batch), got"
      f" {type(weight).__name__}: {weight!r:.80}."
    )
  if jnp.shape(weight) != ():
    raise ValueError(
      f"{what} must be a scalar (the number of examples or tokens in the micro-batch), got an"
      f" array of shape {jnp.shape(weight)}. Reduce it, e.g. to mask.sum()."
    )
  if isinstance(weight, int | float) and weight < 0:  # concrete: refuse now (NaN voids)
    raise ValueError(f"{what} is {weight!r}; weights must be >= 0 (examples or tokens).")
  return jnp.asarray(weight, jnp.float32)


def check_same_structure(grads: Any, reference: Any, what: str) -> None:
  """Raises ValueError unless ``grads`` has the structure and shapes of ``reference``."""
  gdef, rdef = jax.tree.structure(grads), jax.tree.structure(reference)
  if gdef != rdef:
    raise ValueError(
      f"The {what} do not match the structure of the parameters that tx.init was called with."
      f"\n  {what}: {gdef}\n  params: {rdef}\nPass gradients with exactly the structure of the"
      " params (for equinox, filter both with the same eqx.filter)."
    )
  leaves = zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(reference), strict=True)
  for (path, g), r in leaves:
    if jnp.shape(g) != jnp.shape(r):
      raise ValueError(
        f"The {what} leaf at {jax.tree_util.keystr(path)} has shape {jnp.shape(g)}, but the"
        f" parameter has shape {jnp.shape(r)}."
      )


def check_trainable(params: Any, what: str = "params") -> None:
  """TypeError naming the first integer or bool leaf: gradients need float or complex leaves."""
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    if not is_inexact(x):
      dtype = jnp.result_type(x)
      name = "float0" if dtype == jax.dtypes.float0 else dtype
      raise TypeError(
        f"The {what} leaf {jax.tree_util.keystr(path) or what} has dtype {name}: only float"
        " and complex leaves can be trained. Keep integer or bool state (counters, masks)"
        " out of the differentiated params: pass it in the batch, a closure, or the model"
        " state (has_state=True); for equinox, filter with eqx.is_inexact_array."
      )


def check_real_microbatches(num_real: Any, k: int) -> jax.Array | None:
  """``num_real_microbatches``: None, or 1 <= m <= k (checked now when concrete) as int32."""
  if num_real is None:
    return None
  arr = jnp.asarray(num_real)
  if arr.shape != () or not jnp.issubdtype(arr.dtype, jnp.integer):
    raise TypeError(f"num_real_microbatches={num_real!r} must be an int or an int32 scalar array.")
  if not isinstance(arr, jax.core.Tracer) and not 1 <= int(arr) <= k:
    raise ValueError(
      f"num_real_microbatches={int(arr)} must be between 1 and the k={k} micro-batches the"
      " step was built for."
    )
  return arr.astype(jnp.int32)
