"""Flax Linen and NNX steps data-parallel on 8 CPU devices (BatchNorm, dropout): replicated, FSDP,
and tensor-parallel (TP, and FSDP + TP with both gather policies) params on a data x model mesh
(at the end, against the big-batch step), and TP with a model-sharded BatchNorm (last, against
the device-group reference below with 4 data devices).

The reference is a hand loop on one device over the (device, micro-batch) groups the mesh step
forms: device ``d`` holds rows ``d B/D .. (d+1) B/D - 1`` and splits them into ``K`` strided
micro-batches; each group is one ``jax.value_and_grad`` of the model, BatchNorm statistics are
threaded through a device's micro-batches and then averaged over the devices, the gradients are
averaged over all groups, and adam is applied once.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from helpers import assert_trees_close, mesh_1d, mesh_2d, put
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_sharding import big_batch_steps, collectives

import gradaccum_jax as ga

nnx = pytest.importorskip("flax.nnx")

D = 8  # tests/conftest.py gives jax 8 CPU devices
K = 2
B = D * K * 2  # two rows per device micro-batch
LR = 1e-2

pytestmark = pytest.mark.slow  # tensor-parallel meshes: compiles of 2-D meshes


def fsdp_specs(params):
  """Shard the leading dimension over "data" where it divides by D, else replicate."""
  return jax.tree.map(lambda x: P("data") if x.shape and x.shape[0] % D == 0 else P(), params)


def device_groups(batch, devices=D):
  """[(d, i, micro-batch i of device d)] in the mesh step's layout, ``devices`` data devices."""
  rows = len(batch["y"]) // devices
  out = []
  for d in range(devices):
    local = jax.tree.map(lambda x, d=d: x[d * rows : (d + 1) * rows], batch)
    out.extend((d, i, ga.microbatch(local, i, K)) for i in range(K))
  return out


def image_batch(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, 6, 6, 1)) + 2.0 * rng.normal(size=(B, 1, 1, 1))
  return {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(rng.integers(0, 3, B), jnp.int32)}


def xent(logits, mb):
  return optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"]).mean()


def first_update(params, grads, inner=None):
  """One step of ``inner`` (default adam) from its initial state."""
  inner = optax.adam(LR) if inner is None else inner
  updates, _ = inner.update(grads, inner.init(params), params)
  return optax.apply_updates(params, updates)


def mean_over(trees):
  return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


def hlo_collectives(compiled):
  found = collectives(compiled)
  in_loop = [c for c in found if c[2]]
  outside = sorted(op for op, _, inside, _ in found if not inside)
  return in_loop, outside


# --- Linen -----------------------------------------------------------------------------------


