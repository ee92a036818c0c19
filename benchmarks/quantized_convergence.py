"""Does training converge with compressed communication? The examples' GPT, 300 steps.

The GPT of examples/train_gpt.py (its default Config: 4 layers, d 64, T 64, B 8 per rank,
AdamW with warmup + cosine, clipping) is trained on a simulated mesh of 2 ranks, from the
same parameters and the same batches, once per wire format:

  fp32        no compression (the reference)
  int8        MixedPrecision(all_gather_dtype="int8", reduce_scatter_dtype="int8")
  fp8_e4m3    ... torch.float8_e4m3fn for both
  bf16        ... torch.bfloat16 for both
  int8, block 256   ... int8 with 256 elements per scale instead of 4096
  and, with --reduce-only, each format on the gradients' reduce-scatter alone (qgZ).

Prints each run's final loss (the mean of the last 10 steps) and its relative difference to
fp32's, and the bytes one step moved (`stats()`: all-gather and reduce-scatter, encoded
bytes where compressed); writes results/quantized_convergence.json and the loss curves to
docs/img/quantized_convergence.png. Not a timing run: the figures do not depend on speed.

    python -m benchmarks.quantized_convergence                  # 300 steps, both directions
    python -m benchmarks.quantized_convergence --reduce-only    # qgZ alone
    python -m benchmarks.quantized_convergence --steps 5        # a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os

import optree
import torch

import shardfn as sf

from benchmarks import _common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
IMG = os.path.join(ROOT, "docs", "img", "quantized_convergence.png")
FORMATS = {"fp32": None, "int8": "int8", "fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16}
LAST = 10  # the final loss: the mean of the last LAST steps
SMALL_BLOCK = 256  # int8 is also run with this block size ([Note: qgZ] in shardfn/_fsdp/qgz.py, error feedback)


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(ROOT, "examples", "train_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runs(reduce_only: bool) -> dict[str, sf.MixedPrecision | None]:
    """name -> the MixedPrecision of that run (None: full precision)."""
    out = {}
    for name, fmt in FORMATS.items():
        if fmt is None:
            out[name] = None
        elif reduce_only:
            out[f"{name} reduce-scatter"] = sf.MixedPrecision(reduce_scatter_dtype=fmt)
        else:
            out[f"{name} all-gather + reduce-scatter"] = sf.MixedPrecision(all_gather_dtype=fmt,
                                                                           reduce_scatter_dtype=fmt)
        if fmt == "int8":  # int8's step is amax / 127 per block: smaller blocks keep small gradients
            last = list(out)[-1]
            out[f"{last}, block {SMALL_BLOCK}"] = out[last]._replace(block_size=SMALL_BLOCK)
    return out


def train(ex, cfg, mp, seed: int, world: int) -> dict:
    """One run on a simulated mesh of `world` ranks: losses and one step's bytes (rank 0)."""
    mesh = sf.local_mesh({"data": world})
    model = ex.GPT(ex.gpt_config(cfg))
    apply_fn, params = sf.functional(model)
    params = ex.init_params(params, seed)
    data = ex.load_text(cfg.text_chars)
    loss_fn = ex.next_token_loss(apply_fn)

    def body():
        torch.set_num_threads(1)
        step = sf.shard(loss_fn, mesh, mixed_precision=mp)
        shards = step.shard_params(params)
        warmup = min(cfg.warmup, cfg.steps // 5)
        schedule = sf.optim.warmup_cosine_decay_schedule(cfg.lr / 10, cfg.lr, warmup, cfg.steps, cfg.lr / 10)
        decay = lambda tree: optree.tree_map(lambda p: p.dim() >= 2, tree)  # noqa: E731
        opt = sf.optim.chain(
            sf.optim.clip_by_global_norm(cfg.grad_clip, mesh=mesh, specs=step.specs),
            sf.optim.adamw(schedule, b2=0.99, weight_decay=cfg.weight_decay, mask=decay),
        )
        opt_state = opt.init(shards)
        train_step = sf.train_step(step, opt, inplace=True)
        losses = []
        for it in range(cfg.steps):
            batch = ex.get_batch(data, cfg, seed, it, mesh.rank)
            shards, opt_state, loss = train_step(shards, opt_state, batch)
            losses.append(loss.item())
        stats = step.stats()
        return {"losses": losses, "all_gather_bytes": stats["all_gather_bytes"],
                "reduce_scatter_bytes": stats["reduce_scatter_bytes"]}

    return mesh.run(body)[0]


def summarize(results: dict) -> dict:
    ref = results["fp32"]
    final_ref = sum(ref["losses"][-LAST:]) / len(ref["losses"][-LAST:])
    for r in results.values():
        tail = r["losses"][-LAST:]
        r["final_loss"] = sum(tail) / len(tail)
        r["rel_diff_to_fp32"] = (r["final_loss"] - final_ref) / final_ref
        r["all_gather_ratio"] = r["all_gather_bytes"] / ref["all_gather_bytes"]
        r["reduce_scatter_ratio"] = r["reduce_scatter_bytes"] / ref["reduce_scatter_bytes"]
    return results


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
                label=f"{name}: {r['final_loss']:.3f} ({100 * r['rel_diff_to_fp32']:+.2f}%)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (2 ranks)")
    ax.set_title("examples/train_gpt.py's GPT with compressed communication")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reduce-only", action="store_true", help="compress the gradients' reduce-scatter only")
    parser.add_argument("--tiny", action="store_true", help="the example's TINY config (smoke tests)")
    parser.add_argument("--out", default=os.path.join(RESULTS, "quantized_convergence"))
    parser.add_argument("--img", default=IMG)
    args = parser.parse_args(argv)
    env = _common.environment("benchmarks.quantized_convergence", argv)
    ex = _example()
    cfg = ex.Config(**(ex.TINY if args.tiny else {}))
    cfg = dataclasses.replace(cfg, steps=args.steps)
    results = {name: train(ex, cfg, mp, args.seed, args.world) for name, mp in runs(args.reduce_only).items()}
    results = summarize(results)
    print(f"{'run':<48} {'final loss':>10} {'vs fp32':>8} {'all-gather B':>13} {'reduce-scatter B':>17}")
    for name, r in results.items():
        print(f"{name:<48} {r['final_loss']:>10.4f} {100 * r['rel_diff_to_fp32']:>+7.2f}% "
              f"{r['all_gather_bytes']:>13,} {r['reduce_scatter_bytes']:>17,}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"env": _common.finish_environment(env), "config": dataclasses.asdict(cfg), "world": args.world,
                   "last": LAST, "results": results}, f, indent=1)
    drew = plot(results, args.img)
    print(f"wrote {args.out}.json" + (f" and {args.img}" if drew else " (no PNG: matplotlib is not installed)"))
    return results


if __name__ == "__main__":
    main()
