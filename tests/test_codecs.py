"""Codec contract for every registered codec, and the bounds of the tile codecs
(``int``/``int2..8``, ``tahquant``, ``perchannel``/``perchannel2..8``)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwire.codecs import CodecError, NonFiniteError, available, get_codec, pin_spec, unpin_spec
from qwire.codecs import layouts as layouts_mod
from qwire.codecs import tiles as tiles_mod
from qwire.codecs.hadamard import hadamard_matrix, hadamard_transform, pivot_swap
from qwire.codecs.tahquant import entropy_, round_count
from qwire.codecs.tiles import TileCodec

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}  # half an ulp

# The tile codecs of this module, in configurations that cover every branch.
TILE_SPECS = [
    "int2", "int3", "int4", "int8", "int4:layout=ref", "int3:tile=7", "int5:layout=log6,tile=16",
    "int4:symmetric=true", "int6:symmetric=true,layout=ref", "int8:tile=1",
    "tahquant", "tahquant:layout=ref", "tahquant:layout=log6",
    "tahquant:tile=64,unit=token,layout=ref,max_rotated=1,ratio=0.8,slots=token",
    "tahquant:ratio=0.8", "tahquant:ratio=0.5,unit=token,high_bits=3,low_bits=2", "tahquant:tile=4", "tahquant:tile=8",
    "tahquant:slots=token,ratio=0.8,layout=logx,zero_ext=8",
    "tahquant:tau=0,max_rotated=1", "tahquant:tau=inf", "tahquant:tile=8,max_rotated=0.5",
    "tahquant:rotate=false,tile=12", "tahquant:ratio=1", "tahquant:ratio=0,high_bits=2,low_bits=1,slots=token",
    "tahquant:high_bits=8,low_bits=5,tile=16", "tahquant:layout=log7,adapt=block",
    "tahquant:adapt=block,layout=log6,tile=16", "tahquant:layout=log7", "tahquant:zero_width=fixed",
    "tahquant:layout=log7,adapt=predict,fit_rotated=true", "tahquant:layout=log7,adapt=predict,zero_ext=5,tile=16",
    "tahquant:layout=log6t", "tahquant:layout=log6t,zero_width=block,fit_rotated=true",
    "tahquant:layout=log6t,zero_width=block,zero_ext=5,tile=16",
    "perchannel", "perchannel2", "perchannel8:layout=fp32",
]


def _bits(codec) -> int:
    return getattr(codec, "bits", None) or codec.high_bits


def _slack(codec, y: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 arithmetic (relative to the tile's code range) plus the cast of the output to ``dtype``."""
    s = bound * (2.0 ** _bits(codec)) * 2.0 ** -16 + y.float().abs() * EPS[dtype] + 1e-37
    if dtype == torch.float16:
        s = s + 2.0 ** -25  # fp16 subnormal spacing
    return s


