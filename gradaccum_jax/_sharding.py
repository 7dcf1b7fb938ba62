"""Data-parallel and sharded-parameter accumulation: one reduction per window.

Each device scans its rows under ``jax.shard_map`` over the data axes only (others stay GSPMD's),
params device-varying so the loop has no collective; one ``psum`` follows. FSDP params gather,
and their gradients reduce-scatter, once or per micro-batch (``gather_params``). See
docs/data_parallel.md and docs/architecture.md."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gradaccum_jax._checks import check_batch, check_choice, is_inexact
from gradaccum_jax._memory import device_memory_budget
from gradaccum_jax._parts import (
  COLLECTIVES,
  Inputs,
  Static,
  Sums,
  Window,
)

GATHER_POLICIES = ("once", "per_microbatch", "auto")


@dataclasses.dataclass(frozen=True)
class DataParallel:
  """A mesh, its data axes, the params' specs, and how params sharded over data axes gather."""

  mesh: jax.sharding.Mesh
  axes: tuple[str, ...]  # the mesh axes the batch's leading dimension is split over
  param_specs: Any  # a pytree prefix of PartitionSpecs for the params (None: replicated)
  gather: str = "once"  # one of GATHER_POLICIES
  budget: int | None = None  # bytes per device, for gather="auto"

  @property
  def size(self) -> int:
    """The number of devices the batch is split over."""
    return math.prod(self.mesh.shape[a] for a in self.axes)

  @property
  def batch_spec(self) -> P:
    return P(self.axes[0] if len(self.axes) == 1 else self.axes)


def make_data_parallel(
  mesh: Any,
  data_axis: Any,
  param_specs: Any,
  where: str,
  gather_params: str = "once",
  memory_budget_bytes: int | None = None,
) -> DataParallel | None:
  """Checks ``mesh``/``data_axis``/``param_specs``/``gather_params``; None without a mesh."""
  check_choice(gather_params, "gather_params", GATHER_POLICIES, where)
  if mesh is None:
    given = [
      n for n, v in (("data_axis", data_axis), ("param_specs", param_specs)) if v is not None
    ]
    if gather_params != "once":
      given.append("gather_params")
    if given:
      raise ValueError(
        f"{where}: {given[0]}= needs mesh=, the jax.sharding.Mesh the batch is sharded over,"
        f" e.g. mesh=jax.make_mesh((jax.device_count(),), ('data',))."
      )
    return None
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(
      f"{where}: mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((8,), ('data',))),"
      f" got {type(mesh).__name__}."
    )
  data_axis = "data" if data_axis is None else data_axis
  axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
  if not axes or not all(isinstance(a, str) for a in axes) or len(set(axes)) != len(axes):
    raise TypeError(
      f"{where}: data_axis must be a mesh axis name or a tuple of distinct names, got"
      f" {data_axis!r}."
    )
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise ValueError(
      f"{where}: data_axis={data_axis!r} names {', '.join(map(repr, missing))}, which the"
      f" mesh does not have; its axes are {dict(mesh.shape)}. Pass data_axis= one of"
      f" {', '.join(map(repr, mesh.axis_names))} (or a tuple of them): the axes the batch's"
      " leading dimension is sharded over."
    )
  budget = None
  if gather_params == "auto":
    needs = f"{where}: gather_params='auto' compares the policies' compiled memory with a budget"
    budget = int(memory_budget_bytes or device_memory_budget(mesh.devices.flat[0], needs))
  return DataParallel(mesh, axes, param_specs, gather_params, budget)


