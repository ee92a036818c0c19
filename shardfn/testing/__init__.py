"""Test helpers: run a program on real processes or on either mesh backend."""
from ._backends import BACKENDS as BACKENDS
from ._backends import run_on_mesh as run_on_mesh
from ._multiprocess import RankProcessError as RankProcessError
from ._multiprocess import run_multiprocess as run_multiprocess

__all__ = ["BACKENDS", "RankProcessError", "run_multiprocess", "run_on_mesh"]
