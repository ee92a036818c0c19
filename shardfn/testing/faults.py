"""Fault injection, as a test tool: make a chosen rank fail in a chosen way at a chosen point.

A point is a shard step's call number on the rank (`step`, as the flight recorder labels
collectives: 1 for the first call of a `sf.shard` step on that rank, or the number given
to `shardfn.flight.step`) and the n-th collective the rank issues inside that step
(`collective`, 1-based). The faults hook the one place collectives are issued (the flight
recorder's `on_issue`, [Note: flight recorder] in shardfn/_backend/flight.py) and a unit's
transitions (`UnitRuntime.observer`); nothing is mocked: the collectives that do run are
real.

    from shardfn.testing import faults
    with faults.inject(mesh, faults.kill(rank=1, step=3, collective=2)):
        train(...)

Faults:
  kill(rank, step, collective)        the rank's process dies by a signal (SIGKILL) as it
                                      issues that collective (distributed backend)
  delay(rank, seconds, step, coll.)   the rank sleeps before issuing it (every step if
                                      `step` is None): a straggler
  raise_in_backward(unit, rank, step) the rank raises `InjectedFault` as that unit's
                                      backward begins
  drop_from_store(rank, step, coll.)  the rank leaves without dying: its keys are deleted
                                      from the store and it never issues that collective
                                      (it blocks until killed): a hung or partitioned host
  corrupt_shard(shards, path, ...)    a copy of this rank's shards with one element of one
                                      leaf overwritten (NaN by default)
"""

from __future__ import annotations

import dataclasses
import os
import signal as _signal
import threading
import time

from .. import _tree
from .._backend import flight
from .._errors import SpecError

__all__ = ["Fault", "InjectedFault", "kill", "delay", "raise_in_backward", "drop_from_store", "corrupt_shard",
           "inject"]


class InjectedFault(RuntimeError):
    """The error `raise_in_backward` raises (so a test can tell it from a real one)."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planned fault; build it with `kill`, `delay`, `raise_in_backward` or `drop_from_store`."""

    kind: str  # "kill", "delay", "raise", "drop"
    rank: int | None  # None: every rank
    step: int | None = None  # None: every step
    collective: int | None = 1  # the n-th collective of the step on the rank (None: any)
    unit: str | None = None  # raise: the unit, by its name in messages ("unit ('layers', 1)", "root unit")
    seconds: float = 0.0  # delay
    signal: int = _signal.SIGKILL  # kill

    def matches(self, rank: int, step, n: int) -> bool:
        return ((self.rank is None or self.rank == rank) and (self.step is None or self.step == step)
                and (self.collective is None or self.collective == n))


def kill(rank: int, *, step: int, collective: int = 1, signal: int = _signal.SIGKILL) -> Fault:
    """`rank`'s process dies by `signal` as it issues collective `collective` of step `step`."""
    return Fault("kill", rank, step, collective, signal=signal)


def delay(rank: int, seconds: float, *, step: int | None = None, collective: int = 1) -> Fault:
    """`rank` sleeps `seconds` before issuing collective `collective` of step `step` (of
    every step if None): it computes slower, its peers wait for it."""
    return Fault("delay", rank, step, collective, seconds=float(seconds))


def raise_in_backward(unit: str, *, rank: int, step: int | None = None) -> Fault:
    """`rank` raises `InjectedFault` as the backward of `unit` (a unit's name as shard's
    messages give it: `"unit ('layers', 1)"`, `"root unit"`) begins, in step `step`."""
    return Fault("raise", rank, step, None, unit=unit)


def drop_from_store(rank: int, *, step: int, collective: int = 1) -> Fault:
    """`rank` leaves the job at collective `collective` of step `step` without dying: its
    keys are deleted from the default store and it blocks instead of issuing (distributed
    backend): its peers must time out naming it."""
    return Fault("drop", rank, step, collective)


def corrupt_shard(shards, path: str, *, index: int = 0, value: float = float("nan")):
    """A copy of `shards` with element `index` (flat) of the leaf at `path` (its key path as
    shard's messages write it, e.g. `"['layers'][1]['w']"`) set to `value`; the other
    leaves are the same tensors."""
    paths, leaves, treedef = _tree.flatten_with_paths(shards)
    names = [_tree.keystr(p) for p in paths]
    if path not in names:
        raise SpecError(f"corrupt_shard: no leaf at {path}; the leaves are {names}")
    out = []
    for name, leaf in zip(names, leaves):
        if name == path:
            if not 0 <= index < leaf.numel():
                raise SpecError(f"corrupt_shard: index {index} is outside the leaf at {path} "
                                f"(shape {tuple(leaf.shape)}, {leaf.numel()} elements on this rank)")
            leaf = leaf.detach().clone()
            leaf.view(-1)[index] = value
        out.append(leaf)
    return _tree.unflatten(treedef, out)


