"""ga.micro_step: one jitted call per micro-batch; on a mesh, one reduction per window."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, init_mlp, mesh_1d, put, xent_loss
from jax.sharding import PartitionSpec as P
from test_sharding import (
  FSDP,
  SIZES,
  D,
  data,
  plain_steps,
  token_batch,
  token_loss,
)

import gradaccum_jax as ga


def tokens(mb):
  return jnp.sum(mb["mask"])


def run_window(step, params, state, batch, k, mesh=None, calls=None):
  """Calls ``step`` on micro-batches ``calls`` (all k by default) of ``batch``."""
  for i in range(k) if calls is None else calls:
    mb = ga.microbatch(batch, i, k)
    params, state, metrics = step(params, state, mb if mesh is None else put(mb, mesh, P("data")))
  return params, state, metrics


def record_value():
  """An inner transformation that keeps the ``value=`` it was given (the window's mean loss)."""

  def init(params):
    del params
    return jnp.full((), jnp.nan, jnp.float32)

  def update(updates, state, params=None, *, value=None, **extra):
    del state, params, extra
    return updates, jnp.asarray(jnp.nan if value is None else value, jnp.float32)

  return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.slow
def test_without_a_mesh_k_calls_equal_the_big_batch_step_and_pass_the_window_loss():
  k = 4
  params = init_mlp(jax.random.key(0), SIZES)
  batch = token_batch(D * k)
  inner = optax.chain(record_value(), optax.clip_by_global_norm(0.1), optax.adam(1e-2))
  expected, expected_loss = plain_steps(token_loss, inner, params, [batch])
  tx = ga.accumulate(inner, k)
  step = ga.micro_step(token_loss, tx, weight_fn=tokens)
  state = step.init(params)
  p = params
  for i in range(k):
    p, state, metrics = step(p, state, ga.microbatch(batch, i, k))
    assert bool(metrics["updated"]) == (i == k - 1)
    assert int(metrics["micro_step"]) == (i + 1) % k
    if i < k - 1:
      assert np.isnan(metrics["loss"]) and np.isnan(metrics["weight"])
  assert_trees_close(p, expected)
  np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
  np.testing.assert_allclose(state.accumulate.inner_state[0], expected_loss, rtol=1e-5)
  assert float(metrics["weight"]) == float(np.sum(batch["mask"]))
  assert int(state.accumulate.count) == 1 and not np.any(state.accumulate.acc_grads["layer0"]["w"])


@pytest.mark.slow
def test_without_a_mesh_it_equals_train_step_with_aux_and_does_not_retrace():
  k = 2
  params = init_mlp(jax.random.key(0), SIZES)
  batches = [data(8 * k, key) for key in (1, 2)]

  def loss_aux(params, mb):
    loss = xent_loss(params, mb)
    return loss, {"loss": loss, "rows": jnp.sum(mb["y"] >= 0)}

  tx = ga.accumulate(optax.adam(1e-2), k)
  fused = ga.train_step(loss_aux, tx, has_aux=True)
  step = ga.micro_step(loss_aux, tx, has_aux=True, jit=False)
  jitted = jax.jit(chex.assert_max_traces(lambda p, s, mb: step(p, s, mb), n=1))
  p, s = params, step.init(params, batches[0])
  pf, sf = params, tx.init(params)
  for batch in batches:
    p, s, m = run_window(jitted, p, s, batch, k)
    pf, sf, mf = fused(pf, sf, batch)
    assert_trees_close(p, pf)
    np.testing.assert_allclose(m["aux"]["loss"], mf["aux"]["loss"], rtol=1e-5)
    assert int(m["aux"]["rows"]) == int(mf["aux"]["rows"]) == 8 * k
  chex.assert_tree_all_finite(p)


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True], ids=["undonated", "donated"])
def test_with_model_state_k_calls_thread_it_as_train_step_does(donate):
  """Donated, the closing branch writes the new params over the old ones; undonated it returns
  updates: both equal train_step."""
  k, m = 4, 0.5
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(8 * k)

  def loss_fn(params, state, mb):  # a running mean of the inputs, and a counter
    ema = m * state["ema"] + (1 - m) * jnp.mean(mb["x"], axis=0)
    return xent_loss(params, mb), {"ema": ema, "steps": state["steps"] + 1}

  model_state = {"ema": jnp.zeros(SIZES[0]), "steps": jnp.zeros((), jnp.int32)}
  tx = ga.accumulate(optax.adam(1e-2), k)
  fused = ga.train_step(loss_fn, tx, has_state=True)
  pf, sf, _, mf = fused(params, model_state, tx.init(params), batch)
  step = ga.micro_step(loss_fn, tx, has_state=True, donate=donate)
  p, s, state = params, model_state, step.init(params)
  for i in range(k):
    p, s, state, metrics = step(p, s, state, ga.microbatch(batch, i, k))
  assert_trees_close(p, pf)
  assert_trees_close(s, sf)
  assert int(s["steps"]) == k
  np.testing.assert_allclose(metrics["loss"], mf["loss"], rtol=1e-5)


