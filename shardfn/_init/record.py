"""Recording a model's own initialization: the `torch.nn.init` calls (and in-place tensor
ops) that a transformers model's `_init_weights` makes on each parameter and buffer.

[Note: recording a model's own init]
A transformers `PreTrainedModel` initializes itself with `_init_weights(module)`, applied
to every submodule children first (`initialize_weights`' `smart_apply`; a nested
`PreTrainedModel` brings its own `_init_weights`). sf.init does not keep a table of those
rules: it runs them on the model (built on the meta device, so nothing is drawn) and
records what they do. Two hooks see every write:

- the `torch.nn.init` functions (`normal_`, `trunc_normal_`, `zeros_`, ...) are replaced,
  while a recording runs, in `torch.nn.init`, in the torch modules that import them by
  name, and in `transformers.initialization.TORCH_INIT_FUNCTIONS` (which transformers'
  guarded `init.*` functions call): the replacement records its arguments and draws
  nothing. The replacement records only in the thread that is recording (other threads
  get the original), and one recording runs at a time (a lock), so the patch is always
  undone whatever the threads of a simulated mesh do;
- a `TorchFunctionMode` (per thread) sees in-place tensor ops on a parameter or buffer
  (`w.normal_(...)`, `w.data.zero_()`, `w.copy_(value)`, the rotary tables' `copy_`) and
  the views that lead to them (`w[padding_idx]`, `w.data`, `w.detach()`).

Each write is kept with the module whose `_init_weights` made it, in order; later writes
win, as they do in the model. A tied parameter is written through each of its names
(`lm_head.weight` is `model.embed_tokens.weight`); transformers initializes the two before
tying them, so the tied copy takes its source's values: writes made through a tie's target
name (`model.all_tied_weights_keys`) are dropped. The rules run under `torch.device("cpu")`,
so that values they compute (rotary `inv_freq`) are real.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

from .._errors import ShardingError

__all__ = ["Write", "is_transformers_model", "record"]

INIT_FUNCTIONS = ("uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
                  "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_")
# Modules that bind the torch.nn.init functions by name (transformers' guard_torch_init_functions patches these).
_TORCH_MODULES = ("torch.nn.init", "torch.nn.modules.activation", "torch.nn.modules.transformer",
                  "torch.nn.modules.linear", "torch.nn.modules.loss", "torch.nn.modules.batchnorm",
                  "torch.nn.modules.conv", "torch.nn.modules.normalization", "torch.nn.modules.rnn",
                  "torch.nn.modules.sparse")
_state = threading.local()  # .recorder: the _Recorder of this thread's recording, if any
_lock = threading.Lock()  # one recording (one patch of torch.nn.init) at a time


@dataclasses.dataclass(frozen=True)
class Write:
    """One write of a model's init to a parameter or buffer."""

    call: str  # "torch.nn.init.normal_", "Tensor.zero_", "Tensor.copy_"
    args: dict  # the call's arguments but the tensor and the generator (defaults applied)
    index: tuple = ()  # () for the whole tensor; else the indices of `tensor[i][j]...`
    module: str = ""  # the module being initialized when it was made ("" for the root)
    by: str = ""  # the rules that made it: "LlamaModel._init_weights"

    def __str__(self) -> str:
        args = ", ".join(f"{k}={_short(v)}" for k, v in self.args.items())
        where = "".join(f"[{i!r}]" for i in self.index)
        return f"{self.call}({args}){' on' + where if where else ''}"


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} on {value.device.type}>"
    return repr(value)


