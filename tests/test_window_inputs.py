"""Window statistics the loss reads (``window_stats=``): a global-batch MoE balance loss, whose
expert fractions are the whole window's, against the same loss over the whole batch at once
(plain ``jax.value_and_grad``, the fractions from the whole batch's counts)."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_trees_close, mesh_1d

import gradaccum_jax as ga

E, D, L, B = 4, 8, 2, 64  # experts (top 2), width, stacked blocks, rows (tokens) per window
ALPHA, LR = 0.1, 0.1


def init(key):
  ks = jax.random.split(key, 2)
  return {
    "router": jax.random.normal(ks[0], (L, D, E)),
    "experts": jax.random.normal(ks[1], (L, E, D, D)) / 3,
  }


def block(h, p):
  """One top-2-of-4 MoE block with a residual; its expert counts and mean router probabilities."""
  logits = h @ p["router"]
  _, top = jax.lax.top_k(logits, 2)
  gates = jax.nn.softmax(jnp.take_along_axis(logits, top, axis=1))
  outs = jnp.einsum("td,edf->tef", h, p["experts"])
  out = jnp.sum(gates[..., None] * jnp.take_along_axis(outs, top[..., None], axis=1), axis=1)
  counts = jnp.sum(jax.nn.one_hot(top, E, dtype=jnp.int32), axis=(0, 1))
  return h + jnp.tanh(out), (counts, jnp.mean(jax.nn.softmax(logits), axis=0))


def forward(params, x, remat=False):
  """The stacked blocks under ``lax.scan`` (each under ``jax.checkpoint`` with ``remat``)."""
  step = jax.checkpoint(block) if remat else block
  return jax.lax.scan(step, x, params)


def stats_fn(params, mb, remat=False):
  _, (counts, _) = forward(params, mb["x"], remat)
  return {"counts": counts, "tokens": jnp.asarray(mb["x"].shape[0], jnp.int32)}


def loss_fn(params, mb, stats, remat=False):
  """Mean squared error plus the balance loss from the window's expert fractions."""
  h, (_, prob) = forward(params, mb["x"], remat)
  fraction = stats["counts"] / (2 * stats["tokens"])  # (L, E), the window's
  return jnp.mean((h - mb["y"]) ** 2) + ALPHA * E * jnp.sum(fraction * prob)


def whole_batch(params, batch):
  return loss_fn(params, batch, jax.lax.stop_gradient(stats_fn(params, batch)))


def batches(n, key=1):
  ks = jax.random.split(jax.random.key(key), 2 * n)
  return [
    {"x": jax.random.normal(ks[2 * j], (B, D)), "y": jax.random.normal(ks[2 * j + 1], (B, D))}
    for j in range(n)
  ]


def reference(params, windows):
  for batch in windows:
    grads = jax.grad(whole_batch)(params, batch)
    params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
  return params


@pytest.mark.slow
@pytest.mark.parametrize(
  "remat,mesh",
  [
    (False, False),  # the fast tier's cell; remat and the 8-device mesh in the slow tier
    pytest.param(True, False, marks=pytest.mark.slow),
    pytest.param(False, True, marks=pytest.mark.slow),
    pytest.param(True, True, marks=pytest.mark.slow),
  ],
)
def test_global_batch_balance_loss_equals_the_whole_batch_s(remat, mesh):
  params, windows = init(jax.random.key(0)), batches(3)
  kw = {}
  if mesh:
    kw = dict(mesh=mesh_1d(), data_axis="data")
  k = 2 if mesh else 4
  tx = ga.accumulate(optax.sgd(LR), k)
  step = ga.train_step(
    functools.partial(loss_fn, remat=remat),
    tx,
    window_stats=functools.partial(stats_fn, remat=remat),
    **kw,
  )
  new, state = params, tx.init(params)
  for batch in windows:
    new, state, metrics = step(new, state, batch)
  assert_trees_close(new, reference(params, windows), rtol=1e-5, atol=1e-6)
  last = stats_fn(reference(params, windows[:2]), windows[2])
  assert jnp.array_equal(metrics["window_stats"]["counts"], last["counts"])
  assert int(metrics["window_stats"]["tokens"]) == B


@pytest.mark.slow
def test_the_micro_batches_own_fractions_are_not_the_whole_batch_s():
  """What the loss gives without window_stats (each micro-batch's own counts): another step."""
  params, (batch,) = init(jax.random.key(0)), batches(1)
  tx = ga.accumulate(optax.sgd(LR), 4)
  own = ga.train_step(lambda p, mb: loss_fn(p, mb, stats_fn(p, mb)), tx)
  new, _, _ = own(params, tx.init(params), batch)
  gap = max(float(jnp.abs(a - b).max()) for a, b in zip(
    jax.tree.leaves(new), jax.tree.leaves(reference(params, [batch])), strict=True
  ))  # fmt: skip
  assert gap > 1e-5  # 10 times the tolerance the equalities above hold to


@pytest.mark.slow
def test_value_and_grad_and_a_short_window_read_the_window_s_statistics():
  params, (batch,) = init(jax.random.key(0)), batches(1)
  loss, grads = ga.value_and_grad(loss_fn, 4, window_stats=stats_fn)(params, batch)
  want_loss, want = jax.value_and_grad(whole_batch)(params, batch)
  assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
  assert_trees_close(grads, want)
  # Micro-batches 0 and 1 of 4: the statistics and the loss of their rows only.
  tx = ga.accumulate(optax.sgd(LR), 4)
  step = ga.train_step(loss_fn, tx, window_stats=stats_fn)
  new, _, metrics = step(params, tx.init(params), batch, num_real_microbatches=2)
  rows = jax.tree.map(lambda *x: jnp.concatenate(x), *(ga.microbatch(batch, i, 4) for i in (0, 1)))
  assert_trees_close(new, reference(params, [rows]))
  assert int(metrics["window_stats"]["tokens"]) == B // 2


