"""Varying-axis types in shard_map ([Note: varying axes], [Note: typed transposes]).

Properties: random meshes (up to 3-D), axis_names subsets, specs and shapes; programs in
which invariant and varying values meet (so pvary is inserted) around one collective;
values, VJP and JVP against the one-thread reference, under both rules (check_vma True
and False). Traffic: what the types save, read from the backend's recording. Misuse:
every error, matched by message.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn.testing._reference import C, shmap_reference
from traffic import sent

P = sf.P
F64 = torch.float64
OPS = ("psum", "pmean", "pmax", "all_gather", "psum_scatter", "ppermute", "all_to_all", "none")


def _maxdiff(a, b) -> float:
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))


# -- the property ------------------------------------------------------------------------


def _vma_after(op: str, vma: set, axes: tuple) -> set:
    if op in ("psum", "pmean", "pmax", "all_gather"):
        return vma - set(axes)
    if op in ("psum_scatter", "ppermute", "all_to_all"):
        return vma | set(axes)
    return set(vma)


@st.composite
def _cases(draw):
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    shape = {n: draw(st.integers(1, 3)) for n in names}
    assume(math.prod(shape.values()) <= 8)  # rank threads on a 2-core machine
    op = draw(st.sampled_from(OPS))
    axes = tuple(draw(st.permutations(names))[: draw(st.integers(1, len(names)))])
    k = math.prod(shape[a] for a in axes)
    unused = list(names)
    x_entries = [None, None]
    for a in names:
        if draw(st.booleans()):
            d = draw(st.integers(0, 1))
            x_entries[d] = a if x_entries[d] is None else (
                (x_entries[d] if isinstance(x_entries[d], tuple) else (x_entries[d],)) + (a,))
            unused.remove(a)
    x_spec = P(*x_entries)
    w_axes = tuple(a for a in names if draw(st.booleans()))
    w_spec = P(w_axes if w_axes else None)
    block = [draw(st.integers(1, 2)) * (k if op in ("psum_scatter", "all_to_all") else 1), draw(st.integers(1, 3))]

    def size(entry):
        return 1 if entry is None else math.prod(shape[a] for a in (entry if isinstance(entry, tuple) else (entry,)))

    x_shape = tuple(b * size(e) for b, e in zip(block, x_entries))
    w_shape = (size(w_spec[0]),)
    used = set(x_spec.axes) | set(w_axes) | set(axes if op != "none" else ())
    axis_names = sorted(used | {a for a in names if draw(st.booleans())}, key=names.index)
    assume(axis_names)
    if op != "none":
        assume(set(axes) <= set(axis_names))
    vma = _vma_after(op, set(x_spec.axes) | set(w_axes), axes) | set(w_axes)
    extra = [a for a in axis_names if a not in vma and draw(st.booleans())]  # invariant, named: lifted at the output
    y_spec = P(tuple(a for a in axis_names if a in vma or a in extra) or None)
    w_extra = [a for a in axis_names if a not in w_axes and draw(st.booleans())]
    w_out = P(tuple(a for a in axis_names if a in w_axes or a in w_extra) or None)
    perm = draw(st.permutations(range(k)))
    return dict(shape=shape, op=op, axes=axes, x_spec=x_spec, w_spec=w_spec, x_shape=x_shape, w_shape=w_shape,
                axis_names=axis_names, y_spec=y_spec, w_out=w_out, perm=[(i, p) for i, p in enumerate(perm)])


def _program(case):
    op, axes = case["op"], case["axes"]

    def f(x, w):
        h = torch.tanh(x) * w  # invariant meets varying: the types insert pvary
        if op in ("psum", "pmean", "pmax"):
            y = getattr(C, op)(h, axes)
        elif op == "all_gather":
            y = C.all_gather(h, axes, dim=0)
        elif op == "psum_scatter":
            y = C.psum_scatter(h, axes, dim=0)
        elif op == "ppermute":
            y = C.ppermute(h, axes, case["perm"])
        elif op == "all_to_all":
            y = C.all_to_all(h, axes, 0, 1)
        else:
            y = h
        z = y.unsqueeze(0).sum(-1)  # (1, rows): the leading dim carries every axis it varies over
        return z + 0.5 * z * z * w.sum(), w * 3.0

    return f


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_cases(), st.booleans())
def test_typed_shard_map_equals_the_reference(case, check_vma):
    """Values, VJP and JVP of the global function, under the types and under the boundary rule."""
    mesh = sf.local_mesh(case["shape"])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(case["x_shape"], generator=gen, dtype=F64)
    w = torch.randn(case["w_shape"], generator=gen, dtype=F64)
    in_specs, out_specs = (case["x_spec"], case["w_spec"]), (case["y_spec"], case["w_out"])
    reference = shmap_reference(_program(case), case["shape"], in_specs, out_specs)
    f = sf.shard_map(_program(case), mesh, in_specs, out_specs, axis_names=set(case["axis_names"]),
                     check_vma=check_vma)

    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = f(xs, ws)  # the main thread: global values in and out
    want = reference(x, w)
    assert _maxdiff(got, want) <= 1e-12, case
    cts = [torch.randn(t.shape, generator=gen, dtype=F64) for t in want]
    torch.autograd.backward(got, cts)
    _, pullback = torch.func.vjp(reference, x, w)
    assert _maxdiff((xs.grad, ws.grad), pullback(tuple(cts))) <= 1e-10, case

    tx, tw = torch.randn_like(x), torch.randn_like(w)
    _, want_t = torch.func.jvp(reference, (x, w), (tx, tw))

    def jvp_on_a_rank():
        blocks = [sf.scatter(v, mesh, s) for v, s in zip((x, w, tx, tw), in_specs * 2)]
        _, tangents = torch.func.jvp(f, tuple(blocks[:2]), tuple(blocks[2:]))
        return [sf.gather(t, mesh, s) for t, s in zip(tangents, out_specs)]

    for tangents in mesh.run(jvp_on_a_rank):
        assert _maxdiff(tangents, want_t) <= 1e-10, case


# -- what the types save: the backend's recording -----------------------------------------


def _recorded(mesh, fn):
    """On every rank, the (op, axes) of each collective `fn` sends (rank 0's list)."""
    def body():
        with sent() as rec:
            fn()
        return [(c.op, c.axes) for c in rec.records]

    lists = mesh.run(body)
    assert all(other == lists[0] for other in lists), lists
    return lists[0]


@pytest.mark.parametrize("check_vma", [True, False])
def test_the_default_replication_check_sends_nothing(check_vma):
    mesh = sf.local_mesh({"i": 2, "j": 2})
    body = sf.shard_map(lambda x: sf.psum(x * x, "i"), mesh, P(("i", "j")), P("j"), check_vma=check_vma)
    x = torch.arange(4.0)
    assert _recorded(mesh, lambda: body(sf.scatter(x, mesh, P(("i", "j"))))) == [("all_reduce", ("i",))]
    debug = sf.shard_map(lambda x: sf.psum(x * x, "i"), mesh, P(("i", "j")), P("j"), check=True, check_vma=check_vma)
    # check=True: the arguments' structure (first call) and the fingerprints of the output (every call)
    first = _recorded(mesh, lambda: debug(sf.scatter(x, mesh, P(("i", "j")))))
    assert first == [("all_reduce", ("i", "j"))] + [("all_reduce", ("i",))] * 2
    assert _recorded(mesh, lambda: debug(sf.scatter(x, mesh, P(("i", "j"))))) == [("all_reduce", ("i",))] * 2


def _backward_traffic(mesh, f, *args):
    """The collectives of the backward alone (vjp on every rank)."""
    def body():
        out, pullback = torch.func.vjp(f, *args)
        with sent() as rec:
            pullback(torch.ones_like(out))
        return [(c.op, c.axes) for c in rec.records]

    return mesh.run(body)[0]


def test_psum_to_a_replicated_output_costs_nothing_in_the_backward():
    mesh = sf.local_mesh({"i": 2})
    f = lambda x: sf.psum((x * x).sum(), "i")  # noqa: E731
    typed = sf.shard_map(f, mesh, P("i"), P())
    untyped = sf.shard_map(f, mesh, P("i"), P(), check_vma=False)
    x = torch.ones(2, dtype=F64)
    assert _backward_traffic(mesh, typed, x) == []
    assert _backward_traffic(mesh, untyped, x) == [("all_reduce", ("i",))]


def _megatron(mesh, check_vma):
    def mlp(x, w1, w2):  # x replicated; w1 column- and w2 row-sharded over 'm'
        return sf.psum(torch.tanh(x @ w1) @ w2, "m")

    return sf.shard_map(mlp, mesh, (P(), P(None, "m"), P("m", None)), P(), check_vma=check_vma)


def test_megatron_mlp_backward_sends_one_all_reduce_for_the_input_gradient():
    mesh = sf.local_mesh({"m": 2})
    gen = torch.Generator().manual_seed(1)
    x, w1, w2 = (torch.randn(s, generator=gen, dtype=F64) for s in ((5, 3), (3, 8), (8, 3)))

    def blocks():
        return x, sf.scatter(w1, mesh, P(None, "m")), sf.scatter(w2, mesh, P("m", None))

    def traffic(check_vma):
        def body():
            xb, w1b, w2b = blocks()
            out, pullback = torch.func.vjp(_megatron(mesh, check_vma), xb, w1b, w2b)
            with sent() as rec:
                grads = pullback(torch.ones_like(out))
            return [(c.op, c.axes) for c in rec.records], grads

        return mesh.run(body)

    typed, untyped = traffic(True), traffic(False)
    assert typed[0][0] == [("all_reduce", ("m",))]  # Megatron's f: the input's gradient, once
    assert untyped[0][0] == [("all_reduce", ("m",))] * 2  # psum's transpose, and the input boundary's
    ref = torch.func.grad(lambda *a: (torch.tanh(a[0] @ a[1]) @ a[2]).sum(), argnums=(0, 1, 2))(x, w1, w2)
    for (_, (gx, g1, g2)), rank in zip(typed, range(2)):
        assert _maxdiff((gx,), (ref[0],)) <= 1e-12
        assert _maxdiff((g1, g2), (sf.testing.split_blocks(ref[1], P(None, "m"), {"m": 2})[rank],
                                   sf.testing.split_blocks(ref[2], P("m", None), {"m": 2})[rank])) <= 1e-12


def test_a_lifted_all_gather_transposes_to_one_reduce_scatter():
    """Sequence parallelism: gathered activations times a sharded weight. The lifted gather's
    cotangent is reduce-scattered, not all-reduced and sliced."""
    mesh = sf.local_mesh({"m": 2})
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 3, generator=gen, dtype=F64), torch.randn(3, 6, generator=gen, dtype=F64)

    def sp(xb, wb):
        return sf.all_gather(xb, "m", dim=0) @ wb  # (4, 3) @ (3, 3): varies over 'm'

    f = sf.shard_map(sp, mesh, (P("m"), P(None, "m")), P(None, "m"))
    got = f(x.clone().requires_grad_(), w)
    torch.testing.assert_close(got, x @ w, rtol=0, atol=1e-12)

    def body():
        xb, wb = sf.scatter(x, mesh, P("m")), sf.scatter(w, mesh, P(None, "m"))
        out, pullback = torch.func.vjp(f, xb, wb)
        with sent() as rec:
            gx, _ = pullback(torch.ones_like(out))
        return [(c.op, c.axes) for c in rec.records], gx

    want = torch.func.grad(lambda x: (x @ w).sum())(x)
    for rank, (records, gx) in enumerate(mesh.run(body)):
        assert records == [("reduce_scatter", ("m",))]
        torch.testing.assert_close(gx, want[2 * rank: 2 * rank + 2], rtol=0, atol=1e-12)


