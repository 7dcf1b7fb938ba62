"""Memory policy: a compiled program's bytes per device, the device's budget, and
``gather_params="auto"`` and ``unroll="auto"``, which compile each candidate and run the one
that fits."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def compiled_bytes(analysis: Any) -> int:
  """Per-device bytes of a compiled program: temp + arguments + outputs - aliased outputs."""
  return int(
    analysis.temp_size_in_bytes
    + analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
  )


def memory_analysis(compiled: Any, what: str) -> Any:
  """``compiled.memory_analysis()``, or a RuntimeError naming ``what`` needs it."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    raise RuntimeError(
      f"The {jax.default_backend()} backend returns no compiled.memory_analysis(), so {what}."
    )
  return analysis


def device_memory_budget(device: Any, needs: str) -> int:
  """``device.memory_stats()["bytes_limit"]``, or a ValueError saying what ``needs`` it."""
  stats = device.memory_stats() or {}
  if "bytes_limit" not in stats:
    raise ValueError(
      f"{needs}, but the device ({device.platform}: {device}) reports no memory limit"
      f" (memory_stats() is {stats!r}). Pass memory_budget_bytes=, the bytes per device the"
      " step may use."
    )
  return int(stats["bytes_limit"])


# unroll="auto" without memory_budget_bytes: the largest unroll whose compiled peak is at most
# this fraction above unroll 1's.
UNROLL_MARGIN = 0.10


def unrolls_for(k: int) -> list[int]:
  """The unrolls ``"auto"`` tries for ``k`` micro-batches, largest first: ``k`` and the powers of
  two below it, down to 1."""
  return sorted({2**i for i in range(k.bit_length()) if 2**i <= k} | {k}, reverse=True)


def largest_fitting(candidates: list[int], size: Callable[[int], int], budget: int) -> int | None:
  """The largest of ``candidates`` (unrolls, ascending) whose ``size`` (a compile) is at most
  ``budget``, or None. The last (unroll ``k``: no loop) and the first are compiled; between them
  the peak grows with the unroll, so the search interpolates between a fit and a miss until they
  are neighbours: few compiles (docs/choosing_k.md)."""
  fit, miss = 0, len(candidates) - 1
  if size(candidates[miss]) <= budget or size(candidates[0]) > budget:
    return candidates[miss] if size(candidates[miss]) <= budget else None
  while miss - fit > 1:
    (u0, b0), (u1, b1) = ((candidates[i], size(candidates[i])) for i in (fit, miss))
    line = (
      i for i in range(fit + 1, miss) if b0 + (candidates[i] - u0) * (b1 - b0) / (u1 - u0) <= budget
    )
    guess = max(line, default=fit + 1)
    fit, miss = (guess, miss) if size(candidates[guess]) <= budget else (fit, guess)
  return candidates[fit]


