"""Comparing pytrees: structure first, naming the key path, then values per dtype."""

from __future__ import annotations

from typing import Any

import torch

from .. import _tree

__all__ = ["assert_trees_allclose", "assert_trees_equal"]

# Default tolerances by dtype (rtol, atol): a few ulps of accumulated rounding.
_TOLERANCE = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-3),
    torch.float16: (1e-3, 1e-4),
}


def _pairs(a: Any, b: Any):
    paths_a, leaves_a, tree_a = _tree.flatten_with_paths(a)
    paths_b, leaves_b, tree_b = _tree.flatten_with_paths(b)
    if tree_a != tree_b:
        for i, (pa, pb) in enumerate(zip(paths_a, paths_b)):
            if pa != pb:
                raise AssertionError(f"trees have different structures at {_tree.keystr(pa)} (leaf {i}): the "
                                     f"other tree has {_tree.keystr(pb)} there\n{tree_a}\n{tree_b}")
        raise AssertionError(f"trees have different structures ({len(leaves_a)} vs {len(leaves_b)} leaves):\n"
                             f"{tree_a}\n{tree_b}")
    return zip(paths_a, leaves_a, leaves_b)


def _check_meta(where: str, x, y) -> bool:
    """True for tensors (after checking dtype and shape), asserts equality otherwise."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.dtype != y.dtype or x.shape != y.shape:
            raise AssertionError(f"{where}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}")
        return True
    if x != y:
        raise AssertionError(f"{where}: {x!r} != {y!r}")
    return False


def assert_trees_equal(a: Any, b: Any) -> None:
    """Same structure, dtypes, shapes and values, bit for bit (NaNs equal where both are NaN).

    Raises:
      AssertionError: naming the first key path where the trees differ.
    """
    for path, x, y in _pairs(a, b):
        where = _tree.keystr(path) or "the tree"
        if _check_meta(where, x, y) and not torch.equal(x, y):
            if not (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
                    and torch.equal(x.nan_to_num(), y.nan_to_num())):
                diff = (x.double() - y.double()).abs().max().item()
                raise AssertionError(f"{where}: values differ (max |difference| {diff:.3g})")


def assert_trees_allclose(a: Any, b: Any, *, rtol: float | None = None, atol: float | None = None) -> None:
    """Same structure, dtypes and shapes, and values close within tolerances chosen by dtype.

    Args:
      a: a pytree of tensors (and other leaves, compared with `==`).
      b: the tree to compare it with.
      rtol: overrides the per-dtype default (fp64 1e-10, fp32 1e-5, bf16 1.6e-2, fp16
        1e-3; integer and bool tensors are compared exactly).
      atol: overrides the per-dtype default (fp64 1e-12, fp32 1e-6, bf16 1e-3, fp16 1e-4).

    Raises:
      AssertionError: naming the first key path where the trees differ, with the largest
        difference.

    Example:
      >>> import torch, shardfn as sf
      >>> sf.testing.assert_trees_allclose({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-8})
      >>> try:
      ...     sf.testing.assert_trees_allclose({"w": torch.ones(2)}, {"v": torch.ones(2)})
      ... except AssertionError as err:
      ...     print(str(err).splitlines()[0])
      trees have different structures at ['w'] (leaf 0): the other tree has ['v'] there
    """
    for path, x, y in _pairs(a, b):
        where = _tree.keystr(path) or "the tree"
        if not _check_meta(where, x, y):
            continue
        if not (x.is_floating_point() or x.is_complex()):
            if not torch.equal(x, y):
                raise AssertionError(f"{where}: values differ ({x.dtype}, compared exactly)")
            continue
        default = _TOLERANCE.get(x.dtype, (0.0, 0.0))
        r = default[0] if rtol is None else rtol
        t = default[1] if atol is None else atol
        if not torch.allclose(x, y, rtol=r, atol=t, equal_nan=True):
            diff = (x.double() - y.double()).abs().max().item()
            raise AssertionError(f"{where}: values differ beyond rtol={r:g}, atol={t:g} (max |difference| "
                                 f"{diff:.3g}, dtype {x.dtype})")
