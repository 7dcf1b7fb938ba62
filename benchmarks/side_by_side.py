"""Step time side by side: ga against optax.MultiSteps, optax.microbatching and a minimal scan.

The variants of the project's step-time comparison (the file ``results/referee_b32.json``
records one of its runs), in one run per configuration, medians of ``--rounds`` rounds of ``--reps`` windows, with the spread
(min..max over rounds) of each ratio to the plain step:

  plain      jit step on the whole k*b batch (the limit: what accumulation emulates)
  ms_loop    optax.MultiSteps, k jitted micro-steps from Python
  microbat   optax.microbatching.microbatch(grad) then the optimizer once
  min_scan   a minimal lax.scan over the same strided micro-batches, mean, optimizer once
  min_guard  min_scan plus what skip_nonfinite=True (ga's default) adds, written by hand: the
             squared global norm of the mean (each matrix summed by rows first, as ga does),
             and the update run only if it is finite (a lax.cond that updates in place, as
             ga's donated step does): the floor for a step that voids bad windows
  min_loss   min_guard that also sums the micro-batches' losses and returns their mean (as ga
             reports ``metrics["loss"]``): the floor for a step with ga's guard and loss
  min_state  min_loss whose accumulator lives in the donated optimizer state, as
             AccumulateState.acc_grads does: the scan starts from it and the step writes it
             back as zeros after the update (an empty window), as ga's state must be
  ga         gradaccum_jax.train_step (fused scan + one update), donated like the others
  ga_undonated  the same with donate=False (new buffers for params and state every window)
  ga_stream  gradaccum_jax.accumulate, k jitted micro-steps (grad + tx.update) from Python
  ga_micro   gradaccum_jax.micro_step, k jitted calls from Python (no mesh)
  min_u2, min_uk  min_scan with lax.scan(..., unroll=2) and unroll=k (fully unrolled)
  ga_u2, ga_uk    ga.train_step(..., unroll=2) and unroll=k

Each fused program's compiled temp bytes (``memory_analysis()``) are recorded beside its time:
unrolling trades memory (each trip holds its micro-batches' activations) for fewer trips.

MLP 784-512-512-10, softmax cross-entropy, k = 8; by default b in (8, 32, 256) with adam,
and b = 32 with muon. Then, for ``--single-s`` seconds per configuration, plain, min_scan,
min_guard, min_loss, min_state, microbat, ga and ga_undonated one window each in turn: quantiles
(p10, p25, median) of those single windows and ga's ratio to each at the same quantile, steadier
on a shared machine than the rounds.

  python benchmarks/side_by_side.py --out benchmarks/results           # a few minutes
  python benchmarks/side_by_side.py --smoke --out /tmp/bench           # seconds

XLA:CPU runs independent operations of one program on several threads at once, in an order
its concurrency-optimized scheduler picks; how much overlaps differs between programs that do
the same work. To compare the programs with less of that overlap:

  XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false python \
    benchmarks/side_by_side.py --configs adam:8,muon:32 --tag _sequential --out benchmarks/results
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga

SIZES = (784, 512, 512, 10)
VARIANTS = (
  "plain", "ms_loop", "microbat", "min_scan", "min_guard", "min_loss", "min_state", "ga",
  "ga_undonated", "ga_stream", "ga_micro", "min_u2", "min_uk", "ga_u2", "ga_uk",
)  # fmt: skip
UNROLLED = ("min_scan", "min_u2", "min_uk", "ga", "ga_u2", "ga_uk")


def init(key, sizes):
  return [
    {"w": jax.random.normal(jax.random.fold_in(key, i), (m, n)) * (2 / m) ** 0.5, "b": jnp.zeros(n)}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
  ]


def loss_fn(p, mb):
  h = mb["x"]
  for layer in p[:-1]:
    h = jax.nn.relu(h @ layer["w"] + layer["b"])
  logits = h @ p[-1]["w"] + p[-1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"]).mean()


def make_opt(name):
  return optax.contrib.muon(1e-3) if name == "muon" else optax.adam(1e-3)


def variants(opt_name, k, b, sizes):
  """{name: (optimizer whose init makes the state, run(params, state) -> (params, state))}."""
  rng = np.random.default_rng(0)
  batch = {
    "x": jnp.asarray(rng.standard_normal((k * b, sizes[0]), dtype=np.float32)),
    "y": jnp.asarray(rng.integers(0, sizes[-1], (k * b,)), jnp.int32),
  }
  mbs = [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]
  opt, ms, tx = (
    make_opt(opt_name),
    optax.MultiSteps(make_opt(opt_name), k),
    ga.accumulate(make_opt(opt_name), k),
  )
  jit = functools.partial(jax.jit, donate_argnums=(0, 1))

  @jit
  def plain(p, s, bt):
    u, s = opt.update(jax.grad(loss_fn)(p, bt), s, p)
    return optax.apply_updates(p, u), s

  @jit
  def ms_micro(p, s, mb):
    u, s = ms.update(jax.grad(loss_fn)(p, mb), s, p)
    return optax.apply_updates(p, u), s

  @jit
  def microbat(p, s, bt):
    g = optax.microbatching.microbatch(
      jax.grad(loss_fn), argnums=1, microbatch_size=b,
      accumulator=optax.microbatching.AccumulationType.MEAN,
    )(p, bt)  # fmt: skip
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  def grad_sum(p, bt, with_loss=False, unroll=1, start=None):
    """The minimal scan: the strided micro-batches' gradients, summed (and their losses), from
    zeros or from ``start``."""

    def body(c, i):
      mb = jax.tree.map(lambda x: x.reshape((b, k) + x.shape[1:])[:, i], bt)
      if not with_loss:
        return jax.tree.map(jnp.add, c, jax.grad(loss_fn)(p, mb)), None
      loss, g = jax.value_and_grad(loss_fn)(p, mb)
      return (jax.tree.map(jnp.add, c[0], g), c[1] + loss), None

    init = jax.tree.map(jnp.zeros_like, p) if start is None else start
    return jax.lax.scan(body, (init, 0.0) if with_loss else init, jnp.arange(k), unroll=unroll)[0]

  def guarded(p, s, mean):
    """The update if the mean's squared norm is finite, in a lax.cond (in place). Rows first,
    then their sum, as ga does: XLA:CPU runs a reduction to a scalar on one thread."""
    finite = jnp.isfinite(sum(jnp.sum(jnp.sum(m * m, axis=-1)) for m in jax.tree.leaves(mean)))

    def update(c):
      u, s = opt.update(mean, c[1], c[0])
      return optax.apply_updates(c[0], u), s

    return jax.lax.cond(finite, update, lambda c: c, (p, s))

  def min_unrolled(unroll):
    @jit
    def min_scan(p, s, bt):
      u, s = opt.update(jax.tree.map(lambda a: a / k, grad_sum(p, bt, unroll=unroll)), s, p)
      return optax.apply_updates(p, u), s

    return min_scan

  min_scan, min_u2, min_uk = min_unrolled(1), min_unrolled(2), min_unrolled(k)

  @jit
  def min_guard(p, s, bt):
    return guarded(p, s, jax.tree.map(lambda a: a / k, grad_sum(p, bt)))

  @jit
  def min_loss(p, s, bt):
    acc, total = grad_sum(p, bt, with_loss=True)
    return *guarded(p, s, jax.tree.map(lambda a: a / k, acc)), total / k

  @jit
  def min_state(p, s, bt):
    s, start = s
    acc, total = grad_sum(p, bt, with_loss=True, start=start)
    p, s = guarded(p, s, jax.tree.map(lambda a: a / k, acc))
    return p, (s, jax.tree.map(jnp.zeros_like, acc)), total / k

  ga_step = ga.train_step(loss_fn, tx, donate=True)
  ga_undonated = ga.train_step(loss_fn, tx, donate=False)
  ga_u2 = ga.train_step(loss_fn, tx, donate=True, unroll=2)
  ga_uk = ga.train_step(loss_fn, tx, donate=True, unroll=k)
  with_acc = _WithAccumulator(opt)
  programs = {  # name: (what makes its state, the jitted program)
    "min_scan": (opt, min_scan), "min_u2": (opt, min_u2), "min_uk": (opt, min_uk),
    "min_loss": (opt, min_loss), "min_state": (with_acc, min_state),
    "ga": (tx, ga_step), "ga_u2": (tx, ga_u2), "ga_uk": (tx, ga_uk),
  }  # fmt: skip
  p0 = init(jax.random.key(0), sizes)
  temp = {
    n: int(f.lower(p0, o.init(p0), batch).compile().memory_analysis().temp_size_in_bytes)
    for n, (o, f) in programs.items()
  }

  @jit
  def ga_micro(p, s, mb):
    u, s = tx.update(jax.grad(loss_fn)(p, mb), s, p)
    return optax.apply_updates(p, u), s

  micro = ga.micro_step(loss_fn, tx, donate=True)
  loop = lambda f: lambda p, s: functools.reduce(lambda c, mb: f(*c, mb), mbs, (p, s))  # noqa: E731
  return {
    "plain": (opt, lambda p, s: plain(p, s, batch)),
    "ms_loop": (ms, loop(ms_micro)),
    "microbat": (opt, lambda p, s: microbat(p, s, batch)),
    "min_scan": (opt, lambda p, s: min_scan(p, s, batch)),
    "min_guard": (opt, lambda p, s: min_guard(p, s, batch)),
    "min_loss": (opt, lambda p, s: min_loss(p, s, batch)[:2]),
    "min_state": (with_acc, lambda p, s: min_state(p, s, batch)[:2]),
    "ga": (tx, lambda p, s: ga_step(p, s, batch)[:2]),
    "ga_undonated": (tx, lambda p, s: ga_undonated(p, s, batch)[:2]),
    "ga_stream": (tx, loop(ga_micro)),
    "ga_micro": (micro, loop(lambda p, s, mb: micro(p, s, mb)[:2])),
    "min_u2": (opt, lambda p, s: min_u2(p, s, batch)),
    "min_uk": (opt, lambda p, s: min_uk(p, s, batch)),
    "ga_u2": (tx, lambda p, s: ga_u2(p, s, batch)[:2]),
    "ga_uk": (tx, lambda p, s: ga_uk(p, s, batch)[:2]),
  }, temp


class _WithAccumulator:
  """``opt``'s state with an accumulator of zeros beside it, for ``min_state``."""

  def __init__(self, opt):
    self.opt = opt

  def init(self, p):
    return self.opt.init(p), jax.tree.map(jnp.zeros_like, p)


