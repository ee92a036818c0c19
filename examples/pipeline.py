"""Train the examples' character-level GPT with pipeline parallelism x FSDP (sf.pipeline).

The GPT of examples/train_gpt.py (nanoGPT's, 8 layers), written as three pure functions:
`embed` (token + position embeddings: the first stage's `pre`), `block` (one transformer
layer: every stage runs a stack of them) and `head_loss` (final LayerNorm, an untied head
and the cross entropy: the last stage's `post`). The layers are stacked and split over the
mesh's 'stage' axis; `sf.shard` shards every rank's part over 'data' (FSDP), so a step is:
microbatches flow through the stages by the chosen schedule, and gradients are
reduce-scattered over 'data'.

    python examples/pipeline.py                                   # 2 stages x 2 data ranks, 1F1B
    python examples/pipeline.py --stages 4 --schedule zb-h1       # 4 stages x 2 data ranks, zero bubble
    python examples/pipeline.py --schedule interleaved --virtual-stages 2
    python examples/pipeline.py --tiny --steps 10                 # a smoke test in seconds
    torchrun --standalone --nproc-per-node 4 examples/pipeline.py # the same on processes

It prints the schedule as a chart (one row per stage, `.` = idle), the first step's loss
next to the same model's on one device, a progress bar, and draws the loss curve.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
from torch.nn import functional as F

import shardfn as sf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import VOCAB, Progress, get_batch, load_text, plot_losses, tree_bytes  # noqa: E402  (data, bar, plot)

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


@dataclasses.dataclass
class Config:
    n_layer: int = 8
    n_head: int = 4
    n_embd: int = 64  # C
    block_size: int = 64  # T
    batch_size: int = 8  # B: sequences per data rank per step
    microbatches: int = 4  # M: the bubble is ~ (stages - 1) / (M + stages - 1) for 1F1B
    steps: int = 100
    lr: float = 3e-3
    text_chars: int = 200_000


TINY = dict(n_layer=8, n_head=2, n_embd=32, block_size=16, batch_size=4, microbatches=4, steps=10, text_chars=50_000)


# -- the model as pure functions -----------------------------------------------------------


def init(cfg: Config, seed: int) -> dict:
    """GPT-2's init from one generator: N(0, 0.02) matrices, zero biases, unit LayerNorms."""
    g = torch.Generator().manual_seed(seed)
    C, V = cfg.n_embd, len(VOCAB)
    normal = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731

    def layer():
        return {"ln_1": {"weight": torch.ones(C), "bias": torch.zeros(C)},
                "c_attn": {"weight": normal(3 * C, C), "bias": torch.zeros(3 * C)},
                "c_proj": {"weight": normal(C, C), "bias": torch.zeros(C)},
                "ln_2": {"weight": torch.ones(C), "bias": torch.zeros(C)},
                "fc": {"weight": normal(4 * C, C), "bias": torch.zeros(4 * C)},
                "proj": {"weight": normal(C, 4 * C), "bias": torch.zeros(C)}}

    return {"pre": {"wte": normal(V, C), "wpe": normal(cfg.block_size, C)},
            "layers": [layer() for _ in range(cfg.n_layer)],
            "post": {"ln_f": {"weight": torch.ones(C), "bias": torch.zeros(C)}, "head": normal(V, C)}}


def embed(w, batch):  # batch: (idx (b, T), targets (b, T)) -> (b, T, C)
    idx = batch[0]
    return w["wte"][idx] + w["wpe"][: idx.shape[1]]


def make_block(n_head: int):
    def block(w, x):  # (b, T, C) -> (b, T, C)
        b, T, C = x.shape
        h = F.layer_norm(x, (C,), w["ln_1"]["weight"], w["ln_1"]["bias"])
        q, k, v = F.linear(h, w["c_attn"]["weight"], w["c_attn"]["bias"]).split(C, dim=2)
        q, k, v = (t.view(b, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))  # (b, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, T, C)
        x = x + F.linear(y, w["c_proj"]["weight"], w["c_proj"]["bias"])
        h = F.layer_norm(x, (C,), w["ln_2"]["weight"], w["ln_2"]["bias"])
        return x + F.linear(F.gelu(F.linear(h, w["fc"]["weight"], w["fc"]["bias"])), w["proj"]["weight"], w["proj"]["bias"])

    return block


