"""The gradient noise scale: its state, a window's sums, estimates, EMAs (docs/noise_scale.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradaccum_jax._parts import Micro, Unit, mean_of, safe_mean, sq_norm


class NoiseScaleState(NamedTuple):
  r"""State of the gradient noise scale: the estimates' EMAs and the open window's sums.

  Attributes:
    g2_ema: EMA from 0 of the windows' estimates of :math:`|G|^2` (float32).
    trace_ema: EMA from 0 of the windows' estimates of :math:`\mathrm{tr}(\Sigma)` (float32).
    count: windows averaged into the EMAs (int32).
    sq_sum: :math:`\sum_i w_i |g_i|^2` over the open window, times the loss scale squared.
    num: micro-batches of positive weight in the open window (per-device ones on a mesh).
    examples: examples in the open window: the summed weights, or ``k * b`` unweighted.
  """

  g2_ema: jax.Array
  trace_ema: jax.Array
  count: jax.Array
  sq_sum: jax.Array
  num: jax.Array
  examples: jax.Array


class NoiseSums(NamedTuple):
  """A window's sums for the noise scale; additive like ``Sums`` (one psum on a mesh)."""

  sq_sum: jax.Array  # sum_i w_i |g_i|^2
  num: jax.Array  # micro-batches of positive weight
  examples: jax.Array  # examples (or tokens) they hold


def init_state() -> NoiseScaleState:
  zero = jnp.zeros((), jnp.float32)
  return NoiseScaleState(zero, zero, jnp.zeros((), jnp.int32), zero, zero, zero)


def add_noise(n: NoiseSums, sq: jax.Array, w: jax.Array | None, examples: Any = 0.0) -> NoiseSums:
  """``n`` plus a micro-batch's squared norm ``sq``, weight ``w`` (None: ``examples``), in f32."""
  sq = jnp.asarray(sq).astype(jnp.float32)
  if w is None:
    more = NoiseSums(sq, 1.0, examples)
  else:
    pos = w > 0
    more = NoiseSums(jnp.where(pos, w * sq, 0.0), pos.astype(jnp.float32), jnp.where(pos, w, 0.0))
  return jax.tree.map(jnp.add, n, more)


@dataclasses.dataclass(frozen=True)
class NoiseUnit(Unit):
  """The noise sums' unit (protocol: ``_parts``); it needs each micro-batch's own gradient."""

  weighted: bool  # micro-batches weighed by weight_fn (else alike)
  name = "noise"
  needs_grads = "noise"  # a key of _microbatch.CARRIED_BECAUSE

  def init(self, acc_init: Any, like: Micro) -> NoiseSums:
    return NoiseSums(*(jnp.zeros((), jnp.float32),) * 3)

  def update(self, n: NoiseSums, m: Micro) -> NoiseSums:
    return add_noise(n, sq_norm(m.grads), m.weight if self.weighted else None)

  def finalize(self, n: NoiseSums, num: Any, rows: int) -> NoiseSums:
    """Unweighted, the examples are the ``num`` micro-batches' ``rows``."""
    if self.weighted:
      return n
    return n._replace(examples=jnp.asarray(num * rows, jnp.float32))

  def reduce(self, n: NoiseSums) -> tuple[dict[str, Any], Any]:
    """Summed over the devices, in the window's one all-reduce."""
    return {"sum": n}, lambda got: got["sum"]

  def share(self, n: NoiseSums, devices: int) -> NoiseSums:
    """Unweighted, a device's micro-batch weighs ``1 / devices`` (``SumsUnit.share``)."""
    return n if self.weighted else n._replace(sq_sum=n.sq_sum / devices)

  def merge(self, n: NoiseSums, more: NoiseSums) -> NoiseSums:
    return jax.tree.map(lambda x, y: x + y.astype(x.dtype), n, more)

  def empty(self, n: NoiseSums) -> NoiseSums:
    return jax.tree.map(jnp.zeros_like, n)

  def held(self, state: Any) -> NoiseSums | tuple[()]:
    """The open window's noise sums in ``state`` (any mode's; ``()`` without the noise scale)."""
    ns = getattr(state, "accumulate", state).noise_scale
    return () if ns is None else NoiseSums(ns.sq_sum, ns.num, ns.examples)

  def hold(self, state: Any, n: NoiseSums | tuple[()]) -> Any:
    if hasattr(state, "accumulate"):
      return state._replace(accumulate=self.hold(state.accumulate, n))
    ns = state.noise_scale
    return state if ns is None else state._replace(noise_scale=ns._replace(**n._asdict()))


