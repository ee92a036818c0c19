"""The composition matrix's cells: each `shard` option under each entry point, on a model,
run against its reference ([Note: the composition table] in shardfn/_fsdp/support.py).

A cell is (model, option, entry). `run_cell` builds the option's step on the simulated
mesh, runs the entry point on every rank, and checks the result against the reference:
fp64 on one device over the global batch (within the option's tolerance: 1e-10 for the
exact options), or, for `sf.estimate`, the eager step's own `stats()` bytes. A cell the
table refuses must raise the table's error and nothing else.

The MLP is two tensor-parallel-ready blocks (`w1` column-parallel, `w2` row-parallel), so
the same model runs every option, TP included (its loss psums the row-parallel matmul
over 'model' when the step is tensor parallel).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from typing import Any, Callable, NamedTuple

import torch

import shardfn as sf
from shardfn._fsdp import support

D, H, BLOCKS, PER_RANK, LR = 6, 8, 2, 4, 0.1
EXACT = 1e-10


@dataclasses.dataclass(frozen=True)
class Setup:
    mesh_shape: tuple  # ((axis, size), ...)
    shard_kwargs: dict
    tol: float = EXACT  # max |got - want| / max |want| per tree
    tp: bool = False
    remat: bool = False
    uneven: bool = False  # rank r holds PER_RANK + r examples (global_mean)
    compressed: bool = False  # stats' all-gather bytes must be below the full-precision ones


def _data(shape: tuple) -> dict:
    return {"data_axes": tuple(a for a, _ in shape)} if len(shape) > 1 else {}


SETUPS: dict[str, Setup] = {
    "none": Setup((("data", 2),), {}),
    "low_precision": Setup((("data", 2),), {"mixed_precision": sf.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}, tol=3e-2),
    "wire_int8": Setup((("data", 2),), {"mixed_precision": sf.MixedPrecision(
        all_gather_dtype="int8", reduce_scatter_dtype="int8")}, tol=5e-2, compressed=True),
    "wire_fp8": Setup((("data", 2),), {"mixed_precision": sf.MixedPrecision(
        all_gather_dtype=torch.float8_e4m3fn)}, tol=1.5e-1, compressed=True),
    "wire_cast": Setup((("data", 2),), {"mixed_precision": sf.MixedPrecision(
        all_gather_dtype=torch.bfloat16)}, tol=3e-2, compressed=True),
    "hsdp": Setup((("replica", 2), ("shard", 2)), {"data_axes": ("replica", "shard"), "shard_axes": "shard"}),
    "hpz": Setup((("a", 2), ("b", 2)), {"data_axes": ("a", "b"), "reshard_after_forward": "b"}),
    "frozen": Setup((("data", 2),), {"frozen": lambda path: path[-1] == "b1" and path[1] == 0}),
    "tp": Setup((("data", 2), ("model", 2)), {"param_specs": lambda path: {
        "w1": sf.P(None, "model"), "b1": sf.P("model"), "w2": sf.P("model", None)}.get(path[-1])}, tp=True),
    "check_finite": Setup((("data", 2),), {"check_finite": True}),
    "global_mean": Setup((("data", 2),), {"batch_weighting": "global_mean"}, uneven=True),
    "prefetch": Setup((("data", 2),), {"prefetch": 2}),
    "no_reshard": Setup((("data", 2),), {"reshard_after_forward": False}),
    "remat": Setup((("data", 2),), {}, remat=True),
}


_DATA_MESHES = ("hsdp", "hpz")  # options that bring their own data axes


def combine(options: tuple[str, ...]) -> Setup | None:
    """One Setup with every option on, or None where one step cannot have them together
    (two data-axis layouts, two values of one argument: e.g. hpZ and no reshard, int8 and
    float8 all-gathers)."""
    setups = [SETUPS[o] for o in options]
    if len(setups) == 1:
        return setups[0]
    data = [o for o in options if o in _DATA_MESHES]
    if len(data) > 1:
        return None
    mesh = SETUPS[data[0]].mesh_shape if data else (("data", 2),)
    if any(s.tp for s in setups):
        mesh = mesh + (("model", 2),)
    kwargs: dict = {}
    for s in setups:
        for key, value in s.shard_kwargs.items():
            if key == "mixed_precision" and key in kwargs:
                merged = kwargs[key]._asdict()
                for field, v in value._asdict().items():
                    if v != sf.MixedPrecision._field_defaults[field]:
                        if merged[field] != sf.MixedPrecision._field_defaults[field] and merged[field] != v:
                            return None
                        merged[field] = v
                kwargs[key] = sf.MixedPrecision(**merged)
            elif key in kwargs and kwargs[key] is not value:
                return None
            else:
                kwargs[key] = value
    return Setup(mesh, kwargs, tol=max(s.tol for s in setups), tp=any(s.tp for s in setups),
                 remat=any(s.remat for s in setups), uneven=any(s.uneven for s in setups),
                 compressed=any(s.compressed for s in setups))


# -- the model -----------------------------------------------------------------------------


def mlp_params(seed: int = 0, dtype=torch.float64) -> dict:
    g = torch.Generator().manual_seed(seed)
    blocks = [{"w1": torch.randn(D, H, generator=g) / D ** 0.5, "b1": torch.randn(H, generator=g) * 0.1,
               "w2": torch.randn(H, D, generator=g) / H ** 0.5, "b2": torch.randn(D, generator=g) * 0.1}
              for _ in range(BLOCKS)]
    return {"layers": [{k: v.to(dtype) for k, v in b.items()} for b in blocks],
            "head": (torch.randn(D, 1, generator=g) / D ** 0.5).to(dtype)}


def _block(p, x, tp: bool):
    h = torch.tanh(x @ p["w1"] + p["b1"])
    y = h @ p["w2"]
    if tp:
        y = sf.psum(y, "model")
    return x + y + p["b2"]


def make_loss(tp: bool = False, remat: bool = False) -> Callable:
    block = functools.partial(_block, tp=tp)
    return loss_of(sf.remat(block) if remat else block)


def loss_of(block: Callable) -> Callable:
    """The MLP's loss with `block(p, x)` as each block (the tests' variants of it)."""

    def loss_fn(params, batch):
        x, y = batch
        for p in params["layers"]:
            x = block(p, x)
        return ((x @ params["head"] - y) ** 2).mean()

    return loss_fn


def traced_against_eager(step, batch, steps: int = 3, backend: str = "aot_eager") -> dict:
    """`sf.jit(step, adamw)` and eager `sf.train_step(step, adamw)` from the same shards of the
    MLP, `steps` calls each on `batch`: both losses, whether the shards end equal and their
    largest gap, both `stats()` bytes (all-gather, reduce-scatter, all-reduce) and the
    traced step's backward re-gathers. Raises what either raises (a SpecError: a refusal)."""
    opt = sf.optim.adamw(1e-2)
    shards = step.shard_params(mlp_params())
    state = opt.init(shards)
    eager_shards, eager_state = shards, state
    traced, eager = sf.jit(step, opt, backend=backend), sf.train_step(step, opt)
    out = {"losses": [], "eager_losses": []}
    for _ in range(steps):
        shards, state, loss = traced(shards, state, batch)
        out["losses"].append(float(loss))
        eager_shards, eager_state, eager_loss = eager(eager_shards, eager_state, batch)
        out["eager_losses"].append(float(eager_loss))
    pairs = list(zip(sf._tree.flatten(shards)[0], sf._tree.flatten(eager_shards)[0]))
    out["equal"] = all(torch.equal(a, b) for a, b in pairs)
    out["gap"] = max((float((a - b).abs().max()) for a, b in pairs if a.numel()), default=0.0)
    keys = ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes")
    out["bytes"] = tuple(traced.stats()[k] for k in keys)
    out["eager_bytes"] = tuple(step.stats()[k] for k in keys)
    out["backward_gathers"] = traced.record.backward_gathers
    return out


