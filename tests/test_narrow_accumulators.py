"""Narrow (bfloat16, float16) accumulators on a mesh: each device keeps the running weighted mean
of its micro-batches, and the one reduction of the window weighs each device's mean by its
weight (``_parts.Rule``). The mode matrix checks every entry point on a replicated and an FSDP
mesh; these tests check what it does not reach: FSDP params gathered per micro-batch, a
``ga.micro_step`` window's device slots read and continued by the fused step, and the memory
a narrow accumulator saves on each device, read from the compiled programs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import init_mlp, mesh_1d, mlp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

D, K = 8, 4
SIZES = (8, 64, 16)
FSDP = {"layer0": {"w": P(None, "data"), "b": P()}, "layer1": {"w": P("data"), "b": P()}}
NARROW_TOL = {"bfloat16": 2 * K * 2.0**-8, "float16": 2 * K * 2.0**-10}


def token_loss(params, mb):
  logp = jax.nn.log_softmax(mlp(params, mb["x"]))
  nll = -jnp.take_along_axis(logp, mb["y"][:, None], axis=-1)[:, 0]
  return jnp.sum(mb["mask"] * nll) / jnp.sum(mb["mask"])


def tokens(mb):
  return jnp.sum(mb["mask"])


def make_batch(seed, rows):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.standard_normal((rows, SIZES[0])).astype(np.float32),
    "y": rng.integers(0, SIZES[-1], rows).astype(np.int32),
    "mask": (rng.random(rows) < 0.6).astype(np.float32),  # uneven tokens per micro-batch
  }


def put(tree, m, spec):
  specs = jax.tree.broadcast(spec, tree, is_leaf=lambda s: isinstance(s, P))
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(m, s)), tree, specs)


def whole_batch_grads(params, mbs):
  """The token-mean gradient of the micro-batches ``mbs`` as one batch."""
  big = jax.tree.map(lambda *xs: np.concatenate(xs), *mbs)
  return jax.grad(token_loss)(params, big)


def assert_close_to(actual, expected, tol):
  """Each leaf within ``tol`` of its largest entry (a narrow mean rounds once per micro-batch)."""
  for (path, a), e in zip(
    jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
  ):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    err, scale = np.max(np.abs(a - e)), np.max(np.abs(e))
    assert err <= tol * scale, f"{jax.tree_util.keystr(path)}: {err:.3g} > {tol} * {scale:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("gather", ["once", "per_microbatch"])
def test_fsdp_params_gathered_once_or_per_microbatch_with_a_narrow_accumulator(gather, dtype):
  """Per micro-batch, a sharded leaf's ``w g`` is reduce-scattered and summed in float32 (its
  shard), a replicated one keeps the device's running mean; the window is the big batch's."""
  m = mesh_1d()
  params = init_mlp(jax.random.key(0), SIZES)
  batch = make_batch(0, D * K * 2)
  tx = ga.accumulate(optax.sgd(1.0), K, accum_dtype=jnp.dtype(dtype))
  step = ga.train_step(
    token_loss, tx, weight_fn=tokens, mesh=m, param_specs=FSDP, gather_params=gather
  )
  sharded = put(params, m, FSDP)
  new, state, metrics = step(sharded, tx.init(sharded), put(batch, m, P("data")))
  grads = whole_batch_grads(params, [ga.microbatch(batch, i, K) for i in range(K)])
  moved = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new, params)
  assert_close_to(moved, jax.tree.map(jnp.negative, grads), NARROW_TOL[dtype])
  assert state.acc_grads["layer0"]["w"].dtype == jnp.dtype(dtype)
  assert float(metrics["weight"]) == float(np.sum(batch["mask"]))


@pytest.mark.slow
def test_micro_step_slots_of_running_means_read_and_continued_by_the_fused_step():
  """Two micro_step calls on a mesh: ``state.acc_grads`` and ``to_accumulate_state`` weigh each
  device slot's running mean by its weight (summing them would be D times too large); the fused
  step then closes the window with its own K micro-batches: the big batch of all six."""
  m = mesh_1d()
  params = init_mlp(jax.random.key(1), SIZES)
  tx = ga.accumulate(optax.sgd(1.0), K, accum_dtype=jnp.bfloat16)
  micro = ga.micro_step(token_loss, tx, weight_fn=tokens, mesh=m)
  fused = ga.train_step(token_loss, tx, weight_fn=tokens, mesh=m)
  p = put(params, m, P())
  state = tx.init(p)
  mbs = [make_batch(10 + i, D * 2) for i in range(2)]
  for mb in mbs:
    p, state, _ = micro(p, state, put(mb, m, P("data")))
  assert state.accumulate.acc_grads["layer0"]["w"].shape[0] == D  # one slot per device
  tol = NARROW_TOL["bfloat16"]
  open_mean = whole_batch_grads(params, mbs)
  assert_close_to(state.acc_grads, open_mean, tol)
  assert_close_to(micro.to_accumulate_state(state).acc_grads, open_mean, tol)
  np.testing.assert_allclose(float(state.acc_weight), sum(float(tokens(mb)) for mb in mbs))

  batch = make_batch(20, D * K * 2)
  new, state, metrics = fused(p, state, put(batch, m, P("data")))
  assert bool(metrics["updated"]) and int(state.count) == 1
  grads = whole_batch_grads(params, [*mbs, *(ga.microbatch(batch, i, K) for i in range(K))])
  moved = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new, params)
  assert_close_to(moved, jax.tree.map(jnp.negative, grads), tol)


def accumulator_bytes_per_device(state):
  """The bytes one device holds of ``state.acc_grads``, from its arrays' shards."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.acc_grads))


