"""FSDP gather policies (once, per micro-batch, auto) and tensor-parallel meshes, on 8 CPU devices."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, init_mlp, mesh_1d, mesh_2d, mlp, put, xent_loss
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_flax_mesh import (
  LR,
  LinenCNN,
  NnxCNN,
  TrainState,
  fsdp_specs,
  image_batch,
  keys_as_data,
  linen_reference,
  nnx,
  nnx_reference,
  nnx_xent,
  xent,
)
from test_flax_mesh import K as FLAX_K
from test_sharding import FSDP, SIZES, D, data, plain_steps

import gradaccum_jax as ga

# --- reading the compiled HLO: collectives, where they run, over which devices ----------------


def _iota(text):
  """'[4,2]T(1,0)' or '[8]' -> the device ids of an iota list."""
  m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  dims = [int(d) for d in m.group(1).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(2):
    ids = ids.transpose([int(d) for d in m.group(2).split(",")])
  return ids.reshape(-1)


def replica_groups(line):
  """The device groups of a collective's HLO line, whatever notation XLA printed."""
  m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
  if m:
    return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", line)
  if m:
    return _iota(m.group(3)).reshape(int(m.group(1)), int(m.group(2))).tolist()
  m = re.search(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?)\))?"
    r" \{([^}]*)\}",
    line,
  )
  assert m, line
  axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
  shape = [int(n) for _, n in axes]
  ids = (_iota(m.group(2)) if m.group(2) else np.arange(int(np.prod(shape)))).reshape(shape)
  over = [i for i, (a, _) in enumerate(axes) if f"'{a}'" in m.group(3)]
  keep = [i for i in range(len(shape)) if i not in over]
  ids = ids.transpose(keep + over).reshape(-1, int(np.prod([shape[i] for i in over])))
  return ids.tolist()


def collectives_with_groups(compiled, mesh, data_axes=("data",)):
  """(op, result shapes, in a loop body, whether its groups span the data axes) per collective."""
  coords = np.array(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)).T
  data_dims = [mesh.axis_names.index(a) for a in data_axes]
  found = []
  for c in ga.StepReport.from_compiled(compiled).collectives:
    groups = replica_groups(c.text)
    spans = any(len({tuple(coords[d][data_dims]) for d in g}) > 1 for g in groups)
    found.append((c.kind, c.shapes, c.in_loop, spans))
  return found


# --- gather_params on FSDP params: equal to one device -----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["per_microbatch", "auto"])
def test_fsdp_gather_policies_match_the_big_batch_step(gather):
  mesh, k = mesh_1d(), 2
  params = init_mlp(jax.random.key(0), SIZES)
  batches = [data(D * k * 2, key) for key in ((1, 2) if gather == "per_microbatch" else (1,))]
  inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
  expected, expected_loss = plain_steps(xent_loss, inner, params, batches)

  tx = ga.accumulate(inner, k)
  budget = {"auto": {"memory_budget_bytes": 1}}.get(gather, {})  # nothing fits: per micro-batch
  step = ga.train_step(xent_loss, tx, mesh=mesh, param_specs=FSDP, gather_params=gather, **budget)
  p = put(params, mesh, FSDP)
  state = tx.init(p)
  for batch in batches:
    args = (p, state, put(batch, mesh, P("data")))
    if gather == "auto":
      assert step.chosen_gather_params(*args) == "per_microbatch"
      found = step.gather_params_bytes(*args)
      assert set(found) == {"once", "per_microbatch"} and min(found.values()) > 1
    p, state, metrics = step(*args)
  assert_trees_close(p, expected)
  np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
  for tree in (p, state.acc_grads, state.inner_state[1][0].mu):
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(FSDP), strict=True):
      assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (leaf, spec)


