"""Does accumulation equal the whole batch? ``check_equivalence`` asks it of a loss (its loss
and gradient), ``check_step`` of a built step (its new params)."""

from __future__ import annotations

import dataclasses
import re
import sys
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax._accumulate import Accumulate, AccumulateState, MicroStepState
from gradaccum_jax._checks import check_batch, check_num_microbatches, check_real
from gradaccum_jax._micro_step import MicroStep
from gradaccum_jax._microbatch import microbatch, value_and_grad

_MAX_FIT_COORDS = 65536


def _wrap(text: str) -> str:
  return textwrap.fill(text, 100, initial_indent="  ", subsequent_indent="    ")


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
      lines.append(_wrap(text).replace("\xa0", " "))
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
    params, batch, g_acc = jax.device_put(_host((params, batch, g_acc)), jax.devices()[0])
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
    ok: the step's gradient read and within ``rtol``, and every update entry within ``rtol *
      scale`` or within what ``inner_tx`` makes of a gradient within ``rtol``; never with the
      gradient unread (``verdict`` is then ``"not verified"``).
    rtol: the tolerance used.
    scale: the largest entry of the reference update ``|p_ref - p|``.
    max_abs: ``{leaf path: max |p_step - p_ref|}``.
    max_rel: ``{leaf path: max_abs / scale}``, the update's relative error.
    grad_rel: ``{leaf path: largest error of the step's gradient}`` over the largest entry of
      the whole batch's, as read from ``compared``; empty if it could not be read.
    grad_norm_rel: ``|grad_norm / |g| - 1|`` for a step that reports ``metrics["grad_norm"]``.
    max_rel_grad_error: the largest of ``grad_rel`` and ``grad_norm_rel``, or None.
    compared: where the step's gradient was read from.
    optimizer_noise: leaves whose update differs by more than ``rtol * scale`` but no more than
      ``inner_tx`` moves for a gradient within ``rtol`` (Adam, where the gradient is about 0).
    reason: None when ``ok``, else what differs and what to check.
  """

  ok: bool
  rtol: float
  scale: float
  max_abs: dict[str, float]
  max_rel: dict[str, float]
  grad_rel: dict[str, float] = dataclasses.field(default_factory=dict)
  grad_norm_rel: float | None = None
  max_rel_grad_error: float | None = None
  compared: str = "nothing"
  optimizer_noise: tuple[str, ...] = ()
  reason: str | None = None

  @property
  def verdict(self) -> str:
    """``"equivalent"``, ``"NOT equivalent"`` or ``"not verified"`` (the gradient unseen)."""
    unseen = (self.reason or "").startswith("not verified")
    return "equivalent" if self.ok else "not verified" if unseen else "NOT equivalent"

  def __str__(self) -> str:
    worst = max(self.max_rel.values(), default=0.0)
    error = self.max_rel_grad_error
    grad = "not read" if error is None else f"relative error {error:.3e}"
    rows = [
      "One window of the step vs the single-device whole batch:"
      f" {self.verdict} (rtol={self.rtol:g})",
      _wrap(f"gradient: {grad}, from {self.compared}"),
      f"  update:   relative error {worst:.3e} of the largest reference update, {self.scale:.3g}",
    ]
    for leaf, rel in self.max_rel.items():
      grad = self.grad_rel.get(leaf)
      flag = "  ~ optimizer noise" if leaf in self.optimizer_noise else ""
      if not (grad is None or grad <= self.rtol) or not (rel <= self.rtol or flag):
        flag = "  <- differs"
      rows.append(
        f"  {leaf:<32} gradient {'-' if grad is None else f'{grad:.3e}':>9}  update max abs"
        f" {self.max_abs[leaf]:.3e}  relative {rel:.3e}{flag}"
      )
    notes = [self.reason] if self.reason else []
    if not self.scale > 0 and self.grad_rel:
      notes.append("The reference update is 0 (a learning rate of 0): judged by the gradient.")
    if self.optimizer_noise:
      notes.append(_NOISE)
    rows += map(_wrap, notes)
    return "\n".join(rows)


_NOISE = (
  "~ optimizer noise: the update differs where the gradient is within rtol of 0, by no more"
  " than inner_tx moves for a gradient within rtol of the whole batch's (Adam moves such entries"
  " by about its learning rate, whatever their size): judged by the gradient."
)
_ZERO_UPDATE = (
  "the reference update is 0 on every entry (a learning rate of 0 at this step, as at the start"
  " of a warm-up from 0) and the step's gradient was not read in full (compared: {}), so nothing"
  " was checked. Check at a learning rate above 0 (the optimizer without its schedule, in the"
  " step and as inner_tx), or with an optimizer whose state keeps the gradient's moments (adam)."
)
_NOT_VERIFIED = (
  "not verified: the step's gradient was not read (compared: {}), and an update that agrees"
  " says little of it (Adam's first update is about lr * sign(g), whatever the gradient's"
  " scale). Pass inner_state= and a step whose state holds inner_tx's (ga.accumulate's, or"
  " optax.MultiSteps'), report metrics['grad_norm'] from the step, or check it with an optimizer"
  " that is linear in the gradient (optax.sgd) or keeps its moments (optax.adam)."
)
_GRADIENT_DIFFERS = (
  "the step's gradient is not the whole batch's: a gradient reduced twice or a loss scaled (by"
  " k, by the devices), a mean of per-micro-batch means over uneven token counts (pass"
  " weight_fn), or each micro-batch clipped (put clipping inside ga.accumulate's inner"
  " optimizer). ga.check_equivalence(loss_fn, params, batch, k) diagnoses the loss."
)
_UPDATE_DIFFERS = (
  "the update differs by more than inner_tx makes of a gradient within rtol{}: check that"
  " inner_tx is the optimizer the step applies (its learning rate, schedule and state)."
)


def check_step(
  step: Callable[..., Any], loss_fn: Callable[..., Any], inner_tx: optax.GradientTransformation,
  params: Any, opt_state: Any, batch: Any = None, *, has_aux: bool = False,
  inner_state: Any = None, rtol: float = 1e-4,
) -> StepCheck:  # fmt: skip
  """Runs one window of a built step on copies of its arguments and compares its gradient and
  new params with the single-device whole batch's, through the same inner optimizer.

  The reference is ``g = jax.grad(loss_fn)(p, batch)`` and ``p + inner_tx.update(g, s, p)``.
  The step's gradient is read from its inner optimizer's new state (Adam's moments), from an
  update proportional to it (SGD) and from ``metrics["grad_norm"]``; an update entry may differ
  by what ``inner_tx`` makes of a gradient within ``rtol`` (docs/verifying.md).

  Args:
    step: the step as you train with it: ``step(params, opt_state, batch)`` returning
      ``(new_params, opt_state, ...)`` (``ga.train_step`` or your own), a ``ga.linen_train_step``
      (``step(train_state, batch)``), a ``ga.nnx_train_step`` (``step(model, optimizer,
      batch)``), or a ``ga.micro_step``, called here on the ``k`` micro-batches of ``batch``.
    loss_fn: the whole batch's mean loss, ``loss_fn(params, batch)`` (NNX: ``loss_fn(model,
      batch)``, the step's), ``(loss, aux)`` with ``has_aux``; deterministic.
    inner_tx: the optimizer the step applies (the one inside ``ga.accumulate``).
    params, opt_state, batch: the step's arguments, copied: ``(params, opt_state, batch)``,
      ``(train_state, batch)`` or ``(model, optimizer, batch)``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    inner_state: the reference's optimizer state; default: the step's where it is ``inner_tx``'s
      (``opt_state.inner_state`` of a ``ga`` state), else ``inner_tx.init(params)``.
    rtol: the tolerance of ``ok``.

  Returns:
    A :class:`StepCheck`; print it for the gradient and the leaves.

  Raises:
    TypeError, ValueError: for a bad argument, a state inside a window, or new params unlike
      ``params``.

  Examples:
    >>> import jax.numpy as jnp, optax, gradaccum_jax as ga
    >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
    >>> batch = {"x": jnp.arange(24.0).reshape(8, 3) / 10, "y": jnp.ones(8)}
    >>> tx, w = ga.accumulate(optax.adam(0.1), 4), jnp.zeros(3)
    >>> result = ga.check_step(ga.train_step(loss, tx), loss, optax.adam(0.1), w, tx.init(w), batch)
    >>> isinstance(result, ga.StepCheck), result.ok, result.max_rel_grad_error < 1e-5
    (True, True, True)
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
  window = _run_window(step, loss_fn, params, opt_state, batch)
  like = jax.eval_shape(inner_tx.init, window.params)
  if inner_state is None:  # the step's where it has inner_tx's structure
    found = _inner_of(window.state, like, window.params)
    inner_state = found[1] if found is not None and found[0] == 0 else inner_tx.init(window.params)
  ref = _whole_batch(window, inner_tx, has_aux, inner_state, float(rtol))
  if jax.tree.structure(window.new_params) != jax.tree.structure(ref.params):
    raise ValueError(
      f"The step's new params have the structure {jax.tree.structure(window.new_params)}, the"
      f" params {jax.tree.structure(ref.params)}: step must return (new_params, ...)."
    )
  return _judge(window, ref, float(rtol), _inner_of(window.new_state, like, window.params))


class _Window(NamedTuple):
  """One window of a step, on host copies: what :func:`check_step` compares."""

  params: Any  # the trained params before it
  batch: Any
  loss_fn: Callable[..., Any]  # loss_fn(params, batch), on these params
  new_params: Any
  state: Any  # the step's optimizer state before it
  new_state: Any  # and after, or None
  metrics: Any  # the step's metrics dict, or None


_HOW = (
  "check_step calls the step as you pass its arguments: check_step(step, loss_fn, inner_tx,"
  " params, opt_state, batch) for ga.train_step or your own step(params, opt_state, batch),"
  " (..., train_state, batch) for ga.linen_train_step, (..., model, optimizer, batch) for"
  " ga.nnx_train_step, (..., params, state, batch) with the window's whole batch for a"
  " ga.micro_step."
)


def _run_window(step, loss_fn, params, opt_state, batch) -> _Window:
  """Runs one window of ``step`` on copies of its arguments, by the kind of step."""
  nnx = sys.modules.get("flax.nnx")
  train_state = sys.modules.get("flax.training.train_state")
  is_nnx = nnx is not None and isinstance(params, nnx.Module)
  is_train_state = train_state is not None and isinstance(params, train_state.TrainState)
  if is_nnx and not isinstance(opt_state, nnx.Optimizer):
    raise TypeError(
      f"An NNX model's step takes (model, optimizer, batch), the optimizer an nnx.Optimizer"
      f"(model, ga.accumulate(inner, k), wrt=nnx.Param), got {type(opt_state).__name__}: {_HOW}"
    )
  if is_train_state and batch is not None and opt_state is not None:
    raise TypeError(f"A TrainState's step takes (train_state, batch): {_HOW}")
  batch = opt_state if is_train_state and batch is None else batch
  if batch is None:
    raise TypeError(f"batch is missing: {_HOW}")
  if is_nnx:  # the reference's loss on the trained variables (optimizer.wrt), the rest held
    graphdef, trained, rest = nnx.split(params, opt_state.wrt, ..., graph=opt_state.graph)
    rest, model_loss = nnx.as_pure(rest), loss_fn
    host = _host_arguments(nnx.as_pure(trained), nnx.as_pure(opt_state.opt_state), batch)
    whole, parts = nnx.split((params, opt_state))  # copied: nnx.clone shares the arrays
    model, optimizer = nnx.merge(whole, jax.tree.map(lambda x: x.copy(), parts))
    metrics = _call(step, model, optimizer, _copies(batch), copy=False)
    new = nnx.as_pure(nnx.split(model, optimizer.wrt, ..., graph=optimizer.graph)[1])
    new_state = nnx.as_pure(optimizer.opt_state)

    def loss_fn(params, batch):
      return model_loss(nnx.merge(graphdef, params, rest), batch)

  elif is_train_state:
    host = _host_arguments(params.params, params.opt_state, batch)
    out = _call(step, params, batch)
    new, metrics = out if isinstance(out, tuple | list) else (out, None)
    new, new_state = new.params, new.opt_state
  elif isinstance(step, MicroStep):  # on the k micro-batches of batch (rows i, i + k, ...)
    if step.has_state:
      raise ValueError(
        "check_step runs a ga.micro_step as step(params, state, microbatch), and compares it with"
        " a loss without model state; this one has has_state=True. Check the same loss with"
        " ga.micro_step(..., has_state=False) (model state fixed, e.g. BatchNorm in eval mode)."
      )
    host = _host_arguments(params, opt_state, batch)
    k = step.tx.num_microbatches
    k = k if isinstance(k, int) else max(int(k(np.asarray(opt_state.count))), 1)
    check_batch(batch, k)
    new, new_state, metrics = _copies((params, opt_state)) + (None,)
    for i in range(k):
      new, new_state, metrics = step(new, new_state, microbatch(batch, i, k))
  else:
    host = _host_arguments(params, opt_state, batch)
    out = _call(step, params, opt_state, batch)
    out = out if isinstance(out, tuple | list) else (out,)
    metrics = next((o for o in out[1:] if isinstance(o, dict) and "grad_norm" in o), None)
    new, new_state = out[0], (out[1] if len(out) > 1 and out[1] is not metrics else None)
  return _Window(host[0], host[2], loss_fn, _host(new), host[1], _host(new_state), metrics)


def _call(step, *args, copy=True):
  """``step`` on copies of ``args`` (it may donate them); its error says how it was called."""
  try:
    return step(*(_copies(args) if copy else args))
  except Exception as e:
    e.add_note(_HOW)
    raise


def _copies(tree):
  return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def _host(tree):
  """Host copies of the arrays (PRNG keys, which numpy cannot hold, copied on the device)."""

  def host(x):
    key = isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return x.copy() if key else np.asarray(x)

  return jax.tree.map(host, tree)


def _ga_state(tree) -> Any:
  """The first :class:`AccumulateState` (or :class:`MicroStepState`) in ``tree``, or None."""
  is_ga = lambda x: isinstance(x, AccumulateState | MicroStepState)  # noqa: E731
  return next((x for x in jax.tree.leaves(tree, is_leaf=is_ga) if is_ga(x)), None)


def _host_arguments(params, state, batch) -> Any:
  """Host copies of ``(params, state, batch)``, refusing a state inside a window."""
  ga = _ga_state(state)
  if ga is not None and int(np.asarray(ga.micro_step)) != 0:
    raise ValueError(
      f"opt_state holds an open window (micro_step={int(np.asarray(ga.micro_step))}), whose sums"
      " the step would add to this batch's: check_step compares one whole window with the whole"
      " batch. Pass a state at a window's start (tx.init(params), or one a closing call returned)."
    )
  return _host((params, state, batch))


def _subtrees(tree: Any) -> list[Any]:
  """Every node of ``tree``, the root first, level by level."""
  out, todo = [], [tree]
  while todo:
    node = todo.pop(0)
    out.append(node)
    kids = jax.tree_util.tree_flatten(node, is_leaf=lambda x, node=node: x is not node)[0]
    todo += [] if len(kids) == 1 and kids[0] is node else kids
  return out


def _inner_of(state, like, params) -> tuple[int, Any] | None:
  """``(i, s)``: ``s`` the first subtree of ``state`` shaped as ``like``'s ``i``-th subtree (in
  :func:`_subtrees`' order; 0: inner_tx's whole state), the largest that one fits: a ``ga``
  state's ``inner_state``, ``optax.MultiSteps``' ``inner_opt_state``, a wrapper's inner state,
  or the part of ``inner_tx``'s state that another state keeps (Adam's, beside a clip's); None
  if none fits. A subtree shaped as the params alone (an accumulator) is not looked for."""
  ga = _ga_state(state)
  mine = _subtrees(state if ga is None else ga.inner_state)
  plain = jax.tree.structure(params)

  def shape(x):
    return jax.tree.structure(x), [np.shape(v) for v in jax.tree.leaves(x)]

  for i, sub in enumerate(_subtrees(like)):
    if jax.tree.leaves(sub) and jax.tree.structure(sub) != plain:
      found = next((x for x in mine if shape(x) == shape(sub)), None)
      if found is not None:
        return i, found
  return None


class _Reference(NamedTuple):
  """The single-device whole batch, on the host."""

  grads: Any  # g = jax.grad(loss_fn)(p, batch)
  params: Any  # p + inner_tx.update(g, s, p)
  states: tuple[Any, Any, Any]  # inner_tx's new state at g, -g and 0
  moved: Any  # per entry: the most inner_tx's update moves for a gradient within rtol of g
  factor: float | None  # c where inner_tx's update is c * g (SGD), else None


def _whole_batch(window: _Window, inner_tx, has_aux, inner_state, rtol) -> _Reference:
  """The whole batch's gradient, and ``inner_tx``'s update and state at it (``value=`` and
  ``grad=`` passed as ``ga`` passes them); its updates at ``g ± rtol max|g| r`` (random signs
  ``r``: what it makes of a gradient within ``rtol``), at ``2 g`` and ``g / 2`` (is it ``c g``?),
  and its states at ``-g`` and ``0`` (which of their trees are odd in ``g``)."""
  tx = optax.with_extra_args_support(inner_tx)
  p, s, b = jax.device_put((window.params, inner_state, window.batch), jax.devices()[0])

  def update(g, loss, p, s):
    return tx.update(g, s, p, value=loss, grad=g)

  @jax.jit
  def reference(p, s, b):
    out, g = jax.value_and_grad(window.loss_fn, has_aux=has_aux)(p, b)
    loss = out[0] if has_aux else out
    updates, new_s = update(g, loss, p, s)
    return g, loss, optax.apply_updates(p, updates), updates, new_s

  g, loss, new_p, updates, new_s = reference(p, s, b)
  eps = rtol * max((float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g)), default=0.0)
  rng = np.random.default_rng(0)
  signs = jax.tree.map(lambda x: np.where(rng.random(x.shape) < 0.5, -1, 1).astype(x.dtype), g)

  @jax.jit
  def around(g, signs, loss, p, s):
    def at(scale, shift):
      return update(jax.tree.map(lambda x, r: scale * x + shift * r, g, signs), loss, p, s)

    return at(1, eps)[0], at(1, -eps)[0], at(2, 0)[0], at(0.5, 0)[0], at(-1, 0)[1], at(0, 0)[1]

  up, down, double, half, flipped, zero = around(g, signs, loss, p, s)
  moved = jax.tree.map(
    lambda u, a, b: jnp.maximum(jnp.abs(a - u), jnp.abs(b - u)), updates, up, down
  )
  factor = _factor(*_host((g, updates, double, half)))
  return _Reference(*_host((g, new_p, (new_s, flipped, zero), moved)), factor)


