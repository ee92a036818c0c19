"""Per-example gradients of a sharded model, and DP-SGD on top of them.

`torch.func.vmap(torch.func.grad(step), in_dims=(None, 0))` differentiates a `sf.shard`
step once per example: every rank gets its shard of every example's gradient, one
reduce-scatter per unit for the whole vmapped batch.

Which ranks see which examples: `shard` averages the gradient over its data axes, so all
ranks of those axes must look at the *same* example in a vmap slot for the result to be
that example's gradient. The mesh is therefore {'replica': 2, 'shard': 2} with
`shard(..., data_axes='shard')`: parameters are sharded over 'shard' (ZeRO-3 memory), the
two 'shard' ranks of a replica see the same examples, and the two replicas see different
examples (data parallelism over 'replica'; we sum their clipped gradients ourselves).

With the normal data-parallel layout (every rank its own examples), vmap slot i would be
the mean over ranks of their i-th examples' gradients (the step's first vmapped call warns):
use `sf.per_example_grads(step, shards, batch)` and `sf.optim.dp_aggregate` instead, which
send each shard owner its block of every example's gradient (docs/autodiff.md §12).

DP-SGD (Abadi et al., 2016), per step: per-example gradients g_i; clip each to norm C:
g_i * min(1, C / ||g_i||); sum; add N(0, (sigma C)^2) noise; divide by the batch size.
The norm ||g_i|| of a sharded gradient is sqrt(psum over 'shard' of the shards' squared
norms). The whole loop is checked against the same algorithm on one device (float64).

    python examples/per_example_grads.py
"""

import math

import optree
import torch
from torch.nn import functional as F

import shardfn as sf

# -- config ---------------------------------------------------------------------------
MESH = {"replica": 2, "shard": 2}
D_IN, HIDDEN, N_CLASSES = 16, 64, 4
BATCH = 16  # global batch per step: 8 examples per replica
STEPS, LR = 20, 0.5
CLIP, SIGMA = 1.0, 0.5  # DP-SGD: per-example clip norm C, noise multiplier sigma
SEED = 0
DTYPE = torch.float64


def init_params(g: torch.Generator):
    def layer(d_in, d_out):
        return {"w": torch.randn(d_in, d_out, generator=g, dtype=DTYPE) / math.sqrt(d_in),
                "b": torch.zeros(d_out, dtype=DTYPE)}

    return {"layers": [layer(D_IN, HIDDEN), layer(HIDDEN, HIDDEN), layer(HIDDEN, N_CLASSES)]}


def loss_fn(params, example):
    """The loss of ONE example (x: (D_IN,), y: ()); vmap supplies the batch dim."""
    x, y = example
    h = x[None]  # (1, D_IN)
    for i, layer in enumerate(params["layers"]):
        h = h @ layer["w"] + layer["b"]
        h = torch.tanh(h) if i + 1 < len(params["layers"]) else h
    return F.cross_entropy(h, y[None])


def make_data(g: torch.Generator):
    """A learnable toy task: the class is the argmax of a fixed random projection."""
    proj = torch.randn(D_IN, N_CLASSES, generator=g, dtype=DTYPE)
    x = torch.randn(STEPS, BATCH, D_IN, generator=g, dtype=DTYPE)  # (steps, B, D_IN)
    return x, (x @ proj).argmax(-1)  # labels: (steps, B)


def noise_like(params, step: int):
    """The full-size Gaussian noise of `step`, the same on every rank (a seeded generator)."""
    g = torch.Generator().manual_seed(SEED * 100_003 + step)
    return optree.tree_map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), params)


def clip_factors(sq_norms: torch.Tensor) -> torch.Tensor:  # (B,) -> (B,)
    return (CLIP / (sq_norms.sqrt() + 1e-6)).clamp(max=1.0)


# -- sharded DP-SGD: the per-rank program -----------------------------------------------


