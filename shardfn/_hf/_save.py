"""`sf.hf.save_pretrained`: a sharded model written out as transformers writes it.

[Note: exporting one unit at a time] The files' layout (which tensor goes to which
file, at which offset) follows from the model's shapes and the dtypes alone, so rank 0
writes every header first; then all ranks gather the parameters one unit at a time
(`iter_unshard`, the schedule `unshard_params` uses) and rank 0 writes each leaf at its
offset as it arrives. The most any rank holds beyond its shards is one unit's full
parameters, twice for a moment (the all-gather's padded output and its unpadded copy),
never the whole model. Everything is written into `<path>.tmp-<id>` and renamed to
`<path>` at the end (one `rename`, atomic on POSIX); a failure on rank 0 lets the
gathers run to the end (the other ranks are in them) and then raises on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import uuid
from typing import Any

import torch

from .. import _tree
from .._checkpoint._errors import CheckpointError
from .._checkpoint._keys import KeyMap, named_leaves
from .._checkpoint._layout import Ranks, agree
from .._errors import ShardingError, bullet_list
from .._fsdp import api
from .._fsdp.unshard import iter_unshard
from .._functional import _walk
from ._convert import identity, pieces
from ._load import INDEX, SINGLE
from ._safetensors import Writer

__all__ = ["save_pretrained", "SaveStats", "parse_size"]

WHO = "sf.hf.save_pretrained"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """What `save_pretrained` wrote, and the most it held beyond the shards."""

    path: str
    files: tuple[str, ...]  # the weight files, in order
    total_bytes: int  # tensor bytes written (the index's metadata.total_size)
    peak_unit_bytes: int  # the largest unit's full parameters: what one gather holds


def parse_size(size) -> int:
    """Bytes of `5_000_000`, `"5GB"` (10**9) or `"500MiB"` (2**20), as transformers reads them."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    unit = match and _UNITS.get(match.group(2).upper())
    if not match or unit is None:
        raise CheckpointError(f"{WHO}: max_shard_size {size!r} is not a size.\nFix: an int of bytes, or e.g. "
                              f"'5GB', '500MB', '64MiB'.")
    return int(float(match.group(1)) * unit)


def _layout(names: list[str], shapes, dtypes, max_bytes: int) -> list[list[int]]:
    """Leaf indices per file, in order: a new file whenever the next tensor would overflow
    this one (a tensor larger than `max_bytes` gets a file of its own), as transformers does."""
    files: list[list[int]] = [[]]
    size = 0
    for i in range(len(names)):
        n = torch.Size(shapes[i]).numel() * dtypes[i].itemsize
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += n
    return files


