"""Property tests for the FP8 codecs (``fp8``: TACO dual-scale Hadamard, ``fp8plain``)."""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwire.codecs import CodecError, NonFiniteError, get_codec
from qwire.codecs.fp8 import FORMATS, error_bound

SPECS = [
    "fp8", "fp8:format=e5m2", "fp8:hadamard=false", "fp8:group=32", "fp8:group=512,format=e5m2",
    "fp8plain", "fp8plain:format=e5m2", "fp8plain:group=64",
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

shapes = st.lists(st.integers(0, 70), min_size=1, max_size=3).map(tuple)


def group_errors(codec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    err = (y.float() - x.float()).reshape(-1)
    err = torch.nn.functional.pad(err, (0, (-err.numel()) % codec.group))
    return err.view(-1, codec.group).norm(dim=1)


@st.composite
def tensors(draw, dtype=None):
    shape = draw(shapes)
    dtype = dtype or draw(st.sampled_from(DTYPES))
    # Keep |x| inside every format's range after the pre-scale: fp16 caps this at 65504.
    scale = draw(st.sampled_from([1e-6, 1e-3, 1.0, 30.0]))
    arr = draw(hnp.arrays(np.float32, shape, elements=st.floats(-1, 1, width=32)))
    x = torch.from_numpy(arr) * scale
    if draw(st.booleans()) and x.numel():
        idx = draw(st.integers(0, x.numel() - 1))
        x.view(-1)[idx] = draw(st.sampled_from([-1.0, 1.0])) * scale * 100  # an outlier
    return x.to(dtype)


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(SPECS), x=tensors())
def test_roundtrip_contract_and_error_bound(spec, x):
    codec = get_codec(spec)
    p = codec.encode(x)
    assert p.dtype == torch.uint8 and p.dim() == 1 and p.device == x.device
    assert p.numel() == codec.payload_nbytes(x.shape, x.dtype)
    y = codec.decode(p, x.shape, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    if x.numel():
        assert bool((group_errors(codec, x, y) <= error_bound(codec, x.float(), x.dtype)).all())
        # same input -> same payload (deterministic)
        assert torch.equal(codec.encode(x), p)


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(["e4m3", "e5m2"]), group=st.sampled_from([32, 64, 128, 256, 512]),
       n=st.integers(1, 1200))
def test_payload_size_formula(fmt, group, n):
    ng = math.ceil(n / group)
    assert get_codec(f"fp8:format={fmt},group={group}").payload_nbytes((n,), torch.float32) == ng * group + 8 * ng
    assert get_codec(f"fp8:format={fmt},group={group},hadamard=false").payload_nbytes(
        (n,), torch.bfloat16) == n + 8 * ng
    assert get_codec(f"fp8plain:format={fmt},group={group}").payload_nbytes((n,), torch.float16) == n + 4 * ng


def test_relative_error_from_mantissa_bits():
    """Normalized MSE of Gaussian data sits below the unit roundoff squared of each format."""
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    for fmt in ("e4m3", "e5m2"):
        u = FORMATS[fmt].unit_roundoff
        for spec in (f"fp8:format={fmt}", f"fp8plain:format={fmt}"):
            c = get_codec(spec)
            y = c.decode(c.encode(x), x.shape, x.dtype)
            nmse = float((y - x).pow(2).sum() / x.pow(2).sum())
            # Uniform relative error in [-u, u] gives u^2 / 3 on average; allow up to u^2.
            assert nmse < u * u, (spec, nmse)
    e4 = get_codec("fp8:format=e4m3")
    e5 = get_codec("fp8:format=e5m2")
    err4 = (e4.decode(e4.encode(x), x.shape, x.dtype) - x).pow(2).mean()
    err5 = (e5.decode(e5.encode(x), x.shape, x.dtype) - x).pow(2).mean()
    assert err4 < err5  # one more mantissa bit


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_and_constants(spec, dtype):
    codec = get_codec(spec)
    for x in (torch.zeros(3, 100, dtype=dtype), torch.full((257,), 0.75, dtype=dtype),
              torch.full((5, 64), -3e-7, dtype=dtype)):
        y = codec.decode(codec.encode(x), x.shape, dtype)
        if not x.any():
            assert torch.equal(y, x)
        else:
            torch.testing.assert_close(y.float(), x.float(), rtol=FORMATS[codec.format].unit_roundoff + 1e-2,
                                       atol=0)


@pytest.mark.parametrize("spec", ["fp8", "fp8:format=e5m2", "fp8plain"])
def test_tiny_values_near_zero(spec):
    """Values far below 1 keep their relative accuracy (the pre-scale / scale bring them into range)."""
    codec = get_codec(spec)
    torch.manual_seed(1)
    for std in (1e-4, 1e-8, 1e-12):
        x = torch.randn(4, 128) * std
        y = codec.decode(codec.encode(x), x.shape, x.dtype)
        assert bool((group_errors(codec, x, y) <= error_bound(codec, x)).all())
        assert float((y - x).norm() / x.norm()) < 0.1


@pytest.mark.parametrize("spec", ["fp8plain", "fp8plain:format=e5m2", "fp8:hadamard=false"])
def test_bound_covers_rounding_to_fp16_subnormals(spec):
    """fp16 values near 1e-6 are subnormal (step 2^-24): rounding the decoded result back to fp16
    adds up to half a step per element, which the bound for dtype=float16 includes."""
    codec = get_codec(spec)
    step = 2.0 ** -24
    exceeded = 0
    for k in range(2, 40):  # a group of value v with one element at k steps (the group maximum)
        for v in range(1, k):
            x = torch.full((2, 128), v * step).half()
            x[:, 0] = k * step
            y = codec.decode(codec.encode(x), x.shape, x.dtype)
            err = group_errors(codec, x, y)
            assert bool((err <= error_bound(codec, x.float(), x.dtype)).all()), (k, v)
            exceeded += int(not bool((err <= error_bound(codec, x.float())).all()))
    assert exceeded > 0  # the bound of an fp32 result does not cover these cases


def test_tiny_values_flush_to_zero_below_the_scale_floor():
    """fp8 clamps s >= 1e-12 and alpha <= 1e3: groups with |x| << 1e-15 decode to (almost) zero."""
    codec = get_codec("fp8")
    x = torch.full((128,), 1e-25)
    y = codec.decode(codec.encode(x), x.shape, x.dtype)
    assert float(y.abs().max()) <= 1e-12 * FORMATS["e4m3"].min_subnormal / 1e3 * 2


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_saturation(fmt):
    """Beyond the representable range codes saturate to +-FP8_MAX instead of turning into NaN/Inf."""
    f = FORMATS[fmt]
    # s <= 1e6 and alpha >= 1e-3: |x| up to FP8_MAX * 1e6 / 1e-3 fits; far beyond it saturates.
    limit = f.max * 1e6 / 1e-3
    x = torch.zeros(128)
    x[0] = limit * 100
    for spec in (f"fp8:format={fmt},hadamard=false",):
        c = get_codec(spec)
        y = c.decode(c.encode(x), x.shape, x.dtype)
        assert torch.isfinite(y).all()
        assert float(y[0]) == pytest.approx(limit, rel=1e-5)


def test_e5m2_range_exceeds_e4m3():
    x = torch.zeros(128)
    x[0] = 1e13  # beyond e4m3's 4.48e11 reach, inside e5m2's 5.7e13
    e4 = get_codec("fp8:format=e4m3,hadamard=false")
    e5 = get_codec("fp8:format=e5m2,hadamard=false")
    y4 = e4.decode(e4.encode(x), x.shape, x.dtype)
    y5 = e5.decode(e5.encode(x), x.shape, x.dtype)
    assert float(y4[0]) < 0.1 * 1e13  # saturated
    assert float(y5[0]) == pytest.approx(1e13, rel=FORMATS["e5m2"].unit_roundoff)


def test_huge_outlier_in_group():
    torch.manual_seed(2)
    x = torch.randn(2, 128)
    x[0, 5] = 1e6
    for spec in ("fp8", "fp8plain"):
        c = get_codec(spec)
        y = c.decode(c.encode(x), x.shape, x.dtype)
        assert bool((group_errors(c, x, y) <= error_bound(c, x)).all())
        assert float(y[0, 5]) == pytest.approx(1e6, rel=0.07)


@pytest.mark.parametrize("spec", ["fp8", "fp8plain"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused(spec, bad):
    x = torch.ones(130)
    x[7] = bad
    with pytest.raises(NonFiniteError):
        get_codec(spec).encode(x)


@pytest.mark.parametrize("spec", ["fp8:group=100", "fp8:group=16", "fp8:group=1024", "fp8plain:group=96"])
def test_bad_group(spec):
    with pytest.raises(CodecError, match="power of two in 32..512"):
        get_codec(spec)


def test_bad_format_and_params():
    with pytest.raises(CodecError, match="e4m3"):
        get_codec("fp8:format=e3m4")
    with pytest.raises(CodecError, match="no parameter"):
        get_codec("fp8plain:hadamard=true")
    with pytest.raises(CodecError, match="float32, float16 or bfloat16"):
        get_codec("fp8").encode(torch.ones(4, dtype=torch.float64))
    with pytest.raises(CodecError, match="float32, float16 or bfloat16"):
        get_codec("fp8plain").payload_nbytes((4,), torch.int32)


def test_spec_strings_and_alias():
    c = get_codec("fp8:format=e4m3,group=128")
    assert c.spec() == "fp8:format=e4m3,group=128,hadamard=true"
    assert get_codec(c.spec()) == c
    assert get_codec("taco") == get_codec("fp8")
    assert get_codec("fp8plain:format=e5m2").spec() == "fp8plain:format=e5m2,group=128"
    assert get_codec("fp8").compression_ratio((4096,)) == pytest.approx(32 / 8.5)


def test_wrong_payload_length():
    c = get_codec("fp8")
    p = c.encode(torch.randn(256))
    with pytest.raises(CodecError, match="disagree"):
        c.decode(p, (300,), torch.float32)


def test_non_contiguous_and_empty():
    c = get_codec("fp8")
    x = torch.randn(64, 96).t()
    y = c.decode(c.encode(x), x.shape, x.dtype)
    assert bool((group_errors(c, x, y) <= error_bound(c, x)).all())
    e = torch.empty(0, 5)
    assert c.encode(e).numel() == 0 == c.payload_nbytes(e.shape, e.dtype)
    assert c.decode(c.encode(e), e.shape, e.dtype).shape == e.shape


def test_hadamard_payload_layout_and_scales():
    """Payload = codes | alpha | s; alpha follows the RMS rule and s the absmax rule."""
    c = get_codec("fp8:group=32")
    x = torch.linspace(-1, 1, 64)
    p = c.encode(x)
    alpha = p[64:72].clone().view(torch.float32)
    s = p[72:80].clone().view(torch.float32)
    rms = x.view(2, 32).pow(2).mean(1).add(1e-6).sqrt()
    torch.testing.assert_close(alpha, (448 / rms).clamp(1e-3, 1e3))
    codes = p[:64].view(torch.float8_e4m3fn).float()
    assert float(codes.abs().max()) == 448.0
    assert bool((s > 0).all())


def test_the_decode_table_is_made_once_per_format_and_device():
    """The table of the 256 codes' values is made once: on a GPU, copying it from pageable host memory at each
    decode made the stream wait (and such a copy cannot be captured in a CUDA graph)."""
    from qwire.codecs import fp8

    c = get_codec("fp8:impl=torch")
    x = torch.randn(4, 64)
    p = c.encode(x)
    c.decode(p, x.shape, x.dtype)
    made = fp8._lut_on.cache_info().misses
    for _ in range(3):
        c.decode(p, x.shape, x.dtype)
    assert fp8._lut_on.cache_info().misses == made
    assert fp8._lut(c.fmt, "cpu") is fp8._lut(c.fmt, torch.device("cpu"))
