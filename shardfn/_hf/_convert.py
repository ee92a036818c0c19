"""The names (and fused tensors) of a transformers checkpoint, from transformers' own table.

[Note: checkpoint names through transformers' conversion table] transformers 5 loads a
checkpoint through a table of transforms per model type
(`transformers.conversion_mapping`): renames (GPT-NeoX's `embed_out.` -> `lm_head.`,
Mixtral's `.block_sparse_moe.` -> `.mlp.`) and converters that fuse tensors (the
per-expert `experts.{e}.gate_proj` / `up_proj` of Qwen3-MoE and Mixtral stacked and
concatenated into one `experts.gate_up_proj`); `save_pretrained` runs the reverse
transforms (`revert_weight_conversion`). sf.hf keeps no list of its own: it runs that
same reverse function, on meta tensors of the model's parameters, and reads from the
result which part of which parameter each tensor of the checkpoint is. The transforms
these families use only select parts (chunks, per-expert slices, transposes) and make
contiguous copies of them; a dispatch mode (`_Provenance`) follows each copy back to the
tensor it copied, so every checkpoint tensor comes out as a `Piece`: a box of one of our
parameters, with its dims in the file's order. Loading reads, for this rank's box of a
parameter, the part of each piece inside it (only those bytes, as for a plain tensor);
exporting writes each piece out of the gathered parameter. Both directions are the one
table's, so `from_pretrained` of an export and `load_shards` of a `save_pretrained` agree
with transformers by construction. A transform that computes values (not a selection) is
a clear error naming it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._errors import SpecError

__all__ = ["Piece", "pieces", "identity"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One tensor of the checkpoint: a box of one of our parameters."""

    name: str  # its name in the checkpoint
    start: tuple[int, ...]  # per dim of our parameter, where the box starts
    size: tuple[int, ...]  # per dim of our parameter, its length
    dims: tuple[int, ...]  # our parameter's dims in the file tensor's order (dims the file drops are absent)

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape in the file."""
        return tuple(self.size[d] for d in self.dims)

    def within(self, box: list[tuple[int, int]]):
        """The part of this piece inside `box` (per dim of our parameter, global `(start, stop)`):
        `(file box, place)` — the file tensor's box to read, and where it goes in `box`'s block
        (slices per dim) — or None when they do not meet."""
        lo = [max(a, s) for (a, _), s in zip(box, self.start)]
        hi = [min(b, s + n) for (_, b), s, n in zip(box, self.start, self.size)]
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        file_box = [(lo[d] - self.start[d], hi[d] - self.start[d]) for d in self.dims]
        place = tuple(slice(l - a, h - a) for (a, _), l, h in zip(box, lo, hi))
        return file_box, place

    def to_ours(self, block: torch.Tensor, box_shape) -> torch.Tensor:
        """A block read in the file's order, in our parameter's dims (`box_shape`)."""
        order = sorted(range(len(self.dims)), key=lambda j: self.dims[j])
        return block.permute(order).reshape(box_shape)

    def out_of(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of our full parameter, as the file holds it."""
        part = full[tuple(slice(s, s + n) for s, n in zip(self.start, self.size))]
        dropped = [d for d in range(full.dim()) if d not in self.dims]
        part = part.reshape([n for d, n in enumerate(self.size) if d not in dropped] if dropped else part.shape)
        kept = sorted(self.dims)
        return part.permute([kept.index(d) for d in self.dims]).contiguous()


def identity(name: str, shape) -> list[Piece]:
    return [Piece(name, (0,) * len(shape), tuple(shape), tuple(range(len(shape))))]


def _strides(shape) -> list[int]:
    out, n = [], 1
    for size in reversed(shape):
        out.append(n)
        n *= size
    return out[::-1]


class _Provenance(TorchDispatchMode):
    """Records, for each contiguous copy made of a meta tensor, the view it copied."""

    def __init__(self):
        super().__init__()
        self.copies: dict[int, tuple] = {}  # storage -> (shape, stride, offset, storage of the copied view)
        self.computed: dict[int, str] = {}  # storage -> the op that computed it
        self.keep: list = []  # the outputs, alive (their storage keys stay unique)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in args if isinstance(a, torch.Tensor)]
        outs = out if isinstance(out, (tuple, list)) else [out]
        inputs = {t.untyped_storage()._cdata for t in ins}
        for t in outs:
            if not isinstance(t, torch.Tensor) or t.untyped_storage()._cdata in inputs:
                continue  # a view: its offset and strides say where it lies
            self.keep.append(t)
            key = t.untyped_storage()._cdata
            if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten._to_copy) and len(ins) == 1:
                src = ins[0]
                self.copies[key] = (tuple(src.shape), tuple(src.stride()), src.storage_offset(),
                                    src.untyped_storage()._cdata)
            else:
                self.computed[key] = str(func)
        return out