def global_batch(setup: Setup, n_ranks: int, dtype=torch.float64):
    """Per data rank, its (x, y); and the whole batch."""
    g = torch.Generator().manual_seed(1)
    sizes = [PER_RANK + (r if setup.uneven else 0) for r in range(n_ranks)]
    x = torch.randn(sum(sizes), D, generator=g).to(dtype)
    y = torch.randn(sum(sizes), 1, generator=g).to(dtype)
    parts = list(zip(x.split(sizes), y.split(sizes)))
    return parts, (x, y)


def per_example(batch):
    """The batch as examples of one: each leaf (n, ...) -> (n, 1, ...), for vmap over dim 0."""
    return sf._tree.tree_map(lambda t: t[:, None], batch)


class Model(NamedTuple):
    """A model of the matrix: fp64 params, its loss (tensor parallel or not, remat per
    block or not), the ranks' batches and the whole batch, and one rank's batch shapes for
    `sf.estimate`."""

    params: Callable[[], Any]
    loss: Callable[..., Callable]
    batch: Callable[[Setup, int], tuple]
    shapes: Any
    tp: bool = False  # its loss has a tensor-parallel form


T = 8  # tokens per sequence (GPT, Llama)


def _gpt():
    from shardfn.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=T, n_layer=2, n_head=2, n_embd=16)).double()


