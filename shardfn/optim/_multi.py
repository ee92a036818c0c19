"""Per-group optimizers: optax's ``multi_transform``, ``masked`` and ``set_to_zero``.

[Note: masked trees]
An inner transform of ``multi_transform`` / ``masked`` sees the updates, state and params
with every leaf outside its group replaced by ``None``. ``None`` is an empty node in
shardfn's trees (as in JAX), so the inner transform flattens to exactly its own leaves,
allocates state for them only, and a spec tree (``step.specs``) still matches by key
path. That is the role optax's ``MaskedNode`` plays. On the way out, the inner
transform's updates fill their places in the full tree; the others come from the other
groups (``multi_transform``) or pass through unchanged (``masked``).

A label (or mask flag) is given per leaf as a tree (a pytree prefix of the params: one
label may cover a whole subtree), or as a function of the leaf's key path, called
``fn(path)`` or ``fn(path, leaf)`` (two parameters: the leaf too, e.g. to route by
``leaf.ndim``; on shards the leaf is the shard, whose ``ndim`` is the parameter's).
Labels are computed on each call from the tree given, so they never depend on state.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Hashable, Mapping, NamedTuple, Union

import torch

from .. import _tree
from . import _flat
from .base import EmptyState, GradientTransformation, mark_unplaced

Labels = Union[Any, Callable[..., Any]]


class MultiTransformState(NamedTuple):
    """State of ``multi_transform``: ``inner_states[label]`` is that group's state (its
    tensors shaped like the group's leaves; the other leaves are ``None``)."""

    inner_states: dict


class MaskedState(NamedTuple):
    """State of ``masked``: the inner transform's state over the selected leaves."""

    inner_state: Any


def _is_label(x) -> bool:
    return not isinstance(x, (dict, list, tuple)) or isinstance(x, str)


def _arity(fn: Callable) -> int:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return 1
    return 2 if len(params) >= 2 else 1


def leaf_labels(labels: Labels, tree: Any, who: str) -> list:
    """One label per leaf of ``tree`` (flatten order): ``labels`` is a prefix tree of
    labels or a function ``fn(path)`` / ``fn(path, leaf)``."""
    paths, leaves, _ = _tree.flatten_with_paths(tree)
    if callable(labels) and not isinstance(labels, (dict, list, tuple)):
        two = _arity(labels) == 2
        return [labels(p, x) if two else labels(p) for p, x in zip(paths, leaves)]
    return _tree.broadcast_prefix(labels, tree, what=f"{who}: labels", is_prefix_leaf=_is_label)


def _masked_tree(treedef, leaves: list, keep: list[bool]):
    """The tree with the leaves not kept replaced by ``None`` ([Note: masked trees])."""
    return _tree.unflatten(treedef, [x if k else None for x, k in zip(leaves, keep)])


