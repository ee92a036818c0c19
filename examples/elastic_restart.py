"""Survive a lost rank: torchrun restarts the job, training resumes from the last checkpoint.

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/elastic_restart.py \
        --ckpt-dir /tmp/elastic --kill-at 7

Every `--ckpt-every` steps all ranks save a sharded checkpoint (`sf.checkpoint.save`, an
atomic directory). With `--kill-at K`, rank 1 SIGKILLs itself at step K on the first
attempt; torchrun's agent stops the other rank and starts both again
(TORCHELASTIC_RESTART_COUNT=1), and they resume from `sf.checkpoint.latest`. Data and
initialization are deterministic (seeded by step and rank), so the final parameters equal
those of an uninterrupted run; `--out` writes them (rank 0) for comparison.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal

import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.testing.models import mlp_loss, mlp_params


def batch_for(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--ckpt-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=-1, help="rank 1 SIGKILLs itself at this step (first attempt)")
    parser.add_argument("--out", default=None, help="rank 0 writes the final full params here (torch.save)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        # One key space per attempt in torchrun's store: a restarted job must not find the
        # gloo addresses its dead predecessor published (seen on torch 2.13 with --standalone).
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"shardfn-elastic/{attempt}", store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=60))
    mesh = sf.init_mesh({"data": int(os.environ.get("WORLD_SIZE", "1"))}, timeout=60)
    step = sf.shard(mlp_loss, mesh)
    opt = sf.optim.adamw(1e-2)
    train = sf.train_step(step, opt)

    params = mlp_params(torch.Generator().manual_seed(0), [16, 32, 32, 4])
    shards = step.shard_params(params)
    state = opt.init(shards)
    specs = {"params": step.specs, "opt": sf.checkpoint.specs_like(state, step.specs), "step": sf.P()}
    start = 0
    latest = sf.checkpoint.latest(args.ckpt_dir)
    if latest is not None:
        tree = sf.checkpoint.load(latest, {"params": shards, "opt": state, "step": 0}, mesh, specs)
        shards, state, start = tree["params"], tree["opt"], tree["step"]
    if mesh.rank == 0:
        print(f"attempt {attempt}: starting at step {start}" + (f" from {latest}" if latest else ""), flush=True)

    for i in range(start, args.steps):
        if i == args.kill_at and attempt == 0 and mesh.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a node dies mid-training
        shards, state, loss = train(shards, state, batch_for(i, mesh.rank))
        if mesh.rank == 0:
            print(f"step {i}: loss {float(loss):.6f}", flush=True)
        if (i + 1) % args.ckpt_every == 0:
            sf.checkpoint.save(os.path.join(args.ckpt_dir, f"step_{i + 1:06d}"),
                               {"params": shards, "opt": state, "step": i + 1}, mesh, specs)

    full = step.unshard_params(shards)
    if mesh.rank == 0 and args.out:
        torch.save(full, args.out)
        print(f"wrote {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
