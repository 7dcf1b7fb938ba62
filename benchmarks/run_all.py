"""Runs all benchmarks and writes one report: <out>/REPORT.md plus PNG plots.

Each benchmark script runs as its own subprocess (``sys.executable``), so every one gets a
fresh jax (``sharding.py`` must set ``XLA_FLAGS`` before jax starts). Then the report step
reads whatever ``<name>.md``/``<name>.json`` files are in ``--out``: the ones this run wrote,
and, for scripts left out with ``--only``, results already there from an earlier run (the
report says which is which).

  python benchmarks/run_all.py --out benchmarks/results          # full runs: many minutes
  python benchmarks/run_all.py --smoke --out /tmp/bench          # tiny sizes, about a minute
  python benchmarks/run_all.py --device gpu --out /tmp/bench_gpu  # on an accelerator
  python benchmarks/run_all.py --smoke --only memory,sharding --out /tmp/bench

``--device``: ``step_time.py`` takes it directly. The others have no such option and use jax's
default backend; with ``--device cpu`` they get ``JAX_PLATFORMS=cpu``.
``sharding.py`` always measures 8 forced host CPU devices, so it is skipped (with a note) when
``--device`` is ``gpu`` or ``tpu``: its numbers would be CPU numbers, not the device's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCRIPTS = ("step_time", "side_by_side", "transformer", "memory", "sharding", "noise_scale")
TITLES = {
  "step_time": "Step time, overhead, memory and compile time (`step_time.py`)",
  "side_by_side": "Step time side by side with optax at b = 8, 32, 256 (`side_by_side.py`)",
  "transformer": "Throughput and memory on a transformer stack (`transformer.py`)",
  "memory": "Memory with mixed precision and remat (`memory.py`)",
  "sharding": "Data-parallel accumulation on a mesh (`sharding.py`)",
  "noise_scale": "Gradient noise scale (`noise_scale.py`)",
}
MIB = 2**20


def command(name: str, args: argparse.Namespace) -> tuple[list[str], dict[str, str]] | str:
  """The command line and environment for one script, or why it is skipped."""
  cmd = [sys.executable, str(HERE / f"{name}.py"), "--out", str(args.out)]
  if args.smoke:
    cmd.append("--smoke")
  env = dict(os.environ)
  if name == "step_time":
    if args.device:
      cmd += ["--device", args.device]
  elif name == "sharding":
    if args.device not in (None, "cpu"):
      return (
        f"skipped: sharding.py measures 8 forced host CPU devices"
        f" (--xla_force_host_platform_device_count), not the {args.device}; run it with"
        " --device cpu"
      )
    env["JAX_PLATFORMS"] = "cpu"
  elif args.device == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
  return cmd, env


def run_scripts(names: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
  status: dict[str, dict[str, Any]] = {}
  for name in names:
    spec = command(name, args)
    if isinstance(spec, str):
      print(f"== {name}: {spec}", flush=True)
      status[name] = {"state": spec}
      continue
    cmd, env = spec
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env, cwd=HERE.parent).returncode
    seconds = time.perf_counter() - t0
    state = "ran in this run" if rc == 0 else f"FAILED (exit code {rc})"
    print(f"== {name}: {state}, {seconds:.1f} s", flush=True)
    status[name] = {"state": state, "rc": rc, "seconds": seconds}
  return status


def machine_info(device: str | None) -> dict[str, Any]:
  """Read after the scripts ran, so this process never holds an accelerator during them."""
  import jax

  try:
    dev = jax.devices(device)[0] if device else jax.devices()[0]
    dev_text = f"{dev} ({dev.platform}, {dev.device_kind})"
  except RuntimeError as err:  # e.g. --device gpu on a machine without one
    dev_text = f"{device}: unavailable ({err})"
  return {
    "jax": jax.__version__,
    "device": dev_text,
    "os_cpu_count": os.cpu_count(),
    "python": platform.python_version(),
    "platform": platform.platform(),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  }


def load_json(path: Path) -> dict[str, Any] | None:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def demote(md: str, levels: int = 2) -> str:
  """Pushes every markdown heading down `levels` levels (skipping fenced code)."""
  out, fenced = [], False
  for line in md.splitlines():
    if line.startswith("```"):
      fenced = not fenced
    if not fenced and line.startswith("#"):
      line = "#" * levels + line
    out.append(line)
  return "\n".join(out)


def plot_step_time(result: dict[str, Any], out: Path) -> list[tuple[str, str]]:
  """PNG plots from step_time.json; [] when matplotlib is missing."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return []
  made = []
  machine = result.get("machine", {})
  where = f"{machine.get('device_kind', '?')}, jax {machine.get('jax', '?')}"

  curve = result.get("curve") or []
  if curve:
    fig, ax = plt.subplots(figsize=(6, 4))
    bs = [run["b"] for run in curve]
    for method, style in (("plain", "o-"), ("ga_train_step", "s-"), ("ga_streaming", "^--")):
      if all(method in run["methods"] for run in curve):
        ax.plot(bs, [run["methods"][method]["median_ms"] for run in curve], style, label=method)
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_yscale("log")
    ax.set_xlabel("micro-batch size b (rows)")
    ax.set_ylabel("median ms per window")
    ax.set_title(f"Time per window, k={curve[0]['k']} ({where})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "step_time_overhead.png", dpi=110)
    plt.close(fig)
    made.append(("step_time_overhead.png", "time per window vs micro-batch size"))

  memory = result.get("memory") or []
  b_values = sorted({row["b"] for row in memory})
  if memory:
    fig, axes = plt.subplots(1, len(b_values), figsize=(5 * len(b_values), 4), squeeze=False)
    for ax, b in zip(axes[0], b_values, strict=True):
      rows = sorted((r for r in memory if r["b"] == b), key=lambda r: r["k"])
      ks = [r["k"] for r in rows]
      for prog, style in (
        ("ga_train_step", "s-"),
        ("plain_whole", "o-"),
        ("optax_microbatch", "^-"),
      ):
        ys = [(r["programs"][prog]["temp_bytes"] or 0) / MIB for r in rows]
        ax.plot(ks, ys, style, label=prog)
      ref = [
        ((r["programs"]["plain_microbatch"]["temp_bytes"] or 0) + r["accumulator_bytes"]) / MIB
        for r in rows
      ]
      ax.plot(ks, ref, "k:", label="plain_microbatch + accumulator")
      ax.set_xscale("log", base=2)
      ax.set_xticks(ks, [str(k) for k in ks])
      ax.set_xlabel("k (micro-batches per window)")
      ax.set_ylabel("temp MiB (memory_analysis)")
      ax.set_title(f"b={b} ({where})", fontsize=9)
      ax.grid(True, alpha=0.3)
      ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "step_time_memory.png", dpi=110)
    plt.close(fig)
    made.append(("step_time_memory.png", "temp memory vs k"))

    fig, axes = plt.subplots(1, len(b_values), figsize=(5 * len(b_values), 4), squeeze=False)
    for ax, b in zip(axes[0], b_values, strict=True):
      rows = sorted((r for r in memory if r["b"] == b), key=lambda r: r["k"])
      ks = [r["k"] for r in rows]
      for prog in rows[0]["programs"]:
        ax.plot(ks, [r["programs"][prog]["compile_s"] for r in rows], "o-", label=prog)
      ax.set_xscale("log", base=2)
      ax.set_xticks(ks, [str(k) for k in ks])
      ax.set_ylim(bottom=0)
      ax.set_xlabel("k (micro-batches per window)")
      ax.set_ylabel("compile s (best of reps)")
      ax.set_title(f"b={b} ({where})", fontsize=9)
      ax.grid(True, alpha=0.3)
      ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "step_time_compile.png", dpi=110)
    plt.close(fig)
    made.append(("step_time_compile.png", "compile time vs k"))
  return made


