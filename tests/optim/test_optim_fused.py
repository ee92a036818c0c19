"""fused=True: PyTorch's fused kernels on our trees, bit for bit torch.optim(fused=True)."""

from __future__ import annotations

import optree
import pytest
import torch

import shardfn.optim as optim
from optim_testutil import NS, clone_tree, default_shapes, grad_sequence, leaves, make_tree, run_ours, run_torch

LR = 0.01


def _warm_decay(k):  # a LambdaLR factor: warmup, then halving
    return min(1.0, (k + 1) / 5) * 0.5 ** (k // 7)


# name: (ours(lr), torch optimizer(params, lr), has schedule)
CASES = {
    "adamw": (lambda lr: optim.adamw(lr, fused=True), lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True)),
    "adamw-wd": (
        lambda lr: optim.adamw(lr, 0.8, 0.99, 1e-6, weight_decay=0.3, fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=LR, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3, fused=True),
    ),
    "adam": (lambda lr: optim.adam(lr, fused=True), lambda ps: torch.optim.Adam(ps, lr=LR, fused=True)),
    "adam-l2": (
        lambda lr: optim.adam(lr, weight_decay=0.1, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=LR, weight_decay=0.1, fused=True),
    ),
    "sgd": (lambda lr: optim.sgd(lr, fused=True), lambda ps: torch.optim.SGD(ps, lr=LR, fused=True)),
    "sgd-momentum-wd": (
        lambda lr: optim.sgd(lr, 0.9, weight_decay=0.1, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, weight_decay=0.1, fused=True),
    ),
    "sgd-nesterov": (
        lambda lr: optim.sgd(lr, 0.9, nesterov=True, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, nesterov=True, fused=True),
    ),
}


def _params(seed, dtype=torch.float32, shapes=None):
    return make_tree(shapes or default_shapes(), torch.Generator().manual_seed(seed), dtype)


def _torch_states(name, topt, tps):
    if name.startswith("adam"):
        return [("mu", [topt.state[p]["exp_avg"] for p in tps]), ("nu", [topt.state[p]["exp_avg_sq"] for p in tps])]
    if "momentum" in name or "nesterov" in name:
        return [("trace", [topt.state[p]["momentum_buffer"] for p in tps])]
    return []


def _our_states(name, state):
    if name.startswith("adamw"):
        return [("mu", leaves(state[0].mu)), ("nu", leaves(state[0].nu))]
    if name.startswith("adam"):
        return [("mu", leaves(state[1].mu)), ("nu", leaves(state[1].nu))]
    if "momentum" in name or "nesterov" in name:
        return [("trace", leaves(state[1].trace))]
    return []


def _assert_equal(ours, ref, what):
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} leaf {i}"
        assert torch.equal(a, b), f"{what} leaf {i} {tuple(b.shape)}: max abs diff {(a - b).abs().max():.3e}"


@pytest.mark.parametrize("schedule", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_is_bitwise_torch_fused(name, dtype, schedule):
    """20 steps on a nested tree with a 0-dim leaf: params and states torch.equal."""
    ours_fn, torch_fn = CASES[name]
    params = _params(0, dtype)
    grads = grad_sequence(params, 1)
    lr = (lambda k: LR * _warm_decay(k)) if schedule else LR
    sched = (lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warm_decay)) if schedule else None
    ours, state = run_ours(ours_fn(lr), params, grads)
    ref, topt, tps = run_torch(torch_fn, params, grads, sched)
    _assert_equal(leaves(ours), leaves(ref), "params")
    for (what, a), (_, b) in zip(_our_states(name, state), _torch_states(name, topt, tps)):
        _assert_equal(a, b, what)
    if name.startswith("adam"):
        assert int(state[0 if name.startswith("adamw") else 1].count) == len(grads)
    if schedule:
        assert int(state[-1].count) == len(grads)


def test_fused_groups_by_dtype_like_torch():
    """A tree mixing float32, float64 and bfloat16 leaves: one kernel call per dtype, same bits."""
    gen = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(4, 3, generator=gen), "b": torch.randn(5, generator=gen, dtype=torch.float64),
              "c": torch.randn((), generator=gen), "d": torch.randn(6, generator=gen).bfloat16()}
    grads = grad_sequence(params, 4)
    ours, _ = run_ours(optim.adamw(LR, weight_decay=0.1, fused=True), params, grads)
    ref, _, _ = run_torch(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1, fused=True), params, grads)
    _assert_equal(leaves(ours), leaves(ref), "params")


