"""Wire formats for compressed collectives: a float tensor <-> the bytes one rank sends.

`shard`'s quantized all-gather (ZeRO++'s qwZ) and reduce-scatter (qgZ) send each chunk as
one `uint8` row: the chunk quantized block by block, with each block's scale. This module
is the format and nothing else: pure functions on the last dim, any leading dims (a
`(k, S)` buffer encodes row by row), no collectives, no state.

[Note: wire formats]
`Wire.of(spec, block)` names a format; `spec` is what the user passes
(`MixedPrecision.all_gather_dtype` / `reduce_scatter_dtype`):

  torch.bfloat16, torch.float16   a plain cast, no scales
  torch.float8_e4m3fn, _e5m2      per block: scale = amax / fp8 max, x / scale cast to fp8
  "int8"                          per block: symmetric, scale = amax / 127, round(x / scale)

A row of `n` elements is `[scales | payload | padding]`, padded to a multiple of 8 bytes so
every row's scales and payload are aligned for `.view(dtype)`. Scales are float32 (float64
when the tensor is float64, so huge float64 values keep their range).

Segments: a row may be cut into `segments` (sizes summing to `n`; default one segment, the
whole row), and the blocks restart at each segment's start: a segment of `c` elements is
`ceil(c / block)` blocks, its last one partial, and no block spans two segments. `shard`'s
all-gather passes the unit's leaves' chunk sizes ([Note: quantized all-gather] in
_fsdp/gather.py), so each leaf is scaled by its own values: every sharded leaf, 1-D ones
(norms, biases) included, has its own scales, never a neighbour's (the reduce-scatter's
gradient rows are one segment each: [Note: qgZ] in _fsdp/qgz.py). The scales lie in
segment order, then block order. `nbytes(n, segments)` is the row's size: for "int8" with
float32 masters, `n + 4 * (sum over segments of ceil(c / block))` rounded up to 8 (one
segment: `n + 4 * ceil(n / block)`). An empty segment has no block and no scale.

[Note: quantization error bound]
Per element, |x - decode(encode(x))| <= `bound(x)`:
- "int8": half a step, step = max(amax / 127, tiny) per block (tiny = the smallest normal
  of the scale dtype: a block whose amax is below 127 * tiny is flushed to steps of tiny);
- fp8: half an fp8 ulp at the value, scaled: |x| * 2**-(m+1) for normal values, plus
  scale * 2**(e_min - m - 1) where the fp8 value is subnormal (m mantissa bits, e_min the
  smallest normal exponent: e4m3fn m=3, e_min=-6; e5m2 m=2, e_min=-14);
- casts: |x| * 2**-(m+1) with m the dtype's mantissa bits (bf16 7, fp16 10), plus half the
  smallest subnormal; values beyond the dtype's range are refused.
Decoded into a bfloat16 / float16 tensor, the result's own rounding adds |x| * 2**-(m+1).
Values that a format represents exactly (int8: q * amax / 127 with an exact scale; fp8 /
casts: values of the target dtype when the scale is 1 or a power of two) round trip
exactly. NaN and inf are refused (`check=True`): a scale from a non-finite amax would
spread NaN over its whole block.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._errors import SpecError

__all__ = ["NonFiniteWire", "Wire", "scale_dtype", "WIRE_SPECS", "encode", "decode", "nbytes", "bound"]

_FP8 = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # mantissa bits, e_min
_CASTS = {torch.bfloat16: 7, torch.float16: 10}
WIRE_SPECS = ("torch.bfloat16", "torch.float16", "torch.float8_e4m3fn", "torch.float8_e5m2", '"int8"')
_ALIGN = 8


class Wire(NamedTuple):
    """A resolved wire format ([Note: wire formats])."""

    kind: str  # "cast" | "fp8" | "int8"
    dtype: torch.dtype  # the payload's element dtype
    block: int  # elements per scale ("cast": unused)

    @staticmethod
    def of(spec, block: int = 4096, *, where: str = "wire format") -> "Wire | None":
        """`spec` (None, a dtype or "int8") -> a Wire (None: no compression). Raises a
        SpecError naming `where` for anything else."""
        if spec is None:
            return None
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise SpecError(f"{where}: block_size must be a positive int, got {block!r:.40}")
        if isinstance(spec, str) and spec == "int8":
            return Wire("int8", torch.int8, block)
        if spec in _FP8:
            return Wire("fp8", spec, block)
        if spec in _CASTS:
            return Wire("cast", spec, block)
        raise SpecError(f"{where}: got {spec!r:.60}; a wire format is None (no compression) or one of "
                        f"{', '.join(WIRE_SPECS)}.\nFix: e.g. sf.MixedPrecision(all_gather_dtype='int8').")

    @property
    def scaled(self) -> bool:
        return self.kind != "cast"

    def describe(self) -> str:
        return "int8" if self.kind == "int8" else str(self.dtype).replace("torch.", "")


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The scales' dtype, and what a decode computes in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Span(NamedTuple):
    """One segment of a row: elements [start, stop); whole blocks end at `mid`, the partial
    last block is [mid, stop); its blocks' scales start at `first`."""

    start: int
    mid: int
    stop: int
    first: int  # index of its first block (scale) in the row
    whole: int  # whole blocks: (mid - start) // block