class AutoStep:
  """A jitted step with ``gather_params="auto"`` or ``unroll="auto"``: per signature of its
  arguments (shapes, dtypes, shardings), each gather policy (``"once"`` preferred) compiles at
  unroll 1, and the first with an unroll whose compiled bytes (:func:`compiled_bytes`) fit the
  budget runs at the largest (:func:`largest_fitting`), else the last at unroll 1. Without
  ``memory_budget_bytes``, ``unroll="auto"``'s budget is unroll 1's bytes plus
  :data:`UNROLL_MARGIN`. ``chosen_gather_params``, ``chosen_unroll``, ``gather_params_bytes``
  and ``unroll_bytes`` (of the candidates compiled) tell which and why, running nothing."""

  def __init__(self, build: Callable[[Any, int], Any], gathers: tuple, unroll: Any, budget: Any):
    self._gathers, self._unroll, self.budget = gathers, unroll, budget
    self._step = functools.cache(lambda key: build(*key))  # one jitted step per (gather, unroll)
    self._chosen: dict[Any, tuple[tuple, dict[tuple, int], Any]] = {}

  def _choose(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict]:
    num_real = kwargs.get("num_real_microbatches")
    if num_real is not None:  # as JitStep passes it
      kwargs = {**kwargs, "num_real_microbatches": jnp.asarray(num_real, jnp.int32)}
    leaves, treedef = jax.tree.flatten((args, kwargs))
    avals = [(jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves]
    key = treedef, tuple(avals)
    if key not in self._chosen:
      programs, sizes = {}, {}
      what = "'auto' cannot compare the compiled candidates; pass gather_params and unroll"

      def size(c: tuple) -> int:  # compiles candidate c once
        if c not in sizes:
          programs[c] = self._step(c).lower(*args, **kwargs).compile()
          sizes[c] = compiled_bytes(memory_analysis(programs[c], what))
        return sizes[c]

      unrolls = [self._unroll]
      if self._unroll == "auto":
        unrolls = unrolls_for(self._step((self._gathers[0], 1)).num_microbatches(args))[::-1]
      least = {g: size((g, unrolls[0])) for g in self._gathers}  # each policy at unroll 1
      budget, chosen = self.budget, (self._gathers[-1], unrolls[0])
      for g in self._gathers:
        if self.budget is None:  # unroll="auto" alone: a margin over unroll 1
          budget = int(least[g] * (1 + UNROLL_MARGIN))
        u = largest_fitting(unrolls, lambda u, g=g: size((g, u)), budget)
        if u is not None:
          chosen = g, u
          break
      self._chosen[key] = chosen, sizes, programs[chosen]
    return self._chosen[key], kwargs

  def gather_params_bytes(self, *args: Any, **kwargs: Any) -> dict[str, int]:
    """``{"once": bytes, "per_microbatch": bytes}`` per device for these arguments (each at the
    smallest unroll tried)."""
    sizes = self._choose(args, kwargs)[0][1]
    least = min(u for _, u in sizes)
    return {g: b for (g, u), b in sizes.items() if u == least}

  def chosen_gather_params(self, *args: Any, **kwargs: Any) -> str:
    """The gather policy that runs: ``"once"`` if a candidate of it fits, else
    ``"per_microbatch"``."""
    return self._choose(args, kwargs)[0][0][0]

  def unroll_bytes(self, *args: Any, **kwargs: Any) -> dict[int, int]:
    """``{unroll: bytes}`` per device for these arguments, with the chosen gather policy."""
    (gather, _), sizes, _ = self._choose(args, kwargs)[0]
    return {u: b for (g, u), b in sizes.items() if g == gather}

  def chosen_unroll(self, *args: Any, **kwargs: Any) -> int:
    """The unroll that runs: the largest that fits the budget (else the smallest)."""
    return self._choose(args, kwargs)[0][0][1]

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """The chosen candidate's ``lower`` (for ``ga.inspect_step`` and compiled memory)."""
    return self._step(self._choose(args, kwargs)[0][0]).lower(*args, **kwargs)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    (chosen, _, program), lowered_kwargs = self._choose(args, kwargs)
    step = self._step(chosen)
    if not getattr(step, "calls_compiled", False):  # nnx.jit splits its objects in Python
      return step(*args, **kwargs)
    step.check(args, kwargs)
    return program(*args, **lowered_kwargs)


def gathered(build: Callable[[Any, bool], Any], config: Any, jit: bool) -> Any:
  """Any front end's step: ``build(config, jit)``, or with ``gather_params="auto"`` or
  ``unroll="auto"`` an :class:`AutoStep` over the candidates' jitted steps (``jit=False`` is
  refused: "auto" compiles)."""
  gather = None if config.mesh is None else config.mesh.gather
  if gather != "auto" and config.unroll != "auto":
    return build(config, jit)
  if not jit:
    autos = [
      f"{n}='auto'"
      for n, v in (("gather_params", gather), ("unroll", config.unroll))
      if v == "auto"
    ]
    raise ValueError(
      f"{config.where}: {' and '.join(autos)} compiles the step, so it needs jit=True."
    )
  gathers = ("once", "per_microbatch") if gather == "auto" else (gather,)
  budget = config.mesh.budget if gather == "auto" else config.budget
  return AutoStep(lambda g, u: build(config.chosen(g, u), True), gathers, config.unroll, budget)
