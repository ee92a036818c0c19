"""Schedule values, boundaries and errors (parity with lr_scheduler is in test_optim_parity)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn.optim as optim


def test_constant():
    s = optim.constant_schedule(0.3)
    assert [s(k) for k in (0, 1, 10**6)] == [0.3, 0.3, 0.3]


def test_linear_schedule_endpoints_and_begin():
    s = optim.linear_schedule(1.0, 0.0, 4, transition_begin=2)
    assert [s(k) for k in range(8)] == [1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert optim.linear_schedule(0.5, 9.0, 0)(100) == 0.5


@settings(max_examples=30, deadline=None, derandomize=True)
@given(init=st.floats(1e-4, 10.0), decay=st.integers(1, 500), alpha=st.floats(0.0, 1.0), k=st.integers(0, 1000))
def test_cosine_decay_formula(init, decay, alpha, k):
    s = optim.cosine_decay_schedule(init, decay, alpha)
    t = min(k, decay)
    expected = init * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * t / decay)) + alpha)
    assert math.isclose(s(k), expected, rel_tol=1e-12, abs_tol=1e-15)
    assert s(0) == pytest.approx(init) and s(decay) == pytest.approx(init * alpha, abs=1e-12)


def test_join_schedules_restarts_each_piece_at_zero():
    seen = []

    def piece(tag):
        return lambda k: seen.append((tag, k)) or float(k)

    s = optim.join_schedules([piece("a"), piece("b"), piece("c")], [2, 5])
    assert [s(k) for k in range(7)] == [0.0, 1.0, 0.0, 1.0, 2.0, 0.0, 1.0]
    assert seen == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2), ("c", 0), ("c", 1)]


def test_warmup_cosine_decay_values():
    s = optim.warmup_cosine_decay_schedule(0.1, 1.0, 4, 14, end_value=0.2)
    assert [s(k) for k in range(5)] == pytest.approx([0.1, 0.325, 0.55, 0.775, 1.0])
    assert s(9) == pytest.approx(0.2 + 0.8 * 0.5)
    assert s(14) == pytest.approx(0.2) and s(1000) == pytest.approx(0.2)
    w = optim.linear_warmup(2.0, 4)
    assert [w(k) for k in (0, 2, 4, 99)] == [0.0, 1.0, 2.0, 2.0]


def test_schedule_errors():
    with pytest.raises(ValueError, match=r"cosine_decay_schedule: decay_steps must be positive, got 0"):
        optim.cosine_decay_schedule(1.0, 0)
    with pytest.raises(ValueError, match=r"join_schedules: 2 schedules need 1 boundaries, got 2"):
        optim.join_schedules([optim.constant_schedule(1.0)] * 2, [1, 2])
    with pytest.raises(ValueError, match=r"join_schedules: boundaries must increase"):
        optim.join_schedules([optim.constant_schedule(1.0)] * 3, [5, 2])
    with pytest.raises(ValueError, match=r"warmup_cosine_decay_schedule: decay_steps \(which includes the warmup\) must exceed"):
        optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10)


SCHEDULES = {
    "constant": optim.constant_schedule(0.3),
    "linear": optim.linear_schedule(1e-3, 1e-5, 17, transition_begin=3),
    "cosine": optim.cosine_decay_schedule(3e-4, 23, alpha=0.05, exponent=1.5),
    "warmup": optim.linear_warmup(1e-3, 7),
    "warmup_cosine": optim.warmup_cosine_decay_schedule(1e-6, 1e-3, 5, 30, end_value=1e-5),
    "join": optim.join_schedules([optim.constant_schedule(0.5), optim.linear_schedule(0.5, 0.1, 4),
                                  optim.cosine_decay_schedule(0.1, 9)], [3, 8]),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedules_of_a_tensor_step_are_the_float_values(name):
    """[Note: schedules in a graph]: called with a 0-dim int64 tensor (the count inside
    sf.jit's graph), every built-in schedule gives its float value bit for bit."""
    import torch

    schedule = SCHEDULES[name]
    for k in range(45):
        want, got = schedule(k), schedule(torch.tensor(k))
        assert float(got) == want, (name, k, float(got), want)
