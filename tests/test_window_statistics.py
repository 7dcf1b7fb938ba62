"""Window statistics: each aux leaf reduced over a window as ``aux_reduce`` says, in every mode.

The reference is computed independently: each micro-batch's statistics by a plain call of the
loss on its rows (``ga.microbatch``), reduced in numpy over the window's micro-batches of
positive weight (max, min, sum, weighted mean, the last), or from the whole batch's rows where
that is the same thing (the max of the maxima is the max over every row).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_1d
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

K = 4
SPEC = {"mean": "mean", "max": "max", "min": "min", "last": "last", "tokens": "sum",
        "sq": "sum", "any_big": "max"}  # fmt: skip


def loss_fn(w, mb):
  return stats(mb["x"] @ w, mb)


def stats(pred, mb):
  """The token-mean loss of predictions ``pred`` and its statistics."""
  err = jnp.sum((pred - mb["y"]) ** 2, axis=-1)
  mask = mb["n"] > 0
  loss = jnp.sum(err * mask) / jnp.sum(mask)
  aux = {
    "mean": loss, "max": jnp.max(jnp.where(mask, err, -jnp.inf)),
    "min": jnp.min(jnp.where(mask, err, jnp.inf)), "last": loss, "tokens": jnp.sum(mask),
    "sq": jnp.sum(err * mask), "any_big": jnp.any(err * mask > 3.0),
  }  # fmt: skip
  return loss, aux


def weight_fn(mb):
  return jnp.sum(mb["n"] > 0)


def _data(rows=8 * K * 2, empty=None):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k1, (rows, 8))
  n = (jnp.arange(rows) % 3).astype(jnp.int32)
  if empty is not None:  # micro-batch ``empty`` has no tokens
    n = n.at[empty::K].set(0)
  batch = {"x": x, "y": jax.random.normal(k2, (rows, 2)), "n": n}
  return jax.random.normal(k3, (8, 2)) / 3, batch


def reference(w, batch, weighted, num=K, devices=1):
  """The window's statistics from each micro-batch's own values (micro-batches 0..num-1), on
  ``devices`` devices each holding a contiguous ``1 / devices`` of the rows: per device, its
  rows of each micro-batch weigh ``weight_fn``'s (unweighted, ``1 / devices``); the maxima,
  minima and sums over every device's real micro-batches, the weighted mean over them, and
  the mean over the devices of each device's last real micro-batch's value."""
  rows = batch["x"].shape[0] // devices
  vals, weights = {}, {}
  for d in range(devices):
    chunk = jax.tree.map(lambda x, d=d: x[d * rows : (d + 1) * rows], batch)
    for i in range(num):
      mb = ga.microbatch(chunk, i, K)
      vals[i, d] = jax.tree.map(np.asarray, loss_fn(w, mb)[1])
      weights[i, d] = float(weight_fn(mb)) if weighted else 1.0 / devices
  real = [key for key in vals if weights[key] > 0]
  wsum = sum(weights[key] for key in real)
  last = [max(i for i, d2 in real if d2 == d) for d in range(devices)]
  return {
    "mean": sum(weights[key] * vals[key]["mean"] for key in real) / wsum,
    "max": max(vals[key]["max"] for key in real), "min": min(vals[key]["min"] for key in real),
    "last": np.mean([vals[i, d]["last"] for d, i in enumerate(last)]),
    "tokens": sum(vals[key]["tokens"] for key in real), "sq": sum(vals[key]["sq"] for key in real),
    "any_big": any(vals[key]["any_big"] for key in real),
  }  # fmt: skip


def assert_stats(got, want):
  assert set(got) == set(want)
  for name, value in want.items():
    np.testing.assert_allclose(np.asarray(got[name], np.float64), value, rtol=2e-6, err_msg=name)
  assert got["tokens"].dtype == jnp.int32 and got["any_big"].dtype == jnp.bool_
  assert got["max"].dtype == jnp.float32


def _mesh_kw(layout):
  if layout is None:
    return {}
  kw = {"mesh": mesh_1d()}
  if layout == "fsdp_per_microbatch":
    kw.update(param_specs=P("data"), gather_params="per_microbatch")
  return kw


def _run(entry, w, batch, layout, weighted, num_real=None):
  """The window's aux metrics from one entry point."""
  tx = ga.accumulate(optax.sgd(0.1), K)
  kw = {"has_aux": True, "aux_reduce": SPEC, "weight_fn": weight_fn if weighted else None}
  kw.update(_mesh_kw(layout))
  call = {} if num_real is None else {"num_real_microbatches": num_real}
  if entry == "train_step":
    return ga.train_step(loss_fn, tx, **kw)(w, tx.init(w), batch, **call)[2]["aux"]
  if entry == "value_and_grad":
    (_, aux), _ = jax.jit(ga.value_and_grad(loss_fn, K, **kw))(w, batch, **call)
    return aux
  kw.pop("gather_params", None)
  step = ga.micro_step(loss_fn, tx, **kw)
  state, p = step.init(w, ga.microbatch(batch, 0, K)), w
  for i in range(K):
    p, state, metrics = step(p, state, ga.microbatch(batch, i, K))
  return metrics["aux"]


