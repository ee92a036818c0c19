"""The prepared accelerator check: shardfn on CUDA tensors, in one short run.

For a session that is lent a GPU machine (one GPU): it checks the device-agnostic paths
that the CPU test suite cannot, and prints one PASS/FAIL line per check (plus a JSON
report under $OUT when that is set). Every check compares against a reference computed
in the same run.

    python scripts/device_check.py                  # CUDA if available, else CPU (a dry run)
    python scripts/device_check.py --device cpu     # the dry run: what CI could run

shardfn must be importable: installed (`pip install -e .`, scripts/setup.sh), or, on a
machine with only torch and optree, `PYTHONPATH=. python scripts/device_check.py`.

Checks:
  1. nccl-1rank   NCCL process group (world 1) + sf.shard GPT, 5 AdamW steps == plain
                  torch training on the same device (fp32, 1e-4).
  2. bf16         the same with MixedPrecision(bf16, fp32): finite, within 5e-2.
  3. collectives  shard_map psum / all_gather / psum_scatter / ppermute / all_to_all on
                  device tensors, values and gradients == single device.
  4. checkpoint   async save of device shards + AdamW state, load back: bit-identical.
  5. ensembles    vmap over stacked shards on the device == a loop over members.
  6. gloo-2rank   2 processes on the one device over gloo with device tensors (the
                  collective fallbacks): 3 SGD steps == one process.
  7. fused        sf.optim.adamw(fused=True) on device tensors (fp32 and bf16 leaves, 10
                  steps) == torch.optim.AdamW(fused=True): params and moments bit-identical;
                  and sf.shard GPT training with it == plain torch with
                  AdamW(fused=True) (fp32, 1e-4, as check 1).
  8. compiled     sf.shard GPT with compiled blocks (sf.functional(compile=True), inductor)
                  == eager blocks: 5 AdamW steps, fp32 losses within 1e-5 (fused kernels
                  round differently from eager's), and one graph for both blocks.
  9. compressed   quantized communication on device tensors: the GPT with an int8 and an
                  fp8 all-gather (world 1: encode/decode on the device) within 5e-2 of fp32
                  torch.
 11. traced       sf.jit (the whole train step as one torch.compile graph: collectives,
                  backward, AdamW, shards updated in place) of the GPT == the eager
                  sf.train_step, 5 steps, fp32 losses within 1e-4 (inductor on the
                  device; aot_eager in the CPU dry run).
 10. compressed-2rank  2 processes over gloo with device tensors, int8 all-gather + int8
                  reduce-scatter (qgZ's all-to-all): params after 3 steps == the same run
                  on CPU (1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch

import shardfn as sf
import shardfn.checkpoint as ckpt
from shardfn.testing import run_multiprocess
from shardfn.testing.models import GPT, GPTConfig, mlp_loss, mlp_params

RESULTS: dict[str, dict] = {}


def check(name: str):
    def wrap(fn):
        def run(*args):
            t0 = time.perf_counter()
            try:
                detail = fn(*args)
                RESULTS[name] = {"ok": True, "detail": detail}
            except Exception as err:  # noqa: BLE001 - every check reports, none stops the others
                RESULTS[name] = {"ok": False, "detail": f"{type(err).__name__}: {err}",
                                 "traceback": traceback.format_exc()}
            RESULTS[name]["seconds"] = round(time.perf_counter() - t0, 2)
            status = "PASS" if RESULTS[name]["ok"] else "FAIL"
            print(f"{status} {name:12s} {RESULTS[name]['seconds']:6.2f} s  {RESULTS[name]['detail']}", flush=True)
        return run
    return wrap


def max_diff(a, b) -> float:
    """The largest |a - b| over two trees' leaves."""
    leaves = torch.utils._pytree.tree_leaves
    return max((x - y).abs().max().item() for x, y in zip(leaves(a), leaves(b)))


def gpt_batches(cfg, device, n=5, rows=4):
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g).to(device) for _ in range(2))
            for _ in range(n)]


