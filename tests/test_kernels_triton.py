"""The Triton codec kernels (the ``triton`` backend) write the torch reference's payloads.

Without a GPU they run on CPU tensors under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` where torch sees no CUDA device); on a GPU machine the same comparisons run on
CUDA tensors in tests/test_cuda.py. Skipped where triton is not installed.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (scripts/setup.sh installs it on Linux x86-64)")
tl = triton.language

from qwire.codecs import CodecError, NonFiniteError, get_codec, kernels  # noqa: E402
from qwire.codecs.kernels.counting import DeviceWork  # noqa: E402
from qwire.codecs.kernels.gpu import _refine  # noqa: E402
from qwire.codecs.kernels.gpu._common import from_fp8_bits  # noqa: E402
from qwire.codecs.layouts import LogLayout  # noqa: E402
from qwire.codecs.synthetic import llm_like  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (Triton's interpreter)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SPECS = [
    "int4", "int8", "int2", "int3:layout=ref", "int4:symmetric=true", "int6:layout=log6", "int5:tile=48",
    "int4:tile=64,layout=ref,symmetric=true", "int4:tile=20",
    "blockwise8", "blockwise4", "blockwise:bits=3,block=100", "fp4", "blockfp:bits=6,block=64", "blockfp:bits=8",
    "fp8", "fp8:format=e5m2", "fp8:hadamard=false", "fp8:group=32", "fp8:group=512", "fp8plain",
    "fp8plain:format=e5m2,group=64", "perchannel6", "perchannel4:layout=fp32", "perchannel8",
    "int4:layout=log7,fit=mse", "int3:fit=mse", "int4:symmetric=true,layout=log6,fit=mse", "fp16",
]
SHAPES = [(2, 16, 128), (5, 100), (3, 7, 33), (1,)]


def _pair(spec: str):
    sep = "," if ":" in spec else ":"
    return get_codec(spec + sep + "impl=triton"), get_codec(spec + sep + "impl=torch")


def _input(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    if x.shape[-1] > 7:
        x[..., 7] *= 40  # an outlier channel
    return x.to(dtype)


def _same(spec: str, x: torch.Tensor) -> None:
    tri, ref = _pair(spec)
    p_ref = ref.encode(x)
    p_tri = tri.encode(x.to(DEVICE))
    assert p_tri.device.type == DEVICE and p_tri.numel() == p_ref.numel()
    diff = (p_tri.cpu() != p_ref).nonzero()
    assert diff.numel() == 0, f"{spec}: {diff.numel()} payload bytes differ, first at {diff[:4].flatten().tolist()}"
    y_tri = tri.decode(p_tri, x.shape, x.dtype)
    assert y_tri.device.type == DEVICE and y_tri.dtype == x.dtype
    torch.testing.assert_close(y_tri.cpu(), ref.decode(p_ref, x.shape, x.dtype), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_same_payload_and_values_as_the_reference(spec, shape):
    _same(spec, _input(shape))


@pytest.mark.parametrize("spec", ["int4:fit=mse,tile=48", "int3:fit=mse,tile=24", "int8:fit=mse,tile=8"])
@pytest.mark.parametrize("shape", [(3, 7, 96), (2, 144 * 4)], ids=str)
def test_the_search_packs_tiles_of_any_multiple_of_8(spec, shape):
    """Rows of whole tiles: the search's kernel packs the codes, in steps of whole tiles whose code groups are
    rounded up to a power of two (6 and 3 groups a tile here)."""
    _same(spec, _input(shape, seed=11))


@pytest.mark.parametrize("spec", ["int4", "int4:layout=log7,fit=mse", "blockwise4", "fp8", "fp8plain", "fp4",
                                  "perchannel6", "tahquant", "fp16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(spec, dtype):
    """The kernels read half-precision input as it is (no fp32 copy first) and widen each value exactly."""
    _same(spec, _input((4, 96), dtype, seed=1))


@pytest.mark.parametrize("spec", ["int4", "int3:layout=ref", "fp8", "blockwise8", "perchannel6:layout=fp32"])
def test_llm_like_activations_with_massive_outliers(spec):
    x, _ = llm_like((2, 64, 512), magnitude=3000.0, seed=2)
    _same(spec, x)


@pytest.mark.parametrize("spec", ["int4", "fp8", "fp8plain", "blockwise8", "fp4"])
def test_special_values(spec):
    x = torch.zeros(4, 64)
    x[1] = -0.0
    x[2, :5] = torch.tensor([1e-30, -1e-38, 3e-45, 1e-7, -2e-6])  # subnormal and tiny values
    x[3] = torch.linspace(-1, 1, 64)
    _same(spec, x)


@pytest.mark.parametrize("spec", ["fp8plain:group=32", "fp8plain:format=e5m2,group=32", "fp8:hadamard=false,group=32",
                                  "fp8:format=e5m2,group=32"])
def test_every_fp8_code_decodes_as_the_reference(spec):
    """All 256 codes of a format, the NaN and Inf codes no encoder writes included (they decode as 0), through
    the decode kernel's arithmetic on the bits and the reference's table."""
    tri, ref = _pair(spec)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ng = 256 // 32
    scales = [torch.full((ng,), 0.5), torch.full((ng,), 3.0)]  # (alpha and) s per group
    if spec.startswith("fp8plain"):
        scales = scales[1:]
    payload = torch.cat([codes] + [v.view(torch.uint8) for v in scales])
    want = ref.decode(payload, (256,), torch.float32)
    got = tri.decode(payload.to(DEVICE), (256,), torch.float32).cpu()
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (torch.signbit(got) == torch.signbit(want)).all()


@triton.jit
def _fp8_values(Q, OUT, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFT: tl.constexpr):
    r = tl.arange(0, 256)
    tl.store(OUT + r, from_fp8_bits(tl.load(Q + r), MBITS, BIAS, SOFT))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("soft", [False, True], ids=["cast", "bits"])
def test_both_fp8_decodes_give_every_codes_value(fmt, soft):
    """The decode's two ways to an FP8 code's value, Triton's cast (a GPU from sm_89 on; exact under the
    interpreter too) and the arithmetic on the bits (older GPUs, the interpreter), for all 256 codes."""
    from qwire.codecs.fp8 import FORMATS, _lut

    f = FORMATS[fmt]
    if not soft and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU has no FP8 conversion (before sm_89)")
    out = torch.empty(256, device=DEVICE)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    _fp8_values[(1,)](codes, out, MBITS=f.mantissa_bits, BIAS=(1 << (6 - f.mantissa_bits)) - 1, SOFT=soft)
    want = _lut(f, "cpu")
    assert torch.equal(out.cpu(), want) and torch.equal(torch.signbit(out.cpu()), torch.signbit(want))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_fp8_rounding_boundary_encodes_as_torchs_cast(fmt):
    """Each finite FP8 value, each midpoint between neighbours (a tie, rounded to the even code), and the fp32
    values on either side of each midpoint, both signs, subnormals and -0 included, through ``fp8plain``'s encode
    with a scale of exactly 1 (every group holds the format's largest value): the codes are torch's cast, as the
    reference writes them. On a GPU this is the hardware conversion, under the interpreter the integer arithmetic."""
    from qwire.codecs.fp8 import FORMATS

    f = FORMATS[fmt]
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(f.dtype).float()
    vals = vals[torch.isfinite(vals) & (vals >= 0)].unique()  # sorted: 0, the subnormals, the normals, the largest
    mid = (vals[:-1] + vals[1:]) / 2  # exact in fp32
    near = torch.cat([vals, mid, torch.nextafter(mid, torch.tensor(0.0)), torch.nextafter(mid, torch.tensor(1e9))])
    near = torch.cat([near, -near, torch.tensor([-0.0])])
    groups = near.split(31)
    x = torch.cat([torch.cat([grp, torch.zeros(31 - grp.numel()), torch.tensor([f.max])]) for grp in groups])
    tri, ref = _pair(f"fp8plain:format={fmt},group=32")
    p_tri = tri.encode(x.to(DEVICE)).cpu()
    assert torch.equal(p_tri, ref.encode(x))
    assert torch.equal(p_tri[: x.numel()], x.to(f.dtype).view(torch.uint8))  # the scales are 1: codes are casts


@triton.jit
def _lanes_of(T, OUT, BT: tl.constexpr):
    r = tl.arange(0, BT)
    lo = tl.load(T + r[:, None] * 8 + tl.arange(0, 4)[None, :])
    hi = tl.load(T + r[:, None] * 8 + 4 + tl.arange(0, 4)[None, :])
    tl.store(OUT + r, _refine._lanes(lo * lo, hi * hi))


def test_the_mse_search_sums_its_lanes_in_the_reference_order():
    """The search kernel's tree over a tile's 8 lanes of squared errors is ``LogLayout.tile_sse``'s, bit for bit:
    on lanes of widely different magnitudes another pairing of the same additions rounds differently."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 8, generator=g) * torch.pow(10.0, torch.rand(64, 8, generator=g) * 8 - 4)
    out = torch.empty(64, device=DEVICE)
    _lanes_of[(1,)](t.to(DEVICE), out, BT=64)
    zero = torch.zeros(1, 64)
    want = LogLayout.tile_sse(t.unsqueeze(0), torch.zeros(1, 64, 8), zero, zero)[0]  # d = x: the lanes x * x
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("tile,cols", [(1, 5), (2, 7), (4, 10), (8, 8), (20, 47), (32, 96), (64, 100)])
def test_tile_statistics_keep_the_first_largest_magnitude(tile, cols):
    """``_tah_stats`` (a tile per thread, a few elements at a time) gives the reference's per-tile min, max, sum of
    squares, largest magnitude, its first position and the largest elsewhere, on small integers (many ties,
    equal magnitudes of either sign, zero rows, -0) and a short last tile, whose padding has no magnitude."""
    from qwire.codecs.kernels.gpu import tahquant as tq
    from qwire.codecs.kernels.gpu._common import cdiv, launch
    from qwire.codecs.tiles import Geometry, load_tiles

    g = torch.Generator().manual_seed(tile)
    x = torch.randint(-3, 4, (6, cols), generator=g).float()
    x[1] = 0.0
    x[2] = -0.0
    x[3, -1] = 9.0  # the largest at the last real element, before the padding
    R, T = x.shape[0], cdiv(cols, tile)
    outs = [torch.empty(R, T, device=DEVICE) for _ in range(5)]
    piv = torch.empty(R, T, dtype=torch.int64, device=DEVICE)
    gp = triton.next_power_of_2(tile)
    launch(tq._tah_stats, (cdiv(R * T, 8),), x.to(DEVICE), cols, T, tile, R * T, *outs, piv,
           torch.zeros(2, device=DEVICE), BT=8, GP=gp, WHOLE=gp == tile and cols % tile == 0)  # programs across rows
    lo, hi, sq, a1, a2 = (o.cpu() for o in outs)
    t = load_tiles(x, Geometry(R, cols, tile))
    a = t.abs()
    a[:, -1, cols - (T - 1) * tile:] = 0  # the padding's magnitudes
    first = a.argmax(dim=-1)
    assert torch.equal(lo, t.amin(dim=-1) + 0.0) and torch.equal(hi, t.amax(dim=-1) + 0.0)
    assert torch.equal(sq, t.double().square().sum(dim=-1).float())
    assert torch.equal(a1, a.amax(dim=-1)) and torch.equal(piv.cpu(), first)
    assert torch.equal(a2, a.scatter(2, first.unsqueeze(2), 0.0).amax(dim=-1))


def test_fp16_casts_round_and_refuse_overflow_as_the_reference():
    """The fp16 cast kernel: ties to even, values just below the overflow threshold, NaN and Inf kept; a finite value
    that would become Inf raises the reference's error, naming the largest such value; decoding into other dtypes."""
    one = 1.0 + 2.0 ** -11  # halfway between 1 and the next fp16: rounds to 1
    x = torch.tensor([one, 3 * 2.0 ** -11 + 1, 65519.0, -65504.0, 6e-8, -3e-8, float("nan"), float("-inf"), 0.0])
    _same("fp16", x)
    _same("fp16", x[~(x.abs() > 65000)].to(torch.bfloat16))  # in bf16, 65504 and 65519 are 65536: beyond fp16
    tri, ref = _pair("fp16")
    p = ref.encode(x)
    for dtype in (torch.bfloat16, torch.float16):
        y = tri.decode(p.to(DEVICE), x.shape, dtype).cpu()
        torch.testing.assert_close(y, ref.decode(p, x.shape, dtype), rtol=0, atol=0, equal_nan=True)
    for spec in ("bf16", "fp32"):  # their decodes into a wider dtype, or the same one
        dec, want = _pair(spec)
        q = want.encode(x)
        for dtype in (torch.float32, torch.bfloat16):
            y = dec.decode(q.to(DEVICE), x.shape, dtype).cpu()
            torch.testing.assert_close(y, want.decode(q, x.shape, dtype), rtol=0, atol=0, equal_nan=True)
    big = torch.randn(3, 1000)
    big[1, 7], big[2, 900] = 7.0e4, -9.5e4
    for c, t in ((ref, big), (tri, big.to(DEVICE))):
        with pytest.raises(CodecError, match=r"magnitude 9\.5e\+04 exceeds fp16's range"):
            c.encode(t)


def test_fp16_inputs_near_the_largest_finite_value_decode_finite():
    x = torch.full((2, 64), 65472.0, dtype=torch.float16)
    x[1] = -65504.0
    for spec in ("fp8", "fp8plain", "int4", "blockwise8", "perchannel6:layout=fp32"):
        tri, _ = _pair(spec)
        y = tri.decode(tri.encode(x.to(DEVICE)), x.shape, x.dtype)
        assert bool(torch.isfinite(y).all()), spec


SLOT = "tahquant:slots=token,ratio=0.8,layout=logx,zero_ext=8"  # the Triton kernels cover slots=token


@pytest.mark.parametrize("spec", ["int4", "fp8", "fp8plain", "blockwise8", "fp4", "perchannel6", SLOT])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_are_refused(spec, bad):
    x = _input((3, 64))
    x[1, 5] = bad
    with pytest.raises(NonFiniteError):
        get_codec(spec + (",impl=triton" if ":" in spec else ":impl=triton")).encode(x.to(DEVICE))


@pytest.mark.parametrize("spec", ["int4", "int8:layout=log7", "int4:symmetric=true", "tahquant", SLOT])
def test_a_nan_anchor_is_refused_as_a_corrupt_payload(spec):
    """The metadata read and the values' bound in one kernel (gpu/_read.py): a NaN anchor (the payload's first
    four bytes) still leads to the scan of the values and the same error as the reference's."""
    x = _input((4, 300))
    tri, ref = _pair(spec)
    p = ref.encode(x)
    assert ref.sections(ref.geometry(x.shape)).offsets["anchor"] == 0
    p[0:4] = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)  # fp32 NaN
    msgs = []
    for c, q in ((ref, p), (tri, p.to(DEVICE))):
        with pytest.raises(CodecError, match="corrupt payload") as e:
            c.decode(q, x.shape, x.dtype)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


