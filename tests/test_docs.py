"""The docs: every public name has an API entry, relative links resolve, snippets run, and the
Sphinx site builds with warnings as errors, the notebooks executed into it with their outputs."""

import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap
from html.parser import HTMLParser

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close
from jax.sharding import PartitionSpec as P

import gradaccum_jax as ga

# Prose and scripts, not the JAX floor: run once, under the newest JAX pip resolves (CI's Python
# 3.12); under JAX 0.10 the rest of the suite runs.
pytestmark = pytest.mark.skipif(
  jax.__version_info__ < (0, 11), reason="run once, on the newest jax"
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = ("notebooks", "benchmark_results", "_build")  # written by docs/conf.py at build time


def doc_pages():
  return sorted(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).parts[0] not in GENERATED)


def test_every_public_name_has_an_api_entry():
  """A name added to ``ga.__all__`` needs a ``.. autofunction::`` or ``.. autoclass::`` line in
  one of the docs/api/*.md pages (each page lists the names it documents)."""
  text = "\n".join(p.read_text() for p in sorted((DOCS / "api").glob("*.md")))
  entries = re.findall(r"^\.\. auto(?:function|class|data):: gradaccum_jax\.(\w+)$", text, re.M)
  documented = set(entries)
  twice = sorted(n for n in documented if entries.count(n) > 1)
  assert not twice, f"documented more than once in docs/api/*.md (Sphinx would warn): {twice}"
  missing = sorted(set(ga.__all__) - documented)
  assert not missing, f"public names without an API entry in docs/api/*.md: {missing}"
  assert not documented - set(ga.__all__), "docs/api/*.md documents names not in ga.__all__"


def relative_links(path):
  """Markdown link and image targets that are neither URLs nor in-page anchors."""
  text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # not inside code blocks
  for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
    if not re.match(r"[a-z][a-z0-9+.-]*:|#", target):
      yield target


@pytest.mark.parametrize(
  "page", [ROOT / "README.md", *doc_pages()], ids=lambda p: str(p.relative_to(ROOT))
)
def test_relative_links_point_to_files(page):
  targets = list(relative_links(page))
  broken = [t for t in targets if not (page.parent / t.split("#")[0]).exists()]
  assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_relative_links_are_found():
  """The link test above sees the README's links (a regex that matched nothing would pass)."""
  targets = set(relative_links(ROOT / "README.md"))
  assert {"docs/usage.md", "LICENSE", "notebooks/gradient_accumulation.ipynb"} <= targets


def test_stylesheet_scrolls_code_and_keeps_identifiers_whole():
  """Code blocks scroll sideways with their indentation; no rule breaks inside a word (as
  ``accum_dtype=jnp.float 32`` did); signatures show ``jnp.float32``, not its repr."""
  css = (DOCS / "_static" / "custom.css").read_text()
  rule = re.search(r"div\.highlight pre \{(.*?)\}", css, re.S).group(1)
  assert "white-space: pre;" in rule and "overflow-x: auto" in rule
  assert "anywhere" not in css and "break-all" not in css
  conf = (DOCS / "conf.py").read_text()
  assert re.search(r"^autodoc_preserve_defaults = True$", conf, re.M)
  assert re.search(r'^html_css_files = \["custom.css"\]$', conf, re.M)


def python_blocks(path):
  return re.findall(r"^ *```python\n(.*?)^ *```", path.read_text(), re.S | re.M)


def run_blocks(page, namespace=None):
  """Run the page's python blocks in order in ``namespace`` (a new one by default); return it."""
  namespace = {} if namespace is None else namespace
  blocks = python_blocks(page)
  assert blocks, page
  for block in blocks:
    exec(compile(textwrap.dedent(block), str(page), "exec"), namespace)
  return namespace


# Pages whose snippets start from nothing, each run by its own test below (the guide pages run by
# test_docs_python_blocks_run continue the README's Quick start instead).
STANDALONE = (
  "architecture.md",
  "migrating.md",
  "models.md",
  "privacy.md",
  *(f"api/{p.name}" for p in sorted((DOCS / "api").glob("*.md"))),
)


API_PAGES = sorted((DOCS / "api").glob("*.md"))


