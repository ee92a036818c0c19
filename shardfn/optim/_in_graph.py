"""Scalars that depend on the step count, inside a compiled graph.

[Note: step-dependent scalars in a graph]
Under `torch.compile` (`sf.jit`) the optimizer's step count is a symbolic int: dynamo
reads the 0-dim count tensor without specializing on it, so nothing recompiles as it
grows. A scalar computed from it — Adam's bias corrections, a schedule's learning rate —
is then a symbolic float, and passed to a tensor op as a Python number it becomes part of
that op's kernel: inductor's CPU kernels evaluate the expression in every vectorized
iteration (for Adam: two `std::pow`, a `sqrt` and divisions in double, per 8 floats).
Measured on one GPT 8L d512 unit's AdamW update (1.4M float32 elements over 12 leaves,
one thread, in place): 9.4 ms, against 0.85 ms with a constant in its place and 0.70 ms
for torch's fused AdamW kernel.

`scalar(x, like)` turns such a value into a 0-dim float64 tensor computed once, behind an
op inductor does not fuse through (`shardfn::realized`, a copy), so each kernel loads it
(0.92 ms on the same update); a schedule's value, a 0-dim tensor in a graph ([Note:
schedules in a graph] in _schedules.py), goes the same way. In eager code the value comes
back unchanged. The numbers are eager's: an op on float32 tensors with a 0-dim float64 tensor
computes with the value cast to float32, exactly as with a Python float (ATen reads both
as a CPU scalar; inductor promotes to the tensors' dtype), so `aot_eager` stays bit-equal.
"""

from __future__ import annotations

import torch

__all__ = ["scalar"]


@torch.library.custom_op("shardfn::realized", mutates_args=())
def _realized(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` that inductor computes once, as a buffer, instead of inlining the
    expression that made it into every consumer's loop."""
    return x.clone()


@_realized.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def scalar(x, like: torch.Tensor):
    """`x` (a number or a 0-dim tensor) for a tensor op on tensors like `like`: unchanged in
    eager code, a realized 0-dim float64 tensor on `like`'s device while torch.compile
    traces ([Note: step-dependent scalars in a graph]). Dynamo shows a symbolic float to the
    traced code as a `float` (`isinstance(x, torch.SymFloat)` is False there), so every
    number is wrapped: callers pass only values computed from the step count."""
    if not torch.compiler.is_compiling():
        return x
    if isinstance(x, torch.Tensor):
        return _realized(x.to(device=like.device, dtype=torch.float64))
    return _realized(torch.scalar_tensor(x, dtype=torch.float64, device=like.device))
