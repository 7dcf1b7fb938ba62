"""Bad input: a clear error that names the offending value, raised before any work."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import init_mlp, make_batch, xent_loss

import gradaccum_jax as ga


@pytest.fixture
def params():
  return init_mlp(jax.random.key(0))


@pytest.mark.parametrize(
  "bad, error, match",
  [
    (0, ValueError, "num_microbatches=0 must be a positive int"),
    (-3, ValueError, "num_microbatches=-3 must be a positive int"),
    (2.5, TypeError, "num_microbatches=2.5 must be a positive int"),
    ("4", TypeError, "num_microbatches='4' must be a positive int"),
    (True, TypeError, "num_microbatches=True must be a positive int"),
    (None, TypeError, "num_microbatches=None must be a positive int"),
  ],
)
@pytest.mark.parametrize("factory", ["accumulate", "value_and_grad"])
def test_bad_num_microbatches(factory, bad, error, match):
  with pytest.raises(error, match=re.escape(match)):
    if factory == "accumulate":
      ga.accumulate(optax.sgd(0.1), bad)
    else:
      ga.value_and_grad(xent_loss, bad)


def test_numpy_int_is_accepted():
  import numpy as np

  tx = ga.accumulate(optax.sgd(0.1), np.int64(4))
  ga.train_step(xent_loss, tx)


def test_schedule_passed_to_train_step():
  tx = ga.accumulate(optax.sgd(0.1), lambda count: 4)
  with pytest.raises(TypeError, match="fixed int number of micro-batches"):
    ga.train_step(xent_loss, tx)


@pytest.mark.parametrize(
  "tx",
  [
    optax.adam(1e-3),
    optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4),
    optax.chain(optax.clip(1.0), ga.accumulate(optax.adam(1e-3), 4)),
  ],
  ids=["adam", "multisteps", "chained"],
)
def test_tx_not_from_accumulate(tx):
  with pytest.raises(TypeError, match=r"tx must be made by ga.accumulate"):
    ga.train_step(xent_loss, tx)


def test_inner_not_a_transformation():
  with pytest.raises(
    TypeError, match="inner must be an optax.GradientTransformation, got function"
  ):
    ga.accumulate(optax.adam, 4)


def traced_loss():
  calls = [0]

  def loss_fn(params, batch):
    calls[0] += 1
    return xent_loss(params, batch)

  return loss_fn, calls


def test_batch_not_divisible_names_b_and_k(params):
  loss_fn, calls = traced_loss()
  tx = ga.accumulate(optax.sgd(0.1), 3)
  step = ga.train_step(loss_fn, tx)
  with pytest.raises(ValueError, match=r"batch size B=16 is not divisible by num_microbatches k=3"):
    step(params, tx.init(params), make_batch(jax.random.key(1), 16))
  with pytest.raises(ValueError, match=r"B=16 .* k=3"):
    ga.value_and_grad(loss_fn, 3)(params, make_batch(jax.random.key(1), 16))
  assert calls[0] == 0  # raised before the loss was even traced


def test_leaves_with_different_leading_dims(params):
  loss_fn, calls = traced_loss()
  batch = {"x": jnp.zeros((16, 6)), "y": jnp.zeros((12,), jnp.int32)}
  with pytest.raises(ValueError, match=r"different leading.*\['x'\]: 16, \['y'\]: 12"):
    ga.value_and_grad(loss_fn, 4)(params, batch)
  assert calls[0] == 0


def test_scalar_batch_leaf(params):
  batch = {"x": jnp.zeros((16, 6)), "y": jnp.zeros((16,), jnp.int32), "temperature": jnp.ones(())}
  with pytest.raises(ValueError, match=r"batch leaf \['temperature'\] is a scalar"):
    ga.value_and_grad(xent_loss, 4)(params, batch)


def test_grads_structure_mismatch(params):
  tx = ga.accumulate(optax.sgd(0.1), 4)
  state = tx.init(params)
  grads = {"layer0": params["layer0"]}  # a sub-tree
  with pytest.raises(ValueError, match="do not match the structure of the parameters"):
    tx.update(grads, state, params)


def test_grads_shape_mismatch(params):
  tx = ga.accumulate(optax.sgd(0.1), 4)
  state = tx.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  grads["layer1"]["w"] = jnp.zeros((3, 16))
  with pytest.raises(ValueError, match=r"\['layer1'\]\['w'\] has shape \(3, 16\).*\(16, 3\)"):
    tx.update(grads, state, params)


def test_weight_of_wrong_shape(params):
  tx = ga.accumulate(optax.sgd(0.1), 4)
  state = tx.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  with pytest.raises(ValueError, match=r"weight must be a scalar.*shape \(4,\)"):
    tx.update(grads, state, params, weight=jnp.ones(4))


def test_weight_fn_returning_an_array(params):
  with pytest.raises(ValueError, match=r"weight_fn\(microbatch\) must be a scalar.*shape \(4,\)"):
    ga.value_and_grad(xent_loss, 4, weight_fn=lambda mb: jnp.ones(4))(
      params, make_batch(jax.random.key(1), 16)
    )


def test_loss_not_scalar(params):
  def per_example(params, batch):
    return jnp.sum(jax.nn.log_softmax(batch["x"] @ params["layer0"]["w"]), -1)

  with pytest.raises(ValueError, match=r"must return a scalar.*shape \(4,\)"):
    ga.value_and_grad(per_example, 4)(params, make_batch(jax.random.key(1), 16))


def test_has_aux_without_pair(params):
  with pytest.raises(TypeError, match=r"has_aux=True, loss_fn must return a pair"):
    ga.value_and_grad(xent_loss, 4, has_aux=True)(params, make_batch(jax.random.key(1), 16))


def test_aux_without_has_aux(params):
  def with_aux(params, batch):
    return xent_loss(params, batch), {"n": 1.0}

  with pytest.raises(TypeError, match=r"returned a tuple of length 2; .* pass has_aux=True"):
    ga.value_and_grad(with_aux, 4)(params, make_batch(jax.random.key(1), 16))


def test_wrong_state_to_train_step(params):
  tx = ga.accumulate(optax.adam(1e-3), 4)
  step = ga.train_step(xent_loss, tx)
  with pytest.raises(TypeError, match=r"state must be tx.init\(params\).*got tuple"):
    step(params, optax.adam(1e-3).init(params), make_batch(jax.random.key(1), 16))
  with pytest.raises(TypeError, match="has_updated expects an AccumulateState"):
    ga.has_updated(optax.adam(1e-3).init(params))


def test_state_for_other_params(params):
  tx = ga.accumulate(optax.adam(1e-3), 4)
  other = init_mlp(jax.random.key(0), sizes=(6, 8, 3))
  step = ga.train_step(xent_loss, tx)
  with pytest.raises(ValueError, match=r"\['layer0'\]\['b'\] has shape \(16,\).*\(8,\)"):
    step(params, tx.init(other), make_batch(jax.random.key(1), 16))


# --- errors that name the ga argument or signature to change ------------------------------------


def test_a_step_given_rng_for_a_two_argument_loss_names_the_signature(params):
  tx = ga.accumulate(optax.sgd(0.1), 2)
  step = ga.train_step(xent_loss, tx)
  with pytest.raises(TypeError, match=r"ga calls loss_fn\(params, microbatch, rng\).*add an rng"):
    step(params, tx.init(params), make_batch(jax.random.key(0), 8), jax.random.key(1))


def test_a_three_argument_loss_without_rng_says_how_to_call_it(params):
  tx = ga.accumulate(optax.sgd(0.1), 2)
  step = ga.train_step(lambda p, mb, key: xent_loss(p, mb), tx)
  with pytest.raises(TypeError, match=r"call the step with rng=key.*has_state=True"):
    step(params, tx.init(params), make_batch(jax.random.key(0), 8))


def test_tx_update_without_params_for_an_inner_that_needs_them_names_tx_update(params):
  tx = ga.accumulate(optax.adamw(1e-3), 1)
  grads = jax.tree.map(jnp.ones_like, params)
  with pytest.raises(ValueError, match=r"inner optimizer of ga.accumulate needs the params.*"
                     r"tx.update\(grads, state, params\)"):  # fmt: skip
    tx.update(grads, tx.init(params))


def test_the_value_error_says_what_works_and_that_works():
  """An inner optimizer that needs value= in streaming mode: the message says to pass it on
  every call, and doing so runs (the closing call's value reaches the inner optimizer)."""
  inner = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=0, factor=0.5))
  tx = ga.accumulate(inner, 2)
  w = jnp.ones(3)
  state = tx.init(w)
  with pytest.raises(TypeError, match=r"pass them to every tx.update call"):
    tx.update(jnp.ones(3), state, w)
  for value in (1.0, 1.0):
    _, state = tx.update(jnp.ones(3), state, w, value=jnp.asarray(value))
  assert int(state.count) == 1
