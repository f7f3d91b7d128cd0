"""Triton kernels of ``int<b>`` (:mod:`qwire.codecs.direct`), nearest rounding, every layout.

Encode: one kernel computes each tile's (min, max, sum of squares); the layout's reference fit turns
them into the metadata in torch (a few operations on one value per tile); a second kernel quantizes and
bit-packs the codes. Decode: the layout's reference read of the metadata, then one kernel that unpacks
and dequantizes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...base import FP16_MAX, check_decoded, check_finite, decoded_verdict
from ...layouts import LAYOUTS, LogLayout
from ...tiles import check_magnitude, sparse_tiles, values_bound
from ..deferred import check_decoded_later, judge
from . import _refine
from ._common import (
    ELEMENT_WARPS,
    GROUPS_PER_PROGRAM,
    INTERPRET,
    cdiv,
    code_groups,
    contiguous_input,
    fma32,
    group_tiles,
    inverse,
    launch,
    load_codes,
    pack_store,
    program_start,
    register,
    rint_code,
    scan_beyond,
)
from ._fit import fit
from ._read import anchors, codes_in_place, field_view, step_and_code
from ._refine import packs, refine

STATS_TILES = 32 * ELEMENT_WARPS  # tiles per program of the statistics kernels: one per thread
MAX_TILE = 8192  # wider tiles run the torch reference


@triton.jit
def tile_block(X, C, T, G, N, BT: tl.constexpr, GP: tl.constexpr, WHOLE: tl.constexpr, I64: tl.constexpr,
               PIVOT: tl.constexpr = False):
    """Tiles ``ti`` = ``b * BT ..`` of the ``N`` (program ``b``; row-major ids: tile ``t`` of row ``r`` is
    ``r * T + t``), read a few elements at a time, a tile per thread: per tile the min and max (+0 for a signed
    zero) and the sum of squares in fp64 rounded once (the padding of a short last tile repeats the row's last
    element); with
    ``PIVOT``, on the magnitudes of the real elements (0 for the padding), the largest ``a1``, the first position
    ``piv`` holding it and the largest magnitude elsewhere ``a2`` (``a1`` again when it occurs twice). Indices are
    int64 with ``I64``, else int32. ``WHOLE``: the tiles fill ``GP`` (``G`` rounded up to a power of two) and the
    rows hold whole tiles, so every element of a tile is real. Returns ``ti``, which are tiles (``tin``),
    ``mn``, ``mx``, ``sq`` (fp32), ``a1``, ``piv``, ``a2`` (0 without ``PIVOT``)."""
    K: tl.constexpr = 4 if GP >= 4 else GP  # elements a thread reads at once (128 bits of fp32)
    ti = program_start(BT, I64) + tl.arange(0, BT)
    tin = ti < N
    r = ti // T
    t = ti - r * T
    row = X + r * C
    start = row + t * G  # each tile's first element: a pointer per thread, the chunks at constant offsets
    mn = tl.full((BT,), float("inf"), tl.float32)
    mx = tl.full((BT,), float("-inf"), tl.float32)
    sq = tl.zeros((BT,), tl.float64)
    a1 = tl.zeros((BT,), tl.float32)  # magnitudes are >= 0: a tile of zeros keeps position 0
    a2 = tl.zeros((BT,), tl.float32)
    piv = tl.zeros((BT,), tl.int32)
    if not WHOLE:
        last = tl.load(row + C - 1, mask=tin, other=0.0).to(tl.float32)
    for j0 in range(0, GP, K):
        j = j0 + tl.arange(0, K)
        if WHOLE:
            x = _columns(tl.load(start[:, None] + j[None, :], mask=tin[:, None], other=0.0).to(tl.float32))
            lo, hi, xs = x, x, x
        else:
            inb = tin[:, None] & (j[None, :] < G)
            valid = inb & (t[:, None] * G + j[None, :] < C)
            x = tl.load(start[:, None] + j[None, :], mask=valid, other=0.0).to(tl.float32)
            lo = _columns(tl.where(valid, x, float("inf")))
            hi = _columns(tl.where(valid, x, float("-inf")))
            xs = _columns(tl.where(valid, x, tl.where(inb, last[:, None], 0.0)))
            x = _columns(tl.where(valid, x, 0.0))  # the padding has no magnitude
        for i in tl.static_range(K):  # element by element, in order
            mn = tl.minimum(mn, lo[i])
            mx = tl.maximum(mx, hi[i])
            xd = xs[i].to(tl.float64)
            sq = tl.fma(xd, xd, sq)  # the square is exact in fp64: rounded once, as an addition of it
            if PIVOT:
                a1, piv, a2 = _pivot(tl.abs(x[i]), j0 + i, a1, piv, a2)
    return ti, tin, mn + 0.0, mx + 0.0, sq.to(tl.float32), a1, piv, a2


@triton.jit
def _columns(v):
    """The columns of ``v`` ``(BT, K)`` (``K`` 1, 2 or 4, in one thread), a tuple of ``(BT,)``."""
    BT: tl.constexpr = v.shape[0]
    K: tl.constexpr = v.shape[1]
    if K == 1:
        return (tl.reshape(v, (BT,)),)
    ev, od = tl.split(tl.reshape(v, (BT, K // 2, 2)))  # columns 0, 2 .. and 1, 3 ..
    if K == 2:
        return tl.reshape(ev, (BT,)), tl.reshape(od, (BT,))
    e0, e2 = tl.split(ev)
    e1, e3 = tl.split(od)
    return e0, e1, e2, e3


@triton.jit
def _pivot(a, j, a1, piv, a2):
    """The largest magnitude ``a1`` so far, its first position ``piv`` and the largest elsewhere ``a2``, after the
    magnitudes ``a`` at position ``j``."""
    up = a > a1
    return tl.where(up, a, a1), tl.where(up, j, piv), tl.where(up, a1, tl.maximum(a2, a))


@triton.jit
def check_max(CHK, m, mn, mx, sq):
    """The input checks' two numbers, as atomic maxima into ``CHK``: the largest magnitude and the largest sum
    of squares of the tiles ``m`` (a NaN counts as infinite, which a maximum would otherwise drop)."""
    a = tl.maximum(mx, -mn)
    a = tl.where(a == a, a, float("inf"))
    q = tl.where(sq == sq, sq, float("inf"))
    tl.atomic_max(CHK, tl.max(tl.where(m, a, 0.0), axis=0), sem="relaxed")
    tl.atomic_max(CHK + 1, tl.max(tl.where(m, q, 0.0), axis=0), sem="relaxed")


@triton.jit
def _tile_stats(X, C, T, G, N, LO, HI, SQ, CHK, BT: tl.constexpr, GP: tl.constexpr, WHOLE: tl.constexpr,
                I64: tl.constexpr):
    """Per tile: min, max and sum of squares (:func:`tile_block`); the input checks' maxima (:func:`check_max`)."""
    o, m, mn, mx, sq, _, _, _ = tile_block(X, C, T, G, N, BT, GP, WHOLE, I64)
    tl.store(LO + o, mn, mask=m)
    tl.store(HI + o, mx, mask=m)
    tl.store(SQ + o, sq, mask=m)
    check_max(CHK, m, mn, mx, sq)


