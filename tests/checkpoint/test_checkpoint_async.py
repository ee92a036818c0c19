"""sf.checkpoint.save(..., blocking=False): write in the background, publish on wait()."""

import os
import signal

import pytest
import torch

import shardfn as sf
import shardfn.checkpoint as ckpt
import shardfn.optim as optim
from shardfn._checkpoint import _dcp
from shardfn.testing import RankProcessError, run_on_mesh
from shardfn.testing.models import mlp_loss, mlp_params

P = sf.P
D = torch.float64
SIZES = [5, 7, 3]


def _values(seed):
    return {"w": torch.arange(10.0) + seed, "step": seed}


def _blocks(mesh, seed):
    w = _values(seed)["w"].chunk(mesh.size)[mesh.rank].clone()
    return {"w": w, "step": seed}, {"w": P("data"), "step": P()}


def test_async_save_keeps_the_values_of_the_call_while_training_changes_them_in_place(tmp_path):
    """Shards and AdamW state saved with blocking=False, then 3 in-place training steps
    before wait(): the checkpoint holds the values at the save call, and loads on
    another world size."""
    mesh, other = sf.local_mesh({"data": 2}), sf.local_mesh({"data": 3})
    params = mlp_params(torch.Generator().manual_seed(0), SIZES, D)
    path = str(tmp_path / "step_000001")

    def train_and_save():
        step = sf.shard(mlp_loss, mesh)
        opt = optim.adamw(1e-2, inplace=True)
        train = sf.train_step(step, opt, inplace=True)
        shards = step.shard_params(params)
        state = opt.init(shards)
        g = torch.Generator().manual_seed(mesh.rank)
        batch = (torch.randn(4, 5, generator=g, dtype=D), torch.randn(4, 3, generator=g, dtype=D))
        shards, state, _ = train(shards, state, batch)
        specs = {"params": step.specs, "opt": ckpt.specs_like(state, step.specs, shards)}
        expected = {"params": step.unshard_params(shards), "mu": step.unshard_params(state[0].mu)}
        pending = ckpt.save(path, {"params": shards, "opt": state}, mesh, specs, blocking=False)
        assert isinstance(pending, ckpt.PendingSave) and not os.path.exists(path)
        for _ in range(3):  # in place: the very tensors handed to save change
            shards, state, _ = train(shards, state, batch)
        assert ckpt.latest(tmp_path) is None  # not published before wait()
        assert pending.wait() == path and pending.done()
        assert ckpt.latest(tmp_path) == path
        moved = step.unshard_params(shards)
        assert not torch.equal(moved["layers"][0]["w"], expected["params"]["layers"][0]["w"])
        return expected

    expected = mesh.run(train_and_save)[0]

    def load_on_three():
        step = sf.shard(mlp_loss, other)
        opt = optim.adamw(1e-2)
        like_shards = step.shard_params(params)
        like = {"params": like_shards, "opt": opt.init(like_shards)}
        specs = {"params": step.specs, "opt": ckpt.specs_like(like["opt"], step.specs, like_shards)}
        tree = ckpt.load(path, like, other, specs)
        return {"params": step.unshard_params(tree["params"]), "mu": step.unshard_params(tree["opt"][0].mu)}

    for got in other.run(load_on_three):
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
            assert torch.equal(a, b)


def test_async_save_failure_on_one_rank_raises_on_every_rank_at_wait(tmp_path, monkeypatch):
    mesh = sf.local_mesh({"data": 2})
    mesh.run(lambda: ckpt.save(str(tmp_path / "step_000001"), _blocks(mesh, 1)[0], mesh, _blocks(mesh, 1)[1]))
    real = _dcp.write_blocks

    def flaky(tmp, final, rank, plans, blocks):
        out = real(tmp, final, rank, plans, blocks)
        if rank == 1:
            raise OSError("injected: disk full on rank 1")
        return out

    monkeypatch.setattr(_dcp, "write_blocks", flaky)
    errors = []

    def body():
        tree, specs = _blocks(mesh, 2)
        pending = ckpt.save(str(tmp_path / "step_000002"), tree, mesh, specs, blocking=False)
        try:
            pending.wait()
        except OSError as err:
            errors.append((mesh.rank, str(err)))
            raise

    with pytest.raises(OSError, match="injected"):
        mesh.run(body)
    assert sorted(r for r, _ in errors) == [0, 1] and all("disk full on rank 1" in e for _, e in errors)
    assert os.listdir(tmp_path) == ["step_000001"]
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_000001")


def test_async_save_wait_twice_is_an_error(tmp_path):
    pending = ckpt.save(tmp_path / "c", _values(1), None, blocking=False)
    assert "PendingSave(" in repr(pending)
    assert pending.wait() == str(tmp_path / "c")
    with pytest.raises(ckpt.CheckpointError, match="already waited for"):
        pending.wait()
    loaded = ckpt.load(tmp_path / "c", _values(0), None)
    assert torch.equal(loaded["w"], _values(1)["w"]) and loaded["step"] == 1


@pytest.mark.multiprocess
def test_async_save_on_processes_and_a_kill_before_wait(tmp_path):
    """2 gloo processes: an async save published by wait() loads back; a second one whose
    rank 0 is SIGKILLed before wait() is never published, and the first stays the latest."""

    def body(mesh):
        tree, specs = _blocks(mesh, 1)
        ckpt.save(str(tmp_path / "step_000001"), tree, mesh, specs, blocking=False).wait()
        loaded = ckpt.load(str(tmp_path / "step_000001"), {"w": torch.zeros_like(tree["w"]), "step": 0}, mesh, specs)
        assert torch.equal(loaded["w"], tree["w"]) and loaded["step"] == 1
        tree, specs = _blocks(mesh, 2)
        pending = ckpt.save(str(tmp_path / "step_000002"), tree, mesh, specs, blocking=False)
        if mesh.rank == 0:
            while not pending.done():
                pending._thread.join(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        pending.wait()

    with pytest.raises(RankProcessError) as info:
        run_on_mesh(body, {"data": 2}, "distributed", timeout=20.0)
    assert info.value.signal == "SIGKILL" and info.value.rank == 0
    assert not (tmp_path / "step_000002").exists()
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_000001")
    loaded = ckpt.load(ckpt.latest(tmp_path), _values(0), None)
    assert torch.equal(loaded["w"], _values(1)["w"])
