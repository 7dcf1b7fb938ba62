"""Flax Linen: a fused accumulation step for a ``TrainState`` with ``batch_stats``.

flax is an optional dependency: it is imported when a step is built, not with the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from gradaccum_jax._accumulate import as_accumulate
from gradaccum_jax._memory import auto_gather
from gradaccum_jax._options import LossSpec, Options, make_options, split_output
from gradaccum_jax._train_step import JitStep, fused_step


def _import_linen():
  try:
    import flax.core
    import flax.errors
    import flax.linen as nn
  except ImportError as e:  # pragma: no cover - flax is installed with the test extra
    raise ImportError(
      "ga.linen_train_step needs flax: pip install 'gradaccum_jax[flax]' (or pip install flax)."
    ) from e
  return nn, flax.errors, flax.core


@dataclasses.dataclass(frozen=True)
class _LinenModel:
  """How a Linen module is applied to a micro-batch: its inputs, keyword arguments, PRNG keys,
  and the errors that say which of them is wrong."""

  module: Any
  inputs: Any  # the batch key of the model input, or microbatch -> tuple of apply's arguments
  train_kwargs: dict[str, Any]
  collections: tuple[str, ...]  # the RNG collections that get keys
  flax: Any  # (flax.linen, flax.errors, flax.core)

  @classmethod
  def make(cls, module, inputs, train_kwargs, rng_collections) -> _LinenModel:
    if not (isinstance(inputs, str) or callable(inputs)):
      raise TypeError(
        f"{inputs=} must be the key of the model input in the batch (a str) or a callable"
        " microbatch -> tuple of positional arguments of module.apply."
      )
    if train_kwargs is not None and not isinstance(train_kwargs, dict):
      raise TypeError(f"{train_kwargs=} must be a dict of keyword arguments of module.apply.")
    names = (rng_collections,) if isinstance(rng_collections, str) else tuple(rng_collections)
    if not all(isinstance(n, str) for n in names):
      raise TypeError(
        f"{rng_collections=} must be a sequence of flax RNG collection names (str), e.g."
        " ('dropout',)."
      )
    flax = _import_linen()
    if not isinstance(module, flax[0].Module):
      raise TypeError(f"module must be a flax.linen.Module, got {type(module).__name__}.")
    return cls(module, inputs, dict(train_kwargs or {}), names, flax)

  @property
  def name(self) -> str:
    name = getattr(self.module, "name", None)
    return type(self.module).__name__ + (f" {name!r}" if name else "")

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
        " the key of the model input, or a callable microbatch -> tuple of module.apply"
        " arguments."
      ) from None

  def apply(self, params, batch_stats, mb, key, with_stats):
    """``(output, new batch_stats)`` (``batch_stats`` unchanged without ``with_stats``)."""
    variables = {"params": params, **({"batch_stats": batch_stats} if with_stats else {})}
    rngs = None
    if key is not None and self.collections:
      rngs = {c: jax.random.fold_in(key, j) for j, c in enumerate(self.collections)}
    try:
      out = self.module.apply(
        variables, *self.args(mb), **self.train_kwargs,
        mutable=["batch_stats"] if with_stats else False, rngs=rngs,
      )  # fmt: skip
    except Exception as e:
      better = self._explain(e, key, with_stats)
      if better is None:
        raise
      raise better from e
    if not with_stats:
      return out, batch_stats
    out, mutated = out
    new_stats = mutated.get("batch_stats", {})
    if isinstance(batch_stats, self.flax[2].FrozenDict):  # keep the state's structure
      new_stats = self.flax[2].freeze(new_stats)
    return out, new_stats

  def _explain(self, e: Exception, key: Any, with_stats: bool) -> Exception | None:
    """The error naming the argument of ``linen_train_step`` to change, or None to re-raise."""
    errors = self.flax[1]
    if isinstance(e, errors.ScopeCollectionNotFound) and not with_stats and "batch_stats" in str(e):
      return ValueError(
        f"{self.name} has a 'batch_stats' collection, but the train_state has none. Use a"
        " TrainState subclass with a field `batch_stats: Any` set to"
        " module.init(...)['batch_stats']."
      )
    if isinstance(e, TypeError) and "required" in str(e) and "__call__" in str(e):
      return TypeError(
        f"{e}\n{self.name}.__call__ needs more arguments than ga passes: the micro-batch's"
        f" {self.inputs!r} and train_kwargs={self.train_kwargs}. Pass its training keywords to"
        " ga.linen_train_step(..., train_kwargs={'train': True}), or inputs= a callable"
        " microbatch -> tuple of positional arguments."
      )
    if isinstance(e, errors.InvalidRngError):
      hint = (
        "pass a fresh key to the step: step(train_state, batch, rng=key)"
        if key is None
        else f"add the collection to rng_collections (now {self.collections})"
      )
      return ValueError(f"{e}\n{self.name} needs a PRNG key in training: {hint}.")
    return None

  def loss(self, loss_fn, has_aux, with_stats):
    """``loss_fn(outputs, microbatch)`` as ``loss(params, batch_stats, microbatch[, key])`` of
    :func:`train_step` with ``has_state=True``."""

    def loss(params, batch_stats, mb, key=None):
      out, new_stats = self.apply(params, batch_stats, mb, key, with_stats)
      if with_stats and jax.tree.structure(new_stats) != jax.tree.structure(batch_stats):
        raise ValueError(
          f"train_state.batch_stats does not match the 'batch_stats' that {self.name} makes:"
          f"\n  train_state: {jax.tree.structure(batch_stats)}"
          f"\n  module:      {jax.tree.structure(new_stats)}\nSet it to"
          " module.init(...)['batch_stats'] for this module."
        )
      try:
        value, aux = split_output(loss_fn(out, mb), has_aux)
      except self.flax[1].ApplyScopeInvalidVariablesTypeError as e:
        raise TypeError(
          "ga.linen_train_step calls loss_fn(outputs, microbatch) with the model's outputs, and"
          f" this loss_fn applies a module to them ({e}). The step applies {self.name} itself:"
          " write loss_fn(outputs, microbatch), e.g. lambda logits, mb:"
          " optax.softmax_cross_entropy_with_integer_labels(logits, mb['y']).mean()."
        ) from e
      return (value, (aux, new_stats)) if has_aux else (value, new_stats)

    return loss

  def momentum(self, params, batch_stats, batch, key) -> float:
    """The one momentum of the module's BatchNorms that update running statistics."""
    nn, seen = self.flax[0], {}

    def interceptor(next_fun, args, kwargs, context):
      bn = context.module
      if isinstance(bn, nn.BatchNorm) and context.method_name == "__call__":
        use_ra = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
        if (bn.use_running_average if use_ra is None else use_ra) is not True:
          seen["/".join(map(str, bn.path)) or type(bn).__name__] = bn.momentum
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):  # shapes only: the whole batch serves
      jax.eval_shape(lambda *a: self.apply(*a, with_stats=True), params, batch_stats, batch, key)
    momenta = set(seen.values())
    if not momenta:
      raise ValueError(
        f"batchnorm='per_window' but no nn.BatchNorm in {self.name} updates running"
        f" statistics (with train_kwargs={self.train_kwargs!r}) to read the momentum from."
        " Pass batchnorm_momentum=m, or check train_kwargs puts the model in training mode."
      )
    if len(momenta) > 1:
      listing = ", ".join(f"{path}: {m}" for path, m in seen.items())
      raise ValueError(
        f"batchnorm='per_window' needs one momentum, but the BatchNorms of {self.name} have"
        f" different momenta ({listing}). Give them the same momentum, or use"
        " batchnorm='sequential'."
      )
    return float(momenta.pop())


