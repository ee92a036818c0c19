"""What the step-time benchmarks share: the run's environment, a CPU-burning second job,
per-thread CPU accounting from /proc, and where a profiled step's time goes.

[Note: where time goes] A step's wall time on a rank's main thread is split four ways,
from two sources that each see what the other cannot:

- compute and copies: the self time of the profiler's operator events on the main
  thread (torch.profiler, CPU activity), sorted by name (`CATEGORIES`); these ops never
  block, so their self time is time spent running (or waiting for a core);
- waiting on collectives: the main thread's *blocked* time from the kernel's
  /proc/thread-self/schedstat (wall - on-CPU - waiting for a core). On these CPU/gloo
  runs a rank's main thread sleeps only when it waits for a gloo worker thread, that is
  for a collective, whatever API waited (shardfn's polled `Work.wait`, FSDP2's
  `work.wait()`, DDP's reducer in C++): the profiler sees none of these as an operator;
- waiting for a core: the main thread's run-queue time from schedstat (contention: other
  ranks, other jobs on the machine). It happens inside the other shares' ops, so it is
  taken out of them in proportion to their running time: each of compute, copies and
  Python/other is its profiled self time times on-CPU / (wall - blocked);
- Python and other: the rest of the on-CPU time: Python, the autograd engine, views and
  allocations, issuing collectives, hooks, record_function annotations.

The five shares add up to the step's wall time. The CPU time of the process's other
threads (gloo's workers: copies and reductions of collectives) is reported beside; it
overlaps the main thread's time.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time

import torch

# -- the run's environment ------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def command(module: str, argv) -> str:
    """The command line that reproduces this run: `python -m benchmarks.x args...`."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", "-m", module] + [shlex.quote(a) for a in args])


def environment(module: str, argv) -> dict:
    """Date, machine, versions, load average and the exact command, for a result's JSON."""
    mem = _memory_gib()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command(module, argv),
        "machine": f"{os.cpu_count()} CPU cores ({_cpu_model()}), "
                   + (f"{mem:.0f} GiB RAM, " if mem else "") + f"{platform.system()} {platform.release()}",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_start": list(os.getloadavg()),
    }


def write_json(report: dict, out: str) -> None:
    """Write `report` to `out` + ".json" (folders made), and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {out}.json")


def finish_environment(env: dict) -> dict:
    env["loadavg_end"] = list(os.getloadavg())
    return env


class MachineUse:
    """How busy the whole machine was between two snapshots, in cores (from /proc/stat),
    and how much of that was this process's reaped children (the benchmark's ranks):
    the rest is other work on the machine (and a `Load`)."""

    @staticmethod
    def snapshot() -> tuple[float, float, float]:
        import resource

        busy = 0.0
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait
        except (OSError, ValueError, IndexError):
            pass
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.perf_counter(), busy, ru.ru_utime + ru.ru_stime

    @staticmethod
    def delta(a, b) -> dict:
        wall = max(b[0] - a[0], 1e-9)
        busy, ours = (b[1] - a[1]) / wall, (b[2] - a[2]) / wall
        return {"machine_busy_cores": busy, "benchmark_cores": ours, "other_work_cores": max(busy - ours, 0.0)}


# -- a second job on the cores --------------------------------------------------------


BURN = "while True: pass"  # one core, for as long as it runs


class Load:
    """`with Load(k):` runs k processes that each spin one core for the duration (the
    "second job on the cores" of the load test). k = 0 starts nothing."""

    def __init__(self, processes: int):
        self.processes = processes
        self._procs: list[subprocess.Popen] = []

    def __enter__(self):
        for _ in range(self.processes):
            self._procs.append(subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.DEVNULL))
        if self._procs:
            time.sleep(0.5)  # let them start spinning before anything is timed
        return self

    def __exit__(self, *exc):
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            p.wait(5)
        self._procs.clear()


# -- per-thread CPU from /proc ----------------------------------------------------------


def _schedstat(path: str) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting for one) of a thread, from its schedstat."""
    try:
        with open(path) as f:
            run, wait, _ = f.read().split()
        return int(run) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def _switches(path: str) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of a thread: how often it went to sleep,
    and how often the scheduler took its core while it could run."""
    vol = invol = 0
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    invol = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return vol, invol


def _minor_faults() -> int:
    """The process's minor page faults so far (/proc/self/stat field 10)."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, ValueError, IndexError):
        return 0


class ThreadClock:
    """Snapshots of the main thread's (on-CPU, run-queue) seconds and context switches, and
    of the other threads' on-CPU seconds, from /proc (Linux); zeros elsewhere."""

    def __init__(self):
        self.main_tid = threading.get_native_id()

    def snapshot(self) -> tuple:
        run, queue = _schedstat(f"/proc/self/task/{self.main_tid}/schedstat")
        vol, invol = _switches(f"/proc/self/task/{self.main_tid}/status")
        others = 0.0
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            tids = []
        for tid in tids:
            if int(tid) != self.main_tid:
                others += _schedstat(f"/proc/self/task/{tid}/schedstat")[0]
        return time.perf_counter(), run, queue, others, vol, invol, _minor_faults()

    @staticmethod
    def delta(a, b, steps: int = 1) -> dict:
        """Per step: wall, the main thread's on-CPU, run-queue and blocked seconds and its
        sleeps and preemptions, and the other threads' on-CPU seconds, between snapshots."""
        wall, run, queue, others, vol, invol, faults = (y - x for x, y in zip(a, b))
        return {
            "wall_s": wall / steps,
            "main_cpu_s": run / steps,
            "main_runqueue_s": queue / steps,
            "main_blocked_s": max(wall - run - queue, 0.0) / steps,
            "other_threads_cpu_s": others / steps,
            "main_sleeps": vol / steps,
            "main_preemptions": invol / steps,
            "minor_page_faults": faults / steps,  # the process's: fresh pages touched (allocations)
        }


