"""Weights, counting, inner-once, accumulator dtype, non-finite windows, randomness."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batch, max_abs_diff, mlp, xent_loss

import gradaccum_jax as ga

K = 4


# ----------------------------------------------------------------------------- weights


def token_batch(key, batch_size=16, seq=5, d_in=6, lengths=None):
  """Padded sequences: x (B, T, d), labels (B, T), mask (B, T) with varying lengths."""
  xk, yk, lk = jax.random.split(key, 3)
  if lengths is None:
    lengths = jax.random.randint(lk, (batch_size,), 1, seq + 1)
  mask = (jnp.arange(seq)[None, :] < jnp.asarray(lengths)[:, None]).astype(jnp.float32)
  return {
    "x": jax.random.normal(xk, (batch_size, seq, d_in)),
    "y": jax.random.randint(yk, (batch_size, seq), 0, 3),
    "mask": mask,
  }


def token_nll(params, batch):
  logp = jax.nn.log_softmax(mlp(params, batch["x"]))
  return -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1)[..., 0]


def token_mean_loss(params, batch):
  """Mean over the non-padding tokens of the (micro-)batch: 0/0 = NaN if it has none."""
  return jnp.sum(token_nll(params, batch) * batch["mask"]) / jnp.sum(batch["mask"])


def num_tokens(batch):
  return jnp.sum(batch["mask"])


@pytest.mark.slow
def test_the_token_mean_is_not_the_mean_of_micro_batch_means():
  """The weighted entry points' loss, gradient and update equal the whole batch's token mean,
  an empty micro-batch (0/0) adding nothing: tests/test_mode_matrix.py's weighted cells. Here:
  on very unequal lengths the unweighted mean of per-micro-batch means is measurably different,
  and the fused step's weight is the token count."""
  params = init_mlp(jax.random.key(0))
  # Very unequal lengths: micro-batch i holds rows i, i+4, ...
  lengths = jnp.array([1, 5, 2, 5, 1, 5, 3, 4, 1, 5, 2, 5, 1, 4, 1, 5])
  batch = token_batch(jax.random.key(1), lengths=lengths)
  ref_loss, ref_grads = jax.value_and_grad(token_mean_loss)(params, batch)
  bad_loss, bad_grads = ga.value_and_grad(token_mean_loss, K)(params, batch)
  assert abs(float(bad_loss) - float(ref_loss)) > 1e-3
  assert max_abs_diff(bad_grads, ref_grads) > 1e-3
  tx = ga.accumulate(optax.adam(1e-2), K)
  step = ga.train_step(token_mean_loss, tx, weight_fn=num_tokens)
  assert float(step(params, tx.init(params), batch)[2]["weight"]) == float(lengths.sum())


@pytest.mark.slow
def test_all_zero_weight_window_makes_no_update():
  params = init_mlp(jax.random.key(0))
  batch = token_batch(jax.random.key(3), lengths=jnp.zeros(16, jnp.int32))
  inner = optax.adam(1e-2)
  tx = ga.accumulate(inner, K)
  state0 = tx.init(params)
  step = ga.train_step(token_mean_loss, tx, weight_fn=num_tokens)
  new_params, state, metrics = step(params, state0, batch)
  assert_trees_close(new_params, params, rtol=0, atol=0)
  assert_trees_close(state.inner_state, state0.inner_state, rtol=0, atol=0)
  assert int(state.num_skipped) == 1 and int(state.count) == 1
  assert not bool(metrics["updated"]) and not bool(ga.has_updated(state))

  loss, grads = ga.value_and_grad(token_mean_loss, K, weight_fn=num_tokens)(params, batch)
  assert float(loss) == 0.0 and max_abs_diff(grads, jax.tree.map(jnp.zeros_like, grads)) == 0

  # Streaming: weight 0 on every micro-batch, NaN gradients.
  nan_grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
  state = state0
  for _ in range(K):
    updates, state = tx.update(nan_grads, state, params, weight=0.0)
  assert_trees_close(updates, jax.tree.map(jnp.zeros_like, params), rtol=0, atol=0)
  assert int(state.num_skipped) == 1


# ----------------------------------------------------------------------------- counting


@pytest.mark.slow
def test_schedules_and_counters_advance_once_per_window():
  params = init_mlp(jax.random.key(0))
  windows = 5
  schedule = optax.piecewise_constant_schedule(0.1, {1: 0.5, 3: 0.1})

  def make_inner():
    return optax.inject_hyperparams(optax.adam)(learning_rate=schedule)

  data = [make_batch(k, 16) for k in jax.random.split(jax.random.key(1), windows)]
  ref_params, ref_state = params, make_inner().init(params)
  for batch in data:
    g = jax.grad(xent_loss)(ref_params, batch)
    updates, ref_state = make_inner().update(g, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)

  tx = ga.accumulate(make_inner(), K)
  fused_params, fused_state = params, tx.init(params)
  step = ga.train_step(xent_loss, tx)
  stream_params, stream_state = params, tx.init(params)
  for batch in data:
    fused_params, fused_state, _ = step(fused_params, fused_state, batch)
    for i in range(K):
      g = jax.grad(xent_loss)(stream_params, ga.microbatch(batch, i, K))
      updates, stream_state = tx.update(g, stream_state, stream_params)
      stream_params = optax.apply_updates(stream_params, updates)

  for state, p in ((fused_state, fused_params), (stream_state, stream_params)):
    assert int(state.count) == windows
    assert int(state.inner_state.count) == windows  # inject_hyperparams' step counter
    assert int(state.inner_state.inner_state[0].count) == windows  # adam's count
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(
      float(schedule(windows - 1))
    )
    assert_trees_close(p, ref_params)


