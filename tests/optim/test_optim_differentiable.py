"""Pure mode is differentiable by torch.func, exactly ([Note: differentiable pure mode] in
shardfn/optim/_flat.py): hypergradients, Jacobians, jvp and vmap equal central finite
differences (or a loop) in float64; tensor hyperparameters are never read on the host; the
per-leaf path gives the foreach path's bits; in-place and fused modes refuse torch.func."""

from __future__ import annotations

import warnings

import optree
import pytest
import torch

import shardfn as sf
import shardfn.optim as optim
from optim_testutil import NS, clone_tree, leaves

D = torch.float64
H = 1e-6  # central differences: truncation ~H^2, rounding ~1e-16 / H
TOL = 1e-6  # relative
HOST_READ = "Converting a tensor with requires_grad=True to a scalar"


def _t(x):
    return torch.tensor(x, dtype=D)


# -- a smooth least-squares problem --------------------------------------------------------

_GEN = torch.Generator().manual_seed(0)
X = torch.randn(16, 4, generator=_GEN, dtype=D)
Y = torch.randn(16, generator=_GEN, dtype=D)
P0 = {"w": torch.randn(4, generator=_GEN, dtype=D), "b": torch.randn((), generator=_GEN, dtype=D)}


def _loss(params):
    return ((X @ params["w"] + params["b"] - Y) ** 2).mean()


def _loss_after(opt, k, params=P0):
    """The loss after ``k`` steps of ``opt`` from ``params`` (gradients by torch.func.grad)."""
    state = opt.init(params)
    for _ in range(k):
        grads = torch.func.grad(_loss)(params)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return _loss(params)


def _central(f, x):
    """d f / d x of a scalar function of a 0-dim tensor, by central differences."""
    return (f(x + H) - f(x - H)) / (2 * H)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _close(got, want):
    """Relative error <= TOL, or both ~0 (a derivative that is exactly 0, e.g. Adam's first
    step does not depend on b2, comes out of reverse mode as rounding, ~1e-14)."""
    return float((got - want).abs().max()) <= TOL * float(want.abs().max()) + 1e-12


_WARMUP_COSINE = optim.warmup_cosine_decay_schedule(0.2, 1.0, 2, 5, end_value=0.1)

# make(lr) -> optimizer; lr a 0-dim float64 tensor
HYPERGRADIENT = {
    "sgd": (lambda lr: optim.sgd(lr), 0.1),
    "sgd-momentum": (lambda lr: optim.sgd(lr, momentum=0.9, weight_decay=0.01), 0.1),
    "sgd-nesterov": (lambda lr: optim.sgd(lr, momentum=0.9, nesterov=True), 0.1),
    "adam": (lambda lr: optim.adam(lr, weight_decay=0.01), 0.05),
    "adamw": (lambda lr: optim.adamw(lr, weight_decay=0.1), 0.05),
    # sign() has derivative 0 wherever it has one; with weight decay the steps are still
    # nonlinear in lr, p_k = p_{k-1} (1 - lr wd) - lr sign(.), and smooth away from sign flips
    "lion": (lambda lr: optim.lion(lr, weight_decay=0.1), 0.05),
    # a learnable scale times a warmup/cosine schedule, the tensor reaching every step's lr
    "adamw-schedule": (lambda lr: optim.adamw(lambda k: lr * _WARMUP_COSINE(k), weight_decay=0.1), 0.05),
    # the built-in schedule with a tensor peak value
    "sgd-cosine-peak": (lambda lr: optim.sgd(optim.warmup_cosine_decay_schedule(0.2 * lr, lr, 1, 4, end_value=0.01),
                                             momentum=0.5), 0.1),
    "clip-adamw": (lambda lr: optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(lr)), 0.05),
}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", list(HYPERGRADIENT))
def test_hypergradient_of_the_learning_rate_equals_central_differences(name, k):
    make, lr = HYPERGRADIENT[name]
    f = lambda lr: _loss_after(make(lr), k)  # noqa: E731
    got = torch.func.grad(f)(_t(lr))
    want = _central(f, _t(lr))
    assert float(want) != 0.0
    assert _rel(got, want) <= TOL, f"{name}, k={k}: {float(got)} vs central differences {float(want)}"


