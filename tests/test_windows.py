"""Short windows: ga.flush and num_real_microbatches, against steps built for the shorter window."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batch, mesh_1d, xent_loss
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

K = 4
b = 3  # rows per micro-batch


def pad_layout(real, m, k=K, fill=np.nan):
  """``real`` laid out for ``m`` micro-batches, padded to ``k``: real micro-batch ``i`` becomes
  micro-batch ``i`` of the ``k`` layout, the padded ones are ``fill``."""

  def one(x):
    x = np.asarray(x)
    rows = x.reshape((x.shape[0] // m, m) + x.shape[1:])
    floating = np.issubdtype(x.dtype, np.floating)
    pad = np.full((rows.shape[0], k - m) + x.shape[1:], fill if floating else 0, dtype=x.dtype)
    return jnp.asarray(np.concatenate([rows, pad], axis=1).reshape((-1,) + x.shape[1:]))

  return jax.tree.map(one, real)


def token_loss(params, mb):
  """Mean cross-entropy over the micro-batch's real tokens (mask > 0)."""
  logp = jax.nn.log_softmax(mb["x"] @ params["layer0"]["w"] + params["layer0"]["b"])
  nll = -jnp.take_along_axis(logp, mb["y"][:, None], axis=1)[:, 0]
  mask = mb["mask"]
  return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def token_batch(n, key=0):
  batch = make_batch(jax.random.key(key), n)
  batch["mask"] = jnp.asarray(np.random.default_rng(key).integers(0, 2, n), jnp.float32)
  batch["mask"] = batch["mask"].at[::b].set(1.0)  # no micro-batch without tokens
  return batch


def weight_of(mb):
  return mb["mask"].sum()


@pytest.mark.slow
@pytest.mark.parametrize("weighted", [False, True])
def test_num_real_microbatches_equals_a_step_built_for_m_and_compiles_once(weighted):
  params = init_mlp(jax.random.key(0), (6, 3))
  loss_fn, kw = (token_loss, {"weight_fn": weight_of}) if weighted else (xent_loss, {})
  inner = optax.adam(1e-2)
  traces = []

  def counted(params, mb):
    traces.append(1)
    return loss_fn(params, mb)

  tx = ga.accumulate(inner, K)
  step = ga.train_step(counted, tx, **kw)
  for m in range(1, K + 1):
    real = token_batch(m * b, key=m)
    ref_tx = ga.accumulate(inner, m)
    ref_params, ref_state, ref_metrics = ga.train_step(loss_fn, ref_tx, **kw)(
      params, ref_tx.init(params), real
    )
    new_params, state, metrics = step(
      params, tx.init(params), pad_layout(real, m), num_real_microbatches=jnp.int32(m)
    )
    assert_trees_close(new_params, ref_params, rtol=1e-5)
    assert_trees_close(state.inner_state, ref_state.inner_state, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["weight"], ref_metrics["weight"], rtol=1e-6)
    assert bool(metrics["updated"]) and int(state.count) == 1 and int(state.micro_step) == 0
  # The padded micro-batches are NaN: had any been computed, the window would be voided.
  n_traces = len(traces)
  assert step._cache_size() == 1, step._cache_size()
  step(params, tx.init(params), pad_layout(token_batch(b), 1), num_real_microbatches=1)
  assert step._cache_size() == 1 and len(traces) == n_traces  # a Python int: no retrace


@pytest.mark.slow
def test_padded_microbatches_are_not_computed():
  """The loss function runs m times, not k (counted at run time)."""
  calls = []
  params = init_mlp(jax.random.key(0), (6, 3))

  def loss_fn(params, mb):
    jax.debug.callback(lambda: calls.append(1))
    return xent_loss(params, mb)

  tx = ga.accumulate(optax.sgd(0.1), K)
  step = ga.train_step(loss_fn, tx)
  real = token_batch(2 * b)
  jax.block_until_ready(step(params, tx.init(params), pad_layout(real, 2), num_real_microbatches=2))
  jax.effects_barrier()
  assert len(calls) == 2, len(calls)


@pytest.mark.slow
def test_num_real_microbatches_with_model_state_per_window():
  """per_window BatchNorm statistics pool the m real micro-batches only."""

  def loss_fn(params, state, mb):
    h = mb["x"] @ params["layer0"]["w"]
    mu = h.mean(0)
    var = h.var(0)
    new = {"bn": {"mean": 0.9 * state["bn"]["mean"] + 0.1 * mu}}
    new["bn"]["var"] = 0.9 * state["bn"]["var"] + 0.1 * var
    z = (h - mu) / jnp.sqrt(var + 1e-3)
    logp = jax.nn.log_softmax(z + params["layer0"]["b"])
    return -jnp.mean(jnp.take_along_axis(logp, mb["y"][:, None], axis=1)), new

  params = init_mlp(jax.random.key(1), (6, 3))
  mstate = {"bn": {"mean": jnp.zeros(3), "var": jnp.ones(3)}}
  kw = {"has_state": True, "batchnorm": "per_window", "batchnorm_momentum": 0.9}
  inner = optax.sgd(0.5)
  tx = ga.accumulate(inner, K)
  step = ga.train_step(loss_fn, tx, **kw)
  m = 3
  real = token_batch(m * b, key=5)
  ref_tx = ga.accumulate(inner, m)
  ref = ga.train_step(loss_fn, ref_tx, **kw)(params, mstate, ref_tx.init(params), real)
  out = step(params, mstate, tx.init(params), pad_layout(real, m), num_real_microbatches=m)
  assert_trees_close(out[0], ref[0], rtol=1e-5)
  assert_trees_close(out[1], ref[1], rtol=1e-5)


