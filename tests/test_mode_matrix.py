"""The mode matrix: every entry point x accumulator dtype x mesh x weighting x model state gives
the big-batch update, computed independently (a plain ``jax.value_and_grad`` on the whole batch
and the inner optimizer), over two windows and a voided one.

Entry points: ``ga.train_step`` (undonated and donated), ``ga.micro_step``, ``tx.update`` (its
second window closed early by ``ga.flush``), ``ga.value_and_grad``, ``ga.linen_train_step``,
``ga.nnx_train_step``. The inner optimizer is heavy-ball SGD, linear in the window's gradient,
so a wrong scale or weight shows in the params one to one (Adam would hide it).

A second matrix crosses compute dtype (float32, bfloat16, float16 with ``ga.DynamicLossScale``)
x weighting (even, uneven tokens with an empty micro-batch, the same weights times 1,000, as
70,000-token micro-batches weigh) x ``grads_in_place``, against the whole batch computed in the
same compute dtype (:func:`is_precision_cell`). A third crosses a loss of several terms, each
normalized over the window by its own weights, with the fused entry points, accumulator dtypes,
meshes and weightings (:func:`is_term_cell`), a fourth the fused steps' unrolled loop
(:func:`is_unroll_cell`). A path added later joins the matrices.

The matrices are one set of axes (:data:`AXES`) and the rules of :func:`is_cell`: the full
product, run with ``-m "full or not full"``. The default run is a covering array of them
(:func:`covering`): every triple of values on the axes where defects were found (:data:`TRIPLES`)
and every pair of values on any two axes, about a quarter of the cells; the rest are marked
``full`` (and ``slow``) and left out by ``addopts``' ``-m "not full"``."""

import collections
import dataclasses
import functools
import itertools as it

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import assert_trees_close, init_mlp, mlp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

D, K, T = 8, 4, 6  # devices (tests/conftest.py), micro-batches per window, tokens per row
SIZES = (8, 16, 8)  # every dimension divides by D, for the FSDP layout
ROWS = D * K * 2  # a batch: K micro-batches of 2 rows per device
FSDP = {
  "layer0": {"w": P(None, "data"), "b": P("data")},
  "layer1": {"w": P("data"), "b": P("data")},
}
# The real tokens of a row, by its micro-batch (rows i, i + K, ...): uneven, one empty micro-batch.
BASE_TOKENS = np.array([2, 1, 0, 5])
INNER = optax.sgd(0.5, momentum=0.5)
BIG = 1000.0  # the large weights: micro-batches of up to about 80,000 "tokens"
SCALE = ga.DynamicLossScale(initial_scale=2.0**10)

ENTRIES = ("train_step", "train_step_donated", "micro_step", "tx_update", "value_and_grad")
ENTRIES += ("linen", "nnx")
DTYPES = ("float32", "bfloat16", "float16", "float64")
NARROW = ("bfloat16", "float16")
FP16_MESH = ("train_step", "micro_step")  # the entries that run a float16 accumulator on a mesh
# The accumulator's precision: the tolerance on the params' moves, relative to the largest move
# of the leaf (a running mean in a narrow float rounds once per micro-batch).
TOL = {"float32": 2e-5, "bfloat16": 2 * K * 2.0**-8, "float16": 2 * K * 2.0**-10, "float64": 1e-10}


@dataclasses.dataclass(frozen=True)
class Cell:
  entry: str
  dtype: str
  mesh: str | None  # None, "replicated" or "fsdp"
  weighted: bool
  state: bool
  compute: str | None = None  # the compute dtype's cells: "float32", "bfloat16", "float16"
  big: bool = False  # the weights times BIG
  in_place: bool = True  # grads_in_place
  terms: bool = False  # the loss as two terms of one weight (a quarter and three quarters)
  unroll: int = 1  # micro-batches per trip of the fused steps' loop

  @property
  def compute_dtype(self):
    return None if self.compute is None else jnp.dtype(self.compute)

  @property
  def loss_scaled(self):  # float16 trains with a dynamic loss scale, where the entry takes one
    return self.compute == "float16" and self.entry != "value_and_grad"

  @property
  def x64(self):
    return self.dtype == "float64"

  @property
  def param_dtype(self):
    return jnp.float64 if self.x64 else jnp.float32

  @property
  def flushed(self):  # tx.update: the second window closes after K - 1 micro-batches
    return self.entry == "tx_update"

  def __str__(self):
    parts = [self.entry, self.dtype, self.mesh or "nomesh", "weighted" if self.weighted else "even"]
    parts += ["state"] * self.state
    if self.compute is not None:
      parts += [self.compute, *["big"] * self.big, "in_place" if self.in_place else "carried"]
    parts += ["terms"] * self.terms
    parts += [f"unroll{self.unroll}"] * (self.unroll != 1)
    return "-".join(parts)


