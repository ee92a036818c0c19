"""Train a character-level GPT fully sharded (FSDP / ZeRO-3) with shardfn.

The text is the Python standard library's own source (every machine has it), read in a
fixed file order; the vocabulary is newline plus printable ASCII. The model is nanoGPT's,
`shardfn.testing.models.GPT` (the one the tests shard too); `sf.functional` turns it into a
function of a parameter tree, `sf.shard` shards that tree over the mesh (`parallelize`
below says how), and `sf.optim.adamw` updates this rank's shards in place.

    python examples/train_gpt.py                      # 4 ranks as threads of this process
    python examples/train_gpt.py --mesh hsdp --bf16   # {'replica': 2, 'shard': 2}, bf16 compute
    python examples/train_gpt.py --mesh fsdp_tp       # {'data': 2, 'model': 2}: FSDP x Megatron TP
    python examples/train_gpt.py --tiny --steps 20    # a smoke test in a few seconds
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py   # same program, 4 processes

Both launches print the same loss at every step for the same --seed: the parameters come
from one seeded generator, and every rank's batch from a generator seeded by
(seed, step, rank), so neither depends on threads, processes or the global RNG.
"""

import argparse
import dataclasses
import glob
import json
import os
import time
from typing import Callable, NamedTuple

import optree
import torch
from torch.nn import functional as F

import shardfn as sf
from shardfn.testing.models import GPT, GPTConfig

# -- config ---------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64  # C
    block_size: int = 64  # T: characters of context
    batch_size: int = 8  # B: sequences per data rank per step (global batch = B * data ranks)
    steps: int = 200
    lr: float = 3e-3  # peak; linear warmup, then cosine decay to lr / 10
    warmup: int = 20
    weight_decay: float = 0.1  # matrices only, as in nanoGPT
    grad_clip: float = 1.0
    text_chars: int = 400_000  # how much of the standard library to read
    ckpt_every: int = 50


TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, steps=30, warmup=5, text_chars=100_000)
VOCAB = ["\n"] + [chr(i) for i in range(32, 127)]  # 96 characters; any other one becomes "?"
STOI = {c: i for i, c in enumerate(VOCAB)}
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


# -- data: the standard library's source ----------------------------------------------


def load_text(n_chars: int) -> torch.Tensor:
    """The first `n_chars` characters of the stdlib's top-level *.py files, sorted by name."""
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
        total += len(parts[-1])
        if total >= n_chars:
            break
    text = "".join(parts)[:n_chars]
    return torch.tensor([STOI.get(c, STOI["?"]) for c in text], dtype=torch.long)  # (N,)


def get_batch(data: torch.Tensor, cfg: Config, seed: int, step: int, rank: int):
    """This rank's batch at `step`: a function of (seed, step, rank) only."""
    g = torch.Generator().manual_seed(seed * 1_000_000_007 + step * 1_000 + rank)
    ix = torch.randint(len(data) - cfg.block_size - 1, (cfg.batch_size,), generator=g)  # (B,)
    offsets = ix[:, None] + torch.arange(cfg.block_size + 1)  # (B, T + 1)
    chunk = data[offsets]
    return chunk[:, :-1], chunk[:, 1:]  # inputs, targets: (B, T) each


# -- the model: nanoGPT's GPT (shardfn/testing/models.py), from one explicit generator --


def gpt_config(cfg: Config) -> GPTConfig:
    return GPTConfig(vocab_size=len(VOCAB), block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd, sdpa=True)


def init_params(params, seed: int):
    """GPT-2's init from one explicit generator: N(0, 0.02) matrices, zero biases, unit LN."""
    g = torch.Generator().manual_seed(seed)
    paths, leaves, treedef = optree.tree_flatten_with_path(params)
    out = []
    for path, p in zip(paths, leaves):
        if p.dim() >= 2:
            out.append(torch.randn(p.shape, generator=g) * 0.02)
        else:
            out.append(torch.ones_like(p) if path[-1] == "weight" else torch.zeros_like(p))  # LayerNorm / bias
    return optree.tree_unflatten(treedef, out)


# -- parallelization: how the GPT is split over the mesh ---------------------------------


class Plan(NamedTuple):
    forward: Callable  # (params, idx (B, T)) -> logits (B, T, vocab), on this rank's blocks
    shard_options: dict  # for sf.shard: data_axes, shard_axes (and param_specs)
    to_layout: Callable  # the module's tree -> the tree sf.shard splits
    from_layout: Callable  # and back (for sampling from the gathered parameters)


