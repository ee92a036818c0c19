"""sf.jit on a transformers model it cannot trace as one graph: a clear ShardingError, not
dynamo's own exception (found by the families table, tests/hf/hf_families.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hf import hf_families as H  # noqa: E402


def _jit_eager_experts():
    import torch

    import shardfn as sf

    torch._dynamo.reset()
    mesh = sf.init_mesh({"data": 2}, timeout=300)
    model = H.build("qwen3_moe", torch.float64)  # experts_implementation="eager": a loop over the routed experts
    apply_fn, params = sf.functional(model)
    local = {k: v.chunk(2)[mesh.rank] for k, v in H.batch("qwen3_moe").items()}
    step = sf.shard(lambda p, b: H.forward_loss("qwen3_moe", lambda **kw: apply_fn(p, **kw), b), mesh)
    opt = sf.optim.adamw(1e-3)
    shards = step.shard_params(params)
    train = sf.jit(step, opt, backend="aot_eager")
    try:
        train(shards, opt.init(shards), local)
    except sf.ShardingError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_moe_loop_over_routed_experts_is_a_sharding_error():
    from shardfn.testing import run_multiprocess

    for out in run_multiprocess(_jit_eager_experts, 2, timeout=300.0):
        assert out is not None, "sf.jit traced a data-dependent expert loop"
        kind, message = out
        assert message.startswith("sf.jit: the train step cannot be traced as one graph: "), message
        assert "Fix: rewrite that part of loss_fn or the schedule, or train eagerly with sf.train_step(step, opt)." \
            in message
