"""`sf.estimate` (a dry run on meta tensors) against the real step on the simulated mesh.

Exact: parameter, gradient and optimizer-state shards, peak gathered bytes and collective
bytes (the dry run runs the same schedule). Within 10%: the step's peak allocation and
its activations, against what torch.profiler sees allocated in rank 0's thread of the real
step (forward + backward by `torch.func.grad_and_value`, after one forward that teaches
the schedule its prefetch order, as in the dry run).
"""

from __future__ import annotations

import time

import optree
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import shardfn as sf
from allocations import allocations
from shardfn.testing.models import GPT, GPTConfig

TOLERANCE = 0.10


def _nbytes(tree) -> int:
    return sum(x.numel() * x.element_size() for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor))


def _measure(loss_fn, params, make_batch, n, optimizer=None, use_func=False, **options):
    """Run the real step on a simulated mesh of n ranks; rank 0's measurements.

    `peak`: the most bytes allocated at once during the step (profiler). `activations`:
    the most bytes allocated at once besides the gathered parameters, the schedule's own
    count of which (`Stats.live`) is logged with a timestamp each time it changes and set
    against the profiler's events (taking the larger of its values around each event, as
    a buffer is allocated just before it is counted and freed just before it is uncounted).
    """
    mesh = sf.local_mesh({"data": n})
    step = sf.shard(loss_fn, mesh, **options)
    grad_and_value = torch.func.grad_and_value(step) if use_func else step.grad_and_value

    def body():
        torch.set_num_threads(1)
        shards = step.shard_params(params)
        opt_state = optimizer.init(shards) if optimizer is not None else None
        batch = make_batch(mesh.rank)
        step(shards, batch)  # learn the access order
        if mesh.rank != 0:
            grad_and_value(shards, batch)
            return None
        stats = step._state(step._plan_for(shards)).stats
        hold, held = stats.hold, [(0, 0)]

        def logged(nbytes):
            hold(nbytes)
            held.append((time.time_ns(), stats.live))

        stats.hold = logged
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
                pass  # the profiler's first start is slow: keep it out of the measured one
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                held.append((time.time_ns(), stats.live))
                grads, _ = grad_and_value(shards, batch)
        finally:
            del stats.hold
        live = peak = rest = 0
        j = 0
        for t, nbytes in allocations(prof):
            live += nbytes
            while j + 1 < len(held) and held[j + 1][0] <= t:
                j += 1
            gathered = max(held[j][1], held[j + 1][1] if j + 1 < len(held) else 0)
            peak, rest = max(peak, live), max(rest, live - gathered)
        return dict(param_bytes=_nbytes(shards), grad_bytes=_nbytes(grads), opt_state_bytes=_nbytes(opt_state),
                    stats=step.stats(), peak=peak, activations=rest)

    return mesh.run(body)[0]


# -- the cases -----------------------------------------------------------------------------


def _mlp(L=8, D=512, B=1024):
    g = torch.Generator().manual_seed(0)
    params = {"layers": [{"w": torch.randn(D, D, generator=g) / D ** 0.5, "b": torch.zeros(D)} for _ in range(L)]}

    def loss_fn(p, x):
        for layer in p["layers"]:
            x = torch.tanh(x @ layer["w"] + layer["b"])
        return x.square().mean()

    def make_batch(rank):
        return torch.randn(B, D, generator=torch.Generator().manual_seed(rank))

    return loss_fn, params, make_batch, torch.Size([B, D])


def _mlp_remat(L=8, D=512, B=1024):
    """Each layer recomputed in the backward (torch.utils.checkpoint: the eager path only)."""
    from torch.utils.checkpoint import checkpoint

    _, params, make_batch, batch_shapes = _mlp(L, D, B)

    def layer_fn(x, w, b):
        return torch.tanh(torch.tanh(x @ w + b) * 2 + 1)

    def loss_fn(p, x, remat=True):
        for layer in p["layers"]:
            x = checkpoint(layer_fn, x, layer["w"], layer["b"], use_reentrant=False) if remat else layer_fn(
                x, layer["w"], layer["b"])
        return x.square().mean()

    return loss_fn, params, make_batch, batch_shapes


