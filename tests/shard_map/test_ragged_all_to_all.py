"""sf.ragged_all_to_all: values, VJP (both inputs), jvp, vmap, eager backward, against a
single-process reference built from every rank's inputs; uneven and zero-size chunks; a
hypothesis property over random layouts; every error message; real processes.

A layout (`Ragged`) gives, for every sender i and receiver j of one axis group, the chunk
size `send[i][j]`, where it starts in i's operand (`in_off[i][j]`, chunks may overlap)
and where it lands in j's output (`out_off[i][j]`, JAX's meaning: offsets in the
receiver's buffer; incoming chunks never overlap).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardfn as sf
from collective_cases import mesh_for
from shardfn._backend import ops

torch.set_num_threads(1)
P = sf.P
DTYPE = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


@dataclasses.dataclass
class Ragged:
    k: int
    n_in: int
    n_out: int
    in_off: list  # [i][j]: where chunk i -> j starts in i's operand
    send: list  # [i][j]: rows i sends to j
    out_off: list  # [i][j]: where chunk i -> j starts in j's output

    def args(self, i, as_tensor=False):
        recv = [self.send[j][i] for j in range(self.k)]
        lists = (self.in_off[i], self.send[i], self.out_off[i], recv)
        return tuple(torch.tensor(v, dtype=torch.int64) for v in lists) if as_tensor else lists


def make_ragged(rng: random.Random, k: int, n_in: int, n_out: int, max_chunk: int = 3, gaps=True,
                zero_rate: float = 0.25) -> Ragged:
    send = [[0] * k for _ in range(k)]
    out_off = [[0] * k for _ in range(k)]
    for j in range(k):  # receiver j lays out its buffer: senders in a random order, random gaps
        pos = 0
        for i in rng.sample(range(k), k):
            if gaps and pos < n_out and rng.random() < 0.5:
                pos += 1
            n = 0 if rng.random() < zero_rate else rng.randint(0, min(max_chunk, n_out - pos, n_in))
            send[i][j], out_off[i][j] = n, min(pos, n_out)  # a zero-size chunk may sit at n_out
            pos += n
    in_off = [[rng.randint(0, n_in - send[i][j]) for j in range(k)] for i in range(k)]
    return Ragged(k, n_in, n_out, in_off, send, out_off)


def reference(lay: Ragged, operands, outputs):
    """Every receiver's result, from all ranks' inputs in one process (differentiable)."""
    results = []
    for j in range(lay.k):
        r = outputs[j]
        for i in range(lay.k):
            n, o, s = lay.send[i][j], lay.out_off[i][j], lay.in_off[i][j]
            if n:
                r = r.index_copy(0, torch.arange(o, o + n), operands[i][s:s + n])
        results.append(r)
    return results


def data(lay: Ragged, rest=(2,), seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randn((n,) + tuple(rest), generator=gen, dtype=DTYPE)  # noqa: E731
    k = lay.k
    return dict(operands=[rnd(lay.n_in) for _ in range(k)], outputs=[rnd(lay.n_out) for _ in range(k)],
                cts=[rnd(lay.n_out) for _ in range(k)], t_ops=[rnd(lay.n_in) for _ in range(k)],
                t_outs=[rnd(lay.n_out) for _ in range(k)])


def want(lay: Ragged, d):
    """Reference (values, operand grads, output grads, tangents) by autograd / torch.func."""
    k = lay.k
    ops_ = [x.clone().requires_grad_() for x in d["operands"]]
    outs = [x.clone().requires_grad_() for x in d["outputs"]]
    res = reference(lay, ops_, outs)
    loss = sum((r * c).sum() for r, c in zip(res, d["cts"]))
    grads = torch.autograd.grad(loss, ops_ + outs, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, ops_ + outs)]
    _, tans = torch.func.jvp(lambda a, b: tuple(reference(lay, a, b)), (tuple(d["operands"]), tuple(d["outputs"])),
                             (tuple(d["t_ops"]), tuple(d["t_outs"])))
    return [r.detach() for r in res], grads[:k], grads[k:], list(tans)


# -- running on a mesh ------------------------------------------------------------------


MESHES = {"1": ({"x": 1}, "x"), "2": ({"x": 2}, "x"), "3": ({"x": 3}, "x"), "4": ({"x": 4}, "x"),
          "2x2-y+x": ({"x": 2, "y": 2}, ("y", "x"))}


def logical_index(mesh, axis) -> int:
    idx = 0
    for a in (axis,) if isinstance(axis, str) else axis:
        idx = idx * mesh.shape[a] + mesh.coords[a]
    return idx


def program(lay, axis, i, as_tensor=False, check=False):
    def f(a, b):
        return sf.ragged_all_to_all(a, b, *lay.args(i, as_tensor), axis, check=check)
    return f


def full_spec(mesh):
    return P(tuple(mesh.axis_names))


def rank_body(mesh, lay, axis, d, as_tensor=False):
    """On one rank: value, both VJPs (torch.func.vjp, torch.func.grad, loss.backward) and the jvp."""
    i = logical_index(mesh, axis)
    spec = full_spec(mesh)
    f = sf.shard_map(program(lay, axis, i, as_tensor), mesh, (spec, spec), spec)
    a, b, ct = d["operands"][i], d["outputs"][i], d["cts"][i]
    out, vjp = torch.func.vjp(f, a, b)
    g_op, g_out = vjp(ct)
    by_grad = torch.func.grad(lambda x, y: (f(x, y) * ct).sum(), argnums=(0, 1))(a, b)
    ea, eb = a.clone().requires_grad_(), b.clone().requires_grad_()
    (f(ea, eb) * ct).sum().backward()
    _, tan = torch.func.jvp(f, (a, b), (d["t_ops"][i], d["t_outs"][i]))
    return i, out, (g_op, g_out), by_grad, (ea.grad, eb.grad), tan


def check_on(results, expected):
    values, g_ops, g_outs, tans = expected
    for i, out, vjp_grads, by_grad, eager, tan in results:
        torch.testing.assert_close(out, values[i], **TOL)
        for name, (go, gb) in (("vjp", vjp_grads), ("grad", by_grad), ("backward", eager)):
            torch.testing.assert_close(go, g_ops[i], **TOL, msg=lambda m: f"rank {i} operand {name}: {m}")
            torch.testing.assert_close(gb, g_outs[i], **TOL, msg=lambda m: f"rank {i} output {name}: {m}")
        torch.testing.assert_close(tan, tans[i], **TOL)


def run_case(mesh_id, lay, d, as_tensor=False):
    shape, axis = MESHES[mesh_id]
    mesh = mesh_for(shape)
    check_on(mesh.run(rank_body, mesh, lay, axis, d, as_tensor), want(lay, d))


# -- hand-written layouts ----------------------------------------------------------------


def test_semantics_by_hand():
    """Two ranks, uneven: the worked example of the docstring, values and gradients by hand."""
    lay = Ragged(2, 3, 3, in_off=[[0, 1], [0, 1]], send=[[1, 2], [1, 1]], out_off=[[0, 0], [1, 2]])
    operands = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0])]
    outputs = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-4.0, -5.0, -6.0])]
    res = reference(lay, operands, outputs)
    torch.testing.assert_close(res[0], torch.tensor([1.0, 4.0, -3.0]))  # row 2 of rank 0 kept
    torch.testing.assert_close(res[1], torch.tensor([2.0, 3.0, 5.0]))
    mesh = mesh_for({"x": 2})

    def body():
        i = mesh.rank
        f = sf.shard_map(program(lay, "x", i), mesh, (P("x"), P("x")), P("x"))
        a, b = operands[i].clone().requires_grad_(), outputs[i].clone().requires_grad_()
        y = f(a, b)
        (y * torch.tensor([10.0, 20.0, 30.0])).sum().backward()
        return y.detach(), a.grad, b.grad

    (y0, ga0, gb0), (y1, ga1, gb1) = mesh.run(body)
    torch.testing.assert_close(y0, res[0])
    torch.testing.assert_close(y1, res[1])
    # rank 0's row 0 went to rank 0's row 0 (ct 10); rows 1, 2 to rank 1's rows 0, 1 (ct 10, 20)
    torch.testing.assert_close(ga0, torch.tensor([10.0, 10.0, 20.0]))
    # rank 1's row 0 went to rank 0's row 1 (ct 20); row 1 to rank 1's row 2 (ct 30); row 2 unsent
    torch.testing.assert_close(ga1, torch.tensor([20.0, 30.0, 0.0]))
    torch.testing.assert_close(gb0, torch.tensor([0.0, 0.0, 30.0]))  # only the unwritten row
    torch.testing.assert_close(gb1, torch.tensor([0.0, 0.0, 0.0]))


LAYOUTS = {
    # k=1: a local copy into the buffer
    "1": Ragged(1, 4, 5, in_off=[[1]], send=[[3]], out_off=[[2]]),
    # every chunk empty: output unchanged, zero operand gradient
    "2-all-empty": Ragged(2, 2, 3, in_off=[[0, 0], [0, 0]], send=[[0, 0], [0, 0]], out_off=[[0, 3], [3, 0]]),
    # one direction only, and overlapping operand rows (rows 1..2 sent to both peers)
    "3-overlap-in": Ragged(3, 4, 6, in_off=[[0, 1, 1], [0, 0, 0], [2, 0, 3]], send=[[2, 2, 2], [0, 0, 0], [1, 0, 1]],
                           out_off=[[0, 0, 4], [0, 0, 0], [5, 0, 0]]),
    # a zero-size chunk at the offset where another chunk starts, and adjacent chunks
    "2-zero-at-start": Ragged(2, 3, 4, in_off=[[0, 1], [2, 0]], send=[[2, 0], [1, 2]], out_off=[[0, 0], [2, 0]]),
    # uneven with zero-size chunks and gaps
    "4-uneven": Ragged(4, 5, 7, in_off=[[0, 1, 4, 2], [3, 0, 0, 1], [0, 0, 2, 4], [1, 1, 0, 0]],
                       send=[[1, 3, 0, 2], [2, 0, 4, 1], [0, 1, 3, 1], [2, 2, 0, 0]],
                       out_off=[[0, 0, 0, 0], [1, 3, 0, 2], [0, 4, 4, 3], [4, 5, 0, 0]]),
}


@pytest.mark.parametrize("as_tensor", [False, True], ids=["lists", "int64-tensors"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts(name, as_tensor):
    lay = LAYOUTS[name]
    mesh_id = name.split("-")[0]
    run_case(mesh_id, lay, data(lay, seed=1), as_tensor)


@pytest.mark.parametrize("mesh_id", ["2", "3", "4", "2x2-y+x"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_layouts(mesh_id, seed):
    shape, axis = MESHES[mesh_id]
    k = _axis_size(shape, axis)
    lay = make_ragged(random.Random(seed * 10 + k), k, n_in=5, n_out=8)
    run_case(mesh_id, lay, data(lay, rest=(2, 3), seed=seed))


def _axis_size(shape, axis):
    n = 1
    for a in (axis,) if isinstance(axis, str) else axis:
        n *= shape[a]
    return n


def test_two_groups_of_one_axis():
    """axis 'x' on a 2x2 mesh: two independent groups (one per y), each with its own layout."""
    shape = {"x": 2, "y": 2}
    mesh = mesh_for(shape)
    lays = [make_ragged(random.Random(7 + y), 2, 3, 5) for y in range(2)]
    ds = [data(lay, seed=3 + y) for y, lay in enumerate(lays)]

    def body():
        y = mesh.coords["y"]
        return (y,) + rank_body(mesh, lays[y], "x", ds[y])

    results = mesh.run(body)
    for y in range(2):
        check_on([r[1:] for r in results if r[0] == y], want(lays[y], ds[y]))


def test_integer_operands_move_without_autodiff():
    lay = LAYOUTS["4-uneven"]
    mesh = mesh_for({"x": 4})
    d = data(lay, seed=2)
    ints = [(x * 100).to(torch.int32) for x in d["operands"]]
    bufs = [(x * 100).to(torch.int32) for x in d["outputs"]]
    expect = reference(lay, ints, bufs)

    def body():
        i = mesh.rank
        return sf.shard_map(program(lay, "x", i), mesh, (P("x"), P("x")), P("x"))(ints[i], bufs[i])

    for i, got in enumerate(mesh.run(body)):
        assert got.dtype == torch.int32
        torch.testing.assert_close(got, expect[i])


def test_fallback_matches_direct():
    """[Note: fallbacks]: the all-gather fallback gives the same rows."""
    lay = LAYOUTS["4-uneven"]
    d = data(lay, seed=4)
    ops.FORCE_FALLBACK.add("ragged_all_to_all")
    try:
        run_case("4", lay, d)
        run_case("2x2-y+x", lay, d)
    finally:
        ops.FORCE_FALLBACK.discard("ragged_all_to_all")


def test_records_one_ragged_exchange_and_one_offset_exchange():
    lay = LAYOUTS["4-uneven"]
    mesh = mesh_for({"x": 4})
    d = data(lay, seed=5)

    def body():
        i = mesh.rank
        f = sf.shard_map(program(lay, "x", i), mesh, (P("x"), P("x")), P("x"))
        a = d["operands"][i].clone().requires_grad_()
        with ops.recording() as fwd:
            y = f(a, d["outputs"][i])
        with ops.recording() as bwd:
            y.sum().backward()
        mine = lambda rec: [(c.op, c.nbytes) for c in rec.records if "all_to_all" in c.op]  # noqa: E731
        return mine(fwd), mine(bwd)  # (shard_map's own structure check is an all_reduce)

    for i, (fwd, bwd) in enumerate(mesh.run(body)):
        sent = sum(lay.send[i]) * 2 * 8
        recvd = sum(lay.send[j][i] for j in range(4)) * 2 * 8
        assert fwd == [("all_to_all", 4 * 2 * 8), ("ragged_all_to_all", sent)]
        assert bwd == [("ragged_all_to_all", recvd)]  # no offset exchange in the backward


# -- vmap --------------------------------------------------------------------------------


@pytest.mark.parametrize("dims", [(0, 0), (1, 1), (0, None), (None, 0), (-1, 0)],
                         ids=["both0", "both1", "operand-only", "output-only", "last-and-0"])
def test_vmap_equals_loop(dims):
    lay = LAYOUTS["4-uneven"]
    mesh = mesh_for({"x": 4})
    gen = torch.Generator().manual_seed(8)
    B = 3

    def batch(n, d):
        if d is None:
            return torch.randn(n, 2, generator=gen, dtype=DTYPE)
        shape = [n, 2]
        shape.insert(d % 3, B)
        return torch.randn(shape, generator=gen, dtype=DTYPE)

    xs = [batch(lay.n_in, dims[0]) for _ in range(4)]
    ys = [batch(lay.n_out, dims[1]) for _ in range(4)]

    def body():
        i = mesh.rank
        f = sf.shard_map(program(lay, "x", i), mesh, (P("x"), P("x")), P("x"))
        got = torch.func.vmap(f, in_dims=dims)(xs[i], ys[i])
        pick = lambda t, d, b: t if d is None else t.select(d, b)  # noqa: E731
        loop = torch.stack([f(pick(xs[i], dims[0], b), pick(ys[i], dims[1], b)) for b in range(B)])
        return got, loop

    for got, loop in mesh.run(body):
        torch.testing.assert_close(got, loop, rtol=0, atol=0)


def test_vmap_inside_shard_map_and_per_example_grads():
    """vmap inside the program (batch dim 1), and vmap(grad) per-example gradients."""
    lay = LAYOUTS["4-uneven"]
    mesh = mesh_for({"x": 4})
    gen = torch.Generator().manual_seed(9)
    B = 3
    xs = [torch.randn(lay.n_in, B, 2, generator=gen, dtype=DTYPE) for _ in range(4)]
    ys = [torch.randn(lay.n_out, B, 2, generator=gen, dtype=DTYPE) for _ in range(4)]
    cts = [torch.randn(lay.n_out, B, 2, generator=gen, dtype=DTYPE) for _ in range(4)]
    per_b = [want(lay, dict(operands=[x[:, b] for x in xs], outputs=[y[:, b] for y in ys],
                            cts=[c[:, b] for c in cts], t_ops=[x[:, b] for x in xs], t_outs=[y[:, b] for y in ys]))
             for b in range(B)]

    def body():
        i = mesh.rank
        prog = program(lay, "x", i, as_tensor=True)
        inside = sf.shard_map(lambda a, b: torch.func.vmap(prog, in_dims=1, out_dims=1)(a, b), mesh,
                              (P("x"), P("x")), P("x"))
        plain = sf.shard_map(prog, mesh, (P("x"), P("x")), P("x"))
        value = inside(xs[i], ys[i])
        per_example = torch.func.vmap(torch.func.grad(lambda a, b, c: (plain(a, b) * c).sum(), argnums=(0, 1)),
                                      in_dims=1)(xs[i], ys[i], cts[i])
        return i, value, per_example

    for i, value, (g_op, g_out) in mesh.run(body):
        for b in range(B):
            values, g_ops, g_outs, _ = per_b[b]
            torch.testing.assert_close(value[:, b], values[i], **TOL)
            torch.testing.assert_close(g_op[b], g_ops[i], **TOL)
            torch.testing.assert_close(g_out[b], g_outs[i], **TOL)


def test_jacrev_and_jacfwd_match_reference():
    """jacrev = vmap over the transpose (operand batched, zero buffer not); jacfwd = vmap over jvp."""
    lay = LAYOUTS["3-overlap-in"]
    mesh = mesh_for({"x": 3})
    d = data(lay, rest=(), seed=10)
    jac = torch.func.jacrev(lambda a: torch.stack(reference(lay, list(a), d["outputs"])))(torch.stack(d["operands"]))

    def body():
        i = mesh.rank
        f = sf.shard_map(program(lay, "x", i), mesh, (P("x"), P("x")), P("x"))
        g = lambda a: f(a, d["outputs"][i])  # noqa: E731
        return i, torch.func.jacrev(g)(d["operands"][i]), torch.func.jacfwd(g)(d["operands"][i])

    # jac[j, m, i, n] = d out_j[m] / d operand_i[n]. In local mode every rank seeds the same
    # basis vector at once, so rank i's jacrev row m sums over receivers j, and its jacfwd
    # column n over senders j.
    for i, jr, jf in mesh.run(body):
        torch.testing.assert_close(jr, jac.sum(0)[:, i], **TOL)
        torch.testing.assert_close(jf, jac[i].sum(1), **TOL)


def test_double_backward():
    """The transpose is itself differentiable: grad of (grad . v) is the reference's."""
    lay = LAYOUTS["4-uneven"]
    mesh = mesh_for({"x": 4})
    d = data(lay, seed=11)
    v = d["t_ops"]

    def ref_loss(a):
        return sum(((r ** 2) * c).sum() for r, c in zip(reference(lay, list(a), d["outputs"]), d["cts"]))

    A = torch.stack(d["operands"])
    expect = torch.func.grad(lambda a: (torch.func.grad(ref_loss)(a) * torch.stack(v)).sum())(A)

    def body():
        i = mesh.rank
        f = sf.shard_map(program(lay, "x", i), mesh, (P("x"), P("x")), P("x"))
        loss = lambda a: ((f(a, d["outputs"][i]) ** 2) * d["cts"][i]).sum()  # noqa: E731
        return torch.func.grad(lambda a: (torch.func.grad(loss)(a) * v[i]).sum())(d["operands"][i])

    for i, got in enumerate(mesh.run(body)):
        torch.testing.assert_close(got, expect[i], **TOL)