@pytest.mark.slow
@pytest.mark.parametrize(
  "layout",
  [None, *(pytest.param(x, marks=pytest.mark.slow) for x in ("replicated", "fsdp_per_microbatch"))],
)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("entry", ["train_step", "value_and_grad", "micro_step"])
def test_each_reducer_equals_the_window_reference(entry, weighted, layout):
  """max, min, sum (int, float), max of a bool, the weighted mean and the last micro-batch of
  positive weight (weighted: the last micro-batch is empty, so it is micro-batch 2's); on 8
  devices too (the param sharded and gathered per micro-batch where the entry takes it)."""
  w, batch = _data(empty=K - 1 if weighted else None)
  got = _run(entry, w, batch, layout, weighted)
  assert_stats(got, reference(w, batch, weighted, devices=1 if layout is None else 8))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [None, "replicated"])
@pytest.mark.parametrize("entry", ["train_step", "value_and_grad"])
def test_a_short_window_reduces_its_real_microbatches(entry, layout):
  """num_real_microbatches=3: the statistics of micro-batches 0..2, as for the loss."""
  w, batch = _data()
  devices = 1 if layout is None else 8
  want = reference(w, batch, False, 3, devices)
  assert_stats(_run(entry, w, batch, layout, False, num_real=3), want)


@pytest.mark.slow
def test_a_window_split_by_a_checkpoint_and_a_new_layout_reduces_as_one():
  """micro_step on 8 devices for two micro-batches; the state saved (to host), restored into
  the single-device layout (convert_state), two more calls: the window's statistics are the
  uninterrupted window's (the max and min starts fill the other devices' slots)."""
  w, batch = _data()
  tx = ga.accumulate(optax.sgd(0.1), K)
  mesh = mesh_1d()
  on_mesh = ga.micro_step(loss_fn, tx, has_aux=True, aux_reduce=SPEC, mesh=mesh)
  local = ga.micro_step(loss_fn, tx, has_aux=True, aux_reduce=SPEC)
  state, p = on_mesh.init(w, ga.microbatch(batch, 0, K)), w
  for i in range(2):
    p, state, _ = on_mesh(p, state, ga.microbatch(batch, i, K))
  saved = jax.device_get(state)
  state = local.convert_state(saved, local.init(p, ga.microbatch(batch, 0, K)))
  for i in range(2, K):
    p, state, metrics = local(p, state, ga.microbatch(batch, i, K))
  assert bool(metrics["updated"])
  layout_free = ("max", "min", "tokens", "sq", "any_big")  # the same on any number of devices
  want = reference(w, batch, False)
  for name in layout_free:
    np.testing.assert_allclose(metrics["aux"][name], want[name], rtol=2e-6, err_msg=name)
  # and the reverse: a single-device state restored onto the mesh
  state, p = local.init(w, ga.microbatch(batch, 0, K)), w
  for i in range(2):
    p, state, _ = local(p, state, ga.microbatch(batch, i, K))
  state = on_mesh.convert_state(jax.device_get(state), on_mesh.init(p, ga.microbatch(batch, 0, K)))
  for i in range(2, K):
    p, state, metrics = on_mesh(p, state, ga.microbatch(batch, i, K))
  for name in layout_free:
    np.testing.assert_allclose(metrics["aux"][name], want[name], rtol=2e-6, err_msg=name)


