"""The wire formats of compressed collectives (shardfn/_quant.py), as properties.

[Note: quantization error bound] promises, per element, |x - decode(encode(x))| <= bound(x);
here hypothesis draws the shapes (leading dims, row lengths), block sizes (1, small, larger
than the row), magnitudes (zeros, all-zero blocks, subnormals, huge values up to float64's
1e300 for the scaled formats) and dtypes (float32, float64, bfloat16) and checks it for every
format. Values a format represents exactly round trip exactly; NaN / inf and values beyond a
cast's range are refused with a SpecError; a row's size is the documented formula.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardfn._errors import SpecError
from shardfn._quant import Wire, bound, decode, encode, nbytes

SPECS = ["int8", torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
PROPS = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _id(x):
    return str(x).replace("torch.", "")


def wire_of(spec, block):
    return Wire.of(spec, block)


@st.composite
def cases(draw, dtype, scaled: bool):
    """(x, block): a (*lead, n) tensor of `dtype` and a block size."""
    lead = draw(st.sampled_from([(), (1,), (3,), (2, 2)]))
    n = draw(st.integers(1, 40))
    block = draw(st.one_of(st.just(1), st.integers(2, 9), st.just(n), st.integers(n + 1, 5000)))
    numel = math.prod(lead) * n
    kind = draw(st.sampled_from(["raw", "magnitude"]))
    if kind == "raw":  # hypothesis' floats: zeros, subnormals, huge and ordinary values mixed in one row
        width = 64 if dtype == torch.float64 else 32
        values = draw(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=width),
                               min_size=numel, max_size=numel))
        x = torch.tensor(values, dtype=torch.float64).to(dtype)
    else:  # ordinary values at one magnitude, some elements and whole blocks zero
        top = 300 if dtype == torch.float64 and scaled else 36
        low = -320 if dtype == torch.float64 else -44
        exp = draw(st.integers(low, top))
        seed = draw(st.integers(0, 2 ** 16))
        g = torch.Generator().manual_seed(seed)
        x = (torch.rand(numel, generator=g, dtype=torch.float64) * 2 - 1) * 10.0 ** exp
        zero = torch.rand(numel, generator=g) < draw(st.sampled_from([0.0, 0.3]))
        x[zero] = 0
        x = x.reshape(lead + (n,))
        if draw(st.booleans()) and n > block:  # an all-zero block
            x[..., :block] = 0
        x = x.to(dtype)
    x = x.reshape(lead + (n,))
    assume(bool(torch.isfinite(x).all()))  # a float32 near its max may round to inf in bfloat16
    return x, block


def check_bound(x, wire):
    """decode(encode(x)) is within bound(x) everywhere; returns the largest error / bound."""
    y = decode(encode(x, wire), wire, x.shape[-1], x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    err = (x.double() - y.double()).abs()
    b = bound(x, wire).double()
    worst = int((err - b).argmax()) if err.numel() else 0
    assert bool((err <= b).all()), (
        f"{wire}: |err| {err.flatten()[worst].item():.6g} > bound {b.flatten()[worst].item():.6g} at x = "
        f"{x.flatten()[worst].item():.6g} (block {wire.block}, shape {tuple(x.shape)}, dtype {x.dtype})")


def _fits(x, wire) -> bool:
    """A cast refuses values beyond its dtype's range."""
    return wire.scaled or not x.numel() or float(x.double().abs().max()) <= torch.finfo(wire.dtype).max


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_error_within_the_documented_bound(spec, dtype):
    @PROPS
    @given(cases(dtype, scaled=spec == "int8" or spec in (torch.float8_e4m3fn, torch.float8_e5m2)))
    def prop(case):
        x, block = case
        wire = wire_of(spec, block)
        if _fits(x, wire):
            check_bound(x, wire)
        else:
            with pytest.raises(SpecError, match=r"beyond .*'s range"):
                encode(x, wire)

    prop()


def test_int8_bound_is_half_a_step_of_amax_over_127():
    """The bound's size, not only its use: int8 errs at most amax / 254 per block."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1000, generator=g)
    wire = Wire.of("int8", 100)
    err = (decode(encode(x, wire), wire, 1000, x.dtype) - x).abs().reshape(4, 10, 100)
    amax = x.abs().reshape(4, 10, 100).amax(-1, keepdim=True)
    assert bool((err <= amax / 254 * (1 + 1e-6)).all())
    assert float((err / amax).max()) > 0.8 / 254  # and the bound is nearly reached: it is not loose


# -- exact round trips --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@PROPS
@given(st.integers(1, 30), st.integers(1, 12), st.integers(-60, 60), st.integers(0, 2 ** 16))
def test_int8_round_trip_is_exact_on_its_grid(dtype, n, block, exp, seed):
    """Integers q in [-127, 127] times a power-of-two scale, each block reaching 127 * scale."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (3, n), generator=g).double()
    q[:, ::block] = torch.where(torch.rand(3, len(range(0, n, block)), generator=g) < 0.5, -127.0, 127.0)
    x = (q * 2.0 ** exp).to(dtype)
    assert torch.equal(x.double(), q * 2.0 ** exp)  # representable in dtype
    wire = Wire.of("int8", block)
    assert torch.equal(decode(encode(x, wire), wire, n, dtype), x)


