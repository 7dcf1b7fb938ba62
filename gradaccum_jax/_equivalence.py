"""Does accumulation equal the whole batch? ``check_equivalence`` asks it of a loss,
``check_step`` of a built step: each compiles it and one reference (docs/verifying.md)."""

from __future__ import annotations

import dataclasses
import functools
import re
import textwrap
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax._accumulate import Accumulate, AccumulateState, MicroStepState
from gradaccum_jax._checks import check_batch, check_num_microbatches, check_real
from gradaccum_jax._microbatch import microbatch
from gradaccum_jax._train_step import value_and_grad

_MAX_FIT_COORDS = 65536


def _wrap(text: str) -> str:
  return textwrap.fill(text, 100, initial_indent="  ", subsequent_indent="    ")


def _flat(tree: Any, rows: int | None = None) -> np.ndarray:
  """The leaves as one float64 vector, or ``(rows, n)`` for leaves stacked ``rows`` deep."""
  shape = (-1,) if rows is None else (rows, -1)
  parts = [np.asarray(x, np.float64).reshape(shape) for x in jax.tree.leaves(tree)]
  return np.concatenate(parts, axis=-1) if parts else np.zeros(shape[:-1] + (0,))


@dataclasses.dataclass(frozen=True)
class EquivalenceReport:
  """The result of :func:`check_equivalence`; ``str(report)`` is a readable diagnosis.

  Attributes:
    ok: ``loss_rel_error <= rtol and max_rel_grad_error <= rtol``.
    num_microbatches, weighted, rtol: ``k``, whether ``weight_fn`` was given, the tolerance.
    loss_whole, loss_accumulated, loss_rel_error: the losses, ``|difference| / |loss_whole|``.
    max_rel_grad_error: ``max |g_accumulated - g_whole| / max |g_whole|``.
    mean_of_means_loss, mean_of_means_error: the micro-batches' mean loss, its larger error.
    cause, reason: None when ``ok``, else ``"randomness"``, ``"weighting"``,
      ``"batch_dependence"`` or ``"unknown"``, and what to pass.
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

  Exact for :math:`L(B) = \sum_{r \in B} \ell_r / \sum_{r \in B} n_r` with ``weight_fn(mb)``
  :math:`= \sum_{r \in mb} n_r`; else the report says why (docs/semantics.md). Use a small batch.

  Args:
    loss_fn: ``loss_fn(params, batch[, rng]) -> loss`` (``(loss, aux)`` with ``has_aux``).
    params: the parameters (a pytree of float arrays).
    batch: a pytree of arrays sharing a leading batch axis ``B``.
    num_microbatches: ``k``, a positive int dividing ``B`` (``D * k`` on ``D`` data devices).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; aux is not compared.
    weight_fn: the ``weight_fn(microbatch) -> scalar`` you pass to the accumulation, or None.
    rtol: the tolerance, relative to the whole-batch loss and to its gradient's largest entry.
    mesh, data_axis: as in :func:`value_and_grad`; the reference stays one device's whole batch.
    rng: a key for the whole batch; micro-batch ``i`` gets ``jax.random.fold_in(rng, i)``.

  Returns:
    An :class:`EquivalenceReport`; print it for the diagnosis.

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
  extra = () if rng is None else (rng,)
  out, g_acc = jax.jit(acc_fn)(params, batch, *extra)
  loss_acc, g_acc = float(_loss(out, has_aux)), _flat(g_acc)
  params, batch = _host((params, batch))  # the reference: one device's whole batch
  loss_whole, g_whole, losses, grads, used = _per_microbatch(
    loss_fn, has_aux, weight_fn, k, params, batch, rng
  )
  scale = max(float(np.max(np.abs(g_whole), initial=0.0)), 1e-30)

  def errors(loss, g):  # the loss's relative error, and the gradient's over ``scale``
    err = abs(loss - loss_whole) / max(abs(loss_whole), 1e-30)
    return err, float(np.max(np.abs(g - g_whole), initial=0.0)) / scale

  loss_err, grad_err = errors(loss_acc, g_acc)
  mom_loss = float(np.mean(losses[:k]))
  ok = bool(loss_err <= rtol and grad_err <= rtol)  # False for a NaN or an Inf
  report = EquivalenceReport(
    ok, k, weight_fn is not None, float(rtol), loss_whole, loss_acc, loss_err, grad_err,
    mom_loss, max(errors(mom_loss, grads[:k].mean(0))),
  )  # fmt: skip
  if ok:
    return report
  if rng is not None:  # micro-batch 0 again, with another key
    random = abs(losses[k] - losses[0]) > rtol * max(abs(losses[0]), 1e-30)
  else:  # micro-batch 0: rows 0, k, 2k, ...
    random = _traces_differ(loss_fn, params, jax.tree.map(lambda x: x[::k], batch))
  if random:
    return dataclasses.replace(report, cause="randomness", reason=_RANDOM)
  fit = _fit_weights(losses[:k], grads[:k], loss_whole, g_whole, scale, max(rtol, 1e-4))
  cause, reason = _diagnose(fit, batch, None if weight_fn is None else used, mesh, k)
  weights = tuple(map(float, fit)) if isinstance(fit, np.ndarray) else None
  return dataclasses.replace(report, cause=cause, reason=reason, fitted_weights=weights)


_RANDOM = (
  "loss_fn is random (another key changes its loss, or it draws new constants each time it is"
  " traced, e.g. with numpy.random): the whole batch and the micro-batches draw different noise."
  " Check with randomness off (deterministic=True, model.eval(), dropout rate 0)."
)


def _per_microbatch(loss_fn, has_aux, weight_fn, k, params, batch, rng) -> tuple:
  """One program: the whole batch's loss and gradient, each micro-batch's (micro-batch 0's again
  with the key ``fold_in(rng, k)``) and weight; on the host, in float64."""
  vg = jax.value_and_grad(lambda p, b, *key: _loss(loss_fn(p, b, *key), has_aux))

  @jax.jit
  def run(p, b, key):
    def one(i):
      mb = microbatch(b, i % k, k)
      w = 1.0 if weight_fn is None else weight_fn(mb)
      w = jnp.nan if isinstance(w, Mapping) else jnp.asarray(w, jnp.float32)  # per term: unused
      return *vg(p, mb, *(jax.random.fold_in(x, i) for x in key)), w

    return vg(p, b, *key), jax.lax.map(one, jnp.arange(k + len(key)))

  (loss, g), (losses, grads, w) = run(params, batch, () if rng is None else (rng,))
  return float(loss), _flat(g), np.asarray(losses, np.float64), _flat(grads, len(losses)), w[:k]


def _loss(out: Any, has_aux: bool) -> Any:
  return out[0] if has_aux else out


def _traces_differ(loss_fn: Callable[..., Any], params: Any, mb: Any) -> bool:
  """Whether two traces of ``loss_fn`` differ: randomness drawn in Python (``numpy.random``)."""
  # A new wrapper per trace: jax caches the trace of a function it has seen.
  a, b = (jax.make_jaxpr(lambda p, m: loss_fn(p, m))(params, mb) for _ in range(2))
  same = str(a.jaxpr) == str(b.jaxpr) and len(a.consts) == len(b.consts)
  return not (same and all(np.array_equal(x, y) for x, y in zip(a.consts, b.consts, strict=True)))


def _fit_weights(losses, grads, loss_whole, g_whole, scale, tol) -> Any:
  """Least-squares ``w`` (summing to 1) with ``sum_i w_i (L_i, g_i) = (L, g)``; None if none
  fits within ``tol`` or one is below ``-tol``; False for too few gradient coordinates."""
  k = len(losses)
  if g_whole.size + 1 < 2 * k:
    return False  # as many unknowns as equations: any data fits
  if g_whole.size > _MAX_FIT_COORDS:  # a fixed random subset, the same for every gradient
    index = np.sort(np.random.default_rng(0).choice(g_whole.size, _MAX_FIT_COORDS, replace=False))
    grads, g_whole = grads[:, index], g_whole[index]
  top = max(abs(loss_whole), 1e-30)
  a = np.vstack([losses / top, grads.T / scale, np.full(k, 1e3)])
  target = np.concatenate([[loss_whole / top], g_whole / scale, [1e3]])
  w, *_ = np.linalg.lstsq(a, target, rcond=None)
  return None if np.max(np.abs(a @ w - target)) > tol or np.min(w) < -tol else w


def _suggest_weight_fn(batch: Any, k: int, fit: np.ndarray, tol: float) -> str | None:
  """A ``"lambda mb: ..."`` whose counts per micro-batch match the fitted weights, or None: masks
  first, then labels with a negative ignore index (``>= 0``), then padded token ids (``!= 0``)."""
  found = []  # (rank, text, what it counts)
  for path, x in jax.tree_util.tree_leaves_with_path(batch):
    name, x = "mb" + jax.tree_util.keystr(path), np.asarray(x)
    if x.dtype == np.bool_ or (np.issubdtype(x.dtype, np.number) and np.isin(x, (0, 1)).all()):
      found.append((0, f"{name}.sum()", x != 0))
    elif np.issubdtype(x.dtype, np.integer) and x.ndim >= 2:
      found += [(1, f"({name} >= 0).sum()", x >= 0)] if np.any(x < 0) else []
      found += [(2, f"({name} != 0).sum()", x != 0)] if np.any(x == 0) else []
  for _, text, counted in sorted(found, key=lambda f: f[0]):
    counts = np.array([counted[i::k].sum() for i in range(k)], float)  # micro-batch i's rows
    if counts.sum() > 0 and np.max(np.abs(counts / counts.sum() - fit)) <= tol:
      return f"lambda mb: {text}"
  return None


def _diagnose(fit, batch, used, mesh, k) -> tuple[str, str]:
  """(cause, reason) from the weight fit and ``weight_fn``'s weights ``used`` (None: equal)."""
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
  tol, weights = 1e-3, np.ones(k) if used is None else np.asarray(used, np.float64)
  if np.max(np.abs(fit - weights / max(weights.sum(), 1e-30))) <= tol:
    where = " on the mesh (check mesh and data_axis, and the batch layout)" if mesh else ""
    return "unknown", (
      "the micro-batches add up to the whole batch with the weights used, yet the accumulated"
      f" result differs{where}. Check that weight_fn and loss_fn see the same micro-batch, and"
      " that the tolerance suits the compute dtype."
    )
  match = _suggest_weight_fn(batch, k, fit, tol)
  what = f"weight_fn={match}" if match else "the number of non-padding tokens"
  start = (
    "weight_fn's weights are not proportional to the number of items loss_fn averages over in"
    " each micro-batch."
    if used is not None
    else "loss_fn averages over a number of items (tokens, unmasked positions) that differs"
    " between micro-batches, and an unweighted accumulation (a mean of micro-batch means)"
    " weighs every micro-batch equally."
  )
  return "weighting", f"{start} Pass weight_fn(microbatch) counting them, e.g. {what}."


