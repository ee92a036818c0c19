"""`save`, `load`, `export_full` and `contents`: the collective entry points.

`torch.distributed.checkpoint` takes seconds to import, so `_dcp` is imported on first
use: `import shardfn` (and `shardfn.checkpoint`) stays as fast as before.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from .. import _tree
from . import _files
from ._errors import (
    CheckpointDTypeError,
    CheckpointError,
    CheckpointKeyError,
    CheckpointShapeError,
    listing,
)
from ._keys import KeyMap, Leaf, add_aliases, mapper, named_leaves
from ._async import PendingSave, finish_save, staged
from ._layout import Entry, Ranks, agree, chunk_of, global_shapes, manifest

__all__ = ["save", "load", "export_full", "contents"]


def _stored(leaf: Leaf) -> Leaf:
    """A generator is stored as its state tensor (uint8)."""
    if isinstance(leaf.value, torch.Generator):
        return Leaf(leaf.key, leaf.where, leaf.value.get_state(), leaf.spec)
    return leaf


def save(path, tree: Any, mesh, specs: Any = None, *, key_map: KeyMap = None,
         aliases: Mapping[str, str] | None = None, overwrite: bool = False, blocking: bool = True):
    """Save a pytree of this rank's blocks as one DCP checkpoint directory (collective).

    Every rank calls `save` with its own blocks; each writes only the blocks it holds
    (replicated leaves and HSDP replicas are written once), and the directory appears at
    `path` atomically, once complete (see docs/checkpoints.md).

    Args:
      path: the checkpoint directory to create, e.g. `f"{dir}/step_{step:06d}"`; it
        must not exist unless `overwrite`. On the distributed backend every rank must see
        the same file system.
      tree: any pytree of this rank's blocks: tensors (shards, optimizer state, counts),
        `torch.Generator`s (their state is stored), and picklable Python values (ints,
        floats, strings: stored once, as bytes).
      mesh: the mesh the blocks live on, or None for a single process (all replicated).
      specs: a spec-tree prefix of `tree` (`sf.P` leaves; None = replicated): `step.specs`
        for `step.shard_params` shards, `specs_like(opt_state, step.specs)` for an optimizer
        state. Default: everything replicated.
      key_map: our dotted key -> the file's key (callable or dict); see `load`.
      aliases: `{other key: key}`: also store a leaf under other names, e.g.
        `tied_keys(model)` so tied weights appear under every module name, as in FSDP2.
      overwrite: replace an existing checkpoint at `path` (atomically).
      blocking: False saves asynchronously: `save` agrees on the layout with the other
        ranks and copies this rank's blocks (to CPU memory), then returns a `PendingSave`
        while a background thread writes the files; training may go on and change the
        blocks in place. `pending.wait()` (collective: every rank calls it, e.g. before
        the next save) finishes the save and publishes the directory.

    Returns:
      `path`, or with `blocking=False` a `PendingSave` whose `wait()` returns `path`.

    Raises:
      SpecError: the specs do not fit the tree or the mesh, or a block is not its
        `torch.chunk` block.
      CheckpointError: `path` exists, the ranks passed different trees, a Python value
        differs across ranks, or writing failed (on any rank: every rank raises).

    Example:
      >>> import shardfn as sf, torch, tempfile, os
      >>> mesh = sf.local_mesh({"data": 2})
      >>> path = os.path.join(tempfile.mkdtemp(), "step_000001")
      >>> def body():
      ...     block = torch.arange(5.0)[[0, 1, 2] if mesh.rank == 0 else [3, 4]]
      ...     return sf.checkpoint.save(path, {"w": block, "step": 1}, mesh, {"w": sf.P("data"), "step": None})
      >>> mesh.run(body) == [path, path]
      True
      >>> sf.checkpoint.load(path, {"w": torch.zeros(5), "step": 0}, None)
      {'w': tensor([0., 1., 2., 3., 4.]), 'step': 1}
    """
    from ._dcp import finish, save_plan, write_blocks

    who = "sf.checkpoint.save"
    path = os.fspath(path)
    ranks = Ranks(mesh)
    mine: dict[str, Any] = {}

    def prepare():
        leaves, _ = named_leaves(tree, specs, key_map, who=who)
        leaves = [_stored(leaf) for leaf in add_aliases(leaves, aliases, key_map, who)]
        mine["leaves"] = leaves
        save_id = None
        if ranks.rank == 0:
            _files.preflight(path, overwrite, who)
            save_id = _files.new_id()
        return manifest(leaves, ranks, who, digest_objects=True), save_id

    replies = agree(ranks, prepare, who)
    per_rank = [entries for entries, _ in replies]
    save_id = replies[0][1]
    shapes = global_shapes(per_rank, who)  # the same answer (or error) on every rank
    plans = [save_plan(entries, shapes) for entries in per_rank]
    blocks = {leaf.key: leaf.value for leaf in mine["leaves"]}
    if not blocking:  # [Note: async save]: the writer thread works on a copy
        blocks = {key: staged(value) for key, value in blocks.items()}
    tmp = _files.temp_path(path, save_id)

    def write():
        results, mine["metadata"], mine["writer"] = write_blocks(tmp, path, ranks.rank, plans, blocks)
        return results

    def publish(results):  # rank 0: DCP's `.metadata`, then the marker and the atomic rename
        if ranks.rank == 0:
            finish(mine["writer"], mine["metadata"], results)
            info = {"world_size": ranks.size, "mesh": ranks.shape,
                    "specs": {e.key: _spec_text(leaf) for e, leaf in zip(per_rank[0], mine["leaves"])}}
            _files.publish(tmp, path, _files.describe(info), save_id)

    if not blocking:
        return PendingSave(path, tmp, ranks, write, publish)
    finish_save(ranks, tmp, write, publish, who)
    return path


def _spec_text(leaf: Leaf) -> str:
    return repr(leaf.spec) if isinstance(leaf.value, torch.Tensor) else type(leaf.value).__name__


def load(path, like: Any, mesh, specs: Any = None, *, key_map: KeyMap = None, strict: bool = True,
         cast: bool = False, aliases: Mapping[str, str] | None = None) -> Any:
    """Load a checkpoint into the layout of `like` on `mesh`, resharding as needed (collective).

    The checkpoint may come from any mesh and layout (another world size, uneven chunks,
    HSDP or 1-D), from `save` or from `dcp.save` (e.g. an FSDP2 model's state dict). Each
    rank reads only the parts of the files its blocks need.

    Args:
      path: a checkpoint directory (see `latest`).
      like: a pytree of this rank's blocks in the target layout (e.g.
        `step.shard_params(params)` of a freshly built model, or an optimizer state
        initialized from those shards); only shapes, dtypes and devices are used (meta
        tensors are fine). Python-value leaves are placeholders for the stored values;
        `torch.Generator` leaves get the stored state.
      mesh: the mesh to load onto, or None for one process (everything whole).
      specs: the spec-tree prefix describing `like`'s blocks (as for `save`).
      key_map: our dotted key -> the file's key: a dict (unlisted keys unchanged) or a
        callable, e.g. `lambda k: "model." + k`. Keys are key paths joined by '.', equal
        to the module's state_dict names for `sf.functional` params.
      strict: also fail when the file holds keys `like` does not (listing them); pass
        False to load a subset (e.g. only the params of a params + optimizer checkpoint).
      cast: convert tensors whose stored dtype differs from `like`'s (else an error).
      aliases: `{other key: key}` as for `save`: those file keys are expected, not extra.

    Returns:
      A new pytree like `like`, holding this rank's blocks of the stored values.

    Raises:
      IncompleteCheckpointError: `path` is an interrupted save (or has no `.metadata`).
      CheckpointKeyError: keys of `like` missing from the file, or (strict) extra file keys.
      CheckpointShapeError: a stored global shape differs from `like`'s global shape.
      CheckpointDTypeError: a stored dtype differs from `like`'s and `cast` is False.
      SpecError: the specs do not fit `like`, or `like`'s blocks are not torch.chunk blocks.
    """
    from ._dcp import read_blocks, read_metadata

    who = "sf.checkpoint.load"
    path = os.fspath(path)
    ranks = Ranks(mesh)
    mine: dict[str, Any] = {}

    def prepare():
        _files.check_complete(path, who)
        mine["metadata"] = read_metadata(path)
        leaves, mine["treedef"] = named_leaves(like, specs, key_map, who=who, what="like")
        mine["leaves"] = leaves
        return manifest([_stored(leaf) for leaf in leaves], ranks, who, digest_objects=False)

    per_rank = agree(ranks, prepare, who)
    shapes = global_shapes(per_rank, who)
    metadata = mine["metadata"]
    alias_keys = {mapper(key_map)(alias) for alias in (aliases or {})}
    _check_against(metadata.state_dict_metadata, per_rank[ranks.rank], shapes, strict, cast, alias_keys, who)

    targets: dict[str, torch.Tensor] = {}
    offsets: dict[str, tuple[int, ...]] = {}
    objects: list[str] = []
    for leaf, entry in zip(mine["leaves"], per_rank[ranks.rank]):
        if entry.kind == "object":
            objects.append(entry.key)
            continue
        template = leaf.value.get_state() if isinstance(leaf.value, torch.Generator) else leaf.value
        device = ranks.device if template.device.type == "meta" else template.device
        targets[entry.key] = torch.empty(template.shape, dtype=template.dtype, device=device)
        offsets[entry.key] = chunk_of(entry, shapes[entry.key])[0]
    values = read_blocks(path, metadata, targets, offsets, objects)
    out = []
    for leaf in mine["leaves"]:
        if leaf.key in values:
            out.append(values[leaf.key])
        elif isinstance(leaf.value, torch.Generator):
            generator = torch.Generator(device=leaf.value.device)
            generator.set_state(targets[leaf.key])
            out.append(generator)
        else:
            t = targets[leaf.key]
            if leaf.value.requires_grad and t.is_floating_point():
                t.requires_grad_(True)
            out.append(t)
    return _tree.unflatten(mine["treedef"], out)


def _check_against(stored: Mapping[str, Any], entries: list[Entry], shapes: dict, strict: bool, cast: bool,
                   alias_keys: set[str], who: str) -> None:
    """Compare the tree with the file's metadata; raise the first kind of mismatch, listing all."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    ours = {e.key for e in entries}
    missing = [f"{e.where} (key {e.key!r})" for e in entries if e.key not in stored]
    if missing:
        raise CheckpointKeyError(
            f"{who}: {len(missing)} key(s) of the tree are not in the checkpoint:\n{listing(missing)}\n"
            f"{_key_hint([e.key for e in entries if e.key not in stored], list(stored))}"
        )
    extra = sorted(k for k in stored if k not in ours and k not in alias_keys)
    if extra and strict:
        raise CheckpointKeyError(
            f"{who}: the checkpoint holds {len(extra)} key(s) the tree does not:\n{listing(extra)}\n"
            f"Fix: pass strict=False to load only the tree's keys (e.g. params out of a params + "
            f"optimizer checkpoint), add the leaves to the tree, or declare tied names with aliases=."
        )
    kinds, bad_shapes, bad_dtypes = [], [], []
    for e in entries:
        md = stored[e.key]
        is_bytes = isinstance(md, BytesStorageMetadata)
        if is_bytes != (e.kind == "object"):
            kinds.append(f"{e.where} (key {e.key!r}): the file holds "
                         f"{'a Python value' if is_bytes else 'a tensor'}, the tree a {e.kind}")
            continue
        if is_bytes:
            continue
        if tuple(md.size) != shapes[e.key]:
            bad_shapes.append(f"{e.where} (key {e.key!r}): global shape {tuple(md.size)} in the file, "
                              f"{shapes[e.key]} expected from the tree and specs")
        elif md.properties.dtype != e.dtype:
            bad_dtypes.append(f"{e.where} (key {e.key!r}): {md.properties.dtype} in the file, {e.dtype} in the tree")
    if kinds:
        raise CheckpointError(f"{who}: leaves of the wrong kind:\n{listing(kinds)}")
    if bad_shapes:
        raise CheckpointShapeError(
            f"{who}: {len(bad_shapes)} tensor(s) have another global shape in the checkpoint:\n"
            f"{listing(bad_shapes)}\nFix: build `like` from the same model config; the global shape is "
            f"what the blocks of every rank add up to under the specs."
        )
    if bad_dtypes and not cast:
        raise CheckpointDTypeError(
            f"{who}: {len(bad_dtypes)} tensor(s) have another dtype in the checkpoint:\n{listing(bad_dtypes)}\n"
            f"Fix: pass cast=True to convert them to the tree's dtypes, or build `like` in the stored dtypes."
        )


