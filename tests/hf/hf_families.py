"""The families x features table of docs/howto/transformers.md: its cases and its cells.

`TABLE` is the table (family, feature) -> "yes" or "no: <reason>"; `run_cell(family,
feature)` runs one cell and returns None when it holds or the error it met.
tests/hf/test_hf_families.py runs every cell against `TABLE` (a "yes" must pass, a "no"
must fail with its reason), and scripts/gen_hf_families_docs.py writes `markdown()` into
the page between its markers (a test checks the page is current). Tiny configs, random
init, no downloads.

Features:
- remat training: `sf.functional(model, remat=True)` + `sf.shard` on 2 simulated ranks, 2
  AdamW steps in fp64, the loss computed from the logits in fp64, equal to transformers'
  model trained by torch.optim.AdamW on the global batch within 1e-9 at every step;
- sharded init: `sf.init.from_module` of the model on meta + `step.init_shards` on 2
  ranks: constants exactly the model's own values, random leaves at its scale (std within
  25% of the model's own draw);
- load / export: `save_pretrained` -> `sf.hf.load_shards` (2 ranks) -> `unshard_params` bit
  for bit, and `sf.hf.save_pretrained` -> `from_pretrained` -> logits `torch.equal`;
- estimate: `sf.estimate` with `use_cache=False` (where the model takes it) and with remat
  against the real step (tests/estimate's check: bytes of shards, state and collectives
  exact, peak, activations and total within 10%);
- CP: the model with `attn_implementation="shardfn_ring"` on {"data": 1, "seq": 2}
  (zig-zag, FSDP over both axes), `sf.hf.shard_sequence` + `sf.hf.causal_lm_loss`, 2 AdamW
  steps in fp64 equal to the same loss on one device (the model's default attention) within
  1e-9, losses and parameters;
- PP: `sf.hf.pipeline_stages(model, microbatches=2, schedule="1f1b")` on {"stage": 2,
  "data": 1} (one decoder layer a stage) in `sf.shard`, 2 AdamW steps in fp64 equal to one
  device within 1e-9;
- sf.jit: 2 AdamW steps of `sf.jit(step, opt, backend="aot_eager")` on 2 gloo processes,
  losses and parameters bit-equal to the eager `sf.train_step` (fp64; the loss as in remat
  training).

A "no" cell holds the start of the error the library raises (`EXPECTED_ERRORS`).
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import torch
import torch.nn.functional as F

import shardfn as sf

B, T, V = 4, 8, 64  # global batch, sequence, vocab
FAMILIES = ["llama", "mistral", "gemma", "gpt_neox", "phi3", "qwen3_moe", "bert", "t5", "vit"]
FEATURES = ["remat training", "sharded init", "load / export", "estimate", "CP", "PP", "sf.jit"]
LABELS = {"llama": "Llama", "mistral": "Mistral (sliding window)", "gemma": "Gemma (tied)",
          "gpt_neox": "GPT-NeoX", "phi3": "Phi-3", "qwen3_moe": "Qwen3-MoE (eager experts)", "bert": "BERT (masked LM)",
          "t5": "T5", "vit": "ViT (image classification)"}

TABLE: dict[tuple[str, str], str] = {(f, feature): "yes" for f in FAMILIES for feature in FEATURES}
# The router picks each token's experts from activations (`nonzero` of its choice): no dry
# run can know how many tokens each expert gets, so sf.estimate names the op.
TABLE[("qwen3_moe", "estimate")] = "no: routing is data-dependent (sf.estimate raises its SpecError on `nonzero`)"
TABLE[("gemma", "CP")] = "yes, within 1e-6 (Gemma's RMSNorm computes in fp32)"
TABLE[("qwen3_moe", "sf.jit")] = ('yes, with experts_implementation="batched_mm" (the eager experts\' loop is '
                                  'data-dependent)')
NOT_CAUSAL = "bidirectional attention (is_causal=False): the model is not a causal LM"
TABLE.update({
    ("mistral", "CP"): "no: sliding-window attention (only full causal attention is split)",
    ("bert", "CP"): "no: not a causal LM (bidirectional attention, refused by the ring attention)",
    ("t5", "CP"): "no: not a causal LM (a bidirectional encoder, refused by the ring attention)",
    ("vit", "CP"): "no: no token sequence (sf.hf.shard_sequence takes input_ids)",
    ("mistral", "PP"): "no: sliding-window attention (the stages send no mask)",
    ("gpt_neox", "PP"): "no: not of the Llama shape (embed_in, final_layer_norm)",
    ("qwen3_moe", "PP"): "no: mixture of experts (sf.pipeline's meta check cannot shape the routing)",
    ("bert", "PP"): "no: not a decoder LM",
    ("t5", "PP"): "no: not a decoder LM",
    ("vit", "PP"): "no: not a decoder LM",
})
_RING = "ShardingError: attn_implementation='shardfn_ring' in "
_PP = "ShardingError: sf.hf.pipeline_stages("
EXPECTED_ERRORS = {
    ("qwen3_moe", "estimate"): "SpecError: sf.estimate: aten.nonzero.default cannot run in the dry run",
    ("mistral", "CP"): _RING + "MistralAttention (model_type 'mistral'): a sliding window of 4 tokens",
    ("bert", "CP"): _RING + "BertSelfAttention (model_type 'bert'): " + NOT_CAUSAL,
    ("t5", "CP"): _RING + "T5Attention (model_type 't5'): " + NOT_CAUSAL,
    ("vit", "CP"): "ShardingError: sf.hf.shard_sequence(seq_axis='seq', layout='zigzag'): batch must be a dict with "
                   "'input_ids'",
    ("mistral", "PP"): _PP + "MistralForCausalLM): the decoder layers use sliding-window attention (windows of [4]",
    ("gpt_neox", "PP"): _PP + "GPTNeoXForCausalLM): GPTNeoXForCausalLM is not a decoder LM of the Llama shape",
    ("qwen3_moe", "PP"): _PP + "Qwen3MoeForCausalLM): the decoder layers route tokens to 4 experts",
    ("bert", "PP"): _PP + "BertForMaskedLM): BertForMaskedLM is not a decoder LM of the Llama shape",
    ("t5", "PP"): _PP + "T5ForConditionalGeneration): T5ForConditionalGeneration is not a decoder LM of the "
                        "Llama shape",
    ("vit", "PP"): _PP + "ViTForImageClassification): ViTForImageClassification is not a decoder LM of the Llama "
                         "shape",
}


def kind(family: str) -> str:
    return {"bert": "mlm", "t5": "seq2seq", "vit": "image"}.get(family, "causal")


def build(family: str, dtype=torch.float32, device=None):
    """A tiny random-init model of `family` (dropout off), in `dtype`."""
    import transformers

    transformers.logging.set_verbosity_error()
    small = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    if family == "llama":
        cls, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(**small)
    elif family == "mistral":
        cls, cfg = transformers.MistralForCausalLM, transformers.MistralConfig(**small, sliding_window=4)
    elif family == "gemma":
        cls, cfg = transformers.GemmaForCausalLM, transformers.GemmaConfig(**small, head_dim=8)
    elif family == "gpt_neox":
        cls, cfg = transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)
    elif family == "phi3":
        cls, cfg = transformers.Phi3ForCausalLM, transformers.Phi3Config(
            **small, pad_token_id=0, bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attention_dropout=0.0)
    elif family == "qwen3_moe":
        cls, cfg = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            **small, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8,
            experts_implementation="eager")  # [Note: MoE experts in the table]
    elif family == "bert":
        cls, cfg = transformers.BertForMaskedLM, transformers.BertConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    elif family == "t5":
        cls, cfg = transformers.T5ForConditionalGeneration, transformers.T5Config(
            vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0)
    elif family == "vit":
        cls, cfg = transformers.ViTForImageClassification, transformers.ViTConfig(
            image_size=32, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.device(device or "cpu"):
        warnings.simplefilter("ignore")
        model = cls(cfg)
    return model.to(dtype) if device != "meta" else model


def batch(family: str, n: int = B, seed: int = 1, dtype=torch.float64, t: int = T) -> dict:
    """A batch of `n` examples (sequences of `t` tokens): the model's inputs and `labels`."""
    g = torch.Generator().manual_seed(seed)
    if kind(family) == "image":
        return dict(pixel_values=torch.randn(n, 3, 32, 32, generator=g, dtype=dtype),
                    labels=torch.randint(0, 5, (n,), generator=g))
    ids = torch.randint(3, V, (n, t), generator=g)
    if kind(family) == "seq2seq":
        return dict(input_ids=ids, labels=torch.randint(3, V, (n, 5), generator=g))
    return dict(input_ids=ids, labels=ids)


