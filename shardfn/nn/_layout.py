"""Sequence layouts over a mesh axis: which global tokens each rank holds.

[Note: zig-zag layout] With a causal mask, a contiguous split gives rank i the queries
i*T/N .. (i+1)*T/N, which see (i+1)/N of the keys: the last rank works N times as much as
the first. The zig-zag layout cuts the sequence into 2N chunks and gives rank i chunks
i and 2N-1-i, an early one and a late one, so every rank sees the same number of
(query, key) pairs. For N = 4 (chunks 0..7):

    global sequence   | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
    zigzag(x, 4, dim) | 0 | 7 | 1 | 6 | 2 | 5 | 3 | 4 |
    rank              |  0    |  1    |  2    |  3    |

`zigzag` reorders a global tensor so that an ordinary contiguous split (`sf.scatter`,
in_specs `P(..., 'seq')`) hands rank i its two chunks; `unzigzag` puts a gathered output
back in sequence order. Inside the body, `positions(t_local, axis, layout="zigzag")`
gives the global positions of the rank's tokens (for RoPE), and ring attention told
`layout="zigzag"` masks each pair of chunks by their global order.
"""

from __future__ import annotations

import torch

from .. import _binding, _collectives, _vma
from .._errors import ShardingError

__all__ = ["LAYOUTS", "zigzag", "unzigzag", "positions", "chunk_ids", "check_layout"]

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout, where: str) -> str:
    if layout not in LAYOUTS:
        raise ShardingError(f"{where}: layout={layout!r} is not one of {list(LAYOUTS)}.\nFix: pass "
                            f"layout='contiguous' (rank i holds block i) or layout='zigzag' (rank i holds "
                            f"chunks i and 2N-1-i; lay the batch out with sf.nn.zigzag).")
    return layout


def chunk_ids(layout: str, index: int, n: int) -> tuple[int, ...]:
    """Global chunk numbers a rank holds, in its local order: contiguous (index,) of N
    chunks; zigzag (index, 2N-1-index) of 2N chunks."""
    return (index,) if layout == "contiguous" else (index, 2 * n - 1 - index)


def _order(n: int) -> list[int]:
    """Zig-zag chunk order: 0, 2N-1, 1, 2N-2, ..., N-1, N."""
    return [c for i in range(n) for c in (i, 2 * n - 1 - i)]


def _split(x: torch.Tensor, n: int, dim: int, where: str) -> tuple[int, list[torch.Tensor]]:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ShardingError(f"{where}: the axis size must be a positive int, got {n!r}.\nFix: pass "
                            f"mesh.shape['seq'] (or sf.axis_size('seq') inside the body).")
    if not isinstance(x, torch.Tensor):
        raise ShardingError(f"{where}: expected a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ShardingError(f"{where}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}.")
    d = dim % x.dim()
    t = x.shape[d]
    if t % (2 * n):
        raise ShardingError(
            f"{where}: x has shape {tuple(x.shape)}; its sequence dim {d} has length {t}, which does not divide "
            f"into 2 * {n} = {2 * n} equal chunks (the zig-zag layout gives each of the {n} ranks two chunks).\n"
            f"Fix: pad the sequence to a multiple of {2 * n} (and mask the padding), or use layout='contiguous'.")
    return d, list(x.chunk(2 * n, dim=d))


def zigzag(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Reorder a global sequence into the zig-zag layout for an axis of `n` ranks.

    Splits `dim` into 2n equal chunks and orders them 0, 2n-1, 1, 2n-2, ..., n-1, n, so
    that a contiguous split over the axis (`sf.scatter` / in_specs naming it on `dim`)
    gives rank i chunks i and 2n-1-i ([Note: zig-zag layout]). Differentiable (a
    permutation); works under vmap.

    Args:
      x: the global tensor, the same on every rank (or outside any mesh).
      n: the size of the sequence axis.
      dim: the sequence dim of `x` (2 for (B, H, T, D), 1 for token ids (B, T)).

    Returns:
      `x` with its `dim` reordered; same shape.

    Raises:
      ShardingError: `x.shape[dim]` does not divide by 2n.

    Example:
      >>> import shardfn as sf, torch
      >>> sf.nn.zigzag(torch.arange(8), 2, dim=0)
      tensor([0, 1, 6, 7, 2, 3, 4, 5])
    """
    d, chunks = _split(x, n, dim, f"zigzag(n={n}, dim={dim})")
    return torch.cat([chunks[c] for c in _order(n)], dim=d)


def unzigzag(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Undo `zigzag`: put a tensor gathered from the zig-zag layout back in sequence order.

    Example:
      >>> import shardfn as sf, torch
      >>> x = torch.arange(8)
      >>> torch.equal(sf.nn.unzigzag(sf.nn.zigzag(x, 2, 0), 2, 0), x)
      True
    """
    d, chunks = _split(x, n, dim, f"unzigzag(n={n}, dim={dim})")
    order = _order(n)
    return torch.cat([chunks[order.index(c)] for c in range(2 * n)], dim=d)


def positions(t_local: int, axis, *, layout: str = "contiguous", device=None) -> torch.Tensor:
    """Global positions of this rank's `t_local` tokens along a sequence axis.

    Call it inside a shard_map body or an `sf.shard` loss_fn, where `axis` splits the
    sequence: contiguous, rank i holds positions i*t_local .. (i+1)*t_local - 1; zigzag,
    the two chunks i and 2N-1-i of length t_local/2 ([Note: zig-zag layout]). Feed them to
    RoPE (`sf.nn.rotary`) or a position embedding so the model sees global positions.

    Args:
      t_local: this rank's sequence length (the same on every rank).
      axis: the mesh axis (or tuple of axes) the sequence is split over.
      layout: "contiguous" or "zigzag".
      device: where to put the result (default CPU).

    Returns:
      an int64 tensor of shape (t_local,).

    Raises:
      ShardingError: outside a shard_map / shard, an unknown axis, a bad layout, or an odd
        t_local with layout="zigzag".

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"seq": 2})
      >>> f = sf.shard_map(lambda x: x + sf.nn.positions(2, "seq", layout="zigzag"), mesh, sf.P("seq"), sf.P("seq"))
      >>> f(torch.zeros(4, dtype=torch.int64))
      tensor([0, 3, 1, 2])
    """
    where = f"positions(t_local={t_local}, axis={axis!r}, layout={layout!r})"
    check_layout(layout, where)
    mesh = _binding.bound_mesh("positions", axis)
    group = mesh.group(mesh.axes(axis, where=where))  # no communication: no axes check
    if isinstance(t_local, bool) or not isinstance(t_local, int) or t_local < 0:
        raise ShardingError(f"{where}: t_local must be a non-negative int (this rank's sequence length).")
    n, i = group.size, group.index
    if layout == "contiguous":
        pos = torch.arange(t_local, device=device) + i * t_local
    else:
        if t_local % 2:
            raise ShardingError(f"{where}: the zig-zag layout gives each rank two equal chunks, but t_local = "
                                f"{t_local} is odd (axis {axis!r} of size {n}).\nFix: make the global length a "
                                f"multiple of 2 * {n} = {2 * n}, laid out with sf.nn.zigzag.")
        c = t_local // 2
        pos = torch.cat([torch.arange(c, device=device) + cid * c for cid in chunk_ids(layout, i, n)])
    types = _collectives._types("positions", group)
    return pos if types is None else _vma.tag(pos, group.axes, types)