def check_global_batch(batch: Any, dp: Any, k: int) -> None:
  """``batch``'s size, a multiple of the ``dp.size`` data-parallel devices times ``k``."""
  batch_size = check_batch(batch, 1)
  if batch_size % (dp.size * k):
    raise ValueError(
      f"The global batch size B={batch_size} is not divisible by {dp.size * k} = {dp.size}"
      f" devices on the data axes {dp.axes} x num_microbatches k={k}: every device splits"
      f" its B / {dp.size} rows into {k} micro-batches. Use a batch size that is a multiple"
      f" of {dp.size * k}."
    )


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes over which ``x`` may differ between devices (inside shard_map)."""
  mat = getattr(jax.typeof(x), "mat", None)  # the manual axis type
  return frozenset(() if mat is None else mat.varying)


def to_varying(tree: Any, axes: tuple[str, ...]) -> Any:
  """Casts ``tree``'s array leaves to device-varying over ``axes`` (inside shard_map): an
  invariant value's cotangent would be ``psum``-ed, so the loop body has no collective."""

  def cast(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def place(x: Any, mesh: jax.sharding.Mesh, spec: P) -> Any:
  """Constrains ``x`` to ``NamedSharding(mesh, spec)`` (a reshard on explicit meshes)."""
  constrain = jax.reshard if _explicit(mesh) else jax.lax.with_sharding_constraint
  return constrain(x, NamedSharding(mesh, spec))


def _rows_and_rest(dp: DataParallel, batch: Any, rest: Sequence[Any]) -> tuple[Any, list]:
  """On an explicit mesh, ``batch`` split over the data axes and each tree of ``rest`` replicated
  over them only: a leaf sharded over a model axis keeps it."""

  def off_data(x):
    kept = [tuple(n for n in _names(e) if n not in dp.axes) for e in jax.typeof(x).sharding.spec]
    return place(x, dp.mesh, P(*[None if not n else n[0] if len(n) == 1 else n for n in kept]))

  batch = jax.tree.map(lambda x: place(x, dp.mesh, dp.batch_spec), batch)
  return batch, [jax.tree.map(off_data, a) for a in rest]


# Before jax 0.11 a shard_map manual over some axes of a mesh with other Explicit axes replicates
# its operands and results over those: an all-gather of every model-sharded param into it and
# of every gradient out of it (tests/test_flax_mesh.py counts them). Run there with those axes
# Auto, the results typed as they would be; from 0.11 on the shard_map keeps their sharding.
_REPLICATES_EXPLICIT_AXES = tuple(map(int, jax.__version__.split(".")[:2])) < (0, 11)


def shard_map_over_data(fn: Callable[..., Any], dp: DataParallel, in_specs: Any, out_specs: Any):
  """``jax.shard_map(fn)`` manual over ``dp``'s data axes, the others left to GSPMD; every mesh code
  path of the package goes through it."""

  def over(mesh):
    return jax.shard_map(
      fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(dp.axes)
    )

  mesh = dp.mesh
  model = tuple(
    a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if a not in dp.axes and t == AxisType.Explicit
  )  # fmt: skip
  if not (model and _REPLICATES_EXPLICIT_AXES):
    return over(mesh)

  def in_auto(*args):  # the mesh in context there, its model axes Auto
    return over(jax.sharding.get_abstract_mesh())(*args)

  def call(*args):
    # Traced as it is first: a mistake in fn raises here, as it would from jax 0.11 on.
    specs = jax.tree.map(lambda s: s.sharding.spec, jax.eval_shape(over(mesh), *args))
    try:
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return jax.sharding.auto_axes(in_auto, axes=model, out_sharding=specs)(*args)
    except ValueError:  # fn names a model axis (out_sharding=): it needs them Explicit
      return over(mesh)(*args)

  return call


def _explicit(mesh: Any) -> bool:
  return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _names(entry: Any) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _per_leaf(fn: Callable[[Any, Any], Any], tree: Any, plans: Sequence[Any]) -> Any:
  leaves = [fn(x, p) for x, p in zip(jax.tree.leaves(tree), plans, strict=True)]
  return jax.tree.structure(tree).unflatten(leaves)


@dataclasses.dataclass(frozen=True)
class _LeafPlan:
  """How one params leaf crosses the data axes (the library's) and the others (GSPMD's)."""

  spec: P  # its full PartitionSpec, data and model axes
  dim: int | None  # the dimension sharded over data axes, None if replicated over them
  names: tuple[str, ...]  # the data axes that dimension is sharded over
  rest: tuple[str, ...]  # the data axes the leaf is replicated over
  parts: int = 1  # devices along ``names``
  model: bool = False  # whether the spec also names non-data (model) axes
  outside: bool = False  # gathered by GSPMD before the shard_map (see gather), summed after

  @property
  def manual(self) -> P:
    """The spec over the data axes only: the leaf's ``shard_map`` out spec."""
    return P(*[e if d == self.dim else None for d, e in enumerate(self.spec)])

  @property
  def model_spec(self) -> P:
    """The spec without its data axes: the leaf's layout once gathered over them."""
    return P(*[None if d == self.dim else e for d, e in enumerate(self.spec)])

  def gather(self, x: jax.Array) -> jax.Array:
    """The full leaf from this device's shard (inside shard_map)."""
    if self.dim is None:
      return x
    if not self.model:
      return jax.lax.all_gather(x, self.names, axis=self.dim, tiled=True)
    # XLA's partitioner replicates a manual all-gather's operand over the auto (model) axes
    # first; a psum of the zero-padded shard keeps the model sharding (twice the bytes).
    size = x.shape[self.dim]
    full = (*x.shape[: self.dim], size * self.parts, *x.shape[self.dim + 1 :])
    # The zeros take the shard's sharding (on an explicit mesh the update's type must match).
    zeros = jnp.zeros(full, x.dtype, out_sharding=jax.typeof(x).sharding)
    index = jax.lax.axis_index(self.names) * size
    padded = jax.lax.dynamic_update_slice_in_dim(zeros, x, index, self.dim)
    return jax.lax.psum(padded, self.names)

  def scatter(self, g: jax.Array) -> jax.Array:
    """This device's shard of ``g`` summed over ``names`` (a reduce-scatter)."""
    # A psum and a slice (twice the bytes) for a model-sharded leaf, and on a mesh with other
    # Explicit axes, where JAX 0.12 cannot lower the reduce-scatter (docs/architecture.md).
    if self.model or _explicit(getattr(jax.typeof(g).sharding, "mesh", None)):
      return self.take(jax.lax.psum(g, self.names))
    return jax.lax.psum_scatter(g, self.names, scatter_dimension=self.dim, tiled=True)

  def seed(self, acc: jax.Array, factor: int) -> jax.Array:
    """This device's start from its shard ``acc`` of the sums so far (zeros, or an open window):
    ``acc * factor`` on the first device of ``rest``, zeros on the others, so the reduction over
    ``rest`` counts it once."""
    share = acc if factor == 1 else acc * factor
    if not self.rest:
      return share
    return jnp.where(jax.lax.axis_index(self.rest) == 0, share, jnp.zeros_like(acc))

  def take(self, g: jax.Array) -> jax.Array:
    """This device's shard of a full, already summed ``g``."""
    size = g.shape[self.dim] // self.parts
    return jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(self.names) * size, size, self.dim)


