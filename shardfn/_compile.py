"""`torch.compile` and shardfn: compiled blocks between the unit collectives, and the
eager fallback of the code that moves parameters.

[Note: compiled blocks]
Where the graphs are. `sf.functional(model, compile=...)` (or blocks compiled with
`torch.compile(block)` / `block.compile()` before `sf.functional`) compiles the forward of
each child of the first `ModuleList` / `Sequential`: the blocks, `shard`'s default units.
`_functional._bind_child` binds a block's parameters around that forward, so each graph
sits between its unit's collectives: the all-gather runs before it (the block's leaves
are read through the params view), the reduce-scatter after its backward (GatherUnit's
backward node, which autograd runs right after the block's compiled backward node:
[Note: backward order] in _fsdp/runtime.py). A graph's inputs are the block's input and
the unit's full parameters, views of the unit's unsharded buffer, so releasing that
buffer's storage after the forward and restoring it before the backward works under a
compiled block as in eager: the compiled backward reads the saved views after the
restore ([Note: why storage is freed, not the tensor]).

Rank threads share the graphs. Dynamo keeps compiled code on the code object
(`Block.forward`), guarded by types, shapes and dtypes, not by module identity, so every
block of one class and every rank thread's module copy reuse one graph. Two things are
not thread-safe in torch 2.13, and are handled here:
- a frame that misses the cache while another thread compiles it is compiled again
  ("Unexpected recompilation" in TORCH_LOGS=recompiles), once per rank thread, and every
  copy counts against dynamo's recompile limit (8). So a thread's first call of a block
  with a new input signature runs under one process-wide lock: one thread compiles, the
  others then find its graph. A waiting thread waits as long as some thread compiles
  (`torch.compiler.is_compiling()` is a process-wide flag), and gives up after
  _IDLE_WAIT_S without a compile: a block that runs a collective inside its compiled
  forward, where the holder waits for this thread, costs a duplicate compile, not a hang.
- AOTAutograd compiles a graph's backward lazily, at its first backward call, with no
  lock: rank threads sharing a graph would compile it at the same time. The first call
  sets `torch._functorch.config.force_non_lazy_backward_lowering`, so the backward is
  compiled with the forward, under dynamo's compile lock.
Under a `torch.func` transform (`torch.func.grad(step)`, `train_step(use_func=True)`)
torch does not run compiled code (dynamo refuses to trace inside grad / vmap / jvp and
runs such frames eagerly; PyTorch issue #128711): the block's own forward runs instead,
with one warning per process.

[Note: no whole-step graph]
The step itself (`Shard.__call__`, `grad_and_value`, `accumulate`), `sf.functional`'s
`apply_fn` and the params view are not traced: under `torch.compile` they run eagerly,
each one graph break (`not_traced`). What a trace of them hits is in
docs/fsdp_design.md ("Compiling"): raw process-group calls and async work handles,
Python unit state and locks, storage resizes that inductor does not lower, optree specs.
What it does compile is the blocks: [Note: blocks compiled on request].
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Callable

import torch

from . import _tree
from ._errors import SpecError

__all__ = ["compile_options", "compile_context", "CompiledForward", "OnRequest", "not_traced", "WHOLE_STEP"]

_WARMUP = threading.RLock()  # held by a thread's first call of a block per input signature
_IDLE_WAIT_S = 5.0  # [Note: compiled blocks]: waited while nothing compiles, then call anyway
_warned_functorch = False
_warned: set[str] = set()  # not_traced warnings given

WHOLE_STEP = (
    "torch.compile does not capture a shardfn step whole: the step (all-gathers, reduce-scatters, the "
    "free / re-gather schedule) runs eagerly, as one graph break, and compiles the blocks of sf.functional "
    "models it runs with this torch.compile's backend (one graph per block; a pytree loss_fn runs eagerly). "
    "sf.functional(model, compile=True) does the same without torch.compile around the step "
    "(docs/howto/compile.md)."
)


def compile_options(compile, where: str = "sf.functional") -> dict | None:
    """`compile=` checked: None (do not compile) or the keyword arguments of `torch.compile`."""
    if compile is None or compile is False:
        return None
    import torch._dynamo  # noqa: F401  (torch.compile imports it anyway)

    skip_wrappers()
    if compile is True:
        return {}
    if isinstance(compile, Mapping):
        allowed = set(inspect.signature(torch.compile).parameters) - {"model"}
        unknown = sorted(set(compile) - allowed)
        if unknown:
            raise SpecError(
                f"{where}(compile=...): {unknown} {'is not an argument' if len(unknown) == 1 else 'are not arguments'} "
                f"of torch.compile, which takes {sorted(allowed)}.\nFix: e.g. compile={{'mode': 'max-autotune'}}; "
                f"inductor settings go in compile={{'options': {{...}}}}."
            )
        return dict(compile)
    raise SpecError(
        f"{where}: compile must be True, False / None, or a dict of torch.compile keyword arguments "
        f"(e.g. {{'mode': 'max-autotune', 'fullgraph': True}}), got {type(compile).__name__}."
    )


def compile_context(module: torch.nn.Module, name: str) -> Callable:
    """The `torch.compile` wrapper that `module.compile(...)` applied (same backend and
    options), to apply to the module's copy: `copy.deepcopy` drops `_compiled_call_impl`."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    compiled = module._compiled_call_impl
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            ctx = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(ctx, _TorchDynamoContext):
            return ctx
    raise SpecError(
        f"sf.functional: module {name or '(the root)'} was compiled with Module.compile(), but its compiled "
        f"call ({compiled!r}) is not one this torch version's torch.compile returns, so it cannot be "
        f"applied again to the module's per-thread copy.\nFix: compile the blocks through "
        f"sf.functional(model, compile=True) (or compile={{...torch.compile arguments}}) instead."
    )


