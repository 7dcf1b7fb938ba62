"""``python -m gradaccum_jax``: train a digits classifier three ways, and check they agree.

Trains a small MLP on scikit-learn's bundled handwritten digits (8x8 images, no download)
with adam, from the same initialization and on the same batches, three ways: (1) one plain
jitted step on the whole batch of ``k * b`` rows, (2) ``ga.train_step`` over ``k``
micro-batches of ``b`` rows, (3) ``optax.MultiSteps`` driven by a jitted micro-step in a
Python loop. It prints a markdown table (final train loss, test accuracy, median time per
window), checks that the accumulated runs agree with the large batch, and writes a plot of the
three loss curves to ``--out``. Memory is compared in ``benchmarks/memory.py``, not here: at these
sizes XLA reports almost no scratch memory, and one window is one program for two of the runs
but ``k`` programs for ``MultiSteps``.

Needs the ``examples`` extra: ``pip install "gradaccum_jax[examples]"``, or ``pip install -e
".[examples]"`` in a clone of the repository.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga

_EXTRA_HINT = (
  'the demo needs scikit-learn, matplotlib and tqdm: pip install "gradaccum_jax[examples]"'
  ' (in a clone of the repository: pip install -e ".[examples]")'
)
_DESCRIPTION = (
  "Train a small MLP on scikit-learn's digits three ways (a plain big batch, ga.train_step,"
  " optax.MultiSteps) from the same start on the same batches, and check that they agree."
)
TOLERANCE = 1e-3


def init_params(seed, sizes):
  """He-normal weights, zero biases (in numpy: no tiny XLA programs to compile)."""
  rng = np.random.default_rng(seed)
  params = []
  for m, n in zip(sizes[:-1], sizes[1:], strict=True):
    w = rng.standard_normal((m, n)) * np.sqrt(2.0 / m)
    params.append({"w": w.astype(np.float32), "b": np.zeros(n, np.float32)})
  return params


def logits_fn(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, batch):
  logits = logits_fn(params, batch["x"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def evaluate(params, x, y):
  """Mean cross-entropy and accuracy, in numpy (float64) on the host."""
  params = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  for layer in params[:-1]:
    x = np.maximum(x @ layer["w"] + layer["b"], 0.0)
  logits = x @ params[-1]["w"] + params[-1]["b"]
  logits = logits - logits.max(-1, keepdims=True)
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return float(-log_p[np.arange(len(y)), y].mean()), float(np.mean(logits.argmax(-1) == y))


def rel_diff(a, b):
  """``|a - b| / |a|`` with global L2 norms over all leaves (numpy, float64)."""
  a = [np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(a)]
  b = [np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(b)]
  num = sum(np.sum((u - v) ** 2) for u, v in zip(a, b, strict=True))
  return float(np.sqrt(num / sum(np.sum(u**2) for u in a)))


def load_digits_split(seed):
  """Standardized digits, split 80/20 (stratified) into train and test sets."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split
  from sklearn.preprocessing import StandardScaler

  x, y = load_digits(return_X_y=True)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
  scaler = StandardScaler().fit(x_tr)
  as_f32 = lambda a: scaler.transform(a).astype(np.float32)  # noqa: E731
  return as_f32(x_tr), y_tr.astype(np.int32), as_f32(x_te), y_te.astype(np.int32)


def make_windows(x, y, steps, rows, seed):
  """``steps`` windows of ``rows`` examples, drawn epoch by epoch from seeded permutations."""
  rng = np.random.default_rng(seed)
  epochs = math.ceil(steps * rows / len(x))
  order = np.concatenate([rng.permutation(len(x)) for _ in range(epochs)])
  order = order[: steps * rows].reshape(steps, rows)
  return [{"x": x[idx], "y": y[idx]} for idx in order]


def main(argv: list[str] | None = None) -> int:
  # Full float32 matmuls, so that the runs differ only by summation order (GPUs default to
  # TF32-like precision for float32 dots).
  with jax.default_matmul_precision("float32"):
    return _main(argv)