# --- on a mesh -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("specs", [None, FSDP], ids=["replicated", "fsdp"])
def test_on_a_mesh_weighted_with_uneven_tokens_per_device_equals_the_big_batch_step(specs):
  mesh, k = mesh_1d(), 4
  params = init_mlp(jax.random.key(0), SIZES)
  batch = token_batch(D * k * 2)
  per_device = np.asarray(batch["mask"]).reshape(D, -1).sum(axis=1)
  assert len(set(per_device.tolist())) > 1
  inner = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
  expected, expected_loss = plain_steps(token_loss, inner, params, [batch])
  tx = ga.accumulate(inner, k)
  step = ga.micro_step(token_loss, tx, weight_fn=tokens, mesh=mesh, param_specs=specs)
  p = put(params, mesh, P() if specs is None else specs)
  state = step.init(p)
  assert state.accumulate.acc_grads["layer0"]["w"].shape == (D, *SIZES[:2])
  p, state, metrics = run_window(step, p, state, batch, k, mesh)
  assert_trees_close(p, expected)
  np.testing.assert_allclose(metrics["loss"], expected_loss, rtol=1e-5)
  assert float(metrics["weight"]) == float(per_device.sum())
  if specs is not None:  # the params keep their sharding
    for leaf, spec in zip(jax.tree.leaves(p), jax.tree.leaves(specs), strict=True):
      sharding = jax.sharding.NamedSharding(mesh, spec)
      assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, spec)


def loop_collectives(report):
  """Every collective of a ga.StepReport: (op, shapes, whether it is inside a while loop or a
  conditional's branch)."""
  return [(c.kind, c.shapes, c.in_loop or c.in_branch) for c in report.collectives]


@pytest.mark.slow
@pytest.mark.parametrize("specs", [None, FSDP], ids=["replicated", "fsdp"])
def test_gradient_reductions_run_only_in_the_branch_that_closes_the_window(specs):
  """The window closes in a lax.cond branch: a call inside the window takes the other one, so
  the gradient's collectives run once per window (the program's only loop is the one-trip
  scan of the micro-batch's sums, with no collective)."""
  mesh, k = mesh_1d(), 4
  params = init_mlp(jax.random.key(0), SIZES)
  tx = ga.accumulate(optax.adam(1e-2), k)
  step = ga.micro_step(xent_loss, tx, mesh=mesh, param_specs=specs)
  p = put(params, mesh, P() if specs is None else specs)
  mb = put(ga.microbatch(data(D * k), 0, k), mesh, P("data"))
  report = ga.inspect_step(step, p, step.init(p), mb)
  assert len(report.loops) <= 1  # the micro-batch's scan, if any
  found = loop_collectives(report)
  sized = [c for c in found if c[0] in ("all-reduce", "reduce-scatter") and any(c[1])]
  assert sized and all(in_loop for _, _, in_loop in sized), found
  outside = [op for op, _, in_loop in found if not in_loop]
  assert set(outside) <= {"all-gather"}, found  # FSDP: the params, gathered every call
  if specs is None:
    assert [(op, in_loop) for op, _, in_loop in found] == [("all-reduce", True)], found


