"""Compiled memory of one window against the floor: ga.train_step beside a minimal scan.

For each model and k, every program is lowered and compiled on shapes (nothing runs) and its
peak is read from ``compiled.memory_analysis()``: arguments + outputs - aliased + temp, the
bytes a call holds (deterministic). Programs, each on a batch of k micro-batches of b rows:

  min_scan            a hand-written lax.scan of the micro-batch gradients from zeros, their
                      mean, one inner update (params and state donated): the floor
  min_scan_undonated  the same, not donated
  min_state_undonated the same with the accumulator in its state, taken and returned (written
                      back as zeros), as an undonated ga step must: the floor of ga_undonated
  ga                  ga.train_step(..., donate=True)
  ga_undonated        ga.train_step(...)
  microbatching       optax.microbatching.microbatch(jax.grad(loss)) then the update, donated
  multisteps_call     one donated call of optax.MultiSteps (a window is k such calls)

A is one float32 copy of the params. The targets (tests/test_memory.py asserts them):
ga <= min_scan + 0.05 A and ga_undonated <= min_state_undonated + 0.1 A, for every k.

On a mesh of 8 (CPU) devices, per device, the MLP replicated and FSDP (every matrix sharded
on its first dimension): ``mesh_min_scan`` is the hand-written floor under ``jax.shard_map``
(params cast to device-varying, the scan from zeros, one reduction after it; FSDP: the
params gathered once before the scan and the gradients reduce-scattered after it, or
gathered and reduce-scattered per micro-batch into a sharded accumulator), donated.

  python benchmarks/memory_floor.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import sys
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  )

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
  import gradaccum_jax as ga
except ModuleNotFoundError:  # run from a source tree without installing
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  import gradaccum_jax as ga
import side_by_side  # noqa: E402  (benchmarks/side_by_side.py: the MLP's loss)
import transformer  # noqa: E402  (benchmarks/transformer.py: the LM)

MIB = 2**20
KS = (2, 4, 8, 16, 32)


def mlp_model(sizes=(784, 1024, 1024, 10), b=32):
  """``(params, loss_fn, microbatch)`` shapes of an MLP with softmax cross-entropy."""
  params = [
    {"w": jax.ShapeDtypeStruct((m, n), jnp.float32), "b": jax.ShapeDtypeStruct((n,), jnp.float32)}
    for m, n in zip(sizes[:-1], sizes[1:], strict=True)
  ]

  micro = {
    "x": jax.ShapeDtypeStruct((b, sizes[0]), jnp.float32),
    "y": jax.ShapeDtypeStruct((b,), jnp.int32),
  }
  return params, side_by_side.loss_fn, micro


LM = transformer.Config(d=256, heads=4, layers=4, seq=128, vocab=4096, b=4, k=4, rounds=1,
                        reps=1, dtype="float32")  # fmt: skip


def lm_model(c: transformer.Config = LM):
  """``(params, loss_fn, microbatch)`` shapes of benchmarks/transformer.py's decoder LM."""
  params = jax.eval_shape(lambda: transformer.init(jax.random.key(0), c))
  micro = {"tokens": jax.ShapeDtypeStruct((c.b, c.seq + 1), jnp.int32)}
  return params, transformer.make_loss(c), micro


MODELS = {"mlp": mlp_model, "lm": lm_model}


def min_scan(loss_fn, inner, k):
  """The floor: the micro-batch gradients scanned from zeros, their mean, one update."""

  def step(params, state, batch):
    def body(acc, i):
      mb = ga.microbatch(batch, i, k)
      return jax.tree.map(jnp.add, acc, jax.grad(loss_fn)(params, mb)), None

    acc, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), jnp.arange(k))
    updates, state = inner.update(jax.tree.map(lambda a: a / k, acc), state, params)
    return optax.apply_updates(params, updates), state

  return step