def torch_reference(cfg, device, batches, fused=None):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    losses = []
    for idx, tgt in batches:
        opt.zero_grad()
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def shard_losses(mesh, cfg, batches, mp=None, fused=None, compile=None):
    torch.manual_seed(0)
    apply_fn, params = sf.functional(GPT(cfg).to(mesh.device), compile=compile)
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh, mixed_precision=mp)
    opt = sf.optim.adamw(1e-3, fused=fused)
    train = sf.train_step(step, opt)
    shards = step.shard_params(params)
    state = opt.init(shards)
    losses = []
    for batch in batches:
        shards, state, loss = train(shards, state, batch)
        losses.append(float(loss))
    return losses, step, shards, state


@check("nccl-1rank")
def check_train(mesh, cfg):
    batches = gpt_batches(cfg, mesh.device)
    want = torch_reference(cfg, mesh.device, batches)
    got = shard_losses(mesh, cfg, batches)[0]
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff < 1e-4, (got, want)
    return f"backend {torch.distributed.get_backend()}, device {mesh.device}, max |dloss| {diff:.2e} over 5 steps"


@check("bf16")
def check_bf16(mesh, cfg):
    batches = gpt_batches(cfg, mesh.device)
    want = torch_reference(cfg, mesh.device, batches)
    got = shard_losses(mesh, cfg, batches, sf.MixedPrecision(torch.bfloat16, torch.float32))[0]
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert all(x == x for x in got) and diff < 5e-2, (got, want)
    return f"max |dloss| vs fp32 torch {diff:.2e}"


@check("collectives")
def check_collectives(mesh):
    x = torch.randn(4, 6, device=mesh.device, dtype=torch.float64, requires_grad=True)

    def f(x):
        y = sf.psum(x, "data") + sf.all_gather(x, "data") + sf.psum_scatter(x, "data")
        y = y + sf.ppermute(x, "data", [(0, 0)]) + sf.all_to_all(x, "data", 0, 1)
        return sf.psum((y ** 2).sum(), "data")  # invariant, as out_specs P() promises (check_vma)

    loss = sf.shard_map(f, mesh, sf.P("data"), sf.P())
    grads = mesh.run(lambda: torch.autograd.grad(loss(x), x)[0])[0]
    want = torch.autograd.grad(((5 * x) ** 2).sum(), x)[0]  # world 1: every collective is the identity
    assert torch.allclose(grads, want), (grads, want)
    return f"5 collectives and their transposes on {x.device}"


@check("checkpoint")
def check_checkpoint(mesh, cfg):
    _, step, shards, state = shard_losses(mesh, cfg, gpt_batches(cfg, mesh.device, n=2))
    specs = {"params": step.specs, "opt": ckpt.specs_like(state, step.specs, shards)}
    path = os.path.join(tempfile.mkdtemp(), "step_000002")
    ckpt.save(path, {"params": shards, "opt": state}, mesh, specs, blocking=False).wait()
    like = {"params": shards, "opt": state}
    back = ckpt.load(path, like, mesh, specs)
    pairs = list(zip(torch.utils._pytree.tree_leaves(back), torch.utils._pytree.tree_leaves(like)))
    assert all(a.device == b.device and torch.equal(a, b) for a, b in pairs if isinstance(a, torch.Tensor))
    return f"{len(pairs)} leaves round-tripped on {mesh.device}"


@check("ensembles")
def check_ensembles(mesh):
    g = torch.Generator().manual_seed(3)
    members = [torch.utils._pytree.tree_map(lambda t: t.to(mesh.device), mlp_params(g, [5, 7, 3])) for _ in range(3)]
    batch = (torch.randn(8, 5, generator=g).to(mesh.device), torch.randn(8, 3, generator=g).to(mesh.device))
    step = sf.shard(mlp_loss, mesh)
    shards = [step.shard_params(p) for p in members]
    stacked = torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *shards)
    got = torch.func.vmap(torch.func.grad(step), in_dims=(0, None))(stacked, batch)
    loop = [torch.func.grad(step)(s, batch) for s in shards]
    want = torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *loop)
    diff = max((a - b).abs().max().item() for a, b in zip(torch.utils._pytree.tree_leaves(got),
                                                          torch.utils._pytree.tree_leaves(want)))
    assert diff < 1e-5, diff
    return f"3 members, max |dgrad| {diff:.1e}"


