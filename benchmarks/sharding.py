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

Three more comparisons:

  gather      for a params-dominated MLP (512-2048-2048-512, 2 rows per device per micro-batch,
              every param sharded over ``data``): ``gather_params="once"`` against
              ``"per_microbatch"`` across ``k``: XLA's per-device temp memory and total
              (``compiled.memory_analysis()``), collectives and time per window.
  donated     the same model, ``donate=True``, compiled only: per-device memory of the scan
              from zeros against the scan into the state's accumulator, replicated, "once"
              and "per_microbatch".
  streaming   one jitted call per micro-batch, ``k`` calls per window, params replicated:
              ``plain_stream`` (``jax.jit`` of ``jax.value_and_grad`` + ``tx.update`` of
              ``ga.accumulate`` on a micro-batch sharded ``P("data")``: GSPMD all-reduces the
              gradient on every call) against ``ga.micro_step(..., mesh=mesh)`` (per-device
              partial sums, one all-reduce in the call that closes the window).

For each program ``ga.StepReport.from_compiled`` reads the collectives of the compiled HLO
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, ...) inside while-loop
bodies and elsewhere; "per window" counts a collective in the scan's loop ``k`` times, and for
the streaming programs (whose only loop is the one of 0 or 1 trips that closes the window) a
collective outside it ``k`` times and inside it once. Timing:
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
FULL = {
  "layers": (784, 512, 512, 10), "b": 32, "ks": (4, 16), "rounds": 8, "windows": 3,
  "gather": {"layers": (512, 2048, 2048, 512), "b": 2, "ks": (2, 4, 8), "rounds": 5, "windows": 2},
  "streaming": {"layers": (784, 512, 512, 10), "b": 32, "ks": (4, 8), "rounds": 5, "windows": 2},
}  # fmt: skip
SMOKE = {
  "layers": (16, 32, 8), "b": 2, "ks": (2,), "rounds": 1, "windows": 1,
  "gather": {"layers": (16, 32, 8), "b": 2, "ks": (2,), "rounds": 1, "windows": 1},
  "streaming": {"layers": (16, 32, 8), "b": 2, "ks": (2,), "rounds": 1, "windows": 1},
}  # fmt: skip
GATHERS = ("once", "per_microbatch")
STREAMS = ("plain_stream", "micro_step")


# --------------------------------------------------------------------------- HLO


def hlo_collectives(compiled: Any) -> list[dict[str, Any]]:
  """Every collective of a compiled program (``ga.StepReport``): op, result bytes, whether in
  a while loop, whether in a conditional's branch."""
  return [
    {"op": c.kind, "bytes": c.bytes, "in_loop": c.in_loop, "in_branch": c.in_branch}
    for c in ga.StepReport.from_compiled(compiled).collectives
  ]


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
    found = hlo_collectives(compiled)
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


def stream_summary(found: list[dict[str, Any]], k: int) -> dict[str, Any]:
  """Collectives of one streaming call: outside the branch (or loop) that closes the window on
  every call, inside it on one call per window."""

  def where(c: dict[str, Any]) -> str:
    return "close" if c["in_loop"] or c.get("in_branch") else "every_call"

  times = {"every_call": k, "close": 1}
  out: dict[str, Any] = {w: dict(Counter(c["op"] for c in found if where(c) == w)) for w in times}
  out["per_window"] = sum(times[where(c)] for c in found)
  out["bytes_per_window"] = sum(c["bytes"] * times[where(c)] for c in found)
  return out


def interleaved(steps: dict[str, Any], state: dict[str, Any], cfg: dict[str, Any]) -> dict:
  """Median wall time per window of each method, the methods interleaved round by round.
  ``steps[m](state) -> state`` runs one window."""
  methods = list(steps)
  samples: dict[str, list[float]] = {m: [] for m in methods}
  for r in range(cfg["rounds"]):
    for method in methods[r % len(methods) :] + methods[: r % len(methods)]:
      for _ in range(cfg["windows"]):
        t0 = time.perf_counter()
        state[method] = jax.block_until_ready(steps[method](state[method]))
        samples[method].append(time.perf_counter() - t0)
  return {m: summarize(samples[m]) for m in methods}


