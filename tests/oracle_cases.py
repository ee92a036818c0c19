"""The property-based oracle over transforms (issue 38): hypothesis draws a small model, a
mesh, `sf.shard` options (or an `sf.shard_map` program) and a transform stack; the same
stack runs on the sharded function (every rank of a simulated mesh, or processes) and on
one device in fp64, and the two must agree within `EXACT` (max |error| over max |value|),
or the step must refuse with the composition table's own SpecError
([Note: the composition table] in shardfn/_fsdp/support.py) and the table must say so.

One runner serves both sides: `run_stack(stack, f, params, batch, ...)` applies the stack
to `f` (the sharded step, or the plain loss) and returns what it gives, mapped to full
trees by `full` (`step.unshard_params` on a rank, the identity on one device).

Stacks (`STACKS`): grad, vjp (with the batch's cotangent when the batch is passed), jvp
(with a batch tangent when passed), vmap of grad over examples (every data rank holds the
same examples: what a batched collective means, docs/autodiff.md), jacrev of a small
output, Hessian-vector products forward-over-reverse and reverse-over-reverse, and grad
of the loss after one `shardfn.optim` step with respect to a tensor learning rate (one
`sf.shard` step per call, as docs/composition.md asks). Each with its arguments closed
over or passed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from hypothesis import strategies as st

import shardfn as sf
import shardfn.optim as optim
from shardfn._fsdp import support

EXACT = 1e-10
D64 = torch.float64
STACKS = ("grad", "vjp", "jvp", "vmap", "jacrev", "hvp_fwd", "hvp_rev", "optim")
# the composition table's entry each stack goes through
TABLE_ENTRY = {"grad": "func_grad", "vjp": "func_grad", "jvp": "jvp", "vmap": "vmap", "jacrev": "func_grad",
               "hvp_fwd": "hvp", "hvp_rev": "hvp_rev", "optim": "func_grad"}
OPTIMIZERS = ("sgd", "adam", "adamw", "lion")
MESHES = {  # name -> (mesh shape, layouts it allows)
    "1d2": ((("data", 2),), ("fsdp",)),
    "1d4": ((("data", 4),), ("fsdp",)),
    "2d": ((("a", 2), ("b", 2)), ("fsdp", "hsdp", "hpz")),
}
T, C = 4, 8  # tokens and width of the GPT block / Llama layer


# -- models ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _module(name: str, seed: int):
    torch.manual_seed(seed)
    if name == "gpt_block":
        from shardfn.testing.models import Block, GPTConfig

        return Block(GPTConfig(vocab_size=8, block_size=T, n_layer=1, n_head=2, n_embd=C)).double()
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=C, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=8, max_position_embeddings=T)
    # eager attention (CPU SDPA has no forward AD / double backward: docs/composition.md), its
    # softmax in the model's dtype (transformers' eager one casts to float32: _in_its_dtype)
    config._attn_implementation = _eager_attention_in_its_dtype()
    layer = LlamaDecoderLayer(config, layer_idx=0).double()
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.__class__ = _rms_norm_in_its_dtype()
    for p in layer.parameters():  # RMSNorm weights start at 1: move them off so they matter
        p.data.add_(0.1 * torch.randn(p.shape, dtype=D64))
    rope = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, T, C, dtype=D64)
    cos, sin = rope(x, torch.arange(T)[None])
    layer._oracle_rope = (cos.to(D64), sin.to(D64))
    return layer


@functools.cache
def _rms_norm_in_its_dtype():
    """transformers' LlamaRMSNorm computes in float32 whatever the model's dtype (`.to(float32)`
    and back), and its eager attention takes the softmax in float32, so an fp64 layer carries
    fp32 roundings, and two fp64 computations of one gradient that scale the cotangent at
    different points (vjp with c = 1.7 on one device vs c times its grad: 6e-9 apart) differ
    by them, far above the oracle's 1e-10. The oracle's layer computes its norms and softmax
    in the model's dtype: the same math, without the casts."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class RMSNormInItsDtype(LlamaRMSNorm):
        def forward(self, hidden_states):
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    return RMSNormInItsDtype


@functools.cache
def _eager_attention_in_its_dtype() -> str:
    """transformers' eager attention with the softmax in the inputs' dtype, registered under
    a name of its own (see `_rms_norm_in_its_dtype`)."""
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import repeat_kv

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key = repeat_kv(key, module.num_key_value_groups)
        value = repeat_kv(value, module.num_key_value_groups)
        weights = query @ key.transpose(2, 3) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask[:, :, :, : key.shape[-2]]
        weights = torch.softmax(weights, dim=-1)
        return (weights @ value).transpose(1, 2).contiguous(), weights

    AttentionInterface.register("oracle_eager_in_its_dtype", attention)
    return "oracle_eager_in_its_dtype"