@pytest.mark.parametrize("k", [1, 3])
def test_hypergradient_through_inject_hyperparams_state(k):
    """d loss / d state.hyperparams, every hyperparameter of adamw at once."""
    opt = optim.inject_hyperparams(optim.adamw)(0.05, weight_decay=0.1)
    state0 = opt.init(P0)

    def f(hyperparams):
        params, state = P0, state0._replace(hyperparams=hyperparams)
        for _ in range(k):
            updates, state = opt.update(torch.func.grad(_loss)(params), state, params)
            params = optim.apply_updates(params, updates)
        return _loss(params)

    got = torch.func.grad(f)(state0.hyperparams)
    assert set(got) == {"learning_rate", "b1", "b2", "eps", "weight_decay"}
    for name, value in state0.hyperparams.items():
        want = _central(lambda x: f({**state0.hyperparams, name: x}), value)
        assert _close(got[name], want), f"d loss / d {name}: {float(got[name])} vs {float(want)}"


def test_lion_update_is_linear_in_the_learning_rate():
    """Lion's update is -lr * (sign(...) + wd * p): its derivative by lr is update / lr."""
    grads = torch.func.grad(_loss)(P0)
    state = optim.lion(0.1).init(P0)
    f = lambda lr: optim.lion(lr, weight_decay=0.1).update(grads, state, P0)[0]  # noqa: E731
    lr = _t(0.1)
    jac = torch.func.jacrev(f)(lr)
    updates = f(lr)
    for key in P0:
        assert torch.allclose(jac[key], updates[key] / lr, rtol=1e-14, atol=0)
        assert _rel(jac[key], (f(lr + H)[key] - f(lr - H)[key]) / (2 * H)) <= TOL


# -- Jacobians of every transform's update ----------------------------------------------------

# Adam's eps is 1e-3 here: at step 1 the update is g / (|g| + eps'), whose derivative by g is
# ~eps / g^2, below the differences' rounding (~1e-10) for eps = 1e-8.
TRANSFORMS = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd-momentum": lambda: optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optim.adam(0.05, eps=1e-3, weight_decay=0.01),
    "adamw": lambda: optim.adamw(1e-2, eps=1e-3, weight_decay=0.1),
    "adamw-mask": lambda: optim.adamw(1e-2, eps=1e-3, weight_decay=0.1, mask={"w": True, "b": False, "v": True}),
    "adamw-schedule": lambda: optim.adamw(optim.warmup_cosine_decay_schedule(0.0, 0.05, 2, 6), eps=1e-3,
                                          weight_decay=0.1),
    "lion": lambda: optim.lion(0.1, weight_decay=0.1),
    "scale_by_adam": lambda: optim.scale_by_adam(eps=1e-3),
    "scale_by_lion": lambda: optim.scale_by_lion(),
    "trace": lambda: optim.trace(0.9),
    "trace-nesterov": lambda: optim.trace(0.9, nesterov=True),
    "add_decayed_weights": lambda: optim.add_decayed_weights(0.1, mask={"w": True, "b": False, "v": True}),
    "scale": lambda: optim.scale(-0.3),
    "scale_by_learning_rate": lambda: optim.scale_by_learning_rate(0.1),
    "scale_by_schedule": lambda: optim.scale_by_schedule(optim.cosine_decay_schedule(1.0, 5, alpha=0.1)),
    "clip_by_global_norm": lambda: optim.clip_by_global_norm(0.5),  # clips
    "clip_by_global_norm-open": lambda: optim.clip_by_global_norm(100.0),  # lets through
    "identity": lambda: optim.identity(),
    "chain": lambda: optim.chain(optim.clip_by_global_norm(4.0),  # clips the gradients by ~0.7
                                 optim.adamw(optim.linear_schedule(0.1, 0.01, 4), eps=1e-3)),
    "inject_hyperparams": lambda: optim.inject_hyperparams(optim.adamw)(1e-2, eps=1e-3, weight_decay=0.1),
    "inject_hyperparams-sgd": lambda: optim.inject_hyperparams(optim.sgd)(
        optim.cosine_decay_schedule(0.1, 5), momentum=0.9),
}


def _tree_case(seed=1):
    """Params, and 3 gradients with entries of magnitude 1 to ~3: Adam's ``nu`` is then >= 1e-3
    after one step, and central differences by it (error ~ (H / nu)^2 / 8) hold to 1e-7."""
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, generator=gen, dtype=D), "b": torch.randn((), generator=gen, dtype=D),
              "v": torch.randn(2, 2, generator=gen, dtype=D)}

    def grad(p):
        r = torch.randn(p.shape, generator=gen, dtype=D)
        return torch.sign(r) * (1.0 + r.abs())

    grads = [optree.tree_map(grad, params, namespace=NS) for _ in range(3)]
    return params, grads


