"""Property-based: fused = streaming = value_and_grad + inner = the whole-batch step, for drawn
params pytrees (float32, bfloat16, float16, complex64 leaves; odd and empty shapes), batch sizes,
k and weights (zeros included); and a NaN anywhere voids exactly its window."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import gradaccum_jax as ga

DTYPES = {
  "float32": jnp.float32,
  "bfloat16": jnp.bfloat16,
  "float16": jnp.float16,
  "complex64": jnp.complex64,
}
# Relative tolerance of the comparison with the whole-batch step, by the params' dtype: the
# reference differentiates in that dtype, the accumulator is float32.
RTOL = {"float32": 2e-5, "complex64": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
LR = 0.5

shapes = st.lists(st.integers(0, 3), min_size=0, max_size=2).map(tuple)
leaves = st.tuples(st.sampled_from(sorted(DTYPES)), shapes)


@st.composite
def cases(draw):
  specs = draw(st.lists(leaves, min_size=1, max_size=3))
  k = draw(st.integers(1, 4))
  b = draw(st.integers(1, 3))
  weighted = draw(st.booleans())
  seed = draw(st.integers(0, 2**16))
  zero_mb = draw(st.one_of(st.none(), st.integers(0, k - 1))) if weighted and k > 1 else None
  return specs, k, b, weighted, seed, zero_mb


def make(specs, k, b, weighted, seed, zero_mb):
  rng = np.random.default_rng(seed)
  params = {}
  for j, (name, shape) in enumerate(specs):
    x = rng.normal(size=shape) + (1j * rng.normal(size=shape) if name == "complex64" else 0)
    params[f"p{j}_{name}"] = jnp.asarray(x, DTYPES[name])
  n = k * b
  batch = {
    "x": jnp.asarray(rng.normal(size=(n, len(specs))), jnp.float32),
    "y": jnp.asarray(rng.normal(size=n), jnp.float32),
    "mask": jnp.asarray(rng.integers(0, 3, n), jnp.float32) if weighted else jnp.ones(n),
  }
  if zero_mb is not None:  # a whole micro-batch (rows zero_mb, zero_mb + k, ...) of weight 0
    batch["mask"] = batch["mask"].at[zero_mb::k].set(0.0)
  return params, batch


def features(params):
  """One real scalar per leaf: sum(real * cos(idx)) + sum(imag * sin(idx)), in float32."""
  out = []
  for p in params.values():
    idx = jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape)
    z = p.astype(jnp.complex64) if jnp.iscomplexobj(p) else p.astype(jnp.float32)
    out.append(jnp.sum(jnp.real(z) * jnp.cos(idx)) + jnp.sum(jnp.imag(z) * jnp.sin(idx)))
  return jnp.stack(out)


def loss_fn(params, mb):
  """Mean squared error over the rows of positive mask (the micro-batch's tokens)."""
  err = (mb["x"] @ features(params) - mb["y"]) ** 2
  return jnp.sum(err * mb["mask"]) / jnp.maximum(jnp.sum(mb["mask"]), 1.0)


def weight_fn(mb):
  return mb["mask"].sum()


def whole_batch_params(params, batch):
  grads = jax.grad(loss_fn)(params, batch)  # the whole batch's token mean
  return optax.apply_updates(params, jax.tree.map(lambda g: -LR * g, grads))


def close(actual, expected, params):
  for name in params:
    kind = name.split("_", 1)[1]
    a = np.asarray(actual[name].astype(jnp.complex64))
    e = np.asarray(expected[name].astype(jnp.complex64))
    scale = float(np.max(np.abs(e), initial=1.0))
    np.testing.assert_allclose(a, e, rtol=RTOL[kind], atol=RTOL[kind] * scale, err_msg=name)


SETTINGS = settings(
  max_examples=15, deadline=None, derandomize=True,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip


@pytest.mark.slow
@SETTINGS
@given(cases())
def test_every_mode_equals_the_whole_batch_step(case):
  specs, k, b, weighted, seed, zero_mb = case
  params, batch = make(*case)
  kw = {"weight_fn": weight_fn} if weighted else {}
  if batch["mask"].sum() == 0 and weighted:
    return  # an empty window: voided, covered below
  inner = optax.sgd(LR)
  tx = ga.accumulate(inner, k)
  expected = whole_batch_params(params, batch)

  fused, state, metrics = ga.train_step(loss_fn, tx, **kw)(params, tx.init(params), batch)
  assert bool(metrics["updated"]) and int(state.count) == 1
  close(fused, expected, params)

  state = tx.init(params)
  for i in range(k):
    mb = ga.microbatch(batch, i, k)
    g = jax.grad(loss_fn)(params, mb)
    updates, state = tx.update(g, state, params, weight=weight_fn(mb) if weighted else None)
  close(optax.apply_updates(params, updates), expected, params)

  _, grads = ga.value_and_grad(loss_fn, k, **kw)(params, batch)
  updates, _ = inner.update(grads, inner.init(params), params)
  close(optax.apply_updates(params, updates), expected, params)


def two_windows_one_bad(case, bad_window, where):
  """``(params, [batch, batch])`` of a case, with a NaN at ``where`` in window ``bad_window``."""
  specs, k, b, weighted, seed, zero_mb = case
  assume(any(np.prod(shape) > 0 for _, shape in specs))  # else no gradient can see the NaN
  params, batch1 = make(specs, k, b, False, seed, None)
  _, batch2 = make(specs, k, b, False, seed + 1, None)
  batches = [batch1, batch2]
  x = np.asarray(batches[bad_window]["x"]).copy()
  x.flat[where % x.size] = np.nan
  batches[bad_window] = dict(batches[bad_window], x=jnp.asarray(x))
  return params, batches


@pytest.mark.slow
@settings(max_examples=10, deadline=None, derandomize=True)
@given(cases(), st.integers(0, 1), st.integers(0, 100))
def test_a_nan_anywhere_voids_exactly_its_window(case, bad_window, where):
  specs, k = case[:2]
  params, batches = two_windows_one_bad(case, bad_window, where)
  tx = ga.accumulate(optax.sgd(LR), k)
  step = ga.train_step(loss_fn, tx)
  p, s = params, tx.init(params)
  for j, batch in enumerate(batches):
    before = p
    p, s, metrics = step(p, s, batch)
    if j == bad_window:
      assert not bool(metrics["updated"])
      jax.tree.map(
        lambda a, e: np.testing.assert_array_equal(np.asarray(a), np.asarray(e)), p, before
      )
    else:
      assert bool(metrics["updated"])
      close(p, whole_batch_params(before, batch), params)
  assert int(s.num_skipped) == 1 and int(s.count) == 2
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p))


