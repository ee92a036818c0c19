"""Helpers for the optimizer tests: trees, random gradients, torch.optim references, tolerances."""

from __future__ import annotations

import optree
import torch
from hypothesis import strategies as st

import shardfn.optim as optim

NS = "shardfn"
STEPS = 20


def leaves(tree):
    return optree.tree_leaves(tree, namespace=NS)


def structure(tree):
    return optree.tree_structure(tree, namespace=NS)


def default_shapes():
    """Several ranks of leaves, 0-dim included."""
    return [(4, 3), (5,), (), (2, 2, 2), (3, 1), ()]


def make_tree(shapes, gen, dtype=torch.float64):
    """A nested dict/list tree whose leaves have the given shapes (in flattening order)."""
    ts = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    half = max(1, len(ts) // 2)
    layers = [{"w": t} if i % 2 == 0 else {"b": t} for i, t in enumerate(ts[:half])]
    rest = ts[half:]
    head = {f"p{i}": [t] if i % 2 else t for i, t in enumerate(rest)}
    return {"layers": layers, "head": head}


def random_like(tree, gen):
    return optree.tree_map(
        lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype), tree, namespace=NS
    )


def grad_sequence(params, seed, steps=STEPS):
    gen = torch.Generator().manual_seed(seed)
    return [random_like(params, gen) for _ in range(steps)]


def clone_tree(tree):
    return optree.tree_map(lambda t: t.clone(), tree, namespace=NS)


def run_ours(opt, params, grads_seq, *, inplace_apply=False):
    """Run ``opt`` for len(grads_seq) steps; gradients are cloned (in-place mode consumes them)."""
    params = clone_tree(params)
    state = opt.init(params)
    for g in grads_seq:
        updates, state = opt.update(clone_tree(g), state, params)
        params = optim.apply_updates(params, updates, inplace=inplace_apply)
    return params, state


def run_torch(make_opt, params, grads_seq, make_sched=None):
    """Run a torch.optim optimizer (and scheduler, stepped after it) on the tree's leaves."""
    ps = [p.clone().requires_grad_() for p in leaves(params)]
    opt = make_opt(ps)
    sched = make_sched(opt) if make_sched else None
    for g in grads_seq:
        for p, gi in zip(ps, leaves(g)):
            p.grad = gi.clone()
        opt.step()
        if sched is not None:
            sched.step()
    out = optree.tree_unflatten(structure(params), [p.detach() for p in ps])
    return out, opt, ps


def assert_close(ours, ref, dtype=None, what="tree"):
    """Same structure; float64: max abs diff <= 1e-10; float32: <= 1e-6 relative.

    float32's bound is relative to the scale of the values, max(|ref|, 1) per leaf (the
    params start ~N(0, 1)); a leaf that shrinks towards 0 keeps the rounding of its
    O(1) history, so its own magnitude is not the scale.
    """
    assert structure(ours) == structure(ref), f"{what}: {structure(ours)} != {structure(ref)}"
    for i, (a, b) in enumerate(zip(leaves(ours), leaves(ref))):
        assert a.shape == b.shape, f"{what} leaf {i}: shape {a.shape} != {b.shape}"
        dt = dtype or b.dtype
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        if dt == torch.float64:
            tol = 1e-10
        else:
            tol = 1e-6 * max(b.double().abs().max().item() if b.numel() else 0.0, 1.0)
        assert diff <= tol, f"{what} leaf {i} {tuple(b.shape)}: max abs diff {diff:.3e} > {tol:.1e}"


def tree_bytes(tree):
    return sum(t.numel() * t.element_size() for t in leaves(tree))


# -- hypothesis strategies -------------------------------------------------------------
shape_st = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
shapes_st = st.lists(shape_st, min_size=1, max_size=6)
lr_st = st.floats(1e-4, 0.3)
beta_st = st.floats(0.0, 0.999)
wd_st = st.sampled_from([0.0, 1e-3, 0.1, 0.5])
seed_st = st.integers(0, 2**31 - 1)
