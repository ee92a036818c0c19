"""Context parallelism composed with the rest of shardfn, on a GPT (shardfn/testing/seq_gpt.py).

The sequence is split over 'seq' (ring or Ulysses attention, contiguous or zig-zag), the
parameters are FSDP-sharded over 'data' by `sf.shard(..., data_axes=("data", "seq"))`, and
every result is compared with one device training the same GPT on the whole batch (fp64):
`sf.train_step` over 5 AdamW steps (params <= 1e-9), `torch.func.grad` of the step, CP x TP
on a 3-D mesh, `sf.remat` around blocks that call ring attention, and `sf.estimate` of a
CP step on meta tensors. The same training runs on forked processes (slow).
"""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch

import shardfn as sf
from shardfn.testing import run_on_mesh
from shardfn.testing import seq_gpt as G

F64 = torch.float64
CFG = G.SeqGPTConfig(vocab_size=64, max_len=32, n_layer=2, n_head=4, n_embd=32)
TOKENS = sf.P("data", "seq")  # (B, T) token ids: batch over 'data', sequence over 'seq'


def batches(cfg, b: int, t: int, steps: int):
    """`steps` batches of (idx, targets), each (b, t) int64."""
    out = []
    for s in range(steps):
        idx = torch.randint(cfg.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(100 + s))
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def params_of(cfg):
    return G.init_params(cfg, torch.Generator().manual_seed(0), F64)


def single_device(cfg, params, data, opt):
    """One process, the whole batch: the reference."""
    state = opt.init(params)
    train = sf.train_step(lambda p, b: G.loss_fn(p, b, cfg), opt)
    losses = []
    for batch in data:
        params, state, loss = train(params, state, batch)
        losses.append(loss.item())
    return params, losses


def maxdiff(a, b) -> float:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb)
    return max((x - y).abs().max().item() for x, y in zip(la, lb))


def cp_config(cfg, attention, layout, **kw):
    return dataclasses.replace(cfg, attention=attention, axis="seq", layout=layout, **kw)


def local_batch(mesh, batch, layout):
    """This rank's block of a global (idx, targets) batch (zig-zag: reordered first)."""
    n = mesh.shape["seq"]
    if layout == "zigzag":
        batch = tuple(sf.nn.zigzag(x, n, 1) for x in batch)
    return tuple(sf.scatter(x, mesh, TOKENS) for x in batch)


def cp_training(mesh, cfg, params, data, opt, layout, **shard_options):
    """The rank program: sf.shard over ('data', 'seq'), sf.train_step, AdamW in place."""
    step = sf.shard(lambda p, b: G.loss_fn(p, b, cfg), mesh, data_axes=("data", "seq"), **shard_options)
    shards = step.shard_params(params)
    state = opt.init(shards)
    train = sf.train_step(step, opt, inplace=True)
    losses = []
    for batch in data:
        shards, state, loss = train(shards, state, local_batch(mesh, batch, layout))
        losses.append(loss.item())
    return step.unshard_params(shards), losses


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_cp_x_fsdp_training_equals_one_device(attention, layout):
    """{'data': 2, 'seq': 2}: 5 AdamW steps of sf.train_step(sf.shard(...)) == one device."""
    data, opt = batches(CFG, 4, 16, 5), sf.optim.adamw(1e-2)
    want, want_losses = single_device(CFG, params_of(CFG), data, opt)
    mesh = sf.local_mesh({"data": 2, "seq": 2})
    cfg = cp_config(CFG, attention, layout)
    for got, losses in mesh.run(cp_training, mesh, cfg, params_of(CFG), data, opt, layout, shard_axes="data"):
        assert maxdiff(got, want) <= 1e-9
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-12
    assert want_losses[0] != want_losses[-1]  # it trained