# --- the model, its data and the big-batch reference ------------------------------------------


def in_params_dtype(x, w):
  """``x`` in the params' dtype (16-bit compute computes in 16 bits)."""
  return x.astype(w.dtype)


def wide(logits):
  """Logits in float32 or wider: the softmax and the loss value in full precision."""
  return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


def token_loss(params, mb):
  """The mean cross-entropy over the real tokens (NaN for a micro-batch without any)."""
  logp = jax.nn.log_softmax(wide(mlp(params, in_params_dtype(mb["x"], params["layer0"]["w"]))))
  nll = -jnp.take_along_axis(logp, mb["y"][..., None], axis=-1)[..., 0]
  return jnp.sum(mb["mask"] * nll) / jnp.sum(mb["mask"])


def next_state(model_state, mb):
  """A model state threaded through the micro-batches: a counter and a float statistic."""
  return {"n": model_state["n"] + 1, "s": model_state["s"] + jnp.mean(mb["x"])}


def stateful_loss(params, model_state, mb):
  return token_loss(params, mb), next_state(model_state, mb)


def tokens(mb):
  return jnp.sum(mb["mask"])


def big_tokens(mb):
  return jnp.sum(mb["mask"]) * BIG


def weight_fn(cell):
  fn = (big_tokens if cell.big else tokens) if cell.weighted else None
  if fn is None or not cell.terms:
    return fn
  # Each term normalized over the window's tokens; the third window's "b" weighs NaN
  # (:func:`batches`), which voids it as a NaN scalar weight would.
  return lambda mb: {"a": fn(mb), "b": fn(mb) + jnp.sum(mb["nan"])}


def loss_of(cell, fn):
  """``fn``, or with ``cell.terms`` the same loss as two terms (a quarter and three quarters of
  it), each normalized over the window by its own weights: the window's objective and the
  big-batch reference are the one-term loss's, through the per-term path (each term's total
  before the loop, over the devices; an empty micro-batch's 0 / 0 in both terms)."""
  if not cell.terms:
    return fn

  def split(*args):
    out = fn(*args)
    loss, rest = out if isinstance(out, tuple) else (out, None)
    terms = {"a": 0.25 * loss, "b": 0.75 * loss}
    return terms if rest is None else (terms, rest)

  return split


def voided_by_weight(cell):
  """Whether the third window is voided by a NaN weight of one term, its inputs finite."""
  return cell.terms and cell.weighted


