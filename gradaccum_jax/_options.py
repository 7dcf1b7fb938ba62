"""The options every step takes, declared once, and the records they are checked into."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import jax
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
from gradaccum_jax._parts import AuxReducers, reducer_names
from gradaccum_jax._sharding import DataParallel, make_data_parallel

# Every keyword option of the steps: (default, what it does). Each public function takes the
# ones it names in ``@takes(...)``, with these defaults and these docs.
OPTIONS: dict[str, tuple[Any, str]] = {
  "has_aux": (False, "``loss_fn`` returns ``(loss, aux)``; float aux averaged, integer summed."),
  "weight_fn": (None, "``microbatch -> w_i``, e.g. its tokens (a dict: per term, docs/usage.md)."),
  "has_state": (False, "``loss_fn(params, model_state, microbatch[, rng]) -> (loss, new_state)``;"
                " the step takes and returns ``model_state`` after ``params``."),
  "batchnorm": ("sequential", "BatchNorm statistics: ``\"sequential\"``, ``\"per_window\"`` or"
                " ``\"frozen\"`` (docs/models.md)."),
  "batchnorm_momentum": (None, "the running averages' momentum for ``\"per_window\"``."),
  "compute_dtype": (None, "float params cast to it (e.g. ``jnp.bfloat16``) for the loss and the"
                    " window statistics, whose layers may fix their own (docs/models.md)."),
  "mesh": (None, "a ``jax.sharding.Mesh``: data parallel, one reduction per window"
           " (docs/data_parallel.md)."),
  "data_axis": (None, "the mesh axes the batch is split over (``\"data\"``)."),
  "param_specs": (None, "the params' ``PartitionSpec`` prefix: FSDP and model axes."),
  "gather_params": ("once", "FSDP params gathered ``\"once\"`` a window, ``\"per_microbatch\"``"
                    " or ``\"auto\"`` (the first that fits the memory budget)."),
  "memory_budget_bytes": (None, "the per-device budget of the ``\"auto\"`` choices."),
  "grads_in_place": (True, "add each gradient into the accumulator in its backward pass where"
                     " JAX can (0.11+; docs/models.md)."),
  "aux_reduce": (None, "each aux leaf's reducer: ``\"mean\"``, ``\"sum\"``, ``\"max\"``,"
                 " ``\"min\"``, ``\"last\"`` (a name, or a prefix of the aux)."),
  "window_stats": (None, "``stats_fn(params, microbatch)``, reduced over the window first;"
                   " ``loss_fn`` takes the result after the micro-batch (docs/models.md)."),
  "window_stats_reduce": (None, "``window_stats``' reducers, as ``aux_reduce``."),
  "unroll": (1, "micro-batches per trip of the loop, or ``\"auto\"`` (docs/choosing_k.md)."),
}  # fmt: skip


def takes(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Gives a public ``fn(..., **options)`` the keyword options ``names`` of :data:`OPTIONS`: in
  its signature, in its docstring's Args (where it does not document them itself), and refused,
  as Python refuses them, when not among them."""

  def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
      for key in kwargs:
        if key not in allowed:
          raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {key!r}")
      return fn(*args, **kwargs)

    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    allowed = {p.name for p in own if p.kind != p.POSITIONAL_ONLY} | set(names)
    extra = [
      inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=OPTIONS[n][0]) for n in names
    ]
    call.__signature__ = sig.replace(parameters=own + extra)
    del call.__wrapped__  # the signature above, not fn's source (no options there), is the API
    call.__doc__ = _with_docs(fn.__doc__ or "", names)
    return call

  return wrap


def _with_docs(doc: str, names: tuple[str, ...]) -> str:
  """``doc`` with an Args line for each option of ``names`` it does not document."""
  said = {n.strip() for m in re.findall(r"^    ([\w, ]+):", doc, re.M) for n in m.split(",")}
  lines = [
    textwrap.fill(f"{n}: {OPTIONS[n][1]}", 96, initial_indent="    ", subsequent_indent="      ")
    for n in names
    if n not in said
  ]
  head, sep, tail = doc.partition("\n\n  Returns:")
  return f"{head}\n" + "\n".join(lines) + sep + tail if lines and sep else doc


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
  """The loss as a scalar array (Python numbers too), or at the top a dict of them: its terms."""
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
class Loss:
  """How ``loss_fn`` is called, what it returns and how its aux is reduced."""

  fn: Callable[..., Any]
  has_aux: bool = False
  has_state: bool = False
  takes_stats: bool = False  # the window's statistics after the micro-batch (window_stats=)
  aux: AuxReducers = AuxReducers()

  def call(self, params, model_state, mb, key, stats=None) -> tuple[Any, Any, Any]:
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
class WindowStats:
  """``window_stats=``: ``stats_fn(params, [model_state,] microbatch[, rng])`` (the core's
  signature; the front ends translate theirs) and its reducers."""

  fn: Callable[..., Any]
  reducers: AuxReducers
  has_state: bool

  def call(self, params: Any, model_state: Any, mb: Any, key: Any) -> Any:
    args = (params, model_state, mb) if self.has_state else (params, mb)
    return self.fn(*(args if key is None else (*args, key)))


