"""Test configuration: 8 CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The modules whose tests take the longest (notebooks, benchmark smoke runs, the property search,
# the docs build: 20-90 s each on 2 cores). Collected first, so that under ``pytest -n 2``
# xdist hands them out at the start, alternately to each worker, and the short tests fill in
# around them, rather than one long test running alone at the end.
LONGEST_FIRST = (
  "test_notebook.py",
  "test_benchmarks_smoke.py",
  "test_properties.py",
  "test_docs.py",
)


def pytest_collection_modifyitems(config, items):
  items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # stable: order kept within
