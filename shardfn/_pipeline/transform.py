"""`sf.pipeline`: pipeline parallelism as a function transform.

[Note: the pipeline loss] `pipeline(layer_fn, post=..., microbatches=M)` returns a loss
function of `(params, batch)` called on every rank (local view, like a shard_map body over
the pipeline axis): `params["layers"]` is this rank's block of the stacked layers
(`P('stage')`, [Note: stacked layers]), `params["pre"]` / `params["post"]` are whole on
every rank. The loss is the mean of `post(...)` over the microbatches, the same on every
rank of the axis; the gradients of `pre` / `post` are summed over the axis (the rank that
used them computed all of it) and so are the same on every rank too, as for any
replicated input of a shard_map. One autograd.Function wraps the step: its forward runs
the whole schedule ([Note: the executor]) and keeps the gradients, its backward scales
them by the incoming cotangent. So `torch.func.grad`, `loss.backward()`,
`sf.train_step` and `sf.shard` (FSDP over another mesh axis; the pipeline's own messages
go over the pipeline axis only) all see an ordinary differentiable function. Not
supported: forward mode (`jvp`), `vmap` over the loss, double backward.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Mapping

import torch

from .. import _tree
from .._backend import ops
from .._binding import bound_mesh
from .._errors import ShardingError
from .._params_view import ParamsView, materialize
from .._spec import P
from . import checks
from .executor import Stage, execute
from .schedule import Schedule, make_schedule
from .stages import layer_view, local_layer_count, stage_specs

__all__ = ["pipeline", "Pipeline"]


class _Step:
    """The inputs of one call, carried into the autograd.Function as one plain object."""

    def __init__(self, run: Callable):
        self.run = run
        self.grads: tuple = ()


class _PipelineStep(torch.autograd.Function):
    @staticmethod
    def forward(step, *leaves):
        loss, grads = step.run(list(leaves))
        step.grads = grads
        return loss

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.grads = inputs[0].grads

    @staticmethod
    def backward(ctx, g):  # the step's loss is a scalar: its VJP is the gradient times g
        return (None,) + tuple(None if gr is None else gr * g for gr in ctx.grads)


class Pipeline:
    """The loss function `sf.pipeline` returns; call it as `loss = pipe(params, batch)`."""

    def __init__(self, layer_fn, post, microbatches, schedule, mesh_axis, virtual_stages, pre, mesh):
        self.layer_fn, self.post, self.pre = layer_fn, post, pre
        self.microbatches, self.mesh_axis, self.virtual_stages, self.mesh = microbatches, mesh_axis, virtual_stages, mesh
        self._schedule = schedule
        self._schedules: dict[int, Schedule] = {}
        self._checked: dict = {}
        self._local = threading.local()
        self.__name__ = f"pipeline({getattr(layer_fn, '__name__', 'layer_fn')})"

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self, stages: int | None = None) -> Schedule:
        """The schedule for `stages` ranks (default: the pipeline axis of the mesh)."""
        if stages is None:
            stages = self._mesh("schedule").shape[self.mesh_axis]
        if isinstance(self._schedule, Schedule):
            s = self._schedule
            if (s.stages, s.microbatches, s.virtual_stages) != (stages, self.microbatches, self.virtual_stages):
                raise ShardingError(
                    f"{self.__name__}: the schedule given is for {s.stages} stages, {s.microbatches} microbatches, "
                    f"{s.virtual_stages} virtual stages; this run has {stages}, {self.microbatches}, "
                    f"{self.virtual_stages}.\nFix: build the Schedule for the mesh's {self.mesh_axis!r} axis.")
            return s
        if stages not in self._schedules:
            self._schedules[stages] = make_schedule(self._schedule, stages, self.microbatches, self.virtual_stages)
        return self._schedules[stages]

    def trace(self) -> list[tuple]:
        """This rank's actions of the last training call: (Action, start, end) in
        `time.perf_counter()` seconds, in the order they ran."""
        return list(getattr(self._local, "trace", []))

    def measured_bubble(self) -> float:
        """This rank's idle fraction in the last training call, from the trace's timestamps:
        1 - (time in this rank's actions) / (the step's span), the bubble the schedules'
        formulas count. The span runs from the first rank entering the schedule to the last
        rank leaving it (a max all-reduce over that call's pipeline axis: call it on every
        rank after a training call), so the fill and drain a rank waits through before its
        first and after its last action count as idle, as in theory. Timestamps are `time.perf_counter()`, one clock across
        the threads and processes of one host.
        """
        trace, span = self.trace(), getattr(self._local, "span", None)
        if not trace or span is None:
            return 0.0
        began, ended, group = span  # the pipeline group of that call
        ends = torch.tensor([-began, ended], dtype=torch.float64, device=group.backend.device)
        ends = ops.all_reduce(group, ends, "max")
        whole = float(ends[0] + ends[1])
        return 1 - sum(e - s for _, s, e in trace) / whole if whole > 0 else 0.0

    # -- layout -----------------------------------------------------------------------------

    def specs(self, params: Mapping) -> dict:
        """The spec tree of global params: `layers` over the pipeline axis, the rest `P()`."""
        out = {"layers": stage_specs(params["layers"], self.mesh_axis, self.virtual_stages)}
        for key in ("pre", "post"):
            if key in params:
                out[key] = _tree.tree_map(lambda _: P(), params[key])
        return out

    def scatter_params(self, params: Mapping) -> dict:
        """This rank's params from global ones (the same on every rank): `layers` split.

        Raises:
          ShardingError: the layer count does not divide into stages x virtual stages.
        """
        from .._shard_map import scatter

        mesh = self._mesh("scatter_params")
        p = mesh.shape[self.mesh_axis]
        leaves = _tree.flatten(params["layers"])[0]
        dims = 2 if self.virtual_stages > 1 else 1
        n = int(leaves[0].shape[dims - 1]) * (self.virtual_stages if dims == 2 else 1)
        if n % (p * self.virtual_stages):
            raise _indivisible(self.__name__, n, p, self.virtual_stages, self.mesh_axis)
        specs = self.specs(params)
        return {k: _tree.tree_map(lambda x, s: scatter(x, mesh, s), params[k], specs[k]) for k in params}

    # -- the call ---------------------------------------------------------------------------

    def _mesh(self, what: str):
        mesh = self.mesh if self.mesh is not None else bound_mesh()
        if mesh is None:
            raise ShardingError(f"{self.__name__}.{what}: no mesh. Pass mesh= to sf.pipeline, or call it inside "
                                f"sf.shard / sf.shard_map over a mesh with a {self.mesh_axis!r} axis.")
        if self.mesh_axis not in mesh.shape:
            raise ShardingError(f"{self.__name__}: the mesh has no axis {self.mesh_axis!r} (axes: "
                                f"{list(mesh.axis_names)}).\nFix: sf.pipeline(..., mesh_axis=<one of them>).")
        return mesh

    def __call__(self, params, batch):
        if isinstance(params, ParamsView):
            params = materialize(params)
        if not isinstance(params, Mapping) or "layers" not in params:
            raise ShardingError(f"{self.__name__}: params must be a dict with 'layers' (the stacked layers) and "
                                f"optionally 'pre' / 'post'; got {type(params).__name__}"
                                f"{' with keys ' + str(list(params)) if isinstance(params, Mapping) else ''}.")
        if self.pre is None and "pre" in params:
            raise ShardingError(f"{self.__name__}: params['pre'] given but no pre= function.\nFix: pass "
                                f"sf.pipeline(..., pre=embed_fn), or drop params['pre'].")
        mesh = self._mesh("__call__")
        group = mesh.group((self.mesh_axis,))
        schedule = self.schedule(group.size)
        microbatches = checks.split_microbatches(batch, self.microbatches, self.__name__)
        layer_leaves, layer_def = _tree.flatten(params["layers"])
        pre_leaves, pre_def = _tree.flatten(params.get("pre", {}))
        post_leaves, post_def = _tree.flatten(params.get("post", {}))
        all_leaves = layer_leaves + pre_leaves + post_leaves
        diff = [i for i, x in enumerate(all_leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        train = torch.is_grad_enabled() and any(all_leaves[i].requires_grad for i in diff)
        counts = (len(layer_leaves), len(pre_leaves), len(post_leaves))

        def run(float_leaves: list):
            leaves = list(all_leaves)
            for i, x in zip(diff, float_leaves):
                leaves[i] = x
            return self._run(group, schedule, leaves, counts, layer_def, pre_def, post_def, microbatches, batch, train)

        if not train:
            with torch.no_grad():
                return run([all_leaves[i] for i in diff])
        return _PipelineStep.apply(_Step(run), *[all_leaves[i] for i in diff])

    def _run(self, group, schedule: Schedule, leaves, counts, layer_def, pre_def, post_def, microbatches, batch,
             train: bool):
        nl, npre, _ = counts
        layer_leaves, pre_leaves, post_leaves = leaves[:nl], leaves[nl:nl + npre], leaves[nl + npre:]
        V, p, rank = self.virtual_stages, group.size, group.index
        per_chunk = local_layer_count(layer_leaves, V, self.__name__)
        stage = Stage(self.layer_fn, layer_def, layer_view(layer_leaves, V), self.pre, pre_def, pre_leaves,
                      self.post, post_def, post_leaves)
        chunks = list(range(rank, p * V, p))
        act_shape, act_dtype, loss_dtype = self._check(group, schedule, stage, chunks, per_chunk, leaves,
                                                       microbatches, batch)
        trace: list = []
        began = time.perf_counter()
        loss_sum, g_layers, g_pre, g_post = execute(schedule, rank, group, stage, microbatches, _first_input,
                                                    act_shape, act_dtype, train, trace)
        if train:
            self._local.trace = trace
            self._local.span = (began, time.perf_counter(), group)
        loss = loss_sum / self.microbatches if loss_sum is not None else torch.zeros((), dtype=loss_dtype)
        loss = loss.reshape(()).to(loss_dtype)
        if not train:
            return _psum([loss], group)[0]
        shared = [loss] + [g if g is not None else torch.zeros_like(w) for g, w in zip(g_pre + g_post,
                                                                                          pre_leaves + post_leaves)]
        shared = _psum(shared, group)
        loss, g_shared = shared[0], shared[1:]
        g_stack = []
        for i, w in enumerate(layer_leaves):
            rows = [torch.stack([g[i] if g[i] is not None else torch.zeros_like(layer[i])
                                 for g, layer in zip(g_layers[v], stage.chunks[v])]) for v in range(V)]
            g_stack.append(torch.stack(rows) if V > 1 else rows[0])
        grads = g_stack + g_shared
        diff = [g for g, x in zip(grads, leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        return loss, tuple(diff)

    def _check(self, group, schedule, stage, chunks, per_chunk, leaves, microbatches, batch):
        """[Note: every rank raises] once per signature; returns the activation's shape and dtype."""
        # per rank of the mesh (ranks at one stage index but other data / model coords check apart)
        key = (id(group.backend), group.backend.rank(), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x)
                                  for x in leaves + _tree.flatten(batch)[0]))
        if key in self._checked:
            return self._checked[key]
        try:
            with ops.meta_run():  # collectives inside a stage (TP) answer meta tensors at once
                problem, shape, dtype, loss_dtype = checks.probe(stage, chunks, schedule.chunks - 1 in chunks,
                                                                 microbatches[0], _first_input, per_chunk)
        except Exception as err:  # a stage that fails on its own: tell the peers before raising
            problem, shape, dtype, loss_dtype = (f"a stage raised {type(err).__name__}: {err}".replace("|", "/"),
                                                 None, None, None)
        lines = checks.agree(group, f"{per_chunk}|{loss_dtype}|{problem}")
        counts = [int(line.split("|", 2)[0]) for line in lines]
        V, p = self.virtual_stages, group.size
        if len(set(counts)) != 1 or counts[0] < 1:
            total = sum(counts) * V
            raise _indivisible(self.__name__, total, p, V, self.mesh_axis, counts)
        for r, line in enumerate(lines):
            msg = line.split("|", 2)[2]
            if msg:
                raise ShardingError(f"{self.__name__}: on rank {r} of the {self.mesh_axis!r} axis, {msg}\nFix: keep "
                                    f"the activation's shape and dtype through every layer (put an embedding in "
                                    f"pre= and the head and loss in post=).")
        loss_dtype = next(getattr(torch, line.split("|")[1].split(".")[-1]) for line in lines
                          if line.split("|")[1] != "None")
        self._checked[key] = (shape, dtype, loss_dtype)
        return self._checked[key]