def measure(opt_name, k, b, sizes, rounds, reps, min_sample_s=0.0, single_s=0.0):
  """Times every variant; a sample is ``reps`` windows, more when a minimal-scan window is
  short (at least ``min_sample_s`` of it per sample), so that the host's jitter averages out."""
  runs, temp = variants(opt_name, k, b, sizes)
  p0 = init(jax.random.key(0), sizes)

  def fresh(o):
    p = jax.tree.map(jnp.array, p0)
    return p, o.init(p)

  outs = {n: f(*fresh(o))[0] for n, (o, f) in runs.items()}
  err = {
    n: float(
      max(
        jax.tree.leaves(jax.tree.map(lambda u, w: jnp.max(jnp.abs(u - w)), outs[n], outs["plain"]))
      )
    )
    for n in runs
  }
  st = fresh(runs["min_scan"][0])
  st = jax.block_until_ready(runs["min_scan"][1](*st))
  t0 = time.perf_counter()
  jax.block_until_ready(runs["min_scan"][1](*st))
  reps = max(reps, int(min_sample_s / (time.perf_counter() - t0)) + 1)
  samples = {n: [] for n in runs}
  for _ in range(rounds):  # interleaved: every round times every variant
    for n, (o, f) in runs.items():
      st = fresh(o)
      for _ in range(2):
        st = f(*st)
      jax.block_until_ready(st)
      t0 = time.perf_counter()
      for _ in range(reps):
        st = f(*st)
      jax.block_until_ready(st)
      samples[n].append((time.perf_counter() - t0) / reps * 1e3)
  med = {n: statistics.median(v) for n, v in samples.items()}
  single = single_windows(runs, fresh, single_s)
  # Ratios per round (same round, same machine state), then their median and spread.
  ratios = {n: [v / pl for v, pl in zip(samples[n], samples["plain"], strict=True)] for n in runs}
  return {
    "opt": opt_name, "b": b, "k": k, "reps": reps, "ms": med,
    "ratio": {n: statistics.median(r) for n, r in ratios.items()},
    "ratio_min": {n: min(r) for n, r in ratios.items()},
    "ratio_max": {n: max(r) for n, r in ratios.items()},
    "stream_vs_ms_loop": statistics.median(
      [g / m for g, m in zip(samples["ga_stream"], samples["ms_loop"], strict=True)]
    ),
    "micro_vs_ms_loop": statistics.median(
      [g / m for g, m in zip(samples["ga_micro"], samples["ms_loop"], strict=True)]
    ),
    **{
      f"{g}_vs_{m}": statistics.median([x / y for x, y in zip(samples[g], samples[m], strict=True)])
      for g, m in (
        *(("ga", m) for m in ("min_scan", "min_guard", "min_loss", "min_state", "microbat")),
        ("ga_u2", "min_u2"), ("ga_uk", "min_uk"), ("ga_u2", "min_scan"), ("ga_uk", "min_scan"),
      )
    },
    "temp_bytes": temp,
    "max_abs_diff_to_plain": err,
    "single": single,
  }  # fmt: skip


