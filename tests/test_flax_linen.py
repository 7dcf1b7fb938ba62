"""ga.linen_train_step and ga.accumulate with a Flax Linen CNN (BatchNorm, Dropout) and TrainState."""

import functools
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from helpers import assert_trees_close, mesh_1d

import gradaccum_jax as ga

K = 4  # micro-batches per window
B = 16  # batch size
LR = 1e-2


class CNN(nn.Module):
  """8x8x1 images -> 3 classes: two convs (BatchNorm optional), pooling, dropout, dense."""

  use_bn: bool = True
  momenta: tuple[float, float] = (0.9, 0.9)
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool):
    # No conv bias before a BatchNorm: its gradient would be ~0, and adam's update of ~0 noise.
    x = nn.Conv(4, (3, 3), use_bias=not self.use_bn)(x)
    if self.use_bn:
      x = nn.BatchNorm(use_running_average=not train, momentum=self.momenta[0], name="bn0")(x)
    x = nn.relu(x)
    x = nn.Conv(8, (3, 3), strides=2, use_bias=not self.use_bn)(x)
    if self.use_bn:
      x = nn.BatchNorm(use_running_average=not train, momentum=self.momenta[1], name="bn1")(x)
    x = nn.relu(x).mean(axis=(1, 2))
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    return nn.Dense(3)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any


def xent(logits, mb):
  return optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"]).mean()


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)  # numpy: no op-by-op compiles
  # A per-example offset, so the micro-batches have different means.
  x = rng.normal(size=(B, 8, 8, 1)) + 2.0 * rng.normal(size=(B, 1, 1, 1))
  return {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(rng.integers(0, 3, B), jnp.int32)}


@functools.cache
def initial_variables(model):
  """Random variables of model's structure, from numpy (compiling model.init costs ~5 s here)."""
  shapes = jax.eval_shape(
    lambda x: model.init(jax.random.key(0), x, train=False),
    jax.ShapeDtypeStruct((1, 8, 8, 1), jnp.float32),
  )
  rng = np.random.default_rng(1)

  def fill(path, s):
    name = path[-1].key
    if path[0].key == "batch_stats":  # running mean 0 and variance 1, as flax initializes them
      return jnp.full(s.shape, 1.0 if name == "var" else 0.0, s.dtype)
    fan_in = np.prod(s.shape[:-1]) if name == "kernel" else 1.0
    center = 1.0 if name == "scale" else 0.0
    return jnp.asarray(center + rng.normal(size=s.shape) / np.sqrt(fan_in), s.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def make_state(model):
  """A TrainState (with batch_stats when the model has them), tx = ga.accumulate(adam, k)."""
  variables = initial_variables(model)
  tx = ga.accumulate(optax.adam(LR), K)
  if "batch_stats" in variables:
    create = lambda v: TrainState.create(  # noqa: E731
      apply_fn=model.apply, params=v["params"], batch_stats=v["batch_stats"], tx=tx
    )
  else:
    create = lambda v: train_state.TrainState.create(  # noqa: E731
      apply_fn=model.apply, params=v["params"], tx=tx
    )
  return jax.jit(create)(variables)


@functools.partial(jax.jit, static_argnames=("model", "thread"))
def hand_window(model, params, batch_stats, batch, rngs=None, thread=True):
  """Reference: micro-batches 0..K-1 in turn, batch_stats threaded (or fixed), then adam once.

  ``rngs[i]`` is the dropout key of micro-batch ``i``.
  """
  stats, grad_sum, losses = batch_stats, None, []
  for i in range(K):
    mb = ga.microbatch(batch, i, K)

    def loss(p, s, mb=mb, i=i):
      out, mutated = model.apply(
        {"params": p, "batch_stats": s},
        mb["x"],
        train=True,
        mutable=["batch_stats"],
        rngs=None if rngs is None else {"dropout": rngs[i]},
      )
      return xent(out, mb), mutated["batch_stats"]

    (value, new_stats), g = jax.value_and_grad(loss, has_aux=True)(params, stats)
    stats = new_stats if thread else batch_stats
    grad_sum = g if grad_sum is None else jax.tree.map(jnp.add, grad_sum, g)
    losses.append(value)
  grads = jax.tree.map(lambda g: g / K, grad_sum)
  adam = optax.adam(LR)
  updates, _ = adam.update(grads, adam.init(params), params)
  return optax.apply_updates(params, updates), stats, jnp.mean(jnp.stack(losses))


@functools.partial(jax.jit, static_argnums=0)
def big_batch_adam_step(model, params, batch):
  """Reference: one adam step on the whole batch (a model without batch_stats)."""
  loss, grads = jax.value_and_grad(
    lambda p: xent(model.apply({"params": p}, batch["x"], train=True), batch)
  )(params)
  adam = optax.adam(LR)
  updates, _ = adam.update(grads, adam.init(params), params)
  return optax.apply_updates(params, updates), loss


@pytest.mark.slow
def test_streaming_trainstate_matches_one_big_batch_step(batch):
  """tx = ga.accumulate in TrainState.apply_gradients, once per micro-batch; no BatchNorm."""
  model = CNN(use_bn=False)
  state = make_state(model)
  params0 = state.params

  @jax.jit
  def micro_step(state, i):
    mb = ga.microbatch(batch, i, K)
    grads = jax.grad(lambda p: xent(model.apply({"params": p}, mb["x"], train=True), mb))(
      state.params
    )
    return state.apply_gradients(grads=grads)

  for i in range(K):
    state = micro_step(state, i)
    assert bool(ga.has_updated(state.opt_state)) == (i == K - 1)

  expected, loss = big_batch_adam_step(model, params0, batch)
  assert_trees_close(state.params, expected, rtol=1e-5)
  # TrainState.step counts micro-steps (apply_gradients calls); the accumulator counts windows.
  assert int(state.step) == K
  assert int(state.opt_state.count) == 1 and int(state.opt_state.micro_step) == 0

  # The fused step on a plain TrainState (no batch_stats) is the same window.
  fused, metrics = ga.linen_train_step(model, xent, train_kwargs={"train": True})(
    make_state(model), batch
  )
  assert_trees_close(fused.params, expected, rtol=1e-5)
  assert int(fused.step) == 1 and int(fused.opt_state.count) == 1
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)


