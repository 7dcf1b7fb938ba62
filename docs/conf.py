"""Sphinx configuration: API pages from the docstrings (autodoc + napoleon), pages in MyST
markdown, and the notebooks executed at build time and rendered with their outputs by myst-nb;
sphinx-book-theme (as optax), a copy button on code blocks (sphinx-copybutton), and MathJax served
from the built site itself (sphinx-mathjax-offline copies MathJax 3 into ``_static/mathjax``), so
that math renders without a network.

Build: ``sphinx-build -W -b html docs /tmp/docs_html`` (``tests/test_docs.py`` does); running the
notebooks takes one to two minutes of it on 2 CPU cores. ``-D nb_execution_mode=off`` renders them as
stored, without outputs, in seconds.
"""

import os
import pathlib
import re

import gradaccum_jax

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent

project = "gradaccum_jax"
author = "gradaccum_jax authors"
copyright = "gradaccum_jax authors; Apache-2.0"  # noqa: A001
release = gradaccum_jax.__version__

extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "myst_nb",  # MyST markdown pages and .ipynb notebooks (myst-nb brings myst-parser)
  "sphinx_copybutton",
  "sphinx-mathjax-offline",  # sets mathjax_path to the copy of MathJax it ships in the build
]


def _sync(folder: pathlib.Path, files: dict[str, bytes]) -> None:
  """Make ``folder`` hold exactly ``files`` (name -> content), rewriting only what changed, so
  that two builds at once (e.g. two test runs) do not pull files from under each other."""
  folder.mkdir(exist_ok=True)
  for stale in set(p.name for p in folder.iterdir()) - set(files):
    (folder / stale).unlink()
  for name, content in files.items():
    if not (folder / name).is_file() or (folder / name).read_bytes() != content:
      (folder / name).write_bytes(content)


# The notebooks live in notebooks/ at the repository root, outside this source folder; copy
# every one of them (by glob, so new notebooks need no change here) into docs/notebooks/,
# which is generated and ignored by git. notebooks.md lists them with a globbing toctree. A link
# from a notebook into docs/ (the Colab badge's image, docs/_static/colab-badge.svg) is written
# from notebooks/, as GitHub resolves it; from the copy one folder deeper in docs/ the same file
# is one "../docs" shorter.
_sync(
  DOCS / "notebooks",
  {
    p.name: p.read_bytes().replace(b"](../docs/", b"](../")
    for p in (ROOT / "notebooks").glob("*.ipynb")
  },
)

# The benchmark report: benchmarks/README.md and every markdown file under benchmarks/results/
# (a run_all.py REPORT.md, each script's tables), each on its own page that includes the file
# as committed, so that a new results file needs no change here. docs/benchmark_results/ is
# generated and ignored by git.
_BENCH = ROOT / "benchmarks"
_pages = {}
for _md in [_BENCH / "README.md", *sorted((_BENCH / "results").rglob("*.md"))]:
  _rel = _md.relative_to(_BENCH)
  _page = "README" if _rel.name == "README.md" else "_".join(_rel.with_suffix("").parts)
  _pages[f"{_page}.md"] = (
    f"```{{include}} ../../benchmarks/{_rel.as_posix()}\n:relative-images:\n```\n".encode()
  )
_sync(DOCS / "benchmark_results", _pages)

# The notebooks are stored without outputs; every build runs each top to bottom in a fresh
# kernel (a failing cell fails the build) and renders it with its printed outputs and plots.
# tests/test_docs.py checks those in the built pages. The kernels inherit this environment: the
# notebooks' CPU-sized run (GA_NOTEBOOK_SMALL), and 8 CPU devices so that their data-parallel
# cells split the batch as over a TPU's 8 cores (tests/conftest.py sets the same). A value the
# user set is kept.
nb_execution_mode = "force"
nb_execution_timeout = 300  # seconds per cell
nb_execution_raise_on_error = True
nb_execution_show_tb = True  # a failing cell's traceback in the build's log
nb_merge_streams = True  # the lines a cell prints in a loop in one block, not one box each
os.environ.setdefault("GA_NOTEBOOK_SMALL", "1")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  _flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  os.environ["XLA_FLAGS"] = _flags.strip()
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Defaults as written in the source (`accum_dtype=jnp.float32`), not their repr
# (`<class 'jax.numpy.float32'>`); the functions that take the keyword options have a signature
# of their own (no source to read), so `_dtype_defaults` writes their dtypes so.
autodoc_preserve_defaults = True


def _dtype_defaults(app, what, name, obj, options, signature, return_annotation):
  if signature:
    return re.sub(r"<class 'jax\.numpy\.(\w+)'>", r"jnp.\1", signature), return_annotation
  return None


def setup(app):
  app.connect("autodoc-process-signature", _dtype_defaults)


# A signature longer than this puts each parameter on its own line: no parameter is split.
python_maximum_signature_line_length = 88
# The page's table of contents lists a class's fields by their own names (`micro_step` under
# `AccumulateState`), short enough for the sidebar.
toc_object_entries_show_parents = "hide"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints", "jupyter_execute"]
html_theme = "sphinx_book_theme"
html_title = "gradaccum_jax"
html_theme_options = {
  "show_toc_level": 2,
  "navigation_with_keys": False,
  # The comparison's wide tables get the whole width: no table of contents beside them.
  "secondary_sidebar_items": {"**": ["page-toc.html"], "comparison": []},
}
# custom.css: code blocks scroll sideways and keep their lines (a notebook's cells and outputs
# wrap at a space instead), identifiers never break inside,
# the text column is wider on pages with tables, and a table too wide for a phone's screen
# becomes one card per row (custom.js labels the cells with their headers).
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_js_files = ["custom.js"]
# The copy button leaves out prompts and outputs of ">>>" examples and shell "$ " lines.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