FUSED = (
  "plain", "min_scan", "min_guard", "min_loss", "min_state", "microbat", "ga", "ga_undonated",
)  # fmt: skip
QUANTILES = (0.1, 0.25, 0.5)
MIN_SINGLE = 20  # single windows per variant at least, after two warm-up windows


def single_windows(runs, fresh, seconds):
  """The plain step and the fused variants one window each in turn, for about ``seconds``:
  quantiles of the single-window times (ms) and ga's ratio to each other variant at every
  quantile.

  On a shared machine a slow window is the neighbours' doing, so the low quantiles of many
  short samples show what each program costs more steadily than the median of a few long
  ones; the ratios compare the same quantile of windows timed side by side. The order turns
  by one variant every round, so that none always follows the same neighbour (whose data
  it would find evicted from the caches in the same way every time)."""
  if seconds <= 0:
    return None
  states = {n: fresh(runs[n][0]) for n in FUSED}
  t0, times = time.perf_counter(), {n: [] for n in FUSED}
  while time.perf_counter() - t0 < seconds or len(times["ga"]) < 2 + MIN_SINGLE:
    turn = len(times["ga"]) % len(FUSED)
    for n in FUSED[turn:] + FUSED[:turn]:
      t = time.perf_counter()
      states[n] = jax.block_until_ready(runs[n][1](*states[n]))
      times[n].append((time.perf_counter() - t) * 1e3)
  q = {n: {str(p): float(np.quantile(v[2:], p)) for p in QUANTILES} for n, v in times.items()}
  return {
    "windows": len(times["ga"]) - 2, "ms": q,
    "ga_vs": {n: {p: q["ga"][p] / q[n][p] for p in q[n]} for n in FUSED if n != "ga"},
    "min_scan_vs_plain": {p: q["min_scan"][p] / q["plain"][p] for p in q["plain"]},
    "undonated_vs_min_scan": {p: q["ga_undonated"][p] / q["min_scan"][p] for p in q["plain"]},
  }  # fmt: skip


