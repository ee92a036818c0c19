"""`sf.hf.load_shards`: a transformers checkpoint straight into this rank's shards.

The shards' layout is the step's own: `like` (the params tree of `sf.functional` on a
meta model) is laid out exactly as `step.shard_params` would lay out real params (same
plan, tensor-parallel specs and checks, via `_fsdp.api.lay_out`), and `local_bounds` (the
ranges `step.init_shards` draws) says which rows, and with tensor parallelism which
columns, of each leaf this rank holds. Those ranges are read from the files and
nothing else ([Note: reading only this rank's bytes] in _safetensors.py).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Mapping

import torch

from .. import _tree
from .._checkpoint._errors import (
    CheckpointDTypeError,
    CheckpointError,
    CheckpointKeyError,
    CheckpointShapeError,
    listing,
)
from .._checkpoint._keys import KeyMap, mapper, named_leaves
from .._checkpoint._layout import Ranks, agree
from .._errors import ShardingError, SpecError
from .._fsdp import api
from .._fsdp.init import local_bounds
from ._convert import Piece, identity, pieces
from ._safetensors import Header, ReadStats, read_box, read_header

__all__ = ["load_shards", "checkpoint_index"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
WHO = "sf.hf.load_shards"


def checkpoint_index(path) -> dict[str, str]:
    """`{tensor name: file path}` of a transformers checkpoint: a directory holding
    `model.safetensors` or `model.safetensors.index.json` (sharded), or one `.safetensors` file.

    Raises:
      CheckpointError: no safetensors weights there (naming what the directory holds).
    """
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return {name: path for name in read_header(path).entries}
    if not os.path.isdir(path):
        raise CheckpointError(f"{WHO}: no checkpoint at {path!r} (neither a directory nor a .safetensors file)")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{WHO}: {index!r} has no 'weight_map' dict; the index is damaged")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return {name: single for name in read_header(single).entries}
    held = sorted(os.listdir(path))
    fix = ("re-save it with model.save_pretrained(dir) (safetensors is transformers' default format)"
           if any(n.endswith((".bin", ".pt", ".pth")) for n in held) else
           "pass the directory model.save_pretrained(dir) wrote (it holds config.json and model*.safetensors)")
    raise CheckpointError(f"{WHO}: {path!r} holds no {SINGLE} and no {INDEX} (it holds {held[:12]}).\nFix: {fix}.")


def _config(path: str) -> dict:
    """The checkpoint's config.json, or {} (for the messages only)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        return config if isinstance(config, dict) else {}
    except (OSError, TypeError, ValueError):
        return {}


def _resolve(key: str, names: Mapping[str, str], tails: Mapping[str, str], aliases: Mapping[str, list[str]]):
    """The file's name for our `key`: itself; without its first component (a base-model
    checkpoint loaded into a model with a head, as transformers does); with one more
    leading component (the reverse); or a tied alias of it that the file holds."""
    for candidate in [key] + aliases.get(key, []):
        if candidate in names:
            return candidate
        rest = candidate.partition(".")[2]
        if rest and rest in names:
            return rest
        if candidate in tails:
            return tails[candidate]
    return None


_BUILD = threading.Lock()  # the rank threads of a simulated mesh build it at once


def _checkpoint_model(path: str, config: dict):
    """The checkpoint's model class on the meta device (for its conversion table), or None.

    Built by the class's constructor (its parameters' dtype does not matter here): transformers'
    `from_config` sets the process-wide default dtype around the build and puts back what it
    found, which, from several rank threads at once, left another thread's dtype behind."""
    if not config.get("model_type"):
        return None
    try:
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(path)
        cls = next((getattr(transformers, a) for a in config.get("architectures") or [] if hasattr(transformers, a)),
                   None)
        with _BUILD, torch.device("meta"):
            if cls is None:
                cls = transformers.AutoModel._model_mapping[type(cfg)]
            return cls(cfg)
    except Exception:  # noqa: BLE001 - no model to ask: the names are taken as they are
        return None


