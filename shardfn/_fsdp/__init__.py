"""`shard`: fully sharded data parallelism (FSDP / ZeRO-3) as a function transform.

The modules, in the order data flows through them:

  config.py    `shard`'s options, checked once into a frozen `Config`; `MixedPrecision`
  tp.py        FSDP x TP: `param_specs` resolved and checked per leaf ([Note: FSDP x TP])
  plan.py      the layout: units, per-leaf chunks, flat buffers; a frozen `Plan` per tree
  groups.py    per rank: the process groups and dtypes of a step, fixed
  reduce.py    gradient reduction as plain functions (reduce-scatter, HSDP / TP all-reduces)
  batch.py     the loss mean over the data axes and uneven local batches (`batch_weighting`)
  autograd.py  the autograd Functions (gather a unit, reduce its gradients, the loss mean)
  runtime.py   per rank: `Schedule`, `StepMode`, unit states, leaf resolution
  view.py      the read-only params view `loss_fn` receives, fetching leaves on first access
  eager.py     `grad_and_value` on eager autograd (the training fast path)
  funcgrad.py  `torch.func.grad(step)` of a step alone, run on that path below the transform
  step.py      the public `Shard` step and `shard()`

docs/fsdp_design.md explains the design.
"""

from .config import MixedPrecision as MixedPrecision
from .step import Shard as Shard
from .step import shard as shard

__all__ = ["MixedPrecision", "Shard", "shard"]
