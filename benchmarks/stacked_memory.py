"""Compiled memory of one window on models whose blocks are stacked under one ``lax.scan``.

A step that adds each micro-batch's gradient to a scan carry holds that micro-batch's whole
stacked gradient beside the accumulator; one whose backward pass adds each block's gradient
into the accumulator in place (``jax.vjp(...).with_refs``, JAX 0.11+) holds one block's. For
L stacked tanh blocks of width d (each ``jax.checkpoint``-ed), written three ways (a plain
function, a Linen ``nn.scan``, an NNX ``nnx.scan``), adam, params and state donated, each
program is compiled on shapes and its peak read from ``compiled.memory_analysis()``
(arguments + outputs - aliased + temp, deterministic):

  plain      one micro-batch: jax.grad and the update (what training without accumulation holds)
  ref_scan   the hand-written floor: a scan whose backward pass adds into a Ref from zeros,
             then one update on the mean (no accumulator between windows)
  carry_scan the hand-written scan carry += grad (memory_floor.min_scan)
  ga         ga.train_step / ga.linen_train_step / ga.nnx_train_step(..., donate=True)
  ga_carried the same with grads_in_place=False

On 8 devices (``mesh_stacked_bytes``), per device, replicated or FSDP (each block matrix sharded
over "data" on its input dimension), ``ref_scan`` is a hand-written ``shard_map``: a Ref created
in its body, one reduction after the loop. A is one float32 copy of the params (per device).

  python benchmarks/stacked_memory.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import memory_floor  # sets 8 host devices before jax is imported
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ga = memory_floor.ga
SDS = jax.ShapeDtypeStruct
F32 = jnp.float32


def _block(h, w):
  return jnp.tanh(h @ w["w"] + w["b"]), None


def stacked(layers: int, d: int = 256, b: int = 16) -> tuple:
  """``(params, loss_fn, micro)``: ``layers`` checkpointed tanh blocks scanned, a linear head."""
  params = {
    "blocks": {"w": SDS((layers, d, d), F32), "b": SDS((layers, d), F32)},
    "head": SDS((d, 1), F32),
  }

  def loss_fn(p, mb):
    h, _ = jax.lax.scan(jax.checkpoint(_block), mb["x"], p["blocks"])
    return jnp.mean((h @ p["head"] - mb["y"]) ** 2)

  return params, loss_fn, {"x": SDS((b, d), F32), "y": SDS((b, 1), F32)}


def _linen_net(layers: int, d: int):
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return jnp.tanh(nn.Dense(d)(h)), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      blocks = nn.scan(
        nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=layers
      )
      h, _ = blocks()(x, None)
      return nn.Dense(1)(h)

  return Stack()


def _nnx_net(layers: int, d: int):
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(d, d, rngs=rngs)

  @nnx.split_rngs(splits=layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def blocks(rngs):
    return Block(rngs)

  class Stack(nnx.Module):
    def __init__(self, rngs):
      self.blocks = blocks(rngs)
      self.head = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      @nnx.remat
      def run(h, block):
        return jnp.tanh(block.dense(h))

      return self.head(run(x, self.blocks))

  return Stack(nnx.Rngs(1))


def _ref_sums(loss_fn, params, batch, k):
  """The gradient sums of ``batch``'s ``k`` micro-batches, each backward pass adding into a
  Ref made from zeros (frozen after the scan)."""
  acc = jax.tree.map(lambda p: jax.new_ref(jnp.zeros_like(p)), params)

  def body(_, i):
    out, vjp_fn = jax.vjp(lambda q: loss_fn(q, ga.microbatch(batch, i, k)), params)
    vjp_fn.with_refs(acc)(jnp.ones_like(out))
    return (), None

  jax.lax.scan(body, (), jnp.arange(k))
  return jax.tree.map(jax.freeze, acc)


def ref_scan(loss_fn, inner, k):
  """The in-place floor: the sums of :func:`_ref_sums`, their mean, one update."""

  def step(params, state, batch):
    grads = jax.tree.map(lambda g: g / k, _ref_sums(loss_fn, params, batch, k))
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


# One micro-batch, jax.grad and the update: memory_floor's call of an optimizer on a micro-batch.
plain = memory_floor.multisteps_call


def _batch(micro, k, sharding=None):
  return jax.tree.map(
    lambda s: SDS((k * s.shape[0],) + s.shape[1:], s.dtype, sharding=sharding), micro
  )


def _fn_model(front: str, layers: int, d: int, b: int) -> tuple:
  """``(params, loss_fn, micro, ga_peak)`` for a front end: ``ga_peak(k, in_place, batch)``."""
  micro = {"x": SDS((b, d), F32), "y": SDS((b, 1), F32)}
  if front == "fn":
    params, loss_fn, micro = stacked(layers, d, b)

    def ga_peak(k, in_place, batch):
      tx = ga.accumulate(optax.adam(1e-3), k)
      step = ga.train_step(loss_fn, tx, donate=True, grads_in_place=in_place)
      return memory_floor.peak(step.lower(params, jax.eval_shape(tx.init, params), batch).compile())

    return params, loss_fn, micro, ga_peak
  if front == "linen":
    from flax.training import train_state

    net = _linen_net(layers, d)
    params = jax.eval_shape(net.init, jax.random.key(0), micro["x"])["params"]

    def loss_fn(p, mb):
      return jnp.mean((net.apply({"params": p}, mb["x"]) - mb["y"]) ** 2)

    def ga_peak(k, in_place, batch):
      tx = ga.accumulate(optax.adam(1e-3), k)
      ts = jax.eval_shape(
        lambda p: train_state.TrainState.create(apply_fn=net.apply, params=p, tx=tx), params
      )
      step = ga.linen_train_step(
        net, lambda y, mb: jnp.mean((y - mb["y"]) ** 2), donate=True, grads_in_place=in_place
      )
      return memory_floor.peak(step.lower(ts, batch).compile())

    return params, loss_fn, micro, ga_peak
  from flax import nnx

  graphdef, params = nnx.split(nnx.eval_shape(lambda: _nnx_net(layers, d)))

  def loss_fn(p, mb):
    return jnp.mean((nnx.merge(graphdef, p)(mb["x"]) - mb["y"]) ** 2)

  def ga_peak(k, in_place, batch):
    tx = ga.accumulate(optax.adam(1e-3), k)
    step = ga.nnx_train_step(
      lambda m, mb: jnp.mean((m(mb["x"]) - mb["y"]) ** 2), donate=True, grads_in_place=in_place
    )

    def both():
      model = _nnx_net(layers, d)
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return memory_floor.peak(step.lower(*nnx.eval_shape(both), batch).compile())

  return params, loss_fn, micro, ga_peak


def stacked_bytes(front: str, layers: int, k: int, d: int = 256, b: int = 16) -> dict[str, int]:
  """Peak bytes of every program of the module's docstring for ``front`` ("fn", "linen" or
  "nnx"), ``layers`` blocks and ``k`` micro-batches; ``"A"``."""
  params, loss_fn, micro, ga_peak = _fn_model(front, layers, d, b)
  inner = optax.adam(1e-3)
  state, batch = jax.eval_shape(inner.init, params), _batch(micro, k)
  donated = lambda f: jax.jit(f, donate_argnums=(0, 1))  # noqa: E731
  out = {"A": sum(x.size * 4 for x in jax.tree.leaves(params))}
  out["plain"] = memory_floor.peak(
    donated(plain(loss_fn, inner)).lower(params, state, micro).compile()
  )
  for name, fn in (("ref_scan", ref_scan), ("carry_scan", memory_floor.min_scan)):
    out[name] = memory_floor.peak(
      donated(fn(loss_fn, inner, k)).lower(params, state, batch).compile()
    )
  out["ga"], out["ga_carried"] = ga_peak(k, True, batch), ga_peak(k, False, batch)
  return out


def mesh_ref_scan(loss_fn, inner, k, mesh, specs):
  """The in-place floor on a 1-D ``"data"`` mesh: in a ``shard_map``, the params gathered once,
  a Ref made from zeros in the body, one reduction (psum, or reduce-scatter) after the loop."""
  n = mesh.shape["data"]

  def sharded(spec):
    return spec != P()

  def per_device(params, batch):
    params = jax.tree.map(
      lambda x, s: jax.lax.all_gather(x, "data", axis=1, tiled=True) if sharded(s) else x,
      params, specs,
    )  # fmt: skip
    params = jax.tree.map(lambda x, s: x if sharded(s) else jax.lax.pcast(x, "data", to="varying"),
                          params, specs)  # fmt: skip

    def reduce(g, s):
      if sharded(s):
        g = jax.lax.psum_scatter(g, "data", scatter_dimension=1, tiled=True)
      else:
        g = jax.lax.psum(g, "data")
      return g / (k * n)

    return jax.tree.map(reduce, _ref_sums(loss_fn, params, batch, k), specs)

  return memory_floor.sharded_step(per_device, inner, mesh, specs)


def mesh_stacked_bytes(layout: str, layers: int, k: int, d: int = 256, b: int = 16) -> dict:
  """Per-device peak bytes on 8 devices (``layout``: "replicated" or "fsdp") of ``ref_scan`` (the
  ``shard_map`` floor), ``ga`` and ``ga_carried``; ``"A"``: the params a device stores."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  params, loss_fn, micro = stacked(layers, d, b)
  fsdp = {"blocks": {"w": P(None, "data"), "b": P(None, "data")}, "head": P()}
  specs = jax.tree.map(lambda x: P(), params) if layout == "replicated" else fsdp
  params = jax.tree.map(
    lambda x, s: SDS(x.shape, x.dtype, sharding=NamedSharding(mesh, s)), params, specs
  )
  batch = _batch(micro, 8 * k, NamedSharding(mesh, P("data")))
  inner = optax.adam(1e-3)
  tx = ga.accumulate(inner, k)
  with jax.set_mesh(mesh):  # so that eval_shape's outputs carry the shardings
    state, ga_state = jax.eval_shape(inner.init, params), jax.eval_shape(tx.init, params)

  def placed(tree):
    return jax.tree.map(
      lambda x: SDS(
        x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec if x.sharding else P())
      ),
      tree,
    )

  state, ga_state = placed(state), placed(ga_state)
  a = sum(x.size * 4 // (8 if s != P() else 1)
          for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(specs), strict=True))  # fmt: skip
  floor = jax.jit(mesh_ref_scan(loss_fn, inner, k, mesh, specs), donate_argnums=(0, 1))
  out = {"A": a, "ref_scan": memory_floor.peak(floor.lower(params, state, batch).compile())}
  for name, in_place in (("ga", True), ("ga_carried", False)):
    step = ga.train_step(
      loss_fn, tx, mesh=mesh, param_specs=None if layout == "replicated" else specs,
      donate=True, grads_in_place=in_place,
    )  # fmt: skip
    out[name] = memory_floor.peak(step.lower(params, ga_state, batch).compile())
  return out


