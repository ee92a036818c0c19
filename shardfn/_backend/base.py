"""What both backends share: rank layout, axis groups, and waiting with a deadline.

[Note: group order] Process groups are created once per *subset* of mesh axes, in mesh
order, because `torch.distributed.new_group` sorts its ranks. A collective over axes in
another order (`('y', 'x')` on a mesh `{'x', 'y'}`) uses the same process group and a
permutation `Group.perm` from logical index (row-major over the requested order, as in
JAX) to the process group's rank; the ops in `ops.py` reorder blocks accordingly.

[Note: polled waits] On gloo, `Work.wait(timeout)` that expires raises "timed out" and
leaves the operation running; a later wait still completes it. So we wait in short
slices, and between slices check the mesh's abort flag (a peer rank failed) and the
deadline (a peer never arrived). `ProcessGroupGloo.abort()` does not wake a waiter, and
some gloo works cannot be polled with `is_completed()`, so slices are the one way that
works for every op. NCCL works are waited plainly: their wait only orders streams, and
NCCL's watchdog enforces the group timeout.

[Note: desync detection] With `check_collectives` on, `begin` compares each collective
with the one every peer issued as the same sequence number of that group, before it is
issued, and raises DesyncError naming both, instead of hanging in (or mixing up) the
mismatch. The simulated backend compares the ranks' recorded histories under a lock, for
free; the distributed backend all-reduces a digest of the op per collective (exchange.py's
[Note: agree by digest]), so there it is opt-in.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
import threading
import time
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from .._errors import CollectiveTimeoutError, DesyncError, RankAbortedError

__all__ = ["Group", "Order", "order", "blocks_of", "concat_blocks", "BackendBase", "axis_subsets", "group_members",
           "rank_coords", "coords_rank"]

_POLL = datetime.timedelta(milliseconds=50)
# [Note: a lost peer] When a peer process dies, gloo fails the waiting collective at once with
# a transport error naming an address, not a rank; `wait` turns it into a RankAbortedError
# that names the group's other ranks (the one, in a group of two).
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe")


def rank_coords(rank: int, mesh_shape: Mapping[str, int]) -> dict[str, int]:
    """Coordinates of a global rank; ranks are row-major over the mesh axes."""
    coords = {}
    for axis in reversed(list(mesh_shape)):
        rank, coords[axis] = divmod(rank, mesh_shape[axis])
    return {axis: coords[axis] for axis in mesh_shape}


def coords_rank(coords: Mapping[str, int], mesh_shape: Mapping[str, int]) -> int:
    """The global rank at `coords`; the inverse of `rank_coords`."""
    rank = 0
    for axis, size in mesh_shape.items():
        rank = rank * size + coords[axis]
    return rank


def axis_subsets(axis_names: Sequence[str]) -> list[tuple[str, ...]]:
    """Every non-empty subset of the mesh axes, each in mesh order."""
    return [
        combo for n in range(1, len(axis_names) + 1) for combo in itertools.combinations(axis_names, n)
    ]


def group_members(mesh_shape: Mapping[str, int], axes: Sequence[str]) -> list[list[int]]:
    """Partition of the global ranks into the groups that vary only along `axes`.

    Each group lists global ranks in logical order: row-major over `axes` as given.
    """
    others = [a for a in mesh_shape if a not in axes]
    groups = []
    for fixed in itertools.product(*(range(mesh_shape[a]) for a in others)):
        base = dict(zip(others, fixed))
        members = []
        for varying in itertools.product(*(range(mesh_shape[a]) for a in axes)):
            members.append(coords_rank({**base, **dict(zip(axes, varying))}, mesh_shape))
        groups.append(members)
    return groups


@dataclasses.dataclass(frozen=True)
class Group:
    """This rank's view of the process group over some mesh axes."""

    axes: tuple[str, ...]  # logical order, as the user named them
    pg: object  # the torch ProcessGroup (or gloo backend object) of this rank
    ranks: tuple[int, ...]  # global ranks, logical order
    index: int  # this rank's logical index in `ranks`
    perm: tuple[int, ...] | None  # logical index -> pg rank; None when they agree
    backend: "BackendBase"

    @property
    def size(self) -> int:
        return len(self.ranks)


