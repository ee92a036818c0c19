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

[Note: the last unit]
The unit gathered last in the forward is not re-gathered: its backward starts as soon as
the forward ends (after the root's loss), so the forward's buffer is kept for it, and the
next unit's re-gather is prefetched under its backward. Re-gathering it would free and
fetch the same bytes back-to-back; the peak is the same either way (the eager schedule
re-gathers it with prefetch before the root's backward, which holds both). torchtitan sets
`reshard_after_forward=False` on the last block for the same reason. One unit's
all-gather bytes fewer per step (1 / 8 of the re-gathers of a GPT 8L).

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

[Note: overlap in the graph]
Gathering just in time leaves every transfer exposed: the rank waits on each all-gather
and reduce-scatter with nothing to do (measured on the GPT 4L, world 2: 44 ms of a
270 ms step in `wait_tensor`). So the pass also places the collectives as the eager
runtime's `prefetch` does:

- `prefetch=k` (the `shard` option, default 1): unit i's pack and all-gather are issued
  before the first compute of unit i - k, in the forward and among the backward
  re-gathers; each wait stays just before its unit's first reader (`_issue_early`);
- each reduce-scatter's wait moves to the next reduce-scatter's issue
  (`_place_reduce_scatters`; the reduce-scatter itself is issued as soon as its
  gradient exists): one unit's backward runs while the previous unit's
  gradient is on the wire, and at most two units' full gradients are alive at once.

Inductor does not keep an FX graph's order: its scheduler orders nodes by its own
heuristics (measured on the MLP: each wait right after its collective, every unit's pack
fused into one kernel at the top of the graph, every reduce-scatter's wait sunk to the
end with its full gradient alive until then). So after its pattern passes a second pass
(`pin_order`, inductor's `post_grad_custom_post_pass`) states the order as dependencies,
with `control_deps`, the mechanism inductor's own overlap scheduler uses: each
collective's issue and wait, and each non-view op of an all-gather's pack, sit between
the compute nodes (mm, bmm, attention: extern kernels inductor never fuses away) around
them in the scheduled graph. Measured (GPT 4L d256, world 2): `wait_tensor` 44 -> 14 ms
per step; the generated code keeps the order (checked in its output).
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.fx

from .._backend import graph as graph_ops
from .._fsdp.reduce import Stats
from .collectives import PACK, exchange_pairs

__all__ = ["Hpz", "TrafficRecord", "schedule_units", "SchedulePass", "order_constraints", "pin_order", "pin_pass"]

_C = torch.ops._c10d_functional
_STARTS = (_C.all_gather_into_tensor.default, _C.reduce_scatter_tensor.default, _C.all_reduce.default,
           _C.all_to_all_single.default)


def _is_compute(node) -> bool:
    """A node with a flop formula (mm, addmm, bmm, attention, ...): an extern kernel that
    inductor never fuses away, so an ordering constraint on it holds."""
    from torch.utils.flop_counter import flop_registry as registry

    return node.op == "call_function" and (node.target in registry
                                           or getattr(node.target, "overloadpacket", None) in registry)


def _is_view(node) -> bool:
    return bool(getattr(node.target, "is_view", False))


@dataclasses.dataclass
class TrafficRecord:
    """What the last compiled graph communicates per call, counted by the eager step's own
    `Stats` (`_fsdp/reduce.py`: the all-gather's output, the reduce-scatter's input, the
    all-reduce's tensor), and what the schedule pass did."""

    traffic: Stats = dataclasses.field(default_factory=Stats)
    backward_gathers: int = 0  # re-gathers inserted for reshard-after-forward
    overlapped: int = 0  # collectives with a compute node between their issue and their wait
    pinned: int = 0  # order constraints written for inductor (`pin_order`)
    rescheduled: bool = False  # the pass matched every forward all-gather to its unit
    exchanged: int = 0  # reduce-scatters run as a two-rank exchange (`exchange_pairs`)
    exchanged_gathers: int = 0  # all-gathers run as a two-rank exchange
    # per reduce-scatter, in issue order: the compute nodes after its issue (the backward it overlaps)
    compute_after_scatters: tuple[int, ...] = ()
    graphs: int = 0  # graphs the pass has seen (one per compile)

    def stats(self) -> dict[str, int]:
        """`step.stats()`'s collective keys (the graph holds no `peak_gathered_bytes` count)."""
        return {key: value for key, value in self.traffic.values.items() if key != "peak_gathered_bytes"}


def _nbytes(node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _is_backward(node) -> bool:
    return bool(node.meta.get("autograd_backward"))


def _wait_of(node):
    return next((u for u in node.users if u.target is _C.wait_tensor.default), None)


def _derived(wait) -> list:
    """The forward ops that read only the gathered buffer (directly or through each other,
    beside fresh buffers: a decode's `copy(empty, x)`), and those fresh buffers, in graph
    order: they move and are copied together."""
    chain, fresh = {wait}, set()
    for node in wait.graph.nodes:  # graph order is a topological order
        if node in chain or node.op != "call_function" or _is_backward(node):
            continue
        inputs = node.all_input_nodes
        if any(i in chain for i in inputs) and all(i in chain or _is_fresh(i) for i in inputs):
            chain.add(node)
            for i in inputs:
                _add_fresh(i, chain, fresh)
    order = {n: k for k, n in enumerate(wait.graph.nodes)}
    return sorted((chain | fresh) - {wait}, key=order.__getitem__)


# A buffer an op writes into, made from nothing. Not `arange` or `full` of positions: those
# carry values other ops read (transformers' GPT-2 reads `arange(T).unsqueeze(0)` beside the
# gathered position table), and their nodes may stand after the unit's first reader.
_ALLOCATORS = ("empty", "empty_strided", "zeros")


def _is_fresh(node, depth: int = 4) -> bool:
    """A buffer made from nothing (`_ALLOCATORS`), or a view of one: a derived op may write
    into it."""
    if node.op != "call_function" or depth == 0:
        return False
    if not node.all_input_nodes:
        return getattr(getattr(node.target, "_overloadpacket", None), "__name__", None) in _ALLOCATORS
    return _is_view(node) and all(_is_fresh(i, depth - 1) for i in node.all_input_nodes)


def _add_fresh(node, chain: set, fresh: set) -> None:
    """`node` and its inputs into `fresh` when it is a fresh buffer outside `chain`."""
    if node in chain or node in fresh or not _is_fresh(node):
        return
    fresh.add(node)
    for i in node.all_input_nodes:
        _add_fresh(i, chain, fresh)


def _feeding(gather, backward: bool = False) -> list:
    """The ops that only feed this collective, in graph order. For a forward all-gather
    (the default): the forward pack (pad, cat, cast of the shard leaves), moved and re-run
    with it, so the packed buffer lives no longer than the gather. With `backward`: the
    backward ops short of a compute node (the gradient's pack: pad, cat, cast) that feed a
    reduce-scatter."""
    order = {n: i for i, n in enumerate(gather.graph.nodes)}
    accepted = {gather}
    stack = [n for n in gather.all_input_nodes]
    while stack:
        node = max(stack, key=order.__getitem__)  # users before their inputs
        stack.remove(node)
        if node in accepted or node.op != "call_function" or _is_backward(node) != backward or (
                backward and _is_compute(node)):
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


@dataclasses.dataclass(frozen=True)
class Hpz:
    """[Note: hpZ in the graph] The backward re-gather's sub-group: `m` ranks (group
    `name`), this rank's index `mine` among them; the shard group has `k` ranks."""

    k: int
    m: int
    mine: int
    name: str


# [Note: hpZ in the graph]
# With `reshard_after_forward=<inner shard axes>` (hpZ, [Note: hpZ] in _fsdp/plan.py) the
# eager unit keeps, after its forward all-gather, the k / m rows of the gathered buffer
# its sub-group peers do not hold ((k / m, S): the rows of its own sub-group index), and
# the backward re-gathers them over the m-rank sub-group (intra-node) instead of the
# whole shard group. In the graph: right after the forward gather's wait, the kept rows
# are a copy of `gathered.view(k / m, m, S)[:, mine]` (its sub-axes are the shard axes'
# inner ones: row j = outer * m + sub); the backward re-gather all-gathers them over the
# sub-group, (m, k / m, S), and transposes them to the shard group's row order before
# the copied unpack reads them. The same bytes as eager's re-gather, over the same group.


def _node(graph, target, args, kwargs=None, backward: bool = False):
    """A new node with its fake value (the passes after this one read `meta["val"]`)."""
    node = graph.call_function(target, args, kwargs or {})
    vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    node.meta["val"] = target(*vals, **(kwargs or {}))
    if backward:
        node.meta["autograd_backward"] = True
    return node


def _hpz_regather(wait, anchor, hpz: Hpz) -> tuple[dict, list]:
    """[Note: hpZ in the graph] The kept rows after the forward `wait`, and their re-gather
    over the sub-group before `anchor`: ({wait: the re-gathered buffer}, the issue nodes)."""
    graph, aten = wait.graph, torch.ops.aten
    n = wait.meta["val"].numel()
    rows, size = hpz.k // hpz.m, n // hpz.k
    with graph.inserting_after(wait):
        grid = _node(graph, aten.view.default, (wait, [rows, hpz.m, size]))
    with graph.inserting_after(grid):
        mine = _node(graph, aten.select.int, (grid, 1, hpz.mine))
    with graph.inserting_after(mine):
        kept = _node(graph, aten.clone.default, (mine,), {"memory_format": torch.contiguous_format})
    with graph.inserting_before(anchor):
        flat = _node(graph, aten.view.default, (kept, [rows * size]), backward=True)
        gather = _node(graph, _C.all_gather_into_tensor.default, (flat, hpz.m, hpz.name), backward=True)
        got = _node(graph, _C.wait_tensor.default, (gather,), backward=True)
        blocks = _node(graph, aten.view.default, (got, [hpz.m, rows, size]), backward=True)
        ordered = _node(graph, aten.permute.default, (blocks, [1, 0, 2]), backward=True)
        copy = _node(graph, aten.clone.default, (ordered,), {"memory_format": torch.contiguous_format}, backward=True)
        full = _node(graph, aten.view.default, (copy, [n]), backward=True)
    return {wait: full}, [flat, gather]


def schedule_units(graph: torch.fx.Graph, reshard: tuple[bool, ...], record: TrafficRecord, prefetch: int = 1,
                   hpz: Hpz | None = None) -> None:
    """[Note: the schedule is a graph pass] `reshard[i]`: re-gather the i-th unit issued
    in the backward; `prefetch`: issue each unit's all-gather this many units early
    ([Note: overlap in the graph]); `hpz`: re-gather over that sub-group ([Note: hpZ in
    the graph])."""
    gathers = [n for n in _own(graph, _C.all_gather_into_tensor.default) if not _is_backward(n)]
    record.graphs += 1
    record.rescheduled = len(gathers) == len(reshard) and all(_wait_of(g) is not None for g in gathers)
    record.backward_gathers = 0
    if record.rescheduled:
        forward, backward = [], []  # (the nodes that issue a gather, the first op that reads it)
        keep = max((i for i, again in enumerate(reshard) if again), default=None)  # [Note: the last unit]
        for i, (gather, again) in enumerate(zip(gathers, reshard)):
            wait = _wait_of(gather)
            derived = _derived(wait)
            issue = _feeding(gather) + [gather]
            group = issue + [wait] + derived
            members = set(group)
            # gather just in time: before the first op outside the group that reads it
            order = {n: i for i, n in enumerate(graph.nodes)}
            readers = [u for n in group for u in n.users if u not in members]
            if not readers:
                continue
            first = min(readers, key=order.__getitem__)
            for node in group:
                first.prepend(node)
            forward.append((issue, first))
            if not again:
                continue
            order = {n: i for i, n in enumerate(graph.nodes)}
            late = [u for n in [wait] + derived for u in n.users if u not in members and _is_backward(u)]
            if not late:
                continue
            anchor = min(late, key=order.__getitem__)
            if i == keep:  # its forward buffer serves its backward; the next re-gather is prefetched under it
                backward.append(([], anchor))
                continue
            if hpz is None:
                env: dict = {}
                _copy_before(anchor, group, env)
                again_issue = [env[n] for n in issue]
            else:
                env, again_issue = _hpz_regather(wait, anchor, hpz)
                _copy_before(anchor, derived, env)
            for user in set(late):
                for old, new in env.items():
                    if old in user.all_input_nodes:
                        user.replace_input_with(old, new)
            backward.append((again_issue, anchor))
            record.backward_gathers += 1
        if prefetch:
            order = {n: i for i, n in enumerate(graph.nodes)}
            _issue_early(forward, prefetch)
            _issue_early(sorted(backward, key=lambda g: order[g[1]]), prefetch)
        _place_reduce_scatters(graph)
        graph.eliminate_dead_code()  # copies no backward op reads
    _count(graph, record)
    for gather in _own(graph, _C.all_gather_into_tensor.default):  # `pin_order` finds the packs by this
        for node in _feeding(gather):  # mark once the gathers are exchanges
            node.meta[PACK] = True
    record.exchanged, record.exchanged_gathers = exchange_pairs(graph)


def _issue_early(groups: list, prefetch: int) -> None:
    """[Note: overlap in the graph] `groups`: (issue nodes, first reader) per gather in
    execution order. Gather i (i >= 1) is issued just before the first reader of gather
    max(i - prefetch, 0), so its transfer runs under that unit's compute; its wait stays
    before its own first reader. The issue nodes read only the shard leaves (graph
    inputs), so any earlier place is legal."""
    for i in range(1, len(groups)):
        issue, _ = groups[i]
        if not issue:  # the last unit, not re-gathered
            continue
        before = groups[max(i - prefetch, 0)][1]
        order = {n: k for k, n in enumerate(before.graph.nodes)}
        if order[before] < order[issue[0]]:
            for node in issue:
                before.prepend(node)


def _views_of(wait) -> list:
    """The views of a wait's result (directly or through each other), in graph order:
    they move with it."""
    chain, out = {wait}, []
    for node in wait.graph.nodes:
        if node not in chain and node.op == "call_function" and _is_view(node) and node.args and node.args[0] in chain:
            chain.add(node)
            out.append(node)
    return out


def _own(graph: torch.fx.Graph, target) -> list:
    """The step's own `target` collectives (not loss_fn's named-axis ones), in graph order."""
    return [n for n in graph.nodes if n.target is target and not graph_ops.marked(n)]


def _scatters(graph: torch.fx.Graph) -> list:
    """The units' reduce-scatters, in graph order."""
    return _own(graph, _C.reduce_scatter_tensor.default)


def _place_reduce_scatters(graph: torch.fx.Graph) -> None:
    """[Note: overlap in the graph] Each reduce-scatter (with the pack of its gradient)
    is issued as soon as its inputs exist (the traced backward lists every gradient
    function of the gathers at the end: the autograd engine runs them last), and its
    wait (with the views of its result) moves to the next reduce-scatter's issue, or
    before its first other reader if that comes earlier: the unit's backward that follows
    runs while the gradient is on the wire, and at most two units' full gradients are
    alive at once, as in FSDP2's eager schedule."""
    scatters = _scatters(graph)
    for node in scatters:
        moving = _feeding(node, backward=True) + [node]
        members = set(moving)
        order = {n: i for i, n in enumerate(graph.nodes)}
        inputs = [i for n in moving for i in n.all_input_nodes if i not in members]
        if inputs:
            after = max(inputs, key=order.__getitem__)
            for member in moving:
                after.append(member)
                after = member
    scatters = _scatters(graph)  # in their new order
    for node, nxt in zip(scatters, scatters[1:] + [None]):
        wait = _wait_of(node)
        if wait is None:
            continue
        group = [wait] + _views_of(wait)
        members = set(group)
        order = {n: i for i, n in enumerate(graph.nodes)}
        stops = [u for n in group for u in n.users if u not in members] + ([nxt] if nxt is not None else [])
        if not stops:
            continue
        target = min(stops, key=order.__getitem__)
        for member in group:  # down from its collective, or up from where inductor's locality pass sank it
            target.prepend(member)


def _count(graph, record: TrafficRecord) -> None:
    record.traffic.reset()
    record.overlapped = 0
    in_flight: set = set()
    after: list[int] = []  # per reduce-scatter issued so far, compute nodes since
    for node in graph.nodes:
        if graph_ops.marked(node):  # loss_fn's own collective: not the step's traffic, as in eager
            continue
        if _is_compute(node):
            record.overlapped += len(in_flight)
            in_flight.clear()
            after = [n + 1 for n in after]
        elif node.target is _C.reduce_scatter_tensor.default:
            after.append(0)
        elif node.target is _C.wait_tensor.default:
            in_flight.discard(node.args[0])
        if node.target in _STARTS:
            in_flight.add(node)
        if node.target is _C.all_gather_into_tensor.default:
            record.traffic.collective("all_gather", _nbytes(node))
        elif node.target in (_C.reduce_scatter_tensor.default, _C.all_to_all_single.default):
            # an all-to-all is qgZ's reduction (counted before `exchange_pairs` adds any)
            record.traffic.collective("reduce_scatter", _nbytes(node.args[0]))
        elif node.target is _C.all_reduce.default:
            record.traffic.collective("all_reduce", _nbytes(node.args[0]))
    record.compute_after_scatters = tuple(after)


def order_constraints(graph: torch.fx.Graph) -> dict:
    """[Note: overlap in the graph] The graph's order, stated as dependencies inductor's
    scheduler keeps (it otherwise orders by its own heuristics: measured, it put every
    wait right after its collective and fused every unit's pack into one kernel at the
    top of the graph, and every reduce-scatter's wait at the end, which keeps each
    unit's full gradient alive until then). Between compute nodes (`_is_compute`), in
    the order the schedule pass left: a collective's issue and a wait before the next
    compute node, a wait after the last compute node before it, and the ops that pack an
    all-gather's input (a copy of the shard leaves) after the compute node before them,
    so a packed buffer lives no longer than in the schedule."""
    deps: dict = {}
    pending: list = []  # issues and waits since the last compute node
    last = None
    packs = {n for n in graph.nodes if n.meta.get(PACK)}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        wait = node.target is _C.wait_tensor.default
        if wait or (node in packs and not _is_view(node)):
            if last is not None:
                deps.setdefault(node, []).append(last)
        if wait or node.target in _STARTS:
            pending.append(node)
        elif _is_compute(node):
            if pending:
                deps.setdefault(node, []).extend(pending)
                pending = []
            last = node
    return deps


def pin_order(graph: torch.fx.Graph, record: TrafficRecord) -> None:
    """Write `order_constraints` into the graph as inductor's `control_deps` (the mechanism
    its own overlap scheduler uses); a torch without it keeps the graph as it is."""
    try:
        from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
        from torch.utils._ordered_set import OrderedSet
    except ImportError:
        return
    deps = order_constraints(graph)
    record.pinned = sum(len(before) for before in deps.values())
    if deps:
        preserve_node_ordering(graph, {node: OrderedSet(before) for node, before in deps.items()})


class SchedulePass:
    """The pass as inductor's `post_grad_custom_pre_pass` (a `CustomGraphPass`: its uuid
    keys inductor's cache by the unit flags)."""

    def __new__(cls, reshard, record, prefetch: int = 1, hpz: Hpz | None = None):
        from torch._inductor.custom_graph_pass import CustomGraphPass

        class _Pass(CustomGraphPass):
            def __call__(self, graph):
                schedule_units(graph, reshard, record, prefetch, hpz)

            def uuid(self):
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0  # exchange_pairs
                key = ("shardfn-traced-schedule-5", reshard, prefetch, rank, hpz)
                return hashlib.sha256(repr(key).encode()).digest()

        return _Pass()


def pin_pass(record: TrafficRecord):
    """`pin_order` as inductor's `post_grad_custom_post_pass` (after its pattern passes,
    which would not match nodes wrapped in `control_deps`)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pin(CustomGraphPass):
        def __call__(self, graph):
            pin_order(graph, record)

        def uuid(self):
            return hashlib.sha256(b"shardfn-traced-pin-1").digest()

    return _Pin()
