"""Every row of docs/failure_behaviour.md, run: the error type and message start, or a voided window."""

import builtins
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import make_batch, mesh_2d, mlp_batch, mlp_params, xent_loss

import gradaccum_jax as ga

TABLE = Path(__file__).parent.parent / "docs" / "failure_behaviour.md"
K = 4


def rows():
  out = {}
  for line in TABLE.read_text().splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if (
      len(cells) == 2
      and line.startswith("|")
      and not set(cells[0]) <= {"-"}
      and cells[0] != "Bad input"
    ):
      out[cells[0]] = cells[1]
  return out


def base_params():
  """The MLP 6-3 that the rows run unless they say otherwise."""
  return mlp_params((6, 3))


def base_batch():
  return mlp_batch(16)


def fused(batch=None, loss_fn=xent_loss, params=None, inner=None, k=K, **kw):
  batch = base_batch() if batch is None else batch
  params = base_params() if params is None else params
  tx = ga.accumulate(inner or optax.sgd(0.1), k)
  return ga.train_step(loss_fn, tx, **kw)(params, tx.init(params), batch)


def streaming(weight):
  tx = ga.accumulate(optax.sgd(0.1), 2)
  return tx.update(
    jax.grad(xent_loss)(base_params(), base_batch()),
    tx.init(base_params()),
    base_params(),
    weight=weight,
  )


def with_weights(w):
  batch = dict(base_batch(), w=jnp.asarray(w, jnp.float32))
  return fused(batch, weight_fn=lambda mb: mb["w"].sum())


def nan_term_weight():
  """A NaN weight of one term in one micro-batch voids the window, as a NaN scalar weight does."""
  batch = dict(base_batch(), w=jnp.ones(16).at[5].set(jnp.nan))
  return fused(
    batch, loss_fn=lambda p, mb: {"ce": xent_loss(p, mb), "again": xent_loss(p, mb)},
    weight_fn=lambda mb: {"ce": mb["w"].sum(), "again": 1.0},
  )  # fmt: skip


def nan_row():
  return fused(dict(base_batch(), x=base_batch()["x"].at[3, 1].set(jnp.nan)))


def dp(**kw):
  settings = {"l2_clip": 1.0, "noise_multiplier": 1.0, "expected_batch_size": 16, **kw}
  return ga.dp_accumulate(optax.sgd(0.1), K, **settings)


def dp_nan_example():
  """A NaN in one real example: its gradient adds 0 and the window is applied, as the window
  without that example (padding) is."""
  tx = dp(noise_multiplier=0.0)
  batch = dict(base_batch(), mask=jnp.ones(16))
  bad = dict(batch, x=batch["x"].at[3, 1].set(jnp.nan))
  step = ga.train_step(xent_loss, tx, weight_fn=lambda ex: ex["mask"][0])
  new, state, metrics = step(base_params(), tx.init(base_params()), bad)
  want = step(
    base_params(), tx.init(base_params()), dict(batch, mask=batch["mask"].at[3].set(0.0))
  )[0]
  close = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b)), new, want))
  ok = bool(metrics["updated"]) and int(state.num_skipped) == 0 and all(close)
  return "counted as 0" if ok else "voided or wrong"


def dp_step(**kw):
  tx = dp()
  return ga.train_step(
    xent_loss if "has_state" not in kw else lambda p, s, mb: (xent_loss(p, mb), s), tx, **kw
  )


def empty_term():
  """A second term whose elements are all in micro-batch 0: in the others it is 0 / 0 (NaN) and
  weighs 0, and the window's update is the whole batch's, finite ("counted as 0")."""
  mask = (jnp.arange(16) % K == 0).astype(jnp.float32)
  batch = dict(base_batch(), m=mask)

  def loss_fn(p, mb):
    x2 = jnp.sum(mb["x"][:, 0] ** 2 * p["layer0"]["w"][0, 0] ** 2 * mb["m"]) / jnp.sum(mb["m"])
    return {"ce": xent_loss(p, mb), "sq": x2}

  def whole(p):  # the same objective over the whole batch at once
    x2 = jnp.sum(batch["x"][:, 0] ** 2 * p["layer0"]["w"][0, 0] ** 2 * mask) / jnp.sum(mask)
    return xent_loss(p, batch) + x2

  new, state, metrics = fused(batch, loss_fn, weight_fn=lambda mb: {"sq": jnp.sum(mb["m"])})
  want = jax.tree.map(lambda p, g: p - 0.1 * g, base_params(), jax.grad(whole)(base_params()))
  assert bool(metrics["updated"]) and int(state.num_skipped) == 0
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want), strict=True):
    assert jnp.allclose(a, b, atol=1e-6)
  return "counted as 0"


