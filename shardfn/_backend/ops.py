"""Raw collectives on a `Group`: plain tensors in, plain tensors out, no autograd.

The single place where shardfn talks to a process group, so that waits honour the
mesh's timeout and abort flag, blocks come out in logical order (base.py's
[Note: group order]), and byte counters / desync checks have one choke point.

[Note: fallbacks] Not every backend implements every op on every torch version. When the
direct op raises "not supported"/"not implemented", the op is remembered as missing for
that backend and recomputed with a fallback built on all-reduce (all-gather: each rank
writes its block into zeros, then sums; reduce-scatter: sum, then slice; all-to-all:
all-gather, then slice; the uneven all-to-all behind ppermute, the exchange and the ragged
all-to-all: all-gather the sizes, then the chunks padded, then slice). Results are
identical; only the traffic grows. Tests force the fallbacks through `FORCE_FALLBACK`.

[Note: one way to issue] Every op below reaches its process group through `_issue`, which
numbers the collective (`begin`: desync check, timeout messages), starts it or its
fallback, and on meta operands answers at once ([Note: meta tensors]); every synchronous
op is its `_async` op waited at once; and every op maps between a group's logical order
and its process group's order through `base.order`. `_issue` also notes the collective in this
rank's flight recorder, which `Pending.wait` closes ([Note: flight recorder] in flight.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from .._compile import not_traced
from .._errors import CollectiveTimeoutError, DesyncError, RankAbortedError
from . import flight, graph
from .base import Group, blocks_of, concat_blocks, order as logical_order

__all__ = [
    "all_reduce",
    "all_reduce_async",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "ppermute",
    "ppermute_async",
    "ragged_all_to_all",
    "ragged_all_to_all_async",
    "exchange_async",
    "Pending",
    "all_gather_async",
    "reduce_scatter_async",
    "exchanges",
    "all_to_all_async",
    "FORCE_FALLBACK",
    "recording",
    "Collective",
    "meta_run",
    "in_meta_run",
    "same_memory",
    "meta_in_flight",
]

def plain_mode() -> contextlib.ExitStack:
    """Plain tensors only: no functorch lifting, no autograd recording.

    Collectives and their buffers are raw data movement; they must stay plain even when
    called inside a torch.func transform (a wrapped tensor has no storage to hand to a
    process group)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._C._DisableFuncTorch())
    stack.enter_context(torch.no_grad())
    return stack


def _plain_op(fn):
    """The op on plain tensors. While a graph is traced, its graph form ([Note: collectives
    in a graph] in graph.py) where it has one and the group has a registered name; else
    the eager op outside the graph (under torch.compile a graph break, run eagerly; inside
    sf.jit a SpecError naming it)."""
    traced = graph.TRACED.get(fn.__name__)

    def plain(*args, **kwargs):
        with plain_mode():
            return fn(*args, **kwargs)

    outside = not_traced(graph.outside_reason(fn.__name__, traced is not None))(plain)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if graph.compiling():
            if traced is not None and graph.named(args[0]):
                return traced(*args, **kwargs)
            graph.outside(fn.__name__, traced is not None)
            return outside(*args, **kwargs)
        return plain(*args, **kwargs)

    return wrapper


# [Note: meta tensors] `sf.estimate` runs a step on meta tensors (shapes and dtypes, no
# data). A collective on a meta tensor returns a meta result of the right shape at once:
# it is recorded (`recording`) like a real one, but never reaches the process group, so
# the ranks of a dry run need not even issue the same collectives at the same time. An
# async one keeps its input and output alive until it is waited, as a work object does,
# so that a dry run holds the buffers a real run holds.
_meta_run = threading.local()


@contextlib.contextmanager
def meta_run():
    """Mark this thread as running a dry run on meta tensors ([Note: meta tensors]): layers
    above may then accept meta leaves they would otherwise refuse."""
    depth = getattr(_meta_run, "depth", 0)
    _meta_run.depth = depth + 1
    try:
        yield
    finally:
        _meta_run.depth = depth


def in_meta_run() -> bool:
    return getattr(_meta_run, "depth", 0) > 0