@pytest.mark.slow
def test_a_plain_gspmd_streaming_step_all_reduces_every_call():
  """The contrast: jit(value_and_grad + tx.update) on a sharded micro-batch reduces each call."""
  mesh, k = mesh_1d(), 4
  params = put(init_mlp(jax.random.key(0), SIZES), mesh, P())
  tx = ga.accumulate(optax.adam(1e-2), k)

  @jax.jit
  def plain(params, state, mb):
    grads = jax.grad(xent_loss)(params, mb)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  mb = put(ga.microbatch(data(D * k), 0, k), mesh, P("data"))
  found = loop_collectives(ga.inspect_step(plain, params, tx.init(params), mb))
  assert [c for c in found if c[0] == "all-reduce" and any(c[1]) and not c[2]], found


# --- checkpoints: layouts and meshes -----------------------------------------------------------


@pytest.mark.slow
def test_a_window_saved_on_a_mesh_resumes_without_one_and_in_the_fused_step():
  """Two calls on 8 devices, the state moved off the mesh (as after a restore on another
  machine), two more calls: the window is the whole batch's, unweighted."""
  mesh, k = mesh_1d(), 4
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(D * k)
  inner = optax.adam(1e-2)
  expected, _ = plain_steps(xent_loss, inner, params, [batch])
  tx = ga.accumulate(inner, k)
  on_mesh = ga.micro_step(xent_loss, tx, mesh=mesh)
  p = put(params, mesh, P())
  p, state, _ = run_window(on_mesh, p, on_mesh.init(p), batch, k, mesh, calls=range(2))
  saved = jax.device_get(state)  # numpy: no mesh

  single = ga.micro_step(xent_loss, tx)
  restored = single.convert_state(saved, single.init(params))
  assert restored.accumulate.acc_grads["layer0"]["w"].shape == SIZES[:2]
  p1, _, metrics = run_window(single, jax.device_get(p), restored, batch, k, calls=range(2, 4))
  assert bool(metrics["updated"])
  assert_trees_close(p1, expected)
  # Or the saved state as it is: the step totals its 8 slots on the first call.
  p1, _, metrics = run_window(single, jax.device_get(p), saved, batch, k, calls=range(2, 4))
  assert bool(metrics["updated"])
  assert_trees_close(p1, expected)

  # The same open window, summed into tx.init's layout, closed by the fused step on the rest.
  open_window = on_mesh.to_accumulate_state(state)
  assert open_window.acc_grads["layer0"]["w"].shape == SIZES[:2]
  np.testing.assert_allclose(open_window.acc_weight, 2.0)  # 2 micro-batches of weight 1
  # Micro-batch i holds rows i, i + k, ...: keep micro-batches 2 and 3, in the same layout.
  rest = jax.tree.map(
    lambda x: x.reshape(-1, k, *x.shape[1:])[:, 2:].reshape(-1, *x.shape[1:]), batch
  )
  fused = ga.train_step(xent_loss, ga.accumulate(inner, 2))
  p2, _, _ = fused(jax.device_get(p), jax.device_get(open_window), rest)
  assert_trees_close(p2, expected)


# --- one state for every mode -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("specs", [None, FSDP], ids=["replicated", "fsdp"])
@pytest.mark.parametrize("donate", [False, True], ids=["undonated", "donated"])
def test_from_tx_init_it_equals_train_step_window_for_window_and_the_modes_share_a_state(
  specs, donate
):
  """On 8 devices: windows 1 and 3 streamed by micro_step, window 2 fused by train_step, each
  starting from the state the other returned (tx.init's first), equal train_step alone; the
  streamed step compiles twice (tx.init's state, then its own layout), not once per call."""
  mesh, k = mesh_1d(), 4
  params = init_mlp(jax.random.key(0), SIZES)
  batches = [data(D * k, key) for key in (1, 2, 3)]
  tx = ga.accumulate(optax.adam(1e-2), k)
  kw = {"mesh": mesh, "param_specs": specs}
  fused = ga.train_step(xent_loss, tx, **kw)
  traces = []
  loss_fn = lambda p, mb: (traces.append(1), xent_loss(p, mb))[1]  # noqa: E731
  streamed = ga.micro_step(loss_fn, tx, donate=donate, **kw)
  place = lambda t: put(t, mesh, P() if specs is None else specs)  # noqa: E731
  pf, sf = place(params), tx.init(place(params))
  p, s = place(params), tx.init(place(params))
  for i, batch in enumerate(batches):
    pf, sf, mf = fused(pf, sf, put(batch, mesh, P("data")))
    if i == 1:
      p, s, m = fused(p, s, put(batch, mesh, P("data")))
      assert isinstance(s, ga.AccumulateState)
    else:
      p, s, m = run_window(streamed, p, s, batch, k, mesh)
      assert type(s).__name__ == "MicroStepState" and bool(ga.has_updated(s))
    assert_trees_close(p, pf)
    np.testing.assert_allclose(m["loss"], mf["loss"], rtol=1e-5)
    # Two programs (tx.init's layout in, then the step's own), each tracing the loss twice;
    # none more for window 3 (train_step's state has tx.init's layout).
    assert len(traces) == 4, (i, len(traces))