def terms_in_micro_step():
  tx = ga.accumulate(optax.sgd(0.1), 2)
  step = ga.micro_step(lambda p, mb: {"ce": xent_loss(p, mb)}, tx)
  return step(base_params(), step.init(base_params()), base_batch())


def schedule(value):
  tx = ga.accumulate(optax.sgd(0.1), lambda count: value)
  return tx.update(jnp.ones(2), tx.init(jnp.zeros(2)), jnp.zeros(2))


def missing_feature():
  old = ga.accumulate(optax.sgd(0.1), 2).init(jnp.zeros(2))
  return ga.accumulate(optax.sgd(0.1), 2, loss_scale=ga.DynamicLossScale()).update(
    jnp.ones(2), old, jnp.zeros(2)
  )


def negative_traced():
  w = jnp.ones(16).at[0::K].set(-5.0)  # micro-batch 0 has a negative weight
  _, _, metrics = with_weights(w)
  assert bool(metrics["updated"]) and float(metrics["weight"]) == 12.0
  return "counted as 0"


def micro_step_nan():
  """A NaN in the first of K micro-steps with a model state: the window is voided and the
  model state comes back as the window found it."""
  loss = lambda p, ms, mb: (xent_loss(p, mb), {"n": ms["n"] + jnp.mean(mb["x"])})  # noqa: E731
  step = ga.micro_step(loss, ga.accumulate(optax.sgd(0.1), K), has_state=True)
  params, ms = base_params(), {"n": jnp.zeros(())}
  state = step.init(params, model_state=ms)
  for i in range(K):
    mb = ga.microbatch(base_batch(), i, K)
    mb = dict(mb, x=mb["x"].at[0, 0].set(jnp.nan)) if i == 0 else mb
    params, ms, state, metrics = step(params, ms, state, mb)
  assert not bool(metrics["updated"]) and int(state.accumulate.num_skipped) == 1
  assert float(ms["n"]) == 0.0
  return "restored"


def swapped():
  tx = ga.accumulate(optax.sgd(0.1), K)
  return ga.train_step(xent_loss, tx)(base_batch(), tx.init(base_params()), base_params())


