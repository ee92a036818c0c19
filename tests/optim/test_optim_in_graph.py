"""Optimizers inside a compiled graph: step-dependent scalars ([Note: step-dependent scalars in
a graph] in shardfn/optim/_in_graph.py) enter as realized 0-dim tensors, with eager's numbers
and no recompile as the step count grows."""

from __future__ import annotations

import pytest
import torch

import shardfn.optim as optim
from shardfn.optim import _in_graph

STEPS = 20


def _problem():
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(300, generator=gen), torch.randn(7, 5, generator=gen),
              torch.randn(40, generator=gen, dtype=torch.float64)]
    grads = [[torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params] for _ in range(STEPS)]
    return params, grads


def _run(update, params, grads, opt):
    state = opt.init(params)
    for g in grads:
        params, state = update(g, state, params)
    return params, state


def _update_fn(opt):
    def update(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    return update


def test_scalar_is_the_number_itself_in_eager():
    x = 0.25
    assert _in_graph.scalar(x, torch.zeros(1)) is x


@pytest.mark.parametrize("opt", [optim.adamw(1e-2), optim.adam(3e-3, b1=0.8)], ids=["adamw", "adam"])
def test_compiled_adam_is_eager_bit_for_bit_in_one_graph(opt):
    """The graph dynamo captures, run op by op: eager's bits, one graph for 20 step counts,
    and both step-dependent scalars behind `shardfn::realized`."""
    params, grads = _problem()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    update = _update_fn(opt)
    want, want_state = _run(update, params, grads, opt)
    got, got_state = _run(torch.compile(update, backend=backend, fullgraph=True), params, grads, opt)
    assert len(graphs) == 1, f"{len(graphs)} graphs: the step count recompiled"
    assert sum(t is torch.ops.shardfn.realized.default for t in graphs[0]) == 2  # Adam's two scalars
    leaves = torch.utils._pytree.tree_leaves
    assert len(leaves(got_state)) == len(leaves(want_state))
    for a, b in zip(want + leaves(want_state), got + leaves(got_state)):  # params, counts, moments
        assert torch.equal(a, b)
    assert STEPS in [int(x) for x in leaves(got_state) if x.dim() == 0]


def test_compiled_adamw_with_inductor_matches_eager():
    """Inductor's kernels round like eager's here (the scalars are loaded, not recomputed):
    within a float32 ulp or two after 20 steps."""
    opt = optim.adamw(1e-2)
    params, grads = _problem()
    update = _update_fn(opt)
    want, _ = _run(update, params, grads, opt)
    got, _ = _run(torch.compile(update, fullgraph=True), params, grads, opt)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_compiled_adamw_with_a_schedule_is_one_graph_and_eager_within_rounding():
    """[Note: schedules in a graph]: the schedule is traced with the step count as a tensor,
    so 20 steps (warmup from 0 included) are one graph; its value is a tensor, so the chain
    takes the plain path (lr multiplied after Adam, not folded into its denominator): eager's
    numbers within rounding."""
    opt = optim.adamw(optim.warmup_cosine_decay_schedule(0.0, 1e-2, 4, 30))
    params, grads = _problem()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    update = _update_fn(opt)
    want, _ = _run(update, params, grads, opt)
    got, _ = _run(torch.compile(update, backend=backend, fullgraph=True), params, grads, opt)
    assert len(graphs) == 1, f"{len(graphs)} graphs: the schedule recompiled"
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
