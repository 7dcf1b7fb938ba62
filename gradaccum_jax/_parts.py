"""The parts of a window's sums: one small unit per feature, composed by the micro-batch scan.

Every unit answers optax.microbatching's questions: ``init(acc_init, like)`` (its part of the
carry; ``like``: one micro-batch's :class:`Micro`, abstract), ``update(part, micro)`` (add one
micro-batch), ``finalize(part, num, rows)`` (after ``num`` micro-batches of ``rows`` rows) and
``per_device(part, devices, num)`` (after the sum over ``devices``, on a mesh); a feature that
is off is the :class:`Off` unit, whose carry is ``()``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax._checks import check_weight, is_inexact, is_running_mean


class Micro(NamedTuple):
  """What one micro-batch gives the units."""

  loss: jax.Array  # its mean loss, as loss_fn returned it
  aux: Any
  grads: Any  # the gradient of loss * scale
  weight: jax.Array  # float32 scalar (1 unweighted)
  model_state: Any  # the model state after it (None without has_state)


class Sums(NamedTuple):
  """The weighted sums every window keeps; additive, so devices reduce them with one psum."""

  grads: Any  # sum_i w_i g_i (times the loss scale), in the accumulator's dtypes
  weight: jax.Array  # sum_i w_i over the micro-batches of positive weight (float32)
  loss: jax.Array  # sum_i w_i L_i, in the loss's precision (at least float32)
  aux: Any  # inexact leaves: sum_i w_i aux_i; integer and bool leaves: sum_i aux_i

  def merged(self, more: Sums, reducers: AuxReducers) -> Sums:
    """These sums and ``more`` (of later micro-batches) as one window's, by the one rule."""
    grads = merge_gradients(self.grads, self.weight, more.grads, more.weight)
    # Promoted: a float64 loss widens a float32 sum that a state was made with.
    loss = self.loss + more.loss
    aux = reducers.merged(self.aux, more.aux, more.weight)
    return Sums(grads, self.weight + more.weight, loss, aux)


OVERWRITE = "_overwrite_with_gradient"  # flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT


def overwrite_key(params: Any, where: str) -> str | None:
  """``OVERWRITE`` if ``params`` is a Flax variables dict ``{"params": ..., OVERWRITE: ...}``
  (fp8: that collection's "gradient" is its new value, written over the old once per window,
  docs/usage.md, "FP8"), else None."""
  if not (isinstance(params, Mapping) and OVERWRITE in params):
    return None
  if set(params) != {"params", OVERWRITE}:
    raise ValueError(
      f"{where}: params holds Flax's {OVERWRITE!r} collection (fp8) and"
      f" {sorted(set(params) - {OVERWRITE, 'params'})} beside 'params': pass the variables"
      " {'params': ..., '_overwrite_with_gradient': ...} only, other collections as model state"
      " (has_state=True)."
    )
  return OVERWRITE


def refuse_overwrite(tree: Any, what: str, where: str) -> None:
  """A ValueError, before any work, for Flax's fp8 collection in a streaming call's ``tree``."""
  if isinstance(tree, Mapping) and OVERWRITE in tree:
    raise ValueError(
      f"{where}: {what} holds Flax's {OVERWRITE!r} collection (fp8 amax histories and scales):"
      " its window value is the max over the micro-batches, each backward pass scaled by the"
      " window's total weight, which a call on one micro-batch cannot know. Use ga.train_step"
      " or ga.linen_train_step (the state made by tx.init(variables['params']), as Flax's"
      " TrainState.create does)."
    )


def with_params(variables: Any, trained: Any, overwrite: Any) -> Any:
  """``variables`` (a Flax variables dict, of its own type) with new ``"params"`` and fp8
  collection."""
  new = {"params": trained, OVERWRITE: overwrite}
  return new if type(variables) is dict else type(variables)(new)


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
  """Whether any leaf of the accumulator ``acc`` keeps a running mean (:func:`is_running_mean`)."""
  return any(map(is_running_mean, jax.tree.leaves(acc)))


def window_means(
  sums: Sums, loss_like: Any, aux_like: Any, reducers: AuxReducers | None = None
) -> tuple[jax.Array, Any]:
  """The window's weighted mean loss and its aux as ``reducers`` say (by default integer leaves
  summed), in the dtypes ``loss_fn`` returned (``*_like``: one micro-batch's)."""
  loss = safe_mean(sums.loss, sums.weight).astype(loss_like.dtype)
  return loss, (reducers or AuxReducers()).final(sums.aux, sums.weight, aux_like)


def safe_mean(total: jax.Array, weight: jax.Array) -> jax.Array:
  """``total / weight``, and 0 where the weight is 0."""
  return jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1).astype(total.dtype), 0)