class LinenCNN(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(8, (3, 3), use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x).mean(axis=(1, 2))
    x = nn.Dropout(0.25, deterministic=not train)(x)
    return nn.Dense(3)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any


@functools.partial(jax.jit, static_argnums=0)
def linen_group(model, params, stats, mb, key):
  def loss(p):
    out, mutated = model.apply(
      {"params": p, "batch_stats": stats},
      mb["x"],
      train=True,
      mutable=["batch_stats"],
      rngs={"dropout": jax.random.fold_in(key, 0)},  # collection 0 of rng_collections
    )
    return xent(out, mb), mutated["batch_stats"]

  return jax.value_and_grad(loss, has_aux=True)(params)


def linen_reference(model, params, stats, batch, rng, devices=D, inner=None):
  grads, losses, final_stats, s = [], [], [], stats
  for d, i, mb in device_groups(batch, devices):
    s = stats if i == 0 else s
    key = jax.random.fold_in(jax.random.fold_in(rng, d), i)
    (loss, s), g = linen_group(model, params, s, mb, key)
    grads.append(g)
    losses.append(loss)
    if i == K - 1:
      final_stats.append(s)
  return first_update(params, mean_over(grads), inner), mean_over(final_stats), np.mean(losses)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_linen_step_on_a_mesh_matches_the_device_group_reference(layout):
  model, m, batch, rng = LinenCNN(), mesh_1d(), image_batch(), jax.random.key(7)
  variables = model.init(jax.random.key(0), batch["x"][:1], train=False)
  params, stats = variables["params"], variables["batch_stats"]
  specs = fsdp_specs(params) if layout == "fsdp" else None
  tx = ga.accumulate(optax.adam(LR), K)
  # The optimizer state is made from the params as they are placed (FSDP: sharded), as
  # train_step's docstring asks.
  state = TrainState.create(
    apply_fn=model.apply,
    params=put(params, m, P() if specs is None else specs),
    batch_stats=put(stats, m, P()),
    tx=tx,
  )
  step = ga.linen_train_step(model, xent, train_kwargs={"train": True}, mesh=m, param_specs=specs)
  sharded_batch = put(batch, m, P("data"))
  new_state, metrics = step(state, sharded_batch, rng)

  ref_params, ref_stats, ref_loss = linen_reference(model, params, stats, batch, rng)
  assert_trees_close(new_state.params, ref_params, rtol=1e-5, atol=1e-6)
  assert_trees_close(new_state.batch_stats, ref_stats, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
  assert int(new_state.step) == 1 and bool(metrics["updated"])
  if specs is not None:
    for x, s in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(specs), strict=True):
      assert x.sharding.is_equivalent_to(NamedSharding(m, s), x.ndim), (x.sharding, s)

  # The compiled program: nothing in the loop, the collectives of ga.train_step after it.
  in_loop, outside = hlo_collectives(step.lower(state, sharded_batch, rng).compile())
  assert in_loop == [], in_loop
  if specs is None:
    assert outside == ["all-reduce"], outside  # as ga.train_step: one, whatever k
  else:
    sharded = sum(s != P() for s in jax.tree.leaves(specs))
    assert outside.count("reduce-scatter") == sharded and outside.count("all-gather") >= sharded


# --- NNX -------------------------------------------------------------------------------------


class NnxCNN(nnx.Module):
  def __init__(self):
    rngs = nnx.Rngs(params=0, dropout=1)
    self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.bn(self.conv(x))).mean(axis=(1, 2))
    return self.head(self.drop(h))


def keys_as_data(tree):
  is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
  return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def nnx_xent(model, mb):
  return xent(model(mb["x"]), mb)


@nnx.jit
def nnx_group(model, mb):
  # Called eagerly on the model, so BatchNorm statistics and rng counters move as they would.
  return nnx.value_and_grad(nnx_xent)(model, mb)