def _llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=32,
                                      max_position_embeddings=T, tie_word_embeddings=True)
    # eager attention: torch 2.13's CPU SDPA kernel has no forward AD and no double backward
    # (jvp / Hessian-vector products fail on one device too); every other cell is the same
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").double()


@functools.lru_cache(maxsize=None)
def _module(name: str):
    return {"gpt": _gpt, "llama": _llama}[name]()


def _lm_loss(name: str):
    """The next-token loss from the model's logits, in fp64 (both models' own losses cast
    the logits to float32 first)."""

    def loss(tp: bool = False, remat: bool = False):
        apply_fn, _ = sf.functional(_module(name), remat=remat)

        def loss_fn(p, batch):
            ids, targets = batch
            logits = apply_fn(p, ids) if name == "gpt" else apply_fn(p, input_ids=ids).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

        return loss_fn

    return loss


def _lm_params(name: str):
    return lambda: sf.functional(_module(name))[1]


def _lm_batch(setup: Setup, n_ranks: int):
    """Per data rank its (ids, targets) sequences (rank r: PER_RANK + r with global_mean)."""
    g = torch.Generator().manual_seed(1)
    sizes = [PER_RANK + (r if setup.uneven else 0) for r in range(n_ranks)]
    ids = torch.randint(0, 32, (sum(sizes), T), generator=g)
    parts = list(zip(ids.split(sizes), torch.roll(ids, -1, dims=1).split(sizes)))
    return parts, (ids, torch.roll(ids, -1, dims=1))


_LM_SHAPES = (((PER_RANK, T), torch.long), ((PER_RANK, T), torch.long))

MODELS = {
    "mlp": Model(lambda: mlp_params(), lambda tp=False, remat=False: make_loss(tp, remat),
                 lambda setup, n: global_batch(setup, n), (torch.Size([PER_RANK, D]), torch.Size([PER_RANK, 1])),
                 tp=True),
    "gpt": Model(_lm_params("gpt"), _lm_loss("gpt"), _lm_batch, _LM_SHAPES),
    "llama": Model(_lm_params("llama"), _lm_loss("llama"), _lm_batch, _LM_SHAPES),
}


# -- references (fp64, one device, the global batch) -----------------------------------------


def probe(params):
    """A fixed tangent / probe vector shaped like the params."""
    g = torch.Generator().manual_seed(7)
    return sf._tree.tree_map(lambda p: torch.randn(p.shape, generator=g).to(p.dtype), params)


