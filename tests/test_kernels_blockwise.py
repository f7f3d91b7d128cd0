"""CPU kernels of ``perchannel<b>``, the block-wise codecs (``blockwise<b>``, ``blockfp``/``fp4``) and AQ-SGD's
element-wise steps against the torch reference: the same payload bytes for the same input, and the same
decoded values (bit for bit, signed zeros included) from either side's payload."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwire.codecs import CodecError, NonFiniteError, get_codec, kernels

pytest.importorskip("numba")

PERCHANNEL = ["perchannel6", "perchannel8", "perchannel2", "perchannel3", "perchannel4:layout=fp32",
              "perchannel5", "perchannel7:layout=fp32"]
BLOCKWISE = ["blockwise8", "blockwise4", "blockwise", "fp4", "blockfp", "blockwise:bits=6,block=32",
             "blockfp:bits=8,block=64", "blockfp:bits=6,block=7", "blockwise:bits=2,block=1",
             "blockfp:bits=3,block=5", "blockfp:bits=5,block=3", "blockwise:bits=3,block=3", "blockfp:bits=7,block=9",
             "blockwise:bits=5,block=10", "blockwise:bits=7,block=13"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.uint8: torch.uint8}  # uint8: int8 caches hold payloads


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` (so that -0.0 and 0.0 differ)."""
    return t.contiguous().view(INT_VIEW[t.dtype])