def forward_loss(family: str, call, batch: dict) -> torch.Tensor:
    """The loss from the logits in their own dtype (fp64 here, not transformers' fp32 cast):
    `call(**inputs)` is the model or its apply function with the params bound."""
    k = kind(family)
    inputs = {key: v for key, v in batch.items() if key != "labels"}
    if k == "seq2seq":
        inputs["labels"] = batch["labels"]  # builds the decoder's inputs
    if k in ("causal", "seq2seq"):
        inputs["use_cache"] = False
    logits = call(**inputs).logits
    labels = batch["labels"]
    if k == "causal":
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


# [Note: MoE experts in the table] transformers 5 runs a MoE model's experts with
# `torch._grouped_mm` by default ("grouped_mm"), which takes no float64 on the CPU (the
# transformers model itself fails: "Expected mat_a to be Float32, BFloat16 or Float16"), and
# whose meta kernel takes bfloat16 only, so a dry run in fp32 fails on it too. The table's
# Qwen3-MoE runs `experts_implementation="eager"` (a loop over the experts, the same
# parameters and checkpoint): the cells then say what they say of the rest of the model.
# The sf.jit cell runs `experts_implementation="batched_mm"` (each token's experts' weights
# gathered, then batched matmuls: fixed shapes, fp64): the eager loop runs once per expert
# the batch hits (`nonzero`), which dynamo cannot capture as one graph.


