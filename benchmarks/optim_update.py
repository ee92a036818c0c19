"""Time shardfn's adamw update + apply against torch.optim.AdamW (foreach and fused) on the same shards.

The tensors are one rank's FSDP shards (dim-0 ``torch.chunk`` blocks, as ``sf.shard``
holds them) of two models: a GPT-ish transformer (4 layers, d=256) and an MLP
(8 x 1024). Every mode steps the same parameters with the same gradients; repetitions
are interleaved (mode order rotates each round) and the median is reported.

Modes:
  torch-foreach   torch.optim.AdamW(foreach=True).step()             (the baseline)
  torch-fused     torch.optim.AdamW(fused=True).step()               (for reference)
  ours-pure       updates, state = opt.update(...); params = apply_updates(...)
  ours-inplace    adamw(..., inplace=True) + apply_updates(..., inplace=True)
  ours-fused      adamw(..., fused=True) + apply_updates(...)          (torch._fused_adamw_; compare to torch-fused)

Usage:
  python -m benchmarks.optim_update            # full run, writes benchmarks/results/optim_update.json
  python -m benchmarks.optim_update --tiny     # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import shardfn.optim as optim

from benchmarks import _common

LR, WD = 1e-3, 1e-2


# -- models (parameter shapes only) ---------------------------------------------------------


def gpt_shapes(n_layer=4, d=256, vocab=4096, block=256):
    shapes = {"wte": (vocab, d), "wpe": (block, d), "ln_f": {"w": (d,), "b": (d,)}, "h": []}
    for _ in range(n_layer):
        shapes["h"].append(
            {
                "ln_1": {"w": (d,), "b": (d,)},
                "attn": {"c_attn": {"w": (3 * d, d), "b": (3 * d,)}, "c_proj": {"w": (d, d), "b": (d,)}},
                "ln_2": {"w": (d,), "b": (d,)},
                "mlp": {"c_fc": {"w": (4 * d, d), "b": (4 * d,)}, "c_proj": {"w": (d, 4 * d), "b": (d,)}},
            }
        )
    return shapes


def mlp_shapes(n_layer=8, d=1024):
    return {"layers": [{"w": (d, d), "b": (d,)} for _ in range(n_layer)]}


def shard_leaves(shapes, ranks, rank, gen):
    """Rank ``rank``'s dim-0 chunks of randomly initialized tensors of the given shapes."""
    import optree

    flat = optree.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
    out = []
    for s in flat:
        t = torch.randn(s, generator=gen) * 0.02
        chunks = torch.chunk(t, ranks, dim=0)
        out.append((chunks[rank] if rank < len(chunks) else t[:0]).clone())
    return out


# -- one step per mode ---------------------------------------------------------------------


class TorchMode:
    def __init__(self, params, grads, **kw):
        self.params = [p.clone().requires_grad_() for p in params]
        for p, g in zip(self.params, grads):
            p.grad = g.clone()
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, **kw)

    def prepare(self):
        pass

    def step(self):
        self.opt.step()


class OursMode:
    def __init__(self, params, grads, inplace, fused=False):
        self.inplace = inplace or fused
        self.params = [p.clone() for p in params]
        self.src = grads
        self.grads = [g.clone() for g in grads]
        self.opt = optim.adamw(LR, weight_decay=WD, inplace=inplace, fused=fused)
        self.state = self.opt.init(self.params)

    def prepare(self):  # in-place mode consumes the gradients: refill them (untimed)
        if self.inplace:
            torch._foreach_copy_(self.grads, self.src)

    def step(self):
        updates, self.state = self.opt.update(self.grads, self.state, self.params)
        self.params = optim.apply_updates(self.params, updates, inplace=self.inplace)


