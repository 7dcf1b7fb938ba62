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


def test_performance_table_is_the_summary_json():
  """The README's numbers are those ``benchmarks/summary.py`` wrote, to the digits shown."""
  summary = json.loads((README.parent / "benchmarks" / "results" / "summary.json").read_text())
  (table,) = tables(section("Performance"))
  header, *rows = table
  methods = ["plain", "ga", "MultiSteps", "microbatching"]
  assert len(header) == len(methods) + 1
  expected = {
    "CPU ms": summary["time_ms"]["cpu"],
    "GPU ms": summary["time_ms"]["gpu"],
    "peak MiB, k = 8": summary["peak_mib"]["8"],
    "peak MiB, k = 128": summary["peak_mib"]["128"],
  }
  assert [row[0] for row in rows] == list(expected)
  for row in rows:
    for cell, method in zip(row[1:], methods, strict=True):
      value = expected[row[0]][method]
      assert float(cell) == float(f"{value:.3g}"), (row[0], method, cell, value)


def test_sphinx_build_names_the_docs_extra():
  text = README.read_text()
  for match in re.finditer(r"sphinx-build", text):
    nearby = text[max(0, match.start() - 300) : match.end() + 300]
    assert '".[docs]"' in nearby or "`docs` extra" in nearby, nearby
