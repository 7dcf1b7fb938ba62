"""gradaccum_jax: exact, fast gradient accumulation for JAX and optax."""

import importlib.metadata

from gradaccum_jax._accumulate import Accumulate as Accumulate
from gradaccum_jax._accumulate import AccumulateState as AccumulateState
from gradaccum_jax._accumulate import DynamicLossScale as DynamicLossScale
from gradaccum_jax._accumulate import LossScaleState as LossScaleState
from gradaccum_jax._accumulate import accumulate as accumulate
from gradaccum_jax._accumulate import flush as flush
from gradaccum_jax._accumulate import has_updated as has_updated
from gradaccum_jax._autosize import auto_microbatch as auto_microbatch
from gradaccum_jax._autosize import step_memory as step_memory
from gradaccum_jax._equivalence import EquivalenceReport as EquivalenceReport
from gradaccum_jax._equivalence import StepCheck as StepCheck
from gradaccum_jax._equivalence import check_equivalence as check_equivalence
from gradaccum_jax._equivalence import check_step as check_step
from gradaccum_jax._flax import linen_train_step as linen_train_step
from gradaccum_jax._inspect import StepReport as StepReport
from gradaccum_jax._inspect import inspect_step as inspect_step
from gradaccum_jax._lr import scale_adam_hyperparams as scale_adam_hyperparams
from gradaccum_jax._lr import scale_learning_rate as scale_learning_rate
from gradaccum_jax._lr import scale_weight_decay as scale_weight_decay
from gradaccum_jax._micro_step import micro_step as micro_step
from gradaccum_jax._microbatch import microbatch as microbatch
from gradaccum_jax._nnx import nnx_train_step as nnx_train_step
from gradaccum_jax._noise import NoiseScaleState as NoiseScaleState
from gradaccum_jax._noise import noise_scale as noise_scale
from gradaccum_jax._privacy import clipped_grad as clipped_grad
from gradaccum_jax._privacy import dp_accumulate as dp_accumulate
from gradaccum_jax._ramp import ramp_train_step as ramp_train_step
from gradaccum_jax._train_step import train_step as train_step
from gradaccum_jax._train_step import value_and_grad as value_and_grad

try:
  __version__ = importlib.metadata.version("gradaccum_jax")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
  __version__ = "0.0.0+unknown"

__all__ = (
  "Accumulate",
  "AccumulateState",
  "DynamicLossScale",
  "EquivalenceReport",
  "LossScaleState",
  "NoiseScaleState",
  "StepCheck",
  "StepReport",
  "accumulate",
  "auto_microbatch",
  "flush",
  "check_equivalence",
  "check_step",
  "clipped_grad",
  "dp_accumulate",
  "has_updated",
  "inspect_step",
  "linen_train_step",
  "micro_step",
  "microbatch",
  "nnx_train_step",
  "ramp_train_step",
  "noise_scale",
  "scale_adam_hyperparams",
  "scale_learning_rate",
  "scale_weight_decay",
  "step_memory",
  "train_step",
  "value_and_grad",
)