@pytest.mark.slow
def test_the_noise_scale_is_the_same_whatever_the_layout_and_the_gathering():
  """The window's noise estimates over the D * k device micro-batches, by hand from
  jax.grad on each device's rows, equal train_step's with replicated params and with FSDP
  params gathered once and per micro-batch, and the noise scale of ga.micro_step (FSDP and
  replicated) equals train_step's."""
  mesh, k = mesh_1d(), 2
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(D * k * 4, 1)
  grads = []  # device d of micro-batch i: its contiguous slice of the micro-batch's rows
  for i in range(k):
    mb = ga.microbatch(batch, i, k)
    rows = len(mb["x"]) // D
    for d in range(D):
      shard = {key: x[d * rows : (d + 1) * rows] for key, x in mb.items()}
      g = jax.grad(xent_loss)(params, shard)
      grads.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]).astype(np.float64))
  grads = np.stack(grads)
  n, examples = len(grads), len(batch["x"])
  gbar2, mean_sq = np.sum(grads.mean(0) ** 2), np.mean(np.sum(grads**2, 1))
  expected_g2 = (n * gbar2 - mean_sq) / (n - 1)
  expected_trace = examples * (mean_sq - gbar2) / (n - 1)

  def tx():
    return ga.accumulate(optax.sgd(0.0), k, noise_scale_ema=0.9)

  scales = []
  for specs, gather in ((None, "once"), (FSDP, "once"), (FSDP, "per_microbatch")):
    t = tx()
    step = ga.train_step(xent_loss, t, mesh=mesh, param_specs=specs, gather_params=gather)
    p = put(params, mesh, specs or P())
    _, state, metrics = step(p, t.init(p), put(batch, mesh, P("data")))
    np.testing.assert_allclose(metrics["grad_sq_norm_est"], expected_g2, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["trace_sigma_est"], expected_trace, rtol=1e-4)
    scales.append(float(ga.noise_scale(state)))
  for specs in (None, FSDP):
    step = ga.micro_step(xent_loss, tx(), mesh=mesh, param_specs=specs)
    p = put(params, mesh, specs or P())
    state = step.init(p)
    for i in range(k):
      p, state, _ = step(p, state, put(ga.microbatch(batch, i, k), mesh, P("data")))
    scales.append(float(ga.noise_scale(state.accumulate)))
  np.testing.assert_allclose(scales, expected_trace / expected_g2, rtol=1e-3)


@pytest.mark.slow
def test_auto_runs_once_when_it_fits_the_budget():
  mesh, k = mesh_1d(), 2
  params = init_mlp(jax.random.key(0), SIZES)
  tx = ga.accumulate(optax.sgd(0.1), k)
  step = ga.train_step(
    xent_loss, tx, mesh=mesh, param_specs=FSDP, gather_params="auto", memory_budget_bytes=2**40
  )
  p = put(params, mesh, FSDP)
  args = (p, tx.init(p), put(data(D * k), mesh, P("data")))
  assert step.chosen_gather_params(*args) == "once"
  assert step.budget == 2**40


@pytest.mark.slow
def test_auto_compiles_each_policy_once_and_runs_the_program_it_compiled():
  """Traces of the loss: one program per policy to choose, none more for the calls (the
  chosen program runs as compiled; before, the call compiled it a third time)."""
  mesh, k = mesh_1d(), 2
  params = init_mlp(jax.random.key(0), SIZES)
  tx = ga.accumulate(optax.sgd(0.1), k)
  traced = []
  loss = lambda p, mb: (traced.append(1), xent_loss(p, mb))[1]  # noqa: E731
  auto = ga.train_step(loss, tx, mesh=mesh, param_specs=FSDP, gather_params="auto",
                       memory_budget_bytes=1)  # fmt: skip
  p = put(params, mesh, FSDP)
  args = (p, tx.init(p), put(data(D * k), mesh, P("data")))
  assert auto.chosen_gather_params(*args) == "per_microbatch"
  per_program = len(traced) // 2
  assert per_program >= 1 and len(traced) == 2 * per_program
  p1, _, _ = auto(*args)
  p2, _, _ = auto(*args)
  assert len(traced) == 2 * per_program, traced
  plain = ga.train_step(xent_loss, tx, mesh=mesh, param_specs=FSDP, gather_params="per_microbatch")
  assert_trees_close(p1, plain(*args)[0])
  with pytest.raises(ValueError, match="num_real_microbatches"):
    auto(*args, num_real_microbatches=k + 1)
  # ga.inspect_step reads the chosen program: per micro-batch, its gathers are in the loop.
  report = ga.inspect_step(auto, *args)
  assert report.in_loop.get("all-gather", 0) > 0 and report.in_loop.get("reduce-scatter", 0) > 0