@pytest.mark.slow
def test_tx_update_and_flush_close_a_window_micro_step_opened():
  """One streamed call of a 2-window, then tx.update (and, from the same state, ga.flush) on
  its state: the window is the two micro-batches' (the one micro-batch's with flush)."""
  k, lr = 2, 0.1
  params = init_mlp(jax.random.key(0), SIZES)
  batch = data(8 * k)
  tx = ga.accumulate(optax.sgd(lr), k)
  step = ga.micro_step(xent_loss, tx)
  mbs = [ga.microbatch(batch, i, k) for i in range(k)]
  _, state, _ = step(params, tx.init(params), mbs[0])
  grads = [jax.grad(xent_loss)(params, mb) for mb in mbs]
  updates, closed = tx.update(grads[1], state, params)
  assert bool(ga.has_updated(closed)) and isinstance(closed, ga.AccumulateState)
  expected = jax.tree.map(lambda a, b: -lr * (a + b) / 2, *grads)
  assert_trees_close(updates, expected)
  flushed, _ = ga.flush(tx, state, params)
  assert_trees_close(flushed, jax.tree.map(lambda a: -lr * a, grads[0]))


# --- bad input ---------------------------------------------------------------------------------


def test_a_micro_batch_not_divisible_by_the_data_parallel_devices_names_the_axis():
  mesh = mesh_1d()
  params = put(init_mlp(jax.random.key(0), SIZES), mesh, P())
  tx = ga.accumulate(optax.sgd(0.1), 2)
  step = ga.micro_step(xent_loss, tx, mesh=mesh)
  with pytest.raises(ValueError, match=r"12 rows, not divisible by the 8 devices .*\('data',\)"):
    step(params, step.init(params), data(12))


def test_bad_states_and_arguments():
  params = init_mlp(jax.random.key(0), SIZES)
  tx = ga.accumulate(optax.sgd(0.1), 2)
  step = ga.micro_step(xent_loss, tx)
  with pytest.raises(TypeError, match=r"state must be tx.init\(params\).* got tuple"):
    step(params, tx.init(params).inner_state, data(4))
  other = {"w": jnp.zeros(3)}
  with pytest.raises(ValueError, match=r"does not match this step's:\n  saved: .*'w'"):
    step.convert_state(tx.init(other), step.init(params))
  with pytest.raises(TypeError, match=r"made by ga.accumulate"):
    ga.micro_step(xent_loss, optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"pass a micro-batch to init"):
    ga.micro_step(xent_loss, tx, has_aux=True).init(params)
  with pytest.raises(ValueError, match=r"data_axis='data'.*\{'batch': 8\}"):
    ga.micro_step(xent_loss, tx, mesh=jax.make_mesh((D,), ("batch",)))


# --- float64 and a voided window's model state ---------------------------------------------------


