"""Losses of several terms (docs/usage.md, "Losses with several terms"), against the objective
written over the whole batch at once: each term's masked sum over the batch divided by its own
count, plus a term that weighs 1 per micro-batch (its mean over the batch, the micro-batches
being of one size), differentiated by plain ``jax.grad``. Every fused entry point (the Flax
steps' too) with two token-weighted terms, on a mesh and over a voided window:
tests/test_mode_matrix.py's terms cells."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, init_mlp, make_batch, mesh_1d, mlp

import gradaccum_jax as ga

B, LR = 32, 0.1
PARAMS = init_mlp(jax.random.key(0), (6, 8, 3))


def make(key=2, k=4):
  """A batch whose "ce" tokens are ~70 % of the rows and whose "mtp" tokens fall in micro-batch
  0 only (strided micro-batches: rows 0, k, 2k, ...), so in the others "mtp" is 0 / 0."""
  batch = make_batch(jax.random.key(1), B)
  ce = (jax.random.uniform(jax.random.key(key), (B,)) > 0.3).astype(jnp.float32)
  mtp = ((jnp.arange(B) % k == 0) & (jnp.arange(B) % 3 != 1)).astype(jnp.float32)
  return dict(batch, ce=ce, mtp=mtp)


def row_losses(params, batch):
  logits = mlp(params, batch["x"])
  ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1)[:, 0]
  return ce, jnp.sum(logits**2, axis=1)


def loss_fn(params, mb):
  ce, sq = row_losses(params, mb)
  return {
    "ce": jnp.sum(ce * mb["ce"]) / jnp.sum(mb["ce"]),
    "mtp": jnp.sum(ce * mb["mtp"]) / jnp.sum(mb["mtp"]),  # NaN where it has no tokens
    "z": 1e-2 * jnp.mean(sq),  # weighs 1 per micro-batch (weight_fn does not name it)
  }


def weight_fn(mb):
  return {"ce": jnp.sum(mb["ce"]), "mtp": jnp.sum(mb["mtp"])}


def terms_of(params, batch):
  """Each term's value over the whole batch (the micro-batches are of one size)."""
  ce, sq = row_losses(params, batch)
  return {
    "ce": jnp.sum(ce * batch["ce"]) / jnp.sum(batch["ce"]),
    "mtp": jnp.sum(ce * batch["mtp"]) / jnp.sum(batch["mtp"]),
    "z": 1e-2 * jnp.mean(sq),
  }


def objective(params, batch):
  return sum(terms_of(params, batch).values())


def sgd(params, batch):
  return jax.tree.map(lambda p, g: p - LR * g, params, jax.grad(objective)(params, batch))


def first(batch, m, k):
  """The rows of micro-batches 0..m-1 (a short window)."""
  return jax.tree.map(
    lambda *xs: jnp.concatenate(xs), *(ga.microbatch(batch, i, k) for i in range(m))
  )


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 4])
def test_value_and_grad_is_the_whole_batch_s(k):
  batch = make(k=k)
  loss, grads = jax.jit(ga.value_and_grad(loss_fn, k, weight_fn=weight_fn))(PARAMS, batch)
  want_loss, want = jax.value_and_grad(objective)(PARAMS, batch)
  assert np.isfinite(float(loss)) and abs(float(loss) - float(want_loss)) < 1e-5
  assert_trees_close(grads, want)


@pytest.mark.slow
@pytest.mark.parametrize("grads_in_place", [True, False])
@pytest.mark.parametrize("accum_dtype", [jnp.float32, jnp.bfloat16])
def test_train_step_updates_as_the_whole_batch(grads_in_place, accum_dtype):
  batch, k = make(), 4
  tx = ga.accumulate(optax.sgd(LR), k, accum_dtype=accum_dtype)
  step = ga.train_step(loss_fn, tx, weight_fn=weight_fn, grads_in_place=grads_in_place)
  new, state, metrics = step(PARAMS, tx.init(PARAMS), batch)
  tol = 1e-6 if accum_dtype == jnp.float32 else 2e-3
  assert_trees_close(new, sgd(PARAMS, batch), rtol=tol, atol=tol)
  want = terms_of(PARAMS, batch)
  assert abs(float(metrics["loss"]) - float(sum(want.values()))) < 1e-5
  for t, v in want.items():
    assert abs(float(metrics["loss_terms"][t]) - float(v)) < 1e-5, t
  counts = {"ce": batch["ce"].sum(), "mtp": batch["mtp"].sum(), "z": k}
  for t, n in counts.items():
    assert float(metrics["term_weights"][t]) == pytest.approx(float(n)), t
  assert int(state.num_skipped) == 0 and bool(metrics["updated"])