def meta_in_flight() -> int:
    """Bytes of the meta all-gathers of this thread started and not yet waited: gloo copies
    an all-gather through a flat output buffer of its own, which a dry run counts while it
    is in flight."""
    return getattr(_meta_run, "in_flight", 0)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors start at the same memory: `data_ptr()` equality, except on meta
    tensors, whose `data_ptr()` is always 0. (Real tensors are not asked for their storage:
    a storage's Python object, once made, must be released under the GIL, which delays
    frees that gloo's threads make.)"""
    if a.is_meta or b.is_meta:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()
    return a.data_ptr() == b.data_ptr()


FORCE_FALLBACK: set[str] = set()  # op names to run through their fallback (tests)
_MISSING: set[tuple[str, str]] = set()  # (backend class name, op) found unsupported
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_recorders = threading.local()


class Collective(NamedTuple):
    """One collective as `recording` saw it: what this rank handed to the process group."""

    op: str  # "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute", "ragged_all_to_all"
    axes: tuple  # the mesh axes of the group
    nbytes: int  # the logical (unsharded, padded) buffer: all-gather's output, reduce-scatter's input
    dtype: torch.dtype


class recording:
    """Context manager: note each collective this thread hands to a process group (an op
    that short-circuits a one-rank group into a copy is not noted). `records` lists them
    as `Collective`s; a `sink`, if given, is also called as `sink(op, axes, nbytes)`.

    Example: `with ops.recording() as rec: ...` then `[c.op for c in rec.records]`.
    """

    def __init__(self, sink: Callable[[str, tuple, int], None] | None = None):
        self.sink = sink
        self.records: list[Collective] = []

    def _note(self, record: Collective) -> None:
        self.records.append(record)
        if self.sink is not None:
            self.sink(record.op, record.axes, record.nbytes)

    def __enter__(self):
        stack = getattr(_recorders, "stack", None)
        if stack is None:
            stack = _recorders.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _recorders.stack.pop()


def _note(op: str, group: Group, x: torch.Tensor) -> None:
    """Tell the recordings of this thread that `x` (the logical buffer) goes over `group`."""
    for rec in getattr(_recorders, "stack", ()):
        rec._note(Collective(op, group.axes, _nbytes(x), x.dtype))


class Pending:
    """A collective in flight; `wait()` returns its result (once)."""

    def __init__(self, work, group: Group, what: str, seq: int, finish: Callable[[], torch.Tensor],
                 entry: list | None = None):
        self._work, self._group, self._what, self._seq, self._finish = work, group, what, seq, finish
        self._entry = entry  # its flight-recorder entry ([Note: flight recorder] in flight.py)

    def wait(self) -> torch.Tensor:
        with plain_mode():
            t_wait = time.time()
            if self._work is not None:
                try:
                    self._group.backend.wait(self._work, self._group, self._what, self._seq)
                except (CollectiveTimeoutError, RankAbortedError) as err:
                    flight.failed(self._group, "timeout" if isinstance(err, CollectiveTimeoutError) else "peer failed")
                    raise
                self._work = None
            out = self._finish()
            if self._entry is not None:
                flight.done(self._entry, t_wait)
                self._entry = None
            return out

    def then(self, fn: Callable) -> "Pending":
        """This collective followed by `fn` on its result: `wait()` returns `fn(self.wait())`."""
        return Pending(None, self._group, self._what, self._seq, lambda: fn(self.wait()))


def _describe(op: str, x: torch.Tensor) -> str:
    return f"{op}(shape={tuple(x.shape)}, dtype={x.dtype})"


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _unsupported(err: Exception) -> bool:
    text = str(err).lower()
    return any(s in text for s in ("not supported", "not implemented", "unsupported"))


def _direct(group: Group, op: str) -> bool:
    return op not in FORCE_FALLBACK and (type(group.pg).__name__, op) not in _MISSING


def _issue(group: Group, op: str, what: str, direct: Callable, fallback: Callable | None, *, meta: bool = False,
           result: Callable | None = None, held: tuple = (), in_flight: int = 0) -> Pending:
    """Start one collective over `group` ([Note: one way to issue]): `direct()` hands it to the
    process group and returns `(work, finish)`; `wait()` waits for the work, then returns
    `finish()`. `what` describes it in desync and timeout messages (the same on every rank).
    Where the backend lacks the direct op (remembered under `op`; `FORCE_FALLBACK` forces
    it), `wait()` returns `fallback()` instead ([Note: fallbacks]); with no fallback the
    error is raised. On meta operands (`meta`: [Note: meta tensors]) nothing is issued:
    `wait()` returns `result()`, `held` stays alive with the Pending as a work object holds
    its buffers, and `in_flight` bytes count in `meta_in_flight` until waited."""
    if meta:
        _meta_run.in_flight = meta_in_flight() + in_flight
        done = []

        def wait():
            if not done:
                done.append(True)
                _meta_run.in_flight = meta_in_flight() - in_flight
            return result()

        pending = Pending(None, group, "", 0, wait)
        pending.held = held
        return pending
    try:
        seq = group.backend.begin(group, what)
    except DesyncError:
        flight.failed(group, "desync", op, what)
        raise
    entry = flight.record(group, op, what, seq)  # [Note: flight recorder] in flight.py
    if fallback is None or _direct(group, op):
        try:
            work, finish = direct()
            return Pending(work, group, what, seq, finish, entry)
        except RuntimeError as err:
            if fallback is None or not _unsupported(err):
                raise
            _MISSING.add((type(group.pg).__name__, op))
    return Pending(None, group, what, seq, fallback, entry)


def _all_reduce_work(group: Group, t: torch.Tensor, op: str):
    opts = dist.AllreduceOptions()
    opts.reduceOp = _REDUCE_OPS[op]
    return group.pg.allreduce([t], opts)


def _sum_now(group: Group, t: torch.Tensor, what: str) -> None:
    """Sum `t` over the group in place, inside a fallback (already numbered by `_issue`)."""
    group.backend.wait(_all_reduce_work(group, t, "sum"), group, what, 0)


@_plain_op
def all_reduce_async(group: Group, x: torch.Tensor, op: str = "sum") -> Pending:
    """Start reducing `x` over the group; `wait()` returns a new tensor (x is not modified)."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    _note("all_reduce", group, out)
    return _issue(group, "all_reduce", _describe(f"all_reduce[{op}]", out),
                  lambda: (_all_reduce_work(group, out, op), lambda: out), None, meta=out.is_meta, result=lambda: out)


@_plain_op
def all_reduce(group: Group, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce `x` over the group; returns a new tensor (x is not modified)."""
    if group.size == 1:
        return x.detach().clone(memory_format=torch.contiguous_format)
    return all_reduce_async(group, x, op).wait()


@_plain_op
def all_gather_async(group: Group, x: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
    """Start gathering equal-shaped blocks; the result stacks them: (k, *x.shape), logical order.

    `out` (contiguous, (k, *x.shape)) receives the blocks in the process group's order; the
    result is `out` itself when that order is the logical one (`group.perm is None`), else a
    reordered copy."""
    x = x.detach().contiguous()
    order = logical_order(group)
    if out is None:
        out = torch.empty((group.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    _note("all_gather", group, out)

    def finish():
        return order.to_logical(out)

    def direct():
        if exchanges(group.pg):
            return _gather_by_exchange(group, x, out), finish
        return group.pg._allgather_base(out.view(-1), x.view(-1)), finish

    def fallback():
        out.zero_()
        out[order.me] = x
        _sum_now(group, out, "all_gather fallback")
        return finish()

    # a meta run holds the buffers until waited, and gloo's flat copy of the output in flight
    return _issue(group, "all_gather", _describe("all_gather", x), direct, fallback, meta=x.is_meta, result=finish,
                  held=(x, out), in_flight=_nbytes(out))


@_plain_op
def all_gather(group: Group, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Concatenate equal-shaped blocks of all ranks along `dim`, in logical order."""
    if group.size == 1:
        return x.detach().clone()
    stacked = all_gather_async(group, x).wait()  # (k, *shape)
    return concat_blocks(stacked, dim) if x.dim() else stacked


@_plain_op
def reduce_scatter_async(group: Group, x: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
    """Start summing `x` (shape (k, *block)) over the group; result is this rank's block,
    written into `out` when given (its values are valid only after `wait()`)."""
    x = x.detach().contiguous()
    order = logical_order(group)
    if out is None:
        out = torch.empty(tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _note("reduce_scatter", group, x)
    x_pg = order.to_pg(x)

    def direct():
        if exchanges(group.pg):
            return _sum_by_exchange(group, x_pg, out)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return group.pg._reduce_scatter_base(out.view(-1), x_pg.reshape(-1), opts), lambda: out

    def fallback():
        total = x_pg.clone()
        _sum_now(group, total, "reduce_scatter fallback")
        out.copy_(total[order.me])
        return out

    # a meta run holds the buffers until waited; gloo reduces in its own buffers: not copied
    return _issue(group, "reduce_scatter", _describe("reduce_scatter", x), direct, fallback, meta=x.is_meta,
                  result=lambda: out, held=(x_pg, out))


@_plain_op
def reduce_scatter(group: Group, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum over the group, keep this rank's block of `dim` (size must divide by group size)."""
    if group.size == 1:
        return x.detach().clone()
    return reduce_scatter_async(group, blocks_of(x.detach(), dim, group.size)).wait().movedim(0, dim)


# [Note: gloo's two-rank collectives]
# gloo's `_reduce_scatter_base` is slow: measured on this 2-core machine (torch 2.13, fp32,
# median of interleaved runs), it took longer than an all-reduce of the same buffer, which
# moves twice the bytes: 3.3 / 15.4 / 66 ms for 1 / 13.8 / 50 MB at N = 2 (all-reduce 1.5 /
# 12.9 / 39 ms). The same sum as an all-to-all of the blocks followed by a local sum took
# 0.9 / 10.2 / 36 ms. So on a gloo group of two ranks a reduce-scatter is an exchange: each
# rank sends the other its block (a view of the input: its head or its tail) with
# `alltoall_base`, receives the other's block straight into the output, and adds its own
# block there. It needs no memory beyond the output (gloo's op allocated working buffers of
# its own). a + b == b + a exactly, so the result is gloo's sum bit for bit, and the same on
# the simulated and the distributed backends. With more ranks the all-to-all would need a
# (k, block) receive buffer, a whole unsharded unit per reduction in flight, so gloo's op
# stays (measured at N = 4 it took 7.7 / 31 / 130 ms against 2.1 / 16 / 58 ms: the time
# would buy memory). Other backends (NCCL) keep their op.
# An all-gather over such a group is an exchange too: `alltoall_base` sends this rank's block
# to the other and receives the other's block straight into its row of the output, and this
# rank copies its own block into its row meanwhile (gloo's `_allgather_base` makes that copy
# in its own thread). Measured, a 6.3 MB block (one GPT 8L d512 unit) at N = 2, interleaved:
# `_allgather_base` 8.9-11.1 ms, the exchange 5.1-6.9 ms; the same bytes on the wire. The
# traced step rewrites its graph's collectives the same way (`exchange_pairs` in
# `shardfn/_traced/collectives.py`).


def exchanges(pg) -> bool:
    """Whether all-gathers and reduce-scatters over process group `pg` run as the two-rank
    exchange ([Note: gloo's two-rank collectives]): the eager ops and the traced graph's
    pass ask here."""
    return pg.size() == 2 and pg.name() == "gloo"


def _swap(group: Group, me: int, recv: torch.Tensor, send: torch.Tensor):
    """[Note: gloo's two-rank collectives] Send the 1-D `send` to the other rank of a two-rank
    group (pg rank `1 - me`) and receive its block into the 1-D `recv`: one `alltoall_base`
    that sends this rank nothing. Returns the work."""
    splits = [0 if j == me else send.numel() for j in range(2)]
    return group.pg.alltoall_base(recv, send, splits, splits, dist.AllToAllOptions())


def _gather_by_exchange(group: Group, x: torch.Tensor, out: torch.Tensor):
    """[Note: gloo's two-rank collectives] Start leaving both ranks' blocks in `out`
    ((2, *x.shape), pg order); returns the work."""
    me = logical_order(group).me
    rows = out.view(2, -1)
    work = _swap(group, me, rows[1 - me], x.view(-1))
    rows[me].copy_(x.view(-1))
    return work


def _sum_by_exchange(group: Group, x_pg: torch.Tensor, out: torch.Tensor):
    """[Note: gloo's two-rank collectives] `x_pg` (2, *block) in pg order -> (work, finish) whose
    finish leaves this rank's summed block in `out`."""
    me = logical_order(group).me
    flat = x_pg.reshape(2, -1)
    work = _swap(group, me, out.view(-1), flat[1 - me])

    def finish():
        out.view(-1).add_(flat[me])
        return out

    return work, finish


@_plain_op
def all_to_all(group: Group, x: torch.Tensor, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Send block i of `split_dim` to rank i; concatenate received blocks along `concat_dim`.
    (`all_to_all_async` with the blocks moved to the front, waited at once.)"""
    if group.size == 1:
        return x.detach().clone()
    blocks = blocks_of(x.detach(), split_dim, group.size)
    received = all_to_all_async(group, blocks, describe=x).wait()  # (k, m, *rest): source-major blocks
    return concat_blocks(received.movedim(1, split_dim + 1), concat_dim)  # each block back in x's dim order


@_plain_op
def all_to_all_async(group: Group, x: torch.Tensor, describe: torch.Tensor | None = None) -> Pending:
    """Start an all-to-all of equal blocks: `x` is (k, *block), block j for logical index j;
    `wait()` returns (k, *block), block i received from logical index i. The recording notes
    the blocks this rank hands over; errors describe `describe` (the caller's tensor) if
    given, else `x`."""
    x = x.detach().contiguous()
    order = logical_order(group)
    blocks = order.to_pg(x).contiguous()
    recv = torch.empty_like(blocks)
    _note("all_to_all", group, blocks)

    def direct():
        work = group.pg.alltoall_base(recv, blocks, [], [], dist.AllToAllOptions())
        return work, lambda: order.to_logical(recv)

    def fallback():
        gathered = all_gather_async(group, blocks).wait()  # (k_src, k_dst, ...), logical src
        return gathered[:, order.me]  # blocks were laid out by destination pg rank

    # a meta run holds the buffers until waited
    return _issue(group, "all_to_all", _describe("all_to_all", x if describe is None else describe), direct,
                  fallback, meta=x.is_meta, result=lambda: recv, held=(blocks, recv))


def _all_to_all_v(group: Group, op: str, what: str, chunks: Sequence[torch.Tensor], counts: Sequence[int],
                  dtype: torch.dtype, device: torch.device) -> Pending:
    """Start an uneven all-to-all of 1-D chunks (the op behind `ppermute`, `exchange_async`
    and `ragged_all_to_all`): `chunks[j]` (any length, 0 included) goes to logical index j;
    `counts[j]`: how many elements come from logical index j. `wait()` returns the received
    1-D pieces, `[j]` from logical index j. A lone non-empty chunk is handed over as is (the
    caller must not write it before `wait()`); several are packed into one buffer.

    One `alltoall_base` with split sizes, zero for the non-partners ([Note: one all-to-all
    per round]). Fallback: every rank's sizes, then its chunks padded to the longest,
    all-gathered; each rank keeps what was sent to it.
    """
    order, k = logical_order(group), group.size
    parts = [chunks[order.logical[p]] for p in range(k)]  # pg order of the destinations
    filled = [c for c in parts if c.numel()]
    send = filled[0] if len(filled) == 1 else torch.cat(parts)
    in_splits = [c.numel() for c in parts]
    out_splits = [counts[order.logical[p]] for p in range(k)]
    recv = torch.empty(sum(out_splits), dtype=dtype, device=device)

    def finish():
        pieces = recv.split(out_splits)  # pg order of the sources
        return [pieces[order.pg[j]] for j in range(k)]

    def direct():
        return group.pg.alltoall_base(recv, send, out_splits, in_splits, dist.AllToAllOptions()), finish

    def fallback():
        sizes = torch.tensor([c.numel() for c in chunks], dtype=torch.int64, device=device)
        all_sizes = all_gather_async(group, sizes).wait()  # (k_src, k_dst), logical order
        padded = torch.zeros(int(all_sizes.sum(1).max()), dtype=dtype, device=device)
        torch.cat(list(chunks), out=padded[: int(sizes.sum())])
        gathered = all_gather_async(group, padded).wait()  # (k_src, longest)
        starts = torch.cumsum(all_sizes, 1) - all_sizes
        me = group.index
        return [gathered[j, int(starts[j, me]):int(starts[j, me]) + counts[j]] for j in range(k)]

    # a meta run holds the buffers until waited
    return _issue(group, op, what, direct, fallback, meta=device.type == "meta", result=finish, held=(send, recv))


@_plain_op
def ppermute(group: Group, x: torch.Tensor, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send x from logical index src to dst for each pair; ranks that receive nothing get zeros.

    Implemented as one all-to-all with zero-sized splits for non-partners, so it is a
    single pollable collective on every backend.
    """
    return ppermute_async(group, x, perm).wait()


@_plain_op
def ppermute_async(group: Group, x: torch.Tensor, perm: Sequence[tuple[int, int]]) -> Pending:
    """Start `ppermute`; `wait()` returns what this rank received. Compute issued between
    the start and the wait overlaps the transfer (ring attention's next block). Every rank
    must start its ppermutes, and any other collective of the group, in the same order."""
    x = x.detach().contiguous()
    dst = dict(perm).get(group.index)
    src = {d: s for s, d in perm}.get(group.index)
    flat = x.reshape(-1)
    _note("ppermute", group, flat)
    chunks = [flat if j == dst else flat[:0] for j in range(group.size)]
    counts = [flat.numel() if j == src else 0 for j in range(group.size)]
    pending = _all_to_all_v(group, "ppermute", _describe("ppermute", x), chunks, counts, x.dtype, x.device)
    return pending.then(lambda got: got[src].view(x.shape) if src is not None else torch.zeros_like(x))


@_plain_op
def exchange_async(group: Group, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, int]],
                   dtype: torch.dtype, label: str) -> Pending:
    """Point-to-point messages between ranks of `group`, as one all-to-all every rank issues.

    `sends`: (destination index, tensor) pairs, at most one per destination; `recvs`:
    (source index, number of elements) pairs, at most one per source. Every rank of the
    group must call it (with nothing to send or receive, too) with the same `label`, which
    names it in desync and timeout messages. Each message is noted as one "send" by
    `recording`. `wait()` returns the received flat tensors in `recvs` order. Messages go
    in `dtype`, from their device, and must not be written before `wait()`; a rank with
    nothing to send receives on the group's device (meta inside `meta_run`: [Note: meta
    tensors]). An uneven all-to-all, as `ppermute` and `ragged_all_to_all` are.

    [Note: one all-to-all per round] Point-to-point send/recv handles of gloo cannot be
    polled, so a rank waiting for a peer that failed would hang until the process group's
    timeout; an all-to-all with zero-sized splits for the non-partners can be polled and
    keeps the desync/abort machinery of the collectives (see `ppermute`).
    """
    order, k = logical_order(group), group.size
    if sends:
        device = sends[0][1].device
    else:
        device = torch.device("meta") if in_meta_run() else group.backend.device
    chunks = [torch.empty(0, dtype=dtype, device=device)] * k
    for dst, t in sorted(sends, key=lambda m: order.pg[m[0]]):
        _note("send", group, t)
        chunks[dst] = t.detach().reshape(-1).to(dtype)
    counts = [0] * k
    for src, n in recvs:
        counts[src] = n
    pending = _all_to_all_v(group, "exchange", f"exchange({label}, dtype={dtype})", chunks, counts, dtype, device)
    return pending.then(lambda got: [got[src] for src, _ in recvs])


@_plain_op
def ragged_all_to_all_async(group: Group, x: torch.Tensor, send_sizes: Sequence[int],
                            recv_sizes: Sequence[int]) -> Pending:
    """Start `ragged_all_to_all`; `wait()` returns what it returns."""
    x = x.detach().contiguous()
    rest = tuple(x.shape[1:])
    row = math.prod(rest)
    out = torch.empty((sum(recv_sizes),) + rest, dtype=x.dtype, device=x.device)
    # the logical buffer: what this rank hands over (like ppermute, the send side)
    _note("ragged_all_to_all", group, x)
    chunks = [c.reshape(-1) for c in x.split(list(send_sizes))]
    # rank-independent description: the desync check compares it across ranks
    what = f"ragged_all_to_all(row_shape={rest}, dtype={x.dtype})"
    pending = _all_to_all_v(group, "ragged_all_to_all", what, chunks, [n * row for n in recv_sizes], x.dtype,
                            x.device)

    def assemble(pieces):
        if out.numel():
            torch.cat(pieces, out=out.view(-1))
        return out

    return pending.then(assemble)


@_plain_op
def ragged_all_to_all(group: Group, x: torch.Tensor, send_sizes: Sequence[int],
                      recv_sizes: Sequence[int]) -> torch.Tensor:
    """Uneven all-to-all along dim 0: rows packed by destination in, rows packed by source out.

    `x` has `sum(send_sizes)` rows: `send_sizes[0]` rows for logical index 0, then index 1's,
    and so on. Returns `(sum(recv_sizes), *x.shape[1:])`: `recv_sizes[j]` rows from logical
    index j, in index order. Sizes are rows (dim-0 entries) and per-rank knowledge: rank i's
    `send_sizes[j]` must equal rank j's `recv_sizes[i]` (the caller checks; a mismatch is a
    backend error or a hang). One uneven all-to-all of the flattened rows (element counts,
    so zero-row and zero-width chunks need no special case).
    """
    if group.size == 1:
        return x.detach().contiguous().clone()
    return ragged_all_to_all_async(group, x, send_sizes, recv_sizes).wait()