def test_reducers_and_weights_of_window_statistics():
  """Float leaves averaged with the micro-batches' weights, integers summed, ``"max"`` named."""
  batch = {"x": jnp.arange(16.0)[:, None], "w": (jnp.arange(16) % 3 != 0).astype(jnp.float32)}

  def stats(p, mb):
    return {"mean": jnp.sum(mb["x"] * mb["w"][:, None]) / jnp.sum(mb["w"]), "top": jnp.max(mb["x"]), "n": jnp.sum(mb["w"] > 0)}  # fmt: skip

  def loss(p, mb, s):
    return jnp.sum(p * 0.0) + s["mean"] * 0.0

  tx = ga.accumulate(optax.sgd(LR), 4)
  step = ga.train_step(
    loss, tx, weight_fn=lambda mb: jnp.sum(mb["w"]), window_stats=stats,
    window_stats_reduce={"top": "max"},
  )  # fmt: skip
  _, _, metrics = step(jnp.zeros(()), tx.init(jnp.zeros(())), batch)
  got = metrics["window_stats"]
  w = batch["w"]
  assert float(got["mean"]) == pytest.approx(float(jnp.sum(batch["x"][:, 0] * w) / jnp.sum(w)))
  assert float(got["top"]) == 15.0 and int(got["n"]) == int(jnp.sum(w > 0))


@pytest.mark.slow
def test_linen_and_nnx_steps_read_window_statistics():
  import flax.linen as nn
  from flax import nnx
  from flax.training import train_state

  (batch,) = batches(1)
  net = nn.Dense(E)
  variables = net.init(jax.random.key(0), batch["x"][:1])

  def counts(logits, mb):
    _, top = jax.lax.top_k(logits, 2)
    return {"counts": jnp.sum(jax.nn.one_hot(top, E, dtype=jnp.int32), axis=(0, 1))}

  def balance(logits, mb, stats):
    prob = jnp.mean(jax.nn.softmax(logits), axis=0)
    return E * jnp.sum(stats["counts"] / (2 * B) * prob) + jnp.mean(logits**2)

  def whole(params):
    logits = net.apply({"params": params}, batch["x"])
    return balance(logits, batch, jax.lax.stop_gradient(counts(logits, batch)))

  want = jax.tree.map(
    lambda p, g: p - LR * g, variables["params"], jax.grad(whole)(variables["params"])
  )
  ts = train_state.TrainState.create(
    apply_fn=net.apply, params=variables["params"], tx=ga.accumulate(optax.sgd(LR), 4)
  )
  ts, metrics = ga.linen_train_step(net, balance, window_stats=counts)(ts, batch)
  assert_trees_close(ts.params, want)
  assert int(metrics["window_stats"]["counts"].sum()) == 2 * B

  model = nnx.Linear(D, E, rngs=nnx.Rngs(0))
  model.kernel[...] = variables["params"]["kernel"]
  model.bias[...] = variables["params"]["bias"]
  optimizer = nnx.Optimizer(model, ga.accumulate(optax.sgd(LR), 4), wrt=nnx.Param)
  step = ga.nnx_train_step(
    lambda m, mb, s: balance(m(mb["x"]), mb, s), window_stats=lambda m, mb: counts(m(mb["x"]), mb)
  )
  step(model, optimizer, batch)
  assert_trees_close({"kernel": model.kernel[...], "bias": model.bias[...]}, want)


def test_window_stats_errors_name_the_argument():
  tx = ga.accumulate(optax.sgd(LR), 4)
  with pytest.raises(ValueError, match="window_stats_reduce=.* without window_stats="):
    ga.train_step(loss_fn, tx, window_stats_reduce="sum")
  with pytest.raises(ValueError, match="window_stats_reduce names the reducer 'maximum'"):
    ga.train_step(loss_fn, tx, window_stats=stats_fn, window_stats_reduce="maximum")
  with pytest.raises(TypeError, match="window_stats must be a function"):
    ga.train_step(loss_fn, tx, window_stats=3)
  params, (batch,) = init(jax.random.key(0)), batches(1)
  step = ga.train_step(lambda p, mb: jnp.mean(mb["x"]), tx, window_stats=stats_fn)
  with pytest.raises(TypeError, match=r"loss_fn\(params, microbatch, stats\)"):
    step(params, tx.init(params), batch)


def _peak(step, *args):
  a = step.lower(*args).compile().memory_analysis()
  return (
    a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes + a.temp_size_in_bytes
  )


@pytest.mark.slow
def test_the_statistics_pass_holds_no_more_than_one_micro_batch_s_forward():
  """Compiled peaks (deterministic): the step reading the window's statistics against the same
  step whose loss computes them from its own micro-batch differ by less than one micro-batch's
  forward activations (its hidden states, b x D floats per block); the in-place add is kept."""
  params, (batch,) = init(jax.random.key(0)), batches(1)
  tx = ga.accumulate(optax.adam(1e-3), 4)
  own = ga.train_step(lambda p, mb: loss_fn(p, mb, stats_fn(p, mb)), tx, donate=True)
  window = ga.train_step(loss_fn, tx, window_stats=stats_fn, donate=True)
  activations = (B // 4) * D * L * 4
  gap = _peak(window, params, tx.init(params), batch) - _peak(own, params, tx.init(params), batch)
  assert abs(gap) < activations, (gap, activations)
  report = ga.inspect_step(window, params, tx.init(params), batch)
  own_report = ga.inspect_step(own, params, tx.init(params), batch)
  assert report.grads_in_place == own_report.grads_in_place