@pytest.mark.slow
def test_value_and_grad_per_microbatch_matches_jax_value_and_grad():
  mesh, k = mesh_1d(), 2
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(D * k * 2)
  vg = ga.value_and_grad(xent_loss, k, mesh=mesh, param_specs=FSDP, gather_params="per_microbatch")
  loss, grads = jax.jit(vg)(put(params, mesh, FSDP), put(batch, mesh, P("data")))
  ref_loss, ref_grads = jax.value_and_grad(xent_loss)(params, batch)
  assert_trees_close(grads, ref_grads)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)


# --- compiled evidence: where the collectives run, and the memory -----------------------------


@pytest.mark.slow
def test_per_microbatch_gathers_and_reduce_scatters_inside_the_loop():
  mesh, k = mesh_1d(), 4
  params = init_mlp(jax.random.key(0), SIZES)
  tx = ga.accumulate(optax.adam(1e-2), k)
  step = ga.train_step(xent_loss, tx, mesh=mesh, param_specs=FSDP, gather_params="per_microbatch")
  p = put(params, mesh, FSDP)
  compiled = step.lower(p, tx.init(p), put(data(D * k), mesh, P("data"))).compile()
  found = collectives_with_groups(compiled, mesh)
  in_loop = sorted((op, s) for op, shapes, loop, _ in found if loop for s in shapes)
  full = sorted(tuple(x.shape) for x in jax.tree.leaves(params))
  shards = sorted(tuple(x.addressable_shards[0].data.shape) for x in jax.tree.leaves(p))
  # Each micro-batch gathers every param and reduce-scatters its gradient: nothing else.
  assert in_loop == sorted(
    [("all-gather", s) for s in full] + [("reduce-scatter", s) for s in shards]
  )
  # After the loop only scalars are all-reduced (loss sum, the norm for clipping, finiteness).
  assert all(s == () for op, shapes, loop, _ in found if not loop for s in shapes), found


def wide_mlp_step(gather, k, sizes=(512, 1024, 1024, 512)):
  """A params-dominated MLP (8 MiB of float32 params, 2 rows per device per micro-batch),
  compiled on abstract shapes with every leaf sharded over the 8 devices."""
  mesh = mesh_1d()
  sharding = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
  specs = {f"layer{i}": {"w": P("data"), "b": P("data")} for i in range(len(sizes) - 1)}
  params = {
    f"layer{i}": {
      "w": jax.ShapeDtypeStruct((m, n), jnp.float32, sharding=sharding(P("data"))),
      "b": jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding(P("data"))),
    }
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
  }

  def loss_fn(p, mb):
    x = mb["x"]
    for i in range(len(sizes) - 1):
      x = x @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
      x = jnp.tanh(x) if i < len(sizes) - 2 else x
    return jnp.mean(x**2)

  tx = ga.accumulate(optax.sgd(0.1), k)
  state = jax.eval_shape(tx.init, params)
  state = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(P())), state
  )._replace(acc_grads=params)
  batch = {
    "x": jax.ShapeDtypeStruct((D * k * 2, sizes[0]), jnp.float32, sharding=sharding(P("data")))
  }
  step = ga.train_step(loss_fn, tx, mesh=mesh, param_specs=specs, gather_params=gather)
  param_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
  return step.lower(params, state, batch).compile(), param_bytes


@pytest.mark.slow
def test_per_microbatch_needs_less_temp_memory_than_once_for_a_params_dominated_model():
  temp = {}
  for gather in ("once", "per_microbatch"):
    compiled, param_bytes = wide_mlp_step(gather, k=4)
    temp[gather] = compiled.memory_analysis().temp_size_in_bytes
  # Once: the gathered params and a full-size local accumulator for the whole window.
  # Per micro-batch: the gathered params of one micro-batch and a 1/8 accumulator.
  assert temp["once"] - temp["per_microbatch"] >= param_bytes / 2, (temp, param_bytes)
  assert temp["once"] >= param_bytes  # XLA:CPU really reports temp memory at this size


