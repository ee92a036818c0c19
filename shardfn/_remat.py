"""`sf.remat(fn, policy=...)`: rematerialization (JAX's `jax.checkpoint`) that works under
`torch.func` and inside `sf.shard`.

The forward of `remat(fn)` keeps only `fn`'s inputs and what the policy saves; the
backward runs `fn` again and differentiates that run. Policies (`sf.remat_policies`):
`nothing_saveable`, `everything_saveable` (no remat), `dots_saveable` (matmul outputs),
`save_only_these_names(*names)` with `sf.tag(x, name)` inside `fn`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import types
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _tree
from . import _vma
from ._binding import current_binding
from ._errors import SpecError
from ._params_view import materialize, together
from ._remat_state import Recompute, Trace, Tracker, check_outputs, fingerprint, is_unrecorded, nested

__all__ = ["remat", "tag", "Policy", "policies"]

# [Note: remat under torch.func]
# torch.utils.checkpoint relies on saved-tensor hooks, which torch.func refuses
# (pytorch#122729). remat is one autograd.Function instead (`_Remat`): its forward runs
# `fn` without autograd and keeps only the inputs (plus what the policy saves); its
# backward runs `fn` again under `torch.func.vjp` on the saved inputs and pulls the
# cotangents through that run. `jvp` and `vmap` rules come the same way (forward mode on
# the inputs; functorch's generated vmap rule). Inside `sf.shard` the inputs include a
# unit's gathered parameters: views of the unit's buffer, whose storage is freed after the
# forward and re-gathered before the unit's backward ([Note: backward order] in
# _fsdp/runtime.py) — the remat node of a block is created after its unit's gather node and
# before the next unit's, so its backward runs while the unit is gathered again: no second
# copy and no extra all-gather.

# [Note: saving by the policy]
# A dispatch mode (`_Record`) sits below autograd during the no-grad forward and numbers
# every aten op; the outputs of the ops the policy saves (its `ops`, or the op that made a
# tensor passed to `sf.tag` with a saved name) are kept. During the recompute a second mode
# (`_Replay`) hands those outputs back for the ops with the same number and name instead of
# running them; autograd, above the mode, still records the op, so the graph is the same
# and its backward is exact. Only ops that neither mutate nor alias are kept, and a kept
# output that was modified in place later in the forward is dropped. Should the recompute's
# aten op sequence differ from the forward's (a recompute runs under `torch.func.vjp`,
# where functorch implements dropout with other ops), replay stops and the rest is
# computed. That the recompute is the forward again is checked a level up, on the torch
# calls ([Note: a recompute must be its forward] in _remat_state.py). This is the
# mechanism of PyTorch's selective activation checkpointing.

# [Note: randomness in remat]
# The recompute must draw the same random numbers as the forward (dropout). remat records
# the state of every `torch.Generator` among `fn`'s arguments and of the default generator
# of CPU and of the inputs' accelerator, and restores them for the recompute (the caller's
# generators are then put back where the forward left them). On the simulated mesh the
# default generator is shared by all rank threads, so only explicit generators replay
# reliably there: pass one (JAX-style explicit keys).

_aten = torch.ops.aten
_DOTS = frozenset(op for op in (getattr(_aten, name, None) for name in (  # the ones this torch has
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "dot", "mv", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention")) if op is not None)


@dataclasses.dataclass(frozen=True)
class Policy:
    """What remat's forward keeps for the backward (everything else is recomputed)."""

    name: str
    ops: frozenset = frozenset()  # aten overload packets whose outputs are kept
    names: frozenset = frozenset()  # sf.tag names whose values are kept
    everything: bool = False  # keep everything: no rematerialization

    def __repr__(self):
        return f"remat_policies.{self.name}"

    # `ops` as the OpOverloads torch's selective checkpoint takes ([Note: remat under sf.jit]),
    # listed when the policy is made: dynamo cannot list an op's overloads while tracing
    overloads: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        object.__setattr__(self, "overloads", tuple(getattr(p, name) for p in self.ops for name in p.overloads()))


