"""sf.diloco against torchft's own DiLoCo (the optional extra `shardfn[ft]`: torchft==0.2.0).

torchft's reference: 2 replicas as threads of this process, each a real torchft `Manager`
(a `LighthouseServer` for the quorum, a reconfigurable `ProcessGroupGloo` for the
all-reduce) around an `nn.Module` with the full parameters, `torch.optim.AdamW` inside and
`torch.optim.SGD` with Nesterov momentum outside, wrapped by `torchft.local_sgd.DiLoCo`.
Each torchft replica trains on the batches of its replica's two shards (the mean of their
losses, as the inner shard step averages them). shardfn: `sf.diloco` on
`{"replica": 2, "shard": 2}` (tests/optim/test_semisync.py's `run`). The trajectories agree
to fp64 rounding at every inner step, the outer steps included.
"""

import copy
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch import nn

import shardfn as sf
from test_semisync import H, LR, OUTER_LR, OUTER_MOMENTUM, R, S, STEPS, WD, batch, init, loss_fn, max_diff, run

torchft = pytest.importorskip("torchft", reason="torchft is the optional extra shardfn[ft]")

import torch.distributed as dist  # noqa: E402
from torchft._torchft import LighthouseServer  # noqa: E402
from torchft.local_sgd import DiLoCo  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        p = init()
        self.w0 = nn.Parameter(p["layers"][0]["w"])
        self.b0 = nn.Parameter(p["layers"][0]["b"])
        self.w1 = nn.Parameter(p["layers"][1]["w"])

    def tree(self):
        return {"layers": [{"w": self.w0, "b": self.b0}, {"w": self.w1}]}


def torchft_replica(r: int, lighthouse: str, out: dict) -> None:
    torch.set_num_threads(1)
    net = Net()
    inner = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    outer = torch.optim.SGD(net.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(), min_replica_size=R, use_async_quorum=False,
        init_sync=False,  # the replicas start equal; a sync at step 0 would copy one into the other
        load_state_dict=lambda sd: (net.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": net.state_dict(), "optim": inner.state_dict()},
        replica_id=str(r), store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, port=0, connect_timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=20), timeout=timedelta(seconds=20),
    )
    try:
        trajectory = []
        with DiLoCo(manager, [net], inner, outer, sync_every=H, backup_device=torch.device("cpu"), pin_memory=False):
            for t in range(STEPS):
                inner.zero_grad()
                loss = sum(loss_fn(net.tree(), batch(t, r * S + s)) for s in range(S)) / S
                loss.backward()
                inner.step()  # DiLoCo's hooks: the outer step every H inner steps
                trajectory.append([p.detach().clone() for p in (net.w0, net.b0, net.w1)])
        out[r] = (trajectory, manager.current_step())
    except BaseException as err:  # noqa: BLE001 - reported by the test
        out[r] = err
    finally:
        manager.shutdown(wait=False)