def _key_hint(missing: list[str], stored: list[str]) -> str:
    """Suggest a prefix key_map when the file's keys are ours under a common prefix."""
    prefixes = set()
    for key in missing:
        found = [s[: -len(key)] for s in stored if s.endswith("." + key)]
        if len(found) != 1:
            break
        prefixes.add(found[0])
    else:
        if len(prefixes) == 1:
            prefix = prefixes.pop()
            return f"Fix: the file holds them under the prefix {prefix!r}: pass key_map=lambda k: {prefix!r} + k."
    sample = ", ".join(repr(k) for k in sorted(stored)[:5])
    return (f"Fix: check the key names (the file has e.g. {sample}); pass key_map= to rename, or "
            f"sf.checkpoint.contents(path) to list them.")


def export_full(path, unshard, shards: Any, mesh, *, key_map: KeyMap = None,
                aliases: Mapping[str, str] | None = None, format: str | None = None) -> dict[str, Any]:
    """Gather full parameters and write them as one plain state dict file on rank 0 (collective).

    For inference users: the file is `torch.save({name: tensor})` (or safetensors when
    `format="safetensors"` or the path ends in `.safetensors`, if the package is installed),
    with the dotted names of `load`'s keys: for `sf.functional` params, a module's
    `load_state_dict` takes it (add `aliases=tied_keys(model)` for `strict=True`).

    Args:
      path: the file to write (atomically: a temp name, then rename).
      unshard: a `shard` step (its `unshard_params` is used) or a function shards -> full tree.
      shards: this rank's shards.
      mesh: the mesh of the shards (None: `shards` is already full).
      key_map, aliases: as for `save`.
      format: "torch" or "safetensors" (default: from the suffix).

    Returns:
      The full flat state dict `{name: tensor}` (on every rank).
    """
    who = "sf.checkpoint.export_full"
    path = os.fspath(path)
    fmt = format or ("safetensors" if path.endswith(".safetensors") else "torch")
    if fmt not in ("torch", "safetensors"):
        raise CheckpointError(f"{who}: format must be 'torch' or 'safetensors', got {format!r}")
    fn = getattr(unshard, "unshard_params", unshard)
    full = fn(shards)
    leaves, _ = named_leaves(full, None, key_map, who=who, what="params")
    leaves = add_aliases(leaves, aliases, key_map, who)
    state = {leaf.key: leaf.value.detach().cpu() if isinstance(leaf.value, torch.Tensor) else leaf.value
             for leaf in leaves}
    ranks = Ranks(mesh)

    def write():
        if ranks.rank != 0:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{_files.new_id()}"
        if fmt == "torch":
            torch.save(state, tmp)
        else:
            _save_safetensors(state, tmp, who)
        os.replace(tmp, path)

    agree(ranks, write, who)
    return state


