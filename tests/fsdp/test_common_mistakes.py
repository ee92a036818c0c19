"""Common mistakes raise clear errors (key path, shape, what was expected, a Fix line), on
every rank; and uneven local batches are an explicit choice (`shard(batch_weighting=)`),
the "global_mean" one checked against one process on the concatenated batch."""

from __future__ import annotations

import math
import re

import optree
import pytest
import torch

import shardfn as sf

transformers = pytest.importorskip("transformers")

F64 = torch.float64


def _llama(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _ids(n, seed=0, t=8):
    return torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def _messages(mesh, body):
    """Each rank's error message (every rank must raise)."""
    def per_rank():
        try:
            body()
        except sf.ShardingError as e:
            return f"{type(e).__name__}: {e}"
        return None

    return mesh.run(per_rank)


# -- 1. another model's params ------------------------------------------------------------

OTHER_PARAMS = (r"SpecError: sf\.functional: apply_fn needs params\['model'\]\['embed_tokens'\]\['weight'\], but the "
                r"params it was given have no 'model' at params: there they have a dict with keys \['transformer'\]"
                r"(.|\n)*\nFix: pass the params that sf\.functional\(this model\) returned")


def test_another_models_params_name_the_missing_path():
    apply_fn, _ = sf.functional(_llama())
    _, gpt_params = sf.functional(_gpt2())
    with pytest.raises(sf.SpecError) as err:
        apply_fn(gpt_params, _ids(2))
    assert re.search(OTHER_PARAMS, f"SpecError: {err.value}")


def test_another_models_params_under_shard_raise_on_every_rank():
    apply_fn, _ = sf.functional(_llama())
    _, gpt_params = sf.functional(_gpt2())
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, b: apply_fn(p, b, labels=b).loss, mesh)
    msgs = _messages(mesh, lambda: step(step.shard_params(gpt_params), _ids(2)))
    assert len(msgs) == 2 and all(m is not None and re.search(OTHER_PARAMS, m) for m in msgs), msgs


def test_a_missing_leaf_deeper_down_names_its_level():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    apply_fn, params = sf.functional(net)
    del params[1]["bias"]
    with pytest.raises(sf.SpecError, match=r"needs params\[1\]\['bias'\], but the params it was given have no 'bias' "
                                           r"at params\[1\]: there they have a dict with keys \['weight'\]"):
        apply_fn(params, torch.ones(5, 3))


# -- 2. optimizer state of the full params, gradients of the shards -------------------------

