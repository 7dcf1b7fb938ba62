"""Differentially private accumulation (DP-SGD over a window, docs/privacy.md): each example's
gradient clipped, Gaussian noise added once to the window's clipped sum, which is divided by a
fixed expected batch size."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._accumulate import Accumulate, accumulate, as_accumulate
from gradaccum_jax._checks import check_real, check_weight, is_inexact
from gradaccum_jax._microbatch import Backward, Objective
from gradaccum_jax._options import Config
from gradaccum_jax._parts import Micro, addends, safe_mean, sq_norm


@dataclasses.dataclass(frozen=True)
class Privacy:
  """DP-SGD's settings (:func:`dp_accumulate`) and what it does to a micro-batch and a window."""

  l2_clip: float
  noise_multiplier: float
  expected_batch_size: float
  seed: int
  example_weight: Callable[[Any], Any] | None = None  # weight_fn: > 0 for a real example

  def for_loss(self, config: Config) -> Privacy:
    """These settings for a step's loss: ``weight_fn`` flags each real example."""
    if config.stats is not None:
      raise ValueError(
        f"{config.where}: a DP transformation (ga.dp_accumulate) does not take window_stats=:"
        " each example's clipped gradient may read that example only, not the window's."
      )
    return dataclasses.replace(self, example_weight=config.weight_fn)

  def backward(self, **fields: Any) -> PerExample:
    """The window's backward strategy: each example's gradient clipped (:meth:`micro`)."""
    return PerExample(privacy=self, **fields)

  def real(self, example: Any) -> jax.Array:
    """Whether ``example`` (a micro-batch of one row) is real: ``weight_fn`` above 0."""
    if self.example_weight is None:
      return jnp.ones((), bool)
    what, means = (
      "with a DP transformation, weight_fn(example)",
      "1 for a real example, 0 for padding",
    )
    return check_weight(self.example_weight(example), what, means) > 0

  def reals(self, mb: Any) -> jax.Array:
    """Whether each example of micro-batch ``mb`` is real (:meth:`real`), one bool per row."""
    return jax.vmap(lambda ex: self.real(_one_row(ex)))(mb)

  def count(self, mb: Any) -> jax.Array:
    """The micro-batch's real examples, as float32: its weight."""
    return jnp.sum(self.reals(mb).astype(jnp.float32))

  def micro(self, objective: Objective, params: Any, start: Any, mb: Any, key: Any) -> Micro:
    """One micro-batch: each example's gradient (``loss_fn`` on a micro-batch of its row alone,
    example ``e`` with ``fold_in(key, e)``) clipped to ``l2_clip``, 0 for padding or a non-finite
    gradient; its gradient is their mean over its real examples, its weight their number, so the
    window's sums hold the clipped sum."""
    _check_state(start, objective.where)
    mb = jax.tree.map(jnp.asarray, mb)  # a NumPy micro-batch is indexed by a traced example
    rows = jax.tree.leaves(mb)[0].shape[0]
    es = jnp.arange(rows)

    def loss_of(q: Any, e: jax.Array, ex: Any) -> tuple:  # (objective, (loss, aux, new_state))
      k = None if key is None else jax.random.fold_in(key, e)
      return objective(q, start, _one_row(ex), k, None)

    def grad_of(e: jax.Array, ex: Any) -> Any:
      return jax.grad(lambda q: loss_of(q, e, ex)[0])(params)

    real = self.reals(mb)
    norm, finite = jax.vmap(lambda e, ex: _norm(grad_of(e, ex)))(es, mb)
    ok, w = real & finite, jnp.sum(real.astype(jnp.float32))
    # min(1, C / |g_e|): 1 for a zero gradient (C / 0 = inf); 0 for padding or a NaN.
    factor = jnp.where(ok, jnp.minimum(1.0, self.l2_clip / norm), 0.0) / jnp.maximum(w, 1)
    wide = jax.tree.map(lambda p: jnp.promote_types(jnp.result_type(p), jnp.float32), params)

    def batched(_: None) -> tuple:
      def weighted(q: Any) -> tuple:
        out, rest = jax.vmap(loss_of, (None, 0, 0))(q, es, mb)
        return jnp.sum(factor.astype(out.dtype) * out), rest

      (_, rest), grads = jax.value_and_grad(weighted, has_aux=True)(params)
      return jax.tree.map(lambda g, d: g.astype(d), grads, wide), rest

    def one_by_one(_: None) -> tuple:
      def add(e: jax.Array, total: Any) -> Any:
        g = grad_of(e, jax.tree.map(lambda x: x[e], mb))
        return jax.tree.map(
          lambda t, x: t + jnp.where(ok[e], factor[e] * x, 0).astype(t.dtype), total, g
        )

      zeros = jax.tree.map(jnp.zeros_like, params, wide)  # device-varying as the params are
      rest = jax.vmap(lambda e, ex: loss_of(params, e, ex)[1])(es, mb)  # forward only
      return jax.lax.fori_loop(0, rows, add, zeros), rest

    grads, (loss, aux, new_state) = jax.lax.cond(jnp.all(finite), batched, one_by_one, None)
    mean = jax.tree.map(lambda x: safe_mean(jnp.sum(jnp.where(real, x, 0)), w), loss)
    if objective.loss.has_aux:  # each leaf reduced over the real examples as over micro-batches
      red, like = objective.loss.aux, jax.tree.map(lambda x: x[0], aux)

      def add(acc: Any, xs: tuple) -> tuple:
        return red.add(acc, xs[0], xs[1].astype(jnp.float32), True), None

      aux = red.final(jax.lax.scan(add, red.init(like), (aux, real))[0], w, like)
    new_state = None if start is None else jax.tree.map(lambda x: x[0], new_state)
    return Micro(mean, aux, grads, w, new_state)

  def window(self, acc_grads: Any, weight: jax.Array, count: jax.Array) -> tuple:
    """``(never empty, the clipped sum + N(0, (sigma C)^2), B)``: one draw per window, from
    ``fold_in(key(seed), count)``, which a resumed run draws again."""
    total = addends(acc_grads, weight)
    b = jnp.asarray(self.expected_batch_size, jnp.float32)
    return jnp.ones((), bool), self.noised(total, count), b

  def noised(self, total: Any, count: jax.Array) -> Any:
    if self.noise_multiplier == 0:
      return total
    leaves, treedef = jax.tree.flatten(total)
    keys = jax.random.split(jax.random.fold_in(jax.random.key(self.seed), count), len(leaves))
    std = self.noise_multiplier * self.l2_clip

    def noisy(x: jax.Array, k: jax.Array) -> jax.Array:
      z = jax.random.normal(k, x.shape, jnp.promote_types(x.dtype, jnp.float32))
      return x.astype(z.dtype) + std * z

    return treedef.unflatten([noisy(x, k) for x, k in zip(leaves, keys, strict=True)])


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerExample(Backward):
  """DP's backward strategy: each example's gradient clipped to ``l2_clip`` (:meth:`Privacy.micro`)."""

  privacy: Privacy

  def micro(self, p: Any, start: Any, mb: Any, key: Any, w: jax.Array) -> Micro:
    return self.privacy.micro(self.objective, p, start, mb, key)


