"""The micro-batched gradient: split a batch, scan its micro-batches, sum what the units keep."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gradaccum_jax._checks import (
  check_batch,
  check_num_microbatches,
  check_real_microbatches,
  check_trainable,
)
from gradaccum_jax._model_state import ModelStateUnit
from gradaccum_jax._noise import NoiseUnit
from gradaccum_jax._options import Options, make_options
from gradaccum_jax._parts import (
  AuxReducers,
  Inputs,
  Micro,
  Off,
  Overwritten,
  Static,
  SumsUnit,
  Window,
  keeps_running_means,
  mean_of,
  overwritten,
  zeros_accumulator,
)
from gradaccum_jax._sharding import over_mesh, shapes_refusing_nested_shard_map, to_varying
from gradaccum_jax._terms import Terms, names_of, refused, split

IN_PLACE_SCOPE = "ga_grads_in_place"
UNROLL_SCOPE = "ga_unroll_"  # + the micro-batches per trip of an unrolled loop (ga.inspect_step)

# Units beyond the built-in ones, each made by ``make(mg)`` (a MicrobatchedGrad): its part
# follows the model state's in every window's ``parts`` (docs/architecture.md, "Adding a unit").
UNITS: list[Callable[[Any], Any]] = []


def per_term(weight_fn: Any, mb: Any) -> bool:
  """Whether ``weight_fn`` returns per-term weights (a dict) on micro-batch ``mb`` (traced for
  its output's type only: other outputs are checked where the weights are used)."""
  if weight_fn is None:
    return False
  return jax.eval_shape(lambda m: Static(isinstance(weight_fn(m), Mapping)), mb).value


def refs_available() -> bool:
  """Whether this JAX adds a backward pass into a ``jax.Ref`` (``jax.vjp(...).with_refs``), with
  the scan transposition that makes it in place for stacked layers (JAX 0.11)."""
  return hasattr(jax, "new_ref") and jax.__version_info__ >= (0, 11)


def microbatch(batch: Any, index: jax.Array | int, num_microbatches: int) -> Any:
  """Micro-batch ``index`` of ``batch``: the rows ``index, index + k, index + 2k, ...``.

  Strided, so a batch sharded on its leading axis stays in place: each micro-batch takes
  ``B / (k D)`` rows from each of ``D`` devices, and only its rows are gathered.

  Args:
    batch: a pytree of arrays sharing a leading axis ``B``, a multiple of ``k``.
    index: which micro-batch, ``0 <= index < k`` (an int or a traced int).
    num_microbatches: ``k``.

  Returns:
    ``batch`` with every leaf's leading axis ``B / k``.

  Raises:
    IndexError: for a concrete ``index`` outside ``[0, k)``.

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


def window_weight(weighting: Any, batch: Any, k: int, num: Any) -> jax.Array:
  """The total weight of the first ``num`` of ``batch``'s ``k`` micro-batches, known before the
  loop: ``weight_fn`` alone on each micro-batch (no forward pass)."""
  i = jnp.arange(k)
  ws = jax.vmap(lambda j: weighting.total(weighting.of(microbatch(batch, j, k))))(i)
  return jnp.sum(jnp.where(i < num, ws, 0.0))


def seed_unit(total: jax.Array, devices: int) -> jax.Array:
  """The smallest power of two above the whole batch's total weight W (``total`` on one of
  ``devices``; W < unit <= 2 W): an in-place backward pass is seeded with ``w_i / unit``, so its cotangents are
  at the whole batch's scale (a seed of ``w_i`` overflows 16-bit compute for token counts), and
  ``unit * sum_i (w_i / unit) g_i`` is ``sum_i w_i g_i`` with nothing rounded by the scaling
  (a power of two). 1 for a total that is not finite and positive (a void window)."""
  total = total * devices
  _, exponent = jnp.frexp(total)  # total = m 2^exponent, 0.5 <= m < 1
  ok = jnp.isfinite(total) & (total > 0)
  return jnp.where(ok, jnp.ldexp(jnp.ones((), jnp.float32), exponent), 1.0)


# Why a step carries each micro-batch's gradient instead of adding it in place: the key is in the
# name of a scope around the carried backward pass, so ga.inspect_step reads it from the program.
CARRIED_SCOPE = "ga_grads_carried__"
CARRIED_BECAUSE = {
  "option": "grads_in_place=False",
  "jax": "this JAX has no gradient Refs: jax >= 0.11 adds in place",
  "noise": "the noise scale needs each micro-batch's gradient",
  "per_microbatch": "gather_params='per_microbatch' reduce-scatters each micro-batch's gradient",
  "fp8": "fp8 scales each micro-batch's gradient back",
  "dtype": "an accumulator leaf's dtype differs from its param's (float32 sums of 16-bit params)",
  "running_mean": "a 16-bit accumulator keeps a running mean",
  "narrow_loss": "a weighted loss narrower than float32 would round each weight in its seed",
  "streaming": "micro_step adds in place only when donated and without a mesh",
  "privacy": "DP clips each example's gradient before it is summed",
}


@dataclasses.dataclass(frozen=True)
class Fp8:
  """Params partly overwritten (``ov``, :class:`_parts.Overwritten`: Flax's fp8 collection)
  under accumulation: each micro-batch's loss scaled by ``w / total`` before it is
  differentiated (the whole batch's cotangent, which the output-gradient amax sees), its
  gradient scaled back for the sums (``w g``), and the overwritten part's "gradient", its new
  value, handed on as an aux leaf that ``"max_all"`` reduces."""

  ov: Overwritten
  total: jax.Array  # the window's total weight, over the devices too

  @classmethod
  def make(cls, ov, weighting: Any, batch: Any, k: int, num: Any, vary: tuple) -> Fp8:
    """The window's total weight, known before the loop (the real micro-batches' weights)."""
    if not weighting.weighted:
      return cls(ov, jnp.asarray(num, jnp.float32) * (jax.lax.psum(1, vary) if vary else 1))
    total = window_weight(weighting, batch, k, num)
    return cls(ov, jax.lax.psum(total, vary) if vary else total)

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


def trained_window(w: Window, ov: Overwritten, reducers: AuxReducers) -> Window:
  """The window of the trained params (``w``'s sums of all the params): the overwritten part's
  reduced "gradient", its new value, in ``overwrite``."""
  (aux, new), (aux_like, _) = w.sums.aux, w.aux_like
  sums = w.sums._replace(grads=ov.split(w.sums.grads)[0], aux=aux)
  parts = (sums, *w.parts[1:])
  return w._replace(parts=parts, aux_like=aux_like, reducers=reducers, overwrite=new)


def _in_place_refs(acc, weighting, batch, k, num, vary) -> tuple[Any, jax.Array | None]:
  """``(Refs holding acc, the seed's normalizer)`` for backward passes that add into them;
  weighted, the Refs hold ``acc / norm`` and micro-batch i's seed is ``w_i / norm``
  (:func:`seed_unit`: the whole batch's scale); unweighted, ``acc`` and None (seeds of 1)."""
  norm = None
  if weighting.weighted:
    devices = jax.lax.psum(1, vary) if vary else 1
    norm = seed_unit(window_weight(weighting, batch, k, num), devices)
  inverse = None if norm is None else 1 / norm
  return jax.tree.map(lambda a: jax.new_ref(_scaled(a, inverse)), acc), norm


def _scaled(x: jax.Array, factor: jax.Array | None) -> jax.Array:
  """``x * factor`` in ``x``'s dtype; ``x`` itself for no factor (an unweighted window)."""
  return x if factor is None else x * factor.astype(x.dtype)


def _add_into(objective: Callable[[Any], Any], refs: Any, params: Any, w: Any) -> Any:
  """``(loss, aux, new_model_state)`` of one micro-batch whose gradient of ``objective(params)``
  (:meth:`_options.Options.objective` on it), weighted by ``w`` (the backward pass's seed), is
  added into ``refs``; weighted, a micro-batch of weight ``<= 0`` runs forward only, so even a
  NaN adds nothing."""

  # The params are the branches' operand, not a constant they close over: a loss that runs an
  # nnx.scan must find them at the branch's trace level.
  @jax.named_scope(IN_PLACE_SCOPE)  # how ga.inspect_step tells (StepReport.grads_in_place)
  def run(p):
    out, vjp_fn, rest = jax.vjp(objective, p, has_aux=True)
    seed = jnp.ones_like(out) if w is None else jnp.broadcast_to(w.astype(out.dtype), out.shape)
    vjp_fn.with_refs(refs)(seed)
    return rest

  def forward_only(p):
    return objective(p)[1]

  return run(params) if w is None else jax.lax.cond(w > 0, run, forward_only, params)


@dataclasses.dataclass(frozen=True)
class MicroPass:
  """One micro-batch's forward and backward pass: ``(i, model_state) -> Micro``; its gradient
  carried, or (``refs``) added into the Refs, seeded by ``w_i / norm`` (weighted)."""

  opts: Options
  inputs: Inputs  # the params (device-varying on a mesh) and the window's batch
  k: int
  per_micro: Any = None  # a _sharding.PerMicrobatch: params gathered per micro-batch
  fp8: Fp8 | None = None
  why: str | None = None  # why the gradient is carried (a key of CARRIED_BECAUSE)
  refs: Any = None
  norm: jax.Array | None = None

  def __call__(self, i: Any, start: Any) -> Micro:
    scale, opts, fp8 = self.inputs.scale, self.opts, self.fp8
    p, mb, key = self.take(i)
    if opts.privacy is not None:  # each example's gradient clipped (_privacy)
      return opts.privacy.micro(opts, p, start, mb, key)
    w = opts.weighting.of(mb)
    if opts.terms is not None:  # per-term weights: the terms of weight 0 checked first
      return self.by_term(p, start, mb, key, w)
    if self.refs is not None:  # added in place: the units see no gradient
      seed = None if self.norm is None else w / self.norm
      objective = functools.partial(opts.objective, model_state=start, mb=mb, key=key, scale=scale)
      loss, aux, new_state = _add_into(objective, self.refs, p, seed)
      return Micro(loss, aux, (), w, new_state)
    seed = scale if fp8 is None else fp8.seed(w, scale)
    grad_fn = jax.value_and_grad(opts.objective, has_aux=True)
    with jax.named_scope(CARRIED_SCOPE + (self.why or "")):  # ga.inspect_step reads why
      (_, (loss, aux, new_state)), grads = grad_fn(p, start, mb, key, seed)
    if fp8 is not None:
      grads, aux = fp8.split(grads, aux, w)
    return Micro(loss, aux, grads, w, new_state)

  def take(self, i: Any) -> tuple:
    """``(params, microbatch, key)`` of micro-batch ``i``, as its loss gets them."""
    params, batch, rng = self.inputs[:3]
    key = None if rng is None else jax.random.fold_in(rng, i)
    p = params if self.per_micro is None else self.per_micro.gather(params, i)
    return p, microbatch(batch, i, self.k), key

  def by_term(self, p: Any, start: Any, mb: Any, key: Any, w: jax.Array) -> Micro:
    """A micro-batch of a loss with per-term weights (``_terms``): one backward pass where every
    term of weight 0 is finite, else one per term of positive weight, each from a forward pass
    of its own. An empty term's 0 / 0 is NaN, and so is its backward pass even at a cotangent of
    0: a term of weight 0 then adds nothing, as a micro-batch of weight 0 adds nothing. The
    gradient is added into the Refs in place, or carried."""
    opts, fp8, in_place = self.opts, self.fp8, self.refs is not None
    scale = self.inputs.scale
    scale = scale if in_place or fp8 is None else fp8.seed(w, scale)  # the objective's factor
    _, coef, _ = opts.terms.shares(mb)

    def f(q: Any, only: str | None = None, checked: bool = False) -> Any:
      return opts.objective(q, start, mb, key, scale, only=only, checked=checked)

    def backward(out: jax.Array, vjp_fn: Any) -> Any:
      seed = jnp.ones_like(out) if not in_place else (w / self.norm).astype(out.dtype)
      if not in_place:
        return vjp_fn(seed)[0]
      vjp_fn.with_refs(self.refs)(seed)
      return ()

    def nothing(q) -> Any:
      return () if in_place else jax.tree.map(jnp.zeros_like, q)

    # The params are each branch's operand (an nnx.scan in the loss needs them at its level).
    def one(t: str, q: Any) -> Any:  # term t alone: its backward pass reads no other term
      def run(q):
        out, vjp_fn = jax.vjp(lambda q: f(q, only=t)[0], q)
        return backward(out, vjp_fn)

      return jax.lax.cond(coef[t] > 0, run, nothing, q)

    def each(q) -> Any:
      if in_place:  # each term's backward pass adds into the Refs
        for t in opts.terms.names:
          one(t, q)
        return ()
      # Carried: a loop over the terms, one term's gradient held at a time beside the sum (in
      # place, the same loop made XLA hold one more accumulator: benchmarks/window_inputs.py).
      branches = [lambda q, t=t: one(t, q) for t in opts.terms.names]

      def body(j: Any, total: Any) -> Any:
        return jax.tree.map(jnp.add, total, jax.lax.switch(j, branches, q))

      return jax.lax.fori_loop(0, len(branches), body, nothing(q))

    scope = IN_PLACE_SCOPE if in_place else CARRIED_SCOPE + (self.why or "")
    with jax.named_scope(scope):  # ga.inspect_step reads the path
      out, vjp_fn, (loss, aux, new_state, clean) = jax.vjp(
        lambda q: f(q, checked=True), p, has_aux=True
      )
      grads = jax.lax.cond(clean, lambda _: backward(out, vjp_fn), each, p)
    if fp8 is not None:
      grads, aux = fp8.split(grads, aux, w)
    return Micro(loss, aux, grads, w, new_state)


@dataclasses.dataclass(frozen=True)
class MicrobatchedGrad:
  """The core: a loss function's window sums over the ``k`` micro-batches of a batch."""

  options: Options
  num_microbatches: int
  noise_sums: bool = False  # also sum w_i |g_i|^2 for the noise scale (Window.noise)
  overwrite: Overwritten | None = None  # params partly overwritten (fp8: _flax), else None

  def carried_because(self, params, acc_init, per_micro, loss: Callable[[], Any]) -> str | None:
    """None if the backward pass adds each gradient into the accumulator in place
    (``jax.vjp(...).with_refs``, docs/models.md, "Stacked layers"), else why not (a key of
    ``CARRIED_BECAUSE``): ``grads_in_place`` allows it, JAX has it (0.11 or later), no unit needs
    a micro-batch's own gradient, each accumulator leaf has its param's dtype and, weighted, the
    loss value (``loss()``, abstract, traced only then) is float32 or wider (a narrower one rounds
    the seed)."""
    if not self.options.grads_in_place:
      return "option"
    if not refs_available():
      return "jax"
    for why, needs in (
      ("privacy", self.options.privacy is not None),
      ("noise", self.noise_sums),
      ("per_microbatch", per_micro is not None),
      ("fp8", self.overwrite is not None),
      ("running_mean", keeps_running_means(acc_init)),  # a narrow float keeps a mean, not a sum
    ):
      if needs:
        return why
    # A Ref takes the cotangent's dtype and sharding type: each param's.
    types = [(jnp.result_type(x), jax.typeof(x).sharding) for x in jax.tree.leaves(params)]
    if types != [(jnp.result_type(x), jax.typeof(x).sharding) for x in jax.tree.leaves(acc_init)]:
      return "dtype"
    if self.options.weighting.weighted and jnp.finfo(loss().dtype).bits < 32:
      return "narrow_loss"
    return None

  def sums(self, inputs: Inputs, acc_init: Any, in_buffer=False, overwrite=None) -> Window:
    """The window sums of ``inputs.batch``, its gradients added to ``acc_init`` (zeros for a
    running mean leaf); on the mesh if set, where the scan starts from ``acc_init`` only with
    ``in_buffer`` (a donated step's accumulator) and where a device holds its share, else adds
    it after. ``overwrite``: the params' overwritten part (``_parts.overwritten``), if any."""
    params, dp, ov = inputs.params, self.options.parallel, overwrite
    check_trainable(params, where=self.options.where)
    core = self if ov is None else dataclasses.replace(self, overwrite=ov)
    if ov is not None and self.options.privacy is not None:
      raise ValueError(
        f"{self.options.where}: the params hold {ov.name}, whose window value reads every"
        " example: a DP transformation (ga.dp_accumulate) does not take it. Train without it."
      )
    if ov is not None:  # its zeros beside the trained params' sums
      acc_init = ov.join(params, acc_init, jax.tree.map(jnp.zeros_like, ov.split(params)[1]))
    if dp is None:
      w = core.local_sums(inputs, acc_init)
    else:
      w = over_mesh(dp, core, inputs, acc_init, in_buffer)
    return w if ov is None else trained_window(w, ov, self.reducers)

  def terms(self, opts: Options, inputs: Inputs, take: Callable, *, num: Any, vary: tuple) -> Terms:
    """The loss's terms (its output on micro-batch 0 of ``inputs``, shapes only) and their
    window totals; ``take``: a micro-batch's params, rows and key (:meth:`MicroPass.take`)."""
    p, mb, key = take(0)
    out = jax.eval_shape(lambda: opts.loss.call(p, inputs.model_state, mb, key, opts.stats)[0])
    keys = jax.eval_shape(lambda m: Static(tuple(opts.weighting.fn(m))), mb).value
    names = names_of(out, keys, opts.where)
    if opts.where == "micro_step":
      raise TypeError(refused(opts.where, list(names)))
    k = self.num_microbatches
    return Terms.make(
      names, opts.weighting.fn, inputs.batch, k=k, num=num, vary=vary, split=microbatch
    )

  def units(self, model_state: Any, acc_init: Any, per_micro: Any = None) -> tuple:
    """The window's units, in the order of ``Window.parts``: :meth:`summed_units` (the sums
    reduce-scattered per micro-batch with ``per_micro``), the model state (:class:`Off`
    without ``has_state``) and those of :data:`UNITS`."""
    sums, noise = self.summed_units(acc_init)
    sums = sums if per_micro is None else per_micro.wrap(sums)
    opts, model = self.options, Off(None)
    if opts.has_state:
      model = ModelStateUnit.make(model_state, opts.batchnorm, opts.batchnorm_momentum)
    return sums, noise, model, *(make(self) for make in UNITS)

  def summed_units(self, acc_init: Any) -> tuple:
    """The units whose parts are sums (an open window's state keeps them): the gradient, loss
    and aux sums and the noise sums (:class:`Off` when off); ``acc_init``: the accumulator the
    sums start from (its dtypes)."""
    weighting = self.options.weighting
    sums = SumsUnit(weighting, self.reducers, jax.tree.map(jnp.result_type, acc_init))
    return sums, NoiseUnit(weighting) if self.noise_sums else Off()

  @property
  def reducers(self) -> AuxReducers:
    """The aux reducers; fp8: of ``(aux, the overwrite collection's gradient)``, max over all."""
    if self.overwrite is None:
      return self.options.aux_reduce
    return AuxReducers((self.options.aux_reduce.spec, "max_all"))

  def local_sums(self, inputs: Inputs, acc_init: Any, *, vary=(), per_micro=None, carried=None,
                 units=None):  # fmt: skip
    """The scan on one device (in ``shard_map`` with ``vary``, the manual data axes), the
    gradients added in place unless ``carried`` or :meth:`carried_because` says why not; with
    ``per_micro`` (a ``_sharding.PerMicrobatch``) the params are shards, gathered for each
    micro-batch, and the gradients are reduced into an accumulator shaped like the shards."""
    params, batch, rng, model_state, scale, num_real = inputs
    k, opts, ov = self.num_microbatches, self.options, self.overwrite
    rows = check_batch(batch, k) // k
    num = k if num_real is None else num_real
    take = MicroPass(opts, inputs, k, per_micro).take
    if opts.window_stats is not None:  # a forward-only pass over the window, before its loop
      stats = opts.window_stats.window(
        take, opts.weighting, model_state, k=k, num=num, vary=vary, dtype=opts.compute_dtype
      )
      opts = dataclasses.replace(opts, stats=stats)
    if per_term(opts.weighting.fn, take(0)[1]):  # every term's window total, before the loop
      opts = opts.for_window(self.terms(opts, inputs, take, num=num, vary=vary))
    fp8 = None if ov is None else Fp8.make(ov, opts.weighting, batch, k, num, vary)
    if vary:  # per-device gradients: no psum of the cotangents inside the loop
      params = to_varying(params, vary)
    if units is None:  # Window.parts' order; a caller that reduces them passes its own
      units = self.units(model_state, acc_init, per_micro)
    model_unit = units[2]  # gives each micro-batch the model state it starts from
    one = MicroPass(opts, inputs._replace(params=params), k, per_micro, fp8)
    if vary:  # inside the step's shard_map over the data axes, where a loss's own is refused
      like = shapes_refusing_nested_shard_map(one, (0, model_state), vary, opts.where)
    else:
      like = jax.eval_shape(one, 0, model_state)

    init = tuple(unit.init(acc_init, like) for unit in units)
    if vary:
      init = to_varying(init, vary)
    refs = norm = None
    why = carried or self.carried_because(params, acc_init, per_micro, lambda: split(like.loss)[0])
    if why is None:  # the gradients added into Refs
      refs, norm = _in_place_refs(init[0].grads, opts.weighting, batch, k, num, vary)
      init = (init[0]._replace(grads=()), *init[1:])
    one = dataclasses.replace(one, why=why, refs=refs, norm=norm)

    def body(c: tuple, i) -> tuple[tuple, None]:  # the carry: one part per unit
      m = one(i, model_unit.start(c[2]))
      return tuple(unit.update(part, m) for unit, part in zip(units, c, strict=True)), None

    if k == 1 and num_real is None:  # one micro-batch (ga.micro_step): no loop around it
      c = body(init, jnp.zeros((), jnp.int32))[0]
    elif num_real is None:  # a fixed trip count: a scan, ``unroll`` micro-batches per trip
      unroll = min(opts.unroll, k)
      with jax.named_scope(f"{UNROLL_SCOPE}{unroll}") if unroll > 1 else contextlib.nullcontext():
        c, _ = jax.lax.scan(body, init, jnp.arange(k), unroll=unroll)
    else:  # only the first num_real micro-batches run; the others are not computed
      c = jax.lax.fori_loop(0, num_real, lambda i, c: body(c, i)[0], init)
    if refs is not None:
      grads = jax.tree.map(lambda r: _scaled(jax.freeze(r), norm), refs)
      c = (c[0]._replace(grads=grads), *c[1:])
    parts = tuple(unit.finalize(part, num, rows) for unit, part in zip(units, c, strict=True))
    before = {"window_stats": opts.stats} if opts.window_stats is not None else {}
    if opts.terms is not None:
      before["term_weights"] = opts.terms.totals
    return Window(parts, like.loss, like.aux, num, self.reducers, before=before or None)


def value_and_grad(
  loss_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  has_aux: bool = False,
  weight_fn: Callable[[Any], Any] | None = None,
  accum_dtype: Any = jnp.float32,
  has_state: bool = False,
  batchnorm: str = "sequential",
  batchnorm_momentum: float | None = None,
  compute_dtype: Any = None,
  mesh: Any = None,
  data_axis: str | tuple[str, ...] | None = None,
  param_specs: Any = None,
  gather_params: str = "once",
  grads_in_place: bool = True,
  aux_reduce: Any = None,
  window_stats: Callable[..., Any] | None = None,
  window_stats_reduce: Any = None,
  unroll: int | str = 1,
) -> Callable[..., Any]:
  r"""Like ``jax.value_and_grad`` over a whole batch, computed one micro-batch at a time.

  A ``lax.scan`` over the ``k`` micro-batches of :func:`microbatch` sums their weighted losses
  and gradients, holding one micro-batch's activations: :math:`L = \sum_i w_i L_i / \sum_i w_i`
  and :math:`G = \sum_i w_i \nabla L_i / \sum_i w_i` (``w_i`` 1, or ``weight_fn``'s: with token
  counts, ``L`` is the token mean). A weight-0 micro-batch adds nothing, even NaN.

  Args:
    loss_fn: ``loss_fn(params, microbatch[, rng])``, the micro-batch's mean loss (a dict: terms,
      docs/usage.md), or ``(loss, aux)`` with ``has_aux`` (float aux averaged, integer summed).
    num_microbatches: ``k``, a positive int that divides the batch size.
    weight_fn: ``microbatch -> scalar`` weight (e.g. non-padding tokens; a dict: per term).
    window_stats, window_stats_reduce: ``stats_fn(params, microbatch)`` reduced over the window
      first, then ``loss_fn(params, microbatch, stats)`` (docs/models.md, "Mixture of experts").
    accum_dtype: the accumulator's dtype (float32; ``None``: the gradients').
    has_state: ``loss_fn(params, model_state, microbatch[, rng]) -> (loss, new_state)``.
    batchnorm, batchnorm_momentum: with ``has_state``, how BatchNorm statistics update:
      ``"sequential"``, ``"per_window"`` or ``"frozen"`` (docs/models.md).
    compute_dtype: float params are cast to it (e.g. ``jnp.bfloat16``) before ``loss_fn``.
    mesh, data_axis, param_specs, gather_params, grads_in_place, aux_reduce, unroll: as in
      :func:`train_step` (call under jit; ``unroll`` an int).

  Returns:
    ``(params, batch, rng=None, *, num_real_microbatches=None) -> (loss, grads)``
    (``((loss, aux), grads)`` with ``has_aux``; with ``has_state``, ``model_state`` after
    ``params`` and ``(loss, new_model_state)``); micro-batch ``i`` gets ``fold_in(rng, i)``.

  Raises:
    TypeError, ValueError: for a bad ``k`` or mesh, a batch ``k`` does not divide, a bad loss.

  Examples:
    >>> import jax, jax.numpy as jnp, gradaccum_jax as ga
    >>> loss_fn = lambda w, batch: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> batch = {"x": jnp.arange(16.0).reshape(8, 2) / 8, "y": jnp.ones(8)}
    >>> w = jnp.array([0.5, -0.5])
    >>> loss, grads = ga.value_and_grad(loss_fn, num_microbatches=4)(w, batch)
    >>> ref_loss, ref_grads = jax.value_and_grad(loss_fn)(w, batch)
    >>> bool(jnp.allclose(loss, ref_loss)), bool(jnp.allclose(grads, ref_grads))
    (True, True)
  """
  k = check_num_microbatches(num_microbatches, allow_schedule=False)
  if accum_dtype is not None:
    accum_dtype = jnp.dtype(accum_dtype)
  for name, value, instead in (
    ("gather_params", gather_params, "'once' or 'per_microbatch'"),
    ("unroll", unroll, "an int"),
  ):
    if isinstance(value, str) and value == "auto":
      raise ValueError(
        f"value_and_grad: {name}='auto' compiles each candidate, which needs the jitted step of"
        f" ga.train_step; pass {instead}."
      )
  opts = make_options(
    "value_and_grad", loss_fn, has_aux=has_aux, weight_fn=weight_fn, has_state=has_state,
    batchnorm=batchnorm, batchnorm_momentum=batchnorm_momentum, compute_dtype=compute_dtype,
    mesh=mesh, data_axis=data_axis, param_specs=param_specs, gather_params=gather_params,
    grads_in_place=grads_in_place, aux_reduce=aux_reduce, window_stats=window_stats,
    window_stats_reduce=window_stats_reduce, unroll=unroll,
  )  # fmt: skip
  mg = MicrobatchedGrad(opts, k)

  def vg_state(params, model_state, batch, rng=None, *, num_real_microbatches=None):
    num_real = check_real_microbatches(num_real_microbatches, k)
    # params partly overwritten (fp8): that part's "gradient" is its window's new value
    ov = overwritten(params, "value_and_grad")
    trained = params if ov is None else ov.split(params)[0]
    zeros = zeros_accumulator(trained, accum_dtype)
    w = mg.sums(Inputs(params, batch, rng, model_state, None, num_real), zeros, overwrite=ov)
    grads = jax.tree.map(
      lambda a, p: a.astype(jnp.result_type(p)), mean_of(w.sums.grads, w.sums.weight), trained
    )
    grads = grads if ov is None else ov.join(params, grads, w.overwrite)
    loss, aux, _ = w.means()
    return opts.loss.pack(loss, aux, w.model_state), grads

  def vg(params, batch, rng=None, *, num_real_microbatches=None):
    return vg_state(params, None, batch, rng, num_real_microbatches=num_real_microbatches)

  return vg_state if has_state else vg
