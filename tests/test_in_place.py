"""Gradients added into the accumulator inside the backward pass (``grads_in_place``).

Where JAX has ``jax.vjp(...).with_refs`` (0.11+), the fused step's backward pass adds each
block's gradient into the accumulator as the transposed layer scan produces it. Checked here:
the same results as the carried path on the same arguments (bit for bit where the sums run in
the same order), the choice (``StepReport.grads_in_place``) in every case where it falls back,
and the compiled memory on stacked models against a hand-written in-place scan
(benchmarks/stacked_memory.py, the programs the report measures). On JAX 0.10 every step
falls back, and its memory equals the carried path's exactly.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_1d
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga
from gradaccum_jax._microbatch import CARRIED_BECAUSE, refs_available, seed_unit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import stacked_memory  # noqa: E402

REFS = refs_available()
K = 4


def _stack(key, layers=3, d=8):
  k1, k2, k3 = jax.random.split(key, 3)
  params = {
    "blocks": {"w": jax.random.normal(k1, (layers, d, d)) / 3, "b": jnp.zeros((layers, d))},
    "head": jax.random.normal(k2, (d, 2)) / 3,
  }
  x = jax.random.normal(k3, (8 * K * 2, d))
  batch = {"x": x, "y": jnp.tanh(x[:, :2]), "n": jnp.arange(8 * K * 2) % 3}
  return params, batch


def _loss(p, mb, remat=False):
  block = jax.checkpoint(stacked_memory._block) if remat else stacked_memory._block
  h, _ = jax.lax.scan(block, mb["x"], p["blocks"])
  err = jnp.sum((h @ p["head"] - mb["y"]) ** 2, axis=-1)
  mask = mb["n"] > 0
  # A token-weighted mean: 0/0 = NaN for a micro-batch of no tokens (weight 0 adds nothing).
  return jnp.sum(err * mask) / jnp.sum(mask), {"max_err": jnp.max(err), "tokens": jnp.sum(mask)}


def _weight(mb):
  return jnp.sum(mb["n"] > 0)


def assert_close_to_scale(actual, expected, rel):
  """Each leaf within ``rel`` of its largest magnitude (``rel=0``: bit for bit); NaN where the
  expected value is NaN (a call's metrics that do not close a window)."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for (path, a), e in zip(
    jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
  ):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    assert np.array_equal(np.isnan(a), np.isnan(e)), (jax.tree_util.keystr(path), a, e)
    a, e = np.nan_to_num(a), np.nan_to_num(e)
    bound = rel * np.max(np.abs(e), initial=0)
    assert np.max(np.abs(a - e), initial=0) <= bound, (jax.tree_util.keystr(path), a, e)


def _both(make_step, params, state, batch, **call):
  """``make_step(grads_in_place)``'s outputs for True and False, and whether True went in place."""
  out, report = {}, None
  for in_place in (True, False):
    step = make_step(in_place)
    out[in_place] = step(
      jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state), batch, **call
    )
    if in_place:
      report = ga.inspect_step(step, params, state, batch, **call)
  return out[True], out[False], report.grads_in_place