@pytest.mark.slow
def test_linen_and_nnx_steps_reduce_as_the_reference():
  """The Flax front ends take aux_reduce too (a Dense layer, the same loss on its output)."""
  import flax.linen as nn
  from flax import nnx
  from flax.training import train_state

  w, batch = _data()
  tx = ga.accumulate(optax.sgd(0.1), K)

  net = nn.Dense(2, use_bias=False)
  ts = train_state.TrainState.create(apply_fn=net.apply, params={"kernel": w}, tx=tx)
  step = ga.linen_train_step(net, stats, has_aux=True, aux_reduce=SPEC)
  _, metrics = step(ts, batch)
  assert_stats(metrics["aux"], reference(w, batch, False))
  model = nnx.Linear(8, 2, use_bias=False, rngs=nnx.Rngs(0))
  model.kernel[...] = jnp.copy(w)  # the step may donate the model's buffers
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  nnx_step = ga.nnx_train_step(lambda m, mb: stats(m(mb["x"]), mb), has_aux=True, aux_reduce=SPEC)
  assert_stats(nnx_step(model, optimizer, batch)["aux"], reference(w, batch, False))


def _after_loop_all_reduces(report):
  """The dtypes each all-reduce after the loop reduces, as HLO names them."""
  ops = [c for c in report.collectives if c.kind == "all-reduce" and not c.in_loop]
  return sorted(
    tuple(sorted(set(re.findall(r"([a-z]+[0-9]*)\[", c.text.split(" all-reduce")[0])))) for c in ops
  )


@pytest.mark.slow
def test_on_a_mesh_the_reductions_run_once_after_the_loop():
  """No collective in the micro-batch loop; after it, the sums (the integer and bool counts
  too) in one float32 all-reduce, and the max and min leaves in one more per reduction and dtype:
  the max of float32 and of bool, the min of float32."""
  w, batch = _data()
  tx = ga.accumulate(optax.sgd(0.1), K)
  mesh = mesh_1d()
  reports = {}
  for name, spec in (("default", None), ("peaks", SPEC)):
    step = ga.train_step(loss_fn, tx, has_aux=True, aux_reduce=spec, mesh=mesh)
    reports[name] = ga.inspect_step(step, w, tx.init(w), batch)
  for r in reports.values():
    assert r.in_loop == {}, r
  assert _after_loop_all_reduces(reports["default"]) == [("f32",)], reports["default"]
  got = _after_loop_all_reduces(reports["peaks"])
  assert got == [("f32",), ("f32",), ("f32",), ("pred",)], reports["peaks"]
  reports["default"].check(max_in_loop=0, max_after_loop={"all-reduce": 1})


@pytest.mark.slow
def test_default_reducers_are_todays():
  """Without aux_reduce: float leaves the weighted mean, integer and bool leaves summed."""
  w, batch = _data(empty=1)
  tx = ga.accumulate(optax.sgd(0.1), K)
  metrics = ga.train_step(loss_fn, tx, has_aux=True, weight_fn=weight_fn)(w, tx.init(w), batch)[2]
  want = reference(w, batch, True)
  per = [loss_fn(w, ga.microbatch(batch, i, K))[1] for i in range(K)]
  np.testing.assert_allclose(metrics["aux"]["max"], want["mean"] * 0 + np.average(
    [p["max"] for i, p in enumerate(per) if i != 1],
    weights=[float(weight_fn(ga.microbatch(batch, i, K))) for i in range(K) if i != 1]), rtol=2e-6)  # fmt: skip
  assert int(metrics["aux"]["any_big"]) == sum(
    bool(p["any_big"]) for i, p in enumerate(per) if i != 1
  )


@pytest.mark.parametrize(
  "spec,kw,match",
  [
    ({"max": "maximum"}, {}, "reducer 'maximum'"),
    ("max", {"has_aux": False}, "without has_aux=True"),
  ],
)
def test_a_bad_reducer_name_is_refused_when_the_step_is_made(spec, kw, match):
  tx = ga.accumulate(optax.sgd(0.1), K)
  for make in (
    lambda: ga.train_step(loss_fn, tx, **{"has_aux": True, **kw}, aux_reduce=spec),
    lambda: ga.micro_step(loss_fn, tx, **{"has_aux": True, **kw}, aux_reduce=spec),
    lambda: ga.value_and_grad(loss_fn, K, **{"has_aux": True, **kw}, aux_reduce=spec),
  ):
    with pytest.raises(ValueError, match=match):
      make()


