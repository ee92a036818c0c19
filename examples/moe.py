"""Expert parallelism: a top-k mixture-of-experts layer whose experts live on different ranks.

The layer (GShard, Lepikhin et al., 2020; Switch, Fedus et al., 2021):

  router     probs = softmax(x @ w_router)                       (n, E)
             top-k experts per token; gate weights = the top-k probs renormalized to sum
             to 1 (k = 1: Switch's raw top-1 prob, else the gate would be a constant 1 and
             the router would get no gradient)
  dispatch   one-hot dispatch (n, E, C) and combine (n, E, C) tensors: token i's j-th
             choice e takes slot c of expert e's buffer of `capacity` C slots (first
             choices first, then second choices, in token order); tokens past C are dropped
  experts    expert e: gelu(x @ w1[e]) @ w2[e], weights stacked as (E, d, h), (E, h, d)

Experts are split over a mesh axis 'expert' (each rank holds E / R of them) and so are the
tokens. Each rank fills its (E, C, d) buffer from its own tokens, `sf.all_to_all` over
'expert' sends expert e's C slots to the rank that holds e (which then holds
(E / R, R * C, d): the slots from every rank), the experts run, a second all_to_all sends
the outputs back, and the combine tensor mixes them with the gate weights. In the
backward, all_to_all's transpose is all_to_all with the dims swapped, and the router gets
its gradient through the gate weights in the combine tensor.

The model: an input embedding, two [LayerNorm -> MoE -> residual] blocks, a linear head,
trained on a toy regression task whose inputs come from a few clusters, each with its own
target map, so that experts can specialize on clusters. Three ways to run it:

    python examples/moe.py                     # experts over {'expert': 4}, via sf.shard_map
    python examples/moe.py --mode shard        # sf.shard on {'data': 2, 'expert': 2}, experts via param_specs
    python examples/moe.py --mode replicated   # sf.shard, no param_specs: every rank runs all experts
    python examples/moe.py --tiny              # a smoke test in a few seconds

Each run first checks the sharded gradient against the single-device model on the same
global batch (float64, nothing dropped), then trains and prints the loss and how many
tokens each expert received.
"""

import argparse
import dataclasses
import math

import optree
import torch
from torch.nn import functional as F

import shardfn as sf

# -- config ---------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    experts: int = 8  # E
    k: int = 2  # experts per token
    ranks: int = 4  # shard_map: {'expert': 4}, each rank holds E / 4 experts
    data_ranks: int = 2  # sf.shard modes: {'data': 2, 'expert': ranks / 2}
    d_in: int = 8  # input features
    d: int = 32  # model width
    h: int = 64  # expert hidden width
    d_out: int = 4
    layers: int = 2
    clusters: int = 8  # the task: inputs come from this many clusters, each with its own target map
    batch: int = 256  # global tokens per step
    capacity_factor: float = 1.5  # capacity C = ceil(factor * k * tokens per rank / E)
    steps: int = 150
    lr: float = 1e-2
    seed: int = 0


TINY = dict(experts=4, d=16, h=16, clusters=4, batch=32, steps=12)
DTYPE = torch.float64  # exact comparisons with the single-device model; float32 works the same


# -- the MoE layer ----------------------------------------------------------------------


def route(w_router, x, k):
    """Router: (probs (n, E), gate weights (n, k), expert indices (n, k))."""
    probs = torch.softmax(x @ w_router, dim=-1)  # (n, E)
    top, idx = probs.topk(k, dim=-1)  # (n, k), (n, k)
    gates = top / top.sum(-1, keepdim=True) if k > 1 else top
    return probs, gates, idx


def dispatch_combine(gates, idx, num_experts, capacity):
    """GShard's one-hot dispatch and combine tensors, both (n, E, C), and the token counts.

    Token i's j-th choice e = idx[i, j] takes the next free slot of expert e's buffer: the
    j-th choices are placed after all (j-1)-th ones, each in token order; a choice whose
    slot would be >= capacity is dropped (its row of dispatch and combine is zero).
    """
    filled = torch.zeros(num_experts, dtype=torch.long, device=idx.device)  # (E,) slots taken so far
    dispatch = combine = 0
    for j in range(idx.shape[1]):
        mask = F.one_hot(idx[:, j], num_experts)  # (n, E)
        slot = torch.cumsum(mask, dim=0) - 1 + filled  # (n, E): the slot in each expert's buffer
        filled = filled + mask.sum(0)
        keep = mask * (slot < capacity)  # (n, E): 0 where not routed or dropped
        onehot = F.one_hot(slot.clamp(0, capacity - 1), capacity) * keep[..., None]  # (n, E, C)
        onehot = onehot.to(gates.dtype)
        dispatch = dispatch + onehot
        combine = combine + gates[:, j, None, None] * onehot
    return dispatch, combine