def batches(cell):
  """Three batches: two windows and one with a NaN input in a real token (voided; with per-term
  weights, a NaN weight of term "b" in micro-batch 0 instead)."""
  rng = np.random.default_rng(0)
  rows = np.arange(ROWS)
  base = BASE_TOKENS[rows % K]
  real = base + ((rows // K) % 2) * (base > 0) if cell.weighted else np.full(ROWS, T)
  dtype = np.float64 if cell.x64 else np.float32
  out = []
  for j in range(3):
    x = rng.standard_normal((ROWS, T, SIZES[0])).astype(dtype)
    nan = np.zeros(ROWS, dtype)
    if j == 2 and voided_by_weight(cell):
      nan[0] = np.nan  # row 0: micro-batch 0's weight of term "b"
    elif j == 2:
      x[0, 0, 0] = np.nan  # row 0: micro-batch 0, a real token
    mask = (np.arange(T)[None, :] < real[:, None]).astype(dtype)
    y = rng.integers(0, SIZES[-1], (ROWS, T)).astype(np.int32)
    batch = {"x": x, "y": y, "mask": mask}
    out.append({**batch, "nan": nan} if voided_by_weight(cell) else batch)
  return out


def initial(cell):
  params = init_mlp(jax.random.key(0), SIZES, cell.param_dtype)
  model_state = {"n": jnp.zeros((), jnp.int32), "s": jnp.zeros((), cell.param_dtype)}
  return params, model_state


def window_microbatches(cell, window, batch):
  """The micro-batches a window is made of (the flushed window: the first K - 1)."""
  m = K - 1 if cell.flushed and window == 1 else K
  return [ga.microbatch(batch, i, K) for i in range(m)]


@dataclasses.dataclass
class Result:
  """What a window leaves: params, model state, loss, counters and the momentum buffer."""

  params: dict
  model_state: dict | None
  loss: float
  count: int
  num_skipped: int
  trace: dict
  scale: float | None = None  # the loss scale after the window (None without one)


def as_numpy(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def compute_in(dtype, params):
  """``params`` as the step computes with them: cast to ``dtype`` (None: as they are)."""
  return params if dtype is None else jax.tree.map(lambda p: p.astype(dtype), params)


@functools.cache
def reference(dtype, weighted, flushed, compute=None, loss_scaled=False, terms=False):
  """The big-batch run: each window's rows as one batch, one plain SGD step each, computed in
  ``compute`` (``loss_scaled``: the gradient of the loss times a dynamic scale, divided by it);
  a window with a non-finite gradient (``terms``: or a NaN weight) moves nothing but the
  counters (``count``, the model state's ``n``) and halves the loss scale."""
  cell = Cell("tx_update" if flushed else "reference", dtype, None, weighted, False, compute)
  cell = dataclasses.replace(cell, terms=terms)
  with jax.enable_x64(cell.x64):
    params, model_state = initial(cell)
    inner_state = INNER.init(params)

    def scaled_loss(params, batch, scale):
      return token_loss(compute_in(cell.compute_dtype, params), batch) * scale

    grad_fn = jax.jit(jax.value_and_grad(scaled_loss))
    out, skipped, scale = [], 0, SCALE.initial_scale if loss_scaled else 1.0
    for w, batch in enumerate(batches(cell)):
      mbs = window_microbatches(cell, w, batch)
      big = jax.tree.map(lambda *xs: np.concatenate(xs), *mbs)
      loss, grads = grad_fn(params, big, scale)
      loss, grads = jax.tree.map(lambda x, s=scale: x / s, (loss, grads))
      weights = jax.tree.leaves(weight_fn(cell)(big) if "nan" in big else ())
      if all(np.all(np.isfinite(g)) for g in jax.tree.leaves((grads, weights))):
        updates, inner_state = INNER.update(grads, inner_state, params)
        params = optax.apply_updates(params, updates)
        for mb in mbs:
          model_state = next_state(model_state, mb)
      else:
        skipped += 1
        model_state = {**model_state, "n": model_state["n"] + len(mbs)}
        scale = max(scale / SCALE.factor, SCALE.min_scale)
      out.append(
        Result(as_numpy(params), as_numpy(model_state), float(loss), w + 1, skipped,
               as_numpy(inner_state[0].trace), scale if loss_scaled else None)
      )  # fmt: skip
  return out


# --- the entry points: each runs the three windows and reports a Result per window ----------


def mesh_and_specs(cell):
  if cell.mesh is None:
    return None, None
  mesh = jax.make_mesh((D,), ("data",), axis_types=(AxisType.Explicit,))
  return mesh, (FSDP if cell.mesh == "fsdp" else None)


def put(tree, mesh, spec):
  if mesh is None:
    return jax.tree.map(jnp.asarray, tree)
  specs = jax.tree.broadcast(spec, tree, is_leaf=lambda s: isinstance(s, P))
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def mesh_kwargs(cell):
  mesh, specs = mesh_and_specs(cell)
  return {} if mesh is None else {"mesh": mesh, "data_axis": "data", "param_specs": specs}


def from_state(params, model_state, loss, state, rename=lambda tree: tree):
  """A Result from any mode's ``AccumulateState`` (a micro_step state answers every field);
  ``rename`` lays the momentum buffer out as the params."""
  return Result(
    as_numpy(params), None if model_state is None else as_numpy(model_state), float(loss),
    int(state.count), int(state.num_skipped), as_numpy(rename(state.inner_state[0].trace)),
    None if state.loss_scale is None else float(state.loss_scale.scale),
  )  # fmt: skip


def make_tx(cell):
  loss_scale = SCALE if cell.loss_scaled else None
  return ga.accumulate(INNER, K, accum_dtype=jnp.dtype(cell.dtype), loss_scale=loss_scale)


def precision_kwargs(cell):
  """The compute dtype and in-place choice of the second matrix's cells (none in the first);
  ``ga.micro_step`` takes no compute dtype: its loss casts the params itself. An unroll cell's
  unroll (a fused step's)."""
  if cell.unroll != 1:
    return {"unroll": cell.unroll}
  if cell.compute is None:
    return {}
  if cell.entry == "micro_step":
    return {"grads_in_place": cell.in_place}
  return {"compute_dtype": cell.compute_dtype, "grads_in_place": cell.in_place}


def run_train_step(cell, params, model_state, data):
  tx = make_tx(cell)
  loss_fn = loss_of(cell, stateful_loss if cell.state else token_loss)
  step = ga.train_step(
    loss_fn, tx, weight_fn=weight_fn(cell), has_state=cell.state,
    donate=cell.entry == "train_step_donated", **mesh_kwargs(cell), **precision_kwargs(cell),
  )  # fmt: skip
  mesh, specs = mesh_and_specs(cell)
  params = put(params, mesh, specs or P())
  model_state = put(model_state, mesh, P()) if cell.state else None
  state, out = tx.init(params), []
  for batch in data:
    batch = put(batch, mesh, P("data"))
    if cell.state:
      params, model_state, state, metrics = step(params, model_state, state, batch)
    else:
      params, state, metrics = step(params, state, batch)
    out.append(from_state(params, model_state, metrics["loss"], state))  # copied: donated next
  return out


def run_micro_step(cell, params, model_state, data):
  tx = make_tx(cell)
  loss_fn = stateful_loss if cell.state else token_loss
  if cell.compute is not None:

    def loss_fn(params, mb):
      return token_loss(compute_in(cell.compute_dtype, params), mb)

  step = ga.micro_step(
    loss_fn, tx, weight_fn=weight_fn(cell), has_state=cell.state, **mesh_kwargs(cell),
    donate=cell.compute is not None, **precision_kwargs(cell),  # donated: it can add in place
  )  # fmt: skip
  mesh, specs = mesh_and_specs(cell)
  params = put(params, mesh, specs or P())
  model_state = put(model_state, mesh, P()) if cell.state else None
  state, out = tx.init(params), []
  for w, batch in enumerate(data):
    for i, mb in enumerate(window_microbatches(cell, w, batch)):
      mb = put(mb, mesh, P("data"))
      if cell.state:
        params, model_state, state, metrics = step(params, model_state, state, mb)
      else:
        params, state, metrics = step(params, state, mb)
      assert bool(metrics["updated"]) == (i == K - 1 and w < 2), (w, i)
      assert int(state.micro_step) == (i + 1) % K
    out.append(from_state(params, model_state, metrics["loss"], state))
  return out


def run_tx_update(cell, params, model_state, data):
  """The user's own jitted step around ``tx.update``; the second window is flushed early."""
  del model_state  # the user's own business in streaming mode
  tx = make_tx(cell)
  mesh, _ = mesh_and_specs(cell)

  @jax.jit
  def user_step(params, state, mb):
    loss, grads = jax.value_and_grad(token_loss)(params, mb)
    weight = tokens(mb) if cell.weighted else None
    updates, state = tx.update(grads, state, params, weight=weight)
    return optax.apply_updates(params, updates), state, loss

  @jax.jit
  def flush(params, state):
    updates, state = ga.flush(tx, state, params)
    return optax.apply_updates(params, updates), state

  params = put(params, mesh, P())
  state, out = tx.init(params), []
  for w, batch in enumerate(data):
    mbs = window_microbatches(cell, w, batch)
    losses, weights = [], []
    for mb in mbs:
      params, state, loss = user_step(params, state, put(mb, mesh, P("data")))
      losses.append(float(loss))
      weights.append(float(tokens(mb)) if cell.weighted else 1.0)
    if len(mbs) < K:
      assert not bool(ga.has_updated(state))
      params, state = flush(params, state)
    loss = sum(x * y for x, y in zip(losses, weights, strict=True) if y > 0) / sum(weights)
    out.append(from_state(params, None, loss, state))
  return out


def run_value_and_grad(cell, params, model_state, data):
  """``ga.value_and_grad`` and the inner optimizer, a non-finite window skipped by the user."""
  mesh, specs = mesh_and_specs(cell)
  vg = ga.value_and_grad(
    loss_of(cell, stateful_loss if cell.state else token_loss), K, weight_fn=weight_fn(cell),
    accum_dtype=jnp.dtype(cell.dtype), has_state=cell.state, **mesh_kwargs(cell),
    **precision_kwargs(cell),
  )  # fmt: skip

  @jax.jit
  def user_step(params, inner_state, model_state, batch):
    args = (params, model_state, batch) if cell.state else (params, batch)
    out, grads = vg(*args)
    loss, new_model_state = out if cell.state else (out, None)
    ok = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    updates, new_inner = INNER.update(grads, inner_state, params)
    new_params = jax.tree.map(lambda p, u: jnp.where(ok, p + u, p), params, updates)
    new_inner = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_inner, inner_state)
    if cell.state:  # the float statistics restored, as the ga steps restore them
      new_model_state = {
        **new_model_state,
        "s": jnp.where(ok, new_model_state["s"], model_state["s"]),
      }
    return new_params, new_inner, new_model_state, loss, ok

  params = put(params, mesh, specs or P())
  model_state = put(model_state, mesh, P()) if cell.state else None
  inner_state, out, count, skipped = INNER.init(params), [], 0, 0
  for batch in data:
    params, inner_state, model_state, loss, ok = user_step(
      params, inner_state, model_state, put(batch, mesh, P("data"))
    )
    count, skipped = count + 1, skipped + (not bool(ok))
    out.append(
      Result(as_numpy(params), None if model_state is None else as_numpy(model_state),
             float(loss), count, skipped, as_numpy(inner_state[0].trace))
    )  # fmt: skip
  return out


class LinenMLP(nn.Module):
  """The MLP of ``helpers.mlp``, its params named as ``init_mlp``'s; with state, the counter
  and statistic of :func:`next_state` in ``batch_stats``."""

  with_state: bool

  @nn.compact
  def __call__(self, x):
    if self.with_state:
      n = self.variable("batch_stats", "n", lambda: jnp.zeros((), jnp.int32))
      s = self.variable("batch_stats", "s", lambda: jnp.zeros((), x.dtype))
      if not self.is_initializing():
        n.value, s.value = n.value + 1, s.value + jnp.mean(x)
    zeros = lambda shape: lambda key: jnp.zeros(shape, x.dtype)  # noqa: E731
    params = {
      f"layer{i}": {"w": self.param(f"w{i}", zeros((m, n))), "b": self.param(f"b{i}", zeros((n,)))}
      for i, (m, n) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True))
    }
    return mlp(params, in_params_dtype(x, params["layer0"]["w"]))


