"""ga.nnx_train_step: Flax NNX modules with nnx.Optimizer, against independent references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, make_batch, mesh_1d

import gradaccum_jax as ga

nnx = pytest.importorskip("flax.nnx")

K = 4
B = 16


class MLP(nnx.Module):
  def __init__(self, seed=0, *, bn=False, dropout=0.0, momentum=0.9):
    rngs = nnx.Rngs(params=seed, dropout=seed + 100)
    self.l1 = nnx.Linear(6, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, momentum=momentum, rngs=rngs) if bn else None
    self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None
    self.l2 = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    h = self.l1(x)
    if self.bn is not None:
      h = self.bn(h)
    h = jnp.tanh(h)
    if self.drop is not None:
      h = self.drop(h)
    return self.l2(h)


class CNN(nnx.Module):
  """Conv -> BatchNorm over (N, H, W) -> dropout -> mean pool -> Linear."""

  def __init__(self, seed=0):
    rngs = nnx.Rngs(params=seed, dropout=seed + 100)
    self.conv = nnx.Conv(1, 3, kernel_size=(3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(3, momentum=0.8, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.head = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    h = self.drop(jax.nn.relu(self.bn(self.conv(x))))
    return self.head(h.mean(axis=(1, 2)))


def xent(model, batch):
  logp = jax.nn.log_softmax(model(batch["x"]))
  return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def xent_aux(model, batch):
  logits = model(batch["x"])
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1)), jnp.mean(logits)


def params_of(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def rng_count(model):
  return int(model.drop.rngs.count[...])


def image_batch(key, n=B):
  xk, yk = jax.random.split(key)
  return {
    "x": jax.random.normal(xk, (n, 5, 5, 1)),
    "y": jax.random.randint(yk, (n,), 0, 3),
  }


@nnx.jit
def _micro_grad(model, batch, i):
  # nnx.grad calls the model, so its BatchNorm statistics and rng counters move as in eager code.
  return nnx.value_and_grad(xent_aux, has_aux=True)(model, ga.microbatch(batch, i, K))


@functools.partial(jax.jit, static_argnums=0)
def optax_step(inner, params, opt_state, grads):
  """One plain optax step (jitted only to spare the eager dispatch of every small op)."""
  updates, opt_state = inner.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def hand_loop(model, batch, inner, *, same_rng=False):
  """One window by hand: the model called on micro-batch 0, 1, ... in turn, grads averaged,
  then one plain optax step. ``same_rng`` rewinds the rng state before every micro-batch."""
  rng0 = nnx.clone(nnx.state(model, nnx.RngState))
  total, auxes = None, []
  for i in range(K):
    if same_rng:
      nnx.update(model, nnx.clone(rng0))
    (_, aux), grads = _micro_grad(model, batch, jnp.asarray(i))
    grads = nnx.to_pure_dict(grads)
    total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    auxes.append(aux)
  mean = jax.tree.map(lambda g: g / K, total)
  params = params_of(model)
  nnx.update(model, optax_step(inner, params, inner.init(params), mean)[0])
  return float(np.mean(auxes))


def fused(model, batch, inner, **kw):
  optimizer = nnx.Optimizer(model, ga.accumulate(inner, K), wrt=nnx.Param)
  metrics = ga.nnx_train_step(xent, **kw)(model, optimizer, batch)
  return optimizer, metrics


@pytest.mark.slow
def test_plain_model_matches_big_batch_adam_and_streaming():
  inner = optax.adam(1e-2)
  batches = [make_batch(jax.random.key(s), B) for s in (1, 2)]

  # Reference: jax.value_and_grad of the whole batch and optax.adam, on the split model.
  graphdef, params, rest = nnx.split(MLP(), nnx.Param, ...)
  params = nnx.as_pure(params)

  @jax.jit
  def big_value_and_grad(p, batch):
    return jax.value_and_grad(lambda p: xent(nnx.merge(graphdef, p, rest), batch))(p)

  ref_state, ref_losses = inner.init(params), []
  for batch in batches:
    loss, grads = big_value_and_grad(params, batch)
    params, ref_state = optax_step(inner, params, ref_state, grads)
    ref_losses.append(float(loss))
  ref_params = nnx.to_pure_dict(params)

  model = MLP()
  optimizer = nnx.Optimizer(model, ga.accumulate(inner, K), wrt=nnx.Param)
  step = ga.nnx_train_step(xent)
  for batch, ref_loss in zip(batches, ref_losses, strict=True):
    metrics = step(model, optimizer, batch)
    np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=1e-5)
    assert bool(metrics["updated"])
  assert_trees_close(params_of(model), ref_params, rtol=1e-5)
  # Both counters count windows in the fused step.
  assert int(optimizer.step[...]) == 2 and int(optimizer.opt_state.count[...]) == 2

  # Streaming: optimizer.update(model, grads) once per micro-batch.
  model = MLP()
  optimizer = nnx.Optimizer(model, ga.accumulate(inner, K), wrt=nnx.Param)

  @nnx.jit
  def micro_step(model, optimizer, mb):
    optimizer.update(model, nnx.grad(xent)(model, mb))

  for batch in batches:
    for i in range(K):
      micro_step(model, optimizer, ga.microbatch(batch, i, K))
  assert_trees_close(params_of(model), ref_params, rtol=1e-5)
  # nnx's step counts optimizer.update calls (micro-batches); opt_state.count counts windows.
  assert int(optimizer.step[...]) == 2 * K and int(optimizer.opt_state.count[...]) == 2


@pytest.mark.slow
def test_batchnorm_sequential_matches_hand_loop():
  inner = optax.adam(1e-2)
  batch = make_batch(jax.random.key(3), B)
  ref = MLP(bn=True)
  ref_aux = hand_loop(ref, batch, inner)

  model = MLP(bn=True)
  optimizer = nnx.Optimizer(model, ga.accumulate(inner, K), wrt=nnx.Param)
  metrics = ga.nnx_train_step(xent_aux, has_aux=True)(model, optimizer, batch)
  assert_trees_close(params_of(model), params_of(ref), rtol=1e-5)
  # k running-average updates, one per micro-batch, in order.
  assert_trees_close(
    nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)),
    nnx.to_pure_dict(nnx.state(ref, nnx.BatchStat)),
    rtol=1e-5,
  )
  assert not np.allclose(model.bn.mean[...], 0.0)
  np.testing.assert_allclose(float(metrics["aux"]), ref_aux, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_batchnorm_per_window_uses_whole_batch_statistics():
  inner = optax.adam(1e-2)
  batch = image_batch(jax.random.key(4))
  model = CNN()
  old_mean = jnp.array([0.3, -0.2, 0.1])
  old_var = jnp.array([0.5, 2.0, 1.5])
  model.bn.mean[...] = old_mean
  model.bn.var[...] = old_var
  ref = nnx.clone(model)
  h = ref.conv(batch["x"])  # the BatchNorm input, with the params before the step
  m = 0.8
  want_mean = m * old_mean + (1 - m) * h.mean(axis=(0, 1, 2))
  want_var = m * old_var + (1 - m) * h.var(axis=(0, 1, 2))  # biased
  count0 = rng_count(model)
  hand_loop(ref, batch, inner)

  optimizer, _ = fused(model, batch, inner, batchnorm="per_window")
  np.testing.assert_allclose(model.bn.mean[...], want_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(model.bn.var[...], want_var, rtol=1e-5, atol=1e-6)
  # Training-mode normalization uses each micro-batch's statistics: the same gradients as
  # the hand loop, dropout included (the rng counter is threaded, not reset).
  assert_trees_close(params_of(model), params_of(ref), rtol=1e-5)
  assert rng_count(model) == rng_count(ref) == count0 + K


@pytest.mark.slow
def test_batchnorm_frozen_keeps_statistics_and_threads_rngs():
  inner = optax.adam(1e-2)
  batch = make_batch(jax.random.key(5), B)
  model = MLP(bn=True, dropout=0.3)
  # Copied: nnx.clone shares the arrays, which the step (donated by default) deletes.
  before = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))
  ref = nnx.clone(model)
  hand_loop(ref, batch, inner)
  count0 = rng_count(model)

  fused(model, batch, inner, batchnorm="frozen")
  after = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(a, b)
  assert_trees_close(params_of(model), params_of(ref), rtol=1e-5)
  assert rng_count(model) == count0 + K


@pytest.mark.slow
def test_dropout_gets_a_fresh_mask_per_microbatch():
  inner = optax.sgd(0.5)
  batch = make_batch(jax.random.key(6), B)
  model = MLP(dropout=0.5)
  count0 = rng_count(model)
  # Equal models of their own (nnx.clone shares arrays, which the donated step deletes).
  twin, same_key, ref = (MLP(dropout=0.5) for _ in range(3))

  hand_loop(ref, batch, inner)  # micro-batch i draws with the counter left by i - 1
  hand_loop(same_key, batch, inner, same_rng=True)  # every micro-batch draws the same mask
  tx, step = ga.accumulate(inner, K), ga.nnx_train_step(xent)  # shared: one compilation
  for m in (model, twin):
    step(m, nnx.Optimizer(m, tx, wrt=nnx.Param), batch)

  assert_trees_close(params_of(model), params_of(ref), rtol=1e-5)
  assert_trees_close(params_of(twin), params_of(model), rtol=0, atol=0)
  diff = max(
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(
      jax.tree.leaves(params_of(model)), jax.tree.leaves(params_of(same_key)), strict=True
    )
  )
  assert diff > 1e-3, diff
  assert rng_count(model) == rng_count(twin) == count0 + K
  assert rng_count(same_key) == count0 + 1


def test_errors_name_the_problem():
  batch = make_batch(jax.random.key(7), B)
  with pytest.raises(ValueError, match="Unknown batchnorm='window'"):
    ga.nnx_train_step(xent, batchnorm="window")

  model = MLP()
  optimizer = nnx.Optimizer(model, ga.accumulate(optax.sgd(0.1), K), wrt=nnx.Param)
  with pytest.raises(ValueError, match="needs nnx.BatchNorm layers, but the MLP has none"):
    ga.nnx_train_step(xent, batchnorm="per_window")(model, optimizer, batch)
  with pytest.raises(ValueError, match="batchnorm='frozen' but the MLP has no BatchNorm"):
    ga.nnx_train_step(xent, batchnorm="frozen")(model, optimizer, batch)
  with pytest.raises(TypeError, match="pass has_aux=True"):
    ga.nnx_train_step(xent_aux)(model, optimizer, batch)
  with pytest.raises(TypeError, match=r"has_aux=True, loss_fn\(model, microbatch\) must return"):
    ga.nnx_train_step(xent, has_aux=True)(model, optimizer, batch)
  with pytest.raises(ValueError, match="B=15 is not divisible by num_microbatches k=4"):
    ga.nnx_train_step(xent)(model, optimizer, make_batch(jax.random.key(7), 15))
  assert int(optimizer.step[...]) == 0

  plain = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  with pytest.raises(TypeError, match=r"ga.accumulate\(inner, num_microbatches\)"):
    ga.nnx_train_step(xent)(model, plain, batch)

  two = MLP(bn=True)
  two.bn2 = nnx.BatchNorm(3, momentum=0.5, rngs=nnx.Rngs(0))
  opt2 = nnx.Optimizer(two, ga.accumulate(optax.sgd(0.1), K), wrt=nnx.Param)
  with pytest.raises(ValueError, match=r"different ones \(bn: 0.9, bn2: 0.5\)"):
    ga.nnx_train_step(xent, batchnorm="per_window")(two, opt2, batch)


@pytest.mark.slow
def test_jit_false_gives_the_step_to_trace_in_your_own_nnx_jit():
  """jit=False, as in train_step and linen_train_step: the step comes unjitted (no ``lower``),
  and under the caller's nnx.jit it trains the model as the jitted step does."""
  batch = make_batch(jax.random.key(3), B)
  results = []
  for jit in (True, False):
    model = MLP(bn=True)
    optimizer = nnx.Optimizer(model, ga.accumulate(optax.adam(1e-2), K), wrt=nnx.Param)
    step = ga.nnx_train_step(xent, batchnorm="per_window", jit=jit)
    assert hasattr(step, "lower") == jit
    metrics = (step if jit else nnx.jit(step))(model, optimizer, batch)
    stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    results.append((params_of(model), stats, float(metrics["loss"]), int(optimizer.step[...])))
  assert_trees_close(results[1][:2], results[0][:2], rtol=1e-6, atol=1e-7)
  assert results[1][2:] == pytest.approx(results[0][2:], rel=1e-6)
  assert results[1][3] == 1
  mesh = mesh_1d()
  with pytest.raises(ValueError, match=r"nnx_train_step: gather_params='auto'.*needs jit=True"):
    ga.nnx_train_step(xent, mesh=mesh, gather_params="auto", memory_budget_bytes=1, jit=False)


