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
from shardfn.testing.models import GPT, GPTConfig

TOLERANCE = 0.10


def _nbytes(tree) -> int:
    return sum(x.numel() * x.element_size() for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor))


def _allocations(prof) -> list[tuple[int, int]]:
    """(time ns, signed bytes) of every allocation and free the profiler saw, in time order."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return sorted((e.start_ns(), e.nbytes()) for e in events)


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
        for t, nbytes in _allocations(prof):
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
    # gloo on CPU copies a collective through a buffer of its own: the simulated mesh's share
    peak = est.peak_step_bytes + est.scratch_bytes
    total = est.total + est.scratch_bytes
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