def mlp_params(seed: int, d: int = 5, h: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    layers = [{"w1": torch.randn(d, h, generator=g, dtype=D64) / d ** 0.5, "b1": torch.randn(h, generator=g, dtype=D64),
               "w2": torch.randn(h, d, generator=g, dtype=D64) / h ** 0.5, "b2": torch.randn(d, generator=g, dtype=D64)}
              for _ in range(2)]
    return {"layers": layers, "head": torch.randn(d, 2, generator=g, dtype=D64) / d ** 0.5}


def _mlp_block(p, x):
    return x + torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def model(name: str, seed: int, remat: bool):
    """(params, loss_fn, example shapes (x, y) of one example) of a model, fp64."""
    if name == "mlp":
        block = sf.remat(_mlp_block) if remat else _mlp_block

        def mlp_loss(params, batch):
            x, y = batch
            for p in params["layers"]:
                x = block(p, x)
            return ((x @ params["head"] - y) ** 2).mean()

        return mlp_params(seed), mlp_loss, ((5,), (2,))
    module = _module(name, seed)
    # the GPT block: sf.functional's own remat (each child of its mlp Sequential); the Llama layer
    # (no Sequential): sf.remat around the whole apply
    apply_fn, params = sf.functional(module, remat=True if remat and name == "gpt_block" else None)
    if name == "gpt_block":
        def forward(p, x):
            return apply_fn(p, x)
    else:
        rope = module._oracle_rope

        def forward(p, x):
            out = apply_fn(p, x, position_embeddings=rope)
            return out[0] if isinstance(out, tuple) else out
    if remat and name == "llama_layer":
        forward = sf.remat(forward)

    def lm_loss(params, batch):
        x, y = batch
        return ((forward(params, x) - y) ** 2).mean()

    return sf._tree.tree_map(lambda t: t.detach(), params), lm_loss, ((T, C), (T, C))


def batches(shapes, n_ranks: int, per_rank: int, seed: int):
    """Per data rank its (x, y), and the whole batch."""
    g = torch.Generator().manual_seed(seed + 1000)
    whole = tuple(torch.randn(n_ranks * per_rank, *s, generator=g, dtype=D64) for s in shapes)
    parts = [tuple(t[r * per_rank:(r + 1) * per_rank] for t in whole) for r in range(n_ranks)]
    return parts, whole


def probe(tree, seed: int):
    g = torch.Generator().manual_seed(seed + 7)
    return sf._tree.tree_map(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype), tree)


# -- the transform stacks -------------------------------------------------------------------------


def _dot(a, b):
    return sum((x * y).sum() for x, y in zip(sf._tree.flatten(a)[0], sf._tree.flatten(b)[0]))


def _small(loss):
    """A small output of the loss, for jacrev."""
    return torch.stack([loss, loss * loss, torch.sin(loss)])


def _optimizer(name: str, lr):
    return {"sgd": lambda: optim.sgd(lr), "adam": lambda: optim.adam(lr),
            "adamw": lambda: optim.adamw(lr, weight_decay=0.1), "lion": lambda: optim.lion(lr)}[name]()


def first_step(name: str, lr, grads, params):
    """One step of the optimizer from its initial state, written out in plain torch (the
    one-device reference does not use shardfn.optim, so a bug there cannot hide in both
    sides): sgd -lr g; adam -lr m/(sqrt v + eps) with the bias-corrected m = g, v = g^2;
    adamw that plus wd p; lion -lr sign((1 - b1) g)."""
    def one(g, p):
        if name == "sgd":
            return -lr * g
        if name == "lion":
            return -lr * torch.sign((1 - 0.9) * g)
        step = g / (torch.sqrt(g * g) + 1e-8)
        return -lr * (step + 0.1 * p) if name == "adamw" else -lr * step

    return sf._tree.tree_map(one, grads, params)


