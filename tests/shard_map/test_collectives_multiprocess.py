"""The same collective and tensor-parallel cases on real processes (fork + gloo).

Each case runs `rank_body` (tests/collective_cases.py) on every rank through
`run_on_mesh(..., backend="distributed")` and is compared with the expectations the
simulated tests use: the reference evaluator and the unsharded function.
"""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from collective_cases import (
    TP_PARAM_SPECS,
    assert_trees_close,
    assert_triples_close,
    inputs,
    join_results,
    mlp_single,
    parametrized_cases,
    rank_body,
    reference_results,
    tp_setup,
    unsharded,
    unsharded_results,
)
from shardfn.testing import run_on_mesh
from shardfn.testing._reference import join_tree, split_tree

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

OPS = ("psum", "all_gather", "psum_scatter", "ppermute", "all_to_all")
CASES = parametrized_cases(ops=OPS, meshes=("2",)) + parametrized_cases(ops=OPS, meshes=("2x2",), axes=(("y", "x"),))
CI = {"psum-2-x", "all_gather-2x2-y+x", "all_to_all-2x2-y+x"}


@pytest.fixture(scope="module", autouse=True)
def warm_functorch():
    """First use of torch.func compiles TorchScript helpers (seconds per process on 2 cores):
    do it once here, before the ranks are forked, so they inherit it."""
    x = torch.ones(2, dtype=torch.float64)
    torch.func.jvp(torch.sin, (x,), (x,))
    torch.func.vjp(torch.sin, x)[1](x)
    torch.func.vmap(torch.func.grad(lambda v: v.sin().sum()))(x[:, None])


@pytest.mark.parametrize("name,case", [
    pytest.param(n, c, id=n, marks=[pytest.mark.ci] if n in CI else []) for n, c in CASES])
def test_collective_on_processes(name, case):
    x, ct, tangent = inputs(case)
    want = reference_results(case, x, ct, tangent)
    assert_triples_close(want, unsharded_results(unsharded(case), x, ct, tangent), f"{name}: reference vs unsharded")
    per_rank = run_on_mesh(lambda mesh: rank_body(case, mesh, x, ct, tangent), case.mesh_shape, backend="distributed")
    assert_triples_close(join_results(case, case.mesh_shape, per_rank), want, f"{name} on processes")


@pytest.mark.parametrize("mesh_id", [
    "model2", pytest.param("data2xmodel2", marks=pytest.mark.ci)])
def test_tp_mlp_on_processes(mesh_id):
    mesh_sim, loss_fn, params, x, target, in_specs = tp_setup(mesh_id, seed=60)
    want_loss, want_grads = mlp_single(params, x, target), torch.func.grad(mlp_single)(params, x, target)

    def body(mesh):
        f = sf.shard_map(loss_fn, mesh, in_specs, sf.P())
        p, xb, tb = split_tree((params, x, target), in_specs, mesh.shape)[mesh.rank]
        grads, loss = torch.func.grad_and_value(f)(p, xb, tb)
        eager = {k: v.clone().requires_grad_() for k, v in p.items()}
        f(eager, xb, tb).backward()
        return loss, grads, {k: v.grad for k, v in eager.items()}

    results = run_on_mesh(body, mesh_sim.shape, backend="distributed")
    for loss, _, _ in results:
        torch.testing.assert_close(loss, want_loss, rtol=1e-11, atol=1e-12)
    assert_trees_close(join_tree([g for _, g, _ in results], TP_PARAM_SPECS, mesh_sim.shape), want_grads)
    assert_trees_close(join_tree([e for _, _, e in results], TP_PARAM_SPECS, mesh_sim.shape), want_grads)
