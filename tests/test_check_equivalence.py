"""ga.check_equivalence: the verdict against independent references, and the hints."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import init_mlp, make_batch, mlp, xent_loss
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

V, T, D = 11, 7, 8  # vocabulary, sequence length, embedding width


def init_lm(key):
  ek, ok = jax.random.split(key)
  return {"emb": jax.random.normal(ek, (V, D)), "out": jax.random.normal(ok, (D, V)) / D**0.5}


def token_batch(key, batch_size):
  """Sequences of very different lengths, padded with token 0 and masked."""
  tk, lk = jax.random.split(key)
  tokens = jax.random.randint(tk, (batch_size, T + 1), 1, V)
  lengths = jax.random.randint(lk, (batch_size,), 1, T + 1)
  mask = jnp.arange(T)[None, :] < lengths[:, None]
  return {"x": jnp.where(mask, tokens[:, :-1], 0), "y": tokens[:, 1:], "mask": mask}


def token_xent(params, batch):
  """Per-token cross-entropy, averaged over the unmasked tokens of the (micro-)batch."""
  logits = jnp.tanh(params["emb"][batch["x"]]) @ params["out"]
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1)[..., 0]
  return jnp.sum(nll * batch["mask"]) / jnp.sum(batch["mask"])


def count_tokens(mb):
  return jnp.sum(mb["mask"])


def rows(batch, i, k):
  """Micro-batch i of ga's documented order, by plain slicing: rows i, i + k, ..."""
  return jax.tree.map(lambda x: x[i::k], batch)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 4])
def test_ok_for_a_per_example_mean(k):
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)
  report = ga.check_equivalence(xent_loss, params, batch, k)
  assert report.ok and report.cause is None and report.reason is None
  loss = jax.value_and_grad(xent_loss)(params, batch)[0]
  np.testing.assert_allclose(report.loss_whole, loss, rtol=1e-6)
  np.testing.assert_allclose(report.loss_accumulated, loss, rtol=1e-5)
  means = [float(xent_loss(params, rows(batch, i, k))) for i in range(k)]
  np.testing.assert_allclose(report.mean_of_means_loss, np.mean(means), rtol=1e-6)
  assert report.loss_rel_error <= 1e-5 and report.max_rel_grad_error <= 1e-5
  assert report.mean_of_means_error <= 1e-5  # equal-sized micro-batches: the naive mean is exact
  assert "equivalent (rtol=1e-05)" in str(report) and "NOT" not in str(report)


@pytest.mark.slow
def test_flags_a_token_mean_without_weight_fn_and_passes_with_it():
  params, batch, k = init_lm(jax.random.key(0)), token_batch(jax.random.key(1), 8), 4
  report = ga.check_equivalence(token_xent, params, batch, k)
  assert not report.ok
  assert report.cause == "weighting"
  assert "weight_fn=lambda mb: mb['mask'].sum()" in report.reason
  # The weights that rebuild the whole batch are the micro-batches' shares of the tokens.
  counts = np.array([float(rows(batch, i, k)["mask"].sum()) for i in range(k)])
  np.testing.assert_allclose(report.fitted_weights, counts / counts.sum(), atol=1e-4)
  # Unweighted accumulation is the naive mean of micro-batch means, computed here by slicing.
  means = [float(token_xent(params, rows(batch, i, k))) for i in range(k)]
  np.testing.assert_allclose(report.loss_accumulated, np.mean(means), rtol=1e-5)
  np.testing.assert_allclose(report.mean_of_means_loss, np.mean(means), rtol=1e-6)
  assert report.mean_of_means_error > 1e-3
  text = str(report)
  assert "NOT equivalent" in text and "likely reason (weighting)" in text
  assert "weight_fn=lambda mb: mb['mask'].sum()" in text  # not broken across lines

  fixed = ga.check_equivalence(token_xent, params, batch, k, weight_fn=count_tokens)
  assert fixed.ok, str(fixed)
  assert fixed.weighted and fixed.mean_of_means_error > 1e-3  # the naive mean still drifts


@pytest.mark.slow
def test_names_an_ignore_index_count():
  params, batch, k = init_lm(jax.random.key(2)), token_batch(jax.random.key(3), 8), 2
  labels = jnp.where(batch["mask"], batch["y"], -100)  # no mask leaf: labels -100 are ignored
  batch = {"x": batch["x"], "y": labels}

  def loss_fn(params, batch):
    valid = batch["y"] >= 0
    return token_xent(
      params, {"x": batch["x"], "y": jnp.where(valid, batch["y"], 0), "mask": valid}
    )

  report = ga.check_equivalence(loss_fn, params, batch, k)
  assert report.cause == "weighting"
  assert "weight_fn=lambda mb: (mb['y'] >= 0).sum()" in report.reason
  ok = ga.check_equivalence(loss_fn, params, batch, k, weight_fn=lambda mb: (mb["y"] >= 0).sum())
  assert ok.ok


