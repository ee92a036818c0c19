"""Buffers that count their own bytes: a `Held` is one buffer of a unit (a send buffer, an
all-gather output, the unsharded buffer, the hpZ rows, the encoded shards) as the
statistics see it. It adds its bytes to `Stats` (`peak_gathered_bytes`) when it is taken
and removes them when it is freed, so the gather code allocates and frees buffers and
never counts by hand.
"""

from __future__ import annotations

__all__ = ["Meter", "Held"]


class Meter:
    """Bytes of one kind of buffer alive now, and the most at once since `reset`."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.live = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)


class Held:
    """The bytes of one buffer, counted in `stats` (a `reduce.Stats`) while it is alive,
    and in `meter` too if given. `take` counts a buffer (replacing any held before),
    `free` uncounts it; both report to `stats.hold` even for zero bytes, so every change
    of the gathered bytes is a moment a recorder wrapping `stats.hold` sees (_dry_run.py)."""

    __slots__ = ("stats", "meter", "nbytes")

    def __init__(self, stats, meter: Meter | None = None):
        self.stats = stats
        self.meter = meter
        self.nbytes = 0

    def take(self, nbytes: int) -> None:
        self._add(nbytes - self.nbytes)

    def free(self) -> None:
        self._add(-self.nbytes)

    def _add(self, delta: int) -> None:
        self.nbytes += delta
        self.stats.hold(delta)
        if self.meter is not None:
            self.meter.add(delta)

    @property
    def held(self) -> bool:
        return self.nbytes > 0
