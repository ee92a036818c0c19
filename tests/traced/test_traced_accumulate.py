"""sf.jit(step, opt, accumulate=mode): eager `step.accumulate` + the update in one graph
([Note: accumulation in the graph] in shardfn/_traced/step.py), bit for bit with eager
under aot_eager, both modes, with the composition matrix's options."""

import pytest
import torch

import composition_cases as cases
import shardfn as sf
from shardfn.testing import run_multiprocess

TIMEOUT = 300
MICRO = 2


def _versus_eager(option: str, mode: str, steps: int = 2):
    setup = cases.SETUPS[option]
    mesh = sf.init_mesh(dict(setup.mesh_shape), timeout=60)
    step = sf.shard(cases.make_loss(remat=setup.remat), mesh, **setup.shard_kwargs)
    index, size = cases.data_rank(mesh, setup)
    parts, _ = cases.global_batch(setup, size)
    x, y = parts[index]
    micro = list(zip(x.chunk(MICRO), y.chunk(MICRO)))
    opt = sf.optim.adamw(1e-2)
    shards = step.shard_params(cases.mlp_params())
    state = opt.init(shards)
    eager = [shards, state]
    out = {"losses": [], "eager_losses": []}
    try:
        train = sf.jit(step, opt, backend="aot_eager", accumulate=mode)
        for _ in range(steps):
            shards, state, loss = train(shards, state, micro)
            out["losses"].append(float(loss))
            out["eager_losses"].append(_eager_step(step, opt, micro, mode, eager))
    except sf.SpecError as e:
        return {"refused": str(e)}
    flat = sf._tree.flatten
    out["equal"] = all(torch.equal(a, b) for a, b in zip(flat((shards, state))[0], flat(tuple(eager))[0]))
    out["bytes"] = train.stats()["reduce_scatter_bytes"]
    return out


def _eager_step(step, opt, micro, mode, eager: list) -> float:
    """The reference: step.accumulate then the update, in place in `eager` = [shards, state]."""
    grads, loss = step.accumulate(eager[0], micro, mode=mode)
    with torch.no_grad():
        updates, eager[1] = opt.update(grads, eager[1], eager[0])
        eager[0] = sf.optim.apply_updates(eager[0], updates)
    return float(loss)


CASES = [("none", "reduce_each"), ("none", "reduce_once"), ("hsdp", "reduce_once"), ("frozen", "reduce_each"),
         ("wire_int8", "reduce_each"), ("hpz", "reduce_once"), ("low_precision", "reduce_each")]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("option, mode", CASES)
def test_jit_accumulate_equals_eager_accumulate_bit_for_bit(option, mode):
    world = 2 if len(cases.SETUPS[option].mesh_shape) == 1 else 4
    for out in run_multiprocess(_versus_eager, world, option, mode, timeout=TIMEOUT):
        assert "refused" not in out, out["refused"]
        assert out["losses"] == out["eager_losses"]
        assert out["equal"]


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.multiprocess
def test_jit_accumulate_reduce_once_scatters_once_per_unit():
    each, once = (run_multiprocess(_versus_eager, 2, "none", mode, 1, timeout=TIMEOUT)[0]
                  for mode in ("reduce_each", "reduce_once"))
    assert each["equal"] and once["equal"]
    assert each["bytes"] == MICRO * once["bytes"]  # one reduce-scatter per micro-batch, or one per step


@pytest.mark.slow
@pytest.mark.multiprocess
def test_jit_accumulate_refusals_name_the_reason():
    out = run_multiprocess(_versus_eager, 2, "check_finite", "reduce_each", timeout=TIMEOUT)[0]
    assert "sf.jit(accumulate='reduce_each') with check_finite=True" in out["refused"]
    out = run_multiprocess(_versus_eager, 2, "low_precision", "reduce_once", timeout=TIMEOUT)[0]
    assert "mode 'reduce_once' with a reduce dtype or wire format of its own" in out["refused"]
    out = run_multiprocess(_versus_eager, 2, "remat", "reduce_each", timeout=TIMEOUT)[0]
    assert "sf.jit(accumulate='reduce_each') with sf.remat in loss_fn" in out["refused"]
