"""Statistics of the whole window that the loss reads (docs/models.md, "Mixture of experts: a
global-batch balance loss"): a global-batch balance loss needs the window's expert fractions in every
micro-batch's backward pass.

Before the window's loop a forward-only pass runs ``window_stats`` on each micro-batch (from the
window's params and model state, each micro-batch with the key its loss gets), reduces the
values by the aux reducers (``window_stats_reduce``, the names of ``aux_reduce``: integers
summed, floats averaged with the micro-batches' weights by default), and on a mesh over the
devices, once. Every micro-batch's ``loss_fn`` then gets the window's value, under
``jax.lax.stop_gradient``, as its argument after the micro-batch. The pass holds one
micro-batch's forward activations at a time and keeps none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._parts import AuxReducers, Unit, cast_floats
from gradaccum_jax._sharding import reduce_parts, to_varying


@dataclasses.dataclass(frozen=True)
class WindowStats:
  """``stats_fn(params, [model_state,] microbatch[, rng])`` (the core's signature; the front ends
  translate theirs) and its reducers."""

  fn: Callable[..., Any]
  reducers: AuxReducers
  has_state: bool

  def window(self, take: Callable, weighting: Any, model_state: Any, *, k: int, num: Any,
             vary: tuple, dtype: Any = None) -> Any:  # fmt: skip
    """The window's statistics over its first ``num`` of ``k`` micro-batches and the devices
    ``vary``; ``take(i)``: micro-batch ``i``'s ``(params, microbatch, key)`` as its loss gets
    them, the params cast to ``dtype`` as for the loss; ``weighting``: the window's (each
    micro-batch's weight, as the sums take it)."""
    wt, reducers = weighting, self.reducers

    def one(i: Any) -> tuple[Any, jax.Array]:
      params, mb, key = take(i)
      params = cast_floats(params, dtype)
      args = (params, model_state, mb) if self.has_state else (params, mb)
      args = args if key is None else (*args, key)
      return self.fn(*args), wt.of(mb)

    like = jax.eval_shape(lambda: one(0)[0])
    start = (reducers.init(like), jnp.zeros((), jnp.float32))
    start = to_varying(start, vary) if vary else start

    def body(c: tuple, i: Any) -> tuple:
      acc, weight = c
      x, w = one(i)
      return (reducers.add(acc, x, w, wt.weighted), weight + wt.total(w)), None

    if isinstance(num, int):
      (acc, weight), _ = jax.lax.scan(body, start, jnp.arange(num))
    else:
      acc, weight = jax.lax.fori_loop(0, num, lambda i, c: body(c, i)[0], start)
    if vary:  # unweighted, each device's micro-batch weighs 1 / D (linear: after the sum)
      ((acc, weight),) = reduce_parts((_Reduced(reducers),), ((acc, weight),), (), vary)
      devices = jax.lax.axis_size(vary)
      acc = reducers.share(acc, devices, wt.weighted)
      weight = weight if wt.weighted else weight / devices
    return jax.lax.stop_gradient(reducers.final(acc, weight, like))


@dataclasses.dataclass(frozen=True)
class _Reduced(Unit):
  """A device's partial statistics ``(reductions, weight)`` as a unit's part, combined over the
  devices by what its ``reduce`` asks (``_sharding.reduce_parts``): the sums and the weight in
  one all-reduce (integers exact), maxima and minima by their collectives."""

  reducers: AuxReducers

  def reduce(self, part: tuple) -> tuple[dict[str, Any], Callable[[dict[str, Any]], tuple]]:
    acc, weight = part
    asks = self.reducers.split(acc)
    asks["sum"] = (asks["sum"], weight)

    def finish(got: dict[str, Any]) -> tuple:
      summed, total = got["sum"]
      return self.reducers.join({**got, "sum": summed}), total

    return asks, finish
