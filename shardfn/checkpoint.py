"""Checkpoints of sharded pytrees over `torch.distributed.checkpoint` (DCP).

`save(path, tree, mesh, specs)` writes every rank's blocks into one standard DCP
directory, atomically; `load(path, like, mesh, specs)` reads it back into any mesh and
layout (another world size, uneven chunks, HSDP <-> 1-D), and reads FSDP2 / `dcp.save`
checkpoints too. Keys are pytree key paths joined by '.', which for `sf.functional`
params are the module's `state_dict` names. See docs/checkpoints.md.

Example:
  >>> import shardfn as sf, torch, tempfile, os
  >>> mesh4, mesh3 = sf.local_mesh({"data": 4}), sf.local_mesh({"data": 3})
  >>> params = {"w": torch.arange(10.0), "step": 7}
  >>> path = os.path.join(tempfile.mkdtemp(), "step_000007")
  >>> def save():
  ...     step = sf.shard(lambda p, b: p["w"].sum(), mesh4)
  ...     sf.checkpoint.save(path, step.shard_params({"w": params["w"]}) | {"step": 7}, mesh4,
  ...                        {"w": sf.P("data"), "step": sf.P()})
  >>> _ = mesh4.run(save)
  >>> def load():
  ...     like = {"w": torch.zeros(4 if mesh3.rank < 2 else 2), "step": 0}
  ...     return sf.checkpoint.load(path, like, mesh3, {"w": sf.P("data"), "step": sf.P()})
  >>> [r["w"].tolist() for r in mesh3.run(load)]
  [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
"""

from ._checkpoint._async import PendingSave as PendingSave
from ._checkpoint._api import contents as contents
from ._checkpoint._api import export_full as export_full
from ._checkpoint._api import load as load
from ._checkpoint._api import save as save
from ._checkpoint._errors import CheckpointDTypeError as CheckpointDTypeError
from ._checkpoint._errors import CheckpointError as CheckpointError
from ._checkpoint._errors import CheckpointKeyError as CheckpointKeyError
from ._checkpoint._errors import CheckpointShapeError as CheckpointShapeError
from ._checkpoint._errors import IncompleteCheckpointError as IncompleteCheckpointError
from ._checkpoint._files import latest as latest
from ._checkpoint._keys import specs_like as specs_like
from ._checkpoint._keys import tied_keys as tied_keys

__all__ = [
    "PendingSave",
    "save",
    "load",
    "latest",
    "export_full",
    "contents",
    "specs_like",
    "tied_keys",
    "CheckpointError",
    "IncompleteCheckpointError",
    "CheckpointKeyError",
    "CheckpointShapeError",
    "CheckpointDTypeError",
]
