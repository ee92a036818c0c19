"""Learning-rate schedules: plain callables ``schedule(step: int) -> float``.

A schedule's values (``init_value``, ``peak_value``, ``end_value``, ``alpha``, ...) may be
0-dim floating-point tensors: the schedule then returns a 0-dim tensor computed from them
by torch ops, never reading them, so a derivative reaches them through an optimizer's
pure update ([Note: tensor hyperparameters] in ``_hyper.py``).

[Note: schedules in a graph]
Under ``torch.compile`` (``sf.jit``) a schedule is called with the step count as a 0-dim
int64 tensor, as optax calls its schedules with a traced count: Python branches or
``min`` / ``bisect`` on it would bake one step's value into the graph (a recompile per
step) or break it. The built-in schedules compute with torch ops on such a step (clamp,
cos, where; float64, the same IEEE operations as the Python floats: the values are equal
bit for bit, tested) and return a 0-dim float64 tensor; given an int they return a float,
as before. A schedule of your own works in a graph when written the same way.

``step`` is the number of updates already done, so the first update uses
``schedule(0)``. That matches ``torch.optim.lr_scheduler`` used the usual way
(``optimizer.step()`` then ``scheduler.step()``): the k-th ``optimizer.step()``
(counting from 0) runs with the scheduler's value at epoch k.

PyTorch equivalents (``base`` = the optimizer's ``lr``):

- ``LambdaLR(opt, f)``                        = ``lambda k: base * f(k)``
- ``LinearLR(opt, s, e, total_iters=T)``      = ``linear_schedule(base * s, base * e, T)``
- ``CosineAnnealingLR(opt, T_max, eta_min)``  = ``cosine_decay_schedule(base, T_max, alpha=eta_min / base)``
  (for ``k <= T_max``; torch's restarts upward after ``T_max``, ours stays at ``eta_min``)
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Sequence

import torch

from . import _hyper

Schedule = Callable[[int], float]


def _clamp(step, low: int, high: int):
    """``min(max(step, low), high)`` of an int, or of a 0-dim int tensor as float64."""
    if isinstance(step, torch.Tensor):
        return step.clamp(low, high).to(torch.float64)
    return min(max(step, low), high)


def _cos(x):
    return torch.cos(x) if isinstance(x, torch.Tensor) else math.cos(x)


def _float64(x, like: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64) if isinstance(x, torch.Tensor) else torch.full((), x, dtype=torch.float64,
                                                                               device=like.device)


def constant_schedule(value: float) -> Schedule:
    """A schedule that always returns ``value``.

    Args:
        value: the value at every step.

    Returns:
        ``schedule(step) -> float``.

    Example:
        >>> from shardfn.optim import constant_schedule
        >>> constant_schedule(0.1)(1000)
        0.1
    """
    value = _hyper.check(value, "value", "constant_schedule")

    def schedule(step: int) -> float:
        del step
        return value

    return schedule


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """Go linearly from ``init_value`` to ``end_value`` over ``transition_steps`` steps, then stay.

    Args:
        init_value: the value up to (and at) step ``transition_begin``.
        end_value: the value from step ``transition_begin + transition_steps`` on.
        transition_steps: length of the ramp; ``<= 0`` means ``init_value`` forever.
        transition_begin: steps to hold ``init_value`` before the ramp starts.

    Returns:
        ``schedule(step) -> float``.

    Example:
        >>> from shardfn.optim import linear_schedule
        >>> s = linear_schedule(0.0, 1.0, 4)
        >>> [s(k) for k in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    if transition_steps <= 0:
        return constant_schedule(init_value)
    init_value = _hyper.check(init_value, "init_value", "linear_schedule")
    end_value = _hyper.check(end_value, "end_value", "linear_schedule")

    def schedule(step: int) -> float:  # [Note: schedules in a graph]
        frac = _clamp(step - transition_begin, 0, transition_steps) / transition_steps
        return init_value + (end_value - init_value) * frac

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``, then stay.

    ``value(k) = init_value * ((1 - alpha) * c(k) ** exponent + alpha)`` with
    ``c(k) = (1 + cos(pi * min(k, decay_steps) / decay_steps)) / 2``.

    Args:
        init_value: the value at step 0.
        decay_steps: steps to reach the final value (must be positive).
        alpha: the final value as a fraction of ``init_value``.
        exponent: power applied to the cosine factor.

    Returns:
        ``schedule(step) -> float``.

    Example:
        >>> from shardfn.optim import cosine_decay_schedule
        >>> s = cosine_decay_schedule(1.0, 10, alpha=0.1)
        >>> s(0), round(s(5), 6), s(10), s(99)
        (1.0, 0.55, 0.1, 0.1)
    """
    if decay_steps <= 0:
        raise ValueError(f"cosine_decay_schedule: decay_steps must be positive, got {decay_steps}.")
    init_value = _hyper.check(init_value, "init_value", "cosine_decay_schedule")
    alpha = _hyper.check(alpha, "alpha", "cosine_decay_schedule")

    def schedule(step: int) -> float:  # [Note: schedules in a graph]
        k = _clamp(step, 0, decay_steps)
        cosine = 0.5 * (1.0 + _cos(math.pi * k / decay_steps))
        return init_value * ((1.0 - alpha) * cosine**exponent + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules[i]`` between ``boundaries[i-1]`` and ``boundaries[i]``, each from its own step 0.

    Args:
        schedules: ``len(boundaries) + 1`` schedules.
        boundaries: increasing step numbers where the next schedule takes over.

    Returns:
        ``schedule(step) -> float``.

    Example:
        >>> from shardfn.optim import join_schedules, constant_schedule, linear_schedule
        >>> s = join_schedules([constant_schedule(1.0), linear_schedule(1.0, 0.0, 2)], [3])
        >>> [s(k) for k in range(6)]
        [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    schedules, boundaries = list(schedules), [int(b) for b in boundaries]
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join_schedules: {len(schedules)} schedules need {len(schedules) - 1} "
            f"boundaries, got {len(boundaries)}."
        )
    if any(b1 > b2 for b1, b2 in zip(boundaries, boundaries[1:])):
        raise ValueError(f"join_schedules: boundaries must increase, got {boundaries}.")

    def schedule(step: int) -> float:
        if isinstance(step, torch.Tensor):  # [Note: schedules in a graph]: every piece, then select
            value = _float64(schedules[0](step), step)
            for boundary, piece in zip(boundaries, schedules[1:]):
                value = torch.where(step >= boundary, _float64(piece(step - boundary), step), value)
            return value
        i = bisect.bisect_right(boundaries, step)
        start = boundaries[i - 1] if i > 0 else 0
        return schedules[i](step - start)

    return schedule


def linear_warmup(peak_value: float, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Ramp linearly from ``init_value`` to ``peak_value`` over ``warmup_steps``, then hold it.

    Args:
        peak_value: the value from step ``warmup_steps`` on.
        warmup_steps: length of the ramp.
        init_value: the value at step 0.

    Returns:
        ``schedule(step) -> float`` (``linear_schedule(init_value, peak_value, warmup_steps)``).

    Example:
        >>> from shardfn.optim import linear_warmup
        >>> s = linear_warmup(1.0, 4)
        >>> [s(k) for k in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    return linear_schedule(init_value, peak_value, warmup_steps)


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    Same arguments and values as ``optax.warmup_cosine_decay_schedule``: ``decay_steps``
    counts the warmup too, so the value reaches ``end_value`` at step ``decay_steps``.
    In PyTorch terms: ``SequentialLR([LinearLR(init/peak, 1, warmup_steps),
    CosineAnnealingLR(decay_steps - warmup_steps, end_value)], [warmup_steps])``.

    Args:
        init_value: the value at step 0.
        peak_value: the value at step ``warmup_steps``.
        warmup_steps: length of the linear warmup.
        decay_steps: step at which ``end_value`` is reached (warmup included).
        end_value: the final value.
        exponent: power applied to the cosine factor.

    Returns:
        ``schedule(step) -> float``.

    Raises:
        ValueError: if ``decay_steps <= warmup_steps``.

    Example:
        >>> from shardfn.optim import warmup_cosine_decay_schedule
        >>> s = warmup_cosine_decay_schedule(0.0, 1.0, 2, 6)
        >>> [round(s(k), 4) for k in range(8)]
        [0.0, 0.5, 1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    if decay_steps <= warmup_steps:
        raise ValueError(
            "warmup_cosine_decay_schedule: decay_steps (which includes the warmup) must "
            f"exceed warmup_steps, got decay_steps={decay_steps}, warmup_steps={warmup_steps}."
        )
    who = "warmup_cosine_decay_schedule"
    init_value, peak_value, end_value = (_hyper.check(v, name, who) for v, name in (
        (init_value, "init_value"), (peak_value, "peak_value"), (end_value, "end_value")))
    if _hyper.is_tensor(peak_value):  # 0 where peak_value is 0, without reading it (nor dividing by 0)
        zero = peak_value == 0
        alpha = torch.where(zero, 0.0, end_value / torch.where(zero, 1.0, peak_value))
    else:
        alpha = 0.0 if peak_value == 0 else end_value / peak_value
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent),
        ],
        [warmup_steps],
    )