TAH_SPECS = [s + ",slots=token" for s in [
    "tahquant:ratio=0.8,layout=logx,zero_ext=8", "tahquant:unit=token,ratio=0.8", "tahquant:layout=ref,ratio=0.8",
    "tahquant:layout=log,ratio=0.8", "tahquant:layout=log6,ratio=0.8", "tahquant:tau=0,max_rotated=1,ratio=0.8",
    "tahquant:tau=inf,ratio=0.8", "tahquant:tile=8,max_rotated=0.5,ratio=0.8", "tahquant:tile=64,ratio=0.8",
    "tahquant:ratio=1", "tahquant:ratio=0,high_bits=2,low_bits=1", "tahquant:high_bits=8,low_bits=5,tile=16,ratio=0.8",
    "tahquant:zero_ext=12,ratio=0.8", "tahquant:layout=log,zero_ext=0,max_rotated=0.25,ratio=0.8",
    "tahquant:alloc=entropy,ratio=1",
]] + ["tahquant", "tahquant:ratio=0.8", "tahquant:ratio=0.5,unit=token,high_bits=3,low_bits=2", "tahquant:tile=8",
      "tahquant:tile=64", "tahquant:tile=128", "tahquant:layout=ref", "tahquant:zero_ext=0", "tahquant:tau=0",
      "tahquant:fit=mse", "tahquant:fit=mse,ratio=0.8,slots=token,layout=logx,zero_ext=8",
      "tahquant:fit_rotated=true", "tahquant:fit_rotated=true,ratio=0.8", "tahquant:fit_rotated=true,tau=0",
      "tahquant:fit_rotated=true,zero_ext=0,tau=1.5", "tahquant:fit_rotated=true,tile=8",
      "tahquant:layout=log6t,fit_rotated=true", "tahquant:layout=log6t,zero_width=block,fit_rotated=true",
      "tahquant:layout=log6t,zero_width=block,ratio=0.8"]


