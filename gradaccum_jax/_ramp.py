"""Batch-size ramps for the fused step: one compiled program per distinct number of micro-batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from gradaccum_jax._accumulate import AccumulateState, accumulate
from gradaccum_jax._checks import check_num_microbatches
from gradaccum_jax._train_step import train_step


def ramp_train_step(
  loss_fn: Callable[..., Any],
  inner: optax.GradientTransformation,
  *,
  accumulate_kwargs: dict[str, Any] | None = None,
  **train_step_kwargs: Any,
) -> Callable[..., Any]:
  r"""A fused step whose number of micro-batches ``k`` may change from window to window.

  ``step(num_microbatches, *args, **kwargs)`` runs :func:`train_step` for
  ``ga.accumulate(inner, num_microbatches)`` on ``*args`` (``params, state,
  batch`` or, with ``has_state=True``, ``params, model_state, state, batch``).
  The state does not depend on ``k`` (``step.init(params)`` makes it), so one
  state carries through a ramp; each distinct ``k`` is compiled once and
  cached, so a ramp over ``n`` values costs ``n`` compiles. Grow the batch with
  ``k`` (``B = k * b``) to raise the effective batch at constant memory. The
  inner optimizer's counters and schedules see one step per window whatever
  ``k`` is; rescale the learning rate with :func:`scale_learning_rate` if the
  recipe asks for it.

  A ramp driven by the noise-scale estimate (:func:`noise_scale`, with
  ``accumulate_kwargs={"noise_scale_ema": 0.99}``) picks ``k`` so that the
  effective batch tracks the critical batch size ``B_simple``, e.g.
  ``k = min(k_max, max(1, 2 ** round(log2(B_simple / b))))``.

  Args:
    loss_fn: as in :func:`train_step`.
    inner: the optimizer applied once per window.
    accumulate_kwargs: keyword arguments of :func:`accumulate` (``accum_dtype``,
      ``skip_nonfinite``, ``loss_scale``, ``noise_scale_ema``).
    **train_step_kwargs: keyword arguments of :func:`train_step`.

  Returns:
    ``step(num_microbatches, *args, **kwargs)``, with ``step.init(params)`` and
    ``step.compiled_ks()`` (the values of ``k`` compiled so far).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> def loss_fn(w, mb):
    ...   return jnp.mean((mb["x"] @ w - mb["y"]) ** 2)
    >>> step = ga.ramp_train_step(loss_fn, optax.sgd(0.1))
    >>> params = jnp.zeros(2)
    >>> state = step.init(params)
    >>> for k in (1, 2, 4, 4):  # micro-batches of 8 rows; the batch grows with k
    ...   batch = {"x": jnp.ones((8 * k, 2)), "y": jnp.ones(8 * k)}
    ...   params, state, metrics = step(k, params, state, batch)
    >>> int(state.count), step.compiled_ks()
    (4, [1, 2, 4])
  """
  acc_kwargs = dict(accumulate_kwargs or {})
  accumulate(inner, 1, **acc_kwargs)  # bad settings fail now, not at the first step
  steps: dict[int, Callable[..., Any]] = {}

  def step(num_microbatches: int, *args: Any, **kwargs: Any) -> Any:
    k = check_num_microbatches(num_microbatches, allow_schedule=False)
    if k not in steps:  # train_step takes this k as it is: no second check
      steps[k] = train_step(loss_fn, accumulate(inner, k, **acc_kwargs), **train_step_kwargs)
    return steps[k](*args, **kwargs)

  def init(params: optax.Params) -> AccumulateState:
    return accumulate(inner, 1, **acc_kwargs).init(params)

  step.init = init
  step.compiled_ks = lambda: sorted(steps)
  return step