def _fp8_values(fp8: torch.dtype) -> torch.Tensor:
    """Every finite value of an fp8 dtype (from its 256 bit patterns), as float64."""
    v = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(fp8).double()
    return v[torch.isfinite(v)]


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=_id)
@PROPS
@given(st.integers(1, 30), st.integers(1, 12), st.integers(-40, 40), st.integers(0, 2 ** 16))
def test_fp8_round_trip_is_exact_for_its_values(fp8, dtype, n, block, exp, seed):
    """fp8 values times a power-of-two scale, each block reaching the fp8 max times the scale."""
    g = torch.Generator().manual_seed(seed)
    values = _fp8_values(fp8)
    v = values[torch.randint(0, len(values), (3, n), generator=g)]
    top = torch.finfo(fp8).max
    v[:, ::block] = torch.where(torch.rand(3, len(range(0, n, block)), generator=g) < 0.5, -top, top)
    x = (v * 2.0 ** exp).to(dtype)
    assume(torch.equal(x.double(), v * 2.0 ** exp))  # bfloat16 holds e4m3's 3 mantissa bits, not every exponent
    wire = Wire.of(fp8, block)
    assert torch.equal(decode(encode(x, wire), wire, n, dtype), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_id)
@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16], ids=_id)
def test_cast_round_trip_is_exact_for_its_values(cast, dtype):
    """Every finite value of the cast dtype, held in a wider dtype, comes back unchanged."""
    v = torch.arange(2 ** 16, dtype=torch.int32).to(torch.int16).view(cast)
    v = v[torch.isfinite(v)].to(dtype)
    wire = Wire.of(cast)
    assert torch.equal(decode(encode(v, wire), wire, v.numel(), dtype), v)


# -- refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("spec", SPECS, ids=_id)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nan_and_inf_are_refused(spec, dtype, bad):
    x = torch.ones(2, 10, dtype=dtype)
    x[1, 3] = bad
    with pytest.raises(SpecError, match=r"grad shard: 1 of 20 values are NaN or infinite; the .* wire format "
                                        r"cannot carry them .*\nFix: "):
        encode(x, Wire.of(spec, 4), what="grad shard")


def test_a_cast_refuses_values_beyond_its_range():
    with pytest.raises(SpecError, match=r"\|x\| reaches 1e\+05, beyond float16's range \(6.55e\+04\).\nFix: use a "
                                        r"scaled format"):
        encode(torch.tensor([1.0, 1e5]), Wire.of(torch.float16))


@pytest.mark.parametrize("spec, block, match", [
    ("int4", 4096, r"m: got 'int4'; a wire format is None .* or one of torch.bfloat16, .*\nFix: "),
    (torch.int8, 4096, r"got torch.int8; a wire format"),
    ("int8", 0, r"m: block_size must be a positive int, got 0"),
    ("int8", True, r"block_size must be a positive int, got True"),
])
def test_unknown_formats_are_refused(spec, block, match):
    with pytest.raises(SpecError, match=match):
        Wire.of(spec, block, where="m")


def test_decode_refuses_rows_of_the_wrong_size():
    wire = Wire.of("int8", 4)
    rows = encode(torch.ones(2, 10), wire)
    with pytest.raises(SpecError, match=r"decode: rows of 24 bytes, expected 32 for 13 elements of int8 \(block 4\)"):
        decode(rows, wire, 13, torch.float32)


def test_encode_refuses_integer_tensors():
    with pytest.raises(SpecError, match="encodes floating tensors, got torch.int64"):
        encode(torch.ones(3, dtype=torch.int64), Wire.of("int8"))


