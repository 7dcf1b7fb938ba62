"""Replays the defects this project fixed, each put back as a patch, against the test suite.

For each ``patches/<id>.patch`` (a minimal semantic mutation of the package that reintroduces one
fixed defect; README.md here says which): a copy of the repository's tree at ``--rev`` (``git
archive``, default HEAD) in a temporary folder, the patch applied with ``git apply``, and the
tests :data:`CASES` names for it run there (``python -m pytest -q -x -p no:cacheprovider
<node ids>``, ``PYTHONPATH`` the copy; the XLA flags of ``tests/conftest.py`` come with the
tests). A mutant is caught when the tests fail, MISSED when they pass. First the same tests run
once on the unpatched copy, where they must pass.

  python tests/mutations/replay.py                  # every patch, its own tests
  python tests/mutations/replay.py ID [ID ...]      # those patches only
  python tests/mutations/replay.py --each           # every listed test run (no -x): which catch
  python tests/mutations/replay.py --all-default    # the whole default run per mutant (slow)
  python tests/mutations/replay.py --args="-m 'not slow' -n 2 -x"  # any pytest arguments instead
  python tests/mutations/replay.py --list           # the patches and their tests

The exit status is 1 if a mutant is missed, a test errs in a way that is not a failure (a node
id no longer collected) or the baseline fails; 0 when every mutant is caught. A patch whose code
path needs a newer JAX than the running interpreter's (``min_jax``: the gradients added in place
need jax >= 0.11) is reported n/a and not run. Not collected by pytest (no ``test_`` name, no
examples in its docstrings); it needs git and the interpreter whose packages the tests use
(``sys.executable``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PATCHES = HERE / "patches"

RELIABILITY = "tests/test_reliability.py::"
FAILURE_TABLE = "tests/test_failure_table.py::test_row"

# id -> the fixing commit, the tests that catch the mutant (the fastest first: -x stops at the
# first failure), and the oldest JAX on which the mutated path runs.
CASES = {
  "micro_step_narrow_accumulator_k_times": dict(
    commit="b147697",
    tests=[
      "tests/test_micro_step.py::test_a_narrow_accumulator_applies_the_window_mean_once[2-bfloat16]",
      "tests/test_micro_step.py::test_a_narrow_accumulator_applies_the_window_mean_once[4-float16]",
    ],
  ),
  "in_place_seed_raw_weight": dict(
    commit="2c1f70d",
    tests=[
      "tests/test_in_place.py::test_float16_with_70000_token_micro_batches_is_not_voided[in_place]",
      "tests/test_in_place.py::test_float16_token_weights_under_a_loss_scale_apply_the_window[in_place]",
    ],
    min_jax=(0, 11),
  ),
  "voided_window_keeps_nan_model_state": dict(
    commit="35194dd",
    tests=[
      "tests/test_mode_matrix.py::test_every_entry_point_equals_the_big_batch_update"
      "[train_step-float32-nomesh-even-state]",
      RELIABILITY
      + "test_a_voided_window_leaves_model_state_params_and_optimizer_state_as_they_were"
      "[sequential-selects]",
      RELIABILITY + "test_a_voided_window_leaves_linen_batch_stats_as_they_were[donated_in_place]",
    ],
  ),
  "float64_loss_summed_in_float32": dict(
    commit="35194dd",
    tests=[
      RELIABILITY + "test_float64_windows_are_float64_exact[3]",
      RELIABILITY + "test_loss_and_aux_are_summed_in_float64_under_x64",
    ],
  ),
  "short_window_per_window_stats_over_k": dict(
    commit="35194dd",
    tests=["tests/test_windows.py::test_num_real_microbatches_with_model_state_per_window"],
  ),
  "micro_step_voided_restores_closing_calls_state": dict(
    commit="1415741",
    tests=[
      "tests/test_micro_step.py::test_a_voided_window_restores_the_model_state_the_window_found"
      "[undonated-0]",
      FAILURE_TABLE + "[a NaN in any micro-batch of a `ga.micro_step` window with model state]",
    ],
  ),
  "narrow_accumulator_sums_and_overflows": dict(
    commit="65ddcf5",
    tests=[RELIABILITY + "test_low_precision_accumulators_keep_the_mean_representable"],
  ),
  "float64_mean_reciprocal_in_float32": dict(
    commit="5965786",
    tests=[
      RELIABILITY + "test_float64_windows_are_float64_exact[3]",
      RELIABILITY + "test_float64_windows_are_float64_exact[6]",
    ],
  ),
  "nan_weight_counted_as_zero": dict(
    commit="35194dd",
    tests=[
      FAILURE_TABLE + "[a NaN or Inf weight]",
      RELIABILITY + "test_a_non_finite_weight_voids_the_window_in_every_mode[nan]",
    ],
  ),
  "nan_term_weight_not_voiding": dict(
    commit="546c9e5",
    tests=[FAILURE_TABLE + "[a NaN or Inf per-term weight]"],
  ),
  "window_stats_not_in_compute_dtype": dict(
    commit="546c9e5",
    tests=[
      RELIABILITY + "test_window_statistics_are_computed_in_the_compute_dtype[train_step]",
      RELIABILITY + "test_window_statistics_are_computed_in_the_compute_dtype[value_and_grad]",
    ],
  ),
  "dp_clip_norm_overflows": dict(
    commit="546c9e5",
    tests=[
      RELIABILITY + f"test_dp_clips_a_finite_gradient_whose_squared_norm_overflows_float32[{e}]"
      for e in ("train_step", "micro_step", "clipped_grad")
    ],
  ),
  "flush_closes_a_dp_window": dict(
    commit="546c9e5",
    tests=[
      RELIABILITY
      + "test_flush_refuses_a_dp_state_and_the_dp_weight_fn_error_says_what_the_flag_means",
      FAILURE_TABLE + "[`ga.flush` on the state of a `ga.dp_accumulate` transformation]",
    ],
  ),
  "in_place_cond_closes_over_params": dict(
    commit="546c9e5",
    tests=[RELIABILITY + "test_a_weighted_loss_over_an_nnx_scan_model[True]"],
    min_jax=(0, 11),
  ),
  "model_state_replicated_over_model_axes": dict(
    commit="e48603f",
    tests=[
      "tests/test_flax_mesh.py::test_linen_step_with_tensor_parallel_batchnorm_matches_the_device"
      "_group_reference[explicit]",
      "tests/test_flax_mesh.py::test_nnx_step_with_tensor_parallel_batchnorm_matches_the_device"
      "_group_reference[explicit]",
    ],
  ),
  "init_accumulator_not_sharded_like_params": dict(
    commit="8ba22a2",
    tests=[
      "tests/test_sharding.py::test_init_shards_the_accumulator_like_the_params[None-None-explicit]",
      "tests/test_sharding.py::test_init_shards_the_accumulator_like_the_params[None-None-auto]",
    ],
  ),
  "tp_scan_carry_zeros_untyped": dict(
    commit="a853269",
    tests=[
      "tests/test_gather_params.py::test_tensor_parallel_params_match_the_big_batch_step"
      "[fsdp_tp_once-explicit]",
      "tests/test_flax_mesh.py::test_linen_step_with_tensor_parallel_params_matches_the_big_batch"
      "_step[fsdp_tp_once-explicit]",
    ],
  ),
  "norm_by_rows_on_a_mesh": dict(
    commit="454ff79",
    tests=[
      "tests/test_sharding.py::test_sharded_step_gathers_params_once_and_reduce_scatters_once_per"
      "_param",
      "tests/test_gather_params.py::test_per_microbatch_gathers_and_reduce_scatters_inside_the_loop",
    ],
  ),
  "hold_zeros_lose_sharding": dict(
    commit="8447238",
    tests=[
      "tests/test_sharding.py::test_streaming_updates_on_sharded_params_match_the_big_batch_step"
      "[explicit]",
    ],
  ),
  "vector_last_merged_by_wrong_slot": dict(
    commit="7e5e3df",
    tests=[
      "tests/test_window_statistics.py::test_a_vector_last_on_a_mesh_is_each_devices_last_real"
      "_value[micro_step]",
    ],
  ),
  "micro_step_in_place_undonated": dict(
    commit="5e2dfcb",
    tests=["tests/test_in_place.py::test_the_report_says_why_a_step_carries"],
    min_jax=(0, 11),
  ),
  "integer_aux_summed_in_its_own_dtype": dict(
    commit="35194dd",
    tests=[RELIABILITY + "test_integer_aux_does_not_wrap_and_complex_aux_keeps_its_value"],
  ),
  "complex_leaf_real_accumulator": dict(
    commit="35194dd",
    tests=[RELIABILITY + "test_complex_params_keep_their_imaginary_part_in_every_mode"],
  ),
}

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
DEFAULT_RUN = ["-n", "2"]  # the default run: python -m pytest -n 2 (addopts: -m 'not full')


def jax_version() -> tuple[int, ...]:
  """The running interpreter's JAX, ``(major, minor)``."""
  return tuple(int(x) for x in importlib.metadata.version("jax").split(".")[:2])


