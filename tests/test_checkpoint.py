"""Checkpointing with orbax at any point of a window: restoring and going on is bit-exact."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_trees_close, init_mlp, make_batch, xent_loss

import gradaccum_jax as ga

K = 4
BATCH = 16
WINDOWS = 3  # window 0, window 1 (the one interrupted), one more window

tx = ga.accumulate(optax.adam(1e-2), K)


@jax.jit
def micro_step(params, state, batch, i):
  grads = jax.grad(xent_loss)(params, ga.microbatch(batch, i, K))
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


fused_step = ga.train_step(xent_loss, tx)


@jax.jit
def big_batch_step(params, inner_state, batch):
  """The reference: plain adam on the gradient of the whole batch."""
  updates, inner_state = optax.adam(1e-2).update(
    jax.grad(xent_loss)(params, batch), inner_state, params
  )
  return optax.apply_updates(params, updates), inner_state


def batches():
  return [make_batch(key, BATCH) for key in jax.random.split(jax.random.key(1), WINDOWS)]


def schedule(data):
  """The micro-steps of the whole run, in order: (window, micro-batch index)."""
  return [(w, i) for w in range(len(data)) for i in range(K)]


def run(params, state, data, steps):
  for w, i in steps:
    params, state = micro_step(params, state, data[w], i)
  return params, state


def assert_bit_exact(actual, expected):
  """Same tree (NamedTuple types included), same dtypes, same values to the last bit."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, e.dtype, a.shape, e.shape)
  assert_trees_close(actual, expected, rtol=0, atol=0)


@pytest.fixture(scope="module")
def checkpointer():
  ckpt = ocp.StandardCheckpointer()
  yield ckpt
  ckpt.close()


def save_and_restore(checkpointer, path, tree):
  """Writes ``tree`` to ``path`` and reads it back into new arrays, typed by an abstract target."""
  checkpointer.save(path, tree)
  checkpointer.wait_until_finished()
  target = jax.eval_shape(lambda: tree)  # ShapeDtypeStructs in the live NamedTuple types
  restored = checkpointer.restore(path, target)
  for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(tree), strict=True):
    assert isinstance(r, jax.Array) and r is not t
  return restored


@pytest.fixture(scope="module")
def trajectory():
  """The uninterrupted run: (params, state) after every micro-step, the initial pair first."""
  params = init_mlp(jax.random.key(0))
  data = batches()
  states = [(params, tx.init(params))]
  for w, i in schedule(data):
    states.append(micro_step(*states[-1], data[w], i))
  return data, states


@pytest.mark.slow
def test_uninterrupted_run_is_the_big_batch_run(trajectory):
  """The run the checkpointed runs are held to is itself plain adam on the whole batches."""
  data, states = trajectory
  params = states[0][0]
  inner_state = optax.adam(1e-2).init(params)
  for batch in data:
    params, inner_state = big_batch_step(params, inner_state, batch)
  final_params, final_state = states[-1]
  assert_trees_close(final_params, params)
  assert_trees_close(final_state.inner_state, inner_state)
  assert int(final_state.count) == WINDOWS and int(final_state.micro_step) == 0


@pytest.mark.slow
@pytest.mark.parametrize("position", range(K + 1))
def test_restore_at_every_position_of_a_window_is_bit_exact(
  position, trajectory, checkpointer, tmp_path
):
  data, states = trajectory
  steps = schedule(data)
  at = K + position  # `position` micro-steps into window 1 (0: window 0 just closed)
  saved_params, saved_state = states[at]
  assert int(saved_state.micro_step) == position % K
  assert int(saved_state.count) == 1 + position // K

  params, state = save_and_restore(checkpointer, tmp_path / "ckpt", (saved_params, saved_state))
  assert type(state) is ga.AccumulateState
  assert_bit_exact((params, state), (saved_params, saved_state))

  # Go on to the end of window 1 and through one more window, from the restored arrays only.
  end_of_window = 2 * K
  params, state = run(params, state, data, steps[at:end_of_window])
  assert_bit_exact((params, state), states[end_of_window])
  assert bool(ga.has_updated(state))
  params, state = run(params, state, data, steps[end_of_window:])
  assert_bit_exact((params, state), states[-1])


