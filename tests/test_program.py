"""One program, one micro-batch of memory: compiled structure, memory, tracing, state plumbing."""

import re
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batch, xent_loss

import gradaccum_jax as ga
from gradaccum_jax._inspect import _computations, _reachable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import memory_floor  # noqa: E402

# Large enough that XLA:CPU's memory_analysis reports real temp sizes (it reports ~0 below ~16 MiB).
D_IN, HIDDEN, B_MICRO = 512, 2048, 1024
SIZES = (D_IN, HIDDEN, HIDDEN, 16)

pytestmark = pytest.mark.slow  # compiled programs of an 8-32 MiB MLP, read for fusions and copies


def shapes(batch_size):
  return {
    "x": jax.ShapeDtypeStruct((batch_size, D_IN), jnp.float32),
    "y": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
  }


def nbytes(tree):
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def params_shape():
  return jax.eval_shape(lambda: init_mlp(jax.random.key(0), SIZES))


def compile_train_step(params_shape, k):
  tx = ga.accumulate(optax.adam(1e-3), k)
  state = jax.eval_shape(tx.init, params_shape)  # init works on ShapeDtypeStructs
  return ga.train_step(xent_loss, tx).lower(params_shape, state, shapes(k * B_MICRO)).compile()


def compile_plain_step(params_shape, batch_size):
  inner = optax.adam(1e-3)

  def plain(params, state, batch):
    grads = jax.grad(xent_loss)(params, batch)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = jax.eval_shape(inner.init, params_shape)
  return jax.jit(plain).lower(params_shape, state, shapes(batch_size)).compile()


def temp_bytes(compiled):
  return compiled.memory_analysis().temp_size_in_bytes


def footprint(compiled):
  """Arguments, outputs not written over a donated argument, and temp: the bytes a call holds."""
  m = compiled.memory_analysis()
  return (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  )


@pytest.mark.slow
def test_memory_is_one_microbatch_plus_accumulator_whatever_k(params_shape):
  micro = temp_bytes(compile_plain_step(params_shape, B_MICRO))
  accumulator = nbytes(params_shape)  # one fp32 buffer like the params
  micro_input = nbytes(shapes(B_MICRO))  # the gathered rows of one micro-batch
  budget = 1.2 * (micro + accumulator + micro_input)
  assert micro > 0  # the analysis is meaningful at this size

  ours = {k: temp_bytes(compile_train_step(params_shape, k)) for k in (8, 64)}
  assert ours[8] <= budget, (ours, micro, accumulator)
  assert ours[64] == ours[8]  # memory does not grow with k
  full = temp_bytes(compile_plain_step(params_shape, 8 * B_MICRO))
  assert ours[8] < full / 4, (ours, full)
  # No copy of the whole batch: with k=64 the input batch alone is 128 MiB.
  assert ours[64] < nbytes(shapes(64 * B_MICRO)) / 4


def while_loops(hlo_text):
  return re.findall(r"\swhile\(", hlo_text)


@pytest.mark.slow
def test_one_loop_and_a_program_size_independent_of_k():
  params = jax.eval_shape(lambda: init_mlp(jax.random.key(0)))
  texts = {}
  for k in (2, 64):
    tx = ga.accumulate(optax.adam(1e-3), k)
    state = jax.eval_shape(tx.init, params)
    batch = jax.eval_shape(lambda k=k: make_batch(jax.random.key(0), 4 * k))
    texts[k] = ga.train_step(xent_loss, tx).lower(params, state, batch).compile().as_text()
    assert len(while_loops(texts[k])) == 1, k
  # Compile time does not grow with k: the program has the same size up to a few constants
  # (an unrolled loop would be 32 times larger).
  sizes = {k: len(re.findall(r"^\s+(?:ROOT )?%\S+ = ", t, re.M)) for k, t in texts.items()}
  assert abs(sizes[64] - sizes[2]) <= 5, sizes


