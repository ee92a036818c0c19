"""sf.remat under sf.jit when the checkpointed blocks call collectives (tensor parallelism).

[Note: remat across a collective's backward]
The traced step is one forward-loss-backward graph; torch's pass that recomputes the
checkpointed forward (`remat_using_tags_for_fwd_loss_bwd_graph`) finds the backward as
the nodes tagged `autograd_backward` and recomputes into one contiguous run of them. The
nodes an autograd.Function's backward contributes (a psum's all-reduce in the backward of
a tensor-parallel block, GatherFlat's reduce-scatter) are not tagged in torch 2.13
(pytorch/pytorch#182416), so a block that psums splits the backward in two: "Detected N
disjoint backward regions that require recomputation". Those nodes read the gradient, so
they are backward nodes: when the pass refuses a graph for that reason, the untagged nodes
between the first and the last backward node that read a backward node are tagged and the
pass runs again. Graphs the pass takes are left as they are.
"""

from __future__ import annotations

import contextlib

import torch.fx

__all__ = ["remat_across_collectives", "close_backward_gaps"]


def close_backward_gaps(gm: torch.fx.GraphModule) -> int:
    """Tag as backward the untagged call nodes between the first and last backward node
    that read a backward node (in graph order, so chains of them are tagged too); returns
    how many were tagged."""
    nodes = list(gm.graph.nodes)
    marked = [i for i, n in enumerate(nodes) if n.meta.get("autograd_backward")]
    if not marked:
        return 0
    tagged = 0
    for node in nodes[marked[0]:marked[-1]]:
        if node.op == "call_function" and not node.meta.get("autograd_backward") and \
                any(i.meta.get("autograd_backward") for i in node.all_input_nodes):
            node.meta["autograd_backward"] = True
            tagged += 1
    return tagged


@contextlib.contextmanager
def remat_across_collectives():
    """While sf.jit compiles: torch's remat pass, retried once with the gaps closed when it
    finds disjoint backward regions ([Note: remat across a collective's backward])."""
    try:
        from torch._functorch._activation_checkpointing import remat_using_tags_for_fwd_loss_bwd_graph_pass as remat
    except ImportError:  # a torch without the pass
        yield
        return
    original = getattr(remat, "remat_using_tags_for_fwd_loss_bwd_graph", None)
    if original is None:
        yield
        return

    def run(gm):
        try:
            return original(gm)
        except RuntimeError as e:
            if "disjoint backward regions" not in str(e) or not close_backward_gaps(gm):
                raise
            return original(gm)

    remat.remat_using_tags_for_fwd_loss_bwd_graph = run
    try:
        yield
    finally:
        remat.remat_using_tags_for_fwd_loss_bwd_graph = original
