"""Descriptions of parameter trees (`Param` leaves) and drawing their values, whole or in part.

[Note: N-independent random streams]
A leaf's global value is cut into fixed row blocks along dim 0 (`rows_per_block(shape)`
rows, about `ROW_BLOCK_NUMEL` elements; a block depends on the leaf's shape only), and
block j draws from its own `torch.Generator` seeded with a hash of (seed, the leaf's key
path, j). A rank that holds rows [a, b) (and, with tensor parallelism, a column range)
draws the blocks that overlap them, one at a time, and keeps its part: its values are
those of the full tree whatever the world size, the layout or the device, and it never
holds more than its shard plus one block. Values are drawn on the CPU (the same on every
device) and then copied to the mesh's device. The key path is part of the seed: renaming
a leaf changes its values, reordering the tree does not.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Sequence

import torch

from .. import _tree
from .._errors import ShardingError, bullet_list
from .initializers import Initializer, Param

__all__ = ["Param", "describe", "sample", "materialize", "rows_per_block", "block_seed", "ROW_BLOCK_NUMEL"]

ROW_BLOCK_NUMEL = 1 << 16  # elements per random block (at least one row): [Note: N-independent random streams]


def describe(init_fn) -> tuple[list, list[Param], Any]:
    """`(paths, params, treedef)` of a description (or of `init_fn()` run under
    `torch.device("meta")`), every leaf checked; ShardingError listing the bad ones."""
    if isinstance(init_fn, torch.nn.Module):
        raise ShardingError(
            f"sf.init: got the module {type(init_fn).__name__} itself as the description; fix: pass "
            f"sf.init.from_module(module) (or lambda: sf.init.from_module({type(init_fn).__name__}(...)), "
            f"which builds it on the meta device)"
        )
    if callable(init_fn) and not isinstance(init_fn, Initializer):
        with torch.device("meta"):
            tree = init_fn()
    else:
        tree = init_fn
    paths, leaves, treedef = _tree.flatten_with_paths(tree)
    problems = [p for p in (_leaf_problem(path, leaf) for path, leaf in zip(paths, leaves)) if p]
    if problems:
        raise ShardingError("sf.init: every leaf of the description must be an sf.init.Param:\n"
                            + bullet_list(problems))
    if not leaves:
        raise ShardingError("sf.init: the description has no leaves (an empty tree); return a tree of sf.init.Param")
    return list(paths), list(leaves), treedef


def _leaf_problem(path, leaf) -> str | None:
    where = f"params{_tree.keystr(path)}"
    if isinstance(leaf, torch.Tensor):
        kind = "a meta tensor" if leaf.device.type == "meta" else f"a tensor on {leaf.device}"
        return (f"{where} is {kind} of shape {tuple(leaf.shape)} without an initializer; fix: describe it as "
                f"sf.init.Param({tuple(leaf.shape)}, sf.init.normal(std=0.02), {leaf.dtype}) (or any "
                f"initializer), or build the tree with sf.init.from_module(module)")
    if isinstance(leaf, Initializer):
        return (f"{where} is an initializer ({leaf!r}) without a shape; fix: call it with the shape, e.g. "
                f"{leaf!r}((4096, 1024)), or wrap it: sf.init.Param(shape, init)")
    if not isinstance(leaf, Param):
        return (f"{where} is a {type(leaf).__name__}, not an sf.init.Param; fix: describe it as "
                f"sf.init.Param(shape, initializer, dtype), e.g. sf.init.zeros()((1024,))")
    if not isinstance(leaf.init, Initializer):
        return (f"{where} (shape {leaf.shape}) has init={leaf.init!r}, not an sf.init initializer; fix: e.g. "
                f"sf.init.normal(std=0.02) (note the call: sf.init.zeros() not sf.init.zeros)")
    if not all(isinstance(d, int) and d >= 0 for d in leaf.shape):
        return f"{where} has shape {leaf.shape!r}; fix: a tuple of non-negative ints"
    if not isinstance(leaf.dtype, torch.dtype):
        return f"{where} has dtype {leaf.dtype!r}; fix: a torch.dtype, e.g. torch.float32"
    if leaf.init.random and not leaf.dtype.is_floating_point:
        return (f"{where} (shape {leaf.shape}, dtype {leaf.dtype}) has the random initializer {leaf.init!r}, "
                f"which needs a floating dtype; fix: make it floating (dtype=torch.float32), or use "
                f"sf.init.zeros() / ones() / constant(v) for integer or boolean leaves")
    return None


# -- sampling ----------------------------------------------------------------------------------


def rows_per_block(shape: tuple[int, ...]) -> int:
    """Rows of a leaf of `shape` per random block (a function of the shape only)."""
    row = math.prod(shape[1:]) if shape else 1
    return max(1, ROW_BLOCK_NUMEL // max(row, 1))


def block_seed(seed: int, path: tuple, block: int) -> int:
    """The generator seed of row block `block` of the leaf at `path` (63 bits)."""
    text = f"{seed}|{_tree.keystr(path)}|{block}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def sample(param: Param, path: tuple, seed: int, bounds: Sequence[tuple[int, int]] | None = None,
           device=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The part `bounds` (one `(start, stop)` per dim; default: all) of the leaf's global
    value, on `device` (written into `out` when given: that part's shape and the leaf's
    dtype). [Note: N-independent random streams]"""
    shape = tuple(param.shape)
    full = shape if shape else (1,)  # a 0-dim leaf is one row of one element
    bounds = [(0, n) for n in full] if bounds is None or not shape else [tuple(b) for b in bounds]
    if out is None:
        out = torch.empty(tuple(b - a for a, b in bounds), dtype=param.dtype, device=device)
    elif not shape:
        out = out.view(1)
    (a, b), rest = bounds[0], bounds[1:]
    if out.numel():
        # Random blocks are drawn in float32 (float64 for float64 leaves), then cast.
        dtype = param.dtype
        if param.init.random and dtype != torch.float64:
            dtype = torch.float32
        per = rows_per_block(full)
        for block in range(a // per, (b - 1) // per + 1):
            start, stop = block * per, min((block + 1) * per, full[0])
            gen = torch.Generator().manual_seed(block_seed(seed, path, block)) if param.init.random else None
            rows = param.init.rows(full, dtype, start, stop, gen)
            lo, hi = max(a, start), min(b, stop)
            piece = rows[lo - start: hi - start]
            for dim, (s, e) in enumerate(rest, 1):
                piece = piece.narrow(dim, s, e - s)
            out[lo - a: hi - a].copy_(piece)
            del rows, piece
    return out if shape else out.reshape(())


def materialize(init_fn, seed: int, *, device=None):
    """The whole parameter tree of a description, in this process.

    Args:
      init_fn: a description (a pytree of `sf.init.Param`) or a function returning one
        (run under `torch.device("meta")`, so modules it builds hold no memory).
      seed: an int; the same seed gives the same tree as `step.init_shards(init_fn, seed)`
        unsharded, at any world size.
      device: where the leaves go (default: the CPU; values are drawn on the CPU).

    Returns:
      The tree of the description with a tensor per leaf.

    Example:
      >>> import shardfn as sf, torch
      >>> desc = {"w": sf.init.normal(std=0.02)((4, 3)), "b": sf.init.zeros()((3,))}
      >>> params = sf.init.materialize(desc, seed=0)
      >>> tuple(params["w"].shape), params["b"].tolist()
      ((4, 3), [0.0, 0.0, 0.0])
      >>> torch.equal(params["w"], sf.init.materialize(desc, seed=0)["w"])
      True
    """
    _check_seed(seed, "sf.init.materialize")
    paths, params, treedef = describe(init_fn)
    return _tree.unflatten(treedef, [sample(p, path, seed, device=device) for path, p in zip(paths, params)])


def _check_seed(seed, who: str) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ShardingError(f"{who}: seed must be an int, got {type(seed).__name__} {seed!r:.40}")
