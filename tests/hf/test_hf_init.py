"""Sharded init of transformers models with their own rules, no hand overrides.

`sf.init.from_module(model)` on a transformers model built on the meta device follows the
model's own `_init_weights` (recorded, not a table of ours): std = config.initializer_range
for Linear and Embedding weights, norm weights ones (LlamaRMSNorm included), biases zeros,
GPT-2's scaled residual projections, the padding row zeroed, a tied weight once. The
computed buffers (rotary `inv_freq`) are computed as the model computes them. References
are the models built on the CPU by transformers itself, on one process.
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
from torch import nn

import shardfn as sf
from collective_cases import mesh_for

transformers = pytest.importorskip("transformers")

I = sf.init
ARCHS = ["llama", "gpt2", "qwen2"]


def config(arch: str, initializer_range: float = 0.05, **extra):
    """Tiny configs: hidden 64, 2 layers, vocab 128, 4 heads; no dropout (references compare values)."""
    if arch == "llama":  # tied embeddings and a padding row: both rules exercised
        extra = {"tie_word_embeddings": True, "pad_token_id": 3, **extra}
        return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=64, initializer_range=initializer_range, **extra)
    if arch == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                       bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, initializer_range=initializer_range, **extra)
    return transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                    initializer_range=initializer_range, **extra)


def model_class(arch: str):
    return {"llama": transformers.LlamaForCausalLM, "gpt2": transformers.GPT2LMHeadModel,
            "qwen2": transformers.Qwen2ForCausalLM}[arch]


def meta_model(arch: str, dtype=None, **kw):
    with torch.device("meta"):
        model = model_class(arch)(config(arch, **kw))
    return model if dtype is None else model.to(dtype)


def named(tree, model) -> dict[str, torch.Tensor]:
    """The tree's leaves by the model's dotted parameter names."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    out = {".".join(map(str, path)): leaf for path, leaf in zip(paths, leaves)}
    assert sorted(out) == sorted(n for n, _ in model.named_parameters())  # tied: its first name only, as the tree
    return out