@pytest.mark.slow
def test_a_short_window_normalizes_over_its_own_micro_batches():
  batch, k, m = make(), 4, 2
  tx = ga.accumulate(optax.sgd(LR), k)
  new, _, metrics = ga.train_step(loss_fn, tx, weight_fn=weight_fn)(
    PARAMS, tx.init(PARAMS), batch, num_real_microbatches=m
  )
  assert_trees_close(new, sgd(PARAMS, first(batch, m, k)))
  assert float(metrics["term_weights"]["z"]) == m


@pytest.mark.slow
def test_on_a_mesh_each_term_is_normalized_over_every_device():
  batch, k = make(k=2), 2
  tx = ga.accumulate(optax.sgd(LR), k)
  step = ga.train_step(loss_fn, tx, weight_fn=weight_fn, mesh=mesh_1d(), data_axis="data")
  new, _, metrics = step(PARAMS, tx.init(PARAMS), batch)
  # Rows of one micro-batch on each device: "mtp" is 0 / 0 on every device but the ones that
  # hold rows 0, 2, 4, ... of their shard where the mask is set; each term over all of them.
  assert_trees_close(new, sgd(PARAMS, batch))
  assert float(metrics["term_weights"]["z"]) == k * 8  # 1 per micro-batch per device
  assert float(metrics["term_weights"]["mtp"]) == float(batch["mtp"].sum())


@pytest.mark.slow
def test_without_per_term_weights_the_terms_are_summed():
  """A scalar weight_fn weighs every term alike: the weighted mean of the terms' sum."""
  batch, k = make(), 4
  scalar = lambda mb: jnp.sum(mb["ce"])  # noqa: E731
  simple = lambda p, mb: {"ce": loss_fn(p, mb)["ce"], "z": loss_fn(p, mb)["z"]}  # noqa: E731
  tx = ga.accumulate(optax.sgd(LR), k)
  new, _, metrics = ga.train_step(simple, tx, weight_fn=scalar)(PARAMS, tx.init(PARAMS), batch)

  def by_hand(p):
    ws = [scalar(ga.microbatch(batch, i, k)) for i in range(k)]
    ls = [sum(simple(p, ga.microbatch(batch, i, k)).values()) for i in range(k)]
    return sum(w * v for w, v in zip(ws, ls, strict=True)) / sum(ws)

  assert_trees_close(new, jax.tree.map(lambda p, g: p - LR * g, PARAMS, jax.grad(by_hand)(PARAMS)))
  assert abs(float(metrics["loss"]) - float(by_hand(PARAMS))) < 1e-5
  assert set(metrics["loss_terms"]) == {"ce", "z"} and "term_weights" not in metrics


@pytest.mark.slow
def test_terms_with_aux_keep_the_aux():
  batch, k = make(), 4

  def with_aux(p, mb):
    return loss_fn(p, mb), {"tokens": jnp.sum(mb["ce"]).astype(jnp.int32)}

  tx = ga.accumulate(optax.sgd(LR), k)
  step = ga.train_step(with_aux, tx, weight_fn=weight_fn, has_aux=True)
  new, _, metrics = step(PARAMS, tx.init(PARAMS), batch)
  assert_trees_close(new, sgd(PARAMS, batch))
  assert int(metrics["aux"]["tokens"]) == int(batch["ce"].sum())  # integers summed
  loss, grads = ga.value_and_grad(with_aux, k, weight_fn=weight_fn, has_aux=True)(PARAMS, batch)
  assert int(loss[1]["tokens"]) == int(batch["ce"].sum())


@pytest.mark.slow
def test_a_window_whose_terms_all_weigh_zero_is_voided():
  batch = dict(make(), ce=jnp.zeros(B), mtp=jnp.zeros(B))
  only_named = lambda p, mb: {t: v for t, v in loss_fn(p, mb).items() if t != "z"}  # noqa: E731
  tx = ga.accumulate(optax.sgd(LR), 4)
  new, state, metrics = ga.train_step(only_named, tx, weight_fn=weight_fn)(
    PARAMS, tx.init(PARAMS), batch
  )
  assert not bool(metrics["updated"]) and int(state.num_skipped) == 1
  assert_trees_close(new, PARAMS, rtol=0, atol=0)