def _state_before(opt, params, grads, step):
    """The state that update number ``step`` (from 1) receives."""
    state = opt.init(params)
    for g in grads[: step - 1]:
        _, state = opt.update(clone_tree(g), state, params)
    return state


def _float_outputs(out):
    return [t for t in leaves(out) if t.is_floating_point()]


def _check_jacobian(f, x, what):
    """jacrev of ``f`` (a tree of tensors -> list of tensors) at the tree ``x`` against central
    differences, output leaf by output leaf: relative to the block's largest entry, plus the
    differences' own rounding (100 ulps of the output over 2H), which bounds what they can
    resolve (an entry that is exactly 0 comes out of reverse mode as ~1e-14)."""
    xs, spec = optree.tree_flatten(x, namespace=NS)
    sizes = [t.numel() for t in xs]

    def flat_f(vec):
        parts = torch.split(vec, sizes)
        return f(optree.tree_unflatten(spec, [p.reshape(t.shape) for p, t in zip(parts, xs)]))

    vec = torch.cat([t.reshape(-1) for t in xs])
    jac = torch.func.jacrev(flat_f)(vec)  # one (out..., n) per output leaf
    fd = [torch.zeros_like(j) for j in jac]
    for i in range(vec.numel()):
        e = torch.zeros_like(vec)
        e[i] = H
        for col, hi, lo in zip(fd, flat_f(vec + e), flat_f(vec - e)):
            col[..., i] = (hi - lo) / (2 * H)
    for n, (a, b, out) in enumerate(zip(jac, fd, flat_f(vec))):
        scale = float(b.abs().max())
        err = float((a - b).abs().max())
        rounding = 100 * torch.finfo(D).eps * max(float(out.abs().max()), 1e-3) / (2 * H)
        if scale == 0.0:  # e.g. a sign, or an output that does not depend on x
            assert err <= 1e-12, f"{what}: output {n}: jacrev {err:.3g} where central differences are 0"
        else:
            assert err <= TOL * scale + rounding, f"{what}: output {n}: relative error {err / scale:.3g}"


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_jacrev_of_update_equals_central_differences(name, step):
    """With respect to the gradients, the params and each float state leaf; the outputs are the
    updates and the new state's float leaves."""
    opt = TRANSFORMS[name]()
    params, grads = _tree_case()
    state = _state_before(opt, params, grads, step)
    g = grads[step - 1]

    def run(g, state, params):
        return _float_outputs(opt.update(g, state, params))

    _check_jacobian(lambda g: run(g, state, params), g, f"{name} step {step}, by the gradients")
    _check_jacobian(lambda p: run(g, state, p), params, f"{name} step {step}, by the params")
    state_leaves, spec = optree.tree_flatten(state, namespace=NS)
    floats = [i for i, t in enumerate(state_leaves) if t.is_floating_point()]
    for i in floats:
        def by_leaf(x, i=i):
            new = list(state_leaves)
            new[i] = x
            return run(g, optree.tree_unflatten(spec, new), params)

        _check_jacobian(by_leaf, state_leaves[i], f"{name} step {step}, by state leaf {i}")
    if "momentum" in name or name in ("adamw", "lion", "scale_by_adam", "trace", "inject_hyperparams"):
        assert floats, f"{name}: expected float state leaves"


