"""auto_microbatch and step_memory against XLA's memory analysis of directly compiled steps.

XLA:CPU reports about 0 temp bytes for programs below ~16 MiB, so the model has large
activations: MLP 256 -> 2048 -> 2048 -> 10 on a batch of 1024 (a micro-batch of 1024 rows
holds two 8 MiB hidden activations). Nothing is executed: every program is only compiled.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import gradaccum_jax as ga

S = jax.ShapeDtypeStruct
B = 1024
PARAMS = {
  "w0": S((256, 2048), jnp.float32),
  "w1": S((2048, 2048), jnp.float32),
  "w2": S((2048, 10), jnp.float32),
}
BATCH = {"x": S((B, 256), jnp.float32), "y": S((B,), jnp.int32)}
TRIED = (1, 2, 4, 8)


def loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params["w0"])
  h = jnp.tanh(h @ params["w1"])
  logits = h @ params["w2"]
  picked = jnp.take_along_axis(logits, batch["y"][:, None], axis=1)[:, 0]
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


@pytest.fixture(scope="module")
def measured():
  return {k: ga.step_memory(loss_fn, PARAMS, BATCH, k) for k in TRIED}


@pytest.mark.slow
def test_step_memory_is_the_compiled_programs_analysis():
  """Reference: compile the fused step by hand and add up XLA's numbers; the arguments hold at
  least the params, the fp32 accumulator (same size) and the whole batch."""
  k = 4
  tx = ga.accumulate(optax.sgd(0.0), k)
  state = jax.eval_shape(tx.init, PARAMS)
  analysis = ga.train_step(loss_fn, tx).lower(PARAMS, state, BATCH).compile().memory_analysis()
  expected = (
    analysis.temp_size_in_bytes
    + analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
  )
  params_bytes = 4 * (256 * 2048 + 2048 * 2048 + 2048 * 10)
  batch_bytes = 4 * B * 256 + 4 * B
  assert analysis.argument_size_in_bytes >= 2 * params_bytes + batch_bytes
  assert ga.step_memory(loss_fn, PARAMS, BATCH, k) == expected


@pytest.mark.slow
def test_estimate_is_non_increasing_in_k(measured):
  # From k = 2 on, a smaller micro-batch needs no more memory. k = 1 is left out: on XLA:CPU
  # it needs less temp memory than k = 2 (which is why auto_microbatch searches linearly).
  ks = [k for k in TRIED if k >= 2]
  values = [measured[k] for k in ks]
  assert all(a >= b for a, b in zip(values, values[1:], strict=False)), dict(
    zip(ks, values, strict=True)
  )
  assert values[0] > values[-1], dict(zip(ks, values, strict=True))  # the activations did shrink


@pytest.mark.slow
def test_auto_microbatch_picks_the_largest_microbatch_that_fits(measured):
  budget = (measured[4] + measured[8]) // 2  # 4 micro-batches of 256 do not fit, 8 of 128 do
  assert measured[1] > budget and measured[2] > budget
  k, estimates = ga.auto_microbatch(
    loss_fn, PARAMS, BATCH, memory_budget_bytes=budget, return_estimates=True
  )
  assert B % k == 0
  assert k == 8
  assert estimates == {k: measured[k] for k in TRIED}
  assert estimates[8] <= budget < estimates[4]  # next larger micro-batch: the divisor below


@pytest.mark.slow
def test_auto_microbatch_returns_the_whole_batch_when_it_fits(measured):
  k, estimates = ga.auto_microbatch(
    loss_fn, PARAMS, BATCH, memory_budget_bytes=measured[1], return_estimates=True
  )
  assert k == 1 and estimates == {1: measured[1]}


def tiny_loss(w, batch):
  return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


@functools.cache
def tiny_batch():
  return {"x": jnp.ones((6, 3)), "y": jnp.ones(6)}


@pytest.mark.slow
def test_budget_too_small_names_the_bytes():
  one_example = ga.step_memory(tiny_loss, jnp.zeros(3), tiny_batch(), 6)
  with pytest.raises(ValueError, match=rf"k = B = 6\) needs {one_example} bytes.*=100\b"):
    ga.auto_microbatch(tiny_loss, jnp.zeros(3), tiny_batch(), memory_budget_bytes=100)


@pytest.mark.slow
def test_result_is_a_divisor_not_only_a_power_of_two():
  # B = 1536 = 2**9 * 3: divisors 1, 2, 3, 4, 6, ... A budget between k = 2 and k = 3.
  batch = {"x": S((1536, 256), jnp.float32), "y": S((1536,), jnp.int32)}
  m2, m3 = (ga.step_memory(loss_fn, PARAMS, batch, k) for k in (2, 3))
  assert m3 < m2
  k, estimates = ga.auto_microbatch(
    loss_fn, PARAMS, batch, memory_budget_bytes=(m2 + m3) // 2, return_estimates=True
  )
  assert k == 3 and 1536 % k == 0
  assert list(estimates) == [1, 2, 3] and estimates[2] == m2 and estimates[3] == m3


def test_errors():
  if jax.devices()[0].memory_stats() is None:  # CPU: no default budget
    with pytest.raises(ValueError, match=r"memory_budget_bytes="):
      ga.auto_microbatch(tiny_loss, jnp.zeros(3), tiny_batch())
  with pytest.raises(ValueError, match=r"memory_budget_bytes=0 must be > 0"):
    ga.auto_microbatch(tiny_loss, jnp.zeros(3), tiny_batch(), memory_budget_bytes=0)
  with pytest.raises(TypeError, match=r"memory_budget_bytes='1GB' must be a number"):
    ga.auto_microbatch(tiny_loss, jnp.zeros(3), tiny_batch(), memory_budget_bytes="1GB")
  with pytest.raises(TypeError, match=r"already a ga.accumulate"):
    ga.step_memory(tiny_loss, jnp.zeros(3), tiny_batch(), 2, ga.accumulate(optax.sgd(0.1), 2))
  with pytest.raises(ValueError, match=r"not divisible by num_microbatches k=4"):
    ga.step_memory(tiny_loss, jnp.zeros(3), tiny_batch(), 4)
  with pytest.raises(ValueError, match=r"num_microbatches=0 must be a positive int"):
    ga.step_memory(tiny_loss, jnp.zeros(3), tiny_batch(), 0)