@dataclasses.dataclass(frozen=True)
class Precision:
  """``compute_dtype=`` (float params cast to it for the loss and the statistics) and
  ``grads_in_place=``."""

  compute_dtype: Any = None
  in_place: bool = True

  def cast(self, params: Any) -> Any:
    if self.compute_dtype is None:
      return params
    floating = lambda x: jnp.issubdtype(jnp.result_type(x), jnp.floating)  # noqa: E731
    return jax.tree.map(lambda x: x.astype(self.compute_dtype) if floating(x) else x, params)


@dataclasses.dataclass(frozen=True)
class Config:
  """A step's options, checked once: one record per concern, each handed to its stage."""

  where: str  # the public function the user called, for errors
  loss: Loss
  weight_fn: Callable[[Any], Any] | None = None
  precision: Precision = Precision()
  batchnorm: tuple[str, float | None] = ("sequential", None)  # mode and momentum
  stats: WindowStats | None = None
  mesh: DataParallel | None = None
  unroll: int | str = 1  # micro-batches per trip of the loop, or "auto"
  budget: int | None = None  # memory_budget_bytes of unroll="auto" (None: a margin over 1)

  @classmethod
  def make(cls, where: str, loss_fn: Callable[..., Any], *, from_model: bool = False,
           **options: Any) -> Config:  # fmt: skip
    """The options of ``where`` (a public function's name) checked; ``from_model``: the Flax
    steps read ``"per_window"``'s momentum from the model."""
    o = {n: options.get(n, default) for n, (default, _) in OPTIONS.items()}
    has_aux, has_state = bool(o["has_aux"]), bool(o["has_state"])
    check_function(loss_fn, f"{where}: loss_fn must be a function")
    if o["weight_fn"] is not None:
      check_function(
        o["weight_fn"], f"{where}: weight_fn must be a function microbatch -> scalar weight"
      )
    check_batchnorm(o["batchnorm"], o["batchnorm_momentum"], has_state, from_model=from_model)
    dtype = o["compute_dtype"]
    dtype = None if dtype is None else check_float_dtype(dtype, "compute_dtype", where)
    check_aux_reduce(o["aux_reduce"], has_aux, reducer_names(), where)
    stats = _window_stats(o["window_stats"], o["window_stats_reduce"], has_state, where)
    unroll, budget, gather = (
      check_unroll(o["unroll"], where),
      o["memory_budget_bytes"],
      o["gather_params"],
    )
    if budget is not None:
      if gather != "auto" and unroll != "auto":
        raise ValueError(
          f"{where}: memory_budget_bytes= is the budget of gather_params='auto' and"
          f" unroll='auto'; got gather_params={gather!r}, unroll={unroll!r}."
        )
      check_budget(budget, where)
    mesh = make_data_parallel(
      o["mesh"],
      o["data_axis"],
      o["param_specs"],
      where,
      gather,
      budget if gather == "auto" else None,
    )
    momentum = o["batchnorm_momentum"]
    return cls(
      where=where,
      loss=Loss(
        loss_fn, has_aux, has_state, stats is not None, AuxReducers(o["aux_reduce"], where)
      ),
      weight_fn=o["weight_fn"],
      precision=Precision(dtype, check_bool(o["grads_in_place"], f"{where}: grads_in_place")),
      batchnorm=(o["batchnorm"], None if momentum is None else float(momentum)),
      stats=stats,
      mesh=mesh,
      unroll=unroll,
      budget=budget if unroll == "auto" else None,
    )

  def chosen(self, gather: str | None, unroll: int) -> Config:
    """This config with one gather policy ("once" or "per_microbatch"; None without a mesh)
    and one unroll, as ``"auto"`` compiles each (``_memory.gathered``)."""
    mesh = self.mesh if gather is None else dataclasses.replace(self.mesh, gather=gather)
    return dataclasses.replace(self, mesh=mesh, unroll=unroll)


def _window_stats(fn: Any, reduce: Any, has_state: bool, where: str) -> WindowStats | None:
  """``window_stats=`` and ``window_stats_reduce=`` checked (None without them)."""
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