def min_state(loss_fn, inner, k):
  """The floor of a step whose state keeps the accumulator (as ``AccumulateState.acc_grads``
  does): the scan from it, the mean, one update, the accumulator written back as zeros."""

  def step(params, state, batch):
    opt_state, acc = state

    def body(acc, i):
      mb = ga.microbatch(batch, i, k)
      return jax.tree.map(jnp.add, acc, jax.grad(loss_fn)(params, mb)), None

    acc, _ = jax.lax.scan(body, acc, jnp.arange(k))
    updates, opt_state = inner.update(jax.tree.map(lambda a: a / k, acc), opt_state, params)
    return optax.apply_updates(params, updates), (opt_state, jax.tree.map(jnp.zeros_like, acc))

  return step


def microbatching(loss_fn, inner, k):
  def step(params, state, batch):
    b = jax.tree.leaves(batch)[0].shape[0] // k
    grad = optax.microbatching.microbatch(
      jax.grad(loss_fn), argnums=1, microbatch_size=b,
      accumulator=optax.microbatching.AccumulationType.MEAN,
    )(params, batch)  # fmt: skip
    updates, state = inner.update(grad, state, params)
    return optax.apply_updates(params, updates), state

  return step


def multisteps_call(loss_fn, ms):
  def step(params, state, mb):
    updates, state = ms.update(jax.grad(loss_fn)(params, mb), state, params)
    return optax.apply_updates(params, updates), state

  return step


def peak(compiled) -> int:
  m = compiled.memory_analysis()
  return int(
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    + m.temp_size_in_bytes
  )  # fmt: skip


def window_bytes(model: str, k: int, inner=None) -> dict[str, int]:
  """Peak bytes of every program above for ``model`` at ``k``, and ``"A"``."""
  params, loss_fn, micro = MODELS[model]()
  inner = inner or optax.adam(1e-3)
  batch = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct((k * s.shape[0],) + s.shape[1:], s.dtype), micro
  )
  tx = ga.accumulate(inner, k)
  ms = optax.MultiSteps(inner, every_k_schedule=k)
  state, ga_state = jax.eval_shape(inner.init, params), jax.eval_shape(tx.init, params)
  donated = functools.partial(jax.jit, donate_argnums=(0, 1))
  out = {"A": sum(x.size * 4 for x in jax.tree.leaves(params))}
  out["min_scan"] = peak(donated(min_scan(loss_fn, inner, k)).lower(params, state, batch).compile())
  out["min_scan_undonated"] = peak(
    jax.jit(min_scan(loss_fn, inner, k)).lower(params, state, batch).compile()
  )
  out["min_state_undonated"] = peak(
    jax.jit(min_state(loss_fn, inner, k)).lower(params, (state, params), batch).compile()
  )
  for name, donate in (("ga", True), ("ga_undonated", False)):
    step = ga.train_step(loss_fn, tx, donate=donate)
    out[name] = peak(step.lower(params, ga_state, batch, num_real_microbatches=None).compile())
  out["microbatching"] = peak(
    donated(microbatching(loss_fn, inner, k)).lower(params, state, batch).compile()
  )
  ms_state = jax.eval_shape(ms.init, params)
  out["multisteps_call"] = peak(
    donated(multisteps_call(loss_fn, ms)).lower(params, ms_state, micro).compile()
  )
  return out


LAYOUTS = ("replicated", "fsdp_once", "fsdp_per_microbatch")


def _fsdp_specs(params):
  return jax.tree.map(lambda x: P("data") if x.ndim == 2 else P(), params)


