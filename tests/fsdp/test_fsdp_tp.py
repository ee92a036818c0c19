"""FSDP x TP: `shard(..., param_specs=...)` with tensor-parallel collectives inside loss_fn.

Every case is checked against single-device training on the global batch (float64, so
the differences are rounding only): a Megatron MLP stack whose column-parallel weights
are split over 'model', row-parallel ones psummed over 'model', and a LayerNorm-like
scale replicated over it.
"""

import optree
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import shardfn as sf
import shardfn.checkpoint as ckpt
from shardfn.testing import reference_training, run_on_mesh
from collective_cases import mesh_for as mesh_of  # one simulated mesh per shape, per session
from traffic import sent, stats_view, totals

P = sf.P
F64 = torch.float64
LAYER_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": None, "scale": None}


def init(seed: int, d: int = 6, h: int = 8, layers: int = 2, d_out: int = 3, dtype=F64):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    return {
        "layers": [{"w1": r(d, h, s=d ** -0.5), "b1": r(h, s=0.1), "w2": r(h, d, s=h ** -0.5), "b2": r(d, s=0.1),
                    "scale": 1 + r(d, s=0.1)} for _ in range(layers)],
        "head": r(d, d_out),
    }


def specs_for(params):
    return {"layers": [LAYER_SPECS] * len(params["layers"]), "head": None}


def loss_fn(params, batch, reduce=lambda t: t):
    x, y = batch
    for layer in params["layers"]:
        h = torch.tanh((x * layer["scale"]) @ layer["w1"] + layer["b1"])  # column-parallel: (B, H / model)
        x = x + reduce(h @ layer["w2"]) + layer["b2"]  # row-parallel: partial sums -> psum over 'model'
    return ((x @ params["head"] - y) ** 2).mean()


def tp_loss(params, batch):
    return loss_fn(params, batch, lambda t: sf.psum(t, "model"))


def data_batch(mesh, batch):
    """This rank's batch: its chunk over the data axes; the same on every 'model' rank."""
    group = mesh.group(tuple(a for a in mesh.axis_names if a != "model"))
    d, index = group.size, group.index
    return optree.tree_map(lambda t: t.chunk(d)[index] if index < len(t.chunk(d)) else t[:0], batch)


def batch_of(seed: int, n: int = 8, d: int = 6, d_out: int = 3, dtype=F64):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(n, d, generator=g).to(dtype), torch.randn(n, d_out, generator=g).to(dtype)


def reference_grads(params, batch):
    return torch.func.grad_and_value(loss_fn)(params, batch)


def assert_close(got, want, atol=1e-11, what="grads"):
    paths, got_leaves, _ = sf._tree.flatten_with_paths(got)
    for path, a, b in zip(paths, got_leaves, optree.tree_leaves(want)):
        assert a.shape == b.shape, f"{what}{sf._tree.keystr(path)}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        assert diff <= atol * max(1.0, b.double().abs().max().item() if b.numel() else 0.0), (
            f"{what}{sf._tree.keystr(path)} differs by {diff:.3g}")


def tp_grads(mesh, params, batch, mode="func", **kwargs):
    """On every rank: the full (unsharded, un-TP'd) gradient and loss of one step."""
    kwargs.setdefault("data_axes", tuple(a for a in mesh.axis_names if a != "model"))
    step = sf.shard(tp_loss, mesh, param_specs=specs_for(params), **kwargs)

    def body(*_):
        shards = step.shard_params(params)
        local = data_batch(mesh, batch)
        with sent() as rec:
            loss, grads = _one_step(step, shards, local, mode)
        return float(loss), step.unshard_params(grads), (rec.records, step.stats())

    return mesh.run(body)


def _one_step(step, shards, local, mode):
    if mode == "func":
        grads, loss = torch.func.grad_and_value(step)(shards, local)
    elif mode == "fast":
        grads, loss = step.grad_and_value(shards, local)
    else:  # loss.backward() on leaf shards
        shards = optree.tree_map(lambda t: t.requires_grad_(True), shards)
        loss = step(shards, local)
        loss.backward()
        grads = optree.tree_map(lambda t: t.grad, shards)
    return loss, grads


# -- gradients equal single-device ones --------------------------------------------------


@pytest.mark.parametrize("shape", [{"data": 2, "model": 2}, {"model": 2, "data": 2}, {"data": 1, "model": 4},
                                   {"data": 4, "model": 1}], ids=lambda s: "x".join(f"{a}{n}" for a, n in s.items()))
