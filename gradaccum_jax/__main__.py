"""Train a small MLP on scikit-learn's digits three ways (a plain big batch, ga.train_step,
optax.MultiSteps) from the same start on the same batches, and check that they agree."""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import gradaccum_jax as ga

TOLERANCE = 1e-3


def init_params(seed, sizes):
  """He-normal weights, zero biases (in numpy: no tiny XLA programs to compile)."""
  rng = np.random.default_rng(seed)
  ws = [rng.standard_normal((m, n)) * np.sqrt(2.0 / m) for m, n in itertools.pairwise(sizes)]
  return [{"w": w.astype(np.float32), "b": np.zeros(w.shape[1], np.float32)} for w in ws]


def loss_fn(params, batch):
  x = batch["x"]
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  logits = x @ params[-1]["w"] + params[-1]["b"]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def load_digits_split(seed):
  """Standardized digits, split 80/20 (stratified) into train and test sets."""
  from sklearn import datasets, model_selection, preprocessing

  x, y = datasets.load_digits(return_X_y=True)
  split = model_selection.train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
  x_tr, x_te, y_tr, y_te = split
  scaler = preprocessing.StandardScaler().fit(x_tr)
  as_f32 = lambda a: scaler.transform(a).astype(np.float32)  # noqa: E731
  return as_f32(x_tr), y_tr.astype(np.int32), as_f32(x_te), y_te.astype(np.int32)


def make_windows(x, y, steps, rows, seed):
  """``steps`` windows of ``rows`` examples, drawn epoch by epoch from seeded permutations."""
  rng = np.random.default_rng(seed)
  order = np.concatenate([rng.permutation(len(x)) for _ in range(math.ceil(steps * rows / len(x)))])
  return [{"x": x[idx], "y": y[idx]} for idx in order[: steps * rows].reshape(steps, rows)]


def _positive(kind, text):
  """An argparse ``type`` (``kind`` bound): a finite number above zero, or an error naming it."""
  try:
    value = kind(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"must be positive, got {text}")
  return value