def _toward(mean: jax.Array, x: Any, frac: jax.Array) -> jax.Array:
  """The running mean ``mean`` moved the fraction ``frac`` of the way to ``x``, in float32."""
  m = mean.astype(jnp.float32)
  return (m + frac * (jnp.asarray(x).astype(jnp.float32) - m)).astype(mean.dtype)


def merge_gradients(acc: Any, weight: jax.Array, more: Any, more_weight: jax.Array) -> Any:
  """The accumulation rule, shared by every mode: two accumulators of total weights ``weight``
  and ``more_weight`` as one. A leaf of float32 or wider adds the sums; a narrower one keeps
  the running weighted mean (:func:`is_running_mean`), moved toward ``more``'s mean by
  ``more_weight / (weight + more_weight)`` in float32 (left as it is for a zero ``more_weight``,
  even if ``more`` is NaN)."""
  frac = safe_mean(more_weight, weight + more_weight)

  def one(a, b):
    if not is_running_mean(a):
      return a + b.astype(a.dtype)
    return jnp.where(frac > 0, _toward(a, b, frac), a)

  return jax.tree.map(one, acc, more)


def add_gradients(acc: Any, grads: Any, w: jax.Array, weight: jax.Array, wt: Weighting) -> Any:
  """``acc`` (of total weight ``weight``) after one more micro-batch ``grads`` of weight ``w``:
  :func:`merge_gradients` with the micro-batch as a window of its own, whose sum is ``w g``
  (0 for ``w <= 0``) and whose mean is ``g``."""
  one = jax.tree.map(
    lambda a, g: g if is_running_mean(a) else wt.add(jnp.zeros_like(a), g, w), acc, grads
  )
  return merge_gradients(acc, weight, one, wt.total(w))


def mean_of(acc: Any, weight: jax.Array, scale: jax.Array | None = None) -> Any:
  """The mean gradient of an accumulator (in float32 or wider), divided by the loss ``scale``
  if given; 0 for a zero total weight. One multiplication per leaf, which XLA fuses into a norm
  (a division with a select would be written out first)."""
  ok = weight > 0

  def one(a):
    wide = a.astype(jnp.promote_types(a.dtype, jnp.float32))
    real = jnp.finfo(wide.dtype).dtype  # float32 for complex64; float64 for a float64 sum
    factor = jnp.ones((), real) if scale is None else 1 / scale.astype(real)
    if not is_running_mean(a):  # 1 / weight in the sum's precision: exact means in float64
      w = weight.astype(real)
      factor = factor * jnp.where(ok, 1 / jnp.where(ok, w, 1), 0)
    return wide * factor

  return jax.tree.map(one, acc)


def sq_norm(tree: Any, by_rows: bool = False) -> jax.Array:
  """The squared global norm of ``tree``, in float32, or float64 if a leaf is (``|z|^2`` for
  complex leaves).

  ``by_rows``: each matrix summed by rows first (faster on XLA:CPU; not for arrays on a mesh:
  docs/architecture.md, "Closing a window")."""
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
    """``acc + w * tree`` leafwise in ``acc``'s dtypes (``acc + tree`` for integer ``acc``
    leaves); a weight <= 0 (or NaN) adds exactly 0, by a select, even a NaN value (0/0 loss)."""

    def one(a, x):
      x = jnp.asarray(x)
      if not self.weighted:
        return a + x.astype(a.dtype)
      if is_inexact(a):
        x = x.astype(a.dtype) * w.astype(a.dtype)
      return a + jnp.where(w > 0, x, 0).astype(a.dtype)

    return jax.tree.map(one, acc, tree)

  def total(self, w: jax.Array) -> jax.Array:
    """What a micro-batch adds to the total weight: ``w``, 0 for ``w <= 0``; NaN stays NaN
    (a non-finite total voids the window)."""
    return w if not self.weighted else jnp.where(w <= 0, 0.0, w)


AUX_REDUCERS = ("mean", "sum", "max", "min", "last")


def _default_reducer(x: Any) -> str:
  return "mean" if is_inexact(x) else "sum"