def leaf_plans(dp: DataParallel, params: Any) -> list[_LeafPlan]:
  """One plan per params leaf from ``dp.param_specs`` (a pytree prefix of the params)."""
  try:
    specs = jax.tree.broadcast(
      dp.param_specs, params, is_leaf=lambda s: s is None or isinstance(s, P)
    )
  except (ValueError, TypeError) as e:
    raise ValueError(
      "param_specs must be a PartitionSpec, or a pytree prefix of the params with"
      f" PartitionSpec (or None) leaves; params: {jax.tree.structure(params)}. ({e})"
    ) from None
  # One spec per params leaf: flattened up to the params' structure, so a None hole of the
  # params (an equinox partition) stays a hole and a None spec over a leaf means replicated.
  specs = jax.tree.structure(params).flatten_up_to(specs)
  return [
    _leaf_plan(dp, jax.tree_util.keystr(path) or "params", jnp.shape(x), spec)
    for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(params), specs, strict=True)
  ]


def _leaf_plan(dp: DataParallel, name: str, shape: tuple[int, ...], spec: Any) -> _LeafPlan:
  spec = P() if spec is None else spec
  if not isinstance(spec, P):
    raise TypeError(f"param_specs for {name} must be a PartitionSpec or None, got {spec!r}.")
  if len(spec) > len(shape):
    raise ValueError(f"param_specs for {name} is {spec}, longer than its shape {shape}.")
  unknown = [n for e in spec for n in _names(e) if n not in dp.mesh.axis_names]
  if unknown:
    raise ValueError(
      f"param_specs for {name} is {spec}: {', '.join(map(repr, unknown))} is not an axis of"
      f" the mesh {dict(dp.mesh.shape)}."
    )
  data_dims = [(d, _names(e)) for d, e in enumerate(spec) if set(_names(e)) & set(dp.axes)]
  for d, names in data_dims:
    model = [n for n in names if n not in dp.axes]
    if model:
      data = [n for n in names if n in dp.axes]
      raise ValueError(
        f"param_specs for {name} is {spec}: its dimension {d} is split over the data axes"
        f" {tuple(data)} and the non-data axes {tuple(model)} in one entry. The data axes"
        " are gathered and reduced by the library, the others are left to GSPMD, so one"
        " dimension cannot mix them: shard different dimensions, e.g."
        f" P('{data[0]}', '{model[0]}'), or replicate the param over the data axes."
      )
  model = any(n not in dp.axes for e in spec for n in _names(e))
  if len(data_dims) > 1:
    raise ValueError(
      f"param_specs for {name} is {spec}: it shards {len(data_dims)} dimensions over the"
      f" data axes {dp.axes}; shard at most one dimension of each param over them (e.g."
      " P('data') for its leading dimension)."
    )
  dim, names = data_dims[0] if data_dims else (None, ())
  parts = math.prod(dp.mesh.shape[n] for n in names)
  if dim is not None and shape[dim] % parts:
    raise ValueError(
      f"param_specs for {name} is {spec}: its dimension {dim} has size {shape[dim]}, not"
      f" divisible by the {parts} devices of {names}. Shard another dimension or"
      " replicate it (P())."
    )
  rest = tuple(a for a in dp.axes if a not in names)
  return _LeafPlan(spec, dim, names, rest, parts, model)


