"""Step time, temp memory and compile time of gradient accumulation, vs one plain big-batch step.

What is measured, for an MLP 784-512-512-10 (relu), mean softmax cross-entropy,
``optax.adam(1e-3)``, float32, random data from ``jax.random`` (fixed seed),
``k`` micro-batches of ``b`` rows per window (whole batch ``B = k * b``):

  plain             one jitted step on the whole batch: value_and_grad + adam + apply_updates.
  multisteps_loop   optax.MultiSteps(adam, k): a jitted micro-step called k times per window.
  optax_microbatch  optax.microbatching.microbatch(value_and_grad, MEAN) over the batch, then
                    adam, in one jitted function.
  ga_streaming      ga.accumulate(adam, k): a jitted micro-step called k times per window.
  ga_train_step     ga.train_step(loss_fn, ga.accumulate(adam, k)): one call per window.

The loop methods get micro-batches sliced before the timed region (``ga.microbatch``, the
same strided rows the fused methods use). Timing: the wall time of one window (= one
optimizer step) up to ``jax.block_until_ready`` on its params and state, after warm-up.
The methods are interleaved (each round times every method a few windows in turn, the
order rotated each round) so drift on a shared machine hits all of them alike; the
median over all samples is reported, with its ratio to ``plain`` from the same run. Each
method's first window, from the same params, is also compared with ``plain`` (max abs
param difference) as a sanity check.

A second run gives the overhead curve over the micro-batch size ``b`` at fixed ``k``. The
memory/compile table lowers and compiles (on ``jax.ShapeDtypeStruct`` inputs, nothing
executes) for several ``k`` and reports ``compiled.memory_analysis()`` temp bytes and
compile seconds. XLA:CPU reports ~0 temp bytes for small programs, so a larger ``b`` is
added when the first one gives ~0.

Usage: ``python benchmarks/step_time.py [--smoke] [--out benchmarks/results] [--device cpu]``.
Writes ``<out>/step_time.json`` (raw numbers) and ``<out>/step_time.md`` (the tables).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import optax

try:
  import gradaccum_jax as ga
except ModuleNotFoundError:  # run from a source tree without installing
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import gradaccum_jax as ga

LR = 1e-3
SEED = 0
MIB = 2**20
METHODS = ("plain", "multisteps_loop", "optax_microbatch", "ga_streaming", "ga_train_step")
CURVE_METHODS = ("plain", "ga_streaming", "ga_train_step")
# XLA:CPU reports no temp buffers for small programs; below this we add a larger b.
TEMP_MEANINGFUL_BYTES = MIB


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes of one benchmark run."""

  layers: tuple[int, ...]  # input, hidden..., classes
  k: int  # micro-batches per window in the timing runs
  main_bs: tuple[int, ...]
  main_rounds: int
  main_windows: int  # windows per method per round
  curve_bs: tuple[int, ...]
  curve_rounds: int
  curve_windows: int
  warmup: int  # windows per method before timing (the first one compiles)
  mem_ks: tuple[int, ...]
  mem_b: int
  mem_big_b: int  # used as well, for mem_big_ks, when mem_b gives ~0 temp bytes
  mem_big_ks: tuple[int, ...]
  compile_reps: int  # compile each program this many times, report the fastest


FULL = Config(
  layers=(784, 512, 512, 10),
  k=8,
  main_bs=(32, 256),
  main_rounds=10,
  main_windows=3,
  curve_bs=(8, 16, 32, 64, 128, 256),
  curve_rounds=5,
  curve_windows=3,
  warmup=2,
  mem_ks=(2, 8, 64),
  mem_b=256,
  mem_big_b=4096,
  mem_big_ks=(2, 8, 64),
  compile_reps=2,
)

SMOKE = Config(
  layers=(16, 32, 32, 4),
  k=4,
  main_bs=(4,),
  main_rounds=2,
  main_windows=1,
  curve_bs=(4,),
  curve_rounds=1,
  curve_windows=1,
  warmup=1,
  mem_ks=(2,),
  mem_b=8,
  mem_big_b=16,
  mem_big_ks=(2,),
  compile_reps=1,
)


# --------------------------------------------------------------------------- model


def init_params(key: jax.Array, layers: Sequence[int]) -> list[dict[str, jax.Array]]:
  params = []
  for key_i, (n_in, n_out) in zip(
    jax.random.split(key, len(layers) - 1), zip(layers[:-1], layers[1:], strict=True), strict=True
  ):
    w = jax.random.normal(key_i, (n_in, n_out), jnp.float32) * jnp.sqrt(2.0 / n_in)
    params.append({"w": w, "b": jnp.zeros((n_out,), jnp.float32)})
  return params


