"""sf.hf names through transformers' own conversion table, both directions: GPT-NeoX
(`embed_out.` renamed `lm_head.`), Qwen3-MoE and Mixtral (per-expert tensors in the file,
fused `experts.gate_up_proj` / `down_proj` in the model, Mixtral's `block_sparse_moe.`
renamed too). `save_pretrained` -> `sf.hf.load_shards` (2 ranks) -> `unshard_params` is
the model's parameters bit for bit; `sf.hf.save_pretrained` -> `from_pretrained` gives
the same logits (torch.equal) and the same files as transformers' own save_pretrained."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import shardfn as sf
import shardfn.checkpoint as ckpt
from shardfn._hf._safetensors import read_header

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V = 64


def _model(name):
    if name == "gpt_neox":
        cls, cfg = transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    elif name == "qwen3_moe":
        cls, cfg = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, head_dim=8)
    else:
        cls, cfg = transformers.MixtralForCausalLM, transformers.MixtralConfig(
            vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(cfg).eval()


def _names(path):
    return set(read_header(os.path.join(path, "model.safetensors")).entries)


NAMES = ["gpt_neox", "qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_loads_into_shards_bit_for_bit(name, tmp_path):
    model = _model(name)
    model.save_pretrained(str(tmp_path))
    renamed = {"gpt_neox": "embed_out.weight", "qwen3_moe": "model.layers.0.mlp.experts.3.up_proj.weight",
               "mixtral": "model.layers.1.block_sparse_moe.experts.2.w3.weight"}[name]
    assert renamed in _names(str(tmp_path))  # the file holds transformers' saved names, not the model's
    with torch.device("meta"):
        apply_fn, like = sf.functional(type(model)(model.config))
    _, params = sf.functional(model)
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, ids: apply_fn(p, input_ids=ids, labels=ids, use_cache=False).loss, mesh)

    def body():
        shards, stats = sf.hf.load_shards(step, str(tmp_path), like, return_stats=True)
        return step.unshard_params(shards), step.unshard_params(step.shard_params(params)), stats

    back, want, stats = mesh.run(body)[0]
    flat_back, flat_want = torch.utils._pytree.tree_leaves(back), torch.utils._pytree.tree_leaves(want)
    assert len(flat_back) == len(flat_want)
    assert all(torch.equal(a, b) for a, b in zip(flat_back, flat_want))
    # each rank read its own experts' tensors only: half the bytes
    assert stats.data_bytes == stats.wanted_bytes
    assert stats.wanted_bytes * 2 <= sum(p.numel() * p.element_size() for p in model.parameters()) + 4096


@pytest.mark.parametrize("name", NAMES)
def test_export_writes_what_save_pretrained_writes_and_loads_with_equal_logits(name, tmp_path):
    model = _model(name)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    model.save_pretrained(theirs)
    apply_fn, params = sf.functional(model)
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, ids: apply_fn(p, input_ids=ids, labels=ids, use_cache=False).loss, mesh)
    mesh.run(lambda: sf.hf.save_pretrained(ours, step, step.shard_params(params), model))
    assert _names(ours) == _names(theirs)
    loaded, info = type(model).from_pretrained(ours, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)


def test_a_converted_checkpoint_with_a_key_map_takes_the_map_as_it_is(tmp_path):
    # key_map= is the user's own naming: no conversion behind it, so GPT-NeoX's file (embed_out)
    # and our lm_head need the map to say so
    model = _model("gpt_neox")
    model.save_pretrained(str(tmp_path))
    with torch.device("meta"):
        _, like = sf.functional(type(model)(model.config))
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, x: x.sum(), mesh)
    with pytest.raises(ckpt.CheckpointKeyError, match=r"(?s)Missing from the checkpoint \(1\):.*'lm_head.weight'.*"
                                                      r"In the checkpoint but not in `like` \(1\):.*embed_out.weight"):
        mesh.run(lambda: sf.hf.load_shards(step, str(tmp_path), like, key_map={}))
    back = mesh.run(lambda: step.unshard_params(sf.hf.load_shards(
        step, str(tmp_path), like, key_map={"lm_head.weight": "embed_out.weight"})))[0]
    assert torch.equal(back["lm_head"]["weight"], model.lm_head.weight)


@pytest.mark.slow
def test_legacy_names_load_as_from_pretrained_loads_them(tmp_path):
    # an old BERT checkpoint names its LayerNorms' parameters gamma / beta; transformers
    # renames them on load (its "legacy" renames), and so does load_shards
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32)).eval()
    model.save_pretrained(str(tmp_path))
    file = os.path.join(str(tmp_path), "model.safetensors")
    tensors = load_file(file)
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in tensors.items()}
    assert sum("gamma" in k for k in old) == 6
    save_file(old, file, metadata={"format": "pt"})
    again = transformers.BertForMaskedLM.from_pretrained(str(tmp_path))
    assert torch.equal(again.bert.embeddings.LayerNorm.weight, model.bert.embeddings.LayerNorm.weight)
    with torch.device("meta"):
        _, like = sf.functional(transformers.BertForMaskedLM(model.config))
    _, params = sf.functional(model)
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, x: x.sum(), mesh)
    back = mesh.run(lambda: step.unshard_params(sf.hf.load_shards(step, str(tmp_path), like)))[0]
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(back),
                                                 torch.utils._pytree.tree_leaves(params)))