# -- the cells ------------------------------------------------------------------------------

def remat_training(family: str) -> None:
    model = build(family, torch.float64)
    data = batch(family)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    want = []
    for _ in range(2):
        opt.zero_grad()
        loss = forward_loss(family, ref, data)
        loss.backward()
        opt.step()
        want.append(loss.item())
    apply_fn, params = sf.functional(model, remat=True)
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, b: forward_loss(family, lambda **kw: apply_fn(p, **kw), b), mesh)
    sgd = sf.optim.adamw(1e-3)

    def body():
        shards = step.shard_params(params)
        state = sgd.init(shards)
        local = {k: v.chunk(2)[mesh.rank] for k, v in data.items()}
        train = sf.train_step(step, sgd)
        losses = []
        for _ in range(2):
            shards, state, loss = train(shards, state, local)
            losses.append(float(loss))
        return losses

    got = mesh.run(body)[0]
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff <= 1e-9, f"{family}: losses {got} vs transformers {want} ({diff:.2e})"


def sharded_init(family: str) -> None:
    meta = build(family, device="meta")
    desc = sf.init.from_module(meta)
    apply_fn, _ = sf.functional(meta)
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, b: p, mesh)
    full = mesh.run(lambda: step.unshard_params(step.init_shards(desc, seed=0)))[0]
    real = build(family)  # the model's own init, on the CPU
    _, own = sf.functional(real)
    param_type = sf.init.Param
    descs = torch.utils._pytree.tree_leaves(desc, is_leaf=lambda x: isinstance(x, param_type))
    ours, theirs = torch.utils._pytree.tree_leaves(full), torch.utils._pytree.tree_leaves(own)
    assert len(descs) == len(ours) == len(theirs)
    for d, a, b in zip(descs, ours, theirs):
        b = b.detach()
        if b.numel() > 1 and b.std() == 0 or b.numel() == 1:  # a constant in the model: exactly it
            assert torch.equal(a, b), f"{family}: {d.init!r} gives {a.flatten()[:4]}, the model {b.flatten()[:4]}"
        elif b.numel() >= 64:
            ratio = (a.std() / b.std()).item()
            assert 0.75 <= ratio <= 1.25, f"{family}: {d.init!r}: std {a.std():.4g}, the model's {b.std():.4g}"


