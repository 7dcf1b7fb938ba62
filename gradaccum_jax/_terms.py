"""Losses of several terms, each normalized over the whole window (docs/usage.md, "Losses with
several terms").

``loss_fn`` returns ``{term: L_it}``, each term a mean over its own elements in micro-batch
``i``; ``weight_fn`` may return ``{term: w_it}`` (a term it does not name weighs 1 per
micro-batch). The window's objective is ``sum_t S_t / W_t``, ``S_t = sum_i w_it L_it`` and
``W_t = sum_i w_it``. A scalar or no ``weight_fn`` weighs every term alike: the objective is the
weighted mean of ``sum_t L_it`` (:func:`combine`), as for a loss of one term.

Per-term weights need every ``W_t`` before the first backward pass: the fused step computes them
first (:meth:`Terms.make`: ``weight_fn`` alone on each micro-batch, summed over the devices).
Micro-batch ``i`` then weighs ``u_i``, the mean over the terms of positive total of
``w_it / W_t``, and its loss is ``o_i / u_i`` with ``o_i = sum_t w_it / W_t L_it``: the weighted
sums hold ``sum_i grad o_i`` over a total weight of ``sum_i u_i = 1``, which every stage after
the backward pass (meshes, in place, narrow accumulators, closing a window) takes as any
weighted window. The terms' window values ride the loss's sums: a micro-batch's loss is then
``{"loss": ..., "loss_terms": {...}}``, each leaf summed with the micro-batch's weight, so their
weighted means are each term's window value; the totals ``W_t`` are the window's as computed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._checks import check_weight


def combine(loss: dict) -> tuple[jax.Array, jax.Array]:
  """``({"loss": sum_t L_it, "loss_terms": loss}, True)``: the terms of one weight, summed."""
  total = sum(loss.values()).astype(jnp.promote_types(_dtype(loss), jnp.float32))
  return {"loss": total, "loss_terms": loss}, jnp.ones((), bool)


@dataclasses.dataclass(frozen=True)
class Terms:
  """A loss's terms with per-term weights, and (:meth:`make`) their window totals."""

  names: tuple[str, ...]  # the keys of loss_fn's dict
  weight_fn: Callable[[Any], Any]  # microbatch -> {term: weight} for some of the names
  totals: Any = None  # {term: W_t} over the window and the devices

  def weights(self, mb: Any) -> dict[str, jax.Array]:
    """``{term: w_it}`` of micro-batch ``mb``: ``weight_fn``'s, 1 for a term it does not name."""
    given, one = self.weight_fn(mb), jnp.ones((), jnp.float32)
    return {
      t: check_weight(given[t], f"weight_fn(microbatch)[{t!r}]") if t in given else one
      for t in self.names
    }

  def shares(self, mb: Any) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
    """``(u_i, {term: w_it / W_t / u_i}, the weights)``: the micro-batch's weight and each
    term's coefficient in its loss; a term of weight <= 0 (or a window total of 0) gets 0."""
    w = self.weights(mb)
    fracs = {t: _ratio(w[t], self.totals[t]) for t in self.names}
    live = sum(jnp.where(self.totals[t] > 0, 1.0, 0.0) for t in self.names)
    u = _ratio(sum(fracs.values()), live)
    # A NaN or infinite weight, here or in a term's total, voids the window as a scalar one does.
    finite = jnp.all(jnp.isfinite(jnp.stack([*w.values(), *self.totals.values()])))
    return jnp.where(finite, u, jnp.nan), {t: _ratio(f, u) for t, f in fracs.items()}, w

  def weight(self, mb: Any) -> jax.Array:
    """``u_i``: micro-batch ``mb``'s weight in the window (a ``weight_fn`` for the sums)."""
    return self.shares(mb)[0]

  def combine(self, loss: dict, mb: Any, only: str | None = None) -> tuple[Any, jax.Array]:
    """``(the micro-batch's loss as the sums take it, whether every term of weight 0 is
    finite)``: ``o_i / u_i`` beside the terms' values (a term of weight 0 adds nothing, even
    NaN); ``only``: of that term alone (its gradient then reads no other term)."""
    _, coef, w = self.shares(mb)
    parts = {t: jnp.where(coef[t] > 0, coef[t] * loss[t].astype(jnp.float32), 0.0) for t in loss}
    wide = jnp.promote_types(_dtype(loss), jnp.float32)
    total = (parts[only] if only else sum(parts.values())).astype(wide)
    clean = jnp.all(jnp.stack([jnp.isfinite(loss[t]) | (coef[t] > 0) for t in loss]))
    return {"loss": total, "loss_terms": parts}, clean


def _ratio(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a / b``, 0 where ``b`` or ``a`` is not positive (so 0 / 0 and NaN weights give 0)."""
  ok = (a > 0) & (b > 0)
  return jnp.where(ok, a / jnp.where(ok, b, 1), 0.0)


def _dtype(loss: dict) -> Any:
  return jnp.result_type(*loss.values())


def names_of(loss_out: Any, weights_out: Mapping, where: str) -> tuple[str, ...]:
  """The terms of a loss whose value on one micro-batch is ``loss_out`` (abstract), for the
  per-term weights ``weights_out``: a ValueError for weights the terms do not fit."""
  if not isinstance(loss_out, Mapping):
    raise ValueError(
      f"{where}: weight_fn returns a dict of per-term weights {list(weights_out)}, but loss_fn"
      " returns one scalar. Return a dict {term: mean loss} with those keys, or one weight."
    )
  unknown = [t for t in weights_out if t not in loss_out]
  if unknown:
    raise ValueError(
      f"{where}: weight_fn names the term {unknown[0]!r}, which loss_fn does not return; its"
      f" terms are {list(loss_out)}. Name terms of the loss (a term left out weighs 1 per"
      " micro-batch)."
    )
  return tuple(loss_out)


def split(loss: Any) -> tuple[Any, dict[str, Any]]:
  """``(the window's loss, its terms' values)`` of a window's mean loss (``{}`` for one term)."""
  if not isinstance(loss, Mapping):
    return loss, {}
  return loss["loss"], {n: v for n, v in loss.items() if n != "loss"}


def refused(where: str, names: list[str]) -> str:
  """Why ``where`` (a streaming call) cannot take a loss of the terms ``names``."""
  return (
    f"{where}: loss_fn returns a dict of terms {names}, but a call on one micro-batch cannot"
    " normalize each term over the window. Use ga.train_step, ga.value_and_grad or the Flax"
    " steps, which do; or return one scalar (the sum of the terms, weighted as you need)."
  )