def _gpt(B=8, T=64):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=T, n_layer=4, n_head=4, n_embd=128)
    apply_fn, params = sf.functional(GPT(cfg))

    def loss_fn(p, batch):
        return apply_fn(p, *batch)

    def make_batch(rank):
        idx = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(rank))
        return idx, idx

    return loss_fn, params, make_batch, (((B, T), torch.long), ((B, T), torch.long))


def _attention(B=4, H=4, T=512, D=32):
    """Causal attention by F.scaled_dot_product_attention, which picks its kernel by device."""
    g = torch.Generator().manual_seed(0)
    params = {"layers": [{"wq": torch.randn(D, D, generator=g), "wk": torch.randn(D, D, generator=g)}]}

    def loss_fn(p, x):  # x: (B, H, T, D)
        for layer in p["layers"]:
            x = torch.nn.functional.scaled_dot_product_attention(x @ layer["wq"], x @ layer["wk"], x, is_causal=True)
        return x.square().mean()

    def make_batch(rank):
        return torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(rank))

    return loss_fn, params, make_batch, torch.Size([B, H, T, D])


def _check(case, n, optimizer=None, use_func=False, **options):
    loss_fn, params, make_batch, batch_shapes = case
    est = sf.estimate(loss_fn, params, batch_shapes, {"data": n}, optimizer=optimizer, use_func=use_func, **options)
    real = _measure(loss_fn, params, make_batch, n, optimizer, use_func, **options)
    stats = real["stats"]
    assert (est.param_bytes, est.grad_bytes, est.opt_state_bytes) == (
        real["param_bytes"], real["grad_bytes"], real["opt_state_bytes"])
    assert est.peak_gathered_bytes == stats["peak_gathered_bytes"]
    assert (est.all_gather_bytes, est.reduce_scatter_bytes, est.all_reduce_bytes, est.num_collectives) == (
        stats["all_gather_bytes"], stats["reduce_scatter_bytes"], stats["all_reduce_bytes"], stats["num_collectives"])
    # gloo on CPU copies a collective through a buffer of its own: the dry run counts one per
    # collective in flight (ops.meta_in_flight) in peak_step_bytes
    peak = est.peak_step_bytes
    total = est.total
    real_total = real["param_bytes"] + real["opt_state_bytes"] + real["peak"]
    errors = dict(peak=peak / real["peak"] - 1, activations=est.peak_activation_bytes / real["activations"] - 1,
                  total=total / real_total - 1)
    print(f"\nN={n}: estimate {peak} / {est.peak_activation_bytes} / {total}, measured {real['peak']} / "
          f"{real['activations']} / {real_total} (peak / activations / total); errors "
          + ", ".join(f"{k} {v:+.1%}" for k, v in errors.items()))
    assert all(abs(e) <= TOLERANCE for e in errors.values()), errors
    return est, real


@pytest.mark.parametrize("use_func", [False, True], ids=["train_step", "torch.func"])
def test_mlp_matches_the_real_step_on_two_ranks(use_func):
    _check(_mlp(), 2, optimizer=sf.optim.adamw(1e-3), use_func=use_func)


@pytest.mark.parametrize("use_func", [False, True], ids=["train_step", "torch.func"])
def test_gpt_matches_the_real_step_on_two_ranks(use_func):
    _check(_gpt(), 2, optimizer=sf.optim.adamw(1e-3), use_func=use_func)


def test_gpt_matches_the_real_step_on_four_ranks():
    _check(_gpt(), 4, optimizer=sf.optim.adamw(1e-3))


@pytest.mark.parametrize("use_func", [False, True], ids=["train_step", "torch.func"])
def test_attention_is_counted_as_the_fused_kernel_the_device_runs(use_func):
    # on meta tensors sdpa would take the math path and count (B, H, T, T) scores, 16 MiB here,
    # on top of the rest; the CPU's flash kernel (like CUDA's) keeps the output and its
    # log-sum-exp, and its backward a query-sized fp32 buffer while it runs
    est, real = _check(_attention(), 1, use_func=use_func)
    assert est.peak_activation_bytes < 4 * 4 * 512 * 512 * 4


