"""A ``log`` metadata layout's fit in two Triton kernels: :meth:`~qwire.codecs.layouts.LogLayout.fit`.

The reference computes each tile's step and zero with some sixty torch operations on ``(rows, tiles)``
tensors; on a GPU each is a kernel launch. Here:

1. ``_need``: per tile the smallest step that covers it (through-zero grids for outlier tiles included)
   and, by an atomic maximum, the largest of them in each block of ``anchor_rows`` rows: the anchor;
2. ``_codes``: per tile the step code on the anchor's log grid (the largest code whose step still covers
   the tile, settled by exact comparisons as the reference settles it), the zero code (aligned to a whole
   number of steps where that still covers), and the zero extension's split.

Every operation is the reference's, in its order: IEEE divisions (``tl.div_rn``), no multiply-add
contraction (``launch``), the same table of steps. The scalar products the reference forms in Python
(``kmin * u``, ``kmax * u + levels``) are of small integers and powers of two, exact in fp32 as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...base import full_levels
from ...tahquant import TWO_OUTLIERS
from ...tiles import SPARSE_KAPPA
from ._common import cdiv, launch, program_start

TILES_PER_PROGRAM = 1024


@triton.jit
def _zero_range(KMN, KMIN_S, KMAX_S, N, i, m, EXT: tl.constexpr):
    """The range of the zero code of tiles ``i``: per tile (``KMN``: kmin, then kmax, ``N`` each) with the zero
    extension, else the layout's own (``KMIN_S``, ``KMAX_S``)."""
    if EXT:
        kmin = tl.load(KMN + i, mask=m, other=-1.0)
        kmax = tl.load(KMN + N + i, mask=m, other=1.0)
    else:
        kmin = tl.full(i.shape, KMIN_S, tl.float32)
        kmax = tl.full(i.shape, KMAX_S, tl.float32)
    return kmin, kmax


@triton.jit
def _levels(LV, LVC, i, m, HAS_LV: tl.constexpr):
    """The levels of tiles ``i``: per tile from ``LV``, or the number ``LVC`` for every tile (no tensor filled)."""
    if HAS_LV:
        return tl.load(LV + i, mask=m, other=3.0)
    else:
        return tl.full(i.shape, LVC, tl.float32)


