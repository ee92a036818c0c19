"""Second order through `sf.shard`: Hessian-vector products of a sharded loss
([Note: second order through shard] in shardfn/_fsdp/autograd.py).

Both modes, against `torch.func` on one device with the full parameters and the global
batch, in float64:
- forward-over-reverse, `jvp(grad(step))`: each unit's tangent is gathered once in the
  forward and its gradient's tangent reduce-scattered once in the backward;
- reverse-over-reverse, `grad(<grad(step), v>)`: the gradient reduce-scatter transposes to
  an all-gather of the cotangent, and the second backward gathers the units again.
The bytes of each HVP are read from `step.stats()`.
"""

import re

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import _tree
from shardfn._fsdp.autograd import plain
from shardfn.testing._ddp import local_batch
from shardfn.testing.models import GPT, GPTConfig, mlp_loss, mlp_params
from collective_cases import mesh_for  # one simulated mesh per shape, per session

D = torch.float64
TOL = 1e-10
HSDP = {"data_axes": ("replica", "shard"), "shard_axes": "shard"}
leaves = torch.utils._pytree.tree_leaves
tree_map = torch.utils._pytree.tree_map


# -- cases ------------------------------------------------------------------------------


def _mlp_case(seed=5):
    g = torch.Generator().manual_seed(seed)
    params = mlp_params(g, [4, 6, 5, 3], dtype=D)
    batch = (torch.randn(8, 4, generator=g, dtype=D), torch.randn(8, 3, generator=g, dtype=D))
    return mlp_loss, params, batch


