"""The package surface and the demo."""

import importlib.resources

import gradaccum_jax as ga
from gradaccum_jax.__main__ import main


def test_public_names_are_reexported():
  assert sorted(ga.__all__) == sorted(
    [
      "AccumulateState",
      "DynamicLossScale",
      "LossScaleState",
      "NoiseScaleState",
      "accumulate",
      "auto_microbatch",
      "has_updated",
      "linen_train_step",
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


def test_demo_runs_and_agrees(capsys, tmp_path):
  argv = ["--steps", "3", "--k", "4", "--microbatch-size", "8", "--hidden", "16"]
  assert main([*argv, "--out", str(tmp_path), "--quiet"]) == 0
  out = capsys.readouterr().out
  assert "| plain batch of 32 |" in out
  assert "| ga.train_step 4 x 8 |" in out
  assert "| optax.MultiSteps 4 x 8 |" in out
  assert "the runs agree" in out
  png = tmp_path / "loss_curves.png"
  assert png.is_file() and png.stat().st_size > 0


def test_import_needs_no_flax():
  """flax is an optional extra: the package imports without it."""
  import subprocess
  import sys

  code = "import sys; sys.modules['flax'] = None; import gradaccum_jax as ga; print(ga.train_step)"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