def parallelize(kind: str, mesh, apply_fn, cfg: Config, remat: bool = False) -> Plan:
    """fsdp / hsdp: ZeRO-3 over the module's own tree (hsdp: sharded over 'shard' only,
    gradients averaged over 'replica' too); fsdp_tp: Megatron's split of every block over
    'model' (below), FSDP over 'data'. `remat`: each block's activations are recomputed in
    the backward (sf.remat; for fsdp / hsdp, apply_fn comes from sf.functional(..., remat=True))."""
    data_axes = tuple(a for a in mesh.axis_names if a != "model")  # the axes that split the batch
    options = dict(data_axes=data_axes, shard_axes="shard" if kind == "hsdp" else "data")
    if kind != "fsdp_tp":
        return Plan(apply_fn, options, lambda p: p, lambda p: p)
    block = sf.remat(tp_block) if remat else tp_block
    return Plan(lambda p, idx: tp_forward(p, idx, cfg, block), dict(options, param_specs=tp_spec),
                lambda p: to_tp(p, cfg), lambda p: from_tp(p, cfg))


# Tensor parallelism (--mesh fsdp_tp): Megatron's split of each block over the 'model'
# axis (Shoeybi et al., 2019). The attention heads and the MLP's hidden units are divided
# between the 'model' ranks, so each block needs one psum over 'model' after attention
# and one after the MLP. The same parameters as the module's, with c_attn viewed as
# (3, C_out, C_in) so that splitting dim 1 gives every rank its heads of q, k and v.
# `sf.shard(..., param_specs=tp_spec)` gives loss_fn this rank's blocks and FSDP-shards
# them over 'data'; the gradients follow shard_map's transpose rule (docs/howto/fsdp-tp.md).

TP_SPECS = {  # a block's leaf (its path below transformer.h[i]) -> its split over 'model'
    ("attn", "c_attn", "weight"): sf.P(None, "model"),  # column-parallel (3, C, C): this rank's heads
    ("attn", "c_attn", "bias"): sf.P(None, "model"),  # (3, C)
    ("attn", "c_proj", "weight"): sf.P(None, "model"),  # row-parallel (C_out, C_in): its inputs
    ("mlp", 0, "weight"): sf.P("model"),  # column-parallel (4C, C)
    ("mlp", 0, "bias"): sf.P("model"),  # (4C,)
    ("mlp", 2, "weight"): sf.P(None, "model"),  # row-parallel (C, 4C)
}


def tp_spec(path) -> sf.P:
    """How a parameter of the tree `to_tp` makes is split over 'model' (None: replicated:
    embeddings, LayerNorms and the biases added after a psum)."""
    path = tuple(path)
    return TP_SPECS.get(path[3:]) if path[:2] == ("transformer", "h") else None


def to_tp(params, cfg: Config):
    """The module's tree with c_attn's weight (3C, C) -> (3, C, C) and bias (3C,) -> (3, C)."""
    return optree.tree_map_with_path(
        lambda path, p: p.reshape(3, cfg.n_embd, *p.shape[1:]) if "c_attn" in path else p, params)


def from_tp(params, cfg: Config):
    return optree.tree_map_with_path(
        lambda path, p: p.reshape(3 * cfg.n_embd, *p.shape[2:]) if "c_attn" in path else p, params)


def tp_forward(params, idx, cfg: Config, block=None):
    """GPT.forward on this rank's blocks of the `to_tp` tree; logits on every 'model' rank."""
    block = block or tp_block
    T = idx.shape[1]
    C = cfg.n_embd
    tf = params["transformer"]
    x = tf["wte"]["weight"][idx] + tf["wpe"]["weight"][:T]  # (B, T, C)
    for blk in tf["h"]:
        x = block(blk, x, cfg)
    x = F.layer_norm(x, (C,), tf["ln_f"]["weight"], tf["ln_f"]["bias"])
    return x @ tf["wte"]["weight"].T  # the tied head: (B, T, vocab)


