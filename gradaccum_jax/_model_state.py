"""Mutable model state through the micro-batch scan, and the BatchNorm modes."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradaccum_jax._parts import Micro, Unit

BATCHNORM_MODES = ("sequential", "per_window", "frozen")


def check_batchnorm(
  batchnorm: str, momentum: float | None, has_state: bool, *, from_model: bool = False
) -> None:
  """Checks the BatchNorm mode and momentum (``from_model``: read later from the model)."""
  if batchnorm not in BATCHNORM_MODES:
    raise ValueError(f"Unknown {batchnorm=}; use one of {', '.join(map(repr, BATCHNORM_MODES))}.")
  if momentum is not None:
    real = isinstance(momentum, numbers.Real) and not isinstance(momentum, bool)
    if not (real and 0.0 <= float(momentum) < 1.0):
      raise ValueError(
        f"batchnorm_momentum={momentum!r} must be a float in [0, 1): the momentum m of the"
        " BatchNorm running averages (new = m * old + (1 - m) * batch statistic)."
      )
  if batchnorm != "sequential" and not has_state:
    raise ValueError(
      f"{batchnorm=} needs the model state: pass has_state=True and a loss_fn(params,"
      " model_state, microbatch) that returns the new model state."
    )
  if batchnorm == "per_window" and not from_model and momentum is None:
    raise ValueError(
      "batchnorm='per_window' needs batchnorm_momentum, the momentum m of the running"
      " averages (new = m * old + (1 - m) * batch statistic, 0 <= m < 1; flax's default is"
      f" 0.99), got {momentum!r}."
    )


def check_state_like(new_state: Any, model_state: Any) -> None:
  """The loss must return a model state with the structure, shapes and dtypes it was given."""
  if new_state is None and model_state is not None:
    raise TypeError(
      "With has_state=True, loss_fn must return (loss, new_model_state) (or (loss, (aux,"
      " new_model_state)) with has_aux), but the new model state is None. Return the"
      " updated state, e.g. the 'batch_stats' from module.apply(..., mutable=['batch_stats'])."
    )
  ndef, odef = jax.tree.structure(new_state), jax.tree.structure(model_state)
  if ndef != odef:
    raise ValueError(
      "The model state returned by loss_fn has another structure than the one it was given;"
      " it must stay the same across micro-batches.\n"
      f"  given:    {odef}\n  returned: {ndef}"
    )
  for (path, n), o in zip(
    jax.tree_util.tree_leaves_with_path(new_state), jax.tree.leaves(model_state), strict=True
  ):
    if jnp.shape(n) != jnp.shape(o) or jnp.result_type(n) != jnp.result_type(o):
      raise ValueError(
        f"The model state leaf {jax.tree_util.keystr(path)} came back as"
        f" {jnp.result_type(n)}{list(jnp.shape(n))}, but was given as"
        f" {jnp.result_type(o)}{list(jnp.shape(o))}; it must keep its shape and dtype."
      )


def _paths(model_state: Any) -> list[tuple[Any, ...]]:
  """Each leaf's path as a tuple of its dict keys, attribute names and indices."""
  return [
    tuple(next((getattr(e, a) for a in ("key", "name", "idx") if hasattr(e, a)), e) for e in p)
    for p, _ in jax.tree_util.tree_leaves_with_path(model_state)
  ]


def batchnorm_leaves(model_state: Any) -> list[str | None]:
  """For each leaf: ``"mean"``/``"var"`` for BatchNorm running statistics, else None: a pair of
  leaves named ``mean`` and ``var`` with the same parent, as in flax (Linen and NNX)."""
  paths = _paths(model_state)
  present, other = set(paths), {"mean": "var", "var": "mean"}
  return [
    p[-1] if p and p[-1] in other and p[:-1] + (other[p[-1]],) in present else None for p in paths
  ]


class ModelCarry(NamedTuple):
  state: Any  # the model state after the last micro-batch
  stats: Any  # per_window: the running sums of the BatchNorm statistics