# -- hypothesis: random sizes and non-overlapping receive offsets --------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(k=st.integers(1, 4), n_in=st.integers(0, 5), n_out=st.integers(0, 7), seed=st.integers(0, 10 ** 6),
       gaps=st.booleans(), width=st.sampled_from([(), (2,), (0,)]))
def test_property_random_layouts(k, n_in, n_out, seed, gaps, width):
    lay = make_ragged(random.Random(seed), k, n_in, n_out, gaps=gaps)
    run_case(str(k), lay, data(lay, rest=width, seed=seed % 97))


# -- errors --------------------------------------------------------------------------------


def _error_on(mesh, fn, a, b):
    spec = lambda t: P("x") if t.dim() else P()  # noqa: E731
    f = sf.shard_map(fn, mesh, (spec(a), spec(b)), spec(b))
    return f(a, b)


def _run_expect(mesh, fn, n_in=3, n_out=3, rest=(2,)):
    """Run `fn(i)` -> program on every rank; the first error is re-raised by mesh.run."""
    def body():
        i = mesh.rank
        return _error_on(mesh, fn(i), torch.zeros((n_in,) + rest), torch.zeros((n_out,) + rest))
    return mesh.run(body)


NAMES = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def good(i):
    """Rank i sends row 0 to rank 0 and row 1 to rank 1; both land at row i there."""
    return dict(zip(NAMES, ([0, 1], [1, 1], [i, i], [1, 1])))


