"""Where each rank's blocks sit in the global tensors, agreed on by every rank.

[Note: agree, then act] `save` and `load` are collective: every rank calls them with its
own blocks. Each step that can fail on one rank only (a bad spec, a shape that does not
follow `torch.chunk`, a full disk) runs inside `agree`: the rank's result *or its error*
goes through one all-gather of pickled bytes, and if any rank failed every rank raises
the same error. No rank is ever left waiting in a collective that its peers skipped, on
the distributed backend as on the simulated one. Everything computed from the gathered
manifests (global shapes, the DCP plans of all ranks) is a pure function of them, so the
ranks reach the same answer without further messages.

A global shape is the sum of the distinct blocks along each sharded dim, read from the
gathered manifests; each rank's block must then be exactly its `torch.chunk` block
(`_spec.chunk_bounds`), so uneven and zero-row blocks are described exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pickle
from typing import Any, Callable, Sequence

import torch

from .._backend import exchange
from .._errors import SpecError
from .._spec import block_index, chunk_bounds, entry_axes, validate_spec
from ._errors import CheckpointError, listing
from ._keys import Leaf

__all__ = ["Entry", "Ranks", "agree", "manifest", "global_shapes", "chunk_of", "numel"]


class Ranks:
    """The ranks taking part: a mesh (this rank's view) or, with `mesh=None`, this process alone."""

    def __init__(self, mesh):
        self.mesh = mesh
        if mesh is None:
            self.rank, self.size, self.shape, self.coords = 0, 1, {}, {}
            self.device = torch.device("cpu")
        else:
            self.rank, self.size = mesh.rank, mesh.size
            self.shape, self.coords = mesh.shape, mesh.coords
            self.device = mesh.device

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order (two all-gathers: sizes, then padded bytes)."""
        if self.size == 1:
            return [data]
        group = self.mesh.group(self.mesh.axis_names)
        by_logical = exchange.gather_bytes(data, exchange.via_ops(group))
        order = sorted(range(group.size), key=lambda i: group.ranks[i])  # logical index -> global rank
        return [by_logical[i] for i in order]


def _portable(err: BaseException) -> BaseException:
    """The error itself if it pickles round-trip, else a CheckpointError carrying its text."""
    try:
        return pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any unpicklable error becomes text
        return CheckpointError(f"{type(err).__name__}: {err}")


def agree(ranks: Ranks, fn: Callable[[], Any], what: str) -> list:
    """Run `fn` on this rank; return every rank's result, or raise on all ranks if any failed.

    See [Note: agree, then act]. The rank that failed re-raises its own error; the others
    raise a copy of the lowest failing rank's error, noting where it came from.
    """
    try:
        mine = ("ok", fn())
    except Exception as err:  # noqa: BLE001 - shared with the peers, then re-raised
        if ranks.size == 1:
            raise
        own = err
        mine = ("error", _portable(err))
    else:
        own = None
    try:
        payload = pickle.dumps(mine)
    except Exception as err:  # noqa: BLE001 - a result that cannot travel is an error too
        own = CheckpointError(f"{what}: rank {ranks.rank}'s result cannot be pickled: {err!r}")
        payload = pickle.dumps(("error", own))
    replies = [pickle.loads(b) for b in ranks.all_gather_bytes(payload)]
    failed = [(r, reply[1]) for r, reply in enumerate(replies) if reply[0] == "error"]
    if failed:
        if own is not None:
            raise own
        rank, err = failed[0]
        if hasattr(err, "add_note"):
            err.add_note(f"({what} failed on rank {rank}; every rank raises this error)")
        raise err
    return [reply[1] for reply in replies]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One rank's description of one leaf, sent to every rank (the manifest)."""

    key: str
    where: str
    kind: str  # "tensor" or "object"
    shape: tuple[int, ...]  # this rank's block
    dtype: torch.dtype | None
    blocks: tuple[tuple[int, int], ...]  # per dim: (block index, number of blocks)
    axes: tuple[tuple[str, ...], ...]  # per dim: the mesh axes splitting it
    digest: str | None = None  # objects on save: a hash of the pickled value


def manifest(leaves: Sequence[Leaf], ranks: Ranks, who: str, *, digest_objects: bool) -> list[Entry]:
    """This rank's entries; validates each tensor's spec against the mesh (SpecError)."""
    out = []
    for leaf in leaves:
        value = leaf.value
        if isinstance(value, torch.Tensor):
            validate_spec(leaf.spec, value.shape, ranks.shape, f"{who}: specs for {leaf.where}")
            entries = list(leaf.spec) + [None] * (value.dim() - len(leaf.spec))
            blocks = tuple(block_index(e, ranks.coords, ranks.shape) for e in entries)
            axes = tuple(entry_axes(e) for e in entries)
            out.append(Entry(leaf.key, leaf.where, "tensor", tuple(value.shape), value.dtype, blocks, axes))
        else:
            digest = None
            if digest_objects:
                try:
                    digest = hashlib.sha1(pickle.dumps(value)).hexdigest()
                except Exception as err:  # noqa: BLE001
                    raise CheckpointError(
                        f"{who}: {leaf.where} is a {type(value).__name__} that cannot be pickled ({err}).\n"
                        f"Fix: store tensors, numbers, strings or other picklable values."
                    ) from err
            out.append(Entry(leaf.key, leaf.where, "object", (), None, (), (), digest))
    return out


def _first_difference(per_rank: list[list[Entry]], who: str) -> None:
    keys0 = [e.key for e in per_rank[0]]
    for r, entries in enumerate(per_rank[1:], start=1):
        keys = [e.key for e in entries]
        if keys == keys0:
            continue
        i = next((i for i, (a, b) in enumerate(zip(keys0, keys)) if a != b), min(len(keys0), len(keys)))
        a = f"key {keys0[i]!r}" if i < len(keys0) else "no leaf"
        b = f"key {keys[i]!r}" if i < len(keys) else "no leaf"
        raise CheckpointError(
            f"{who}: the ranks passed different trees: rank 0 has {len(keys0)} leaves, rank {r} has "
            f"{len(keys)}; first difference at leaf #{i}: rank 0 has {a}, rank {r} has {b}.\n"
            f"Fix: every rank must pass a tree of the same structure (its own blocks of the same leaves)."
        )


def global_shapes(per_rank: list[list[Entry]], who: str) -> dict[str, tuple[int, ...]]:
    """The global shape of every tensor leaf, from every rank's manifest (see the module note).

    Raises:
      CheckpointError: the ranks disagree on the keys, kinds, dtypes or ranks of the
        leaves, or on a Python value's value.
      SpecError: a rank's block is not its `torch.chunk` block of the global shape (or
        replicas of a block differ in size).
    """
    _first_difference(per_rank, who)
    shapes: dict[str, tuple[int, ...]] = {}
    problems: list[str] = []
    differ: list[str] = []
    for column in zip(*per_rank):
        first = column[0]
        if first.kind == "object":
            if len({e.digest for e in column}) > 1:
                differ.append(f"{first.where} (key {first.key!r}) is not the same Python value on every rank")
            continue
        if any(e.kind != first.kind or e.dtype != first.dtype or len(e.shape) != len(first.shape) for e in column):
            seen = sorted({f"{e.kind} {e.dtype} rank-{len(e.shape)}" for e in column})
            differ.append(f"{first.where} (key {first.key!r}): the ranks hold different kinds of leaf: {seen}")
            continue
        shape = []
        for d in range(len(first.shape)):
            count = first.blocks[d][1]
            sizes: dict[int, set[int]] = {}
            for e in column:
                sizes.setdefault(e.blocks[d][0], set()).add(e.shape[d])
            if any(len(s) > 1 for s in sizes.values()) or len(sizes) != count:
                detail = {i: sorted(s) for i, s in sorted(sizes.items())}
                problems.append(
                    f"{first.where}: dim {d} is split {count} ways over mesh axes {first.axes[d]}, but the ranks "
                    f"report block sizes {detail} (block index -> sizes); replicas of a block must agree"
                )
                break
            total = sum(next(iter(s)) for s in sizes.values())
            expected = {i: _size(chunk_bounds(total, count, i)) for i in sizes}
            actual = {i: next(iter(s)) for i, s in sizes.items()}
            if expected != actual:
                problems.append(
                    f"{first.where}: dim {d} (global size {total}, split {count} ways over mesh axes "
                    f"{first.axes[d]}) has block sizes {_by_index(actual)} but torch.chunk gives "
                    f"{_by_index(expected)}"
                )
                break
            shape.append(total)
        else:
            shapes[first.key] = tuple(shape)
    if differ:
        raise CheckpointError(
            f"{who}: the ranks disagree on leaves that are stored once:\n{listing(differ)}\n"
            f"Fix: Python values and replicated leaves must be equal on every rank; store a per-rank "
            f"value as a tensor with a leading dim of 1 and spec P(mesh.axis_names) (one row per rank)."
        )
    if problems:
        raise SpecError(
            f"{who}: the leaves are not the blocks their specs describe:\n{listing(problems)}\n"
            f"Fix: pass this rank's blocks as step.shard_params or sf.scatter make them "
            f"(torch.chunk along each sharded dim), with the same specs on every rank."
        )
    return shapes


def _size(bounds: tuple[int, int]) -> int:
    return bounds[1] - bounds[0]


def _by_index(sizes: dict[int, int]) -> str:
    return "[" + ", ".join(str(sizes[i]) for i in sorted(sizes)) + "]"


def chunk_of(entry: Entry, global_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(offsets, sizes)` of a rank's block (its manifest entry) inside the global tensor."""
    offsets = []
    for d, (index, count) in enumerate(entry.blocks):
        offsets.append(chunk_bounds(global_shape[d], count, index)[0])
    return tuple(offsets), entry.shape


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)
