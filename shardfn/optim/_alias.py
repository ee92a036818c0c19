"""Ready-made optimizers, each a ``chain`` of transforms, with PyTorch's semantics.

| shardfn                         | PyTorch                                   | chain                                                   |
|---------------------------------|-------------------------------------------|---------------------------------------------------------|
| ``sgd(lr, momentum, nesterov, weight_decay)`` | ``torch.optim.SGD`` (dampening=0) | add_decayed_weights → trace → scale_by_learning_rate |
| ``adam(lr, b1, b2, eps, weight_decay)``       | ``torch.optim.Adam`` (L2 decay)   | add_decayed_weights → scale_by_adam → scale_by_learning_rate |
| ``adamw(lr, b1, b2, eps, weight_decay=1e-2)`` | ``torch.optim.AdamW``             | scale_by_adam → add_decayed_weights → scale_by_learning_rate |
| ``lion(lr, b1, b2, weight_decay)``            | (Lion paper, optax.lion)          | scale_by_lion → add_decayed_weights → scale_by_learning_rate |

``sgd``, ``adam`` and ``adamw`` with ``fused=True`` keep that chain's state but run
PyTorch's fused kernel instead (see [Note: fused updates] in ``_fused.py``).
"""

from __future__ import annotations

from typing import Optional

from . import _flat, _hyper
from ._adam import scale_by_adam
from ._fused import check_fused, fused_adam, fused_sgd
from ._lion import scale_by_lion
from ._momentum import trace
from ._scale import ScalarOrSchedule, scale_by_learning_rate
from ._weight_decay import Mask, add_decayed_weights
from .base import GradientTransformation, chain, identity


def _check_lr(lr: ScalarOrSchedule, who: str) -> ScalarOrSchedule:
    """A schedule, a float >= 0, or a 0-dim floating-point tensor (whose value is not read:
    [Note: tensor hyperparameters] in _hyper.py)."""
    if callable(lr):
        return lr
    lr = _hyper.check(lr, "learning_rate", who)
    if not _hyper.is_tensor(lr) and not lr >= 0.0:
        raise ValueError(f"{who}: learning rate must be >= 0 (or a schedule), got {lr}.")
    return lr


def _check_nonneg(value, name: str, who: str):
    value = _hyper.check(value, name, who)
    if not _hyper.is_tensor(value) and not value >= 0.0:
        raise ValueError(f"{who}: {name} must be >= 0, got {value}.")
    return value


def _modes(who: str, inplace: Optional[bool], fused: Optional[bool], hyper: dict, **unsupported) -> tuple[bool, bool]:
    """Resolve ``(inplace, fused)``; those modes take numbers only ([Note: tensor hyperparameters])."""
    fused_flag = fused
    fused = check_fused(fused, inplace, who, **unsupported)
    inplace = bool(inplace) or fused
    if inplace:
        _hyper.numbers_only(who, "fused=True" if fused_flag else "inplace=True", **hyper)
    return inplace, fused