@pytest.mark.slow
def test_sequential_matches_hand_loop_threading_batch_stats(batch):
  model = CNN()
  state = make_state(model)
  step = ga.linen_train_step(model, xent, batchnorm="sequential", train_kwargs={"train": True})
  new, metrics = step(state, batch)
  params, stats, loss = hand_window(model, state.params, state.batch_stats, batch)
  assert_trees_close(new.params, params, rtol=1e-5)
  assert_trees_close(new.batch_stats, stats, rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
  assert int(new.step) == 1 and int(new.opt_state.count) == 1 and bool(metrics["updated"])
  # A second window continues from the new state.
  newer, _ = step(new, batch)
  assert int(newer.step) == 2 and int(newer.opt_state.count) == 2


@functools.partial(jax.jit, static_argnums=0)
def first_bn_input(model, variables, x):
  """The input of bn0 (the output of Conv_0) for the rows x."""
  _, state = model.apply(
    variables, x, train=False, capture_intermediates=True, mutable=["intermediates"]
  )
  return state["intermediates"]["Conv_0"]["__call__"][0]


@pytest.mark.slow
def test_per_window_running_stats_are_the_pooled_window_statistics(batch):
  m = 0.9
  model = CNN(momenta=(m, m))
  state = make_state(model)
  step = ga.linen_train_step(model, xent, batchnorm="per_window", train_kwargs={"train": True})
  new, _ = step(state, batch)  # the momentum is read from the module's BatchNorms

  variables = {"params": state.params, "batch_stats": state.batch_stats}
  h = np.asarray(first_bn_input(model, variables, batch["x"]), np.float64)  # the WHOLE batch
  old = jax.tree.map(np.asarray, state.batch_stats["bn0"])
  expected_mean = m * old["mean"] + (1 - m) * h.mean(axis=(0, 1, 2))
  expected_var = m * old["var"] + (1 - m) * h.var(axis=(0, 1, 2))  # biased, as flax
  got = new.batch_stats["bn0"]
  np.testing.assert_allclose(got["mean"], expected_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got["var"], expected_var, rtol=1e-5, atol=1e-6)

  # The variance of the micro-batch means matters: they differ, and averaging the micro-batch
  # variances alone would give another running variance.
  hs = h.reshape(B // K, K, -1, h.shape[-1])  # rows i, i + K, ...: micro-batch i is hs[:, i]
  mus = hs.mean(axis=(0, 2))  # (K, channels)
  assert mus.std(axis=0).min() > 0.05, mus
  naive_var = m * old["var"] + (1 - m) * hs.var(axis=(0, 2)).mean(axis=0)
  assert not np.allclose(naive_var, got["var"], rtol=1e-3), (naive_var, got["var"])
  np.testing.assert_allclose(  # the gap is the variance of the micro-batch means
    got["var"] - naive_var, (1 - m) * mus.var(axis=0), rtol=1e-4, atol=1e-6
  )

  # The params move as in the hand loop where each micro-batch starts from the window's stats.
  params, _, _ = hand_window(model, state.params, state.batch_stats, batch, thread=False)
  assert_trees_close(new.params, params, rtol=1e-5)
  assert int(new.step) == 1


@pytest.mark.slow
def test_frozen_keeps_batch_stats_and_trains_params(batch):
  model = CNN()
  state = make_state(model)
  step = ga.linen_train_step(model, xent, batchnorm="frozen", train_kwargs={"train": True})
  new, _ = step(state, batch)
  for a, b in zip(
    jax.tree.leaves(new.batch_stats), jax.tree.leaves(state.batch_stats), strict=True
  ):
    np.testing.assert_array_equal(a, b)
  params, _, _ = hand_window(model, state.params, state.batch_stats, batch, thread=False)
  assert_trees_close(new.params, params, rtol=1e-5)
  assert all(
    not np.allclose(a, b)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params), strict=True)
  )


