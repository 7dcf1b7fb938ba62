"""Learning-rate and Adam hyperparameter scaling against their closed forms."""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga


@pytest.mark.parametrize(
  ("rule", "factor"),
  [("linear", 2048 / 256), ("sqrt", math.sqrt(2048 / 256)), ("none", 1.0)],
)
def test_float_closed_form(rule, factor):
  out = ga.scale_learning_rate(0.05, 256, 2048, rule=rule)
  assert isinstance(out, float)
  assert out == pytest.approx(0.05 * factor, rel=1e-12)


def test_smaller_batch_scales_down():
  assert ga.scale_learning_rate(0.3, 512, 128) == pytest.approx(0.3 / 4)
  assert ga.scale_learning_rate(0.3, 512, 128, rule="sqrt") == pytest.approx(0.3 / 2)


def test_numpy_int_batch_sizes_are_accepted():
  out = ga.scale_learning_rate(0.1, np.int64(100), np.int32(300))
  assert out == pytest.approx(0.3)


@pytest.mark.parametrize("rule", ["linear", "sqrt", "none"])
def test_schedule_closed_form(rule):
  base, size = 128, 1152  # kappa = 9
  factor = {"linear": 9.0, "sqrt": 3.0, "none": 1.0}[rule]
  schedule = optax.cosine_decay_schedule(0.2, decay_steps=100)
  scaled = ga.scale_learning_rate(schedule, base, size, rule=rule)
  assert callable(scaled)
  for count in (0, 1, 17, 50, 99, 100, 250):
    reference = factor * 0.2 * 0.5 * (1 + math.cos(math.pi * min(count, 100) / 100))
    np.testing.assert_allclose(float(scaled(jnp.asarray(count))), reference, rtol=1e-5, atol=1e-7)


def test_warmup_from_base_float():
  # Goyal et al.: from the base lr 0.1 to 0.1 * 8 = 0.8 over 40 steps, then constant.
  schedule = ga.scale_learning_rate(0.1, 32, 256, warmup_steps=40)
  assert callable(schedule)
  for count, expected in [
    (0, 0.1),
    (10, 0.1 + 0.7 / 4),
    (20, 0.45),
    (40, 0.8),
    (41, 0.8),
    (999, 0.8),
  ]:
    np.testing.assert_allclose(float(schedule(count)), expected, rtol=1e-6)


def test_warmup_from_zero_float():
  schedule = ga.scale_learning_rate(0.1, 32, 256, warmup_steps=40, warmup_from="zero")
  for count, expected in [(0, 0.0), (10, 0.2), (20, 0.4), (40, 0.8), (100, 0.8)]:
    np.testing.assert_allclose(float(schedule(count)), expected, rtol=1e-6, atol=1e-9)


def test_warmup_with_sqrt_rule_and_schedule():
  # kappa = 4: sqrt factor 2. The base schedule decays linearly 1e-3 -> 0 over 200 steps.
  base = optax.linear_schedule(1e-3, 0.0, 200)
  schedule = ga.scale_learning_rate(base, 64, 256, rule="sqrt", warmup_steps=10)
  for count in (0, 5, 10, 100, 200):
    multiplier = 1.0 + (2.0 - 1.0) * min(count / 10, 1.0)
    expected = multiplier * 1e-3 * (1 - count / 200)
    np.testing.assert_allclose(float(schedule(count)), expected, rtol=1e-5, atol=1e-12)


def test_warmup_schedule_drives_an_optimizer():
  """The schedule is usable inside optax and inside ga.accumulate (count = windows)."""
  lr = ga.scale_learning_rate(0.5, 1, 2, warmup_steps=2, warmup_from="zero")  # 0, 0.5, 1.0
  tx = ga.accumulate(optax.sgd(lr), num_microbatches=2)
  params = jnp.zeros(())
  state = tx.init(params)
  moved = []
  for _ in range(3):  # 3 windows of 2 micro-batches, gradient 1 each time
    for _ in range(2):
      updates, state = tx.update(jnp.ones(()), state, params)
      params = optax.apply_updates(params, updates)
    moved.append(float(params))
  np.testing.assert_allclose(moved, [0.0, -0.5, -1.5], atol=1e-7)


