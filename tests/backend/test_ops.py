"""Raw collectives (shardfn/_backend/ops.py) against references computed on the global data.

Every rank's input is integer-valued, so sums are exact in any order and results are
compared bit for bit. Groups and their logical order are recomputed here independently:
the ranks that share every coordinate outside `axes`, ordered row-major over `axes` as
given (JAX's order), so ('y', 'x') on a {'x': 2, 'y': 2} mesh orders ranks 0, 2, 1, 3.
"""

import functools
import itertools

import numpy as np
import pytest
import torch

import shardfn as sf
from shardfn._backend import ops
from shardfn.testing import run_on_mesh

ALL_OPS = {"all_gather", "reduce_scatter", "all_to_all", "ppermute"}

# (mesh shape, axes): a 1-D mesh of 2, 3 and 4 ranks, and each way to name axes of a 2x2 mesh.
CASES = [
    ({"data": 2}, ("data",)),
    ({"data": 3}, ("data",)),
    ({"data": 4}, "data"),
    ({"x": 2, "y": 2}, ("x",)),
    ({"x": 2, "y": 2}, ("y",)),
    ({"x": 2, "y": 2}, ("x", "y")),
    ({"x": 2, "y": 2}, ("y", "x")),
]
CASE_IDS = ["2", "3", "4", "2x2-x", "2x2-y", "2x2-xy", "2x2-yx"]

# -- references ---------------------------------------------------------------------------


def coords_of(rank: int, shape: dict) -> dict:
    sizes = list(shape.values())
    return dict(zip(shape, np.unravel_index(rank, sizes)))


def logical_group(rank: int, shape: dict, axes) -> list[int]:
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    mine = coords_of(rank, shape)
    n = int(np.prod(list(shape.values())))
    members = [r for r in range(n) if all(coords_of(r, shape)[a] == mine[a] for a in shape if a not in axes)]
    return sorted(members, key=lambda r: tuple(coords_of(r, shape)[a] for a in axes))


def rank_input(rank: int, shape: tuple, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-50, 50, shape, generator=gen).to(dtype)


def block_shape(k: int) -> tuple:
    return (2 * k, k, 3)  # dims 0 and 1 split k ways


@functools.cache
def simulated_mesh(shape_items: tuple) -> sf.Mesh:
    """One simulated mesh per shape for the whole module (tearing down gloo groups costs ~20 ms each)."""
    return sf.local_mesh(dict(shape_items), timeout=30)


def run_op(shape, axes, body):
    """Run `body(mesh, group, x)` on a simulated mesh, each rank with its own input."""
    k = len(logical_group(0, shape, axes))
    mesh = simulated_mesh(tuple(shape.items()))

    def per_rank():
        return body(mesh, mesh.group(axes), rank_input(mesh.rank, block_shape(k)))

    return mesh.run(per_rank)


def inputs_of(group: list[int], k: int) -> list[torch.Tensor]:
    return [rank_input(r, block_shape(k)) for r in group]


# -- the ops ------------------------------------------------------------------------------


def check_all_reduce(shape, axes, results):
    for rank, got in enumerate(results):
        xs = torch.stack(inputs_of(logical_group(rank, shape, axes), len(logical_group(rank, shape, axes))))
        assert torch.equal(got["sum"], xs.sum(0))
        assert torch.equal(got["max"], xs.amax(0))
        assert torch.equal(got["min"], xs.amin(0))
        assert torch.equal(got["int64"], xs.to(torch.int64).sum(0)) and got["int64"].dtype == torch.int64


def all_reduce_body(mesh, group, x):
    return {
        "sum": ops.all_reduce(group, x, "sum"),
        "max": ops.all_reduce(group, x, "max"),
        "min": ops.all_reduce(group, x, "min"),
        "int64": ops.all_reduce(group, x.to(torch.int64), "sum"),
        "unchanged": torch.equal(x, rank_input(mesh.rank, x.shape)),
    }