def _prog() -> str:
  """The command as the user typed it: the console script's name, or ``python -m ...``."""
  name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
  if name.startswith("gradaccum-jax"):  # the console script (gradaccum-jax.exe on Windows)
    return "gradaccum-jax"
  return "python -m gradaccum_jax"


def _positive(kind):
  """An argparse ``type`` that accepts finite numbers above zero and names a rejected value."""

  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
    if not (math.isfinite(value) and value > 0):
      raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value

  return parse


def _parse(argv):
  parser = argparse.ArgumentParser(prog=_prog(), description=_DESCRIPTION)
  pos_int, pos_float = _positive(int), _positive(float)
  parser.add_argument("--k", type=pos_int, default=8, help="micro-batches per update (default 8)")
  parser.add_argument(
    "--microbatch-size", type=pos_int, default=32, help="rows per micro-batch b (default 32)"
  )
  parser.add_argument("--steps", type=pos_int, default=100, help="optimizer updates (default 100)")
  parser.add_argument(
    "--lr", type=pos_float, default=1e-3, help="adam learning rate, > 0 (default 1e-3)"
  )
  parser.add_argument("--hidden", type=pos_int, default=128, help="hidden width (default 128)")
  parser.add_argument(
    "--seed",
    type=int,
    default=0,
    help="seed of the initialization, the train/test split and the batch order (default 0)",
  )
  parser.add_argument("--out", default="demo_out", help="folder for the plot (default demo_out/)")
  parser.add_argument("--quiet", action="store_true", help="no progress bar")
  return parser.parse_args(argv)


def _main(argv: list[str] | None) -> int:
  args = _parse(argv)
  try:
    import matplotlib
    import sklearn  # noqa: F401
    from tqdm import tqdm
  except ImportError as e:
    print(f"error: {_EXTRA_HINT} ({e})", file=sys.stderr)
    raise SystemExit(2) from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  k, b = args.k, args.microbatch_size
  rows = k * b
  x_tr, y_tr, x_te, y_te = load_digits_split(args.seed)
  windows = make_windows(x_tr, y_tr, args.steps, rows, args.seed)
  micro = [[{n: a[i * b : (i + 1) * b] for n, a in w.items()} for i in range(k)] for w in windows]
  windows, micro = jax.device_put((windows, micro))
  params0 = jax.device_put(init_params(args.seed, (x_tr.shape[1], args.hidden, args.hidden, 10)))
  print(
    f"gradaccum_jax {ga.__version__} on {jax.devices()[0].platform} (jax {jax.__version__}):"
    f" digits ({len(x_tr)} train / {len(x_te)} test), MLP 64-{args.hidden}-{args.hidden}-10,"
    f" {args.steps} adam updates of {rows} = {k} x {b} rows"
  )

  # (1) plain large batch: one jitted step on all k * b rows.
  big = optax.adam(args.lr)

  @jax.jit
  def plain_step(params, opt_state, batch):
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = big.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # (2) ga.train_step: one XLA program, a scan over k micro-batches then one adam update.
  tx = ga.accumulate(optax.adam(args.lr), k)
  accum_step = ga.train_step(loss_fn, tx, has_aux=True)

  # (3) optax.MultiSteps: a jitted micro-step, called k times per window from Python.
  multi = optax.MultiSteps(optax.adam(args.lr), every_k_schedule=k)

  @jax.jit
  def multi_micro_step(params, opt_state, microbatch):
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, microbatch)
    updates, opt_state = multi.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # A runner takes the compiled step and runs one window: it returns the new params and state
  # and the window's loss(es), left on the device until the window is timed.
  def run_window(step, state, params, i):
    params, state, out = step(params, state, windows[i])
    return params, state, [out["loss"] if isinstance(out, dict) else out]

  def run_micro(step, state, params, i):
    losses = []
    for mb in micro[i]:  # equal-size micro-batches: the window loss is their mean
      params, state, loss = step(params, state, mb)
      losses.append(loss)
    return params, state, losses

  runs = {  # name: (jitted step, initial state, example input, runner)
    f"plain batch of {rows}": (plain_step, big.init(params0), windows[0], run_window),
    f"ga.train_step {k} x {b}": (accum_step, tx.init(params0), windows[0], run_window),
    f"optax.MultiSteps {k} x {b}": (multi_micro_step, multi.init(params0), micro[0][0], run_micro),
  }
  results = _train(runs, params0, args, (x_tr, y_tr, x_te, y_te), tqdm)
  print("\n| run | final train loss | test accuracy | ms / window (median) |")
  print("|---|---|---|---|")
  for name, r in results.items():
    print(f"| {name} | {r['train_loss']:.4f} | {r['test_acc']:.4f} | {r['ms']:.2f} |")
  agree = _report_agreement(results, args.steps)
  print(f"loss curves: {_plot_losses(results, args, plt)}")
  return 0 if agree else 1


