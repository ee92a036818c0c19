"""LocalSGD and DiLoCo across the replicas of an HSDP mesh ([Note: semi-synchronous replicas]
in shardfn/_semisync.py), against a single-process fp64 reference written here with
torch.optim (AdamW inside each replica, SGD with Nesterov momentum outside), and the bytes
across replicas against HSDP's, read from `stats()` and from the recorded collectives."""

import pytest
import torch

import shardfn as sf
from shardfn._backend import ops
from shardfn._quant import Wire, nbytes

R, S, H, STEPS = 2, 2, 4, 8  # replicas, shards per replica, inner steps per outer step, inner steps
LR, WD, OUTER_LR, OUTER_MOMENTUM = 1e-2, 1e-2, 0.7, 0.9


def loss_fn(p, batch):
    x, y = batch
    h = torch.tanh(x @ p["layers"][0]["w"] + p["layers"][0]["b"])
    return ((h @ p["layers"][1]["w"] - y) ** 2).mean()


def init():
    g = torch.Generator().manual_seed(0)
    return {"layers": [{"w": torch.randn(6, 8, generator=g, dtype=torch.float64) / 2.5,
                        "b": torch.zeros(8, dtype=torch.float64)},
                       {"w": torch.randn(8, 2, generator=g, dtype=torch.float64) / 3.0}]}


def batch(t: int, data_rank: int):
    g = torch.Generator().manual_seed(1000 * t + data_rank)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    return x, torch.sin(x[:, :2])