@dataclasses.dataclass(frozen=True)
class AuxReducers:
  """How each aux leaf is reduced over a window (``aux_reduce=``; docs/usage.md, "Window
  statistics"): ``"mean"`` (weighted by the micro-batches' weights; the default of float
  leaves), ``"sum"`` (over the micro-batches and devices; the default of integer and bool
  leaves), ``"max"``, ``"min"`` (over the micro-batches and devices; -inf and +inf for a window
  of no positive weight) or ``"last"`` (the last micro-batch of positive weight; on a mesh, the
  mean of the devices' values for it). Micro-batches of weight <= 0 are left out of all but
  the package's own ``"max_all"`` (fp8 amax: the max over every micro-batch that ran)."""

  spec: Any = None  # None, a name, or a pytree prefix of the aux with names (None: default)

  def ops(self, aux: Any) -> Any:
    """A tree like ``aux`` of each leaf's reducer; a ValueError for a spec that is not a prefix
    of ``aux`` or that asks a mean of an integer leaf."""
    if self.spec is None:
      return jax.tree.map(_default_reducer, aux)
    try:
      spec = jax.tree.broadcast(self.spec, aux, is_leaf=lambda x: x is None or isinstance(x, str))
    except (ValueError, TypeError) as e:
      raise ValueError(
        f"aux_reduce={self.spec!r} must be one of {AUX_REDUCERS} or a pytree prefix of the aux"
        f" loss_fn returns, {jax.tree.structure(aux)}, with those names (or None) as leaves."
        f" ({e})"
      ) from None
    specs = jax.tree.structure(aux).flatten_up_to(spec)
    out = []
    for (path, x), op in zip(jax.tree_util.tree_leaves_with_path(aux), specs, strict=True):
      op = _default_reducer(x) if op is None else op
      if op == "mean" and not is_inexact(x):
        raise ValueError(
          f"aux_reduce asks the mean of the integer aux leaf {jax.tree_util.keystr(path)}"
          f" ({jnp.result_type(x)}): a weighted mean is a float; use 'sum', or return a float."
        )
      out.append(op)
    return jax.tree.structure(aux).unflatten(out)

  def _map(self, fn: Callable[..., Any], aux: Any, *rest: Any) -> Any:
    return jax.tree.map(fn, self.ops(aux), aux, *rest)

  def init(self, like: Any) -> Any:
    """Each leaf's start: 0 for a sum or "last", the identity of "max" and "min"."""

    def one(op, x):
      dtype = sum_dtype(x) if op in ("mean", "sum") else jnp.result_type(x)
      return jnp.full(jnp.shape(x), _identity(op, dtype), dtype)

    return self._map(one, like)

  def add(self, acc: Any, aux: Any, w: jax.Array, weighted: bool) -> Any:
    """``acc`` after one micro-batch's ``aux`` of weight ``w``."""
    real = w > 0

    def one(op, a, x):
      x = jnp.asarray(x)
      if op == "mean":
        return a + (jnp.where(real, x.astype(a.dtype) * w.astype(a.dtype), 0) if weighted else x)
      if op == "sum":
        return a + (jnp.where(real, x, 0) if weighted else x).astype(a.dtype)
      if op == "last":
        return jnp.where(real, x, a).astype(a.dtype) if weighted else x.astype(a.dtype)
      if op == "max_all":  # every micro-batch that ran, whatever its weight (fp8 amax)
        return _peak(op, a, x)
      return _peak(op, a, jnp.where(real, x, _identity(op, a.dtype)) if weighted else x)

    return self._map(one, acc, aux)

  def merged(self, acc: Any, more: Any, more_weight: jax.Array) -> Any:
    """Two windows' reductions as one (``more`` of later micro-batches, of total weight
    ``more_weight``)."""

    def one(op, a, b):
      if op == "last":
        return jnp.where(more_weight > 0, b, a).astype(a.dtype)
      return a + b.astype(a.dtype) if op in ("mean", "sum") else _peak(op, a, b)

    return self._map(one, acc, more)

  def per_device(self, aux: Any, devices: int, weighted: bool) -> Any:
    """Before the sum over ``devices`` (``_sharding.reduce_sums``): unweighted means, and "last",
    divided by ``devices``, so that their sum is the mean of the devices' values."""

    def one(op, x):
      divide = op == "last" or (op == "mean" and not weighted)
      return x / devices if divide and is_inexact(x) else x

    return self._map(one, aux)

  def split(self, aux: Any) -> tuple[Any, Any, Any]:
    """``aux`` as three trees like it: the leaves summed over devices, maxed, minned (the others
    None in each)."""
    ops = self.ops(aux)

    def pick(want):
      return jax.tree.map(lambda op, x: x if (op in want) else None, ops, aux)

    return pick(("mean", "sum", "last")), pick(("max", "max_all")), pick(("min",))

  def join(self, summed: Any, maxed: Any, minned: Any) -> Any:
    """The three trees of :meth:`split` (each reduced over the devices) as one."""
    leaves = [jax.tree.leaves(t, is_leaf=lambda v: v is None) for t in (summed, maxed, minned)]
    out = [next((x for x in xs if x is not None), None) for xs in zip(*leaves, strict=True)]
    return jax.tree.structure(summed, is_leaf=lambda v: v is None).unflatten(out)

  def over_slots(self, aux: Any) -> Any:
    """``aux`` with a leading axis of device slots reduced (summed, or maxed, minned)."""

    def one(op, x):
      return {"max": jnp.max, "max_all": jnp.max, "min": jnp.min}.get(op, jnp.sum)(x, 0)

    return self._map(one, aux)

  def final(self, total: Any, weight: jax.Array, like: Any) -> Any:
    """The window's aux from its reductions, in the dtypes ``loss_fn`` returned (``like``)."""

    def one(op, t, x):
      if op == "mean":
        return safe_mean(t, weight).astype(jnp.result_type(x))
      return t.astype(jnp.result_type(x)) if is_inexact(x) else t

    return self._map(one, total, like)


