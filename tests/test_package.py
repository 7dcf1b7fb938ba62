"""The package surface and what the wheel holds."""

import importlib.resources
import tarfile
import zipfile
from pathlib import Path

import pytest

import gradaccum_jax as ga

ROOT = Path(__file__).resolve().parents[1]


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
      "clipped_grad",
      "dp_accumulate",
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
      "scale_weight_decay",
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


def test_wheel_holds_the_library_only(tmp_path, monkeypatch):
  """The wheel holds the package's modules, py.typed and the metadata: no demo, no console
  script. The sdist keeps the demo, examples/demo.py, which the README runs from a clone."""
  import hatchling.build

  monkeypatch.chdir(ROOT)
  wheel = hatchling.build.build_wheel(str(tmp_path / "wheel"))
  with zipfile.ZipFile(tmp_path / "wheel" / wheel) as archive:
    files = sorted(archive.namelist())
  info = wheel.removesuffix("-py3-none-any.whl") + ".dist-info"
  modules = [f"gradaccum_jax/{path.name}" for path in (ROOT / "gradaccum_jax").glob("*.py")]
  metadata = [f"{info}/{name}" for name in ("METADATA", "WHEEL", "RECORD", "licenses/LICENSE")]
  assert files == sorted([*modules, "gradaccum_jax/py.typed", *metadata])
  assert "gradaccum_jax/__init__.py" in files and "gradaccum_jax/_accumulate.py" in files
  sdist = hatchling.build.build_sdist(str(tmp_path / "sdist"))
  with tarfile.open(tmp_path / "sdist" / sdist) as archive:
    assert f"{sdist.removesuffix('.tar.gz')}/examples/demo.py" in archive.getnames()


@pytest.mark.slow
def test_import_needs_no_flax():
  """flax is an optional extra: the package imports without it."""
  import subprocess
  import sys

  code = "import sys; sys.modules['flax'] = None; import gradaccum_jax as ga; print(ga.train_step)"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
