"""`sf.functional(module)`: an nn.Module as a pure function of a parameter tree.

The tree follows the module tree (`params['transformer']['h'][3]['attn']['c_attn']['weight']`),
the first `nn.ModuleList` / `nn.Sequential` becoming a list, so `shard`'s default units are
its children. [Note: binding units around their own forward] `apply_fn` binds only the
root leaves when it enters the model, and binds each child of that first list around the
child's own forward call; under `shard` a unit is therefore gathered when its block runs,
not all at once.

[Note: a module copy per thread] `torch.func.functional_call` swaps module attributes in
place, which is not thread-safe: rank threads of a simulated mesh sharing one module would
mix each other's parameters. Each thread gets its own copy, whose parameters live on the
meta device (no memory; the real values always come from the tree). Ties survive the
copy, and buffers (persistent or not, e.g. rotary tables) are copied and used as they are;
those on the meta device (a module built there) are computed in the copy, on the device of
the parameters ([Note: computed buffers] in shardfn/_init/buffers.py).

Compiled blocks (`compile=`, or blocks compiled before the split) are in _compile.py:
[Note: compiled blocks]. A module wrapped by `torch.compile(module)` appears in the tree
as the module itself (no `_orig_mod` level), so a compiled model's tree and checkpoints
are the plain model's.
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Callable

import torch
from torch import nn

from ._compile import CompiledForward, OnRequest, compile_context, compile_options, not_traced
from ._errors import SpecError
from ._tree import keystr
from ._bind import Binding
from ._params_view import ParamsView, together
from ._init.buffers import fill_meta_buffers
from ._remat_state import unrecorded
from ._remat_modules import checkpointing, takes_use_cache, turn_off_checkpointing, without_cache

__all__ = ["functional"]


def _walk(module: nn.Module, path: tuple, name: str, seen: set[int], leaves: list, children: dict):
    """Build the params tree of `module`; record (tree path, dotted name) of every leaf and
    the dotted module name of every child of a list container."""
    if _is_optimized(module):  # torch.compile(module): the tree skips its `_orig_mod` level
        return _walk(module._orig_mod, path, f"{name}._orig_mod" if name else "_orig_mod", seen, leaves, children)
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        node = []
        for i, (child_name, child) in enumerate(module.named_children()):
            child_dotted = f"{name}.{child_name}" if name else child_name
            children[path + (i,)] = child_dotted
            node.append(_walk(child, path + (i,), child_dotted, seen, leaves, children))
        return node
    node: dict = {}
    for pname, p in module.named_parameters(recurse=False):
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            node[pname] = p.detach()
            leaves.append((path + (pname,), f"{name}.{pname}" if name else pname))
    for child_name, child in module.named_children():
        sub = _walk(child, path + (child_name,), f"{name}.{child_name}" if name else child_name, seen, leaves, children)
        if sub or isinstance(sub, list):
            node[child_name] = sub
    return node


def _get(tree, path):
    """The leaf of `tree` at `path`; a SpecError naming the path if the tree has none there."""
    if isinstance(tree, ParamsView):  # a shard step's view: straight to the leaf
        leaf = tree.find(path)
        if leaf is not None:
            return leaf
    node = tree
    for depth, key in enumerate(path):
        if not _has(node, key):
            raise SpecError(_not_this_model(tree, path, depth, node))
        node = node[key]
    return node


def _has(node, key) -> bool:
    """`node[key]` exists (checked before indexing: indexing a params view gathers leaves)."""
    if isinstance(node, Mapping):
        return key in node
    if isinstance(node, Sequence) and not isinstance(node, str):
        return isinstance(key, int) and -len(node) <= key < len(node)
    return False


def _not_this_model(tree, path: tuple, depth: int, node) -> str:
    """The message of `_get` when `tree` has no entry `path[depth]` (another model's params)."""
    if isinstance(node, Mapping):
        has = f"a dict with keys [{', '.join(sorted(map(repr, node)))}]"
    elif isinstance(node, Sequence) and not isinstance(node, str):
        has = f"a list of length {len(node)}"
    else:
        has = f"a {type(node).__name__}"
    top = f" (top level: [{', '.join(sorted(map(repr, tree)))}])" if depth and isinstance(tree, Mapping) else ""
    return (
        f"sf.functional: apply_fn needs params{keystr(path)}, but the params it was given have no "
        f"{path[depth]!r} at params{keystr(path[:depth])}: there they have {has}. These look like the params "
        f"of another model{top}.\nFix: pass the params that sf.functional(this model) returned "
        f"(apply_fn, params = sf.functional(model)), or step.shard_params(params) of them, to this apply_fn."
    )


def functional(module: nn.Module, *, remat=None, compile=None) -> tuple[Callable, dict]:
    """Split an `nn.Module` into `(apply_fn, params)`.

    Args:
      module: any module; its parameters become the tree, its buffers stay on it.
      remat: a policy from `sf.remat_policies` (or True for `nothing_saveable`): each child
        of the first `ModuleList` / `Sequential` (the blocks, shard's default units) runs
        under `sf.remat` with it, so its activations are recomputed in the backward.
        transformers models then run with `use_cache=False` while gradients are recorded,
        as under Hugging Face's gradient checkpointing ([Note: transformers under remat]);
        a model on which `gradient_checkpointing_enable()` was called gets `remat=True`
        (HF's `torch.utils.checkpoint` is turned off on shardfn's copies, not on `module`).
        Modules that write buffers (BatchNorm) update them once per forward, as without
        remat. docs/howto/remat.md has the details.
      compile: True, or a dict of `torch.compile` keyword arguments (`{"mode":
        "max-autotune", "fullgraph": True}`): the forward of each of those blocks is
        compiled, one graph per block (blocks of one class share it, across rank threads
        too), between its unit's all-gather and, in the backward, its reduce-scatter,
        which stay outside the graphs. Blocks compiled before the split
        (`torch.compile(block)`, `block.compile(...)`) are compiled the same way, with
        their own options, and so are the blocks of a module compiled as a whole
        (`torch.compile(model)`, with its options; the code around the blocks is left to
        torch.compile, which runs a forward that loops over its blocks eagerly). Under
        `torch.func` transforms the blocks run eagerly (torch does not run compiled code
        there). docs/howto/compile.md has the details.

    Returns:
      `apply_fn(params, *args, **kwargs)` calling the module's forward with those
      parameters, and `params`, a nested dict of detached parameter tensors following the
      module tree (lists for `ModuleList` / `Sequential`). Tied parameters appear once.

    Raises:
      SpecError: `module` is not an `nn.Module`; `remat=` (or Hugging Face gradient
        checkpointing) with `compile=`. `apply_fn` raises a SpecError naming the key path
        when its params lack one of the model's leaves (the params of another model), and
        when `use_cache=True` is passed with remat while gradients are recorded.

    Example:
      >>> import shardfn as sf, torch
      >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
      >>> apply_fn, params = sf.functional(net)
      >>> [sorted(p) for p in params]
      [['bias', 'weight'], [], ['bias', 'weight']]
      >>> apply_fn(params, torch.ones(5, 3)).shape
      torch.Size([5, 2])

      Compiled blocks (the first call compiles them: seconds to a minute):

      >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
      >>> apply_fn, params = sf.functional(net, compile={"backend": "aot_eager"})
      >>> apply_fn(params, torch.ones(5, 3)).shape
      torch.Size([5, 2])
    """
    if not isinstance(module, nn.Module):
        raise SpecError(_not_a_module(module))
    options = compile_options(compile)
    checkpointed = checkpointing(module)  # model.gradient_checkpointing_enable(): blocks under sf.remat instead
    if options is not None and checkpointed:
        raise SpecError(
            f"sf.functional: compile= on a model with Hugging Face gradient checkpointing on (e.g. "
            f"{checkpointed[0]!r}): shardfn would recompute the blocks with sf.remat, which does not run "
            f"compiled code.\nFix: model.gradient_checkpointing_disable() before sf.functional(model, compile=...), "
            f"or keep the checkpointing and drop compile= (sf.functional(model, remat=True))."
        )
    if options is not None and remat is not None and remat is not False:
        raise SpecError(
            "sf.functional: remat= and compile= together would run the blocks eagerly: sf.remat recomputes a "
            "block under torch.func.vjp, where torch does not run compiled code.\nFix: keep compile= and "
            "recompute inside the compiled block with torch.utils.checkpoint.checkpoint(..., use_reentrant=False) "
            "in its forward (torch.compile recomputes it in its backward graph), or keep remat= without compile=."
        )
    if remat is True or (checkpointed and (remat is None or remat is False)):
        from ._remat import policies

        remat = policies.nothing_saveable
    if remat is False:
        remat = None
    no_cache = remat is not None and takes_use_cache(module)  # [Note: transformers under remat]
    leaves: list[tuple[tuple, str]] = []
    children: dict[tuple, str] = {}
    params = _walk(module, (), "", set(), leaves, children)
    # The unit stack: the first list in the tree, found the way shard's default units are.
    stack = next((p[:d] for p, _ in leaves for d, k in enumerate(p) if isinstance(k, int)), None)
    if stack is None and isinstance(params, list):
        stack = ()
    units: dict[int, tuple[str, list]] = {}
    root: list[tuple[tuple, str]] = []
    for path, dotted in leaves:
        if stack is not None and len(path) > len(stack) and path[: len(stack)] == stack:
            i = path[len(stack)]
            child = children[stack + (i,)]
            units.setdefault(i, (child, []))[1].append((path, dotted[len(child) + 1 :]))
        else:
            root.append((path, dotted))
    # Modules compiled with Module.compile(): a deep copy drops that, so each copy gets it again.
    recompile = {name: compile_context(m, name) for name, m in module.named_modules()
                 if getattr(m, "_compiled_call_impl", None) is not None}
    around = dict(recompile, **{name: m.dynamo_ctx for name, m in module.named_modules() if _is_optimized(m)})
    unit_compilers = {}
    for child_name, _ in units.values():
        if child_name in recompile:  # block.compile(...)
            unit_compilers[child_name] = recompile.pop(child_name)
        elif options is not None:
            unit_compilers[child_name] = _torch_compile(options)
        else:  # a compiled module around the blocks: the blocks are compiled with its options
            outer = [name for name in around if child_name.startswith(f"{name}.") or not name]
            if outer:
                unit_compilers[child_name] = around[max(outer, key=len)]
    local = threading.local()
    meta_buffers = any(b is not None and b.device.type == "meta" for b in module.buffers())

    def thread_module(device) -> nn.Module:
        copy_ = getattr(local, "module", None)
        if copy_ is None:
            # Once per thread, and outside every transform: an sf.remat around apply_fn does not
            # repeat it, and a torch.func level active at the first call (a shard step's grad)
            # would wrap the copied buffers, which then escape to later calls at other levels
            # (functorch's "escaped?" assertion: the oracle's one-device reference after a step).
            with unrecorded(), torch._C._DisableFuncTorch(), torch.no_grad():
                copy_ = _make_thread_module(device)
        return copy_

    def _make_thread_module(device) -> nn.Module:
        copy_ = _meta_copy(module)
        if meta_buffers:  # [Note: computed buffers] in shardfn/_init/buffers.py
            fill_meta_buffers(copy_, device)
        turn_off_checkpointing(copy_)  # HF's torch.utils.checkpoint: replaced by sf.remat on the blocks
        local.module = copy_
        for name, ctx in recompile.items():  # inside a block, or around the blocks
            m = copy_.get_submodule(name)
            m._compiled_call_impl = ctx(m._call_impl)
        for child_name, paths in units.values():
            _bind_child(copy_.get_submodule(child_name), paths, local, remat, unit_compilers.get(child_name),
                        child_name)
        return copy_

    root_names = [name for _, name in root]

    def apply_fn(params, *args, **kwargs):
        if torch.compiler.is_compiling() and not _holds_view(params):  # [Note: one apply function]
            if no_cache:
                kwargs = without_cache(kwargs, module)
            return torch.func.functional_call(module, _named(params, "", {}), args, kwargs, strict=False)
        return eager_apply(params, *args, **kwargs)

    @not_traced(_APPLY_EAGER, warn=True)  # [Note: no whole-step graph] in _compile.py
    def eager_apply(params, *args, **kwargs):
        if no_cache:
            kwargs = without_cache(kwargs, module)
        with together(held=True):  # bound for the whole forward (embeddings, a tied head)
            bound = [_get(params, p) for p, _ in root]
        m = thread_module(_device_of(bound, args, kwargs) if meta_buffers else None)
        binding = getattr(local, "root_binding", None)
        if binding is None or binding.module is not m:
            binding = local.root_binding = Binding(m, root_names)
        previous = getattr(local, "params", None)
        local.params = params
        try:
            return binding.call(bound, args, kwargs)  # [Note: binding without functional_call]
        finally:
            local.params = previous

    return apply_fn, params


# [Note: one apply function]
# `sf.functional`'s apply function has two interpreters of one meaning, `module(*args)`
# with the parameters of `params`:
# - eager (a shard step, sf.remat, sf.estimate): each block's parameters are bound around
#   the block's own forward, through a per-thread module copy, so that `shard` gathers one
#   unit at a time; dynamo cannot trace that (Python state, gathers), so it is `not_traced`;
# - traced (`sf.jit`, which hands it the full parameters as a plain tree and schedules the
#   gathers as a graph pass): one `torch.func.functional_call` on the module.
# Which one runs is decided by where it runs: dynamo tracing a plain tree takes the second.
# A params view under torch.compile (an eager step compiled around) still takes the first,
# as a graph break. `sf.traced_apply(model)` is this same function.


def _holds_view(tree) -> bool:
    """Whether `tree` is (or holds, at its top) a shard step's params view."""
    if isinstance(tree, ParamsView):
        return True
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return any(isinstance(v, ParamsView) for v in values)


def _named(tree, prefix: str, out: dict) -> dict:
    """Dotted module names -> leaves, by plain recursion over dicts and lists (dynamo
    traces it; optree's polyfills fail on some dicts: [Note: trees in the graph] in
    shardfn/_traced/step.py)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        out[prefix] = tree
        return out
    for key, value in items:
        _named(value, f"{prefix}.{key}" if prefix else str(key), out)
    return out


def _not_a_module(value) -> str:
    """The message of `functional` given something that is not an nn.Module."""
    name = getattr(value, "__name__", None)
    what = f"{type(value).__name__} {name}" if name else f"{type(value).__name__} {value!r:.60}"
    return (
        f"sf.functional: expected a torch.nn.Module, got the {what}. sf.functional splits a module into "
        f"(apply_fn, params): a function of its parameters and the tree of those parameters.\nFix: pass the "
        f"model, apply_fn, params = sf.functional(model); a function that already takes the parameters "
        f"explicitly, f(params, batch), needs no sf.functional: give it to sf.shard(f, mesh) with your params tree."
    )


_APPLY_EAGER = (
    "torch.compile does not trace sf.functional's apply_fn (it reads sharded parameters, which all-gathers "
    "them): it runs eagerly, as one graph break, and compiles the model's blocks with this torch.compile's "
    "backend (docs/howto/compile.md)."
)
_BLOCK_EAGER = "the gather of a block's unit runs eagerly, between graphs ([Note: compiled blocks])"


def _device_of(bound: list, args, kwargs) -> torch.device:
    """The device of the forward's tensors (parameters first), for the buffers computed there."""
    tensors = [*bound, *args, *kwargs.values()]
    return next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "meta"),
                torch.device("cpu"))


