"""The EMA gradient noise scale of ``ga.accumulate`` against a brute-force reference.

Trains an MLP classifier (32-64-10, tanh) on synthetic Gaussian blobs with
``ga.train_step(loss_fn, ga.accumulate(optax.adam(1e-3), k, noise_scale_ema=0.95))``,
``k`` micro-batches of ``b`` rows of fresh data per window. Every ``--every`` windows, at the
current params, it measures the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` by the
two-batch-size method of McCandlish et al. (2018, appendix A.1): the mean squared norm of
per-batch mean gradients ``E|G_B|^2 = |G|^2 + tr(Sigma) / B`` at a small and a big batch size,
from many independent batches of fresh samples (``jax.vmap`` in chunks), so

  |G|^2    = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small),
  tr Sigma = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big),

and records it next to ``ga.noise_scale(state)`` (the EMA estimate) and the window's raw
estimate ``trace_sigma_est / grad_sq_norm_est``. The EMA averages about
``(1 + d) / (1 - d)`` past windows, at params that moved since, so it lags the brute-force
value a little while the noise scale changes.

Usage: ``python benchmarks/noise_scale.py [--smoke] [--out benchmarks/results]``; writes
``<out>/noise_scale.json``, ``<out>/noise_scale.md`` and, when matplotlib is importable,
``<out>/noise_scale.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
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

D_IN, HIDDEN, CLASSES = 32, 64, 10
BLOB_SCALE = 0.35  # class centers' spread against unit within-class noise: overlapping blobs


def make_centers(key):
  return BLOB_SCALE * jax.random.normal(key, (CLASSES, D_IN))


def sample(centers, key, rows):
  """``rows`` fresh examples: a uniform class label and its center plus N(0, I) noise."""
  yk, xk = jax.random.split(key)
  y = jax.random.randint(yk, (rows,), 0, CLASSES)
  x = centers[y] + jax.random.normal(xk, (rows, D_IN))
  return {"x": x, "y": y}


def init_params(key):
  params = []
  for i, (m, n) in enumerate(zip((D_IN, HIDDEN), (HIDDEN, CLASSES), strict=True)):
    w = jax.random.normal(jax.random.fold_in(key, i), (m, n)) / math.sqrt(m)
    params.append({"w": w, "b": jnp.zeros((n,))})
  return params


def loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params[0]["w"] + params[0]["b"])
  logits = h @ params[1]["w"] + params[1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def mean_sq_batch_grad(params, centers, key, batch_size, num_batches, chunk):
  """The mean over ``num_batches`` fresh batches of ``|mean gradient of the batch|^2``."""

  def sq_norm_of_batch_grad(kk):
    grads = jax.grad(loss_fn)(params, sample(centers, kk, batch_size))
    return sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))

  keys = jax.random.split(key, num_batches)
  # lax.map with batch_size vmaps over chunks of keys, bounding the memory of the batches.
  return jnp.mean(jax.lax.map(sq_norm_of_batch_grad, keys, batch_size=chunk))


def brute_force(params, centers, key, cfg):
  ks, kb = jax.random.split(key)
  small, big = cfg["brute_small"], cfg["brute_big"]
  sq_small = mean_sq_batch_grad(params, centers, ks, small, cfg["brute_n_small"], cfg["chunk"])
  sq_big = mean_sq_batch_grad(params, centers, kb, big, cfg["brute_n_big"], cfg["chunk"])
  g2 = (big * sq_big - small * sq_small) / (big - small)
  trace = (sq_small - sq_big) / (1 / small - 1 / big)
  return {"g2": g2, "trace": trace, "b_simple": trace / g2}


def config(smoke: bool) -> dict:
  if smoke:
    return dict(
      k=8, b=16, windows=10, every=5, decay=0.95, brute_small=4, brute_big=64,
      brute_n_small=512, brute_n_big=64, chunk=128, seed=0,
    )  # fmt: skip
  return dict(
    k=8, b=16, windows=200, every=20, decay=0.95, brute_small=4, brute_big=256,
    brute_n_small=20000, brute_n_big=2000, chunk=500, seed=0,
  )  # fmt: skip


def fmt(x: float) -> str:
  return "nan" if not math.isfinite(x) else f"{x:.2f}"


def table(rows: list[dict]) -> str:
  lines = [
    "| window | loss | EMA estimate | brute force | EMA / brute | window raw estimate |",
    "|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
      f"| {r['window']} | {r['loss']:.4f} | {fmt(r['ema'])} | {fmt(r['brute'])}"
      f" | {fmt(r['ratio_ema_vs_brute'])} | {fmt(r['window_raw'])} |"
    )
  return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=(6, 4))
  w = [r["window"] for r in rows]
  ax.plot(w, [r["ema"] for r in rows], "o-", label="ga.noise_scale (EMA)")
  ax.plot(w, [r["brute"] for r in rows], "s--", label="brute force (two batch sizes)")
  ax.set_xlabel("window")
  ax.set_ylabel("B_simple (examples)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a tiny run of a few seconds")
  parser.add_argument("--out", default="benchmarks/results", help="output folder")
  args = parser.parse_args(argv)
  cfg = config(args.smoke)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()

  key = jax.random.key(cfg["seed"])
  kc, kp, kd, kbf = jax.random.split(key, 4)
  centers, params = make_centers(kc), init_params(kp)
  k, b = cfg["k"], cfg["b"]
  tx = ga.accumulate(optax.adam(1e-3), k, noise_scale_ema=cfg["decay"])
  state = tx.init(params)
  step = ga.train_step(loss_fn, tx)
  brute = jax.jit(lambda p, kk: brute_force(p, centers, kk, cfg))
  draw = jax.jit(lambda kk: sample(centers, kk, k * b))

  rows = []
  for window in range(1, cfg["windows"] + 1):
    params, state, metrics = step(params, state, draw(jax.random.fold_in(kd, window)))
    if window % cfg["every"] == 0 or window == 1:
      ref = {n: float(v) for n, v in brute(params, jax.random.fold_in(kbf, window)).items()}
      g2, tr = float(metrics["grad_sq_norm_est"]), float(metrics["trace_sigma_est"])
      ema = float(ga.noise_scale(state))
      rows.append(
        {
          "window": window,
          "loss": float(metrics["loss"]),
          "ema": ema,
          "brute": ref["b_simple"],
          "ratio_ema_vs_brute": ema / ref["b_simple"],
          "window_raw": tr / g2,
          "window_grad_sq_norm_est": g2,
          "window_trace_sigma_est": tr,
          "ema_g2": float(state.noise_scale.g2_ema),
          "ema_trace": float(state.noise_scale.trace_ema),
          "brute_g2": ref["g2"],
          "brute_trace": ref["trace"],
        }
      )
      print(f"window {window}: EMA {ema:.2f}, brute force {ref['b_simple']:.2f}", flush=True)
  total_s = time.perf_counter() - t0

  dev = jax.devices()[0]
  machine = {
    "jax": jax.__version__,
    "optax": optax.__version__,
    "gradaccum_jax": ga.__version__,
    "backend": jax.default_backend(),
    "device": str(dev),
    "device_kind": dev.device_kind,
    "python": platform.python_version(),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  }
  png = out / "noise_scale.png"
  plotted = plot(rows, png)
  result = {
    "config": {**cfg, "smoke": args.smoke, "model": f"MLP {D_IN}-{HIDDEN}-{CLASSES} tanh"},
    "machine": machine,
    "rows": rows,
    "plot": png.name if plotted else None,
    "total_s": total_s,
  }
  (out / "noise_scale.json").write_text(json.dumps(result, indent=2) + "\n")

  tab = table(rows)
  md = [
    "# Gradient noise scale: EMA estimate vs brute force",
    "",
    f"MLP {D_IN}-{HIDDEN}-{CLASSES} (tanh) on Gaussian blobs, adam(1e-3),"
    f" `ga.accumulate(k={k}, noise_scale_ema={cfg['decay']})`, b={b} rows per micro-batch"
    f" (B={k * b}), {cfg['windows']} windows, seed {cfg['seed']}"
    f"{' (--smoke)' if args.smoke else ''}. Brute force (McCandlish et al. 2018, A.1) at the"
    f" current params: {cfg['brute_n_small']} batches of {cfg['brute_small']} and"
    f" {cfg['brute_n_big']} batches of {cfg['brute_big']} fresh examples. The EMA averages"
    f" about {(1 + cfg['decay']) / (1 - cfg['decay']):.0f} past windows and lags; the window"
    " raw estimate is that window's `trace_sigma_est / grad_sq_norm_est` (one window: noisy).",
    "",
    tab,
    "",
    f"jax {machine['jax']}, optax {machine['optax']}, {machine['backend']}:"
    f" {machine['device_kind']} ({machine['device']}); {total_s:.1f} s in all.",
    "",
    f"Plot: `{png.name}`." if plotted else "Plot: skipped (matplotlib is not installed).",
  ]
  (out / "noise_scale.md").write_text("\n".join(md) + "\n")
  print(tab)
  print(f"total {total_s:.1f} s; wrote {out}/noise_scale.json, {out}/noise_scale.md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
