"""Test configuration: 8 CPU devices and XLA:CPU's quick code generation, set before jax is
imported anywhere (the subprocesses some tests start inherit both)."""

import os

# Compiling is most of the suite's time. XLA:CPU's LLVM backend at optimization level 0 compiles
# 2.5x faster (the transformer smoke run's four programs: 6.7 against 16.8 s) and changes only
# the machine code: the optimized HLO the tests read (fusions, loops, collectives, buffers, memory
# analysis) is the same (md5 of the compiled text of the fused step, MLP 784-512-512-10), and
# results agree to rounding (its loss and grad norm bit for bit; after one adam step of lr 1e-3,
# params within 2.7e-5, adam's near-sign update magnifying the gradients' last bits where they
# are tiny). Every test compares programs compiled alike. A flag of the user's own is kept.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
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
