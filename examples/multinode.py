"""Train the examples' GPT across machines: HSDP, sharded within a node, replicated across.

The mesh is `{'node': NODES, 'gpu': GPUS_PER_NODE}`. torchrun numbers ranks node-major and
meshes lay ranks out row-major, so each 'gpu' group is one machine: the parameters are
sharded over 'gpu' (all-gathers and reduce-scatters on the fast intra-node link) and
replicated over 'node' (one gradient all-reduce per step crosses the network).

    # on each of two machines (or two terminals of one, as tests/backend/test_multinode.py does)
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint node0:29500 \
        --rdzv-id gpt-run examples/multinode.py --checkpoint-dir /shared/gpt-run --out losses.json
    # the same run from one launcher: the same losses, bit for bit
    torchrun --standalone --nproc-per-node 4 examples/multinode.py --mesh 2x2 --out losses.json
    # and without torchrun: the 2x2 mesh simulated by threads of one process, same losses
    python examples/multinode.py --mesh 2x2 --out losses.json

Every `--ckpt-every` steps all ranks save a sharded checkpoint (`sf.checkpoint`, atomic)
under `--checkpoint-dir`, which must be a filesystem every node sees. A run resumes from
the latest one it finds there, so restarting after a lost node is rerunning the same
command on every node. When a peer dies mid-step, the survivors stop within `--timeout`
seconds at most (at once when the dead peer's connections close) with a message that says
so, instead of hanging; see docs/howto/multi-node.md.

`--all-gather-dtype`, `--reduce-scatter-dtype` and `--block-size` pass through to
`sf.MixedPrecision` (compressed communication, docs/howto/compressed-communication.md);
each is passed only when given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys

import optree
import torch

import shardfn as sf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import (TINY, Config, get_batch, gpt_config, init_params, load_checkpoint,  # noqa: E402
                       load_text, next_token_loss, save_checkpoint)
from shardfn.testing.models import GPT  # noqa: E402

DTYPES = {"none": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int8": "int8"}
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout",
             "connectFullMesh", "ECONNRESET", "EPIPE")


def mesh_shape(arg: str | None, simulated: bool = False) -> dict:
    """`--mesh NODESxGPUS`, or torchrun's layout: nodes x processes per node."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if simulated and re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", arg):
        nodes, gpus = map(int, arg.split("x"))
        return {"node": nodes, "gpu": gpus}
    if arg is None:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        nodes, gpus = world // per_node, per_node
    elif re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", arg):
        nodes, gpus = map(int, arg.split("x"))
    else:
        raise SystemExit(f"multinode.py: --mesh {arg!r} is not NODESxGPUS.\nFix: e.g. --mesh 2x{world // 2 or 1}.")
    if nodes * gpus != world:
        raise SystemExit(f"multinode.py: --mesh {nodes}x{gpus} has {nodes * gpus} ranks but the job has {world} "
                         f"(WORLD_SIZE).\nFix: --mesh NODESxGPUS with NODES * GPUS = {world}.")
    return {"node": nodes, "gpu": gpus}


