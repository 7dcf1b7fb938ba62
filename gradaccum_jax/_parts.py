"""The parts of a window: one small unit per feature, every stage a map over them by name.

A :class:`Unit` is a record of verbs (its defaults stand for those it leaves out)::

  carry = unit.init(acc_init, like)       # before the loop (``like``: one Micro, abstract)
  carry = unit.update(carry, micro)       # once per micro-batch (a :class:`Micro`)
  part = unit.finalize(carry, num, rows)  # after ``num`` micro-batches of ``rows`` rows
  asks, finish = unit.reduce(part)        # over devices: what each collective combines ...
  part = finish(combined)                 # ... and the window's part from them
  part = unit.share(part, devices)        # linear: a device's share of the sum
  part = unit.merge(part, more)           # two partial windows, ``more`` of later ones
  part = unit.empty(part)                 # a window with nothing in it
  part = unit.held(state); state = unit.hold(state, part)  # an open window's part in a state
  metrics |= unit.metrics(part)           # what the closed window reports

``asks`` maps a collective to a tree: ``"grads"`` (gradient leaves, reduced as their params are
laid out), ``"sum"``, ``"max"``, ``"min"`` and ``"state"`` (model state); a stage combines every
unit's asks at once (``_sharding.reduce_parts``: one all-reduce), device slots (a leading axis)
by the same asks (:func:`over_slots`). A window's parts are a dict keyed by ``unit.name``; a
feature that is off has no unit."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax._checks import check_weight, is_inexact, is_running_mean
from gradaccum_jax._terms import split as split_terms


class Micro(NamedTuple):
  """What one micro-batch gives the units."""

  loss: jax.Array  # its mean loss, as loss_fn returned it
  aux: Any
  grads: Any  # the gradient of loss * scale
  weight: jax.Array  # float32 scalar (1 unweighted)
  model_state: Any  # the model state after it (None without has_state)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Static:
  """A value a traced function returns beside its arrays (a pytree node without leaves: through
  ``jit`` and ``shard_map`` it comes back as it went in), e.g. one micro-batch's shapes."""

  value: Any

  @classmethod
  def shapes(cls, tree: Any, *rest: Any) -> Static:
    """``(tree's shapes and dtypes, *rest)``, without shardings: two traces of one function
    give equal values (a pytree's metadata is compared where a program is resharded)."""
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)
    return cls((like, *rest))


class Inputs(NamedTuple):
  """What a window is computed from, one value through every stage (the scan, the mesh)."""

  params: Any
  batch: Any  # the window's rows (a device's own inside the mesh's shard_map)
  rng: jax.Array | None = None  # micro-batch i gets fold_in(rng, i) (on a mesh, per device)
  model_state: Any = None  # the model state the window starts from (None without has_state)
  scale: jax.Array | None = None  # the loss scale (None without one)
  num_real: Any = None  # how many micro-batches run (None: all k)


class Sums(NamedTuple):
  """The weighted sums every window keeps; additive, so devices reduce them with one psum."""

  grads: Any  # sum_i w_i g_i (times the loss scale), in the accumulator's dtypes
  weight: jax.Array  # sum_i w_i over the micro-batches of positive weight (float32)
  loss: Any  # sum_i w_i L_i, in the loss's precision (at least float32); a tree for terms
  aux: Any  # inexact leaves: sum_i w_i aux_i; integer and bool leaves: sum_i aux_i

  def merged(self, more: Sums, reducers: AuxReducers) -> Sums:
    """These sums and ``more`` (of later micro-batches) as one window's, by the one rule."""
    grads = merge_gradients(self.grads, self.weight, more.grads, more.weight)
    # Promoted: a float64 loss widens a float32 sum that a state was made with.
    loss = jax.tree.map(jnp.add, self.loss, more.loss)
    aux = reducers.merged(self.aux, more.aux, more.weight)
    return Sums(grads, self.weight + more.weight, loss, aux)


@dataclasses.dataclass(frozen=True)
class Overwritten:
  """Params part of which is overwritten once per window, not trained (an adapter's: Flax's fp8
  collection, ``_flax.fp8_overwritten``): that part's "gradient" is its new value, the maximum
  over the window's micro-batches, each differentiated at the whole batch's cotangent scale;
  written after the window, kept if it is voided (docs/usage.md, "FP8")."""

  split: Callable[[Any], tuple[Any, Any]]  # params -> (trained, overwritten)
  join: Callable[[Any, Any, Any], Any]  # (params, trained, overwritten) -> params of its type
  name: str  # what the overwritten part is, for errors
  instead: str  # what a streaming call's user does instead