def mesh_min_scan(loss_fn, inner, k, mesh, specs, per_microbatch):
  """The floor on a 1-D ``"data"`` mesh: see the module's docstring."""
  n = mesh.shape["data"]

  def gather(x, spec):
    return jax.lax.all_gather(x, "data", axis=0, tiled=True) if spec != P() else x

  def scatter(g, spec):
    return jax.lax.psum_scatter(g, "data", scatter_dimension=0, tiled=True) if spec != P() else g

  def vary(x):  # a gathered shard may be varying already
    try:
      return jax.lax.pcast(x, "data", to="varying")
    except ValueError:
      return x

  def per_device(params, batch):
    if not per_microbatch:
      params = jax.tree.map(gather, params, specs)
    params = jax.tree.map(vary, params)

    def body(acc, i):
      p = params
      if per_microbatch:  # tied to the trip, so that XLA does not hoist the gathers
        p, _ = jax.lax.optimization_barrier((p, i))
        p = jax.tree.map(gather, p, specs)
      g = jax.grad(loss_fn)(p, ga.microbatch(batch, i, k))
      if per_microbatch:
        g = jax.tree.map(scatter, g, specs)
      return jax.tree.map(jnp.add, acc, g), None

    acc, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), jnp.arange(k))
    if per_microbatch:
      acc = jax.tree.map(lambda a, s: a if s != P() else jax.lax.psum(a, "data"), acc, specs)
    else:
      acc = jax.tree.map(
        lambda a, s: scatter(a, s) if s != P() else jax.lax.psum(a, "data"), acc, specs
      )
    return jax.tree.map(lambda a: a / (k * n), acc)

  return sharded_step(per_device, inner, mesh, specs)


def sharded_step(per_device, inner, mesh, specs):
  """``step(params, state, batch)``: the mean gradient ``per_device(params, batch)`` returns
  under ``jax.shard_map`` (batch rows over ``"data"``, params by ``specs``), one update."""

  def step(params, state, batch):
    grads = jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs)(
      params, batch
    )
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _mlp_on_mesh(layout: str) -> tuple:
  """The MLP on 8 devices, replicated (``layout="replicated"``) or FSDP (any other):
  ``(mesh, specs, params, loss_fn, micro, like, a)``. ``params`` are ShapeDtypeStructs placed
  by ``specs``; ``like`` places an ``eval_shape`` tree as its types say (replicated where they
  say nothing); ``a`` is one float32 copy of the params per device."""
  # Explicit, so that eval_shape's state carries the params' shardings in its types.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  params, loss_fn, micro = mlp_model(b=32)
  specs = jax.tree.map(lambda x: P(), params) if layout == "replicated" else _fsdp_specs(params)
  placed = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))  # noqa: E731
  like = lambda tree: jax.tree.map(  # noqa: E731  (eval_shape gives no concrete mesh)
    lambda x: placed(x, P() if x.sharding is None else x.sharding.spec), tree
  )
  a = sum(x.size * 4 // (1 if s == P() else 8)
          for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(specs), strict=True))  # fmt: skip
  return mesh, specs, jax.tree.map(placed, params, specs), loss_fn, micro, like, a


def mesh_window_bytes(layout: str, k: int, inner=None) -> dict[str, int]:
  """Per-device peak bytes of ``mesh_min_scan`` and ga.train_step (donated and not) on 8
  devices, for the MLP in ``layout``; ``"A"``: one float32 copy of the params per device."""
  mesh, specs, params, loss_fn, micro, like, a = _mlp_on_mesh(layout)
  inner = inner or optax.adam(1e-3)
  tx = ga.accumulate(inner, k)
  batch = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(
      (8 * k * s.shape[0],) + s.shape[1:], s.dtype, sharding=NamedSharding(mesh, P("data"))
    ),
    micro,
  )
  with jax.set_mesh(mesh):  # so that eval_shape's outputs carry the shardings (jax 0.12)
    state, ga_state = jax.eval_shape(inner.init, params), jax.eval_shape(tx.init, params)
  state, ga_state = like(state), like(ga_state)
  per_mb = layout == "fsdp_per_microbatch"
  floor = mesh_min_scan(loss_fn, inner, k, mesh, specs, per_mb)
  out = {
    "A": a,
    "mesh_min_scan": peak(
      jax.jit(floor, donate_argnums=(0, 1)).lower(params, state, batch).compile()
    ),
    "mesh_min_scan_undonated": peak(jax.jit(floor).lower(params, state, batch).compile()),
  }  # fmt: skip
  for name, donate in (("ga", True), ("ga_undonated", False)):
    step = ga.train_step(
      loss_fn, tx, mesh=mesh, param_specs=None if layout == "replicated" else specs,
      gather_params="per_microbatch" if per_mb else "once", donate=donate,
    )  # fmt: skip
    out[name] = peak(step.lower(params, ga_state, batch, num_real_microbatches=None).compile())
  return out


