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


@pytest.mark.parametrize("rule", ["sqrt", "half_life"])
@pytest.mark.parametrize(
  "hyperparams",
  [(0.9, 0.999, 1e-8), (0.0, 0.999, 1e-8), (0.9, 0.0, 0.0), (0.0, 0.0, 1e-8), (0.7, 0.3, 0.1)],
)
def test_scale_adam_hyperparams_kappa_one_returns_the_inputs(rule, hyperparams):
  """kappa = 1 is no change, exactly, b = 0 included (it used to raise "batch too large")."""
  for base in (1, 7, 256):
    out = ga.scale_adam_hyperparams(*hyperparams, base, base, rule=rule)
    assert out == hyperparams
    assert all(o is h for o, h in zip(out, hyperparams, strict=True))


def test_scale_adam_hyperparams_sqrt_rule_at_its_limit():
  # kappa = 10, b1 = 0.9: 1 - b1 -> 10 * 0.1 = 1, so b1 = 0 (no momentum), inside the range.
  b1, b2, eps = ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, 256, 2560)
  assert b1 == pytest.approx(0.0, abs=1e-12)
  assert b2 == pytest.approx(1 - 10 * 0.001)
  assert eps == pytest.approx(1e-8 / math.sqrt(10))


def test_scale_adam_hyperparams_sqrt_rule_out_of_range():
  # kappa = 11: kappa * (1 - b1) = 1.1 > 1; the limit is 256 / 0.1 = 2560; b1 >= 1 - 1/11.
  with pytest.raises(ValueError, match=r"scale_adam_hyperparams: b1=0.9 is out of") as info:
    ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, 256, 2816)
  message = str(info.value)
  for part in (
    "kappa = batch_size / base_batch_size = 2816/256 = 11:",
    "kappa * (1 - b1) <= 1 (here 1.1, which would make b1 = -0.1)",
    "batch_size <= base_batch_size / (1 - b1) = 2560.",
    f"b1 >= {1 - 1 / 11:.6g}",
    "rule='half_life'",
  ):
    assert part in message, (part, message)
  # b1 = 0 (no momentum): no batch above the base one is in the rule's range.
  with pytest.raises(ValueError, match=r"b1=0.0 is out of .* = 512/256 = 2:.*no batch above 256"):
    ga.scale_adam_hyperparams(0.0, 0.999, 1e-8, 256, 512)
  with pytest.raises(ValueError, match=r"b2=0.5 is out of .*here 1.5, which would make b2 = -0.5"):
    ga.scale_adam_hyperparams(0.9, 0.5, 1e-8, 1, 3)  # b1 -> 0.7 is fine, b2 -> -0.5 is not
  with pytest.raises(ValueError, match=r"b2=0.99 is out of .*base_batch_size / \(1 - b2\) = 100"):
    ga.scale_adam_hyperparams(0.999, 0.99, 1e-8, 1, 200)


HALF_LIFE_SIZES = [(256, 32), (64, 32), (100, 99), (100, 101), (256, 768), (256, 2816), (2, 2000)]


@pytest.mark.parametrize(("base", "size"), HALF_LIFE_SIZES)
@pytest.mark.parametrize("b2", [0.95, 0.98, 0.999, 0.5])
def test_scale_adam_hyperparams_half_life_closed_form(base, size, b2):
  """b2 -> b2 ** kappa (as exp(kappa log b2)); b1 and eps unchanged; b2's half-life, counted in
  examples (base * ln(1/2) / ln(b2)), is the same before and after."""
  kappa = size / base
  b1, new_b2, eps = ga.scale_adam_hyperparams(0.9, b2, 1e-8, base, size, rule="half_life")
  assert (b1, eps) == (0.9, 1e-8)
  assert new_b2 == pytest.approx(math.exp(kappa * math.log(b2)), rel=1e-13)
  half_life = base * math.log(0.5) / math.log(b2)
  assert size * math.log(0.5) / math.log(new_b2) == pytest.approx(half_life, rel=1e-12)


