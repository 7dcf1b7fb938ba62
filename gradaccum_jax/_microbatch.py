"""The window: what it must know first, one backward strategy, a scan of its units' parts.

``Core.window`` runs, on one device (in ``shard_map`` on a mesh)::

  before = core.before(...)       # the prepass: per-term totals, statistics, fp8's total
  backward = core.backward(...)   # chosen once: carried, in place, by term, per example
  parts = scan(i -> {name: unit.update(parts[name], backward(i, start))})
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._checks import check_batch, check_num_microbatches, check_trainable
from gradaccum_jax._model_state import ModelStateUnit
from gradaccum_jax._noise import NoiseUnit
from gradaccum_jax._options import Config, Loss, Precision
from gradaccum_jax._parts import (
  AuxReducers,
  Inputs,
  Micro,
  Overwritten,
  Static,
  SumsUnit,
  Unit,
  Weighting,
  Window,
  keeps_running_means,
)
from gradaccum_jax._sharding import ONE_DEVICE, Devices, over_mesh
from gradaccum_jax._terms import Terms, combine, names_of, refused, split

IN_PLACE_SCOPE = "ga_grads_in_place"
# The package's own loops, named for ga.inspect_step: the window's, the window statistics' pass.
WINDOW_SCOPE, STATS_SCOPE = "ga_window_loop", "ga_window_stats"
UNROLL_SCOPE = "ga_unroll_"  # + the micro-batches per trip of an unrolled loop (ga.inspect_step)
# Why a step carries each gradient instead of adding it in place: the key names a scope around
# the carried backward pass, which ga.inspect_step reads from the program.
CARRIED_SCOPE = "ga_grads_carried__"
CARRIED_BECAUSE = {
  "option": "grads_in_place=False",
  "jax": "this JAX has no gradient Refs: jax >= 0.11 adds in place",
  "noise": "the noise scale needs each micro-batch's gradient",
  "unit": "a unit needs each micro-batch's gradient",
  "per_microbatch": "gather_params='per_microbatch' reduce-scatters each micro-batch's gradient",
  "fp8": "fp8 scales each micro-batch's gradient back",
  "dtype": "an accumulator leaf's dtype differs from its param's (float32 sums of 16-bit params)",
  "running_mean": "a 16-bit accumulator keeps a running mean",
  "narrow_loss": "a weighted loss narrower than float32 would round each weight in its seed",
  "streaming": "micro_step adds in place only when donated and without a mesh",
  "privacy": "DP clips each example's gradient before it is summed",
}

# Units beyond the built-in ones: ``make(core) -> Unit | None`` (None: off for this core); each
# part is computed, reduced, held and reported as the built-in ones (docs/architecture.md).
UNITS: list[Callable[[Any], Unit | None]] = []


def refs_available() -> bool:
  """Whether this JAX adds a backward pass into a ``jax.Ref`` in place (0.11 and later)."""
  return hasattr(jax, "new_ref") and jax.__version_info__ >= (0, 11)


def microbatch(batch: Any, index: jax.Array | int, num_microbatches: int) -> Any:
  """Micro-batch ``index`` of ``batch``: the rows ``index, index + k, index + 2k, ...``.

  Strided, so a batch sharded on its leading axis stays in place: each micro-batch takes
  ``B / (k D)`` rows from each of ``D`` devices.

  Args:
    batch: a pytree of arrays sharing a leading axis ``B``, a multiple of ``k``.
    index: which micro-batch, ``0 <= index < k`` (an int or a traced int).
    num_microbatches: ``k``.

  Returns:
    ``batch`` with every leaf's leading axis ``B / k``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradaccum_jax as ga
    >>> ga.microbatch(jnp.arange(6), 1, num_microbatches=3)
    Array([1, 4], dtype=int32)
  """
  k = check_num_microbatches(num_microbatches, allow_schedule=False)
  if not isinstance(index, jax.core.Tracer) and not 0 <= int(index) < k:
    raise IndexError(f"micro-batch {index=} is out of range for num_microbatches={k}.")

  def take(x):
    x = jnp.asarray(x)
    x = x.reshape((x.shape[0] // k, k) + x.shape[1:])
    return jax.lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False)

  return jax.tree.map(take, batch)


def seed_unit(total: jax.Array, devices: int) -> jax.Array:
  """The power of two above the window's weight W (``total`` on one of ``devices``): seeded by
  ``w_i / unit``, a backward pass has the whole batch's cotangent scale, and scaling back
  rounds nothing; 1 for a void window."""
  total = total * devices
  _, exponent = jnp.frexp(total)  # total = m 2^exponent, 0.5 <= m < 1
  ok = jnp.isfinite(total) & (total > 0)
  return jnp.where(ok, jnp.ldexp(jnp.ones((), jnp.float32), exponent), 1.0)


@dataclasses.dataclass(frozen=True)
class Take:
  """Micro-batch ``i``'s ``(params, rows, key)``; params gathered for it with ``per_micro``."""

  inputs: Inputs
  k: int
  per_micro: Any = None  # a _sharding.PerMicrobatch

  def __call__(self, i: Any) -> tuple[Any, Any, Any]:
    params, batch, rng = self.inputs[:3]
    key = None if rng is None else jax.random.fold_in(rng, i)
    p = params if self.per_micro is None else self.per_micro.gather(params, i)
    return p, microbatch(batch, i, self.k), key