def load_shards(step, path, like: Any, *, cast: bool = False, key_map: KeyMap = None,
                tied: Mapping[str, str] | None = None, strict: bool = True, return_stats: bool = False,
                model=None):
    """This rank's shards of a transformers checkpoint, reading only this rank's rows.

    Collective: every rank of `step.mesh` calls it (inside `mesh.run`, or under torchrun)
    with the same arguments. Each rank reads the files' headers and, per leaf, only the
    byte range of its own block: its dim-0 chunk (FSDP, HSDP), with `param_specs` the
    rows of its tensor-parallel block, from which it takes its columns. No rank ever
    builds the full model; beyond its shards it holds one leaf's rows at a time.

    Args:
      step: the `sf.shard` step the shards are for (its mesh, `shard_axes`,
        `param_specs` and units decide the layout, as for `step.shard_params`).
      path: a directory written by `model.save_pretrained` (`model.safetensors`, or
        `model.safetensors.index.json` and its files), or one `.safetensors` file.
      like: the params tree to fill, e.g. `sf.functional(model)[1]` of the model built on
        the meta device (`with torch.device("meta"): model = AutoModelForCausalLM.from_config(cfg)`):
        its tree, shapes and dtypes. Tied parameters appear once in it, so a checkpoint
        without `lm_head.weight` (tied to the embeddings) loads as is.
      cast: convert each tensor to `like`'s dtype (e.g. a bf16 checkpoint into fp32
        master shards); without it a dtype difference is an error.
      key_map: our dotted key (the module's `state_dict` name) -> the file's name, as a
        callable or a dict, for checkpoints whose names differ. Without it the names are
        transformers' own: the checkpoint's tensors are found through transformers'
        conversion table, as `from_pretrained` finds them (renames such as GPT-NeoX's
        `embed_out` -> `lm_head`, per-expert tensors fused into Qwen3-MoE's and Mixtral's
        `experts.gate_up_proj`: [Note: checkpoint names through transformers' conversion
        table] in shardfn/_hf/_convert.py).
      tied: `{other name: our name}` (`sf.checkpoint.tied_keys(model)`): names under which
        the file may hold a tied parameter; they are read when our name is absent and
        are not "unexpected" when both are present.
      strict: tensors in the file that `like` has no place for are an error; False
        ignores them.
      return_stats: also return a `ReadStats` of the bytes this rank read.
      model: the transformers model `like` is the parameters of (its class and config choose
        the conversion table); default: the class and config the checkpoint's config.json
        names, built on the meta device.

    Returns:
      The shards (`like`'s structure; each leaf this rank's block, on `mesh.device`), or
      `(shards, stats)` with `return_stats`. `step(shards, batch)`, `step.unshard_params`
      and `step.specs` treat them as `step.shard_params`' own.

    Raises:
      CheckpointKeyError: parameters missing from the checkpoint, or (`strict`) tensors
        in it that `like` lacks, listed with a fix.
      CheckpointShapeError / CheckpointDTypeError: a tensor's shape or dtype in the file
        differs from `like`'s (naming the key and both shapes / dtypes).
      CheckpointError: no safetensors checkpoint at `path`, or a damaged file.
      ShardingError: called outside a rank. Every rank raises when any rank fails.

    Example:
      >>> import shardfn as sf, torch, tempfile
      >>> from transformers import LlamaConfig, LlamaForCausalLM
      >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      ...                   num_attention_heads=2, num_key_value_heads=2)
      >>> path = tempfile.mkdtemp()
      >>> LlamaForCausalLM(cfg).save_pretrained(path)
      >>> with torch.device("meta"):
      ...     apply_fn, like = sf.functional(LlamaForCausalLM(cfg))
      >>> mesh = sf.local_mesh({"data": 2})
      >>> step = sf.shard(lambda p, ids: apply_fn(p, ids, labels=ids, use_cache=False).loss, mesh)
      >>> def per_rank():
      ...     shards, stats = sf.hf.load_shards(step, path, like, return_stats=True)
      ...     return tuple(shards["model"]["embed_tokens"]["weight"].shape), stats.data_bytes == stats.wanted_bytes
      >>> mesh.run(per_rank)
      [((32, 32), True), ((32, 32), True)]
    """
    mesh, cfg = step.mesh, step.config
    if not mesh.in_rank():
        raise ShardingError(
            f"{WHO}: runs on every rank (each reads its own rows); this thread is not a rank of the simulated "
            f"mesh {mesh.shape}.\nFix: call it inside mesh.run(...), e.g. mesh.run(lambda: train(...))."
        )
    path = os.fspath(path)
    paths, leaves, treedef = _tree.flatten_with_paths(like)
    for p, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor):
            raise SpecError(f"{WHO}: like{_tree.keystr(p)} is a {type(x).__name__}, not a tensor.\nFix: pass the "
                            f"params tree of sf.functional(model) (a meta model is enough: shapes and dtypes).")
    metas = [torch.empty(x.shape, dtype=x.dtype, device="meta") for x in leaves]
    api.check_same_everywhere(step, paths, metas)
    plan, _ = api.lay_out(step, _tree.unflatten(treedef, metas), paths, metas, treedef, allow_meta=True)
    boxes = local_bounds(plan, mesh, cfg.shard_axes, [tuple(x.shape) for x in metas])
    keys = [leaf.key for leaf in named_leaves(like, None, key_map, who=WHO, what="like")[0]]
    shapes = [tuple(m.shape) for m in metas]
    stats = ReadStats()
    out: dict[int, torch.Tensor] = {}

    def read_all():
        index = checkpoint_index(path)
        aliases: dict[str, list[str]] = {}
        to_file = mapper(key_map)
        for other, ours in (tied or {}).items():
            aliases.setdefault(to_file(ours), []).append(to_file(other))
        tails: dict[str, str] = {}
        for name in index:
            rest = name.partition(".")[2]
            if rest:
                tails[rest] = None if rest in tails else name  # None: ambiguous
        tails = {k: v for k, v in tails.items() if v is not None}
        parts = _pieces(path, keys, shapes, metas, key_map, model)
        legacy = _legacy_names(index) if key_map is None else {}
        flat = [(i, piece, _resolve(piece.name, index, tails, aliases) or legacy.get(piece.name))
                for i in range(len(keys)) for piece in parts[i]]
        _check_keys(path, index, flat, paths, metas, {to_file(k) for k in tied or {}}, strict)
        headers: dict[str, Header] = {}
        for file in sorted({index[s] for _, _, s in flat}):
            headers[file] = read_header(file, stats)
        entries = []
        for _, _, source in flat:
            entry = headers[index[source]].entries.get(source)
            if entry is None:
                raise CheckpointError(f"{WHO}: the index names {index[source]!r} for {source!r}, but that file does "
                                      f"not hold it; the checkpoint is damaged")
            entries.append(entry)
        _check_shapes(flat, paths, metas, entries, cast)
        blocks = [torch.empty([b - a for a, b in boxes[i]], dtype=metas[i].dtype) for i in range(len(keys))]
        order = sorted(range(len(flat)), key=lambda j: (index[flat[j][2]], entries[j].begin))
        file, f = None, None
        try:
            for j in order:
                i, piece, source = flat[j]
                within = piece.within(boxes[i])
                if within is None:  # no part of this piece is this rank's
                    continue
                if index[source] != file:
                    if f is not None:
                        f.close()
                    file = index[source]
                    f = open(file, "rb")
                file_box, place = within
                part = read_box(f, entries[j], file_box, stats)
                target = blocks[i][place]
                target.copy_(piece.to_ours(part, target.shape))
        finally:
            if f is not None:
                f.close()
        for i, block in enumerate(blocks):
            out[i] = block.to(device=mesh.device)

    agree(Ranks(mesh), read_all, WHO)
    shards = _tree.unflatten(treedef, [out[i] for i in range(len(leaves))])
    return (shards, stats) if return_stats else shards


