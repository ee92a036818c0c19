"""State a remat'd function mutates, and the check that its recompute is its forward again.

Used by `_remat.py`: [Note: state in remat] and [Note: a recompute must be its forward].
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._errors import SpecError

__all__ = ["Tracker", "Trace", "Recompute", "nested", "fingerprint", "check_outputs", "diverged"]

# [Note: state in remat]
# A function can mutate tensors it did not create: BatchNorm's running statistics and
# `num_batches_tracked`, a static KV cache, a counter kept in a buffer. Its recompute must
# neither mutate them a second time nor read their post-forward values. The forward's
# dispatch mode (`_Record`) sees every aten op: a tensor argument that the op's schema
# writes (`Tensor(a!)`, in place or `out=`) and whose storage no op of the forward created
# is *state* (`Tracker`). Its whole storage is copied the first time the forward writes it:
# the value the forward started from. The recompute runs under a torch-function mode
# (`Recompute`) that, wherever the function passes one of those tensors (or a view of one)
# to a torch function or method, passes the same view of a scratch copy of that snapshot
# instead; the copies are made inside the recompute's `torch.func.vjp`, where writing them
# is allowed (writing a captured tensor is not). So the recompute reads what the forward
# read and writes what the forward wrote, into its scratch copies, and the real tensors keep
# the values the forward left, exactly as without remat. A tensor argument of the function
# written in place is an error instead: its saved value would no longer be the input.

# [Note: a recompute must be its forward]
# State that is not a tensor (a transformers `DynamicCache`'s lists, a Python counter, a
# list a module appends to) cannot be snapshotted; its effect can be detected. The forward
# records, under a torch-function mode (`Trace`), every torch function and Tensor method
# the function calls that returns tensors, with their shapes and dtypes (attribute reads
# and mode switches are left out: `_computes`), and every autograd.Function applied as
# one call ([Note: an autograd.Function is one call]); the
# recompute (`Recompute`) must make the same calls with the same signatures, all of them,
# and its outputs must have the forward's values (`fingerprint`: per floating-point output,
# the sum and the sum of absolute values in float64, compared with a tolerance by dtype;
# for outputs on the CPU only, since on an accelerator reading them would stall the host
# once per remat call, and the shapes already catch a cache appended to twice; not under
# `vmap`). Otherwise a
# SpecError names the function, the call and the probable cause: differentiating a
# different computation would give wrong gradients silently (a KV cache appended to twice
# attends over duplicated keys: the same outputs, other gradients). The check is on torch
# calls, not aten ops, because the aten ops may legitimately differ: the recompute runs
# under `torch.func.vjp`, where functorch implements dropout with other ops. A remat call
# inside a remat'd function is opaque to the outer one's modes (`nested`): its own
# bookkeeping (and `autograd.Function.apply`, which takes another path under `torch.func`)
# is not the outer function's computation, and it checks its own recompute.


def storage_key(t: torch.Tensor):
    """The identity of `t`'s storage (None for meta / empty storages, which hold no values)."""
    if t.device.type == "meta" or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None  # no values (meta), or a subclass (fake tensors: no data pointer)
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


# Ops that write arguments their schema does not mark: the batch norms' running statistics
# (arguments 3 and 4) when `training` (argument 5) is set.
_UNMARKED_WRITES = {getattr(torch.ops.aten, name): (3, 4) for name in ("native_batch_norm", "cudnn_batch_norm",
                                                                         "miopen_batch_norm")
                    if hasattr(torch.ops.aten, name)}