def test_a_value_lifted_twice_is_summed_once():
    mesh = sf.local_mesh({"m": 2})
    f = sf.shard_map(lambda x, a, b: sf.psum((x * a).sum() + (x * b).sum(), "m"), mesh, (P(), P("m"), P("m")), P())
    x = torch.ones(3, dtype=F64)
    assert _backward_traffic(mesh, lambda x: f(x, torch.ones(3, dtype=F64), torch.ones(3, dtype=F64)), x) == [
        ("all_reduce", ("m",))]


# -- misuse ---------------------------------------------------------------------------------


def test_an_in_place_write_of_varying_values_into_an_invariant_tensor_that_needs_grad():
    mesh = sf.local_mesh({"i": 2})

    def f(w, x):
        w = w * 1.0
        w.add_(x)
        return w

    g = sf.shard_map(f, mesh, (P(), P("i")), P("i"))
    with pytest.raises(sf.ShardingError, match=r"(?s)in-place add_ writes values that vary over mesh axes \['i'\] "
                                               r"into a tensor of shape \(2,\) that requires grad.*Fix: write it "
                                               r"out of place .* sf.pvary\(x, \('i',\)\)"):
        g(torch.ones(2, requires_grad=True), torch.ones(4))
    # lifted first, or without grad, it is fine
    lifted = sf.shard_map(lambda w, x: sf.pvary(w * 1.0, "i").add_(x), mesh, (P(), P("i")), P("i"))
    torch.testing.assert_close(lifted(torch.ones(2, requires_grad=True), torch.ones(4)), torch.full((4,), 2.0))
    torch.testing.assert_close(g(torch.ones(2), torch.ones(4)), torch.full((4,), 2.0))


