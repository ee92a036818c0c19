"""Synchronous HSDP across the replicas of a torchft Manager: a lost replica without a restart.

[Note: synchronous replicas through torchft] HSDP on a mesh `{"replica": R, "shard": S}`
all-reduces every step's gradient shard across replicas. Here the replicas are not mesh
axes: each replica is its own mesh (its FSDP group, `sf.shard(loss_fn, mesh)` on
`{"shard": S}`), and the rank's torchft `Manager` (its process group joins the ranks of
the same shard index across replicas) is the replica dimension. One step on every rank:

    manager.start_quorum()             # the live replicas agree on membership; a replica
                                       # behind the others is healed here, from a healthy
                                       # peer's state_dict (not from disk)
    grads = step.grad_and_value(...)   # this replica's gradient shard (reduce-scattered
                                       # over its own shard axes)
    manager.allreduce(grads)           # the sum over the replicas in the quorum, / their number
    if manager.should_commit():        # every rank of every replica in the quorum finished
        shards, opt_state = opt.update(...)
    # else: the step is dropped on every replica (shards and state unchanged, the
    # Manager's step not advanced): the caller runs it again, at the next quorum

The sum rule when a replica drops: the gradient of a step is the mean over the replicas
that finished it. A replica that dies inside a step makes the others' all-reduce fail;
torchft then refuses the commit everywhere, the step is taken again at the next quorum
without the dead replica, and its gradient is the mean over the survivors. Within a
replica nothing changes: a lost rank there fails that replica (its peers' collectives
fail), not the job.

Healing needs the quorum synchronous (`Manager(use_async_quorum=False)`): the healed
state is applied inside `start_quorum`, before the gradient is computed, so a replacement
takes part in its first step with its peer's parameters (the mean is unchanged by it:
its gradient is of the same parameters on its own batch). The state is whatever this
rank's shards and optimizer state were at the last step boundary: `state_dict(rank)` /
`load_state_dict(sd, rank)` are the callbacks to give the Manager (torchft calls them on a
thread of its own, so bind the rank: `state_dict=lambda: train.state_dict(rank)`).
"""

from __future__ import annotations

import functools

import torch

from . import _tree
from ._errors import SpecError
from .optim import apply_updates

__all__ = ["Replicated"]


class Replicated:
    """What `sf.train_step(step, opt, replicas=manager)` returns: `train(shards, opt_state,
    batch) -> (shards, opt_state, loss)` (loss: this replica's; `batch` may be a function of
    the Manager's step, called after the quorum: a replacement healed there takes its
    peers' step, e.g. `lambda k: loader.batch(k)`), with `state_dict` /
    `load_state_dict` for the Manager, `log` and `stats()`. See [Note: synchronous
    replicas through torchft]."""

    def __init__(self, step, opt, manager, *, inplace: bool = False):
        if not hasattr(step, "grad_and_value") or not hasattr(step, "mesh"):
            raise SpecError(f"train_step(replicas=...): the step must be an sf.shard step (one replica's FSDP step), "
                            f"got {type(step).__name__}.\nFix: step = sf.shard(loss_fn, replica_mesh).")
        if getattr(step.config, "has_aux", False):
            raise SpecError("train_step(replicas=...): a step with has_aux=True is not supported across torchft "
                            "replicas.\nFix: return the loss alone from loss_fn.")
        if getattr(manager, "_use_async_quorum", False):
            raise SpecError(
                "train_step(replicas=...): the Manager was built with use_async_quorum=True; a replica healed by "
                "an asynchronous quorum would compute its first gradient from its stale parameters.\nFix: "
                "Manager(..., use_async_quorum=False).")
        self.step, self.opt, self.manager, self.inplace = step, opt, manager, inplace
        self.mesh = step.mesh
        self._current: dict[int, tuple] = {}  # rank -> (shards, opt_state) at the last step boundary
        self._healed: dict[int, bool] = {}
        self._stats: dict[int, dict[str, int]] = {}
        self.log: list[tuple] = []  # (rank, manager step, participants, healed, committed) per step tried

    def _rank_stats(self) -> dict[str, int]:
        return self._stats.setdefault(self.mesh.rank, {"steps": 0, "committed": 0, "dropped": 0, "replica_bytes": 0})

    def state_dict(self, rank: int | None = None) -> dict:
        """Rank `rank`'s (default: this rank's) shards and optimizer state at its last step
        boundary, for torchft's `Manager(state_dict=...)`."""
        shards, opt_state = self._current[self.mesh.rank if rank is None else rank]
        return {"shards": shards, "opt_state": opt_state}

    def load_state_dict(self, sd: dict, rank: int | None = None) -> None:
        """Replace rank `rank`'s (default: this rank's) shards and optimizer state with a
        peer's: torchft's healing, at the quorum."""
        rank = self.mesh.rank if rank is None else rank
        self._current[rank] = (sd["shards"], sd["opt_state"])
        self._healed[rank] = True

    def __call__(self, shards, opt_state, batch):
        manager, rank, stats = self.manager, self.mesh.rank, self._rank_stats()
        self._current[rank] = (shards, opt_state)
        self._healed[rank] = False
        manager.start_quorum()  # synchronous: heals this rank's state here if its replica is behind
        shards, opt_state = self._current[rank]
        if callable(batch):  # the batch of the Manager's step, known after the quorum (a healed replica's jumps)
            batch = batch(manager.current_step())
        grads, loss = self.step.grad_and_value(shards, batch)
        stats["steps"] += 1
        with torch.no_grad():
            leaves, treedef = _tree.flatten(grads)
            dtype = functools.reduce(torch.promote_types, (g.dtype for g in leaves))
            flat = torch.cat([g.reshape(-1).to(dtype) for g in leaves])  # (n,) this rank's gradient shards
            stats["replica_bytes"] += flat.numel() * flat.element_size()
            manager.allreduce(flat).wait()  # the mean over the replicas in the quorum, in place
            participants = manager.num_participants()
            if not manager.should_commit():  # a replica (or a rank of one) failed this step: drop it everywhere
                stats["dropped"] += 1
                self.log.append((rank, manager.current_step(), participants, self._healed[rank], False))
                return shards, opt_state, loss.detach()
            self.log.append((rank, manager.current_step() - 1, participants, self._healed[rank], True))
            mean, start = [], 0
            for g in leaves:
                mean.append(flat[start:start + g.numel()].reshape(g.shape).to(g.dtype))
                start += g.numel()
            updates, opt_state = self.opt.update(_tree.unflatten(treedef, mean), opt_state, shards)
            shards = apply_updates(shards, updates, inplace=self.inplace)
        stats["committed"] += 1
        self._current[rank] = (shards, opt_state)
        return shards, opt_state, loss.detach()

    def stats(self) -> dict[str, int]:
        """This rank's counts: `steps` tried, `committed`, `dropped` (refused by the Manager),
        and `replica_bytes` (the gradient bytes all-reduced across replicas)."""
        return dict(self._rank_stats())
