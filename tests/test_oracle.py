"""The property-based oracle over transforms (issue 38; tests/oracle_cases.py).

Hypothesis draws a model (an MLP, a GPT block, a transformers Llama decoder layer), a mesh
(simulated 1-D of 2 or 4 ranks, 2-D 2x2 with FSDP over both axes, HSDP or hpZ; processes
in the slow set), `sf.shard` options (reshard_after_forward, prefetch, a frozen leaf,
MixedPrecision in fp64, check_finite, batch_weighting, units per leaf group, remat) or an
`sf.shard_map` program (in/out specs, a psum or all_gather body, check_vma both ways) and
a transform stack (grad, vjp, jvp, vmap over examples, jacrev of a small output, HVP
forward-over-reverse and reverse-over-reverse, grad through one shardfn.optim step with a
tensor learning rate; arguments closed over or passed). Every rank's result must equal the
same stack on one device in fp64 within 1e-10 (max |error| over max |value|), or the step
must refuse with the composition table's SpecError where the table refuses.

Profiles: the lean one (`ORACLE_LEAN` examples per stack, marked slow + ci so `make test`
runs it) and the full one (`ORACLE_FULL`, default 300 per stack, `make test-all`); both
derandomized. `ORACLE_FULL=50 pytest tests/test_oracle.py -m slow` runs a shorter full set.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import oracle_cases as oc

LEAN = int(os.environ.get("ORACLE_LEAN", "5"))
LEAN_SM = 4 * LEAN  # a shard_map case costs a few ms
FULL = int(os.environ.get("ORACLE_FULL", "300"))


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _shard(stack: str, n: int, models=("mlp", "gpt_block")):
    @_settings(n)
    @given(oc.shard_cases(models=models, stacks=(stack,)))
    def run(case):
        problems = oc.check_shard_case(case)
        assert not problems, f"{case}:\n" + "\n".join(problems)

    run()


def _shard_map(stack: str, n: int):
    @_settings(n)
    @given(oc.shard_map_cases(stacks=(stack,)))
    def run(case):
        problems = oc.check_shard_map_case(case)
        assert not problems, f"{case}:\n" + "\n".join(problems)

    run()


@pytest.fixture(scope="module", autouse=True)
def _release_meshes():
    yield
    oc.mesh_of.cache_clear()  # each simulated mesh holds its ranks' threads


# -- lean: make test -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("stack", oc.STACKS)
def test_shard_equals_one_device_lean(stack):
    _shard(stack, LEAN)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("stack", oc.SM_STACKS)
def test_shard_map_equals_one_device_lean(stack):
    _shard_map(stack, LEAN_SM)


@pytest.mark.slow
@pytest.mark.ci
def test_llama_layer_lean():
    pytest.importorskip("transformers")

    @_settings(3)
    @given(oc.shard_cases(models=("llama_layer",), meshes=("1d2", "2d")))
    def run(case):
        problems = oc.check_shard_case(case)
        assert not problems, f"{case}:\n" + "\n".join(problems)

    run()


def test_the_oracle_accepts_a_refusal_only_where_the_table_refuses():
    """vmap with batch_weighting='global_mean' is the table's refused cell: the oracle wants
    its SpecError; the same options under grad must run and be exact."""
    case = oc.ShardCase(model="mlp", mesh="1d2", layout="fsdp", stack="vmap", closed=False, weighting="global_mean")
    assert oc.check_shard_case(case) == []
    step = oc.sf.shard(lambda p, b: None, oc.mesh_of(oc.MESHES["1d2"][0]), batch_weighting="global_mean")
    assert "vmap(grad(step), in_dims=(None, 0)) does not support batch_weighting='global_mean'" in str(
        oc.expected_refusal(case, step))
    assert oc.expected_refusal(oc.ShardCase(model="mlp", mesh="1d2", layout="fsdp", stack="grad", closed=False,
                                            weighting="global_mean"), step) is None


# -- full: make test-all ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("stack", oc.STACKS)
def test_shard_equals_one_device_full(stack):
    pytest.importorskip("transformers")
    _shard(stack, FULL, models=("mlp", "gpt_block", "llama_layer"))


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("stack", oc.SM_STACKS)
def test_shard_map_equals_one_device_full(stack):
    _shard_map(stack, FULL)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mesh", ["1d2", "2d"])
def test_processes_equal_one_device(mesh):
    """Every stack once on real gloo processes (2 and 2x2), shard and shard_map."""
    from shardfn.testing import run_on_mesh

    sm_mesh = {"1d2": "1d2", "2d": "2d"}[mesh]

    @settings(max_examples=1, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(oc.shard_cases(meshes=(mesh,)), min_size=len(oc.STACKS), max_size=len(oc.STACKS),
                    unique_by=lambda c: c.stack),
           st.lists(oc.shard_map_cases(meshes=(sm_mesh,)), min_size=len(oc.SM_STACKS), max_size=len(oc.SM_STACKS),
                    unique_by=lambda c: c.stack))
    def run(cases, sm_cases):
        shape = dict(oc.MESHES[mesh][0])
        # shard_map cases name axes x / y: a second mesh of the same shape in the same processes
        sm_shape = dict(oc.SM_MESHES[sm_mesh])

        def both(m):
            import shardfn as sf

            problems = []
            for case in cases:
                problems += [f"{case}: {p}" for p in oc.check_shard_case(case, mesh=m)]
            sm = sf.init_mesh(sm_shape)
            for case in sm_cases:
                problems += [f"{case}: {p}" for p in oc.check_shard_map_case(case, mesh=sm)]
            return problems

        results = run_on_mesh(both, shape, backend="distributed", timeout=300)
        problems = [p for r in results for p in r]
        assert not problems, "\n".join(problems)

    run()


def test_remat_around_a_functional_apply_on_its_first_call():
    """Found by the oracle: sf.remat around sf.functional's apply function refuses the first
    call of that apply function on each thread, one device included: the apply function makes
    its per-thread module copy (`thread_module` in shardfn/_functional.py: a deepcopy onto
    meta, computed buffers) inside the remat'd forward, so remat's recording (a dispatch mode
    numbering the ops) sees ops the recompute does not repeat: "at torch call #0 the forward
    called torch.empty_like", or, with the copy hidden from torch-function modes only, "gave
    output #0 another value than its forward" (the op numbering shifted). The second call
    works. Under sf.shard every rank thread's first step fails. sf.functional(module,
    remat=...) (remat per block) is not affected. Fixed: the copy is made `unrecorded()`
    (shardfn/_remat_state.py), unseen by remat's modes. Fp64."""
    import torch

    import shardfn as sf
    from shardfn.testing.models import Block, GPTConfig

    torch.manual_seed(0)
    apply_fn, params = sf.functional(Block(GPTConfig(block_size=4, n_head=2, n_embd=8)).double())
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    plain = torch.func.grad(lambda p: (apply_fn(p, x) ** 2).mean())(params)
    torch.manual_seed(0)
    apply_fn, params = sf.functional(Block(GPTConfig(block_size=4, n_head=2, n_embd=8)).double())
    forward = sf.remat(lambda p, x: apply_fn(p, x))
    got = torch.func.grad(lambda p: (forward(p, x) ** 2).mean())(params)  # the first call of this apply_fn
    assert oc.max_rel(got, plain) <= 1e-12


