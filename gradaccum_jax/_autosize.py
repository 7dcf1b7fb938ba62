"""Choosing the number of micro-batches from the compiled step's memory, without running it."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._accumulate import Accumulate, accumulate
from gradaccum_jax._checks import check_batch, check_num_microbatches
from gradaccum_jax._train_step import train_step


def _abstract(tree: Any) -> Any:
  """``tree`` as ``jax.ShapeDtypeStruct`` leaves (arrays or structs in, nothing computed)."""
  return jax.eval_shape(lambda t: t, tree)


def _memory_analysis(
  loss_fn, params, batch, k, tx, has_aux, weight_fn, compute_dtype, accum_dtype, donate
):
  if tx is None:
    tx = optax.sgd(0.0)
  if isinstance(tx, Accumulate):
    raise TypeError(
      "tx is already a ga.accumulate(...) transformation; pass the inner optimizer"
      " (e.g. optax.adam(1e-3)): the number of micro-batches is what is being chosen."
    )
  acc_tx = accumulate(tx, k, accum_dtype=accum_dtype)
  params_s = _abstract(params)
  state_s = jax.eval_shape(acc_tx.init, params_s)
  step = train_step(
    loss_fn,
    acc_tx,
    has_aux=has_aux,
    weight_fn=weight_fn,
    compute_dtype=compute_dtype,
    donate=donate,
  )
  compiled = step.lower(params_s, state_s, _abstract(batch)).compile()
  analysis = compiled.memory_analysis()
  if analysis is None:
    raise RuntimeError(
      f"The {jax.default_backend()} backend returns no compiled.memory_analysis(), so the"
      " step's memory cannot be estimated; choose num_microbatches by hand."
    )
  return analysis


def _total(analysis) -> int:
  return int(
    analysis.temp_size_in_bytes
    + analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
  )


def step_memory(
  loss_fn: Callable[..., Any],
  params: Any,
  batch: Any,
  num_microbatches: int,
  tx: optax.GradientTransformation | None = None,
  *,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  compute_dtype: Any = None,
  accum_dtype: Any = jnp.float32,
  donate: bool = False,
) -> int:
  """Bytes the compiled fused step needs for ``num_microbatches`` micro-batches.

  Lowers and compiles ``ga.train_step(loss_fn, ga.accumulate(tx,
  num_microbatches))`` on ``jax.ShapeDtypeStruct`` versions of ``params`` and
  ``batch`` (nothing runs on the device) and reads XLA's
  ``compiled.memory_analysis()``. The estimate is

  ``temp + argument + output - alias`` bytes:

  the scratch memory of the program (activations of one micro-batch, the local
  accumulator), its inputs (params, the accumulator state with the inner
  optimizer's state, and the whole batch), its outputs (new params, state,
  metrics), less the outputs that reuse an input's buffer (with
  ``donate=True``). The code size and memory held by other live arrays are not
  counted. It is XLA's static plan for one device; the allocator's
  fragmentation can add to it. XLA:CPU reports little or no temp memory for
  small programs.

  Args:
    loss_fn: as in :func:`train_step`.
    params: the params, as arrays or ``jax.ShapeDtypeStruct`` leaves.
    batch: one whole batch of ``B`` rows (arrays or ``jax.ShapeDtypeStruct``).
    num_microbatches: ``k``; must divide ``B``.
    tx: the inner optimizer (its state counts among the arguments);
      ``optax.sgd(0.0)`` (no state) by default.
    has_aux, weight_fn, compute_dtype, donate: as in :func:`train_step`.
    accum_dtype: as in :func:`accumulate`.

  Returns:
    The estimated bytes, an int.

  Raises:
    ValueError: if ``num_microbatches`` does not divide the batch size or the
      batch is malformed.
    TypeError: if ``tx`` is already made by :func:`accumulate`.
    RuntimeError: if the backend gives no memory analysis.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import gradaccum_jax as ga
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> params = jax.ShapeDtypeStruct((3,), jnp.float32)
    >>> batch = {"x": jax.ShapeDtypeStruct((8, 3), jnp.float32),
    ...          "y": jax.ShapeDtypeStruct((8,), jnp.float32)}
    >>> ga.step_memory(loss_fn, params, batch, num_microbatches=4) > 0
    True
  """
  k = check_num_microbatches(num_microbatches, allow_schedule=False)
  check_batch(_abstract(batch), k)
  analysis = _memory_analysis(
    loss_fn, params, batch, k, tx, has_aux, weight_fn, compute_dtype, accum_dtype, donate
  )
  return _total(analysis)


def _default_budget() -> int:
  device = jax.devices()[0]
  stats = device.memory_stats()
  if not stats or "bytes_limit" not in stats:
    raise ValueError(
      f"The default device ({device.platform}: {device}) reports no memory limit"
      f" (memory_stats() is {stats!r}), so there is no default budget. Pass"
      " memory_budget_bytes=, the bytes the training step may use."
    )
  return int(stats["bytes_limit"])


def auto_microbatch(
  loss_fn: Callable[..., Any],
  params: Any,
  batch: Any,
  tx: optax.GradientTransformation | None = None,
  *,
  memory_budget_bytes: int | None = None,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  compute_dtype: Any = None,
  accum_dtype: Any = jnp.float32,
  donate: bool = False,
  return_estimates: bool = False,
) -> int | tuple[int, dict[int, int]]:
  """The fewest micro-batches ``k`` (largest micro-batch) whose fused step fits a budget.

  For the divisors ``k`` of the batch size ``B`` in increasing order, compiles
  ``ga.train_step(loss_fn, ga.accumulate(tx, k))`` on abstract shapes (see
  :func:`step_memory`: nothing executes, no trial runs that could run out of
  memory) and returns the first ``k`` whose estimated
  ``temp + argument + output - alias`` bytes are at most the budget, i.e. the
  largest micro-batch ``b = B / k`` that fits. The search is linear and stops
  at the first fit, so it compiles one program per divisor up to the answer.
  It does not assume the estimate shrinks as ``k`` grows (no binary search):
  it does not always, e.g. on XLA:CPU ``k = 1`` (no accumulator in the loop)
  can need less temp memory than ``k = 2``.

  The arguments include the whole batch and the params, optimizer state and
  fp32 accumulator, which do not shrink with ``k``; only the temp memory of
  one micro-batch does. Memory held by other arrays is not counted, so leave a
  margin in the budget (a tenth of the device's limit, say).

  Args:
    loss_fn: as in :func:`train_step`.
    params: the params, as arrays or ``jax.ShapeDtypeStruct`` leaves.
    batch: one whole batch of ``B`` rows (arrays or ``jax.ShapeDtypeStruct``).
    tx: the inner optimizer (not wrapped in :func:`accumulate`);
      ``optax.sgd(0.0)`` by default. Pass the one you train with: its state
      counts.
    memory_budget_bytes: the bytes the step may use. By default the first
      device's ``memory_stats()["bytes_limit"]`` (GPU, TPU); required on
      backends that report none, such as CPU.
    has_aux, weight_fn, compute_dtype, donate: as in :func:`train_step`.
    accum_dtype: as in :func:`accumulate`.
    return_estimates: also return the estimated bytes of every ``k`` compiled.

  Returns:
    ``k``, a divisor of ``B``; with ``return_estimates``, ``(k, {k: bytes})``
    over the divisors tried.

  Raises:
    ValueError: with no budget where the device reports no limit, a budget
      ``<= 0``, a malformed batch, or when even ``k = B`` (one example per
      micro-batch) does not fit: the message gives that step's bytes and the
      budget.
    TypeError: if ``tx`` is already made by :func:`accumulate`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import gradaccum_jax as ga
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> params = jnp.zeros(3)
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones(8)}
    >>> ga.auto_microbatch(loss_fn, params, batch, memory_budget_bytes=2**30)
    1
  """
  if memory_budget_bytes is None:
    budget = _default_budget()
  else:
    if isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, numbers.Real):
      raise TypeError(
        f"memory_budget_bytes={memory_budget_bytes!r} must be a number of bytes (an int)."
      )
    if not memory_budget_bytes > 0:
      raise ValueError(f"memory_budget_bytes={memory_budget_bytes!r} must be > 0.")
    budget = memory_budget_bytes
  batch_s = _abstract(batch)
  batch_size = check_batch(batch_s, 1)
  divisors = [k for k in range(1, batch_size + 1) if batch_size % k == 0]
  estimates: dict[int, int] = {}
  analysis = None
  for k in divisors:
    analysis = _memory_analysis(
      loss_fn, params, batch_s, k, tx, has_aux, weight_fn, compute_dtype, accum_dtype, donate
    )
    estimates[k] = _total(analysis)
    if estimates[k] <= budget:
      return (k, estimates) if return_estimates else k
  raise ValueError(
    f"Even one example per micro-batch (k = B = {batch_size}) needs"
    f" {estimates[batch_size]} bytes (temp {analysis.temp_size_in_bytes}, arguments"
    f" {analysis.argument_size_in_bytes}, outputs {analysis.output_size_in_bytes}, aliased"
    f" {analysis.alias_size_in_bytes}), more than memory_budget_bytes={budget}. The"
    " arguments include the whole batch and the params, optimizer state and accumulator:"
    " raise the budget, pass a smaller batch, use donate=True, or shrink the model"
    " (remat inside loss_fn, bf16 compute_dtype)."
  )