def _masked_tokens(B=8, T=256, D=256, V=64, pad=True):
    """Token ids and a mask whose sum sizes the activations: a data-dependent program."""
    g = torch.Generator().manual_seed(0)
    params = {"layers": [{"emb": torch.randn(V, D, generator=g)}, {"w": torch.randn(D, D, generator=g) / 16}]}
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[:, T // 4:] = 0  # three quarters padding

    def loss_fn(p, batch):
        ids, mask = batch
        keep = int(mask.sum())  # .item() of an integer batch leaf: a real value in the dry run
        x = p["layers"][0]["emb"][ids.flatten()[:keep]]  # (keep, D)
        return torch.tanh(x @ p["layers"][1]["w"]).square().mean()

    def make_batch(rank):
        return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(rank)), mask

    return loss_fn, params, make_batch, (((B, T), torch.long), mask)


def test_integer_batch_values_steer_the_dry_run_as_the_real_step():
    est, real = _check(_masked_tokens(), 2)
    loss_fn, params, _, shapes = _masked_tokens(pad=False)
    ones = sf.estimate(loss_fn, params, (shapes[0], shapes[0]), 2)
    # a batch given as shapes is filled with ones: nothing padded, four times the tokens
    assert ones.peak_activation_bytes > 3 * est.peak_activation_bytes


def test_a_value_computed_from_an_activation_is_refused_with_the_op_named():
    def loss_fn(p, x):
        h = x @ p["w"]
        counts = torch.zeros(4, dtype=torch.long)  # a real tensor...
        counts.copy_(h[0, :4].long())  # ...written from an activation: its values are unknown now
        if counts.sum().item() > 0:
            h = h * 2
        return h.square().mean()

    with pytest.raises(sf.SpecError, match=r"(?s)sf.estimate: aten._local_scalar_dense.default cannot run in the "
                                           r"dry run: its inputs \(meta torch.int64 \(\)\) are meta.*\nFix: compute the value from "
                                           r"integer or bool batch leaves"):
        sf.estimate(loss_fn, {"w": torch.Size([8, 8])}, torch.Size([4, 8]), 2)


def test_the_programs_own_errors_pass_through():
    def loss_fn(p, x):
        return (x @ p["w"].T[:3]).sum()  # (4, 8) @ (3, 8): a shape error, the real step's too

    with pytest.raises(RuntimeError, match="same reduction dim") as info:
        sf.estimate(loss_fn, {"w": torch.Size([8, 8])}, torch.Size([4, 8]), 1)
    assert not isinstance(info.value, sf.SpecError)


def test_a_large_value_computed_from_the_batch_stays_meta():
    def loss_fn(p, batch):
        wide = batch[..., None].repeat(1, 1, 2 ** 16)  # (4, 64, 65536) int64: 128 MiB, above REAL_BYTES
        return (p["w"] * wide.sum(-1).float()).mean()

    est = sf.estimate(loss_fn, {"w": torch.Size([4, 64])}, ((4, 64), torch.long), 1)
    assert est.peak_activation_bytes >= 4 * 64 * 2 ** 16 * 8  # counted, never allocated


def test_recomputation_is_measured_as_written():
    loss_fn, params, make_batch, batch_shapes = _mlp_remat()
    est, _ = _check((loss_fn, params, make_batch, batch_shapes), 2)
    plain = sf.estimate(lambda p, x: loss_fn(p, x, remat=False), params, batch_shapes, 2)
    # without recomputation each layer keeps its inner tanh's output, a (B, D) tensor, for the backward
    assert plain.peak_activation_bytes - est.peak_activation_bytes >= 8 * 1024 * 512 * 4


