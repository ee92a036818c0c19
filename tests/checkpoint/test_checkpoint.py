"""sf.checkpoint: sharded DCP save / load with resharding, atomicity, FSDP2 interchange, errors."""

import os
import pickle
import signal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardfn as sf
import shardfn.checkpoint as ckpt
import shardfn.optim as optim
from shardfn._checkpoint import _dcp, _files
from shardfn._spec import block_index, chunk_bounds
from shardfn.testing import RankProcessError, run_on_mesh
from shardfn.testing._ddp import local_batch
from shardfn.testing.models import GPT, GPTConfig, mlp_loss, mlp_params
from collective_cases import mesh_for as mesh_of  # one simulated mesh per shape, per session

P = sf.P
D = torch.float64
SIZES = [5, 7, 3]  # dim 0 of 5 over 4 ranks: blocks 2, 2, 1, 0 (uneven and empty)


def block(x: torch.Tensor, spec, coords, mesh_shape) -> torch.Tensor:
    """The torch.chunk block of a global tensor under `spec` at `coords` (the reference)."""
    for dim, entry in enumerate(spec):
        index, count = block_index(entry, coords, mesh_shape)
        start, stop = chunk_bounds(x.shape[dim], count, index)
        x = x.narrow(dim, start, stop - start)
    return x.clone()


def params0(seed=0, sizes=SIZES, dtype=D):
    return mlp_params(torch.Generator().manual_seed(seed), sizes, dtype)


def zeros_like_tree(tree):
    return torch.utils._pytree.tree_map(torch.zeros_like, tree)


def assert_trees_equal(a, b):
    la, ta = torch.utils._pytree.tree_flatten(a)
    lb, tb = torch.utils._pytree.tree_flatten(b)
    assert ta == tb, f"structures differ: {ta} vs {tb}"
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (x, y)
        else:
            assert x == y


# -- training used by the resharding and resume tests ---------------------------------------------

BATCH_ROWS = 12  # divisible by 1, 2, 3, 4: every world size sees the same global mean


def batch_at(i: int):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(BATCH_ROWS, SIZES[0], generator=g, dtype=D), torch.randn(BATCH_ROWS, SIZES[-1], generator=g, dtype=D)


def train(mesh, steps, *, load_from=None, save_to=None):
    """AdamW on shards for `steps` steps (resuming from a checkpoint); losses and full params + state."""
    step = sf.shard(mlp_loss, mesh)
    opt = optim.adamw(1e-2)
    shards = step.shard_params(params0())
    state = opt.init(shards)
    start = 0
    specs = {"params": step.specs, "opt": ckpt.specs_like(state, step.specs), "step": P()}
    if load_from is not None:
        tree = ckpt.load(load_from, {"params": shards, "opt": state, "step": 0}, mesh, specs)
        shards, state, start = tree["params"], tree["opt"], tree["step"]
    losses = []
    for i in range(start, start + steps):
        grads, loss = torch.func.grad_and_value(step)(shards, local_batch(batch_at(i), mesh.rank, mesh.size))
        updates, state = opt.update(grads, state, shards)
        shards = optim.apply_updates(shards, updates)
        losses.append(float(loss))
    if save_to is not None:
        ckpt.save(save_to, {"params": shards, "opt": state, "step": start + steps}, mesh, specs)
    adam = state[0]
    full = {"params": step.unshard_params(shards), "mu": step.unshard_params(adam.mu),
            "nu": step.unshard_params(adam.nu), "count": adam.count}
    return losses, full


# -- resharding ---------------------------------------------------------------------------------


def test_save_on_4_load_on_2_and_3_and_back_bit_identical(tmp_path):
    """Params and AdamW state (uneven and empty blocks) survive 4 -> 2, 4 -> 3 -> 4 exactly."""
    _, reference = run_on_mesh(lambda m: train(m, 2, save_to=str(tmp_path / "w4")), {"data": 4})[0]

    def reload(src, dst):
        def body(mesh):
            return train(mesh, 0, load_from=src, save_to=dst)[1]
        return body

    for world in (2, 3):
        out = mesh_of({"data": world}).run(reload(str(tmp_path / "w4"), str(tmp_path / f"w{world}")), mesh_of({"data": world}))
        for full in out:
            assert_trees_equal(full, reference)
    back = mesh_of({"data": 4}).run(reload(str(tmp_path / "w3"), None), mesh_of({"data": 4}))
    assert_trees_equal(back[0], reference)
    assert int(reference["count"]) == 2


