"""shardfn `shard` vs PyTorch FSDP2 vs DDP, each with its optimizer variants: step time,
scaling, memory, traffic, and (with --profile) where a step's time goes.

Every method runs in the same gloo processes, on the same model, data and world size,
1 thread per rank, with interleaved repetitions (the order rotates each repetition) so
that machine drift hits all alike. A method's time is the median over repetitions of
the slowest rank's mean step time. Prints tables and writes JSON (with the date, the
machine, the load average and the command); `python -m benchmarks.report --write` turns
the JSON into docs/benchmarks.md's tables.

Methods (`METHODS`):
  shardfn-foreach   sf.shard(sf.functional(model)) + sf.optim.adamw(inplace=True) (foreach ops)
  shardfn-fused     the same with sf.optim.adamw(fused=True) (torch's fused AdamW kernel on the shards)
  fsdp2-foreach     fully_shard on every block and the root + torch.optim.AdamW(foreach=True)
  fsdp2-fused       the same with AdamW(fused=True)
  ddp               DistributedDataParallel (no buffer broadcast, gradients as bucket views) + AdamW(fused=True)
  shardfn-jaxloop   (opt-in) torch.func.grad_and_value(step), opt.update + sf.optim.apply_updates, float(loss):
                    the loop the docs teach, with shardfn-fused's optimizer
  shardfn-jaxloop-pure (opt-in) the same loop with the docs' default sf.optim.adamw(lr): pure updates
  --compressed adds: shardfn-wire-bf16 / -fp8 / -int8 (MixedPrecision(all_gather_dtype=w,
                    reduce_scatter_dtype=w), fused AdamW; fp32 masters and compute) and fsdp2-bf16
                    (MixedPrecisionPolicy(param_dtype=bf16): bf16 all-gather and compute)
  --compile adds:   fsdp2-compiled (block.compile() on each block, then fully_shard; fused AdamW) and
                    shardfn-compiled (sf.functional(model, compile=True); fused AdamW) and
                    shardfn-compiled-step (torch.compile(sf.train_step(...)) of the plain model) and
                    shardfn-traced (sf.jit: forward, backward, reduce-scatters and AdamW in one inductor
                    graph; the model applied with sf.traced_apply; AdamW in place, inplace=True)
  opt-in:           shardfn-noreshard / fsdp2-noreshard (reshard_after_forward=False, fused AdamW) and
                    shardfn-traced-noreshard (sf.jit of the same): no re-gather in the backward, DDP's
                    bytes on the wire, the whole model gathered through the step (ZeRO-2's memory)

    python -m benchmarks.fsdp_vs_ddp                        # 3 models x N = 1, 2, 4 (tens of minutes)
    python -m benchmarks.fsdp_vs_ddp --tiny                 # seconds; what the test suite runs
    python -m benchmarks.fsdp_vs_ddp --models gpt --world-sizes 2 --reps 7 --profile
    python -m benchmarks.fsdp_vs_ddp --models gpt --world-sizes 2 --load 1 --threads \\
        --out benchmarks/results/fsdp_vs_ddp_load     # with a CPU-burning second job
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import warnings
from typing import Callable

import torch

import shardfn as sf
from shardfn.testing import run_multiprocess
from shardfn.testing.models import GPT, MLP, GPTConfig

from benchmarks import _common

RESULTS = os.path.join(os.path.dirname(__file__), "results")
LR = 1e-3
PARITY_STEPS = 3  # the first steps of every method, from the same init: losses compared with DDP's


# -- models ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    label: str
    build: Callable[[], torch.nn.Module]
    rows: int  # batch rows per rank
    items_per_row: int  # tokens per row (GPT) or 1 sample (MLP)
    unit: str  # what items/s counts
    steps: int = 3  # steps per timed block by default: a block of about a second or more


MODELS = {
    "gpt": ModelSpec("GPT 4L d256", lambda: GPT(GPTConfig()), 8, 128, "tokens"),
    "gpt-8L": ModelSpec("GPT 8L d512", lambda: GPT(GPTConfig(n_layer=8, n_head=8, n_embd=512)), 8, 128, "tokens",
                        steps=1),
    "mlp": ModelSpec("MLP 8x1024", lambda: MLP(width=1024, depth=8, d_in=64, d_out=8), 64, 1, "samples",
                     steps=5),
}
TINY = {
    "gpt": ModelSpec("GPT 2L d32 (tiny)", lambda: GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2,
                                                                n_embd=32)), 2, 16, "tokens"),
    "gpt-8L": ModelSpec("GPT 3L d64 (tiny)", lambda: GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=3, n_head=2,
                                                                   n_embd=64)), 2, 16, "tokens"),
    "mlp": ModelSpec("MLP 2x64 (tiny)", lambda: MLP(width=64, depth=2, d_in=16, d_out=4), 2, 1, "samples"),
}


def build_model(spec: ModelSpec) -> torch.nn.Module:
    torch.manual_seed(0)
    return spec.build()


def blocks_of(model) -> torch.nn.ModuleList:
    return model.transformer.h if isinstance(model, GPT) else model.layers


def make_batch(model, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, GPT):
        cfg = model.cfg
        idx = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)  # (B, T)
        return idx, torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)
    d_in, d_out = model.inp.in_features, model.out.out_features
    return torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# -- trainers: `(one step -> mean loss over ranks, state bytes per rank)` -------------------


def shardfn_trainer(step, params, batch, fused: bool = False, compile_step: bool = False):
    """`(one step -> mean loss, state bytes)` of `sf.train_step` on a shard step, with
    in-place AdamW like torch.optim (state and shards are updated in their buffers);
    `fused`: the fused kernel (`sf.optim.adamw(fused=True)`), else the foreach chain;
    `compile_step`: `torch.compile` of the train step (which compiles the blocks)."""
    opt = sf.optim.adamw(LR, weight_decay=0.0, fused=True) if fused else sf.optim.adamw(LR, weight_decay=0.0,
                                                                                          inplace=True)
    train = sf.train_step(step, opt, inplace=True)
    if compile_step:
        warnings.filterwarnings("ignore", "torch.compile does not capture")  # said in the docs
        train = torch.compile(train)
    return train_loop(train, step, opt, params, batch)


def train_loop(train, step, opt, params, batch):
    """`(one step -> loss, state bytes)` of a `train(shards, opt_state, batch)` function
    (`sf.train_step`, `sf.jit`) from `params` sharded by `step`."""
    state = {"shards": step.shard_params(params)}
    state["opt"] = opt.init(state["shards"])

    def one():
        state["shards"], state["opt"], loss = train(state["shards"], state["opt"], batch)
        return float(loss)

    def nbytes():  # shards + grads (same size as shards) + optimizer state
        leaves = torch.utils._pytree.tree_leaves
        return 2 * tensor_bytes(leaves(state["shards"])) + tensor_bytes(leaves(state["opt"]))

    return one, nbytes


def _torch_opt_bytes(model, opt):
    def local(t):
        return t._local_tensor if hasattr(t, "_local_tensor") else t

    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    states = [local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensor_bytes(params) + tensor_bytes(grads) + tensor_bytes(states)


def torch_trainer(model, batch, fused: bool = False):
    """`(one step -> mean loss over ranks, state bytes)` of a torch-wrapped model (FSDP2,
    DDP, DTensor) with AdamW (fused or foreach). The loss is all-reduced for its mean
    over ranks, as shardfn's step returns it."""
    kind = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, **kind)

    def one():
        opt.zero_grad(set_to_none=True)
        loss = model(*batch)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        return float(mean) / torch.distributed.get_world_size()

    return one, lambda: _torch_opt_bytes(model, opt)


