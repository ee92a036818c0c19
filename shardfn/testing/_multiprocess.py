"""Run one function on N real processes joined by `torch.distributed` (gloo on CPU).

[Note: fork, not spawn] `mp.spawn` re-imports torch in every child (1.5-3 s per group);
forking this process costs ~0.05 s, and lets `fn` be a closure or a lambda. Two traps
of forking a process that holds gloo groups (e.g. a simulated mesh built earlier):
the child must not garbage-collect the inherited groups (their destructors can block),
so the parent calls `gc.freeze()` around the fork, and the child leaves with `os._exit`,
never running finalizers or atexit hooks.

[Note: stay until all are done] A child that has its answer (a result or an error)
reports it through its pipe and then waits for the parent's word before it exits. Were
it to exit at once, a peer still inside a collective with it would fail with gloo's
"connection closed by peer", and the report would blame the wrong rank. So the ranks
that die are exactly those that crashed or were killed, and the parent can tell a root
cause (a death, or the first error reported) from its consequences.

[Note: die with the parent] Each child asks the kernel for SIGKILL when the thread that
forked it dies (Linux `PR_SET_PDEATHSIG`). A test runner killing its worker on a timeout
(pytest-timeout's `os._exit`, the deadline plugin's SIGKILL) then takes the ranks with it,
where they would otherwise linger, orphaned, inside a collective. The forking thread stays
in `run_multiprocess` until every child has been joined or killed, so this never fires early.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Mapping

from .._errors import ShardingError

__all__ = ["RankProcessError", "run_multiprocess"]

_MARGIN_S = 5.0  # on top of `timeout`, for start-up and reporting
_GRACE_S = 0.5  # after a first failure, how long to look for a dying peer (the likelier cause)
_EXIT_WAIT_S = 30.0  # how long a finished child may take to leave after the parent's word (4 ranks under a CPU hog: >10 s seen)


class RankProcessError(ShardingError):
    """A rank process of `run_multiprocess` raised, died, or did not finish in time.

    Attributes:
      rank: the rank blamed (the one that died, else the first to report an error);
        None when the run timed out with no rank failing.
      exc_type: the qualified name of the rank's exception type (None for a death).
      exc_message: `str()` of the rank's exception (None for a death).
      traceback: the rank's formatted traceback text (None for a death).
      signal: the name of the signal that killed the rank (e.g. "SIGKILL"), else None.
      failures: rank -> one-line summary, for every rank that failed.
    """

    def __init__(self, message: str, *, rank=None, exc_type=None, exc_message=None,
                 traceback=None, signal=None, failures=None):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.traceback = traceback
        self.signal = signal
        self.failures = dict(failures or {})


@dataclasses.dataclass
class _Failure:
    rank: int
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    exitcode: int | None = None

    @property
    def signal(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def summary(self) -> str:
        if self.exc_type is not None:
            first = (self.message or "").splitlines()[0] if self.message else ""
            return f"rank {self.rank} raised {self.exc_type}: {first}"
        if self.signal is not None:
            return f"rank {self.rank} was killed by {self.signal} (exit code {self.exitcode})"
        return f"rank {self.rank} exited with code {self.exitcode} without reporting a result"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _type_name(err: BaseException) -> str:
    cls = type(err)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _error_payload(err: BaseException) -> bytes:
    return pickle.dumps((
        "error",
        _type_name(err),
        str(err),
        "".join(traceback.format_exception(type(err), err, err.__traceback__)),
    ))


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """[Note: die with the parent] (Linux; elsewhere the parent's own kill is all there is)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request was in place
        os._exit(1)


def _child(rank: int, nprocs: int, store_path: str, port: int, conn, fn: Callable, args, kwargs,
           timeout: float, env: Mapping[str, str] | None, parent_pid: int | None = None) -> None:
    """Body of one rank process; always leaves through `os._exit` (see [Note: fork, not spawn])."""
    code = 1
    try:
        if parent_pid is not None:
            _die_with_parent(parent_pid)
        os.environ.update({
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
        })
        os.environ.update(env or {})
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks on a timeout
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        try:
            dist.init_process_group(
                "gloo",
                store=dist.FileStore(store_path, nprocs),
                rank=rank,
                world_size=nprocs,
                timeout=datetime.timedelta(seconds=timeout),
            )
            result = fn(*args, **kwargs)
            payload = pickle.dumps(("ok", pickle.dumps(result)))
            code = 0
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            payload = _error_payload(err)
        conn.send_bytes(payload)
        # [Note: stay until all are done]
        if conn.poll(timeout + 2 * _MARGIN_S):
            conn.recv_bytes()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - last resort: the pipe itself failed
        code = 1
        try:
            conn.send_bytes(_error_payload(err))
        except BaseException:  # noqa: BLE001
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(code)


def run_multiprocess(fn: Callable, nprocs: int, *args, timeout: float = 60.0,
                     env: Mapping[str, str] | None = None, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `nprocs` processes over one gloo process group.

    Each process is forked from this one (so `fn` may be a closure), gets the launcher
    variables `torchrun` would set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT) plus `GLOO_SOCKET_IFNAME=lo` and one intra-op thread, and has the
    default process group initialized (gloo over a `FileStore` in a fresh temporary
    directory) before `fn` runs, so `sf.init_mesh(...)` inside `fn` simply uses it.

    Args:
      fn: the per-rank program; its return value must be picklable.
      nprocs: number of processes (the world size).
      timeout: seconds for the whole run; also the process group's collective timeout.
        The run is stopped (every rank killed) a few seconds after it.
      env: extra environment variables for the children (e.g. TORCH_DISTRIBUTED_DEBUG).

    Returns:
      The per-rank return values, in rank order.

    Raises:
      RankProcessError: a rank raised (naming the rank, the exception type and message,
        with the rank's traceback), died (naming the signal), or the run timed out
        (naming the ranks still running). The other ranks are killed at once.

    Example:
      >>> import shardfn as sf, torch
      >>> from shardfn.testing import run_multiprocess
      >>> def body():
      ...     mesh = sf.init_mesh({"data": 2}, timeout=30)
      ...     return mesh.all_reduce(torch.tensor([mesh.rank + 1.0]), "data").item()
      >>> run_multiprocess(body, 2)
      [3.0, 3.0]
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"run_multiprocess: nprocs must be a positive int, got {nprocs!r}")
    ctx = multiprocessing.get_context("fork")
    tmpdir = tempfile.mkdtemp(prefix="shardfn-mp-")
    store_path = os.path.join(tmpdir, "store")
    port = _free_port()
    procs: dict[int, Any] = {}
    conns: dict[int, Any] = {}
    finished = False
    try:
        gc.freeze()  # [Note: fork, not spawn]
        try:
            for rank in range(nprocs):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_child,
                    args=(rank, nprocs, store_path, port, child_conn, fn, args, kwargs, timeout, env, os.getpid()),
                    name=f"shardfn-rank-{rank}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()  # so that a dead child's pipe reads as EOF here
                procs[rank], conns[rank] = proc, parent_conn
        finally:
            gc.unfreeze()
        results, failures, running = _collect(procs, conns, timeout)
        if failures or running:
            if running and not failures:
                _dump_stacks(procs, running)
            raise _failure_error(nprocs, timeout, results, failures, running)
        for rank in range(nprocs):  # everyone answered: let them go
            conns[rank].send_bytes(b"exit")
        _join_all(procs)
        finished = True
        return [results[rank] for rank in range(nprocs)]
    finally:
        if not finished:
            _kill_all(procs)
        for conn in conns.values():
            conn.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _collect(procs, conns, timeout: float):
    """Wait for every rank's report; stop early on a failure. Returns (results, failures, running)."""
    results: dict[int, Any] = {}
    failures: dict[int, _Failure] = {}
    pending = set(procs)
    deadline = time.monotonic() + timeout + _MARGIN_S
    grace_until = None
    while pending:
        now = time.monotonic()
        stop = deadline if grace_until is None else min(deadline, grace_until)
        if now >= stop:
            break
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        multiprocessing.connection.wait(waitables, timeout=stop - now)
        for rank in sorted(pending):
            conn, proc = conns[rank], procs[rank]
            report = None
            if conn.poll():
                try:
                    report = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    report = None
            if report is not None:
                pending.discard(rank)
                if report[0] == "ok":
                    try:
                        results[rank] = pickle.loads(report[1])
                    except BaseException as err:  # noqa: BLE001
                        failures[rank] = _Failure(rank, _type_name(err), f"could not unpickle the result: {err}",
                                                  "".join(traceback.format_exception(type(err), err, err.__traceback__)))
                else:
                    _, exc_type, message, tb = report
                    failures[rank] = _Failure(rank, exc_type, message, tb)
            elif proc.exitcode is not None or not proc.is_alive():
                proc.join(1.0)
                pending.discard(rank)
                failures[rank] = _Failure(rank, exitcode=proc.exitcode)
        if failures and grace_until is None:
            grace_until = time.monotonic() + _GRACE_S
    return results, failures, sorted(pending)


def _blame(failures: dict[int, _Failure]) -> _Failure:
    """The root cause: a rank that died (peers then fail in collectives), else the first error."""
    deaths = [f for f in failures.values() if f.exc_type is None]
    if deaths:
        return min(deaths, key=lambda f: f.rank)
    return next(iter(failures.values()))  # dicts keep insertion order = order of arrival


def _failure_error(nprocs, timeout, results, failures, running) -> RankProcessError:
    summaries = {r: f.summary() for r, f in failures.items()}
    if not failures:
        return RankProcessError(
            f"run_multiprocess: {nprocs} processes did not finish within {timeout:g} s "
            f"(+{_MARGIN_S:g} s margin); ranks still running: {running}; ranks that returned: "
            f"{sorted(results)}. Their stacks were dumped to stderr; all were killed.",
            failures={r: f"rank {r} was still running" for r in running},
        )
    cause = _blame(failures)
    lines = [f"run_multiprocess: {cause.summary()} (of {nprocs} processes)."]
    others = [s for r, s in summaries.items() if r != cause.rank]
    if others:
        lines.append("Other ranks:\n" + "\n".join(f"  - {s}" for s in others))
    if running:
        lines.append(f"Ranks still running when the others were killed: {running}.")
    if cause.traceback:
        lines.append(f"Traceback of rank {cause.rank}:\n{cause.traceback.rstrip()}")
    elif cause.signal is not None:
        lines.append(f"Rank {cause.rank} left no traceback: it was killed by {cause.signal}.")
    return RankProcessError(
        "\n".join(lines),
        rank=cause.rank,
        exc_type=cause.exc_type,
        exc_message=cause.message,
        traceback=cause.traceback,
        signal=cause.signal,
        failures=summaries,
    )


def _dump_stacks(procs, ranks) -> None:
    """Ask hung ranks to print every thread's stack to stderr (faulthandler on SIGUSR1)."""
    for rank in ranks:
        try:
            os.kill(procs[rank].pid, signal.SIGUSR1)
        except (ProcessLookupError, OSError):
            pass
    time.sleep(0.3)


def _kill_all(procs) -> None:
    for proc in procs.values():
        if proc.is_alive():
            try:
                proc.kill()
            except (ProcessLookupError, OSError):
                pass
    for proc in procs.values():
        proc.join(5.0)


def _join_all(procs) -> None:
    """Wait for finished ranks to leave; a crash while leaving is still an error."""
    deadline = time.monotonic() + _EXIT_WAIT_S
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, p in procs.items() if p.is_alive()]
    bad = {r: _Failure(r, exitcode=p.exitcode) for r, p in procs.items() if p.exitcode not in (0, None)}
    if stuck or bad:
        _kill_all(procs)
        parts = [f.summary() for f in bad.values()]
        if stuck:
            parts.append(f"ranks {stuck} did not exit within {_EXIT_WAIT_S:g} s of returning (killed)")
        raise RankProcessError(
            "run_multiprocess: every rank returned, but leaving failed: " + "; ".join(parts),
            rank=(sorted(bad) or stuck)[0],
            failures={r: f.summary() for r, f in bad.items()},
        )
