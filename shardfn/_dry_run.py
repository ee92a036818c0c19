"""The dispatch rules of `sf.estimate`'s dry run: what runs on meta, what runs for real, and
how the bytes the ops allocate are counted.

[Note: what runs for real in a dry run] Parameters, activations and floating-point batch
leaves are meta tensors: shapes and dtypes, no data, no memory. But real programs branch on
values: transformers' mask code asks `attention_mask.all()` (`padding_mask.all()`, then
`.item()`) to decide whether it can skip the mask and let attention run causal; other code
takes `.max().item()` of position ids, or `nonzero()` of a padding mask. No meta tensor
can answer, and guessing an answer could silently change the path the step takes, hence
its memory. So the dry run keeps values where they are cheap and known:

- integer and bool batch leaves are real tensors (given ones as they are; shapes filled
  with ones: token id 1, mask "attend everywhere", no padding), up to `REAL_BYTES`;
- an op whose tensor arguments are all real runs for real, on the device they are on,
  when what it allocates is at most `REAL_BYTES` (its meta twin is run first to learn
  that; the meta result is kept otherwise) — masks, positions, labels and the decisions
  taken on them are then the real ones;
- an op asked to move real integer or bool tensors to the meta device
  (`mask.to(x.device)` with `x` an activation) is such an op: it stays real, on its
  inputs' device, as the real step would. Floating-point ones do go to meta (a KV cache's
  `torch.tensor([], device=x.device)` is then what it is in the real step, under
  `torch.func` too), and so does a floating-point factory asked for meta (the schedule's
  own buffers are made so); an integer or bool one (`torch.arange(T, device=x.device)`:
  positions, cache positions) is made real on the CPU, its values known from the shape
  alone, so that transformers' mask code can ask `.all()` of positions built from it
  (a Llama under `use_cache=False` or remat);
- an op that mixes real and meta arguments runs on meta (the real ones are moved there:
  no copy of data), so nothing computed from a parameter or an activation ever has
  values; a real tensor it writes into (`buf.copy_(activation)`) is marked unknown and
  counts as meta from then on;
- an op on meta that needs values (`.item()`, `nonzero`, `masked_select`, `unique`, ...)
  is a `SpecError` naming the op and its inputs, never a guessed answer.

Bytes are counted alike on both sides (a storage's `nbytes`), so the count is that of the
real step on the batch given. FakeTensorMode was the other candidate; it answers no
`.item()` either (it raises a data-dependent error) and it would replace meta tensors in
the whole schedule (collectives, plan checks), for no gain on this question.

[Note: fused attention in a dry run] `F.scaled_dot_product_attention` picks its kernel by
device: on meta tensors it always takes the math path, which materializes the (B, H, T, T)
scores and keeps them for the backward; on CPU (flash attention for CPU) and CUDA (flash,
memory-efficient, cuDNN) a fused kernel keeps only the output and the log-sum-exp. A dry
run on meta would then overcount attention by O(T^2) (+16-19% on a tiny Llama). So
`MetaFunctions` asks PyTorch's CPU dispatcher which kernel it would pick for the same
shapes, dtypes, mask shape and dropout (stride-0 stand-ins: no memory), and when it is the
fused one runs the fused op (`_scaled_dot_product_flash_attention_for_cpu`, whose meta
kernel and backward exist) on the meta tensors. The CUDA kernels hold the same tensors
(output + log-sum-exp), so the count stands for both. The backward's fp32 accumulator of
the query's gradient is counted while it runs (`_SCRATCH`); the CPU kernel's per-thread
blocks (qSplit x kvSplit floats per thread: ~1 MiB at T = 1024) are not.
"""

from __future__ import annotations

import weakref
from typing import Callable

import optree
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ._backend import ops
from ._errors import SpecError

__all__ = ["Tracker", "MetaFunctions", "real_batch_leaf", "REAL_BYTES"]

REAL_BYTES = 64 * 2 ** 20  # the most bytes one real op (or batch leaf) of a dry run may allocate


def _as_meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) and not x.is_meta else x


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _describe(tensors: list[torch.Tensor]) -> str:
    return ", ".join(f"{'meta' if t.is_meta else t.device.type} {t.dtype} {tuple(t.shape)}" for t in tensors)


def real_batch_leaf(x: torch.Tensor) -> torch.Tensor:
    """A batch leaf for the dry run ([Note: what runs for real in a dry run]): integer and bool
    leaves real (a meta one becomes ones), floating-point ones meta."""
    if x.is_floating_point() or x.is_complex() or x.numel() * x.element_size() > REAL_BYTES:
        return _as_meta(x)
    return torch.ones(x.shape, dtype=x.dtype) if x.is_meta else x