class _Counter(threading.local):
    step = None
    n = 0


_active: list = []  # the open `inject`s ([Note: one dispatcher])
_active_lock = threading.Lock()
_previous_observer: list = [None]


def _dispatch_issue(group, op, seq, entry) -> None:
    for inj in list(_active):
        inj._on_issue(group, op, seq, entry)


def _dispatch_observer(unit, name: str) -> None:
    if _previous_observer[0] is not None:
        _previous_observer[0](unit, name)
    for inj in list(_active):
        inj._observer(unit, name)


class inject:
    """Context manager: the faults happen on `mesh`'s ranks while it is open.

    Open it around the training loop on every rank (inside `mesh.run` on a simulated mesh:
    each rank thread's `inject` then acts for that rank only), or once around `mesh.run`.
    [Note: one dispatcher] The hooks are process-wide (the flight recorder's `on_issue`,
    `UnitRuntime.observer`): one dispatcher is installed while any `inject` is open, and
    asks each open one in turn.

    Example: `with faults.inject(mesh, faults.delay(1, 0.5)): train()`."""

    def __init__(self, mesh, *faults: Fault):
        self.backend = mesh._backend
        self.faults = faults
        for f in faults:
            if f.kind in ("kill", "drop") and self.backend.kind != "distributed":
                raise SpecError(f"faults.{'kill' if f.kind == 'kill' else 'drop_from_store'}: needs a process per "
                                f"rank (the distributed backend); on a simulated mesh use raise_in_backward or "
                                f"delay.")
        self.owner = self.backend.rank() if mesh.in_rank() and self.backend.kind != "distributed" else None
        self.count = _Counter()
        self.fired: list[tuple[str, int, object, int]] = []  # (kind, rank, step, n) as they happen

    def _mine(self, backend) -> int | None:
        """This thread's rank if the event is for this `inject`, else None."""
        if backend is not self.backend or not self.backend.in_rank():
            return None
        rank = self.backend.rank()
        return rank if self.owner is None or self.owner == rank else None

    def _on_issue(self, group, op, seq, entry) -> None:
        rank = self._mine(group.backend)
        if rank is None:
            return
        c = self.count
        step = entry[flight.STEP]
        if step != c.step:
            c.step, c.n = step, 0
        c.n += 1
        for f in self.faults:
            if f.kind != "raise" and f.matches(rank, step, c.n):
                self.fired.append((f.kind, rank, step, c.n))
                self._fire(f, rank)

    def _fire(self, f: Fault, rank: int) -> None:
        if f.kind == "delay":
            time.sleep(f.seconds)
        elif f.kind == "kill":
            os.kill(os.getpid(), f.signal)
            time.sleep(60)  # the signal is on its way
        elif f.kind == "drop":
            try:
                import torch.distributed as dist

                store = dist.distributed_c10d._get_default_store()
                store.delete_key(f"shardfn/flight/pid/{rank}")
            except Exception:  # noqa: BLE001 - there may be no store key to delete
                pass
            threading.Event().wait()  # gone: never issues, never returns

    def _observer(self, unit, name: str) -> None:
        if name not in ("pre_backward", "post_backward"):
            return
        rank = self._mine(unit.groups.shard.backend)
        if rank is None:
            return
        for f in self.faults:
            if (f.kind == "raise" and f.unit == unit.plan.name() and (f.rank is None or f.rank == rank)
                    and (f.step is None or f.step == flight.context.step)):
                self.fired.append(("raise", rank, flight.context.step, 0))
                raise InjectedFault(f"injected fault: rank {rank} raised in the backward of {f.unit} "
                                    f"(step {flight.context.step})")

    def __enter__(self):
        from .._fsdp.unit import UnitRuntime

        with _active_lock:
            if not _active:
                _previous_observer[0] = UnitRuntime.observer
                UnitRuntime.observer = _dispatch_observer
                flight.on_issue.append(_dispatch_issue)
            _active.append(self)
        return self

    def __exit__(self, *exc):
        from .._fsdp.unit import UnitRuntime

        with _active_lock:
            _active.remove(self)
            if not _active:
                flight.on_issue.remove(_dispatch_issue)
                UnitRuntime.observer = _previous_observer[0]
                _previous_observer[0] = None
        return False