def written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments that `func` writes: those its schema marks (`Tensor(a!)`), and
    the running statistics of a batch norm in training."""
    out = []
    unmarked = _UNMARKED_WRITES.get(func.overloadpacket)
    if unmarked is not None and len(args) > 5 and args[5] is True:
        out.extend(t for i in unmarked for t in _tensors(args[i]))
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out.extend(_tensors(value))
    return out


def fresh(func, out) -> list[torch.Tensor]:
    """The outputs of `func` that alias none of its arguments (new storages)."""
    returns = func._schema.returns
    outs = list(out) if isinstance(out, (tuple, list)) and len(returns) != 1 else [out]
    made = []
    for ret, value in zip(returns, outs):
        if ret.alias_info is None:
            made.extend(_tensors(value))
    return made


class Tracker:
    """The forward's view of state: which storages its ops created, and a snapshot of each
    storage it wrote without having created it. [Note: state in remat]"""

    def __init__(self, name: str, inputs):
        self.name = name
        self.inputs = {storage_key(t): i for i, t in enumerate(inputs) if storage_key(t) is not None}
        self.created: set = set()
        self.snapshots: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (the tensor, its storage's values)

    def before(self, func, args, kwargs) -> None:
        if not func._schema.is_mutable and func.overloadpacket not in _UNMARKED_WRITES:
            return
        for t in written(func, args, kwargs):
            key = storage_key(t)
            if key is None or key in self.created or key in self.snapshots:
                continue
            if key in self.inputs:
                raise SpecError(
                    f"sf.remat: {self.name} writes its tensor argument #{self.inputs[key]} in place "
                    f"({func}, shape {tuple(t.shape)}): the recompute in the backward would start from "
                    f"the written value, not the input.\nFix: compute a new tensor (x = x + y instead "
                    f"of x += y) or clone the argument before writing it."
                )
            whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
            self.snapshots[key] = (t, whole.clone())

    def after(self, func, out) -> None:
        for t in fresh(func, out):
            key = storage_key(t)
            if key is not None:
                self.created.add(key)


_depth = threading.local()  # how many sf.remat calls are running on this thread, one inside the other


@contextlib.contextmanager
def nested():
    """A remat call: the modes of the calls around it do not record or check what runs inside."""
    _depth.n = getattr(_depth, "n", 0) + 1
    try:
        yield
    finally:
        _depth.n -= 1


@contextlib.contextmanager
def unrecorded():
    """Work a remat'd function does on its first call only (sf.functional's per-thread
    module copy): remat's modes run it without numbering, recording or checking it, so
    the recompute, which does not repeat it, still matches its forward
    ([Note: a recompute must be its forward])."""
    _depth.hidden = getattr(_depth, "hidden", 0) + 1
    try:
        yield
    finally:
        _depth.hidden -= 1


def is_unrecorded() -> bool:
    return getattr(_depth, "hidden", 0) > 0


def _own(mode) -> bool:
    return getattr(_depth, "n", 0) == mode.depth and not is_unrecorded()


def call_signature(out) -> tuple:
    """The shapes and dtypes of a torch function's tensor outputs (and the sizes it returns)."""
    if isinstance(out, torch.Tensor):
        return ((tuple(out.shape), out.dtype),)
    if isinstance(out, torch.Size):
        return (("size", tuple(out)),)
    if isinstance(out, (tuple, list)):
        return tuple(sig for x in out for sig in call_signature(x))
    return ()


# [Note: an autograd.Function is one call]
# `Function.apply` takes two paths: outside torch.func (the remat forward, under no_grad)
# its `forward` runs as Python code, whose torch calls a torch-function mode sees one by
# one; under torch.func (the recompute, inside `torch.func.vjp`) it is one
# `custom_function_call`, whose insides the mode does not see. Compared call by call, the
# two runs of any block that applies a Function (shardfn's collectives, a fused kernel,
# flash-attention) would differ. So while a `Trace` or `Recompute` is active on a thread,
# `Function.apply` is one call on both paths: its class and the signature of its outputs,
# with what runs inside it opaque (`nested`), as a remat call inside a remat'd function
# is. The hook wraps `torch.autograd.Function.apply` once, on the first remat forward; on a
# thread with no such mode it only calls the original.

_active = threading.local()  # the innermost Trace / Recompute entered on this thread
_hook_lock = threading.Lock()
_original_apply = None


def _install_apply_hook() -> None:
    global _original_apply
    with _hook_lock:
        if _original_apply is not None:
            return
        function = torch.autograd.function.Function
        _original_apply = function.apply.__func__

        def apply(cls, *args, **kwargs):
            mode = getattr(_active, "mode", None)
            if mode is None or not _own(mode):
                return _original_apply(cls, *args, **kwargs)
            with nested():
                out = _original_apply(cls, *args, **kwargs)
            mode.function_applied(cls, out)
            return out

        apply.__doc__ = _original_apply.__doc__
        function.apply = classmethod(apply)


class _Tracked(TorchFunctionMode):
    """A torch-function mode that `Function.apply` reports to ([Note: an autograd.Function is one call])."""

    def __enter__(self):
        _install_apply_hook()
        self._outer = getattr(_active, "mode", None)
        _active.mode = self
        return super().__enter__()

    def __exit__(self, *exc):
        _active.mode = self._outer
        return super().__exit__(*exc)


def _computes(out) -> bool:
    """A call that makes tensors: what the comparison follows. Reads of a tensor's
    attributes (`.shape`, `.dtype`) and switches (`set_grad_enabled`) are left out: code
    may read them differently under torch.func (a library checking its transform level)
    without computing anything else."""
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in out)