SLOW_CASES = ("remat_and_bf16_compute", "short_window")  # in the full suite only
CASES = {
  "plain": ({}, {}),
  "weighted_with_an_empty_microbatch": ({"weight_fn": _weight}, {}),
  "remat_and_bf16_compute": ({"compute_dtype": jnp.bfloat16, "loss_fn": "remat"}, {}),
  "short_window": ({}, {"num_real_microbatches": 3}),
  "donated": ({"donate": True}, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize(
  "case",
  [c if c not in SLOW_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
)
def test_in_place_equals_the_carried_path(case):
  """Params, state and metrics after two windows (the second opened by a streaming call) are
  the carried path's: bit for bit unweighted (the sums run in the same order), within 1e-6
  relative weighted (the weight seeds the backward pass instead of scaling its result)."""
  step_kw, call = CASES[case]
  params, batch = _stack(jax.random.key(1))
  if case == "weighted_with_an_empty_microbatch":  # micro-batch 1 has no tokens
    batch["n"] = batch["n"].at[1::K].set(0)
  loss_fn = _loss if step_kw.pop("loss_fn", None) is None else lambda p, mb: _loss(p, mb, True)
  tx = ga.accumulate(optax.adam(1e-2), K)
  state = tx.init(params)
  _, state = tx.update(jax.grad(lambda p: loss_fn(p, batch)[0])(params), state, params)  # opened

  def make(in_place):
    return ga.train_step(loss_fn, tx, has_aux=True, grads_in_place=in_place, **step_kw)

  (p1, s1, m1), (p0, s0, m0), went = _both(make, params, state, batch, **call)
  assert went == REFS
  assert_close_to_scale((p1, s1, m1), (p0, s0, m0), 1e-6 if "weight_fn" in step_kw else 0)
  assert bool(s1.updated) and all(np.isfinite(x).all() for x in jax.tree.leaves(p1))


@pytest.mark.slow
@pytest.mark.parametrize(
  "layout",
  ["replicated", "fsdp_once", "fsdp_per_microbatch"],
)
def test_in_place_on_a_mesh_equals_the_carried_path(layout):
  """8 devices, weighted with an empty micro-batch: FSDP gathered per micro-batch reduces each
  micro-batch's own gradient, so it is carried; the others go in place where JAX can."""
  mesh = mesh_1d()
  params, batch = _stack(jax.random.key(2))
  batch["n"] = batch["n"].at[1::K].set(0)
  specs = None
  if layout != "replicated":
    specs = {"blocks": {"w": P(None, "data"), "b": P(None, "data")}, "head": P()}
  gather = "per_microbatch" if layout == "fsdp_per_microbatch" else "once"
  tx = ga.accumulate(optax.adam(1e-2), K)

  def make(in_place):
    return ga.train_step(
      _loss, tx, has_aux=True, weight_fn=_weight, mesh=mesh, param_specs=specs,
      gather_params=gather, grads_in_place=in_place,
    )  # fmt: skip

  (p1, s1, m1), (p0, s0, m0), went = _both(make, params, tx.init(params), batch)
  assert went == (REFS and layout != "fsdp_per_microbatch")
  assert_close_to_scale((p1, s1, m1), (p0, s0, m0), 1e-6)


def _model_state_loss(p, ms, mb):
  loss, aux = _loss(p, mb)
  return loss, {"seen": ms["seen"] + aux["tokens"], "scale": 0.9 * ms["scale"] + 0.1 * loss}


@pytest.mark.slow
def test_in_place_with_model_state_loss_scale_and_value_and_grad():
  """Model state threaded through the micro-batches, a dynamic loss scale, and
  ga.value_and_grad: each as the carried path."""
  params, batch = _stack(jax.random.key(3))
  tx = ga.accumulate(optax.sgd(0.1, momentum=0.9), K, loss_scale=ga.DynamicLossScale())
  ms = {"seen": jnp.zeros((), jnp.int32), "scale": jnp.ones(())}
  out = {}
  for in_place in (True, False):
    step = ga.train_step(_model_state_loss, tx, has_state=True, grads_in_place=in_place)
    vg = ga.value_and_grad(_loss, K, has_aux=True, grads_in_place=in_place)
    out[in_place] = (step(params, ms, tx.init(params), batch), jax.jit(vg)(params, batch))
  assert_close_to_scale(out[True], out[False], 0)


@pytest.mark.slow
def test_linen_and_nnx_stacked_models_in_place_equal_the_carried_path():
  """ga.linen_train_step on an nn.scan model and ga.nnx_train_step on an nnx.scan model."""
  from flax import nnx
  from flax.training import train_state

  x = jax.random.normal(jax.random.key(4), (K * 4, 16))
  batch = {"x": x, "y": jnp.tanh(x[:, :1])}
  net = stacked_memory._linen_net(3, 16)
  tx = ga.accumulate(optax.adam(1e-2), K)
  params = net.init(jax.random.key(5), x[:1])["params"]
  out = {}
  for in_place in (True, False):
    ts = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)
    step = ga.linen_train_step(
      net, lambda y, mb: jnp.mean((y - mb["y"]) ** 2), grads_in_place=in_place
    )
    assert ga.inspect_step(step, ts, batch).grads_in_place == (REFS and in_place)
    ts, metrics = step(ts, batch)
    model = stacked_memory._nnx_net(3, 16)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    nnx_step = ga.nnx_train_step(
      lambda m, mb: jnp.mean((m(mb["x"]) - mb["y"]) ** 2), grads_in_place=in_place
    )
    nnx_metrics = nnx_step(model, optimizer, batch)
    out[in_place] = (ts.params, ts.opt_state, metrics, nnx.state(model), nnx_metrics)
  assert_close_to_scale(out[True], out[False], 0)


def _report(params, tx, **kw):
  batch = _stack(jax.random.key(0))[1]
  step = ga.train_step(_loss, tx, has_aux=True, **kw)
  return ga.inspect_step(step, params, tx.init(params), batch).grads_in_place


@pytest.mark.slow
def test_where_it_falls_back_and_the_report_says_so():
  """In place only where every accumulator leaf has its param's dtype and no unit needs a
  micro-batch's own gradient; the report's line says which path the program took."""
  params = _stack(jax.random.key(0))[0]
  adam = optax.adam(1e-3)
  assert _report(params, ga.accumulate(adam, K)) == REFS
  assert not _report(params, ga.accumulate(adam, K), grads_in_place=False)
  assert not _report(params, ga.accumulate(adam, K, noise_scale_ema=0.9))
  assert not _report(params, ga.accumulate(adam, K, accum_dtype=jnp.bfloat16))  # running mean
  half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  assert not _report(half, ga.accumulate(adam, K))  # a float32 sum of bfloat16 params
  assert _report(half, ga.accumulate(adam, K, accum_dtype=None)) is False  # bf16 running mean
  line = repr(ga.inspect_step(ga.train_step(_loss, ga.accumulate(adam, K), has_aux=True),
                              params, ga.accumulate(adam, K).init(params), _stack(jax.random.key(0))[1]))  # fmt: skip
  assert ("gradients added in place" if REFS else "gradients carried") in line


def _report_of(params, tx, **kw):
  batch = _stack(jax.random.key(0))[1]
  step = ga.train_step(_loss, tx, has_aux=True, **kw)
  return ga.inspect_step(step, params, tx.init(params), batch)


@pytest.mark.slow
def test_the_report_says_why_a_step_carries():
  """``StepReport.carried_because`` names the cause in every case the step falls back (None in
  place), and the report's line prints it."""
  params = _stack(jax.random.key(0))[0]
  adam = optax.adam(1e-3)
  no_refs = CARRIED_BECAUSE["jax"] if not REFS else None
  cases = [
    (params, ga.accumulate(adam, K), {}, None),
    (params, ga.accumulate(adam, K), {"grads_in_place": False}, CARRIED_BECAUSE["option"]),
    (params, ga.accumulate(adam, K, noise_scale_ema=0.9), {}, no_refs or CARRIED_BECAUSE["noise"]),
    (params, ga.accumulate(adam, K, accum_dtype=jnp.bfloat16), {}, no_refs or "running mean"),
    (jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), ga.accumulate(adam, K), {},
     no_refs or CARRIED_BECAUSE["dtype"]),
    (params, ga.accumulate(adam, K), {"weight_fn": _weight}, None),
  ]  # fmt: skip
  for p, tx, kw, why in cases:
    report = _report_of(p, tx, **kw)
    if why is None:
      assert report.grads_in_place == REFS and report.carried_because == no_refs, kw
      continue
    assert not report.grads_in_place and why in report.carried_because, (kw, report)
    assert f"gradients carried ({report.carried_because})" in repr(report)
  step = ga.micro_step(lambda p, mb: _loss(p, mb)[0], ga.accumulate(adam, K))  # undonated
  mb = ga.microbatch(_stack(jax.random.key(0))[1], 0, K)
  report = ga.inspect_step(step, params, ga.accumulate(adam, K).init(params), mb)
  assert report.carried_because == (no_refs or CARRIED_BECAUSE["streaming"])


# --- 16-bit compute x weights, in place: the cases of the whole batch's scale ----------------

F16_ROWS, TOKENS = 8, 32  # rows of a micro-batch, tokens per row


def _ones_loss(dtype):
  """``mean((x @ w))`` computed in ``dtype`` then float32: every row's gradient is exactly x."""

  def loss(w, mb):
    return jnp.mean((mb["x"].astype(w.dtype) @ w).astype(jnp.float32))

  return loss


def _token_weight(per_row):
  return lambda mb: jnp.float32(per_row) * mb["x"].shape[0]


def _float16_runs(weight, loss_scale, in_place):
  """``w`` after one window of k = 2 micro-batches of 8 rows of ones (the gradient is 1 in
  every micro-batch), sgd(0.1), float16 compute, in every entry point that computes it;
  ``(w, num_skipped, loss scale)`` for each."""
  loss = _ones_loss(jnp.float16)
  w0, batch = jnp.zeros((8, 1)), {"x": jnp.ones((2 * F16_ROWS, 8))}
  scale = ga.DynamicLossScale() if loss_scale else None
  tx = ga.accumulate(optax.sgd(0.1), 2, loss_scale=scale)
  kw = {"weight_fn": weight, "grads_in_place": in_place}
  out = {}
  for donate in (False, True):
    step = ga.train_step(loss, tx, compute_dtype=jnp.float16, donate=donate, **kw)
    p, s, _ = step(jnp.copy(w0), tx.init(w0), batch)
    out[f"train_step donate={donate}"] = (p, s)
  micro = ga.micro_step(lambda w, mb: loss(w.astype(jnp.float16), mb), tx, donate=True, **kw)
  p, s = jnp.copy(w0), tx.init(w0)
  for i in range(2):
    p, s, _ = micro(p, s, ga.microbatch(batch, i, 2))
  out["micro_step"] = (p, s)
  results = {
    name: (np.asarray(p), int(s.num_skipped), None if s.loss_scale is None else float(s.loss_scale.scale))
    for name, (p, s) in out.items()
  }  # fmt: skip
  if not loss_scale:  # value_and_grad takes no loss scale
    _, g = jax.jit(ga.value_and_grad(loss, 2, compute_dtype=jnp.float16, **kw))(w0, batch)
    results["value_and_grad"] = (np.asarray(w0 - 0.1 * g), 0, None)
  return results


@pytest.mark.slow
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "carried"])
def test_float16_token_weights_under_a_loss_scale_apply_the_window(in_place):
  """32 tokens a row: a seed of w_i = 256 times the loss scale 2^15 overflowed float16 in place
  (w = 0, a voided window, the scale halved); seeded at the whole batch's scale it is applied as
  the whole batch applies it: w = -0.1 (the gradient is exactly 1), nothing skipped, 2^15."""
  for name, got in _float16_runs(_token_weight(TOKENS), True, in_place).items():
    np.testing.assert_array_equal(got[0], np.full((8, 1), -0.1, np.float32), err_msg=name)
    assert got[1:] == (0, 2.0**15), (name, got)


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "carried"])
def test_float16_with_70000_token_micro_batches_is_not_voided(in_place):
  """70,000 tokens a micro-batch (32 sequences of 2,048 and more) without a loss scale: every
  window was voided in place (grad_norm inf); now w = -0.1 in every entry point."""
  for name, got in _float16_runs(_token_weight(70_000 / F16_ROWS), False, in_place).items():
    np.testing.assert_allclose(got[0], np.full((8, 1), -0.1), rtol=2.0**-11, err_msg=name)
    assert got[1] == 0, (name, got)