def _gpt_case(remat=None):
    """The examples' GPT (tied head: the root unit), 2 blocks, its loss in float64."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    apply_fn, params = sf.functional(GPT(cfg).to(D), remat=remat)

    def loss_fn(p, batch):
        idx, targets = batch
        logits = apply_fn(p, idx)  # (B, T, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g))
    return loss_fn, params, batch


def _probe(params, seed=2):
    g = torch.Generator().manual_seed(seed)
    return tree_map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)


def _dot(a, b):
    return sum((x * y).sum() for x, y in zip(leaves(a), leaves(b)))


def _max_diff(a, b):
    pairs = list(zip(leaves(a), leaves(b)))
    assert len(pairs) == len(leaves(b))
    return max((x - y).abs().max().item() for x, y in pairs)


def _where(frozen, tree, fn):
    """`tree` with `fn` applied to the leaves whose path `frozen` marks."""
    paths, xs, treedef = _tree.flatten_with_paths(tree)
    return _tree.unflatten(treedef, [fn(x) if frozen is not None and frozen(p) else x for p, x in zip(paths, xs)])


def _reference(loss_fn, params, batch, v, frozen=None):
    """jvp(grad(loss_fn)) on one device; frozen leaves are constants (their tangent is
    ignored, their entry zero)."""
    v = _where(frozen, v, torch.zeros_like)
    hvp = torch.func.jvp(lambda p: torch.func.grad(loss_fn)(p, batch), (params,), (v,))[1]
    return _where(frozen, hvp, torch.zeros_like)


def _hvp(step, shards, local, vs, mode):
    if mode == "forward-over-reverse":
        return torch.func.jvp(lambda s: torch.func.grad(step)(s, local), (shards,), (vs,))[1]
    return torch.func.grad(lambda s: _dot(torch.func.grad(step)(s, local), vs))(shards)


def _unit_bytes(step):
    """(Ψ, the root unit's part of it): the padded unsharded bytes of the sharded units."""
    units = [u for u in step._last_plan.units if u.sharded]
    psi = sum(u.k * u.shard_numel * D.itemsize for u in units)
    return psi, sum(u.k * u.shard_numel * D.itemsize for u in units if u.is_root)


def _run(case, shape, mode, **kwargs):
    """Per rank: (max error of the HVP against one device, stats of the HVP, stats of
    the plain grad(step) on the same step), and the step."""
    loss_fn, params, batch = case
    v = _probe(params)
    want = _reference(loss_fn, params, batch, v, kwargs.get("frozen"))
    mesh = mesh_for(shape)
    step = sf.shard(loss_fn, mesh, **kwargs)

    def body():
        shards, vs = step.shard_params(params), step.shard_params(v)
        local = local_batch(batch, mesh.rank, mesh.size)
        torch.func.grad(step)(shards, local)
        first = step.stats()
        hvp = _hvp(step, shards, local, vs, mode)
        stats = step.stats()
        return _max_diff(step.unshard_params(hvp), want), stats, first

    return mesh.run(body), step


MODES = ["forward-over-reverse", "reverse-over-reverse"]


def _check_bytes(step, stats, first, mode):
    """forward-over-reverse = the primal's schedule + one gather and one reduce-scatter of
    the tangent per unit; reverse-over-reverse = + the cotangent's gather and the second
    backward's re-gather (every unit, the root included) and reduce-scatter."""
    psi, root = _unit_bytes(step)
    assert first["all_gather_bytes"] == 2 * psi - root and first["reduce_scatter_bytes"] == psi
    extra_gathers = 1 if mode == "forward-over-reverse" else 2
    assert stats["all_gather_bytes"] == first["all_gather_bytes"] + extra_gathers * psi
    assert stats["reduce_scatter_bytes"] == 2 * psi


# -- HVPs equal one device ---------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_mlp_hvp_equals_one_device(mode, world):
    results, step = _run(_mlp_case(), {"data": world}, mode)
    for err, stats, first in results:
        assert err <= TOL
        _check_bytes(step, stats, first, mode)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_gpt_hvp_equals_one_device(mode, world):
    results, step = _run(_gpt_case(), {"data": world}, mode)
    psi, root = _unit_bytes(step)
    assert root > 0  # the tied embedding / head: stays gathered through the first backward
    for err, stats, first in results:
        assert err <= TOL
        _check_bytes(step, stats, first, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["mlp", "gpt"])
def test_hsdp_hvp_equals_one_device(case, mode):
    """The replica all-reduce is linear (forward mode) and transposes to the identity: the
    HVP's cotangent is the same on every replica."""
    results, step = _run(_mlp_case() if case == "mlp" else _gpt_case(), {"replica": 2, "shard": 2}, mode, **HSDP)
    for err, stats, first in results:
        assert err <= TOL
        _check_bytes(step, stats, first, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_a_replicated_scalar_leaf(hsdp, mode):
    """A 0-dim leaf is whole on every rank, its gradient all-reduced: the tangent's
    all-reduce is the same sum, and its transpose the identity (HSDP's replicas too)."""
    _, params, batch = _mlp_case()
    params = dict(params, temp=torch.tensor(1.3, dtype=D))

    def loss_fn(p, b):
        x, y = b
        return mlp_loss({"layers": p["layers"]}, (x, y / p["temp"])) * p["temp"] ** 2

    shape, kwargs = ({"replica": 2, "shard": 2}, HSDP) if hsdp else ({"data": 2}, {})
    results, step = _run((loss_fn, params, batch), shape, mode, **kwargs)
    for err, stats, first in results:
        assert err <= TOL
        _check_bytes(step, stats, first, mode)


@pytest.mark.parametrize("mode", MODES)
def test_remat_per_block_hvp_equals_one_device(mode):
    results, _ = _run(_gpt_case(remat=True), {"data": 2}, mode)
    assert max(err for err, _, _ in results) <= TOL


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["mlp", "gpt"])
def test_frozen_leaves_are_constants_of_the_hvp(case, mode):
    """Frozen leaves get no gradient, so no HVP entry, and their tangent does not move the
    others' (the probe is non-zero on them)."""
    if case == "mlp":
        frozen = lambda path: path[:2] == ("layers", 1)  # noqa: E731
    else:
        frozen = lambda path: "ln_f" in path or path[:3] == ("transformer", "h", 0)  # noqa: E731
    results, _ = _run(_mlp_case() if case == "mlp" else _gpt_case(), {"data": 2}, mode, frozen=frozen)
    assert max(err for err, _, _ in results) <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_hpz_and_no_reshard(mode):
    axes = ("node", "gpu")
    for shape, kwargs in [({"node": 2, "gpu": 2}, dict(data_axes=axes, shard_axes=axes, reshard_after_forward="gpu")),
                          ({"data": 2}, dict(reshard_after_forward=False, prefetch=0))]:
        results, _ = _run(_mlp_case(), shape, mode, **kwargs)
        assert max(err for err, _, _ in results) <= TOL, kwargs


@pytest.mark.parametrize("mode", MODES)
def test_wire_formats_are_straight_through(mode):
    """With an int8 all-gather the HVP is the one at the decoded parameters (tangents and
    cotangents travel exactly); an int8 reduce-scatter quantizes the gradient, not the HVP."""
    _, params, batch = _mlp_case()
    v = _probe(params)
    mesh = mesh_for({"data": 2})
    seen = {}

    def loss_fn(p, b):  # mlp_loss, keeping the decoded leaves it reads
        (x, y), n = b, len(p["layers"])
        for i in range(n):
            w, bias = p["layers"][i]["w"], p["layers"][i]["b"]
            seen.setdefault((mesh.rank, i), {"w": plain(w).clone(), "b": plain(bias).clone()})
            x = x @ w + bias
            x = torch.tanh(x) if i + 1 < n else x
        return ((x - y) ** 2).mean()

    wire = sf.MixedPrecision(all_gather_dtype="int8", reduce_scatter_dtype="int8", block_size=4)
    step = sf.shard(loss_fn, mesh, mixed_precision=wire)

    def body():
        shards, vs = step.shard_params(params), step.shard_params(v)
        local = local_batch(batch, mesh.rank, mesh.size)
        step(shards, local)  # no transform: `seen` holds plain decoded values
        return step.unshard_params(_hvp(step, shards, local, vs, mode))

    got = mesh.run(body)
    decoded = {"layers": [seen[(0, i)] for i in range(3)]}
    assert _max_diff(decoded, params) > 1e-3  # the wire format did change the parameters
    want = _reference(mlp_loss, decoded, batch, v)
    for hvp in got:
        assert _max_diff(hvp, want) <= TOL


def test_batched_hvp_under_vmap_and_eager_double_backward():
    """vmap over probes (several HVPs in one pass: the tangents' reduce-scatters batched)
    and `torch.autograd.grad(create_graph=True)` on eager autograd."""
    loss_fn, params, batch = _mlp_case()
    v = _probe(params)
    want = _reference(loss_fn, params, batch, v)
    mesh = mesh_for({"data": 2})
    step = sf.shard(loss_fn, mesh)
    scales = [1.0, 2.0, -1.0]

    def body():
        shards, vs = step.shard_params(params), step.shard_params(v)
        local = local_batch(batch, mesh.rank, mesh.size)
        probes = tree_map(lambda t: torch.stack([c * t for c in scales]), vs)
        batched = torch.func.vmap(lambda t: _hvp(step, shards, local, t, "forward-over-reverse"))(probes)
        errs = [_max_diff(step.unshard_params(tree_map(lambda t: t[i], batched)), tree_map(lambda w: c * w, want))
                for i, c in enumerate(scales)]
        s = tree_map(lambda t: t.detach().requires_grad_(), shards)
        grads = torch.autograd.grad(step(s, local), leaves(s), create_graph=True)
        hv = torch.autograd.grad(_dot(grads, leaves(vs)), leaves(s))
        errs.append(_max_diff(step.unshard_params(torch.utils._pytree.tree_unflatten(list(hv), torch.utils._pytree.tree_structure(s))), want))
        return errs

    for errs in mesh.run(body):
        assert max(errs) <= TOL


def test_hutchinson_example_in_the_docs_runs_and_equals_one_device():
    """The ```python block of docs/autodiff.md §9 (a Hutchinson trace estimate): each
    rank's estimate equals the same probes' mean of zᵀHz on one device."""
    import os

    page = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "autodiff.md")).read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "def hutchinson" in b]
    assert len(blocks) == 1  # §9's block (§12 has other ones)
    scope = {}
    exec(compile(blocks[0], "docs/autodiff.md", "exec"), scope)
    loss_fn, params, batch, probes = scope["mlp_loss"], scope["params"], scope["batch"], scope["probes"]
    quad = [_dot(z, _reference(loss_fn, params, batch, z)) for z in probes]
    want = float(sum(quad) / len(quad))
    assert all(abs(e - want) <= TOL for e in scope["estimates"])
    flat = torch.cat([x.reshape(-1) for x in leaves(params)])
    shapes = [x.shape for x in leaves(params)]

    def flat_loss(w):
        parts = torch.split(w, [s.numel() for s in shapes])
        tree = torch.utils._pytree.tree_unflatten([p.reshape(s) for p, s in zip(parts, shapes)],
                                                  torch.utils._pytree.tree_structure(params))
        return loss_fn(tree, batch)

    trace = float(torch.func.hessian(flat_loss)(flat).diagonal().sum())
    assert abs(scope["estimates"][0] - trace) <= 0.5 * abs(trace)  # an estimate: 64 probes