@triton.jit
def _quant_pack(X, n, C, T, Z, S, P, off, nbytes, H, TOP, G: tl.constexpr, ROWS8: tl.constexpr,
                SYM: tl.constexpr, BITS: tl.constexpr, GB: tl.constexpr, EXACT64: tl.constexpr,
                INV: tl.constexpr, I64: tl.constexpr):
    """Codes of elements ``8 * gid ..`` (row-major), packed: ``round((x - z) / s)`` computed as
    ``fma(x, 1/s, -z/s)`` (symmetric: ``fma(x, 1/s, h)``), clamped to [0, TOP]; a step of 0 gives the bias.
    Element ``(r, c)`` takes the step ``S[r * T + c // G]`` (:func:`group_tiles`); with ``INV``, ``S`` holds
    ``1/s`` already (0 for a step of 0), as the division here makes it."""
    gid, i, m = code_groups(n, GB, I64)
    x = tl.load(X + i, mask=m, other=0.0).to(tl.float32)
    ti, tm = group_tiles(gid, i, m, n, C, T, G, ROWS8)
    if INV:
        inv = tl.load(S + ti, mask=tm, other=0.0)
    else:
        inv = inverse(tl.load(S + ti, mask=tm, other=0.0))
    if SYM:
        bias = tl.full(inv.shape, H, tl.float32)
    else:
        z = tl.load(Z + ti, mask=tm, other=0.0)
        bias = -(z * inv)
    v = fma32(x, inv, bias, EXACT64)
    v = tl.minimum(tl.maximum(v, 0.0), TOP)
    q = tl.where(m, rint_code(v), 0)
    if BITS == 8:
        tl.store(P + off + i, q.to(tl.uint8), mask=m)
    else:
        pack_store(q, gid, P, off, nbytes, BITS)