def save_only_these_names(*names: str) -> Policy:
    """Keep the values tagged with one of `names` (`sf.tag(x, name)` inside `fn`)."""
    if not names or not all(isinstance(n, str) for n in names):
        raise SpecError(f"save_only_these_names takes one or more strings, got {names!r}")
    return Policy(f"save_only_these_names{names!r}", names=frozenset(names))


policies = types.SimpleNamespace(
    nothing_saveable=Policy("nothing_saveable"),
    everything_saveable=Policy("everything_saveable", everything=True),
    dots_saveable=Policy("dots_saveable", ops=_DOTS),
    save_only_these_names=save_only_these_names,
)

_local = threading.local()  # the _Record mode of the innermost remat forward on this thread


def tag(x: torch.Tensor, name: str) -> torch.Tensor:
    """Name an intermediate value of a remat'd function, for `save_only_these_names`.

    Returns `x` itself; outside remat it does nothing. Tag the result of a computation
    (a matmul, an activation), not a view of one.
    """
    if not isinstance(name, str):
        raise SpecError(f"sf.tag(x, name): name must be a string, got {name!r}")
    recorder = getattr(_local, "recorder", None)
    if recorder is not None and isinstance(x, torch.Tensor):
        with torch._C.DisableTorchFunction():  # bookkeeping, not calls of fn's ([Note: a recompute must be its forward])
            recorder.tagged(x, name)
    return x


def _plain(t: torch.Tensor) -> torch.Tensor:
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def _key(t: torch.Tensor):
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _cacheable(func) -> bool:
    schema = func._schema
    return not schema.is_mutable and not any(r.alias_info is not None for r in schema.returns)


class _Record(TorchDispatchMode):
    """Forward: number the ops, keep the outputs the policy saves. [Note: saving by the policy]"""

    def __init__(self, policy: Policy, tracker: Tracker):
        super().__init__()
        self.policy = policy
        self.tracker = tracker  # state the forward writes ([Note: state in remat])
        self.index = 0
        self.names: list = []  # per op: its overload, in order
        self.kept: dict[int, tuple[Any, list[int]]] = {}  # op index -> (outputs, their versions)
        self.made: dict[tuple, tuple[int, Any, int]] = {}  # tensor key -> (op index, outputs, version)
        self.tags: dict[int, str] = {}  # op index -> tag name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_unrecorded():
            return func(*args, **kwargs)
        self.tracker.before(func, args, kwargs)
        out = func(*args, **kwargs)
        self.tracker.after(func, out)
        i, self.index = self.index, self.index + 1
        self.names.append(func)
        if _cacheable(func):
            tensors = [t for t in _tree.flatten(out)[0] if isinstance(t, torch.Tensor)]
            versions = [t._version for t in tensors]
            if func.overloadpacket in self.policy.ops:
                self.kept[i] = (out, versions)
            elif self.policy.names:
                for t, v in zip(tensors, versions):
                    if t.device.type != "meta" and t.untyped_storage().nbytes():
                        self.made[_key(t)] = (i, out, v)
        return out

    def tagged(self, x: torch.Tensor, name: str) -> None:
        if name not in self.policy.names:
            return
        t = _plain(x)
        found = self.made.get(_key(t)) if t.untyped_storage().nbytes() else None
        if found is not None and found[2] == t._version:
            i, out, _ = found
            outs = [u for u in _tree.flatten(out)[0] if isinstance(u, torch.Tensor)]
            self.kept[i] = (out, [u._version for u in outs])
            self.tags[i] = name

    def finish(self) -> dict[int, Any]:
        """The kept outputs still as the ops made them (none modified in place later)."""
        self.made.clear()
        kept = {}
        for i, (out, versions) in self.kept.items():
            tensors = [t for t in _tree.flatten(out)[0] if isinstance(t, torch.Tensor)]
            if [t._version for t in tensors] == versions:
                kept[i] = out
        return kept


