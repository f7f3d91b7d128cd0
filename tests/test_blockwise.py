"""Property tests for the block-wise codecs (int8/int4 absmax and block-scaled FP4)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwire.codecs import CodecError, NonFiniteError, get_codec
from qwire.codecs.blockwise import minifloat_grid

SPECS = ["blockwise8", "blockwise4", "fp4", "blockwise:bits=6,block=32", "blockfp:bits=8,block=64",
         "blockfp:bits=6,block=7", "blockwise:bits=2,block=1"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TINY = 1e-44  # absolute slack for fp32 subnormal rounding of the scale product


def _roundtrip(codec, x):
    p = codec.encode(x)
    assert p.dtype == torch.uint8 and p.dim() == 1
    assert p.numel() == codec.payload_nbytes(x.shape, x.dtype)
    y = codec.decode(p, x.shape, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    return y


def _check_bound(codec, x, y):
    bound = codec.error_bound(x).reshape(-1)
    xf, yf = x.float().reshape(-1), y.float().reshape(-1)
    # decode computes in fp32, then casts to x's dtype: allow that cast's rounding too.
    eps = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[x.dtype]
    slack = bound * 1e-5 + yf.abs() * eps + TINY
    if x.dtype == torch.float16:
        slack = slack + 2 ** -24  # fp16 subnormal spacing
    err = (xf - yf).abs()
    assert bool((err <= bound + slack).all()), f"max excess {float((err - bound - slack).max())}"


@st.composite
def tensors(draw):
    n = draw(st.integers(0, 700))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([1e-30, 1e-6, 1.0, 1e3, 1e30])) if dtype == torch.float32 else \
        draw(st.sampled_from([1e-3, 1.0, 100.0]))
    seed = draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    kind = draw(st.sampled_from(["randn", "outlier", "zeros", "const", "sparse"]))
    if kind == "outlier" and n:
        x[draw(st.integers(0, n - 1))] = scale * 1e4 if dtype == torch.float32 else 1000.0
    elif kind == "zeros":
        x.zero_()
    elif kind == "const":
        x.fill_(draw(st.sampled_from([-2.5, 0.1, 7.0])))
    elif kind == "sparse":
        x = x * (torch.rand(n, generator=g) < 0.05)
    shape = draw(st.sampled_from(["flat", "2d"]))
    if shape == "2d" and n % 5 == 0 and n:
        x = x.view(5, n // 5)
    return x.to(dtype)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=40, deadline=None)
@given(x=tensors())
def test_roundtrip_length_and_bound(spec, x):
    codec = get_codec(spec)
    y = _roundtrip(codec, x)
    _check_bound(codec, x, y)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 600), value=st.floats(-1e6, 1e6, allow_nan=False, width=32))
def test_zero_and_constant_blocks(spec, n, value):
    codec = get_codec(spec)
    z = torch.zeros(n)
    assert torch.equal(_roundtrip(codec, z), z)
    c = torch.full((n,), value)
    # a constant block is its own absmax: it maps to the largest code and decodes exactly
    # (up to one fp32 rounding of the scale product)
    torch.testing.assert_close(_roundtrip(codec, c), c, rtol=2e-7, atol=0)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_raises(spec, bad):
    codec = get_codec(spec)
    x = torch.randn(300)
    x[123] = bad
    with pytest.raises(NonFiniteError):
        codec.encode(x)


@pytest.mark.parametrize("spec", SPECS)
def test_odd_sizes_payload_and_packing(spec):
    codec = get_codec(spec)
    for n in [1, 2, 3, 7, 127, 129, 255, 257, 1001]:
        x = torch.randn(n)
        bits = codec.bits
        want = 4 * math.ceil(n / codec.block) + math.ceil(n * bits / 8)
        assert codec.payload_nbytes((n,), torch.float32) == want
        _check_bound(codec, x, _roundtrip(codec, x))


def test_spec_round_trips_and_presets():
    assert get_codec("blockwise8").spec() == "blockwise:bits=8,block=256"
    assert get_codec("blockwise4").spec() == "blockwise:bits=4,block=128"
    assert get_codec("fp4").spec() == "blockfp:bits=4,block=128"
    assert get_codec("blockwise8:block=64").block == 64
    for s in SPECS:
        c = get_codec(s)
        assert get_codec(c.spec()) == c
    with pytest.raises(CodecError):
        get_codec("blockwise:bits=9")
    with pytest.raises(CodecError):
        get_codec("blockfp:bits=2")
    with pytest.raises(CodecError):
        get_codec("blockwise8").encode(torch.arange(10))


def test_fp4_grid_is_e2m1():
    assert minifloat_grid(2, 1) == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    codec = get_codec("fp4:block=8")
    x = torch.tensor([6.0, -4.0, 3.0, -2.0, 1.5, 1.0, -0.5, 0.0])  # exactly representable, absmax 6
    assert torch.equal(_roundtrip(codec, x), x)
    # 4 bits per code really packed: 8 codes -> 4 bytes + one fp32 scale
    assert codec.encode(x).numel() == 4 + 4


def test_int8_error_vs_rate_distortion():
    """Gaussian input: block-wise int8 / int4 sit within a few dB of the 2^(-2R) bound."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    for spec, bits in [("blockwise8", 8), ("blockwise4", 4), ("fp4", 4)]:
        codec = get_codec(spec)
        y = _roundtrip(codec, x)
        nmse = float(((x - y) ** 2).mean() / (x ** 2).mean())
        assert 2 ** (-2 * bits) < nmse < 2 ** (-2 * bits) * 30, (spec, nmse)


def test_decode_rejects_wrong_payload():
    codec = get_codec("blockwise8")
    p = codec.encode(torch.randn(100))
    with pytest.raises(CodecError):
        codec.decode(p[:-1], (100,), torch.float32)
    with pytest.raises(CodecError):
        codec.decode(p, (101,), torch.float32)
