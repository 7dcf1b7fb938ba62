"""Scaling a learning rate (and Adam's other hyperparameters) with the effective batch size."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

_RULES = ("linear", "sqrt", "none")
_WARMUP_FROM = ("base", "zero")


def _check_batch_size(value: Any, name: str) -> int:
  if isinstance(value, bool) or not hasattr(value, "__index__"):
    raise TypeError(
      f"{name}={value!r} must be a positive int (a number of examples), got {type(value).__name__}."
    )
  value = operator.index(value)
  if value <= 0:
    raise ValueError(f"{name}={value} must be a positive int (a number of examples).")
  return value


def _kappa(base_batch_size: Any, batch_size: Any) -> float:
  base = _check_batch_size(base_batch_size, "base_batch_size")
  size = _check_batch_size(batch_size, "batch_size")
  return size / base


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

  With accumulation the optimizer sees one gradient per window of
  ``batch_size = k * b`` examples, so a learning rate tuned for
  ``base_batch_size`` examples per step usually needs rescaling. With
  :math:`\kappa` = ``batch_size / base_batch_size`` the rules are:

  - ``"linear"``: :math:`\eta \kappa`, the linear scaling rule for SGD
    (Goyal et al., 2017).
  - ``"sqrt"``: :math:`\eta \sqrt{\kappa}`, the square-root scaling rule for
    Adam-type optimizers (Malladi et al., 2022). That rule also rescales Adam's
    betas and epsilon: see :func:`scale_adam_hyperparams`.
  - ``"none"``: :math:`\eta` unchanged.

  With ``warmup_steps > 0`` the multiplier of the learning rate ramps
  linearly over the first ``warmup_steps`` optimizer steps (``count`` from 0
  to ``warmup_steps``), from 1 (``warmup_from="base"``: start at the base,
  unscaled learning rate, Goyal et al.'s gradual warmup, which they ran over
  about 5 epochs) or from 0 (``warmup_from="zero"``) to the rule's factor,
  and stays there after: the learning rate at ``count`` is
  ``(f0 + (f - f0) * min(count / warmup_steps, 1)) * lr(count)`` with ``f``
  the rule's factor and ``f0`` 1 or 0. Under :func:`accumulate` the inner
  optimizer's ``count`` counts windows, so ``warmup_steps`` counts optimizer
  steps, not micro-batches (5 epochs of ``N`` examples are ``5 N /
  batch_size`` steps).

  These rules are heuristics derived for particular regimes (small learning
  rates, SGD or Adam near their SDE limits; the linear rule breaks down for
  large batches): the best learning rate for a new batch size depends on the
  model, the optimizer and the data. Treat the result as a starting point and
  tune around it.

  Args:
    learning_rate: a float, or an optax schedule ``count -> learning rate``,
      tuned with ``base_batch_size`` examples per optimizer step.
    base_batch_size: the batch size (examples per step) the learning rate was
      tuned for; a positive int.
    batch_size: the effective batch size to train with (``k * b`` with
      accumulation); a positive int.
    rule: ``"linear"``, ``"sqrt"`` or ``"none"``.
    warmup_steps: optimizer steps of linear warmup; 0 for none.
    warmup_from: ``"base"`` (warm up from the unscaled learning rate) or
      ``"zero"`` (from 0). Only used with ``warmup_steps > 0``.

  Returns:
    A float for a float ``learning_rate`` without warmup; otherwise a
    schedule ``count -> learning rate`` to pass to an optax optimizer.

  Raises:
    ValueError: for an unknown ``rule`` or ``warmup_from``, a batch size
      ``<= 0`` or ``warmup_steps < 0``.
    TypeError: for a batch size or ``warmup_steps`` that is not an int, or a
      ``learning_rate`` that is neither a number nor callable.

  Examples:
    >>> import gradaccum_jax as ga
    >>> ga.scale_learning_rate(0.1, base_batch_size=256, batch_size=1024)
    0.4
    >>> ga.scale_learning_rate(1e-3, 256, 1024, rule="sqrt")
    0.002
    >>> schedule = ga.scale_learning_rate(0.1, 256, 1024, warmup_steps=100)
    >>> [round(float(schedule(n)), 6) for n in (0, 50, 100, 1000)]
    [0.1, 0.25, 0.4, 0.4]

  References:
    Goyal et al., `Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
    <https://arxiv.org/abs/1706.02677>`_, 2017.

    Malladi et al., `On the SDEs and Scaling Rules for Adaptive Gradient
    Algorithms <https://arxiv.org/abs/2205.10287>`_, 2022.
  """
  kappa = _kappa(base_batch_size, batch_size)
  if rule not in _RULES:
    raise ValueError(f"rule={rule!r} is not a scaling rule; use one of {', '.join(_RULES)}.")
  if isinstance(warmup_steps, bool) or not hasattr(warmup_steps, "__index__"):
    raise TypeError(f"warmup_steps={warmup_steps!r} must be an int >= 0 (optimizer steps).")
  warmup_steps = operator.index(warmup_steps)
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 (0 for no warmup).")
  if warmup_from not in _WARMUP_FROM:
    raise ValueError(
      f"warmup_from={warmup_from!r} is not valid; use one of {', '.join(_WARMUP_FROM)}."
    )
  factor = {"linear": kappa, "sqrt": math.sqrt(kappa), "none": 1.0}[rule]

  if callable(learning_rate):
    base_schedule = learning_rate
  else:
    try:
      base_value = float(learning_rate)
    except (TypeError, ValueError):
      raise TypeError(
        f"learning_rate={learning_rate!r} must be a float or an optax schedule"
        " (a callable count -> learning rate)."
      ) from None
    if warmup_steps == 0:
      return base_value * factor

    def base_schedule(count):
      del count
      return base_value

  if warmup_steps == 0:

    def scaled(count):
      return factor * base_schedule(count)

    return scaled

  start = 1.0 if warmup_from == "base" else 0.0

  def warmed_up(count):
    frac = jnp.clip(jnp.asarray(count, jnp.float32) / warmup_steps, 0.0, 1.0)
    return (start + (factor - start) * frac) * base_schedule(count)

  return warmed_up