def save_pretrained(path, step, shards: Any, model, *, max_shard_size="5GB", dtype: torch.dtype | None = None,
                    key_map: KeyMap = None, overwrite: bool = False) -> SaveStats:
    """Write sharded parameters as a transformers checkpoint directory (collective).

    `AutoModelForCausalLM.from_pretrained(path)` (or the model's class) loads the result:
    `config.json` (from `model.config`), `generation_config.json` when the model can
    generate, and the weights as `model.safetensors`, or, above `max_shard_size`, as
    `model-0000i-of-0000n.safetensors` files with `model.safetensors.index.json`. A tied
    weight is written once, under its first name (transformers drops `lm_head.weight`
    when `tie_word_embeddings`, and ties it again on load). Parameters are gathered one
    unit at a time and written by rank 0 ([Note: exporting one unit at a time]); the
    directory appears at `path` atomically, once complete.

    Args:
      path: the directory to create.
      step: the `sf.shard` step of the shards.
      shards: this rank's shards (from `step.shard_params`, `step.init_shards`,
        `sf.hf.load_shards`, or trained).
      model: the model the shards are the parameters of (it may live on the meta
        device): its config is written, and its parameter tree gives the global shapes
        and the order of the tensors in the files.
      max_shard_size: the largest weight file, as bytes or "5GB" / "500MB" / "64MiB"
        (transformers' default is "5GB").
      dtype: the dtype to write floating-point tensors in (e.g. `torch.bfloat16`);
        default: the shards' own. `config.json` records it.
      key_map: our dotted key -> the name to write (callable or dict). Without it the
        names (and the split of fused tensors) are those `model.save_pretrained` writes,
        from transformers' conversion table (GPT-NeoX's `lm_head` as `embed_out`, Qwen3-MoE's
        and Mixtral's fused experts one tensor per expert: [Note: checkpoint names through
        transformers' conversion table] in shardfn/_hf/_convert.py).
      overwrite: replace an existing `path` (atomically); otherwise it must not exist.

    Returns:
      A `SaveStats` (the same on every rank).

    Raises:
      ShardingError: `model`'s parameter tree is not the shards' (naming the keys), or
        called outside a rank.
      CheckpointError: `path` exists (without `overwrite`), or writing failed on rank 0;
        every rank raises.

    Example:
      >>> import shardfn as sf, torch, tempfile, os
      >>> from transformers import GPT2Config, GPT2LMHeadModel
      >>> model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
      ...                                    bos_token_id=0, eos_token_id=0))
      >>> apply_fn, params = sf.functional(model)
      >>> mesh = sf.local_mesh({"data": 2})
      >>> step = sf.shard(lambda p, ids: apply_fn(p, ids, labels=ids, use_cache=False).loss, mesh)
      >>> path = os.path.join(tempfile.mkdtemp(), "gpt2-tiny")
      >>> stats = mesh.run(lambda: sf.hf.save_pretrained(path, step, step.shard_params(params), model))[0]
      >>> sorted(os.listdir(path)), stats.total_bytes
      (['config.json', 'generation_config.json', 'model.safetensors'], 114176)
    """
    mesh = step.mesh
    if not mesh.in_rank():
        raise ShardingError(
            f"{WHO}: every rank takes part (the parameters are gathered one unit at a time); this thread is not "
            f"a rank of the simulated mesh {mesh.shape}.\nFix: call it inside mesh.run(...)."
        )
    path = os.fspath(path)
    max_bytes = parse_size(max_shard_size)
    order: list[tuple[tuple, str]] = []
    full_tree = _walk(model, (), "", set(), order, {})
    keys, shapes, dtypes = _describe(full_tree, shards, key_map, dtype)
    position = {p: i for i, (p, _) in enumerate(order)}
    paths = _tree.flatten_with_paths(full_tree)[0]
    by_module = sorted(range(len(keys)), key=lambda i: position.get(paths[i], len(order) + i))
    parts = ([identity(k, s) for k, s in zip(keys, shapes)] if key_map is not None else
             pieces(model, keys, shapes, dtypes))
    written = [(i, piece) for i in by_module for piece in parts[i]]  # the file's tensors, in order
    files = [[written[j] for j in group] for group in
             _layout([p.name for _, p in written], [p.shape for _, p in written], [dtypes[i] for i, _ in written],
                     max_bytes)]
    names = ([SINGLE] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    total = sum(torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, dtypes))
    ranks = Ranks(mesh)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    state: dict[str, Any] = {}

    def prepare():  # rank 0: the directory, the configs, every file's header
        if ranks.rank != 0:
            return
        if os.path.exists(path) and not overwrite:
            raise CheckpointError(f"{WHO}: {path!r} already exists.\nFix: save to a new directory, or pass "
                                  f"overwrite=True to replace it atomically.")
        os.makedirs(tmp)
        _write_configs(model, tmp, next((d for d in dtypes if d.is_floating_point), None))
        writers, where = [], {}
        for name, group in zip(names, files):
            writers.append(Writer(os.path.join(tmp, name), [(p.name, p.shape, dtypes[i]) for i, p in group],
                                  {"format": "pt"}))
            where.update({p.name: writers[-1] for _, p in group})
        state["writers"], state["where"] = writers, where

    try:
        agree(ranks, prepare, WHO)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    failure: list[BaseException] = []
    for i, leaf in iter_unshard(step, shards):  # every rank gathers; rank 0 writes
        if ranks.rank == 0 and not failure:
            try:
                if tuple(leaf.shape) != shapes[i]:
                    raise ShardingError(f"{WHO}: {keys[i]!r}: the gathered leaf has shape {tuple(leaf.shape)}, the "
                                        f"model's parameter {shapes[i]}.\nFix: pass the model these shards belong to.")
                for piece in parts[i]:
                    state["where"][piece.name].write(piece.name, piece.out_of(leaf.to(dtypes[i])))
            except Exception as err:  # noqa: BLE001 - the others are in the gathers: finish them, then raise
                failure.append(err)

    def finish():
        if ranks.rank != 0:
            return
        try:
            if failure:
                raise failure[0]
            for writer in state["writers"]:
                writer.close()
            if len(files) > 1:
                weight_map = {p.name: name for name, group in zip(names, files) for _, p in group}
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                with open(os.path.join(tmp, INDEX), "w") as f:
                    json.dump(index, f, indent=2)
                    f.write("\n")
            _publish(tmp, path)
        except BaseException:
            for writer in state.get("writers", []):
                if not writer.file.closed:
                    writer.file.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    agree(ranks, finish, WHO)
    plan = api.plan_of(step, shards)
    peak = max((u.full_numel * u.dtype.itemsize for u in plan.units if u.sharded), default=0)
    return SaveStats(path, tuple(names), total, peak)


def _describe(full_tree, shards, key_map, dtype):
    """Keys, global shapes and output dtypes per leaf; the model's tree must be the shards'."""
    full_paths, full_leaves, full_def = _tree.flatten_with_paths(full_tree)
    shard_paths, shard_leaves, shard_def = _tree.flatten_with_paths(shards)
    if full_def != shard_def:
        ours, theirs = set(map(_tree.keystr, full_paths)), set(map(_tree.keystr, shard_paths))
        lines = ([f"shards{k}: not a parameter of the model" for k in sorted(theirs - ours)] +
                 [f"model{k}: not in the shards" for k in sorted(ours - theirs)])
        raise ShardingError(
            f"{WHO}: the model's parameter tree is not the shards' tree:\n{bullet_list(lines[:20])}\nFix: pass the "
            f"model whose sf.functional params the shards were made from (a meta-device copy is enough)."
        )
    keys = [leaf.key for leaf in named_leaves(full_tree, None, key_map, who=WHO, what="params")[0]]
    shapes = [tuple(x.shape) for x in full_leaves]
    dtypes = [dtype if (dtype is not None and s.is_floating_point()) else s.dtype for s in shard_leaves]
    return keys, shapes, dtypes


def _write_configs(model, directory: str, dtype) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ShardingError(f"{WHO}: the model ({type(model).__name__}) has no transformers config.\nFix: pass a "
                            f"transformers PreTrainedModel; for other modules use sf.checkpoint.export_full.")
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    if dtype is not None:  # what the weights are written in, as transformers records it
        config.dtype = dtype
    config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        generation.save_pretrained(directory)


def _publish(tmp: str, path: str) -> None:
    """Rename the finished `tmp` to `path`, replacing an old `path` by a swap of renames."""
    old = None
    if os.path.exists(path):
        old = f"{tmp}.old"
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
