"""shardfn `shard` vs PyTorch FSDP2 vs DDP vs one process: step time, memory, traffic.

Same model, data, world size and threads per rank for every method, in one multi-process
gloo run, with interleaved repetitions (A B C A B C ...) so that machine drift hits all
alike. Prints a table and writes JSON (and a PNG bar chart when matplotlib is present).

    python -m benchmarks.fsdp_vs_ddp                 # GPT + MLP, world sizes 2 and 4
    python -m benchmarks.fsdp_vs_ddp --tiny          # seconds; what the test suite runs
    python -m benchmarks.fsdp_vs_ddp --models gpt --world-sizes 2 --reps 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import shardfn as sf
from shardfn.testing import run_multiprocess
from shardfn.testing.models import GPT, MLP, GPTConfig

RESULTS = os.path.join(os.path.dirname(__file__), "results")
LR = 1e-3


def build_model(name: str, tiny: bool):
    torch.manual_seed(0)
    if name == "gpt":
        cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32) if tiny else GPTConfig()
        return GPT(cfg)
    return MLP(width=64, depth=2, d_in=16, d_out=4) if tiny else MLP(width=1024, depth=8, d_in=64, d_out=8)


def make_batch(name: str, model, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        cfg = model.cfg
        idx = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)
        return idx, torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)
    d_in, d_out = model.inp.in_features, model.out.out_features
    return torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# -- the methods: each returns (step() -> loss, state_bytes() -> int, extra) ---------------


def shardfn_trainer(step, params, batch):
    """`(one step -> mean loss, state bytes)` of `sf.train_step` on a shard step, with
    in-place AdamW like torch.optim (state and shards are updated in their buffers)."""
    opt = sf.optim.adamw(LR, weight_decay=0.0, inplace=True)
    train = sf.train_step(step, opt, inplace=True)
    state = {"shards": step.shard_params(params)}
    state["opt"] = opt.init(state["shards"])

    def one():
        state["shards"], state["opt"], loss = train(state["shards"], state["opt"], batch)
        return float(loss)

    def nbytes():  # shards + grads (same size as shards) + optimizer state
        leaves = torch.utils._pytree.tree_leaves
        return 2 * tensor_bytes(leaves(state["shards"])) + tensor_bytes(leaves(state["opt"]))

    return one, nbytes


def method_shardfn(name, mesh, batch, tiny):
    apply_fn, params = sf.functional(build_model(name, tiny))
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
    return (*shardfn_trainer(step, params, batch), step)


def _torch_opt_bytes(model, opt):
    def local(t):
        return t._local_tensor if hasattr(t, "_local_tensor") else t

    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    states = [local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensor_bytes(params) + tensor_bytes(grads) + tensor_bytes(states)


def method_fsdp2(name, mesh, batch, tiny):
    from torch.distributed.fsdp import fully_shard

    model = build_model(name, tiny)
    blocks = model.transformer.h if name == "gpt" else model.layers
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return (*torch_trainer(model, batch), None)


def torch_trainer(model, batch):
    """`(one step -> mean loss over ranks, state bytes)` of a torch-wrapped model (FSDP2,
    DDP, DTensor) with AdamW(foreach)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=True)

    def one():
        opt.zero_grad(set_to_none=True)
        loss = model(*batch)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        return float(mean) / torch.distributed.get_world_size()

    return one, lambda: _torch_opt_bytes(model, opt)


def method_ddp(name, mesh, batch, tiny):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return (*torch_trainer(DDP(build_model(name, tiny)), batch), None)


METHODS = {"shardfn": method_shardfn, "fsdp2": method_fsdp2, "ddp": method_ddp}


def rank_main(name: str, world: int, rows: int, reps: int, steps: int, tiny: bool):
    torch.set_num_threads(1)
    mesh = sf.init_mesh({"data": world}, timeout=600)
    rank = mesh.rank
    model = build_model(name, tiny)
    batch = make_batch(name, model, rows, seed=1000 + rank)
    made = {m: fn(name, mesh, batch, tiny) for m, fn in METHODS.items()}
    # Correctness first: the same 3 steps from the same init; losses vs DDP.
    losses = {m: [made[m][0]() for _ in range(3)] for m in made}
    times = {m: [] for m in made}
    for _ in range(reps):
        for m, (one, _, _) in made.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                one()
            torch.distributed.barrier()
            times[m].append((time.perf_counter() - t0) / steps)
    # One process on the global batch (rank 0 alone; the others wait).
    single = []
    if rank == 0:
        ref = build_model(name, tiny)
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0, foreach=True)
        global_batch = [torch.cat(t) for t in zip(*(make_batch(name, ref, rows, 1000 + r) for r in range(world)))]
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                ref(*global_batch).backward()
                opt.step()
            single.append((time.perf_counter() - t0) / steps)
    torch.distributed.barrier()
    step = made["shardfn"][2]
    return {
        "times": times,
        "single": single,
        "losses": losses,
        "state_bytes": {m: made[m][1]() for m in made},
        "stats": step.stats(),
    }


