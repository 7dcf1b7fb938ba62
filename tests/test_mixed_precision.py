"""bf16 and fp16 training against fp32 references: master weights, accumulators, loss scaling.

Tolerances come from the unit roundoff u of each format (round to nearest: the largest relative
error of one rounding): bf16 keeps 8 significant bits, u = 2^-8 ~ 3.9e-3; fp16 keeps 11,
u = 2^-11 ~ 4.9e-4. A gradient of this two-layer MLP goes through about five rounded operations
(the cast of the params and inputs, the two matmuls, tanh, the backward matmuls); to first order
their relative errors add with random signs, so the norm-wise relative error of a gradient is a
small multiple of u (measured: 0.6u-1.3u for bf16, 0.8u-1.4u for fp16). We allow 4u. Results
that are exact in the arithmetic (an fp32 sum of a few low-precision values, scaling by a power
of two) are held to fp32 precision.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batch, mlp

import gradaccum_jax as ga

K = 4
BF16_U = 2.0**-8
FP16_U = 2.0**-11
LR = 0.1


def loss_fn(params, batch):
  """Mean cross-entropy computed in the params' dtype (what compute_dtype casts them to)."""
  dtype = params["layer0"]["w"].dtype
  logp = jax.nn.log_softmax(mlp(params, batch["x"].astype(dtype)))
  return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


@jax.jit
def fp32_grad(params, batch):
  """The reference: the fp32 gradient of the whole batch (params upcast to fp32)."""
  return jax.grad(loss_fn)(jax.tree.map(lambda p: p.astype(jnp.float32), params), batch)


def rel_err(actual, expected):
  """Norm-wise relative error ||actual - expected|| / ||expected|| over the whole tree."""
  a = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(actual)])
  e = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(expected)])
  return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def dtypes(tree):
  return {jnp.dtype(x.dtype) for x in jax.tree.leaves(tree)}


def capture(lr=LR):
  """sgd(lr) that keeps, as its state, the gradient it was last given (to read it exactly)."""

  def update(grads, state, params=None):
    return jax.tree.map(lambda g: -lr * g, grads), grads

  return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params), update)


# ----------------------------------------------------------------------------- bf16


@pytest.mark.slow
def test_bf16_compute_with_fp32_master_params_and_accumulator():
  params = init_mlp(jax.random.key(0), sizes=(6, 32, 3))
  seen = set()

  def probed_loss(p, mb):
    seen.add(jnp.dtype(p["layer0"]["w"].dtype))  # at trace time: what loss_fn computes in
    return loss_fn(p, mb)

  k, b = 64, 4  # many small micro-batches: where a bf16 accumulator loses most
  batch = make_batch(jax.random.key(1), k * b)
  ref = fp32_grad(params, batch)
  grads = {}
  for name, accum_dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
    tx = ga.accumulate(capture(), k, accum_dtype=accum_dtype)
    state = tx.init(params)
    assert dtypes(state.acc_grads) == {jnp.dtype(accum_dtype)}
    step = ga.train_step(probed_loss, tx, compute_dtype=jnp.bfloat16)
    new_params, state, metrics = step(params, state, batch)
    assert dtypes(new_params) == {jnp.dtype(jnp.float32)}  # master params stay fp32
    assert dtypes(state.acc_grads) == {jnp.dtype(accum_dtype)}
    assert dtypes(state.inner_state) == {jnp.dtype(jnp.float32)}  # G in the params' dtype
    assert bool(metrics["updated"])
    # The step applied -LR * G to the fp32 params.
    assert_trees_close(new_params, jax.tree.map(lambda p, g: p - LR * g, params, state.inner_state))
    grads[name] = state.inner_state
  assert seen == {jnp.dtype(jnp.bfloat16)}

  err_fp32_acc, err_bf16_acc = rel_err(grads["fp32"], ref), rel_err(grads["bf16"], ref)
  print(f"bf16 compute, k={k}: rel. error fp32 acc {err_fp32_acc:.2e}, bf16 acc {err_bf16_acc:.2e}")
  assert 0 < err_fp32_acc < 4 * BF16_U
  # The fp32 accumulator adds no error of its own: the bf16 one rounds on each of the k adds.
  assert err_fp32_acc < 0.5 * err_bf16_acc