def reference(setup: Setup, params, batch, entry: str, model: str = "mlp"):
    # remat on one device too: in fp64 it changes nothing but where a model computes in float32
    # (a Llama's RMSNorm), whose recompute under a second derivative rounds in its own order
    loss_fn = MODELS[model].loss(remat=setup.remat)
    if entry == "vmap":  # per-example gradients: every rank holds the same examples
        return _unfrozen(setup, torch.func.vmap(torch.func.grad(loss_fn), in_dims=(None, 0))(
            params, per_example(batch)))
    if entry in ("jvp", "hvp", "hvp_rev"):  # frozen leaves are constants: their tangent is ignored
        v = _unfrozen(setup, probe(params))
        if entry == "jvp":
            return torch.func.jvp(lambda p: loss_fn(p, batch), (params,), (v,))[1]
        if entry == "hvp":
            return _unfrozen(setup, torch.func.jvp(lambda p: torch.func.grad(loss_fn)(p, batch), (params,), (v,))[1])
        # the same mode on one device: a Llama's RMSNorm computes in float32 (its own cast), so the two
        # modes round differently there (5e-8 apart), each equal to its one-device twin
        return _unfrozen(setup, torch.func.grad(lambda p: sum((g * t).sum() for g, t in zip(
            sf._tree.flatten(torch.func.grad(loss_fn)(p, batch))[0], sf._tree.flatten(v)[0])))(params))
    grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
    return _unfrozen(setup, grads), loss


def _unfrozen(setup: Setup, grads):
    """Frozen leaves' gradients are zero."""
    frozen = setup.shard_kwargs.get("frozen")
    if frozen is None:
        return grads
    paths, leaves, treedef = sf._tree.flatten_with_paths(grads)
    return sf._tree.unflatten(treedef, [torch.zeros_like(g) if frozen(p) else g for p, g in zip(paths, leaves)])


# -- entry points -------------------------------------------------------------------------------


def _full(step, tree):
    return step.unshard_params(tree)


def run_entry(entry: str, step, shards, batch, parts: list | None = None) -> dict:
    """Run `entry` on this rank; return what it gives, gathered to full trees."""
    if entry == "call":
        return {"loss": step(shards, batch).detach()}
    if entry == "train_step":
        opt = sf.optim.sgd(LR)
        new, _, loss = sf.train_step(step, opt)(shards, opt.init(shards), batch)
        return {"loss": loss, "params": _full(step, new)}
    if entry == "grad_and_value":
        grads, loss = step.grad_and_value(shards, batch)
        return {"loss": loss, "grads": _full(step, grads)}
    if entry == "func_grad":
        grads, loss = torch.func.grad_and_value(step)(shards, batch)
        return {"loss": loss.detach(), "grads": _full(step, grads)}
    if entry == "backward":
        leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in sf._tree.flatten(shards)[0]]
        tree = sf._tree.unflatten(sf._tree.flatten(shards)[1], leaves)
        loss = step(tree, batch)
        loss.backward()
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
        return {"loss": loss.detach(), "grads": _full(step, sf._tree.unflatten(sf._tree.flatten(shards)[1], grads))}
    if entry in ("jvp", "hvp", "hvp_rev"):
        v = step.shard_params(probe(step.unshard_params(shards)))
        if entry == "jvp":
            loss, tangent = torch.func.jvp(lambda s: step(s, batch), (shards,), (v,))
            return {"loss": loss.detach(), "tangent": tangent.detach()}
        if entry == "hvp":
            hvp = torch.func.jvp(lambda s: torch.func.grad(step)(s, batch), (shards,), (v,))[1]
        else:
            hvp = torch.func.grad(lambda s: sum((g * t).sum() for g, t in zip(
                sf._tree.flatten(torch.func.grad(step)(s, batch))[0], sf._tree.flatten(v)[0])))(shards)
        return {"hvp": _full(step, hvp)}
    if entry == "vmap":
        grads = torch.func.vmap(torch.func.grad(step), in_dims=(None, 0))(shards, per_example(batch))
        n = sf._tree.flatten(batch)[0][0].shape[0]
        return {"per_example": [_full(step, sf._tree.tree_map(lambda g, i=i: g[i], grads)) for i in range(n)]}
    if entry.startswith("accumulate"):
        mode = entry.partition(":")[2] or "reduce_each"
        half = sf._tree.flatten(batch)[0][0].shape[0] // 2
        micro = [sf._tree.tree_map(lambda t: t[:half], batch), sf._tree.tree_map(lambda t: t[half:], batch)]
        grads, loss = step.accumulate(shards, micro, mode=mode)
        return {"loss": loss.detach(), "grads": _full(step, grads)}
    raise KeyError(entry)


