"""Quantized gradient reduction (ZeRO++'s qgZ): `MixedPrecision(reduce_scatter_dtype=...)`.

Plain functions, as reduce.py's: reduce.py's `reduce_scatter`, the one entry of the eager
gradient reduction, calls `reduce_scatter` here when `Groups.reduce_wire` is set.

[Note: qgZ]
A quantized *ring* reduce-scatter would re-quantize the running partial sum at each of its
N - 1 hops, so its error grows with N (and each hop's scale follows the growing sum). qgZ
quantizes each rank's contribution once instead:

  packed (k, *lead, S) gradient rows, in reduce_dtype (or the leaves' dtype)
  -> encode row by row ([Note: wire formats] in shardfn/_quant.py): (k, *lead, R) uint8
  -> one all-to-all over the shard group: row j goes to rank j; rank j receives the k
     encoded copies of its own row, one from each rank
  -> decode to float32 (float64 for float64 gradients) and sum locally: (*lead, S)
  -> cast to the packed dtype; then `finish_reduce` as for a plain reduce-scatter.

Error: the sum of the decoded rows differs from the exact sum by at most the sum of each
row's own bound (plus the float32 summation's rounding, far below them):

  |err[e]| <= sum over ranks r of bound(row_r)[e]
           = sum_r amax_r(block of e) / 254                     (int8)
           <= k * max_r amax_r / 254,

each amax the largest |gradient| of that rank's block. Relative to the largest |summand| in
a block this is at most k / 254 for int8 (k * 2**-(m+1) + subnormal terms for fp8, k * 2**-8
for bf16), and relative to the *sum* it does not depend on k when the ranks' gradients are
alike (the sum grows like k too): one quantization per contribution, not one per hop.

Bytes: each rank hands k rows of `nbytes(S)` bytes to the all-to-all and sends k - 1 of them,
as a ring reduce-scatter sends (k - 1) / k of its (k, S) input: `reduce_scatter_bytes` counts
the encoded buffer, `k * prod(lead) * nbytes(S)`, for int8 with float32 gradients
`k * (S + 4 * ceil(S / block))` rounded up to 8 per row: a quarter of the full-precision
figure plus the scales.

Blocks run end to end over each row, across the unit's leaves (`encode` without segments),
unlike the all-gather's scales per leaf ([Note: quantized all-gather] in gather.py): this
module sees a packed buffer, not the plan. On the small transformers Llama of
tests/quant/test_quant_leaves.py (2 ranks) the int8 reduce-scatter alone measured 0.6% off the
fp64 gradient (max error / max gradient), int8 both ways 1.5%, so the gradients have not
needed it; passing the leaves' chunk sizes here (from the reducer's plan) is the change if
they do.

No error feedback: its residual would be the unsharded (k, S) buffer per rank, state outside
the checkpoint; for int8, a smaller block size recovers as much (docs/howto/compressed-
communication.md, measured on the examples' GPT).

A one-rank shard group sends nothing; there the plain reduce-scatter (a copy) keeps the
gradient exact. NaN / inf are not checked here (a host sync per unit): a non-finite
gradient makes its whole block NaN after decoding, which `check_finite=True` reports as the
plain path does.
"""

from __future__ import annotations

import functools

import torch

from .._backend import ops
from .._quant import Wire, decode, encode, nbytes, scale_dtype

__all__ = ["reduce_scatter", "decoded_sum", "accumulation_dtype", "encoded_bytes"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype decoded rows are summed in: the wire's scale dtype (float64 for float64
    gradients, else float32), which is also what lets a row decode straight into it."""
    return scale_dtype(dtype)


def decoded_sum(received: torch.Tensor, wire: Wire, n: int, dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The all-to-all's `(k, *lead, R)` encoded rows (row i from rank i) -> their decoded sum,
    `(*lead, S)` in `dtype` (in `out` if given). Each row decodes straight into the
    accumulation dtype: no rounding to a narrower `dtype` before the sum. The eager
    reduction's wait and the traced step's `GatherFlat.backward` both end here."""
    acc = torch.empty(received.shape[:-1] + (n,), dtype=accumulation_dtype(dtype), device=received.device)
    if received.dim() == 2:  # row by row: each decodes straight into its row of acc
        for j in range(received.shape[0]):
            decode(received[j], wire, n, dtype, out=acc[j])
    else:
        decode(received, wire, n, dtype, out=acc)
    if out is None:
        return acc.sum(0).to(dtype)
    if out.dtype == acc.dtype and out.is_contiguous():
        torch.sum(acc, dim=0, out=out)
    else:
        out.copy_(acc.sum(0))
    return out


def reduce_scatter(packed: torch.Tensor, group, wire: Wire, stats, out: torch.Tensor | None = None) -> ops.Pending:
    """Start the qgZ reduction of a packed `(k, *lead, S)` gradient buffer over the shard
    group ([Note: qgZ]); `wait()` waits for the all-to-all, then decodes and sums the
    received rows: this rank's `(*lead, S)` sum in `packed`'s dtype (written into `out` if
    given). `stats` counts the encoded bytes as the reduce-scatter's. Called through
    reduce.py's `reduce_scatter`, the one entry of the eager gradient reduction."""
    with ops.plain_mode():
        rows = encode(packed, wire, check=False)  # (k, *lead, R)
        stats.collective("reduce_scatter", rows.numel() * rows.element_size())
        if out is None:
            out = torch.empty(packed.shape[1:], dtype=packed.dtype, device=packed.device)
        return ops.all_to_all_async(group, rows).then(
            functools.partial(decoded_sum, wire=wire, n=packed.shape[-1], dtype=packed.dtype, out=out))


def encoded_bytes(shape: tuple[int, ...], wire: Wire, dtype: torch.dtype) -> int:
    """Bytes of a `(k, *lead, S)` buffer encoded row by row: what `reduce_scatter` hands over."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * nbytes(shape[-1], wire, dtype)
