"""Context parallelism on transformers models: `attn_implementation="shardfn_ring"` /
`"shardfn_ulysses"`, `sf.hf.shard_sequence` and `sf.hf.causal_lm_loss`.

A transformers Llama and a Qwen2 (GQA: 4 query heads, 2 K/V heads), unchanged but for
their attention implementation, train on `{"data": 2, "seq": 2}` (FSDP over 'data', the
sequence over 'seq', contiguous and zig-zag) exactly as the same model with SDPA on one
device (fp64, 3 AdamW steps, params <= 1e-9); right-padded batches (a key-padding mask)
too; the one-device loss is transformers' own; the attention's memory per rank falls as
1/N; the bad inputs are refused by message. One lean case runs on forked processes.
"""

from __future__ import annotations

import warnings

import optree
import pytest
import torch

import shardfn as sf
from shardfn.testing import run_on_mesh

transformers = pytest.importorskip("transformers")

V, B, T = 64, 4, 16
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def model_of(arch: str, attn: str = "sdpa", **overrides):
    """A tiny random-init fp64 model of `arch` (seed 0), with attention `attn`."""
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    sf.hf.register_attention()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_cls(config_cls(vocab_size=V, **dict(SIZES, **overrides))).double()
    model.set_attn_implementation(attn)
    return model


def batches(steps: int, pad: bool = False):
    """`steps` global batches {"input_ids", "labels"[, "attention_mask"]} of (B, T)."""
    out = []
    for s in range(steps):
        ids = torch.randint(V, (B, T), generator=torch.Generator().manual_seed(100 + s))
        batch = {"input_ids": ids, "labels": ids.clone()}
        if pad:  # right padding: rows end 0, 3, 5, 9 tokens early
            mask = torch.ones(B, T, dtype=torch.long)
            for row, n in enumerate((0, 3, 5, 9)):
                mask[row, T - n:] = 0
            batch["labels"] = ids.masked_fill(mask == 0, -100)
            batch["attention_mask"] = mask
        out.append(batch)
    return out


def maxdiff(a, b) -> float:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb)
    return max((x - y).abs().max().item() for x, y in zip(la, lb))


def one_device(arch, data, opt):
    """The reference: the SDPA model on the whole batch, sf.train_step, fp64."""
    apply_fn, params = sf.functional(model_of(arch))
    loss = sf.hf.causal_lm_loss(apply_fn, seq_axis=None)
    train = sf.train_step(loss, opt)
    state, losses = opt.init(params), []
    for batch in data:
        params, state, value = train(params, state, sf.hf.shard_sequence(batch, None))
        losses.append(value.item())
    return params, losses


def cp_training(mesh, model, layout, data, opt, remat=False):
    """The rank program: the model (built once, outside the rank threads: they share the
    global RNG), FSDP over 'data', the sequence over 'seq'."""
    apply_fn, params = sf.functional(model, remat=remat)
    step = sf.shard(sf.hf.causal_lm_loss(apply_fn, layout=layout), mesh, data_axes=("data", "seq"),
                    shard_axes="data")
    shards = step.shard_params(params)
    state = opt.init(shards)
    train = sf.train_step(step, opt, inplace=True)
    losses = []
    for batch in data:
        shards, state, loss = train(shards, state, sf.hf.shard_sequence(batch, mesh, layout=layout))
        losses.append(loss.item())
    return step.unshard_params(shards), losses


CASES = [pytest.param("llama", "shardfn_ring", "zigzag", marks=pytest.mark.ci),
         ("llama", "shardfn_ring", "contiguous"),
         ("llama", "shardfn_ulysses", "contiguous"),
         ("llama", "shardfn_ulysses", "zigzag"),
         ("qwen2", "shardfn_ring", "contiguous"),
         pytest.param("qwen2", "shardfn_ring", "zigzag", marks=pytest.mark.ci),
         ("qwen2", "shardfn_ulysses", "contiguous"),
         ("qwen2", "shardfn_ulysses", "zigzag")]


@pytest.mark.parametrize("arch, attn, layout", CASES)
def test_cp_x_fsdp_training_equals_one_device(arch, attn, layout):
    """{'data': 2, 'seq': 2}: 3 AdamW steps of the unchanged model with the registered
    attention == the SDPA model on one device (fp64, params <= 1e-9, losses <= 1e-12)."""
    data, opt = batches(3), sf.optim.adamw(1e-2)
    want, want_losses = one_device(arch, data, opt)
    mesh = sf.local_mesh({"data": 2, "seq": 2})
    for got, losses in mesh.run(cp_training, mesh, model_of(arch, attn), layout, data, opt):
        assert maxdiff(got, want) <= 1e-9
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-12
    assert want_losses[0] != want_losses[-1]  # it trained


