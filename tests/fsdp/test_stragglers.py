"""Stragglers ([Note: busy time] in shardfn/_fsdp/stragglers.py): every rank's step and busy
time in `stats()` after `step.check_stragglers()`, and a warning naming a rank that is
slower in each of the last `patience` steps. The slow rank is made by fault injection
(`faults.delay`: it sleeps before its first collective of every step)."""

import warnings

import pytest
import torch

import shardfn as sf
from shardfn.testing import faults

DELAY_S = 0.6  # far above this model's step (~10 ms; ~170 ms seen on a loaded 2-core machine)


def loss_fn(p, x):
    for layer in p["layers"]:
        x = torch.tanh(x @ layer["w"])
    return x.square().mean()


PARAMS = {"layers": [{"w": torch.eye(8) * 0.5} for _ in range(2)]}


def _run(mesh, fault_list, steps: int):
    """Per rank, per step: (slow ranks, busy times, step times); and the warnings' texts
    (recorded on the main thread: the warnings filters are process-wide, not per thread)."""
    step = sf.shard(loss_fn, mesh)

    def body():
        shards = step.shard_params(PARAMS)
        out = []
        with faults.inject(mesh, *fault_list):
            for _ in range(steps):
                torch.func.grad(step)(shards, torch.ones(2, 8))
                report = step.check_stragglers(patience=3)
                stats = step.stats()
                out.append((report["slow"], stats["rank_busy_time_s"], stats["rank_step_time_s"]))
        return out

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", sf.StragglerWarning)
        per_rank = mesh.run(body)
    return per_rank, [str(w.message) for w in caught if issubclass(w.category, sf.StragglerWarning)]


def test_a_delayed_rank_is_named_after_patience_steps():
    mesh = sf.local_mesh({"data": 4}, timeout=30)
    per_rank, messages = _run(mesh, [faults.delay(2, DELAY_S, step=None, collective=1)], steps=4)
    for rank, out in enumerate(per_rank):
        slow = [s for s, *_ in out]
        assert slow == [[], [], [2], [2]], (rank, slow)  # named once 3 checks in a row saw it
        for _, busy, step_time in out:
            assert busy[2] >= DELAY_S and max(busy[:2] + busy[3:]) < DELAY_S / 2, busy
            assert all(t >= DELAY_S for t in step_time)  # every rank's step took the delay: they waited
    assert len(messages) == 4 * 2, messages  # every rank warns, at steps 3 and 4
    assert all(m.startswith("rank 2 is consistently slower: in each of the last 3 steps its busy time")
               for m in messages), messages
    assert "Fix: look at that rank's host" in messages[0]


def test_stats_has_no_times_without_the_check():
    mesh = sf.local_mesh({"data": 2}, timeout=30)
    step = sf.shard(loss_fn, mesh)

    def body():
        shards = step.shard_params(PARAMS)
        with pytest.raises(sf.ShardingError, match="check_stragglers: this step has not run on this rank yet"):
            step.check_stragglers()
        torch.func.grad(step)(shards, torch.ones(2, 8))
        keys = set(step.stats())
        step.check_stragglers()
        return keys, set(step.stats()) - keys

    for before, added in mesh.run(body):
        assert "rank_busy_time_s" not in before
        assert added == {"rank_step_time_s", "rank_busy_time_s"}
