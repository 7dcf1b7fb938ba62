"""Data-parallel and sharded-parameter accumulation on 8 CPU devices: one reduction per window."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  assert_trees_close,
  init_mlp,
  make_batch,
  mesh_1d,
  mlp,
  mlp_params,
  put,
  xent_loss,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

D = 8  # tests/conftest.py gives jax 8 CPU devices
SIZES = (8, 16, 8)  # an MLP whose every dimension divides by D, for the sharded layouts
# FSDP-style: every leaf sharded over "data", on its leading or its last dimension.
FSDP = {
  "layer0": {"w": P(None, "data"), "b": P("data")},
  "layer1": {"w": P("data"), "b": P("data")},
}


def big_batch_steps(loss_fn, inner, params, batches):
  """The reference: one plain optax step on each whole batch, no accumulation, one device;
  the params after all of them, and the last batch's loss and gradient."""

  @jax.jit
  def run(params, batches):
    state = inner.init(params)
    for batch in batches:
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, state = inner.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params, loss, grads

  return run(params, batches)


def plain_steps(loss_fn, inner, params, batches):
  """:func:`big_batch_steps`' params and last loss."""
  return big_batch_steps(loss_fn, inner, params, batches)[:2]


def data(batch_size, key=1):
  """A classification batch, from numpy (no small jax programs to compile)."""
  rng = np.random.default_rng(key)
  return {
    "x": rng.standard_normal((batch_size, SIZES[0])).astype(np.float32),
    "y": rng.integers(0, SIZES[-1], batch_size).astype(np.int32),
  }


# --- results equal the single-device big-batch step ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind,k", [("explicit", 2), ("auto", 4)])
def test_replicated_params_match_the_big_batch_step_over_two_windows(kind, k):
  mesh = mesh_1d(kind)
  params = init_mlp(jax.random.key(0), SIZES)
  batches = [data(D * k * 2, key) for key in (1, 2)]
  inner = optax.adam(1e-2)
  expected, expected_loss = plain_steps(xent_loss, inner, params, batches)

  tx = ga.accumulate(inner, k)
  step = ga.train_step(xent_loss, tx, mesh=mesh, data_axis="data")
  p = put(params, mesh, P())
  state = tx.init(p)
  for batch in batches:
    p, state, metrics = step(p, state, put(batch, mesh, P("data")))
  assert_trees_close(p, expected)
  np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
  assert float(metrics["weight"]) == k  # as on one device: k micro-batches of weight 1
  assert int(state.count) == 2 and int(state.inner_state[0].count) == 2
  for leaf in jax.tree.leaves(p):
    assert leaf.sharding.is_fully_replicated


T = 5  # tokens per row


def token_batch(batch_size, key=3):
  """Rows of T tokens with a padding mask; the real tokens per row differ across devices."""
  rng = np.random.default_rng(key)
  rows = np.arange(batch_size)
  device = rows // (batch_size // D)
  real = 1 + (device + rows) % T  # 1..T real tokens, uneven within and across devices
  return {
    "x": rng.standard_normal((batch_size, T, SIZES[0])).astype(np.float32),
    "y": rng.integers(0, SIZES[-1], (batch_size, T)).astype(np.int32),
    "mask": (np.arange(T)[None, :] < real[:, None]).astype(np.float32),
  }


def token_loss(params, batch):
  """Mean cross-entropy over the real tokens of the (micro-)batch."""
  logp = jax.nn.log_softmax(mlp(params, batch["x"]))
  nll = -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1)[..., 0]
  return jnp.sum(nll * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)


@pytest.mark.slow
def test_token_weighted_with_uneven_tokens_per_device_matches_the_big_batch_step():
  mesh, k = mesh_1d(), 4
  params = init_mlp(jax.random.key(0), SIZES)
  batch = token_batch(D * k * 2)
  per_device = np.asarray(batch["mask"]).reshape(D, -1).sum(axis=1)
  assert len(set(per_device.tolist())) > 1  # the devices really hold different token counts
  inner = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.5))
  expected, expected_loss = plain_steps(token_loss, inner, params, [batch])

  tx = ga.accumulate(inner, k)
  step = ga.train_step(token_loss, tx, weight_fn=lambda mb: jnp.sum(mb["mask"]), mesh=mesh)
  p = put(params, mesh, P())
  p, state, metrics = step(p, tx.init(p), put(batch, mesh, P("data")))
  assert_trees_close(p, expected)
  np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
  assert float(metrics["weight"]) == float(per_device.sum())  # the global token count