def _save_safetensors(state: dict, path: str, who: str) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise CheckpointError(
            f"{who}: format 'safetensors' needs the safetensors package (pip install safetensors)"
        ) from err
    others = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if others:
        raise CheckpointError(f"{who}: safetensors holds tensors only; these leaves are not:\n{listing(others)}")
    seen: set[int] = set()
    tensors = {}
    for key, t in state.items():  # safetensors refuses shared storage (aliases, views): copy repeats
        ptr = t.untyped_storage().data_ptr()
        tensors[key] = t.clone().contiguous() if ptr in seen and t.numel() else t.contiguous()
        seen.add(ptr)
    save_file(tensors, path)


def contents(path) -> dict[str, Any]:
    """What a checkpoint holds: `{key: (global shape, dtype)}` for tensors, `{key: "object"}` for values.

    Example:
      >>> import shardfn as sf, torch, tempfile, os
      >>> path = sf.checkpoint.save(os.path.join(tempfile.mkdtemp(), "c"), {"w": torch.zeros(2, 3), "n": 7}, None)
      >>> sf.checkpoint.contents(path)
      {'n': 'object', 'w': ((2, 3), torch.float32)}
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ._dcp import read_metadata

    path = os.fspath(path)
    _files.check_complete(path, "sf.checkpoint.contents")
    out = {}
    for key, md in sorted(read_metadata(path).state_dict_metadata.items()):
        out[key] = "object" if isinstance(md, BytesStorageMetadata) else (tuple(md.size), md.properties.dtype)
    return out
