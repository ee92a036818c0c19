"""SOAP against a single-device implementation written here from the paper's Algorithm 3
(Vyas et al. 2024), on one device and on shards (the owner keeps the matrix's state and
runs the eigendecompositions)."""

from __future__ import annotations

import math

import pytest
import torch

import shardfn as sf
import shardfn.optim as optim
from matrix_cases import blocks, grads_of, rel_err, tree_of
from optim_testutil import clone_tree
from shardfn._backend import ops
from shardfn._spec import chunk_bounds

SHAPES = {"a": (6, 4), "b": (3, 5), "c": (5, 5), "d": (1, 3)}
FREQ = 3
LR, WD, B1, B2, EPS = 0.01, 0.01, 0.9, 0.95, 1e-8


def soap_reference(w, grads, lr=LR, wd=WD, b1=B1, b2=B2, bs=B2, eps=EPS, freq=FREQ):
    """Algorithm 3 of the SOAP paper for one matrix, eigenbasis by eigh every `freq` Adam steps;
    the first gradient only builds the basis (as the paper's code). Decoupled decay."""
    m, n = w.shape
    L, R = torch.zeros(m, m, dtype=w.dtype), torch.zeros(n, n, dtype=w.dtype)
    M, V = torch.zeros_like(w), torch.zeros_like(w)
    QL = QR = None
    for t, G in enumerate(grads, start=1):
        if t == 1:
            L, R = torch.lerp(L, G @ G.T, 1 - bs), torch.lerp(R, G.T @ G, 1 - bs)
            QL, QR = torch.linalg.eigh(L)[1], torch.linalg.eigh(R)[1]
            w = w - lr * wd * w
            continue
        s = t - 1
        Gp = QL.T @ G @ QR  # the gradient in the eigenbasis
        M = torch.lerp(M, G, 1 - b1)
        Mp = QL.T @ M @ QR
        V = torch.lerp(V, Gp * Gp, 1 - b2)
        N = QL @ ((Mp / (1 - b1 ** s)) / ((V / (1 - b2 ** s)).sqrt() + eps)) @ QR.T
        w = w - lr * (N + wd * w)
        L, R = torch.lerp(L, G @ G.T, 1 - bs), torch.lerp(R, G.T @ G, 1 - bs)
        if s % freq == 0:
            QL, QR = torch.linalg.eigh(L)[1], torch.linalg.eigh(R)[1]
    return w


def _opt(**kw):
    return optim.soap(LR, B1, B2, eps=EPS, weight_decay=WD, precondition_frequency=FREQ, **kw)


def _run(opt, params, grads):
    params = clone_tree(params)
    state = opt.init(params)
    for g in grads:
        u, state = opt.update(clone_tree(g), state, params)
        params = optim.apply_updates(params, u)
    return params, state


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_soap_equals_the_papers_algorithm_for_ten_steps(dtype, tol):
    params = tree_of(SHAPES, 0, dtype)
    grads = grads_of(SHAPES, 1, dtype)
    ref = {k: soap_reference(params[k], [g[k] for g in grads]) for k in SHAPES}
    ours, state = _run(_opt(), params, grads)
    assert rel_err(ours, ref) <= tol
    assert state[0].ql["a"].shape == (6, 6) and state[0].qr["a"].shape == (4, 4)


@pytest.mark.parametrize("n", [2, 4])
def test_sharded_soap_equals_unsharded_with_state_on_the_owner(n):
    dtype = torch.float64
    params = tree_of(SHAPES, 0, dtype)
    grads = grads_of(SHAPES, 1, dtype)
    ref, _ = _run(_opt(), params, grads)
    mesh = sf.local_mesh({"data": n})
    opt = _opt(mesh=mesh, specs=sf.P("data"))

    def rank_fn():
        r = mesh.coords["data"]
        shards = blocks(params, n, r)
        state = opt.init(shards)
        for g in grads:
            with ops.recording() as rec:
                u, state = opt.update(blocks(g, n, r), state, shards)
            shards = optim.apply_updates(shards, u)
        owners = {p[0]: o for p, (_, o) in opt.update.owners(shards).items()}
        return r, shards, state, [(c.op, c.nbytes) for c in rec.records], owners

    for r, shards, state, records, owners in mesh.run(rank_fn):
        for k in SHAPES:
            assert torch.equal(shards[k], blocks(ref, n, r)[k]), (r, k)
            m, nn = SHAPES[k]
            want = (m, m) if owners[k] == r else (0,)  # whole on the owner, empty elsewhere
            assert state[0].l[k].shape == want
        gather = sum(math.prod(s) // s[0] * (lambda b: b[1] - b[0])(chunk_bounds(s[0], n, r)) * 8
                     for k, s in SHAPES.items() if owners[k] != r)
        scatter = sum((math.prod(s) - math.prod(s) // s[0] * (lambda b: b[1] - b[0])(chunk_bounds(s[0], n, r))) * 8
                      for k, s in SHAPES.items() if owners[k] == r)
        assert records == [("ragged_all_to_all", gather), ("ragged_all_to_all", scatter)]


def test_soap_with_adamw_on_the_other_leaves():
    shapes = dict(SHAPES, bias=(4,))
    params = tree_of(shapes, 2, torch.float64)
    grads = grads_of(shapes, 3, torch.float64)
    opt = optim.multi_transform({"soap": _opt(), "adamw": optim.adamw(1e-2)},
                                lambda path, p: "soap" if p.ndim == 2 else "adamw")
    ours, _ = _run(opt, params, grads)
    assert rel_err({k: ours[k] for k in SHAPES}, {k: soap_reference(params[k], [g[k] for g in grads])
                                                  for k in SHAPES}) <= 1e-12


def test_soap_refuses_a_leaf_that_is_not_2d():
    opt = _opt()
    params = {"w": torch.ones(3, 3), "b": torch.ones(3)}
    with pytest.raises(ValueError, match=r"(?s)params\['b'\]: shape \(3,\).*multi_transform"):
        opt.update(params, opt.init(params), params)