def test_hsdp_2x2_to_1d_4_and_back(tmp_path):
    """HSDP blocks (P('shard'), replicated over 'replica') are written once and load on a 1-D mesh."""
    params = params0(seed=3)
    hsdp = mesh_of({"replica": 2, "shard": 2})
    flat = mesh_of({"data": 4})

    def save_hsdp():
        step = sf.shard(mlp_loss, hsdp, data_axes=("replica", "shard"), shard_axes="shard")
        return ckpt.save(str(tmp_path / "hsdp"), step.shard_params(params), hsdp, step.specs)

    def hsdp_to_flat():
        step = sf.shard(mlp_loss, flat)
        like = step.shard_params(zeros_like_tree(params))
        loaded = ckpt.load(str(tmp_path / "hsdp"), like, flat, step.specs)
        ckpt.save(str(tmp_path / "flat"), loaded, flat, step.specs)
        return step.unshard_params(loaded)

    def flat_to_hsdp():
        step = sf.shard(mlp_loss, hsdp, data_axes=("replica", "shard"), shard_axes="shard")
        loaded = ckpt.load(str(tmp_path / "flat"), step.shard_params(zeros_like_tree(params)), hsdp, step.specs)
        return step.unshard_params(loaded)

    hsdp.run(save_hsdp)
    for full in flat.run(hsdp_to_flat) + hsdp.run(flat_to_hsdp):
        assert_trees_equal(full, params)
    with open(tmp_path / "hsdp" / ".metadata", "rb") as f:
        chunks = pickle.load(f).state_dict_metadata["layers.0.w"].chunks
    assert sorted(c.offsets[0] for c in chunks) == [0, 3]  # one chunk per shard, replicas deduplicated


@st.composite
def layouts(draw):
    leaves = []
    for _ in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
        dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.bfloat16]))
        split = draw(st.sampled_from([None] + list(range(ndim))))
        spec = P() if split is None else P(*([None] * split + ["data"]))
        leaves.append((shape, dtype, spec))
    return leaves, draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(0, 2**16))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_reshard_any_tree_between_world_sizes(case):
    import tempfile

    leaves, n_save, n_load, seed = case
    g = torch.Generator().manual_seed(seed)
    full = {"leaves": [torch.randint(-99, 99, shape, generator=g).to(dtype) for shape, dtype, _ in leaves],
            "meta": {"seed": seed, "name": "x"}}
    specs = {"leaves": [spec for _, _, spec in leaves], "meta": P()}

    def local(mesh, tree):
        return {"leaves": [block(x, s, mesh.coords, mesh.shape) for x, s in zip(tree["leaves"], specs["leaves"])],
                "meta": dict(tree["meta"])}

    placeholder = {"leaves": [torch.full(x.shape, 7).to(x.dtype) for x in full["leaves"]], "meta": {"seed": 0, "name": ""}}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c")
        m_save, m_load = mesh_of({"data": n_save}), mesh_of({"data": n_load})
        m_save.run(lambda: ckpt.save(path, local(m_save, full), m_save, specs))
        got = m_load.run(lambda: (ckpt.load(path, local(m_load, placeholder), m_load, specs), local(m_load, full)))
    for loaded, expected in got:
        assert_trees_equal(loaded, expected)


# -- resume -------------------------------------------------------------------------------------