STREAMING_INNERS = {"adam": lambda: optax.adam(1e-3), "sgd": lambda: optax.sgd(1e-3)}


def streaming_bytes(model: str, inner_name: str, k: int = 8, layout: str | None = None) -> dict:
  """Peak bytes of one call per micro-batch, each donated and not (``_undonated``): ``plain``
  (``jax.grad`` + the inner update, the floor), ``stream`` (``jax.grad`` + ``tx.update``),
  ``micro`` (``ga.micro_step``) and ``multisteps`` (``optax.MultiSteps``); and ``"A"``.

  With ``layout`` (``"replicated"``, ``"fsdp"``; the MLP): per device on 8 devices, an
  explicit ``"data"`` mesh; ``plain``, ``stream`` and ``multisteps`` are sharded by GSPMD (a
  gradient reduction per call), ``micro`` is ``ga.micro_step(..., mesh=mesh)`` (per-device
  sums, one reduction per window); ``"A"`` is the params as a device stores them."""
  if layout is None:
    params, loss_fn, micro = MODELS[model]()
    a, like, micro_kw = sum(x.size * 4 for x in jax.tree.leaves(params)), (lambda t: t), {}
    context = contextlib.nullcontext()
  else:
    mesh, specs, params, loss_fn, micro, like, a = _mlp_on_mesh(layout)
    micro = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("data"))),
      micro,
    )
    micro_kw = {"mesh": mesh, "param_specs": None if layout == "replicated" else specs}
    context = jax.set_mesh(mesh)
  inner = STREAMING_INNERS[inner_name]()
  tx, ms = ga.accumulate(inner, k), optax.MultiSteps(inner, every_k_schedule=k)
  out = {"A": a}

  def with_update(update):
    def step(p, s, mb):
      updates, s = update(jax.grad(loss_fn)(p, mb), s, p)
      return optax.apply_updates(p, updates), s

    return step

  calls = {
    "plain": (with_update(inner.update), inner.init),
    "stream": (with_update(tx.update), tx.init),
    "multisteps": (multisteps_call(loss_fn, ms), ms.init),
  }
  with context:
    for donate in (True, False):
      tag = "" if donate else "_undonated"
      for name, (fn, init) in calls.items():
        jitted = jax.jit(fn, donate_argnums=(0, 1) if donate else ())
        state = like(jax.eval_shape(init, params))
        out[name + tag] = peak(jitted.lower(params, state, micro).compile())
      step = ga.micro_step(loss_fn, tx, donate=donate, **micro_kw)
      state = like(jax.eval_shape(step.init, params))
      out["micro" + tag] = peak(step.lower(params, state, micro).compile())
  return out


def streaming_report(rows) -> str:
  names = ("stream", "micro", "multisteps")
  lines = [
    "| model | inner | A MiB | plain | " + " | ".join(names) + " | "
    + " | ".join(f"{n} undonated" for n in ("plain", *names)) + " |",
    "|---" * 11 + "|",
  ]  # fmt: skip
  for (model, inner), r in rows.items():
    over = lambda n, r=r: f"+{(r[n] - r['plain']) / r['A']:.2f} A"  # noqa: E731
    lines.append(
      f"| {model} | {inner} | {r['A'] / MIB:.2f} | {r['plain'] / MIB:.2f} MiB | "
      + " | ".join(over(n) for n in names) + " | "
      + " | ".join(over(n + "_undonated") for n in ("plain", *names)) + " |"
    )  # fmt: skip
  return "\n".join(lines)


def excess(row: dict[str, int]) -> dict[str, float]:
  """ga's peak over the floor's, in A: donated and undonated."""
  return {
    "ga": (row["ga"] - row["min_scan"]) / row["A"],
    "ga_undonated": (row["ga_undonated"] - row["min_state_undonated"]) / row["A"],
  }


