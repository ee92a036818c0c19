"""shardfn: JAX-style functional sharding for PyTorch.

Meshes with named axes (`local_mesh` simulates one in this process, `init_mesh` spans a
torchrun job), partition specs, `shard_map` with named-axis collectives whose gradients
are right, and `shard`: fully sharded data parallelism as a function transform.
"""

from . import checkpoint as checkpoint
from . import init as init
from . import nn as nn
from . import optim as optim
from ._collectives import all_gather as all_gather
from ._collectives import all_to_all as all_to_all
from ._collectives import axis_index as axis_index
from ._collectives import axis_size as axis_size
from ._collectives import pmax as pmax
from ._collectives import pmean as pmean
from ._collectives import pmin as pmin
from ._collectives import ppermute as ppermute
from ._collectives import psum as psum
from ._collectives import psum_scatter as psum_scatter
from ._collectives import pvary as pvary
from ._collectives import ragged_all_to_all as ragged_all_to_all
from ._estimate import Estimate as Estimate
from ._estimate import estimate as estimate
from ._errors import CollectiveTimeoutError as CollectiveTimeoutError
from ._errors import DesyncError as DesyncError
from ._errors import NonFiniteError as NonFiniteError
from ._errors import RankAbortedError as RankAbortedError
from ._errors import ShardingError as ShardingError
from ._errors import SpecError as SpecError
from ._fsdp.stragglers import StragglerWarning as StragglerWarning
from ._fsdp import MixedPrecision as MixedPrecision
from ._fsdp import Shard as Shard
from ._fsdp import shard as shard
from ._functional import functional as functional
from ._memory import MemoryReport as MemoryReport
from ._memory import measure_memory as measure_memory
from ._mesh import Mesh as Mesh
from ._mesh import init_mesh as init_mesh
from ._mesh import local_mesh as local_mesh
from ._per_example import PerExampleGrads as PerExampleGrads
from ._per_example import per_example_grads as per_example_grads
from . import pipeline as pipeline  # a namespace that is also the transform: sf.pipeline(...), sf.pipeline.schedule(...)
from ._remat import policies as remat_policies
from ._remat import remat as remat
from ._remat import tag as tag
from ._shard_map import gather as gather
from ._shard_map import scatter as scatter
from ._shard_map import shard_map as shard_map
from ._spec import P as P
from ._spec import PartitionSpec as PartitionSpec
from ._visualize import visualize_sharding as visualize_sharding
from ._traced import jit as jit
from ._traced import traced_apply as traced_apply
from .optim import train_step as train_step
from ._semisync import diloco as diloco
from ._semisync import local_sgd as local_sgd

__version__ = "0.1.0.dev0"

__all__ = [
    "CollectiveTimeoutError",
    "DesyncError",
    "Estimate",
    "MemoryReport",
    "Mesh",
    "MixedPrecision",
    "NonFiniteError",
    "P",
    "PartitionSpec",
    "PerExampleGrads",
    "RankAbortedError",
    "Shard",
    "ShardingError",
    "SpecError",
    "StragglerWarning",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "checkpoint",
    "estimate",
    "functional",
    "gather",
    "hf",
    "init",
    "init_mesh",
    "jit",
    "local_mesh",
    "measure_memory",
    "nn",
    "optim",
    "per_example_grads",
    "pipeline",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "pvary",
    "ragged_all_to_all",
    "remat",
    "remat_policies",
    "scatter",
    "shard",
    "shard_map",
    "tag",
    "testing",
    "traced_apply",
    "train_step",
    "diloco",
    "local_sgd",
    "visualize_sharding",
]


_LAZY = ("testing", "hf")


def __getattr__(name: str):
    """`sf.testing` and `sf.hf` are imported on first access, so `import shardfn` stays light
    (the test helpers pull in multiprocessing machinery, and `shardfn.testing.strategies`
    hypothesis; `sf.hf` is for transformers users)."""
    if name in _LAZY:
        import importlib

        return importlib.import_module("." + name, __name__)  # also binds shardfn.<name>
    if name in pipeline.FLAT:  # the flat pipeline names of earlier releases
        import warnings

        new = pipeline.FLAT[name]
        warnings.warn(f"sf.{name} is sf.pipeline.{new} now (the pipeline API is one namespace, like sf.nn)",
                      DeprecationWarning, stacklevel=2)
        return getattr(pipeline, new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _prime_compile() -> None:
    from ._compile import skip_wrappers

    skip_wrappers()  # a no-op unless torch._dynamo is imported already ([Note: no whole-step graph])


_prime_compile()