def experts(w1, w2, x):  # x: (E_local, slots, d) -> (E_local, slots, d)
    return torch.einsum("esh,ehd->esd", F.gelu(torch.einsum("esd,edh->esh", x, w1)), w2)


def moe(p, x, *, k, capacity, axis=None):
    """The MoE layer on this rank's tokens x (n, d); returns (out (n, d), counts (2, E)):
    per expert, the tokens routed to it and those it kept (the others were dropped).

    p: {'router': (d, E), 'w1': (E_local, d, h), 'w2': (E_local, h, d)}. With `axis`, the
    experts are split over that mesh axis (E_local = E / R) and the slots travel by
    all_to_all; without it this rank holds and runs all E experts.
    """
    num_experts = p["router"].shape[1]
    _, gates, idx = route(p["router"], x, k)
    dispatch, combine = dispatch_combine(gates, idx, num_experts, capacity)  # (n, E, C) each
    counts = torch.stack([F.one_hot(idx, num_experts).sum((0, 1)).to(x.dtype), dispatch.sum((0, 2))]).detach()
    buf = torch.einsum("nec,nd->ecd", dispatch, x)  # (E, C, d): expert e's slots from this rank
    if axis is not None:
        buf = sf.all_to_all(buf, axis, split_dim=0, concat_dim=1)  # (E / R, R * C, d): my experts' slots, all ranks
    y = experts(p["w1"], p["w2"], buf)
    if axis is not None:
        y = sf.all_to_all(y, axis, split_dim=1, concat_dim=0)  # (E, C, d): back to the tokens' rank
    return torch.einsum("nec,ecd->nd", combine, y), counts  # (n, d), (2, E)


def moe_reference(p, x, *, k):
    """The same layer without dispatch, capacity or communication: every expert runs on every
    token, weighted by that token's gate for it (0 if not chosen). The single-device truth."""
    _, gates, idx = route(p["router"], x, k)
    out = 0
    for e in range(p["w1"].shape[0]):
        weight = (gates * (idx == e)).sum(-1)  # (n,)
        out = out + weight[:, None] * (F.gelu(x @ p["w1"][e]) @ p["w2"][e])
    return out


# -- the model ------------------------------------------------------------------------


def init_params(cfg: Config, generator: torch.Generator):
    def w(*shape, fan_in):
        return torch.randn(*shape, generator=generator, dtype=DTYPE) / math.sqrt(fan_in)

    E = cfg.experts
    return {
        "embed": w(cfg.d_in, cfg.d, fan_in=cfg.d_in),
        "blocks": [{"ln": {"w": torch.ones(cfg.d, dtype=DTYPE), "b": torch.zeros(cfg.d, dtype=DTYPE)},
                    "moe": {"router": w(cfg.d, E, fan_in=cfg.d),
                            "w1": w(E, cfg.d, cfg.h, fan_in=cfg.d),  # (E, d, h)
                            "w2": w(E, cfg.h, cfg.d, fan_in=cfg.h)}}  # (E, h, d)
                   for _ in range(cfg.layers)],
        "head": w(cfg.d, cfg.d_out, fan_in=cfg.d),
    }


def is_expert_weight(path) -> bool:
    return path[-1] in ("w1", "w2")


def expert_specs(params):
    """shard_map's in_specs for the params: expert weights split over 'expert', the rest replicated."""
    paths, leaves, treedef = optree.tree_flatten_with_path(params)
    return optree.tree_unflatten(treedef, [sf.P("expert") if is_expert_weight(p) else sf.P() for p in paths])


