"""`sf.hf`: transformers checkpoints straight into shards, and shards back out.

Checkpoints are written by transformers' own `save_pretrained` from random-init models
built here (no downloads); the references are the models' own tensors and logits. Each
rank's reads are counted by shardfn's reader and checked against byte counts computed
here from the shards' shapes and the files' headers.
"""

import json
import os
import struct

import optree
import pytest
import torch

import shardfn as sf
import shardfn.checkpoint as ckpt
from shardfn.testing import run_on_mesh
from collective_cases import mesh_for  # one simulated mesh per shape, per session

transformers = pytest.importorskip("transformers")

P = sf.P
VOCAB = 64


def llama(dtype=torch.float32, tie=False, layers=2, vocab=VOCAB):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM, cfg, dtype


def gpt2(dtype=torch.float64, tie=True, layers=2, vocab=VOCAB):
    cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=layers, n_head=2, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie)
    return transformers.GPT2LMHeadModel, cfg, dtype


def build(spec, seed=0, device=None):
    cls, cfg, dtype = spec
    torch.manual_seed(seed)
    if device == "meta":
        with torch.device("meta"):
            return cls(cfg).to(dtype)
    return cls(cfg).to(dtype).eval()


ARCHS = {"llama-f32": llama(), "gpt2-f64-tied": gpt2()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> (checkpoint dir, the reference model): Llama as a sharded index, GPT-2 as one file."""
    out = {}
    for name, spec in ARCHS.items():
        model = build(spec)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path, max_shard_size="20KB" if name.startswith("llama") else "5GB")
        out[name] = (path, model)
    return out


def leaves(tree):
    return optree.tree_leaves(tree, namespace="shardfn")




def header_bytes(path):
    """8 + the JSON header's length, summed over the checkpoint's weight files (read here, not by shardfn)."""
    total = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                total += 8 + struct.unpack("<Q", f.read(8))[0]
    return total


def loss_fn_for(apply_fn):
    def loss_fn(params, ids):
        out = apply_fn(params, ids, labels=ids, use_cache=False)
        return out.loss, out.logits.detach()

    return loss_fn


# -- sharded loads: the layout of shard_params, bit for bit, reading only this rank's bytes ------


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("n", [2, 4])
def test_load_shards_fsdp_equals_shard_params_and_reads_only_its_rows(saved, arch, n):
    path, model = saved[arch]
    apply_fn, full = sf.functional(model)
    like = sf.functional(build(ARCHS[arch], device="meta"))[1]
    mesh = mesh_for({"data": n})
    step = sf.shard(loss_fn_for(apply_fn), mesh, has_aux=True)
    item = ARCHS[arch][2].itemsize

    def body():
        shards, stats = sf.hf.load_shards(step, path, like, return_stats=True)
        return shards, stats, step.shard_params(full), step.unshard_params(shards)

    for rank, (shards, stats, expected, back) in enumerate(mesh.run(body)):
        sf.testing.assert_trees_equal(shards, expected)  # each rank: exactly shard_params' dim-0 chunks
        sf.testing.assert_trees_equal(back, full)  # the round trip: the model's own tensors, bit for bit
        mine = sum(x.numel() for x in leaves(shards)) * item
        assert stats.data_bytes == mine == stats.wanted_bytes == stats.row_bytes, (rank, stats)
        assert stats.header_bytes == header_bytes(path)
        assert stats.total_bytes <= mine + header_bytes(path)  # its rows + the headers, nothing else
        largest = max(x.numel() for x in leaves(shards)) * item
        assert stats.max_read_bytes == largest  # one block held beyond the shards at a time
    if arch.startswith("llama"):
        assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1  # the sharded index


def tp_specs(path):
    """Megatron layout for HF Linear weights (out, in): q/k/v, gate, up split on dim 0 (their
    output), o_proj and down_proj on dim 1 (their input: a column slice of every row)."""
    name = path[-2] if len(path) > 1 else ""
    if path[-1] != "weight":
        return None
    if name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return P("model", None)
    if name in ("o_proj", "down_proj"):
        return P(None, "model")
    return None


@pytest.mark.parametrize("mesh_shape,kw", [
    ({"data": 2, "model": 2}, dict(param_specs=tp_specs)),
    ({"replica": 2, "shard": 2}, dict(data_axes=("replica", "shard"), shard_axes="shard")),
], ids=["fsdp_x_tp", "hsdp"])
def test_load_shards_tp_and_hsdp(saved, mesh_shape, kw, tmp_path):
    path, model = saved["llama-f32"]
    apply_fn, full = sf.functional(model)
    like = sf.functional(build(ARCHS["llama-f32"], device="meta"))[1]
    mesh = mesh_for(mesh_shape)
    step = sf.shard(loss_fn_for(apply_fn), mesh, **kw)
    out = str(tmp_path / "export")

    def body():
        shards, stats = sf.hf.load_shards(step, path, like, return_stats=True)
        saved_stats = sf.hf.save_pretrained(out, step, shards, model)
        return shards, stats, step.shard_params(full), step.unshard_params(shards), saved_stats

    for shards, stats, expected, back, _ in mesh.run(body):
        sf.testing.assert_trees_equal(shards, expected)
        sf.testing.assert_trees_equal(back, full)
        # the bytes of the full rows its blocks lie in, computed from the shapes here
        rows = sum(shard.shape[0] * x[0].numel() * 4 for shard, x in zip(leaves(shards), leaves(full)))
        assert stats.row_bytes == rows
        assert stats.data_bytes <= rows  # its rows; with o_proj / down_proj column slices, fewer
        assert stats.total_bytes <= rows + header_bytes(path)
        if "param_specs" in kw:  # the column-parallel reads take a span, not whole rows
            assert stats.wanted_bytes < stats.data_bytes < stats.row_bytes
        else:
            assert stats.wanted_bytes == stats.data_bytes == stats.row_bytes
    # The export from those shards is the model itself.
    again = transformers.LlamaForCausalLM.from_pretrained(out)
    sf.testing.assert_trees_equal(sf.functional(again)[1], full)


# -- export -> from_pretrained -> the same logits ------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_export_trained_shards_loads_in_transformers_with_same_logits(saved, arch, tmp_path):
    path, model = saved[arch]
    spec = ARCHS[arch]
    empty = sf.hf.empty_model(spec[1], spec[0], dtype=spec[2]).eval()  # no weights held; eval: no dropout
    assert all(p.is_meta for p in empty.parameters()) and not any(b.is_meta for b in empty.buffers())
    apply_fn, like = sf.functional(empty)
    mesh = mesh_for({"data": 2})
    step = sf.shard(loss_fn_for(apply_fn), mesh, has_aux=True)
    out = str(tmp_path / "export")
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))

    def body():
        shards = sf.hf.load_shards(step, path, like)
        grads, _ = torch.func.grad(step, has_aux=True)(shards, ids.chunk(2)[mesh.rank])
        shards = optree.tree_map(lambda s, g: s - 0.1 * g, shards, grads, namespace="shardfn")  # one SGD step
        stats = sf.hf.save_pretrained(out, step, shards, empty, max_shard_size="30KB")
        return stats, step(shards, ids)[1], step.unshard_params(shards)

    (stats, logits, trained), _ = mesh.run(body)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert list(stats.files) == files and len(files) > 1
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert sorted(index["weight_map"]) == sorted(set(model.state_dict()) - set(ckpt.tied_keys(model)))
    assert index["metadata"]["total_size"] == stats.total_bytes == sum(x.numel() for x in leaves(trained)) * spec[2].itemsize
    assert stats.peak_unit_bytes < stats.total_bytes  # gathered one unit at a time, never the whole model
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=spec[2])
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    sf.testing.assert_trees_equal(sf.functional(loaded)[1], trained)
    if spec[1].tie_word_embeddings:
        assert "lm_head.weight" not in index["weight_map"]
        assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    with torch.no_grad():
        theirs = loaded(ids, use_cache=False).logits
    assert torch.equal(theirs, logits), (theirs - logits).abs().max()


def test_export_single_file_in_bf16_records_the_dtype(saved, tmp_path):
    path, model = saved["llama-f32"]
    apply_fn, full = sf.functional(model)
    mesh = mesh_for({"data": 2})
    step = sf.shard(loss_fn_for(apply_fn), mesh, has_aux=True)
    out = str(tmp_path / "bf16")
    mesh.run(lambda: sf.hf.save_pretrained(out, step, step.shard_params(full), model, dtype=torch.bfloat16))
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    written = load_file(os.path.join(out, "model.safetensors"))
    assert written.keys() == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert written[key].dtype == torch.bfloat16 and torch.equal(written[key], value.to(torch.bfloat16))


# -- dtype casts, key names, tied weights --------------------------------------------------------


def test_bf16_checkpoint_into_fp32_master_shards_needs_cast(tmp_path):
    model = build(llama(dtype=torch.bfloat16))
    model.save_pretrained(str(tmp_path))
    like = sf.functional(build(llama(), device="meta"))[1]  # fp32
    apply_fn, full = sf.functional(model)
    mesh = mesh_for({"data": 2})
    step = sf.shard(loss_fn_for(apply_fn), mesh, has_aux=True)
    with pytest.raises(ckpt.CheckpointDTypeError, match=r"(?s)model.embed_tokens.weight.*holds torch.bfloat16, "
                                                       r"like has torch.float32.*Fix: pass cast=True"):
        mesh.run(lambda: sf.hf.load_shards(step, str(tmp_path), like))
    shards, stats = mesh.run(lambda: sf.hf.load_shards(step, str(tmp_path), like, cast=True, return_stats=True))[0]
    assert all(x.dtype == torch.float32 for x in leaves(shards))
    assert stats.data_bytes == sum(x.numel() for x in leaves(shards)) * 2  # read as bf16, cast after
    back = mesh.run(lambda: step.unshard_params(sf.hf.load_shards(step, str(tmp_path), like, cast=True)))[0]
    sf.testing.assert_trees_equal(back, optree.tree_map(lambda x: x.float(), full, namespace="shardfn"))


def test_base_model_checkpoint_loads_into_the_model_with_a_head(tmp_path):
    """GPT2Model writes 'h.0.attn...' (no 'transformer.' prefix): transformers strips the
    prefix on load, and so does load_shards (the tied lm_head needs no tensor of its own)."""
    spec = gpt2()
    base = transformers.GPT2Model(spec[1]).to(spec[2])
    base.save_pretrained(str(tmp_path))
    like = sf.functional(build(spec, device="meta"))[1]
    mesh = mesh_for({"data": 2})
    step = sf.shard(lambda p, x: p["transformer"]["ln_f"]["weight"].sum(), mesh)
    back = mesh.run(lambda: step.unshard_params(sf.hf.load_shards(step, str(tmp_path), like)))[0]
    sf.testing.assert_trees_equal(back["transformer"], sf.functional(base)[1])


def test_tied_copy_in_the_file_is_accepted_with_tied(tmp_path, saved):
    """A checkpoint that also stores lm_head.weight (a tied copy): unexpected unless tied= names it."""
    _, model = saved["gpt2-f64-tied"]
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in state
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    like = sf.functional(build(gpt2(), device="meta"))[1]
    mesh = mesh_for({"data": 2})
    step = sf.shard(lambda p, x: p["transformer"]["ln_f"]["weight"].sum(), mesh)
    with pytest.raises(ckpt.CheckpointKeyError, match=r"(?s)not in `like` \(1\):\n  - lm_head.weight.*tied="):
        mesh.run(lambda: sf.hf.load_shards(step, str(tmp_path), like))
    back = mesh.run(lambda: step.unshard_params(sf.hf.load_shards(step, str(tmp_path), like,
                                                                  tied=ckpt.tied_keys(model))))[0]
    sf.testing.assert_trees_equal(back, sf.functional(model)[1])


# -- errors --------------------------------------------------------------------------------------


def _load_error(path, like, **kw):
    mesh = mesh_for({"data": 2})
    step = sf.shard(lambda p, x: sum(t.sum() for t in leaves(p)), mesh)
    return mesh.run(lambda: sf.hf.load_shards(step, path, like, **kw))


def test_missing_and_unexpected_keys_are_listed_with_a_fix(saved):
    path, _ = saved["llama-f32"]
    bigger = sf.functional(build(llama(layers=3), device="meta"))[1]
    with pytest.raises(ckpt.CheckpointKeyError, match=r"(?s)its config.json names \['LlamaForCausalLM'\].*"
                                                      r"Missing from the checkpoint \(9\):\n  - "
                                                      r"'model.layers.2.input_layernorm.weight' \(like\['model'\]"
                                                      r"\['layers'\]\[2\]\['input_layernorm'\]\['weight'\], shape "
                                                      r"\(32,\)\).*Fix: build `like`") as info:
        _load_error(path, bigger)
    assert "tie_word_embeddings" not in str(info.value)  # the hint is for checkpoints that tie
    smaller = sf.functional(build(llama(layers=1), device="meta"))[1]
    with pytest.raises(ckpt.CheckpointKeyError, match=r"(?s)not in `like` \(9\):\n  - model.layers.1.*strict=False"):
        _load_error(path, smaller)
    shards = _load_error(path, smaller, strict=False)  # the first layer and the rest load
    assert shards[0]["model"]["layers"][0]["mlp"]["up_proj"]["weight"].shape == (32, 32)


def test_tied_checkpoint_into_an_untied_model_names_tie_word_embeddings(saved):
    path, _ = saved["gpt2-f64-tied"]
    untied = sf.functional(build(gpt2(tie=False), device="meta"))[1]
    with pytest.raises(ckpt.CheckpointKeyError, match=r"(?s)'lm_head.weight' \(like\['lm_head'\]\['weight'\], "
                                                      r"shape \(64, 32\)\).*tie_word_embeddings=true, so "
                                                      r"lm_head.weight is not stored\): build the model with "
                                                      r"tie_word_embeddings=True"):
        _load_error(path, untied)


def test_shape_mismatch_names_key_and_both_shapes(saved):
    path, _ = saved["llama-f32"]
    other = sf.functional(build(llama(vocab=80), device="meta"))[1]
    with pytest.raises(ckpt.CheckpointShapeError, match=r"(?s)'model.embed_tokens.weight' \(like\['model'\]"
                                                        r"\['embed_tokens'\]\['weight'\]\): the checkpoint holds "
                                                        r"\(64, 32\), like has \(80, 32\).*AutoConfig.from_pretrained"):
        _load_error(path, other)


def test_no_safetensors_and_outside_a_rank(tmp_path, saved):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    like = sf.functional(build(llama(), device="meta"))[1]
    with pytest.raises(ckpt.CheckpointError, match=r"holds no model.safetensors and no model.safetensors.index.json "
                                                   r"\(it holds \['pytorch_model.bin'\]\).\nFix: re-save it"):
        _load_error(str(tmp_path), like)
    step = sf.shard(lambda p, x: x.sum(), mesh_for({"data": 2}))
    with pytest.raises(sf.ShardingError, match=r"not a rank of the simulated mesh.*\nFix: call it inside mesh.run"):
        sf.hf.load_shards(step, saved["llama-f32"][0], like)


def test_export_errors(tmp_path, saved):
    path, model = saved["llama-f32"]
    apply_fn, full = sf.functional(model)
    mesh = mesh_for({"data": 2})
    step = sf.shard(loss_fn_for(apply_fn), mesh, has_aux=True)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ckpt.CheckpointError, match=r"'.*taken' already exists.\nFix: .*overwrite=True"):
        mesh.run(lambda: sf.hf.save_pretrained(str(tmp_path / "taken"), step, step.shard_params(full), model))
    assert os.listdir(tmp_path) == ["taken"]  # no temporary directory left behind
    other = build(llama(layers=1))
    with pytest.raises(sf.ShardingError, match=r"(?s)the model's parameter tree is not the shards' tree:\n  - "
                                               r"shards\['model'\]\['layers'\]\[1\].*not a parameter of the model"):
        mesh.run(lambda: sf.hf.save_pretrained(str(tmp_path / "x"), step, step.shard_params(full), other))
    with pytest.raises(ckpt.CheckpointError, match=r"max_shard_size '5 parsecs' is not a size"):
        mesh.run(lambda: sf.hf.save_pretrained(str(tmp_path / "x"), step, step.shard_params(full), model,
                                               max_shard_size="5 parsecs"))
    assert os.listdir(tmp_path) == ["taken"]


def test_export_failing_mid_write_raises_everywhere_and_leaves_nothing(tmp_path, saved, monkeypatch):
    """Rank 0 fails writing a leaf while the other ranks gather: every rank raises, and
    neither the target nor a temporary directory is left (the write is atomic)."""
    path, model = saved["llama-f32"]
    apply_fn, full = sf.functional(model)
    mesh = mesh_for({"data": 2})
    step = sf.shard(loss_fn_for(apply_fn), mesh, has_aux=True)
    from shardfn._hf import _safetensors

    real, calls = _safetensors.Writer.write, []

    def flaky(self, name, t):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("injected: disk full")
        return real(self, name, t)

    monkeypatch.setattr(_safetensors.Writer, "write", flaky)
    results = []

    def body():
        try:
            sf.hf.save_pretrained(str(tmp_path / "out"), step, step.shard_params(full), model)
        except OSError as err:
            results.append((mesh.rank, str(err)))

    mesh.run(body)
    assert sorted(results) == [(0, "injected: disk full"), (1, "injected: disk full")]
    assert os.listdir(tmp_path) == []


# -- real processes ------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.ci
def test_load_and_export_on_two_processes(saved, tmp_path):
    path, model = saved["llama-f32"]
    apply_fn, full = sf.functional(model)
    like = sf.functional(build(ARCHS["llama-f32"], device="meta"))[1]
    out = str(tmp_path / "export")

    def body(mesh):
        step = sf.shard(loss_fn_for(apply_fn), mesh, has_aux=True)
        shards, stats = sf.hf.load_shards(step, path, like, return_stats=True)
        sf.hf.save_pretrained(out, step, shards, model)
        return stats.data_bytes, sum(x.numel() for x in leaves(shards)) * 4, step.unshard_params(shards)

    for data_bytes, mine, back in run_on_mesh(body, {"data": 2}, "distributed"):
        assert data_bytes == mine
        sf.testing.assert_trees_equal(back, full)
    sf.testing.assert_trees_equal(sf.functional(transformers.LlamaForCausalLM.from_pretrained(out))[1], full)