def describe(name: str, result: dict[str, Any] | None) -> str:
  """One line on which run produced a script's results, read from its json."""
  if result is None:
    return "no json"
  config = result.get("config", {})
  machine = result.get("machine", {})
  smoke = config.get("smoke")
  parts = []
  if smoke is not None:
    parts.append("smoke run" if smoke else "full run")
  device = machine.get("device_kind") or machine.get("device") or config.get("device")
  if device:
    parts.append(f"device {device}")
  jax_version = machine.get("jax") or config.get("jax")
  if jax_version:
    parts.append(f"jax {jax_version}")
  if machine.get("date"):
    parts.append(machine["date"])
  return ", ".join(parts)


def write_report(args: argparse.Namespace, status: dict[str, dict[str, Any]]) -> Path:
  out = Path(args.out)
  info = machine_info(args.device)
  lines = [
    "# Benchmark report",
    "",
    f"Written by `benchmarks/run_all.py{' --smoke' if args.smoke else ''}"
    f"{f' --device {args.device}' if args.device else ''}"
    f"{f' --only {args.only}' if args.only else ''}` on {info['date']}.",
    "",
    f"- jax {info['jax']}, python {info['python']}",
    f"- device: {info['device']}",
    f"- os.cpu_count(): {info['os_cpu_count']}; {info['platform']}",
    "",
    "| script | this run | results in this folder |",
    "|---|---|---|",
  ]
  for name in SCRIPTS:
    state = status.get(name, {}).get("state", "not run (left out with --only)")
    if "seconds" in status.get(name, {}):
      state += f", {status[name]['seconds']:.0f} s"
    lines.append(f"| `{name}.py` | {state} | {describe(name, load_json(out / f'{name}.json'))} |")
  lines.append("")

  step_time = load_json(out / "step_time.json")
  plots = plot_step_time(step_time, out) if step_time else []
  for name in SCRIPTS:
    lines += [f"## {TITLES[name]}", ""]
    md_path = out / f"{name}.md"
    if not md_path.is_file():
      lines += [f"No `{name}.md` in this folder.", ""]
      continue
    lines += [demote(md_path.read_text().strip()), ""]
    if name == "step_time":
      for png, caption in plots:
        lines += [f"![{caption}]({png})", ""]
      if step_time and not plots:
        lines += ["Plots skipped: matplotlib is not installed.", ""]
    if name == "noise_scale" and (out / "noise_scale.png").is_file():
      lines += ["![noise scale estimates](noise_scale.png)", ""]
  (out / "REPORT.md").write_text("\n".join(lines))
  return out / "REPORT.md"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny sizes for every script")
  parser.add_argument("--device", choices=("cpu", "gpu", "tpu"), default=None)
  parser.add_argument("--out", default="benchmarks/results", help="folder for all results")
  parser.add_argument(
    "--only",
    default="",
    help=f"comma-separated subset of {','.join(SCRIPTS)} to run; the report still includes"
    " results already in --out for the others",
  )
  args = parser.parse_args(argv)
  names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(SCRIPTS)
  unknown = sorted(set(names) - set(SCRIPTS))
  if unknown:
    parser.error(f"unknown script(s) in --only: {', '.join(unknown)}")
  args.out = str(Path(args.out).resolve())  # the scripts run with the repository as cwd
  Path(args.out).mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  status = run_scripts([n for n in SCRIPTS if n in names], args)
  report = write_report(args, status)
  failed = [n for n, s in status.items() if s.get("rc", 0) != 0]
  print(f"wrote {report} ({time.perf_counter() - t0:.0f} s in all)")
  if failed:
    print(f"failed: {', '.join(failed)}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