@triton.jit
def _unpack_dequant(P, off, nbytes, n, C, T, Z, S, H, OUT, G: tl.constexpr, ROWS8: tl.constexpr,
                    SYM: tl.constexpr, BITS: tl.constexpr, GB: tl.constexpr, EXACT64: tl.constexpr,
                    I64: tl.constexpr):
    """fp32 values ``z + q * s`` (symmetric: ``(-h * s) + q * s``, one fused multiply-add) of the packed codes."""
    gid, i, m = code_groups(n, GB, I64)
    q = load_codes(P, off, gid, i, m, nbytes, BITS)
    ti, tm = group_tiles(gid, i, m, n, C, T, G, ROWS8)
    s = tl.load(S + ti, mask=tm, other=0.0)
    if SYM:
        zz = -H * s
    else:
        zz = tl.load(Z + ti, mask=tm, other=0.0)
    tl.store(OUT + i, fma32(q.to(tl.float32), s, zz, EXACT64), mask=m)


@triton.jit
def _decode_log(P, off, nbytes, n, C, T, COD, COFF, KCOD, KOFF, A, TAB, LVC, TA, KMIN, UNIT_F, H, OUT, BM,
                G: tl.constexpr, ROWS8: tl.constexpr, SYM: tl.constexpr, BITS: tl.constexpr, GB: tl.constexpr,
                EXACT64: tl.constexpr, CB: tl.constexpr, KB: tl.constexpr, I64: tl.constexpr):
    """A ``log`` layout's read (``_read``) and :func:`_unpack_dequant` in one pass: each code group's tile's step and
    zero from its codes in the payload (``CB``-bit step codes at byte ``COFF`` of ``COD``, ``KB``-bit zero codes at
    ``KOFF`` of ``KCOD``) and its block's anchor ``A``, ``LVC`` levels for every tile; the values into ``OUT``; and,
    as atomic maxima of their fp32 bits (which order as the magnitudes do, NaN above Inf), the values' bound
    ``max |z| + levels |s|`` (NaN counts as Inf) into ``BM[0]`` and the values' largest magnitude into ``BM[1]``:
    the decode check's two numbers, with nothing to scan later."""
    gid, i, m = code_groups(n, GB, I64)
    q = load_codes(P, off, gid, i, m, nbytes, BITS)
    ti, tm = group_tiles(gid, i, m, n, C, T, G, ROWS8)
    s, k = step_and_code(A, TAB, COD, COFF, KCOD, KOFF, ti, tm, TA, KMIN, SYM, CB, KB)
    if SYM:
        z = tl.zeros_like(s)
        zz = -H * s
    else:
        u = tl.full(s.shape, LVC + 1.0, tl.float32) * UNIT_F
        z = (k * u) * s
        zz = z
    v = fma32(q.to(tl.float32), s, zz, EXACT64)
    tl.store(OUT + i, v, mask=m)
    b = tl.abs(z) + tl.abs(s) * tl.full(s.shape, LVC, tl.float32)
    b = tl.where(b == b, b, float("inf")).to(tl.int32, bitcast=True)
    tl.atomic_max(BM, tl.max(tl.max(tl.where(tm, b, 0), axis=1), axis=0), sem="relaxed")
    av = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |v|'s bits, a NaN's sign cleared too (abs may keep it)
    tl.atomic_max(BM + 1, tl.max(tl.max(tl.where(m, av, 0), axis=1), axis=0), sem="relaxed")