@pytest.mark.parametrize("shape, axes", CASES, ids=CASE_IDS)
def test_all_reduce(shape, axes):
    results = run_op(shape, axes, all_reduce_body)
    check_all_reduce(shape, axes, results)
    assert all(r["unchanged"] for r in results)  # the input is not modified


def all_gather_body(mesh, group, x):
    return {"dim0": ops.all_gather(group, x, 0), "dim1": ops.all_gather(group, x, 1),
            "scalar": ops.all_gather(group, x[0, 0, 0])}


def check_all_gather(shape, axes, results):
    for rank, got in enumerate(results):
        group = logical_group(rank, shape, axes)
        xs = inputs_of(group, len(group))
        assert torch.equal(got["dim0"], torch.cat(xs, 0))
        assert torch.equal(got["dim1"], torch.cat(xs, 1))
        assert torch.equal(got["scalar"], torch.stack([x[0, 0, 0] for x in xs]))


def reduce_scatter_body(mesh, group, x):
    return {"dim0": ops.reduce_scatter(group, x, 0), "dim1": ops.reduce_scatter(group, x, 1)}


def check_reduce_scatter(shape, axes, results):
    for rank, got in enumerate(results):
        group = logical_group(rank, shape, axes)
        total = torch.stack(inputs_of(group, len(group))).sum(0)
        me = group.index(rank)
        assert torch.equal(got["dim0"], total.chunk(len(group), 0)[me])
        assert torch.equal(got["dim1"], total.chunk(len(group), 1)[me])


A2A_DIMS = [(0, 0), (0, 1), (1, 0), (1, 2), (0, 2), (1, 1)]


def all_to_all_body(mesh, group, x):
    return {dims: ops.all_to_all(group, x, *dims) for dims in A2A_DIMS}


def check_all_to_all(shape, axes, results):
    for rank, got in enumerate(results):
        group = logical_group(rank, shape, axes)
        k, me = len(group), group.index(rank)
        xs = inputs_of(group, k)
        for split, concat in A2A_DIMS:
            expected = torch.cat([x.chunk(k, split)[me] for x in xs], concat)
            assert torch.equal(got[(split, concat)], expected), (split, concat)


def perms(k: int) -> dict:
    out = {
        "shift+1": [(i, (i + 1) % k) for i in range(k)],
        "shift-1": [(i, (i - 1) % k) for i in range(k)],
        "identity": [(i, i) for i in range(k)],
        "one-pair": [(0, k - 1)],
    }
    if k >= 3:
        out["partial"] = [(0, 1), (1, 2)]  # rank 0 receives nothing, the last one sends nothing
        out["swap"] = [(0, 2), (2, 0)]
    return out


def ppermute_body(mesh, group, x):
    return {name: ops.ppermute(group, x, perm) for name, perm in perms(group.size).items()}


def check_ppermute(shape, axes, results):
    for rank, got in enumerate(results):
        group = logical_group(rank, shape, axes)
        k, me = len(group), group.index(rank)
        xs = inputs_of(group, k)
        for name, perm in perms(k).items():
            src = {d: s for s, d in perm}.get(me)
            expected = xs[src] if src is not None else torch.zeros_like(xs[me])
            assert torch.equal(got[name], expected), name


OPS = {
    "all_gather": (all_gather_body, check_all_gather),
    "reduce_scatter": (reduce_scatter_body, check_reduce_scatter),
    "all_to_all": (all_to_all_body, check_all_to_all),
    "ppermute": (ppermute_body, check_ppermute),
}


def op_params():
    for (shape, axes), case_id in zip(CASES, CASE_IDS):
        for op in OPS:
            for fallback in (False, True):
                # 2x2-yx-all_to_all-fallback caught a bug: the fallback indexed destination
                # blocks (process-group order) with the logical index.
                yield pytest.param(shape, axes, op, fallback,
                                   id=f"{case_id}-{op}-{'fallback' if fallback else 'direct'}")