@pytest.mark.slow
def test_value_and_grad_on_a_mesh_matches_jax_value_and_grad():
  mesh, k = mesh_1d("auto"), 2
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(D * k * 3)

  def loss_aux(params, mb):
    logits = mlp(params, mb["x"])
    return xent_loss(params, mb), {"correct": jnp.sum(jnp.argmax(logits, -1) == mb["y"])}

  vg = ga.value_and_grad(loss_aux, k, has_aux=True, mesh=mesh)
  (loss, aux), grads = jax.jit(vg)(put(params, mesh, P()), put(batch, mesh, P("data")))
  (ref_loss, ref_aux), ref_grads = jax.value_and_grad(loss_aux, has_aux=True)(params, batch)
  assert_trees_close(grads, ref_grads)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert int(aux["correct"]) == int(ref_aux["correct"])  # integer aux: summed over everything


@pytest.mark.slow
def test_a_window_left_open_by_streaming_is_closed_by_the_mesh_step():
  mesh, k, lr = mesh_1d(), 2, 0.5
  params = init_mlp(jax.random.key(0), SIZES)
  streamed, batch = data(8, key=4), data(D * k)
  tx = ga.accumulate(optax.sgd(lr), k + 1)  # one micro-batch streamed, k in the step
  grad = jax.jit(jax.grad(xent_loss))
  g_streamed, g_batch = grad(params, streamed), grad(params, batch)
  _, state = jax.jit(tx.update)(g_streamed, tx.init(params), params)
  step = ga.train_step(xent_loss, ga.accumulate(optax.sgd(lr), k), mesh=mesh)
  p, _, _ = step(put(params, mesh, P()), put(state, mesh, P()), put(batch, mesh, P("data")))
  # Every micro-batch weighs 1: G = (g_streamed + k * g_batch) / (k + 1).
  expected = jax.tree.map(
    lambda w, a, b: w - lr * (a + k * b) / (k + 1), params, g_streamed, g_batch
  )
  assert_trees_close(p, expected)


