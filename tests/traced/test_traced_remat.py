"""sf.remat inside a loss traced by sf.jit ([Note: remat under sf.jit] in shardfn/_remat.py).

The values are the matrix's cell (tests/fsdp/test_composition.py: bit for bit with eager
`sf.train_step` under aot_eager). Here: the traced graph does recompute the block in the
backward (the block's ops appear twice), and a policy with no traced form is refused by
name.
"""

import collections

import pytest
import torch

import composition_cases as cases
import shardfn as sf
import shardfn._traced.step as traced_step
from shardfn.testing import run_multiprocess

TIMEOUT = 240


def _graph_ops(policy_name: str | None):
    """The block's ops in the graph sf.jit compiles (counted by the schedule pass's input)."""
    seen = []
    schedule = traced_step.schedule_units

    def spy(graph, *args, **kwargs):
        seen.append(collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function"))
        return schedule(graph, *args, **kwargs)

    traced_step.schedule_units = spy
    mesh = sf.init_mesh({"data": 2}, timeout=60)
    if policy_name is None:
        loss_fn = cases.make_loss(remat=False)
    else:
        policy = getattr(sf.remat_policies, policy_name)
        policy = policy("h") if policy_name == "save_only_these_names" else policy
        base = cases.make_loss(remat=False)

        def loss_fn(params, batch):
            x, y = batch
            for p in params["layers"]:
                x = sf.remat(lambda p, x: cases._block(p, x, tp=False), policy=policy)(p, x)
            return base({"layers": [], "head": params["head"]}, (x, y))

    step = sf.shard(loss_fn, mesh)
    parts, _ = cases.global_batch(cases.SETUPS["none"], 2)
    opt = sf.optim.sgd(0.1)
    shards = step.shard_params(cases.mlp_params())
    try:
        sf.jit(step, opt, backend="aot_eager")(shards, opt.init(shards), parts[mesh.coords["data"]])
    except (sf.SpecError, sf.ShardingError) as e:
        return str(e)
    return {k: v for k, v in seen[-1].items() if k in ("aten.tanh.default", "aten.mm.default")}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_remat_under_jit_recomputes_the_block_in_the_graph():
    plain, remat, dots = (run_multiprocess(_graph_ops, 2, p, timeout=TIMEOUT)[0]
                          for p in (None, "nothing_saveable", "dots_saveable"))
    blocks = cases.BLOCKS
    assert remat["aten.tanh.default"] == plain["aten.tanh.default"] + blocks  # each block's tanh, again
    assert remat["aten.mm.default"] > plain["aten.mm.default"]  # and its matmuls
    assert dots["aten.tanh.default"] == plain["aten.tanh.default"] + blocks  # matmuls saved, tanh recomputed


@pytest.mark.slow
@pytest.mark.multiprocess
def test_remat_policies_with_no_traced_form_are_refused_by_name():
    message = run_multiprocess(_graph_ops, 2, "save_only_these_names", timeout=TIMEOUT)[0]
    assert isinstance(message, str), message
    assert "has no traced form" in message and "Fix: policy=sf.remat_policies.nothing_saveable" in message