class ParamsModel:
  """The params-dominated model of the gather and donated comparisons, its batch on the mesh."""

  def __init__(self, cfg: dict[str, Any], mesh: Any, k: int):
    self.mesh, self.k, self.b = mesh, k, cfg["b"]
    n = mesh.shape["data"]
    self.params0 = init_params(jax.random.key(0), cfg["layers"])
    self.batch = jax.device_put(
      make_batch(jax.random.key(1), n * k * cfg["b"], cfg["layers"]),
      NamedSharding(mesh, P("data")),
    )
    self.fsdp = fsdp_specs(self.params0, n)

  def placed(self, specs: Any) -> tuple[Any, Any, Any]:
    """``(tx, params, state)``: adam accumulated over k, the params laid out as ``specs`` (the
    state's zeros_like keeps it; its scalar counters replicated)."""
    tx = ga.accumulate(optax.adam(LR), self.k)
    spec_tree = jax.tree.broadcast(specs, self.params0, is_leaf=lambda x: isinstance(x, P))
    params = jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(self.mesh, s)), self.params0, spec_tree
    )
    state = jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(self.mesh, P())) if x.ndim == 0 else x,
      tx.init(params),
    )
    return tx, params, state

  def run(self, **results: Any) -> dict[str, Any]:
    """A run's record: its sizes and ``results``."""
    return {
      "k": self.k,
      "b": self.b,
      "B": self.mesh.shape["data"] * self.k * self.b,
      "param_bytes": sum(int(x.size) * 4 for x in jax.tree.leaves(self.params0)),
      **results,
    }


def run_gather(cfg: dict[str, Any], mesh: Any, k: int) -> dict[str, Any]:
  """gather_params="once" against "per_microbatch" for a params-dominated model."""
  model = ParamsModel(cfg, mesh, k)
  batch, specs = model.batch, model.fsdp
  result, steps, state, first = {}, {}, {}, {}
  for gather in GATHERS:
    tx, params, opt_state = model.placed(specs)
    step = ga.train_step(loss_fn, tx, mesh=mesh, param_specs=specs, gather_params=gather)
    t0 = time.perf_counter()
    compiled = step.lower(params, opt_state, batch).compile()
    compile_s = time.perf_counter() - t0
    report = ga.StepReport.from_compiled(compiled)
    result[gather] = {
      "compile_s": compile_s,
      "temp_bytes": report.temp_bytes,
      "total_bytes": report.peak_bytes,
      "collectives": collective_summary(hlo_collectives(compiled), k),
    }
    p, s_, _ = jax.block_until_ready(step(params, opt_state, batch))
    first[gather] = p
    p, s_, _ = jax.block_until_ready(step(p, s_, batch))  # warm-up with the outputs' layout
    steps[gather] = lambda st, step=step: step(st[0], st[1], batch)[:2]
    state[gather] = (p, s_)
  result["per_microbatch"]["first_window_max_abs_diff_vs_once"] = max_abs_diff(
    first["per_microbatch"], first["once"]
  )
  for gather, stats in interleaved(steps, state, cfg).items():
    result[gather].update(stats)
  return model.run(methods=result)


DONATED_LAYOUTS = ("replicated", "once", "per_microbatch")


def run_donated(cfg: dict[str, Any], mesh: Any, k: int) -> dict[str, Any]:
  """Compiled memory per device of the step donated and not, for the params-dominated model
  replicated and sharded (FSDP). Compiles only."""
  model = ParamsModel(cfg, mesh, k)
  result = {}
  for layout in DONATED_LAYOUTS:
    specs = P() if layout == "replicated" else model.fsdp
    tx, params, state = model.placed(specs)
    result[layout] = {}
    for donate in (False, True):
      step = ga.train_step(
        loss_fn, tx, mesh=mesh, param_specs=None if layout == "replicated" else specs,
        gather_params="once" if layout == "replicated" else layout, donate=donate,
      )  # fmt: skip
      report = ga.inspect_step(step, params, state, model.batch)
      result[layout]["donated" if donate else "undonated"] = {
        "temp_bytes": report.temp_bytes,
        "total_bytes": report.peak_bytes,
      }
  return model.run(layouts=result)