def tp_block(blk, x, cfg: Config):
    """One block on this rank's heads and hidden units: (B, T, C) -> (B, T, C)."""
    B, T, C = x.shape
    hs = C // cfg.n_head
    h = F.layer_norm(x, (C,), blk["ln_1"]["weight"], blk["ln_1"]["bias"])
    attn = blk["attn"]
    w, b = attn["c_attn"]["weight"], attn["c_attn"]["bias"]  # (3, C / model, C), (3, C / model)
    q, k, v = torch.einsum("btc,koc->kbto", h, w) + b[:, None, None, :]  # each (B, T, C / model)
    nh = q.shape[-1] // hs  # this rank's heads
    q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, nh * hs)
    x = x + sf.psum(y @ attn["c_proj"]["weight"].T, "model") + attn["c_proj"]["bias"]  # row-parallel
    h = F.layer_norm(x, (C,), blk["ln_2"]["weight"], blk["ln_2"]["bias"])
    a = F.gelu(h @ blk["mlp"][0]["weight"].T + blk["mlp"][0]["bias"])  # (B, T, 4C / model)
    return x + sf.psum(a @ blk["mlp"][2]["weight"].T, "model") + blk["mlp"][2]["bias"]


# -- training: the per-rank program ---------------------------------------------------


def tree_bytes(tree) -> int:
    return sum(x.numel() * x.element_size() for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor))