def is_transformers_model(module: torch.nn.Module) -> bool:
    """`module` is a transformers `PreTrainedModel` (found by class, without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(module).__mro__)


def record(model: torch.nn.Module) -> dict[int, list[Write]]:
    """The writes of `model`'s own init (`_init_weights` of each submodule, children first,
    as `initialize_weights` applies it), per parameter or buffer (keyed by `id` of the
    tensor), in order. Draws nothing, changes nothing. [Note: recording a model's own init]

    Raises:
      ShardingError: `_init_weights` failed on the meta device, naming the module.
    """
    recorder = _Recorder(model)
    # Tensors transformers marks as loaded skip its init: the rules are recorded as for a fresh model.
    loaded = [t for t in recorder.tensors.values() if getattr(t, "_is_hf_initialized", False)]
    with _lock, _patched(), torch.device("cpu"), torch.no_grad():
        _state.recorder = recorder
        for t in loaded:
            t._is_hf_initialized = False
        try:
            with _Tracker(recorder):
                for name, module, owner in _init_order(model):
                    recorder.name, recorder.module = name, module
                    recorder.by = f"{type(owner).__name__}._init_weights"
                    try:
                        owner._init_weights(module)
                    except Exception as e:
                        raise ShardingError(
                            f"sf.init: {recorder.by}({name or 'the model'}) failed while sf.init recorded the "
                            f"model's own initialization (on its meta-device modules, drawing nothing): "
                            f"{type(e).__name__}: {e}\nFix: pass sf.init.from_module(model, overrides=...) a "
                            f"function giving every parameter an initializer, and set computed buffers by hand."
                        ) from e
        finally:
            _state.recorder = None
            for t in loaded:
                t._is_hf_initialized = True
    return recorder.writes


def _init_order(model):
    """(dotted name, module, the PreTrainedModel whose _init_weights applies to it), children
    first: transformers' `smart_apply`."""
    out = []

    def visit(name, module, owner):
        for child_name, child in module.named_children():
            child_owner = child if is_transformers_model(child) else owner
            visit(f"{name}.{child_name}" if name else child_name, child, child_owner)
        out.append((name, module, owner))

    visit("", model, model)
    return out


def _tied_targets(model) -> set[str]:
    keys = getattr(model, "all_tied_weights_keys", None) or {}
    return set(keys) if isinstance(keys, dict) else set()


class _Recorder:
    def __init__(self, model: torch.nn.Module):
        named = list(_named_tensors(model))
        self.tensors = {id(t): t for _, t in named}
        counts: dict[int, int] = {}
        for _, t in named:
            counts[id(t)] = counts.get(id(t), 0) + 1
        self.tied = {i for i, n in counts.items() if n > 1}  # ids of tensors with several names
        self.tied_targets = _tied_targets(model)
        self.views: dict[int, tuple[int, tuple, torch.Tensor]] = {}  # id(view) -> (id(base), index, view)
        self.writes: dict[int, list[Write]] = {}
        self.name, self.module, self.by = "", model, ""  # the module being initialized, by whose rules

    def target(self, tensor) -> tuple[int, tuple] | None:
        """(id of the parameter or buffer, index) that `tensor` is, or views; None if neither."""
        if self.tensors.get(id(tensor)) is tensor:
            return id(tensor), ()
        view = self.views.get(id(tensor))
        if view is not None and view[2] is tensor:
            return view[0], view[1]
        return None

    def view(self, out, base: int, index: tuple) -> None:
        if isinstance(out, torch.Tensor):
            self.views[id(out)] = (base, index, out)  # keeps `out` alive: its id is not reused

    def write(self, tensor, call: str, args: dict, index: tuple = ()) -> None:
        """Record `call` on `tensor` (or on `tensor[index]`) if it is, or views, a recorded tensor."""
        target = self.target(tensor)
        if target is None or self._through_tie(target[0]):
            return
        base, index = target[0], target[1] + index
        self.writes.setdefault(base, []).append(Write(call, args, index, self.name, self.by))

    def _through_tie(self, base: int) -> bool:
        """The write goes through a tied copy's name (lm_head.weight): its source's init wins."""
        if base not in self.tied or not self.tied_targets:
            return False
        prefix = f"{self.name}." if self.name else ""
        names = [f"{prefix}{name}" for name, t in _named_tensors(self.module) if id(t) == base]
        # a module holding the tensor under its source name too (BertLMPredictionHead's `bias`,
        # tied to its `decoder.bias`) writes it through that name: the source's own init
        return bool(names) and all(name in self.tied_targets for name in names)


def _named_tensors(module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from ((n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None)


_DATA_GET = torch.Tensor.data.__get__
_VIEWS = {"detach", "detach_", "view_as", "__getitem__"}
_NO_WRITE = {"requires_grad_", "share_memory_", "retain_grad"}


class _Tracker(TorchFunctionMode):
    """In-place ops on a recorded tensor, and the views that lead to them."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = self.recorder.target(args[0]) if args and isinstance(args[0], torch.Tensor) else None
        if target is None:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func == _DATA_GET or name in _VIEWS:
            out = func(*args, **kwargs)
            index = target[1] + ((args[1],) if name == "__getitem__" else ())
            self.recorder.view(out, target[0], index)
            return out
        if name == "__setitem__":  # w[i] = value
            self.recorder.write(args[0], "Tensor.__setitem__", {"value": args[2]}, (args[1],))
            return None
        if name == "__set__":  # w.data = value: recorded (sf.init cannot follow it), not done
            self.recorder.write(args[0], "Tensor.data.__set__", {"value": args[1]})
            return None
        if name.endswith("_") and not name.endswith("__") and name not in _NO_WRITE:
            self.recorder.write(args[0], f"Tensor.{name}", _method_args(name, args[1:], kwargs))
            return args[0]
        return func(*args, **kwargs)


_METHOD_PARAMS = {"normal_": ("mean", "std"), "uniform_": ("from", "to"), "fill_": ("value",), "copy_": ("src",)}
_METHOD_DEFAULTS = {"normal_": {"mean": 0.0, "std": 1.0}, "uniform_": {"from": 0.0, "to": 1.0}}


def _method_args(name: str, args: tuple, kwargs: dict) -> dict:
    out = dict(_METHOD_DEFAULTS.get(name, {}))
    for key, value in zip(_METHOD_PARAMS.get(name, ()), args):
        out[key] = value
    if len(args) > len(_METHOD_PARAMS.get(name, ())):
        out["args"] = args[len(_METHOD_PARAMS.get(name, ())):]
    out.update({k: v for k, v in kwargs.items() if k != "generator"})
    return out


@contextlib.contextmanager
def _patched():
    """The torch.nn.init functions replaced by recording ones (see the Note); undone on exit."""
    undo = []
    try:
        for module_name in _TORCH_MODULES:
            module = sys.modules.get(module_name)
            for name in INIT_FUNCTIONS:
                original = getattr(module, name, None) if module is not None else None
                if callable(original):
                    undo.append((module, name, original))
                    setattr(module, name, _recording(name, original))
        table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
        if isinstance(table, dict):
            for name in INIT_FUNCTIONS:
                if callable(table.get(name)):
                    undo.append((table, name, table[name]))
                    table[name] = _recording(name, table[name])
        yield
    finally:
        for where, name, original in reversed(undo):
            if isinstance(where, dict):
                where[name] = original
            else:
                setattr(where, name, original)


def _recording(name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init(*args, **kwargs):
        recorder = getattr(_state, "recorder", None)
        if recorder is None:  # another thread, or no recording: the real function
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        tensor, *_ = bound.arguments.values()
        recorder.write(tensor, f"torch.nn.init.{name}",
                       {k: v for k, v in list(bound.arguments.items())[1:] if k != "generator"})
        return tensor

    return init

