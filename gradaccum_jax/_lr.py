"""Scaling a learning rate (and Adam's other hyperparameters) with the effective batch size."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import optax

from gradaccum_jax._checks import check_int, check_positive_int

_RULES = {"linear": lambda kappa: kappa, "sqrt": math.sqrt, "none": lambda kappa: 1.0}
_WARMUP_FROM = {"base": 1.0, "zero": 0.0}  # the multiplier the warmup starts from


def _kappa(base_batch_size: Any, batch_size: Any) -> float:
  """``batch_size / base_batch_size``, after checking both are positive ints."""
  for name, value in (("base_batch_size", base_batch_size), ("batch_size", batch_size)):
    check_positive_int(value, f"{name}={value!r} must be a positive int (a number of examples).")
  return operator.index(batch_size) / operator.index(base_batch_size)


def scale_learning_rate(
  learning_rate: float | Callable[[Any], Any],
  base_batch_size: int,
  batch_size: int,
  *,
  rule: str = "linear",
  warmup_steps: int = 0,
  warmup_from: str = "base",
) -> float | Callable[[Any], Any]:
  r"""Scales a learning rate tuned at ``base_batch_size`` for a batch of ``batch_size``.

  The learning rate is multiplied by a factor ``f`` of :math:`\kappa` = ``batch_size /
  base_batch_size``; with warmup, at step ``count``, by ``f0 + (f - f0) * min(count /
  warmup_steps, 1)``. Starting points to tune around (the rules' sources and where they hold:
  docs/choosing_k.md).

  Args:
    learning_rate: a float or an optax schedule, tuned at ``base_batch_size``.
    base_batch_size: the examples per step it was tuned for, a positive int.
    batch_size: the effective batch size (``k * b`` with accumulation), a positive int.
    rule: ``f`` is :math:`\kappa` (``"linear"``), :math:`\sqrt{\kappa}` (``"sqrt"``, for
      Adam-type optimizers, with :func:`scale_adam_hyperparams`) or 1 (``"none"``).
    warmup_steps: optimizer steps (windows, not micro-batches) of linear warmup; 0 for none.
    warmup_from: ``f0`` is 1 (``"base"``, the unscaled learning rate) or 0 (``"zero"``).

  Returns:
    A float for a float ``learning_rate`` without warmup, else a schedule ``count -> lr``.

  Raises:
    ValueError: an unknown ``rule`` or ``warmup_from``, a batch size ``<= 0``, warmup ``< 0``.
    TypeError: a batch size or warmup not an int, a ``learning_rate`` not a number or callable.

  Examples:
    >>> import gradaccum_jax as ga
    >>> ga.scale_learning_rate(0.1, base_batch_size=256, batch_size=1024)
    0.4
    >>> schedule = ga.scale_learning_rate(0.1, 256, 1024, warmup_steps=100)
    >>> [round(float(schedule(n)), 6) for n in (0, 50, 100, 1000)]
    [0.1, 0.25, 0.4, 0.4]

  References:
    Goyal et al. 2017, https://arxiv.org/abs/1706.02677; Malladi et al. 2022,
    https://arxiv.org/abs/2205.10287.
  """
  kappa = _kappa(base_batch_size, batch_size)
  if rule not in _RULES:
    raise ValueError(f"rule={rule!r} is not a scaling rule; use one of {', '.join(_RULES)}.")
  if check_int(warmup_steps, f"{warmup_steps=} must be an int >= 0 (optimizer steps).") < 0:
    raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 (0 for no warmup).")
  if warmup_from not in _WARMUP_FROM:
    raise ValueError(f"warmup_from={warmup_from!r} must be one of {', '.join(_WARMUP_FROM)}.")
  factor, start, steps = _RULES[rule](kappa), _WARMUP_FROM[warmup_from], int(warmup_steps)
  schedule = learning_rate
  if not callable(learning_rate):
    try:
      schedule = optax.constant_schedule(float(learning_rate))
    except (TypeError, ValueError):
      raise TypeError(f"{learning_rate=} must be a float or an optax schedule.") from None
    if steps == 0:
      return float(learning_rate) * factor
  ramp = optax.linear_schedule(start, factor, steps) if steps else optax.constant_schedule(factor)
  return lambda count: ramp(count) * schedule(count)


def scale_adam_hyperparams(
  b1: float, b2: float, eps: float, base_batch_size: int, batch_size: int
) -> tuple[float, float, float]:
  r"""Adam's ``b1``, ``b2`` and ``eps`` under the square-root scaling rule (Malladi et al.).

  :math:`1 - \beta_i \to \kappa (1 - \beta_i)` and :math:`\epsilon \to \epsilon / \sqrt{\kappa}`
  with :math:`\kappa` = ``batch_size / base_batch_size``, for ``kappa * (1 - beta_i) < 1``; the
  learning rate goes with ``rule="sqrt"`` (source, derivation, limits: docs/choosing_k.md).

  Args:
    b1, b2: Adam's first- and second-moment decays, in ``[0, 1)``.
    eps: Adam's epsilon, ``>= 0``.
    base_batch_size: the batch size they were tuned for.
    batch_size: the effective batch size to train with (``k * b``).

  Returns:
    The tuple ``(b1, b2, eps)`` for ``batch_size``.

  Raises:
    ValueError: a scaled beta ``<= 0`` (the batch too large), a beta outside ``[0, 1)``,
      ``eps < 0``, or a batch size ``<= 0``.
    TypeError: a batch size that is not an int.

  Examples:
    >>> import gradaccum_jax as ga
    >>> [round(x, 12) for x in ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, 256, 1024)]
    [0.6, 0.996, 5e-09]

  References:
    Malladi et al. 2022, https://arxiv.org/abs/2205.10287.
  """
  kappa = _kappa(base_batch_size, batch_size)
  if not eps >= 0:
    raise ValueError(f"eps={eps!r} must be >= 0.")
  scaled = []
  for name, beta in (("b1", b1), ("b2", b2)):
    if not 0 <= beta < 1:
      raise ValueError(f"{name}={beta!r} must be in [0, 1).")
    new = 1.0 - kappa * (1.0 - beta)
    new = 0.0 if abs(new) < 1e-12 else new  # rounding: 1 - 10 * (1 - 0.9) is 2e-16, not 0
    if new <= 0:
      raise ValueError(
        f"The square-root rule gives {name} = 1 - kappa * (1 - {name}) = {new:.6g} <= 0 for"
        f" kappa = batch_size / base_batch_size = {batch_size}/{base_batch_size} = {kappa:.6g}"
        f" and {name}={beta!r}: the batch is too large for the rule. Use batch_size <"
        f" {base_batch_size / (1.0 - beta):.6g}, or keep {name} unscaled."
      )
    scaled.append(new)
  return scaled[0], scaled[1], eps / math.sqrt(kappa)
