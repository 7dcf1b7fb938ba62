"""Data-parallel accumulation on a device mesh: a plain GSPMD jit of a scan vs ga.train_step(mesh=).

What is measured, on ``--devices`` (8 by default) forced host CPU devices on one ``data`` mesh
axis, for an MLP 784-512-512-10 (relu), mean softmax cross-entropy, ``optax.adam(1e-3)``,
float32, random data, ``k`` micro-batches of ``b`` rows per device (global batch
``B = devices * k * b``, sharded ``P("data")`` on its leading axis):

  naive       ``jax.jit`` of a ``lax.scan`` over ``ga.microbatch(batch, i, k)`` summing the
              gradients, then adam: partitioned by GSPMD (params replicated).
  ga          ``ga.train_step(loss_fn, ga.accumulate(adam, k), mesh=mesh)``: params
              replicated, a local scan per device, one all-reduce after the loop.
  ga_sharded  the same with ``param_specs``: every param sharded over ``data`` on its first
              dimension divisible by the devices (FSDP/ZeRO layout): one all-gather before
              the loop, one reduce-scatter per param after it.

For each program the compiled HLO (``compiled.as_text()``) is parsed for collectives
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) inside while-loop
bodies and outside them; "per window" counts a collective in the loop ``k`` times. Timing:
median wall ms per window (one optimizer step) up to ``jax.block_until_ready``, after
warm-up, the methods interleaved round by round. The first window of every method is
compared with ``naive`` (max abs param difference) as a sanity check.

Usage: ``python benchmarks/sharding.py [--smoke] [--out benchmarks/results] [--devices 8]``.
Writes ``<out>/sharding.json`` (raw numbers) and ``<out>/sharding.md`` (the tables). On a
shared CPU the 8 devices are threads on the same cores: the collectives are memory copies,
so the times show the cost of the program structure, not of a network.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _force_devices(argv: Sequence[str] | None) -> int:
  """Sets the host device count before jax is imported (XLA reads it once)."""
  parser = argparse.ArgumentParser(add_help=False)
  parser.add_argument("--devices", type=int, default=8)
  n = parser.parse_known_args(argv)[0].devices
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  return n


_force_devices(sys.argv[1:] if __name__ == "__main__" else [])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import (  # noqa: E402
  ga,
  init_params,
  loss_fn,
  machine_info,
  make_batch,
  max_abs_diff,
  summarize,
)

LR = 1e-3
METHODS = ("naive", "ga", "ga_sharded")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
FULL = {"layers": (784, 512, 512, 10), "b": 32, "ks": (4, 16), "rounds": 8, "windows": 3}
SMOKE = {"layers": (16, 32, 8), "b": 2, "ks": (2,), "rounds": 1, "windows": 1}


# --------------------------------------------------------------------------- HLO

_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s")
_CALLED = re.compile(
  r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)"
  r"|branch_computations=\{([^}]*)\}"
)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def hlo_collectives(text: str) -> list[dict[str, Any]]:
  """Every collective of a compiled HLO module: op, result bytes, whether in a while loop."""
  comps: dict[str, list[str]] = {}
  current = None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and line.rstrip().endswith("{"):
      current = comps.setdefault(header.group(1), [])
    elif line.startswith("}"):
      current = None
    elif current is not None:
      current.append(line)
  stack = [
    name
    for lines in comps.values()
    for line in lines
    if re.search(r"\swhile\(", line)
    for name in re.findall(r"(?:body|condition)=%([\w.\-]+)", line)
  ]
  in_loop: set[str] = set()
  while stack:
    name = stack.pop()
    if name in in_loop or name not in comps:
      continue
    in_loop.add(name)
    for line in comps[name]:
      for one, many in _CALLED.findall(line):
        stack.extend([one] if one else [c.strip().lstrip("%") for c in many.split(",")])
  found = []
  for name, lines in comps.items():
    for m in map(_OP.match, lines):
      if m:
        size = 0
        for dtype, dims in re.findall(r"\b(pred|bf16|[suf]\d+)\[([\d,]*)\]", m.group(1)):
          n = 1
          for d in filter(None, dims.split(",")):
            n *= int(d)
          size += n * _DTYPE_BYTES.get(dtype, int(dtype[1:]) // 8 if dtype[1:].isdigit() else 4)
        found.append({"op": m.group(2), "bytes": size, "in_loop": name in in_loop})
  return found


def collective_summary(found: list[dict[str, Any]], k: int) -> dict[str, Any]:
  in_loop = Counter(c["op"] for c in found if c["in_loop"])
  outside = Counter(c["op"] for c in found if not c["in_loop"])
  return {
    "in_loop": dict(in_loop),
    "outside_loop": dict(outside),
    "per_window": sum(in_loop.values()) * k + sum(outside.values()),
    "bytes_per_window": sum(c["bytes"] * (k if c["in_loop"] else 1) for c in found),
  }


# --------------------------------------------------------------------------- steps


def naive_step(tx: optax.GradientTransformation, k: int) -> Any:
  def step(params, opt_state, batch):
    def body(acc, i):
      loss, grads = jax.value_and_grad(loss_fn)(params, ga.microbatch(batch, i, k))
      return (jax.tree.map(jnp.add, acc[0], grads), acc[1] + loss), None

    zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(()))
    (grads, loss), _ = jax.lax.scan(body, zeros, jnp.arange(k))
    grads = jax.tree.map(lambda g: g / k, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss / k}

  return jax.jit(step)


def fsdp_specs(params: Any, n: int) -> Any:
  """Each param sharded over "data" on its first dimension divisible by n, else replicated."""

  def spec(x):
    for d, size in enumerate(x.shape):
      if size % n == 0:
        return P(*([None] * d), "data")
    return P()

  return jax.tree.map(spec, params)


def setup(method: str, mesh: Any, params0: Any, batch: Any, k: int) -> tuple[Any, Any]:
  """(jitted step, (params, state, batch)) with the inputs placed on the mesh."""
  n = mesh.shape["data"]
  tx = optax.adam(LR) if method == "naive" else ga.accumulate(optax.adam(LR), k)
  specs = fsdp_specs(params0, n) if method == "ga_sharded" else P()
  spec_tree = jax.tree.broadcast(specs, params0, is_leaf=lambda s: isinstance(s, P))
  params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params0, spec_tree)
  # zeros_like keeps the params' sharding; the scalar counters go replicated on the mesh.
  state = jax.tree.map(
    lambda x: jax.device_put(x, NamedSharding(mesh, P())) if x.ndim == 0 else x,
    tx.init(params),
  )
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  if method == "naive":
    step = naive_step(tx, k)
  else:
    param_specs = specs if method == "ga_sharded" else None
    step = ga.train_step(loss_fn, tx, mesh=mesh, param_specs=param_specs)
  return step, (params, state, batch)


def run_k(cfg: dict[str, Any], mesh: Any, k: int) -> dict[str, Any]:
  n = mesh.shape["data"]
  params0 = init_params(jax.random.key(0), cfg["layers"])
  batch = make_batch(jax.random.key(1), n * k * cfg["b"], cfg["layers"])
  steps, inputs, result, state = {}, {}, {}, {}
  first = {}
  for method in METHODS:
    step, args = setup(method, mesh, params0, batch, k)
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    found = hlo_collectives(compiled.as_text())
    steps[method], inputs[method] = step, args
    p, s, _ = jax.block_until_ready(step(*args))
    first[method] = p
    for _ in range(cfg["windows"]):  # warm-up (and any recompile for the outputs' layout)
      p, s, _ = jax.block_until_ready(step(p, s, args[2]))
    state[method] = (p, s)
    result[method] = {"compile_s": compile_s, "collectives": collective_summary(found, k)}
  for method in METHODS:
    result[method]["first_window_max_abs_diff_vs_naive"] = max_abs_diff(
      first[method], first["naive"]
    )
  samples: dict[str, list[float]] = {m: [] for m in METHODS}
  for r in range(cfg["rounds"]):
    order = METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]
    for method in order:
      p, s = state[method]
      for _ in range(cfg["windows"]):
        t0 = time.perf_counter()
        p, s, _ = steps[method](p, s, inputs[method][2])
        jax.block_until_ready((p, s))
        samples[method].append(time.perf_counter() - t0)
      state[method] = (p, s)
  base = summarize(samples["naive"])["median_ms"]
  for method in METHODS:
    stats = summarize(samples[method])
    stats["ratio_vs_naive"] = stats["median_ms"] / base
    result[method].update(stats)
  return {"k": k, "b": cfg["b"], "B": n * k * cfg["b"], "methods": result}


# --------------------------------------------------------------------------- report


def fmt_counts(counts: dict[str, int]) -> str:
  return ", ".join(f"{v} {op}" for op, v in sorted(counts.items())) or "none"


def table(runs: list[dict[str, Any]]) -> str:
  rows = [
    "| k | B | method | ms / window | ratio | in loop body | after / before the loop |"
    " collectives per window | result MiB per window |",
    "|---:|---:|---|---:|---:|---|---|---:|---:|",
  ]
  for run in runs:
    for method in METHODS:
      m = run["methods"][method]
      c = m["collectives"]
      rows.append(
        f"| {run['k']} | {run['B']} | {method} | {m['median_ms']:.2f} |"
        f" {m['ratio_vs_naive']:.2f} | {fmt_counts(c['in_loop'])} |"
        f" {fmt_counts(c['outside_loop'])} | {c['per_window']} |"
        f" {c['bytes_per_window'] / 2**20:.2f} |"
      )
  return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
  parser.add_argument("--out", default="benchmarks/results", help="folder for the json/md")
  parser.add_argument("--devices", type=int, default=8, help="forced host CPU devices")
  args = parser.parse_args(argv)
  cfg = SMOKE if args.smoke else FULL
  n = len(jax.devices())
  mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
  t_start = time.perf_counter()
  info = machine_info(jax.devices()[0])
  runs = []
  for k in cfg["ks"]:
    print(f"k={k} ...", flush=True)
    runs.append(run_k(cfg, mesh, k))
  total_s = time.perf_counter() - t_start
  model = "-".join(map(str, cfg["layers"]))
  md = "\n".join(
    [
      f"# Data-parallel accumulation on {n} devices ({'smoke' if args.smoke else 'full'} run)",
      "",
      f"{info['cpu_model'] or info['platform_processor']}, os.cpu_count()="
      f"{info['os_cpu_count']}, {n} {info['backend']} devices; jax {info['jax']}, optax"
      f" {info['optax']}; {info['date']}. MLP {model} relu, adam, float32, b={cfg['b']} rows"
      f" per device per micro-batch, batch sharded P('data'). Median wall ms per window over"
      f" {cfg['rounds']} interleaved rounds x {cfg['windows']} windows; ratio to naive in the"
      f" same run. Collectives from the compiled HLO (a tuple all-reduce counts once; 'per"
      f" window' counts a collective in the loop k times; MiB = their result sizes). Total"
      f" run {total_s:.0f} s.",
      "",
      table(runs),
      "",
    ]
  )
  print()
  print(md)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  config = {**cfg, "devices": n, "smoke": args.smoke}
  (out / "sharding.json").write_text(
    json.dumps({"config": config, "machine": info, "runs": runs, "total_s": total_s}, indent=1)
  )
  (out / "sharding.md").write_text(md)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