@pytest.mark.slow
@pytest.mark.parametrize("page", API_PAGES, ids=lambda p: p.name)
def test_api_pages_open_with_an_example(page):
  """Each API page runs a short example before its first autodoc entry; its names are checked."""
  text = page.read_text()
  first_entry = text.index("```{eval-rst}")
  assert "```python" in text[:first_entry], f"{page.name}: no example before the first entry"
  ns = run_blocks(page)
  checks = {
    "transformation.md": lambda: bool(ga.has_updated(ns["state"])) and int(ns["state"].count) == 1,
    "microbatched_gradient.md": lambda: (
      abs(float(ns["loss"]) - float(ns["whole_loss"])) < 1e-6
      and bool(jnp.allclose(ns["grads"], ns["whole_grads"], atol=1e-6))
    ),
    "fused_step.md": lambda: (
      int(ns["state"].count) == 1
      and ns["ramp"].compiled_ks() == [1, 2, 4]
      and bool(jnp.allclose(ns["micro_w"], ns["w"]))  # 4 micro-steps = one fused window
    ),
    "front_ends.md": lambda: int(ns["ts"].step) == 1 and int(ns["optimizer"].opt_state.count) == 1,
    "sizing.md": lambda: ns["k"] >= 1 and ns["lr"] == pytest.approx(0.4),
  }
  assert checks[page.name](), page.name


@pytest.mark.slow
def test_models_nnx_check_equivalence():
  """docs/models.md: the masked token loss of an NNX model fails the check unweighted and passes
  weighted by tokens; the step weighted by tokens reports the whole batch's token mean and
  counts one window; the split's params are the model's variables, updated by the step."""
  ns = run_blocks(DOCS / "models.md")
  assert not ns["unweighted"].ok and ns["unweighted"].cause == "weighting"
  assert ns["weighted"].ok and ns["weighted"].weighted
  assert float(ns["metrics"]["loss"]) == pytest.approx(float(ns["whole_loss"]), rel=1e-6)
  optimizer = ns["optimizer"]
  assert (int(optimizer.step[...]), int(optimizer.opt_state.count[...])) == (1, 1)
  after = float(ns["model_loss"](ns["model"], ns["batch"]))
  assert float(ns["token_loss"](ns["params"], ns["batch"])) == after != float(ns["whole_loss"])
  # The MoE section: the global-batch balance loss from the window's statistics, the whole
  # batch's step.
  assert ns["moe_same"] and int(ns["moe_metrics"]["window_stats"]["tokens"]) == 64


def test_architecture_adds_a_statistic_with_one_table_entry():
  """docs/architecture.md: a reducer defined on the page, one entry of the table, gives the
  window's largest residual magnitude, the whole batch's."""
  from gradaccum_jax import _parts

  try:
    ns = run_blocks(DOCS / "architecture.md")
    batch = ns["stat_batch"]
    whole = np.max(np.abs(np.asarray(batch["x"]) @ np.zeros(3) - np.asarray(batch["y"])))
    assert float(ns["worst"]) == float(whole) == 8.0
  finally:
    _parts.REDUCERS.pop("abs_max", None)


