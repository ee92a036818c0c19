"""Small byte strings across the ranks of a group: agree on them, or exchange them.

[Note: agree by digest] To check that every rank of a group holds the same description
(a tree's structure, the op about to be issued), each rank all-reduces(max) the pair
`[crc32, -crc32]` of its bytes: every rank then holds the max and (negated) the min of
the digests, and they agree exactly when the two are equal. That is one all-reduce of two
int64s when all is well. Only on a disagreement are the bytes themselves exchanged (two
all-gathers: the sizes, then the bytes padded to the longest), so that the error can
name what differs and on which ranks.

Both steps run over a `Transport`: `via_ops` (the counted, deadline-aware collectives of
ops.py) for checks made by the layers above, `via_pg` (the bare process group) for the
desync check that runs inside ops.py's own bookkeeping.
"""

from __future__ import annotations

import zlib
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from . import ops
from .base import Group, order

__all__ = ["Transport", "via_ops", "via_pg", "same_everywhere", "gather_bytes"]


class Transport(NamedTuple):
    """The two collectives the exchange needs, over one group, on `device`."""

    all_reduce_max: Callable[[torch.Tensor], torch.Tensor]
    all_gather: Callable[[torch.Tensor], torch.Tensor]  # 1-D blocks concatenated, logical order
    device: torch.device


def via_ops(group: Group) -> Transport:
    """Through ops.py: counted, checked for desync, waited with the mesh's deadline."""
    return Transport(
        lambda t: ops.all_reduce(group, t, "max"),
        lambda t: ops.all_gather(group, t),
        group.backend.device,  # NCCL groups take CUDA tensors only
    )


def via_pg(group: Group) -> Transport:
    """Straight on the process group: for checks that ops.py itself makes before an op."""

    def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        group.pg.allreduce([t], opts).wait()
        return t

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty((group.size,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        group.pg._allgather_base(out.view(-1), t.reshape(-1)).wait()
        return order(group).to_logical(out).reshape(-1)

    return Transport(all_reduce_max, all_gather, group.backend.device)


def same_everywhere(data: bytes, transport: Transport) -> bool:
    """Whether every rank passed the same `data` (one all-reduce; see [Note: agree by digest])."""
    digest = zlib.crc32(data)
    with ops.plain_mode():
        flags = torch.tensor([digest, -digest], dtype=torch.int64, device=transport.device)
        both = transport.all_reduce_max(flags)
    return int(both[0]) == -int(both[1])


def gather_bytes(data: bytes, transport: Transport) -> list[bytes]:
    """Every rank's `data`, in the group's logical order (two all-gathers: sizes, then bytes)."""
    device = transport.device
    with ops.plain_mode():
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        sizes = transport.all_gather(torch.tensor([mine.numel()], device=device)).cpu()
        width = max(int(sizes.max()), 1)
        padded = torch.zeros(width, dtype=torch.uint8, device=device)
        padded[: mine.numel()] = mine.to(device)
        rows = transport.all_gather(padded).reshape(len(sizes), width).cpu()
    return [rows[i, : int(sizes[i])].numpy().tobytes() for i in range(len(sizes))]
