"""What one rank's `shard` step communicates over, and in which dtypes."""

from __future__ import annotations

import dataclasses

import torch

from .._quant import Wire
from .config import MixedPrecision
from .plan import Plan, hpz_rows

__all__ = ["Groups"]


@dataclasses.dataclass(frozen=True)
class Groups:
    """What a rank's step communicates over, and in which dtypes: fixed per (plan, mesh, config)."""

    mesh: object
    device: torch.device
    shard: object  # Group over the shard axes
    data: object  # Group over the data axes (the loss mean)
    all: object  # Group over every mesh axis (check_finite)
    hpz: object | None  # [Note: hpZ] the backward re-gather's sub-group
    hpz_keep: torch.Tensor | None  # shard-group rows kept after the forward
    hpz_order: torch.Tensor | None  # re-gathered row -> shard-group row
    tp_size: int  # ranks over the tensor-parallel axes ([Note: FSDP x TP])
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    gather_wire: Wire | None = None  # MixedPrecision.all_gather_dtype ([Note: wire formats] in _quant.py)
    reduce_wire: Wire | None = None  # MixedPrecision.reduce_scatter_dtype

    @property
    def shard_index(self) -> int:
        return self.shard.index

    @classmethod
    def build(cls, plan: Plan, mesh, config) -> "Groups":
        hpz = keep = order = None
        if config.reshard_axes:
            hpz = mesh.group(config.reshard_axes)
            rows, positions = hpz_rows(mesh, config.shard_axes, config.reshard_axes)
            keep, order = torch.tensor(rows, device=mesh.device), torch.tensor(positions, device=mesh.device)
        mp = config.mixed_precision or MixedPrecision()
        return cls(mesh, mesh.device, mesh.group(config.shard_axes), mesh.group(config.data_axes),
                   mesh.group(mesh.axis_names), hpz, keep, order,
                   mesh.axis_size(plan.tp_axes) if plan.tp_axes else 1, mp.param_dtype, mp.reduce_dtype,
                   *mp.wires())
