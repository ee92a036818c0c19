"""What kind of step is running (`StepMode`) and which units to gather when (`Schedule`):
pure bookkeeping, learned step to step; `RankState` (runtime.py) acts on its answers.
"""

from __future__ import annotations

import enum

from .plan import UnitPlan

__all__ = ["StepMode", "Schedule"]


class StepMode(enum.Enum):
    EAGER = "eager"  # each unit's gradient is reduced and waited when its backward ends
    DEFERRED = "deferred"  # Shard.grad_and_value: reduce-scatters waited at the end ([Note: deferred reductions])
    ACCUMULATE = "accumulate"  # Shard.accumulate: as EAGER; stats() covers every micro-batch
    ACCUMULATE_HOLD = "accumulate_hold"  # accumulate(mode="reduce_once") before the last micro-batch: no reduction

    @property
    def keeps_stats(self) -> bool:
        return self in (StepMode.ACCUMULATE, StepMode.ACCUMULATE_HOLD)


class Schedule:
    """Which units to gather when: this step's first-access order, the previous step's
    (the prefetch plan), and how far ahead to prefetch. Pure bookkeeping: the RankState
    acts on its answers."""

    def __init__(self, units: tuple[UnitPlan, ...], prefetch: int):
        self.units = units
        self.prefetch = prefetch
        self.order: list[int] = []  # units in first-access order, this step
        self.prev_order: list[int] = []  # ... on the previous step
        self.in_forward = False

    def begin_step(self) -> None:
        self.prev_order, self.order = (self.order or self.prev_order), []
        self.in_forward = True

    def prefetch_after(self, u: int) -> list[int]:
        """Forward: the units to start gathering once unit u is entered."""
        if self.prefetch <= 0 or u not in self.prev_order:
            return []
        pos = self.prev_order.index(u)
        return [i for i in self.prev_order[pos + 1: pos + 1 + self.prefetch] if self.units[i].sharded]

    def backward_next(self, upcoming: list[int]) -> tuple[list[int], list[int]]:
        """Backward: of the units whose backward is still to come (next first), those to
        have gathered now — frozen ones (they have no node to do it for the next) up to
        the first trainable one — and `prefetch` more to start."""
        need = []
        for i in upcoming:
            need.append(i)
            if not self.units[i].frozen:
                break
        return need, upcoming[len(need): len(need) + self.prefetch]
