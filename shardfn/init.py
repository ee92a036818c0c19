"""Parameter initializers that describe a tree without materializing it (`sf.init`).

A *description* is a pytree whose leaves are `Param(shape, init, dtype)`: a shape, a
dtype and an `Initializer` (`normal`, `trunc_normal`, `uniform`, `zeros`, `ones`,
`constant`, `kaiming_uniform`, ...), and no data. `materialize(description, seed)` builds
the whole tree in one process; `step.init_shards(description, seed)` builds only this
rank's shards of it, and both give the same values, bit for bit, at every world size.
`from_module(module)` describes an `nn.Module` (built on the meta device) with PyTorch's
default initializer of each parameter's module type, following `sf.functional`'s tree.

[Note: N-independent random streams]
A leaf's global value is cut into fixed row blocks along dim 0 (`rows_per_block(shape)`
rows, about `ROW_BLOCK_NUMEL` elements; a block depends on the leaf's shape only), and
block j draws from its own `torch.Generator` seeded with a hash of (seed, the leaf's key
path, j). A rank that holds rows [a, b) (and, with tensor parallelism, a column range)
draws the blocks that overlap them, one at a time, and keeps its part: its values are
those of the full tree whatever the world size, the layout or the device, and it never
holds more than its shard plus one block. Values are drawn on the CPU (the same on every
device) and then copied to the mesh's device. The key path is part of the seed: renaming
a leaf changes its values, reordering the tree does not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Callable, Sequence

import torch

from . import _tree
from ._errors import ShardingError, bullet_list

__all__ = [
    "Initializer",
    "Param",
    "normal",
    "trunc_normal",
    "uniform",
    "zeros",
    "ones",
    "constant",
    "kaiming_uniform",
    "kaiming_normal",
    "xavier_uniform",
    "xavier_normal",
    "materialize",
    "from_module",
    "torch_default",
]

ROW_BLOCK_NUMEL = 1 << 16  # elements per random block (at least one row): [Note: N-independent random streams]


# -- initializers ------------------------------------------------------------------------------


class Initializer:
    """How to fill a leaf: `rows(shape, dtype, start, stop, generator)` returns rows
    [start, stop) of the leaf's global value (shape `(stop - start, *shape[1:])`).

    `random` initializers draw from `generator` (one per row block) and need a floating
    dtype; the others ignore it. Call an initializer with a shape (or a meta tensor) to get
    a `Param`: `sf.init.normal(std=0.02)((1024, 256))`.
    """

    random: bool = True
    name: str = "initializer"  # the public constructor, for messages

    def rows(self, shape: tuple[int, ...], dtype: torch.dtype, start: int, stop: int,
             generator: torch.Generator | None) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, shape, dtype: torch.dtype | None = None) -> "Param":
        if isinstance(shape, torch.Tensor):
            dtype = shape.dtype if dtype is None else dtype
            shape = shape.shape
        elif isinstance(shape, int):
            shape = (shape,)
        return Param(tuple(shape), self, torch.float32 if dtype is None else dtype)

    def __repr__(self) -> str:
        fields = dataclasses.fields(self) if dataclasses.is_dataclass(self) else ()
        fields = [f for f in fields if f.name != "distribution"]  # part of the name (kaiming_uniform)
        return f"sf.init.{self.name}(" + ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields) + ")"


def _block_shape(shape, start, stop) -> tuple[int, ...]:
    return (stop - start,) + tuple(shape[1:])


@dataclasses.dataclass(frozen=True, repr=False)
class _Constant(Initializer):
    value: float
    random = False

    def __repr__(self) -> str:
        if type(self.value) is int and self.value in (0, 1):  # what zeros() and ones() build
            return "sf.init.zeros()" if self.value == 0 else "sf.init.ones()"
        return f"sf.init.constant({self.value!r})"

    def rows(self, shape, dtype, start, stop, generator):
        return torch.full(_block_shape(shape, start, stop), self.value, dtype=dtype)


@dataclasses.dataclass(frozen=True, repr=False)
class _Normal(Initializer):
    name = "normal"

    mean: float = 0.0
    std: float = 1.0

    def rows(self, shape, dtype, start, stop, generator):
        out = torch.empty(_block_shape(shape, start, stop), dtype=dtype)
        return out.normal_(self.mean, self.std, generator=generator)


@dataclasses.dataclass(frozen=True, repr=False)
class _TruncNormal(Initializer):
    name = "trunc_normal"

    mean: float = 0.0
    std: float = 1.0
    a: float = -2.0
    b: float = 2.0

    def rows(self, shape, dtype, start, stop, generator):
        out = torch.empty(_block_shape(shape, start, stop), dtype=dtype)
        return torch.nn.init.trunc_normal_(out, self.mean, self.std, self.a, self.b, generator=generator)


@dataclasses.dataclass(frozen=True, repr=False)
class _Uniform(Initializer):
    name = "uniform"

    a: float = 0.0
    b: float = 1.0

    def rows(self, shape, dtype, start, stop, generator):
        out = torch.empty(_block_shape(shape, start, stop), dtype=dtype)
        return out.uniform_(self.a, self.b, generator=generator)


def _fans(shape: tuple[int, ...], who: str) -> tuple[int, int]:
    """PyTorch's (fan_in, fan_out) of a weight of `shape` (`(out, in, *kernel)` layout)."""
    if len(shape) < 2:
        raise ShardingError(
            f"sf.init.{who}: fan in/out need a weight of at least 2 dims ((out, in, *kernel), PyTorch's "
            f"layout), got shape {tuple(shape)}.\nFix: use sf.init.uniform / normal with an explicit bound "
            f"for 1-D leaves (e.g. a bias: uniform(-1 / fan_in ** 0.5, 1 / fan_in ** 0.5))."
        )
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