@pytest.mark.parametrize("spec", TAH_SPECS)
@pytest.mark.parametrize("shape", [(2, 16, 128), (3, 5, 100), (4, 40)], ids=str)
def test_tahquant_same_payload_and_values_as_the_reference(spec, shape):
    """TAH-Quant: statistics, rotation, fit, search, code streams and the rotated tiles' blocks in Triton, some
    per-tile decisions in torch; every byte as the reference's (short last tiles included)."""
    _same(spec, _input(shape, seed=3))


@pytest.mark.parametrize("spec", [SLOT, "tahquant:unit=token,layout=log6,ratio=0.8,slots=token",
                                  "tahquant:tile=64,slots=token", "tahquant", "tahquant:ratio=0.8,tile=64",
                                  "tahquant:fit_rotated=true", "tahquant:layout=log7,adapt=predict,fit_rotated=true"])
def test_tahquant_llm_like_ties_and_half_precision(spec):
    x, _ = llm_like((2, 32, 512), massive=2, outlier_channels=3, magnitude=1e4, seed=4)
    _same(spec, x)
    g = torch.Generator().manual_seed(7)
    t = torch.randn(3, 12, 128, generator=g).round()  # equal tiles, ranges and ratios: the tie rules
    t[:, ::3] = 1.0
    t[:, 2::5, ::16] = 40.0
    _same(spec, t)
    _same(spec, _input((4, 96), torch.bfloat16, seed=5))



