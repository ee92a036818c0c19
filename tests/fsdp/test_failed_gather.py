"""A unit whose gather fails after its all-gather finished (the copy-out raised) leaves the
step's own error to the user, not a second one from the clean-up, and the step runs again."""

import threading

import pytest
import torch

import shardfn as sf
from shardfn._fsdp import gather


def _loss(params, batch):
    x = batch
    for layer in params["layers"]:
        x = torch.tanh(x @ layer)
    return x.square().mean()


def test_a_failed_copy_out_raises_its_own_error_and_the_next_step_runs(monkeypatch):
    mesh = sf.local_mesh({"data": 2})
    # a wire format: the gathered rows are decoded by copy_out (a plain gather lands in place)
    step = sf.shard(_loss, mesh, mixed_precision=sf.MixedPrecision(all_gather_dtype=torch.bfloat16))
    params = {"layers": [torch.randn(4, 4, dtype=torch.float64) for _ in range(2)]}
    batch = torch.randn(3, 4, dtype=torch.float64)
    copy_out, calls = gather.copy_out, threading.local()

    def failing(*args, **kwargs):
        calls.n = getattr(calls, "n", 0) + 1
        if calls.n == 1:  # each rank's first copy-out (its all-gather has finished)
            raise RuntimeError("planted: copy-out failed")
        return copy_out(*args, **kwargs)

    def body():
        shards = step.shard_params(params)
        try:
            step(shards, batch)
        except RuntimeError as e:
            first = str(e)
        else:
            first = None
        return first, float(step(shards, batch))

    monkeypatch.setattr(gather, "copy_out", failing)
    reference = float(_loss(params, batch))
    for first, loss in mesh.run(body):
        assert first == "planted: copy-out failed"  # not "'NoneType' object has no attribute 'wait'"
        assert loss == pytest.approx(reference, rel=1e-2)  # bf16 on the wire