@pytest.mark.slow
def test_tx_update_with_totals_known_up_front_is_the_whole_batch_s():
  """docs/usage.md's recipe for tx.update: differentiate k * sum_t w_t / W_t * L_t, weight 1."""
  batch, k = make(), 4
  totals = {"ce": batch["ce"].sum(), "mtp": batch["mtp"].sum(), "z": k}
  tx = ga.accumulate(optax.sgd(LR), k)
  params, state = PARAMS, tx.init(PARAMS)

  def scaled(p, mb):
    w = dict(weight_fn(mb), z=1.0)
    terms = loss_fn(p, mb)
    return k * sum(jnp.where(w[t] > 0, w[t] / totals[t] * terms[t], 0.0) for t in terms)

  for i in range(k):
    mb = ga.microbatch(batch, i, k)
    grads = jax.grad(scaled)(params, mb)
    if i > 0:  # "mtp" is 0 / 0 here: its gradient is NaN even where it weighs 0
      assert not all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
      grads = jax.grad(lambda p, mb=mb: scaled_without_mtp(p, mb, totals, k))(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert_trees_close(params, sgd(PARAMS, batch))


def scaled_without_mtp(p, mb, totals, k):
  terms = loss_fn(p, mb)
  return k * (jnp.sum(mb["ce"]) / totals["ce"] * terms["ce"] + terms["z"] / totals["z"])


@pytest.mark.slow
@pytest.mark.parametrize("grads_in_place", [True, False])
def test_per_term_weights_keep_the_in_place_add_and_its_peak(grads_in_place):
  """Where JAX adds in place, a loss with per-term weights does too (its empty terms are
  checked on the forward pass), and its compiled peak is the one-term step's plus at most three
  micro-batches' activations (the pass term by term runs a forward pass of its own beside the
  first one's residuals); carried, plus one gradient (the terms' sum beside one term's)."""
  params = init_mlp(jax.random.key(0), (64, 256, 3))
  batch, k = dict(make(), **make_batch(jax.random.key(1), B, d_in=64)), 4
  tx = ga.accumulate(optax.adam(1e-3), k)
  kw = dict(donate=True, grads_in_place=grads_in_place)
  one = ga.train_step(
    lambda p, mb: sum(loss_fn(p, mb).values()), tx, weight_fn=lambda mb: jnp.sum(mb["ce"]), **kw
  )
  terms = ga.train_step(loss_fn, tx, weight_fn=weight_fn, **kw)
  r_one = ga.inspect_step(one, params, tx.init(params), batch)
  r_terms = ga.inspect_step(terms, params, tx.init(params), batch)
  assert r_terms.grads_in_place == r_one.grads_in_place
  A = sum(x.size * 4 for x in jax.tree.leaves(params))
  residuals = (B // k) * (64 + 256 + 3) * 4  # one micro-batch's activations, float32
  peaks = [
    s.lower(params, tx.init(params), batch).compile().memory_analysis().temp_size_in_bytes
    for s in (one, terms)
  ]
  extra = 3 * residuals + (0 if r_terms.grads_in_place else A)
  assert 0 <= peaks[1] - peaks[0] <= extra, (peaks, A, residuals)


@pytest.mark.slow
def test_per_term_weights_on_stacked_layers_add_in_place_at_the_one_term_peak():
  """Stacked blocks under one lax.scan, gradients added in place: the pass term by term adds
  each term's gradient into the accumulator too, so the peak stays within three micro-batches'
  activations of the one-term step's (a loop over the terms there held one more accumulator);
  carried, one gradient more."""
  L, D, k = 4, 64, 4
  params = {"w": jax.random.normal(jax.random.key(0), (L, D, D)) / D**0.5}

  def rows(p, mb):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), mb["x"], p["w"])
    return jnp.sum(h**2, axis=1)

  def terms(p, mb):
    r = rows(p, mb)
    return {"a": jnp.sum(r * mb["ce"]) / jnp.sum(mb["ce"]), "b": jnp.sum(r * mb["mtp"]) / jnp.sum(mb["mtp"])}  # fmt: skip

  batch = dict(make(k=k), x=jax.random.normal(jax.random.key(3), (B, D)))
  tx = ga.accumulate(optax.adam(1e-3), k)
  one = ga.train_step(
    lambda p, mb: sum(terms(p, mb).values()), tx, weight_fn=lambda mb: jnp.sum(mb["ce"]),
    donate=True,
  )  # fmt: skip
  per_term = ga.train_step(terms, tx, donate=True, weight_fn=lambda mb: {"a": jnp.sum(mb["ce"]), "b": jnp.sum(mb["mtp"])})  # fmt: skip
  peaks = [
    s.lower(params, tx.init(params), batch).compile().memory_analysis().temp_size_in_bytes
    for s in (one, per_term)
  ]
  activations = (B // k) * D * (L + 1) * 4  # the block inputs and output of one micro-batch
  in_place = ga.inspect_step(per_term, params, tx.init(params), batch).grads_in_place
  A = params["w"].size * 4  # carried (JAX 0.10): the terms' sum beside one term's gradient
  scalars = 64  # the per-term weights' finiteness check (a NaN weight voids the window)
  bound = 3 * activations + (0 if in_place else A) + scalars
  assert peaks[1] - peaks[0] <= bound, (peaks, activations)


# --- per-term weights and window statistics together (issue 61) -------------------------------

CLASSES, K = 4, 4


def _router(p, x):
  return jnp.tanh(x @ p["w1"]) @ p["w2"]


def _counts(p, mb):
  """The window statistic: the real tokens routed to each class (top 1)."""
  top = jnp.argmax(_router(p, mb["x"]), -1)
  hot = jax.nn.one_hot(top, CLASSES, dtype=jnp.int32) * mb["m"][..., None].astype(jnp.int32)
  return jnp.sum(hot, axis=(0, 1))


def _ce_and_balance(p, mb, stats):
  """A token cross-entropy and a global-batch balance loss (the window's fractions ``f``, each
  micro-batch's mean router probability): what MoE users train."""
  logp = jax.nn.log_softmax(_router(p, mb["x"]))
  nll = -jnp.take_along_axis(logp, mb["y"][..., None], -1)[..., 0]
  m = mb["m"]
  f = stats / jnp.maximum(jnp.sum(stats), 1)
  probs = jnp.sum(jnp.exp(logp) * m[..., None], axis=(0, 1)) / jnp.sum(m)
  return {"ce": jnp.sum(nll * m) / jnp.sum(m), "balance": CLASSES * jnp.sum(probs * f)}


def _tokens(mb):
  return {"ce": jnp.sum(mb["m"]), "balance": jnp.sum(mb["m"])}


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["value_and_grad", "value_and_grad_mesh", "train_step", "nnx"])
def test_per_term_weights_and_window_statistics_combine_to_the_big_batch(entry):
  """Token-weighted terms, one reading the window's statistics (before: "weight_fn(microbatch)
  must be a scalar number"): the loss and gradient of the whole batch, whose balance loss reads
  the whole batch's fractions, on one device and eight."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  p = {"w1": jax.random.normal(k1, (5, 8)), "w2": jax.random.normal(k2, (8, CLASSES))}
  lengths = jnp.array([1, 6, 3, 0, 2, 5, 4, 6] * 4)  # uneven, one empty row in each micro-batch
  batch = {
    "x": jax.random.normal(k3, (32, 6, 5)), "y": jax.random.randint(k3, (32, 6), 0, CLASSES),
    "m": (jnp.arange(6)[None] < lengths[:, None]).astype(jnp.float32),
  }  # fmt: skip

  def whole(p, b):
    terms = _ce_and_balance(p, b, jax.lax.stop_gradient(_counts(p, b)))
    return terms["ce"] + terms["balance"]

  loss, grads = jax.value_and_grad(whole)(p, batch)
  kw = dict(weight_fn=_tokens, window_stats=_counts)
  if entry.startswith("value_and_grad"):
    mesh = jax.make_mesh((8,), ("data",)) if entry.endswith("mesh") else None
    got_loss, got = jax.jit(ga.value_and_grad(_ce_and_balance, K, mesh=mesh, **kw))(p, batch)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-5)
  elif entry == "train_step":
    tx = ga.accumulate(optax.sgd(1.0), K)
    new, _, metrics = ga.train_step(_ce_and_balance, tx, **kw)(p, tx.init(p), batch)
    got = jax.tree.map(lambda a, b: a - b, p, new)  # sgd(1.0): the gradient
    np.testing.assert_array_equal(metrics["window_stats"], _counts(p, batch))
  else:
    from flax import nnx

    class Router(nnx.Module):
      def __init__(self):
        self.w1, self.w2 = nnx.Param(p["w1"].copy()), nnx.Param(p["w2"].copy())

    model = Router()
    optimizer = nnx.Optimizer(model, ga.accumulate(optax.sgd(1.0), K), wrt=nnx.Param)
    as_params = lambda m: {"w1": m.w1[...], "w2": m.w2[...]}  # noqa: E731
    step = ga.nnx_train_step(
      lambda m, mb, s: _ce_and_balance(as_params(m), mb, s), weight_fn=_tokens,
      window_stats=lambda m, mb: _counts(as_params(m), mb),
    )  # fmt: skip
    step(model, optimizer, batch)
    got = jax.tree.map(lambda a, b: a - b, p, as_params(model))
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(grads), strict=True):
    np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-6)
