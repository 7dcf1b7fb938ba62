"""``python -m gradaccum_jax``: train a small classifier with and without accumulation, and compare.

Makes a synthetic classification problem, then trains the same MLP with adam
twice from the same initialization and data: (1) one plain jitted step on the
whole batch of ``k * b`` rows, (2) ``ga.train_step`` over ``k`` micro-batches of
``b`` rows. It prints the loss, accuracy and time per update of each, the XLA
temp memory of each compiled step, and checks that the two runs agree.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga


def make_data(key, num_examples, dim, num_classes):
  """Gaussian blobs around random class centres, with label noise from the overlap."""
  ck, xk, yk = jax.random.split(key, 3)
  centres = 0.5 * jax.random.normal(ck, (num_classes, dim))
  y = jax.random.randint(yk, (num_examples,), 0, num_classes)
  x = centres[y] + 2.0 * jax.random.normal(xk, (num_examples, dim))
  return x / jnp.sqrt(dim), y


def init_params(key, sizes):
  params = []
  for m, n in zip(sizes[:-1], sizes[1:], strict=True):
    key, wk = jax.random.split(key)
    params.append({"w": jax.random.normal(wk, (m, n)) * jnp.sqrt(2.0 / m), "b": jnp.zeros(n)})
  return params


def logits_fn(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, batch):
  logits = logits_fn(params, batch["x"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def main(argv: list[str] | None = None) -> int:
  # Full float32 matmuls, so that the two runs differ only by summation order (GPUs default to
  # TF32-like precision for float32 dots).
  with jax.default_matmul_precision("float32"):
    return _main(argv)


def _main(argv: list[str] | None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m gradaccum_jax", description=__doc__.split("\n")[0]
  )
  parser.add_argument("--k", type=int, default=8, help="micro-batches per update (default 8)")
  parser.add_argument("--microbatch-size", type=int, default=64, help="rows per micro-batch b")
  parser.add_argument("--steps", type=int, default=30, help="optimizer updates (windows)")
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--classes", type=int, default=10)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.k <= 0 or args.microbatch_size <= 0 or args.steps <= 0:
    parser.error(
      f"--k={args.k}, --microbatch-size={args.microbatch_size} and --steps={args.steps} must be positive"
    )

  k, b = args.k, args.microbatch_size
  batch_size = k * b
  key = jax.random.key(args.seed)
  dk, pk = jax.random.split(key)
  x, y = make_data(dk, batch_size * args.steps, args.dim, args.classes)
  batches = [
    {"x": x[i * batch_size : (i + 1) * batch_size], "y": y[i * batch_size : (i + 1) * batch_size]}
    for i in range(args.steps)
  ]
  params0 = init_params(pk, (args.dim, args.hidden, args.hidden, args.classes))
  print(
    f"gradaccum_jax {ga.__version__} on {jax.devices()[0].platform} (jax {jax.__version__}):"
    f" {args.steps} adam updates of an effective batch of {batch_size} = {k} x {b} rows"
  )

  inner = optax.adam(args.lr)

  @jax.jit
  def plain_step(params, opt_state, batch):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss, "aux": aux}

  tx = ga.accumulate(optax.adam(args.lr), k)
  accum_step = ga.train_step(loss_fn, tx, has_aux=True)

  runs = {
    f"plain batch of {batch_size}": (plain_step, inner.init(params0)),
    f"ga.train_step {k} x {b}": (accum_step, tx.init(params0)),
  }
  results = {}
  for name, (step, state) in runs.items():
    compiled = step.lower(params0, state, batches[0]).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    params, losses, times = params0, [], []
    for batch in batches:
      start = time.perf_counter()
      params, state, metrics = step(params, state, batch)
      jax.block_until_ready(params)
      times.append(time.perf_counter() - start)
      losses.append(float(metrics["loss"]))
    results[name] = {
      "params": params,
      "loss": losses[-1],
      "first_loss": losses[0],
      "accuracy": float(metrics["aux"]["accuracy"]),
      "ms": 1e3 * float(np.median(times[1:] or times)),
      "temp_mib": temp / 2**20,
    }

  print("\n| run | first loss | final loss | final accuracy | ms / update | XLA temp MiB |")
  print("|---|---|---|---|---|---|")
  for name, r in results.items():
    print(
      f"| {name} | {r['first_loss']:.4f} | {r['loss']:.4f} | {r['accuracy']:.3f} |"
      f" {r['ms']:.2f} | {r['temp_mib']:.2f} |"
    )
  (_, ra), (_, rb) = results.items()
  diff = optax.tree.norm(jax.tree.map(jnp.subtract, ra["params"], rb["params"]))
  rel = float(diff / optax.tree.norm(ra["params"]))
  agree = rel < 1e-3
  print(
    f"\nrelative parameter difference after {args.steps} updates: {rel:.1e}"
    f" -> {'the runs agree' if agree else 'THE RUNS DISAGREE'} (tolerance 1e-3)"
  )
  return 0 if agree else 1


if __name__ == "__main__":
  sys.exit(main())
