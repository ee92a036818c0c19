"""Per-rank memory of `shard` + AdamW versus world size, against the ZeRO-3 formula.

A model of fixed total size is trained for one step on simulated meshes of 1, 2, 4 and 8
ranks. Bytes are counted, not read off RSS (RSS is dominated by torch itself at this
scale): the rank's shards, its gradient shards, its AdamW state, and the peak bytes of
gathered (unsharded) parameters from `step.stats()`. The formula for fp32 AdamW is
(4 + 4 + 8) * numel / N bytes of state, plus at most 2 units + the root gathered at once.

    python -m benchmarks.memory_scaling            # writes results/memory_scaling.{json,png}
    python -m benchmarks.memory_scaling --tiny
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import shardfn as sf
from shardfn.testing.models import MLP

from benchmarks import _common

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def measure(world: int, width: int, depth: int) -> dict:
    torch.manual_seed(0)
    apply_fn, params = sf.functional(MLP(width=width, depth=depth, d_in=width, d_out=8))
    numel = sum(t.numel() for t in torch.utils._pytree.tree_leaves(params))
    mesh = sf.local_mesh({"data": world})
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
    opt = sf.optim.adamw(1e-3)
    unit_bytes = 4 * (width * width + width)  # one hidden layer, fp32 (unpadded)

    def body():
        torch.set_num_threads(1)
        shards = step.shard_params(params)
        state = opt.init(shards)
        g = torch.Generator().manual_seed(mesh.rank)
        batch = (torch.randn(4, width, generator=g), torch.randn(4, 8, generator=g))
        grads = torch.func.grad(step)(shards, batch)
        return {
            "params": nbytes(shards), "grads": nbytes(grads), "optimizer": nbytes(state),
            "peak_gathered": step.stats()["peak_gathered_bytes"],
        }

    per_rank = mesh.run(body)
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    state = worst["params"] + worst["grads"] + worst["optimizer"]
    formula = 16 * numel / world
    return {
        "world": world, "numel": numel, **worst, "state_bytes": state, "formula_bytes": formula,
        "state_over_formula": state / formula, "unit_bytes": unit_bytes,
        "peak_gathered_units": worst["peak_gathered"] / unit_bytes,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=os.path.join(RESULTS, "memory_scaling"))
    args = parser.parse_args(argv)
    if args.tiny:
        args.width, args.depth, args.world_sizes = 32, 3, [1, 2, 4]
    env = _common.environment("benchmarks.memory_scaling", argv)
    rows = [measure(n, args.width, args.depth) for n in args.world_sizes]
    print(f"{'N':>2} {'state MB':>9} {'16*numel/N MB':>14} {'ratio':>6} {'peak gathered MB':>17} {'(units)':>8}")
    for r in rows:
        print(f"{r['world']:>2} {r['state_bytes'] / 2**20:>9.2f} {r['formula_bytes'] / 2**20:>14.2f} "
              f"{r['state_over_formula']:>6.3f} {r['peak_gathered'] / 2**20:>17.2f} {r['peak_gathered_units']:>8.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"env": _common.finish_environment(env), "results": rows}, f, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        ns = [r["world"] for r in rows]
        ax.plot(ns, [r["state_bytes"] / 2**20 for r in rows], "o-", label="params+grads+AdamW (measured)")
        ax.plot(ns, [r["formula_bytes"] / 2**20 for r in rows], "k--", label="16·Ψ/N (ZeRO-3)")
        ax.plot(ns, [r["peak_gathered"] / 2**20 for r in rows], "s-", label="peak gathered params")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks N")
        ax.set_ylabel("MB per rank")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
        print(f"wrote {args.out}.json and {args.out}.png")
    except ImportError:
        print(f"wrote {args.out}.json (no PNG: matplotlib is not installed)")
    return rows


if __name__ == "__main__":
    main()