FRONTS = ("fn", "linen", "nnx")


def report(rows: dict, mesh_rows: dict) -> str:
  names = ("ref_scan", "carry_scan", "ga", "ga_carried")
  lines = [
    "| model | L | k | A MiB | plain MiB | " + " | ".join(names) + " |", "|---" * 9 + "|"
  ]  # fmt: skip
  for (front, layers, k), r in rows.items():
    over = " | ".join(f"{(r[n] - r['plain']) / r['A']:+.2f} A" for n in names)
    lines.append(
      f"| {front} | {layers} | {k} | {r['A'] / MIB:.2f} | {r['plain'] / MIB:.2f} | {over} |"
    )
  lines += [
    "", "On 8 devices, per device, the plain stacked model: peak in MiB and ga's excess over the"
    " hand-written shard_map floor in A.", "",
    "| layout | L | k | A MiB | ref_scan | ga | ga_carried | ga - floor | ga_carried - floor |",
    "|---" * 9 + "|",
  ]  # fmt: skip
  for (layout, layers, k), r in mesh_rows.items():
    lines.append(
      f"| {layout} | {layers} | {k} | {r['A'] / MIB:.2f} | {r['ref_scan'] / MIB:.2f} |"
      f" {r['ga'] / MIB:.2f} | {r['ga_carried'] / MIB:.2f} |"
      f" {(r['ga'] - r['ref_scan']) / r['A']:+.2f} A | {(r['ga_carried'] - r['ref_scan']) / r['A']:+.2f} A |"
    )
  return "\n".join(lines)