def _with(i, **over):
    names = NAMES
    args = good(i)
    args.update({k: (v(i) if callable(v) else v) for k, v in over.items()})
    return lambda a, b: sf.ragged_all_to_all(a, b, *(args[n] for n in names), "x")


def test_good_arguments_for_the_error_tests():
    mesh = mesh_for({"x": 2})
    _run_expect(mesh, lambda i: _with(i))


@pytest.mark.parametrize("over,match", [
    (dict(send_sizes=[1, 1, 1]), r"send_sizes must have one entry per rank of the axis \(length 2\), got length 3"),
    (dict(recv_sizes=torch.tensor([1, 1, 0])), r"recv_sizes must be 1-D with one entry per rank of the axis "
                                               r"\(length 2\), got shape \(3,\)"),
    (dict(input_offsets=torch.tensor([[0, 1]])), r"input_offsets must be 1-D .* got shape \(1, 2\)"),
    (dict(output_offsets=torch.tensor([0.0, 1.0])), r"(?s)output_offsets must hold integers, got dtype "
                                                    r"torch.float32.*\.to\(torch.int64\)"),
    (dict(send_sizes=[1, 1.0]), r"send_sizes must hold Python ints, got \[1, 1.0\]"),
    (dict(send_sizes=[True, 1]), r"send_sizes must hold Python ints"),
    (dict(recv_sizes="11"), r"recv_sizes must be a 1-D integer tensor or a list of 2 ints, got str"),
    (dict(input_offsets=[0, -1]), r"input_offsets has negative entries: \[0, -1\]"),
    (dict(input_offsets=[0, 3]), r"(?s)input_offsets\[1\] \+ send_sizes\[1\] = 3 \+ 1 = 4 exceeds operand's 3 rows "
                                 r"\(operand shape \(3, 2\)\)"),
], ids=["len-list", "len-tensor", "2d", "float", "float-in-list", "bool", "str", "negative", "past-operand"])
def test_local_argument_errors(over, match):
    mesh = mesh_for({"x": 2})
    with pytest.raises(sf.SpecError, match=match) as info:
        _run_expect(mesh, lambda i: _with(i, **over))
    assert "ragged_all_to_all(axis='x', axis size 2)" in str(info.value)


