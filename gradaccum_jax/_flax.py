"""Flax Linen: a fused accumulation step for a ``TrainState`` (flax imported when it is built)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from gradaccum_jax._accumulate import as_accumulate
from gradaccum_jax._equivalence import HOW, CheckWindow, call_copied, host_arguments
from gradaccum_jax._memory import gathered
from gradaccum_jax._options import OPTIONS, Config, Loss, split_output, takes
from gradaccum_jax._parts import Overwritten, register_overwrite
from gradaccum_jax._train_step import JitStep, fused_step


@dataclasses.dataclass(frozen=True)
class _LinenModel:
  """A Linen module applied to a micro-batch, with errors that name the argument to change."""

  module: Any
  inputs: Any  # the batch key of the model input, or microbatch -> tuple of apply's arguments
  train_kwargs: dict[str, Any]
  collections: tuple[str, ...]  # the RNG collections that get keys
  name: str  # the module's class and name, for errors
  flax: Any  # the flax package

  @classmethod
  def make(cls, module, inputs, train_kwargs, rng_collections) -> _LinenModel:
    names = check_linen_args(inputs, train_kwargs, rng_collections)
    try:
      import flax.linen  # flax.core and flax.errors come with it
    except ImportError as e:  # pragma: no cover - flax is installed with the test extra
      raise ImportError(
        "ga.linen_train_step needs flax: pip install 'gradaccum_jax[flax]' (or pip install flax)."
      ) from e
    if not isinstance(module, flax.linen.Module):
      raise TypeError(f"module must be a flax.linen.Module, got {type(module).__name__}.")
    name = type(module).__name__ + (f" {module.name!r}" if module.name else "")
    return cls(module, inputs, dict(train_kwargs or {}), names, name, flax)

  def args(self, mb):
    """The positional arguments of ``module.apply`` for micro-batch ``mb``."""
    if callable(self.inputs):
      args = self.inputs(mb)
      return args if isinstance(args, tuple) else (args,)
    try:
      return (mb[self.inputs],)
    except (KeyError, TypeError, IndexError):
      keys = list(mb) if isinstance(mb, dict) else type(mb).__name__
      raise ValueError(
        f"inputs={self.inputs!r} is not a key of the micro-batch (keys: {keys}). Pass inputs="
        " the key of the model input, or a callable microbatch -> tuple of apply's arguments."
      ) from None

  def apply(self, params, batch_stats, mb, key, with_stats):
    """``(output, new batch_stats)`` (``batch_stats`` unchanged without ``with_stats``)."""
    # fp8: params are the variables {"params", "_overwrite_with_gradient"} (Flax's TrainState)
    fp8 = fp8_overwritten(params, "params", "linen_train_step") is not None
    variables = dict(params) if fp8 else {"params": params}
    variables.update({"batch_stats": batch_stats} if with_stats else {})
    keyed = () if key is None else enumerate(self.collections)
    rngs = {c: jax.random.fold_in(key, j) for j, c in keyed}
    try:
      out = self.module.apply(
        variables, *self.args(mb), **self.train_kwargs,
        mutable=["batch_stats"] if with_stats else False, rngs=rngs,
      )  # fmt: skip
    except Exception as e:
      self._explain(e, key, with_stats)  # raises the error naming the argument to change
      raise
    if not with_stats:
      return out, batch_stats
    out, new_stats = out[0], out[1].get("batch_stats", {})
    frozen = isinstance(batch_stats, self.flax.core.FrozenDict)  # keep the state's structure
    return out, self.flax.core.freeze(new_stats) if frozen else new_stats

  def _explain(self, e: Exception, key: Any, with_stats: bool) -> None:
    """Raises the error naming the argument of ``linen_train_step`` to change, if ``e`` has one."""
    errors, name = self.flax.errors, self.name
    if isinstance(e, errors.ScopeCollectionNotFound) and not with_stats and "batch_stats" in str(e):
      raise ValueError(
        f"{name} has a 'batch_stats' collection, but the train_state has none. Use a TrainState"
        " subclass with a field `batch_stats: Any` set to module.init(...)['batch_stats']."
      ) from e
    if isinstance(e, TypeError) and "required" in str(e) and "__call__" in str(e):
      raise TypeError(
        f"{e}\n{name}.__call__ needs more than microbatch[{self.inputs!r}] and train_kwargs="
        f"{self.train_kwargs}: pass its training keywords, e.g. train_kwargs={{'train': True}},"
        " or inputs= a callable microbatch -> tuple of positional arguments."
      ) from e
    if isinstance(e, errors.InvalidRngError):
      hint = f"add the collection to rng_collections (now {self.collections})"
      if key is None:
        hint = "pass a fresh key to the step: step(train_state, batch, rng=key)"
      raise ValueError(f"{e}\n{name} needs a PRNG key in training: {hint}.") from e

  def loss(self, spec: Loss, with_stats: bool) -> Loss:
    """``spec``'s ``loss_fn(outputs, microbatch)`` as the ``has_state`` loss of ``fused_step``."""

    def loss(params, batch_stats, mb, *rest):  # rest: (window stats,) (key,)
      stats = rest[:1] if spec.takes_stats else ()
      key = rest[len(stats)] if len(rest) > len(stats) else None
      out, new_stats = self.apply(params, batch_stats, mb, key, with_stats)
      try:
        value, aux = split_output(spec.fn(out, mb, *stats), spec.has_aux)
      except self.flax.errors.ApplyScopeInvalidVariablesTypeError as e:
        raise TypeError(
          f"ga.linen_train_step calls loss_fn(outputs, microbatch) and applies {self.name}"
          f" itself, but this loss_fn applies a module ({e}). Write loss_fn(outputs, microbatch),"
          " e.g. lambda logits, mb: optax.softmax_cross_entropy_with_integer_labels(...).mean()."
        ) from e
      return spec.pack(value, aux, new_stats)

    return dataclasses.replace(spec, fn=loss)

  def window_stats(self, ws: Any, with_stats: bool) -> Any:
    """``window_stats(outputs, microbatch)`` as the core's (None stays None)."""
    if ws is None:
      return None

    def stats(params, batch_stats, mb, key=None):
      return ws.fn(self.apply(params, batch_stats, mb, key, with_stats)[0], mb)

    return dataclasses.replace(ws, fn=stats)

  def momentum(self, params, batch_stats, batch, key) -> float:
    """The one momentum of the module's BatchNorms that update running statistics."""
    nn, seen = self.flax.linen, {}

    def interceptor(next_fun, args, kwargs, context):
      bn = context.module
      if isinstance(bn, nn.BatchNorm) and context.method_name == "__call__":
        use_ra = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
        if (bn.use_running_average if use_ra is None else use_ra) is not True:
          seen["/".join(map(str, bn.path)) or type(bn).__name__] = bn.momentum
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):  # shapes only: the whole batch serves
      jax.eval_shape(lambda *a: self.apply(*a, with_stats=True), params, batch_stats, batch, key)
    if len(set(seen.values())) != 1:
      listing = ", ".join(f"{path}: {m}" for path, m in seen.items())
      found = f"BatchNorms of different momenta ({listing})" if seen else "no BatchNorm in training"
      raise ValueError(
        f"batchnorm='per_window' needs one momentum, but {self.name} has {found} (with"
        f" train_kwargs={self.train_kwargs!r}). Give them one, pass batchnorm_momentum=m, or use"
        " batchnorm='sequential'."
      )
    return float(next(iter(seen.values())))


