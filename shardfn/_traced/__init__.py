"""The traced train step: `sf.jit(step, opt)` ([Note: the traced step] in step.py)."""

from .module import traced_apply
from .step import TracedStep, jit

__all__ = ["TracedStep", "jit", "traced_apply"]
