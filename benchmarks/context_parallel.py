"""Context-parallel attention: ring and Ulysses vs one rank and vs all-gather-KV attention.

One causal attention layer, forward + backward, fp32, on a sequence of T tokens split
over a 'seq' axis of N gloo processes (1 thread each). Methods (`METHODS`):

  single      every rank runs F.scaled_dot_product_attention on the whole sequence (no
              communication): the one-rank time, under the same core contention
  allgather   all_gather K and V over 'seq', local SDPA of this rank's queries against the
              whole sequence with the causal offset of its block (the simple baseline:
              K/V memory O(T) per rank)
  ring        sf.nn.ring_attention (zig-zag layout): K/V blocks around the ring, compute
              overlapping the next block's ppermute, custom ring VJP
  ulysses     sf.nn.ulysses_attention (zig-zag layout): all_to_all to a split of the heads

Repetitions are interleaved (the order rotates each repetition); a method's time is the
median over repetitions of the slowest rank's mean step time. Per step it also records
the main thread's time blocked on collectives (/proc schedstat, see benchmarks/_common.py)
and, for ring attention, the time spent waiting on each ppermute after the compute it
overlaps (`shardfn.nn._ring.counting()`'s `wait_s`: the communication the compute did not
hide). Outputs are checked against single-rank SDPA first. Prints a table with ratios and
writes JSON (date, machine, load average, command) to benchmarks/results/.

    python -m benchmarks.context_parallel                  # T = 8192, N = 2 and 4
    python -m benchmarks.context_parallel --seq-len 16384 --world-sizes 4 --reps 7
    python -m benchmarks.context_parallel --tiny           # seconds; what the test suite runs
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import torch
from torch.nn import functional as F

import shardfn as sf
from shardfn.nn._ring import counting
from shardfn.testing import run_multiprocess

from benchmarks import _common

RESULTS = os.path.join(os.path.dirname(__file__), "results")
METHODS = ("single", "allgather", "ring", "ulysses")
SEQ = sf.P(None, None, "seq")  # (B, H, T, D): the sequence is dim 2


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int = 1
    heads: int = 8
    seq_len: int = 8192
    head_dim: int = 64


TINY = Shape(batch=1, heads=4, seq_len=64, head_dim=8)


# -- the methods: (q, k, v) local blocks in the zig-zag layout -> this rank's output rows ----


def allgather_kv_attention(q, k, v, axis: str):
    """Causal attention of this rank's zig-zag query block against all_gathered K and V:
    the baseline ring attention improves on (K/V memory and traffic O(T) per rank)."""
    n = sf.axis_size(axis)
    k_all = sf.nn.unzigzag(sf.all_gather(k, axis, dim=2), n, 2)  # (B, H, T, D) in sequence order
    v_all = sf.nn.unzigzag(sf.all_gather(v, axis, dim=2), n, 2)
    q_pos = sf.nn.positions(q.shape[2], axis, layout="zigzag", device=q.device)  # global rows of our queries
    k_pos = torch.arange(k_all.shape[2], device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]  # (T_local, T): the causal mask at our offset
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allowed)


def _method(name: str, mesh):
    """A function of this rank's (q, k, v) blocks for `name` (single: of the whole tensors)."""
    if name == "single":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    body = {
        "allgather": lambda q, k, v: allgather_kv_attention(q, k, v, "seq"),
        "ring": lambda q, k, v: sf.nn.ring_attention(q, k, v, "seq", layout="zigzag"),
        "ulysses": lambda q, k, v: sf.nn.ulysses_attention(q, k, v, "seq", layout="zigzag"),
    }[name]
    return sf.shard_map(body, mesh, (SEQ, SEQ, SEQ), SEQ)