@pytest.mark.parametrize("shape, axes, op, fallback", list(op_params()))
def test_collective(monkeypatch, shape, axes, op, fallback):
    if fallback:
        monkeypatch.setattr(ops, "FORCE_FALLBACK", set(ALL_OPS))
    body, check = OPS[op]
    check(shape, axes, run_op(shape, axes, body))


def test_fallbacks_give_identical_results(monkeypatch):
    """Direct and fallback paths agree element for element on one case that is known good."""
    shape, axes = {"x": 2, "y": 2}, ("x", "y")

    def everything(mesh, group, x):
        return [all_gather_body(mesh, group, x), reduce_scatter_body(mesh, group, x),
                all_to_all_body(mesh, group, x), ppermute_body(mesh, group, x)]

    direct = run_op(shape, axes, everything)
    monkeypatch.setattr(ops, "FORCE_FALLBACK", set(ALL_OPS))
    fallback = run_op(shape, axes, everything)
    for d_rank, f_rank in zip(direct, fallback):
        for d_op, f_op in zip(d_rank, f_rank):
            assert d_op.keys() == f_op.keys()
            for key in d_op:
                assert torch.equal(d_op[key], f_op[key]), key


def test_recording_sees_every_collective():
    seen = []

    def body(mesh, group, x):
        with ops.recording(lambda op, axes, nbytes: seen.append((mesh.rank, op, axes, nbytes))) as rec:
            ops.all_reduce(group, x)
            ops.all_gather(group, x)
        assert [(c.op, c.dtype) for c in rec.records] == [("all_reduce", torch.float32), ("all_gather", torch.float32)]
        assert [tuple(c[:3]) for c in rec.records] == [s[1:] for s in seen if s[0] == mesh.rank]
        return None

    run_op({"data": 2}, ("data",), body)
    x_bytes = (2 * 2) * 2 * 3 * 4  # (2k, k, 3) float32 with k = 2
    assert sorted(seen) == [  # all_gather counts its (logical) output: k blocks
        (0, "all_gather", ("data",), 2 * x_bytes), (0, "all_reduce", ("data",), x_bytes),
        (1, "all_gather", ("data",), 2 * x_bytes), (1, "all_reduce", ("data",), x_bytes),
    ]


# -- a multi-process subset: the same references on real processes ---------------------------