@pytest.mark.slow
def test_sharded_params_match_the_big_batch_step_and_keep_their_sharding():
  mesh, k = mesh_1d(), 2
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(D * k * 2)
  inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
  expected, expected_loss = plain_steps(xent_loss, inner, params, [batch])

  tx = ga.accumulate(inner, k)
  step = ga.train_step(xent_loss, tx, mesh=mesh, param_specs=FSDP)
  p = put(params, mesh, FSDP)
  state = tx.init(p)  # zeros_like keeps the params' sharding: mu, nu, acc_grads are sharded
  p, state, metrics = step(p, state, put(batch, mesh, P("data")))
  assert_trees_close(p, expected)
  np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
  for tree in (p, state.acc_grads, state.inner_state[1][0].mu):
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(FSDP), strict=True):
      assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (leaf, spec)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_streaming_updates_on_sharded_params_match_the_big_batch_step(kind):
  """jax.grad + tx.update (jitted, sharding-in-types on an explicit mesh) on FSDP params, a
  window and a flushed half window: the big-batch steps' params. On an explicit mesh, the zero
  updates of a call that holds are sharded like the params (before: a lax.cond TypeError)."""
  mesh, k = mesh_1d(kind), 2
  params = init_mlp(jax.random.key(0), SIZES)
  micro = [data(8, key=i) for i in range(k + 1)]
  inner = optax.adam(1e-2)
  whole = lambda mbs: {n: np.concatenate([mb[n] for mb in mbs]) for n in mbs[0]}  # noqa: E731
  expected, _ = plain_steps(xent_loss, inner, params, [whole(micro[:k]), whole(micro[k:])])
  tx, replicated = ga.accumulate(inner, k), NamedSharding(mesh, P())

  def loss_fn(p, mb):  # gathered for the forward; the gradient comes back sharded like p
    return xent_loss(jax.tree.map(lambda x: jax.sharding.reshard(x, replicated), p), mb)

  @jax.jit
  def update(p, state, mb):
    updates, state = tx.update(jax.grad(loss_fn)(p, mb), state, p)
    return optax.apply_updates(p, updates), state

  @jax.jit
  def flush(p, state):
    updates, state = ga.flush(tx, state, p)
    return optax.apply_updates(p, updates), state

  with jax.set_mesh(mesh):  # as explicit sharding is used
    p = put(params, mesh, FSDP)
    state = tx.init(p)
    for mb in micro:
      p, state = update(p, state, put(mb, mesh, P("data")))
    p, state = flush(p, state)
  assert int(state.count) == 2
  assert_trees_close(p, expected)
  for leaf, spec in zip(jax.tree.leaves(p), jax.tree.leaves(FSDP), strict=True):
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (leaf, spec)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("param_dtype,accum_dtype", [(jnp.bfloat16, jnp.float32), (None, None)])
def test_init_shards_the_accumulator_like_the_params(kind, param_dtype, accum_dtype):
  """Each device holds its shard of the accumulator from ``init`` on, as of optax's ``mu``,
  not a whole one on the first device (a full-size buffer there, at FSDP scale)."""
  mesh = mesh_1d(kind)
  params = init_mlp(jax.random.key(0), SIZES)
  if param_dtype is not None:
    params = jax.tree.map(lambda x: x.astype(param_dtype), params)
  p = put(params, mesh, FSDP)
  state = ga.accumulate(optax.adam(1e-2), 2, accum_dtype=accum_dtype).init(p)
  leaves = jax.tree.leaves(state.acc_grads)
  mus = jax.tree.leaves(state.inner_state[0].mu)
  for acc, mu, x in zip(leaves, mus, jax.tree.leaves(p), strict=True):
    assert acc.sharding == x.sharding == mu.sharding, (acc.sharding, x.sharding)
    assert {s.data.shape for s in acc.addressable_shards} == {x.addressable_shards[0].data.shape}
    assert acc.dtype == (x.dtype if accum_dtype is None else accum_dtype)
    assert not np.any(np.asarray(acc.astype(jnp.float32)))


@pytest.mark.slow
def test_params_sharded_over_one_of_two_data_axes():
  """HSDP: the batch is split over ("replica", "data"); params sharded over "data" only."""
  mesh = jax.make_mesh((2, 4), ("replica", "data"), axis_types=(AxisType.Explicit,) * 2)
  k = 2
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(D * k * 2)
  specs = {"layer0": {"w": P(None, "data"), "b": P()}, "layer1": {"w": P("data"), "b": P()}}
  inner = optax.adam(1e-2)
  expected, _ = plain_steps(xent_loss, inner, params, [batch])
  tx = ga.accumulate(inner, k)
  step = ga.train_step(xent_loss, tx, mesh=mesh, data_axis=("replica", "data"), param_specs=specs)
  p = put(params, mesh, specs)
  p, _, _ = step(p, tx.init(p), put(batch, mesh, P(("replica", "data"))))
  assert_trees_close(p, expected)


def test_model_state_float_leaves_are_averaged_over_devices_and_integer_leaves_kept():
  mesh, k, m = mesh_1d(), 4, 0.5
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(D * k * 2)

  def loss_fn(params, state, mb):  # a running mean of the inputs, and a counter
    ema = m * state["ema"] + (1 - m) * jnp.mean(mb["x"], axis=0)
    return xent_loss(params, mb), {"ema": ema, "steps": state["steps"] + 1}

  model_state = {"ema": jnp.zeros(SIZES[0]), "steps": jnp.zeros((), jnp.int32)}
  tx = ga.accumulate(optax.sgd(0.1), k)
  step = ga.train_step(loss_fn, tx, has_state=True, mesh=mesh)
  p = put(params, mesh, P())
  _, new_state, _, _ = step(p, put(model_state, mesh, P()), tx.init(p), put(batch, mesh, P("data")))

  # Each device runs the k running-average updates on its own rows (its micro-batch i is
  # rows i, i + k, ... of its B / D rows); the devices' results are then averaged.
  x = np.asarray(batch["x"], np.float64).reshape(D, -1, SIZES[0])
  emas = []
  for rows in x:
    ema = np.zeros(SIZES[0])
    for i in range(k):
      ema = m * ema + (1 - m) * rows[i::k].mean(axis=0)
    emas.append(ema)
  np.testing.assert_allclose(new_state["ema"], np.mean(emas, axis=0), rtol=1e-5, atol=1e-6)
  assert int(new_state["steps"]) == k


