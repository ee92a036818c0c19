"""Checks that every rank agrees on something (a tree's structure, shapes, dtypes).

One small all-reduce when they agree; on a disagreement, every rank's description is
exchanged (two all-gathers of bytes) so the error can name the first differing entry
and the ranks on each side.
"""

from __future__ import annotations

import zlib

import torch

from ._backend import ops
from ._errors import ShardingError

__all__ = ["exchange_text", "check_same_everywhere"]


def exchange_text(group, text: str) -> list[str]:
    """Every rank's `text`, in the group's logical order (works on both backends)."""
    device = group.backend.device  # NCCL groups take CUDA tensors only
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    sizes = ops.all_gather(group, torch.tensor([data.numel()], device=device))
    width = max(int(sizes.max()), 1)
    padded = torch.nn.functional.pad(data, (0, width - data.numel()))
    rows = ops.all_gather_async(group, padded).wait()
    rows, sizes = rows.cpu(), sizes.cpu()
    return [bytes(rows[i, : int(sizes[i])].tolist()).decode() for i in range(group.size)]


def check_same_everywhere(group, lines: list[str], what: str, fix: str) -> None:
    """Raise ShardingError on every rank unless all ranks of `group` passed equal `lines`.

    Args:
      lines: one description per entry (e.g. "['w']: (4, 2) torch.float32").
      what: what the lines describe, for the message ("parameter trees").
      fix: the advice line.
    """
    digest = zlib.crc32("\n".join(lines).encode())
    with ops.plain_mode():
        flags = torch.tensor([digest, -digest], dtype=torch.int64, device=group.backend.device)
        both = ops.all_reduce(group, flags, "max")
        if int(both[0]) == -int(both[1]):
            return
        texts = exchange_text(group, "\n".join(lines))
    me = group.ranks[group.index]
    for other, text in enumerate(texts):
        theirs = text.split("\n") if text else []
        if theirs == lines:
            continue
        for i in range(max(len(lines), len(theirs))):
            a = lines[i] if i < len(lines) else "<nothing>"
            b = theirs[i] if i < len(theirs) else "<nothing>"
            if a != b:
                raise ShardingError(
                    f"the ranks passed different {what}. First difference, at entry #{i}: rank {me} has "
                    f"{a}, rank {group.ranks[other]} has {b}.\nFix: {fix}"
                )
