"""Flax NNX: a fused accumulation step for a module and its ``nnx.Optimizer``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding

from gradaccum_jax._accumulate import as_accumulate
from gradaccum_jax._equivalence import HOW, CheckWindow, call_copied, copies, host_arguments
from gradaccum_jax._memory import gathered
from gradaccum_jax._model_state import batchnorm_leaves
from gradaccum_jax._options import OPTIONS, Config, split_output, takes
from gradaccum_jax._sharding import DataParallel, leaf_plans, on_the_params_mesh
from gradaccum_jax._train_step import JitStep, fused_step


def _batchnorm_momentum(model: Any, nnx: Any) -> float:
  """The one momentum of every ``nnx.BatchNorm`` in ``model``, for ``batchnorm='per_window'``."""
  layers = [(p, node) for p, node in nnx.iter_graph(model) if isinstance(node, nnx.BatchNorm)]
  found = {"/".join(map(str, p)) or "<model>": float(node.momentum) for p, node in layers}
  if not found:
    raise ValueError(
      f"batchnorm='per_window' needs nnx.BatchNorm layers, but the {type(model).__name__} has"
      " none. Use batchnorm='sequential' (the default) for a model without BatchNorm."
    )
  if len(set(found.values())) > 1:
    listing = ", ".join(f"{path}: {m}" for path, m in found.items())
    raise ValueError(
      "batchnorm='per_window' updates all running statistics with one momentum, but the"
      f" nnx.BatchNorm layers have different ones ({listing}). Give them one, or use 'sequential'."
    )
  momentum = next(iter(found.values()))
  if not 0.0 <= momentum < 1.0:
    raise ValueError(f"batchnorm='per_window' needs a momentum in [0, 1), got {momentum}.")
  return momentum


def _lay_out(nnx: Any, dp: DataParallel, model: Any, optimizer: Any) -> None:
  """Puts a donated step's arrays on ``dp``'s mesh before ``nnx.jit`` lowers it: the params as
  ``param_specs`` lays them out, any other array still on one device replicated (an array already
  there is not copied)."""
  if not isinstance(optimizer, nnx.Optimizer):
    return  # the step says what to pass
  _, params, rest = nnx.split(model, optimizer.wrt, ..., graph=optimizer.graph)
  params = nnx.as_pure(params)
  spec = [p.spec for p in leaf_plans(dp, params)]
  leaves = [
    jax.device_put(x, NamedSharding(dp.mesh, s))
    for x, s in zip(jax.tree.leaves(params), spec, strict=True)
  ]
  params = jax.tree.structure(params).unflatten(leaves)
  nnx.update(model, params, on_the_params_mesh(nnx.as_pure(rest), params))
  opt_state = nnx.as_pure(nnx.state(optimizer.opt_state, graph=optimizer.graph))
  nnx.update(optimizer.opt_state, on_the_params_mesh(opt_state, params))


class _LaidOut:
  """``nnx.jit``'s step (and its ``lower``) with :func:`_lay_out` run first."""

  def __init__(self, jitted: Callable[..., Any], lay_out: Callable[..., None]):
    self._jitted, self._lay_out = jitted, lay_out

  def __call__(self, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    self._lay_out(model, optimizer)
    return self._jitted(model, optimizer, *args, **kwargs)

  def lower(self, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    self._lay_out(model, optimizer)
    return self._jitted.lower(model, optimizer, *args, **kwargs)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._jitted, name)


def _nnx_step(nnx: Any, config: Config, donate: bool, jit: bool):
  """:func:`nnx_train_step` for one gather policy: the model translated for ``fused_step``."""

  def step(model, optimizer, batch, *, num_real_microbatches=None):
    if not isinstance(optimizer, nnx.Optimizer):
      raise TypeError(
        f"optimizer must be an nnx.Optimizer(model, ga.accumulate(inner, k), wrt=nnx.Param),"
        f" got {type(optimizer).__name__}."
      )
    tx = as_accumulate(optimizer.tx, "optimizer.tx")
    wrt, graph = optimizer.wrt, optimizer.graph
    mode = config.batchnorm[0]
    momentum = _batchnorm_momentum(model, nnx) if mode == "per_window" else None
    graphdef, params, rest = nnx.split(model, wrt, ..., graph=graph)
    params, rest = nnx.as_pure(params), nnx.as_pure(rest)
    if mode == "frozen" and not any(batchnorm_leaves(rest)):
      raise ValueError(
        f"batchnorm='frozen' but the {type(model).__name__} has no BatchNorm statistics (variables"
        " 'mean' and 'var' side by side) outside the trained variables: use batchnorm='sequential'."
      )

    def loss(params, rest, mb, *stats):  # stats: (the window statistics,) with window_stats
      merged = nnx.merge(graphdef, params, rest)
      value = config.loss.fn(merged, mb, *stats)
      value, aux = split_output(value, config.loss.has_aux, "loss_fn(model, microbatch)")
      new_rest = nnx.as_pure(nnx.split(merged, wrt, ..., graph=graph)[2])
      return config.loss.pack(value, aux, new_rest)

    def stats(params, rest, mb):
      return config.stats.fn(nnx.merge(graphdef, params, rest), mb)

    ws = config.stats and dataclasses.replace(config.stats, fn=stats)
    loss = dataclasses.replace(config.loss, fn=loss)
    run = dataclasses.replace(config, loss=loss, batchnorm=(mode, momentum), stats=ws)
    new_params, new_rest, opt_state, metrics = fused_step(run, tx, donate and jit)(
      params, rest, nnx.as_pure(optimizer.opt_state), batch, None, num_real_microbatches
    )
    nnx.update(model, new_params, new_rest)
    nnx.update(optimizer.opt_state, nnx.state(opt_state, graph=graph))
    optimizer.step[...] += 1
    return metrics

  if not jit:
    return step
  jitted = nnx.jit(step, donate_argnums=(0, 1) if donate else ())
  dp = config.mesh
  if donate and dp is not None:
    jitted = _LaidOut(jitted, lambda model, optimizer: _lay_out(nnx, dp, model, optimizer))

  def k(args):
    return as_accumulate(args[1].tx).fixed_num_microbatches("nnx_train_step")

  return JitStep(jitted, k, calls_compiled=False)  # nnx.jit's lower takes other arguments


@takes(*(n for n in OPTIONS if n not in ("has_state", "batchnorm_momentum")))
def nnx_train_step(
  loss_fn: Callable[..., Any], *, donate: bool = True, jit: bool = True, **options: Any
) -> Callable[..., dict[str, Any]]:
  r"""A fused accumulation step for a Flax NNX module and its ``nnx.Optimizer``.

  ``step(model, optimizer, batch) -> metrics`` is :func:`train_step` for ``optimizer =
  nnx.Optimizer(model, ga.accumulate(inner, k), wrt=...)``: the params are what ``wrt`` selects,
  the rest is model state, both updated in place (docs/models.md).

  Args:
    loss_fn, window_stats: ``fn(model, microbatch)``.
    param_specs: shaped as ``nnx.to_pure_dict(nnx.state(model, wrt))``.
    donate: write the new variables over the old (an array also held elsewhere, as
      ``nnx.clone`` shares them, is deleted: copy it first, or pass ``donate=False``).
    jit: return the step jitted with ``nnx.jit``, or traceable.

  Returns:
    ``step(model, optimizer, batch, *, num_real_microbatches=None) -> metrics``;
    ``optimizer.step`` advances by 1.

  Examples:
    >>> import jax.numpy as jnp, optax, gradaccum_jax as ga
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, ga.accumulate(optax.adam(1e-2), 4), wrt=nnx.Param)
    >>> step = ga.nnx_train_step(lambda model, mb: jnp.mean((model(mb["x"]) - mb["y"]) ** 2))
    >>> metrics = step(model, optimizer, {"x": jnp.ones((32, 3)), "y": jnp.ones((32, 1))})
    >>> int(optimizer.step[...]), int(optimizer.opt_state.count[...])
    (1, 1)
  """
  try:
    from flax import nnx
  except ImportError as e:  # pragma: no cover - flax is installed with the test extra
    raise ImportError(
      'ga.nnx_train_step needs flax: pip install "gradaccum_jax[flax]" (or pip install flax).'
    ) from e
  specs = options.get("param_specs")
  if isinstance(specs, dict):  # the trained variables are an nnx.State: a dict of specs as one
    options["param_specs"] = nnx.State(specs)
  config = Config.make("nnx_train_step", loss_fn, from_model=True, has_state=True, **options)
  step = gathered(lambda c, j: _nnx_step(nnx, c, donate, j), config, jit)
  step.check_window = _check_window
  return step


def _check_window(step, loss_fn, model, optimizer, batch) -> CheckWindow:
  """One window of an NNX step on copies of ``model`` and ``optimizer`` (``ga.check_step``): the
  reference's loss on the trained variables (``optimizer.wrt``), the rest held."""
  from flax import nnx

  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(
      f"An NNX model's step takes (model, optimizer, batch), the optimizer an nnx.Optimizer"
      f"(model, ga.accumulate(inner, k), wrt=nnx.Param), got {type(optimizer).__name__}: {HOW}"
    )
  graphdef, trained, rest = nnx.split(model, optimizer.wrt, ..., graph=optimizer.graph)
  rest = nnx.as_pure(rest)
  host = host_arguments(nnx.as_pure(trained), nnx.as_pure(optimizer.opt_state), batch)
  whole, parts = nnx.split((model, optimizer))  # copied: nnx.clone shares the arrays
  model, optimizer = nnx.merge(whole, copies(parts))
  metrics = call_copied(step, model, optimizer, copies(batch), copy=False)
  new = nnx.as_pure(nnx.split(model, optimizer.wrt, ..., graph=optimizer.graph)[1])

  def trained_loss(params, batch):
    return loss_fn(nnx.merge(graphdef, params, rest), batch)

  return CheckWindow.after(host, trained_loss, new, nnx.as_pure(optimizer.opt_state), metrics)
