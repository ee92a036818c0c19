"""sf.remat on every block shape transformers has: a block that returns one of its inputs as
it is (T5's layers hand their `position_bias` on), tuples holding None, keyword-only
tensors; and encoder-decoder models (T5, BART) through `sf.functional(remat=True)` +
`sf.shard`, equal to transformers' own gradients on one process (fp64)."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardfn as sf

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

tree_leaves = torch.utils._pytree.tree_leaves
tree_map = torch.utils._pytree.tree_map
V, B, S, T = 64, 4, 7, 5  # vocab, global batch, source and target lengths


def _maxdiff(a, b) -> float:
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    return max((u - v).abs().max().item() for u, v in zip(la, lb))


# -- block shapes ---------------------------------------------------------------------------

def _x(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_a_block_returning_its_input_as_is():
    # T5: `return hidden, position_bias` with the bias it was given: an autograd.Function
    # refused it ("An input that has been returned as-is as output is being saved for backward")
    w, h, bias = _x(4, 4), _x(3, 4, seed=1), _x(3, 4, seed=2)

    def block(w, h, bias):
        return torch.tanh(h @ w + bias), bias

    def loss(fn):
        def f(w, h, bias):
            out, b = fn(w, h, bias)
            out2, b2 = fn(w, out, b)  # the next block gets the bias back
            return (out2 * b2).sum() + b2.square().sum()
        return f

    want = torch.func.grad(loss(block), argnums=(0, 1, 2))(w, h, bias)
    got = torch.func.grad(loss(sf.remat(block)), argnums=(0, 1, 2))(w, h, bias)
    assert _maxdiff(got, want) <= 1e-12
    out, b = sf.remat(block)(w, h, bias)
    assert b is bias  # the caller's own tensor back
    leaves = [t.detach().requires_grad_() for t in (w, h, bias)]
    loss(sf.remat(block))(*leaves).backward()
    assert _maxdiff([t.grad for t in leaves], want) <= 1e-12


def test_tuples_with_none_and_keyword_only_tensors():
    w, h, mask = _x(4, 4), _x(3, 4, seed=1), _x(3, 4, seed=3)

    def block(w, h, *, mask=None, scale=2.0):
        out = torch.tanh(h @ w) * scale
        if mask is not None:
            out = out * mask
        return (out, None, (None, out.sum())), None

    def loss(fn):
        return lambda w, h, mask: sum(x.sum() for x in tree_leaves(fn(w, h, mask=mask, scale=3.0)) if x is not None)

    want = torch.func.grad(loss(block), argnums=(0, 1, 2))(w, h, mask)
    got = torch.func.grad(loss(sf.remat(block)), argnums=(0, 1, 2))(w, h, mask)
    assert _maxdiff(got, want) <= 1e-12
    (out, none, (none2, total)), last = sf.remat(block)(w, h, mask=mask)
    assert none is None and none2 is None and last is None


# -- encoder-decoder models -------------------------------------------------------------------

def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0))


def _bart():
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None))


MODELS = {"t5": _t5, "bart": _bart}


def _model(name):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[name]().double()


def _batch():
    g = torch.Generator().manual_seed(1)
    return dict(input_ids=torch.randint(3, V, (B, S), generator=g), labels=torch.randint(3, V, (B, T), generator=g))


def _reference(model, batch):
    """transformers' own loss and gradients on the global batch (the mean over its tokens)."""
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _sharded(model, batch, n, how):
    apply_fn, params = sf.functional(model, remat=True)
    mesh = sf.local_mesh({"data": n})
    step = sf.shard(lambda p, b: apply_fn(p, **b).loss, mesh)

    def body():
        shards = step.shard_params(params)
        local = {k: v.chunk(n)[mesh.rank] for k, v in batch.items()}
        if how == "func":
            grads, loss = torch.func.grad_and_value(step)(shards, local)
        else:
            grads, loss = step.grad_and_value(shards, local)
        return loss.item(), step.unshard_params(grads)

    return mesh.run(body)[0]


def _by_name(tree) -> dict:
    """The leaves of a parameter tree by dotted module name (`encoder.block.0....`)."""
    return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf
            for path, leaf in torch.utils._pytree.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("how", ["grad_and_value", pytest.param("func", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_models_under_remat_and_shard_equal_transformers(name, how, monkeypatch):
    import shardfn._remat as remat_module

    recomputed = []
    backward = remat_module._Remat.backward
    monkeypatch.setattr(remat_module._Remat, "backward", staticmethod(
        lambda ctx, *grads: recomputed.append(ctx.call.name) or backward(ctx, *grads)))
    model = _model(name)
    batch = _batch()
    want_loss, want = _reference(model, batch)
    loss, grads = _sharded(model, batch, 2, how)
    # the blocks of the first list (the encoder's: shard's units) are recomputed, on both ranks
    assert len(recomputed) == 2 * 2 and all("encoder" in n for n in recomputed), recomputed
    assert abs(loss - want_loss) <= 1e-12
    got = _by_name(grads)
    assert set(got) <= set(want) and len(got) == len(set(map(id, model.parameters())))  # ties once
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= 1e-10
