"""``fit=mse`` in one Triton kernel: :meth:`~qwire.codecs.layouts.LogLayout.refine` for asymmetric tiles.

Each program takes ``BT`` tiles (row-major, across rows) and tries the reference's candidate grids on them: the covering
grid, then the step codes one and two finer, centred on the tile, each also one zero unit either side where
a unit is under a step. A candidate's squared error is computed as :meth:`LogLayout.tile_sse` computes it
(the codes of ``quantize_``, ``d = x - (z + q s)``, ``d * d`` summed into 8 lanes in element order, the lanes
then as the same tree), so the first grid of lowest error is the reference's, bit for bit. The tile is read
once, from the rows where it lies (a short last tile repeats the row's last element, as ``load_tiles`` pads
it), for all seven grids; the reference builds a padded copy of the rows and quantizes a copy of it per
candidate. Where the codes of every tile form one stream in tile order (``tahquant``'s default), the same
program then quantizes its tiles on the grids it chose and packs their codes into the payload, reading the
tiles again while they are still in the caches: the encode reads the input from memory twice instead of
three times (``python scripts/gpu_op_count.py --traffic``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...base import full_levels
from ...hadamard import normalization
from ._common import (
    INTERPRET,
    cdiv,
    fma32,
    group_word,
    inverse,
    launch,
    listed_at,
    program_start,
    rint,
    rint_code,
    store_words,
)
from ._rotate import rotated_tiles

# tiles per program, read 8 elements at a time, a tile per thread: SEARCH_WARPS warps of 32 threads (at 4 warps
# the tile's 8 lanes were split between two threads, whose sums went through shared memory, and each thread held
# the grids of 2 tiles; python scripts/compile_for_gpu.py --specs tahquant --sass)
TILES_PER_PROGRAM = 64
SEARCH_WARPS = TILES_PER_PROGRAM // 32
# under the interpreter, few large programs (each program runs the kernel's Python once); a GPU runs
# TILES_PER_PROGRAM (scripts/compile_for_gpu.py --issue sets this to it, to count what a GPU's programs run)
INTERPRETER_TILES = 1 << 14


@triton.jit
def _grid(z, s):
    """``1/s`` (0 for a step of 0) and ``-z/s`` of grids ``(z, s)``, as the reference quantizes."""
    inv = inverse(s)
    return inv, -(z * inv)


@triton.jit
def _sq(acc, x, inb, z, s, inv, bias, L, FULL: tl.constexpr, EXACT64: tl.constexpr):
    """``acc`` plus the squared errors of the half chunk ``x`` ``(BT, 4)`` quantized on grids ``(z, s)`` (0 outside
    the tiles; with ``FULL``, chunks of 8 fill the tiles, and the lanes of tiles past the last are never read)."""
    v = fma32(x, inv[:, None], bias[:, None], EXACT64)
    v = tl.minimum(tl.maximum(v, 0.0), L[:, None])
    d = x - (z[:, None] + rint(v) * s[:, None])
    if FULL:
        return acc + d * d
    else:
        return acc + tl.where(inb, d * d, 0.0)


@triton.jit
def _sq8(lo, hi, xl, xh, il, ih, z, s, inv, bias, L, FULL: tl.constexpr, EXACT64: tl.constexpr):
    """:func:`_sq` of a chunk of 8: lanes 0-3 ``lo`` of its first half ``xl``, lanes 4-7 ``hi`` of ``xh``."""
    return (_sq(lo, xl, il, z, s, inv, bias, L, FULL, EXACT64),
            _sq(hi, xh, ih, z, s, inv, bias, L, FULL, EXACT64))


@triton.jit
def _lanes(lo, hi):
    """The squared error ``(BT,)`` of lanes 0-3 ``lo`` and 4-7 ``hi`` ``(BT, 4)`` as the reference sums them:
    ``((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))``, the lanes taken apart by splits (no reductions). A
    thread holds a tile's four lanes of each (:func:`_refine_log`), so the splits stay in its registers."""
    BT: tl.constexpr = lo.shape[0]
    q = lo + hi  # l0 + l4, l1 + l5, l2 + l6, l3 + l7
    a, b = tl.split(tl.permute(tl.reshape(q, (BT, 2, 2)), (0, 2, 1)))  # q0, q1 and q2, q3
    e, f = tl.split(a + b)  # (l0 + l4) + (l2 + l6) and (l1 + l5) + (l3 + l7)
    return e + f


