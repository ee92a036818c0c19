"""A pytest plugin: a suite that always finishes, and leaves no process behind.

Loaded by `tests/conftest.py` (and by the Makefile's `ISOLATE` options with `-p`). Two parts:

**Reaper** (in the process that runs the tests, with or without pytest-xdist). The process
becomes a Linux *child subreaper*, so a rank process orphaned by a test (its parent died,
or it double-forked, or it left its session) is re-parented to it instead of to init. The
direct children alive before a test's setup are remembered; whatever new child (with its
whole process tree) is still alive after its teardown, on every exit path (passed, failed,
raised, timed out in a fixture), is killed and reaped, with a warning that names the test
and the processes. Exited children are reaped silently. The inductor compile-worker pool
(long-lived by design) is left alone.

**Hard per-test deadline** (in the pytest-xdist controller, i.e. from outside the process
running the test). `pytest-timeout` stays the inner limit; it cannot fire when the test
holds the GIL in C code, ignores its signal, or the worker is wedged. The controller sees
which test each worker runs (its `logstart`/`logfinish` events) and a watchdog thread,
once a test has run `--hard-timeout` seconds (default: pytest-timeout's `timeout` + 60),
asks the worker and its forked rank processes to write every thread's stack (faulthandler
on SIGUSR2, into a file the controller reads), then kills the worker's whole process tree.
xdist reports the test as failed ("worker 'gw0' crashed while running ...", followed by
the deadline and the stacks), starts a fresh worker for the rest, and prints its summary.
The controller is a subreaper too: whatever a dead worker leaves behind comes to it and is
killed when the worker goes down and at the end of the session.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import pytest

__all__ = ["children", "process_tree", "kill_tree"]

_PR_SET_CHILD_SUBREAPER = 36
_DUMP_SIGNAL = signal.SIGUSR2
_EXEMPT = ("torch._inductor.compile_worker", "torch/_inductor/compile_worker")
_MAX_DUMPED_CHILDREN = 8
_BEGIN = "--- shardfn: test begins: "  # the worker's line in its stacks file before each test


# -- processes --------------------------------------------------------------------------


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int) -> list[int]:
    """The direct children of `pid` (every thread's), from /proc; [] where unknown."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except OSError:
            continue
    return out


def process_tree(pid: int) -> list[int]:
    """Every descendant of `pid` (not `pid` itself), parents before their children."""
    seen: list[int] = []
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in seen:
                seen.append(child)
                todo.append(child)
    return seen


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _state(pid: int) -> str | None:
    """The /proc state letter ('R', 'S', 'Z', ...), None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:][:1].decode()


def _catches(pid: int, sig: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def kill_tree(pids, reap: bool = True) -> None:
    """Stop, then SIGKILL each pid and its descendants; reap those that are our children."""
    everyone: list[int] = []
    for pid in pids:
        for p in [pid, *process_tree(pid)]:
            if p not in everyone:
                everyone.append(p)
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # stopped first: nobody forks in between
        for p in everyone:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
    if reap:
        _reap(everyone, wait_s=2.0)


def _reap(pids, wait_s: float = 0.0) -> None:
    """waitpid the given pids that are our children (zombies included); ignore the rest."""
    deadline = time.monotonic() + wait_s
    pending = set(pids)
    while pending:
        for p in list(pending):
            try:
                done, _ = os.waitpid(p, os.WNOHANG)
            except ChildProcessError:  # not ours (a grandchild) or already reaped
                pending.discard(p)
                continue
            if done:
                pending.discard(p)
        if not pending or time.monotonic() >= deadline:
            return
        time.sleep(0.02)


def _exempt(pid: int) -> bool:
    cmd = _cmdline(pid)
    return any(mark in cmd for mark in _EXEMPT)


# -- options ------------------------------------------------------------------------------


def pytest_addoption(parser):
    group = parser.getgroup("shardfn-deadline", "per-test hard deadline and process reaper (shardfn)")
    group.addoption(
        "--hard-timeout", type=float, default=None, dest="hard_timeout",
        help="seconds after which the pytest-xdist controller kills the process tree of a worker "
             "still running one test (stacks first); default: ini hard_timeout, else pytest-timeout's "
             "timeout + 60; 0 disables",
    )
    parser.addini("hard_timeout", "default for --hard-timeout (seconds)", default=None)


def _hard_timeout(config) -> float:
    value = config.getoption("hard_timeout", None)
    if value is None:
        ini = config.getini("hard_timeout")
        if ini not in (None, ""):
            value = float(ini)
    if value is None:
        try:
            inner = float(config.getini("timeout") or 0)
        except (ValueError, KeyError):
            inner = 0.0
        value = inner + 60.0 if inner > 0 else 600.0
    return float(value)


def pytest_configure(config):
    if getattr(config, "_shardfn_deadline", None) is not None:
        return
    plugin = _Worker(config)
    config._shardfn_deadline = plugin
    config.pluginmanager.register(plugin, "shardfn-deadline-worker")
    if not hasattr(config, "workerinput") and config.pluginmanager.hasplugin("xdist") \
            and getattr(config.option, "numprocesses", None):
        config.pluginmanager.register(_Controller(config), "shardfn-deadline-controller")


# -- in the process that runs the tests: the reaper ---------------------------------------


class _Worker:
    def __init__(self, config):
        self.config = config
        self.pid = os.getpid()
        self.subreaper = _become_subreaper()
        self.before: set[int] = set()
        self.stacks = None
        workerinput = getattr(config, "workerinput", None) or {}
        folder = workerinput.get("shardfn_deadline_dir")
        if folder and os.path.isdir(folder):
            # the controller reads this file after asking for a dump (append mode: its headers and
            # the dumps of forked rank processes, which inherit the handler, interleave cleanly)
            self.stacks = open(os.path.join(folder, f"{self.pid}.stacks"), "a", buffering=1)  # noqa: SIM115
            faulthandler.register(_DUMP_SIGNAL, file=self.stacks, all_threads=True, chain=False)

    # [Note: a worker that dies on its own] xdist reports a worker that died by itself only as
    # "crashed", and what it printed on the way out is lost (its stdout is not the terminal).
    # Two ways a test ends its worker: pytest-timeout's thread method (the project's), which
    # dumps the stacks to that lost terminal and calls os._exit; and a fatal signal (SIGSEGV,
    # SIGFPE, SIGABRT, SIGBUS) in torch or gloo. Both now write into the stacks file the
    # controller reads (the fatal-signal handler is inherited by forked rank processes), and
    # the controller adds the file's new text and the test's run time to the crash report.
    def pytest_sessionstart(self, session):
        if self.stacks is not None:  # after pytest's own faulthandler plugin set stderr
            faulthandler.enable(file=self.stacks, all_threads=True)

    @pytest.hookimpl(tryfirst=True, optionalhook=True)
    def pytest_timeout_set_timer(self, item, settings):
        if self.stacks is None or settings.method != "thread" or os.getpid() != self.pid:
            return None  # pytest-timeout's own timer
        import pytest_timeout

        def expire():
            self.stacks.write(f"\npytest-timeout: {item.nodeid} ran past timeout={settings.timeout:g} s; its "
                              f"thread method ends the worker (os._exit). Every thread's stack:\n")
            faulthandler.dump_traceback(file=self.stacks, all_threads=True)
            self.stacks.flush()
            pytest_timeout.timeout_timer(item, settings)  # its report (lost with the worker), then os._exit

        timer = threading.Timer(settings.timeout, expire)
        timer.name = f"pytest_timeout {item.nodeid}"

        def cancel():
            timer.cancel()
            timer.join()

        item.cancel_timeout = cancel
        timer.start()
        return True

    def _alive_children(self) -> set[int]:
        return {p for p in children(self.pid) if _state(p) not in (None, "Z")}

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item):
        if os.getpid() == self.pid:
            self.before = set(children(self.pid))
            if self.stacks is not None:  # where this test's text starts ([Note: a worker that dies on its own])
                self.stacks.write(f"\n{_BEGIN}{item.nodeid}\n")
                self.stacks.flush()
        yield

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item, nextitem):
        yield
        if os.getpid() != self.pid:  # a forked child that runs pytest hooks: not our business
            return
        new = [p for p in children(self.pid) if p not in self.before]
        zombies = [p for p in new if _state(p) == "Z"]
        _reap(zombies)
        leftover = [p for p in new if p not in zombies and _state(p) is not None and not _exempt(p)]
        if not leftover:
            return
        described = [f"{p} ({_cmdline(p)[:80]})" for p in leftover]
        kill_tree(leftover)
        item.warn(pytest.PytestWarning(
            f"{item.nodeid} left {len(leftover)} process(es) running after its teardown; the reaper "
            f"killed them with their children: {'; '.join(described)}. Fix: join or kill the "
            f"processes the test starts on every exit path (shardfn.testing.run_multiprocess does)."))

    def pytest_unconfigure(self, config):
        if os.getpid() != self.pid:
            return
        if self.stacks is not None:
            faulthandler.unregister(_DUMP_SIGNAL)
            faulthandler.disable()
            self.stacks.close()
            self.stacks = None
        if self.subreaper and hasattr(config, "workerinput"):  # an xdist worker: all of ours go
            left = [p for p in children(self.pid) if _state(p) not in (None, "Z") and not _exempt(p)]
            if left:
                kill_tree(left)


# -- in the xdist controller: the hard deadline -------------------------------------------


class _Running:
    def __init__(self, worker_id, pid, nodeid, stacks_at=0):
        self.worker_id = worker_id
        self.pid = pid
        self.nodeid = nodeid
        self.start = time.monotonic()
        self.stacks_at = stacks_at  # the size of the worker's stacks file when the test began
        self.expired = threading.Event()  # the watchdog took this one
        self.done = threading.Event()  # ... and finished dumping and killing
        self.note = ""


class _Controller:
    def __init__(self, config):
        self.config = config
        self.limit = _hard_timeout(config)
        self.folder = tempfile.mkdtemp(prefix="shardfn-deadline-")
        self.pids: dict[str, int] = {}  # worker id -> pid
        self.running: dict[str, _Running] = {}
        self.expired: dict[str, _Running] = {}  # nodeid -> what the watchdog did
        self.died: dict[str, tuple[_Running, float]] = {}  # nodeid -> (its run, seconds): workers that died by themselves
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = None
        _become_subreaper()

    # xdist hooks (optional: this plugin is only registered when xdist runs)
    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):
        node.workerinput["shardfn_deadline_dir"] = self.folder
        try:
            self.pids[node.gateway.id] = node.gateway._rinfo().pid  # cached by xdist before this hook
        except Exception:  # noqa: BLE001 - without the pid there is no deadline for this worker
            pass

    def _stacks_path(self, pid: int) -> str:
        return os.path.join(self.folder, f"{pid}.stacks")

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        wid = node.gateway.id
        self.pids.pop(wid, None)
        with self.lock:
            r = self.running.pop(wid, None)
        if error and r is not None and not r.expired.is_set():  # [Note: a worker that dies on its own]
            self.died[r.nodeid] = (r, time.monotonic() - r.start)
        if error:  # a crashed worker's orphans were re-parented to us: they go now
            self._kill_orphans()

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem, report, sched):
        entry = self.expired.get(crashitem)
        if entry is None:
            if crashitem in self.died:
                report.longrepr = f"{report.longrepr}\n{self._died_note(crashitem, *self.died[crashitem])}"
            return
        entry.done.wait(30.0)
        report.longrepr = f"{report.longrepr}\n{entry.note}"

    def pytest_sessionstart(self, session):
        dsession = self.config.pluginmanager.getplugin("dsession")
        if dsession is None or self.limit <= 0:
            return
        # DSession dispatches worker events by attribute name ("worker_" + event): wrap the two
        # that say which test a worker starts and ends.
        logstart, logfinish = dsession.worker_logstart, dsession.worker_logfinish

        def worker_logstart(node, nodeid, location):
            wid = node.gateway.id
            if wid in self.pids:
                with self.lock:
                    path = self._stacks_path(self.pids[wid])
                    self.running[wid] = _Running(wid, self.pids[wid], nodeid,
                                                 os.path.getsize(path) if os.path.exists(path) else 0)
            return logstart(node=node, nodeid=nodeid, location=location)

        def worker_logfinish(node, nodeid, location):
            with self.lock:
                self.running.pop(node.gateway.id, None)
            return logfinish(node=node, nodeid=nodeid, location=location)

        dsession.worker_logstart, dsession.worker_logfinish = worker_logstart, worker_logfinish
        self.thread = threading.Thread(target=self._watch, name="shardfn-deadline", daemon=True)
        self.thread.start()

    def _watch(self):
        while not self.stop.wait(0.5):
            now = time.monotonic()
            with self.lock:
                late = [r for r in self.running.values() if now - r.start > self.limit and not r.expired.is_set()]
                for r in late:
                    r.expired.set()
                    self.expired[r.nodeid] = r
            for r in late:
                try:
                    self._expire(r)
                except Exception as err:  # noqa: BLE001 - the watchdog must not die
                    r.note += f"\n(the watchdog failed while killing: {err!r})"
                finally:
                    r.done.set()

    def _expire(self, r: _Running) -> None:
        path = self._stacks_path(r.pid)
        elapsed = time.monotonic() - r.start
        tree = process_tree(r.pid)
        targets = [r.pid] + [p for p in tree if _catches(p, _DUMP_SIGNAL)][:_MAX_DUMPED_CHILDREN]
        start_at = os.path.getsize(path) if os.path.exists(path) else 0
        for pid in targets:
            with open(path, "a") as f:
                who = f"worker {r.worker_id}" if pid == r.pid else f"child process {pid} of worker {r.worker_id}"
                f.write(f"\n--- {who} (pid {pid}: {_cmdline(pid)[:100]}), every thread's stack ---\n")
            try:
                os.kill(pid, _DUMP_SIGNAL)
            except ProcessLookupError:
                continue
            _wait_for_growth(path, 2.0 if pid == r.pid else 1.0)
        try:
            with open(path, errors="replace") as f:
                f.seek(start_at)
                stacks = f.read().strip()
        except OSError:
            stacks = "(no stacks: the dump file is missing)"
        everyone = [r.pid, *tree]
        with self.lock:
            still = self.running.get(r.worker_id) is r
        if still:
            kill_tree([r.pid], reap=False)  # execnet waits for the worker itself
            _reap(tree)
        try:
            inner = self.config.getini("timeout")
        except (ValueError, KeyError):
            inner = None
        action = (f"The controller killed worker {r.worker_id}'s process tree (pids {everyone}); a fresh "
                  f"worker runs the remaining tests." if still else
                  "It ended while its stacks were being written (not killed).")
        r.note = (
            f"shardfn hard deadline: {r.nodeid} ran {elapsed:.0f} s, past --hard-timeout={self.limit:g} s "
            f"(pytest-timeout's timeout={inner} did not end it). {action}\n"
            f"Stacks (faulthandler, asked for just before the kill):\n{stacks}"
        )

    def _died_note(self, nodeid: str, r: _Running, seconds: float) -> str:
        # from the worker's own line for this test: the controller sees the test start late
        # under load, after a crash at once had written its stacks (r.stacks_at: a fallback)
        try:
            with open(self._stacks_path(r.pid), errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        mark = f"{_BEGIN}{nodeid}\n"
        at = text.rfind(mark)
        text = (text[at + len(mark):] if at >= 0 else text[r.stacks_at:]).strip()
        return (f"shardfn: worker {r.worker_id} died by itself {seconds:.0f} s into {nodeid} (not the hard "
                f"deadline). What it wrote on the way out (pytest-timeout's expiry, or a fatal signal's "
                f"stacks):\n" + (text or "(nothing: a signal faulthandler does not catch, e.g. SIGKILL from "
                                         "the kernel's OOM killer, or os._exit in the test)"))

    def _kill_orphans(self) -> None:
        workers = set(self.pids.values())
        left = [p for p in children(os.getpid()) if p not in workers and _state(p) not in (None, "Z")
                and not _exempt(p)]
        for p in children(os.getpid()):
            if p not in workers and _state(p) == "Z":
                _reap([p])
        if left:
            kill_tree(left)

    def pytest_unconfigure(self, config):
        self.stop.set()
        if self.thread is not None:
            self.thread.join(5.0)
        workers = set(self.pids.values())
        left = [p for p in children(os.getpid()) if p not in workers and not _exempt(p)]
        if left:
            kill_tree(left)
        shutil.rmtree(self.folder, ignore_errors=True)


def _wait_for_growth(path: str, timeout: float) -> None:
    """Wait until the dump file grew and then stayed the same size for 0.2 s (or `timeout`)."""
    deadline = time.monotonic() + timeout
    size = os.path.getsize(path) if os.path.exists(path) else 0
    grown, stable_since = False, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = os.path.getsize(path) if os.path.exists(path) else 0
        if now != size:
            size, grown, stable_since = now, True, time.monotonic()
        elif grown and time.monotonic() - stable_since > 0.2:
            return

