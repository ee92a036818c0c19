"""The initializers of `sf.init` (how to fill a leaf, given its global shape) and `Param`.

Each is a small frozen dataclass whose `rows(shape, dtype, start, stop, generator)`
returns rows [start, stop) of the leaf's global value; `random` ones draw from the
generator of each row block (describe.py's [Note: N-independent random streams]). Fans
follow PyTorch's weight layout `(out, in, *kernel)` and are computed from the global
shape, never from a shard's.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._errors import ShardingError

__all__ = ["Initializer", "Param", "normal", "trunc_normal", "uniform", "zeros", "ones", "constant", "kaiming_uniform",
           "kaiming_normal", "xavier_uniform", "xavier_normal", "zero_rows"]


class Initializer:
    """How to fill a leaf: `rows(shape, dtype, start, stop, generator)` returns rows
    [start, stop) of the leaf's global value (shape `(stop - start, *shape[1:])`).

    `random` initializers draw from `generator` (one per row block) and need a floating
    dtype; the others ignore it. Call an initializer with a shape (or a meta tensor) to get
    a `Param`: `sf.init.normal(std=0.02)((1024, 256))`. A new initializer subclasses this
    (a frozen dataclass, so that its repr and equality describe it) and defines `rows`.

    Example:
      >>> import shardfn as sf, torch
      >>> init = sf.init.uniform(-1, 1)
      >>> init((3, 2))
      Param(shape=(3, 2), init=sf.init.uniform(a=-1.0, b=1.0), dtype=torch.float32)
      >>> init.rows((3, 2), torch.float32, 1, 3, torch.Generator().manual_seed(0)).shape
      torch.Size([2, 2])
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


@dataclasses.dataclass(frozen=True, repr=False)
class _ZeroRows(Initializer):
    """`init` with some rows zero (an embedding's padding row)."""

    init: Initializer
    indices: tuple[int, ...]

    @property
    def random(self) -> bool:
        return self.init.random

    def __repr__(self) -> str:
        return f"sf.init.zero_rows({self.init!r}, {self.indices!r})"

    def rows(self, shape, dtype, start, stop, generator):
        out = self.init.rows(shape, dtype, start, stop, generator)
        for row in self.indices:
            if start <= row < stop:
                out[row - start] = 0
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


def zero_rows(init: Initializer, rows) -> Initializer:
    """`init` with the rows `rows` (indices along dim 0) set to zero, e.g. an embedding's
    padding row: `zero_rows(normal(std=0.02), (pad_id,))`. The other rows are `init`'s own
    values, the same as without `zero_rows`."""
    if not isinstance(init, Initializer):
        raise ShardingError(f"sf.init.zero_rows: init must be an sf.init initializer, got {init!r:.60}")
    rows = (rows,) if isinstance(rows, int) else tuple(sorted({int(r) for r in rows}))
    if any(r < 0 for r in rows):
        raise ShardingError(f"sf.init.zero_rows: rows must be non-negative row indices, got {rows}")
    return _ZeroRows(init, rows)


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