@pytest.mark.slow
def test_flags_a_weight_fn_that_counts_the_wrong_thing():
  params, batch = init_lm(jax.random.key(0)), token_batch(jax.random.key(1), 8)
  report = ga.check_equivalence(
    token_xent, params, batch, 4, weight_fn=lambda mb: mb["mask"].shape[0] * 1.0
  )
  assert not report.ok and report.cause == "weighting"
  assert report.reason.startswith("weight_fn's weights are not proportional")


def standardized_loss(params, batch):
  """BatchNorm-like: the features are standardized with the batch's own mean and std."""
  x = batch["x"]
  x = (x - jnp.mean(x, axis=0)) / (jnp.std(x, axis=0) + 1e-5)
  return xent_loss(params, {**batch, "x": x})


@pytest.mark.slow
@pytest.mark.parametrize("weight_fn", [None, lambda mb: mb["x"].shape[0] * 1.0])
def test_flags_batch_dependence(weight_fn):
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)
  report = ga.check_equivalence(standardized_loss, params, batch, 4, weight_fn=weight_fn)
  assert not report.ok
  assert report.cause == "batch_dependence", str(report)
  assert "BatchNorm" in report.reason and report.fitted_weights is None
  # The same layer with fixed (running) statistics is per-example, hence exact.
  mu, sd = jnp.mean(batch["x"], axis=0), jnp.std(batch["x"], axis=0)

  def eval_mode(params, batch):
    return xent_loss(params, {**batch, "x": (batch["x"] - mu) / sd})

  assert ga.check_equivalence(eval_mode, params, batch, 4).ok


def dropout_loss(params, batch, key):
  keep = jax.random.bernoulli(key, 0.8, batch["x"].shape)
  return xent_loss(params, {**batch, "x": batch["x"] * keep / 0.8})


@pytest.mark.slow
def test_flags_randomness_from_a_key():
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)
  report = ga.check_equivalence(dropout_loss, params, batch, 4, rng=jax.random.key(3))
  assert not report.ok and report.cause == "randomness"
  assert "deterministic" in report.reason
  # A loss that takes a key but ignores it is deterministic, and exact.
  ignores = lambda p, b, key: xent_loss(p, b)  # noqa: E731
  assert ga.check_equivalence(ignores, params, batch, 4, rng=jax.random.key(3)).ok


@pytest.mark.slow
def test_flags_randomness_from_side_effects():
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)
  noise = np.random.default_rng(0)

  def noisy(params, batch):  # a new draw at each trace and each eager call
    return xent_loss(params, batch) + 0.1 * noise.standard_normal()

  report = ga.check_equivalence(noisy, params, batch, 4)
  assert not report.ok and report.cause == "randomness"


@pytest.mark.slow
def test_has_aux():
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)

  def loss_aux(params, batch):
    logits = mlp(params, batch["x"])
    return xent_loss(params, batch), {"correct": jnp.sum(jnp.argmax(logits, -1) == batch["y"])}

  assert ga.check_equivalence(loss_aux, params, batch, 4, has_aux=True).ok


@pytest.mark.slow
def test_too_few_parameters_to_tell():
  def loss_fn(w, batch):  # 2 parameters, k = 4: any 4 micro-batches fit 3 numbers
    err = (batch["x"] * w[0] + w[1] - batch["y"]) ** 2
    return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])

  batch = token_batch(jax.random.key(1), 8)
  batch = {"x": batch["x"] / V, "y": batch["y"] / V, "mask": batch["mask"]}
  report = ga.check_equivalence(loss_fn, jnp.array([0.5, -0.3]), batch, 4)
  assert not report.ok and report.cause == "unknown"
  assert "too few parameters" in report.reason


def mesh_8():
  return jax.make_mesh((8,), ("data",))


@pytest.mark.slow
def test_on_a_mesh():
  mesh = mesh_8()
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 32)
  assert ga.check_equivalence(xent_loss, params, batch, 2, mesh=mesh, data_axis="data").ok

  lm, tokens = init_lm(jax.random.key(0)), token_batch(jax.random.key(1), 32)
  flagged = ga.check_equivalence(token_xent, lm, tokens, 2, mesh=mesh)
  assert not flagged.ok and flagged.cause == "weighting"
  assert "mb['mask'].sum()" in flagged.reason
  # Already sharded inputs are fine too.
  sharded = jax.device_put(tokens, NamedSharding(mesh, P("data")))
  fixed = ga.check_equivalence(token_xent, lm, sharded, 2, weight_fn=count_tokens, mesh=mesh)
  assert fixed.ok, str(fixed)