@pytest.mark.parametrize(
  "spec,match",
  [
    ({"max": "max", "nope": "min"}, r"names the key 'nope'.*keys there are \['any_big', 'last',"),
    (("max", "min"), "pytree prefix of the aux"),
    ({**SPEC, "tokens": "mean"}, "mean of the integer aux leaf \\['tokens'\\]"),
  ],
)
def test_a_spec_that_does_not_fit_the_aux_is_refused_at_trace_time(spec, match):
  w, batch = _data()
  tx = ga.accumulate(optax.sgd(0.1), K)
  step = ga.train_step(loss_fn, tx, has_aux=True, aux_reduce=spec)
  with pytest.raises(ValueError, match=f"^train_step: aux_reduce.*{match}"):
    step(w, tx.init(w), batch)


@pytest.mark.slow
def test_a_partial_dict_names_some_keys_and_the_rest_keep_the_default():
  """{"tokens": "sum", "max": "max"}: those two as named, every other leaf as without
  aux_reduce (float leaves the weighted mean, the bool leaf summed: a count); nested too."""
  w, batch = _data(empty=1)
  tx = ga.accumulate(optax.sgd(0.1), K)
  per = [loss_fn(w, ga.microbatch(batch, i, K))[1] for i in range(K)]
  weights = np.array([float(weight_fn(ga.microbatch(batch, i, K))) for i in range(K)])
  real = weights > 0
  for spec in ({"tokens": "sum", "max": "max"}, {"tokens": "sum", "max": "max", "min": None}):
    step = ga.train_step(loss_fn, tx, has_aux=True, weight_fn=weight_fn, aux_reduce=spec)
    got = step(w, tx.init(w), batch)[2]["aux"]
    for name in ("mean", "min", "last", "sq"):  # float leaves: the weighted mean
      want = np.average([float(p[name]) for p in per if p["tokens"]], weights=weights[real])
      np.testing.assert_allclose(got[name], want, rtol=2e-6, err_msg=name)
    assert int(got["tokens"]) == sum(int(p["tokens"]) for p in per)
    kept = [p for p, r in zip(per, real, strict=True) if r]
    assert int(got["any_big"]) == sum(bool(p["any_big"]) for p in kept)
    np.testing.assert_allclose(got["max"], max(float(p["max"]) for p in kept))

  def nested(w, mb):
    loss, aux = loss_fn(w, mb)
    return loss, {"stats": aux, "steps": jnp.ones((), jnp.int32)}

  spec = {"stats": {"max": "max"}}
  got = ga.train_step(nested, tx, has_aux=True, aux_reduce=spec)(w, tx.init(w), batch)[2]["aux"]
  assert int(got["steps"]) == K  # the default: summed
  np.testing.assert_allclose(got["stats"]["max"], max(float(p["max"]) for p in per), rtol=2e-6)
  step = ga.train_step(nested, tx, has_aux=True, aux_reduce={"stats": {"nope": "max"}})
  with pytest.raises(ValueError, match=r"names the key 'nope'.* at \['stats'\]; its keys there"):
    step(w, tx.init(w), batch)


E, D = 4, 8
MOE_SPEC = {"counts": "sum", "prob_sum": "sum", "tokens": "sum", "max_logit": "max"}


def moe_loss(params, bias, mb):
  """A top-2 mixture of 4 linear experts; ``bias`` (model state) only steers the routing."""
  logits = mb["x"] @ params["router"]
  _, top = jax.lax.top_k(logits + bias, 2)
  gates = jax.nn.softmax(jnp.take_along_axis(logits, top, axis=1))
  outs = jnp.einsum("td,edf->tef", mb["x"], params["experts"])
  out = jnp.sum(gates[..., None] * jnp.take_along_axis(outs, top[..., None], axis=1), axis=1)
  stats = {
    "counts": jnp.sum(jax.nn.one_hot(top, E, dtype=jnp.int32), axis=(0, 1)),
    "prob_sum": jnp.sum(jax.nn.softmax(logits), axis=0),
    "tokens": jnp.asarray(mb["x"].shape[0], jnp.int32),
    "max_logit": jnp.max(logits),
  }
  return jnp.mean((out - mb["y"]) ** 2), (stats, bias)