@triton.jit
def _finer(c0, d: tl.constexpr, a, u, L, mid, TAB, ZCODE, KMIN, KMAX, tin):
    """The candidates of step code ``c0 + d`` (``LogLayout.MSE_FINER``): the step ``sc``, and per zero shift 0,
    -1, 1 (``LogLayout.MSE_SHIFTS``) the zero ``z*``, its zero code ``k*`` (clamped) and whether it was inside the
    code range; ``ok`` whether the step can be searched at all."""
    c = tl.minimum(c0 + d, ZCODE - 1)
    sc = a * tl.load(TAB + c, mask=tin, other=0.0)
    us = u * sc
    kc = tl.floor(tl.div_rn(mid - (L * sc) * 0.5, tl.where(us != 0, us, 1.0)) + 0.5)
    k0 = tl.minimum(tl.maximum(kc, KMIN), KMAX)
    k1 = tl.minimum(tl.maximum(kc - 1.0, KMIN), KMAX)
    k2 = tl.minimum(tl.maximum(kc + 1.0, KMIN), KMAX)
    in0 = (kc >= KMIN) & (kc <= KMAX)
    in1 = (kc - 1.0 >= KMIN) & (kc - 1.0 <= KMAX)
    in2 = (kc + 1.0 >= KMIN) & (kc + 1.0 <= KMAX)
    return c, sc, us != 0, (k0 * u) * sc, (k1 * u) * sc, (k2 * u) * sc, k0, k1, k2, in0, in1, in2


@triton.jit
def _take(ok, acc, best, zc, sc, c, k, bz, bs, bc, bk):
    """The candidate of lanes ``acc`` (lanes 0-3, lanes 4-7) where ``ok`` (it is searched) and its error is below
    ``best`` (the first lowest is kept)."""
    e = _lanes(acc[0], acc[1])
    ok = ok & (e < best)
    return (tl.where(ok, e, best), tl.where(ok, zc, bz), tl.where(ok, sc, bs), tl.where(ok, c, bc),
            tl.where(ok, k, bk))


@triton.jit
def _take_step(ok, fine, acc0, acc1, acc2, z0, z1, z2, sc, c, k0, k1, k2, in0, in1, in2, best, bz, bs, bc, bk):
    """The three candidates of one finer step (:func:`_finer`) in the reference's order: the centred zero, then
    one zero unit below and above where ``fine`` (a unit under a step)."""
    best, bz, bs, bc, bk = _take(ok & in0, acc0, best, z0, sc, c, k0, bz, bs, bc, bk)
    best, bz, bs, bc, bk = _take(ok & in1 & fine, acc1, best, z1, sc, c, k1, bz, bs, bc, bk)
    return _take(ok & in2 & fine, acc2, best, z2, sc, c, k2, bz, bs, bc, bk)


@triton.jit
def _tile_fit(LO, HI, Z, S, SCALE, ZC, LV, ti, m, KMIN):
    """Tiles ``ti``'s range, their covering grid, its step code and zero code (``KMIN`` added back) and their
    levels (1 where not ``m``)."""
    lo = tl.load(LO + ti, mask=m, other=0.0)
    hi = tl.load(HI + ti, mask=m, other=0.0)
    z = tl.load(Z + ti, mask=m, other=0.0)
    s = tl.load(S + ti, mask=m, other=0.0)
    c0 = tl.load(SCALE + ti, mask=m, other=0).to(tl.int32)
    k0 = tl.load(ZC + ti, mask=m, other=0).to(tl.float32) + KMIN
    return lo, hi, z, s, c0, k0, tl.load(LV + ti, mask=m, other=1.0)