def test_resume_same_world_bit_identical_and_across_world_sizes_close(tmp_path):
    """Simulated: 10 straight steps == 5 + save + load + 5 (on 4 ranks bit for bit; 4 -> 2 close)."""
    straight_losses, straight = run_on_mesh(lambda m: train(m, 10), {"data": 4})[0]
    run_on_mesh(lambda m: train(m, 5, save_to=str(tmp_path / "step_000005")), {"data": 4})
    same = run_on_mesh(lambda m: train(m, 5, load_from=str(tmp_path / "step_000005")), {"data": 4})[0]
    assert same[0] == straight_losses[5:]
    assert_trees_equal(same[1], straight)
    other = run_on_mesh(lambda m: train(m, 5, load_from=str(tmp_path / "step_000005")), {"data": 2})[0]
    assert max(abs(a - b) for a, b in zip(other[0], straight_losses[5:])) < 1e-12
    for key in ("params", "mu", "nu"):
        for a, b in zip(torch.utils._pytree.tree_leaves(other[1][key]), torch.utils._pytree.tree_leaves(straight[key])):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.multiprocess
def test_resume_in_new_process_groups_bit_identical(tmp_path):
    """Distributed: new processes (and process groups) for the second half; losses and params exact."""
    path = str(tmp_path / "step_000005")
    straight_losses, straight = run_on_mesh(lambda m: train(m, 10), {"data": 2}, "distributed")[0]
    run_on_mesh(lambda m: train(m, 5, save_to=path), {"data": 2}, "distributed")
    assert ckpt.latest(tmp_path) == path
    losses, full = run_on_mesh(lambda m: train(m, 5, load_from=path), {"data": 2}, "distributed")[1]
    assert losses == straight_losses[5:]
    assert_trees_equal(full, straight)


# -- atomicity and faults -----------------------------------------------------------------------


def _values(seed):
    return {"w": torch.arange(10.0) + seed, "step": seed}


def _save_on(mesh, path, seed):
    return ckpt.save(path, {"w": block(_values(seed)["w"], P("data"), mesh.coords, mesh.shape), "step": seed},
                     mesh, {"w": P("data"), "step": P()})


def test_failed_save_leaves_previous_checkpoint_latest(tmp_path, monkeypatch):
    """One rank fails while writing: every rank raises, only a .tmp- directory is left behind."""
    mesh = mesh_of({"data": 2})
    mesh.run(lambda: _save_on(mesh, str(tmp_path / "step_000001"), 1))
    real = _dcp.write_blocks

    def flaky(tmp, final, rank, plans, blocks):
        out = real(tmp, final, rank, plans, blocks)  # the files are written, then the rank dies
        if rank == 1:
            raise OSError("injected: disk full on rank 1")
        return out

    monkeypatch.setattr(_dcp, "write_blocks", flaky)
    with pytest.raises(OSError, match="injected"):
        mesh.run(lambda: _save_on(mesh, str(tmp_path / "step_000002"), 2))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["step_000001"]  # rank 0 removed the unfinished directory
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_000001")
    assert_trees_equal(ckpt.load(ckpt.latest(tmp_path), _values(0), None), _values(1))


