"""The distributed backend: one process per rank over `torch.distributed`.

Started by `torchrun` (or any launcher that sets RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT); `init_mesh` initializes the default process group from that environment
when the caller has not. One process group per subset of mesh axes is created eagerly,
by every rank in the same order (group creation is collective); see base.py's
[Note: group order] for axes named in another order.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from .._errors import ShardingError, SpecError
from . import exchange
from .base import BackendBase, axis_subsets, group_members

__all__ = ["DistributedBackend"]

_REPORT_WINDOW_S = 2.0  # how long a timed-out rank collects its peers' whereabouts
# The process groups' own timeout exceeds the mesh's by this much, so on gloo our polled
# wait (base.py's [Note: polled waits]) reports first, naming the op and the late ranks.
_PG_GRACE_S = 30.0


def _default_backend(device: torch.device | None) -> str:
    if device is not None:
        return "nccl" if device.type == "cuda" else "gloo"
    return "nccl" if torch.cuda.is_available() else "gloo"


class DistributedBackend(BackendBase):
    kind = "distributed"

    def __init__(self, mesh_shape: Mapping[str, int], timeout: float, backend: str | None, device,
                 check_collectives: bool = False):
        super().__init__(mesh_shape, timeout)
        self.check_collectives = check_collectives or os.environ.get("SHARDFN_CHECK_COLLECTIVES") == "1"
        device = torch.device(device) if device is not None else None
        if not dist.is_initialized():
            missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise ShardingError(
                    f"init_mesh found no process group and the launcher variables {missing} are not set.\n"
                    f"Fix: start the program with `torchrun --standalone --nproc-per-node "
                    f"{self.size} script.py`, or use sf.local_mesh({self.mesh_shape}) to simulate "
                    f"the mesh in this process."
                )
            dist.init_process_group(
                backend=backend or _default_backend(device),
                timeout=datetime.timedelta(seconds=self.timeout + _PG_GRACE_S),
            )
        world = dist.get_world_size()
        if world != self.size:
            raise SpecError(
                f"init_mesh: the mesh shape {self.mesh_shape} has {self.size} devices but the world has "
                f"{world} processes.\nFix: pick a shape whose sizes multiply to {world} "
                f"(e.g. {{'data': {world}}}), or launch {self.size} processes."
            )
        self._rank = dist.get_rank()
        self._timeouts = 0  # timeout events seen by this rank (see _missing_ranks)
        self.backend_name = dist.get_backend()
        if device is None:
            if self.backend_name == "nccl":
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", self._rank % torch.cuda.device_count())))
            else:
                device = torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.device = device
        self._pgs: dict[tuple[str, ...], object] = {}
        group_timeout = datetime.timedelta(seconds=self.timeout + _PG_GRACE_S)
        for subset in axis_subsets(list(self.mesh_shape)):
            for members in group_members(self.mesh_shape, subset):
                if len(members) == world:
                    pg = dist.group.WORLD
                else:
                    pg = dist.new_group(ranks=sorted(members), timeout=group_timeout)
                if self._rank in members:
                    self._pgs[subset] = pg

    def rank(self) -> int:
        return self._rank

    def in_rank(self) -> bool:
        return True

    def _pg(self, rank: int, subset: tuple[str, ...]):
        return self._pgs[subset]

    def _polled(self, work) -> bool:
        return self.backend_name == "gloo"

    def _check_same_op(self, group, key: str, seq: int, what: str) -> None:
        """Opt-in (costs one small blocking all-reduce per collective): compare a digest of
        the op description across the group (see exchange.py's [Note: agree by digest]);
        on a mismatch, exchange the descriptions."""
        if group.size == 1:
            return
        transport = exchange.via_pg(group)  # ops.py would come back here: go to the group directly
        if exchange.same_everywhere(what.encode(), transport):
            return
        for i, text in enumerate(exchange.gather_bytes(what.encode(), transport)):
            if text.decode(errors="replace") != what:
                raise self._desync(group, seq, what, group.ranks[i], text.decode(errors="replace"))

    def _missing_ranks(self, group, seq: int) -> str:
        """Ask the peers, through the store, where they are (best effort: error path only)."""
        try:
            store = dist.distributed_c10d._get_default_store()
            me = self.rank()
            self._timeouts += 1  # keys are per timeout event, so a later report never reads a stale one
            prefix = f"shardfn/stuck/{self._timeouts}"
            store.set(f"{prefix}/{me}", self._last_op.get(me, "?"))
            peers = [r for r in group.ranks if r != me]
            reports: dict[int, str] = {}
            deadline = time.monotonic() + _REPORT_WINDOW_S
            while len(reports) < len(peers) and time.monotonic() < deadline:
                for r in peers:
                    if r not in reports and store.check([f"{prefix}/{r}"]):
                        reports[r] = store.get(f"{prefix}/{r}").decode()
                time.sleep(0.05)
        except Exception as err:  # noqa: BLE001 - the report is a courtesy
            return f"(could not ask the other ranks where they are: {err!r})"
        silent = [r for r in peers if r not in reports]
        lines = [f"rank {r} timed out too, at: {text}" for r, text in sorted(reports.items())]
        if silent:
            lines.append(f"ranks {silent} did not report (still computing, waiting elsewhere, or dead)")
        return "Ranks of the group: " + "; ".join(lines) + "."

    def run(self, fn: Callable, args, kwargs) -> list:
        return [fn(*args, **kwargs)]
