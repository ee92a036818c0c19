"""shard_map called from the main thread of a simulated mesh: global values in and out.

The JAX-notebook experience: `f(x_global)` scatters `x_global` by `in_specs`, runs every
rank, and gathers each output by `out_specs`. It is one autograd.Function on the global
tensors: its forward runs the ranks with autograd recording in each rank thread, and its
backward runs each rank's backward (scattering the output cotangents, gathering the input
cotangents). Rank 0's global values are returned; every rank holds the same ones.
"""

from __future__ import annotations

import torch

from . import _tree
from ._blocks import gather_blocks, slice_block
from ._errors import ShardingError
from ._spec import PartitionSpec, as_spec, is_spec, validate_spec

__all__ = ["global_call"]


def _spec_leaves(specs, tree, what):
    return [as_spec(s, what) for s in _tree.broadcast_prefix(specs, tree, what=what, is_prefix_leaf=is_spec)]


class _Runner:
    """What the forward learned per rank, kept for the backward (a plain object:
    functorch rebuilds dicts passed through `Function.apply`)."""

    def __init__(self, local_fn, mesh, in_specs, out_specs, args, name):
        self.local_fn, self.mesh, self.out_specs, self.name = local_fn, mesh, out_specs, name
        self.paths, leaves, self.treedef = _tree.flatten_with_paths(args)
        self.leaves = list(leaves)
        self.in_leaf_specs = _spec_leaves(in_specs, args, "in_specs")
        self.tensor_idx = [i for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor)]
        for i in self.tensor_idx:
            validate_spec(
                self.in_leaf_specs[i], tuple(self.leaves[i].shape), mesh.shape,
                f"{name}: in_specs for argument {_tree.keystr(self.paths[i])}",
            )
        self.saved: dict[int, tuple] = {}
        self.out_treedef = None
        self.out_leaf_specs: list[PartitionSpec] = []
        self.global_leaves: list = []

    def forward(self, tensors, record: bool):
        def body():
            rank = self.mesh.rank
            leaves = list(self.leaves)
            locals_ = []
            for i, t in zip(self.tensor_idx, tensors):
                block = slice_block(t.detach(), self.in_leaf_specs[i], self.mesh).clone()
                if record and block.is_floating_point():
                    block.requires_grad_(True)
                leaves[i] = block
                locals_.append(block)
            with torch.set_grad_enabled(record):
                out = self.local_fn(*_tree.unflatten(self.treedef, leaves))
            out_paths, out_leaves, out_treedef = _tree.flatten_with_paths(out)
            specs = _spec_leaves(self.out_specs, out, "out_specs")
            globals_ = []
            for leaf, spec in zip(out_leaves, specs):
                if isinstance(leaf, torch.Tensor):
                    with torch.no_grad():
                        globals_.append(gather_blocks(leaf.detach(), spec, self.mesh))
                else:
                    globals_.append(leaf)
            if record:
                self.saved[rank] = (locals_, out_leaves)
            return out_treedef, specs, globals_

        results = self.mesh.run(body)
        self.out_treedef, self.out_leaf_specs, globals_ = results[0]
        self.global_leaves = globals_
        return globals_

    def backward(self, cotangents):
        def body():
            locals_, outs = self.saved.pop(self.mesh.rank)
            pairs = [
                (o, slice_block(g, spec, self.mesh).contiguous())
                for o, g, spec in zip(outs, cotangents, self.out_leaf_specs)
                if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
            ]
            wanted = [x for x in locals_ if x.requires_grad]
            grads = torch.autograd.grad(
                [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            ) if pairs and wanted else [None] * len(wanted)
            by_id = {id(x): g for x, g in zip(wanted, grads)}
            out = []
            for i, x in zip(self.tensor_idx, locals_):
                g = by_id.get(id(x))
                if g is None:
                    out.append(None)
                    continue
                with torch.no_grad():
                    out.append(gather_blocks(g, self.in_leaf_specs[i], self.mesh))
            return out

        return self.mesh.run(body)[0]


class _GlobalShardMap(torch.autograd.Function):
    @staticmethod
    def forward(runner, record, *tensors):
        outs = runner.forward(tensors, record)
        return tuple(o for o in outs if isinstance(o, torch.Tensor))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.runner = inputs[0]
        ctx.mark_non_differentiable(*[o for o in output if not (o.is_floating_point() or o.is_complex())])

    @staticmethod
    def backward(ctx, *cotangents):
        grads = ctx.runner.backward(cotangents)
        return (None, None) + tuple(grads)


def global_call(local_fn, mesh, in_specs, out_specs, args, name):
    """Run `local_fn` on every rank of a simulated mesh from global `args`; global outputs."""
    runner = _Runner(local_fn, mesh, in_specs, out_specs, args, name)
    tensors = [runner.leaves[i] for i in runner.tensor_idx]
    record = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    try:
        tensor_outs = _GlobalShardMap.apply(runner, record, *tensors)
    except (RuntimeError, NotImplementedError) as err:
        if isinstance(err, NotImplementedError) or "functorch" in str(err) or "vmap" in str(err):
            raise ShardingError(
                f"{name}: a shard_map called from the main thread of a simulated mesh (global mode) "
                f"supports values and .backward(), not torch.func transforms around it.\nFix: apply "
                f"torch.func transforms on the ranks: mesh.run(lambda: torch.func.grad(f)(local_args))."
            ) from err
        raise
    it = iter(tensor_outs)
    leaves = [next(it) if isinstance(g, torch.Tensor) else g for g in runner.global_leaves]
    # The tensor outputs are the very tensors in global_leaves, now carrying this call's
    # backward node, whose ctx holds the runner: a cycle through the C++ autograd graph that
    # Python's collector cannot break, keeping the mesh and its gloo groups alive. Drop it.
    runner.global_leaves = []
    return _tree.unflatten(runner.out_treedef, leaves)