def head_loss(w, x, batch):  # (b, T, C) -> the microbatch's mean next-character cross entropy
    h = F.layer_norm(x, (x.shape[-1],), w["ln_f"]["weight"], w["ln_f"]["bias"])
    logits = h @ w["head"].T  # (b, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def one_device_loss(params, batch, n_head: int):
    x = embed(params["pre"], batch)
    for layer in params["layers"]:
        x = make_block(n_head)(layer, x)
    return head_loss(params["post"], x, batch)


# -- training ------------------------------------------------------------------------------


def train(mesh, cfg: Config, args, params, data):
    """Run on every rank; returns the losses and the step-0 loss of one device on rank 0's batch."""
    torch.set_num_threads(1)
    pipe = sf.pipeline(make_block(cfg.n_head), pre=embed, post=head_loss, microbatches=cfg.microbatches,
                       schedule=args.schedule, virtual_stages=args.virtual_stages)
    step = sf.shard(pipe, mesh, data_axes="data")  # FSDP over 'data' of each stage's part
    stacked = dict(params, layers=sf.pipeline.stack_layers(params["layers"], args.virtual_stages))
    layer_spec = sf.P("stage") if args.virtual_stages == 1 else sf.P(None, "stage")
    local = dict(stacked, layers=torch.utils._pytree.tree_map(lambda x: sf.scatter(x, mesh, layer_spec),
                                                             stacked["layers"]))  # this stage's layers
    shards = step.shard_params(local)
    opt = sf.optim.adamw(cfg.lr, weight_decay=0.1)
    state = opt.init(shards)
    train_step = sf.train_step(step, opt, inplace=True)
    rank0 = mesh.rank == 0
    if rank0:
        print(pipe.schedule(mesh.shape["stage"]).draw())
    data_rank = mesh.coords["data"]
    reference = None
    if rank0:  # the whole first batch (every data rank's part) on one device
        parts = [get_batch(data, cfg, args.seed, 0, d) for d in range(mesh.shape["data"])]
        whole = tuple(torch.cat(t) for t in zip(*parts))
        reference = float(one_device_loss(params, whole, cfg.n_head))
    progress = Progress(cfg.steps, 0, enabled=rank0 and not args.quiet, every=max(1, cfg.steps // 10))
    tokens = cfg.batch_size * cfg.block_size * mesh.shape["data"]
    losses = []
    for it in range(cfg.steps):
        batch = get_batch(data, cfg, args.seed, it, data_rank)
        t0 = time.perf_counter()
        shards, state, loss = train_step(shards, state, batch)
        losses.append(loss.item())
        held = 2 * tree_bytes(shards) + tree_bytes(state) + step.stats()["peak_gathered_bytes"]
        progress.update(it, cfg.steps, losses[-1], tokens / (time.perf_counter() - t0), held)
    progress.close()
    return losses, reference, pipe.measured_bubble()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2, choices=[1, 2, 4])
    parser.add_argument("--data", type=int, default=2, help="FSDP ranks per stage (simulated)")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1"])
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=OUT_DIR)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    if args.schedule == "interleaved" and args.virtual_stages == 1:
        args.virtual_stages = 2
    cfg = Config(**(TINY if args.tiny else {}))
    if args.steps is not None:
        cfg.steps = args.steps
    if args.microbatches is not None:
        cfg.microbatches = args.microbatches
    if "WORLD_SIZE" in os.environ:  # torchrun: stages x the rest
        world = int(os.environ["WORLD_SIZE"])
        mesh = sf.init_mesh({"stage": args.stages, "data": world // args.stages})
    else:
        mesh = sf.local_mesh({"stage": args.stages, "data": args.data})
    data = load_text(cfg.text_chars)
    params = init(cfg, args.seed)
    t0 = time.perf_counter()
    results = mesh.run(train, mesh, cfg, args, params, data)
    losses, reference, bubble = results[0]
    if mesh.kind == "distributed" and mesh.rank != 0:
        return
    print(f"step-0 loss {losses[0]:.6f}, one device {reference:.6f}: |diff| {abs(losses[0] - reference):.2e}")
    print(f"loss: step 0 {losses[0]:.4f} -> step {len(losses) - 1} {losses[-1]:.4f}  "
          f"({time.perf_counter() - t0:.1f} s, rank 0's measured bubble {bubble:.2f})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pipeline_losses.json"), "w") as f:
        json.dump({"losses": losses, "mesh": mesh.shape, "schedule": args.schedule}, f)
    plot_losses(losses, os.path.join(args.out, "pipeline_loss.png"),
                f"char GPT, {args.schedule} on {mesh.shape}")
    print("OK")


if __name__ == "__main__":
    main()