def test_the_one_device_loss_is_transformers_own():
    """causal_lm_loss(seq_axis=None) on shard_sequence(batch, None) is the token mean that
    transformers' loss computes (labels shifted inside, -100 ignored), in fp64."""
    model = model_of("llama")
    apply_fn, params = sf.functional(model)
    for batch in batches(1) + batches(1, pad=True):
        ours = sf.hf.causal_lm_loss(apply_fn, seq_axis=None)(params, sf.hf.shard_sequence(batch, None))
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        theirs = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
        assert ours.dtype == torch.float64
        assert abs(ours.item() - theirs.item()) <= 1e-13
        hf = model(**batch).loss  # transformers' own, cast to fp32 inside
        assert abs(ours.item() - hf.item()) <= 1e-6


@pytest.mark.parametrize("attn", ["shardfn_ring", "shardfn_ulysses"])
def test_padded_batches_with_a_key_padding_mask(attn):
    """Right-padded rows (attention_mask 0, labels -100): ranks score different numbers of
    tokens, and the loss is still the global token mean; training == one device."""
    data, opt = batches(3, pad=True), sf.optim.adamw(1e-2)
    want, want_losses = one_device("llama", data, opt)
    mesh = sf.local_mesh({"data": 2, "seq": 2})
    for got, losses in mesh.run(cp_training, mesh, model_of("llama", attn), "zigzag", data, opt):
        assert maxdiff(got, want) <= 1e-9
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-12


def test_remat_around_decoder_layers_that_call_ring_attention():
    """sf.functional(model, remat=True): each decoder layer, its ring attention included, is
    recomputed in the backward; training is still one device's."""
    data, opt = batches(2), sf.optim.adamw(1e-2)
    want, _ = one_device("llama", data, opt)
    mesh = sf.local_mesh({"data": 2, "seq": 2})
    for got, _ in mesh.run(cp_training, mesh, model_of("llama", "shardfn_ring"), "zigzag", data, opt, True):
        assert maxdiff(got, want) <= 1e-9


def test_shifted_labels_cross_the_split():
    """Each block's last token is scored against the next block's first token; positions
    are global; zig-zag reorders tokens, positions and labels alike."""
    ids = torch.arange(8)[None] + 10  # (1, 8): tokens 10..17
    mesh = sf.local_mesh({"seq": 2})
    got = mesh.run(lambda: sf.hf.shard_sequence({"input_ids": ids}, mesh, batch_axes=()))
    assert got[0]["input_ids"].tolist() == [[10, 11, 12, 13]]
    assert got[0]["shift_labels"].tolist() == [[11, 12, 13, 14]]  # 13's label is rank 1's first token
    assert got[1]["shift_labels"].tolist() == [[15, 16, 17, -100]]
    assert got[1]["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert [g["loss_weight"].tolist() for g in got] == [[[2, 2, 2, 2]], [[2, 2, 2, 0]]]  # ranks, where scored
    assert [g["num_items"].tolist() for g in got] == [[[7] * 4]] * 2  # 7 scored tokens in all
    zig = mesh.run(lambda: sf.hf.shard_sequence({"input_ids": ids}, mesh, batch_axes=(), layout="zigzag"))
    assert zig[0]["input_ids"].tolist() == [[10, 11, 16, 17]]
    assert zig[0]["position_ids"].tolist() == [[0, 1, 6, 7]]
    assert zig[0]["shift_labels"].tolist() == [[11, 12, 17, -100]]
    assert zig[1]["shift_labels"].tolist() == [[13, 14, 15, 16]]


def _activations_per_rank(attn: str, n: int, ids) -> tuple[int, int]:
    """Rank 0's activations (the bytes a forward leaves alive for its backward: the net of
    sf.measure_memory around an eager forward) and the forward's peak, in a 1-layer Llama
    whose memory is its attention, the sequence over n ranks ('sdpa': one device)."""
    model = model_of("llama", attn, num_hidden_layers=1, num_key_value_heads=4)
    apply_fn, params = sf.functional(model)
    mesh = sf.local_mesh({"data": 1, "seq": n})
    loss = sf.hf.causal_lm_loss(apply_fn, seq_axis=None if attn == "sdpa" else "seq")
    step = sf.shard(loss, mesh, data_axes=("data", "seq"))

    def body():
        shards = optree.tree_map(lambda x: x.detach().requires_grad_(), step.shard_params(params))
        batch = sf.hf.shard_sequence({"input_ids": ids}, mesh)
        step(shards, batch).backward()  # warm: gathers, process groups
        if mesh.rank != 0:
            mesh.all_reduce(torch.ones(1))
            step(shards, batch).backward()
            return None
        with sf.measure_memory("cpu") as m:
            mesh.all_reduce(torch.ones(1))
            loss = step(shards, batch)
        loss.backward()
        return m.net_bytes, m.peak_bytes

    return mesh.run(body)[0]


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["shardfn_ring", "shardfn_ulysses"])
def test_attention_memory_per_rank_falls_as_one_over_n(attn):
    """A rank's peak in a step of a model whose memory is its attention (T = 512, 1 layer,
    32 wide, fp64) against the SDPA model on one device: at most 1.2/N of it for N = 2, 4
    (Ulysses holds the T x T scores of H/N heads: 1/N; ring only (T/N)^2 blocks: less)."""
    ids = torch.randint(V, (1, 512), generator=torch.Generator().manual_seed(0))
    one, one_peak = _activations_per_rank("sdpa", 1, ids)
    for n in (2, 4):
        held, peak = _activations_per_rank(attn, n, ids)
        print(f"{attn}: a rank of N = {n} holds {held / one:.3f} of one device's {one:,} B of activations "
              f"(1/N = {1 / n:.3f}); forward peak {peak / one_peak:.3f} of one device's {one_peak:,} B")
        assert held / one <= 1.2 / n


