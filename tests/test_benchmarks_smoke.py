"""Smoke tests of the benchmark scripts: each --smoke run exits 0 and writes its results."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

# Subprocess runs of the benchmark scripts: the full suite only, once, on the newest jax.
pytestmark = [
  pytest.mark.slow,
  pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="run once, on the newest jax"),
]

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"plain", "multisteps_loop", "optax_microbatch", "ga_streaming", "ga_train_step"}
CURVE_METHODS = {"plain", "ga_streaming", "ga_train_step"}
PROGRAMS = {
  "ga_train_step",
  "plain_microbatch",
  "plain_whole",
  "optax_microbatch",
  "multisteps_micro_step",
  "ga_streaming_micro_step",
}


def run_script(argv):
  """Runs ``argv`` from the repository root; fails with its output if it exits non-zero."""
  proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


def test_step_time_smoke(tmp_path):
  run_script([sys.executable, "benchmarks/step_time.py", "--smoke", "--out", str(tmp_path)])
  json_path, md_path = tmp_path / "step_time.json", tmp_path / "step_time.md"
  assert json_path.is_file() and md_path.is_file()

  result = json.loads(json_path.read_text())
  assert {"config", "machine", "methods", "main", "curve", "memory", "total_s"} <= set(result)
  assert result["config"]["smoke"] is True
  for key in ("backend", "device_kind", "jax", "jaxlib", "optax", "os_cpu_count"):
    assert key in result["machine"]
  assert set(result["methods"]) == METHODS

  assert result["main"]
  for run in result["main"]:
    assert run["B"] == run["k"] * run["b"]
    assert set(run["methods"]) == METHODS
    for stats in run["methods"].values():
      assert stats["median_ms"] > 0
      assert stats["ratio_vs_plain"] > 0
      assert len(stats["samples_ms"]) == stats["n"] > 0
      # Every method computes the same update as the plain big-batch step.
      assert stats["first_window_max_abs_diff_vs_plain"] < 1e-4
    assert run["methods"]["plain"]["ratio_vs_plain"] == 1.0

  assert result["curve"]
  for run in result["curve"]:
    assert set(run["methods"]) == CURVE_METHODS

  assert result["memory"]
  for row in result["memory"]:
    assert row["accumulator_bytes"] > 0
    assert row["ratio_temp_train_step_vs_plain_mb_plus_acc"] is not None
    assert set(row["programs"]) == PROGRAMS
    for prog in row["programs"].values():
      assert prog["compile_s"] > 0
      assert prog["temp_bytes"] is not None

  md = md_path.read_text()
  for name in METHODS:
    assert name in md
  assert "train_step / (plain(b) + acc)" in md
  assert result["machine"]["jax"] in md


def test_sharding_smoke(tmp_path):
  run_script([sys.executable, "benchmarks/sharding.py", "--smoke", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "sharding.json").read_text())
  assert result["config"]["smoke"] is True and result["config"]["devices"] == 8
  for run in result["runs"]:
    methods = run["methods"]
    assert set(methods) == {"naive", "ga", "ga_sharded"}
    for stats in methods.values():
      assert stats["median_ms"] > 0
      assert stats["first_window_max_abs_diff_vs_naive"] < 1e-4
    # The baseline reduces inside the loop; ours never does, and reduces once after it.
    assert methods["naive"]["collectives"]["in_loop"]
    assert not methods["ga"]["collectives"]["in_loop"]
    assert methods["ga"]["collectives"]["outside_loop"] == {"all-reduce": 1}
    assert not methods["ga_sharded"]["collectives"]["in_loop"]
  for run in result["gather_runs"]:  # FSDP policies: per micro-batch gathers in the loop
    methods = run["methods"]
    assert not methods["once"]["collectives"]["in_loop"]
    assert set(methods["per_microbatch"]["collectives"]["in_loop"]) == {
      "all-gather",
      "reduce-scatter",
    }
    assert methods["per_microbatch"]["first_window_max_abs_diff_vs_once"] < 1e-4
  for run in result["stream_runs"]:  # streaming: the plain step reduces every call, ours once
    methods = run["methods"]
    assert methods["plain_stream"]["collectives"]["every_call"]
    assert not methods["micro_step"]["collectives"]["every_call"]
    assert methods["micro_step"]["collectives"]["close"] == {"all-reduce": 1}
    assert methods["micro_step"]["first_window_max_abs_diff_vs_plain"] < 1e-4
  donated = result["donated"]["layouts"]  # compiled memory, undonated and donated
  assert set(donated) == {"replicated", "once", "per_microbatch"}
  for m in donated.values():
    assert m["donated"]["total_bytes"] < m["undonated"]["total_bytes"], m
  assert "| naive |" in (tmp_path / "sharding.md").read_text()


def test_device_check_smoke_runs_side_by_side_and_transformer(tmp_path):
  """benchmarks/device_check.sh (the one run prepared for a lent GPU) at its smoke sizes: both
  scripts run, their results and logs land in the folder given, and each is checked."""
  env = {**os.environ, "SMOKE": "1", "PYTHON": sys.executable}
  proc = subprocess.run(
    ["bash", "benchmarks/device_check.sh", str(tmp_path)], cwd=ROOT, env=env,
    capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    "env.log", "side_by_side.log", "side_by_side_gpu.json", "side_by_side_gpu.md",
    "transformer.log", "transformer_gpu.json", "transformer_gpu.md",
  ]  # fmt: skip
  check_side_by_side(tmp_path / "side_by_side_gpu.json", tmp_path / "side_by_side_gpu.md")
  tf = json.loads((tmp_path / "transformer_gpu.json").read_text())
  assert tf["preset"] == "smoke" and tf["config"]["dtype"] == "float32"
  progs = tf["programs"]
  assert set(progs) == {"plain_b", "plain_kb", "ga", "min_scan", "ms_loop", "microbat"}
  # One window of k micro-batches is the step on the whole batch; one micro-batch's is not
  # (relative L2 distance of the first update from plain_kb's).
  for n in ("ga", "min_scan", "ms_loop", "microbat"):
    assert progs[n]["update_rel_diff_to_plain_kb"] < 1e-4, n
  assert progs["plain_b"]["update_rel_diff_to_plain_kb"] > 0.1
  for n, r in progs.items():
    assert r["tokens_per_s"] > 0 and (n == "ms_loop") == (r["footprint_bytes"] is None), n
  assert set(tf["ga_window_vs"]) == {"plain_kb", "min_scan", "ms_loop", "microbat"}
  ms = {n: r["ms"] for n, r in progs.items()}  # medians of one round: the round's own ratio
  assert tf["ga_window_vs"]["ms_loop"] == pytest.approx(ms["ga"] / ms["ms_loop"])
  # ga scans into the state's accumulator: no more than the minimal scan (its metrics and
  # counters: a few KiB) and, where the backward pass adds into it in place (JAX 0.11+), one
  # block's gradient held before it is added (the smoke model stacks a single block, so nothing
  # is saved there: tests/test_in_place.py measures what is on stacked blocks).
  blocks = tf["config"]["layers"] * 12 * tf["config"]["d"] ** 2 * 4
  assert progs["ga"]["footprint_bytes"] <= progs["min_scan"]["footprint_bytes"] + 4096 + blocks
  assert "| program | ms per call |" in (tmp_path / "transformer_gpu.md").read_text()


def check_side_by_side(json_path, md_path):
  result = json.loads(json_path.read_text())
  assert [(r["opt"], r["b"]) for r in result["rows"]] == [("adam", 4)]
  assert result["meta"]["xla_flags"] == os.environ.get("XLA_FLAGS", "")
  for row in result["rows"]:
    assert set(row["ratio"]) == {
      "plain", "ms_loop", "microbat", "min_scan", "min_guard", "min_loss", "min_state", "ga",
      "ga_undonated", "ga_stream", "ga_micro", "min_u2", "min_uk", "ga_u2", "ga_uk",
    }  # fmt: skip
    assert max(row["max_abs_diff_to_plain"].values()) < 1e-3  # every variant trains alike
    temp = row["temp_bytes"]  # an unrolled loop holds more micro-batches at once
    assert temp["min_scan"] <= temp["min_uk"] and temp["ga"] <= temp["ga_uk"]
    # the accumulator in the state: ga adds into it in place, the hand-written form does not
    assert temp["ga"] < temp["min_state"]
    single = row["single"]  # single windows in turn: quantiles, and ga's ratio at each
    assert single["windows"] >= 20
    assert set(single["ga_vs"]) == {
      "plain", "min_scan", "min_guard", "min_loss", "min_state", "microbat", "ga_undonated",
    }  # fmt: skip
    for n, q in single["ga_vs"].items():
      assert q["0.5"] == pytest.approx(single["ms"]["ga"]["0.5"] / single["ms"][n]["0.5"])
    ms = single["ms"]
    assert single["min_scan_vs_plain"]["0.1"] == pytest.approx(
      ms["min_scan"]["0.1"] / ms["plain"]["0.1"]
    )
  md = md_path.read_text()
  assert "| opt | b | plain ms |" in md and "| opt | b | windows |" in md
  assert "ga_uk / min_uk" in md
  assert "| opt | b | min_loss temp MiB | min_state temp MiB | ga temp MiB |" in md


def test_side_by_side_names_a_bad_configs_entry():
  # In this process: no jax start-up in a subprocess.
  spec = importlib.util.spec_from_file_location("side_by_side", ROOT / "benchmarks/side_by_side.py")
  side_by_side = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(side_by_side)
  with pytest.raises(ValueError, match="--configs entry 'sgd:32' is not opt:b"):
    side_by_side.parse_configs("adam:8,sgd:32")


def test_noise_scale_smoke(tmp_path):
  run_script([sys.executable, "benchmarks/noise_scale.py", "--smoke", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "noise_scale.json").read_text())
  assert result["config"]["smoke"] is True and result["machine"]["jax"]
  assert result["rows"]
  for row in result["rows"]:
    # Both estimates of B_simple are finite and positive, within a loose factor of each other.
    assert row["ema"] > 0 and row["brute"] > 0
    assert 0.25 < row["ratio_ema_vs_brute"] < 4
  assert (tmp_path / "noise_scale.png").is_file() == (result["plot"] is not None)
  md = (tmp_path / "noise_scale.md").read_text()
  assert "| window | loss | EMA estimate | brute force |" in md
  assert result["machine"]["jax"] in md


def test_run_all_smoke(tmp_path):
  # The full smoke run of all the scripts takes minutes; the others have their own smoke tests
  # above. This one checks the driver and memory.py: it runs the fastest script (memory) and
  # builds the report and plots, taking the others' results from the committed ones.
  for name in ("step_time", "noise_scale", "sharding"):
    for ext in ("json", "md"):
      shutil.copy(ROOT / "benchmarks" / "results" / f"{name}.{ext}", tmp_path)
  run_script(
    [sys.executable, "benchmarks/run_all.py", "--smoke", "--only", "memory", "--out", str(tmp_path)]
  )
  memory = json.loads((tmp_path / "memory.json").read_text())
  assert memory["config"]["layers"] == [64, 128, 128, 10]  # the smoke sizes
  rows = memory["results"]
  assert any("checkpoint" in name for name in rows) and any("bf16" in name for name in rows)
  for r in rows.values():
    assert r["total_mib"] >= r["temp_mib"] >= 0 and r["compile_s"] > 0
  assert "| configuration |" in (tmp_path / "memory.md").read_text()
  report = (tmp_path / "REPORT.md").read_text()
  for name in ("step_time", "memory", "sharding", "noise_scale"):
    assert f"`{name}.py`" in report
  assert "| `step_time.py` | not run (left out with --only) | full run" in report
  assert "| `sharding.py` | not run (left out with --only) | full run" in report
  assert "| `memory.py` | ran in this run" in report
  assert "| naive |" in report and "| configuration |" in report
  pngs = ("step_time_overhead.png", "step_time_memory.png", "step_time_compile.png")
  for png in pngs:
    assert (tmp_path / png).stat().st_size > 0
    assert f"]({png})" in report


def test_window_inputs_smoke(tmp_path):
  """The cost of window statistics and per-term weights: peaks and times of the four programs."""
  run_script([sys.executable, "benchmarks/window_inputs.py", "--smoke", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "window_inputs_smoke.json").read_text())
  assert set(result["results"]) == {"own_stats", "window_stats", "one_term", "terms"}
  for run in result["results"].values():
    assert run["peak_bytes"] > 0 and run["ms"] > 0


def test_privacy_smoke(tmp_path):
  """DP-SGD's cost: peaks and times of the plain and private windows at two splits."""
  run_script([sys.executable, "benchmarks/privacy.py", "--smoke", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "privacy_smoke.json").read_text())
  assert set(result["results"]) == {
    f"{n} k={k} b={b}" for n in ("plain", "dp") for k, b in ((4, 4), (2, 8))
  }
  for run in result["results"].values():
    assert run["peak_bytes"] > 0 and run["ms"] > 0
  assert len(result["ratios"]) == 4  # time and peak for each split
