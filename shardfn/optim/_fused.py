"""Fused updates: ``adam``/``adamw``/``sgd`` with ``fused=True`` call PyTorch's fused kernels.

[Note: fused updates]
``torch._fused_adamw_``, ``torch._fused_adam_`` and ``torch._fused_sgd_`` take lists of
params, grads and state tensors of one device and dtype and do the whole step (moments,
bias corrections, weight decay, ``p -= lr * ...``) in one kernel per tensor, writing the
params and the state in place. They are what ``torch.optim.AdamW(fused=True)`` runs, so
calling them on the same tensors with the same scalars gives the same bits.

- The state is the state of the unfused chain (``adamw``: ``(ScaleByAdamState,
  EmptyState, lr state)``), built by the same ``init``, so a checkpoint moves between
  ``fused=True`` and ``fused=False``. The step count stays a 0-dim int64 CPU tensor; the
  kernels want a float step tensor per leaf on the leaves' device, so each call makes one
  0-dim float32 tensor per (device, dtype) group and passes it for every leaf (the
  kernels only read it). torch keeps a float32 step per param, whose values are the
  same integers.
- The learning rate is what the chain's last link would scale by (``factor``, see
  [Note: scale fusion]): a float, or ``schedule(count)``; the lr state advances in place.
- Because the kernel writes the params, ``update`` returns ``AppliedUpdates(params)``
  instead of a tree of updates, and ``apply_updates`` returns those params as they are
  (no memory pass). The gradients may be written too (the kernels' schema marks them
  mutable), so they count as consumed, as in in-place mode.
- SGD's kernel has an ``is_first_step`` flag (``buf = g``); our momentum buffer starts at
  zero and ``0 * momentum + g`` is ``g``, so we always pass ``False`` (same bits, except
  that a ``-0.0`` gradient gives a ``+0.0`` buffer).
- Leaves are grouped by (device, dtype) in order of first appearance, one kernel call per
  group, like ``torch.optim``'s ``_group_tensors_by_device_and_dtype``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import _tree
from . import _flat, _fusion
from .base import AppliedUpdates, GradientTransformation


def check_fused(fused: Optional[bool], inplace: Optional[bool], who: str, **unsupported) -> bool:
    """Resolve ``fused`` (None -> False) and reject combinations the kernels cannot do.

    Raises:
        ValueError: naming ``who`` and the offending argument.
    """
    if fused is None or not fused:
        return False
    if inplace is False:
        raise ValueError(
            f"{who}: fused=True updates the params and the state in place (PyTorch's fused "
            "kernel writes them), so it cannot take inplace=False; leave `inplace` unset "
            "or pass inplace=True, or use fused=False for pure updates."
        )
    for name, value in unsupported.items():
        if value is not None:
            raise ValueError(
                f"{who}: fused=True does not support `{name}` (got {value!r}); PyTorch's fused "
                f"kernel treats every leaf alike. Use fused=False to pass `{name}`."
            )
    return True


def _groups(who: str, treedef, params: list, **lists) -> dict:
    """Indices of the leaves grouped by (device, dtype); every list checked against params."""
    supported = torch.utils._foreach_utils._get_fused_kernels_supported_devices()
    paths = None
    groups: dict = {}
    for i, p in enumerate(params):
        problem = None
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            problem = f"is {getattr(p, 'dtype', type(p).__name__)}, not a floating-point tensor"
        elif p.device.type not in supported:
            problem = f"is on {p.device}, a device without fused kernels ({', '.join(supported)})"
        else:
            for name, leaves in lists.items():
                t = leaves[i]
                if not isinstance(t, torch.Tensor) or t.device != p.device or t.dtype != p.dtype:
                    got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                    problem = f"is {p.dtype} on {p.device} but its `{name}` leaf is {got}"
                    break
                if t.shape != p.shape:
                    problem = f"has shape {tuple(p.shape)} but its `{name}` leaf has {tuple(t.shape)}"
                    break
        if problem is not None:
            paths = paths or [a.codify("") for a in treedef.accessors()]
            raise ValueError(
                f"{who}: fused=True needs every param, gradient and state leaf to be a "
                f"floating-point tensor of one device and dtype per leaf; `params`{paths[i]} "
                f"{problem}. Use fused=False for this tree."
            )
        groups.setdefault((p.device, p.dtype), []).append(i)
    return groups


def _pick(leaves: list, idx: list[int]) -> list:
    return [leaves[i] for i in idx]


def _lr_hooks(link: GradientTransformation) -> tuple[Callable, Callable]:
    f = _fusion.fusion_of(link.update)
    return (lambda state: -f.factor(state)), f.advance


def fused_adam(
    links: tuple, adam_at: int, b1: float, b2: float, eps: float, weight_decay: float,
    *, decoupled: bool, who: str,
) -> GradientTransformation:
    """Adam (L2 decay) or AdamW (decoupled) by ``torch._fused_adam(w)_``; see [Note: fused updates].

    ``links`` is the unfused chain's transforms (for ``init`` and the lr hooks);
    ``adam_at`` the index of its ``scale_by_adam`` link.
    """
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    lr_of, advance = _lr_hooks(links[-1])
    inits = tuple(t.init for t in links)
    upd = f"{who}.update"

    def init(params):
        return tuple(fn(params) for fn in inits)

    def update(updates, state, params=None):
        _flat.require_params(params, upd)
        _check_state(state, len(links), upd)
        g, treedef = _tree.flatten(updates)
        p = _flat.leaves_like(treedef, params, "params", upd, shapes_of=g)
        adam = state[adam_at]
        mu = _flat.leaves_like(treedef, adam.mu, "state.mu", upd, shapes_of=g)
        nu = _flat.leaves_like(treedef, adam.nu, "state.nu", upd, shapes_of=g)
        groups = _groups(upd, treedef, p, grads=g, mu=mu, nu=nu)
        lr = float(lr_of(state[-1]))
        new_state = list(state)
        new_state[-1] = advance(state[-1])
        count, t = _flat.bump_count(adam.count, True)
        new_state[adam_at] = adam._replace(count=count)
        with torch.no_grad():
            g = _flat.writable(g)
            for (device, _), idx in groups.items():
                step = torch.full((), float(t), dtype=torch.float32, device=device)
                kernel(
                    _pick(p, idx), _pick(g, idx), _pick(mu, idx), _pick(nu, idx), [],
                    [step] * len(idx), lr=lr, beta1=b1, beta2=b2, weight_decay=weight_decay,
                    eps=eps, amsgrad=False, maximize=False,
                )
        return AppliedUpdates(params), tuple(new_state)

    update.fused_kernel = kernel.__name__  # read by sf.jit, which cannot trace it
    return GradientTransformation(init, update)


def fused_sgd(
    links: tuple, trace_at: Optional[int], momentum: float, nesterov: bool, weight_decay: float,
    *, who: str,
) -> GradientTransformation:
    """SGD (L2 decay, optional momentum) by ``torch._fused_sgd_``; see [Note: fused updates]."""
    lr_of, advance = _lr_hooks(links[-1])
    inits = tuple(t.init for t in links)
    upd = f"{who}.update"

    def init(params):
        return tuple(fn(params) for fn in inits)

    def update(updates, state, params=None):
        _flat.require_params(params, upd)
        _check_state(state, len(links), upd)
        g, treedef = _tree.flatten(updates)
        p = _flat.leaves_like(treedef, params, "params", upd, shapes_of=g)
        bufs = {}
        if trace_at is not None:
            bufs["momentum buffer"] = _flat.leaves_like(treedef, state[trace_at].trace, "state.trace", upd, shapes_of=g)
        groups = _groups(upd, treedef, p, grads=g, **bufs)
        buf = bufs.get("momentum buffer")
        lr = float(lr_of(state[-1]))
        new_state = list(state)
        new_state[-1] = advance(state[-1])
        with torch.no_grad():
            g = _flat.writable(g)
            for idx in groups.values():
                torch._fused_sgd_(
                    _pick(p, idx), _pick(g, idx), [] if buf is None else _pick(buf, idx),
                    weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=0.0,
                    nesterov=nesterov, maximize=False, is_first_step=False,
                )
        return AppliedUpdates(params), tuple(new_state)

    update.fused_kernel = "_fused_sgd_"  # read by sf.jit, which cannot trace it
    return GradientTransformation(init, update)


def _check_state(state, n: int, who: str) -> None:
    if type(state) is not tuple or len(state) != n:  # a plain tuple, not a NamedTuple state
        raise ValueError(
            f"{who}: the state should be the {n}-tuple this optimizer's init returned, got "
            f"{type(state).__name__}{f' of length {len(state)}' if type(state) is tuple else ''}."
        )
