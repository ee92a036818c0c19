"""The errors `sf.checkpoint` raises; all are `sf.ShardingError`s."""

from __future__ import annotations

from .._errors import ShardingError, bullet_list

__all__ = [
    "CheckpointError",
    "IncompleteCheckpointError",
    "CheckpointKeyError",
    "CheckpointShapeError",
    "CheckpointDTypeError",
    "listing",
]


class CheckpointError(ShardingError):
    """A checkpoint could not be saved or loaded (base class of the errors below)."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is not a complete checkpoint: a save was interrupted or is running."""


class CheckpointKeyError(CheckpointError):
    """The tree and the checkpoint do not hold the same keys (missing or extra key paths)."""


class CheckpointShapeError(CheckpointError, ValueError):
    """A tensor's global shape in the file differs from the one the tree and specs describe."""


class CheckpointDTypeError(CheckpointError, TypeError):
    """A tensor's dtype in the file differs from the tree's (pass `cast=True` to convert)."""


def listing(items: list[str], limit: int = 20) -> str:
    """A bulleted list of at most `limit` items, then a count of the rest."""
    shown = list(items[:limit])
    if len(items) > limit:
        shown.append(f"... and {len(items) - limit} more")
    return bullet_list(shown)
