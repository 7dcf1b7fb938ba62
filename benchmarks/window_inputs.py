"""What a window-exact objective costs: the forward-only statistics pass of ``window_stats=`` and
the per-term weights of a loss of several terms, each against the same step without it.

A top-2-of-E MoE of L stacked blocks under ``lax.scan`` (each block ``jax.checkpoint``-ed),
adam, k micro-batches of b tokens, params and state donated:

  own_stats     the balance loss from each micro-batch's own expert counts, read off its forward
                pass (no extra pass: what accumulation without window statistics trains)
  window_stats  the global-batch balance loss: ``window_stats=`` counts over the window first
  one_term      the loss as one scalar, weighted by tokens (``weight_fn`` -> a scalar)
  terms         the same two terms as a dict, each weighted by its own tokens

Memory: each program compiled on shapes, its peak read from ``compiled.memory_analysis()``
(arguments + outputs - aliased + temp; deterministic). Time: the median of ``--reps`` windows
after a warm-up, the programs interleaved (one window of each per round), the ratios within
one run.

  python benchmarks/window_inputs.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

import gradaccum_jax as ga


def model(E, D, L):
  def block(h, p):
    logits = h @ p["router"]
    _, top = jax.lax.top_k(logits, 2)
    gates = jax.nn.softmax(jnp.take_along_axis(logits, top, axis=1))
    outs = jnp.einsum("td,edf->tef", h, p["experts"])
    out = jnp.sum(gates[..., None] * jnp.take_along_axis(outs, top[..., None], axis=1), axis=1)
    counts = jnp.sum(jax.nn.one_hot(top, E, dtype=jnp.int32), axis=(0, 1))
    return h + jnp.tanh(out), (counts, jnp.mean(jax.nn.softmax(logits), axis=0))

  def forward(params, x):
    return jax.lax.scan(jax.checkpoint(block), x, params)

  def stats(params, mb):
    _, (counts, _) = forward(params, mb["x"])
    return {"counts": counts, "tokens": jnp.sum(mb["mask"]).astype(jnp.int32)}

  def loss(params, mb, s=None):
    """The balance loss from the window's counts ``s``, or (None) from this micro-batch's own,
    read off the same forward pass."""
    h, (counts, prob) = forward(params, mb["x"])
    err = jnp.sum(jnp.mean((h - mb["y"]) ** 2, axis=1) * mb["mask"]) / jnp.sum(mb["mask"])
    if s is None:
      s = {"counts": counts, "tokens": jnp.sum(mb["mask"]).astype(jnp.int32)}
    return err + 0.01 * E * jnp.sum(s["counts"] / (2 * s["tokens"]) * prob)

  def terms(params, mb):
    h, _ = forward(params, mb["x"])
    row = jnp.mean((h - mb["y"]) ** 2, axis=1)
    return {
      "main": jnp.sum(row * mb["mask"]) / jnp.sum(mb["mask"]),
      "aux": jnp.sum(jnp.abs(h[:, 0]) * mb["aux"]) / jnp.sum(mb["aux"]),
    }

  return stats, loss, terms


def steps(E, D, L, k):
  stats, loss, terms = model(E, D, L)
  tx = ga.accumulate(optax.adam(1e-3), k)
  return tx, {
    "own_stats": ga.train_step(loss, tx, donate=True),
    "window_stats": ga.train_step(loss, tx, window_stats=stats, donate=True),
    "one_term": ga.train_step(
      lambda p, mb: sum(terms(p, mb).values()), tx, donate=True,
      weight_fn=lambda mb: jnp.sum(mb["mask"]),
    ),
    "terms": ga.train_step(
      terms, tx, donate=True,
      weight_fn=lambda mb: {"main": jnp.sum(mb["mask"]), "aux": jnp.sum(mb["aux"])},
    ),
  }  # fmt: skip


def run(E=8, D=128, L=4, b=64, k=8, reps=20):
  keys = jax.random.split(jax.random.key(0), 4)
  params = {
    "router": jax.random.normal(keys[0], (L, D, E)) / D**0.5,
    "experts": jax.random.normal(keys[1], (L, E, D, D)) / D**0.5,
  }
  B = b * k
  batch = {
    "x": jax.random.normal(keys[2], (B, D)),
    "y": jax.random.normal(keys[3], (B, D)),
    "mask": (jnp.arange(B) % 7 != 0).astype(jnp.float32),
    "aux": (jnp.arange(B) % 3 == 0).astype(jnp.float32),
  }
  tx, programs = steps(E, D, L, k)
  out, live, times = {}, {}, {name: [] for name in programs}
  for name, step in programs.items():
    report = ga.inspect_step(step, params, tx.init(params), batch)
    out[name] = {"peak_bytes": report.peak_bytes, "temp_bytes": report.temp_bytes}
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    p, s, _ = step(p, s, batch)  # compiled and warm
    live[name] = (jax.block_until_ready(p), s)
  for _ in range(reps):  # interleaved: one window of each program per round
    for name, step in programs.items():
      p, s = live[name]
      t0 = time.perf_counter()
      p, s, _ = step(p, s, batch)
      jax.block_until_ready(p)
      times[name].append(time.perf_counter() - t0)
      live[name] = (p, s)
  for name in programs:
    out[name]["ms"] = 1e3 * statistics.median(times[name])
  params_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
  return {
    "config": dict(E=E, D=D, L=L, b=b, k=k, reps=reps, params_bytes=params_bytes),
    "results": out,
    "ratios": {
      "window_stats / own_stats time": out["window_stats"]["ms"] / out["own_stats"]["ms"],
      "window_stats - own_stats peak (bytes)": out["window_stats"]["peak_bytes"]
      - out["own_stats"]["peak_bytes"],
      "terms / one_term time": out["terms"]["ms"] / out["one_term"]["ms"],
      "terms - one_term peak (bytes)": out["terms"]["peak_bytes"] - out["one_term"]["peak_bytes"],
    },
    "where": f"{platform.processor() or platform.machine()}, jax {jax.__version__},"
    f" {jax.default_backend()}",
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 reps (the test suite)")
  parser.add_argument("--out", type=Path, default=None)
  args = parser.parse_args()
  sizes = dict(E=4, D=16, L=2, b=8, k=2, reps=2) if args.smoke else dict(reps=args.reps)
  result = run(**sizes)
  text = json.dumps(result, indent=1)
  print(text)
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "smoke" if args.smoke else "jax" + "".join(jax.__version__.split(".")[:2])
    (args.out / f"window_inputs_{tag}.json").write_text(text + "\n")


if __name__ == "__main__":
  main()