@pytest.fixture(params=[None, (256, 16)], ids=["steps", "small-steps"])
def zero_width_steps(request, monkeypatch):
    """The flags and the rotated tiles ``_zero_widths`` takes per step of its loops: as they are, and small, so that
    each block's list of rotated tiles is made and read over several steps."""
    if request.param is not None:
        from qwire.codecs.kernels.gpu import tahquant as gpu_tahquant

        monkeypatch.setattr(gpu_tahquant, "ZERO_WIDTH_TILES", request.param[0])
        monkeypatch.setattr(gpu_tahquant, "ZERO_WIDTH_ROTATED", request.param[1])
    return request.param


@pytest.mark.parametrize("spec", ["tahquant:layout=log6t,zero_width=block,fit_rotated=true",
                                  "tahquant:layout=log6t,zero_width=block,ratio=0.8"])
def test_tahquant_zero_width_per_block(spec, zero_width_steps):
    """``zero_width=block``: three blocks of rows that take the widths 0, 9 and 1 (each named in its anchor): the
    blocks, their search and the metadata read per block, every byte as the reference's."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3 * 64, 1024, generator=g)
    x[64:128, 100] *= 1e4 / x[64:128, 100].abs().clamp(min=1e-3)
    x[128:, 300] = 30.0 * x[128:, 300].sign()
    x[128:, 500] = 3.0 * x[128:, 500].sign() + 0.1
    _, ref = _pair(spec)
    gg, sec = ref._layout(x.shape)
    tags = (sec.get(ref.encode(x), "anchor", 0, gg.n_blocks).view(torch.int32) & 15).tolist()
    assert tags == [0, 9, 1], tags
    _same(spec, x)


def test_tahquant_zero_widths_sum_every_rotated_tile(zero_width_steps):
    """``_zero_widths`` against the reference's ``_block_widths`` and ``_block_reach`` on tiles made so that the
    choice of each block's width depends on all its rotated tiles: random steps over six decades, zero codes
    over the reach of every width, a third of the tiles rotated, in 12 blocks."""
    from qwire.codecs.kernels.gpu import tahquant as gpu_tahquant

    ref = get_codec("tahquant:layout=log6t,zero_width=block", impl="torch")
    g, _ = ref._layout((48 * 64, 256))
    R, T = g.rows, g.tiles
    gen = torch.Generator().manual_seed(3)
    flags = torch.rand(R, T, generator=gen) < 0.3
    s = torch.exp(torch.randn(R, T, generator=gen) * 3)
    span = 1 << ref.lay.zero_bits
    zc = torch.randint(0, span, (R, T), generator=gen, dtype=torch.int32).to(torch.uint8)
    reach = (1 << (torch.arange(R) // g.anchor_rows % 9)).unsqueeze(1)  # per block: high parts up to 2^(b % 9)
    ze = (torch.rand(R, T, generator=gen) * 2 * reach).to(torch.int32) - reach.to(torch.int32)
    levels = torch.where(torch.rand(R, T, generator=gen) < 0.5, 7.0, 3.0)
    k = ref._zero_codes(zc, ze)
    want = ref._block_widths(flags, s, k, levels, g, sync_free=True)
    assert len(set(want.tolist())) > 2  # the blocks choose different widths
    kmn = torch.stack([torch.full((R, T), -5.0), torch.full((R, T), 5.0)]).to(DEVICE)
    got = gpu_tahquant._zero_widths_of(ref, flags.to(DEVICE), s.to(DEVICE), zc.to(DEVICE), ze.to(DEVICE),
                                       levels.to(DEVICE), kmn, g)
    assert torch.equal(got.cpu().long(), want.long())
    wmin, wmax = ref._block_reach(ref._tile_widths(want, R, g), flags, torch.full((R, T), -5.0),
                                  torch.full((R, T), 5.0))
    assert torch.equal(kmn[0].cpu(), wmin) and torch.equal(kmn[1].cpu(), wmax)


def test_tahquant_a_width_beyond_zero_ext_is_a_corrupt_payload():
    """An anchor naming a zero extension wider than ``zero_ext``: the GPU path reads nothing back for it, decodes
    NaN instead, and its check of the values raises (corrupt payload), as the CPU path does from the tag."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))
    x[:, 3] = 1e3
    tri, ref = _pair("tahquant")
    p = ref.encode(x)
    p[0:4] = (p[0:4].clone().view(torch.int32) | 15).view(torch.uint8)  # width 15 > zero_ext = 9
    for c, q in ((ref, p), (tri, p.to(DEVICE))):
        with pytest.raises(CodecError, match="corrupt payload"):
            c.decode(q, x.shape, x.dtype)