def test_error_recv_sizes_disagree_with_senders():
    mesh = mesh_for({"x": 2})
    with pytest.raises(sf.SpecError, match=r"recv_sizes\[1\] = 2, but axis index 1 sends 1 rows here \(its "
                                           r"send_sizes\[0\] = 1\)"):
        _run_expect(mesh, lambda i: _with(i, recv_sizes=[1, 2] if i == 0 else [1, 1]))


def test_error_chunk_past_receivers_output():
    mesh = mesh_for({"x": 2})
    # rank 0 tells rank 1 to write its row at 3: past rank 1's 3 rows; rank 1 finds it
    with pytest.raises(sf.SpecError, match=r"(?s)on axis index 1:\n  - axis index 0 writes rows 3:4 here \(its "
                                           r"output_offsets\[1\] = 3, send_sizes\[1\] = 1\), beyond output's 3 "
                                           r"rows \(output shape \(3, 2\)\)\nFix: .*receiver's buffer"):
        _run_expect(mesh, lambda i: _with(i, output_offsets=[0, 3] if i == 0 else [1, 1]))


def test_error_incoming_chunks_overlap():
    mesh = mesh_for({"x": 2})
    # both ranks write rank 0's row 0 (only rank 0 sees it)
    with pytest.raises(sf.SpecError, match=r"on axis index 0:\n  - the chunks from axis indices 0 \(rows 0:1\) "
                                           r"and 1 \(rows 0:1\) overlap in output"):
        _run_expect(mesh, lambda i: _with(i, output_offsets=[0, 0] if i == 0 else [0, 1]))