@pytest.mark.slow
def test_architecture_adds_a_unit_with_one_line():
  """docs/architecture.md: a gradient statistic defined on the page, one registry line, equals
  the closed form (the largest entry of any one row's gradient) in every step that runs the
  loss, on one device and 8, and survives a checkpoint of a micro_step state mid-window; its
  max takes a collective of its own on the mesh, beside the window's one all-reduce."""
  import orbax.checkpoint as ocp

  from gradaccum_jax import _microbatch, _parts

  try:
    ns = run_blocks(DOCS / "architecture.md")
    _microbatch.UNITS.append(lambda core: ns["GradMax"]())
    loss, w, batch = ns["grad_loss"], ns["stat_w"], ns["stat_batch"]
    rows = [jax.tree.map(lambda x, i=i: x[i : i + 1], batch) for i in range(16)]
    expected = max(float(jnp.max(jnp.abs(jax.grad(loss)(w, r)))) for r in rows)
    assert float(ns["grad_max"]) == pytest.approx(expected, rel=1e-6)
    mesh = jax.make_mesh((8,), ("data",))
    tx2 = ga.accumulate(optax.sgd(0.1), 2)  # on 8 devices, 2 micro-batches of one row each
    on_mesh = ga.train_step(loss, tx2, mesh=mesh)
    assert float(on_mesh(w, tx2.init(w), batch)[2]["grad_max"]) == pytest.approx(expected, rel=1e-6)
    report = ga.inspect_step(on_mesh, w, tx2.init(w), batch)
    assert report.after_loop.get("all-reduce", 0) >= 2 and report.in_loop == {}
    tx = ns["unit_tx"]

    class Linear(nnx.Module):  # the NNX step, the same loss
      def __init__(self):
        self.w = nnx.Param(jnp.zeros(3))

    model = Linear()
    nnx_step = ga.nnx_train_step(lambda m, mb: loss(m.w[...], mb))
    got = nnx_step(model, nnx.Optimizer(model, tx, wrt=nnx.Param), batch)["grad_max"]
    assert float(got) == pytest.approx(expected, rel=1e-6)
    for mesh_, k, txk in ((None, 16, tx), (mesh, 2, tx2)):  # micro_step, a checkpoint mid-window
      step, state, params = ga.micro_step(loss, txk, mesh=mesh_), txk.init(w), w
      for i in range(k):
        mb = ga.microbatch(batch, i, k)
        params, state, metrics = step(params, state, mb)
        if i == k // 2 - 1:
          with ocp.StandardCheckpointer() as ckpt:
            path = pathlib.Path(tempfile.mkdtemp()) / "state"
            ckpt.save(path, state)
            ckpt.wait_until_finished()
            like = jax.tree.map(
              lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
            )
            state = ckpt.restore(path, like)
      assert float(metrics["grad_max"]) == pytest.approx(expected, rel=1e-6), mesh_
  finally:
    _microbatch.UNITS.clear()
    _parts.REDUCERS.pop("abs_max", None)


@pytest.mark.slow
def test_privacy_page_trains_privately_and_accounts_for_its_windows():
  """docs/privacy.md: three Poisson-sampled windows of one compiled program, the streaming loop
  of clipped_grad and tx.update, and the accountant's epsilon for them and for a whole run."""
  ns = run_blocks(DOCS / "privacy.md")
  assert ns["windows"] == 3 and int(ns["state"].num_skipped) == 0
  assert ns["step"]._cache_size() == 1  # one program for windows of every size
  assert 0 < float(ns["metrics"]["weight"]) < ns["rows"]  # padded: fewer real rows than the buffer
  assert int(ns["stream_state"].count) == 1 and bool(ga.has_updated(ns["stream_state"]))
  assert 0 < ns["eps"] < ns["eps_run"] < 10


@pytest.mark.slow
def test_migrating_snippets_match_their_before():
  """docs/migrating.md: every "after" gives the parameters and counters of its "before"."""
  ns = run_blocks(DOCS / "migrating.md")
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), ns["ms_params"], ns["params"])
  assert all(jax.tree.leaves(moved)), "the MultiSteps window did not move every param"
  assert_trees_close(ns["ga_params"], ns["ms_params"])
  assert_trees_close(ns["stream_params"], ns["ms_params"])
  assert (int(ns["ms_state"].mini_step), int(ns["ms_state"].gradient_step)) == (0, 1)
  assert (int(ns["ga_state"].micro_step), int(ns["ga_state"].count)) == (0, 1)
  # Linen: the same params; TrainState.step counted micro-batches before and windows after.
  assert_trees_close(ns["ga_ts"].params, ns["ms_ts"].params)
  assert (int(ns["ms_ts"].step), int(ns["ga_ts"].step)) == (ns["k"], 1)
  assert_trees_close(ns["ga_drop"].params, ns["ms_drop"].params)  # the same dropout masks
  # NNX: the same params; Optimizer.step counted micro-batches before and windows after.
  assert_trees_close(nnx.state(ns["ga_model"], nnx.Param), nnx.state(ns["ms_model"], nnx.Param))
  assert (int(ns["ms_opt"].step[...]), int(ns["ga_opt"].step[...])) == (ns["k"], 1)
  # NNX streaming: optimizer.update(model, grads, weight=rows) in the loop, the same params.
  ms_nnx_params = nnx.state(ns["ms_model"], nnx.Param)
  assert_trees_close(nnx.state(ns["stream_model"], nnx.Param), ms_nnx_params)
  stream_opt = ns["stream_opt"]
  assert (int(stream_opt.step[...]), int(stream_opt.opt_state.count[...])) == (ns["k"], 1)


