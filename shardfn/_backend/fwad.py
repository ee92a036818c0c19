"""Forward-mode AD that works in the rank threads of a simulated mesh.

[Note: forward AD on the simulated mesh] PyTorch's forward AD has one process-wide dual
level (`torch._C._enter_dual_level`), and `torch.func.jvp` keeps its nesting depth in a
module global (`torch._functorch.eager_transforms.JVP_NESTING`). With several rank
threads calling `jvp` at once, one thread's exit closes the level another is using, or a
thread sees depth 2 and skips entering a level: tangents then come back as zeros (silently)
or fail with "Trying to access a forward AD level with an invalid index".

Ranks run the same program, so they can share the one level: `install()` makes the
nesting depth per thread and the dual level reference-counted (the first thread in enters
it, the last one out exits it). In a single thread this behaves exactly like PyTorch's
own code. It is installed when the first simulated mesh is created, and only then.
"""

from __future__ import annotations

import threading

from torch.autograd import forward_ad as _fwad

__all__ = ["install"]

_lock = threading.Lock()
_tls = threading.local()
_shared = {"count": 0, "level": None}
_installed = False


class _PerThreadNesting:
    """Stands in for `eager_transforms.JVP_NESTING`: compares as this thread's depth."""

    @staticmethod
    def value() -> int:
        return getattr(_tls, "jvp_nesting", 0)

    def __eq__(self, other):
        return self.value() == other

    def __hash__(self):
        return hash(self.value())

    def __int__(self):
        return self.value()

    __index__ = __int__

    def __repr__(self):
        return repr(self.value())


def install() -> None:
    """Patch torch's forward-AD bookkeeping for rank threads (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        from torch._functorch import eager_transforms as et

        original_enter, original_exit = _fwad.enter_dual_level, _fwad.exit_dual_level

        def enter_dual_level():
            with _lock:
                if _shared["count"] == 0:
                    _shared["level"] = original_enter()
                _shared["count"] += 1
                return _shared["level"]

        def exit_dual_level(*, level=None):
            with _lock:
                _shared["count"] -= 1
                if _shared["count"] == 0:
                    original_exit(level=_shared["level"])

        def enter_jvp_nesting() -> int:
            level = et._jvp_increment_nesting()
            _tls.jvp_nesting = _PerThreadNesting.value() + 1
            return level

        def exit_jvp_nesting() -> None:
            et._jvp_decrement_nesting()
            _tls.jvp_nesting = _PerThreadNesting.value() - 1

        _fwad.enter_dual_level = enter_dual_level
        _fwad.exit_dual_level = exit_dual_level
        et.enter_jvp_nesting = enter_jvp_nesting
        et.exit_jvp_nesting = exit_jvp_nesting
        et.JVP_NESTING = _PerThreadNesting()
        _installed = True
