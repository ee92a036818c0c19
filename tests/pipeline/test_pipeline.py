"""sf.pipeline against the same model on one device (fp64), for every schedule; the
schedules' bubbles against theory; activation memory, traffic, checkpoints and errors."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn._backend import ops
from shardfn.testing import run_on_mesh


D, IN, OUT = 6, 4, 2
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def layer_fn(w, x):  # (b, D) -> (b, D)
    return torch.tanh(x @ w["w"] + w["b"])


def pre(w, mb):  # (b, IN) -> (b, D)
    return mb[0] @ w["e"]


def post(w, x, mb):  # the head and the loss of one microbatch
    return ((x @ w["h"] - mb[1]) ** 2).mean()


def make_params(n_layers: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    layers = [{"w": torch.randn(D, D, generator=g, dtype=dtype) / D ** 0.5,
               "b": torch.randn(D, generator=g, dtype=dtype) / 4} for _ in range(n_layers)]
    return {"pre": {"e": torch.randn(IN, D, generator=g, dtype=dtype)},
            "post": {"h": torch.randn(D, OUT, generator=g, dtype=dtype)}}, layers


def make_batch(n: int, seed: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN, generator=g, dtype=dtype), torch.randn(n, OUT, generator=g, dtype=dtype)


def reference_loss(params, batch):
    h = pre(params["pre"], batch)
    for layer in params["layers"]:
        h = layer_fn(layer, h)
    return post(params["post"], h, batch)


def max_error(a, b) -> float:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(la) == len(lb)
    return max((x - y).abs().max().item() for x, y in zip(la, lb))


def check_against_one_device(schedule: str, V: int, p: int, M: int, how: str = "func") -> float:
    n_layers = 2 * p * V
    shared, layers = make_params(n_layers)
    batch = make_batch(2 * M)
    want_grads, want_loss = torch.func.grad_and_value(reference_loss)(dict(shared, layers=layers), batch)
    want = dict(want_grads, layers=sf.pipeline.stack_layers(want_grads["layers"], V))
    mesh = sf.local_mesh({"stage": p})
    pipe = sf.pipeline(layer_fn, pre=pre, post=post, microbatches=M, schedule=schedule, virtual_stages=V, mesh=mesh)
    params = dict(shared, layers=sf.pipeline.stack_layers(layers, V))
    specs = pipe.specs(params)

    def body():
        local = pipe.scatter_params(params)
        if how == "func":
            grads, loss = torch.func.grad_and_value(pipe)(local, batch)
        else:
            leaves = torch.utils._pytree.tree_map(lambda t: t.detach().requires_grad_(), local)
            loss = pipe(leaves, batch)
            loss.backward()
            loss = loss.detach()
            grads = torch.utils._pytree.tree_map(lambda t: t.grad, leaves)
        full = dict(grads, layers={k: sf.gather(v, mesh, specs["layers"][k]) for k, v in grads["layers"].items()})
        return float(loss), full

    errors = []
    for loss, grads in mesh.run(body):
        errors += [abs(loss - float(want_loss)), max_error(grads, want)]
    return max(errors)


@pytest.mark.parametrize("schedule,V", SCHEDULES)
@pytest.mark.parametrize("p,M", [(2, 1), (2, 3), (3, 5), (4, 3), (4, 8)])
def test_gradients_equal_one_device(schedule, V, p, M):
    assert check_against_one_device(schedule, V, p, M) <= 1e-10


@pytest.mark.parametrize("schedule,V", [("1f1b", 1), ("zb-h1", 1)])
def test_loss_backward_equals_one_device(schedule, V):
    assert check_against_one_device(schedule, V, 2, 4, how="backward") <= 1e-10


def test_property_every_schedule_stage_count_and_microbatch_count():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=6, deadline=None, derandomize=True)
    @hypothesis.given(st.sampled_from(SCHEDULES), st.integers(2, 4), st.integers(1, 8))
    def prop(schedule, p, M):
        assert check_against_one_device(schedule[0], schedule[1], p, M) <= 1e-10

    prop()


def test_eval_call_without_grad_gives_the_loss_only():
    shared, layers = make_params(4)
    batch = make_batch(6)
    mesh = sf.local_mesh({"stage": 2})
    pipe = sf.pipeline(layer_fn, pre=pre, post=post, microbatches=3, mesh=mesh)
    params = dict(shared, layers=sf.pipeline.stack_layers(layers))
    want = float(reference_loss(dict(shared, layers=layers), batch))
    losses = mesh.run(lambda: float(pipe(pipe.scatter_params(params), batch)))
    assert all(abs(x - want) <= 1e-12 for x in losses)
    assert mesh.run(lambda: pipe.trace()) == [[], []]  # an eval call runs only forwards and keeps no trace


# -- PP x FSDP, AdamW -------------------------------------------------------------------------


def adamw_reference(shared, layers, batch, steps: int = 5) -> dict:
    """`steps` steps of torch.optim.AdamW on one device; the params stacked as the pipeline's."""
    ref = torch.utils._pytree.tree_map(lambda t: t.clone().requires_grad_(), dict(shared, layers=layers))
    opt = torch.optim.AdamW(torch.utils._pytree.tree_leaves(ref), lr=1e-2, weight_decay=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        reference_loss(ref, batch).backward()
        opt.step()
    ref = torch.utils._pytree.tree_map(lambda t: t.detach(), ref)
    return dict(ref, layers=sf.pipeline.stack_layers(ref["layers"]))


def pp_fsdp_adamw(mesh, params, batch, steps: int = 5) -> dict:
    """On every rank of {'stage', 'data'}: `steps` AdamW steps of sf.shard(sf.pipeline(...)); the full params."""
    pipe = sf.pipeline(layer_fn, pre=pre, post=post, microbatches=2, schedule="zb-h1")
    step = sf.shard(pipe, mesh, data_axes="data")  # the pipeline finds the mesh from the shard
    optimizer = sf.optim.adamw(1e-2)
    train = sf.train_step(step, optimizer)
    shards = step.shard_params(_local(params, mesh))
    state = optimizer.init(shards)
    mine = tuple(x.chunk(mesh.shape["data"])[mesh.coords["data"]] for x in batch)
    for _ in range(steps):
        shards, state, loss = train(shards, state, mine)
    full = step.unshard_params(shards)
    return dict(full, layers={k: sf.gather(v, mesh, sf.P("stage")) for k, v in full["layers"].items()})


def test_five_adamw_steps_of_pipeline_x_fsdp_equal_one_device():
    shared, layers = make_params(4)
    batch = make_batch(16)
    want = adamw_reference(shared, layers, batch)
    params = dict(shared, layers=sf.pipeline.stack_layers(layers))
    for got in run_on_mesh(lambda mesh: pp_fsdp_adamw(mesh, params, batch), {"stage": 2, "data": 2}):
        assert max_error(got, want) <= 1e-9


def _local(params, mesh):
    """This rank's params: the layers split over 'stage' (sf.shard then splits them over 'data')."""
    return dict(params, layers={k: sf.scatter(v, mesh, sf.P("stage")) for k, v in params["layers"].items()})


# -- schedules: bubbles, order, memory, traffic -----------------------------------------------


def test_bubbles_from_the_schedules_match_theory_and_zb_h1_beats_1f1b():
    p, M = 4, 8
    s = {name: sf.pipeline.schedule(name, p, M, V) for name, V in SCHEDULES}
    for name in ("gpipe", "1f1b"):
        assert s[name].bubble() == pytest.approx([(p - 1) / (M + p - 1)] * p, abs=1e-12)
    assert s["zb-h1"].bubble() == pytest.approx([(p - 1) / (3 * M + p - 1)] * p, abs=1e-12)  # 3/27
    assert max(s["zb-h1"].bubble()) < min(s["1f1b"].bubble())
    assert max(s["interleaved"].bubble()) < min(s["1f1b"].bubble())
    assert s["gpipe"].peak_in_flight() == [8, 8, 8, 8] and s["1f1b"].peak_in_flight() == [4, 3, 2, 1]
    assert s["zb-h1"].peak_in_flight() == [4, 4, 4, 4]  # ZB-H1: 1F1B's peak (p) on every rank


def _megatron_interleaved_order(p, M, V, rank):
    """Megatron-LM's `forward_backward_pipelining_with_interleaving`, transcribed for one rank
    (M a multiple of p): its k-th forward / backward runs chunk `get_model_chunk_id(k)` of
    microbatch `get_microbatch_id_in_model_chunk(k)`; warm-up (p - rank - 1) * 2 + (V - 1) * p
    forwards, then (forward k + warm-up, backward k) pairs, then the cool-down backwards."""
    total = M * V
    warmup = min((p - rank - 1) * 2 + (V - 1) * p, total)

    def chunk_id(k, forward):
        v = (k % (p * V)) // p
        return v if forward else V - v - 1

    def microbatch(k):
        return (k // (p * V)) * p + k % p

    def act(kind, k):  # model chunk v of this rank is the global chunk v * p + rank
        return sf.pipeline.Action(kind, microbatch(k), chunk_id(k, kind == "F") * p + rank)

    order = [act("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [act("F", warmup + k), act("B", k)]
    return order + [act("B", k) for k in range(total - warmup, total)]


def _textbook_order(name, p, M, rank):
    """GPipe: every forward, then every backward; 1F1B (PipeDream-Flush, Megatron's
    non-interleaved schedule): p - rank - 1 warm-up forwards, 1F1B pairs, cool-down."""
    F = [sf.pipeline.Action("F", mb, rank) for mb in range(M)]
    B = [sf.pipeline.Action("B", mb, rank) for mb in range(M)]
    if name == "gpipe":
        return F + B
    warmup = min(p - rank - 1, M)
    order = F[:warmup]
    for k in range(M - warmup):
        order += [F[warmup + k], B[k]]
    return order + B[M - warmup:]


@pytest.mark.parametrize("p,M", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 12)])
def test_interleaved_order_is_megatrons_and_its_bubble_the_formula(p, M):
    s = sf.pipeline.schedule("interleaved", p, M, 2)
    assert [list(acts) for acts in s.actions] == [_megatron_interleaved_order(p, M, 2, r) for r in range(p)]
    assert s.bubble() == pytest.approx([(p - 1) / (2 * M + p - 1)] * p, abs=1e-12)
    assert s.total_slots == 3 * 2 * M + 3 * (p - 1)  # every rank: M*V forwards + M*V double backwards + fill/drain
    assert s.peak_in_flight() == [min(2 * M, (p - r - 1) * 2 + p + 1) for r in range(p)]


def test_interleaved_order_spelled_out_for_two_stages():
    """p = 2, M = 4, V = 2, read off Megatron's loop by hand (chunk 2 / 3 = rank 0 / 1's second chunk)."""
    s = sf.pipeline.schedule("interleaved", 2, 4, 2)
    assert [repr(a) for a in s.actions[0]] == "F0 F1 F0.2 F1.2 F2 B0.2 F3 B1.2 F2.2 B0 F3.2 B1 B2.2 B3.2 B2 B3".split()
    assert [repr(a) for a in s.actions[1]] == \
        "F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3 F3.3 B3.3 B2.1 B3.1".split()


@pytest.mark.parametrize("p,M", [(2, 1), (2, 4), (4, 3), (4, 8)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_orders_are_the_textbook_ones(name, p, M):
    s = sf.pipeline.schedule(name, p, M)
    assert [list(acts) for acts in s.actions] == [_textbook_order(name, p, M, r) for r in range(p)]


def test_zb_h1_order_is_pinned():
    """ZB-H1 (Qi et al. 2023): 1F1B's warm-up, B (input gradient) right after its F where it can,
    each W deferred into a slot where the rank would otherwise wait."""
    s = sf.pipeline.schedule("zb-h1", 2, 4)
    assert [repr(a) for a in s.actions[0]] == "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3".split()
    assert [repr(a) for a in s.actions[1]] == "F0.1 B0.1 F1.1 B1.1 W0.1 F2.1 B2.1 W1.1 F3.1 B3.1 W2.1 W3.1".split()
    s = sf.pipeline.schedule("zb-h1", 4, 4)
    assert [" ".join(map(repr, acts)) for acts in s.actions] == [
        "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3",
        "F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 W0.1 B2.1 W1.1 B3.1 W2.1 W3.1",
        "F0.2 F1.2 B0.2 F2.2 B1.2 F3.2 B2.2 W0.2 B3.2 W1.2 W2.2 W3.2",
        "F0.3 B0.3 F1.3 B1.3 F2.3 B2.3 F3.3 B3.3 W0.3 W1.3 W2.3 W3.3",
    ]


@pytest.mark.parametrize("name,V,p,M,idle,slots", [
    ("gpipe", 1, 2, 4, 3, 15), ("gpipe", 1, 4, 8, 9, 33),
    ("1f1b", 1, 2, 4, 3, 15), ("1f1b", 1, 4, 8, 9, 33),
    ("interleaved", 2, 2, 2, 3, 15), ("interleaved", 2, 2, 4, 3, 27), ("interleaved", 2, 4, 8, 9, 57),
    ("zb-h1", 1, 2, 4, 1, 13), ("zb-h1", 1, 4, 8, 3, 27),
])
def test_exact_bubble_fractions(name, V, p, M, idle, slots):
    """Idle slots / step slots on every rank, as exact fractions (e.g. interleaved p = 2, M = 2:
    3/15 = 0.200; one swapped pair of forwards makes it 0.250, which this must catch)."""
    s = sf.pipeline.schedule(name, p, M, V)
    assert s.total_slots == slots
    assert [round(b * slots, 9) for b in s.bubble()] == [idle] * p
    assert s.bubble() == [pytest.approx(idle / slots, abs=1e-12)] * p


def test_the_executor_runs_each_rank_in_schedule_order_and_reproduces_the_bubble():
    p, M = 4, 8
    shared, layers = make_params(p)
    batch = make_batch(M)
    mesh = sf.local_mesh({"stage": p})
    for name in ("1f1b", "zb-h1"):
        pipe = sf.pipeline(layer_fn, pre=pre, post=post, microbatches=M, schedule=name, mesh=mesh)
        params = dict(shared, layers=sf.pipeline.stack_layers(layers))

        def body():
            torch.func.grad(pipe)(pipe.scatter_params(params), batch)
            return [a for a, _, _ in pipe.trace()], pipe.measured_bubble()

        ran = mesh.run(body)
        schedule = pipe.schedule(p)
        assert [r[0] for r in ran] == [list(acts) for acts in schedule.actions]
        replayed = sf.pipeline.Schedule(name, p, M, [r[0] for r in ran], split_backward=name == "zb-h1")
        assert replayed.bubble() == schedule.bubble()
        assert all(0.0 <= r[1] < 1.0 for r in ran)  # measured from timestamps (the benchmark records them)


def test_1f1b_holds_fewer_activations_than_gpipe():
    """Rank 0's peak allocation during a training call, p = 4, M = 8 (theory: p / M = 0.5)."""
    p, M, rows = 4, 8, 256
    shared, layers = make_params(2 * p)
    batch = make_batch(M * rows)
    mesh = sf.local_mesh({"stage": p})
    params = dict(shared, layers=sf.pipeline.stack_layers(layers))
    peaks = {}
    for name in ("gpipe", "1f1b"):
        pipe = sf.pipeline(layer_fn, pre=pre, post=post, microbatches=M, schedule=name, mesh=mesh)

        def body():
            local = pipe.scatter_params(params)
            torch.func.grad(pipe)(local, batch)  # warm-up: the one-time checks
            if mesh.rank != 0:
                torch.func.grad(pipe)(local, batch)
                return None
            with sf.measure_memory("cpu") as m:
                torch.func.grad(pipe)(local, batch)
            return m.peak_bytes

        peaks[name] = mesh.run(body)[0]
    ratio = peaks["1f1b"] / peaks["gpipe"]
    print(f"peak bytes rank 0: gpipe {peaks['gpipe']}, 1f1b {peaks['1f1b']}, ratio {ratio:.3f} (theory {p / M})")
    assert ratio <= 0.7


@pytest.mark.parametrize("p,V", [(4, 1), (2, 2)])
def test_one_activation_and_one_gradient_transfer_per_microbatch_and_boundary(p, V):
    M, rows = 3, 2
    shared, layers = make_params(p * V)
    batch = make_batch(M * rows)
    mesh = sf.local_mesh({"stage": p})
    pipe = sf.pipeline(layer_fn, pre=pre, post=post, microbatches=M, schedule="interleaved" if V > 1 else "1f1b",
                       virtual_stages=V, mesh=mesh)
    params = dict(shared, layers=sf.pipeline.stack_layers(layers, V))

    def body():
        local = pipe.scatter_params(params)
        torch.func.grad(pipe)(local, batch)  # the one-time checks, then a recorded call
        with ops.recording() as rec:
            torch.func.grad(pipe)(local, batch)
        return [(c.op, c.nbytes) for c in rec.records]

    sent = mesh.run(body)
    boundaries = p * V - 1
    transfers = pipe.schedule(p).transfers()
    assert len(transfers) == 2 * M * boundaries
    assert sum(1 for t in transfers if t[0] == "act") == M * boundaries
    for r, records in enumerate(sent):
        sends = [n for op, n in records if op == "send"]
        assert len(sends) == sum(1 for t in transfers if t[3] == r)
        assert set(sends) == {rows * D * 8}  # one (rows, D) fp64 activation or its gradient each
    assert sum(len([1 for op, _ in rec if op == "send"]) for rec in sent) == 2 * M * boundaries


# -- checkpoints ------------------------------------------------------------------------------


def test_checkpoint_of_pipeline_params_reshards_to_other_stage_counts(tmp_path):
    shared, layers = make_params(4)
    params = dict(shared, layers=sf.pipeline.stack_layers(layers))
    pipe = sf.pipeline(layer_fn, pre=pre, post=post, microbatches=2)
    specs = pipe.specs(params)
    path = str(tmp_path / "ckpt")
    run_on_mesh(lambda mesh: sf.checkpoint.save(path, pipe.scatter_params.__func__(
        _with_mesh(pipe, mesh), params), mesh, specs), {"stage": 4})
    for p in (2, 1):
        def load(mesh):
            like = _with_mesh(pipe, mesh).scatter_params(torch.utils._pytree.tree_map(torch.zeros_like, params))
            got = sf.checkpoint.load(path, like, mesh, specs)
            return dict(got, layers={k: sf.gather(v, mesh, specs["layers"][k]) for k, v in got["layers"].items()})
        for got in run_on_mesh(load, {"stage": p}):
            assert max_error(got, params) == 0.0
    plain = run_on_mesh(lambda mesh: sf.checkpoint.load(path, params, mesh, torch.utils._pytree.tree_map(
        lambda _: sf.P(), params)), {"data": 1})[0]  # no pipeline at all
    assert max_error(plain, params) == 0.0


def _with_mesh(pipe, mesh):
    return sf.pipeline(pipe.layer_fn, pre=pipe.pre, post=pipe.post, microbatches=pipe.microbatches, mesh=mesh)


# -- errors -----------------------------------------------------------------------------------


def _errors_on_every_rank(mesh, body) -> list[str]:
    def guarded():
        try:
            body()
        except sf.ShardingError as err:
            return str(err)
        return "no error"

    return mesh.run(guarded)


def test_invalid_microbatch_count_and_schedule():
    with pytest.raises(sf.ShardingError, match=r"microbatches must be a positive int, got 0"):
        sf.pipeline(layer_fn, post=post, microbatches=0)
    with pytest.raises(sf.ShardingError, match=r"unknown schedule 'pipedream'"):
        sf.pipeline(layer_fn, post=post, microbatches=2, schedule="pipedream")
    with pytest.raises(sf.ShardingError, match=r"virtual_stages=2 needs schedule='interleaved'"):
        sf.pipeline(layer_fn, post=post, microbatches=2, virtual_stages=2)


def test_batch_not_divisible_by_microbatches_raises_on_every_rank():
    shared, layers = make_params(4)
    mesh = sf.local_mesh({"stage": 2})
    pipe = sf.pipeline(layer_fn, pre=pre, post=post, microbatches=3, mesh=mesh)
    params = dict(shared, layers=sf.pipeline.stack_layers(layers))
    msgs = _errors_on_every_rank(mesh, lambda: pipe(pipe.scatter_params(params), make_batch(8)))
    assert all("batch[0] has 8 rows (shape (8, 4)), which microbatches=3 does not divide" in m for m in msgs)


def test_layers_not_divisible_into_stages_raise_on_every_rank():
    shared, layers = make_params(6)
    mesh = sf.local_mesh({"stage": 4})
    pipe = sf.pipeline(layer_fn, pre=pre, post=post, microbatches=2, mesh=mesh)
    params = dict(shared, layers=sf.pipeline.stack_layers(layers))
    msgs = _errors_on_every_rank(mesh, lambda: pipe.scatter_params(params))
    assert all("6 layers do not split into 4 stages x 1 virtual stages over mesh axis 'stage'" in m for m in msgs)

    def uneven():  # blocks as torch.chunk cuts them: 2, 2, 2, 0 layers
        local = dict(shared, layers={k: v.chunk(4)[mesh.rank] if mesh.rank < 3 else v[:0]
                                     for k, v in params["layers"].items()})
        torch.func.grad(pipe)(local, make_batch(4))

    msgs = _errors_on_every_rank(mesh, uneven)
    assert all("6 layers do not split into 4 stages" in m and "[2, 2, 2, 0] layers per chunk" in m for m in msgs), msgs


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_a_stage_that_changes_the_activation_raises_on_every_rank(bad):
    shared, layers = make_params(4)
    mesh = sf.local_mesh({"stage": 2})
    def cast_layer(w, x):  # computes in x's dtype, returns the params' dtype
        return layer_fn({k: v.to(x.dtype) for k, v in w.items()}, x).to(w["b"].dtype)

    pipe = sf.pipeline(cast_layer, pre=pre, post=post, microbatches=2, mesh=mesh)
    params = dict(shared, layers=sf.pipeline.stack_layers(layers))

    def body():
        local = pipe.scatter_params(params)
        if mesh.rank == 1:  # the second stage's layers: another width, or another dtype
            w = local["layers"]
            local["layers"] = ({"w": torch.cat([w["w"], w["w"][..., :1]], -1), "b": torch.cat([w["b"], w["b"][..., :1]], -1)}
                               if bad == "shape" else {k: v.float() for k, v in w.items()})
        torch.func.grad(pipe)(local, make_batch(4))

    msgs = _errors_on_every_rank(mesh, body)
    want = ("to shape (2, 7), torch.float64" if bad == "shape" else "to shape (2, 6), torch.float32")
    assert all("on rank 1 of the 'stage' axis, layer 2 (chunk 1) maps the activation of shape (2, 6), "
               "torch.float64 " + want in m for m in msgs), msgs


def test_a_hand_written_schedule_is_checked():
    F, B = (lambda mb, c=0: sf.pipeline.Action("F", mb, c)), (lambda mb, c=0: sf.pipeline.Action("B", mb, c))
    with pytest.raises(sf.ShardingError, match=r"deadlocks"):
        sf.pipeline.Schedule("mine", 2, 1, [[B(0), F(0)], [F(0, 1), B(0, 1)]])
    with pytest.raises(sf.ShardingError, match=r"no rank runs \[Action\(kind='B'|no rank runs \[B0"):
        sf.pipeline.Schedule("mine", 2, 1, [[F(0)], [F(0, 1), B(0, 1)]])
    with pytest.raises(sf.ShardingError, match=r"rank 0 lists F0.1: chunk 1 lives on rank 1"):
        sf.pipeline.Schedule("mine", 2, 1, [[F(0), F(0, 1)], [B(0, 1), B(0)]])
    good = sf.pipeline.Schedule("mine", 2, 1, [[F(0), B(0)], [F(0, 1), B(0, 1)]])
    assert good.draw().splitlines()[1:] == ["rank 0 |F0 .  .  .  B0 B0|", "rank 1 |.  F0 B0 B0 .  . |"]


def test_schedule_draw_and_repr():
    s = sf.pipeline.schedule("1f1b", 2, 3)
    assert s.draw().splitlines()[1:] == ["rank 0 |F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2|",
                                         "rank 1 |.  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  . |"]
    assert "rank 1: F0.1 B0.1 F1.1 B1.1 F2.1 B2.1" in repr(s)


# -- processes --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.multiprocess
def test_pipeline_x_fsdp_on_processes_equals_one_device():
    """{'stage': 2, 'data': 2} on 4 processes: one step's gradients, then 5 AdamW steps."""
    shared, layers = make_params(4)
    batch = make_batch(8)
    want_grads, want_loss = torch.func.grad_and_value(reference_loss)(dict(shared, layers=layers), batch)
    want_grads = dict(want_grads, layers=sf.pipeline.stack_layers(want_grads["layers"]))
    want_params = adamw_reference(shared, layers, batch)
    params = dict(shared, layers=sf.pipeline.stack_layers(layers))

    def body(mesh):
        pipe = sf.pipeline(layer_fn, pre=pre, post=post, microbatches=2, schedule="1f1b")
        step = sf.shard(pipe, mesh, data_axes="data")
        mine = tuple(x.chunk(2)[mesh.coords["data"]] for x in batch)
        grads, loss = torch.func.grad_and_value(step)(step.shard_params(_local(params, mesh)), mine)
        full = step.unshard_params(grads)
        full = dict(full, layers={k: sf.gather(v, mesh, sf.P("stage")) for k, v in full["layers"].items()})
        return float(loss), full, pp_fsdp_adamw(mesh, params, batch)

    for loss, grads, trained in run_on_mesh(body, {"stage": 2, "data": 2}, "distributed"):
        assert abs(loss - float(want_loss)) <= 1e-12
        assert max_error(grads, want_grads) <= 1e-10
        assert max_error(trained, want_params) <= 1e-9


# -- composition: remat per layer, PP x FSDP x TP ------------------------------------------------


def test_remat_per_layer_gives_the_same_gradients():
    shared, layers = make_params(4)
    batch = make_batch(4)
    mesh = sf.local_mesh({"stage": 2})
    params = dict(shared, layers=sf.pipeline.stack_layers(layers))
    got = {}
    for name, fn in (("plain", layer_fn), ("remat", sf.remat(layer_fn))):
        pipe = sf.pipeline(fn, pre=pre, post=post, microbatches=2, schedule="zb-h1", mesh=mesh)
        got[name] = mesh.run(lambda: torch.func.grad(pipe)(pipe.scatter_params(params), batch))
    for a, b in zip(got["plain"], got["remat"]):
        assert max_error(a, b) <= 1e-12


H = 4  # hidden width of the tensor-parallel MLP layer, split over 'model'


def tp_layer(w, x, reduce=lambda t: t):  # Megatron MLP: column-parallel w1, row-parallel w2
    return x + reduce(torch.tanh(x @ w["w1"] + w["b1"]) @ w["w2"])


def test_pipeline_x_fsdp_x_tensor_parallel_on_a_3d_mesh():
    g = torch.Generator().manual_seed(3)
    layers = [{"w1": torch.randn(D, H, generator=g, dtype=torch.float64) / D ** 0.5,
               "b1": torch.randn(H, generator=g, dtype=torch.float64) / 4,
               "w2": torch.randn(H, D, generator=g, dtype=torch.float64) / H ** 0.5} for _ in range(4)]
    shared, _ = make_params(0)
    batch = make_batch(8)

    def reference(p, b):
        h = pre(p["pre"], b)
        for layer in p["layers"]:
            h = tp_layer(layer, h)
        return post(p["post"], h, b)

    want_grads, want_loss = torch.func.grad_and_value(reference)(dict(shared, layers=layers), batch)
    want = dict(want_grads, layers=sf.pipeline.stack_layers(want_grads["layers"]))
    params = dict(shared, layers=sf.pipeline.stack_layers(layers))
    mesh = sf.local_mesh({"stage": 2, "data": 2, "model": 2})
    tp_specs = {"w1": sf.P(None, None, "model"), "b1": sf.P(None, "model"), "w2": sf.P(None, "model")}
    pipe = sf.pipeline(lambda w, x: tp_layer(w, x, lambda t: sf.psum(t, "model")), pre=pre, post=post,
                       microbatches=2, schedule="1f1b")
    step = sf.shard(pipe, mesh, param_specs=lambda path: tp_specs.get(path[-1]) if path[0] == "layers" else None)

    def body():
        local = _local(params, mesh)
        grads, loss = torch.func.grad_and_value(step)(step.shard_params(local), tuple(
            x.chunk(2)[mesh.coords["data"]] for x in batch))
        full = step.unshard_params(grads)
        return float(loss), dict(full, layers={k: sf.gather(v, mesh, sf.P("stage")) for k, v in full["layers"].items()})

    for loss, grads in mesh.run(body):
        assert abs(loss - float(want_loss)) <= 1e-12
        assert max_error(grads, want) <= 1e-10


def test_the_pipeline_api_is_one_namespace_and_the_flat_names_warn():
    """`sf.pipeline` is the transform and the namespace (issue 36); the flat names of
    earlier releases still resolve, with a DeprecationWarning naming the new spelling."""
    schedule = sf.pipeline.schedule("1f1b", 2, 4)
    assert isinstance(schedule, sf.pipeline.Schedule) and schedule.name == "1f1b"
    assert callable(sf.pipeline) and sf.pipeline.transform.__name__ == "pipeline"
    for flat, new in [("pipeline_schedule", "schedule"), ("PipelineSchedule", "Schedule"),
                      ("PipelineAction", "Action"), ("stack_layers", "stack_layers"), ("Pipeline", "Pipeline")]:
        with pytest.warns(DeprecationWarning, match=rf"sf\.{flat} is sf\.pipeline\.{new} now"):
            assert getattr(sf, flat) is getattr(sf.pipeline, new)
