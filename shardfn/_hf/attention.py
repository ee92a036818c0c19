"""Context parallelism for transformers models: ring and Ulysses as attention implementations.

[Note: transformers attention over a split sequence] transformers 5 looks a model's
attention up by name (`config._attn_implementation`) in `transformers.AttentionInterface`,
and its mask builder by the same name in `AttentionMaskInterface`. `register_attention()`
registers two names:

- `"shardfn_ring"`: `sf.nn.ring_attention` over the sequence axis;
- `"shardfn_ulysses"`: `sf.nn.ulysses_attention` (the heads, query and K/V, divide by N).

[Note: only causal LMs are split] The names are for causal LMs, trained with
`shard_sequence` + `causal_lm_loss` (next-token labels shifted before the split). A module
that attends both ways (`is_causal=False`: BERT's or ViT's encoder, T5's) is refused at its
first attention call, with the model_type and the fix: a bidirectional model trained by
that loss would see the very tokens it is asked to predict. T5's relative position bias,
Gemma 2's softcap and a sliding window are refused too (the sf.nn attentions have none).

The attention function gets this rank's q, k, v blocks (B, H, T_local, D) and calls the
sf.nn attention with the causal mask by *global* position (contiguous or zig-zag) and GQA
as it comes (K/V heads not repeated). The mask builder hands the 2-D key-padding mask
through as it is (this rank's (B, T_local) columns, a bool key mask for the sf.nn call):
transformers' own builders would make a (T_local x T_local) causal mask of local
positions, which is wrong across ranks. The sequence axis and layout reach the attention
as keyword arguments of the model call (`seq_axis=`, `seq_layout=`), which transformers
passes down to every attention call; `causal_lm_loss` passes them.

The model sees global positions because the batch carries them: `shard_sequence` builds
`position_ids = arange(T)` for the global batch, lays it out like the tokens (zig-zag
reorders it) and scatters it, so the rotary embedding of every rank rotates its tokens by
their global positions, in either layout, with no change to the model.

[Note: shifted labels across the split] A causal LM predicts token t+1 at position t.
transformers shifts the labels inside its loss (`labels[..., 1:]` against
`logits[..., :-1, :]`), which on a split sequence would drop each block's last position
and pair its first with its own token. So `shard_sequence` shifts the *global* labels
once, before the split (`shift_labels[:, t] = labels[:, t + 1]`, -100 at the end), and
the loss pairs every local position with its shifted label: the last token of block i is
scored against the first token of block i + 1. Tokens labelled -100 (the last position,
padding) count for nothing, so ranks hold different numbers of scored tokens;
`shard_sequence` therefore also gives each token its weight in the global token mean,
scaled by the number of ranks (`loss_weight / num_items`, two integer tensors), and
`sf.shard`'s mean over `data_axes=(batch_axes..., seq_axis)` is then exactly the global
token mean one device computes, in the model's dtype (fp64 stays fp64; transformers' own
loss casts to fp32).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .. import nn as _sfnn
from .._errors import ShardingError

__all__ = ["ATTENTIONS", "register_attention", "shard_sequence", "causal_lm_loss", "token_weights"]

ATTENTIONS = {"shardfn_ring": "ring_attention", "shardfn_ulysses": "ulysses_attention"}
IGNORE = -100  # transformers' ignore_index


def _attention_function(name: str):
    attend = getattr(_sfnn, ATTENTIONS[name])

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                  seq_axis="seq", seq_layout="contiguous", **kwargs):
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        where = f"attn_implementation={name!r} in {type(module).__name__}" + \
            (f" (model_type {model_type!r})" if model_type else "")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        problems = []
        if not causal:  # [Note: only causal LMs are split]
            problems.append("bidirectional attention (is_causal=False): the model is not a causal LM, and "
                            "sf.hf's context parallelism trains causal LMs (shard_sequence shifts the labels for "
                            "causal_lm_loss's next-token loss); train it without a sequence axis (sf.shard over "
                            "'data'), or call sf.nn.ring_attention(..., causal=False) in a model of your own")
        if dropout:
            problems.append(f"attention dropout {dropout} (config.attention_dropout): the sf.nn attentions have "
                            f"none; set it to 0.0 or call model.eval()")
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if window is not None:
            problems.append(f"a sliding window of {window} tokens: only full causal attention is split; set "
                            f"config.sliding_window=None (or use_sliding_window=False)")
        if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
            problems.append("a logit softcap or a position bias (Gemma 2, T5): not supported by the sf.nn attentions")
        if query.shape[2] != key.shape[2]:
            problems.append(f"q has {query.shape[2]} positions but k has {key.shape[2]}: a KV cache is in use; "
                            f"pass use_cache=False when training")
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
            problems.append(f"a {attention_mask.dim()}-D attention mask {tuple(attention_mask.shape)}: pass the 2-D "
                            f"key-padding mask (B, T_local) of this rank's tokens, or none")
        if problems:
            raise ShardingError(f"{where}: " + "; ".join(problems) + ".")
        mask = None if attention_mask is None else attention_mask.to(torch.bool)
        if name == "shardfn_ulysses":
            key, value = _kv_heads_for_ulysses(query, key, value, seq_axis)
        out = attend(query, key, value, seq_axis, causal=causal, scale=scaling, mask=mask, layout=seq_layout)
        return out.transpose(1, 2).contiguous(), None  # (B, T_local, H, D), no attention weights

    attention.__name__ = f"{name}_attention"
    return attention


def _kv_heads_for_ulysses(query, key, value, axis):
    """Ulysses splits the heads over the axis: with fewer K/V heads than its size N (GQA,
    N a multiple of Hkv, H of N), repeat each K/V head N / Hkv times, which keeps every
    query head with its own K/V head (head j of H uses K/V head j // (H / Hkv) either way)."""
    from .._collectives import axis_size

    n, h, hkv = axis_size(axis), query.shape[1], key.shape[1]
    if hkv % n and h % n == 0 and n % hkv == 0:
        key, value = key.repeat_interleave(n // hkv, dim=1), value.repeat_interleave(n // hkv, dim=1)
    return key, value


def _padding_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """The mask builder for our names: the 2-D key-padding mask as given ([Note: transformers
    attention over a split sequence]); causality is the sf.nn attention's, by global position."""
    return None if attention_mask is None else attention_mask.to(torch.bool)


def register_attention() -> tuple[str, ...]:
    """Register `"shardfn_ring"` and `"shardfn_ulysses"` as transformers attention implementations.

    Importing `sf.hf` calls it once; calling it again is harmless. Then build or switch a
    model with `attn_implementation="shardfn_ring"` (`from_pretrained`, `from_config`) or
    `model.set_attn_implementation("shardfn_ring")`, and call it through
    `sf.hf.causal_lm_loss` inside `sf.shard` over a mesh with a sequence axis
    ([Note: transformers attention over a split sequence]).

    Returns:
      The registered names.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in ATTENTIONS:
        AttentionInterface.register(name, _attention_function(name))
        AttentionMaskInterface.register(name, _padding_mask)
    return tuple(ATTENTIONS)


# -- the batch and the loss -------------------------------------------------------------------


def _axes(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def shard_sequence(batch: Mapping, mesh=None, *, seq_axis: str = "seq", batch_axes="data",
                   layout: str = "contiguous") -> dict:
    """This rank's block of a causal-LM batch, its sequence split over `seq_axis`.

    From the global batch (the same on every rank, as for `sf.scatter`), builds the model
    inputs a sequence-split transformers model needs and scatters them, batch rows over
    `batch_axes` and the sequence over `seq_axis` (`P(batch_axes, seq_axis)`):

    - `input_ids`, and `attention_mask` if given: this rank's tokens;
    - `position_ids`: their global positions (rotary embeddings see the whole sequence);
    - `shift_labels`: the labels shifted by one *before* the split ([Note: shifted labels
      across the split]): each block's last token is scored against the next block's first;
    - `loss_weight` (int: the number of ranks where the token is scored, else 0) and
      `num_items` (int: the scored tokens of the global batch, on every token): a token's
      weight in the rank's loss is their ratio, so that `sf.shard`'s mean over
      `data_axes=(*batch_axes, seq_axis)` of `causal_lm_loss` is the mean over every
      scored token of the global batch.

    With `layout="zigzag"` every tensor is first put through `sf.nn.zigzag` (rank i holds
    chunks i and 2N-1-i of 2N: balanced causal work for ring attention). With `mesh=None`
    the same dict comes back whole, for one device (the reference).

    Args:
      batch: {"input_ids": (B, T) int, optional "labels": (B, T) (default: input_ids; -100
        where a token is not scored), optional "attention_mask": (B, T), 1 for real tokens}.
      mesh: the mesh, or None for one device.
      seq_axis: the mesh axis the sequence is split over.
      batch_axes: the mesh axes (a name or a tuple; () for none) the batch rows are split over.
      layout: "contiguous" or "zigzag"; pass the same to `causal_lm_loss`.

    Returns:
      A dict of this rank's (B_local, T_local) tensors.

    Raises:
      ShardingError: a missing or non-2-D input_ids, labels or mask of another shape, a bad
        layout, a length that does not split over the axis (zigzag: 2N chunks).

    Example:
      >>> import shardfn as sf, torch
      >>> b = sf.hf.shard_sequence({"input_ids": torch.arange(8)[None]}, None)
      >>> b["shift_labels"].tolist(), b["position_ids"].tolist()
      ([[1, 2, 3, 4, 5, 6, 7, -100]], [[0, 1, 2, 3, 4, 5, 6, 7]])
    """
    from .._spec import P
    from .._shard_map import scatter
    from ..nn._layout import check_layout

    where = f"sf.hf.shard_sequence(seq_axis={seq_axis!r}, layout={layout!r})"
    check_layout(layout, where)
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        raise ShardingError(f"{where}: batch must be a dict with 'input_ids' (B, T) (and optionally 'labels', "
                            f"'attention_mask'), got {type(batch).__name__}"
                            f"{' with keys ' + str(list(batch)) if isinstance(batch, Mapping) else ''}.")
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    problems = [f"batch[{k!r}] has shape {tuple(x.shape)}" for k, x in batch.items()
                if isinstance(x, torch.Tensor) and (x.dim() != 2 or x.shape != ids.shape)]
    if ids.dim() != 2 or problems:
        raise ShardingError(f"{where}: input_ids, labels and attention_mask must be (B, T) alike; input_ids has "
                            f"shape {tuple(ids.shape)}" + "".join("; " + p for p in problems) + ".")
    axes = _axes(batch_axes)
    if mesh is not None:
        unknown = [a for a in axes + (seq_axis,) if a not in mesh.shape]
        if unknown:
            raise ShardingError(
                f"{where}: the mesh {dict(mesh.shape)} has no axis {unknown[0]!r} (batch_axes={batch_axes!r}, "
                f"seq_axis={seq_axis!r}).\nFix: build the mesh with a sequence axis and the batch axes, e.g. "
                f"{{'data': 2, {seq_axis!r}: 2}}, or pass seq_axis= / batch_axes= (() for none) to match it.")
    B, T = ids.shape
    shift = torch.cat([labels[:, 1:], torch.full((B, 1), IGNORE, dtype=labels.dtype, device=labels.device)], 1)
    if "attention_mask" in batch:  # a padded key is not a target either
        shift = shift.masked_fill(torch.cat([batch["attention_mask"][:, 1:], torch.zeros_like(ids[:, :1])], 1) == 0,
                                  IGNORE)
    scored = shift != IGNORE
    ranks = 1 if mesh is None else math.prod(mesh.shape[a] for a in axes + (seq_axis,))
    out = {"input_ids": ids, "position_ids": torch.arange(T, device=ids.device).expand(B, T),
           "shift_labels": shift, "loss_weight": scored.to(torch.int64) * ranks,
           "num_items": torch.full((B, T), max(int(scored.sum()), 1), dtype=torch.int64, device=ids.device)}
    if "attention_mask" in batch:
        out["attention_mask"] = batch["attention_mask"]
    if mesh is None:
        return out
    n = mesh.shape[seq_axis]
    if layout == "zigzag":
        out = {k: _sfnn.zigzag(x, n, 1) for k, x in out.items()}
    elif T % n:
        raise ShardingError(f"{where}: the sequence length {T} does not split over axis {seq_axis!r} of size {n}."
                            f"\nFix: pad the batch to a multiple of {n} tokens (labels -100, attention_mask 0).")
    spec = P(axes if len(axes) != 1 else axes[0], seq_axis) if axes else P(None, seq_axis)
    return {k: scatter(x.contiguous(), mesh, spec) for k, x in out.items()}


def token_weights(batch: Mapping, dtype: torch.dtype) -> torch.Tensor:
    """Each token's weight in its rank's loss, flattened: `loss_weight / num_items` in `dtype`
    ([Note: shifted labels across the split]). Kept as two integer tensors in the batch, so
    the batch holds no float leaf that `sf.shard` would ask to match the parameters' dtype."""
    return batch["loss_weight"].flatten().to(dtype) / batch["num_items"].flatten().to(dtype)


def causal_lm_loss(apply_fn, *, seq_axis: str | None = "seq", layout: str = "contiguous", **model_kwargs):
    """A loss function `loss(params, batch)` for a transformers causal LM, sequence-split or not.

    Calls `apply_fn(params, input_ids=..., position_ids=..., attention_mask=...,
    use_cache=False, seq_axis=..., seq_layout=...)` on this rank's block (`shard_sequence`)
    and returns `sum(cross_entropy(logits, shift_labels) * loss_weight / num_items)`: this rank's
    share of the global token mean, computed in the logits' dtype ([Note: shifted labels
    across the split]). Put it in `sf.shard(loss, mesh, data_axes=(*batch_axes, seq_axis))`
    with a model whose attention is `"shardfn_ring"` / `"shardfn_ulysses"`; with
    `seq_axis=None` (one device, any attention) it is the plain token-mean loss of
    `shard_sequence(batch, None)`.

    Args:
      apply_fn: from `sf.functional(model)` (with `remat=` or not).
      seq_axis: the sequence axis, or None for a model that sees the whole sequence.
      layout: "contiguous" or "zigzag", as given to `shard_sequence`.
      **model_kwargs: more keyword arguments of the model call.

    Returns:
      `loss(params, batch) -> scalar`.
    """
    from ..nn._layout import check_layout

    check_layout(layout, "sf.hf.causal_lm_loss")
    if seq_axis is not None:
        register_attention()
    cp = {} if seq_axis is None else {"seq_axis": seq_axis, "seq_layout": layout}

    def loss(params, batch):
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
        logits = apply_fn(params, **inputs, use_cache=False, **cp, **model_kwargs).logits  # (B, T_local, vocab)
        nll = F.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten(), ignore_index=IGNORE,
                              reduction="none")
        return (nll * token_weights(batch, nll.dtype)).sum()

    loss.__name__ = "causal_lm_loss"
    return loss
