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

from typing import NamedTuple

import torch
import torch.fx

from .._backend import graph
from .._backend.ops import exchanges
from .._fsdp.qgz import decoded_sum
from .._quant import Wire, decode, encode

__all__ = ["GatherFlat", "Wires", "all_reduce_max", "all_reduce_sum", "exchange_pairs", "PACK"]


def all_reduce_sum(x: torch.Tensor, name: str) -> torch.Tensor:
    """The sum of `x` over the group `name` (a new tensor; no gradient flows through it)."""
    return graph.all_reduce_by_name(x, "sum", name)


def all_reduce_max(x: torch.Tensor, name: str) -> torch.Tensor:
    """The max of `x` over the group `name` (a new tensor; no gradient flows through it)."""
    return graph.all_reduce_by_name(x, "max", name)


class Wires(NamedTuple):
    """A unit's wire formats in the traced step ([Note: wire formats] in shardfn/_quant.py):
    the all-gather's (with its segments, the leaves' chunks) and the reduce-scatter's."""

    gather: Wire | None = None
    segments: tuple[int, ...] | None = None
    reduce: Wire | None = None


def _gather_encoded(buf: torch.Tensor, k: int, name: str, wires: Wires) -> torch.Tensor:
    """The eager quantized all-gather ([Note: quantized all-gather] in _fsdp/gather.py) as
    graph ops: encode the (S,) masters row, all-gather the k uint8 rows, decode each in
    the masters' dtype: (k * S,)."""
    n = buf.shape[0]
    rows = encode(buf, wires.gather, segments=wires.segments, check=False)
    got = graph.all_gather_by_name(rows, k, name).view(k, -1)
    return decode(got, wires.gather, n, buf.dtype, segments=wires.segments).reshape(-1)


def _reduce_scatter_encoded(grad: torch.Tensor, k: int, name: str, wire: Wire) -> torch.Tensor:
    """The eager qgZ reduction ([Note: qgZ] in _fsdp/qgz.py) as graph ops: encode the k rows,
    one all-to-all, then eager's `qgz.decoded_sum` of the k received rows."""
    rows = grad.view(k, -1)
    encoded = encode(rows, wire, check=False)
    splits = [encoded.shape[1]] * k
    received = graph.all_to_all_by_name(encoded.reshape(-1), splits, name).view(k, -1)
    return decoded_sum(received, wire, rows.shape[1], grad.dtype)


class GatherFlat(torch.autograd.Function):
    """`(S,)` shard buffer in the shards' dtype -> `(k * S,)` rank-major gathered buffer in
    `param_dtype`. Backward: the gradient cast to `reduce_dtype`, reduce-scattered (sum),
    then each of `regions` ((group name, start, stop) of the shard buffer: HSDP's replica
    axes, then the tensor-parallel axes a leaf is replicated over) summed over its group,
    as eager's `finish_reduce` does in that order, cast back to the shards' dtype. With `wires`, either travels
    in its wire format as the eager runtime sends it; differentiation treats the format
    as the identity (straight-through). [Note: traceable collectives]
    The backward mirrors eager's one reduce-scatter entry, `shardfn._fsdp.reduce.reduce_scatter`."""

    @staticmethod
    def forward(buf, k: int, name: str, param_dtype, reduce_dtype, regions: tuple = (), wires: Wires = Wires()):
        if wires.gather is not None:
            return _gather_encoded(buf, k, name, wires).to(param_dtype)
        return graph.all_gather_by_name(buf.to(param_dtype), k, name)

    @staticmethod
    def setup_context(ctx, inputs, output):
        buf, ctx.k, ctx.name, _, reduce_dtype, ctx.regions, ctx.wires = inputs
        ctx.dtype = buf.dtype
        ctx.reduce_dtype = reduce_dtype

    @staticmethod
    def backward(ctx, grad):
        grad = grad.to(ctx.reduce_dtype).contiguous()
        if ctx.wires.reduce is not None and ctx.k > 1:
            reduced = _reduce_scatter_encoded(grad, ctx.k, ctx.name, ctx.wires.reduce)
        else:
            reduced = graph.reduce_scatter_by_name(grad, ctx.k, ctx.name)
        for group, start, stop in ctx.regions:
            reduced = reduced.slice_scatter(all_reduce_sum(reduced[start:stop], group), 0, start, stop)
        return reduced.to(ctx.dtype), None, None, None, None, None, None


def _exchange_rank(name: str) -> int | None:
    """This rank's index in group `name` when its collectives are exchanges (a gloo group of
    two ranks: [Note: gloo's two-rank collectives] in `_backend/ops.py`), else None."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(name)
    return dist.get_rank(pg) if exchanges(pg) else None


PACK = "shardfn_pack"  # node.meta key: an op that packs an all-gather's input (pinned by `pin_order`)


def exchange_pairs(graph: torch.fx.Graph) -> tuple[int, int]:
    """[Note: gloo's two-rank collectives] in the graph: each 1-D `reduce_scatter_tensor` and
    `all_gather_into_tensor` over a gloo group of two ranks becomes the exchange the eager
    runtime uses, an `all_to_all_single` that sends the other rank a block (none to itself)
    and receives the other's block, then:
    - reduce-scatter: the sum with this rank's own block of the input. The same bytes leave
      the rank and the sum is gloo's bit for bit (a + b == b + a); gloo's op took longer than
      an all-reduce of the same buffer;
    - all-gather: the cat of this rank's input and the received block, in rank order, which
      inductor fuses into the unpack's copies; gloo's op copies the input into the output
      and took longer (measured in the Note).
    Run after the schedule pass has placed and counted the collectives: the all-to-all stands
    where the collective stood, its wait where its wait stood. Returns (reduce-scatters,
    all-gathers) rewritten. The graph is rank-specific after it."""
    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    counts = {c10d.reduce_scatter_tensor.default: 0, c10d.all_gather_into_tensor.default: 0}
    for node in list(graph.nodes):
        if node.target not in counts:
            continue
        scatter = node.target is c10d.reduce_scatter_tensor.default
        x, k, name = (node.args[0], node.args[2], node.args[3]) if scatter else node.args
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        wait = next((u for u in node.users if u.target is c10d.wait_tensor.default), None)
        if (scatter and node.args[1] != "sum") or k != 2 or wait is None or val is None or val.dim() != 1 \
                or len(node.users) != 1:
            continue
        me = _exchange_rank(name)
        if me is None:
            continue
        block = val.shape[0] // 2 if scatter else val.shape[0]
        splits = [0 if j == me else block for j in range(2)]
        with graph.inserting_before(node):
            sent = graph.call_function(aten.slice.Tensor, (x, 0, (1 - me) * block, (2 - me) * block)) if scatter else x
            exchange = graph.call_function(c10d.all_to_all_single.default, (sent, splits, splits, name))
        with graph.inserting_before(wait):
            received = graph.call_function(c10d.wait_tensor.default, (exchange,))
            if scatter:
                own = graph.call_function(aten.slice.Tensor, (x, 0, me * block, (me + 1) * block))
                result = graph.call_function(aten.add.Tensor, (received, own))
            else:
                result = graph.call_function(aten.cat.default, ([x, received] if me == 0 else [received, x],))
        for new, like in ((sent, node), (exchange, node), (received, wait), (result, wait)) + (
                ((own, wait),) if scatter else ()):
            if new is not x:
                new.meta = dict(like.meta)
        wait.replace_all_uses_with(result)
        graph.erase_node(wait)
        graph.erase_node(node)
        counts[node.target] += 1
    return counts[c10d.reduce_scatter_tensor.default], counts[c10d.all_gather_into_tensor.default]