def linen_params(params):
  return {f"{k}{i}": params[f"layer{i}"][k] for i in range(len(SIZES) - 1) for k in ("w", "b")}


def mlp_params(linen):
  return {f"layer{i}": {k: linen[f"{k}{i}"] for k in ("w", "b")} for i in range(len(SIZES) - 1)}


class LinenState(train_state.TrainState):
  batch_stats: dict


def token_loss_of_logits(logits, mb):
  logp = jax.nn.log_softmax(wide(logits))
  nll = -jnp.take_along_axis(logp, mb["y"][..., None], axis=-1)[..., 0]
  return jnp.sum(mb["mask"] * nll) / jnp.sum(mb["mask"])


def run_linen(cell, params, model_state, data):
  mesh, specs = mesh_and_specs(cell)
  module = LinenMLP(cell.state)
  tx = make_tx(cell)
  p = put(linen_params(params), mesh, P() if specs is None else linen_params(specs))
  if cell.state:
    state = LinenState.create(
      apply_fn=module.apply, params=p, tx=tx, batch_stats=put(model_state, mesh, P())
    )
  else:
    state = train_state.TrainState.create(apply_fn=module.apply, params=p, tx=tx)
  step = ga.linen_train_step(
    module, loss_of(cell, token_loss_of_logits), weight_fn=weight_fn(cell), **precision_kwargs(cell),
    **{**mesh_kwargs(cell), **({"param_specs": linen_params(specs)} if specs else {})},
  )  # fmt: skip
  out = []
  for batch in data:
    state, metrics = step(state, put(batch, mesh, P("data")))
    assert set(metrics.get("loss_terms", ())) == ({"a", "b"} if cell.terms else set())
    stats = state.batch_stats if cell.state else None
    params, opt_state = mlp_params(state.params), state.opt_state
    out.append(from_state(params, stats, metrics["loss"], opt_state, rename=mlp_params))
  return out