def load_export(family: str) -> None:
    model = build(family).eval()
    with tempfile.TemporaryDirectory() as tmp:
        saved, ours = os.path.join(tmp, "saved"), os.path.join(tmp, "ours")
        model.save_pretrained(saved)
        like = sf.functional(build(family, device="meta"))[1]
        apply_fn, params = sf.functional(model)
        mesh = sf.local_mesh({"data": 2})
        step = sf.shard(lambda p, b: p, mesh)

        def body():
            back = step.unshard_params(sf.hf.load_shards(step, saved, like))
            sf.hf.save_pretrained(ours, step, step.shard_params(params), model)
            return back

        back = mesh.run(body)[0]
        for a, b in zip(torch.utils._pytree.tree_leaves(back), torch.utils._pytree.tree_leaves(params)):
            assert torch.equal(a, b), f"{family}: a loaded leaf differs"
        loaded = type(model).from_pretrained(ours).eval()
        data = batch(family, dtype=torch.float32)
        inputs = {k: v for k, v in data.items() if k != "labels" or kind(family) == "seq2seq"}
        with torch.no_grad():
            assert torch.equal(loaded(**inputs).logits, model(**inputs).logits), f"{family}: logits differ"


def estimate(family: str) -> None:
    from estimate.test_estimate import _check

    for remat in (False, True):
        apply_fn, params = sf.functional(build(family), remat=remat or None)

        def loss_fn(p, b):
            return forward_loss(family, lambda **kw: apply_fn(p, **kw), b)

        def make_batch(rank):  # longer sequences: activations, not fixed costs, decide the peak
            return batch(family, seed=rank, dtype=torch.float32, t=48)

        shapes = {k: (tuple(v.shape), v.dtype) for k, v in make_batch(0).items()}
        _check((loss_fn, params, make_batch, shapes), 2, optimizer=sf.optim.adamw(1e-3))


def _maxdiff(a, b) -> float:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(la) == len(lb), f"{len(la)} leaves vs {len(lb)}"
    return max((x - y).abs().max().item() for x, y in zip(la, lb))


def _causal_batch(family: str) -> dict:
    """The cell's batch as sf.hf's causal-LM helpers take it: {"input_ids"} (the labels are
    the tokens); an image model's pixel batch as it is (shard_sequence names what it lacks)."""
    data = batch(family)
    return {"input_ids": data["input_ids"]} if "input_ids" in data else data


def _one_device(model, data: dict, opt, steps: int = 2):
    """The reference of the CP and PP cells: sf.train_step of sf.hf.causal_lm_loss on the whole
    batch (the token mean of next-token cross entropy, fp64), the model's default attention."""
    apply_fn, params = sf.functional(model)
    train = sf.train_step(sf.hf.causal_lm_loss(apply_fn, seq_axis=None), opt)
    state, losses = opt.init(params), []
    for _ in range(steps):
        params, state, loss = train(params, state, sf.hf.shard_sequence(data, None))
        losses.append(loss.item())
    return params, losses


# [Note: Gemma in fp32 norms] Gemma's RMSNorm computes in fp32 whatever the model's dtype
# (`self._norm(x.float())`), so two fp64 computations that differ in the last bits (another
# order of the attention's sums) differ by fp32 roundings after a step: the one-device model
# with eager attention instead of SDPA differs from itself by 6.7e-7 after the CP cell's 2
# AdamW steps (lr 1e-2); ring attention against SDPA, by 1.5e-8. Its CP cell holds to 1e-6.
TOLERANCE = {"gemma": 1e-6}


def context_parallel(family: str) -> None:
    model = build(family, torch.float64)
    data, opt = _causal_batch(family), sf.optim.adamw(1e-2)
    ring = copy.deepcopy(model)
    sf.hf.register_attention()
    ring.set_attn_implementation("shardfn_ring")
    mesh = sf.local_mesh({"data": 1, "seq": 2})

    def body():
        apply_fn, params = sf.functional(ring)
        step = sf.shard(sf.hf.causal_lm_loss(apply_fn, layout="zigzag"), mesh, data_axes=("data", "seq"),
                        shard_axes=("data", "seq"))
        shards = step.shard_params(params)
        state, losses = opt.init(shards), []
        train = sf.train_step(step, opt)
        for _ in range(2):
            shards, state, loss = train(shards, state, sf.hf.shard_sequence(data, mesh, layout="zigzag"))
            losses.append(loss.item())
        return step.unshard_params(shards), losses

    results = mesh.run(body)
    want, want_losses = _one_device(model, data, opt)
    for got, losses in results:
        diff = max(_maxdiff(got, want), max(abs(a - b) for a, b in zip(losses, want_losses)))
        assert diff <= TOLERANCE.get(family, 1e-9), f"{family}: CP losses {losses} vs one device {want_losses} " \
                                                   f"({diff:.2e})"


