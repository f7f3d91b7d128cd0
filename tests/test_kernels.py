"""The fast codec implementations against the torch reference, and the dispatch that chooses them.

Every codec with a CPU kernel must write the reference's payload bytes for the same input and
decode any payload to the reference's values (so two processes may run different
implementations). Codec-specific kernel tests live in test_kernels_<codec>.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwire.codecs import CodecError, NonFiniteError, get_codec, kernels

pytest.importorskip("numba")

INT_SPECS = [
    "int2", "int3", "int4", "int5", "int6", "int8", "int4:layout=ref", "int3:layout=ref", "int4:layout=log6",
    "int5:layout=log6,tile=16", "int3:tile=7", "int8:tile=1", "int4:tile=64", "int4:symmetric=true",
    "int6:symmetric=true,layout=ref", "int3:symmetric=true,layout=log6", "int4:layout=log7,fit=mse", "int3:fit=mse",
    "int8:fit=mse,tile=7", "int4:symmetric=true,layout=log6,fit=mse",
]
TAH_SPECS = [
    "tahquant", "tahquant:layout=log", "tahquant:layout=ref", "tahquant:layout=log6", "tahquant:unit=token",
    "tahquant-paper", "tahquant-public", "tahquant:tau=0,max_rotated=1", "tahquant:tau=inf",
    "tahquant:tile=8,max_rotated=0.5", "tahquant:rotate=false,tile=12", "tahquant:ratio=1",
    "tahquant:ratio=0,high_bits=2,low_bits=1,slots=token", "tahquant:ratio=0.8",
    "tahquant:ratio=0.5,unit=token,high_bits=3,low_bits=2", "tahquant:layout=ref",
    "tahquant:high_bits=8,low_bits=5,tile=16", "tahquant:zero_ext=12",
    "tahquant:layout=log,zero_ext=0,max_rotated=0.25", "tahquant:alloc=entropy", "tahquant:alloc=entropy,unit=token",
    "tahquant:alloc=entropy,layout=log,zero_ext=0,max_rotated=0.25", "tahquant:fit=mse",
    "tahquant:fit=mse,ratio=0.8,tile=16", "tahquant:fit=mse,slots=token,ratio=0.8,layout=logx,zero_ext=8",
    "tahquant:fit=mse,rotate=false,tile=12,layout=log6", "tahquant:fit_rotated=true",
    "tahquant:zero_ext=0,tau=1.5,fit_rotated=true", "tahquant:fit_rotated=true,tau=0",
    "tahquant:tau=0,layout=log6,tile=64,fit_rotated=true", "tahquant:fit_rotated=true,ratio=0.8,tile=16",
    "tahquant:layout=log7,adapt=block,fit_rotated=true", "tahquant:adapt=block,layout=log6,zero_ext=5,tile=16",
    "tahquant:layout=log7,adapt=predict,fit_rotated=true", "tahquant:adapt=predict,layout=log6,zero_ext=5,tile=16",
    "tahquant:layout=log6t", "tahquant:layout=log6t,zero_width=block,fit_rotated=true",
    "tahquant:layout=log6t,zero_width=block,zero_ext=5,tile=16,ratio=0.8",
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _pair(spec: str):
    sep = "," if ":" in spec else ":"
    return get_codec(spec), get_codec(spec + sep + "impl=torch")


def _same(spec: str, x: torch.Tensor) -> None:
    fast, ref = _pair(spec)
    assert kernels.implementation(fast) == "cpu" and kernels.implementation(ref) == "torch"
    pf, pr = fast.encode(x), ref.encode(x)
    assert pf.numel() == pr.numel() == ref.payload_nbytes(x.shape, x.dtype)
    assert torch.equal(pf, pr), f"{spec} {tuple(x.shape)} {x.dtype}: {(pf != pr).sum().item()} bytes differ"
    yf, yr = fast.decode(pr, x.shape, x.dtype), ref.decode(pf, x.shape, x.dtype)
    assert yf.dtype == x.dtype and yf.shape == x.shape
    assert torch.equal(yf, yr), f"{spec}: decoded values differ"


@st.composite
def tensors(draw):
    shape = draw(st.sampled_from([(1,), (5,), (3, 7), (2, 3, 33), (4, 64), (9, 100), (2, 17, 96), (130, 40)]))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["randn", "zeros", "const", "outlier", "tiny", "huge", "ints"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(shape, generator=g)
    if kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "const":
        x = torch.full(shape, draw(st.sampled_from([1.5, -3.0, 1e-3])))
    elif kind == "outlier":
        x.view(-1)[:: max(1, x.numel() // 3)] *= draw(st.sampled_from([30.0, 1e3, 1e4]))
    elif kind == "tiny":
        x = x * 1e-30
    elif kind == "huge":
        x = x * 1e30
    elif kind == "ints":
        x = torch.randint(-3, 4, shape, generator=g).float()
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


@pytest.mark.parametrize("spec", INT_SPECS)
@settings(max_examples=25, deadline=None)
@given(x=tensors())
def test_int_kernel_matches_reference(spec, x):
    if x.dtype == torch.float16 and "layout=ref" in spec and x.abs().max() > 1e4:
        return  # the ref layout refuses such ranges on both paths (tested below)
    try:
        _same(spec, x)
    except CodecError as e:  # both paths must refuse alike
        with pytest.raises(type(e)):
            _pair(spec)[1].encode(x)


@pytest.mark.parametrize("spec", TAH_SPECS)
@settings(max_examples=15, deadline=None)
@given(x=tensors())
def test_tahquant_kernel_matches_reference(spec, x):
    if "unit=token" in spec or "public" in spec:
        x = x.reshape(1, *x.shape) if x.dim() < 2 else x
    if ("ref" in spec or "paper" in spec or "public" in spec) and x.float().abs().max() > 1e4:
        return  # fp16 metadata refuses such ranges on both paths (tests/test_codecs.py)
    _same(spec, x)


@pytest.mark.parametrize("spec", ["tahquant", "tahquant-public", "tahquant:unit=token,layout=log6",
                                  "tahquant:fit_rotated=true"])
def test_tahquant_kernel_llm_like_and_threaded(spec):
    """Massive activations and outlier channels (the zero extension), several thread blocks."""
    from qwire.codecs.synthetic import llm_like

    for shape, mag, spacing in [((4, 64, 1024), 1e4, 64), ((3, 40, 256), 300.0, 32), ((2, 9, 96), 30.0, 16)]:
        x, _ = llm_like(shape, massive=2, outlier_channels=3, magnitude=mag, spacing=spacing, seed=3)
        if "public" in spec:
            x = x.clamp(-6e4, 6e4)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            _same(spec, x)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("spec", TAH_SPECS + ["int4", "int4:layout=log7,fit=mse"])
def test_a_codec_that_keeps_its_scratch_buffers_encodes_each_call_as_a_fresh_one(spec):
    """The CPU kernels keep an encode's scratch buffers for the next call of the same codec, shape and thread
    (kernels/cpu/_common.Workspace): one codec encoding a run of different tensors, two shapes interleaved,
    from two threads at once, gives every payload the reference gives (nothing left from an earlier call)."""
    from concurrent.futures import ThreadPoolExecutor

    from qwire.codecs.synthetic import llm_like

    fast, ref = _pair(spec)
    g = torch.Generator().manual_seed(5)
    xs = []
    for shape in [(2, 17, 96), (9, 100)] * 3:
        xs.append(torch.randn(shape, generator=g))
    xs[2] = llm_like((2, 17, 96), massive=2, outlier_channels=3, magnitude=300.0, spacing=16, seed=3)[0]
    xs[3] = torch.zeros(9, 100)
    xs[4] = torch.randint(-3, 4, (2, 17, 96), generator=g).float()
    want = [ref.encode(x) for x in xs]
    for x, w in zip(xs, want):
        assert torch.equal(fast.encode(x), w), f"{spec} {tuple(x.shape)}"
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(fast.encode, xs * 3))
    assert all(torch.equal(p, w) for p, w in zip(got, want * 3)), spec


def test_a_codec_s_scratch_buffers_go_with_it():
    """A workspace is kept while its codec lives, and dropped with it; large tensors get none kept."""
    import gc

    from qwire.codecs.kernels.cpu import _common

    codec = get_codec("tahquant")
    codec.encode(torch.randn(2, 16, 64))
    mine = [k for k in _common._workspaces if k[0] == id(codec)]
    assert len(mine) == 1, mine
    codec.encode(torch.randn(_common.WORKSPACE_NUMEL + 64))
    assert [k for k in _common._workspaces if k[0] == id(codec)] == mine
    del codec
    gc.collect()
    assert not any(k == mine[0] for k in _common._workspaces)


def test_top_k_tie_rule():
    """The reference's explicit tie rule: the earlier of equal values; without ties, topk's set."""
    from qwire.codecs.tahquant import top_k

    v = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    assert top_k(v, 2).sort(dim=1).values.tolist() == [[1, 2], [0, 1]]
    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(4))
    for k in (1, 12, 51, 63):
        want = torch.zeros_like(w, dtype=torch.bool).scatter_(1, w.topk(k, dim=1).indices, True)
        got = torch.zeros_like(w, dtype=torch.bool).scatter_(1, top_k(w, k), True)
        assert torch.equal(got, want)


@pytest.mark.parametrize("spec", ["tahquant", "tahquant:alloc=entropy", "tahquant:tile=8,max_rotated=0.25",
                                  "tahquant:tau=0,max_rotated=0.3",
                                  "tahquant:tau=1.7,max_rotated=0.1,tile=16", "tahquant:unit=token,max_rotated=0.2"])
def test_tahquant_kernel_ties(spec):
    """Ties in the allocation's ranking (equal tiles) and in the rotation ranking (one-spike tiles: ratio
    inf; equal ratios), more candidates than slots: the kernel picks what the reference's rule picks."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 24, 128, generator=g).round()  # integer values: many equal tiles and ratios
    x[:, ::3] = 1.0
    x[:, 1::4, ::8] = 0.0
    x[:, 2::5] = 0.0
    x[:, 2::5, ::16] = 40.0  # tiles with a single spike (a2 = 0)
    x[1, :, :64:4] = 5.0 * torch.arange(16.0)
    _same(spec, x)
    _same(spec, x[:, :7, :100].contiguous())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("spec", ["int4", "int3:symmetric=true", "tahquant"])