# -- one cell ------------------------------------------------------------------------------


def _max_rel(got, want) -> float:
    paths, g_leaves, _ = sf._tree.flatten_with_paths(got)
    w_leaves = sf._tree.flatten(want)[0]
    top = max(float(w.abs().max()) for w in w_leaves) or 1.0
    return max(float((g.to(torch.float64) - w).abs().max()) for g, w in zip(g_leaves, w_leaves)) / top


@functools.lru_cache(maxsize=None)
def _mesh(shape: tuple):
    return sf.local_mesh(dict(shape))


def data_rank(mesh, setup: Setup) -> tuple[int, int]:
    """(this rank's index over the data axes, their size)."""
    axes = setup.shard_kwargs.get("data_axes", ("data",))
    axes = (axes,) if isinstance(axes, str) else axes
    index, size = 0, 1
    for a in axes:
        index, size = index * mesh.shape[a] + mesh.coords[a], size * mesh.shape[a]
    return index, size


def expected_refusal(options: tuple[str, ...], entry: str) -> Exception | None:
    """The table's error for these options under `entry`, as the step raises it: the
    options the step's config shows, in the table's order (`sf.remat` is found at run time,
    so it is refused only when nothing else is)."""
    ordered = [o.key for o in support.OPTIONS if o.key in options]
    static = [o for o in ordered if o != "remat"]
    return support.refusal(entry, static) or support.refusal(entry, ordered)


def run_cell(option, entry: str, model: str = "mlp") -> list[str]:
    """Run one cell on the MLP: `option` is an option key or a tuple of them (a pair);
    returns the problems found ([] = equal to the reference, or refused by the table's own
    error)."""
    options = (option,) if isinstance(option, str) else tuple(option)
    setup = combine(options)
    if setup is None:
        return []  # not a combination one step can have (see `combine`)
    table_entry = entry.partition(":")[0]
    if setup.tp and not MODELS[model].tp:
        return []  # the model's forward has no tensor-parallel form (its loss would need collectives)
    if table_entry == "estimate":
        return _estimate_cell(options, setup, model)
    if table_entry == "jit":
        return _jit_refusal_cell(options, setup, model)
    mesh = _mesh(setup.mesh_shape)
    params = MODELS[model].params()
    loss_fn = MODELS[model].loss(tp=setup.tp, remat=setup.remat)
    step = sf.shard(loss_fn, mesh, **setup.shard_kwargs)

    def body():
        index, size = data_rank(mesh, setup)
        parts, whole = MODELS[model].batch(setup, size)
        batch = parts[index]
        if entry == "vmap":  # per-example gradients: every rank holds the same examples
            batch = parts[0]
            whole = parts[0]
        shards = step.shard_params(params)
        try:
            got = run_entry(entry, step, shards, batch)
        except sf.ShardingError as e:
            return ("refused", str(e))
        return ("ran", got, whole, step.stats())

    results = mesh.run(body)
    problems = []
    want = expected_refusal(options, table_entry)
    if want is not None:
        for r in results:
            if r[0] != "refused" or str(want) not in r[1]:
                problems.append(f"expected the table's refusal {str(want)[:80]!r}, got {r[0]}: {str(r[1])[:300]}")
        return problems
    for r in results:
        if r[0] == "refused":
            problems.append(f"refused, but the table supports it: {r[1][:400]}")
            continue
        _, got, whole, stats = r
        problems += _compare(setup, params, whole, entry, got, stats, options, model)
    return problems


