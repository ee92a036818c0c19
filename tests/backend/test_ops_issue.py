"""One way to issue a collective (shardfn/_backend/ops.py, [Note: one way to issue]).

Every op goes through `_issue`: on meta tensors it answers at once, recorded, without
reaching the process group ([Note: meta tensors]); a backend without the direct op gets
the fallback ([Note: fallbacks]). The exchange, the ragged all-to-all and ppermute share
one uneven all-to-all; a group's two orders are worked out in one place (`base.order`).
"""

import functools

import pytest
import torch

import shardfn as sf
from shardfn._backend import base, ops
from shardfn._fsdp import reduce
from shardfn._quant import Wire


@functools.cache
def mesh_of(shape_items: tuple) -> sf.Mesh:
    return sf.local_mesh(dict(shape_items), timeout=30)


def run(shape: dict, body):
    mesh = mesh_of(tuple(shape.items()))
    return mesh.run(lambda: body(mesh))


def message(src: int, dst: int, n: int, device="cpu") -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32, device=device) + 100 * src + 10 * dst


# -- meta runs: at once, recorded, nothing issued ----------------------------------------------


def test_exchange_on_meta_tensors_returns_at_once_and_is_recorded():
    """One rank alone calls it, so an exchange that reached the process group would hang:
    rank 0 with nothing to send (the meta device comes from `meta_run`), then rank 1."""

    def body(mesh):
        group = mesh.group(("data",))
        if mesh.rank == 0:
            with ops.meta_run(), ops.recording() as rec:
                got = ops.exchange_async(group, [], [(1, 5)], torch.float32, "round 1").wait()
            return [(t.shape, t.dtype, t.device.type) for t in got], rec.records
        return None

    (got, records), _ = run({"data": 2}, body)
    assert got == [((5,), torch.float32, "meta")]
    assert records == []  # nothing sent

    def sender(mesh):
        group = mesh.group(("data",))
        if mesh.rank == 1:
            sends = [(0, torch.empty(3, 4, dtype=torch.float64, device="meta"))]
            with ops.meta_run(), ops.recording() as rec:
                got = ops.exchange_async(group, sends, [(0, 7)], torch.float32, "round 1").wait()
            return [(t.shape, t.dtype, t.device.type) for t in got], [(c.op, c.nbytes) for c in rec.records]
        return None

    _, (got, records) = run({"data": 2}, sender)
    assert got == [((7,), torch.float32, "meta")]
    assert records == [("send", 3 * 4 * 8)]  # the message as the caller handed it (float64)


@pytest.mark.parametrize("op", ["ragged_all_to_all", "ppermute", "all_reduce"])
def test_ops_on_meta_tensors_return_at_once_and_are_recorded(op):
    """Rank 0 alone calls them on a 3-rank mesh: the right shapes, one record each."""

    def body(mesh):
        if mesh.rank != 0:
            return None
        group = mesh.group(("data",))
        x = torch.empty(6, 2, device="meta")
        with ops.recording() as rec:
            if op == "ragged_all_to_all":
                got = ops.ragged_all_to_all(group, x, [1, 2, 3], [4, 0, 1])
            elif op == "ppermute":
                got = ops.ppermute(group, x, [(0, 1), (2, 0)])
            else:
                got = ops.all_reduce(group, x)
        return got.shape, got.device.type, [(c.op, c.nbytes) for c in rec.records]

    shape, device, records = run({"data": 3}, body)[0]
    assert device == "meta"
    assert shape == ((5, 2) if op == "ragged_all_to_all" else (6, 2))
    assert records == [(op, 6 * 2 * 4)]


def test_meta_all_gather_counts_its_buffer_in_flight_until_waited():
    def body(mesh):
        group = mesh.group(("data",))
        x = torch.empty(3, device="meta")
        pending = ops.all_gather_async(group, x)
        during = ops.meta_in_flight()
        got = pending.wait()
        return during, ops.meta_in_flight(), got.shape

    assert run({"data": 2}, body) == [(2 * 3 * 4, 0, (2, 3))] * 2


# -- the exchange: one uneven all-to-all, with a fallback ------------------------------------


