"""`torch.func.grad(step)` of a whole shard step runs below the transform, on the path of
`step.grad_and_value` ([Note: torch.func.grad of a whole step] in shardfn/_fsdp/funcgrad.py):
same gradients as the wrapped path, its memory instead of functorch's, and the cases it
must leave to the wrapped path."""

import contextlib

import pytest
import torch

import shardfn as sf
from shardfn._fsdp.funcgrad import wrapped
from shardfn.testing._ddp import local_batch
from shardfn.testing.models import GPT, GPTConfig, mlp_loss, mlp_params

D = torch.float64
leaves = torch.utils._pytree.tree_leaves
_wrapped_tensor = torch._C._functorch.is_functorch_wrapped_tensor


def _mlp_case(seed=5):
    g = torch.Generator().manual_seed(seed)
    params = mlp_params(g, [4, 6, 5, 3], dtype=D)
    batch = (torch.randn(8, 4, generator=g, dtype=D), torch.randn(8, 3, generator=g, dtype=D))
    return params, batch


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(leaves(a), leaves(b)))


HSDP = {"data_axes": ("replica", "shard"), "shard_axes": "shard"}


@pytest.mark.parametrize("kwargs", [{}, {"frozen": lambda path: path[:2] == ("layers", 1)},
                                    {"reshard_after_forward": False, "prefetch": 0}, HSDP,
                                    {"check_finite": True}],
                         ids=["plain", "frozen", "no-reshard", "hsdp", "check_finite"])
def test_grad_equals_the_wrapped_path_and_grad_and_value(kwargs):
    params, batch = _mlp_case()
    mesh = sf.local_mesh({"replica": 2, "shard": 2} if kwargs is HSDP else {"data": 2})
    step = sf.shard(mlp_loss, mesh, **kwargs)

    def body():
        shards = step.shard_params(params)
        local = local_batch(batch, mesh.rank, mesh.size)
        fast, fast_loss = torch.func.grad_and_value(step)(shards, local)
        with wrapped():
            ref, ref_loss = torch.func.grad_and_value(step)(shards, local)
        direct, direct_loss = step.grad_and_value(shards, local)
        same_tree = torch.utils._pytree.tree_structure(fast) == torch.utils._pytree.tree_structure(ref)
        return (same_tree, _max_diff(fast, ref), _max_diff(fast, direct), float(fast_loss) == float(ref_loss),
                float(fast_loss) == float(direct_loss), any(_wrapped_tensor(x) for x in leaves(fast)))

    for same_tree, d_ref, d_direct, loss_ref, loss_direct, still_wrapped in mesh.run(body):
        assert same_tree and not still_wrapped
        assert d_ref < 1e-14 and d_direct == 0.0  # the wrapped path sums in another order
        assert loss_ref and loss_direct


def test_loss_fn_runs_below_the_transform_only_where_exact():
    """Whether `loss_fn` runs inside a functorch transform says which path ran: below it
    for grad and vjp of the shards; at its level under vmap, jvp, has_aux, or when the
    batch is differentiated too."""
    params, batch = _mlp_case()
    mesh = sf.local_mesh({"data": 2})
    seen = {0: [], 1: []}  # per rank thread

    def loss_fn(p, b):
        seen[mesh.rank].append(bool(torch._C._functorch.get_interpreter_stack()))
        return mlp_loss(p, b)

    step = sf.shard(loss_fn, mesh)
    aux_step = sf.shard(lambda p, b: (loss_fn(p, b), b[0].sum()), mesh, has_aux=True)

    def body():
        shards = step.shard_params(params)
        aux_step.shard_params(params)
        x, y = local_batch(batch, mesh.rank, mesh.size)
        out = {}

        def record(name, fn):
            seen[mesh.rank].clear()
            fn()
            out[name] = list(seen[mesh.rank])

        record("grad", lambda: torch.func.grad(step)(shards, (x, y)))
        record("vjp", lambda: torch.func.vjp(lambda s: step(s, (x, y)), shards)[1](torch.tensor(2.0, dtype=D)))
        record("vjp(batch too)", lambda: torch.func.vjp(step, shards, (x, y))[1](torch.tensor(2.0, dtype=D)))
        record("vmap(grad)", lambda: torch.func.vmap(torch.func.grad(step), in_dims=(None, 0))(
            shards, (x[:, None], y[:, None])))
        record("jvp", lambda: torch.func.jvp(lambda s: step(s, (x, y)), (shards,),
                                             (torch.utils._pytree.tree_map(torch.ones_like, shards),)))
        record("has_aux", lambda: torch.func.grad(aux_step, has_aux=True)(shards, (x, y)))
        record("argnums=(0, 1)", lambda: torch.func.grad(step, argnums=(0, 1))(shards, (x, y)))
        return out

    for out in mesh.run(body):
        assert out["grad"] == [False] and out["vjp"] == [False]
        assert out["vmap(grad)"] == [True]  # vmap runs the step once for the whole batch
        for name in ("vjp(batch too)", "jvp", "has_aux", "argnums=(0, 1)"):
            assert out[name] and all(out[name]), name