class NnxLayer(nnx.Module):
  def __init__(self, w, b):
    self.w, self.b = nnx.Param(w), nnx.Param(b)


class NnxMLP(nnx.Module):
  """The MLP of ``helpers.mlp``; with state, :func:`next_state`'s as ``nnx.BatchStat``."""

  def __init__(self, params, model_state):
    self.layer0 = NnxLayer(params["layer0"]["w"], params["layer0"]["b"])
    self.layer1 = NnxLayer(params["layer1"]["w"], params["layer1"]["b"])
    self.with_state = model_state is not None
    if self.with_state:
      self.n, self.s = nnx.BatchStat(model_state["n"]), nnx.BatchStat(model_state["s"])

  def __call__(self, x):
    if self.with_state:
      self.n[...], self.s[...] = self.n[...] + 1, self.s[...] + jnp.mean(x)
    params = {
      name: {"w": layer.w[...], "b": layer.b[...]}
      for name, layer in (("layer0", self.layer0), ("layer1", self.layer1))
    }
    return mlp(params, in_params_dtype(x, params["layer0"]["w"]))


def is_variable(x):
  return isinstance(x, nnx.Variable)


def run_nnx(cell, params, model_state, data):
  mesh, specs = mesh_and_specs(cell)
  model = NnxMLP(
    put(params, mesh, specs or P()), put(model_state, mesh, P()) if cell.state else None
  )
  optimizer = nnx.Optimizer(model, make_tx(cell), wrt=nnx.Param)
  step = ga.nnx_train_step(
    loss_of(cell, lambda model, mb: token_loss_of_logits(model(mb["x"]), mb)),
    weight_fn=weight_fn(cell), **mesh_kwargs(cell), **precision_kwargs(cell),
  )  # fmt: skip
  out = []
  for batch in data:
    metrics = step(model, optimizer, put(batch, mesh, P("data")))
    assert set(metrics.get("loss_terms", ())) == ({"a", "b"} if cell.terms else set())
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    stats = {"n": model.n[...], "s": model.s[...]} if cell.state else None
    opt_state = jax.tree.map(lambda v: v[...], optimizer.opt_state, is_leaf=is_variable)
    out.append(from_state(params, stats, metrics["loss"], opt_state))
  return out


