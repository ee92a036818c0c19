"""Quickstart: a simulated 4-rank mesh, a collective, and data-parallel training by hand.

Runs in a few seconds on a laptop CPU:

    python examples/quickstart.py

Each rank of `sf.local_mesh` is a thread of this process holding real gloo process
groups, so the same per-rank code runs unchanged as one process per rank under
`torchrun` with `sf.init_mesh`. This example averages gradients by hand with
`mesh.all_reduce`; `sf.shard` will do that (and shard the parameters) for you.
"""

import torch

import shardfn as sf

# -- config ---------------------------------------------------------------------------
N_RANKS = 4
N_SAMPLES, N_FEATURES = 256, 8  # global batch: 64 rows per rank
STEPS, LR = 100, 0.1
SEED = 0

torch.set_num_threads(1)  # one intra-op thread: the ranks are threads already


def make_data(seed: int):
    """A noisy linear problem y = X @ w_true + 0.1 * noise; explicit generator, no global RNG."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=gen)  # (N, F)
    w_true = torch.randn(N_FEATURES, generator=gen)  # (F,)
    y = x @ w_true + 0.1 * torch.randn(N_SAMPLES, generator=gen)  # (N,)
    return x, y, w_true


def mse(w, x, y):
    return ((x @ w - y) ** 2).mean()


def train_data_parallel(mesh: sf.Mesh, x_global, y_global):
    """Per-rank program: train on this rank's rows, averaging gradients over 'data'."""
    rank_index = mesh.coords["data"]
    x = x_global.chunk(mesh.shape["data"])[rank_index]  # (N / 4, F): this rank's shard
    y = y_global.chunk(mesh.shape["data"])[rank_index]  # (N / 4,)
    w = torch.zeros(N_FEATURES, requires_grad=True)
    losses = []
    for _ in range(STEPS):
        loss = mse(w, x, y)
        (grad,) = torch.autograd.grad(loss, w)
        mesh.all_reduce(grad, "data", op="mean")  # equal shards: mean of means = global gradient
        with torch.no_grad():
            w -= LR * grad
        losses.append(mesh.all_reduce(loss.detach(), "data", op="mean").item())
    return w.detach(), losses


def train_single_process(x, y):
    """The reference: the same loop on the global batch in one process."""
    w = torch.zeros(N_FEATURES, requires_grad=True)
    for _ in range(STEPS):
        (grad,) = torch.autograd.grad(mse(w, x, y), w)
        with torch.no_grad():
            w -= LR * grad
    return w.detach()


def main():
    mesh = sf.local_mesh({"data": N_RANKS})
    print(mesh)

    # Every rank knows its coordinates; mesh.run returns per-rank results in rank order.
    for rank, coords in mesh.run(lambda: (mesh.rank, mesh.coords)):
        print(f"  rank {rank}: coords {coords}")

    # A collective: each rank contributes its rank number, all of them receive the sum.
    sums = mesh.run(lambda: mesh.all_reduce(torch.tensor([float(mesh.rank)]), "data").item())
    print(f"all_reduce of the rank numbers over 'data': {sums}  (0+1+2+3 = 6 on every rank)")

    x, y, w_true = make_data(SEED)
    results = mesh.run(train_data_parallel, mesh, x, y)
    w_dp, losses = results[0]
    print("\ndata-parallel training on 4 ranks, 64 rows each:")
    for step in (0, 1, 5, 20, 50, STEPS - 1):
        print(f"  step {step:3d}  loss {losses[step]:.6f}")

    spread = max((r[0] - w_dp).abs().max().item() for r in results)
    w_ref = train_single_process(x, y)
    diff = (w_dp - w_ref).abs().max().item()
    print(f"\nmax |w| difference between ranks:                  {spread:.2e}")
    print(f"max |w| difference vs single-process training:     {diff:.2e}")
    print(f"max |w| difference vs the true weights (noise 0.1): {(w_dp - w_true).abs().max().item():.2e}")
    assert losses[-1] < 0.1 * losses[0], "the loss should fall"
    assert spread == 0.0, "every rank should hold the same weights"
    assert diff < 1e-5, "data-parallel training should match single-process training"
    print("OK")


if __name__ == "__main__":
    main()