@pytest.mark.parametrize("mode", ["func", "fast", "backward"])
def test_grads_match_single_device(shape, mode):
    params, batch = init(0), batch_of(0)
    want, want_loss = reference_grads(params, batch)
    for loss, grads, _ in tp_grads(mesh_of(shape), params, batch, mode):
        assert abs(loss - float(want_loss)) < 1e-12
        assert_close(grads, want)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.sampled_from([(1, 2), (2, 2), (1, 3), (3, 1), (1, 4), (2, 1)]),
    d=st.integers(1, 5), mult=st.integers(1, 2), layers=st.integers(1, 2), batch=st.integers(1, 7),
    reshard=st.booleans(), prefetch=st.integers(0, 2), seed=st.integers(0, 2 ** 16),
)
def test_grads_match_single_device_property(shape, d, mult, layers, batch, reshard, prefetch, seed):
    """Uneven FSDP chunks (d, batch rows) and tensor-parallel splits of hidden = mult * model * data."""
    data, model = shape
    params = init(seed, d=d, h=mult * data * model, layers=layers)
    xy = batch_of(seed, n=batch, d=d)
    assume(len(xy[0].chunk(data)) == data)  # torch.chunk made fewer chunks: empty batches would give NaN losses
    # The DDP loss semantics: the mean over data ranks of each one's chunk loss.
    want, want_loss = torch.func.grad_and_value(
        lambda p: sum(loss_fn(p, (x, y)) for x, y in zip(xy[0].chunk(data), xy[1].chunk(data))) / data)(params)
    mesh = mesh_of({"data": data, "model": model})
    for loss, grads, _ in tp_grads(mesh, params, xy, reshard_after_forward=reshard, prefetch=prefetch,
                                   batch_weighting="mean_of_means"):  # uneven chunks, DDP's mean of means
        assert abs(loss - float(want_loss)) < 1e-11 * max(1.0, abs(float(want_loss)))
        assert_close(grads, want)


def test_hsdp_times_tp_matches_single_device():
    """{'replica': 2, 'shard': 2, 'model': 2}: sharded over 'shard', replicated over 'replica'."""
    params, batch = init(1, h=8), batch_of(1)
    want, want_loss = reference_grads(params, batch)
    mesh = mesh_of({"replica": 2, "shard": 2, "model": 2})
    results = tp_grads(mesh, params, batch, data_axes=("replica", "shard"), shard_axes="shard")
    for loss, grads, _ in results:
        assert abs(loss - float(want_loss)) < 1e-12
        assert_close(grads, want)


def test_specs_combine_tensor_parallel_and_fsdp_axes():
    params = init(0)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=specs_for(params))
    shapes = mesh.run(lambda: optree.tree_map(lambda t: tuple(t.shape), step.shard_params(params)))
    assert step.specs["layers"][0] == {"w1": P("data", "model"), "b1": P(("model", "data")),
                                       "w2": P(("model", "data"), None), "b2": P("data"), "scale": P("data")}
    assert step.specs["head"] == P("data")
    # w1 (6, 8): TP block (6, 4), FSDP chunk (3, 4); w2 (8, 6): TP block (4, 6), chunk (2, 6).
    assert shapes[3]["layers"][0]["w1"] == (3, 4) and shapes[3]["layers"][0]["w2"] == (2, 6)
    assert shapes[3]["layers"][0]["b1"] == (2,) and shapes[3]["head"] == (3, 3)


def test_param_specs_as_a_function_of_the_key_path():
    params, batch = init(2), batch_of(2)
    want, _ = reference_grads(params, batch)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=lambda path: LAYER_SPECS[path[-1]] if path[0] == "layers" else None)
    grads = mesh.run(lambda: step.unshard_params(torch.func.grad(step)(step.shard_params(params),
                                                                       data_batch(mesh, batch))))
    assert_close(grads[0], want)


