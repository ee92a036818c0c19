"""`sf.estimate`, component by component, against the schedule written out from the shapes.

`tests/estimate/test_estimate.py` compares the dry run with the real step (exact where both read
the same bookkeeping, 10% on the profiler's peak), which let a dropped optimizer state
and a dropped gathered-buffer term pass. Here each component is computed in the test from
the parameter shapes alone, with the formulas of docs/design/memory.md and
docs/fsdp_design.md, and asserted exactly:

- shards and gradients: per leaf, rank 0's `torch.chunk` rows (the largest chunk);
- optimizer state per kind: none (sgd), one buffer (sgd with momentum, lion + its int64
  count), two (adam, adamw + the count);
- gathered buffers at their peak: the root unit stays gathered through the forward; then
  either one block copying out of its all-gather output (two copies of it) or one block
  computing and `prefetch` blocks in flight, each with its send buffer (a block of
  several leaves sends an (S,) buffer: no new bytes in fp32, where the shards are views of
  it, a packed copy in param_dtype otherwise); without resharding, every unit plus the last
  one's all-gather output;
- traffic: non-root units gathered twice with resharding (the root once), every unit
  reduce-scattered once, the loss all-reduced (32 bytes), HSDP's cross-replica
  all-reduce of each unit's gradient shard; padded to k * ceil(rows / k) rows, in
  param_dtype / reduce_dtype;
- the step's peak holds at least the gathered peak plus gloo's copy of the block in flight
  ([Note: meta tensors]); where it falls in a block's reduce-scatter (fp32, prefetch=1,
  even chunks), it is that plus the block's gradient in its three forms, within 16 KiB
  (the activations of a one-row batch); `total` is shards + optimizer state + the step's peak.
"""

from __future__ import annotations

import math

import pytest
import torch

import shardfn as sf

D, L, B = 256, 3, 1  # blocks of a (256, 256) weight and a (256,) bias; one row of batch: tiny activations


def _params(d=D, layers=L):
    return {"embed": torch.Size([d, d]), "layers": [{"w": torch.Size([d, d]), "b": torch.Size([d])}
                                                    for _ in range(layers)], "head": torch.Size([d, 4])}


def _loss_fn(p, x):
    x = x @ p["embed"]
    for layer in p["layers"]:
        x = torch.tanh(x @ layer["w"] + layer["b"])
    return (x @ p["head"]).square().mean()


# -- the schedule, from the shapes ------------------------------------------------------------


def _rows(shape):
    return shape[0], math.prod(shape[1:])  # dim-0 rows, elements per row


def _shard_numel(shapes, k):
    """Elements of rank 0's shard of these leaves (the largest): ceil(rows / k) rows each."""
    return sum(math.ceil(r / k) * per for r, per in map(_rows, shapes))