def _compare(setup, params, whole, entry, got, stats, options=(), model: str = "mlp") -> list[str]:
    problems = []
    want_grads, want_loss = reference(setup, params, whole, "grads", model) if entry != "vmap" else (None, None)
    if "loss" in got:
        err = abs(float(got["loss"]) - float(want_loss)) / max(abs(float(want_loss)), 1e-30)
        if not err <= setup.tol:
            problems.append(f"loss off by {err:.3g} (relative; tol {setup.tol})")
    if "grads" in got:
        err = _max_rel(got["grads"], want_grads)
        if not err <= setup.tol:
            problems.append(f"grads off by {err:.3g} (max |err| / max |grad|; tol {setup.tol})")
    if "params" in got:
        want = sf._tree.tree_map(lambda p, g: p - LR * g, params, want_grads)
        err = _max_rel(got["params"], want)
        if not err <= setup.tol:
            problems.append(f"params after one SGD step off by {err:.3g} (tol {setup.tol})")
    if "tangent" in got:
        want = reference(setup, params, whole, "jvp", model)
        err = abs(float(got["tangent"]) - float(want)) / max(abs(float(want)), 1e-30)
        if not err <= setup.tol:
            problems.append(f"the loss' tangent off by {err:.3g} (relative; tol {setup.tol})")
    if "hvp" in got:
        err = _max_rel(got["hvp"], reference(setup, params, whole, entry, model))
        if not err <= setup.tol:
            problems.append(f"the Hessian-vector product off by {err:.3g} (tol {setup.tol})")
    if "per_example" in got:
        want = reference(setup, params, whole, "vmap", model)
        for i, g in enumerate(got["per_example"]):
            err = _max_rel(g, sf._tree.tree_map(lambda w: w[i], want))
            if not err <= setup.tol:
                problems.append(f"example {i}'s gradient off by {err:.3g} (tol {setup.tol})")
                break
    if setup.compressed and _narrower_wire(setup):  # the wire format was used: fewer bytes than without it
        full = _full_precision_bytes(options, entry, model)  # (forward-mode tangents are gathered exactly, in full precision)
        if not 0 < stats["all_gather_bytes"] < full:
            problems.append(f"all-gather bytes {stats['all_gather_bytes']} are not compressed (full precision: {full})")
    return problems


def _narrower_wire(setup: Setup) -> bool:
    """Whether the all-gather's wire format is narrower than the compute dtype (a bf16 wire
    under bf16 compute is the same bytes plus each row's padding)."""
    mp = setup.shard_kwargs["mixed_precision"]
    wire = mp.all_gather_dtype
    itemsize = 1 if wire == "int8" else wire.itemsize if wire is not None else 8
    return wire is None or itemsize < (mp.param_dtype or torch.float64).itemsize


@functools.lru_cache(maxsize=None)
def _full_precision_bytes(options: tuple[str, ...], entry: str, model: str = "mlp") -> int:
    """The all-gather bytes of the same cell with the wire formats off."""
    setup = combine(options)
    mp = setup.shard_kwargs["mixed_precision"]._replace(all_gather_dtype=None, reduce_scatter_dtype=None)
    setup = dataclasses.replace(setup, shard_kwargs=dict(setup.shard_kwargs, mixed_precision=mp))
    mesh = _mesh(setup.mesh_shape)
    step = sf.shard(MODELS[model].loss(tp=setup.tp, remat=setup.remat), mesh, **setup.shard_kwargs)

    def body():
        index, size = data_rank(mesh, setup)
        parts, _ = MODELS[model].batch(setup, size)
        batch = parts[0] if entry == "vmap" else parts[index]
        run_entry(entry, step, step.shard_params(MODELS[model].params()), batch)
        return step.stats()["all_gather_bytes"]

    return max(mesh.run(body))