class _Replay(TorchDispatchMode):
    """Recompute: hand back the kept outputs of the ops with the same number and overload."""

    def __init__(self, names: list, kept: dict[int, Any]):
        super().__init__()
        self.names, self.kept = names, kept
        self.index = 0
        self.in_step = True  # False once the op sequence diverges: compute the rest

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_unrecorded():
            return func(*args, **(kwargs or {}))
        i, self.index = self.index, self.index + 1
        if self.in_step and (i >= len(self.names) or self.names[i] is not func):
            self.in_step = False
        if self.in_step and i in self.kept:
            return self.kept[i]
        return func(*args, **(kwargs or {}))


# [Note: modes around a remat call]
# torch drops the torch-function modes of the caller inside an autograd.Function: its
# backward runs with none (the engine does not carry them), and under `torch.func` its
# forward too (torch 2.13). A mode around `remat(fn)` would then see `fn`'s calls without
# remat and not with it: `sf.estimate`'s `MetaFunctions`, which counts attention as the
# fused kernel the device runs, missed the recompute's attention, and the dry run of a
# remat'd transformers model counted its (B, H, T, T) math-path scores (+28% on a tiny
# Llama). A mode whose meaning is the same at every level of a transform says so with a
# class attribute `inside_remat = True` (MetaFunctions does); a _Call keeps those active
# when it is called and enters again the ones missing around the forward and the
# recompute. Others are not carried: shard's check under `torch.func.grad(step)`
# (funcgrad.py) reads the transform level it was entered at, and remat's own recording
# modes follow their own depth ([Note: a recompute must be its forward]).


def _caller_modes() -> list:
    return [m for m in torch.overrides._get_current_function_mode_stack() if getattr(m, "inside_remat", False)]


@contextlib.contextmanager
def _modes(modes: list):
    active = {id(m) for m in torch.overrides._get_current_function_mode_stack()}
    with contextlib.ExitStack() as stack:
        for m in modes:
            if id(m) not in active:
                stack.enter_context(m)
        yield


# [Note: outputs that are inputs]
# A block may return one of its inputs as it is: a T5 layer hands the `position_bias` it
# was given on to the next layer, a block returns its attention mask. An autograd.Function
# cannot ("An input that has been returned as-is as output is being saved for backward"),
# and it would gain nothing: the output's gradient is the input's. So the forward notes
# which outputs are inputs (by identity, on the first call), the Function returns the
# computed ones only (the recompute too, so the vjp's cotangents line up), and the caller
# gets its own tensors back at those positions: their gradient flows past remat, exactly.


# [Note: no tensors in a _Call]
# A _Call lives in its _Remat node's ctx, and the Function's outputs are the very tensors
# `fn` returned, now carrying that node as grad_fn. Keeping them (or the inputs, gathered
# parameters whose nodes hold shard's step state) in the _Call made cycles through the C++
# autograd graph that Python's collector cannot break: each step, mesh and its gloo groups
# outlived their last reference. So the _Call holds the non-tensor leaves only; the inputs
# are the ctx's saved tensors and the outputs are the caller's.


def _static(leaves: list) -> list:
    """`leaves` with each tensor replaced by None ([Note: no tensors in a _Call])."""
    return [None if isinstance(x, torch.Tensor) else x for x in leaves]