def table(rows):
  head = (
    "| opt | b | plain ms | "
    + " | ".join(VARIANTS[1:])
    + " | ga / min_scan | ga / min_guard | ga / min_loss | ga / min_state | ga / microbat"
    + " | stream / ms_loop | micro / ms_loop |"
  )
  lines = [head, "|" + "---|" * (len(VARIANTS) + 9)]
  for r in rows:
    cells = [
      f"{r['ratio'][n]:.2f}x ({r['ratio_min'][n]:.2f}-{r['ratio_max'][n]:.2f})"
      for n in VARIANTS[1:]
    ]
    lines.append(
      f"| {r['opt']} | {r['b']} | {r['ms']['plain']:.2f} | " + " | ".join(cells)
      + f" | {r['ga_vs_min_scan']:.3f} | {r['ga_vs_min_guard']:.3f} | {r['ga_vs_min_loss']:.3f}"
      + f" | {r['ga_vs_min_state']:.3f} | {r['ga_vs_microbat']:.3f}"
      + f" | {r['stream_vs_ms_loop']:.3f}"
      + f" | {r['micro_vs_ms_loop']:.3f} |"
    )  # fmt: skip
  return "\n".join(lines)


def unroll_table(rows):
  """Time (ratio to plain) and compiled temp memory of the rolled and unrolled programs."""
  head = (
    "| opt | b | " + " | ".join(f"{n}: x plain, temp MiB" for n in UNROLLED)
    + " | ga / min_scan | ga_u2 / min_u2 | ga_uk / min_uk |"
  )  # fmt: skip
  lines = [head, "|" + "---|" * (len(UNROLLED) + 5)]
  for r in rows:
    cells = [f"{r['ratio'][n]:.2f}, {r['temp_bytes'][n] / 2**20:.2f}" for n in UNROLLED]
    lines.append(
      f"| {r['opt']} | {r['b']} | " + " | ".join(cells) + f" | {r['ga_vs_min_scan']:.3f}"
      + f" | {r['ga_u2_vs_min_u2']:.3f} | {r['ga_uk_vs_min_uk']:.3f} |"
    )  # fmt: skip
  return "\n".join(lines)


