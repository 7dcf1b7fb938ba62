"""Compiled memory of one streaming call (jax.grad + an accumulating update + apply), written
six ways by hand, beside the plain micro-batch step and ``tx.update``: the forms a window's
close can take in one XLA program, and what each holds.

Every program is compiled on shapes (nothing runs) and read with ``memory_analysis()``
(deterministic). Every form calls the same optax inner optimizer (sgd or adam) on the mean,
so any difference is the form's. The state is ``(accumulator, micro-step count, inner
state)``; A is one float32 copy of the params.

  plain      jax.grad then the inner update on g (the accumulator passed through, for the same
             arguments)
  ga         jax.grad + ga.accumulate(inner).update, then optax.apply_updates
  branch     the sums added before a lax.cond that returns the updates (zeros when held) and
             a flag that it closed; the accumulator zeroed by a select on that flag after it
             (ga's form)
  early      the same, the select on the predicate known before the lax.cond (XLA then
             hoists the zeros above the branch and copies the sums)
  cond_acc   the same, the lax.cond also returning the accumulator (zeros or the sums)
  in_branch  the sums added inside both branches of the lax.cond (optax.MultiSteps' form
             before it computed the update on every call)
  selects    no lax.cond: the update computed on every call and selected (optax.MultiSteps
             today), so a call inside the window runs the inner optimizer
  lazy       the sums returned as they are after a close, zeroed at the next call's add

  python benchmarks/streaming_forms.py [--model mlp|lm] [--inner sgd|adam]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_floor  # noqa: E402

import gradaccum_jax as ga  # noqa: E402

K, LR = 8, 0.1
INNERS = {"sgd": lambda: optax.sgd(LR), "adam": lambda: optax.adam(LR)}


def _tree(fn, *trees):
  return jax.tree.map(fn, *trees)


def forms(loss_fn, inner):
  """The close written by hand in each form; the state is ``(accumulator, count, inner state)``."""

  def plain(p, s, mb):
    updates, inner_state = inner.update(jax.grad(loss_fn)(p, mb), s[2], p)
    return optax.apply_updates(p, updates), (*s[:2], inner_state)

  def start(p, s, mb):
    acc, n, inner_state = s
    return acc, n + 1, inner_state, jax.grad(loss_fn)(p, mb)

  def update(sums, n, inner_state, p):
    return inner.update(_tree(lambda x: x / n, sums), inner_state, p)

  def zeros(tree):
    return _tree(jnp.zeros_like, tree)

  def out(p, updates, acc, n, inner_state):
    return optax.apply_updates(p, updates), (acc, jnp.where(n >= K, 0, n), inner_state)

  def branch(p, s, mb):
    acc, n, inner_state, g = start(p, s, mb)
    sums = _tree(jnp.add, acc, g)
    closed, updates, inner_state = jax.lax.cond(
      n >= K,
      lambda *a: (True, *update(*a)),
      lambda x, n, st, p: (False, zeros(x), st),
      sums, n, inner_state, p,
    )  # fmt: skip
    acc = _tree(lambda x: jnp.where(closed, 0.0, x), sums)
    return out(p, updates, acc, n, inner_state)

  def early(p, s, mb):
    acc, n, inner_state, g = start(p, s, mb)
    sums = _tree(jnp.add, acc, g)
    hold = lambda x, n, st, p: (zeros(x), st)  # noqa: E731
    updates, inner_state = jax.lax.cond(n >= K, update, hold, sums, n, inner_state, p)
    acc = _tree(lambda x: jnp.where(n >= K, 0.0, x), sums)
    return out(p, updates, acc, n, inner_state)

  def cond_acc(p, s, mb):
    acc, n, inner_state, g = start(p, s, mb)
    sums = _tree(jnp.add, acc, g)
    updates, inner_state, acc = jax.lax.cond(
      n >= K,
      lambda x, n, st, p: (*update(x, n, st, p), zeros(x)),
      lambda x, n, st, p: (zeros(x), st, x),
      sums, n, inner_state, p,
    )  # fmt: skip
    return out(p, updates, acc, n, inner_state)

  def in_branch(p, s, mb):
    acc, n, inner_state, g = start(p, s, mb)

    def close(acc, g, n, st, p):
      return *update(_tree(jnp.add, acc, g), n, st, p), zeros(acc)

    def hold(acc, g, n, st, p):
      return zeros(acc), st, _tree(jnp.add, acc, g)

    updates, inner_state, acc = jax.lax.cond(n >= K, close, hold, acc, g, n, inner_state, p)
    return out(p, updates, acc, n, inner_state)

  def selects(p, s, mb):
    acc, n, inner_state, g = start(p, s, mb)
    sums = _tree(jnp.add, acc, g)
    updates, new_state = update(sums, n, inner_state, p)
    updates = _tree(lambda u: jnp.where(n >= K, u, 0.0), updates)
    inner_state = _tree(lambda a, b: jnp.where(n >= K, a, b), new_state, inner_state)
    acc = _tree(lambda x: jnp.where(n >= K, 0.0, x), sums)
    return out(p, updates, acc, n, inner_state)

  def lazy(p, s, mb):
    acc, n, inner_state, g = start(p, s, mb)
    sums = _tree(lambda a, g: jnp.where(n == 1, 0.0, a) + g, acc, g)  # n == 1: a new window
    hold = lambda x, n, st, p: (zeros(x), st)  # noqa: E731
    updates, inner_state = jax.lax.cond(n >= K, update, hold, sums, n, inner_state, p)
    return out(p, updates, sums, n, inner_state)

  return {
    "plain": plain,
    "branch": branch,
    "early": early,
    "cond_acc": cond_acc,
    "in_branch": in_branch,
    "selects": selects,
    "lazy": lazy,
  }


def measure(model: str = "mlp", inner_name: str = "sgd") -> dict[str, dict[str, float]]:
  """``{form: {"temp": ..., "peak": ..., "temp_undonated": ..., "peak_undonated": ...}}`` in A."""
  params, loss_fn, micro = memory_floor.MODELS[model]()
  a = sum(x.size * 4 for x in jax.tree.leaves(params))
  inner = INNERS[inner_name]()
  tx = ga.accumulate(inner, K)

  def ga_step(p, s, mb):
    updates, s = tx.update(jax.grad(loss_fn)(p, mb), s, p)
    return optax.apply_updates(p, updates), s

  zeros = jax.tree.map(jnp.zeros_like, params)
  state = (zeros, jnp.zeros((), jnp.int32), jax.eval_shape(inner.init, params))
  programs = {name: (fn, state) for name, fn in forms(loss_fn, inner).items()}
  programs["ga"] = (ga_step, jax.eval_shape(tx.init, params))
  out = {}
  for name, (fn, s) in programs.items():
    row = {}
    for donate, tag in ((True, ""), (False, "_undonated")):
      jitted = jax.jit(fn, donate_argnums=(0, 1) if donate else ())
      compiled = jitted.lower(params, s, micro).compile()
      row["temp" + tag] = compiled.memory_analysis().temp_size_in_bytes / a
      row["peak" + tag] = memory_floor.peak(compiled) / a
    out[name] = row
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="mlp", choices=sorted(memory_floor.MODELS))
  parser.add_argument("--inner", default="sgd", choices=sorted(INNERS))
  args = parser.parse_args(argv)
  rows = measure(args.model, args.inner)
  print(
    f"{args.model}, {args.inner}, k = {K}; jax {jax.__version__}, {jax.devices()[0].platform}; in A"
  )
  print("| form | temp | peak | temp undonated | peak undonated |\n|---|---|---|---|---|")
  for name, r in rows.items():
    cells = (r["temp"], r["peak"], r["temp_undonated"], r["peak_undonated"])
    print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
  main()