def run_stack(stack: str, f, params, batch, *, full, closed: bool, v, tb, c, lr, opt: str = "sgd", f_outer=None,
              plain_optimizer: bool = False):
    """Apply `stack` to `f(params, batch)`; return a dict of full trees / tensors.

    v: a tangent / probe shaped like `params`; tb: a tangent (or cotangent) for the batch;
    c: a scalar cotangent; lr: a 0-dim tensor learning rate; f_outer: the function of the
    loss after the optimizer step (another sf.shard step: one step per call)."""
    func = torch.func
    if stack == "grad":
        g = func.grad(lambda p: f(p, batch))(params) if closed else func.grad(f)(params, batch)
        return {"grad": full(g)}
    if stack == "vjp":
        if closed:
            out, pull = func.vjp(lambda p: f(p, batch), params)
            (g,) = pull(c)
            return {"out": out.detach(), "grad": full(g)}
        out, pull = func.vjp(f, params, batch)
        g, gb = pull(c)
        return {"out": out.detach(), "grad": full(g), "batch_grad": gb}
    if stack == "jvp":
        if closed:
            out, t = func.jvp(lambda p: f(p, batch), (params,), (v,))
        else:
            out, t = func.jvp(f, (params, batch), (v, tb))
        return {"out": out.detach(), "tangent": t.detach()}
    if stack == "vmap":
        per_example = sf._tree.tree_map(lambda t: t[:, None], batch)
        fn = func.grad(f) if not closed else (lambda p, b: func.grad(lambda q: f(q, b))(p))
        g = func.vmap(fn, in_dims=(None, 0))(params, per_example)
        n = sf._tree.flatten(batch)[0][0].shape[0]
        return {f"example{i}": full(sf._tree.tree_map(lambda t, i=i: t[i], g)) for i in range(n)}
    if stack == "jacrev":
        if closed:
            jac = func.jacrev(lambda p: _small(f(p, batch)))(params)
        else:
            jac = func.jacrev(lambda p, b: _small(f(p, b)))(params, batch)
        return {f"row{i}": full(sf._tree.tree_map(lambda t, i=i: t[i], jac)) for i in range(3)}
    if stack == "hvp_fwd":
        if closed:
            h = func.jvp(lambda p: func.grad(f)(p, batch), (params,), (v,))[1]
        else:
            zeros = sf._tree.tree_map(torch.zeros_like, batch)
            h = func.jvp(func.grad(f), (params, batch), (v, zeros))[1]
        return {"hvp": full(h)}
    if stack == "hvp_rev":
        if closed:
            h = func.grad(lambda p: _dot(func.grad(f)(p, batch), v))(params)
        else:
            h = func.grad(lambda p, b, w: _dot(func.grad(f)(p, b), w))(params, batch, v)
        return {"hvp": full(h)}
    if stack == "optim":
        f_outer = f_outer or f

        def after(lr, p, b):
            if plain_optimizer:
                return f_outer(sf._tree.tree_map(torch.add, p, first_step(opt, lr, func.grad(f)(p, b), p)), b)
            o = _optimizer(opt, lr)
            updates, _ = o.update(func.grad(f)(p, b), o.init(p), p)
            return f_outer(optim.apply_updates(p, updates), b)

        if closed:
            hyper = func.grad(lambda lr: after(lr, params, batch))(lr)
        else:
            hyper = func.grad(after)(lr, params, batch)
        return {"hypergrad": hyper.detach()}
    raise KeyError(stack)


# -- cases ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardCase:
    model: str
    mesh: str
    layout: str  # fsdp | hsdp | hpz (2-D meshes)
    stack: str
    closed: bool
    reshard: bool = True
    prefetch: int = 1
    frozen: int | None = None  # index of the frozen leaf
    mp64: bool = False  # MixedPrecision in fp64 (exact)
    check_finite: bool = False
    weighting: str = "equal"
    remat: bool = False
    per_leaf_units: bool = False
    per_rank: int = 2
    opt: str = "sgd"
    seed: int = 0

    def shard_kwargs(self, leaf_paths) -> dict:
        shape, _ = MESHES[self.mesh]
        kw: dict = {}
        if len(shape) > 1:
            kw["data_axes"] = tuple(a for a, _ in shape)
            if self.layout == "hsdp":
                kw["shard_axes"] = "b"
        if self.layout == "hpz":
            kw["reshard_after_forward"] = "b"
        elif not self.reshard:
            kw["reshard_after_forward"] = False
        if self.prefetch != 1:
            kw["prefetch"] = self.prefetch
        if self.frozen is not None:
            chosen = leaf_paths[self.frozen % len(leaf_paths)]
            kw["frozen"] = lambda path, chosen=chosen: tuple(path) == tuple(chosen)
        if self.mp64:
            kw["mixed_precision"] = sf.MixedPrecision(param_dtype=D64, reduce_dtype=D64, output_dtype=D64)
        if self.check_finite:
            kw["check_finite"] = True
        if self.weighting != "equal":
            kw["batch_weighting"] = self.weighting
        if self.per_leaf_units:
            kw["units"] = lambda path: tuple(path[:2])
        return kw