MIB = 2**20


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None, help="folder for stacked_memory.json and .md")
  args = ap.parse_args(argv)
  rows = {(f, n, k): stacked_bytes(f, n, k) for f in FRONTS for n in (4, 8) for k in (8, 32)}
  mesh_rows = {
    (layout, n, k): mesh_stacked_bytes(layout, n, k)
    for layout in ("replicated", "fsdp") for n in (4, 8) for k in (8, 32)
  }  # fmt: skip
  meta = {"backend": jax.default_backend(), "jax": jax.__version__, "optax": optax.__version__,
          "python": platform.python_version(), "inner": "adam", "d": 256, "b": 16}  # fmt: skip
  md = (
    "# Stacked layers: compiled memory of one window\n\n"
    f"Peak of one donated call above the plain one-micro-batch step, in A (one float32 copy of"
    f" the params); L checkpointed tanh blocks of width 256 under one scan, b = 16, adam. jax"
    f" {meta['jax']}, {meta['backend']}.\n\n" + report(rows, mesh_rows) + "\n"
  )
  print(md)
  if args.out:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key = lambda t: "/".join(map(str, t))  # noqa: E731
    (out / "stacked_memory.json").write_text(json.dumps({
      "meta": meta, "rows": {key(t): r for t, r in rows.items()},
      "mesh_rows": {key(t): r for t, r in mesh_rows.items()},
    }, indent=2))  # fmt: skip
    (out / "stacked_memory.md").write_text(md)


