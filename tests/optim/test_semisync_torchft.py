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

import threading
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
