"""What DP-SGD over a window costs (``ga.dp_accumulate``): each example's gradient, clipped
before it is summed, against the same window without privacy.

MLP 784-512-512-10 (A = its fp32 params' bytes), adam, params and state donated, windows of
``B = k b`` examples split as ``(k, b)``, for each split:

  plain  ``ga.accumulate``: one backward pass per micro-batch of b rows
  dp     ``ga.dp_accumulate`` (C = 1, sigma = 1): b per-example gradients per micro-batch (a
         ``vmap``), each clipped, summed; noise once per window

Memory: each program compiled on shapes, its peak read from ``compiled.memory_analysis()``
(arguments + outputs - aliased + temp; deterministic), also in units of A. Time: the median of
``--reps`` windows after a warm-up, the programs interleaved (one window of each per round), the
ratios within one run.

  python benchmarks/privacy.py --out benchmarks/results
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


def mlp_loss(params, mb):
  h = mb["x"]
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    h = jax.nn.relu(h) if i < len(params) - 1 else h
  logp = jax.nn.log_softmax(h)
  return -jnp.mean(jnp.take_along_axis(logp, mb["y"][:, None], axis=1))


def init(sizes, key):
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {"w": jax.random.normal(k, (m, n)) / m**0.5, "b": jnp.zeros(n)}
    for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def run(sizes=(784, 512, 512, 10), window=256, splits=((32, 8), (8, 32)), reps=10):
  params = init(sizes, jax.random.key(0))
  A = sum(x.size * 4 for x in jax.tree.leaves(params))
  kx, ky = jax.random.split(jax.random.key(1))
  batch = {
    "x": jax.random.normal(kx, (window, sizes[0])),
    "y": jax.random.randint(ky, (window,), 0, sizes[-1]),
  }
  programs = {}
  for k, b in splits:
    assert k * b == window, (k, b, window)
    plain = ga.accumulate(optax.adam(1e-3), k)
    dp = ga.dp_accumulate(
      optax.adam(1e-3), k, l2_clip=1.0, noise_multiplier=1.0, expected_batch_size=window
    )
    for name, tx in (("plain", plain), ("dp", dp)):
      programs[f"{name} k={k} b={b}"] = (tx, ga.train_step(mlp_loss, tx, donate=True))
  out, live, times = {}, {}, {name: [] for name in programs}
  for name, (tx, step) in programs.items():
    peak = ga.inspect_step(step, params, tx.init(params), batch).peak_bytes
    out[name] = {"peak_bytes": peak, "peak_A": round(peak / A, 2)}
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    p, s, _ = step(p, s, batch)  # compiled and warm
    live[name] = (jax.block_until_ready(p), s)
  for _ in range(reps):  # interleaved: one window of each program per round
    for name, (_, step) in programs.items():
      p, s = live[name]
      t0 = time.perf_counter()
      p, s, _ = step(p, s, batch)
      jax.block_until_ready(p)
      times[name].append(time.perf_counter() - t0)
      live[name] = (p, s)
  ratios = {}
  for name in programs:
    out[name]["ms"] = 1e3 * statistics.median(times[name])
  for k, b in splits:
    dp, plain = out[f"dp k={k} b={b}"], out[f"plain k={k} b={b}"]
    ratios[f"k={k} b={b}: dp / plain time"] = round(dp["ms"] / plain["ms"], 3)
    ratios[f"k={k} b={b}: dp - plain peak (A)"] = round(
      (dp["peak_bytes"] - plain["peak_bytes"]) / A, 2
    )
  return {
    "config": dict(
      sizes=list(sizes), window=window, splits=[list(s) for s in splits], reps=reps, params_bytes=A
    ),  # fmt: skip
    "results": out,
    "ratios": ratios,
    "where": f"{platform.processor() or platform.machine()}, jax {jax.__version__},"
    f" {jax.default_backend()}",
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 reps (the test suite)")
  parser.add_argument("--out", type=Path, default=None)
  args = parser.parse_args()
  small = dict(sizes=(16, 32, 4), window=16, splits=((4, 4), (2, 8)), reps=2)
  result = run(**small) if args.smoke else run(reps=args.reps)
  text = json.dumps(result, indent=1)
  print(text)
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "smoke" if args.smoke else "jax" + "".join(jax.__version__.split(".")[:2])
    (args.out / f"privacy_{tag}.json").write_text(text + "\n")


if __name__ == "__main__":
  main()