def stateful_loss(params, ms, mb):
  """loss_fn with a running statistic in the model state (a mean of the inputs, as BatchNorm's)."""
  return loss_fn(params, mb), {"mean": 0.9 * ms["mean"] + 0.1 * jnp.mean(mb["x"], axis=0)}


def assert_equal(a, e):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, e)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True)
@given(cases(), st.integers(0, 1), st.integers(0, 100))
def test_a_nan_anywhere_voids_exactly_its_window_in_micro_step_and_with_model_state(
  case, bad_window, where
):
  """ga.micro_step and ga.train_step with model state and adam, two windows, a NaN anywhere in
  one: that window leaves params, adam's state and the float model state exactly as it found
  them (micro_step: whichever call of the window the NaN is in), counts one skipped window of
  two, and the other window trains, identically in both modes."""
  specs, k = case[:2]
  params, batches = two_windows_one_bad(case, bad_window, where)
  tx = ga.accumulate(optax.adam(LR), k)
  ms0 = {"mean": jnp.zeros(len(specs), jnp.float32)}
  fused = ga.train_step(stateful_loss, tx, has_state=True)
  micro = ga.micro_step(stateful_loss, tx, has_state=True)
  runs = {}
  for mode in ("fused", "micro"):
    p, ms, s = params, ms0, tx.init(params)
    if mode == "micro":
      s = micro.init(params, model_state=ms0)
    for j, batch in enumerate(batches):
      before = (p, ms, (s if mode == "fused" else s.accumulate).inner_state)
      if mode == "fused":
        p, ms, s, metrics = fused(p, ms, s, batch)
      else:
        for i in range(k):
          p, ms, s, metrics = micro(p, ms, s, ga.microbatch(batch, i, k))
      inner = (s if mode == "fused" else s.accumulate).inner_state
      assert bool(metrics["updated"]) == (j != bad_window)
      if j == bad_window:
        assert_equal((p, ms, inner), before)
    acc = s if mode == "fused" else s.accumulate
    assert int(acc.num_skipped) == 1 and int(acc.count) == 2
    runs[mode] = (p, ms)
  for a, e in zip(jax.tree.leaves(runs["micro"]), jax.tree.leaves(runs["fused"]), strict=True):
    kind = "complex64" if jnp.iscomplexobj(e) else str(jnp.result_type(e))
    rtol = RTOL.get(kind, 2e-5)
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=rtol)


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
