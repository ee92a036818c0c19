"""What the allocator did inside a torch.profiler region: the tests' independent measure of memory.

The count itself is shardfn's public one (`sf.measure_memory` uses it on the CPU); this
module keeps the name the tests import for regions they profile themselves."""

from __future__ import annotations

from shardfn._memory import allocations, net_and_peak

__all__ = ["allocations", "net_and_peak"]