# Adapters ``(tree, what, where) -> Overwritten | None`` (a ValueError for a tree they cannot
# take), registered by the front ends that define them (:func:`register_overwrite`).
_ADAPTERS: list[Callable[[Any, str, str], Overwritten | None]] = []


def register_overwrite(adapter: Callable[[Any, str, str], Overwritten | None]) -> None:
  _ADAPTERS.append(adapter)


def overwritten(tree: Any, where: str, what: str = "params") -> Overwritten | None:
  """The :class:`Overwritten` an adapter finds in ``tree`` (``what``: its name in errors)."""
  return next((o for o in (a(tree, what, where) for a in _ADAPTERS) if o is not None), None)


def refuse_overwritten(tree: Any, what: str, where: str) -> None:
  """A ValueError, before any work, for an overwritten part in a streaming call's ``tree``."""
  found = overwritten(tree, where, what)
  if found is not None:
    raise ValueError(
      f"{where}: {what} holds {found.name}: its window value is the max over the micro-batches,"
      " each backward pass scaled by the window's total weight, which a call on one"
      f" micro-batch cannot know. {found.instead}"
    )


def sum_dtype(like: Any) -> Any:
  """The dtype a sum of ``like`` values is kept in: float32 or wider, int32 or wider."""
  floor = jnp.float32 if is_inexact(like) else jnp.int32
  return jnp.promote_types(jnp.result_type(like), floor)


def zeros_accumulator(params: Any, accum_dtype: Any) -> Any:
  """Zeros like ``params`` (shapes and shardings, as optax's own state), in ``accum_dtype``'s
  precision (complex for a complex leaf; the params' dtypes if None)."""

  def zeros(p):
    dtype = jnp.result_type(p)
    if accum_dtype is not None:
      complex_leaf = jnp.issubdtype(dtype, jnp.complexfloating)
      dtype = jnp.promote_types(accum_dtype, jnp.complex64) if complex_leaf else accum_dtype
    return jnp.zeros_like(p, dtype)

  return jax.tree.map(zeros, params)


def keeps_running_means(acc: Any) -> bool:
  """Whether any leaf of the accumulator ``acc`` keeps a running mean (:data:`RUNNING_MEAN`)."""
  return any(rule_of(a).running_mean for a in jax.tree.leaves(acc))


def window_means(
  sums: Sums, loss_like: Any, aux_like: Any, reducers: AuxReducers
) -> tuple[jax.Array, Any]:
  """The window's weighted mean loss and its aux as ``reducers`` say, in the dtypes ``loss_fn``
  returned (``*_like``: one micro-batch's)."""
  loss = jax.tree.map(lambda s, x: safe_mean(s, sums.weight).astype(x.dtype), sums.loss, loss_like)
  return loss, reducers.final(sums.aux, sums.weight, aux_like)


def safe_mean(total: jax.Array, weight: jax.Array) -> jax.Array:
  """``total / weight``: 0 where the weight is 0, NaN where it is not finite (a voided window)."""
  mean = jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1).astype(total.dtype), 0)
  return jnp.where(jnp.isfinite(weight), mean, jnp.nan)


def _leading(x: jax.Array, like: jax.Array) -> jax.Array:
  """``x`` (a scalar, or one value per device slot) broadcastable against ``like``."""
  return jnp.reshape(x, jnp.shape(x) + (1,) * (jnp.ndim(like) - jnp.ndim(x)))


class Rule:
  """How an accumulator leaf keeps a window, chosen once per leaf by its dtype (:func:`rule_of`) and
  used by every mode: :data:`SUM` (float32 or wider: ``sum_i w_i g_i``) or :data:`RUNNING_MEAN`
  (a narrower float, whose sum could overflow: the weighted mean, moved in float32 as
  ``optax.MultiSteps`` does)."""

  running_mean = False

  def one(self, acc: jax.Array, g: Any, w: jax.Array, weighted: bool) -> jax.Array:
    return weighted_sum(jnp.zeros_like(acc), g, w, weighted)

  def merge(self, acc: jax.Array, more: Any, frac: jax.Array) -> jax.Array:
    return acc + more.astype(acc.dtype)

  def share(self, acc: jax.Array, devices: int) -> jax.Array:
    return acc / devices

  def addend(self, acc: jax.Array, weight: jax.Array) -> jax.Array:
    return acc

  def from_total(self, total: jax.Array, weight: jax.Array, dtype: Any) -> jax.Array:
    return total


