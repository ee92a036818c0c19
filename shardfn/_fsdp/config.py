"""The options of `shard`, checked once and frozen into a `Config`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, NamedTuple

import torch

from .._errors import SpecError
from .._quant import Wire
from .._spec import PartitionSpec
from .batch import check_weighting

__all__ = ["MixedPrecision", "Config", "make_config", "resolve_reshard"]


class MixedPrecision(NamedTuple):
    """Dtypes for `shard`: shards (master weights) keep theirs; gathers and compute run in
    `param_dtype`, gradient reductions in `reduce_dtype`, the loss is returned in
    `output_dtype`; floating batch tensors are cast to `param_dtype` when `cast_inputs`.

    Compressed communication ([Note: wire formats] in shardfn/_quant.py): with
    `all_gather_dtype`, each unit's shards travel the all-gather in that format (quantized
    once per step from the master shards, dequantized into the unit's buffer in the
    compute dtype); with `reduce_scatter_dtype`, gradients travel quantized (an all-to-all
    of quantized chunks, summed in float32 by the receiving rank: ZeRO++'s qgZ). Either is
    None (full precision), torch.bfloat16 / torch.float16 (a cast), torch.float8_e4m3fn /
    torch.float8_e5m2 (per-block scales) or "int8" (per-block symmetric); `block_size`
    elements share a scale."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_inputs: bool = True
    all_gather_dtype: torch.dtype | str | None = None
    reduce_scatter_dtype: torch.dtype | str | None = None
    block_size: int = 4096

    def wires(self) -> tuple[Wire | None, Wire | None]:
        """The all-gather's and the reduce-scatter's wire formats (None: full precision),
        resolved once for every runtime: the eager groups, the traced step, the table."""
        return (Wire.of(self.all_gather_dtype, self.block_size, where="shard: MixedPrecision.all_gather_dtype"),
                Wire.of(self.reduce_scatter_dtype, self.block_size, where="shard: MixedPrecision.reduce_scatter_dtype"))


@dataclasses.dataclass(frozen=True)
class Config:
    data_axes: tuple[str, ...]
    shard_axes: tuple[str, ...]
    units: Callable[[tuple], Hashable] | None
    reshard_after_forward: bool
    reshard_axes: tuple[str, ...] | None  # hpZ: re-gather in the backward over these shard axes only
    prefetch: int
    mixed_precision: MixedPrecision | None
    has_aux: bool
    replicated: Callable[[tuple], bool] | None
    frozen: Callable[[tuple], bool] | None
    check_finite: bool
    param_specs: Any = None  # spec tree (prefix of params) or `path -> spec`, over non-data axes
    batch_weighting: str = "equal"  # how unequal local batches weigh in the loss mean (batch.py)


def make_config(loss_fn, mesh, *, data_axes, shard_axes, units, reshard_after_forward, prefetch, mixed_precision,
                has_aux, replicated, frozen, check_finite, param_specs, batch_weighting="equal") -> Config:
    """`shard`'s arguments, checked (a SpecError naming the argument and the fix)."""
    data = mesh.axes(data_axes, where="shard(data_axes=...)")
    sharded = data if shard_axes is None else mesh.axes(shard_axes, where="shard(shard_axes=...)")
    stray = [a for a in sharded if a not in data]
    if stray:
        raise SpecError(
            f"shard: shard_axes {sharded} must be a subset of data_axes {data}; {stray} are not data axes.\n"
            f"Fix: add them to data_axes (HSDP: data_axes=('replica', 'shard'), shard_axes='shard')."
        )
    for name, fn in (("units", units), ("replicated", replicated), ("frozen", frozen)):
        if fn is not None and not callable(fn):
            raise SpecError(f"shard: {name} must be a function of a key path (or None), got {fn!r:.60}; "
                            f"e.g. {name}=lambda path: path[0] == 'layers'")
    reshard, reshard_axes = resolve_reshard(reshard_after_forward, mesh, sharded)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise SpecError(f"shard: prefetch must be a non-negative int, got {prefetch!r}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise SpecError("shard: mixed_precision must be sf.MixedPrecision(param_dtype=..., reduce_dtype=...)")
    if mixed_precision is not None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(mixed_precision, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise SpecError(f"shard: MixedPrecision.{field} must be a floating torch.dtype or None, got {dtype!r:.60}")
        mixed_precision.wires()  # a SpecError naming the field
    if isinstance(loss_fn, torch.nn.Module):
        raise SpecError(
            f"shard: sf.shard takes a loss function of explicit parameters, loss_fn(params, batch) -> scalar, "
            f"not an nn.Module (got a {type(loss_fn).__name__}): a module's forward takes the batch, not the "
            f"parameters, and returns its output, not a loss.\nFix: apply_fn, params = sf.functional(model); "
            f"loss_fn = lambda p, b: loss(apply_fn(p, b), b) (e.g. lambda p, b: apply_fn(p, b, labels=b).loss "
            f"for a transformers causal LM); step = sf.shard(loss_fn, mesh); shards = step.shard_params(params)."
        )
    if not callable(loss_fn):
        raise SpecError(f"shard: loss_fn must be callable, got {loss_fn!r:.60}")
    if param_specs is not None and not (callable(param_specs) or isinstance(param_specs, (PartitionSpec, dict, list, tuple))):
        raise SpecError(f"shard: param_specs must be a tree of sf.P(...) (a prefix of params) or a function of a key "
                        f"path, got {param_specs!r:.60}")
    return Config(data, sharded, units, reshard, reshard_axes, prefetch, mixed_precision, has_aux, replicated,
                  frozen, bool(check_finite), param_specs, check_weighting(batch_weighting))


def resolve_reshard(value, mesh, shard_axes: tuple[str, ...]) -> tuple[bool, tuple[str, ...] | None]:
    """`reshard_after_forward` -> (free after forward, hpZ sub-axes or None)."""
    k = mesh.axis_size(shard_axes)
    if isinstance(value, bool):
        return value, None
    if isinstance(value, int):
        suffixes = {mesh.axis_size(shard_axes[i:]): shard_axes[i:] for i in range(len(shard_axes))}
        if value == k:
            return True, None
        if 1 < value < k and value in suffixes:
            return True, suffixes[value]
        sizes = {a: mesh.shape[a] for a in shard_axes}
        possible = sorted(s for s in suffixes if 1 < s < k)
        groups = f"give groups of {possible} ranks" if possible else f"have no inner axes (only all {k} ranks)"
        raise SpecError(
            f"shard: reshard_after_forward={value}: an int means 're-gather in the backward within groups of "
            f"{value} ranks' (FSDP2's form); here a group is the last shard axes, and shard_axes {shard_axes} "
            f"(sizes {sizes}) {groups}.\nFix: name the axes, e.g. reshard_after_forward={shard_axes[-1]!r}, "
            f"or shape the mesh so that inner shard axes have {value} ranks."
        )
    if isinstance(value, str) or (isinstance(value, tuple) and value and all(isinstance(a, str) for a in value)):
        axes = mesh.axes(value, where="shard(reshard_after_forward=...)")
        stray = [a for a in axes if a not in shard_axes]
        if stray:
            raise SpecError(
                f"shard: reshard_after_forward={value!r} names {stray}, which are not shard axes {shard_axes}; "
                f"it names the shard axes to re-gather over in the backward (hpZ).\nFix: pick some of {shard_axes}."
            )
        ordered = tuple(a for a in shard_axes if a in axes)
        return True, (None if set(ordered) == set(shard_axes) else ordered)
    raise SpecError(
        f"shard: reshard_after_forward must be True, False, shard axis names or an int, got {value!r:.60}"
    )
