"""``check_equivalence``: does accumulating over micro-batches give the whole batch's loss and gradient?"""

from __future__ import annotations

import dataclasses
import numbers
import re
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax._microbatch import microbatch, value_and_grad

# The weight fit uses at most this many gradient coordinates (a fixed random subset beyond it).
_MAX_FIT_COORDS = 65536


@dataclasses.dataclass(frozen=True)
class EquivalenceReport:
  """The result of :func:`check_equivalence`; ``str(report)`` is a readable diagnosis.

  Attributes:
    ok: whether the accumulated loss and gradient equal the whole batch's:
      ``loss_rel_error <= rtol`` and ``max_rel_grad_error <= rtol``, both finite.
      This is the fact; ``cause`` and ``reason`` are a hint.
    num_microbatches: ``k``.
    weighted: whether a ``weight_fn`` was given.
    rtol: the tolerance used.
    loss_whole: ``loss_fn`` on the whole batch (``jax.value_and_grad``).
    loss_accumulated: the loss of ``ga.value_and_grad(loss_fn, k, ...)``.
    loss_rel_error: ``|loss_accumulated - loss_whole| / |loss_whole|``.
    max_rel_grad_error: the largest absolute difference between the accumulated
      and the whole-batch gradient, over all leaves, divided by the whole-batch
      gradient's largest absolute entry.
    mean_of_means_loss: the naive mean of the ``k`` micro-batches' mean losses.
    mean_of_means_error: how far the naive mean of the micro-batches' means is
      from the whole batch: the larger of its relative loss error and its
      relative gradient error (measured as ``max_rel_grad_error``).
    cause: ``None`` when ``ok``, else ``"randomness"``, ``"weighting"``,
      ``"batch_dependence"`` or ``"unknown"``.
    reason: ``None`` when ``ok``, else the likely reason and what to pass.
    fitted_weights: the relative micro-batch weights (summing to 1) that best
      rebuild the whole batch's loss and gradient from the micro-batches', or
      ``None`` when they were not fitted.
  """

  ok: bool
  num_microbatches: int
  weighted: bool
  rtol: float
  loss_whole: float
  loss_accumulated: float
  loss_rel_error: float
  max_rel_grad_error: float
  mean_of_means_loss: float
  mean_of_means_error: float
  cause: str | None = None
  reason: str | None = None
  fitted_weights: tuple[float, ...] | None = None

  def __str__(self) -> str:
    verdict = "equivalent" if self.ok else "NOT equivalent"
    how = "weighted by weight_fn" if self.weighted else "unweighted"
    lines = [
      f"Accumulation over k={self.num_microbatches} micro-batches ({how}) vs the whole batch:"
      f" {verdict} (rtol={self.rtol:g}).",
      f"  loss       whole batch {self.loss_whole:.7g}, accumulated {self.loss_accumulated:.7g}"
      f" (relative error {self.loss_rel_error:.2e})",
      f"  gradient   max relative error {self.max_rel_grad_error:.2e}",
      f"  naive mean of micro-batch means: loss {self.mean_of_means_loss:.7g}"
      f" (relative error {self.mean_of_means_error:.2e})",
    ]
    if self.fitted_weights is not None:
      shown = ", ".join(f"{w:.3f}" for w in self.fitted_weights[:8])
      more = ", ..." if len(self.fitted_weights) > 8 else ""
      lines.append(f"  micro-batch weights that rebuild the whole batch: [{shown}{more}]")
    if self.reason is not None:
      text = f"likely reason ({self.cause}): {self.reason}"
      # A suggested ``lambda mb: ...`` stays on one line, to copy: its spaces do not break.
      text = re.sub(r"lambda mb: \S+", lambda m: m.group(0).replace(" ", "\xa0"), text)
      wrapped = textwrap.fill(text, 100, initial_indent="  ", subsequent_indent="    ")
      lines.append(wrapped.replace("\xa0", " "))
    return "\n".join(lines)