def counting(inner, counter):
  """Wraps ``inner`` so that every run-time execution of its update bumps ``counter``."""

  def bump():
    counter[0] += 1

  def update(updates, state, params=None):
    jax.debug.callback(bump)
    return inner.update(updates, state, params)

  return optax.GradientTransformation(inner.init, update)


@pytest.mark.slow
def test_inner_optimizer_runs_once_per_window():
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)
  windows = 3

  ours = [0]
  tx = ga.accumulate(counting(optax.adam(1e-2), ours), K)
  step = ga.train_step(xent_loss, tx)
  state = tx.init(params)
  for _ in range(windows):
    params, state, _ = step(params, state, batch)
  jax.effects_barrier()
  assert ours[0] == windows

  ours[0] = 0
  state = tx.init(params)
  micro = jax.jit(lambda g, s, p: tx.update(g, s, p))
  for _ in range(windows * K):
    _, state = micro(jax.grad(xent_loss)(params, batch), state, params)
  jax.effects_barrier()
  assert ours[0] == windows

  # The same counter sees optax.MultiSteps run its inner optimizer on every micro-step.
  theirs = [0]
  ms = optax.MultiSteps(counting(optax.adam(1e-2), theirs), every_k_schedule=K)
  ms_state = ms.init(params)
  ms_update = jax.jit(ms.update)
  for _ in range(windows * K):
    _, ms_state = ms_update(jax.grad(xent_loss)(params, batch), ms_state, params)
  jax.effects_barrier()
  assert theirs[0] == windows * K


def test_num_microbatches_schedule_in_streaming_mode():
  """k = 2 for the first window, then 3: windows close after micro-steps 2 and 5."""
  tx = ga.accumulate(optax.sgd(1.0), lambda count: jnp.where(count < 1, 2, 3))
  params = jnp.zeros(2)
  state = tx.init(params)
  grads = [jnp.array([float(i), 1.0]) for i in range(1, 6)]
  emitted = []
  for g in grads:
    updates, state = tx.update(g, state, params)
    emitted.append(bool(ga.has_updated(state)))
    if emitted[-1]:
      params = optax.apply_updates(params, updates)
  assert emitted == [False, True, False, False, True]
  # -(mean of 1,2) - (mean of 3,4,5) = -1.5 - 4; second coordinate -1 - 1.
  assert_trees_close(params, jnp.array([-5.5, -2.0]))


@pytest.mark.slow
def test_fused_step_closes_a_window_left_open_by_streaming_calls():
  params = init_mlp(jax.random.key(0))
  extra = make_batch(jax.random.key(5), 4)
  batch = make_batch(jax.random.key(6), 16)
  tx = ga.accumulate(optax.sgd(0.5), K)
  state = tx.init(params)
  _, state = tx.update(jax.grad(xent_loss)(params, extra), state, params)  # 1 pending micro-batch
  new_params, state, _ = ga.train_step(xent_loss, tx)(params, state, batch)
  # The window is the 5 micro-batches of 4 rows: the mean over all 20 rows.
  both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), extra, batch)
  ref = jax.grad(xent_loss)(params, both)
  assert_trees_close(new_params, jax.tree.map(lambda p, g: p - 0.5 * g, params, ref))
  assert int(state.micro_step) == 0 and int(state.count) == 1


# ----------------------------------------------------------------------------- dtypes


