"""The CPU kernels of the float casts (``fp16``, ``bf16``, ``fp32``) against the torch reference: the same
payload bytes and decoded values (NaNs compared as NaNs), the same fp16 overflow error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwire.codecs import CodecError, get_codec, kernels

pytest.importorskip("numba")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SPECS = ["fp16", "bf16", "fp32"]


def _pair(spec: str):
    fast, ref = get_codec(spec + ":impl=cpu"), get_codec(spec + ":impl=torch")
    assert kernels.implementation(fast) == "cpu"
    return fast, ref


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.uint8:
        return torch.equal(a, b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _check(spec: str, x: torch.Tensor) -> None:
    fast, ref = _pair(spec)
    try:
        pr = ref.encode(x)
    except CodecError as e:
        with pytest.raises(CodecError, match="exceeds fp16's range"):
            fast.encode(x)
        assert "exceeds fp16's range" in str(e)
        return
    pf = fast.encode(x)
    assert pf.dtype == torch.uint8 and pf.numel() == fast.payload_nbytes(x.shape, x.dtype)
    if x.isnan().any():  # NaN bit patterns may differ: compare the decoded payload instead
        assert _same(fast.decode(pf, x.shape, x.dtype), ref.decode(pr, x.shape, x.dtype))
    else:
        assert torch.equal(pf, pr), f"{spec} {x.dtype}: {int((pf != pr).sum())} bytes differ"
    for dtype in DTYPES:
        yf, yr = fast.decode(pr, x.shape, dtype), ref.decode(pr, x.shape, dtype)
        assert yf.shape == x.shape and yf.dtype == dtype
        assert _same(yf, yr), f"{spec} -> {dtype}: decoded values differ"


@st.composite
def tensors(draw):
    n = draw(st.one_of(st.integers(0, 20), st.integers(0, 3000)))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-42, 1e-8, 1e-5, 1.0, 6e4, 1e5, 1e30]))
    x = torch.randn(n, generator=gen) * scale
    if n and draw(st.booleans()):
        idx = torch.randint(0, n, (3,), generator=gen)
        x[idx] = torch.tensor(draw(st.lists(st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0,
                                                            65504.0, 65520.0, 65519.99, 1e-45]),
                                            min_size=3, max_size=3)))
    return x.to(dtype)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=50, deadline=None)
@given(x=tensors())
def test_float_kernels_match_reference(spec, x):
    _check(spec, x)


@pytest.mark.parametrize("spec", SPECS)
def test_rounding_boundaries_every_fp16_and_bf16(spec):
    """Every fp16 and bf16 value, and the fp32 values halfway between neighbours (ties) and next to them."""
    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for half in (h.view(torch.float16), h.view(torch.bfloat16)):
        f = half.float()
        _check(spec, half)
        _check(spec, f)
        _check(spec, torch.nextafter(f, torch.full_like(f, float("inf"))))
        _check(spec, torch.nextafter(f, torch.full_like(f, -float("inf"))))
        ties = ((f[:-1].double() + f[1:].double()) / 2).float()  # exact in fp32 between finite neighbours
        _check(spec, ties[torch.isfinite(ties)])


def test_overflow_message_and_odd_payloads():
    fast, ref = _pair("fp16")
    x = torch.ones(1001)
    x[999] = 7e4
    for codec in (fast, ref):
        with pytest.raises(CodecError, match="7e\\+04 exceeds fp16's range"):
            codec.encode(x)
    # a payload that is a view at an odd byte offset decodes the same
    p = torch.cat([torch.zeros(1, dtype=torch.uint8), ref.encode(torch.randn(999))])[1:]
    assert p.data_ptr() % 2 == 1
    for dtype in DTYPES:
        assert _same(fast.decode(p, (999,), dtype), ref.decode(p, (999,), dtype))
    with pytest.raises(CodecError, match="disagree"):
        fast.decode(p, (998,), torch.float32)


def test_threads_and_non_contiguous():
    x = torch.randn(300, 700).t()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        for spec in SPECS:
            _check(spec, x)
            _check(spec, x.to(torch.bfloat16))
    finally:
        torch.set_num_threads(old)
