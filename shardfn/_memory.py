"""`sf.measure_memory`: the bytes a piece of code allocates, as the allocator counts them.

[Note: measuring memory per thread] Peak RSS says nothing at this scale (~218 MB after
`import torch`), and on the simulated mesh every rank shares one process. So the bytes are
taken from the allocator itself:

- on an accelerator (CUDA, ...): `torch.accelerator.memory_allocated` at entry and
  `max_memory_allocated` (its peak, reset at entry) at exit. These are the device's
  counters, for every thread of the process using that device;
- on the CPU: the allocator's own events, recorded by `torch.profiler` with
  `profile_memory=True`, summed in time order. The profiler records the thread that
  started it, and that thread only (checked on torch 2.13: a thread allocating 4 MiB
  blocks in a loop beside a profiled 1000-byte allocation leaves the profiled peak at
  1000 bytes), so on the simulated mesh a rank thread measures itself: what its ops
  allocate, not gloo's threads nor the other ranks. CPU backward ops run in the thread
  that calls `backward()` / `torch.func.grad`, so they are counted.

Two profilers at once in one process crash it (a segmentation fault, torch 2.13), and two
measurements of one device's counters would reset each other's peak: one measurement
runs at a time per process and device kind; a second, from another thread, is an error
rather than a wait (rank threads wait on each other in collectives: waiting here could
deadlock). On the simulated mesh, measure one rank (`if mesh.rank == 0:`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator

import torch

from ._errors import ShardingError

__all__ = ["measure_memory", "MemoryReport"]

_busy = {"cpu": threading.Lock(), "accelerator": threading.Lock()}


@dataclasses.dataclass
class MemoryReport:
    """What `sf.measure_memory` counted, filled in when its `with` block ends.

    Attributes:
      device: the device whose allocations were counted.
      peak_bytes: the most bytes allocated at once inside the block, above what was
        allocated when it began.
      net_bytes: bytes allocated minus bytes freed inside the block (what it left allocated).
        On the CPU, freeing memory allocated before the block is not seen (the profiler
        does not know that block's size), so only the block's own allocations count; on an
        accelerator the device counter falls with it too.
    """

    device: torch.device
    peak_bytes: int = 0
    net_bytes: int = 0


def _default_device() -> torch.device:
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


@contextlib.contextmanager
def measure_memory(device: torch.device | str | None = None) -> Iterator[MemoryReport]:
    """Measure the peak and net bytes the code inside a `with` block allocates on `device`.

    On the CPU the calling thread's allocations are counted (the allocator's events, seen
    by `torch.profiler`), so on the simulated mesh each rank thread measures itself; on an
    accelerator the device's own counters are read, for the whole process
    ([Note: measuring memory per thread]). Memory allocated before the block is not
    counted; the peak is relative to the level at entry. Compare with `sf.estimate`, which
    predicts the same peak for a `shard` step from a dry run.

    Args:
      device: the device to count: `"cpu"`, `"cuda"`, `"cuda:1"`, ... Default: the current
        accelerator if there is one, else the CPU (pass `"cpu"` to measure a CPU step on a
        machine with a GPU).

    Returns:
      A context manager yielding a `MemoryReport`; its `peak_bytes` and `net_bytes` are
      set when the block ends.

    Raises:
      ShardingError: another thread of this process is measuring the same kind of device
        (two CPU profilers at once crash the process; accelerator peaks are per device).

    Example:
      >>> import shardfn as sf, torch
      >>> with sf.measure_memory("cpu") as m:
      ...     x = torch.empty(1024, 1024)  # 4 MiB, kept
      ...     y = torch.empty(2048, 1024)  # 8 MiB, freed below
      ...     del y
      >>> m.peak_bytes, m.net_bytes
      (12582912, 4194304)
    """
    device = torch.device(device) if device is not None else _default_device()
    kind = "cpu" if device.type == "cpu" else "accelerator"
    lock = _busy[kind]
    if not lock.acquire(blocking=False):
        raise ShardingError(
            f"sf.measure_memory: another thread of this process is already measuring {kind} memory "
            f"({'two torch.profiler sessions at once crash the process' if kind == 'cpu' else 'the device keeps one peak counter'}).\n"
            f"Fix: measure one thread at a time; on the simulated mesh, one rank (if mesh.rank == 0: ...)."
        )
    report = MemoryReport(device=device)
    try:
        if kind == "cpu":
            with _cpu_events(report):
                yield report
        else:
            start = torch.accelerator.memory_allocated(device)
            torch.accelerator.reset_peak_memory_stats(device)
            try:
                yield report
            finally:
                report.peak_bytes = torch.accelerator.max_memory_allocated(device) - start
                report.net_bytes = torch.accelerator.memory_allocated(device) - start
    finally:
        lock.release()


@contextlib.contextmanager
def _cpu_events(report: MemoryReport) -> Iterator[None]:
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
    finally:
        report.net_bytes, report.peak_bytes = net_and_peak(prof)


def allocations(prof) -> list[tuple[int, int]]:
    """(time ns, signed bytes) of the blocks the profiling thread allocated inside the
    region of `prof` (a `torch.profiler.profile(profile_memory=True)`): each allocation,
    and its free when that thread frees it, in time order.

    The profiler records the profiling thread's allocator events only, and among them the
    frees of blocks allocated before the region or by another thread: gloo's worker thread
    allocates a collective's copy buffer and which thread drops the last reference is a
    race; the garbage collector, run inside the region, frees an earlier test's tensors.
    Frees are matched to allocations by address, and a free of a block not allocated here
    is left out (unmatched, such frees made a measurement 16% low, or 0.5 MiB off in 1 MiB,
    at random)."""
    from torch._C._profiler import _EventType

    events = sorted((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size)
                    for e in _event_tree(prof.profiler.kineto_results.experimental_event_tree())
                    if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu")
    held, out = {}, []
    for t, ptr, nbytes in events:
        if nbytes > 0:
            held[ptr] = nbytes
            out.append((t, nbytes))
        elif held.pop(ptr, None) is not None:
            out.append((t, nbytes))
    return out


def _event_tree(nodes):
    for e in nodes:
        yield e
        yield from _event_tree(e.children)


def net_and_peak(prof) -> tuple[int, int]:
    """(bytes allocated minus freed, most bytes live at once) on the CPU within the region
    profiled by `prof`, from the allocator's own events (`allocations`): memory allocated
    before the region is not counted, and only the profiling thread's allocations are seen
    ([Note: measuring memory per thread])."""
    live = peak = 0
    for _, nbytes in allocations(prof):
        live += nbytes
        peak = max(peak, live)
    return live, peak