def dp_sgd_sharded(mesh, params, xs, ys):
    step = sf.shard(loss_fn, mesh, data_axes="shard")  # sharded over 'shard'; 'replica' is ours
    per_example = torch.func.vmap(torch.func.grad_and_value(step), in_dims=(None, 0))
    shards = step.shard_params(params)
    specs = optree.tree_leaves(step.specs, is_leaf=lambda s: isinstance(s, sf.P))
    whole = [len(s) == 0 for s in specs]  # leaves every 'shard' rank keeps whole (none here)
    replica = mesh.coords["replica"]
    losses, first_norms = [], None
    for t in range(STEPS):
        x = xs[t].chunk(MESH["replica"])[replica]  # (B / 2, D_IN): this replica's examples
        y = ys[t].chunk(MESH["replica"])[replica]
        grads, loss = per_example(shards, (x, y))  # each leaf: (B / 2, *shard shape)
        leaves, treedef = optree.tree_flatten(grads)
        # ||g_i||^2 = psum over 'shard' of each shard's part (whole leaves counted once).
        sq = sum(g.flatten(1).pow(2).sum(1) for g, w in zip(leaves, whole) if not w or mesh.coords["shard"] == 0)
        mesh.all_reduce(sq, "shard")  # (B / 2,)
        factors = clip_factors(sq)
        clipped = [torch.einsum("b,b...->...", factors, g) for g in leaves]  # sum of clipped grads
        for c in clipped:
            mesh.all_reduce(c, "replica")  # ... over both replicas: the global batch
        noise = noise_like(params, t)
        noise = [sf.scatter(n, mesh, s) for n, s in zip(optree.tree_leaves(noise), specs)]  # this rank's block
        update = [(c + SIGMA * CLIP * n) / BATCH for c, n in zip(clipped, noise)]
        shards = optree.tree_map(lambda p, u: p - LR * u, shards, optree.tree_unflatten(treedef, update))
        losses.append(mesh.all_reduce(loss.mean(), "replica", op="mean").item())
        if t == 0:
            first_norms = sq.sqrt()
    return losses, step.unshard_params(shards), first_norms


# -- the same algorithm on one device -------------------------------------------------------


def dp_sgd_reference(params, xs, ys):
    per_example = torch.func.vmap(torch.func.grad_and_value(loss_fn), in_dims=(None, 0))
    losses, first_norms = [], None
    for t in range(STEPS):
        grads, loss = per_example(params, (xs[t], ys[t]))  # each leaf: (B, *param shape)
        leaves, treedef = optree.tree_flatten(grads)
        sq = sum(g.flatten(1).pow(2).sum(1) for g in leaves)  # (B,)
        factors = clip_factors(sq)
        clipped = [torch.einsum("b,b...->...", factors, g) for g in leaves]
        noise = optree.tree_leaves(noise_like(params, t))
        update = [(c + SIGMA * CLIP * n) / BATCH for c, n in zip(clipped, noise)]
        params = optree.tree_map(lambda p, u: p - LR * u, params, optree.tree_unflatten(treedef, update))
        losses.append(loss.mean().item())
        if t == 0:
            first_norms = sq.sqrt()
    return losses, params, first_norms


def main():
    torch.set_num_threads(1)
    mesh = sf.local_mesh(MESH)
    g = torch.Generator().manual_seed(SEED)
    params = init_params(g)
    xs, ys = make_data(g)

    results = mesh.run(dp_sgd_sharded, mesh, params, xs, ys)
    ref_losses, ref_params, ref_norms = dp_sgd_reference(params, xs, ys)
    losses, final, _ = results[0]

    print(f"{mesh}: DP-SGD, clip C={CLIP}, noise sigma={SIGMA}, batch {BATCH}, {STEPS} steps")
    for t in range(0, STEPS, 5):
        print(f"  step {t:2d}  loss {losses[t]:.6f}   (one device: {ref_losses[t]:.6f})")
    # Rank (replica r, shard s) computed the norms of examples r*B/2 .. (r+1)*B/2 - 1.
    norms = torch.cat([results[r * MESH["shard"]][2] for r in range(MESH["replica"])])
    norm_diff = (norms - ref_norms).abs().max().item()
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_diff = max((a - b).abs().max().item() for a, b in zip(optree.tree_leaves(final), optree.tree_leaves(ref_params)))
    print(f"per-example gradient norms at step 0: {[round(v, 3) for v in norms[:6].tolist()]} ...")
    print(f"max |per-example norm diff|: {norm_diff:.3e}")
    print(f"max |loss diff|: {loss_diff:.3e}")
    print(f"max |param diff| after {STEPS} steps: {param_diff:.3e}")
    assert norm_diff < 1e-10 and loss_diff < 1e-10 and param_diff < 1e-10
    assert losses[-1] < losses[0], "DP-SGD should still lower the loss"
    print("OK")


if __name__ == "__main__":
    main()
