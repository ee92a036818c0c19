"""In-place mode (same numbers, same buffers, no allocations) and pure mode (inputs untouched)."""

from __future__ import annotations

import optree
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import shardfn.optim as optim
from optim_testutil import (
    NS,
    assert_close,
    clone_tree,
    default_shapes,
    grad_sequence,
    leaves,
    make_tree,
    run_ours,
)

OPTIMIZERS = {
    "sgd": lambda inplace: optim.sgd(0.05, inplace=inplace),
    "sgd-momentum-wd": lambda inplace: optim.sgd(0.05, 0.9, weight_decay=0.1, inplace=inplace),
    "sgd-nesterov": lambda inplace: optim.sgd(0.05, 0.9, nesterov=True, inplace=inplace),
    "adam-l2": lambda inplace: optim.adam(0.01, weight_decay=0.1, inplace=inplace),
    "adamw": lambda inplace: optim.adamw(0.01, inplace=inplace),
    "adamw-schedule-mask": lambda inplace: optim.adamw(
        optim.warmup_cosine_decay_schedule(0.0, 0.01, 3, 20), weight_decay=0.3,
        mask=lambda p: optree.tree_map(lambda t: t.dim() > 1, p, namespace=NS), inplace=inplace,
    ),
    "lion": lambda inplace: optim.lion(0.01, weight_decay=0.1, inplace=inplace),
    "clip+adamw": lambda inplace: optim.chain(
        optim.clip_by_global_norm(0.5, inplace=inplace), optim.adamw(0.01, inplace=inplace)
    ),
}


def _params(seed=0, dtype=torch.float64, shapes=None):
    return make_tree(shapes or default_shapes(), torch.Generator().manual_seed(seed), dtype)