class _Call:
    """One call of a remat'd function: what its Function needs, in a plain object (functorch
    rebuilds dicts passed to `Function.apply`)."""

    def __init__(self, fn, policy, offload_to, treedef, leaves, slots):
        self.fn, self.policy, self.offload_to = fn, policy, offload_to
        self.name = _name(fn)
        self.treedef, self.slots = treedef, slots  # slots: positions of tensor leaves
        self.binding = current_binding()
        self.modes = _caller_modes()  # [Note: modes around a remat call]
        self.types = _vma.current()  # a typed shard_map body: its inputs' types, for the recompute
        self.vmas = [_vma.vma(leaves[i], self.types) for i in slots]
        self.leaves = _static(leaves)  # the tensors come with each call ([Note: no tensors in a _Call])
        self.out_vmas: list = []
        self.out_treedef = None
        self.out_static: list = []  # non-tensor outputs, by position
        self.out_slots: list[int] = []  # positions of the computed tensor outputs
        self.out_inputs: dict[int, int] = {}  # position of an output that is an input -> that input's
        self.names: list = []
        self.calls: list = []  # the forward's torch calls and their outputs' signatures
        self.kept: dict[int, Any] = {}
        self.kept_versions: dict[int, list[int]] = {}  # kept op index -> its tensors' versions after the forward
        self.devices: dict[int, torch.device] = {}  # kept op index -> device before offload
        self.rng: dict = {}
        self.snapshots: dict = {}  # state the forward wrote: storage -> (tensor, value before) [Note: state in remat]
        self.prints: list | None = None  # the forward's outputs, summed [Note: a recompute must be its forward]

    def call(self, tensors):
        leaves = list(self.leaves)
        for slot, t, v in zip(self.slots, tensors, self.vmas):
            leaves[slot] = _vma.tag(t, v, self.types) if self.types is not None else t
        args, kwargs = _tree.unflatten(self.treedef, leaves)
        out = self.fn(*args, **kwargs)
        if self.out_treedef is None:  # the forward: which outputs are inputs ([Note: outputs that are inputs])
            self._find_outputs(out, [leaves[slot] for slot in self.slots])
        return out

    def rerun(self, inputs, wrt: list[int], replay=None):
        """`fn` again as a function of the inputs at positions `wrt` (the others fixed), with
        flat tensor outputs: what the backward and jvp differentiate. It must make the
        forward's torch calls ([Note: a recompute must be its forward]) and sees the state
        the forward wrote as it was before the forward ([Note: state in remat]); `replay`, a
        `_Replay`, hands back the values the policy kept."""
        def run(*diff):
            full = list(inputs)
            for i, t in zip(wrt, diff):
                full[i] = t
            recompute = Recompute(self.name, self.calls, self.snapshots)  # its scratch copies: not replayed ops
            with recompute, replay if replay is not None else contextlib.nullcontext():
                out = self.call(full)
            recompute.finish()
            return self.flat_outputs(out)

        return run

    def _find_outputs(self, out, inputs: list) -> None:
        leaves, self.out_treedef = _tree.flatten(out)
        self.out_static = _static(leaves)
        position = {id(t): k for k, t in enumerate(inputs)}
        tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.out_inputs = {i: position[id(leaves[i])] for i in tensors if id(leaves[i]) in position}
        self.out_slots = [i for i in tensors if i not in self.out_inputs]
        self.out_vmas = [_vma.vma(leaves[i], self.types) for i in self.out_slots]

    def flat_outputs(self, out) -> tuple:
        """The tensors `fn` computed among its outputs, in order: not those that are its
        inputs returned as they are ([Note: outputs that are inputs])."""
        leaves, _ = _tree.flatten(out)
        return tuple(leaves[i] for i in self.out_slots)

    def unflatten_outputs(self, tensors, inputs: list):
        """`fn`'s output: `tensors` the computed ones, `inputs` the caller's tensors (those
        returned as they are)."""
        leaves = list(self.out_static)
        for slot, t in zip(self.out_slots, tensors):
            leaves[slot] = t
        for slot, k in self.out_inputs.items():
            leaves[slot] = inputs[k]
        return _tree.unflatten(self.out_treedef, leaves)

    # -- randomness ([Note: randomness in remat]) -------------------------------------------
    def save_rng(self, tensors) -> None:
        devices = sorted({t.device for t in tensors if t.device.type not in ("cpu", "meta")}, key=str)
        self.rng = {
            "generators": [(g, g.get_state()) for g in self.leaves if isinstance(g, torch.Generator)],
            "cpu": torch.get_rng_state(),
            "devices": [(d, torch.get_device_module(d).get_rng_state(d)) for d in devices],
        }

    def replaying_rng(self):
        rng = self.rng
        return _RngReplay(rng["generators"], rng["cpu"], rng["devices"])