def nnx_reference(model, batch, devices=D, inner=None):
  """Every device starts from a copy of the model and threads its state (BatchNorm, rng
  counters) through its own micro-batches; statistics are averaged and counters maxed over
  the devices."""
  grads, losses, finals = [], [], []
  for _, i, mb in device_groups(batch, devices):
    if i == 0:
      copy = nnx.clone(model)
    loss, g = nnx_group(copy, mb)
    grads.append(nnx.to_pure_dict(g))
    losses.append(loss)
    if i == K - 1:
      finals.append(nnx.to_pure_dict(nnx.state(copy, nnx.Not(nnx.Param))))

  def over_devices(*xs):
    if jnp.issubdtype(xs[0].dtype, jnp.inexact):
      return sum(xs) / len(xs)  # BatchNorm statistics: averaged
    if jnp.issubdtype(xs[0].dtype, jnp.integer):
      return functools.reduce(jnp.maximum, xs)  # rng counters: equal on every device
    return xs[0]  # rng keys: unchanged

  new_rest = jax.tree.map(over_devices, *finals)
  new_params = first_update(nnx.to_pure_dict(nnx.state(model, nnx.Param)), mean_over(grads), inner)
  return new_params, new_rest, np.mean(losses)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_nnx_step_on_a_mesh_matches_the_device_group_reference(layout):
  m, batch = mesh_1d(), image_batch(1)
  ref_params, ref_rest, ref_loss = nnx_reference(NnxCNN(), batch)

  model = NnxCNN()
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  specs = fsdp_specs(params) if layout == "fsdp" else None
  optimizer = nnx.Optimizer(model, ga.accumulate(optax.adam(LR), K), wrt=nnx.Param)
  step = ga.nnx_train_step(nnx_xent, mesh=m, param_specs=specs)
  metrics = step(model, optimizer, put(batch, m, P("data")))

  assert_trees_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)), ref_params, rtol=1e-5)
  new_rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
  assert_trees_close(keys_as_data(new_rest), keys_as_data(ref_rest), rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
  assert int(optimizer.opt_state.count[...]) == 1


@pytest.mark.slow
def test_nnx_step_on_a_mesh_has_no_collective_in_the_loop():
  m, batch = mesh_1d(), put(image_batch(2), mesh_1d(), P("data"))
  model = NnxCNN()
  optimizer = nnx.Optimizer(model, ga.accumulate(optax.adam(LR), K), wrt=nnx.Param)
  step = ga.nnx_train_step(nnx_xent, mesh=m)
  in_loop, outside = hlo_collectives(step.lower(model, optimizer, batch).compile())
  assert in_loop == [], in_loop
  assert outside.count("all-reduce") >= 1 and "all-gather" not in outside, outside


# --- tensor parallelism: a Dense kernel sharded over "model" on its output dim, the next on its
# input dim, on a 4 x 2 ("data", "model") mesh, against the big-batch step on one device; then
# FSDP + TP, the other dim of each kernel (and the out bias) sharded over "data" too -------------

# inputs, hidden units (split over "model"), classes; the inputs and classes divide by 4 ("data")
TP_SIZES = (8, 16, 4)
TP_K = 2
TP_ROWS = 4 * TP_K * 2  # two rows per data device per micro-batch
# sgd, not adam: adam's update is blind to a gradient off by a constant factor (say, summed
# over the model axis too); a big step makes a gradient error show in the params.
TP_INNER = optax.sgd(0.5, momentum=0.9)
# The Linen params and the NNX model's nnx.to_pure_dict have this structure.
TP_SPECS = {
  "hidden": {"kernel": P(None, "model"), "bias": P("model")},
  "out": {"kernel": P("model", None), "bias": P()},
}
FSDP_TP_SPECS = {
  "hidden": {"kernel": P("data", "model"), "bias": P("model")},
  "out": {"kernel": P("model", "data"), "bias": P("data")},
}
# layout: (param specs, gather_params).
TP_LAYOUTS = {
  "tp": (TP_SPECS, "once"),
  "fsdp_tp_once": (FSDP_TP_SPECS, "once"),
  "fsdp_tp_per_microbatch": (FSDP_TP_SPECS, "per_microbatch"),
}


def tp_params(batchnorm=False):
  """The params of both models, from numpy (no init programs to compile); with ``batchnorm``
  also the BatchNorm's scale and bias (named "bn") and its running statistics, returned as
  ``(params, batch_stats)``."""
  rng = np.random.default_rng(4)
  params = {
    name: {
      "kernel": (rng.standard_normal((m, n)) / np.sqrt(m)).astype(np.float32),
      "bias": (0.1 * rng.standard_normal(n)).astype(np.float32),
    }
    for name, m, n in (("hidden", *TP_SIZES[:2]), ("out", *TP_SIZES[1:]))
  }
  if not batchnorm:
    return params
  n = TP_SIZES[1]
  near_one = lambda: (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
  params["bn"] = {"scale": near_one(), "bias": (0.1 * rng.standard_normal(n)).astype(np.float32)}
  stats = {"bn": {"mean": (0.1 * rng.standard_normal(n)).astype(np.float32), "var": near_one()}}
  return params, stats


def tp_batches(rows=TP_ROWS):
  """Two windows of ``rows`` rows."""
  rng = np.random.default_rng(5)
  return [
    {
      "x": rng.standard_normal((rows, TP_SIZES[0])).astype(np.float32),
      "y": rng.integers(0, TP_SIZES[-1], rows).astype(np.int32),
    }
    for _ in range(2)
  ]


def tp_plain_loss(p, batch):
  h = jnp.tanh(batch["x"] @ p["hidden"]["kernel"] + p["hidden"]["bias"])
  return xent(h @ p["out"]["kernel"] + p["out"]["bias"], batch)


@functools.cache
def tp_reference():
  """The big-batch step (jax.value_and_grad of the mean loss over the whole window, on one
  device, then TP_INNER) on each window, the model written in plain jax.numpy: the params
  after both, and the last window's loss and gradient norm."""

  params, value, grads = big_batch_steps(tp_plain_loss, TP_INNER, tp_params(), tp_batches())
  return params, value, optax.tree.norm(grads)


def tp_out_sharding(x, kernel):
  """The sharding of ``x @ kernel`` on a mesh with explicit axes: rows as ``x``'s, columns as
  the kernel's. A product that contracts a model-sharded dimension must name it there, as in
  a plain jax.jit step; None (GSPMD or one device decides) on an auto mesh or off a mesh."""
  rows, cols = jax.typeof(x).sharding, jax.typeof(kernel).sharding
  if AxisType.Explicit not in rows.mesh.axis_types:
    return None
  return NamedSharding(rows.mesh, P(*rows.spec[:-1], cols.spec[-1]))


def explicit_dot_general(lhs, rhs, dimension_numbers, precision=None, **kwargs):
  """lax.dot_general with tp_out_sharding, for nn.Dense(dot_general=...): Linen's Dense takes
  no out_sharding (nnx.Linear does, at the call)."""
  kwargs["out_sharding"] = kwargs.get("out_sharding") or tp_out_sharding(lhs, rhs)
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **kwargs)


class LinenTP(nn.Module):
  """With ``batchnorm``, a BatchNorm ("bn") on the hidden units: over "model" like them."""

  batchnorm: bool = False

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.Dense(TP_SIZES[1], dot_general=explicit_dot_general, name="hidden")(x)
    if self.batchnorm:
      h = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(h)
    return nn.Dense(TP_SIZES[2], dot_general=explicit_dot_general, name="out")(jnp.tanh(h))


class NnxTP(nnx.Module):
  def __init__(self, batchnorm=False):
    rngs = nnx.Rngs(params=0)
    self.hidden = nnx.Linear(TP_SIZES[0], TP_SIZES[1], rngs=rngs)
    self.bn = nnx.BatchNorm(TP_SIZES[1], momentum=0.9, rngs=rngs) if batchnorm else None
    self.out = nnx.Linear(TP_SIZES[1], TP_SIZES[2], rngs=rngs)

  def __call__(self, x):
    h = self.hidden(x, out_sharding=tp_out_sharding(x, self.hidden.kernel[...]))
    h = jnp.tanh(h if self.bn is None else self.bn(h))
    return self.out(h, out_sharding=tp_out_sharding(h, self.out.kernel[...]))


def nnx_tp_model(values, batchnorm=False):
  """An NnxTP holding ``values`` (its nnx.to_pure_dict, placed or not): no init to compile."""
  model = nnx.eval_shape(functools.partial(NnxTP, batchnorm))
  state = nnx.state(model)
  nnx.replace_by_pure_dict(state, values)
  nnx.update(model, state)
  return model


def assert_tp_step(params, momentum, metrics, m, specs):
  """Two windows equal two big-batch steps, and the params and their momentum keep specs."""
  expected, expected_loss, expected_norm = tp_reference()
  assert bool(metrics["updated"])
  assert_trees_close(params, expected)
  np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], expected_norm, rtol=1e-5)
  for tree in (params, momentum):
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs), strict=True):
      assert leaf.sharding.is_equivalent_to(NamedSharding(m, spec), leaf.ndim), (leaf, spec)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_linen_step_with_tensor_parallel_params_matches_the_big_batch_step(layout, kind):
  """On an explicit mesh nn.Dense names the sharding of its product (explicit_dot_general)."""
  (specs, gather), m, model = TP_LAYOUTS[layout], mesh_2d(kind), LinenTP()
  params = put(tp_params(), m, specs)
  tx = ga.accumulate(TP_INNER, TP_K)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  step = ga.linen_train_step(model, xent, mesh=m, param_specs=specs, gather_params=gather)
  for batch in tp_batches():
    state, metrics = step(state, put(batch, m, P("data")))
  assert int(state.step) == 2
  assert_tp_step(state.params, state.opt_state.inner_state[0].trace, metrics, m, specs)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_nnx_step_with_tensor_parallel_params_matches_the_big_batch_step(layout, kind):
  """On an explicit mesh nnx.Linear is called with out_sharding= (tp_out_sharding)."""
  (specs, gather), m = TP_LAYOUTS[layout], mesh_2d(kind)
  model = nnx_tp_model(put(tp_params(), m, specs))
  optimizer = nnx.Optimizer(model, ga.accumulate(TP_INNER, TP_K), wrt=nnx.Param)
  step = ga.nnx_train_step(nnx_xent, mesh=m, param_specs=specs, gather_params=gather)
  for batch in tp_batches():
    metrics = step(model, optimizer, put(batch, m, P("data")))
  assert int(optimizer.opt_state.count[...]) == 2
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  momentum = nnx.to_pure_dict(nnx.state(optimizer.opt_state.inner_state[0].trace))
  assert_tp_step(params, momentum, metrics, m, specs)