@pytest.mark.slow
@pytest.mark.parametrize("loss_dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_a_weighted_loss_narrower_than_float32_is_carried_and_exact(loss_dtype):
  """A loss value in bfloat16 (float16) would round each weight in its seed (257 -> 256 in
  bfloat16: w = -0.0996 instead of -0.1): such a step carries, and equals the closed form
  -0.1 (every gradient is 1) in the fused step, value_and_grad and micro_step; the report says
  why it carries."""
  w0, batch = jnp.zeros((8, 1)), {"x": jnp.ones((2 * F16_ROWS, 8))}

  def loss(w, mb):  # the loss value in loss_dtype
    return jnp.mean(mb["x"].astype(loss_dtype) @ w.astype(loss_dtype))

  weight = {jnp.bfloat16: 257.0, jnp.float16: 2049.0}[loss_dtype]
  kw = {"weight_fn": lambda mb: jnp.float32(weight)}
  tx = ga.accumulate(optax.sgd(0.1), 2)
  step = ga.train_step(loss, tx, donate=True, **kw)
  report = ga.inspect_step(step, w0, tx.init(w0), batch)
  assert not report.grads_in_place
  assert report.carried_because == (CARRIED_BECAUSE["narrow_loss" if REFS else "jax"])
  p, _, _ = step(jnp.copy(w0), tx.init(w0), batch)
  _, g = jax.jit(ga.value_and_grad(loss, 2, **kw))(w0, batch)
  micro = ga.micro_step(loss, tx, donate=True, **kw)
  q, s = jnp.copy(w0), tx.init(w0)
  for i in range(2):
    q, s, _ = micro(q, s, ga.microbatch(batch, i, 2))
  for name, got in (("train_step", p), ("value_and_grad", w0 - 0.1 * g), ("micro_step", q)):
    np.testing.assert_array_equal(np.asarray(got), np.full((8, 1), -0.1, np.float32), name)


def test_the_seed_unit_is_the_power_of_two_at_or_above_the_whole_batch_weight():
  """Closed form: the smallest power of two above W D, 2^(floor(log2(W D)) + 1); 1 for a void
  or non-finite total."""
  for total, devices, unit in ((1.0, 1, 2.0), (3.0, 1, 4.0), (257.0, 1, 512.0), (70_000.0, 1,
                                2.0**17), (5.0, 8, 64.0), (0.0, 1, 1.0), (np.nan, 1, 1.0),
                               (np.inf, 1, 1.0)):  # fmt: skip
    assert float(seed_unit(jnp.float32(total), devices)) == unit, (total, devices)


def test_grads_in_place_must_be_a_bool():
  tx = ga.accumulate(optax.sgd(0.1), K)
  for make in (
    lambda: ga.train_step(_loss, tx, grads_in_place="yes"),
    lambda: ga.value_and_grad(_loss, K, grads_in_place=1),
    lambda: ga.linen_train_step(None, _loss, grads_in_place=None),
    lambda: ga.nnx_train_step(_loss, grads_in_place="no"),
  ):
    with pytest.raises(TypeError, match="grads_in_place must be True or False"):
      make()


def _over(r, name, floor):
  return (r[name] - r[floor]) / r["A"]


@pytest.mark.slow
@pytest.mark.parametrize("front", stacked_memory.FRONTS)
@pytest.mark.parametrize("layers,k", [(4, 8), (8, 8), (8, 32)])
def test_a_stacked_model_holds_what_a_hand_written_in_place_scan_holds(front, layers, k):
  """Donated, adam: the fused step's peak is the hand-written Ref scan's within 0.1 A, about
  (1 - 1/L) A below the carried path's; on JAX 0.10 it falls back, equal to the carried path."""
  r = stacked_memory.stacked_bytes(front, layers, k)
  if not REFS:
    assert r["ga"] == r["ga_carried"], r
    return
  assert r["ga"] <= r["ref_scan"] + 0.1 * r["A"], r
  assert _over(r, "ga_carried", "ga") >= 1 - 1 / layers - 0.15, r
  assert r["ga_carried"] <= r["carry_scan"] + 0.05 * r["A"], r


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
@pytest.mark.parametrize("layers,k", [(4, 8), (8, 32)])
def test_on_8_devices_a_stacked_model_holds_what_a_shard_map_ref_scan_holds(layout, layers, k):
  """Per device, against a hand-written shard_map Ref scan (no accumulator between windows):
  replicated within 0.1 A (the Ref is the state's donated accumulator); FSDP gathered once,
  one device-A more and no other, the state's 1/D shard of the accumulator, which the floor
  does not keep (streaming calls share the window through it)."""
  r = stacked_memory.mesh_stacked_bytes(layout, layers, k)
  if not REFS:
    assert r["ga"] == r["ga_carried"], r
    return
  extra = 0 if layout == "replicated" else 1
  assert r["ga"] <= r["ref_scan"] + (extra + 0.1) * r["A"], r
  assert r["ga"] < r["ga_carried"], r


@pytest.mark.slow
@pytest.mark.parametrize("weighted", [False, True])
def test_micro_step_in_place_equals_the_carried_path(weighted):
  """ga.micro_step (no mesh) over a window and a half, weighted with an empty micro-batch or not:
  params, state and metrics as with grads_in_place=False, bit for bit unweighted."""
  params, batch = _stack(jax.random.key(6))
  if weighted:
    batch["n"] = batch["n"].at[1::K].set(0)
  tx = ga.accumulate(optax.adam(1e-2), K)
  out = {}
  for in_place in (True, False):
    step = ga.micro_step(
      _loss, tx, has_aux=True, weight_fn=_weight if weighted else None, grads_in_place=in_place
    )
    p, s = params, step.init(params, ga.microbatch(batch, 0, K))
    for i in range(K + 2):
      p, s, m = step(p, s, ga.microbatch(batch, i % K, K))
      if i == K - 1:
        closed = m
    out[in_place] = (p, s, closed, m)
  assert bool(out[True][2]["updated"])
  assert_close_to_scale(out[True], out[False], 1e-6 if weighted else 0)


@pytest.mark.slow
@pytest.mark.parametrize("layers", [4, 8])
def test_a_micro_step_on_stacked_blocks_holds_what_a_hand_written_in_place_call_holds(layers):
  """Donated, adam: one ga.micro_step call holds the hand-written in-place call's peak within
  0.1 A (its accumulator the state's, donated; one block's gradient), 1 - 1/L A less than the
  carried call; on JAX 0.10 it falls back, equal to the carried call."""
  r = stacked_memory.streaming_stacked_bytes(layers)
  if not REFS:
    assert r["micro"] == r["micro_carried"], r
    return
  assert r["micro"] <= r["ref_call"] + 0.1 * r["A"], r
  assert _over(r, "micro_carried", "micro") >= 1 - 1 / layers - 0.05, r