def _moe_data(rows=128):
  keys = jax.random.split(jax.random.key(7), 4)
  params = {"router": jax.random.normal(keys[0], (D, E)),
            "experts": jax.random.normal(keys[1], (E, D, D)) / 3}  # fmt: skip
  batch = {"x": jax.random.normal(keys[2], (rows, D)), "y": jax.random.normal(keys[3], (rows, D))}
  return params, jnp.linspace(-0.5, 0.5, E), batch


def _balance(stats):
  fraction, prob = stats["counts"] / (2 * stats["tokens"]), stats["prob_sum"] / stats["tokens"]
  return E * jnp.sum(fraction * prob)


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("layout", [None, "replicated"])
def test_moe_window_statistics_and_bias_update_equal_the_whole_batch(remat, layout):
  """Top-2 of 4 experts: the window's tokens per expert equal the whole batch's exactly, with
  jax.checkpoint (recomputation cannot count twice: statistics are outputs) and on 8 devices;
  the load-balance loss from the window's sums, the auxiliary-loss-free bias update from its
  counts and the params after one SGD step are the whole batch's."""
  params, bias, batch = _moe_data()
  loss = jax.checkpoint(moe_loss) if remat else moe_loss
  tx = ga.accumulate(optax.sgd(0.1), K)
  step = ga.train_step(
    loss, tx, has_aux=True, has_state=True, aux_reduce=MOE_SPEC, **_mesh_kw(layout)
  )
  new_params, same_bias, _, metrics = step(params, bias, tx.init(params), batch)
  stats = metrics["aux"]
  (whole_loss, (whole, _)), grads = jax.value_and_grad(moe_loss, has_aux=True)(params, bias, batch)
  np.testing.assert_array_equal(stats["counts"], whole["counts"])
  assert stats["counts"].dtype == jnp.int32 and int(stats["tokens"]) == batch["x"].shape[0]
  np.testing.assert_allclose(_balance(stats), _balance(whole), rtol=1e-6)
  np.testing.assert_allclose(stats["max_logit"], whole["max_logit"], rtol=1e-6)  # matmul rounding
  update = 1e-3 * jnp.sign(jnp.mean(stats["counts"]) - stats["counts"])
  whole_update = 1e-3 * jnp.sign(jnp.mean(whole["counts"]) - whole["counts"])
  np.testing.assert_array_equal(same_bias + update, bias + whole_update)
  np.testing.assert_allclose(metrics["loss"], whole_loss, rtol=1e-6)
  want = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_moe_counts_with_micro_step_come_with_the_closing_call():
  params, bias, batch = _moe_data()
  tx = ga.accumulate(optax.sgd(0.1), K)
  step = ga.micro_step(moe_loss, tx, has_aux=True, has_state=True, aux_reduce=MOE_SPEC)
  p, b = params, bias
  state = step.init(params, ga.microbatch(batch, 0, K), model_state=bias)
  for i in range(K):
    p, b, state, metrics = step(p, b, state, ga.microbatch(batch, i, K))
  _, (whole, _) = moe_loss(params, bias, batch)
  assert bool(metrics["updated"])
  np.testing.assert_array_equal(metrics["aux"]["counts"], whole["counts"])


@pytest.mark.slow
def test_a_voided_window_reports_its_statistics_and_the_next_starts_afresh():
  """A NaN in micro-batch 2 voids the window (params kept), whose statistics are reported as
  its loss is (the max of a NaN row is NaN); in micro_step, whose reductions are state, the
  next window's statistics are the reference's: nothing of the voided window is left."""
  w, batch = _data()
  bad = dict(batch, x=batch["x"].at[2].set(jnp.nan))  # row 2: micro-batch 2
  tx = ga.accumulate(optax.sgd(0.1), K)
  p1, _, m1 = ga.train_step(loss_fn, tx, has_aux=True, aux_reduce=SPEC)(w, tx.init(w), bad)
  assert not bool(m1["updated"]) and np.isnan(m1["aux"]["max"]) and np.isnan(m1["loss"])
  np.testing.assert_array_equal(p1, w)
  step = ga.micro_step(loss_fn, tx, has_aux=True, aux_reduce=SPEC)
  state, p = step.init(w, ga.microbatch(batch, 0, K)), w
  for data in (bad, batch):
    for i in range(K):
      p, state, metrics = step(p, state, ga.microbatch(data, i, K))
    if data is bad:
      assert not bool(metrics["updated"]) and np.isnan(metrics["aux"]["max"])
  assert bool(metrics["updated"])
  assert_stats(metrics["aux"], reference(w, batch, False))