@check("gloo-2rank")
def check_gloo_two_ranks(device: str):
    g = torch.Generator().manual_seed(4)
    params = mlp_params(g, [6, 8, 3])
    batch = (torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g))

    def body():
        mesh = sf.init_mesh({"data": 2}, device=device, timeout=60)
        step = sf.shard(mlp_loss, mesh)
        shards = step.shard_params(params)
        local = tuple(t.chunk(2)[mesh.rank].to(mesh.device) for t in batch)
        for _ in range(3):
            grads = torch.func.grad(step)(shards, local)
            shards = torch.utils._pytree.tree_map(lambda p, q: p - 0.1 * q, shards, grads)
        return torch.utils._pytree.tree_map(lambda t: t.cpu(), step.unshard_params(shards))

    got = run_multiprocess(body, 2, timeout=120)[0]
    ref = params
    for _ in range(3):
        grads = torch.func.grad(lambda p: sum(mlp_loss(p, tuple(t.chunk(2)[r] for t in batch)) for r in range(2)) / 2)(ref)
        ref = torch.utils._pytree.tree_map(lambda p, q: p - 0.1 * q, ref, grads)
    diff = max_diff(got, ref)
    assert diff < 1e-5, diff
    return f"params after 3 steps, max |d| {diff:.1e}"


@check("compressed")
def check_compressed(mesh, cfg):
    batches = gpt_batches(cfg, mesh.device)
    want = torch_reference(cfg, mesh.device, batches)
    diffs = {}
    for name, wire in (("int8", "int8"), ("fp8", torch.float8_e4m3fn)):
        got = shard_losses(mesh, cfg, batches, sf.MixedPrecision(all_gather_dtype=wire, block_size=256))[0]
        diffs[name] = max(abs(a - b) for a, b in zip(got, want))
        assert all(x == x for x in got) and diffs[name] < 5e-2, (name, got, want)
    return f"world 1, max |dloss| vs fp32 torch: {diffs}"


@check("compressed-2rank")
def check_compressed_two_ranks(device: str) -> str:
    g = torch.Generator().manual_seed(5)
    params = mlp_params(g, [64, 96, 3])
    batch = (torch.randn(8, 64, generator=g), torch.randn(8, 3, generator=g))
    mp = sf.MixedPrecision(all_gather_dtype="int8", reduce_scatter_dtype="int8", block_size=64)

    def body(dev):
        mesh = sf.init_mesh({"data": 2}, device=dev, timeout=60)
        step = sf.shard(mlp_loss, mesh, mixed_precision=mp)
        shards = step.shard_params(params)
        local = tuple(t.chunk(2)[mesh.rank].to(mesh.device) for t in batch)
        for _ in range(3):
            grads, _ = step.grad_and_value(shards, local)
            shards = torch.utils._pytree.tree_map(lambda p, q: p - 0.1 * q, shards, grads)
        return torch.utils._pytree.tree_map(lambda t: t.cpu(), step.unshard_params(shards))

    got = run_multiprocess(body, 2, device, timeout=120)[0]
    ref = run_multiprocess(body, 2, "cpu", timeout=120)[0]
    diff = max_diff(got, ref)
    assert diff < 1e-5, diff
    return f"params after 3 steps vs CPU, max |d| {diff:.1e}"


@check("traced")
def check_traced(mesh, cfg):
    batches = gpt_batches(cfg, mesh.device)
    want = shard_losses(mesh, cfg, batches, fused=False)[0]
    torch.manual_seed(0)
    model = GPT(cfg).to(mesh.device)
    _, params = sf.functional(model)
    apply = sf.traced_apply(model)
    step = sf.shard(lambda p, b: apply(p, *b), mesh)
    opt = sf.optim.adamw(1e-3)
    train = sf.jit(step, opt, backend="inductor" if mesh.device.type != "cpu" else "aot_eager", inplace=True)
    shards = step.shard_params(params)
    state = opt.init(shards)
    got = []
    for batch in batches:
        shards, state, loss = train(shards, state, batch)
        got.append(float(loss))
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff < 1e-4, (got, want)
    return f"max |dloss| vs eager train_step {diff:.2e} over 5 steps; graph bytes {train.stats()}"