def thread_names() -> dict[str, int]:
    """How many threads of this process carry each name (/proc/self/task/*/comm)."""
    names: collections.Counter = collections.Counter()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
    except OSError:
        pass
    return dict(sorted(names.items()))


# -- where a profiled step's time goes (see [Note: where time goes]) --------------------

_COLLECTIVE = re.compile(r"^(c10d::|_c10d_functional::|c10d_functional::)|gloo|nccl|record_param_comms")
_COPY = re.compile(
    r"^(aten::(copy_|cat|clone|_to_copy|to|contiguous|stack|split_with_sizes_copy|_chunk_cat|narrow_copy|"
    r"index_copy_?|fill_|zero_|zeros|zeros_like|new_zeros|full|_foreach_copy_|_foreach_zero_|"
    r"unsafe_split_with_sizes_copy)$|fsdp::)"
)
_FRAMEWORK = re.compile(  # views, metadata and allocation: no arithmetic, no bytes moved
    r"^aten::(empty|empty_like|empty_strided|new_empty|new_empty_strided|resize_|set_|view|_unsafe_view|"
    r"reshape|_reshape_alias|as_strided|as_strided_|t|transpose|permute|expand|expand_as|slice|select|narrow|"
    r"unsqueeze|squeeze|flatten|unflatten|split|split_with_sizes|chunk|unbind|detach|detach_|alias|lift_fresh|"
    r"numpy_T|view_as|unsafe_split|_local_scalar_dense|item|is_nonzero|result_type|lift|_has_compatible_"
    r"shallow_copy_type|_to_dense|requires_grad_|is_same_size|ones|ones_like|arange|scalar_tensor|"
    r"_nested_tensor_from_mask_left_aligned|record_stream|empty_like)$"
)
CATEGORIES = ("compute", "copies", "collective_calls", "framework_ops", "annotations")


def categorize(name: str) -> str:
    """The category of a profiler event by its name: an operator's (compute, copies, a
    collective call, a view/allocation) or an annotation (record_function, autograd node,
    optimizer step...: its self time is Python and framework)."""
    if _COLLECTIVE.search(name):
        return "collective_calls"
    if _COPY.search(name):
        return "copies"
    if _FRAMEWORK.search(name):
        return "framework_ops"
    if name.startswith("aten::") or name.startswith("inductor::") or name.startswith("torch_compile"):
        return "compute"
    if name.startswith("cpp_fused") or name.startswith("kernel_cpp") or name.startswith("graph_"):
        return "compute"  # inductor's generated CPU kernels
    return "annotations"


def shares(profile: dict) -> dict[str, float]:
    """A profiled step's wall time split five ways, in milliseconds that add up to it (see
    [Note: where time goes]): compute, copies, Python and other, waiting on collectives,
    waiting for a core. `profile` is what `profile_step` returns (or a mean of those)."""
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    for name, ms in profile["ops_self_ms"].items():
        by_cat[categorize(name)] += ms
    wall, blocked = profile["wall_ms"], profile["main_blocked_ms"]
    running = max(wall - blocked, 1e-9)  # on a CPU or waiting for one
    f = min(profile["main_cpu_ms"] / running, 1.0)  # the run-queue time, spread in proportion
    compute, copies = by_cat["compute"] * f, by_cat["copies"] * f
    return {
        "compute": compute,
        "copies": copies,
        "python_other": max(running * f - compute - copies, 0.0),
        "collective_wait": blocked,
        "runqueue": running * (1 - f),
    }


def profile_step(fn, trace_path: str | None = None) -> dict:
    """Run `fn()` once under torch.profiler (CPU) and the thread clock: the step's wall
    time, its main thread's on-CPU, run-queue and blocked time, the other threads' CPU
    time, and the self time of every operator on the main thread, by name (milliseconds).
    Writes a Chrome trace to `trace_path` when given."""
    from torch.profiler import ProfilerActivity, profile, record_function

    clock = ThreadClock()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        a = clock.snapshot()
        with record_function("benchmark_step"):
            fn()
        b = clock.snapshot()
    sched = ThreadClock.delta(a, b)
    events = prof.events()
    main = next((e.thread for e in events if e.name == "benchmark_step"), None)
    ops: collections.Counter = collections.Counter()
    for e in events:
        if e.thread == main and e.name != "benchmark_step":
            ops[e.name] += e.self_cpu_time_total / 1e3
    if trace_path is not None:
        os.makedirs(os.path.dirname(trace_path), exist_ok=True)
        prof.export_chrome_trace(trace_path)
    return {
        "wall_ms": sched["wall_s"] * 1e3,
        "main_cpu_ms": sched["main_cpu_s"] * 1e3,
        "main_runqueue_ms": sched["main_runqueue_s"] * 1e3,
        "main_blocked_ms": sched["main_blocked_s"] * 1e3,
        "other_threads_cpu_ms": sched["other_threads_cpu_s"] * 1e3,
        "ops_self_ms": dict(ops),
    }