class Progress:
    """A tqdm bar when tqdm is installed, else a plain line every `every` steps.

    `state+gathered/rank` is what rank 0 holds besides activations: its parameter shards,
    their gradients and the AdamW state, plus the most gathered (unsharded) parameters the
    last step held at once. The step's whole peak (activations included) is planned by
    sf.estimate before training and measured by sf.measure_memory."""

    def __init__(self, total: int, initial: int, enabled: bool, every: int = 10):
        self.enabled, self.every, self.bar = enabled, every, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, total: int, loss: float, tok_s: float, held: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f}  {tok_s:,.0f} tok/s  state+gathered/rank {held / 1e6:.2f} MB")
            self.bar.update(1)
        elif step % self.every == 0 or step == total - 1:
            print(f"step {step:4d}/{total}  loss {loss:.4f}  {tok_s:8,.0f} tok/s  "
                  f"state+gathered/rank {held / 1e6:.2f} MB", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def next_token_loss(forward):
    """The loss of a forward `(params, idx) -> logits`: cross entropy of the next token."""
    def loss_fn(params, batch):
        x, y = batch  # (B, T), (B, T)
        logits = forward(params, x)  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return loss_fn


def mixed_precision(args):
    return sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None


def print_estimate(mesh, cfg: Config, args, apply_fn, params) -> None:
    """What each rank will hold and move, from a dry run of this run's step (sf.estimate)."""
    plan = parallelize(args.mesh, mesh, apply_fn, cfg, remat=args.remat)
    batch = (((cfg.batch_size, cfg.block_size), torch.long),) * 2  # this rank's (idx, targets)
    est = sf.estimate(next_token_loss(plan.forward), plan.to_layout(params), batch, mesh.shape,
                      optimizer=sf.optim.adamw(cfg.lr), mixed_precision=mixed_precision(args), **plan.shard_options)
    print(f"planned per rank (sf.estimate{', remat' if args.remat else ''}):\n{est}")


def train(mesh, cfg: Config, args, apply_fn, params, data):
    """Run on every rank. Returns (losses, full params, per-rank memory table)."""
    torch.set_num_threads(1)  # the ranks are the parallelism; keep runs reproducible
    plan = parallelize(args.mesh, mesh, apply_fn, cfg, remat=args.remat)
    loss_fn = next_token_loss(plan.forward)
    mp = mixed_precision(args)
    step = sf.shard(loss_fn, mesh, mixed_precision=mp, **plan.shard_options)
    shards = step.shard_params(plan.to_layout(params))  # fp32 master weights: this rank's chunks
    warmup = min(cfg.warmup, cfg.steps // 5)  # short runs (smoke tests) get a short warmup
    schedule = sf.optim.warmup_cosine_decay_schedule(cfg.lr / 10, cfg.lr, warmup, cfg.steps, cfg.lr / 10)
    decay_matrices = lambda tree: optree.tree_map(lambda p: p.dim() >= 2, tree)  # noqa: E731
    opt = sf.optim.chain(
        sf.optim.clip_by_global_norm(cfg.grad_clip, mesh=mesh, specs=step.specs),  # each block counted once
        sf.optim.adamw(schedule, b2=0.99, weight_decay=cfg.weight_decay, mask=decay_matrices),
    )
    opt_state = opt.init(shards)  # AdamW moments shaped like the shards: sharded too
    start, losses = 0, []
    if args.resume:
        start, shards, opt_state, losses = load_checkpoint(args.ckpt_dir, mesh, step, shards, opt_state)
    train_step = sf.train_step(step, opt, inplace=True)

    rank0 = mesh.rank == 0
    progress = Progress(cfg.steps, start, enabled=rank0 and not args.quiet)
    static_bytes = 2 * tree_bytes(shards) + tree_bytes(opt_state)  # shards + their grads + AdamW state
    data_group = mesh.group(plan.shard_options["data_axes"])  # 'model' ranks share their data rank's batch
    data_rank, data_size = data_group.index, data_group.size
    tokens = cfg.batch_size * cfg.block_size * data_size
    pending = None  # the asynchronous save in flight, if any
    for it in range(start, cfg.steps):
        batch = get_batch(data, cfg, args.seed, it, data_rank)
        t0 = time.perf_counter()
        shards, opt_state, loss = train_step(shards, opt_state, batch)
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        held = static_bytes + step.stats()["peak_gathered_bytes"]  # activations not included
        progress.update(it, cfg.steps, losses[-1], tokens / dt, held)
        if args.ckpt_dir and ((it + 1) % cfg.ckpt_every == 0 or it + 1 == cfg.steps):
            if pending is not None:
                pending.wait()  # collective: the previous save is published before the next starts
            pending = save_checkpoint(args.ckpt_dir, mesh, step, shards, opt_state, it + 1, losses)
    if pending is not None:
        pending.wait()
    progress.close()

    stats = step.stats()
    row = [tree_bytes(shards), tree_bytes(opt_state), stats["peak_gathered_bytes"], stats["all_gather_bytes"],
           stats["reduce_scatter_bytes"]]
    table = torch.zeros(mesh.size, len(row), dtype=torch.float64)
    table[mesh.rank] = torch.tensor(row, dtype=torch.float64)
    mesh.all_reduce(table, None)  # every rank's row, on every rank
    full = step.unshard_params(shards)
    return losses, plan.from_layout(full), table.long().tolist()


# -- checkpoints (sf.checkpoint) ------------------------------------------------------


def _checkpoint(step, shards, opt_state):
    """sf.checkpoint, and the specs of what we save: AdamW's moments are sharded like the params."""
    ckpt = sf.checkpoint
    specs = {"params": step.specs, "opt": ckpt.specs_like(opt_state, step.specs, shards), "step": None, "losses": None}
    return ckpt, specs


def save_checkpoint(directory, mesh, step, shards, opt_state, it, losses):
    """Start an asynchronous save (the files are written while training goes on, from a
    copy: the in-place optimizer may change the shards); `.wait()` publishes it."""
    ckpt, specs = _checkpoint(step, shards, opt_state)
    tree = {"params": shards, "opt": opt_state, "step": it, "losses": json.dumps(losses)}
    return ckpt.save(os.path.join(directory, f"step_{it:06d}"), tree, mesh, specs, overwrite=True, blocking=False)


def load_checkpoint(directory, mesh, step, shards, opt_state):
    ckpt, specs = _checkpoint(step, shards, opt_state)
    path = ckpt.latest(directory)
    if path is None:
        if mesh.rank == 0:
            print(f"--resume: no checkpoint under {directory!r}; starting from step 0")
        return 0, shards, opt_state, []
    like = {"params": shards, "opt": opt_state, "step": 0, "losses": ""}
    tree = ckpt.load(path, like, mesh, specs)  # from any world size / mesh shape: resharded on load
    if mesh.rank == 0:
        print(f"resumed from {path} (step {tree['step']})")
    return tree["step"], tree["params"], tree["opt"], json.loads(tree["losses"])


# -- after training: sampling and the loss curve (main program, rank 0) -----------------


@torch.no_grad()
def sample(apply_fn, params, cfg: Config, prompt: str, n: int, temperature: float, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([[STOI.get(c, STOI["?"]) for c in prompt]])  # (1, t)
    for _ in range(n):
        logits = apply_fn(params, idx[:, -cfg.block_size :])[:, -1, :]  # (1, vocab)
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    return "".join(VOCAB[i] for i in idx[0].tolist())


def plot_losses(losses, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no loss plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(losses)), losses, lw=1)
    ax.set(xlabel="step", ylabel="train loss (nats/char)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curve: {path}")


def report(cfg, args, mesh, losses, params, table, apply_fn, seconds):
    mb = lambda b: f"{b / 1e6:7.3f}"  # noqa: E731
    print(f"\nloss: step 0 {losses[0]:.4f} -> step {len(losses) - 1} {losses[-1]:.4f}   ({seconds:.1f} s)")
    print("per-rank memory (MB) and last-step traffic: shards | AdamW state | peak gathered | all-gather | reduce-scatter")
    for rank, row in enumerate(table):
        print(f"  rank {rank}: " + " | ".join(mb(b) for b in row))
    total = sum(p.numel() * 4 for p in optree.tree_leaves(params))
    if args.mesh == "fsdp_tp":
        print(f"  (the unsharded fp32 model is {total / 1e6:.3f} MB; shards: 1/{mesh.size} of the leaves split over "
              f"'model', 1/{mesh.shape['data']} of those replicated over it)")
    else:
        print(f"  (the unsharded fp32 model is {total / 1e6:.3f} MB; ZeRO-3: shards ~ 1/{mesh.size} of it each)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train_gpt_losses.json"), "w") as f:
        json.dump({"losses": losses, "mesh": mesh.shape, "kind": mesh.kind, "seed": args.seed}, f)
    plot_losses(losses, os.path.join(args.out, "train_gpt_loss.png"), f"char GPT, {args.mesh} on {mesh.shape}")
    for i, prompt in enumerate(("def ", "class ", "import ")):
        text = sample(apply_fn, params, cfg, prompt, args.sample_chars, 0.8, args.seed + i)
        print(f"\n--- sample {i} (temperature 0.8) ---\n{text}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mesh", choices=["fsdp", "hsdp", "fsdp_tp"], default="fsdp")
    parser.add_argument("--ranks", type=int, default=4, help="simulated ranks (torchrun: WORLD_SIZE)")
    parser.add_argument("--bf16", action="store_true", help="bf16 gathers and compute, fp32 master weights and reductions")
    parser.add_argument("--remat", action="store_true", help="recompute each block's activations in the backward (sf.remat)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 32-wide model for smoke tests")
    parser.add_argument("--ckpt-dir", default=None, help="save sf.checkpoint directories here")
    parser.add_argument("--ckpt-every", type=int, default=None)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    parser.add_argument("--out", default=OUT_DIR, help="where the loss curve goes")
    parser.add_argument("--sample-chars", type=int, default=200)
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args()
    cfg = Config(**(TINY if args.tiny else {}))
    cfg.steps = args.steps if args.steps is not None else cfg.steps
    cfg.ckpt_every = args.ckpt_every or cfg.ckpt_every
    if args.resume and not args.ckpt_dir:
        parser.error("--resume needs --ckpt-dir")
    world = int(os.environ.get("WORLD_SIZE", args.ranks))
    if args.mesh != "fsdp" and (world < 2 or world % 2):
        two = "{'replica': n / 2, 'shard': 2}" if args.mesh == "hsdp" else "{'data': n / 2, 'model': 2}"
        parser.error(f"--mesh {args.mesh} needs an even number of ranks ({two}), got {world}")
    if args.mesh == "fsdp_tp" and cfg.n_head % 2:
        parser.error(f"--mesh fsdp_tp splits the {cfg.n_head} heads over 2 'model' ranks: use an even n_head")

    torch.set_num_threads(1)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    shape = {"fsdp": {"data": world}, "hsdp": {"replica": world // 2, "shard": 2},
             "fsdp_tp": {"data": world // 2, "model": 2}}[args.mesh]
    # 300 s per collective: under torchrun rank 0 plans the run (sf.estimate) while the others
    # wait in their first collective; 120 s was missed on a 2-core machine under a CPU hog
    mesh = sf.init_mesh(shape, timeout=300) if distributed else sf.local_mesh(shape, timeout=300)

    data = load_text(cfg.text_chars)
    apply_fn, params = sf.functional(GPT(gpt_config(cfg)), remat=True if args.remat else None)
    params = init_params(params, args.seed)
    data_ranks = world // 2 if args.mesh == "fsdp_tp" else world  # the 'model' ranks share a batch
    if not distributed or mesh.rank == 0:
        n = sum(p.numel() for p in optree.tree_leaves(params))
        print(f"{mesh}: {args.mesh}{' bf16' if args.bf16 else ''}, {n:,} parameters, {len(data):,} characters "
              f"of stdlib source, global batch {cfg.batch_size * data_ranks} x {cfg.block_size}")
        print_estimate(mesh, cfg, args, apply_fn, params)

    t0 = time.perf_counter()
    results = mesh.run(train, mesh, cfg, args, apply_fn, params, data)  # simulated: one result per rank
    losses, full_params, table = results[0]
    if not distributed or mesh.rank == 0:
        report(cfg, args, mesh, losses, full_params, table, apply_fn, time.perf_counter() - t0)
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