def check_equivalence(
  loss_fn: Callable[..., Any],
  params: Any,
  batch: Any,
  num_microbatches: int,
  *,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  rtol: float = 1e-5,
  mesh: Any = None,
  data_axis: str | tuple[str, ...] | None = None,
  rng: jax.Array | None = None,
) -> EquivalenceReport:
  r"""Checks that accumulating ``loss_fn`` over micro-batches gives the whole batch's loss and gradient.

  Computes ``jax.value_and_grad(loss_fn)`` on the whole batch and
  ``ga.value_and_grad(loss_fn, k, weight_fn=..., mesh=...)`` (jitted) on the
  same batch, and reports whether the loss and the gradient agree within
  ``rtol`` (the gradient error is relative to the whole-batch gradient's
  largest entry). Accumulation is exact when ``loss_fn`` is a weighted mean
  over rows that do not interact, :math:`L(B) = \sum_{r \in B} \ell_r /
  \sum_{r \in B} n_r` with ``weight_fn(mb)`` :math:`= \sum_{r \in mb} n_r`
  (``n_r = 1`` per example: no ``weight_fn`` needed).

  When they differ, the report names a likely cause (a hint, not a proof):

  * ``"randomness"``: ``loss_fn`` on micro-batch 0 gives a different loss with
    another key (when ``rng`` is given), or two traces of it differ (randomness
    drawn in Python, e.g. ``numpy.random``, which ``jit`` freezes per trace).
  * ``"weighting"``: the whole batch's loss and gradient are, within
    ``max(rtol, 1e-4)``, a weighted average of the micro-batches' with weights
    other than the ones used (found by least squares over the loss and up to
    65536 gradient coordinates): ``loss_fn`` is a mean over tokens or masked
    positions whose number varies. The report suggests a ``weight_fn``, naming
    a batch leaf whose per-micro-batch count matches the fitted weights (a bool
    or 0/1 leaf: ``.sum()``; an integer leaf: the count of entries ``>= 0`` or
    ``!= 0``).
  * ``"batch_dependence"``: no weighted average fits, so a row's loss depends
    on the other rows of its batch: BatchNorm in training mode, features
    standardized with batch statistics, in-batch negatives. Accumulation cannot
    reproduce these exactly.
  * ``"unknown"``: the micro-batches add up to the whole batch with the weights
    used, yet the accumulated result differs (e.g. a layout problem on a
    mesh), or the model has too few parameters for the fit to tell.

  The fit needs more gradient coordinates than ``2 k``; it is skipped (cause
  ``"unknown"``) for tinier models. Precision differences also make results
  differ: under bf16 compute pass ``rtol`` of about ``1e-2``. The check runs
  eagerly (it returns Python floats), costs about three whole-batch forward
  and backward passes and keeps ``k + 2`` copies of (a subset of) the
  gradient in host memory: use a small batch. Aux outputs are not compared.

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning the scalar mean loss over its
      (micro-)batch, or ``(loss, aux)`` with ``has_aux``; ``loss_fn(params,
      batch, rng)`` when ``rng`` is given.
    params: the parameters (a pytree of float arrays).
    batch: a pytree of arrays sharing a leading batch axis ``B``.
    num_microbatches: ``k``, a positive int dividing ``B`` (``D * k`` with a
      mesh of ``D`` devices on ``data_axis``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    weight_fn: the ``weight_fn(microbatch) -> scalar`` you pass to the
      accumulation (e.g. the number of non-padding tokens), or ``None``.
    rtol: the tolerance of ``ok``, relative to the whole-batch loss and to the
      largest entry of the whole-batch gradient.
    mesh: a ``jax.sharding.Mesh`` to accumulate data-parallel over, as in
      :func:`value_and_grad`; the reference stays the single-device whole
      batch.
    data_axis: the mesh axis the batch is sharded over (``"data"`` by
      default). Needs ``mesh``.
    rng: a PRNG key: the whole batch is evaluated with it and micro-batch ``i``
      with ``jax.random.fold_in(rng, i)``, as :func:`value_and_grad` does.

  Returns:
    An :class:`EquivalenceReport`; print it for the diagnosis.

  Raises:
    TypeError: if ``loss_fn`` is not callable, or ``num_microbatches`` or
      ``rtol`` is not a number.
    ValueError: if ``num_microbatches`` or ``rtol`` is not positive, the batch
      leaves have different leading dimensions, or ``k`` does not divide the
      batch size; errors of :func:`value_and_grad` for a bad mesh.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import gradaccum_jax as ga
    >>> def token_loss(w, batch):  # the mean over the non-padding tokens
    ...   err = (batch["x"] * w - batch["y"]) ** 2
    ...   return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])
    >>> lengths = jnp.array([6, 1, 2, 5])  # tokens per sequence
    >>> batch = {
    ...   "x": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6),
    ...   "y": jnp.ones((4, 6)),
    ...   "mask": jnp.arange(6)[None, :] < lengths[:, None],
    ... }
    >>> w = jnp.linspace(0.1, 0.6, 6)
    >>> report = ga.check_equivalence(token_loss, w, batch, num_microbatches=2)
    >>> report.ok, report.cause
    (False, 'weighting')
    >>> print(report.reason)  # doctest: +ELLIPSIS
    loss_fn averages over ... e.g. weight_fn=lambda mb: mb['mask'].sum().
    >>> count = lambda mb: jnp.sum(mb["mask"])
    >>> ga.check_equivalence(token_loss, w, batch, 2, weight_fn=count).ok
    True
  """
  k = _check_args(loss_fn, batch, num_microbatches, rtol)
  acc_fn = value_and_grad(  # checks mesh and data_axis eagerly
    loss_fn, k, has_aux=has_aux, weight_fn=weight_fn, mesh=mesh, data_axis=data_axis
  )
  vg = jax.value_and_grad(loss_fn, has_aux=bool(has_aux))

  def split(out):
    value, grads = out
    return (value[0] if has_aux else value), grads

  extra = () if rng is None else (rng,)
  if mesh is None:
    loss_acc, g_acc = split(jax.jit(acc_fn)(params, batch, *extra))
  else:
    loss_acc, g_acc = split(_on_mesh(acc_fn, mesh, data_axis, k, params, batch, extra))
    # The reference is the single-device whole batch: everything via the host to one device.
    params, batch, loss_acc, g_acc = jax.device_put(
      jax.tree.map(np.asarray, (params, batch, loss_acc, g_acc)), jax.devices()[0]
    )
  loss_whole, g_whole = split(jax.jit(vg)(params, batch, *extra))

  # The k micro-batches, one at a time, in ga's order (rows i, i + k, ...).
  @jax.jit
  def one(params, batch, i, key):
    return split(vg(params, microbatch(batch, i, k), *(() if key is None else (key,))))

  keys = [None if rng is None else jax.random.fold_in(rng, i) for i in range(k)]
  micro = [one(params, batch, i, key) for i, key in enumerate(keys)]
  losses = np.array([float(x) for x, _ in micro])
  g_mean = jax.tree.map(lambda *g: sum(g) / k, *[g for _, g in micro])

  scale = max(float(max(jnp.max(jnp.abs(g)) for g in jax.tree.leaves(g_whole))), 1e-30)
  loss_whole = float(loss_whole)
  loss_err = _rel(float(loss_acc), loss_whole)
  grad_err = _max_abs_diff(g_acc, g_whole) / scale
  mom_loss = float(np.mean(losses))
  mom_err = max(_rel(mom_loss, loss_whole), _max_abs_diff(g_mean, g_whole) / scale)
  ok = bool(np.isfinite(loss_err) and np.isfinite(grad_err))
  ok = ok and loss_err <= rtol and grad_err <= rtol
  report = EquivalenceReport(
    ok, k, weight_fn is not None, float(rtol), loss_whole, float(loss_acc), loss_err,
    grad_err, mom_loss, mom_err,
  )  # fmt: skip
  if ok:
    return report
  mbs = [microbatch(batch, i, k) for i in range(k)]
  if rng is not None:  # micro-batch 0 again, with another key
    random = _rel(float(one(params, batch, 0, jax.random.fold_in(rng, k))[0]), losses[0]) > rtol
  else:
    random = _traces_differ(loss_fn, params, mbs[0])
  if random:
    return dataclasses.replace(report, cause="randomness", reason=_RANDOM)
  grads = [g for _, g in micro]
  fit = _fit_weights(_Flattener(params), losses, grads, loss_whole, g_whole, scale, max(rtol, 1e-4))
  used = np.ones(k) if weight_fn is None else np.array([float(weight_fn(mb)) for mb in mbs])
  cause, reason = _diagnose(fit, used / max(used.sum(), 1e-30), mbs, weight_fn, mesh, k)
  weights = None if fit is None or fit is False else tuple(float(w) for w in fit)
  return dataclasses.replace(report, cause=cause, reason=reason, fitted_weights=weights)