def _data_dependent(func, args, kwargs, error: Exception) -> SpecError:
    return SpecError(
        f"sf.estimate: {func} cannot run in the dry run: its inputs ({_describe(_tensors((args, kwargs)))}) are "
        f"meta tensors (computed from parameters, activations or floating-point batch leaves), and it needs "
        f"their values or has no meta kernel ({type(error).__name__}: {str(error).splitlines()[0]}).\n"
        f"Fix: compute the value from integer or bool batch leaves, which run for real (pass them in batch_shapes "
        f"as real tensors holding representative values, or as shapes: filled with ones), or take the branch "
        f"without data-dependent code (e.g. a fixed size instead of .item()) when estimating."
    )


# what torch says when an op cannot run on meta tensors (`.item()`, no meta kernel, nonzero)
_NO_META = ("meta tensor", "meta kernel", "'meta' backend", "data-independent", "data-dependent")


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes into (`self` of an in-place op, `out=`)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            x = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
            out.extend(_tensors(x))
    return out


def _run_real_or_meta(func, args, kwargs):
    """An op without meta arguments: for real when it allocates at most REAL_BYTES."""
    device, real = kwargs.get("device"), _tensors(args)
    if not real and device is not None and torch.device(device).type == "meta":  # a meta factory
        out = func(*args, **kwargs)
        small = sum(t.untyped_storage().nbytes() for t in _tensors(out)) <= REAL_BYTES
        if small and not any(t.is_floating_point() or t.is_complex() for t in _tensors(out)):
            return func(*args, **{**kwargs, "device": torch.device("cpu")})  # positions: values from shapes alone
        return out
    if real and device is not None and torch.device(device).type == "meta" and not any(
            x.is_floating_point() or x.is_complex() for x in real):  # integer values stay where they are
        kwargs = {**kwargs, "device": real[0].device}
    if func._schema.is_mutable:  # in place / out=: the memory is already there
        return func(*args, **kwargs)
    meta_args, meta_kwargs = optree.tree_map(_as_meta, (args, kwargs))
    if any(a.name == "device" for a in func._schema.arguments):
        meta_kwargs = {**meta_kwargs, "device": torch.device("meta")}
    try:
        meta_out = func(*meta_args, **meta_kwargs)
    except (RuntimeError, NotImplementedError):  # data-dependent (nonzero, item, ...): real inputs, run it
        return func(*args, **kwargs)
    inputs = {x.untyped_storage()._cdata for x in _tensors((meta_args, meta_kwargs))}
    new = {s._cdata: s.nbytes() for s in (t.untyped_storage() for t in _tensors(meta_out))
           if s._cdata not in inputs}
    return func(*args, **kwargs) if sum(new.values()) <= REAL_BYTES else meta_out