def test_second_call_does_not_retrace():
  """What comes out has the avals that went in, so every later window reuses the first compile:
  ``chex.assert_max_traces`` raises on a second trace, for the fused step and for the streaming
  micro-step across window boundaries (the state's type through the window-closing branch)."""
  chex.clear_trace_counter()  # the counters are global, keyed by where the wrapper was made
  params = init_mlp(jax.random.key(0))
  tx = ga.accumulate(optax.adam(1e-3), 4)
  step = jax.jit(chex.assert_max_traces(ga.train_step(xent_loss, tx, jit=False), n=1))
  state = tx.init(params)
  for i in range(4):
    params, state, metrics = step(params, state, make_batch(jax.random.key(2 + i), 16))
  chex.assert_tree_all_finite((params, state, metrics))
  assert int(state.count) == 4

  def micro_step(params, state, microbatch):
    updates, state = tx.update(jax.grad(xent_loss)(params, microbatch), state, params)
    return optax.apply_updates(params, updates), state

  micro_step = jax.jit(chex.assert_max_traces(micro_step, n=1))
  for i in range(10):  # two windows closed and a third open: both branches run
    params, state = micro_step(params, state, make_batch(jax.random.key(10 + i), 4))
  chex.assert_tree_all_finite((params, state))
  assert int(state.count) == 6 and int(state.micro_step) == 2


@pytest.mark.slow
def test_state_survives_cond_and_scan():
  """The streaming state keeps its type through lax.cond and drives a lax.scan of micro-steps."""
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)
  k = 4
  tx = ga.accumulate(optax.adam(1e-2), k)
  state = tx.init(params)
  same = jax.lax.cond(True, lambda s: s, lambda s: s, state)
  assert type(same) is ga.AccumulateState
  assert jax.tree.structure(same) == jax.tree.structure(state)

  @jax.jit
  def window(params, state, batch):
    def body(carry, i):
      params, state = carry
      grads = jax.grad(xent_loss)(params, ga.microbatch(batch, i, k))
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), None

    return jax.lax.scan(body, (params, state), jnp.arange(k))[0]

  new_params, new_state = window(params, state, batch)
  fused_params, fused_state, _ = ga.train_step(xent_loss, tx)(params, state, batch)
  assert_trees_close(new_params, fused_params)
  assert_trees_close(new_state, fused_state)


@pytest.mark.slow
def test_donation_runs_and_matches():
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)
  tx = ga.accumulate(optax.adam(1e-2), 4)
  expected, _, _ = ga.train_step(xent_loss, tx)(params, tx.init(params), batch)
  copy = jax.tree.map(jnp.copy, params)
  got, _, _ = ga.train_step(xent_loss, tx, donate=True)(copy, tx.init(copy), batch)
  assert_trees_close(got, expected, rtol=0, atol=0)


@pytest.mark.slow
def test_unjitted_step_composes_with_user_jit():
  params = init_mlp(jax.random.key(0))
  batch = make_batch(jax.random.key(1), 16)
  tx = ga.accumulate(optax.sgd(0.1), 4)
  raw = ga.train_step(xent_loss, tx, jit=False)
  a, _, _ = jax.jit(raw)(params, tx.init(params), batch)
  b, _, _ = ga.train_step(xent_loss, tx)(params, tx.init(params), batch)
  assert_trees_close(a, b, rtol=0, atol=0)


def state_copies(compiled, in_loops=False):
  """Copies of arrays (not scalars, not of a zeros broadcast) outside every while loop: the
  ones that run on every call, whichever branch of a conditional is taken; ``in_loops``: the
  ones inside loops too."""
  comps = _computations(compiled.as_text())
  in_loop = set() if in_loops else _reachable(comps, "while")
  copy = re.compile(r"= (\w+\[[\d,]+\])\S* copy\(%([^)]+)\)")
  return [
    (shape, operand)
    for name, lines in comps.items()
    if name not in in_loop
    for shape, operand in copy.findall("\n".join(lines))
    if "broadcast" not in operand and "constant" not in operand
  ]