# transforms with every hyperparameter a tensor: factory, hyperparameters
HYPERPARAMETERS = {
    "sgd": (optim.sgd, dict(learning_rate=0.1, momentum=0.9, weight_decay=0.01)),
    "sgd-nesterov": (lambda **h: optim.sgd(nesterov=True, **h), dict(learning_rate=0.1, momentum=0.9)),
    "adam": (optim.adam, dict(learning_rate=0.05, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)),
    "adamw": (optim.adamw, dict(learning_rate=0.05, b1=0.9, b2=0.999, eps=1e-3, weight_decay=0.1)),
    "lion": (optim.lion, dict(learning_rate=0.1, b1=0.9, b2=0.99, weight_decay=0.1)),
    "scale_by_adam": (optim.scale_by_adam, dict(b1=0.8, b2=0.99, eps=1e-3)),
    "scale_by_lion": (optim.scale_by_lion, dict(b1=0.8, b2=0.99)),
    "trace": (optim.trace, dict(decay=0.9)),
    "add_decayed_weights": (optim.add_decayed_weights, dict(weight_decay=0.1)),
    "scale": (optim.scale, dict(step_size=-0.3)),
    "scale_by_learning_rate": (optim.scale_by_learning_rate, dict(learning_rate=0.1)),
    "clip_by_global_norm": (optim.clip_by_global_norm, dict(max_norm=0.5)),
    "scale_by_schedule": (lambda **h: optim.scale_by_schedule(optim.cosine_decay_schedule(
        h["init_value"], 5, alpha=h["alpha"])), dict(init_value=0.5, alpha=0.1)),
    "warmup_cosine": (lambda **h: optim.scale_by_learning_rate(optim.warmup_cosine_decay_schedule(
        h["init"], h["peak"], 2, 6, end_value=h["end"])), dict(init=0.01, peak=0.1, end=0.02)),
}


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("name", list(HYPERPARAMETERS))
def test_jacrev_by_tensor_hyperparameters_equals_central_differences(name, step):
    factory, values = HYPERPARAMETERS[name]
    params, grads = _tree_case(2)
    state = _state_before(factory(**values), params, grads, step)
    g = grads[step - 1]
    f = lambda h: _float_outputs(factory(**h).update(g, state, params))  # noqa: E731
    _check_jacobian(f, {k: _t(v) for k, v in values.items()}, f"{name} step {step}, by the hyperparameters")


def test_global_norm_and_schedules_are_differentiable():
    params, _ = _tree_case()
    _check_jacobian(lambda t: [optim.global_norm(t)], params, "global_norm")
    _check_jacobian(lambda t: [torch.func.vmap(optim.global_norm)(t)],  # per member of a stack
                    optree.tree_map(lambda x: torch.stack([x, 2 * x]), params, namespace=NS), "vmap(global_norm)")
    schedules = {
        "constant": lambda h: optim.constant_schedule(h["a"]),
        "linear": lambda h: optim.linear_schedule(h["a"], h["b"], 4, 1),
        "cosine": lambda h: optim.cosine_decay_schedule(h["a"], 5, alpha=h["b"], exponent=2.0),
        "warmup_cosine": lambda h: optim.warmup_cosine_decay_schedule(h["b"], h["a"], 2, 6, end_value=h["c"]),
        "join": lambda h: optim.join_schedules([optim.linear_warmup(h["a"], 2), optim.constant_schedule(h["c"])], [3]),
    }
    h = {"a": _t(0.3), "b": _t(0.05), "c": _t(0.02)}
    for name, make in schedules.items():
        for step in (0, 1, 3, 7, torch.tensor(3)):  # an int, or the count as a tensor (as in a graph)
            _check_jacobian(lambda h: [torch.as_tensor(make(h)(step), dtype=D)], h, f"{name} at step {step}")


# -- jvp and vmap -------------------------------------------------------------------------------


def test_jvp_of_adamw_update_is_the_jacobian_times_the_tangent():
    opt = optim.adamw(1e-2, weight_decay=0.1)
    params, grads = _tree_case()
    state = _state_before(opt, params, grads, 3)
    f = lambda g: opt.update(g, state, params)[0]  # noqa: E731
    tangent = grads[0]
    primal, jvp = torch.func.jvp(f, (grads[2],), (tangent,))
    want = optree.tree_map(lambda a, b: (a - b) / (2 * H), f(optree.tree_map(lambda g, t: g + H * t, grads[2], tangent,
                                                                               namespace=NS)),
                           f(optree.tree_map(lambda g, t: g - H * t, grads[2], tangent, namespace=NS)), namespace=NS)
    for a, b in zip(leaves(jvp), leaves(want)):
        assert _rel(a, b) <= TOL
    for a, b in zip(leaves(primal), leaves(f(grads[2]))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["sgd-momentum", "adamw", "clip-adamw"])
def test_forward_mode_hypergradient_equals_reverse_mode(name):
    make, lr = HYPERGRADIENT[name]
    f = lambda lr: _loss_after(make(lr), 3)  # noqa: E731
    _, forward = torch.func.jvp(f, (_t(lr),), (_t(1.0),))
    reverse = torch.func.grad(f)(_t(lr))
    assert _rel(forward, reverse) <= 1e-12


