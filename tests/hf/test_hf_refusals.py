"""The refusals of sf.hf's context parallelism and pipelines met by the families table
(tests/hf/hf_families.py): a bidirectional model with ring / Ulysses attention, a
mixture-of-experts or sliding-window Phi-3 in `pipeline_stages`; each by its message, on
tiny models, in about a second (the table's cells are slow)."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardfn as sf

transformers = pytest.importorskip("transformers")

V = 64
SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _quiet(cls, config):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(config).double()


@pytest.mark.parametrize("attn", ["shardfn_ring", "shardfn_ulysses"])
def test_a_bidirectional_model_is_refused_by_the_cp_attention(attn):
    """BERT's encoder attends both ways: its first attention call on a split sequence names
    the module, the model_type, why and the fix."""
    bert = _quiet(transformers.BertForMaskedLM, transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    sf.hf.register_attention()
    bert.set_attn_implementation(attn)
    apply_fn, params = sf.functional(bert)
    mesh = sf.local_mesh({"seq": 2})
    step = sf.shard(sf.hf.causal_lm_loss(apply_fn), mesh, data_axes=("seq",))
    ids = torch.randint(V, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(sf.ShardingError, match=rf"(?s)attn_implementation='{attn}' in BertSelfAttention \(model_type "
                                               r"'bert'\): bidirectional attention \(is_causal=False\): the model "
                                               r"is not a causal LM.*train it without a sequence axis"):
        mesh.run(lambda: step(step.shard_params(params), sf.hf.shard_sequence({"input_ids": ids}, mesh,
                                                                              batch_axes=())))


def test_mixture_of_experts_layers_are_refused_by_pipeline_stages():
    moe = _quiet(transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        **SIZES, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8,
        experts_implementation="eager"))
    with pytest.raises(sf.ShardingError, match=r"(?s)Qwen3MoeForCausalLM\): the decoder layers route tokens to 4 "
                                               r"experts.*model_type 'qwen3_moe'.*Fix: train the MoE model without "
                                               r"a pipeline"):
        sf.hf.pipeline_stages(moe, microbatches=2)


def test_phi3_splits_and_its_sliding_window_is_refused():
    """Phi-3 is of the Llama shape (fused q/k/v and gate/up inside its layers); a Phi-3 with
    config.sliding_window, which every attention call gets, is refused as Mistral's is."""
    extra = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0)
    phi3 = _quiet(transformers.Phi3ForCausalLM, transformers.Phi3Config(**SIZES, **extra))
    stages = sf.hf.pipeline_stages(phi3, microbatches=2)
    _, params = sf.functional(phi3)
    assert stages.split(params)["layers"]["self_attn"]["qkv_proj"]["weight"].shape == (2, 64, 32)
    windowed = _quiet(transformers.Phi3ForCausalLM, transformers.Phi3Config(**SIZES, **extra, sliding_window=4))
    with pytest.raises(sf.ShardingError, match=r"(?s)Phi3ForCausalLM\): the decoder layers use sliding-window "
                                               r"attention \(windows of \[4\] tokens\).*Fix: config.sliding_window"):
        sf.hf.pipeline_stages(windowed, microbatches=2)
