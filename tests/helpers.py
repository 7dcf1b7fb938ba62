"""Shared test helpers: one tree comparison, a small model, data, reading compiled HLO."""

import re

import jax
import jax.numpy as jnp
import numpy as np


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
  """Leafwise np.testing.assert_allclose, with the same tree structure."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected), (
    jax.tree.structure(actual),
    jax.tree.structure(expected),
  )
  for (path, a), e in zip(
    jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
  ):
    np.testing.assert_allclose(
      np.asarray(a, np.float64),
      np.asarray(e, np.float64),
      rtol=rtol,
      atol=atol,
      err_msg=f"at {jax.tree_util.keystr(path)}",
    )


def max_abs_diff(a, b):
  return max(
    float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def init_mlp(key, sizes=(6, 16, 3), dtype=jnp.float32):
  params = {}
  for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
    key, wk, bk = jax.random.split(key, 3)
    params[f"layer{i}"] = {
      "w": (jax.random.normal(wk, (m, n)) / np.sqrt(m)).astype(dtype),
      "b": (0.1 * jax.random.normal(bk, (n,))).astype(dtype),
    }
  return params


def mlp(params, x):
  n = len(params)
  for i in range(n):
    x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
    if i < n - 1:
      x = jnp.tanh(x)
  return x


def xent_loss(params, batch):
  """Mean softmax cross-entropy over the (micro-)batch."""
  logits = mlp(params, batch["x"])
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def make_batch(key, batch_size, d_in=6, num_classes=3):
  xk, yk = jax.random.split(key)
  return {
    "x": jax.random.normal(xk, (batch_size, d_in)),
    "y": jax.random.randint(yk, (batch_size,), 0, num_classes),
  }


# --- reading a compiled HLO module --------------------------------------------------------------

_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s")
_CALLED = re.compile(
  r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)"
  r"|branch_computations=\{([^}]*)\}"
)


def computations(hlo_text):
  """{computation name: its instruction lines} of an HLO module's text."""
  comps, current = {}, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and line.rstrip().endswith("{"):
      current = comps.setdefault(header.group(1), [])
    elif line.startswith("}"):
      current = None
    elif current is not None:
      current.append(line)
  return comps


def reachable(comps, roots):
  """The computations ``roots`` are or call, transitively."""
  seen, stack = set(), list(roots)
  while stack:
    name = stack.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for line in comps[name]:
      for one, many in _CALLED.findall(line):
        stack.extend([one] if one else [c.strip().lstrip("%") for c in many.split(",")])
  return seen


def called_by(comps, op):
  """The computations every ``op`` instruction (``while``, ``conditional``) calls directly."""
  return [
    one or name.strip().lstrip("%")
    for lines in comps.values()
    for line in lines
    if re.search(rf"\s{op}\(", line)
    for one, many in _CALLED.findall(line)
    for name in ([""] if one else many.split(","))
  ]


def in_while_loops(comps):
  """The while bodies and conditions, and every computation they call (fusions, nested loops)."""
  return reachable(comps, called_by(comps, "while"))


def in_branches(comps):
  """The branches of every conditional, and every computation they call."""
  return reachable(comps, called_by(comps, "conditional"))