@dataclasses.dataclass(frozen=True)
class PerMicrobatch:
  """``gather_params="per_microbatch"``: each micro-batch gathers the params' shards, and its
  gradient is reduce-scattered (:meth:`wrap`)."""

  plans: tuple[_LeafPlan, ...]
  axes: tuple[str, ...]

  def gather(self, params: Any, index: jax.Array) -> Any:
    """The full params for micro-batch ``index``, tied to it: XLA would otherwise hoist the
    gathers out of the loop and hold the full params all window."""
    params, _ = jax.lax.optimization_barrier((params, index))
    return to_varying(_per_leaf(lambda x, p: p.gather(x), params, self.plans), self.axes)

  def wrap(self, unit: Any) -> Any:
    """The sums ``unit`` reduce-scattering each micro-batch's gradient of a data-sharded leaf."""
    return dataclasses.replace(
      unit, scatters=tuple(None if p.dim is None else p.scatter for p in self.plans)
    )


def reduce_over_data(
  plans: list[_LeafPlan], grads: list[jax.Array], extra: Any, axes: tuple[str, ...],
  scattered: bool,
) -> tuple[list[jax.Array], Any]:  # fmt: skip
  """The per-device gradient leaves and ``extra`` (additive sums) reduced over the data axes:
  one tuple ``psum`` of ``extra`` and of the gradients of params replicated over the data axes or
  sharded over data and model axes (each device keeps its shard), one reduce-scatter per param
  sharded over data axes only, unless ``scattered`` (reduced in the loop, per micro-batch): then
  only summed over the data axes it is replicated over."""
  whole = [p.dim is None or (p.model and not scattered) for p in plans]
  summed, extra = jax.lax.psum(([g for g, w in zip(grads, whole, strict=True) if w], extra), axes)
  it, out = iter(summed), []
  for g, p, w in zip(grads, plans, whole, strict=True):
    if w:
      g = next(it)
      out.append(g if p.dim is None else p.take(g))
    else:
      g = g if scattered else p.scatter(g)
      out.append(jax.lax.psum(g, p.rest) if p.rest else g)
  return out, extra


def reduce_parts(units: dict, parts: dict, plans, axes, *, scattered=False) -> dict:
  """Each unit's part of a device's window (by name) combined over the data ``axes`` by what its
  ``reduce`` asks (the protocol: ``_parts``): every unit's ``"sum"`` and ``"grads"`` in one
  all-reduce (:func:`reduce_over_data`; integer leaves carried in its float32 by
  :func:`_as_float32_parts`, as an all-reduce has one dtype), with reduce-scatters for the
  gradients of params sharded over the data axes only; ``"max"`` and ``"min"`` one more each per
  dtype; ``"state"`` by :func:`reduce_state`."""
  names = list(units)
  if not names:
    return {}
  asks, finishes = zip(*(units[n].reduce(parts[n]) for n in names), strict=True)
  extra = [a.get("sum", ()) for a in asks]
  grads = [a["grads"] for a in asks if "grads" in a]
  bits = _part_bits(jax.lax.axis_size(axes))
  parts = jax.tree.map(lambda x: _as_float32_parts(x, bits), extra)
  leaves = [x for g in grads for x in jax.tree.leaves(g)]
  summed = []
  if leaves or jax.tree.leaves(parts):  # else no all-reduce at all
    summed, parts = reduce_over_data(list(plans) * len(grads), leaves, parts, axes, scattered)
  extra = jax.tree.map(lambda x, like: _from_float32_parts(x, like, bits), parts, extra)

  def combine(name, t):  # "max", "min" or "state"
    if name == "state":
      return reduce_state(t, axes)
    return COLLECTIVES[name][0](t, axes) if jax.tree.leaves(t) else t

  it, out = iter(summed), []
  for a, finish, total in zip(asks, finishes, extra, strict=True):
    got = {name: combine(name, t) for name, t in a.items() if name in ("max", "min", "state")}
    if "grads" in a:
      got["grads"] = jax.tree.map(lambda _: next(it), a["grads"])
    out.append(finish({**got, "sum": total}))
  return dict(zip(names, out, strict=True))