class Trace(_Tracked):
    """Forward: every torch function `fn` calls, with its outputs' signature, in order.
    [Note: a recompute must be its forward]"""

    def __init__(self):
        super().__init__()
        self.calls: list = []
        self.depth = getattr(_depth, "n", 0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _own(self) and _computes(out):
            self.calls.append((func, call_signature(out)))
        return out

    def function_applied(self, cls, out) -> None:
        self.calls.append((cls, call_signature(out)))


class Recompute(_Tracked):
    """The recompute: each torch function call must be the forward's, with outputs of the
    same signature ([Note: a recompute must be its forward]), and each tensor the forward
    wrote is replaced by the same view of a scratch copy of its value before the forward
    ([Note: state in remat])."""

    def __init__(self, name: str, calls: list, snapshots: dict):
        super().__init__()
        self.name, self.calls, self.index = name, calls, 0
        self.depth = getattr(_depth, "n", 0)
        # Made here, inside the recompute's transform: writable there. Keyed by storage.
        self.scratch = {key: snap.clone() for key, (_, snap) in snapshots.items()}

    def _swap(self, x, swapped: dict):
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(self._swap(t, swapped) for t in x)
        if not isinstance(x, torch.Tensor):
            return x
        if type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter:
            return x
        if torch._C._functorch.is_functorch_wrapped_tensor(x):
            return x
        scratch = self.scratch.get(storage_key(x))
        if scratch is None:
            return x
        if scratch.dtype != x.dtype:  # another dtype's view of the same storage
            scratch = scratch.view(x.dtype)
        view = scratch.as_strided(x.shape, x.stride(), x.storage_offset())
        swapped[id(view)] = x
        return view

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_unrecorded():
            return func(*args, **kwargs)
        swapped = {}
        if self.scratch:
            args = tuple(self._swap(a, swapped) for a in args)
            kwargs = {k: self._swap(v, swapped) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if swapped and isinstance(out, torch.Tensor) and id(out) in swapped:
            out = swapped[id(out)]  # `x += 1` returns x, which Python then assigns: the real tensor, not its copy
        if _own(self) and _computes(out):
            self._check(func, out)
        return out

    def function_applied(self, cls, out) -> None:
        self._check(cls, out)

    def _check(self, func, out) -> None:
        i, self.index = self.index, self.index + 1
        want = self.calls[i] if i < len(self.calls) else None
        got = (func, call_signature(out))
        if want is None or want[0] != func or want[1] != got[1]:  # != : `Tensor.shape.__get__` is new each time
            raise diverged(self.name, i, want, got)

    def finish(self) -> None:
        """The recompute made all of the forward's calls."""
        if self.index < len(self.calls):
            raise diverged(self.name, self.index, self.calls[self.index], None)


_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.complex128: 1e-10, torch.complex64: 1e-4}


def fingerprint(outputs) -> list | None:
    """Per floating-point output: its dtype, sum and sum of |x| in float64 (complex128);
    None under vmap (batched outputs, whose values are not one tensor's)."""
    prints = []
    with torch.no_grad(), torch._C._DisableFuncTorch():
        for t in outputs:
            if torch._C._functorch.is_batchedtensor(t):
                return None
            if not (t.is_floating_point() or t.is_complex()) or storage_key(t) is None or t.device.type != "cpu":
                prints.append(None)  # an accelerator's values: reading them would sync the host (see the Note)
                continue
            d = t.detach().to(torch.complex128 if t.is_complex() else torch.float64)
            prints.append((t.dtype, d.sum(), d.abs().sum()))
    return prints


def check_outputs(name: str, prints: list | None, outputs) -> None:
    """Raise when the recompute's outputs are not the forward's. [Note: a recompute must be its forward]"""
    if prints is None:
        return
    with torch.no_grad(), torch._C._DisableFuncTorch():
        again = fingerprint([_plain(t) for t in outputs])
        for i, (want, got) in enumerate(zip(prints, again or [])):
            if want is None or got is None:
                continue
            dtype, total, size = want
            if bool((total - got[1]).abs() > _TOLERANCE.get(dtype, 2e-2) * (size + 1e-30)):
                raise SpecError(
                    f"sf.remat: the recompute of {name} in the backward gave output #{i} another value than "
                    f"its forward (sum {got[1].item():.6g} instead of {total.item():.6g}, shape "
                    f"{tuple(outputs[i].shape)}, {dtype}): {_CAUSE}"
                )


def _plain(t: torch.Tensor) -> torch.Tensor:
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


_CAUSE = (
    "the function changed state in its forward that it reads again (a KV cache it appended to, a Python "
    "counter or list), so the backward would differentiate another computation and the gradients would be "
    "wrong.\nFix: for transformers models do not pass use_cache=True (sf.functional(model, remat=...) "
    "runs them with use_cache=False, as Hugging Face's gradient checkpointing does); otherwise keep the state "
    "out of the remat'd function (pass it in and return its new value) or do not remat it."
)


def _describe(func, sig) -> str:
    shapes = ", ".join(f"size {tuple(d)}" if s == "size" else f"{tuple(s)} {str(d).replace('torch.', '')}"
                       for s, d in sig) or "no tensor"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    if getattr(func, "__name__", None) == "__get__" and hasattr(func, "__self__"):  # a Tensor property
        name = f"Tensor.{func.__self__.__name__}"
    if isinstance(func, type) and issubclass(func, torch.autograd.Function):
        name = f"{func.__qualname__}.apply"
    if name.startswith("_VariableFunctionsClass."):  # torch.cat and the other builtins
        name = "torch." + name.split(".", 1)[1]
    elif getattr(func, "__module__", None) == "torch.nn.functional":
        name = "F." + name
    return f"{name} -> {shapes}"


def diverged(name: str, index: int, want, got) -> SpecError:
    """The error for a recompute whose op `index` is not the forward's (`want`, `got`:
    (op, signature) or None for no op)."""
    forward = _describe(*want) if want is not None else "no more ops"
    recompute = _describe(*got) if got is not None else "no more ops"
    return SpecError(
        f"sf.remat: the recompute of {name} in the backward is not its forward: at torch call #{index} the "
        f"forward called {forward}, the recompute {recompute}. Probable cause: {_CAUSE}"
    )