# --- a new reducer is one entry; integer sums on a mesh; a vector "last" on a mesh -----------


def _absmax_add(acc, x, w, weighted):
  x = jnp.abs(x)
  return jnp.maximum(acc, jnp.where(w > 0, x, 0) if weighted else x).astype(acc.dtype)


def _absmax_merge(acc, more, more_weight):
  del more_weight
  return jnp.maximum(acc, more)


def _window_aux(entry, loss, tx, kw, w, batch):
  """The window's aux from one fused step, or from K micro_step calls on its micro-batches."""
  if entry == "train_step":
    return ga.train_step(loss, tx, **kw)(w, tx.init(w), batch)[2]["aux"]
  step = ga.micro_step(loss, tx, **kw)
  state, p = step.init(w, ga.microbatch(batch, 0, K)), w
  for i in range(K):
    p, state, metrics = step(p, state, ga.microbatch(batch, i, K))
  return metrics["aux"]


def _extremes_loss(w, mb):
  """The loss and the most negative prediction of the micro-batch's real rows (+inf for none)."""
  loss, aux = loss_fn(w, mb)
  pred = (mb["x"] @ w)[:, 0]
  return loss, {"lo": jnp.min(jnp.where(mb["n"] > 0, pred, jnp.inf)), "tokens": aux["tokens"]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [None, "replicated"])
@pytest.mark.parametrize("entry", ["train_step", "micro_step"])
def test_a_new_reducer_is_one_table_entry(monkeypatch, entry, layout):
  """A toy "absmax" (the largest magnitude over the micro-batches and devices of positive
  weight), defined here as one entry of the table and nothing else, equals its closed form
  max_i |x_i| over the window: on one device and on 8 (a max over devices, and over the device
  slots of micro_step), the empty micro-batch (whose value is +inf) left out."""
  from gradaccum_jax import _parts

  tx = ga.accumulate(optax.sgd(0.1), K)
  spec = {"lo": "absmax"}
  with pytest.raises(ValueError, match="reducer 'absmax'"):  # not a reducer before the entry
    ga.train_step(_extremes_loss, tx, has_aux=True, aux_reduce=spec)
  entry_of_the_table = _parts.Reducer(
    start=lambda dtype: 0, add=_absmax_add, merge=_absmax_merge, collective="max"
  )
  monkeypatch.setitem(_parts.REDUCERS, "absmax", entry_of_the_table)
  w, batch = _data(empty=K - 1)
  kw = {"has_aux": True, "aux_reduce": spec, "weight_fn": weight_fn, **_mesh_kw(layout)}
  got = _window_aux(entry, _extremes_loss, tx, kw, w, batch)
  devices = 1 if layout is None else 8
  rows = batch["x"].shape[0] // devices
  values = []  # each device's value of each micro-batch of positive weight
  for d in range(devices):
    chunk = jax.tree.map(lambda x, d=d: np.asarray(x[d * rows : (d + 1) * rows]), batch)
    for i in range(K):
      mb = jax.tree.map(lambda x, i=i: x[i::K], chunk)
      if (mb["n"] > 0).any():
        values.append((mb["x"] @ np.asarray(w))[mb["n"] > 0, 0].min())
  assert len(values) == devices * (K - 1)
  np.testing.assert_allclose(got["lo"], max(abs(v) for v in values), rtol=1e-6)
  assert int(got["tokens"]) == int(np.sum(np.asarray(batch["n"]) > 0))  # the default kept


def _wrapping_loss(w, mb):
  """Integer statistics near int32's ends, so that a window's sum wraps around."""
  loss, aux = loss_fn(w, mb)
  big = jnp.int32(2**31 - 5) - aux["tokens"]
  return loss, {"big": big, "small": jnp.int32(-(2**31) + 3) + aux["tokens"], "mean": aux["mean"]}


def _int32(value):
  """A Python int as int32 wraps it (two's complement modulo 2**32)."""
  return (value + 2**31) % 2**32 - 2**31