def tp_loss(p, mb):
  """The Linen/NNX TP models' loss in plain jax (explicit_dot_general names the products)."""

  def dot(x, kernel):
    return explicit_dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))

  h = jnp.tanh(dot(mb["x"], p["hidden"]["kernel"]) + p["hidden"]["bias"])
  return xent(dot(h, p["out"]["kernel"]) + p["out"]["bias"], mb)


def tp_report(entry, layout, kind):
  """``ga.inspect_step`` of ``entry``'s step on the TP mesh of ``kind``."""
  (specs, gather), m = TP_LAYOUTS[layout], mesh_2d(kind)
  params, tx = put(tp_params(), m, specs), ga.accumulate(TP_INNER, TP_K)
  batch = put(tp_batches()[0], m, P("data"))
  if entry == "linen":
    model = LinenTP()
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    step = ga.linen_train_step(model, xent, mesh=m, param_specs=specs, gather_params=gather)
    return ga.inspect_step(step, state, batch)
  step = ga.micro_step(tp_loss, tx, mesh=m, param_specs=specs)
  return ga.inspect_step(step, params, step.init(params), ga.microbatch(batch, 0, TP_K))


@pytest.mark.parametrize(
  "entry,layout", [("linen", layout) for layout in TP_LAYOUTS] + [("micro_step", "tp")]
)
def test_an_explicit_tensor_parallel_mesh_communicates_as_an_auto_one(entry, layout):
  """Before, on jax 0.10 an explicit mesh gathered every model-sharded param into the
  shard_map and every gradient out of it over "model": 9 all-gathers after the loop per
  window (3x the sharded params' bytes) for the "tp" layout, none on an auto mesh or jax 0.12.
  Now the all-gathers in and after the loop are an auto mesh's (an explicit FSDP + TP mesh
  reduces with a psum where an auto one reduce-scatters: docs/architecture.md); for "tp"
  every collective is, and none is an all-gather after the loop."""
  auto, explicit = (tp_report(entry, layout, kind) for kind in ("auto", "explicit"))
  for counts in ("in_loop", "after_loop", "in_loop_bytes", "after_loop_bytes"):
    got, want = getattr(explicit, counts), getattr(auto, counts)
    assert got.get("all-gather", 0) == want.get("all-gather", 0), (str(explicit), str(auto))
    if layout == "tp":
      assert got == want, (str(explicit), str(auto))
  if layout == "tp":
    explicit.check(max_in_loop=None, max_after_loop={"all-gather": 0, "reduce-scatter": 0})