@dataclasses.dataclass(frozen=True)
class StepCheck:
  """The result of :func:`check_step`; ``str(check)`` is a table of the leaves.

  Attributes:
    ok: the gradient read and within ``rtol``, each update entry within ``rtol * scale`` or what
      ``inner_tx`` makes of a gradient within ``rtol``.
    rtol, scale: the tolerance, and the largest entry of the reference update ``|p_ref - p|``.
    max_abs, max_rel: ``{leaf path: max |p_step - p_ref|}``, and that over ``scale``.
    grad_rel: ``{leaf path: gradient error / max |g|}`` as read from ``compared`` (or empty).
    grad_norm_rel: ``|grad_norm / |g| - 1|`` for a step that reports ``metrics["grad_norm"]``.
    max_rel_grad_error: the largest of ``grad_rel`` and ``grad_norm_rel``, or None.
    compared: where the step's gradient was read from.
    optimizer_noise: leaves off by more than ``rtol * scale``, within what ``inner_tx`` moves.
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
  " by about its learning rate, whatever their size), or by a rounding of the params (an update"
  " near their float resolution): judged by the gradient."
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
_ON_A_MESH = (
  " On a mesh, also a term that is not linear in a micro-batch's rows (a per-micro-batch"
  " balance loss, a per-micro-batch normalization), which each device computes on its own rows:"
  " read the window's statistics with window_stats= instead (docs/data_parallel.md)."
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
  """Runs one window of a built step on copies of its arguments and compares it with the whole batch.

  The reference is ``p + inner_tx.update(g, s, p)``, ``g = jax.grad(loss_fn)(p, batch)`` on one
  device; the step's gradient is read from its optimizer's state, its update or
  ``metrics["grad_norm"]`` (docs/verifying.md).

  Args:
    step: ``step(params, opt_state, batch) -> (new_params, opt_state, ...)``, or a ga step.
    loss_fn: the deterministic mean loss ``loss_fn(params, batch)`` (NNX: ``(model, batch)``).
    inner_tx: the optimizer the step applies (the one inside ``ga.accumulate``).
    params, opt_state, batch: the step's arguments as you pass them, copied (docs/verifying.md).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    inner_state: the reference's optimizer state (default: the step's, or ``inner_tx.init``).
    rtol: the tolerance of ``ok``.

  Returns:
    A :class:`StepCheck`; print it for the gradient and the leaves.

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
  if inner_state is None:  # the step's, where it is inner_tx's; else inner_tx.init's
    found = _inner_of(window.state, like, window.params)
    inner_state = found[1] if found is not None and found[0] == 0 else None
  ref = _whole_batch(window, inner_tx, has_aux, inner_state, float(rtol))
  if jax.tree.structure(window.new_params) != jax.tree.structure(ref.params):
    raise ValueError(
      f"The step's new params have the structure {jax.tree.structure(window.new_params)}, the"
      f" params {jax.tree.structure(ref.params)}: step must return (new_params, ...)."
    )
  return _judge(window, ref, float(rtol), _inner_of(window.new_state, like, window.params))


class CheckWindow(NamedTuple):
  """One window of a step, on host copies, as :func:`check_step` compares it; a front end's step
  returns it from ``step.check_window(step, loss_fn, a, b, c)`` (``check_step``'s arguments)."""

  params: Any  # the trained params before it
  batch: Any
  loss_fn: Callable[..., Any]  # loss_fn(params, batch), on these params
  new_params: Any
  state: Any  # the step's optimizer state before it
  new_state: Any  # and after, or None
  metrics: Any  # the step's metrics dict, or None
  devices: int = 1  # the devices its arguments were laid out on

  @classmethod
  def after(cls, host: tuple, loss_fn: Any, new: Any, new_state: Any, metrics: Any) -> CheckWindow:
    """The window from ``host`` (:func:`host_arguments`) and what the step returned."""
    return cls(host[0], host[2], loss_fn, _host(new), host[1], _host(new_state), metrics, host[3])


HOW = (
  "check_step calls the step as you pass its arguments: check_step(step, loss_fn, inner_tx,"
  " params, opt_state, batch) for ga.train_step or your own step(params, opt_state, batch),"
  " (..., train_state, batch) for ga.linen_train_step, (..., model, optimizer, batch) for"
  " ga.nnx_train_step, (..., params, state, batch) with the window's whole batch for a"
  " ga.micro_step."
)


def _run_window(step, loss_fn, params, opt_state, batch) -> CheckWindow:
  """One window of ``step`` on copies, as the step says, else as ``step(params, opt_state,
  batch) -> (new_params, new_state, ...)``."""
  custom = getattr(step, "check_window", None)
  if custom is not None:
    return custom(step, loss_fn, params, opt_state, batch)
  if batch is None:
    raise TypeError(f"batch is missing: {HOW}")
  host = host_arguments(params, opt_state, batch)
  out = call_copied(step, params, opt_state, batch)
  out = out if isinstance(out, tuple | list) else (out,)
  metrics = next((o for o in out[1:] if isinstance(o, dict) and "grad_norm" in o), None)
  new_state = out[1] if len(out) > 1 and out[1] is not metrics else None
  return CheckWindow.after(host, loss_fn, out[0], new_state, metrics)


def call_copied(step, *args, copy=True):
  """``step`` on copies of ``args`` (it may donate them); its error says how it was called."""
  try:
    return step(*(copies(args) if copy else args))
  except Exception as e:
    e.add_note(HOW)
    raise


def copies(tree):
  """New buffers for the arrays of ``tree`` (transferred: no copy is compiled)."""

  def new(x):
    return jax.device_put(x, may_alias=False) if isinstance(x, jax.Array) else x

  return jax.tree.map(new, tree)


def _host(tree):
  """Host copies of the arrays (PRNG keys, which numpy cannot hold, copied on the device)."""

  def host(x):
    key = isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return copies(x) if key else np.asarray(x)

  return jax.tree.map(host, tree)


def _ga_state(tree) -> Any:
  """The first :class:`AccumulateState` (or :class:`MicroStepState`) in ``tree``, or None."""
  is_ga = lambda x: isinstance(x, AccumulateState | MicroStepState)  # noqa: E731
  return next((x for x in jax.tree.leaves(tree, is_leaf=is_ga) if is_ga(x)), None)


def host_arguments(params, state, batch) -> Any:
  """``(params, state, batch, devices)``: host copies, and the devices they were laid out on;
  a state inside a window refused."""
  ga = _ga_state(state)
  if ga is not None and int(np.asarray(ga.micro_step)) != 0:
    raise ValueError(
      f"opt_state holds an open window (micro_step={int(np.asarray(ga.micro_step))}), whose sums"
      " the step would add to this batch's: check_step compares one whole window with the whole"
      " batch. Pass a state at a window's start (tx.init(params), or one a closing call returned)."
    )
  arrays = [x for x in jax.tree.leaves((params, state, batch)) if isinstance(x, jax.Array)]
  devices = max((len(x.sharding.device_set) for x in arrays), default=1)
  return (*_host((params, state, batch)), devices)


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
  """``(i, s)``: ``s`` the subtree of ``state`` shaped as ``like``'s ``i``-th, the largest that
  fits (Adam's state beside a clip's), never one shaped as the params (an accumulator); or None."""
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


def _whole_batch(window: CheckWindow, inner_tx, has_aux, inner_state, rtol) -> _Reference:
  """One program: ``g`` and ``inner_tx``'s update and state at it, at ``g ± rtol max|g| r``
  (random signs ``r``), ``2 g`` and ``g / 2`` (updates), and at ``-g`` and 0 (states)."""
  tx = optax.with_extra_args_support(inner_tx)
  rng = np.random.default_rng(0)
  signs = jax.tree.map(
    lambda x: np.where(rng.random(np.shape(x)) < 0.5, -1, 1).astype(np.result_type(x)),
    window.params,
  )

  @jax.jit
  def reference(p, s, b, signs):
    s = tx.init(p) if s is None else s
    loss, g = jax.value_and_grad(lambda p: _loss(window.loss_fn(p, b), has_aux))(p)
    top = [jnp.max(jnp.abs(x)).astype(jnp.float32) for x in jax.tree.leaves(g)]
    eps = rtol * functools.reduce(jnp.maximum, top, jnp.float32(0))

    def at(scale, shift):
      h = jax.tree.map(lambda x, r: scale * x + (shift * r).astype(x.dtype), g, signs)
      return tx.update(h, s, p, value=loss, grad=h)

    (u, new_s), up, down = at(1, 0), at(1, eps)[0], at(1, -eps)[0]
    moved = jax.tree.map(lambda u, a, b: jnp.maximum(abs(a - u), abs(b - u)), u, up, down)
    new_p = optax.apply_updates(p, u)
    return g, new_p, (new_s, at(-1, 0)[1], at(0, 0)[1]), moved, u, at(2, 0)[0], at(0.5, 0)[0]

  args = jax.device_put((window.params, inner_state, window.batch), jax.devices()[0])
  g, new_p, states, moved, *updates = _host(reference(*args, signs))
  return _Reference(g, new_p, states, moved, _factor(g, *updates))


def _factor(grads, updates, double, half) -> float | None:
  """``c`` if ``updates = c * grads``, ``c != 0``, and doubling or halving the gradient does
  the same to the update (no clipping, no normalization), else None."""
  g, u, u2, uh = map(_flat, (grads, updates, double, half))
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
  """The gradient's error per params leaf in the step's new inner state ``mine`` against ``T(g)``
  over ``max |T(g) - T(0)|``, from the trees odd in ``g`` (Adam's ``mu``), else the rest."""
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


def _judge(window: CheckWindow, ref: _Reference, rtol: float, mine: Any) -> StepCheck:
  """The verdict: the gradient where it was read (``mine``: the step's new inner state), the
  update within what ``inner_tx`` makes of a gradient within ``rtol``, and the gradient seen."""
  paths = [jax.tree_util.keystr(p) or "params" for p, _ in jax.tree.leaves_with_path(ref.params)]
  new, old, target = (jax.tree.leaves(t) for t in (window.new_params, window.params, ref.params))
  scale = max(map(_error, target, old), default=0.0)
  diffs = [np.abs(np.float64(a) - b) for a, b in zip(new, target, strict=True)]
  max_abs = {p: float(np.max(d, initial=0.0)) for p, d in zip(paths, diffs, strict=True)}
  max_rel = {p: a / scale if scale > 0 else (0.0 if a == 0 else np.inf) for p, a in max_abs.items()}
  # Allowed: rtol of the update, what inner_tx makes of a gradient within rtol, a rounding of p.
  eps = [jnp.finfo(a.dtype).eps if jnp.issubdtype(a.dtype, jnp.inexact) else 0 for a in new]
  moved = zip(jax.tree.leaves(ref.moved), eps, target, strict=True)
  bound = [np.maximum(rtol * scale, np.maximum(m, e * np.abs(np.float64(t)))) for m, e, t in moved]
  within = {p: bool(np.all(d <= m)) for p, d, m in zip(paths, diffs, bound, strict=True)}
  noise = tuple(p for p in paths if within[p] and not max_rel[p] <= rtol)

  grad_rel, read = _from_state(window.params, ref.states, mine)
  compared = [f"the inner optimizer's new state ({', '.join(read)})"] if read else []
  if not grad_rel and ref.factor is not None:  # the update is c * g: its error is g's
    top = float(np.max(np.abs(_flat(ref.grads)), initial=0.0))
    grad_rel = {p: a / (abs(ref.factor) * top) for p, a in max_abs.items()}
    compared.append(f"the update ({ref.factor:.3g} times the gradient for inner_tx)")
  norm = None  # |grad_norm / |g| - 1| where the step reports metrics["grad_norm"]
  if isinstance(window.metrics, dict) and "grad_norm" in window.metrics:
    reported = float(np.asarray(window.metrics["grad_norm"]))
    whole = float(np.linalg.norm(_flat(ref.grads)))
    norm = abs(reported - whole) / whole if whole > 0 else (0.0 if reported == 0 else np.inf)
    norm = norm if np.isfinite(norm) else np.inf
    compared.append("metrics['grad_norm']")
  errors = list(grad_rel.values()) + ([] if norm is None else [norm])
  what = " and ".join(compared) or "nothing: inner_tx keeps no moment of it and is not linear in it"
  if not scale > 0 and not grad_rel:
    reason = _ZERO_UPDATE.format(what)
  elif not all(e <= rtol for e in errors):
    reason = _GRADIENT_DIFFERS + (_ON_A_MESH if window.devices > 1 else "")
  elif not all(within.values()):
    reason = _UPDATE_DIFFERS.format(", while its gradient is the whole batch's" if grad_rel else "")
  else:  # the update agrees: verified only if the gradient was seen
    reason = None if errors else _NOT_VERIFIED.format(what)
  return StepCheck(
    reason is None, rtol, scale, max_abs, max_rel, grad_rel, norm,
    max(errors) if errors else None, what, noise, reason,
  )  # fmt: skip