def _state_tensors(state):
    return [t for t in optree.tree_leaves(state, namespace=NS) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_inplace_gives_the_pure_numbers(name):
    params = _params(1)
    grads = grad_sequence(params, 2)
    pure, pure_state = run_ours(OPTIMIZERS[name](False), params, grads)
    inpl, inpl_state = run_ours(OPTIMIZERS[name](True), params, grads, inplace_apply=True)
    assert_close(inpl, pure, what="params")
    assert_close(_state_tensors(inpl_state), _state_tensors(pure_state), what="state")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_inplace_keeps_every_buffer(name):
    params = _params(3)
    opt = OPTIMIZERS[name](True)
    state = opt.init(params)
    p_ptrs = [t.data_ptr() for t in leaves(params)]
    s_ptrs = [t.data_ptr() for t in _state_tensors(state)]
    for g in grad_sequence(params, 4, steps=5):
        g_ptrs = [t.data_ptr() for t in leaves(g)]
        updates, state = opt.update(g, state, params)
        assert [t.data_ptr() for t in leaves(updates)] == g_ptrs  # written into the grads
        out = optim.apply_updates(params, updates, inplace=True)
        assert out is params
        assert [t.data_ptr() for t in leaves(params)] == p_ptrs
        assert [t.data_ptr() for t in _state_tensors(state)] == s_ptrs


def _allocations(fn):
    """Sizes (bytes) of every CPU allocation made while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_inplace_allocates_nothing_tensor_sized(name):
    shapes = [(64, 32), (256,), (16, 4, 8)]  # every leaf >= 1 KiB in float32
    params = make_tree(shapes, torch.Generator().manual_seed(5), torch.float32)
    opt = OPTIMIZERS[name](True)
    state = opt.init(params)
    grads = grad_sequence(params, 6, steps=3)
    for g in grads[:2]:  # warm up (first-call caches)
        updates, state = opt.update(g, state, params)
        optim.apply_updates(params, updates, inplace=True)

    def step():
        updates, _ = opt.update(grads[2], state, params)
        optim.apply_updates(params, updates, inplace=True)

    sizes = _allocations(step)
    # Only scalars (foreach's CPU path wraps Python numbers as 0-dim tensors) and, for
    # clipping, the vector of per-leaf norms may appear; every leaf is >= 1 KiB.
    assert max(sizes, default=0) <= 8 * len(leaves(params)), sorted(sizes)[-5:]
    # ... while the pure step allocates at least new state and new params.
    pure = OPTIMIZERS[name](False)
    pstate = pure.init(params)
    pure_sizes = _allocations(lambda: optim.apply_updates(params, pure.update(grads[2], pstate, params)[0]))
    assert sum(pure_sizes) >= sum(t.numel() * 4 for t in leaves(params))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_pure_mode_mutates_nothing(name):
    params = _params(7)
    opt = OPTIMIZERS[name](False)
    state = opt.init(params)
    grads_seq = grad_sequence(params, 8, steps=3)
    for g in grads_seq[:2]:
        updates, state = opt.update(g, state, params)
        params = optim.apply_updates(params, updates)
    g = grads_seq[2]
    inputs = {"params": params, "grads": g, "state": _state_tensors(state)}
    before = clone_tree(inputs)
    versions = [t._version for t in leaves(inputs)]
    updates, new_state = opt.update(g, state, params)
    new_params = optim.apply_updates(params, updates)
    assert [t._version for t in leaves(inputs)] == versions, "an input was written in place"
    for a, b in zip(leaves(inputs), leaves(before)):
        assert torch.equal(a, b)
    ptrs = {t.data_ptr() for t in leaves(params)}
    assert not ptrs & {t.data_ptr() for t in leaves(new_params)}


def test_inplace_handles_expanded_gradients_and_leaves_requiring_grad():
    """torch.func.grad returns stride-0 (expanded) gradients for sums; in-place mode copies those."""
    params = {"w": torch.randn(3, 4, dtype=torch.float64, requires_grad=True), "b": torch.zeros(4, dtype=torch.float64, requires_grad=True)}
    grads = torch.func.grad(lambda p: (p["w"].sum() + (p["b"] * 2).sum()))(params)
    assert grads["w"].stride() == (0, 0)
    ref_params = clone_tree({k: v.detach() for k, v in params.items()})
    expected, _ = run_ours(optim.adamw(0.1), ref_params, [clone_tree(grads)])
    opt = optim.adamw(0.1, inplace=True)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    optim.apply_updates(params, updates, inplace=True)
    assert_close({k: v.detach() for k, v in params.items()}, expected)
    assert params["w"].grad_fn is None and params["w"].requires_grad


# -- scale fusion (see [Note: scale fusion]) ---------------------------------------------


def _plain(t):
    """The same transform without fusion hooks: chain runs it link by link."""
    return optim.GradientTransformation(t.init, lambda u, s, p=None: t.update(u, s, p))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("kind", ["adamw", "adam", "adamw-warmup-from-0"])
def test_scale_fusion_matches_the_plain_chain(inplace, kind):
    lr = optim.warmup_cosine_decay_schedule(0.0, 0.02, 4, 20) if kind.endswith("0") else 0.02
    if kind.startswith("adamw"):
        links = [optim.scale_by_adam(inplace=inplace), optim.add_decayed_weights(0.3, inplace=inplace),
                 optim.scale_by_learning_rate(lr, inplace=inplace)]
    else:
        links = [optim.add_decayed_weights(0.3, inplace=inplace), optim.scale_by_adam(inplace=inplace),
                 optim.scale_by_learning_rate(lr, inplace=inplace)]
    params = _params(9)
    grads = grad_sequence(params, 10)
    fused, fstate = run_ours(optim.chain(*links), params, grads, inplace_apply=inplace)
    plain, pstate = run_ours(optim.chain(*[_plain(t) for t in links]), params, grads, inplace_apply=inplace)
    assert_close(fused, plain, what="params")
    assert_close(_state_tensors(fstate), _state_tensors(pstate), what="state")


def test_pure_adamw_allocates_only_new_state_update_and_params():
    """Fused pure adamw: new mu, nu, the update and the new params (4x the params), no more."""
    params = make_tree([(64, 32), (256,), (16, 4, 8)], torch.Generator().manual_seed(11), torch.float32)
    nbytes = sum(t.numel() * 4 for t in leaves(params))
    grads = grad_sequence(params, 12, steps=2)
    for opt, expected in [(optim.adamw(0.01), 4), (_plain_adamw(), 6)]:
        state = opt.init(params)
        _, state = opt.update(grads[0], state, params)
        sizes = _allocations(lambda: optim.apply_updates(params, opt.update(grads[1], state, params)[0]))
        big = sum(s for s in sizes if s >= 512)  # (the profiler nets out 4-byte scalar frees)
        assert abs(big - expected * nbytes) <= 64, (expected, big / nbytes)


def _plain_adamw():
    return optim.chain(*[_plain(t) for t in (optim.scale_by_adam(), optim.add_decayed_weights(1e-2),
                                             optim.scale_by_learning_rate(0.01))])