class _RunningMean(Rule):
  running_mean = True

  def one(self, acc: jax.Array, g: Any, w: jax.Array, weighted: bool) -> jax.Array:
    return g

  def merge(self, acc: jax.Array, more: Any, frac: jax.Array) -> jax.Array:
    frac = _leading(frac, acc)  # left as it is for a zero share, even if ``more`` is NaN
    return jnp.where(frac > 0, _toward(acc, more, frac), acc)

  def share(self, acc: jax.Array, devices: int) -> jax.Array:
    return acc  # a mean: the devices' weights say each one's share

  def addend(self, acc: jax.Array, weight: jax.Array) -> jax.Array:
    return acc.astype(jnp.float32) * _leading(weight, acc).astype(jnp.float32)

  def from_total(self, total: jax.Array, weight: jax.Array, dtype: Any) -> jax.Array:
    return safe_mean(total, _leading(weight, total)).astype(dtype)


SUM, RUNNING_MEAN = Rule(), _RunningMean()


def rule_of(acc: Any) -> Rule:
  """The :class:`Rule` of an accumulator leaf (or dtype): :data:`RUNNING_MEAN` for a float
  narrower than float32 (:func:`_checks.is_running_mean`), else :data:`SUM`."""
  return RUNNING_MEAN if is_running_mean(acc) else SUM


def _toward(mean: jax.Array, x: Any, frac: jax.Array) -> jax.Array:
  """The running mean ``mean`` moved the fraction ``frac`` of the way to ``x``, in float32."""
  m = mean.astype(jnp.float32)
  return (m + frac * (jnp.asarray(x).astype(jnp.float32) - m)).astype(mean.dtype)


def merge_gradients(acc: Any, weight: jax.Array, more: Any, more_weight: jax.Array) -> Any:
  """The accumulation rule, shared by every mode: two accumulators of total weights ``weight``
  and ``more_weight`` (scalars, or one per device slot) as one, each leaf by its
  :class:`Rule`."""
  frac = safe_mean(more_weight, weight + more_weight)
  return jax.tree.map(lambda a, b: rule_of(a).merge(a, b, frac), acc, more)


def add_gradients(acc: Any, grads: Any, w: jax.Array, weight: jax.Array, weighted: bool) -> Any:
  """``acc`` (of total weight ``weight``) after one more micro-batch ``grads`` of weight ``w``:
  :func:`merge_gradients` with the micro-batch as a window of its own (``Rule.one``)."""
  one = jax.tree.map(lambda a, g: rule_of(a).one(a, g, w, weighted), acc, grads)
  return merge_gradients(acc, weight, one, counted(w, weighted))


def addends(acc: Any, weight: jax.Array, dtypes: Any = None) -> Any:
  """Each leaf of ``acc`` as its addend of a sum over devices or device slots (``Rule.addend``;
  ``dtypes``: the accumulator's, where a leaf is already a sum in a wider dtype)."""
  dtypes = jax.tree.map(jnp.result_type, acc) if dtypes is None else dtypes
  return jax.tree.map(
    lambda a, d: a if jnp.result_type(a) != d else rule_of(d).addend(a, weight), acc, dtypes
  )


def from_totals(totals: Any, weight: jax.Array, dtypes: Any) -> Any:
  """The window of the summed :func:`addends` ``totals`` of total ``weight``."""
  return jax.tree.map(lambda t, d: rule_of(d).from_total(t, weight, d), totals, dtypes)


def over_slots(units: dict[str, Unit], parts: dict[str, Any]) -> dict[str, Any]:
  """The window of ``parts`` held in device slots (a leading axis of every leaf): each unit's
  slots combined as its ``reduce`` asks, as devices are (``_sharding.reduce_parts``)."""

  combine = {"grads": jnp.sum, **{name: c[1] for name, c in COLLECTIVES.items()}}

  def one(unit: Any, part: Any) -> Any:
    asks, finish = unit.reduce(part)
    return finish(
      {n: jax.tree.map(functools.partial(combine[n], axis=0), t) for n, t in asks.items()}
    )

  return {name: one(unit, parts[name]) for name, unit in units.items()}


def mean_of(acc: Any, weight: jax.Array, scale: jax.Array | None = None) -> Any:
  """The mean gradient of an accumulator (in float32 or wider), divided by the loss ``scale`` if
  given; 0 for a zero total weight, NaN for a non-finite one (a voided window)."""
  ok = weight > 0

  def one(a):
    wide = a.astype(jnp.promote_types(a.dtype, jnp.float32))
    real = jnp.finfo(wide.dtype).dtype  # float32 for complex64; float64 for a float64 sum
    factor = jnp.ones((), real) if scale is None else 1 / scale.astype(real)
    w = weight.astype(real)
    if not rule_of(a).running_mean:  # 1 / weight in the sum's precision: exact means in float64
      factor = factor * jnp.where(ok, 1 / jnp.where(ok, w, 1), 0)
    return wide * jnp.where(jnp.isfinite(w), factor, jnp.nan)

  return jax.tree.map(one, acc)