@pytest.mark.parametrize("spec", ["tahquant", "tahquant:tile=64,zero_ext=0"])
def test_tahquant_reads_back_one_value_each_way(spec, monkeypatch):
    """With one code width, the default's GPU path waits for the GPU once per encode (the input check) and once per
    decode (the bound that decides whether the values are scanned): the rotated tiles are processed where their
    flags are set, with no list of them to size on the host."""
    from qwire.codecs import packing
    from qwire.codecs.kernels import gpu  # noqa: F401  (registers the bit packing of CUDA tensors)

    if DEVICE == "cpu":  # pack as CUDA tensors would
        monkeypatch.setitem(packing.DEVICE_KERNELS, "cpu", packing.DEVICE_KERNELS["cuda"])
    x, _ = llm_like((2, 32, 512), massive=2, outlier_channels=3, magnitude=1e3, seed=4)
    x = x.to(DEVICE)
    tri, _ = _pair(spec)
    p = tri.encode(x)
    for what, fn in (("encode", lambda: tri.encode(x)), ("decode", lambda: tri.decode(p, x.shape, x.dtype))):
        with DeviceWork() as h:
            fn()
        assert len(h.reads) == 1, f"{spec} {what} reads back {h.reads}"


def test_tahquant_entropy_allocation_runs_the_reference():
    """The paper's entropy ranking is not written in Triton: impl=triton refuses it, impl=auto runs the
    reference on CUDA tensors."""
    assert kernels.BACKENDS["triton"].load()
    assert not kernels.BACKENDS["triton"].kernels["TAHQuant"].supports(get_codec("tahquant:alloc=entropy,ratio=0.8"))
    assert kernels.BACKENDS["triton"].kernels["TAHQuant"].supports(get_codec(SLOT))
    assert kernels.BACKENDS["triton"].kernels["TAHQuant"].supports(get_codec("tahquant"))
    with pytest.raises(CodecError, match="does not cover this configuration"):
        get_codec("tahquant:alloc=entropy,ratio=0.8,impl=triton").encode(_input((2, 64)).to(DEVICE))


