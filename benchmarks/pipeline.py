"""Pipeline schedules vs FSDP alone: step time at p = 2 and 4 processes on one deep model.

Every method runs in the same gloo processes (1 thread per rank) on the same model (a
residual MLP of `--layers` layers of width `--width`, an input projection as `pre` and a
regression head as `post`) and the same global batch:

  gpipe, 1f1b, interleaved (V = 2), zb-h1   sf.pipeline over {'stage': p}, M microbatches (default 2p)
  fsdp                                      sf.shard over {'data': p}, each rank 1/p of the batch

A method's time is the median over repetitions of the slowest rank's step time (after
warm-up steps), repetitions interleaved (the order rotates) so that drift hits all alike.
For the pipelines it also records each rank's bubble measured from the executor's action
timestamps (idle / step time) next to the schedule's slot count. Prints a table with each
method's ratio to FSDP and writes JSON; `python -m benchmarks.report --write` turns the
JSON into docs/benchmarks.md's table (section "pipeline"). It never asserts a time.

    python -m benchmarks.pipeline                        # p = 2, 4; tens of seconds to minutes
    python -m benchmarks.pipeline --reps 7 --world-sizes 4 --microbatches 8
    python -m benchmarks.pipeline --tiny                 # seconds; what the test suite runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import shardfn as sf
from shardfn.testing import run_multiprocess

from benchmarks import _common

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
METHODS = [name for name, _ in SCHEDULES] + ["fsdp"]


def layer_fn(w, x):  # (b, W) -> (b, W): a residual MLP block
    return x + torch.tanh(x @ w["w1"]) @ w["w2"]


def pre(w, mb):
    return mb[0] @ w["inp"]


def post(w, x, mb):
    return ((x @ w["out"] - mb[1]) ** 2).mean()


def fsdp_loss(params, batch):
    h = pre(params["pre"], batch)
    for layer in params["layers"]:
        h = layer_fn(layer, h)
    return post(params["post"], h, batch)


def make_params(layers: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = [{"w1": torch.randn(width, width, generator=g) / width ** 0.5,
             "w2": torch.randn(width, width, generator=g) / width} for _ in range(layers)]
    shared = {"pre": {"inp": torch.randn(16, width, generator=g) / 4},
              "post": {"out": torch.randn(width, 1, generator=g) / width ** 0.5}}
    return shared, rows


def make_batch(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g)


def _rank_body(cfg: dict):
    """On every rank: the step times of every method, repetitions interleaved."""
    torch.set_num_threads(1)
    p = int(os.environ["WORLD_SIZE"])
    shared, rows = make_params(cfg["layers"], cfg["width"])
    batch = make_batch(cfg["batch"])
    M = cfg["microbatches"] or 2 * p
    runners, bubbles, slots = {}, {}, {}
    stage_mesh = sf.init_mesh({"stage": p})
    for name, V in SCHEDULES:
        if cfg["layers"] % (p * V):
            continue
        pipe = sf.pipeline(layer_fn, pre=pre, post=post, microbatches=M, schedule=name, virtual_stages=V,
                           mesh=stage_mesh)
        local = pipe.scatter_params(dict(shared, layers=sf.pipeline.stack_layers(rows, V)))
        opt = sf.optim.adamw(1e-3)
        state = [local, opt.init(local)]
        train = sf.train_step(pipe, opt, inplace=True)

        def run(train=train, state=state, pipe=pipe, name=name):
            train(state[0], state[1], batch)
            bubbles.setdefault(name, []).append(pipe.measured_bubble())

        runners[name] = run
        slots[name] = pipe.schedule(p).bubble()[stage_mesh.coords["stage"]]
    data_mesh = sf.init_mesh({"data": p})
    step = sf.shard(fsdp_loss, data_mesh, data_axes="data")
    shards = step.shard_params(dict(shared, layers=rows))
    opt = sf.optim.adamw(1e-3)
    fsdp_state = [shards, opt.init(shards)]
    fsdp_train = sf.train_step(step, opt, inplace=True)
    mine = tuple(x.chunk(p)[data_mesh.rank] for x in batch)
    runners["fsdp"] = lambda: fsdp_train(fsdp_state[0], fsdp_state[1], mine)
    times = {name: [] for name in runners}
    names = list(runners)
    for _ in range(cfg["warmup"]):
        for name in names:
            runners[name]()
    for rep in range(cfg["reps"]):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            data_mesh.all_reduce(torch.zeros(1), None)  # start together
            t0 = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - t0)
    return {"times": times, "bubbles": {k: v[cfg["warmup"]:] for k, v in bubbles.items()}, "slots": slots,
            "microbatches": M}


def measure(p: int, cfg: dict) -> dict:
    per_rank = run_multiprocess(_rank_body, p, cfg, timeout=600)
    reps = cfg["reps"]
    row = {"world": p, "microbatches": per_rank[0]["microbatches"], "step_s": {}, "bubble_measured": {},
           "bubble_slots": {}}
    for name in per_rank[0]["times"]:
        slowest = [max(r["times"][name][i] for r in per_rank) for i in range(reps)]
        row["step_s"][name] = statistics.median(slowest)
        if name in per_rank[0]["bubbles"]:
            row["bubble_measured"][name] = [statistics.median(r["bubbles"][name]) for r in per_rank]
            row["bubble_slots"][name] = [r["slots"][name] for r in per_rank]
    row["ratio_vs_fsdp"] = {k: v / row["step_s"]["fsdp"] for k, v in row["step_s"].items()}
    return row


def render(report: dict) -> str:
    """The markdown table docs/benchmarks.md shows (benchmarks.report's "pipeline" section)."""
    head = "| method | p | M | step (s) | / FSDP | bubble measured (max rank) | bubble slots |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for row in report["results"]:
        for name in METHODS:
            if name not in row["step_s"]:
                continue
            measured = row["bubble_measured"].get(name)
            slots = row["bubble_slots"].get(name)
            lines.append(f"| {name} | {row['world']} | {row['microbatches'] if name != 'fsdp' else '-'} | "
                         f"{row['step_s'][name]:.4f} | {row['ratio_vs_fsdp'][name]:.2f} | "
                         f"{max(measured):.3f} | {max(slots):.3f} |" if measured else
                         f"| {name} | {row['world']} | - | {row['step_s'][name]:.4f} | 1.00 | - | - |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256, help="global batch (rows)")
    parser.add_argument("--microbatches", type=int, default=0, help="M (default 2p)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=os.path.join(RESULTS, "pipeline"))
    args = parser.parse_args(argv)
    if args.tiny:
        args.world_sizes, args.layers, args.width, args.batch, args.reps, args.warmup = [2], 4, 16, 16, 2, 1
    env = _common.environment("benchmarks.pipeline", argv)
    cfg = {"layers": args.layers, "width": args.width, "batch": args.batch, "microbatches": args.microbatches,
           "reps": args.reps, "warmup": args.warmup}
    rows = [measure(p, cfg) for p in args.world_sizes]
    report = {"env": _common.finish_environment(env), "config": cfg, "results": rows}
    print(render(report))
    _common.write_json(report, args.out)
    return report


if __name__ == "__main__":
    main()
