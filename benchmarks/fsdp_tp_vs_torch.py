"""FSDP x TP: shardfn `shard(..., param_specs=...)` vs PyTorch's FSDP2 + DTensor tensor parallelism.

The same model (a stack of pre-LayerNorm Megatron MLP blocks: fc1 column-parallel, fc2
row-parallel), the same initial weights, data and AdamW, on a {'data': D, 'model': 2}
mesh of gloo processes, 1 thread per rank:

- shardfn: `sf.shard(loss_fn, mesh, param_specs=...)`, one `sf.psum(..., 'model')` per
  block inside `loss_fn`, `sf.train_step` with in-place AdamW;
- torch: `parallelize_module(block, mesh['tp'], {'fc1': ColwiseParallel(), 'fc2':
  RowwiseParallel()})`, then `fully_shard(block, mesh=mesh['dp'])` per block and for the
  model, `torch.optim.AdamW(foreach=True)`.

Repetitions are interleaved (A B A B ...) so machine drift hits both alike. Prints a
table and writes JSON (and a PNG when matplotlib is present).

    python -m benchmarks.fsdp_tp_vs_torch              # width 512, 6 blocks, 4 ranks
    python -m benchmarks.fsdp_tp_vs_torch --tiny       # seconds; what the test suite runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

import shardfn as sf
from shardfn.testing import run_multiprocess
from benchmarks import _common
from benchmarks.fsdp_vs_ddp import shardfn_trainer, torch_trainer  # the same trainers as the 1-D benchmark

RESULTS = os.path.join(os.path.dirname(__file__), "results")


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)  # column-parallel over 'model'
        self.fc2 = nn.Linear(4 * width, width)  # row-parallel over 'model'

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, width: int, depth: int, d_out: int = 8):
        super().__init__()
        self.layers = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, d_out)

    def forward(self, x, y):
        for block in self.layers:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def build(args) -> Net:
    torch.manual_seed(0)
    return Net(args.width, args.depth)


def spec_of(path):
    """Megatron's split of the module tree's leaves over 'model' (nn.Linear is (out, in))."""
    if path[0] != "layers":
        return None
    if path[2] == "fc1":
        return sf.P("model")  # weight (4W, W) and bias (4W,): this rank's hidden units
    if path[2] == "fc2" and path[3] == "weight":
        return sf.P(None, "model")  # (W, 4W): the matching input columns
    return None  # LayerNorm, fc2's bias (added after the psum)


def tp_loss(params, batch):
    x, y = batch
    for blk in params["layers"]:
        h = F.layer_norm(x, x.shape[-1:], blk["ln"]["weight"], blk["ln"]["bias"])
        h = F.gelu(F.linear(h, blk["fc1"]["weight"], blk["fc1"]["bias"]))  # (B, 4W / model)
        x = x + sf.psum(F.linear(h, blk["fc2"]["weight"]), "model") + blk["fc2"]["bias"]
    return F.mse_loss(F.linear(x, params["head"]["weight"], params["head"]["bias"]), y)


def method_shardfn(args, mesh, batch):
    _, params = sf.functional(build(args))
    return shardfn_trainer(sf.shard(tp_loss, mesh, data_axes="data", param_specs=spec_of), params, batch)


def method_torch(args, mesh, batch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dm = init_device_mesh("cpu", (mesh.shape["data"], mesh.shape["model"]), mesh_dim_names=("dp", "tp"))
    model = build(args)
    for block in model.layers:
        parallelize_module(block, dm["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(block, mesh=dm["dp"])
    fully_shard(model, mesh=dm["dp"])
    return torch_trainer(model, batch)  # the mean over all ranks = over 'dp' ('tp' ranks hold the same loss)


METHODS = {"shardfn": method_shardfn, "torch": method_torch}


def rank_main(args):
    torch.set_num_threads(1)
    mesh = sf.init_mesh({"data": args.world // 2, "model": 2}, timeout=600)
    g = torch.Generator().manual_seed(1000 + mesh.coords["data"])  # one batch per data rank
    batch = (torch.randn(args.rows, args.width, generator=g), torch.randn(args.rows, 8, generator=g))
    made = {m: fn(args, mesh, batch) for m, fn in METHODS.items()}
    losses = {m: [made[m][0]() for _ in range(3)] for m in made}  # correctness first: same 3 steps
    times = {m: [] for m in made}
    for _ in range(args.reps):
        for m, (one, _) in made.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                one()
            torch.distributed.barrier()
            times[m].append((time.perf_counter() - t0) / args.steps)
    return {"times": times, "losses": losses, "state_bytes": {m: made[m][1]() for m in made}}


def run(args) -> dict:
    per_rank = run_multiprocess(rank_main, args.world, args, timeout=3600)
    medians = {m: statistics.median(max(r["times"][m][i] for r in per_rank) for i in range(args.reps))
               for m in METHODS}
    losses = per_rank[0]["losses"]
    n = sum(p.numel() for p in build(args).parameters())
    return {
        "mesh": {"data": args.world // 2, "model": 2},
        "width": args.width, "depth": args.depth, "rows_per_data_rank": args.rows, "parameters": n,
        "median_step_s": medians,
        "ratio_vs_torch": medians["shardfn"] / medians["torch"],
        "state_bytes_per_rank": {m: max(r["state_bytes"][m] for r in per_rank) for m in METHODS},
        "unsharded_state_bytes": 16 * n,  # fp32 params + grads + 2 AdamW moments on one rank
        "losses": losses,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["shardfn"], losses["torch"])),
    }


def plot(result: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.2))
    t = result["median_step_s"]
    ax.bar(["shardfn\nshard(param_specs)", "torch\nFSDP2 + DTensor TP"], [t["shardfn"], t["torch"]],
           color=["C0", "C1"])
    ax.set_ylabel("median step time (s)")
    ax.set_title(f"FSDP x TP on {result['mesh']} (gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="ranks: {'data': world / 2, 'model': 2}")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--rows", type=int, default=32, help="batch rows per data rank")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, 1 rep: seconds")
    parser.add_argument("--out", default=os.path.join(RESULTS, "fsdp_tp_vs_torch"))
    args = parser.parse_args(argv)
    if args.world < 2 or args.world % 2:
        parser.error(f"--world must be even (a 'model' axis of 2), got {args.world}")
    if args.tiny:
        args.width, args.depth, args.rows, args.reps, args.steps = 16, 2, 4, 1, 1
    env = _common.environment("benchmarks.fsdp_tp_vs_torch", argv)
    result = run(args)
    t, sb = result["median_step_s"], result["state_bytes_per_rank"]
    print(f"FSDP x TP on {result['mesh']}, {result['parameters']:,} parameters (width {args.width}, "
          f"{args.depth} blocks), {args.rows} rows per data rank")
    print(f"  median step: shardfn {t['shardfn']:.4f} s, torch FSDP2 + TP {t['torch']:.4f} s, "
          f"ratio {result['ratio_vs_torch']:.3f}")
    print(f"  state per rank (params + grads + AdamW): shardfn {sb['shardfn'] / 2**20:.2f} MB, torch "
          f"{sb['torch'] / 2**20:.2f} MB, unsharded {result['unsharded_state_bytes'] / 2**20:.2f} MB")
    print(f"  max |loss difference| over 3 steps: {result['max_loss_diff']:.2e}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"env": _common.finish_environment(env), "result": result}, f, indent=2)
    wrote = f"{args.out}.json and {args.out}.png" if plot(result, args.out + ".png") else f"{args.out}.json"
    print(f"wrote {wrote}")
    return result


if __name__ == "__main__":
    main()