@pytest.mark.slow
def test_docs_python_blocks_run():
  """The snippets of the guide pages run in order, continuing the README's Quick start."""
  namespace: dict = {}
  pages = [ROOT / "README.md"] + [
    DOCS / f"{n}.md" for n in ("usage", "choosing_k", "data_parallel", "verifying")
  ]
  for page in pages:
    run_blocks(page, namespace)
  ns = namespace
  assert isinstance(ns["k"], int) and int(ns["dp_state"].count) == 1
  # usage.md: the ga.micro_step loop closed one window, equal to one fused step from there.
  closed = ns["stream"].to_accumulate_state(ns["stream_state"])
  assert int(closed.count) == 1 and bool(ns["stream_metrics"]["updated"])
  fused, _, fused_metrics = ga.train_step(ns["loss_fn"], ns["tx"])(
    ns["params"], ns["tx"].init(ns["params"]), ns["batch"]
  )
  assert_trees_close(ns["stream_params"], fused)
  assert float(ns["stream_metrics"]["loss"]) == pytest.approx(float(fused_metrics["loss"]))
  # usage.md, several terms: each normalized over the window, the whole batch's step.
  assert ns["terms_same"] and set(ns["terms_metrics"]["loss_terms"]) == {"tokens", "mtp"}
  # usage.md, MoE: a balance loss trained inside the loss is per micro-batch, not the batch's.
  assert not ns["per_micro"].ok and ns["per_micro"].cause == "batch_dependence"
  # usage.md, FP8: the window's amax histories and scales are the whole batch's.
  assert ns["fp8_same"] and int(ns["fp8_state"].opt_state.count) == 1
  # data_parallel.md, FSDP: the 10-element bias is replicated, the rest and the optimizer's
  # state sharded over the 8 devices, and the window equals one device's.
  assert jax.device_count() == 8
  specs = jax.tree.map(lambda x: x.sharding.spec, ns["fsdp_params"])
  assert specs["out"]["b"] == P() or all(s is None for s in specs["out"]["b"])
  assert specs["hidden"]["w"][0] == "data" and specs["out"]["w"][0] == "data"
  mu = ns["fsdp_state"].inner_state[0].mu
  assert mu["hidden"]["w"].sharding.spec[0] == "data"
  one, _, _ = ga.train_step(ns["mlp_loss"], ns["fsdp_tx"])(
    ns["mlp_params"], ns["fsdp_tx"].init(ns["mlp_params"]), ns["cls_batch"]
  )
  assert_trees_close(ns["fsdp_params"], one)
  assert not bool(jnp.allclose(one["hidden"]["w"], ns["mlp_params"]["hidden"]["w"]))
  # verifying.md: a hand-written scan step on make_mesh's Explicit axes, with out_sharding=
  # where jax asks for it, gives the whole-batch gradient.
  assert ns["check_mesh"].axis_types == (jax.sharding.AxisType.Explicit,)
  whole = jax.grad(ns["toy_loss"])(ns["check_params"], ns["check_batch"])
  assert_trees_close(ns["own_grads"], whole)
  standalone = [DOCS / name for name in STANDALONE]
  others = [p for p in doc_pages() if p not in pages + standalone and python_blocks(p)]
  assert not others, f"python blocks not run by this test: {others}"