@pytest.mark.slow
def test_restore_mid_window_then_fused_step_closes_the_window(trajectory, checkpointer, tmp_path):
  data, states = trajectory
  pending = 2
  at = K + pending  # window 0 closed, 2 micro-batches of window 1 accumulated
  saved_params, saved_state = states[at]
  params, state = save_and_restore(checkpointer, tmp_path / "ckpt", (saved_params, saved_state))

  new_batch, last_batch = (make_batch(key, BATCH) for key in jax.random.split(jax.random.key(7)))
  ours = fused_step(params, state, new_batch)[:2]
  uninterrupted = fused_step(saved_params, saved_state, new_batch)[:2]
  assert_bit_exact(ours, uninterrupted)
  assert int(ours[1].count) == 2 and int(ours[1].micro_step) == 0

  # Independently: the closed window is adam on the mean over its K + 2 micro-batches of equal
  # size, i.e. the gradient of the mean loss over all their rows, at the params of window 0.
  rows = [ga.microbatch(data[1], i, K) for i in range(pending)] + [new_batch]
  window = jax.tree.map(lambda *x: jnp.concatenate(x), *rows)
  p0 = states[0][0]
  p1, s1 = big_batch_step(p0, optax.adam(1e-2).init(p0), data[0])
  p2, s2 = big_batch_step(p1, s1, window)
  assert_trees_close(ours[0], p2)
  assert_trees_close(ours[1].inner_state, s2)

  # And one more window stays bit-exact.
  assert_bit_exact(fused_step(*ours, last_batch)[:2], fused_step(*uninterrupted, last_batch)[:2])


@pytest.mark.slow
def test_loss_scale_state_round_trips(checkpointer, tmp_path):
  """With dynamic loss scaling the state carries a LossScaleState; it survives a checkpoint."""
  scaled_tx = ga.accumulate(
    optax.sgd(0.1), K, loss_scale=ga.DynamicLossScale(initial_scale=2.0**10, period=1)
  )
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(3), BATCH)

  @jax.jit
  def scaled_micro_step(params, state, i):
    scale = state.loss_scale.scale
    grads = jax.grad(lambda p: xent_loss(p, ga.microbatch(batch, i, K)) * scale)(params)
    updates, state = scaled_tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state = ga.train_step(xent_loss, scaled_tx)(params, scaled_tx.init(params), batch)[:2]
  assert float(state.loss_scale.scale) == 2.0**11  # period=1: one good window doubles it
  params, state = scaled_micro_step(params, state, 0)
  restored = save_and_restore(checkpointer, tmp_path / "ckpt", (params, state))
  assert type(restored[1].loss_scale) is ga.LossScaleState
  assert_bit_exact(restored, (params, state))
  ours, theirs = restored, (params, state)
  for i in range(1, K):
    ours, theirs = scaled_micro_step(*ours, i), scaled_micro_step(*theirs, i)
  assert_bit_exact(ours, theirs)
  assert float(ours[1].loss_scale.scale) == 2.0**12 and int(ours[1].count) == 2


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_a_mesh_checkpoint_restores_onto_a_fresh_state_mid_window(layout, checkpointer, tmp_path):
  """With params on a mesh, tx.init places every leaf of the state there (the counters and the
  inner optimizer's count replicated), so the standard Orbax recipe, restoring onto the shapes
  and shardings of a fresh tx.init(params), works (before: "incompatible devices") and gives
  the saved state bit for bit, mid-window; the window then closes as it would have."""
  from helpers import mesh_1d, put  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  from test_sharding import FSDP, SIZES  # noqa: PLC0415

  mesh = mesh_1d()
  params = put(init_mlp(jax.random.key(0), SIZES), mesh, P() if layout == "replicated" else FSDP)
  tx_mesh = ga.accumulate(optax.adam(1e-2), 3)
  state = tx_mesh.init(params)
  for leaf in jax.tree.leaves(state):
    assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh, leaf.sharding
  grad = jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.tanh(x @ p["layer0"]["w"]) ** 2)))
  x = jnp.ones((4, SIZES[0]))
  for _ in range(2):  # two of three micro-batches: the window is open
    _, state = jax.jit(tx_mesh.update)(grad(params, x), state, params)
  checkpointer.save(tmp_path / "ckpt", state)
  checkpointer.wait_until_finished()
  fresh = tx_mesh.init(params)
  target = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), fresh
  )
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  assert_trees_close(restored, state, rtol=0, atol=0)
  for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
    assert r.sharding == t.sharding
  a = jax.jit(tx_mesh.update)(grad(params, x), state, params)
  b = jax.jit(tx_mesh.update)(grad(params, x), restored, params)
  assert_trees_close(a, b, rtol=0, atol=0)
  assert bool(b[1].updated)


