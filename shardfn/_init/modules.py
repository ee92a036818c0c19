"""`from_module`: describe an nn.Module's parameters with its own initialization rules: a
transformers model's `_init_weights` (recorded: rules.py), else PyTorch's defaults."""

from __future__ import annotations

import math
from typing import Callable

import torch

from .. import _tree
from .._functional import _walk
from .._errors import ShardingError, bullet_list
from .describe import Param
from .initializers import Initializer, _Embedding, _fans, constant, kaiming_uniform, ones, uniform, zeros
from .record import is_transformers_model, record
from .rules import param_initializer

__all__ = ["from_module", "torch_default"]


def torch_default(module: torch.nn.Module, name: str) -> Initializer | None:
    """PyTorch's default initializer of `module`'s parameter `name` (its `reset_parameters`),
    or None for a module type this does not know.

    nn.Linear and nn.Conv*: weight `kaiming_uniform(a=sqrt(5))`, bias uniform on
    ±1/sqrt(fan_in); nn.Embedding: normal(0, 1) (padding row zero); nn.LayerNorm,
    nn.GroupNorm, nn.RMSNorm, nn.BatchNorm*: weight ones, bias zeros.
    """
    nn = torch.nn
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
        if name == "weight":
            return kaiming_uniform(a=math.sqrt(5))
        if name == "bias":
            fan_in, _ = _fans(tuple(module.weight.shape), "torch_default")
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            return uniform(-bound, bound)
    if isinstance(module, nn.Embedding) and name == "weight":
        return _Embedding(module.padding_idx)
    norms = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, getattr(nn, "RMSNorm", nn.LayerNorm))
    if isinstance(module, norms):
        return {"weight": ones(), "bias": zeros()}.get(name)
    return None


def from_module(module: torch.nn.Module, overrides=None):
    """A description of `module`'s parameters, in `sf.functional(module)`'s tree layout.

    Build the module under `torch.device("meta")` (no memory). Each parameter gets, unless
    `overrides` gives one:

    - for a transformers `PreTrainedModel`: what the model's own `_init_weights` does to it
      (run on the meta-device modules and recorded, [Note: recording a model's own init]):
      normal(std=config.initializer_range) for Linear and Embedding weights, ones for norm
      weights (LlamaRMSNorm included), zeros for biases, the padding row zeroed, GPT-2's
      scaled residual projections, a tied weight initialized once, as its source;
    - for other modules: PyTorch's default initializer of its module type (`torch_default`).

    The module's computed buffers (rotary `inv_freq`) are not parameters:
    `sf.functional` computes them when it finds them on the meta device, and
    `sf.init.materialize_buffers(module)` does it in place.

    Args:
      module: an nn.Module, typically on the meta device; only shapes and dtypes are read.
      overrides: a function `(path, module, name) -> Initializer | None` (None: the
        default), or a dict whose keys are module types (value: a dict parameter name ->
        initializer) or dotted parameter names such as `"transformer.wte.weight"` (value:
        an initializer). Dotted names win over types.

    Returns:
      A pytree of `sf.init.Param`, the same structure as `sf.functional(module)[1]`.

    Raises:
      ShardingError: listing every parameter without an initializer: one of a module type
        without a known default and no override, or, for a transformers model, one that
        its `_init_weights` leaves alone or initializes with a call sf.init cannot draw by
        row blocks (e.g. `orthogonal_`), naming the call.

    Example:
      >>> import shardfn as sf, torch
      >>> with torch.device("meta"):
      ...     net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
      >>> desc = sf.init.from_module(net, {torch.nn.Linear: {"bias": sf.init.zeros()}})
      >>> desc[0]["weight"].init, desc[1]["weight"].init
      (sf.init.kaiming_uniform(a=2.23606797749979, mode='fan_in', nonlinearity='leaky_relu'), sf.init.ones())
      >>> sf.init.materialize(desc, seed=0)[0]["bias"].tolist()
      [0.0, 0.0, 0.0, 0.0]
    """
    leaves: list[tuple[tuple, str]] = []
    tree = _walk(module, (), "", set(), leaves, {})
    dotted_of = dict(leaves)
    paths, tensors, treedef = _tree.flatten_with_paths(tree)
    choose = _override_fn(overrides)
    own = _ModelRules(module) if is_transformers_model(module) else None
    out, problems = [], []
    for path, tensor in zip(paths, tensors):
        dotted = dotted_of[path]
        owner_name, _, name = dotted.rpartition(".")
        owner = module.get_submodule(owner_name)
        where = f"params{_tree.keystr(path)} ({dotted}, shape {tuple(tensor.shape)})"
        init = choose(path, owner, name, dotted)
        if init is None and own is not None:
            init, problem = own.initializer(dotted, tuple(tensor.shape))
            if problem is not None:
                problems.append(f"{where}: {problem}; fix: pass overrides={{{dotted!r}: sf.init.normal(std=0.02)}} "
                                f"(or any sf.init initializer)")
                continue
        if init is None:
            init = torch_default(owner, name)
        if init is None and own is not None:  # [Note: values set by the constructor]
            init = own.constructed(dotted)
        if init is None:
            unknown = "" if own is None else f"is left alone by {own.rules} and "
            problems.append(
                f"{where} {unknown}belongs to a "
                f"{type(owner).__name__}, whose default initializer sf.init does not know; fix: pass "
                f"overrides={{{type(owner).__name__}: {{{name!r}: sf.init.normal(std=0.02)}}}} or "
                f"{{{dotted!r}: ...}}"
            )
            continue
        out.append(Param(tuple(tensor.shape), init, tensor.dtype))
    if problems:
        raise ShardingError("sf.init.from_module: no initializer for:\n" + bullet_list(problems))
    return _tree.unflatten(treedef, out)


