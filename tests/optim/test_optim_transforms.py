"""Lion, chain, weight-decay masks, scaling transforms, apply_updates and the public errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn.optim as optim
from optim_testutil import (
    assert_close,
    clone_tree,
    default_shapes,
    grad_sequence,
    leaves,
    make_tree,
    run_ours,
    seed_st,
    shapes_st,
    structure,
)

import optree


def _params(seed=0, dtype=torch.float64, shapes=None):
    return make_tree(shapes or default_shapes(), torch.Generator().manual_seed(seed), dtype)


# -- lion ------------------------------------------------------------------------------


def _lion_reference(params, grads_seq, lr, b1, b2, wd):
    """Lion written out per tensor from the paper's pseudo-code (decoupled decay)."""
    ps = [p.clone() for p in leaves(params)]
    mus = [torch.zeros_like(p) for p in ps]
    for grads in grads_seq:
        for i, g in enumerate(leaves(grads)):
            c = b1 * mus[i] + (1 - b1) * g
            ps[i] = ps[i] - lr * (torch.sign(c) + wd * ps[i])
            mus[i] = b2 * mus[i] + (1 - b2) * g
    return optree.tree_unflatten(structure(params), ps), mus


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    shapes=shapes_st,
    seed=seed_st,
    lr=st.floats(1e-4, 0.1),
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.0, 0.999),
    wd=st.sampled_from([0.0, 0.01, 0.3]),
)
def test_lion_matches_reference_formula(shapes, seed, lr, b1, b2, wd):
    params = _params(seed, shapes=shapes)
    grads = grad_sequence(params, seed + 1)
    ours, state = run_ours(optim.lion(lr, b1, b2, wd), params, grads)
    ref, mus = _lion_reference(params, grads, lr, b1, b2, wd)
    assert_close(ours, ref, what="params")
    assert_close(leaves(state[0].mu), mus, what="mu")
    assert int(state[0].count) == len(grads)


def test_lion_update_is_a_sign():
    params = _params(1)
    opt = optim.lion(0.5, weight_decay=0.0)
    updates, _ = opt.update(grad_sequence(params, 2, 1)[0], opt.init(params), params)
    for u in leaves(updates):
        assert set(u.abs().flatten().tolist()) <= {0.5}


# -- chain, identity, scaling ------------------------------------------------------------


def test_chain_composes_left_to_right_and_nests_state():
    opt = optim.chain(optim.scale(2.0), optim.trace(0.5), optim.scale(-1.0))
    params = {"w": torch.zeros(3, dtype=torch.float64)}
    state = opt.init(params)
    assert isinstance(state, tuple) and len(state) == 3
    assert isinstance(state[0], optim.EmptyState) and isinstance(state[1], optim.TraceState)
    g = {"w": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)}
    u, state = opt.update(g, state, params)
    torch.testing.assert_close(u["w"], -2.0 * g["w"])
    u, state = opt.update(g, state, params)
    torch.testing.assert_close(u["w"], -(2.0 * g["w"] + 0.5 * 2.0 * g["w"]))


def test_adamw_is_literally_a_chain_of_three():
    params = _params(3)
    grads = grad_sequence(params, 4)
    spelled = optim.chain(
        optim.scale_by_adam(0.9, 0.999, 1e-8), optim.add_decayed_weights(0.2), optim.scale_by_learning_rate(0.01)
    )
    a, sa = run_ours(spelled, params, grads)
    b, sb = run_ours(optim.adamw(0.01, weight_decay=0.2), params, grads)
    assert_close(a, b)
    assert type(sb[0]) is optim.ScaleByAdamState and type(sb[1]) is optim.EmptyState


def test_identity_and_scale():
    g = {"a": torch.ones(2), "b": [torch.ones(())]}
    assert optim.identity().update(g, optim.identity().init(g))[0] is g
    u, _ = optim.scale(0.25).update(g, optim.EmptyState())
    assert [t.tolist() for t in leaves(u)] == [[0.25, 0.25], 0.25]


