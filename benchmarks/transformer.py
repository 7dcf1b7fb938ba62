"""Throughput and memory of ga.train_step on a transformer stack that keeps the device busy.

A decoder-only transformer (pre-norm blocks scanned over depth, causal attention by
``jax.nn.dot_product_attention``, tied embedding), float32 params with bf16 compute,
next-token cross-entropy, ``optax.chain(clip_by_global_norm(1), adamw)``. Four programs,
each jitted with params and state donated:

  plain_b   one optimizer step on a micro-batch of b sequences: the throughput to keep
  plain_kb  one optimizer step on the whole k*b sequences (what accumulation emulates)
  ga        ga.train_step on the k*b sequences (k micro-batches of b, compute_dtype=bf16)
  min_scan  a hand-written lax.scan of the k micro-batch gradients from zeros, their mean, one
            update (bf16 compute as ga's): the floor for an accumulating step
  ms_loop   optax.MultiSteps: k jitted micro-steps from Python per window
  microbat  optax.microbatching.microbatch(grad) on the k*b sequences, then the update

Timing: interleaved rounds, each timing ``--reps`` calls of every program after two
warm-up calls; tokens/s per round and the same-round ratio ga / plain_b (median and
min-max over rounds), and ga's time per window over each other window's in the same round. Memory: each program's ``compiled.memory_analysis()`` (arguments +
outputs - aliased + temp), and ga's excess over plain_b's plus the float32 accumulator and
the larger batch; with ``--peak`` (a backend whose devices report ``memory_stats``: GPU,
TPU) each program but plain_kb also runs three steps in its own subprocess, which reports the
device's ``peak_bytes_in_use``. Achieved TFLOP/s: tokens/s times the model's training flops
per token (6 N + 12 L T d; not counting the forward passes recomputed under remat).

Presets: ``--preset gpu`` (d 2048, 8 blocks, 2048 tokens per sequence, b 8, k 4, each block
recomputed in the backward pass: a compute-bound plain step on an H200), ``cpu`` (d 256, 4
blocks, 128 tokens, b 4, k 4), ``--smoke`` (tiny, one round, for the tests). The default is
``gpu`` on an accelerator and ``cpu`` on a CPU.

  python benchmarks/transformer.py --out benchmarks/results
  python benchmarks/transformer.py --preset gpu --peak --out "$OUT" --tag _gpu
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
  import gradaccum_jax as ga
except ModuleNotFoundError:  # run from a source tree without installing
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import gradaccum_jax as ga
from gradaccum_jax._train_step import JitStep

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Config:
  d: int
  heads: int
  layers: int
  seq: int
  vocab: int
  b: int
  k: int
  rounds: int
  reps: int
  dtype: str = "bfloat16"  # compute dtype; params and optimizer state are float32
  # Recompute each block in the backward pass (jax.checkpoint): jax.nn.dot_product_attention's
  # default (XLA) implementation keeps every block's b x heads x T x T scores otherwise.
  remat: bool = False


PRESETS = {
  "gpu": Config(
    d=2048, heads=16, layers=8, seq=2048, vocab=32768, b=8, k=4, rounds=5, reps=3, remat=True
  ),
  "cpu": Config(d=256, heads=4, layers=4, seq=128, vocab=4096, b=4, k=4, rounds=5, reps=2),
  # float32 compute: XLA:CPU takes twice as long to compile the bf16 program
  "smoke": Config(
    d=16, heads=2, layers=1, seq=8, vocab=32, b=2, k=2, rounds=1, reps=1, dtype="float32"
  ),
}


def init(key, c: Config):
  ks = iter(jax.random.split(key, 6))
  normal = lambda shape, std: jax.random.normal(next(ks), shape, jnp.float32) * std  # noqa: E731
  d, n, f = c.d, c.layers, 4 * c.d
  return {
    "embed": normal((c.vocab, d), 0.02),
    "pos": normal((c.seq, d), 0.02),
    "blocks": {
      "ln1": jnp.ones((n, d)),
      "qkv": normal((n, d, 3 * d), d**-0.5),
      "out": normal((n, d, d), (2 * n * d) ** -0.5),
      "ln2": jnp.ones((n, d)),
      "up": normal((n, d, f), d**-0.5),
      "down": normal((n, f, d), (2 * n * f) ** -0.5),
    },
    "ln_f": jnp.ones((d,)),
  }


def rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def make_loss(c: Config):
  def loss_fn(params, batch):
    p = jax.tree.map(lambda x: x.astype(c.dtype), params)  # a no-op under compute_dtype
    tokens, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    h = p["embed"][tokens] + p["pos"]

    def block(h, w):
      a = rms_norm(h, w["ln1"]) @ w["qkv"]
      q, k, v = (t.reshape(*h.shape[:2], c.heads, -1) for t in jnp.split(a, 3, axis=-1))
      att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
      h = h + att.reshape(h.shape) @ w["out"]
      h = h + jax.nn.gelu(rms_norm(h, w["ln2"]) @ w["up"]) @ w["down"]
      return h, None

    h, _ = jax.lax.scan(jax.checkpoint(block) if c.remat else block, h, p["blocks"])
    logits = (rms_norm(h, p["ln_f"]) @ p["embed"].T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return loss_fn


def make_opt():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, weight_decay=0.01))


def programs(c: Config):
  """{name: (optimizer whose init makes the state, jitted step(params, state, batch), batch)}: each
  step returns (params, state, ...)."""
  loss_fn, opt = make_loss(c), make_opt()
  tx = ga.accumulate(make_opt(), c.k)
  rng = np.random.default_rng(0)
  whole = {"tokens": jnp.asarray(rng.integers(0, c.vocab, (c.k * c.b, c.seq + 1)), jnp.int32)}
  micro = {"tokens": whole["tokens"][: c.b]}

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def plain(p, s, batch):
    g = jax.grad(loss_fn)(p, batch)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  ga_step = ga.train_step(loss_fn, tx, donate=True, compute_dtype=c.dtype)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def min_scan(p, s, batch):
    low = jax.tree.map(lambda x: x.astype(c.dtype), p)

    def body(acc, i):
      g = jax.grad(loss_fn)(low, ga.microbatch(batch, i, c.k))
      return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, g), None

    acc, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), jnp.arange(c.k))
    u, s = opt.update(jax.tree.map(lambda a: a / c.k, acc), s, p)
    return optax.apply_updates(p, u), s

  ms = optax.MultiSteps(make_opt(), c.k)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def ms_micro(p, s, mb):
    u, s = ms.update(jax.grad(loss_fn)(p, mb), s, p)
    return optax.apply_updates(p, u), s

  def ms_loop(p, s, batch):  # k jitted micro-steps from Python, as MultiSteps is driven
    for i in range(c.k):
      p, s = ms_micro(p, s, ga.microbatch(batch, i, c.k))
    return p, s

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def microbat(p, s, batch):
    g = optax.microbatching.microbatch(
      jax.grad(loss_fn), argnums=1, microbatch_size=c.b,
      accumulator=optax.microbatching.AccumulationType.MEAN,
    )(p, batch)  # fmt: skip
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  return {
    "plain_b": (opt, plain, micro),
    "plain_kb": (opt, plain, whole),
    "ga": (tx, ga_step, whole),
    "min_scan": (opt, min_scan, whole),
    "ms_loop": (ms, ms_loop, whole),
    "microbat": (opt, microbat, whole),
  }


def lowered(step, *args):
  """``step.lower(*args)`` with the keywords a call passes, so that it finds the call's program."""
  if isinstance(step, JitStep):  # ga.train_step's
    return step.lower(*args, num_real_microbatches=None)
  return step.lower(*args)  # a plain jax.jit


