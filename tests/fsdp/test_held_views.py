"""A leaf that loss_fn keeps past other units' entry ([Note: a view kept across units] in
shardfn/_fsdp/runtime.py): its unit stays gathered to the end of the forward, so the loss
and gradients equal one device's. Before the fix this read freed storage: a segfault on
CPU (found by tests/test_fuzz.py)."""

import pytest
import torch

import shardfn as sf

MESH = sf.local_mesh({"data": 2}, timeout=30)
PARAMS = [{"w": torch.arange(12.0).reshape(4, 3) / 10 + i} for i in range(3)]  # 3 units of one leaf


def read_all_then_use(p, x):
    ws = [blk["w"] for blk in p]  # every unit entered (and, in a layer stack, freed) before any use
    return sum(((x @ w.T).tanh().sum() for w in ws), torch.zeros(()))


def layer_stack(p, x):
    for blk in p:
        x = torch.cat([(x @ blk["w"].T).tanh(), x[:, 3:]], dim=1)[:, :3]
    return x.sum()


def _reference(fn, x):
    params = [{"w": b["w"].clone().requires_grad_()} for b in PARAMS]
    loss = fn(params, x)
    loss.backward()
    return loss.detach(), [b["w"].grad for b in params]


@pytest.mark.parametrize("entry", ["call", "grad", "backward"])
def test_leaves_read_first_and_used_after_other_units_equal_one_device(entry):
    step = sf.shard(read_all_then_use, MESH)
    x = torch.linspace(-1, 1, 12).reshape(4, 3)
    want_loss, want_grads = _reference(read_all_then_use, x)

    def body():
        shards = step.shard_params(PARAMS)
        local = x[2 * MESH.rank: 2 * MESH.rank + 2]
        if entry == "call":
            return step(shards, local).detach(), None
        if entry == "grad":
            grads, loss = torch.func.grad_and_value(step)(shards, local)
        else:
            shards = [{"w": b["w"].clone().requires_grad_()} for b in shards]
            loss = step(shards, local)
            loss.backward()
            grads = [{"w": b["w"].grad} for b in shards]
        return loss.detach(), step.unshard_params(grads)

    for loss, grads in MESH.run(body):
        # the step's loss is the mean over ranks of each rank's sum over its examples
        torch.testing.assert_close(loss, want_loss / 2, rtol=1e-6, atol=1e-6)
        if grads is not None:
            for got, want in zip(grads, want_grads):
                torch.testing.assert_close(got["w"], want / 2, rtol=1e-6, atol=1e-6)


def test_a_layer_stack_still_frees_each_unit_when_the_next_is_entered():
    """The check keeps only what loss_fn holds: a layer stack has one unit gathered at a
    time (no prefetch here), not all three."""
    step = sf.shard(layer_stack, MESH, prefetch=0)
    unit_bytes = 4 * 3 * 4

    def body():
        shards = step.shard_params(PARAMS)
        torch.func.grad(step)(shards, torch.ones(2, 3))
        return step.stats()["peak_gathered_bytes"]

    assert MESH.run(body) == [unit_bytes, unit_bytes]


def held_on_rank_0(p, x):
    """Every rank reads unit 0's leaf (a read is a gather); rank 0 keeps it while unit 1 is
    entered; then every rank reads it again."""
    first = p[0]["w"]
    kept = first if sf.axis_index("data") == 0 else None
    del first
    y = (x @ p[1]["w"].T).tanh()
    w0 = p[0]["w"]  # read again: gathered again (and pinned) on both ranks
    return (y @ w0).sum() + (x @ p[2]["w"].T).sum() + (0.0 if kept is None else 0.0 * kept.sum())


def test_a_held_leaf_read_again_gathers_as_a_freed_one():
    """A deferred unit read again is released and gathered again, as on a rank where it was
    freed: the collectives do not depend on what loss_fn held (if they did, the simulated
    mesh would raise a DesyncError), and the result is one device's."""
    step = sf.shard(held_on_rank_0, MESH)
    x = torch.linspace(-1, 1, 12).reshape(4, 3)
    params = [{"w": b["w"].clone().requires_grad_()} for b in PARAMS]
    want_loss = sum(held_on_rank_0_ref(params, x[2 * r: 2 * r + 2]) for r in range(2)) / 2
    want_loss.backward()

    def body():
        grads, loss = torch.func.grad_and_value(step)(step.shard_params(PARAMS), x[2 * MESH.rank: 2 * MESH.rank + 2])
        return loss, step.unshard_params(grads), step.stats()["all_gather_bytes"]

    (l0, g0, b0), (l1, g1, b1) = MESH.run(body)
    assert b0 == b1
    for loss, grads in ((l0, g0), (l1, g1)):
        torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-6, atol=1e-6)
        for got, want in zip(grads, params):
            torch.testing.assert_close(got["w"], want["w"].grad, rtol=1e-6, atol=1e-6)


def held_on_rank_0_ref(p, x):
    y = (x @ p[1]["w"].T).tanh()
    return (y @ p[0]["w"]).sum() + (x @ p[2]["w"].T).sum()