def test_scale_by_schedule_counts_updates_done():
    seen = []
    opt = optim.scale_by_schedule(lambda k: seen.append(k) or float(k))
    g = {"w": torch.ones(2)}
    state = opt.init(g)
    outs = []
    for _ in range(4):
        u, state = opt.update(g, state)
        outs.append(u["w"][0].item())
    assert seen == [0, 1, 2, 3] and outs == [0.0, 1.0, 2.0, 3.0]
    assert int(state.count) == 4 and state.count.dtype == torch.int64


def test_scale_by_learning_rate_sign_and_schedule():
    g = {"w": torch.ones(1)}
    assert optim.scale_by_learning_rate(0.1).update(g, optim.EmptyState())[0]["w"].item() == pytest.approx(-0.1)
    assert optim.scale_by_learning_rate(0.1, flip_sign=False).update(g, optim.EmptyState())[0]["w"].item() == pytest.approx(0.1)
    opt = optim.scale_by_learning_rate(lambda k: 10.0 * (k + 1))
    state = opt.init(g)
    u, state = opt.update(g, state)
    u, state = opt.update(g, state)
    assert u["w"].item() == -20.0


# -- add_decayed_weights -------------------------------------------------------------------


def _decay_case():
    params = {"w": torch.full((2,), 2.0), "b": torch.full((1,), 2.0), "blocks": [{"w": torch.full((3,), 2.0)}]}
    zeros = optree.tree_map(torch.zeros_like, params)
    return params, zeros


@pytest.mark.parametrize(
    "mask",
    [
        {"w": True, "b": False, "blocks": [{"w": True}]},
        {"w": True, "b": False, "blocks": True},  # a prefix
        lambda p: optree.tree_map(lambda t: t.numel() > 1, p),  # a callable
    ],
)
def test_add_decayed_weights_mask(mask):
    params, zeros = _decay_case()
    opt = optim.add_decayed_weights(0.5, mask)
    u, _ = opt.update(zeros, opt.init(params), params)
    assert u["w"].tolist() == [1.0, 1.0]
    assert u["b"].tolist() == [0.0]
    assert u["blocks"][0]["w"].tolist() == [1.0, 1.0, 1.0]


def test_mask_lines_up_by_key_with_an_ordered_dict():
    """A plain-dict mask of a state_dict-like OrderedDict matches by key, not by position."""
    from collections import OrderedDict

    params = OrderedDict([("z", torch.full((2,), 2.0)), ("a", torch.full((1,), 2.0))])
    zeros = OrderedDict((k, torch.zeros_like(v)) for k, v in params.items())
    opt = optim.add_decayed_weights(0.5, mask={"a": False, "z": True})
    u, _ = opt.update(zeros, opt.init(params), params)
    assert u["z"].tolist() == [1.0, 1.0] and u["a"].tolist() == [0.0]


def test_adamw_mask_skips_decay_of_masked_leaves():
    params = _params(5)
    grads = grad_sequence(params, 6)
    no_decay = optree.tree_map(lambda t: t.dim() >= 2, params)
    masked, _ = run_ours(optim.adamw(0.05, weight_decay=0.5, mask=no_decay), params, grads)
    plain, _ = run_ours(optim.adamw(0.05, weight_decay=0.0), params, grads)
    decayed, _ = run_ours(optim.adamw(0.05, weight_decay=0.5), params, grads)
    for m, p, d, keep in zip(leaves(masked), leaves(plain), leaves(decayed), leaves(no_decay)):
        torch.testing.assert_close(m, d if keep else p, rtol=0, atol=1e-12)


def test_add_decayed_weights_errors():
    params, zeros = _decay_case()
    opt = optim.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match=r"add_decayed_weights.update: needs the current parameters"):
        opt.update(zeros, opt.init(params))
    bad = optim.add_decayed_weights(0.1, mask={"w": True})
    with pytest.raises(ValueError, match=r"`mask` must be a pytree of bools"):
        bad.update(zeros, bad.init(params), params)
    notbool = optim.add_decayed_weights(0.1, mask={"w": True, "b": "yes", "blocks": True})
    with pytest.raises(ValueError, match=r"mask entry for params\['b'\] is 'yes'"):
        notbool.update(zeros, notbool.init(params), params)


