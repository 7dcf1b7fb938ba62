"""Reverse-mode differentiation through streaming accumulation, as through optax itself.

A meta-gradient (learned optimizers, hyper-gradients) differentiates the params after some
updates with respect to the starting params or the data. ``tx.update`` and ``ga.flush`` close
their windows in ``lax.cond`` branches, so ``jax.grad`` goes through them; the reference is the
same two windows unrolled by hand (the mean of each window's gradients, one inner update each),
in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradaccum_jax as ga

INNERS = {
  "sgd": lambda: optax.sgd(0.1),
  "momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "adam": lambda: optax.adam(0.05),
}
K = 3

pytestmark = pytest.mark.slow  # gradients through whole windows


def loss_fn(w, x):
  return jnp.mean(jnp.tanh(x @ w) ** 2)


def data():
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.standard_normal((2, K, 4, 3))), jnp.asarray(rng.standard_normal(3))


def streamed(tx, w, xs, close_with_flush=False):
  """The params after two windows of K streaming updates each (the last by ga.flush)."""
  state = tx.init(w)
  for window in xs:
    for i, x in enumerate(window):
      if close_with_flush and i == len(window) - 1:
        _, state = tx.update(jax.grad(loss_fn)(w, x), state, w)
        updates, state = ga.flush(tx, state, w)
      else:
        updates, state = tx.update(jax.grad(loss_fn)(w, x), state, w)
      w = optax.apply_updates(w, updates)
  return w


def unrolled(inner, w, xs):
  state = inner.init(w)
  for window in xs:
    g = sum(jax.grad(loss_fn)(w, x) for x in window) / len(window)
    updates, state = inner.update(g, state, w)
    w = optax.apply_updates(w, updates)
  return w


@pytest.mark.parametrize("name", list(INNERS))
@pytest.mark.parametrize("closing", ["update", "flush"])
def test_grad_through_two_streaming_windows_equals_the_unrolled_reference(name, closing):
  with jax.enable_x64(True):
    xs, w0 = data()
    xs, w0 = xs.astype(jnp.float64), w0.astype(jnp.float64)
    # With flush, each window is K - 1 updates and a flush of the open window.
    k = K if closing == "update" else K + 1
    tx = ga.accumulate(INNERS[name](), k, accum_dtype=jnp.float64)
    outer = lambda f: jax.jit(jax.grad(lambda w, xs: jnp.sum(f(w, xs) ** 2), argnums=(0, 1)))  # noqa: E731
    got = outer(lambda w, xs: streamed(tx, w, xs, closing == "flush"))(w0, xs)
    want = outer(lambda w, xs: unrolled(INNERS[name](), w, xs))(w0, xs)
    for g, r in zip(got, want, strict=True):
      assert g.dtype == jnp.float64
      assert bool(jnp.all(jnp.isfinite(g)))
      np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-12)
    assert float(jnp.max(jnp.abs(want[0]))) > 1e-3  # a meta-gradient that is not zero


def test_grad_through_a_ga_micro_step_window():
  """ga.micro_step closes in a lax.cond too: jax.grad of the params after a window."""
  xs, w0 = data()
  tx = ga.accumulate(optax.adam(0.05), K)
  step = ga.micro_step(lambda w, mb: loss_fn(w, mb["x"]), tx, jit=False)

  def after(w):
    state = step.init(w)
    for x in xs[0]:
      w, state, _ = step(w, state, {"x": x})
    return jnp.sum(w**2)

  got = jax.jit(jax.grad(after))(w0)
  want = jax.jit(jax.grad(lambda w: jnp.sum(unrolled(optax.adam(0.05), w, xs[:1]) ** 2)))(w0)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