def _norm(grads: Any) -> tuple[jax.Array, jax.Array]:
  """``(|g|, whether g is finite)``, without overflow: the norm of ``g / max |g|`` times it, so
  a finite gradient whose squared norm is past float32's range is still clipped to C."""
  top = jnp.max(
    jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in jax.tree.leaves(grads)])
  )
  scale = jnp.where(top > 0, top, 1.0)
  sq = sq_norm(jax.tree.map(lambda x: x / scale.astype(x.dtype), grads))
  return top * jnp.sqrt(sq), jnp.isfinite(top) & jnp.isfinite(sq)


def _one_row(example: Any) -> Any:
  """An example as a micro-batch of one row: what ``loss_fn`` and ``weight_fn`` take."""
  return jax.tree.map(lambda x: x[None], example)


def _check_state(start: Any, where: str) -> None:
  """A ValueError for a model state one example's loss could not keep to itself: float
  statistics (BatchNorm) mix the examples, an RNG stream draws once for all of them."""
  for path, x in jax.tree_util.tree_leaves_with_path(start):
    if is_inexact(x) or jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
      raise ValueError(
        f"{where}: with a DP transformation (ga.dp_accumulate) each example's loss runs alone,"
        f" but the model state holds {jax.tree_util.keystr(path)} ({jnp.result_type(x)}):"
        " float statistics (BatchNorm) mix the examples and an RNG stream would give every"
        " example of a micro-batch one draw. Use a normalization without batch statistics"
        " (LayerNorm, GroupNorm) and pass the step a key (rng=) for dropout."
      )


