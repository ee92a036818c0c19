"""From a model's recorded init (record.py) to sf.init: an initializer per parameter, a
value per computed buffer.

A parameter's writes are folded in order, as the model applies them: a write to the whole
tensor replaces what came before (GPT-2's `c_proj.weight`: normal(std) from the Linear
rule, then normal(std / sqrt(2 * n_layer)) from its block's rule), and zeroing one row
(`weight[padding_idx]`) is kept on top (`sf.init.zero_rows`). A call that sf.init cannot
draw by row blocks (`orthogonal_`, `eye_`, a `copy_` of a computed value, an op on part
of a tensor other than zeroing rows) is returned as the problem, for the caller's error.

A buffer's writes are replayed on a real tensor: `copy_` of a computed value (rotary
`inv_freq`), constants (BatchNorm's running statistics). Random writes to a buffer are a
problem.
"""

from __future__ import annotations

import math

import torch

from .initializers import (Initializer, constant, kaiming_normal, kaiming_uniform, normal, ones, trunc_normal, uniform,
                           xavier_normal, xavier_uniform, zero_rows, zeros)
from .record import Write

__all__ = ["param_initializer", "buffer_value"]


def param_initializer(writes: list[Write], shape: tuple[int, ...]) -> tuple[Initializer | None, Write | None]:
    """`(initializer, None)` that draws what `writes` leave in a parameter of `shape`;
    `(None, write)` naming a write sf.init cannot follow; `(None, None)` without writes."""
    init, rows = None, set()
    for write in writes:
        if not write.index:
            init, rows = _initializer(write), set()
            if init is None:
                return None, write
        elif _zeroes(write) and len(write.index) == 1 and isinstance(write.index[0], int) and shape:
            rows.add(write.index[0] % shape[0])
        else:
            return None, write
    if init is None and rows:  # rows zeroed in a tensor that nothing else initializes
        return None, writes[-1]
    if init is not None and rows:
        init = zero_rows(init, tuple(rows))
    return init, None


def buffer_value(writes: list[Write], like: torch.Tensor, device=None) -> tuple[torch.Tensor | None, Write | None]:
    """`(value, None)`: the buffer `like` (a meta tensor: shape, dtype) after `writes`, on
    `device`; `(None, write)` naming a write that cannot be replayed; `(None, None)` without
    writes."""
    if not writes:
        return None, None
    out = torch.zeros(like.shape, dtype=like.dtype, device="cpu")
    for write in writes:
        part = out
        for i in write.index:
            part = part[i]
        if write.call == "Tensor.copy_" and isinstance(write.args.get("src"), torch.Tensor) \
                and write.args["src"].device.type != "meta":
            part.copy_(write.args["src"])
            continue
        value = _constant_value(write)
        if value is None:
            return None, write
        part.fill_(value)
    return out.to(device) if device is not None else out, None


def _initializer(write: Write) -> Initializer | None:
    call, a = write.call.rpartition(".")[2], write.args
    if not all(isinstance(v, (int, float, str, bool)) or v is None for k, v in a.items() if k != "args"):
        return None  # a tensor-valued argument, e.g. normal_(mean=tensor)
    if "args" in a:
        return None
    if call == "normal_":
        return normal(a["mean"], a["std"])
    if call == "uniform_":
        return uniform(a["a"], a["b"]) if write.call.startswith("torch") else uniform(a["from"], a["to"])
    if call == "trunc_normal_":
        return trunc_normal(a["mean"], a["std"], a["a"], a["b"])
    if call in ("xavier_uniform_", "xavier_normal_"):
        return (xavier_uniform if call == "xavier_uniform_" else xavier_normal)(a["gain"])
    if call in ("kaiming_uniform_", "kaiming_normal_"):
        build = kaiming_uniform if call == "kaiming_uniform_" else kaiming_normal
        return build(a["a"], a["mode"], a["nonlinearity"])
    value = _constant_value(write)
    if value is None:
        return None
    if value == 0:
        return zeros()
    return ones() if value == 1 else constant(value)


def _constant_value(write: Write) -> float | None:
    call, a = write.call.rpartition(".")[2], write.args
    if call in ("zeros_", "zero_"):
        return 0
    if call == "ones_":
        return 1
    value = a.get("val", a.get("value")) if call in ("constant_", "fill_", "__setitem__") else None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type != "meta":
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def _zeroes(write: Write) -> bool:
    return _constant_value(write) == 0
