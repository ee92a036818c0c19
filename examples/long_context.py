"""Train a GPT on sequences too long for one rank: context parallelism with shardfn.

Every sequence is split over the mesh's 'seq' axis: each rank holds T / S of its tokens
and their activations, and attention sees the whole sequence through `sf.nn.ring_attention`
(K/V blocks passed around the ring) or `sf.nn.ulysses_attention` (all_to_all to a split of
the heads). The parameters are FSDP-sharded over 'data' by `sf.shard`, whose gradients are
averaged over ('data', 'seq'): every rank holds as many tokens, so that is the token mean
over the global batch, as one device computes it. The model is the functional GPT of
`shardfn/testing/seq_gpt.py` (nanoGPT's block; positions from `sf.nn.positions`).

    python examples/long_context.py                        # ring, zig-zag, {'data': 1, 'seq': 4}
    python examples/long_context.py --cp ulysses --data 2 --seq 2         # contiguous layout
    torchrun --nproc-per-node 4 examples/long_context.py   # the same on processes (--data x --seq = 4)

Before training it prints (1) a check at a small size, in float64: the first steps' losses
on the mesh equal one device's; (2) one rank's planned activation memory (sf.estimate) vs a
single rank holding the whole sequence, against the budget below.
"""

import argparse
import dataclasses
import glob
import json
import os
import time

import torch

import shardfn as sf
from shardfn.testing import seq_gpt

# -- config ---------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64  # C
    seq_len: int = 4096  # T: characters of context (global)
    batch_size: int = 1  # B: sequences per data rank per step
    steps: int = 40
    lr: float = 3e-3
    text_chars: int = 400_000
    activation_budget_mb: float = 20.0  # what one rank may spend on activations (stated, for the check)


TINY = dict(seq_len=256, steps=6, text_chars=50_000, activation_budget_mb=2.0)
CHECK = dict(n_layer=2, n_head=4, n_embd=32, seq_len=64, batch_size=2)  # the float64 equality check
CHECK_STEPS = 3
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


def global_batch(data: torch.Tensor, batch: int, t: int, seed: int, step: int):
    """The global batch at `step` (the same on every rank): inputs, targets, (batch, t) each."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ix = torch.randint(len(data) - t - 1, (batch,), generator=g)  # (B,)
    chunk = data[ix[:, None] + torch.arange(t + 1)]  # (B, T + 1)
    return chunk[:, :-1], chunk[:, 1:]


# -- context parallelism: the model config and this rank's tokens ---------------------


def model_config(cfg: Config, args, attention: str) -> seq_gpt.SeqGPTConfig:
    """attention "sdpa": one rank, the whole sequence; "ring" / "ulysses": over 'seq'."""
    cp = attention != "sdpa"
    return seq_gpt.SeqGPTConfig(vocab_size=len(VOCAB), max_len=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
                                n_embd=cfg.n_embd, attention=attention, axis="seq" if cp else None,
                                layout=args.layout if cp else "contiguous")


def local_tokens(mesh, batch, layout: str):
    """This rank's block of the global (inputs, targets): sequences over 'data', tokens over
    'seq' (zig-zag: chunks i and 2S-1-i of 2S, so causal attention's work is balanced)."""
    if layout == "zigzag":
        batch = tuple(sf.nn.zigzag(x, mesh.shape["seq"], dim=1) for x in batch)
    return tuple(sf.scatter(x, mesh, sf.P("data", "seq")) for x in batch)  # (B, T / S) each


def make_step(mesh, mcfg):
    """sf.shard: parameters FSDP-sharded over 'data'; the loss (and gradients) averaged over
    ('data', 'seq'), i.e. over every token of the global batch."""
    return sf.shard(lambda p, b: seq_gpt.loss_fn(p, b, mcfg), mesh, data_axes=("data", "seq"), shard_axes="data")


def train_on_mesh(mesh, cfg: Config, args, params, batches, progress=False):
    """The rank program: AdamW over `batches` (global; params' dtype); returns (losses, seconds)."""
    step = make_step(mesh, model_config(cfg, args, args.cp))
    opt = sf.optim.adamw(cfg.lr, weight_decay=0.0)
    shards = step.shard_params(params)
    state = opt.init(shards)
    train = sf.train_step(step, opt, inplace=True)
    bar = _progress(len(batches)) if progress and mesh.rank == 0 else None
    losses, start = [], time.perf_counter()
    for batch in batches:
        shards, state, loss = train(shards, state, local_tokens(mesh, batch, args.layout))
        losses.append(loss.item())
        if bar is not None:
            bar.set_postfix_str(f"loss {loss.item():.3f}")
            bar.update(1)
    if bar is not None:
        bar.close()
    return losses, time.perf_counter() - start


def train_one_device(cfg: Config, args, params, batches):
    mcfg = model_config(cfg, args, "sdpa")
    opt = sf.optim.adamw(cfg.lr, weight_decay=0.0)
    train = sf.train_step(lambda p, b: seq_gpt.loss_fn(p, b, mcfg), opt)
    state, losses = opt.init(params), []
    for batch in batches:
        params, state, loss = train(params, state, batch)
        losses.append(loss.item())
    return losses


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True)


# -- the two printed checks -----------------------------------------------------------


