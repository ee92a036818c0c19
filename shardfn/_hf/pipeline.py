"""`sf.hf.pipeline_stages`: a transformers `*ForCausalLM` as `sf.pipeline`'s pieces.

[Note: a decoder LM as pre / layers / post] A Llama-style causal LM is `embed_tokens`,
then N identical decoder layers fed the rotary `(cos, sin)` of the positions, then the
final `norm`, `lm_head` and the loss. `sf.pipeline` wants one tensor between stages, so
the pieces are:

- `pre`: `embed_tokens(input_ids)` (B, T, C), run on the first stage;
- each layer: the decoder layer (one `sf.functional` of the model's first layer, fed each
  layer's parameters), which computes its rotary `(cos, sin)` at positions 0..T-1 from
  the model's `rotary_emb` (a buffer, no parameters: recomputing it per layer is cheaper
  than sending it between stages) and runs causal attention with the model's own
  attention implementation (no mask tensor: causal by `is_causal`);
- `post`: `norm`, `lm_head`, and the next-token cross entropy of the microbatch in the
  logits' dtype (labels shifted inside each sequence; a microbatch holds whole sequences).

The parameters are the `sf.functional(model)` tree regrouped: `split(params)` gives
`{"pre": {"embed_tokens": ...}, "layers": <stacked decoder layers>, "post": {"norm": ...,
"lm_head": ...}}` and `join(...)` the inverse. Tied embeddings (`lm_head.weight` is
`embed_tokens.weight`, e.g. Gemma, small Qwen2): the tree holds the weight once, in
`pre`; the loss hands it to `post` as well, so its gradient is the sum of both uses, as
on one device.

The loss is the pipeline's mean over microbatches of each microbatch's share of the batch's
token mean (`loss_weight / num_items` of `shard_sequence(batch, None)`, times M): exactly the token mean
of the whole batch, labels -100 included.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .._errors import ShardingError
from .._params_view import ParamsView, materialize
from .._pipeline import pipeline as _pipeline
from .._pipeline import stack_layers, unstack_layers
from .attention import IGNORE, shard_sequence, token_weights

__all__ = ["pipeline_stages", "PipelineStages"]

_PIECES = ("embed_tokens", "layers", "norm", "rotary_emb")
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")

# [Note: which decoder LMs] `_MODEL_TYPES` are the transformers models whose base model's
# forward is exactly `embed_tokens` -> each decoder layer (hidden states, rotary
# `position_embeddings`, a causal mask) -> `norm`, and whose head reads the norm's output.
# Phi-3 fuses q/k/v and gate/up inside its layers and passes `config.sliding_window` to its
# attention (checked, as Mistral's); it is checked against one device in
# tests/hf/test_hf_families.py ("PP"). Mixture-of-experts layers (Qwen3-MoE, Mixtral:
# `config.num_experts` / `num_local_experts`) are refused: sf.pipeline checks every stage
# on meta tensors before it runs (shardfn/_pipeline/checks.py), and a router's dispatch
# (`nonzero` of its choice: how many tokens each expert gets) has no meta shape. Gemma
# scales its embedding by sqrt(hidden size): transformers 5 does it inside `embed_tokens`
# (its `embed_scale`), so `pre` scales too and Gemma is supported there (the families
# table's PP cell, ≤ 1e-9); where the model's forward does it (transformers 4), refused.


def _decoder(model, where: str):
    """The base model (`model.model`), checked to be embed -> layers -> norm with rotary."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    missing = [name for name in _PIECES if base is None or not hasattr(base, name)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if missing or head is None or not isinstance(base.layers, torch.nn.ModuleList):
        raise ShardingError(
            f"{where}: {type(model).__name__} is not a decoder LM of the Llama shape (model.{prefix} with "
            f"embed_tokens, a ModuleList of layers, norm and rotary_emb, and an output head); missing: "
            f"{missing or ['the output head']}.\nFix: use a Llama-style *ForCausalLM (model_type "
            f"{', '.join(_MODEL_TYPES)}), or write pre / layer / post for sf.pipeline by hand "
            f"(docs/howto/pipeline.md).")
    config = model.config
    model_type = getattr(config, "model_type", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:  # [Note: which decoder LMs]
        raise ShardingError(
            f"{where}: the decoder layers route tokens to {experts} experts (mixture of experts, model_type "
            f"{model_type!r}); sf.pipeline checks each stage on meta tensors, where the router's data-dependent "
            f"dispatch has no shape.\nFix: train the MoE model without a pipeline (sf.shard over a data axis), or "
            f"write pre / layer / post for sf.pipeline by hand with a dispatch of fixed capacity.")
    scaled_inside = model_type == "gemma" and hasattr(base.embed_tokens, "embed_scale")  # [Note: which decoder LMs]
    if model_type not in _MODEL_TYPES and not scaled_inside:  # [Note: which decoder LMs]
        raise ShardingError(
            f"{where}: model_type {model_type!r} is not one whose forward is exactly embed -> decoder layers -> "
            f"norm -> head (supported: {', '.join(_MODEL_TYPES)}; e.g. Gemma scales the embedding in its "
            f"forward).\nFix: write pre / layer / post for sf.pipeline by hand (docs/howto/pipeline.md).")
    windows = {getattr(layer.self_attn, "sliding_window", None) for layer in base.layers}
    if model_type in ("mistral", "phi3"):  # they pass config.sliding_window to every attention call
        windows.add(getattr(config, "sliding_window", None))
    if windows != {None}:
        raise ShardingError(
            f"{where}: the decoder layers use sliding-window attention (windows of "
            f"{sorted(w for w in windows if w is not None)} tokens), which needs "
            f"a mask tensor the pipeline does not send between stages.\nFix: config.sliding_window=None (or "
            f"use_sliding_window=False), or train without a pipeline (sf.shard).")
    return prefix, base, head


class PipelineStages:
    """What `sf.hf.pipeline_stages` returns: `loss`, `split` / `join`, and the `sf.pipeline`."""

    def __init__(self, model, microbatches, schedule, mesh_axis, virtual_stages, mesh, remat):
        from .. import _functional
        from .._remat import remat as _remat

        where = f"sf.hf.pipeline_stages({type(model).__name__})"
        self.prefix, base, head = _decoder(model, where)
        self.tied = head.weight is base.embed_tokens.weight
        self.virtual_stages = virtual_stages
        self.n_layers = len(base.layers)
        rotary = base.rotary_emb
        apply_embed, _ = _functional.functional(base.embed_tokens)
        apply_layer, _ = _functional.functional(base.layers[0])
        apply_norm, _ = _functional.functional(base.norm)
        self._where = where

        def embed(w, mb):  # (b, T) token ids -> (b, T, C)
            if "attention_mask" in mb:
                raise ShardingError(f"{where}: the batch has an attention_mask; the pipeline runs causal attention "
                                    f"without a mask tensor.\nFix: pack the sequences to full length (labels -100 "
                                    f"where nothing is to be learned) and drop attention_mask.")
            return apply_embed(w["embed_tokens"], mb["input_ids"])

        def layer(w, x):  # (b, T, C) -> (b, T, C)
            positions = torch.arange(x.shape[1], device=x.device)[None]  # (1, T)
            cos_sin = rotary(x, positions)  # the model's rotary table at 0..T-1
            return apply_layer(w, x, attention_mask=None, position_embeddings=cos_sin, position_ids=positions,
                               use_cache=False)

        def head_loss(w, x, mb):  # the microbatch's share of the batch's token mean
            h = apply_norm(w["norm"], x)
            logits = F.linear(h, w["lm_head"]["weight"], w["lm_head"].get("bias"))  # (b, T, vocab)
            nll = F.cross_entropy(logits.flatten(0, 1), mb["shift_labels"].flatten(), ignore_index=IGNORE,
                                  reduction="none")
            return (nll * token_weights(mb, nll.dtype)).sum() * microbatches

        self.pipe = _pipeline(_remat(layer) if remat else layer, pre=embed, post=head_loss,
                              microbatches=microbatches, schedule=schedule, mesh_axis=mesh_axis,
                              virtual_stages=virtual_stages, mesh=mesh)

    # -- parameters -------------------------------------------------------------------------

    def split(self, params: Mapping) -> dict:
        """The `sf.functional(model)` tree regrouped for the pipeline (global, every layer)."""
        base = params.get(self.prefix) if isinstance(params, Mapping) else None
        if base is None or not isinstance(base.get("layers"), list) or "embed_tokens" not in base:
            raise ShardingError(f"{self._where}.split: params must be the sf.functional(model) tree (with "
                                f"[{self.prefix!r}]['layers'] a list), got keys "
                                f"{list(params) if isinstance(params, Mapping) else type(params).__name__}.")
        post = {"norm": base["norm"]}
        if not self.tied:
            post["lm_head"] = params["lm_head"]
        return {"pre": {"embed_tokens": base["embed_tokens"]},
                "layers": stack_layers(base["layers"], self.virtual_stages), "post": post}

    def join(self, params: Mapping) -> dict:
        """`split`'s inverse on global (gathered) parameters: the `sf.functional(model)` tree."""
        base = {"embed_tokens": params["pre"]["embed_tokens"],
                "layers": unstack_layers(params["layers"], self.virtual_stages), "norm": params["post"]["norm"]}
        out = {self.prefix: base}
        if not self.tied:
            out["lm_head"] = params["post"]["lm_head"]
        return out

    def scatter_params(self, params: Mapping, mesh=None) -> dict:
        """This rank's part of `split(params)` (or of the `sf.functional` tree): its layers.

        `mesh`: the mesh (default: the one given to `pipeline_stages`, or the enclosing
        shard_map's); call it on every rank, with the same global params."""
        if self.prefix in params:
            params = self.split(params)
        if mesh is None:
            return self.pipe.scatter_params(params)
        from .._shard_map import scatter
        from .. import _tree

        specs = self.pipe.specs(params)
        return {k: _tree.tree_map(lambda x, s: scatter(x, mesh, s), params[k], specs[k]) for k in params}

    # -- the loss ---------------------------------------------------------------------------

    def loss(self, params, batch) -> torch.Tensor:
        """The pipeline's loss: the token mean of next-token cross entropy over `batch`.

        Args:
          params: this rank's part (`scatter_params`), or its shards inside `sf.shard`.
          batch: {"input_ids": (B, T), optional "labels": (B, T), -100 where not scored}:
            the whole (data-rank) batch on every rank of the pipeline axis; B divisible by M.
        """
        if isinstance(params, ParamsView):
            params = materialize(params)
        if self.tied:  # one weight, used by the first stage and the last: gradients add up
            head = {"weight": params["pre"]["embed_tokens"]["weight"]}
            params = dict(params, post=dict(params["post"], lm_head=head))
        return self.pipe(params, shard_sequence(batch, None))

    __call__ = loss


def pipeline_stages(model, *, microbatches: int, schedule=None, mesh_axis: str = "stage",
                    virtual_stages: int = 1, mesh=None, remat: bool = False) -> PipelineStages:
    """Split a transformers decoder LM into `sf.pipeline`'s pre / layers / post.

    [Note: a decoder LM as pre / layers / post]: `pre` is the token embedding, every
    stage runs a stack of the model's decoder layers (rotary embeddings recomputed per
    layer from the model's own `rotary_emb`), `post` is the final norm, the head and the
    loss. Every `sf.pipeline` schedule works ("gpipe", "1f1b", "interleaved" with
    `virtual_stages >= 2`, "zb-h1", or a `Schedule`), and so does `sf.shard` around the
    loss (PP x FSDP over another axis). Tied embeddings are supported.

    Args:
      model: a Llama-shaped `*ForCausalLM` (model_type llama, gemma (transformers 5), mistral and phi3 without
        sliding window, qwen2, qwen3; no mixture of experts: [Note: which decoder LMs]), e.g. from
        `sf.hf.empty_model` or `from_pretrained`; its attention implementation is used
        as it is (sdpa, eager).
      microbatches, schedule, mesh_axis, virtual_stages, mesh: as for `sf.pipeline`; the
        default schedule is "1f1b" ("interleaved" with `virtual_stages > 1`).
      remat: wrap each decoder layer in `sf.remat` (recompute its activations in the backward).

    Returns:
      A `PipelineStages`: `.loss(params, batch)` (also callable itself), `.split(params)`
      / `.join(params)` between the `sf.functional(model)` tree and the pipeline's,
      `.scatter_params(params)` (this rank's layers), `.pipe` (the `sf.pipeline`:
      `.schedule()`, `.specs()`, `.measured_bubble()`).

    Raises:
      ShardingError: a model that is not of that shape (with the fix: write the pieces by
        hand), mixture-of-experts layers, sliding-window attention, a batch with an
        attention_mask.

    Example:
      >>> import shardfn as sf, torch, transformers
      >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
      ...                                num_attention_heads=2)
      >>> model = transformers.LlamaForCausalLM(cfg)
      >>> apply_fn, params = sf.functional(model)
      >>> mesh = sf.local_mesh({"stage": 2})
      >>> stages = sf.hf.pipeline_stages(model, microbatches=2, mesh=mesh)
      >>> batch = {"input_ids": torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))}
      >>> losses = mesh.run(lambda: float(stages.loss(stages.scatter_params(params), batch)))
      >>> one = float(sf.hf.causal_lm_loss(apply_fn, seq_axis=None)(params, sf.hf.shard_sequence(batch, None)))
      >>> abs(losses[0] - one) < 1e-5 and losses[0] == losses[1]
      True
    """
    if schedule is None:
        schedule = "interleaved" if virtual_stages > 1 else "1f1b"
    return PipelineStages(model, microbatches, schedule, mesh_axis, virtual_stages, mesh, remat)
