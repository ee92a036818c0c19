"""What the backend actually sent in a `shard` step: `ops.recording`'s records, summed
under `step.stats()`'s keys, so byte and count claims rest on the wire, not on the
bookkeeping that `stats()` keeps beside it."""

from __future__ import annotations

import contextlib
from collections import Counter

from shardfn._backend import ops

STATS_KEYS = ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "num_collectives")


def totals(records: list[ops.Collective], qgz: bool = False) -> dict[str, int]:
    """Bytes per kind (`<op>_bytes`, zero when absent) and `num_collectives` of `records`.
    `qgz`: the all-to-alls are quantized gradient reductions, which `stats()` counts as
    `reduce_scatter_bytes` ([Note: qgZ] in shardfn/_fsdp/qgz.py)."""
    out = Counter({key: 0 for key in STATS_KEYS})
    for c in records:
        op = "reduce_scatter" if qgz and c.op == "all_to_all" else c.op
        out[f"{op}_bytes"] += c.nbytes
        out["num_collectives"] += 1
    return dict(out)


@contextlib.contextmanager
def sent():
    """In a rank thread: `with sent() as rec:` records what this rank sends (`rec.records`)."""
    with ops.recording() as rec:
        yield rec


def stats_view(stats: dict) -> dict[str, int]:
    """`step.stats()` restricted to the keys the recording can check."""
    return {key: stats[key] for key in STATS_KEYS}
