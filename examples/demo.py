"""Train a small MLP on scikit-learn's digits with a plain big batch, ga.train_step,
optax.MultiSteps and optax.microbatching, from the same start on the same batches, in three
cases: every row real, with a token-mean loss and clipping and a warm-up schedule inside the
optimizer (where all of them match the big batch); the same programs on windows with uneven
token counts; clipping and the schedule around optax.MultiSteps. Prints how far each tool's
updates are from the big batch's, and plots it.

From a clone, after pip install -e ".[examples]": python examples/demo.py"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga

TOLERANCE = 1e-3


class Run(NamedTuple):
  """One way to train: a jitted step, the optimizer whose ``init`` makes its state, whether a
  call takes the whole window (else one micro-batch of it), and why it may differ from the big
  batch (None: it should not)."""

  step: Any
  tx: Any
  whole: bool
  differs_because: str | None = None


class Result(NamedTuple):
  """A run's final params, window losses, median ms per window, and after each window its
  relative difference to the reference (the reference's own: its flat params)."""

  params: Any
  losses: list[float]
  ms: float
  track: list


class Case(NamedTuple):
  title: str
  windows: list  # each window's rows (a dict of arrays)
  runs: dict[str, Run]  # the first is the reference: the plain step on the whole window


def init_params(seed, sizes):
  """He-normal weights, zero biases (in numpy: no tiny XLA programs to compile)."""
  rng = np.random.default_rng(seed)
  ws = [rng.standard_normal((m, n)) * np.sqrt(2.0 / m) for m, n in itertools.pairwise(sizes)]
  return [{"w": w.astype(np.float32), "b": np.zeros(w.shape[1], np.float32)} for w in ws]


@jax.jit
def row_losses(params, batch):
  """Each row's cross-entropy, and whether the MLP classifies it right."""
  x = batch["x"]
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  logits = x @ params[-1]["w"] + params[-1]["b"]
  hits = jnp.argmax(logits, -1) == batch["y"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), hits


def token_loss(params, batch):
  """The mean cross-entropy of the batch's real rows (``mask`` 1; padding is 0): a token mean,
  and the accuracy of all its rows."""
  losses, hits = row_losses(params, batch)
  tokens = jnp.maximum(batch["mask"].sum(), 1.0)
  return jnp.sum(losses * batch["mask"]) / tokens, {"accuracy": jnp.mean(hits)}


def real_rows(microbatch):
  """ga's ``weight_fn`` for ``token_loss``: the micro-batch's real (not padding) rows."""
  return microbatch["mask"].sum()


def load_digits_split(seed):
  """Standardized digits, split 80/20 (stratified) into train and test sets."""
  from sklearn import datasets, model_selection, preprocessing

  x, y = datasets.load_digits(return_X_y=True)
  split = model_selection.train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
  x_tr, x_te, y_tr, y_te = split
  scaler = preprocessing.StandardScaler().fit(x_tr)
  x_tr, x_te = (scaler.transform(a).astype(np.float32) for a in (x_tr, x_te))
  return x_tr, y_tr.astype(np.int32), x_te, y_te.astype(np.int32)


def make_windows(x, y, steps, rows, seed):
  """``steps`` windows of ``rows`` examples, drawn epoch by epoch from seeded permutations."""
  rng = np.random.default_rng(seed)
  order = np.concatenate([rng.permutation(len(x)) for _ in range(math.ceil(steps * rows / len(x)))])
  return [{"x": x[idx], "y": y[idx]} for idx in order[: steps * rows].reshape(steps, rows)]


def with_padding(windows, k, seed):
  """Each window with a ``mask``: micro-batch ``i`` (rows ``i, i + k, ...``, as ga splits)
  keeps its first ``n_i`` rows, ``n_i`` drawn from 1 to b; the rest is padding."""
  rng, out = np.random.default_rng(seed + 1), []
  for w in windows:
    b = len(w["y"]) // k
    real = rng.integers(1, b + 1, size=(k, 1)) > np.arange(b)  # (k, b): micro-batch, row
    out.append({**w, "mask": real.T.reshape(-1).astype(np.float32)})  # row i + k * j
  return out


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
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  pos_int, pos_float = (functools.partial(_positive, kind) for kind in (int, float))
  for flag, kind, default, text in [
    ("--k", pos_int, 8, "micro-batches per update (default 8)"),
    ("--microbatch-size", pos_int, 32, "rows per micro-batch b (default 32)"),
    ("--steps", pos_int, 100, "optimizer updates (default 100)"),
    ("--lr", pos_float, 1e-3, "adam's peak learning rate, > 0 (default 1e-3)"),
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
    hint = 'in the clone, pip install -e ".[examples]"'
    print(f"error: the demo needs scikit-learn, matplotlib and tqdm: {hint} ({e})", file=sys.stderr)
    raise SystemExit(2) from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  with jax.default_matmul_precision("float32"):  # not TF32-like: runs differ by summation order
    k, b, rows = args.k, args.microbatch_size, args.k * args.microbatch_size
    x_tr, y_tr, x_te, y_te = load_digits_split(args.seed)
    windows = make_windows(x_tr, y_tr, args.steps, rows, args.seed)
    params0 = jax.device_put(init_params(args.seed, (x_tr.shape[1], args.hidden, args.hidden, 10)))
    print(
      f"gradaccum_jax {ga.__version__} on {jax.devices()[0].platform} (jax {jax.__version__}):"
      f" digits ({len(x_tr)} train / {len(x_te)} test), MLP 64-{args.hidden}-{args.hidden}-10,"
      f" {args.steps} adam updates of {rows} = {k} x {b} rows, from the same start, per case"
    )
    bar = functools.partial(tqdm, disable=args.quiet or not sys.stderr.isatty(), leave=False)
    data = jax.device_put({"x": np.concatenate([x_tr, x_te]), "y": np.concatenate([y_tr, y_te])})
    found = []  # (case number, name, Result, differs_because) of every run but the references
    for number, case in enumerate(_cases(args, windows), start=1):
      print(f"\n{number}. {case.title}")
      found += _run_case(number, case, args, params0, bar, (data, len(x_tr)))
    agree = _report(found, args.steps)
    print(f"plot: {_plot(found, args, plt)}")
    return 0 if agree else 1


def _cases(args, windows) -> list[Case]:
  """The three cases, each a reference (the plain step on the whole window) and the tools. One
  loss (a token mean) and one optimizer (clipping, then adam on a warm-up and cosine schedule)
  throughout: five programs, each compiled once, however many cases run it."""
  k, b, lr = args.k, args.microbatch_size, args.lr
  clip = 1.0  # the global norm (the digits MLP's gradients start at norms 3 to 5)
  # The schedule: warm-up from lr / 10 to lr, then a cosine back to lr / 10.
  warmup = max(1, args.steps // 10)
  decay = max(args.steps, 2 * warmup)
  schedule = optax.warmup_cosine_decay_schedule(lr / 10, lr, warmup, decay, end_value=lr / 10)
  inner = optax.chain(optax.clip_by_global_norm(clip), optax.adam(schedule))
  around = optax.chain(  # clipping and the schedule wrapped around MultiSteps, as often added
    optax.clip_by_global_norm(clip),
    optax.inject_hyperparams(
      lambda learning_rate: optax.MultiSteps(optax.adam(learning_rate), k).gradient_transformation()
    )(learning_rate=schedule),
  )
  tx, multisteps = ga.accumulate(inner, k), optax.MultiSteps(inner, k)
  ms, plain = f"optax.MultiSteps {k} x {b}", f"plain batch of {k * b}"
  runs = {
    plain: Run(_optax_step(inner, token_loss), inner, True),
    f"ga.train_step {k} x {b}, weight_fn": Run(
      ga.train_step(token_loss, tx, has_aux=True, weight_fn=real_rows), tx, True
    ),
    ms: Run(_optax_step(multisteps, token_loss), multisteps, False),
    f"optax.microbatching {k} x {b}": Run(
      _optax_step(inner, token_loss, microbatch_size=b), inner, True
    ),
  }
  mean_of_means = "a mean of per-micro-batch means, not the token mean"
  uneven = {n: r._replace(differs_because=mean_of_means) if n.startswith("optax") else r
            for n, r in runs.items()}  # fmt: skip
  why = "clips each micro-batch; the schedule counts micro-batches"
  outside = {plain: runs[plain], f"{ms}, around it": Run(_optax_step(around, token_loss), around, False, why)}  # fmt: skip
  full = [{**w, "mask": np.ones(len(w["y"]), np.float32)} for w in windows]
  return [
    Case(
      f"Every row real (equal micro-batches), the loss the mean over the window's rows,"
      f" clipping (global norm {clip:g}) and a learning-rate schedule (warm-up over {warmup}"
      " windows, then a cosine) inside the inner optimizer: the usual case, where every tool"
      " matches the big batch.",
      full, runs,
    ),
    Case(
      f"Uneven tokens, the same programs: micro-batch i has n_i real rows (n_i drawn from 1 to"
      f" {b}, the rest padding) and the loss is the mean over the window's real rows. ga weights"
      " each micro-batch by its real rows (weight_fn=lambda mb: mb['mask'].sum()); MultiSteps"
      " and microbatching (MEAN) are given each micro-batch's mean.",
      with_padding(windows, k, args.seed), uneven,
    ),
    Case(
      "Case 1's windows, with clipping and the schedule around MultiSteps, as they are often"
      " added (optax.chain(clip, ...), optax.inject_hyperparams), not inside its inner optimizer.",
      full, outside,
    ),
  ]  # fmt: skip


def _optax_step(tx, loss, microbatch_size=None):
  """One jitted optax step on a batch: the whole window (plain), one micro-batch (MultiSteps),
  or the whole window through ``optax.microbatching`` (the mean of its micro-batches'
  gradients, micro-batch ``i`` the rows ``i, i + k, ...`` as in ga) when ``microbatch_size``
  is given."""
  grad_fn = jax.value_and_grad(loss, has_aux=True)
  if microbatch_size is not None:
    mean = optax.microbatching.AccumulationType.MEAN
    grad_fn = optax.microbatching.microbatch(grad_fn, 1, microbatch_size, accumulator=mean)

  @jax.jit
  def step(params, opt_state, batch):
    (loss_value, _), grads = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss_value}

  return step


def _flat(params):
  return np.concatenate([np.asarray(leaf, np.float64).ravel() for leaf in jax.tree.leaves(params)])


def _norm(v):
  """The L2 norm without BLAS, whose threads would spin against XLA's on a small machine."""
  return math.sqrt(float(np.sum(np.square(v))))


def _run(run: Run, batches, params, bar, reference=None) -> Result:
  """``run.step`` on each window's ``batches`` (the first window also compiles it: the time
  is the median of the others). After each window, the flat params (the reference's run,
  ``reference`` None) or their distance to ``reference``'s after the same window, over the
  distance the reference had moved from the start."""
  state = run.tx.init(params)
  start_flat, losses, times, track = _flat(params), [], [], []
  for t, window in enumerate(bar(batches)):
    start, window_losses = time.perf_counter(), []
    for batch in window:  # the window's loss: the mean of its calls' (case 1's plot)
      params, state, metrics = run.step(params, state, batch)
      window_losses.append(metrics["loss"])
    jax.block_until_ready(params)
    times.append(time.perf_counter() - start)
    losses.append(float(np.mean([float(loss) for loss in window_losses])))
    flat = _flat(params)
    if reference is None:
      track.append(flat)
    else:
      moved = max(_norm(reference[t] - start_flat), np.finfo(np.float32).tiny)
      track.append(_norm(flat - reference[t]) / moved)
  return Result(params, losses, 1e3 * float(np.median(times[1:] or times)), track)


def _run_case(number, case, args, params0, bar, data):
  """Every run of ``case`` from ``params0``, a table of each one's final train loss, test
  accuracy and time, and ``(number, name, Result, differs_because)`` of each but the first.
  ``data``: the train rows then the test rows, and how many are train rows."""
  k = args.k
  whole = jax.device_put([[w] for w in case.windows])
  micro = jax.device_put(
    [[{n: a[i::k] for n, a in w.items()} for i in range(k)] for w in case.windows]
  )
  rows, n_train = data
  print("| run | final train loss | test accuracy | ms / window (median) |\n|---|---|---|---|")
  ref, found = None, []
  for name, run in case.runs.items():
    batches = whole if run.whole else micro
    result = _run(run, batches, params0, functools.partial(bar, desc=name), ref and ref.track)
    if ref is None:
      ref = result
      if number == 1:  # its losses: the plot
        found.append((number, name, result._replace(track=None), None))
    else:
      found.append((number, name, result, run.differs_because))
    losses, hits = (np.asarray(a) for a in row_losses(result.params, rows))
    train_loss, test_acc = float(np.mean(losses[:n_train])), float(np.mean(hits[n_train:]))
    print(f"| {name} | {train_loss:.4f} | {test_acc:.4f} | {result.ms:.2f} |")
  return found


def _report(found, steps) -> bool:
  """The table of every run's difference to its case's reference; whether each run that
  should match the big batch does."""
  print(
    "\nDifference to the plain big batch's params after the same updates, over the distance"
    " the big batch moved them from the start (0 = the same update):"
  )
  print(f"| case | run | after the first update | after {steps} | |\n|---|---|---|---|---|")
  wrong, differ = [], []
  for number, name, result, why in found:
    if result.track is None:
      continue
    first, last = result.track[0], result.track[-1]
    close = max(first, last) < TOLERANCE
    verdict = "ok" if close else (f"differs: {why}" if why else "TOO LARGE")
    print(f"| {number} | {name} | {first:.1e} | {last:.1e} | {verdict} |")
    if not close:
      (differ if why else wrong).append(f"{number}. {name}")
  if wrong:
    print(f"-> THE RUNS DISAGREE (tolerance {TOLERANCE:.0e}): {', '.join(wrong)}")
  else:
    but = f", but for {len(differ)} that differ by design: {'; '.join(differ)}" if differ else ""
    print(f"-> the runs agree with the big batch (tolerance {TOLERANCE:.0e}){but}")
  return not wrong


def _plot(found, args: argparse.Namespace, plt) -> str:
  """Case 1's window losses, and every run's difference to the big batch after each update,
  on log scales, saved as ``<args.out>/loss_curves.png``. The second panel's legend sits
  beside it, clear of the curves."""
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "loss_curves.png")
  fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.6), dpi=110, width_ratios=(1, 1.1))
  updates = range(1, args.steps + 1)
  styles = [
    {"lw": 5, "alpha": 0.3, "color": "0.4"},
    {"lw": 1.8, "ls": "--", "color": _color("ga.")},
    {"lw": 1.8, "ls": ":", "color": "k"},
    {"lw": 1, "ls": "-.", "color": _color("optax.microbatching")},
  ]
  case1 = [(name, result) for number, name, result, _ in found if number == 1]
  for (name, result), style in zip(case1, itertools.cycle(styles)):
    left.plot(updates, result.losses, label=name, **style)
  k, b = args.k, args.microbatch_size
  left.set_title(
    f"1. every row real: training loss\nclipped adam, warm-up to lr={args.lr:g}, {k * b} = {k} x {b}"
  )
  left.set(yscale="log", xlabel="optimizer update (window)", ylabel="training loss of the window")
  left.legend(fontsize=7, loc="upper right")
  floor = 1e-9  # a difference of exactly 0 drawn at the floor
  for number, name, result, _ in found:
    if result.track is not None:
      values, wide = np.maximum(result.track, floor), name.startswith("optax.MultiSteps")
      right.plot(updates, values, color=_color(name), ls=("-", "--", ":")[(number - 1) % 3],
                 lw=3.5 if wide else 1.5, alpha=0.6 if wide else 1, label=f"{number}. {name}")  # fmt: skip
  right.axhline(TOLERANCE, color="0.5", lw=0.8, label=f"tolerance {TOLERANCE:g}")
  right.set_title("difference to the plain big batch's params\n(over the distance it moved them)")
  right.set(yscale="log", xlabel="optimizer update (window)", ylabel="relative difference")
  right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
  for ax in (left, right):
    ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, bbox_inches="tight")
  plt.close(fig)
  return path


def _color(name):
  if name.startswith("ga."):
    return "tab:blue"
  if name.startswith("optax.MultiSteps"):
    return "tab:red" if "around" in name else "tab:orange"
  return "tab:green"


if __name__ == "__main__":
  sys.exit(main())
