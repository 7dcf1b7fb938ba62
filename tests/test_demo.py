"""The demo, examples/demo.py: run as the README runs it, its cases where the usual tools differ
from the big batch and ga does not, and its arguments."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import gradaccum_jax as ga

# Prose and scripts, not the JAX floor: run once, under the newest JAX pip resolves (CI's Python
# 3.12); under JAX 0.10 the rest of the suite runs.
pytestmark = pytest.mark.skipif(
  jax.__version_info__ < (0, 11), reason="run once, on the newest jax"
)

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.py"


def load_demo():
  """examples/demo.py as a module (it is a script of the clone, not part of the package)."""
  spec = importlib.util.spec_from_file_location("demo", DEMO)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


demo = load_demo()


def test_padding_gives_each_microbatch_of_ga_its_own_token_count():
  """Case 2's mask: micro-batch i of ga's split keeps its first n_i rows, 1 <= n_i <= b."""
  k, b = 4, 8
  windows = [{"x": np.zeros((k * b, 3)), "y": np.zeros(k * b)} for _ in range(5)]
  counts = []
  for w in demo.with_padding(windows, k, seed=0):
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
def test_demo_script_shows_where_the_usual_tools_differ(tmp_path):
  """``python examples/demo.py``, as the README's first command runs it (small sizes): every
  run that should equal the big batch does (with clipping and the schedule inside the optimizer,
  uneven tokens weighted), the three that differ by design differ, and the plot is written."""
  argv = ["--steps", "3", "--k", "4", "--microbatch-size", "8", "--hidden", "16", "--quiet"]
  proc = subprocess.run(
    [sys.executable, str(DEMO), *argv, "--out", str(tmp_path)],
    capture_output=True, text=True, timeout=600, cwd=tmp_path,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = proc.stdout
  assert "| run | final train loss | test accuracy | ms / window (median) |\n" in out
  assert out.count("| plain batch of 32 |") == 3  # each case's reference
  rows = difference_rows(out)
  ms, mb = "optax.MultiSteps 4 x 8", "optax.microbatching 4 x 8"
  should_agree = [
    (1, "ga.train_step 4 x 8, weight_fn"),
    (1, ms),
    (1, mb),
    (2, "ga.train_step 4 x 8, weight_fn"),
  ]
  should_differ = [(2, ms), (2, mb), (3, f"{ms}, around it")]
  assert sorted(rows) == sorted(should_agree + should_differ)
  for key in should_agree:
    first, last, verdict = rows[key]
    assert max(first, last) < demo.TOLERANCE and verdict == "ok", (key, rows[key])
  for key in should_differ:
    first, last, verdict = rows[key]
    assert first > 0.05 and verdict.startswith("differs: "), (key, rows[key])
  # The two wrong tools of case 2 compute the same mean of per-micro-batch means.
  assert rows[(2, ms)][0] == pytest.approx(rows[(2, mb)][0], rel=1e-3)
  assert "-> the runs agree with the big batch (tolerance 1e-03), but for 3 that differ" in out
  png = tmp_path / "loss_curves.png"
  assert png.is_file() and png.stat().st_size > 0


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--lr", "-1"], "argument --lr: must be positive, got -1"),
    (["--lr=0"], "argument --lr: must be positive, got 0"),
    (["--lr", "nan"], "argument --lr: must be positive, got nan"),
    (["--lr", "fast"], "argument --lr: 'fast' is not a float"),
    (["--k", "0"], "argument --k: must be positive, got 0"),
    (["--steps", "-3"], "argument --steps: must be positive, got -3"),
    (["--hidden", "1.5"], "argument --hidden: '1.5' is not a int"),
  ],
)
def test_demo_rejects_bad_arguments(argv, message, capsys):
  with pytest.raises(SystemExit) as exc:
    demo.main([*argv, "--quiet"])
  assert exc.value.code == 2
  assert message in capsys.readouterr().err


def test_demo_help_names_the_script_and_every_option(capsys, monkeypatch):
  monkeypatch.setattr(sys, "argv", [str(DEMO), "--help"])
  with pytest.raises(SystemExit) as exc:
    demo.main(["--help"])
  assert exc.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: demo.py ")
  assert "python examples/demo.py" in out and "``" not in out
  # Every option has a help text (argparse leaves the rest of the line empty otherwise).
  for option in ("--k K", "--steps STEPS", "--lr LR", "--hidden HIDDEN", "--seed SEED"):
    assert re.search(rf"^  {option} +\S", out, re.M), option