# -- apply_updates --------------------------------------------------------------------------


def test_apply_updates_adds_and_keeps_param_dtype():
    params = {"a": torch.ones(2, dtype=torch.bfloat16), "b": [torch.ones((), dtype=torch.float64)]}
    updates = {"a": torch.full((2,), 0.5), "b": [torch.tensor(-1.0, dtype=torch.float64)]}
    new = optim.apply_updates(params, updates)
    assert new["a"].dtype == torch.bfloat16 and new["a"].tolist() == [1.5, 1.5]
    assert new["b"][0].item() == 0.0
    assert params["a"].tolist() == [1.0, 1.0]


def test_empty_trees_pass_through():
    for opt in [optim.adamw(0.1), optim.sgd(0.1, 0.9), optim.lion(0.1), optim.clip_by_global_norm(1.0)]:
        state = opt.init({})
        u, state = opt.update({}, state, {})
        assert u == {}
    assert optim.apply_updates({}, {}) == {}


# -- errors ---------------------------------------------------------------------------------


def test_structure_mismatch_names_the_path():
    params = {"a": torch.zeros(2), "layers": [torch.zeros(1), torch.zeros(1)]}
    opt = optim.adam(0.1)
    state = opt.init(params)
    grads = {"a": torch.zeros(2), "layers": [torch.zeros(1)], "extra": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"scale_by_adam.update: the updates and `state.mu` have different tree") as e:
        opt.update(grads, state, params)
    assert "the updates have a leaf at ['extra'] where `state.mu` has one at ['layers'][0]" in str(e.value)
    grads = {"a": torch.zeros(2), "layers": [torch.zeros(1)]}
    with pytest.raises(ValueError, match=r"`state.mu` has a leaf at \['layers'\]\[1\] that the updates lack"):
        opt.update(grads, state, params)
    with pytest.raises(ValueError, match=r"apply_updates: the params and `updates` have different(.|\n)*the params have a leaf at \['layers'\]\[0\] that `updates` lacks"):
        optim.apply_updates(params, {"a": torch.zeros(2)})


def test_chain_errors():
    with pytest.raises(TypeError, match=r"chain: argument 1 is function, not a GradientTransformation"):
        optim.chain(optim.scale(1.0), optim.adamw)
    opt = optim.chain(optim.scale(1.0), optim.scale(2.0))
    with pytest.raises(ValueError, match=r"chain.update: the state holds 1 inner states but the chain has 2"):
        opt.update({}, (optim.EmptyState(),))


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: optim.adam(-1.0), r"adam: learning rate must be >= 0"),
        (lambda: optim.adamw(0.1, b1=1.0), r"scale_by_adam: b1 must be in \[0, 1\)"),
        (lambda: optim.adamw(0.1, b2=-0.1), r"scale_by_adam: b2 must be in \[0, 1\)"),
        (lambda: optim.adam(0.1, eps=-1.0), r"scale_by_adam: eps must be >= 0"),
        (lambda: optim.adamw(0.1, weight_decay=-1), r"adamw: weight_decay must be >= 0"),
        (lambda: optim.sgd(0.1, nesterov=True), r"sgd: nesterov=True needs momentum > 0"),
        (lambda: optim.sgd(0.1, momentum=-0.5), r"sgd: momentum must be >= 0"),
        (lambda: optim.lion(0.1, b1=1.0), r"scale_by_lion: b1 must be in \[0, 1\)"),
        (lambda: optim.lion(0.1, b2=1.5), r"scale_by_lion: b2 must be in \[0, 1\)"),
    ],
)
def test_invalid_hyperparameters(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_pure_update_does_not_share_state_between_calls():
    """Pure mode: an old state stays valid; updating from it twice gives the same result."""
    params = _params(7)
    g = grad_sequence(params, 8, 1)[0]
    opt = optim.adamw(0.1)
    state = opt.init(params)
    u1, s1 = opt.update(clone_tree(g), state, params)
    u2, s2 = opt.update(clone_tree(g), state, params)
    assert_close(u1, u2)
    assert int(state[0].count) == 0 and int(s1[0].count) == 1