@pytest.mark.parametrize(("base", "size"), [(256, 2816), (2, 2000), (1, 10**6)])
def test_scale_adam_hyperparams_half_life_where_sqrt_rule_has_no_answer(base, size):
  """kappa = 11, 1000, 10**6: the square-root rule raises for b1 = 0.9; half_life does not."""
  with pytest.raises(ValueError, match=r"b1=0.9 is out of the square-root rule's range"):
    ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, base, size)
  b1, b2, eps = ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, base, size, rule="half_life")
  assert (b1, eps) == (0.9, 1e-8)
  assert b2 == pytest.approx(math.exp(size / base * math.log(0.999)), rel=1e-12)
  assert 0 <= b2 < 1
  assert ga.scale_adam_hyperparams(0.0, 0.0, 0.0, 1, 10**6, rule="half_life") == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(("base", "size"), [(1000, 900), (1000, 990), (1000, 1010), (100, 110)])
@pytest.mark.parametrize("delta", [1e-2, 1e-3, 1e-4])
def test_scale_adam_hyperparams_half_life_agrees_with_sqrt_rule_to_first_order(base, size, delta):
  """With d = 1 - b2: (1 - d) ** kappa = 1 - kappa d + kappa (kappa - 1) d**2 / 2 + O(d**3),
  and the square-root rule's b2 is 1 - kappa d: the two differ by the d**2 term."""
  kappa, b2 = size / base, 1 - delta
  _, half_life, _ = ga.scale_adam_hyperparams(0.0, b2, 1e-8, base, size, rule="half_life")
  _, sqrt_rule, _ = ga.scale_adam_hyperparams(0.9, b2, 1e-8, base, size)
  d = 1 - b2  # delta as the float b2 holds it
  assert sqrt_rule == pytest.approx(1 - kappa * d, rel=1e-14)
  second_order = kappa * (kappa - 1) * d**2 / 2
  assert half_life - sqrt_rule == pytest.approx(second_order, rel=delta + 1e-5)
  assert abs(half_life - sqrt_rule) < abs(sqrt_rule - b2) * delta  # the first-order change agrees