@pytest.mark.slow
def test_rng_is_folded_with_the_device_then_the_microbatch():
  mesh, k = mesh_1d(), 2
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(D * k)
  key = jax.random.key(7)

  def loss_fn(params, mb, rng):  # the loss plus a draw, whose weighted mean is the metric
    return xent_loss(params, mb), jax.random.uniform(rng)

  tx = ga.accumulate(optax.sgd(0.1), k)
  step = ga.train_step(loss_fn, tx, has_aux=True, mesh=mesh)
  p = put(params, mesh, P())
  _, _, metrics = step(p, tx.init(p), put(batch, mesh, P("data")), rng=key)
  draws = [
    jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, d), i))
    for d in range(D)
    for i in range(k)
  ]
  np.testing.assert_allclose(metrics["aux"], np.mean(draws), rtol=1e-6)
  assert len(set(np.asarray(draws).tolist())) == D * k


# --- the compiled program: no collective in the loop, one reduction after it -----------------


def collectives(compiled):
  """Every collective of a compiled program: (op, result shapes, inside a while loop, bytes)."""
  report = ga.StepReport.from_compiled(compiled)
  assert report.loops, "no while loop in the program"
  return [(c.kind, c.shapes, c.in_loop, c.bytes) for c in report.collectives]


def compiled_step(k, mesh, param_specs=None, weight_fn=None, loss_fn=xent_loss, batch=None):
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(D * k * 2) if batch is None else batch
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  tx = ga.accumulate(inner, k)
  step = ga.train_step(
    loss_fn, tx, mesh=mesh, param_specs=param_specs, weight_fn=weight_fn, donate=False
  )
  p = put(params, mesh, P() if param_specs is None else param_specs)
  args = (p, tx.init(p), put(batch, mesh, P("data")))
  return step.lower(*args).compile(), args


def param_shapes():
  return sorted(tuple(x.shape) for x in jax.tree.leaves(mlp_params(SIZES)))


@pytest.mark.slow
def test_replicated_step_has_one_all_reduce_after_the_loop_whatever_k():
  """Gradients, loss and weight sums go in one tuple all-reduce after the loop, for any k."""
  mesh = mesh_1d()
  found = {}
  for k in (2, 8):
    compiled, _ = compiled_step(k, mesh, weight_fn=lambda mb: jnp.sum(mb["y"] >= 0))
    found[k] = colls = collectives(compiled)
    assert not [c for c in colls if c[2]], colls  # nothing inside the loop body
    assert [op for op, *_ in colls] == ["all-reduce"], colls  # and no all-gather of the batch
    shapes = colls[0][1]
    # One operand per gradient leaf, plus two f32[] scalars: the loss and the weight sums.
    assert sorted(s for s in shapes if s) == param_shapes(), shapes
    assert shapes.count(()) == 2, shapes
  assert found[2] == found[8]