def decode_log(lay, sec, payload: torch.Tensor, g, symmetric: bool, levels: int, bits: int,
               into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values (flat) of an ``int<b>`` payload in a ``log`` layout (``levels`` for every tile), in one kernel
    (:func:`_decode_log`), and the decode check's bound and largest magnitude (int32 ``(2,)``, the bits of two
    fp32). ``into`` as in :func:`unpack_dequant`."""
    n, nt = g.rows * g.cols, g.rows * g.tiles
    dev = payload.device
    c = codes_in_place(sec, payload, "scale", nt)
    k = codes_in_place(sec, payload, "zero", nt) if not symmetric else c
    vals = torch.empty(n, device=dev) if into is None else into.view(-1)
    bm = torch.zeros(2, dtype=torch.int32, device=dev)
    launch(_decode_log, (cdiv(cdiv(n, 8), GROUPS_PER_PROGRAM),), payload, sec.offsets["codes"], (n * bits + 7) // 8,
           n, g.cols, g.tiles, c[0], c[1], k[0], k[1], anchors(lay, sec, payload, g), lay.read_table(dev),
           float(levels), g.tiles * g.anchor_rows, float(lay.kmin), float(lay.unit(0)), float(levels // 2), vals, bm,
           G=g.tile, ROWS8=g.cols % 8 == 0, SYM=symmetric, BITS=bits, GB=GROUPS_PER_PROGRAM, EXACT64=INTERPRET,
           CB=c[2], KB=k[2], num_warps=ELEMENT_WARPS)
    return vals, bm


def stats_tiles(n: int) -> int:
    """Tiles per program of the statistics kernels for ``n`` tiles: ``STATS_TILES`` (a tile per thread) on a GPU;
    under the interpreter, few large programs (each runs the kernel's Python once), as many tiles as the search's
    kernel takes (``_refine.INTERPRETER_TILES``, which ``scripts/compile_for_gpu.py --issue`` sets to a GPU's)."""
    if not INTERPRET:
        return STATS_TILES
    return triton.next_power_of_2(max(STATS_TILES, min(n, _refine.INTERPRETER_TILES)))


def tile_stats(X: torch.Tensor, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tile (min, max, sum of squares) ``(R, T)`` of the flat ``X`` of geometry ``g``, and the input checks'
    maxima (for :func:`checks`)."""
    lo = torch.empty(g.rows, g.tiles, device=X.device)
    hi, sq = torch.empty_like(lo), torch.empty_like(lo)
    chk = torch.zeros(2, device=X.device)
    gp = triton.next_power_of_2(g.tile)
    n, bt = g.rows * g.tiles, stats_tiles(g.rows * g.tiles)
    launch(_tile_stats, (cdiv(n, bt),), X, g.cols, g.tiles, g.tile, n, lo, hi, sq, chk, BT=bt, GP=gp,
           WHOLE=gp == g.tile and g.cols % g.tile == 0, num_warps=ELEMENT_WARPS)
    return lo, hi, sq, chk


def checks(x: torch.Tensor, chk: torch.Tensor, name: str) -> None:
    """The codecs' input checks from the statistics kernels' maxima ``chk`` (largest magnitude, largest sum of
    squares; NaN/Inf propagate into the sums of squares): one host sync, now or deferred
    (:mod:`qwire.codecs.kernels.deferred`)."""

    def verdict(v: list) -> None:
        m, q = v
        if not math.isfinite(q):
            check_finite(x, name)
        check_magnitude(x, m, name)

    judge(chk, verdict)


def decoded(vals: torch.Tensor, bound: torch.Tensor | float, scale: float, name: str) -> None:
    """The decoders' check of their values, given the bound ``scale * bound`` (on the device, or a number)."""
    if isinstance(bound, torch.Tensor):
        check_decoded_later(vals, bound, name, scale=scale, scan=scan_beyond)
    else:
        check_decoded(vals, bound * scale, name)


def quant_pack(X: torch.Tensor, g, z: torch.Tensor | None, s: torch.Tensor, payload: torch.Tensor, off: int,
               bits: int, levels: int, symmetric: bool, per_channel: bool = False,
               inv_steps: torch.Tensor | None = None) -> None:
    """Codes of the flat fp32 ``X`` (geometry ``g``) packed into ``payload`` from byte ``off``; ``z``, ``s``
    per tile ``(R, T)``, or per channel ``(C,)`` when ``per_channel`` (symmetric only). ``inv_steps``: ``1/s``
    (0 where ``s`` is), shaped as ``s``, made as the kernel would (symmetric only): no division per code."""
    if inv_steps is not None and not symmetric:
        raise ValueError("quant_pack: inverse steps are for symmetric grids only")
    n = g.rows * g.cols
    T, G = (0, 1) if per_channel else (g.tiles, g.tile)  # the step of element (r, c) is S[r * T + c // G]
    launch(_quant_pack, (cdiv(cdiv(n, 8), GROUPS_PER_PROGRAM),), X, n, g.cols, T,
           (s if z is None else z).contiguous(), (s if inv_steps is None else inv_steps).contiguous(), payload, off,
           (n * bits + 7) // 8, float(levels // 2), float(2 * (levels // 2) if symmetric else levels), G=G,
           ROWS8=g.cols % 8 == 0, SYM=symmetric, BITS=bits, GB=GROUPS_PER_PROGRAM, EXACT64=INTERPRET,
           INV=inv_steps is not None, num_warps=ELEMENT_WARPS)


def unpack_dequant(payload: torch.Tensor, off: int, g, z: torch.Tensor | None, s: torch.Tensor, bits: int,
                   levels: int, symmetric: bool, per_channel: bool = False, into: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """fp32 values (flat) of the codes packed at ``payload[off:]``; ``z``, ``s`` as in :func:`quant_pack`.
    ``into``: a contiguous fp32 tensor of as many elements to write them to (e.g. the decoder's output)."""
    n = g.rows * g.cols
    T, G = (0, 1) if per_channel else (g.tiles, g.tile)
    vals = torch.empty(n, device=payload.device) if into is None else into.view(-1)
    launch(_unpack_dequant, (cdiv(cdiv(n, 8), GROUPS_PER_PROGRAM),), payload, off, (n * bits + 7) // 8, n, g.cols,
           T, (s if z is None else z).contiguous(), s.contiguous(), float(levels // 2), vals, G=G,
           ROWS8=g.cols % 8 == 0, SYM=symmetric, BITS=bits, GB=GROUPS_PER_PROGRAM, EXACT64=INTERPRET,
           num_warps=ELEMENT_WARPS)
    return vals


def into(out: torch.Tensor) -> torch.Tensor | None:
    """The decoder's output itself where the kernels can write the fp32 values straight into it (no copy)."""
    return out if out.dtype == torch.float32 and out.is_contiguous() else None


def store(out: torch.Tensor, vals: torch.Tensor) -> None:
    """Decoded fp32 ``vals`` into ``out`` (nothing to do where they were decoded into it); fp16 clamped first
    (within half a step of 65504 is not Inf)."""
    if vals.data_ptr() == out.data_ptr():
        return
    if out.dtype == torch.float16:
        vals = vals.clamp_(-FP16_MAX, FP16_MAX)
    out.view(-1).copy_(vals)


def encode(codec, x: torch.Tensor) -> torch.Tensor:
    g, sec, payload = codec._begin_encode(x)
    if not g.numel:
        return payload
    X = contiguous_input(x)
    lay, L, sym = LAYOUTS[codec.layout], codec.levels, codec.symmetric
    lo, hi, sq, chk = tile_stats(X, g)
    checks(x, chk, codec.name)
    if isinstance(lay, LogLayout):  # gpu/_fit.py: the reference's fit (and outlier tiles) in two kernels
        z, s, vals = fit(lay, lo, hi, L, sym, g.anchor_rows, sq=sq, tile=g.tile, out=_in_payload(lay, sec, payload, g,
                                                                                                 codec.searches))
        sparse = vals.pop("sparse", None)
    else:
        sparse = None if sym else sparse_tiles(sq, lo, hi, L, g.tile)
        z, s, vals = lay.fit(lo, hi, L, sym, g.anchor_rows, codec.name, sparse)
    packed = None  # rows of whole tiles: the codes in element order are in tile order, packed by the search
    if codec.searches and g.cols % g.tile == 0 and packs(lay, sym, g.tile):
        packed = (payload, sec.offsets["codes"], (g.numel * codec.bits + 7) // 8, L, codec.bits)
    if codec.searches:  # the reference's search (gpu/_refine.py)
        outl = sparse if sparse is not None else sparse_tiles(sq, lo, hi, L, g.tile)
        z, s = refine(lay, X, g, lo, hi, z, s, vals, L, sym, g.anchor_rows, (outl,), pack=packed)
    lay.put(sec, payload, vals, 0, g)
    if packed is None:
        quant_pack(X, g, z, s, payload, sec.offsets["codes"], codec.bits, L, sym)
    return payload


def _in_payload(lay, sec, payload: torch.Tensor, g, searches: bool) -> dict[str, torch.Tensor]:
    """The fit's outputs that can be written straight into their payload fields: the anchors where they lie aligned
    (untagged layouts), and without a search (which chooses other codes) the 8-bit step and zero codes."""
    out = {}
    views = [("anchor", g.n_blocks)] if not lay.tag_bits else []
    if not searches:
        views += [("scale", g.rows * g.tiles), ("zero", g.rows * g.tiles)]
    for name, n in views:
        v = field_view(sec, payload, name, n) if name in sec else None
        if v is not None:
            out[name] = v if name == "anchor" else v.view(g.rows, g.tiles)
    return out


def decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    g, sec, out = codec._begin_decode(payload, shape, dtype)
    if not g.numel:
        return out
    lay = LAYOUTS[codec.layout]
    if isinstance(lay, LogLayout):  # the metadata, the values and the check's two numbers in one kernel
        vals, bm = decode_log(lay, sec, payload, g, codec.symmetric, codec.levels, codec.bits, into=into(out))
        judge(bm.view(torch.float32), lambda v: decoded_verdict(v[0], v[1], codec.name))
        store(out, vals)
        return out
    z, s = lay.read(sec, payload, 0, g.rows, g, codec.symmetric, codec.levels)
    vals = unpack_dequant(payload, sec.offsets["codes"], g, z, s, codec.bits, codec.levels, codec.symmetric,
                          into=into(out))
    decoded(vals, values_bound(z, s, codec.levels), 1.0, codec.name)
    store(out, vals)
    return out


def _supports(codec) -> bool:
    return codec.rounding == "nearest" and codec.tile <= MAX_TILE


register("DirectInt", supports=_supports, encode=encode, decode=decode)
