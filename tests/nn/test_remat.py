"""sf.remat: the same values and gradients as without it, under every entry point, with
the recomputation the policy asks for; inside sf.shard, no extra all-gather; and the GPT's
memory peak at least halved."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import shardfn as sf
import shardfn._remat as remat_module
from allocations import net_and_peak
from shardfn._backend import ops
from shardfn.testing.models import GPT, GPTConfig

P = sf.remat_policies
POLICIES = [P.nothing_saveable, P.dots_saveable, P.save_only_these_names("h"), P.everything_saveable]
tree_leaves = torch.utils._pytree.tree_leaves


def _block(p, x):
    h = sf.tag(torch.tanh(x @ p["w1"]), "h")
    return torch.sin(h @ p["w2"]) + x


def _params(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(4, 8, generator=g, dtype=dtype), "w2": torch.randn(8, 4, generator=g, dtype=dtype)}


def _x(n=5, seed=1):
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _maxdiff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(tree_leaves(a), tree_leaves(b)))


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_remat_equals_no_remat_under_every_transform(policy):
    p, x = _params(), _x()
    f = sf.remat(_block, policy=policy)
    loss = lambda fn: (lambda p, x: fn(p, x).square().sum())  # noqa: E731

    assert _maxdiff(torch.func.grad(loss(f))(p, x), torch.func.grad(loss(_block))(p, x)) <= 1e-12
    out, pull = torch.func.vjp(lambda p: f(p, x), p)
    ref_out, ref_pull = torch.func.vjp(lambda p: _block(p, x), p)
    ct = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    assert torch.equal(out, ref_out)
    assert _maxdiff(pull(ct), ref_pull(ct)) <= 1e-12
    tangents = _params(seed=3)
    assert _maxdiff(torch.func.jvp(lambda p: f(p, x), (p,), (tangents,))[1],
                    torch.func.jvp(lambda p: _block(p, x), (p,), (tangents,))[1]) <= 1e-12
    per_example = lambda fn: torch.func.vmap(torch.func.grad(lambda p, xi: loss(fn)(p, xi[None])), in_dims=(None, 0))  # noqa: E731
    assert _maxdiff(per_example(f)(p, x), per_example(_block)(p, x)) <= 1e-12
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    loss(f)(leaves, x).backward()
    assert _maxdiff({k: v.grad for k, v in leaves.items()}, torch.func.grad(loss(_block))(p, x)) <= 1e-12


class _Count(TorchDispatchMode):
    """Counts the aten ops that really run (remat's replay hands saved outputs back above it)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _ops_run(policy) -> dict[str, int]:
    p, x = _params(), _x()
    fn = _block if policy is None else sf.remat(_block, policy=policy)
    with _Count() as count:
        torch.func.grad(lambda p: fn(p, x).square().sum())(p)
    return count.counts


def test_policies_recompute_what_they_do_not_save():
    plain, nothing, dots, names = (_ops_run(p) for p in (None, P.nothing_saveable, P.dots_saveable,
                                                         P.save_only_these_names("h")))
    # The block's forward has 2 matmuls, 1 tanh, 1 sin; the backward (w.r.t. the weights
    # only: x needs no gradient, and the recompute does not compute one) 3 matmuls.
    assert plain["mm"] == 5 and plain["tanh"] == 1 and plain["sin"] == 1
    assert nothing["mm"] == 7 and nothing["tanh"] == 2 and nothing["sin"] == 2  # the forward again
    assert dots["mm"] == 5 and dots["tanh"] == 2 and dots["sin"] == 2  # matmul outputs handed back
    assert names["mm"] == 7 and names["tanh"] == 1 and names["sin"] == 2  # the tagged tanh handed back


def test_offload_moves_named_saves_to_the_offload_device(monkeypatch):
    calls = []
    forward = remat_module._Remat.forward

    def spy(call, *tensors):
        calls.append(call)
        return forward(call, *tensors)

    monkeypatch.setattr(remat_module._Remat, "forward", staticmethod(spy))
    p, x = _params(), _x()
    f = sf.remat(_block, policy=P.save_only_these_names("h"), offload_to="cpu")
    g = torch.func.grad(lambda p: f(p, x).square().sum())(p)
    assert _maxdiff(g, torch.func.grad(lambda p: _block(p, x).square().sum())(p)) <= 1e-12
    (call,) = calls
    kept = [t for out in call.kept.values() for t in tree_leaves(out)]
    assert len(kept) == 1 and kept[0].shape == (5, 8)  # tanh(x @ w1), the tagged value
    assert all(t.device == torch.device("cpu") for t in kept)
    assert set(call.devices.values()) == {x.device}  # where they go back to for the recompute


def test_random_draws_are_replayed():
    p, x = _params(), _x()

    def noisy(p, x, g):
        h = torch.tanh(x @ p["w1"])
        keep = torch.rand(h.shape, generator=g, dtype=h.dtype) > 0.5  # dropout's mask
        return (h * keep) @ p["w2"]

    def grads(fn):
        g = torch.Generator().manual_seed(7)
        out = torch.func.grad(lambda p: fn(p, x, g).square().sum())(p)
        return out, g.get_state()

    got, state_after = grads(sf.remat(noisy))
    want, want_state = grads(noisy)
    assert _maxdiff(got, want) <= 1e-12
    assert torch.equal(state_after, want_state)  # the caller's generator advanced once, as without remat

    torch.manual_seed(11)  # the default generator is replayed too (one process)
    global_noisy = lambda p, x: torch.nn.functional.dropout(torch.tanh(x @ p["w1"]), 0.5) @ p["w2"]  # noqa: E731
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    sf.remat(global_noisy)(leaves, x).square().sum().backward()
    torch.manual_seed(11)
    want = torch.func.grad(lambda p: global_noisy(p, x).square().sum())(p)
    assert _maxdiff({k: v.grad for k, v in leaves.items()}, want) <= 1e-12


def _layers_params(L=4, d=6):
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(d, d, generator=g, dtype=torch.float64),
            "layers": [{"w": torch.randn(d, d, generator=g, dtype=torch.float64) / 2,
                        "b": torch.randn(d, generator=g, dtype=torch.float64)} for _ in range(L)]}


