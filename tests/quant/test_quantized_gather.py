"""Quantized all-gather (ZeRO++ qwZ): `MixedPrecision(all_gather_dtype=...)`.

References are built here from `shardfn._quant` on the full leaves: each rank's shard
buffer is the concatenation of its `torch.chunk` of every leaf of a unit (zero-padded to
the chunk size), encoded and decoded with the leaves' chunks as segments (scales per leaf:
tests/quant/test_quant_leaves.py); `loss_fn` must see exactly those values, each within `bound`
of the master value. Gradients: the quantizer is the identity for differentiation
(straight-through), so the step's gradient must equal the exact fp32 gradient evaluated at
the decoded parameters; that is how the error bound enters the gradient, and it is checked
to fp32 round-off. Traffic: `k * nbytes(S, segments)` per unit gather, against `stats()` and the
backend's recording.
"""

from __future__ import annotations

import threading

import optree
import pytest
import torch

import shardfn as sf
from shardfn import _quant
from shardfn._fsdp import gather as gather_mod
from shardfn.testing import run_on_mesh
from tests import traffic

WIRES = {"int8": "int8", "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "bf16": torch.bfloat16}
BLOCK = 8  # small: several blocks per leaf, partial last blocks, padding inside blocks


def make_params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    layers = [{"w": torch.randn(7, 5, generator=g), "b": torch.randn(5, generator=g) * 1e-3} for _ in range(3)]
    params = {"layers": layers, "embed": torch.randn(9, 5, generator=g) * 10, "head": torch.randn(5, 3, generator=g)}
    return optree.tree_map(lambda x: x.to(dtype), params)


def loss_fn(p, x, record=None):  # x: (B, 5)
    def get(*path):
        t = p
        for key in path:
            t = t[key]
        if record is not None:
            record(path, t)
        return t

    x = x + get("embed").sum(0)
    for i in range(len(p["layers"])):
        x = torch.tanh(x @ get("layers", i, "w")[:5] + get("layers", i, "b"))
    return (x @ get("head")).square().mean()


def batch_of(rank, n=4, dtype=torch.float32):
    return torch.randn(n, 5, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def seen_recorder():
    """(a loss_fn that records the full leaves it reads, per rank thread; the record)."""
    seen, lock = {}, threading.Lock()

    def record(path, t):
        with lock:
            seen.setdefault(threading.current_thread().name, {})[path] = t.detach().clone()

    return (lambda p, x: loss_fn(p, x, record)), seen


def leaf_segments(unit):
    """The unit's leaves' chunk sizes: where the wire's blocks restart."""
    return tuple(layout.chunk_numel for layout in unit.sharded)


def reference(plan, params, wire, compute=None):
    """Per leaf path, the full leaf as the quantized gather must produce it (built from
    `_quant` on the full leaves' chunks), after checking every element against `bound`."""
    paths, leaves, _ = optree.tree_flatten_with_path(params)
    out = {}
    for unit in plan.units:
        if not unit.sharded:
            continue
        rows = []
        for r in range(unit.k):
            pieces = []
            for layout in unit.sharded:
                chunks = torch.chunk(leaves[layout.index], unit.k)
                chunk = chunks[r].reshape(-1) if r < len(chunks) else torch.zeros(0, dtype=layout.dtype)
                pieces.append(torch.nn.functional.pad(chunk, (0, layout.chunk_numel - chunk.numel())))
            buf = torch.cat(pieces)  # (S,) rank r's shard buffer in the masters' dtype
            segs = leaf_segments(unit)
            dec = _quant.decode(_quant.encode(buf, wire, segments=segs), wire, buf.numel(), buf.dtype, segments=segs)
            assert bool(((dec - buf).abs() <= _quant.bound(buf, wire, segments=segs)).all())
            rows.append(dec.to(compute or buf.dtype))
        for layout in unit.sharded:
            region = torch.stack([row[layout.offset: layout.offset + layout.chunk_numel] for row in rows])
            full = region.reshape((unit.k * layout.chunk,) + layout.shape[1:])[: layout.rows]
            out[paths[layout.index]] = full
    return out


def expected_gather_bytes(plan, wire, *, reshard=True):
    total = 0
    for unit in plan.units:
        if unit.sharded:
            times = 1 if (unit.is_root or not reshard) else 2
            total += times * unit.k * _quant.nbytes(unit.shard_numel, wire, unit.dtype, leaf_segments(unit))
    return total


def run_step(mesh, wire, *, options=None, params=None, mp=None, record=None):
    """One grad_and_value step per rank: (loss, full grads, seen leaves, stats, recorded totals)."""
    params = params or make_params()
    mp = mp or {}
    f, seen = seen_recorder() if record is None else record
    step = sf.shard(f, mesh, mixed_precision=sf.MixedPrecision(all_gather_dtype=wire, block_size=BLOCK, **mp),
                    **(options or {}))
    data = ("data",) if "data" in mesh.shape else tuple(mesh.axis_names)

    def body():
        shards = step.shard_params(params)
        index = mesh.coords[data[0]] if len(data) == 1 else mesh.rank
        with traffic.sent() as rec:
            grads, loss = torch.func.grad_and_value(step)(shards, batch_of(index))
        return (float(loss), step.unshard_params(grads), step.stats(), traffic.totals(rec.records), shards,
                step._plan_for(shards))

    results = mesh.run(body)
    return step, params, results, seen


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", list(WIRES))
def test_gathered_values_gradients_and_traffic(name, n):
    wire_spec = WIRES[name]
    wire = _quant.Wire.of(wire_spec, BLOCK)
    mesh = sf.local_mesh({"data": n})
    step, params, results, seen = run_step(mesh, wire_spec)
    plan = results[0][5]
    ref = reference(plan, params, wire)
    assert len(seen) == n
    for leaves in seen.values():  # what loss_fn saw: decode(encode(shard buffer)), exactly
        for path, full in ref.items():
            assert torch.equal(leaves[path], full), (name, path)
    # gradient = the exact fp32 gradient at the decoded parameters (the quantizer is straight-through)
    decoded = optree.tree_unflatten(optree.tree_structure(params), [
        ref.get(p, x) for p, x in zip(*optree.tree_flatten_with_path(params)[:2])])
    exact = torch.func.grad(lambda p: torch.stack([loss_fn(p, batch_of(r)) for r in range(n)]).mean())(decoded)
    for loss, grads, stats, sent, *_ in results:
        sf.testing.assert_trees_allclose(grads, exact, rtol=1e-5, atol=1e-6)
        expected = expected_gather_bytes(plan, wire)
        assert stats["all_gather_bytes"] == expected == sent["all_gather_bytes"]
        assert traffic.stats_view(stats) == sent


def test_bytes_formula_int8_is_a_quarter_plus_scales():
    mesh = sf.local_mesh({"data": 2})
    params = {"layers": [{"w": torch.randn(64, 128)} for _ in range(2)]}  # S = 4096 per unit
    step = sf.shard(lambda p, x: sum((x @ l["w"]).square().mean() for l in p["layers"]), mesh,
                    mixed_precision=sf.MixedPrecision(all_gather_dtype="int8", block_size=1024))

    def body():
        shards = step.shard_params(params)
        with traffic.sent() as rec:
            torch.func.grad(step)(shards, torch.randn(4, 64))
        return step.stats()["all_gather_bytes"], traffic.totals(rec.records)["all_gather_bytes"]

    s = 4096
    per_gather = 2 * (s + 4 * (s // 1024))  # k * (S int8 + one fp32 scale per block), already 8-aligned
    for stats_bytes, sent_bytes in mesh.run(body):
        assert stats_bytes == sent_bytes == 2 * 2 * per_gather == 2 * 2 * 2 * 4112
        assert per_gather / (2 * s * 4) == pytest.approx(0.25 + 1 / 1024)


class Encodes:
    """Counts `encode` calls of the gather (per thread)."""

    def __init__(self, monkeypatch):
        self.calls, self.lock = {}, threading.Lock()
        original = gather_mod.encode

        def counting(*args, **kwargs):
            with self.lock:
                key = threading.current_thread().name
                self.calls[key] = self.calls.get(key, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(gather_mod, "encode", counting)


@pytest.mark.parametrize("options", [{}, {"reshard_after_forward": False}, {"prefetch": 0}],
                         ids=["reshard", "no-reshard", "no-prefetch"])
def test_encoded_once_per_step(monkeypatch, options):
    counter = Encodes(monkeypatch)
    mesh = sf.local_mesh({"data": 2})
    params = make_params()
    step = sf.shard(loss_fn, mesh, mixed_precision=sf.MixedPrecision(all_gather_dtype="int8", block_size=BLOCK),
                    **options)

    def body():
        shards = step.shard_params(params)
        state = step._state(step._plan_for(shards))
        dropped = []
        for _ in range(3):
            torch.func.grad(step)(shards, batch_of(mesh.rank))
            dropped.append(all(u.encoded is None for u in state.units))  # released when the step ended
        return dropped, sum(1 for u in state.units if u.plan.sharded), step.stats(), state.plan

    out = mesh.run(body)
    assert out[0][0] == out[1][0] == [True] * 3
    units, stats, plan = out[0][1:]
    wire = _quant.Wire.of("int8", BLOCK)
    assert stats["all_gather_bytes"] == expected_gather_bytes(plan, wire, reshard=options.get("reshard_after_forward", True))
    assert units == 4  # three layers and the root
    assert sorted(counter.calls.values()) == [3 * units, 3 * units]


def test_accumulate_encodes_once_and_matches_one_big_batch(monkeypatch):
    counter = Encodes(monkeypatch)
    mesh = sf.local_mesh({"data": 2})
    params = make_params()
    step = sf.shard(loss_fn, mesh, mixed_precision=sf.MixedPrecision(all_gather_dtype="int8", block_size=BLOCK))

    def body():
        shards = step.shard_params(params)
        micro = [batch_of(mesh.rank + 10 * i) for i in range(3)]
        grads, loss = step.accumulate(shards, micro)
        calls = counter.calls[threading.current_thread().name]  # this rank's, before its next step
        big, big_loss = torch.func.grad_and_value(step)(shards, torch.cat(micro))  # equal sizes: the same mean
        return grads, loss, big, big_loss, calls

    for grads, loss, big, big_loss, calls in mesh.run(body):
        assert calls == 4  # once per unit for all three micro-batches
        sf.testing.assert_trees_allclose(grads, big, rtol=1e-5, atol=1e-7)
        assert float(loss) == pytest.approx(float(big_loss), rel=1e-6)


def test_param_dtype_bf16_with_int8_gather():
    mesh = sf.local_mesh({"data": 2})
    step, params, results, seen = run_step(mesh, "int8", mp={"param_dtype": torch.bfloat16})
    ref = reference(results[0][5], params, _quant.Wire.of("int8", BLOCK), compute=torch.bfloat16)
    for leaves in seen.values():
        for path, full in ref.items():
            assert leaves[path].dtype == torch.bfloat16 and torch.equal(leaves[path], full)
    # int8 rows of fp32 masters: a quarter of fp32's bytes plus scales, half of bf16's
    for _, _, stats, sent, *_ in results:
        assert stats["all_gather_bytes"] == sent["all_gather_bytes"] == expected_gather_bytes(
            results[0][5], _quant.Wire.of("int8", BLOCK))


def test_hsdp_and_hpz_gather_the_same_values():
    wire = _quant.Wire.of("int8", BLOCK)
    axes = ("node", "gpu")
    mesh = sf.local_mesh({"node": 2, "gpu": 2})
    base = run_step(mesh, "int8", options=dict(data_axes=axes, shard_axes=axes))
    hpz = run_step(mesh, "int8", options=dict(data_axes=axes, shard_axes=axes, reshard_after_forward="gpu"))
    hsdp = run_step(mesh, "int8", options=dict(data_axes=axes, shard_axes="gpu"))
    for step, params, results, seen in (base, hpz, hsdp):
        ref = reference(results[0][5], params, wire)
        for leaves in seen.values():
            assert all(torch.equal(leaves[p], full) for p, full in ref.items())
        for _, _, stats, sent, *_ in results:
            assert stats["all_gather_bytes"] == sent["all_gather_bytes"] == expected_gather_bytes(
                results[0][5], wire)
    for (l0, g0, *_), (l1, g1, *_) in zip(base[2], hpz[2]):  # hpZ re-gathers the kept encoded rows: same values
        assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(g0), optree.tree_leaves(g1)))
    # hpZ keeps, between a unit's forward and its backward, its k / M encoded rows (not decoded values)
    step = sf.shard(loss_fn, mesh, data_axes=axes, shard_axes=axes, reshard_after_forward="gpu",
                    mixed_precision=sf.MixedPrecision(all_gather_dtype="int8", block_size=BLOCK))

    def kept_rows():
        shards = step.shard_params(make_params())
        step(shards, batch_of(mesh.rank))
        state = step._state(step._plan_for(shards))
        return [(u.kept.dtype, tuple(u.kept.shape), u.row_bytes) for u in state.units if u.kept is not None]

    for kept in mesh.run(kept_rows):
        assert len(kept) == 3 and kept == [(torch.uint8, (2, row), row) for *_, row in kept]


def test_frozen_leaves_and_unshard_params_are_exact():
    mesh = sf.local_mesh({"data": 2})
    wire = _quant.Wire.of(torch.float8_e4m3fn, BLOCK)
    step, params, results, seen = run_step(mesh, torch.float8_e4m3fn, options=dict(frozen=lambda path: path[-1] == "b"))
    ref = reference(results[0][5], params, wire)
    for leaves in seen.values():
        assert all(torch.equal(leaves[p], full) for p, full in ref.items())
    for _, grads, *_ in results:
        assert all(float(layer["b"].abs().max()) == 0 for layer in grads["layers"])
    full = mesh.run(lambda: step.unshard_params(results[mesh.rank][4]))
    for tree in full:  # the export is never quantized
        assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(tree), optree.tree_leaves(params)))


def test_vmap_ensemble_equals_each_member():
    mesh = sf.local_mesh({"data": 2})
    members = [make_params(seed) for seed in range(3)]
    step = sf.shard(loss_fn, mesh, mixed_precision=sf.MixedPrecision(all_gather_dtype="int8", block_size=BLOCK))

    def body():
        shards = [step.shard_params(p) for p in members]
        stacked = optree.tree_map(lambda *xs: torch.stack(xs), *shards)
        x = batch_of(mesh.rank)
        with traffic.sent() as rec:
            grads, losses = torch.func.vmap(torch.func.grad_and_value(step), in_dims=(0, None))(stacked, x)
        sent = traffic.totals(rec.records)["all_gather_bytes"]
        each = [torch.func.grad_and_value(step)(s, x) for s in shards]
        return grads, losses, each, sent, step._plan_for(shards[0])

    wire = _quant.Wire.of("int8", BLOCK)
    for grads, losses, each, sent, plan in mesh.run(body):
        for b, (g, loss) in enumerate(each):
            assert float(losses[b]) == pytest.approx(float(loss), rel=1e-6)
            sf.testing.assert_trees_allclose(optree.tree_map(lambda t: t[b], grads), g, rtol=1e-5, atol=1e-7)
        # one (B, nbytes(S, segments)) all-gather per unit: B encoded rows per rank
        assert sent == sum(3 * u.k * _quant.nbytes(u.shard_numel, wire, segments=leaf_segments(u))
                           for u in plan.units if u.sharded)


def test_nan_in_params_names_the_unit_and_leaf():
    mesh = sf.local_mesh({"data": 2})
    params = make_params()
    params["layers"][1]["w"][0, 0] = float("nan")  # on rank 0's chunk
    params["layers"][1]["w"][6, 1] = float("inf")  # on rank 1's
    step = sf.shard(loss_fn, mesh, mixed_precision=sf.MixedPrecision(all_gather_dtype="int8"))

    def body():
        shards = step.shard_params(params)
        step(shards, batch_of(mesh.rank))

    with pytest.raises(sf.NonFiniteError, match=r"(?s)unit \('layers', 1\).*params\['layers'\]\[1\]\['w'\].*"
                                               r"NaN or infinite.*all_gather_dtype=None"):
        mesh.run(body)


def test_estimate_reports_the_compressed_traffic_and_the_encoded_buffers():
    mp = sf.MixedPrecision(all_gather_dtype="int8", block_size=BLOCK)
    params = make_params()
    est = sf.estimate(loss_fn, params, torch.Size([4, 5]), {"data": 2}, mixed_precision=mp)
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(loss_fn, mesh, mixed_precision=mp)

    def body():
        shards = step.shard_params(params)
        step(shards, batch_of(mesh.rank))
        step.grad_and_value(shards, batch_of(mesh.rank))
        return step.stats(), step._plan_for(shards)

    stats, plan = mesh.run(body)[0]
    wire = _quant.Wire.of("int8", BLOCK)
    assert est.all_gather_bytes == stats["all_gather_bytes"] == expected_gather_bytes(plan, wire)
    assert est.peak_gathered_bytes == stats["peak_gathered_bytes"]
    rows = {u.key: _quant.nbytes(u.shard_numel, wire, segments=leaf_segments(u)) for u in plan.units if u.sharded}
    # every layer's encoded row is kept until its backward; the root (embed and head, not resharded) is
    # gathered once, and its row is released before the first layer's is made
    assert est.encoded_send_bytes == sum(v for key, v in rows.items() if key != "<root>")
    assert "encoded all-gather send buffers" in str(est)


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.multiprocess
def test_int8_gather_on_processes_equals_the_simulated_mesh():
    params = make_params()

    def body(mesh):
        step = sf.shard(loss_fn, mesh, mixed_precision=sf.MixedPrecision(all_gather_dtype="int8", block_size=BLOCK))
        shards = step.shard_params(params)
        with traffic.sent() as rec:
            grads, loss = step.grad_and_value(shards, batch_of(mesh.rank))
        return float(loss), step.unshard_params(grads), step.stats(), traffic.totals(rec.records)

    on_processes = run_on_mesh(body, {"data": 2}, "distributed")
    simulated = run_on_mesh(body, {"data": 2}, "simulated")
    for (l0, g0, s0, r0), (l1, g1, s1, r1) in zip(on_processes, simulated):
        assert l0 == l1 and s0 == s1 and r0 == r1 == traffic.stats_view(s0)
        assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(g0), optree.tree_leaves(g1)))