# --- tensor parallelism: params sharded over a model axis, left to GSPMD ----------------------

TP = {"layer0": {"w": P(None, "model"), "b": P("model")}, "layer1": {"w": P("model"), "b": P()}}
FSDP_TP = {
  "layer0": {"w": P("data", "model"), "b": P("model")},
  "layer1": {"w": P("model", "data"), "b": P("data")},
}


def explicit_xent_loss(params, batch):
  """helpers.xent_loss written for explicit sharding: each product's output is sharded like
  its rows and replicated over the model axis (a product that contracts a model-sharded
  dimension must say so); on arrays without a mesh it is xent_loss."""
  h = batch["x"]
  for i in range(len(params)):
    sharding = jax.typeof(h).sharding
    out = None if sharding.mesh.empty else NamedSharding(sharding.mesh, P(sharding.spec[0], None))
    h = jnp.matmul(h, params[f"layer{i}"]["w"], out_sharding=out) + params[f"layer{i}"]["b"]
    h = jnp.tanh(h) if i < len(params) - 1 else h
  logp = jax.nn.log_softmax(h)
  return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize(
  "specs,gather",
  [(TP, "once"), (FSDP_TP, "once"), (FSDP_TP, "per_microbatch")],
  ids=["tp", "fsdp_tp_once", "fsdp_tp_per_microbatch"],
)
def test_tensor_parallel_params_match_the_big_batch_step(specs, gather, kind):
  """On an explicit mesh (jax.make_mesh's default) the loss says the sharding of the products
  that contract a model-sharded dimension, as a plain jax.jit step would need too; before, the
  accumulator's zeros lacked the model sharding in their type (scan carry mismatch) and the
  per-micro-batch gather padded a model-sharded shard into unsharded zeros."""
  mesh, k = mesh_2d(kind), 2
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(4 * k * 2)
  inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
  expected, expected_loss = plain_steps(xent_loss, inner, params, [batch])
  tx = ga.accumulate(inner, k)
  loss = explicit_xent_loss if kind == "explicit" else xent_loss
  step = ga.train_step(loss, tx, mesh=mesh, param_specs=specs, gather_params=gather)
  p = put(params, mesh, specs)
  args = (p, tx.init(p), put(batch, mesh, P("data")))
  found = collectives_with_groups(step.lower(*args).compile(), mesh)
  over_data_in_loop = [c for c in found if c[2] and c[3]]
  if gather == "once":  # the loop only talks over "model" (the activations of the TP layers)
    assert not over_data_in_loop, found
  else:  # per micro-batch: the data-sharded params are gathered, their gradients reduced
    assert over_data_in_loop and not [c for c in over_data_in_loop if c[0] == "all-to-all"]
  p, state, metrics = step(*args)
  assert_trees_close(p, expected)
  np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
  for leaf, spec in zip(jax.tree.leaves(p), jax.tree.leaves(specs), strict=True):
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (leaf, spec)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("specs", [TP, FSDP_TP], ids=["tp", "fsdp_tp"])
def test_micro_step_with_tensor_parallel_params_matches_the_big_batch_step(specs, kind):
  """ga.micro_step on a data x model mesh: k calls of one micro-batch equal the big-batch step
  and the params keep their model sharding. Before, its shard_maps (manual over the data axes
  only) were given specs naming the model axis, an error on every mesh."""
  mesh, k = mesh_2d(kind), 2
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(4 * k * 2)
  expected, expected_loss = plain_steps(xent_loss, optax.adam(1e-2), params, [batch])
  loss = explicit_xent_loss if kind == "explicit" else xent_loss
  step = ga.micro_step(loss, ga.accumulate(optax.adam(1e-2), k), mesh=mesh, param_specs=specs)
  p = put(params, mesh, specs)
  state = step.init(p)
  for i in range(k):
    p, state, metrics = step(p, state, put(ga.microbatch(batch, i, k), mesh, P("data")))
  assert bool(metrics["updated"])
  assert_trees_close(p, expected)
  np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
  for leaf, spec in zip(jax.tree.leaves(p), jax.tree.leaves(specs), strict=True):
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (leaf, spec)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_micro_step_keeps_model_state_sharded_over_the_model_axis(kind):
  """Model state sharded over "model" (a running mean of the TP layer's hidden units) through
  ga.micro_step on a 4x2 mesh: each call averages the devices' state, so with equal rows per
  device it is the running mean of each whole micro-batch's hidden units, the closed form here.
  Before, the state was replicated over the model axis too and an explicit mesh raised a scan
  carry type mismatch."""
  mesh, k, m = mesh_2d(kind), 2, 0.5

  xent = explicit_xent_loss if kind == "explicit" else xent_loss

  def hidden(params, x):  # model-sharded units (an explicit mesh wants that said)
    sharding = jax.typeof(x).sharding
    out = None
    if kind == "explicit" and not sharding.mesh.empty:
      out = NamedSharding(sharding.mesh, P(sharding.spec[0], "model"))
    w, b = params["layer0"]["w"], params["layer0"]["b"]
    return jnp.tanh(jnp.matmul(x, w, out_sharding=out) + b)

  def loss_fn(params, state, mb):
    ema = m * state["ema"] + (1 - m) * jnp.mean(hidden(params, mb["x"]), axis=0)
    return xent(params, mb), {"ema": ema}

  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(4 * k * 2)
  expected, _ = plain_steps(xent_loss, optax.sgd(1e-2, momentum=0.9), params, [batch])
  ema = jnp.zeros(SIZES[1])
  for i in range(k):
    ema = m * ema + (1 - m) * jnp.mean(hidden(params, ga.microbatch(batch, i, k)["x"]), axis=0)
  tx = ga.accumulate(optax.sgd(1e-2, momentum=0.9), k)
  step = ga.micro_step(loss_fn, tx, has_state=True, mesh=mesh, param_specs=TP)
  p, s = put(params, mesh, TP), put({"ema": jnp.zeros(SIZES[1])}, mesh, P("model"))
  state = step.init(p)
  for i in range(k):
    p, s, state, metrics = step(p, s, state, put(ga.microbatch(batch, i, k), mesh, P("data")))
  assert bool(metrics["updated"])
  assert_trees_close(p, expected)
  np.testing.assert_allclose(s["ema"], ema, rtol=1e-5, atol=1e-6)
  assert s["ema"].sharding.is_equivalent_to(NamedSharding(mesh, P("model")), 1), s["ema"].sharding