def sq_norm(tree: Any, by_rows: bool = False) -> jax.Array:
  """The squared global norm of ``tree``, in float32, or float64 if a leaf is (``|z|^2`` for complex
  leaves)."""
  leaves = [
    x.astype(jnp.promote_types(jnp.result_type(x), jnp.float32)) for x in jax.tree.leaves(tree)
  ]
  total = jnp.zeros((), jnp.result_type(jnp.float32, *(jnp.real(x).dtype for x in leaves)))
  for x in leaves:
    sq = jnp.real(x * jnp.conj(x))
    if by_rows and sq.ndim > 1:
      sq = jnp.sum(sq, axis=-1)
    total = total + jnp.sum(sq).astype(total.dtype)
  return total


@dataclasses.dataclass(frozen=True)
class Weighting:
  """How micro-batches are weighed: equally (``fn=None``), or by ``fn(microbatch)``; the only
  place that knows (unweighted, nothing is multiplied or selected)."""

  fn: Callable[[Any], Any] | None

  @property
  def weighted(self) -> bool:
    return self.fn is not None

  def of(self, microbatch: Any) -> jax.Array:
    if self.fn is None:
      return jnp.ones((), jnp.float32)
    return check_weight(self.fn(microbatch), "the value of weight_fn(microbatch)")

  def add(self, acc: Any, tree: Any, w: jax.Array) -> Any:
    return weighted_sum(acc, tree, w, self.weighted)

  def total(self, w: jax.Array) -> jax.Array:
    return counted(w, self.weighted)


def weighted_sum(acc: Any, tree: Any, w: jax.Array, weighted: bool) -> Any:
  """``acc + w * tree`` leafwise in ``acc``'s dtypes (``acc + tree`` for integer leaves, or
  unweighted); a weight <= 0 (or NaN) adds exactly 0, by a select, even a NaN value."""

  def one(a, x):
    x = jnp.asarray(x)
    if not weighted:
      return a + x.astype(a.dtype)
    if is_inexact(a):
      x = x.astype(a.dtype) * w.astype(a.dtype)
    return a + jnp.where(w > 0, x, 0).astype(a.dtype)

  return jax.tree.map(one, acc, tree)


def counted(w: jax.Array, weighted: bool) -> jax.Array:
  """What a micro-batch adds to the total weight: ``w``, 0 for ``w <= 0``; NaN stays NaN."""
  return w if not weighted else jnp.where(w <= 0, 0.0, w)


# Window statistics as data: each aux leaf's reducer is a record of REDUCERS; AuxReducers
# composes them per leaf, and every stage (the scan, the streaming slots, the mesh reduction,
# the window's end) calls its verbs. A new statistic is one entry of REDUCERS.

# How partial reductions combine: over the data axes, inside ``shard_map``; over a leading axis
# of device slots (``ga.micro_step`` on a mesh).
COLLECTIVES: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
  "sum": (jax.lax.psum, jnp.sum),
  "max": (jax.lax.pmax, jnp.max),
  "min": (jax.lax.pmin, jnp.min),
}


def _as_is(acc: jax.Array, devices: int, weighted: bool) -> jax.Array:
  """A device's share: its partial reduction, as it is."""
  del devices, weighted
  return acc


def _as_returned(total: jax.Array, weight: jax.Array, like: Any) -> jax.Array:
  """The window's value: the reduction, in ``like``'s dtype if a float (integers as summed)."""
  del weight
  return total.astype(jnp.result_type(like)) if is_inexact(like) else total


@dataclasses.dataclass(frozen=True)
class Reducer:
  """One window statistic of an aux leaf, as data (docs/usage.md, "Window statistics")."""

  start: Callable[[Any], Any]
  add: Callable[[jax.Array, Any, jax.Array, bool], jax.Array]
  merge: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
  collective: str = "sum"
  share: Callable[[jax.Array, int, bool], jax.Array] = _as_is
  final: Callable[[jax.Array, jax.Array, Any], jax.Array] = _as_returned
  dtype: Callable[[Any], Any] = jnp.result_type
  integers: bool = True
  public: bool = True


