"""sf.functional(model, remat=...) on transformers models at their default config: the same
gradients as without remat (fp64, 1e-10), with and without sf.shard, under torch.func.grad,
step.grad_and_value and .backward(); HF's gradient_checkpointing_enable() and
torch.utils.checkpoint inside a shard loss either work or name sf.remat."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardfn as sf

transformers = pytest.importorskip("transformers")

V, T, B = 96, 8, 4  # vocab, sequence, global batch
tree_leaves = torch.utils._pytree.tree_leaves
tree_map = torch.utils._pytree.tree_map


def _model(arch: str, **overrides):
    """A tiny random-init model of `arch` in fp64, at its default config otherwise."""
    small = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                  dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)),
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
                 dict(n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                  dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)),
    }
    config_cls, model_cls, sizes = small[arch]
    config = config_cls(vocab_size=V, **sizes, **overrides)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_cls(config).double()


def _ids(seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _maxdiff(a, b) -> float:
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    return max((u - v).abs().max().item() for u, v in zip(la, lb))


def _grads(model, remat, how, ids, seed=5):
    """Gradients of the LM loss through sf.functional, without sf.shard."""
    apply_fn, params = sf.functional(model, remat=remat)
    loss = lambda p: apply_fn(p, input_ids=ids, labels=ids).loss  # noqa: E731
    torch.manual_seed(seed)  # GPT-2's dropout: the same draws in both runs (remat replays them)
    if how == "func":
        return torch.func.grad(loss)(params)
    leaves = tree_map(lambda t: t.detach().requires_grad_(), params)
    loss(leaves).backward()
    return tree_map(lambda t: t.grad, leaves)


@pytest.mark.parametrize("how", ["func", "backward"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_remat_equals_plain_at_the_default_config(arch, how):
    model = _model(arch)
    assert model.config.use_cache is True  # the default that made the recompute append to the cache again
    ids = _ids()
    want = _grads(model, None, how, ids)
    got = _grads(model, True, how, ids)
    assert _maxdiff(got, want) <= 1e-10


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eager_attention_under_remat(arch):
    model = _model(arch, attn_implementation="eager")
    ids = _ids()
    assert _maxdiff(_grads(model, True, "func", ids), _grads(model, None, "func", ids)) <= 1e-10


def _sharded_grads(model, remat, how, n):
    apply_fn, params = sf.functional(model, remat=remat)
    mesh = sf.local_mesh({"data": n})
    step = sf.shard(lambda p, ids: apply_fn(p, input_ids=ids, labels=ids).loss, mesh)
    ids = _ids()

    def body():
        shards = step.shard_params(params)
        local = ids.chunk(n)[mesh.rank]
        if how == "func":
            grads = torch.func.grad(step)(shards, local)
        elif how == "grad_and_value":
            grads, _ = step.grad_and_value(shards, local)
        else:
            leaves = tree_map(lambda t: t.detach().requires_grad_(), shards)
            step(leaves, local).backward()
            grads = tree_map(lambda t: t.grad, leaves)
        return step.unshard_params(grads)

    return mesh.run(body)[0]


@pytest.mark.parametrize("how, n", [("func", 2), ("grad_and_value", 2), ("backward", 2), ("grad_and_value", 1)])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_remat_equals_plain_inside_shard(arch, how, n):
    # The simulated ranks share the default generator, so dropout's draws are not the same from
    # run to run: GPT-2 without dropout here (attention and cache at their defaults).
    overrides = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if arch == "gpt2" else {}
    model = _model(arch, **overrides)
    want = _sharded_grads(model, None, how, n)
    got = _sharded_grads(model, True, how, n)
    assert _maxdiff(got, want) <= 1e-10
    assert _maxdiff(want, _grads(model, None, "func", _ids())) <= 1e-10  # and the model's own gradients


def test_use_cache_true_with_remat_raises():
    model = _model("llama")
    apply_fn, params = sf.functional(model, remat=True)
    ids = _ids()
    with pytest.raises(sf.SpecError, match=r"(?s)LlamaForCausalLM, remat=\.\.\.\): use_cache=True with remat.*"
                                            r"Fix: train with use_cache=False"):
        torch.func.grad(lambda p: apply_fn(p, input_ids=ids, labels=ids, use_cache=True).loss)(params)
    with torch.no_grad():  # no recompute without gradients: the cache is allowed (generation)
        out = apply_fn(params, input_ids=ids, use_cache=True)
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == T


def test_a_cache_passed_to_a_rematted_block_raises():
    # A layer given a cache object under remat (what use_cache=True did): detected, not wrong.
    model = _model("llama")
    layer = model.model.layers[0]
    ids = _ids()
    h = model.model.embed_tokens(ids).detach()
    pos = torch.arange(T)[None]
    cos_sin = tuple(t.detach() for t in model.model.rotary_emb(h, pos))
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def block(p, h, cache):  # the layer returns its hidden states
        return torch.func.functional_call(layer, p, (h,), dict(position_embeddings=cos_sin, cache=cache))

    cache = transformers.DynamicCache(config=model.config)
    with pytest.raises(sf.SpecError, match=r"(?s)recompute of function .*block.* is not its forward.*KV cache.*"
                                            r"Fix: for transformers models do not pass use_cache=True"):
        torch.func.grad(lambda p: sf.remat(block)(p, h, cache).square().sum())(params)


def test_gradient_checkpointing_enable_maps_to_remat(monkeypatch):
    model = _model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers 5 deprecates the name
        model.gradient_checkpointing_enable()
    model.train()
    import shardfn._remat as remat_module

    recomputed = []
    backward = remat_module._Remat.backward

    def spy(ctx, *grads):
        recomputed.append(ctx.call.name)
        return backward(ctx, *grads)

    monkeypatch.setattr(remat_module._Remat, "backward", staticmethod(spy))
    plain = _model("llama")
    for how in ("func", "grad_and_value", "backward"):
        recomputed.clear()
        got = _sharded_grads(model, None, how, 2)
        assert _maxdiff(got, _sharded_grads(plain, None, how, 2)) <= 1e-10
        assert sorted(recomputed) == ["block 'model.layers.0' (LlamaDecoderLayer)"] * 2 + \
            ["block 'model.layers.1' (LlamaDecoderLayer)"] * 2  # 2 ranks, each block recomputed by sf.remat
    assert model.model.layers[0].gradient_checkpointing is True  # the user's model is left as it was


def test_torch_utils_checkpoint_in_a_shard_loss_names_remat():
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator().manual_seed(0)
    params = {"embed": torch.randn(6, 6, generator=g, dtype=torch.float64),
              "layers": [{"w": torch.randn(6, 6, generator=g, dtype=torch.float64)} for _ in range(2)]}
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)

    def loss(p, x, reentrant):
        h = x @ p["embed"]
        for lp in p["layers"]:
            h = checkpoint(lambda h, w: torch.tanh(h @ w), h, lp["w"], use_reentrant=reentrant)
        return h.square().mean()

    mesh = sf.local_mesh({"data": 2})
    # non-reentrant: raised in the forward, inside loss_fn; reentrant: in the backward, which
    # torch.func.grad(step) runs below the transform ([Note: torch.func.grad of a whole step])
    for reentrant, entry, where in ((False, "func", "loss_fn"), (True, "func", r"torch.func.grad\(step\)"),
                                    (True, "grad_and_value", "step.grad_and_value")):
        step = sf.shard(lambda p, x: loss(p, x, reentrant), mesh)

        def body():
            shards = step.shard_params(params)
            return torch.func.grad(step)(shards, x) if entry == "func" else step.grad_and_value(shards, x)

        with pytest.raises(sf.SpecError, match=rf"(?s)shard: {where}: torch.utils.checkpoint failed inside it.*"
                                                r"Fix: recompute with sf.remat\(block\)"):
            mesh.run(body)


def test_gradient_checkpointing_with_compile_is_an_error():
    model = _model("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable()
    with pytest.raises(sf.SpecError, match=r"(?s)compile= on a model with Hugging Face gradient checkpointing on "
                                            r"\(e.g. 'transformer'\).*Fix: model.gradient_checkpointing_disable"):
        sf.functional(model, compile=True)