def _linen_step(model: _LinenModel, config: Config, donate: bool, jit: bool):
  """:func:`linen_train_step` for one gather policy: the model translated for ``fused_step``."""

  def step(train_state, batch, rng=None, *, num_real_microbatches=None):
    tx = as_accumulate(getattr(train_state, "tx", None), "train_state.tx")
    has_field = hasattr(train_state, "batch_stats")
    stats = train_state.batch_stats if has_field else {}
    with_stats = bool(jax.tree.leaves(stats))
    mode, m = config.batchnorm
    if mode != "sequential" and not with_stats:
      raise ValueError(
        f"batchnorm={mode!r} needs BatchNorm statistics, but {model.name} has no"
        f" 'batch_stats' collection (the {type(train_state).__name__}'s batch_stats are"
        f" {'empty' if has_field else 'missing'}). Use batchnorm='sequential' (the default)."
      )
    if mode == "per_window" and m is None:
      m = model.momentum(train_state.params, stats, batch, rng)
    run = dataclasses.replace(
      config, loss=model.loss(config.loss, with_stats), batchnorm=(mode, m),
      stats=model.window_stats(config.stats, with_stats),
    )  # fmt: skip
    params, new_stats, opt_state, metrics = fused_step(run, tx, donate and jit)(
      train_state.params, stats, train_state.opt_state, batch, rng, num_real_microbatches
    )
    new = {"step": train_state.step + 1, "params": params, "opt_state": opt_state}
    return train_state.replace(**new, **({"batch_stats": new_stats} if has_field else {})), metrics

  if not jit:
    return step

  def k(args):
    return as_accumulate(args[0].tx).fixed_num_microbatches("linen_train_step")

  return JitStep(jax.jit(step, donate_argnums=(0,) if donate else ()), k)