@st.composite
def shard_cases(draw, models=("mlp", "gpt_block"), meshes=tuple(MESHES), stacks=STACKS):
    stack = draw(st.sampled_from(stacks))
    mesh = draw(st.sampled_from(meshes))
    layout = draw(st.sampled_from(MESHES[mesh][1]))
    name = draw(st.sampled_from(models))
    return ShardCase(
        model=name, mesh=mesh, layout=layout, stack=stack, closed=draw(st.booleans()),
        reshard=draw(st.booleans()), prefetch=draw(st.sampled_from((1, 2))),
        # frozen leaves are constants of the step: their dependence on a learning rate is dropped, so the
        # hypergradient is not the one-device one there (left out of the optim stack)
        frozen=None if stack == "optim" else draw(st.one_of(st.none(), st.integers(0, 20))),
        mp64=draw(st.booleans()), check_finite=draw(st.booleans()),
        weighting=draw(st.sampled_from(("equal", "equal", "global_mean"))),
        # GPT + remat under vmap: a known functorch assertion, a SpecError (docs/composition.md). The Llama
        # layer's remat is sf.remat around sf.functional's apply (its first call on a thread was refused:
        # a bug found here, test_oracle.py::test_remat_around_a_functional_apply_on_its_first_call)
        remat=draw(st.booleans()) if stack != "vmap" else False,
        per_leaf_units=draw(st.booleans()), per_rank=draw(st.integers(1, 3)),
        opt=draw(st.sampled_from(OPTIMIZERS)), seed=draw(st.integers(0, 2 ** 16)))


@functools.lru_cache(maxsize=None)
def mesh_of(shape: tuple):
    return sf.local_mesh(dict(shape))


def _unfrozen(kwargs, tree):
    frozen = kwargs.get("frozen")
    if frozen is None:
        return tree
    paths, leaves, treedef = sf._tree.flatten_with_paths(tree)
    return sf._tree.unflatten(treedef, [torch.zeros_like(x) if frozen(p) else x for p, x in zip(paths, leaves)])


def max_rel(got, want) -> float:
    g_leaves, w_leaves = sf._tree.flatten(got)[0], sf._tree.flatten(want)[0]
    assert len(g_leaves) == len(w_leaves), (len(g_leaves), len(w_leaves))
    top = max(float(w.abs().max()) for w in w_leaves) or 1.0
    return max(float((g.to(D64) - w).abs().max()) for g, w in zip(g_leaves, w_leaves)) / top


def expected_refusal(case: ShardCase, step) -> Exception | None:
    """What the composition table says for this step's options under the stack's entry
    point (read from the step's config, as the step reads it; sf.remat is found at run time)."""
    options = support.active_options(step.config)
    if case.remat:
        options.append("remat")
    return support.refusal(TABLE_ENTRY[case.stack], options)


