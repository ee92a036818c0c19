"""Parameter initializers that describe a tree without materializing it (`sf.init`).

A *description* is a pytree whose leaves are `Param(shape, init, dtype)`: a shape, a
dtype and an `Initializer` (`normal`, `trunc_normal`, `uniform`, `zeros`, `ones`,
`constant`, `kaiming_uniform`, ...), and no data. `materialize(description, seed)` builds
the whole tree in one process; `step.init_shards(description, seed)` builds only this
rank's shards of it, and both give the same values, bit for bit, at every world size.
`from_module(module)` describes an `nn.Module` (built on the meta device), following
`sf.functional`'s tree: a transformers model with its own `_init_weights` rules, other
modules with PyTorch's default initializer of each parameter's module type.
`materialize_buffers(module)` computes the buffers such a module holds on meta (rotary
`inv_freq`).
"""

from ._init.buffers import materialize_buffers as materialize_buffers
from ._init.describe import materialize as materialize
from ._init.initializers import Initializer as Initializer
from ._init.initializers import Param as Param
from ._init.initializers import constant as constant
from ._init.initializers import kaiming_normal as kaiming_normal
from ._init.initializers import kaiming_uniform as kaiming_uniform
from ._init.initializers import normal as normal
from ._init.initializers import ones as ones
from ._init.initializers import trunc_normal as trunc_normal
from ._init.initializers import uniform as uniform
from ._init.initializers import xavier_normal as xavier_normal
from ._init.initializers import xavier_uniform as xavier_uniform
from ._init.initializers import zero_rows as zero_rows
from ._init.initializers import zeros as zeros
from ._init.modules import from_module as from_module
from ._init.modules import torch_default as torch_default

__all__ = [
    "Initializer",
    "Param",
    "constant",
    "from_module",
    "kaiming_normal",
    "kaiming_uniform",
    "materialize",
    "materialize_buffers",
    "normal",
    "ones",
    "torch_default",
    "trunc_normal",
    "uniform",
    "xavier_normal",
    "xavier_uniform",
    "zero_rows",
    "zeros",
]