def _parse(argv):
  name = os.path.basename(sys.argv[0]) if sys.argv else ""  # gradaccum-jax(.exe), or python -m
  prog = "gradaccum-jax" if name.startswith("gradaccum-jax") else "python -m gradaccum_jax"
  parser = argparse.ArgumentParser(prog=prog, description=__doc__)
  pos_int, pos_float = (functools.partial(_positive, kind) for kind in (int, float))
  for flag, kind, default, text in [
    ("--k", pos_int, 8, "micro-batches per update (default 8)"),
    ("--microbatch-size", pos_int, 32, "rows per micro-batch b (default 32)"),
    ("--steps", pos_int, 100, "optimizer updates (default 100)"),
    ("--lr", pos_float, 1e-3, "adam learning rate, > 0 (default 1e-3)"),
    ("--hidden", pos_int, 128, "hidden width (default 128)"),
    ("--seed", int, 0, "seed of the initialization, split and batch order (default 0)"),
    ("--out", str, "demo_out", "folder for the plot (default demo_out/)"),
  ]:
    parser.add_argument(flag, type=kind, default=default, help=text)
  parser.add_argument("--quiet", action="store_true", help="no progress bar")
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = _parse(argv)
  try:
    import matplotlib
    import sklearn  # noqa: F401
    from tqdm import tqdm
  except ImportError as e:
    hint = 'pip install "gradaccum_jax[examples]" (in a clone: pip install -e ".[examples]")'
    print(f"error: the demo needs scikit-learn, matplotlib and tqdm: {hint} ({e})", file=sys.stderr)
    raise SystemExit(2) from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  with jax.default_matmul_precision("float32"):  # not TF32-like: runs differ by summation order
    k, b, rows = args.k, args.microbatch_size, args.k * args.microbatch_size
    x_tr, y_tr, x_te, y_te = load_digits_split(args.seed)
    windows = make_windows(x_tr, y_tr, args.steps, rows, args.seed)
    micro = [[{n: a[i * b : (i + 1) * b] for n, a in w.items()} for i in range(k)] for w in windows]
    windows, micro = jax.device_put(([[w] for w in windows], micro))
    params0 = jax.device_put(init_params(args.seed, (x_tr.shape[1], args.hidden, args.hidden, 10)))
    print(
      f"gradaccum_jax {ga.__version__} on {jax.devices()[0].platform} (jax {jax.__version__}):"
      f" digits ({len(x_tr)} train / {len(x_te)} test), MLP 64-{args.hidden}-{args.hidden}-10,"
      f" {args.steps} adam updates of {rows} = {k} x {b} rows"
    )
    big, multi = optax.adam(args.lr), optax.MultiSteps(optax.adam(args.lr), every_k_schedule=k)
    tx = ga.accumulate(optax.adam(args.lr), k)
    accum = ga.train_step(loss_fn, tx, has_aux=True)  # one program: a scan over k, one update
    runs = {  # name: (jitted step, initial state, each window's batches)
      f"plain batch of {rows}": (_optax_step(big), big.init(params0), windows),
      f"ga.train_step {k} x {b}": (accum, tx.init(params0), windows),
      f"optax.MultiSteps {k} x {b}": (_optax_step(multi), multi.init(params0), micro),
    }
    hide = args.quiet or not sys.stderr.isatty()
    results = {
      name: _run(*run, params0, functools.partial(tqdm, desc=name, disable=hide, leave=False))
      for name, run in runs.items()
    }
    print("\n| run | final train loss | test accuracy | ms / window (median) |\n|---|---|---|---|")
    for name, (params, _, ms) in results.items():
      train_loss = float(loss_fn(params, {"x": x_tr, "y": y_tr})[0])
      test_acc = float(loss_fn(params, {"x": x_te, "y": y_te})[1]["accuracy"])
      print(f"| {name} | {train_loss:.4f} | {test_acc:.4f} | {ms:.2f} |")
    (ref_name, (ref, _, _)), *others = results.items()
    print(f"\nrelative parameter difference to the {ref_name} after {args.steps} updates:")
    flat = lambda tree: np.asarray(ravel_pytree(tree)[0], np.float64)  # noqa: E731
    ref, agree = flat(ref), True
    for name, (params, _, _) in others:
      rel = float(np.linalg.norm(flat(params) - ref) / np.linalg.norm(ref))  # global L2 norms
      agree &= rel < TOLERANCE
      print(f"  {name}: {rel:.1e} ({'ok' if rel < TOLERANCE else 'TOO LARGE'})")
    print(f"-> {'the runs agree' if agree else 'THE RUNS DISAGREE'} (tolerance {TOLERANCE:.0e})")
    print(f"loss curves: {_plot_losses(results, args, plt)}")
    return 0 if agree else 1


def _optax_step(tx):
  """One jitted optax step on a batch: the whole batch (plain), or one micro-batch (MultiSteps)."""

  @jax.jit
  def step(params, opt_state, batch):
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}

  return step


def _run(step, state, windows, params, bar):
  """``step`` compiled, then timed on each window's batches: params, window losses, median ms."""
  compiled = step.lower(params, state, windows[0][0]).compile()
  losses, times = [], []
  for batches in bar(windows):
    start, window = time.perf_counter(), []
    for batch in batches:  # equal-size micro-batches: the window loss is their mean
      params, state, metrics = compiled(params, state, batch)
      window.append(metrics["loss"])
    jax.block_until_ready(params)
    times.append(time.perf_counter() - start)
    losses.append(float(np.mean([float(loss) for loss in window])))
  return params, losses, 1e3 * float(np.median(times[1:] or times))


def _plot_losses(results: dict, args: argparse.Namespace, plt) -> str:
  """The runs' window losses on a log scale, saved as ``<args.out>/loss_curves.png``."""
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "loss_curves.png")
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
  styles = [{"lw": 4, "alpha": 0.35}, {"lw": 1.8, "ls": "--"}, {"lw": 1.8, "ls": ":", "color": "k"}]
  for (name, (_, losses, _)), style in zip(results.items(), styles, strict=True):
    ax.plot(range(1, args.steps + 1), losses, label=name, **style)
  k, b = args.k, args.microbatch_size
  ax.set_title(f"digits MLP, adam lr={args.lr:g}, effective batch {k * b} = {k} x {b}")
  ax.set(yscale="log", xlabel="optimizer update (window)", ylabel="training loss of the window")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.savefig(path, bbox_inches="tight")
  plt.close(fig)
  return path


if __name__ == "__main__":
  sys.exit(main())
