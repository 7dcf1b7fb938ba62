"""The options of the micro-batched gradient, validated once and shared by every front end."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

from gradaccum_jax._checks import (
  check_aux_reduce,
  check_bool,
  check_budget,
  check_float_dtype,
  check_function,
  check_int,
)
from gradaccum_jax._model_state import check_batchnorm, check_state_like
from gradaccum_jax._parts import AuxReducers, Weighting, cast_floats, reducer_names
from gradaccum_jax._sharding import DataParallel, make_data_parallel
from gradaccum_jax._terms import Terms, combine, refused
from gradaccum_jax._window_stats import WindowStats


def split_output(out: Any, has_aux: bool, what: str = "loss_fn") -> tuple[Any, Any]:
  """``(loss, aux)`` from what a loss function returned; aux is None without ``has_aux``."""
  if has_aux:
    if not (isinstance(out, tuple | list) and len(out) == 2):
      raise TypeError(f"With has_aux=True, {what} must return a pair (loss, aux), got {out!r:.80}.")
    return out[0], out[1]
  if isinstance(out, tuple | list):
    raise TypeError(
      f"{what} returned a {type(out).__name__} of length {len(out)}; if it returns"
      " (loss, aux), pass has_aux=True (and has_state=True for (loss, new_model_state))."
    )
  return out, None


def check_loss(loss: Any, has_aux: bool, what: str = "loss_fn") -> Any:
  """The loss as a scalar array (Python numbers accepted, as ``jax.value_and_grad`` does), or a
  dict of them: a loss of several terms (``_terms``)."""
  if isinstance(loss, Mapping) and loss and what == "loss_fn":
    return {t: check_loss(x, has_aux, f"loss_fn's term {t!r}") for t, x in loss.items()}
  if not (hasattr(loss, "shape") or isinstance(loss, int | float)):
    several = " (or a dict of them: a loss of several terms)" if what == "loss_fn" else ""
    raise TypeError(f"{what} must return a scalar array{several}, got {type(loss).__name__}.")
  if jnp.shape(loss) != ():
    hint = "" if has_aux or what != "loss_fn" else " If it returns (loss, aux), pass has_aux=True."
    raise ValueError(
      f"{what} must return a scalar: the mean loss over its micro-batch; got"
      f" shape {jnp.shape(loss)}.{hint}"
    )
  loss = jnp.asarray(loss)
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(f"{what} must return a real float loss, got dtype {loss.dtype}.")
  return loss


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """How ``loss_fn`` is called and what it returns."""

  fn: Callable[..., Any]
  has_aux: bool
  has_state: bool
  takes_stats: bool = False  # the window's statistics after the micro-batch (window_stats=)

  def call(self, params: Any, model_state: Any, mb: Any, key: Any, stats: Any = None
           ) -> tuple[Any, Any, Any]:  # fmt: skip
    """``(loss, aux, new_model_state)`` of one micro-batch (``stats``: the window's)."""
    args = (params, model_state, mb) if self.has_state else (params, mb)
    args = (*args, stats) if self.takes_stats else args
    args = args if key is None else (*args, key)
    self._check_signature(len(args))
    out = self.fn(*args)
    if not self.has_state:
      loss, aux = split_output(out, self.has_aux)
      return check_loss(loss, self.has_aux), aux, None
    shape = "(loss, (aux, new_model_state))" if self.has_aux else "(loss, new_model_state)"
    if not (isinstance(out, tuple | list) and len(out) == 2):
      raise TypeError(f"With has_state=True, loss_fn must return a pair {shape}, got {out!r:.80}.")
    loss, rest = out
    aux, new_state = split_output(rest, True) if self.has_aux else (None, rest)
    check_state_like(new_state, model_state)
    return check_loss(loss, self.has_aux), aux, new_state

  def _check_signature(self, n: int) -> None:
    """A TypeError naming the ga signature when ``loss_fn`` cannot take ``n`` arguments."""
    try:
      inspect.signature(self.fn).bind(*range(n))
    except ValueError:  # no signature to read (a builtin): let the call say
      return
    except TypeError:
      called = "params, model_state, microbatch" if self.has_state else "params, microbatch"
      called += ", stats" if self.takes_stats else ""
      if n > 2 + self.has_state + self.takes_stats:
        called += ", rng"
        fix = "add an rng argument to loss_fn, or call the step without rng="
      elif self.takes_stats:
        fix = "with window_stats=, loss_fn gets the window's statistics after the micro-batch"
      else:
        fix = "call the step with rng=key if loss_fn takes a key"
        if not self.has_state:
          fix += ", or pass has_state=True for loss_fn(params, model_state, microbatch)"
      raise TypeError(
        f"ga calls loss_fn({called}), but {getattr(self.fn, '__name__', 'loss_fn')}"
        f"{inspect.signature(self.fn)} does not take {n} positional arguments: {fix}."
      ) from None

  def pack(self, loss: Any, aux: Any, model_state: Any) -> Any:
    """The value part in the shape ``loss_fn`` returns it."""
    if self.has_state:
      return (loss, (aux, model_state)) if self.has_aux else (loss, model_state)
    return (loss, aux) if self.has_aux else loss


@dataclasses.dataclass(frozen=True)
class Options:
  """Everything about how a loss is turned into a window's sums, checked once."""

  loss: LossSpec
  weighting: Weighting
  batchnorm: str = "sequential"
  batchnorm_momentum: float | None = None
  compute_dtype: Any = None
  parallel: DataParallel | None = None
  where: str = "train_step"  # the public function the user called, for errors
  grads_in_place: bool = True  # gradients added into the accumulator where JAX can
  aux_reduce: AuxReducers = AuxReducers()  # how each aux leaf is reduced over a window
  terms: Terms | None = None  # in a window of a loss with per-term weights, its terms' totals
  window_stats: WindowStats | None = None  # statistics of the window the loss reads, else None
  stats: Any = None  # their value in a window (_window_stats.WindowStats.window)
  privacy: Any = None  # DP (_privacy.Privacy): each example's gradient clipped, else None
  unroll: int | str = 1  # micro-batches per trip of the scan, or "auto" (_memory.gathered)
  budget: int | None = None  # memory_budget_bytes of unroll="auto" (None: a margin over 1)

  @property
  def has_state(self) -> bool:
    return self.loss.has_state

  def objective(self, params, model_state, mb, key, scale, *, only=None, checked=False):
    """(loss * scale in float32, (loss, aux, new_model_state)): what is differentiated. A loss of
    several terms (``_terms``) as the sums take it: ``{"loss": ..., "loss_terms": ...}``;
    ``only``: one term's alone; ``checked``: the rest also says whether every term of weight 0
    is finite."""
    params = cast_floats(params, self.compute_dtype)
    loss, aux, new_state = self.loss.call(params, model_state, mb, key, self.stats)
    clean = jnp.ones((), bool)
    if isinstance(loss, dict):
      if self.where == "micro_step":
        raise TypeError(refused(self.where, list(loss)))
      loss, clean = combine(loss) if self.terms is None else self.terms.combine(loss, mb, only)
    value = loss["loss"] if isinstance(loss, dict) else loss
    scaled = value.astype(jnp.promote_types(value.dtype, jnp.float32))
    rest = (loss, aux, new_state, clean) if checked else (loss, aux, new_state)
    return (scaled if scale is None else scaled * scale), rest

  def for_window(self, terms: Terms) -> Options:
    """These options in a window of a loss with per-term weights: each micro-batch weighs
    ``u_i`` (``terms``: their window totals, ``_terms.Terms.make``)."""
    return dataclasses.replace(self, terms=terms, weighting=Weighting(terms.weight))

  def chosen(self, gather: str | None, unroll: int) -> Options:
    """These options with one gather policy ("once" or "per_microbatch"; None without a mesh)
    and one unroll, as ``"auto"`` compiles each (``_memory.gathered``)."""
    parallel = (
      self.parallel if gather is None else dataclasses.replace(self.parallel, gather=gather)
    )
    return dataclasses.replace(self, parallel=parallel, unroll=unroll)


def make_options(
  where: str,
  loss_fn: Callable[..., Any],
  *,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  has_state: bool = False,
  batchnorm: str = "sequential",
  batchnorm_momentum: float | None = None,
  compute_dtype: Any = None,
  mesh: Any = None,
  data_axis: Any = None,
  param_specs: Any = None,
  gather_params: str = "once",
  memory_budget_bytes: int | None = None,
  momentum_from_model: bool = False,
  grads_in_place: bool = True,
  aux_reduce: Any = None,
  window_stats: Callable[..., Any] | None = None,
  window_stats_reduce: Any = None,
  unroll: int | str = 1,
) -> Options:
  """Validates the options of ``where`` (a public function's name) and builds them."""
  check_function(loss_fn, f"{where}: loss_fn must be a function")
  if weight_fn is not None:
    check_function(weight_fn, f"{where}: weight_fn must be a function microbatch -> scalar weight")
  check_batchnorm(batchnorm, batchnorm_momentum, bool(has_state), from_model=momentum_from_model)
  if compute_dtype is not None:
    compute_dtype = check_float_dtype(compute_dtype, "compute_dtype", where)
  check_aux_reduce(aux_reduce, bool(has_aux), reducer_names(), where)
  stats = _window_stats(window_stats, window_stats_reduce, bool(has_state), where)
  unroll = check_unroll(unroll, where)
  if memory_budget_bytes is not None:
    if gather_params != "auto" and unroll != "auto":
      raise ValueError(
        f"{where}: memory_budget_bytes= is the budget of gather_params='auto' and"
        f" unroll='auto'; got gather_params={gather_params!r}, unroll={unroll!r}."
      )
    check_budget(memory_budget_bytes, where)
  return Options(
    loss=LossSpec(loss_fn, bool(has_aux), bool(has_state), stats is not None),
    unroll=unroll,
    budget=memory_budget_bytes if unroll == "auto" else None,
    window_stats=stats,
    weighting=Weighting(weight_fn),
    batchnorm=batchnorm,
    batchnorm_momentum=None if batchnorm_momentum is None else float(batchnorm_momentum),
    compute_dtype=compute_dtype,
    parallel=make_data_parallel(
      mesh,
      data_axis,
      param_specs,
      where,
      gather_params,
      memory_budget_bytes if gather_params == "auto" else None,
    ),
    where=where,
    grads_in_place=check_bool(grads_in_place, f"{where}: grads_in_place"),
    aux_reduce=AuxReducers(aux_reduce, where),
  )


def _window_stats(fn: Any, reduce: Any, has_state: bool, where: str) -> WindowStats | None:
  """``window_stats=`` and ``window_stats_reduce=`` checked, as a :class:`WindowStats` (None
  without them)."""
  if fn is None:
    if reduce is not None:
      raise ValueError(
        f"{where}: window_stats_reduce={reduce!r} is given without window_stats= (the function"
        " whose values it reduces)."
      )
    return None
  check_function(fn, f"{where}: window_stats must be a function")
  check_aux_reduce(reduce, True, reducer_names(), where, "window_stats_reduce")
  return WindowStats(fn, AuxReducers(reduce, where, "window_stats_reduce"), has_state)


def check_unroll(unroll: Any, where: str) -> int | str:
  """``unroll``: a positive int (micro-batches per trip of the window's loop) or ``"auto"``."""
  if unroll == "auto":
    return unroll
  must = f"{where}: unroll must be a positive int (micro-batches per trip of the loop) or 'auto'"
  n = check_int(unroll, f"{must}, got {unroll!r}.")
  if n < 1:
    raise ValueError(f"{must}, got {n}.")
  return n