@dataclasses.dataclass(frozen=True, repr=False)
class _Kaiming(Initializer):
    a: float = 0.0
    mode: str = "fan_in"
    nonlinearity: str = "leaky_relu"
    distribution: str = "uniform"

    @property
    def name(self) -> str:
        return f"kaiming_{self.distribution}"

    def rows(self, shape, dtype, start, stop, generator):
        fan_in, fan_out = _fans(shape, self.name)
        fan = fan_in if self.mode == "fan_in" else fan_out
        std = torch.nn.init.calculate_gain(self.nonlinearity, self.a) / math.sqrt(fan)
        out = torch.empty(_block_shape(shape, start, stop), dtype=dtype)
        if self.distribution == "uniform":
            bound = math.sqrt(3.0) * std
            return out.uniform_(-bound, bound, generator=generator)
        return out.normal_(0.0, std, generator=generator)


@dataclasses.dataclass(frozen=True, repr=False)
class _Xavier(Initializer):
    gain: float = 1.0
    distribution: str = "uniform"

    @property
    def name(self) -> str:
        return f"xavier_{self.distribution}"

    def rows(self, shape, dtype, start, stop, generator):
        fan_in, fan_out = _fans(shape, self.name)
        std = self.gain * math.sqrt(2.0 / (fan_in + fan_out))
        out = torch.empty(_block_shape(shape, start, stop), dtype=dtype)
        if self.distribution == "uniform":
            bound = math.sqrt(3.0) * std
            return out.uniform_(-bound, bound, generator=generator)
        return out.normal_(0.0, std, generator=generator)


@dataclasses.dataclass(frozen=True, repr=False)
class _Embedding(Initializer):
    """nn.Embedding's default: normal(0, 1), with the `padding_idx` row zero."""

    padding_idx: int | None = None

    def __repr__(self) -> str:
        return f"sf.init.torch_default(nn.Embedding(..., padding_idx={self.padding_idx!r}))"

    def rows(self, shape, dtype, start, stop, generator):
        out = torch.empty(_block_shape(shape, start, stop), dtype=dtype).normal_(0.0, 1.0, generator=generator)
        if self.padding_idx is not None and start <= self.padding_idx < stop:
            out[self.padding_idx - start] = 0
        return out


