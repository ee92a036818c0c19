"""`sf.pipeline`: pipeline parallelism, a namespace like `sf.nn`, `sf.hf` and `sf.init`
that is also the transform itself.

- `sf.pipeline(layer_fn, post=..., microbatches=..., schedule="1f1b", ...)`: the
  transform (`sf.pipeline.transform`), a loss over stages of stacked layers;
- `sf.pipeline.schedule(name, stages, microbatches, virtual_stages=1)`: a built-in
  schedule as data ("gpipe", "1f1b", "interleaved", "zb-h1"), `sf.pipeline.SCHEDULES`
  their names; `sf.pipeline.Schedule(...)` and `sf.pipeline.Action(...)` to write one;
- `sf.pipeline.stack_layers(layers, virtual_stages)` / `unstack_layers(...)`: per-layer
  trees to one stacked tree (a leading layer dim) and back; `stage_specs(...)` their
  specs over the stage axis;
- `sf.pipeline.Pipeline`: what the transform returns.

See docs/howto/pipeline.md. The flat names of earlier releases (`sf.pipeline_schedule`,
`sf.PipelineSchedule`, `sf.PipelineAction`, `sf.stack_layers`, `sf.unstack_layers`,
`sf.Pipeline`) still work, with a DeprecationWarning naming these.
"""

import sys
import types

from ._pipeline import SCHEDULES as SCHEDULES
from ._pipeline import Action as Action
from ._pipeline import Pipeline as Pipeline
from ._pipeline import Schedule as Schedule
from ._pipeline import make_schedule as schedule
from ._pipeline import pipeline as transform
from ._pipeline import stack_layers as stack_layers
from ._pipeline import stage_specs as stage_specs
from ._pipeline import unstack_layers as unstack_layers

__all__ = ["transform", "schedule", "SCHEDULES", "Schedule", "Action", "Pipeline", "stack_layers",
           "unstack_layers", "stage_specs"]

# the flat names of earlier releases -> their place here (shardfn/__init__.py's __getattr__)
FLAT = {"pipeline_schedule": "schedule", "PipelineSchedule": "Schedule", "PipelineAction": "Action",
        "Pipeline": "Pipeline", "stack_layers": "stack_layers", "unstack_layers": "unstack_layers"}


class _Namespace(types.ModuleType):
    """The module, callable: `sf.pipeline(...)` is `sf.pipeline.transform(...)`."""

    def __call__(self, *args, **kwargs):
        return transform(*args, **kwargs)


sys.modules[__name__].__class__ = _Namespace