@takes(*(n for n in OPTIONS if n != "has_state"))
def linen_train_step(
  module: Any, loss_fn: Callable[..., Any], *, inputs: str | Callable[[Any], Any] = "x",
  train_kwargs: dict[str, Any] | None = None, rng_collections: Sequence[str] = ("dropout",),
  donate: bool = False, jit: bool = True, **options: Any,
) -> Callable[..., tuple[Any, dict[str, Any]]]:  # fmt: skip
  r"""A fused accumulation step for a Flax Linen module and its ``TrainState``.

  ``step(train_state, batch, rng=None)`` is :func:`train_step` (``has_state=True``, the state
  ``batch_stats``) for ``train_state.tx = ga.accumulate(inner, k)`` and the loss
  ``loss_fn(module.apply(...), microbatch)``. More: docs/models.md; fp8 params: docs/usage.md.

  Args:
    module: the ``flax.linen.Module`` (``module.apply`` is called, not ``apply_fn``).
    loss_fn, window_stats: ``fn(outputs, microbatch)``.
    inputs: the batch key of the model input, or ``inputs(microbatch)`` -> ``apply``'s arguments.
    train_kwargs: keyword arguments of every ``module.apply``, e.g. ``{"train": True}``.
    rng_collections: the RNG collections that get keys (``fold_in(fold_in(rng, i), j)``).
    donate, jit: write over the old state; jit the step.
    batchnorm_momentum: ``"per_window"``'s momentum (None: the module's ``nn.BatchNorm``'s).

  Returns:
    ``step(train_state, batch, rng=None, *, num_real_microbatches=None) -> (train_state,
    metrics)``, ``train_state.step`` advanced by 1; ``metrics`` as :func:`train_step`'s.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, gradaccum_jax as ga
    >>> from flax.training import train_state
    >>> class TrainState(train_state.TrainState):
    ...   batch_stats: dict
    >>> net = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=False)])
    >>> v = net.init(jax.random.key(0), jnp.ones((1, 3)))  # {"params", "batch_stats"}
    >>> state = TrainState.create(apply_fn=net.apply, tx=ga.accumulate(optax.adam(1e-3), 4), **v)
    >>> step = ga.linen_train_step(net, lambda y, mb: jnp.mean(y**2), batchnorm="per_window")
    >>> state, metrics = step(state, {"x": jax.random.normal(jax.random.key(1), (32, 3))})
    >>> int(state.step), int(state.opt_state.count)
    (1, 1)
  """
  config = Config.make("linen_train_step", loss_fn, from_model=True, has_state=True, **options)
  model = _LinenModel.make(module, inputs, train_kwargs, rng_collections)
  step = gathered(lambda c, j: _linen_step(model, c, donate, j), config, jit)
  step.check_window = _check_window
  return step


def _check_window(step, loss_fn, train_state, batch, more) -> CheckWindow:
  """One window of a Linen step, ``step(train_state, batch)`` (``ga.check_step``)."""
  if more is not None and hasattr(train_state, "opt_state"):
    raise TypeError(f"A TrainState's step takes (train_state, batch): {HOW}")
  if more is not None:  # not a TrainState: the step says what it takes
    call_copied(step, train_state, batch, more)
  if batch is None:
    raise TypeError(f"batch is missing: {HOW}")
  host = host_arguments(train_state.params, train_state.opt_state, batch)
  out = call_copied(step, train_state, batch)
  new, metrics = out if isinstance(out, tuple | list) else (out, None)
  return CheckWindow.after(host, loss_fn, new.params, new.opt_state, metrics)


def check_linen_args(inputs: Any, train_kwargs: Any, rng_collections: Any) -> tuple[str, ...]:
  """``linen_train_step``'s ``inputs``, ``train_kwargs`` and ``rng_collections`` checked; the
  collections' names as a tuple."""
  names = (rng_collections,) if isinstance(rng_collections, str) else tuple(rng_collections)
  if not (isinstance(inputs, str) or callable(inputs)):
    raise TypeError(f"{inputs=} must be a batch key or a callable microbatch -> apply's arguments.")
  if train_kwargs is not None and not isinstance(train_kwargs, dict):
    raise TypeError(f"{train_kwargs=} must be a dict of keyword arguments of module.apply.")
  if not all(isinstance(n, str) for n in names):
    raise TypeError(f"{rng_collections=} must be flax RNG collection names, e.g. ('dropout',).")
  return names


OVERWRITE = "_overwrite_with_gradient"  # flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT


def _split(variables: Any) -> tuple[Any, Any]:
  return variables["params"], variables[OVERWRITE]


def _join(variables: Any, trained: Any, overwrite: Any) -> Any:
  new = {"params": trained, OVERWRITE: overwrite}
  return new if type(variables) is dict else type(variables)(new)


_FP8 = Overwritten(
  _split,
  _join,
  name=f"Flax's {OVERWRITE!r} collection (fp8 amax histories and scales)",
  instead="Use ga.train_step or ga.linen_train_step (the state made by"
  " tx.init(variables['params']), as Flax's TrainState.create does).",
)


def fp8_overwritten(tree: Any, what: str, where: str) -> Overwritten | None:
  """Flax's fp8 collection as :class:`_parts.Overwritten` if ``tree`` is the variables
  ``{"params": ..., OVERWRITE: ...}`` (docs/usage.md, "FP8"); a ValueError for other
  collections beside them."""
  if not (isinstance(tree, Mapping) and OVERWRITE in tree):
    return None
  if set(tree) != {"params", OVERWRITE}:
    raise ValueError(
      f"{where}: {what} holds Flax's {OVERWRITE!r} collection (fp8) and"
      f" {sorted(set(tree) - {OVERWRITE, 'params'})} beside 'params': pass the variables"
      " {'params': ..., '_overwrite_with_gradient': ...} only, other collections as model state"
      " (has_state=True)."
    )
  return _FP8


register_overwrite(fp8_overwritten)