@pytest.mark.slow
def test_sharded_step_gathers_params_once_and_reduce_scatters_once_per_param():
  mesh = mesh_1d()
  found = {}
  for k in (2, 8):
    compiled, (p, _, _) = compiled_step(k, mesh, param_specs=FSDP)
    found[k] = colls = collectives(compiled)
    assert not [c for c in colls if c[2]], colls  # nothing inside the loop body
    gathers = [t for op, t, *_ in colls if op == "all-gather"]
    scatters = [t for op, t, *_ in colls if op == "reduce-scatter"]
    reduces = [t for op, t, *_ in colls if op == "all-reduce"]
    assert {op for op, *_ in colls} == {"all-gather", "reduce-scatter", "all-reduce"}, colls
    # All-gathers are of the params only (each to its full shape), none of the batch.
    assert sorted(s for g in gathers for s in g) == param_shapes(), gathers
    # One reduce-scatter per param, into its 1/D shard.
    shards = sorted(tuple(x.addressable_shards[0].data.shape) for x in jax.tree.leaves(p))
    assert sorted(s for r in scatters for s in r) == shards, scatters
    # The all-reduces are of scalars only: the loss sum, the squared norms of the gradient
    # shards (clip_by_global_norm and the grad_norm metric) and the is-finite check.
    assert all(s == () for r in reduces for s in r), reduces
    assert len(reduces) <= 2, reduces
  assert found[2] == found[8]


def naive_window(params, batch, k):
  """The plain GSPMD way: jit a scan of micro-batch gradients and let XLA partition it."""

  def body(acc, i):
    grads = jax.grad(xent_loss)(params, ga.microbatch(batch, i, k))
    return jax.tree.map(jnp.add, acc, grads), None

  acc, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), jnp.arange(k))
  return jax.tree.map(lambda a: a / k, acc)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_naive_jit_of_a_scan_reduces_inside_the_loop(kind):
  """The check above can fail: GSPMD all-reduces the gradient once per micro-batch."""
  mesh, k = mesh_1d(kind), 4
  params = init_mlp(jax.random.key(0), SIZES)
  batch = put(data(D * k * 2), mesh, P("data"))
  fn = jax.jit(naive_window, static_argnums=2)
  colls = collectives(fn.lower(put(params, mesh, P()), batch, k).compile())
  assert [c for c in colls if c[2] and c[0] == "all-reduce"], colls


# --- two processes, one global mesh -----------------------------------------------------------