def test_auto_keeps_the_numba_kernels_on_cpu_tensors():
    assert kernels.implementation(get_codec("int4"), "cpu") in ("cpu", "torch")
    assert kernels.BACKENDS["triton"].device_type == "cuda"


def test_triton_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(CodecError, match="runs on cuda tensors"):
        get_codec("int4:impl=triton").encode(torch.randn(4, 32))


def test_a_failing_kernel_is_retired_once_and_the_reference_runs(monkeypatch):
    """Under impl=auto a kernel that raises anything but a CodecError (e.g. a compiler error on an untested
    GPU) is replaced by the reference, with one warning; impl=triton still raises."""
    b = kernels.BACKENDS["triton"]
    ks = b.kernels["FP8Plain"]

    def broken(codec, x):
        raise RuntimeError("compiler said no")

    monkeypatch.setitem(ks.ops, "encode", broken)
    monkeypatch.setattr(kernels, "backend_for", lambda device: b)
    monkeypatch.setattr(kernels, "_RETIRED", set())
    x = _input((4, 64)).to(DEVICE)  # on a GPU machine the Triton backend takes CUDA tensors only
    c = get_codec("fp8plain")
    with pytest.warns(RuntimeWarning, match="compiler said no"):
        p = c.encode(x)
    assert torch.equal(p, get_codec("fp8plain:impl=torch").encode(x))
    assert "encode" not in ks.ops
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(get_codec("fp8plain").encode(x), p)  # said once
    monkeypatch.setitem(ks.ops, "encode", broken)
    with pytest.raises(RuntimeError, match="compiler said no"):
        get_codec("fp8plain:impl=triton").encode(x)