def _factor(grads, updates, double, half) -> float | None:
  """``c`` if ``updates = c * grads``, ``c != 0``, and doubling or halving the gradient does
  the same to the update (no clipping, no normalization), else None."""
  g, u, u2, uh = (np.concatenate([np.ravel(x).astype(np.float64) for x in jax.tree.leaves(t)])
                  for t in (grads, updates, double, half))  # fmt: skip
  top, norm = np.max(np.abs(u), initial=0.0), float(g @ g)
  if not (top > 0 and norm > 0):
    return None
  c = float(u @ g) / norm
  pairs = ((u, c * g), (u2 / 2, u), (uh * 2, u))
  same = all(np.max(np.abs(a - b)) <= 1e-5 * top for a, b in pairs)
  return c if np.isfinite(c) and c != 0 and same else None


def _error(a, b) -> float:
  """``max |a - b|`` in float64; inf for a NaN."""
  err = float(np.max(np.abs(np.float64(a) - b), initial=0.0))
  return err if np.isfinite(err) else np.inf


def _from_state(params, states, mine) -> tuple[dict[str, float], list[str]]:
  """The gradient's relative error per params leaf, read from the inner optimizer's new state
  ``mine``: each float leaf whose path ends in a params leaf's path and has its shape (Adam's
  ``mu`` and ``nu``, under any wrapper), the step's against the reference's ``T(g)``, over the
  largest entry of the gradient's part ``T(g) - T(0)`` of its tree. Trees odd in ``g`` (``mu``,
  whose error is the gradient's) are read, else the others (``nu``)."""
  if mine is None:
    return {}, []
  index, mine = mine
  states = [_subtrees(x)[index] for x in states]  # the part of inner_tx's state the step keeps
  paths = [
    (jax.tree_util.keystr(p), np.shape(x)) for p, x in jax.tree_util.tree_leaves_with_path(params)
  ]
  trees: dict[str, list] = {}  # tree name -> [(params leaf index, r, r(-g), r(0), mine)]
  leaves = zip(
    jax.tree_util.tree_leaves_with_path(states[0]),
    *map(jax.tree.leaves, (*states[1:], mine)),
    strict=True,
  )
  for (path, r), rf, r0, m in leaves:
    key = jax.tree_util.keystr(path)
    fits = [i for i, (p, shape) in enumerate(paths) if key.endswith(p) and np.shape(r) == shape]
    if fits and jnp.issubdtype(np.result_type(r), jnp.inexact):
      i = max(fits, key=lambda i: len(paths[i][0]))
      trees.setdefault(key[: len(key) - len(paths[i][0])] or "state", []).append((i, r, rf, r0, m))
  found = []  # (odd, name, {params leaf index: error})
  for name, rows in trees.items():
    part = max(_error(r, r0) for _, r, _, r0, _ in rows)
    if 0 < part < np.inf:  # T(g) + T(-g) = 2 T(0) for an odd T
      odd = max(_error(np.float64(r) + rf, 2 * np.float64(r0)) for _, r, rf, r0, _ in rows)
      found.append((odd <= 1e-3 * part, name, {i: _error(m, r) / part for i, r, _, _, m in rows}))
  read = [f for f in found if f[0]] or found
  names = [p or "params" for p, _ in paths]
  errors = {
    names[i]: max(f[2][i] for f in read if i in f[2]) for i in {i for f in read for i in f[2]}
  }
  return dict(sorted(errors.items(), key=lambda e: names.index(e[0]))), [f[1] for f in read]