if __name__ == "__main__":
  main()


def streaming_stacked_bytes(layers: int = 8, k: int = 8, d: int = 256, b: int = 16) -> dict:
  """One donated call per micro-batch on the stacked model (adam): ``plain`` (jax.grad and the
  update), ``micro`` and ``micro_carried`` (``ga.micro_step``, ``grads_in_place`` True and
  False), and ``ref_call``, the hand-written floor of a call that does not close the window:
  params, adam's state and the accumulator donated, the backward pass adding into the
  accumulator's buffer; ``"A"``."""
  params, loss_fn, micro = stacked(layers, d, b)
  inner = optax.adam(1e-3)
  tx = ga.accumulate(inner, k)
  state = jax.eval_shape(inner.init, params)
  out = {"A": sum(x.size * 4 for x in jax.tree.leaves(params))}
  donated = jax.jit(plain(loss_fn, inner), donate_argnums=(0, 1))
  out["plain"] = memory_floor.peak(donated.lower(params, state, micro).compile())
  for name, in_place in (("micro", True), ("micro_carried", False)):
    step = ga.micro_step(loss_fn, tx, donate=True, grads_in_place=in_place)
    out[name] = memory_floor.peak(
      step.lower(params, jax.eval_shape(step.init, params), micro).compile()
    )

  def ref_call(params, state, acc, mb):
    refs = jax.tree.map(jax.new_ref, acc)
    loss, vjp_fn = jax.vjp(lambda q: loss_fn(q, mb), params)
    vjp_fn.with_refs(refs)(jnp.ones_like(loss))
    return params, state, jax.tree.map(jax.freeze, refs), loss

  floor = jax.jit(ref_call, donate_argnums=(0, 1, 2))
  out["ref_call"] = memory_floor.peak(floor.lower(params, state, params, micro).compile())
  return out