def test_check_mode_makes_every_rank_raise():
    mesh = mesh_for({"x": 2})
    names = NAMES

    def body():
        i = mesh.rank
        args = good(i)
        if i == 1:
            args["input_offsets"] = [0, 5]  # only rank 1 is wrong
        f = sf.shard_map(lambda a, b: sf.ragged_all_to_all(a, b, *(args[n] for n in names), "x", check=True),
                         mesh, (P("x"), P("x")), P("x"))
        try:
            f(torch.zeros(3, 2), torch.zeros(3, 2))
        except sf.SpecError as err:
            return str(err)
        return None

    msgs = mesh.run(body)
    assert "another rank of the axis found invalid arguments" in msgs[0]
    assert "input_offsets[1] + send_sizes[1] = 5 + 1 = 6 exceeds operand's 3 rows" in msgs[1]
    assert mesh.run(lambda: _error_on(mesh, _with(mesh.rank), torch.zeros(3), torch.zeros(3)).shape) == [(3,)] * 2


@pytest.mark.parametrize("a,b,match", [
    (torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.float64), r"operand and output must share dtype and trailing "
                                                                r"dims .* got operand \(3, 2\) torch.float32"),
    (torch.zeros(3, 2), torch.zeros(3, 4), r"must share dtype and trailing dims"),
    (torch.zeros(()), torch.zeros(3), r"operand and output need rank >= 1 \(rows are dim 0\)"),
    (torch.zeros(3, dtype=torch.complex64), torch.zeros(3, dtype=torch.complex64), r"dtype torch.complex64 is not "
                                                                                    r"supported"),
], ids=["dtype", "trailing", "scalar", "complex"])
def test_operand_errors(a, b, match):
    mesh = mesh_for({"x": 2})
    with pytest.raises(sf.SpecError, match=match):
        mesh.run(lambda: _error_on(mesh, _with(mesh.rank), a, b))