def _spans(n: int, block: int, segments) -> tuple[_Span, ...]:
    """The row's segments ([Note: wire formats]); `segments=None` is one, the whole row."""
    sizes = (n,) if segments is None else tuple(segments)
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in sizes) or sum(sizes) != n:
        raise SpecError(f"wire format: segments must be non-negative ints summing to the row's {n} "
                        f"elements, got {sizes!r:.80}")
    out, start, first = [], 0, 0
    for c in sizes:
        whole = c // block
        out.append(_Span(start, start + whole * block, start + c, first, whole))
        start, first = start + c, first + -(-c // block)
    return tuple(out)


def _blocks(n: int, wire: Wire, segments=None) -> int:
    if not wire.scaled:
        return 0
    return sum(-(-c // wire.block) for c in segments) if segments is not None else -(-n // wire.block)


def _layout(n: int, wire: Wire, dtype: torch.dtype, segments=None) -> tuple[int, int, int]:
    """(scale bytes, payload bytes, row bytes) of an `n`-element row."""
    scale_bytes = _blocks(n, wire, segments) * scale_dtype(dtype).itemsize
    payload = n * wire.dtype.itemsize
    return scale_bytes, payload, -(-(scale_bytes + payload) // _ALIGN) * _ALIGN


def nbytes(n: int, wire: Wire, dtype: torch.dtype = torch.float32, segments=None) -> int:
    """Bytes of one encoded row of `n` elements of `dtype` (scales, payload, padding);
    `segments`: the sizes the blocks restart at ([Note: wire formats])."""
    if segments is not None:
        _spans(n, wire.block, segments)  # checks them
    return _layout(n, wire, dtype, segments)[2]


def _qmax(wire: Wire) -> float:
    return 127.0 if wire.kind == "int8" else torch.finfo(wire.dtype).max


def _parts(x: torch.Tensor, span: _Span, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(*lead, n) -> views of one segment, no copy: its whole blocks (*lead, whole, block)
    and its partial last block's elements (*lead, stop - mid) (padding would copy)."""
    return x[..., span.start:span.mid].unflatten(-1, (span.whole, block)), x[..., span.mid:span.stop]


def _products(q: torch.Tensor, scales: torch.Tensor, span: _Span, block: int) -> list[torch.Tensor]:
    """One segment decoded as new tensors (decode's traced form): its whole blocks' and its
    partial block's payload times their scales, in the scale dtype, flat in the last dim."""
    blocks, tail = _parts(q, span, block)
    last = span.first + span.whole
    return [(blocks * scales[..., span.first:last, None]).flatten(-2), tail * scales[..., last:last + 1]]


class NonFiniteWire(SpecError):
    """NaN / inf refused by `encode` (a SpecError; callers may name the leaves)."""


def _refuse_non_finite(x: torch.Tensor, wire: Wire, what: str) -> None:
    bad = int((~torch.isfinite(x)).sum())
    raise NonFiniteWire(f"{what}: {bad} of {x.numel()} values are NaN or infinite; the {wire.describe()} "
                        f"wire format cannot carry them (a block's scale would make its whole block NaN).\n"
                        f"Fix: find where they come from (sf.shard(check_finite=True) names the step), or "
                        f"communicate without compression.")


def _scales(x: torch.Tensor, wire: Wire, spans: tuple[_Span, ...], check: bool = False, what: str = "encode"
            ) -> torch.Tensor:
    """Per-block scales (*lead, blocks) in the scale dtype, segment by segment: amax / qmax,
    at least the dtype's tiny, and at most max / qmax * (1 - 2**-20), so that q * scale
    never rounds past the dtype's max (decode needs no clamp; a block at the max loses
    2**-20 of it, far below half a step). (abs + amax measured 6x faster than a vector
    inf-norm on CPU.)"""
    sdt = scale_dtype(x.dtype)
    x = x if x.dtype == sdt else x.to(sdt)
    pieces = []  # NaN propagates through amax: the check sees it
    for span in spans:
        blocks, tail = _parts(x, span, wire.block)
        if span.whole:
            pieces.append(blocks.abs().amax(-1))
        if tail.shape[-1]:
            pieces.append(tail.abs().amax(-1, keepdim=True))
    if len(pieces) == 1:
        amax = pieces[0]
    else:
        amax = torch.cat(pieces, dim=-1) if pieces else x.new_empty(x.shape[:-1] + (0,))
    if check and not bool(torch.isfinite(amax).all()):  # before the clamp, which would hide an inf
        _refuse_non_finite(x, wire, what)
    info, qmax = torch.finfo(sdt), _qmax(wire)
    scales = amax.div_(qmax).clamp_min_(info.tiny)
    cap = info.max / qmax * (1 - 2.0 ** -20)
    # The cap only on finite scales: an inf (or NaN) amax keeps a non-finite scale, so an
    # unchecked encode (qgZ) decodes that whole block to inf / NaN, never to a finite lie.
    return scales.masked_fill_((scales > cap) & torch.isfinite(scales), cap)


def encode(x: torch.Tensor, wire: Wire, *, segments=None, check: bool = True, what: str = "encode"
           ) -> torch.Tensor:
    """(*lead, n) floats -> (*lead, nbytes(n, segments)) uint8 rows ([Note: wire formats]).

    `segments`: sizes summing to n; each segment's blocks start at its start (None: one
    segment, the row). `check`: refuse NaN / inf (and, for casts, values beyond the dtype's
    range) with a SpecError naming `what`; it reads the blocks' amax (or a cast's) on the
    host, no extra pass over x, but a sync (skip it where that costs)."""
    if not x.is_floating_point():
        raise SpecError(f"{what}: a wire format encodes floating tensors, got {x.dtype}")
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    spans = _spans(n, wire.block, segments)
    scale_bytes, payload_bytes, row = _layout(n, wire, x.dtype, segments)
    out = torch.empty(lead + (row,), dtype=torch.uint8, device=x.device)
    if wire.kind == "cast":
        if check and x.numel():  # one pass: NaN propagates through amax, inf shows as itself
            top = float(x.abs().amax())
            if not math.isfinite(top):
                _refuse_non_finite(x, wire, what)
            if top > torch.finfo(wire.dtype).max:  # e.g. fp32 -> fp16, bf16 -> fp16
                raise SpecError(f"{what}: |x| reaches {top:.3g}, beyond {wire.describe()}'s range "
                                f"({torch.finfo(wire.dtype).max:.3g}).\nFix: use a scaled format "
                                f"('int8' or float8 with per-block scales) or no compression.")
    else:
        xs = x.to(scale_dtype(x.dtype))  # no copy for float32 / float64
        scales = _scales(xs, wire, spans, check, what)  # refuses a block whose amax is NaN / inf
        payload = out[..., scale_bytes:scale_bytes + payload_bytes].view(wire.dtype).view(lead + (n,))
        for span in spans:
            blocks, tail = _parts(xs, span, wire.block)
            last = span.first + span.whole
            for part, scale, dest in ((blocks, scales[..., span.first:last, None], payload[..., span.start:span.mid]),
                                      (tail, scales[..., last:last + 1], payload[..., span.mid:span.stop])):
                if not part.shape[-1] or not part.numel():
                    continue
                scaled = torch.div(part, scale)
                if wire.kind == "int8":  # |x / scale| <= 127 (1 + 2**-19): rounds to at most 127, no clamp
                    scaled.round_()
                # fp8: |x / scale| <= max (1 + 2**-19) rounds to the max (e4m3fn's NaN starts past 464): no clamp
                dest.copy_(scaled.reshape(dest.shape))  # the cast to int8 / fp8 in the same pass
        out[..., :scale_bytes].copy_(scales.view(torch.uint8).reshape(lead + (scale_bytes,)))
    if wire.kind == "cast":
        out[..., scale_bytes:scale_bytes + payload_bytes].view(wire.dtype).view(lead + (n,)).copy_(x)
    out[..., scale_bytes + payload_bytes:].zero_()
    return out


def _fp8_to_float(q: torch.Tensor, dtype: torch.dtype, *, scaled: bool = True) -> torch.Tensor:
    """fp8 -> `dtype` through float16's bits, exactly: e5m2 is float16's top byte, and e4m3fn's
    bits shifted into float16's places are the value times 2**-8 (both biases differ by 8),
    subnormals included. (torch's direct fp8 conversion runs about twice as slow on CPU.)
    e4m3fn's NaN (S.1111.111) has no float16 twin there and is put back by hand.
    `scaled=False` (decode's fast path): e4m3fn's values are left 2**-8 of theirs, for the
    caller to fold into its scale, and the NaN is not put back (decode never meets one: a
    block with a NaN or inf has a non-finite scale, which spreads over the block anyway)."""
    u = q.view(torch.uint8).to(torch.int16)
    if q.dtype == torch.float8_e5m2:
        return (u << 8).view(torch.float16).to(dtype)
    magnitude = u & 0x7F
    half = (magnitude << 7) | ((u & 0x80) << 8)
    value = half.view(torch.float16).to(dtype)
    if not scaled:
        return value
    return value.mul_(256.0).masked_fill_(magnitude == 0x7F, float("nan"))


def decode(rows: torch.Tensor, wire: Wire, n: int, dtype: torch.dtype, *, segments=None,
           out: torch.Tensor | list[torch.Tensor] | None = None) -> torch.Tensor | list[torch.Tensor]:
    """(*lead, nbytes(n, segments)) uint8 rows -> (*lead, n) in `dtype`, or into `out`: a
    (*lead, n) tensor, or one (*lead, c) tensor per segment (e.g. each leaf's place in a
    unit's buffer), of any float dtype, each with unit stride in its last dim.

    `dtype` is the dtype the rows were encoded from (it fixes the scale dtype) or any float
    dtype for casts. Each block is one multiply of the payload by its scale, written
    straight into its destination (computed in the scale dtype, rounded once into `out`'s):
    no full-size float temporary beside the result, but fp8's own conversion (one row)."""
    spans = _spans(n, wire.block, segments)
    scale_bytes, payload_bytes, row = _layout(n, wire, dtype, segments)
    if rows.shape[-1] != row:
        raise SpecError(f"decode: rows of {rows.shape[-1]} bytes, expected {row} for {n} elements of "
                        f"{wire.describe()} (block {wire.block}"
                        + (f", segments {tuple(segments)!r:.80})" if segments is not None else ")"))
    lead = tuple(rows.shape[:-1])
    rows = rows.contiguous()
    q = rows[..., scale_bytes:scale_bytes + payload_bytes].view(wire.dtype)
    if isinstance(out, (list, tuple)):
        if len(out) != len(spans):
            raise SpecError(f"decode: {len(out)} outputs for {len(spans)} segments")
        result, targets = out, list(out)
    else:
        result = torch.empty(lead + (n,), dtype=dtype, device=rows.device) if out is None else out
        whole_row = result if tuple(result.shape) == lead + (n,) else result.view(lead + (n,))
        targets = [whole_row[..., span.start:span.stop] for span in spans]
    if not n:  # no payload and no scales (a row of 0 bytes cannot be viewed as scales)
        return result
    if wire.kind == "cast":
        for span, target in zip(spans, targets):
            target.copy_(q[..., span.start:span.stop].view(target.shape))
        return result
    scales = rows[..., :scale_bytes].view(scale_dtype(dtype))
    if wire.kind == "fp8":
        q = _fp8_to_float(q, scales.dtype, scaled=False)
        if wire.dtype == torch.float8_e4m3fn:  # its 2**8 folded into the (small) scales
            scales = scales * 256.0
    if out is None and torch.compiler.is_compiling():  # sf.jit: the same products, no `out=` (dynamo refuses it)
        return torch.cat([piece for span in spans for piece in _products(q, scales, span, wire.block)], dim=-1
                         ).to(dtype)
    for span, target in zip(spans, targets):
        size = span.stop - span.start
        if tuple(target.shape) != lead + (size,):
            target = target.view(lead + (size,))
        blocks, tail = _parts(q, span, wire.block)
        last = span.first + span.whole
        if span.whole:  # q * scale straight into its place, one pass
            torch.mul(blocks, scales[..., span.first:last, None],
                      out=target[..., :span.mid - span.start].unflatten(-1, (span.whole, wire.block)))
        if span.mid < span.stop:  # the segment's last, partial block
            torch.mul(tail, scales[..., last:last + 1], out=target[..., span.mid - span.start:])
    return result


def bound(x: torch.Tensor, wire: Wire, *, segments=None) -> torch.Tensor:
    """Per element, the largest |x - decode(encode(x, segments=...))| allowed ([Note:
    quantization error bound]): each block's step from its own segment's values."""
    sdt = scale_dtype(x.dtype)
    a = x.to(sdt).abs()
    # decoded into x's dtype: a half-precision x adds its own rounding of the result
    own = a * 2.0 ** -(_CASTS[x.dtype] + 1) if x.dtype in _CASTS else 0.0
    if wire.kind == "cast":
        m = _CASTS[wire.dtype]
        sub = torch.finfo(wire.dtype).smallest_normal * 2.0 ** -m
        return a * 2.0 ** -(m + 1) + sub / 2
    spans = _spans(x.shape[-1], wire.block, segments)
    scales = _scales(x, wire, spans)
    steps = [scales[..., span.first:span.first + -(-(span.stop - span.start) // wire.block)]
             .repeat_interleave(wire.block, dim=-1)[..., :span.stop - span.start] for span in spans]
    step = torch.cat(steps, dim=-1) if steps else a
    if wire.kind == "int8":
        return step / 2 + own
    m, e_min = _FP8[wire.dtype]
    return a * 2.0 ** -(m + 1) + step * 2.0 ** (e_min - m - 1) * (1 + 2.0 ** -20) + own