@check("fused")
def check_fused(mesh, cfg):
    device = mesh.device
    g = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(33, 17, generator=g), "b": torch.randn(17, generator=g), "s": torch.randn((), generator=g),
              "h": torch.randn(64, 8, generator=g).bfloat16()}
    params = {k: v.to(device) for k, v in params.items()}
    grads = [{k: torch.randn(v.shape, generator=g).to(device, v.dtype) for k, v in params.items()} for _ in range(10)]
    ours = sf.optim.adamw(1e-2, weight_decay=0.1, fused=True)
    mine = {k: v.clone() for k, v in params.items()}
    state = ours.init(mine)
    for grad in grads:
        updates, state = ours.update({k: v.clone() for k, v in grad.items()}, state, mine)
        mine = sf.optim.apply_updates(mine, updates)
    theirs = {k: v.clone().requires_grad_() for k, v in params.items()}
    topt = torch.optim.AdamW(theirs.values(), lr=1e-2, weight_decay=0.1, fused=True)
    for grad in grads:
        for k, p in theirs.items():
            p.grad = grad[k].clone()
        topt.step()
    adam = state[0]
    for k, p in theirs.items():
        for what, a, b in [("param", mine[k], p.detach()), ("exp_avg", adam.mu[k], topt.state[p]["exp_avg"]),
                           ("exp_avg_sq", adam.nu[k], topt.state[p]["exp_avg_sq"])]:
            assert a.device == b.device and torch.equal(a, b), \
                f"{what} of {k} ({b.dtype}): max |d| {(a.float() - b.float()).abs().max().item():.2e}"
    batches = gpt_batches(cfg, device)
    want = torch_reference(cfg, device, batches, fused=True)
    got = shard_losses(mesh, cfg, batches, fused=True)[0]
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff < 1e-4, (got, want)
    return (f"optimizer: 4 leaves (fp32, bf16) x 10 steps bit-identical to torch's fused AdamW; "
            f"training: max |dloss| {diff:.2e} over 5 steps")


@check("compiled")
def check_compiled(mesh, cfg):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    batches = gpt_batches(cfg, mesh.device)
    want = shard_losses(mesh, cfg, batches)[0]
    t0 = time.perf_counter()
    got = shard_losses(mesh, cfg, batches, compile=True)[0]
    seconds = time.perf_counter() - t0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff <= 1e-5, (got, want)
    assert graphs == 1, f"{graphs} graphs for {cfg.n_layer} blocks of one class (expected 1: a recompile?)"
    return f"max |dloss| vs eager blocks {diff:.2e} over 5 steps; {graphs} graph; compile + 5 steps {seconds:.1f} s"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, device {args.device}", flush=True)
    check_gloo_two_ranks(args.device)  # first: it forks, and a forked child must not inherit a CUDA context
    check_compressed_two_ranks(args.device)
    if args.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(0)}", flush=True)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29517")}.items():
        os.environ.setdefault(key, value)
    mesh = sf.init_mesh({"data": 1}, backend="nccl" if args.device == "cuda" else "gloo",
                        device="cuda:0" if args.device == "cuda" else "cpu", timeout=120)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    check_train(mesh, cfg)
    check_bf16(mesh, cfg)
    check_collectives(mesh)
    check_checkpoint(mesh, cfg)
    check_ensembles(mesh)
    check_fused(mesh, cfg)
    check_compiled(mesh, cfg)
    check_compressed(mesh, cfg)
    check_traced(mesh, cfg)
    torch.distributed.destroy_process_group()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "device_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=2)
    failed = [name for name, r in RESULTS.items() if not r["ok"]]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
