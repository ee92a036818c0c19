"""The simulated backend: N ranks as threads of one process, over real gloo groups.

Each rank thread holds real `ProcessGroupGloo`s built on one in-memory `HashStore`, so
every collective runs the same gloo code as a multi-process job. [Note: fail fast] A rank
that raises sets the mesh's abort flag; the others leave their current wait within one
poll slice (see base.py's [Note: polled waits]) with `RankAbortedError`, and `run`
re-raises the first real error with its rank. Groups that may hold unfinished work are
retired (kept referenced, since a gloo group with stuck work blocks when collected) and
fresh ones are built for the next `run` — only when some group's members issued different
numbers of collectives, i.e. when work can be pending. Stuck gloo work ends at gloo's own
timeout (the mesh timeout + 2 s); until then it also holds up interpreter exit, which is
why tests use short mesh timeouts. `shutdown()`/`abort()` on a gloo group do not release
it (checked on torch 2.13).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import threading
import weakref
import time
from typing import Callable, Mapping

import torch
from torch.distributed import HashStore, PrefixStore, ProcessGroupGloo

from .._errors import RankAbortedError, ShardingError
from . import fwad
from .base import BackendBase, axis_subsets, group_members, rank_coords

__all__ = ["SimulatedBackend"]

_GRAVEYARD: list = []  # retired process groups; see [Note: fail fast]
_LIVE: "weakref.WeakSet[SimulatedBackend]" = weakref.WeakSet()


@atexit.register
def _release_groups() -> None:
    """Drop every gloo group while Python is still alive.

    A gloo worker thread that destroys a finished work item at interpreter shutdown needs
    the GIL to release the Python object it holds, and aborts the process ("terminate
    called without an active exception") if Python is already finalizing."""
    for backend in list(_LIVE):
        backend._pgs = {}
        backend._groups.clear()
    _GRAVEYARD.clear()
    gc.collect()
_GRACE_S = 2.0  # gloo's own timeout exceeds ours, so our message comes first; see [Note: fail fast]


class SimulatedBackend(BackendBase):
    kind = "simulated"

    def __init__(self, mesh_shape: Mapping[str, int], timeout: float):
        super().__init__(mesh_shape, timeout)
        fwad.install()  # see fwad.py: [Note: forward AD on the simulated mesh]
        self.device = torch.device("cpu")
        self._local = threading.local()
        self._store = HashStore()
        self._generation = 0
        self._pgs: dict[tuple[int, tuple[str, ...]], object] = {}
        self._lock = threading.Lock()
        self._history: dict[tuple[int, str], dict[int, str]] = {}  # (rank, subset key) -> {seq: op}
        self._history_lock = threading.Lock()
        _LIVE.add(self)
        self.check_collectives = True  # free here: ranks share memory
        self._build()

    # -- groups -----------------------------------------------------------------------
    def _build(self) -> None:
        """Create every axis-subset group for every rank, concurrently (it is a rendezvous)."""
        self._generation += 1
        self._groups.clear()
        self._seq.clear()
        self._last_op.clear()
        self._op_at.clear()
        self._history = {}
        subsets = axis_subsets(list(self.mesh_shape))
        pgs: dict = {}
        errors: list = []

        def build_rank(rank: int) -> None:
            try:
                for subset in subsets:
                    members = next(m for m in group_members(self.mesh_shape, subset) if rank in m)
                    ordered = sorted(members)
                    opts = ProcessGroupGloo._Options()
                    opts._devices = [ProcessGroupGloo.create_device(interface="lo")]
                    opts._timeout = datetime.timedelta(seconds=self.timeout + _GRACE_S)
                    prefix = f"shardfn/{self._generation}/{','.join(subset)}/{ordered[0]}"
                    pgs[(rank, subset)] = ProcessGroupGloo(
                        PrefixStore(prefix, self._store), ordered.index(rank), len(ordered), opts
                    )
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads = [threading.Thread(target=build_rank, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise ShardingError(f"could not create the simulated mesh's gloo groups: {errors[0]!r}") from errors[0]
        self._pgs = pgs

    def _pg(self, rank: int, subset: tuple[str, ...]):
        return self._pgs[(rank, subset)]

    def _retire(self) -> None:
        """Replace the groups if one may hold unfinished work; see [Note: fail fast]."""
        if self._all_groups_in_step():
            return  # every group's members issued the same number of collectives: nothing pending
        _GRAVEYARD.append(self._pgs)
        self._build()

    def _all_groups_in_step(self) -> bool:
        for subset in axis_subsets(list(self.mesh_shape)):
            key = ",".join(subset)
            for members in group_members(self.mesh_shape, subset):
                if len({self._seq.get((r, key), 0) for r in members}) > 1:
                    return False
        return True

    # -- ranks ------------------------------------------------------------------------
    def rank(self) -> int:
        rank = getattr(self._local, "rank", None)
        if rank is None:
            raise ShardingError(
                f"this simulated mesh has {self.size} ranks, and the calling thread is none of them: "
                f"the rank (and anything per-rank: coords, collectives) is defined only inside "
                f"mesh.run(fn) or a shard_map / shard function running on the mesh.\n"
                f"Fix: put the per-rank code in a function and call mesh.run(fn)."
            )
        return rank

    def in_rank(self) -> bool:
        return getattr(self._local, "rank", None) is not None

    _HISTORY = 256  # collectives remembered per rank and group

    def _check_same_op(self, group, key: str, seq: int, what: str) -> None:
        rank = self.rank()
        with self._history_lock:  # record-then-compare is atomic: of two ranks, the later sees the earlier
            mine = self._history.setdefault((rank, key), {})
            mine[seq] = what
            mine.pop(seq - self._HISTORY, None)
            peers = {peer: self._history.get((peer, key)) for peer in group.ranks}
        for peer, theirs in peers.items():
            other = theirs.get(seq) if theirs is not None else None
            if other is not None and other != what:
                raise self._desync(group, seq, what, peer, other)

    def _missing_ranks(self, group, seq: int) -> str:
        key = ",".join(a for a in self.mesh_shape if a in group.axes)
        late = [r for r in group.ranks if self._seq.get((r, key), 0) < seq]
        mine = self._op_at.get((self.rank(), key), (seq, "?"))[1]
        at_seq = {r: self._op_at.get((r, key)) for r in group.ranks}
        differ = {r: op[1] for r, op in at_seq.items() if op is not None and op[0] == seq and op[1] != mine}
        if differ:
            others = "; ".join(f"rank {r} issued {text}" for r, text in differ.items())
            return f"The ranks disagree on collective #{seq} of this group: rank {self.rank()} issued {mine}; {others}."
        if not late:
            return "Every rank of the group issued it; the hold-up is inside the collective."
        where = "; ".join(f"rank {r} is at: {self._last_op.get(r, 'no collective yet')}" for r in late)
        return f"Ranks that did not arrive: {late} ({where})."

    # -- running ----------------------------------------------------------------------
    def run(self, fn: Callable, args, kwargs) -> list:
        if self.in_rank():  # SPMD code calling run again: it is already on its rank
            return [fn(*args, **kwargs)]
        with self._lock:  # one program on the mesh at a time
            return self._run_all(fn, args, kwargs)

    def _run_all(self, fn: Callable, args, kwargs) -> list:
        self.abort.clear()
        results: list = [None] * self.size
        failures: list[tuple[float, int, BaseException]] = []

        def body(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                failures.append((time.monotonic(), rank, err))
                self.abort.set()
            finally:
                self._local.rank = None

        threads = [
            threading.Thread(target=body, args=(r,), name=f"shardfn-rank-{r}", daemon=True)
            for r in range(self.size)
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.1)
        except BaseException:  # KeyboardInterrupt in a notebook: stop every rank, then re-raise
            self.abort.set()
            for t in threads:
                if t.ident is not None:
                    t.join(self.timeout)
            self._retire()
            raise
        if failures:
            self._retire()
            raise _first_error(failures, self.mesh_shape)
        return results


def _first_error(failures, mesh_shape) -> BaseException:
    real = [f for f in failures if not isinstance(f[2], RankAbortedError)] or failures
    _, rank, err = min(real, key=lambda f: (f[0], f[1]))
    note = f"(raised on rank {rank} of the simulated mesh, coords {rank_coords(rank, mesh_shape)})"
    if hasattr(err, "add_note"):
        err.add_note(note)
    elif err.args and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}\n{note}",) + err.args[1:]
    err.shardfn_rank = rank
    return err