def pipeline(family: str) -> None:
    model = build(family, torch.float64)
    data, opt = _causal_batch(family), sf.optim.adamw(1e-2)
    stages = sf.hf.pipeline_stages(model, microbatches=2, schedule="1f1b")
    mesh = sf.local_mesh({"stage": 2, "data": 1})
    _, params = sf.functional(model)

    def body():
        step = sf.shard(stages.loss, mesh, data_axes="data")
        shards = step.shard_params(stages.scatter_params(params, mesh))
        state, losses = opt.init(shards), []
        train = sf.train_step(step, opt)
        for _ in range(2):
            shards, state, loss = train(shards, state, data)
            losses.append(loss.item())
        return step.unshard_params(shards), losses

    results = mesh.run(body)  # rank i: stage i (data has size 1)
    layers = torch.utils._pytree.tree_map(lambda *xs: torch.cat(xs), *[p["layers"] for p, _ in results])
    got = stages.join(dict(results[0][0], layers=layers))
    want, want_losses = _one_device(model, data, opt)
    for _, losses in results:
        diff = max(_maxdiff(got, want), max(abs(a - b) for a, b in zip(losses, want_losses)))
        assert diff <= 1e-9, f"{family}: PP losses {losses} vs one device {want_losses} ({diff:.2e})"


def _jit_vs_eager(family: str) -> dict:
    """One gloo process of 2: 2 AdamW steps of the eager sf.train_step and of sf.jit (aot_eager)."""
    torch._dynamo.reset()
    mesh = sf.init_mesh({"data": 2}, timeout=300)
    model = build(family, torch.float64)
    if family == "qwen3_moe":  # [Note: MoE experts in the table]
        model.set_experts_implementation("batched_mm")
    apply_fn, params = sf.functional(model)
    local = {k: v.chunk(2)[mesh.rank] for k, v in batch(family).items()}
    out = {}
    for mode in ("eager", "traced"):
        step = sf.shard(lambda p, b: forward_loss(family, lambda **kw: apply_fn(p, **kw), b), mesh)
        opt = sf.optim.adamw(1e-3)
        shards = step.shard_params(params)
        state = opt.init(shards)
        train = sf.train_step(step, opt) if mode == "eager" else sf.jit(step, opt, backend="aot_eager", inplace=True)
        losses = []
        for _ in range(2):
            shards, state, loss = train(shards, state, local)
            losses.append(float(loss))
        out[mode] = (losses, [x.clone() for x in torch.utils._pytree.tree_leaves(shards)])
    (el, es), (tl, ts) = out["eager"], out["traced"]
    diff = max((a - b).abs().max().item() for a, b in zip(es, ts) if a.numel())  # a shard may be empty
    return {"eager": el, "traced": tl, "param_diff": diff}


def jit(family: str) -> None:
    from shardfn.testing import run_multiprocess

    for out in run_multiprocess(_jit_vs_eager, 2, family, timeout=300.0):
        assert out["traced"] == out["eager"] and out["param_diff"] == 0.0, f"{family}: sf.jit {out}"


CELLS = {"remat training": remat_training, "sharded init": sharded_init, "load / export": load_export,
         "estimate": estimate, "CP": context_parallel, "PP": pipeline, "sf.jit": jit}


def run_cell(family: str, feature: str) -> str | None:
    """None when the cell holds; else the error it met, in one line."""
    try:
        CELLS[feature](family)
    except Exception as e:  # noqa: BLE001 - the table records it
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    return None


# -- the page -------------------------------------------------------------------------------

BEGIN = "<!-- families table: begin (scripts/gen_hf_families_docs.py writes it) -->"
END = "<!-- families table: end -->"


def markdown() -> str:
    rows = ["| family | " + " | ".join(FEATURES) + " |", "|---" * (len(FEATURES) + 1) + "|"]
    for family in FAMILIES:
        rows.append(f"| {LABELS[family]} | " + " | ".join(TABLE[(family, f)] for f in FEATURES) + " |")
    return "\n".join(rows) + "\n"