def named_loss(p, mb):
  """tp_loss with the model axis named in out_sharding=, as a plain jit step on the mesh needs."""
  h = jnp.matmul(mb["x"], p["hidden"]["kernel"], out_sharding=P(None, "model"))
  h = jnp.tanh(h + p["hidden"]["bias"])
  logits = jnp.matmul(h, p["out"]["kernel"], out_sharding=P())
  return xent(logits + p["out"]["bias"], mb)


def test_a_loss_that_names_the_model_axis_runs_on_an_explicit_mesh():
  """On jax 0.10 such a loss cannot run with the model axes Auto: it keeps them Explicit (and
  the all-gathers). The window equals the big-batch step of the same loss on one device."""
  m, specs = mesh_2d("explicit"), TP_SPECS
  params, batch = put(tp_params(), m, specs), tp_batches()[0]
  tx = ga.accumulate(TP_INNER, TP_K)
  step = ga.train_step(named_loss, tx, mesh=m, param_specs=specs)
  new, _, metrics = step(params, tx.init(params), put(batch, m, P("data")))
  expected, loss, _ = big_batch_steps(tp_plain_loss, TP_INNER, tp_params(), [batch])
  assert_trees_close(new, expected)
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)


# --- tensor parallelism with BatchNorm: "bn" after the hidden layer, its scale, bias and running
# statistics sharded over "model" like the hidden units, against the device-group reference on
# one device (4 data devices, each threading the statistics through its micro-batches) ---------