def test_params_sharded_over_both_axes_and_rope():
    """FSDP over 'data' x 'seq' (every rank a different shard, as torchtitan does), RoPE
    at sf.nn.positions, ring attention, zig-zag: still one device's training."""
    base = dataclasses.replace(CFG, rope=True)
    data, opt = batches(base, 2, 16, 5), sf.optim.adamw(1e-2)
    want, _ = single_device(base, params_of(base), data, opt)
    mesh = sf.local_mesh({"data": 1, "seq": 4})
    cfg = cp_config(base, "ring", "zigzag")
    for got, _ in mesh.run(cp_training, mesh, cfg, params_of(base), data, opt, "zigzag", shard_axes=("data", "seq")):
        assert maxdiff(got, want) <= 1e-9


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_func_grad_of_the_cp_step(attention):
    """torch.func.grad(step): reduce-scattered gradients averaged over 'data' and 'seq' ==
    the single-device gradient of the token-mean loss."""
    params, (batch,) = params_of(CFG), batches(CFG, 4, 8, 1)
    want = torch.func.grad(lambda p: G.loss_fn(p, batch, CFG))(params)
    mesh = sf.local_mesh({"data": 2, "seq": 2})
    cfg = cp_config(CFG, attention, "contiguous")
    step = sf.shard(lambda p, b: G.loss_fn(p, b, cfg), mesh, data_axes=("data", "seq"), shard_axes="data")

    def body():
        grads = torch.func.grad(step)(step.shard_params(params), local_batch(mesh, batch, "contiguous"))
        return step.unshard_params(grads)

    for got in mesh.run(body):
        assert maxdiff(got, want) <= 1e-10


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_cp_x_tp_on_a_3d_mesh(attention):
    """{'data': 2, 'seq': 2, 'model': 2}: the MLP split Megatron-style over 'model'
    (param_specs), the sequence over 'seq', FSDP over 'data'; 3 AdamW steps == one device."""
    data, opt = batches(CFG, 2, 8, 3), sf.optim.adamw(1e-2)
    want, want_losses = single_device(CFG, params_of(CFG), data, opt)
    mesh = sf.local_mesh({"data": 2, "seq": 2, "model": 2})
    cfg = cp_config(CFG, attention, "zigzag", mlp_axis="model")
    results = mesh.run(cp_training, mesh, cfg, params_of(CFG), data, opt, "zigzag", shard_axes="data",
                       param_specs=G.mlp_tp_spec)
    for got, losses in results:
        assert maxdiff(got, want) <= 1e-9
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-12


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_remat_around_blocks_that_call_context_parallel_attention(attention):
    """sf.remat(block) recomputes the attention (its collectives included) in the backward:
    the gradients are the single-device ones (eager and torch.func), remat's recompute
    check accepts the ring's autograd.Function as one call, and the ring's forward pass
    runs once more per block: N - 1 more K/V transfers each."""
    from shardfn.nn._ring import counting

    params, (batch,) = params_of(CFG), batches(CFG, 2, 16, 1)
    want = torch.func.grad(lambda p: G.loss_fn(p, batch, CFG))(params)
    mesh = sf.local_mesh({"data": 1, "seq": 2})
    transfers = {}
    for remat in (False, True):
        cfg = cp_config(CFG, attention, "zigzag", remat=remat)
        step = sf.shard(lambda p, b, cfg=cfg: G.loss_fn(p, b, cfg), mesh, data_axes=("data", "seq"))

        def body(step=step):
            shards = step.shard_params(params)
            with counting() as c:
                grads, _ = step.grad_and_value(shards, local_batch(mesh, batch, "zigzag"))  # eager autograd
            func = torch.func.grad(step)(shards, local_batch(mesh, batch, "zigzag"))
            return step.unshard_params(grads), step.unshard_params(func), c["transfers"]

        for eager, func, n_transfers in mesh.run(body):
            assert maxdiff(eager, want) <= 1e-10
            assert maxdiff(func, want) <= 1e-10
            transfers[remat] = n_transfers
    if attention == "ring":
        assert transfers[True] == transfers[False] + CFG.n_layer * (2 - 1)
    else:
        assert transfers == {False: 0, True: 0}


def test_estimate_of_a_cp_step():
    """sf.estimate plans a CP step on meta tensors (ring attention's ppermutes included):
    per-rank params are 1/2 of the model (FSDP over 'data'), and the activations of a rank
    holding T/4 tokens are below 0.4 of those of a rank holding all T."""
    cfg1 = dataclasses.replace(CFG, max_len=128)
    params = G.init_params(cfg1, torch.Generator().manual_seed(0))
    t = 128

    def est(cfg, mesh_shape, t_local):
        tokens = ((2, t_local), torch.long)
        return sf.estimate(lambda p, b: G.loss_fn(p, b, cfg), params, (tokens, tokens), mesh_shape,
                           optimizer=sf.optim.adamw(1e-3), data_axes=("data", "seq"), shard_axes="data")

    one = est(cfg1, {"data": 2, "seq": 1}, t)
    ring = est(cp_config(cfg1, "ring", "zigzag"), {"data": 2, "seq": 4}, t // 4)
    full = sum(x.numel() * 4 for x in optree.tree_leaves(params))
    assert ring.param_bytes <= full // 2 + 64 and ring.param_bytes == one.param_bytes
    assert ring.peak_activation_bytes < 0.4 * one.peak_activation_bytes


def _distributed_training(attention):
    data, opt = batches(CFG, 4, 16, 5), sf.optim.adamw(1e-2)
    want, _ = single_device(CFG, params_of(CFG), data, opt)
    cfg = cp_config(CFG, attention, "zigzag")
    results = run_on_mesh(lambda mesh: cp_training(mesh, cfg, params_of(CFG), data, opt, "zigzag",
                                                   shard_axes="data"),
                          {"data": 2, "seq": 2}, "distributed", timeout=60.0)
    assert len(results) == 4
    for got, _ in results:
        assert maxdiff(got, want) <= 1e-9


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.multiprocess
def test_cp_x_fsdp_training_on_processes_ring():
    """4 forked processes (gloo), {'data': 2, 'seq': 2}, ring attention: == one device."""
    _distributed_training("ring")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cp_x_fsdp_training_on_processes_ulysses():
    _distributed_training("ulysses")
