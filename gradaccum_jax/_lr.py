"""Scaling a learning rate (and Adam's other hyperparameters) with the effective batch size."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import optax

from gradaccum_jax._checks import check_choice, check_int, check_positive_int, check_real

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
  """Scales a learning rate tuned at ``base_batch_size`` for a batch of ``batch_size``.

  η → f η, f = κ, √κ or 1 by ``rule``, κ = ``batch_size / base_batch_size``; warmup ramps to f.

  Args:
    learning_rate: a float or an optax schedule, tuned at ``base_batch_size``.
    base_batch_size, batch_size: the tuned and the effective (``k * b``) batch, positive ints.
    rule: ``"linear"``, ``"sqrt"`` (Adam-type optimizers) or ``"none"``.
    warmup_steps: optimizer steps (windows, not micro-batches) of linear warmup; 0 for none.
    warmup_from: ``"base"`` (the warmup starts at ``learning_rate``) or ``"zero"``.

  Returns:
    A float for a float ``learning_rate`` without warmup, else a schedule ``count -> lr``.

  Examples:
    >>> import gradaccum_jax as ga
    >>> warm = ga.scale_learning_rate(0.1, 256, 1024, warmup_steps=100)  # 0.1 -> 0.4 in 100 steps
    >>> ga.scale_learning_rate(0.1, base_batch_size=256, batch_size=1024), float(warm(50))
    (0.4, 0.25)

  References:
    Goyal et al., https://arxiv.org/abs/1706.02677; Malladi et al., https://arxiv.org/abs/2205.10287
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
  """Adam's ``b1``, ``b2`` and ``eps`` tuned at ``base_batch_size``, for ``batch_size``.

  ``"sqrt"``: 1 − βᵢ → κ (1 − βᵢ), ε → ε / √κ; ``"half_life"``: β₂ → β₂^κ (docs/choosing_k.md).

  Args:
    b1, b2, eps: Adam's first- and second-moment decays, in ``[0, 1)``, and epsilon, ``>= 0``.
    base_batch_size, batch_size: as in :func:`scale_learning_rate`, κ their ratio.
    rule: ``"sqrt"`` (with ``scale_learning_rate(..., rule="sqrt")``) or ``"half_life"``.

  Returns:
    The tuple ``(b1, b2, eps)`` for ``batch_size``.

  Examples:
    >>> import gradaccum_jax as ga
    >>> [round(x, 12) for x in ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, 256, 1024)]
    [0.6, 0.996, 5e-09]
    >>> ga.scale_adam_hyperparams(0.9, 0.95, 1e-8, 256, 512, rule="half_life")  # b2 = 0.95**2
    (0.9, 0.9025, 1e-08)

  References:
    Malladi et al., https://arxiv.org/abs/2205.10287; Marek et al., https://arxiv.org/abs/2507.07101
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


def scale_weight_decay(
  weight_decay: float, base_batch_size: int, batch_size: int, *, lr_rule: str = "none"
) -> float:
  """Scales AdamW's weight decay tuned at ``base_batch_size`` for a batch of ``batch_size``.

  λ → κ λ / f keeps AdamW's timescale B / (η λ D) fixed (docs/choosing_k.md).

  Args:
    weight_decay: ``optax.adamw``'s ``weight_decay`` λ, ``>= 0``, tuned at ``base_batch_size``.
    base_batch_size, batch_size: as in :func:`scale_learning_rate`, κ their ratio.
    lr_rule: the ``rule`` that scaled the learning rate η by f; ``"none"`` (f = 1): λ → κ λ.

  Returns:
    The weight decay for ``batch_size``, a float.

  Examples:
    >>> import gradaccum_jax as ga
    >>> [ga.scale_weight_decay(0.1, 256, 1024, lr_rule=r) for r in ("none", "sqrt", "linear")]
    [0.4, 0.2, 0.1]

  References:
    Bergsma et al., https://arxiv.org/abs/2505.13738
  """
  kappa = _kappa(base_batch_size, batch_size)
  check_choice(lr_rule, "lr_rule", tuple(_RULES), "scale_weight_decay")
  if not check_real(weight_decay, f"scale_weight_decay: {weight_decay=} must be a float") >= 0:
    raise ValueError(f"scale_weight_decay: {weight_decay=} must be >= 0 (0 for no decay).")
  return float(weight_decay) * kappa / _RULES[lr_rule](kappa)