def _part_bits(devices: int) -> int:
  """The bits of each float32 part of an integer sum over ``devices`` devices: a part is below
  ``2**bits``, so the sum of ``devices`` of them is below ``2**24``, where float32 is exact."""
  return 24 - (devices - 1).bit_length()


def _as_float32_parts(x: jax.Array, bits: int) -> jax.Array:
  """An integer ``x`` as float32 parts of ``bits`` bits of its two's complement (the lowest
  first, on a new leading axis), so that it joins the floats' all-reduce; a float as it is."""
  if not jnp.issubdtype(jnp.result_type(x), jnp.integer) or bits < 1:
    return x
  width = jnp.iinfo(x.dtype).bits
  word = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}"))
  mask = (1 << bits) - 1
  return jnp.stack([((word >> s) & mask).astype(jnp.float32) for s in range(0, width, bits)])


def _from_float32_parts(parts: jax.Array, like: jax.Array, bits: int) -> jax.Array:
  """The integer sum of :func:`_as_float32_parts` summed over the devices: each part's sum an
  exact integer below ``2**24``, shifted back and added modulo ``2**width``, as the integer
  ``psum`` wraps."""
  if not jnp.issubdtype(jnp.result_type(like), jnp.integer) or bits < 1:
    return parts
  width = jnp.iinfo(like.dtype).bits
  unsigned = jnp.dtype(f"uint{width}")
  word = sum(parts[j].astype(unsigned) << (j * bits) for j in range(parts.shape[0]))
  return jax.lax.bitcast_convert_type(word, like.dtype)


@dataclasses.dataclass(frozen=True)
class Devices:
  """The manual data axes a window runs over, inside the step's ``shard_map`` (none on one
  device): the core's every collective goes through them."""

  axes: tuple[str, ...] = ()

  def count(self) -> Any:
    return jax.lax.psum(1, self.axes) if self.axes else 1

  def sum(self, tree: Any) -> Any:
    return jax.lax.psum(tree, self.axes) if self.axes else tree

  def varying(self, tree: Any) -> Any:
    """``tree`` device-varying: its cotangents are not summed over the devices in the loop."""
    return to_varying(tree, self.axes) if self.axes else tree

  def reduce(self, units: dict, parts: dict) -> dict:
    """Each unit's part combined over the devices as it asks (:func:`reduce_parts`)."""
    return reduce_parts(units, parts, (), self.axes) if self.axes else parts

  def shapes(self, fn: Callable[..., Any], args: tuple, where: str) -> Any:
    """The shapes of ``fn(*args)`` (a micro-batch's pass, traced once); with axes, a ValueError
    for a loss that calls ``jax.shard_map`` inside the step's own over the data axes."""
    if not self.axes:
      return jax.eval_shape(fn, *args)
    return _shapes_refusing_nested_shard_map(fn, args, self.axes, where)


ONE_DEVICE = Devices()


def _shapes_refusing_nested_shard_map(fn: Callable[..., Any], args: tuple, axes: tuple, where: str):
  """The shapes of ``fn(*args)``, or a ValueError for a loss that calls ``jax.shard_map`` itself
  inside the step's own ``shard_map`` over the data ``axes``: JAX cannot lower that nesting (a
  context-mesh mismatch, or a Shardy verifier error that names neither cause nor fix)."""
  try:
    jaxpr, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    nested = "shard_map" in str(jaxpr)
  except ValueError as e:  # the nested call may fail while it is traced
    if "shard_map" not in str(e):
      raise
    nested = True
  if nested:
    raise ValueError(
      f"{where}: loss_fn calls jax.shard_map inside the step's mesh=, where the data axes"
      f" {axes} are already manual (the step's own shard_map runs each device's micro-batches),"
      " and JAX cannot lower a shard_map nested there. Leave the model axes to GSPMD instead:"
      " shard the params over them with param_specs= and write loss_fn without shard_map"
      " (docs/data_parallel.md, 'Model axes'); or call the step without mesh=."
    )
  return shapes