def _identity(op: str, dtype: Any) -> Any:
  """The start of a reduction: 0, or the lowest (``max``) or highest (``min``) value."""
  if op not in ("max", "min", "max_all"):
    return 0
  if jnp.issubdtype(dtype, jnp.bool_):
    return op == "min"
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.inf if op == "min" else -jnp.inf
  info = jnp.iinfo(dtype)
  return info.max if op == "min" else info.min


def _peak(op: str, a: jax.Array, x: Any) -> jax.Array:
  return (jnp.minimum if op == "min" else jnp.maximum)(a, jnp.asarray(x).astype(a.dtype))


@dataclasses.dataclass(frozen=True)
class SumsUnit:
  """Gradient, weight, loss and aux sums (always on)."""

  weighting: Weighting
  reducers: AuxReducers

  def init(self, acc_init: Any, like: Micro) -> Sums:
    loss = jnp.zeros(jnp.shape(like.loss), sum_dtype(like.loss))
    return Sums(acc_init, jnp.zeros((), jnp.float32), loss, self.reducers.init(like.aux))

  def update(self, s: Sums, m: Micro) -> Sums:
    w, wt = m.weight, self.weighting
    grads = add_gradients(s.grads, m.grads, w, s.weight, wt)
    weight = s.weight if self.counted_after(s) else s.weight + wt.total(w)
    aux = self.reducers.add(s.aux, m.aux, w, wt.weighted)
    return Sums(grads, weight, wt.add(s.loss, m.loss, w), aux)

  def counted_after(self, s: Sums) -> bool:
    """Whether the total weight (unweighted: the number of micro-batches) is added after the
    loop, in :meth:`finalize`, saving a kernel per micro-batch; not when a running mean needs it."""
    return not self.weighting.weighted and not keeps_running_means(s.grads)

  def finalize(self, s: Sums, num: Any, rows: int) -> Sums:
    """``s`` after a loop over ``num`` micro-batches (of ``rows`` rows each)."""
    if not self.counted_after(s):
      return s
    return s._replace(weight=s.weight + jnp.asarray(num, jnp.float32))

  def per_device(self, s: Sums, devices: int, num: Any) -> Sums:
    """After the sum over ``devices``: unweighted, a device's micro-batch weighs ``1 / devices``,
    so global micro-batch ``i`` weighs 1, as on one device, and the total weight is ``num``."""
    aux = self.reducers.per_device(s.aux, devices, self.weighting.weighted)
    if self.weighting.weighted:
      return s._replace(aux=aux)
    grads, loss = _divided((s.grads, s.loss), devices)
    return Sums(grads, jnp.asarray(num, jnp.float32), loss, aux)

  def seed_factor(self, devices: int) -> int:
    """What an open window's sums are multiplied by when one device adds them into its share:
    unweighted ``devices``, as :meth:`per_device` divides by it (exact for a power of two)."""
    return 1 if self.weighting.weighted else devices


def _divided(tree: Any, devices: int) -> Any:
  """``tree``'s float leaves divided by ``devices``."""
  return jax.tree.map(lambda x: x / devices if is_inexact(x) else x, tree)


@dataclasses.dataclass(frozen=True)
class Off:
  """A feature that is off: its carry is ``()``, nothing is computed, and its part of the
  window is ``final`` (``()``; None for the model state)."""

  final: Any = ()

  def init(self, *args: Any) -> tuple[()]:
    return ()

  def update(self, carry: tuple[()], m: Micro) -> tuple[()]:
    return ()

  def start(self, carry: tuple[()]) -> None:
    return None

  def finalize(self, carry: tuple[()], num: Any, rows: int) -> Any:
    return self.final

  def per_device(self, part: Any, devices: int, num: Any) -> Any:
    return part


def keep_if_voided(updated: jax.Array, new: Any, old: Any) -> Any:
  """``new``, but for a voided window (``updated`` False) its float leaves (running statistics)
  as ``old`` holds them; counters advance either way."""
  return jax.tree.map(lambda n, o: jnp.where(updated, n, o) if is_inexact(n) else n, new, old)