# -- what is refused, and how ------------------------------------------------------------


def test_third_order_and_reverse_over_forward_are_clear_errors():
    loss_fn, params, batch = _mlp_case()
    v = _probe(params)
    mesh = mesh_for({"data": 2})
    step = sf.shard(loss_fn, mesh)

    def body():
        shards, vs = step.shard_params(params), step.shard_params(v)
        local = local_batch(batch, mesh.rank, mesh.size)
        hvp = lambda s: _hvp(step, s, local, vs, "reverse-over-reverse")  # noqa: E731
        out = {}
        for name, fn in [("grad of reverse-over-reverse", lambda: torch.func.grad(lambda s: _dot(hvp(s), vs))(shards)),
                         ("grad of forward-over-reverse", lambda: torch.func.grad(
                             lambda s: _dot(_hvp(step, s, local, vs, "forward-over-reverse"), vs))(shards)),
                         ("reverse-over-forward", lambda: torch.func.grad(
                             lambda s: torch.func.jvp(lambda s2: step(s2, local), (s,), (vs,))[1])(shards))]:
            with pytest.raises(sf.ShardingError) as info:
                fn()
            out[name] = str(info.value)
        return out

    for out in mesh.run(body):
        assert re.search(r"(?s)^shard: a third derivative \(reverse mode over a second backward\) through a unit's "
                         r"gradient reduction is not supported: shard differentiates its step twice.*"
                         r"Fix: for a Hessian-vector product use torch\.func\.jvp\(torch\.func\.grad\(step\), "
                         r"\(shards, batch\), \(v, zeros\)\)", out["grad of reverse-over-reverse"])
        assert out["grad of forward-over-reverse"].startswith(
            "shard: reverse mode over forward-over-reverse through a unit's gradient reduction is not supported")
        assert out["reverse-over-forward"] == (
            "shard: reverse mode over forward mode (torch.func.grad of torch.func.jvp(step)) is not supported: "
            "torch 2.13's reverse-over-forward is wrong for some ops (layer_norm), with or without shard.\n"
            "Fix: for a Hessian-vector product use forward-over-reverse, torch.func.jvp(torch.func.grad(step), "
            "(shards, batch), (v, zeros)).")