@pytest.mark.slow
def test_dropout_gets_one_key_per_microbatch(batch):
  model = CNN(dropout=0.5)
  state = make_state(model)
  step = ga.linen_train_step(model, xent, train_kwargs={"train": True})
  rng = jax.random.key(7)
  new, _ = step(state, batch, rng)

  # Micro-batch i, collection j of rng_collections: fold_in(fold_in(rng, i), j).
  keys = jnp.stack([jax.random.fold_in(jax.random.fold_in(rng, i), 0) for i in range(K)])
  params, stats, _ = hand_window(model, state.params, state.batch_stats, batch, keys)
  assert_trees_close(new.params, params, rtol=1e-5)
  assert_trees_close(new.batch_stats, stats, rtol=1e-5)
  # The keys differ between micro-batches: one shared key gives another result.
  shared = jnp.stack([keys[0]] * K)
  params_shared, _, _ = hand_window(model, state.params, state.batch_stats, batch, shared)
  assert not np.allclose(params_shared["Dense_0"]["kernel"], new.params["Dense_0"]["kernel"])

  again, _ = step(state, batch, rng)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(new), strict=True):
    np.testing.assert_array_equal(a, b)
  other, _ = step(state, batch, jax.random.key(8))
  assert not np.allclose(other.params["Dense_0"]["kernel"], new.params["Dense_0"]["kernel"])


@pytest.mark.parametrize("mode", ["per_window", "frozen"])
def test_module_without_batch_stats_needs_sequential(batch, mode):
  model = CNN(use_bn=False)
  step = ga.linen_train_step(model, xent, batchnorm=mode, train_kwargs={"train": True})
  with pytest.raises(
    ValueError, match=rf"batchnorm='{mode}'.*CNN has no 'batch_stats'.*'sequential'"
  ):
    step(make_state(model), batch)


def test_unknown_batchnorm_mode():
  with pytest.raises(ValueError, match=re.escape("Unknown batchnorm='ghost'; use one of")):
    ga.linen_train_step(CNN(), xent, batchnorm="ghost")


def test_per_window_needs_one_momentum(batch):
  model = CNN(momenta=(0.9, 0.8))
  step = ga.linen_train_step(model, xent, batchnorm="per_window", train_kwargs={"train": True})
  with pytest.raises(ValueError, match=r"different momenta \(bn0: 0.9, bn1: 0.8\)"):
    step(make_state(model), batch)


