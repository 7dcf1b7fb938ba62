"""Mutable model state through the micro-batches, and the three BatchNorm modes (pure JAX model)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_trees_close, make_batch

import gradaccum_jax as ga

K = 4
M = 0.9  # BatchNorm momentum of the model below


def init(key):
  w1k, w2k = jax.random.split(key)
  params = {"w1": jax.random.normal(w1k, (6, 8)) / 3, "w2": jax.random.normal(w2k, (8, 3)) / 3}
  state = {
    "bn": {"mean": jnp.full(8, 0.1), "var": jnp.full(8, 2.0)},
    "calls": jnp.zeros((), jnp.int32),
  }
  return params, state


def bn_stats(params, x):
  h = x @ params["w1"]
  return h, jnp.mean(h, 0), jnp.mean(h * h, 0) - jnp.mean(h, 0) ** 2  # biased, as flax


def loss_fn(params, state, mb):
  """A BatchNorm layer in training mode: normalize with the batch's own statistics."""
  h, mu, var = bn_stats(params, mb["x"])
  h = jnp.tanh((h - mu) / jnp.sqrt(var + 1e-5))
  logp = jax.nn.log_softmax(h @ params["w2"])
  loss = -jnp.mean(jnp.take_along_axis(logp, mb["y"][:, None], axis=1))
  new_bn = {
    "mean": M * state["bn"]["mean"] + (1 - M) * mu,
    "var": M * state["bn"]["var"] + (1 - M) * var,
  }
  return loss, {"bn": new_bn, "calls": state["calls"] + 1}


def hand_loop(params, state, batch, thread_bn=True):
  """Reference: call the model on micro-batch 0..k-1 in turn, mean of the gradients."""
  grads, losses = [], []
  s = state
  for i in range(K):
    start = s if thread_bn else {"bn": state["bn"], "calls": s["calls"]}
    (loss, s), g = jax.value_and_grad(loss_fn, has_aux=True)(
      params, start, ga.microbatch(batch, i, K)
    )
    grads.append(g)
    losses.append(loss)
  return sum(losses) / K, jax.tree.map(lambda *g: sum(g) / K, *grads), s


@pytest.fixture
def setup():
  params, state = init(jax.random.key(0))
  return params, state, make_batch(jax.random.key(1), 32)


@pytest.mark.slow
def test_sequential_threads_the_state(setup):
  params, state, batch = setup
  ref_loss, ref_grads, ref_state = hand_loop(params, state, batch)
  (loss, new_state), grads = ga.value_and_grad(loss_fn, K, has_state=True)(params, state, batch)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)
  assert_trees_close(new_state, ref_state)
  assert int(new_state["calls"]) == K  # k running-average updates per window

  tx = ga.accumulate(optax.sgd(0.1), K)
  step = ga.train_step(loss_fn, tx, has_state=True)
  new_params, model_state, opt_state, metrics = step(params, state, tx.init(params), batch)
  assert_trees_close(model_state, ref_state)
  assert_trees_close(new_params, jax.tree.map(lambda p, g: p - 0.1 * g, params, ref_grads))
  assert_trees_close(metrics["loss"], ref_loss)
  assert int(opt_state.count) == 1


@pytest.mark.slow
def test_per_window_uses_the_pooled_statistics_of_the_whole_batch(setup):
  params, state, batch = setup
  _, ref_grads, ref_state = hand_loop(params, state, batch, thread_bn=False)
  (_, new_state), grads = ga.value_and_grad(
    loss_fn, K, has_state=True, batchnorm="per_window", batchnorm_momentum=M
  )(params, state, batch)
  # Direct: the statistics of the whole batch of 32 rows, one running-average update.
  _, mu, var = bn_stats(params, batch["x"])
  assert_trees_close(new_state["bn"]["mean"], M * state["bn"]["mean"] + (1 - M) * mu)
  assert_trees_close(new_state["bn"]["var"], M * state["bn"]["var"] + (1 - M) * var)
  # Normalization still uses each micro-batch's statistics, every micro-batch from the same state.
  assert_trees_close(grads, ref_grads)
  assert int(new_state["calls"]) == K  # other state is threaded
  # The variance of the micro-batch means matters: the mean of micro-batch variances alone is off.
  micro_vars = [bn_stats(params, ga.microbatch(batch, i, K)["x"])[2] for i in range(K)]
  mean_of_vars = M * state["bn"]["var"] + (1 - M) * sum(micro_vars) / K
  with pytest.raises(AssertionError):
    assert_trees_close(mean_of_vars, new_state["bn"]["var"])