def test_accumulate_reduce_once_refuses_forward_mode():
    loss_fn, params, batch = _mlp_case()
    mesh = mesh_for({"data": 2})
    step = sf.shard(loss_fn, mesh)

    def body():
        shards, vs = step.shard_params(params), step.shard_params(_probe(params))
        local = local_batch(batch, mesh.rank, mesh.size)
        micro = [tree_map(lambda t: t[:2], local), tree_map(lambda t: t[2:], local)]
        with pytest.raises(sf.ShardingError, match=re.escape(
                "shard: forward mode over the gradient (jvp of grad) is not supported inside step.grad_and_value / "
                "sf.train_step or step.accumulate(mode='reduce_once') (step mode accumulate_hold).\nFix: "
                "differentiate torch.func.grad(step) itself, e.g. torch.func.jvp(torch.func.grad(step), "
                "(shards, batch), (v, zeros)) for a Hessian-vector product.")):
            torch.func.jvp(lambda s: step.accumulate(s, micro, mode="reduce_once")[0], (shards,), (vs,))
        # reduce_each reduces every micro-batch as the plain step does: its jvp is the HVP
        hvp = torch.func.jvp(lambda s: step.accumulate(s, micro, mode="reduce_each")[0], (shards,), (vs,))[1]
        return step.unshard_params(hvp)

    want = _reference(loss_fn, params, batch, _probe(params))
    for hvp in mesh.run(body):
        assert _max_diff(hvp, want) <= TOL


def test_an_ensemble_refuses_second_order_and_forward_mode():
    loss_fn, params, batch = _mlp_case()
    mesh = mesh_for({"data": 2})
    step = sf.shard(loss_fn, mesh)

    def body():
        members = [step.shard_params(params), step.shard_params(_probe(params, seed=3))]
        stacked = tree_map(lambda *t: torch.stack(t), *members)
        local = local_batch(batch, mesh.rank, mesh.size)
        ensemble = lambda s: torch.func.vmap(step, in_dims=(0, None))(s, local).sum()  # noqa: E731
        with pytest.raises(sf.ShardingError, match=re.escape(
                "shard: forward mode (jvp) through an ensemble's step (vmap over stacked shards) is not supported.\n"
                "Fix: run torch.func.jvp on each member's step (its shards unstacked).")):
            torch.func.jvp(ensemble, (stacked,), (stacked,))
        with pytest.raises(sf.ShardingError, match=re.escape(
                "shard: second-order derivatives of an ensemble's step (vmap over stacked shards) are not "
                "supported.\nFix: differentiate each member's step.")):
            torch.func.grad(lambda s: _dot(torch.func.grad(ensemble)(s), stacked))(stacked)

    mesh.run(body)


@pytest.mark.parametrize("mode", MODES)
def test_fsdp_times_tp_hvp_equals_one_device(mode):
    """param_specs (Megatron MLP inside loss_fn, psum over 'model'): the tensor-parallel
    regions' all-reduce is one more linear sum of the gradient, its transpose the identity."""
    from test_fsdp_tp import batch_of, data_batch, init, loss_fn, specs_for, tp_loss

    params, batch = init(0), batch_of(0)
    v = _probe(params, seed=9)
    want = _reference(loss_fn, params, batch, v)
    mesh = mesh_for({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=specs_for(params), data_axes=("data",))

    def body():
        shards, vs = step.shard_params(params), step.shard_params(v)
        return _max_diff(step.unshard_params(_hvp(step, shards, data_batch(mesh, batch), vs, mode)), want)

    assert max(mesh.run(body)) <= TOL
