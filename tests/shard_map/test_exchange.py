"""Digest agreement and byte exchange across a group (shardfn/_backend/exchange.py).

Both transports must give every rank the same bytes in the group's logical order, also
for a group whose axes are named against mesh order (('y', 'x') orders ranks 0, 2, 1, 3).
"""

import pytest

import shardfn as sf
from shardfn._backend import exchange


@pytest.mark.parametrize("axes", [("x", "y"), ("y", "x"), ("y",)])
@pytest.mark.parametrize("via", [exchange.via_ops, exchange.via_pg])
def test_gather_bytes_in_logical_order(axes, via):
    mesh = sf.local_mesh({"x": 2, "y": 2})

    def body():
        group = mesh.group(axes)
        data = b"" if mesh.rank == 1 else f"rank {mesh.rank}".encode() * (mesh.rank + 1)
        got = exchange.gather_bytes(data, via(group))
        want = [b"" if r == 1 else f"rank {r}".encode() * (r + 1) for r in group.ranks]
        return got == want

    assert mesh.run(body) == [True] * 4


@pytest.mark.parametrize("via", [exchange.via_ops, exchange.via_pg])
def test_same_everywhere(via):
    mesh = sf.local_mesh({"data": 3})

    def body():
        group = mesh.group(("data",))
        same = exchange.same_everywhere(b"tree: (4, 2) float32", via(group))
        differ = exchange.same_everywhere(b"tree: (4, 2) float32" * (mesh.rank == 2), via(group))
        return same, differ

    assert mesh.run(body) == [(True, False)] * 3