def theory_bytes(stats: dict) -> float:
    return stats["reduce_scatter_bytes"]  # Psi in param dtype, padded


def run(model: str, world: int, args) -> dict:
    rows = 2 if args.tiny else (8 if model == "gpt" else 64)
    per_rank = run_multiprocess(rank_main, world, model, world, rows, args.reps, args.steps, args.tiny,
                                timeout=3600)
    medians = {m: statistics.median(max(r["times"][m][i] for r in per_rank) for i in range(args.reps))
               for m in METHODS}
    single = statistics.median(per_rank[0]["single"])
    stats = per_rank[0]["stats"]
    psi = theory_bytes(stats)
    sent = (stats["all_gather_bytes"] + stats["reduce_scatter_bytes"]) * (world - 1) / world
    losses = per_rank[0]["losses"]
    return {
        "model": model,
        "world": world,
        "median_step_s": medians,
        "single_process_step_s": single,
        "ratio_vs_fsdp2": medians["shardfn"] / medians["fsdp2"],
        "ratio_vs_ddp": medians["shardfn"] / medians["ddp"],
        "state_bytes_per_rank": per_rank[0]["state_bytes"],
        "comm_bytes_per_rank": sent,
        "comm_theory_bytes_per_rank": 3 * psi * (world - 1) / world,
        "stats": stats,
        "max_loss_diff_vs_ddp": {m: max(abs(a - b) for a, b in zip(losses[m], losses["ddp"])) for m in losses},
    }


def print_table(rows: list[dict]) -> None:
    head = f"{'model':5} {'N':>2} {'shardfn s':>10} {'fsdp2 s':>9} {'ddp s':>8} {'1-proc s':>9} " \
           f"{'/fsdp2':>7} {'/ddp':>6} {'state MB sf/fsdp2/ddp':>24} {'comm MB (theory)':>18} {'dloss':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        t, sb = r["median_step_s"], r["state_bytes_per_rank"]
        mb = "/".join(f"{sb[m] / 2**20:.1f}" for m in ("shardfn", "fsdp2", "ddp"))
        comm = f"{r['comm_bytes_per_rank'] / 2**20:.2f} ({r['comm_theory_bytes_per_rank'] / 2**20:.2f})"
        print(f"{r['model']:5} {r['world']:>2} {t['shardfn']:>10.4f} {t['fsdp2']:>9.4f} {t['ddp']:>8.4f} "
              f"{r['single_process_step_s']:>9.4f} {r['ratio_vs_fsdp2']:>7.3f} {r['ratio_vs_ddp']:>6.3f} "
              f"{mb:>24} {comm:>18} {r['max_loss_diff_vs_ddp']['shardfn']:>8.1e}")


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['model']} N={r['world']}" for r in rows]
    width = 0.25
    for j, m in enumerate(("shardfn", "fsdp2", "ddp")):
        ax.bar([i + (j - 1) * width for i in range(len(rows))], [r["median_step_s"][m] for r in rows], width, label=m)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("median step time (s)")
    ax.set_title("shardfn vs FSDP2 vs DDP (gloo, 1 thread per rank)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt", "mlp"], choices=["gpt", "mlp"])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--tiny", action="store_true", help="tiny models, 1 rep: seconds")
    parser.add_argument("--out", default=os.path.join(RESULTS, "fsdp_vs_ddp"))
    args = parser.parse_args(argv)
    if args.tiny:
        args.reps, args.steps = 1, 1
    rows = [run(m, n, args) for m in args.models for n in args.world_sizes]
    print_table(rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, "results": rows}, f, indent=2)
    if plot(rows, args.out + ".png"):
        print(f"wrote {args.out}.json and {args.out}.png")
    else:
        print(f"wrote {args.out}.json (no PNG: matplotlib is not installed)")
    return rows


if __name__ == "__main__":
    main()