def multi_transform(transforms: Mapping[Hashable, GradientTransformation], labels: Labels) -> GradientTransformation:
    """A transform per group of leaves: ``transforms[label]`` runs on the leaves labelled so.

    optax's ``multi_transform``. The Muon recipe is one line:
    ``multi_transform({"muon": muon(0.02), "adamw": adamw(3e-4)}, lambda path, p: "muon" if p.ndim == 2 else "adamw")``.

    Args:
        transforms: ``{label: GradientTransformation}``.
        labels: a tree of labels (a pytree prefix of the params: one label may cover a
            subtree), or a function of a leaf's key path, ``fn(path) -> label``, or of the
            path and the leaf, ``fn(path, leaf) -> label``.

    Returns:
        A ``GradientTransformation`` with ``MultiTransformState({label: inner state})``.
        Each inner transform sees its own leaves only ([Note: masked trees] in ``_multi.py``).

    Raises:
        ValueError: a leaf's label has no transform (naming the leaf's path and the labels).

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.multi_transform({"sgd": optim.sgd(0.1), "frozen": optim.set_to_zero()},
        ...                             {"w": "sgd", "b": "frozen"})
        >>> params = {"w": torch.ones(2), "b": torch.ones(2)}
        >>> u, _ = opt.update({"w": torch.ones(2), "b": torch.ones(2)}, opt.init(params), params)
        >>> u["w"], u["b"]
        (tensor([-0.1000, -0.1000]), tensor([0., 0.]))
    """
    transforms = dict(transforms)
    for name, t in transforms.items():
        if not (isinstance(t, tuple) and len(t) == 2 and all(callable(f) for f in t)):
            raise TypeError(f"multi_transform: transforms[{name!r}] is {type(t).__name__}, not a "
                            f"GradientTransformation; did you forget to call it, e.g. `adamw(1e-3)`?")
    who = "multi_transform"

    def groups(tree):
        paths, leaves, treedef = _tree.flatten_with_paths(tree)
        labs = leaf_labels(labels, tree, who)
        unknown = [(p, l) for p, l in zip(paths, labs) if l not in transforms]
        if unknown:
            listing = "\n".join(f"  - params{_tree.keystr(p)}: label {l!r}" for p, l in unknown[:10])
            raise ValueError(f"{who}: these leaves have labels with no transform (transforms has "
                             f"{sorted(map(str, transforms))}):\n{listing}\nFix: add a transform for "
                             f"each label, or label the leaves with one of those.")
        return leaves, treedef, labs

    def init(params):
        leaves, treedef, labs = groups(params)
        return MultiTransformState({name: t.init(_masked_tree(treedef, leaves, [l == name for l in labs]))
                                    for name, t in transforms.items()})

    def update(updates, state, params=None):
        leaves, treedef, labs = groups(updates)
        p_leaves = None if params is None else _flat.leaves_like(treedef, params, "params", f"{who}.update",
                                                                  shapes_of=leaves)
        out = list(leaves)
        new_states = {}
        for name, t in transforms.items():
            keep = [l == name for l in labs]
            if name not in state.inner_states:
                raise ValueError(f"{who}.update: the state has no group {name!r} (it has "
                                 f"{sorted(map(repr, state.inner_states))}); pass the state this init returned.")
            inner_p = None if p_leaves is None else _masked_tree(treedef, p_leaves, keep)
            u, new_states[name] = t.update(_masked_tree(treedef, leaves, keep), state.inner_states[name], inner_p)
            if any(keep):
                got = _tree.flatten(u)[0]
                for i, x in zip((i for i, k in enumerate(keep) if k), got):
                    out[i] = x
        return _tree.unflatten(treedef, out), MultiTransformState(new_states)

    mark_unplaced(update, [t.update for t in transforms.values()])
    return GradientTransformation(init, update)


def masked(inner: GradientTransformation, mask: Labels) -> GradientTransformation:
    """Run ``inner`` on the leaves where ``mask`` is True; the others pass through unchanged.

    optax's ``masked``. ``mask`` is a tree of bools (a pytree prefix of the params) or a
    function ``fn(path)`` / ``fn(path, leaf)`` returning a bool.

    Returns:
        A ``GradientTransformation`` with ``MaskedState(inner_state)``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> no_decay_on_bias = optim.masked(optim.add_decayed_weights(0.5), {"w": True, "b": False})
        >>> params = {"w": torch.ones(2), "b": torch.ones(2)}
        >>> u, _ = no_decay_on_bias.update({"w": torch.zeros(2), "b": torch.zeros(2)},
        ...                                no_decay_on_bias.init(params), params)
        >>> u["w"], u["b"]
        (tensor([0.5000, 0.5000]), tensor([0., 0.]))
    """
    if not (isinstance(inner, tuple) and len(inner) == 2 and all(callable(f) for f in inner)):
        raise TypeError(f"masked: inner is {type(inner).__name__}, not a GradientTransformation")
    who = "masked"

    def flags(tree):
        leaves, treedef = _tree.flatten(tree)
        keep = [bool(f) for f in leaf_labels(mask, tree, who)]
        return leaves, treedef, keep

    def init(params):
        leaves, treedef, keep = flags(params)
        return MaskedState(inner.init(_masked_tree(treedef, leaves, keep)))

    def update(updates, state, params=None):
        leaves, treedef, keep = flags(updates)
        inner_p = None
        if params is not None:
            p_leaves = _flat.leaves_like(treedef, params, "params", f"{who}.update", shapes_of=leaves)
            inner_p = _masked_tree(treedef, p_leaves, keep)
        u, inner_state = inner.update(_masked_tree(treedef, leaves, keep), state.inner_state, inner_p)
        out = list(leaves)
        for i, x in zip((i for i, k in enumerate(keep) if k), _tree.flatten(u)[0]):
            out[i] = x
        return _tree.unflatten(treedef, out), MaskedState(inner_state)

    mark_unplaced(update, [inner.update])
    return GradientTransformation(init, update)


def set_to_zero() -> GradientTransformation:
    """Updates of zeros (optax's ``set_to_zero``): a frozen group in ``multi_transform``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> optim.set_to_zero().update({"w": torch.ones(2)}, optim.EmptyState())[0]["w"]
        tensor([0., 0.])
    """

    def init(params):
        del params
        return EmptyState()

    def update(updates, state, params=None):
        del params
        return _tree.tree_map(torch.zeros_like, updates), state

    return GradientTransformation(init, update)