def test_error_outside_shard_map():
    with pytest.raises(sf.ShardingError, match=r"ragged_all_to_all\(axis='x'\) was called outside shard_map"):
        sf.ragged_all_to_all(torch.zeros(2), torch.zeros(2), [0], [1], [0], [1], "x")


def test_error_batched_sizes_under_vmap():
    mesh = mesh_for({"x": 2})

    def body():
        def prog(a, b, sizes):
            return sf.ragged_all_to_all(a, b, [0, 1], sizes, [0, 1], [1, 1], "x")

        f = sf.shard_map(lambda a, b, s: torch.func.vmap(prog)(a, b, s), mesh, (P("x"), P("x"), P("x")), P("x"))
        return f(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.int64))

    with pytest.raises(sf.SpecError, match=r"send_sizes is batched by vmap; per-example ragged layouts are not "
                                           r"supported.\nFix: vmap over the data only"):
        mesh.run(body)


# -- real processes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def warm_functorch():
    x = torch.ones(2, dtype=torch.float64)
    torch.func.jvp(torch.sin, (x,), (x,))
    torch.func.vjp(torch.sin, x)[1](x)


def _process_case(mesh_id, seed):
    shape, axis = MESHES[mesh_id]
    k = _axis_size(shape, axis)
    lay = make_ragged(random.Random(seed), k, n_in=4, n_out=6)
    lay.send[0][k - 1] = 0  # at least one zero-size chunk
    d = data(lay, seed=seed)
    return shape, axis, lay, d


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_id", [pytest.param("2", marks=pytest.mark.ci), "2x2-y+x"])
def test_on_processes(mesh_id, warm_functorch):
    from shardfn.testing import run_on_mesh

    shape, axis, lay, d = _process_case(mesh_id, 21)
    results = run_on_mesh(lambda mesh: rank_body(mesh, lay, axis, d, as_tensor=True), shape, backend="distributed")
    check_on(results, want(lay, d))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_vmap_and_fallback_on_processes(warm_functorch):
    from shardfn.testing import run_on_mesh

    lay = LAYOUTS["4-uneven"]
    gen = torch.Generator().manual_seed(12)
    xs = [torch.randn(3, lay.n_in, 2, generator=gen, dtype=DTYPE) for _ in range(4)]
    ys = [torch.randn(lay.n_out, 2, generator=gen, dtype=DTYPE) for _ in range(4)]
    expect = [reference(lay, [x[b] for x in xs], ys) for b in range(3)]

    def body(mesh):
        i = mesh.rank
        f = sf.shard_map(program(lay, "x", i), mesh, (P("x"), P("x")), P("x"))
        batched = torch.func.vmap(f, in_dims=(0, None))(xs[i], ys[i])
        ops.FORCE_FALLBACK.add("ragged_all_to_all")
        try:
            fallback = f(xs[i][0], ys[i])
        finally:
            ops.FORCE_FALLBACK.discard("ragged_all_to_all")
        return i, batched, fallback

    for i, batched, fallback in run_on_mesh(body, {"x": 4}, backend="distributed"):
        for b in range(3):
            torch.testing.assert_close(batched[b], expect[b][i], **TOL)
        torch.testing.assert_close(fallback, expect[0][i], **TOL)


# -- uneven blocks in the other collectives ----------------------------------------------
#
# all_gather, psum, pmax, ppermute and all_to_all need the same shape on every rank, and
# psum_scatter / all_to_all a split dim that divides by (tiled) or equals (untiled) the
# axis size. torch.chunk blocks of a dim that does not divide are uneven (5 rows over 2
# ranks: 3 and 2). Each case below must be a clear error, never a hang or garbage: a
# SpecError for a shape the op can check locally, a DesyncError naming both shapes for a
# mismatch between ranks (the simulated mesh always compares collectives; on processes,
# `init_mesh(..., check_collectives=True)` or SHARDFN_CHECK_COLLECTIVES=1 does). The way to
# move uneven blocks is ragged_all_to_all (test_uneven_all_gather_by_ragged_all_to_all).