OPTIMIZERS = {
    "adamw": lambda: sf.optim.adamw(1e-3),
    "adamw_inplace": lambda: sf.optim.adamw(1e-3, inplace=True),
    "adamw_fused": lambda: sf.optim.adamw(1e-3, fused=True),
    "adam_l2": lambda: sf.optim.adam(1e-3, weight_decay=0.1),
    "sgd_momentum": lambda: sf.optim.sgd(1e-2, momentum=0.9),
    "sgd_momentum_fused": lambda: sf.optim.sgd(1e-2, momentum=0.9, fused=True),
    "lion": lambda: sf.optim.lion(1e-4),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_of_the_full_params_is_refused_at_update(name):
    apply_fn, params = sf.functional(_llama())
    mesh = sf.local_mesh({"data": 4})
    step = sf.shard(lambda p, b: apply_fn(p, b, labels=b).loss, mesh)
    opt = OPTIMIZERS[name]()

    def body():
        shards = step.shard_params(params)
        state = opt.init(params)  # the mistake: the full params
        grads = torch.func.grad(step)(shards, _ids(2, mesh.rank))
        opt.update(grads, state, shards)

    msgs = _messages(mesh, body)
    assert all(m is not None for m in msgs), msgs
    for m in msgs:
        assert m.startswith("SpecError: ") and ".update: " in m
        assert "['lm_head']['weight']: shape (128, 64)" in m and ": (32, 64)" in m, m
        assert "it was made from the full parameters" in m or "one tree holds the full tensors" in m, m
        assert "\nFix: opt.init(shards) with the shards step.shard_params returned" in m


def test_state_shape_check_names_the_leaf_and_both_shapes():
    opt = sf.optim.adamw(1e-3)
    state = opt.init({"a": torch.zeros(3), "w": torch.zeros(8, 2)})
    with pytest.raises(sf.SpecError, match=r"scale_by_adam\.update: state\.mu does not have the shapes of the updates:\n"
                                           r"  - state\.mu\['w'\]: shape \(8, 2\), updates: \(2, 2\)\n"
                                           r"(.|\n)*\nFix: opt\.init\(shards\)"):
        opt.update({"a": torch.ones(3), "w": torch.ones(2, 2)}, state, {"a": torch.ones(3), "w": torch.ones(2, 2)})


def test_apply_updates_of_other_shapes_is_refused():
    with pytest.raises(sf.SpecError, match=r"apply_updates: updates does not have the shapes of the params:\n"
                                           r"  - updates\['w'\]: shape \(2, 2\), params: \(8, 2\)"):
        sf.optim.apply_updates({"w": torch.ones(8, 2)}, {"w": torch.ones(2, 2)})


# -- 3. sf.shard(model) ---------------------------------------------------------------------


def test_shard_of_a_module_is_refused_at_shard_time():
    mesh = sf.local_mesh({"data": 2})
    with pytest.raises(sf.SpecError, match=r"sf\.shard takes a loss function of explicit parameters, "
                                           r"loss_fn\(params, batch\) -> scalar, not an nn\.Module \(got a "
                                           r"LlamaForCausalLM\)(.|\n)*\nFix: apply_fn, params = "
                                           r"sf\.functional\(model\); loss_fn = lambda p, b: "):
        sf.shard(_llama(), mesh)


# -- 4. sf.functional(fn) --------------------------------------------------------------------


def test_functional_of_a_function_is_refused():
    def forward(params, x):
        return x @ params["w"]

    with pytest.raises(sf.SpecError, match=r"sf\.functional: expected a torch\.nn\.Module, got the function forward\."
                                           r"(.|\n)*\nFix: pass the model, apply_fn, params = sf\.functional\(model\); "
                                           r"a function that already takes the parameters explicitly"):
        sf.functional(forward)
    with pytest.raises(sf.SpecError, match=r"got the dict \{'w'"):
        sf.functional({"w": torch.ones(2)})


# -- 5. sf.scatter leaving a rank empty -------------------------------------------------------

EMPTY_BLOCKS = (r"SpecError: scatter: splitting a tensor of shape \(6, 3\) by P\('data'\) leaves some ranks empty "
                r"blocks while others hold rows:\n  - dim 0 \(size 6\) over 'data' \(size 4\): torch\.chunk blocks of "
                r"ceil\(6 / 4\) = 2 rows give the 4 ranks \[2, 2, 2, 0\] rows; the last 1 get none\n(.|\n)*"
                r"\nFix: dim 0: a size divisible by 4 \(pad to 8, or drop to 4\); or pass allow_empty=True")


def test_scatter_that_leaves_a_rank_empty_raises_on_every_rank():
    mesh = sf.local_mesh({"data": 4})
    x = torch.arange(18.0).reshape(6, 3)
    msgs = _messages(mesh, lambda: sf.scatter(x, mesh, sf.P("data")))
    assert all(m is not None and re.search(EMPTY_BLOCKS, m) for m in msgs), msgs
    shapes = mesh.run(lambda: tuple(sf.scatter(x, mesh, sf.P("data"), allow_empty=True).shape))
    assert shapes == [(2, 3), (2, 3), (2, 3), (0, 3)]  # the opt-in: torch.chunk's layout
    assert mesh.run(lambda: sf.scatter(torch.arange(7.0), mesh, sf.P("data")).tolist()) == [
        [0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0]]  # uneven but none empty: allowed


def test_scatter_over_two_axes_names_both():
    mesh = sf.local_mesh({"data": 2, "model": 2})
    with pytest.raises(sf.SpecError, match=r"dim 1 \(size 3\) over 'data' \(size 2\) x 'model' \(size 2\): torch\.chunk "
                                           r"blocks of ceil\(3 / 4\) = 1 rows give the 4 ranks \[1, 1, 1, 0\]"):
        mesh.run(lambda: sf.scatter(torch.ones(2, 3), mesh, sf.P(None, ("data", "model"))))


def test_shard_still_lays_out_small_leaves_with_empty_trailing_chunks():
    mesh = sf.local_mesh({"data": 4})
    step = sf.shard(lambda p, x: (x @ p["w"] + p["b"]).square().mean(), mesh)
    params = {"w": torch.ones(4, 3), "b": torch.ones(3)}

    def body():
        shards = step.shard_params(params)
        grads = torch.func.grad(step)(shards, torch.ones(2, 4))
        return tuple(shards["b"].shape), tuple(grads["b"].shape)

    assert mesh.run(body) == [((1,), (1,)), ((1,), (1,)), ((1,), (1,)), ((0,), (0,))]


# -- 6. uneven local batches --------------------------------------------------------------------

SIZES = [4, 3, 2, 1]  # rows per rank of a global batch of 10


def _mlp_params():
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(6, 8, generator=g, dtype=F64), "b1": torch.randn(8, generator=g, dtype=F64),
            "w2": torch.randn(8, 2, generator=g, dtype=F64)}


def _mlp_loss(p, batch):
    x, y = batch
    return (torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y).square().mean()