class _RngReplay:
    def __init__(self, generators, cpu_state, device_states):
        self.generators, self.cpu_state, self.device_states = generators, cpu_state, device_states

    def __enter__(self):
        self.after = [(g, g.get_state()) for g, _ in self.generators]
        self.saved_cpu = torch.get_rng_state()
        self.saved_devices = [(d, torch.get_device_module(d).get_rng_state(d)) for d, _ in self.device_states]
        for g, state in self.generators:
            g.set_state(state)
        torch.set_rng_state(self.cpu_state)
        for d, state in self.device_states:
            torch.get_device_module(d).set_rng_state(state, d)

    def __exit__(self, *exc):
        for g, state in self.after:
            g.set_state(state)
        torch.set_rng_state(self.saved_cpu)
        for d, state in self.saved_devices:
            torch.get_device_module(d).set_rng_state(state, d)


class _Remat(torch.autograd.Function):
    """`fn`'s outputs, keeping only its inputs (and the policy's saves) for the backward.
    [Note: remat under torch.func]"""

    generate_vmap_rule = True

    @staticmethod
    def forward(call: _Call, *tensors):
        call.save_rng(tensors)
        recorder = _Record(call.policy, Tracker(call.name, [_plain(t) for t in tensors]))
        trace = Trace()
        previous = getattr(_local, "recorder", None)
        _local.recorder = recorder
        try:
            with _modes(call.modes), torch.no_grad(), trace, recorder:
                out = call.call(tensors)
        finally:
            _local.recorder = previous
        call.calls = trace.calls
        call.names, call.kept = recorder.names, recorder.finish()
        call.snapshots = recorder.tracker.snapshots
        if call.offload_to is not None:
            with torch._C._DisableFuncTorch(), torch.no_grad():
                call.kept = {i: _tree.tree_map(lambda t: _offload(t, call, i), out) for i, out in call.kept.items()}
        call.kept_versions = {i: _versions(out) for i, out in call.kept.items()}  # [Note: kept values written later]
        flat = call.flat_outputs(out)
        call.prints = fingerprint(flat)
        return flat

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.call = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.save_for_forward(*inputs[1:])

    @staticmethod
    def backward(ctx, *grads):
        call: _Call = ctx.call
        inputs = ctx.saved_tensors
        needed = ctx.needs_input_grad[1:]  # differentiate only what the caller asks for
        wrt = [i for i, t in enumerate(inputs) if needed[i] and (t.is_floating_point() or t.is_complex())]
        kept = {i: out for i, out in call.kept.items() if _versions(out) == call.kept_versions[i]}
        if call.offload_to is not None:  # back where they were made (plain: replay hands out plain tensors)
            with torch._C._DisableFuncTorch(), torch.no_grad():
                kept = {i: _tree.tree_map(lambda t: _move(t, call.devices.get(i)), out) for i, out in kept.items()}
        replay = _Replay(call.names, kept)
        rerun = call.rerun(inputs, wrt, replay)
        with _modes(call.modes), call.replaying_rng(), call.binding or contextlib.nullcontext():
            outs, pullback = torch.func.vjp(rerun, *[inputs[i] for i in wrt])
        check_outputs(call.name, call.prints, outs)
        partial = pullback(tuple(grads))
        out = [None] * len(inputs)
        for i, g in zip(wrt, partial):
            out[i] = g
        return (None, *out)

    @staticmethod
    def jvp(ctx, _call, *tangents):
        call: _Call = ctx.call
        inputs = ctx.saved_tensors
        wrt = [i for i, t in enumerate(inputs) if t.is_floating_point() or t.is_complex()]
        rerun = call.rerun(inputs, wrt)
        primals = [inputs[i] for i in wrt]
        tans = [tangents[i] if tangents[i] is not None else torch.zeros_like(inputs[i]) for i in wrt]
        with _modes(call.modes), call.replaying_rng(), call.binding or contextlib.nullcontext():
            outs, out = torch.func.jvp(rerun, tuple(primals), tuple(tans))
        check_outputs(call.name, call.prints, outs)
        return out