class Tracker(TorchDispatchMode):
    """Runs each op of this thread by the dry run's rules ([Note: what runs for real in a dry
    run]) and counts the live bytes of the storages they create; peaks while `recording`.

    A storage is new when no input of the op shares it (views, in-place and `out=` ops
    return their inputs' storage). `extra()` gives the bytes held outside op outputs (the
    units' unsharded buffers) and `gathered()` those the schedule counts as gathered."""

    def __init__(self):
        super().__init__()
        self.recording = False
        self.live = 0
        self.keys: dict[int, int] = {}  # storage -> bytes, of those created while recording
        self.exclude: set[int] = set()
        self.extra: Callable[[], int] = lambda: 0
        self.gathered: Callable[[], int] = lambda: 0
        self.peak_step = self.peak_rest = 0
        self.unknown: set[int] = set()  # storages of real tensors written from meta ones: no values

    def _is_meta(self, x: torch.Tensor) -> bool:
        return x.is_meta or x.untyped_storage()._cdata in self.unknown

    def _forget_values(self, x: torch.Tensor) -> None:
        storage = x.untyped_storage()
        if not storage.device.type == "meta" and storage._cdata not in self.unknown:
            self.unknown.add(storage._cdata)
            weakref.finalize(storage, self.unknown.discard, storage._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(self._is_meta(x) for x in _tensors((args, kwargs))):
            for x in _written(func, args, kwargs):
                self._forget_values(x)
            args, kwargs = optree.tree_map(_as_meta, (args, kwargs))
            try:
                out = func(*args, **kwargs)
            except (RuntimeError, NotImplementedError) as e:
                if not any(m in str(e).lower() for m in _NO_META):
                    raise  # the program's own error (a shape mismatch, ...), as the real step would raise it
                raise _data_dependent(func, args, kwargs, e) from e
        else:
            out = _run_real_or_meta(func, args, kwargs)
        if self.recording:
            inputs = {x.untyped_storage()._cdata for x in _tensors((args, kwargs))}
            for t in _tensors(out):
                self._see(t, inputs)
            if func in _SCRATCH:  # held inside the kernel, beside its outputs, until it returns
                scratch = _SCRATCH[func](*args)
                self._see(scratch, inputs)
                self.sample()
                del scratch
            self.sample()
        return out

    def _see(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in inputs or key in self.keys or key in self.exclude:
            return
        n = storage.nbytes()
        self.keys[key] = n
        self.live += n
        weakref.finalize(storage, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        self.keys.pop(key, None)
        self.live -= n

    def watch(self, state) -> None:
        """Start recording a step of `state` (a `RankState` whose units have their buffers
        from an earlier call): its units' unsharded buffers are counted while they hold
        storage, and every change of its gathered bytes is a moment to sample."""
        units = state.units
        self.exclude = {u._full_data.untyped_storage()._cdata for u in units if u._full_data is not None}
        self.extra = lambda: sum(u.nbytes for u in units if u.full_held)
        self.gathered = lambda: state.stats.live
        hold = state.stats.hold

        def hold_and_sample(nbytes: int) -> None:
            hold(nbytes)
            self.sample()

        state.stats.hold = hold_and_sample  # this instance only
        self.recording = True

    def unwatch(self, state) -> None:
        self.recording = False
        del state.stats.hold

    def sample(self) -> None:
        if not self.recording:
            return
        total = self.live + self.extra() + ops.meta_in_flight()  # gloo's copy of each collective in flight
        self.peak_step = max(self.peak_step, total)
        self.peak_rest = max(self.peak_rest, total - self.gathered())


# -- attention -------------------------------------------------------------------------------

# Buffers a kernel allocates and frees inside itself, which no op reports: the fused
# attention backward accumulates the query's gradient in fp32 (the CPU kernel, measured on
# torch 2.13: a buffer of q's size in fp32 plus per-thread blocks; CUDA flash attention's
# dq_accum likewise), so a dry run counts one fp32 buffer of q's shape while it runs.
_SCRATCH = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        lambda grad_out, query, *rest: torch.empty(query.shape, dtype=torch.float32, device="meta"),
}

_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


def _stand_in(t: torch.Tensor | None) -> torch.Tensor | None:
    """A CPU tensor of `t`'s shape and dtype holding one row (stride 0 elsewhere): enough for
    the kernel choice, which looks at shapes, dtypes, the last dim's stride and whether a
    gradient is wanted (the CPU's fused kernel has none for a mask: T5's learned position
    bias takes the math path)."""
    if t is None:
        return None
    wants_grad = t.requires_grad and torch.is_grad_enabled() and (t.is_floating_point() or t.is_complex())
    with torch._C._DisableFuncTorch():  # a plain tensor, also inside remat's recompute (a torch.func transform)
        row = torch.empty(t.shape[-1:], dtype=t.dtype, requires_grad=wants_grad)
        return row.expand(t.shape)


class MetaFunctions(TorchFunctionMode):
    """Two functions that meta tensors get wrong, put right for the dry run:
    `F.scaled_dot_product_attention` takes the kernel the CPU dispatcher would take
    ([Note: fused attention in a dry run]), and `torch.tensor(data, device="meta")`, which
    fails under `torch.func.grad` on torch 2.13 ("attempted to call in-place operation
    (aten::detach_) that would mutate a captured Tensor": a KV cache's empty start), is
    made on the CPU and moved to meta, which works. It holds inside `sf.remat`'s forward and
    recompute too ([Note: modes around a remat call] in shardfn/_remat.py)."""

    inside_remat = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = _fused(*args, **kwargs)
            if out is not None:
                return out
        if func is torch.tensor and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            requires_grad = kwargs.pop("requires_grad", False)
            out = func(*args, **{**kwargs, "device": "cpu"}).to("meta")
            return out.requires_grad_() if requires_grad else out
        return func(*args, **kwargs)


def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if not (isinstance(query, torch.Tensor) and query.is_meta) or query.dim() != 4:
        return None
    choice = torch.ops.aten._fused_sdp_choice(
        _stand_in(query), _stand_in(key), _stand_in(value), _stand_in(attn_mask), dropout_p, is_causal,
        scale=scale, enable_gqa=enable_gqa)
    if choice != _FLASH:
        return None
    mask = _as_meta(attn_mask)
    if mask is not None and mask.dtype == torch.bool:  # the CPU kernel converts a bool mask to additive
        mask = torch.zeros_like(mask, dtype=query.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
