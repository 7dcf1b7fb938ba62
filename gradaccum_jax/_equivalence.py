"""Does accumulation equal the whole batch? ``check_equivalence`` asks it of a loss (its loss
and gradient), ``check_step`` of a built step (its new params)."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax._accumulate import Accumulate, AccumulateState, MicroStepState
from gradaccum_jax._checks import check_batch, check_num_microbatches, check_real
from gradaccum_jax._microbatch import microbatch, value_and_grad

_MAX_FIT_COORDS = 65536


@dataclasses.dataclass(frozen=True)
class EquivalenceReport:
  """The result of :func:`check_equivalence`; ``str(report)`` is a readable diagnosis.

  Attributes:
    ok: ``loss_rel_error <= rtol and max_rel_grad_error <= rtol`` (the fact; ``cause`` is a hint).
    num_microbatches, weighted, rtol: ``k``, whether a ``weight_fn`` was given, the tolerance.
    loss_whole, loss_accumulated: the whole batch's loss and that of ``ga.value_and_grad``.
    loss_rel_error: ``|loss_accumulated - loss_whole| / |loss_whole|``.
    max_rel_grad_error: the largest ``|accumulated - whole|`` gradient entry over the largest
      ``|whole|`` entry.
    mean_of_means_loss, mean_of_means_error: the naive mean of the micro-batches' mean losses,
      and the larger of its loss and gradient relative errors.
    cause: ``None``, or ``"randomness"``, ``"weighting"``, ``"batch_dependence"``, ``"unknown"``.
    reason: ``None`` when ``ok``, else the likely reason and what to pass.
    fitted_weights: the micro-batch weights (summing to 1) that best rebuild the whole batch.
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
    how = "weighted by weight_fn" if self.weighted else "unweighted"
    lines = [
      f"Accumulation over k={self.num_microbatches} micro-batches ({how}) vs the whole batch:"
      f" {'equivalent' if self.ok else 'NOT equivalent'} (rtol={self.rtol:g}).",
      f"  loss relative error      {self.loss_rel_error:.2e} (whole batch"
      f" {self.loss_whole:.7g}, accumulated {self.loss_accumulated:.7g})",
      f"  gradient relative error  {self.max_rel_grad_error:.2e} (largest |accumulated - whole|"
      " over largest |whole|)",
      f"  naive mean of micro-batch means: loss {self.mean_of_means_loss:.7g}, relative error"
      f" {self.mean_of_means_error:.2e} (the larger of loss and gradient)",
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

  Compares ``ga.value_and_grad(loss_fn, k, ...)`` with ``jax.value_and_grad(loss_fn)`` on the
  whole batch. Accumulation is exact when ``loss_fn`` is a weighted mean over rows that do not
  interact, :math:`L(B) = \sum_{r \in B} \ell_r / \sum_{r \in B} n_r` with ``weight_fn(mb)``
  :math:`= \sum_{r \in mb} n_r`. Otherwise the report names a likely cause and what to pass (the
  causes, how they are told apart and the cost: docs/semantics.md). Use a small batch.

  Args:
    loss_fn: ``loss_fn(params, batch)``, the scalar mean loss over its (micro-)batch, or
      ``(loss, aux)`` with ``has_aux``; ``loss_fn(params, batch, rng)`` when ``rng`` is given.
    params: the parameters (a pytree of float arrays).
    batch: a pytree of arrays sharing a leading batch axis ``B``.
    num_microbatches: ``k``, a positive int dividing ``B`` (``D * k`` on ``D`` data devices).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; aux is not compared.
    weight_fn: the ``weight_fn(microbatch) -> scalar`` you pass to the accumulation, or ``None``.
    rtol: the tolerance, relative to the whole-batch loss and to its gradient's largest entry.
    mesh, data_axis: as in :func:`value_and_grad`; the reference stays one device's whole batch.
    rng: a PRNG key for the whole batch; micro-batch ``i`` gets ``jax.random.fold_in(rng, i)``.

  Returns:
    An :class:`EquivalenceReport`; print it for the diagnosis.

  Raises:
    TypeError: a ``loss_fn`` that is not callable, a ``num_microbatches`` or ``rtol`` not a number.
    ValueError: ``num_microbatches`` or ``rtol`` ``<= 0``, a malformed batch or mesh, ``B % k``.

  Examples:
    >>> import jax.numpy as jnp, gradaccum_jax as ga
    >>> def token_loss(w, batch):  # the mean over the non-padding tokens
    ...   return jnp.sum((batch["x"] * w - 1) ** 2 * batch["mask"]) / jnp.sum(batch["mask"])
    >>> batch = {"x": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6), "mask": jnp.tri(4, 6, 1, bool)}
    >>> w = jnp.linspace(0.1, 0.6, 6)  # sequences of 2, 3, 4 and 5 tokens in batch["mask"]
    >>> report = ga.check_equivalence(token_loss, w, batch, num_microbatches=2)
    >>> report.cause, report.reason.split("e.g. ")[-1]
    ('weighting', "weight_fn=lambda mb: mb['mask'].sum().")
    >>> ga.check_equivalence(token_loss, w, batch, 2, weight_fn=lambda mb: mb["mask"].sum()).ok
    True
  """
  k = check_num_microbatches(num_microbatches, allow_schedule=False)
  acc_fn = value_and_grad(  # checks loss_fn, weight_fn, mesh and data_axis
    loss_fn, k, has_aux=has_aux, weight_fn=weight_fn, mesh=mesh, data_axis=data_axis
  )
  if not check_real(rtol, "rtol must be a positive float") > 0:
    raise ValueError(f"rtol must be positive, got {rtol=}.")
  check_batch(batch, k)
  vg = jax.jit(jax.value_and_grad(loss_fn, has_aux=bool(has_aux)))

  def split(out):  # (loss as a float, grads), without aux
    return float(out[0][0] if has_aux else out[0]), out[1]

  extra = () if rng is None else (rng,)
  keys = [() if rng is None else (jax.random.fold_in(rng, i),) for i in range(k)]
  loss_acc, g_acc = split(jax.jit(acc_fn)(params, batch, *extra))
  if mesh is not None:  # the reference is the single-device whole batch, via the host
    params, batch, g_acc = jax.device_put(
      jax.tree.map(np.asarray, (params, batch, g_acc)), jax.devices()[0]
    )
  loss_whole, g_whole = split(vg(params, batch, *extra))
  mbs = [microbatch(batch, i, k) for i in range(k)]  # in ga's order: rows i, i + k, ...
  micro = [split(vg(params, mb, *key)) for mb, key in zip(mbs, keys, strict=True)]
  losses, grads = zip(*micro, strict=True)
  scale = max(float(max(jnp.max(jnp.abs(g)) for g in jax.tree.leaves(g_whole))), 1e-30)
  loss_err, grad_err = _rel_errors(loss_acc, g_acc, loss_whole, g_whole, scale)
  g_mean, mom_loss = jax.tree.map(lambda *g: sum(g) / k, *grads), float(np.mean(losses))
  mom_err = max(_rel_errors(mom_loss, g_mean, loss_whole, g_whole, scale))
  ok = bool(loss_err <= rtol and grad_err <= rtol)  # False for a NaN or an Inf
  report = EquivalenceReport(
    ok, k, weight_fn is not None, float(rtol), loss_whole, loss_acc, loss_err, grad_err,
    mom_loss, mom_err,
  )  # fmt: skip
  if ok:
    return report
  if rng is not None:  # micro-batch 0 again, with another key
    again = split(vg(params, mbs[0], jax.random.fold_in(rng, k)))[0]
    random = abs(again - losses[0]) > rtol * max(abs(losses[0]), 1e-30)
  else:
    random = _traces_differ(loss_fn, params, mbs[0])
  if random:
    return dataclasses.replace(report, cause="randomness", reason=_RANDOM)
  fit = _fit_weights(losses, grads, loss_whole, g_whole, scale, max(rtol, 1e-4))
  cause, reason = _diagnose(fit, mbs, weight_fn, mesh, k)
  weights = tuple(map(float, fit)) if isinstance(fit, np.ndarray) else None
  return dataclasses.replace(report, cause=cause, reason=reason, fitted_weights=weights)


_RANDOM = (
  "loss_fn is random (another key changes its loss, or it draws new constants each time it is"
  " traced, e.g. with numpy.random): the whole batch and the micro-batches draw different noise."
  " Check with randomness off (deterministic=True, model.eval(), dropout rate 0)."
)


def _rel_errors(loss, grads, loss_whole, g_whole, scale) -> tuple[float, float]:
  """The loss's relative error, and the gradient's: its largest absolute error over ``scale``."""
  diffs = jax.tree.map(
    lambda x, y: jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))), grads, g_whole
  )
  loss_err = abs(loss - loss_whole) / max(abs(loss_whole), 1e-30)
  return loss_err, float(max(jax.tree.leaves(diffs), default=0.0)) / scale


def _traces_differ(loss_fn: Callable[..., Any], params: Any, mb: Any) -> bool:
  """Whether two traces of ``loss_fn`` differ: randomness drawn in Python (``numpy.random``)."""
  # A new wrapper per trace: jax caches the trace of a function it has seen.
  a, b = (jax.make_jaxpr(lambda p, m: loss_fn(p, m))(params, mb) for _ in range(2))
  same = str(a.jaxpr) == str(b.jaxpr) and len(a.consts) == len(b.consts)
  return not (same and all(np.array_equal(x, y) for x, y in zip(a.consts, b.consts, strict=True)))


def _fit_weights(losses, grads, loss_whole, g_whole, scale, tol) -> Any:
  """Least-squares weights ``w`` (summing to 1) with ``sum_i w_i (L_i, g_i) = (L, g)``; None if
  none fits within ``tol`` or one is below ``-tol``; False for too few gradient coordinates."""
  k, size = len(losses), sum(int(np.size(g)) for g in jax.tree.leaves(g_whole))
  if size + 1 < 2 * k:
    return False  # as many unknowns as equations: any data fits
  index = None
  if size > _MAX_FIT_COORDS:  # a fixed random subset, the same for every gradient
    index = np.sort(np.random.default_rng(0).choice(size, _MAX_FIT_COORDS, replace=False))

  def column(loss, g):
    v = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(g)])
    v = np.asarray(v if index is None else v[index], np.float64) / scale
    return np.concatenate([[loss / max(abs(loss_whole), 1e-30)], v, [1e3]])

  a = np.stack([column(loss, g) for loss, g in zip(losses, grads, strict=True)], axis=1)
  target = column(loss_whole, g_whole)
  w, *_ = np.linalg.lstsq(a, target, rcond=None)
  return None if np.max(np.abs(a @ w - target)) > tol or np.min(w) < -tol else w


def _suggest_weight_fn(mbs: list[Any], fit: np.ndarray, tol: float) -> str | None:
  """A ``"lambda mb: ..."`` whose counts match the fitted weights, or None: masks first, then
  labels with a negative ignore index (count ``>= 0``), then padded token ids (count ``!= 0``)."""
  found = []  # (rank, text, counts per micro-batch)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(mbs[0])]
  for path, xs in zip(paths, zip(*map(jax.tree.leaves, mbs), strict=True), strict=True):
    name, x, xs = "mb" + path, np.asarray(xs[0]), [np.asarray(v) for v in xs]
    binary = np.issubdtype(x.dtype, np.number) and x.size and np.all((x == 0) | (x == 1))
    if x.dtype == np.bool_ or binary:
      found.append((0, f"{name}.sum()", [v.sum() for v in xs]))
    elif np.issubdtype(x.dtype, np.integer) and x.ndim >= 2:
      if np.any(x < 0):
        found.append((1, f"({name} >= 0).sum()", [(v >= 0).sum() for v in xs]))
      if np.any(x == 0):
        found.append((2, f"({name} != 0).sum()", [(v != 0).sum() for v in xs]))
  for _, text, counts in sorted(found, key=lambda f: f[0]):
    counts = np.array(counts, float)
    if counts.sum() > 0 and np.max(np.abs(counts / counts.sum() - fit)) <= tol:
      return f"lambda mb: {text}"
  return None


def _diagnose(fit, mbs, weight_fn, mesh, k) -> tuple[str, str]:
  """(cause, reason) from the weight fit and the relative weights used."""
  if fit is False:
    return "unknown", (
      f"the model has too few parameters to tell the causes apart (fewer than 2 k = {2 * k}"
      " gradient coordinates); try a larger model or a smaller num_microbatches."
    )
  if fit is None:
    return "batch_dependence", (
      "no weighting of the micro-batches rebuilds the whole batch's loss and gradient, so a row's"
      " loss depends on the other rows of its batch: BatchNorm in training mode, features"
      " standardized per batch, in-batch negatives, a loss normalized by a batch statistic."
      " Accumulation cannot match that. Use LayerNorm or GroupNorm, check in eval mode (running"
      " statistics), or accept ghost batch norm (ga.train_step's batchnorm=, per micro-batch)."
    )
  tol, used = 1e-3, np.array([1.0 if weight_fn is None else float(weight_fn(mb)) for mb in mbs])
  if np.max(np.abs(fit - used / max(used.sum(), 1e-30))) <= tol:
    where = " on the mesh (check mesh and data_axis, and the batch layout)" if mesh else ""
    return "unknown", (
      "the micro-batches add up to the whole batch with the weights used, yet the accumulated"
      f" result differs{where}. Check that weight_fn and loss_fn see the same micro-batch, and"
      " that the tolerance suits the compute dtype."
    )
  match = _suggest_weight_fn(mbs, fit, tol)
  what = f"weight_fn={match}" if match else "the number of non-padding tokens"
  start = (
    "weight_fn's weights are not proportional to the number of items loss_fn averages over in"
    " each micro-batch."
    if weight_fn is not None
    else "loss_fn averages over a number of items (tokens, unmasked positions) that differs"
    " between micro-batches, and an unweighted accumulation (a mean of micro-batch means)"
    " weighs every micro-batch equally."
  )
  return "weighting", f"{start} Pass weight_fn(microbatch) counting them, e.g. {what}."


@dataclasses.dataclass(frozen=True)
class StepCheck:
  """The result of :func:`check_step`; ``str(check)`` is a table of the leaves.

  Attributes:
    ok: whether every leaf's ``max_rel`` is within ``rtol`` (and finite).
    rtol: the tolerance used.
    scale: the largest entry of the reference update ``|p_ref - p|``.
    max_abs: ``{leaf path: max |p_step - p_ref|}``.
    max_rel: ``{leaf path: max_abs / scale}``.
  """

  ok: bool
  rtol: float
  scale: float
  max_abs: dict[str, float]
  max_rel: dict[str, float]

  def __str__(self) -> str:
    verdict = "equivalent" if self.ok else "NOT equivalent"
    rows = [f"One window of the step vs the single-device whole-batch update: {verdict}"
            f" (rtol={self.rtol:g} of the largest reference update, {self.scale:.3g})"]  # fmt: skip
    for leaf, rel in self.max_rel.items():
      flag = "" if rel <= self.rtol else "  <- differs"
      rows.append(f"  {leaf:<40} max abs {self.max_abs[leaf]:.3e}  relative {rel:.3e}{flag}")
    return "\n".join(rows)


def check_step(
  step: Callable[..., Any], loss_fn: Callable[..., Any], inner_tx: optax.GradientTransformation,
  params: Any, opt_state: Any, batch: Any, *, has_aux: bool = False, inner_state: Any = None,
  rtol: float = 1e-4,
) -> StepCheck:  # fmt: skip
  """Runs one window of a built step on copies of its arguments and compares the new params with
  the single-device whole-batch update by the same inner optimizer.

  The reference is ``p_ref = p + inner_tx.update(jax.grad(loss_fn)(p, batch), s, p)`` on one device.
  Check gradient scales with SGD: Adam's first update is about ``lr * sign(g)`` (docs/verifying.md).

  Args:
    step: ``step(params, opt_state, batch)`` returning ``(new_params, ...)``: a ``ga`` step (a
      window per call) or your own jitted step.
    loss_fn: ``loss_fn(params, batch)``, the whole batch's mean loss (``(loss, aux)`` with
      ``has_aux``); deterministic.
    inner_tx: the optimizer the step applies (the one inside ``ga.accumulate``).
    params, opt_state, batch: the step's arguments (not modified nor donated).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    inner_state: the reference's optimizer state; default: ``opt_state.inner_state`` of a ``ga``
      state, else ``inner_tx.init(params)``.
    rtol: the tolerance of ``ok``.

  Returns:
    A :class:`StepCheck`; print it for the leaves.

  Raises:
    TypeError, ValueError: for a bad argument, or new params unlike ``params``.

  Examples:
    >>> import jax.numpy as jnp, optax, gradaccum_jax as ga
    >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
    >>> batch = {"x": jnp.arange(24.0).reshape(8, 3) / 10, "y": jnp.ones(8)}
    >>> tx, w = ga.accumulate(optax.sgd(0.1), 4), jnp.zeros(3)
    >>> step = ga.train_step(loss, tx)
    >>> result = ga.check_step(step, loss, optax.sgd(0.1), w, tx.init(w), batch)
    >>> isinstance(result, ga.StepCheck), result.ok
    (True, True)
  """
  for name, fn in (("step", step), ("loss_fn", loss_fn)):
    if not callable(fn):
      raise TypeError(f"{name} must be a function, got {fn!r}.")
  if isinstance(inner_tx, Accumulate):
    raise TypeError(
      "inner_tx is the ga.accumulate transformation; pass the optimizer inside it, which the"
      " reference applies once to the whole batch: inner_tx=tx.inner (e.g. optax.sgd(0.1))."
    )
  if not isinstance(inner_tx, optax.GradientTransformation):
    raise TypeError(f"inner_tx must be an optax transformation (e.g. optax.sgd), got {inner_tx!r}.")
  if not check_real(rtol, "rtol must be a positive float") > 0:
    raise ValueError(f"rtol must be a positive float, got {rtol!r}.")
  if inner_state is None and isinstance(opt_state, AccumulateState | MicroStepState):
    inner_state = opt_state.inner_state
  # Host copies first: the step may donate its arguments.
  host = jax.tree.map(np.asarray, (params, batch, inner_state))
  out = step(
    *jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, (params, opt_state, batch))
  )
  new = jax.tree.map(np.asarray, out[0] if isinstance(out, tuple | list) else out)
  p0, b, s0 = jax.device_put(host, jax.devices()[0])  # the single-device whole batch

  @jax.jit
  def reference(p, s, b):
    grads = jax.grad(loss_fn, has_aux=has_aux)(p, b)
    updates, _ = inner_tx.update(grads[0] if has_aux else grads, s, p)
    return optax.apply_updates(p, updates)

  ref = jax.tree.map(np.asarray, reference(p0, inner_tx.init(p0) if s0 is None else s0, b))
  if jax.tree.structure(new) != jax.tree.structure(ref):
    raise ValueError(
      f"The step's new params have the structure {jax.tree.structure(new)}, the params"
      f" {jax.tree.structure(ref)}: step must return (new_params, ...)."
    )

  def diff(a, b):
    return float(np.max(np.abs(np.float64(a) - b), initial=0))

  scale = max(map(diff, jax.tree.leaves(ref), jax.tree.leaves(host[0])), default=0.0)
  paths = [jax.tree_util.keystr(path) or "params" for path, _ in jax.tree.leaves_with_path(ref)]
  max_abs = dict(zip(paths, map(diff, jax.tree.leaves(new), jax.tree.leaves(ref)), strict=True))
  max_rel = {p: a / scale if scale > 0 else (0.0 if a == 0 else np.inf) for p, a in max_abs.items()}
  ok = all(np.isfinite(v) and v <= rtol for v in max_rel.values())
  return StepCheck(bool(ok), float(rtol), scale, max_abs, max_rel)
