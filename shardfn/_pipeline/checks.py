"""The pipeline's input checks, each raising the same ShardingError on every rank.

[Note: every rank raises] A bad stage (a layer that changes the activation's shape or
dtype, a chunk count that does not divide) is seen on the rank that holds it; its peers
would wait for an activation that never comes. So, on the first call with a given
signature, every rank runs its part of the pipeline on meta tensors (shapes and dtypes
only), and the ranks exchange what they found (two small all-gathers); then each raises
the first problem, naming the rank it was found on. Batch-shaped problems (a batch that
M does not divide) are the same on every rank of the axis, so they raise without
communicating.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import _tree
from .._backend import exchange
from .._errors import ShardingError

__all__ = ["split_microbatches", "probe", "agree"]


def split_microbatches(batch, m: int, where: str) -> list:
    """`batch` cut into `m` microbatches along dim 0 of every tensor leaf."""
    paths, leaves, treedef = _tree.flatten_with_paths(batch)
    parts: list[list] = [[] for _ in range(m)]
    sizes = set()
    for path, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            n = x.shape[0]
            if n % m:
                raise ShardingError(
                    f"{where}: batch{_tree.keystr(path)} has {n} rows (shape {tuple(x.shape)}), which "
                    f"microbatches={m} does not divide.\nFix: a batch size that is a multiple of {m} "
                    f"(e.g. {max(m, n - n % m)}), or microbatches= a divisor of {n}."
                )
            sizes.add(n)
            for i, chunk in enumerate(x.chunk(m)):
                parts[i].append(chunk)
        else:
            for part in parts:
                part.append(x)
    if not sizes:
        raise ShardingError(f"{where}: the batch holds no tensor with a batch dim to cut into microbatches=" 
                            f"{m}.\nFix: pass the batch as a tensor or a tree of tensors of shape (B, ...).")
    return [_tree.unflatten(treedef, part) for part in parts]


def _meta(x):
    return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def probe(stage, chunks: list[int], last_chunk: bool, microbatch, first_input: Callable,
          layers_per_chunk: int) -> tuple[str, tuple | None, torch.dtype | None, torch.dtype | None]:
    """Run this rank's chunks on meta tensors.

    Returns:
      (problem or "", activation shape, activation dtype, loss dtype) — the activation is
      what `pre` (or the batch) gives the first layer; every chunk must keep it.
    """
    mb = _tree.tree_map(_meta, microbatch)
    if stage.pre is not None:
        h = stage.pre(_tree.unflatten(stage.pre_treedef, [_meta(x) for x in stage.pre_leaves]), mb)
        what = "pre(params['pre'], microbatch)"
    else:
        h = first_input(mb)
        what = "the microbatch's input (batch[0])"
    if not isinstance(h, torch.Tensor) or not h.is_floating_point():
        return (f"{what} gives {_describe(h)}; the activation between stages must be one floating-point tensor.",
                None, None, None)
    shape, dtype = tuple(h.shape), h.dtype
    for c, layers in zip(chunks, stage.chunks):
        x = torch.empty(shape, dtype=dtype, device="meta")
        for i, layer in enumerate(layers):
            y = stage.layer_fn(_tree.unflatten(stage.layer_treedef, [_meta(w) for w in layer]), x)
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != shape or y.dtype != dtype:
                return (f"layer {c * layers_per_chunk + i} (chunk {c}) maps the activation of shape {shape}, "
                        f"{dtype} to {_describe(y)}; every layer must return its input's shape and dtype, so that "
                        f"the stages pass one kind of tensor.", shape, dtype, None)
    loss_dtype = None
    if last_chunk:
        x = torch.empty(shape, dtype=dtype, device="meta")
        loss = stage.post(_tree.unflatten(stage.post_treedef, [_meta(w) for w in stage.post_leaves]), x, mb)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            return (f"post(params['post'], x, microbatch) returns {_describe(loss)}; it must return the "
                    f"microbatch's scalar loss.", shape, dtype, None)
        loss_dtype = loss.dtype
    return "", shape, dtype, loss_dtype


def agree(group, line: str) -> list[str]:
    """Every rank's `line`, in the group's order (two small all-gathers)."""
    if group.size == 1:
        return [line]
    return [b.decode() for b in exchange.gather_bytes(line.encode(), exchange.via_ops(group))]