class Schedule:
    """What the memory model says one rank holds and moves, for `_params` on a shard group
    of `k` ranks (and `replicas` HSDP replicas)."""

    def __init__(self, k, *, prefetch=1, reshard=True, param_bytes=4, reduce_bytes=4, replicas=1, d=D, layers=L):
        p = _params(d, layers)
        root = [p["embed"], p["head"]]
        block = [p["layers"][0]["w"], p["layers"][0]["b"]]
        self.k, self.replicas = k, replicas
        self.shards = 4 * (_shard_numel(root, k) + layers * _shard_numel(block, k))  # fp32 master shards
        self.root = k * _shard_numel(root, k) * param_bytes  # padded unsharded buffers, in param_dtype
        self.unit = k * _shard_numel(block, k) * param_bytes
        # a block of two leaves sends its (S,) shard buffer: the buffer its fp32 shards are views
        # of ([Note: shards in one buffer]: no new bytes), or a packed copy cast to param_dtype
        self.send = 0 if param_bytes == 4 else _shard_numel(block, k) * param_bytes
        self.gathered = self.root + layers * self.unit
        if reshard:
            self.peak_gathered = self.root + max(2 * self.unit, (prefetch + 1) * self.unit + prefetch * self.send)
            self.all_gather = self.root + 2 * layers * self.unit
            gathers = 1 + 2 * layers
        else:
            self.peak_gathered = self.gathered + self.unit  # all units, and the last one's output before copy-out
            self.all_gather = self.gathered
            gathers = 1 + layers
        self.reduce_scatter = (self.root + layers * self.unit) // param_bytes * reduce_bytes
        shard_grads = (_shard_numel(root, k) + layers * _shard_numel(block, k)) * reduce_bytes
        self.all_reduce = 32 + (shard_grads if replicas > 1 else 0)  # the loss; HSDP: each unit's grad shard
        self.num_collectives = gathers + (1 + layers) + 1 + ((1 + layers) if replicas > 1 else 0)
        self.scratch = max(self.root, self.unit) * max(1, reduce_bytes // param_bytes)
        self.in_flight = self.unit if reshard and prefetch else 0  # gloo's copy of a prefetched block


OPTIMIZERS = {  # name -> (optimizer, state bytes as a function of the shard bytes)
    "none": (None, lambda s: 0),
    "sgd": (sf.optim.sgd(0.1), lambda s: 0),
    "sgd-momentum": (sf.optim.sgd(0.1, momentum=0.9), lambda s: s),
    "adam": (sf.optim.adam(1e-3), lambda s: 2 * s + 8),
    "adamw": (sf.optim.adamw(1e-3), lambda s: 2 * s + 8),
    "lion": (sf.optim.lion(1e-4), lambda s: s + 8),
}

BF16 = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
SETUPS = {  # name -> (mesh shape, shard options, Schedule arguments)
    "fsdp2": ({"data": 2}, {}, dict(k=2)),
    "fsdp4": ({"data": 4}, {}, dict(k=4)),
    "uneven3": ({"data": 3}, {}, dict(k=3)),  # 256 rows over 3: 86, 86, 84; padded to 258
    "prefetch0": ({"data": 2}, dict(prefetch=0), dict(k=2, prefetch=0)),
    "prefetch2": ({"data": 2}, dict(prefetch=2), dict(k=2, prefetch=2)),
    "no-reshard": ({"data": 2}, dict(reshard_after_forward=False), dict(k=2, reshard=False)),
    "no-reshard4": ({"data": 4}, dict(reshard_after_forward=False), dict(k=4, reshard=False)),
    "bf16": ({"data": 2}, dict(mixed_precision=BF16), dict(k=2, param_bytes=2)),
    "hsdp2x2": ({"replica": 2, "shard": 2}, dict(data_axes=("replica", "shard"), shard_axes="shard"),
                dict(k=2, replicas=2)),
}


# fp32, prefetch=1, resharding, even chunks: the step peaks in a block's reduce-scatter (the
# activations of one row and the root's small head gradient aside); the other setups peak
# elsewhere (padding copies, casts, no prefetch, everything gathered) and get the lower bound
STEP_PEAK_AT_A_REDUCE_SCATTER = ("fsdp2", "fsdp4", "hsdp2x2")


def _estimate(setup, optimizer=None, **kwargs):
    shape, options, _ = SETUPS[setup]
    return sf.estimate(_loss_fn, _params(), torch.Size([B, D]), shape, optimizer=optimizer, **options, **kwargs)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_each_component_is_the_schedules(setup):
    est = _estimate(setup, optimizer=sf.optim.adamw(1e-3))
    s = Schedule(**SETUPS[setup][2])
    got = {k: getattr(est, k) for k in ("param_bytes", "grad_bytes", "opt_state_bytes", "peak_gathered_bytes",
                                        "all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes",
                                        "num_collectives", "scratch_bytes")}
    want = dict(param_bytes=s.shards, grad_bytes=s.shards, opt_state_bytes=2 * s.shards + 8,
                peak_gathered_bytes=s.peak_gathered, all_gather_bytes=s.all_gather,
                reduce_scatter_bytes=s.reduce_scatter, all_reduce_bytes=s.all_reduce,
                num_collectives=s.num_collectives, scratch_bytes=s.scratch)
    assert got == want, {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert est.total == est.param_bytes + est.opt_state_bytes + est.peak_step_bytes
    # at the gathered peak the step holds those buffers, and gloo's copy of the block in flight
    assert est.peak_step_bytes >= s.peak_gathered + s.in_flight, (est.peak_step_bytes, s.peak_gathered, s.in_flight)
    if setup in STEP_PEAK_AT_A_REDUCE_SCATTER:
        # a block's reduce-scatter with the previous block prefetched: the gathered peak (the
        # root, this block, the next one's output and send buffer), gloo's copy of that gather,
        # and this block's gradient three times: unsharded (w, b), packed (k, S), reduced (S,)
        unsharded = (D * D + D) * 4
        # (HSDP: and the reduced shard's all-reduce over the replicas, a second (S,))
        reduced = _shard_numel([(D, D), (D,)], s.k) * 4
        low = s.peak_gathered + s.in_flight + unsharded + s.unit + reduced * (2 if s.replicas > 1 else 1)
        assert low <= est.peak_step_bytes <= low + 16 * 1024, (est.peak_step_bytes, low)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_optimizer_state_per_kind(kind):
    optimizer, state = OPTIMIZERS[kind]
    s = Schedule(k=4)
    est = _estimate("fsdp4", optimizer=optimizer)
    assert est.opt_state_bytes == state(s.shards)
    assert est.total == s.shards + state(s.shards) + est.peak_step_bytes
    assert "optimizer state" in str(est) and sf._estimate.format_bytes(state(s.shards)) in str(est)


@pytest.mark.parametrize("k", [2, 4])
def test_the_step_peak_holds_every_gathered_buffer_when_they_dominate(k):
    """Eight blocks kept gathered (reshard_after_forward=False): the gathered buffers are
    most of the step's peak, which must hold all of them, the shard gradients (the step
    returns them) and the last block's copy-out at once, activations (one row) aside."""
    shape = {"data": k}
    est = sf.estimate(_loss_fn, _params(layers=8), torch.Size([B, D]), shape, reshard_after_forward=False)
    s = Schedule(k, reshard=False, layers=8)
    assert est.peak_gathered_bytes == s.peak_gathered
    assert est.peak_step_bytes >= s.peak_gathered
    # upper bound: the gathered peak, every gradient shard, one block's unsharded gradient and
    # its packed copy, and the activations of one row (a few KiB)
    assert est.peak_step_bytes <= s.peak_gathered + s.shards + 2 * s.unit + 64 * 1024


def test_the_prefetched_blocks_gloo_copy_is_in_the_step_peak():
    """The forward's gathered peak with two blocks in flight: the root, the block
    computing, two gathering (output + send buffer each) and gloo's copy of each."""
    s = Schedule(k=2, prefetch=2, layers=6)
    est = sf.estimate(_loss_fn, _params(layers=6), torch.Size([B, D]), {"data": 2}, prefetch=2)
    assert est.peak_gathered_bytes == s.peak_gathered
    assert est.peak_step_bytes >= s.peak_gathered + 2 * s.unit
