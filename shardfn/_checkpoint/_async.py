"""Asynchronous saves: `save(..., blocking=False)` returns a `PendingSave`."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import torch

from . import _files
from ._errors import CheckpointError
from ._layout import Ranks, agree

__all__ = ["PendingSave", "staged", "finish_save"]


def finish_save(ranks: Ranks, tmp: str, written: Callable[[], Any], publish: Callable[[Any], None], who: str) -> None:
    """The collective end of every save: every rank's write results (or the first error,
    raised on every rank), then rank 0 publishes; on any failure rank 0 removes `tmp`."""
    try:
        results = agree(ranks, written, who)
        agree(ranks, lambda: publish(results), who)
    except Exception:
        if ranks.rank == 0:  # the save failed somewhere: leave no partial directory behind
            _files.discard(tmp)
        raise


def staged(value):
    """A copy of a block that training cannot change under the writer: tensors to CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


class PendingSave:
    """An asynchronous `save` in flight (`save(..., blocking=False)`).

    [Note: async save] The collective parts of a save (agreeing on the layout; at the end,
    gathering every rank's write results and publishing) run on the ranks' own threads,
    in step with their other collectives; only the file writing, which needs no
    communication, runs on a background thread, from a staged copy of the blocks. So
    `wait()` is collective, like `save`: call it on every rank at the same point of the
    program. Until then the checkpoint is a temporary directory that `latest` and `load`
    ignore; a process that dies before `wait()` leaves the previous checkpoint the latest.

    Example:
      >>> import shardfn as sf, torch, tempfile, os
      >>> path = os.path.join(tempfile.mkdtemp(), "step_000001")
      >>> w = torch.ones(3)
      >>> pending = sf.checkpoint.save(path, {"w": w}, None, blocking=False)
      >>> _ = w.add_(1)  # training goes on; the save holds a copy
      >>> pending.wait() == path
      True
      >>> sf.checkpoint.load(path, {"w": torch.zeros(3)}, None)["w"]
      tensor([1., 1., 1.])
    """

    def __init__(self, path: str, tmp: str, ranks: Ranks, write: Callable[[], Any], publish: Callable[[Any], None]):
        self.path = path
        self._tmp, self._ranks, self._publish = tmp, ranks, publish
        self._outcome: dict[str, Any] = {}
        self._waited = False

        def run():
            try:
                self._outcome["results"] = write()
            except BaseException as err:  # noqa: BLE001 - reported by wait(), on every rank
                self._outcome["error"] = err

        self._thread = threading.Thread(target=run, name=f"shardfn-save-{os.path.basename(path)}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """Whether this rank has finished writing its files (no communication)."""
        return not self._thread.is_alive()

    def wait(self) -> str:
        """Finish the save on every rank (collective) and publish it; returns the path.

        Raises what `save` raises: if writing failed on any rank, every rank raises and no
        directory appears at the path."""
        who = "sf.checkpoint.save(blocking=False).wait()"
        if self._waited:
            raise CheckpointError(f"{who}: this save of {self.path!r} was already waited for")
        self._waited = True
        self._thread.join()

        def written():
            if "error" in self._outcome:
                raise self._outcome["error"]
            return self._outcome["results"]

        finish_save(self._ranks, self._tmp, written, self._publish, who)
        return self.path

    def __repr__(self) -> str:
        state = "published" if self._waited else ("written, waiting" if self.done() else "writing")
        return f"PendingSave({self.path!r}, {state})"
