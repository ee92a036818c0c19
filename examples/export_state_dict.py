"""Checkpoints: train a small GPT sharded over 2 ranks, save, resume on 3, export for inference.

Runs in a few seconds on a laptop CPU:

    python examples/export_state_dict.py [output_dir]

1. 2 simulated ranks train with `sf.shard` + `sf.optim.adamw` and save a sharded DCP
   checkpoint every few steps (`sf.checkpoint.save`, atomic, one file per rank);
2. 3 ranks resume from `sf.checkpoint.latest(dir)`: the blocks are resharded (uneven
   `torch.chunk` blocks on 3 ranks) and training continues;
3. the full parameters are exported as one plain state dict (`sf.checkpoint.export_full`)
   that a stock `GPT` module loads with `load_state_dict(strict=True)`.

The same per-rank functions run one process per rank under `torchrun` with `sf.init_mesh`.
"""

import os
import sys
import tempfile

import torch

import shardfn as sf
import shardfn.checkpoint  # noqa: F401 - sf.checkpoint
import shardfn.optim as optim
from shardfn.testing.models import GPT, GPTConfig

# -- config ---------------------------------------------------------------------------
CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)
BATCH, LR, SEED = 12, 1e-2, 0  # 12 sequences per step: 6 per rank on 2, 4 per rank on 3
STEPS_FIRST, STEPS_RESUMED, SAVE_EVERY = 6, 4, 3

torch.set_num_threads(1)  # the ranks are threads already


def batch_at(step: int):
    """The global batch of a step: (BATCH, T) token ids and next-token targets (3 batches, cycled)."""
    g = torch.Generator().manual_seed(1000 + step % 3)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # (B, T), (B, T)


def build(mesh):
    """The model as a function, its shard step, optimizer, and the checkpoint specs."""
    torch.manual_seed(SEED)
    model = GPT(CFG)
    apply_fn, params = sf.functional(model)
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
    shards = step.shard_params(params)
    opt = optim.adamw(LR)
    state = opt.init(shards)
    specs = {"params": step.specs, "opt": sf.checkpoint.specs_like(state, step.specs), "step": sf.P()}
    return model, step, opt, shards, state, specs


def train(mesh, run_dir: str, steps: int):
    """Per-rank program: resume from the latest checkpoint if any, train, save every few steps."""
    model, step, opt, shards, state, specs = build(mesh)
    start = 0
    latest = sf.checkpoint.latest(run_dir)
    if latest is not None:
        tree = sf.checkpoint.load(latest, {"params": shards, "opt": state, "step": 0}, mesh, specs)
        shards, state, start = tree["params"], tree["opt"], tree["step"]
    losses = []
    for i in range(start, start + steps):
        idx, tgt = (torch.chunk(x, mesh.size)[mesh.rank] for x in batch_at(i))  # this rank's rows
        grads, loss = torch.func.grad_and_value(step)(shards, (idx, tgt))
        updates, state = opt.update(grads, state, shards)
        shards = optim.apply_updates(shards, updates)
        losses.append(float(loss))
        if (i + 1) % SAVE_EVERY == 0:
            tree = {"params": shards, "opt": state, "step": i + 1}
            sf.checkpoint.save(os.path.join(run_dir, f"step_{i + 1:06d}"), tree, mesh, specs)
    export = os.path.join(run_dir, "gpt.pt")
    sf.checkpoint.export_full(export, step, shards, mesh, aliases=sf.checkpoint.tied_keys(model))
    return start, losses, export


def main(out_dir: str) -> None:
    run_dir = os.path.join(out_dir, "run")
    for world, steps in ((2, STEPS_FIRST), (3, STEPS_RESUMED)):
        mesh = sf.local_mesh({"data": world})
        start, losses, export = mesh.run(train, mesh, run_dir, steps)[0]
        print(f"{world} ranks: steps {start}..{start + steps - 1}, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print("checkpoints:", sorted(n for n in os.listdir(run_dir) if n.startswith("step_")))
    print("latest:", os.path.basename(sf.checkpoint.latest(run_dir)))

    model = GPT(CFG)  # a stock module, for inference
    model.load_state_dict(torch.load(export, weights_only=True), strict=True)
    idx, tgt = batch_at(0)
    with torch.no_grad():
        print(f"exported model loads strictly; loss on batch 0: {float(model(idx, tgt)):.4f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="shardfn-ckpt-"))
