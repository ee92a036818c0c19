"""`shard`: fully sharded data parallelism (FSDP / ZeRO-3) as a function transform.

The modules, in the order data flows through them:

  config.py    `shard`'s options, checked once into a frozen `Config`; `MixedPrecision`
  tp.py        FSDP x TP: `param_specs` resolved and checked per leaf ([Note: FSDP x TP])
  plan.py      the layout: units, per-leaf chunks, flat buffers; a frozen `Plan` per tree
  groups.py    per rank: the process groups and dtypes of a step, fixed
  gather.py    a unit's all-gather: pack (or encode), all-gather, copy out (or decode)
  reduce.py    gradient reduction as plain functions (reduce-scatter, HSDP / TP all-reduces)
  batch.py     the loss mean over the data axes and uneven local batches (`batch_weighting`)
  autograd.py  the autograd Functions (gather a unit, reduce its gradients, the loss mean)
  held.py      buffers that count their own bytes in `stats()` (`Held`, `Meter`)
  unit.py      one unit's lifecycle: its buffers, `UnitState`, the per-step `UnitStep`, and
               its transitions pre_forward / post_forward / pre_backward / post_backward
  schedule.py  `StepMode` (what kind of call runs) and `Schedule` (access order, prefetch)
  reducer.py   per rank: `Reducer`, a unit's gradients -> its shard gradients by step mode
               (at once, deferred, accumulated); it owns the deferred reduce-scatters
  runtime.py   per rank: `RankState`, when each unit transition runs, leaf resolution
  view.py      shard's side of the params view (`make_view`, `current_scope`, `stacked`)
  funcgrad.py  `torch.func.grad(step)` of a step alone, run on that path below the transform
  step.py      the public `Shard` step and `shard()`

Generic pieces it uses live below it, so that `sf.functional`, `sf.remat`, `sf.pipeline`
and `sf.optim` never import `shard` (tests/test_package.py checks the layering):

  ../_params_view.py  the read-only params view `loss_fn` receives, `together`, `materialize`
  ../_autodiff.py     `eager_grad_and_value`: `grad_and_value` on eager autograd (the fast path)
  ../_binding.py      the thread-local mesh binding (`shard` and `shard_map` push it)

docs/fsdp_design.md explains the design.
"""

from .config import MixedPrecision as MixedPrecision
from .step import Shard as Shard
from .step import shard as shard

__all__ = ["MixedPrecision", "Shard", "shard"]