# [Note: kept values written later]
# A value the policy keeps may be one of `fn`'s outputs (a block that ends in a matmul,
# under dots_saveable), and the caller may write that output in place after the call, as
# plain PyTorch allows when nothing saved it. The kept tensor is the same tensor, so it
# changes too; handed back to the recompute, it would make the recompute another
# computation (a SpecError from the output check on the CPU, wrong gradients where that
# check cannot read the values). The versions of the kept tensors are taken when the
# forward ends (after any offload) and compared in the backward: a kept value written
# since is recomputed instead of handed back.


def _versions(out) -> list[int]:
    return [t._version for t in _tree.flatten(out)[0] if isinstance(t, torch.Tensor)]


def _name(fn) -> str:
    """How errors name a remat'd function."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return name if name.startswith("block ") else f"function {name!r}"


def _offload(t, call: _Call, i: int):
    if not isinstance(t, torch.Tensor):
        return t
    call.devices[i] = t.device
    return _move(t, call.offload_to)


def _move(t, device):
    return t.to(device) if isinstance(t, torch.Tensor) and device is not None else t


def _functorch_assert(name: str, e: Exception) -> str:
    return (
        f"sf.remat: torch's functorch failed an internal assertion inside {name} under a torch.func transform "
        f"({str(e).splitlines()[0][:120]}). Seen on torch 2.13 with vmap over the gradient of a block that masks "
        f"its attention with a boolean buffer (the examples' GPT without sdpa); the same block without sf.remat, "
        f"or with F.scaled_dot_product_attention, works.\nFix: drop sf.remat for this transform (e.g. "
        f"sf.functional(model) instead of sf.functional(model, remat=True) for per-example gradients), or use "
        f"scaled_dot_product_attention in the block."
    )


# [Note: remat under sf.jit]
# dynamo cannot trace `_Remat` (an autograd.Function holding a Python `_Call` and dispatch
# modes), but it traces `torch.utils.checkpoint` as one higher-order op whose region
# AOTAutograd's partitioner recomputes in the backward: the same rematerialization, done
# by the compiler. So under tracing (`sf.jit`, `torch.compile`) remat is that checkpoint,
# with the policy's saved ops as torch's selective-checkpoint policy (MUST_SAVE for them,
# PREFER_RECOMPUTE for the rest). The values are those of `fn` either way; what the graph
# keeps is the partitioner's choice. Policies by `sf.tag` name and `offload_to` have no
# form there and are refused before tracing goes on.


def _traced(fn, policy: Policy, offload, args, kwargs):
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if policy.names or offload is not None:
        raise SpecError(
            f"sf.remat({_name(fn)}) under sf.jit / torch.compile: the policy {policy!r}"
            f"{f' with offload_to={offload}' if offload is not None else ''} has no traced form (it keeps values by "
            f"sf.tag name or moves them between devices).\nFix: policy=sf.remat_policies.nothing_saveable or "
            f"dots_saveable under sf.jit, or train eagerly with sf.train_step(step, opt)."
        )
    if not policy.ops:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, list(policy.overloads)), **kwargs)


def remat(fn: Callable, *, policy: Policy = policies.nothing_saveable, offload_to=None) -> Callable:
    """Rematerialize `fn` in the backward instead of keeping its intermediate values.

    `remat(fn)(*args)` computes `fn(*args)`; for the backward it keeps only the tensors
    among `args` (and the values `policy` saves) and runs `fn` again, differentiating that
    run (JAX's `jax.checkpoint`). Gradients are those of `fn` itself: exact, since the same
    ops run on the same inputs (random draws replayed: [Note: randomness in remat]). It
    works under `torch.func.grad` / `vjp` / `jvp` / `vmap`, `loss.backward()`,
    `step.grad_and_value`, and inside `sf.shard`'s `loss_fn`, where a block's gathered
    parameters are re-gathered by shard's own schedule for the recompute.

    State: tensors `fn` writes without having created them (BatchNorm's running
    statistics, a static cache) are written once, by the forward; the recompute reads and
    writes scratch copies of their values from before the forward ([Note: state in
    remat]). State remat cannot copy (a transformers `DynamicCache`, a Python counter or
    list) must leave the recompute's torch calls, their result shapes and its outputs
    those of the forward, or a SpecError is raised ([Note: a recompute must be its
    forward]): remat never differentiates another computation silently.

    Args:
      fn: a function of tensors and other values (non-tensors are held as constants);
        returns a tensor or a pytree of them. Inside `sf.shard`, pass it the block's own
        parameters (`params["layers"][i]`), not the whole tree.
      policy: what to keep, from `sf.remat_policies`: `nothing_saveable` (default),
        `dots_saveable` (matmul and attention outputs), `save_only_these_names(*names)`
        (values marked with `sf.tag(x, name)` inside `fn`), `everything_saveable` (no
        remat).
      offload_to: a device (e.g. "cpu") to move the kept values to after the forward;
        they move back before the recompute.

    Returns:
      A function with `fn`'s signature.

    Raises:
      SpecError: for a bad `policy` / `offload_to`; in the forward, when `fn` writes one of
        its own tensor arguments in place; in the backward, when the recompute is not the
        forward again (state changed by the forward: a KV cache appended to, a counter),
        naming the function, the first differing call and the fix.

    Example:
      >>> import torch, shardfn as sf
      >>> w = torch.randn(4, 4, dtype=torch.float64)
      >>> x = torch.randn(3, 4, dtype=torch.float64)
      >>> block = lambda w, x: torch.tanh(x @ w)
      >>> loss = lambda w: sf.remat(block)(w, x).square().sum()
      >>> g = torch.func.grad(loss)(w)
      >>> torch.allclose(g, torch.func.grad(lambda w: block(w, x).square().sum())(w), rtol=0, atol=1e-12)
      True
    """
    if not callable(fn):
        raise SpecError(f"sf.remat: fn must be callable, got {fn!r:.60}")
    if not isinstance(policy, Policy):
        raise SpecError(
            f"sf.remat: policy must be one of sf.remat_policies (nothing_saveable, dots_saveable, "
            f"everything_saveable, save_only_these_names(...)), got {policy!r:.60}"
        )
    if offload_to is not None and not policy.names and not policy.ops:
        raise SpecError(f"sf.remat: offload_to={offload_to!r} moves the values the policy saves, and "
                        f"{policy!r} saves none.\nFix: use policy=sf.remat_policies.save_only_these_names(...).")
    offload = torch.device(offload_to) if offload_to is not None else None

    def wrapped(*args, **kwargs):
        if policy.everything:
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling():  # [Note: remat under sf.jit]
            return _traced(fn, policy, offload, args, kwargs)
        with together():  # a block's leaves may span units (frozen=, units=): read at once, none frees another
            leaves, treedef = _tree.flatten((materialize(args), materialize(kwargs)))
        slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        call = _Call(fn, policy, offload, treedef, leaves, slots)
        try:
            with nested():  # opaque to a remat around it ([Note: a recompute must be its forward])
                outs = _Remat.apply(call, *[leaves[i] for i in slots])
        except RuntimeError as e:
            if "INTERNAL ASSERT FAILED" in str(e) and "functorch" in str(e):
                raise SpecError(_functorch_assert(call.name, e)) from e
            raise
        if call.types is not None:  # the types the forward saw ([Note: varying axes])
            outs = tuple(_vma.tag(o, v, call.types) for o, v in zip(outs, call.out_vmas))
        return call.unflatten_outputs(outs, [leaves[i] for i in slots])

    wrapped.__wrapped__ = fn
    return wrapped