def check_shard_case(case: ShardCase, mesh=None) -> list[str]:
    """Run one case on the simulated mesh (or `mesh`); the problems found ([] = exact, or
    refused by the table's own error where the table refuses)."""
    shape, _ = MESHES[case.mesh]
    mesh = mesh or mesh_of(shape)
    params, loss_fn, shapes = model(case.model, case.seed, case.remat)
    leaf_paths = sf._tree.flatten_with_paths(params)[0]
    kwargs = case.shard_kwargs(leaf_paths)
    step = sf.shard(loss_fn, mesh, **kwargs)
    outer = sf.shard(loss_fn, mesh, **kwargs) if case.stack == "optim" else None
    n_data = math.prod(s for _, s in shape)
    parts, whole = batches(shapes, n_data, case.per_rank, case.seed)
    v_full = _unfrozen(kwargs, probe(params, case.seed))
    tb_parts, tb_whole = batches(shapes, n_data, case.per_rank, case.seed + 1)
    c = torch.tensor(1.7, dtype=D64)
    lr = torch.tensor(0.05, dtype=D64)
    if case.stack == "vmap":  # every data rank holds the same examples
        parts, whole = [parts[0]] * n_data, parts[0]
    common = dict(closed=case.closed, c=c, lr=lr, opt=case.opt)

    def body():
        index = 0
        for a, _ in shape:
            index = index * mesh.shape[a] + mesh.coords[a]
        shards = step.shard_params(params)
        if outer is not None:
            outer.shard_params(params)
        try:
            got = run_stack(case.stack, step, shards, parts[index], full=step.unshard_params,
                            v=step.shard_params(v_full), tb=tb_parts[index], f_outer=outer, **common)
        except sf.ShardingError as e:
            return ("refused", str(e))
        if "hypergrad" in got:  # lr scales this rank's shards: the hypergradient is the sum of the parts,
            # each shard counted once (HSDP's replicas hold the same shard, each its whole gradient)
            replicas = mesh.shape["a"] if case.layout == "hsdp" else 1
            got["hypergrad"] = mesh.all_reduce(got["hypergrad"].clone(), op="sum") / replicas
        return ("ran", got, index)

    results = mesh.run(body) if mesh.kind == "simulated" else [body()]  # processes: this rank's
    want_error = expected_refusal(case, step)
    if want_error is not None:
        return [f"rank {r}: expected the table's refusal {str(want_error)[:120]!r}, got {res[0]}: {str(res[1])[:300]}"
                for r, res in enumerate(results) if res[0] != "refused" or str(want_error) not in res[1]]
    problems = [f"rank {r}: refused, but the table supports it: {res[1][:500]}"
                for r, res in enumerate(results) if res[0] == "refused"]
    if problems:
        return problems
    want = run_stack(case.stack, loss_fn, params, whole, full=lambda t: _unfrozen(kwargs, t), v=v_full,
                     tb=tb_whole, plain_optimizer=True, **common)
    for r, (_, got, index) in enumerate(results):
        problems += compare(got, want, rank=r, index=index, per_rank=case.per_rank, n_data=n_data)
    return problems


def compare(got: dict, want: dict, *, rank: int, index: int = 0, per_rank: int = 0, n_data: int = 1,
            tol: float = EXACT) -> list[str]:
    problems = []
    if set(got) != set(want):
        return [f"rank {rank}: outputs {sorted(got)} != the reference's {sorted(want)}"]
    for key in got:
        w = want[key]
        if key == "batch_grad":  # this rank's rows of the whole batch's cotangent
            w = tuple(t[index * per_rank:(index + 1) * per_rank] for t in w)
        err = max_rel(got[key], w)
        if not err <= tol:
            problems.append(f"rank {rank}: {key} off by {err:.3g} (max |err| / max |value|; tol {tol})")
    return problems


# -- shard_map ------------------------------------------------------------------------------------

SM_MESHES = {"1d2": (("x", 2),), "1d4": (("x", 4),), "2d": (("x", 2), ("y", 2))}
SM_STACKS = ("grad", "vjp", "jvp", "vmap", "jacrev", "hvp_fwd", "hvp_rev")
SM_D, SM_H, SM_K = 3, 4, 3


@dataclasses.dataclass(frozen=True)
class ShardMapCase:
    mesh: str
    batch_axes: tuple  # the axes x's rows are split over (row-major in this order)
    w_axis: str | None  # the axis w's columns (and u's rows) are split over
    body: str  # psum | all_gather
    check_vma: bool
    stack: str
    closed: bool
    rows: int = 2  # per batch block
    seed: int = 0


@st.composite
def shard_map_cases(draw, meshes=tuple(SM_MESHES), stacks=SM_STACKS):
    mesh = draw(st.sampled_from(meshes))
    axes = [a for a, _ in SM_MESHES[mesh]]
    w_axis = draw(st.sampled_from([None] + axes))
    free = [a for a in axes if a != w_axis]
    batch_axes = tuple(draw(st.permutations(free))[:draw(st.integers(0, len(free)))])
    return ShardMapCase(mesh=mesh, batch_axes=batch_axes, w_axis=w_axis,
                        body=draw(st.sampled_from(("psum", "all_gather"))), check_vma=draw(st.booleans()),
                        stack=draw(st.sampled_from(stacks)), closed=draw(st.booleans()),
                        rows=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2 ** 16)))


def _global_f(params, x):
    w, u = params
    return ((torch.tanh(x @ w) @ u) ** 2).mean(0)


def _sm_body(case: ShardMapCase):
    def body(params, x):
        w, u = params
        if case.w_axis is not None and case.body == "all_gather":
            w = sf.all_gather(w, case.w_axis, dim=1, tiled=True)
            u = sf.all_gather(u, case.w_axis, dim=0, tiled=True)
        y = torch.tanh(x @ w) @ u
        if case.w_axis is not None and case.body == "psum":
            y = sf.psum(y, case.w_axis)
        out = (y ** 2).mean(0)
        return sf.pmean(out, case.batch_axes) if case.batch_axes else out

    return body


