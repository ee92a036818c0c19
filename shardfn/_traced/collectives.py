"""Traceable collectives of the traced step: `torch.ops._c10d_functional`, by group name.

[Note: traceable collectives]
The eager runtime calls process-group methods (`ProcessGroupGloo._allgather_base`, ...)
on buffers whose storage it frees and restores; dynamo cannot trace either. The traced
step instead calls the functional collectives, which take a tensor and a registered
group *name* and return a new tensor (`all_gather_into_tensor` + `wait_tensor`): dynamo
records them as graph nodes, AOTAutograd keeps them functional, and inductor lowers them
to its own collective kernels (and may reorder or bucket them). A unit's flat shard buffer
goes through `GatherFlat`, whose transpose is the reduce-scatter (sum) of the gradient,
exactly as the eager runtime's `GatherUnit` ([Note: collectives inside torch.func] in
docs/fsdp_design.md): autograd of the traced step composes it with the differentiable
pack / unpack around it (pad + cat, narrow + reshape), so the gradient leaves the rank in
the same packed layout and the same dtypes as in eager (layout: `_fsdp/plan.py`).

`torch.distributed._functional_collectives.all_gather_tensor_autograd` would do the same
gather, but its registered backward is a reduce-scatter in the gathered dtype; ours casts
to `reduce_dtype` first (mixed precision), as the eager runtime does.
"""

from __future__ import annotations

import torch

__all__ = ["GatherFlat", "all_reduce_sum"]


def _all_gather(x: torch.Tensor, k: int, name: str) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(x, k, name))


def _reduce_scatter(x: torch.Tensor, k: int, name: str) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.reduce_scatter_tensor(x, "sum", k, name))


def all_reduce_sum(x: torch.Tensor, name: str) -> torch.Tensor:
    """The sum of `x` over the group `name` (a new tensor; no gradient flows through it)."""
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", name))


class GatherFlat(torch.autograd.Function):
    """`(S,)` shard buffer in the shards' dtype -> `(k * S,)` rank-major gathered buffer in
    `param_dtype`. Backward: the gradient cast to `reduce_dtype`, reduce-scattered (sum),
    cast back to the shards' dtype. [Note: traceable collectives]"""

    @staticmethod
    def forward(buf, k: int, name: str, param_dtype, reduce_dtype):
        return _all_gather(buf.to(param_dtype), k, name)

    @staticmethod
    def setup_context(ctx, inputs, output):
        buf, ctx.k, ctx.name, _, reduce_dtype = inputs
        ctx.dtype = buf.dtype
        ctx.reduce_dtype = reduce_dtype

    @staticmethod
    def backward(ctx, grad):
        reduced = _reduce_scatter(grad.to(ctx.reduce_dtype).contiguous(), ctx.k, ctx.name)
        return reduced.to(ctx.dtype), None, None, None, None
