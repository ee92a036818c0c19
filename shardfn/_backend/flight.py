"""The flight recorder: every rank's last collectives, dumped when something goes wrong.

[Note: flight recorder] As NCCL's flight recorder, each rank keeps a ring buffer (a deque
of `SIZE` small lists) of the last collectives it issued: its running number on this rank,
the group's sequence number (the one desync checks and timeout messages use), the op and
its description (shapes, dtype), the group (mesh axes, member ranks), the shard step and
unit that issued it where known (`context`), and its issue, wait and end times. `_issue`
in ops.py records every collective (one `record` call) and `Pending.wait` closes it
(`done`): a few attribute reads, two clock reads and one deque append each, nothing that
grows with tensor size and no collective of its own.

The rings are dumped, one JSON file per rank, to the dump directory (`set_dump_dir`, or the
`SHARDFN_FLIGHT_DIR` environment variable) on a collective timeout, a desync, or SIGUSR1.
A rank that times out also asks its peers to dump: each rank of the distributed backend
publishes its pid in the default store once, and the timed-out rank sends them SIGUSR1
(same host only; a rank on another host dumps only on its own timeout or signal), then
waits briefly for their files. On the simulated backend every rank lives in this process,
so the failing rank dumps them all. `python -m shardfn.flight DIR` reads the files
(`shardfn/flight.py`).

The rings hang off the backend object, so they die with their mesh.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import weakref

__all__ = ["SIZE", "context", "record", "done", "failed", "set_dump_dir", "dump_dir", "dump", "ring", "step",
           "on_issue"]

SIZE = int(os.environ.get("SHARDFN_FLIGHT_SIZE", "2048"))  # collectives kept per rank
_PEER_WAIT_S = 2.0  # how long a timed-out rank waits for its peers' dump files

# One entry: a list, so that `done` can fill in the end (indices below).
N, SEQ, OP, WHAT, AXES, RANKS, STEP, UNIT, T_ISSUE, T_WAIT, T_END = range(11)
FIELDS = ("n", "seq", "op", "what", "axes", "ranks", "step", "unit", "t_issue", "t_wait", "t_end")


class _Context(threading.local):
    step = None  # the shard step's call number on this rank thread (set by RankState.begin_step)
    unit = None  # the unit whose gather / reduction runs now (set by UnitRuntime, Reducer)
    waited = 0.0  # seconds this thread spent waiting for collectives (the straggler check's "idle")


context = _Context()
_dir: list = [os.environ.get("SHARDFN_FLIGHT_DIR") or None]
_backends: "weakref.WeakSet" = weakref.WeakSet()  # backends with rings (to dump on a signal)
_announced: "weakref.WeakSet" = weakref.WeakSet()  # distributed backends whose pid is in the store
on_issue: list = []  # callables `(group, op, seq, entry)` run after each record (fault injection)
_lock = threading.Lock()


def ring(backend, rank: int) -> collections.deque:
    """This rank's ring on `backend` (created on first use)."""
    rings = backend.__dict__.get("_flight_rings")
    if rings is None:
        with _lock:
            rings = backend.__dict__.setdefault("_flight_rings", {})
            backend.__dict__["_flight_pid"] = os.getpid()  # a forked child does not dump its parent's rings
            _backends.add(backend)
    r = rings.get(rank)
    if r is None:
        r = rings[rank] = collections.deque(maxlen=SIZE)
        if _dir[0] is not None:
            _announce(backend)
    return r


def record(group, op: str, what: str, seq: int) -> list:
    """Note a collective just handed to `group`'s process group; returns its entry."""
    backend = group.backend
    rank = backend.rank()
    r = ring(backend, rank)
    n = r[-1][N] + 1 if r else 1
    entry = [n, seq, op, sys.intern(what), group.axes, group.ranks, context.step, context.unit, time.time(), None,
             None]  # interned: a step's descriptions repeat every step
    r.append(entry)
    if on_issue:
        for hook in list(on_issue):
            hook(group, op, seq, entry)
    return entry


def done(entry: list | None, t_wait: float) -> None:
    """The collective of `entry` completed; its wait began at `t_wait` (time.time())."""
    now = time.time()
    context.waited += now - t_wait
    if entry is not None:
        entry[T_WAIT] = t_wait
        entry[T_END] = now


@contextlib.contextmanager
def step(number: int):
    """Label the collectives issued inside as those of step `number` (a shard step labels
    its own: use this around hand-written collectives, e.g. a shard_map training loop)."""
    before = context.step
    context.step = number
    try:
        yield
    finally:
        context.step = before


@contextlib.contextmanager
def unit(name):
    """Label the collectives issued inside as those of unit `name`."""
    before = context.unit
    context.unit = name
    try:
        yield
    finally:
        context.unit = before


# -- dumping -------------------------------------------------------------------------------


