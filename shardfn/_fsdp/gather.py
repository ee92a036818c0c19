"""One unit's all-gather: pack (and encode) -> all-gather -> (decode and) copy out.

Every place that gathers a unit's shards goes through these functions: the schedule's
gathers and re-gathers (unit.py), the ensemble and forward-mode gathers (autograd.py)
and the exact export (unshard.py). They are plain functions on plain tensors; the caller
owns the buffers, their lifetimes and their accounting ([Note: gathering into the unit's
buffer] in unit.py).

[Note: quantized all-gather]
With `MixedPrecision(all_gather_dtype=...)` (ZeRO++'s qwZ) a unit's shard buffer travels
in a wire format ([Note: wire formats] in shardfn/_quant.py): the rank packs its shards
in the masters' dtype into the (S,) shard buffer, encodes it into one uint8 row of
`nbytes(S, segments)` bytes (scales, payload, padding), and the all-gather moves k such
rows, (k, nbytes(S, segments)). Each received row is decoded on its own, each leaf's
segment straight into that leaf's place in the unit's leaf-major unsharded buffer, in the
compute dtype (param_dtype, or the leaves' dtype): no full-size float copy of the unit
exists beside that buffer (fp8's conversion scratch is one row).
- Scales per leaf: the segments are the leaves' chunks (`layout.chunk_numel`, in the
  buffer's order), so the quantization blocks restart at each leaf's start and no block
  spans two leaves. Every sharded leaf has its own scales, 1-D leaves (norms, biases)
  too: a 0.02-scale projection never shares a scale with a norm weight of 1.0, whose
  amax would make the projection's step 50 times coarser (measured on a transformers
  Llama, int8: gradients 13.9% off the fp64 reference with scales across leaves, within
  1.1% with scales per leaf; tests/quant/test_quant_leaves.py). Bytes per rank: the sum over
  sharded leaves of `chunk * payload itemsize + scale itemsize * ceil(chunk / block)`,
  rounded up to 8 (`row_bytes`), a few scales more than one run of blocks over the row.
- The masters (the shards) stay in full precision; the optimizer updates them.
- The encoding is a function of the shards, which do not change within a step: the
  runtime encodes each unit once per step and keeps the row for the backward's re-gather
  (unit.py: `UnitRuntime.encoded`).
- Differentiation treats the quantizer as the identity (straight-through): the gradient
  is the reduce-scatter of the gradient with respect to the decoded parameters, and a
  forward-mode tangent is gathered exactly (`gather_full`).
- NaN / inf in a shard would poison its whole block (a non-finite scale): the encode
  checks first and names the unit and the leaf. The check reads a value on the host, so
  it runs on CPU (and meta: never) and on an accelerator only with `check_finite=True`.
- Exports (`unshard_params`, `iter_unshard`, `sf.hf` save) gather exactly: no wire.
"""

from __future__ import annotations

import torch

from .. import _tree
from .._backend import ops
from .._errors import NonFiniteError
from .._quant import NonFiniteWire, Wire, decode, encode, nbytes
from .plan import UnitPlan, copy_out as _copy_out, leaf_views, pack_shards, region_views

__all__ = ["send_buffer", "row_bytes", "segments", "start", "copy_out", "stacked_leaves", "gather_full",
           "should_check"]


def segments(plan: UnitPlan) -> tuple[int, ...]:
    """The shard buffer's leaf chunks, in order: where the wire format's blocks restart
    ([Note: quantized all-gather])."""
    return tuple(layout.chunk_numel for layout in plan.sharded)


def row_bytes(plan: UnitPlan, dtype: torch.dtype, wire: Wire | None) -> int:
    """Bytes one rank sends in the unit's all-gather: S elements of `dtype` or, with a
    wire format, one encoded row of the masters' S elements, scaled leaf by leaf."""
    if wire is None:
        return plan.shard_numel * dtype.itemsize
    return nbytes(plan.shard_numel, wire, plan.dtype, segments(plan))


def should_check(device: torch.device, check_finite: bool) -> bool:
    """Whether an encode checks for NaN / inf ([Note: quantized all-gather]): on CPU always,
    on an accelerator only with `check_finite` (a host read), on meta never."""
    return device.type != "meta" and (device.type == "cpu" or check_finite)


