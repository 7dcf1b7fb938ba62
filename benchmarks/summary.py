"""The README's performance summary: time and peak memory per window, ga against the anchors.

One model and one size, the side-by-side comparison's: MLP 784-512-512-10, softmax cross-entropy, adam,
k = 8 micro-batches of b = 32 rows (a window is one optimizer step on 256 rows). Four ways to
take that step:

  plain         one jitted step on the whole batch of 256 rows (the limit accumulation emulates)
  ga            ga.train_step (one program: a lax.scan over the micro-batches, one update)
  MultiSteps    optax.MultiSteps, k jitted calls of one micro-batch each
  microbatching optax.microbatching.microbatch(jax.grad(loss)) then the update, in one program

Time per window is read from measurements already made (nothing is timed here): the CPU from
``results/referee_b32.json`` (a side-by-side run at b = 32, the variants of
``side_by_side.py``), the GPU from
``results/side_by_side_gpu.json`` (its adam, b = 32 row). Peak memory is computed here, for the
CPU, by compiling each program on shapes (nothing runs) for k = 2 ... 128 at b = 32:
``compiled.memory_analysis()``'s arguments + outputs - aliased + temp, as ``memory_floor.py``
reads it (deterministic). The fused programs (plain, ga, microbatching) hold the whole batch of
k * b rows as an argument; a MultiSteps call holds one micro-batch (the loader keeps the rest),
so its peak is that of one call, whatever k. The plot draws each peak less the batch passed in.

  python benchmarks/summary.py --out benchmarks/results

writes ``summary.json`` and ``summary.png`` (needs matplotlib: the ``examples`` extra).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import jax
import optax

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
  import gradaccum_jax as ga
except ModuleNotFoundError:  # run from a source tree without installing
  sys.path.insert(0, str(HERE.parent))
  import gradaccum_jax as ga
import memory_floor  # noqa: E402  (the programs and the peak, as the memory report reads them)

SIZES, K, B = (784, 512, 512, 10), 8, 32
KS = (2, 4, 8, 16, 32, 64, 128)  # the memory panel: peak against k at b = 32
METHODS = ("plain", "ga", "MultiSteps", "microbatching")
# The variant names of side_by_side.py for each method.
TIME_KEYS = {"plain": "plain", "ga": "ga", "MultiSteps": "ms_loop", "microbatching": "microbat"}
MIB = 2**20


def peak_mib(k: int = K, b: int = B) -> dict[str, float]:
  """Compiled peak MiB of one window of each method (MultiSteps: one call)."""
  params, loss_fn, micro = memory_floor.mlp_model(SIZES, b)
  batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct((k * b,) + s.shape[1:], s.dtype), micro)
  inner = optax.adam(1e-3)
  tx, ms = ga.accumulate(inner, k), optax.MultiSteps(inner, every_k_schedule=k)
  state = jax.eval_shape(inner.init, params)
  donated = functools.partial(jax.jit, donate_argnums=(0, 1))

  def plain(p, s, bt):
    updates, s = inner.update(jax.grad(loss_fn)(p, bt), s, p)
    return optax.apply_updates(p, updates), s

  compiled = {
    "plain": donated(plain).lower(params, state, batch),
    "ga": ga.train_step(loss_fn, tx, donate=True).lower(
      params, jax.eval_shape(tx.init, params), batch, num_real_microbatches=None
    ),
    "MultiSteps": donated(memory_floor.multisteps_call(loss_fn, ms)).lower(
      params, jax.eval_shape(ms.init, params), micro
    ),
    "microbatching": donated(memory_floor.microbatching(loss_fn, inner, k)).lower(
      params, state, batch
    ),
  }
  return {name: memory_floor.peak(lowered.compile()) / MIB for name, lowered in compiled.items()}


def time_row(path: Path, opt: str = "adam", b: int = B) -> tuple[dict, dict[str, float]]:
  """``(meta, ms per window of each method)`` from a side_by_side JSON (one row or ``rows``)."""
  data = json.loads(path.read_text())
  rows = data.get("rows", [data])
  (row,) = [r for r in rows if r["opt"] == opt and r["b"] == b]
  return data["meta"], {m: row["ms"][TIME_KEYS[m]] for m in METHODS}


def summary(results: Path) -> dict:
  cpu_meta, cpu = time_row(results / "referee_b32.json")
  gpu_meta, gpu = time_row(results / "side_by_side_gpu.json")
  return {
    "model": f"MLP {'-'.join(map(str, SIZES))}, adam, b = {B} rows per micro-batch",
    "time_ms": {"cpu": cpu, "gpu": gpu},
    "time_meta": {"cpu": cpu_meta, "gpu": gpu_meta},
    "peak_mib": {str(k): peak_mib(k) for k in KS},
    "peak_meta": {
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "optax": optax.__version__,
    },
  }


def plot(s: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  colors = {
    "plain": "0.6",
    "ga": "tab:blue",
    "MultiSteps": "tab:orange",
    "microbatching": "tab:green",
  }
  cm, gm = s["time_meta"]["cpu"], s["time_meta"]["gpu"]
  panels = [
    (s["time_ms"]["cpu"], f"CPU: ms per window at k = {K}\n2 shared cores, jax {cm['jax']}, {cm['date']}"),
    (s["time_ms"]["gpu"], f"GPU (older program): ms per window at k = {K}\none H200, jax {gm['jax']}, {gm['date']}"),
  ]  # fmt: skip
  fig, axes = plt.subplots(1, 4, figsize=(14, 3.6), width_ratios=(1, 1, 1.2, 1))
  for ax, (values, title), fmt in zip(axes, panels, ("%.1f", "%.2f"), strict=False):
    bars = ax.barh(list(METHODS)[::-1], [values[m] for m in METHODS][::-1],
                   color=[colors[m] for m in METHODS][::-1])  # fmt: skip
    ax.bar_label(bars, fmt=fmt, padding=2, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.3)
    ax.tick_params(labelsize=8)
  axes[1].set_yticklabels([])
  ax = axes[2]
  ks = [int(k) for k in s["peak_mib"]]
  row = sum(math.prod(x.shape[1:]) * x.dtype.itemsize for x in jax.tree.leaves(
    memory_floor.mlp_model(SIZES, B)[2]))  # fmt: skip
  for m in METHODS:  # the input a program is passed: the window's rows, or one micro-batch's
    rows = [B if m == "MultiSteps" else k * B for k in ks]
    beyond = [s["peak_mib"][str(k)][m] - r * row / MIB for k, r in zip(ks, rows, strict=True)]
    ax.plot(ks, beyond, "o-", ms=3, color=colors[m], label=m)
  ax.axvline(K, color="0.85", lw=1, zorder=0)
  ax.set_xscale("log", base=2)
  ax.set_xticks(ks, [str(k) for k in ks])
  ax.set_xlabel(f"k (micro-batches of b = {B} rows)", fontsize=8)
  ax.set_title(
    f"CPU: compiled peak MiB per window beyond\nthe batch passed in, jax {s['peak_meta']['jax']}",
    fontsize=9,
  )
  ax.tick_params(labelsize=8)
  ax.legend(fontsize=7, frameon=False)
  _transformer_panel(axes[3], colors)
  fig.suptitle(f"One window (one optimizer step): {s['model']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110, metadata={"Software": None})
  plt.close(fig)


def _transformer_panel(ax, colors) -> None:
  """The GPU transformer run (``results/transformer_gpu.json``): tokens/s against a plain step
  on one micro-batch, for a plain step on the whole window and for ga."""
  t = json.loads((HERE / "results" / "transformer_gpu.json").read_text())
  c, progs = t["config"], t["programs"]
  names = {"plain_kb": "plain", "ga": "ga"}
  bars = ax.barh(["ga", "plain, k b rows"], [progs["ga"]["vs_plain_b"], progs["plain_kb"]["vs_plain_b"]],
                 color=[colors[names[n]] for n in ("ga", "plain_kb")])  # fmt: skip
  ax.bar_label(bars, fmt="%.3f", padding=2, fontsize=8)
  ax.set_xlim(0, 1.3)
  ax.tick_params(labelsize=8)
  ax.set_title(
    f"GPU transformer, {t['params'] / 1e6:.0f} M params,\n{c['dtype']}, k = {c['k']}, H200,"
    f" {t['meta']['date']}:\ntokens/s / plain step on b = {c['b']}",
    fontsize=9,
  )


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", type=Path, default=HERE / "results")
  a = ap.parse_args(argv)
  s = summary(a.out)
  (a.out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
  plot(s, a.out / "summary.png")
  for kind, values in (*s["time_ms"].items(), *s["peak_mib"].items()):
    print(kind, {m: round(v, 3) for m, v in values.items()})


if __name__ == "__main__":
  main()
