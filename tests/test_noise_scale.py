"""The gradient noise scale estimate against closed forms and brute-force references.

Linear regression y = x.w* + eps with x ~ N(0, I_d), eps ~ N(0, s2) and the loss
0.5 (x.w - y)^2 has, at params w with delta = w - w*, the per-example gradient
g = x (x.delta - eps), so

  G = E g = E[x x^T] delta = delta,                 |G|^2 = |delta|^2,
  E|g|^2 = E[|x|^2 (x.delta)^2] + s2 E|x|^2 = (d + 2) |delta|^2 + d s2

(Gaussian fourth moments: rotate delta onto e_1, E[x_1^4] = 3, E[x_j^2 x_1^2] = 1),
and tr(Sigma) = E|g|^2 - |G|^2 = (d + 1) |delta|^2 + d s2.

The statistical checks average many independent windows and allow 4 standard
errors of the mean, measured from the per-window estimates themselves.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import init_mlp, xent_loss

import gradaccum_jax as ga

D_IN = 4
NOISE_VAR = 0.25
W_STAR = (1.0, -0.5, 0.25, 2.0)
DELTA = (0.6, 0.0, -0.8, 0.0)  # |delta|^2 = 1
G2_TRUE = float(np.sum(np.float32(DELTA) ** 2))  # 1, in float32 as the arrays hold it
TRACE_TRUE = (D_IN + 1) * G2_TRUE + D_IN * NOISE_VAR  # 6


def regression_batch(key, rows):
  xk, ek = jax.random.split(key)
  x = jax.random.normal(xk, (rows, D_IN))
  y = x @ jnp.array(W_STAR) + jnp.sqrt(NOISE_VAR) * jax.random.normal(ek, (rows,))
  return {"x": x, "y": y}


def sq_loss(w, batch):
  return jnp.mean(0.5 * (batch["x"] @ w - batch["y"]) ** 2)


def masked_sq_loss(w, batch):
  """Mean over the rows with mask 1 (the 'tokens'); 0/0 = NaN for an empty micro-batch."""
  per_row = 0.5 * (batch["x"] @ w - batch["y"]) ** 2
  return jnp.sum(per_row * batch["mask"]) / jnp.sum(batch["mask"])


def num_rows(batch):
  return jnp.sum(batch["mask"])


def run_windows(step, state, params, make_batch, num_windows, key):
  """Scans ``num_windows`` windows of fresh data at fixed params (sgd with lr 0)."""

  def body(state, key):
    _, state, metrics = step(params, state, make_batch(key))
    return state, metrics

  return jax.jit(lambda s, keys: jax.lax.scan(body, s, keys))(
    state, jax.random.split(key, num_windows)
  )


def assert_mean_close(samples, expected, what):
  samples = np.asarray(samples, np.float64)
  assert np.all(np.isfinite(samples)), what
  mean = samples.mean()
  se = samples.std(ddof=1) / np.sqrt(len(samples))
  # The test can tell: its standard error is small against the value.
  assert se < 0.03 * abs(expected), (what, se, expected)
  assert abs(mean - expected) < 4 * se, (what, mean, expected, se)
  return mean, se


@pytest.mark.slow
def test_unweighted_estimates_match_the_closed_form_for_linear_regression():
  k, b, windows = 4, 8, 4000
  tx = ga.accumulate(optax.sgd(0.0), k, noise_scale_ema=0.99)
  params = jnp.array(W_STAR) + jnp.array(DELTA)
  step = ga.train_step(sq_loss, tx, jit=False)
  state, metrics = run_windows(
    step,
    tx.init(params),
    params,
    lambda key: regression_batch(key, k * b),
    windows,
    jax.random.key(0),
  )
  assert_mean_close(metrics["grad_sq_norm_est"], G2_TRUE, "|G|^2")
  assert_mean_close(metrics["trace_sigma_est"], TRACE_TRUE, "tr(Sigma)")
  # Sensitivity: the plug-in estimate without the k / (k - 1) correction is off by 25 %.
  plug_in = np.mean(metrics["trace_sigma_est"]) * (k - 1) / k
  assert abs(plug_in - TRACE_TRUE) > 0.15 * TRACE_TRUE
  assert int(state.noise_scale.count) == windows
  assert np.all(metrics["updated"])


def weighted_regression_batch(key, sizes, rows_per_mb):
  """Micro-batch i (rows i, i + k, ...) has ``sizes[i]`` rows with mask 1, the rest padding."""
  k = len(sizes)
  batch = regression_batch(key, k * rows_per_mb)
  position, mb = np.divmod(np.arange(k * rows_per_mb), k)
  batch["mask"] = jnp.asarray(position < np.asarray(sizes)[mb], jnp.float32)
  return batch


@pytest.mark.slow
def test_weighted_estimates_are_unbiased_with_unequal_token_counts():
  sizes = (1, 0, 4, 11, 24)  # micro-batch 1 is empty: weight 0, a NaN loss, not a sample
  k, windows = len(sizes), 4000
  tx = ga.accumulate(optax.sgd(0.0), k, noise_scale_ema=0.99)
  params = jnp.array(W_STAR) + jnp.array(DELTA)
  step = ga.train_step(masked_sq_loss, tx, weight_fn=num_rows, jit=False)
  state, metrics = run_windows(
    step,
    tx.init(params),
    params,
    lambda key: weighted_regression_batch(key, sizes, 24),
    windows,
    jax.random.key(1),
  )
  np.testing.assert_array_equal(metrics["weight"], sum(sizes))
  assert_mean_close(metrics["grad_sq_norm_est"], G2_TRUE, "|G|^2")
  assert_mean_close(metrics["trace_sigma_est"], TRACE_TRUE, "tr(Sigma)")
  # The EMAs (bias-corrected) are averages of the same unbiased estimates.
  correction = 1 - 0.99 ** int(state.noise_scale.count)
  np.testing.assert_allclose(float(state.noise_scale.trace_ema) / correction, TRACE_TRUE, rtol=0.2)


@pytest.mark.slow
def test_data_parallel_estimates_are_unbiased_over_device_microbatches():
  devices, k, b, windows = 4, 2, 8, 3000
  mesh = jax.make_mesh((devices,), ("data",))
  tx = ga.accumulate(optax.sgd(0.0), k, noise_scale_ema=0.99)
  params = jnp.array(W_STAR) + jnp.array(DELTA)
  step = ga.train_step(sq_loss, tx, mesh=mesh, jit=False)
  _, metrics = run_windows(
    step,
    tx.init(params),
    params,
    lambda key: regression_batch(key, k * b),
    windows,
    jax.random.key(2),
  )
  assert_mean_close(metrics["grad_sq_norm_est"], G2_TRUE, "|G|^2")
  assert_mean_close(metrics["trace_sigma_est"], TRACE_TRUE, "tr(Sigma)")


def classification_batch(key, rows, teacher):
  x = jax.random.normal(key, (rows, 6))
  logits = 3.0 * jnp.tanh(x @ teacher)
  y = jax.random.categorical(jax.random.fold_in(key, 1), logits)
  return {"x": x, "y": y}


@pytest.mark.slow
def test_noise_scale_matches_the_two_batch_size_brute_force_estimate():
  """McCandlish et al., appendix A.1: E|G_B|^2 = |G|^2 + tr(Sigma) / B at two batch sizes."""
  teacher = jax.random.normal(jax.random.key(3), (6, 3))
  params = init_mlp(jax.random.key(4))
  make = lambda key, rows: classification_batch(key, rows, teacher)  # noqa: E731

  def mean_sq_batch_grad(key, batch_size, num_batches):
    grads = jax.vmap(lambda kk: jax.grad(xent_loss)(params, make(kk, batch_size)))(
      jax.random.split(key, num_batches)
    )
    sq = sum(jnp.sum(g.reshape(num_batches, -1) ** 2, axis=1) for g in jax.tree.leaves(grads))
    return float(jnp.mean(sq))

  small, big = 4, 128
  sq_small = mean_sq_batch_grad(jax.random.key(5), small, 40000)
  sq_big = mean_sq_batch_grad(jax.random.key(6), big, 2000)
  trace_ref = (sq_small - sq_big) / (1 / small - 1 / big)
  g2_ref = (big * sq_big - small * sq_small) / (big - small)
  b_ref = trace_ref / g2_ref

  k, b, decay, windows = 4, 16, 0.997, 3000
  tx = ga.accumulate(optax.sgd(0.0), k, noise_scale_ema=decay)
  step = ga.train_step(xent_loss, tx, jit=False)
  state, metrics = run_windows(
    step, tx.init(params), params, lambda key: make(key, k * b), windows, jax.random.key(7)
  )
  estimate = float(ga.noise_scale(state))
  np.testing.assert_allclose(float(metrics["noise_scale"][-1]), estimate, rtol=1e-6)
  # The EMA averages about (1 + d) / (1 - d) windows; its relative standard error (from the
  # per-window spread) bounds the tolerance, plus 5 % for the brute-force reference.
  n_eff = (1 + decay) / (1 - decay)
  rel = [
    np.std(metrics[m]) / abs(np.mean(metrics[m])) / np.sqrt(n_eff)
    for m in ("grad_sq_norm_est", "trace_sigma_est")
  ]
  tol = 4 * np.hypot(*rel) + 0.05
  assert tol < 0.35, tol
  print(f"B_simple: EMA {estimate:.3f}, brute force {b_ref:.3f}, tolerance {tol:.3f}")
  np.testing.assert_allclose(estimate, b_ref, rtol=tol)


@pytest.mark.slow
def test_train_step_metrics_and_streaming_agree_on_the_same_microbatches():
  sizes = (3, 7, 1, 5)
  k = len(sizes)
  tx = ga.accumulate(optax.sgd(0.1), k, noise_scale_ema=0.5)
  params = jnp.array(W_STAR) + jnp.array(DELTA)
  batches = [weighted_regression_batch(jax.random.key(10 + j), sizes, 8) for j in range(2)]

  step = ga.train_step(masked_sq_loss, tx, weight_fn=num_rows)
  grad_fn = jax.jit(jax.grad(masked_sq_loss))
  fused_params, fused_state = params, tx.init(params)
  for batch in batches:
    p_last = fused_params  # the params of the last window's gradients
    fused_params, fused_state, metrics = step(fused_params, fused_state, batch)
  assert {"noise_scale", "grad_sq_norm_est", "trace_sigma_est"} <= set(metrics)

  # An independent reference for the last window: per-micro-batch gradients and the formulas.
  gs, ws = [], []
  for i in range(k):
    mb = ga.microbatch(batches[-1], i, k)
    gs.append(np.asarray(grad_fn(p_last, mb), np.float64))
    ws.append(float(num_rows(mb)))
  gs, ws = np.stack(gs), np.asarray(ws)
  big_w = ws.sum()
  gbar = (ws[:, None] * gs).sum(0) / big_w
  mean_sq = (ws * (gs**2).sum(1)).sum() / big_w
  np.testing.assert_allclose(
    metrics["grad_sq_norm_est"], (k * gbar @ gbar - mean_sq) / (k - 1), rtol=1e-4
  )
  np.testing.assert_allclose(
    metrics["trace_sigma_est"], big_w * (mean_sq - gbar @ gbar) / (k - 1), rtol=1e-4
  )

  update = jax.jit(tx.update)
  streamed_params, streamed_state = params, tx.init(params)
  for batch in batches:
    for i in range(k):
      mb = ga.microbatch(batch, i, k)
      grads = grad_fn(streamed_params, mb)
      updates, streamed_state = update(grads, streamed_state, streamed_params, weight=num_rows(mb))
      streamed_params = optax.apply_updates(streamed_params, updates)
  np.testing.assert_allclose(streamed_params, fused_params, rtol=1e-5)
  for name, s, f in zip(
    ga.NoiseScaleState._fields, streamed_state.noise_scale, fused_state.noise_scale, strict=True
  ):
    np.testing.assert_allclose(s, f, rtol=1e-4, err_msg=name)
  assert int(fused_state.noise_scale.count) == 2
  np.testing.assert_allclose(ga.noise_scale(streamed_state), metrics["noise_scale"], rtol=1e-4)


def test_off_by_default_and_nothing_extra_in_the_state_or_metrics():
  tx = ga.accumulate(optax.sgd(0.1), 2)
  params = jnp.zeros(D_IN)
  state = tx.init(params)
  assert state.noise_scale is None
  _, _, metrics = ga.train_step(sq_loss, tx)(params, state, regression_batch(jax.random.key(0), 8))
  assert "noise_scale" not in metrics
  with pytest.raises(ValueError, match="noise_scale_ema=0.99"):
    ga.noise_scale(state)
  with pytest.raises(TypeError, match="AccumulateState"):
    ga.noise_scale(state.inner_state)


@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1, float("nan")])
def test_noise_scale_ema_out_of_range_names_the_value(bad):
  with pytest.raises(ValueError, match=rf"noise_scale_ema must be a decay in \[0, 1\).*{bad}"):
    ga.accumulate(optax.sgd(0.1), 2, noise_scale_ema=bad)


WRONG_TYPES = {
  "True": lambda: True,
  "0.99": lambda: "0.99",
  "jnp.float32": lambda: jnp.float32(0.9),
}


@pytest.mark.parametrize("wrong", list(WRONG_TYPES))
def test_noise_scale_ema_of_the_wrong_type_names_it(wrong):
  bad = WRONG_TYPES[wrong]()  # made here: a jax array at import would compile
  with pytest.raises(TypeError, match="noise_scale_ema must be a float"):
    ga.accumulate(optax.sgd(0.1), 2, noise_scale_ema=bad)