# --- donated: the scan adds into the state's accumulator on the mesh too ----------------------

# HSDP: the batch split over ("replica", "data"), the weights sharded over "data" only.
HSDP = {"layer0": {"w": P(None, "data"), "b": P()}, "layer1": {"w": P("data"), "b": P()}}
LAYOUTS = {  # (mesh, param_specs, gather_params)
  "replicated": ("1d", None, "once"),
  "fsdp_once": ("1d", FSDP, "once"),
  "fsdp_per_microbatch": ("1d", FSDP, "per_microbatch"),
  "tp": ("2d", TP, "once"),
  "fsdp_tp_per_microbatch": ("2d", FSDP_TP, "per_microbatch"),
  "hsdp_per_microbatch": ("hsdp", HSDP, "per_microbatch"),
}


def layout_mesh(kind):
  """``(mesh, data axes)`` of a LAYOUTS mesh kind."""
  if kind == "hsdp":
    mesh = jax.make_mesh((2, 4), ("replica", "data"), axis_types=(AxisType.Explicit,) * 2)
    return mesh, ("replica", "data")
  return (mesh_1d() if kind == "1d" else mesh_2d("auto")), "data"


def kept(batch):
  """The rows a weighted loss counts (a padding mask): about two in three."""
  return (batch["y"] % 3 != 0).astype(jnp.float32)


