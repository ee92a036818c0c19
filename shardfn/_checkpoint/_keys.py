"""Trees to named leaves: checkpoint keys, spec broadcasting, `specs_like`, `tied_keys`.

[Note: checkpoint keys] A leaf's key is its pytree key path joined with dots: dict keys
and list indices as they are, namedtuple fields by name. So `sf.functional(model)`'s
`params['transformer']['h'][0]['attn']['c_attn']['weight']` is stored as
`transformer.h.0.attn.c_attn.weight`, the module's own `state_dict` name, and an AdamW
state `(ScaleByAdamState(count, mu, nu), ...)` as `0.count`, `0.mu.<param key>`, ...
These are the names DCP's own `flatten_state_dict` gives nested dicts, so a tree
`{"model": shards}` lands at `model.<param key>`, where torchtitan and FSDP2 users put it.
A `key_map` (callable or dict) renames our key to the file's key, on save and on load.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import optree
import torch

from .. import _tree
from .._errors import SpecError
from .._spec import PartitionSpec, is_spec
from ._errors import CheckpointError, listing

__all__ = ["Leaf", "mapper", "named_leaves", "add_aliases", "key_of", "specs_like", "tied_keys"]

KeyMap = Callable[[str], str] | Mapping[str, str] | None


@dataclasses.dataclass
class Leaf:
    """One leaf of a tree being saved or loaded."""

    key: str  # the key in the file (after key_map); see [Note: checkpoint keys]
    where: str  # how messages name it: "tree['params']['w']"
    value: Any  # a tensor, a torch.Generator, or a picklable Python value
    spec: PartitionSpec  # P() for every non-tensor leaf


def _entry_text(entry) -> str:
    for attr in ("field", "name"):
        value = getattr(entry, attr, None)
        if isinstance(value, str):
            return value
    return str(entry.entry)


def key_of(accessor) -> str:
    """The dotted key of one optree accessor (its path entries joined by '.')."""
    return ".".join(_entry_text(e) for e in accessor)


def mapper(key_map: KeyMap) -> Callable[[str], str]:
    if key_map is None:
        return lambda k: k
    if callable(key_map):
        return key_map
    if isinstance(key_map, Mapping):
        return lambda k: key_map.get(k, k)
    raise CheckpointError(
        f"key_map must be a callable (our key -> file key) or a dict, got {type(key_map).__name__}.\n"
        f"Fix: e.g. key_map=lambda k: 'model.' + k, or key_map={{'w': 'layer.weight'}}."
    )


def named_leaves(tree: Any, specs: Any, key_map: KeyMap, *, who: str, what: str = "tree"):
    """Flatten `tree` once into `(leaves, treedef)`, broadcasting the spec-tree prefix `specs`.

    Raises:
      SpecError: `specs` is not a prefix of `tree` (naming the key path), or an entry is
        not a PartitionSpec.
      CheckpointError: two leaves map to the same key.
    """
    accessors, values, treedef = optree.tree_flatten_with_accessor(tree, namespace=_tree.NAMESPACE)
    paths = [a.path for a in accessors]
    if specs is None:
        spec_leaves = [PartitionSpec()] * len(values)
    else:
        try:
            spec_leaves = _tree.broadcast_prefix(specs, tree, what="specs", is_prefix_leaf=is_spec)
        except SpecError as err:
            raise SpecError(f"{who}: {err}") from None
    to_file = mapper(key_map)
    out: list[Leaf] = []
    for accessor, path, value, spec in zip(accessors, paths, values, spec_leaves):
        where = f"{what}{_tree.keystr(path)}"
        spec = PartitionSpec() if spec is None else spec
        if not isinstance(spec, PartitionSpec):
            raise SpecError(
                f"{who}: specs for {where} is {spec!r}, not a PartitionSpec.\n"
                f"Fix: use sf.P(...), or None for replicated."
            )
        if not isinstance(value, (torch.Tensor, torch.Generator)) and len(spec.axes):
            raise SpecError(
                f"{who}: {where} is a {type(value).__name__}, not a tensor, but its spec {spec!r} shards it.\n"
                f"Fix: give non-tensor leaves P() (they are stored once, as pickled bytes)."
            )
        key = to_file(key_of(accessor))
        if not isinstance(key, str) or not key:
            raise CheckpointError(f"{who}: key_map returned {key!r} for {where}; keys must be non-empty strings")
        out.append(Leaf(key, where, value, spec))
    _check_unique(out, who)
    return out, treedef


def add_aliases(leaves: list[Leaf], aliases: Mapping[str, str] | None, key_map: KeyMap, who: str) -> list[Leaf]:
    """`leaves` plus one leaf per alias `{other key: our key}` holding the same value.

    Both sides are our keys (before `key_map`); the alias goes through `key_map` too.
    """
    if not aliases:
        return leaves
    to_file = mapper(key_map)
    by_key = {leaf.key: leaf for leaf in leaves}
    unknown = [f"{alias!r} -> {source!r}" for alias, source in aliases.items() if to_file(source) not in by_key]
    if unknown:
        raise CheckpointError(
            f"{who}: aliases name keys the tree does not have:\n{listing(unknown)}\n"
            f"Fix: aliases map another name to one of the tree's keys, e.g. "
            f"{{'lm_head.weight': 'transformer.wte.weight'}} (see sf.checkpoint.tied_keys(module))."
        )
    extra = []
    for alias, source in aliases.items():
        leaf = by_key[to_file(source)]
        extra.append(Leaf(to_file(alias), f"{leaf.where} (alias {alias!r})", leaf.value, leaf.spec))
    out = leaves + extra
    _check_unique(out, who)
    return out


def _check_unique(leaves: list[Leaf], who: str) -> None:
    seen: dict[str, str] = {}
    clashes = []
    for leaf in leaves:
        if leaf.key in seen:
            clashes.append(f"{seen[leaf.key]} and {leaf.where} both have key {leaf.key!r}")
        seen.setdefault(leaf.key, leaf.where)
    if clashes:
        raise CheckpointError(
            f"{who}: several leaves map to the same checkpoint key (keys join the key path with '.', "
            f"so a dict key holding a '.' can collide with a nested path, or key_map sends two keys "
            f"to one):\n{listing(clashes)}\nFix: rename the dict keys or fix key_map."
        )


def specs_like(state: Any, params_specs: Any, params: Any = None) -> Any:
    """The spec tree of an optimizer state built from shards: params' specs where it looks like them.

    Every subtree of `state` with the structure of the params (e.g. AdamW's `mu` and
    `nu`) gets `params_specs`; every other leaf (step counts, schedules) gets `P()`.

    Args:
      state: the optimizer state (e.g. `sf.optim.adamw(lr).init(shards)`).
      params_specs: the params' spec tree, e.g. `step.specs`.
      params: the params (or shards) whose structure to look for; needed only when
        `params_specs` is a prefix (e.g. a single `P('data')`) rather than a full tree.

    Returns:
      A spec tree shaped like `state`, to pass to `save` / `load` with it.

    Example:
      >>> import shardfn as sf, torch
      >>> state = sf.optim.adam(1e-3).init({"w": torch.zeros(4, 2), "b": torch.zeros(2)})
      >>> sf.checkpoint.specs_like(state, {"w": sf.P("data"), "b": sf.P()})
      (EmptyState(), ScaleByAdamState(count=P(), mu={'w': P('data'), 'b': P()}, nu={'w': P('data'), 'b': P()}), EmptyState())
    """
    if params is not None:
        target = optree.tree_structure(params, none_is_leaf=True, namespace=_tree.NAMESPACE)
    else:
        target = optree.tree_structure(params_specs, none_is_leaf=True, is_leaf=is_spec, namespace=_tree.NAMESPACE)
    if target.num_leaves == 1 and optree.treespec_is_leaf(target):
        raise SpecError(
            "specs_like: the params are a single leaf, so every leaf of the state would look like "
            "them.\nFix: build the spec tree by hand, e.g. (ScaleByAdamState(P(), P('data'), P('data')), ...)."
        )

    def matches(sub) -> bool:
        return optree.tree_structure(sub, none_is_leaf=True, namespace=_tree.NAMESPACE) == target

    return optree.tree_map(
        lambda sub: params_specs if matches(sub) else PartitionSpec(),
        state,
        is_leaf=matches,
        none_is_leaf=True,
        namespace=_tree.NAMESPACE,
    )


def tied_keys(module: torch.nn.Module, prefix: str = "") -> dict[str, str]:
    """`{second name: first name}` for every parameter a module holds under several names.

    `sf.functional` keeps only the first name of a tied parameter (GPT's `lm_head.weight`
    is `transformer.wte.weight`); pass this as `aliases=` to `save` / `export_full` to
    also store it under the other names, as `module.state_dict()` and FSDP2 do.

    Example:
      >>> import shardfn as sf
      >>> from shardfn.testing.models import GPT, GPTConfig
      >>> sf.checkpoint.tied_keys(GPT(GPTConfig(n_layer=1)))
      {'lm_head.weight': 'transformer.wte.weight'}
    """
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[prefix + name] = prefix + first[id(p)]
        else:
            first[id(p)] = name
    return out