def run_streaming(cfg: dict[str, Any], mesh: Any, k: int) -> dict[str, Any]:
  """One jitted call per micro-batch: a plain GSPMD step against ga.micro_step, replicated."""
  n = mesh.shape["data"]
  params0 = init_params(jax.random.key(0), cfg["layers"])
  batch = make_batch(jax.random.key(1), n * k * cfg["b"], cfg["layers"])
  mbs = [
    jax.device_put(ga.microbatch(batch, i, k), NamedSharding(mesh, P("data"))) for i in range(k)
  ]
  replicate = lambda t: jax.device_put(t, NamedSharding(mesh, P()))  # noqa: E731
  tx = ga.accumulate(optax.adam(LR), k)

  @jax.jit
  def plain(params, opt_state, mb):
    grads = jax.grad(loss_fn)(params, mb)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  micro = ga.micro_step(loss_fn, tx, mesh=mesh)
  calls = {"plain_stream": plain, "micro_step": lambda p, s, mb: micro(p, s, mb)[:2]}
  inits = {
    "plain_stream": replicate(tx.init(params0)),
    "micro_step": micro.init(replicate(params0)),
  }
  lowered = {"plain_stream": plain.lower, "micro_step": micro.lower}
  result, steps, state = {}, {}, {}
  for method in STREAMS:
    args = (replicate(params0), inits[method], mbs[0])
    t0 = time.perf_counter()
    compiled = lowered[method](*args).compile()
    result[method] = {
      "compile_s": time.perf_counter() - t0,
      "collectives": stream_summary(hlo_collectives(compiled), k),
    }

    def window(st, call=calls[method]):
      p, s_ = st
      for mb in mbs:
        p, s_ = call(p, s_, mb)
      return p, s_

    state[method] = jax.block_until_ready(window(args[:2]))
    result[method]["first"] = state[method][0]
    state[method] = jax.block_until_ready(window(state[method]))  # warm-up
    steps[method] = window
  result["micro_step"]["first_window_max_abs_diff_vs_plain"] = max_abs_diff(
    result["micro_step"].pop("first"), result["plain_stream"].pop("first")
  )
  for method, stats in interleaved(steps, state, cfg).items():
    result[method].update(stats)
  base = result["plain_stream"]["median_ms"]
  for method in STREAMS:
    result[method]["ratio_vs_plain"] = result[method]["median_ms"] / base
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


MIB = 2**20


def gather_table(runs: list[dict[str, Any]]) -> str:
  rows = [
    "| k | B | gather_params | temp MiB / device | total MiB / device | ms / window |"
    " ratio to once | in loop body | outside the loop | MiB moved per window |",
    "|---:|---:|---|---:|---:|---:|---:|---|---|---:|",
  ]
  for run in runs:
    once = run["methods"]["once"]["median_ms"]
    for gather in GATHERS:
      m = run["methods"][gather]
      c = m["collectives"]
      rows.append(
        f"| {run['k']} | {run['B']} | {gather} | {m['temp_bytes'] / MIB:.1f} |"
        f" {m['total_bytes'] / MIB:.1f} | {m['median_ms']:.1f} | {m['median_ms'] / once:.2f} |"
        f" {fmt_counts(c['in_loop'])} | {fmt_counts(c['outside_loop'])} |"
        f" {c['bytes_per_window'] / MIB:.1f} |"
      )
  return "\n".join(rows)