def test_stats_count_the_tensor_parallel_psum_of_replicated_leaves():
    """Leaves replicated over 'model' (b2, scale, head) get one extra all-reduce of their
    reduce-scattered range over 'model'; the split ones (w1, b1, w2) do not."""
    params, batch = init(0, d=6, h=8), batch_of(0)
    mesh = mesh_of({"data": 2, "model": 2})
    (_, _, (records, stats)), *_ = tp_grads(mesh, params, batch, reshard_after_forward=True)
    # What the backend sent, in float64 elements. Gathered per data rank, in TP-local rows:
    # w1 (6, 4) b1 (4,) w2 (4, 6) b2 (6,) scale (6,) = 64 elements a layer, gathered twice
    # (forward, backward); the root (head, 6 x 3) once.
    sent_ = [(c.op, c.axes, c.nbytes // 8) for c in records]
    assert {c.dtype for c in records} == {F64}
    assert sorted(n for op, _, n in sent_ if op == "all_gather") == [18] + [64] * 4
    assert sorted(n for op, _, n in sent_ if op == "reduce_scatter") == [18, 64, 64]
    assert {axes for op, axes, _ in sent_ if op != "all_reduce"} == {("data",)}
    over_model = sorted(n for op, axes, n in sent_ if op == "all_reduce" and axes == ("model",))
    activations = [24] * 4  # loss_fn's own psum of (4, 6) per layer, and its transpose (a psum)
    psummed = [3 + 3] * 2 + [9]  # this rank's chunks of b2 and scale per layer, and of head (3, 3)
    check = [4]  # the first call's loss replication check: 2 fingerprints and their negations
    assert over_model == sorted(activations + psummed + check)
    assert [n for op, axes, n in sent_ if op == "all_reduce" and axes == ("data",)] == [4]  # [loss, n, n*n, unknown]
    # stats() counts shard's own collectives: all of the above but loss_fn's psums.
    wire = totals(records)
    wire["all_reduce_bytes"] -= 8 * sum(activations)
    wire["num_collectives"] -= len(activations)
    assert stats_view(stats) == wire


# -- training, accumulation, policies, forward mode ---------------------------------------


def test_adamw_with_global_norm_clipping_matches_single_process_training():
    """5 steps of sf.optim (clip + adamw) on {'data': 2, 'model': 2} == one process on the
    global batch; the clipping norm counts every block once (specs from step.specs)."""
    params = init(3, h=8)
    batches = [batch_of(10 + t) for t in range(5)]

    def optimizer(mesh=None, specs=None):
        clip = sf.optim.clip_by_global_norm(0.5, mesh=mesh, specs=specs) if mesh else sf.optim.clip_by_global_norm(0.5)
        return sf.optim.chain(clip, sf.optim.adamw(1e-2, weight_decay=0.1))

    ref_losses, ref_params = reference_training(loss_fn, params, batches, 2, optimizer=optimizer())
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=specs_for(params))

    def train():
        shards = step.shard_params(params)
        opt = optimizer(mesh, step.specs)
        state = opt.init(shards)
        update = sf.train_step(step, opt)
        losses, history = [], []
        for batch in batches:
            shards, state, loss = update(shards, state, data_batch(mesh, batch))
            losses.append(float(loss))
            history.append(step.unshard_params(shards))
        return losses, history

    for losses, history in mesh.run(train):
        assert losses == pytest.approx(ref_losses, abs=1e-12)
        for got, want in zip(history, ref_params):
            assert_close(got, want, what="params")


@pytest.mark.parametrize("mode", ["reduce_each", "reduce_once"])
def test_accumulate_equals_the_big_batch(mode):
    params, batch = init(4, h=8), batch_of(4, n=16)
    want, want_loss = reference_grads(params, batch)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=specs_for(params))

    def body():
        x, y = data_batch(mesh, batch)
        grads, loss = step.accumulate(step.shard_params(params), list(zip(x.chunk(2), y.chunk(2))), mode=mode)
        return float(loss), step.unshard_params(grads)

    for loss, grads in mesh.run(body):
        assert abs(loss - float(want_loss)) < 1e-12
        assert_close(grads, want)


def test_bf16_compute_fp32_reduce_is_close_and_halves_gather_bytes():
    params, batch = init(5, h=8, dtype=torch.float32), batch_of(5, dtype=torch.float32)
    want, _ = reference_grads(params, batch)
    mesh = mesh_of({"data": 2, "model": 2})
    mp = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    (_, g32, (r32, _)), *_ = tp_grads(mesh, params, batch)
    (_, g16, (r16, _)), *_ = tp_grads(mesh, params, batch, mixed_precision=mp)
    assert totals(r16)["all_gather_bytes"] * 2 == totals(r32)["all_gather_bytes"]  # as sent
    assert {c.dtype for c in r16 if c.op == "all_gather"} == {torch.bfloat16}
    assert {c.dtype for c in r16 if c.op == "reduce_scatter"} == {torch.float32}
    assert_close(g32, want, atol=1e-5)
    assert_close(g16, want, atol=5e-2)
    assert all(g.dtype == torch.float32 for g in optree.tree_leaves(g16))