# -- layout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("spec", SPECS, ids=_id)
@pytest.mark.parametrize("n, block", [(1, 1), (7, 3), (64, 64), (100, 4096), (4097, 4096), (10, 1)])
def test_row_size_is_the_formula_and_rows_are_aligned(spec, dtype, n, block):
    wire = Wire.of(spec, block)
    payload = {"int8": 1}.get(spec, 1 if spec in (torch.float8_e4m3fn, torch.float8_e5m2) else 2) * n
    scales = (8 if dtype == torch.float64 else 4) * -(-n // block) if wire.scaled else 0
    expected = -(-(payload + scales) // 8) * 8
    assert nbytes(n, wire, dtype) == expected
    rows = encode(torch.randn(3, n).to(dtype), wire)
    assert rows.shape == (3, expected) and rows.dtype == torch.uint8
    assert expected % 8 == 0  # every row starts 8-byte aligned in a (k, row) buffer
    if wire.scaled:  # the scales sit first, readable in place as float32 / float64
        sdt = torch.float64 if dtype == torch.float64 else torch.float32
        assert bool((rows[:, :scales].view(sdt) > 0).all())


def test_int8_with_float32_is_a_quarter_plus_scales():
    """The figure the docs quote: n + 4 * ceil(n / block) bytes, rounded up to 8."""
    wire = Wire.of("int8", 4096)
    assert nbytes(2 ** 20, wire) == 2 ** 20 + 4 * 256
    assert nbytes(2 ** 20, wire) / (4 * 2 ** 20) == pytest.approx(0.25 + 1 / 4096)


def test_decode_into_out_and_zero_rows():
    wire = Wire.of(torch.float8_e4m3fn, 5)
    x = torch.randn(4, 12)
    out = torch.empty(4, 12, dtype=torch.float64)
    decode(encode(x, wire), wire, 12, torch.float32, out=out)
    assert torch.equal(out, decode(encode(x, wire), wire, 12, torch.float32).double())
    empty = torch.empty(0, 12)
    assert decode(encode(empty, wire), wire, 12, torch.float32).shape == (0, 12)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("out", [torch.float32, torch.float64])
def test_fp8_decode_through_float16_bits_is_torchs_conversion_for_every_byte(fp8, out):
    """`_fp8_to_float` (the fast path of decode) against torch's own fp8 conversion, on all
    256 bit patterns: zeros, subnormals, the max, and e4m3fn's NaN."""
    from shardfn._quant import _fp8_to_float

    every = torch.arange(256, dtype=torch.uint8).view(fp8)
    mine, theirs = _fp8_to_float(every, out), every.to(out)
    assert mine.dtype == out
    assert torch.equal(mine.isnan(), theirs.isnan())
    assert torch.equal(mine.nan_to_num(0.0), theirs.nan_to_num(0.0))


@pytest.mark.parametrize("spec", ["int8", torch.float8_e4m3fn, torch.float8_e5m2], ids=["int8", "e4m3fn", "e5m2"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_an_unchecked_encode_never_turns_a_non_finite_block_finite(spec, bad):
    """qgZ encodes without the check (no host sync): a block holding NaN / inf must decode
    to non-finite values (its scale is non-finite), never to finite ones; the other
    blocks are untouched."""
    wire = Wire.of(spec, 4)
    x = torch.tensor([1.0, bad, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0])
    y = decode(encode(x, wire, check=False), wire, 8, torch.float32)
    assert not bool(torch.isfinite(y[:4]).any()), y
    assert bool(torch.isfinite(y[4:]).all()) and (y[4:] - x[4:]).abs().max() <= bound(x[4:], wire).max()


@pytest.mark.parametrize("into", ["tensor", "segments"])
@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_decode_out_on_a_partial_last_block(spec, into):
    """decode(out=) where each segment ends in a partial block: 2 rows of 13 = 4 + 4 + 4 + 1
    elements (block 4), in segments (6, 7) = (4 + 2) + (4 + 3), the partial blocks' values
    1000x larger than their whole blocks' (a wrong block's scale misses the bound by far),
    decoded into float64 views placed inside a larger buffer, whose other elements must stay."""
    wire = Wire.of(spec, 4)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 13, generator=g, dtype=torch.float64) + 0.5
    segments = (6, 7) if into == "segments" else None
    partial = [4, 5, 10, 11, 12] if into == "segments" else [12]
    x[:, partial] *= 1000.0
    x = x.float()
    rows = encode(x, wire, segments=segments)
    sentinel = -12345.0
    buffer = torch.full((2, 20), sentinel, dtype=torch.float64)
    if into == "tensor":
        out = buffer[:, 3:16]  # a view with a row stride of 20
        assert decode(rows, wire, 13, torch.float32, out=out) is out
        got = out
    else:
        out = [buffer[:, 1:7], buffer[:, 10:17]]
        result = decode(rows, wire, 13, torch.float32, segments=segments, out=out)
        assert result is out or list(result) == out
        got = torch.cat(out, dim=-1)
    touched = torch.zeros(20, dtype=torch.bool)
    touched[3:16] = into == "tensor"
    if into == "segments":
        touched[1:7] = touched[10:17] = True
    assert bool((buffer[:, ~touched] == sentinel).all()), buffer  # nothing written outside the views
    err = (got - x.double()).abs()
    limit = bound(x, wire, segments=segments).double()
    assert bool((err <= limit).all()), (spec, err, limit)
    # the partial blocks decode to their own magnitude (relative error of the format, not 1000x off)
    rel = (err / x.double().abs())[:, partial].max().item()
    assert rel <= {"int8": 1 / 127, torch.float8_e4m3fn: 2 ** -3, torch.float8_e5m2: 2 ** -2,
                   torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[spec], rel
    # and equal, after rounding into float32, what decode returns without out=
    plain = decode(rows, wire, 13, torch.float32, segments=segments)
    assert torch.equal(got.float(), plain)