def _signature(args, kwargs) -> tuple:
    leaves = _tree.flatten((args, kwargs))[0]
    return (torch.is_grad_enabled(),) + tuple(
        (tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else type(x)
        for x in leaves
    )


def _eager_backward_compile():
    config = torch._functorch.config
    if hasattr(config, "force_non_lazy_backward_lowering"):
        return config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


class CompiledForward:
    """A block's forward, compiled; one per rank thread's module copy ([Note: compiled blocks]).

    `compiled(*args)` is the compiled forward, `eager(*args)` the same forward uncompiled
    (under `torch.func` transforms)."""

    def __init__(self, compiled: Callable, eager: Callable):
        skip_wrappers()
        self.compiled = compiled
        self.eager = eager
        self.warm: set[tuple] = set()  # input signatures this thread has called with

    def __call__(self, *args, **kwargs):
        if torch._C._functorch.peek_interpreter_stack() is not None:
            _warn_functorch()
            return self.eager(*args, **kwargs)
        key = _signature(args, kwargs)
        if key in self.warm:
            return self.compiled(*args, **kwargs)
        locked = _acquire_warmup()
        try:
            with _eager_backward_compile():
                out = self.compiled(*args, **kwargs)
        finally:
            if locked:
                _WARMUP.release()
        self.warm.add(key)
        return out


# [Note: blocks compiled on request]
# `torch.compile(step)` (or of `sf.train_step`'s train, of a function calling the step, of
# `sf.functional`'s apply_fn) cannot trace the step ([Note: no whole-step graph]); it runs
# eagerly, but not all of it: while it runs, this thread carries a request holding the
# backend of the torch.compile that called it (its mode and options included: the
# dynamo callback's `_torchdynamo_orig_backend` chain ends at the `torch.compile` backend
# wrapper), and each block of an `sf.functional` model that was not compiled otherwise
# (an `OnRequest` forward) compiles its forward with that backend on first use, exactly
# as `sf.functional(model, compile=...)` would: one graph per block class, shared by the
# rank threads, the unit collectives between the graphs. Outside such a call the blocks
# run eagerly (one thread-local read per block call). Under sf.remat, the blocks stay
# eager (remat recomputes under torch.func.vjp, where compiled code does not run).

_request = threading.local()


def _backend_of(callback) -> Callable | None:
    """The `torch.compile` backend behind a dynamo eval-frame callback, or None."""
    backend, seen = callback, 0
    while seen < 8:
        inner = getattr(backend, "_torchdynamo_orig_backend", None)
        if inner is None or inner is backend:
            break
        backend, seen = inner, seen + 1
    return backend if seen and callable(backend) else None


@contextlib.contextmanager
def _requesting(backend: Callable):
    previous = getattr(_request, "backend", None)
    _request.backend = backend
    try:
        yield
    finally:
        _request.backend = previous


class OnRequest:
    """A block's forward that runs eagerly, or compiled with the backend of the
    torch.compile'd step now running on this thread ([Note: blocks compiled on request])."""

    def __init__(self, eager: Callable):
        self.eager = eager
        # (backend, CompiledForward); backends compare by value (torch's inductor wrapper is
        # unhashable and equal to another of the same mode and options)
        self.compiled: list[tuple[Callable, CompiledForward]] = []

    def __call__(self, *args, **kwargs):
        backend = getattr(_request, "backend", None)
        if backend is None:
            return self.eager(*args, **kwargs)
        forward = next((f for b, f in self.compiled if b is backend or b == backend), None)
        if forward is None:
            forward = CompiledForward(torch.compile(self.eager, backend=backend), self.eager)
            self.compiled.append((backend, forward))
        return forward(*args, **kwargs)


def _acquire_warmup() -> bool:
    """Take the warm-up lock; False if its holder has stopped compiling for _IDLE_WAIT_S
    (it may wait in a collective for this thread: then go on without the lock)."""
    idle = 0.0
    while not _WARMUP.acquire(timeout=0.05):
        # torch.compiler.is_compiling() is a process-wide flag, True while any thread compiles
        idle = 0.0 if torch.compiler.is_compiling() else idle + 0.05
        if idle >= _IDLE_WAIT_S:
            return False
    return True


def _user_stacklevel() -> int:
    """`warnings.warn`'s stacklevel for the first frame outside torch and shardfn (the
    user's line), seen from a function that calls `warnings.warn` directly."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _warn_functorch() -> None:
    global _warned_functorch
    if not _warned_functorch:
        _warned_functorch = True
        warnings.warn(
            "sf.functional(compile=...): under a torch.func transform that runs the step at its level (vmap, "
            "jvp, second order, has_aux=True, a differentiated batch) the compiled blocks run eagerly: "
            "torch.compile does not run inside torch.func transforms (PyTorch issue #128711). torch.func.grad(step) "
            "alone, step.grad_and_value, sf.train_step and loss.backward() run them compiled.",
            stacklevel=_user_stacklevel(),
        )


def not_traced(reason: str, warn: bool = False) -> Callable[[Callable], Callable]:
    """Decorate a function of ours that torch.compile must not trace ([Note: no whole-step
    graph]): called from compiled code it is one graph break, and it runs eagerly with
    everything it calls (torch._dynamo.disable), except what is compiled explicitly (the
    blocks). That also covers our frames that run while a dynamo callback is active but
    nothing traces them: a frame dynamo gave up on, or autograd running our backward
    nodes under `loss.backward()` inside a compiled function. `warn` (the entry points of a
    step): say so, with `reason`, the first time it is called under torch.compile, and
    compile the blocks it runs with that torch.compile's backend ([Note: blocks compiled
    on request]). Without torch._dynamo imported (nothing can be compiling) it is a plain
    call; with it, about a microsecond more."""

    def decorate(fn: Callable) -> Callable:
        disabled: list[Callable] = []

        def call(traced: bool, backend, args, kwargs):
            if traced and warn and reason not in _warned:
                _warned.add(reason)
                warnings.warn(reason, stacklevel=_user_stacklevel())
            if backend is None:
                return fn(*args, **kwargs)
            with _requesting(backend):  # [Note: blocks compiled on request]
                return fn(*args, **kwargs)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            if not disabled:
                skip_wrappers()
                disabled.append(torch._dynamo.disable(call, recursive=True, reason=reason))
            # traced, or called under a torch.compile'd function whose callback is set (from a frame
            # dynamo skipped or gave up on: a top-level `torch.compile(step)`); no Python frame here
            callback = _callback[0]()
            backend = _backend_of(callback) if warn and callback is not None else None
            return disabled[0](torch.compiler.is_dynamo_compiling() or callback is not None, backend, args, kwargs)

        _WRAPPER_CODE[:] = [wrapper.__code__]
        return wrapper

    return decorate


_WRAPPER_CODE: list = []  # the code object of every not_traced wrapper
_skipped = False
# torch's C getter of this thread's dynamo callback (a C call: no frame for dynamo to compile)
_callback: list[Callable] = [itertools.repeat(None).__next__]


def skip_wrappers() -> None:
    """Tell dynamo never to compile a `not_traced` wrapper's own frame (called from a frame it
    gave up on, it would compile it once per decorated function, one code object, up to its
    recompile limit). Called once torch._dynamo is imported, best outside compiled code."""
    global _skipped
    if not _skipped and "torch._dynamo" in sys.modules:
        _skipped = True
        from torch._dynamo import eval_frame

        if hasattr(eval_frame, "skip_code"):
            for code in _WRAPPER_CODE:
                eval_frame.skip_code(code)
        _callback[0] = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", _callback[0])