def nnx_module():
  from flax import nnx

  model = nnx.Sequential(nnx.Linear(6, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
  tx = ga.accumulate(optax.sgd(0.1), K)
  loss = lambda m, mb: xent_loss({"layer0": {"w": jnp.eye(6, 3), "b": m(mb["x"])[0]}}, mb)  # noqa: E731
  return ga.micro_step(loss, tx)(model, tx.init(model), ga.microbatch(base_batch(), 0, K))


def _aux_loss(p, mb):
  return xent_loss(p, mb), {"n": jnp.sum(mb["y"]), "m": jnp.max(mb["x"])}


def aux_reduce(spec):
  return fused(loss_fn=_aux_loss, has_aux=True, aux_reduce=spec)


def fp8_refused(where):
  tx = ga.accumulate(optax.sgd(0.1), K)
  fp8_vars = {"params": base_params(), "_overwrite_with_gradient": {"amax_history": jnp.zeros(4)}}
  if where == "micro_step":
    stream = ga.micro_step(lambda v, mb: xent_loss(v["params"], mb), tx)
    return stream(fp8_vars, stream.init(fp8_vars), ga.microbatch(base_batch(), 0, K))
  if where == "tx.update":
    return tx.update(jax.tree.map(jnp.zeros_like, fp8_vars), tx.init(base_params()), fp8_vars)
  more = {**fp8_vars, "batch_stats": {"mean": jnp.zeros(3)}}
  return ga.train_step(lambda v, mb: xent_loss(v["params"], mb), tx)(
    more, tx.init(base_params()), base_batch()
  )


def nested_shard_map():
  """A loss with its own shard_map over "model" inside the step's shard_map over "data"."""
  mesh = mesh_2d("explicit")
  spec = jax.sharding.PartitionSpec

  def loss_fn(w, mb):
    def inner(w_shard, x):
      return jax.lax.psum(jnp.sum((x @ w_shard) ** 2), "model")

    tp = jax.shard_map(inner, mesh=mesh, in_specs=(spec(None, "model"), spec()), out_specs=spec())
    return tp(w, mb["x"]) / mb["x"].shape[0]

  w = jnp.ones((6, 8))
  return fused(params=w, loss_fn=loss_fn, mesh=mesh, data_axis="data")


def check_open_window():
  tx = ga.accumulate(optax.sgd(0.1), K)
  state = tx.init(base_params())
  _, state = tx.update(jax.grad(xent_loss)(base_params(), base_batch()), state, base_params())
  return ga.check_step(
    ga.train_step(xent_loss, tx), xent_loss, optax.sgd(0.1), base_params(), state, base_batch()
  )


def check_nnx_not_optimizer():
  from flax import nnx

  model = nnx.Linear(6, 3, rngs=nnx.Rngs(0))

  def loss(m, mb):
    return jnp.mean(m(mb["x"]) ** 2)

  return ga.check_step(ga.nnx_train_step(loss), loss, optax.sgd(0.1), model, None, base_batch())


def check_train_state_and_opt_state():
  import flax.linen as nn
  from flax.training import train_state

  tx = ga.accumulate(optax.sgd(0.1), K)
  m = nn.Dense(3)
  v = m.init(jax.random.key(0), base_batch()["x"])
  ts = train_state.TrainState.create(apply_fn=m.apply, params=v["params"], tx=tx)

  def loss(logits, mb):
    return jnp.mean(logits**2)

  return ga.check_step(
    ga.linen_train_step(m, loss), loss, optax.sgd(0.1), ts, ts.opt_state, base_batch()
  )


def check_micro_step_with_state():
  tx = ga.accumulate(optax.sgd(0.1), K)
  step = ga.micro_step(lambda p, s, mb: (xent_loss(p, mb), s), tx, has_state=True)
  return ga.check_step(
    step, xent_loss, optax.sgd(0.1), base_params(), tx.init(base_params()), base_batch()
  )


def check_without_batch():
  tx = ga.accumulate(optax.sgd(0.1), K)
  return ga.check_step(
    ga.train_step(xent_loss, tx), xent_loss, optax.sgd(0.1), base_params(), tx.init(base_params())
  )


TRIGGERS = {
  "Flax's fp8 collection in `ga.micro_step`'s params": lambda: fp8_refused("micro_step"),
  "Flax's fp8 collection in `tx.update`'s grads": lambda: fp8_refused("tx.update"),
  'fp8 variables with another collection beside `"params"`': lambda: fp8_refused("train_step"),
  "an unknown reducer in `aux_reduce`": lambda: aux_reduce({"n": "sum", "m": "maximum"}),
  "a key in an `aux_reduce` dict that the aux does not have (keys left out keep the default)": lambda: (
    aux_reduce({"max": "max"})
  ),
  "`aux_reduce` of another structure than the aux (a tuple for a dict)": lambda: aux_reduce(
    ("sum", "max")
  ),
  '`aux_reduce="mean"` for an integer aux leaf': lambda: aux_reduce("mean"),
  "`grads_in_place` that is not True or False": lambda: fused(grads_in_place="yes"),
  "params and batch swapped in a step's call": swapped,
  "the `ga.accumulate` transformation as `check_step`'s `inner_tx`": lambda: ga.check_step(
    lambda p, s, b: (p,),
    xent_loss,
    ga.accumulate(optax.sgd(0.1), K),
    base_params(),
    None,
    base_batch(),
  ),
  "`check_step` on a state inside a window (`micro_step > 0`)": check_open_window,
  "`check_step` on an NNX model whose second argument is not its `nnx.Optimizer`": (
    check_nnx_not_optimizer
  ),
  "`check_step` on a TrainState with both `opt_state` and `batch` given": (
    check_train_state_and_opt_state
  ),
  "`check_step` on a `ga.micro_step` with `has_state=True`": check_micro_step_with_state,
  "`check_step` without a batch": check_without_batch,
  "an NNX module with variables other than `nnx.Param` (BatchNorm statistics, `nnx.Rngs`) as a step's params": nnx_module,
  "a step called with `rng=` whose `loss_fn` takes no key": lambda: ga.train_step(
    xent_loss, ga.accumulate(optax.sgd(0.1), K)
  )(
    base_params(),
    ga.accumulate(optax.sgd(0.1), K).init(base_params()),
    base_batch(),
    jax.random.key(0),
  ),
  "`tx.update` without params for an inner optimizer that needs them": lambda: ga.accumulate(
    optax.adamw(0.1), 1
  ).update(
    jax.tree.map(jnp.ones_like, base_params()),
    ga.accumulate(optax.adamw(0.1), 1).init(base_params()),
  ),
  "an inner optimizer that needs `value=`, in streaming mode without it": lambda: ga.accumulate(
    optax.contrib.reduce_on_plateau(), 2
  ).update(jnp.ones(2), ga.accumulate(optax.contrib.reduce_on_plateau(), 2).init(jnp.ones(2))),
  "a NaN in any micro-batch of a `ga.micro_step` window with model state": micro_step_nan,
  "an empty batch (B = 0)": lambda: fused({"x": jnp.zeros((0, 6)), "y": jnp.zeros(0, jnp.int32)}),
  "a batch size that `k` does not divide": lambda: fused(make_batch(jax.random.key(1), 10)),
  "batch leaves with different leading dimensions": lambda: fused(
    dict(base_batch(), y=base_batch()["y"][:8])
  ),
  "a NaN or Inf in any micro-batch's gradient": nan_row,
  "a NaN or Inf weight": lambda: with_weights(jnp.ones(16).at[5].set(jnp.nan)),
  "every weight 0": lambda: with_weights(jnp.zeros(16)),
  "a negative weight, concrete (`tx.update(..., weight=-1.0)`)": lambda: streaming(-1.0),
  "a negative weight computed under `jit` (`weight_fn`)": negative_traced,
  "`weight_fn` returning `None` or a non-number": lambda: fused(weight_fn=lambda mb: None),
  "`weight_fn` returning an array": lambda: fused(weight_fn=lambda mb: mb["x"][:, 0]),
  "a non-scalar loss": lambda: fused(loss_fn=lambda p, mb: mb["x"] @ p["layer0"]["w"]),
  "a term of a loss of several terms that is not a scalar": lambda: fused(
    loss_fn=lambda p, mb: {"ce": xent_loss(p, mb), "aux": mb["x"][:, 0]}
  ),
  "a term of a loss of several terms that is itself a dict": lambda: fused(
    loss_fn=lambda p, mb: {"ce": xent_loss(p, mb), "aux": {"z": xent_loss(p, mb)}}
  ),
  "a per-term weight that is not a number": lambda: fused(
    loss_fn=lambda p, mb: {"ce": xent_loss(p, mb)}, weight_fn=lambda mb: {"ce": "tokens"}
  ),
  "a NaN or Inf per-term weight": nan_term_weight,
  "`weight_fn` naming a term that `loss_fn` does not return": lambda: fused(
    loss_fn=lambda p, mb: {"ce": xent_loss(p, mb)}, weight_fn=lambda mb: {"mtp": 1.0}
  ),
  "`weight_fn` returning per-term weights for a loss of one scalar": lambda: fused(
    weight_fn=lambda mb: {"ce": 1.0}
  ),
  "a term of weight 0 whose value is NaN (the 0/0 of an empty term)": empty_term,
  "a loss of several terms in `ga.micro_step`": terms_in_micro_step,
  "`window_stats=` given to a streaming call (`ga.micro_step`)": lambda: ga.micro_step(
    xent_loss, ga.accumulate(optax.sgd(0.1), 2), window_stats=lambda p, mb: {}
  ),
  "`window_stats_reduce=` of another structure than the statistics": lambda: fused(
    loss_fn=lambda p, mb, s: xent_loss(p, mb),
    window_stats=lambda p, mb: {"n": jnp.sum(mb["y"])},
    window_stats_reduce=("sum", "max"),
  ),
  "`window_stats_reduce=` without `window_stats=`": lambda: fused(window_stats_reduce="sum"),
  "`ga.dp_accumulate` with `l2_clip` not above 0 (or not finite)": lambda: dp(l2_clip=0.0),
  "`ga.dp_accumulate` with a negative `noise_multiplier`": lambda: dp(noise_multiplier=-1.0),
  "`window_stats=` with a `ga.dp_accumulate` transformation": lambda: dp_step(
    window_stats=lambda p, mb: {}
  )(base_params(), dp().init(base_params()), base_batch()),
  "a model state with float leaves (BatchNorm statistics) under `ga.dp_accumulate`": lambda: (
    dp_step(has_state=True)(
      base_params(), {"mean": jnp.zeros(3)}, dp().init(base_params()), base_batch()
    )
  ),
  "`ga.dp_accumulate` with a `seed` outside 64 bits": lambda: dp(seed=2**70),
  "`ga.flush` on the state of a `ga.dp_accumulate` transformation": lambda: ga.flush(
    dp(),
    dp().update(
      jax.tree.map(jnp.ones_like, base_params()), dp().init(base_params()), base_params()
    )[1],
    base_params(),
  ),
  "`weight_fn(example)` under `ga.dp_accumulate` returning a non-number": lambda: dp_step(
    weight_fn=lambda ex: "real"
  )(base_params(), dp().init(base_params()), base_batch()),
  "`ga.clipped_grad` given a transformation of `ga.accumulate`": lambda: ga.clipped_grad(
    xent_loss, ga.accumulate(optax.sgd(0.1), 2)
  ),
  "a real example whose gradient is not finite under `ga.dp_accumulate`": dp_nan_example,
  "a `loss_fn` that takes no statistics, given `window_stats=`": lambda: fused(
    window_stats=lambda p, mb: {"n": jnp.sum(mb["y"])}
  ),
  "`(loss, aux)` returned without `has_aux=True`": lambda: fused(
    loss_fn=lambda p, mb: (xent_loss(p, mb), 1.0)
  ),
  "an integer or bool leaf in the params": lambda: fused(
    params=dict(base_params(), step=jnp.zeros((), jnp.int32))
  ),
  "a `num_microbatches` schedule returning 0 or less": lambda: schedule(0),
  "a `num_microbatches` schedule returning a float": lambda: schedule(2.7),
  "a schedule given to a fused step": lambda: ga.train_step(
    xent_loss, ga.accumulate(optax.sgd(0.1), lambda c: 2)
  ),
  "a state made without a feature the transformation has": missing_feature,
  "the inner optimizer's state instead of `tx.init(params)`": lambda: ga.train_step(
    xent_loss, ga.accumulate(optax.sgd(0.1), K)
  )(base_params(), optax.sgd(0.1).init(base_params()), base_batch()),
  "gradients with another structure than the params": lambda: ga.accumulate(
    optax.sgd(0.1), 2
  ).update({"w": jnp.ones(2)}, ga.accumulate(optax.sgd(0.1), 2).init(base_params())),
  "`num_real_microbatches` outside `1..k`": lambda: ga.train_step(
    xent_loss, ga.accumulate(optax.sgd(0.1), K)
  )(
    base_params(),
    ga.accumulate(optax.sgd(0.1), K).init(base_params()),
    base_batch(),
    num_real_microbatches=5,
  ),
  "`ga.microbatch` index outside `0..k-1`": lambda: ga.microbatch(base_batch(), 5, 4),
  "an inner optimizer that needs `value_fn=` (a line search)": lambda: fused(inner=optax.lbfgs()),
  "a mesh without the data axis": lambda: ga.train_step(
    xent_loss,
    ga.accumulate(optax.sgd(0.1), K),
    mesh=jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,)),
  ),
  "a loss that calls `jax.shard_map` itself (over a model axis) inside a step with `mesh=`": (
    nested_shard_map
  ),
  "a batch beyond the square-root rule's range in `ga.scale_adam_hyperparams` (κ (1 − β) > 1, e.g. `b1=0.9` at 11× the batch)": lambda: (
    ga.scale_adam_hyperparams(0.9, 0.999, 1e-8, 256, 11 * 256)
  ),
  "an unknown `rule` in `ga.scale_adam_hyperparams`": lambda: ga.scale_adam_hyperparams(
    0.9, 0.999, 1e-8, 512, 256, rule="linear"
  ),
  "`every_k_schedule=` (`optax.MultiSteps`' name) given to `ga.accumulate`": lambda: ga.accumulate(
    optax.sgd(0.1), every_k_schedule=4
  ),
  "an `optax.MultiSteps` as `ga.accumulate`'s inner optimizer": lambda: ga.accumulate(
    optax.MultiSteps(optax.sgd(0.1), 4), 2
  ),
  "an optimizer not wrapped in `ga.accumulate`": lambda: ga.train_step(xent_loss, optax.sgd(0.1)),
}


def test_every_row_has_a_trigger():
  assert set(rows()) == set(TRIGGERS)


@pytest.mark.parametrize("row", sorted(TRIGGERS))
def test_row(row):
  expected = rows()[row]
  if expected == "voided window":
    _, state, metrics = TRIGGERS[row]()
    assert not bool(metrics["updated"]) and int(state.num_skipped) == 1
    return
  if expected.startswith("micro-step window voided"):
    assert TRIGGERS[row]() == "restored"
    return
  if not expected.startswith("`"):
    assert TRIGGERS[row]() == "counted as 0"
    return
  error, message = re.fullmatch(r"`(\w+): (.*)`( \(the function you called\))?", expected).groups()[
    :2
  ]
  with pytest.raises(getattr(builtins, error), match=re.escape(message)):
    TRIGGERS[row]()