# -- the methods: each returns a Trainer, or raises Unsupported -----------------------------


class Unsupported(Exception):
    """This method cannot be built with this shardfn / torch (recorded, not fatal)."""


@dataclasses.dataclass
class Trainer:
    step: Callable[[], float]
    state_bytes: Callable[[], int]
    shard_step: object = None  # shardfn's step, for its stats()


def _shardfn(spec, mesh, batch, fused=False, compile_=False, compile_step=False, wire=None, reshard=True):
    apply_fn, params = sf.functional(build_model(spec), compile=compile_)
    mp = None if wire is None else sf.MixedPrecision(all_gather_dtype=wire, reduce_scatter_dtype=wire)
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh, mixed_precision=mp, reshard_after_forward=reshard)
    return Trainer(*shardfn_trainer(step, params, batch, fused=fused, compile_step=compile_step), shard_step=step)


def _shardfn_jaxloop(spec, mesh, batch, fused=True):
    """The loop the docs teach, as a user writes it: `torch.func.grad_and_value(step)`, then
    `opt.update` + `sf.optim.apply_updates`, then `float(loss)`, with the optimizer of
    `shardfn-fused` (its `sf.train_step`): compare the two. `fused=False`: the docs'
    default `sf.optim.adamw(lr)` (pure: new state and new shards each step)."""
    apply_fn, params = sf.functional(build_model(spec))
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
    opt = sf.optim.adamw(LR, weight_decay=0.0, fused=True) if fused else sf.optim.adamw(LR, weight_decay=0.0)
    state = {"shards": step.shard_params(params)}
    state["opt"] = opt.init(state["shards"])

    def one():
        grads, loss = torch.func.grad_and_value(step)(state["shards"], batch)
        updates, state["opt"] = opt.update(grads, state["opt"], state["shards"])
        state["shards"] = sf.optim.apply_updates(state["shards"], updates)
        return float(loss)

    def nbytes():  # as shardfn_trainer counts
        leaves = torch.utils._pytree.tree_leaves
        return 2 * tensor_bytes(leaves(state["shards"])) + tensor_bytes(leaves(state["opt"]))

    return Trainer(one, nbytes, shard_step=step)