def _indivisible(name, total, p, V, axis, counts=None) -> ShardingError:
    got = f" (the ranks hold {counts} layers per chunk)" if counts else ""
    return ShardingError(
        f"{name}: {total} layers do not split into {p} stages x {V} virtual stages over mesh axis {axis!r}{got}: "
        f"every chunk must hold the same number of layers, at least one.\nFix: a layer count divisible by "
        f"{p * V}, or another stage count; scatter the stacked layers with pipe.scatter_params(params)."
    )


def _first_input(mb):
    """The first layer's input when there is no pre=: the microbatch itself, or its first entry."""
    if isinstance(mb, torch.Tensor):
        return mb
    if isinstance(mb, (tuple, list)) and mb:
        return mb[0]
    if isinstance(mb, Mapping) and "x" in mb:
        return mb["x"]
    raise ShardingError("sf.pipeline: without pre=, the batch must be a tensor, a tuple (x, ...) or a dict with "
                        "'x'.\nFix: pass pre=lambda params, mb: <the first layer's input>.")


def _psum(tensors: list, group) -> list:
    """Sum each tensor over the group: one all-reduce per dtype."""
    if group.size == 1:
        return tensors
    out = list(tensors)
    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        flat = ops.all_reduce(group, flat, "sum")
        at = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = flat[at:at + n].view(tensors[i].shape)
            at += n
    return out