TP_BN_SPECS = {**TP_SPECS, "bn": {"scale": P("model"), "bias": P("model")}}
TP_BN_STATS_SPECS = {"bn": {"mean": P("model"), "var": P("model")}}
TP_DATA = 4  # data devices of mesh_2d
TP_BN_ROWS = TP_DATA * K * 4  # four rows per data device per micro-batch: BatchNorm sees 4


def assert_tp_batchnorm_step(params, stats, loss, reference, m):
  """The device-group reference's params, statistics and loss; the specs kept."""
  ref_params, ref_stats, ref_loss = reference
  assert_trees_close(params, ref_params, rtol=1e-5)
  assert_trees_close(stats, ref_stats, rtol=1e-5)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for tree, specs in ((params, TP_BN_SPECS), (stats, TP_BN_STATS_SPECS)):
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs), strict=True):
      assert leaf.sharding.is_equivalent_to(NamedSharding(m, spec), leaf.ndim), (leaf, spec)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_linen_step_with_tensor_parallel_batchnorm_matches_the_device_group_reference(kind):
  m, model = mesh_2d(kind), LinenTP(batchnorm=True)
  (params, stats), batch = tp_params(batchnorm=True), tp_batches(TP_BN_ROWS)[0]
  state = TrainState.create(
    apply_fn=model.apply,
    params=put(params, m, TP_BN_SPECS),
    batch_stats=put(stats, m, TP_BN_STATS_SPECS),
    tx=ga.accumulate(TP_INNER, K),
  )
  step = ga.linen_train_step(model, xent, mesh=m, param_specs=TP_BN_SPECS)
  state, metrics = step(state, put(batch, m, P("data")))
  # The model draws no keys: the reference's are unused.
  reference = linen_reference(
    model, params, stats, batch, jax.random.key(0), devices=TP_DATA, inner=TP_INNER
  )
  assert int(state.step) == 1 and bool(metrics["updated"])
  assert_tp_batchnorm_step(state.params, state.batch_stats, metrics["loss"], reference, m)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_nnx_step_with_tensor_parallel_batchnorm_matches_the_device_group_reference(kind):
  m = mesh_2d(kind)
  (params, stats), batch = tp_params(batchnorm=True), tp_batches(TP_BN_ROWS)[0]
  values = {**params, "bn": {**params["bn"], **stats["bn"]}}  # nnx.BatchNorm holds both
  reference = nnx_reference(nnx_tp_model(values, True), batch, devices=TP_DATA, inner=TP_INNER)

  model = nnx_tp_model(put(values, m, {**TP_BN_SPECS, "bn": P("model")}), True)
  optimizer = nnx.Optimizer(model, ga.accumulate(TP_INNER, K), wrt=nnx.Param)
  step = ga.nnx_train_step(nnx_xent, mesh=m, param_specs=TP_BN_SPECS)
  metrics = step(model, optimizer, put(batch, m, P("data")))
  assert int(optimizer.opt_state.count[...]) == 1 and bool(metrics["updated"])
  new_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  new_stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
  assert_tp_batchnorm_step(new_params, new_stats, metrics["loss"], reference, m)