_RANDOM = (
  "loss_fn is random (another key changes its loss, or it draws new constants each time it"
  " is traced, e.g. with numpy.random), so the"
  " whole batch and the micro-batches draw different dropout masks or noise and cannot agree."
  " Check with randomness off (deterministic=True, model.eval(), dropout rate 0): the"
  " accumulation of the deterministic loss is what must match."
)


def _check_args(loss_fn: Any, batch: Any, num_microbatches: Any, rtol: Any) -> int:
  """Checks the arguments at the boundary; returns ``k``."""
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be a function loss_fn(params, batch), got {loss_fn!r}.")
  if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, numbers.Integral):
    raise TypeError(f"num_microbatches must be a positive int, got {num_microbatches!r}.")
  k = int(num_microbatches)
  if k < 1:
    raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches=}.")
  if isinstance(rtol, bool) or not isinstance(rtol, numbers.Real):
    raise TypeError(f"rtol must be a positive float, got {rtol!r}.")
  if not rtol > 0:
    raise ValueError(f"rtol must be positive, got {rtol=}.")
  sizes = {
    jax.tree_util.keystr(path) or "batch": (jnp.shape(x) or (None,))[0]
    for path, x in jax.tree_util.tree_leaves_with_path(batch)
  }
  if not sizes or None in sizes.values() or len(set(sizes.values())) > 1:
    listing = ", ".join(f"{name}: {size}" for name, size in sizes.items()) or "no leaves"
    raise ValueError(
      f"batch must be a pytree of arrays sharing a leading batch dimension, got {listing}."
    )
  batch_size = next(iter(sizes.values()))
  if batch_size % k:
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    raise ValueError(
      f"batch size B={batch_size} is not divisible by num_microbatches k={k}; pick k among"
      f" the divisors of {batch_size}: {divisors}."
    )
  return k


