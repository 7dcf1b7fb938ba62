"""The notebooks as stored: stripped of outputs, their text matching their code, an install cell
that works before a release, a Colab badge shipped with them. The docs build executes them top to
bottom (at their small size) and tests/test_docs.py checks their outputs in the built pages."""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "gradient_accumulation.ipynb"
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
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


@paths
def test_notebook_colab_badge_is_shipped(path):
  """The badge opens this notebook on Colab, and its image is a file of the repository, found
  from the notebook as GitHub finds it (docs/conf.py points the docs' copy at the same file), so
  that it shows offline."""
  intro = nbformat.read(path, as_version=4).cells[0].source
  ((image, link),) = re.findall(r"^\[!\[Open In Colab\]\(([^)\s]+)\)\]\(([^)\s]+)\)$", intro, re.M)
  assert link.startswith("https://colab.research.google.com/github/"), link
  assert link.endswith(f"/blob/main/notebooks/{path.name}"), link
  assert not re.match(r"[a-z][a-z0-9+.-]*:", image), f"the badge loads from the network: {image}"
  assert image.endswith(".svg") and (path.parent / image).is_file(), image


def test_readme_links_every_notebook():
  readme = (ROOT / "README.md").read_text()
  for name in NOTEBOOKS:
    assert f"(notebooks/{name})" in readme, name
