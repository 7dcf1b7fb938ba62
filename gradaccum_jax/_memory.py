"""Memory policy: a compiled program's bytes per device, the device's budget, and
``gather_params="auto"``, which compiles both gather policies and runs the one that fits."""

from __future__ import annotations

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


class AutoGatherStep:
  """A jitted step with ``gather_params="auto"``: per signature of its arguments (shapes, dtypes,
  shardings) both policies compile once; ``"once"`` runs if its compiled memory fits the budget,
  else ``"per_microbatch"``. ``chosen_gather_params(*args)`` tells which, and
  ``gather_params_bytes(*args)`` the bytes of each (:func:`compiled_bytes`), running nothing."""

  def __init__(self, steps: dict[str, Any], budget: int):
    self._steps, self.budget = steps, budget
    self._chosen: dict[Any, tuple[str, dict[str, int], Any]] = {}

  def _choose(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict]:
    num_real = kwargs.get("num_real_microbatches")
    if num_real is not None:  # as JitStep passes it
      kwargs = {**kwargs, "num_real_microbatches": jnp.asarray(num_real, jnp.int32)}
    leaves, treedef = jax.tree.flatten((args, kwargs))
    avals = [(jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves]
    key = treedef, tuple(avals)
    if key not in self._chosen:
      programs = {g: step.lower(*args, **kwargs).compile() for g, step in self._steps.items()}
      what = "gather_params='auto' cannot compare the policies; pass 'once' or 'per_microbatch'"
      sizes = {g: compiled_bytes(memory_analysis(c, what)) for g, c in programs.items()}
      chosen = "once" if sizes["once"] <= self.budget else "per_microbatch"
      self._chosen[key] = chosen, sizes, programs[chosen]
    return self._chosen[key], kwargs

  def gather_params_bytes(self, *args: Any, **kwargs: Any) -> dict[str, int]:
    """``{"once": bytes, "per_microbatch": bytes}`` per device for these arguments."""
    return self._choose(args, kwargs)[0][1]

  def chosen_gather_params(self, *args: Any, **kwargs: Any) -> str:
    """``"once"`` if its compiled memory fits the budget, else ``"per_microbatch"``."""
    return self._choose(args, kwargs)[0][0]

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """The chosen policy's ``lower`` (for ``ga.inspect_step`` and compiled memory)."""
    return self._steps[self.chosen_gather_params(*args, **kwargs)].lower(*args, **kwargs)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    (chosen, _, program), lowered_kwargs = self._choose(args, kwargs)
    step = self._steps[chosen]
    if not getattr(step, "calls_compiled", False):  # nnx.jit splits its objects in Python
      return step(*args, **kwargs)
    step.check(args, kwargs)
    return program(*args, **lowered_kwargs)


def gathered(build: Callable[[Any, bool], Any], opts: Any, jit: bool) -> Any:
  """Any front end's step: ``build(opts, jit)``, or with ``gather_params="auto"`` an
  :class:`AutoGatherStep` over both policies' jitted steps (``jit=False`` is refused: "auto"
  compiles)."""
  if opts.parallel is None or opts.parallel.gather != "auto":
    return build(opts, jit)
  if not jit:
    raise ValueError(f"{opts.where}: gather_params='auto' compiles the step, so it needs jit=True.")
  steps = {g: build(opts.with_gather(g), True) for g in ("once", "per_microbatch")}
  return AutoGatherStep(steps, opts.parallel.budget)