def _on_mesh(acc_fn, mesh, data_axis, k, params, batch, extra) -> Any:
  """``acc_fn`` jitted on ``mesh``: params replicated, the batch sharded on ``data_axis``."""
  axes = tuple(data_axis) if isinstance(data_axis, tuple | list) else (data_axis or "data",)
  devices = int(np.prod([mesh.shape[a] for a in axes]))
  batch_size = jnp.shape(jax.tree.leaves(batch)[0])[0]
  if batch_size % (devices * k):
    raise ValueError(
      f"batch size B={batch_size} is not divisible by {devices} devices on"
      f" data_axis={axes if len(axes) > 1 else axes[0]!r} x num_microbatches k={k}: every"
      f" device splits its B / {devices} rows into {k} micro-batches."
    )
  sharding = jax.sharding.NamedSharding
  params = jax.device_put(params, sharding(mesh, jax.sharding.PartitionSpec()))
  batch = jax.device_put(batch, sharding(mesh, jax.sharding.PartitionSpec(axes)))
  return jax.jit(acc_fn)(params, batch, *extra)


def _rel(value: float, reference: float) -> float:
  return abs(value - reference) / max(abs(reference), 1e-30)


def _max_abs_diff(a: Any, b: Any) -> float:
  diffs = jax.tree.map(
    lambda x, y: jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))), a, b
  )
  return float(max(jax.tree.leaves(diffs), default=0.0))


class _Flattener:
  """Flattens gradient trees to one float64 vector of at most ``_MAX_FIT_COORDS`` coordinates."""

  def __init__(self, params: Any):
    self.size = sum(int(np.size(p)) for p in jax.tree.leaves(params))
    self.index = None
    if self.size > _MAX_FIT_COORDS:  # a fixed random subset, the same for every tree
      rs = np.random.default_rng(0)
      self.index = np.sort(rs.choice(self.size, _MAX_FIT_COORDS, replace=False))

  def __call__(self, tree: Any) -> np.ndarray:
    leaves = [jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)]
    v = jnp.concatenate(leaves) if leaves else jnp.zeros(0)
    if self.index is not None:
      v = v[self.index]
    return np.asarray(v, np.float64)


def _traces_differ(loss_fn: Callable[..., Any], params: Any, mb: Any) -> bool:
  """Whether two traces of ``loss_fn`` differ: randomness drawn in Python (``numpy.random``).

  A key-free JAX function traces to the same program with the same constants
  every time; two traces cost no compilation.
  """
  # A new wrapper per trace: jax caches the trace of a function it has seen.
  a, b = (jax.make_jaxpr(lambda p, m: loss_fn(p, m))(params, mb) for _ in range(2))
  if str(a.jaxpr) != str(b.jaxpr) or len(a.consts) != len(b.consts):
    return True
  return any(not np.array_equal(x, y) for x, y in zip(a.consts, b.consts, strict=True))