def dp_accumulate(
  inner: optax.GradientTransformation,
  num_microbatches: int,
  *,
  l2_clip: float,
  noise_multiplier: float,
  expected_batch_size: float,
  seed: int = 0,
  accum_dtype: Any = jnp.float32,
  skip_nonfinite: bool = True,
) -> Accumulate:
  r"""DP-SGD over accumulation windows: :func:`accumulate` whose window update is private.

  Each example's gradient :math:`g_e` (``loss_fn`` on its row alone) is clipped to norm ``C``
  in the steps (:func:`clipped_grad` for ``tx.update``); the window closes with one ``inner``
  update on

  .. math:: G = \Big(\sum_e \min(1, C / \|g_e\|)\, g_e + \mathcal{N}(0, \sigma^2 C^2 I)\Big) / B,

  the noise drawn once per window from ``seed`` and ``state.count`` (docs/privacy.md).

  Args:
    inner: the optimizer applied once per window.
    num_microbatches: ``k``, a positive int.
    l2_clip, noise_multiplier, expected_batch_size: ``C > 0``, ``sigma >= 0``, ``B > 0``
      (fixed: the realized count would depend on the data).
    seed: the noise's seed (a 64-bit int); keep it secret and fixed across a resumed run.
    accum_dtype, skip_nonfinite: as in :func:`accumulate`.

  Returns:
    An :class:`Accumulate` whose ``privacy`` holds the settings.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> tx = ga.dp_accumulate(optax.sgd(1.0), 2, l2_clip=1.0, noise_multiplier=0.0,
    ...                       expected_batch_size=4)
    >>> loss_fn = lambda w, mb: jnp.mean(mb["x"] @ w)  # each example's gradient is its x
    >>> batch = {"x": jnp.array([[3.0, 4.0], [0.0, 0.5], [0.0, 0.0], [0.6, 0.8]])}
    >>> w, state, _ = ga.train_step(loss_fn, tx)(jnp.zeros(2), tx.init(jnp.zeros(2)), batch)
    >>> w  # -(x_0 / 5 + x_1 + x_2 + x_3) / 4
    Array([-0.3  , -0.525], dtype=float32)
  """
  settings = {"l2_clip": l2_clip, "noise_multiplier": noise_multiplier}
  settings["expected_batch_size"] = expected_batch_size
  for name, value in settings.items():
    value = check_real(value, f"dp_accumulate: {name} must be a real number")
    if not (value >= 0 if name == "noise_multiplier" else value > 0) or value == float("inf"):
      at_least = ">= 0" if name == "noise_multiplier" else "> 0"
      raise ValueError(f"dp_accumulate: {name}={value!r} must be finite and {at_least}.")
    settings[name] = value
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise TypeError(f"dp_accumulate: seed must be an int, got {seed!r}.")
  if not -(2**63) <= seed < 2**63:  # what jax.random.key takes
    raise ValueError(f"dp_accumulate: seed={seed} must be a 64-bit int, -2**63 <= seed < 2**63.")
  tx = accumulate(inner, num_microbatches, accum_dtype=accum_dtype, skip_nonfinite=skip_nonfinite)
  acc = dataclasses.replace(tx.settings, privacy=Privacy(**settings, seed=seed))
  return Accumulate(acc.init, acc.update, acc)


def clipped_grad(
  loss_fn: Callable[..., Any],
  tx: Accumulate,
  *,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
) -> Callable[..., Any]:
  """A micro-batch's clipped gradient for ``tx.update`` of a :func:`dp_accumulate` ``tx``.

  ``fn(params, microbatch, rng=None) -> (value, grads, weight)``: ``grads`` the mean over the
  micro-batch's real examples of each example's gradient clipped to ``tx``'s ``l2_clip``,
  ``weight`` their number, ``value`` the loss (``(loss, aux)`` with ``has_aux``) over them;
  ``tx.update(grads, state, params, weight=weight)`` then adds their clipped sum, as a fused
  step does (the noise is added when the window closes).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradaccum_jax as ga
    >>> tx = ga.dp_accumulate(optax.sgd(1.0), 1, l2_clip=1.0, noise_multiplier=0.0,
    ...                       expected_batch_size=2)
    >>> fn = ga.clipped_grad(lambda w, mb: jnp.mean(mb @ w), tx)
    >>> _, grads, weight = fn(jnp.zeros(2), jnp.array([[3.0, 4.0], [0.0, 0.5]]))
    >>> grads, weight  # (x_0 / 5 + x_1) / 2 over 2 examples
    (Array([0.3 , 0.65], dtype=float32), Array(2., dtype=float32))
  """
  privacy = as_accumulate(tx).settings.privacy
  if privacy is None:
    raise TypeError(
      "clipped_grad: tx must be made by ga.dp_accumulate (it holds l2_clip), got a transformation"
      " without privacy settings."
    )
  config = Config.make("clipped_grad", loss_fn, has_aux=has_aux, weight_fn=weight_fn)
  privacy, objective = (
    privacy.for_loss(config),
    Objective(config.loss, config.precision, "clipped_grad"),
  )

  def fn(params: Any, microbatch: Any, rng: Any = None) -> tuple[Any, Any, jax.Array]:
    m = privacy.micro(objective, params, None, microbatch, rng)
    return config.loss.pack(m.loss, m.aux, None), m.grads, m.weight

  return fn
