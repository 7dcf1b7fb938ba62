"""One program, one micro-batch of memory: compiled structure, memory, tracing, state plumbing."""

import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import (
  assert_trees_close,
  computations,
  in_while_loops,
  init_mlp,
  make_batch,
  xent_loss,
)

import gradaccum_jax as ga

# Large enough that XLA:CPU's memory_analysis reports real temp sizes (it reports ~0 below ~16 MiB).
D_IN, HIDDEN, B_MICRO = 512, 2048, 1024
SIZES = (D_IN, HIDDEN, HIDDEN, 16)


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


def state_copies(compiled):
  """Copies of arrays (not scalars, not of a zeros broadcast) outside every while loop: the
  ones that run on every call, whichever branch of a conditional is taken."""
  comps = computations(compiled.as_text())
  in_loop = in_while_loops(comps)
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
