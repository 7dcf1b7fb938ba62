"""Losses of several terms, each normalized over the whole window (docs/usage.md, "Losses with
several terms").

``loss_fn`` returns ``{term: L_it}``, each term a mean over its own elements in micro-batch
``i``; ``weight_fn`` may return ``{term: w_it}`` (a term it does not name weighs 1 per
micro-batch). The window's objective is ``sum_t S_t / W_t``, ``S_t = sum_i w_it L_it`` and
``W_t = sum_i w_it``. A scalar or no ``weight_fn`` weighs every term alike: the objective is the
weighted mean of ``sum_t L_it``, as for a loss of one term.

Per-term weights need every ``W_t`` before the first backward pass. The fused step computes them
first (:func:`term_totals`, ``weight_fn`` alone, summed over the devices); ``micro_step`` takes
them as ``window_weights=``. Micro-batch ``i`` then weighs ``u_i``, the mean over the terms of
positive total of ``w_it / W_t``, and its loss is ``o_i / u_i`` with
``o_i = sum_t w_it / W_t L_it``. The weighted sums hold ``sum_i grad o_i`` over a total weight
of ``sum_i u_i = 1``, which every stage after the backward pass (meshes, in place, narrow
accumulators, closing a window) takes as any weighted window. Each term's window value rides
the aux, reduced by its weighted mean (``"loss_terms"``), and each ``W_t`` by its sum
(``"term_weights"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._checks import check_weight

# How the terms' window values ride the aux (a prefix of ``aux_reduce``'s spec beside the user's).
REDUCE = {"loss_terms": "mean", "term_weights": "sum"}


@dataclasses.dataclass(frozen=True)
class Terms:
  """A loss's terms, read from its output on one micro-batch (:func:`probe`)."""

  names: tuple[str, ...]  # the keys of loss_fn's dict
  weight_fn: Callable[[Any], Any] | None  # returns {term: weight}, or None: no per-term weights
  where: str = "train_step"

  @property
  def per_term(self) -> bool:
    return self.weight_fn is not None

  def weights(self, mb: Any) -> dict[str, jax.Array]:
    """``{term: w_it}`` of micro-batch ``mb``: ``weight_fn``'s, 1 for a term it does not name."""
    given = self.weight_fn(mb)
    one = jnp.ones((), jnp.float32)
    return {
      t: check_weight(given[t], f"weight_fn(microbatch)[{t!r}]") if t in given else one
      for t in self.names
    }

  def shares(self, w: dict, totals: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(u_i, {term: w_it / W_t / u_i})``: the micro-batch's weight and each term's coefficient
    in its loss; a term of weight <= 0 (or a window total of 0) gets 0."""
    fracs = {t: _ratio(w[t], totals[t]) for t in self.names}
    live = sum(jnp.where(totals[t] > 0, 1.0, 0.0) for t in self.names)
    u = _ratio(sum(fracs.values()), live)
    return u, {t: _ratio(f, u) for t, f in fracs.items()}

  def combine(self, loss: dict, aux: Any, mb: Any, totals: dict | None, only: str | None = None
              ) -> tuple[jax.Array, Any, jax.Array]:  # fmt: skip
    """``(the micro-batch's loss as the sums take it, (aux, the terms' values), whether every term
    of weight 0 is finite)``: ``o_i / u_i`` with per-term weights (a term of weight 0 adds
    nothing, even NaN), else ``sum_t L_it``; ``only``: of that term alone (its gradient then
    reads no other term)."""
    if not self.per_term:
      return sum(loss.values()), (aux, {"loss_terms": loss}), jnp.ones((), bool)
    w = self.weights(mb)
    _, coef = self.shares(w, totals)
    parts = {t: jnp.where(coef[t] > 0, coef[t] * loss[t].astype(jnp.float32), 0.0) for t in loss}
    wide = jnp.promote_types(_dtype(loss), jnp.float32)
    total = (parts[only] if only else sum(parts.values())).astype(wide)
    clean = jnp.all(jnp.stack([jnp.isfinite(loss[t]) | (coef[t] > 0) for t in loss]))
    return total, (aux, {"loss_terms": parts, "term_weights": w}), clean

  def coefficients(self, mb: Any, totals: dict) -> dict[str, jax.Array]:
    """Each term's coefficient in micro-batch ``mb``'s loss (:meth:`shares`)."""
    return self.shares(self.weights(mb), totals)[1]

  def weighting(self, totals: dict) -> Callable[[Any], jax.Array]:
    """``microbatch -> u_i``: the weight function of a window of term totals ``totals``."""
    return lambda mb: self.shares(self.weights(mb), totals)[0]

  def totals(self, batch: Any, k: int, num: Any, vary: tuple, microbatch: Callable) -> dict:
    """Every ``W_t`` over the window's first ``num`` micro-batches (and the devices ``vary``),
    from ``weight_fn`` alone, before the loop."""
    i = jnp.arange(k)
    ws = jax.vmap(lambda j: self.weights(microbatch(batch, j, k)))(i)
    out = {t: jnp.sum(jnp.where((i < num) & (w > 0), w, 0.0)) for t, w in ws.items()}
    return jax.lax.psum(out, vary) if vary else out

  def check_totals(self, totals: Any) -> dict[str, jax.Array]:
    """``window_weights=`` of a streaming call: ``{term: W_t}`` for every term."""
    if not isinstance(totals, Mapping) or set(totals) != set(self.names):
      got = list(totals) if isinstance(totals, Mapping) else type(totals).__name__
      raise ValueError(
        f"{self.where}: window_weights must be a dict of every term's total weight over the"
        f" window, keys {list(self.names)}; got {got}."
      )
    return {t: check_weight(totals[t], f"window_weights[{t!r}]") for t in self.names}


def _ratio(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a / b``, 0 where ``b`` or ``a`` is not positive (so 0 / 0 and NaN weights give 0)."""
  ok = (a > 0) & (b > 0)
  return jnp.where(ok, a / jnp.where(ok, b, 1), 0.0)