@pytest.mark.slow
def test_num_real_microbatches_on_a_mesh():
  mesh = mesh_1d()
  params = init_mlp(jax.random.key(0), (6, 3))
  inner = optax.adam(1e-2)
  tx = ga.accumulate(inner, K)
  step = ga.train_step(token_loss, tx, weight_fn=weight_of, mesh=mesh)
  m, rows = 2, 8 * b  # b rows per device micro-batch
  real = token_batch(m * rows, key=9)
  ref_tx = ga.accumulate(inner, m)
  ref_params, _, ref_metrics = ga.train_step(token_loss, ref_tx, weight_fn=weight_of, mesh=mesh)(
    params, ref_tx.init(params), real
  )
  # Each device lays out its own rows: pad every device's share.
  shares = [jax.tree.map(lambda x, d=d: x[d * m * b : (d + 1) * m * b], real) for d in range(8)]
  padded = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[pad_layout(s, m) for s in shares])
  padded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), padded)
  new_params, _, metrics = step(params, tx.init(params), padded, num_real_microbatches=m)
  assert_trees_close(new_params, ref_params, rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("weighted", [False, True])
def test_flush_after_m_streaming_calls_is_one_big_batch_step(weighted):
  params = init_mlp(jax.random.key(2), (6, 3))
  inner = optax.adamw(1e-2, weight_decay=0.1)
  tx = ga.accumulate(inner, K)
  m = 3
  batch = token_batch(m * b, key=3)
  loss_fn = token_loss if weighted else xent_loss
  state = tx.init(params)
  for i in range(m):
    mb = ga.microbatch(batch, i, m)
    g = jax.grad(loss_fn)(params, mb)
    _, state = tx.update(g, state, params, weight=weight_of(mb) if weighted else None)
  assert int(state.micro_step) == m and int(state.count) == 0
  updates, state = jax.jit(ga.flush, static_argnums=0)(tx, state, params)

  # Reference: one inner step on the whole-batch gradient (token mean: the loss over all rows).
  if weighted:
    grads = jax.grad(
      lambda p: (
        sum(
          token_loss(p, ga.microbatch(batch, i, m)) * weight_of(ga.microbatch(batch, i, m))
          for i in range(m)
        )
        / batch["mask"].sum()
      )
    )(params)
  else:
    grads = jax.grad(xent_loss)(params, batch)
  ref_updates, ref_inner = inner.update(grads, inner.init(params), params)
  assert_trees_close(updates, ref_updates, rtol=1e-5, atol=1e-7)
  assert_trees_close(state.inner_state, ref_inner, rtol=1e-5, atol=1e-7)
  assert int(state.count) == 1 and int(state.micro_step) == 0 and bool(state.updated)
  assert float(state.acc_weight) == 0 and all(
    float(jnp.abs(a).max()) == 0 for a in jax.tree.leaves(state.acc_grads)
  )

  # The next window starts clean: a full window after the flush is one plain big-batch step.
  batch2 = token_batch(K * b, key=4)
  for i in range(K):
    g = jax.grad(xent_loss)(params, ga.microbatch(batch2, i, K))
    updates2, state = tx.update(g, state, params)
  ref2, _ = inner.update(jax.grad(xent_loss)(params, batch2), ref_inner, params)
  assert_trees_close(updates2, ref2, rtol=1e-5, atol=1e-7)


def test_empty_flush_changes_nothing():
  params = init_mlp(jax.random.key(2), (6, 3))
  tx = ga.accumulate(optax.adam(1e-2), K)
  state = tx.init(params)
  updates, new_state = ga.flush(tx, state, params)
  assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
  assert_trees_close(new_state, state, rtol=0, atol=0)


def test_flush_and_num_real_microbatches_errors():
  params = init_mlp(jax.random.key(0), (6, 3))
  with pytest.raises(TypeError, match=r"tx must be made by ga.accumulate"):
    ga.flush(optax.adam(1e-2), optax.adam(1e-2).init(params), params)
  tx = ga.accumulate(optax.sgd(0.1), K)
  step = ga.train_step(xent_loss, tx)
  batch = make_batch(jax.random.key(0), K * b)
  for bad in (0, K + 1):
    with pytest.raises(ValueError, match=rf"num_real_microbatches={bad} must be between 1 and"):
      step(params, tx.init(params), batch, num_real_microbatches=bad)
  with pytest.raises(TypeError, match=r"num_real_microbatches=2.5 must be an int"):
    step(params, tx.init(params), batch, num_real_microbatches=2.5)


@pytest.mark.slow
def test_value_and_grad_num_real_microbatches():
  params = init_mlp(jax.random.key(0), (6, 3))
  m = 2
  real = make_batch(jax.random.key(3), m * b)
  loss, grads = ga.value_and_grad(xent_loss, K)(
    params, pad_layout(real, m), num_real_microbatches=m
  )
  ref_loss, ref_grads = jax.value_and_grad(xent_loss)(params, real)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7)