def scale_adam_hyperparams(
  b1: float,
  b2: float,
  eps: float,
  base_batch_size: int,
  batch_size: int,
) -> tuple[float, float, float]:
  r"""Adam's ``b1``, ``b2`` and ``eps`` under the square-root scaling rule.

  Malladi et al. (2022) derive that Adam (and RMSprop) trained with batch
  :math:`\kappa B_0` follows the same SDE as with batch :math:`B_0` when, along
  with :math:`\eta \to \sqrt{\kappa}\,\eta` (``scale_learning_rate(...,
  rule="sqrt")``),

  .. math::
    1 - \beta_i \to \kappa (1 - \beta_i), \qquad
    \epsilon \to \epsilon / \sqrt{\kappa},

  with :math:`\kappa` = ``batch_size / base_batch_size``. Growing the batch
  thus shortens the moment averages; the rule needs
  :math:`\kappa (1 - \beta_i) < 1`, i.e. ``batch_size < base_batch_size /
  (1 - beta_i)`` (e.g. a 10x larger batch at most with ``b1 = 0.9``). As
  with any scaling rule, the best hyperparameters still depend on the model
  and the data.

  Args:
    b1: Adam's first-moment decay, in ``[0, 1)``.
    b2: Adam's second-moment decay, in ``[0, 1)``.
    eps: Adam's epsilon, ``>= 0``.
    base_batch_size: the batch size the hyperparameters were tuned for.
    batch_size: the effective batch size to train with (``k * b``).

  Returns:
    The tuple ``(b1, b2, eps)`` for ``batch_size``.

  Raises:
    ValueError: if a scaled beta would be ``<= 0`` (``batch_size`` too large
      for the rule), a beta is outside ``[0, 1)``, ``eps < 0``, or a batch size
      is ``<= 0``.
    TypeError: if a batch size is not an int.

  Examples:
    >>> import gradaccum_jax as ga
    >>> b1, b2, eps = ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, 256, 1024)
    >>> round(b1, 6), round(b2, 6), round(eps, 12)
    (0.6, 0.996, 5e-09)

  References:
    Malladi et al., `On the SDEs and Scaling Rules for Adaptive Gradient
    Algorithms <https://arxiv.org/abs/2205.10287>`_, 2022.
  """
  kappa = _kappa(base_batch_size, batch_size)
  if not eps >= 0:
    raise ValueError(f"eps={eps!r} must be >= 0.")
  scaled = []
  for name, beta in (("b1", b1), ("b2", b2)):
    if not 0 <= beta < 1:
      raise ValueError(f"{name}={beta!r} must be in [0, 1).")
    new = 1.0 - kappa * (1.0 - beta)
    if abs(new) < 1e-12:  # rounding: 1 - 10 * (1 - 0.9) is 2e-16, not 0
      new = 0.0
    if new <= 0:
      raise ValueError(
        f"The square-root rule gives {name} = 1 - kappa * (1 - {name}) = {new:.6g} <= 0"
        f" for kappa = batch_size / base_batch_size = {batch_size}/{base_batch_size}"
        f" = {kappa:.6g} and {name}={beta!r}: the batch is too large for the rule. Use"
        f" batch_size < {base_batch_size / (1.0 - beta):.6g}, or keep {name} unscaled."
      )
    scaled.append(new)
  return scaled[0], scaled[1], eps / math.sqrt(kappa)