def _is_optimized(module: nn.Module) -> bool:
    """`module` is `torch.compile(m)` (torch._dynamo's OptimizedModule; not imported unless
    torch._dynamo is, which takes a second)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)


def _torch_compile(options: dict) -> Callable:
    return lambda fn: torch.compile(fn, **options)


def _bind_child(child: nn.Module, paths, local, remat=None, compiler=None, name: str = "") -> None:
    original = child.forward
    if _is_optimized(child):  # torch.compile(block): its forward is compiled already
        original = CompiledForward(original, child._orig_mod.__call__)
    elif compiler is not None:
        original = CompiledForward(compiler(original), original)
    elif remat is None:  # compiled when a torch.compile'd step runs it ([Note: blocks compiled on request])
        original = OnRequest(original)
    active = threading.local()
    binding = Binding(child, [name for _, name in paths])  # [Note: binding without functional_call]

    def run(unit, *args, **kwargs):  # the child's own forward, with its unit's parameters
        before = getattr(active, "on", False)
        active.on = True
        try:
            return binding.call(unit, args, kwargs)
        finally:
            active.on = before

    if remat is not None:
        from ._remat import remat as rematerialize

        run.__qualname__ = f"block {name!r} ({type(child).__name__})"  # how sf.remat's errors name it
        run = rematerialize(run, policy=remat)

    @not_traced(_BLOCK_EAGER)  # a compiled module around the blocks: a graph break here
    def forward(*args, **kwargs):
        if getattr(active, "on", False):
            return original(*args, **kwargs)
        with together():  # one block's leaves may span units (frozen=, units=): fetched at once
            unit = [_get(local.params, p) for p, _ in paths]
        return run(unit, *args, **kwargs)

    child.forward = forward


def _meta_copy(module: nn.Module) -> nn.Module:
    memo = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for _, p in module.named_parameters(remove_duplicate=False)
    }
    for m in module.modules():  # torch.compile(m)'s context (its backend) is shared, not copied
        if _is_optimized(m):
            memo[id(m.dynamo_ctx)] = m.dynamo_ctx
    return copy.deepcopy(module, memo)