def loss_fn(params: list[dict[str, jax.Array]], batch: dict[str, jax.Array]) -> jax.Array:
  h = batch["x"]
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      h = jax.nn.relu(h)
  return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


def make_batch(key: jax.Array, size: int, layers: Sequence[int]) -> dict[str, jax.Array]:
  kx, ky = jax.random.split(key)
  return {
    "x": jax.random.normal(kx, (size, layers[0]), jnp.float32),
    "y": jax.random.randint(ky, (size,), 0, layers[-1], jnp.int32),
  }


def param_bytes(params: Any) -> int:
  """Bytes of one fp32 copy of the params (= one fp32 accumulator)."""
  return sum(int(x.size) * 4 for x in jax.tree.leaves(params))


# --------------------------------------------------------------------------- steps
# Each factory returns an un-jitted ``step(params, state, batch) -> (params, state, aux)``.


def plain_step_fn(tx: optax.GradientTransformation) -> Callable[..., Any]:
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def micro_step_fn(tx: optax.GradientTransformation) -> Callable[..., Any]:
  """Grad on one micro-batch + ``tx.update`` + apply (MultiSteps or ga.accumulate)."""
  return plain_step_fn(tx)


def optax_microbatch_step_fn(tx: optax.GradientTransformation, b: int) -> Callable[..., Any]:
  vg = optax.microbatching.microbatch(
    jax.value_and_grad(loss_fn),
    argnums=1,
    microbatch_size=b,
    accumulator=optax.microbatching.AccumulationType.MEAN,
  )

  def step(params, opt_state, batch):
    loss, grads = vg(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def adam() -> optax.GradientTransformation:
  return optax.adam(LR)


# --------------------------------------------------------------------------- timing


class Runner:
  """Runs one window: ``step`` over ``inputs`` (1 whole batch, or k micro-batches)."""

  def __init__(self, step: Callable[..., Any], params: Any, state: Any, inputs: list[Any]):
    self.step, self.params, self.state, self.inputs = step, params, state, inputs

  def __call__(self) -> Any:
    p, s = self.params, self.state
    for x in self.inputs:
      p, s, _ = self.step(p, s, x)
    self.params, self.state = p, s
    return p, s


def make_runners(
  names: Sequence[str], params0: Any, batch: Any, k: int, b: int
) -> dict[str, Runner]:
  mbs = jax.block_until_ready([ga.microbatch(batch, i, k) for i in range(k)])
  dev = jax.tree.leaves(params0)[0].devices().pop()

  def init(tx: optax.GradientTransformation) -> Any:
    # Committed like the step's outputs, or the second call would compile again.
    return jax.device_put(tx.init(params0), dev)

  runners: dict[str, Runner] = {}
  for name in names:
    if name == "plain":
      tx = adam()
      runners[name] = Runner(jax.jit(plain_step_fn(tx)), params0, init(tx), [batch])
    elif name == "multisteps_loop":
      tx = optax.MultiSteps(adam(), every_k_schedule=k)
      runners[name] = Runner(jax.jit(micro_step_fn(tx)), params0, init(tx), mbs)
    elif name == "optax_microbatch":
      tx = adam()
      step = jax.jit(optax_microbatch_step_fn(tx, b))
      runners[name] = Runner(step, params0, init(tx), [batch])
    elif name == "ga_streaming":
      tx = ga.accumulate(adam(), k)
      runners[name] = Runner(jax.jit(micro_step_fn(tx)), params0, init(tx), mbs)
    elif name == "ga_train_step":
      tx = ga.accumulate(adam(), k)
      runners[name] = Runner(ga.train_step(loss_fn, tx), params0, init(tx), [batch])
    else:
      raise ValueError(name)
  return runners


def max_abs_diff(a: Any, b: Any) -> float:
  return max(
    float(jnp.max(jnp.abs(x - y)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def summarize(samples_s: list[float]) -> dict[str, Any]:
  ms = sorted(1e3 * s for s in samples_s)
  q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
  return {
    "median_ms": statistics.median(ms),
    "p25_ms": q[0],
    "p75_ms": q[2],
    "min_ms": ms[0],
    "n": len(ms),
    "samples_ms": [1e3 * s for s in samples_s],
  }


def time_methods(
  names: Sequence[str],
  cfg: Config,
  b: int,
  rounds: int,
  windows: int,
  dev: jax.Device,
) -> dict[str, Any]:
  """Interleaved timing of ``names`` at micro-batch size ``b``; returns per-method stats."""
  k = cfg.k
  kp, kb = jax.random.split(jax.random.key(SEED))
  params0 = jax.device_put(init_params(kp, cfg.layers), dev)
  batch = jax.device_put(make_batch(kb, k * b, cfg.layers), dev)
  runners = make_runners(names, params0, batch, k, b)

  # Warm-up; the first window of each method (from params0) doubles as a sanity check.
  first = {}
  for name, run in runners.items():
    first[name] = jax.block_until_ready(run())[0]
    for _ in range(cfg.warmup - 1):
      jax.block_until_ready(run())
  check = {name: max_abs_diff(p, first["plain"]) for name, p in first.items()}

  samples: dict[str, list[float]] = {n: [] for n in names}
  order = list(names)
  for r in range(rounds):
    rot = order[r % len(order) :] + order[: r % len(order)]
    for name in rot:
      run = runners[name]
      for _ in range(windows):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        samples[name].append(time.perf_counter() - t0)

  stats = {n: summarize(samples[n]) for n in names}
  base = stats["plain"]["median_ms"]
  for n in names:
    stats[n]["ratio_vs_plain"] = stats[n]["median_ms"] / base
    stats[n]["first_window_max_abs_diff_vs_plain"] = check[n]
  return {"k": k, "b": b, "B": k * b, "methods": stats}


# --------------------------------------------------------------------------- memory / compile


def sds(tree: Any, dev: jax.Device) -> Any:
  sharding = jax.sharding.NamedSharding(
    jax.sharding.Mesh([dev], ("one",)), jax.sharding.PartitionSpec()
  )
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def compile_stats(jitted: Any, *args: Any, reps: int = 1) -> dict[str, Any]:
  """Lower + compile on abstract args (nothing runs), ``reps`` times from cleared caches.

  Returns the fastest lower/compile seconds, all of them, and memory_analysis bytes.
  """
  times = []
  for _ in range(reps):
    jax.clear_caches()
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    times.append((t1 - t0, t2 - t1))
  lower_s, compile_s = min(t[0] for t in times), min(t[1] for t in times)
  out: dict[str, Any] = {
    "lower_s": lower_s,
    "compile_s": compile_s,
    "total_s": min(a + b for a, b in times),
    "all_lower_compile_s": times,
  }
  ma = compiled.memory_analysis()
  for field in ("temp", "argument", "output", "alias", "generated_code"):
    v = getattr(ma, f"{field}_size_in_bytes", None) if ma is not None else None
    out[f"{field}_bytes"] = None if v is None else int(v)
  return out


def memory_rows(cfg: Config, b: int, ks: Sequence[int], dev: jax.Device) -> list[dict[str, Any]]:
  key = jax.random.key(SEED)
  params = sds(jax.eval_shape(lambda: init_params(key, cfg.layers)), dev)
  acc_bytes = param_bytes(params)
  adam_state = sds(jax.eval_shape(adam().init, params), dev)

  def batch_sds(rows: int) -> Any:
    return sds(jax.eval_shape(lambda: make_batch(key, rows, cfg.layers)), dev)

  def stats(jitted: Any, *args: Any) -> dict[str, Any]:
    return compile_stats(jitted, *args, reps=cfg.compile_reps)

  plain_mb = stats(jax.jit(plain_step_fn(adam())), params, adam_state, batch_sds(b))
  rows = []
  for k in ks:
    tx = ga.accumulate(adam(), k)
    ga_state = sds(jax.eval_shape(tx.init, params), dev)
    ms = optax.MultiSteps(adam(), every_k_schedule=k)
    ms_state = sds(jax.eval_shape(ms.init, params), dev)
    whole, mb = batch_sds(k * b), batch_sds(b)
    res = {
      "ga_train_step": stats(ga.train_step(loss_fn, tx), params, ga_state, whole),
      "plain_microbatch": plain_mb,
      "plain_whole": stats(jax.jit(plain_step_fn(adam())), params, adam_state, whole),
      "optax_microbatch": stats(
        jax.jit(optax_microbatch_step_fn(adam(), b)), params, adam_state, whole
      ),
      "multisteps_micro_step": stats(jax.jit(micro_step_fn(ms)), params, ms_state, mb),
      "ga_streaming_micro_step": stats(jax.jit(micro_step_fn(tx)), params, ga_state, mb),
    }
    denom = (res["plain_microbatch"]["temp_bytes"] or 0) + acc_bytes
    ts = res["ga_train_step"]["temp_bytes"]
    rows.append(
      {
        "k": k,
        "b": b,
        "B": k * b,
        "accumulator_bytes": acc_bytes,
        "ratio_temp_train_step_vs_plain_mb_plus_acc": None if ts is None else ts / denom,
        "programs": res,
      }
    )
  return rows


# --------------------------------------------------------------------------- report


def machine_info(dev: jax.Device) -> dict[str, Any]:
  cpu_model = ""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu_model = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  return {
    "backend": jax.default_backend(),
    "device": str(dev),
    "device_platform": dev.platform,
    "device_kind": dev.device_kind,
    "num_devices": len(jax.devices(dev.platform)),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "optax": optax.__version__,
    "gradaccum_jax": ga.__version__,
    "python": platform.python_version(),
    "os_cpu_count": os.cpu_count(),
    "platform_processor": platform.processor(),
    "cpu_model": cpu_model,
    "platform": platform.platform(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  }


def fmt_mib(x: int | None) -> str:
  return "n/a" if x is None else f"{x / MIB:.2f}"


def main_table(runs: list[dict[str, Any]], names: Sequence[str]) -> str:
  head = "| method |" + "".join(
    f" b={r['b']} (B={r['B']}) median ms [p25-p75] | ratio |" for r in runs
  )
  sep = "|---|" + "---:|---:|" * len(runs)
  lines = [head, sep]
  for n in names:
    cells = ""
    for r in runs:
      s = r["methods"][n]
      cells += (
        f" {s['median_ms']:.2f} [{s['p25_ms']:.2f}-{s['p75_ms']:.2f}] | {s['ratio_vs_plain']:.2f} |"
      )
    lines.append(f"| {n} |{cells}")
  lines.append("")
  lines.append(
    "First window from identical params, max |param - plain's|: "
    + "; ".join(
      f"b={r['b']}: "
      + ", ".join(
        f"{n} {r['methods'][n]['first_window_max_abs_diff_vs_plain']:.1e}"
        for n in names
        if n != "plain"
      )
      for r in runs
    )
  )
  return "\n".join(lines)


def curve_table(runs: list[dict[str, Any]]) -> str:
  lines = [
    "| b | B | plain ms | ga_streaming ms | ga_train_step ms | (d)/(a) streaming | (e)/(a) train_step |",
    "|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in runs:
    m = r["methods"]
    lines.append(
      f"| {r['b']} | {r['B']} | {m['plain']['median_ms']:.2f} |"
      f" {m['ga_streaming']['median_ms']:.2f} | {m['ga_train_step']['median_ms']:.2f} |"
      f" {m['ga_streaming']['ratio_vs_plain']:.2f} | {m['ga_train_step']['ratio_vs_plain']:.2f} |"
    )
  return "\n".join(lines)


MEM_COLS = (
  ("ga_train_step", "train_step"),
  ("plain_microbatch", "plain(b)"),
  ("plain_whole", "plain(k*b)"),
  ("optax_microbatch", "optax_mb"),
  ("multisteps_micro_step", "MultiSteps micro"),
  ("ga_streaming_micro_step", "ga streaming micro"),
)


def memory_table(rows: list[dict[str, Any]]) -> str:
  head = "| b | k | B | acc MiB |" + "".join(f" {label} |" for _, label in MEM_COLS)
  head += " train_step / (plain(b) + acc) |"
  lines = [
    "Temp MiB (`compiled.memory_analysis().temp_size_in_bytes`):",
    "",
    head,
    "|---:|---:|---:|---:|" + "---:|" * (len(MEM_COLS) + 1),
  ]
  for r in rows:
    p = r["programs"]
    ratio = r["ratio_temp_train_step_vs_plain_mb_plus_acc"]
    lines.append(
      f"| {r['b']} | {r['k']} | {r['B']} | {fmt_mib(r['accumulator_bytes'])} |"
      + "".join(f" {fmt_mib(p[key]['temp_bytes'])} |" for key, _ in MEM_COLS)
      + (" n/a |" if ratio is None else f" {ratio:.2f} |")
    )
  lines += [
    "",
    "Compile seconds (`.compile()`; lower in brackets):",
    "",
    "| b | k | B |" + "".join(f" {label} |" for _, label in MEM_COLS),
    "|---:|---:|---:|" + "---:|" * len(MEM_COLS),
  ]
  for r in rows:
    p = r["programs"]
    lines.append(
      f"| {r['b']} | {r['k']} | {r['B']} |"
      + "".join(f" {p[key]['compile_s']:.2f} ({p[key]['lower_s']:.2f}) |" for key, _ in MEM_COLS)
    )
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
  parser.add_argument("--out", default="benchmarks/results", help="folder for the json/md")
  parser.add_argument("--device", choices=("cpu", "gpu", "tpu"), default=None)
  args = parser.parse_args(argv)
  cfg = SMOKE if args.smoke else FULL
  dev = jax.devices(args.device)[0] if args.device else jax.devices()[0]
  t_start = time.perf_counter()

  info = machine_info(dev)
  info_line = (
    f"Machine: {info['cpu_model'] or info['platform_processor'] or platform.machine()},"
    f" os.cpu_count()={info['os_cpu_count']}; device {info['device']} ({info['device_kind']},"
    f" backend {info['backend']}); jax {info['jax']}, jaxlib {info['jaxlib']}, optax"
    f" {info['optax']}; {info['date']}"
  )
  print(info_line, flush=True)
  print(json.dumps(info, indent=1), flush=True)

  main_runs = []
  for b in cfg.main_bs:
    print(f"timing all methods, k={cfg.k} b={b} ...", flush=True)
    main_runs.append(time_methods(METHODS, cfg, b, cfg.main_rounds, cfg.main_windows, dev))
  curve_runs = []
  for b in cfg.curve_bs:
    print(f"overhead curve, k={cfg.k} b={b} ...", flush=True)
    curve_runs.append(time_methods(CURVE_METHODS, cfg, b, cfg.curve_rounds, cfg.curve_windows, dev))

  print(f"memory/compile, b={cfg.mem_b} ...", flush=True)
  mem = memory_rows(cfg, cfg.mem_b, cfg.mem_ks, dev)
  for r in mem:
    print(
      f"  b={r['b']} k={r['k']}: temp bytes train_step"
      f" {r['programs']['ga_train_step']['temp_bytes']}, plain(b)"
      f" {r['programs']['plain_microbatch']['temp_bytes']}",
      flush=True,
    )
  small = [
    r["programs"][name]["temp_bytes"] or 0
    for r in mem
    for name in ("ga_train_step", "plain_microbatch")
  ]
  mem_note = f"Each row's micro-batch size is its b column; all rows used b={cfg.mem_b}."
  if min(small) < TEMP_MEANINGFUL_BYTES:
    print(f"  temp ~0 at b={cfg.mem_b}; adding b={cfg.mem_big_b} ...", flush=True)
    mem += memory_rows(cfg, cfg.mem_big_b, cfg.mem_big_ks, dev)
    mem_note = (
      f"Each row's micro-batch size is its b column. At b={cfg.mem_b} some programs report"
      f" < {TEMP_MEANINGFUL_BYTES // MIB} MiB temp (XLA:CPU reports ~0 temp for small"
      f" programs), so rows with b={cfg.mem_big_b} were added; read the ratio there."
    )

  total_s = time.perf_counter() - t_start
  model = "-".join(map(str, cfg.layers))
  md = "\n".join(
    [
      f"# Gradient accumulation step time ({'smoke' if args.smoke else 'full'} run)",
      "",
      info_line,
      "",
      f"MLP {model} relu, mean softmax cross-entropy, adam(1e-3), float32. Interleaved"
      f" timing; median wall ms per window (one optimizer step = k micro-batches), ratio ="
      f" median / plain's median in the same run. Total run {total_s:.0f} s.",
      "",
      f"## Step time per window, k={cfg.k} ({cfg.main_rounds} rounds x {cfg.main_windows}"
      " windows per method)",
      "",
      main_table(main_runs, METHODS),
      "",
      f"## Overhead vs micro-batch size b, k={cfg.k} ({cfg.curve_rounds} rounds x"
      f" {cfg.curve_windows} windows)",
      "",
      curve_table(curve_runs),
      "",
      "## Temp memory and compile time (compiled on ShapeDtypeStructs, nothing run)",
      "",
      mem_note,
      "",
      memory_table(mem),
      "",
    ]
  )
  print()
  print(md)

  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  result = {
    "config": dataclasses.asdict(cfg) | {"smoke": args.smoke, "lr": LR, "seed": SEED},
    "machine": info,
    "methods": list(METHODS),
    "main": main_runs,
    "curve": curve_runs,
    "memory": mem,
    "memory_note": mem_note,
    "total_s": total_s,
  }
  (out / "step_time.json").write_text(json.dumps(result, indent=1) + "\n")
  (out / "step_time.md").write_text(md)
  print(f"wrote {out / 'step_time.json'} and {out / 'step_time.md'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
