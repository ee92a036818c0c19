"""`sf.measure_memory`: peak and net bytes of a block, per calling thread on the CPU."""

from __future__ import annotations

import threading

import pytest
import torch

import shardfn as sf

MiB = 2 ** 20


def test_peak_and_net_are_relative_to_the_start():
    before = torch.empty(MiB)  # allocated before the block: not counted
    with sf.measure_memory("cpu") as m:
        kept = torch.empty(MiB // 4)  # 1 MiB (fp32), kept
        tmp = torch.empty(MiB // 2)  # 2 MiB, freed
        del tmp, before  # 4 MiB freed that the block did not allocate: the CPU profiler does not see it
    assert m.device == torch.device("cpu")
    assert m.peak_bytes == 3 * MiB
    assert m.net_bytes == 1 * MiB
    assert kept.numel() == MiB // 4


def test_the_report_is_filled_when_the_block_raises_and_the_next_measurement_runs():
    with pytest.raises(ValueError, match="inside"):
        with sf.measure_memory("cpu") as m:
            x = torch.empty(MiB // 4)
            raise ValueError("inside")
    assert m.peak_bytes == MiB and x.numel() == MiB // 4
    with sf.measure_memory("cpu") as again:
        torch.empty(MiB // 8)
    assert again.peak_bytes == MiB // 2 and again.net_bytes == 0


def test_a_rank_thread_measures_itself_on_the_simulated_mesh():
    mesh = sf.local_mesh({"data": 2})

    def body():
        if mesh.rank == 0:
            with sf.measure_memory("cpu") as m:
                mine = torch.empty(MiB // 4)  # 1 MiB
                mesh.all_reduce(torch.ones(1))  # rank 1 holds its 16 MiB across this collective
                del mine
            return m.peak_bytes
        theirs = torch.empty(4 * MiB)  # 16 MiB in rank 1's thread
        mesh.all_reduce(torch.ones(1))
        del theirs
        return None

    peak = mesh.run(body)[0]
    assert MiB <= peak < MiB + 64 * 1024  # rank 1's 16 MiB is not seen; the collective's few bytes are


def test_a_second_measurement_from_another_thread_is_refused():
    entered, tried, errors = threading.Event(), threading.Event(), []

    def first():
        with sf.measure_memory("cpu"):
            entered.set()
            tried.wait(30)

    def second():
        entered.wait(30)
        try:
            with sf.measure_memory("cpu"):
                pass
        except sf.ShardingError as e:
            errors.append(str(e))
        finally:
            tried.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errors) == 1
    assert "sf.measure_memory: another thread of this process is already measuring cpu memory" in errors[0]
    assert "Fix: measure one thread at a time" in errors[0]


def test_a_shard_step_measured_against_its_estimate():
    def loss_fn(p, x):
        for layer in p["layers"]:
            x = torch.tanh(x @ layer["w"])
        return x.square().mean()

    params = {"layers": [{"w": torch.randn(256, 256) / 16} for _ in range(4)]}
    est = sf.estimate(loss_fn, params, torch.Size([512, 256]), 2)
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(loss_fn, mesh)

    def body():
        shards = step.shard_params(params)
        x = torch.randn(512, 256, generator=torch.Generator().manual_seed(mesh.rank))
        step(shards, x)  # learn the prefetch order, as the dry run does
        if mesh.rank != 0:
            step.grad_and_value(shards, x)
            return None
        with sf.measure_memory("cpu") as m:
            step.grad_and_value(shards, x)
        return m.peak_bytes

    peak = mesh.run(body)[0]
    assert abs(est.peak_step_bytes / peak - 1) <= 0.10, (est.peak_step_bytes, peak)


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
def test_accelerator_counters():
    device = torch.accelerator.current_accelerator()
    with sf.measure_memory() as m:
        x = torch.empty(MiB, device=device)  # 4 MiB
        y = torch.empty(2 * MiB, device=device)  # 8 MiB, freed
        del y
    assert m.device.type == device.type
    assert m.peak_bytes >= 12 * MiB and m.net_bytes == x.numel() * 4
