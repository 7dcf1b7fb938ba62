"""The demo's cases where the usual tools differ from the big batch and ga does not."""

import re

import numpy as np
import pytest

import gradaccum_jax as ga
from gradaccum_jax.__main__ import TOLERANCE, main, with_padding


def test_padding_gives_each_microbatch_of_ga_its_own_token_count():
  """Case 2's mask: micro-batch i of ga's split keeps its first n_i rows, 1 <= n_i <= b."""
  k, b = 4, 8
  windows = [{"x": np.zeros((k * b, 3)), "y": np.zeros(k * b)} for _ in range(5)]
  counts = []
  for w in with_padding(windows, k, seed=0):
    for i in range(k):
      mask = np.asarray(ga.microbatch(w["mask"], i, k))
      n = int(mask.sum())
      assert 1 <= n <= b and mask.tolist() == [1.0] * n + [0.0] * (b - n)
      counts.append(n)
  assert len(set(counts)) > 1  # uneven


def difference_rows(out):
  """``{(case, run): (after the first update, after the last, verdict)}`` from the demo's table."""
  rows = re.findall(r"^\| (\d) \| ([^|]+) \| ([\d.e+-]+) \| ([\d.e+-]+) \| ([^|]+) \|$", out, re.M)
  return {(int(c), run): (float(first), float(last), v) for c, run, first, last, v in rows}


@pytest.mark.slow
def test_demo_cases_show_where_the_usual_tools_differ(capsys, tmp_path):
  argv = ["--steps", "3", "--k", "4", "--microbatch-size", "8", "--hidden", "16", "--quiet"]
  assert main([*argv, "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  rows = difference_rows(out)
  ms, mb = "optax.MultiSteps 4 x 8", "optax.microbatching 4 x 8"
  should_agree = [
    (1, "ga.train_step 4 x 8"),
    (1, ms),
    (1, mb),
    (2, "ga.train_step 4 x 8, weight_fn"),
    (3, "ga.train_step 4 x 8"),
    (3, f"{ms}, inside"),
    (3, mb),
  ]
  should_differ = [(2, ms), (2, mb), (3, f"{ms}, around it")]
  assert sorted(rows) == sorted(should_agree + should_differ)
  for key in should_agree:
    first, last, verdict = rows[key]
    assert max(first, last) < TOLERANCE and verdict == "ok", (key, rows[key])
  for key in should_differ:
    first, last, verdict = rows[key]
    assert first > 0.05 and verdict.startswith("differs: "), (key, rows[key])
  # The two wrong tools of case 2 compute the same mean of per-micro-batch means.
  assert rows[(2, ms)][0] == pytest.approx(rows[(2, mb)][0], rel=1e-3)
  assert "-> the runs agree with the big batch (tolerance 1e-03), but for 3 that differ" in out
  png = tmp_path / "loss_curves.png"
  assert png.is_file() and png.stat().st_size > 0