@triton.jit
def _need(LO, HI, LV, LVC, SQ, A1, A2SQ, SPARSE, KMN, KMIN_S, KMAX_S, N, TA, GM1, GM2, KAPPA, TWO2, UNIT_F, NEED,
          ALIGNED, J, ANCH, SYM: tl.constexpr, SPARSE_MODE: tl.constexpr, EXT: tl.constexpr, HAS_LV: tl.constexpr,
          BT: tl.constexpr, I64: tl.constexpr):
    """The covering step ``NEED`` of tiles ``b * BT ..`` (row-major ids of the ``N``), their through-zero
    choice (``ALIGNED``, ``J``) and the anchors ``ANCH`` (one per ``TA`` tiles, zero-initialized). The outlier
    tiles (``SPARSE_MODE``): 0 none; 1 given in ``SPARSE``; 2 ``tiles.sparse_tiles`` of the sums of squares
    ``SQ`` (``GM1``: the tile's size less one, at least 1; ``KAPPA``: ``tiles.SPARSE_KAPPA``), written to
    ``SPARSE``; 3 also TAH-Quant's two-outlier tiles (``TAHQuant._outlier_tiles``: ``A1`` the largest
    magnitude, ``A2SQ`` the square of the second, ``GM2`` the tile's size less two, at least 1, ``TWO2`` the
    square of ``TWO_OUTLIERS``)."""
    i = program_start(BT, I64) + tl.arange(0, BT)
    m = i < N
    lo = tl.load(LO + i, mask=m, other=0.0)
    hi = tl.load(HI + i, mask=m, other=0.0)
    L = _levels(LV, LVC, i, m, HAS_LV)
    if SYM:
        need = tl.div_rn(tl.maximum(hi, -lo), tl.floor(L * 0.5))
    else:
        kmin, kmax = _zero_range(KMN, KMIN_S, KMAX_S, N, i, m, EXT)
        u = (L + 1.0) * UNIT_F
        need = tl.div_rn(hi - lo, L - u)
        need = tl.maximum(need, tl.div_rn(lo, kmin * u))
        need = tl.maximum(need, tl.div_rn(hi, kmax * u + L))
        if SPARSE_MODE > 0:  # LogLayout._through_zero: the two whole j around L * (-lo) / (hi - lo)
            width = tl.where(hi > lo, hi - lo, 1.0)
            j0 = tl.maximum(tl.floor(tl.div_rn(L * (-lo), width)), 1.0)
            ja = tl.minimum(j0, L - 1.0)
            sa = tl.maximum(tl.div_rn(-lo, ja), tl.div_rn(hi, L - ja))
            jb = tl.minimum(j0 + 1.0, L - 1.0)
            sb = tl.maximum(tl.div_rn(-lo, jb), tl.div_rn(hi, L - jb))
            better = sb < sa
            bs = tl.where(better, sb, sa)
            bj = tl.where(better, jb, ja)
            if SPARSE_MODE == 1:
                sp = tl.load(SPARSE + i, mask=m, other=0) != 0
            else:  # tiles.sparse_tiles: the RMS without the largest magnitude under KAPPA steps
                top = tl.maximum(hi, -lo)
                sq = tl.load(SQ + i, mask=m, other=0.0)
                step = tl.div_rn(KAPPA * (hi - lo), L)
                rest = tl.div_rn(tl.maximum(sq - top * top, 0.0), tl.full(sq.shape, GM1, tl.float32))
                sp = tl.sqrt_rn(rest) < step
                if SPARSE_MODE == 3:  # two outliers well above the rest: the same test without both
                    a1 = tl.load(A1 + i, mask=m, other=0.0)
                    a2sq = tl.load(A2SQ + i, mask=m, other=0.0)
                    rest2 = sq - a2sq
                    ms = tl.div_rn(tl.maximum(rest2 - a1 * a1, 0.0), tl.full(sq.shape, GM2, tl.float32))
                    r2 = tl.div_rn(tl.maximum(rest2 - top * top, 0.0), tl.full(sq.shape, GM2, tl.float32))
                    sp = sp | ((tl.sqrt_rn(r2) < step) & (a2sq > TWO2 * ms))
                tl.store(SPARSE + i, sp.to(tl.int8), mask=m)
            aligned = sp & (lo < 0) & (hi > 0) & (L >= 3.0) & (u <= 1.0) & (tl.div_rn(bj, u) <= -kmin)
            need = tl.where(aligned, bs * 1.00000095367431640625, need)  # 1 + 2^-20: a few ulps of margin
            tl.store(ALIGNED + i, aligned.to(tl.int8), mask=m)
            tl.store(J + i, bj, mask=m)
    tl.store(NEED + i, need, mask=m)
    # The anchors: one atomic maximum of the largest step for each of the first three anchor blocks that the
    # program's tiles reach. A block holds >= 2^16 elements, so with tiles of up to 128 elements (>= 512 tiles
    # a block) the program's 1024 tiles reach at most three; with larger tiles a block has fewer tiles to
    # contend, and the tiles past the third block take one atomic each. An atomic per tile made every tile of
    # a block contend for one address (100 us per 16 MB fit on an H200, 60% of an int4 encode's kernel time).
    blk = i // TA  # the anchor block of each tile (TA: tiles per block, a whole number of rows)
    b0 = program_start(BT, I64) // TA
    for k in tl.static_range(3):
        sel = m & (blk == b0 + k)
        top = tl.max(tl.where(sel, need, 0.0), axis=0)
        tl.atomic_max(ANCH + b0 + k, top, mask=tl.max(sel.to(tl.int32), axis=0) > 0, sem="relaxed")
    tl.atomic_max(ANCH + blk, need, mask=m & (blk > b0 + 2), sem="relaxed")