@pytest.mark.parametrize(
  ("kwargs", "error", "pattern"),
  [
    ({"b1": 1.0}, ValueError, r"b1=1.0 must be in \[0, 1\)"),
    ({"b2": -0.1}, ValueError, r"b2=-0.1 must be in \[0, 1\)"),
    ({"eps": -1.0}, ValueError, r"eps=-1.0 must be >= 0"),
    ({"base_batch_size": 0}, ValueError, r"base_batch_size=0 must be a positive int"),
    ({"batch_size": 2.0}, TypeError, r"batch_size=2.0 must be a positive int"),
    ({"rule": "linear"}, ValueError, r"rule='linear' must be one of 'sqrt', 'half_life'"),
    ({"rule": "half_life", "b2": 1.0}, ValueError, r"b2=1.0 must be in \[0, 1\)"),
    ({"rule": "half_life", "eps": -1e-8}, ValueError, r"eps=-1e-08 must be >= 0"),
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


LR_FACTORS = {"linear": lambda kappa: kappa, "sqrt": math.sqrt, "none": lambda kappa: 1.0}


@pytest.mark.parametrize("lr_rule", list(LR_FACTORS))
@pytest.mark.parametrize(("base", "size"), [(256, 1024), (1024, 256), (100, 300)])
def test_scale_weight_decay_closed_form(lr_rule, base, size):
  """lambda -> kappa lambda / f, f the learning rate's factor under lr_rule."""
  kappa = size / base
  out = ga.scale_weight_decay(0.05, base, size, lr_rule=lr_rule)
  assert isinstance(out, float)
  assert out == pytest.approx(0.05 * kappa / LR_FACTORS[lr_rule](kappa), rel=1e-15)
  assert ga.scale_weight_decay(0.05, base, base, lr_rule=lr_rule) == 0.05  # kappa = 1
  assert ga.scale_weight_decay(0, base, size, lr_rule=lr_rule) == 0.0


def test_scale_weight_decay_by_hand():
  assert ga.scale_weight_decay(0.1, 256, 1024) == pytest.approx(0.4)  # the paper's rule
  assert ga.scale_weight_decay(0.1, 256, 1024, lr_rule="sqrt") == pytest.approx(0.2)
  assert ga.scale_weight_decay(0.1, 256, 1024, lr_rule="linear") == 0.1
  assert ga.scale_weight_decay(0.1, 1024, 256) == pytest.approx(0.025)
  assert ga.scale_weight_decay(0.1, 1024, 256, lr_rule="sqrt") == pytest.approx(0.05)
  assert ga.scale_weight_decay(0.1, np.int64(100), np.int32(300)) == pytest.approx(0.3)


@pytest.mark.parametrize("lr_rule", list(LR_FACTORS))
@pytest.mark.parametrize(("base", "size"), [(256, 1024), (1024, 256), (32, 2048), (7, 3)])
def test_scale_weight_decay_holds_the_timescale(lr_rule, base, size):
  """With the learning rate scaled by the same rule, lr * wd / B (the fraction of the weights
  decayed per example) is the base setting's: the timescale B / (lr wd D) is unchanged."""
  lr = ga.scale_learning_rate(3e-4, base, size, rule=lr_rule)
  wd = ga.scale_weight_decay(0.1, base, size, lr_rule=lr_rule)
  assert lr * wd / size == pytest.approx(3e-4 * 0.1 / base, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("lr_rule", list(LR_FACTORS))
@pytest.mark.parametrize(("base", "size"), [(64, 256), (256, 64)])
def test_scale_weight_decay_optax_adamw_decays_as_much_per_example(lr_rule, base, size):
  """optax.adamw applies p <- p - lr (u + wd p); with zero gradients u = 0, so a window of
  ``size`` examples (k micro-batches through ga.accumulate) multiplies p by 1 - lr' wd', and per
  example that is the base setting's decay, measured by one optax.adamw step at ``base``."""
  lr = ga.scale_learning_rate(0.1, base, size, rule=lr_rule)
  wd = ga.scale_weight_decay(0.5, base, size, lr_rule=lr_rule)
  params = jnp.array([1.0, -2.0, 0.5, 4.0])  # powers of two: p / params is exact
  zeros = jnp.zeros_like(params)

  def decay(tx, steps):
    state, p = tx.init(params), params
    for _ in range(steps):
      updates, state = tx.update(zeros, state, p)
      p = optax.apply_updates(p, updates)
    return 1.0 - np.asarray(p) / np.asarray(params)

  k = max(size // base, 1)
  scaled = decay(ga.accumulate(optax.adamw(lr, weight_decay=wd), num_microbatches=k), k)
  np.testing.assert_allclose(scaled, lr * wd, rtol=1e-5)
  unscaled = decay(optax.adamw(0.1, weight_decay=0.5), 1)
  np.testing.assert_allclose(scaled / size, unscaled / base, rtol=1e-5)


@pytest.mark.parametrize(
  ("args", "kwargs", "error", "pattern"),
  [
    ((-0.1, 8, 16), {}, ValueError, r"scale_weight_decay: weight_decay=-0.1 must be >= 0"),
    ((math.nan, 8, 16), {}, ValueError, r"weight_decay=nan must be >= 0"),
    (("0.1", 8, 16), {}, TypeError, r"weight_decay='0.1' must be a float, got '0.1'"),
    ((True, 8, 16), {}, TypeError, r"weight_decay=True must be a float"),
    ((0.1, 8, 16), {"lr_rule": "half_life"}, ValueError, r"lr_rule='half_life' must be one of"),
    ((0.1, 0, 16), {}, ValueError, r"base_batch_size=0 must be a positive int"),
    ((0.1, 8, 16.0), {}, TypeError, r"batch_size=16.0 must be a positive int"),
    ((0.1, 8, 16, "sqrt"), {}, TypeError, r"positional argument"),  # lr_rule is keyword-only
  ],
)
def test_scale_weight_decay_errors(args, kwargs, error, pattern):
  with pytest.raises(error, match=pattern):
    ga.scale_weight_decay(*args, **kwargs)