def test_a_micro_step_that_does_not_close_the_window_copies_no_state():
  """The non-closing path of tx.update passes the state through a while loop of 0 trips, in
  place: no array of the inner optimizer's state (nor the accumulator) is copied."""
  params = init_mlp(jax.random.key(0), (64, 128, 8))
  tx = ga.accumulate(optax.adam(1e-3), 4)

  def micro(p, s, mb):
    updates, s = tx.update(jax.grad(xent_loss)(p, mb), s, p)
    return optax.apply_updates(p, updates), s

  batch = make_batch(jax.random.key(1), 8, d_in=64, num_classes=8)
  compiled = jax.jit(micro, donate_argnums=(0, 1)).lower(params, tx.init(params), batch).compile()
  assert state_copies(compiled) == []


def min_scan_step(inner, k):
  """The floor to compare with: benchmarks/memory_floor.py's minimal scan (the micro-batch
  gradients from zeros, their mean, one inner update; no weights, checks or metrics)."""
  return memory_floor.min_scan(xent_loss, inner, k)


@pytest.mark.slow
def test_the_donated_fused_step_copies_no_state_and_needs_the_memory_of_a_minimal_scan(
  params_shape,
):
  """Donated, the inner update writes params, mu and nu in place and the scan adds into the
  state's accumulator: no array is copied outside the loops, and the compiled temp memory is
  the hand-written minimal scan's less its accumulator (the state holds it), so the whole
  footprint, state included, is the minimal scan's. Undonated, no more temp than the
  undonated floor."""
  k = 8
  tx = ga.accumulate(optax.adam(1e-3), k)
  state = jax.eval_shape(tx.init, params_shape)
  batch = shapes(k * B_MICRO)
  ours = ga.train_step(xent_loss, tx, donate=True).lower(params_shape, state, batch).compile()
  assert state_copies(ours) == []
  inner = optax.adam(1e-3)
  floor = (
    jax.jit(min_scan_step(inner, k), donate_argnums=(0, 1))
    .lower(params_shape, jax.eval_shape(inner.init, params_shape), batch)
    .compile()
  )
  scalars = 4096  # the metrics, counters and flags: a few hundred bytes
  acc = nbytes(state.acc_grads)
  assert 0 < temp_bytes(ours) <= temp_bytes(floor) - acc + scalars, (
    temp_bytes(ours), temp_bytes(floor), acc,
  )  # fmt: skip
  assert footprint(ours) <= footprint(floor) + scalars, (footprint(ours), footprint(floor))
  plain = ga.train_step(xent_loss, tx).lower(params_shape, state, batch).compile()
  undonated_floor = (
    jax.jit(min_scan_step(inner, k))
    .lower(params_shape, jax.eval_shape(inner.init, params_shape), batch)
    .compile()
  )
  assert temp_bytes(plain) <= temp_bytes(undonated_floor) + scalars


SMALL_K, SMALL_B = 8, 8