RUNNERS = {
  "train_step": run_train_step,
  "train_step_donated": run_train_step,
  "micro_step": run_micro_step,
  "tx_update": run_tx_update,
  "value_and_grad": run_value_and_grad,
  "linen": run_linen,
  "nnx": run_nnx,
}


# --- the cells: the axes, the rules that make a combination a cell, the covering array --------

AXES = {  # a Cell's fields, each with its values
  "entry": ENTRIES,
  "dtype": DTYPES,  # the accumulator's
  "mesh": (None, "replicated", "fsdp"),
  "weighted": (False, True),
  "state": (False, True),
  "compute": (None, "float32", "bfloat16", "float16"),
  "big": (False, True),
  "in_place": (True, False),
  "terms": (False, True),
  "unroll": (1, 2, K),
}
# The axes where defects were found, run in every triple of their values: entry point x
# accumulator dtype x mesh (micro_step alone applied k times a narrow accumulator's mean; narrow
# accumulators on a mesh) and compute dtype x weighting (even, tokens, tokens times BIG: the
# `weighted` and `big` axes) x in place (float16 in place with the large weights, a defect only
# the second matrix's crossing found), and entry point x weighting x terms (each fused entry
# point's per-term weights). Every other combination: every pair of values.
TRIPLES = (("entry", "dtype", "mesh"), ("compute", "weighted", "big", "in_place"))
TRIPLES += (("entry", "weighted", "terms"),)
FUSED = ("train_step", "train_step_donated", "value_and_grad", "linen", "nnx")
PRECISION_ENTRIES = ("train_step", "train_step_donated", "micro_step", "value_and_grad")
PRECISION_ENTRIES += ("linen", "nnx")


def is_first_cell(cell):
  """The first matrix (no compute dtype, terms or unroll): every combination; on a mesh a narrow
  accumulator (each device's running mean, weighed by its weight in the one reduction) weighted
  without model state, and even with it."""
  if cell.entry == "tx_update" and cell.mesh == "fsdp":
    return False  # tx.update takes no mesh=: GSPMD runs the user's step (replicated)
  if cell.state and cell.entry == "tx_update":
    return False  # streaming mode leaves the model state to the user's step
  if cell.mesh and cell.dtype in NARROW and cell.entry != "tx_update":
    # On a mesh a narrow accumulator weighted, or with model state; float16 by the two
    # paths (the fused step's reduction, micro_step's slots), bfloat16 by every entry.
    return cell.weighted != cell.state and (cell.dtype != "float16" or cell.entry in FP16_MESH)
  return True


def is_term_cell(cell):
  """A loss of several terms through the fused entry points (the streaming ones refuse it), in
  float32 and bfloat16, with and without a mesh, even and weighted by tokens per term."""
  if cell.entry not in FUSED or cell.dtype not in ("float32", "bfloat16") or cell.state:
    return False
  if cell.mesh and cell.dtype in NARROW and not cell.weighted:
    return False  # a narrow accumulator on a mesh: weighted, as in the first matrix
  return True


def is_unroll_cell(cell):
  """The fused entry points with their loop unrolled (2 micro-batches per trip, and all of
  them), with and without a mesh: float32 even with model state, float32 and a bfloat16 running
  mean weighted with it, and the bfloat16 running mean weighted without."""
  kinds = (("float32", False, True), ("float32", True, True), ("bfloat16", True, True))
  kinds += (("bfloat16", True, False),)
  return cell.entry in FUSED and (cell.dtype, cell.weighted, cell.state) in kinds


def is_precision_cell(cell):
  """Every entry point that takes ``compute_dtype`` and ``grads_in_place`` x compute dtype x
  weighting (even, uneven tokens, the same times BIG) x in place or carried, with a float32
  accumulator; on a mesh, the fused step in 16 bits with the large weights."""
  if cell.entry not in PRECISION_ENTRIES or cell.dtype != "float32" or cell.state:
    return False
  if cell.big and not cell.weighted:
    return False  # BIG multiplies the tokens' weights
  if cell.compute == "float32" and cell.in_place and not cell.big:
    return False  # float32 in place with even or token weights: the first matrix's cell
  if cell.mesh is not None:
    return cell.entry == "train_step" and cell.compute != "float32" and cell.big
  return True


