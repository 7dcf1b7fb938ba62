"""FP8 under accumulation: a Linen model with Flax's fp8 dot products equals the big-batch step.

Flax keeps an fp8 layer's amax histories and scales in the ``"_overwrite_with_gradient"``
collection; their "gradient" is the new value, which ``TrainState.apply_gradients`` writes over
the old (Flax's fp8 docs train on ``jax.grad`` of the whole variables dict). Over a window the
whole batch's amax is the max over the micro-batches, and the output-gradient amax sees the
whole batch's cotangent: each micro-batch's loss is scaled by ``w_i / W`` before it is
differentiated. Every reference here is that plain big-batch step, written the Flax way.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from helpers import assert_trees_close, mesh_1d
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

OWG = "_overwrite_with_gradient"
B = 32


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, dot_general_cls=nn.Fp8DirectDotGeneralOp)(x))
    return nn.Dense(1, dot_general_cls=nn.Fp8DirectDotGeneralOp)(x)[:, 0]


NET = Net()
INNER = optax.sgd(0.1, momentum=0.9)


@functools.cache
def net_variables():
  """NET's variables: its params and the fp8 collection."""
  return NET.init(jax.random.key(0), jnp.ones((1, 5)))


def mse(y, mb):
  return jnp.mean((y - mb["y"]) ** 2)


def token_mse(y, mb):
  """A token mean: the batch's real rows (``mask`` 1) only."""
  return jnp.sum(mb["mask"] * (y - mb["y"]) ** 2) / jnp.maximum(jnp.sum(mb["mask"]), 1.0)


def tokens(mb):
  return jnp.sum(mb["mask"])


def batches(n=3, masked=False, k=4):
  """``n`` batches, each of a wider spread of inputs than the last (the amax history moves);
  ``masked``: uneven real rows per micro-batch, micro-batch 1 of ``k`` all padding."""
  rng = np.random.default_rng(0)
  out = []
  for i in range(n):
    b = {
      "x": jnp.asarray(rng.standard_normal((B, 5)) * (1 + i), jnp.float32),
      "y": jnp.asarray(rng.standard_normal(B), jnp.float32),
    }
    if masked:
      mask = (rng.random(B) < 0.6).astype(np.float32)
      mask[np.arange(B) % k == 1] = 0.0  # micro-batch 1 (rows 1, 1 + k, ...): all padding
      b["mask"] = jnp.asarray(mask)
    out.append(b)
  return out


def big_batch_step(loss):
  """The Flax fp8 docs' step: ``jax.grad`` of the whole variables, ``apply_gradients``."""

  def step(state, batch):
    grads = jax.grad(lambda v: loss(NET.apply(v, batch["x"]), batch))(state.params)
    return state.apply_gradients(grads=grads)

  return jax.jit(step)