def _dtype(loss: dict) -> Any:
  return jnp.result_type(*loss.values())


def probe(loss_out: Any, weights_out: Any, weight_fn: Any, where: str) -> Terms | None:
  """The :class:`Terms` of a loss whose value on one micro-batch is ``loss_out`` (abstract) and
  whose ``weight_fn`` returns ``weights_out``; None for a loss of one term (a ValueError for
  per-term weights it does not fit)."""
  if not isinstance(loss_out, Mapping):
    if isinstance(weights_out, Mapping):
      raise ValueError(
        f"{where}: weight_fn returns a dict of per-term weights {list(weights_out)}, but loss_fn"
        " returns one scalar. Return a dict {term: mean loss} with those keys, or one weight."
      )
    return None
  names = tuple(loss_out)
  if not isinstance(weights_out, Mapping):
    return Terms(names, None, where)
  unknown = [t for t in weights_out if t not in loss_out]
  if unknown:
    raise ValueError(
      f"{where}: weight_fn names the term {unknown[0]!r}, which loss_fn does not return; its"
      f" terms are {list(names)}. Name terms of the loss (a term left out weighs 1 per"
      " micro-batch)."
    )
  return Terms(names, weight_fn, where)


def refused(where: str, names: list[str]) -> str:
  """Why ``where`` cannot take a loss of the terms ``names`` here, and what to do instead."""
  if where == "micro_step":
    why = (
      "a call on one micro-batch cannot normalize each term over the window. Use ga.train_step,"
      " ga.value_and_grad or the Flax steps, which do"
    )
  else:  # the probe failed (_microbatch.MicrobatchedGrad.with_terms)
    why = (
      "ga reads a loss's terms by tracing it on one micro-batch before the step, and that trace"
      " failed (e.g. a loss that calls jax.shard_map itself)"
    )
  return (
    f"{where}: loss_fn returns a dict of terms {names}, but {why}; or return one scalar (the sum"
    " of the terms, weighted as you need)."
  )