def over_mesh(dp: DataParallel, core: Any, inputs: Inputs, acc_init: Any, in_buffer=False) -> Any:
  """Runs ``core.window`` (a ``_microbatch.Core``'s scan on one device) on every device's rows under
  ``shard_map``, then reduces once (:func:`reduce_parts`)."""
  if dp.gather not in ("once", "per_microbatch"):
    raise ValueError(
      f"gather_params={dp.gather!r} is chosen by the jitted step (ga.train_step and the"
      " Linen/NNX steps); here pass 'once' or 'per_microbatch'."
    )
  check_global_batch(inputs.batch, dp, core.num_microbatches)
  per_mb = dp.gather == "per_microbatch"
  plans = tuple(
    dataclasses.replace(p, outside=p.dim is not None and p.model and not per_mb)
    for p in leaf_plans(dp, inputs.params)
  )
  treedef = jax.tree.structure(inputs.params)
  acc_leaves = tuple(jax.tree.leaves(acc_init))
  # Seeded: a device's scan starts from its shard of the accumulator, shaped like its sums (a
  # leaf replicated over the data axes, or sharded over them and reduced per micro-batch).
  seeded = tuple(in_buffer and (p.dim is None or per_mb) for p in plans)
  seed_plans = [p for p, s in zip(plans, seeded, strict=True) if s]
  seeds = tuple(a for a, s in zip(acc_leaves, seeded, strict=True) if s)
  per_device = _OverMesh(dp, core, plans, acc_leaves, seeded)
  inputs, seeds = _laid_out(dp, plans, inputs, seeds, seed_plans)
  params_in = treedef.unflatten([P() if p.outside else p.manual for p in plans])
  in_specs = (
    Inputs(params_in, dp.batch_spec, P(), P(), P(), P()),
    tuple(p.manual for p in seed_plans),
  )
  # The sums' gradients as the params are laid out; every other part is replicated (reduced).
  out_specs = ((Sums(treedef.unflatten([p.manual for p in plans]), P(), P(), P()), P(), P()), P())
  (sums, rest, before), like = shard_map_over_data(per_device, dp, in_specs, out_specs)(
    inputs, seeds
  )
  grads = treedef.unflatten([
    g if s else a + g.astype(a.dtype)
    for a, g, s in zip(acc_leaves, jax.tree.leaves(sums.grads), seeded, strict=True)
  ])  # fmt: skip
  num = core.num_microbatches if inputs.num_real is None else inputs.num_real
  parts = {"sums": sums._replace(grads=grads), **rest}
  return Window(parts, *like.value[0], num, core.reducers, before=before)


@dataclasses.dataclass(frozen=True)
class _OverMesh:
  """:func:`over_mesh`'s body on one device: its rows' scan, then the reduction over devices;
  returns ``(the sums, the other parts by name, what the window computed before its loop)`` and
  one micro-batch's loss and aux shapes (a ``_parts.Static``)."""

  dp: DataParallel
  core: Any  # a _microbatch.Core
  plans: tuple[_LeafPlan, ...]
  acc_leaves: tuple[Any, ...]  # the accumulator the window's gradients are added to
  seeded: tuple[bool, ...]  # per leaf: whether the scan starts from this device's share of it

  def __call__(self, inputs: Inputs, seeds: tuple) -> tuple[tuple[Sums, tuple], Static]:
    dp, plans, core = self.dp, self.plans, self.core
    params, rng = inputs.params, inputs.rng
    per_mb, treedef = dp.gather == "per_microbatch", jax.tree.structure(params)
    if not per_mb:  # gathered once, before the scan
      params = _per_leaf(lambda x, p: x if p.outside else p.gather(x), params, plans)
    if rng is not None:
      rng = jax.random.fold_in(rng, jax.lax.axis_index(dp.axes))
    # Zeros like the params (on an explicit mesh their model sharding is in the carry's type),
    # or this device's share of the seeds.
    it, factor = iter(seeds), core.summed_units(self.acc_leaves)["sums"].seed_factor(dp.size)
    acc0 = treedef.unflatten([
      p.seed(next(it), factor) if s else jnp.zeros_like(x, jnp.result_type(a))
      for x, a, p, s in zip(jax.tree.leaves(params), self.acc_leaves, plans, self.seeded, strict=True)
    ])  # fmt: skip
    hook = PerMicrobatch(plans, dp.axes) if per_mb else None
    inputs = inputs._replace(params=params, rng=rng)
    units = core.units(inputs.model_state, acc0, hook)
    w = core.window(inputs, acc0, devices=Devices(dp.axes), per_micro=hook, units=units)
    parts = reduce_parts(units, w.parts, plans, dp.axes, scattered=per_mb)
    parts = {name: unit.share(parts[name], dp.size) for name, unit in units.items()}
    sums = parts.pop("sums")
    return (sums, parts, w.before), Static.shapes((w.loss_like, w.aux_like))


