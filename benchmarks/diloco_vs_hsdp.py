"""DiLoCo and LocalSGD against synchronous HSDP: the examples' GPT on 2 replicas x 2 shards.

The GPT of examples/train_gpt.py (its default Config: 4 layers, d 64, T 64, B 8 per data
rank, AdamW with warmup + cosine, clipping) is trained on a simulated mesh
`{"replica": 2, "shard": 2}` from the same parameters on the same batches (data rank =
replica * 2 + shard), three ways:

  hsdp          sf.shard(data_axes=("replica", "shard"), shard_axes="shard"): every step's
                gradient all-reduced across replicas
  diloco H=4    sf.diloco(inner step over "shard" only, the same AdamW, sync_every=4,
                outer SGD lr 0.7, Nesterov momentum 0.9)
  local_sgd H=4 sf.local_sgd(..., sync_every=4): the replicas' parameters averaged

Prints each run's final loss (the mean of the last 10 steps; for the semi-synchronous runs
the mean of the two replicas' losses, each over its own half of the global batch) and the
bytes one rank sent across replicas per step (HSDP: its gradient all-reduces over
'replica', recorded; the others: `train.stats()`); writes results/diloco_vs_hsdp.json and
the loss curves to docs/img/diloco_vs_hsdp.png. Not a timing run.

    python -m benchmarks.diloco_vs_hsdp              # 200 steps
    python -m benchmarks.diloco_vs_hsdp --tiny --steps 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import optree
import torch

import shardfn as sf
from benchmarks import _common
from benchmarks.quantized_convergence import _example

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
IMG = os.path.join(ROOT, "docs", "img", "diloco_vs_hsdp.png")
LAST = 10
H = 4
SHAPE = {"replica": 2, "shard": 2}


def train(ex, cfg, kind: str, seed: int) -> dict:
    mesh = sf.local_mesh(SHAPE)
    model = ex.GPT(ex.gpt_config(cfg))
    apply_fn, params = sf.functional(model)
    params = ex.init_params(params, seed)
    data = ex.load_text(cfg.text_chars)
    loss_fn = ex.next_token_loss(apply_fn)

    def body():
        torch.set_num_threads(1)
        if kind == "hsdp":
            step = sf.shard(loss_fn, mesh, data_axes=("replica", "shard"), shard_axes="shard")
        else:
            step = sf.shard(loss_fn, mesh, data_axes="shard")
        shards = step.shard_params(params)
        warmup = min(cfg.warmup, cfg.steps // 5)
        schedule = sf.optim.warmup_cosine_decay_schedule(cfg.lr / 10, cfg.lr, warmup, cfg.steps, cfg.lr / 10)
        decay = lambda tree: optree.tree_map(lambda p: p.dim() >= 2, tree)  # noqa: E731
        opt = sf.optim.chain(
            sf.optim.clip_by_global_norm(cfg.grad_clip, mesh=mesh, axes="shard", specs=step.specs),
            sf.optim.adamw(schedule, b2=0.99, weight_decay=cfg.weight_decay, mask=decay),
        )
        if kind == "hsdp":
            state, train_step = opt.init(shards), sf.train_step(step, opt)
        else:
            make = sf.diloco if kind.startswith("diloco") else sf.local_sgd
            train_step = make(step, opt, sync_every=H)
            state = train_step.init(shards)
        losses, replica_bytes = [], 0
        for it in range(cfg.steps):
            batch = ex.get_batch(data, cfg, seed, it, mesh.rank)
            if kind == "hsdp" and it == 0:
                from shardfn._backend import ops

                with ops.recording() as rec:
                    shards, state, loss = train_step(shards, state, batch)
                replica_bytes = sum(c.nbytes for c in rec.records if c.axes == ("replica",))
            else:
                shards, state, loss = train_step(shards, state, batch)
            losses.append(loss.item())
        if kind != "hsdp":
            replica_bytes = train_step.stats()["replica_bytes"] / cfg.steps
        return {"losses": losses, "replica_bytes_per_step": replica_bytes}

    per_rank = mesh.run(body)
    replicas = [per_rank[0], per_rank[SHAPE["shard"]]]  # one rank of each replica
    losses = [(a + b) / 2 for a, b in zip(replicas[0]["losses"], replicas[1]["losses"])]
    return {"losses": losses, "replica_bytes_per_step": per_rank[0]["replica_bytes_per_step"]}


def plot(results: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r in results.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], lw=1,
                label=f"{name}: {r['final_loss']:.3f}, {r['replica_bytes_per_step']:,.0f} B/step across replicas")
    ax.set_xlabel("step (inner steps for DiLoCo / LocalSGD)")
    ax.set_ylabel("training loss (mean over the 4 data ranks)")
    ax.set_title("examples/train_gpt.py's GPT on {replica: 2, shard: 2}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="the example's TINY config (smoke tests)")
    parser.add_argument("--out", default=os.path.join(RESULTS, "diloco_vs_hsdp"))
    parser.add_argument("--img", default=IMG)
    args = parser.parse_args(argv)
    env = _common.environment("benchmarks.diloco_vs_hsdp", argv)
    ex = _example()
    cfg = dataclasses.replace(ex.Config(**(ex.TINY if args.tiny else {})), steps=args.steps)
    results = {name: train(ex, cfg, name, args.seed) for name in ("hsdp", f"diloco H={H}", f"local_sgd H={H}")}
    for r in results.values():
        tail = r["losses"][-LAST:]
        r["final_loss"] = sum(tail) / len(tail)
    print(f"{'run':<16} {'final loss':>10} {'B/step across replicas':>23}")
    for name, r in results.items():
        print(f"{name:<16} {r['final_loss']:>10.4f} {r['replica_bytes_per_step']:>23,.0f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"env": _common.finish_environment(env), "config": dataclasses.asdict(cfg), "mesh": SHAPE,
                   "sync_every": H, "last": LAST, "results": results}, f, indent=1)
    drew = plot(results, args.img)
    print(f"wrote {args.out}.json" + (f" and {args.img}" if drew else " (no PNG: matplotlib is not installed)"))
    return results


if __name__ == "__main__":
    main()
