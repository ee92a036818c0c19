"""Fine-tune a Hugging Face transformers causal LM, fully sharded, with shardfn.

The model is a transformers `LlamaForCausalLM`: by default a small random-init one whose
config and weights this script writes itself with `save_pretrained` (no download), or
any local directory `save_pretrained` wrote (`--model-dir`). No rank builds the whole
model: `sf.hf.empty_model` builds it with its parameters on the meta device (shapes
only; the rotary tables are computed), `sf.functional` turns it
into a function of a parameter tree (`remat=True`: each decoder layer's activations are
recomputed in the backward), `sf.shard` shards that tree over the mesh, and
`sf.hf.load_shards` reads each rank's rows of the weights straight from the
safetensors files. After fine-tuning on a tiny character-level text with
`sf.optim.adamw`, `sf.hf.save_pretrained` writes the model back out, and
`AutoModelForCausalLM.from_pretrained` reloads it: its logits are the sharded model's.

    python examples/finetune_hf.py                        # 2 ranks as threads of this process
    python examples/finetune_hf.py --ranks 4 --steps 100
    python examples/finetune_hf.py --model-dir path/to/a/save_pretrained/dir
    python examples/finetune_hf.py --tiny --steps 4       # a smoke test in seconds
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py   # same program, 2 processes
    python examples/finetune_hf.py --cp ring --ranks 4    # context parallel: {'data': 2, 'seq': 2}
    python examples/finetune_hf.py --cp ulysses --ranks 2 # {'data': 1, 'seq': 2}, contiguous layout
    python examples/finetune_hf.py --pp 2 --ranks 4       # 2 pipeline stages x 2 FSDP ranks, 1F1B

`--cp ring|ulysses` splits every sequence over a 'seq' mesh axis: the model is the same,
its attention implementation switched to `"shardfn_ring"` / `"shardfn_ulysses"`
(`sf.hf.register_attention`), the batch split by `sf.hf.shard_sequence` (global positions,
labels shifted before the split) and the loss `sf.hf.causal_lm_loss`
(docs/howto/context-parallel.md). `--pp N` splits the decoder layers into N pipeline
stages with `sf.hf.pipeline_stages` (embedding first, norm + head + loss last; `--schedule`),
FSDP over the rest of the ranks (docs/howto/pipeline.md); each rank then reads the whole
checkpoint and keeps its stage's part, and the export gathers the layers from the stages.
Both end, like the default, by reloading the export with `from_pretrained` and comparing
its loss on an evaluation batch with the sharded model's.

The forward is called with `use_cache=False`: no KV cache while training (transformers
does the same with its own gradient checkpointing), so the recompute never appends to a
cache the first forward filled.
"""

import argparse
import dataclasses
import os
import time

import optree
import torch

import shardfn as sf

# -- config ---------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    hidden_size: int = 64  # C
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    block_size: int = 64  # T: characters of context
    batch_size: int = 4  # B: sequences per rank per step (global batch = B * ranks)
    steps: int = 150
    lr: float = 3e-3
    weight_decay: float = 0.1


TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, block_size=32,
            batch_size=2, steps=6)
VOCAB = ["\n"] + [chr(i) for i in range(32, 127)]  # 96 characters: the token ids 0..95
STOI = {c: i for i, c in enumerate(VOCAB)}
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
TEXT = (__doc__ + "\n") * 20  # a repeated text: the model should learn it quickly


# -- the model: a directory save_pretrained wrote -------------------------------------


def write_random_model(cfg: Config, directory: str, seed: int) -> None:
    """A random-init Llama of `cfg`, written as a pretrained model directory (once, by one process)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.block_size,
                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)


# -- data: a repeated character-level text ----------------------------------------------


def encode(text: str, vocab_size: int) -> torch.Tensor:
    ids = torch.tensor([STOI.get(c, STOI["?"]) for c in text], dtype=torch.long)  # (N,)
    if vocab_size < len(VOCAB):
        raise SystemExit(f"the model's vocabulary ({vocab_size}) is smaller than the {len(VOCAB)} characters")
    return ids


def get_batch(data: torch.Tensor, cfg: Config, seed: int, step: int, rank: int) -> torch.Tensor:
    """This rank's (B, T) token ids at `step`: a function of (seed, step, rank) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_000 + rank)
    ix = torch.randint(len(data) - cfg.block_size, (cfg.batch_size,), generator=g)  # (B,)
    return data[ix[:, None] + torch.arange(cfg.block_size)]  # (B, T)


