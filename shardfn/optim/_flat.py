"""Flat-list plumbing shared by the optimizer transforms.

Every transform flattens its pytrees once at its boundary (with the package's
``shardfn._tree`` helpers), works on flat lists of tensors with ``torch._foreach_*``
ops, and unflattens on the way out. This module holds what the optimizers add to that
boundary: flattening against a reference structure (with errors that name the first
differing key path), the step counter, and guards for the corner cases of the foreach ops.

[Note: in-place mode]
A transform built with ``inplace=True`` owns the buffers it is given: it updates its
state tensors in place and writes its output into the incoming ``updates`` tensors
(the gradients are consumed), so a whole ``adamw`` step allocates nothing. Only a
gradient that cannot be written (an expanded tensor whose elements share memory, as
``torch.func.grad`` returns for ``x.sum()``) is copied first. In-place work runs under
``torch.no_grad()`` so that leaf tensors that require grad may be updated. Pure mode
(the default) never writes to its inputs and returns new tensors, which may alias
inputs that a transform leaves unchanged (e.g. leaves masked out of weight decay).
In-place and fused modes refuse tensors of a ``torch.func`` transform (``refuse_func``):
their writes under ``no_grad`` would give wrong derivatives, or none.

[Note: differentiable pure mode]
Pure mode has two implementations of each transform's arithmetic, op for op the same:

- the foreach path: ``torch._foreach_*`` ops on the flat lists, which may write into the
  fresh buffers they just made (Adam divides its ``sqrt`` output in place). It is what a
  training loop runs (under ``no_grad``, or on tensors that do not require grad).
- the per-leaf path: out-of-place torch ops, leaf by leaf, taking each hyperparameter as a
  float or a 0-dim tensor ([Note: tensor hyperparameters] in ``_hyper.py``).

The foreach path cannot be differentiated or batched: foreach ops have no vmap batching
rules, ``_foreach_norm`` has no forward derivative, ``_foreach_mul`` by a 0-dim tensor fails
under ``grad``, and writing into ``sqrt``'s saved output gave ``torch.func.jacrev`` of
``adamw``'s update a Jacobian off by 1370% (4-weight least squares, step 2), with no
error. So an update takes the per-leaf path (``per_leaf``) when a hyperparameter is a
tensor, when a ``torch.func`` transform is running, or when autograd records (grad mode
on and a leaf requires grad). Under ``torch.compile`` the
foreach path stays ([Note: step-dependent scalars in a graph] in ``_in_graph.py``). With
numbers for hyperparameters the two paths give the same bits on CPU (foreach ops there are
loops of the same kernels; tested), so a derivative is that of what training computes.

Step-count scalars (bias corrections, a schedule's step) come from the count as before: an
integer carries no derivative. Only when ``vmap`` batches the count (over a stack of
optimizer states) does it stay a tensor, and they are computed by torch ops.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from .. import _tree
from .._errors import SpecError, bullet_list
from .._functorch import is_batched

def leaves_like(
    treedef: optree.PyTreeSpec, tree: Any, name: str, who: str, ref: str = "the updates",
    shapes_of: list | None = None,
) -> list[Any]:
    """Flatten ``tree`` and check that it has the structure ``treedef`` (that of ``ref``).

    Args:
        shapes_of: the leaves of ``ref``; when given, each leaf of ``tree`` must also have
            the shape of its leaf there (one tuple comparison per leaf).

    Raises:
        ValueError: naming ``who``, the argument ``name`` and the first differing key path.
        SpecError: a leaf whose shape differs from ``ref``'s ([Note: state of the full
            params]).
    """
    leaves, other = _tree.flatten(tree)
    if other != treedef:
        raise ValueError(_structure_error(treedef, other, ref, name, who))
    if shapes_of is not None:
        bad = [i for i, (a, b) in enumerate(zip(leaves, shapes_of))
               if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape]
        if bad:
            raise SpecError(_shape_error(treedef, bad, leaves, shapes_of, ref, name, who))
    return leaves


# [Note: state of the full params]
# The usual way to get here: `opt.init(params)` on the full parameters, then `update` with
# the gradients of `step.shard_params(params)`, which have 1/N of the rows. Every
# transform's `update` flattens its state (and params) through `leaves_like` with the
# gradient leaves, so the shapes are compared once per leaf before any math, and the
# message says which leaf and by how much, instead of a size-mismatch RuntimeError from
# inside a foreach op.


def _shape_error(treedef, bad: list[int], leaves, ref_leaves, ref, name, who) -> str:
    paths = treedef.paths()
    ref_name = ref.replace("the ", "")
    lines = [f"{name}{_tree.keystr(paths[i])}: shape {tuple(leaves[i].shape)}, {ref_name}: "
             f"{tuple(ref_leaves[i].shape)}" for i in bad[:5]]
    if len(bad) > 5:
        lines.append(f"... and {len(bad) - 5} more of {len(leaves)} leaves")
    a, b = leaves[bad[0]], ref_leaves[bad[0]]
    rows = a.dim() == b.dim() and a.dim() > 0 and a.shape[1:] == b.shape[1:] and a.shape[0] != b.shape[0]
    if rows and name.startswith("state") and a.shape[0] > b.shape[0]:
        why = (" The state has more rows than the gradient: it was made from the full parameters, while "
               "the gradients are this rank's shards.")
    elif rows:
        why = " Only the rows differ: one tree holds the full tensors, the other this rank's shards."
    else:
        why = ""
    return (
        f"{who}: {name} does not have the shapes of {ref}:\n{bullet_list(lines)}\n"
        f"Optimizer state, parameters and gradients must be shaped alike, leaf by leaf.{why}\n"
        "Fix: opt.init(shards) with the shards step.shard_params returned (not the full params), and "
        "update / apply_updates with those shards, their gradients and the state this optimizer returned."
    )


def _structure_error(expected, got, ref, name, who) -> str:
    want = [a.codify("") for a in expected.accessors()]
    have = [a.codify("") for a in got.accessors()]
    first = next((i for i, (w, h) in enumerate(zip(want, have)) if w != h), None)
    if first is not None:
        where = f"{ref} have a leaf at {want[first]} where `{name}` has one at {have[first]}"
    elif len(want) > len(have):
        where = f"{ref} have a leaf at {want[len(have)]} that `{name}` lacks"
    elif len(have) > len(want):
        where = f"`{name}` has a leaf at {have[len(want)]} that {ref} lack"
    else:
        where = "same leaf paths, different container types"
    return (
        f"{who}: {ref} and `{name}` have different tree structures.\n"
        f"  - {where}\n"
        f"  - {ref.replace('the ', '')}: {expected}\n"
        f"  - {name}: {got}\n"
        "  Fix: pass gradients with the structure of the params given to init, and the "
        "state that this optimizer's init/update returned."
    )


def per_leaf(*lists: list, hyper: tuple = ()) -> bool:
    """Whether a pure update takes the per-leaf path; see [Note: differentiable pure mode].

    Args:
        *lists: the flat leaves the update reads (updates, state, params).
        hyper: the transform's hyperparameters (a tensor among them decides alone).
    """
    if any(isinstance(h, torch.Tensor) for h in hyper):
        return True
    if torch.compiler.is_compiling():
        return False
    if torch._C._functorch.maybe_current_level() is not None:
        return True
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for leaves in lists for t in leaves
    )


def refuse_func(who: str, fix: str, *trees: Any) -> None:
    """Raise if an in-place or fused update is given tensors of a ``torch.func`` transform.

    One C call when no transform runs; otherwise every leaf of ``trees`` is looked at.

    Raises:
        RuntimeError: naming ``who``, the transform and ``fix``.
    """
    if torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is None:
        return
    for tree in trees:
        for t in (tree if isinstance(tree, list) else _tree.flatten(tree)[0]):
            if isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
                transform = "vmap" if is_batched(t) else "grad, vjp, jacrev, jacfwd or jvp"
                raise RuntimeError(
                    f"{who}: refused under torch.func ({transform}): this update runs in place "
                    f"(inplace=True or fused=True), writing the state and gradient tensors under "
                    f"torch.no_grad(), which torch.func can neither differentiate nor batch, so its "
                    f"derivatives would be wrong or missing. Fix: use pure mode: {fix}."
                )




def require_params(params: Any, who: str) -> None:
    if params is None:
        raise ValueError(
            f"{who}: needs the current parameters; call update(grads, state, params)."
        )


def writable(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Return ``leaves`` with any tensor whose elements share memory replaced by a copy.

    In-place mode writes its output into the gradient buffers (see
    [Note: in-place mode]); an expanded gradient (stride 0) cannot be written, so only
    those are copied.
    """
    out = leaves
    for i, t in enumerate(leaves):
        if torch._debug_has_internal_overlap(t) != 0:
            if out is leaves:
                out = list(leaves)
            out[i] = t.clone()
    return out


