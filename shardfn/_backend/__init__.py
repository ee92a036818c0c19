"""The process groups behind a mesh's axes: a simulated and a distributed backend."""

from .base import BackendBase, Group
from .distributed import DistributedBackend
from .simulated import SimulatedBackend

__all__ = ["BackendBase", "Group", "DistributedBackend", "SimulatedBackend"]