def _zero(dtype: Any) -> int:
  del dtype
  return 0


def _lowest(dtype: Any, high: bool = False) -> Any:
  """The start of a maximum: -inf, the least integer, or False (``high``: of a minimum, the
  other end)."""
  if jnp.issubdtype(dtype, jnp.bool_):
    return high
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.inf if high else -jnp.inf
  return jnp.iinfo(dtype).max if high else jnp.iinfo(dtype).min


def _add_weighted(acc: jax.Array, x: Any, w: jax.Array, weighted: bool) -> jax.Array:
  x = jnp.asarray(x)
  return acc + (jnp.where(w > 0, x.astype(acc.dtype) * w.astype(acc.dtype), 0) if weighted else x)


def _add(acc: jax.Array, x: Any, w: jax.Array, weighted: bool) -> jax.Array:
  return acc + (jnp.where(w > 0, x, 0) if weighted else jnp.asarray(x)).astype(acc.dtype)


def _plus(acc: jax.Array, more: jax.Array, more_weight: jax.Array) -> jax.Array:
  del more_weight
  return acc + more.astype(acc.dtype)


def _add_last(acc: jax.Array, x: Any, w: jax.Array, weighted: bool) -> jax.Array:
  x = jnp.asarray(x)
  return (jnp.where(w > 0, x, acc) if weighted else x).astype(acc.dtype)


def _later(acc: jax.Array, more: jax.Array, more_weight: jax.Array) -> jax.Array:
  """``more``, unless its micro-batches weigh nothing (``more_weight``: one per slot, or one)."""
  return jnp.where(_leading(more_weight > 0, more), more, acc).astype(acc.dtype)


def _mean_share(acc: jax.Array, devices: int, weighted: bool) -> jax.Array:
  """Unweighted, a device's micro-batch weighs ``1 / devices``, so that the devices' sum is the
  mean over every micro-batch; weighted, the weights say it."""
  return acc / devices if not weighted and is_inexact(acc) else acc


def _weighted_mean(total: jax.Array, weight: jax.Array, like: Any) -> jax.Array:
  return safe_mean(total, weight).astype(jnp.result_type(like))


def _peak(pick: Callable[..., jax.Array], start: Callable[[Any], Any], collective: str,
          every: bool = False) -> Reducer:  # fmt: skip
  """A maximum or a minimum (``pick``: ``jnp.maximum``, ...) over the micro-batches of positive
  weight (``every``: over every micro-batch that ran), and over the devices by ``collective``."""

  def add(acc: jax.Array, x: Any, w: jax.Array, weighted: bool) -> jax.Array:
    x = jnp.where(w > 0, x, start(acc.dtype)) if weighted and not every else x
    return pick(acc, jnp.asarray(x).astype(acc.dtype))

  def merge(acc: jax.Array, more: jax.Array, more_weight: jax.Array) -> jax.Array:
    del more_weight
    return pick(acc, more.astype(acc.dtype))

  return Reducer(start, add, merge, collective)


# The window statistics; ``aux_reduce=`` names the public ones.
REDUCERS: dict[str, Reducer] = {
  # the mean weighted by the micro-batches' weights (equal without weight_fn): floats' default
  "mean": Reducer(_zero, _add_weighted, _plus, "sum", _mean_share, _weighted_mean, sum_dtype,
                  integers=False),
  # the sum over the micro-batches and devices: the default of integer and bool leaves
  "sum": Reducer(_zero, _add, _plus, "sum", dtype=sum_dtype),
  # over the micro-batches and devices; -inf and +inf for a window of no positive weight
  "max": _peak(jnp.maximum, _lowest, "max"),
  "min": _peak(jnp.minimum, functools.partial(_lowest, high=True), "min"),
  # the last micro-batch of positive weight; on a mesh the mean of the devices' values for it
  "last": Reducer(_zero, _add_last, _later, "sum", lambda a, d, w: _mean_share(a, d, False)),
  # fp8 amax (_microbatch.Fp8): the max over every micro-batch that ran, whatever its weight
  "max_all": dataclasses.replace(_peak(jnp.maximum, _lowest, "max", every=True), public=False),
}  # fmt: skip


def reducer_names() -> tuple[str, ...]:
  """The reducers ``aux_reduce=`` may name (:data:`REDUCERS`' public entries)."""
  return tuple(name for name, r in REDUCERS.items() if r.public)


def _default_reducer(x: Any) -> str:
  return "mean" if is_inexact(x) else "sum"