def test_per_window_needs_a_batchnorm_in_training_and_auto_needs_jit(batch):
  model = CNN()
  step = ga.linen_train_step(model, xent, batchnorm="per_window", train_kwargs={"train": False})
  with pytest.raises(ValueError, match=r"needs one momentum, but CNN has no BatchNorm in training"):
    step(make_state(model), batch)
  mesh = mesh_1d()
  with pytest.raises(ValueError, match=r"linen_train_step: gather_params='auto'.*needs jit=True"):
    ga.linen_train_step(
      model, xent, mesh=mesh, gather_params="auto", memory_budget_bytes=1, jit=False
    )


def test_tx_must_come_from_accumulate(batch):
  model = CNN()
  state = make_state(model).replace(tx=optax.adam(LR))
  step = ga.linen_train_step(model, xent, train_kwargs={"train": True})
  with pytest.raises(TypeError, match="train_state.tx must be made by ga.accumulate"):
    step(state, batch)


def test_plain_trainstate_for_a_model_with_batch_stats(batch):
  model = CNN()
  variables = initial_variables(model)
  state = train_state.TrainState.create(
    apply_fn=model.apply, params=variables["params"], tx=ga.accumulate(optax.adam(LR), K)
  )
  step = ga.linen_train_step(model, xent, train_kwargs={"train": True})
  with pytest.raises(ValueError, match="CNN has a 'batch_stats' collection, but the train_state"):
    step(state, batch)


def test_dropout_without_rng_says_to_pass_one(batch):
  model = CNN(dropout=0.5)
  step = ga.linen_train_step(model, xent, train_kwargs={"train": True})
  with pytest.raises(ValueError, match=re.escape("step(train_state, batch, rng=key)")):
    step(make_state(model), batch)


@pytest.mark.parametrize("bad", [1.0, -0.1, "0.9"])
def test_bad_momentum(bad):
  with pytest.raises(ValueError, match=re.escape(f"batchnorm_momentum={bad!r} must be a float")):
    ga.linen_train_step(CNN(), xent, batchnorm="per_window", batchnorm_momentum=bad)


def test_linen_mistakes_name_the_ga_argument_to_change():
  """A loss_fn(params, batch) of the old signature, and a module whose __call__ needs train=
  without train_kwargs, each raise a TypeError naming what ga passes and what to change."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      return nn.Dense(3)(x)

  model = Net()
  x = jnp.ones((8, 4))
  params = model.init(jax.random.key(0), x[:1], train=False)["params"]
  tx = ga.accumulate(optax.sgd(0.1), 2)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  batch = {"x": x, "y": jnp.zeros(8, jnp.int32)}

  def old_loss(p, mb):  # the MultiSteps-era signature: applies the model itself
    logits = model.apply({"params": p}, mb["x"], train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"]).mean()

  step = ga.linen_train_step(model, old_loss, train_kwargs={"train": True}, jit=False)
  with pytest.raises(TypeError, match=r"calls loss_fn\(outputs, microbatch\)"):
    step(state, batch)

  def loss(logits, mb):
    return optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"]).mean()

  with pytest.raises(TypeError, match=r"train_kwargs=\{'train': True\}"):
    ga.linen_train_step(model, loss, jit=False)(state, batch)


def test_the_default_keeps_the_old_state_and_donate_true_writes_over_it():
  """docs/models.md: undonated by default, the TrainState passed in (and the variables it was
  made from) can still be read after the call; donate=True deletes its arrays, and the new
  state is the same bit for bit."""
  rng = np.random.default_rng(2)
  net = nn.Dense(2)
  variables = {"params": {"kernel": rng.normal(size=(3, 2)), "bias": np.zeros(2)}}
  variables = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), variables)
  mb = {"x": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), "y": jnp.ones((8, 2))}
  news = {}
  for donate in (None, True):
    ts = train_state.TrainState.create(
      apply_fn=net.apply, params=variables["params"], tx=ga.accumulate(optax.sgd(0.1), 2)
    )
    kw = {} if donate is None else {"donate": True}
    step = ga.linen_train_step(net, lambda y, mb: jnp.mean((y - mb["y"]) ** 2), **kw)
    news[donate], _ = step(ts, mb)
    deleted = [x.is_deleted() for x in jax.tree.leaves(ts.params)]
    assert deleted == [bool(donate)] * 2, (donate, deleted)
  assert_trees_close(news[True].params, news[None].params, rtol=0, atol=0)