def compile_small_donated_step(accum_dtype=jnp.float32, skip_nonfinite=True):
  """``(params, batch, compiled)``: the donated step on shapes at b = 8, k = 8, adam."""
  params = jax.eval_shape(lambda: init_mlp(jax.random.key(0), (784, 512, 512, 10)))
  batch = {
    "x": jax.ShapeDtypeStruct((SMALL_K * SMALL_B, 784), jnp.float32),
    "y": jax.ShapeDtypeStruct((SMALL_K * SMALL_B,), jnp.int32),
  }
  tx = ga.accumulate(
    optax.adam(1e-3), SMALL_K, accum_dtype=accum_dtype, skip_nonfinite=skip_nonfinite
  )
  step = ga.train_step(xent_loss, tx, donate=True)
  return params, batch, step.lower(params, jax.eval_shape(tx.init, params), batch).compile()


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_the_donated_fused_step_at_a_small_microbatch_needs_the_temp_memory_of_a_minimal_scan(
  skip_nonfinite,
):
  """At b = 8 (the step-time benchmark's MLP 784-512-512-10, k = 8) the temp memory is the
  minimal scan's less one accumulator (the scan adds into the state's), and no array is
  copied, inside the loops included. Before: 7.66 MiB against 4.13, because merging a window
  left open by streaming calls (a loop that seldom runs) copied the accumulator; and with
  skip_nonfinite=False 2.74 MB against 1.65, the accumulator copied before the loop, because
  the update's flag did not wait for the norm. A bf16 accumulator (running means) scans from
  zeros: one accumulator more, no copy either."""
  params, batch, ours = compile_small_donated_step(skip_nonfinite=skip_nonfinite)
  inner = optax.adam(1e-3)
  floor = (
    jax.jit(min_scan_step(inner, SMALL_K), donate_argnums=(0, 1))
    .lower(params, jax.eval_shape(inner.init, params), batch)
    .compile()
  )
  assert state_copies(ours, in_loops=True) == []
  assert 0 < temp_bytes(ours) <= temp_bytes(floor) - nbytes(params) + 4096, (
    temp_bytes(ours),
    temp_bytes(floor),
  )
  *_, bf16 = compile_small_donated_step(jnp.bfloat16, skip_nonfinite)
  assert state_copies(bf16, in_loops=True) == []
  assert temp_bytes(bf16) <= temp_bytes(floor) + 4096, (temp_bytes(bf16), temp_bytes(floor))


def count_whiles(lowered):
  return lowered.as_text().count("stablehlo.while")


def test_the_fused_step_and_streaming_calls_close_in_a_branch():
  """The donated fused step voids a bad window in a lax.cond that updates in place, as the
  streaming calls close theirs (which reverse-mode differentiation goes through): the inner
  optimizer runs once per window in each. Counted in the lowered programs: the fused step's
  one while loop is its scan, tx.update and ga.micro_step have none (its one micro-batch runs
  without a loop around it)."""
  params = init_mlp(jax.random.key(0), (64, 128, 8))
  k = 4
  tx = ga.accumulate(optax.adam(1e-3), k)
  state = tx.init(params)
  batch = make_batch(jax.random.key(1), 8 * k, d_in=64, num_classes=8)
  mb = ga.microbatch(batch, 0, k)

  def streaming(p, s, mb):
    updates, s = tx.update(jax.grad(xent_loss)(p, mb), s, p)
    return optax.apply_updates(p, updates), s

  micro = ga.micro_step(xent_loss, tx, donate=True)
  fused = ga.train_step(xent_loss, tx, donate=True).lower(params, state, batch).as_text()
  assert fused.count("stablehlo.while") == 1 and fused.count("stablehlo.case") >= 1
  streamed = jax.jit(streaming, donate_argnums=(0, 1)).lower(params, state, mb).as_text()
  assert streamed.count("stablehlo.while") == 0 and streamed.count("stablehlo.case") >= 2
  assert count_whiles(micro.lower(params, micro.init(params), mb)) == 0


def nan_batch(batch):
  return {**batch, "x": batch["x"].at[0, 0].set(jnp.nan)}


