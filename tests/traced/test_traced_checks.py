"""sf.jit with `check_finite=True` and `batch_weighting="global_mean"`: the failure paths.

The equal-to-eager cells (finite steps, uneven batches) are the composition matrix's
(tests/fsdp/test_composition.py, `jit` on processes). Here: a NaN on one rank raises eager's
NonFiniteError on every rank, naming the loss or the unit and the rank, and leaves the
shards and optimizer state as they were, donated (`inplace=True`) or not; a global_mean
step whose batch size is unknown on one rank fails on every rank.
"""

import pytest
import torch

import composition_cases as cases
import shardfn as sf
from shardfn.testing import run_multiprocess

TIMEOUT = 240


def _loss_with_a_nan_gradient(base):
    """base + sqrt(c * s^2), s the head's sum: finite for c = 0 and 1, and for c = 0 its
    gradient is 0/0 = NaN (a finite loss whose gradient is not)."""

    def loss_fn(params, batch):
        x, y, c = batch
        return base(params, (x, y)) + torch.sqrt(c * params["head"].sum() ** 2)

    return loss_fn


def _nan_step(where: str, inplace: bool):
    mesh = sf.init_mesh({"data": 2}, timeout=60)
    step = sf.shard(_loss_with_a_nan_gradient(cases.make_loss()), mesh, check_finite=True)
    parts, _ = cases.global_batch(cases.SETUPS["check_finite"], 2)
    x, y = parts[mesh.coords["data"]]
    c = torch.ones((), dtype=x.dtype)
    opt = sf.optim.adamw(1e-2)
    shards = step.shard_params(cases.mlp_params())
    state = opt.init(shards)
    train = sf.jit(step, opt, backend="aot_eager", inplace=inplace)
    shards, state, _ = train(shards, state, (x, y, c))  # a finite step first: the graph is built
    before = [t.clone() for t in sf._tree.flatten((shards, state))[0]]
    if mesh.coords["data"] == 1:
        if where == "loss":
            y = y.clone()
            y[0, 0] = float("nan")
        else:
            c = torch.zeros((), dtype=x.dtype)
    out = {"error": None, "eager_error": None}
    try:
        train(shards, state, (x, y, c))
    except sf.NonFiniteError as e:
        after = sf._tree.flatten((shards, state))[0]
        out.update(error=str(e), unchanged=all(torch.equal(a, b) for a, b in zip(before, after)))
    try:
        sf.train_step(step, opt)(shards, state, (x, y, c))
    except sf.NonFiniteError as e:
        out["eager_error"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.multiprocess
def test_jit_check_finite_raises_eagers_error_on_every_rank_and_updates_nothing():
    for rank, out in enumerate(run_multiprocess(_nan_step, 2, "loss", True, timeout=TIMEOUT)):
        assert out["error"] is not None, f"rank {rank}: no NonFiniteError"
        assert out["error"].startswith("shard(check_finite=True): the loss is NaN or infinite on ranks [1] "
                                       f"(this is rank {rank}). The step stopped before returning, so no "
                                       "parameter update was applied.")
        assert out["unchanged"]  # inplace=True: the graph wrote where(all finite, new, old)
        assert out["error"] == out["eager_error"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_jit_check_finite_names_the_unit_whose_gradient_is_not_finite():
    for out in run_multiprocess(_nan_step, 2, "gradient", False, timeout=TIMEOUT):
        assert out["error"] is not None
        # the first flag in eager's order: the loss is finite, then units in backward order
        assert out["error"].startswith("shard(check_finite=True): the gradient of "), out["error"]
        assert out["unchanged"]
        assert out["error"] == out["eager_error"]  # the same unit and ranks as the eager step names


def _unknown_size():
    mesh = sf.init_mesh({"data": 2}, timeout=60)
    base = cases.make_loss()
    step = sf.shard(lambda p, b: base(p, b[:2]), mesh, batch_weighting="global_mean")
    parts, _ = cases.global_batch(cases.SETUPS["global_mean"], 2)
    x, y = parts[mesh.coords["data"]]
    # rank 1's third leaf has another leading dim than (x, y): its batch size is unknown
    tag = torch.zeros(x.shape[0] + mesh.coords["data"])
    opt = sf.optim.sgd(0.1)
    shards = step.shard_params(cases.mlp_params())
    try:
        sf.jit(step, opt, backend="aot_eager")(shards, opt.init(shards), (x, y, tag))
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_jit_global_mean_with_an_unknown_batch_size_fails_on_every_rank():
    for message in run_multiprocess(_unknown_size, 2, timeout=TIMEOUT):
        assert message is not None and "batch_weighting='global_mean' needs every rank's batch size" in message
