"""Shared test helpers: one tree comparison, a small model, data (compiled HLO: ga.inspect_step),
and the setup several test modules share, built on first use (importing a test module compiles
nothing)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


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


# --- setup several test modules share, built on first use -------------------------------------


def mlp_params(sizes=(6, 16, 3), key=0):
  """``init_mlp(jax.random.key(key), sizes)``, computed once per ``(sizes, key)``: the same
  arrays at every call, in a fresh dict."""
  return jax.tree.map(lambda x: x, _mlp_params(tuple(sizes), key))


@functools.cache
def _mlp_params(sizes, key):
  with jax.ensure_compile_time_eval():  # concrete arrays, even when first called under a trace
    return init_mlp(jax.random.key(key), sizes)


def mlp_batch(batch_size, key=1):
  """``make_batch(jax.random.key(key), batch_size)``, computed once per ``(batch_size, key)``:
  the same arrays at every call, in a fresh dict."""
  return dict(_mlp_batch(batch_size, key))


@functools.cache
def _mlp_batch(batch_size, key):
  with jax.ensure_compile_time_eval():
    return make_batch(jax.random.key(key), batch_size)


@functools.cache
def mesh_1d(kind="explicit"):
  """The 8 CPU devices (tests/conftest.py) as one "data" axis, Explicit (``jax.make_mesh``'s
  default) or Auto; made once per kind."""
  axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
  return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


@functools.cache
def mesh_2d(kind="explicit"):
  """The 8 CPU devices as a 4 x 2 ("data", "model") mesh, both axes Explicit or both Auto;
  made once per kind."""
  axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def put(tree, mesh, spec):
  """device_put every leaf with NamedSharding(mesh, spec); spec may be a pytree prefix."""
  specs = jax.tree.broadcast(spec, tree, is_leaf=lambda s: isinstance(s, P))
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)