def check_equals_one_device(mesh, args, data, lead: bool = True) -> float:
    """float64, small: the first CHECK_STEPS losses on the mesh vs one device's."""
    cfg = Config(**CHECK)
    mesh_batch = cfg.batch_size * mesh.shape["data"]
    batches = [global_batch(data, mesh_batch, cfg.seq_len, args.seed + 1, s) for s in range(CHECK_STEPS)]
    params = seq_gpt.init_params(model_config(cfg, args, "sdpa"), torch.Generator().manual_seed(args.seed),
                                 torch.float64)
    want = train_one_device(cfg, args, params, batches)
    got = mesh.run(train_on_mesh, mesh, cfg, args, params, batches)[0][0]
    diff = max(abs(a - b) for a, b in zip(got, want))
    if lead:
        print(f"check (float64, T={cfg.seq_len}, {CHECK_STEPS} AdamW steps): losses on {mesh.shape} "
              f"{[round(x, 6) for x in got]} vs one device {[round(x, 6) for x in want]}: max |delta| {diff:.2e}")
    assert diff <= 1e-9, f"context-parallel losses differ from one device's by {diff}"
    return diff


def activation_estimate(cfg: Config, args, params, mesh_shape) -> tuple[int, int]:
    """Peak activation bytes of one training step on one rank (sf.estimate, meta tensors):
    this mesh (T / S tokens a rank) and one rank holding the whole sequence."""
    tokens = lambda t: ((cfg.batch_size, t), torch.long)  # noqa: E731
    cp = model_config(cfg, args, args.cp)
    here = sf.estimate(lambda p, b: seq_gpt.loss_fn(p, b, cp), params, (tokens(cfg.seq_len // mesh_shape["seq"]),) * 2,
                       mesh_shape, data_axes=("data", "seq"), shard_axes="data")
    one = model_config(cfg, args, "sdpa")
    alone = sf.estimate(lambda p, b: seq_gpt.loss_fn(p, b, one), params, (tokens(cfg.seq_len),) * 2, {"data": 1})
    return here.peak_activation_bytes, alone.peak_activation_bytes


# -- report ---------------------------------------------------------------------------


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", choices=["ring", "ulysses"], default="ring")
    parser.add_argument("--layout", choices=["contiguous", "zigzag"], default=None,
                        help="default: zigzag for ring (balanced causal work), contiguous for ulysses (its "
                             "local attention keeps SDPA's causal kernel)")
    parser.add_argument("--data", type=int, default=1, help="ranks of the 'data' axis (FSDP)")
    parser.add_argument("--seq", type=int, default=4, help="ranks of the 'seq' axis (context parallelism)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help=f"a smoke-test size: {TINY}")
    parser.add_argument("--out", default=OUT_DIR, help="where the loss curve and losses go")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    args.layout = args.layout or ("zigzag" if args.cp == "ring" else "contiguous")

    cfg = Config(**(TINY if args.tiny else {}))
    cfg = dataclasses.replace(cfg, **{k: v for k, v in dict(steps=args.steps, seq_len=args.seq_len).items() if v})
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one thread per rank (ranks are threads on the simulated mesh)
    shape = {"data": args.data, "seq": args.seq}
    distributed = "WORLD_SIZE" in os.environ
    mesh = sf.init_mesh(shape, timeout=120) if distributed else sf.local_mesh(shape, timeout=120)
    lead = not distributed or int(os.environ.get("RANK", "0")) == 0
    data = load_text(cfg.text_chars)

    check_equals_one_device(mesh, args, data, lead)

    mcfg = model_config(cfg, args, "sdpa")
    params = seq_gpt.init_params(mcfg, torch.Generator().manual_seed(args.seed))
    if lead:
        here, alone = activation_estimate(cfg, args, params, shape)
        budget = cfg.activation_budget_mb * 1e6
        print(f"activations per rank (sf.estimate, T={cfg.seq_len}, B={cfg.batch_size}): one rank holding the whole "
              f"sequence {alone / 1e6:.2f} MB ({'fits' if alone <= budget else 'does NOT fit'} the "
              f"{cfg.activation_budget_mb:g} MB budget); {args.cp} over 'seq'={args.seq}: {here / 1e6:.2f} MB "
              f"({'fits' if here <= budget else 'does NOT fit'}), {here / alone:.2f}x")

    batches = [global_batch(data, cfg.batch_size * args.data, cfg.seq_len, args.seed, s) for s in range(cfg.steps)]
    losses, seconds = mesh.run(train_on_mesh, mesh, cfg, args, params, batches, progress=not args.quiet)[0]
    tokens = cfg.steps * cfg.batch_size * args.data * cfg.seq_len
    if lead:
        print(f"trained {cfg.steps} steps of {cfg.batch_size * args.data} x {cfg.seq_len} tokens with {args.cp} "
              f"attention ({args.layout}) on {shape}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"{seconds:.1f} s ({tokens / seconds:,.0f} tok/s)")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "long_context_losses.json"), "w") as f:
            json.dump({"losses": losses, "kind": "distributed" if distributed else "simulated", "cp": args.cp, "layout": args.layout, "mesh": shape,
                       "seq_len": cfg.seq_len}, f)
        plot_losses(losses, os.path.join(args.out, "long_context_loss.png"),
                    f"{args.cp} attention, {args.layout}, T={cfg.seq_len}, {shape}")


if __name__ == "__main__":
    main()
