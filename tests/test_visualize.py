"""sf.visualize_sharding: the picture matches the blocks sf.scatter hands each rank."""

import re

import pytest
import torch

import shardfn as sf
from shardfn._visualize import visualize_sharding

P = sf.P


def test_exported_from_the_package():
    assert sf.visualize_sharding is visualize_sharding
    assert "visualize_sharding" in getattr(sf, "__all__", ["visualize_sharding"])


def test_two_d_picture():
    picture = visualize_sharding((8, 6), {"data": 2, "model": 2}, P("data", "model"))
    assert picture == "\n".join([
        "(8, 6) P('data', 'model') on mesh {'data': 2, 'model': 2}",
        "┌────────────┬────────────┐",
        "│   rank 0   │   rank 1   │",
        "│ [0:4, 0:3] │ [0:4, 3:6] │",
        "├────────────┼────────────┤",
        "│   rank 2   │   rank 3   │",
        "│ [4:8, 0:3] │ [4:8, 3:6] │",
        "└────────────┴────────────┘",
    ])


def test_one_d_uneven_and_empty_blocks():
    picture = visualize_sharding((10,), {"data": 4}, P("data"))
    assert "│ [0:3]  │ [3:6]  │ [6:9]  │ [9:10] │" in picture
    picture = visualize_sharding((3, 2), {"data": 4}, P("data"))
    assert "[3:3, 0:2] empty" in picture  # torch.chunk: the last rank holds no rows


def test_replicated_blocks_list_every_holder():
    assert "ranks 0,2" in visualize_sharding((6, 4), {"data": 2, "model": 2}, P(None, "model"))
    assert "ranks 0-7" in visualize_sharding((8,), {"data": 8}, None)
    assert "ranks 0,3" in visualize_sharding((7, 5), {"replica": 2, "shard": 3}, P("shard"))


def test_accepts_tensor_and_mesh_and_show_prints(capsys):
    mesh = sf.local_mesh({"data": 2})
    picture = visualize_sharding(torch.zeros(4, 2), mesh, P("data"), show=True)
    assert capsys.readouterr().out == picture + "\n"
    assert picture == visualize_sharding((4, 2), {"data": 2}, P("data"))


def _parse(picture: str) -> dict[int, list[tuple[int, int]]]:
    """rank -> the [start:stop] ranges of its block, read back from the picture."""
    lines = picture.splitlines()[1:]
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in lines if line.startswith("│")]
    out = {}
    for labels, extents in zip(cells[0::2], cells[1::2]):
        for label, extent in zip(labels, extents):
            ranks = []
            for part in label.split(" ", 1)[1].split(","):
                a, _, b = part.partition("-")
                ranks.extend(range(int(a), int(b or a) + 1))
            ranges = [tuple(map(int, r)) for r in re.findall(r"(\d+):(\d+)", extent)]
            for rank in ranks:
                out[rank] = ranges
    return out


CASES = [
    ((8, 6), {"data": 2, "model": 2}, P("data", "model")),
    ((8, 6), {"data": 2, "model": 2}, P("model", "data")),
    ((7, 5), {"data": 2, "model": 2}, P(("data", "model"))),
    ((5, 9), {"data": 2, "model": 2}, P(None, ("model", "data"))),
    ((3, 2), {"data": 4}, P("data")),
    ((10,), {"data": 4}, P("data")),
    ((6,), {"replica": 2, "shard": 3}, P("shard")),
    ((4, 4), {"data": 2, "model": 2}, P()),
]


@pytest.mark.parametrize("shape, mesh_shape, spec", CASES, ids=[f"{s}-{p!r}" for s, _, p in CASES])
def test_picture_matches_scatter(shape, mesh_shape, spec):
    mesh = sf.local_mesh(mesh_shape)
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    blocks = mesh.run(lambda: sf.scatter(x, mesh, spec, allow_empty=True))  # the picture draws empty blocks too
    drawn = _parse(visualize_sharding(shape, mesh, spec))
    assert sorted(drawn) == list(range(mesh.size))
    for rank, block in enumerate(blocks):
        want = x[tuple(slice(a, b) for a, b in drawn[rank])]
        assert torch.equal(block, want), (rank, drawn[rank])


def test_errors_name_the_problem():
    with pytest.raises(sf.SpecError, match=r"draws 1-D and 2-D tensors; got shape \(2, 3, 4\)"):
        visualize_sharding((2, 3, 4), {"data": 2}, P("data"))
    with pytest.raises(sf.SpecError, match=r"(?s)visualize_sharding: .*'model', which is not a mesh axis"):
        visualize_sharding((4,), {"data": 2}, P("model"))
    with pytest.raises(sf.SpecError, match=r"mesh must be an sf.Mesh or its shape"):
        visualize_sharding((4,), [2], P())
    with pytest.raises(sf.SpecError, match=r"expected a tensor or a shape"):
        visualize_sharding("abc", {"data": 2}, P())
