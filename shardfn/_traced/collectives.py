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
import torch.fx

from .._backend.ops import exchanges_reduce_scatter

__all__ = ["GatherFlat", "all_reduce_sum", "exchange_pairs"]


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


def _exchange_rank(name: str) -> int | None:
    """This rank's index in group `name` when its reduce-scatters are exchanges (a gloo group
    of two ranks: [Note: gloo's reduce-scatter] in `_backend/ops.py`), else None."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(name)
    return dist.get_rank(pg) if exchanges_reduce_scatter(pg) else None


def exchange_pairs(graph: torch.fx.Graph) -> int:
    """[Note: gloo's reduce-scatter] in the graph: each 1-D `reduce_scatter_tensor` over a
    gloo group of two ranks becomes the exchange the eager runtime uses, an
    `all_to_all_single` that sends the other rank its block (none to itself) and receives
    the other's block, then the sum with this rank's own block. The same bytes leave the
    rank and the sum is gloo's bit for bit (a + b == b + a); gloo's op took longer than an
    all-reduce of the same buffer. Run after the schedule pass has placed and counted the
    reduce-scatters: the all-to-all stands where the reduce-scatter stood, its wait where
    the wait stood. Returns the number rewritten. The graph is rank-specific after it."""
    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    count = 0
    for node in list(graph.nodes):
        if node.target is not c10d.reduce_scatter_tensor.default:
            continue
        x, op, k, name = node.args
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        wait = next((u for u in node.users if u.target is c10d.wait_tensor.default), None)
        if op != "sum" or k != 2 or wait is None or val is None or val.dim() != 1 or len(node.users) != 1:
            continue
        me = _exchange_rank(name)
        if me is None:
            continue
        block = val.shape[0] // 2
        splits = [0 if j == me else block for j in range(2)]
        with graph.inserting_before(node):
            other = graph.call_function(aten.slice.Tensor, (x, 0, (1 - me) * block, (2 - me) * block))
            sent = graph.call_function(c10d.all_to_all_single.default, (other, splits, splits, name))
        with graph.inserting_before(wait):
            received = graph.call_function(c10d.wait_tensor.default, (sent,))
            own = graph.call_function(aten.slice.Tensor, (x, 0, me * block, (me + 1) * block))
            total = graph.call_function(aten.add.Tensor, (received, own))
        for new, like in ((other, node), (sent, node), (received, wait), (own, wait), (total, wait)):
            new.meta = dict(like.meta)
        wait.replace_all_uses_with(total)
        graph.erase_node(wait)
        graph.erase_node(node)
        count += 1
    return count
