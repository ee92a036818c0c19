"""sf.remat and values written in place after they were saved: per policy, the gradient of
the same program without remat, or autograd's own error — never another gradient.

Three moments a saved value can be written: inside `fn`, after the policy kept it
([Note: saving by the policy]: the kept output is dropped and recomputed); after the
call, by the caller, through `fn`'s output when that output is the kept value ([Note:
kept values written later]); and after the call, an input of `fn` (which every policy
keeps for the recompute): autograd's version check must refuse the backward, as it does
without remat.
"""

from __future__ import annotations

import pytest
import torch

import shardfn as sf

P = sf.remat_policies
F64 = torch.float64
POLICIES = [
    pytest.param(P.nothing_saveable, None, id="nothing_saveable"),
    pytest.param(P.dots_saveable, None, id="dots_saveable"),
    pytest.param(P.save_only_these_names("a"), None, id="save_only_these_names"),
    pytest.param(P.save_only_these_names("a"), "cpu", id="save_only_these_names-offload"),
    pytest.param(P.everything_saveable, None, id="everything_saveable"),
]


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(4, 8, generator=g, dtype=F64), torch.randn(8, 4, generator=g, dtype=F64)
    return w1, w2, torch.randn(5, 4, generator=g, dtype=F64)


def _grads(block, w1, w2, x):
    """d/d(w1, w2) of sum(block(...)^2) by torch.func.grad and by .backward()."""
    def loss(w1, w2):
        return block(w1, w2, x).square().sum()

    by_func = torch.func.grad(loss, argnums=(0, 1))(w1, w2)
    a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    loss(a, b).backward()
    return by_func, (a.grad, b.grad)


def _assert_close(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def _written_after_kept(w1, w2, x):
    a = sf.tag(x @ w1, "a")  # kept by dots_saveable (a matmul) and save_only_these_names("a")
    a.mul_(2.0)  # written after the policy kept it: plain autograd allows it (mm saves x, w1; mul_ saves nothing)
    return torch.sin(torch.tanh(a) @ w2)


def _written_before_tagged(w1, w2, x):
    a = x @ w1
    a.add_(1.0)  # written before the tag: the tagged value is no longer the matmul's output
    return torch.sin(torch.tanh(sf.tag(a, "a")) @ w2)


@pytest.mark.parametrize("policy, offload", POLICIES)
@pytest.mark.parametrize("block", [_written_after_kept, _written_before_tagged], ids=["after", "before_tag"])
def test_a_kept_value_written_in_place_inside_fn_is_recomputed(policy, offload, block):
    w1, w2, x = _data()
    want = torch.func.grad(lambda a, b: block(a, b, x).square().sum(), argnums=(0, 1))(w1, w2)
    for got in _grads(sf.remat(block, policy=policy, offload_to=offload), w1, w2, x):
        _assert_close(got, want)


def _ends_in_a_matmul(w1, w2, x):
    return sf.tag(torch.tanh(x @ w1) @ w2, "a")  # the output is the kept value (dots_saveable, "a")


@pytest.mark.parametrize("policy, offload", POLICIES)
def test_an_output_that_is_a_kept_value_written_in_place_by_the_caller(policy, offload):
    """The caller writes fn's output in place after the call (legal: nothing saved it). The
    kept value is that tensor; handing it back to the recompute would recompute another
    function (a SpecError on the CPU, a wrong gradient where outputs are not read)."""
    w1, w2, x = _data(1)

    def caller(fn):
        def block(w1, w2, x):
            y = fn(w1, w2, x)
            y.add_(1.0)
            return y * torch.tanh(y)
        return block

    want = torch.func.grad(lambda a, b: caller(_ends_in_a_matmul)(a, b, x).square().sum(), argnums=(0, 1))(w1, w2)
    remat = sf.remat(_ends_in_a_matmul, policy=policy, offload_to=offload)
    for got in _grads(caller(remat), w1, w2, x):
        _assert_close(got, want)


@pytest.mark.parametrize("policy, offload", POLICIES)
def test_an_input_written_in_place_after_the_call_is_refused_by_autograd(policy, offload):
    """Every policy keeps fn's inputs for the backward; written after the call, the
    recompute would differentiate at another point. Autograd's version check refuses it,
    as it refuses the same program without remat."""
    w1, w2, x = _data(2)
    f = sf.remat(_written_after_kept, policy=policy, offload_to=offload)
    for fn in (_written_after_kept, f):
        w = w1.clone().requires_grad_()
        xi = x.clone()
        out = fn(w, w2, xi)
        xi.mul_(3.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.square().sum().backward()