def bench_model(name, shapes, ranks, reps, warmup, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = shard_leaves(shapes, ranks, 0, gen)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    modes = {
        "torch-foreach": TorchMode(params, grads, foreach=True),
        "torch-fused": TorchMode(params, grads, fused=True),
        "ours-pure": OursMode(params, grads, inplace=False),
        "ours-inplace": OursMode(params, grads, inplace=True),
        "ours-fused": OursMode(params, grads, inplace=True, fused=True),
    }
    for m in modes.values():
        for _ in range(warmup):
            m.prepare()
            m.step()
    times = {k: [] for k in modes}
    order = list(modes)
    for rep in range(reps):
        rot = order[rep % len(order):] + order[: rep % len(order)]
        for k in rot:
            modes[k].prepare()
            t0 = time.perf_counter()
            modes[k].step()
            times[k].append(time.perf_counter() - t0)
    # Sanity: every mode computed the same parameters (same grads each step), and the
    # fused modes the same bits (same kernel, same number of steps).
    ref = modes["torch-foreach"].params
    for k, m in modes.items():
        err = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(m.params, ref) if a.numel())
        assert err < 1e-5, f"{name} {k}: parameters diverge from torch-foreach by {err:.2e}"
    fused_bitwise = all(
        torch.equal(a.detach(), b.detach())
        for a, b in zip(modes["ours-fused"].params, modes["torch-fused"].params)
    )
    base = statistics.median(times["torch-foreach"])
    base_fused = statistics.median(times["torch-fused"])
    rows = []
    for k in modes:
        med = statistics.median(times[k])
        rows.append(
            {
                "model": name,
                "mode": k,
                "median_ms": med * 1e3,
                "min_ms": min(times[k]) * 1e3,
                "ratio_vs_torch_foreach": med / base,
                "ratio_vs_torch_fused": med / base_fused,
            }
        )
    numel = sum(p.numel() for p in params)
    return {"model": name, "shard_numel": numel, "num_leaves": len(params),
            "fused_bitwise_equal_torch_fused": fused_bitwise, "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small models, few repetitions")
    ap.add_argument("--ranks", type=int, default=2, help="shard the models over this many ranks; time rank 0")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1 = one rank's share)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "optim_update.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = _common.environment("benchmarks.optim_update", argv)

    if args.tiny:
        models = {"gpt-1L-d64": gpt_shapes(1, 64, 512, 64), "mlp-2x128": mlp_shapes(2, 128)}
        reps, warmup = args.reps or 15, 2
    else:
        models = {"gpt-4L-d256": gpt_shapes(), "mlp-8x1024": mlp_shapes()}
        reps, warmup = args.reps or 60, 5

    results = [bench_model(name, shapes, args.ranks, reps, warmup) for name, shapes in models.items()]

    print(f"adamw update+apply, rank 0 of {args.ranks}, {args.threads} thread(s), median of {reps} interleaved reps")
    print(f"{'model':<14}{'shard params':>14}{'leaves':>8}  {'mode':<15}{'median ms':>11}{'min ms':>9}"
          f"{'/foreach':>10}{'/fused':>8}")
    for res in results:
        for row in res["rows"]:
            print(
                f"{res['model']:<14}{res['shard_numel']:>14,}{res['num_leaves']:>8}  {row['mode']:<15}"
                f"{row['median_ms']:>11.3f}{row['min_ms']:>9.3f}{row['ratio_vs_torch_foreach']:>10.2f}"
                f"{row['ratio_vs_torch_fused']:>8.2f}"
            )
        print(f"{res['model']}: ours-fused params bitwise equal to torch-fused: {res['fused_bitwise_equal_torch_fused']}")
    print("/foreach, /fused = median / torch-foreach (resp. torch-fused) median "
          "(targets: ours-inplace <= 1.1 /foreach, ours-fused <= 1.05 /fused)")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "optim_update",
        "config": {
            "tiny": args.tiny,
            "ranks": args.ranks,
            "threads": args.threads,
            "reps": reps,
            "warmup": warmup,
            "lr": LR,
            "weight_decay": WD,
            "dtype": "float32",
        },
        "env": {
            **_common.finish_environment(env),
            "loadavg_1m_at_end": os.getloadavg()[0],  # other work on the box skews medians
        },
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