def test_vmap_over_gradients_equals_a_loop():
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    params, grads = _tree_case()
    state = _state_before(opt, params, grads, 2)
    stacked = optree.tree_map(lambda *g: torch.stack(g), *grads, namespace=NS)
    got_u, got_s = torch.func.vmap(lambda g: opt.update(g, state, params))(stacked)
    for i, g in enumerate(grads):
        want_u, want_s = opt.update(g, state, params)
        for a, b in zip(leaves((got_u, got_s)), leaves((want_u, want_s))):
            if a.is_floating_point():
                assert torch.allclose(a[i], b, rtol=1e-13, atol=1e-15)


def test_vmap_over_learning_rates_equals_a_loop():
    lrs = torch.tensor([0.01, 0.05, 0.1], dtype=D)
    for make in (lambda lr: optim.adamw(lr, weight_decay=0.1), lambda lr: optim.sgd(lr, momentum=0.9)):
        got = torch.func.vmap(lambda lr: _loss_after(make(lr), 3))(lrs)
        want = torch.stack([_loss_after(make(lr), 3) for lr in lrs])
        assert torch.allclose(got, want, rtol=1e-13, atol=0)


def test_vmap_over_a_stack_of_states_with_different_counts():
    """An ensemble of Adam states at steps 1 and 3: the count is batched, so the bias corrections
    are computed by torch ops, per member."""
    opt = optim.adamw(optim.linear_schedule(0.1, 0.01, 4), weight_decay=0.1)
    params, grads = _tree_case()
    states = [_state_before(opt, params, grads, 1), _state_before(opt, params, grads, 3)]
    stacked = optree.tree_map(lambda *s: torch.stack(s), *states, namespace=NS)
    got_u, got_s = torch.func.vmap(lambda s: opt.update(grads[2], s, params))(stacked)
    for i, s in enumerate(states):
        want_u, want_s = opt.update(grads[2], s, params)
        for a, b in zip(leaves((got_u, got_s)), leaves((want_u, want_s))):
            assert torch.allclose(a[i], b, rtol=1e-14, atol=0) if a.is_floating_point() else torch.equal(a[i], b)


# -- the per-leaf path computes the foreach path's numbers ------------------------------------------


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_per_leaf_path_gives_the_foreach_paths_bits(name):
    """Float hyperparameters: the update under torch.func.grad and under vmap (per-leaf ops)
    equals the plain update (foreach ops) bit for bit, over 3 steps, on float64 and float32
    leaves and one of >= 16384 elements (Adam's other form: [Note: big leaves] in _adam.py).
    inject_hyperparams (tensor hyperparameters, per-leaf both times): the same under vmap as
    without, a 0-dim float32 leaf included (its scalars are cast to float32 first, which a
    batched leaf, 1-dim underneath, would do by itself)."""
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(3, generator=gen, dtype=D), "b": torch.randn((), generator=gen),
              "v": torch.randn(130, 130, generator=gen)}
    opt = TRANSFORMS[name]()
    state = opt.init(params)
    for _ in range(3):
        g = optree.tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=p.dtype), params, namespace=NS)
        plain = opt.update(clone_tree(g), state, params)

        def with_aux(g):
            out = opt.update(g, state, params)
            return sum(t.sum() for t in leaves(out[0])), out

        _, under_grad = torch.func.grad(with_aux, has_aux=True)(g)
        stacked = optree.tree_map(lambda t: t[None], g, namespace=NS)
        under_vmap = torch.func.vmap(lambda g: opt.update(g, state, params))(stacked)
        for a, b, c in zip(leaves(plain), leaves(under_grad), leaves(under_vmap)):
            assert torch.equal(a, b), f"{name}: the per-leaf path under grad differs from the foreach path"
            assert torch.equal(a, c[0]), f"{name}: the per-leaf path under vmap differs from the foreach path"
        state = plain[1]


