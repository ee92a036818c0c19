"""Time a shard step with eager blocks against compiled blocks (`sf.functional(compile=True)`).

A nanoGPT-style GPT on 2 ranks, fp32 AdamW via `sf.train_step`, one intra-op thread per
rank; the same batches in both runs, whose steps alternate. Prints a table (median step after warm-up, the first
step, which compiles, and the largest loss difference) and writes JSON. A timing, not a
test: it asserts nothing.

    python scripts/time_compile.py                        # simulated mesh (rank threads)
    python scripts/time_compile.py --backend distributed  # 2 gloo processes
    python scripts/time_compile.py --layers 2 --embd 64 --steps 10   # quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import shardfn as sf
from shardfn.testing import run_on_mesh
from shardfn.testing.models import GPT, GPTConfig


def train_loops(mesh, models: dict, steps: int, batch_size: int) -> dict:
    """`{name: (per-step seconds, losses)}` of `steps` AdamW steps of each model on this rank,
    the models' steps interleaved (eager, compiled, eager, ...) so that load from other
    processes on the machine falls on both alike."""
    torch.set_num_threads(1)
    runs = {}
    for name, (apply_fn, params) in models.items():
        step = sf.shard(lambda p, b, apply_fn=apply_fn: apply_fn(p, *b), mesh)
        opt = sf.optim.adamw(1e-3)
        shards = step.shard_params(params)
        runs[name] = [sf.train_step(step, opt), shards, opt.init(shards), [], []]
    vocab = params["transformer"]["wte"]["weight"].shape[0]
    seq = params["transformer"]["wpe"]["weight"].shape[0]  # block_size
    g = torch.Generator().manual_seed(100 + mesh.rank)
    for _ in range(steps):
        batch = tuple(torch.randint(0, vocab, (batch_size, seq), generator=g) for _ in range(2))  # (B, T) x 2
        for run in runs.values():
            train, shards, state, times, losses = run
            t0 = time.perf_counter()
            run[1], run[2], loss = train(shards, state, batch)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
    return {name: (run[3], run[4]) for name, run in runs.items()}


def model(cfg: GPTConfig, compile: bool):
    torch.manual_seed(0)  # the same init in both runs
    return sf.functional(GPT(cfg), compile=compile)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["simulated", "distributed"], default="simulated")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=23)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default="time_compile.json")
    args = parser.parse_args(argv)
    cfg = GPTConfig(vocab_size=1024, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    names = {"eager": False, "compiled blocks": True}
    built = {n: model(cfg, c) for n, c in names.items()} if args.backend == "simulated" else None  # one RNG

    def body(mesh):
        models = built or {n: model(cfg, c) for n, c in names.items()}  # a process builds its own
        return train_loops(mesh, models, args.steps, args.batch)

    rows = {}
    for name, (times, losses) in run_on_mesh(body, {"data": 2}, args.backend, timeout=600)[0].items():
        rows[name] = {"first_step_s": times[0], "median_step_s": statistics.median(times[args.warmup:]),
                      "losses": losses}
    eager = rows["eager"]
    print(f"GPT {args.layers}L d{args.embd} T{args.seq} B{args.batch}/rank, 2 ranks ({args.backend}), fp32 AdamW, "
          f"torch {torch.__version__}")
    print(f"{'':16s} {'first step (s)':>15s} {'median step (s)':>16s} {'vs eager':>9s} {'max |dloss|':>12s}")
    for name, r in rows.items():
        dloss = max(abs(a - b) for a, b in zip(r["losses"], eager["losses"]))
        print(f"{name:16s} {r['first_step_s']:15.3f} {r['median_step_s']:16.4f} "
              f"{eager['median_step_s'] / r['median_step_s']:8.2f}x {dloss:12.1e}")
    with open(args.json, "w") as f:
        json.dump({"config": vars(args), "torch": torch.__version__, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