def test_report_labels_each_error():
  """str and repr say which relative error is the loss's and which the gradient's."""
  report = ga.EquivalenceReport(
    ok=False, num_microbatches=2, weighted=False, rtol=1e-5, loss_whole=2.0,
    loss_accumulated=2.5, loss_rel_error=0.25, max_rel_grad_error=0.125,
    mean_of_means_loss=2.5, mean_of_means_error=0.5,
  )  # fmt: skip
  lines = str(report).splitlines()
  assert re.fullmatch(
    r"  loss relative error +2\.50e-01 \(whole batch 2, accumulated 2\.5\)", lines[1]
  )
  assert re.match(
    r"  gradient relative error +1\.25e-01 \(largest \|accumulated - whole\|", lines[2]
  )
  assert re.match(
    r"  naive mean of micro-batch means: loss 2\.5, relative error 5\.00e-01", lines[3]
  )
  assert lines[3].endswith("(the larger of loss and gradient)")
  assert "loss_rel_error=0.25" in repr(report) and "max_rel_grad_error=0.125" in repr(report)


@pytest.mark.slow
def test_report_is_frozen():
  params = init_mlp(jax.random.key(0))
  report = ga.check_equivalence(xent_loss, params, make_batch(jax.random.key(1), 8), 2)
  with pytest.raises(dataclasses.FrozenInstanceError):
    report.ok = False


@pytest.mark.parametrize(
  "k, kwargs, error, match",
  [
    (
      3,
      {},
      ValueError,
      r"batch size B=16 is not divisible by num_microbatches k=3.*divisors: 1, 2, 4, 8, 16\)",
    ),
    (0, {}, ValueError, r"num_microbatches=0"),
    (2.0, {}, TypeError, r"num_microbatches=2.0 must be a positive int"),
    (True, {}, TypeError, r"num_microbatches=True must be a positive int"),
    (2, {"rtol": 0.0}, ValueError, r"rtol=0.0"),
    (2, {"rtol": "1e-5"}, TypeError, r"rtol must be a positive float, got '1e-5'"),
    (2, {"data_axis": "data"}, ValueError, r"data_axis= needs mesh="),
  ],
)
def test_bad_arguments(k, kwargs, error, match):
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)
  with pytest.raises(error, match=match):
    ga.check_equivalence(xent_loss, params, batch, k, **kwargs)


def test_bad_batch_and_loss_fn():
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)
  with pytest.raises(ValueError, match=r"\['x'\]: 16, \['y'\]: 8"):
    ga.check_equivalence(xent_loss, params, {"x": batch["x"], "y": batch["y"][:8]}, 2)
  with pytest.raises(TypeError, match="loss_fn must be a function"):
    ga.check_equivalence("xent", params, batch, 2)
  with pytest.raises(ValueError, match=r"B=16 is not divisible by 32 = 8 devices .* k=4"):
    ga.check_equivalence(xent_loss, params, batch, 4, mesh=mesh_8())
  with pytest.raises(ValueError, match=r"data_axis='batch' names 'batch'"):
    ga.check_equivalence(xent_loss, params, batch, 2, mesh=mesh_8(), data_axis="batch")


# --- ga.check_step: one window of a built step against the single-device whole batch ----------

C, K = 5, 4  # classes; micro-batches per window


def init_shifted(key):
  k1, k2 = jax.random.split(key)
  w1 = jax.random.normal(k1, (6, 16)) / 6**0.5
  return {"w1": w1, "w2": jax.random.normal(k2, (16, C)) / 4, "shift": jnp.full((1,), 0.3)}


def shifted_xent(params, batch):
  """Cross-entropy of logits plus one shift added to every logit. The softmax ignores the shift,
  so its true gradient is 0, as an attention key bias's is: sum_c (softmax_c - onehot_c) = 0."""
  logits = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] + params["shift"]
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


SHIFTED = init_shifted(jax.random.key(0))
CLS_BATCH = make_batch(jax.random.key(1), 32, num_classes=C)


def fused(inner, loss_fn=shifted_xent, params=SHIFTED, batch=CLS_BATCH, **kwargs):
  """``check_step`` of ``ga.train_step(loss_fn, ga.accumulate(inner, K))`` against
  ``shifted_xent`` and ``inner``."""
  tx = ga.accumulate(inner, K)
  step = ga.train_step(loss_fn, tx, **kwargs)
  return ga.check_step(step, shifted_xent, inner, params, tx.init(params), batch)


def scaled(loss_fn, factor):
  return lambda p, b: factor * loss_fn(p, b)


@pytest.mark.slow
def test_check_step_allows_a_rounding_of_the_params_below_rtol_of_a_small_update():
  """Adam at lr 1e-5 on params near 1: rtol of the update (1e-9) is below float32's resolution of
  the params (1.2e-7). A step whose update differs from the reference's by 5e-5 of it (another
  fusion or summation order) rounds some new params the other way, one ulp apart: not a
  difference (the gradient is still read from Adam's moments), where twice the update is."""
  n, inner = 4096, optax.adam(1e-5)
  params = {"w": jnp.linspace(0.5, 1.0, n)}
  rng = np.random.default_rng(0)
  batch = {"x": rng.standard_normal((16, n)).astype(np.float32), "y": np.ones(16, np.float32)}

  def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] / n - b["y"]) ** 2)

  def step_off_by(factor):
    @jax.jit
    def step(p, s, b):
      u, s = inner.update(jax.grad(loss)(p, b), s, p)
      return jax.tree.map(lambda p, u: p + u * factor, p, u), s

    return ga.check_step(step, loss, inner, params, inner.init(params), batch)

  rounded = step_off_by(1 + 5e-5)
  assert rounded.ok and max(rounded.max_abs.values()) > rounded.rtol * rounded.scale, str(rounded)
  assert not step_off_by(2.0).ok