def window_states(package, mode, stop, start=0, carry=None):
  """``(params, state)`` after micro-batches ``start..stop - 1`` (windows of 4; adam, the noise
  scale) through ``tx.update`` (``mode="streaming"``, weight 8 each) or ``micro_step``, from
  ``carry`` or a fresh start. It wrote tests/data/states_985bfe5.npz with the package of commit
  985bfe5 (stop 6: one window, then two micro-batches of the next), keyed as :func:`paths` keys
  them, ``mode/path``."""
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w": jax.random.normal(k1, (4, 3)), "b": jax.random.normal(k2, (3,))}
  tx = package.accumulate(optax.adam(1e-2), 4, noise_scale_ema=0.9)
  params, state = carry or (params, tx.init(params))

  def loss_fn(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

  step = package.micro_step(loss_fn, tx)
  update = jax.jit(lambda g, s, p: tx.update(g, s, p, weight=8.0))
  for i in range(start, stop):
    kx, ky = jax.random.split(jax.random.key(10 + i))
    b = {"x": jax.random.normal(kx, (8, 4)), "y": jax.random.normal(ky, (8, 3))}
    if mode == "micro_step":
      params, state, _ = step(params, state, b)
    else:
      updates, state = update(jax.grad(loss_fn)(params, b), state, params)
      params = optax.apply_updates(params, updates)
  return params, state


def paths(tree):
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(k) for k, _ in leaves]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["streaming", "micro_step"])
def test_a_state_written_before_the_pipeline_core_restores_and_closes_its_window(mode):
  """A mid-window state the package wrote at 985bfe5, before its core became a pipeline of named
  units, fills today's structure path by path (every path, shape and dtype the same: an
  ``AccumulateState`` or a ``MicroStepState`` with ``parts=None``), and closes its window as an
  uninterrupted run of today's package does."""
  stored = np.load(pathlib.Path(__file__).parent / "data" / "states_985bfe5.npz")
  today = window_states(ga, mode, 6)
  leaves, treedef = jax.tree.flatten(today)
  names = paths(today)
  assert sorted(names) == sorted(k.partition("/")[2] for k in stored if k.startswith(f"{mode}/"))
  old = [stored[f"{mode}/{name}"] for name in names]
  assert [(x.shape, x.dtype) for x in old] == [(x.shape, x.dtype) for x in leaves]
  restored = jax.tree.unflatten(treedef, [jnp.asarray(x) for x in old])
  assert_trees_close(restored, today, rtol=1e-5, atol=1e-5)  # written with jax 0.12: to rounding
  closed = window_states(ga, mode, 8, start=6, carry=restored)
  assert int(closed[1].count) == 2 and int(closed[1].micro_step) == 0
  assert_trees_close(closed, window_states(ga, mode, 8), rtol=1e-5, atol=1e-5)