def _real_stats(loss_fn, params, make_batch, shape, **options):
    mesh = sf.local_mesh(shape)
    step = sf.shard(loss_fn, mesh, **options)

    def body():
        shards = step.shard_params(params)
        batch = make_batch(mesh.rank)
        step(shards, batch)
        grads, _ = step.grad_and_value(shards, batch)
        return _nbytes(shards), _nbytes(grads), step.stats()

    return max(mesh.run(body), key=lambda r: r[0])


@pytest.mark.parametrize("shape, options", [
    ({"replica": 2, "shard": 2}, dict(data_axes=("replica", "shard"), shard_axes="shard")),  # HSDP
    ({"node": 2, "gpu": 2}, dict(data_axes=("node", "gpu"), reshard_after_forward="gpu")),  # hpZ
    ({"data": 3}, dict(prefetch=2)),  # uneven chunks: 512 rows over 3 ranks
], ids=["hsdp", "hpz", "uneven"])
def test_two_dimensional_meshes_and_uneven_chunks_are_exact(shape, options):
    loss_fn, params, make_batch, batch_shapes = _mlp(L=4, D=512, B=8)
    est = sf.estimate(loss_fn, params, batch_shapes, shape, **options)
    param_bytes, grad_bytes, stats = _real_stats(loss_fn, params, make_batch, shape, **options)
    assert (est.param_bytes, est.grad_bytes) == (param_bytes, grad_bytes)
    assert {k: getattr(est, k) for k in stats} == stats