def donated_table(run: dict[str, Any]) -> str:
  rows = [
    "| layout | temp MiB / device, undonated | donated | total MiB / device, undonated |"
    " donated | saved |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for layout, m in run["layouts"].items():
    plain, don = m["undonated"], m["donated"]
    rows.append(
      f"| {layout} | {plain['temp_bytes'] / MIB:.1f} | {don['temp_bytes'] / MIB:.1f} |"
      f" {plain['total_bytes'] / MIB:.1f} | {don['total_bytes'] / MIB:.1f} |"
      f" {(plain['total_bytes'] - don['total_bytes']) / MIB:.1f} |"
    )
  return "\n".join(rows)


def stream_table(runs: list[dict[str, Any]]) -> str:
  rows = [
    "| k | B | method | ms / window | ratio | every call | closing call |"
    " collectives per window | MiB moved per window |",
    "|---:|---:|---|---:|---:|---|---|---:|---:|",
  ]
  for run in runs:
    for method in STREAMS:
      m = run["methods"][method]
      c = m["collectives"]
      rows.append(
        f"| {run['k']} | {run['B']} | {method} | {m['median_ms']:.1f} |"
        f" {m['ratio_vs_plain']:.2f} | {fmt_counts(c['every_call'])} |"
        f" {fmt_counts(c['close'])} | {c['per_window']} |"
        f" {c['bytes_per_window'] / MIB:.2f} |"
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
  runs, gather_runs, stream_runs = [], [], []
  for k in cfg["ks"]:
    print(f"train_step k={k} ...", flush=True)
    runs.append(run_k(cfg, mesh, k))
  for k in cfg["gather"]["ks"]:
    print(f"gather_params k={k} ...", flush=True)
    gather_runs.append(run_gather(cfg["gather"], mesh, k))
  for k in cfg["streaming"]["ks"]:
    print(f"streaming k={k} ...", flush=True)
    stream_runs.append(run_streaming(cfg["streaming"], mesh, k))
  print("donated ...", flush=True)
  donated = run_donated(cfg["gather"], mesh, cfg["gather"]["ks"][-1])
  total_s = time.perf_counter() - t_start
  model = "-".join(map(str, cfg["layers"]))
  g, st = cfg["gather"], cfg["streaming"]
  param_mib = gather_runs[0]["param_bytes"] / MIB
  timing = (
    "Median wall ms per window over {rounds} interleaved rounds x {windows} windows (a shared"
    " CPU: noisy, compare the ratios of one run)."
  )
  md = "\n".join(
    [
      f"# Data-parallel accumulation on {n} devices ({'smoke' if args.smoke else 'full'} run)",
      "",
      f"{info['cpu_model'] or info['platform_processor']}, os.cpu_count()="
      f"{info['os_cpu_count']}, {n} {info['backend']} devices; jax {info['jax']}, optax"
      f" {info['optax']}; {info['date']}. Total run {total_s:.0f} s.",
      "",
      "## Fused step: a plain GSPMD scan against ga.train_step(mesh=)",
      "",
      f"MLP {model} relu, adam, float32, b={cfg['b']} rows per device per micro-batch, batch"
      f" sharded P('data'). {timing.format(**cfg)} Ratio to naive. Collectives from the"
      " compiled HLO (a tuple all-reduce counts once; 'per window' counts a collective in the"
      " loop k times; MiB = their result sizes).",
      "",
      table(runs),
      "",
      "## FSDP: gather_params='once' against 'per_microbatch'",
      "",
      f"MLP {'-'.join(map(str, g['layers']))} relu ({param_mib:.1f} MiB of float32 params,"
      f" every param sharded over the {n} devices), adam, b={g['b']} rows per device per"
      " micro-batch. temp / total MiB: XLA's per-device compiled.memory_analysis() (temp;"
      " temp + arguments + outputs - aliased). MiB moved: result bytes of the collectives per"
      f" window. {timing.format(**g)}",
      "",
      gather_table(gather_runs),
      "",
      "## Streaming: one jitted call per micro-batch",
      "",
      f"MLP {'-'.join(map(str, st['layers']))} relu, adam, params replicated, b={st['b']} rows"
      " per device per micro-batch, k calls per window. Collectives of one call: outside the"
      " loop of 0 or 1 trips that closes the window (every call), inside it (the closing call)."
      f" {timing.format(**st)}",
      "",
      stream_table(stream_runs),
      "",
      "## Donated and undonated",
      "",
      f"The FSDP section's MLP, adam, k={donated['k']}, compiled only: per-device memory"
      " (compiled.memory_analysis()) of the step undonated and donated. Donated, each device's"
      " scan starts from its share of the state's accumulator (replicated: the whole of it;"
      " 'per_microbatch': its 1/D shard), so the window holds one accumulator; 'once' gathers"
      " each param for the window and sums its whole gradient in a buffer of its own.",
      "",
      donated_table(donated),
      "",
    ]
  )
  print()
  print(md)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  config = {**cfg, "devices": n, "smoke": args.smoke}
  result = {
    "config": config,
    "machine": info,
    "runs": runs,
    "gather_runs": gather_runs,
    "stream_runs": stream_runs,
    "donated": donated,
    "total_s": total_s,
  }
  (out / "sharding.json").write_text(json.dumps(result, indent=1))
  (out / "sharding.md").write_text(md)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
