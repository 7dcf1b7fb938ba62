"""Equinox models: params partitioned with eqx.is_inexact_array, non-array fields left alone."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_trees_close, make_batch, mesh_1d

import gradaccum_jax as ga

K = 4
BATCH = 16
WINDOWS = 2
LR = 1e-2


class Classifier(eqx.Module):
  """An MLP with fields that are not parameters: a function, an int, an int array."""

  mlp: eqx.nn.MLP
  squash: Callable  # a non-array leaf
  repeats: int  # a non-array leaf, used in the forward pass
  offsets: jax.Array  # an integer array: not inexact, so not trained

  def __call__(self, x):
    for _ in range(self.repeats):
      x = self.squash(x)
    return self.mlp(x) + self.offsets.astype(x.dtype)


def make_model():
  mlp = eqx.nn.MLP(6, 3, width_size=16, depth=2, activation=jnp.tanh, key=jax.random.key(0))
  return Classifier(mlp, jnp.sin, 2, jnp.array([0, 1, -1]))


def model_loss(model, batch):
  """Mean softmax cross-entropy of the model over the (micro-)batch."""
  logp = jax.nn.log_softmax(jax.vmap(model)(batch["x"]))
  return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def batches():
  return [make_batch(key, BATCH) for key in jax.random.split(jax.random.key(1), WINDOWS)]


def reference_run(model, data):
  """Plain big-batch training: jax.value_and_grad of the whole batch, then adam."""
  params, static = eqx.partition(model, eqx.is_inexact_array)
  inner = optax.adam(LR)
  inner_state = inner.init(params)

  @jax.jit
  def step(params, inner_state, batch):
    loss, grads = jax.value_and_grad(lambda p: model_loss(eqx.combine(p, static), batch))(params)
    updates, inner_state = inner.update(grads, inner_state, params)
    return eqx.apply_updates(params, updates), inner_state, loss

  losses = []
  for batch in data:
    params, inner_state, loss = step(params, inner_state, batch)
    losses.append(loss)
  return params, inner_state, losses


def assert_static_fields_kept(model, original):
  assert model.squash is original.squash and model.repeats == original.repeats
  assert model.offsets.dtype == original.offsets.dtype
  assert_trees_close(model.offsets, original.offsets, rtol=0, atol=0)


@pytest.mark.slow
def test_partition_leaves_holes_for_the_non_array_fields():
  """The setting that needs care: params is a Module with None where the fields are not arrays."""
  model = make_model()
  params, static = eqx.partition(model, eqx.is_inexact_array)
  assert params.squash is None and params.repeats is None and params.offsets is None
  assert static.squash is jnp.sin and static.repeats == 2
  state = ga.accumulate(optax.adam(LR), K).init(params)
  assert jax.tree.structure(state.acc_grads) == jax.tree.structure(params)
  assert state.acc_grads.offsets is None and state.acc_grads.squash is None


@pytest.mark.slow
def test_fused_train_step_matches_big_batch_adam():
  model, data = make_model(), batches()
  ref_params, ref_inner, ref_losses = reference_run(model, data)

  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss_fn(params, microbatch):
    return model_loss(eqx.combine(params, static), microbatch)

  tx = ga.accumulate(optax.adam(LR), K)
  opt_state = tx.init(params)
  step = ga.train_step(loss_fn, tx)
  for batch, ref_loss in zip(data, ref_losses, strict=True):
    params, opt_state, metrics = step(params, opt_state, batch)
    assert_trees_close(metrics["loss"], ref_loss)
    assert bool(metrics["updated"])

  assert_trees_close(params, ref_params)
  assert_trees_close(opt_state.inner_state, ref_inner)
  assert int(opt_state.count) == WINDOWS and int(opt_state.inner_state[0].count) == WINDOWS
  assert_static_fields_kept(eqx.combine(params, static), model)


@pytest.mark.slow
def test_streaming_with_filter_grad_and_filter_jit_matches_big_batch_adam():
  """The case optax.MultiSteps needs workarounds for (equinox#590): updates with None leaves."""
  model, data = make_model(), batches()
  ref_params, ref_inner, _ = reference_run(model, data)

  tx = ga.accumulate(optax.adam(LR), K)
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def micro_step(model, opt_state, microbatch):
    grads = eqx.filter_grad(model_loss)(model, microbatch)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state

  trained = model
  for batch in data:
    start = trained
    for i in range(K):
      trained, opt_state = micro_step(trained, opt_state, ga.microbatch(batch, i, K))
      moved = bool(ga.has_updated(opt_state))
      assert moved == (i == K - 1)
      if not moved:  # inside a window the model does not move
        assert_trees_close(
          eqx.filter(trained, eqx.is_inexact_array),
          eqx.filter(start, eqx.is_inexact_array),
          rtol=0,
          atol=0,
        )

  assert_trees_close(eqx.filter(trained, eqx.is_inexact_array), ref_params)
  assert_trees_close(opt_state.inner_state, ref_inner)
  assert int(opt_state.count) == WINDOWS
  assert_static_fields_kept(trained, model)


@pytest.mark.slow
def test_data_parallel_on_a_mesh_matches_big_batch_adam():
  """The filtered params (with None holes) on 8 devices: replicated, then FSDP param_specs."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  model, data = make_model(), [make_batch(jax.random.key(s), 8 * K) for s in (3, 4)]
  ref_params, ref_inner, _ = reference_run(model, data)
  mesh = mesh_1d()
  params, static = eqx.partition(model, eqx.is_inexact_array)
  # FSDP: the leading dimension over "data" where it divides by the 8 devices.
  fsdp = jax.tree.map(lambda x: P("data") if x.shape[0] % 8 == 0 else P(), params)

  def loss_fn(params, microbatch):
    return model_loss(eqx.combine(params, static), microbatch)

  for specs in (None, fsdp):
    tx = ga.accumulate(optax.adam(LR), K)
    placed = (
      eqx.filter_shard(params, NamedSharding(mesh, P()))
      if specs is None
      else (jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs))
    )
    opt_state = tx.init(placed)
    step = ga.train_step(loss_fn, tx, mesh=mesh, param_specs=specs)
    p = placed
    for batch in data:
      sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), batch)
      p, opt_state, metrics = step(p, opt_state, sharded)
      assert bool(metrics["updated"])
    assert_trees_close(p, ref_params)
    assert_trees_close(opt_state.inner_state, ref_inner)
    assert_static_fields_kept(eqx.combine(p, static), model)