def set_dump_dir(path: str | os.PathLike | None) -> None:
    """Where the rings are dumped (None: nowhere). Called on the main thread, it also
    installs the SIGUSR1 handler that dumps this process's rings (and then prints every
    thread's stack, as faulthandler would)."""
    _dir[0] = None if path is None else os.fspath(path)
    if path is None:
        return
    os.makedirs(_dir[0], exist_ok=True)
    _install_signal()
    for backend in list(_backends):
        _announce(backend)


def dump_dir() -> str | None:
    return _dir[0]


def _install_signal() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGUSR1)
    if getattr(previous, "_shardfn_flight", False):
        return

    def on_signal(signum, frame):
        dump("SIGUSR1")
        faulthandler.dump_traceback(all_threads=True)
        if callable(previous):
            previous(signum, frame)

    on_signal._shardfn_flight = True
    signal.signal(signal.SIGUSR1, on_signal)


def _announce(backend) -> None:
    """Publish this process's pid in the default store (distributed backend), once, so that
    a peer that times out can ask it to dump."""
    if backend.kind != "distributed" or backend in _announced:
        return
    _announced.add(backend)
    try:
        import torch.distributed as dist

        dist.distributed_c10d._get_default_store().set(f"shardfn/flight/pid/{backend.rank()}", str(os.getpid()))
    except Exception:  # noqa: BLE001 - best effort: this rank then dumps only on its own events
        pass


def _entry_json(e: list) -> dict:
    out = dict(zip(FIELDS, e))
    out["axes"], out["ranks"] = list(e[AXES]), list(e[RANKS])
    out["unit"] = None if e[UNIT] is None else str(e[UNIT])
    out["nbytes"] = _nbytes(e[WHAT])
    return out


def _nbytes(what: str) -> int | None:
    """Bytes of the operand from its description `op(shape=(...), dtype=torch.X)` (None if
    the description has no shape): worked out at dump time, so that recording stays cheap."""
    import math

    import torch

    try:
        shape = what.split("shape=(", 1)[1].split(")", 1)[0]
        dims = [int(d) for d in shape.split(",") if d.strip()]
        dtype = getattr(torch, what.split("dtype=torch.", 1)[1].split(")", 1)[0].split(",")[0])
        return math.prod(dims) * dtype.itemsize
    except (IndexError, ValueError, AttributeError):
        return None


def dump(reason: str, backend=None, ranks=None) -> list[str]:
    """Write the rings (of `backend`, else of every backend with rings) to the dump
    directory, one `rank{R}.json` per rank; returns the paths (none without a directory)."""
    path = _dir[0]
    if path is None:
        return []
    os.makedirs(path, exist_ok=True)
    written = []
    mine = [b for b in _backends if b.__dict__.get("_flight_pid") == os.getpid()]
    for b in ([backend] if backend is not None else mine):
        rings = b.__dict__.get("_flight_rings", {})
        for rank, r in sorted(rings.items()):
            if ranks is not None and rank not in ranks:
                continue
            doc = {"rank": rank, "pid": os.getpid(), "reason": reason, "time": time.time(),
                   "mesh": dict(b.mesh_shape), "backend": b.kind, "size": SIZE,
                   "entries": [_entry_json(e) for e in list(r)]}
            name = os.path.join(path, f"rank{rank}.json")
            tmp = f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, name)
            written.append(name)
    return written


def failed(group, reason: str, op: str | None = None, what: str | None = None) -> None:
    """A collective over `group` timed out, or (`op`, `what`) was refused as out of step
    with the peers' (a desync, recorded here under the number it would have had): dump
    (never raises)."""
    try:
        if _dir[0] is None:
            return
        backend = group.backend
        if reason == "desync":
            key = ",".join(a for a in backend.mesh_shape if a in group.axes)
            seq = backend._op_at.get((backend.rank(), key), (None,))[0]
            r = ring(backend, backend.rank())
            r.append([r[-1][N] + 1 if r else 1, seq, op, what, group.axes, group.ranks, context.step,
                      context.unit, time.time(), None, None])
        if backend.kind != "distributed":
            dump(reason, backend)  # every rank lives here
            return
        dump(reason, backend, [backend.rank()])
        if reason == "timeout":
            _ask_peers(backend, [r for r in group.ranks if r != backend.rank()])
    except Exception:  # noqa: BLE001 - the dump is a courtesy on the error path
        pass


def _ask_peers(backend, peers: list[int]) -> None:
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    since = time.time()
    asked = []
    for r in peers:
        key = f"shardfn/flight/pid/{r}"
        if store.check([key]):
            try:
                os.kill(int(store.get(key).decode()), signal.SIGUSR1)
                asked.append(r)
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + _PEER_WAIT_S
    while time.monotonic() < deadline:
        fresh = [r for r in asked if os.path.exists(p := os.path.join(_dir[0], f"rank{r}.json"))
                 and os.path.getmtime(p) >= since - 1]
        if len(fresh) == len(asked):
            return
        time.sleep(0.05)