# -- errors ------------------------------------------------------------------------------------


def _cp_call(model, batch, layout="contiguous", mesh_shape=None):
    apply_fn, params = sf.functional(model)
    mesh = sf.local_mesh(mesh_shape or {"seq": 2})
    step = sf.shard(sf.hf.causal_lm_loss(apply_fn, layout=layout), mesh, data_axes=("seq",))
    return mesh.run(lambda: step(step.shard_params(params), sf.hf.shard_sequence(batch, mesh, batch_axes=(),
                                                                                 layout=layout)))


def test_attention_dropout_and_sliding_windows_are_refused():
    batch = batches(1)[0]
    with pytest.raises(sf.ShardingError, match=r"attention dropout 0.5 \(config.attention_dropout\).*set it to 0.0"):
        _cp_call(model_of("llama", "shardfn_ring", attention_dropout=0.5).train(), batch)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(vocab_size=V, sliding_window=4, **SIZES))
    mistral.set_attn_implementation("shardfn_ring")
    with pytest.raises(sf.ShardingError, match=r"a sliding window of 4 tokens.*sliding_window=None"):
        _cp_call(mistral.double(), batch)


def test_bad_batches_are_refused():
    mesh = sf.local_mesh({"seq": 2})
    with pytest.raises(sf.ShardingError, match=r"batch must be a dict with 'input_ids'"):
        sf.hf.shard_sequence(torch.zeros(2, 8, dtype=torch.long), mesh)
    with pytest.raises(sf.ShardingError, match=r"batch\['labels'\] has shape \(2, 7\)"):
        sf.hf.shard_sequence({"input_ids": torch.zeros(2, 8, dtype=torch.long),
                              "labels": torch.zeros(2, 7, dtype=torch.long)}, mesh)
    with pytest.raises(sf.ShardingError, match=r"(?s)has no axis 'seq'.*Fix: build the mesh with a sequence axis"):
        sf.hf.shard_sequence({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, sf.local_mesh({"data": 2}))
    with pytest.raises(sf.ShardingError, match=r"does not divide\s+into 2 \* 2 = 4 equal chunks"):
        sf.hf.shard_sequence({"input_ids": torch.zeros(2, 6, dtype=torch.long)}, mesh, batch_axes=(),
                             layout="zigzag")
    with pytest.raises(sf.ShardingError, match=r"(?s)length 7 does not split over axis 'seq' of size 2.*pad the batch"):
        sf.hf.shard_sequence({"input_ids": torch.zeros(2, 7, dtype=torch.long)}, mesh, batch_axes=())


def test_ulysses_with_fewer_kv_heads_than_ranks():
    """Qwen2 with 2 K/V heads on a 4-way sequence axis: each K/V head is repeated to 4
    (GQA pairing kept), so Ulysses runs; 2 AdamW steps == one device. With 4 query heads
    on 8 ranks, Ulysses' own error, with its fix."""
    data, opt = batches(2), sf.optim.adamw(1e-2)
    want, _ = one_device("qwen2", data, opt)
    mesh = sf.local_mesh({"data": 1, "seq": 4})
    for got, _ in mesh.run(cp_training, mesh, model_of("qwen2", "shardfn_ulysses"), "contiguous", data, opt):
        assert maxdiff(got, want) <= 1e-9
    batch = {"input_ids": batches(1)[0]["input_ids"][:1]}
    with pytest.raises(sf.ShardingError, match=r"(?s)both must divide by 8.*Fix: use sf.nn.ring_attention"):
        _cp_call(model_of("qwen2", "shardfn_ulysses"), batch, mesh_shape={"seq": 8})


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.multiprocess
def test_cp_training_on_processes():
    """4 forked processes (gloo), {'data': 2, 'seq': 2}, a Qwen2 with ring attention, zig-zag:
    == one device."""
    data, opt = batches(2), sf.optim.adamw(1e-2)
    want, _ = one_device("qwen2", data, opt)
    model = model_of("qwen2", "shardfn_ring")
    results = run_on_mesh(lambda mesh: cp_training(mesh, model, "zigzag", data, opt),
                          {"data": 2, "seq": 2}, "distributed", timeout=120.0)
    assert len(results) == 4
    for got, _ in results:
        assert maxdiff(got, want) <= 1e-9
