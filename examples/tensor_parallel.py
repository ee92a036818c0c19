"""Megatron-style tensor parallelism with `sf.shard_map` on a {'data': 2, 'model': 2} mesh.

A transformer block (attention + MLP) split the Megatron way (Shoeybi et al., 2019):

  MLP        W1 (D, 4D) column-parallel: each 'model' rank holds 4D/2 output columns and
             computes its slice of the hidden layer, no communication;
             W2 (4D, D) row-parallel: each rank holds the matching 4D/2 input rows and
             computes a partial sum of the output -> one psum over 'model'.
  attention  Wq, Wk, Wv column-parallel (each rank holds half the heads), Wo row-parallel
             -> one psum over 'model'.

The batch is split over 'data'. The block is written once (`block` below): the single-device
model passes `reduce=identity`, the tensor-parallel one `reduce=psum over 'model'`. In the
backward, shard_map's transpose rule supplies the other half of Megatron's f/g pair: the
input `x` is replicated over 'model' (its in spec omits the axis), so its cotangent is
psummed over 'model'. The loss and every gradient are checked against the single-device
block (float64, so the differences are rounding only).

    python examples/tensor_parallel.py
"""

import math

import torch
from torch.nn import functional as F

import shardfn as sf

# -- config ---------------------------------------------------------------------------
MESH = {"data": 2, "model": 2}
B, T, D, N_HEAD = 8, 16, 32, 4  # batch, sequence, width, heads (head size D / N_HEAD = 8)
SEED = 0
DTYPE = torch.float64  # exact comparisons; float32 works the same, to ~1e-6


def init_params(generator: torch.Generator):
    def w(*shape):
        return torch.randn(*shape, generator=generator, dtype=DTYPE) / math.sqrt(shape[0])

    def ln():
        return {"w": 1 + 0.1 * torch.randn(D, generator=generator, dtype=DTYPE), "b": torch.zeros(D, dtype=DTYPE)}

    return {
        "ln1": ln(),
        "attn": {"wq": w(D, D), "wk": w(D, D), "wv": w(D, D), "wo": w(D, D), "bo": torch.zeros(D, dtype=DTYPE)},
        "ln2": ln(),
        "mlp": {"w1": w(D, 4 * D), "b1": 0.1 * w(4 * D), "w2": w(4 * D, D), "b2": torch.zeros(D, dtype=DTYPE)},
    }


# How each parameter is laid out over the mesh: column-parallel weights split their output
# dim (and bias) over 'model', row-parallel weights their input dim; the rest is replicated.
SPECS = {
    "ln1": sf.P(),
    "attn": {"wq": sf.P(None, "model"), "wk": sf.P(None, "model"), "wv": sf.P(None, "model"),
             "wo": sf.P("model", None), "bo": sf.P()},
    "ln2": sf.P(),
    "mlp": {"w1": sf.P(None, "model"), "b1": sf.P("model"), "w2": sf.P("model", None), "b2": sf.P()},
}


# -- the block, written once ------------------------------------------------------------


def attention(p, x, reduce):  # x: (B, T, D), replicated over 'model'
    Bx, Tx, _ = x.shape
    hs = D // N_HEAD
    q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]  # (B, T, D_local): this rank's heads only
    nh = q.shape[-1] // hs  # N_HEAD on one device, N_HEAD / 2 per 'model' rank
    q, k, v = (t.view(Bx, Tx, nh, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
    y = y.transpose(1, 2).reshape(Bx, Tx, nh * hs)  # (B, T, D_local)
    return reduce(y @ p["wo"]) + p["bo"]  # row-parallel: partial sums -> psum -> (B, T, D)


def mlp(p, x, reduce):  # x: (B, T, D)
    h = F.gelu(x @ p["w1"] + p["b1"])  # column-parallel: (B, T, 4D_local), no communication
    return reduce(h @ p["w2"]) + p["b2"]  # row-parallel: one psum -> (B, T, D)


def block(params, x, reduce=lambda t: t):
    x = x + attention(params["attn"], F.layer_norm(x, (D,), params["ln1"]["w"], params["ln1"]["b"]), reduce)
    return x + mlp(params["mlp"], F.layer_norm(x, (D,), params["ln2"]["w"], params["ln2"]["b"]), reduce)


def loss_single_device(params, x, y):
    return ((block(params, x) - y) ** 2).mean()


def loss_tensor_parallel(params, x, y):
    """Per rank: params are this rank's blocks, x and y this 'data' rank's rows."""
    out = block(params, x, reduce=lambda t: sf.psum(t, "model"))  # (B / 2, T, D) on every 'model' rank
    local = ((out - y) ** 2).sum() / (B * T * D)  # this rank's share of the global mean
    return sf.psum(local, "data")  # the same scalar on every rank: out spec P()


def main():
    torch.set_num_threads(1)
    mesh = sf.local_mesh(MESH)
    g = torch.Generator().manual_seed(SEED)
    params = init_params(g)
    x = torch.randn(B, T, D, generator=g, dtype=DTYPE)
    y = torch.randn(B, T, D, generator=g, dtype=DTYPE)

    print(f"{mesh}: who holds which block of the MLP weights")
    print(sf.visualize_sharding(params["mlp"]["w1"], mesh, SPECS["mlp"]["w1"]))
    print(sf.visualize_sharding(params["mlp"]["w2"], mesh, SPECS["mlp"]["w2"]))

    # Called from the main thread with global tensors, the shard_map'ed function scatters
    # them by in_specs, runs the 4 ranks, and returns the global loss, differentiably.
    tp_loss = sf.shard_map(loss_tensor_parallel, mesh, in_specs=(SPECS, sf.P("data"), sf.P("data")), out_specs=sf.P())
    leaves, treedef = torch.utils._pytree.tree_flatten(params)
    leaves = [p.clone().requires_grad_(True) for p in leaves]
    loss_tp = tp_loss(torch.utils._pytree.tree_unflatten(leaves, treedef), x, y)
    grads_tp = torch.autograd.grad(loss_tp, leaves)

    ref = [p.clone().requires_grad_(True) for p in leaves]
    loss_ref = loss_single_device(torch.utils._pytree.tree_unflatten(ref, treedef), x, y)
    grads_ref = torch.autograd.grad(loss_ref, ref)

    print(f"\nloss: tensor parallel {loss_tp.item():.12f}   single device {loss_ref.item():.12f}")
    print(f"max |loss diff|: {abs(loss_tp.item() - loss_ref.item()):.3e}")
    paths = [torch.utils._pytree.keystr(k) for k, _ in torch.utils._pytree.tree_flatten_with_path(params)[0]]
    worst = 0.0
    for path, a, b in zip(paths, grads_tp, grads_ref):
        diff = (a - b).abs().max().item()
        worst = max(worst, diff)
        print(f"  grad{path:<16} {tuple(a.shape)!s:<10} max |diff| {diff:.3e}")
    print(f"max |grad diff|: {worst:.3e}")

    # The per-rank view: each 'model' rank holds half the heads and half the MLP.
    def local_shapes():
        local = sf.scatter(params["mlp"]["w1"], mesh, SPECS["mlp"]["w1"])
        return mesh.coords, tuple(local.shape)

    for coords, shape in mesh.run(local_shapes):
        print(f"  rank {coords}: mlp.w1 block {shape}")
    assert abs(loss_tp.item() - loss_ref.item()) < 1e-10 and worst < 1e-10
    print("OK")


if __name__ == "__main__":
    main()
