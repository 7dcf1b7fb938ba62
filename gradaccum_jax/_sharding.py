"""Data-parallel and sharded-parameter accumulation: one reduction per window.

``jax.jit`` of a ``lax.scan`` over a batch sharded on a ``data`` axis leaves the
partitioning to GSPMD, which all-gathers the batch before the loop and
all-reduces the gradient inside it, once per micro-batch. Here the scan runs
under ``jax.shard_map`` instead: every device splits its own rows into the ``k``
micro-batches and accumulates their gradients locally, with the params and the
accumulator cast to device-varying (``jax.lax.pcast(..., to="varying")``) so
that differentiating replicated params inserts no ``psum`` into the loop body.
The sums are reduced once, after the loop: one ``psum`` (gradients of
replicated params, loss, weight and aux sums together) and, for params sharded
over the data axes, one ``psum_scatter`` per such param. The window is then
closed outside the ``shard_map``, by the jitted (GSPMD) program, on the reduced
gradient.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gradaccum_jax._checks import check_batch, is_inexact
from gradaccum_jax._parts import Sums, Weighting


@dataclasses.dataclass(frozen=True)
class DataParallel:
  """Where the batch and the params live: a mesh, its data axes and the params' specs."""

  mesh: jax.sharding.Mesh
  axes: tuple[str, ...]  # the mesh axes the batch's leading dimension is split over
  param_specs: Any  # a pytree prefix of PartitionSpecs for the params (None: replicated)

  @property
  def size(self) -> int:
    """The number of devices the batch is split over."""
    return math.prod(self.mesh.shape[a] for a in self.axes)

  @property
  def batch_spec(self) -> P:
    return P(self.axes[0] if len(self.axes) == 1 else self.axes)