def pipeline(layer_fn: Callable, *, post: Callable, microbatches: int, schedule: str | Schedule = "1f1b",
             mesh_axis: str = "stage", virtual_stages: int = 1, pre: Callable | None = None,
             mesh=None) -> Pipeline:
    """Pipeline parallelism as a function transform: a loss over stages of stacked layers.

    Args:
      layer_fn: `layer_fn(layer_params, x) -> x`, one layer; it must keep `x`'s shape and dtype.
      post: `post(post_params, x, microbatch) -> scalar loss` of one microbatch (the head
        and the loss), run on the last stage.
      microbatches: `M`, how many microbatches each batch is cut into along dim 0.
      schedule: "gpipe", "1f1b", "interleaved" (with `virtual_stages >= 2`), "zb-h1", or
        a `Schedule` you built (see `sf.pipeline.schedule`).
      mesh_axis: the mesh axis the stages lie on.
      virtual_stages: `V` chunks of layers per rank (interleaved 1F1B).
      pre: `pre(pre_params, microbatch) -> x` (the embedding), run on the first stage;
        without it the first layer gets the microbatch (or its first entry).
      mesh: the mesh; default: the mesh of the enclosing `sf.shard` / `sf.shard_map`.

    Returns:
      A `Pipeline`: `loss = pipe(params, batch)` on every rank, with `params = {"layers":
      this rank's block of the stack, "pre": ..., "post": ...}` and `batch` the whole batch
      (the same on every rank of the axis). The loss (mean over microbatches) and the
      gradients of `pre` / `post` are the same on every rank of the axis ([Note: the
      pipeline loss]). Also: `.schedule()`, `.specs(params)`, `.scatter_params(params)`,
      `.trace()`, `.measured_bubble()`.

    Raises:
      ShardingError: an invalid microbatch count or schedule (here); a batch that M does
        not divide, layers that do not split into stages, a layer that changes the
        activation's shape or dtype (when called; on every rank, [Note: every rank raises]).

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"stage": 2})
      >>> layers = {"w": torch.eye(3, dtype=torch.float64).repeat(4, 1, 1)}  # 4 layers, stacked
      >>> pipe = sf.pipeline(lambda w, x: torch.tanh(x @ w["w"]), post=lambda _, x, mb: x.square().mean(),
      ...                    microbatches=2, mesh=mesh)
      >>> x = torch.ones(4, 3, dtype=torch.float64)
      >>> losses = mesh.run(lambda: float(pipe(pipe.scatter_params({"layers": layers}), (x,))))
      >>> round(losses[0], 6) == round(losses[1], 6)
      True
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ShardingError(f"sf.pipeline: microbatches must be a positive int, got {microbatches!r}.\nFix: e.g. "
                            f"microbatches=2 * stages (the bubble shrinks as M grows).")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ShardingError(f"sf.pipeline: virtual_stages must be a positive int, got {virtual_stages!r}.")
    if isinstance(schedule, str):
        make_schedule(schedule, 1, microbatches, virtual_stages)  # validates the name and options now
    elif not isinstance(schedule, Schedule):
        raise ShardingError(f"sf.pipeline: schedule must be a name or a Schedule, got {type(schedule).__name__}.")
    return Pipeline(layer_fn, post, microbatches, schedule, mesh_axis, virtual_stages, pre, mesh)