def _layer(p, h):
    return sf.tag(torch.tanh(h @ p["w"] + p["b"]), "h")


def _shard_loss(policy):
    layer = _layer if policy is None else sf.remat(_layer, policy=policy)

    def loss_fn(p, x):
        h = x @ p["embed"]
        for lp in p["layers"]:
            h = layer(lp, h)  # the unit's own params: gathered by shard's schedule
        return h.square().mean()

    return loss_fn


@pytest.mark.parametrize("how", ["func", "grad_and_value", "backward"])
@pytest.mark.parametrize("policy", POLICIES[:3], ids=repr)
def test_remat_inside_shard_regathers_through_the_schedule(policy, how):
    params = _layers_params()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def run(policy):
        mesh = sf.local_mesh({"data": 2})
        step = sf.shard(_shard_loss(policy), mesh)

        def body():
            shards = step.shard_params(params)
            xl = x.chunk(2)[mesh.rank]
            step(shards, xl)  # learn the order: the measured call prefetches
            with ops.recording() as rec:
                if how == "func":
                    grads = torch.func.grad(step)(shards, xl)
                elif how == "grad_and_value":
                    grads, _ = step.grad_and_value(shards, xl)
                else:
                    leaves = torch.utils._pytree.tree_map(lambda t: t.detach().requires_grad_(), shards)
                    step(leaves, xl).backward()
                    grads = torch.utils._pytree.tree_map(lambda t: t.grad, leaves)
            return step.unshard_params(grads), [(c.op, c.axes, c.nbytes) for c in rec.records], step.stats()

        return mesh.run(body)

    for (got, sent, stats), (want, ref_sent, ref_stats) in zip(run(policy), run(None)):
        assert _maxdiff(got, want) <= 1e-12
        assert sent == ref_sent  # no extra all-gather: the recompute uses the schedule's re-gather
        assert stats["peak_gathered_bytes"] == ref_stats["peak_gathered_bytes"]