def forward(params, x, layer):
    """x: (n, d_in) -> ((n, d_out), [counts (2, E) per block]); `layer(p, h)` is the MoE."""
    h = x @ params["embed"]  # (n, d)
    counts = []
    for block in params["blocks"]:
        out, c = layer(block["moe"], F.layer_norm(h, h.shape[-1:], block["ln"]["w"], block["ln"]["b"]))
        h = h + out  # a dropped token passes through on the residual
        counts.append(c)
    return h @ params["head"], counts


def reference_loss(params, batch, k):
    x, y = batch
    pred, _ = forward(params, x, lambda p, h: (moe_reference(p, h, k=k), None))
    return ((pred - y) ** 2).mean()


def local_loss(params, batch, *, k, capacity, axis, batch_axes):
    """This rank's mean loss, and the step's token counts (layers, 2, E): routed / kept per
    expert, summed over the ranks of `batch_axes` (the axes the batch is split over)."""
    x, y = batch
    pred, counts = forward(params, x, lambda p, h: moe(p, h, k=k, capacity=capacity, axis=axis))
    return ((pred - y) ** 2).mean(), sf.psum(torch.stack(counts), batch_axes)


# -- the task -------------------------------------------------------------------------


def make_task(cfg: Config):
    g = torch.Generator().manual_seed(cfg.seed + 1)
    centers = 3 * torch.randn(cfg.clusters, cfg.d_in, generator=g, dtype=DTYPE)  # (G, d_in)
    maps = torch.randn(cfg.clusters, cfg.d_in, cfg.d_out, generator=g, dtype=DTYPE) / math.sqrt(cfg.d_in)
    return centers, maps


def global_batch(cfg: Config, task, step: int):
    """The step's global batch, a function of (seed, step) only: (x, y, cluster of each token)."""
    centers, maps = task
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    cluster = torch.randint(cfg.clusters, (cfg.batch,), generator=g)  # (N,)
    x = centers[cluster] + torch.randn(cfg.batch, cfg.d_in, generator=g, dtype=DTYPE)  # (N, d_in)
    y = torch.tanh(torch.einsum("ni,nio->no", x, maps[cluster]))  # (N, d_out): each cluster its own map
    return x, y, cluster


# -- parallelization: three ways ------------------------------------------------------


