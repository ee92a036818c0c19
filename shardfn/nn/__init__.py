"""`sf.nn`: parallel layers as named-axis functions: context parallelism for attention.

API contract (stable; what `examples/long_context.py`, the composition with `sf.shard`
and the docs build on):

- `ring_attention(q, k, v, axis, *, causal=True, scale=None, mask=None, layout="contiguous")`
  and `ulysses_attention(...)` with the same arguments: called inside a `shard_map` body
  or an `sf.shard` loss_fn, on this rank's sequence block. q: (B, H, T_local, D); k, v:
  (B, Hkv, T_local, D), H a multiple of Hkv; mask: None or bool (B, T_local), True where a
  key takes part (key padding). Returns (B, H, T_local, D) in q's dtype, equal to this
  rank's rows of `F.scaled_dot_product_attention(..., is_causal=causal, enable_gqa=True)`
  over the gathered sequence in global order (fully masked query rows: 0, as SDPA).
  Every rank of `axis` must call with the same shapes, options and layout.
- Layouts: "contiguous" (rank i holds block i: `in_specs` `P(None, None, 'seq')` on the
  natural order) or "zigzag" (rank i holds chunks i and 2N-1-i of 2N: put the global batch
  through `zigzag(x, N, dim)` before scattering and gathered outputs through
  `unzigzag(y, N, dim)`). Only the causal mask depends on the layout; it balances the
  causal work of ring attention.
- `positions(t_local, axis, layout=...)`: the global positions (int64, (t_local,)) of this
  rank's tokens; `rotary(x, positions, base=...)`: RoPE at those positions.
- Autodiff: VJP and JVP (first order) and `torch.func.vmap` for both attentions; ring
  attention's backward is a custom VJP with O(T_local) saved state, and its second
  derivatives raise ShardingError.
- Traffic per rank and call, kv = 2 * B * Hkv * T_local * D elements: ring forward (N-1)
  kv in the input dtype; ring backward (N-1) kv in the input dtype + N kv in the
  accumulation dtype (fp32, fp64 for fp64); each pass also moves (N-1) masks of B *
  T_local bytes when a mask is given. Ulysses: one all_to_all each of q, k, v and the
  output per pass (forward and backward), plus one all_gather of the mask.
- Errors: `sf.ShardingError` (a SpecError for unknown axes), naming the shapes, the axis,
  its size and a Fix, for: calls outside a mesh, bad shapes or dtypes, heads not
  divisible (Ulysses), odd local length or global length not divisible by 2N (zigzag).
"""

from ._layout import positions as positions
from ._layout import unzigzag as unzigzag
from ._layout import zigzag as zigzag
from ._ring import ring_attention as ring_attention
from ._rotary import rotary as rotary
from ._ulysses import ulysses_attention as ulysses_attention

__all__ = ["positions", "ring_attention", "rotary", "ulysses_attention", "unzigzag", "zigzag"]