def masked_loss(params, batch):
  """The mean cross-entropy over the kept rows: weighted by their number, a window's gradient
  is the gradient of the mean over every kept row of the window, however it is split."""
  logp = jax.nn.log_softmax(mlp(params, batch["x"]))
  rows = -jnp.take_along_axis(logp, batch["y"][:, None], axis=1)[:, 0]
  return jnp.sum(kept(batch) * rows) / jnp.maximum(jnp.sum(kept(batch)), 1.0)


@pytest.mark.slow
@pytest.mark.parametrize(
  "layout,weighted",
  [(layout, False) for layout in LAYOUTS]
  # Weighted, where the open window starts on one device of a group: nothing is scaled.
  + [("replicated", True), ("fsdp_tp_per_microbatch", True), ("hsdp_per_microbatch", True)],
)
def test_a_donated_mesh_step_scanning_into_the_state_closes_a_window_left_open(layout, weighted):
  """Donated, each device's scan starts from its share of the state's accumulator: the first device of each group that
  the sums are reduced over starts from a window left open by streaming calls, the others from
  zeros (unweighted, scaled by the devices, as the reduction divides by them), so the open
  window counts once. SGD's update against the closed form of the window's mean gradient,
  over every layout (HSDP: a weight sharded over "data" starts on the first "replica", a bias
  replicated over both data axes on one device of the eight)."""
  mesh_kind, specs, gather = LAYOUTS[layout]
  mesh, axes = layout_mesh(mesh_kind)
  devices = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
  k, lr = 2, 0.5
  params = init_mlp(jax.random.key(0), SIZES)
  streamed, batch = data(4, key=4), data(devices * k * 2)
  loss_fn = masked_loss if weighted else xent_loss
  grad = jax.jit(jax.grad(loss_fn))
  if weighted:  # G: the mean over every kept row of the window
    both = jax.tree.map(lambda a, b: np.concatenate([a, b]), streamed, batch)
    total = lambda p: masked_loss(p, both) * jnp.sum(kept(both))  # noqa: E731
    mean_grad = jax.tree.map(lambda g: g / jnp.sum(kept(both)), jax.grad(total)(params))
    weight = jnp.sum(kept(streamed))
  else:  # every micro-batch weighs 1: G = (g_streamed + k * g_batch) / (k + 1)
    g_s, g_b = grad(params, streamed), grad(params, batch)
    mean_grad = jax.tree.map(lambda a, b: (a + k * b) / (k + 1), g_s, g_b)
    weight = None
  expected = jax.tree.map(lambda w, g: w - lr * g, params, mean_grad)

  tx = ga.accumulate(optax.sgd(lr), k + 1)  # one micro-batch streamed, k in the step
  p = put(params, mesh, P() if specs is None else specs)
  state = tx.init(p)
  _, state = jax.jit(tx.update)(grad(params, streamed), state, p, weight=weight)
  assert int(state.micro_step) == 1
  step = ga.train_step(
    loss_fn, ga.accumulate(optax.sgd(lr), k), mesh=mesh, data_axis=axes, param_specs=specs,
    gather_params=gather, donate=True, weight_fn=(lambda mb: jnp.sum(kept(mb))) if weighted else None,
  )  # fmt: skip
  p, state, metrics = step(p, state, put(batch, mesh, P(axes)))
  assert bool(metrics["updated"])
  assert_trees_close(p, expected)
  assert int(state.micro_step) == 0 and int(state.count) == 1
  for leaf in jax.tree.leaves(state.acc_grads):
    assert not np.any(np.asarray(leaf)), "the accumulator is cleared"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["replicated", "fsdp_once", "fsdp_per_microbatch"])
