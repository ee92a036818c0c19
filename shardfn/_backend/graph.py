"""The collectives in a graph: what `ops` issues while torch.compile traces.

[Note: collectives in a graph]
The eager ops (`ops.py`) hand buffers to process-group methods, number them, time them
and note them in the flight recorder: Python state dynamo cannot trace. While a graph is
traced (`compiling()`: dynamo, and AOTAutograd's tracing of the joint graph), each op
instead returns the functional collective of `torch.ops._c10d_functional` on its group's
registered process-group name, waited at once:
a graph node that AOTAutograd keeps functional and inductor lowers (and may reorder). The
results are the eager op's: blocks in the group's logical order (base.py's [Note: group
order]), a new tensor, the operand untouched. `sf.jit`'s own gather and reduce-scatter
(`shardfn/_traced/collectives.py`) issue through the same functions by name.

The named-axis collectives are `torch.autograd.Function`s with a `jvp` (forward mode) and
a `vmap` rule; dynamo refuses to trace a Function that defines `jvp` (it reads `fn.jvp` and
compares it with the base class's). `@traceable` makes the class's `jvp` a descriptor that
answers the base class's during a compile session (`torch.compiler.is_compiling()`:
dynamo's own code reads it, outside any traced frame) and the rule otherwise: forward mode
is not used inside the graphs sf.jit traces (reverse mode only), and every use of the rule
outside torch.compile, torch.func.jvp included, sees it unchanged. (A twin class without
`jvp`, chosen at each call, was tried: dynamo cannot trace reading a class off a Function.)

An op without a graph form here (the async ones, ppermute, the ragged and uneven
all-to-alls), or over a group whose process group has no registered name (the simulated
mesh's), runs outside the graph (`_compile.not_traced`): under torch.compile a graph break
that runs it eagerly, as before these forms existed; inside sf.jit (`fullgraph()`) a
SpecError naming the op and the reason.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx.traceback

from .._errors import SpecError
from .base import Group, blocks_of, concat_blocks, order

__all__ = ["traceable", "compiling", "all_reduce_by_name", "all_gather_by_name", "reduce_scatter_by_name",
           "all_to_all_by_name", "TRACED", "named", "outside_reason", "outside", "fullgraph",
           "MARK", "marked"]

_c10d = torch.ops._c10d_functional


def compiling() -> bool:
    """A graph is being traced: dynamo is tracing Python, or make_fx (AOTAutograd's joint
    graph, which runs the Functions' backwards) is recording ops. Not
    `torch.compiler.is_compiling()`: that holds for the whole compile session, in which the
    eager runtime may run for real (a disabled region of a compiled block)."""
    return torch.compiler.is_dynamo_compiling() or \
        torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


class _OutsideGraphs:
    """A Function's `jvp`, seen as the base class's (none) while a graph is traced."""

    def __init__(self, rule: staticmethod):
        self.rule = rule

    def __get__(self, obj, owner=None):
        # dynamo's own code reads it (not a traced frame): the whole compile session's flag
        return torch.autograd.Function.jvp if torch.compiler.is_compiling() else self.rule.__get__(obj, owner)


def traceable(fn: type) -> type:
    """Class decorator: the Function `fn` traces into a graph; its forward-mode rule is
    hidden from dynamo there ([Note: collectives in a graph])."""
    fn.jvp = _OutsideGraphs(fn.__dict__["jvp"])
    return fn


# -- by registered group name (the traced step's own buffers) -------------------------------


def all_reduce_by_name(x: torch.Tensor, op: str, name: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), op, name))


def all_gather_by_name(x: torch.Tensor, k: int, name: str) -> torch.Tensor:
    """(k * n, ...) from (n, ...): the blocks in the process group's rank order."""
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), k, name))


def reduce_scatter_by_name(x: torch.Tensor, k: int, name: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x.contiguous(), "sum", k, name))


