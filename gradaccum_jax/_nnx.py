"""The fused accumulation step for Flax NNX modules and ``nnx.Optimizer``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gradaccum_jax._accumulate import as_accumulate
from gradaccum_jax._memory import auto_gather
from gradaccum_jax._model_state import batchnorm_leaves
from gradaccum_jax._options import LossSpec, make_options, split_output
from gradaccum_jax._train_step import JitStep, fused_step


def _import_nnx():
  try:
    from flax import nnx
  except ImportError as e:
    raise ImportError(
      'ga.nnx_train_step needs flax: pip install "gradaccum_jax[flax]" (or pip install flax).'
    ) from e
  return nnx


def _batchnorm_momentum(model: Any, nnx: Any) -> float:
  """The one momentum of every ``nnx.BatchNorm`` in ``model``, for ``batchnorm='per_window'``."""
  found = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.BatchNorm):
      found["/".join(map(str, path)) or "<model>"] = node.momentum
  if not found:
    raise ValueError(
      f"batchnorm='per_window' needs nnx.BatchNorm layers, but the {type(model).__name__} has"
      " none. Use batchnorm='sequential' (the default) for a model without BatchNorm."
    )
  momenta = set(map(float, found.values()))
  if len(momenta) > 1:
    listing = ", ".join(f"{path}: {m}" for path, m in found.items())
    raise ValueError(
      "batchnorm='per_window' updates all running statistics with one momentum, but the"
      f" nnx.BatchNorm layers have different ones ({listing}). Give them the same momentum,"
      " or use batchnorm='sequential'."
    )
  (momentum,) = momenta
  if not 0.0 <= momentum < 1.0:
    raise ValueError(
      f"batchnorm='per_window' needs a BatchNorm momentum m with 0 <= m < 1, got {momentum}."
    )
  return momentum


def nnx_train_step(
  loss_fn: Callable[..., Any],
  *,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  batchnorm: str = "sequential",
  compute_dtype: Any = None,
  mesh: Any = None,
  data_axis: str | tuple[str, ...] | None = None,
  param_specs: Any = None,
  donate: bool = False,
  gather_params: str = "once",
  memory_budget_bytes: int | None = None,
) -> Callable[..., dict[str, Any]]:
  r"""A jitted accumulation step for a Flax NNX module and its ``nnx.Optimizer``.

  ``step(model, optimizer, batch) -> metrics`` is :func:`train_step` for NNX:
  ``optimizer`` is ``nnx.Optimizer(model, ga.accumulate(inner, k), wrt=...)``,
  ``batch`` is split into its ``k`` micro-batches (micro-batch ``i`` holds rows
  ``i, i + k, ...``), their gradients with respect to the variables the
  optimizer trains (its ``wrt`` filter) are scanned into the accumulator of
  ``optimizer.opt_state``, and the window is closed with one ``inner`` update,
  all in one ``nnx.jit`` program. The step updates ``model`` and ``optimizer``
  in place: the trained variables, the model's other state (BatchNorm
  statistics, ``nnx.Rngs`` counters, any other ``nnx.Variable``) and the
  optimizer state.

  Inside, the model is split into its trained variables and the rest, and the
  rest is threaded through the micro-batches as the model state of
  ``train_step(..., has_state=True)``; ``batchnorm`` says how the running
  statistics of ``nnx.BatchNorm`` layers (their ``mean`` and ``var``) are
  updated. Any other state, the ``nnx.Rngs`` counters included, is threaded in
  every mode: micro-batch ``i`` sees the counters left by micro-batch ``i - 1``,
  so each micro-batch draws its own dropout masks, as ``k`` calls of the model
  in a row would, and the counters advance by the ``k`` calls.

  Randomness comes from the ``nnx.Rngs`` held by the model (e.g.
  ``nnx.Dropout(0.1, rngs=rngs)``); ``loss_fn`` gets no key.

  Step counters: ``optimizer.step`` advances by 1 per call of ``step``, one
  window, as ``optimizer.opt_state.count`` (windows closed) does. In streaming
  mode, ``optimizer.update(model, grads)`` once per micro-batch advances
  ``optimizer.step`` per micro-batch (``k`` per window), while
  ``opt_state.count`` and the inner optimizer's schedules still count windows.
  Read ``optimizer.opt_state.count`` for the number of optimizer steps when you
  mix the two. A window voided for a non-finite gradient (see
  :func:`accumulate`) advances both counters and leaves the trained variables,
  the optimizer state and the model's other state as they were, except the
  ``nnx.Rngs`` counters (integer leaves of ``nnx.RngCount``), which advance
  as in an applied window so the next window draws new randomness.

  Args:
    loss_fn: ``loss_fn(model, microbatch)`` returning the scalar mean loss over
      the micro-batch, or ``(loss, aux)`` with ``has_aux``. The model is in
      the mode you set (``model.train()`` or ``model.eval()``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` is averaged
      over the micro-batches with their weights (integer leaves summed), as in
      :func:`value_and_grad`.
    weight_fn: ``weight_fn(microbatch) -> scalar`` weight of a micro-batch,
      e.g. its number of non-padding tokens; ``None`` weighs all equally.
    batchnorm: how the running statistics of BatchNorm layers are updated:
      ``"sequential"`` (each micro-batch updates them in turn: ``k`` updates
      per window), ``"per_window"`` (once per window with the pooled mean and
      variance of the whole batch, with the momentum of the model's
      ``nnx.BatchNorm`` layers, which must all have the same) or ``"frozen"``
      (left unchanged). The normalization itself uses each micro-batch's own
      statistics in every mode (see :func:`value_and_grad`).
    compute_dtype, mesh, data_axis, param_specs: as in :func:`train_step`:
      mixed precision, and data-parallel training over a mesh. ``param_specs``
      is a ``PartitionSpec`` or a nested dict of them shaped like
      ``nnx.to_pure_dict(nnx.state(model, wrt))`` (a prefix of it). With a
      mesh, every device threads the model's other state through its own
      micro-batches; float leaves (BatchNorm statistics) are then averaged
      over the devices and integer leaves (``nnx.Rngs`` counters) take their
      maximum. The ``nnx.Rngs`` streams are not folded with the device index,
      so every device draws the same dropout masks for its own rows.
    donate: donate the model's and optimizer's arrays to the step (updated in
      place by XLA).
    gather_params, memory_budget_bytes: with ``param_specs``, how params
      sharded over data axes are gathered (``"once"``, ``"per_microbatch"``
      or ``"auto"``), as in :func:`train_step`.

  Returns:
    ``step(model, optimizer, batch, *, num_real_microbatches=None) ->
    metrics`` (``num_real_microbatches``: as in :func:`train_step`), jitted
    with ``nnx.jit``;
    ``metrics`` holds ``"loss"``, ``"grad_norm"``, ``"weight"``, ``"updated"``
    and, with ``has_aux``, ``"aux"``, as in :func:`train_step`.

  Raises:
    ValueError: eagerly for an unknown ``batchnorm``; at the first call, for
      ``"per_window"`` on a model without ``nnx.BatchNorm`` or with BatchNorm
      layers of different momenta, ``"frozen"`` on a model without BatchNorm
      statistics, or a batch whose size ``k`` does not divide.
    TypeError: at the first call, if ``optimizer`` is not an ``nnx.Optimizer``
      whose ``tx`` is made by :func:`accumulate`, or ``loss_fn`` does not
      return what ``has_aux`` says.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import gradaccum_jax as ga
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> tx = ga.accumulate(optax.adam(1e-2), num_microbatches=4)
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> def loss_fn(model, batch):
    ...   return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    >>> step = ga.nnx_train_step(loss_fn)
    >>> batch = {"x": jnp.ones((32, 3)), "y": jnp.ones((32, 1))}
    >>> metrics = step(model, optimizer, batch)  # 4 micro-batches of 8, one update
    >>> int(optimizer.step[...]), int(optimizer.opt_state.count[...])
    (1, 1)
  """
  settings = dict(locals())  # the arguments, for the "auto" policy's two steps
  nnx = _import_nnx()
  options = make_options(
    "nnx_train_step",
    loss_fn,
    has_aux=has_aux,
    weight_fn=weight_fn,
    has_state=True,
    batchnorm=batchnorm,
    compute_dtype=compute_dtype,
    mesh=mesh,
    data_axis=data_axis,
    # The trained variables are an nnx.State: a nested dict of specs (as nnx.to_pure_dict
    # gives the params) is read as one.
    param_specs=nnx.State(param_specs) if isinstance(param_specs, dict) else param_specs,
    gather_params=gather_params,
    memory_budget_bytes=memory_budget_bytes,
    momentum_from_model=True,
  )
  if gather_params == "auto":  # one step per policy, run as their compiled memory says
    one = {**settings, "memory_budget_bytes": None}  # each policy's step, as the user asked
    del one["gather_params"]
    return auto_gather(lambda g: nnx_train_step(**one, gather_params=g), options.parallel.budget)
  has_aux = bool(has_aux)

  def step(model, optimizer, batch, *, num_real_microbatches=None):
    if not isinstance(optimizer, nnx.Optimizer):
      raise TypeError(
        f"optimizer must be an nnx.Optimizer(model, ga.accumulate(inner, k), wrt=nnx.Param),"
        f" got {type(optimizer).__name__}."
      )
    tx = as_accumulate(optimizer.tx, "optimizer.tx")
    wrt, graph = optimizer.wrt, optimizer.graph
    momentum = _batchnorm_momentum(model, nnx) if batchnorm == "per_window" else None
    graphdef, params, rest = nnx.split(model, wrt, ..., graph=graph)
    params, rest = nnx.as_pure(params), nnx.as_pure(rest)
    if batchnorm == "frozen" and not any(batchnorm_leaves(rest)):
      raise ValueError(
        f"batchnorm='frozen' but the {type(model).__name__} has no BatchNorm statistics"
        " (variables named 'mean' and 'var' side by side, as in nnx.BatchNorm) outside the"
        " trained variables. Use batchnorm='sequential' (the default)."
      )

    def pure_loss(params, rest, microbatch):
      m = nnx.merge(graphdef, params, rest)
      loss, aux = split_output(loss_fn(m, microbatch), has_aux, "loss_fn(model, microbatch)")
      _, _, new_rest = nnx.split(m, wrt, ..., graph=graph)
      return loss, (aux, nnx.as_pure(new_rest))

    opts = dataclasses.replace(
      options, loss=LossSpec(pure_loss, True, True), batchnorm_momentum=momentum
    )
    opt_state = nnx.as_pure(optimizer.opt_state)
    new_params, new_rest, new_opt_state, metrics = fused_step(opts, tx, in_place=donate)(
      params, rest, opt_state, batch, None, num_real_microbatches
    )
    if not has_aux:
      metrics.pop("aux")
    nnx.update(model, new_params, new_rest)
    nnx.update(optimizer.opt_state, nnx.state(new_opt_state, graph=graph))
    optimizer.step[...] += 1
    return metrics

  jitted = nnx.jit(step, donate_argnums=(0, 1) if donate else ())
  return JitStep(
    jitted,
    lambda args: as_accumulate(args[1].tx).fixed_num_microbatches("nnx_train_step"),
    calls_compiled=False,
  )
