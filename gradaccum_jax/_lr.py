"""Scaling a learning rate (and Adam's other hyperparameters) with the effective batch size."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import optax

from gradaccum_jax._checks import check_choice, check_int, check_positive_int

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


def _sqrt_rule_beta(name: str, beta: float, base: int, batch: int) -> float:
  """``1 - kappa * (1 - beta)``, or a ValueError naming ``name`` when it falls below 0."""
  kappa = batch / base
  new = 1.0 - kappa * (1.0 - beta)
  if abs(new) < 1e-12:  # rounding: 1 - 10 * (1 - 0.9) is 2.2e-16, not 0
    return 0.0
  if new > 0:
    return new
  limit = f"{base / (1.0 - beta):.6g}"
  if beta == 0:
    limit += f" ({name}=0 averages over one step already: no batch above {base} is in range)"
  raise ValueError(
    f"scale_adam_hyperparams: {name}={beta!r} is out of the square-root rule's range at kappa ="
    f" batch_size / base_batch_size = {batch}/{base} = {kappa:.6g}: the rule needs kappa * (1 -"
    f" {name}) <= 1 (here {kappa * (1.0 - beta):.6g}, which would make {name} = {new:.6g}),"
    f" i.e. batch_size <= base_batch_size / (1 - {name}) = {limit}. Use a batch_size within"
    f" that limit, {name} >= {1.0 - 1.0 / kappa:.6g}, rule='half_life' (it keeps b1 and holds"
    f" b2's half-life fixed, for any kappa), or keep {name} unscaled."
  )


def scale_adam_hyperparams(
  b1: float,
  b2: float,
  eps: float,
  base_batch_size: int,
  batch_size: int,
  *,
  rule: str = "sqrt",
) -> tuple[float, float, float]:
  r"""Adam's ``b1``, ``b2`` and ``eps`` tuned at ``base_batch_size``, for ``batch_size``.

  With :math:`\kappa` = ``batch_size / base_batch_size`` (:math:`\kappa = 1`: the inputs):

  - ``rule="sqrt"`` (Malladi et al.): :math:`1 - \beta_i \to \kappa (1 - \beta_i)` for both
    betas and :math:`\epsilon \to \epsilon / \sqrt{\kappa}`; needs :math:`\kappa (1 - \beta_i)
    \le 1`. The learning rate goes with ``scale_learning_rate(..., rule="sqrt")``.
  - ``rule="half_life"`` (Marek et al.): :math:`\beta_2 \to \beta_2^{\kappa}`, which keeps
    ``b2``'s half-life fixed in examples (tokens), for every :math:`\kappa`; ``b1`` and ``eps``
    are returned unchanged. To first order in :math:`1 - \beta_2` it is the ``"sqrt"`` rule's
    ``b2``: :math:`\beta_2^{\kappa} = 1 - \kappa (1 - \beta_2) + O((1 - \beta_2)^2)`.
    Sources, derivations and limits: docs/choosing_k.md.

  Args:
    b1, b2: Adam's first- and second-moment decays, in ``[0, 1)``.
    eps: Adam's epsilon, ``>= 0``.
    base_batch_size: the batch size they were tuned for.
    batch_size: the effective batch size to train with (``k * b``).
    rule: ``"sqrt"`` (the default) or ``"half_life"``.

  Returns:
    The tuple ``(b1, b2, eps)`` for ``batch_size``.

  Raises:
    ValueError: with ``rule="sqrt"``, a beta with ``kappa * (1 - beta) > 1``; a beta outside
      ``[0, 1)``, ``eps < 0``, a batch size ``<= 0`` or an unknown ``rule``.
    TypeError: a batch size that is not an int.

  Examples:
    >>> import gradaccum_jax as ga
    >>> [round(x, 12) for x in ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, 256, 1024)]
    [0.6, 0.996, 5e-09]
    >>> b1, b2, eps = ga.scale_adam_hyperparams(0.9, 0.95, 1e-8, 256, 512, rule="half_life")
    >>> b1, round(b2, 12), eps  # b2 = 0.95 ** 2
    (0.9, 0.9025, 1e-08)

  References:
    Malladi et al. 2022, https://arxiv.org/abs/2205.10287; Marek et al. 2025,
    https://arxiv.org/abs/2507.07101.
  """
  kappa = _kappa(base_batch_size, batch_size)
  check_choice(rule, "rule", ("sqrt", "half_life"), "scale_adam_hyperparams")
  if not eps >= 0:
    raise ValueError(f"eps={eps!r} must be >= 0.")
  for name, beta in (("b1", b1), ("b2", b2)):
    if not 0 <= beta < 1:
      raise ValueError(f"{name}={beta!r} must be in [0, 1).")
  if kappa == 1:
    return b1, b2, eps
  if rule == "half_life":
    return b1, b2**kappa, eps
  base, batch = operator.index(base_batch_size), operator.index(batch_size)
  b1, b2 = _sqrt_rule_beta("b1", b1, base, batch), _sqrt_rule_beta("b2", b2, base, batch)
  return b1, b2, eps / math.sqrt(kappa)
