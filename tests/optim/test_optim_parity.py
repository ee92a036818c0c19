"""Parity with torch.optim: SGD, Adam, AdamW (and their schedulers) on nested trees, 20 steps."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn.optim as optim
from optim_testutil import (
    assert_close,
    beta_st,
    default_shapes,
    grad_sequence,
    leaves,
    lr_st,
    make_tree,
    run_ours,
    run_torch,
    seed_st,
    shapes_st,
    wd_st,
)

DTYPES = [torch.float64, torch.float32]
HYP = settings(max_examples=15, deadline=None, derandomize=True)


def _params(shapes, seed, dtype):
    return make_tree(shapes, torch.Generator().manual_seed(seed), dtype)


# -- SGD -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(
    "momentum,nesterov,wd", [(0.0, False, 0.0), (0.0, False, 0.1), (0.9, False, 0.0), (0.9, True, 0.05), (0.5, False, 0.3)]
)
def test_sgd_matches_torch(dtype, foreach, momentum, nesterov, wd):
    params = _params(default_shapes(), 0, dtype)
    grads = grad_sequence(params, 1)
    ours, state = run_ours(optim.sgd(0.05, momentum, nesterov, wd), params, grads)
    ref, topt, tps = run_torch(
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=momentum, nesterov=nesterov, weight_decay=wd, foreach=foreach),
        params, grads,
    )
    assert_close(ours, ref, what="params")
    if momentum:
        bufs = [topt.state[p]["momentum_buffer"] for p in tps]
        assert_close(leaves(state[1].trace), bufs, what="momentum buffers")


@HYP
@given(shapes=shapes_st, seed=seed_st, lr=lr_st, momentum=st.floats(0.0, 0.99), nesterov=st.booleans(), wd=wd_st)
def test_sgd_matches_torch_hypothesis(shapes, seed, lr, momentum, nesterov, wd):
    nesterov = nesterov and momentum > 0
    params = _params(shapes, seed, torch.float64)
    grads = grad_sequence(params, seed + 1)
    ours, _ = run_ours(optim.sgd(lr, momentum, nesterov, wd), params, grads)
    ref, _, _ = run_torch(
        lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=wd), params, grads
    )
    assert_close(ours, ref)


# -- Adam / AdamW ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_matches_torch(dtype, foreach, wd):
    params = _params(default_shapes(), 2, dtype)
    grads = grad_sequence(params, 3)
    ours, state = run_ours(optim.adam(1e-2, weight_decay=wd), params, grads)
    ref, topt, tps = run_torch(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=wd, foreach=foreach), params, grads)
    assert_close(ours, ref, what="params")
    adam_state = state[1]
    assert int(adam_state.count) == len(grads)
    assert_close(leaves(adam_state.mu), [topt.state[p]["exp_avg"] for p in tps], what="mu")
    assert_close(leaves(adam_state.nu), [topt.state[p]["exp_avg_sq"] for p in tps], what="nu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("wd", [None, 0.0, 0.3])
def test_adamw_matches_torch(dtype, foreach, wd):
    kw = {} if wd is None else {"weight_decay": wd}  # None: both libraries' default, 1e-2
    params = _params(default_shapes(), 4, dtype)
    grads = grad_sequence(params, 5)
    ours, state = run_ours(optim.adamw(3e-2, b1=0.8, b2=0.99, eps=1e-6, **kw), params, grads)
    ref, topt, tps = run_torch(
        lambda ps: torch.optim.AdamW(ps, lr=3e-2, betas=(0.8, 0.99), eps=1e-6, foreach=foreach, **kw), params, grads
    )
    assert_close(ours, ref, what="params")
    assert_close(leaves(state[0].nu), [topt.state[p]["exp_avg_sq"] for p in tps], what="nu")


def test_adamw_default_weight_decay_is_torchs():
    params = _params(default_shapes(), 6, torch.float64)
    grads = grad_sequence(params, 7, steps=3)
    without, _ = run_ours(optim.adamw(0.1, weight_decay=0.0), params, grads)
    default, _ = run_ours(optim.adamw(0.1), params, grads)
    explicit, _ = run_ours(optim.adamw(0.1, weight_decay=1e-2), params, grads)
    assert_close(default, explicit)
    with pytest.raises(AssertionError):
        assert_close(default, without)


@HYP
@given(shapes=shapes_st, seed=seed_st, lr=lr_st, b1=beta_st, b2=beta_st, wd=wd_st, decoupled=st.booleans())
def test_adam_family_matches_torch_hypothesis(shapes, seed, lr, b1, b2, wd, decoupled):
    params = _params(shapes, seed, torch.float64)
    grads = grad_sequence(params, seed + 1)
    make = optim.adamw if decoupled else optim.adam
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ours, _ = run_ours(make(lr, b1, b2, 1e-8, wd), params, grads)
    ref, _, _ = run_torch(lambda ps: cls(ps, lr=lr, betas=(b1, b2), eps=1e-8, weight_decay=wd), params, grads)
    assert_close(ours, ref)


# -- schedules against torch.optim.lr_scheduler -----------------------------------------
# torch calls scheduler.step() after optimizer.step(), so its k-th optimizer step (from 0)
# uses the scheduler's value at epoch k; our schedule gets the count of updates done, k.

LR = 0.05


def _lambda(k):
    return 1.0 / (1.0 + 0.3 * k) if k % 3 else 0.5 / (1.0 + k)


SCHEDULES = {
    "LambdaLR": (
        lambda k: LR * _lambda(k),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, _lambda),
    ),
    "LinearLR": (
        optim.linear_schedule(LR * 0.25, LR * 1.0, 8),
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=8),
    ),
    "LinearLR-decay": (
        optim.linear_schedule(LR, LR * 0.1, 12),
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=12),
    ),
    "CosineAnnealingLR": (
        optim.cosine_decay_schedule(LR, 20, alpha=0.1),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20, eta_min=LR * 0.1),
    ),
    "warmup+cosine (SequentialLR)": (
        optim.warmup_cosine_decay_schedule(LR * 0.1, LR, 5, 5 + 16, end_value=LR * 0.05),
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=5),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=16, eta_min=LR * 0.05),
            ],
            milestones=[5],
        ),
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_schedules_match_torch_lr_scheduler(name, kind):
    schedule, make_sched = SCHEDULES[name]
    params = _params(default_shapes(), 8, torch.float64)
    grads = grad_sequence(params, 9)
    if kind == "sgd":
        ours_opt = optim.sgd(schedule, momentum=0.9, weight_decay=0.1)
        make = lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, weight_decay=0.1)  # noqa: E731
    elif kind == "adam":
        ours_opt = optim.adam(schedule, weight_decay=0.1)
        make = lambda ps: torch.optim.Adam(ps, lr=LR, weight_decay=0.1)  # noqa: E731
    else:  # decay follows the scheduled lr, like torch
        ours_opt = optim.adamw(schedule, weight_decay=0.5)
        make = lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.5)  # noqa: E731
    ours, _ = run_ours(ours_opt, params, grads)
    ref, _, _ = run_torch(make, params, grads, make_sched)
    assert_close(ours, ref)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_values_match_torch_lr_scheduler(name):
    schedule, make_sched = SCHEDULES[name]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    sched = make_sched(opt)
    for k in range(20):
        assert math.isclose(schedule(k), opt.param_groups[0]["lr"], rel_tol=1e-12, abs_tol=1e-15), k
        opt.step()
        sched.step()


def test_schedule_off_by_one_would_be_caught():
    """Shifting the schedule by one step must break parity (the test above can fail)."""
    schedule, make_sched = SCHEDULES["LambdaLR"]
    params = _params(default_shapes(), 10, torch.float64)
    grads = grad_sequence(params, 11)
    ours, _ = run_ours(optim.adamw(lambda k: schedule(k + 1)), params, grads)
    ref, _, _ = run_torch(lambda ps: torch.optim.AdamW(ps, lr=LR), params, grads, make_sched)
    with pytest.raises(AssertionError, match="max abs diff"):
        assert_close(ours, ref)