def test_vmap_per_example_grads_equal_a_loop():
    params, batch = init(6, h=8), batch_of(6, n=4)
    mesh = mesh_of({"data": 1, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=specs_for(params))

    def body():
        shards = step.shard_params(params)
        x, y = batch
        per_example = torch.func.vmap(torch.func.grad(step), in_dims=(None, 0))(shards, (x[:, None], y[:, None]))
        loop = [torch.func.grad(step)(shards, (x[i:i + 1], y[i:i + 1])) for i in range(len(x))]
        stacked = optree.tree_map(lambda *g: torch.stack(g), *loop)
        return per_example, stacked

    for per_example, stacked in mesh.run(body):
        assert_close(per_example, stacked, atol=1e-13)


def test_jvp_equals_finite_differences():
    params, batch = init(7, h=8), batch_of(7)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=specs_for(params))
    direction = optree.tree_map(lambda t: torch.randn(t.shape, generator=torch.Generator().manual_seed(1), dtype=F64),
                                params)
    eps = 1e-6
    plus = loss_fn(optree.tree_map(lambda p, v: p + eps * v, params, direction), batch)
    minus = loss_fn(optree.tree_map(lambda p, v: p - eps * v, params, direction), batch)
    fd = float((plus - minus) / (2 * eps))

    def body():
        shards, tangent = step.shard_params(params), step.shard_params(direction)
        _, t = torch.func.jvp(lambda s: step(s, data_batch(mesh, batch)), (shards,), (tangent,))
        return float(t)

    for t in mesh.run(body):
        assert t == pytest.approx(fd, rel=1e-6)


# -- checkpoints: FSDP x TP <-> plain FSDP ----------------------------------------------


def test_checkpoint_from_fsdp_tp_loads_on_plain_fsdp_and_back(tmp_path):
    params = init(8, h=8)
    zeros = optree.tree_map(torch.zeros_like, params)
    tp = mesh_of({"data": 2, "model": 2})
    flat = mesh_of({"data": 3})
    tp_step = sf.shard(tp_loss, tp, param_specs=specs_for(params))
    flat_step = sf.shard(loss_fn, flat)
    tp.run(lambda: ckpt.save(str(tmp_path / "tp"), tp_step.shard_params(params), tp, tp_step.specs))

    def to_flat():
        loaded = ckpt.load(str(tmp_path / "tp"), flat_step.shard_params(zeros), flat, flat_step.specs)
        ckpt.save(str(tmp_path / "flat"), loaded, flat, flat_step.specs)
        return flat_step.unshard_params(loaded)

    for full in flat.run(to_flat):
        assert_close(full, params, atol=0.0, what="params")

    def to_tp():
        loaded = ckpt.load(str(tmp_path / "flat"), tp_step.shard_params(zeros), tp, tp_step.specs)
        return tp_step.unshard_params(loaded)

    for full in tp.run(to_tp):
        assert_close(full, params, atol=0.0, what="params")


# -- errors ---------------------------------------------------------------------------


def _error(fn, mesh):
    with pytest.raises(sf.SpecError if fn.__name__.startswith("spec") else sf.ShardingError) as e:
        mesh.run(fn)
    return str(e.value)


def test_error_param_specs_naming_a_data_axis():
    params = init(0)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs={"layers": [LAYER_SPECS, {**LAYER_SPECS, "w1": P("data", "model")}],
                                                "head": None})
    with pytest.raises(sf.SpecError) as e:
        mesh.run(lambda: step.shard_params(params))
    msg = str(e.value)
    assert "params['layers'][1]['w1']" in msg and "names data axes ['data']" in msg and "Fix: drop" in msg


def test_error_dim0_split_twice_unevenly():
    params = init(0, h=6)  # 6 rows over model 2, then data 2: blocks (2, 1 | 2, 1) are not torch.chunk of 6 by 4
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=specs_for(params))
    with pytest.raises(sf.SpecError) as e:
        mesh.run(lambda: step.shard_params(params))
    msg = str(e.value)
    assert "params['layers'][0]['b1'] (shape (6,))" in msg and "split 2 ways over ('model',)" in msg
    assert "make dim 0 a multiple of 4" in msg


def test_error_param_specs_not_a_prefix():
    params = init(0)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs={"layers": LAYER_SPECS, "head": None})
    with pytest.raises(sf.SpecError) as e:
        mesh.run(lambda: step.shard_params(params))
    assert "param_specs['layers']" in str(e.value) and "list of length 2" in str(e.value)


