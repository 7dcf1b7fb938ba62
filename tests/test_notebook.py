"""Execute the notebooks top to bottom (at their small size), and check they are stored stripped."""

import os
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "gradient_accumulation.ipynb"
NOTEBOOKS = {  # notebook: (text its outputs must contain, number of inline plots)
  "gradient_accumulation.ipynb": (
    ["max |params DP - single device|", "StepReport: 1 loop(s)", "whole batch: equivalent"],
    2,
  ),
  "token_weighted_lm.ipynb": (
    [
      "NOT equivalent",
      "likely reason (weighting)",
      "weight_fn=lambda mb: mb['mask'].sum()",
      "loss of the first window: big batch",
      "on 8 devices",  # the data-parallel cell ran (conftest.py's 8 CPU devices)
      "notebook ran in",
    ],
    1,
  ),
}
paths = pytest.mark.parametrize(
  "path", [ROOT / "notebooks" / n for n in NOTEBOOKS], ids=list(NOTEBOOKS)
)


@paths
def test_notebook_is_stripped(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [], "notebook outputs must be stripped"
      assert cell.execution_count is None, "execution counts must be stripped"


def test_notebook_text_matches_code():
  """Numbers the text states are the ones the code uses (at least the training run's steps)."""
  nb = nbformat.read(NOTEBOOK, as_version=4)
  text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
  code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
  (steps,) = re.findall(r"^STEPS = (\d+)$", code, re.M)
  stated = re.findall(r"the same (\d+) batches", text)
  assert stated == [steps], (stated, steps)


@paths
def test_notebook_install_cell_works_before_a_release(path):
  """The install cell installs from the repository (URL in one variable), only when the package
  is not importable (so it does nothing under this test), and keeps jax on a Colab TPU."""
  nb = nbformat.read(path, as_version=4)
  install = next(c.source for c in nb.cells if c.cell_type == "code")
  (repo,) = re.findall(r'^REPO = "(https://github\.com/[\w.-]+/[\w.-]+)"$', install, re.M)
  assert install.count(repo) == 1 and "git+{REPO}" in install
  assert 'find_spec("gradaccum_jax") is None' in install
  assert "--no-deps" in install and "pip install gradaccum_jax" in install
  intro = nb.cells[0].source
  assert "TPU" in intro and "restart" in intro.lower() and "do not reinstall jax" in intro
  assert repo.removeprefix("https://github.com/") in intro  # the Colab badge: same repository


def test_readme_links_every_notebook():
  readme = (ROOT / "README.md").read_text()
  for name in NOTEBOOKS:
    assert f"(notebooks/{name})" in readme, name


@pytest.mark.slow
@paths
def test_notebook_runs(path, tmp_path, monkeypatch):
  nbclient = pytest.importorskip("nbclient")
  from ipykernel.kernelspec import install

  # A "python3" kernelspec that launches this interpreter (sys.executable), found first through JUPYTER_PATH, so
  # the kernel runs in the same (possibly fresh) virtual environment, whatever kernels the user
  # has installed.
  install(kernel_name="python3", prefix=str(tmp_path))
  jupyter_path = [str(tmp_path / "share" / "jupyter"), os.environ.get("JUPYTER_PATH", "")]
  monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(p for p in jupyter_path if p))
  # The kernel imports this checkout's gradaccum_jax, installed or not; it inherits the
  # environment, including conftest.py's 8 CPU devices, so the data-parallel cells are exercised.
  python_path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in python_path if p))
  monkeypatch.setenv("GA_NOTEBOOK_SMALL", "1")  # the CPU-sized run of notebooks that have one

  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
  )
  client.execute()  # raises nbclient.exceptions.CellExecutionError on the first failing cell

  outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
  text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
  expected, num_plots = NOTEBOOKS[path.name]
  for snippet in expected:
    assert snippet in text, snippet
  images = [out for out in outputs if "image/png" in out.get("data", {})]
  assert len(images) == num_plots, "every plot must render inline"
