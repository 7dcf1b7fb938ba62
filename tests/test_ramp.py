"""Batch-size ramps: k changes between windows, one state, one compile per distinct k."""

import chex
import jax
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batch, xent_loss

import gradaccum_jax as ga

B_MICRO = 4


@pytest.mark.slow
def test_ramp_matches_big_batch_steps_and_compiles_once_per_k():
  # One trace (plus shape evaluation) per distinct k: at most 2 x 4; chex raises on a 9th.
  chex.clear_trace_counter()  # the counters are global, keyed by where the wrapper was made
  loss_fn = chex.assert_max_traces(xent_loss, n=2 * 4)
  params = init_mlp(jax.random.key(0))
  ks = [1, 2, 4, 4, 2, 8]
  data = [
    make_batch(jax.random.fold_in(jax.random.key(1), i), B_MICRO * k) for i, k in enumerate(ks)
  ]
  schedule = optax.linear_schedule(0.02, 0.002, len(ks))

  ref, ref_state = params, optax.adam(schedule).init(params)
  for batch in data:  # a plain step on each window's whole batch
    grads = jax.grad(xent_loss)(ref, batch)
    updates, ref_state = optax.adam(schedule).update(grads, ref_state, ref)
    ref = optax.apply_updates(ref, updates)

  step = ga.ramp_train_step(loss_fn, optax.adam(schedule))
  state = step.init(params)
  for k, batch in zip(ks, data, strict=True):
    params, state, metrics = step(k, params, state, batch)
    assert float(metrics["weight"]) == k
  assert_trees_close(params, ref)
  assert int(state.count) == len(ks)  # the schedule saw one step per window
  assert step.compiled_ks() == [1, 2, 4, 8]


def test_ramp_rejects_bad_k_and_settings():
  with pytest.raises(TypeError, match="loss_scale must be a ga.DynamicLossScale"):
    ga.ramp_train_step(xent_loss, optax.sgd(0.1), accumulate_kwargs={"loss_scale": 3.0})
  step = ga.ramp_train_step(xent_loss, optax.sgd(0.1))
  params = init_mlp(jax.random.key(0))
  with pytest.raises(ValueError, match="num_microbatches=0 must be a positive int"):
    step(0, params, step.init(params), make_batch(jax.random.key(1), 8))