class Run:
    """One way to parallelize the model: its mesh, the axes that split the batch, the step
    (`step(params, batch) -> (loss, counts)`), and how to go from the global parameters to
    this rank's and back."""

    def __init__(self, cfg: Config, mode: str, capacity: int):
        self.mode = mode
        if mode == "shard_map":  # expert parallelism alone: tokens and experts over 'expert'
            self.mesh = sf.local_mesh({"expert": cfg.ranks})
            self.batch_axes = ("expert",)

            def loss_fn(params, batch):  # the global mean, the same on every rank: out spec P()
                loss, counts = local_loss(params, batch, k=cfg.k, capacity=capacity, axis="expert",
                                          batch_axes=self.batch_axes)
                return sf.psum(loss, "expert") / cfg.ranks, counts

            self.specs = expert_specs(init_params(cfg, torch.Generator()))
            self.step = sf.shard_map(loss_fn, self.mesh, in_specs=(self.specs, sf.P("expert")),
                                     out_specs=(sf.P(), sf.P()))
            return
        # sf.shard: the batch split over 'data' and 'expert', the parameters FSDP-sharded over 'data'
        self.mesh = sf.local_mesh({"data": cfg.data_ranks, "expert": cfg.ranks // cfg.data_ranks})
        self.batch_axes = ("data", "expert")
        if mode == "shard":  # experts split over 'expert' by param_specs: tokens travel by all_to_all
            self.step = sf.shard(
                lambda p, b: local_loss(p, b, k=cfg.k, capacity=capacity, axis="expert", batch_axes=self.batch_axes),
                self.mesh, data_axes=("data", "expert"), shard_axes="data", has_aux=True,
                param_specs=lambda path: sf.P("expert") if is_expert_weight(path) else None)
        else:  # "replicated": every rank gathers all experts and runs them on its own tokens
            self.step = sf.shard(
                lambda p, b: local_loss(p, b, k=cfg.k, capacity=capacity, axis=None, batch_axes=self.batch_axes),
                self.mesh, data_axes=("data", "expert"), has_aux=True)

    def local_params(self, params):  # on a rank: the global parameters -> this rank's
        if self.mode == "shard_map":
            return optree.tree_map(lambda t, s: sf.scatter(t, self.mesh, s), params, self.specs)
        return self.step.shard_params(params)

    def global_params(self, local):  # on a rank: this rank's parameters (or gradients) -> the global ones
        if self.mode == "shard_map":
            return optree.tree_map(lambda t, s: sf.gather(t, self.mesh, s), local, self.specs)
        return self.step.unshard_params(local)

    def rows(self, t):  # on a rank: its rows of a global batch tensor (its chunk over batch_axes)
        index, n = 0, 1
        for a in self.batch_axes:
            index, n = index * self.mesh.shape[a] + self.mesh.coords[a], n * self.mesh.shape[a]
        return t.chunk(n)[index]


def main(cfg: Config, mode: str):
    torch.set_num_threads(1)
    assert cfg.batch % cfg.ranks == 0, "the global batch must split evenly over the ranks"
    tokens = cfg.batch // cfg.ranks  # per rank
    capacity = math.ceil(cfg.capacity_factor * cfg.k * tokens / cfg.experts)
    params = init_params(cfg, torch.Generator().manual_seed(cfg.seed))
    task = make_task(cfg)

    # 1. The sharded gradient is the single-device one (capacity = tokens: nothing is dropped).
    run = Run(cfg, mode, capacity=tokens)
    x, y, _ = global_batch(cfg, task, 0)
    want = torch.func.grad(reference_loss)(params, (x, y), cfg.k)

    def check():
        grads, _ = torch.func.grad(run.step, has_aux=True)(run.local_params(params), (run.rows(x), run.rows(y)))
        return run.global_params(grads)

    got = run.mesh.run(check)[0]
    diff = max((a - b).abs().max().item() for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)))
    print(f"{mode}: mesh {run.mesh.shape}, {cfg.experts} experts, top-{cfg.k}, {tokens} tokens per rank, "
          f"capacity {capacity} slots per expert per rank")
    print(f"max |grad diff| vs single device: {diff:.3e}")

    # 2. Train.
    run = Run(cfg, mode, capacity=capacity)
    opt = sf.optim.adamw(cfg.lr, weight_decay=0.0)
    train = sf.optim.train_step(run.step, opt, has_aux=True)

    def loop():
        shards = run.local_params(params)
        state = opt.init(shards)
        log = []
        for i in range(cfg.steps):
            x, y, _ = global_batch(cfg, task, 1 + i)
            shards, state, loss, counts = train(shards, state, (run.rows(x), run.rows(y)))
            log.append((float(loss), counts.round().long()))  # counts: (layers, 2, E)
        return log, run.global_params(shards)

    log, trained = run.mesh.run(loop)[0]
    for i, (loss, counts) in enumerate(log):
        if i % max(1, cfg.steps // 10) == 0 or i == cfg.steps - 1:
            routed, kept = counts[0]
            print(f"step {i:4d}  loss {loss:.4f}  block 0 tokens per expert {routed.tolist()}  "
                  f"dropped {int((routed - kept).sum())}/{cfg.k * cfg.batch}")

    # 3. Which expert does each cluster go to? (block 0's first choice, on a fresh batch)
    x, _, cluster = global_batch(cfg, task, 10_000)
    block = trained["blocks"][0]
    _, _, idx = route(block["moe"]["router"], F.layer_norm(x @ trained["embed"], (cfg.d,), block["ln"]["w"],
                                                          block["ln"]["b"]), cfg.k)
    table = torch.zeros(cfg.clusters, cfg.experts, dtype=torch.long)
    table.index_put_((cluster, idx[:, 0]), torch.ones_like(cluster), accumulate=True)
    print("block 0, first choice of the tokens of each cluster, per expert:")
    for g in range(cfg.clusters):
        print(f"  cluster {g}: {table[g].tolist()}")
    print(f"first loss {log[0][0]:.4f}  last loss {log[-1][0]:.4f}")
    assert diff < 1e-10 and log[-1][0] < log[0][0]
    print("OK")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["shard_map", "shard", "replicated"], default="shard_map")
    parser.add_argument("--tiny", action="store_true", help="a few-second smoke test")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--k", type=int, choices=[1, 2])
    args = parser.parse_args()
    cfg = Config(**(TINY if args.tiny else {}))
    cfg.steps = args.steps or cfg.steps
    cfg.k = args.k or cfg.k
    main(cfg, args.mode)