def _shardfn_traced(spec, mesh, batch, reshard=True):
    """sf.jit: the whole step in one graph (docs/fsdp_design.md, "Traced step"), updating
    the shards and the AdamW state in place (`inplace=True`), as the eager methods do."""
    model = build_model(spec)
    _, params = sf.functional(model)
    apply = sf.traced_apply(model)
    step = sf.shard(lambda p, b: apply(p, *b), mesh, reshard_after_forward=reshard)
    opt = sf.optim.adamw(LR, weight_decay=0.0)
    return Trainer(*train_loop(sf.jit(step, opt, inplace=True), step, opt, params, batch))


def _fsdp2(spec, mesh, batch, fused=False, compile_=False, param_dtype=None, reshard=True):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(spec)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in blocks_of(model):
        if compile_:
            block.compile()
        fully_shard(block, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
    return Trainer(*torch_trainer(model, batch, fused=fused))


def _ddp(spec, mesh, batch):
    from torch.nn.parallel import DistributedDataParallel as DDP

    # At its best: the GPT's mask buffer is constant (no broadcast each forward), and the
    # gradients live in the buckets (no copy into them).
    model = DDP(build_model(spec), forward_sync_buffers=False, gradient_as_bucket_view=True)
    return Trainer(*torch_trainer(model, batch, fused=True))


METHODS = {
    "shardfn-foreach": lambda s, m, b: _shardfn(s, m, b),
    "shardfn-fused": lambda s, m, b: _shardfn(s, m, b, fused=True),
    "fsdp2-foreach": lambda s, m, b: _fsdp2(s, m, b),
    "fsdp2-fused": lambda s, m, b: _fsdp2(s, m, b, fused=True),
    "ddp": _ddp,
}
# not in the default run: --methods shardfn-jaxloop ...
LOOPS = {"shardfn-jaxloop": _shardfn_jaxloop,
         "shardfn-jaxloop-pure": lambda s, m, b: _shardfn_jaxloop(s, m, b, fused=False)}
COMPILED = {
    "shardfn-compiled": lambda s, m, b: _shardfn(s, m, b, fused=True, compile_=True),
    "shardfn-compiled-step": lambda s, m, b: _shardfn(s, m, b, fused=True, compile_step=True),
    "shardfn-traced": _shardfn_traced,
    "fsdp2-compiled": lambda s, m, b: _fsdp2(s, m, b, fused=True, compile_=True),
}
# Compressed communication (MixedPrecision.all_gather_dtype / reduce_scatter_dtype): fp32
# master shards and compute, the all-gather and the gradient reduction on the wire in the
# format named. FSDP2's nearest option is a bf16 parameter all-gather, which also computes
# in bf16 (MixedPrecisionPolicy(param_dtype=bf16), fp32 gradient reduction).
COMPRESSED = {
    "shardfn-wire-bf16": lambda s, m, b: _shardfn(s, m, b, fused=True, wire=torch.bfloat16),
    "shardfn-wire-fp8": lambda s, m, b: _shardfn(s, m, b, fused=True, wire=torch.float8_e4m3fn),
    "shardfn-wire-int8": lambda s, m, b: _shardfn(s, m, b, fused=True, wire="int8"),
    "fsdp2-bf16": lambda s, m, b: _fsdp2(s, m, b, fused=True, param_dtype=torch.bfloat16),
}
# Without the backward's re-gather (ZeRO-2's traffic: one all-gather and one reduce-scatter
# per unit and step, DDP's bytes; the unsharded parameters live from their gather to their
# backward, so the step's peak holds the whole model).
NORESHARD = {
    "shardfn-noreshard": lambda s, m, b: _shardfn(s, m, b, fused=True, reshard=False),
    "shardfn-traced-noreshard": lambda s, m, b: _shardfn_traced(s, m, b, reshard=False),
    "fsdp2-noreshard": lambda s, m, b: _fsdp2(s, m, b, fused=True, reshard=False),
}
ALL_METHODS = {**METHODS, **LOOPS, **COMPILED, **COMPRESSED, **NORESHARD}


# -- one world size: every method in the same processes -------------------------------------


def _median(xs):
    return statistics.median(xs) if xs else None


def rank_main(model: str, world: int, methods: list, reps: int, steps: int, warmup: int, tiny: bool,
              trace_dir: str | None, intra_op_threads: int = 1):
    torch.set_num_threads(intra_op_threads)
    spec = (TINY if tiny else MODELS)[model]
    mesh = sf.init_mesh({"data": world}, timeout=3600)
    rank = mesh.rank
    batch = make_batch(build_model(spec), spec.rows, seed=1000 + rank)
    made, unsupported = {}, {}
    for m in methods:
        try:
            made[m] = ALL_METHODS[m](spec, mesh, batch)
        except Unsupported as err:
            unsupported[m] = str(err)
    # Correctness first: the same steps from the same init; losses compared with DDP's.
    losses = {m: [t.step() for _ in range(PARITY_STEPS)] for m, t in made.items()}
    for t in made.values():
        for _ in range(max(warmup - PARITY_STEPS, 0)):
            t.step()
    order = list(made)
    times = {m: [] for m in made}
    cpu = {m: [] for m in made}
    clock = _common.ThreadClock()
    for rep in range(reps):
        for m in order[rep % len(order):] + order[:rep % len(order)]:
            torch.distributed.barrier()
            a = clock.snapshot()
            for _ in range(steps):
                made[m].step()
            b = clock.snapshot()  # before the barrier: this rank's own time
            torch.distributed.barrier()
            c = clock.snapshot()
            times[m].append((c[0] - a[0]) / steps)
            cpu[m].append(_common.ThreadClock.delta(a, b, steps))
    profiles = {}
    if trace_dir is not None:
        for m, t in made.items():
            torch.distributed.barrier()
            path = os.path.join(trace_dir, f"{model}-N{world}-{m}.json") if rank == 0 else None
            profiles[m] = _common.profile_step(t.step, path)
    torch.distributed.barrier()
    sf_step = next((t.shard_step for t in made.values() if t.shard_step is not None), None)
    return {
        "times": times,
        "cpu": {m: {k: _median([d[k] for d in ds]) for k in ds[0]} for m, ds in cpu.items() if ds},
        "losses": losses,
        "unsupported": unsupported,
        "state_bytes": {m: t.state_bytes() for m, t in made.items()},
        "stats": sf_step.stats() if sf_step is not None else None,
        "stats_by_method": {m: t.shard_step.stats() for m, t in made.items() if t.shard_step is not None},
        "profiles": profiles,
        "threads": _common.thread_names(),
    }


def run(model: str, world: int, args) -> dict:
    spec = (TINY if args.tiny else MODELS)[model]
    steps = args.steps or spec.steps
    load_before, use_before = list(os.getloadavg()), _common.MachineUse.snapshot()
    per_rank = run_multiprocess(rank_main, world, model, world, args.methods, args.reps, steps, args.warmup,
                                args.tiny, args.trace_dir if args.profile else None, args.intra_op_threads,
                                timeout=7200)
    use = _common.MachineUse.delta(use_before, _common.MachineUse.snapshot())
    ran = list(per_rank[0]["times"])
    step_s = {m: statistics.median(max(r["times"][m][i] for r in per_rank) for i in range(args.reps)) for m in ran}
    losses = per_rank[0]["losses"]
    stats = per_rank[0]["stats"]
    row = {
        "model": model,
        "label": spec.label,
        "world": world,
        "rows_per_rank": spec.rows,
        "items_per_step_per_rank": spec.rows * spec.items_per_row,
        "unit": spec.unit,
        "steps_per_block": steps,
        "loadavg_before_after": [load_before, list(os.getloadavg())],  # others' work on the machine
        "machine_use": use,  # cores busy on average during the row's run: the benchmark's, other work's
        "step_s": step_s,
        "step_s_per_rep": {m: [max(r["times"][m][i] for r in per_rank) for i in range(args.reps)] for m in ran},
        "unsupported": per_rank[0]["unsupported"],
        "losses": losses,
        "max_loss_diff_vs_ddp": ({m: max(abs(a - b) for a, b in zip(losses[m], losses["ddp"])) for m in losses}
                                 if "ddp" in losses else {}),
        "state_bytes_per_rank": per_rank[0]["state_bytes"],
        # per step, median over repetitions, mean over ranks (see _common.ThreadClock)
        "cpu_per_step": {m: {k: statistics.fmean(r["cpu"][m][k] for r in per_rank) for k in per_rank[0]["cpu"][m]}
                         for m in ran},
        "threads_at_end": per_rank[0]["threads"],
    }
    row["stats_by_method"] = per_rank[0].get("stats_by_method", {})
    if stats is not None:
        psi = stats["reduce_scatter_bytes"]  # Psi in the parameter dtype, padded
        row["stats"] = stats
        row["comm_bytes_per_rank"] = (stats["all_gather_bytes"] + stats["reduce_scatter_bytes"]) * (world - 1) / world
        row["comm_theory_bytes_per_rank"] = 3 * psi * (world - 1) / world
    if args.profile:
        row["profile"] = {m: _profile_mean([r["profiles"][m] for r in per_rank]) for m in ran}
    return row


def _profile_mean(per_rank: list[dict]) -> dict:
    """The ranks' profiles averaged: times, and operators' self times by name (rounded to
    the microsecond; `python -m benchmarks.report` sorts them into shares)."""
    keys = ("wall_ms", "main_cpu_ms", "main_runqueue_ms", "main_blocked_ms", "other_threads_cpu_ms")
    out = {k: statistics.fmean(p[k] for p in per_rank) for k in keys}
    names = sorted({n for p in per_rank for n in p["ops_self_ms"]})
    ops = {n: round(sum(p["ops_self_ms"].get(n, 0.0) for p in per_rank) / len(per_rank), 3) for n in names}
    out["ops_self_ms"] = {n: v for n, v in ops.items() if v > 0}
    out["share_ms"] = _common.shares(out)
    return out


# -- thread census: each method alone in fresh processes ------------------------------------


def census_main(model: str, world: int, method: str, tiny: bool, steps: int, intra_op_threads: int = 1):
    torch.set_num_threads(intra_op_threads)
    spec = (TINY if tiny else MODELS)[model]
    mesh = sf.init_mesh({"data": world}, timeout=3600)
    before = _common.thread_names()
    batch = make_batch(build_model(spec), spec.rows, seed=1000 + mesh.rank)
    try:
        trainer = ALL_METHODS[method](spec, mesh, batch)
    except Unsupported as err:
        return {"unsupported": str(err)}
    for _ in range(2):
        trainer.step()
    clock = _common.ThreadClock()
    torch.distributed.barrier()
    a = clock.snapshot()
    for _ in range(steps):
        trainer.step()
    b = clock.snapshot()
    torch.distributed.barrier()
    after = _common.thread_names()
    return {"threads_before": before, "threads_after": after, "count_before": sum(before.values()),
            "count_after": sum(after.values()), "cpu_per_step": _common.ThreadClock.delta(a, b, steps)}


def thread_census(model: str, world: int, args) -> dict:
    """Per method, run alone: the process's threads (by name) after init_mesh and after two
    steps, and the CPU seconds per step of the main thread and of the others."""
    out = {}
    for m in args.methods:
        per_rank = run_multiprocess(census_main, world, model, world, m, args.tiny, 3, args.intra_op_threads,
                                    timeout=3600)
        if "unsupported" in per_rank[0]:
            out[m] = per_rank[0]
            continue
        out[m] = {**per_rank[0], "cpu_per_step": {k: statistics.fmean(r["cpu_per_step"][k] for r in per_rank)
                                                  for k in per_rank[0]["cpu_per_step"]}}
    return {"model": model, "world": world, "methods": out}


# -- ratios and tables ----------------------------------------------------------------------


def best(row: dict, family: str) -> tuple[str, float] | None:
    """The fastest variant of `family` ('shardfn' or 'fsdp2') in this row. Compiled variants
    count only when both families have one (FSDP2 compiled against shardfn compiled)."""
    t = row["step_s"]
    both_compiled = "shardfn-compiled" in t and "fsdp2-compiled" in t
    # other numerics (compressed), graphs (traced) or memory (no re-gather): their own ratios
    cands = [m for m in t if m.startswith(family + "-") and (both_compiled or "-compiled" not in m)
             and m not in COMPRESSED and m not in NORESHARD and m != "shardfn-traced"]
    if not cands:
        return None
    m = min(cands, key=t.get)
    return m, t[m]


def ratios(row: dict) -> dict:
    """The ratios the targets read, from a row's step times (None where a method is missing)."""
    t = row["step_s"]

    def r(a, b):
        return t[a] / t[b] if a in t and b in t else None

    sb, fb = best(row, "shardfn"), best(row, "fsdp2")
    return {
        "foreach: shardfn / fsdp2": r("shardfn-foreach", "fsdp2-foreach"),
        "fused: shardfn / fsdp2": r("shardfn-fused", "fsdp2-fused"),
        "compiled: shardfn / fsdp2": r("shardfn-compiled", "fsdp2-compiled"),
        "best: shardfn / fsdp2": sb[1] / fb[1] if sb and fb else None,
        "best: shardfn / ddp": sb[1] / t["ddp"] if sb and "ddp" in t else None,
        "shardfn-best / fsdp2-compiled": sb[1] / t["fsdp2-compiled"] if sb and "fsdp2-compiled" in t else None,
        **{f"{w}: shardfn / ddp": r(f"shardfn-wire-{w}", "ddp") for w in ("int8", "fp8", "bf16")
           if f"shardfn-wire-{w}" in t},
        **{f"{w} / fp32 (fused)": r(f"shardfn-wire-{w}", "shardfn-fused") for w in ("int8", "fp8", "bf16")
           if f"shardfn-wire-{w}" in t},
        "jaxloop: loop / train_step (fused)": r("shardfn-jaxloop", "shardfn-fused"),
        "jaxloop: loop / fsdp2 (fused)": r("shardfn-jaxloop", "fsdp2-fused"),
        "jaxloop: loop / ddp": r("shardfn-jaxloop", "ddp"),
        "jaxloop-pure: loop / train_step (fused)": r("shardfn-jaxloop-pure", "shardfn-fused"),
        "jaxloop-pure: loop / ddp": r("shardfn-jaxloop-pure", "ddp"),
        "traced: sf.jit / eager (fused)": r("shardfn-traced", "shardfn-fused"),
        "traced: sf.jit / ddp": r("shardfn-traced", "ddp"),
        "traced: sf.jit / fsdp2-compiled": r("shardfn-traced", "fsdp2-compiled"),
        "noreshard: shardfn / ddp": r("shardfn-noreshard", "ddp"),
        "noreshard: shardfn / fsdp2": r("shardfn-noreshard", "fsdp2-noreshard"),
        "noreshard: shardfn / reshard (fused)": r("shardfn-noreshard", "shardfn-fused"),
        "noreshard: sf.jit / ddp": r("shardfn-traced-noreshard", "ddp"),
        "noreshard: sf.jit / sf.jit reshard": r("shardfn-traced-noreshard", "shardfn-traced"),
    }


def print_table(rows: list[dict]) -> None:
    methods = [m for m in ALL_METHODS if any(m in r["step_s"] or m in r["unsupported"] for r in rows)]
    head = f"{'model':<18} {'N':>2} " + " ".join(f"{m:>16}" for m in methods)
    print("median step time, s (slowest rank)")
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = [f"{r['step_s'][m]:>16.4f}" if m in r["step_s"] else f"{'unsupported':>16}" for m in methods]
        print(f"{r['label']:<18} {r['world']:>2} " + " ".join(cells))
    print()
    names = list(ratios(rows[0]))
    print(f"{'model':<18} {'N':>2} " + " ".join(f"{n:>30}" for n in names) + f" {'max dloss vs ddp':>17}")
    for r in rows:
        rs = ratios(r)
        dl = max(r["max_loss_diff_vs_ddp"].values(), default=float("nan"))
        print(f"{r['label']:<18} {r['world']:>2} " + " ".join(f"{rs[n]:>30.3f}" if rs[n] is not None
                                                             else f"{'-':>30}" for n in names) + f" {dl:>17.1e}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--methods", nargs="+", default=None, choices=list(ALL_METHODS),
                        help="default: the five of METHODS (and the compiled ones with --compile)")
    parser.add_argument("--compile", action="store_true", help="add fsdp2-compiled, shardfn-compiled and shardfn-compiled-step")
    parser.add_argument("--compressed", action="store_true",
                        help="add shardfn-wire-{bf16,fp8,int8} (compressed all-gather + reduce-scatter) and fsdp2-bf16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per timed block (default: the model's, 1-5: a block of a second or more)")
    parser.add_argument("--warmup", type=int, default=PARITY_STEPS, help="untimed steps (the parity steps count)")
    parser.add_argument("--profile", action="store_true", help="profile one step per method (traces in --trace-dir)")
    parser.add_argument("--trace-dir", default=os.path.join(RESULTS, "traces"))
    parser.add_argument("--load", type=int, default=0, metavar="K",
                        help="run K CPU-burning processes (a second job on the cores) during the run")
    parser.add_argument("--intra-op-threads", type=int, default=1, metavar="T",
                        help="torch.set_num_threads(T) in every rank (default 1: ranks x T <= cores)")
    parser.add_argument("--threads", action="store_true",
                        help="also count each method's threads, run alone (first model, N = 2)")
    parser.add_argument("--tiny", action="store_true", help="tiny models, 1 rep of 1 step: seconds")
    parser.add_argument("--out", default=os.path.join(RESULTS, "fsdp_vs_ddp"), help="JSON path, without .json")
    args = parser.parse_args(argv)
    if args.methods is None:
        args.methods = (list(METHODS) + (list(COMPILED) if args.compile else [])
                        + (list(COMPRESSED) if args.compressed else []))
    if args.tiny:
        args.reps, args.steps = 1, 1
    env = _common.environment("benchmarks.fsdp_vs_ddp", argv)
    with _common.Load(args.load):
        rows = [run(m, n, args) for m in args.models for n in args.world_sizes]
        census = thread_census(args.models[0], 2, args) if args.threads else None
    report = {
        "benchmark": "fsdp_vs_ddp",
        "env": _common.finish_environment(env),
        "config": {"reps": args.reps, "warmup": max(args.warmup, PARITY_STEPS),
                   "parity_steps": PARITY_STEPS, "methods": args.methods, "load_processes": args.load,
                   "tiny": args.tiny, "threads_per_rank": args.intra_op_threads, "lr": LR},
        "results": rows,
    }
    if census is not None:
        report["thread_census"] = census
    print_table(rows)
    if census is not None:
        print(f"\nthreads per process, each method alone ({census['model']}, N = {census['world']}):")
        for m, c in census["methods"].items():
            if "unsupported" in c:
                print(f"  {m:<17} unsupported")
                continue
            cps = c["cpu_per_step"]
            print(f"  {m:<17} {c['count_before']} -> {c['count_after']} threads {c['threads_after']}; per step: "
                  f"main {cps['main_cpu_s']:.3f} s CPU, others {cps['other_threads_cpu_s']:.3f} s CPU")
    _common.write_json(report, args.out)
    return report


if __name__ == "__main__":
    main()