def test_error_param_specs_unknown_axis_and_bad_type():
    params = init(0)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=lambda path: P("tensor") if path[-1] == "w2" else None)
    with pytest.raises(sf.SpecError) as e:
        mesh.run(lambda: step.shard_params(params))
    assert "params['layers'][0]['w2']" in str(e.value) and "'tensor', which is not a mesh axis" in str(e.value)
    with pytest.raises(sf.SpecError, match="param_specs must be a tree of sf.P"):
        sf.shard(tp_loss, mesh, param_specs="model")


def test_error_loss_differs_across_the_model_axis():
    """Different batches on the two 'model' ranks: a silent wrong gradient unless caught."""
    params, batch = init(0), batch_of(0)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=specs_for(params))

    def body():
        x, y = batch
        local = (x[mesh.rank::4], y[mesh.rank::4])  # a batch per rank, not per data rank
        return step(step.shard_params(params), local)

    with pytest.raises(sf.ShardingError) as e:
        mesh.run(body)
    msg = str(e.value)
    assert "the loss differs across mesh axes ('model',)" in msg and "the tensor-parallel axes of param_specs" in msg
    assert "same batch" in msg and "data_axes" in msg


# -- real processes -------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.ci
def test_fsdp_tp_on_processes_matches_single_device():
    """4 gloo processes, {'data': 2, 'model': 2}: gradients and 3 SGD steps equal one process."""
    params = init(9, h=8)
    batches = [batch_of(20 + t) for t in range(3)]
    ref_losses, ref_params = reference_training(loss_fn, params, batches, 2, lr=0.1)

    def body(mesh):
        step = sf.shard(tp_loss, mesh, param_specs=specs_for(params))
        shards = step.shard_params(params)
        losses = []
        for batch in batches:
            grads, loss = step.grad_and_value(shards, data_batch(mesh, batch))
            shards = optree.tree_map(lambda p, g: p - 0.1 * g, shards, grads)
            losses.append(float(loss))
        return losses, step.unshard_params(shards)

    for losses, full in run_on_mesh(body, {"data": 2, "model": 2}, "distributed"):
        assert losses == pytest.approx(ref_losses, abs=1e-12)
        assert_close(full, ref_params[-1], what="params")


def test_error_collective_over_an_axis_param_specs_does_not_name():
    """Without param_specs, 'model' is not a tensor-parallel axis: a psum over it inside
    loss_fn would give gradients scaled by its size, so it is refused."""
    params, batch = init(0), batch_of(0)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh)
    with pytest.raises(sf.ShardingError) as e:
        mesh.run(lambda: step(step.shard_params(params), data_batch(mesh, batch)))
    msg = str(e.value)
    assert "psum over ['model'] inside loss_fn" in msg and "param_specs names: []" in msg
    assert "Fix: pass param_specs that split some parameters over ['model']" in msg


def test_axes_not_named_anywhere_are_left_alone():
    """An axis that is neither a data axis nor named by param_specs is the caller's: each
    of its ranks trains on its own batch, with no reduction over it (per_example_grads.py)."""
    params = init(0)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(loss_fn, mesh)

    def body():
        g = torch.Generator().manual_seed(mesh.coords["model"])  # a different batch per 'model' rank
        x, y = torch.randn(8, 6, generator=g, dtype=F64), torch.randn(8, 3, generator=g, dtype=F64)
        grads = torch.func.grad(step)(step.shard_params(params), data_batch(mesh, (x, y)))
        return step.unshard_params(grads), reference_grads(params, (x, y))[0]

    for got, want in mesh.run(body):
        assert_close(got, want)


def test_frozen_and_replicated_leaves_with_tensor_parallel_specs():
    """frozen= leaves keep their TP split and get zero gradients; replicated= leaves (kept
    whole by shard) keep theirs and get the exact gradient."""
    params, batch = init(11, h=8), batch_of(11)
    want, _ = reference_grads(params, batch)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=specs_for(params), frozen=lambda path: path[-1] == "w1",
                    replicated=lambda path: path[-1] in ("b1", "scale"))

    def body():
        grads = torch.func.grad(step)(step.shard_params(params), data_batch(mesh, batch))
        return step.unshard_params(grads)

    for grads in mesh.run(body):
        for layer, ref in zip(grads["layers"], want["layers"]):
            assert torch.equal(layer["w1"], torch.zeros_like(ref["w1"]))
            ref["w1"] = layer["w1"]
        assert_close(grads, want)