def mixed_precision(args) -> sf.MixedPrecision | None:
    """sf.MixedPrecision from the flags that were given (None: plain fp32)."""
    kw = {}
    if args.bf16:
        kw.update(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if args.all_gather_dtype is not None:
        kw["all_gather_dtype"] = DTYPES[args.all_gather_dtype]
    if args.reduce_scatter_dtype is not None:
        kw["reduce_scatter_dtype"] = DTYPES[args.reduce_scatter_dtype]
    if args.block_size is not None:
        kw["block_size"] = args.block_size
    return sf.MixedPrecision(**kw) if kw else None


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another rank went away."""
    if isinstance(error, (sf.CollectiveTimeoutError, sf.RankAbortedError)):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in PEER_LOST)


def stop(rank: int, args, what: str, code: int):
    """Say why this rank stops and how to go on, then exit at once (no atexit: tearing down
    gloo groups whose peers are gone can block)."""
    latest = sf.checkpoint.latest(args.checkpoint_dir) if args.checkpoint_dir else None
    print(f"multinode.py: rank {rank} {what}.\nFix: rerun the same command on every node; training resumes from "
          f"{latest or 'step 0 (no checkpoint yet: pass --checkpoint-dir)'}.", file=sys.stderr, flush=True)
    os._exit(code)


def train(mesh, cfg: Config, args, data):
    """Run on every rank; returns (losses, full params, the step a checkpoint resumed,
    this rank's last-step traffic: `step.stats()`)."""
    apply_fn, params = sf.functional(GPT(gpt_config(cfg)))
    params = init_params(params, args.seed)  # the same on every rank: one seeded generator
    step = sf.shard(next_token_loss(apply_fn), mesh, data_axes=("node", "gpu"), shard_axes="gpu",
                    mixed_precision=mixed_precision(args))
    shards = step.shard_params(params)  # fp32 master weights: 1/GPUS of each leaf
    warmup = min(cfg.warmup, cfg.steps // 5)
    schedule = sf.optim.warmup_cosine_decay_schedule(cfg.lr / 10, cfg.lr, warmup, cfg.steps, cfg.lr / 10)
    decay_matrices = lambda tree: optree.tree_map(lambda p: p.dim() >= 2, tree)  # noqa: E731
    opt = sf.optim.chain(
        sf.optim.clip_by_global_norm(cfg.grad_clip, mesh=mesh, specs=step.specs),
        sf.optim.adamw(schedule, b2=0.99, weight_decay=cfg.weight_decay, mask=decay_matrices),
    )
    opt_state = opt.init(shards)
    start, losses = 0, []
    if args.checkpoint_dir and sf.checkpoint.latest(args.checkpoint_dir) is not None:
        start, shards, opt_state, losses = load_checkpoint(args.checkpoint_dir, mesh, step, shards, opt_state)
    train_step = sf.train_step(step, opt, inplace=True)

    pending = None  # the asynchronous save in flight
    for it in range(start, cfg.steps):
        x, y = get_batch(data, cfg, args.seed, it, mesh.rank)  # the data rank is the global rank
        batch = (x.to(mesh.device), y.to(mesh.device))  # (B, T) each: cuda:LOCAL_RANK under NCCL
        shards, opt_state, loss = train_step(shards, opt_state, batch)
        losses.append(loss.item())
        if mesh.rank == 0 and not args.quiet:
            print(f"step {it:4d}/{cfg.steps}  loss {losses[-1]:.6f}", flush=True)
        if args.checkpoint_dir and ((it + 1) % cfg.ckpt_every == 0 or it + 1 == cfg.steps):
            if pending is not None:
                pending.wait()  # collective: the previous save is published before the next starts
            pending = save_checkpoint(args.checkpoint_dir, mesh, step, shards, opt_state, it + 1, losses)
    if pending is not None:
        pending.wait()
    stats = step.stats()  # before unshard_params, whose gathers are not a training step's
    return losses, step.unshard_params(shards), start, stats


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mesh", default=None, help="NODESxGPUS (default: torchrun's nnodes x nproc-per-node)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 32-wide model (tests, smoke runs)")
    parser.add_argument("--checkpoint-dir", default=None, help="save here every --ckpt-every steps; resume from it")
    parser.add_argument("--ckpt-every", type=int, default=None)
    parser.add_argument("--out", default=None, help="rank 0 writes the losses here (JSON)")
    parser.add_argument("--params-out", default=None, help="rank 0 writes the final full params here (torch.save)")
    parser.add_argument("--bf16", action="store_true", help="bf16 gathers and compute, fp32 reductions")
    parser.add_argument("--all-gather-dtype", choices=sorted(DTYPES), default=None,
                        help="sf.MixedPrecision(all_gather_dtype=...): the dtype parameters travel in")
    parser.add_argument("--reduce-scatter-dtype", choices=sorted(DTYPES), default=None,
                        help="sf.MixedPrecision(reduce_scatter_dtype=...): the dtype gradients travel in")
    parser.add_argument("--block-size", type=int, default=None, help="sf.MixedPrecision(block_size=...)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective waits for its peers")
    parser.add_argument("--quiet", action="store_true")
    return parser


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    cfg = Config(**(TINY if args.tiny else {}))
    cfg.steps = args.steps if args.steps is not None else cfg.steps
    cfg.ckpt_every = args.ckpt_every or cfg.ckpt_every
    data = load_text(cfg.text_chars)

    torch.set_num_threads(1)  # the ranks are the parallelism; keep CPU runs reproducible
    if "RANK" not in os.environ:  # `python examples/multinode.py`: the ranks as threads of this process
        mesh = sf.local_mesh(mesh_shape(args.mesh or "2x2", simulated=True), timeout=args.timeout)
        report(mesh, args, *mesh.run(train, mesh, cfg, args, data)[0])
        return
    mesh = sf.init_mesh(mesh_shape(args.mesh), timeout=args.timeout)
    signal.signal(signal.SIGTERM, lambda signum, frame: stop(mesh.rank, args, (
        "was stopped by SIGTERM: its launcher stops every rank when one fails or when it loses the "
        "rendezvous (a node died), and schedulers stop jobs this way"), 128 + signum))
    try:
        result = train(mesh, cfg, args, data)
    except Exception as e:
        if not lost_peer(e):
            raise
        stop(mesh.rank, args, f"lost a peer mid-step ({type(e).__name__}: {str(e).splitlines()[0]}).\n"
                              f"A node (or one of its processes) died or stopped responding; this job cannot go on "
                              f"without it", 1)
    if mesh.rank == 0:
        report(mesh, args, *result)
    torch.distributed.destroy_process_group()


def report(mesh, args, losses, full, start, stats) -> None:
    """Rank 0: a summary line, the losses (`--out`, JSON) and the final params (`--params-out`)."""
    mp = mixed_precision(args)
    print(f"{mesh}: {len(losses)} steps (resumed at {start}), loss {losses[0]:.6f} -> {losses[-1]:.6f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "mesh": mesh.shape, "resumed_at": start, "seed": args.seed, "stats": stats,
                       "mixed_precision": None if mp is None else {k: str(v) for k, v in mp._asdict().items()}}, f)
    if args.params_out:
        torch.save(full, args.params_out)


if __name__ == "__main__":
    main()