def loaded_cpu_model(arch: str, params, dtype=torch.float32, **kw):
    """The model built on the CPU by transformers, its parameters replaced by `params`."""
    model = model_class(arch)(config(arch, **kw)).to(dtype)
    state = named(params, model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: loaded through its source
    return model




# -- bit for bit at every world size -------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_init_shards_equal_materialize_bit_for_bit(arch, n):
    def description():  # built on the meta device by init_shards / materialize
        return I.from_module(model_class(arch)(config(arch)))

    full = I.materialize(description, seed=17)
    mesh = mesh_for({"data": n})
    apply_fn, _ = sf.functional(meta_model(arch))
    step = sf.shard(lambda p, ids: apply_fn(p, input_ids=ids, labels=ids).loss, mesh)

    def body():
        shards = step.init_shards(description, seed=17)
        sf.testing.assert_trees_equal(shards, step.shard_params(full))
        sf.testing.assert_trees_equal(step.unshard_params(shards), full)
        return sum(s.numel() for s in optree.tree_leaves(shards))

    held = mesh.run(body)
    assert sum(held) == sum(t.numel() for t in optree.tree_leaves(full))  # each rank drew only its rows


# -- the models' own rules -----------------------------------------------------------------------


@pytest.mark.parametrize("initializer_range", [0.05, 0.11])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_models_own_init_statistics(arch, initializer_range):
    model = meta_model(arch, initializer_range=initializer_range)
    full = named(I.materialize(I.from_module(model), seed=3), model)
    layers = model.config.num_hidden_layers
    checked = {"std": 0, "ones": 0, "zeros": 0}
    for name, value in full.items():
        owner = model.get_submodule(name.rpartition(".")[0])
        kind = type(owner).__name__
        if "Norm" in kind:  # LayerNorm, LlamaRMSNorm, Qwen2RMSNorm: weight ones, bias zeros
            expected = torch.ones_like(value) if name.endswith("weight") else torch.zeros_like(value)
            assert torch.equal(value, expected), name
            checked["ones" if name.endswith("weight") else "zeros"] += 1
        elif name.endswith("bias"):
            assert torch.equal(value, torch.zeros_like(value)), name
            checked["zeros"] += 1
        else:  # Linear, Conv1D (GPT-2), Embedding: normal(0, initializer_range)
            std = initializer_range
            if arch == "gpt2" and name.endswith("c_proj.weight"):  # GPT-2's residual scaling, its own rule
                std = initializer_range / math.sqrt(2 * layers)
            if name == "model.embed_tokens.weight" and arch == "llama":  # the padding row: zero
                assert torch.equal(value[3], torch.zeros(64)) and value[2].abs().sum() > 0
                value = torch.cat([value[:3], value[4:]])
            sample = value.std().item()
            assert 0.9 * std < sample < 1.1 * std, f"{name}: std {sample:.4f}, expected {std:.4f}"
            assert abs(value.mean().item()) < 0.1 * std, name
            checked["std"] += 1
    # every weight matrix of the 2 layers, the embeddings (and GPT-2's position embeddings, its head tied)
    per_layer = {"llama": 7, "gpt2": 4, "qwen2": 7}[arch]
    heads = {"llama": 1, "gpt2": 2, "qwen2": 2}[arch]  # llama ties lm_head to embed_tokens: one leaf
    assert checked["std"] == layers * per_layer + heads
    assert checked["ones"] == layers * 2 + 1
    assert checked["zeros"] == {"llama": 0, "gpt2": 2 * (4 + 2) + 1, "qwen2": 2 * 3}[arch]
    assert ("lm_head.weight" in full) == (arch == "qwen2")  # tied weights: described once


def test_descriptions_name_the_models_rules():
    desc = I.from_module(meta_model("llama"))
    assert desc["model"]["embed_tokens"]["weight"].init == I.zero_rows(I.normal(std=0.05), (3,))
    assert desc["model"]["layers"][0]["mlp"]["down_proj"]["weight"].init == I.normal(std=0.05)
    assert desc["model"]["norm"]["weight"].init == I.ones()
    assert "lm_head" not in desc
    gpt = I.from_module(meta_model("gpt2", initializer_range=0.04))
    block = gpt["transformer"]["h"][1]
    assert block["attn"]["c_attn"]["weight"].init == I.normal(std=0.04)
    assert block["attn"]["c_proj"]["weight"].init == I.normal(std=0.04 / math.sqrt(4))
    assert block["mlp"]["c_proj"]["bias"].init == I.zeros() and block["ln_2"]["weight"].init == I.ones()
    # overrides still win, and the recording left torch.nn.init as it was
    assert I.from_module(meta_model("llama"), {"model.norm.weight": I.constant(2.0)})["model"]["norm"]["weight"].init \
        == I.constant(2.0)
    assert torch.nn.init.normal_.__module__ == "torch.nn.init" and torch.nn.init.normal_.__name__ == "normal_"
    import importlib  # (a submodule: an attribute of transformers only once something imported it)

    assert importlib.import_module("transformers.initialization").TORCH_INIT_FUNCTIONS["zeros_"] is torch.nn.init.zeros_


def test_zero_rows_keeps_the_other_rows_values():
    plain, padded = I.normal(std=0.5)((300, 256)), I.zero_rows(I.normal(std=0.5), (0, 299))((300, 256))
    a, b = I.materialize({"e": plain}, seed=1)["e"], I.materialize({"e": padded}, seed=1)["e"]
    assert torch.equal(b[1:299], a[1:299]) and not b[0].any() and not b[299].any() and a[0].any()
    assert repr(padded.init) == "sf.init.zero_rows(sf.init.normal(mean=0.0, std=0.5), (0, 299))"


# -- buffers, forward, training ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_the_materialized_model_runs_with_the_cpu_models_buffers(arch):
    model = meta_model(arch)
    params = I.materialize(I.from_module(model), seed=5)
    reference = loaded_cpu_model(arch, params)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    apply_fn, _ = sf.functional(model)  # its meta buffers are computed in its own copy of the model
    logits = apply_fn(params, input_ids=ids).logits
    assert logits.shape == (2, 12, 128) and logits.isfinite().all()
    assert torch.equal(logits, reference(input_ids=ids).logits)
    if arch == "gpt2":  # no computed buffers
        assert not list(model.buffers())
        return
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.device.type == "meta"  # sf.functional left the model itself alone
    assert I.materialize_buffers(model) is model
    for name in ("inv_freq", "original_inv_freq"):
        ours, theirs = getattr(rotary, name), getattr(reference.model.rotary_emb, name)
        assert ours.device.type == "cpu" and torch.equal(ours, theirs), name
    assert "model.rotary_emb.inv_freq" not in model.state_dict()  # still non-persistent
    assert torch.equal(torch.func.functional_call(model, named(params, model), (ids,)).logits, logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_sharded_training_step_from_init_shards_with_no_overrides(arch):
    model = meta_model(arch, torch.float64)
    apply_fn, _ = sf.functional(model)
    mesh = mesh_for({"data": 2})
    step = sf.shard(lambda p, ids: apply_fn(p, input_ids=ids, labels=ids).loss, mesh)
    opt = sf.optim.adamw(1e-2)
    batch = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))

    def body():
        shards = step.init_shards(I.from_module(model), seed=9)
        state = opt.init(shards)
        grads, loss = torch.func.grad_and_value(step)(shards, batch[2 * mesh.rank: 2 * mesh.rank + 2])
        updates, state = opt.update(grads, state, shards)
        shards = sf.optim.apply_updates(shards, updates)
        return loss, step.unshard_params(shards)

    (loss, after), (loss1, after1) = mesh.run(body)
    sf.testing.assert_trees_equal(after, after1)
    # The reference: transformers' CPU model from the same values, plain PyTorch AdamW, one process.
    start = I.materialize(I.from_module(model), seed=9)
    reference = loaded_cpu_model(arch, start, torch.float64)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_loss = sum(reference(input_ids=b, labels=b).loss for b in batch.split(2)) / 2
    ref_loss.backward()
    torch_opt.step()
    assert abs(loss.item() - ref_loss.item()) < 1e-10
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    for name, value in named(after, model).items():
        torch.testing.assert_close(value, expected[name], atol=1e-10, rtol=0, msg=name)
    moved = [n for n, v in named(after, model).items() if not torch.equal(v, named(start, model)[n])]
    assert len(moved) == len(expected)  # every parameter took the step


