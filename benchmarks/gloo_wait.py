"""Waiting on a gloo collective: shardfn's polled wait vs a plain `Work.wait()`, with and without a busy-loop second job.

shardfn's distributed backend waits on a gloo work in slices of `Work.wait(timeout)`
(shardfn/_backend/base.py, [Note: polled waits]) so that it can notice a failed peer
and name a late one. This measures what that costs against a plain `work.wait()`: 2
gloo processes, each iteration starts an async all-gather, computes a little, then
waits; per iteration the wall time, the main thread's CPU time, its blocked time and
its run-queue time (from /proc), with 0, 1 and 2 CPU-burning processes on the machine.

    python -m benchmarks.gloo_wait            # writes benchmarks/results/gloo_wait.json
    python -m benchmarks.gloo_wait --tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

import torch
import torch.distributed as dist

import shardfn as sf
from shardfn._backend.base import _POLL
from shardfn.testing import run_multiprocess

from benchmarks import _common

RESULTS = os.path.join(os.path.dirname(__file__), "results")
MODES = ("plain", "polled")


def polled_wait(work) -> int:
    """shardfn's wait loop (base.py's BackendBase.wait), without its abort and deadline
    checks; returns how many slices timed out."""
    slices = 0
    while True:
        try:
            work.wait(_POLL)
            return slices
        except RuntimeError as err:
            if "timed out" not in str(err).lower():
                raise
            slices += 1


def rank_main(numel: int, iters: int, reps: int, matmuls: int):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename
    sf.init_mesh({"data": 2}, timeout=600)
    x, out = torch.randn(numel), torch.empty(2 * numel)
    a = torch.randn(256, 256)
    clock = _common.ThreadClock()
    per_mode = {m: [] for m in MODES}
    timed_out = 0
    for rep in range(reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            dist.barrier()
            s0 = clock.snapshot()
            for _ in range(iters):
                work = dist.all_gather_into_tensor(out, x, async_op=True)
                for _ in range(matmuls):
                    a @ a
                if mode == "plain":
                    work.wait()
                else:
                    timed_out += polled_wait(work)
            per_mode[mode].append(_common.ThreadClock.delta(s0, clock.snapshot(), iters))
    dist.barrier()
    out = {m: {k: statistics.median(d[k] for d in ds) for k in ds[0]} for m, ds in per_mode.items()}
    out["polled"]["timed_out_slices"] = timed_out / (iters * reps)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", nargs="+", type=int, default=[0, 1, 2], help="busy-loop processes per run")
    parser.add_argument("--numel", type=int, default=1 << 23,
                        help="floats all-gathered per rank (32 MB: waits longer than a poll slice)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--matmuls", type=int, default=5, help="256x256 matmuls between start and wait")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=os.path.join(RESULTS, "gloo_wait"), help="JSON path, without .json")
    args = parser.parse_args(argv)
    if args.tiny:
        args.loads, args.numel, args.iters, args.reps = [0], 1 << 10, 3, 2
    env = _common.environment("benchmarks.gloo_wait", argv)
    rows = []
    for load in args.loads:
        with _common.Load(load):
            use0 = _common.MachineUse.snapshot()
            per_rank = run_multiprocess(rank_main, 2, args.numel, args.iters, args.reps, args.matmuls, timeout=1200)
            use = _common.MachineUse.delta(use0, _common.MachineUse.snapshot())
        per_mode = {m: {k: statistics.fmean(r[m][k] for r in per_rank) for k in per_rank[0][m]} for m in MODES}
        rows.append({"load_processes": load, "machine_use": use, "per_iteration": per_mode,
                     "polled_over_plain": per_mode["polled"]["wall_s"] / per_mode["plain"]["wall_s"]})
        for m in MODES:
            d = per_mode[m]
            print(f"load {load} {m:6}: {d['wall_s'] * 1e3:7.2f} ms/iter, main CPU {d['main_cpu_s'] * 1e3:6.2f} ms, "
                  f"blocked {d['main_blocked_s'] * 1e3:6.2f} ms, waiting for a core {d['main_runqueue_s'] * 1e3:6.2f} ms")
    report = {"benchmark": "gloo_wait", "env": _common.finish_environment(env),
              "config": {"numel": args.numel, "iters": args.iters, "reps": args.reps, "matmuls": args.matmuls,
                         "poll_ms": _POLL.total_seconds() * 1e3},
              "results": rows}
    _common.write_json(report, args.out)
    return report


if __name__ == "__main__":
    main()