def test_the_donated_mesh_step_trains_as_the_undonated_one(layout):
  """The donated mesh step (scanning into the state's accumulator, the update in a loop of 0
  or 1 trips) against the undonated one (selects, new buffers), from the same start with adam
  and the noise scale estimated: a window left open by a streamed micro-batch, then a short
  window (``num_real_microbatches=1``). The same params, metrics and state, from two
  different programs."""
  mesh_kind, specs, gather = LAYOUTS[layout]
  mesh, axes = layout_mesh(mesh_kind)
  k = 2
  params = jax.device_get(init_mlp(jax.random.key(0), SIZES))  # on the host: donation spares it
  streamed = data(4, key=4)
  batches = [put(data(D * k * 2, key=5 + i), mesh, P(axes)) for i in range(2)]
  runs, programs = {}, {}
  for into in (False, True):  # donated or not
    tx = ga.accumulate(optax.adam(1e-2), k, noise_scale_ema=0.9)
    p = put(params, mesh, P() if specs is None else specs)
    state = tx.init(p)
    _, state = jax.jit(tx.update)(jax.grad(xent_loss)(params, streamed), state, p)
    assert int(state.micro_step) == 1
    step = ga.train_step(
      xent_loss, tx, mesh=mesh, data_axis=axes, param_specs=specs, gather_params=gather,
      donate=into,
    )  # fmt: skip
    programs[into] = step.lower(p, state, batches[0], num_real_microbatches=None).as_text()
    metrics = []
    for batch, m in zip(batches, (None, 1), strict=True):
      p, state, out = step(p, state, batch, num_real_microbatches=m)
      metrics.append(jax.device_get(out))
    runs[into] = jax.device_get((p, state, metrics))
  assert programs[True] != programs[False]
  (p0, s0, m0), (p1, s1, m1) = runs[False], runs[True]
  assert_trees_close(p1, p0)
  assert_trees_close(s1, s0)
  for a, b in zip(m1, m0, strict=True):
    assert bool(a["updated"]) and bool(b["updated"])
    assert_trees_close(a, b)
  assert [float(m["weight"]) for m in m0] == [k, 1]  # each batch's micro-batches run
  assert int(s1.count) == 2 and int(s1.micro_step) == 0


# --- bad input ---------------------------------------------------------------------------------


def test_a_dimension_split_over_data_and_model_axes_names_the_leaf():
  mesh = mesh_2d("auto")
  params = init_mlp(jax.random.key(0), SIZES)
  specs = {"layer0": {"w": P(("data", "model")), "b": P()}, "layer1": P()}
  vg = ga.value_and_grad(xent_loss, 2, mesh=mesh, param_specs=specs)
  with pytest.raises(ValueError, match=r"\['layer0'\]\['w'\].*dimension 0 is split over the data"):
    vg(params, data(16))


@pytest.mark.parametrize(
  "specs,message",
  [
    (P("replica"), r"'replica' is not an axis of the mesh"),
    ({"layer0": {"w": P("data", "data"), "b": P()}, "layer1": P()}, r"shards 2 dimensions over"),
  ],
)
def test_param_specs_naming_unknown_axes_or_two_data_dimensions(specs, message):
  vg = ga.value_and_grad(xent_loss, 2, mesh=mesh_2d("auto"), param_specs=specs)
  with pytest.raises(ValueError, match=message):
    vg(init_mlp(jax.random.key(0), SIZES), data(16))


def test_bad_gather_params_and_budget():
  tx = ga.accumulate(optax.sgd(0.1), 2)
  mesh = mesh_1d()
  with pytest.raises(ValueError, match=r"gather_params='sometimes' must be one of 'once'"):
    ga.train_step(xent_loss, tx, mesh=mesh, param_specs=FSDP, gather_params="sometimes")
  with pytest.raises(ValueError, match=r"gather_params= needs mesh="):
    ga.train_step(xent_loss, tx, gather_params="per_microbatch")
  with pytest.raises(
    ValueError, match=r"memory_budget_bytes= is the budget of gather_params='auto'"
  ):
    ga.train_step(xent_loss, tx, mesh=mesh, memory_budget_bytes=2**30)
  with pytest.raises(ValueError, match=r"reports no memory limit .* Pass memory_budget_bytes="):
    ga.train_step(xent_loss, tx, mesh=mesh, param_specs=FSDP, gather_params="auto")
  with pytest.raises(ValueError, match=r"needs jit=True"):
    ga.train_step(xent_loss, tx, mesh=mesh, gather_params="auto", memory_budget_bytes=1, jit=False)
  with pytest.raises(ValueError, match=r"value_and_grad: gather_params='auto'"):
    ga.value_and_grad(xent_loss, 2, mesh=mesh, gather_params="auto")


