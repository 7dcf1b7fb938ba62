"""The package surface and the demo."""

import importlib.resources
import re
import sys

import pytest

import gradaccum_jax as ga
from gradaccum_jax.__main__ import main


def test_public_names_are_reexported():
  assert sorted(ga.__all__) == sorted(
    [
      "Accumulate",
      "AccumulateState",
      "DynamicLossScale",
      "EquivalenceReport",
      "LossScaleState",
      "NoiseScaleState",
      "StepCheck",
      "StepReport",
      "accumulate",
      "auto_microbatch",
      "check_equivalence",
      "check_step",
      "flush",
      "has_updated",
      "inspect_step",
      "linen_train_step",
      "micro_step",
      "microbatch",
      "nnx_train_step",
      "ramp_train_step",
      "noise_scale",
      "scale_adam_hyperparams",
      "scale_learning_rate",
      "step_memory",
      "train_step",
      "value_and_grad",
    ]
  )
  for name in ga.__all__:
    obj = getattr(ga, name)
    assert obj.__module__.startswith("gradaccum_jax._"), name
    assert obj.__doc__, name
  assert isinstance(ga.__version__, str) and ga.__version__
  assert importlib.resources.files("gradaccum_jax").joinpath("py.typed").is_file()


@pytest.mark.slow
def test_demo_runs_and_agrees(capsys, tmp_path):
  argv = ["--steps", "3", "--k", "4", "--microbatch-size", "8", "--hidden", "16"]
  assert main([*argv, "--out", str(tmp_path), "--quiet"]) == 0
  out = capsys.readouterr().out
  assert "| plain batch of 32 |" in out
  assert "| ga.train_step 4 x 8 |" in out
  assert "| optax.MultiSteps 4 x 8 |" in out
  assert "the runs agree" in out
  # No memory column: one window is one program for two runs and k programs for MultiSteps.
  assert "| run | final train loss | test accuracy | ms / window (median) |\n" in out
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
    main([*argv, "--quiet"])
  assert exc.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize(
  "argv0, prog",
  [
    ("/venv/bin/gradaccum-jax", "gradaccum-jax"),
    ("/src/gradaccum_jax/__main__.py", "python -m gradaccum_jax"),
  ],
)
def test_demo_help_names_the_command(argv0, prog, capsys, monkeypatch):
  monkeypatch.setattr(sys, "argv", [argv0, "--help"])
  with pytest.raises(SystemExit) as exc:
    main(["--help"])
  assert exc.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(f"usage: {prog} ")
  assert "``" not in out
  # Every option has a help text (argparse leaves the rest of the line empty otherwise).
  for option in ("--k K", "--steps STEPS", "--lr LR", "--hidden HIDDEN", "--seed SEED"):
    assert re.search(rf"^  {option} +\S", out, re.M), option


def test_import_needs_no_flax():
  """flax is an optional extra: the package imports without it."""
  import subprocess
  import sys

  code = "import sys; sys.modules['flax'] = None; import gradaccum_jax as ga; print(ga.train_step)"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