UNEVEN_MISMATCH = {
    "psum": lambda b: sf.psum(b, "x"),
    "pmax": lambda b: sf.pmax(b, "x"),
    "all_gather": lambda b: sf.all_gather(b, "x"),
    "all_gather-dim1": lambda b: sf.all_gather(b, "x", dim=1),
    "all_gather-untiled": lambda b: sf.all_gather(b, "x", tiled=False),
    "ppermute": lambda b: sf.ppermute(b, "x", [(0, 1), (1, 0)]),
    "all_to_all-split1": lambda b: sf.all_to_all(b, "x", 1, 0),  # dim 1 (2) divides; dim 0 differs
}


@pytest.mark.parametrize("op", list(UNEVEN_MISMATCH))
def test_uneven_torch_chunk_blocks_are_a_desync_error(op):
    mesh = mesh_for({"x": 2})
    x = torch.arange(10.0).reshape(5, 2)  # torch.chunk over 2 ranks: 3 rows and 2 rows
    f = sf.shard_map(UNEVEN_MISMATCH[op], mesh, P("x"), P("x"), check=False)
    shape = r"shape=\((1, )?[23], 2\)"
    with pytest.raises(sf.DesyncError, match=rf"(?s)collectives out of step over mesh axes \('x',\).*{shape}"
                                             rf".*but rank [01] issued .*{shape}.*sf.ragged_all_to_all"):
        mesh.run(lambda: f(torch.chunk(x, 2)[mesh.rank]))


@pytest.mark.parametrize("op,match", [
    ("psum_scatter", r"psum_scatter\(axis='x', dim=0, tiled=True\): x has shape \(3, 2\); dim 0 has size 3, "
                     r"which must be divisible by the axis size 2"),
    ("all_to_all", r"all_to_all\(axis='x', split_dim=0, tiled=True\): x has shape \(3, 2\); split dim 0 has size "
                   r"3, which must be divisible by the axis size 2"),
])
def test_uneven_torch_chunk_blocks_split_on_dim0(op, match):
    """The rank with 3 rows finds it locally; the rank with 2 rows is stopped."""
    mesh = mesh_for({"x": 2})
    x = torch.arange(10.0).reshape(5, 2)
    prog = (lambda b: sf.psum_scatter(b, "x")) if op == "psum_scatter" else (lambda b: sf.all_to_all(b, "x", 0, 0))
    f = sf.shard_map(prog, mesh, P("x"), P("x"), check=False)
    with pytest.raises(sf.SpecError, match=match):
        mesh.run(lambda: f(torch.chunk(x, 2)[mesh.rank]))


@pytest.mark.parametrize("call,shape,match", [
    (lambda b: sf.psum_scatter(b, "x", tiled=False), (3, 2),
     r"psum_scatter\(axis='x', dim=0, tiled=False\): x has shape \(3, 2\); dim 0 has size 3, which must be equal "
     r"to the axis size 2"),
    (lambda b: sf.psum_scatter(b, ("x", "y"), dim=1), (2, 6),
     r"psum_scatter\(axis=\('x', 'y'\), dim=1, tiled=True\): x has shape \(2, 6\); dim 1 has size 6, which must "
     r"be divisible by the axis size 4.\nFix: pad dim 1 to a multiple of 4"),
    (lambda b: sf.psum_scatter(b, ("y", "x"), dim=-1), (2, 5),
     r"psum_scatter\(axis=\('y', 'x'\), dim=-1, tiled=True\): x has shape \(2, 5\); dim 1 has size 5"),
    (lambda b: sf.all_to_all(b, "y", 0, 1, tiled=False), (3, 2),
     r"all_to_all\(axis='y', split_dim=0, tiled=False\): x has shape \(3, 2\); split dim 0 has size 3, which "
     r"must be equal to the axis size 2"),
    (lambda b: sf.all_to_all(b, ("x", "y"), 1, 0), (4, 6),
     r"all_to_all\(axis=\('x', 'y'\), split_dim=1, tiled=True\): x has shape \(4, 6\); split dim 1 has size 6, "
     r"which must be divisible by the axis size 4"),
    (lambda b: sf.all_to_all(b, "x", -1, 0), (4, 3),
     r"split dim 1 has size 3, which must be divisible by the axis size 2"),
], ids=["psum_scatter-untiled", "psum_scatter-tuple-dim1", "psum_scatter-neg-dim", "all_to_all-untiled",
        "all_to_all-tuple-split1", "all_to_all-neg-split"])
def test_indivisible_split_dims_are_spec_errors(call, shape, match):
    mesh = mesh_for({"x": 2, "y": 2})
    f = sf.shard_map(call, mesh, P(), P(), check=False)
    with pytest.raises(sf.SpecError, match=match):
        mesh.run(lambda: f(torch.zeros(shape)))