def test_float_and_tensor_hyperparameters_agree():
    """A tensor learning rate gives the float's numbers up to rounding (no scale fusion), and
    float64 hyperparameters leave float32 leaves float32, 0-dim ones included."""
    params, grads = _tree_case()
    params = {**params, "s": torch.tensor(0.5), "m": torch.ones(3)}  # float32
    grads = [{**g, "s": torch.tensor(-1.5), "m": torch.full((3,), 2.0)} for g in grads]
    for make in (lambda lr, wd: optim.adamw(lr, weight_decay=wd), lambda lr, wd: optim.lion(lr, weight_decay=wd),
                 lambda lr, wd: optim.sgd(lr, momentum=wd, nesterov=True, weight_decay=wd)):
        a, b = make(0.05, 0.1), make(_t(0.05), _t(0.1))
        sa, sb = a.init(params), b.init(params)
        for g in grads:
            ua, sa = a.update(g, sa, params)
            ub, sb = b.update(g, sb, params)
            for x, y in zip(leaves((ua, sa)), leaves((ub, sb))):
                assert x.dtype == y.dtype
                assert torch.allclose(x, y, rtol=1e-14 if x.dtype == D else 1e-6, atol=0)


# -- no host reads of tensor hyperparameters ------------------------------------------------------


def _all_tensor_hyperparameters():
    for name, (factory, values) in HYPERPARAMETERS.items():
        yield name, factory, values
    yield "inject_hyperparams", (lambda **h: optim.inject_hyperparams(optim.adamw)(**h)), dict(
        learning_rate=0.05, weight_decay=0.1)


@pytest.mark.parametrize("name,factory,values", list(_all_tensor_hyperparameters()),
                         ids=[n for n, _, _ in _all_tensor_hyperparameters()])