def check_shard_map_case(case: ShardMapCase, mesh=None) -> list[str]:
    shape = SM_MESHES[case.mesh]
    mesh = mesh or mesh_of(shape)
    n_batch = math.prod(dict(shape)[a] for a in case.batch_axes)
    wa = case.w_axis
    n_w = dict(shape)[wa] if wa else 1
    g = torch.Generator().manual_seed(case.seed)
    params = (torch.randn(SM_D, SM_H * n_w, generator=g, dtype=D64),
              torch.randn(SM_H * n_w, SM_K, generator=g, dtype=D64) / SM_H ** 0.5)
    x = torch.randn(case.rows * n_batch, SM_D, generator=g, dtype=D64)
    v = tuple(torch.randn(p.shape, generator=g, dtype=D64) for p in params)
    tx = torch.randn(x.shape, generator=g, dtype=D64)
    c = torch.randn(SM_K, generator=g, dtype=D64)
    p_specs = (sf.P(None, wa), sf.P(wa, None))
    x_spec = sf.P(case.batch_axes or None)
    if case.stack == "jacrev" or case.stack == "vjp":
        f_out = lambda f: f  # noqa: E731 -- the small output itself
    else:
        f_out = lambda f: (lambda p, b: _dot(f(p, b), c))  # noqa: E731 -- a scalar of it
    mapped = sf.shard_map(_sm_body(case), mesh, (p_specs, x_spec), sf.P(), check_vma=case.check_vma)

    def sm_stack(f, p, b, full, v, tb):
        fo = f_out(f)
        if case.stack == "vjp":
            if case.closed:
                out, pull = torch.func.vjp(lambda q: fo(q, b), p)
                return {"out": out.detach(), "grad": full(pull(c)[0])}
            out, pull = torch.func.vjp(fo, p, b)
            gp, gb = pull(c)
            return {"out": out.detach(), "grad": full(gp), "xgrad": full(gb, x_spec)}
        if case.stack == "jvp" and not case.closed:
            out, t = torch.func.jvp(fo, (p, b), (v, tb))
            return {"out": out.detach(), "tangent": t.detach()}
        if case.stack == "vmap":  # vmap over stacked copies of x (scaled), the params shared
            xs = torch.stack([b, 0.5 * b, -b])
            fn = torch.func.grad(fo) if not case.closed else (lambda q, bb: torch.func.grad(lambda r: fo(r, bb))(q))
            gs = torch.func.vmap(fn, in_dims=(None, 0))(p, xs)
            return {f"example{i}": full(tuple(t[i] for t in gs)) for i in range(3)}
        if case.stack == "jacrev":
            jac = torch.func.jacrev(lambda q: fo(q, b))(p) if case.closed else torch.func.jacrev(fo)(p, b)
            return {f"row{i}": full(tuple(t[i] for t in jac)) for i in range(SM_K)}
        return run_stack(case.stack, fo, p, b, full=full, closed=case.closed, v=v, tb=tb, c=torch.tensor(1.0, dtype=D64),
                         lr=None)

    def body():
        local_p = tuple(sf.scatter(t, mesh, s) for t, s in zip(params, p_specs))
        local_v = tuple(sf.scatter(t, mesh, s) for t, s in zip(v, p_specs))
        local_x, local_tx = sf.scatter(x, mesh, x_spec), sf.scatter(tx, mesh, x_spec)

        def full(tree, spec=None):
            if spec is not None:
                return sf.gather(tree.detach(), mesh, spec)
            return tuple(sf.gather(t.detach(), mesh, s) for t, s in zip(tree, p_specs))

        try:
            return ("ran", sm_stack(mapped, local_p, local_x, full, local_v, local_tx))
        except sf.ShardingError as e:
            return ("refused", str(e))

    results = mesh.run(body) if mesh.kind == "simulated" else [body()]
    problems = [f"rank {r}: refused: {res[1][:500]}" for r, res in enumerate(results) if res[0] == "refused"]
    if problems:  # shard_map has no refused cell among these stacks
        return problems
    want = sm_stack(_global_f, params, x, lambda t, spec=None: t, v, tx)
    for r, (_, got) in enumerate(results):
        problems += compare(got, want, rank=r)
    return problems