def exchange_body(mesh, axes):
    """Every rank sends `message(me, j, me + j + 1)` to every other logical index j."""
    group = mesh.group(axes)
    me, k = group.index, group.size
    sends = [(j, message(me, j, me + j + 1)) for j in range(k) if j != me]
    recvs = [(j, me + j + 1) for j in reversed(range(k)) if j != me]  # any order: results follow it
    got = ops.exchange_async(group, sends, recvs, torch.float32, "round 1").wait()
    return [(src, t) for (src, _), t in zip(recvs, got)]


@pytest.mark.parametrize("fallback", [False, True], ids=["direct", "fallback"])
@pytest.mark.parametrize("axes", [("x", "y"), ("y", "x")])
def test_exchange_delivers_every_message(monkeypatch, axes, fallback):
    if fallback:
        monkeypatch.setattr(ops, "FORCE_FALLBACK", {"exchange"})
    shape = {"x": 2, "y": 2}
    results = run(shape, lambda mesh: (mesh.group(axes).index, exchange_body(mesh, axes)))
    for me, received in results:
        assert [src for src, _ in received] == [j for j in reversed(range(4)) if j != me]
        for src, t in received:
            assert torch.equal(t, message(src, me, src + me + 1))


def test_exchange_is_described_by_its_label_alone():
    """Desync and timeout messages name the exchange by the caller's label, not the caller."""
    mesh = sf.local_mesh({"data": 2}, timeout=30)  # its own: a desync leaves the groups out of step

    def body():
        ops.exchange_async(mesh.group(("data",)), [], [], torch.float32, f"round {mesh.rank}").wait()

    with pytest.raises(sf.DesyncError, match=r"issued exchange\(round \d, dtype=torch.float32\)"):
        mesh.run(body)


# -- sync = async + wait, and Pending.then --------------------------------------------------------


def test_sync_ops_are_their_async_ops_waited():
    def body(mesh):
        group = mesh.group(("data",))
        x = message(mesh.rank, 0, 6).reshape(3, 2)
        sizes = [1, 2] if mesh.rank == 0 else [2, 1]  # rows to each rank, and from it
        return (torch.equal(ops.all_reduce(group, x, "max"), ops.all_reduce_async(group, x, "max").wait()),
                torch.equal(ops.ragged_all_to_all(group, x, sizes, sizes),
                            ops.ragged_all_to_all_async(group, x, sizes, sizes).wait()))

    assert run({"data": 2}, body) == [(True, True)] * 2


def test_then_applies_after_the_wait():
    def body(mesh):
        group = mesh.group(("data",))
        pending = ops.all_gather_async(group, torch.full((2,), float(mesh.rank))).then(lambda t: t.sum())
        return float(pending.wait())

    assert run({"data": 2}, body) == [2.0, 2.0]


# -- the group's two orders -----------------------------------------------------------------------


@pytest.mark.parametrize("axes", [("x", "y"), ("y", "x"), ("y",)])
def test_order_maps_both_ways(axes):
    def body(mesh):
        group = mesh.group(axes)
        order = base.order(group)
        blocks = torch.arange(group.size)
        pg_rank = sorted(group.ranks).index(mesh.rank)  # pg ranks follow ascending global rank
        return (torch.equal(order.to_logical(order.to_pg(blocks)), blocks), order.me == pg_rank,
                [order.logical[order.pg[i]] for i in range(group.size)] == list(range(group.size)),
                order.same == (group.perm is None))

    assert run({"x": 2, "y": 2}, body) == [(True, True, True, True)] * 4


# -- the eager reduce-scatter: one entry, one Pending ------------------------------------------


@pytest.mark.parametrize("wire", [None, "int8"])
def test_reduce_scatter_entry_returns_an_ops_pending(wire):
    def body(mesh):
        group = mesh.group(("data",))
        packed = torch.ones(2, 32) * (mesh.rank + 1)
        pending = reduce.reduce_scatter(packed, group, reduce.Stats(), wire=Wire.of(wire) if wire else None)
        return isinstance(pending, ops.Pending), pending.wait()

    for is_pending, got in run({"data": 2}, body):
        assert is_pending
        assert torch.allclose(got, torch.full((32,), 3.0), rtol=1e-2)
