"""Shared fixtures: one test body, run on the simulated and on the distributed backend.

Marker scheme (see pyproject.toml): `multiprocess` for tests that fork real processes;
`slow` for the long or numerous ones, which `make test` (CI) skips unless they are also
marked `ci`; `make test-all` runs everything.
"""

import pytest
import torch

from shardfn.testing import run_on_mesh

# the process reaper and the xdist controller's hard per-test deadline (see the module's docs)
pytest_plugins = ["tests._deadline"]

torch.set_num_threads(1)  # ranks are threads (simulated) or processes: one intra-op thread each

BACKENDS = [
    pytest.param("simulated", id="simulated"),
    pytest.param("distributed", id="distributed", marks=pytest.mark.multiprocess),
]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """'simulated' (sf.local_mesh threads) or 'distributed' (forked processes + sf.init_mesh)."""
    return request.param


@pytest.fixture
def on_mesh(backend):
    """`on_mesh(fn, shape, **kw)`: run `fn(mesh)` on every rank of a `shape` mesh; per-rank results."""

    def run(fn, shape, **kwargs):
        return run_on_mesh(fn, shape, backend, **kwargs)

    run.backend = backend
    return run