def send_buffer(plan: UnitPlan, shards, dtype: torch.dtype, device, *, wire: Wire | None = None,
                lead: tuple[int, ...] = (), check: bool = False) -> torch.Tensor:
    """This rank's send buffer: the (*lead, S) shard buffer in `dtype` (the shard itself
    when nothing needs packing), or with `wire` the shard buffer packed in the masters'
    dtype and encoded leaf by leaf, (*lead, row_bytes) uint8. `check`: refuse NaN / inf,
    naming the unit and the leaf."""
    if wire is None:
        return pack_shards(plan, shards, dtype, device, lead)
    packed = pack_shards(plan, shards, plan.dtype, device, lead)
    try:  # the check reads the blocks' scales (or a cast's amax): no extra pass over the shard
        return encode(packed, wire, segments=segments(plan), check=check,
                      what=f"shard: the all-gather of {plan.name()}")
    except NonFiniteWire:
        _refuse_non_finite(plan, shards, wire)


def _refuse_non_finite(plan: UnitPlan, shards, wire: Wire) -> None:
    bad = [f"params{_tree.keystr(layout.path)} ({int((~torch.isfinite(x)).sum())} of {x.numel()} values on this rank)"
           for layout, x in zip(plan.sharded, shards) if not bool(torch.isfinite(x).all())]
    raise NonFiniteError(
        f"shard: {plan.name()} cannot be all-gathered in {wire.describe()}: {', '.join(bad)} hold NaN or "
        f"infinite values, and a block's scale would spread them over the whole block.\nFix: find where "
        f"they come from (a diverged update: lower the learning rate, clip gradients; check_finite=True "
        f"stops the step that made them), or gather without compression (all_gather_dtype=None)."
    )


def start(group, send: torch.Tensor, out: torch.Tensor | None = None) -> ops.Pending:
    """Start the all-gather of `send` over `group`: (k, *send.shape), into `out` if given."""
    return ops.all_gather_async(group, send, out=out)


def copy_out(plan: UnitPlan, rows: torch.Tensor, full: torch.Tensor, wire: Wire | None = None) -> None:
    """(k, S) rank-major gathered buffer -> the leaf-major unsharded buffer `full`; with
    `wire`, (k, row_bytes) uint8 rows decoded one at a time, each leaf's segment of row j
    straight into that leaf's j-th chunk of `full` (no scratch row, no second copy)."""
    if wire is None:
        _copy_out(plan, rows, full)
        return
    rows = rows.reshape(plan.k, -1)
    regions, sizes = region_views(plan, full), segments(plan)  # per leaf (k, chunk) views of `full`
    for j in range(plan.k):
        decode(rows[j], wire, plan.shard_numel, plan.dtype, segments=sizes, out=[r[j] for r in regions])


def stacked_leaves(plan: UnitPlan, rows: torch.Tensor, dtype: torch.dtype, wire: Wire | None = None
                   ) -> list[torch.Tensor]:
    """(k, B, S) gathered stacked shard buffers (or (k, B, row_bytes) encoded rows) -> per
    sharded leaf, the B members' full leaves (B, *shape) ([Note: stacked shards])."""
    if wire is not None:
        decoded = torch.empty(rows.shape[:-1] + (plan.shard_numel,), dtype=dtype, device=rows.device)
        rows = decode(rows, wire, plan.shard_numel, plan.dtype, segments=segments(plan), out=decoded)
    size = rows.shape[1]
    out = []
    for layout in plan.sharded:
        block = rows.narrow(2, layout.offset, layout.chunk_numel).movedim(0, 1)  # (B, k, c * row)
        full = block.reshape((size, plan.k * layout.chunk) + layout.shape[1:]).narrow(1, 0, layout.rows)
        out.append(full.contiguous())
    return out


def gather_full(plan: UnitPlan, group, shards, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """The unit's full leaves, gathered exactly now (no wire format): views of a fresh
    unsharded buffer. For exports and forward-mode tangents."""
    send = send_buffer(plan, shards, dtype, device)
    rows = start(group, send).wait()
    del send
    full = torch.empty(plan.full_numel, dtype=dtype, device=device)
    copy_out(plan, rows, full)
    return leaf_views(plan, full)