def normal(mean: float = 0.0, std: float = 1.0) -> Initializer:
    """Normal(mean, std) values (`torch.nn.init.normal_`)."""
    return _Normal(float(mean), float(std))


def trunc_normal(mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> Initializer:
    """Normal(mean, std) truncated to [a, b] (absolute bounds, as `torch.nn.init.trunc_normal_`)."""
    return _TruncNormal(float(mean), float(std), float(a), float(b))


def uniform(a: float = 0.0, b: float = 1.0) -> Initializer:
    """Uniform values on [a, b) (`torch.nn.init.uniform_`)."""
    return _Uniform(float(a), float(b))


def zeros() -> Initializer:
    """All zeros (any dtype)."""
    return _Constant(0)


def ones() -> Initializer:
    """All ones (any dtype)."""
    return _Constant(1)


def constant(value: float) -> Initializer:
    """All `value` (any dtype that holds it)."""
    return _Constant(value)


def kaiming_uniform(a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Initializer:
    """`torch.nn.init.kaiming_uniform_`: uniform on ±gain·sqrt(3 / fan), fans of PyTorch's
    `(out, in, *kernel)` layout. `kaiming_uniform(a=5 ** 0.5)` is nn.Linear's default."""
    _check_mode(mode)
    return _Kaiming(float(a), mode, nonlinearity, "uniform")


def kaiming_normal(a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Initializer:
    """`torch.nn.init.kaiming_normal_`: normal(0, gain / sqrt(fan)), PyTorch's fan layout."""
    _check_mode(mode)
    return _Kaiming(float(a), mode, nonlinearity, "normal")


def xavier_uniform(gain: float = 1.0) -> Initializer:
    """`torch.nn.init.xavier_uniform_`: uniform on ±gain·sqrt(6 / (fan_in + fan_out))."""
    return _Xavier(float(gain), "uniform")


def xavier_normal(gain: float = 1.0) -> Initializer:
    """`torch.nn.init.xavier_normal_`: normal(0, gain·sqrt(2 / (fan_in + fan_out)))."""
    return _Xavier(float(gain), "normal")


def _check_mode(mode: str) -> None:
    if mode not in ("fan_in", "fan_out"):
        raise ShardingError(f"sf.init: mode must be 'fan_in' or 'fan_out', got {mode!r}")


# -- descriptions ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Param:
    """One leaf of a description: its global shape, its initializer and its dtype; no data.

    Example:
      >>> import shardfn as sf, torch
      >>> sf.init.Param((4, 3), sf.init.zeros())
      Param(shape=(4, 3), init=sf.init.zeros(), dtype=torch.float32)
      >>> sf.init.normal(std=0.02)((8, 2), torch.bfloat16).dtype
      torch.bfloat16
    """

    shape: tuple[int, ...]
    init: Initializer
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if isinstance(self.shape, int):
            object.__setattr__(self, "shape", (self.shape,))
        elif isinstance(self.shape, (list, torch.Size)):
            object.__setattr__(self, "shape", tuple(self.shape))

    def meta(self) -> torch.Tensor:
        """An empty tensor of this shape and dtype on the meta device."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def describe(init_fn) -> tuple[list, list[Param], Any]:
    """`(paths, params, treedef)` of a description (or of `init_fn()` run under
    `torch.device("meta")`), every leaf checked; ShardingError listing the bad ones."""
    if isinstance(init_fn, torch.nn.Module):
        raise ShardingError(
            f"sf.init: got the module {type(init_fn).__name__} itself as the description; fix: pass "
            f"sf.init.from_module(module) (or lambda: sf.init.from_module({type(init_fn).__name__}(...)), "
            f"which builds it on the meta device)"
        )
    if callable(init_fn) and not isinstance(init_fn, Initializer):
        with torch.device("meta"):
            tree = init_fn()
    else:
        tree = init_fn
    paths, leaves, treedef = _tree.flatten_with_paths(tree)
    problems = [p for p in (_leaf_problem(path, leaf) for path, leaf in zip(paths, leaves)) if p]
    if problems:
        raise ShardingError("sf.init: every leaf of the description must be an sf.init.Param:\n"
                            + bullet_list(problems))
    if not leaves:
        raise ShardingError("sf.init: the description has no leaves (an empty tree); return a tree of sf.init.Param")
    return list(paths), list(leaves), treedef


def _leaf_problem(path, leaf) -> str | None:
    where = f"params{_tree.keystr(path)}"
    if isinstance(leaf, torch.Tensor):
        kind = "a meta tensor" if leaf.device.type == "meta" else f"a tensor on {leaf.device}"
        return (f"{where} is {kind} of shape {tuple(leaf.shape)} without an initializer; fix: describe it as "
                f"sf.init.Param({tuple(leaf.shape)}, sf.init.normal(std=0.02), {leaf.dtype}) (or any "
                f"initializer), or build the tree with sf.init.from_module(module)")
    if isinstance(leaf, Initializer):
        return (f"{where} is an initializer ({leaf!r}) without a shape; fix: call it with the shape, e.g. "
                f"{leaf!r}((4096, 1024)), or wrap it: sf.init.Param(shape, init)")
    if not isinstance(leaf, Param):
        return (f"{where} is a {type(leaf).__name__}, not an sf.init.Param; fix: describe it as "
                f"sf.init.Param(shape, initializer, dtype), e.g. sf.init.zeros()((1024,))")
    if not isinstance(leaf.init, Initializer):
        return (f"{where} (shape {leaf.shape}) has init={leaf.init!r}, not an sf.init initializer; fix: e.g. "
                f"sf.init.normal(std=0.02) (note the call: sf.init.zeros() not sf.init.zeros)")
    if not all(isinstance(d, int) and d >= 0 for d in leaf.shape):
        return f"{where} has shape {leaf.shape!r}; fix: a tuple of non-negative ints"
    if not isinstance(leaf.dtype, torch.dtype):
        return f"{where} has dtype {leaf.dtype!r}; fix: a torch.dtype, e.g. torch.float32"
    if leaf.init.random and not leaf.dtype.is_floating_point:
        return (f"{where} (shape {leaf.shape}, dtype {leaf.dtype}) has the random initializer {leaf.init!r}, "
                f"which needs a floating dtype; fix: make it floating (dtype=torch.float32), or use "
                f"sf.init.zeros() / ones() / constant(v) for integer or boolean leaves")
    return None


# -- sampling ----------------------------------------------------------------------------------


def rows_per_block(shape: tuple[int, ...]) -> int:
    """Rows of a leaf of `shape` per random block (a function of the shape only)."""
    row = math.prod(shape[1:]) if shape else 1
    return max(1, ROW_BLOCK_NUMEL // max(row, 1))


def block_seed(seed: int, path: tuple, block: int) -> int:
    """The generator seed of row block `block` of the leaf at `path` (63 bits)."""
    text = f"{seed}|{_tree.keystr(path)}|{block}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def sample(param: Param, path: tuple, seed: int, bounds: Sequence[tuple[int, int]] | None = None,
           device=None) -> torch.Tensor:
    """The part `bounds` (one `(start, stop)` per dim; default: all) of the leaf's global
    value, on `device`. [Note: N-independent random streams]"""
    shape = tuple(param.shape)
    full = shape if shape else (1,)  # a 0-dim leaf is one row of one element
    bounds = [(0, n) for n in full] if bounds is None or not shape else [tuple(b) for b in bounds]
    out = torch.empty(tuple(b - a for a, b in bounds), dtype=param.dtype, device=device)
    (a, b), rest = bounds[0], bounds[1:]
    if out.numel():
        # Random blocks are drawn in float32 (float64 for float64 leaves), then cast.
        dtype = param.dtype
        if param.init.random and dtype != torch.float64:
            dtype = torch.float32
        per = rows_per_block(full)
        for block in range(a // per, (b - 1) // per + 1):
            start, stop = block * per, min((block + 1) * per, full[0])
            gen = torch.Generator().manual_seed(block_seed(seed, path, block)) if param.init.random else None
            rows = param.init.rows(full, dtype, start, stop, gen)
            lo, hi = max(a, start), min(b, stop)
            piece = rows[lo - start: hi - start]
            for dim, (s, e) in enumerate(rest, 1):
                piece = piece.narrow(dim, s, e - s)
            out[lo - a: hi - a].copy_(piece)
            del rows, piece
    return out if shape else out.reshape(())


def materialize(init_fn, seed: int, *, device=None):
    """The whole parameter tree of a description, in this process.

    Args:
      init_fn: a description (a pytree of `sf.init.Param`) or a function returning one
        (run under `torch.device("meta")`, so modules it builds hold no memory).
      seed: an int; the same seed gives the same tree as `step.init_shards(init_fn, seed)`
        unsharded, at any world size.
      device: where the leaves go (default: the CPU; values are drawn on the CPU).

    Returns:
      The tree of the description with a tensor per leaf.

    Example:
      >>> import shardfn as sf, torch
      >>> desc = {"w": sf.init.normal(std=0.02)((4, 3)), "b": sf.init.zeros()((3,))}
      >>> params = sf.init.materialize(desc, seed=0)
      >>> tuple(params["w"].shape), params["b"].tolist()
      ((4, 3), [0.0, 0.0, 0.0])
      >>> torch.equal(params["w"], sf.init.materialize(desc, seed=0)["w"])
      True
    """
    _check_seed(seed, "sf.init.materialize")
    paths, params, treedef = describe(init_fn)
    return _tree.unflatten(treedef, [sample(p, path, seed, device=device) for path, p in zip(paths, params)])


def _check_seed(seed, who: str) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ShardingError(f"{who}: seed must be an int, got {type(seed).__name__} {seed!r:.40}")


# -- nn.Module ---------------------------------------------------------------------------------


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

    Build the module under `torch.device("meta")` (no memory); each parameter gets
    PyTorch's default initializer of its module type (`torch_default`) unless `overrides`
    gives one.

    Args:
      module: an nn.Module, typically on the meta device; only shapes and dtypes are read.
      overrides: a function `(path, module, name) -> Initializer | None` (None: the
        default), or a dict whose keys are module types (value: a dict parameter name ->
        initializer) or dotted parameter names such as `"transformer.wte.weight"` (value:
        an initializer). Dotted names win over types.

    Returns:
      A pytree of `sf.init.Param`, the same structure as `sf.functional(module)[1]`.

    Raises:
      ShardingError: listing every parameter of a module type without a known default and
        no override.

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
    from ._functional import _walk

    leaves: list[tuple[tuple, str]] = []
    tree = _walk(module, (), "", set(), leaves, {})
    dotted_of = dict(leaves)
    paths, tensors, treedef = _tree.flatten_with_paths(tree)
    choose = _override_fn(overrides)
    out, problems = [], []
    for path, tensor in zip(paths, tensors):
        dotted = dotted_of[path]
        owner_name, _, name = dotted.rpartition(".")
        owner = module.get_submodule(owner_name)
        init = choose(path, owner, name, dotted)
        if init is None:
            init = torch_default(owner, name)
        if init is None:
            problems.append(
                f"params{_tree.keystr(path)} ({dotted}, shape {tuple(tensor.shape)}) belongs to a "
                f"{type(owner).__name__}, whose default initializer sf.init does not know; fix: pass "
                f"overrides={{{type(owner).__name__}: {{{name!r}: sf.init.normal(std=0.02)}}}} or "
                f"{{{dotted!r}: ...}}"
            )
            continue
        out.append(Param(tuple(tensor.shape), init, tensor.dtype))
    if problems:
        raise ShardingError("sf.init.from_module: no initializer for:\n" + bullet_list(problems))
    return _tree.unflatten(treedef, out)


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