def _position(index, stride, offset) -> int:
    return offset + sum(i * s for i, s in zip(index, stride))


def _unflat(q: int, shape) -> list[int]:
    return [(q // s) % n for s, n in zip(_strides(shape), shape)]


def _trace(t: torch.Tensor, roots: dict, mode: _Provenance, name: str):
    """(our key, offset, strides) of file tensor `t` in our parameter's flat layout."""
    shape = tuple(t.shape)
    corners = [tuple(0 for _ in shape)] + [tuple(int(j == i) for j in range(len(shape))) for i in range(len(shape))
                                           if shape[i] > 1]
    # each corner's flat position in the current storage, followed back to a root
    key, stride, offset = t.untyped_storage()._cdata, tuple(t.stride()), t.storage_offset()
    points = {c: _position(c, stride, offset) for c in corners}
    far = tuple(n - 1 for n in shape)
    points[far] = _position(far, stride, offset)
    while key not in roots:
        if key in mode.computed:
            raise SpecError(f"sf.hf: transformers' conversion of {name!r} computes it ({mode.computed[key]}), "
                            f"which sf.hf cannot read or write by parts.\nFix: load the model with "
                            f"transformers' from_pretrained and pass its sf.functional params to step.shard_params.")
        if key not in mode.copies:
            raise SpecError(f"sf.hf: transformers' conversion made {name!r} from a tensor sf.hf cannot place.")
        vshape, vstride, voffset, key = mode.copies[key]
        points = {c: _position(_unflat(q, vshape), vstride, voffset) for c, q in points.items()}
    origin = points[corners[0]]
    strides = [0] * len(shape)
    for i in range(len(shape)):
        if shape[i] > 1:
            strides[i] = points[tuple(int(j == i) for j in range(len(shape)))] - origin
    if points[far] != _position(far, strides, origin):
        raise SpecError(f"sf.hf: transformers' conversion of {name!r} is not a box of one parameter.")
    return roots[key], origin, strides


def _piece(name: str, param_shape, origin: int, strides, shape) -> Piece:
    pstrides = _strides(param_shape)
    start = _unflat(origin, param_shape)
    dims, used = [], set()
    for n, s in zip(shape, strides):
        if n > 1:
            matches = [d for d in range(len(param_shape)) if pstrides[d] == s and param_shape[d] > 1 and d not in used]
            if len(matches) != 1:
                raise SpecError(f"sf.hf: transformers' conversion of {name!r} is not a box of one parameter.")
            dims.append(matches[0])
            used.add(matches[0])
        else:
            dims.append(None)
    free = [d for d in range(len(param_shape)) if d not in used]
    for j, d in enumerate(dims):  # a file dim of length 1: one of ours not otherwise placed
        if d is None:
            if not free:
                raise SpecError(f"sf.hf: transformers' conversion of {name!r} adds a dim sf.hf cannot place.")
            dims[j] = free.pop(0)
            used.add(dims[j])
    size = [1] * len(param_shape)
    for j, d in enumerate(dims):
        size[d] = shape[j]
    return Piece(name, tuple(start), tuple(size), tuple(dims))


def pieces(model, keys: list[str], shapes, dtypes) -> list[list[Piece]]:
    """Per our key (the module's state_dict name), the checkpoint tensors it is written as by
    `model.save_pretrained` and read from by `from_pretrained` ([Note: checkpoint names
    through transformers' conversion table]); one identity piece for a key the table leaves
    as it is, or when `model` is not a transformers model."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return [identity(k, s) for k, s in zip(keys, shapes)]
    if getattr(model, "config", None) is None:
        return [identity(k, s) for k, s in zip(keys, shapes)]
    metas = {k: torch.empty(s, dtype=d, device="meta") for k, s, d in zip(keys, shapes, dtypes)}
    roots = {t.untyped_storage()._cdata: k for k, t in metas.items()}
    with _Provenance() as mode:
        written = revert_weight_conversion(model, dict(metas))
    if written is metas or list(written) == keys and all(written[k] is metas[k] for k in keys):
        return [identity(k, s) for k, s in zip(keys, shapes)]
    out: dict[str, list[Piece]] = {k: [] for k in keys}
    shape_of = dict(zip(keys, shapes))
    for name, t in written.items():
        key, origin, strides = _trace(t, roots, mode, name)
        out[key].append(_piece(name, shape_of[key], origin, strides, tuple(t.shape)))
    for key, ps in out.items():
        if sum(math.prod(p.size) for p in ps) != math.prod(shape_of[key]):
            raise SpecError(f"sf.hf: transformers' conversion writes {key!r} as {[p.name for p in ps]}, which do "
                            f"not cover it once.")
    return [out[k] for k in keys]