@dataclasses.dataclass(frozen=True)
class ModelStateUnit(Unit):
  """The scan's unit for the model state (protocol: ``_parts``): how it flows through the
  micro-batches of a window."""

  mode: str
  momentum: float | None
  kinds: tuple[str | None, ...]
  var_to_mean: tuple[int | None, ...]
  initial: Any  # the model state the window starts from
  name = "model_state"

  @classmethod
  def make(cls, model_state: Any, mode: str, momentum: float | None) -> ModelStateUnit:
    kinds = tuple(batchnorm_leaves(model_state))
    if mode != "sequential" and not any(kinds):
      raise ValueError(
        f"batchnorm={mode!r} but the model state has no BatchNorm statistics (pairs of leaves"
        f" named 'mean' and 'var', e.g. flax's 'batch_stats' collection). Structure:"
        f" {jax.tree.structure(model_state)}. Use batchnorm='sequential' for other state."
      )
    paths = _paths(model_state)
    index = {p: i for i, p in enumerate(paths)}
    var_to_mean = tuple(
      index[p[:-1] + ("mean",)] if kind == "var" else None
      for p, kind in zip(paths, kinds, strict=True)
    )
    return cls(mode, momentum, kinds, var_to_mean, model_state)

  def init(self, acc_init: Any = None, like: Any = None) -> ModelCarry:
    """per_window's stats: (sum of new values, sum of squared shifts) per BatchNorm leaf."""
    if self.mode != "per_window":
      return ModelCarry(self.initial, None)
    stats = [
      (jnp.zeros(jnp.shape(x), jnp.float32),) * 2 if kind else None
      for kind, x in zip(self.kinds, jax.tree.leaves(self.initial), strict=True)
    ]
    return ModelCarry(self.initial, stats)

  def start(self, c: ModelCarry) -> Any:
    """The state the next micro-batch starts from (also the frozen mode's state after it)."""
    if self.mode == "sequential":
      return c.state
    leaves, treedef = jax.tree.flatten(c.state)
    trios = zip(leaves, jax.tree.leaves(self.initial), self.kinds, strict=True)
    return treedef.unflatten([x0 if kind else x for x, x0, kind in trios])

  def update(self, c: ModelCarry, m: Micro) -> ModelCarry:
    if self.mode != "per_window":
      return ModelCarry(m.model_state, None)

    def one(st, x, x0):
      x = x.astype(jnp.float32)
      shift = x - x0.astype(jnp.float32)
      return st[0] + x, st[1] + shift * shift

    n, s = jax.tree.leaves(m.model_state), jax.tree.leaves(self.initial)
    stats = [None if st is None else one(st, n[i], s[i]) for i, st in enumerate(c.stats)]
    return ModelCarry(m.model_state, stats)

  def finalize(self, c: ModelCarry, num: Any, rows: int = 0) -> Any:
    """The model state after the window of ``num`` micro-batches."""
    if self.mode != "per_window":
      return self.start(c)
    out, treedef = jax.tree.flatten(c.state)
    s, stats = jax.tree.leaves(self.initial), c.stats
    k = jnp.asarray(num, jnp.float32)
    for i, kind in enumerate(self.kinds):
      if kind is None:
        continue
      mean_new = stats[i][0] / k
      if kind == "var":
        # mean_i(new_var_i) is the EMA of the mean micro-batch variance; the pooled
        # variance adds the variance of the micro-batch means mu_i. With
        # new_mean_i = m * old + (1 - m) * mu_i, var_i(new_mean_i) = (1 - m)^2 var_i(mu_i).
        j = self.var_to_mean[i]
        shift_mean = stats[j][0] / k - s[j].astype(jnp.float32)
        var_of_new_means = jnp.maximum(stats[j][1] / k - shift_mean**2, 0.0)
        mean_new = mean_new + var_of_new_means / (1.0 - self.momentum)
      out[i] = mean_new.astype(jnp.result_type(s[i]))
    return treedef.unflatten(out)

  def reduce(self, state: Any) -> tuple[dict[str, Any], Any]:
    """Over the devices as ``"state"``: float leaves averaged where they differ, int, bool and
    key leaves maxed (``_sharding.reduce_state``)."""
    return {"state": state}, lambda got: got["state"]