def _linen_step(model: _LinenModel, opts: Options, donate: bool, jit: bool):
  """The step of :func:`linen_train_step` for one gather policy: ``model`` translated into
  ``(params, batch_stats, loss)`` for the fused core."""

  def step(train_state, batch, rng=None, *, num_real_microbatches=None):
    tx = as_accumulate(getattr(train_state, "tx", None), "train_state.tx")
    has_field = hasattr(train_state, "batch_stats")
    stats = train_state.batch_stats if has_field else {}
    with_stats = bool(jax.tree.leaves(stats))
    if opts.batchnorm != "sequential" and not with_stats:
      where = f"{type(train_state).__name__} has no batch_stats field"
      raise ValueError(
        f"batchnorm={opts.batchnorm!r} needs BatchNorm statistics, but {model.name} has no"
        f" 'batch_stats' collection ({'its batch_stats are empty' if has_field else where})."
        " Use batchnorm='sequential' (the default) for a model without BatchNorm."
      )
    momentum = opts.batchnorm_momentum
    if opts.batchnorm == "per_window" and momentum is None:
      momentum = model.momentum(train_state.params, stats, batch, rng)
    has_aux = opts.loss.has_aux
    loss = LossSpec(model.loss(opts.loss.fn, has_aux, with_stats), has_aux, True)
    fused = fused_step(
      dataclasses.replace(opts, loss=loss, batchnorm_momentum=momentum), tx, donate and jit
    )
    params, new_stats, opt_state, metrics = fused(
      train_state.params, stats, train_state.opt_state, batch, rng, num_real_microbatches
    )
    new = {"step": train_state.step + 1, "params": params, "opt_state": opt_state}
    return train_state.replace(**new, **({"batch_stats": new_stats} if has_field else {})), metrics

  if not jit:
    return step
  jitted = jax.jit(step, donate_argnums=(0,) if donate else ())
  return JitStep(
    jitted, lambda args: as_accumulate(args[0].tx).fixed_num_microbatches("linen_train_step")
  )