def zeros_like(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """One zero buffer per leaf, shaped (and strided) like it: state of a shard is a shard."""
    return [torch.zeros_like(t, memory_format=torch.preserve_format) for t in leaves]


# -- step counter --------------------------------------------------------------------
# Counts live on the CPU as 0-dim int64 tensors, like torch.optim's non-capturable
# "step": reading them (for bias corrections and schedules) never syncs an accelerator,
# and they checkpoint like any other state tensor.


def new_count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def read_count(count: Any) -> int:
    """The count as an int; under torch.compile the 0-dim tensor itself, so a schedule of
    it is traced, not specialized ([Note: schedules in a graph] in _schedules.py); a count
    that vmap batches stays that tensor ([Note: differentiable pure mode])."""
    if isinstance(count, torch.Tensor):
        if torch.compiler.is_compiling():
            return count
        if is_batched(count):
            return count
    return int(count)


def bump_count(count: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, int]:
    """Return (count + 1, its value as an int); in place when ``inplace``. A count that
    vmap batches gives (count + 1, that as a float64 tensor)."""
    if inplace and isinstance(count, torch.Tensor):
        count.add_(1)
        return count, int(count)
    if isinstance(count, torch.Tensor) and not torch.compiler.is_compiling() and is_batched(count):
        count = count + 1
        return count, count.to(torch.float64)
    value = int(count) + 1
    return torch.tensor(value, dtype=torch.int64), value
