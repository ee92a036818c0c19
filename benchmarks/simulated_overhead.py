"""The same `shard` training program on the simulated mesh vs real processes, same N.

The simulated mesh runs every rank as a thread of one process (convenient for notebooks
and tests); this measures what that costs against one process per rank (gloo, fork).
Both use one intra-op thread per rank. Prints the median step time of each and the ratio.

    python -m benchmarks.simulated_overhead [--tiny] [--world 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import shardfn as sf
from shardfn.testing import run_multiprocess
from shardfn.testing.models import MLP

from benchmarks import _common

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def program(mesh, width: int, depth: int, steps: int) -> list[float]:
    """Build, warm up, then time `steps` training steps; per-step seconds."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    apply_fn, params = sf.functional(MLP(width=width, depth=depth, d_in=64, d_out=8))
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
    opt = sf.optim.adamw(1e-3, inplace=True)
    train = sf.train_step(step, opt, inplace=True)
    shards = step.shard_params(params)
    state = opt.init(shards)
    g = torch.Generator().manual_seed(mesh.rank)
    batch = (torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        shards, state, _ = train(shards, state, batch)
        mesh.all_reduce(torch.zeros(()))  # a barrier, so every rank's step is over
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=os.path.join(RESULTS, "simulated_overhead.json"))
    args = parser.parse_args(argv)
    if args.tiny:
        args.width, args.depth, args.steps = 32, 2, 2
    env = _common.environment("benchmarks.simulated_overhead", argv)
    shape = {"data": args.world}
    mesh = sf.local_mesh(shape)
    simulated = mesh.run(program, mesh, args.width, args.depth, args.steps)[0]
    distributed = run_multiprocess(lambda: program(sf.init_mesh(shape), args.width, args.depth, args.steps),
                                   args.world, timeout=600)[0]
    sim, dist = statistics.median(simulated), statistics.median(distributed)
    print(f"world {args.world}: simulated {sim:.4f} s/step, multi-process {dist:.4f} s/step, ratio {sim / dist:.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"env": _common.finish_environment(env), "world": args.world, "simulated_s": sim, "multiprocess_s": dist,
                   "ratio": sim / dist}, f, indent=2)
    return sim, dist


if __name__ == "__main__":
    main()