def _pieces(path: str, keys, shapes, metas, key_map, model) -> list[list[Piece]]:
    """Per leaf, the checkpoint tensors it is read from: transformers' conversion table's
    ([Note: checkpoint names through transformers' conversion table]), or with `key_map` the
    names it gives."""
    if key_map is not None:
        return [identity(k, s) for k, s in zip(keys, shapes)]
    model = model if model is not None else _checkpoint_model(path, _config(path))
    if model is None:
        return [identity(k, s) for k, s in zip(keys, shapes)]
    return pieces(model, keys, shapes, [m.dtype for m in metas])


def _legacy_names(index) -> dict[str, str]:
    """{today's name: the file's} for the file's names that transformers' legacy renames
    change on load (`LayerNorm.gamma` / `beta` of old BERT checkpoints, weight-norm's
    `weight_g` / `weight_v`), as `from_pretrained` applies them."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import apply_renamings
    except ImportError:
        return {}
    renamings = get_checkpoint_conversion_mapping("legacy") or []
    out = {}
    for name in index:
        renamed = apply_renamings(name, renamings)
        if renamed != name:
            out[renamed] = name
    return out


def _check_keys(path, index, flat, paths, metas, tied, strict) -> None:
    missing = [f"{piece.name!r} (like{_tree.keystr(paths[i])}, shape {piece.shape})" for i, piece, s in flat if s is None]
    used = set(s for _, _, s in flat if s is not None)
    unexpected = [n for n in index if n not in used and n not in tied] if strict else []
    if not (missing or unexpected):
        return
    config = _config(path)
    named = f" (its config.json names {config['architectures']})" if config.get("architectures") else ""
    parts = [f"{WHO}: `like` and the checkpoint {path!r}{named} do not hold the same tensors."]
    fixes = []
    if missing:
        parts.append(f"Missing from the checkpoint ({len(missing)}):\n{listing(missing)}")
        fixes.append("build `like` from the model class and config the checkpoint was saved from "
                     "(AutoConfig.from_pretrained(path)); names that differ: key_map={our key: file key}")
        if config.get("tie_word_embeddings"):
            fixes.append("the checkpoint ties the output embeddings to the input ones (its config.json has "
                         "tie_word_embeddings=true, so lm_head.weight is not stored): build the model with "
                         "tie_word_embeddings=True, and sf.functional holds that weight once")
    if unexpected:
        parts.append(f"In the checkpoint but not in `like` ({len(unexpected)}):\n{listing(sorted(unexpected))}")
        fixes.append("pass tied=sf.checkpoint.tied_keys(model) when they are tied copies, or strict=False to "
                     "ignore them")
    raise CheckpointKeyError("\n".join(parts) + "\nFix: " + "; ".join(fixes) + ".")


def _check_shapes(flat, paths, metas, entries, cast: bool) -> None:
    shapes, dtypes = [], []
    for (i, piece, source), entry in zip(flat, entries):
        name, meta = f"{source!r} (like{_tree.keystr(paths[i])})", metas[i]
        if entry.shape != piece.shape:
            shapes.append(f"{name}: the checkpoint holds {entry.shape}, like has {piece.shape}")
        elif entry.dtype != meta.dtype and not cast:
            dtypes.append(f"{name}: the checkpoint holds {entry.dtype}, like has {meta.dtype}")
    if shapes:
        raise CheckpointShapeError(
            f"{WHO}: tensors whose shape in the checkpoint differs from like's:\n{listing(shapes)}\nFix: build the "
            f"model from the checkpoint's own config (transformers.AutoConfig.from_pretrained(path): vocab_size, "
            f"hidden_size, ...), then take like from sf.functional(model)."
        )
    if dtypes:
        raise CheckpointDTypeError(
            f"{WHO}: tensors whose dtype in the checkpoint differs from like's:\n{listing(dtypes)}\nFix: pass "
            f"cast=True to convert them while reading (e.g. bf16 weights into fp32 master shards), or build the "
            f"model in the checkpoint's dtype."
        )