@dataclasses.dataclass(frozen=True)
class Objective:
  """What a micro-batch's backward pass differentiates: ``loss_fn`` at the params cast to the
  compute dtype, with the window's statistics and terms, times the loss scale, in float32."""

  loss: Loss
  precision: Precision
  where: str
  stats: Any = None
  terms: Terms | None = None

  def __call__(self, params, model_state, mb, key, scale, *, only=None, checked=False):
    """``(loss * scale, (loss, aux, new_model_state))``; terms as the sums take them, ``only``
    one's, ``checked``: also whether every term of weight 0 is finite."""
    args = (self.precision.cast(params), model_state, mb, key, self.stats)
    loss, aux, new_state = self.loss.call(*args)
    clean = jnp.ones((), bool)
    if isinstance(loss, dict):
      if self.where == "micro_step":
        raise TypeError(refused(self.where, list(loss)))
      loss, clean = combine(loss) if self.terms is None else self.terms.combine(loss, mb, only)
    value = loss["loss"] if isinstance(loss, dict) else loss
    scaled = value.astype(jnp.promote_types(value.dtype, jnp.float32))
    rest = (loss, aux, new_state, clean) if checked else (loss, aux, new_state)
    return (scaled if scale is None else scaled * scale), rest


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backward:
  """A micro-batch's forward and backward pass, ``(i, model_state) -> Micro``: carried (the gradient
  handed to the units)."""

  take: Take
  objective: Objective
  weighting: Weighting
  scale: Any = None  # the loss scale
  fp8: Any = None  # Fp8: each loss seeded at the whole batch's scale, its gradient scaled back
  why: str | None = None  # why the gradient is carried (a key of CARRIED_BECAUSE)
  refs: Any = None  # the accumulator's Refs, where gradients are added in place
  norm: Any = None  # weighted, in place: the seeds' normalizer (seed_unit)

  def __call__(self, i: Any, start: Any) -> Micro:
    p, mb, key = self.take(i)
    return self.micro(p, start, mb, key, self.weighting.of(mb))

  def micro(self, p: Any, start: Any, mb: Any, key: Any, w: jax.Array) -> Micro:
    seed = self.scale if self.fp8 is None else self.fp8.seed(w, self.scale)
    grad_fn = jax.value_and_grad(self.objective, has_aux=True)
    with jax.named_scope(CARRIED_SCOPE + (self.why or "")):  # ga.inspect_step reads why
      (_, (loss, aux, new_state)), grads = grad_fn(p, start, mb, key, seed)
    if self.fp8 is not None:
      grads, aux = self.fp8.split(grads, aux, w)
    return Micro(loss, aux, grads, w, new_state)

  def seed(self, w: jax.Array, like: jax.Array) -> Any:
    """An in-place backward pass's seed: ``w / norm`` weighted (None unweighted: 1)."""
    return None if self.norm is None else (w / self.norm).astype(like.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InPlace(Backward):
  """The backward pass adds the gradient into the Refs (``jax.vjp(...).with_refs``), seeded by
  ``w_i / norm``; a micro-batch of weight <= 0 runs forward only, so even a NaN adds nothing."""

  def micro(self, p: Any, start: Any, mb: Any, key: Any, w: jax.Array) -> Micro:
    objective = functools.partial(
      self.objective, model_state=start, mb=mb, key=key, scale=self.scale
    )

    # The params are the branches' operand: a loss that runs an nnx.scan must find them at the
    # branch's trace level, not as a constant it closes over.
    @jax.named_scope(IN_PLACE_SCOPE)  # how ga.inspect_step tells (StepReport.grads_in_place)
    def run(q):
      out, vjp_fn, rest = jax.vjp(objective, q, has_aux=True)
      seed = self.seed(w, out)
      vjp_fn.with_refs(self.refs)(jnp.ones_like(out) if seed is None else seed)
      return rest

    weighted = self.norm is not None
    rest = jax.lax.cond(w > 0, run, lambda q: objective(q)[1], p) if weighted else run(p)
    return Micro(*rest[:2], (), w, rest[2])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ByTerm(Backward):
  """A loss with per-term weights (``_terms``): one backward pass where every term of weight 0
  is finite, else one per term of positive weight, each from a forward pass of its own (an
  empty term's 0 / 0 is NaN, and so is its backward pass even at a cotangent of 0); in place
  into the Refs, or carried."""

  def micro(self, p: Any, start: Any, mb: Any, key: Any, w: jax.Array) -> Micro:
    in_place = self.refs is not None
    scale = self.scale if in_place or self.fp8 is None else self.fp8.seed(w, self.scale)
    coef = self.objective.terms.shares(mb)[1]

    def f(q: Any, only: str | None = None, checked: bool = False) -> Any:
      return self.objective(q, start, mb, key, scale, only=only, checked=checked)

    def backward(out: jax.Array, vjp_fn: Any) -> Any:
      if not in_place:
        return vjp_fn(jnp.ones_like(out))[0]
      vjp_fn.with_refs(self.refs)(self.seed(w, out))
      return ()

    def nothing(q) -> Any:
      return () if in_place else jax.tree.map(jnp.zeros_like, q)

    def one(t: str, q: Any) -> Any:  # term t alone (params the operand, as InPlace says)
      def run(q):
        return backward(*jax.vjp(lambda q: f(q, only=t)[0], q))

      return jax.lax.cond(coef[t] > 0, run, nothing, q)

    def each(q) -> Any:
      if in_place:  # each term's backward pass adds into the Refs
        for t in self.objective.terms.names:
          one(t, q)
        return ()
      # Carried: one term's gradient held at a time beside the sum (the same loop in place held
      # one more accumulator: benchmarks/window_inputs.py).
      branches = [lambda q, t=t: one(t, q) for t in self.objective.terms.names]

      def body(j: Any, total: Any) -> Any:
        return jax.tree.map(jnp.add, total, jax.lax.switch(j, branches, q))

      return jax.lax.fori_loop(0, len(branches), body, nothing(q))

    scope = IN_PLACE_SCOPE if in_place else CARRIED_SCOPE + (self.why or "")
    with jax.named_scope(scope):  # ga.inspect_step reads the path
      out, vjp_fn, (loss, aux, new_state, clean) = jax.vjp(
        lambda q: f(q, checked=True), p, has_aux=True
      )
      grads = jax.lax.cond(clean, lambda _: backward(out, vjp_fn), each, p)
    if self.fp8 is not None:
      grads, aux = self.fp8.split(grads, aux, w)
    return Micro(loss, aux, grads, w, new_state)


@dataclasses.dataclass(frozen=True)
class Fp8:
  """Params partly overwritten (``ov``: Flax's fp8 collection) under accumulation: each loss
  scaled by ``w / total`` before it is differentiated (the whole batch's cotangent, which the
  output-gradient amax sees), its gradient scaled back (``w g``), and the overwritten part's
  "gradient", its new value, an aux leaf that ``"max_all"`` reduces."""

  ov: Overwritten
  total: jax.Array  # the window's total weight, over the devices too

  def seed(self, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    ok = self.total > 0  # else a void window: nothing is added
    part = jnp.where(ok, w / jnp.where(ok, self.total, 1), 0.0)
    return part if scale is None else part * scale

  def split(self, grads: Any, aux: Any, w: jax.Array) -> tuple[Any, Any]:
    """``(the gradients as the sums take them, (aux, the overwritten part's new value))``."""
    back = jnp.where(w > 0, self.total / jnp.where(w > 0, w, 1), 0)  # 1 / the seed's part

    def scaled_back(g):
      wide = jnp.promote_types(g.dtype, jnp.float32)
      return g.astype(wide) * back.astype(wide)

    trained, new = self.ov.split(grads)
    zeros = jax.tree.map(jnp.zeros_like, new)  # the overwritten part adds nothing
    return self.ov.join(grads, jax.tree.map(scaled_back, trained), zeros), (aux, new)


@dataclasses.dataclass(frozen=True)
class _Stats(Unit):
  """A device's partial statistics ``(reductions, weight)``, combined over the devices as its
  reducers ask (_sharding.reduce_parts): sums and weight in one all-reduce, peaks by theirs."""

  reducers: AuxReducers

  def reduce(self, part: tuple) -> tuple[dict[str, Any], Callable[[dict[str, Any]], tuple]]:
    acc, weight = part
    asks = self.reducers.split(acc)
    asks["sum"] = (asks["sum"], weight)

    def finish(got: dict[str, Any]) -> tuple:
      summed, total = got["sum"]
      return self.reducers.join({**got, "sum": summed}), total

    return asks, finish


@dataclasses.dataclass(frozen=True)
class Core:
  """A loss's window over ``k`` micro-batches: its stages, chosen once for a step."""

  config: Config
  num_microbatches: int
  noise_sums: bool = False  # also sum w_i |g_i|^2 for the noise scale
  privacy: Any = None  # DP's settings (_privacy.Privacy): each example's gradient clipped
  overwrite: Overwritten | None = None  # params partly overwritten (fp8: _flax), else None

  @classmethod
  def make(cls, config: Config, k: int, settings: Any = None) -> Core:
    """The core of ``config``'s loss under a transformation's ``settings`` (its noise scale and
    DP; none for ``value_and_grad``)."""
    privacy = getattr(settings, "privacy", None)
    privacy = None if privacy is None else privacy.for_loss(config)
    return cls(config, k, getattr(settings, "noise_scale_ema", None) is not None, privacy)

  @property
  def weighting(self) -> Weighting:
    """Each micro-batch's weight: ``weight_fn``'s, or under DP its real examples."""
    return Weighting(self.config.weight_fn if self.privacy is None else self.privacy.count)

  @property
  def reducers(self) -> AuxReducers:
    """The aux reducers; fp8: of ``(aux, the overwrite collection's gradient)``, max over all."""
    aux = self.config.loss.aux
    return aux if self.overwrite is None else AuxReducers((aux.spec, "max_all"))

  def summed_units(self, acc_init: Any) -> dict[str, Unit]:
    """The units whose parts an open window's state holds: the sums and the noise sums."""
    w = self.weighting
    units = {"sums": SumsUnit(w, self.reducers, jax.tree.map(jnp.result_type, acc_init))}
    return units | ({"noise": NoiseUnit(w.weighted)} if self.noise_sums else {})

  def registered(self) -> dict[str, Unit]:
    """The units of :data:`UNITS` this core has, by name (a maker returns None for off)."""
    made = (make(self) for make in UNITS)
    return {u.name: u for u in made if u is not None}

  def held_units(self, acc_init: Any) -> dict[str, Unit]:
    """The units whose parts a streaming call's state holds: the sums and the registered ones."""
    return self.summed_units(acc_init) | self.registered()

  def units(self, model_state: Any, acc_init: Any, per_micro: Any = None) -> dict[str, Unit]:
    """Every unit of the window, by name (the sums reduce-scattered per micro-batch with
    ``per_micro``)."""
    units = self.summed_units(acc_init)
    if per_micro is not None:
      units["sums"] = per_micro.wrap(units["sums"])
    if self.config.loss.has_state:
      units["model_state"] = ModelStateUnit.make(model_state, *self.config.batchnorm)
    return units | self.registered()

  def metrics(self, window: Window) -> dict[str, Any]:
    """What the registered units report of the closed window."""
    return {
      k: v for n, u in self.registered().items() for k, v in u.metrics(window.parts[n]).items()
    }

  def carried_because(self, params, acc_init, units, per_micro, loss) -> str | None:
    """None if the backward pass adds each gradient into the accumulator in place, else why not
    (a key of ``CARRIED_BECAUSE``); ``loss()``: the loss's abstract value (its dtype)."""
    if not self.config.precision.in_place:
      return "option"
    if not refs_available():
      return "jax"
    needs = [getattr(u, "needs_grads", None) for u in units.values()]
    for why, needed in (
      ("privacy", self.privacy is not None),
      *((n, True) for n in needs if n),
      ("per_microbatch", per_micro is not None),
      ("fp8", self.overwrite is not None),
      ("running_mean", keeps_running_means(acc_init)),  # a narrow float keeps a mean, not a sum
    ):
      if needed:
        return why
    # A Ref takes the cotangent's dtype and sharding type: each param's.
    types = [(jnp.result_type(x), jax.typeof(x).sharding) for x in jax.tree.leaves(params)]
    if types != [(jnp.result_type(x), jax.typeof(x).sharding) for x in jax.tree.leaves(acc_init)]:
      return "dtype"
    if self.config.weight_fn is not None and jnp.finfo(loss().dtype).bits < 32:
      return "narrow_loss"
    return None

  def sums(self, inputs: Inputs, acc_init: Any, in_buffer=False, overwrite=None) -> Window:
    """The window of ``inputs.batch``, its gradients added to ``acc_init``; on the mesh if set, the
    scan starting from ``acc_init`` with ``in_buffer`` (a donated accumulator), else adding it
    after."""
    params, dp, ov, where = inputs.params, self.config.mesh, overwrite, self.config.where
    check_trainable(params, where=where)
    core = self if ov is None else dataclasses.replace(self, overwrite=ov)
    if ov is not None and self.privacy is not None:
      raise ValueError(
        f"{where}: the params hold {ov.name}, whose window value reads every example: a DP"
        " transformation (ga.dp_accumulate) does not take it. Train without it."
      )
    if ov is not None:  # its zeros beside the trained params' sums
      acc_init = ov.join(params, acc_init, jax.tree.map(jnp.zeros_like, ov.split(params)[1]))
    w = (
      core.window(inputs, acc_init)
      if dp is None
      else over_mesh(dp, core, inputs, acc_init, in_buffer)
    )
    if ov is None:
      return w
    (aux, new), (aux_like, _) = w.sums.aux, w.aux_like  # the overwritten part's new value
    sums = w.sums._replace(grads=ov.split(w.sums.grads)[0], aux=aux)
    return w._replace(parts={**w.parts, "sums": sums}, aux_like=aux_like,
                      reducers=self.config.loss.aux, overwrite=new)  # fmt: skip

  def before(self, take: Take, model_state: Any, num: Any, devices: Devices) -> tuple:
    """The prepass, before the loop: ``weight_fn`` alone on every micro-batch (per-term totals,
    fp8's total) and ``window_stats`` forward only on each, reduced over the window and the
    devices at once (twice for statistics weighed by per-term weights)."""
    cfg, k, weighting = self.config, self.num_microbatches, self.weighting
    _, mb0, _ = take(0)
    terms, stats, out = None, cfg.stats, {}
    if (
      weighting.weighted
      and jax.eval_shape(lambda m: Static(isinstance(weighting.fn(m), Mapping)), mb0).value
    ):
      terms = self.terms(take, model_state)
    i = jnp.arange(k)
    if terms is not None:  # every term's total first: the micro-batches weigh u_i
      ws = jax.vmap(lambda j: terms.weights(microbatch(take.inputs.batch, j, k)))(i)
      # A weight <= 0 adds nothing; a NaN or infinite one makes the total so, voiding the window.
      totals = {t: jnp.sum(jnp.where((i < num) & ~(w <= 0), w, 0.0)) for t, w in ws.items()}
      totals = devices.sum(totals)
      terms = dataclasses.replace(terms, totals=totals)
      weighting, out["term_weights"] = Weighting(terms.weight), totals
    if stats is not None:
      out["window_stats"] = self.statistics(take, model_state, num, devices, weighting)
    return out, weighting, terms

  def terms(self, take: Take, model_state: Any) -> Terms:
    """The loss's terms (its output's keys on micro-batch 0, shapes only) for per-term weights."""
    cfg = self.config
    p, mb, key = take(0)
    stats = None
    if cfg.stats is not None:
      stats = jax.eval_shape(lambda: cfg.stats.call(cfg.precision.cast(p), model_state, mb, key))
    out = jax.eval_shape(lambda s: cfg.loss.call(p, model_state, mb, key, s)[0], stats)
    keys = jax.eval_shape(lambda m: Static(tuple(cfg.weight_fn(m))), mb).value
    names = names_of(out, keys, cfg.where)
    if cfg.where == "micro_step":
      raise TypeError(refused(cfg.where, list(names)))
    return Terms(names, cfg.weight_fn)

  def statistics(self, take, model_state, num, devices, weighting) -> Any:
    """``window_stats`` on each micro-batch, forward only (one micro-batch's activations held
    at a time), reduced by its reducers with the micro-batches' weights, then over devices."""
    cfg = self.config
    reducers, wt = cfg.stats.reducers, weighting

    def one(i: Any) -> tuple[Any, jax.Array]:
      params, mb, key = take(i)
      return cfg.stats.call(cfg.precision.cast(params), model_state, mb, key), wt.of(mb)

    like = jax.eval_shape(lambda: one(0)[0])
    start = (reducers.init(like), jnp.zeros((), jnp.float32))
    start = devices.varying(start)

    def body(c: tuple, i: Any) -> tuple:
      x, w = one(i)
      return (reducers.add(c[0], x, w, wt.weighted), c[1] + wt.total(w)), None

    with jax.named_scope(STATS_SCOPE):
      if isinstance(num, int):
        acc, weight = jax.lax.scan(body, start, jnp.arange(num))[0]
      else:
        acc, weight = jax.lax.fori_loop(0, num, lambda i, c: body(c, i)[0], start)
    acc, weight = devices.reduce({"s": _Stats(reducers)}, {"s": (acc, weight)})["s"]
    if devices.axes:  # unweighted, each device's micro-batch weighs 1 / D (linear: after the sum)
      acc = reducers.share(acc, devices.count(), wt.weighted)
      weight = weight if wt.weighted else weight / devices.count()
    return jax.lax.stop_gradient(reducers.final(acc, weight, like))

  def fp8_total(self, take: Take, weighting: Weighting, num: Any, devices: Devices) -> jax.Array:
    """The window's total weight over the devices: fp8 seeds each loss with its share."""
    if not weighting.weighted:
      return jnp.asarray(num, jnp.float32) * devices.count()
    return devices.sum(self.local_weight(take, weighting, num))

  def local_weight(self, take: Take, weighting: Weighting, num: Any) -> jax.Array:
    """The total weight of this device's first ``num`` micro-batches: ``weight_fn`` alone."""
    k, i = self.num_microbatches, jnp.arange(self.num_microbatches)
    batch = take.inputs.batch
    ws = jax.vmap(lambda j: weighting.total(weighting.of(microbatch(batch, j, k))))(i)
    return jnp.sum(jnp.where(i < num, ws, 0.0))

  def window(self, inputs: Inputs, acc_init: Any, *, devices: Devices = ONE_DEVICE,
             per_micro=None, carried=None, units=None) -> Window:  # fmt: skip
    """The scan on one device (in ``shard_map`` over ``devices``' data axes); with
    ``per_micro`` (``_sharding.PerMicrobatch``) the params are shards, gathered for each
    micro-batch, and the gradients reduce-scattered into an accumulator shaped like them."""
    params, batch, _, model_state, scale, num_real = inputs
    cfg, k, ov = self.config, self.num_microbatches, self.overwrite
    rows = check_batch(batch, k) // k
    num = k if num_real is None else num_real
    before, weighting, terms = self.before(Take(inputs, k, per_micro), model_state, num, devices)
    fp8 = None
    if ov is not None:
      fp8 = Fp8(ov, self.fp8_total(Take(inputs, k), weighting, num, devices))
    params = devices.varying(params)  # per-device gradients: no psum of cotangents in the loop
    take = Take(inputs._replace(params=params), k, per_micro)
    objective = Objective(cfg.loss, cfg.precision, cfg.where, before.get("window_stats"), terms)
    units = self.units(model_state, acc_init, per_micro) if units is None else units
    kind = Backward if terms is None else ByTerm
    fields = dict(take=take, objective=objective, weighting=weighting, scale=inputs.scale, fp8=fp8)
    if self.privacy is not None:  # each example's gradient clipped (_privacy)
      kind = self.privacy.backward
    carried_pass = kind(**fields)
    like = devices.shapes(carried_pass, (0, model_state), cfg.where)
    init = devices.varying({name: unit.init(acc_init, like) for name, unit in units.items()})
    why = carried or self.carried_because(
      params, acc_init, units, per_micro, lambda: split(like.loss)[0]
    )
    refs = norm = None
    if why is None:  # the gradients added into Refs, which hold acc / norm (seeds w_i / norm)
      if weighting.weighted:
        norm = seed_unit(self.local_weight(Take(inputs, k), weighting, num), devices.count())
      inverse = None if norm is None else 1 / norm
      refs = jax.tree.map(lambda a: jax.new_ref(_scaled(a, inverse)), init["sums"].grads)
      init["sums"] = init["sums"]._replace(grads=())
      kind = InPlace if kind is Backward else kind
    backward = kind(**fields, why=why, refs=refs, norm=norm)
    model = units.get("model_state")
    start = (lambda c: None) if model is None else (lambda c: model.start(c["model_state"]))

    def body(c: dict, i) -> tuple[dict, None]:  # the carry: each unit's part, by name
      m = backward(i, start(c))
      return {name: unit.update(c[name], m) for name, unit in units.items()}, None

    if k == 1 and num_real is None:  # one micro-batch (ga.micro_step): no loop around it
      c = body(init, jnp.zeros((), jnp.int32))[0]
    elif num_real is None:  # a fixed trip count: a scan, ``unroll`` micro-batches per trip
      unroll = min(cfg.unroll, k)
      scope = WINDOW_SCOPE + (f"/{UNROLL_SCOPE}{unroll}" if unroll > 1 else "")
      with jax.named_scope(scope):
        c, _ = jax.lax.scan(body, init, jnp.arange(k), unroll=unroll)
    else:  # only the first num_real micro-batches run; the others are not computed
      with jax.named_scope(WINDOW_SCOPE):
        c = jax.lax.fori_loop(0, num_real, lambda i, c: body(c, i)[0], init)
    if refs is not None:
      grads = jax.tree.map(lambda r: _scaled(jax.freeze(r), norm), refs)
      c["sums"] = c["sums"]._replace(grads=grads)
    parts = {name: unit.finalize(c[name], num, rows) for name, unit in units.items()}
    return Window(parts, like.loss, like.aux, num, self.reducers, before=before or None)


def _scaled(x: jax.Array, factor: jax.Array | None) -> jax.Array:
  """``x * factor`` in ``x``'s dtype; ``x`` itself for no factor (an unweighted window)."""
  return x if factor is None else x * factor.astype(x.dtype)
