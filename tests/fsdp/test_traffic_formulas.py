"""A `shard` step's traffic against byte counts computed here from the parameter shapes.

`tests/fsdp/test_traffic.py` checks `step.stats()` against the backend's recording; both could
agree on a wrong number. Here the expected bytes come from the design's formulas
(docs/design/memory.md "Communication per step"), per option, and both `stats()` and the
recording (`ops.recording`, tests/traffic.py) must equal them:

- a unit is every leaf of one block (`params["layers"][i]`), the root everything else;
  0-dim leaves are replicated, outside every unit;
- a unit's all-gather moves its padded unsharded buffer: per leaf k * ceil(rows / k) rows
  (dim-0 chunks, zero-padded), in param_dtype; with reshard_after_forward every block is
  gathered twice (forward and backward) and the root once; without, each once; hpZ's
  backward re-gather moves the whole buffer again (from the kept rows);
- a unit's reduce-scatter moves the same padded numel in reduce_dtype, once per step
  (per micro-batch with accumulate's reduce_each), none for a frozen unit;
- all-reduces: the loss with the batch-size check ([loss, n, n^2, unknown] in float64: 32
  bytes) per forward, the replicated leaves' gradients (in reduce_dtype, else at least
  float32), and under HSDP each unit's reduce-scattered shard across the replicas;
- one collective per gather, reduce-scatter and all-reduce.
"""

from __future__ import annotations

import dataclasses
import math

import optree
import pytest
import torch

import shardfn as sf
from collective_cases import mesh_for
from traffic import sent, stats_view, totals

F64 = torch.float64
SHAPES = {  # rows that do not divide by 2, 3 or 4 somewhere: padding in the buffers
    "embed": (5, 6),
    "layers": [{"w": (6, 6), "b": (6,)}, {"w": (6, 6), "b": (6,)}, {"w": (6, 6), "b": (6,)}],
    "head": (6, 3),
    "temperature": (),  # 0-dim: replicated, its gradient all-reduced
}
ROOT = ("embed", "head")
BATCH = 4


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    return optree.tree_map(lambda s: (torch.randn(s, generator=g, dtype=F64) * 0.5 + (1.0 if s == () else 0.0))
                           .to(dtype), SHAPES, is_leaf=lambda x: isinstance(x, tuple))


def _loss_fn(p, batch):
    x, y = batch
    h = x @ p["embed"]
    for layer in p["layers"]:
        h = torch.tanh(h @ layer["w"] + layer["b"])
    return ((h @ p["head"] - y) ** 2).mean() * p["temperature"]


def _padded(shape, k) -> int:
    rows, per = shape[0], math.prod(shape[1:])
    return k * math.ceil(rows / k) * per