@pytest.mark.parametrize("open_window", [False, True], ids=["closed", "open"])
def test_donated_and_undonated_steps_agree_on_voided_good_and_open_windows(open_window):
  """The donated step updates in place (a branch of a lax.cond), the undonated one selects:
  a voided window leaves params and inner state exactly as they were in both, a good window
  gives the same result, and a window left open by streaming calls is merged by both (the
  scan starts from the state's accumulator, whose sums are cleared after the update)."""
  k = 4
  tx = ga.accumulate(optax.adam(1e-2), k)
  params = init_mlp(jax.random.key(0))
  good = make_batch(jax.random.key(1), 4 * k)
  state = tx.init(params)
  if open_window:  # two streaming micro-steps of another batch: the window is open
    for i in range(2):
      mb = ga.microbatch(make_batch(jax.random.key(2), 2 * k), i, k)
      _, state = tx.update(jax.grad(xent_loss)(params, mb), state, params)
    assert int(state.micro_step) == 2
  copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731  (donation consumes the input)
  results = {}
  for donate in (False, True):
    step = ga.train_step(xent_loss, tx, donate=donate)
    p, s, m = step(copy(params), copy(state), nan_batch(good))
    assert not bool(m["updated"]) and int(s.num_skipped) == 1 and int(s.count) == 1
    assert_trees_close(p, params, rtol=0, atol=0)
    assert_trees_close(s.inner_state, state.inner_state, rtol=0, atol=0)
    assert int(s.micro_step) == 0 and float(s.acc_weight) == 0.0
    assert all(not jnp.any(a) for a in jax.tree.leaves(s.acc_grads))  # the window is cleared
    results[donate] = step(copy(params), copy(state), good)
    assert bool(results[donate][2]["updated"])
  assert_trees_close(results[True][:2], results[False][:2], rtol=1e-6, atol=1e-7)
  if open_window:  # the reference: the open window's micro-batches and the batch's, weighed 1
    streamed = [ga.microbatch(make_batch(jax.random.key(2), 2 * k), i, k) for i in range(2)]
    mbs = streamed + [ga.microbatch(good, i, k) for i in range(k)]
    grads = [jax.grad(xent_loss)(params, mb) for mb in mbs]
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    inner = optax.adam(1e-2)
    updates, _ = inner.update(mean, inner.init(params), params)
    assert_trees_close(results[True][0], optax.apply_updates(params, updates), rtol=1e-5)


def test_a_ga_micro_step_that_does_not_close_the_window_copies_no_state():
  """ga.micro_step closes the window in a loop of 0 or 1 trips, as tx.update does: its calls
  inside the window copy no array of the state."""
  params = init_mlp(jax.random.key(0), (64, 128, 8))
  tx = ga.accumulate(optax.adam(1e-3), 4)
  step = ga.micro_step(xent_loss, tx, donate=True)
  mb = make_batch(jax.random.key(1), 8, d_in=64, num_classes=8)
  assert state_copies(step.lower(params, step.init(params), mb).compile()) == []


def test_only_an_update_with_matrix_products_reads_a_mean_made_once():
  """Donated, an update with matrix products (muon) reads the window's mean made once before
  its loop (an optimization barrier in the lowered program); an elementwise one (adam) reads
  it fused and its program holds no barrier. Both give the whole batch's update."""
  from gradaccum_jax._accumulate import has_matrix_products

  x = jnp.ones((3, 3))
  assert not has_matrix_products(lambda a: jnp.tanh(a) * 2, x)
  assert has_matrix_products(lambda a: jax.lax.scan(lambda c, _: (c @ c, None), a, None, 2)[0], x)
  assert has_matrix_products(lambda a: jax.lax.cond(a[0, 0] > 0, lambda a: a @ a, jnp.sin, a), x)
  sizes, k = (8, 16, 4), 4
  params = init_mlp(jax.random.key(0), sizes)
  batch = make_batch(jax.random.key(1), 8 * k, sizes[0], sizes[-1])
  for inner, barrier in ((optax.contrib.muon(1e-2), True), (optax.adam(1e-2), False)):
    tx = ga.accumulate(inner, k)
    step = ga.train_step(xent_loss, tx, donate=True)
    lowered = step.lower(params, tx.init(params), batch).as_text()  # before XLA removes it
    assert ("optimization_barrier" in lowered) == barrier, inner
    new_params, _, _ = step(jax.tree.map(jnp.copy, params), tx.init(params), batch)
    g = jax.grad(xent_loss)(params, batch)
    updates, _ = inner.update(g, inner.init(params), params)
    assert_trees_close(new_params, optax.apply_updates(params, updates), rtol=1e-5, atol=1e-6)
