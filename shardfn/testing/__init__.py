"""Test helpers: run a program on real processes or on either mesh backend."""
from ._backends import BACKENDS as BACKENDS
from ._backends import run_on_mesh as run_on_mesh
from ._ddp import assert_ddp_equivalent as assert_ddp_equivalent
from ._ddp import ddp_training as ddp_training
from ._ddp import reference_training as reference_training
from ._multiprocess import RankProcessError as RankProcessError
from ._multiprocess import run_multiprocess as run_multiprocess

__all__ = [
    "BACKENDS",
    "RankProcessError",
    "assert_ddp_equivalent",
    "ddp_training",
    "reference_training",
    "run_multiprocess",
    "run_on_mesh",
]