def estimates(
  acc_grads: Any, acc_weight: jax.Array, ns: NoiseScaleState, scale: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """A window's unbiased estimates of ``|G|^2`` and ``tr(Sigma)``; NaN if ``n < 2`` or empty."""
  valid = (ns.num > 1.5) & (acc_weight > 0)
  scale2 = 1.0 if scale is None else scale**2
  # The sums are of scaled gradients.
  gbar2 = sq_norm(mean_of(acc_grads, acc_weight)).astype(jnp.float32) / scale2
  mean_sq = safe_mean(ns.sq_sum, acc_weight) / scale2
  n1 = jnp.where(valid, ns.num - 1.0, 1.0)
  g2 = (ns.num * gbar2 - mean_sq) / n1
  trace = ns.examples * (mean_sq - gbar2) / n1
  return jnp.where(valid, g2, jnp.nan), jnp.where(valid, trace, jnp.nan)


def after_window(
  ns: NoiseScaleState | None, decay: Any, acc_grads: Any, acc_weight: Any, ok: Any, scale: Any
) -> tuple[NoiseScaleState | None, dict[str, jax.Array]]:
  """The state after a window (EMAs moved if ``ok`` and estimable, sums emptied) and what the
  window reports: the ratio of the averages and this window's estimates."""
  if ns is None:
    return None, {}
  g2, trace = estimates(acc_grads, acc_weight, ns, scale)
  use = ok & jnp.isfinite(g2) & jnp.isfinite(trace)

  def ema(old, new):
    return jnp.where(use, decay * old + (1 - decay) * new, old)

  count = jnp.where(use, optax.safe_increment(ns.count), ns.count)
  new = init_state()._replace(
    g2_ema=ema(ns.g2_ema, g2), trace_ema=ema(ns.trace_ema, trace), count=count
  )
  metrics = dict(noise_scale=new.trace_ema / new.g2_ema, grad_sq_norm_est=g2, trace_sigma_est=trace)
  return new, metrics


def noise_scale(state: Any) -> jax.Array:
  r"""The simple gradient noise scale :math:`B_\text{simple} = \mathrm{tr}(\Sigma) / |G|^2`.

  The ratio of the EMAs in ``state.noise_scale``, in examples (what the weights count), from
  unbiased per-window estimates (docs/noise_scale.md).

  Args:
    state: the state of ``ga.accumulate(..., noise_scale_ema=decay)`` (any mode's).

  Returns:
    A float32 scalar array, NaN before the first estimated window.

  Examples:
    >>> import jax.numpy as jnp, optax, gradaccum_jax as ga
    >>> tx = ga.accumulate(optax.sgd(0.0), 2, noise_scale_ema=0.9)
    >>> params, state = jnp.zeros(2), tx.init(jnp.zeros(2))
    >>> for g in (jnp.array([3.0, 0.0]), jnp.array([1.0, 0.0])):
    ...   _, state = tx.update(g, state, params, weight=1.0)
    >>> # |gbar|^2 = 4, A = (9 + 1) / 2 = 5: |G|^2 ~ 2 * 4 - 5 = 3, tr(Sigma) ~ 2 * (5 - 4) = 2
    >>> round(float(ga.noise_scale(state)), 4)
    0.6667

  References:
    McCandlish et al., https://arxiv.org/abs/1812.06162
  """
  ns = getattr(getattr(state, "accumulate", state), "noise_scale", False)  # any mode's state
  if ns is False:
    raise TypeError(f"noise_scale expects an AccumulateState, got {type(state).__name__}.")
  if ns is None:
    raise ValueError(
      "This state has no noise scale estimate: make the transformation with"
      " ga.accumulate(inner, k, noise_scale_ema=0.99)."
    )
  return ns.trace_ema / ns.g2_ema
