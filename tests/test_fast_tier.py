"""The fast tier, ``python -m pytest -m "not slow"``, still calls every public name at least once.

A name counts as covered when the ``>>>`` examples of some public docstring use it (doctests run
in the fast tier), or when a fast test listed in ``FAST_TESTS`` uses it as ``ga.<name>``. A new
public name without a doctest example needs an entry here (and a fast test, if none uses it).
"""

import ast
import pathlib
import re

import chex
import jax.numpy as jnp
import optax

import gradaccum_jax as ga

ROOT = pathlib.Path(__file__).resolve().parents[1]

FAST_TESTS = {  # public name -> fast tests ("file::function") that use it as ga.<name>
  "Accumulate": ["tests/test_fast_tier.py::test_public_classes_in_one_small_window"],
  "AccumulateState": ["tests/test_fast_tier.py::test_public_classes_in_one_small_window"],
  "DynamicLossScale": [
    "tests/test_fast_tier.py::test_public_classes_in_one_small_window",
    "tests/test_mixed_precision.py::test_fp16_loss_scale_once_per_window_overflow_skips_and_growth_fused",
  ],
  "LossScaleState": ["tests/test_fast_tier.py::test_public_classes_in_one_small_window"],
  "NoiseScaleState": ["tests/test_fast_tier.py::test_public_classes_in_one_small_window"],
  "EquivalenceReport": ["tests/test_fast_tier.py::test_public_classes_in_one_small_window"],
}


def test_public_classes_in_one_small_window():
  """The public state and report classes, from one window of a tiny linear model."""
  params = {"w": jnp.zeros(3)}
  tx = ga.accumulate(
    optax.sgd(0.1), 2, loss_scale=ga.DynamicLossScale(initial_scale=2.0**4), noise_scale_ema=0.9
  )
  assert isinstance(tx, ga.Accumulate) and tx.num_microbatches == 2
  state = tx.init(params)
  assert isinstance(state, ga.AccumulateState)
  assert isinstance(state.loss_scale, ga.LossScaleState)
  assert isinstance(state.noise_scale, ga.NoiseScaleState)
  for g in (jnp.array([1.0, 0.0, 0.0]), jnp.array([0.0, 1.0, 0.0])):
    scaled = {"w": g * state.loss_scale.scale}  # streaming mode: the user scales the loss
    updates, state = tx.update(scaled, state, params, weight=jnp.float32(4))
  chex.assert_tree_all_finite(updates)
  chex.assert_trees_all_close(updates, {"w": jnp.array([-0.05, -0.05, 0.0])})
  assert int(state.count) == 1

  def loss_fn(w, batch):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

  batch = {"x": jnp.arange(12.0).reshape(4, 3) / 10, "y": jnp.ones(4)}
  report = ga.check_equivalence(loss_fn, jnp.full(3, 0.1), batch, num_microbatches=2)
  assert isinstance(report, ga.EquivalenceReport) and report.ok


def example_lines():
  """The ``>>>`` and ``...`` lines of every public docstring."""
  docs = [getattr(ga, name).__doc__ or "" for name in ga.__all__]
  return "\n".join(
    line for doc in docs for line in doc.splitlines() if line.strip().startswith((">>>", "..."))
  )


def is_slow(decorators):
  return any("slow" in ast.unparse(d) for d in decorators)


def fast_test_source(node_id):
  """The source of a test function, asserting that neither it nor its module is marked slow."""
  path, name = node_id.split("::")
  tree = ast.parse((ROOT / path).read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(
      isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
    ):
      assert "slow" not in ast.unparse(node.value), f"{path} is marked slow as a whole"
  (func,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
  assert not is_slow(func.decorator_list), f"{node_id} is marked slow"
  return ast.unparse(func)


def test_every_public_name_is_called_in_the_fast_tier():
  examples = example_lines()
  uncovered = []
  for name in ga.__all__:
    if re.search(rf"\b{name}\b", examples):
      continue  # a doctest uses it
    tests = FAST_TESTS.get(name, [])
    if not any(re.search(rf"\bga\.{name}\b", fast_test_source(t)) for t in tests):
      uncovered.append(name)
  assert not uncovered, (
    f"public names that no doctest and no fast test in FAST_TESTS uses: {uncovered}; add a "
    "doctest example, or a fast test and its entry in tests/test_fast_tier.py"
  )
