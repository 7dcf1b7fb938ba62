"""``unroll=``: the fused steps' loop over micro-batches with several per trip, against the rolled
loop (unroll 1) of the train step, on a mesh, in short windows, and ``unroll="auto"`` against
the compiled memory of each candidate. Every fused entry point unrolled, weighted, with model
state, on a mesh and over a voided window: tests/test_mode_matrix.py's unroll cells."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batch, mesh_1d, put, xent_loss
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

K = 8
PARAMS = init_mlp(jax.random.key(0), (6, 16, 8))
BATCH = make_batch(jax.random.key(1), 64, num_classes=8)
FSDP = {
  "layer0": {"w": P(None, "data"), "b": P("data")},
  "layer1": {"w": P("data"), "b": P("data")},
}


def run(unroll, *, k=K, windows=2, batch=BATCH, **kw):
  tx = ga.accumulate(optax.adam(1e-2), k, accum_dtype=kw.pop("accum_dtype", jnp.float32))
  step = ga.train_step(xent_loss, tx, unroll=unroll, **kw)
  params, state = jax.tree.map(jnp.copy, PARAMS), tx.init(PARAMS)
  for _ in range(windows):
    params, state, metrics = step(params, state, batch)
  return params, metrics


@pytest.mark.slow
@pytest.mark.parametrize(
  "unroll,donate,grads_in_place",
  [
    pytest.param(u, d, g, marks=[] if (u, d, g) == (2, True, True) else [pytest.mark.slow])
    for u in (2, 3, K, 2 * K)
    for d in (False, True)
    for g in (True, False)
  ],
)
def test_train_step_unrolled_is_the_rolled_step(unroll, donate, grads_in_place):
  """The same micro-batches summed in the same order: the rolled step's params, within 1e-6
  (XLA may fuse the unrolled body's adds differently)."""
  kw = dict(donate=donate, grads_in_place=grads_in_place)
  rolled, m1 = run(1, **kw)
  unrolled, m2 = run(unroll, **kw)
  assert_trees_close(unrolled, rolled, rtol=1e-6, atol=1e-7)
  assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-6)