def assert_window_equal(ours, ref, before, exact):
  """The params within float32 rounding of the update, the fp8 collection exactly the whole
  batch's (``exact``) or to float32 rounding."""
  moves = jax.tree.map(lambda r, p: jnp.max(jnp.abs(r - p)), ref["params"], before["params"])
  for a, r, m in zip(
    *(jax.tree.leaves(t) for t in (ours["params"], ref["params"], moves)), strict=True
  ):
    assert float(m) > 0
    np.testing.assert_allclose(a, r, rtol=0, atol=1e-5 * float(m))
  for a, r in zip(jax.tree.leaves(ours[OWG]), jax.tree.leaves(ref[OWG]), strict=True):
    if exact:
      np.testing.assert_array_equal(a, r)
    else:
      np.testing.assert_allclose(a, r, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_the_fp8_collection_moves():
  """The reference itself: each window writes a new amax into every history, the output
  gradients' included (so a wrong reduction of any of them shows)."""
  ref = train_state.TrainState.create(apply_fn=NET.apply, params=net_variables(), tx=INNER)
  ref = big_batch_step(mse)(ref, batches(1)[0])
  for path, leaf in jax.tree_util.tree_leaves_with_path(ref.params[OWG]):
    if "history" in jax.tree_util.keystr(path):
      assert float(leaf[0]) > 0, path


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [None, pytest.param("data", marks=pytest.mark.slow)])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_linen_train_step_equals_the_big_batch(k, mesh):
  ref = train_state.TrainState.create(apply_fn=NET.apply, params=net_variables(), tx=INNER)
  ours = train_state.TrainState.create(
    apply_fn=NET.apply, params=net_variables(), tx=ga.accumulate(INNER, k)
  )
  mesh = None if mesh is None else mesh_1d()
  step, big = ga.linen_train_step(NET, mse, inputs="x", mesh=mesh), big_batch_step(mse)
  for i, batch in enumerate(batches()):
    before = ref.params
    ref = big(ref, batch)
    ours, metrics = step(ours, batch)
    # Window 0 starts from the same params: every amax is the whole batch's, bit for bit.
    assert_window_equal(ours.params, ref.params, before, exact=i == 0)
    assert int(ours.opt_state.count) == i + 1 and bool(metrics["updated"])
    assert "aux" not in metrics


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [None, pytest.param("data", marks=pytest.mark.slow)])
def test_token_weighted_windows_equal_the_big_batch(mesh):
  """Uneven real rows and a micro-batch of padding only: its rows still pass the forward (their
  inputs count in the input amax, as in the whole batch), its cotangent is 0."""
  k = 4
  ref = train_state.TrainState.create(apply_fn=NET.apply, params=net_variables(), tx=INNER)
  ours = train_state.TrainState.create(
    apply_fn=NET.apply, params=net_variables(), tx=ga.accumulate(INNER, k)
  )
  mesh = None if mesh is None else mesh_1d()
  step = ga.linen_train_step(NET, token_mse, inputs="x", weight_fn=tokens, mesh=mesh)
  big = big_batch_step(token_mse)
  for batch in batches(2, masked=True, k=k):
    before = ref.params
    ref, (ours, _) = big(ref, batch), step(ours, batch)
    assert_window_equal(ours.params, ref.params, before, exact=False)


def variables_loss(variables, mb):
  return mse(NET.apply(variables, mb["x"]), mb)


@pytest.mark.slow
def test_train_step_on_the_variables_dict():
  """``ga.train_step`` with the variables as params and ``tx.init(variables["params"])``, as
  Flax's ``TrainState.create`` makes it."""
  tx = ga.accumulate(INNER, 4)
  ref = train_state.TrainState.create(apply_fn=NET.apply, params=net_variables(), tx=INNER)
  params, state = net_variables(), tx.init(net_variables()["params"])
  step = ga.train_step(variables_loss, tx)
  for i, batch in enumerate(batches(2)):
    before = ref.params
    ref = big_batch_step(mse)(ref, batch)
    params, state, _ = step(params, state, batch)
    assert_window_equal(params, ref.params, before, exact=i == 0)


