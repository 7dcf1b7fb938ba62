"""DP-SGD over accumulation windows (ga.dp_accumulate, docs/privacy.md), against a by-hand
whole-batch reference: each example's gradient from plain ``jax.grad`` on its row alone, clipped
to C, summed over the batch's real examples, divided by B; and against JAX Privacy's
``clipped_grad``, the noise's closed-form spread and an uninterrupted run."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batch, mesh_1d, mlp, mlp_params, put
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

N, C, B, LR = 32, 3.0, 40.0, 0.1  # rows, clip norm (about half the examples clip), B, lr
FSDP = {
  "layer0": {"w": P(None, "data"), "b": P("data")},
  "layer1": {"w": P("data"), "b": P("data")},
}


def base_params():
  """The MLP 6-16-8 the windows train."""
  return mlp_params((6, 16, 8))


def make(key=1, pad=0.0):
  """A batch of N rows, about a quarter of them padding (mask 0) filled with ``pad``: 0 (every
  gradient finite: one backward pass of the weighted losses) or NaN (examples one at a time)."""
  batch = make_batch(jax.random.key(key), N, num_classes=8)
  mask = (jax.random.uniform(jax.random.key(key + 100), (N,)) > 0.25).astype(jnp.float32)
  x = jnp.where(mask[:, None] > 0, batch["x"], pad)
  return dict(batch, x=x, mask=mask)


def loss_fn(params, mb):
  logits = mlp(params, mb["x"])
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), mb["y"][:, None], axis=1))


def weight_fn(example):
  return example["mask"][0]


_grads = {}


def _grad(fn):
  if fn not in _grads:
    _grads[fn] = jax.jit(jax.grad(fn))
  return _grads[fn]


def clipped_sum(params, batch, loss=loss_fn):
  """sum_e min(1, C / |g_e|) g_e over the real examples: plain jax.grad on each row alone."""
  total = jax.tree.map(jnp.zeros_like, params)
  for e in range(N):
    if float(batch["mask"][e]) == 0:
      continue
    row = jax.tree.map(lambda x, e=e: x[e : e + 1], batch)
    g = _grad(loss)(params, row)
    norm = float(
      np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(g)))
    )
    total = jax.tree.map(lambda t, x, norm=norm: t + x * min(1.0, C / norm), total, g)
  return total


def sgd(params, batch, loss=loss_fn):
  """One window of plain SGD on the by-hand private gradient (sigma = 0)."""
  g = clipped_sum(params, batch, loss)
  return jax.tree.map(lambda p, x: p - LR * x / B, params, g)


def dp_tx(k, sigma=0.0, seed=0, inner=None, **kw):
  inner = optax.sgd(LR) if inner is None else inner
  kw = dict(l2_clip=C, noise_multiplier=sigma, expected_batch_size=B, seed=seed, **kw)
  return ga.dp_accumulate(inner, k, **kw)


FAST_CELLS = {(2, False, 0.0), (4, True, "nan")}  # the rest in the slow tier


@pytest.mark.slow
@pytest.mark.parametrize(
  "k,donate,pad",
  [
    pytest.param(
      k, d, p, marks=[] if (k, d, "nan" if p != p else p) in FAST_CELLS else [pytest.mark.slow]
    )
    for k in (1, 2, 4)
    for d in (False, True)
    for p in (0.0, np.nan)
  ],
)
def test_train_step_is_the_by_hand_clipped_whole_batch_update(k, donate, pad):
  batch = make(pad=pad)
  tx = dp_tx(k)
  step = ga.train_step(loss_fn, tx, weight_fn=weight_fn, donate=donate)
  params, state = jax.tree.map(jnp.copy, base_params()), tx.init(base_params())
  params, state, metrics = step(params, state, batch)
  assert_trees_close(params, sgd(base_params(), batch))
  assert float(metrics["weight"]) == float(jnp.sum(batch["mask"]))  # the real examples
  assert bool(metrics["updated"]) and np.isfinite(float(metrics["loss"]))
  # a second window starts from the first's params and empty sums
  params, state, _ = step(params, state, make(2))
  assert_trees_close(params, sgd(sgd(base_params(), batch), make(2)))
  assert int(state.count) == 2 and int(state.num_skipped) == 0


@pytest.mark.slow
@pytest.mark.parametrize(
  "accum_dtype,pad",
  [
    (jnp.float32, 0.0),
    pytest.param(jnp.float32, np.nan, marks=pytest.mark.slow),
    pytest.param(jnp.bfloat16, 0.0, marks=pytest.mark.slow),
    pytest.param(jnp.bfloat16, np.nan, marks=pytest.mark.slow),
  ],
)
def test_micro_step_and_tx_update_are_the_fused_window(accum_dtype, pad):
  batch, k = make(pad=pad), 4
  tol = dict(rtol=1e-5, atol=1e-6) if accum_dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-3)
  want = sgd(base_params(), batch)
  tx = dp_tx(k, accum_dtype=accum_dtype)
  step = ga.micro_step(loss_fn, tx, weight_fn=weight_fn)
  params, state = base_params(), tx.init(base_params())
  for i in range(k):
    params, state, metrics = step(params, state, ga.microbatch(batch, i, k))
  assert_trees_close(params, want, **tol)
  assert bool(metrics["updated"]) and float(metrics["weight"]) == float(jnp.sum(batch["mask"]))

  grad = jax.jit(ga.clipped_grad(loss_fn, tx, weight_fn=weight_fn))
  params, state = base_params(), tx.init(base_params())
  for i in range(k):
    _, g, w = grad(params, ga.microbatch(batch, i, k))
    updates, state = tx.update(g, state, params, weight=w)
    params = optax.apply_updates(params, updates)
  assert_trees_close(params, want, **tol)


@pytest.mark.slow
@pytest.mark.parametrize(
  "specs,gather",
  [(None, "once"), (FSDP, "once"), (FSDP, "per_microbatch")],
  ids=["replicated", "fsdp", "fsdp-per_microbatch"],
)
@pytest.mark.parametrize("sigma,pad", [(0.0, 0.0), (1.3, np.nan)])
def test_on_a_mesh_the_sums_and_the_noise_are_the_one_device_window_s(specs, gather, sigma, pad):
  """8 devices, k = 2: the update equals the one-device step's (sigma = 0: the by-hand one), the
  noise drawn once for the window, not once per device (that would be sqrt(8) larger)."""
  batch, k = make(pad=pad), 2
  mesh = mesh_1d()
  tx = dp_tx(k, sigma, seed=7)
  one = ga.train_step(loss_fn, tx, weight_fn=weight_fn)(
    base_params(), tx.init(base_params()), batch
  )[0]
  step = ga.train_step(
    loss_fn, tx, weight_fn=weight_fn, mesh=mesh, param_specs=specs, gather_params=gather
  )
  params = base_params() if specs is None else put(base_params(), mesh, FSDP)
  new, state, _ = step(params, tx.init(params), put(batch, mesh, P("data")))
  assert_trees_close(new, one)
  if sigma == 0:
    assert_trees_close(new, sgd(base_params(), batch))
  mstep = ga.micro_step(loss_fn, tx, weight_fn=weight_fn, mesh=mesh, param_specs=specs)
  params, state = (
    (base_params() if specs is None else put(base_params(), mesh, FSDP)),
    tx.init(params),
  )
  for i in range(k):
    params, state, _ = mstep(params, state, put(ga.microbatch(batch, i, k), mesh, P("data")))
  assert_trees_close(params, one)


@pytest.mark.parametrize("k", [pytest.param(k, marks=pytest.mark.slow) for k in (1, 2, 4)])
def test_the_noise_is_drawn_once_per_window_with_spread_sigma_c_over_b(k):
  """update(sigma) - update(0) over 8 seeds and 2,000 coordinates: standard deviation
  sigma C / B (lr 1), whatever k; drawn per micro-batch it would be sqrt(k) larger."""
  dim, sigma = 2000, 2.0
  w0 = jnp.zeros(dim)
  batch = {"x": jax.random.normal(jax.random.key(3), (16, dim))}

  def linear(w, mb):
    return jnp.mean(mb["x"] @ w)

  def update(sigma, seed):
    tx = ga.dp_accumulate(optax.sgd(1.0), k, l2_clip=C, noise_multiplier=sigma,
                          expected_batch_size=B, seed=seed)  # fmt: skip
    return ga.train_step(linear, tx)(w0, tx.init(w0), batch)[0]

  noise = np.stack([update(sigma, s) - update(0.0, s) for s in range(8)])
  want = sigma * C / B
  assert abs(noise.std() / want - 1) < 0.03, (noise.std(), want)
  assert abs(noise.mean()) < 4 * want / np.sqrt(noise.size)
  assert not np.allclose(noise[0], noise[1])  # each seed its own draw


@pytest.mark.slow
def test_a_resumed_run_draws_the_uninterrupted_run_s_noise():
  batches = [make(i) for i in range(3)]
  tx = dp_tx(2, sigma=1.1, seed=3, inner=optax.adam(1e-2))
  step = ga.train_step(loss_fn, tx, weight_fn=weight_fn)
  params, state = base_params(), tx.init(base_params())
  for b in batches:
    params, state, _ = step(params, state, b)

  resumed, saved = base_params(), tx.init(base_params())
  resumed, saved, _ = step(resumed, saved, batches[0])
  saved = jax.tree.map(np.asarray, jax.device_get((resumed, saved)))  # a checkpoint
  tx2 = dp_tx(2, sigma=1.1, seed=3, inner=optax.adam(1e-2))
  step2 = ga.train_step(loss_fn, tx2, weight_fn=weight_fn)
  resumed, state2 = jax.tree.map(jnp.asarray, saved)
  for b in batches[1:]:
    resumed, state2, _ = step2(resumed, state2, b)
  assert_trees_close(resumed, params, rtol=0, atol=0)
  other = dp_tx(2, sigma=1.1, seed=4, inner=optax.adam(1e-2))
  p4 = ga.train_step(loss_fn, other, weight_fn=weight_fn)(
    base_params(), other.init(base_params()), batches[0]
  )[0]
  assert not np.allclose(
    p4["layer0"]["w"], step(base_params(), tx.init(base_params()), batches[0])[0]["layer0"]["w"]
  )


# JAX Privacy 2.0.0 calls optax.global_norm, which optax 0.2.8 deprecates.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated:DeprecationWarning")
def test_one_window_is_jax_privacy_s_clipped_grad_divided_by_b():
  import jax_privacy

  batch = make()
  real = batch["mask"] > 0
  whole = jax.tree.map(lambda x: x[np.asarray(real)], batch)  # JAX Privacy takes no mask
  peer = jax_privacy.clipped_grad(loss_fn, l2_clip_norm=C, batch_argnums=1)(base_params(), whole)
  tx = dp_tx(4, inner=optax.sgd(1.0))
  new = ga.train_step(loss_fn, tx, weight_fn=weight_fn)(
    base_params(), tx.init(base_params()), batch
  )[0]
  assert_trees_close(jax.tree.map(lambda p, n: (p - n) * B, base_params(), new), peer)


@pytest.mark.slow
def test_a_non_finite_example_adds_nothing_and_voids_nothing():
  batch = make()
  x = batch["x"].at[5].set(jnp.inf)  # a real example whose gradient is NaN
  bad = dict(batch, x=x)
  kept = dict(batch, mask=batch["mask"].at[5].set(0.0))
  tx = dp_tx(4)
  step = ga.train_step(loss_fn, tx, weight_fn=weight_fn)
  new, state, metrics = step(base_params(), tx.init(base_params()), bad)
  assert bool(metrics["updated"]) and int(state.num_skipped) == 0
  assert_trees_close(new, sgd(base_params(), kept))


@pytest.mark.slow
def test_a_window_of_padding_only_still_takes_its_noisy_step():
  """Voiding an empty window would tell the data: it takes the step of sum 0 plus noise."""
  batch = dict(make(), mask=jnp.zeros(N))
  tx = dp_tx(2, sigma=1.0)
  new, state, metrics = ga.train_step(loss_fn, tx, weight_fn=weight_fn)(
    base_params(), tx.init(base_params()), batch
  )
  assert bool(metrics["updated"]) and float(metrics["weight"]) == 0
  assert not np.allclose(new["layer1"]["b"], base_params()["layer1"]["b"])


@pytest.mark.slow
def test_linen_and_nnx_steps_clip_each_example():
  import flax.linen as nn
  from flax import nnx
  from flax.training import train_state

  batch, k = make(), 2
  net = nn.Dense(8)
  variables = net.init(jax.random.key(0), batch["x"][:1])

  def xent(logits, mb):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), mb["y"][:, None], axis=1))

  def dense_loss(params, mb):
    return xent(net.apply({"params": params}, mb["x"]), mb)

  want = sgd(variables["params"], batch, dense_loss)
  ts = train_state.TrainState.create(apply_fn=net.apply, params=variables["params"], tx=dp_tx(k))
  ts, _ = ga.linen_train_step(net, xent, weight_fn=weight_fn)(ts, batch)
  assert_trees_close(ts.params, want)

  model = nnx.Linear(6, 8, rngs=nnx.Rngs(0))
  model.kernel[...] = variables["params"]["kernel"]
  model.bias[...] = variables["params"]["bias"]
  optimizer = nnx.Optimizer(model, dp_tx(k), wrt=nnx.Param)
  ga.nnx_train_step(lambda m, mb: xent(m(mb["x"]), mb), weight_fn=weight_fn)(
    model, optimizer, batch
  )
  assert_trees_close({"kernel": model.kernel[...], "bias": model.bias[...]}, want)


@pytest.mark.slow
def test_aux_is_reduced_over_the_real_examples():
  batch = make()

  def with_aux(params, mb):
    loss = loss_fn(params, mb)
    return loss, {"loss": loss, "rows": jnp.ones((), jnp.int32), "peak": loss}

  tx = dp_tx(4)
  step = ga.train_step(with_aux, tx, weight_fn=weight_fn, has_aux=True, aux_reduce={"peak": "max"})
  _, _, metrics = step(base_params(), tx.init(base_params()), batch)
  real = np.asarray(batch["mask"]) > 0
  losses = np.array([float(loss_fn(base_params(), jax.tree.map(lambda x, e=e: x[e : e + 1], batch)))
                     for e in np.flatnonzero(real)])  # fmt: skip
  assert int(metrics["aux"]["rows"]) == real.sum()
  np.testing.assert_allclose(float(metrics["aux"]["loss"]), losses.mean(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["loss"]), losses.mean(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["aux"]["peak"]), losses.max(), rtol=1e-6)


def test_bad_settings_and_options_are_refused_before_any_work():
  with pytest.raises(ValueError, match="l2_clip=0.0 must be finite and > 0"):
    ga.dp_accumulate(optax.sgd(1.0), 2, l2_clip=0.0, noise_multiplier=1.0, expected_batch_size=8)
  with pytest.raises(ValueError, match="noise_multiplier=-1.0 must be finite and >= 0"):
    ga.dp_accumulate(optax.sgd(1.0), 2, l2_clip=1.0, noise_multiplier=-1, expected_batch_size=8)
  with pytest.raises(ValueError, match="expected_batch_size=inf"):
    ga.dp_accumulate(optax.sgd(1.0), 2, l2_clip=1, noise_multiplier=1, expected_batch_size=np.inf)
  with pytest.raises(TypeError, match="seed must be an int"):
    ga.dp_accumulate(
      optax.sgd(1.0), 2, l2_clip=1, noise_multiplier=1, expected_batch_size=8, seed=1.5
    )
  with pytest.raises(TypeError, match="made by ga.dp_accumulate"):
    ga.clipped_grad(loss_fn, ga.accumulate(optax.sgd(1.0), 2))
  tx = dp_tx(2)
  with pytest.raises(ValueError, match="does not take window_stats="):
    ga.train_step(loss_fn, tx, window_stats=lambda p, mb: jnp.mean(mb["x"]))(
      base_params(), tx.init(base_params()), make()
    )

  def bn_loss(params, state, mb):
    return loss_fn(params, mb), state

  with pytest.raises(ValueError, match=r"the model state holds \['mean'\] \(float32\)"):
    ga.train_step(bn_loss, tx, has_state=True)(
      base_params(), {"mean": jnp.zeros(3)}, tx.init(base_params()), make()
    )
  with pytest.raises(ValueError, match=r"weight_fn\(example\)"):
    ga.train_step(loss_fn, tx, weight_fn=lambda ex: ex["mask"])(
      base_params(), tx.init(base_params()), make()
    )


def test_the_accountant_counts_windows_and_matches_the_gaussian_closed_form():
  """docs/privacy.md's accountant at q = 1 (every example in every window): T windows of the
  Gaussian mechanism are one of noise sigma / sqrt(T), whose epsilon has a closed form
  (mu-GDP, mu = sqrt(T) / sigma: delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2))."""
  import dp_accounting
  from scipy.stats import norm

  sigma, windows, delta = 4.0, 50, 1e-5
  event = dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(sigma)), windows
  )
  pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
  eps = pld.compose(event).get_epsilon(delta)
  mu = np.sqrt(windows) / sigma

  def delta_of(e):
    return norm.cdf(-e / mu + mu / 2) - np.exp(e) * norm.cdf(-e / mu - mu / 2)

  lo, hi = 0.0, 50.0
  for _ in range(200):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
  assert abs(eps - hi) < 1e-2 * hi, (eps, hi)
  rdp = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)
  assert rdp >= hi  # RDP's bound is looser, never below the exact value


@pytest.mark.slow
def test_the_extra_memory_grows_with_the_micro_batch_not_the_window():
  """docs/privacy.md: the clipped pass's extra peak (compiled memory analysis, over the plain
  window's) depends on b, the rows of a micro-batch, not on k: accumulation keeps it small."""
  params = init_mlp(jax.random.key(0), (64, 256, 8))

  def extra(k, b):
    batch = make_batch(jax.random.key(1), k * b, d_in=64, num_classes=8)
    peaks = []
    for tx in (ga.accumulate(optax.adam(1e-3), k), dp_tx(k, 1.0, inner=optax.adam(1e-3))):
      step = ga.train_step(loss_fn, tx, donate=True)
      analysis = step.lower(params, tx.init(params), batch).compile().memory_analysis()
      peaks.append(
        analysis.argument_size_in_bytes + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes
      )  # fmt: skip
    return peaks[1] - peaks[0]

  A = sum(x.size * 4 for x in jax.tree.leaves(params))
  assert extra(8, 8) == extra(2, 8)  # a window 4 times larger: the same extra bytes
  assert 0 < extra(2, 4) < extra(2, 8) < extra(2, 16)
  assert extra(2, 16) - extra(2, 8) > 4 * A  # b examples' gradients of the largest layer