def flops_per_token(c: Config):
  """Training flops per token, 6 N + 12 L T d (N: the matrices' params, the unembedding
  included; the attention scores and their weighted sum, forward and backward). Not XLA's
  cost analysis, which counts the body of a loop (the blocks' scan, the micro-batches') once."""
  n = c.layers * 12 * c.d * c.d + c.vocab * c.d
  return 6 * n + 12 * c.layers * c.seq * c.d


def compiled_stats(params, opt, step, batch):
  """Memory analysis of one program, compiled on abstract inputs (none for ms_loop's Python
  loop of programs)."""
  if not hasattr(step, "lower"):
    return {f"{f}_bytes": None for f in ("temp", "argument", "output", "alias", "footprint")}
  p = jax.eval_shape(lambda: params)
  compiled = lowered(step, p, jax.eval_shape(opt.init, p), batch).compile()
  ma = compiled.memory_analysis()
  out = {}
  for field in ("temp", "argument", "output", "alias"):
    v = getattr(ma, f"{field}_size_in_bytes", None) if ma is not None else None
    out[f"{field}_bytes"] = None if v is None else int(v)
  if None not in out.values():
    out["footprint_bytes"] = (
      out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    )
  return out


def peak_in_subprocess(preset: str, name: str):
  """The device's peak_bytes_in_use after three steps of one program, in a fresh process."""
  code = (
    "import json, transformer as t;"
    f" print('PEAK', json.dumps(t.run_for_peak({preset!r}, {name!r})))"
  )
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # beside this process's
  r = subprocess.run(
    [sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
    text=True,
  )  # fmt: skip
  for line in r.stdout.splitlines():
    if line.startswith("PEAK "):
      return json.loads(line[5:])
  return {"error": (r.stderr or r.stdout)[-2000:]}


def run_for_peak(preset: str, name: str):
  c = PRESETS[preset]
  o, step, batch = programs(c)[name]
  p = init(jax.random.key(0), c)
  st = (p, o.init(p))
  for _ in range(3):
    st = step(*st, batch)[:2]
  jax.block_until_ready(st)
  stats = jax.local_devices()[0].memory_stats() or {}
  return {"peak_bytes_in_use": stats.get("peak_bytes_in_use")}


T0 = time.perf_counter()


def log(msg):
  """A progress line on stderr, so that a run stopped at its time limit still says how far it
  came and how long each stage took."""
  print(f"[transformer {time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def measure(c: Config, preset: str, peak: bool, save=lambda res: None):
  """Times every program and reads its memory; ``save(res)`` gets the results so far after the
  timing and after each peak. A program that fails (out of memory, say) is reported with
  its error and left out of the rest, so that the others' figures survive."""
  runs = programs(c)
  p0 = init(jax.random.key(0), c)
  failed = {}

  def fresh(o):
    p = jax.tree.map(jnp.array, p0)
    return p, o.init(p)

  # Each program's first update from the same params, against plain_kb's (adam's first step
  # is about lr times a sign, so a max difference says little under bf16: an L2 distance).
  moved = {}
  for n, (o, step, batch) in list(runs.items()):
    try:
      moved[n] = jax.block_until_ready(jax.tree.map(jnp.subtract, step(*fresh(o), batch)[0], p0))
      log(f"{n}: compiled, first update done")
    except Exception as e:  # noqa: BLE001  (reported, and the others go on)
      failed[n] = f"{type(e).__name__}: {str(e)[:1500]}"
      del runs[n]
      log(f"{n}: FAILED {failed[n][:300]}")
  sq = lambda tree: sum(float(jnp.vdot(x, x)) for x in jax.tree.leaves(tree))  # noqa: E731
  ref = moved.get("plain_kb")
  diff = {
    n: None if ref is None else (sq(jax.tree.map(jnp.subtract, v, ref)) / sq(ref)) ** 0.5
    for n, v in moved.items()
  }
  del moved, ref
  tokens = {n: batch["tokens"].shape[0] * c.seq for n, (_, _, batch) in runs.items()}
  samples = {n: [] for n in runs}
  for i in range(c.rounds):
    for n, (o, step, batch) in runs.items():
      st = fresh(o)
      for _ in range(2):
        st = step(*st, batch)[:2]
      jax.block_until_ready(st)
      t0 = time.perf_counter()
      for _ in range(c.reps):
        st = step(*st, batch)[:2]
      jax.block_until_ready(st)
      samples[n].append((time.perf_counter() - t0) / c.reps)
      del st
    log(
      f"round {i + 1}/{c.rounds}: "
      + ", ".join(f"{n} {v[-1] * 1e3:.1f} ms" for n, v in samples.items())
    )
  tok_s = {n: [tokens[n] / t for t in v] for n, v in samples.items()}
  base = tok_s.get("plain_b", [float("nan")] * c.rounds)  # NaN ratios if plain_b failed
  ratio = {n: [a / b for a, b in zip(tok_s[n], base, strict=True)] for n in runs}
  stats = {n: compiled_stats(p0, *run) for n, run in runs.items()}
  fpt = flops_per_token(c)
  acc_bytes = sum(x.size * 4 for x in jax.tree.leaves(p0))
  batch_extra = (c.k - 1) * c.b * (c.seq + 1) * 4  # int32 tokens of the k - 1 more micro-batches
  fp = {n: s.get("footprint_bytes") for n, s in stats.items()}
  window = [n for n in runs if n != "plain_b"]  # the programs whose call is a window
  ga_vs = {
    n: statistics.median([a / b for a, b in zip(samples["ga"], samples[n], strict=True)])
    for n in window if "ga" in runs and n != "ga"
  }  # fmt: skip
  rows = {
    n: {
      "ms": statistics.median(samples[n]) * 1e3,
      "tokens_per_s": statistics.median(tok_s[n]),
      "vs_plain_b": statistics.median(ratio[n]),
      "vs_plain_b_min": min(ratio[n]),
      "vs_plain_b_max": max(ratio[n]),
      "tflop_per_s": statistics.median(tok_s[n]) * fpt / 1e12,
      "update_rel_diff_to_plain_kb": diff[n],
      **stats[n],
    }
    for n in runs
  }
  out = {
    "config": dataclasses.asdict(c),
    "preset": preset,
    "params": sum(x.size for x in jax.tree.leaves(p0)),
    "accumulator_bytes": acc_bytes,
    "batch_extra_bytes": batch_extra,
    "programs": rows,
    "ga_window_vs": ga_vs,
    "failed": failed,
  }
  if fp.get("plain_b") is not None:
    out["footprint_over_plain_b_plus_acc"] = {
      n: fp[n] / (fp["plain_b"] + acc_bytes + batch_extra) for n in runs if n in ("ga", "min_scan")
    }
  log("timing and memory analysis done")
  save(out)
  if peak and jax.local_devices()[0].memory_stats() is not None:
    # Each in a process of its own, which this one's cache of compiled programs spares a compile
    # (main sets it). This process keeps what its allocator took (for plain_kb's step, about 55
    # GiB on the gpu preset by XLA:CPU's memory analysis), which leaves an H200 room for each.
    # Not plain_kb's: the comparison is with one micro-batch's step; nor the anchors'.
    del runs, p0
    out["peak"] = {}
    for n in ("plain_b", "ga", "min_scan"):
      if n not in failed:
        out["peak"][n] = peak_in_subprocess(preset, n)
        log(f"{n}: peak {out['peak'][n]}"[:400])
        save(out)
  return out


def report(res, meta):
  c = res["config"]
  lines = [
    "# Transformer throughput and memory\n",
    f"{meta['date']}, {meta['machine']}, jax {meta['jax']}, optax {meta['optax']}. Decoder-only"
    f" transformer: d {c['d']}, {c['heads']} heads, {c['layers']} blocks, {c['seq']} tokens per"
    f" sequence, vocab {c['vocab']} ({res['params'] / 1e6:.1f} M params, float32,"
    f" {c['dtype']} compute{', blocks recomputed in the backward pass' if c.get('remat') else ''});"
    f" adamw with clipping; b = {c['b']} sequences per micro-batch, k = {c['k']}. Medians of"
    f" {c['rounds']} interleaved rounds of {c['reps']} calls; ratio = tokens/s over plain_b's in"
    " the same round (min-max); TFLOP/s = tokens/s x (6 N + 12 L T d). Footprint = arguments +"
    " outputs - aliased + temp, from"
    " `memory_analysis()`. First update vs plain_kb's: |d - d_kb| / |d_kb| (L2, over all"
    " params) of each program's first change of the params from the same start.\n",
    "| program | ms per call | tokens/s | / plain_b (min-max) | TFLOP/s | temp MiB |"
    " footprint MiB | first update vs plain_kb's |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  mib = lambda x: "n/a" if x is None else f"{x / MIB:.1f}"  # noqa: E731
  fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
  for n, r in res["programs"].items():
    tf = "n/a" if r["tflop_per_s"] is None else f"{r['tflop_per_s']:.3g}"
    lines.append(
      f"| {n} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} | {r['vs_plain_b']:.3f}"
      f" ({r['vs_plain_b_min']:.3f}-{r['vs_plain_b_max']:.3f}) | {tf} | {mib(r['temp_bytes'])}"
      f" | {mib(r.get('footprint_bytes'))} | {fmt(r['update_rel_diff_to_plain_kb'], '.1e')} |"
    )
  for n, err in res.get("failed", {}).items():
    lines.append(f"| {n} | failed: {err[:200].replace('|', '/')} | | | | | | |")
  if res.get("ga_window_vs"):
    ratios = ", ".join(f"{n} {v:.3f}" for n, v in res["ga_window_vs"].items())
    lines.append(f"\nga's time per window over each other's, same round (median): {ratios}.")
  if "footprint_over_plain_b_plus_acc" in res:
    ratios = ", ".join(f"{n} {v:.3f}" for n, v in res["footprint_over_plain_b_plus_acc"].items())
    lines.append(
      f"\nFootprint / (plain_b's + the float32 accumulator {mib(res['accumulator_bytes'])}"
      f" MiB + the larger batch {mib(res['batch_extra_bytes'])} MiB): {ratios}. min_scan holds"
      " its accumulator beside the optimizer state; ga scans into the state's."
    )
  if "peak" in res:
    cells = ", ".join(
      f"{n} {mib(v.get('peak_bytes_in_use'))} MiB" if "error" not in v else f"{n}: failed"
      for n, v in res["peak"].items()
    )
    lines.append(f"\nDevice peak_bytes_in_use after three steps, each in its own process: {cells}.")
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", choices=tuple(PRESETS), default=None)
  ap.add_argument("--smoke", action="store_true", help="the smoke preset")
  ap.add_argument("--rounds", type=int, default=None)
  ap.add_argument("--reps", type=int, default=None)
  ap.add_argument("--peak", action="store_true", help="peak device memory, one process each")
  ap.add_argument("--out", type=Path, default=None, help="folder for transformer<tag>.{json,md}")
  ap.add_argument("--tag", default="")
  args = ap.parse_args(argv)
  if args.peak:  # jax would take 75 % of the device's memory, and the peak runs need room
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    # The peak runs' compiles, cached on disk, serve this process's timing runs too.
    cache = os.environ.setdefault(
      "JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "ga_transformer_jax_cache")
    )
    jax.config.update("jax_compilation_cache_dir", cache)
  preset = "smoke" if args.smoke else args.preset
  if preset is None:
    preset = "cpu" if jax.default_backend() == "cpu" else "gpu"
  c = PRESETS[preset]
  for field in ("rounds", "reps"):
    v = getattr(args, field)
    if v is not None:
      if v < 1:
        raise SystemExit(f"--{field} {v}: give a positive number")
      c = dataclasses.replace(c, **{field: v})
  meta = {
    "date": time.strftime("%Y-%m-%d"),
    "machine": f"{platform.machine()}, {jax.devices()[0].device_kind}",
    "backend": jax.default_backend(), "jax": jax.__version__, "optax": optax.__version__,
    "gradaccum_jax": ga.__version__,
  }  # fmt: skip

  def save(res):
    if args.out is not None:
      args.out.mkdir(parents=True, exist_ok=True)
      (args.out / f"transformer{args.tag}.json").write_text(
        json.dumps({"meta": meta, **res}, indent=1)
      )

  res = measure(c, preset, args.peak, save)
  md = report(res, meta)
  print(md)
  if args.out is not None:
    (args.out / f"transformer{args.tag}.md").write_text(md)


if __name__ == "__main__":
  main()
