"""LocalSGD and DiLoCo: semi-synchronous training across the replicas of an HSDP mesh.

[Note: semi-synchronous replicas] On a mesh `{"replica": R, "shard": S}`, HSDP all-reduces
every step's gradient shard across replicas. Here each replica trains on its own: the
inner step is a `shard` step whose data axes leave the replica axes out, so nothing
crosses replicas in it (the inner optimizer, e.g. AdamW, steps on the replica's own
gradient). Every `sync_every` (H) inner steps, the *outer* step:

    delta  = mean over replicas of (anchor - shards)      # the pseudo-gradient
    anchor = outer_opt step on anchor with delta           # DiLoCo: SGD, Nesterov 0.9
    shards = anchor                                        # every replica restarts from it

where `anchor` is the parameters at the last outer step. LocalSGD is the outer SGD with
learning rate 1 and no momentum: the replicas' parameters averaged. The inner optimizer's
state carries on across outer steps (as DiLoCo's paper and torchft do). The averaging is
one all-reduce of the replica's shards (Ψ/S bytes) per H inner steps: 1/H of HSDP's
cross-replica traffic; with `wire=` (torch.bfloat16, "int8", a float8 dtype: the formats of
[Note: wire formats] in _quant.py) each replica's delta is encoded, all-gathered across
replicas and decoded before the mean. `stats()` counts those bytes.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from . import _tree
from ._backend import ops
from ._errors import SpecError
from ._quant import Wire, decode, encode, nbytes
from .optim import apply_updates, sgd, train_step

__all__ = ["SemiSync", "SemiSyncState", "diloco", "local_sgd"]


class SemiSyncState(NamedTuple):
    inner: Any  # the inner optimizer's state (sharded like the shards)
    outer: Any  # the outer optimizer's state
    anchor: Any  # the parameters (this rank's shards) at the last outer step
    count: int  # inner steps taken


class SemiSync:
    """The callable `diloco` / `local_sgd` return: `train(shards, state, batch) ->
    (shards, state, loss)`, with `init(shards)` and `stats()`."""

    def __init__(self, step, inner, outer, *, sync_every: int, replica_axes, wire, name: str, replicas=None):
        mesh = step.mesh
        self.step, self.inner, self.outer, self.mesh, self.name = step, inner, outer, mesh, name
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise SpecError(f"{name}: sync_every must be a positive int (inner steps per outer step), "
                            f"got {sync_every!r:.40}")
        self.sync_every = sync_every
        self.replicas = replicas  # [Note: replicas through torchft]
        if replicas is not None:
            if wire is not None:
                raise SpecError(f"{name}: wire= encodes the delta for shardfn's own all-gather across replicas; "
                                f"with replicas= the torchft Manager all-reduces it.\nFix: drop wire=.")
            replica_axes = ()
        self.replica_axes = mesh.axes(replica_axes, where=f"{name}(replica_axes=...)") if replica_axes else ()
        data_axes = tuple(step.config.data_axes)
        both = [a for a in self.replica_axes if a in data_axes]
        if both:
            raise SpecError(
                f"{name}: the inner step averages its gradients over {data_axes}, which include the replica "
                f"axes {both}: that is HSDP, every step synchronous.\nFix: build the inner step without them, "
                f"e.g. sf.shard(loss_fn, mesh, data_axes='shard') on {mesh.shape}, so that each replica trains "
                f"on its own between outer steps.")
        self.wire = Wire.of(wire, where=f"{name}(wire=...)")
        self._train = train_step(step, inner)
        self._stats: dict[int, dict[str, int]] = {}
        self._current: dict[int, tuple] = {}  # rank -> (shards, state) at the outer step (torchft's state_dict)
        self._healed: dict[int, bool] = {}
        self.log: list[tuple] = []  # (rank, manager step, participants, healed, committed) per managed outer step

    def _rank_stats(self) -> dict[str, int]:
        return self._stats.setdefault(self.mesh.rank, {"inner_steps": 0, "outer_steps": 0, "replica_bytes": 0})

    def init(self, shards) -> SemiSyncState:
        """The state for `shards` (this rank's, from `step.shard_params`; the same on every replica)."""
        anchor = _tree.tree_map(lambda x: x.detach().clone(), shards)
        return SemiSyncState(self.inner.init(shards), self.outer.init(anchor), anchor, 0)

    def __call__(self, shards, state: SemiSyncState, batch):
        shards, inner_state, loss = self._train(shards, state.inner, batch)
        stats = self._rank_stats()
        stats["inner_steps"] += 1
        count = state.count + 1
        state = state._replace(inner=inner_state, count=count)
        if count % self.sync_every == 0:
            if self.replicas is not None:
                return (*self._managed_outer_step(shards, state, stats), loss)
            shards, state = self._outer_step(shards, state, stats)
        return shards, state, loss

    # [Note: replicas through torchft] With `replicas=` a torchft `Manager` (one per rank,
    # its process group joining the ranks of the same shard index across replicas), the
    # replicas are not mesh axes: each replica is its own mesh, and the outer step asks the
    # Manager for a quorum (live replicas agree on membership; a replica behind the others is
    # healed there from a peer's state, through `state_dict` / `load_state_dict`, which the
    # caller registers with the Manager), all-reduces the delta through it (the sum over the
    # replicas that take part in this step, divided by their number: the sum rule when a
    # replica drops; a replica healed at this quorum takes part with its peer's state, so
    # it adds that peer's delta once more and the mean is unchanged), and applies the outer
    # step only if the Manager commits; else the replica restarts from the anchor.
    def state_dict(self, rank: int | None = None) -> dict:
        """Rank `rank`'s (default: this rank's) shards and state at its latest outer step,
        for torchft's `Manager(state_dict=...)` (torchft calls it from a thread of its own:
        bind the rank, e.g. `lambda: train.state_dict(rank)`)."""
        shards, state = self._current[self.mesh.rank if rank is None else rank]
        return {"shards": shards, "inner": state.inner, "outer": state.outer, "anchor": state.anchor,
                "count": state.count}

    def load_state_dict(self, sd: dict, rank: int | None = None) -> None:
        """Replace rank `rank`'s (default: this rank's) shards and state: torchft's healing."""
        rank = self.mesh.rank if rank is None else rank
        self._current[rank] = (sd["shards"], SemiSyncState(sd["inner"], sd["outer"], sd["anchor"], sd["count"]))
        self._healed[rank] = True

    @torch.no_grad()
    def _managed_outer_step(self, shards, state: SemiSyncState, stats):
        manager, rank = self.replicas, self.mesh.rank
        self._current[rank] = (shards, state)
        self._healed[rank] = False
        manager.start_quorum()  # synchronous quorum: heals this replica here if it is behind
        shards, state = self._current[rank]
        paths, leaves, treedef = _tree.flatten_with_paths(shards)
        anchor = _tree.flatten(state.anchor)[0]
        deltas = [a - x for a, x in zip(anchor, leaves)]
        dtype = functools.reduce(torch.promote_types, (d.dtype for d in deltas))
        flat = torch.cat([d.reshape(-1).to(dtype) for d in deltas])
        stats["replica_bytes"] += flat.numel() * flat.element_size()
        manager.allreduce(flat).wait()  # the mean over the participating replicas, in place
        participants = manager.num_participants()
        if not manager.should_commit():
            self.log.append((rank, manager.current_step(), participants, self._healed[rank], False))
            return _tree.tree_map(lambda x: x.clone(), state.anchor), state
        self.log.append((rank, manager.current_step() - 1, participants, self._healed[rank], True))
        out, start = [], 0
        for d in deltas:
            out.append(flat[start:start + d.numel()].reshape(d.shape).to(d.dtype))
            start += d.numel()
        updates, outer_state = self.outer.update(_tree.unflatten(treedef, out), state.outer, state.anchor)
        new = apply_updates(state.anchor, updates)
        stats["outer_steps"] += 1
        anchor = _tree.tree_map(lambda x: x.detach().clone(), new)
        return new, state._replace(outer=outer_state, anchor=anchor)

    @torch.no_grad()
    def _outer_step(self, shards, state: SemiSyncState, stats):
        paths, leaves, treedef = _tree.flatten_with_paths(shards)
        anchor = _tree.flatten(state.anchor)[0]
        delta = self._mean_over_replicas([a - x for a, x in zip(anchor, leaves)], stats)
        updates, outer_state = self.outer.update(_tree.unflatten(treedef, delta), state.outer, state.anchor)
        new = apply_updates(state.anchor, updates)
        stats["outer_steps"] += 1
        anchor = _tree.tree_map(lambda x: x.detach().clone(), new)
        return new, state._replace(outer=outer_state, anchor=anchor)

    def _mean_over_replicas(self, deltas: list[torch.Tensor], stats) -> list[torch.Tensor]:
        group = self.mesh.group(self.replica_axes)
        if group.size == 1:
            return deltas
        dtype = functools.reduce(torch.promote_types, (d.dtype for d in deltas))
        flat = torch.cat([d.reshape(-1).to(dtype) for d in deltas])  # (n,) this replica's delta shard
        if self.wire is None:
            stats["replica_bytes"] += flat.numel() * flat.element_size()
            mean = ops.all_reduce(group, flat) / group.size
        else:
            row = encode(flat, self.wire, what=f"{self.name}: the outer delta")  # (nbytes,) uint8
            rows = ops.all_gather(group, row).reshape(group.size, -1)  # (R, nbytes)
            stats["replica_bytes"] += rows.numel()
            assert rows.shape[1] == nbytes(flat.numel(), self.wire, dtype)
            mean = decode(rows, self.wire, flat.numel(), dtype).sum(0) / group.size  # (n,)
        out, start = [], 0
        for d in deltas:
            out.append(mean[start:start + d.numel()].reshape(d.shape).to(d.dtype))
            start += d.numel()
        return out

    def stats(self) -> dict[str, int]:
        """This rank's counts so far: `inner_steps`, `outer_steps`, `replica_bytes` (the bytes
        handed to collectives across replicas: the all-reduced delta, or the all-gathered
        encoded rows with `wire`), and `replica_bytes_per_inner_step` (rounded down)."""
        s = dict(self._rank_stats())
        s["replica_bytes_per_inner_step"] = s["replica_bytes"] // max(s["inner_steps"], 1)
        return s


def diloco(step, inner, *, sync_every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
           outer=None, replica_axes="replica", wire=None, replicas=None) -> SemiSync:
    """DiLoCo (Douillard et al. 2023): each replica takes `sync_every` inner optimizer steps
    on its own, then an outer Nesterov SGD step on the replicas' mean parameter delta.

    Args:
      step: the inner `sf.shard` step; its `data_axes` must leave out `replica_axes` (e.g.
        `sf.shard(loss_fn, mesh, data_axes="shard")` on `{"replica": R, "shard": S}`).
      inner: the inner optimizer (e.g. `sf.optim.adamw(4e-4)`).
      sync_every: H, inner steps per outer step.
      outer_lr: the outer `sf.optim.sgd(outer_lr, outer_momentum, nesterov=True)`'s learning rate.
      outer_momentum: its momentum (0: no momentum, plain SGD).
      outer: another outer optimizer instead (an `sf.optim` transformation).
      replica_axes: the mesh axes across which replicas differ.
      wire: None (the delta all-reduced in its dtype) or a wire format (torch.bfloat16,
        "int8", a float8 dtype): each replica's delta encoded, all-gathered and decoded.
      replicas: a torchft `Manager` (this rank's) instead of mesh axes: each replica is its
        own mesh, and the replicas agree on membership, heal and average through it
        ([Note: replicas through torchft]; register `train.state_dict` /
        `train.load_state_dict` with the Manager).

    Returns:
      A `SemiSync`: `state = train.init(shards)`; `shards, state, loss = train(shards, state,
      batch)` on every rank; `train.stats()`. See [Note: semi-synchronous replicas].

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"replica": 2, "shard": 2})
      >>> step = sf.shard(lambda p, x: (x @ p["w"]).square().mean(), mesh, data_axes="shard")
      >>> train = sf.diloco(step, sf.optim.adamw(1e-2), sync_every=4)
      >>> def run():
      ...     shards = step.shard_params({"w": torch.ones(4, 2)})
      ...     state = train.init(shards)
      ...     for _ in range(8):
      ...         shards, state, loss = train(shards, state, torch.randn(3, 4))
      ...     return train.stats()["outer_steps"]
      >>> mesh.run(run)
      [2, 2, 2, 2]
    """
    outer = outer if outer is not None else sgd(outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    return SemiSync(step, inner, outer, sync_every=sync_every, replica_axes=replica_axes, wire=wire, name="diloco",
                    replicas=replicas)


def local_sgd(step, inner, *, sync_every: int, replica_axes="replica", wire=None, replicas=None) -> SemiSync:
    """LocalSGD: each replica takes `sync_every` inner optimizer steps on its own, then the
    replicas' parameters are averaged (DiLoCo's outer step with SGD at learning rate 1, no
    momentum: `anchor - mean(anchor - shards)`). Arguments as `diloco`'s."""
    return SemiSync(step, inner, sgd(1.0), sync_every=sync_every, replica_axes=replica_axes, wire=wire,
                    name="local_sgd", replicas=replicas)