@pytest.mark.slow
def test_bf16_params_with_fp32_accumulator():
  params32 = init_mlp(jax.random.key(0))
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params32)  # stored in bf16
  batch = make_batch(jax.random.key(2), 32)
  ref_grads = fp32_grad(params, batch)
  ref_updates = jax.tree.map(lambda g: -LR * g, ref_grads)

  # Streaming: bf16 micro-batch gradients, summed into an fp32 accumulator.
  tx = ga.accumulate(optax.sgd(LR), K)
  state = tx.init(params)
  micro_grad, update = jax.jit(jax.grad(loss_fn)), jax.jit(tx.update)
  micro_grads = [micro_grad(params, ga.microbatch(batch, i, K)) for i in range(K)]
  assert dtypes(micro_grads) == {jnp.dtype(jnp.bfloat16)}
  for g in micro_grads[:-1]:
    updates, state = update(g, state, params)
  assert dtypes(state.acc_grads) == {jnp.dtype(jnp.float32)}
  # An fp32 sum of three bf16 values is exact here: compare with a float64 sum.
  exact_sum = jax.tree.map(lambda *g: sum(np.asarray(x, np.float64) for x in g), *micro_grads[:-1])
  assert_trees_close(state.acc_grads, exact_sum, rtol=1e-7, atol=0)
  updates, state = update(micro_grads[-1], state, params)
  assert bool(ga.has_updated(state))
  assert dtypes(updates) == {jnp.dtype(jnp.bfloat16)}  # cast back to the params' dtype
  err = rel_err(updates, ref_updates)
  print(f"bf16 params, streaming: rel. error of the update {err:.2e}")
  assert err < 4 * BF16_U

  # Fused: the same, and the new params are bf16 within one rounding of the fp32 result.
  step = ga.train_step(loss_fn, ga.accumulate(optax.sgd(LR), K))
  new_params, state, _ = step(params, ga.accumulate(optax.sgd(LR), K).init(params), batch)
  assert dtypes(new_params) == {jnp.dtype(jnp.bfloat16)}
  assert dtypes(state.acc_grads) == {jnp.dtype(jnp.float32)}
  ref_new = jax.tree.map(lambda p, u: p.astype(jnp.float32) + u, params, ref_updates)
  max_update = max(float(jnp.max(jnp.abs(u))) for u in jax.tree.leaves(ref_updates))
  # |new - ref| <= u |ref| (the final rounding to bf16) + the update's own error (4u of it).
  assert_trees_close(new_params, ref_new, rtol=BF16_U, atol=4 * BF16_U * max_update)


# ----------------------------------------------------------------------------- fp16


def loss_scale():
  return ga.DynamicLossScale(initial_scale=2.0**15, period=3, factor=2.0)


def fp16_inner():
  return optax.sgd(LR, momentum=0.9)  # with momentum, so that "inner state unchanged" has teeth