def _train(runs: dict, params0: Any, args: argparse.Namespace, data: tuple, tqdm: Any) -> dict:
  """Each run from ``params0`` for ``args.steps`` windows, compiled before timing: its final
  params, window losses, train loss, test accuracy and median ms per window."""
  x_tr, y_tr, x_te, y_te = data
  results = {}
  show_bar = not args.quiet and sys.stderr.isatty()
  for name, (jitted, state, example, run) in runs.items():
    compiled = jitted.lower(params0, state, example).compile()
    params, losses, times = params0, [], []
    for i in tqdm(range(args.steps), desc=name, disable=not show_bar, leave=False):
      start = time.perf_counter()
      params, state, window_losses = run(compiled, state, params, i)
      jax.block_until_ready(params)
      times.append(time.perf_counter() - start)
      losses.append(float(np.mean([float(loss) for loss in window_losses])))
    train_loss, _ = evaluate(params, x_tr, y_tr)
    _, test_acc = evaluate(params, x_te, y_te)
    results[name] = {
      "params": params,
      "losses": losses,
      "train_loss": train_loss,
      "test_acc": test_acc,
      "ms": 1e3 * float(np.median(times[1:] or times)),  # the first window is a warm-up
    }
  return results


def _report_agreement(results: dict, steps: int) -> bool:
  """Prints each run's relative parameter difference to the first run; True if all are within
  TOLERANCE."""
  ref_name, *others = results
  ref = results[ref_name]["params"]
  agree = True
  print(f"\nrelative parameter difference to the {ref_name} after {steps} updates:")
  for name in others:
    rel = rel_diff(ref, results[name]["params"])
    ok = rel < TOLERANCE
    agree &= ok
    print(f"  {name}: {rel:.1e} ({'ok' if ok else 'TOO LARGE'})")
  print(f"-> {'the runs agree' if agree else 'THE RUNS DISAGREE'} (tolerance {TOLERANCE:.0e})")
  return agree


def _plot_losses(results: dict, args: argparse.Namespace, plt: Any) -> str:
  """The runs' window losses on a log scale, saved as ``<args.out>/loss_curves.png``."""
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "loss_curves.png")
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
  styles = [
    {"lw": 4, "alpha": 0.35},
    {"lw": 1.8, "ls": "--"},
    {"lw": 1.8, "ls": ":", "color": "black"},
  ]
  for (name, r), style in zip(results.items(), styles, strict=True):
    ax.plot(range(1, args.steps + 1), r["losses"], label=name, **style)
  ax.set_yscale("log")
  ax.set_xlabel("optimizer update (window)")
  ax.set_ylabel("training loss of the window")
  k, b = args.k, args.microbatch_size
  ax.set_title(f"digits MLP, adam lr={args.lr:g}, effective batch {k * b} = {k} x {b}")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return path


if __name__ == "__main__":
  sys.exit(main())