def test_one_collective_cannot_mix_typed_and_untyped_axes():
    mesh = sf.local_mesh({"data": 2, "model": 2})
    inner = sf.shard_map(lambda x: sf.psum(x, ("model", "data")), mesh, P("model"), P(), axis_names={"model"})
    outer = sf.shard_map(lambda x: inner(x), mesh, P("data"), P(), axis_names={"data"}, check_vma=False)
    with pytest.raises(sf.SpecError, match=r"(?s)psum\(axis=\('model', 'data'\)\): \['model'\] belong to a "
                                           r"shard_map with varying-axis types.*\['data'\] to enclosing code "
                                           r"without them.*Fix: call psum once per kind of axis"):
        outer(torch.ones(8))


def test_pvary_names_only_manual_axes_and_is_the_identity_without_types():
    mesh = sf.local_mesh({"data": 2, "model": 2})
    f = sf.shard_map(lambda x: sf.pvary(x, "model"), mesh, P("data"), P("data"), axis_names={"data"})
    with pytest.raises(sf.SpecError, match=r"pvary\(axis='model'\): \['model'\] are not manual here"):
        f(torch.ones(4))
    g = sf.shard_map(lambda x: sf.pvary(x, "data") * 2, mesh, P(), P(), check_vma=False)
    torch.testing.assert_close(g(torch.ones(2)), torch.full((2,), 2.0))