def test_tensor_hyperparameters_are_never_read_on_the_host(name, factory, values):
    """Under torch.func.grad a host read warns (torch's "Converting a tensor with
    requires_grad=True to a scalar"); warnings are errors here. And in plain eager code no
    tensor but the int64 step count is read at all (no other aten._local_scalar_dense)."""
    params, grads = _tree_case()

    def loss(h):
        opt = factory(**h)
        state = opt.init(params)
        p = params
        for g in grads:
            updates, state = opt.update(g, state, p)
            p = optim.apply_updates(p, updates)
        return sum(t.sum() for t in leaves(p))

    h = {k: _t(v) for k, v in values.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.func.grad(loss)(h)
        loss({k: v.clone().requires_grad_() for k, v in h.items()}).backward()  # eager autograd too

    reads = []

    class Reads(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and args[0].dtype != torch.int64:
                reads.append(args[0])  # a float, or a bool of one (`if lr > 0:`); not the count
            return func(*args, **(kwargs or {}))

    with Reads():
        loss(h)
    assert not reads, f"{name}: {len(reads)} host reads of tensors other than the step count"


# -- refusals and checks ------------------------------------------------------------------------------

_REFUSED = r"refused under torch.func \({}\): this update runs in place .* Fix: use pure mode: {}"


def _update_under(transform, opt, params, grads):
    state = opt.init(params)
    if transform == "grad":
        return torch.func.grad(lambda g: sum(t.sum() for t in leaves(opt.update(g, state, params)[0])))(grads)
    if transform == "jvp":
        return torch.func.jvp(lambda g: opt.update(g, state, params)[0], (grads,), (grads,))
    stacked = optree.tree_map(lambda g: torch.stack([g, g]), grads, namespace=NS)
    return torch.func.vmap(lambda g: opt.update(g, state, params)[0])(stacked)


@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap"])
def test_inplace_and_fused_modes_refuse_torch_func(transform):
    params, grads = _tree_case()
    kind = "vmap" if transform == "vmap" else "grad, vjp, jacrev, jacfwd or jvp"
    cases = [
        (optim.adamw(1e-3, inplace=True), r"adamw.update", r"optim.adamw\(lr\) without inplace=\.\.\."),
        (optim.adamw(1e-3, fused=True), r"adamw.update", r"optim.adamw\(lr\) without inplace=\.\.\. and fused=\.\.\."),
        (optim.sgd(0.1, momentum=0.9, fused=True), r"sgd.update", r"optim.sgd\(lr\) without inplace=\.\.\. and fused"),
        (optim.lion(0.1, inplace=True), r"lion.update", r"optim.lion\(lr\) without inplace=\.\.\."),
        (optim.scale_by_adam(inplace=True), r"scale_by_adam.update", r"optim.scale_by_adam\(\.\.\.\) without inplace=True"),
        (optim.trace(0.9, inplace=True), r"trace.update", r"optim.trace\(\.\.\.\) without inplace=True"),
        (optim.scale(0.5, inplace=True), r"scale.update", r"optim.scale\(\.\.\.\) without inplace=True"),
        (optim.clip_by_global_norm(1.0, inplace=True), r"clip_by_global_norm.update",
         r"optim.clip_by_global_norm\(\.\.\.\) without inplace=True"),
        (optim.add_decayed_weights(0.1, inplace=True), r"add_decayed_weights.update",
         r"optim.add_decayed_weights\(\.\.\.\) without inplace=True"),
        (optim.inject_hyperparams(optim.adamw)(1e-3, inplace=True), r"inject_hyperparams\(adamw\).update",
         r"inject_hyperparams\(adamw\)\(\.\.\.\) without inplace"),
    ]
    for opt, who, fix in cases:
        with pytest.raises(RuntimeError, match=f"{who}: " + _REFUSED.format(kind, fix)):
            _update_under(transform, opt, params, clone_tree(grads[0]))


def test_apply_updates_in_place_refuses_torch_func():
    params, grads = _tree_case()
    with pytest.raises(RuntimeError, match=r"apply_updates: refused under torch.func \(grad, vjp, jacrev, jacfwd or jvp\)"
                                           r".* Fix: use pure mode: apply_updates\(params, updates\) without inplace=True"):
        torch.func.grad(lambda p: optim.apply_updates(p, grads[0], inplace=True)["b"])(clone_tree(params))


def test_hyperparameter_errors():
    with pytest.raises(ValueError, match=r"adamw: learning_rate given as a tensor must be a 0-dim floating-point "
                                         r"tensor .* got a torch.float64 tensor of shape \(1,\)"):
        optim.adamw(torch.tensor([1e-3], dtype=D))
    with pytest.raises(ValueError, match=r"scale_by_adam: b1 given as a tensor must be a 0-dim floating-point tensor"
                                         r" .* got a torch.int64 tensor of shape \(\)"):
        optim.adamw(1e-3, b1=torch.tensor(0))
    with pytest.raises(ValueError, match=r"adamw: inplace=True takes its hyperparameters as Python numbers, but "
                                         r"`learning_rate` is a tensor"):
        optim.adamw(_t(1e-3), inplace=True)
    with pytest.raises(ValueError, match=r"sgd: fused=True takes its hyperparameters as Python numbers, but "
                                         r"`momentum` is a tensor"):
        optim.sgd(0.1, momentum=_t(0.9), fused=True)
    with pytest.raises(ValueError, match=r"scale_by_adam: inplace=True takes .* `eps` is a tensor"):
        optim.scale_by_adam(eps=_t(1e-8), inplace=True)
    with pytest.raises(ValueError, match=r"linear_schedule: end_value given as a tensor must be a 0-dim"):
        optim.linear_schedule(0.0, torch.ones(2), 5)
    # numbers are still checked by value, tensors never
    with pytest.raises(ValueError, match=r"adamw: learning rate must be >= 0"):
        optim.adamw(-1.0)
    optim.adamw(_t(-1.0))


def test_inject_hyperparams_errors():
    with pytest.raises(ValueError, match=r"inject_hyperparams: static_args names \['momentun'\], which sgd does not "
                                         r"take"):
        optim.inject_hyperparams(optim.sgd, static_args="momentun")
    with pytest.raises(ValueError, match=r"adamw: learning rate must be >= 0"):
        optim.inject_hyperparams(optim.adamw)(-1.0)
    opt = optim.inject_hyperparams(optim.adamw)(1e-3)
    state = opt.init(P0)
    del state.hyperparams["b2"]
    with pytest.raises(ValueError, match=r"inject_hyperparams\(adamw\).update: state.hyperparams lacks \['b2'\]"):
        opt.update(P0, state, P0)
    with pytest.raises(ValueError, match=r"inject_hyperparams\(adamw\).update: the state should be the "
                                         r"InjectHyperparamsState"):
        opt.update(P0, optim.adamw(1e-3).init(P0), P0)


# -- inject_hyperparams ---------------------------------------------------------------------------------


def test_inject_hyperparams_equals_the_plain_optimizer_and_takes_changes():
    params, grads = _tree_case()
    for make in (lambda lr: optim.adamw(lr, weight_decay=0.1), lambda lr: optim.sgd(lr, momentum=0.9)):
        inject = optim.inject_hyperparams(make)  # a lambda: its one argument is lr
        opt = inject(0.05)
        state = opt.init(params)
        ref_params, got_params = params, params
        ref_state = make(0.05).init(params)
        for i, g in enumerate(grads):
            lr = 0.05 if i == 0 else 0.02
            if i == 1:
                state.hyperparams["lr"] = _t(0.02)
            u, state = opt.update(g, state, got_params)
            got_params = optim.apply_updates(got_params, u)
            ru, ref_state = make(lr).update(g, ref_state, ref_params)
            ref_params = optim.apply_updates(ref_params, ru)
        for a, b in zip(leaves(got_params), leaves(ref_params)):
            assert torch.allclose(a, b, rtol=1e-14, atol=1e-16)
        assert int(state.count) == len(grads)


def test_inject_hyperparams_schedule_and_static_args():
    schedule = optim.linear_schedule(0.1, 0.0, 3)
    opt = optim.inject_hyperparams(optim.sgd, static_args="momentum")(schedule, momentum=0.0)
    state = opt.init(P0)
    assert set(state.hyperparams) == {"learning_rate", "weight_decay"}  # momentum static, nesterov a flag
    assert isinstance(state.inner_state[1], optim.EmptyState)  # momentum 0 as a number: no buffer
    seen = []
    for _ in range(4):
        _, state = opt.update(P0, state, P0)
        seen.append(float(state.hyperparams["learning_rate"]))
    assert seen == [schedule(k) for k in range(4)]


def test_inject_hyperparams_in_place_reads_the_values_as_numbers():
    params, grads = _tree_case()
    opt = optim.inject_hyperparams(optim.adamw)(0.05, weight_decay=0.1, inplace=True)
    ref = optim.adamw(0.05, weight_decay=0.1, inplace=True)
    state, ref_state = opt.init(params), ref.init(params)
    for g in grads:
        u, state = opt.update(clone_tree(g), state, params)
        ru, ref_state = ref.update(clone_tree(g), ref_state, params)
        for a, b in zip(leaves(u), leaves(ru)):
            assert torch.equal(a, b)


# -- through sf.shard on a simulated mesh ----------------------------------------------------------------


def _mlp():
    from shardfn.testing.models import mlp_loss, mlp_params

    gen = torch.Generator().manual_seed(5)
    params = mlp_params(gen, [4, 6, 5, 3], dtype=D)
    batch = (torch.randn(8, 4, generator=gen, dtype=D), torch.randn(8, 3, generator=gen, dtype=D))
    return mlp_loss, params, batch


def _mlp_loss_after(loss_fn, params, batch, lr, k):
    opt = optim.adamw(lr, weight_decay=0.1)
    state = opt.init(params)
    for _ in range(k):
        updates, state = opt.update(torch.func.grad(loss_fn)(params, batch), state, params)
        params = optim.apply_updates(params, updates)
    return loss_fn(params, batch)


def _sharded_hypergradient(k):
    from shardfn.testing._ddp import local_batch

    loss_fn, params, batch = _mlp()
    lr = _t(0.05)
    want = torch.func.grad(lambda lr: _mlp_loss_after(loss_fn, params, batch, lr, k))(lr)
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(loss_fn, mesh)

    def rank_main():
        shards = step.shard_params(params)
        local = local_batch(batch, mesh.rank, mesh.size)
        # lr scales this rank's shards only: the hypergradient is the sum of the ranks' parts
        part = torch.func.grad(lambda lr: _mlp_loss_after(step, shards, local, lr, k))(lr)
        return mesh.all_reduce(part.clone(), op="sum")

    got = mesh.run(rank_main)
    for r, g in enumerate(got):
        assert abs(float(g - want)) <= 1e-10 * abs(float(want)), f"rank {r}: {float(g)} vs one device {float(want)}"


def test_hypergradient_through_shard_one_step_equals_one_device():
    _sharded_hypergradient(1)


def test_hypergradient_through_one_shard_step_over_three_steps_is_refused_clearly():
    """One step differentiated through several of its own calls with other shards is
    refused ([Note: one call's backward at a time] in shardfn/_fsdp/autograd.py: it was
    silently wrong); one sf.shard step per call is right (tests/fsdp/test_composition.py)."""
    with pytest.raises(sf.ShardingError, match="one sf.shard step per call"):
        _sharded_hypergradient(3)