def test_peak_gathered_bytes_counts_encoded_rows_and_uint8_output():
    mesh = sf.local_mesh({"data": 2})
    params = {"layers": [{"w": torch.randn(64, 64)} for _ in range(2)]}
    options = dict(prefetch=0, mixed_precision=sf.MixedPrecision(all_gather_dtype="int8"))
    step = sf.shard(lambda p, x: sum((x @ l["w"]).square().mean() for l in p["layers"]), mesh, **options)

    def body():
        shards = step.shard_params(params)
        torch.func.grad(step)(shards, torch.randn(4, 64))
        return step.stats()

    full, row = 64 * 64 * 4, _quant.nbytes(32 * 64, _quant.Wire.of("int8"))
    assert row == 2056
    # unit 1's forward gather: both units' encoded rows (unit 0's is kept for its backward), unit 1's
    # (k, row) uint8 all-gather output, and its unsharded fp32 buffer (unit 0's was released)
    for stats in mesh.run(body):
        assert stats["peak_gathered_bytes"] == 2 * row + 2 * row + full
        assert stats["all_gather_bytes"] == 2 * 2 * (2 * row)
    est = sf.estimate(lambda p, x: sum((x @ l["w"]).square().mean() for l in p["layers"]), params,
                      torch.Size([4, 64]), {"data": 2}, **options)
    assert est.peak_gathered_bytes == 4 * row + full and est.encoded_send_bytes == 2 * row