def test_out_of_memory_or_a_broken_context_is_raised_not_worked_around(monkeypatch):
    """A kernel that runs out of memory, or leaves a CUDA fault behind, says nothing about the kernel:
    the error reaches the caller (the reference would fail too, less clearly) and the kernel stays."""
    x = _input((4, 64)).to(DEVICE)
    get_codec("fp8plain:impl=triton").encode(x)  # the backend's kernels are registered on first use
    b = kernels.BACKENDS["triton"]
    ks = b.kernels["FP8Plain"]
    monkeypatch.setattr(kernels, "backend_for", lambda device: b)
    monkeypatch.setattr(kernels, "_RETIRED", set())
    for err in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                RuntimeError("CUDA error: an illegal memory access was encountered")):
        def broken(codec, x, err=err):
            raise err

        monkeypatch.setitem(ks.ops, "encode", broken)
        with pytest.raises(type(err)):
            get_codec("fp8plain").encode(x)
        assert ks.ops["encode"] is broken and not kernels._RETIRED


@pytest.mark.parametrize("spec", ["int4", SLOT, "fp8", "blockwise4", "perchannel6"])
def test_a_strided_payload_decodes_like_a_contiguous_one(spec):
    x = _input((3, 40, 96)).to(DEVICE)
    c = get_codec(spec, impl="triton")
    p = c.encode(x)
    buf = torch.zeros(2 * p.numel(), dtype=torch.uint8, device=p.device)
    buf[::2] = p
    assert torch.equal(c.decode(buf[::2], x.shape, x.dtype), c.decode(p, x.shape, x.dtype))


@pytest.mark.parametrize("spec", ["int4", "int4:layout=log6", "tahquant", "perchannel6", "perchannel6:layout=fp32",
                                  "fp16", "blockwise8", "fp4"])
def test_a_payload_at_an_odd_address_decodes_like_an_aligned_one(spec):
    """The decoders read fields in place where their bytes are aligned (fp32 anchors and steps, 8-bit codes); a
    payload received into a buffer at an odd offset is read through a copy instead."""
    x = _input((3, 40, 96)).to(DEVICE)
    c = get_codec(spec, impl="triton")
    p = c.encode(x)
    buf = torch.zeros(p.numel() + 1, dtype=torch.uint8, device=p.device)
    buf[1:] = p
    assert buf[1:].data_ptr() % 2
    assert torch.equal(c.decode(buf[1:], x.shape, x.dtype), c.decode(p, x.shape, x.dtype))


def test_a_launch_is_recorded_as_the_jit_would_compile_it():
    """``_launches.describe``: an integer 1 becomes a constant, 16-aligned tensors and multiples of 16 are marked
    (what lets the compiler use 128-bit accesses), the interpreter-only arguments become a GPU's, and the warps
    are kept apart from the constants."""
    from qwire.codecs.kernels.gpu import _launches
    from qwire.codecs.kernels.gpu.direct import _unpack_dequant

    buf = torch.zeros(64)
    # the record reads only the arguments' types and alignment, so any will do: C gets a tensor 4 bytes in
    args = (buf.view(torch.uint8), 1, 48, 32, buf[1:], buf, buf, buf, 0.5, buf)
    rec = _launches.describe(getattr(_unpack_dequant, "fn", _unpack_dequant), args,
                             {"G": 32, "ROWS8": True, "SYM": False, "BITS": 4, "GB": 256, "EXACT64": True,
                              "num_warps": 2})
    assert rec["kernel"] == "_unpack_dequant" and rec["num_warps"] == 2
    assert rec["constexprs"]["off"] == 1 and "off" not in rec["signature"]  # 1 is specialized
    assert rec["constexprs"]["EXACT64"] is False and "num_warps" not in rec["constexprs"]
    assert rec["signature"]["P"] == "*u8" and rec["signature"]["nbytes"] == "i32"
    assert {"P", "nbytes", "n", "Z", "S", "OUT"} <= set(rec["aligned"])  # 48 and 32: multiples of 16
    assert "C" not in rec["aligned"]  # buf[1:] starts 4 bytes in
    seen = []
    with _launches.watching(lambda fn, a, k: seen.append(fn.__name__)):
        c = get_codec("int4:impl=triton")
        c.decode(c.encode(torch.randn(4, 64)), (4, 64), torch.float32)
    assert {"_tile_stats", "_quant_pack", "_decode_log"} <= set(seen)


