"""Per-group optimizers (optax's multi_transform, masked, set_to_zero) against torch.optim
param groups on one device."""

from __future__ import annotations

import pytest
import torch

import shardfn.optim as optim
from optim_testutil import assert_close, clone_tree, leaves

STEPS = 10


def _model(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return {
        "emb": r(11, 6),
        "layers": [{"w": r(6, 6), "b": r(6), "norm": r(6)}, {"w": r(4, 6), "b": r(4), "norm": r(4)}],
        "head": r(3, 4),
    }


def _grads(params, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [optree_map(lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype), params) for _ in range(STEPS)]


def optree_map(fn, tree):
    import optree

    return optree.tree_map(fn, tree, namespace="shardfn")


def _hidden(path, p):
    return "muon" if p.ndim == 2 and path[0] == "layers" else "adamw"


def _run(opt, params, grads):
    params = clone_tree(params)
    state = opt.init(params)
    for g in grads:
        u, state = opt.update(clone_tree(g), state, params)
        params = optim.apply_updates(params, u)
    return params, state


def _torch_groups(params, grads, groups):
    """groups: [(leaf-selector(path, p) -> bool, factory(list of tensors) -> torch optimizer)]"""
    import optree

    paths, ps, treedef = optree.tree_flatten_with_path(params, namespace="shardfn")
    ts = [p.clone().requires_grad_() for p in ps]
    opts = []
    for select, make in groups:
        chosen = [t for path, p, t in zip(paths, ps, ts) if select(path, p)]
        if chosen:
            opts.append(make(chosen))
    for g in grads:
        for t, gi in zip(ts, leaves(g)):
            t.grad = gi.clone()
        for o in opts:
            o.step()
    return optree.tree_unflatten(treedef, [t.detach() for t in ts])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_muon_on_hidden_matrices_adamw_elsewhere_equals_torch(dtype):
    params = _model(dtype)
    grads = _grads(params)
    opt = optim.multi_transform({"muon": optim.muon(0.02), "adamw": optim.adamw(3e-3, weight_decay=0.01)}, _hidden)
    ours, state = _run(opt, params, grads)
    ref = _torch_groups(params, grads, [
        (lambda path, p: _hidden(path, p) == "muon", lambda ps: torch.optim.Muon(ps, lr=0.02)),
        (lambda path, p: _hidden(path, p) == "adamw", lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01)),
    ])
    assert_close(ours, ref)
    # each group's state holds its own leaves only
    muon_state = state.inner_states["muon"][0]
    assert [tuple(t.shape) for t in leaves(muon_state.momentum)] == [(6, 6), (4, 6)]
    adam_state = state.inner_states["adamw"][0]
    assert len(leaves(adam_state.mu)) == 6  # emb, head, 2 biases, 2 norms


def test_no_decay_on_norms_and_biases_equals_torch_param_groups():
    params = _model(torch.float64)
    grads = _grads(params, 2)

    def decays(path):  # a function of the key path only
        return path[-1] not in ("b", "norm")

    opt = optim.multi_transform({True: optim.adamw(1e-2, weight_decay=0.3), False: optim.adamw(1e-2, weight_decay=0.0)},
                                decays)
    ours, _ = _run(opt, params, grads)
    ref = _torch_groups(params, grads, [
        (lambda path, p: decays(path), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.3)),
        (lambda path, p: not decays(path), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0)),
    ])
    assert_close(ours, ref)


def test_masked_decay_is_the_same_as_two_groups():
    params = _model(torch.float64)
    grads = _grads(params, 3)
    mask = lambda path, p: p.ndim == 2  # noqa: E731
    opt = optim.chain(optim.scale_by_adam(), optim.masked(optim.add_decayed_weights(0.3), mask),
                      optim.scale_by_learning_rate(1e-2))
    ours, _ = _run(opt, params, grads)
    ref = _torch_groups(params, grads, [
        (mask, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.3)),
        (lambda path, p: not mask(path, p), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0)),
    ])
    assert_close(ours, ref)


def test_masked_passes_the_other_leaves_through_unchanged():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    opt = optim.masked(optim.sgd(0.5), {"w": True, "b": False})
    grads = {"w": torch.full((2, 2), 2.0), "b": torch.full((2,), 7.0)}
    u, state = opt.update(grads, opt.init(params), params)
    assert torch.equal(u["w"], torch.full((2, 2), -1.0))
    assert u["b"] is grads["b"]
    assert isinstance(state, optim.MaskedState)


def test_frozen_group_and_label_prefix_tree():
    params = _model(torch.float32)
    grads = _grads(params, 4)
    labels = {"emb": "frozen", "layers": "train", "head": "train"}  # a prefix: one label per subtree
    opt = optim.multi_transform({"train": optim.adamw(1e-2), "frozen": optim.set_to_zero()}, labels)
    ours, state = _run(opt, params, grads)
    assert torch.equal(ours["emb"], params["emb"])
    assert not torch.equal(ours["head"], params["head"])
    assert state.inner_states["frozen"] == optim.EmptyState()
    assert "emb" in state.inner_states["train"][0].mu and state.inner_states["train"][0].mu["emb"] is None


def test_a_label_without_a_transform_names_the_leaf():
    opt = optim.multi_transform({"a": optim.sgd(0.1)}, {"w": "a", "b": "bias"})
    with pytest.raises(ValueError, match=r"(?s)params\['b'\]: label 'bias'.*Fix: add a transform"):
        opt.init({"w": torch.ones(2), "b": torch.ones(2)})


def test_a_bad_label_tree_is_a_spec_error_naming_the_path():
    import shardfn as sf

    opt = optim.multi_transform({"a": optim.sgd(0.1)}, {"w": "a", "x": "a"})
    with pytest.raises(sf.SpecError, match="labels"):
        opt.init({"w": torch.ones(2), "b": torch.ones(2)})


def test_uncalled_transform_is_a_type_error():
    with pytest.raises(TypeError, match="did you forget to call it"):
        optim.multi_transform({"a": optim.adamw}, lambda path: "a")
