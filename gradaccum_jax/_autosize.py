"""Choosing the number of micro-batches from the compiled step's memory, without running it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._accumulate import Accumulate, accumulate
from gradaccum_jax._checks import check_batch, check_budget, check_num_microbatches
from gradaccum_jax._memory import (
  compiled_bytes,
  device_memory_budget,
  memory_analysis,
  unrolls_for,
)
from gradaccum_jax._options import check_unroll
from gradaccum_jax._train_step import train_step


def _memory_analysis(loss_fn, params, batch, k, tx, accum_dtype, **step_kwargs):
  """XLA's memory analysis of the fused step for ``k``, compiled on shapes (nothing runs)."""
  if isinstance(tx, Accumulate):
    raise TypeError(
      "tx is already a ga.accumulate(...) transformation; pass the inner optimizer"
      " (e.g. optax.adam(1e-3)): the number of micro-batches is what is being chosen."
    )
  acc_tx = accumulate(optax.sgd(0.0) if tx is None else tx, k, accum_dtype=accum_dtype)
  args = jax.eval_shape(lambda p, b: (p, acc_tx.init(p), b), params, batch)  # shapes only
  compiled = train_step(loss_fn, acc_tx, **step_kwargs).lower(*args).compile()
  return memory_analysis(compiled, "ga.auto_microbatch cannot size k; pick it by hand")


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
  unroll: int = 1,
) -> int:
  """Bytes the compiled fused step needs for ``num_microbatches`` micro-batches.

  ``temp + argument + output - alias`` of XLA's ``compiled.memory_analysis()`` for one device,
  with ``ga.train_step(loss_fn, ga.accumulate(tx, num_microbatches))`` compiled on the shapes of
  ``params`` and ``batch``: nothing runs (docs/choosing_k.md).

  Args:
    loss_fn, has_aux, weight_fn, compute_dtype, donate: as in :func:`train_step`.
    params, batch: arrays or ``jax.ShapeDtypeStruct`` leaves; ``batch`` of ``B`` rows.
    num_microbatches: ``k``; must divide ``B``.
    tx: the inner optimizer (its state counts); ``optax.sgd(0.0)`` (no state) by default.
    accum_dtype: as in :func:`accumulate`.
    unroll: micro-batches per trip of the loop, an int (:func:`train_step`).

  Returns:
    The estimated bytes, an int.

  Examples:
    >>> import jax, jax.numpy as jnp, gradaccum_jax as ga
    >>> loss_fn = lambda w, batch: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> batch = jax.eval_shape(lambda: {"x": jnp.ones((8, 3)), "y": jnp.ones(8)})  # shapes only
    >>> ga.step_memory(loss_fn, jnp.zeros(3), batch, num_microbatches=4) > 0
    True
  """
  k = check_num_microbatches(num_microbatches, allow_schedule=False)
  check_batch(batch, k)
  if check_unroll(unroll, "step_memory") == "auto":
    raise ValueError(
      "step_memory: unroll must be an int; ga.auto_microbatch(unroll='auto') picks one."
    )
  kwargs = dict(has_aux=has_aux, weight_fn=weight_fn, compute_dtype=compute_dtype, donate=donate)
  kwargs["unroll"] = unroll
  return compiled_bytes(_memory_analysis(loss_fn, params, batch, k, tx, accum_dtype, **kwargs))


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
  unroll: int | str = 1,
  return_estimates: bool = False,
) -> Any:
  """The fewest micro-batches ``k`` (largest micro-batch) whose fused step fits a budget.

  The first divisor ``k`` of the batch size ``B``, in increasing order, whose :func:`step_memory`
  is at most the budget; other arrays' memory is not counted (docs/choosing_k.md).

  Args:
    loss_fn, params, batch, has_aux, weight_fn, compute_dtype, accum_dtype, donate: as in
      :func:`step_memory`.
    tx: the inner optimizer you train with (not wrapped in :func:`accumulate`): its state counts.
    memory_budget_bytes: the bytes the step may use; by default the first device's
      ``memory_stats()["bytes_limit"]`` (GPU, TPU), required where there is none (CPU).
    unroll: an int (:func:`train_step`), or ``"auto"``: for the ``k`` found, also the largest
      unroll of 2, 4, ..., ``k`` that fits.
    return_estimates: also return the bytes of every ``k`` compiled.

  Returns:
    ``k`` (``(k, unroll)`` with ``unroll="auto"``); with ``return_estimates``,
    ``(that, {k: bytes})`` (``{(k, unroll): bytes}`` with ``unroll="auto"``).

  Examples:
    >>> import jax.numpy as jnp, gradaccum_jax as ga
    >>> loss_fn = lambda w, batch: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones(8)}
    >>> ga.auto_microbatch(loss_fn, jnp.zeros(3), batch, memory_budget_bytes=2**30)
    1
  """
  budget = memory_budget_bytes
  if budget is None:
    needs = "auto_microbatch compares the compiled step's memory with a budget"
    budget = device_memory_budget(jax.devices()[0], needs)
  check_budget(budget, "auto_microbatch")
  batch_size = check_batch(batch, 1)
  kwargs = dict(has_aux=has_aux, weight_fn=weight_fn, compute_dtype=compute_dtype, donate=donate)
  auto = check_unroll(unroll, "auto_microbatch") == "auto"
  estimates: dict[Any, int] = {}

  def fits(k: int, u: int) -> bool:
    nonlocal analysis
    analysis = _memory_analysis(loss_fn, params, batch, k, tx, accum_dtype, unroll=u, **kwargs)
    estimates[(k, u) if auto else k] = compiled_bytes(analysis)
    return compiled_bytes(analysis) <= budget

  analysis = None
  for k in (d for d in range(1, batch_size + 1) if batch_size % d == 0):
    if fits(k, 1 if auto else unroll):
      chosen = (k, next(u for u in unrolls_for(k) if u == 1 or fits(k, u))) if auto else k
      return (chosen, estimates) if return_estimates else chosen
  raise ValueError(
    f"Even one example per micro-batch (k = B = {batch_size}) needs {compiled_bytes(analysis)}"
    f" bytes (temp {analysis.temp_size_in_bytes}, arguments {analysis.argument_size_in_bytes},"
    f" outputs {analysis.output_size_in_bytes}, aliased {analysis.alias_size_in_bytes}) >"
    f" memory_budget_bytes={budget}; the arguments hold the whole batch, params, optimizer state"
    " and accumulator. Raise the budget, pass a smaller batch, use donate=True, or shrink the"
    " model (remat inside loss_fn, bf16 compute_dtype)."
  )