# -- training ---------------------------------------------------------------------------


class Progress:
    """A tqdm bar when tqdm is installed, else a line every 10 steps."""

    def __init__(self, total: int, enabled: bool):
        self.bar, self.enabled = None, enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}")
            self.bar.update(1)
        elif self.enabled and step % 10 == 0:
            print(f"step {step:4d}  loss {loss:.4f}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def global_batch(data: torch.Tensor, cfg: Config, seed: int, step: int, n_data: int) -> dict:
    """The whole batch of `step` (every data rank's rows), for sf.hf.shard_sequence."""
    ids = torch.cat([get_batch(data, cfg, seed, step, d) for d in range(n_data)])  # (B * n_data, T)
    return {"input_ids": ids, "labels": ids}


def train_cp(mesh, cfg: Config, args, model, model_dir: str, export_dir: str, data: torch.Tensor):
    """--cp: the sequence over 'seq' (ring or Ulysses attention), FSDP over 'data'.
    Returns (losses, the sharded model's eval loss, the eval batch)."""
    torch.set_num_threads(1)
    apply_fn, like = sf.functional(model, remat=True)  # the model's attention is already shardfn_*
    loss_fn = sf.hf.causal_lm_loss(apply_fn, layout=args.layout)  # this rank's share of the token mean
    step = sf.shard(loss_fn, mesh, data_axes=("data", "seq"), shard_axes="data")
    shards = sf.hf.load_shards(step, model_dir, like)  # this rank's rows of the 'data' split
    opt = sf.optim.adamw(cfg.lr, weight_decay=cfg.weight_decay,
                         mask=lambda tree: optree.tree_map(lambda p: p.dim() >= 2, tree))
    opt_state = opt.init(shards)
    train_step = sf.train_step(step, opt, inplace=True)
    progress = Progress(cfg.steps, enabled=mesh.rank == 0 and not args.quiet)
    losses = []
    for it in range(cfg.steps):
        batch = global_batch(data, cfg, args.seed, it, mesh.shape["data"])
        local = sf.hf.shard_sequence(batch, mesh, layout=args.layout)  # (B, T / seq) of this rank's rows
        shards, opt_state, loss = train_step(shards, opt_state, local)
        losses.append(loss.item())
        progress.update(it, losses[-1])
    progress.close()
    sf.hf.save_pretrained(export_dir, step, shards, model, overwrite=True)
    eval_batch = global_batch(data, cfg, args.seed + 1, 0, mesh.shape["data"])
    with torch.no_grad():
        eval_loss = step(shards, sf.hf.shard_sequence(eval_batch, mesh, layout=args.layout))
    return losses, float(eval_loss), eval_batch


def train_pp(mesh, cfg: Config, args, model, model_dir: str, export_dir: str, data: torch.Tensor):
    """--pp: the decoder layers over 'stage' (sf.hf.pipeline_stages), FSDP over 'data'."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    stages = sf.hf.pipeline_stages(model, microbatches=cfg.batch_size, schedule=args.schedule)
    step = sf.shard(stages.loss, mesh, data_axes="data")
    full = AutoModelForCausalLM.from_pretrained(model_dir)  # every weight, then this stage's part
    _, params = sf.functional(full)
    shards = step.shard_params(stages.scatter_params(params, mesh))
    opt = sf.optim.adamw(cfg.lr, weight_decay=cfg.weight_decay,
                         mask=lambda tree: optree.tree_map(lambda p: p.dim() >= 2, tree))
    opt_state = opt.init(shards)
    train_step = sf.train_step(step, opt, inplace=True)
    if mesh.rank == 0 and not args.quiet:
        print(stages.pipe.schedule(mesh.shape["stage"]).draw())
    progress = Progress(cfg.steps, enabled=mesh.rank == 0 and not args.quiet)
    losses = []
    for it in range(cfg.steps):
        ids = get_batch(data, cfg, args.seed, it, mesh.coords["data"])  # this data rank's (B, T)
        shards, opt_state, loss = train_step(shards, opt_state, {"input_ids": ids, "labels": ids})
        losses.append(loss.item())
        progress.update(it, losses[-1])
    progress.close()
    # export: gather the stages' layers (P('stage')), back to the transformers tree, rank 0 writes
    local = step.unshard_params(shards)
    specs = stages.pipe.specs(local)
    whole = {k: optree.tree_map(lambda x, s: sf.gather(x, mesh, s), local[k], specs[k]) for k in local}
    if mesh.rank == 0:
        state = {".".join(map(str, path)): x for path, x in zip(*optree.tree_flatten_with_path(stages.join(whole))[:2])}
        full.load_state_dict(state, strict=False)  # tied heads share the embedding's tensor
        full.save_pretrained(export_dir)
        print(f"exported {export_dir} (gathered from {mesh.shape['stage']} stages)")
    if mesh.kind == "distributed":
        torch.distributed.barrier()
    eval_batch = global_batch(data, cfg, args.seed + 1, 0, 1)
    with torch.no_grad():
        eval_loss = step(shards, eval_batch)  # every data rank the same rows: their mean is that loss
    return losses, float(eval_loss), eval_batch


def train(mesh, cfg: Config, args, model, model_dir: str, export_dir: str, data: torch.Tensor):
    """Run on every rank: load shards, fine-tune, export. Returns (losses, sharded logits, eval ids)."""
    if args.cp:
        return train_cp(mesh, cfg, args, model, model_dir, export_dir, data)
    if args.pp:
        return train_pp(mesh, cfg, args, model, model_dir, export_dir, data)
    torch.set_num_threads(1)  # the ranks are the parallelism
    apply_fn, like = sf.functional(model, remat=True)  # like: meta tensors (tree, shapes, dtypes)

    def loss_fn(params, ids):  # ids: (B, T); transformers shifts the labels itself
        out = apply_fn(params, ids, labels=ids, use_cache=False)  # no KV cache while training
        return out.loss, out.logits.detach()  # aux: the logits, for the final comparison

    step = sf.shard(loss_fn, mesh, has_aux=True)
    shards, stats = sf.hf.load_shards(step, model_dir, like, return_stats=True)  # this rank's rows only
    if mesh.rank == 0:
        total = sum(x.numel() * x.element_size() for x in optree.tree_leaves(like))
        print(f"rank 0 read {stats.data_bytes:,} of {total:,} weight bytes (+ {stats.header_bytes:,} header bytes)")
    decay_matrices = lambda tree: optree.tree_map(lambda p: p.dim() >= 2, tree)  # noqa: E731
    opt = sf.optim.adamw(cfg.lr, weight_decay=cfg.weight_decay, mask=decay_matrices)
    opt_state = opt.init(shards)  # AdamW moments shaped like the shards: sharded too
    train_step = sf.train_step(step, opt, has_aux=True, inplace=True)

    progress = Progress(cfg.steps, enabled=mesh.rank == 0 and not args.quiet)
    losses = []
    for it in range(cfg.steps):
        ids = get_batch(data, cfg, args.seed, it, mesh.rank)  # (B, T)
        shards, opt_state, loss, _ = train_step(shards, opt_state, ids)
        losses.append(loss.item())
        progress.update(it, losses[-1])
    progress.close()

    saved = sf.hf.save_pretrained(export_dir, step, shards, model, overwrite=True)  # one unit at a time
    if mesh.rank == 0:
        print(f"exported {saved.files} to {export_dir} (gathered at most {saved.peak_unit_bytes:,} bytes at once)")
    eval_ids = get_batch(data, cfg, args.seed + 1, 0, 0)  # the same (B, T) on every rank
    _, logits = step(shards, eval_ids)  # the sharded model's logits, (B, T, vocab)
    return losses, logits, eval_ids


def plot_losses(losses, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no loss plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses)
    ax.set(xlabel="step", ylabel="loss (next character)", title="finetune_hf.py: sharded fine-tuning")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curve: {path}")


def compare_loss(export_dir: str, loss: float, eval_batch: dict) -> None:
    """--cp / --pp: the reloaded export's loss on the eval batch against the sharded model's."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    apply_fn, params = sf.functional(reloaded)
    with torch.no_grad():
        theirs = sf.hf.causal_lm_loss(apply_fn, seq_axis=None)(params, sf.hf.shard_sequence(eval_batch, None))
    diff = abs(theirs.item() - loss)
    print(f"max |loss diff| (from_pretrained vs sharded): {diff:.3e}")
    assert diff <= 1e-5, diff
    print("OK")


def compare(export_dir: str, logits: torch.Tensor, eval_ids: torch.Tensor) -> None:
    """Reload the export with transformers and compare its logits with the sharded model's."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    with torch.no_grad():
        theirs = reloaded(eval_ids, use_cache=False).logits  # (B, T, vocab)
    diff = (theirs - logits).abs().max().item()
    print(f"max |logits diff| (from_pretrained vs sharded): {diff:.3e}")
    assert diff <= 1e-6, diff
    print("OK")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=None, help="a local directory model.save_pretrained wrote")
    parser.add_argument("--ranks", type=int, default=2, help="simulated ranks (torchrun: WORLD_SIZE)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a 32-wide model and a few steps, for smoke tests")
    parser.add_argument("--out", default=OUT_DIR, help="where the model directories and the loss plot go")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--cp", choices=["ring", "ulysses"], default=None,
                        help="context parallelism: split each sequence over a 'seq' axis of --seq ranks")
    parser.add_argument("--seq", type=int, default=2, help="--cp: ranks of the 'seq' axis")
    parser.add_argument("--layout", choices=["contiguous", "zigzag"], default=None,
                        help="--cp: the sequence layout (default: zigzag for ring, contiguous for ulysses)")
    parser.add_argument("--pp", type=int, default=0, help="pipeline parallelism: N stages of decoder layers")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"], help="--pp: the schedule")
    args = parser.parse_args()
    cfg = Config(**(TINY if args.tiny else {}))
    cfg.steps = args.steps if args.steps is not None else cfg.steps
    if args.cp and args.pp:
        raise SystemExit("--cp and --pp: pick one (their composition is not wired up in this example)")
    args.layout = args.layout or ("zigzag" if args.cp == "ring" else "contiguous")

    torch.set_num_threads(1)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    world = int(os.environ.get("WORLD_SIZE", args.ranks))
    inner = {"seq": args.seq} if args.cp else {"stage": args.pp} if args.pp else {}
    n_inner = next(iter(inner.values()), 1)
    if world % n_inner:
        raise SystemExit(f"{world} ranks do not split into {inner} x data")
    shape = {"stage": args.pp, "data": world // args.pp} if args.pp else {"data": world // n_inner, **inner}
    mesh = sf.init_mesh(shape, timeout=120) if distributed else sf.local_mesh(shape, timeout=120)
    rank0 = not distributed or mesh.rank == 0
    work = os.path.join(args.out, "finetune_hf")
    model_dir = args.model_dir or os.path.join(work, "base")
    export_dir = os.path.join(work, "finetuned")
    if args.model_dir is None and rank0:
        write_random_model(cfg, model_dir, args.seed)
    if distributed:
        torch.distributed.barrier()  # the base model is written before any rank reads it

    # Parameters on the meta device (no memory: the shards come from the files), buffers
    # such as the rotary tables computed; built once per process, before the rank threads.
    model = sf.hf.empty_model(model_dir)
    if args.cp:  # the one change to the model: its attention
        sf.hf.register_attention()
        model.set_attn_implementation(f"shardfn_{args.cp}")
    if args.pp and model.config.num_hidden_layers % args.pp:
        raise SystemExit(f"--pp {args.pp}: the model's {model.config.num_hidden_layers} layers do not split into "
                         f"{args.pp} stages")
    data = encode(TEXT, model.config.vocab_size)
    if rank0:
        print(f"{mesh}: fine-tuning {model_dir} on {len(data):,} characters, global batch "
              f"{cfg.batch_size * mesh.shape['data']} x {cfg.block_size}, {cfg.steps} steps")
    t0 = time.perf_counter()
    losses, result, eval_data = mesh.run(train, mesh, cfg, args, model, model_dir, export_dir, data)[0]
    if rank0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {time.perf_counter() - t0:.1f} s")
        plot_losses(losses, os.path.join(args.out, "finetune_hf_loss.png"))
        if args.cp or args.pp:
            compare_loss(export_dir, result, eval_data)
        else:
            compare(export_dir, result, eval_data)
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