def test_tensor_parallel_steps_are_exact():
    """FSDP x TP: Megatron's MLP split over 'model' (column- then row-parallel, a psum inside
    loss_fn), each rank's blocks FSDP-sharded over 'data'; the dry run's collectives on meta
    tensors answer with meta results, and its bytes equal the real step's stats()."""
    D, H, B = 64, 128, 8
    g = torch.Generator().manual_seed(0)
    params = {"layers": [{"w1": torch.randn(D, H, generator=g) / D ** 0.5, "w2": torch.randn(H, D, generator=g) / H ** 0.5,
                          "scale": torch.ones(D)} for _ in range(2)]}
    specs = lambda path: {"w1": sf.P(None, "model"), "w2": sf.P("model", None)}.get(path[-1])  # noqa: E731

    def loss_fn(p, x):
        for layer in p["layers"]:
            x = x * layer["scale"] + sf.psum(torch.tanh(x @ layer["w1"]) @ layer["w2"], "model")
        return x.square().mean()

    shape = {"data": 2, "model": 2}
    est = sf.estimate(loss_fn, params, torch.Size([B, D]), shape, param_specs=specs)
    # each 'model' rank of a data rank reads that data rank's batch
    make_batch = lambda rank: torch.randn(B, D, generator=torch.Generator().manual_seed(rank // 2))  # noqa: E731
    param_bytes, grad_bytes, stats = _real_stats(loss_fn, params, make_batch, shape, param_specs=specs)
    assert (est.param_bytes, est.grad_bytes) == (param_bytes, grad_bytes)
    assert {k: getattr(est, k) for k in stats} == stats
    assert stats["all_reduce_bytes"] > 0  # the psums and the replicated leaves' sum over 'model' are counted


def test_options_are_followed_exactly():
    # ZeRO-2's trade (units kept gathered) in bf16: the dry run follows the options it is given
    mp = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    est, real = _check(_mlp(L=4, B=512), 2, reshard_after_forward=False, mixed_precision=mp)
    psi = 2 * real["param_bytes"]  # fp32 shards on 2 ranks
    assert est.all_gather_bytes == psi // 2  # Ψ_p = Ψ / 2 in bf16, gathered once


# -- the API --------------------------------------------------------------------------------


def _tiny_gpt():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
    with torch.device("meta"):  # no memory: the dry run needs shapes only
        apply_fn, params = sf.functional(GPT(cfg))
    return (lambda p, b: apply_fn(p, *b)), params


def test_eight_ranks_follow_the_memory_model():
    loss_fn, params = _tiny_gpt()
    psi = _nbytes(params)
    psi_root = _nbytes({k: v for k, v in params["transformer"].items() if k != "h"})
    psi_unit = _nbytes(params["transformer"]["h"][0])
    est = sf.estimate(loss_fn, params, (((2, 16), torch.long),) * 2, {"data": 8}, optimizer=sf.optim.adamw(1e-3))
    assert est.mesh_shape == {"data": 8}
    assert est.param_bytes == est.grad_bytes == psi // 8
    assert est.opt_state_bytes == 2 * psi // 8 + 8  # mu, nu and the int64 step count
    assert est.peak_gathered_bytes == psi_root + 2 * psi_unit  # docs/design/memory.md
    assert est.all_gather_bytes == 2 * psi - psi_root and est.reduce_scatter_bytes == psi
    assert est.all_reduce_bytes == 32  # the loss all-reduce: [loss, n, n*n, unknown] in float64 (fsdp_design.md)
    assert est.peak_activation_bytes > 0
    assert est.total == est.param_bytes + est.opt_state_bytes + est.peak_step_bytes
    assert est.peak_step_bytes >= max(est.peak_gathered_bytes, est.peak_activation_bytes, est.grad_bytes)


def test_params_and_batch_as_tensors_shapes_or_pairs_agree():
    loss_fn, params, _, _ = _mlp(L=2, D=64, B=8)
    shapes = optree.tree_map(lambda x: x.shape, params)
    tuples = optree.tree_map(lambda x: (tuple(x.shape), x.dtype), params)
    meta = optree.tree_map(lambda x: x.to("meta"), params)
    results = [
        sf.estimate(loss_fn, params, torch.zeros(8, 64), 2),
        sf.estimate(loss_fn, shapes, torch.Size([8, 64]), {"data": 2}),
        sf.estimate(loss_fn, tuples, (8, 64), {"data": 2}),
        sf.estimate(loss_fn, meta, ((8, 64), torch.float32), {"data": 2}),
    ]
    assert all(r == results[0] for r in results[1:])


def test_estimate_prints_a_table():
    loss_fn, params, _, _ = _mlp(L=2, D=64, B=8)
    text = str(sf.estimate(loss_fn, params, (8, 64), 2, optimizer=sf.optim.sgd(0.1)))
    for row in ("parameter shards", "gradient shards", "optimizer state", "peak gathered parameters",
                "peak activations", "total", "all-gather per step", "reduce-scatter per step"):
        assert row in text
    assert text.startswith("sf.estimate on mesh {'data': 2}, per rank:")


def test_a_leaf_that_is_no_shape_is_named():
    loss_fn, params, _, _ = _mlp(L=2, D=64, B=8)
    params["layers"][1]["b"] = "64"
    with pytest.raises(sf.SpecError, match=r"params_or_shapes\['layers'\]\[1\]\['b'\] is a str"):
        sf.estimate(loss_fn, params, (8, 64), 2)
    with pytest.raises(sf.SpecError, match=r"batch_shapes\[1\] is a float"):
        sf.estimate(loss_fn, optree.tree_map(lambda x: x.shape, _mlp(L=2, D=64)[1]), ((8, 64), 1.5), 2)


def test_meta_params_are_still_refused_by_a_real_step():
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, x: (x @ p["w"]).sum(), mesh)
    with pytest.raises(sf.ShardingError, match=r"params\['w'\] is on the meta device"):
        mesh.run(lambda: step.shard_params({"w": torch.empty(4, 4, device="meta")}))


def test_collectives_on_meta_tensors_return_shapes_without_the_process_group():
    from shardfn._backend import ops

    mesh = sf.local_mesh({"data": 4})
    backend = mesh._backend

    def body():
        group = mesh.group("data")
        seen = []
        x = torch.empty(2, 3, device="meta")
        with ops.recording(lambda op, axes, nbytes: seen.append((op, nbytes))):
            shapes = [
                ops.all_reduce(group, x).shape,
                ops.all_gather(group, x).shape,
                ops.all_gather_async(group, x).wait().shape,
                ops.reduce_scatter(group, torch.empty(8, 3, device="meta")).shape,
                ops.all_to_all(group, torch.empty(4, 6, device="meta"), 0, 1).shape,
                ops.ppermute(group, x, [(0, 1), (1, 0)]).shape,
            ]
        return shapes, seen

    before = dict(backend._seq)
    # one rank alone: nothing waits for the others
    shapes, seen = backend.run(lambda: body() if mesh.rank == 0 else None, (), {})[0]
    assert shapes == [(2, 3), (8, 3), (4, 2, 3), (2, 3), (1, 24), (2, 3)]
    assert seen == [("all_reduce", 24), ("all_gather", 96), ("all_gather", 96), ("reduce_scatter", 96),
                    ("all_to_all", 96), ("ppermute", 24)]
    assert dict(backend._seq) == before  # no sequence number taken: the group never saw them


def _cells(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.strip().splitlines()]


def _table_difference(page: str, now: str) -> str:
    """What differs between the table on the page and the one the estimate gives now, cell
    by cell, and what a difference means."""
    old, new = _cells(page), _cells(now)
    header = new[0]
    diffs = [f"  - {header[j] if j < len(header) else f'column {j}'} at {row[0]} ranks: page {a!r}, now {b!r}"
             for i, (row, other) in enumerate(zip(old, new)) if i > 1
             for j, (a, b) in enumerate(zip(row, other)) if a != b]
    if len(old) != len(new) or old[0] != new[0]:
        diffs.append(f"  - the tables' shapes differ: page {len(old)} rows, header {old[0]}; now {len(new)} rows, "
                     f"header {new[0]}")
    return ("sf.estimate now gives other numbers than the table in docs/howto/will-it-fit.md:\n" + "\n".join(diffs)
            + "\nThe page's numbers were checked against the memory model when they were written, so a "
            "difference is a change in what sf.estimate (or the step it dry-runs) counts: find the commit that "
            "moved it and decide whether the new number is right (tests/estimate/test_estimate_exact.py asserts each "
            "component against the schedule). It is a bug to look at, not a table to refresh; rewrite the page "
            "only once the change is understood and intended, and say why in that commit.")


def _check_remat_saves(estimates, remat) -> None:
    for est, rem in zip(estimates, remat):  # every block recomputed: the blocks' saved activations go, the
        # (B, T, vocab) logits and their loss remain (attention is fused: no (B, H, T, T) scores either way)
        assert rem.peak_activation_bytes < 0.75 * est.peak_activation_bytes


def test_the_docs_tables_first_rows_are_what_the_estimate_gives():
    # The table's rows for 1 and 2 ranks (a GPT-2-small dry run costs ~2 s per rank and plan,
    # so the 8-rank rows run in the slow test below, which checks the script end to end).
    from benchmarks import will_it_fit

    estimates, remat = will_it_fit.estimates(sizes=(1, 2)), will_it_fit.estimates(sizes=(1, 2), remat=True)
    page = will_it_fit.page_table().splitlines()
    page = "\n".join(page[:2] + [row for row in page[2:] if _cells(row)[0][0] in ("1", "2")])
    now = will_it_fit.markdown_table(estimates, remat)
    assert page == now, _table_difference(page, now)
    _check_remat_saves(estimates, remat)


@pytest.mark.slow
def test_the_docs_table_is_what_the_script_prints(tmp_path):
    from benchmarks import will_it_fit

    rows = will_it_fit.main(["--out", str(tmp_path / "fit")])
    assert [r["mesh_shape"]["data"] for r in rows] == [1, 2, 4, 8]
    estimates = [sf.Estimate(**{k: v for k, v in r.items() if k not in ("total", "remat")}) for r in rows]
    remat = [sf.Estimate(**{k: v for k, v in r["remat"].items() if k != "total"}) for r in rows]
    page, now = will_it_fit.page_table(), will_it_fit.markdown_table(estimates, remat)
    assert page == now, _table_difference(page, now)
    _check_remat_saves(estimates, remat)
