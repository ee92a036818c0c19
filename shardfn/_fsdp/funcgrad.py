"""`torch.func.grad(step)` of a whole shard step, on the fast path of `Shard.grad_and_value`.

[Note: torch.func.grad of a whole step]
`torch.func.grad_and_value(step)(shards, batch)`, the loop the docs teach, differentiates
the step at a functorch grad level. Run as is, three costs come with it that
`sf.train_step` (`Shard.grad_and_value`, eager autograd) does not pay:
- functorch differentiates with `torch.autograd.grad(..., create_graph=True)`, so the
  backward records a graph of its own: the activations' gradients stay alive until the
  step's gradients are returned (GPT 4L d256, 8 x 128 tokens per rank: peak 194 MB
  against 99 MB), and every backward op makes an autograd node;
- every op of the forward and backward goes through functorch's wrapping, and each of
  shard's autograd Functions through its Python machinery for custom Functions (2.3x the
  Python calls of the step: 46.8k against 20.2k);
- each unit's reduce-scatter is waited inside its backward (StepMode.EAGER): nothing
  overlaps it ([Note: deferred reductions] in reducer.py needs the gradients to be
  autograd outputs that nothing reads before the backward ends).
When the step is the only transform running, its gradient is a plain function of the
shards: `StepGrad` computes it in its forward, with `Shard.grad_and_value` on the
unwrapped tensors (below the grad level, as functorch runs a custom Function's forward),
returns the loss, and its backward hands the gradients back scaled by the loss's
cotangent. The numbers are those of `Shard.grad_and_value`, equal to the wrapped path's.
Two consequences: the forward of `torch.func.vjp(step, ...)` runs the backward too (the
gradient is made with the loss), and the caller's TorchFunctionModes, which functorch
turns off inside a custom Function's forward, are entered again there (`_Call`).

`eligible` takes this path only where it is exact:
- the interpreter stack is one grad level (`grad`, `grad_and_value`, `vjp`): no `vmap`
  (ensembles, per-example gradients), `jvp` or outer `grad` (higher order) around it;
- every shard leaf is a tensor of that level, with no autograd history below it (no
  `loss.backward()` around the transform);
- no batch or extra argument is differentiated (`argnums` over the batch), no `has_aux`
  (an aux computed from the parameters could be differentiated by the caller), and the
  step is not inside `accumulate` (its own step modes);
- `loss_fn` reads no tensor of the grad level except through its arguments: run below
  that level, such a tensor (a closure set inside the transformed function) would get no
  gradient. A pure `loss_fn` never does; the first call of each step checks it
  (`_Captured`, a TorchFunctionMode) and raises a ShardingError if it does.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils import _pytree as pytree

from .. import _tree
from .._errors import ShardingError

__all__ = ["eligible", "grad_path", "wrapped"]

_functorch = torch._C._functorch
_local = threading.local()


@contextlib.contextmanager
def wrapped():
    """In this thread, run shard steps under `torch.func.grad` at the grad level (each op
    wrapped by functorch, reduce-scatters waited in the backward), as before this path
    existed: the reference the tests compare `StepGrad` with."""
    before = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = before


def eligible(step, mode, leaves, extra) -> bool:
    """Whether `step(shards, *extra)` may run as `StepGrad` ([Note: torch.func.grad of a
    whole step]): `mode` is the step's StepMode on this rank, `leaves` the shard leaves,
    `extra` the batch and the other arguments."""
    from .schedule import StepMode

    if step.config.has_aux or mode is not StepMode.EAGER or getattr(_local, "off", False):
        return False
    stack = _functorch.get_interpreter_stack()
    if not stack or len(stack) != 1 or stack[0].key() != torch._C._functorch.TransformType.Grad:
        return False
    level = stack[0].level()
    for x in leaves:
        if not isinstance(x, torch.Tensor) or _functorch.maybe_get_level(x) != level:
            return False
        if _functorch.get_unwrapped(x).requires_grad:  # autograd outside the transform
            return False
    return not any(isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves(extra))


def grad_path(step, shards, extra):
    """The loss of `step(shards, *extra)` as the output of a `StepGrad` node."""
    leaves, treedef = _tree.flatten(shards)
    rest, rest_spec = pytree.tree_flatten(extra)
    outs = StepGrad.apply(_Call(step, _get_current_function_mode_stack()), treedef, rest_spec, len(leaves),
                          *leaves, *rest)
    return outs[0]


class _Call:
    """The step and the TorchFunctionModes active around it (`with torch.device(...)`,
    sf.estimate's dry-run functions), which functorch turns off while it runs a custom
    Function's forward: StepGrad enters them again. One object, so that functorch's
    pytree handling of the Function's arguments does not walk the modes."""

    def __init__(self, step, modes):
        self.step, self.modes = step, list(modes)

    @contextlib.contextmanager
    def modes_on(self):
        with contextlib.ExitStack() as stack:
            if not _get_current_function_mode_stack():
                for mode in self.modes:
                    stack.enter_context(mode)
            yield


class StepGrad(torch.autograd.Function):
    """Shard leaves (and the batch) -> the step's loss, with its gradient computed in the
    forward by `Shard.grad_and_value`; outputs `(loss, *grads)`, the grads not
    differentiable. Backward: the grads times the loss's cotangent."""

    @staticmethod
    def forward(call, treedef, rest_spec, n: int, *args):
        step = call.step
        shards = _tree.unflatten(treedef, list(args[:n]))
        extra = pytree.tree_unflatten(list(args[n:]), rest_spec)
        with call.modes_on(), _Captured.first_call(step):
            grads, loss = step._grad_and_value(shards, *extra, where="shard: torch.func.grad(step)")
        step._funcgrad_checked = True  # checked once it ran through
        return (loss, *_tree.flatten(grads)[0])

    @staticmethod
    def setup_context(ctx, inputs, output):
        grads = output[1:]
        ctx.mark_non_differentiable(*grads)
        ctx.set_materialize_grads(False)  # no zeros for the grads' own (absent) cotangents
        ctx.save_for_backward(*grads)
        ctx.n, ctx.n_rest = inputs[3], len(inputs) - 4 - inputs[3]

    @staticmethod
    def backward(ctx, g, *_):
        grads = list(ctx.saved_tensors)
        if g is None:  # the loss itself was not used
            return (None,) * (4 + len(grads) + ctx.n_rest)
        floats = [i for i, x in enumerate(grads) if x.is_floating_point()]
        if _is_one(g):  # torch.func.grad's own cotangent: the grads as they are, no pass over them
            return (None, None, None, None, *[grads[i] if x.is_floating_point() else None for i, x in enumerate(grads)],
                    *([None] * ctx.n_rest))
        if not _functorch.is_functorch_wrapped_tensor(g) and all(grads[i].dtype == g.dtype for i in floats):
            scaled = torch._foreach_mul([grads[i] for i in floats], g)  # one op for all leaves
        else:  # a batched cotangent (jacrev), or dtypes to promote
            scaled = [(grads[i] * g).to(grads[i].dtype) for i in floats]
        out = [None] * len(grads)
        for i, x in zip(floats, scaled):
            out[i] = x
        return (None, None, None, None, *out, *([None] * ctx.n_rest))


def _is_one(g: torch.Tensor) -> bool:
    """Whether the loss's cotangent is the scalar 1 (`grad` / `grad_and_value` pass
    `ones_like(loss)`): read on the CPU only (on an accelerator the read would be a host
    sync each step, and the multiply it saves is cheap there)."""
    return (g.device.type == "cpu" and g.dim() == 0 and not _functorch.is_functorch_wrapped_tensor(g)
            and bool(g == 1))


class _Captured(TorchFunctionMode):
    """Raises if a differentiable functorch-wrapped tensor reaches a torch function below
    the grad level (`loss_fn` closing over a tensor of the transform, which would get no
    gradient; a constant one, e.g. an index made inside the transform, is harmless)."""

    @classmethod
    def first_call(cls, step):
        return _nothing() if getattr(step, "_funcgrad_checked", False) else cls()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():  # a compiled block: not traced into its graph
            return func(*args, **kwargs)
        for x in pytree.tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor) and _functorch.is_functorch_wrapped_tensor(x) and x.requires_grad:
                raise ShardingError(
                    f"shard: under torch.func.grad(step), loss_fn used a tensor of the transform that is not "
                    f"one of its arguments ({getattr(func, '__name__', func)} got a tensor of shape "
                    f"{tuple(x.shape)} from the transformed function, e.g. through a closure or a global). "
                    f"shard differentiates the step below the transform ([Note: torch.func.grad of a whole "
                    f"step] in shardfn/_fsdp/funcgrad.py), where that tensor would get no gradient.\nFix: pass "
                    f"it to the step as part of the batch (step(shards, (x, y, that_tensor)))."
                )
        return func(*args, **kwargs)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