def test_kernel_fused_pass_stops_and_checks(spec, threads):
    """The int kernel's one-pass encode (log layouts) stops at a block whose statistics need the input
    checks: a NaN there raises as the reference does; a huge but valid value (its square overflows
    fp32) gets the reference's bytes through the passes one after the other. tahquant alike."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 512, generator=g)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = x.clone()
        y[290, 7] = 3e25
        _same(spec, y)
        y[290, 7] = float("nan")
        for impl in _pair(spec):
            with pytest.raises(NonFiniteError):
                impl.encode(y)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("spec", ["int4", "int3:tile=64", "int8:symmetric=true", "int4:layout=ref"])
def test_int_kernel_large_and_threaded(spec):
    """Several thread blocks and anchor blocks, rows not a multiple of 8, odd channel counts."""
    g = torch.Generator().manual_seed(1)
    for shape in [(3, 331, 1000), (2, 257, 1600), (4099, 37)]:
        x = torch.randn(shape, generator=g) * 2
        x[..., 5] *= 300.0
        x[0, 0] *= 1e4 if "ref" not in spec else 10.0  # the ref layout holds fp16's range only
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            _same(spec, x)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_int_kernel_refuses_non_finite(bad):
    x = torch.randn(64, 96)
    x[17, 33] = bad
    for c in _pair("int4"):
        with pytest.raises(NonFiniteError):
            c.encode(x)


def test_int_kernel_refuses_out_of_range():
    x = torch.randn(16, 64)
    x[3, 3] = 1e37
    for c in _pair("int4"):
        with pytest.raises(CodecError, match="exceeds the largest value"):
            c.encode(x)


def test_impl_option():
    c = get_codec("int4:impl=torch")
    assert c.impl == "torch" and c.spec() == get_codec("int4").spec()  # impl is not wire configuration
    assert c == get_codec("int4")
    with pytest.raises(CodecError, match="impl='gpu' must be one of"):
        get_codec("int4", impl="gpu")
    assert kernels.implementation(get_codec("int4:rounding=stochastic")) == "torch"  # not covered: reference
    with pytest.raises(CodecError, match="does not cover this configuration"):
        kernels.implementation(get_codec("int4:rounding=stochastic,impl=cpu"))
    assert kernels.implementation(get_codec("int4:impl=cpu")) == "cpu"


def test_impl_from_environment(monkeypatch):
    monkeypatch.setenv("QWIRE_CODEC_IMPL", "torch")
    assert get_codec("int4").impl == "torch"
    monkeypatch.setenv("QWIRE_CODEC_IMPL", "fastest")
    with pytest.raises(CodecError, match="QWIRE_CODEC_IMPL"):
        get_codec("int4")


def test_backend_that_cannot_load_falls_back_once(monkeypatch):
    b = kernels.Backend("cpu", "cpu", "qwire.codecs.kernels.no_such_module", "Re-run the set-up.")
    monkeypatch.setitem(kernels.BACKENDS, "cpu", b)
    x = torch.randn(8, 32)
    with pytest.warns(RuntimeWarning, match="could not load"):
        p = get_codec("int4").encode(x)
    assert torch.equal(p, get_codec("int4:impl=torch").encode(x))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not again
        get_codec("int4").encode(x)
    with pytest.raises(CodecError, match="cannot run here"):
        get_codec("int4:impl=cpu").encode(x)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_fast_packers_match_the_bit_stream(bits):
    """The packers' whole-group paths write qwire.codecs.packing's bit stream (the byte-wise packer)
    at any byte offset and length, and the unpackers read it back."""
    import numpy as np

    from qwire.codecs.kernels.cpu._common import pack_into, unpack_from
    from qwire.codecs.kernels.cpu._fastpack import pack, unpack

    rng = np.random.default_rng(bits)
    for n in (0, 1, 7, 8, 31, 32, 33, 100, 1000):
        for o in (0, 3):
            c = rng.integers(0, 1 << bits, n).astype(np.uint8)
            a, b = np.zeros(o + n, np.uint8), np.zeros(o + n, np.uint8)
            assert pack(a, o, c, bits) == pack_into(b, o, c, bits)
            assert (a == b).all()
            d = np.empty(n, np.uint8)
            unpack(a, o, d, bits)
            assert (d == c).all()
            unpack_from(a, o, d, bits)
            assert (d == c).all()


def test_kernel_top_mask_is_top_k():
    """The kernels' selection of the k largest per row (bisection on the ordered bits) is top_k's set,
    ties (the earlier first), signed zeros, negatives and infinities included."""
    import numpy as np
    from numba import njit

    from qwire.codecs.kernels.cpu._tah import _top_mask
    from qwire.codecs.tahquant import top_k

    @njit
    def rows(v, k, out):
        keys = np.empty(v.shape[1], dtype=np.int32)
        for r in range(v.shape[0]):
            _top_mask(v[r], k, out[r], keys)

    g = torch.Generator().manual_seed(11)
    v = torch.randn(40, 64, generator=g).round()  # many ties
    v[0] = 0.0
    v[1, ::2] = -0.0
    v[2, :5] = math.inf
    v[3] = -torch.rand(64, generator=g)
    v[4, ::3] = 1e-40  # subnormals
    for k in (1, 12, 51, 63):
        got = torch.zeros(v.shape, dtype=torch.bool)
        rows(v.numpy(), k, got.numpy())
        want = torch.zeros_like(got).scatter_(1, top_k(v, k), True)
        assert torch.equal(got, want), k


@pytest.mark.parametrize("spec", ["blockwise8", "blockwise4", "fp4", "blockfp:bits=6,block=64"])
def test_the_blockwise_codecs_refuse_at_encode_what_their_decode_would_take_for_corruption(spec):
    """A block maximum near fp32's top (above 2^120) encoded without complaint, and its own decode then called
    the payload corrupt; now the encode refuses it as the other quantizing codecs do, on each implementation."""
    x = torch.randn(4, 64)
    x[2, 5] = 3e38
    sep = "," if ":" in spec else ":"
    for impl in ("torch", "cpu"):
        with pytest.raises(CodecError, match=r"input magnitude 3e\+38 exceeds the largest value a quantizing"):
            get_codec(f"{spec}{sep}impl={impl}").encode(x)
    x[2, 5] = 1e36  # below 2^120: taken, and decoded
    c = get_codec(spec)
    assert c.decode(c.encode(x), x.shape, x.dtype).abs().amax() > 5e35