@pytest.mark.slow
def test_diloco_follows_torchfts_diloco():
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=R)
    out: dict = {}
    try:
        threads = [threading.Thread(target=torchft_replica, args=(r, lighthouse.address(), out), daemon=True)
                   for r in range(R)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        lighthouse.shutdown()
    errors = {r: v for r, v in out.items() if isinstance(v, BaseException)}
    assert not errors and len(out) == R, (errors, list(out))
    assert [out[r][1] for r in range(R)] == [STEPS // H] * R  # torchft's manager committed every outer step

    _, results = run(sf.diloco, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    worst = 0.0
    for rank, (trajectory, _) in enumerate(results):
        theirs = out[rank // S][0]
        for t in range(STEPS):
            worst = max(worst, max_diff(trajectory[t], theirs[t]))
    assert worst < 1e-13, worst


# -- a replica lost and healed, through torchft's Manager ---------------------------------------

H2, OUTER_STEPS, DIE_AT = 2, 7, 5  # replica 1 dies before its 6th inner step (in outer period 2)


class Died(Exception):
    pass


def ft_replica(r: int, shards_per_replica: int, lighthouse: str, logs: list, finals: dict, die_at=None,
               alone=None, start=None, back=None) -> None:
    """One replica (its own mesh {"shard": S}, one torchft Manager per rank) under
    sf.diloco(replicas=<the rank's Manager>)."""
    mesh = sf.local_mesh({"shard": shards_per_replica}, timeout=30)
    step = sf.shard(loss_fn, mesh, data_axes="shard")
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)

    def body():
        torch.set_num_threads(1)
        me = mesh.rank
        manager = Manager(
            pg=ProcessGroupGloo(), min_replica_size=1, use_async_quorum=False, init_sync=False,
            load_state_dict=lambda sd: train.load_state_dict(sd, rank=me), state_dict=lambda: train.state_dict(rank=me),
            replica_id=str(r), store_addr="localhost", store_port=store.port, rank=me, world_size=shards_per_replica,
            lighthouse_addr=lighthouse, port=0, connect_timeout=timedelta(seconds=20),
            quorum_timeout=timedelta(seconds=30), timeout=timedelta(seconds=20))
        train = sf.diloco(step, sf.optim.adamw(LR, weight_decay=WD), sync_every=H2, outer_lr=OUTER_LR,
                          outer_momentum=OUTER_MOMENTUM, replicas=manager)
        if start is not None:  # both replicas' Managers heartbeat before the first quorum: one quorum of two,
            start.wait(60)  # not two of one (min_replicas=1 would let each form its own)
            time.sleep(0.5)
        if back is not None and alone is None:  # the replacement: its Manager heartbeats; replica 0 may go on
            time.sleep(0.5)
            back.set()
        try:
            shards = step.shard_params(init())
            state = train.init(shards)
            while manager.current_step() < OUTER_STEPS:
                if die_at is not None and state.count == die_at:
                    raise Died(f"replica {r} lost")
                shards, state, _ = train(shards, state, batch(state.count, r * shards_per_replica + me))
                if alone is not None and manager.current_step() >= 4 and not alone.is_set():
                    alone.set()  # replica 0 took steps 2 and 3 alone: let the replacement start,
                    assert back.wait(60)  # and wait for it (it would otherwise finish alone first)
            full = step.unshard_params(shards)
            return [full["layers"][0]["w"], full["layers"][0]["b"], full["layers"][1]["w"]], state.count
        finally:
            if me == 0:
                logs.append((r, list(train.log)))
            manager.shutdown(wait=False)

    finals[r] = mesh.run(body)[0]


def reference_with_membership(participants: dict[int, int], healed_at: int, shards_per_replica: int) -> list:
    """Replica 0's parameters after OUTER_STEPS outer steps, replica 1 taking part where
    `participants[k] == 2` and healed (a copy of replica 0, not taking part) at step `healed_at`."""
    leaves = lambda tree: [tree["layers"][0]["w"], tree["layers"][0]["b"], tree["layers"][1]["w"]]  # noqa: E731
    params = [init() for _ in range(R)]
    opts = [torch.optim.AdamW([p.requires_grad_() for p in leaves(params[r])], lr=LR, weight_decay=WD)
            for r in range(R)]
    anchor = [x.detach().clone().requires_grad_() for x in leaves(init())]
    outer = torch.optim.SGD(anchor, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    for k in range(OUTER_STEPS):
        for r in range(R):
            for i in range(H2):
                opts[r].zero_grad()
                n = shards_per_replica
                (sum(loss_fn(params[r], batch(k * H2 + i, r * n + s)) for s in range(n)) / n).backward()
                opts[r].step()
        with torch.no_grad():
            if k == healed_at:  # replica 1 gets replica 0's state (parameters and AdamW's)
                for p1, p0 in zip(leaves(params[1]), leaves(params[0])):
                    p1.copy_(p0)
                opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))  # no shared state tensors
            deltas = [[a - p for a, p in zip(anchor, leaves(params[r]))] for r in range(R)]
            for i, a in enumerate(anchor):
                a.grad = (deltas[0][i] + deltas[1][i]) / 2 if participants[k] == 2 else deltas[0][i] / 1
            outer.step()
            for r in range(R):
                for p, a in zip(leaves(params[r]), anchor):
                    p.copy_(a)
    return [a.detach() for a in anchor]


@pytest.mark.slow
@pytest.mark.parametrize("shards_per_replica", [1, 2])
def test_a_lost_replica_is_healed_from_its_peer_through_torchft(shards_per_replica):
    """Replica 1 dies in outer period 2; replica 0 goes on alone (no restart) for outer steps
    2 and 3 at least; replica 1 restarts from scratch, is healed from replica 0 at a quorum (its shards and both
    optimizers' states, through the Manager's checkpoint transport), and both finish equal.
    Replica 0's parameters equal the fp64 reference that averaged over the replicas that
    took part in each outer step (as torchft's logs say), to rounding."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000)
    start = threading.Barrier(R * shards_per_replica)
    logs, finals, errors = [], {}, {}

    alone, back = threading.Event(), threading.Event()

    def run_replica(r):
        try:
            if r == 1:
                try:
                    ft_replica(1, shards_per_replica, lighthouse.address(), logs, finals, die_at=DIE_AT, start=start)
                except Died:
                    assert alone.wait(120)
                    ft_replica(1, shards_per_replica, lighthouse.address(), logs, finals, back=back)  # the replacement
            else:
                ft_replica(0, shards_per_replica, lighthouse.address(), logs, finals, alone=alone, start=start,
                           back=back)
        except BaseException as err:  # noqa: BLE001
            errors[r] = err

    try:
        threads = [threading.Thread(target=run_replica, args=(r,), daemon=True) for r in range(R)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        lighthouse.shutdown()
    assert not errors and sorted(finals) == [0, 1], (errors, logs)
    zero = next(log for r, log in logs if r == 0)
    assert all(committed for *_, committed in zero) and [s for _, s, *_ in zero] == list(range(OUTER_STEPS)), zero
    participants = {s: p for _, s, p, _, _ in zero}
    replacement = [log for r, log in logs if r == 1][-1]
    healed = [s for _, s, _, h, _ in replacement if h]
    assert len(healed) == 1, replacement
    assert healed[0] >= 4 and [participants[s] for s in range(OUTER_STEPS)] == (
        [2, 2] + [1] * (healed[0] - 2) + [2] * (OUTER_STEPS - healed[0])), (participants, healed)
    # (healed at a synchronous quorum, the replacement takes part with its peer's state: the
    # mean of two equal deltas is that delta, exactly)
    # the survivors' trajectory: the reference that averaged over the replicas that took part
    want = reference_with_membership(participants, healed[0], shards_per_replica)
    assert max_diff(finals[0][0], want) < 1e-13, (max_diff(finals[0][0], want), participants)
    # the healed replica equals its peer
    assert max_diff(finals[1][0], finals[0][0]) == 0.0 and finals[1][1] == finals[0][1] == OUTER_STEPS * H2
