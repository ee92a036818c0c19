"""The params view as `shard` uses it.

The view itself, `together` and `materialize` are the generic params-view protocol in
`shardfn/_params_view.py` (below `_fsdp/`, so that `sf.functional`, `sf.remat` and
`sf.pipeline` use them without importing `shard`). This module holds the `shard`-side
pieces: the protocol's producer half (`make_view`, `current_scope`) that step.py and
runtime.py drive, and `stacked`, which tells an ensemble of shards under `vmap` apart.
"""

from __future__ import annotations

import torch

from .._params_view import current_scope, make_view
from .._functorch import is_batched

__all__ = ["make_view", "current_scope", "stacked"]


def stacked(t: torch.Tensor) -> bool:
    """Whether `t` is batched by a vmap (an ensemble of shards, [Note: stacked shards]; a
    vmapped batch, whose leading dim is then not the batch size)."""
    return is_batched(t)
