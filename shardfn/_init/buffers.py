"""`materialize_buffers`: compute the buffers of a module built on the meta device.

[Note: computed buffers]
Buffers are not parameters: `sf.init` descriptions do not hold them, and a module built
on the meta device has them on meta too ("Cannot copy out of meta tensor; no data!" at
the first forward). Most are computed from the configuration, not learned: rotary
`inv_freq`, BatchNorm's running statistics before training. They are computed the way the
model computes them: a transformers model's own `_init_weights` (recorded, [Note:
recording a model's own init]; transformers 5 recomputes rotary tables there), else
PyTorch's defaults (BatchNorm running statistics). `sf.functional` does this in each
thread's copy of the module ([Note: a module copy per thread]) on the device of the
parameters, leaving buffers it cannot compute on meta (the forward may not read them).
"""

from __future__ import annotations

import torch

from .._errors import ShardingError, bullet_list
from .record import is_transformers_model, record
from .rules import buffer_value

__all__ = ["materialize_buffers", "fill_meta_buffers"]


def materialize_buffers(module: torch.nn.Module, device=None) -> torch.nn.Module:
    """Compute, in place, the buffers of `module` that are on the meta device.

    A transformers model's buffers are computed by its own `_init_weights` (rotary
    `inv_freq` and `original_inv_freq`, BatchNorm statistics, ...); other modules' by
    PyTorch's defaults (BatchNorm running statistics: zeros, ones, 0). Buffers not on the
    meta device are left as they are; persistence (`state_dict`) is kept.

    Args:
      module: an nn.Module, typically built under `torch.device("meta")`.
      device: where the computed buffers go (default: the CPU).

    Returns:
      `module` itself.

    Raises:
      ShardingError: listing each meta buffer that nothing computes (its dotted name,
        shape, dtype), with the fix.

    Example:
      >>> import shardfn as sf, torch
      >>> with torch.device("meta"):
      ...     bn = torch.nn.BatchNorm1d(3)
      >>> sf.init.materialize_buffers(bn).running_var.tolist()
      [1.0, 1.0, 1.0]
    """
    problems = fill_meta_buffers(module, device)
    if problems:
        raise ShardingError("sf.init.materialize_buffers: cannot compute these buffers of "
                            f"{type(module).__name__}, which are on the meta device:\n" + bullet_list(problems))
    return module


def fill_meta_buffers(module: torch.nn.Module, device=None) -> list[str]:
    """Compute the meta buffers of `module` in place (see `materialize_buffers`); returns
    a message for each one left on meta."""
    owners: dict[int, list[tuple[torch.nn.Module, str, str]]] = {}
    for dotted, buffer in module.named_buffers(remove_duplicate=False):
        if buffer is not None and buffer.device.type == "meta":
            owner_name, _, name = dotted.rpartition(".")
            owners.setdefault(id(buffer), []).append((module.get_submodule(owner_name), name, dotted))
    if not owners:
        return []
    writes = record(module) if is_transformers_model(module) else {}
    problems = []
    for key, places in owners.items():
        owner, name, dotted = places[0]
        meta = owner._buffers[name]
        value, bad = buffer_value(writes.get(key, []), meta, device)
        if value is None and bad is None:
            value = _torch_default(owner, name, meta, device)
        if value is None:
            why = (f"{bad.by}({bad.module or 'the model'}) sets it with {bad}" if bad is not None
                   else f"nothing computes it (no write in the model's _init_weights, no PyTorch default for "
                        f"{type(owner).__name__}.{name})")
            parent = dotted.rpartition(".")[0]
            problems.append(f"{dotted} (shape {tuple(meta.shape)}, {meta.dtype}): {why}; fix: build the module "
                            f"on a real device, or set it before use: module.get_submodule({parent!r}).{name} = <tensor>")
            continue
        for place, buffer_name, _ in places:  # a buffer shared by several modules is set in each
            place._buffers[buffer_name] = value
    return problems


def _torch_default(owner, name, meta, device) -> torch.Tensor | None:
    if isinstance(owner, torch.nn.modules.batchnorm._NormBase) and name in ("running_mean", "running_var",
                                                                             "num_batches_tracked"):
        fill = 1 if name == "running_var" else 0
        return torch.full(meta.shape, fill, dtype=meta.dtype, device=device)
    return None