def git(*args: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
  return subprocess.run(["git", *args], cwd=cwd, check=True, **kw)


def snapshot(rev: str, dest: Path) -> Path:
  """The repository's tree at ``rev`` (``git archive``) extracted into ``dest``."""
  root = Path(git("rev-parse", "--show-toplevel", cwd=HERE, capture_output=True, text=True)
              .stdout.strip())  # fmt: skip
  dest.mkdir(parents=True)
  archive = git("archive", "--format=tar", rev, cwd=root, capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
  return dest


def run_tests(tree: Path, args: list[str], timeout: float | None) -> tuple[int, str, float]:
  """``(pytest's exit status, its output, seconds)`` for ``args`` run in ``tree``."""
  env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", COLUMNS="400")
  start = time.monotonic()
  # A session of its own: a timeout or an interrupt ends pytest and its xdist workers together.
  proc = subprocess.Popen(PYTEST + args, cwd=tree, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
  try:
    text, _ = proc.communicate(timeout=timeout)
    rc = proc.returncode
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    rc, text = -1, f"timed out after {timeout} s\n" + proc.communicate()[0]
  except BaseException:
    os.killpg(proc.pid, signal.SIGKILL)
    raise
  return rc, text, time.monotonic() - start


def failed_tests(text: str) -> list[tuple[str, str]]:
  """``(node id, the start of its error)`` for each test pytest's short summary lists as FAILED or
  ERROR."""
  lines = re.findall(r"^(?:FAILED|ERROR) (.*)$", text, re.M)
  return [tuple(line.partition(" - ")[::2]) for line in lines]


def verdict(rc: int) -> str:
  """pytest's exit status as a mutant's result: 1 (tests failed) or 2 (a collection error,
  which fails the run as well) caught; 0 missed; anything else (no test collected, a node id
  not found, a timeout) an error of the replay."""
  return {0: "MISSED", 1: "caught", 2: "caught"}.get(rc, "ERROR")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("ids", nargs="*", help="patch ids (default: every one)")
  parser.add_argument("--rev", default="HEAD", help="the revision to mutate (default HEAD)")
  parser.add_argument("--args", help="pytest arguments run on each mutant instead of its tests")
  parser.add_argument("--all-default", action="store_true",
                      help="run the whole default run (python -m pytest -n 2 -x) per mutant")  # fmt: skip
  parser.add_argument("--each", action="store_true",
                      help="run every listed test (no -x), to see which of them catch it")  # fmt: skip
  parser.add_argument("--no-baseline", action="store_true", help="skip the unpatched run")
  parser.add_argument("--timeout", type=float, default=3600, help="seconds per pytest run")
  parser.add_argument("--json", type=Path, help="write the results here")
  parser.add_argument("--keep", action="store_true", help="keep the temporary trees")
  parser.add_argument("--list", action="store_true", help="list the patches and their tests")
  a = parser.parse_args()

  on_disk = sorted(p.stem for p in PATCHES.glob("*.patch"))
  unknown = sorted(set(on_disk) ^ set(CASES))
  if unknown:
    print(f"patches and CASES differ: {unknown}", file=sys.stderr)
    return 2
  ids = a.ids or list(CASES)
  bad = [i for i in ids if i not in CASES]
  if bad:
    print(f"unknown ids: {bad}; known: {list(CASES)}", file=sys.stderr)
    return 2
  if a.list:
    for i in ids:
      c = CASES[i]
      need = f" (jax >= {'.'.join(map(str, c['min_jax']))})" if "min_jax" in c else ""
      print(f"{i}  [{c['commit']}]{need}")
      for t in c["tests"]:
        print(f"    {t}")
    return 0

  jax_now = jax_version()
  runnable = [i for i in ids if jax_now >= CASES[i].get("min_jax", (0, 0))]
  x = [] if a.each else ["-x"]

  def args_for(i: str | None) -> list[str]:
    if a.args is not None:
      return shlex.split(a.args)
    if a.all_default:
      return DEFAULT_RUN + x
    if i is None:  # the baseline: every runnable case's tests, once each
      return list(dict.fromkeys(t for j in runnable for t in CASES[j]["tests"]))
    return x + CASES[i]["tests"]

  mode = "the whole default run" if a.all_default else "targeted tests"
  mode = f"pytest {a.args}" if a.args is not None else mode + (", each" if a.each else "")
  print(f"python {sys.version.split()[0]}, jax {importlib.metadata.version('jax')},"
        f" rev {a.rev}, {mode}")  # fmt: skip
  results, status, started = {}, 0, time.monotonic()
  tmp = Path(tempfile.mkdtemp(prefix="ga_mutations_"))
  try:
    base = snapshot(a.rev, tmp / "base")
    if not a.no_baseline and runnable:
      rc, text, secs = run_tests(base, args_for(None), a.timeout)
      ok = rc == 0
      results["(unpatched)"] = dict(result="pass" if ok else "FAIL", rc=rc, seconds=round(secs, 1),
                                    failed=failed_tests(text))  # fmt: skip
      print(f"{'(unpatched)':48} {'pass' if ok else 'FAIL'}  {secs:7.1f} s", flush=True)
      if not ok:
        print(text[-4000:])
        status = 1
    for i in ids:
      if i not in runnable:
        need = ".".join(map(str, CASES[i]["min_jax"]))
        results[i] = dict(result=f"n/a (jax >= {need})")
        print(f"{i:48} n/a: its path needs jax >= {need}", flush=True)
        continue
      tree = tmp / i
      shutil.copytree(base, tree, symlinks=True)
      git("apply", str(PATCHES / f"{i}.patch"), cwd=tree)
      rc, text, secs = run_tests(tree, args_for(i), a.timeout)
      result, failed = verdict(rc), failed_tests(text)
      results[i] = dict(result=result, rc=rc, seconds=round(secs, 1), failed=failed)
      print(f"{i:48} {result:6}  {secs:7.1f} s", flush=True)
      for node, error in failed:
        print(f"    {node}\n        {error[:200]}", flush=True)
      if result != "caught":
        status = 1
        if result == "ERROR":
          print(text[-3000:])
      if not a.keep:
        shutil.rmtree(tree)
  finally:
    if not a.keep:
      shutil.rmtree(tmp, ignore_errors=True)
    else:
      print(f"trees kept in {tmp}")
  total = time.monotonic() - started
  counts = {}
  for r in results.values():
    counts[r["result"]] = counts.get(r["result"], 0) + 1
  print(f"total {total:.0f} s: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
  if a.json:
    meta = dict(python=sys.version.split()[0], jax=importlib.metadata.version("jax"), rev=a.rev,
                mode=mode,
                seconds=round(total, 1))  # fmt: skip
    a.json.write_text(json.dumps(dict(meta=meta, results=results), indent=1) + "\n")
  return status


if __name__ == "__main__":
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleaned up as an interrupt is
  sys.exit(main())