def is_cell(cell):
  """Whether a combination of the axes' values runs: a cell of the first matrix, of the terms or
  unroll matrices (all three: the big-batch test, the params' dtype as the compute dtype, in
  place) or of the compute dtype's (its own test; one term, unroll 1)."""
  if cell.compute is not None:
    return not cell.terms and cell.unroll == 1 and is_precision_cell(cell)
  if cell.big or not cell.in_place:
    return False  # the large weights and carried gradients: the compute dtype's cells
  if cell.terms:
    return cell.unroll == 1 and is_term_cell(cell)
  return is_unroll_cell(cell) if cell.unroll != 1 else is_first_cell(cell)


def is_fast(cell):
  """The fast tier's cells (``-m "not slow"``), none on a mesh: float32 through every entry point
  (Linen and NNX unweighted) and the other accumulator dtypes through the weighted fused step;
  the compute dtypes in place with the large weights through ``train_step``; its terms in
  float32 (Linen and NNX weighted) and its loop unrolled by 2, float32 and (weighted) with model
  state."""
  if cell.mesh is not None:
    return False
  if cell.compute is not None:  # the large weights, where 16 bits overflowed
    return cell.entry == "train_step" and cell.in_place and cell.big
  if cell.terms:  # and the Flax steps' per-term weights
    return cell.dtype == "float32" and (
      cell.entry == "train_step" or cell.entry in ("linen", "nnx") and cell.weighted
    )
  if cell.unroll != 1:  # float32, and weighted with model state in both dtypes
    return (
      cell.entry == "train_step" and cell.unroll == 2 and (cell.dtype == "float32" or cell.state)
    )
  if cell.dtype == "float32":
    return not (cell.entry in ("linen", "nnx") and cell.weighted)
  return cell.entry == "train_step" and cell.weighted and not cell.state


@functools.cache
def full_product():
  """Every cell: the combinations of the axes' values that :func:`is_cell` keeps."""
  every = (Cell(**dict(zip(AXES, values, strict=True))) for values in it.product(*AXES.values()))
  return tuple(cell for cell in every if is_cell(cell))


@functools.cache
def pairs_and_triples(cell):
  """What a cell covers: its values on every two axes, and on each group of :data:`TRIPLES`."""
  values = [(axis, getattr(cell, axis)) for axis in AXES]
  named = [tuple((axis, getattr(cell, axis)) for axis in group) for group in TRIPLES]
  return frozenset([*it.combinations(values, 2), *named])


@functools.cache
def covering():
  """The default run: the fast tier's cells, then (greedily) the cell that covers the most pairs
  and named triples not yet covered, the first in :func:`full_product`'s order on a tie, until
  every one some cell holds is covered; then, latest first, each added cell whose pairs and
  triples the others cover is left out. Deterministic, and every added cell covers something
  no other covering cell does."""
  every = full_product()
  chosen = [cell for cell in every if is_fast(cell)]
  seeded, covered = len(chosen), set().union(*map(pairs_and_triples, chosen))
  needed = set().union(*map(pairs_and_triples, every))
  while covered != needed:
    best = max(every, key=lambda cell: len(pairs_and_triples(cell) - covered))
    chosen.append(best)
    covered |= pairs_and_triples(best)
  holders = collections.Counter(t for cell in chosen for t in pairs_and_triples(cell))
  for cell in reversed(chosen[seeded:]):
    if all(holders[t] > 1 for t in pairs_and_triples(cell)):
      chosen.remove(cell)
      holders.subtract(pairs_and_triples(cell))
  return frozenset(chosen)


def as_param(cell):
  """A cell's test parameter: fast, slow, or slow and ``full`` (beyond the covering array: left
  out by default, run with ``-m full``)."""
  marks = [] if is_fast(cell) else [pytest.mark.slow]
  marks += [] if cell in covering() else [pytest.mark.full]
  return pytest.param(cell, id=str(cell), marks=marks)


def cells():
  """The big-batch test's cells: the first matrix's, the terms' and the unrolled loops'."""
  return [as_param(cell) for cell in full_product() if cell.compute is None]


def precision_cells():
  """The compute dtype's cells."""
  return [as_param(cell) for cell in full_product() if cell.compute is not None]


def assert_moves_close(actual, expected, start, tol, what):
  """Each leaf's move from ``start`` equals the reference's within ``tol`` of its largest."""
  for (path, a), e, s in zip(
    jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), jax.tree.leaves(start),
    strict=True,
  ):  # fmt: skip
    a, e, s = (np.asarray(t, np.float64) for t in (a, e, s))
    scale = max(np.max(np.abs(e - s)), 1e-30)
    err = np.max(np.abs((a - s) - (e - s)))
    assert err <= tol * scale, (
      f"{what}{jax.tree_util.keystr(path)}: {err:.3g} > {tol} * {scale:.3g}"
    )