def _inputs(shape: Shape, mesh, seed: int = 0):
    """The global (q, k, v, cotangent), the same on every rank; and this rank's zig-zag blocks."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(shape.batch, shape.heads, shape.seq_len, shape.head_dim, generator=g) for _ in range(4)]
    n = mesh.shape["seq"]
    r = mesh.coords["seq"]
    blocks = [torch.chunk(sf.nn.zigzag(x, n, 2), n, dim=2)[r].contiguous() for x in full]
    return full, blocks


def rank_main(shape: Shape, world: int, methods: list, reps: int, steps: int, warmup: int):
    torch.set_num_threads(1)
    mesh = sf.init_mesh({"seq": world}, timeout=3600)
    full, blocks = _inputs(shape, mesh)
    fns = {m: _method(m, mesh) for m in methods}
    args = {m: [x.clone().requires_grad_() for x in (full if m == "single" else blocks)[:3]] for m in methods}
    cts = {m: (full if m == "single" else blocks)[3] for m in methods}

    def step(m):
        out = fns[m](*args[m])
        out.backward(cts[m])
        for x in args[m]:
            x.grad = None
        return out

    # Correctness first: every method's output rows equal single-rank SDPA's.
    want = torch.chunk(sf.nn.zigzag(F.scaled_dot_product_attention(*full[:3], is_causal=True), world, 2), world,
                       dim=2)[mesh.coords["seq"]]
    max_diff = {}
    for m in methods:
        out = step(m).detach()
        if m == "single":
            out = torch.chunk(sf.nn.zigzag(out, world, 2), world, dim=2)[mesh.coords["seq"]]
        max_diff[m] = (out - want).abs().max().item()
        for _ in range(warmup - 1):
            step(m)
    order = list(methods)
    times = {m: [] for m in methods}
    cpu = {m: [] for m in methods}
    ring_wait = {m: [] for m in methods}
    clock = _common.ThreadClock()
    for rep in range(reps):
        for m in order[rep % len(order):] + order[:rep % len(order)]:
            torch.distributed.barrier()
            with counting() as c:
                a = clock.snapshot()
                for _ in range(steps):
                    step(m)
                b = clock.snapshot()  # before the barrier: this rank's own time
            torch.distributed.barrier()
            times[m].append((b[0] - a[0]) / steps)
            cpu[m].append(_common.ThreadClock.delta(a, b, steps))
            ring_wait[m].append({"wait_s": c["wait_s"] / steps, "transfers": c["transfers"] / steps})
    torch.distributed.barrier()
    return {
        "times": times,
        "max_diff": max_diff,
        "cpu": {m: {k: statistics.median(d[k] for d in ds) for k in ds[0]} for m, ds in cpu.items()},
        "ring_wait": {m: {k: statistics.median(d[k] for d in ds) for k in ds[0]} for m, ds in ring_wait.items()},
    }


def run(world: int, shape: Shape, args) -> dict:
    load_before = list(os.getloadavg())
    per_rank = run_multiprocess(rank_main, world, shape, world, args.methods, args.reps, args.steps, args.warmup,
                                timeout=7200)
    ran = list(per_rank[0]["times"])
    step_s = {m: statistics.median(max(r["times"][m][i] for r in per_rank) for i in range(args.reps)) for m in ran}
    mean = lambda m, key, k: statistics.fmean(r[key][m][k] for r in per_rank)  # noqa: E731
    return {
        "world": world,
        "shape": dataclasses.asdict(shape),
        "loadavg_before_after": [load_before, list(os.getloadavg())],
        "step_s": step_s,
        "step_s_per_rep": {m: [max(r["times"][m][i] for r in per_rank) for i in range(args.reps)] for m in ran},
        "max_abs_diff_vs_sdpa": {m: max(r["max_diff"][m] for r in per_rank) for m in ran},
        # per step, median over repetitions, mean over ranks
        "blocked_on_collectives_s": {m: mean(m, "cpu", "main_blocked_s") for m in ran},
        "ppermute_wait_s": {m: mean(m, "ring_wait", "wait_s") for m in ran if m == "ring"},
        "ppermute_waits_per_step": {m: mean(m, "ring_wait", "transfers") for m in ran if m == "ring"},
        "ratios": {f"{m}/single": step_s[m] / step_s["single"] for m in ran if "single" in step_s and m != "single"}
        | {f"{m}/allgather": step_s[m] / step_s["allgather"] for m in ("ring", "ulysses")
           if m in step_s and "allgather" in step_s},
    }


def markdown_table(rows: list[dict]) -> str:
    """The results as a markdown table (printed here; docs/benchmarks.md via benchmarks.report)."""
    lines = ["| N | T | method | step ms | / single | / all-gather-KV | blocked on collectives ms "
             "| ppermute wait ms | max abs diff vs SDPA |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        for m, s in row["step_s"].items():
            vs_single = row["ratios"].get(f"{m}/single")
            vs_ag = row["ratios"].get(f"{m}/allgather")
            wait = row["ppermute_wait_s"].get(m)
            lines.append(
                f"| {row['world']} | {row['shape']['seq_len']} | {m} | {s * 1e3:.2f} | "
                f"{'' if vs_single is None else f'{vs_single:.2f}'} | {'' if vs_ag is None else f'{vs_ag:.2f}'} | "
                f"{row['blocked_on_collectives_s'][m] * 1e3:.2f} | {'' if wait is None else f'{wait * 1e3:.2f}'} | "
                f"{row['max_abs_diff_vs_sdpa'][m]:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seq-len", type=int, default=Shape.seq_len)
    parser.add_argument("--heads", type=int, default=Shape.heads)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="T = 64, 1 rep of 1 step: seconds")
    parser.add_argument("--out", default=os.path.join(RESULTS, "context_parallel"), help="JSON path, without .json")
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else Shape(seq_len=args.seq_len, heads=args.heads)
    if args.tiny:
        args.reps, args.steps, args.warmup = 1, 1, 1
    env = _common.environment("benchmarks.context_parallel", argv)
    rows = [run(n, shape, args) for n in args.world_sizes]
    report = {
        "benchmark": "context_parallel",
        "env": _common.finish_environment(env),
        "config": {"reps": args.reps, "steps": args.steps, "warmup": args.warmup, "methods": args.methods,
                   "tiny": args.tiny, "threads_per_rank": 1, "dtype": "float32", "causal": True,
                   "layout": "zigzag"},
        "results": rows,
    }
    print("\n" + markdown_table(rows))
    _common.write_json(report, args.out)
    return report


if __name__ == "__main__":
    main()
