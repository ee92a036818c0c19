"""Pipeline parallelism: schedules as data, one executor, the `sf.pipeline` transform."""

from .schedule import SCHEDULES, Action, Schedule, make_schedule
from .stages import stack_layers, stage_specs, unstack_layers
from .transform import Pipeline, pipeline

__all__ = ["pipeline", "Pipeline", "Schedule", "Action", "make_schedule", "SCHEDULES", "stack_layers",
           "unstack_layers", "stage_specs"]