def test_gpt_blocks_under_remat_halve_the_peak_inside_shard():
    cfg = GPTConfig(n_layer=6, n_embd=64, n_head=4, vocab_size=64, block_size=64)
    torch.manual_seed(0)
    model = GPT(cfg).double()
    mesh = sf.local_mesh({"data": 2})
    measured = {}
    for remat in (None, P.nothing_saveable):
        apply_fn, params = sf.functional(model, remat=remat)
        step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)

        def body():
            idx = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(mesh.rank))
            shards = step.shard_params(params)
            step.grad_and_value(shards, (idx, idx))  # learn the order
            if mesh.rank != 0:  # one profiler per process: rank 0's thread
                return step.grad_and_value(shards, (idx, idx))[0]
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                grads, _ = step.grad_and_value(shards, (idx, idx))
            measured[remat] = net_and_peak(prof)[1]
            return grads

        measured[(remat, "grads")] = mesh.run(body)
    assert _maxdiff(measured[(None, "grads")], measured[(P.nothing_saveable, "grads")]) <= 1e-12
    assert measured[P.nothing_saveable] <= 0.5 * measured[None], measured


def test_errors_name_the_fix():
    with pytest.raises(sf.SpecError, match="policy must be one of sf.remat_policies"):
        sf.remat(_block, policy="nothing")
    with pytest.raises(sf.SpecError, match="(?s)saves none.*save_only_these_names"):
        sf.remat(_block, offload_to="cpu")
    with pytest.raises(sf.SpecError, match="name must be a string"):
        sf.tag(torch.ones(1), 3)
    with pytest.raises(sf.SpecError, match="one or more strings"):
        P.save_only_these_names()
    with pytest.raises(sf.SpecError, match="must be callable"):
        sf.remat(3)


# -- state: modules that change something in their forward ------------------------------