def all_to_all_by_name(x: torch.Tensor, splits: list[int], name: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_to_all_single(x.contiguous(), splits, splits, name))


# -- the ops on a Group, as `ops` issues them while compiling -------------------------------

# The graph nodes of the named-axis collectives (loss_fn's own) carry this in
# `node.meta["custom"]`, so that `sf.jit`'s traffic record counts only the step's traffic,
# as the eager `step.stats()` does.
MARK = "shardfn_named_axis"


def _marked():
    annotate = getattr(torch.fx.traceback, "annotate", None)  # torch >= 2.10
    return annotate({MARK: True}) if annotate is not None else contextlib.nullcontext()


def marked(node) -> bool:
    """The graph node is a named-axis collective's (loss_fn's), not the step's own."""
    return bool(node.meta.get("custom", {}).get(MARK))


def _name(group: Group) -> str:
    """The group's registered process-group name (`ops` calls a graph form only when
    `named(group)`)."""
    return group.pg.group_name


def all_reduce(group: Group, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    if group.size == 1:
        return x.clone(memory_format=torch.contiguous_format)
    with _marked():
        return all_reduce_by_name(x, op, _name(group))


def all_gather(group: Group, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    if group.size == 1:
        return x.clone()
    with _marked():
        flat = all_gather_by_name(x.reshape(-1), group.size, _name(group))
    stacked = order(group).to_logical(flat.view((group.size,) + tuple(x.shape)))
    return concat_blocks(stacked, dim) if x.dim() else stacked


def reduce_scatter(group: Group, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    if group.size == 1:
        return x.clone()
    stacked = blocks_of(x, dim, group.size)
    with _marked():
        out = reduce_scatter_by_name(order(group).to_pg(stacked).reshape(-1), group.size, _name(group))
    return out.view(stacked.shape[1:]).movedim(0, dim)


def all_to_all(group: Group, x: torch.Tensor, split_dim: int, concat_dim: int) -> torch.Tensor:
    if group.size == 1:
        return x.clone()
    blocks = blocks_of(x, split_dim, group.size)
    ranks = order(group)
    sent = ranks.to_pg(blocks)
    with _marked():
        got = all_to_all_by_name(sent.reshape(-1), [sent[0].numel()] * group.size, _name(group))
    received = ranks.to_logical(got.view(blocks.shape))  # (k, m, *rest): source-major
    return concat_blocks(received.movedim(1, split_dim + 1), concat_dim)


TRACED = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
          "all_to_all": all_to_all}


_FULLGRAPH = [False]  # set by `fullgraph()`: sf.jit is tracing its one graph


@contextlib.contextmanager
def fullgraph():
    """While sf.jit traces: an op that would run outside the graph raises its SpecError
    instead (a graph break is an error there, and dynamo's would not say which op)."""
    _FULLGRAPH[0], before = True, _FULLGRAPH[0]
    try:
        yield
    finally:
        _FULLGRAPH[0] = before


def outside(op: str, has_form: bool) -> None:
    """Called by `ops` for an op about to run outside the graph: its SpecError under `fullgraph()`."""
    if _FULLGRAPH[0]:
        raise SpecError(f"sf.jit: {outside_reason(op, has_form)} with sf.train_step(step, opt).")


def named(group: Group) -> bool:
    """The group's process group is registered with torch.distributed by a name a graph can
    hold (the distributed backend's are; the simulated mesh's are not)."""
    return bool(getattr(group.pg, "group_name", None))


def outside_reason(op: str, has_form: bool) -> str:
    """Why shardfn's `op` runs outside a graph, and the fix ([Note: collectives in a graph])."""
    if has_form:
        return (f"shardfn's {op} over a group whose process group has no registered name (the simulated mesh's) "
                f"cannot be a graph node.\nFix: run under torchrun (sf.init_mesh), or train eagerly")
    return (f"shardfn's {op} has no graph form (graph forms: {', '.join(sorted(TRACED))}).\nFix: express it with "
            f"those collectives, or train eagerly")
