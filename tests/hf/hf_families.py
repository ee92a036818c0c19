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
- sf.jit: not tested here (tests/hf/test_hf_traced.py covers Llama, GPT-2, Qwen2).
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
FEATURES = ["remat training", "sharded init", "load / export", "estimate", "sf.jit"]
LABELS = {"llama": "Llama", "mistral": "Mistral (sliding window)", "gemma": "Gemma (tied)",
          "gpt_neox": "GPT-NeoX", "phi3": "Phi-3", "qwen3_moe": "Qwen3-MoE (eager experts)", "bert": "BERT (masked LM)",
          "t5": "T5", "vit": "ViT (image classification)"}

NOT_TESTED = "not tested"
TABLE: dict[tuple[str, str], str] = {
    **{(f, feature): "yes" for f in FAMILIES for feature in FEATURES[:4]},
    **{(f, "sf.jit"): NOT_TESTED for f in FAMILIES},
}
TABLE[("llama", "sf.jit")] = "yes, with and without remat (tests/hf/test_hf_traced.py)"
# The router picks each token's experts from activations (`nonzero` of its choice): no dry
# run can know how many tokens each expert gets, so sf.estimate names the op.
TABLE[("qwen3_moe", "estimate")] = "no: routing is data-dependent (sf.estimate raises its SpecError on `nonzero`)"
EXPECTED_ERRORS = {("qwen3_moe", "estimate"): "SpecError: sf.estimate: aten.nonzero.default cannot run in the dry run"}


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


CELLS = {"remat training": remat_training, "sharded init": sharded_init, "load / export": load_export,
         "estimate": estimate}


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