def test_a_float64_accumulator_runs_and_reports_one_dtype_on_every_call():
  """Under x64, micro_step with accum_dtype=float64 reports each metric in one dtype whether a
  call closes the window or not (before: a TypeError, grad_norm float32 in one branch and
  float64 in the other), and the closing call's mean is the float64 mean."""
  with jax.enable_x64(True):
    tx = ga.accumulate(optax.sgd(0.1), 2, accum_dtype=jnp.float64)
    s = ga.micro_step(lambda w, mb: jnp.mean((mb["x"] @ w) ** 2), tx)
    w = jnp.zeros(3)
    state = s.init(w)
    w, state, held = s(w, state, {"x": jnp.ones((4, 3))})
    w, state, closed = s(w, state, {"x": jnp.ones((4, 3))})
    assert not bool(held["updated"]) and bool(closed["updated"])
    for key in held:
      assert held[key].dtype == closed[key].dtype, key
    assert closed["grad_norm"].dtype == jnp.float64


def ema_loss(p, ms, mb):
  return jnp.mean((mb["x"] @ p - 1) ** 2), {"ema": 0.5 * ms["ema"] + 0.5 * jnp.mean(mb["x"])}


@pytest.mark.parametrize("bad", [0, 1, 2])
@pytest.mark.parametrize("donate", [False, True], ids=["undonated", "donated"])
def test_a_voided_window_restores_the_model_state_the_window_found(bad, donate):
  """A NaN in any micro-batch of a window voids it: micro_step returns the float model state
  as the window found it, not the NaN of a later call nor the updates of the clean calls
  before the bad one (as train_step does). The next window then trains from it."""
  k = 3
  tx = ga.accumulate(optax.sgd(0.1), k)
  step = ga.micro_step(ema_loss, tx, has_state=True, donate=donate)
  w, ms = jnp.zeros(3), {"ema": jnp.asarray(0.25)}
  state = step.init(w, model_state=ms)
  rows = np.random.default_rng(0).standard_normal((k, 4, 3)).astype(np.float32)
  rows[bad, 0, 0] = np.nan
  for x in rows:
    w, ms, state, metrics = step(w, ms, state, {"x": jnp.asarray(x)})
  assert not bool(metrics["updated"]) and int(state.accumulate.num_skipped) == 1
  np.testing.assert_array_equal(w, jnp.zeros(3))
  assert float(ms["ema"]) == 0.25
  clean = np.random.default_rng(1).standard_normal((k, 4, 3)).astype(np.float32)
  fused = ga.train_step(ema_loss, ga.accumulate(optax.sgd(0.1), k), has_state=True)
  batch = {"x": jnp.asarray(clean.transpose(1, 0, 2).reshape(4 * k, 3))}  # row i + j k
  want_w, want_ms, *_ = fused(jnp.zeros(3), {"ema": jnp.asarray(0.25)}, tx.init(w), batch)
  for x in clean:
    w, ms, state, metrics = step(w, ms, state, {"x": jnp.asarray(x)})
  assert bool(metrics["updated"])
  assert_trees_close(w, want_w)
  assert_trees_close(ms, want_ms)


# --- narrow accumulators and shared windows (closed forms) ---------------------------------------


def linear_loss(w, mb):
  """The gradient of mean(x @ w) is the mean row of x: micro-batch i of rows c_i gives c_i."""
  return jnp.mean(mb["x"] @ w)