@pytest.mark.parametrize("cell", cells())
def test_every_entry_point_equals_the_big_batch_update(cell):
  expected = reference(cell.dtype, cell.weighted, cell.flushed, terms=voided_by_weight(cell))
  with jax.enable_x64(cell.x64):
    params, model_state = initial(cell)
    start = as_numpy(params)
    actual = RUNNERS[cell.entry](cell, params, model_state, batches(cell))
  tol = TOL[cell.dtype]
  zero_trace = jax.tree.map(np.zeros_like, start)
  for w, (a, e) in enumerate(zip(actual, expected, strict=True)):
    assert_moves_close(a.params, e.params, start, tol, f"window {w}: params")
    assert_moves_close(a.trace, e.trace, zero_trace, tol, f"window {w}: momentum")
    assert (a.count, a.num_skipped) == (e.count, e.num_skipped), (w, a.count, a.num_skipped)
    if w < 2:  # the voided window's loss is NaN in both; window 1's at params within tol
      np.testing.assert_allclose(a.loss, e.loss, rtol=max(tol, 1e-5) if not cell.x64 else 1e-10)
    else:  # the voided window moves nothing: the params and momentum of window 1, bit for bit
      assert not np.isfinite(a.loss)
      assert_trees_close((a.params, a.trace), (actual[1].params, actual[1].trace), rtol=0, atol=0)
    if cell.state:
      assert int(a.model_state["n"]) == int(e.model_state["n"])
      np.testing.assert_allclose(a.model_state["s"], e.model_state["s"], rtol=1e-5)


# --- compute dtype x weighting x in place -----------------------------------------------------

# The compute dtype's precision: the step and the whole batch round differently (the sums' order,
# each micro-batch's cotangent scale), each within a few units of the 16-bit dtype's epsilon.
# Measured: at most 9 (bfloat16) and 7 (float16) epsilons, in place or carried, on jax 0.12.
COMPUTE_TOL = {"float32": TOL["float32"], "bfloat16": 16 * 2.0**-8, "float16": 16 * 2.0**-11}


@pytest.mark.parametrize("cell", precision_cells())
def test_every_compute_dtype_and_weighting_equals_the_big_batch_in_place_or_carried(cell):
  """The params, momentum, counters, loss and loss scale of two windows and a voided one equal
  the whole batch's computed in the same dtype: a weighted in-place backward pass is seeded at
  the whole batch's scale, so float16 neither overflows (voided windows, a halved loss scale)
  nor rounds the weights."""
  expected = reference(cell.dtype, cell.weighted, False, cell.compute, cell.loss_scaled)
  params, model_state = initial(cell)
  start = as_numpy(params)
  actual = RUNNERS[cell.entry](cell, params, model_state, batches(cell))
  tol = COMPUTE_TOL[cell.compute]
  zero_trace = jax.tree.map(np.zeros_like, start)
  for w, (a, e) in enumerate(zip(actual, expected, strict=True)):
    got = (a.count, a.num_skipped, a.scale)
    assert got == (e.count, e.num_skipped, e.scale), (w, got)
    assert_moves_close(a.params, e.params, start, tol, f"window {w}: params")
    assert_moves_close(a.trace, e.trace, zero_trace, tol, f"window {w}: momentum")
    if w < 2:
      np.testing.assert_allclose(a.loss, e.loss, rtol=max(tol, 1e-5))
    else:
      assert not np.isfinite(a.loss)


def test_the_default_cells_cover_every_pair_and_the_named_triples():
  """The default run (the cells not marked ``full``) holds every value of every axis, every pair
  of values on two axes and every triple on :data:`TRIPLES` that some cell of the full product
  holds; a cell marked ``full`` is marked ``slow`` too, so the fast tier never runs it."""
  params = cells() + precision_cells()
  marked = {p.id: {mark.name for mark in p.marks} for p in params}
  full = [p.values[0] for p in params]
  default = [p.values[0] for p in params if "full" not in marked[p.id]]

  def held(cells):
    pairs = {
      ((a, getattr(c, a)), (b, getattr(c, b))) for c in cells for a, b in it.combinations(AXES, 2)
    }
    triples = {tuple((a, getattr(c, a)) for a in group) for c in cells for group in TRIPLES}
    return pairs | triples

  missing = held(full) - held(default)
  assert not missing, f"{len(missing)} not in the default run, e.g. {sorted(missing, key=str)[:3]}"
  for axis, values in AXES.items():
    assert {getattr(c, axis) for c in default} == set(values), axis
  assert all("slow" in marked[p.id] for p in params if "full" in marked[p.id])