@triton.jit
def _chunk(row, t, G, C, j0, tin, last, WHOLE: tl.constexpr):
    """Elements ``j0 .. j0 + 3`` of tiles ``t`` of rows ``row`` ``(BT, 4)`` in fp32, and which are inside the tiles
    (a short last tile repeats its row's last element ``last``)."""
    j = j0 + tl.arange(0, 4)
    cols = t[:, None] * G + j[None, :]
    if WHOLE:
        inb = tin[:, None]
        x = tl.load(row[:, None] + cols, mask=inb, other=0.0).to(tl.float32)
    else:
        inb = tin[:, None] & (j[None, :] < G)
        x = tl.load(row[:, None] + cols, mask=inb & (cols < C), other=0.0).to(tl.float32)
        x = tl.where(inb & (cols >= C), last[:, None], x)
    return x, inb


@triton.jit
def _refine_log(X, C, T, N, G, LO, HI, Z, S, SCALE, ZC, LV, SKIP1, SKIP2, ANCH, AR, TAB, ZCODE, KMIN, KMAX,
                UNIT_F, OZ, OS, OSCALE, OZC, P, POFF, PBYTES, TOP, NCH: tl.constexpr, NSKIP: tl.constexpr,
                BT: tl.constexpr, WHOLE: tl.constexpr, EXACT64: tl.constexpr, BITS: tl.constexpr,
                I64: tl.constexpr):
    """Program ``b``: tiles ``b * BT ..`` of the ``N`` (row-major ids; tile ``t`` of row ``r`` is ``r * T + t``).
    In: the covering fit (``Z``, ``S``, step code ``SCALE`` and zero code ``ZC``, uint8), levels ``LV``, the tiles
    not to search (set in ``SKIP1`` or, with ``NSKIP = 2``, ``SKIP2``; none with ``NSKIP = 0``), the anchors
    ``ANCH`` (one per ``AR`` rows) and the step table ``TAB``. Out: the chosen grid ``OZ``, ``OS`` and its codes
    ``OSCALE``, ``OZC`` (uint8).

    The seven candidate grids are known before any is tried, so one pass over each tile, 8 elements at a time,
    accumulates the squared errors of all seven (each in its own lanes, in element order, as the reference
    sums them), and the choices follow in the reference's order. A thread takes a tile (``SEARCH_WARPS`` warps
    of ``BT`` threads in all): its lanes, its grids and their sums stay in the thread's registers.
    ``WHOLE``: the tile ``G`` is a multiple of 8 and the rows hold whole tiles (no padding, no lane outside a tile).

    ``BITS`` > 0 (``G`` a multiple of 8): the tiles' codes on the chosen grids, ``round((x - z) / s)`` clamped to
    [0, ``TOP``] as ``_stream_quant_pack`` makes them, packed ``BITS`` bits each into the stream at ``P + POFF``
    (``PBYTES`` bytes) that holds every tile's codes in tile order; each thread reads its tile again (from the
    caches) and writes its code groups."""
    ti = program_start(BT, I64) + tl.arange(0, BT)
    tin = ti < N
    r = ti // T
    t = ti - r * T
    row = X + r * C
    last = tl.load(row + C - 1, mask=tin, other=0.0).to(tl.float32)
    lo, hi, z, s, c0, k0, L = _tile_fit(LO, HI, Z, S, SCALE, ZC, LV, ti, tin, KMIN)
    live = tin & (c0 < ZCODE)
    if NSKIP > 0:
        live = live & (tl.load(SKIP1 + ti, mask=tin, other=0) == 0)
    if NSKIP > 1:
        live = live & (tl.load(SKIP2 + ti, mask=tin, other=0) == 0)
    a = tl.load(ANCH + r // AR, mask=tin, other=0.0)
    u = (L + 1.0) * UNIT_F
    mid = (lo + hi) * 0.5
    ca, sa, oka, za0, za1, za2, ka0, ka1, ka2, ia0, ia1, ia2 = _finer(c0, 1, a, u, L, mid, TAB, ZCODE, KMIN, KMAX,
                                                                       tin)
    cb, sb, okb, zb0, zb1, zb2, kb0, kb1, kb2, ib0, ib1, ib2 = _finer(c0, 2, a, u, L, mid, TAB, ZCODE, KMIN, KMAX,
                                                                       tin)
    inv, bias = _grid(z, s)
    inva, ba0 = _grid(za0, sa)
    _, ba1 = _grid(za1, sa)
    _, ba2 = _grid(za2, sa)
    invb, bb0 = _grid(zb0, sb)
    _, bb1 = _grid(zb1, sb)
    _, bb2 = _grid(zb2, sb)
    e0 = tl.zeros((BT, 4), tl.float32)
    e = (e0, e0)
    ea0, ea1, ea2, eb0, eb1, eb2 = e, e, e, e, e, e
    for ch in range(0, NCH):  # in element order: element i into lane i % 8 (lanes 0-3 of xl, 4-7 of xh)
        xl, il = _chunk(row, t, G, C, ch * 8, tin, last, WHOLE)
        xh, ih = _chunk(row, t, G, C, ch * 8 + 4, tin, last, WHOLE)
        e = _sq8(e[0], e[1], xl, xh, il, ih, z, s, inv, bias, L, WHOLE, EXACT64)
        ea0 = _sq8(ea0[0], ea0[1], xl, xh, il, ih, za0, sa, inva, ba0, L, WHOLE, EXACT64)
        ea1 = _sq8(ea1[0], ea1[1], xl, xh, il, ih, za1, sa, inva, ba1, L, WHOLE, EXACT64)
        ea2 = _sq8(ea2[0], ea2[1], xl, xh, il, ih, za2, sa, inva, ba2, L, WHOLE, EXACT64)
        eb0 = _sq8(eb0[0], eb0[1], xl, xh, il, ih, zb0, sb, invb, bb0, L, WHOLE, EXACT64)
        eb1 = _sq8(eb1[0], eb1[1], xl, xh, il, ih, zb1, sb, invb, bb1, L, WHOLE, EXACT64)
        eb2 = _sq8(eb2[0], eb2[1], xl, xh, il, ih, zb2, sb, invb, bb2, L, WHOLE, EXACT64)
    best, bz, bs, bc, bk = _lanes(e[0], e[1]), z, s, c0, k0
    fine = u < 1.0  # a shifted zero is tried only where a zero unit is under a step
    best, bz, bs, bc, bk = _take_step(live & oka, fine, ea0, ea1, ea2, za0, za1, za2, sa, ca, ka0, ka1, ka2, ia0, ia1,
                                      ia2, best, bz, bs, bc, bk)
    best, bz, bs, bc, bk = _take_step(live & okb, fine, eb0, eb1, eb2, zb0, zb1, zb2, sb, cb, kb0, kb1, kb2, ib0, ib1,
                                      ib2, best, bz, bs, bc, bk)
    tl.store(OZ + ti, bz, mask=tin)
    tl.store(OS + ti, bs, mask=tin)
    tl.store(OSCALE + ti, bc.to(tl.uint8), mask=tin)
    tl.store(OZC + ti, (bk - KMIN).to(tl.int32).to(tl.uint8), mask=tin)
    if BITS > 0:  # the codes on the chosen grids, from the tiles just read (in the caches), each by its thread
        inv, bias = _grid(bz, bs)
        for ch in range(0, NCH):
            xl, il = _chunk(row, t, G, C, ch * 8, tin, last, WHOLE)
            xh, ih = _chunk(row, t, G, C, ch * 8 + 4, tin, last, WHOLE)
            w = _codes_word(xl, inv, bias, TOP, 0, EXACT64, BITS) + _codes_word(xh, inv, bias, TOP, 4, EXACT64, BITS)
            store_words(w, tl.where(tin, ti * NCH + ch, PBYTES), P, POFF, PBYTES, BITS)


@triton.jit
def _codes_word(x, inv, bias, TOP, first: tl.constexpr, EXACT64: tl.constexpr, BITS: tl.constexpr):
    """The word (:func:`group_word`) of half a code group ``x`` ``(BT, 4)``, codes ``first ..``, on grids
    ``(inv, bias)``: ``round((x - z) / s)`` clamped to [0, ``TOP``], as ``_stream_quant_pack`` makes them."""
    v = fma32(x, inv[:, None], bias[:, None], EXACT64)
    return group_word(rint_code(tl.minimum(tl.maximum(v, 0.0), TOP)), first, BITS)


def refine(lay, X: torch.Tensor, g, lo: torch.Tensor, hi: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
           vals: dict[str, torch.Tensor], levels: torch.Tensor | int, symmetric: bool, anchor_rows: int,
           skip: tuple[torch.Tensor, ...] = (), pack: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``lay.refine`` (a :class:`~qwire.codecs.layouts.LogLayout`) of the flat rows ``X`` of geometry ``g``, with
    the same arguments and results (``vals``' ``scale`` and ``zero`` updated), the tiles set in any of ``skip``
    (bool ``(R, T)``, at most two) left out of the search; symmetric grids run the reference.
    ``pack`` = ``(payload, offset, bytes, top, bits)``: also every tile's codes on its grid, packed into the stream
    at ``payload[offset:]`` that holds them all in tile order (as ``_stream_quant_pack``), in the same kernel; the
    caller checks :func:`packs` first."""
    R, T, dev = g.rows, g.tiles, X.device
    if not packs(lay, symmetric, g.tile) and pack is not None:
        raise ValueError("refine: this search has no kernel that packs the codes")
    if symmetric or lay.MSE_FINER != (1, 2) or lay.MSE_SHIFTS != (0, -1, 1):  # the candidates the kernel has
        from ...tiles import load_tiles

        mask = None
        for k in skip:
            mask = ~k if mask is None else mask & ~k
        return lay.refine(load_tiles(X.view(g.rows, g.cols), g), lo, hi, z, s, vals, levels, symmetric,
                          anchor_rows, mask)
    if len(skip) > 2:
        raise ValueError("refine: at most two skip masks")
    sk = [k.expand(R, T).contiguous() for k in skip] + [lo, lo]
    oz, os_ = torch.empty(R, T, device=dev), torch.empty(R, T, device=dev)
    oc = torch.empty(R, T, dtype=torch.uint8, device=dev)
    ozc = torch.empty(R, T, dtype=torch.uint8, device=dev)
    n = R * T
    bt = triton.next_power_of_2(min(n, INTERPRETER_TILES)) if INTERPRET else TILES_PER_PROGRAM
    launch(_refine_log, (cdiv(n, bt),), X, g.cols, T, n, g.tile, lo.contiguous(), hi.contiguous(),
           z.contiguous(), s.contiguous(), vals["scale"].contiguous(), vals["zero"].contiguous(),
           full_levels(levels, (R, T), dev).contiguous(), sk[0], sk[1], vals["anchor"].contiguous(), anchor_rows,
           lay._table(dev), lay.zero_code, float(lay.kmin), float(lay.kmax), float(lay.unit(0)), oz, os_, oc, ozc,
           pack[0] if pack else oz, pack[1] if pack else 0, pack[2] if pack else 0, float(pack[3]) if pack else 0.0,
           NCH=cdiv(g.tile, 8), NSKIP=len(skip), BT=bt, WHOLE=g.tile % 8 == 0 and g.cols % g.tile == 0,
           EXACT64=INTERPRET, BITS=pack[4] if pack else 0, num_warps=SEARCH_WARPS)
    vals["scale"] = oc
    vals["zero"] = ozc
    return oz, os_


def packs(lay, symmetric: bool, tile: int) -> bool:
    """Whether :func:`refine` can pack the codes in its kernel: the kernel's search, and tiles of whole code
    groups (a multiple of 8 elements)."""
    return not symmetric and lay.MSE_FINER == (1, 2) and lay.MSE_SHIFTS == (0, -1, 1) and tile % 8 == 0


BLOCK_ELEMS = 2048  # values of the rotated tiles a program of the block search holds (BG tiles of G)


@triton.jit
def _halve(e):
    """``e[:, :H] + e[:, H:]`` of ``e`` ``(BG, 2 H)``, taken apart by a split."""
    BG: tl.constexpr = e.shape[0]
    H: tl.constexpr = e.shape[1] // 2
    a, b = tl.split(tl.permute(tl.reshape(e, (BG, 2, H)), (0, 2, 1)))
    return a + b


@triton.jit
def _block_sse(y, wide, zc, sc, L, LOG2G: tl.constexpr, EXACT64: tl.constexpr):
    """Squared error ``(BG,)`` of blocks ``y`` ``(BG, G)`` on grids ``(zc, sc)``, as ``LogLayout.refine_blocks``
    computes it: ``2 L + 1`` levels on ``sc / 2`` where ``wide``, ``L`` on ``sc`` elsewhere (``quantize_``'s codes),
    ``d = y - (z + q step)``, ``d * d`` added by halving."""
    step = tl.where(wide, sc[:, None] * 0.5, sc[:, None])
    inv = inverse(step)
    v = fma32(y, inv, -(zc[:, None] * inv), EXACT64)
    top = tl.where(wide, L[:, None] * 2.0 + 1.0, L[:, None])
    v = tl.minimum(tl.maximum(v, 0.0), top)
    d = y - (zc[:, None] + rint(v) * step)
    e = d * d
    for _ in tl.static_range(LOG2G):
        e = _halve(e)
    return tl.reshape(e, (e.shape[0],))


@triton.jit
def _block_cand(kc, dk: tl.constexpr, c, sc, y, wide, u, L, ok, KMIN, KMAX, best, bz, bs, bc, bk, LOG2G: tl.constexpr,
                EXACT64: tl.constexpr):
    """The candidate of zero code ``kc + dk`` on step ``sc`` (code ``c``), kept where ``ok``, inside the range and
    below ``best`` (the first of lowest error is kept)."""
    k = kc + dk
    inside = (k >= KMIN) & (k <= KMAX)
    k = tl.minimum(tl.maximum(k, KMIN), KMAX)
    zc = (k * u) * sc
    e = _block_sse(y, wide, zc, sc, L, LOG2G, EXACT64)
    ok = ok & inside & (e < best)
    return tl.where(ok, e, best), tl.where(ok, zc, bz), tl.where(ok, sc, bs), tl.where(ok, c, bc), tl.where(ok, k, bk)


@triton.jit
def _block_step(c0, d: tl.constexpr, y, wide, a, u, L, mid, live, KMIN, KMAX, TAB, ZCODE, m, best, bz, bs, bc, bk,
                LOG2G: tl.constexpr, EXACT64: tl.constexpr):
    """The candidates of step code ``c0 + d`` in the reference's order (the centred zero, then one unit below and
    above where a unit is under a step)."""
    c = tl.minimum(c0 + d, ZCODE - 1)
    sc = a * tl.load(TAB + c, mask=m, other=0.0)
    us = u * sc
    kc = tl.floor(tl.div_rn(mid - (L * sc) * 0.5, tl.where(us != 0, us, 1.0)) + 0.5)
    best, bz, bs, bc, bk = _block_cand(kc, 0.0, c, sc, y, wide, u, L, live, KMIN, KMAX, best, bz, bs, bc, bk, LOG2G,
                                       EXACT64)
    fine = live & (u < 1.0)
    best, bz, bs, bc, bk = _block_cand(kc, -1.0, c, sc, y, wide, u, L, fine, KMIN, KMAX, best, bz, bs, bc, bk, LOG2G,
                                       EXACT64)
    return _block_cand(kc, 1.0, c, sc, y, wide, u, L, fine, KMIN, KMAX, best, bz, bs, bc, bk, LOG2G, EXACT64)


@triton.jit
def _refine_blocks_body(y, ti, m, T, LO, HI, Z, S, SCALE, ZC, EXT, LV, ANCH, AR, TAB, ZCODE, LAY_KMIN, KMIN, KMAX,
                        UNIT_F, WB, WR, G: tl.constexpr, LOG2G: tl.constexpr, NW: tl.constexpr, ZB: tl.constexpr,
                        HAS_EXT: tl.constexpr, PAD_LAST: tl.constexpr, PER_BLOCK: tl.constexpr,
                        EXACT64: tl.constexpr):
    r = ti // T
    if PAD_LAST:
        m = m & (ti - r * T != T - 1)
    lo, hi, z, s, c0, k0, L = _tile_fit(LO, HI, Z, S, SCALE, ZC, LV, ti, m, LAY_KMIN)
    if HAS_EXT:
        k0 = k0 + tl.load(EXT + ti, mask=m, other=0).to(tl.float32) * (1 << ZB)
    a = tl.load(ANCH + r // AR, mask=m, other=0.0)
    if PER_BLOCK:  # zero_width=block: the block's width (WB) sets the wide elements and the zero codes' range (WR)
        eb = tl.load(WB + r // AR, mask=m, other=0)
        wide = tl.arange(0, G)[None, :] < (NW - eb)[:, None]
        KMIN = tl.load(WR + 2 * eb, mask=m, other=0.0)
        KMAX = tl.load(WR + 2 * eb + 1, mask=m, other=0.0)
    else:
        wide = (tl.arange(0, G) < NW)[None, :]
    live = m & (c0 < ZCODE)
    u = (L + 1.0) * UNIT_F
    mid = (lo + hi) * 0.5
    best = _block_sse(y, wide, z, s, L, LOG2G, EXACT64)
    bz, bs, bc, bk = z, s, c0, k0
    best, bz, bs, bc, bk = _block_step(c0, 1, y, wide, a, u, L, mid, live, KMIN, KMAX, TAB, ZCODE, m, best, bz, bs,
                                       bc, bk, LOG2G, EXACT64)
    best, bz, bs, bc, bk = _block_step(c0, 2, y, wide, a, u, L, mid, live, KMIN, KMAX, TAB, ZCODE, m, best, bz, bs,
                                       bc, bk, LOG2G, EXACT64)
    code = bk - LAY_KMIN
    if HAS_EXT:
        high = tl.floor(code * (1.0 / (1 << ZB)))
        tl.store(EXT + ti, high.to(tl.int32), mask=m)
        code = code - high * (1 << ZB)
    tl.store(Z + ti, bz, mask=m)
    tl.store(S + ti, bs, mask=m)
    tl.store(SCALE + ti, bc.to(tl.uint8), mask=m)
    tl.store(ZC + ti, code.to(tl.int32).to(tl.uint8), mask=m)


@triton.jit
def _refine_blocks(X, C, T, IDX, CNT, PIV, ROT, n, LO, HI, Z, S, SCALE, ZC, EXT, LV, ANCH, AR, TAB, ZCODE, LAY_KMIN,
                   KMIN, KMAX, UNIT_F, NORM, WB, WR, G: tl.constexpr, LOG2G: tl.constexpr, NW: tl.constexpr,
                   ZB: tl.constexpr, HAS_EXT: tl.constexpr, PAD_LAST: tl.constexpr, BG: tl.constexpr,
                   ONDEV: tl.constexpr, PER_BLOCK: tl.constexpr, EXACT64: tl.constexpr):
    """``LogLayout.refine_blocks`` of rotated tiles ``k``, in place in ``Z``, ``S``, the step and zero codes
    ``SCALE``, ``ZC`` (uint8) and, with ``HAS_EXT``, the zero codes' high parts ``EXT`` (int32), all per tile id.
    ``ONDEV``: ``k`` below the count ``CNT`` of the device list ``IDX`` (tile ``IDX[k]``, rotated again from the
    rows ``X``, pivot ``PIV[tile]``); else ``k < n``: tile ``IDX[k]``, its rotated values in row ``k`` of ``ROT``.
    The zero code ranges over ``KMIN`` .. ``KMAX``; ``PAD_LAST``: the last tile of a row (padded) is skipped.
    ``PER_BLOCK`` (``zero_width=block``): a tile's zero extension is its block's ``WB[row // AR]`` bits ``w``,
    its wide elements ``NW - w`` and its zero code's range ``WR[2 w]`` .. ``WR[2 w + 1]``."""
    k = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG).to(tl.int64)
    if ONDEV:
        cnt = tl.load(CNT)
        if tl.program_id(0) * BG < cnt:
            m, ti, p = listed_at(IDX, PIV, k, cnt)
            y = rotated_tiles(X, C, T, ti, p, m, NORM, BG, G, LOG2G)
            _refine_blocks_body(y, ti, m, T, LO, HI, Z, S, SCALE, ZC, EXT, LV, ANCH, AR, TAB, ZCODE, LAY_KMIN, KMIN,
                                KMAX, UNIT_F, WB, WR, G, LOG2G, NW, ZB, HAS_EXT, PAD_LAST, PER_BLOCK, EXACT64)
    else:
        m = k < n
        ti = tl.load(IDX + k, mask=m, other=0).to(tl.int64)
        j = tl.arange(0, G).to(tl.int64)
        y = tl.load(ROT + k[:, None] * G + j[None, :], mask=m[:, None], other=0.0)
        _refine_blocks_body(y, ti, m, T, LO, HI, Z, S, SCALE, ZC, EXT, LV, ANCH, AR, TAB, ZCODE, LAY_KMIN, KMIN, KMAX,
                            UNIT_F, WB, WR, G, LOG2G, NW, ZB, HAS_EXT, PAD_LAST, PER_BLOCK, EXACT64)


def refine_blocks(codec, X: torch.Tensor, g, listed, idx: torch.Tensor | None, rot: torch.Tensor, piv: torch.Tensor,
                  lo: torch.Tensor, hi: torch.Tensor, z: torch.Tensor, s: torch.Tensor, vals: dict[str, torch.Tensor],
                  ext: torch.Tensor | None, levels: torch.Tensor, widths: torch.Tensor | None = None) -> None:
    """``TAHQuant._refine_rotated`` (``fit_rotated``) on the GPU, in place (``z``, ``s``, ``vals``' ``scale`` and
    ``zero``, ``ext``: contiguous ``(R, T)``): the rotated tiles of the device list ``listed`` (rotated again from
    the flat rows ``X``, pivots ``piv`` per tile), or ``idx`` (row-major ids; their rotated values: the rows of
    ``rot``), with ``levels`` ``(R, T)`` their narrow width's; ``widths``: each block of rows' zero-extension
    bits (``zero_width=block``). No host sync."""
    from ._blocks import DeviceList

    lay = codec.lay
    G = g.tile
    if lay.MSE_FINER != (1, 2) or lay.MSE_SHIFTS != (0, -1, 1):
        raise NotImplementedError("refine_blocks: the kernel tries the step codes 1 and 2 finer, zero shifts 0, -1, 1")
    for t in (z, s, vals["scale"], vals["zero"], levels) + ((ext,) if ext is not None else ()):
        assert t.is_contiguous()
    if codec.extends:
        half, span = float(1 << (codec.ext_bits - 1)), float(1 << lay.zero_bits)
        kr = (lay.kmin - span * half, lay.kmax + span * (half - 1))
    else:
        kr = (float(lay.kmin), float(lay.kmax))
    ondev = isinstance(listed, DeviceList)
    n = listed.ids.numel() if ondev else idx.numel()
    if not n:
        return
    bg = max(1, BLOCK_ELEMS // G)
    ids = listed.ids if ondev else idx
    wb = wr = z  # (not read)
    nw = G - codec.narrowed
    if widths is not None:  # the reach of every width, (kmin, kmax) interleaved, as TAHQuant._width_reach
        wb = widths.to(torch.int32).contiguous()
        wr = codec._reach_table(X.device)  # made once per device
        nw = G - int(math.log2(G))
    launch(_refine_blocks, (cdiv(n, bg),), X, g.cols, g.tiles, ids, listed.count if ondev else ids, piv,
           rot if rot.numel() else z, n, lo, hi, z, s, vals["scale"], vals["zero"], ext if ext is not None else z,
           levels, vals["anchor"].contiguous(), g.anchor_rows, lay._table(X.device), lay.zero_code, float(lay.kmin),
           kr[0], kr[1], float(lay.unit(0)), normalization(G), wb, wr, G=G, LOG2G=G.bit_length() - 1,
           NW=nw, ZB=lay.zero_bits, HAS_EXT=ext is not None, PAD_LAST=g.padded > g.cols, BG=bg,
           ONDEV=ondev, PER_BLOCK=widths is not None, EXACT64=INTERPRET)
