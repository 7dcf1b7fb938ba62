"""Compiled memory of one streaming call (jax.grad + an accumulating update + apply), written
five ways by hand, beside the plain micro-batch step and ``tx.update``: the forms a window's
close can take in one XLA program, and what each holds.

Every program is compiled on shapes (nothing runs) and read with ``memory_analysis()``
(deterministic). The inner optimizer is sgd (``-lr * mean``), so any difference is the form's.
The state is ``(accumulator, micro-step count)``; A is one float32 copy of the params.

  plain      jax.grad then params - lr * g (the accumulator passed through, for the same
             arguments)
  ga         jax.grad + ga.accumulate(optax.sgd).update, then optax.apply_updates
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

  python benchmarks/streaming_forms.py [--model mlp|lm]
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


def _tree(fn, *trees):
  return jax.tree.map(fn, *trees)


def forms(loss_fn):
  def plain(p, s, mb):
    return _tree(lambda a, g: a - LR * g, p, jax.grad(loss_fn)(p, mb)), s

  def start(p, s, mb):
    acc, n = s
    return acc, n + 1, jax.grad(loss_fn)(p, mb)

  def update(sums, n):
    return _tree(lambda x: -LR * x / n, sums)

  def zeros(tree):
    return _tree(jnp.zeros_like, tree)

  def branch(p, s, mb):
    acc, n, g = start(p, s, mb)
    sums = _tree(jnp.add, acc, g)
    closed, updates = jax.lax.cond(
      n >= K, lambda x, n: (True, update(x, n)), lambda x, n: (False, zeros(x)), sums, n
    )
    acc = _tree(lambda x: jnp.where(closed, 0.0, x), sums)
    return _tree(jnp.add, p, updates), (acc, jnp.where(n >= K, 0, n))

  def early(p, s, mb):
    acc, n, g = start(p, s, mb)
    sums = _tree(jnp.add, acc, g)
    updates = jax.lax.cond(n >= K, update, lambda x, n: zeros(x), sums, n)
    acc = _tree(lambda x: jnp.where(n >= K, 0.0, x), sums)
    return _tree(jnp.add, p, updates), (acc, jnp.where(n >= K, 0, n))

  def cond_acc(p, s, mb):
    acc, n, g = start(p, s, mb)
    sums = _tree(jnp.add, acc, g)
    updates, acc = jax.lax.cond(
      n >= K, lambda x, n: (update(x, n), zeros(x)), lambda x, n: (zeros(x), x), sums, n
    )
    return _tree(jnp.add, p, updates), (acc, jnp.where(n >= K, 0, n))

  def in_branch(p, s, mb):
    acc, n, g = start(p, s, mb)

    def close(acc, g, n):
      return update(_tree(jnp.add, acc, g), n), zeros(acc)

    def hold(acc, g, n):
      return zeros(acc), _tree(jnp.add, acc, g)

    updates, acc = jax.lax.cond(n >= K, close, hold, acc, g, n)
    return _tree(jnp.add, p, updates), (acc, jnp.where(n >= K, 0, n))

  def selects(p, s, mb):
    acc, n, g = start(p, s, mb)
    sums = _tree(jnp.add, acc, g)
    updates = _tree(lambda u: jnp.where(n >= K, u, 0.0), update(sums, n))
    acc = _tree(lambda x: jnp.where(n >= K, 0.0, x), sums)
    return _tree(jnp.add, p, updates), (acc, jnp.where(n >= K, 0, n))

  def lazy(p, s, mb):
    acc, n, g = start(p, s, mb)
    sums = _tree(lambda a, g: jnp.where(n == 1, 0.0, a) + g, acc, g)  # n == 1: a new window
    updates = jax.lax.cond(n >= K, update, lambda x, n: zeros(x), sums, n)
    return _tree(jnp.add, p, updates), (sums, jnp.where(n >= K, 0, n))

  return {
    "plain": plain,
    "branch": branch,
    "early": early,
    "cond_acc": cond_acc,
    "in_branch": in_branch,
    "selects": selects,
    "lazy": lazy,
  }


def measure(model: str = "mlp") -> dict[str, dict[str, float]]:
  """``{form: {"temp": ..., "peak": ..., "temp_undonated": ..., "peak_undonated": ...}}`` in A."""
  params, loss_fn, micro = memory_floor.MODELS[model]()
  a = sum(x.size * 4 for x in jax.tree.leaves(params))
  tx = ga.accumulate(optax.sgd(LR), K)

  def ga_step(p, s, mb):
    updates, s = tx.update(jax.grad(loss_fn)(p, mb), s, p)
    return optax.apply_updates(p, updates), s

  state = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.int32))
  programs = {name: (fn, state) for name, fn in forms(loss_fn).items()}
  programs["ga"] = (ga_step, jax.eval_shape(tx.init, params))
  out = {}
  for name, (fn, s) in programs.items():
    row = {}
    for donate, tag in ((True, ""), (False, "_undonated")):
      jitted = jax.jit(fn, donate_argnums=(0, 1) if donate else ())
      m = jitted.lower(params, s, micro).compile().memory_analysis()
      row["temp" + tag] = m.temp_size_in_bytes / a
      row["peak" + tag] = memory_floor.peak(jitted.lower(params, s, micro).compile()) / a
    out[name] = row
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="mlp", choices=sorted(memory_floor.MODELS))
  args = parser.parse_args(argv)
  rows = measure(args.model)
  print(f"{args.model}, sgd, k = {K}; jax {jax.__version__}, {jax.devices()[0].platform}; in A")
  print("| form | temp | peak | temp undonated | peak undonated |\n|---|---|---|---|---|")
  for name, r in rows.items():
    cells = (r["temp"], r["peak"], r["temp_undonated"], r["peak_undonated"])
    print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
  main()
