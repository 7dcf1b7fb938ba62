"""``inspect_step``: what a compiled step communicates (collectives in and after its loops), which
loop is the window's, and what it holds."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import traceback
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax

from gradaccum_jax._checks import check_int
from gradaccum_jax._microbatch import (
  CARRIED_BECAUSE,
  CARRIED_SCOPE,
  IN_PLACE_SCOPE,
  STATS_SCOPE,
  UNROLL_SCOPE,
  WINDOW_SCOPE,
)

# The collectives, named as in HLO; an async pair (``all-gather-start``/``-done``) is one op.
KINDS = (
  "all-reduce", "reduce-scatter", "all-gather", "all-to-all", "ragged-all-to-all",
  "collective-permute", "collective-broadcast",
)  # fmt: skip
# A computation: its header line, ending in "{", then its lines up to one starting with "}".
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s[^\n]*\{ *\n(.*?)^\}", re.M | re.S)
_CALLED = re.compile(
  r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)"
  r"|(?:branch_computations|called_computations)=\{([^}]*)\}"
)
_OP = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start|-done)?\(")
_WHILE = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=.*?\swhile\(")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CARRIED = re.compile(CARRIED_SCOPE + r"(\w+)")
_UNROLL = re.compile(UNROLL_SCOPE + r"(\d+)")
_ARRAY = re.compile(r"\b[a-z]+(\d*)[a-z0-9]*\[([\d,]*)\]")  # (bits of the dtype, dims)
# Where each op was written: its ``stack_frame_id=`` in the module's tables of frames and files.
_TABLE = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(.*?)\n\n", re.M | re.S)
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_LOCATION = re.compile(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")
# The loops the package names (its scopes): the window's scan, the window statistics' pass.
_OWN = re.compile(rf'op_name="[^"]*/({WINDOW_SCOPE}|{STATS_SCOPE})/(?:{UNROLL_SCOPE}\d+/)?while"')
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
ROLES = {"window": "the window's micro-batch loop", "statistics": "the window statistics' pass",
         "package": "another of the package's", "model": "the model's own",
         "other": "the program's own"}  # fmt: skip
_BACKWARD = re.compile(f"{IN_PLACE_SCOPE}|{CARRIED_SCOPE}")  # a micro-batch's pass: the model's


def _computations(hlo_text: str) -> dict[str, list[str]]:
  """``{computation name: its instruction lines}`` of an HLO module's text."""
  return {m[1]: m[2].splitlines() for m in _COMPUTATION.finditer(hlo_text)}


def _called(line: str) -> list[str]:
  """The computations an instruction calls: a loop's body and condition, branches, fusions..."""
  return [n.strip().lstrip("%") for m in _CALLED.findall(line) for n in "".join(m).split(",")]


def _closure(comps: dict[str, list[str]], names: list[str]) -> set[str]:
  """``names`` and every computation they call, transitively."""
  stack, seen = list(names), set()
  while stack:
    name = stack.pop()
    if name not in seen and name in comps:
      seen.add(name)
      stack.extend(c for line in comps[name] for c in _called(line))
  return seen


def _reachable(comps: dict[str, list[str]], op: str) -> set[str]:
  """The computations every ``op`` (``while``, ``conditional``) calls, and all they call."""
  return _closure(
    comps, [c for ls in comps.values() for ln in ls if f" {op}(" in ln for c in _called(ln)]
  )


