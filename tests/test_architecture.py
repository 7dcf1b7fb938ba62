"""The architecture page stays true, and the package's modules import without a cycle."""

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "gradaccum_jax"


def package_imports(path):
  """(top-level imports of gradaccum_jax modules, imports of them inside functions)."""
  tree = ast.parse(path.read_text())
  top, nested = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradaccum_jax."):
      target = node.module.split(".")[1]
      if node in tree.body:
        top.add(target)
      else:
        nested.append(target)
  return top, nested


def test_no_import_cycle_and_no_imports_inside_functions():
  graph = {}
  for path in sorted(PACKAGE.glob("_*.py")):
    if path.name == "__init__.py":
      continue
    top, nested = package_imports(path)
    assert not nested, f"{path.name} imports {nested} inside a function"
    graph[path.stem] = top
  done, active = set(), []

  def visit(node):
    if node in active:
      cycle = active[active.index(node) :] + [node]
      pytest.fail(f"import cycle: {' -> '.join(cycle)}")
    if node in done:
      return
    active.append(node)
    for nxt in graph.get(node, ()):
      visit(nxt)
    active.pop()
    done.add(node)

  for node in graph:
    visit(node)


def test_every_name_on_the_architecture_page_exists():
  text = (ROOT / "docs" / "architecture.md").read_text()
  modules = set(re.findall(r"\b(_[a-z_]+)\.py\b", text))
  for module in modules:
    assert (PACKAGE / f"{module}.py").exists(), module
  names = re.findall(r"\b(_[a-z_]+)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)", text)
  assert len(names) > 20
  for module, dotted in names:
    if dotted == "py":
      continue
    obj = importlib.import_module(f"gradaccum_jax.{module}")
    for part in dotted.split("."):
      assert hasattr(obj, part), f"{module}.{dotted}"
      obj = getattr(obj, part)