def _estimate_cell(options: tuple[str, ...], setup: Setup, model: str = "mlp") -> list[str]:
    """sf.estimate's collective bytes equal the eager step's stats() (its grad_and_value,
    the path sf.train_step takes), or the table's refusal."""
    params = MODELS[model].params()
    loss_fn = MODELS[model].loss(tp=setup.tp, remat=setup.remat)
    shape = dict(setup.mesh_shape)
    want = expected_refusal(options, "estimate")
    try:
        est = sf.estimate(loss_fn, params, MODELS[model].shapes, shape,
                          dtype=torch.float64, **setup.shard_kwargs)
    except sf.ShardingError as e:
        if want is not None and str(want) in str(e):
            return []
        return [f"sf.estimate raised: {str(e)[:400]}"]
    if want is not None:
        return ["sf.estimate ran, but the table refuses it"]
    if setup.uneven:  # the dry run gives every rank the same batch shape; compare on equal batches
        setup = dataclasses.replace(setup, uneven=False)
    mesh = _mesh(setup.mesh_shape)
    step = sf.shard(loss_fn, mesh, **setup.shard_kwargs)

    def body():
        index, size = data_rank(mesh, setup)
        parts, _ = MODELS[model].batch(setup, size)
        shards = step.shard_params(params)
        step(shards, parts[index])  # the estimate's first forward, which learns the order
        step.grad_and_value(shards, parts[index])
        return step.stats()

    stats = max(mesh.run(body), key=lambda s: s["all_gather_bytes"])
    problems = []
    for key in ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "peak_gathered_bytes"):
        if getattr(est, key) != stats[key]:
            problems.append(f"sf.estimate's {key} {getattr(est, key)} != the step's {stats[key]}")
    return problems


def _jit_refusal_cell(options: tuple[str, ...], setup: Setup, model: str = "mlp") -> list[str]:
    """On the simulated mesh sf.jit runs nothing, but checks the options first: a refused
    option raises the table's error (a supported one gets to the backend check)."""
    mesh = _mesh(setup.mesh_shape)
    step = sf.shard(MODELS[model].loss(tp=setup.tp, remat=setup.remat), mesh, **setup.shard_kwargs)
    params = MODELS[model].params()

    def body():
        index, size = data_rank(mesh, setup)
        parts, _ = MODELS[model].batch(setup, size)
        shards = step.shard_params(params)
        opt = sf.optim.sgd(LR)
        try:
            sf.jit(step, opt, backend="aot_eager")(shards, opt.init(shards), parts[index])
        except sf.ShardingError as e:
            return str(e)
        return "ran"

    messages = mesh.run(body)
    # sf.remat is found while tracing, on processes (tests/fsdp/test_composition.py)
    want = support.refusal("jit", [o.key for o in support.OPTIONS if o.key in options and o.key != "remat"])
    problems = []
    for m in messages:
        if want is not None and str(want) not in m:
            problems.append(f"expected the table's refusal, got: {m[:300]}")
        if want is None and "needs the distributed backend" not in m:
            problems.append(f"expected the backend refusal on the simulated mesh, got: {m[:300]}")
    return problems


def release() -> None:
    """Drop the cached meshes (each holds gloo groups and their threads for every rank and
    axis subset: an 8-rank, 3-axis mesh holds hundreds) and models, so that the rest of a
    test session does not run beside their threads."""
    _mesh.cache_clear()
    _full_precision_bytes.cache_clear()
    _module.cache_clear()
    from shardfn import _estimate

    _estimate._meta_mesh.cache_clear()  # sf.estimate's meta meshes, one per mesh shape the cells used
    gc.collect()


ENTRY_KEYS = ("call", "train_step", "grad_and_value", "func_grad", "backward", "jvp", "hvp", "hvp_rev", "vmap",
              "accumulate:reduce_each",
              "accumulate:reduce_once", "jit", "estimate")
CELLS: list[tuple[str, str]] = [(o, e) for o in SETUPS for e in ENTRY_KEYS]

# Cells that are neither right nor refused by the table, each with the clear error it raises
# instead (a torch limit found by the matrix; the docs page lists them).
KNOWN: dict[tuple[str, str, str], str] = {}
PAIRS: list[tuple[str, str]] = [(a, b) for i, a in enumerate(SETUPS) for b in list(SETUPS)[i + 1:]
                                if "none" not in (a, b) and combine((a, b)) is not None]