def linen_train_step(
  module: Any,
  loss_fn: Callable[..., Any],
  *,
  batchnorm: str = "sequential",
  batchnorm_momentum: float | None = None,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  inputs: str | Callable[[Any], Any] = "x",
  train_kwargs: dict[str, Any] | None = None,
  rng_collections: Sequence[str] = ("dropout",),
  donate: bool = False,
  jit: bool = True,
  compute_dtype: Any = None,
  mesh: Any = None,
  data_axis: str | tuple[str, ...] | None = None,
  param_specs: Any = None,
  gather_params: str = "once",
  memory_budget_bytes: int | None = None,
) -> Callable[..., tuple[Any, dict[str, Any]]]:
  r"""A fused accumulation step for a Flax Linen module and its ``TrainState``.

  ``step(train_state, batch, rng=None)`` is :func:`train_step` with ``has_state=True`` for
  ``train_state.tx = ga.accumulate(inner, k)``: micro-batch ``i`` gives ``loss_fn(outputs,
  microbatch)`` with ``outputs, stats = module.apply({"params": params, "batch_stats": stats},
  microbatch[inputs], **train_kwargs, mutable=["batch_stats"])``, and ``inner`` updates once
  on the weighted mean gradient. A plain ``TrainState`` serves a module without BatchNorm.
  Step counters, keys and BatchNorm on a mesh: docs/models.md.

  Args:
    module: the ``flax.linen.Module`` (``module.apply`` is called, not ``apply_fn``).
    loss_fn: ``loss_fn(outputs, microbatch)``, the mean loss (``(loss, aux)`` with ``has_aux``).
    batchnorm, batchnorm_momentum: as in :func:`value_and_grad`; ``None`` reads the momentum
      from the module's ``nn.BatchNorm`` layers, which must all have the same.
    inputs: the batch key of the model input, or ``inputs(microbatch)`` returning the tuple of
      positional arguments of ``module.apply``.
    train_kwargs: keyword arguments of every ``module.apply``, e.g. ``{"train": True}``.
    rng_collections: the RNG collections to key: with ``rng=key``, micro-batch ``i`` gives the
      ``j``-th ``fold_in(fold_in(key, i), j)``. Pass a fresh key every step.
    has_aux, weight_fn, donate, jit, compute_dtype, mesh, data_axis, param_specs,
      gather_params, memory_budget_bytes: as in :func:`train_step`.

  Returns:
    ``step(train_state, batch, rng=None, *, num_real_microbatches=None) -> (train_state,
    metrics)``: new ``params``, ``opt_state``, ``batch_stats``, ``step + 1``; ``metrics`` and
    ``num_real_microbatches`` as in :func:`train_step`.

  Raises:
    ValueError, TypeError: when built, for a bad option; at the first call, for a ``tx`` not
      from :func:`accumulate`, a ``batchnorm`` mode without ``batch_stats``, BatchNorms of
      different momenta, or a batch ``k`` does not divide.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
    >>> from flax.training import train_state
    >>> import gradaccum_jax as ga
    >>> class TrainState(train_state.TrainState):
    ...   batch_stats: dict
    >>> net = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=False)])
    >>> v = net.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> state = TrainState.create(apply_fn=net.apply, params=v["params"],
    ...   batch_stats=v["batch_stats"], tx=ga.accumulate(optax.adam(1e-3), 4))
    >>> step = ga.linen_train_step(net, lambda out, mb: jnp.mean((out - mb["y"]) ** 2),
    ...   batchnorm="per_window")
    >>> batch = {"x": jax.random.normal(jax.random.key(1), (32, 3)), "y": jnp.zeros((32, 4))}
    >>> state, metrics = step(state, batch)
    >>> int(state.step), int(state.opt_state.count), metrics["loss"].shape
    (1, 1, ())
  """
  opts = make_options(
    "linen_train_step", loss_fn, has_aux=has_aux, weight_fn=weight_fn, has_state=True,
    batchnorm=batchnorm, batchnorm_momentum=batchnorm_momentum, compute_dtype=compute_dtype,
    mesh=mesh, data_axis=data_axis, param_specs=param_specs, gather_params=gather_params,
    memory_budget_bytes=memory_budget_bytes, momentum_from_model=True,
  )  # fmt: skip
  model = _LinenModel.make(module, inputs, train_kwargs, rng_collections)
  if gather_params != "auto":
    return _linen_step(model, opts, donate, jit)
  if not jit:
    raise ValueError(
      "linen_train_step: gather_params='auto' compiles the step, so it needs jit=True."
    )
  return auto_gather(
    lambda g: _linen_step(model, opts.with_gather(g), donate, True), opts.parallel.budget
  )