def state_table(rows):
  """Compiled temp memory of the guarded scans and ga: where the accumulator lives."""
  lines = [
    "| opt | b | min_loss temp MiB | min_state temp MiB | ga temp MiB |",
    "|---|---|---|---|---|",
  ]
  for r in rows:
    t = {n: r["temp_bytes"][n] / 2**20 for n in ("min_loss", "min_state", "ga")}
    lines.append(
      f"| {r['opt']} | {r['b']} | {t['min_loss']:.2f} | {t['min_state']:.2f} | {t['ga']:.2f} |"
    )
  return "\n".join(lines)


def single_table(rows):
  head = (
    "| opt | b | windows | "
    + " | ".join(f"{n} ms" for n in FUSED)
    + " | ga / min_scan | ga / min_guard | ga / min_loss | ga / min_state | ga / microbat"
    + " | ga / plain | min_scan / plain | ga_undonated / min_scan |"
  )
  lines = [head, "|" + "---|" * (len(FUSED) + 11)]
  fmt = lambda d: "/".join(f"{d[str(p)]:.3f}" for p in QUANTILES)  # noqa: E731
  for r in rows:
    s = r["single"]
    lines.append(
      f"| {r['opt']} | {r['b']} | {s['windows']} | " + " | ".join(fmt(s["ms"][n]) for n in FUSED)
      + " | " + " | ".join(
        fmt(s["ga_vs"][n])
        for n in ("min_scan", "min_guard", "min_loss", "min_state", "microbat", "plain")
      ) + f" | {fmt(s['min_scan_vs_plain'])} | {fmt(s['undonated_vs_min_scan'])} |"
    )  # fmt: skip
  return "\n".join(lines)