def _laid_out(dp: DataParallel, plans, inputs: Inputs, seeds: tuple, seed_plans: list) -> tuple:
  """``over_mesh``'s inputs laid out for its ``shard_map``: params ``outside`` gathered over the
  data axes; on an explicit mesh all as the in_specs say, the rest replicated over them only."""
  mesh, explicit = dp.mesh, _explicit(dp.mesh)
  params, batch, *rest = inputs
  if explicit or any(p.outside for p in plans):
    params = _per_leaf(
      lambda x, p: place(x, mesh, p.model_spec if p.outside else p.spec), params, plans
    )
  if explicit:
    batch, rest = _rows_and_rest(dp, batch, rest)
    seeds = tuple(place(a, mesh, p.spec) for a, p in zip(seeds, seed_plans, strict=True))
  return Inputs(params, batch, *rest), seeds


def reduce_state(model_state: Any, axes: tuple[str, ...]) -> Any:
  """Float leaves averaged over the devices where they differ; int, bool and key leaves maxed."""

  def reduce(x):
    vary = tuple(a for a in axes if a in varying_axes(x))
    if not vary:
      return x
    if is_inexact(x):
      return jax.lax.pmean(x, vary)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # equal on every device in practice
      return jax.random.wrap_key_data(
        jax.lax.pmax(jax.random.key_data(x), vary), impl=jax.random.key_impl(x)
      )
    if jnp.result_type(x) == jnp.bool_:
      return jax.lax.pmax(x.astype(jnp.int32), vary).astype(jnp.bool_)
    return jax.lax.pmax(x, vary)

  return jax.tree.map(reduce, model_state)


def place_params(dp: DataParallel | None, tree: Any) -> Any:
  """Constrains a params-shaped ``tree`` to the params' sharding (replicated by default)."""
  if dp is None:
    return tree
  return _per_leaf(lambda x, p: place(x, dp.mesh, p.spec), tree, leaf_plans(dp, tree))


def on_the_params_mesh(state: Any, params: Any) -> Any:
  """``state`` with every concrete array that is not on the params' mesh (the counters, the
  inner optimizer's own ``count``) placed there, replicated: a checkpoint restored onto
  ``tx.init(params)``'s shardings then finds every leaf on one set of devices."""

  def concrete(x):
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)

  def named(x):
    return concrete(x) and isinstance(x.sharding, jax.sharding.NamedSharding)

  meshes = [x.sharding.mesh for x in jax.tree.leaves(params) if named(x)]
  if not meshes:
    return state
  replicated = NamedSharding(meshes[0], P())
  return jax.tree.map(
    lambda x: jax.device_put(x, replicated) if concrete(x) and not named(x) else x, state
  )


def with_types_of(tree: Any, like: Any) -> Any:
  """``tree`` resharded where a leaf's sharding type differs from ``like``'s (on an explicit
  mesh, a loop's carry must keep its type: an inner state laid out replicated, updated from
  gradients sharded like the params, comes out sharded)."""

  def cast(x, ref):
    want = getattr(jax.typeof(ref), "sharding", None)
    if not _explicit(getattr(want, "mesh", None)):
      return x  # no sharding in the types
    return x if jax.typeof(x).sharding.spec == want.spec else jax.reshard(x, want)

  return jax.tree.map(cast, tree, like)