@pytest.mark.slow
def test_value_and_grad_equals_jax_grad_of_the_variables():
  """The collection's "gradient" is the whole batch's new value, as ``jax.value_and_grad``
  gives it; the params' gradient is the whole batch's."""
  batch = batches(1)[0]
  loss, grads = ga.value_and_grad(variables_loss, 4)(net_variables(), batch)
  ref_loss, ref_grads = jax.value_and_grad(variables_loss)(net_variables(), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  assert_trees_close(grads["params"], ref_grads["params"], rtol=1e-5, atol=1e-7)
  for a, r in zip(jax.tree.leaves(grads[OWG]), jax.tree.leaves(ref_grads[OWG]), strict=True):
    np.testing.assert_array_equal(a, r)


@pytest.mark.slow
def test_a_short_window_equals_the_big_batch_of_its_real_micro_batches():
  k, m = 4, 2
  batch = batches(1)[0]
  real = jax.tree.map(lambda x: x[np.arange(B) % k < m], batch)  # rows of micro-batches 0, 1
  ref = train_state.TrainState.create(apply_fn=NET.apply, params=net_variables(), tx=INNER)
  ours = train_state.TrainState.create(
    apply_fn=NET.apply, params=net_variables(), tx=ga.accumulate(INNER, k)
  )
  ref = big_batch_step(mse)(ref, real)
  ours, _ = ga.linen_train_step(NET, mse, inputs="x")(ours, batch, num_real_microbatches=m)
  assert_window_equal(ours.params, ref.params, net_variables(), exact=True)


@pytest.mark.slow
def test_a_voided_window_keeps_the_collection():
  """A window of zero total weight changes neither the params nor the amax histories."""
  ours = train_state.TrainState.create(
    apply_fn=NET.apply, params=net_variables(), tx=ga.accumulate(INNER, 4)
  )
  batch = dict(batches(1)[0], mask=jnp.zeros(B))
  step = ga.linen_train_step(NET, token_mse, inputs="x", weight_fn=tokens)
  new, metrics = step(ours, batch)
  assert not bool(metrics["updated"]) and int(new.opt_state.num_skipped) == 1
  jax.tree.map(np.testing.assert_array_equal, new.params, net_variables())


@pytest.mark.slow
def test_the_collection_is_carried_not_added_in_place():
  """In-place accumulation adds every cotangent into the accumulator; the fp8 collection's is a
  new value, maxed over the window, so its step takes the carried path on every JAX (the same
  model without fp8 adds in place where JAX can, so the report can tell)."""
  batch, tx = batches(1)[0], ga.accumulate(INNER, 4)
  ours = train_state.TrainState.create(apply_fn=NET.apply, params=net_variables(), tx=tx)
  report = ga.inspect_step(ga.linen_train_step(NET, mse, inputs="x"), ours, batch)
  assert report.grads_in_place is False
  plain = nn.Sequential([nn.Dense(16), jnp.tanh, nn.Dense(1)])
  params = plain.init(jax.random.key(0), jnp.ones((1, 5)))["params"]
  state = train_state.TrainState.create(apply_fn=plain.apply, params=params, tx=tx)
  step = ga.linen_train_step(plain, lambda y, mb: mse(y[:, 0], mb), inputs="x")
  assert ga.inspect_step(step, state, batch).grads_in_place is (jax.__version_info__ >= (0, 11))


@pytest.mark.slow
def test_streaming_calls_refuse_the_collection():
  """``ga.micro_step`` and ``tx.update`` see one micro-batch: they cannot scale its cotangent by
  the window's total weight, so they refuse the collection before any work."""
  tx = ga.accumulate(INNER, 4)
  stream = ga.micro_step(variables_loss, tx)
  with pytest.raises(ValueError, match="micro_step: params holds Flax's '_overwrite_with_gra"):
    stream(net_variables(), stream.init(net_variables()), batches(1)[0])
  grads = jax.tree.map(jnp.zeros_like, net_variables())
  with pytest.raises(ValueError, match="tx.update: grads holds Flax's '_overwrite_with_gradi"):
    tx.update(grads, tx.init(net_variables()["params"]), net_variables())


def test_other_collections_beside_the_fp8_one_are_refused():
  tx = ga.accumulate(INNER, 4)
  params = {**net_variables(), "batch_stats": {"mean": jnp.zeros(3)}}
  with pytest.raises(
    ValueError,
    match="train_step: params holds Flax's '_overwrite_with_gradient' collection \\(fp8\\) and \\['batch_stats'\\]",
  ):
    ga.train_step(variables_loss, tx)(params, tx.init(net_variables()["params"]), batches(1)[0])


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["once", "per_microbatch"])
def test_fsdp_params_equal_the_big_batch(gather):
  """FSDP: the kernels sharded over the 8 devices (param_specs for the whole variables dict),
  gathered once or per micro-batch; the collection replicated, reduced by one pmax."""
  net = Net()
  variables = net.init(jax.random.key(0), jnp.ones((1, 8)))
  rng = np.random.default_rng(1)
  batch = {
    "x": jnp.asarray(rng.standard_normal((B, 8)), jnp.float32),
    "y": jnp.asarray(rng.standard_normal(B), jnp.float32),
  }
  specs = jax.tree.map(lambda x: P("data") if x.ndim == 2 else P(), variables)
  ref = train_state.TrainState.create(apply_fn=net.apply, params=variables, tx=INNER)
  grads = jax.grad(lambda v: mse(net.apply(v, batch["x"]), batch))(ref.params)
  ref = ref.apply_gradients(grads=grads)
  ours = train_state.TrainState.create(
    apply_fn=net.apply, params=variables, tx=ga.accumulate(INNER, 4)
  )
  step = ga.linen_train_step(
    net, mse, inputs="x", mesh=mesh_1d(), param_specs=specs,
    gather_params=gather,
  )  # fmt: skip
  ours, _ = step(ours, batch)
  assert ours.params["params"]["Dense_0"]["kernel"].sharding.spec[0] == "data"
  assert_window_equal(ours.params, ref.params, variables, exact=True)