def report(rows: dict[str, dict[int, dict[str, int]]]) -> str:
  names = ["min_scan", "ga", "min_scan_undonated", "min_state_undonated", "ga_undonated",
           "microbatching", "multisteps_call"]  # fmt: skip
  lines = [
    "| model | k | A MiB | "
    + " | ".join(names)
    + " | ga - min_scan (A) | ga_undonated - min_state_undonated (A) |",
    "|---" * (len(names) + 5) + "|",
  ]
  for model, by_k in rows.items():
    for k, row in by_k.items():
      ex = excess(row)
      cells = " | ".join(f"{row[n] / MIB:.2f}" for n in names)
      lines.append(
        f"| {model} | {k} | {row['A'] / MIB:.2f} | {cells} | {ex['ga']:+.3f} |"
        f" {ex['ga_undonated']:+.3f} |"
      )
  return "\n".join(lines)


def mesh_report(rows) -> str:
  lines = [
    "| layout | k | A MiB | mesh_min_scan | ga | ga - floor (A) | mesh_min_scan_undonated |"
    " ga_undonated | undonated - floor (A) |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for layout, by_k in rows.items():
    for k, r in by_k.items():
      lines.append(
        f"| {layout} | {k} | {r['A'] / MIB:.2f} | {r['mesh_min_scan'] / MIB:.2f} |"
        f" {r['ga'] / MIB:.2f} | {(r['ga'] - r['mesh_min_scan']) / r['A']:+.3f} |"
        f" {r['mesh_min_scan_undonated'] / MIB:.2f} | {r['ga_undonated'] / MIB:.2f} |"
        f" {(r['ga_undonated'] - r['mesh_min_scan_undonated']) / r['A']:+.3f} |"
      )
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None, help="folder for memory_floor.json and .md")
  ap.add_argument("--ks", default=",".join(map(str, KS)))
  args = ap.parse_args(argv)
  ks = [int(k) for k in args.ks.split(",")]
  rows = {model: {k: window_bytes(model, k) for k in ks} for model in MODELS}
  mesh_rows = {layout: {k: mesh_window_bytes(layout, k) for k in ks} for layout in LAYOUTS}
  stream_rows = {(m, i): streaming_bytes(m, i) for m in MODELS for i in STREAMING_INNERS}
  mesh_stream_rows = {
    (layout, i): streaming_bytes("mlp", i, layout=layout)
    for layout in ("replicated", "fsdp")
    for i in STREAMING_INNERS
  }
  meta = {
    "backend": jax.default_backend(), "jax": jax.__version__, "optax": optax.__version__,
    "python": platform.python_version(), "inner": "adam",
  }  # fmt: skip
  md = (
    "# Compiled memory against the floor\n\n"
    f"Peak bytes per call in MiB (compiled.memory_analysis(): arguments + outputs - aliased +"
    f" temp), adam; MLP 784-1024-1024-10 at b = 32, LM d {LM.d}, {LM.layers} blocks,"
    f" {LM.seq} tokens at b = {LM.b}. jax {meta['jax']}, optax {meta['optax']},"
    f" {meta['backend']}.\n\n" + report(rows) + "\n\nOn 8 devices, per device (MiB), the MLP:"
    " A is one float32 copy of the params as a device stores them.\n\n"
    + mesh_report(mesh_rows)
    + "\n\n## Streaming: one call per micro-batch, k = 8\n\nPeak of one call above the"
    " donated plain micro-batch step's (jax.grad + the inner update), in A.\n\n"
    + streaming_report(stream_rows)
    + "\n\nOn 8 devices, per device, the MLP (A as a device stores the params; the model"
    " column is the layout): ga.micro_step with mesh=, the others sharded by GSPMD.\n\n"
    + streaming_report(mesh_stream_rows)
    + "\n"
  )
  print(md)
  if args.out:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_floor.json").write_text(
      json.dumps(
        {
          "meta": meta,
          "rows": rows,
          "mesh_rows": mesh_rows,
          "stream_rows": {f"{m}/{i}": r for (m, i), r in stream_rows.items()},
          "mesh_stream_rows": {f"{m}/{i}": r for (m, i), r in mesh_stream_rows.items()},
        },
        indent=2,
      )
    )
    (out / "memory_floor.md").write_text(md)


if __name__ == "__main__":
  main()