@pytest.mark.slow
def test_frozen_leaves_the_statistics(setup):
  params, state, batch = setup
  _, ref_grads, _ = hand_loop(params, state, batch, thread_bn=False)
  tx = ga.accumulate(optax.sgd(0.1), K)
  step = ga.train_step(loss_fn, tx, has_state=True, batchnorm="frozen")
  new_params, model_state, _, _ = step(params, state, tx.init(params), batch)
  assert_trees_close(model_state["bn"], state["bn"], rtol=0, atol=0)
  assert int(model_state["calls"]) == K
  assert_trees_close(new_params, jax.tree.map(lambda p, g: p - 0.1 * g, params, ref_grads))


@pytest.mark.slow
def test_has_state_with_aux_and_rng(setup):
  params, state, batch = setup

  def loss_aux(params, state, mb, rng):
    noise = 0.01 * jax.random.normal(rng, mb["x"].shape)
    loss, new_state = loss_fn(params, state, {"x": mb["x"] + noise, "y": mb["y"]})
    return loss, ({"loss_again": loss}, new_state)

  rng = jax.random.key(7)
  (loss, (aux, new_state)), grads = ga.value_and_grad(loss_aux, K, has_aux=True, has_state=True)(
    params, state, batch, rng=rng
  )
  s, ref = state, []
  for i in range(K):
    (l_i, (_, s)), g = jax.value_and_grad(loss_aux, has_aux=True)(
      params, s, ga.microbatch(batch, i, K), jax.random.fold_in(rng, i)
    )
    ref.append((l_i, g))
  assert_trees_close(loss, sum(r[0] for r in ref) / K)
  assert_trees_close(aux["loss_again"], loss)
  assert_trees_close(grads, jax.tree.map(lambda *g: sum(g) / K, *[r[1] for r in ref]))
  assert_trees_close(new_state, s)


def test_errors(setup):
  params, state, batch = setup
  with pytest.raises(ValueError, match=r"Unknown batchnorm='ghost'; use one of 'sequential'"):
    ga.value_and_grad(loss_fn, K, has_state=True, batchnorm="ghost")
  with pytest.raises(
    ValueError, match=r"batchnorm='frozen' needs the model state: pass has_state=True"
  ):
    ga.train_step(loss_fn, ga.accumulate(optax.sgd(0.1), K), batchnorm="frozen")
  with pytest.raises(ValueError, match=r"per_window' needs batchnorm_momentum.*got None"):
    ga.value_and_grad(loss_fn, K, has_state=True, batchnorm="per_window")

  def no_state(params, state, mb):
    return loss_fn(params, state, mb)[0], None

  with pytest.raises(TypeError, match=r"new model state is None"):
    ga.value_and_grad(no_state, K, has_state=True)(params, state, batch)

  def only_loss(params, state, mb):
    return loss_fn(params, state, mb)[0]

  with pytest.raises(TypeError, match=r"must return a pair \(loss, new_model_state\)"):
    ga.value_and_grad(only_loss, K, has_state=True)(params, state, batch)

  def grows(params, state, mb):
    loss, new = loss_fn(params, state, mb)
    return loss, {**new, "extra": jnp.zeros(())}

  with pytest.raises(ValueError, match=r"another structure than the one it was given"):
    ga.value_and_grad(grows, K, has_state=True)(params, state, batch)

  def recast(params, state, mb):
    loss, new = loss_fn(params, state, mb)
    return loss, {**new, "calls": new["calls"].astype(jnp.float32)}

  with pytest.raises(
    ValueError, match=r"\['calls'\] came back as float32\[\], but was given as int32\[\]"
  ):
    ga.value_and_grad(recast, K, has_state=True)(params, state, batch)

  def no_bn(params, state, mb):
    return loss_fn(
      params, {"bn": {"mean": jnp.zeros(8), "var": jnp.ones(8)}, "calls": state["c"]}, mb
    )[0], state

  with pytest.raises(ValueError, match=r"batchnorm='frozen' but the model state has no BatchNorm"):
    ga.value_and_grad(no_bn, K, has_state=True, batchnorm="frozen")(
      params, {"c": jnp.zeros(())}, batch
    )
