"""The exceptions shardfn raises, and small builders for their messages.

Every error a user can provoke through the public API is a `ShardingError` (or a
subclass), so callers can catch one class. Messages name the function, the leaf's
key path, the shape, the mesh axis and a fix.
"""

from __future__ import annotations

__all__ = [
    "ShardingError",
    "SpecError",
    "CollectiveTimeoutError",
    "RankAbortedError",
    "DesyncError",
    "NonFiniteError",
    "bullet_list",
]


class ShardingError(Exception):
    """Base class of the errors shardfn raises for bad input or a failed collective."""


class SpecError(ShardingError, ValueError):
    """A partition spec, spec tree or mesh description that does not fit its argument."""


class CollectiveTimeoutError(ShardingError, TimeoutError):
    """A collective waited longer than the mesh's timeout for its peers."""


class DesyncError(ShardingError):
    """Ranks of a group issued different collectives at the same point of the program."""


class NonFiniteError(ShardingError, FloatingPointError):
    """A loss or gradient was NaN or infinite under `shard(..., check_finite=True)`."""


class RankAbortedError(ShardingError):
    """Raised on a rank whose peer failed: the mesh is stopping every rank."""


def bullet_list(lines: list[str]) -> str:
    """Format several failures as the bulleted list our messages use."""
    return "\n".join(f"  - {line}" for line in lines)