def _check(codec, x: torch.Tensor) -> torch.Tensor:
    p = codec.encode(x)
    assert p.dtype == torch.uint8 and p.dim() == 1 and p.device == x.device
    assert p.numel() == codec.payload_nbytes(x.shape, x.dtype)
    y = codec.decode(p, x.shape, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    if isinstance(codec, TileCodec):  # only this module's codecs: others state their own bounds
        bound = codec.error_bound(x, p)
        err = (x.float() - y.float()).abs()
        excess = err - bound - _slack(codec, y, bound, x.dtype)
        assert bool((excess <= 0).all()), f"{codec.spec()}: error exceeds bound by {float(excess.max()):.3g}"
    return y


@st.composite
def tensors(draw, max_cols: int = 70):
    lead = draw(st.lists(st.integers(0, 5), min_size=0, max_size=2))
    shape = (*lead, draw(st.integers(1, max_cols))) if draw(st.integers(0, 9)) else ()
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([1e-6, 1.0, 300.0] + ([1e-30, 1e20] if dtype != torch.float16 else [])))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    x = torch.randn(shape, generator=g) * scale
    kind = draw(st.sampled_from(["randn", "outlier_channels", "zeros", "const", "offset", "student"]))
    if kind == "outlier_channels" and x.dim() and x.shape[-1] > 2:
        x[..., :: max(1, x.shape[-1] // 3)] *= 60.0
    elif kind == "zeros":
        x.zero_()
    elif kind == "const":
        x.fill_(draw(st.sampled_from([-2.5, 0.1, 7.0])) * scale)
    elif kind == "offset":
        x += 40 * scale
    elif kind == "student":
        x = torch.distributions.StudentT(2.0).sample(x.shape) * scale
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


# ------------------------------------------------------------------------------ every registered codec
def _stateless() -> list[str]:
    return [n for n in available() if not get_codec(n).stateful]


@pytest.mark.parametrize("name", _stateless())
@settings(max_examples=12, deadline=None)
@given(x=tensors())
def test_contract_every_codec(name, x):
    """Payload is 1-D uint8 of exactly payload_nbytes; decode keeps shape, dtype and device."""
    x = x.clamp(-1e3, 1e3)  # inside every format's range (fp16 casts refuse > 65504)
    codec = get_codec(name)
    try:
        codec.payload_nbytes(x.shape, x.dtype)
    except CodecError:  # a codec may refuse a shape; it must then refuse to encode it as well
        with pytest.raises(CodecError):
            codec.encode(x)
        return
    y = _check(codec, x)
    if codec.lossless:
        assert torch.equal(y, x)


@pytest.mark.parametrize("name", _stateless())
def test_spec_round_trip_every_codec(name):
    codec = get_codec(name)
    again = get_codec(codec.spec())
    assert again == codec and again.spec() == codec.spec()


# ------------------------------------------------------------------------------ the tile codecs
@pytest.mark.parametrize("spec", TILE_SPECS)
@settings(max_examples=15, deadline=None)
@given(x=tensors())
def test_error_within_bound(spec, x):
    """|x - decode(encode(x))| <= the bound from the decoded metadata (half a decoded step; TAH
    rotated tiles sqrt(G) times that), plus fp32 and output-cast rounding."""
    codec = get_codec(spec)
    try:
        _check(codec, x)
    except CodecError as e:  # fp16 metadata cannot hold it: only the ref layout, only for big values
        assert codec.layout == "ref" and float(x.abs().max()) * math.sqrt(codec.tile) > 65504, e
        assert "layout=" in str(e)


@pytest.mark.parametrize("spec", ["int4", "int3:tile=16", "int8", "int4:layout=ref", "int5:layout=log6",
                                  "int4:symmetric=true", "int4:symmetric=true,layout=ref"])
def test_int_step_from_configuration(spec):
    """The decoded step is the ideal one times at most the layout's rounding factor.

    Ideal: (max - min) / L (symmetric: absmax / h). ``ref`` rounds the zero down to fp16
    and the step up (factor <= 1 + 2^-10, zero error <= 2^-11 |min|); ``log`` uses steps
    2^(1/q) apart and a zero on a grid of u steps (step <= 2^(1/q) (max - min) / (L - u)),
    or, for an outlier tile given a grid through 0, at most one step more of range
    (step <= 2^(1/q) (max - min) / (L - 1)). The tiles straddle 0, so the zero code's reach
    never binds.
    """
    codec = get_codec(spec)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    x[:, ::2] = x[:, ::2].abs()
    x[:, 1::2] = -x[:, 1::2].abs()
    p = codec.encode(x)
    bound = codec.error_bound(x, p).view(40, -1, codec.tile)[..., 0]  # s / 2 per tile
    t = x.view(40, -1, codec.tile)
    lo, hi = t.amin(-1), t.amax(-1)
    L = (1 << codec.bits) - 1
    if codec.symmetric:
        ideal = torch.maximum(hi, -lo) / (L // 2)
        lay = layouts_mod.LAYOUTS[codec.layout]
        factor = 1 + 2.0 ** -10 if codec.layout == "ref" else 2.0 ** (1 / lay.per_octave)
        limit = ideal * factor
    elif codec.layout == "ref":
        limit = (hi - lo + 2.0 ** -11 * lo.abs()) / L * (1 + 2.0 ** -10)
    else:
        lay = layouts_mod.LAYOUTS[codec.layout]
        limit = 2.0 ** (1 / lay.per_octave) * (hi - lo) / (L - max(lay.unit(L), 1.0))
    assert bool((2 * bound <= limit * (1 + 1e-6)).all())
    assert bool((2 * bound >= (hi - lo) / L * (1 - 1e-6)).all())  # never finer than ideal


def test_bits_per_code_really_packed():
    """A 4-bit payload is 4 bits per code plus the metadata: bytes / elements, counted."""
    x = torch.randn(64, 256)
    for spec, meta_bits in [("int4", 16 / 32), ("int4:layout=ref", 32 / 32), ("int4:tile=4096", 16 / 256),
                            ("int4:layout=ref,symmetric=true,tile=128", 16 / 128)]:
        codec = get_codec(spec)
        p = codec.encode(x)
        bpe = 8 * p.numel() / x.numel()
        anchors = codec.geometry(x.shape).n_blocks if "log" in codec.layout else 0  # fp32 per >= 64K elements
        assert anchors <= 4
        assert bpe == pytest.approx(4 + meta_bits + 32 * anchors / x.numel(), abs=1e-9), spec
    big = get_codec("int4:tile=4096").encode(torch.randn(16, 4096))
    assert 8 * big.numel() / (16 * 4096) == pytest.approx(4.0, rel=2e-3)


def test_tahquant_default_cost_target():
    """Issue-2 target: TAH-Quant's default configuration costs <= 4.41 bits/element, all included."""
    codec = get_codec("tahquant")
    for shape in [(8, 128, 256), (4, 128, 512), (2, 64, 1600), (2, 64, 2048), (1, 16, 4096)]:
        x = torch.randn(shape)
        assert 8 * codec.encode(x).numel() / x.numel() <= 4.41, shape
    # the reference layout at the public code's G=64 and v1 allocation: 0.8*4 + 0.2*3 + (16+16+1+6)/64
    ref = get_codec("tahquant:tile=64,unit=token,layout=ref,max_rotated=1,ratio=0.8,slots=token")
    k = round_count(0.8, 128)  # high tokens per sequence of 128
    want = (4 * k + 3 * (128 - k)) / 128 + 39 / 64 + 1 / 1600  # + the 1-bit-per-token allocation map
    assert ref.bits_per_element((8, 128, 1600)) == pytest.approx(want, abs=1e-6)
    assert abs(want - 4.41) < 0.005


def test_zeros_exact_and_empty_tensors():
    for spec in TILE_SPECS:
        codec = get_codec(spec)
        for dtype in DTYPES:
            z = torch.zeros(3, 5, 40, dtype=dtype)
            assert torch.equal(codec.decode(codec.encode(z), z.shape, dtype), z), spec
            for shape in [(0,), (0, 32), (4, 0), (2, 0, 5)]:
                e = torch.empty(shape, dtype=dtype)
                assert codec.payload_nbytes(shape, dtype) == 0
                p = codec.encode(e)
                assert p.numel() == 0 and p.dtype == torch.uint8
                d = codec.decode(p, shape, dtype)
                assert d.shape == e.shape and d.dtype == dtype


@pytest.mark.parametrize("spec", ["int4", "tahquant", "tahquant:unit=token", "perchannel", "int4:layout=ref"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_raises(spec, bad):
    codec = get_codec(spec)
    for pos in [0, 37, -1]:  # also inside the padded last tile
        x = torch.randn(3, 70)
        x.view(-1)[pos] = bad
        with pytest.raises(NonFiniteError, match="NaN/Inf"):
            codec.encode(x)


def test_metadata_never_overflows_silently():
    x = torch.randn(4, 64) * 1e30
    for spec in ["int4", "tahquant", "int4:symmetric=true"]:  # log layout: any finite fp32 value
        _check(get_codec(spec), x)
    for spec in ["int4:layout=ref", "tahquant:layout=ref", "int4:layout=ref,symmetric=true"]:
        with pytest.raises(CodecError, match="layout=log"):
            get_codec(spec).encode(x)
    with pytest.raises(CodecError, match="layout=fp32"):
        get_codec("perchannel").encode(torch.randn(4, 8) * 1e7)
    _check(get_codec("perchannel:layout=fp32"), torch.randn(4, 8) * 1e30)
    with pytest.raises(CodecError, match="rescale"):
        get_codec("int4").encode(torch.full((2, 4), 1e38))
    # values at fp16's limit decode without becoming Inf
    h = torch.tensor([[65504.0, -65504.0, 1.0, 60000.0] * 8], dtype=torch.float16)
    for spec in ["int3", "tahquant", "int2:layout=ref", "perchannel2"]:
        y = _check(get_codec(spec), h)
        assert bool(torch.isfinite(y).all()), spec


def test_gradient_sized_values():
    """Gradients are tiny (1e-9 .. 1e-5). The log layout is scale-free: a tensor scaled by 2^-23
    is quantized exactly as well. fp16 metadata (``ref``) loses precision there (subnormal steps)
    but stays within its bound."""
    g = torch.randn(4, 32, 256)
    g[..., 3] *= 100

    def nmse(spec, x):
        y = _check(get_codec(spec), x)
        return float(((y - x) ** 2).sum() / (x ** 2).sum())

    for spec in ["tahquant", "tahquant:layout=log6", "int4", "int3:symmetric=true", "perchannel:layout=fp32"]:
        assert nmse(spec, g * 2.0 ** -23) == pytest.approx(nmse(spec, g), rel=1e-4), spec
    for spec in ["tahquant:layout=ref", "perchannel"]:
        assert nmse(spec, g * 1e-7) < 0.5


@pytest.mark.parametrize("spec", ["int3:rounding=stochastic", "int4:rounding=stochastic,symmetric=true",
                                  "tahquant:rounding=stochastic", "perchannel4:rounding=stochastic",
                                  "tahquant:rounding=stochastic,tau=0,max_rotated=1,tile=8"])
def test_stochastic_rounding_unbiased(spec):
    """Mean of N decodes converges to x.

    Each decode's error at an element lies in an interval of width 2b (b = the element's stochastic
    error bound) and has mean 0, so by Hoeffding P(|mean of N| >= c b) <= 2 exp(-N c^2 / 2).
    N = 200, c = 0.4: 2 exp(-16) = 2.3e-7 per element; over 5 specs x 640 elements the chance of a
    false failure is below 1e-3 (and the seeds are fixed, so the outcome is deterministic).
    """
    codec = get_codec(spec)
    x = torch.randn(8, 80, generator=torch.Generator().manual_seed(3))
    x[:, 5] *= 30
    b = codec.error_bound(x)
    N = 200
    acc = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(N):
        acc += codec.decode(codec.encode(x), x.shape, x.dtype).double()
    mean_err = (acc / N - x.double()).abs()
    assert bool((mean_err <= 0.4 * b.double() + 1e-12).all()), float((mean_err / b).max())
    # averaging removes the rounding error, which nearest rounding (deterministic) keeps
    near = get_codec(spec.replace("rounding=stochastic", "rounding=nearest"))
    y = near.decode(near.encode(x), x.shape, x.dtype)
    assert float(mean_err.mean()) < 0.5 * float((y - x).abs().mean())


def test_stochastic_rounding_reproducible():
    x = torch.randn(8, 64)
    a, b = get_codec("tahquant:rounding=stochastic,seed=7"), get_codec("tahquant:rounding=stochastic,seed=7")
    pa = [a.encode(x) for _ in range(3)]
    pb = [b.encode(x) for _ in range(3)]
    assert all(torch.equal(u, v) for u, v in zip(pa, pb))
    assert not torch.equal(pa[0], pa[1])
    c = get_codec("tahquant:rounding=stochastic,seed=8")
    assert not torch.equal(c.encode(x), pa[0])


@pytest.mark.parametrize("spec", ["int3", "tahquant", "tahquant:layout=ref,tile=16", "perchannel",
                                  "int4:tile=5,layout=log6"])
def test_payload_does_not_depend_on_chunking(spec, monkeypatch):
    """The payload format is chunk-free: tiny processing chunks give the same bytes (as on GPUs,
    which use one chunk)."""
    codec = get_codec(spec)
    x = torch.randn(3, 100, 70)
    x[..., 9] *= 50
    whole = codec.encode(x)
    monkeypatch.setattr(tiles_mod, "CHUNK_ELEMS", 64)
    monkeypatch.setattr(tiles_mod, "ANCHOR_ELEMS", 1 << 16)
    assert torch.equal(codec.encode(x), whole)
    y = codec.decode(whole, x.shape, x.dtype)
    monkeypatch.undo()
    assert torch.equal(codec.decode(whole, x.shape, x.dtype), y)


def test_deterministic_and_non_contiguous_input():
    x = torch.randn(16, 96).t()  # non-contiguous (96, 16)
    for spec in ["int4", "tahquant:tile=8", "perchannel"]:
        codec = get_codec(spec)
        assert torch.equal(codec.encode(x), codec.encode(x.contiguous()))
        _check(codec, x)


# ------------------------------------------------------------------------------ TAH-Quant internals
def _tah_sections(codec, x):
    p = codec.encode(x)
    g = codec.geometry(x.shape)
    return p, g, codec.sections(g)


def test_tahquant_allocation_is_entropy_top_k():
    codec = get_codec("tahquant:tile=16,ratio=0.7,alloc=entropy")
    x = torch.randn(6, 7, 100, generator=torch.Generator().manual_seed(5))
    x[..., :40] *= torch.rand(6, 7, 40) ** 4  # vary the entropy between tiles
    p, g, sec = _tah_sections(codec, x)
    alloc = sec.get(p, "alloc", 0, g.n_tiles).view(g.rows, g.tiles).bool()
    k = round_count(0.7, g.tiles)
    assert bool((alloc.sum(1) == k).all())
    a = torch.nn.functional.pad(x.reshape(g.rows, 100).abs().double(), (0, g.padded - 100)).view(g.rows, g.tiles, 16)
    pr = a / a.sum(-1, keepdim=True)
    h = -(pr * torch.log(pr.clamp_min(1e-300))).sum(-1)
    assert torch.allclose(entropy_(a.float()).double(), h, atol=1e-5)
    ref = torch.zeros_like(alloc).scatter_(1, h.topk(k, 1).indices, True)
    assert torch.equal(alloc, ref)


def test_tahquant_token_allocation():
    codec = get_codec("tahquant:unit=token,ratio=0.25,alloc=entropy")
    x = torch.randn(3, 8, 64)
    x[1, 2] = 0.0
    x[1, 2, 0] = 5.0  # a token with entropy 0 never gets the high width
    p, g, sec = _tah_sections(codec, x)
    alloc = sec.get(p, "alloc", 0, g.rows).view(3, 8).bool()
    assert bool((alloc.sum(1) == round_count(0.25, 8)).all())
    assert not bool(alloc[1, 2])


def test_tahquant_allocation_is_range_top_k():
    """The default allocation: in each token the k tiles of largest range as quantized (a rotated
    tile's range after its rotation) get the high width; with unit=token, the k tokens whose widest
    tile is widest."""
    G = 16
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 7, 8 * G, generator=g)
    x.view(6, 7, 8, G).mul_(torch.rand(6, 7, 8, 1, generator=g) * 4 + 0.1)  # tile ranges differ
    x.view(6, 7, 8, G)[:, :, 2] *= 0.05
    x.view(6, 7, 8, G)[:, :, 2, 5] = 300.0  # one outlier: widest before the rotation, narrow after it
    codec = get_codec(f"tahquant:tile={G},ratio=0.5")
    p, geo, sec = _tah_sections(codec, x)
    alloc = sec.get(p, "alloc", 0, geo.n_tiles).view(geo.rows, 8).bool()
    flags = sec.get(p, "rotflag", 0, geo.n_tiles).view(geo.rows, 8).bool()
    assert bool(flags[:, 2].all())
    t = x.reshape(geo.rows, 8, G).clone()
    rot = t[flags]  # every rotated tile (some N(0,1) tiles qualify too), pivot = first largest magnitude
    t[flags] = hadamard_transform(pivot_swap(rot, rot.abs().argmax(-1)))
    rng = t.amax(-1) - t.amin(-1)
    k = round_count(0.5, 8)
    ref = torch.zeros_like(alloc).scatter_(1, rng.topk(k, 1).indices, True)
    assert torch.equal(alloc, ref)
    assert not bool(alloc[:, 2].any())  # the rotated tile's range is now the smallest
    codec = get_codec(f"tahquant:tile={G},ratio=0.25,unit=token,tau=inf")
    p, geo, sec = _tah_sections(codec, x)
    tok = sec.get(p, "alloc", 0, geo.rows).view(6, 7).bool()
    widest = (x.view(6, 7, 8, G).amax(-1) - x.view(6, 7, 8, G).amin(-1)).amax(-1)
    ref = torch.zeros_like(tok).scatter_(1, widest.topk(round_count(0.25, 7), 1).indices, True)
    assert torch.equal(tok, ref)


def test_tahquant_range_allocation_beats_entropy_on_uneven_tiles():
    """Tiles of different scales (tokens and channel groups of LLM activations): giving the high width
    to the widest tiles lowers the error at the same payload size; on N(0,1) it loses nothing."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(8, 64, 512, generator=g)
    uneven = x * torch.exp(torch.randn(8, 64, 16, 1, generator=g) * 0.5).repeat_interleave(32, 2).view(8, 64, 512)

    def err(spec, v):
        c = get_codec(spec)
        p = c.encode(v)
        return p.numel(), float(((c.decode(p, v.shape, v.dtype) - v) ** 2).sum() / (v ** 2).sum())

    for v, margin in ((uneven, 0.85), (x, 1.0)):
        (nr, er), (ne, ee) = err("tahquant:ratio=0.8", v), err("tahquant:ratio=0.8,alloc=entropy", v)
        assert nr == ne
        assert er < margin * ee


@pytest.mark.parametrize("cap", [1.0, 0.25])
def test_tahquant_rotation_flags_and_pivots(cap):
    G = 16
    codec = get_codec(f"tahquant:tile={G},tau=2,max_rotated={cap},slots=token")
    x = torch.randn(20, 8 * G, generator=torch.Generator().manual_seed(2))
    x.view(20, 8, G)[:, :, 3] *= torch.linspace(0.5, 6, 8)  # ratio r grows along the tiles
    p, g, sec = _tah_sections(codec, x)
    flags = sec.get(p, "rotflag", 0, g.n_tiles).view(20, 8).bool()
    t = x.view(20, 8, G).abs()
    top2 = t.topk(2, -1).values
    r = top2[..., 0] / top2[..., 1]
    m = codec.slot_count(g)
    if cap == 1.0:
        assert torch.equal(flags, r > 2)
    else:
        assert m == 2 and bool((flags.sum(1) <= m).all())
        score = torch.where(r > 2, r, torch.zeros_like(r))
        ref = torch.zeros_like(flags).scatter_(1, score.topk(m, 1).indices, True) & (r > 2)
        assert torch.equal(flags, ref)
    slots = sec.get(p, "pivot", 0, 20 * m).view(20, m).long()
    piv = t.argmax(-1)
    for row in range(20):
        want = piv[row][flags[row]].tolist()
        assert slots[row, : len(want)].tolist() == want
        assert slots[row, len(want):].tolist() == [0] * (m - len(want))


def test_tahquant_rotation_helps_outliers():
    x = torch.distributions.StudentT(4.0).sample((32, 64, 512))
    x[..., [7, 100, 333]] *= torch.tensor([25.0, 60.0, 100.0])
    def nmse(spec):
        c = get_codec(spec)
        y = c.decode(c.encode(x), x.shape, x.dtype)
        return float(((y - x) ** 2).sum() / (x ** 2).sum())
    tah, norot, int4 = nmse("tahquant"), nmse("tahquant:rotate=false"), nmse("int4")
    assert tah < 0.5 * norot
    assert tah < int4  # and int4 spends more bits (4.5 vs 4.35 per element)


def test_tahquant_partial_tiles_and_ranks():
    for shape in [(5, 33), (2, 3, 4, 100), (7,), ()]:
        x = torch.randn(shape)
        _check(get_codec("tahquant"), x)
        _check(get_codec("tahquant:unit=token,tile=8"), x)


# ------------------------------------------------------------------------------ Hadamard and pivot swap
@pytest.mark.parametrize("n", [1, 2, 4, 8, 32, 64, 128])
def test_hadamard_inverts_and_matches_matrix(n):
    x = torch.randn(50, n, dtype=torch.float64)
    h = hadamard_matrix(n, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(hadamard_transform(x), x @ h.T, atol=1e-12)
    assert torch.allclose(hadamard_transform(hadamard_transform(x)), x, atol=1e-12)
    xf = x.float()
    assert torch.allclose(hadamard_transform(hadamard_transform(xf)), xf, atol=1e-5)


def test_pivot_swap_and_rotation_invert():
    x = torch.randn(40, 32)
    p = torch.randint(0, 32, (40,))
    assert torch.equal(pivot_swap(pivot_swap(x, p), p), x)
    y = hadamard_transform(pivot_swap(x, p))
    back = pivot_swap(hadamard_transform(y), p)
    assert torch.allclose(back, x, atol=1e-5)
    # the pivot moved to position 0 adds the same value to every output (column 0 is all ones)
    e = torch.zeros(1, 32)
    e[0, 11] = 8.0
    r = hadamard_transform(pivot_swap(e, torch.tensor([11])))
    assert torch.allclose(r, torch.full_like(r, 8.0 / math.sqrt(32)))


# ------------------------------------------------------------------------------ specs and errors
def test_aliases_and_inf_round_trip():
    assert get_codec("int4") == get_codec("int:bits=4")
    assert get_codec("perchannel6") == get_codec("perchannel")
    assert get_codec("int4:tile=64").tile == 64
    c = get_codec("tahquant:tau=inf")
    assert math.isinf(c.tau) and "tau=inf" in c.spec()
    assert get_codec(c.spec()) == c
    assert get_codec("tahquant", tile=64, ratio=0.5) == get_codec("tahquant:tile=64,ratio=0.5")


@pytest.mark.parametrize("spec,match", [
    ("tahquant:tile=48", "power of two"),
    ("tahquant:tile=1", r"tile=1 must lie in"),
    ("tahquant:low_bits=5", "low_bits <= high_bits"),
    ("tahquant:ratio=1.5", r"ratio=1.5 must lie in \[0.0, 1.0\]"),
    ("tahquant:tau=-1", "tau"),
    ("tahquant:tau=nan", "cannot be NaN"),
    ("tahquant:unit=seq", "must be one of"),
    ("tahquant:max_rotated=0", "max_rotated"),
    ("tahquant:rounding=up", "nearest"),
    ("tahquant:rotate=maybe", "not a valid bool"),
    ("int4:layout=fp8", r"must be one of \['ref', 'log', 'log6', 'log7'\]"),
    ("int9", "Did you mean"),
    ("int:bits=9", r"bits=9 must lie in \[2, 8\]"),
    ("int4:tile", "not key=value"),
    ("int4:tile=0", "tile"),
    ("int4:tiles=32", "valid parameters: bits, tile"),
    ("perchannel:layout=log", "must be one of"),
    ("perchannel:bits=1", "bits"),
])
def test_bad_specs(spec, match):
    with pytest.raises(CodecError, match=match):
        get_codec(spec)


def test_bad_inputs():
    codec = get_codec("tahquant")
    x = torch.randn(4, 64)
    p = codec.encode(x)
    with pytest.raises(CodecError, match="disagree"):
        codec.decode(p[:-1], x.shape, x.dtype)
    with pytest.raises(CodecError, match="disagree"):
        get_codec("tahquant:high_bits=5").decode(p, x.shape, x.dtype)
    with pytest.raises(CodecError, match="float32, float16 or bfloat16"):
        codec.encode(torch.arange(10))
    with pytest.raises(CodecError, match="1-D uint8"):
        codec.decode(p.float(), x.shape, x.dtype)
    with pytest.raises(CodecError, match="dtype must be a torch.dtype .*, got str 'float32'"):  # not "got float32"
        codec.payload_nbytes(x.shape, "float32")
    with pytest.raises(CodecError, match="rotate=false"):
        get_codec("tahquant:tile=24")
    assert get_codec("tahquant:tile=24,rotate=false").tile == 24


def test_a_pinned_spec_builds_the_same_codec_and_a_pin_without_newer_parameters_their_legacy_one() -> None:
    for spec in ("tahquant", "perchannel6", "blockwise8:block=256", "fp8", "int4:layout=log7,fit=mse", "fp32",
                 "aqsgd:inner=int4", "auto"):
        pin = pin_spec(spec)
        assert pin is not None and get_codec(pin).spec() == pin == pin_spec(get_codec(spec).spec()), spec
        assert get_codec(pin).spec() == get_codec(spec).spec() or get_codec(spec).nested, spec  # (nested: pinned)
        assert unpin_spec(pin) == pin, spec
    assert pin_spec("perchannel6") == "perchannel:bits=6,rounding=nearest,seed=0,layout=ref"
    for spec in ("torch-fp16", "fp8:group=auto", "nosuch", ""):  # a DDP hook, TACO's reshaping, no codec
        assert pin_spec(spec) is None, spec
    # a pin written before fit, fit_rotated and zero_width existed: the codec of that time, not today's default
    old = ",".join(p for p in pin_spec("tahquant:layout=log7").split(",")
                   if not p.startswith(("fit=", "fit_rotated=", "zero_width=")))
    back = get_codec(unpin_spec(old))
    assert (back.config["fit"], back.config["fit_rotated"], back.config["zero_width"]) == ("minmax", False, "fixed")
    assert get_codec(old).config["fit"] == "mse"  # (what the short spec builds now)
    with pytest.raises(CodecError, match="nosuch"):
        unpin_spec("tahquant:nosuch=1")
    with pytest.raises(CodecError, match="unknown codec 'gone'"):
        unpin_spec("gone:bits=3")


def test_codecs_named_inside_a_codec_are_pinned_with_it() -> None:
    """aqsgd's inner and warmup codecs and auto's candidates are pinned too (options joined by ';'): a pin whose
    nested tahquant lacks the parameters added since builds that codec of its time, not today's default; a pin
    of the format before (nested codecs as written, nested=False) keeps them as written; a bare auto on a
    collective option pins the candidates of that dimension."""
    from qwire.config import TrainConfig, codec_pins, with_pinned_codecs

    full = pin_spec("tahquant:layout=log7")
    for spec, key in (("aqsgd:inner=tahquant:layout=log7", "inner"), ("auto:candidates=fp32+tahquant:layout=log7",
                                                                      "candidates")):
        pin = pin_spec(spec)
        assert full.replace(",", ";").split(":", 1)[1] in pin and unpin_spec(pin) == pin, pin
        assert pin_spec(spec, nested=False) == get_codec(spec).spec()  # the format before: as written
        old = ";".join(p for p in pin.split(";") if not p.startswith(("fit=", "fit_rotated=", "zero_width=")))
        back = get_codec(unpin_spec(old))
        inner = back.inner_codec if key == "inner" else back.choices[-1]
        assert (inner.config["fit"], inner.config["fit_rotated"], inner.config["zero_width"]) == (
            "minmax", False, "fixed"), old
        assert unpin_spec(get_codec(spec).spec(), nested=False) == get_codec(spec).spec()
    assert get_codec("auto:candidates=fp16+fp8:format=e5m2;group=64").choices[-1].spec() == get_codec(
        "fp8:format=e5m2,group=64").spec()  # a candidate's options joined by ';'
    for bad in ("aqsgd:inner=int4;layout=log7", "auto:candidates=fp32+fp8;format=e5m2"):  # the ':' forgotten
        with pytest.raises(CodecError, match=r"follow a ':' and are joined by ';', e\.g\. (int4|fp8):"):
            get_codec(bad)
    cfg = TrainConfig(stages=2, dp=2, dp_codec="auto", fwd_codec="aqsgd:inner=int8", bwd_codec="auto")
    pins = codec_pins(cfg)
    assert "candidates=fp32+fp16+blockwise:bits=8;block=256" in pins["dp_codec"], pins  # DP's, not the pipeline's
    assert "candidates=fp32+fp16+int:bits=8;" in pins["bwd_codec"] and pins["nested"] == "pinned", pins
    assert with_pinned_codecs(cfg, pins) == (cfg, [])
    # a nested codec pinned otherwise than this version builds it: the run's, with a note naming it
    changed = {**pins, "fwd_codec": pins["fwd_codec"].replace("bits=8", "bits=6")}
    got, notes = with_pinned_codecs(cfg, changed)
    assert get_codec(got.fwd_codec).inner_codec.bits == 6 and len(notes) == 1 and "inner=" in notes[0], notes
    # the format before: nested codecs as written, a collective's auto pinned with the pipeline's candidates
    before = {"fwd_codec": pin_spec("aqsgd:inner=int8", nested=False), "dp_codec": get_codec("auto").spec(),
              "bwd_codec": get_codec("auto").spec()}
    assert with_pinned_codecs(cfg, before) == (cfg, [])