# [Note: values set by the constructor]
# A transformers model's `_init_weights` leaves some parameters to `__init__`, which makes
# them with a constant: BertLMPredictionHead's `bias = nn.Parameter(torch.zeros(vocab))`,
# a layer scale `torch.ones(d) * 1.0`-free `nn.Parameter(torch.full((d,), 1e-5))`. A model
# built on the meta device holds no values, so from_module builds the model's class once
# more from its config, on the meta device, under a mode that notes every constant factory
# call (zeros, ones, full, their _like forms, torch.tensor of a number) by the storage it
# makes; `nn.Parameter(t)` keeps t's storage, so each parameter of the copy says which
# constant it was made as. Only constants are followed: a parameter made by `torch.empty`,
# `torch.randn` or arithmetic stays an error naming it.

_CONSTANT_FACTORIES = {torch.zeros: "zeros", torch.ones: "ones", torch.full: "full", torch.zeros_like: "zeros",
                       torch.ones_like: "ones", torch.full_like: "full", torch.tensor: "tensor"}


class _Factories(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.made: dict[int, Initializer] = {}  # storage -> the constant it was made as
        self.keep: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = _CONSTANT_FACTORIES.get(func)
        if kind is not None and isinstance(out, torch.Tensor):
            init = None
            if kind == "zeros":
                init = zeros()
            elif kind == "ones":
                init = ones()
            elif kind == "full":
                value = args[1] if len(args) > 1 else kwargs.get("fill_value")
                init = constant(float(value)) if isinstance(value, (int, float)) else None
            elif args and isinstance(args[0], (int, float)) and not isinstance(args[0], bool):
                init = constant(float(args[0]))
            if init is not None:
                self.keep.append(out)
                self.made[out.untyped_storage()._cdata] = init
        return out


def _constructed(model: torch.nn.Module) -> dict[str, Initializer]:
    """Dotted parameter name -> the constant `model`'s class makes it with in `__init__`
    ([Note: values set by the constructor]); {} when the class cannot be built again."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    try:
        with torch.device("meta"), _Factories() as mode:
            again = type(model)(config)
    except Exception:  # noqa: BLE001 - a class that needs more than its config: nothing to follow
        return {}
    out = {}
    for name, p in again.named_parameters(remove_duplicate=False):
        init = mode.made.get(p.untyped_storage()._cdata)
        if init is not None:
            out[name] = init
    return out


class _ModelRules:
    """A transformers model's recorded init, per parameter."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.writes = record(model)
        self.rules = f"{type(model).__name__}._init_weights"
        self._constructed: dict[str, Initializer] | None = None

    def constructed(self, dotted: str) -> Initializer | None:
        """The constant `__init__` makes `dotted` with, or None ([Note: values set by the constructor])."""
        if self._constructed is None:
            self._constructed = _constructed(self.model)
        return self._constructed.get(dotted)

    def initializer(self, dotted: str, shape: tuple[int, ...]) -> tuple[Initializer | None, str | None]:
        writes = self.writes.get(id(self.model.get_parameter(dotted)), [])
        init, bad = param_initializer(writes, shape)
        if bad is None:
            return init, None
        return None, (f"{bad.by}({bad.module or 'the model'}) calls {bad} on it, which sf.init cannot draw "
                      f"row block by row block")


def _override_fn(overrides) -> Callable:
    if overrides is None:
        return lambda path, owner, name, dotted: None
    if callable(overrides) and not isinstance(overrides, dict):
        return lambda path, owner, name, dotted: overrides(path, owner, name)
    if not isinstance(overrides, dict):
        raise ShardingError(
            f"sf.init.from_module: overrides must be a dict or a function, got {type(overrides).__name__}"
        )

    def choose(path, owner, name, dotted):
        if dotted in overrides:
            return overrides[dotted]
        for key, value in overrides.items():
            if isinstance(key, type) and isinstance(owner, key):
                return value.get(name) if isinstance(value, dict) else value
        return None

    return choose
