"""Test helpers: run a program on real processes or on either mesh backend."""
from ._backends import BACKENDS as BACKENDS
from ._backends import run_on_mesh as run_on_mesh
from ._blocks import ReferenceCheckError as ReferenceCheckError
from ._blocks import join_blocks as join_blocks
from ._blocks import join_tree as join_tree
from ._blocks import local_blocks as local_blocks
from ._blocks import split_blocks as split_blocks
from ._blocks import split_tree as split_tree
from ._ddp import assert_ddp_equivalent as assert_ddp_equivalent
from ._ddp import ddp_training as ddp_training
from ._ddp import fsdp2_training as fsdp2_training
from ._ddp import reference_training as reference_training
from ._multiprocess import RankProcessError as RankProcessError
from ._multiprocess import run_multiprocess as run_multiprocess
from ._reference import C as C
from ._reference import shmap_reference as shmap_reference
from ._trees import assert_trees_allclose as assert_trees_allclose
from ._trees import assert_trees_equal as assert_trees_equal
from . import faults as faults

__all__ = [
    "BACKENDS",
    "C",
    "assert_trees_allclose",
    "assert_trees_equal",
    "ReferenceCheckError",
    "join_blocks",
    "join_tree",
    "local_blocks",
    "shmap_reference",
    "split_blocks",
    "split_tree",
    "RankProcessError",
    "assert_ddp_equivalent",
    "ddp_training",
    "fsdp2_training",
    "reference_training",
    "run_multiprocess",
    "run_on_mesh",
    "faults",
]
