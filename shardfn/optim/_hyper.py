"""Hyperparameters as Python numbers or as 0-dim tensors, and the scalar math on either.

[Note: tensor hyperparameters]
A hyperparameter (learning rate, ``b1``, ``b2``, ``eps``, weight decay, momentum,
``max_norm``, a schedule's values) is a Python number or a 0-dim floating-point tensor.
A number is checked by value and kept as a ``float``, as always. A tensor is checked by
dtype and ndim only, never by value: reading it (``float(t)``, ``t >= 0``, ``if t:``)
cuts its derivative (``torch.func.grad`` then returns 0, with torch's "Converting a
tensor with requires_grad=True to a scalar" warning), fails under ``vmap``, and syncs an
accelerator. Pure mode computes with it by torch ops on the per-leaf path
([Note: differentiable pure mode] in ``_flat.py``), so derivatives reach it.

The scalar arithmetic around the leaves (bias corrections, ``1 - b1``, ``lr * wd``) is
written once for both kinds: Python operators give a float from floats and a 0-dim tensor
as soon as one operand is a tensor; ``sqrt`` and ``add_scaled`` below pick the op, and
``Cast`` gives a tensor the dtype and device of the leaves it meets.

In-place and fused modes take numbers only (``numbers_only``): they write under
``torch.no_grad()``, so a tensor there could be neither differentiated nor batched.
"""

from __future__ import annotations

import math
from typing import Any, Union

import torch

Scalar = Union[float, torch.Tensor]  # a float, or a 0-dim floating-point tensor


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def check(value: Any, name: str, who: str) -> Scalar:
    """``value`` as a float, or as the 0-dim floating-point tensor it is (dtype and ndim checked).

    The caller checks the range of a float; a tensor's value is never read.

    Raises:
        ValueError: a tensor that is not floating-point or not 0-dim.
    """
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or value.dim() != 0:
            raise ValueError(
                f"{who}: {name} given as a tensor must be a 0-dim floating-point tensor (its value is "
                f"never read: it enters the update as a tensor, so derivatives reach it), got a "
                f"{value.dtype} tensor of shape {tuple(value.shape)}. Fix: pass a Python number, or "
                f"torch.tensor(x, dtype=torch.float64)."
            )
        return value
    return float(value)


def numbers_only(who: str, mode: str, **values: Any) -> None:
    """Refuse tensor hyperparameters in in-place and fused modes ([Note: tensor hyperparameters]).

    Raises:
        ValueError: naming ``who``, the mode and the first tensor argument.
    """
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            raise ValueError(
                f"{who}: {mode} takes its hyperparameters as Python numbers, but `{name}` is a tensor. "
                f"Tensor hyperparameters (to differentiate by them, or to change them between steps) "
                f"work in pure mode: leave `inplace` and `fused` unset, or wrap the optimizer in "
                f"optim.inject_hyperparams; or pass float({name})."
            )


class Cast:
    """Scalars for ops on leaves: each tensor among ``values`` in the leaf's dtype and on its
    device, converted once per (dtype, device); numbers as they are.

    The dtype is what ATen does with a number, and with a 0-dim tensor against a leaf of 1
    dim or more; a 0-dim leaf (which a 0-dim float64 tensor would promote) stays in its dtype,
    and so does a leaf under vmap, 1-dim underneath. The device lets a scalar that vmap
    batches (bias corrections of a batched count live on the CPU) meet accelerator leaves.
    """

    def __init__(self, *values: Scalar):
        self.values = values
        self.tensors = any(isinstance(v, torch.Tensor) for v in values)
        self.cache: dict = {}

    def __call__(self, leaf: torch.Tensor) -> tuple:
        if not self.tensors:
            return self.values
        key = (leaf.dtype, leaf.device)
        out = self.cache.get(key)
        if out is None:
            out = tuple(v.to(device=leaf.device, dtype=leaf.dtype) if isinstance(v, torch.Tensor) else v
                        for v in self.values)
            self.cache[key] = out
        return out


def sqrt(x: Scalar) -> Scalar:
    return torch.sqrt(x) if isinstance(x, torch.Tensor) else math.sqrt(x)


def add_scaled(x: torch.Tensor, y: torch.Tensor, alpha: Scalar) -> torch.Tensor:
    """``x + alpha * y``: ``torch.add(x, y, alpha=alpha)`` for a number (the foreach path's op,
    the same bits), ``x + y * alpha`` for a tensor (``alpha=`` takes numbers only)."""
    if isinstance(alpha, torch.Tensor):
        return torch.add(x, torch.mul(y, alpha))
    return torch.add(x, y, alpha=alpha)


def addcmul(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, value: Scalar) -> torch.Tensor:
    """``x + value * a * b``, as ``torch.addcmul`` (which takes a number ``value`` only)."""
    if isinstance(value, torch.Tensor):
        return torch.addcmul(x, torch.mul(a, value), b)
    return torch.addcmul(x, a, b, value=value)