@pytest.mark.slow
def test_donated_step_voids_a_bad_window_in_place_and_matches_the_undonated_step():
  """donate=True updates params and optimizer state in place (a branch of a lax.cond): a
  window with a NaN leaves both exactly as they were, and good windows equal donate=False."""
  inner = optax.adam(1e-2)
  bad = make_batch(jax.random.key(1), B)
  bad["x"] = bad["x"].at[0, 0].set(jnp.nan)
  good = make_batch(jax.random.key(2), B)
  results = []
  for donate in (False, True):
    model = MLP()
    optimizer = nnx.Optimizer(model, ga.accumulate(inner, K), wrt=nnx.Param)
    step = ga.nnx_train_step(xent, donate=donate)
    before = params_of(model), nnx.to_pure_dict(nnx.state(optimizer.opt_state))
    before = jax.tree.map(jnp.copy, before)  # the arrays themselves are donated
    metrics = step(model, optimizer, bad)
    assert not bool(metrics["updated"]) and int(optimizer.opt_state.num_skipped[...]) == 1
    assert_trees_close(params_of(model), before[0], rtol=0, atol=0)
    inner_after = nnx.to_pure_dict(nnx.state(optimizer.opt_state))["inner_state"]
    assert_trees_close(inner_after, before[1]["inner_state"], rtol=0, atol=0)
    assert bool(step(model, optimizer, good)["updated"])
    results.append(params_of(model))
  assert_trees_close(results[1], results[0], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_the_default_step_is_the_donated_one():
  """donate=True is the default (the step writes back into the model and the optimizer): the
  default step compiles to donate=True's program (the same text and memory analysis), whose peak
  (temp + arguments + outputs - aliased, as ga.inspect_step reports it) is below donate=False's,
  and a call deletes the arrays the model and the optimizer held before it."""
  batch = make_batch(jax.random.key(1), B)
  programs, peaks = {}, {}
  for donate in (None, True, False):
    model = MLP()
    optimizer = nnx.Optimizer(model, ga.accumulate(optax.adam(1e-2), K), wrt=nnx.Param)
    step = ga.nnx_train_step(xent, **({} if donate is None else {"donate": donate}))
    compiled = step.lower(model, optimizer, batch).compile()
    m = compiled.memory_analysis()
    sizes = (m.temp_size_in_bytes, m.argument_size_in_bytes, m.output_size_in_bytes)
    programs[donate] = compiled.as_text(), (*sizes, m.alias_size_in_bytes)
    peaks[donate] = ga.inspect_step(step, model, optimizer, batch).peak_bytes
    assert peaks[donate] == sum(sizes) - m.alias_size_in_bytes, (donate, m)
  assert programs[None] == programs[True] and programs[None][0] != programs[False][0]
  assert programs[True][1][3] > 0 and programs[False][1][3] == 0  # aliased bytes
  assert peaks[None] == peaks[True] < peaks[False], peaks

  model = MLP()
  optimizer = nnx.Optimizer(model, ga.accumulate(optax.adam(1e-2), K), wrt=nnx.Param)
  held = model.l1.kernel[...], optimizer.opt_state.acc_grads["l1"]["kernel"][...]
  ga.nnx_train_step(xent)(model, optimizer, batch)
  assert all(x.is_deleted() for x in held)
  assert not model.l1.kernel[...].is_deleted()


@pytest.mark.slow
def test_streaming_optimizer_update_takes_the_micro_batch_weight():
  """docs/migrating.md: optimizer.update(model, grads, weight=w) hands ``weight`` to
  ga.accumulate, so the window applies sgd to sum_i w_i g_i / sum_i w_i (by hand, from each
  micro-batch's gradient), not to the plain mean; optimizer.step counts calls, the state windows."""
  model = MLP()
  optimizer = nnx.Optimizer(model, ga.accumulate(optax.sgd(0.5), 2), wrt=nnx.Param)
  batch, weights = make_batch(jax.random.key(8), B), (1.0, 3.0)
  mbs = [ga.microbatch(batch, i, 2) for i in range(2)]
  grads = [nnx.to_pure_dict(nnx.grad(xent)(model, mb)) for mb in mbs]
  mean = jax.tree.map(lambda a, b: (weights[0] * a + weights[1] * b) / 4.0, *grads)
  plain = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
  want = jax.tree.map(lambda p, g: p - 0.5 * g, params_of(model), mean)
  unweighted = jax.tree.map(lambda p, g: p - 0.5 * g, params_of(model), plain)

  @nnx.jit
  def stream(model, optimizer, mb, weight):
    optimizer.update(model, nnx.grad(xent)(model, mb), weight=weight)

  for mb, w in zip(mbs, weights, strict=True):
    stream(model, optimizer, mb, w)
  assert_trees_close(params_of(model), want, rtol=1e-6, atol=1e-7)
  assert not np.allclose(want["l1"]["kernel"], unweighted["l1"]["kernel"])
  assert (int(optimizer.step[...]), int(optimizer.opt_state.count[...])) == (2, 1)


def test_has_updated_reads_the_state_an_nnx_optimizer_wraps():
  """nnx.Optimizer wraps the state's leaves in variables: ga.has_updated unwraps them (before,
  it returned the variable), False inside a window and True after the closing update."""
  model = MLP()
  optimizer = nnx.Optimizer(model, ga.accumulate(optax.sgd(0.1), 2), wrt=nnx.Param)
  seen = []
  for i in range(2):
    grads = nnx.grad(xent)(model, ga.microbatch(make_batch(jax.random.key(1), B), i, 2))
    optimizer.update(model, grads)
    updated = ga.has_updated(optimizer.opt_state)
    assert isinstance(updated, jax.Array) and updated.dtype == jnp.bool_
    seen.append(bool(updated))
  assert seen == [False, True]


@pytest.mark.slow
def test_micro_step_takes_an_all_param_module_and_refuses_one_with_other_variables():
  """docs/models.md: a module of nnx.Param only is a pytree of params for ga.micro_step (equal
  to the split model's window); one with BatchNorm statistics is refused with what to do."""
  model, k = nnx.Linear(3, 2, rngs=nnx.Rngs(0)), 2
  batch = {"x": jax.random.normal(jax.random.key(1), (8, 3)), "y": jnp.ones((8, 2))}

  def loss(m, mb):
    return jnp.mean((m(mb["x"]) - mb["y"]) ** 2)

  tx = ga.accumulate(optax.sgd(0.5), k)
  step, state, module = ga.micro_step(loss, tx), tx.init(model), model
  for i in range(k):
    module, state, _ = step(module, state, ga.microbatch(batch, i, k))
  graphdef, params = nnx.split(model)
  expected = optax.apply_updates(
    params,
    jax.tree.map(
      lambda g: -0.5 * g, jax.grad(lambda p: loss(nnx.merge(graphdef, p), batch))(params)
    ),
  )
  assert_trees_close(nnx.state(module), expected, rtol=1e-5)
  with_stats = nnx.Sequential(
    nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.BatchNorm(2, rngs=nnx.Rngs(0))
  )
  with pytest.raises(
    TypeError, match=r"micro_step: params is an nnx.Sequential .*BatchStat.*nnx.split"
  ):
    step(with_stats, tx.init(with_stats), ga.microbatch(batch, 0, k))