@dataclasses.dataclass
class Setup:
    mesh: dict
    options: dict = dataclasses.field(default_factory=dict)
    k: int = 2  # the shard group's size
    replicas: int = 1  # HSDP replicas
    param_bytes: int = 8  # itemsize of what is gathered
    reduce_bytes: int = 8  # ... and reduce-scattered
    frozen_layers: tuple = ()
    micro: int = 1  # accumulate's micro-batches
    reduce_once: bool = False

    @property
    def reshard(self) -> bool:
        return self.options.get("reshard_after_forward", True) is not False

    def expected(self) -> dict[str, int]:
        """The formulas of the module docstring, from SHAPES alone."""
        root = sum(_padded(SHAPES[name], self.k) for name in ROOT)
        units = [sum(_padded(s, self.k) for s in layer.values()) for layer in SHAPES["layers"]]
        gathers = (root + sum(units) * (2 if self.reshard else 1)) * self.micro
        n_gathers = (1 + len(units) * (2 if self.reshard else 1)) * self.micro
        trained = [root] + [u for i, u in enumerate(units) if i not in self.frozen_layers]
        reductions = 1 if self.reduce_once else self.micro
        scatter = sum(trained) * self.reduce_bytes * reductions
        replicated = 1 * self.reduce_bytes  # the temperature's gradient
        all_reduce = 32 * self.micro + replicated * reductions
        n_all_reduce = self.micro + reductions
        if self.replicas > 1:  # each unit's gradient shard across the replicas
            all_reduce += sum(t // self.k for t in trained) * self.reduce_bytes * reductions
            n_all_reduce += len(trained) * reductions
        return {
            "all_gather_bytes": gathers * self.param_bytes,
            "reduce_scatter_bytes": scatter,
            "all_reduce_bytes": all_reduce,
            "num_collectives": n_gathers + len(trained) * reductions + n_all_reduce,
        }


BF16 = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16_BOTH = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
SETUPS = {
    "fsdp2": Setup({"data": 2}),
    "fsdp4": Setup({"data": 4}, k=4),
    "fsdp3": Setup({"data": 3}, k=3),
    "fsdp2-no-reshard": Setup({"data": 2}, dict(reshard_after_forward=False)),
    "fsdp4-no-reshard": Setup({"data": 4}, dict(reshard_after_forward=False), k=4),
    "fsdp4-prefetch2": Setup({"data": 4}, dict(prefetch=2), k=4),
    "fsdp4-prefetch0": Setup({"data": 4}, dict(prefetch=0), k=4),
    "hsdp2x2": Setup({"replica": 2, "shard": 2}, dict(data_axes=("replica", "shard"), shard_axes="shard"),
                     replicas=2),
    "hpz2x2": Setup({"node": 2, "gpu": 2}, dict(data_axes=("node", "gpu"), reshard_after_forward="gpu"), k=4),
    "bf16": Setup({"data": 2}, dict(mixed_precision=BF16), param_bytes=2, reduce_bytes=4),
    "bf16-reduce": Setup({"data": 4}, dict(mixed_precision=BF16_BOTH), k=4, param_bytes=2, reduce_bytes=2),
    "frozen": Setup({"data": 2}, dict(frozen=lambda path: path[:2] == ("layers", 1)), frozen_layers=(1,)),
    "accumulate-each": Setup({"data": 2}, micro=2),
    "accumulate-once": Setup({"data": 2}, micro=2, reduce_once=True),
    "accumulate-once-hsdp": Setup({"replica": 2, "shard": 2}, dict(data_axes=("replica", "shard"),
                                                                    shard_axes="shard"),
                                  replicas=2, micro=2, reduce_once=True),
}


def _run(setup: Setup, how: str):
    """Per rank: (what the backend recorded, stats()) of one gradient step."""
    mesh = mesh_for(setup.mesh)
    dtype = torch.float32 if "mixed_precision" in setup.options else F64
    params = _params(dtype)
    step = sf.shard(_loss_fn, mesh, **setup.options)
    data_axes = setup.options.get("data_axes", "data")

    def body():
        g = torch.Generator().manual_seed(10 + mesh.group(data_axes).index)
        batch = (torch.randn(BATCH, 5, generator=g, dtype=dtype), torch.randn(BATCH, 3, generator=g, dtype=dtype))
        shards = step.shard_params(params)
        step(shards, batch)  # the first call learns the order and checks the structure
        with sent() as rec:
            if setup.micro > 1:
                half = BATCH // setup.micro
                micro = [(batch[0][i:i + half], batch[1][i:i + half]) for i in range(0, BATCH, half)]
                step.accumulate(shards, micro, mode="reduce_once" if setup.reduce_once else "reduce_each")
            elif how == "func":
                torch.func.grad(step)(shards, batch)
            else:
                step.grad_and_value(shards, batch)
        return totals(rec.records), stats_view(step.stats())

    return mesh.run(body)


@pytest.mark.parametrize("how", ["func", "train_step"])
@pytest.mark.parametrize("name", list(SETUPS))
def test_traffic_is_the_formula(name, how):
    setup = SETUPS[name]
    if setup.micro > 1 and how == "func":
        pytest.skip("accumulate has one entry point")
    want = setup.expected()
    for rank, (recorded, stats) in enumerate(_run(setup, how)):
        assert recorded == want, f"rank {rank}: the backend recorded {recorded}, the formula gives {want}"
        assert stats == want, f"rank {rank}: stats() {stats}, the formula gives {want}"


def test_the_formulas_see_the_padding():
    """The padded sizes differ from the plain ones on these shapes, so a count of the
    unpadded buffers (or of the shard instead of the unit) could not pass."""
    plain = sum(math.prod(s) for s in (SHAPES["embed"], SHAPES["head"]))
    assert sum(_padded(SHAPES[n], 4) for n in ROOT) != plain
    assert sum(_padded(s, 4) for s in SHAPES["layers"][0].values()) == 8 * 6 + 8 != 6 * 6 + 6
    assert SETUPS["fsdp2"].expected() != SETUPS["fsdp2-no-reshard"].expected()
