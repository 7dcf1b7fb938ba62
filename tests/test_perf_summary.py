"""benchmarks/summary.py: the README's performance plot is made from the stored runs, and its
memory figures are what the compiler says today."""

import json
import pathlib
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

import summary  # noqa: E402  (benchmarks/summary.py)


def stored():
  return json.loads((RESULTS / "summary.json").read_text())


def test_times_are_the_stored_runs():
  s = stored()
  _, cpu = summary.time_row(RESULTS / "referee_b32.json")
  _, gpu = summary.time_row(RESULTS / "side_by_side_gpu.json")
  assert s["time_ms"] == {"cpu": cpu, "gpu": gpu}
  assert s["time_meta"]["gpu"]["backend"] == "gpu" and s["time_meta"]["cpu"]["backend"] == "cpu"


@pytest.mark.slow
def test_memory_is_recomputed_alike():
  """The compiled peaks at k = 8 are deterministic: recompiled, they match the stored ones (on
  the jax version that wrote them; another version may plan buffers differently)."""
  s = stored()
  if jax.__version__ != s["peak_meta"]["jax"] or jax.default_backend() != "cpu":
    pytest.skip(f"summary.json was written with jax {s['peak_meta']['jax']} on the CPU")
  now = summary.peak_mib(8)
  assert now == pytest.approx(s["peak_mib"]["8"], abs=0.01)


def test_memory_shape():
  """What the README says of the plot: the fused programs grow with k (the batch they hold), ga
  the least; a MultiSteps call does not."""
  peak = stored()["peak_mib"]
  ks = sorted(peak, key=int)
  assert len({round(peak[k]["MultiSteps"], 6) for k in ks}) == 1
  last = peak[ks[-1]]
  assert last["ga"] < last["microbatching"] < last["plain"]


def test_plot_is_drawn(tmp_path):
  pytest.importorskip("matplotlib")
  summary.plot(stored(), tmp_path / "summary.png")
  assert (tmp_path / "summary.png").stat().st_size > 10_000