@triton.jit
def _codes(LO, HI, LV, LVC, NEED, ALIGNED, J, KMN, KMIN_S, KMAX_S, ANCH, AOUT, TAB, N, TA, UNIT_F, ZCODE, LKMIN,
           ZSPAN, INV_ZSPAN, P, FINE, COARSE, Z, S, SC, ZC, ZE, SYM: tl.constexpr, HAS_SPARSE: tl.constexpr,
           EXT: tl.constexpr, ALIGN: tl.constexpr, TAPER: tl.constexpr, HAS_LV: tl.constexpr, BT: tl.constexpr,
           TAG: tl.constexpr, I64: tl.constexpr):
    """Step code ``SC``, zero code ``ZC`` (and its extension ``ZE``), decoded zero ``Z`` and step ``S`` of
    tiles ``b * BT ..`` from their covering steps ``NEED`` and the anchors. ``TAG`` > 0: the anchors are first
    rounded up to a multiple of ``2^TAG`` units in the last place (``LogLayout.round_anchor``), and the rounded
    ones written to ``AOUT`` by the program that holds each block's first tile."""
    i = program_start(BT, I64) + tl.arange(0, BT)
    m = i < N
    need = tl.load(NEED + i, mask=m, other=0.0)
    a = tl.load(ANCH + i // TA, mask=m, other=0.0)
    if TAG > 0:
        MASK: tl.constexpr = (1 << TAG) - 1
        a = ((a.to(tl.int32, bitcast=True) + MASK) & ~MASK).to(tl.float32, bitcast=True)
        tl.store(AOUT + i // TA, a, mask=m & (i % TA == 0))
    # smallest step on the grid a * 2^(-c/P) that is >= need; then settled exactly (log2 may be off by one)
    ratio = tl.where(need > 0, tl.div_rn(need, tl.where(a > 0, a, 1.0)), 1.0)
    lg = -tl.log2(ratio)
    c = tl.floor(P * lg)
    if TAPER:  # LogLayout.guess_code: codes from FINE - 1 on are COARSE per octave
        c = tl.where(c > FINE - 1.0, (FINE - 1.0) + tl.floor((lg - tl.div_rn(FINE - 1.0, P)) * COARSE), c)
    c = tl.where(c == c, c, 0.0)  # NaN (an Inf input: inf / inf), which a minimum may pass on, indexes TAB
    c = tl.minimum(tl.maximum(c, 0.0), ZCODE - 1.0).to(tl.int32)
    s = a * tl.load(TAB + c, mask=m, other=0.0)
    short = s < need
    c = tl.where(short, tl.maximum(c - 1, 0), c)
    s = a * tl.load(TAB + c, mask=m, other=0.0)
    c1 = tl.minimum(c + 1, ZCODE - 1)
    s1 = a * tl.load(TAB + c1, mask=m, other=0.0)
    longer = (s1 >= need) & (c1 > c)
    c = tl.where(longer, c1, c)
    s = tl.where(longer, s1, s)
    zero = need <= 0
    c = tl.where(zero, ZCODE, c)
    s = tl.where(zero, 0.0, s)
    tl.store(SC + i, c.to(tl.uint8), mask=m)
    tl.store(S + i, s, mask=m)
    if SYM:
        tl.store(Z + i, tl.zeros_like(s), mask=m)
    else:
        lo = tl.load(LO + i, mask=m, other=0.0)
        hi = tl.load(HI + i, mask=m, other=0.0)
        L = _levels(LV, LVC, i, m, HAS_LV)
        kmin, kmax = _zero_range(KMN, KMIN_S, KMAX_S, N, i, m, EXT)
        u = (L + 1.0) * UNIT_F
        us = tl.where(zero, 1.0, u * s)
        k = tl.floor(tl.div_rn(lo, us))
        k = tl.minimum(tl.maximum(k, kmin), kmax)
        if HAS_SPARSE:  # zero = -j steps: 0 is a grid point
            aligned = tl.load(ALIGNED + i, mask=m, other=0) != 0
            j = tl.load(J + i, mask=m, other=0.0)
            k = tl.where(aligned & ~zero, tl.div_rn(-j, u), k)
        if ALIGN:  # prefer a zero that is a whole number of steps where it still covers the tile
            kal = tl.div_rn(tl.floor(k * u), u)
            ok = (kal * us + L * s >= hi) & (kal >= kmin)
            k = tl.where(ok, kal, k)
        z = (k * u) * s
        over = z > lo  # fp32 rounding put the zero just above the minimum
        if EXT:
            k = tl.where(over, tl.maximum(k - 1.0, kmin), k)
        else:
            k = tl.where(over, tl.maximum(k - 1.0, LKMIN), k)
        z = (k * u) * s
        tl.store(Z + i, z, mask=m)
        code = k - LKMIN
        if EXT:  # the zero field's low bits and the signed high part
            high = tl.floor(code * INV_ZSPAN)  # 1 / ZSPAN, exact: a power of two
            tl.store(ZC + i, (code - high * ZSPAN).to(tl.int32).to(tl.uint8), mask=m)
            tl.store(ZE + i, high.to(tl.int32), mask=m)
        else:
            tl.store(ZC + i, code.to(tl.int32).to(tl.uint8), mask=m)


def fit(lay, lo: torch.Tensor, hi: torch.Tensor, levels: torch.Tensor | int, symmetric: bool, anchor_rows: int,
        sparse: torch.Tensor | None = None, kmin: torch.Tensor | None = None, kmax: torch.Tensor | None = None,
        sq: torch.Tensor | None = None, tile: int = 0, a1: torch.Tensor | None = None,
        a2sq: torch.Tensor | None = None, kmn: torch.Tensor | None = None, out: dict[str, torch.Tensor] | None = None
        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``lay.fit(lo, hi, levels, symmetric, anchor_rows, codec, sparse, kmin=, kmax=)`` of a
    :class:`~qwire.codecs.layouts.LogLayout` (same results, same ``vals``), for ``(R, T)`` fp32 ``lo``, ``hi``
    on a GPU (the input checks have run: everything is finite). With ``sq`` (the tiles' sums of squares) and
    ``tile`` instead of ``sparse``: the outlier tiles are ``tiles.sparse_tiles(sq, lo, hi, levels, tile)``,
    computed in the kernel and returned in ``vals["sparse"]`` (bool); with ``a1`` and ``a2sq`` as well, TAH-Quant's
    ``_outlier_tiles`` (one or two outliers). ``kmn``: ``kmin`` and ``kmax`` as one contiguous ``(2, R, T)`` fp32
    tensor, instead of ``kmin=`` and ``kmax=``. ``out``: where to write some of ``vals`` (``anchor``, fp32; ``scale``,
    ``zero``, uint8), e.g. their fields in the payload, which then need no copy (:meth:`Sections.put` sees them in
    place)."""
    R, T = lo.shape
    n, dev = R * T, lo.device
    ext = kmin is not None or kmn is not None
    has_lv = isinstance(levels, torch.Tensor)  # else one number for every tile, passed as it is
    L = full_levels(levels, (R, T), dev).contiguous() if has_lv else lo
    lvc = 0.0 if has_lv else float(levels)
    lo, hi = lo.contiguous(), hi.contiguous()
    if kmn is None:
        kmn = torch.stack([kmin.expand(R, T), kmax.expand(R, T)]).to(torch.float32).contiguous() if ext else lo
    mode = 0 if symmetric else 1 if sparse is not None else (3 if a2sq is not None else 2) if sq is not None else 0
    sp = (_as_int8(sparse, R, T) if mode == 1
          else torch.empty(R, T, dtype=torch.int8, device=dev) if mode >= 2 else lo)
    need = torch.empty(R, T, device=dev)
    aligned = torch.empty(R, T, dtype=torch.int8, device=dev) if mode else need
    j = torch.empty(R, T, device=dev) if mode else need
    out = out or {}
    anchor = out["anchor"].zero_() if "anchor" in out else torch.zeros(cdiv(R, anchor_rows), device=dev)
    unit_f = float(lay.unit(0))
    grid = (cdiv(n, TILES_PER_PROGRAM),)
    launch(_need, grid, lo, hi, L, lvc, sq.contiguous() if mode >= 2 else lo, a1.contiguous() if mode == 3 else lo,
           a2sq.contiguous() if mode == 3 else lo, sp, kmn, float(lay.kmin), float(lay.kmax), n, T * anchor_rows,
           float(max(1, tile - 1)), float(max(1, tile - 2)), float(SPARSE_KAPPA), float(TWO_OUTLIERS ** 2), unit_f,
           need, aligned, j, anchor,
           SYM=symmetric, SPARSE_MODE=mode, EXT=ext, HAS_LV=has_lv, BT=TILES_PER_PROGRAM)
    z, s = torch.empty(R, T, device=dev), torch.empty(R, T, device=dev)
    sc = out["scale"] if "scale" in out else torch.empty(R, T, dtype=torch.uint8, device=dev)
    zc = out["zero"] if "zero" in out else torch.empty(R, T, dtype=torch.uint8, device=dev)
    ze = torch.empty(R, T, dtype=torch.int32, device=dev) if ext else zc
    rounded = torch.empty_like(anchor) if lay.tag_bits else anchor  # LogLayout.round_anchor, in _codes
    launch(_codes, grid, lo, hi, L, lvc, need, aligned, j, kmn, float(lay.kmin), float(lay.kmax), anchor, rounded,
           lay._table(dev), n, T * anchor_rows, unit_f, lay.zero_code, float(lay.kmin), float(1 << lay.zero_bits),
           1.0 / (1 << lay.zero_bits),
           float(lay.per_octave), float(lay.fine), float(lay.coarse), z, s, sc, zc, ze,
           SYM=symmetric, HAS_SPARSE=mode > 0, EXT=ext, ALIGN=lay.align, TAPER=lay.tapered, HAS_LV=has_lv,
           BT=TILES_PER_PROGRAM, TAG=lay.tag_bits)
    vals = {"anchor": rounded, "scale": sc}
    if mode >= 2:
        vals["sparse"] = sp.view(torch.bool)  # codes 0 and 1
    if symmetric:
        return z, s, vals
    vals["zero"] = zc
    if ext:
        vals["zero_ext"] = ze
    return z, s, vals


def _as_int8(sparse: torch.Tensor, R: int, T: int) -> torch.Tensor:
    """The outlier tiles ``sparse`` (bool, broadcastable to ``(R, T)``) as contiguous int8 ``(R, T)``: a view where
    they are that already (e.g. ``vals["sparse"]`` of an earlier fit), else a copy."""
    if sparse.dtype == torch.bool and sparse.shape == (R, T) and sparse.is_contiguous():
        return sparse.view(torch.int8)
    return sparse.to(torch.int8).expand(R, T).contiguous()