def _global_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(sum(SIZES), 6, generator=g, dtype=F64), torch.randn(sum(SIZES), 2, generator=g, dtype=F64)


def _local(batch, rank):
    start = sum(SIZES[:rank])
    return tuple(t[start:start + SIZES[rank]] for t in batch)


def test_unequal_batches_raise_on_every_rank_by_default():
    mesh = sf.local_mesh({"data": 4})
    step = sf.shard(_mlp_loss, mesh)
    batch = _global_batch()
    msgs = _messages(mesh, lambda: step(step.shard_params(_mlp_params()), _local(batch, mesh.rank)))
    for m in msgs:
        assert m is not None and m.startswith(
            "ShardingError: shard: the local batches differ in size across the data axes (rank 0: 4, rank 1: 3, "
            "rank 2: 2, rank 3: 1; a rank's batch size is the leading dim of its batch's tensor leaves"), msgs
        assert ("\nFix: give every rank the same number of examples (drop or pad the global batch to a multiple "
                "of 4;") in m
        assert "batch_weighting='global_mean'" in m and "batch_weighting='mean_of_means'" in m


def test_on_an_accelerator_the_check_is_read_at_the_next_step(monkeypatch):
    # [Note: the equal-size check does not stall an accelerator]: the device test is the
    # only thing patched; the collectives and the check are the real ones.
    from shardfn._fsdp import batch as batch_module

    monkeypatch.setattr(batch_module, "_defer", lambda device: True)
    mesh = sf.local_mesh({"data": 4})
    step = sf.shard(_mlp_loss, mesh)
    batch = _global_batch()

    def two_steps():
        shards = step.shard_params(_mlp_params())
        first = step(shards, _local(batch, mesh.rank))  # returns: its check is pending
        try:
            step(shards, _local(batch, mesh.rank))
        except sf.ShardingError as err:
            return float(first), str(err)
        return float(first), None

    for loss, msg in mesh.run(two_steps):
        assert math.isfinite(loss)
        assert msg is not None and msg.startswith("shard: the local batches differ in size across the data axes "
                                                  "(rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1;"), msg


def test_a_rank_with_an_empty_batch_is_unequal():
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(_mlp_loss, mesh)
    batch = _global_batch()
    msgs = _messages(mesh, lambda: step(step.shard_params(_mlp_params()),
                                        tuple(t[:3] if mesh.rank == 0 else t[:0] for t in batch)))
    assert all(m is not None and "(rank 0: 3, rank 1: 0;" in m for m in msgs), msgs


def test_equal_batches_cost_no_extra_collective():
    """The check rides on the loss all-reduce: one all-reduce of [loss, n, n*n, unknown] in
    float64 (32 bytes); mean_of_means keeps the loss alone (8 bytes: a float64 loss)."""
    params = _mlp_params()
    batch = _global_batch()
    for weighting, nbytes in [("equal", 32), ("global_mean", 32), ("mean_of_means", 8)]:
        mesh = sf.local_mesh({"data": 2})
        step = sf.shard(_mlp_loss, mesh, batch_weighting=weighting)

        def body():
            shards = step.shard_params(params)
            torch.func.grad(step)(shards, tuple(t[:4] for t in batch))
            return step.stats()

        for stats in mesh.run(body):
            assert stats["all_reduce_bytes"] == nbytes, (weighting, stats)
            assert stats["num_collectives"] == 1 + 1 + 1  # gather, reduce-scatter (one unit), the loss


def test_mean_of_means_is_the_old_unchecked_mean():
    mesh = sf.local_mesh({"data": 4})
    step = sf.shard(_mlp_loss, mesh, batch_weighting="mean_of_means")
    params, batch = _mlp_params(), _global_batch()
    losses = mesh.run(lambda: float(step(step.shard_params(params), _local(batch, mesh.rank))))
    want = sum(float(_mlp_loss(params, _local(batch, r))) for r in range(4)) / 4
    assert losses == [pytest.approx(want, rel=1e-14)] * 4


@pytest.mark.parametrize("how", ["func_grad", "grad_and_value", "backward"])
def test_global_mean_matches_one_process_on_the_concatenated_batch(how):
    params, batch = _mlp_params(), _global_batch()
    ref_grads, ref_loss = torch.func.grad_and_value(_mlp_loss)(params, batch)
    mesh = sf.local_mesh({"data": 4})
    step = sf.shard(_mlp_loss, mesh, batch_weighting="global_mean")

    def body():
        shards = step.shard_params(params)
        local = _local(batch, mesh.rank)
        if how == "func_grad":
            grads, loss = torch.func.grad_and_value(step)(shards, local)
        elif how == "grad_and_value":
            grads, loss = step.grad_and_value(shards, local)
        else:
            for t in shards.values():
                t.requires_grad_(True)
            loss = step(shards, local)
            loss.backward()
            grads = {k: t.grad for k, t in shards.items()}
        want = step.shard_params(ref_grads)
        return float(loss), max(float((grads[k] - want[k]).abs().max()) for k in want if want[k].numel())

    for loss, err in mesh.run(body):
        assert loss == pytest.approx(float(ref_loss), rel=1e-13, abs=1e-15)
        assert err <= 1e-12