def _shapes_and_bytes(result_type: str) -> tuple[tuple[tuple[int, ...], ...], int]:
  """'(f32[16]{0}, bf16[2,3]{1,0})' -> (((16,), (2, 3)), 76): shapes, and bytes of all."""
  arrays = _ARRAY.findall(result_type)
  shapes = tuple(tuple(int(d) for d in dims.split(",") if d) for _, dims in arrays)
  bits = [int(b or 8) for b, _ in arrays]  # 8 for pred and token
  return shapes, sum(math.prod(s) * n // 8 for s, n in zip(shapes, bits, strict=True))


class Collective(NamedTuple):
  """One collective op of a compiled program (see :class:`StepReport`)."""

  kind: str  # as in HLO: "all-reduce", "all-gather", ...
  name: str  # the instruction's name
  computation: str  # the computation it is in
  shapes: tuple[tuple[int, ...], ...]  # of its result (one per operand of a tuple op)
  bytes: int  # its result's size on one device, per execution
  in_loop: bool  # in a while loop's body or condition, or something they call
  in_branch: bool  # in a conditional's branch, or something it calls
  text: str  # its HLO line (replica groups, channel, ...)


class Loop(NamedTuple):
  """One while loop of a compiled program: its trip count (None when not static), its role."""

  name: str
  computation: str
  trip_count: int | None
  nested: bool  # inside another loop
  role: str | None = None  # a key of ROLES; None where the program does not say
  source: str | None = None  # "file:line (function)" where it was written


def _loops(comps: dict[str, list[str]], text: str) -> tuple[Loop, ...]:
  """Every while loop, where it was written (its innermost stack frame) and its role."""
  t = {m[1]: dict(r.split(" ", 1) for r in m[2].splitlines()) for m in _TABLE.finditer(text)}

  def source(line: str) -> tuple[str, str, str] | None:  # (file, function, line number)
    frame = (m := _FRAME.search(line)) and t.get("StackFrames", {}).get(m[1])
    if not frame:
      return None
    loc = _LOCATION.search(t["FileLocations"][re.search(r"location_id=(\d+)", frame)[1]])
    return t["FileNames"][loc[1]].strip('"'), t["FunctionNames"][loc[2]].strip('"'), loc[3]

  found = [  # (name, computation, trips, the computations it runs, source, its HLO line)
    (m[1], comp, _TRIPS.search(line), _closure(comps, _called(line)), source(line), line)
    for comp, lines in comps.items() for line in lines if (m := _WHILE.match(line))
  ]  # fmt: skip
  own = {f[0]: {WINDOW_SCOPE: "window", STATS_SCOPE: "statistics"}[m[1]]
         for f in found if (m := _OWN.search(f[5]))}  # fmt: skip
  out = []
  for name, comp, trips, _, src, line in found:
    outer = {own.get(f[0]) for f in found if comp in f[3]}  # the roles of the loops around it
    role = own.get(name) or _role(src, outer, bool(_BACKWARD.search(line)))
    where = src and f"{src[1]}, {os.path.basename(src[0])}:{src[2]}"
    out.append(Loop(name, comp, trips and int(trips[1]), bool(outer), role, where))
  return tuple(out)


def _role(src: tuple | None, outer: set, backward: bool) -> str | None:
  """The ROLES key of a loop the package did not name, from where it was written and whether
  one of the package's loops runs it."""
  if src is None:
    return None
  if src[0].startswith(_PACKAGE):
    return "package"
  return "model" if outer & {"window", "statistics"} or backward else "other"


# What to do about a collective over budget (check's message): in a loop, and outside loops.
_IN_LOOP = (
  "move the collectives in a loop out of it (reduce once per window, e.g."
  " ga.train_step(..., mesh=mesh))"
)
_AFTER_LOOP = (
  "the ops outside loops run once per window already; an all-reduce has one dtype and one"
  " reduction, so a step takes one per dtype and reduction it needs. A ga step takes one for its"
  " sums (the loss, the gradients, aux sums and means, integer sums carried in its float32, float"
  " model state averaged) and at most one more for each of: the window statistics (window_stats=,"
  " reduced before the loop): their sums and means, each dtype of their maxima and of their"
  " minima; the per-term totals (a weight_fn returning a dict, summed before the loop); each"
  " dtype of aux maxima and of aux minima; each dtype of integer and key model state (maxed; bool"
  " as int32). Raise max_after_loop to the count listed"
)


@dataclasses.dataclass(frozen=True)
class StepReport:
  """What a compiled step communicates and holds: the result of :func:`inspect_step`.

  Attributes:
    collectives: every collective op, a :class:`Collective`; ``bytes`` is its result's size on
      one device per execution (docs/verifying.md). An op in a loop runs once per trip.
    loops: every while loop, a :class:`Loop` with its ``role`` (``ROLES``); ``window_loop`` is
      the window's micro-batch loop, None without one.
    in_loop, after_loop: ``{kind: number of ops}`` inside the while loops and outside them;
      ``in_loop_bytes``, ``after_loop_bytes``: the bytes they move per execution.
    temp_bytes, argument_bytes, output_bytes, alias_bytes: ``compiled.memory_analysis()`` per
      device (None if the backend has none); ``peak_bytes``: temp + arguments + outputs - alias.
    grads_in_place: whether the backward pass adds the gradients into the accumulator in place.
    carried_because: for a ``ga`` step whose gradients are carried, why; else None.
    unroll: for a ``ga`` step, the micro-batches per trip of its loop; None for another program.
  """

  collectives: tuple[Collective, ...]
  loops: tuple[Loop, ...]
  temp_bytes: int | None
  argument_bytes: int | None
  output_bytes: int | None
  alias_bytes: int | None
  grads_in_place: bool = False
  carried_because: str | None = None
  unroll: int | None = None

  @classmethod
  def from_compiled(cls, compiled: Any) -> StepReport:
    """The report of a ``jax.stages.Compiled``: its HLO text and memory analysis."""
    text = compiled.as_text()
    comps = _computations(text)
    loops, branches = _reachable(comps, "while"), _reachable(comps, "conditional")
    found = []
    for comp, lines in comps.items():
      for m in filter(None, map(_OP.match, lines)):
        if m[4] != "-start":  # counted at its -done
          where = (comp in loops, comp in branches, m.string.strip())
          found.append(Collective(m[3], m[1], comp, *_shapes_and_bytes(m[2]), *where))
    mem = compiled.memory_analysis()
    parts = ("temp", "argument", "output", "alias")
    sizes = [None if mem is None else int(getattr(mem, f"{p}_size_in_bytes")) for p in parts]
    in_place = IN_PLACE_SCOPE in text
    why = None if in_place or not (m := _CARRIED.search(text)) else CARRIED_BECAUSE.get(m[1])
    unrolled = _UNROLL.search(text)
    unroll = int(unrolled[1]) if unrolled else (1 if in_place or CARRIED_SCOPE in text else None)
    return cls(tuple(found), _loops(comps, text), *sizes, in_place, why, unroll)

  def _sum(self, in_loop: bool, bytes_: bool) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in (c for c in self.collectives if c.in_loop == in_loop):
      out[c.kind] = out.get(c.kind, 0) + (c.bytes if bytes_ else 1)
    return out

  in_loop = property(lambda self: self._sum(True, False))
  after_loop = property(lambda self: self._sum(False, False))
  in_loop_bytes = property(lambda self: self._sum(True, True))
  after_loop_bytes = property(lambda self: self._sum(False, True))

  @property
  def window_loop(self) -> Loop | None:
    return next((lp for lp in self.loops if lp.role == "window"), None)

  @property
  def peak_bytes(self) -> int | None:
    if self.temp_bytes is not None:
      return self.temp_bytes + self.argument_bytes + self.output_bytes - self.alias_bytes

  def _parts(self) -> str:
    return (
      f"temp {self.temp_bytes}, arguments {self.argument_bytes}, outputs {self.output_bytes},"
      f" aliased {self.alias_bytes}"
    )

  def check(self, max_in_loop: Any = 0, max_after_loop: Any = None, max_peak_bytes=None) -> None:
    """Raises a ValueError naming every collective and byte over budget; for users' tests.

    Args:
      max_in_loop: the most ops of each kind inside loops: an int for every kind,
        ``{kind: count}`` for the kinds named, or None (no limit).
      max_after_loop: the same, outside every loop.
      max_peak_bytes: the most per-device :attr:`peak_bytes`, or None.
    """

    def described(c: Collective) -> str:  # where it is, what it moves and in which dtypes
      dtypes = dict.fromkeys(re.findall(r"([a-z]+[0-9]*)\[", _OP.match(c.text)[2]))
      return f"%{c.name} in %{c.computation} ({c.bytes} bytes) [{', '.join(dtypes)}]"

    problems, advice = [], {}
    for in_loop, value in ((True, max_in_loop), (False, max_after_loop)):
      name, where = ("max_in_loop", "in a loop") if in_loop else ("max_after_loop", "outside loops")
      if value is None:
        continue
      budget = dict(value) if isinstance(value, Mapping) else dict.fromkeys(KINDS, value)
      for kind, n in budget.items():
        if kind not in KINDS:
          raise ValueError(f"{name} names an unknown collective {kind!r}; the kinds are {KINDS}.")
        if check_int(n, f"{name} must give an int count for {kind!r}, got {n!r}.") < 0:
          raise ValueError(f"{name} must give a count >= 0 for {kind!r}, got {n!r}.")
      for kind, count in self._sum(in_loop, False).items():
        if count > budget.get(kind, count):
          ops = [c for c in self.collectives if c.kind == kind and c.in_loop == in_loop]
          listing = ", ".join(map(described, ops))
          problems.append(f"{count} {kind} {where} (allowed {budget[kind]}): {listing}")
          advice[in_loop] = _IN_LOOP if in_loop else _AFTER_LOOP
    if max_peak_bytes is not None:
      if self.peak_bytes is None:
        raise ValueError("max_peak_bytes given, but the backend reports no memory analysis.")
      if self.peak_bytes > max_peak_bytes:
        problems.append(f"peak_bytes={self.peak_bytes} > {max_peak_bytes=} ({self._parts()})")
        advice[None] = "raise max_peak_bytes or hold less (docs/verifying.md)"
    if problems:
      raise ValueError(
        f"The step is over budget; {'; '.join(advice.values())}:\n  " + "\n  ".join(problems)
      )

  def __repr__(self) -> str:
    groups: dict[tuple, list[Loop]] = {}  # the window's loop first, then the package's, ...
    for lp in sorted(self.loops, key=lambda lp: list(ROLES).index(lp.role) if lp.role else 9):
      outside = lp.role in ("model", "other")  # where the model's or optimizer's loop is written
      groups.setdefault((lp.role, lp.source if outside else None), []).append(lp)
    loops = "; ".join(_loop_words(*key, lps) for key, lps in groups.items())
    head = (
      f"StepReport: {len(self.loops)} loop(s){f' ({loops})' if loops else ''}, peak"
      f" {self.peak_bytes} bytes per device ({self._parts()}), gradients"
      f" {'added in place' if self.grads_in_place else 'carried'}"
      f"{f' ({self.carried_because})' if self.carried_because else ''}"
      f"{f', loop unrolled {self.unroll}' if self.unroll and self.unroll > 1 else ''}"
    )
    counts = (self.in_loop, self.in_loop_bytes, self.after_loop, self.after_loop_bytes)
    kinds = [kind for kind in KINDS if kind in counts[0] or kind in counts[2]]
    if not kinds:
      return f"{head}\n  no collectives"
    row = "  {:<20} {:>8} {:>12} {:>11} {:>12}".format
    rows = [row(kind, *(c.get(kind, 0) for c in counts)) for kind in kinds]
    return "\n".join([head, row("collective", "in loop", "bytes", "after loop", "bytes"), *rows])


def _loop_words(role: str | None, source: str | None, loops: list[Loop]) -> str:
  """E.g. "the model's own %while.1, %while.2: 2 trips (model.py:3 (block))"."""
  trips = ", ".join(
    dict.fromkeys("?" if lp.trip_count is None else str(lp.trip_count) for lp in loops)
  )
  names = ", ".join(f"%{lp.name}" for lp in loops)
  return (
    f"{ROLES[role] + ' ' if role else ''}{names}: {trips} trips{f' ({source})' if source else ''}"
  )


def inspect_step(step: Callable[..., Any], *args: Any, **kwargs: Any) -> StepReport:
  """Compiles ``step`` on the given arguments, runs nothing, and reports its collectives and memory.

  Args:
    step: a ``ga`` step, a ``jax.jit`` function (its ``lower`` is used), or a function to jit.
    *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` (with shardings).
    **kwargs: its keyword arguments.

  Returns:
    A :class:`StepReport` (docs/verifying.md); ``report.check(max_in_loop=0)`` raises on a
    collective in a loop.

  Examples:
    >>> import jax, jax.numpy as jnp, gradaccum_jax as ga
    >>> step = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c * 2, None), x, None, 4)[0])
    >>> report = ga.inspect_step(step, jnp.ones(3))
    >>> isinstance(report, ga.StepReport), report.in_loop, report.window_loop
    (True, {}, None)
    >>> [lp.trip_count for lp in report.loops]
    [4]
  """
  if not callable(step):
    raise TypeError(f"step must be a function (a ga step or a jax.jit one), got {step!r}.")
  lower = getattr(step, "lower", None) or jax.jit(step).lower
  try:
    compiled = lower(*args, **kwargs).compile()
  except Exception as e:
    frame, _ = list(traceback.walk_tb(e.__traceback__))[-1]
    if frame.f_globals.get("__name__", "").startswith("gradaccum_jax."):
      raise  # raised by the package's own checks: it names the value and what to change
    raise ValueError(
      f"inspect_step could not lower and compile step={step!r} on the given arguments"
      f" ({type(e).__name__}: {e}); pass the arguments you call it with (arrays or"
      " jax.ShapeDtypeStruct), and keep Python-side work on values out of the step."
    ) from e
  return StepReport.from_compiled(compiled)