@pytest.mark.slow
def test_an_unrolled_loop_makes_fewer_trips_and_a_short_window_runs_rolled():
  step = ga.train_step(xent_loss, ga.accumulate(optax.sgd(0.1), K), unroll=4)
  tx = ga.accumulate(optax.sgd(0.1), K)
  report = ga.inspect_step(step, PARAMS, tx.init(PARAMS), BATCH)
  assert report.unroll == 4 and [lp.trip_count for lp in report.loops if lp.trip_count] == [2]
  assert "loop unrolled 4" in repr(report)
  assert ga.inspect_step(ga.train_step(xent_loss, tx), PARAMS, tx.init(PARAMS), BATCH).unroll == 1
  # num_real_microbatches: the first m micro-batches, as the rolled step takes them
  for m in (1, 3, 5):
    got = step(PARAMS, tx.init(PARAMS), BATCH, num_real_microbatches=m)[0]
    want = ga.train_step(xent_loss, tx)(PARAMS, tx.init(PARAMS), BATCH, num_real_microbatches=m)
    assert_trees_close(got, want[0], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("specs", [None, FSDP], ids=["replicated", "fsdp"])
def test_on_a_mesh_no_collective_enters_the_unrolled_loop(specs):
  mesh = mesh_1d()
  tx = ga.accumulate(optax.adam(1e-2), 2)
  params, batch = put(PARAMS, mesh, specs or P()), put(BATCH, mesh, P("data"))
  outs = []
  for unroll in (1, 2):
    step = ga.train_step(xent_loss, tx, mesh=mesh, param_specs=specs, unroll=unroll)
    report = ga.inspect_step(step, params, tx.init(params), batch)
    report.check(max_in_loop=0)
    assert report.unroll == unroll
    outs.append(step(params, tx.init(params), batch)[0])
  assert_trees_close(outs[1], outs[0], rtol=1e-6, atol=1e-7)
  assert_trees_close(outs[0], run(1, k=16, windows=1)[0], rtol=1e-5, atol=1e-6)


def peak(step, *args):
  a = step.lower(*args).compile().memory_analysis()
  return (
    a.temp_size_in_bytes + a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes
  )


def wider():
  """A model whose activations outweigh its params: (params, batch, tx, the step's args)."""
  params = init_mlp(jax.random.key(0), (64, 256, 8))
  batch = make_batch(jax.random.key(1), 256, d_in=64, num_classes=8)
  tx = ga.accumulate(optax.adam(1e-3), K)
  return params, batch, tx, (params, tx.init(params), batch)


@pytest.mark.slow
def test_auto_takes_the_largest_unroll_within_the_budget():
  """Each candidate's compiled bytes are its program's; "auto" runs the largest that fits."""
  _, _, tx, args = wider()
  sizes = {u: peak(ga.train_step(xent_loss, tx, unroll=u), *args) for u in (1, 2, 4, K)}
  assert sizes[1] < sizes[2] < sizes[4] < sizes[K]  # each unrolled trip holds its activations
  for budget, want in ((sizes[4], 4), (sizes[4] - 1, 2), (sizes[K] * 2, K), (sizes[1] - 1, 1)):
    step = ga.train_step(xent_loss, tx, unroll="auto", memory_budget_bytes=budget)
    assert step.chosen_unroll(*args) == want
    compiled = step.unroll_bytes(*args)  # the candidates compiled: the chosen one among them
    assert compiled.items() <= sizes.items() and want in compiled and 1 in compiled
    assert peak(step, *args) == sizes[want] and (want == 1 or sizes[want] <= budget)
    new = step(*args)[0]
    assert_trees_close(new, ga.train_step(xent_loss, tx)(*args)[0], rtol=1e-6, atol=1e-7)
  # without a budget: the largest within 10 % over unroll 1's
  step = ga.train_step(xent_loss, tx, unroll="auto")
  want = max(u for u in sizes if sizes[u] <= sizes[1] * 1.1)
  assert step.chosen_unroll(*args) == want
  assert ga.inspect_step(step, *args).unroll == want


@pytest.mark.slow
def test_auto_compiles_few_candidates_once_per_signature(monkeypatch):
  """ "auto" compiles unroll 1 and k (no loop), then, as the peak grows with the unroll while a
  loop remains, the candidates a line between a fit and a miss points to, until they are
  neighbours: 3 compiles where unroll 2 is over the budget (1, k, 2), 2 where k fits, at most all
  for a budget in between. A second call with the same shapes, and running the step, compile
  nothing more."""
  _, _, tx, args = wider()
  sizes = {u: peak(ga.train_step(xent_loss, tx, unroll=u), *args) for u in (1, 2, 4, K)}
  assert sizes[2] > sizes[1] * 1.1  # the default budget: unroll 1 alone fits
  compiles = []
  compile_ = jax.stages.Lowered.compile

  def counted(self, *a, **kw):
    compiles.append(self)
    return compile_(self, *a, **kw)

  monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
  for budget, want, count in ((None, 1, 3), (sizes[K], K, 2), (sizes[4], 4, 4)):
    compiles.clear()
    step = ga.train_step(xent_loss, tx, unroll="auto", memory_budget_bytes=budget)
    assert step.chosen_unroll(*args) == want and len(compiles) == count, (
      budget,
      step.unroll_bytes(*args),
    )
    assert len(step.unroll_bytes(*args)) == count
    jax.block_until_ready(step(*args))
    assert step.chosen_unroll(*args) == want and len(compiles) == count  # nothing more compiled


@pytest.mark.slow
def test_auto_with_gather_auto_prefers_once_then_the_largest_unroll():
  mesh = mesh_1d()
  tx = ga.accumulate(optax.adam(1e-2), 2)
  params, batch = put(PARAMS, mesh, FSDP), put(BATCH, mesh, P("data"))
  args = (params, tx.init(params), batch)
  sizes = {
    (g, u): peak(
      ga.train_step(xent_loss, tx, mesh=mesh, param_specs=FSDP, gather_params=g, unroll=u), *args
    )  # fmt: skip
    for g in ("once", "per_microbatch")
    for u in (1, 2)
  }
  budget = sizes[("once", 2)]
  step = ga.train_step(xent_loss, tx, mesh=mesh, param_specs=FSDP, gather_params="auto",
                       unroll="auto", memory_budget_bytes=budget)  # fmt: skip
  assert (step.chosen_gather_params(*args), step.chosen_unroll(*args)) == ("once", 2)
  assert step.gather_params_bytes(*args) == {g: sizes[(g, 1)] for g in ("once", "per_microbatch")}


def test_bad_unroll_is_refused_before_any_work():
  tx = ga.accumulate(optax.sgd(0.1), K)
  with pytest.raises(ValueError, match="unroll must be a positive int .* got 0"):
    ga.train_step(xent_loss, tx, unroll=0)
  with pytest.raises(
    TypeError,
    match=re.escape(
      "unroll must be a positive int (micro-batches per trip of the loop) or 'auto', got 2.0"
    ),
  ):
    ga.train_step(xent_loss, tx, unroll=2.0)
  with pytest.raises(ValueError, match="value_and_grad: unroll='auto' compiles each candidate"):
    ga.value_and_grad(xent_loss, K, unroll="auto")
  with pytest.raises(
    ValueError, match="train_step: unroll='auto' compiles the step, so it needs jit=True"
  ):
    ga.train_step(xent_loss, tx, unroll="auto", jit=False)
  with pytest.raises(
    ValueError, match="memory_budget_bytes= is the budget of gather_params='auto' and unroll='auto'"
  ):
    ga.train_step(xent_loss, tx, memory_budget_bytes=2**30)


@pytest.mark.slow
def test_step_memory_and_auto_microbatch_size_the_unrolled_step():
  params, batch, tx, args = wider()
  for u in (1, 4):
    got = ga.step_memory(xent_loss, params, batch, K, optax.adam(1e-3), unroll=u)
    assert got == peak(ga.train_step(xent_loss, tx, unroll=u), *args)

  def sized(k, u=1):
    return ga.step_memory(xent_loss, params, batch, k, optax.adam(1e-3), unroll=u)

  budget = sized(4, 2)  # k = 4 fits at unroll 2, not at 4; k = 2 does not fit
  assert sized(2) > budget and sized(4, 4) > budget
  (k, unroll), est = ga.auto_microbatch(
    xent_loss,
    params,
    batch,
    optax.adam(1e-3),
    memory_budget_bytes=budget,
    unroll="auto",
    return_estimates=True,
  )
  assert (k, unroll) == (4, 2)
  assert est == {(1, 1): sized(1), (2, 1): sized(2), (4, 1): sized(4), (4, 4): sized(4, 4),
                 (4, 2): budget}  # fmt: skip
  assert (
    ga.auto_microbatch(xent_loss, params, batch, optax.adam(1e-3), memory_budget_bytes=budget) == 4
  )
  with pytest.raises(ValueError, match="step_memory: unroll must be an int"):
    ga.step_memory(xent_loss, params, batch, K, unroll="auto")