MULTIPROCESS_CASES = [
    pytest.param(shape, axes, id=case_id, marks=[] if case_id in ("2", "2x2-yx") else [pytest.mark.slow])
    for (shape, axes), case_id in zip(CASES, CASE_IDS)
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape, axes", MULTIPROCESS_CASES)
def test_collectives_multiprocess(shape, axes):
    k = len(logical_group(0, shape, axes))

    def per_rank(mesh):
        group = mesh.group(axes)
        x = rank_input(mesh.rank, block_shape(k))
        return {op: body(mesh, group, x) for op, (body, _) in OPS.items()} | {"all_reduce": all_reduce_body(mesh, group, x)}

    results = run_on_mesh(per_rank, shape, "distributed")
    check_all_reduce(shape, axes, [r["all_reduce"] for r in results])
    for op, (_, check) in OPS.items():
        check(shape, axes, [r[op] for r in results])


def test_logical_group_reference():
    # The test's own reference for group order, pinned by hand.
    shape = {"x": 2, "y": 2}
    assert logical_group(0, shape, ("y", "x")) == [0, 2, 1, 3]
    assert logical_group(3, shape, ("x",)) == [1, 3]
    assert logical_group(3, shape, ("y",)) == [2, 3]
    assert [logical_group(r, {"a": 2, "b": 3}, ("b", "a")) for r in (4,)] == [[0, 3, 1, 4, 2, 5]]
    assert list(itertools.chain(*(coords_of(r, shape).values() for r in range(4)))) == [0, 0, 0, 1, 1, 0, 1, 1]


# -- [Note: gloo's two-rank collectives]: two ranks exchange blocks (and add) --------------


def _gloo_reduce_scatter_body(mesh):
    import torch.distributed as dist

    group = mesh.group(("data",))
    out = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(100 + mesh.rank)
        x = torch.randn(2, 7, 3, generator=g, dtype=torch.float64).to(dtype)  # not exact in every order
        blocks = ops.all_gather(group, x.unsqueeze(0), 0)  # (2_src, 2, 7, 3): both ranks' inputs
        gloo = torch.empty(7, 3, dtype=dtype)  # gloo's own reduce-scatter
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        group.pg._reduce_scatter_base(gloo.view(-1), x.reshape(-1), opts).wait()
        out[str(dtype)] = (ops.reduce_scatter_async(group, x).wait(), blocks[0, mesh.rank] + blocks[1, mesh.rank], gloo)
    return out


@pytest.mark.parametrize("backend", ["simulated", pytest.param("distributed", marks=pytest.mark.multiprocess)])
def test_gloo_reduce_scatter_of_two_is_the_exchange_sum(backend):
    """On a gloo group of two the reduce-scatter is an exchange and an add: bit for bit the
    blocks' sum and gloo's own op, in every dtype."""
    for rank, out in enumerate(run_on_mesh(_gloo_reduce_scatter_body, {"data": 2}, backend)):
        for dtype, (got, want, gloo) in out.items():
            assert got.dtype == want.dtype and got.shape == (7, 3), dtype
            assert torch.equal(got, want) and torch.equal(got, gloo), (rank, dtype)


def _gloo_all_gather_body(mesh):
    group = mesh.group(("data",))
    out = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.uint8):
        g = torch.Generator().manual_seed(100 + mesh.rank)
        x = (torch.randn(7, 3, generator=g, dtype=torch.float64) * 50).to(dtype)
        gloo = torch.empty(2, 7, 3, dtype=dtype)  # gloo's own all-gather
        group.pg._allgather_base(gloo.view(-1), x.reshape(-1)).wait()
        out[str(dtype)] = (ops.all_gather_async(group, x).wait(), gloo, x)
    return out


@pytest.mark.parametrize("backend", ["simulated", pytest.param("distributed", marks=pytest.mark.multiprocess)])
def test_gloo_all_gather_of_two_is_the_exchange(backend):
    """On a gloo group of two the all-gather is an exchange: gloo's own op's result, bit for
    bit, in every dtype, this rank's block in its row."""
    for rank, out in enumerate(run_on_mesh(_gloo_all_gather_body, {"data": 2}, backend)):
        for dtype, (got, gloo, mine) in out.items():
            assert got.dtype == gloo.dtype and got.shape == (2, 7, 3), dtype
            assert torch.equal(got, gloo) and torch.equal(got[rank], mine), (rank, dtype)


def test_gloo_all_gather_takes_the_exchange_for_two_ranks_only(monkeypatch):
    calls = []
    real = ops._gather_by_exchange
    monkeypatch.setattr(ops, "_gather_by_exchange", lambda *a: calls.append(a[0].size) or real(*a))
    for k in (2, 3):
        got = run_on_mesh(lambda mesh: ops.all_gather(mesh.group(("data",)), torch.full((2,), float(mesh.rank)), 0),
                          {"data": k})
        assert all(torch.equal(g, torch.arange(k).repeat_interleave(2).float()) for g in got)
    assert calls == [2, 2]  # both ranks of the 2-rank mesh; gloo's own op on 3


def test_gloo_reduce_scatter_takes_the_exchange_for_two_ranks_only(monkeypatch):
    calls = []
    real = ops._sum_by_exchange
    monkeypatch.setattr(ops, "_sum_by_exchange", lambda *a: calls.append(a[0].size) or real(*a))
    for k in (2, 3):
        run_on_mesh(lambda mesh: ops.reduce_scatter(mesh.group(("data",)), torch.ones(2 * k, 3), 0), {"data": k})
    assert calls == [2, 2]  # both ranks of the 2-rank mesh; gloo's own op on 3