NOTEBOOK_OUTPUTS = {  # notebook: (texts its printed outputs contain, number of inline plots)
  "gradient_accumulation": (
    ["max |params DP - single device|", "StepReport: 1 loop(s)", "whole batch: equivalent"],
    2,
  ),
  "token_weighted_lm": (
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


class CellOutputs(HTMLParser):
  """What a notebook page (myst-nb) shows below its code cells: the printed text (stdout and
  stderr, not the code or the prose) and the images."""

  def __init__(self, page: str):
    super().__init__()
    self.divs: list[str] = []  # the classes of the open <div>s, outermost first
    self.text: list[str] = []
    self.images: list[str] = []  # src of each <img> in a cell's output
    self.feed(page)
    self.close()

  def inside(self, cls):
    return any(cls in classes.split() for classes in self.divs)

  def handle_starttag(self, tag, attrs):
    if tag == "div":
      self.divs.append(dict(attrs).get("class") or "")
    elif tag == "img" and self.inside("cell_output"):
      self.images.append(dict(attrs)["src"])

  def handle_endtag(self, tag):
    if tag == "div":
      self.divs.pop()

  def handle_data(self, data):
    if self.inside("cell_output") and (self.inside("stream") or self.inside("stderr")):
      self.text.append(data)


@pytest.mark.slow
def test_sphinx_builds_without_warnings(tmp_path):
  """The site builds with warnings as errors; the notebooks run top to bottom in it (a failing
  cell fails the build) and their pages show what they print and their plots."""
  from ipykernel.kernelspec import install

  # The notebooks' kernels: a "python3" kernelspec that launches this interpreter, found first
  # through JUPYTER_PATH, so that they run in this (possibly fresh) virtual environment whatever
  # kernels the user has installed; they import this checkout's gradaccum_jax, installed or not.
  # They inherit the rest of the environment, conftest.py's 8 CPU devices included, so that the
  # data-parallel cells are exercised, and run at the notebooks' CPU size.
  install(kernel_name="python3", prefix=str(tmp_path / "kernel"))
  env = dict(os.environ, GA_NOTEBOOK_SMALL="1")
  for name, first in (
    ("JUPYTER_PATH", tmp_path / "kernel" / "share" / "jupyter"),
    ("PYTHONPATH", ROOT),
  ):
    env[name] = os.pathsep.join(p for p in (str(first), os.environ.get(name, "")) if p)
  site = tmp_path / "html"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "sphinx",
      "-W",
      "--keep-going",
      "-q",
      "-b",
      "html",
      str(DOCS),
      str(site),
    ],
    capture_output=True,
    text=True,
    timeout=900,
    env=env,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  index = (site / "index.html").read_text()
  assert "Should I switch from" in index and "Compared with other tools" in index  # the README
  for page in ("api/transformation.html", "api/sizing.html", "notebooks.html", "comparison.html"):
    assert (site / page).is_file(), page
  assert 'href="comparison.html"' in index  # in the toctree, and linked from the decision table
  notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
  assert notebooks == sorted(NOTEBOOK_OUTPUTS), "a notebook needs its expected outputs here"
  for name, (expected, num_plots) in NOTEBOOK_OUTPUTS.items():
    page = (site / "notebooks" / f"{name}.html").read_text()
    outputs = CellOutputs(page)
    text = "".join(outputs.text)
    for snippet in expected:
      assert snippet in text, (name, snippet)
    plots = [src for src in outputs.images if src.endswith(".png")]
    assert len(plots) == len(outputs.images) == num_plots, (name, outputs.images)
    assert all((site / "notebooks" / src).is_file() for src in plots), plots
    # The Colab badge is the site's own copy (it shows offline); notebook code cells are there
    # for custom.css to wrap.
    assert '<img alt="Open In Colab" src="../_images/colab-badge.svg" />' in page, name
    assert 'class="cell_input' in page and "custom.css" in page, name
  api = (site / "api" / "transformation.html").read_text()
  assert 'id="gradaccum_jax.accumulate"' in api  # autodoc rendered, not printed as text
  # Signatures show defaults as written (autodoc_preserve_defaults), not their repr.
  assert "jnp.float32" in api and "&lt;class" not in api
  assert "sphinx-book-theme" in index and "copybutton.js" in index  # the theme, the button
  assert "custom.css" in index and "custom.js" in index  # code scrolls, tables fit (docs/_static)
  # Math renders offline: MathJax is loaded from the site itself, and no page loads a script,
  # stylesheet, image (the Colab badge) or font from the network.
  assert 'class="math' in api and 'src="../_static/mathjax/tex-chtml.js"' in api
  assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()
  fonts = site / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2"
  assert any(fonts.glob("*.woff")), "MathJax's fonts are not in the site"
  remote = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"(?:https?:)?//[^\"]*\"")
  for html in site.rglob("*.html"):
    found = remote.findall(html.read_text())
    assert not found, f"{html.relative_to(site)} loads from the network: {found}"
  css = "\n".join(p.read_text(errors="replace") for p in (site / "_static").rglob("*.css"))
  assert not re.findall(r"url\([\"']?(?:https?:)?//", css), "a stylesheet loads from the network"