@pytest.mark.slow
@pytest.mark.parametrize("specs", [None, FSDP], ids=["replicated", "fsdp"])
def test_a_narrow_accumulator_halves_the_accumulator_bytes_of_each_device(specs):
  """The compiled fused step's arguments and outputs (params, state, batch) per device are
  smaller by exactly the float32 accumulator's bytes minus the bfloat16 one's: the accumulator
  alone is narrower, and no float32 copy of it is kept between windows."""
  m = mesh_1d()
  params = put(init_mlp(jax.random.key(0), SIZES), m, specs or P())
  batch = put(make_batch(0, D * K * 2), m, P("data"))
  analysis, held = {}, {}
  for dtype in (jnp.float32, jnp.bfloat16):
    tx = ga.accumulate(optax.sgd(1.0), K, accum_dtype=dtype)
    state = tx.init(params)
    step = ga.train_step(token_loss, tx, weight_fn=tokens, mesh=m, param_specs=specs)
    analysis[dtype] = step.lower(params, state, batch).compile().memory_analysis()
    held[dtype] = accumulator_bytes_per_device(state)
  saved = held[jnp.float32] - held[jnp.bfloat16]
  per_device = sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(params))
  assert saved == 2 * per_device  # 4 - 2 bytes per entry of the device's params
  wide, narrow = analysis[jnp.float32], analysis[jnp.bfloat16]
  assert wide.argument_size_in_bytes - narrow.argument_size_in_bytes == saved
  assert wide.output_size_in_bytes - narrow.output_size_in_bytes == saved


@pytest.mark.slow
@pytest.mark.parametrize("specs", [None, FSDP], ids=["replicated", "fsdp"])
def test_a_narrow_accumulator_takes_the_float32_accumulators_collectives(specs):
  """Each device's running mean joins the window's one all-reduce as ``mean * weight`` in
  float32 (an all-reduce has one dtype): the narrow step's collectives, in the loop and after
  it, are the float32 step's, and none is in the loop."""
  m = mesh_1d()
  params = put(init_mlp(jax.random.key(0), SIZES), m, specs or P())
  batch = put(make_batch(0, D * K * 2), m, P("data"))
  reports = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    tx = ga.accumulate(optax.sgd(1.0), K, accum_dtype=dtype)
    step = ga.train_step(token_loss, tx, weight_fn=tokens, mesh=m, param_specs=specs)
    reports[dtype] = ga.inspect_step(step, params, tx.init(params), batch)
  wide, narrow = reports[jnp.float32], reports[jnp.bfloat16]
  assert narrow.in_loop == wide.in_loop == {}
  assert narrow.after_loop == wide.after_loop
  if specs is None:
    assert narrow.after_loop == {"all-reduce": 1}
