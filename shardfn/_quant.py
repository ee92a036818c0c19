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
when the tensor is float64, so huge float64 values keep their range). `nbytes(n)` is the
row's size: for "int8" with float32 masters, `n + 4 * ceil(n / block)` rounded up to 8.

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


def _blocks(n: int, wire: Wire) -> int:
    return -(-n // wire.block) if wire.scaled else 0


def _layout(n: int, wire: Wire, dtype: torch.dtype) -> tuple[int, int, int]:
    """(scale bytes, payload bytes, row bytes) of an `n`-element row."""
    scale_bytes = _blocks(n, wire) * scale_dtype(dtype).itemsize
    payload = n * wire.dtype.itemsize
    return scale_bytes, payload, -(-(scale_bytes + payload) // _ALIGN) * _ALIGN


def nbytes(n: int, wire: Wire, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one encoded row of `n` elements of `dtype` (scales, payload, padding)."""
    return _layout(n, wire, dtype)[2]


def _qmax(wire: Wire) -> float:
    return 127.0 if wire.kind == "int8" else torch.finfo(wire.dtype).max


def _by_block(x: torch.Tensor, wire: Wire) -> torch.Tensor:
    """(*lead, n) -> (*lead, blocks, block), zero-padded."""
    n = x.shape[-1]
    blocks = _blocks(n, wire)
    pad = blocks * wire.block - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], blocks, wire.block)  # explicit: a (0, n) tensor has no -1


def _parts(x: torch.Tensor, wire: Wire) -> tuple[torch.Tensor, torch.Tensor]:
    """(*lead, n) -> views, no copy: the whole blocks (*lead, n // block, block) and the
    partial last block's (*lead, n % block) elements (padding would copy the whole row)."""
    full = x.shape[-1] // wire.block * wire.block
    return x[..., :full].unflatten(-1, (full // wire.block, wire.block)), x[..., full:]


class NonFiniteWire(SpecError):
    """NaN / inf refused by `encode` (a SpecError; callers may name the leaves)."""


def _refuse_non_finite(x: torch.Tensor, wire: Wire, what: str) -> None:
    bad = int((~torch.isfinite(x)).sum())
    raise NonFiniteWire(f"{what}: {bad} of {x.numel()} values are NaN or infinite; the {wire.describe()} "
                        f"wire format cannot carry them (a block's scale would make its whole block NaN).\n"
                        f"Fix: find where they come from (sf.shard(check_finite=True) names the step), or "
                        f"communicate without compression.")


def _scales(x: torch.Tensor, wire: Wire, check: bool = False, what: str = "encode") -> torch.Tensor:
    """Per-block scales (*lead, blocks) in the scale dtype: amax / qmax, at least the dtype's
    tiny, and at most max / qmax * (1 - 2**-20), so that q * scale never rounds past the
    dtype's max (decode needs no clamp; a block at the max loses 2**-20 of it, far below
    half a step). (abs + amax measured 6x faster than a vector inf-norm on CPU.)"""
    sdt = scale_dtype(x.dtype)
    blocks, tail = _parts(x if x.dtype == sdt else x.to(sdt), wire)
    amax = blocks.abs().amax(-1)  # NaN propagates: the check sees it
    if tail.shape[-1]:
        amax = torch.cat([amax, tail.abs().amax(-1, keepdim=True)], dim=-1)
    if check and not bool(torch.isfinite(amax).all()):  # before the clamp, which would hide an inf
        _refuse_non_finite(x, wire, what)
    info, qmax = torch.finfo(sdt), _qmax(wire)
    scales = amax.div_(qmax).clamp_min_(info.tiny)
    cap = info.max / qmax * (1 - 2.0 ** -20)
    # The cap only on finite scales: an inf (or NaN) amax keeps a non-finite scale, so an
    # unchecked encode (qgZ) decodes that whole block to inf / NaN, never to a finite lie.
    return scales.masked_fill_((scales > cap) & torch.isfinite(scales), cap)


def encode(x: torch.Tensor, wire: Wire, *, check: bool = True, what: str = "encode") -> torch.Tensor:
    """(*lead, n) floats -> (*lead, nbytes(n)) uint8 rows ([Note: wire formats]).

    `check`: refuse NaN / inf (and, for casts, values beyond the dtype's range) with a
    SpecError naming `what`; it reads the blocks' amax (or a cast's) on the host, no extra
    pass over x, but a sync (skip it where that costs)."""
    if not x.is_floating_point():
        raise SpecError(f"{what}: a wire format encodes floating tensors, got {x.dtype}")
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    scale_bytes, payload_bytes, row = _layout(n, wire, x.dtype)
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
        scales = _scales(x, wire, check, what)  # refuses a block whose amax is NaN / inf
        payload = out[..., scale_bytes:scale_bytes + payload_bytes].view(wire.dtype).view(lead + (n,))
        blocks, tail = _parts(x.to(scales.dtype), wire)
        whole = blocks.shape[-2]
        for part, scale, dest in ((blocks, scales[..., :whole, None], payload[..., :whole * wire.block]),
                                  (tail, scales[..., whole:], payload[..., whole * wire.block:])):
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


def decode(rows: torch.Tensor, wire: Wire, n: int, dtype: torch.dtype, *, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """(*lead, nbytes(n)) uint8 rows -> (*lead, n) in `dtype` (into `out` if given).

    `dtype` is the dtype the rows were encoded from (it fixes the scale dtype) or any float
    dtype for casts."""
    scale_bytes, payload_bytes, row = _layout(n, wire, dtype)
    if rows.shape[-1] != row:
        raise SpecError(f"decode: rows of {rows.shape[-1]} bytes, expected {row} for {n} elements of "
                        f"{wire.describe()} (block {wire.block})")
    lead = tuple(rows.shape[:-1])
    rows = rows.contiguous()
    q = rows[..., scale_bytes:scale_bytes + payload_bytes].view(wire.dtype)
    if wire.kind == "cast":
        value = q
    else:
        scales = rows[..., :scale_bytes].view(scale_dtype(dtype))
        if wire.kind == "fp8":
            q = _fp8_to_float(q, scales.dtype, scaled=False)
            if wire.dtype == torch.float8_e4m3fn:  # its 2**8 folded into the (small) scales
                scales = scales * 256.0
        target = out if out is not None and out.dtype == scales.dtype and out.is_contiguous() else None
        if target is not None and (n % wire.block == 0 or not lead):  # q * scale straight into `out`, one pass
            full = n // wire.block * wire.block
            target = target.view(lead + (n,))
            torch.mul(q[..., :full].view(lead + (-1, wire.block)), scales[..., :full // wire.block].unsqueeze(-1),
                      out=target[..., :full].view(lead + (-1, wire.block)))
            if full < n:  # the last, partial block (one row: `lead` is empty)
                torch.mul(q[full:], scales[-1], out=target[full:])
            return out
        value = (_by_block(q, wire) * scales.unsqueeze(-1)).flatten(-2)[..., :n]
    if out is None:
        return value.to(dtype)
    out.copy_(value.reshape(out.shape))
    return out


def bound(x: torch.Tensor, wire: Wire) -> torch.Tensor:
    """Per element, the largest |x - decode(encode(x))| allowed ([Note: quantization error bound])."""
    sdt = scale_dtype(x.dtype)
    a = x.to(sdt).abs()
    # decoded into x's dtype: a half-precision x adds its own rounding of the result
    own = a * 2.0 ** -(_CASTS[x.dtype] + 1) if x.dtype in _CASTS else 0.0
    if wire.kind == "cast":
        m = _CASTS[wire.dtype]
        sub = torch.finfo(wire.dtype).smallest_normal * 2.0 ** -m
        return a * 2.0 ** -(m + 1) + sub / 2
    n = x.shape[-1]
    step = _scales(x, wire).repeat_interleave(wire.block, dim=-1)[..., :n]
    if wire.kind == "int8":
        return step / 2 + own
    m, e_min = _FP8[wire.dtype]
    return a * 2.0 ** -(m + 1) + step * 2.0 ** (e_min - m - 1) * (1 + 2.0 ** -20) + own