@pytest.mark.parametrize("n,shape,spec", [
    (5, {"x": 2}, P("x")), (2, {"x": 3}, P("x")), (7, {"x": 4}, P("x")),
    (7, {"x": 2, "y": 2}, P(("x", "y"))), (5, {"x": 2, "y": 2}, P("y", "x")),
], ids=["5-on-2", "2-on-3-empty", "7-on-4", "7-on-2x2", "5x3-on-2x2-2d"])
def test_scatter_gather_uneven_torch_chunk_blocks(n, shape, spec):
    """scatter hands out torch.chunk blocks (trailing ranks fewer or none); gather puts them
    back; scatter's backward is gather, gather's backward takes this rank's block."""
    from shardfn.testing._reference import split_blocks

    mesh = mesh_for(shape)
    gen = torch.Generator().manual_seed(n)
    X = torch.randn(n, 3, generator=gen, dtype=DTYPE)
    blocks = split_blocks(X, spec, mesh.shape)
    cts = [torch.randn(b.shape, generator=gen, dtype=DTYPE) for b in blocks]
    full_ct = torch.randn(X.shape, generator=gen, dtype=DTYPE)
    if len(spec) == 1:  # dim-0 sharding: the blocks are torch.chunk's, padded with empty blocks
        chunks = list(torch.chunk(X, mesh.size))
        chunks += [X[:0]] * (mesh.size - len(chunks))
        assert sorted(b.shape[0] for b in blocks) == sorted(c.shape[0] for c in chunks)

    def body():
        r = mesh.rank
        Xs = X.clone().requires_grad_()
        block = sf.scatter(Xs, mesh, spec, allow_empty=True)
        (block * cts[r]).sum().backward()
        xb = blocks[r].clone().requires_grad_()
        full = sf.gather(xb, mesh, spec)
        (full * full_ct).sum().backward()
        g_func = torch.func.grad(lambda b: (sf.gather(b, mesh, spec) * full_ct).sum())(blocks[r])
        _, tan = torch.func.jvp(lambda t: sf.scatter(t, mesh, spec, allow_empty=True), (X,), (full_ct,))
        return block.detach(), Xs.grad, full.detach(), xb.grad, g_func, tan

    from shardfn.testing._reference import join_blocks

    want_grad_X = join_blocks(cts, spec, mesh.shape)  # every rank's block cotangent, put back
    for r, (block, gX, full, gx, g_func, tan) in enumerate(mesh.run(body)):
        assert block.shape == blocks[r].shape
        torch.testing.assert_close(block, blocks[r], rtol=0, atol=0)
        torch.testing.assert_close(gX, want_grad_X, **TOL)
        torch.testing.assert_close(full, X, rtol=0, atol=0)
        torch.testing.assert_close(gx, split_blocks(full_ct, spec, mesh.shape)[r], rtol=0, atol=0)
        torch.testing.assert_close(g_func, gx, rtol=0, atol=0)
        torch.testing.assert_close(tan, split_blocks(full_ct, spec, mesh.shape)[r], rtol=0, atol=0)


def test_uneven_all_gather_by_ragged_all_to_all():
    """The recipe for gathering uneven blocks: every rank sends its whole block to every peer,
    at the block's global row offset. Gradient: each rank's block gets the sum over ranks of
    its rows' cotangents (all_gather's transpose, psum_scatter, on uneven blocks)."""
    mesh = mesh_for({"x": 3})
    X = torch.randn(7, 2, generator=torch.Generator().manual_seed(13), dtype=DTYPE)
    sizes = [len(c) for c in torch.chunk(X, 3)]  # 3, 3, 1
    starts = [sum(sizes[:i]) for i in range(3)]
    cts = [torch.randn(7, 2, generator=torch.Generator().manual_seed(14 + i), dtype=DTYPE) for i in range(3)]

    def gather_uneven(b):
        i = sf.axis_index("x")
        return sf.ragged_all_to_all(b, b.new_zeros(7, 2), [0] * 3, [sizes[i]] * 3, [starts[i]] * 3, sizes, "x")

    f = sf.shard_map(gather_uneven, mesh, P("x"), P("x"), check=False)

    def body():
        b = torch.chunk(X, 3)[mesh.rank].clone().requires_grad_()
        full = f(b)
        (full * cts[mesh.rank]).sum().backward()
        return full.detach(), b.grad

    total = sum(cts)
    for r, (full, grad) in enumerate(mesh.run(body)):
        torch.testing.assert_close(full, X, rtol=0, atol=0)
        torch.testing.assert_close(grad, torch.chunk(total, 3)[r], **TOL)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_uneven_blocks_on_processes_with_check_collectives(warm_functorch):
    """On processes a shape mismatch is caught by check_collectives (off by default: gloo
    then aborts a rank with "Received data size doesn't match expected size")."""
    from shardfn.testing import run_on_mesh

    x = torch.arange(10.0).reshape(5, 2)

    def body(mesh):
        f = sf.shard_map(lambda b: sf.all_gather(b, "x"), mesh, P("x"), P("x"), check=False)
        return f(torch.chunk(x, 2)[mesh.rank])

    with pytest.raises(Exception, match=r"DesyncError: collectives out of step over mesh axes \('x',\)"):
        run_on_mesh(body, {"x": 2}, backend="distributed", env={"SHARDFN_CHECK_COLLECTIVES": "1"})