@dataclasses.dataclass(frozen=True)
class AuxReducers:
  """Each aux leaf's :class:`Reducer` (``aux_reduce=``; docs/usage.md, "Window statistics"): one
  name of :data:`REDUCERS` for every leaf, a pytree prefix of the aux with names, or dicts of
  some of the aux's keys; a leaf left out, or None, gets the default (``"mean"`` for float
  leaves, ``"sum"`` for integer and bool ones)."""

  spec: Any = None  # None, a name, a pytree prefix of the aux with names, or a partial dict
  where: str | None = None  # the function the user called, for errors
  name: str = "aux_reduce"  # the argument that gave ``spec`` (window_stats_reduce), for errors

  @property
  def _of(self) -> str:
    return "aux loss_fn returns" if self.name == "aux_reduce" else "statistics window_stats returns"

  def _refuse(self, text: str) -> ValueError:
    return ValueError(text if self.where is None else f"{self.where}: {text}")

  def records(self, aux: Any) -> Any:
    """A tree like ``aux`` of each leaf's :class:`Reducer`; a ValueError for a spec that does not
    fit ``aux`` or that asks a float statistic of an integer leaf."""
    if self.spec is None:
      return jax.tree.map(lambda x: REDUCERS[_default_reducer(x)], aux)
    treedef, spec = jax.tree.structure(aux), self._completed(self.spec, aux)
    try:
      spec = jax.tree.broadcast(spec, aux, is_leaf=lambda x: x is None or isinstance(x, str))
    except (ValueError, TypeError):
      raise self._refuse(
        f"{self.name}={self.spec!r} must be one of {reducer_names()}, a pytree prefix of the"
        f" {self._of}, {treedef}, with those names (or None) as leaves, or a dict of some of its"
        " keys."
      ) from None
    out, leaves = [], jax.tree_util.tree_leaves_with_path(aux)
    for (path, x), name in zip(leaves, treedef.flatten_up_to(spec), strict=True):
      r = REDUCERS[_default_reducer(x) if name is None else name]
      if not (r.integers or is_inexact(x)):
        raise self._refuse(
          f"{self.name} asks the {name} of the integer {self._of.split()[0]} leaf"
          f" {jax.tree_util.keystr(path)}"
          f" ({jnp.result_type(x)}): a {name} is a float; use 'sum', or return a float."
        )
      out.append(r)
    return treedef.unflatten(out)

  def _completed(self, spec: Any, aux: Any, path: str = "") -> Any:
    """``spec`` with each dict of it that meets a dict of the aux given the aux's other keys (as
    None: the default); a ValueError naming a key the aux does not have."""
    if isinstance(spec, Mapping) and isinstance(aux, Mapping):
      unknown = [key for key in spec if key not in aux]
      if unknown:
        raise self._refuse(
          f"{self.name} names the key {unknown[0]!r}, which the {self._of} does not have"
          f"{f' at {path}' if path else ''}; its keys there are {list(aux)}. Name keys of it"
          " (those left out keep the default)."
        )
      done = {k: self._completed(spec.get(k), v, f"{path}[{k!r}]") for k, v in aux.items()}
      return done if type(aux) is dict else type(aux)(done)
    if type(spec) in (tuple, list) and type(spec) is type(aux) and len(spec) == len(aux):
      parts = enumerate(zip(spec, aux, strict=True))
      return type(spec)(self._completed(s, a, f"{path}[{i}]") for i, (s, a) in parts)
    return spec

  def _map(self, verb: Callable[..., Any], aux: Any, *rest: Any) -> Any:
    return jax.tree.map(verb, self.records(aux), aux, *rest)

  def init(self, like: Any) -> Any:
    """Each leaf's start (0 for a sum, the identity of a max or min), in its reducer's dtype."""
    return self._map(lambda r, x: jnp.full(jnp.shape(x), r.start(r.dtype(x)), r.dtype(x)), like)

  def add(self, acc: Any, aux: Any, w: jax.Array, weighted: bool) -> Any:
    """``acc`` after one micro-batch's ``aux`` of weight ``w``."""
    return self._map(lambda r, a, x: r.add(a, x, w, weighted), acc, aux)

  def merged(self, acc: Any, more: Any, more_weight: jax.Array) -> Any:
    """Two windows' reductions as one (``more`` of later micro-batches, of total weight
    ``more_weight``)."""
    return self._map(lambda r, a, b: r.merge(a, b, more_weight), acc, more)

  def share(self, aux: Any, devices: int, weighted: bool) -> Any:
    """Each device's share of the reductions (linear: before or after they are combined)."""
    return self._map(lambda r, x: r.share(x, devices, weighted), aux)

  def split(self, aux: Any) -> dict[str, Any]:
    """``aux`` as one tree like it per collective of :data:`COLLECTIVES`: the leaves it combines,
    None elsewhere."""
    records = self.records(aux)

    def only(name: str) -> Any:
      return jax.tree.map(lambda r, x: x if r.collective == name else None, records, aux)

    return {name: only(name) for name in COLLECTIVES}

  def join(self, parts: dict[str, Any]) -> Any:
    """The trees of :meth:`split` (each combined over the devices) as one."""
    trees = list(parts.values())
    leaves = [jax.tree.leaves(t, is_leaf=lambda v: v is None) for t in trees]
    out = [next((x for x in xs if x is not None), None) for xs in zip(*leaves, strict=True)]
    return jax.tree.structure(trees[0], is_leaf=lambda v: v is None).unflatten(out)

  def final(self, total: Any, weight: jax.Array, like: Any) -> Any:
    """The window's aux from its reductions, in the dtypes ``loss_fn`` returned (``like``)."""
    return self._map(lambda r, t, x: r.final(t, weight, x), total, like)


