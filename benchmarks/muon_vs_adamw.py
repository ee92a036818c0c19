"""Time per step of Muon + AdamW against AdamW alone on the examples' GPT under sf.shard.

Both optimizers train the same model from the same shards on the same batches; each is
`sf.train_step(step, opt)` (gradient, update, apply). The recipe is examples/muon_gpt.py's:
Muon on the blocks' 2-D matrices (each orthogonalized whole on its owner rank: one
gather and one scatter per step, docs/optimizers-sharded.md), AdamW with decay on the
embeddings, without on LayerNorms and biases; the baseline is AdamW with the same groups.
Steps alternate between the two (mode order rotates each round) and the median is
reported, with the owner rule's bytes per step (from `update.stats()`, checked against
`update.plan`) and the Newton–Schulz work each rank did.

Run it on an idle machine: it never asserts a time.

  python -m benchmarks.muon_vs_adamw                 # 4 processes (gloo), GPT 4L d256
  python -m benchmarks.muon_vs_adamw --tiny          # seconds-long smoke run
  python -m benchmarks.muon_vs_adamw --simulated     # 4 ranks as threads of this process
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F

import shardfn as sf
import shardfn.optim as optim
from benchmarks import _common
from shardfn.testing.models import GPT, GPTConfig

LR, MUON_LR, WD = 3e-3, 0.02, 0.1


def label(path, p) -> str:
    if p.ndim == 2 and "h" in path:
        return "muon"
    return "decay" if p.ndim == 2 else "no_decay"


def make(name: str, mesh, specs):
    groups = {"decay": optim.adamw(LR, weight_decay=WD), "no_decay": optim.adamw(LR, weight_decay=0.0)}
    if name == "muon":
        groups["muon"] = optim.muon(MUON_LR, weight_decay=0.01, mesh=mesh, specs=specs)
    else:
        groups["muon"] = optim.adamw(LR, weight_decay=WD)
    return optim.multi_transform(groups, label), groups["muon"]


def body(mesh, cfg: GPTConfig, batch: int, reps: int, warmup: int):
    """Every rank: interleaved timed steps of both optimizers; rank 0's numbers are reported."""
    torch.set_num_threads(1)
    model = GPT(cfg)
    apply_fn, params = sf.functional(model)
    gen = torch.Generator().manual_seed(0)
    params = torch.utils._pytree.tree_map(lambda p: torch.randn(p.shape, generator=gen) * 0.02, params)

    def loss_fn(params, b):
        idx, targets = b  # (B, T), (B, T)
        logits = apply_fn(params, idx)  # (B, T, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    step = sf.shard(loss_fn, mesh)
    runs = {}
    for name in ("adamw", "muon"):
        shards = step.shard_params(params)
        opt, muon = make(name, mesh, step.specs)
        runs[name] = dict(shards=shards, state=opt.init(shards), train=optim.train_step(step, opt), muon=muon, times=[])
    rank = mesh.coords["data"]
    names = list(runs)
    for it in range(warmup + reps):
        g = torch.Generator().manual_seed(it * 1000 + rank)
        idx = torch.randint(cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        b = (idx[:, :-1], idx[:, 1:])
        order = names[it % 2:] + names[:it % 2]
        for name in order:
            r = runs[name]
            t0 = time.perf_counter()
            r["shards"], r["state"], loss = r["train"](r["shards"], r["state"], b)
            dt = time.perf_counter() - t0
            if it >= warmup:
                r["times"].append(dt)
    stats = runs["muon"]["muon"].update.stats()
    meta = torch.utils._pytree.tree_map(lambda p: torch.empty(p.shape, device="meta"), params)
    hidden = {"h": meta["transformer"]["h"]}  # the matrices the recipe gives Muon
    return dict(times={k: v["times"] for k, v in runs.items()}, stats=stats, rank=mesh.rank,
                hidden_numel=sum(p.numel() for p in torch.utils._pytree.tree_leaves(hidden) if p.dim() == 2))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--simulated", action="store_true", help="ranks as threads (sf.local_mesh), not processes")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "muon_vs_adamw"))
    args = ap.parse_args(argv)
    env = _common.environment("benchmarks.muon_vs_adamw", argv)
    if args.tiny:
        cfg, batch, reps, warmup = GPTConfig(vocab_size=96, block_size=16, n_layer=1, n_head=2, n_embd=32), 2, 3, 1
    else:
        cfg, batch, reps, warmup = GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=256), 8, 20, 3
    reps = args.reps or reps
    shape = {"data": args.ranks}
    if args.simulated:
        mesh = sf.local_mesh(shape)
        results = mesh.run(body, mesh, cfg, batch, reps, warmup)
    else:
        from shardfn.testing import run_multiprocess

        results = run_multiprocess(lambda: body(sf.init_mesh(shape, timeout=120), cfg, batch, reps, warmup),
                                   args.ranks, timeout=1200)
    r0 = results[0]
    med = {k: statistics.median(v) * 1e3 for k, v in r0["times"].items()}
    print(f"GPT {cfg.n_layer}L d{cfg.n_embd} (T={cfg.block_size}, batch {batch}/rank), {args.ranks} "
          f"{'threads' if args.simulated else 'processes'}, median of {reps} interleaved steps, rank 0")
    print(f"{'optimizer':<14}{'median ms/step':>16}{'min ms':>10}")
    for name in ("adamw", "muon"):
        print(f"{'Muon + AdamW' if name == 'muon' else 'AdamW':<14}{med[name]:>16.1f}{min(r0['times'][name]) * 1e3:>10.1f}")
    print(f"Muon + AdamW / AdamW: {med['muon'] / med['adamw']:.2f}x")
    per_rank = [(r["rank"], r["stats"]["gather_bytes"], r["stats"]["scatter_bytes"], r["stats"]["owned_matrices"])
                for r in results]
    print("owner rule per step (bfloat16): rank, gather bytes, scatter bytes, matrices owned:", per_rank)
    total = sum(g + s for _, g, s, _ in per_rank)
    print(f"  total over ranks {total:,} bytes; 2 x 2 bytes x {r0['hidden_numel']:,} hidden-matrix elements "
          f"= {4 * r0['hidden_numel']:,} minus the owners' own blocks")
    report = {"benchmark": "muon_vs_adamw", "config": dict(tiny=args.tiny, ranks=args.ranks, simulated=args.simulated,
                                                           reps=reps, warmup=warmup, batch=batch, n_layer=cfg.n_layer,
                                                           n_embd=cfg.n_embd, block_size=cfg.block_size),
              "median_ms": med, "times_ms": {k: [t * 1e3 for t in v] for k, v in r0["times"].items()},
              "owner_bytes": per_rank, "env": _common.finish_environment(env)}
    _common.write_json(report, args.out)
    return report


if __name__ == "__main__":
    main()