def test_crash_between_metadata_and_rename_is_not_complete(tmp_path, monkeypatch):
    """A process dying after .metadata but before the rename leaves a directory load refuses."""
    mesh = mesh_of({"data": 2})
    mesh.run(lambda: _save_on(mesh, str(tmp_path / "step_000001"), 1))

    def crash(tmp, path, info, save_id):
        raise RuntimeError("injected: killed before rename")

    monkeypatch.setattr(_files, "publish", crash)
    monkeypatch.setattr(_files, "discard", lambda tmp: None)  # a dead process cleans nothing up
    with pytest.raises(RuntimeError, match="before rename"):
        mesh.run(lambda: _save_on(mesh, str(tmp_path / "step_000002"), 2))
    (tmp,) = [tmp_path / n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert (tmp / ".metadata").exists()  # DCP-complete, but never published
    with pytest.raises(ckpt.IncompleteCheckpointError, match="temporary directory"):
        ckpt.load(tmp, _values(0), None)
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_000001")


@pytest.mark.multiprocess
def test_sigkill_during_distributed_save(tmp_path):
    """A rank process killed mid-save (SIGKILL): the previous checkpoint is still the latest and loads."""

    def body(mesh):
        _save_on(mesh, str(tmp_path / "step_000001"), 1)
        real = _dcp.write_blocks

        def die(tmp, final, rank, plans, blocks):
            out = real(tmp, final, rank, plans, blocks)
            if rank == 0:  # the coordinator: nobody is left to clean up
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        _dcp.write_blocks = die  # this process only (forked)
        _save_on(mesh, str(tmp_path / "step_000002"), 2)

    with pytest.raises(RankProcessError) as info:
        run_on_mesh(body, {"data": 2}, "distributed", timeout=20.0)
    assert info.value.signal == "SIGKILL" and info.value.rank == 0
    assert not (tmp_path / "step_000002").exists()
    (partial,) = [n for n in os.listdir(tmp_path) if n.startswith("step_000002.tmp-")]
    with pytest.raises(ckpt.IncompleteCheckpointError, match="only the unfinished save"):
        ckpt.load(tmp_path / "step_000002", _values(0), None)
    with pytest.raises(ckpt.IncompleteCheckpointError, match="temporary directory"):
        ckpt.load(tmp_path / partial, _values(0), None)
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_000001")
    assert_trees_equal(ckpt.load(ckpt.latest(tmp_path), _values(0), None), _values(1))


def test_latest_orders_by_step_and_skips_incomplete(tmp_path):
    for step in (9, 10, 100):
        ckpt.save(tmp_path / f"step_{step}", _values(step), None)
    os.makedirs(tmp_path / "step_200.tmp-abc")  # an unfinished save
    os.makedirs(tmp_path / "step_300")  # no .metadata
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_100")
    assert ckpt.latest(tmp_path / "nowhere") is None


def test_overwrite_is_opt_in_and_atomic(tmp_path):
    path = tmp_path / "ckpt"
    ckpt.save(path, _values(1), None)
    with pytest.raises(ckpt.CheckpointError, match="already exists"):
        ckpt.save(path, _values(2), None)
    ckpt.save(path, _values(2), None, overwrite=True)
    assert_trees_equal(ckpt.load(path, _values(0), None), _values(2))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# -- interchange --------------------------------------------------------------------------------

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.ci
def test_fsdp2_round_trip_both_ways(tmp_path):
    """shardfn -> FSDP2 (dcp.load + set_model_state_dict) and FSDP2 (dcp.save) -> shardfn, GPT on 2 ranks."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401 - imported once here, inherited by the forks
    import torch.distributed.fsdp  # noqa: F401

    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")

    def body(mesh):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
        from torch.distributed.fsdp import fully_shard

        def fsdp_gpt(seed):
            torch.manual_seed(seed)
            model = GPT(CFG)
            for block_ in model.transformer.h:
                fully_shard(block_)
            return fully_shard(model)

        full = StateDictOptions(full_state_dict=True)
        prefix = lambda k: "model." + k  # noqa: E731 - the layout torchtitan uses: {"model": state_dict}
        # shardfn -> FSDP2
        torch.manual_seed(1)
        model = GPT(CFG)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        apply_fn, params = sf.functional(model)
        step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
        ckpt.save(ours, step.shard_params(params), mesh, step.specs, key_map=prefix, aliases=ckpt.tied_keys(model))
        fsdp = fsdp_gpt(seed=2)
        sd = get_model_state_dict(fsdp)
        dcp.load({"model": sd}, checkpoint_id=ours)
        set_model_state_dict(fsdp, sd)
        into_fsdp = get_model_state_dict(fsdp, options=full)
        # FSDP2 -> shardfn
        other = fsdp_gpt(seed=3)
        dcp.save({"model": get_model_state_dict(other)}, checkpoint_id=theirs)
        from_fsdp = get_model_state_dict(other, options=full)
        torch.manual_seed(4)
        like = step.shard_params(sf.functional(GPT(CFG))[1])
        loaded = ckpt.load(theirs, like, mesh, step.specs, key_map=prefix, aliases=ckpt.tied_keys(model))
        return expected, into_fsdp, from_fsdp, ckpt.export_full(str(tmp_path / "export.pt"), step, loaded, mesh)

    for expected, into_fsdp, from_fsdp, into_ours in run_on_mesh(body, {"data": 2}, "distributed", timeout=60.0):
        assert sorted(into_fsdp) == sorted(expected) and "lm_head.weight" in expected
        for k in expected:
            assert torch.equal(into_fsdp[k], expected[k]), k
        assert sorted(into_ours) == sorted(k for k in from_fsdp if k != "lm_head.weight")
        for k in into_ours:
            assert torch.equal(into_ours[k], from_fsdp[k]), k
        assert torch.equal(from_fsdp["lm_head.weight"], into_ours["transformer.wte.weight"])


def test_export_full_loads_into_the_module_strictly(tmp_path):
    mesh = mesh_of({"data": 2})
    torch.manual_seed(0)
    model = GPT(CFG)
    apply_fn, params = sf.functional(model)
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
    path = tmp_path / "gpt.pt"
    mesh.run(lambda: ckpt.export_full(path, step, step.shard_params(params), mesh, aliases=ckpt.tied_keys(model)))
    fresh = GPT(CFG)
    fresh.load_state_dict(torch.load(path, weights_only=True), strict=True)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    assert sorted(os.listdir(tmp_path)) == ["gpt.pt"]


def test_export_safetensors_with_tied_names(tmp_path):
    import safetensors.torch  # a test extra

    torch.manual_seed(0)
    model = GPT(CFG)
    _, params = sf.functional(model)
    ckpt.export_full(tmp_path / "gpt.safetensors", lambda p: p, params, None, aliases=ckpt.tied_keys(model))
    loaded = safetensors.torch.load_file(str(tmp_path / "gpt.safetensors"))
    assert sorted(loaded) == sorted(model.state_dict())
    assert torch.equal(loaded["lm_head.weight"], model.transformer.wte.weight.detach())


def test_load_into_meta_like_allocates(tmp_path):
    ckpt.save(tmp_path / "c", {"w": torch.arange(6.0)}, None)
    mesh = mesh_of({"data": 4})
    out = mesh.run(lambda: ckpt.load(tmp_path / "c", {"w": torch.empty(2 if mesh.rank < 3 else 0, device="meta")}, mesh, P("data")))
    assert [o["w"].tolist() for o in out] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], []]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_key_map_dcp_nesting_generators_and_plain_dcp_load(tmp_path):
    """A key_map prefix equals DCP's nesting of {'model': ...}; generators keep their stream."""
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(7)
    torch.rand(3, generator=gen)
    tree = {"w": torch.arange(6.0).reshape(3, 2), "rng": gen, "epoch": 3}
    ckpt.save(tmp_path / "c", tree, None, key_map=lambda k: "model." + k)
    plain = {"model": {"w": torch.zeros(3, 2), "rng": torch.zeros_like(gen.get_state()), "epoch": 0}}
    dcp.load(plain, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert torch.equal(plain["model"]["w"], tree["w"]) and plain["model"]["epoch"] == 3
    back = ckpt.load(tmp_path / "c", {"w": torch.zeros(3, 2), "rng": torch.Generator(), "epoch": 0}, None,
                     key_map={"w": "model.w", "rng": "model.rng", "epoch": "model.epoch"})
    assert torch.equal(torch.rand(4, generator=back["rng"]), torch.rand(4, generator=gen))
    assert ckpt.contents(tmp_path / "c")["model.w"] == ((3, 2), torch.float32)


# -- errors -------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "c"
    ckpt.save(path, {"a": torch.ones(4, 3), "b": {"c": torch.zeros(2)}}, None)
    return path


def test_error_missing_key(saved):
    with pytest.raises(ckpt.CheckpointKeyError, match=r"1 key\(s\) of the tree are not in the checkpoint:\n  - like\['d'\] \(key 'd'\)"):
        ckpt.load(saved, {"a": torch.ones(4, 3), "b": {"c": torch.zeros(2)}, "d": torch.ones(1)}, None)


def test_error_extra_key_and_strict_false(saved):
    with pytest.raises(ckpt.CheckpointKeyError, match=r"holds 1 key\(s\) the tree does not:\n  - b\.c\nFix: pass strict=False"):
        ckpt.load(saved, {"a": torch.zeros(4, 3)}, None)
    assert torch.equal(ckpt.load(saved, {"a": torch.zeros(4, 3)}, None, strict=False)["a"], torch.ones(4, 3))


def test_error_shape_mismatch(saved):
    with pytest.raises(ckpt.CheckpointShapeError, match=r"like\['a'\] \(key 'a'\): global shape \(4, 3\) in the file, \(5, 3\) expected"):
        ckpt.load(saved, {"a": torch.ones(5, 3), "b": {"c": torch.zeros(2)}}, None)


def test_error_shape_mismatch_uses_the_global_shape_on_a_mesh(saved):
    mesh = mesh_of({"data": 2})
    like = lambda: {"a": torch.ones(3 if mesh.rank == 0 else 2, 3), "b": {"c": torch.zeros(2)}}  # noqa: E731
    with pytest.raises(ckpt.CheckpointShapeError, match=r"global shape \(4, 3\) in the file, \(5, 3\) expected"):
        mesh.run(lambda: ckpt.load(saved, like(), mesh, {"a": P("data"), "b": P()}))


def test_error_dtype_mismatch_and_cast(saved):
    like = {"a": torch.ones(4, 3, dtype=D), "b": {"c": torch.zeros(2)}}
    with pytest.raises(ckpt.CheckpointDTypeError, match=r"(?s)like\['a'\] \(key 'a'\): torch.float32 in the file, torch.float64 in the tree.*cast=True"):
        ckpt.load(saved, like, None)
    out = ckpt.load(saved, like, None, cast=True)
    assert out["a"].dtype == D and torch.equal(out["a"], torch.ones(4, 3, dtype=D))


def test_error_incomplete_and_missing_checkpoints(tmp_path):
    os.makedirs(tmp_path / "no_metadata")
    with pytest.raises(ckpt.IncompleteCheckpointError, match="has no .metadata file"):
        ckpt.load(tmp_path / "no_metadata", {}, None)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint at"):
        ckpt.load(tmp_path / "absent", {}, None)


def test_error_key_hint_suggests_prefix(tmp_path):
    ckpt.save(tmp_path / "c", {"w": torch.ones(2)}, None, key_map=lambda k: "model." + k)
    with pytest.raises(ckpt.CheckpointKeyError, match=r"pass key_map=lambda k: 'model\.' \+ k"):
        ckpt.load(tmp_path / "c", {"w": torch.ones(2)}, None)


def test_error_blocks_that_are_not_torch_chunk_blocks(tmp_path):
    mesh = mesh_of({"data": 2})
    with pytest.raises(sf.SpecError, match=r"has block sizes \[1, 3\] but torch.chunk gives \[2, 2\]"):
        mesh.run(lambda: ckpt.save(tmp_path / "c", {"w": torch.ones(1 if mesh.rank == 0 else 3)}, mesh, P("data")))
    assert not os.listdir(tmp_path)  # nothing was written


def test_error_ranks_disagree_on_tree_or_values(tmp_path):
    mesh = mesh_of({"data": 2})
    with pytest.raises(ckpt.CheckpointError, match="the ranks passed different trees.*rank 1 has key 'x'"):
        mesh.run(lambda: ckpt.save(tmp_path / "c", {"w": torch.ones(2), **({"x": 1} if mesh.rank else {})}, mesh))
    with pytest.raises(ckpt.CheckpointError, match=r"tree\['step'\] \(key 'step'\) is not the same Python value on every rank"):
        mesh.run(lambda: ckpt.save(tmp_path / "c", {"step": mesh.rank}, mesh))


def test_error_specs_not_a_prefix():
    with pytest.raises(sf.SpecError, match=r"sf.checkpoint.save: specs is not a pytree prefix.*missing key\(s\) \['b'\]"):
        ckpt.save("unused", {"a": torch.ones(2), "b": 1}, None, {"a": P()})


def test_specs_like_maps_moments_to_param_specs():
    state = optim.adamw(1e-3).init({"w": torch.zeros(4, 2), "b": torch.zeros(2)})
    specs = ckpt.specs_like(state, {"w": P("data"), "b": P()})
    assert specs[0].mu == {"w": P("data"), "b": P()} and specs[0].nu == specs[0].mu and specs[0].count == P()