@pytest.mark.parametrize("spec", ["int4", "int4:fit=mse", "int6:layout=log6", "perchannel6", "blockwise8",
                                  "blockwise4", "fp8", "fp16", "tahquant", "tahquant:fit=minmax,ratio=0.8"])
def test_int64_indices_write_the_int32_indices_bytes(spec, monkeypatch):
    """The kernels index in int32 below ``INDEX_LIMIT`` elements and in int64 above it (``I64``); with the limit at
    0 every kernel takes the int64 path, which must write the same payload and values (a test cannot allocate
    2^31 elements)."""
    from qwire.codecs.kernels.gpu import _common, _launches

    c = get_codec(spec + ("," if ":" in spec else ":") + "impl=triton")
    x = _input((6, 320)).to(DEVICE)
    narrow = c.encode(x)
    widths = []
    monkeypatch.setattr(_common, "INDEX_LIMIT", 0)
    with _launches.watching(lambda fn, a, k: widths.append(k.get("I64"))):
        wide = c.encode(x)
        y = c.decode(wide, x.shape, x.dtype)
    assert True in widths and False not in widths  # every kernel that takes I64 was given True
    assert torch.equal(wide, narrow)
    monkeypatch.undo()
    assert torch.equal(y, c.decode(narrow, x.shape, x.dtype))


def test_a_codec_call_decides_the_index_width_once_and_checks_its_bound(monkeypatch):
    """Within a codec call the kernels are given int32 indices without a look at each launch's arguments, where
    the call's size (``CALL_FACTOR``) rules 2^31 out, and every launch is checked against that bound (under the
    interpreter); a call too large for the rule looks at each launch's arguments as before."""
    from qwire.codecs.kernels.gpu import _common, _launches

    widths = []
    c = get_codec("tahquant:impl=triton")
    x = _input((6, 320)).to(DEVICE)
    with _launches.watching(lambda fn, a, k: widths.append(k.get("I64"))):
        c.decode(c.encode(x), x.shape, x.dtype)
    assert len(widths) > 5 and True not in widths
    monkeypatch.setattr(_common, "CHECK_CALLS", True)
    huge = torch.zeros(1).expand(_common.INDEX_LIMIT)  # no memory behind an expanded tensor
    kernel = _common._scan_beyond

    @_common.codec_call
    def entry(codec, t, given):
        return _common.index_width(kernel, (given,), {})["I64"]

    with pytest.raises(AssertionError, match="_scan_beyond: an argument of .* beyond the codec call.s bound"):
        entry(None, torch.zeros(1000), torch.zeros(1).expand(10 ** 7))
    assert entry(None, torch.zeros(1).expand(1 << 28), huge) is True  # past the rule: the arguments decide
    assert entry(None, torch.zeros(1).expand(1 << 28), torch.zeros(4)) is False
    assert _common.index_width(kernel, (huge,), {})["I64"] is True  # outside a codec call: as before


def test_indices_are_int64_only_for_tensors_or_numbers_of_2_31_elements():
    from qwire.codecs.kernels.gpu._common import INDEX_LIMIT, wide_indices

    small = torch.zeros(4)
    assert not wide_indices((small, 7, 0.5, True))
    assert wide_indices((small, torch.zeros(1).expand(INDEX_LIMIT)))  # no memory behind an expanded tensor
    assert wide_indices((small, INDEX_LIMIT)) and wide_indices((-INDEX_LIMIT,))
    assert not wide_indices((torch.zeros(1).expand(INDEX_LIMIT - 1), INDEX_LIMIT - 1))


@pytest.mark.parametrize("spec", ["blockwise8", "fp4", "blockwise8:block=8192"])
def test_the_blockwise_kernels_refuse_a_magnitude_their_decode_would_take_for_corruption(spec):
    """As the reference: a block maximum above 2^120 is refused at encode (the kernels flag it beside NaN/Inf;
    ``block=8192`` takes the two-pass path), and one just below it is taken."""
    x = _input((2, 8192)).to(DEVICE)
    x[1, 3] = 3e38
    c, _ = _pair(spec)
    with pytest.raises(CodecError, match=r"input magnitude 3e\+38 exceeds the largest value a quantizing"):
        c.encode(x)
    x[1, 3] = 1e36
    _same(spec, x)
