"""Muon: torch.optim.Muon's numbers on one device, and the same numbers on shards through
the owner path (simulated mesh, HSDP, sf.shard with a frozen leaf and accumulation, a
process group), with the bytes the owner rule states."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardfn as sf
import shardfn.optim as optim
from optim_testutil import NS, assert_close, clone_tree, leaves
from shardfn._backend import ops
from shardfn._spec import chunk_bounds
from matrix_cases import block, grads_of, mlp, mlp_batches, mlp_loss, rel_err, tree_of

SHAPES = {"a": (8, 5), "b": (3, 7), "c": (6, 6), "d": (1, 4), "e": (9, 2)}  # (1, 4): empty shards on 2+ ranks
_tree, _grads, _rel_err, _block = tree_of, grads_of, rel_err, block


def _run(opt, params, grads):
    params = clone_tree(params)
    state = opt.init(params)
    for g in grads:
        u, state = opt.update(clone_tree(g), state, params)
        params = optim.apply_updates(params, u)
    return params, state


def _torch_muon(params, grads, **kw):
    names = list(params)
    ts = [params[k].clone().requires_grad_() for k in names]
    opt = torch.optim.Muon(ts, **kw)
    for g in grads:
        for k, t in zip(names, ts):
            t.grad = g[k].clone()
        opt.step()
    return {k: t.detach() for k, t in zip(names, ts)}, opt


# -- one device ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("kw", [
    dict(lr=0.02),
    dict(lr=0.05, weight_decay=0.0, momentum=0.9, nesterov=False),
    dict(lr=0.01, weight_decay=0.2, adjust_lr_fn="match_rms_adamw", ns_steps=3),
    dict(lr=0.01, ns_coefficients=(2.0, -1.5, 0.5), eps=1e-5),
], ids=["defaults", "no-nesterov", "match_rms_adamw", "coefficients"])
def test_muon_equals_torch_muon_for_ten_steps(dtype, tol, kw):
    params = _tree(SHAPES, 0, dtype)
    grads = _grads(SHAPES, 1, dtype)
    ref, _ = _torch_muon(params, grads, **kw)
    args = dict(kw)
    lr = args.pop("lr")
    ours, state = _run(optim.muon(lr, **args), params, grads)
    assert _rel_err(ours, ref) <= tol
    # the momentum buffer is torch's momentum_buffer
    _, topt = _torch_muon(params, grads, **kw)
    bufs = [topt.state[p]["momentum_buffer"] for p in topt.param_groups[0]["params"]]
    assert _rel_err(state[0].momentum, dict(zip(SHAPES, bufs))) <= tol


def test_newton_schulz_is_torchs_bit_for_bit():
    from torch.optim._muon import _zeropower_via_newtonschulz

    from shardfn.optim._muon import NS_COEFFICIENTS, newton_schulz

    gen = torch.Generator().manual_seed(3)
    for shape in [(5, 3), (3, 5), (4, 4), (1, 6)]:
        x = torch.randn(shape, generator=gen)
        assert torch.equal(newton_schulz(x), _zeropower_via_newtonschulz(x, NS_COEFFICIENTS, 5, 1e-7))


def test_muon_refuses_a_leaf_that_is_not_2d_naming_it():
    opt = optim.muon(0.02)
    params = {"w": torch.ones(3, 3), "b": torch.ones(3)}
    with pytest.raises(ValueError, match=r"(?s)params\['b'\]: shape \(3,\).*multi_transform"):
        opt.update(params, opt.init(params), params)


def test_bad_hyperparameters_are_value_errors():
    with pytest.raises(ValueError, match="momentum"):
        optim.muon(0.02, momentum=-1.0)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        optim.muon(0.02, adjust_lr_fn="nope")
    with pytest.raises(ValueError, match="ns_coefficients"):
        optim.muon(0.02, ns_coefficients=(1.0, 2.0))


# -- on shards ----------------------------------------------------------------------------

def _formula_bytes(shapes, n, owners, me, wire_bytes):
    """[Note: the owner rule]: gather(r) = b * sum_{owner != r} n_i(r); scatter(r) = b * sum_{owner == r} (N_i - n_i(r))."""
    gather = scatter = 0
    for k, s in shapes.items():
        row = math.prod(s[1:])
        mine = (lambda r: (chunk_bounds(s[0], n, r)[1] - chunk_bounds(s[0], n, r)[0]) * row)
        if owners[k] == me:
            scatter += (math.prod(s) - mine(me)) * wire_bytes
        else:
            gather += mine(me) * wire_bytes
    return gather, scatter


@pytest.mark.parametrize("n", [2, 4])
def test_sharded_muon_equals_unsharded_and_torch_with_the_stated_bytes(n):
    dtype = torch.float32
    params = _tree(SHAPES, 0, dtype)
    grads = _grads(SHAPES, 1, dtype)
    ref, _ = _run(optim.muon(0.02), params, grads)
    torch_ref, _ = _torch_muon(params, grads, lr=0.02)
    mesh = sf.local_mesh({"data": n})
    opt = optim.muon(0.02, mesh=mesh, specs=sf.P("data"))

    def rank_fn():
        r = mesh.coords["data"]
        shards = {k: _block(v, n, r) for k, v in params.items()}
        state = opt.init(shards)
        for g in grads:
            with ops.recording() as rec:
                u, state = opt.update({k: _block(v, n, r) for k, v in g.items()}, state, shards)
            shards = optim.apply_updates(shards, u)
        owners = {path[0]: o for path, (_, o) in opt.update.owners(shards).items()}
        return shards, state, [(c.op, c.nbytes) for c in rec.records], opt.update.stats(), owners

    for r, (shards, state, records, stats, owners) in enumerate(mesh.run(rank_fn)):
        blocks = {k: _block(v, n, r) for k, v in ref.items()}
        for k in SHAPES:  # bit for bit: the owner runs the single-device math on the same bits
            assert torch.equal(shards[k], blocks[k]), (r, k)
        assert _rel_err(shards, {k: _block(v, n, r) for k, v in torch_ref.items()}) <= 1e-6
        assert [tuple(t.shape) for t in leaves(state[0].momentum)] == [tuple(b.shape) for b in leaves(blocks)]
        gather, scatter = _formula_bytes(SHAPES, n, owners, r, 2)  # bfloat16 on the wire both ways
        assert records == [("ragged_all_to_all", gather), ("ragged_all_to_all", scatter)]
        assert (stats["gather_bytes"], stats["scatter_bytes"], stats["num_collectives"]) == (gather, scatter, 2)


def test_owners_are_balanced_by_flops():
    mesh = sf.local_mesh({"data": 4})
    shapes = {f"w{i}": (8, 8) for i in range(4)} | {"big": (16, 16)}
    opt = optim.muon(0.02, mesh=mesh)

    def rank_fn():
        r = mesh.coords["data"]
        shards = {k: _block(torch.zeros(s), 4, r) for k, s in shapes.items()}
        return opt.update.owners(shards)

    owners = {p[0]: o for p, (_, o) in mesh.run(rank_fn)[0].items()}
    # the 16x16 (8x the flops of an 8x8) goes first to rank 0; the four 8x8 to ranks 1, 2, 3, 1
    assert owners == {"big": 0, "w0": 1, "w1": 2, "w2": 3, "w3": 1}


def test_hsdp_replicas_each_run_the_owner_path_over_their_shard_axis():
    dtype = torch.float64
    params = _tree(SHAPES, 5, dtype)
    grads = _grads(SHAPES, 6, dtype)
    ref, _ = _torch_muon(params, grads, lr=0.02)
    mesh = sf.local_mesh({"replica": 2, "shard": 2})
    opt = optim.muon(0.02, mesh=mesh, specs=sf.P("shard"))

    def rank_fn():
        r = mesh.coords["shard"]
        shards = {k: _block(v, 2, r) for k, v in params.items()}
        state = opt.init(shards)
        for g in grads:
            with ops.recording() as rec:
                u, state = opt.update({k: _block(v, 2, r) for k, v in g.items()}, state, shards)
            shards = optim.apply_updates(shards, u)
        return shards, {c.axes for c in rec.records}

    for rank, (shards, axes) in enumerate(mesh.run(rank_fn)):
        r = rank % 2
        assert _rel_err(shards, {k: _block(v, 2, r) for k, v in ref.items()}) <= 1e-12
        assert axes == {("shard",)}


def test_specs_that_do_not_fit_the_blocks_are_a_spec_error():
    mesh = sf.local_mesh({"data": 2})
    opt = optim.muon(0.02, mesh=mesh, specs=sf.P(None, "data"))  # the blocks are dim-0 chunks

    def rank_fn():
        shards = {"w": torch.zeros(3, 4) if mesh.coords["data"] == 0 else torch.zeros(2, 4)}
        opt.update(shards, opt.init(shards), shards)

    with pytest.raises(sf.SpecError, match=r"(?s)params\[.w.\]: global shape between.*Fix: pass the specs"):
        mesh.run(rank_fn)


# -- under sf.shard: the recipe, a frozen leaf, accumulation --------------------------------

_mlp, _mlp_loss, _batches = mlp, mlp_loss, mlp_batches


def _label(path, p):
    if path == ("layers", 1, "b"):
        return "frozen"
    return "muon" if p.ndim == 2 and path[0] == "layers" else "adamw"


def _torch_recipe(params, batches):
    paths, ps, treedef = optree.tree_flatten_with_path(params, namespace=NS)
    ts = [p.clone().requires_grad_() for p in ps]
    muon = torch.optim.Muon([t for path, p, t in zip(paths, ps, ts) if _label(path, p) == "muon"], lr=0.02)
    adamw = torch.optim.AdamW([t for path, p, t in zip(paths, ps, ts) if _label(path, p) == "adamw"], lr=1e-2)
    for batch in batches:
        tree = optree.tree_unflatten(treedef, ts)
        grads = torch.autograd.grad(_mlp_loss(tree, batch), ts)
        for path, p, t, g in zip(paths, ps, ts, grads):
            t.grad = None if _label(path, p) == "frozen" else g
        muon.step()
        adamw.step()
    return optree.tree_unflatten(treedef, [t.detach() for t in ts])


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("mode", ["train_step", "accumulate"])
def test_muon_adamw_recipe_under_sf_shard_equals_torch_on_one_device(mode):
    n = 4
    params = _mlp()
    batches = _batches(n)
    ref = _torch_recipe(params, batches)
    mesh = sf.local_mesh({"data": n})
    step = sf.shard(_mlp_loss, mesh, frozen=lambda path: path == ("layers", 1, "b"))

    def rank_fn():
        shards = step.shard_params(clone_tree(params))
        opt = optim.multi_transform({"muon": optim.muon(0.02, mesh=mesh, specs=step.specs),
                                     "adamw": optim.adamw(1e-2), "frozen": optim.set_to_zero()}, _label)
        train = optim.train_step(step, opt)
        state = opt.init(shards)
        r = mesh.coords["data"]
        for x, y in batches:
            local = (x[4 * r:4 * r + 4], y[4 * r:4 * r + 4])
            if mode == "train_step":
                shards, state, _ = train(shards, state, local)
            else:  # two micro-batches of 2
                grads, _ = step.accumulate(shards, [(local[0][:2], local[1][:2]), (local[0][2:], local[1][2:])])
                u, state = opt.update(grads, state, shards)
                shards = optim.apply_updates(shards, u)
        return step.unshard_params(shards)

    for full in mesh.run(rank_fn):
        assert torch.equal(full["layers"][1]["b"], params["layers"][1]["b"])  # frozen
        assert _rel_err(full, ref) <= 1e-10


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.ci
def test_sharded_muon_on_a_process_group_equals_one_device():
    from shardfn.testing import run_on_mesh

    params = _tree(SHAPES, 0, torch.float32)
    grads = _grads(SHAPES, 1, torch.float32)
    ref, _ = _run(optim.muon(0.02), params, grads)

    def body(mesh):
        opt = optim.muon(0.02, mesh=mesh, specs=sf.P("data"))
        r = mesh.coords["data"]
        shards = {k: _block(v, 2, r) for k, v in params.items()}
        state = opt.init(shards)
        for g in grads:
            u, state = opt.update({k: _block(v, 2, r) for k, v in g.items()}, state, shards)
            shards = optim.apply_updates(shards, u)
        return shards, opt.update.stats()

    for r, (shards, stats) in enumerate(run_on_mesh(body, {"data": 2}, backend="distributed")):
        for k in SHAPES:
            assert torch.equal(shards[k], _block(ref[k], 2, r)), (r, k)
        assert stats["num_collectives"] == 2


# -- property: random shapes, meshes and owners -------------------------------------------

_MESHES = [{"data": 1}, {"data": 2}, {"data": 3}, {"data": 4}, {"replica": 2, "shard": 2}]
_mesh_cache: dict = {}


def _mesh(i):
    if i not in _mesh_cache:
        _mesh_cache[i] = sf.local_mesh(_MESHES[i])
    return _mesh_cache[i]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(st.one_of(st.tuples(st.integers(1, 7), st.integers(1, 6)), st.tuples(st.integers(1, 7))),
                       min_size=1, max_size=5),
       mesh_i=st.integers(0, len(_MESHES) - 1), owner_seed=st.one_of(st.none(), st.integers(0, 2**16)),
       nesterov=st.booleans())
def test_property_sharded_update_equals_single_device(shapes, mesh_i, owner_seed, nesterov):
    """Random 2-D and 1-D leaves (dims not divisible by the ranks, empty shards), meshes and
    owner assignments: Muon (2-D) + AdamW (1-D) on shards gives the blocks of the whole run."""
    shapes = {f"p{i}": s for i, s in enumerate(shapes)}
    params = _tree(shapes, 1, torch.float32)
    grads = _grads(shapes, 2, torch.float32, steps=3)

    def make(mesh=None, specs=None, owners=None):
        return optim.multi_transform({"muon": optim.muon(0.02, nesterov=nesterov, mesh=mesh, specs=specs,
                                                         owners=owners),
                                      "adamw": optim.adamw(1e-2)}, lambda path, p: "muon" if p.ndim == 2 else "adamw")

    ref, _ = _run(make(), params, grads)
    mesh = _mesh(mesh_i)
    axis = "shard" if "shard" in mesh.shape else "data"
    k = mesh.shape[axis]
    owners = None
    if owner_seed is not None:
        owners = lambda path, shape, size: (hash(path) + owner_seed) % size  # noqa: E731
    opt = make(mesh, sf.P(axis), owners)

    def rank_fn():
        r = mesh.coords[axis]
        shards = {key: _block(v, k, r) for key, v in params.items()}
        state = opt.init(shards)
        for g in grads:
            u, state = opt.update({key: _block(v, k, r) for key, v in g.items()}, state, shards)
            shards = optim.apply_updates(shards, u)
        return r, shards

    for r, shards in mesh.run(rank_fn):
        for key, s in shapes.items():
            want = _block(ref[key], k, r)
            if len(s) == 2:
                assert torch.equal(shards[key], want), (key, s, r)
            else:
                assert_close({key: shards[key]}, {key: want})


# -- tensor parallelism: a TP-split matrix is orthogonalized as the whole logical matrix -----

def _tp_problem(hidden, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    d = 8
    params = {"layers": [{"w1": torch.randn(d, hidden, generator=g, dtype=dtype) / d ** 0.5,
                          "w2": torch.randn(hidden, d, generator=g, dtype=dtype) / hidden ** 0.5,
                          "scale": torch.ones(d, dtype=dtype)} for _ in range(2)]}
    layer_specs = {"w1": sf.P(None, "model"), "w2": sf.P("model", None), "scale": None}
    batches = [(torch.randn(8, d, generator=g, dtype=dtype), torch.randn(8, d, generator=g, dtype=dtype))
               for _ in range(5)]
    return params, {"layers": [layer_specs] * 2}, batches


def _tp_loss(params, batch, reduce=lambda t: t):
    x, y = batch
    for layer in params["layers"]:
        x = x + reduce(torch.nn.functional.gelu((x * layer["scale"]) @ layer["w1"]) @ layer["w2"])
    return ((x - y) ** 2).mean()


def _tp_label(path, p):
    return "muon" if p.ndim == 2 else "adamw"


def _tp_run(hidden):
    params, param_specs, batches = _tp_problem(hidden)
    mesh = sf.local_mesh({"data": 2, "model": 2})
    step = sf.shard(lambda p, b: _tp_loss(p, b, lambda t: sf.psum(t, "model")), mesh, data_axes="data",
                    param_specs=param_specs)

    def rank_fn():
        shards = step.shard_params(clone_tree(params))
        opt = optim.multi_transform({"muon": optim.muon(0.02, mesh=mesh, specs=step.specs),
                                     "adamw": optim.adamw(1e-2)}, _tp_label)
        train = optim.train_step(step, opt)
        state = opt.init(shards)
        r = mesh.coords["data"]
        for x, y in batches:
            shards, state, _ = train(shards, state, (x.chunk(2)[r], y.chunk(2)[r]))
        return shards, step.specs, mesh.coords

    return params, batches, mesh, mesh.run(rank_fn)


@pytest.mark.slow
def test_a_tensor_parallel_matrix_is_orthogonalized_whole():
    from shardfn._spec import local_block

    params, batches, mesh, results = _tp_run(hidden=32)
    paths, ps, treedef = optree.tree_flatten_with_path(params, namespace=NS)
    ts = [p.clone().requires_grad_() for p in ps]
    muon = torch.optim.Muon([t for path, p, t in zip(paths, ps, ts) if _tp_label(path, p) == "muon"], lr=0.02)
    adamw = torch.optim.AdamW([t for path, p, t in zip(paths, ps, ts) if _tp_label(path, p) == "adamw"], lr=1e-2)
    for batch in batches:
        grads = torch.autograd.grad(_tp_loss(optree.tree_unflatten(treedef, ts), batch), ts)
        for t, g in zip(ts, grads):
            t.grad = g
        muon.step()
        adamw.step()
    ref = optree.tree_unflatten(treedef, [t.detach() for t in ts])
    for shards, specs, coords in results:
        want = optree.tree_map(lambda x, s: local_block(x, s, coords, mesh.shape), ref, specs, namespace=NS,
                               none_is_leaf=True)
        assert _rel_err(shards, want) <= 1e-10


@pytest.mark.parametrize("make", [lambda: optim.muon(0.02), lambda: optim.adafactor(0.01), lambda: optim.soap(0.01),
                                  lambda: optim.multi_transform({"m": optim.muon(0.02), "a": optim.adamw(1e-3)},
                                                                lambda path, p: "m" if p.ndim == 2 else "a")],
                         ids=["muon", "adafactor", "soap", "recipe"])
def test_train_step_refuses_a_whole_matrix_transform_without_the_steps_layout(make):
    """The bug of torch.optim.Muon under fully_shard: each rank's slice orthogonalized. Here a
    whole-matrix transform built without `mesh` is refused on a sharded step, with the fix."""
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(_mlp_loss, mesh)
    with pytest.raises(sf.SpecError, match=r"(?s)built without `mesh`.*Fix: .*mesh=mesh, specs=step.specs"):
        optim.train_step(step, make())
    optim.train_step(step, optim.muon(0.02, mesh=mesh, specs=sf.P("data")))  # placed: fine
    optim.train_step(_mlp_loss, make())  # a plain function: whole params, fine