WORKER = """
import os, sys
import numpy as np
import jax

process_id, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
  coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
  initialization_timeout=30,
)
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
import gradaccum_jax as ga
from helpers import init_mlp, make_batch, xent_loss

assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
mesh = jax.make_mesh((4,), ("data",))
k, mode = int(sys.argv[4]), sys.argv[5]

def global_array(x, spec):  # every process holds the whole value, and fills its own shards
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

params = init_mlp(jax.random.key(0))  # 6-16-3: every sharded dimension divides by 4
specs = None if mode == "replicated" else {
  "layer0": {"w": P(None, "data"), "b": P("data")}, "layer1": {"w": P("data"), "b": P()},
}
place = lambda tree, spec: jax.tree.map(
  lambda x, s: global_array(x, s), tree,
  jax.tree.broadcast(spec or P(), tree, is_leaf=lambda s: isinstance(s, P)),
)
tx = ga.accumulate(optax.adam(1e-2), k)
p = place(params, specs)
batches = [make_batch(jax.random.key(key), 4 * k * 2) for key in (1, 2)]
if mode == "micro_step":  # k calls of one micro-batch each per window
  step = ga.micro_step(xent_loss, tx, mesh=mesh, param_specs=specs)
  state = step.init(p)
  for batch in batches:
    for i in range(k):
      mb = place(ga.microbatch(batch, i, k), P("data"))
      p, state, metrics = step(p, state, mb)
else:
  gather = "per_microbatch" if mode == "per_microbatch" else "once"
  step = ga.train_step(xent_loss, tx, mesh=mesh, param_specs=specs, gather_params=gather)
  spec_tree = jax.tree.broadcast(specs or P(), params, is_leaf=lambda s: isinstance(s, P))
  state = optax.tree_map_params(  # params-shaped leaves sharded like the params
    tx, global_array, tx.init(params), spec_tree,
    transform_non_params=lambda x: global_array(x, P()), is_leaf=lambda s: isinstance(s, P),
  )
  for batch in batches:
    p, state, metrics = step(p, state, place(batch, P("data")))
p = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(p)  # gather the shards
local = lambda x: np.asarray(x.addressable_shards[0].data)  # replicated: the whole value
result = {jax.tree_util.keystr(q): local(x) for q, x in jax.tree_util.tree_leaves_with_path(p)}
np.savez(os.path.join(out, f"process{process_id}.npz"), loss=local(metrics["loss"]), **result)
"""


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replicated", "per_microbatch", "micro_step"])
def test_two_processes_on_one_global_mesh_train_like_one_device(tmp_path, mode):
  """2 processes x 2 CPU devices (gloo collectives): 2 windows equal the one-device steps, with
  replicated params, FSDP params gathered per micro-batch, and streaming FSDP micro_step."""
  k = 2
  (tmp_path / "worker.py").write_text(WORKER)
  root = Path(__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
  port = free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, str(tmp_path / "worker.py"), str(i), str(port), str(tmp_path), str(k), mode],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  deadline = time.monotonic() + 150  # 2 shared cores: a worker compiles for about 40 s
  try:
    logs = [proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for proc in procs]
  finally:
    for proc in procs:  # never leave a worker behind, whatever happened
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  for proc, log in zip(procs, logs, strict=True):
    assert proc.returncode == 0, log[-3000:]

  params = init_mlp(jax.random.key(0))
  batches = [make_batch(jax.random.key(key), 4 * k * 2) for key in (1, 2)]
  expected, expected_loss = plain_steps(xent_loss, optax.adam(1e-2), params, batches)
  for i in range(2):
    got = np.load(tmp_path / f"process{i}.npz")
    for path, leaf in jax.tree_util.tree_leaves_with_path(expected):
      name = jax.tree_util.keystr(path)
      np.testing.assert_allclose(got[name], leaf, rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(got["loss"], expected_loss, rtol=1e-5)


# --- bad input ---------------------------------------------------------------------------------


def test_a_mesh_without_the_data_axis_names_the_axes_it_has():
  mesh = jax.make_mesh((2, 4), ("replica", "model"))
  tx = ga.accumulate(optax.sgd(0.1), 2)
  with pytest.raises(ValueError, match=r"'batch'.*\{'replica': 2, 'model': 4\}"):
    ga.train_step(xent_loss, tx, mesh=mesh, data_axis="batch")
  with pytest.raises(ValueError, match=r"'data'.*'replica', 'model'"):
    ga.value_and_grad(xent_loss, 2, mesh=mesh)  # data_axis defaults to "data"


def test_data_axis_or_param_specs_without_a_mesh():
  with pytest.raises(ValueError, match="data_axis= needs mesh="):
    ga.value_and_grad(xent_loss, 2, data_axis="data")
  with pytest.raises(ValueError, match="param_specs= needs mesh="):
    ga.train_step(xent_loss, ga.accumulate(optax.sgd(0.1), 2), param_specs=P("data"))


def test_a_batch_not_divisible_by_devices_times_k_names_both():
  mesh, k = mesh_1d(), 4
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(48)  # divisible by D = 8 and by k = 4, not by 32
  vg = ga.value_and_grad(xent_loss, k, mesh=mesh)
  with pytest.raises(ValueError, match=r"B=48 .* 32 = 8 devices .* k=4"):
    vg(params, batch)


def test_param_specs_that_do_not_fit_the_params():
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(16)
  cases = [
    ({"layer0": {"w": P(("data", "model")), "b": P()}, "layer1": P()}, r"data and model|split"),
    ({"layer0": {"w": P("data", "data"), "b": P()}, "layer1": P()}, r"shards 2 dimensions"),
    ({"layer0": P(), "layer1": {"w": P(None, None, "data"), "b": P()}}, r"longer than its shape"),
  ]
  for specs, message in cases:
    vg = ga.value_and_grad(xent_loss, 2, mesh=mesh, param_specs=specs)
    with pytest.raises(ValueError, match=message):
      vg(params, batch)
  odd = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}  # 3 rows on 2 devices
  vg = ga.value_and_grad(lambda p, mb: jnp.sum(p["w"]), 2, mesh=mesh, param_specs=P("data"))
  with pytest.raises(ValueError, match=r"\['w'\].*size 3, not divisible by the 2 devices"):
    vg(odd, batch)