def test_fused_updates_in_place_and_keeps_every_buffer():
    params = _params(5)
    opt = optim.adamw(LR, fused=True)
    state = opt.init(params)
    p_ptrs = [t.data_ptr() for t in leaves(params)]
    s_ptrs = [t.data_ptr() for t in leaves(state)]
    for g in grad_sequence(params, 6, steps=3):
        before = clone_tree(params)
        updates, state = opt.update(g, state, params)
        assert isinstance(updates, optim.AppliedUpdates)
        assert not all(torch.equal(a, b) for a, b in zip(leaves(params), leaves(before)))
        assert optim.apply_updates(params, updates) is params
        assert optim.apply_updates(params, updates, inplace=True) is params
        assert [t.data_ptr() for t in leaves(params)] == p_ptrs
        assert [t.data_ptr() for t in leaves(state)] == s_ptrs


def test_fused_state_is_the_unfused_state():
    """Same init, same structure: a checkpoint moves between fused=True and fused=False."""
    params = _params(7)
    for fused, plain in [(optim.adamw(LR, fused=True), optim.adamw(LR)),
                         (optim.adam(LR, fused=True), optim.adam(LR)),
                         (optim.sgd(LR, 0.9, fused=True), optim.sgd(LR, 0.9))]:
        a, b = fused.init(params), plain.init(params)
        assert optree.tree_structure(a, namespace=NS) == optree.tree_structure(b, namespace=NS)
    # 10 fused steps then 10 unfused from its state = 20 unfused steps, to rounding.
    grads = grad_sequence(params, 8)
    p = clone_tree(params)
    state = optim.adamw(LR, fused=True).init(p)
    for i, g in enumerate(grads):
        opt = optim.adamw(LR, fused=True) if i < 10 else optim.adamw(LR, inplace=True)
        updates, state = opt.update(clone_tree(g), state, p)
        p = optim.apply_updates(p, updates, inplace=True)
    ref, _ = run_ours(optim.adamw(LR), params, grads)
    for a, b in zip(leaves(p), leaves(ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_default_is_the_foreach_chain():
    params = _params(9)
    grads = grad_sequence(params, 10, steps=5)
    default, _ = run_ours(optim.adamw(LR), params, grads)
    off, _ = run_ours(optim.adamw(LR, fused=False), params, grads)
    _assert_equal(leaves(default), leaves(off), "params")


@pytest.mark.parametrize("inplace", [False, True])
def test_fused_train_step_is_bitwise_torch_fused(inplace):
    """sf.train_step with adamw(fused=True) vs loss.backward() + AdamW(fused=True).step()."""
    gen = torch.Generator().manual_seed(11)
    params = {"w1": torch.randn(8, 16, generator=gen) * 0.3, "b1": torch.zeros(16),
              "w2": torch.randn(16, generator=gen) * 0.3, "s": torch.tensor(0.5)}
    batches = [(torch.randn(32, 8, generator=gen), torch.randn(32, generator=gen)) for _ in range(20)]

    def loss_fn(p, batch):
        x, y = batch
        return ((torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] * p["s"] - y) ** 2).mean()

    opt = optim.adamw(lambda k: 3e-3 * _warm_decay(k), weight_decay=0.05, fused=True)
    train = optim.train_step(loss_fn, opt, inplace=inplace)
    shards = clone_tree(params)
    state = opt.init(shards)
    tp = {k: v.clone().requires_grad_() for k, v in params.items()}
    topt = torch.optim.AdamW(tp.values(), lr=3e-3, weight_decay=0.05, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(topt, _warm_decay)
    for batch in batches:
        shards, state, loss = train(shards, state, batch)
        topt.zero_grad()
        tloss = loss_fn(tp, batch)
        tloss.backward()
        topt.step()
        sched.step()
        assert torch.equal(loss, tloss.detach())
    _assert_equal(leaves(shards), [t.detach() for t in leaves(tp)], "params")


# -- errors ------------------------------------------------------------------------------


def test_fused_rejects_inplace_false():
    with pytest.raises(ValueError, match=r"adamw: fused=True .* cannot take inplace=False"):
        optim.adamw(LR, fused=True, inplace=False)
    with pytest.raises(ValueError, match=r"sgd: fused=True .* cannot take inplace=False"):
        optim.sgd(LR, fused=True, inplace=False)


def test_fused_rejects_a_mask():
    with pytest.raises(ValueError, match=r"adamw: fused=True does not support `mask`"):
        optim.adamw(LR, mask={"w": True}, fused=True)


def test_fused_rejects_bad_hyperparameters_first():
    with pytest.raises(ValueError, match=r"b1 must be in \[0, 1\)"):
        optim.adam(LR, b1=1.5, fused=True)


def test_fused_rejects_non_float_leaves():
    params = {"w": torch.ones(3), "n": torch.zeros(2, dtype=torch.int64)}
    opt = optim.adamw(LR, fused=True)
    with pytest.raises(ValueError, match=r"adamw.update: fused=True needs .* `params`\['n'\] is torch.int64, not a floating-point"):
        opt.update(clone_tree(params), opt.init(params), params)


def test_fused_rejects_unsupported_devices():
    params = {"w": torch.ones(3), "m": torch.ones(3, device="meta")}
    opt = optim.sgd(LR, 0.9, fused=True)
    with pytest.raises(ValueError, match=r"sgd.update: .* `params`\['m'\] is on meta, a device without fused kernels"):
        opt.update(clone_tree(params), opt.init(params), params)


def test_fused_rejects_grads_of_another_dtype():
    params = {"w": torch.ones(3)}
    opt = optim.adam(LR, fused=True)
    with pytest.raises(ValueError, match=r"`params`\['w'\] is torch.float32 on cpu but its `grads` leaf is torch.float64"):
        opt.update({"w": torch.ones(3, dtype=torch.float64)}, opt.init(params), params)


def test_fused_needs_params_and_matching_trees():
    params = {"w": torch.ones(3), "b": torch.ones(())}
    opt = optim.adamw(LR, fused=True)
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"adamw.update: needs the current parameters"):
        opt.update(clone_tree(params), state)
    with pytest.raises(ValueError, match=r"adamw.update: the updates and `params` have different tree structures"):
        opt.update(clone_tree(params), state, {"w": params["w"]})
    with pytest.raises(ValueError, match=r"adamw.update: the state should be the 3-tuple"):
        opt.update(clone_tree(params), state[0], params)


def test_apply_updates_rejects_applied_updates_of_other_params():
    params = {"w": torch.ones(3)}
    opt = optim.adamw(LR, fused=True)
    updates, _ = opt.update({"w": torch.ones(3)}, opt.init(params), params)
    with pytest.raises(ValueError, match=r"apply_updates: `updates` is the AppliedUpdates of a fused optimizer"):
        optim.apply_updates({"w": torch.ones(3)}, updates)
    assert optim.apply_updates(dict(params), updates)["w"] is params["w"]  # same leaves: fine


def test_fused_step_allocates_nothing_tensor_sized():
    from torch.profiler import ProfilerActivity, profile

    params = make_tree([(64, 32), (256,), (16, 4, 8)], torch.Generator().manual_seed(13), torch.float32)
    opt = optim.adamw(LR, fused=True)
    state = opt.init(params)
    grads = grad_sequence(params, 14, steps=3)
    for g in grads[:2]:
        optim.apply_updates(params, opt.update(g, state, params)[0])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        optim.apply_updates(params, opt.update(grads[2], state, params)[0])
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert max(sizes, default=0) <= 8, sorted(sizes)[-5:]  # only the 0-dim float step


def test_fused_handles_expanded_gradients_and_leaves_requiring_grad():
    params = {"w": torch.randn(3, 4, requires_grad=True), "b": torch.zeros(4, requires_grad=True)}
    grads = torch.func.grad(lambda p: p["w"].sum() + (p["b"] * 2).sum())(params)
    assert grads["w"].stride() == (0, 0)
    ref, _, _ = run_torch(lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
                          {k: v.detach() for k, v in params.items()}, [clone_tree(grads)])
    opt = optim.adamw(0.1, fused=True)
    updates, _ = opt.update(grads, opt.init(params), params)
    optim.apply_updates(params, updates)
    _assert_equal([params["b"].detach(), params["w"].detach()], leaves(ref), "params")
    assert params["w"].grad_fn is None and params["w"].requires_grad
