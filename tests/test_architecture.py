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


def test_only_the_flax_front_end_names_flax_s_fp8_collection():
  """fp8 is an adapter of the Flax front end (``_flax.fp8_overwritten``) over the core's generic
  hook for params partly overwritten once per window (``_parts.Overwritten``): no other module
  names the collection or reads a variables dict's ``"params"``."""
  for path in sorted(PACKAGE.glob("*.py")):
    if path.name in ("_flax.py", "_nnx.py"):
      continue
    text = path.read_text()
    assert "_overwrite_with_gradient" not in text, path.name
    assert '["params"]' not in text and "['params']" not in text.replace(
      "variables['params']", ""
    ), path.name


def test_no_module_imports_another_modules_private_names():
  """A module reaches another through the names the architecture page lists as its API."""
  found = []
  for path in sorted(PACKAGE.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradaccum_jax."):
        found += [(path.name, a.name) for a in node.names if a.name.startswith("_")]
  assert not found, found


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


def backend_reads(path):
  """Where a module reads the backend or a device's platform outside an f-string (a message
  may name them; nothing else may depend on them), and its module-level switches (an
  upper-case name bound to True, False or None, read at trace time)."""
  tree = ast.parse(path.read_text())
  in_messages = {id(n) for s in ast.walk(tree) if isinstance(s, ast.JoinedStr) for n in ast.walk(s)}
  found = []
  for node in ast.walk(tree):
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    if (
      name in ("default_backend", "platform", "backend", "platforms")
      and id(node) not in in_messages
    ):
      found.append(f"{path.name}:{node.lineno} reads {name}")
  for node in tree.body:
    if isinstance(node, ast.Assign | ast.AnnAssign):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      value = node.value
      if isinstance(value, ast.Constant) and value.value in (True, False, None):
        found += [
          f"{path.name}:{node.lineno} switch {t.id}"
          for t in targets
          if isinstance(t, ast.Name) and t.id.isupper()
        ]
  return found


def test_no_backend_platform_or_module_switch_decides_a_program(tmp_path):
  """One program per set of user arguments on every backend: no module of the package reads
  jax.default_backend(), a device's platform or a module-level switch but to name it in a
  message, so the program the CPU tests compile is the one a GPU or TPU runs."""
  found = [f for path in sorted(PACKAGE.glob("*.py")) for f in backend_reads(path)]
  assert found == []
  # The check itself finds each kind (it could not pass by looking at nothing).
  probe = tmp_path / "probe.py"
  probe.write_text(
    "import jax\nSWITCH: bool | None = None\n"
    "def f(d):\n  return jax.default_backend() == 'gpu' or d.platform == 'tpu'\n"
  )
  assert len(backend_reads(probe)) == 3