def test_check_finite_stops_every_rank_of_both_axes():
    params, (x, y) = init(12, h=8), batch_of(12)
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(tp_loss, mesh, param_specs=specs_for(params), check_finite=True)

    def body():
        bx, by = data_batch(mesh, (x, y))
        if mesh.coords["data"] == 1:
            bx = bx.clone()
            bx[0, 0] = float("nan")  # data rank 1's batch, seen by both of its 'model' ranks
        return step.grad_and_value(step.shard_params(params), (bx, by))

    with pytest.raises(sf.NonFiniteError) as e:
        mesh.run(body)
    assert "the loss is NaN or infinite on ranks [2, 3]" in str(e.value)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("shape", [{"replica": 2, "shard": 2, "model": 2}, {"model": 2, "replica": 2, "shard": 2}],
                         ids=["model-last", "model-first"])
def test_hsdp_times_tp_on_8_processes_matches_single_device(shape):
    """3-D meshes on real process groups (both axis orders): the eager fast path (deferred
    reduce-scatters, then replica and 'model' all-reduces) and torch.func agree with one device."""
    params, batch = init(1, h=8), batch_of(1)
    want, want_loss = reference_grads(params, batch)

    def body(mesh):
        step = sf.shard(tp_loss, mesh, data_axes=("replica", "shard"), shard_axes="shard",
                        param_specs=specs_for(params))
        shards = step.shard_params(params)
        fast, loss = step.grad_and_value(shards, data_batch(mesh, batch))
        func = torch.func.grad(step)(shards, data_batch(mesh, batch))
        return float(loss), step.unshard_params(fast), step.unshard_params(func)

    results = run_on_mesh(body, shape, "distributed", timeout=60.0)
    assert len(results) == 8
    for loss, fast, func in results:
        assert abs(loss - float(want_loss)) < 1e-12
        assert_close(fast, want)
        assert_close(func, want)


def test_sequence_parallel_blocks_match_single_device():
    """Megatron sequence parallelism inside shard: each 'model' rank holds a sequence chunk
    of the activations (so its batch differs), LayerNorm runs on the chunk, all_gather over
    'model' before the column-parallel matmul and psum_scatter after the row-parallel one;
    the loss is psummed over 'model', and the gradient is the single-device one."""
    B, T, D, H = 4, 8, 6, 16
    g = torch.Generator().manual_seed(13)
    params = {"layers": [{"ln": 1 + 0.1 * torch.randn(D, generator=g, dtype=F64),
                          "w1": torch.randn(D, H, generator=g, dtype=F64) / D ** 0.5,
                          "w2": torch.randn(H, D, generator=g, dtype=F64) / H ** 0.5} for _ in range(2)]}
    specs = {"layers": [{"ln": None, "w1": P(None, "model"), "w2": P("model", None)}] * 2}
    x, y = torch.randn(B, T, D, generator=g, dtype=F64), torch.randn(B, T, D, generator=g, dtype=F64)

    def block(p, x, gather=lambda t: t, scatter=lambda t: t):
        h = gather(torch.nn.functional.layer_norm(x, (D,), p["ln"]))  # (B, T / model, D) -> (B, T, D)
        return x + scatter(torch.nn.functional.gelu(h @ p["w1"]) @ p["w2"])  # partial (B, T, D) -> (B, T / model, D)

    def single(params, batch):
        x, y = batch
        for p in params["layers"]:
            x = block(p, x)
        return ((x - y) ** 2).mean()

    def sequence_parallel(params, batch):
        x, y = batch
        for p in params["layers"]:
            x = block(p, x, lambda t: sf.all_gather(t, "model", dim=1), lambda t: sf.psum_scatter(t, "model", dim=1))
        return sf.psum(((x - y) ** 2).sum() / (x.shape[0] * T * D), "model")

    want, want_loss = torch.func.grad_and_value(single)(params, (x, y))
    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(sequence_parallel, mesh, param_specs=specs)

    def body():
        d, m = mesh.coords["data"], mesh.coords["model"]
        local = x.chunk(2)[d].chunk(2, dim=1)[m], y.chunk(2)[d].chunk(2, dim=1)[m]  # rows by 'data', tokens by 'model'
        grads, loss = step.grad_and_value(step.shard_params(params), local)
        return float(loss), step.unshard_params(grads)

    for loss, grads in mesh.run(body):
        assert abs(loss - float(want_loss)) < 1e-12
        assert_close(grads, want)