@pytest.mark.parametrize("layout", [None, pytest.param("replicated", marks=pytest.mark.slow)])
@pytest.mark.parametrize("entry", ["train_step", "micro_step"])
def test_integer_sums_are_exact_and_wrap_as_int32(entry, layout):
  """Summed over the window's micro-batches and devices (on 8, in the float32 all-reduce as
  parts of 21 bits), int32 statistics near 2**31 equal their closed form: n c - T for n
  (device, micro-batch) pairs of c = 2**31 - 5 minus their tokens, wrapped as int32 sums wrap."""
  w, batch = _data()
  tx = ga.accumulate(optax.sgd(0.1), K)
  kw = {"has_aux": True, **_mesh_kw(layout)}
  got = _window_aux(entry, _wrapping_loss, tx, kw, w, batch)
  pairs = K * (1 if layout is None else 8)
  tokens = int(np.sum(np.asarray(batch["n"]) > 0))
  assert got["big"].dtype == jnp.int32
  assert int(got["big"]) == _int32(pairs * (2**31 - 5) - tokens)
  assert int(got["small"]) == _int32(pairs * (-(2**31) + 3) + tokens)


@pytest.mark.parametrize("devices", [1, 2, 3, 8, 255, 256, 257, 4096, 2**20])
@pytest.mark.parametrize("value", [-1, -(2**31), 2**31 - 1, 123_456_789])
def test_integer_parts_summed_in_float32_are_exact_for_any_device_count(devices, value):
  """The worst case of the float32 parts: every device sends the same int32 (-1: every part at
  its largest); their float32 sum, in any order, gives back devices * value wrapped as int32."""
  from gradaccum_jax import _sharding

  bits = _sharding._part_bits(devices)
  assert devices * (2**bits - 1) < 2**24  # each part's sum is an exact float32 integer
  parts = np.asarray(_sharding._as_float32_parts(jnp.int32(value), bits))
  assert parts.dtype == np.float32 and parts.max() < 2**bits
  summed = np.sum(np.broadcast_to(parts, (devices, *parts.shape)), axis=0, dtype=np.float32)
  back = _sharding._from_float32_parts(jnp.asarray(summed), jnp.int32(0), bits)
  assert back.dtype == jnp.int32 and int(back) == _int32(devices * value)


@pytest.mark.parametrize("entry", ["train_step", "micro_step"])
def test_a_vector_last_on_a_mesh_is_each_devices_last_real_value(entry):
  """A "last" leaf of 8 values on 8 devices whose last micro-batch is empty on the even ones:
  each device's last micro-batch of positive weight, the mean over the devices (micro_step
  merges its device slots by each slot's own weight)."""
  w, batch = _data()
  rows, devices = batch["x"].shape[0], 8
  r = np.arange(rows)
  empty = ((r // (rows // devices)) % 2 == 0) & (r % K == K - 1)
  batch = dict(batch, n=jnp.where(empty, 0, 1).astype(jnp.int32))

  def vector_loss(w, mb):
    real = (mb["n"] > 0)[:, None]
    return loss_fn(w, mb)[0], {"v": jnp.sum(jnp.where(real, mb["x"], 0), axis=0)}

  tx = ga.accumulate(optax.sgd(0.1), K)
  mesh = jax.make_mesh((devices,), ("data",))
  kw = {"has_aux": True, "aux_reduce": "last", "weight_fn": weight_fn, "mesh": mesh}
  if entry == "train_step":
    got = ga.train_step(vector_loss, tx, **kw)(w, tx.init(w), batch)[2]["aux"]["v"]
  else:
    step = ga.micro_step(vector_loss, tx, **kw)
    state, p = step.init(w, ga.microbatch(batch, 0, K)), w
    for i in range(K):
      p, state, metrics = step(p, state, ga.microbatch(batch, i, K))
    got = metrics["aux"]["v"]
  x, n, per = np.asarray(batch["x"]), np.asarray(batch["n"]), rows // devices
  want = []
  for d in range(devices):
    last = K - 2 if d % 2 == 0 else K - 1
    rows_d = [q for q in range(d * per, (d + 1) * per) if q % K == last and n[q] > 0]
    want.append(x[rows_d].sum(axis=0))
  np.testing.assert_allclose(got, np.mean(want, axis=0), rtol=1e-5, atol=1e-6)
