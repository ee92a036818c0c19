"""Train the examples' character-level GPT with Muon + AdamW, fully sharded, against AdamW alone.

The usual recipe (Keller Jordan's Muon; torch.optim.Muon's docs): Muon on the 2-D hidden
matrices of the transformer blocks, AdamW on the embeddings (the tied token embedding is
also the head), with decay, and on the LayerNorms and biases, without. With
`sf.optim.multi_transform` that is one label function (`label` below). Under `sf.shard`
each rank holds dim-0 chunks of every matrix; Muon's momentum stays in those chunks, and
each matrix is orthogonalized whole on one owner rank (docs/optimizers-sharded.md).

    python examples/muon_gpt.py                          # both optimizers, 4 ranks as threads
    python examples/muon_gpt.py --tiny --steps 20        # a smoke test in a few seconds
    python examples/muon_gpt.py --optimizer muon         # one of them
    torchrun --standalone --nproc-per-node 4 examples/muon_gpt.py --optimizer muon

It writes `muon_gpt_losses.json` and `muon_gpt_loss.png` (the two loss curves, same
steps, batches and seed) under --out. The same data, model and init as train_gpt.py.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_gpt's data and model helpers

import shardfn as sf  # noqa: E402
import shardfn.optim as optim  # noqa: E402
from shardfn.testing.models import GPT  # noqa: E402
from train_gpt import OUT_DIR, TINY, Config, get_batch, gpt_config, init_params, load_text  # noqa: E402


@dataclasses.dataclass
class MuonConfig:
    muon_lr: float = 0.02  # Muon's own scale (torch's default shape factor sqrt(max(1, A/B)))
    muon_weight_decay: float = 0.01
    momentum: float = 0.95


# -- the recipe: which leaf gets which optimizer ----------------------------------------


def label(path, p) -> str:
    """'muon' for the blocks' 2-D matrices; 'decay' for the embeddings; 'no_decay' for
    LayerNorms and biases."""
    if p.ndim == 2 and "h" in path:  # transformer.h[i].{attn, mlp}.*.weight
        return "muon"
    return "decay" if p.ndim == 2 else "no_decay"


def schedule(peak: float, cfg: Config):
    return optim.warmup_cosine_decay_schedule(0.0, peak, cfg.warmup, cfg.steps, peak / 10)


def make_optimizer(name: str, cfg: Config, mcfg: MuonConfig, mesh, specs):
    adamw = {"decay": optim.adamw(schedule(cfg.lr, cfg), weight_decay=cfg.weight_decay),
             "no_decay": optim.adamw(schedule(cfg.lr, cfg), weight_decay=0.0)}
    if name == "adamw":
        groups = dict(adamw, muon=optim.adamw(schedule(cfg.lr, cfg), weight_decay=cfg.weight_decay))
    else:
        muon = optim.muon(schedule(mcfg.muon_lr, cfg), weight_decay=mcfg.muon_weight_decay, momentum=mcfg.momentum,
                          mesh=mesh, specs=specs)
        groups = dict(adamw, muon=muon)
    return optim.chain(optim.clip_by_global_norm(cfg.grad_clip, mesh, specs=specs), optim.multi_transform(groups, label))


# -- training ----------------------------------------------------------------------------


def train(mesh, name: str, cfg: Config, mcfg: MuonConfig, seed: int, data, quiet: bool):
    """Run on every rank: `cfg.steps` steps of `name`; the losses and seconds per step."""
    apply_fn, params = sf.functional(GPT(gpt_config(cfg)))
    params = init_params(params, seed)

    def loss_fn(params, batch):
        idx, targets = batch  # (B, T), (B, T)
        logits = apply_fn(params, idx)  # (B, T, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    step = sf.shard(loss_fn, mesh)
    shards = step.shard_params(params)
    opt = make_optimizer(name, cfg, mcfg, mesh, step.specs)
    state = opt.init(shards)
    train_step = optim.train_step(step, opt)
    rank = mesh.coords["data"]
    losses, times = [], []
    for it in range(cfg.steps):
        batch = get_batch(data, cfg, seed, it, rank)
        t0 = time.perf_counter()
        shards, state, loss = train_step(shards, state, batch)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if not quiet and mesh.rank == 0 and (it % 10 == 0 or it == cfg.steps - 1):
            print(f"{name:6s} step {it:4d}/{cfg.steps}  loss {losses[-1]:.4f}  {times[-1] * 1e3:7.1f} ms/step")
    return losses, times


def plot(results: dict, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, (losses, _) in results.items():
        ax.plot(range(1, len(losses) + 1), losses, label="Muon + AdamW" if name == "muon" else "AdamW")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross entropy)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--optimizer", choices=["both", "muon", "adamw"], default="both")
    ap.add_argument("--ranks", type=int, default=4, help="simulated data ranks (ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 32-wide GPT: a smoke test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    cfg = Config(**TINY) if args.tiny else Config()
    if args.steps is not None:
        cfg.steps = args.steps
    mcfg = MuonConfig()
    torch.set_num_threads(1)
    data = load_text(cfg.text_chars)
    if "RANK" in os.environ:
        mesh = sf.init_mesh({"data": int(os.environ["WORLD_SIZE"])})
    else:
        mesh = sf.local_mesh({"data": args.ranks})
    names = ["adamw", "muon"] if args.optimizer == "both" else [args.optimizer]
    results = {}
    for name in names:
        per_rank = mesh.run(train, mesh, name, cfg, mcfg, args.seed, data, args.quiet)
        results[name] = per_rank[0]
    if mesh.kind != "simulated" and mesh.rank != 0:
        return results
    os.makedirs(args.out, exist_ok=True)
    print(f"\nGPT {cfg.n_layer}L d{cfg.n_embd}, {cfg.steps} steps, {mesh.size} data ranks, batch "
          f"{cfg.batch_size}x{cfg.block_size} per rank")
    print(f"{'optimizer':<14} {'first loss':>10} {'last loss':>10} {'mean of last 10':>16} {'median ms/step':>15}")
    for name, (losses, times) in results.items():
        med = sorted(times)[len(times) // 2] * 1e3
        tail = sum(losses[-10:]) / len(losses[-10:])
        print(f"{'Muon + AdamW' if name == 'muon' else 'AdamW':<14} {losses[0]:>10.4f} {losses[-1]:>10.4f} "
              f"{tail:>16.4f} {med:>15.1f}")
    with open(os.path.join(args.out, "muon_gpt_losses.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "muon": dataclasses.asdict(mcfg), "ranks": mesh.size,
                   "losses": {k: v[0] for k, v in results.items()}}, f, indent=1)
    plot(results, os.path.join(args.out, "muon_gpt_loss.png"),
         f"examples' GPT {cfg.n_layer}L d{cfg.n_embd}, {mesh.size} ranks (sf.shard), same batches and steps")
    return results


if __name__ == "__main__":
    main()
