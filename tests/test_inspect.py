"""ga.inspect_step and ga.check_step on 8 CPU devices: the collectives of the compiled step, where
they run and what they move, its memory, and one window against the whole-batch update."""

import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import init_mlp, xent_loss
from jax.sharding import PartitionSpec as P
from test_sharding import FSDP, SIZES, D, data, mesh_1d, naive_window, put, token_batch, token_loss

import gradaccum_jax as ga

PARAMS = init_mlp(jax.random.key(0), SIZES)
PARAM_BYTES = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(PARAMS))  # float32 leaves
LEAVES = len(jax.tree.leaves(PARAMS))


def built(k, specs=None, gather="once", inner=None, loss_fn=xent_loss, batch=None, **kwargs):
  """``(step, its arguments)`` of ga.train_step on the 8-device mesh."""
  mesh = mesh_1d()
  tx = ga.accumulate(inner or optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), k)
  step = ga.train_step(loss_fn, tx, mesh=mesh, param_specs=specs, gather_params=gather, **kwargs)
  p = put(PARAMS, mesh, P() if specs is None else specs)
  batch = data(D * k * 2) if batch is None else batch
  return step, (p, tx.init(p), put(batch, mesh, P("data")))


def close(a, b):
  return abs(a - b) <= 0.01 * b


# --- the reader, on a hand-written module: every count known ----------------------------------

HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%gather_fusion (p: f32[4]) -> f32[32] {
  ROOT %ag = f32[32]{0} all-gather(f32[4]{0} %p), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %f = f32[32]{0} fusion(f32[4]{0} %x), kind=kLoop, calls=%gather_fusion
  %ars = bf16[4,2]{1,0} all-reduce-start(bf16[4,2]{1,0} %y), to_apply=%add
  %ard = bf16[4,2]{1,0} all-reduce-done(bf16[4,2]{1,0} %ars)
  ROOT %t2 = (s32[], f32[4]) tuple(%i, %x)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

%branch (q: f32[8]) -> f32[1] {
  ROOT %rs = f32[1]{0} reduce-scatter(f32[8]{0} %q), dimensions={0}, to_apply=%add
}

%other (q: f32[8]) -> f32[8] {
  ROOT %cp = f32[8]{0} collective-permute(f32[8]{0} %q), source_target_pairs={{0,1}}
}

ENTRY %main (x: f32[4]) -> (f32[], f32[16]) {
  %w = (s32[], f32[4]) while((s32[], f32[4]) %t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %c = f32[1]{0} conditional(pred[] %p, f32[8]{0} %q, f32[8]{0} %q), true_computation=%branch, false_computation=%other
  %ags = (f32[2]{0}, f32[16]{0}) all-gather-start(f32[2]{0} %z), dimensions={0}
  %agd = f32[16]{0} all-gather-done((f32[2]{0}, f32[16]{0}) %ags)
  ROOT %ar = (f32[], f32[3,5]{1,0}) all-reduce(f32[] %l, f32[3,5]{1,0} %g), to_apply=%add
}
"""


class FakeCompiled:
  def __init__(self, text, memory=None):
    self.text, self.memory = text, memory

  def as_text(self):
    return self.text

  def memory_analysis(self):
    return self.memory


def test_the_reader_counts_loops_branches_fusions_and_async_pairs_once():
  report = ga.StepReport.from_compiled(FakeCompiled(HLO))
  assert report.in_loop == {"all-gather": 1, "all-reduce": 1}  # via the fusion; start/done once
  assert report.in_loop_bytes == {"all-gather": 32 * 4, "all-reduce": 8 * 2}
  assert report.after_loop == {"reduce-scatter": 1, "collective-permute": 1, "all-gather": 1, "all-reduce": 1}  # fmt: skip
  assert report.after_loop_bytes == {
    "reduce-scatter": 4, "collective-permute": 32, "all-gather": 64, "all-reduce": 4 + 60,
  }  # fmt: skip
  by_name = {c.name: c for c in report.collectives}
  assert set(by_name) == {"ag", "ard", "rs", "cp", "agd", "ar"}
  assert by_name["rs"].in_branch and by_name["cp"].in_branch and not by_name["ar"].in_branch
  assert by_name["ar"].shapes == ((), (3, 5)) and by_name["ag"].computation == "gather_fusion"
  assert report.loops == (ga._inspect.Loop("w", "main", 6, False),)
  assert report.peak_bytes is None and "no memory" not in repr(report)


# --- ga.train_step on the mesh: where its collectives run, what they move -----------------------


@pytest.mark.slow
def test_a_replicated_step_reduces_once_after_the_loop_whatever_k():
  found = {}
  for k in (2, 4, 8):
    step, args = built(k)
    report = found[k] = ga.inspect_step(step, *args)
    assert report.in_loop == {} and report.after_loop == {"all-reduce": 1}, report
    assert k in [loop.trip_count for loop in report.loops], report.loops
    # The gradients and the loss sum, one tuple all-reduce: the params' bytes and a scalar.
    assert close(report.after_loop_bytes["all-reduce"], PARAM_BYTES), report
    report.check(max_in_loop=0, max_after_loop={"all-reduce": 1})
  shapes = {k: [(c.kind, c.shapes) for c in r.collectives] for k, r in found.items()}
  assert shapes[2] == shapes[4] == shapes[8], shapes
  assert "all-reduce" in repr(found[2]) and "trips" in repr(found[2])


@pytest.mark.slow
def test_a_plain_jit_of_a_scan_reduces_in_the_loop_and_fails_the_check():
  mesh, k = mesh_1d(), 4
  batch = put(data(D * k * 2), mesh, P("data"))
  step = jax.jit(naive_window, static_argnums=2)
  report = ga.inspect_step(step, put(PARAMS, mesh, P()), batch, k)
  assert report.in_loop.get("all-reduce", 0) >= 1, report
  with pytest.raises(ValueError, match=r"all-reduce in a loop \(allowed 0\)") as err:
    report.check(max_in_loop=0)
  for c in report.collectives:
    assert (f"%{c.name} in %{c.computation} ({c.bytes} bytes)" in str(err.value)) == c.in_loop
  report.check(max_in_loop=None)  # no budget: passes


@pytest.mark.slow
def test_fsdp_gathers_and_reduce_scatters_outside_the_loop_once_and_inside_per_microbatch():
  for gather in ("once", "per_microbatch"):
    step, args = built(4, FSDP, gather)
    report = ga.inspect_step(step, *args)
    inside, outside = (
      (report.in_loop, report.after_loop)
      if gather == "per_microbatch"
      else (report.after_loop, report.in_loop)
    )
    sizes = report.in_loop_bytes if gather == "per_microbatch" else report.after_loop_bytes
    # One all-gather of every param (to its full size), one reduce-scatter of its gradient
    # (to its 1/D shard); on the other side of the loop neither (only scalar all-reduces).
    assert inside["all-gather"] == inside["reduce-scatter"] == LEAVES, report
    assert not {"all-gather", "reduce-scatter"} & set(outside), report
    assert close(sizes["all-gather"], PARAM_BYTES), (sizes, PARAM_BYTES)
    assert close(sizes["reduce-scatter"], PARAM_BYTES / D), (sizes, PARAM_BYTES)
    budget = {"all-gather": LEAVES, "reduce-scatter": LEAVES, "all-reduce": 2}
    if gather == "once":
      report.check(max_in_loop=0, max_after_loop=budget)
    else:
      with pytest.raises(ValueError, match="all-gather in a loop"):
        report.check(max_in_loop=0)


@pytest.mark.slow
def test_peak_bytes_is_the_compiled_memory_analysis_and_nothing_runs():
  calls = []

  def loss_fn(params, mb):
    jax.debug.callback(lambda: calls.append(1))
    return xent_loss(params, mb)

  step, args = built(2, FSDP, loss_fn=loss_fn)
  report = ga.inspect_step(step, *args)
  assert calls == []  # compiled, not run
  m = step.lower(*args).compile().memory_analysis()
  expected = (
    m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
  )
  assert report.peak_bytes == expected > 0
  assert (report.temp_bytes, report.argument_bytes) == (m.temp_size_in_bytes, m.argument_size_in_bytes)  # fmt: skip
  report.check(max_peak_bytes=expected)
  with pytest.raises(ValueError, match=rf"peak_bytes={expected} > max_peak_bytes={expected - 1}"):
    report.check(max_peak_bytes=expected - 1)
  jax.block_until_ready(step(*args))
  jax.effects_barrier()
  assert calls  # the callback does run when the step runs


# --- one window against the single-device whole-batch update -----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
  "specs,gather",
  [(None, "once"), (FSDP, "once"), (FSDP, "per_microbatch")],
  ids=["replicated", "fsdp_once", "fsdp_per_microbatch"],
)
def test_check_step_passes_for_ga_steps(specs, gather):
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  step, args = built(4, specs, gather, inner=inner, donate=True)
  before = jax.tree.map(np.asarray, args)
  result = ga.check_step(step, xent_loss, inner, *args)
  assert result.ok, str(result)
  assert set(result.max_rel) == {"['layer0']['b']", "['layer0']['w']", "['layer1']['b']", "['layer1']['w']"}  # fmt: skip
  assert result.scale > 0 and max(result.max_rel.values()) <= result.rtol
  # The arguments are intact (the step ran on copies, donated).
  for a, b in zip(jax.tree.leaves(args), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)


@contextlib.contextmanager
def compiles():
  """The programs XLA compiles inside the block, as jax logs them."""
  names = []

  class Handler(logging.Handler):
    def emit(self, record):
      if "Finished XLA compilation of " in (message := record.getMessage()):
        names.append(message.split("compilation of ")[1].split(" in ")[0])

  handler = Handler()
  logging.getLogger("jax").addHandler(handler)
  try:
    with jax.log_compiles(True):
      yield names
  finally:
    logging.getLogger("jax").removeHandler(handler)


@pytest.mark.slow
def test_each_check_compiles_the_step_and_one_reference():
  """inspect_step compiles the step once; check_step runs it (one compile) and one reference
  program (the whole batch's gradient and what inner_tx makes of it and of the gradients near
  it); check_equivalence compiles the accumulation and one program for the whole batch and
  every micro-batch. Nothing else compiles: no copy, no eager op on the host's numbers."""
  inner = optax.adam(1e-2)
  for check, expected in (("inspect_step", 1), ("check_step", 2), ("check_equivalence", 2)):
    step, args = built(4, inner=inner)
    jax.block_until_ready(args)
    with compiles() as names:
      if check == "inspect_step":
        ga.inspect_step(step, *args)
      elif check == "check_step":
        assert ga.check_step(step, xent_loss, inner, *args).ok
      else:
        assert ga.check_equivalence(xent_loss, args[0], args[2], 4, mesh=mesh_1d()).ok
    assert len(names) == expected, (check, names)


def shard_map_step(inner, loss_fn, reduce):
  """A hand-written data-parallel step: per-device gradients of ``loss_fn``, ``reduce``d."""
  mesh = mesh_1d()

  def grads(params, batch):
    return reduce(jax.grad(loss_fn)(params, batch))

  @jax.jit
  def step(params, opt_state, batch):
    g = jax.shard_map(grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(params, batch)
    updates, opt_state = inner.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


# Under shard_map the gradient of replicated params comes summed over the devices already (the
# transpose of their implicit broadcast to every device): the mean is that sum over D, and a
# pmean on top of it reduces the gradient a second time (D times the mean).
def mean(tree):
  return jax.tree.map(lambda g: g / D, tree)


def pmean_again(tree):
  return jax.tree.map(lambda g: jax.lax.pmean(g, "data"), tree)


@pytest.mark.slow
@pytest.mark.parametrize(
  "name,loss_fn,reduce,batch,inner,ok",
  [
    ("equal rows, the mean", xent_loss, mean, data(D * 4), optax.sgd(0.1), True),
    ("uneven tokens, mean of means", token_loss, mean, token_batch(D * 2), optax.sgd(0.1), False),
    ("gradient reduced twice", xent_loss, pmean_again, data(D * 4), optax.sgd(0.1), False),
    # Adam's first update is about lr * sign(g), but its first moment holds the gradient itself,
    # which check_step reads: the scale error is caught.
    ("reduced twice, adam", xent_loss, pmean_again, data(D * 4), optax.adam(1e-2), False),
  ],
  ids=["mean", "mean_of_means", "reduced_twice", "reduced_twice_adam"],
)
def test_check_step_flags_hand_written_steps_that_are_not_the_big_batch(
  name, loss_fn, reduce, batch, inner, ok
):
  if loss_fn is token_loss:  # the devices really hold different numbers of tokens
    assert len(set(batch["mask"].reshape(D, -1).sum(1).tolist())) > 1
  mesh = mesh_1d()
  p = put(PARAMS, mesh, P())
  result = ga.check_step(
    shard_map_step(inner, loss_fn, reduce), loss_fn, inner, p, inner.init(p), put(batch, mesh, P("data"))
  )  # fmt: skip
  assert result.ok == ok, (name, str(result))
  assert ("NOT equivalent" in str(result)) != ok and ("<- differs" in str(result)) != ok


def toy_loss(params, batch):  # docs/verifying.md's
  hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


@pytest.mark.slow
def test_a_gradient_reduced_twice_fails_by_d_minus_1_with_sgd_and_by_a_small_margin_with_adam():
  """docs/verifying.md: with Adam the distance is small (here above the default rtol), with
  SGD it is D - 1 times the update."""
  rng = np.random.default_rng(0)
  params = {
    "w1": rng.standard_normal((8, 32)).astype(np.float32) / 3,
    "b1": np.zeros(32, np.float32),
    "w2": rng.standard_normal((32, 1)).astype(np.float32) / 6,
  }
  rows = D * 8
  batch = {"x": rng.standard_normal((rows, 8)), "y": rng.standard_normal((rows, 1))}
  batch = jax.tree.map(lambda x: x.astype(np.float32), batch)
  mesh = mesh_1d()
  p, b = put(params, mesh, P()), put(batch, mesh, P("data"))
  distance = {}
  for name, inner in (("adam", optax.adam(1e-3)), ("sgd", optax.sgd(0.1))):
    step = shard_map_step(inner, toy_loss, pmean_again)
    result = ga.check_step(step, toy_loss, inner, p, inner.init(p), b)
    assert not result.ok, (name, str(result))
    distance[name] = max(result.max_rel.values())
  assert 1e-4 < distance["adam"] < 1e-2, distance
  np.testing.assert_allclose(distance["sgd"], D - 1, rtol=1e-3)


def counted_loss(params, batch):
  """The MLP's loss and integer window statistics beside a float one (an MoE's counts, say)."""
  logits = batch["x"] @ params["layer0"]["w"] + params["layer0"]["b"]
  logits = jnp.tanh(logits) @ params["layer1"]["w"] + params["layer1"]["b"]
  aux = {
    "per_class": jnp.sum(jax.nn.one_hot(jnp.argmax(logits, -1), 8, dtype=jnp.int32), 0),
    "rows": jnp.asarray(batch["x"].shape[0], jnp.int32),
    "max_logit": jnp.max(logits),
  }
  return xent_loss(params, batch), aux


@pytest.mark.slow
def test_integer_window_statistics_share_the_one_all_reduce_after_the_loop():
  """Integer counts beside the float sums: one all-reduce after the loop, of float32 only (the
  budget of docs/verifying.md holds); a max adds one more, and the over-budget message lists
  each op's dtypes and says that ops after the loop already run once per window."""
  sums = {"per_class": "sum", "rows": "sum"}  # the rest: defaults (max_logit a weighted mean)
  step, args = built(4, loss_fn=counted_loss, has_aux=True, aux_reduce=sums)
  report = ga.inspect_step(step, *args)
  assert report.in_loop == {} and report.after_loop == {"all-reduce": 1}, report
  (op,) = report.collectives
  assert "s32[" not in op.text.split(" all-reduce")[0], op.text
  report.check(max_in_loop=0, max_after_loop={"all-reduce": 1, "all-gather": 0})
  metrics = step(*args)[2]
  assert (
    int(metrics["aux"]["rows"]) == D * 4 * 2 and int(jnp.sum(metrics["aux"]["per_class"])) == D * 8
  )

  step, args = built(4, loss_fn=counted_loss, has_aux=True, aux_reduce={**sums, "max_logit": "max"})
  report = ga.inspect_step(step, *args)
  assert report.after_loop == {"all-reduce": 2}, report
  with pytest.raises(ValueError, match="2 all-reduce outside loops") as err:
    report.check(max_in_loop=0, max_after_loop={"all-reduce": 1})
  message = str(err.value)
  assert "run once per window already" in message and "out of it" not in message, message
  assert message.count("[f32]") == 2, message  # the sums' and the max's, each named


# --- a model of stacked layers: which loop is the window's, which reductions come before it -----

L = 3  # blocks stacked under one lax.scan


def stacked_params():
  rng = np.random.default_rng(0)
  return {
    "blocks": rng.standard_normal((L, SIZES[0], SIZES[0])).astype(np.float32) / 3,
    "out": rng.standard_normal((SIZES[0], SIZES[-1])).astype(np.float32) / 3,
  }


def stacked_logits(params, x):
  """L tanh blocks under one lax.scan (the model's own loop), then a linear head."""
  h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["blocks"])
  return h @ params["out"]


def stacked_stats(params, mb):
  """Window statistics, forward only: a count (summed) and the largest logit."""
  return {"rows": jnp.sum(mb["y"] >= 0), "top": jnp.max(stacked_logits(params, mb["x"]))}


def stacked_xent(params, mb, stats=None):
  logp = jax.nn.log_softmax(stacked_logits(params, mb["x"]))
  nll = -jnp.mean(jnp.take_along_axis(logp, mb["y"][:, None], axis=1))
  # The loop reads both statistics (XLA may join a reduction the loop does not read with the one
  # after the loop: one all-reduce fewer).
  return nll if stats is None else nll + 1e-3 * (stats["top"] + stats["rows"])


def stacked_terms(params, mb):
  return {"xent": stacked_xent(params, mb), "l2": 1e-3 * jnp.sum(params["out"] ** 2)}


def stacked_step(k, loss_fn=stacked_xent, mesh=None, **kwargs):
  """``(step, its arguments)`` of ga.train_step on the stacked model, on ``mesh`` if given."""
  tx = ga.accumulate(optax.sgd(0.1), k)
  step = ga.train_step(loss_fn, tx, mesh=mesh, **kwargs)
  p, batch = stacked_params(), data(D * k * 2)
  if mesh is not None:
    p, batch = put(p, mesh, P()), put(batch, mesh, P("data"))
  return step, (p, tx.init(p), batch)


STATS = {"window_stats": stacked_stats, "window_stats_reduce": {"rows": "sum"}}  # "top": a mean


@pytest.mark.slow
@pytest.mark.parametrize(
  "loss_fn,kwargs,after",
  [
    (stacked_xent, {}, 1),
    (stacked_xent, STATS, 2),  # + the statistics' sums, before the loop
    (stacked_xent, {**STATS, "window_stats_reduce": {"rows": "sum", "top": "max"}}, 3),  # + a max
    (stacked_terms, {"weight_fn": lambda mb: {"xent": jnp.sum(mb["y"] >= 0), "l2": 1.0}}, 2),
  ],
  ids=["plain", "window_stats", "window_stats_max", "per_term_weights"],
)
def test_each_reduction_before_the_loop_is_one_all_reduce_that_the_budget_message_names(
  loss_fn, kwargs, after
):
  """Window statistics and per-term totals are reduced before the loop, once per window: one
  all-reduce for their sums, one per reduction and dtype of their maxima (docs/verifying.md's
  budget). Over a budget of 1, the message names these causes and says they run once a window."""
  step, args = stacked_step(4, loss_fn, mesh_1d(), **kwargs)
  report = ga.inspect_step(step, *args)
  assert report.in_loop == {} and report.after_loop == {"all-reduce": after}, report
  report.check(max_in_loop=0, max_after_loop={"all-reduce": after})
  if after == 1:
    return
  with pytest.raises(ValueError, match=f"{after} all-reduce outside loops") as err:
    report.check(max_in_loop=0, max_after_loop={"all-reduce": 1})
  message = " ".join(str(err.value).split())
  for cause in ("window statistics (window_stats=", "per-term totals", "aux maxima", "model state"):
    assert cause in message, (cause, message)
  assert "run once per window already" in message and "out of it" not in message, message


@pytest.mark.slow
def test_the_report_names_the_window_loop_the_statistics_pass_and_the_models_own_loops():
  """The window's micro-batch loop (k trips, or k / unroll), the window statistics' forward pass
  before it (k trips) and the model's lax.scan over its blocks (L trips, in both), by role."""
  k = 4
  for unroll in (1, 2):
    step, args = stacked_step(k, window_stats=stacked_stats, unroll=unroll)
    report = ga.inspect_step(step, *args)
    roles = [lp.role for lp in report.loops]
    assert roles.count("window") == roles.count("statistics") == 1, report.loops
    window = report.window_loop
    assert window.trip_count == k // unroll and not window.nested, window
    assert "_microbatch.py" in window.source, window
    (stats,) = [lp for lp in report.loops if lp.role == "statistics"]
    assert stats.trip_count == k and not stats.nested, stats
    model = [lp for lp in report.loops if lp.role == "model"]
    assert model and {lp.trip_count for lp in model} == {L}, report.loops
    assert all(lp.nested and "stacked_logits" in lp.source for lp in model), model
    assert set(roles) == {"window", "statistics", "model"}, report.loops
    text = repr(report)
    assert f"the window's micro-batch loop %{window.name}: {k // unroll} trips" in text, text
    assert f"the window statistics' pass %{stats.name}: {k} trips" in text, text
    assert f"{L} trips (stacked_logits, test_inspect.py:" in text and "the model's own" in text
  # The same scan in a plain jitted step: no window loop, the program's own.
  own = ga.inspect_step(jax.jit(jax.grad(stacked_xent)), args[0], args[2])
  assert own.window_loop is None and {lp.role for lp in own.loops} == {"other"}, own.loops
  assert "the program's own" in repr(own) and "window" not in repr(own), repr(own)


def test_inspect_step_passes_the_packages_own_errors_on_as_they_are():
  """A bad aux_reduce is the package's error, raised when the step is traced: inspect_step
  raises it unchanged, not wrapped in advice about the arguments."""
  step, args = built(2, loss_fn=counted_loss, has_aux=True, aux_reduce={"nope": "sum"})
  with pytest.raises(ValueError, match="^train_step: aux_reduce names the key 'nope'") as err:
    ga.inspect_step(step, *args)
  assert "pass the arguments" not in str(err.value)


# --- bad input ---------------------------------------------------------------------------------


def test_bad_input_gets_errors_that_say_what_to_change():
  with pytest.raises(TypeError, match="step must be a function"):
    ga.inspect_step(42)
  with pytest.raises(ValueError, match="could not lower and compile"):
    ga.inspect_step(lambda x: float(x) * 2, jnp.ones(()))
  report = ga.inspect_step(jax.jit(jnp.sin), jnp.ones(3))
  with pytest.raises(ValueError, match="unknown collective 'all-reduse'"):
    report.check(max_in_loop={"all-reduse": 0})
  with pytest.raises(ValueError, match="count >= 0 for 'all-reduce', got -1"):
    report.check(max_after_loop=-1)
  with pytest.raises(TypeError, match="inner_tx must be an optax transformation"):
    ga.check_step(jnp.sin, jnp.sin, "adam", jnp.ones(3), (), {})
  with pytest.raises(ValueError, match="rtol must be a positive float"):
    ga.check_step(jnp.sin, jnp.sin, optax.sgd(0.1), jnp.ones(3), (), {}, rtol=0)
