"""The README's Python snippets run as written."""

import json
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert blocks
  namespace: dict = {}
  exec(compile("\n".join(blocks), str(README), "exec"), namespace)
  assert int(namespace["state"].count) == 1
  assert float(namespace["metrics"]["loss"]) == 1.0  # zero params: (0 - 1)^2


def section(title):
  """The README's ``## title`` section, up to the next ``## `` heading."""
  text = README.read_text()
  start = text.index(f"\n## {title}\n")
  return text[start + 1 : text.index("\n## ", start + 1)]


def tables(text):
  """Each markdown table of ``text`` as its rows of cells (the separator row left out)."""
  found, rows = [], []
  for line in [*text.splitlines(), ""]:
    if line.startswith("|"):
      if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line):
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    elif rows:
      found, rows = [*found, rows], []
  return found


def test_performance_section_fits_on_a_screen():
  perf = section("Performance")
  assert len(perf.splitlines()) <= 40
  found = tables(perf)
  assert found and all(len(row) <= 8 for table in found for row in table)
  assert "benchmarks/results/summary.png" in perf


def test_performance_table_is_the_stored_runs():
  """The README's numbers are those ``benchmarks/summary.py`` (the MLP) and
  ``benchmarks/transformer.py --preset cpu`` (the LM: per window, the median ms of the plain
  step on the whole window, ga, the MultiSteps loop and optax.microbatching) wrote, to the
  digits shown; the LM bullet's ratios are that run's own."""
  results = README.parent / "benchmarks" / "results"
  summary = json.loads((results / "summary.json").read_text())
  lm = json.loads((results / "transformer_cpu.json").read_text())
  (table,) = tables(section("Performance"))
  header, *rows = table
  methods = ["plain", "ga", "MultiSteps", "microbatching"]
  assert len(header) == len(methods) + 1
  lm_ms = {m: lm["programs"][p]["ms"] for m, p in zip(methods, LM_PROGRAMS, strict=True)}
  expected = {
    "MLP, CPU ms": summary["time_ms"]["cpu"],
    "MLP, GPU ms": summary["time_ms"]["gpu"],
    "MLP, peak MiB, k = 8": summary["peak_mib"]["8"],
    "MLP, peak MiB, k = 128": summary["peak_mib"]["128"],
    "LM, CPU ms": lm_ms,
  }
  assert [row[0] for row in rows] == list(expected)
  for row in rows:
    for cell, method in zip(row[1:], methods, strict=True):
      value = expected[row[0]][method]
      assert float(cell) == float(f"{value:.3g}"), (row[0], method, cell, value)
  words = " ".join(section("Performance").split())
  assert (lm["config"]["layers"], lm["config"]["k"], lm["config"]["b"]) == (4, 4, 4)
  assert f"measured with jax {lm['meta']['jax']}" in words
  vs = lm["ga_window_vs"]
  for p, of in [("ms_loop", "`MultiSteps`'"), ("microbat", "`optax.microbatching`'s"),
                ("plain_kb", "the plain big batch's")]:  # fmt: skip
    assert f"{vs[p]:.2f} of {of}" in words, p


LM_PROGRAMS = ("plain_kb", "ga", "ms_loop", "microbat")


def test_sphinx_build_names_the_docs_extra():
  text = README.read_text()
  for match in re.finditer(r"sphinx-build", text):
    nearby = text[max(0, match.start() - 300) : match.end() + 300]
    assert '".[docs]"' in nearby or "`docs` extra" in nearby, nearby


def test_decision_block_opens_the_readme():
  """The first section answers "should I switch from MultiSteps?" in a table against both optax
  tools, with the CPU times of the performance summary, and links the full comparison. The table
  stays readable on a phone where GitHub shows it without our stylesheet: four short columns
  (the long names may break at a soft hyphen), each tool's cell a word or a number; the details
  are in the text around it."""
  text = README.read_text()
  first = re.search(r"^## (.*)$", text, re.M).group(1)
  assert first == "Should I switch from `optax.MultiSteps`?"
  block = section(first)
  (table,) = tables(block)
  assert [c.replace("&shy;", "") for c in table[0][1:]] == ["ga", "MultiSteps", "microbatching"]
  assert "`import gradaccum_jax as ga`" in block
  assert "`optax.MultiSteps`" in block and "`optax.microbatching`" in block
  assert 6 <= len(table) - 1 <= 9
  assert all(len(row) == 4 for row in table)
  assert all(len(cell) <= 12 and "`" not in cell for row in table[1:] for cell in row[1:]), table
  summary = json.loads((README.parent / "benchmarks" / "results" / "summary.json").read_text())
  (times,) = [row for row in table if row[0].startswith("time per window, CPU")]
  for cell, method in zip(times[1:], ["ga", "MultiSteps", "microbatching"], strict=True):
    assert cell.startswith(f"{summary['time_ms']['cpu'][method]:.1f} ms"), (cell, method)
  assert "docs/comparison.md" in block and "docs/migrating.md" in block


def test_set_up_keeps_the_two_commands_and_no_maintainer_detail():
  """.ci/run runs the test command as written here; test counts, timings and the versions pip
  resolves live in docs/development.md."""
  setup = section("Set up")
  commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
  assert commands == [
    'python -m venv .venv && . .venv/bin/activate && pip install -e ".[examples]" && python examples/demo.py',
    'python -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m pytest -n 2',
  ]
  assert not re.search(r"\d+ tests|\d+ min|resolves|not slow", setup), setup
  assert "docs/development.md" in setup
  assert (README.parent / "examples" / "demo.py").is_file()  # the demo, outside the package


def test_every_docs_page_is_in_the_documentation_list():
  docs = README.parent / "docs"
  pages = sorted(
    p.relative_to(README.parent).as_posix()
    for p in [*docs.glob("*.md"), *(docs / "api").glob("*.md")]
    if p.name != "index.md"
  )
  listed = section("Documentation")
  missing = [p for p in pages if f"]({p})" not in listed]
  assert not missing, f"docs pages not linked from the README's Documentation list: {missing}"


def test_no_jargon_and_no_script_outside_the_repository():
  """Plain words ("the referee" was a script outside the repository), and no path a clone lacks."""
  root = README.parent
  texts = [README, root / "benchmarks" / "README.md", *sorted((root / "docs").glob("*.md"))]
  for path in texts:
    text = path.read_text()
    assert "referee" not in text.replace("referee_b32", "").replace("ab_referee", ""), path
    assert "shared/bench" not in text, path