def test_global_mean_jvp_is_the_weighted_tangent():
    params, batch = _mlp_params(), _global_batch()
    tangent = {k: torch.ones_like(v) for k, v in params.items()}
    _, ref = torch.func.jvp(lambda p: _mlp_loss(p, batch), (params,), (tangent,))
    mesh = sf.local_mesh({"data": 4})
    step = sf.shard(_mlp_loss, mesh, batch_weighting="global_mean")

    def body():
        shards = step.shard_params(params)
        _, t = torch.func.jvp(lambda s: step(s, _local(batch, mesh.rank)), (shards,), (step.shard_params(tangent),))
        return float(t)

    assert mesh.run(body) == [pytest.approx(float(ref), rel=1e-12)] * 4


def test_global_mean_with_equal_batches_is_the_default():
    """Equal sizes: the same gradients bit for bit (the same 1/N); the loss, summed as
    n * loss / sum(n), agrees to its last bits."""
    params, batch = _mlp_params(), _global_batch()
    out = {}
    for weighting in ("equal", "global_mean"):
        mesh = sf.local_mesh({"data": 2})
        step = sf.shard(_mlp_loss, mesh, batch_weighting=weighting)
        out[weighting] = mesh.run(lambda: torch.func.grad_and_value(step)(
            step.shard_params(params), tuple(t[5 * mesh.rank: 5 * mesh.rank + 5] for t in batch)))
    for (ga, la), (gb, lb) in zip(out["equal"], out["global_mean"]):
        assert float(la) == pytest.approx(float(lb), rel=1e-15)
        assert all(torch.equal(ga[k], gb[k]) for k in ga)


def test_global_mean_llama_matches_one_process():
    """A transformers Llama in float64 (the next-token loss computed here in float64:
    transformers' own `labels=` loss upcasts the logits to float32)."""
    model = _llama(F64)
    apply_fn, params = sf.functional(model)
    ids = _ids(sum(SIZES), seed=3)

    def loss_fn(p, b):
        logits = apply_fn(p, b).logits[:, :-1]  # (B, T - 1, V)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

    ref_grads, ref_loss = torch.func.grad_and_value(lambda p: loss_fn(p, ids))(params)
    mesh = sf.local_mesh({"data": 4})
    step = sf.shard(loss_fn, mesh, batch_weighting="global_mean")

    def body():
        start = sum(SIZES[:mesh.rank])
        grads, loss = step.grad_and_value(step.shard_params(params), ids[start:start + SIZES[mesh.rank]])
        want = step.shard_params(ref_grads)
        errs = [float((a - b).abs().max()) for a, b in zip(optree.tree_leaves(grads), optree.tree_leaves(want))
                if a.numel()]
        return float(loss), max(errs)

    for loss, err in mesh.run(body):
        assert loss == pytest.approx(float(ref_loss), rel=1e-12)
        assert err <= 1e-10


def test_unknown_batch_sizes_are_not_checked_but_cannot_be_weighted():
    """Leaves that disagree on the leading dim: no batch size. 'equal' checks nothing then;
    'global_mean' cannot weigh and says so on every rank."""
    params = _mlp_params()

    def loss_fn(p, batch):
        x, scale = batch  # scale: (2,), not a batch dim
        return (torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] * scale).square().mean()

    for weighting in ("equal", "global_mean"):
        mesh = sf.local_mesh({"data": 2})
        step = sf.shard(loss_fn, mesh, batch_weighting=weighting)
        run = lambda: step(step.shard_params(params), (torch.ones(3 + mesh.rank, 6, dtype=F64),  # noqa: E731
                                                       torch.ones(2, dtype=F64)))
        if weighting == "equal":
            assert len(mesh.run(run)) == 2
        else:
            msgs = _messages(mesh, run)
            assert all(m is not None and m.startswith(
                "ShardingError: shard(batch_weighting='global_mean'): no rank knows its batch size "
                "(rank 0: unknown, rank 1: unknown;") for m in msgs), msgs
            assert all("\nFix: give the batch tensor leaves one leading (batch) dim" in m for m in msgs)


def test_batch_weighting_is_checked():
    mesh = sf.local_mesh({"data": 2})
    with pytest.raises(sf.SpecError, match=r"shard: batch_weighting must be one of \('equal', 'mean_of_means', "
                                           r"'global_mean'\), got 'weighted'"):
        sf.shard(_mlp_loss, mesh, batch_weighting="weighted")
