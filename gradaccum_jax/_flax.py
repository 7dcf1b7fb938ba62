"""Flax Linen: a fused accumulation step for a ``TrainState`` with ``batch_stats``.

flax is an optional dependency: it is imported when a step is built, not with the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from gradaccum_jax._accumulate import as_accumulate
from gradaccum_jax._checks import check_batch
from gradaccum_jax._memory import auto_gather
from gradaccum_jax._microbatch import microbatch
from gradaccum_jax._options import LossSpec, make_options, split_output
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


def _module_name(module: Any) -> str:
  name = getattr(module, "name", None)
  return type(module).__name__ + (f" {name!r}" if name else "")


def _rng_collections(rng_collections: Any) -> tuple[str, ...]:
  if isinstance(rng_collections, str):
    return (rng_collections,)
  names = tuple(rng_collections)
  if not all(isinstance(n, str) for n in names):
    raise TypeError(
      f"{rng_collections=} must be a sequence of flax RNG collection names (str), e.g."
      " ('dropout',)."
    )
  return names


@dataclasses.dataclass(frozen=True)
class _LinenModel:
  """How a Linen module is applied to a micro-batch: its inputs, keyword arguments, PRNG keys,
  and the errors that say which of them is wrong."""

  module: Any
  inputs: Any  # the batch key of the model input, or microbatch -> tuple of apply's arguments
  train_kwargs: dict[str, Any]
  collections: tuple[str, ...]  # the RNG collections that get keys
  name: str
  nn: Any
  flax_errors: Any
  flax_core: Any

  @classmethod
  def make(cls, module, inputs, train_kwargs, rng_collections) -> _LinenModel:
    if not (isinstance(inputs, str) or callable(inputs)):
      raise TypeError(
        f"{inputs=} must be the key of the model input in the batch (a str) or a callable"
        " microbatch -> tuple of positional arguments of module.apply."
      )
    if train_kwargs is not None and not isinstance(train_kwargs, dict):
      raise TypeError(f"{train_kwargs=} must be a dict of keyword arguments of module.apply.")
    collections = _rng_collections(rng_collections)
    nn, flax_errors, flax_core = _import_linen()
    if not isinstance(module, nn.Module):
      raise TypeError(f"module must be a flax.linen.Module, got {type(module).__name__}.")
    return cls(
      module, inputs, dict(train_kwargs or {}), collections, _module_name(module),
      nn, flax_errors, flax_core,
    )  # fmt: skip

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

  def rngs(self, key):
    if key is None or not self.collections:
      return None
    return {c: jax.random.fold_in(key, j) for j, c in enumerate(self.collections)}

  def apply(self, params, batch_stats, mb, key, with_stats):
    """``(output, new batch_stats)`` (``batch_stats`` unchanged without ``with_stats``)."""
    variables = {"params": params}
    if with_stats:
      variables["batch_stats"] = batch_stats
    try:
      out = self.module.apply(
        variables,
        *self.args(mb),
        **self.train_kwargs,
        mutable=["batch_stats"] if with_stats else False,
        rngs=self.rngs(key),
      )
    except self.flax_errors.ScopeCollectionNotFound as e:
      if with_stats or "batch_stats" not in str(e):
        raise
      raise ValueError(
        f"{self.name} has a 'batch_stats' collection, but the train_state has none. Use a"
        " TrainState subclass with a field `batch_stats: Any` set to"
        " module.init(...)['batch_stats']."
      ) from e
    except TypeError as e:
      if "required" not in str(e) or "__call__" not in str(e):
        raise
      raise TypeError(
        f"{e}\n{self.name}.__call__ needs more arguments than ga passes: the micro-batch's"
        f" {self.inputs!r} and train_kwargs={self.train_kwargs}. Pass its training keywords to"
        " ga.linen_train_step(..., train_kwargs={'train': True}), or inputs= a callable"
        " microbatch -> tuple of positional arguments."
      ) from e
    except self.flax_errors.InvalidRngError as e:
      hint = (
        "pass a fresh key to the step: step(train_state, batch, rng=key)"
        if key is None
        else f"add the collection to rng_collections (now {self.collections})"
      )
      raise ValueError(f"{e}\n{self.name} needs a PRNG key in training: {hint}.") from e
    if with_stats:
      out, mutated = out
      new_stats = mutated.get("batch_stats", {})
      if isinstance(batch_stats, self.flax_core.FrozenDict):  # keep the state's structure
        new_stats = self.flax_core.freeze(new_stats)
      return out, new_stats
    return out, batch_stats

  def momentum(self, params, batch_stats, mb, key) -> float:
    """The one momentum of the module's BatchNorms that update running statistics."""
    nn, seen = self.nn, {}

    def interceptor(next_fun, args, kwargs, context):
      bn = context.module
      if isinstance(bn, nn.BatchNorm) and context.method_name == "__call__":
        use_ra = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
        if use_ra is None:
          use_ra = bn.use_running_average
        if use_ra is not True:  # this BatchNorm updates its running statistics
          seen["/".join(map(str, bn.path)) or type(bn).__name__] = bn.momentum
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
      jax.eval_shape(lambda p, s, m, k: self.apply(p, s, m, k, True), params, batch_stats, mb, key)
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

  ``step(train_state, batch, rng=None) -> (train_state, metrics)`` runs one
  window of :func:`train_step` (``has_state=True``): micro-batch ``i`` of
  ``batch`` (rows ``i, i + k, ...``, see :func:`microbatch`) goes through

  .. code-block:: python

    outputs, mutated = module.apply(
        {"params": params, "batch_stats": batch_stats}, *args, **train_kwargs,
        mutable=["batch_stats"], rngs=rngs)
    loss = loss_fn(outputs, microbatch)

  the ``batch_stats`` flow through the micro-batches as ``batchnorm`` says, and
  the optimizer ``train_state.tx`` (made by :func:`accumulate`; its ``k`` is the
  number of micro-batches) is applied once to the weighted mean gradient. The
  returned state has new ``params``, ``opt_state`` and ``batch_stats``, and
  ``step`` incremented by 1 (one window is one optimizer step).

  ``train_state`` is a ``flax.training.train_state.TrainState`` subclass with a
  ``batch_stats`` field, or a plain ``TrainState`` for a module without
  BatchNorm (then ``apply`` gets only the params and only
  ``batchnorm="sequential"`` is allowed). ``module.apply`` is called, not
  ``train_state.apply_fn``.

  The optimizer is read from ``train_state.tx`` when the step is traced, so it
  cannot disagree with ``opt_state``; ``tx`` is static in a ``TrainState``, and
  a state with another ``tx`` traces (and checks) the step anew.

  Args:
    module: the ``flax.linen.Module``.
    loss_fn: ``loss_fn(outputs, microbatch)`` returning the scalar mean loss
      over the micro-batch, or ``(loss, aux)`` with ``has_aux``.
    batchnorm: ``"sequential"`` (each micro-batch updates the running
      statistics in turn: ``k`` updates per window), ``"per_window"`` (one
      update per window with the pooled mean and variance of the whole
      window) or ``"frozen"`` (left unchanged), as in :func:`value_and_grad`.
      In every mode each micro-batch is normalized with its own statistics.
    batchnorm_momentum: for ``"per_window"``, the momentum of the running
      averages. ``None`` (default) reads it from the module's ``nn.BatchNorm``
      layers (with ``flax.linen.intercept_methods``, at trace time); they must
      all have the same momentum.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``metrics["aux"]`` is
      then its weighted mean over the window.
    weight_fn: ``weight_fn(microbatch) -> scalar`` weight of a micro-batch
      (e.g. its number of non-padding tokens); ``None`` weighs them equally.
    inputs: the key of the model input in the batch (``module.apply(...,
      microbatch[inputs])``), or ``inputs(microbatch)`` returning the tuple of
      positional arguments of ``module.apply`` (a non-tuple is one argument).
    train_kwargs: keyword arguments of every ``module.apply`` call, e.g.
      ``{"train": True}``.
    rng_collections: the RNG collections the module draws from in training.
      With ``step(..., rng=key)``, micro-batch ``i`` gives the ``j``-th
      collection the key ``fold_in(fold_in(key, i), j)``. Pass a fresh
      ``key`` every step (e.g. ``fold_in(key, train_state.step)``).
    donate: donate ``train_state`` to the step (its arrays are then invalid).
    jit: return the step jitted (default), or traceable, to call inside your
      own ``jax.jit``.
    compute_dtype, mesh, data_axis, param_specs: as in :func:`train_step`:
      mixed precision, and data-parallel training over a mesh (every device
      threads ``batch_stats`` through its own micro-batches, which are then
      averaged over the devices; see :func:`train_step`).
    gather_params, memory_budget_bytes: with ``param_specs``, how params
      sharded over data axes are gathered (``"once"``, ``"per_microbatch"``
      or ``"auto"``), as in :func:`train_step`.

  Returns:
    ``step(train_state, batch, rng=None, *, num_real_microbatches=None) ->
    (train_state, metrics)`` (``num_real_microbatches``: as in
    :func:`train_step`), with
    ``metrics`` as in :func:`train_step` (``"loss"``, ``"grad_norm"``,
    ``"weight"``, ``"updated"``, and ``"aux"`` with ``has_aux``).

  Raises:
    ValueError: when built, for an unknown ``batchnorm`` or a bad
      ``batchnorm_momentum``. At the first call (trace): ``"per_window"`` or
      ``"frozen"`` for a module without ``batch_stats``; ``"per_window"`` with
      BatchNorms of different momenta, or none to read it from; a
      ``TrainState`` without ``batch_stats`` for a module that has them; a
      batch whose size ``k`` does not divide.
    TypeError: at the first call, when ``train_state.tx`` is not made by
      :func:`accumulate`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
    >>> from flax.training import train_state
    >>> import gradaccum_jax as ga
    >>> class Net(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x, train):
    ...     x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(4)(x))
    ...     return nn.Dense(1)(nn.relu(x))[:, 0]
    >>> class TrainState(train_state.TrainState):
    ...   batch_stats: dict
    >>> net = Net()
    >>> variables = net.init(jax.random.key(0), jnp.ones((1, 3)), train=False)
    >>> state = TrainState.create(
    ...   apply_fn=net.apply, params=variables["params"],
    ...   batch_stats=variables["batch_stats"],
    ...   tx=ga.accumulate(optax.adam(1e-3), num_microbatches=4))
    >>> def loss_fn(pred, mb):
    ...   return jnp.mean((pred - mb["y"]) ** 2)
    >>> step = ga.linen_train_step(
    ...   net, loss_fn, batchnorm="per_window", train_kwargs={"train": True})
    >>> batch = {"x": jnp.ones((32, 3)), "y": jnp.zeros(32)}
    >>> state, metrics = step(state, batch)
    >>> int(state.step), int(state.opt_state.count), metrics["loss"].shape
    (1, 1, ())
  """
  settings = dict(locals())  # the arguments, for the "auto" policy's two steps
  options = make_options(
    "linen_train_step",
    loss_fn,
    has_aux=has_aux,
    weight_fn=weight_fn,
    has_state=True,
    batchnorm=batchnorm,
    batchnorm_momentum=batchnorm_momentum,
    compute_dtype=compute_dtype,
    mesh=mesh,
    data_axis=data_axis,
    param_specs=param_specs,
    gather_params=gather_params,
    memory_budget_bytes=memory_budget_bytes,
    momentum_from_model=True,
  )
  if gather_params == "auto":  # one step per policy, run as their compiled memory says
    if not jit:
      raise ValueError("linen_train_step: gather_params='auto' compiles the step; it needs jit.")
    one = {**settings, "memory_budget_bytes": None}  # each policy's step, as the user asked
    del one["gather_params"]
    return auto_gather(lambda g: linen_train_step(**one, gather_params=g), options.parallel.budget)
  model = _LinenModel.make(module, inputs, train_kwargs, rng_collections)
  name = model.name

  def step(train_state, batch, rng=None, *, num_real_microbatches=None):
    tx = as_accumulate(getattr(train_state, "tx", None), "train_state.tx")
    has_field = hasattr(train_state, "batch_stats")
    stats = train_state.batch_stats if has_field else {}
    with_stats = bool(jax.tree.leaves(stats))
    if batchnorm != "sequential" and not with_stats:
      where = (
        "its batch_stats are empty"
        if has_field
        else f"{type(train_state).__name__} has no batch_stats field"
      )
      raise ValueError(
        f"batchnorm={batchnorm!r} needs BatchNorm statistics, but {name} has no"
        f" 'batch_stats' collection ({where}). Use batchnorm='sequential' (the default) for"
        " a model without BatchNorm."
      )

    def loss(params, batch_stats, mb, key=None):
      out, new_stats = model.apply(params, batch_stats, mb, key, with_stats)
      if with_stats and jax.tree.structure(new_stats) != jax.tree.structure(batch_stats):
        raise ValueError(
          f"train_state.batch_stats does not match the 'batch_stats' that {name} makes:"
          f"\n  train_state: {jax.tree.structure(batch_stats)}"
          f"\n  module:      {jax.tree.structure(new_stats)}\nSet it to"
          " module.init(...)['batch_stats'] for this module."
        )
      try:
        value = loss_fn(out, mb)
      except model.flax_errors.ApplyScopeInvalidVariablesTypeError as e:
        raise TypeError(
          "ga.linen_train_step calls loss_fn(outputs, microbatch) with the model's outputs, and"
          f" this loss_fn applies a module to them ({e}). The step applies {name} itself:"
          " write loss_fn(outputs, microbatch), e.g. lambda logits, mb:"
          " optax.softmax_cross_entropy_with_integer_labels(logits, mb['y']).mean()."
        ) from e
      value, aux = split_output(value, has_aux)
      return value, (aux, new_stats)

    momentum = options.batchnorm_momentum
    if batchnorm == "per_window" and momentum is None:
      k = tx.fixed_num_microbatches("linen_train_step")
      mb0 = microbatch(batch, 0, k) if check_batch(batch, k) else None
      momentum = model.momentum(
        train_state.params, stats, mb0, None if rng is None else jax.random.fold_in(rng, 0)
      )
    opts = dataclasses.replace(
      options, loss=LossSpec(loss, True, True), batchnorm_momentum=momentum
    )
    params, new_stats, opt_state, metrics = fused_step(opts, tx, in_place=donate and jit)(
      train_state.params, stats, train_state.opt_state, batch, rng, num_real_microbatches
    )
    if not has_aux:
      metrics.pop("aux")
    updates = {"step": train_state.step + 1, "params": params, "opt_state": opt_state}
    if has_field:
      updates["batch_stats"] = new_stats
    return train_state.replace(**updates), metrics

  if not jit:
    return step
  jitted = jax.jit(step, donate_argnums=(0,) if donate else ())
  return JitStep(
    jitted, lambda args: as_accumulate(args[0].tx).fixed_num_microbatches("linen_train_step")
  )