# -- the oracle catches planted bugs ---------------------------------------------------------------
# Each plants one wrong rule (monkeypatched for the test only) and asks the oracle about a
# case that exercises it: it must report a difference from one device (or fail loudly),
# so a green oracle means something.


def _caught(check, case) -> str:
    try:
        problems = check(case)
    except Exception as e:  # noqa: BLE001 (a loud failure is a catch too)
        return f"raised {type(e).__name__}: {e}"
    return "\n".join(problems)


def test_a_planted_wrong_jvp_rule_is_caught(monkeypatch):
    from shardfn import _collectives

    case = oc.ShardMapCase(mesh="1d2", batch_axes=(), w_axis="x", body="psum", check_vma=False, stack="jvp",
                           closed=False)
    assert oc.check_shard_map_case(case) == []
    right = _collectives._Psum.jvp
    monkeypatch.setattr(_collectives._Psum, "jvp", staticmethod(lambda ctx, t, g: 2 * right(ctx, t, g)))
    assert "rank 0: tangent off by" in _caught(oc.check_shard_map_case, case)


def test_a_planted_wrong_transpose_is_caught(monkeypatch):
    from shardfn import _collectives

    case = oc.ShardMapCase(mesh="1d2", batch_axes=(), w_axis="x", body="all_gather", check_vma=False,
                           stack="grad", closed=False)
    assert oc.check_shard_map_case(case) == []
    right = _collectives._AllGather.backward
    monkeypatch.setattr(_collectives._AllGather, "backward",
                        staticmethod(lambda ctx, g: (2 * right(ctx, g)[0], None, None)))
    assert "rank 0: grad off by" in _caught(oc.check_shard_map_case, case)


def test_a_planted_float_of_a_hyperparameter_is_caught(monkeypatch):
    """`float(lr)` inside an optimizer cuts the hypergradient (or fails under torch.func)."""
    case = oc.ShardCase(model="mlp", mesh="1d2", layout="fsdp", stack="optim", closed=False, opt="sgd")
    assert oc.check_shard_case(case) == []
    right = oc.optim.sgd
    monkeypatch.setattr(oc.optim, "sgd", lambda lr, *a, **k: right(float(lr), *a, **k))
    assert "rank 0: hypergrad off by" in _caught(oc.check_shard_case, case)


def test_a_functional_apply_first_called_inside_a_transform_serves_other_levels():
    """Found by the oracle on processes: sf.functional's per-thread module copy, made at the
    apply function's first call on a thread, copied the module's buffers inside the torch.func
    level active then (a shard step's grad); a later call at another level (the one-device
    reference in the same process) read a wrapped buffer: functorch's "escaped?" internal
    assertion. The copy is made outside every transform. Fp64."""
    import torch

    import shardfn as sf
    from shardfn.testing.models import Block, GPTConfig

    torch.manual_seed(0)
    block = Block(GPTConfig(block_size=4, n_head=2, n_embd=8, sdpa=False)).double()  # a causal-mask buffer
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    want = (block(x) ** 2).mean()
    apply_fn, params = sf.functional(block)
    loss = lambda p: (apply_fn(p, x) ** 2).mean()  # noqa: E731
    v = sf._tree.tree_map(torch.ones_like, params)
    # the first call on this thread two levels deep (a Hessian-vector product), then at one
    hvp = torch.func.grad(lambda p: oc._dot(torch.func.grad(loss)(p), v))(params)
    first = torch.func.grad(loss)(params)
    plain = loss(params)
    assert torch.equal(plain, want.detach())
    assert oc.max_rel(torch.func.grad(loss)(params), first) == 0.0
    assert all(torch.isfinite(t).all() for t in sf._tree.flatten(hvp)[0])