def rows_of(c):
  return {"x": jnp.full((4, 2), c, jnp.float32), "t": jnp.full((4,), 0.0)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_a_narrow_accumulator_applies_the_window_mean_once(dtype, k):
  """Before: bfloat16 and float16 accumulators applied k times the update (a plain sum of the
  calls' gradients closed as a running mean). sgd(1) from 0 on gradients 1..k: -(k + 1) / 2."""
  tx = ga.accumulate(optax.sgd(1.0), k, accum_dtype=jnp.dtype(dtype))
  step, w = ga.micro_step(linear_loss, tx), jnp.zeros(2)
  state = tx.init(w)
  for i in range(k):
    w, state, metrics = step(w, state, rows_of(i + 1.0))
  np.testing.assert_allclose(w, -(k + 1) / 2, rtol=1e-2 if dtype != "float32" else 1e-6)
  np.testing.assert_allclose(metrics["grad_norm"], (k + 1) / 2 * np.sqrt(2), rtol=1e-2)
  assert int(state.count) == 1 and int(state.micro_step) == 0


# Each mode's call, on the state any mode returned: ("m", c, w) a micro_step call on rows c of
# weight w, ("u", c, w) a tx.update, ("f",) a flush. The window's update is -sum(w c) / sum(w).
SHARED = [
  ([("m", 1.0, 1.0), ("u", 3.0, 1.0)], -2.0),
  ([("u", 1.0, 1.0), ("m", 3.0, 1.0)], -2.0),
  ([("m", 1.0, 1.0), ("m", 2.0, 1.0), ("f",)], -1.5),
  ([("m", 1.0, 2.0), ("m", 2.0, 1.0), ("m", 9.0, 0.0), ("m", 4.0, 5.0)], -(2 + 2 + 20) / 8),
  ([("u", 1.0, 2.0), ("m", 2.0, 1.0), ("u", 9.0, 0.0), ("m", 4.0, 5.0)], -(2 + 2 + 20) / 8),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("calls,expected", SHARED, ids=["m+u", "u+m", "m+m+flush", "m4", "umum"])
def test_streaming_modes_share_a_window_with_any_accumulator(dtype, calls, expected):
  """micro_step, tx.update and flush on one window, with uneven weights (one of 0): the update
  is the window's weighted mean, once (before, with bfloat16: 3, 4.5, 3 and 7 where 2, 2, 1.5
  and 3 are right); the closing micro_step's grad_norm is its norm."""
  k = sum(c[0] != "f" for c in calls) + (calls[-1][0] == "f")
  tx = ga.accumulate(optax.sgd(1.0), k, accum_dtype=jnp.dtype(dtype))
  step = ga.micro_step(linear_loss, tx, weight_fn=lambda mb: jnp.sum(mb["t"]) + mb["w"][0])
  update = jax.jit(lambda g, s, w, weight: tx.update(g, s, w, weight=weight))
  w, state, metrics = jnp.zeros(2), tx.init(jnp.zeros(2)), None
  for call in calls:
    if call[0] == "m":
      w, state, metrics = step(w, state, dict(rows_of(call[1]), w=jnp.full((4,), call[2])))
    elif call[0] == "u":
      u, state = update(jnp.full(2, call[1]), state, w, call[2])
      w = w + u
    else:
      u, state = ga.flush(tx, state, w)
      w = w + u
  tol = 2e-2 if dtype != "float32" else 1e-6
  np.testing.assert_allclose(w, expected, rtol=tol)
  assert int(state.count) == 1 and bool(ga.has_updated(state))
  if calls[-1][0] == "m":
    np.testing.assert_allclose(metrics["grad_norm"], -expected * np.sqrt(2), rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [None, "replicated"])
def test_the_returned_state_answers_every_accumulate_state_field(layout):
  """state.count, state.inner_state, ... of the state micro_step returns, as of every other
  mode's (before: AttributeError on the MicroStepState wrapper); acc_grads and acc_weight are
  the window's totals over the device slots."""
  mesh = None if layout is None else mesh_1d()
  tx = ga.accumulate(optax.sgd(1.0, momentum=0.9), 3)
  step = ga.micro_step(linear_loss, tx, mesh=mesh)
  w, state = jnp.zeros(2), tx.init(jnp.zeros(2))
  for c in (1.0, 2.0):
    mb = rows_of(c) if mesh is None else put(dict(x=jnp.full((D, 2), c)), mesh, P("data"))
    w, state, _ = step(w, state, mb)
  assert int(state.count) == 0 and int(state.micro_step) == 2 and int(state.num_skipped) == 0
  assert not bool(state.updated) and state.loss_scale is None and state.noise_scale is None
  assert jax.tree.structure(state.inner_state) == jax.tree.structure(tx.init(w).inner_state)
  np.testing.assert_allclose(state.acc_grads, [3.0, 3.0], rtol=1e-6)  # 1 + 2
  np.testing.assert_allclose(state.acc_weight, 2.0)
  for name in ga.AccumulateState._fields:
    getattr(state, name)
  with pytest.raises(AttributeError, match="no attribute 'acc'"):
    state.acc  # noqa: B018


def test_reading_a_field_totals_only_that_field_s_device_slots():
  """On a mesh, ``state.acc_weight``, ``state.noise_scale`` and the counters read no part of the
  accumulator (``acc_grads``'s slots are summed only when it is read); each total equals the
  slots summed by hand."""
  mesh = mesh_1d()
  tx = ga.accumulate(optax.sgd(1.0), 3, noise_scale_ema=0.9)
  step = ga.micro_step(linear_loss, tx, mesh=mesh)
  w, state = jnp.zeros(2), tx.init(jnp.zeros(2))
  for c in (1.0, 2.0):
    w, state, _ = step(w, state, put(dict(x=jnp.full((D, 2), c)), mesh, P("data")))
  acc = state.accumulate
  assert acc.acc_weight.shape == (D,)  # the device slots

  def sums_in(read):  # the reductions a read of the state traces, by operand shape
    eqns = jax.make_jaxpr(read)(state).eqns
    return sorted(tuple(e.invars[0].aval.shape) for e in eqns if e.primitive.name == "reduce_sum")

  assert sums_in(lambda s: s.acc_weight) == [(D,)]
  assert sums_in(lambda s: s.count) == sums_in(lambda s: s.inner_state) == []
  assert (D, 2) not in sums_in(lambda s: s.noise_scale)
  assert sums_in(lambda s: s.acc_grads) == [(D, 2)]
  np.testing.assert_array_equal(state.acc_weight, np.sum(np.asarray(acc.acc_weight), axis=0))
  np.testing.assert_array_equal(state.acc_grads, np.sum(np.asarray(acc.acc_grads), axis=0))
  np.testing.assert_array_equal(
    state.noise_scale.sq_sum, np.sum(np.asarray(acc.noise_scale.sq_sum), axis=0)
  )


@pytest.mark.slow
def test_the_transformation_holds_its_settings_and_copies_keep_them():
  """``tx.settings`` is stored on the transformation (not read back from ``tx.update``), and a
  copy keeps the settings and works as the original."""
  import copy

  tx = ga.accumulate(optax.sgd(0.5), 3, accum_dtype=jnp.bfloat16)
  assert "settings" in vars(tx) and tx.settings.num_microbatches == 3
  for twin in (copy.copy(tx), copy.deepcopy(tx)):
    assert (twin.num_microbatches, twin.accum_dtype) == (3, jnp.bfloat16)
    state = twin.init(jnp.zeros(2))
    for _ in range(3):
      updates, state = twin.update(jnp.ones(2), state, jnp.zeros(2))
    np.testing.assert_allclose(updates, [-0.5, -0.5])


@pytest.mark.slow
@pytest.mark.parametrize("features", ["plain", "loss_scale_noise_aux"])
def test_micro_step_reports_the_metrics_of_train_step_in_the_same_dtypes(features):
  """One function builds a closed window's metrics for every mode: micro_step's closing call
  reports train_step's keys (before: no "loss_scale" nor noise-scale metrics) in its dtypes,
  and their values for the same window (its "micro_step" aside)."""
  rich = features != "plain"
  kw = dict(loss_scale=ga.DynamicLossScale(2.0**4), noise_scale_ema=0.5) if rich else {}
  k, params = 4, init_mlp(jax.random.key(0), SIZES)
  batch = data(8 * k)

  def loss(p, mb):
    value = xent_loss(p, mb)
    return (value, {"n": jnp.sum(mb["y"] >= 0), "half": value / 2}) if rich else value

  tx = ga.accumulate(optax.adam(1e-2), k, **kw)
  _, _, fused = ga.train_step(loss, tx, has_aux=rich)(params, tx.init(params), batch)
  step = ga.micro_step(loss, tx, has_aux=rich)
  state = step.init(params, ga.microbatch(batch, 0, k)) if rich else tx.init(params)
  _, _, streamed = run_window(step, params, state, batch, k)
  assert set(streamed) - {"micro_step"} == set(fused)
  for key, value in jax.tree_util.tree_leaves_with_path(fused):
    got = jax.tree_util.tree_leaves_with_path(streamed)
    other = dict((jax.tree_util.keystr(p), v) for p, v in got)[jax.tree_util.keystr(key)]
    assert other.dtype == value.dtype, key
    np.testing.assert_allclose(other, value, rtol=2e-5, err_msg=jax.tree_util.keystr(key))
