"""What the allocator did inside a torch.profiler region: the tests' independent measure of memory."""

from __future__ import annotations


def net_and_peak(prof) -> tuple[int, int]:
    """(bytes allocated minus freed, most bytes live at once) within the profiled region of
    `prof` (profile_memory=True), from the allocator's own events: memory allocated before
    the region is not counted. Only the profiled thread's allocations are seen."""
    live = peak = 0
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return live, peak
