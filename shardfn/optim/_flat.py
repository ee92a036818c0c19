"""Flat-list plumbing shared by the optimizer transforms.

Every transform flattens its pytrees once at its boundary (with the package's
``shardfn._tree`` helpers), works on flat lists of tensors with ``torch._foreach_*``
ops, and unflattens on the way out. This module holds what the optimizers add to that
boundary: flattening against a reference structure (with errors that name the first
differing key path), the step counter, and guards for the corner cases of the foreach ops.

[Note: in-place mode]
A transform built with ``inplace=True`` owns the buffers it is given: it updates its
state tensors in place and writes its output into the incoming ``updates`` tensors
(the gradients are consumed), so a whole ``adamw`` step allocates nothing. Only a
gradient that cannot be written (an expanded tensor whose elements share memory, as
``torch.func.grad`` returns for ``x.sum()``) is copied first. In-place work runs under
``torch.no_grad()`` so that leaf tensors that require grad may be updated. Pure mode
(the default) never writes to its inputs and returns new tensors, which may alias
inputs that a transform leaves unchanged (e.g. leaves masked out of weight decay).
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from .. import _tree

def leaves_like(
    treedef: optree.PyTreeSpec, tree: Any, name: str, who: str, ref: str = "the updates"
) -> list[Any]:
    """Flatten ``tree`` and check that it has the structure ``treedef`` (that of ``ref``).

    Raises:
        ValueError: naming ``who``, the argument ``name`` and the first differing key path.
    """
    leaves, other = _tree.flatten(tree)
    if other != treedef:
        raise ValueError(_structure_error(treedef, other, ref, name, who))
    return leaves


def _structure_error(expected, got, ref, name, who) -> str:
    want = [a.codify("") for a in expected.accessors()]
    have = [a.codify("") for a in got.accessors()]
    first = next((i for i, (w, h) in enumerate(zip(want, have)) if w != h), None)
    if first is not None:
        where = f"{ref} have a leaf at {want[first]} where `{name}` has one at {have[first]}"
    elif len(want) > len(have):
        where = f"{ref} have a leaf at {want[len(have)]} that `{name}` lacks"
    elif len(have) > len(want):
        where = f"`{name}` has a leaf at {have[len(want)]} that {ref} lack"
    else:
        where = "same leaf paths, different container types"
    return (
        f"{who}: {ref} and `{name}` have different tree structures.\n"
        f"  - {where}\n"
        f"  - {ref.replace('the ', '')}: {expected}\n"
        f"  - {name}: {got}\n"
        "  Fix: pass gradients with the structure of the params given to init, and the "
        "state that this optimizer's init/update returned."
    )


def require_params(params: Any, who: str) -> None:
    if params is None:
        raise ValueError(
            f"{who}: needs the current parameters; call update(grads, state, params)."
        )


def writable(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Return ``leaves`` with any tensor whose elements share memory replaced by a copy.

    In-place mode writes its output into the gradient buffers (see
    [Note: in-place mode]); an expanded gradient (stride 0) cannot be written, so only
    those are copied.
    """
    out = leaves
    for i, t in enumerate(leaves):
        if torch._debug_has_internal_overlap(t) != 0:
            if out is leaves:
                out = list(leaves)
            out[i] = t.clone()
    return out


def zeros_like(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """One zero buffer per leaf, shaped (and strided) like it: state of a shard is a shard."""
    return [torch.zeros_like(t, memory_format=torch.preserve_format) for t in leaves]


# -- step counter --------------------------------------------------------------------
# Counts live on the CPU as 0-dim int64 tensors, like torch.optim's non-capturable
# "step": reading them (for bias corrections and schedules) never syncs an accelerator,
# and they checkpoint like any other state tensor.


def new_count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def read_count(count: Any) -> int:
    return int(count)


def bump_count(count: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, int]:
    """Return (count + 1, its value as an int); in place when ``inplace``."""
    if inplace and isinstance(count, torch.Tensor):
        count.add_(1)
        return count, int(count)
    value = int(count) + 1
    return torch.tensor(value, dtype=torch.int64), value
