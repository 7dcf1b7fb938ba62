"""Batch-size ramps for the fused step: one compiled program per distinct number of micro-batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from gradaccum_jax._accumulate import accumulate
from gradaccum_jax._checks import check_num_microbatches
from gradaccum_jax._train_step import train_step


def ramp_train_step(
  loss_fn: Callable[..., Any],
  inner: optax.GradientTransformation,
  *,
  accumulate_kwargs: dict[str, Any] | None = None,
  **train_step_kwargs: Any,
) -> Callable[..., Any]:
  """A fused step whose number of micro-batches ``k`` may change from window to window.

  ``step(k, params, [model_state,] state, batch)`` is :func:`train_step` for
  ``ga.accumulate(inner, k)``, compiled once per ``k``, one state for all (docs/choosing_k.md).

  Args:
    loss_fn: as in :func:`train_step`.
    inner: the optimizer applied once per window.
    accumulate_kwargs: keyword arguments of :func:`accumulate`; the others go to :func:`train_step`.

  Returns:
    ``step``, with ``step.init(params)`` and ``step.compiled_ks()`` (the ``k`` compiled so far).

  Examples:
    >>> import jax.numpy as jnp, optax, gradaccum_jax as ga
    >>> step = ga.ramp_train_step(lambda w, mb: jnp.mean((mb @ w) ** 2), optax.sgd(0.1))
    >>> params, state = jnp.ones(2), step.init(jnp.ones(2))
    >>> for k in (1, 2, 4, 4):  # micro-batches of 8 rows; the batch grows with k
    ...   params, state, metrics = step(k, params, state, jnp.ones((8 * k, 2)))
    >>> int(state.count), step.compiled_ks()
    (4, [1, 2, 4])
  """
  acc_kwargs, steps = dict(accumulate_kwargs or {}), {}

  def step(num_microbatches: int, *args: Any, **kwargs: Any) -> Any:
    k = check_num_microbatches(num_microbatches, allow_schedule=False)
    if k not in steps:  # train_step takes this k as it is: no second check
      steps[k] = train_step(loss_fn, accumulate(inner, k, **acc_kwargs), **train_step_kwargs)
    return steps[k](*args, **kwargs)

  step.init = accumulate(inner, 1, **acc_kwargs).init  # bad settings fail now, not at a step
  step.compiled_ks = lambda: sorted(steps)
  return step