@pytest.mark.slow
def test_check_step_has_no_false_alarm_for_adam_on_a_zero_gradient_leaf():
  g = jax.grad(shifted_xent)(SHIFTED, CLS_BATCH)
  assert abs(float(g["shift"][0])) <= 1e-6 * float(jnp.max(jnp.abs(g["w2"])))  # 0, rounded
  result = fused(optax.adam(1e-3))
  assert result.ok, str(result)
  # Adam turns the shift's rounding noise into an update of about lr: the updates differ there,
  # the gradients do not.
  assert result.max_rel["['shift']"] > 10 * result.rtol, str(result)
  assert result.optimizer_noise == ("['shift']",)
  assert result.max_rel_grad_error <= 1e-5 and result.grad_norm_rel <= 1e-5
  assert set(result.grad_rel) == set(result.max_rel) and "mu" in result.compared
  text = str(result)
  assert "~ optimizer noise" in text and "NOT" not in text and "<- differs" not in text
  # The same step against another learning rate: the gradients agree, the updates do not.
  tx = ga.accumulate(ADAM, K)
  step = ga.train_step(shifted_xent, tx)
  other = ga.check_step(step, shifted_xent, optax.adam(2e-3), SHIFTED, tx.init(SHIFTED), CLS_BATCH)
  assert not other.ok and other.max_rel_grad_error <= 1e-5, str(other)
  assert other.reason.startswith("the update differs by more than inner_tx makes of a gradient")
  np.testing.assert_allclose(other.max_rel["['w1']"], 0.5, rtol=1e-3)  # lr against 2 lr
  # SGD reads the gradient from its update (-lr times it): the same verdict, the same errors.
  sgd = fused(optax.sgd(0.1))
  assert sgd.ok and "-0.1 times the gradient" in sgd.compared, str(sgd)
  assert sgd.grad_rel == pytest.approx(sgd.max_rel, rel=1e-3, abs=1e-9)


WARM_UP = optax.linear_schedule(0.0, 1e-3, 10)
ADAM = optax.adam(1e-3)


@pytest.mark.slow
def test_check_step_judges_a_zero_reference_update_by_the_gradient_or_flags_it():
  # The warm-up's first learning rate is 0: the reference update is 0 on every entry.
  u, _ = optax.adam(WARM_UP).update(SHIFTED, optax.adam(WARM_UP).init(SHIFTED), SHIFTED)
  assert not any(bool(jnp.any(x != 0)) for x in jax.tree.leaves(u))
  exact = fused(optax.adam(WARM_UP))
  assert exact.ok and exact.scale == 0.0 and exact.max_rel_grad_error <= 1e-5, str(exact)
  assert "judged by the gradient" in str(exact)
  doubled = fused(optax.adam(WARM_UP), scaled(shifted_xent, 2.0))
  assert not doubled.ok and doubled.scale == 0.0, str(doubled)
  np.testing.assert_allclose(doubled.max_rel_grad_error, 1.0, rtol=1e-4)  # 2 g against g
  # SGD keeps no moment and its update (0) says nothing of the gradient: flagged.
  sgd = fused(optax.sgd(optax.linear_schedule(0.0, 0.1, 10)))
  assert not sgd.ok and sgd.reason.startswith("the reference update is 0"), str(sgd)
  assert sgd.grad_rel == {} and sgd.compared == "metrics['grad_norm']"


def microbatch_means(loss_fn, params, batch, weights=None):
  """The weighted mean of the micro-batches' gradients (rows i, i + K, ...), by slicing."""
  grads = [jax.grad(loss_fn)(params, rows(batch, i, K)) for i in range(K)]
  w = np.ones(K) if weights is None else np.asarray(weights, np.float64)
  return jax.tree.map(
    lambda *g: sum(wi * gi for wi, gi in zip(w, g, strict=True)) / w.sum(), *grads
  )


def rel_error(grads, whole):
  """The largest entry of ``|grads - whole|`` over the largest of ``|whole|``."""
  diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grads, whole)
  return max(jax.tree.leaves(diffs)) / max(
    float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(whole)
  )


def clip(tree, c):
  return jax.tree.map(lambda g: g * min(1.0, c / float(optax.tree.norm(tree))), tree)


def streaming_step(loss_fn, tx):
  """A hand-written window: ``tx.update`` once per micro-batch, in one jitted call."""

  @jax.jit
  def step(params, opt_state, batch):
    for i in range(K):
      updates, opt_state = tx.update(
        jax.grad(loss_fn)(params, rows(batch, i, K)), opt_state, params
      )
      params = optax.apply_updates(params, updates)
    return params, opt_state

  return step


