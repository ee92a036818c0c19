"""Checks that every rank agrees on something (a tree's structure, shapes, dtypes).

One small all-reduce when they agree; on a disagreement, every rank's description is
exchanged so the error can name the first differing entry and the ranks on each side
(see _backend/exchange.py's [Note: agree by digest]).
"""

from __future__ import annotations

from ._backend import exchange
from ._errors import ShardingError

__all__ = ["check_same_everywhere"]


def check_same_everywhere(group, lines: list[str], what: str, fix: str) -> None:
    """Raise ShardingError on every rank unless all ranks of `group` passed equal `lines`.

    Args:
      lines: one description per entry (e.g. "['w']: (4, 2) torch.float32").
      what: what the lines describe, for the message ("parameter trees").
      fix: the advice line.
    """
    data = "\n".join(lines).encode()
    transport = exchange.via_ops(group)
    if exchange.same_everywhere(data, transport):
        return
    texts = [b.decode() for b in exchange.gather_bytes(data, transport)]
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
