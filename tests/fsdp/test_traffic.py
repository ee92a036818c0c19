"""`step.stats()` against what the backend actually sent (`ops.recording`).

`stats()` is bookkeeping kept beside the collectives; the recording sits in ops.py, the
one choke point every collective passes. Over a grid of options (resharding, prefetch,
HSDP, mixed precision, frozen leaves, a replicated 0-dim leaf, FSDP x TP, hpZ,
check_finite, accumulation) and every way of taking a gradient, the two must agree on
the bytes of each kind and on the number of collectives, on every rank, on every call.
"""

import optree
import pytest
import torch

import shardfn as sf
from collective_cases import mesh_for
from traffic import sent, stats_view, totals

P = sf.P
F64 = torch.float64
LAYER_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": None, "scale": None}


def init(d=5, h=4, layers=2, d_out=3, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    return {
        "layers": [{"w1": r(d, h, s=d ** -0.5), "b1": r(h, s=0.1), "w2": r(h, d, s=h ** -0.5), "b2": r(d, s=0.1),
                    "scale": 1 + r(d, s=0.1)} for _ in range(layers)],
        "head": r(d, d_out),
        "temperature": torch.tensor(1.5, dtype=dtype),  # 0-dim: replicated, gradient all-reduced
    }


def make_loss(tp: bool):
    def loss_fn(params, batch):
        x, y = batch
        for layer in params["layers"]:
            h = torch.tanh((x * layer["scale"]) @ layer["w1"] + layer["b1"])
            out = h @ layer["w2"]
            x = x + (sf.psum(out, "model") if tp else out) + layer["b2"]
        return ((x @ params["head"] - y) ** 2).mean() * params["temperature"]

    return loss_fn


BF16 = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

# name -> (mesh shape, shard() keyword arguments); "tp" cases add param_specs.
SETUPS = {
    "fsdp2": ({"data": 2}, {}),
    "fsdp3-uneven": ({"data": 3}, {}),
    "hsdp2x2": ({"replica": 2, "shard": 2}, dict(data_axes=("replica", "shard"), shard_axes="shard")),
    "bf16": ({"data": 2}, dict(mixed_precision=BF16)),
    "bf16-reduce": ({"data": 2}, dict(mixed_precision=sf.MixedPrecision(torch.bfloat16, torch.bfloat16))),
    "frozen": ({"data": 2}, dict(frozen=lambda path: path[:2] == ("layers", 0))),
    "check_finite": ({"data": 2}, dict(check_finite=True)),
    "tp": ({"data": 2, "model": 2}, dict(tp=True)),
    "hsdp-tp": ({"replica": 2, "shard": 2, "model": 2},
                dict(tp=True, data_axes=("replica", "shard"), shard_axes="shard")),
    "hpz": ({"node": 2, "gpu": 2}, dict(data_axes=("node", "gpu"), reshard_after_forward="gpu")),
}


# [Note: loss_fn's own collectives] `stats()` counts the collectives of the step (gathers,
# reductions, the loss, checks), not those loss_fn issues itself: in the TP cases, each
# layer's psum of its (rows, 5) activations over 'model' in the forward and psum's
# transpose, another psum, in the backward (so 2 layers x 2; per micro-batch under
# accumulate, whose micro-batches split the rows; nothing on a one-rank 'model' axis).
# They are taken off the recording.


def run_calls(shape, kwargs, mode, calls=2):
    """Per rank: [(recorded totals, stats) for each call] of `calls` gradient steps."""
    kwargs = dict(kwargs)
    tp = kwargs.pop("tp", False)
    mesh = mesh_for(shape)
    dtype = torch.float32 if "mixed_precision" in kwargs else F64
    params = init(dtype=dtype)
    if tp:
        kwargs["param_specs"] = {"layers": [LAYER_SPECS] * 2, "head": None, "temperature": None}
    data_axes = kwargs.get("data_axes", "data")
    step = sf.shard(make_loss(tp), mesh, **kwargs)

    def body():
        group = mesh.group(data_axes)
        g = torch.Generator().manual_seed(100 + group.index)  # the same batch on every 'model' rank
        shards = step.shard_params(params)
        out = []
        for _ in range(calls):
            batch = (torch.randn(4, 5, generator=g, dtype=dtype), torch.randn(4, 3, generator=g, dtype=dtype))
            with sent() as rec:
                if mode == "func":
                    torch.func.grad_and_value(step)(shards, batch)
                elif mode == "fast":
                    step.grad_and_value(shards, batch)
                elif mode == "backward":
                    leaves = optree.tree_leaves(shards)
                    for t in leaves:
                        t.requires_grad_(True)
                        t.grad = None
                    step(shards, batch).backward()
                else:  # accumulate: stats cover all micro-batches
                    micro = [(batch[0][:2], batch[1][:2]), (batch[0][2:], batch[1][2:])]
                    step.accumulate(shards, micro, mode=mode)
            recorded = totals(rec.records)
            if tp and mesh.shape["model"] > 1:  # [Note: loss_fn's own collectives]
                rows = batch[0].shape[0]
                recorded["all_reduce_bytes"] -= 2 * 2 * rows * 5 * dtype.itemsize
                recorded["num_collectives"] -= 2 * 2 * (2 if mode.startswith("reduce_") else 1)
            mp = kwargs.get("mixed_precision")
            if mp is not None:  # gathers move param_dtype, reduce-scatters reduce_dtype
                assert {c.dtype for c in rec.records if c.op == "all_gather"} == {mp.param_dtype}
                assert {c.dtype for c in rec.records if c.op == "reduce_scatter"} == {mp.reduce_dtype}
            out.append((recorded, stats_view(step.stats())))
        return out

    return mesh.run(body)


def assert_agree(results):
    for rank, calls in enumerate(results):
        for i, (recorded, stats) in enumerate(calls):
            assert stats == recorded, f"rank {rank}, call {i}: stats() {stats} != recorded {recorded}"


GRID = [(r, p) for r in (True, False) for p in (0, 2)]


@pytest.mark.parametrize("reshard, prefetch", GRID, ids=[f"reshard{r}-prefetch{p}" for r, p in GRID])
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("mode", ["func", "backward", "fast"])
def test_stats_agree_with_what_was_sent(setup, reshard, prefetch, mode):
    shape, kwargs = SETUPS[setup]
    kwargs = {"reshard_after_forward": reshard, **kwargs, "prefetch": prefetch}
    assert_agree(run_calls(shape, kwargs, mode))


@pytest.mark.parametrize("setup", ["fsdp2", "hsdp2x2", "bf16", "frozen", "tp"])
@pytest.mark.parametrize("mode", ["reduce_each", "reduce_once"])
def test_stats_agree_with_what_was_sent_under_accumulate(setup, mode):
    shape, kwargs = SETUPS[setup]
    assert_agree(run_calls(shape, kwargs, mode))


ONE_RANK_GROUPS = [  # (mesh shape, shard() kwargs): all-reduces over one-rank groups send nothing, count nothing
    pytest.param({"data": 1}, {}, id="data1"),
    pytest.param({"data": 1}, dict(check_finite=True), id="data1-check_finite"),
    pytest.param({"data": 1, "model": 2}, dict(tp=True), id="tp-data1"),
    pytest.param({"data": 2, "model": 1}, dict(tp=True), id="tp-model1"),
    pytest.param({"replica": 1, "shard": 2}, dict(data_axes=("replica", "shard"), shard_axes="shard"), id="hsdp1x2"),
    pytest.param({"replica": 2, "shard": 1}, dict(data_axes=("replica", "shard"), shard_axes="shard"), id="hsdp2x1"),
]


@pytest.mark.parametrize("shape, kwargs", ONE_RANK_GROUPS)
def test_stats_agree_with_what_was_sent_with_one_rank_axes(shape, kwargs):
    """Axes of size one. `ops.all_reduce` over a one-rank group returns a copy without
    calling the process group, so stats() must not count it; the gathers and
    reduce-scatters still go through the (one-rank) process group and both count them."""
    assert_agree(run_calls(shape, kwargs, "func"))