def same_or_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that any two NaNs match (their bit patterns vary between torch's own paths)."""
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(bits(a)[~na], bits(b)[~nb])


def _pair(spec: str, **kw):
    return get_codec(spec, **kw), get_codec(spec, impl="torch", **kw)


def _same(spec: str, x: torch.Tensor) -> None:
    fast, ref = _pair(spec)
    assert kernels.implementation(fast) == "cpu" and kernels.implementation(ref) == "torch"
    try:
        pr = ref.encode(x)
    except CodecError as e:  # both paths refuse alike (NaN/Inf, out of range)
        with pytest.raises(type(e)):
            fast.encode(x)
        return
    pf = fast.encode(x)
    assert pf.dtype == torch.uint8 and pf.numel() == pr.numel() == ref.payload_nbytes(x.shape, x.dtype)
    assert torch.equal(pf, pr), f"{spec} {tuple(x.shape)} {x.dtype}: {(pf != pr).sum().item()} bytes differ"
    for dtype in {x.dtype, torch.float32}:
        yr = ref.decode(pr, x.shape, dtype)
        for y in (fast.decode(pr, x.shape, dtype), fast.decode(pf, x.shape, dtype)):
            assert y.shape == x.shape and y.dtype == dtype
            assert torch.equal(bits(y), bits(yr)), f"{spec} {tuple(x.shape)} {x.dtype}->{dtype}: decoded values differ"
        assert torch.equal(bits(ref.decode(pf, x.shape, dtype)), bits(yr))


@st.composite
def tensors(draw):
    shape = draw(st.sampled_from([(), (1,), (7,), (3, 5), (2, 3, 33), (4, 64), (9, 129), (2, 17, 96), (130, 1),
                                  (5, 3, 7), (300,)]))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["randn", "zeros", "const", "outlier", "tiny", "subnormal", "huge", "ints",
                                 "signed_zeros", "channels"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(shape, generator=g)
    if kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "const":
        x = torch.full(shape, draw(st.sampled_from([1.5, -3.0, 1e-3, 7.0])))
    elif kind == "outlier" and x.numel():
        x.view(-1)[:: max(1, x.numel() // 3)] *= draw(st.sampled_from([30.0, 1e3, 1e4, 1e7]))
    elif kind == "tiny":
        x = x * 1e-30
    elif kind == "subnormal":
        x = x * 1e-39
    elif kind == "huge":
        x = x * draw(st.sampled_from([1e20, 1e30, 1e37]))
    elif kind == "ints":
        x = torch.randint(-3, 4, shape, generator=g).float()
    elif kind == "signed_zeros":
        x = torch.where(torch.rand(shape, generator=g) < 0.5, x, -torch.zeros(shape)) * 1e-3
    elif kind == "channels" and x.dim():
        x[..., :: max(1, x.shape[-1] // 3)] *= 60.0
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


@pytest.mark.parametrize("spec", PERCHANNEL)
@settings(max_examples=30, deadline=None)
@given(x=tensors())
def test_perchannel_kernel_matches_reference(spec, x):
    _same(spec, x)


@pytest.mark.parametrize("spec", BLOCKWISE)
@settings(max_examples=25, deadline=None)
@given(x=tensors())
def test_blockwise_kernel_matches_reference(spec, x):
    _same(spec, x)


@pytest.mark.parametrize("spec", ["perchannel6", "perchannel3", "blockwise8", "blockwise4", "fp4",
                                  "blockwise:bits=6,block=7", "blockfp:bits=5,block=3"])
def test_large_and_threaded(spec):
    """Several thread blocks, rows not a multiple of 8, odd channel counts, sizes not a multiple of the block."""
    g = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for shape in [(3, 331, 1001), (4099, 37), (70001,)]:
            x = torch.randn(shape, generator=g) * 2
            x[..., 5] *= 300.0
            x.view(-1)[123] = 3e4
            _same(spec, x)
            _same(spec, x.to(torch.bfloat16))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("spec", ["perchannel6", "perchannel8:layout=fp32", "blockwise8", "blockwise4", "fp4",
                                  "blockfp:bits=6,block=7"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_raises_on_both_paths(spec, bad):
    for pos in [0, 37, -1]:
        x = torch.randn(3, 70)
        x.view(-1)[pos] = bad
        for c in _pair(spec):
            with pytest.raises(NonFiniteError, match="NaN/Inf"):
                c.encode(x)


@pytest.mark.parametrize("spec", PERCHANNEL[:2] + BLOCKWISE[:4])
def test_empty_tensors(spec):
    for c in _pair(spec):
        for shape in [(0,), (3, 0), (0, 5)]:
            for dtype in DTYPES:
                p = c.encode(torch.empty(shape, dtype=dtype))
                assert p.numel() == 0 == c.payload_nbytes(shape, dtype) and p.dtype == torch.uint8
                y = c.decode(p, shape, dtype)
                assert y.shape == shape and y.dtype == dtype


def test_perchannel_configurations_and_edges():
    assert kernels.implementation(get_codec("perchannel4:rounding=stochastic")) == "torch"  # not covered
    assert kernels.implementation(get_codec("perchannel")) == "cpu"
    x = torch.randn(4, 8) * 1e7  # ref layout: steps beyond fp16 raise on both paths
    for c in _pair("perchannel"):
        with pytest.raises(CodecError, match="layout=fp32"):
            c.encode(x)
    # fp32 steps so small that 1/step overflows: the kernel hands over to the reference
    x = torch.randn(6, 10) * 1e-39
    x[:, 3] = 1e-44
    _same("perchannel6:layout=fp32", x)
    # fp16 output at the limit of fp16's range stays finite
    h = torch.tensor([[65504.0, -65504.0, 1.0, 60000.0] * 8], dtype=torch.float16)
    _same("perchannel2", h)
    _same("blockwise4", h)


def test_non_contiguous_input():
    x = torch.randn(16, 96).t()
    for spec in ["perchannel6", "blockwise8", "fp4"]:
        _same(spec, x)


# ------------------------------------------------------------------------------------------- AQ-SGD
def test_aqsgd_sub_codecs_follow_impl():
    c = get_codec("aqsgd:inner=int4,warmup=fp16,cache_dtype=int8", impl="torch")
    assert c.inner_codec.impl == c.warmup_codec.impl == c._row_codec.impl == "torch"
    assert get_codec("aqsgd:inner=int4", impl="auto").inner_codec.impl == "auto"
    assert get_codec("aqsgd:inner=int4", impl="cpu").inner_codec.impl == "auto"  # inner codecs take theirs
    t = torch.empty(0)
    assert kernels.select(get_codec("aqsgd"), "_delta", t) is not None
    assert kernels.select(get_codec("aqsgd", impl="torch"), "_accumulate", t) is None


def _caches_equal(*codecs):
    keys = set(codecs[0].cache)
    for c in codecs[1:]:
        assert set(c.cache) == keys
    for k in keys:
        first = codecs[0].cache[k]
        for c in codecs[1:]:
            assert c.cache[k].dtype == first.dtype and torch.equal(bits(c.cache[k]), bits(first)), k


@pytest.mark.parametrize("inner", ["int4", "perchannel6", "blockwise8", "fp16"])
@pytest.mark.parametrize("cache_dtype", ["fp16", "bf16", "fp32", "int8"])
def test_aqsgd_fast_and_reference_agree(inner, cache_dtype):
    """Payloads, decoded activations and both sides' caches are bit-identical whichever side runs which
    implementation, over visits that drift from large to small deltas, for every activation dtype."""
    spec = f"aqsgd:inner={inner},cache_dtype={cache_dtype}"
    g = torch.Generator().manual_seed(7)
    base = torch.randn(5, 6, 40, generator=g) * 50
    for dtype in DTYPES:
        send_f, recv_f = get_codec(spec), get_codec(spec)
        send_r, recv_r = get_codec(spec, impl="torch"), get_codec(spec, impl="torch")
        for step in range(4):
            ids = torch.tensor([(2 * step + k) % 5 for k in range(3)])
            x = (base[ids] + torch.randn(3, 6, 40, generator=g) * 10.0 ** (1 - step)).to(dtype)
            pf, pr = send_f.encode(x, sample_ids=ids), send_r.encode(x, sample_ids=ids)
            assert torch.equal(pf, pr), (spec, dtype, step)
            yf, yr = recv_f.decode(pr, x.shape, dtype, sample_ids=ids), recv_r.decode(pf, x.shape, dtype)
            assert yf.dtype == dtype and torch.equal(bits(yf), bits(yr)), (spec, dtype, step)
        _caches_equal(send_f, recv_f, send_r, recv_r)


@st.composite
def _pairs(draw):
    dx, dm = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    n = draw(st.sampled_from([1, 7, 300, 5000]))
    scale = draw(st.sampled_from([1e-6, 1.0, 3e4, 1e38]))
    a, b = torch.randn(n, generator=g) * scale, torch.randn(n, generator=g) * scale
    if draw(st.booleans()):  # near-cancellation, signed zeros and subnormals
        b = a * (1 + 1e-3 * torch.randn(n, generator=g))
        b[:: 3] = -0.0
        a[1:: 5] = 1e-40
    return a.to(dx), b.to(dm)


@settings(max_examples=60, deadline=None)
@given(xm=_pairs())
def test_aqsgd_delta_and_accumulate_kernels(xm):
    """``x - m.to(x.dtype)`` and ``m + d.to(m.dtype)`` for every pair of dtypes, overflow to Inf included."""
    x, m = xm
    fast, ref = get_codec("aqsgd"), get_codec("aqsgd", impl="torch")
    assert same_or_nan(fast._delta(x, m), ref._delta(x, m))
    assert same_or_nan(fast._accumulate(m.clone(), x), ref._accumulate(m.clone(), x))


def test_aqsgd_threaded():
    """Several thread blocks in the element-wise kernels (fp16 cache, bf16 activations)."""
    g = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for dtype in (torch.float32, torch.bfloat16):
            send_f, send_r = get_codec("aqsgd:inner=blockwise8"), get_codec("aqsgd:inner=blockwise8", impl="torch")
            base = torch.randn(2, 301, 499, generator=g)
            for step in range(3):
                x = (base + 0.1 * step * torch.randn(base.shape, generator=g)).to(dtype)
                assert torch.equal(send_f.encode(x, sample_ids=[0, 1]), send_r.encode(x, sample_ids=[0, 1]))
            _caches_equal(send_f, send_r)
    finally:
        torch.set_num_threads(threads)