def averaging_twice(loss_fn, inner):
  """A hand-written window that divides the micro-batches' summed gradient by K twice."""

  @jax.jit
  def step(params, opt_state, batch):
    total = microbatch_means(loss_fn, params, batch)
    updates, opt_state = inner.update(jax.tree.map(lambda g: g / K, total), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


@pytest.mark.slow
@pytest.mark.parametrize("inner", [optax.adam(1e-3), optax.sgd(0.1)], ids=["adam", "sgd"])
def test_check_step_catches_a_gradient_scaled_or_reduced_twice(inner):
  times_k = fused(inner, scaled(shifted_xent, float(K)))
  assert not times_k.ok and "reduced twice" in times_k.reason, str(times_k)
  np.testing.assert_allclose(times_k.max_rel_grad_error, K - 1, rtol=1e-4)  # K g against g
  np.testing.assert_allclose(times_k.grad_norm_rel, K - 1, rtol=1e-4)
  step = averaging_twice(shifted_xent, inner)
  twice = ga.check_step(step, shifted_xent, inner, SHIFTED, inner.init(SHIFTED), CLS_BATCH)
  assert not twice.ok and twice.grad_norm_rel is None, str(twice)
  np.testing.assert_allclose(twice.max_rel_grad_error, 1 - 1 / K, rtol=1e-4)  # g / K against g
  assert "<- differs" in str(twice) and "NOT equivalent" in str(twice)


@pytest.mark.slow
def test_check_step_catches_a_mean_of_micro_batch_means_under_adam():
  params, batch, inner = init_lm(jax.random.key(0)), token_batch(jax.random.key(1), 8), ADAM
  counts = [float(rows(batch, i, K)["mask"].sum()) for i in range(K)]
  assert len(set(counts)) > 1  # uneven token counts
  tx = ga.accumulate(inner, K)
  step = ga.train_step(token_xent, tx)
  plain = ga.check_step(step, token_xent, inner, params, tx.init(params), batch)
  assert not plain.ok, str(plain)
  whole = jax.grad(token_xent)(params, batch)
  expected = rel_error(microbatch_means(token_xent, params, batch), whole)
  assert expected > 1e-3
  np.testing.assert_allclose(plain.max_rel_grad_error, expected, rtol=1e-3)
  assert rel_error(microbatch_means(token_xent, params, batch, counts), whole) < 1e-5
  step = ga.train_step(token_xent, tx, weight_fn=count_tokens)
  weighted = ga.check_step(step, token_xent, inner, params, tx.init(params), batch)
  assert weighted.ok and weighted.max_rel_grad_error <= 1e-5, str(weighted)


@pytest.mark.slow
def test_check_step_catches_clipping_per_micro_batch():
  per_micro = [jax.grad(shifted_xent)(SHIFTED, rows(CLS_BATCH, i, K)) for i in range(K)]
  c = 0.5 * min(float(optax.tree.norm(g)) for g in per_micro)  # clips every one of them
  inner = optax.chain(optax.clip_by_global_norm(c), optax.adam(1e-3))
  after = fused(inner)
  assert after.ok, str(after)
  tx = optax.chain(optax.clip_by_global_norm(c), ga.accumulate(optax.adam(1e-3), K))
  step = streaming_step(shifted_xent, tx)
  before = ga.check_step(step, shifted_xent, inner, SHIFTED, tx.init(SHIFTED), CLS_BATCH)
  assert not before.ok and "clipped" in before.reason, str(before)
  whole = clip(jax.grad(shifted_xent)(SHIFTED, CLS_BATCH), c)
  mean = jax.tree.map(lambda *g: sum(g) / K, *(clip(g, c) for g in per_micro))
  np.testing.assert_allclose(before.max_rel_grad_error, rel_error(mean, whole), rtol=1e-3)


class NnxNet(nnx.Module):
  """shifted_xent's model in NNX."""

  def __init__(self, seed=0):
    rngs = nnx.Rngs(seed)
    self.hidden, self.out = nnx.Linear(6, 16, rngs=rngs), nnx.Linear(16, C, rngs=rngs)
    self.shift = nnx.Param(jnp.full((1,), 0.3))

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x))) + self.shift


class LinenNet(nn.Module):
  """shifted_xent's model in Linen."""

  @nn.compact
  def __call__(self, x):
    shift = self.param("shift", lambda key: jnp.full((1,), 0.3))
    return nn.Dense(C)(jnp.tanh(nn.Dense(16)(x))) + shift


