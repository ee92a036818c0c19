"""The unit schedule of the traced step, as one pass over the captured graph.

[Note: the schedule is a graph pass]
The traced step is one graph: forward, backward (traced by AOTAutograd from the
`torch.autograd.grad` call dynamo records), reduce-scatters and optimizer. Two parts of
the eager schedule are not dataflow, so they are written into the graph by this pass:

- **gather just in time**: each unit's all-gather, the pack that feeds it and the
  copy-out views of its gathered buffer move to just before the first op that reads it,
  so the forward holds one unit's full parameters at a time (plus the root unit's), as
  the eager schedule does with `prefetch=0`;
- **reshard after forward = re-gather in the backward**: the backward ops that read a
  non-root unit's full parameters (the saved weights of its matmuls) are pointed at a
  second all-gather of the same shard buffer, inserted just before the first of them;
  the forward's gathered buffer then dies after its last forward use. This is
  SimpleFSDP's selective recompute of the all-gather (arXiv 2411.00284). A traced
  `autograd.grad` leaves one inference graph with no forward/backward partition, so
  `torch.utils.checkpoint` policies (which the partitioner applies) do not recompute
  here: measured, a `MUST_RECOMPUTE` policy on the gather left 4 all-gathers for 4 units.

Backward nodes carry `meta["autograd_backward"]` (set by AOTAutograd's tracer). What is
re-run is the pack that only feeds the all-gather (pad, cat, cast of the shard leaves:
left alone, the 16 packed buffers of a 16-unit model lived from the start of the graph to
their backward re-gather, +2 MB over eager on the 16 x 1 MiB MLP), the all-gather, its wait
and the ops that read only the gathered buffer (the unpack: narrow, reshape, view):
nothing that reads an activation is recomputed.
Forward all-gathers are matched to units by their order in the traced graph, which is
the order the step issued them; if the count differs the pass changes nothing and says
so in its record (`TrafficRecord.rescheduled` is False), and the tests check it.

The pass also counts the graph's collectives and bytes (`TrafficRecord`), so
`stats()` reports what the compiled graph sends, not what Python intended.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.fx

__all__ = ["TrafficRecord", "schedule_units", "SchedulePass"]

_C = torch.ops._c10d_functional


@dataclasses.dataclass
class TrafficRecord:
    """What the last compiled graph communicates per call (bytes as `stats()` counts them:
    the all-gather's output, the reduce-scatter's input, the all-reduce's tensor)."""

    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_bytes: int = 0
    num_collectives: int = 0
    backward_gathers: int = 0  # re-gathers inserted for reshard-after-forward
    rescheduled: bool = False  # the pass matched every forward all-gather to its unit
    graphs: int = 0  # graphs the pass has seen (one per compile)

    def stats(self) -> dict[str, int]:
        return {"all_gather_bytes": self.all_gather_bytes, "reduce_scatter_bytes": self.reduce_scatter_bytes,
                "all_reduce_bytes": self.all_reduce_bytes, "num_collectives": self.num_collectives}


def _nbytes(node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _is_backward(node) -> bool:
    return bool(node.meta.get("autograd_backward"))


def _wait_of(node):
    return next((u for u in node.users if u.target is _C.wait_tensor.default), None)


def _derived(wait) -> list:
    """The forward ops that read only the gathered buffer (directly or through each other),
    in graph order."""
    chain, out = {wait}, []
    for node in wait.graph.nodes:  # graph order is a topological order
        if node in chain or node.op != "call_function" or _is_backward(node):
            continue
        inputs = node.all_input_nodes
        if inputs and all(i in chain for i in inputs):
            chain.add(node)
            out.append(node)
    return out


def _feeding(gather) -> list:
    """The forward ops that only feed this all-gather (the pack: pad, cat, cast of the
    shard leaves), in graph order: moved and re-run with it, so the packed buffer lives no
    longer than the gather."""
    order = {n: i for i, n in enumerate(gather.graph.nodes)}
    accepted = {gather}
    stack = [n for n in gather.all_input_nodes]
    while stack:
        node = max(stack, key=order.__getitem__)  # users before their inputs
        stack.remove(node)
        if node in accepted or node.op != "call_function" or _is_backward(node):
            continue
        if all(u in accepted for u in node.users):
            accepted.add(node)
            stack.extend(i for i in node.all_input_nodes if i not in accepted and i not in stack)
    accepted.discard(gather)
    return sorted(accepted, key=order.__getitem__)


def _copy_before(anchor, nodes: list, env: dict) -> None:
    graph = anchor.graph
    with graph.inserting_before(anchor):
        for node in nodes:
            new = graph.node_copy(node, lambda n: env.get(n, n))
            new.meta = dict(node.meta)
            env[node] = new


def schedule_units(graph: torch.fx.Graph, reshard: tuple[bool, ...], record: TrafficRecord) -> None:
    """[Note: the schedule is a graph pass] `reshard[i]`: re-gather the i-th unit issued
    in the backward."""
    gathers = [n for n in graph.nodes if n.target is _C.all_gather_into_tensor.default and not _is_backward(n)]
    record.graphs += 1
    record.rescheduled = len(gathers) == len(reshard) and all(_wait_of(g) is not None for g in gathers)
    record.backward_gathers = 0
    if record.rescheduled:
        for gather, again in zip(gathers, reshard):
            wait = _wait_of(gather)
            derived = _derived(wait)
            group = _feeding(gather) + [gather, wait] + derived
            members = set(group)
            # gather just in time: before the first op outside the group that reads it
            order = {n: i for i, n in enumerate(graph.nodes)}
            readers = [u for n in group for u in n.users if u not in members]
            if readers:
                first = min(readers, key=order.__getitem__)
                for node in group:
                    first.prepend(node)
            if not again:
                continue
            order = {n: i for i, n in enumerate(graph.nodes)}
            late = [u for n in [wait] + derived for u in n.users if u not in members and _is_backward(u)]
            if not late:
                continue
            anchor = min(late, key=order.__getitem__)
            env: dict = {}
            _copy_before(anchor, group, env)
            for user in set(late):
                for old, new in env.items():
                    if old in user.all_input_nodes:
                        user.replace_input_with(old, new)
            record.backward_gathers += 1
        graph.eliminate_dead_code()  # copies no backward op reads
    _count(graph, record)


def _count(graph, record: TrafficRecord) -> None:
    record.all_gather_bytes = record.reduce_scatter_bytes = record.all_reduce_bytes = record.num_collectives = 0
    for node in graph.nodes:
        if node.target is _C.all_gather_into_tensor.default:
            record.all_gather_bytes += _nbytes(node)
        elif node.target is _C.reduce_scatter_tensor.default:
            record.reduce_scatter_bytes += _nbytes(node.args[0])
        elif node.target is _C.all_reduce.default:
            record.all_reduce_bytes += _nbytes(node.args[0])
        else:
            continue
        record.num_collectives += 1


class SchedulePass:
    """The pass as inductor's `post_grad_custom_pre_pass` (a `CustomGraphPass`: its uuid
    keys inductor's cache by the unit flags)."""

    def __new__(cls, reshard, record):
        from torch._inductor.custom_graph_pass import CustomGraphPass

        class _Pass(CustomGraphPass):
            def __call__(self, graph):
                schedule_units(graph, reshard, record)

            def uuid(self):
                return hashlib.sha256(repr(("shardfn-traced-schedule-1", reshard)).encode()).digest()

        return _Pass()
