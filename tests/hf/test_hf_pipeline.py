"""Pipelines for transformers decoder models: `sf.hf.pipeline_stages(model, ...)`.

A transformers Llama (4 decoder layers, GQA) split into sf.pipeline's pre (embedding) /
stacked decoder layers / post (norm, head, loss) trains over 2 and 4 stages x FSDP over
'data' exactly as one device (fp64, 3 AdamW steps, params <= 1e-9) with 1F1B and ZB-H1;
GPipe, interleaved 1F1B, a Qwen2, tied embeddings, labels -100 and remat too; models the
split would get wrong are refused by message.
"""

from __future__ import annotations

import warnings

import optree
import pytest
import torch

import shardfn as sf

transformers = pytest.importorskip("transformers")

V, B, T = 64, 4, 16
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def model_of(arch: str = "llama", **overrides):
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_cls(config_cls(vocab_size=V, **dict(SIZES, **overrides))).double()


def batches(steps: int, ignore: bool = False):
    out = []
    for s in range(steps):
        ids = torch.randint(V, (B, T), generator=torch.Generator().manual_seed(100 + s))
        labels = ids.clone()
        if ignore:  # rows with 0, 3, 5, 9 unscored tokens: microbatches and data ranks score unequal counts
            for row, n in enumerate((0, 3, 5, 9)):
                labels[row, :n] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def maxdiff(a, b) -> float:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb)
    return max((x - y).abs().max().item() for x, y in zip(la, lb))


def one_device(model, data, opt):
    apply_fn, params = sf.functional(model)
    train = sf.train_step(sf.hf.causal_lm_loss(apply_fn, seq_axis=None), opt)
    state, losses = opt.init(params), []
    for batch in data:
        params, state, loss = train(params, state, sf.hf.shard_sequence(batch, None))
        losses.append(loss.item())
    return params, losses


def pp_training(mesh, model, data, opt, **options):
    """The rank program: pipeline_stages over 'stage', sf.shard (FSDP) over 'data'; each
    data rank trains on its rows of every global batch. Returns this rank's trained part."""
    stages = sf.hf.pipeline_stages(model, **options)
    step = sf.shard(stages.loss, mesh, data_axes="data")
    _, params = sf.functional(model)
    shards = step.shard_params(stages.scatter_params(params, mesh))
    state = opt.init(shards)
    train = sf.train_step(step, opt, inplace=True)
    n, d = mesh.shape["data"], mesh.coords["data"]
    losses = []
    for batch in data:
        rows = {k: x.chunk(n)[d] for k, x in batch.items()}
        shards, state, loss = train(shards, state, rows)
        losses.append(loss.item())
    return mesh.coords, step.unshard_params(shards), losses


def joined(stages, results, virtual_stages=1):
    """The whole sf.functional tree from the ranks' parts (data coord 0 of every stage)."""
    parts = sorted((c["stage"], p) for c, p, _ in results if c["data"] == 0)
    dim = 1 if virtual_stages > 1 else 0
    layers = optree.tree_map(lambda *xs: torch.cat(xs, dim), *[p["layers"] for _, p in parts])
    return stages.join(dict(parts[0][1], layers=layers))


def check_training(model, mesh_shape, steps=3, ignore=False, **options):
    data, opt = batches(steps, ignore), sf.optim.adamw(1e-2)
    want, want_losses = one_device(model, data, opt)
    mesh = sf.local_mesh(mesh_shape)
    results = mesh.run(pp_training, mesh, model, data, opt, **options)
    got = joined(sf.hf.pipeline_stages(model, microbatches=options["microbatches"],
                                       virtual_stages=options.get("virtual_stages", 1)), results,
                 options.get("virtual_stages", 1))
    assert maxdiff(got, want) <= 1e-9
    for _, _, losses in results:
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-12
    assert want_losses[0] != want_losses[-1]


@pytest.mark.parametrize("stages", [pytest.param(2, marks=pytest.mark.ci), 4])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pp_x_fsdp_training_equals_one_device(schedule, stages):
    """{'stage': 2 or 4, 'data': 2}: 3 AdamW steps of a transformers Llama split by
    pipeline_stages, FSDP over 'data' == one device (fp64, params <= 1e-9)."""
    check_training(model_of(), {"stage": stages, "data": 2}, microbatches=2, schedule=schedule)


@pytest.mark.parametrize("schedule, virtual_stages", [("gpipe", 1), ("interleaved", 2)])
def test_the_other_schedules(schedule, virtual_stages):
    check_training(model_of(), {"stage": 2, "data": 2}, steps=2, microbatches=2, schedule=schedule,
                   virtual_stages=virtual_stages)


def test_tied_embeddings_are_one_weight():
    """tie_word_embeddings: the tree holds the weight once (in pre); the last stage uses it as
    the head, and its gradient is the sum of both uses, as on one device."""
    model = model_of(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    stages = sf.hf.pipeline_stages(model, microbatches=2)
    _, params = sf.functional(model)
    assert "lm_head" not in stages.split(params)["post"]
    check_training(model, {"stage": 2, "data": 2}, steps=2, microbatches=2, schedule="1f1b")


def test_qwen2_unscored_labels_and_remat():
    """A Qwen2 (biased q/k/v), labels -100 on rows' starts (unequal scored tokens per
    microbatch: the loss is still the batch's token mean), each layer under sf.remat."""
    check_training(model_of("qwen2"), {"stage": 2, "data": 1}, steps=2, ignore=True, microbatches=4,
                   schedule="zb-h1", remat=True)


def test_split_and_join_are_inverse():
    model = model_of()
    stages = sf.hf.pipeline_stages(model, microbatches=2, virtual_stages=2)
    _, params = sf.functional(model)
    split = stages.split(params)
    assert sorted(split) == ["layers", "post", "pre"]
    assert split["layers"]["self_attn"]["q_proj"]["weight"].shape == (2, 2, 32, 32)  # (V, L / V, out, in)
    assert maxdiff(stages.join(split), params) == 0.0


# -- refused, with the fix ---------------------------------------------------------------------


def test_models_the_split_would_get_wrong_are_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2))
    with pytest.raises(sf.ShardingError, match=r"(?s)not a decoder LM of the Llama shape.*missing.*write pre / "
                                               r"layer / post for sf.pipeline by hand"):
        sf.hf.pipeline_stages(gpt2, microbatches=2)
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(vocab_size=V, embedding_multiplier=2.0,
                                                                         **SIZES))
    with pytest.raises(sf.ShardingError, match=r"model_type 'granite' is not one whose forward is exactly embed"):
        sf.hf.pipeline_stages(granite, microbatches=2)  # it multiplies the embedding in its forward
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(vocab_size=V, sliding_window=8, **SIZES))
    with pytest.raises(sf.ShardingError,
                       match=r"(?s)sliding-window attention \(windows of \[8\] tokens\).*Fix: config.sliding_window"):
        sf.hf.pipeline_stages(mistral, microbatches=2)


def test_a_padding_mask_is_refused():
    model = model_of()
    mesh = sf.local_mesh({"stage": 2})
    stages = sf.hf.pipeline_stages(model, microbatches=2, mesh=mesh)
    _, params = sf.functional(model)
    batch = dict(batches(1)[0], attention_mask=torch.ones(B, T, dtype=torch.long))
    with pytest.raises(sf.ShardingError, match=r"(?s)the batch has an attention_mask.*drop attention_mask"):
        mesh.run(lambda: stages.loss(stages.scatter_params(params), batch))
