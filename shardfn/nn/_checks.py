"""Argument checks shared by ring and Ulysses attention: one clear error per mistake."""

from __future__ import annotations

import contextlib
import math

import torch

from .._errors import DesyncError, ShardingError

__all__ = ["check_qkv", "default_scale", "same_blocks"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def check_qkv(where: str, q, k, v, mask) -> None:
    """q (B, H, T, D), k and v (B, Hkv, T, D) with H % Hkv == 0, one float dtype; mask
    None or bool (B, T). Raises ShardingError listing every problem, with a Fix."""
    problems = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            problems.append(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        elif x.dim() != 4:
            problems.append(f"{name} must be 4-D (batch, heads, local sequence, head dim), got shape {_shape(x)}")
        elif x.dtype not in _FLOATS:
            problems.append(f"{name} has dtype {x.dtype}; attention needs a float dtype")
    if not problems:
        if k.shape != v.shape:
            problems.append(f"k {_shape(k)} and v {_shape(v)} must have the same shape")
        if q.dtype != k.dtype or q.dtype != v.dtype:
            problems.append(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
            problems.append(f"q {_shape(q)} and k {_shape(k)} must agree on batch (dim 0), local sequence "
                            f"length (dim 2) and head dim (dim 3)")
        elif k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            problems.append(f"q has {q.shape[1]} heads and k/v {k.shape[1]}: the query heads must be a multiple "
                            f"of the key/value heads (GQA/MQA)")
    if mask is not None and not problems:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2 \
                or tuple(mask.shape) != (q.shape[0], q.shape[2]):
            what = f"dtype {mask.dtype} shape {_shape(mask)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            problems.append(f"mask must be a bool key-padding mask of shape (batch, local sequence) = "
                            f"{(q.shape[0], q.shape[2])}, True where a key takes part; got {what}")
    if problems:
        items = "\n".join(f"  - {p}" for p in problems)
        raise ShardingError(f"{where}:\n{items}\nFix: pass this rank's sequence block of each: q (B, H, T_local, "
                            f"D), k and v (B, Hkv, T_local, D) with H a multiple of Hkv, one float dtype, and "
                            f"mask None or bool (B, T_local).")


def default_scale(scale, d: int, where: str) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ShardingError(f"{where}: scale must be a Python float or None (1/sqrt(head dim)), got {scale!r:.60}")
    return float(scale)


@contextlib.contextmanager
def same_blocks(where: str, q: torch.Tensor, k: torch.Tensor, axis, n: int):
    """Turn a collective desync inside the attention into the likely cause: ranks holding
    blocks of different lengths (a global length that does not divide by the axis size,
    split by torch.chunk). The backend detects it (the simulated mesh always; processes
    with `check_collectives`) before anything is sent; no extra collective is spent here."""
    try:
        yield
    except DesyncError as err:
        raise DesyncError(
            f"{where}: the ranks of axis {axis!r} (size {n}) issued different collectives; most likely their "
            f"sequence blocks differ in length (this rank: q {tuple(q.shape)}, k {tuple(k.shape)}), which "
            f"happens when the global sequence length does not divide by {n}. Every rank needs the same "
            f"T_local.\nFix: pad the sequence to a multiple of {n} (of {2 * n} for layout='zigzag') and pass "
            f"mask= for the padding.\nThe backend reported: {err}") from err