class Slots:
  """Where ``ga.micro_step`` keeps an open window's sums: with a mesh, one slot per data-parallel
  device (a leading axis of ``D`` sharded over the data axes; their total is the window's), so
  a call adds its rows' sums with no collective; without one, the sums themselves."""

  def __init__(self, dp: DataParallel | None):
    self.dp = dp
    self.devices = 1 if dp is None else dp.size

  def _spec(self, like: P | None = None) -> P:
    return P(self.dp.batch_spec[0], *(like or ()))

  def _specs(self, tree: Any) -> Any:
    return jax.tree.map(lambda _: self._spec(), tree)

  def check_rows(self, rows: int) -> None:
    if rows % self.devices:
      dp = self.dp
      raise ValueError(
        f"micro_step: the micro-batch has {rows} rows, not divisible by the {dp.size} devices"
        f" on the data axes {dp.axes} (mesh {dict(dp.mesh.shape)}): every device takes"
        f" {rows} / {dp.size} of them. Use micro-batches of a multiple of {dp.size} rows."
      )

  def first(self, units: dict, parts: dict, params: Any, reducers: Any) -> dict:
    """A window's ``parts`` (by name) in the first slot, the others empty (an aux leaf's max or
    min at its start; gradients laid out as ``params`` are over the model axes)."""
    if self.dp is None:
      return parts
    mesh = self.dp.mesh

    def one(x, spec=None, fill=0):
      spec = P() if spec is None else spec
      sharding = NamedSharding(mesh, self._spec(spec))
      x = place(jnp.asarray(x), mesh, spec)  # gathered over the data axes
      shape, dtype = (self.devices, *jnp.shape(x)), jnp.result_type(x)
      zeros = jnp.full(shape, fill, dtype, device=sharding)
      if _explicit(mesh):  # a typed sharding
        return zeros.at[0].set(x, out_sharding=sharding)
      return place(zeros.at[0].set(x), mesh, sharding.spec)

    def slotted(x, empty):  # x in the first slot, the others ``empty``
      x, empty = (place(jnp.asarray(v), mesh, P()) for v in (x, empty))
      rest = jnp.broadcast_to(empty, (self.devices - 1, *jnp.shape(x))).astype(x.dtype)
      return place(jnp.concatenate([x[None], rest]), mesh, self._spec())

    sums, others = parts["sums"], {n: p for n, p in parts.items() if n != "sums"}
    grads = _per_leaf(lambda g, p: one(g, p.model_spec), sums.grads, leaf_plans(self.dp, params))
    rest = jax.tree.map(one, sums._replace(grads=(), aux=()))
    others = {n: jax.tree.map(slotted, p, units[n].empty(p)) for n, p in others.items()}
    # Per leaf its reducer's start (0, or the start of a max or min), a scalar: jax 0.10 cannot
    # place an array fill on the slots' sharding.
    records = reducers.records(sums.aux)
    aux = jax.tree.map(lambda x, r: one(x, fill=r.start(jnp.result_type(x))), sums.aux, records)
    return {"sums": rest._replace(grads=grads, aux=aux), **others}

  def local(self, local: Callable[..., Any], inputs: Inputs, own: dict) -> Any:
    """``local(inputs, own, axes) -> (slotted, replicated)`` of a micro-batch
    (``inputs.batch``): with a mesh every device's parts of its rows, in its own slot, with no
    gradient collective (data-sharded params gathered by GSPMD before), and what ``local``
    reduced over the devices itself (the model state)."""
    dp = self.dp
    if dp is None:
      return local(inputs, own, ())
    axes, mesh, plans = dp.axes, dp.mesh, leaf_plans(dp, inputs.params)
    params = _per_leaf(lambda x, p: place(x, mesh, p.model_spec), inputs.params, plans)

    def per_device(inputs, own):
      if inputs.rng is not None:
        inputs = inputs._replace(rng=jax.random.fold_in(inputs.rng, jax.lax.axis_index(axes)))
      own = jax.tree.map(lambda x: x[0], own)
      new, replicated = local(inputs, own, axes)
      return jax.tree.map(lambda x: x[None], new), replicated

    mb, rest = inputs.batch, list(inputs[2:])
    if _explicit(mesh):
      slot, sums = self._spec(), own["sums"]
      grad_specs = _per_leaf(lambda _, p: self._spec(p.model_spec), sums.grads, plans)
      specs = {n: self._specs(x) for n, x in own.items()}
      specs["sums"] = Sums(grad_specs, slot, slot, self._specs(sums.aux))
      own = jax.tree.map(lambda x, s: place(x, mesh, s), own, specs)
      mb, rest = _rows_and_rest(dp, mb, rest)
    own_specs = self._specs(own)
    in_specs = (Inputs(P(), dp.batch_spec, P(), P(), P(), P()), own_specs)
    add = shard_map_over_data(per_device, dp, in_specs, (own_specs, P()))
    return add(Inputs(params, mb, *rest), own)

  def reduce(self, params: Any, units: dict, own: dict) -> dict:
    """The window's parts (``own``: the slotted parts of ``units``, by name): the slots reduced
    (:func:`reduce_parts`: one all-reduce, reduce-scatters for data-sharded params)."""
    dp = self.dp
    if dp is None:
      return own
    plans, treedef = leaf_plans(dp, params), jax.tree.structure(params)

    def per_device(own):
      return reduce_parts(units, jax.tree.map(lambda x: x[0], own), plans, dp.axes)

    out = {n: P() for n in own}
    out["sums"] = jax.tree.map(lambda _: P(), own["sums"])._replace(
      grads=treedef.unflatten([p.manual for p in plans])
    )
    return shard_map_over_data(per_device, dp, (self._specs(own),), out)(own)