def fp32_run(params, data):
  """The reference: fp32 big-batch sgd with momentum; params before and after every window."""
  inner = fp16_inner()

  @jax.jit
  def step(params, state, batch):
    updates, state = inner.update(jax.grad(loss_fn)(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  state = inner.init(params)
  history = [params]
  for batch in data:
    params, state = step(params, state, batch)
    history.append(params)
  return history


def displacement(after, before):
  return jax.tree.map(lambda a, b: a - b, after, before)


def test_fp16_loss_scale_once_per_window_overflow_skips_and_growth_fused():
  params = init_mlp(jax.random.key(0))
  data = [make_batch(key, 16) for key in jax.random.split(jax.random.key(3), 6)]
  tx = ga.accumulate(fp16_inner(), K, loss_scale=loss_scale())
  step = ga.train_step(loss_fn, tx, compute_dtype=jnp.float16)

  # From the rule: 3 good windows at 2^15, then the scale doubles to 2^16, which is above the
  # fp16 maximum 65504: the scaled gradient overflows, the window is skipped and the scale halves.
  expected_used = [2.0**15, 2.0**15, 2.0**15, 2.0**16, 2.0**15, 2.0**15]
  expected_after = [2.0**15, 2.0**15, 2.0**16, 2.0**15, 2.0**15, 2.0**15]
  skipped_window = 3
  assert 2.0**16 > float(jnp.finfo(jnp.float16).max) > 2.0**15

  state = tx.init(params)
  trajectory = [params]
  for w, batch in enumerate(data):
    before_params, before = trajectory[-1], state
    new_params, state, metrics = step(before_params, before, batch)
    assert float(metrics["loss_scale"]) == expected_used[w]
    assert float(state.loss_scale.scale) == expected_after[w]
    assert dtypes(new_params) == {jnp.dtype(jnp.float32)}
    assert dtypes(state.acc_grads) == {jnp.dtype(jnp.float32)}
    if w == skipped_window:  # the whole window is voided
      assert not bool(metrics["updated"]) and not bool(ga.has_updated(state))
      assert_trees_close(new_params, before_params, rtol=0, atol=0)
      assert_trees_close(state.inner_state, before.inner_state, rtol=0, atol=0)
      assert_trees_close(state.acc_grads, before.acc_grads, rtol=0, atol=0)  # reset to zeros
      assert int(state.num_skipped) == int(before.num_skipped) + 1
    else:
      assert bool(metrics["updated"])
      assert int(state.num_skipped) == int(before.num_skipped)
    assert int(state.count) == w + 1
    trajectory.append(new_params)
  assert int(state.num_skipped) == 1

  # Every applied window, the one right after the overflow included, matches fp32 training on
  # the applied batches only.
  applied = [w for w in range(len(data)) if w != skipped_window]
  ref = fp32_run(params, [data[w] for w in applied])
  errors = []
  for n, w in enumerate(applied):
    errors.append(
      rel_err(displacement(trajectory[w + 1], trajectory[w]), displacement(ref[n + 1], ref[n]))
    )
  print("fp16 + loss scaling, per-window update rel. errors:", [f"{e:.1e}" for e in errors])
  assert max(errors) < 4 * FP16_U
  assert rel_err(displacement(trajectory[-1], params), displacement(ref[-1], params)) < 4 * FP16_U


@pytest.mark.slow
def test_fp16_loss_scale_streaming_user_scales_the_loss():
  """Streaming: the user differentiates loss * state.loss_scale.scale; the scale only changes
  when a window closes."""
  params = init_mlp(jax.random.key(0))
  data = [make_batch(key, 16) for key in jax.random.split(jax.random.key(3), 4)]
  tx = ga.accumulate(fp16_inner(), K, loss_scale=loss_scale())

  def fp16_loss(p, mb):
    return loss_fn(jax.tree.map(lambda x: x.astype(jnp.float16), p), mb)

  @jax.jit
  def micro_step(params, state, mb):
    scale = state.loss_scale.scale
    grads = jax.grad(lambda p: fp16_loss(p, mb).astype(jnp.float32) * scale)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  scales = []  # the scale after each micro-step, per window
  window_params = [params]
  for batch in data:
    scales.append([])
    for i in range(K):
      params, state = micro_step(params, state, ga.microbatch(batch, i, K))
      scales[-1].append(float(state.loss_scale.scale))
    window_params.append(params)
  # Constant inside a window; the k-th call applies the rule (as in the fused test above).
  assert scales == [
    [2.0**15] * 4,
    [2.0**15] * 4,
    [2.0**15] * 3 + [2.0**16],
    [2.0**16] * 3 + [2.0**15],
  ]
  assert int(state.num_skipped) == 1 and int(state.count) == 4
  assert_trees_close(window_params[4], window_params[3], rtol=0, atol=0)  # overflow: skipped

  ref = fp32_run(window_params[0], data[:3])
  for w in range(3):
    err = rel_err(
      displacement(window_params[w + 1], window_params[w]), displacement(ref[w + 1], ref[w])
    )
    assert err < 4 * FP16_U, (w, err)


@pytest.mark.slow
def test_fp16_loss_scaling_is_undone_exactly():
  """Without overflow the scaled update is the unscaled fp16 update (scaling by a power of two
  is exact in floating point, bar fp16 underflow of the unscaled gradient), and both are within
  fp16 tolerance of fp32."""
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(4), 16)
  ref = fp32_grad(params, batch)
  grads, metrics = {}, {}
  for name, scaling in (("scaled", loss_scale()), ("unscaled", None)):
    tx = ga.accumulate(capture(), K, loss_scale=scaling)
    _, state, metrics[name] = ga.train_step(loss_fn, tx, compute_dtype=jnp.float16)(
      params, tx.init(params), batch
    )
    assert bool(metrics[name]["updated"])
    grads[name] = state.inner_state
  err_scaled, err_unscaled = rel_err(grads["scaled"], ref), rel_err(grads["unscaled"], ref)
  diff = rel_err(grads["scaled"], grads["unscaled"])
  print(
    f"fp16: rel. error scaled {err_scaled:.2e}, unscaled {err_unscaled:.2e}, between {diff:.1e}"
  )
  assert err_scaled < 4 * FP16_U
  assert diff < 1e-5  # a forgotten or doubled unscale would be off by a factor of 2^15
  # The reported gradient norm is unscaled too.
  assert_trees_close(metrics["scaled"]["grad_norm"], optax.tree.norm(grads["scaled"]), rtol=1e-5)