class Window(NamedTuple):
  """One batch's micro-batches as each unit keeps them (``parts``, by unit name)."""

  parts: dict[str, Any]  # "sums": Sums, "noise", "model_state" (if on), and registered units'
  loss_like: jax.ShapeDtypeStruct  # one micro-batch's loss ...
  aux_like: Any  # ... and aux
  num: Any  # the micro-batches summed (k, or num_real_microbatches)
  reducers: AuxReducers = AuxReducers()
  overwrite: Any = None  # an overwritten part's new value (Overwritten; fp8), else None
  before: Any = None  # what the window computed before its loop, as metrics (a dict), or None

  sums = property(lambda self: self.parts["sums"])
  model_state = property(lambda self: self.parts.get("model_state"))

  def means(self) -> tuple[jax.Array, Any, dict[str, Any]]:
    """The weighted mean loss, the reduced aux and a loss's terms' values (``{}`` for one)."""
    loss, aux = window_means(self.sums, self.loss_like, self.aux_like, self.reducers)
    loss, terms = split_terms(loss)
    return loss, aux, terms


class Unit:
  """The verbs of the protocol (this module's docstring) a unit may leave out: its carry is its
  part, combined over no collective and shared as it is, a later part replaces an earlier one,
  an empty part is the part itself, a state holds none of it, and it reports nothing."""

  name = "unit"

  def finalize(self, carry: Any, num: Any, rows: int) -> Any:
    return carry

  def reduce(self, part: Any) -> tuple[dict[str, Any], Callable[[dict[str, Any]], Any]]:
    return {}, lambda got: part

  def share(self, part: Any, devices: int) -> Any:
    return part

  def merge(self, part: Any, more: Any) -> Any:
    return more

  def empty(self, part: Any) -> Any:
    return part

  def held(self, state: Any) -> Any:
    """An open window's part in a streaming call's state (``MicroStepState.parts``)."""
    return state.parts[self.name]

  def hold(self, state: Any, part: Any) -> Any:
    return state._replace(parts={**state.parts, self.name: part})

  def metrics(self, part: Any) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class SumsUnit(Unit):
  """Gradient, weight, loss and aux sums (always on); ``dtypes``: the accumulator's (a narrow
  leaf's share is summed in float32; default the sums')."""

  weighting: Weighting
  reducers: AuxReducers
  dtypes: Any = None
  scatters: tuple | None = None  # per gradient leaf its per-micro-batch reduce-scatter, or None
  name = "sums"

  def init(self, acc_init: Any, like: Micro) -> Sums:
    loss = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), sum_dtype(x)), like.loss)
    grads = acc_init
    if self.scatters:  # a narrow leaf reduce-scattered per micro-batch: its shard's float32 sum
      leaves = zip(jax.tree.leaves(acc_init), self.scatters, strict=True)
      wide = [a.astype(jnp.float32) if f and rule_of(a).running_mean else a for a, f in leaves]
      grads = jax.tree.structure(acc_init).unflatten(wide)
    return Sums(grads, jnp.zeros((), jnp.float32), loss, self.reducers.init(like.aux))

  def update(self, s: Sums, m: Micro) -> Sums:
    w, wt = m.weight, self.weighting
    weight = s.weight if self.counted_after(s) else s.weight + wt.total(w)
    aux = self.reducers.add(s.aux, m.aux, w, wt.weighted)
    return Sums(self.add_grads(s, m), weight, wt.add(s.loss, m.loss, w), aux)

  def add_grads(self, s: Sums, m: Micro) -> Any:
    """The gradient sums after ``m``; with ``scatters``, ``w_i g_i`` of a leaf sharded over the
    data axes reduce-scattered before it is added (each device's weight on its own gradient)."""
    weighted = self.weighting.weighted
    if not self.scatters:
      return add_gradients(s.grads, m.grads, m.weight, s.weight, weighted)

    def one(a, g, scatter):
      if scatter is None:
        return add_gradients(a, g, m.weight, s.weight, weighted)
      return a + scatter(weighted_sum(jnp.zeros(jnp.shape(g), a.dtype), g, m.weight, weighted))

    leaves = zip(jax.tree.leaves(s.grads), jax.tree.leaves(m.grads), self.scatters, strict=True)
    return jax.tree.structure(s.grads).unflatten([one(*t) for t in leaves])

  def counted_after(self, s: Sums) -> bool:
    """Unweighted, the total weight is the number of micro-batches, added after the loop (a
    kernel per micro-batch saved), unless a running mean needs it in the loop."""
    return not self.weighting.weighted and not keeps_running_means(s.grads)

  def finalize(self, s: Sums, num: Any, rows: int) -> Sums:
    if not self.counted_after(s):
      return s
    return s._replace(weight=s.weight + jnp.asarray(num, jnp.float32))

  def reduce(self, s: Sums) -> tuple[dict[str, Any], Callable[[dict[str, Any]], Sums]]:
    """The gradients as ``"grads"`` (a running mean as ``mean * weight`` in float32), the
    weight, loss and summed aux as ``"sum"``, aux maxima and minima by their collectives."""
    dtypes = jax.tree.map(jnp.result_type, s.grads) if self.dtypes is None else self.dtypes
    by = self.reducers.split(s.aux)
    asks = {"grads": addends(s.grads, s.weight, dtypes), **by}
    asks["sum"] = s._replace(grads=(), aux=by["sum"])

    def finish(got: dict[str, Any]) -> Sums:
      rest = got["sum"]
      aux = self.reducers.join({**{name: got[name] for name in by}, "sum": rest.aux})
      return rest._replace(grads=from_totals(got["grads"], rest.weight, dtypes), aux=aux)

    return asks, finish

  def share(self, s: Sums, devices: int) -> Sums:
    """Unweighted, a device's micro-batch weighs ``1 / devices``, so that global micro-batch
    ``i`` weighs 1, as on one device (weighted, the weights say it; aux by their reducers)."""
    aux = self.reducers.share(s.aux, devices, self.weighting.weighted)
    if self.weighting.weighted:
      return s._replace(aux=aux)
    grads = jax.tree.map(lambda a: rule_of(a).share(a, devices), s.grads)
    loss = jax.tree.map(lambda x: x / devices if is_inexact(x) else x, s.loss)
    return Sums(grads, s.weight / devices, loss, aux)

  def merge(self, s: Sums, more: Sums) -> Sums:
    return s.merged(more, self.reducers)

  def held(self, state: Any) -> Sums:
    """The open window's sums in ``state`` (an ``AccumulateState`` holds no loss or aux sums)."""
    acc = getattr(state, "accumulate", state)
    loss, aux = getattr(state, "loss_sum", ()), getattr(state, "aux_sum", ())
    return Sums(acc.acc_grads, acc.acc_weight, loss, aux)

  def hold(self, state: Any, s: Sums) -> Any:
    if not hasattr(state, "accumulate"):
      return state._replace(acc_grads=s.grads, acc_weight=s.weight)
    acc = state.accumulate._replace(acc_grads=s.grads, acc_weight=s.weight)
    return state._replace(accumulate=acc, loss_sum=s.loss, aux_sum=s.aux)

  def empty(self, s: Sums) -> Sums:
    return jax.tree.map(jnp.zeros_like, s)._replace(aux=self.reducers.init(s.aux))

  def seed_factor(self, devices: int) -> int:
    """The inverse of :meth:`share`: an open window's sums, added by one device into its share."""
    return 1 if self.weighting.weighted else devices


PLAIN_SUMS = SumsUnit(Weighting(None), AuxReducers())  # a state's sums, reduced or totalled


def keep_if_voided(updated: jax.Array, new: Any, old: Any) -> Any:
  """``new``, but for a voided window (``updated`` False) its float leaves (running statistics)
  as ``old`` holds them; counters advance either way."""
  return jax.tree.map(lambda n, o: jnp.where(updated, n, o) if is_inexact(n) else n, new, old)