def parse_configs(text):
  """``"adam:8,muon:32"`` -> ``[("adam", 8), ("muon", 32)]``, or a ValueError naming the entry."""
  configs = []
  for entry in text.split(","):
    opt, _, b = entry.strip().partition(":")
    if opt not in ("adam", "muon") or not b.isdigit() or int(b) < 1:
      raise ValueError(
        f"--configs entry {entry!r} is not opt:b with opt adam or muon and b a positive int,"
        " e.g. --configs adam:8,muon:32"
      )
    configs.append((opt, int(b)))
  return configs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", type=Path, default=None, help="folder for side_by_side.{json,md}")
  ap.add_argument("--smoke", action="store_true", help="tiny sizes and one round")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument(
    "--min-sample-s", type=float, default=0.5,
    help="at least this many seconds of minimal-scan windows per sample (more reps at small b)",
  )  # fmt: skip
  ap.add_argument(
    "--single-s", type=float, default=20.0,
    help="seconds per configuration of single windows of plain and the fused variants, in turn",
  )  # fmt: skip
  ap.add_argument("--k", type=int, default=8)
  ap.add_argument(
    "--configs", default="adam:8,adam:32,adam:256,muon:32",
    help="comma-separated opt:b rows (opt: adam or muon)",
  )  # fmt: skip
  ap.add_argument(
    "--tag", default="", help="suffix of the output files' names (side_by_side<tag>.json, .md)"
  )
  args = ap.parse_args(argv)
  sizes, configs, rounds, reps = SIZES, parse_configs(args.configs), args.rounds, args.reps
  if args.smoke:
    sizes, configs, rounds, reps = (16, 8, 4), [("adam", 4)], 1, 2
    args.min_sample_s, args.single_s = 0.0, 0.1
  rows, t0 = [], time.perf_counter()
  for o, b in configs:
    rows.append(measure(o, args.k, b, sizes, rounds, reps, args.min_sample_s, args.single_s))
    r = rows[-1]
    print(  # progress on stderr: a run stopped at its time limit still shows the rows it did
      f"[side_by_side {time.perf_counter() - t0:6.1f} s] {o} b={b}: ms "
      + ", ".join(f"{n} {v:.3g}" for n, v in r["ms"].items())
      + f"; ga/min_scan {r['ga_vs_min_scan']:.3f}, ga/microbat {r['ga_vs_microbat']:.3f}",
      file=sys.stderr, flush=True,
    )  # fmt: skip
  meta = {
    "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {jax.devices()[0].device_kind}",
    "backend": jax.default_backend(), "jax": jax.__version__, "optax": optax.__version__,
    "gradaccum_jax": ga.__version__, "rounds": rounds, "reps": reps, "k": args.k, "sizes": sizes,
    "min_sample_s": args.min_sample_s, "single_s": args.single_s,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }  # fmt: skip
  md = (
    "# Step time side by side\n\n"
    f"Side by side, k={args.k}, MLP {'-'.join(map(str, sizes))}; {meta['date']}, {meta['machine']},"
    f" jax {meta['jax']}, optax {meta['optax']}"
    + (f", XLA_FLAGS={meta['xla_flags']}" if meta["xla_flags"] else "")
    + f"; medians of {rounds} rounds; a round times"
    f" every variant on at least {reps} windows, and at least {args.min_sample_s} s of minimal"
    " scan windows (reps per row in the JSON); ratio to plain (min-max over rounds).\n\n"
    + table(rows)
    + "\n\nUnrolled loops (`unroll=2` and `unroll=k`): time as a ratio to plain, compiled temp"
    " memory (MiB), and ga's ratio to the minimal scan unrolled alike.\n\n"
    + unroll_table(rows)
    + "\n\nCompiled temp memory of the guarded scans (arguments aside: min_state's and ga's hold"
    " the accumulator, min_loss's do not).\n\n" + state_table(rows) + "\n"
  )
  if all(r["single"] for r in rows):
    md += (
      f"\nSingle windows of the plain step and the fused variants in turn, about {args.single_s} s"
      " per row:"
      f" p10/p25/median of the window times (ms), and ga's ratio to each at the same quantile.\n\n"
      + single_table(rows)
      + "\n"
    )
  print(md)
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"side_by_side{args.tag}"
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / f"{name}.md").write_text(md)


if __name__ == "__main__":
  main()