def logits_xent(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def nnx_xent(model, batch):
  return logits_xent(model(batch["x"]), batch)


def linen_xent(params, batch):
  return logits_xent(LinenNet().apply({"params": params}, batch["x"]), batch)


def front_end(kind, inner, factor=1.0):
  """``(step, loss_fn, arguments)`` for check_step; the step's loss is ``factor`` times its."""
  tx = ga.accumulate(inner, K)
  if kind == "nnx":
    model = NnxNet()
    step = ga.nnx_train_step(scaled(nnx_xent, factor), donate=True)
    return step, nnx_xent, (model, nnx.Optimizer(model, tx, wrt=nnx.Param), CLS_BATCH)
  if kind == "linen":
    params = LinenNet().init(jax.random.key(0), CLS_BATCH["x"][:1])["params"]
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    return ga.linen_train_step(LinenNet(), scaled(logits_xent, factor)), linen_xent, (ts, CLS_BATCH)
  loss_fn = scaled(shifted_xent, factor)
  if kind == "train_step":
    step = ga.train_step(loss_fn, tx, donate=True)
  elif kind == "micro_step":
    step = ga.micro_step(loss_fn, tx, donate=True)
  else:  # your own: tx.update once per micro-batch
    step = streaming_step(loss_fn, tx)
  return step, shifted_xent, (SHIFTED, tx.init(SHIFTED), CLS_BATCH)


def host_copy(args):
  if isinstance(args[0], nnx.Module):
    args = nnx.state(args[:2]), args[2]
  return [np.asarray(x) for x in jax.tree.leaves(args)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["train_step", "micro_step", "linen", "nnx", "own_streaming"])
def test_check_step_takes_every_front_end(kind):
  step, loss_fn, args = front_end(kind, ADAM)
  before = host_copy(args)
  result = ga.check_step(step, loss_fn, ADAM, *args)
  assert result.ok and "mu" in result.compared and result.max_rel_grad_error <= 1e-5, str(result)
  assert (result.grad_norm_rel is None) == (kind == "own_streaming")  # ga's steps report it
  assert len(result.max_rel) == (3 if kind in ("train_step", "micro_step", "own_streaming") else 5)
  assert [s for s in result.optimizer_noise if "shift" in s], str(result)  # adam's noise, excused
  for a, b in zip(host_copy(args), before, strict=True):  # the step ran on copies
    np.testing.assert_array_equal(a, b)
  step, loss_fn, args = front_end(kind, ADAM, factor=2.0)
  doubled = ga.check_step(step, loss_fn, ADAM, *args)
  assert not doubled.ok and "<- differs" in str(doubled), str(doubled)
  np.testing.assert_allclose(doubled.max_rel_grad_error, 1.0, rtol=1e-4)  # 2 g against g


def test_check_step_refuses_what_it_cannot_check_and_says_what_to_pass():
  inner, tx = ADAM, ga.accumulate(ADAM, K)
  model = NnxNet()
  with pytest.raises(TypeError, match=r"An NNX model's step takes \(model, optimizer, batch\)"):
    ga.check_step(ga.nnx_train_step(nnx_xent), nnx_xent, inner, model, tx.init(SHIFTED), CLS_BATCH)
  linen_step, _, (ts, batch) = front_end("linen", inner)
  with pytest.raises(TypeError, match=r"A TrainState's step takes \(train_state, batch\)"):
    ga.check_step(linen_step, linen_xent, inner, ts, ts.opt_state, batch)
  with pytest.raises(TypeError, match="train_state.tx must be made by ga.accumulate") as err:
    ga.check_step(linen_step, linen_xent, inner, ts.params, ts.opt_state, batch)
  assert "(..., train_state, batch) for ga.linen_train_step" in " ".join(err.value.__notes__)
  stateful = ga.micro_step(lambda p, s, mb: (shifted_xent(p, mb), s), tx, has_state=True)
  with pytest.raises(ValueError, match=r"has_state=True\. Check the same loss with"):
    ga.check_step(stateful, shifted_xent, inner, SHIFTED, tx.init(SHIFTED), CLS_BATCH)
  step = ga.train_step(shifted_xent, tx)
  with pytest.raises(TypeError, match=r"batch is missing: check_step calls the step as you pass"):
    ga.check_step(step, shifted_xent, inner, SHIFTED, tx.init(SHIFTED))
  _, inside = tx.update(SHIFTED, tx.init(SHIFTED), SHIFTED)  # one micro-batch of K
  with pytest.raises(ValueError, match=r"open window \(micro_step=1\), whose sums"):
    ga.check_step(step, shifted_xent, inner, SHIFTED, inside, CLS_BATCH)


def test_step_check_report_shows_the_gradient_beside_the_update():
  paths = ("['a']", "['b']", "['c']")
  check = ga.StepCheck(
    ok=False, rtol=1e-4, scale=1e-3, max_abs=dict(zip(paths, (2e-4, 5e-5, 0.0), strict=True)),
    max_rel=dict(zip(paths, (0.2, 0.05, 0.0), strict=True)),
    grad_rel=dict(zip(paths, (1e-7, 0.5, 0.0), strict=True)), grad_norm_rel=0.25,
    max_rel_grad_error=0.5, compared="the inner optimizer's new state ([0].mu)",
    optimizer_noise=("['a']",), reason="the step's gradient is not the whole batch's.",
  )  # fmt: skip
  lines = str(check).splitlines()
  assert lines[0].endswith(": NOT equivalent (rtol=0.0001)")
  assert lines[1] == (
    "  gradient: relative error 5.000e-01, from the inner optimizer's new state ([0].mu)"
  )
  assert lines[2] == "  update:   relative error 2.000e-01 of the largest reference update, 0.001"

  def row(leaf, grad, max_abs, rel, flag):
    grad, max_abs, rel = map(re.escape, (grad, max_abs, rel))
    return rf"  \['{leaf}'\] +gradient +{grad}  update max abs {max_abs}  relative {rel}{flag}"

  rows = [
    row("a", "1.000e-07", "2.000e-04", "2.000e-01", "  ~ optimizer noise"),
    row("b", "5.000e-01", "5.000e-05", "5.000e-02", "  <- differs"),  # the gradient differs
    row("c", "0.000e+00", "0.000e+00", "0.000e+00", ""),
  ]
  for pattern, line in zip(rows, lines[3:6], strict=True):
    assert re.fullmatch(pattern, line), line
  assert lines[6] == "  the step's gradient is not the whole batch's."
  assert lines[7].startswith("  ~ optimizer noise: the update differs where the gradient is")
  # Made as before (five fields), the gradient is not read and the rows show none.
  old = ga.StepCheck(True, 1e-4, 1e-3, {"['a']": 0.0}, {"['a']": 0.0})
  assert "gradient: not read, from nothing" in str(old)
  assert re.search(r"\['a'\] +gradient +-  update", str(old))


# --- check_step never calls a wrong step equivalent (issue 60) ---------------------------------

OPTIMIZERS = {
  "sgd": lambda: optax.sgd(0.1),
  "momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "adam": lambda: optax.adam(1e-2),
  "adamw": lambda: optax.adamw(1e-2),
  "lion": lambda: optax.lion(1e-3),
  "adafactor": lambda: optax.adafactor(1e-2),
}
WARM = optax.linear_schedule(0.1, 1.0, 10)  # a warm-up: a step counted late moves further


def multisteps_loop(tx, loss_fn=token_xent, k=K):
  """The commonest hand-written accumulation: ``tx`` (``optax.MultiSteps`` inside) updated on
  each micro-batch's mean loss, in one jitted call."""

  @jax.jit
  def step(params, state, batch):
    for i in range(k):
      updates, state = tx.update(jax.grad(loss_fn)(params, rows(batch, i, k)), state, params)
      params = optax.apply_updates(params, updates)
    return params, state

  return step


def reduced_twice(inner):
  """A data-parallel step that sums the 8 devices' mean gradients (a psum where a pmean is due)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

  def local(params, batch):
    return jax.lax.psum(jax.grad(token_xent)(params, batch), "data")

  grads = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())

  @jax.jit
  def step(params, state, batch):
    updates, state = inner.update(grads(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  return step


def wrong_step(name, inner, params, batch):
  """``(step, its state, the optimizer the user believes it applies)`` of a wrong step."""
  if name == "mean_of_means":  # uneven token counts, each micro-batch's mean weighed alike
    tx = optax.MultiSteps(inner, every_k_schedule=K)
    return multisteps_loop(tx), tx.init(params), inner
  if name == "clipped_per_micro_batch":  # the clip before MultiSteps sees each micro-batch
    g = [jax.grad(token_xent)(params, rows(batch, i, K)) for i in range(K)]
    c = 0.5 * min(float(optax.tree.norm(x)) for x in g)
    tx = optax.chain(optax.clip_by_global_norm(c), optax.MultiSteps(inner, every_k_schedule=K))
    return multisteps_loop(tx), tx.init(params), optax.chain(optax.clip_by_global_norm(c), inner)
  if name == "schedule_counts_micro_steps":  # the schedule outside MultiSteps counts its calls
    tx = optax.chain(optax.MultiSteps(inner, every_k_schedule=K), optax.scale_by_schedule(WARM))
    return multisteps_loop(tx), tx.init(params), optax.chain(inner, optax.scale_by_schedule(WARM))
  return reduced_twice(inner), inner.init(params), inner


def slow_but(values, fast):
  """``values`` as parameters, all but ``fast`` in the slow tier."""
  return [v if v == fast else pytest.param(v, marks=pytest.mark.slow) for v in values]


@pytest.mark.parametrize("opt", slow_but(OPTIMIZERS, "adam"))
@pytest.mark.parametrize(
  "name",
  ["mean_of_means", "clipped_per_micro_batch", "schedule_counts_micro_steps", "reduced_twice"],
)
def test_check_step_never_calls_a_wrong_step_equivalent(name, opt):
  """Wrong steps users write, under every optimizer: flagged, or "not verified" where the
  gradient cannot be seen; never "equivalent" (before: MultiSteps(adam) averaging token means
  was "equivalent; gradient: not read", its acc_grads beside mu and nu hiding them)."""
  params, batch = init_lm(jax.random.key(0)), token_batch(jax.random.key(1), 16)
  step, state, believed = wrong_step(name, OPTIMIZERS[opt](), params, batch)
  check = ga.check_step(step, token_xent, believed, params, state, batch)
  assert not check.ok and check.verdict in ("NOT equivalent", "not verified"), str(check)
  assert check.verdict in str(check).splitlines()[0]
  if name == "mean_of_means" and opt in ("adam", "adamw", "lion", "momentum"):
    assert check.verdict == "NOT equivalent" and "inner_opt_state" not in check.compared


@pytest.mark.parametrize("opt", slow_but(OPTIMIZERS, "adam"))
@pytest.mark.parametrize(
  "entry", slow_but(("train_step", "micro_step", "tx_update", "linen", "nnx"), "train_step")
)
def test_check_step_calls_the_library_s_own_steps_equivalent(entry, opt):
  """ga's steps, token-weighted, in every entry point and under every optimizer."""
  params, batch = init_lm(jax.random.key(0)), token_batch(jax.random.key(1), 16)
  inner = OPTIMIZERS[opt]()
  tx = ga.accumulate(inner, K)
  kw = {"weight_fn": count_tokens}
  if entry == "train_step":
    check = ga.check_step(ga.train_step(token_xent, tx, **kw), token_xent, inner, params,
                          tx.init(params), batch)  # fmt: skip
  elif entry == "micro_step":
    step = ga.micro_step(token_xent, tx, **kw)
    check = ga.check_step(step, token_xent, inner, params, tx.init(params), batch)
  elif entry == "tx_update":

    @jax.jit
    def step(params, state, batch):
      for i in range(K):
        mb = rows(batch, i, K)
        grads = jax.grad(token_xent)(params, mb)
        updates, state = tx.update(grads, state, params, weight=count_tokens(mb))
        params = optax.apply_updates(params, updates)
      return params, state

    check = ga.check_step(step, token_xent, inner, params, tx.init(params), batch)
  elif entry == "linen":

    class LM(nn.Module):
      @nn.compact
      def __call__(self, x):
        emb = self.param("emb", lambda k: params["emb"])
        return jnp.tanh(emb[x]) @ self.param("out", lambda k: params["out"])

    module = LM()
    ts = train_state.TrainState.create(apply_fn=module.apply, params=dict(params), tx=tx)
    step = ga.linen_train_step(module, lambda logits, mb: token_xent_of(logits, mb), **kw)
    check = ga.check_step(step, lambda p, b: token_xent_of(module.apply({"params": p}, b["x"]), b),
                          inner, ts, batch)  # fmt: skip
  else:

    class NnxLM(nnx.Module):
      def __init__(self):
        self.emb, self.out = nnx.Param(params["emb"]), nnx.Param(params["out"])

    model = NnxLM()

    def model_loss(m, b):
      return token_xent_of(jnp.tanh(m.emb[...][b["x"]]) @ m.out[...], b)

    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = ga.nnx_train_step(model_loss, **kw)
    check = ga.check_step(step, model_loss, inner, model, optimizer, batch)
  assert check.ok and check.verdict == "equivalent", str(check)
  assert check.max_rel_grad_error is not None and check.max_rel_grad_error <= 1e-5, str(check)


def token_xent_of(logits, batch):
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1)[..., 0]
  return jnp.sum(nll * batch["mask"]) / jnp.sum(batch["mask"])