class Order(NamedTuple):
    """A group's logical order and its process group's order, each way ([Note: group order]
    in base.py); `order(group)` is the one place that works them out."""

    pg: tuple[int, ...]  # logical index -> pg rank
    logical: tuple[int, ...]  # pg rank -> logical index
    me: int  # this rank's pg rank
    same: bool  # the two orders agree (`group.perm is None`)

    def to_logical(self, stacked: torch.Tensor) -> torch.Tensor:
        """(k, ...) blocks in pg order -> logical order (`stacked` itself when the orders agree)."""
        return stacked if self.same else stacked[torch.tensor(self.pg, device=stacked.device)]

    def to_pg(self, stacked: torch.Tensor) -> torch.Tensor:
        """(k, ...) blocks in logical order -> pg order (`stacked` itself when the orders agree)."""
        return stacked if self.same else stacked[torch.tensor(self.logical, device=stacked.device)]


def order(group: "Group") -> Order:
    if group.perm is None:
        ranks = tuple(range(group.size))
        return Order(ranks, ranks, group.index, True)
    logical = [0] * group.size
    for i, pg_rank in enumerate(group.perm):
        logical[pg_rank] = i
    return Order(group.perm, tuple(logical), group.perm[group.index], False)


def blocks_of(x: torch.Tensor, dim: int, k: int) -> torch.Tensor:
    """`x` split into `k` equal blocks along `dim`, stacked in front: (k, size / k, *other dims)."""
    moved = x.movedim(dim, 0)
    return moved.reshape((k, moved.shape[0] // k) + tuple(moved.shape[1:]))


def concat_blocks(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """(k, *block) -> the k blocks concatenated along `dim` of a block."""
    return stacked.movedim(0, dim).flatten(dim, dim + 1)


class BackendBase:
    """Rank bookkeeping, group lookup and deadline-aware waits common to both backends."""

    kind = "base"

    def __init__(self, mesh_shape: Mapping[str, int], timeout: float):
        self.mesh_shape = dict(mesh_shape)
        self.size = math.prod(self.mesh_shape.values())
        self.timeout = float(timeout)
        self.abort = threading.Event()
        self._groups: dict[tuple[int, tuple[str, ...]], Group] = {}
        # (rank, subset key) -> number of collectives issued; (rank) -> last op text.
        self._seq: dict[tuple[int, str], int] = {}
        self._last_op: dict[int, str] = {}
        self._op_at: dict[tuple[int, str], tuple[int, str]] = {}  # (rank, subset key) -> latest (seq, op)
        self.check_collectives = False  # compare every collective across ranks (see _check_same_op)

    # -- to be provided by a backend --------------------------------------------------
    def rank(self) -> int:
        raise NotImplementedError

    def _pg(self, rank: int, subset: tuple[str, ...]):
        """The process group object of `rank` for a mesh-ordered subset of axes."""
        raise NotImplementedError

    def _polled(self, work) -> bool:
        return True

    # -- shared ---------------------------------------------------------------------
    def group(self, axes: tuple[str, ...]) -> Group:
        rank = self.rank()
        cached = self._groups.get((rank, axes))
        if cached is not None:
            return cached
        subset = tuple(a for a in self.mesh_shape if a in axes)
        logical = next(m for m in group_members(self.mesh_shape, axes) if rank in m)
        pg_order = sorted(logical)  # pg ranks follow mesh order = ascending global rank
        perm = tuple(pg_order.index(r) for r in logical)
        group = Group(
            axes=axes,
            pg=self._pg(rank, subset),
            ranks=tuple(logical),
            index=logical.index(rank),
            perm=None if perm == tuple(range(len(perm))) else perm,
            backend=self,
        )
        self._groups[(rank, axes)] = group
        return group

    def begin(self, group: Group, what: str) -> int:
        """Record that this rank issues a collective on `group`; returns its sequence number."""
        rank = self.rank()
        key = (rank, ",".join(a for a in self.mesh_shape if a in group.axes))
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        self._last_op[rank] = f"{what} (collective #{seq} over {group.axes})"
        self._op_at[key] = (seq, what)
        if self.check_collectives:
            try:
                self._check_same_op(group, key[1], seq, what)
            except BaseException:
                self._seq[key] = seq - 1  # not issued: the peers that did are now out of step
                raise
        return seq

    def _check_same_op(self, group: Group, key: str, seq: int, what: str) -> None:
        """Raise DesyncError if a peer issued another collective as collective #seq of this
        group; see [Note: desync detection]."""

    def _desync(self, group: Group, seq: int, mine: str, other_rank: int, other: str) -> DesyncError:
        uneven = ""
        if mine.split("(shape=")[0] == other.split("(shape=")[0] and mine.split("dtype=")[-1] == other.split("dtype=")[-1]:
            uneven = (" If the blocks are uneven on purpose (a torch.chunk that does not divide), pad them to one "
                      "size, or exchange them with sf.ragged_all_to_all.")
        return DesyncError(
            f"collectives out of step over mesh axes {group.axes}: as collective #{seq} of that group, "
            f"rank {self.rank()} issued {mine} but rank {other_rank} issued {other}.\nFix: every rank must "
            f"issue the same collectives in the same order with the same shapes and dtypes; look for a "
            f"branch on the rank or on data that differs across ranks.{uneven}"
        )

    def wait(self, work, group: Group, what: str, seq: int) -> None:
        """Wait for `work`, honouring the abort flag and the timeout. See [Note: polled waits]."""
        if not self._polled(work):
            work.wait()
            return
        deadline = time.monotonic() + self.timeout
        while True:
            # The work first, then the abort flag: a collective that completed for every rank
            # is this rank's result even if a peer raised right after it (the peer's error then
            # reaches this rank through the program, e.g. an agreement's reply, as it should).
            try:
                work.wait(_POLL)
                return
            except RuntimeError as err:
                text = str(err).lower()
                if any(s in text for s in _PEER_LOST):
                    raise RankAbortedError(self._lost_message(group, what, seq, err)) from err
                if "timed out" not in text:
                    raise
            if self.abort.is_set():
                raise RankAbortedError(
                    f"rank {self.rank()} stopped in {what} over axes {group.axes}: another rank failed "
                    f"(its error is raised by mesh.run)."
                )
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(self._timeout_message(group, what, seq))

    def _lost_message(self, group: Group, what: str, seq: int, err: Exception) -> str:
        """A peer's connection broke mid-collective ([Note: a lost peer])."""
        peers = [r for r in group.ranks if r != self.rank()]
        who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {peers}"
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return (
            f"{what} over mesh axes {group.axes} (collective #{seq} on that group) failed on rank "
            f"{self.rank()}: the connection to {who} broke: it died or closed its process group "
            f"(the backend says: {first[:300]}).\nFix: the cause is on {who}: look at its log (an "
            f"exception, an out-of-memory kill, a signal); this rank only lost its peer."
        )

    def _timeout_message(self, group: Group, what: str, seq: int) -> str:
        missing = self._missing_ranks(group, seq)
        return (
            f"{what} over mesh axes {group.axes} (collective #{seq} on that group) waited more than "
            f"{self.timeout:g} s on rank {self.rank()}; ranks of the group {list(group.ranks)}.\n"
            f"{missing}\n"
            f"Fix: every rank of the group must issue the same collectives in the same order "
            f"(look for a rank-dependent branch or an exception on another rank); raise the mesh's "
            f"timeout (local_mesh/init_mesh timeout=...) if the work is just slow."
        )

    def _missing_ranks(self, group: Group, seq: int) -> str:
        raise NotImplementedError

    def run(self, fn: Callable, args, kwargs) -> list:
        raise NotImplementedError
