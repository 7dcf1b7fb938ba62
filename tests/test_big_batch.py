"""Equivalence with one big batch: the fused step, value_and_grad and streaming mode."""

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batch, xent_loss

import gradaccum_jax as ga

K = 4
BATCH = 32
WINDOWS = 3
CLIP = 0.05

OPTIMIZERS = {
  "sgd": lambda: optax.sgd(0.3),
  "momentum": lambda: optax.sgd(0.3, momentum=0.9),
  "adam": lambda: optax.adam(1e-2),
  "adam_schedule": lambda: optax.adam(optax.linear_schedule(1e-2, 1e-3, WINDOWS)),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  "lamb": lambda: optax.lamb(1e-2),
  "lars": lambda: optax.lars(0.1),
  "adafactor": lambda: optax.adafactor(1e-2),
  "clip_adamw": lambda: optax.chain(
    optax.clip_by_global_norm(CLIP), optax.adamw(1e-2, weight_decay=0.1)
  ),
}


def batches(num=WINDOWS, size=BATCH, seed=1):
  return [make_batch(k, size) for k in jax.random.split(jax.random.key(seed), num)]


def reference_run(inner, params, data):
  """Plain big-batch training: jax.value_and_grad on the whole batch, then inner."""
  state = inner.init(params)
  history = []
  for batch in data:
    loss, grads = jax.value_and_grad(xent_loss)(params, batch)
    updates, state = inner.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    history.append((loss, grads, params))
  return history


# The fast tier checks adam and clip_adamw; the other optimizers run in the full suite only.
SLOW = set(OPTIMIZERS) - {"adam", "clip_adamw"}


@pytest.mark.parametrize(
  "name",
  [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(OPTIMIZERS)],
)
def test_fused_step_matches_big_batch(name):
  params = init_mlp(jax.random.key(0))
  data = batches()
  ref = reference_run(OPTIMIZERS[name](), params, data)
  tx = ga.accumulate(OPTIMIZERS[name](), K)
  step = ga.train_step(xent_loss, tx)
  state = tx.init(params)
  for batch, (ref_loss, ref_grads, ref_params) in zip(data, ref, strict=True):
    params, state, metrics = step(params, state, batch)
    assert_trees_close(metrics["loss"], ref_loss)
    assert_trees_close(metrics["grad_norm"], optax.tree.norm(ref_grads))
    assert_trees_close(params, ref_params)
  assert int(state.count) == WINDOWS


@pytest.mark.slow
@pytest.mark.parametrize(
  "name",
  [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(OPTIMIZERS)],
)
def test_streaming_matches_big_batch(name):
  params = init_mlp(jax.random.key(0))
  data = batches()
  ref = reference_run(OPTIMIZERS[name](), params, data)
  tx = ga.accumulate(OPTIMIZERS[name](), K)
  state = tx.init(params)

  @jax.jit
  def micro_step(params, state, mb):
    grads = jax.grad(xent_loss)(params, mb)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for batch, (_, _, ref_params) in zip(data, ref, strict=True):
    start = params
    for i in range(K):
      params, state = micro_step(params, state, ga.microbatch(batch, i, K))
      if i < K - 1:  # zero updates inside the window
        assert_trees_close(params, start, rtol=0, atol=0)
        assert not bool(ga.has_updated(state))
    assert bool(ga.has_updated(state))
    assert_trees_close(params, ref_params)
  assert int(state.count) == WINDOWS
  assert int(state.micro_step) == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgd", "adam", "clip_adamw"])
def test_value_and_grad_matches_big_batch(name):
  params = init_mlp(jax.random.key(0))
  data = batches()
  inner = OPTIMIZERS[name]()
  ref = reference_run(OPTIMIZERS[name](), params, data)
  vg = jax.jit(ga.value_and_grad(xent_loss, K))
  state = inner.init(params)
  for batch, (ref_loss, ref_grads, ref_params) in zip(data, ref, strict=True):
    loss, grads = vg(params, batch)
    assert_trees_close(loss, ref_loss)
    assert_trees_close(grads, ref_grads)
    updates, state = inner.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    assert_trees_close(params, ref_params)


@pytest.mark.slow
def test_clipping_sees_the_accumulated_gradient():
  """The clip threshold is active, and clipping each micro-batch would give another result."""
  params = init_mlp(jax.random.key(0))
  batch = batches(1)[0]
  grads = jax.grad(xent_loss)(params, batch)
  assert float(optax.tree.norm(grads)) > 2 * CLIP  # clipping is active

  inner = OPTIMIZERS["clip_adamw"]()
  per_micro = optax.chain(
    optax.clip_by_global_norm(CLIP), ga.accumulate(optax.adamw(1e-2, weight_decay=0.1), K)
  )
  state = per_micro.init(params)
  for i in range(K):
    g = jax.grad(xent_loss)(params, ga.microbatch(batch, i, K))
    wrong, state = per_micro.update(g, state, params)
  right, _ = inner.update(grads, inner.init(params), params)
  ours_tx = ga.accumulate(inner, K)
  step = ga.train_step(xent_loss, ours_tx)
  new_params, _, _ = step(params, ours_tx.init(params), batch)
  assert_trees_close(new_params, optax.apply_updates(params, right))
  with pytest.raises(AssertionError):
    assert_trees_close(wrong, right)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 8, 32])
def test_any_k_dividing_the_batch(k):
  params = init_mlp(jax.random.key(3))
  batch = batches(1)[0]
  loss, grads = ga.value_and_grad(xent_loss, k)(params, batch)
  ref_loss, ref_grads = jax.value_and_grad(xent_loss)(params, batch)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)


def test_microbatch_rows_are_strided():
  batch = {"x": jnp.arange(12).reshape(6, 2), "y": jnp.arange(6)}
  mb = ga.microbatch(batch, 1, 3)
  assert mb["y"].tolist() == [1, 4]
  assert mb["x"].tolist() == [[2, 3], [8, 9]]
  # Every row lands in exactly one micro-batch.
  rows = sorted(r for i in range(3) for r in ga.microbatch(batch, i, 3)["y"].tolist())
  assert rows == list(range(6))


@pytest.mark.slow
def test_has_aux_means_and_sums():
  params = init_mlp(jax.random.key(0))
  batch = batches(1)[0]

  def loss_fn(p, mb):
    logits = mb["x"] @ p["layer0"]["w"]
    loss = xent_loss(p, mb)
    correct = jnp.sum(jnp.argmax(logits[:, :3], -1) == mb["y"])
    return loss, {"loss_copy": loss, "correct": correct, "logit_mean": jnp.mean(logits)}

  (loss, aux), grads = ga.value_and_grad(loss_fn, K, has_aux=True)(params, batch)
  (ref_loss, ref_aux), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)
  assert_trees_close(aux["loss_copy"], ref_aux["loss_copy"])
  assert_trees_close(aux["logit_mean"], ref_aux["logit_mean"])
  assert int(aux["correct"]) == int(ref_aux["correct"])  # integer leaves are summed
  assert aux["correct"].dtype == jnp.int32

  tx = ga.accumulate(optax.sgd(0.1), K)
  _, _, metrics = ga.train_step(loss_fn, tx, has_aux=True)(params, tx.init(params), batch)
  assert_trees_close(metrics["aux"]["logit_mean"], ref_aux["logit_mean"])
  assert int(metrics["aux"]["correct"]) == int(ref_aux["correct"])