def test_check_step_names_a_term_nonlinear_in_the_rows_on_a_mesh():
  """On 8 devices a per-micro-batch term that is not linear in its rows (the square of the
  micro-batch's mean prediction) is computed on each device's rows: NOT equivalent, and the
  reason names that cause (before: only causes a mesh does not make)."""
  mesh = jax.make_mesh((8,), ("data",))

  def loss(w, b):
    pred = b["x"] @ w
    return jnp.mean((pred - b["y"]) ** 2) + jnp.mean(pred) ** 2

  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal(3), jnp.float32)
  batch = {"x": rng.standard_normal((64, 3)).astype(np.float32), "y": np.zeros(64, np.float32)}
  tx = ga.accumulate(optax.sgd(0.1), K)
  step = ga.train_step(loss, tx, mesh=mesh)
  args = (
    jax.device_put(w, NamedSharding(mesh, P())),
    jax.device_put(batch, NamedSharding(mesh, P("data"))),
  )
  check = ga.check_step(step, loss, optax.sgd(0.1), args[0], tx.init(args[0]), args[1])
  assert not check.ok and "On a mesh, also a term that is not linear" in check.reason, str(check)
  alone = ga.check_step(ga.train_step(loss, tx), loss, optax.sgd(0.1), w, tx.init(w), batch)
  assert not alone.ok and "On a mesh" not in alone.reason  # a per-micro-batch term: one device