def test_scale_adam_hyperparams_by_hand():
  # kappa = 4: 1 - b -> 4 (1 - b); eps -> eps / 2.
  b1, b2, eps = ga.scale_adam_hyperparams(0.95, 0.999, 1e-8, 100, 400)
  assert b1 == pytest.approx(1 - 4 * 0.05)
  assert b2 == pytest.approx(1 - 4 * 0.001)
  assert eps == pytest.approx(0.5e-8)
  # kappa = 1/2 (smaller batch): betas move towards 1, eps grows by sqrt(2).
  b1, b2, eps = ga.scale_adam_hyperparams(0.9, 0.99, 1e-6, 64, 32)
  assert b1 == pytest.approx(0.95)
  assert b2 == pytest.approx(0.995)
  assert eps == pytest.approx(1e-6 * math.sqrt(2))
  # kappa = 1: unchanged.
  assert ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, 7, 7) == pytest.approx((0.9, 0.999, 1e-8))


def test_scale_adam_hyperparams_kappa_too_large():
  with pytest.raises(ValueError, match=r"b1 = 1 - kappa.*kappa = .*= 10 .*batch_size < 256"):
    ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, 256, 2560)  # b1 -> 1 - 10 * 0.1 = 0
  with pytest.raises(ValueError, match=r"b1 = 1 - kappa.* = -0.1 <= 0"):
    ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, 256, 2816)  # kappa = 11
  with pytest.raises(ValueError, match=r"b2 = 1 - kappa"):
    ga.scale_adam_hyperparams(0.9, 0.5, 1e-8, 1, 3)  # b1 -> 0.7 is fine, b2 -> -0.5 is not
  with pytest.raises(ValueError, match=r"b2 = 1 - kappa.*b2=0.99"):
    ga.scale_adam_hyperparams(0.999, 0.99, 1e-8, 1, 200)


@pytest.mark.parametrize(
  ("kwargs", "error", "pattern"),
  [
    ({"b1": 1.0}, ValueError, r"b1=1.0 must be in \[0, 1\)"),
    ({"b2": -0.1}, ValueError, r"b2=-0.1 must be in \[0, 1\)"),
    ({"eps": -1.0}, ValueError, r"eps=-1.0 must be >= 0"),
    ({"base_batch_size": 0}, ValueError, r"base_batch_size=0 must be a positive int"),
    ({"batch_size": 2.0}, TypeError, r"batch_size=2.0 must be a positive int"),
  ],
)
def test_scale_adam_hyperparams_errors(kwargs, error, pattern):
  args = {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "base_batch_size": 8, "batch_size": 8} | kwargs
  with pytest.raises(error, match=pattern):
    ga.scale_adam_hyperparams(**args)


@pytest.mark.parametrize(
  ("args", "kwargs", "error", "pattern"),
  [
    ((0.1, 8, 16), {"rule": "cubic"}, ValueError, r"rule='cubic'.*linear, sqrt, none"),
    ((0.1, 0, 16), {}, ValueError, r"base_batch_size=0 must be a positive int"),
    ((0.1, 8, -4), {}, ValueError, r"batch_size=-4 must be a positive int"),
    ((0.1, 8.0, 16), {}, TypeError, r"base_batch_size=8.0 must be a positive int"),
    ((0.1, 8, "16"), {}, TypeError, r"batch_size='16' must be a positive int"),
    ((0.1, True, 16), {}, TypeError, r"base_batch_size=True must be a positive int"),
    ((0.1, 8, 16), {"warmup_steps": -1}, ValueError, r"warmup_steps=-1 must be >= 0"),
    ((0.1, 8, 16), {"warmup_steps": 2.5}, TypeError, r"warmup_steps=2.5 must be an int"),
    ((0.1, 8, 16), {"warmup_from": "one"}, ValueError, r"warmup_from='one'.*base, zero"),
    (("fast", 8, 16), {}, TypeError, r"learning_rate='fast' must be a float or an optax"),
  ],
)
def test_scale_learning_rate_errors(args, kwargs, error, pattern):
  with pytest.raises(error, match=pattern):
    ga.scale_learning_rate(*args, **kwargs)