def test_a_two_axis_mesh_without_a_data_axis_names_its_axes():
  mesh = jax.make_mesh((4, 2), ("batch", "model"))
  tx = ga.accumulate(optax.sgd(0.1), 2)
  with pytest.raises(ValueError, match=r"data_axis='data'.*\{'batch': 4, 'model': 2\}"):
    ga.train_step(xent_loss, tx, mesh=mesh, param_specs=TP)


# --- the Linen and NNX steps take the policy too -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
  "layout,donated",
  [
    ("fsdp_per_microbatch", False),
    ("replicated", True),
    ("fsdp_once", True),
    ("fsdp_per_microbatch", True),
  ],
)
def test_linen_step_matches_the_device_group_reference(layout, donated):
  """FSDP params gathered per micro-batch, and donated steps (scanning into the state's
  accumulator) in every layout: BatchNorm's statistics, the first update and the loss as the
  device-group reference computes them."""
  model, m, batch, rng = LinenCNN(), mesh_1d(), image_batch(), jax.random.key(7)
  variables = model.init(jax.random.key(0), batch["x"][:1], train=False)
  # On the host, so that the donated step spares them for the reference below.
  params, stats = jax.device_get((variables["params"], variables["batch_stats"]))
  specs = None if layout == "replicated" else fsdp_specs(params)
  state = TrainState.create(
    apply_fn=model.apply,
    params=put(params, m, P() if specs is None else specs),
    batch_stats=put(stats, m, P()),
    tx=ga.accumulate(optax.adam(LR), FLAX_K),
  )
  step = ga.linen_train_step(
    model, xent, train_kwargs={"train": True}, mesh=m, param_specs=specs,
    gather_params=LAYOUTS[layout][2], donate=donated,
  )  # fmt: skip
  new_state, metrics = step(state, put(batch, m, P("data")), rng)
  ref_params, ref_stats, ref_loss = linen_reference(model, params, stats, batch, rng)
  assert_trees_close(new_state.params, ref_params)
  assert_trees_close(new_state.batch_stats, ref_stats)
  np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
  assert int(new_state.step) == 1 and bool(metrics["updated"])


@pytest.mark.slow
def test_nnx_step_with_auto_gathering_matches_the_device_group_reference():
  m, batch = mesh_1d(), image_batch(1)
  ref_params, ref_rest, ref_loss = nnx_reference(NnxCNN(), batch)
  model = NnxCNN()
  specs = fsdp_specs(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  optimizer = nnx.Optimizer(model, ga.accumulate(optax.adam(LR), FLAX_K), wrt=nnx.Param)
  step = ga.nnx_train_step(
    nnx_xent, mesh=m, param_specs=specs, gather_params="auto", memory_budget_bytes=1
  )
  sharded = put(batch, m, P("data"))
  assert step.chosen_gather_params(model, optimizer, sharded) == "per_microbatch"
  metrics = step(model, optimizer, sharded)
  assert_trees_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)), ref_params)
  new_rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
  assert_trees_close(keys_as_data(new_rest), keys_as_data(ref_rest))
  np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["once", "per_microbatch"])
def test_a_donated_fsdp_step_takes_a_state_laid_out_otherwise_than_the_params(gather):
  """On an explicit mesh the state may be laid out replicated while the params are sharded
  (``tx.init`` of host params, then placed): the inner update comes out sharded like the
  gradients, and the donated step's branch in place keeps its carry's types (on jax 0.12 this
  was a while_loop carry-type TypeError). The update equals the big-batch step's."""
  mesh, k = mesh_1d(), 2
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(D * k * 2)
  expected, _ = plain_steps(xent_loss, optax.adam(1e-2), params, [batch])
  tx = ga.accumulate(optax.adam(1e-2), k)
  state = put(tx.init(params), mesh, P())
  step = ga.train_step(
    xent_loss, tx, mesh=mesh, param_specs=FSDP, gather_params=gather, donate=True
  )
  got, state, metrics = step(put(params, mesh, FSDP), state, put(batch, mesh, P("data")))
  assert bool(metrics["updated"])
  assert_trees_close(got, expected)