def test_composed_uses_equal_the_wrapped_path():
    """The cotangent scales the gradient (vjp, a scaled loss), other terms of the shards add
    to it, the batch's own gradient (argnums) takes the wrapped path."""
    params, batch = _mlp_case(seed=7)
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(mlp_loss, mesh)

    def body():
        shards = step.shard_params(params)
        xy = local_batch(batch, mesh.rank, mesh.size)

        def regularized(s, b):
            return 3.0 * step(s, b) + sum((t * t).sum() for t in leaves(s))

        def cases():
            return [
                torch.func.grad(regularized)(shards, xy),
                torch.func.vjp(lambda s: step(s, xy), shards)[1](torch.tensor(-0.5, dtype=D))[0],
                torch.func.grad(step, argnums=(0, 1))(shards, xy),
            ]

        fast = cases()
        with wrapped():
            ref = cases()
        return [_max_diff(a, b) for a, b in zip(fast, ref)]

    for diffs in mesh.run(body):
        assert max(diffs) < 1e-13, diffs


def test_torch_function_modes_around_the_step_still_apply():
    """functorch turns TorchFunctionModes off inside a custom Function's forward; StepGrad
    enters the caller's again, so loss_fn runs under them (here: a counter of tanh calls)."""
    params, batch = _mlp_case()
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(mlp_loss, mesh)

    class CountTanh(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += getattr(func, "__name__", "") == "tanh"
            return func(*args, **(kwargs or {}))

    def body():
        shards = step.shard_params(params)
        xy = local_batch(batch, mesh.rank, mesh.size)
        counts = []
        for path in (contextlib.nullcontext, wrapped):
            with path(), CountTanh() as mode:
                torch.func.grad(step)(shards, xy)
            counts.append(mode.n)
        return counts

    assert mesh.run(body) == [[2, 2]] * 2  # two hidden layers


def test_a_tensor_of_the_transform_captured_by_loss_fn_is_an_error():
    """Below the transform, a tensor that reaches loss_fn other than through its arguments
    would get no gradient: the first call says so instead."""
    params, batch = _mlp_case()
    mesh = sf.local_mesh({"data": 2})
    captured = {}
    step = sf.shard(lambda p, b: mlp_loss(p, b) * captured["scale"], mesh)

    def body():
        shards = step.shard_params(params)
        xy = local_batch(batch, mesh.rank, mesh.size)

        def f(s, scale):
            captured["scale"] = scale  # set inside the transformed function: a tensor of its level
            return step(s, xy)

        try:
            torch.func.grad(f, argnums=(0, 1))(shards, torch.tensor(2.0, dtype=D))
        except sf.ShardingError as e:
            return str(e)
        return None

    for msg in mesh.run(body):
        assert msg is not None
        assert "loss_fn used a tensor of the transform that is not one of its arguments" in msg
        assert "got a tensor of shape ()" in msg and "Fix: pass it to the step as part of the batch" in msg


def test_memory_is_the_grad_and_value_path_not_functorchs():
    """Peak bytes of one gradient on rank 0 (allocator events, deterministic): functorch's
    own differentiation keeps the backward's intermediates (create_graph=True); below the
    transform the peak is step.grad_and_value's (and the cotangent's copy of the gradients)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    apply_fn, params = sf.functional(GPT(cfg))
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
    paths = {
        "func": lambda s, b: torch.func.grad_and_value(step)(s, b),
        "direct": lambda s, b: step.grad_and_value(s, b),
        "wrapped": lambda s, b: _in_wrapped(lambda: torch.func.grad_and_value(step)(s, b)),
    }

    def body():
        g = torch.Generator().manual_seed(mesh.rank)
        batch = tuple(torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g) for _ in range(2))
        shards = step.shard_params(params)
        peaks = {}
        for name, fn in paths.items():
            fn(shards, batch)  # the second call prefetches in the learned order
            if mesh.rank == 0:
                with sf.measure_memory("cpu") as m:
                    fn(shards, batch)  # the gradients are freed inside the measured region
                peaks[name] = m.peak_bytes
            else:
                fn(shards, batch)
        return peaks, sum(x.numel() * x.element_size() for x in leaves(shards))

    peaks, shard_bytes = mesh.run(body)[0]
    # + at most one copy of this rank's gradients: StepGrad's backward scales them by the cotangent
    assert peaks["func"] <= peaks["direct"] + shard_bytes, (peaks, shard_bytes)
    assert peaks["wrapped"] > 1.3 * peaks["func"], peaks


def _in_wrapped(fn):
    with wrapped():
        return fn()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_jax_loop_equals_train_step_on_processes():
    """The loop the docs teach (grad_and_value, opt.update, apply_updates) on two gloo
    processes: the same losses and parameters as sf.train_step, bit for bit."""
    from shardfn.testing import run_multiprocess

    def rank_main():
        mesh = sf.init_mesh({"data": 2})
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        apply_fn, params = sf.functional(GPT(cfg))
        g = torch.Generator().manual_seed(mesh.rank)
        batch = tuple(torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g) for _ in range(2))
        step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
        opt = sf.optim.adamw(1e-2)
        shards, state, losses = step.shard_params(params), None, []
        state = opt.init(shards)
        for _ in range(3):
            grads, loss = torch.func.grad_and_value(step)(shards, batch)
            updates, state = opt.update(grads, state, shards)
            shards = sf.optim.apply_updates(shards, updates)
            losses.append(float(loss))
        train = sf.train_step(step, opt)
        ref, ref_state, ref_losses = step.shard_params(params), None, []
        ref_state = opt.init(ref)
        for _ in range(3):
            ref, ref_state, loss = train(ref, ref_state, batch)
            ref_losses.append(float(loss))
        return losses == ref_losses, _max_diff(shards, ref)

    assert run_multiprocess(rank_main, 2, timeout=300) == [(True, 0.0)] * 2