def reference(outer_lr: float, outer_momentum: float, wire_dtype=None) -> list[list[dict]]:
    """Per inner step t (after it), per replica: the full parameters, in one process."""
    leaves = lambda tree: [tree["layers"][0]["w"], tree["layers"][0]["b"], tree["layers"][1]["w"]]  # noqa: E731
    params = [init() for _ in range(R)]
    opts = [torch.optim.AdamW([p.requires_grad_() for p in leaves(params[r])], lr=LR, weight_decay=WD)
            for r in range(R)]
    anchor = [x.detach().clone().requires_grad_() for x in leaves(init())]
    outer = torch.optim.SGD(anchor, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    out = []
    for t in range(STEPS):
        for r in range(R):
            opts[r].zero_grad()
            loss = sum(loss_fn(params[r], batch(t, r * S + s)) for s in range(S)) / S  # the mean over 'shard'
            loss.backward()
            opts[r].step()
        if (t + 1) % H == 0:
            with torch.no_grad():
                deltas = [[a - p for a, p in zip(anchor, leaves(params[r]))] for r in range(R)]
                if wire_dtype is not None:
                    deltas = [[d.to(wire_dtype).to(d.dtype) for d in ds] for ds in deltas]
                for i, a in enumerate(anchor):
                    a.grad = (deltas[0][i] + deltas[1][i]) / R
                outer.step()
                for r in range(R):
                    for p, a in zip(leaves(params[r]), anchor):
                        p.copy_(a)
        out.append([[x.detach().clone() for x in leaves(params[r])] for r in range(R)])
    return out


def run(make, **kwargs):
    """Per rank: (per inner step, the unsharded parameters as a list of leaves), stats()."""
    mesh = sf.local_mesh({"replica": R, "shard": S}, timeout=30)
    step = sf.shard(loss_fn, mesh, data_axes="shard")
    train = make(step, sf.optim.adamw(LR, weight_decay=WD), sync_every=H, **kwargs)

    def body():
        shards = step.shard_params(init())
        state = train.init(shards)
        replica, shard = mesh.coords["replica"], mesh.coords["shard"]
        out = []
        for t in range(STEPS):
            shards, state, _ = train(shards, state, batch(t, replica * S + shard))
            full = step.unshard_params(shards)
            out.append([full["layers"][0]["w"], full["layers"][0]["b"], full["layers"][1]["w"]])
        return out, train.stats()

    return mesh, mesh.run(body)


def max_diff(got, want) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


@pytest.mark.parametrize("kind", ["diloco", "local_sgd", "diloco_bf16"])
def test_trajectory_equals_the_single_process_reference(kind):
    if kind == "local_sgd":
        mesh, results = run(sf.local_sgd)
        want = reference(1.0, 0.0)
    else:
        wire = torch.bfloat16 if kind == "diloco_bf16" else None
        mesh, results = run(sf.diloco, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, wire=wire)
        want = reference(OUTER_LR, OUTER_MOMENTUM, wire)
    worst = 0.0
    for rank, (trajectory, stats) in enumerate(results):
        replica = rank // S
        for t in range(STEPS):
            worst = max(worst, max_diff(trajectory[t], want[t][replica]))
        assert (stats["inner_steps"], stats["outer_steps"]) == (STEPS, STEPS // H)
    assert worst < 1e-13, worst  # fp64: rounding only (AdamW's and the reductions' order)
    # between outer steps the replicas part ways; at an outer step they meet again
    r0, r1 = results[0][0], results[S][0]
    assert max_diff(r0[H - 2], r1[H - 2]) > 1e-3
    assert max_diff(r0[H - 1], r1[H - 1]) == 0.0 and max_diff(r0[-1], r1[-1]) == 0.0


def test_bytes_across_replicas_are_one_hth_of_hsdp():
    mesh = sf.local_mesh({"replica": R, "shard": S}, timeout=30)
    hsdp = sf.shard(loss_fn, mesh, data_axes=("replica", "shard"), shard_axes="shard")

    def hsdp_body():
        shards = hsdp.shard_params(init())
        with ops.recording() as rec:
            hsdp.grad_and_value(shards, batch(0, mesh.rank))
        grads = sum(c.nbytes for c in rec.records if c.axes == ("replica",))
        loss = sum(c.nbytes for c in rec.records if c.axes == ("replica", "shard"))
        return grads, loss, hsdp.stats()["all_reduce_bytes"]

    hsdp_bytes, loss_bytes, hsdp_all_reduce = mesh.run(hsdp_body)[0]
    shard_numel = (6 * 8 + 8 + 8 * 2) // S  # this rank's shard of every leaf (each divides by S)
    assert hsdp_bytes == shard_numel * 8  # the gradient shards' all-reduces across replicas, fp64, every step
    assert hsdp_all_reduce == hsdp_bytes + loss_bytes  # stats() sees them, and the loss mean's (its 32 bytes)

    for wire, per_sync in [(None, shard_numel * 8), (torch.bfloat16, R * nbytes(shard_numel, Wire.of(torch.bfloat16),
                                                                               torch.float64)),
                           ("int8", R * nbytes(shard_numel, Wire.of("int8"), torch.float64))]:
        _, results = run(sf.diloco, wire=wire)
        for _, stats in results:
            assert stats["replica_bytes"] == (STEPS // H) * per_sync, (wire, stats)
            if wire is None:  # the gradient part of HSDP's cross-replica bytes, once per H inner steps
                assert stats["replica_bytes_per_inner_step"] * H == hsdp_bytes
    assert R * nbytes(shard_numel, Wire.of("int8"), torch.float64) < shard_numel * 8 / 2


def test_an_inner_step_that_averages_over_replicas_is_refused():
    mesh = sf.local_mesh({"replica": R, "shard": S}, timeout=30)
    hsdp = sf.shard(loss_fn, mesh, data_axes=("replica", "shard"), shard_axes="shard")
    with pytest.raises(sf.SpecError, match=r"diloco: the inner step averages its gradients over \('replica', "
                                           r"'shard'\), which include the replica axes \['replica'\]"):
        sf.diloco(hsdp, sf.optim.adamw(LR), sync_every=H)
    step = sf.shard(loss_fn, mesh, data_axes="shard")
    with pytest.raises(sf.SpecError, match="local_sgd: sync_every must be a positive int"):
        sf.local_sgd(step, sf.optim.adamw(LR), sync_every=0)