def test_axis_index_is_a_varying_tensor_in_typed_bodies_and_an_int_elsewhere():
    mesh = sf.local_mesh({"i": 2})
    typed = sf.shard_map(lambda x: x * (sf.axis_index("i") + 1), mesh, P(), P("i"))
    torch.testing.assert_close(typed(torch.ones(2)), torch.tensor([1.0, 1.0, 2.0, 2.0]))
    with pytest.raises(sf.ShardingError, match=r"the output: varies over \['i'\]"):
        sf.shard_map(lambda x: x * (sf.axis_index("i") + 1), mesh, P(), P())(torch.ones(2))
    kinds = mesh.run(lambda: sf.shard_map(lambda x: (type(sf.axis_index("i")).__name__, x), mesh, P(), P(),
                                          check_vma=False)(torch.ones(1))[0])
    assert kinds == ["int", "int"]


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
def test_remat_inside_a_typed_body_keeps_the_types(policy):
    """The recompute re-enters the body's types: the replicated input's lift (and its
    gradient's psum) happens again in the backward, and outputs keep their types."""
    mesh = sf.local_mesh({"m": 2})
    gen = torch.Generator().manual_seed(3)
    x, w1, w2 = (torch.randn(s, generator=gen, dtype=F64) for s in ((5, 3), (3, 8), (8, 3)))

    def block(x, w1, w2):
        return torch.tanh(x @ w1) @ w2

    remat = sf.remat(block, policy=getattr(sf.remat_policies, policy))
    specs = (P(), P(None, "m"), P("m", None))
    f = sf.shard_map(lambda *a: sf.psum(remat(*a), "m"), mesh, specs, P())
    args = [t.clone().requires_grad_() for t in (x, w1, w2)]
    f(*args).sum().backward()
    want = torch.func.grad(lambda *a: block(*a).sum(), argnums=(0, 1, 2))(x, w1, w2)
    assert _maxdiff([a.grad for a in args], want) <= 1e-12
    with pytest.raises(sf.ShardingError, match=r"the output: varies over \['m'\]"):
        sf.shard_map(remat, mesh, specs, P())(x, w1, w2)


def test_outputs_leave_the_scope_untyped_and_picklable():
    # A type names its scope, which holds the mesh (gloo groups, locks): kept on an output
    # it pinned the mesh and made the tensor fail torch.save / pickling between processes.
    import io
    import pickle

    mesh = sf.local_mesh({"x": 2})
    f = sf.shard_map(lambda a: (sf.psum(a, "x"), a * 2), mesh, in_specs=sf.P("x"), out_specs=(sf.P(), sf.P("x")))

    def body():
        outs = f(torch.ones(2, dtype=torch.float64) * (mesh.rank + 1))  # this rank's block
        buf = io.BytesIO()
        torch.save(outs, buf)
        return [hasattr(o, "_sf_vma") for o in outs], [o.tolist() for o in pickle.loads(pickle.dumps(outs))]

    assert mesh.run(body) == [([False, False], [[3.0, 3.0], [2.0, 2.0]]), ([False, False], [[3.0, 3.0], [4.0, 4.0]])]
