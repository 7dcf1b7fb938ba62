"""Temp memory of the fused step with remat and mixed precision, from XLA's memory analysis.

Compiles (on ``jax.ShapeDtypeStruct`` inputs: nothing executes) a plain step on one
micro-batch, a plain step on the whole batch, and ``ga.train_step`` in several
configurations, and reports ``compiled.memory_analysis()``: temp bytes (activations,
gradients, the accumulator, scratch) and argument bytes (params, optimizer state, batch).
The model is an MLP with wide tanh layers so that activations dominate, adam, k micro-batches
of b rows (large, since XLA:CPU reports ~0 temp bytes for programs below ~16 MiB). On a CPU,
bf16 arithmetic is emulated through float32 copies, so the bf16 rows mean something only on
an accelerator.

Usage: ``python benchmarks/memory.py [--smoke] [--out benchmarks/results]``; writes
``<out>/memory.json`` and ``<out>/memory.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

try:
  import gradaccum_jax as ga
except ModuleNotFoundError:  # run from a source tree without installing
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import gradaccum_jax as ga

MIB = 2**20


def init_params(layers, dtype):
  return [
    {"w": jax.ShapeDtypeStruct((m, n), dtype), "b": jax.ShapeDtypeStruct((n,), dtype)}
    for m, n in zip(layers[:-1], layers[1:], strict=True)
  ]


def loss_fn(params, batch):
  h = batch["x"].astype(params[0]["w"].dtype)
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      h = jnp.tanh(h)
  return optax.softmax_cross_entropy_with_integer_labels(h.astype(jnp.float32), batch["y"]).mean()


def block_params(d, hidden, depth):
  """Stacked weights of ``depth`` residual blocks, scanned over the leading axis."""
  return {
    "up": jax.ShapeDtypeStruct((depth, d, hidden), jnp.float32),
    "down": jax.ShapeDtypeStruct((depth, hidden, d), jnp.float32),
  }


def block(h, layer):
  return h + jnp.tanh(h @ layer["up"]) @ layer["down"], None


def block_loss(params, batch, per_layer=False):
  """Residual MLP blocks (d -> hidden -> d): the activations inside a block dwarf its output."""
  h, _ = jax.lax.scan(jax.checkpoint(block) if per_layer else block, batch["x"], params)
  return jnp.mean((h - batch["y"]) ** 2)


def regression_shape(size, d):
  return {
    "x": jax.ShapeDtypeStruct((size, d), jnp.float32),
    "y": jax.ShapeDtypeStruct((size, d), jnp.float32),
  }


def remat_rows(smoke):
  d, hidden, depth = (16, 64, 2) if smoke else (64, 2048, 4)
  b, k = (8, 2) if smoke else (512, 4)
  params = block_params(d, hidden, depth)
  tx = ga.accumulate(optax.sgd(0.1), k)
  state = jax.eval_shape(tx.init, params)
  batch = regression_shape(k * b, d)

  def lower(loss, **kwargs):
    return ga.train_step(loss, tx, **kwargs).lower(params, state, batch)

  rows = {
    "blocks: ga.train_step, no remat": lower(block_loss),
    "blocks: ga.train_step, jax.checkpoint around each block in loss_fn": lower(
      lambda p, mb: block_loss(p, mb, per_layer=True)
    ),
  }
  desc = f"residual blocks {d}-{hidden}-{d} x{depth}, sgd, k={k} micro-batches of b={b} rows"
  return rows, desc


def batch_shape(size, d_in):
  return {
    "x": jax.ShapeDtypeStruct((size, d_in), jnp.float32),
    "y": jax.ShapeDtypeStruct((size,), jnp.int32),
  }


def plain(params, b, d_in):
  inner = optax.adam(1e-3)

  def step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step).lower(params, jax.eval_shape(inner.init, params), batch_shape(b, d_in))


def fused(params, b, k, d_in, **kwargs):
  tx = ga.accumulate(optax.adam(1e-3), k)
  step = ga.train_step(loss_fn, tx, **kwargs)
  return step.lower(params, jax.eval_shape(tx.init, params), batch_shape(k * b, d_in))


def measure(lowered):
  start = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  analysis = compiled.memory_analysis()
  return {
    "temp_mib": analysis.temp_size_in_bytes / MIB,
    "argument_mib": analysis.argument_size_in_bytes / MIB,
    "output_mib": analysis.output_size_in_bytes / MIB,
    "alias_mib": analysis.alias_size_in_bytes / MIB,
    # Everything live at the peak, as XLA accounts it: inputs, outputs not aliased to them, temp.
    "total_mib": (
      analysis.argument_size_in_bytes
      + analysis.output_size_in_bytes
      - analysis.alias_size_in_bytes
      + analysis.temp_size_in_bytes
    )
    / MIB,
    "compile_s": seconds,
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script runs")
  parser.add_argument("--out", default="benchmarks/results")
  args = parser.parse_args(argv)
  layers = (64, 128, 128, 10) if args.smoke else (784, 2048, 2048, 2048, 10)
  b, k = (16, 4) if args.smoke else (4096, 8)
  d_in = layers[0]
  f32 = init_params(layers, jnp.float32)
  bf16 = init_params(layers, jnp.bfloat16)
  rows = {
    "plain step on one micro-batch (b rows)": plain(f32, b, d_in),
    "plain step on the whole batch (k*b rows)": plain(f32, k * b, d_in),
    "ga.train_step, fp32": fused(f32, b, k, d_in),
    "ga.train_step, bf16 compute on fp32 params": fused(
      f32, b, k, d_in, compute_dtype=jnp.bfloat16
    ),
    "ga.train_step, bf16 params, fp32 accumulator": fused(bf16, b, k, d_in),
  }
  block_rows, block_desc = remat_rows(args.smoke)
  rows.update(block_rows)
  results = {name: measure(lowered) for name, lowered in rows.items()}
  acc_mib = sum(x.size * 4 for x in jax.tree.leaves(f32)) / MIB
  device = jax.devices()[0]
  header = (
    f"MLP {'-'.join(map(str, layers))} tanh, adam, k={k} micro-batches of b={b} rows;"
    f" one fp32 accumulator = {acc_mib:.2f} MiB. {device.platform}:{device.device_kind},"
    f" jax {jax.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d}."
  )
  lines = [
    "# Temp memory: remat and mixed precision",
    "",
    header,
    f"Rows starting 'blocks:': {block_desc}.",
    "",
    "| configuration | temp MiB | arguments MiB | outputs MiB | total MiB | compile s |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for name, r in results.items():
    lines.append(
      f"| {name} | {r['temp_mib']:.2f} | {r['argument_mib']:.2f} | {r['output_mib']:.2f} |"
      f" {r['total_mib']:.2f} | {r['compile_s']:.2f} |"
    )
  text = "\n".join(lines) + "\n"
  print(text)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "memory.md").write_text(text)
  meta = {"layers": layers, "b": b, "k": k, "device": str(device), "jax": jax.__version__}
  (out / "memory.json").write_text(json.dumps({"config": meta, "results": results}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