def _refusing_func(opt: GradientTransformation, who: str, fused: bool) -> GradientTransformation:
    """``opt`` whose update refuses tensors of a torch.func transform, naming the alias."""
    inner = opt.update
    fix = f"optim.{who}(lr) without inplace=..." + (" and fused=..." if fused else "")

    def update(updates, state, params=None):
        _flat.refuse_func(f"{who}.update", fix, updates, state, params)
        return inner(updates, state, params)

    if hasattr(inner, "fused_kernel"):  # read by sf.jit
        update.fused_kernel = inner.fused_kernel
    return GradientTransformation(opt.init, update)


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    inplace: Optional[bool] = None,
    fused: Optional[bool] = None,
) -> GradientTransformation:
    """Stochastic gradient descent with ``torch.optim.SGD``'s momentum and weight decay.

    ``g += weight_decay * p``; ``buf = momentum * buf + g`` (``buf = g`` on the first
    step); the step is ``buf``, or ``g + momentum * buf`` with Nesterov; ``p -= lr * step``.

    Args:
        learning_rate: a float, a schedule ``step -> lr``, or in pure mode a 0-dim
            floating-point tensor (differentiable).
        momentum: momentum factor (0 disables the buffer).
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        weight_decay: L2 penalty added to the gradient.
        inplace: update state and the incoming gradients in place (no allocation);
            None means False, or True with ``fused=True``.
        fused: one ``torch._fused_sgd_`` call per (device, dtype) group, which updates
            the params, the buffer and the lr state in place; ``update`` then returns
            ``AppliedUpdates`` (see ``docs/optim.md``). None (the default) means False.

    Returns:
        ``chain(add_decayed_weights, trace, scale_by_learning_rate)`` (with ``fused=True``,
        one transform with that chain's state).

    Raises:
        ValueError: bad hyperparameters; ``fused=True`` with ``inplace=False``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> optim.apply_updates(params, updates)["w"]
        tensor([0.9000, 0.9000])
    """
    who = "sgd"
    learning_rate = _check_lr(learning_rate, who)
    momentum = _check_nonneg(momentum, "momentum", who)
    weight_decay = _check_nonneg(weight_decay, "weight_decay", who)
    if nesterov and not _hyper.is_tensor(momentum) and momentum <= 0:
        raise ValueError(f"{who}: nesterov=True needs momentum > 0, got momentum={momentum}.")
    inplace, fused = _modes(who, inplace, fused, dict(learning_rate=learning_rate, momentum=momentum,
                                                      weight_decay=weight_decay))
    has_trace = _hyper.is_tensor(momentum) or momentum != 0.0  # a tensor's value is not read
    links = (
        add_decayed_weights(weight_decay, inplace=inplace),
        trace(momentum, nesterov, inplace=inplace) if has_trace else identity(),
        scale_by_learning_rate(learning_rate, inplace=inplace),
    )
    if fused:
        opt = fused_sgd(links, 1 if has_trace else None, momentum, nesterov, weight_decay, who=who)
    else:
        opt = chain(*links)
    return _refusing_func(opt, who, fused) if inplace else opt


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    inplace: Optional[bool] = None,
    fused: Optional[bool] = None,
) -> GradientTransformation:
    """Adam with ``torch.optim.Adam``'s semantics (L2 ``weight_decay`` added to the gradient).

    Args:
        learning_rate: a float, a schedule ``step -> lr``, or in pure mode a 0-dim
            floating-point tensor (differentiable).
        b1: decay of the first moment (torch's ``betas[0]``).
        b2: decay of the second moment (torch's ``betas[1]``).
        eps: added after the square root of the bias-corrected second moment.
        weight_decay: L2 penalty added to the gradient before the moments.
        inplace: update state and the incoming gradients in place (no allocation);
            None means False, or True with ``fused=True``.
        fused: one ``torch._fused_adam_`` call per (device, dtype) group (the kernel of
            ``torch.optim.Adam(fused=True)``, same bits), updating the params and the
            state in place; ``update`` then returns ``AppliedUpdates`` (see
            ``docs/optim.md``). None (the default) means False.

    Returns:
        ``chain(add_decayed_weights, scale_by_adam, scale_by_learning_rate)`` (with
        ``fused=True``, one transform with that chain's state).

    Raises:
        ValueError: bad hyperparameters; ``fused=True`` with ``inplace=False``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.adam(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> optim.apply_updates(params, updates)["w"]
        tensor([0.9000, 0.9000])
    """
    who = "adam"
    learning_rate = _check_lr(learning_rate, who)
    weight_decay = _check_nonneg(weight_decay, "weight_decay", who)
    inplace, fused = _modes(who, inplace, fused, dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                                                      weight_decay=weight_decay))
    links = (
        add_decayed_weights(weight_decay, inplace=inplace),
        scale_by_adam(b1, b2, eps, inplace=inplace),
        scale_by_learning_rate(learning_rate, inplace=inplace),
    )
    if fused:
        opt = fused_adam(links, 1, float(b1), float(b2), float(eps), weight_decay, decoupled=False, who=who)
    else:
        opt = chain(*links)
    return _refusing_func(opt, who, fused) if inplace else opt


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask: Optional[Mask] = None,
    *,
    inplace: Optional[bool] = None,
    fused: Optional[bool] = None,
) -> GradientTransformation:
    """AdamW with ``torch.optim.AdamW``'s semantics: decoupled decay scaled by the (scheduled) lr.

    The update is ``-lr_t * (adam + weight_decay * p)``, so ``apply_updates`` gives
    ``p * (1 - lr_t * weight_decay) - lr_t * adam``: torch's ``p.mul_(1 - lr * wd)``
    followed by its Adam step.

    Args:
        learning_rate: a float, a schedule ``step -> lr``, or in pure mode a 0-dim
            floating-point tensor (differentiable); decay follows it, like torch.
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added after the square root of the bias-corrected second moment.
        weight_decay: decoupled weight decay (torch's default ``1e-2``).
        mask: which leaves to decay (see ``add_decayed_weights``).
        inplace: update state and the incoming gradients in place (no allocation);
            None means False, or True with ``fused=True``.
        fused: one ``torch._fused_adamw_`` call per (device, dtype) group (the kernel of
            ``torch.optim.AdamW(fused=True)``, same bits), updating the params and the
            state in place; ``update`` then returns ``AppliedUpdates`` (see
            ``docs/optim.md``). None (the default) means False: the foreach chain.

    Returns:
        ``chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)`` (with
        ``fused=True``, one transform with that chain's state).

    Raises:
        ValueError: bad hyperparameters; ``fused=True`` with ``inplace=False`` or a ``mask``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.adamw(0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(2)}
        >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> optim.apply_updates(params, updates)["w"]  # 1 * (1 - 0.05) - 0.1
        tensor([0.8500, 0.8500])
    """
    who = "adamw"
    learning_rate = _check_lr(learning_rate, who)
    weight_decay = _check_nonneg(weight_decay, "weight_decay", who)
    inplace, fused = _modes(who, inplace, fused, dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                                                      weight_decay=weight_decay), mask=mask)
    links = (
        scale_by_adam(b1, b2, eps, inplace=inplace),
        add_decayed_weights(weight_decay, mask, inplace=inplace),
        scale_by_learning_rate(learning_rate, inplace=inplace),
    )
    if fused:
        opt = fused_adam(links, 0, float(b1), float(b2), float(eps), weight_decay, decoupled=True, who=who)
    else:
        opt = chain(*links)
    return _refusing_func(opt, who, fused) if inplace else opt


def lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    mask: Optional[Mask] = None,
    *,
    inplace: bool = False,
) -> GradientTransformation:
    """Lion: ``p -= lr * (sign(b1 * mu + (1 - b1) * g) + weight_decay * p)``; ``mu = lerp(mu, g, 1 - b2)``.

    Args:
        learning_rate: a float, a schedule ``step -> lr``, or in pure mode a 0-dim
            floating-point tensor (differentiable).
        b1: interpolation for the sign.
        b2: decay of the momentum.
        weight_decay: decoupled weight decay.
        mask: which leaves to decay (see ``add_decayed_weights``).
        inplace: update state and the incoming gradients in place (no allocation).

    Returns:
        ``chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate)``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.lion(0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, _ = opt.update({"w": torch.tensor([2.0, -0.1])}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000,  0.1000])
    """
    who = "lion"
    learning_rate = _check_lr(learning_rate, who)
    weight_decay = _check_nonneg(weight_decay, "weight_decay", who)
    if inplace:
        _hyper.numbers_only(who, "inplace=True", learning_rate=learning_rate, b1=b1, b2=b2,
                            weight_decay=weight_decay)
    opt = chain(
        scale_by_lion(b1, b2, inplace=inplace),
        add_decayed_weights(weight_decay, mask, inplace=inplace),
        scale_by_learning_rate(learning_rate, inplace=inplace),
    )
    return _refusing_func(opt, who, False) if inplace else opt