@pytest.mark.slow
def test_fp32_accumulator_beats_bf16_accumulation():
  k = 64
  params32 = init_mlp(jax.random.key(0), sizes=(6, 32, 3))
  params16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params32)
  batch = make_batch(jax.random.key(1), 8 * k)

  def loss_fn(p, mb):
    return xent_loss(p, {"x": mb["x"].astype(p["layer0"]["w"].dtype), "y": mb["y"]})

  # fp32 reference: the same (bf16-valued) params, computed in fp32 on the whole batch.
  ref = jax.grad(loss_fn)(jax.tree.map(lambda p: p.astype(jnp.float32), params16), batch)
  _, g_fp32acc = ga.value_and_grad(loss_fn, k)(params16, batch)
  _, g_bf16acc = ga.value_and_grad(loss_fn, k, accum_dtype=jnp.bfloat16)(params16, batch)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(g_fp32acc))

  def rel_err(g):
    num = sum(
      jnp.sum((a.astype(jnp.float32) - b) ** 2)
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref), strict=True)
    )
    return float(jnp.sqrt(num) / optax.tree.norm(ref))

  err32, err16 = rel_err(g_fp32acc), rel_err(g_bf16acc)
  assert err32 < 0.5 * err16, (err32, err16)

  # The accumulate state holds fp32 sums; the inner optimizer sees bf16 gradients.
  seen = {}

  def probe(updates, state, params=None):
    seen["dtypes"] = {g.dtype for g in jax.tree.leaves(updates)}
    return optax.sgd(0.1).update(updates, state, params)

  tx = ga.accumulate(optax.GradientTransformation(optax.sgd(0.1).init, probe), k)
  state = tx.init(params16)
  assert {a.dtype for a in jax.tree.leaves(state.acc_grads)} == {jnp.dtype(jnp.float32)}
  new_params, state, _ = ga.train_step(loss_fn, tx)(params16, state, batch)
  assert seen["dtypes"] == {jnp.dtype(jnp.bfloat16)}
  assert {p.dtype for p in jax.tree.leaves(new_params)} == {jnp.dtype(jnp.bfloat16)}
  assert {a.dtype for a in jax.tree.leaves(state.acc_grads)} == {jnp.dtype(jnp.float32)}


# ----------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("mode", ["fused", pytest.param("streaming", marks=pytest.mark.slow)])
def test_nonfinite_microbatch_voids_the_window(mode):
  params = init_mlp(jax.random.key(0))
  good = make_batch(jax.random.key(1), 16)
  bad = {"x": good["x"].at[5].set(jnp.nan), "y": good["y"]}  # row 5: micro-batch 1
  tx = ga.accumulate(optax.adam(1e-2), K)
  state0 = tx.init(params)

  if mode == "fused":
    step = ga.train_step(xent_loss, tx)

    def window(p, s, b):
      return step(p, s, b)[:2]
  else:

    def window(p, s, b):
      for i in range(K):
        g = jax.grad(xent_loss)(p, ga.microbatch(b, i, K))
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
      return p, s

  p1, s1 = window(params, state0, bad)
  assert_trees_close(p1, params, rtol=0, atol=0)
  assert_trees_close(s1.inner_state, state0.inner_state, rtol=0, atol=0)
  assert_trees_close(s1.acc_grads, state0.acc_grads, rtol=0, atol=0)
  assert int(s1.num_skipped) == 1 and int(s1.count) == 1 and not bool(ga.has_updated(s1))

  # Training goes on: the next window is exactly the first window of a fresh run.
  p2, s2 = window(p1, s1, good)
  ref_p, ref_s = window(params, state0, good)
  assert_trees_close(p2, ref_p, rtol=0, atol=0)
  assert_trees_close(s2.inner_state, ref_s.inner_state, rtol=0, atol=0)
  assert int(s2.num_skipped) == 1 and int(s2.count) == 2 and bool(ga.has_updated(s2))


def test_skip_nonfinite_false_lets_nan_through():
  params = init_mlp(jax.random.key(0))
  good = make_batch(jax.random.key(1), 16)
  bad = {"x": good["x"].at[5].set(jnp.inf), "y": good["y"]}
  tx = ga.accumulate(optax.sgd(0.1), K, skip_nonfinite=False)
  new_params, state, _ = ga.train_step(xent_loss, tx)(params, tx.init(params), bad)
  assert not all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(new_params))
  assert int(state.num_skipped) == 0


# ----------------------------------------------------------------------------- randomness


def noisy_loss(params, mb, rng):
  """A dropout-like loss: what it computes depends on the key."""
  keep = jax.random.bernoulli(rng, 0.7, mb["x"].shape)
  return xent_loss(params, {"x": mb["x"] * keep / 0.7, "y": mb["y"]})


@pytest.mark.slow
def test_each_microbatch_gets_fold_in_of_its_index():
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)
  rng = jax.random.key(42)
  ref = [
    jax.value_and_grad(noisy_loss)(params, ga.microbatch(batch, i, K), jax.random.fold_in(rng, i))
    for i in range(K)
  ]
  ref_loss = sum(r[0] for r in ref) / K
  ref_grads = jax.tree.map(lambda *g: sum(g) / K, *[r[1] for r in ref])

  vg = ga.value_and_grad(noisy_loss, K)
  loss, grads = vg(params, batch, rng=rng)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)
  loss_again, _ = vg(params, batch, rng=rng)
  assert float(loss_again) == float(loss)  # deterministic for a key
  other, _ = vg(params, batch, rng=jax.random.key(43))
  assert float(other) != float(loss)

  tx = ga.accumulate(optax.sgd(0.1), K)
  step = ga.train_step(noisy_loss, tx)
  p1, _, m1 = step(params, tx.init(params), batch, rng=rng)
  assert_trees_close(m1["loss"], ref_loss)
  assert_trees_close(p1, jax.tree.map(lambda p, g: p - 0.1 * g, params, ref_grads))
  # Raw uint32 keys work too.
  _, _, m_raw = step(params, tx.init(params), batch, rng=jax.random.PRNGKey(0))
  assert np.isfinite(float(m_raw["loss"]))
