"""Checks of user input, each written once and called at the boundary of the public functions."""

from __future__ import annotations

import contextlib
import numbers
import operator
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# An int, or a schedule ``count -> int`` (``count``: windows closed so far).
NumMicrobatches = int | Callable[[jax.Array], Any]


def check_real(value: Any, must: str) -> float:
  """``value`` as a float; a TypeError ``"{must}, got {value!r}."`` unless real (not a bool)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{must}, got {value!r}.")
  return float(value)


def check_int(value: Any, must: str) -> int:
  """``value`` as an int, or a TypeError ``"{must}"``: an integer, not a bool."""
  if isinstance(value, bool) or not hasattr(value, "__index__"):
    raise TypeError(must)
  return operator.index(value)


def check_bool(value: Any, name: str) -> bool:
  """``value``, or a TypeError naming ``name``: True or False (a NumPy bool too)."""
  if not isinstance(value, bool | np.bool_):
    raise TypeError(f"{name} must be True or False, got {value!r}.")
  return bool(value)


def check_positive_int(value: Any, must: str) -> int:
  """``value`` as an int; ``"{must}"`` as a TypeError (not an int) or ValueError (below 1)."""
  if (n := check_int(value, must)) <= 0:
    raise ValueError(must)
  return n


def check_choice(value: Any, name: str, choices: Any, where: str | None = None) -> None:
  """A ValueError naming ``name`` (and ``where``, if given) unless ``value`` is in ``choices``."""
  if value not in choices:
    prefix = "" if where is None else f"{where}: "
    raise ValueError(f"{prefix}{name}={value!r} must be one of {', '.join(map(repr, choices))}.")


def check_decay(value: Any, name: str, example: str) -> float:
  """``value`` as a float in ``[0, 1)``; ``example`` follows "e.g." in the errors."""
  value = check_real(value, f"{name} must be a float decay in [0, 1) (e.g. {example}) or None")
  if not 0.0 <= value < 1.0:
    raise ValueError(f"{name} must be a decay in [0, 1) (e.g. {example}), got {value!r}.")
  return value


def check_function(value: Any, must: str) -> None:
  """A TypeError ``"{must}, got {value!r:.80}."`` unless ``value`` is callable."""
  if not callable(value):
    raise TypeError(f"{must}, got {value!r:.80}.")


def check_float_dtype(dtype: Any, name: str, where: str) -> Any:
  """``dtype`` as a NumPy dtype, or a ValueError: it must be a float dtype."""
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{where}: {name}={dtype} must be a float dtype.")
  return dtype


def check_aux_reduce(spec: Any, has_aux: bool, names: tuple[str, ...], where: str,
                     what: str = "aux_reduce") -> None:  # fmt: skip
  """``aux_reduce``'s (or ``what``'s) leaves each one of ``names``, given only with ``has_aux``."""
  leaves = jax.tree.leaves(spec)
  if leaves and not has_aux:
    raise ValueError(f"{where}: {what}={spec!r} is given without has_aux=True.")
  for name in leaves:
    if name not in names:
      raise ValueError(
        f"{where}: {what} names the reducer {name!r}; each leaf must be one of"
        f" {names} (or None for the default)."
      )


def is_inexact(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def is_running_mean(acc: Any) -> bool:
  """Whether a leaf keeps a running mean, not a sum: a float under 32 bits (its sum overflows)."""
  dtype = jnp.result_type(acc)
  return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def check_num_microbatches(
  num_microbatches: Any, *, allow_schedule: bool, where: str = "A fused step"
) -> NumMicrobatches:
  """A positive int, or a schedule if allowed (if not, the TypeError names ``where``)."""
  if callable(num_microbatches) and not isinstance(num_microbatches, type):
    if allow_schedule:
      return num_microbatches
    raise TypeError(
      f"{where} needs a fixed int number of micro-batches per window, got the schedule"
      f" {num_microbatches=}. Pass an int to ga.accumulate, drive a schedule with tx.update"
      " (streaming mode), or use ga.ramp_train_step."
    )
  must = f"{num_microbatches=} must be a positive int (micro-batches per optimizer step)."
  return check_positive_int(num_microbatches, must)


def check_migrated(unexpected: dict[str, Any]) -> None:
  """A TypeError for an argument ``accumulate`` does not take (``every_k_schedule``: the fix)."""
  if "every_k_schedule" in unexpected:
    raise TypeError(
      f"every_k_schedule={unexpected['every_k_schedule']!r} is optax.MultiSteps' argument;"
      " ga.accumulate calls it num_microbatches: ga.accumulate(opt, num_microbatches=k)."
    )
  if unexpected:
    raise TypeError(f"accumulate() got an unexpected keyword argument {next(iter(unexpected))!r}")


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
  shapes = {jax.tree_util.keystr(path) or "batch": jnp.shape(x) for path, x in leaves}
  for name, shape in shapes.items():
    if not shape:
      raise ValueError(
        f"batch leaf {name} is a scalar; every batch leaf needs a leading batch dimension (pass"
        " constants through a closure or the params instead)."
      )
  sizes = {name: shape[0] for name, shape in shapes.items()}
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


def check_weight(
  weight: Any, what: str = "weight", means: str = "the examples or tokens in the micro-batch"
) -> jax.Array:
  """A scalar float32 weight, or an error naming what gave it, its shape and what it ``means``."""
  if hasattr(weight, "shape") or isinstance(weight, int | float):
    if jnp.shape(weight) != ():
      raise ValueError(
        f"{what} must be a scalar ({means}), got an array of shape {jnp.shape(weight)}. Reduce"
        " it, e.g. to mask.sum()."
      )
    if isinstance(weight, int | float) and weight < 0:  # concrete: refuse now
      raise ValueError(f"{what} is {weight!r}; weights must be >= 0 ({means}).")
    with contextlib.suppress(TypeError):  # an array JAX cannot hold (strings)
      return jnp.asarray(weight, jnp.float32)
  raise TypeError(
    f"{what} must be a scalar number ({means}), got {type(weight).__name__}: {weight!r:.80}."
  )


def check_same_structure(grads: Any, reference: Any, what: str) -> None:
  """Raises ValueError unless ``grads`` has the structure and shapes of ``reference``."""
  gdef, rdef = jax.tree.structure(grads), jax.tree.structure(reference)
  if gdef != rdef:
    order = " (a step takes params, opt_state, batch, in that order)" if what == "params" else ""
    raise ValueError(
      f"The {what} do not match the structure of the parameters that tx.init was called with."
      f"\n  {what} passed: {gdef}\n  tx.init(params): {rdef}\nPass {what} with exactly the"
      f" structure of the params{order} (for equinox, filter both with the same eqx.filter)."
    )
  leaves = zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(reference), strict=True)
  for (path, g), r in leaves:
    if jnp.shape(g) != jnp.shape(r):
      raise ValueError(
        f"The {what} leaf at {jax.tree_util.keystr(path)} has shape {jnp.shape(g)}, but the"
        f" parameter has shape {jnp.shape(r)}."
      )


def check_trainable(params: Any, what: str = "params", where: str | None = None) -> None:
  """A TypeError for an int or bool leaf or (with ``where``) an NNX module's non-Param state."""
  nnx = sys.modules.get("flax.nnx")  # imported by the user if params can be a module
  if where is not None and nnx is not None and isinstance(params, nnx.Module):
    others = nnx.state(params, nnx.Not(nnx.Param))
    variables = jax.tree.leaves(others, is_leaf=lambda v: isinstance(v, nnx.Variable))
    kinds = sorted({type(v).__name__ for v in variables})
    if kinds:
      raise TypeError(
        f"{where}: {what} is an nnx.{type(params).__name__} with variables other than nnx.Param"
        f" ({', '.join(kinds)}), which {where} would differentiate and update as params. Use"
        " ga.nnx_train_step(loss_fn) with nnx.Optimizer(model, tx, wrt=nnx.Param), or split"
        " the module: graphdef, params, rest = nnx.split(model, nnx.Param, ...); pass params,"
        " and rest as the model state (has_state=True) of loss_fn(params, rest, microbatch),"
        " which calls nnx.merge(graphdef, params, rest) (docs/models.md)."
      )
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


def check_budget(budget: Any, where: str) -> None:
  """``memory_budget_bytes``, checked: a number of bytes > 0."""
  must = f"{where}: memory_budget_bytes={budget!r} must be"
  if not check_real(budget, f"{must} a number of bytes") > 0:
    raise ValueError(f"{must} > 0.")
