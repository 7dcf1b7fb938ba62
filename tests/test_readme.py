"""The README's Python snippets run as written."""

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