def _fit_weights(flat, losses, grads, loss_whole, g_whole, scale, tol) -> Any:
  """Weights ``w`` (summing to 1) with ``sum_i w_i (L_i, g_i) = (L, g)``; None: no fit; False: too small.

  Least squares on the loss and the gradient coordinates, each normalized by the
  whole batch's scale; the fit holds when its largest residual is within ``tol``
  and no weight is negative beyond ``tol``.
  """
  k = len(losses)
  if flat.size + 1 < 2 * k:
    return False  # as many unknowns as equations: any data fits
  lscale = max(abs(loss_whole), 1e-30)
  cols = [
    np.concatenate([[li / lscale], flat(g) / scale]) for li, g in zip(losses, grads, strict=True)
  ]
  target = np.concatenate([[loss_whole / lscale], flat(g_whole) / scale])
  a = np.stack(cols, axis=1)
  # The constraint sum_i w_i = 1 as one more, heavily weighted, equation.
  a = np.concatenate([a, 1e3 * np.ones((1, k))])
  target = np.concatenate([target, [1e3]])
  w, *_ = np.linalg.lstsq(a, target, rcond=None)
  residual = np.max(np.abs(a @ w - target))
  if residual > tol or np.min(w) < -tol:
    return None
  return w


def _count_candidates(mb: Any) -> dict[str, Callable[[Any], Any]]:
  """Counts a ``weight_fn`` might use, ``{"lambda mb: ...": fn}``, most likely first.

  Masks (bool or 0/1 leaves) first, then labels with an ignore index (integer
  leaves with negative entries: count those ``>= 0``), then padded token ids
  (integer leaves of rank >= 2 with zeros: count those ``!= 0``).
  """
  masks, labels, tokens = {}, {}, {}
  for path, x in jax.tree_util.tree_leaves_with_path(mb):
    name = "mb" + jax.tree_util.keystr(path)
    x = np.asarray(x)
    if x.dtype == np.bool_ or (
      np.issubdtype(x.dtype, np.number) and x.size and np.all((x == 0) | (x == 1))
    ):
      masks[f"lambda mb: {name}.sum()"] = lambda m, p=path: _leaf(m, p).sum()
    elif np.issubdtype(x.dtype, np.integer) and x.ndim >= 2:
      if np.any(x < 0):
        labels[f"lambda mb: ({name} >= 0).sum()"] = lambda m, p=path: (_leaf(m, p) >= 0).sum()
      if np.any(x == 0):
        tokens[f"lambda mb: ({name} != 0).sum()"] = lambda m, p=path: (_leaf(m, p) != 0).sum()
  return masks | labels | tokens


def _leaf(tree: Any, path: Any) -> Any:
  for p, x in jax.tree_util.tree_leaves_with_path(tree):
    if p == path:
      return x
  raise KeyError(path)


def _diagnose(fit, used, mbs, weight_fn, mesh, k) -> tuple[str, str]:
  """(cause, reason) from the weight fit and the relative weights ``used``."""
  if fit is False:
    return "unknown", (
      f"the model has too few parameters to tell the causes apart (fewer than 2 k = {2 * k}"
      " gradient coordinates); try a larger model or a smaller num_microbatches."
    )
  if fit is None:
    return "batch_dependence", (
      "no weighting of the micro-batches rebuilds the whole batch's loss and gradient, so a"
      " row's loss depends on the other rows of its batch: BatchNorm in training mode,"
      " features standardized with batch statistics, in-batch negatives or a loss normalized"
      " by a batch statistic. Accumulation cannot reproduce that exactly. Use LayerNorm or"
      " GroupNorm, check with the model in eval mode (running statistics), or accept ghost"
      " batch norm (statistics per micro-batch, see batchnorm= of ga.train_step)."
    )
  tol = 1e-3
  if np.max(np.abs(fit - used)) <= tol:
    where = " on the mesh (check mesh and data_axis, and the batch layout)" if mesh else ""
    return "unknown", (
      "the micro-batches add up to the whole batch with the weights used, yet the accumulated"
      f" result differs{where}. Check that weight_fn and loss_fn see the same micro-batch, and"
      " that the tolerance suits the compute dtype."
    )
  matches = []
  for text, fn in _count_candidates(mbs[0]).items():
    counts = np.array([float(fn(mb)) for mb in mbs])
    if counts.sum() > 0 and np.max(np.abs(counts / counts.sum() - fit)) <= tol:
      matches.append(text)
  what = (
    f"Pass weight_fn counting them, e.g. weight_fn={matches[0]}."
    if matches
    else "Pass weight_fn(microbatch) returning that number (e.g. the non-padding tokens)."
  )
  if weight_fn is None:
    start = (
      "loss_fn averages over a number of items (tokens, unmasked positions) that differs"
      " between micro-batches, and an unweighted accumulation (a mean of micro-batch means)"
      " weighs every micro-batch equally."
    )
  else:
    start = (
      "weight_fn's weights are not proportional to the number of items loss_fn averages over"
      " in each micro-batch."
    )
  return "weighting", f"{start} {what}"