def _judge(window: _Window, ref: _Reference, rtol: float, mine: Any) -> StepCheck:
  """The verdict: the gradient where it was read (``mine``: the step's new inner state), the
  update within what ``inner_tx`` makes of a gradient within ``rtol``, and the gradient seen."""
  paths = [jax.tree_util.keystr(p) or "params" for p, _ in jax.tree.leaves_with_path(ref.params)]
  new, old, target = (jax.tree.leaves(t) for t in (window.new_params, window.params, ref.params))
  scale = max(map(_error, target, old), default=0.0)
  diffs = [np.abs(np.float64(a) - b) for a, b in zip(new, target, strict=True)]
  max_abs = {p: float(np.max(d, initial=0.0)) for p, d in zip(paths, diffs, strict=True)}
  max_rel = {p: a / scale if scale > 0 else (0.0 if a == 0 else np.inf) for p, a in max_abs.items()}
  bound = [np.maximum(rtol * scale, m) for m in jax.tree.leaves(ref.moved)]
  within = {p: bool(np.all(d <= m)) for p, d, m in zip(paths, diffs, bound, strict=True)}
  noise = tuple(p for p in paths if within[p] and not max_rel[p] <= rtol)

  grad_rel, read = _from_state(window.params, ref.states, mine)
  compared = [f"the inner optimizer's new state ({', '.join(read)})"] if read else []
  if not grad_rel and ref.factor is not None:  # the update is c * g: its error is g's
    top = max(float(np.max(np.abs(g), initial=0.0)) for g in jax.tree.leaves(ref.grads))
    grad_rel = {p: a / (abs(ref.factor) * top) for p, a in max_abs.items()}
    compared.append(f"the update ({ref.factor:.3g} times the gradient for inner_tx)")
  norm = None  # |grad_norm / |g| - 1| where the step reports metrics["grad_norm"]
  if isinstance(window.metrics, dict) and "grad_norm" in window.metrics:
    reported = float(np.asarray(window.metrics["grad_norm"]))
    whole = float(np.sqrt(sum(np.sum(np.float64(x) ** 2) for x in jax.tree.leaves(ref.grads))))
    norm = abs(reported - whole) / whole if whole > 0 else (0.0 if reported == 0 else np.inf)
    norm = norm if np.isfinite(norm) else np.inf
    compared.append("metrics['grad_norm']")
  errors = list(grad_rel.values()) + ([] if norm is None else [norm])
  what = " and ".join(compared) or "nothing: inner_tx keeps no moment of it and is not linear in it"
  if not scale > 0 and not grad_rel:
    reason = _ZERO_UPDATE.format(what)
  elif not all(e <= rtol for e in errors):
    reason = _GRADIENT_DIFFERS
  elif not all(within.values()):
    reason = _UPDATE_DIFFERS.format(", while its gradient is the whole batch's" if grad_rel else "")
  else:  # the update agrees: verified only if the gradient was seen
    reason = None if errors else _NOT_VERIFIED.format(what)
  return StepCheck(
    reason is None, rtol, scale, max_abs, max_rel, grad_rel, norm,
    max(errors) if errors else None, what, noise, reason,
  )  # fmt: skip
