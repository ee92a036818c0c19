"""Stragglers: each rank's time per step, and a warning naming a rank that is consistently slower.

[Note: busy time] In a synchronous step every rank's wall time is about the same: the fast
ranks wait inside collectives for the slow one. What gives a straggler away is its *busy*
time: the step's wall time (from `begin_step` to the end of its last collective) less the
time it spent waiting for collectives, both read from the flight recorder's issue, wait and
end times ([Note: flight recorder] in shardfn/_backend/flight.py): no timer of its own.
`Shard.check_stragglers()` (opt-in, one 16-byte-per-rank all-gather over every mesh axis,
not counted in `stats()`'s bytes) exchanges the two numbers, puts them in `stats()`, and
warns (`StragglerWarning`) when one rank's busy time exceeded `ratio` times the median of
the others' and `min_s` more, in each of the last `patience` checks.
"""

from __future__ import annotations

import collections
import statistics
import time
import warnings

import torch

from .._backend import flight, ops

__all__ = ["StragglerWarning", "local_times", "check"]


class StragglerWarning(UserWarning):
    """A rank has been consistently slower than its peers (its busy time per step)."""


def local_times(state) -> tuple[float, float]:
    """`(step_s, busy_s)` of this rank's last step of `state` (a RankState)."""
    backend = state.mesh._backend
    ring = flight.ring(backend, backend.rank())
    started = state.started
    end, waited = None, 0.0
    for e in reversed(ring):
        if e[flight.T_ISSUE] < started:
            break
        if e[flight.STEP] != state.calls or e[flight.T_END] is None:
            continue
        end = e[flight.T_END] if end is None else max(end, e[flight.T_END])
        waited += e[flight.T_END] - e[flight.T_WAIT]
    step_s = (time.time() if end is None else end) - started
    return step_s, max(step_s - waited, 0.0)


def check(state, *, ratio: float, patience: int, min_s: float) -> dict:
    """See `Shard.check_stragglers`."""
    group = state.groups.all
    step_s, busy_s = local_times(state)
    mine = torch.tensor([step_s, busy_s], dtype=torch.float64, device=state.groups.device)
    rows = (ops.all_gather(group, mine) if group.size > 1 else mine).reshape(group.size, 2).cpu()  # (k, 2)
    ranks = list(group.ranks)
    steps, busy = rows[:, 0].tolist(), rows[:, 1].tolist()
    history = state.__dict__.setdefault("straggler_history", collections.deque(maxlen=patience))
    if history.maxlen != patience:
        history = state.straggler_history = collections.deque(history, maxlen=patience)
    slow_now = set()
    for i in range(len(ranks)):
        others = busy[:i] + busy[i + 1:]
        if others:
            median = statistics.median(others)
            if busy[i] > ratio * median and busy[i] - median > min_s:
                slow_now.add(i)
    history.append((slow_now, busy))
    slow = sorted(set.intersection(*(s for s, _ in history))) if len(history) == patience else []
    state.timings = {"rank_step_time_s": steps, "rank_busy_time_s": busy}
    for i in slow:
        seen = ", ".join(f"{b[i]:.3f}" for _, b in history)
        medians = ", ".join(f"{statistics.median(b[:i] + b[i + 1:]):.3f}" for _, b in history)
        warnings.warn(StragglerWarning(
            f"rank {ranks[i]} is consistently slower: in each of the last {patience} steps its busy time "
            f"(the step's time outside collective waits) was over {ratio:g}x the other ranks' median: "
            f"{seen} s against {medians} s.\nFix: look at that rank's host (other load, throttling, a slow "
            f"input pipeline) or its work (a larger batch, a rank-dependent branch)."), stacklevel=3)
    return {"ranks": ranks, "step_time_s": steps, "busy_time_s": busy, "slow": [ranks[i] for i in slow]}