def make_data_parallel(
  mesh: Any, data_axis: Any, param_specs: Any, where: str
) -> DataParallel | None:
  """Checks ``mesh``/``data_axis``/``param_specs``; None without a mesh."""
  if mesh is None:
    if data_axis is not None or param_specs is not None:
      given = "data_axis" if data_axis is not None else "param_specs"
      raise ValueError(
        f"{where}: {given}= needs mesh=, the jax.sharding.Mesh the batch is sharded over,"
        f" e.g. mesh=jax.make_mesh((jax.device_count(),), ('data',))."
      )
    return None
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(
      f"{where}: mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((8,), ('data',))),"
      f" got {type(mesh).__name__}."
    )
  if data_axis is None:
    data_axis = "data"
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
  return DataParallel(mesh, axes, param_specs)


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes over which ``x`` may differ between devices (inside shard_map)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # jax >= 0.10: the manual axis type
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def to_varying(tree: Any, axes: tuple[str, ...]) -> Any:
  """Casts every array leaf of ``tree`` to device-varying over ``axes`` (inside shard_map).

  A value that is invariant over a manual axis and then differentiated against
  a varying loss gets its cotangent ``psum``-ed: cast before the scan, the
  params' gradients stay per-device and the loop body has no collective.
  """

  def cast(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def _place(x: Any, mesh: jax.sharding.Mesh, spec: P) -> Any:
  """Constrains ``x`` to ``NamedSharding(mesh, spec)`` (a reshard on explicit meshes)."""
  sharding = NamedSharding(mesh, spec)
  if any(t == AxisType.Explicit for t in mesh.axis_types):
    return jax.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


@dataclasses.dataclass(frozen=True)
class _LeafPlan:
  spec: P
  dim: int | None  # the sharded dimension, None for a replicated leaf
  names: tuple[str, ...]  # the mesh axes that dimension is sharded over
  rest: tuple[str, ...]  # the data axes the leaf is replicated over


def _leaf_plans(dp: DataParallel, params: Any) -> list[_LeafPlan]:
  """One plan per params leaf from ``dp.param_specs`` (a pytree prefix of the params)."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if dp.param_specs is None:
    return [_LeafPlan(P(), None, (), dp.axes) for _ in leaves]
  try:
    specs = jax.tree.broadcast(
      dp.param_specs, params, is_leaf=lambda s: s is None or isinstance(s, P)
    )
  except (ValueError, TypeError) as e:
    raise ValueError(
      "param_specs must be a PartitionSpec, or a pytree prefix of the params with"
      f" PartitionSpec (or None) leaves; params: {jax.tree.structure(params)}. ({e})"
    ) from None
  specs = jax.tree.leaves(specs, is_leaf=lambda s: s is None or isinstance(s, P))
  plans = []
  for (path, x), spec in zip(leaves, specs, strict=True):
    name = jax.tree_util.keystr(path) or "params"
    spec = P() if spec is None else spec
    if not isinstance(spec, P):
      raise TypeError(f"param_specs for {name} must be a PartitionSpec or None, got {spec!r}.")
    shape = jnp.shape(x)
    if len(spec) > len(shape):
      raise ValueError(f"param_specs for {name} is {spec}, longer than its shape {shape}.")
    sharded = [(d, e) for d, e in enumerate(spec) if e is not None]
    if len(sharded) > 1:
      raise ValueError(
        f"param_specs for {name} is {spec}: it shards {len(sharded)} dimensions; shard at most"
        " one dimension of each param (e.g. P('data') for its leading dimension)."
      )
    if not sharded:
      plans.append(_LeafPlan(P(), None, (), dp.axes))
      continue
    dim, entry = sharded[0]
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    outside = [n for n in names if n not in dp.axes]
    if outside:
      raise ValueError(
        f"param_specs for {name} is {spec}, sharded over {', '.join(map(repr, outside))},"
        f" which is not a data axis (data_axis={dp.axes}). Params can only be sharded over"
        " axes the batch is split over; add the axis to data_axis, or replicate the param."
      )
    parts = math.prod(dp.mesh.shape[n] for n in names)
    if shape[dim] % parts:
      raise ValueError(
        f"param_specs for {name} is {spec}: its dimension {dim} has size {shape[dim]}, not"
        f" divisible by the {parts} devices of {names}. Shard another dimension or"
        " replicate it (P())."
      )
    rest = tuple(a for a in dp.axes if a not in names)
    plans.append(_LeafPlan(spec, dim, names, rest))
  return plans


def _check_global_batch(batch: Any, dp: DataParallel, k: int) -> None:
  batch_size = check_batch(batch, 1)
  if batch_size % (dp.size * k):
    raise ValueError(
      f"The global batch size B={batch_size} is not divisible by {dp.size * k} = {dp.size}"
      f" devices on the data axes {dp.axes} x num_microbatches k={k}: every device splits"
      f" its B / {dp.size} rows into {k} micro-batches. Use a batch size that is a multiple"
      f" of {dp.size * k}."
    )


def over_mesh(
  dp: DataParallel,
  local_sums: Callable[..., Any],
  weighting: Weighting,
  k: int,
  params: Any,
  batch: Any,
  rng: jax.Array | None,
  acc_init: Any,
  model_state: Any,
  scale: jax.Array | None,
  num_real: jax.Array | None,
) -> Any:
  """Runs ``local_sums`` on every device's rows under ``shard_map``, then reduces once.

  ``local_sums(params, batch, rng, acc0, model_state, scale, num_real, vary_axes)`` is the
  single-device scan (it returns a ``Window``); it runs with the params gathered once and
  cast to device-varying, so its loop body has no collective. After it: one ``psum`` of
  everything additive (the gradients of replicated params, :class:`Sums` and
  :class:`NoiseSums`), one ``psum_scatter`` per sharded param, float model-state leaves
  averaged and integer ones maxed where they differ between devices. Returns the
  ``Window`` of the whole global batch, its gradients added to ``acc_init``.
  """
  _check_global_batch(batch, dp, k)
  axes, mesh = dp.axes, dp.mesh
  plans = _leaf_plans(dp, params)
  treedef = jax.tree.structure(params)
  param_specs = treedef.unflatten([p.spec for p in plans])
  acc_like = [
    jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(acc_init)
  ]
  static = {}

  def per_device(params, batch, rng, model_state, scale, num_real):
    leaves = [
      x if p.dim is None else jax.lax.all_gather(x, p.names, axis=p.dim, tiled=True)
      for x, p in zip(jax.tree.leaves(params), plans, strict=True)
    ]
    full = treedef.unflatten(leaves)  # gathered once, before the scan
    if rng is not None:
      rng = jax.random.fold_in(rng, jax.lax.axis_index(axes))
    acc0 = treedef.unflatten([jnp.zeros(a.shape, a.dtype) for a in acc_like])
    w = local_sums(full, batch, rng, acc0, model_state, scale, num_real, axes)
    static["window"] = w
    grads = jax.tree.leaves(w.sums.grads)
    # One psum for everything additive and replicated: XLA emits one (tuple) all-reduce.
    replicated = [g for g, p in zip(grads, plans, strict=True) if p.dim is None]
    replicated, sums, noise = jax.lax.psum((replicated, w.sums._replace(grads=()), w.noise), axes)
    it = iter(replicated)
    out = []
    for g, p in zip(grads, plans, strict=True):
      if p.dim is None:
        out.append(next(it))
        continue
      g = jax.lax.psum_scatter(g, p.names, scatter_dimension=p.dim, tiled=True)
      out.append(jax.lax.psum(g, p.rest) if p.rest else g)
    sums, noise = weighting.per_device(
      sums._replace(grads=treedef.unflatten(out)), noise, dp.size, w.num
    )
    return sums, noise, _reduce_state(w.model_state, axes)

  batch_spec = dp.batch_spec
  args = (params, batch, rng, model_state, scale, num_real)
  if any(t == AxisType.Explicit for t in mesh.axis_types):
    # On an explicit mesh shard_map wants its inputs already laid out as in_specs.
    args = (
      jax.tree.map(lambda x, s: _place(x, mesh, s), params, param_specs),
      jax.tree.map(lambda x: _place(x, mesh, batch_spec), batch),
      *(jax.tree.map(lambda x: _place(x, mesh, P()), a) for a in args[2:]),
    )
  reduce = jax.shard_map(
    per_device,
    mesh=mesh,
    in_specs=(param_specs, batch_spec, P(), P(), P(), P()),
    out_specs=(Sums(param_specs, P(), P(), P()), P(), P()),
  )
  sums, noise, new_state = reduce(*args)
  grads = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc_init, sums.grads)
  return static["window"]._replace(
    sums=sums._replace(grads=grads),
    noise=noise,
    model_state=new_state,
    num=k if num_real is None else num_real,
  )


def _reduce_state(model_state: Any, axes: tuple[str, ...]) -> Any:
  """Float leaves averaged over the devices where they differ; integer, bool (and PRNG key)
  leaves maxed."""

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
  specs = [p.spec for p in _leaf_plans(dp, tree)]
  leaves = [_place(x, dp.mesh, s) for x, s in zip(jax.tree.leaves(tree), specs, strict=True)]
  return jax.tree.structure(tree).unflatten(leaves)