# -- errors --------------------------------------------------------------------------------------


class OrthogonalHead(transformers.LlamaForCausalLM):
    """Llama whose own rules give the head an init sf.init cannot draw by row blocks."""

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self.lm_head:
            torch.nn.init.orthogonal_(module.weight)


class ScaledHead(transformers.LlamaForCausalLM):
    """Old-style rules through `.data`: a normal draw, a zeroed row, then an in-place scaling."""

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self.lm_head:
            module.weight.data.normal_(mean=0.0, std=0.3)
            module.weight.data[-1] = 0
            if self.config.scale_head:
                module.weight.data.mul_(0.5)
        if self.config.broken and module is self.lm_head:
            module.weight.sum().item()


class WithGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(4))
        self.register_buffer("table", torch.empty(4), persistent=False)


def test_an_init_sf_init_cannot_draw_is_named_with_the_fix():
    cfg = config("llama", tie_word_embeddings=False)
    with torch.device("meta"):
        model = OrthogonalHead(cfg)
    with pytest.raises(sf.ShardingError) as info:
        I.from_module(model)
    message = str(info.value)
    assert ("params['lm_head']['weight'] (lm_head.weight, shape (128, 64)): OrthogonalHead._init_weights(lm_head) "
            "calls torch.nn.init.orthogonal_(gain=1) on it, which sf.init cannot draw row block by row block; fix: "
            "pass overrides={'lm_head.weight': sf.init.normal(std=0.02)}") in message
    assert message.count("\n  - ") == 1  # only the head
    desc = I.from_module(model, {"lm_head.weight": I.normal(std=0.01)})
    assert desc["lm_head"]["weight"].init == I.normal(std=0.01)

    with torch.device("meta"):
        scaled = ScaledHead(config("llama", tie_word_embeddings=False, scale_head=False, broken=False))
    scaled.lm_head.weight._is_hf_initialized = True  # "loaded": transformers' init skips it; the rules are still read
    head = I.from_module(scaled)["lm_head"]["weight"].init
    assert head == I.zero_rows(I.normal(std=0.3), (127,))  # Tensor.normal_ and __setitem__ through .data
    assert scaled.lm_head.weight._is_hf_initialized is True
    scaled.config.scale_head = True
    with pytest.raises(sf.ShardingError, match=r"lm_head.weight, shape \(128, 64\)\): ScaledHead._init_weights\("
                                               r"lm_head\) calls Tensor.mul_\(args=\(0.5,\)\) on it"):
        I.from_module(scaled)
    scaled.config.broken = True
    with pytest.raises(sf.ShardingError, match=r"(?s)sf.init: ScaledHead._init_weights\(lm_head\) failed while "
                                               r"sf.init recorded .*RuntimeError: .*meta.*Fix: pass "
                                               r"sf.init.from_module\(model, overrides=...\)"):
        I.from_module(scaled)
    assert torch.nn.init.normal_.__module__ == "torch.nn.init"  # restored after the failure too


def test_a_parameter_or_buffer_the_rules_leave_alone_is_named():
    with torch.device("meta"):
        model = meta_model("llama")
        model.model.gate = WithGate()
    with pytest.raises(sf.ShardingError, match=r"params\['model'\]\['gate'\]\['gate'\] \(model.gate.gate, shape "
                                               r"\(4,\)\) is left alone by LlamaForCausalLM._init_weights and belongs "
                                               r"to a WithGate, .*overrides=\{WithGate: \{'gate': "):
        I.from_module(model)
    with pytest.raises(sf.ShardingError, match=r"(?s)cannot compute these buffers of LlamaForCausalLM.*"
                                               r"model.gate.table \(shape \(4,\), torch.float32\): nothing computes "
                                               r"it .*fix: build the module on a real device, or set it before use: "
                                               r"module.get_submodule\('model.gate'\).table = <tensor>"):
        I.materialize_buffers(model)
    assert model.model.rotary_emb.inv_freq.device.type == "cpu"  # the others were computed
    with torch.device("meta"):
        bn = nn.BatchNorm1d(3)
    assert I.materialize_buffers(bn).running_mean.tolist() == [0.0, 0.0, 0.0]
    assert bn.num_batches_tracked.item() == 0