class _LaggedCenter(torch.nn.Module):
    """Centers its input by a running mean it reads before updating it (a buffer written
    in place), so its output depends on the state the forward started from."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d, dtype=torch.float64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        out = x - self.mean
        self.mean.mul_(0.5).add_(0.5 * x.detach().mean(0))
        self.calls += 1
        return out


def _stateful_model():
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), _LaggedCenter(6), nn.Tanh(), nn.Linear(6, 3),
                         nn.BatchNorm1d(3)).double()


@pytest.mark.parametrize("how", ["func", "backward"])
def test_state_written_in_the_forward_is_written_once_and_read_as_before(how):
    plain, rematted = _stateful_model(), _stateful_model()
    p = {k: v.detach() for k, v in plain.named_parameters()}
    xs = [torch.randn(8, 4, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in range(3)]

    def plain_grads(x):  # the reference: plain autograd (torch.func refuses writes to a module's buffers)
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        torch.func.functional_call(plain, leaves, (x,)).square().sum().backward()
        return {k: v.grad for k, v in leaves.items()}

    block = sf.remat(lambda p, x: torch.func.functional_call(rematted, p, (x,)))

    def remat_grads(x):
        if how == "func":
            return torch.func.grad(lambda p: block(p, x).square().sum())(p)
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        block(leaves, x).square().sum().backward()
        return {k: v.grad for k, v in leaves.items()}

    for x in xs:  # three steps: each recompute must start from the state its forward saw
        assert _maxdiff(remat_grads(x), plain_grads(x)) <= 1e-12
        for (name, got), (_, want) in zip(rematted.named_buffers(), plain.named_buffers()):
            assert torch.equal(got, want), name  # running_mean/var, num_batches_tracked, mean, calls: once per forward
    assert int(rematted[1].num_batches_tracked) == 3 and int(rematted[2].calls) == 3


def test_state_inside_shard_and_functional():
    # sf.functional(remat=True) on blocks with BatchNorm, inside sf.shard: the same gradients
    # as without remat, step after step (the per-thread copies carry the running statistics).
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), _LaggedCenter(6), nn.Tanh())
                            for _ in range(3)]).double()
    x = torch.randn(3, 8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run(remat):
        apply_fn, params = sf.functional(model, remat=remat)
        mesh = sf.local_mesh({"data": 2})
        step = sf.shard(lambda p, x: apply_fn(p, x).square().mean(), mesh)

        def body():
            shards = step.shard_params(params)
            return [step.unshard_params(step.grad_and_value(shards, xi.chunk(2)[mesh.rank])[0]) for xi in x]

        return mesh.run(body)

    assert _maxdiff(run(True), run(None)) <= 1e-12


@pytest.mark.parametrize("how", ["func", "backward"])
def test_state_that_moves_the_output_is_read_by_the_recompute_as_the_forward_read_it(how):
    """As above, with the lagged mean where its value reaches the output (before a tanh; after
    a BatchNorm it moves by rounding only, before one it cancels): a recompute reading the
    state the forward left changes the gradients by ~1e-2, a second write changes the buffers."""
    nn = torch.nn

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), _LaggedCenter(6), nn.Tanh(), nn.BatchNorm1d(6), nn.Linear(6, 3)).double()

    plain, rematted = model(), model()
    initial = {k: v.clone() for k, v in plain.named_buffers()}
    p = {k: v.detach() for k, v in plain.named_parameters()}
    xs = [2 + torch.randn(8, 4, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in range(3)]

    def plain_grads(x):
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        torch.func.functional_call(plain, leaves, (x,)).square().sum().backward()
        return {k: v.grad for k, v in leaves.items()}

    block = sf.remat(lambda p, x: torch.func.functional_call(rematted, p, (x,)))

    def remat_grads(x):
        if how == "func":
            return torch.func.grad(lambda p: block(p, x).square().sum())(p)
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        block(leaves, x).square().sum().backward()
        return {k: v.grad for k, v in leaves.items()}

    for x in xs:
        assert _maxdiff(remat_grads(x), plain_grads(x)) <= 1e-12
        for (name, got), (_, want) in zip(rematted.named_buffers(), plain.named_buffers()):
            assert torch.equal(got, want), name
    for name in ("1.mean", "3.running_mean", "3.running_var"):
        assert (dict(rematted.named_buffers())[name] - initial[name]).abs().max() > 1e-2, name


@pytest.mark.parametrize("remat", [True, P.dots_saveable])
def test_state_inside_shard_and_functional_buffers_equal_no_remat(remat):
    """The buffers themselves, not only the gradients: BatchNorm's running statistics (which
    a train-mode forward writes but never reads, so a second write in the recompute changes
    no output) and the lagged mean, on every rank's module copy, after three steps, equal
    those without remat bit for bit, and moved far more than rounding from where they began."""
    import threading

    nn = torch.nn
    torch.manual_seed(0)
    # the lagged mean before the tanh, the BatchNorm after: right after a BatchNorm it would
    # average normalized (zero-mean) activations and move by rounding only (as in the two tests
    # above), right before one it would cancel (BatchNorm ignores a shift per feature)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), _LaggedCenter(6), nn.Tanh(), nn.BatchNorm1d(6))
                            for _ in range(2)]).double()
    initial = {k: v.clone() for k, v in model.named_buffers()}
    x = 3 + torch.randn(3, 8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    copies = {}  # rank thread -> its module copy ([Note: a module copy per thread]; hooks are copied with it)
    model.register_forward_hook(lambda m, args, out: copies.__setitem__(threading.get_ident(), m))

    def run(remat):
        apply_fn, params = sf.functional(model, remat=remat)
        mesh = sf.local_mesh({"data": 2})
        step = sf.shard(lambda p, x: apply_fn(p, x).square().mean(), mesh)

        def body():
            shards = step.shard_params(params)
            grads = [step.unshard_params(step.grad_and_value(shards, xi.chunk(2)[mesh.rank])[0]) for xi in x]
            return grads, {k: v.clone() for k, v in copies[threading.get_ident()].named_buffers()}

        return mesh.run(body)

    got, want = run(remat), run(None)
    assert len(got) == len(want) == 2
    # the gradients read the lagged mean the forward read (the recompute must not see its update)
    assert _maxdiff([g for g, _ in got], [w for w, _ in want]) <= 1e-12
    got, want = [b for _, b in got], [b for _, b in want]
    for rank, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w) == sorted(initial)
        for name in w:
            assert torch.equal(g[name], w[name]), (rank, name, g[name], w[name])
        assert int(g["0.3.num_batches_tracked"]) == 3 and int(g["1.1.calls"]) == 3
        for name in ("0.3.running_mean", "0.3.running_var", "1.3.running_mean", "0.1.mean", "1.1.mean"):
            assert (g[name] - initial[name]).abs().max() > 1e-2, name  # state that moved, not rounding
    assert all(torch.equal(v, initial[k]) for k, v in model.named_buffers())  # the original is untouched


class _History(torch.nn.Module):
    """Keeps what it saw in a Python list and uses all of it: state remat cannot replay."""

    def __init__(self):
        super().__init__()
        self.seen: list = []

    def forward(self, x):
        self.seen.append(x.detach())
        return x * torch.cat(self.seen).mean()


class _Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.calls


def test_state_remat_cannot_replay_raises():
    p, x = _params(), _x()
    history = _History()
    f = sf.remat(lambda p, x: history(_block(p, x)))
    with pytest.raises(sf.SpecError, match=r"(?s)recompute of function .*<lambda>' in the backward is not its "
                                            r"forward: at torch call #\d+ the forward called torch.cat -> \(5, 4\) "
                                            r"float64, the recompute torch.cat -> \(10, 4\) float64.*KV cache.*"
                                            r"Fix: for transformers models do not pass use_cache=True.*keep the "
                                            r"state out of the remat'd function"):
        torch.func.grad(lambda p: f(p, x).square().sum())(p)
    counter = _Counter()
    f = sf.remat(lambda p, x: counter(_block(p, x)))
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    with pytest.raises(sf.SpecError, match=r"(?s)gave output #0 another value than its forward.*Python counter"):
        f(leaves, x).square().sum().backward()


def test_writing_an_argument_in_place_raises():
    p, x = _params(), _x()
    f = sf.remat(lambda p, x: _block(p, x.mul_(2)))
    with pytest.raises(sf.SpecError, match=r"(?s)writes its tensor argument #2 in place \(aten.mul_.Tensor, "
                                            r"shape \(5, 4\)\).*Fix: compute a new tensor"):
        torch.func.grad(lambda p: f(p, x).square().sum())(p)


def test_state_read_through_another_dtype_view():
    class Bits(torch.nn.Module):  # writes a float64 buffer, reads it through an int64 view made at init
        def __init__(self):
            super().__init__()
            self.register_buffer("value", torch.zeros(4, dtype=torch.float64))
            self.bits = self.value.view(torch.int64)

        def forward(self, x):
            out = x * (1 + (self.bits != 0).double())  # 1 before the first write, 2 after
            self.value.add_(1.0)
            return out

    p, x = _params(), _x()
    module = Bits()
    f = sf.remat(lambda p, x: module(_block(p, x)))
    got = torch.func.grad(lambda p: f(p, x).square().sum())(p)
    assert _maxdiff(got, torch.func.grad(lambda p: _block(p, x).square().sum())(p)) <= 1e-12  # read as before
    assert torch.equal(module.value, torch.ones(4, dtype=torch.float64))  # written once


class _Scale(torch.autograd.Function):
    """A user's Function whose forward reads attributes and switches grad mode (as
    collectives and fused kernels do): one call to remat's check on both paths."""

    @staticmethod
    def forward(x, k):
        with torch.no_grad():
            assert x.dtype == torch.float64 and x.shape[-1] == 4
            return x * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.k = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return _Scale.apply(g, ctx.k), None


@pytest.mark.parametrize("how", ["grad", "backward"])
def test_an_autograd_function_inside_is_one_call(how):
    # [Note: an autograd.Function is one call]: under torch.func.vjp (the recompute) a
    # Function is one custom_function_call, in the no-grad forward its forward's own calls
    p, x = _params(), _x()

    def block(p, x):
        return _Scale.apply(_block(p, x), 3.0).tanh()

    loss = lambda f: (lambda p: f(p, x).square().sum())
    if how == "grad":
        got, want = torch.func.grad(loss(sf.remat(block)))(p), torch.func.grad(loss(block))(p)
    else:
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        loss(sf.remat(block))(leaves).backward()
        got, want = {k: v.grad for k, v in leaves.items()}, torch.func.grad(loss(block))(p)
    assert _maxdiff(got, want) <= 1e-12
