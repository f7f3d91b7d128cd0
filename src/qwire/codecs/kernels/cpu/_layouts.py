"""The ``log`` / ``log6`` / ``logx`` metadata fit (:class:`qwire.codecs.layouts.LogLayout`) as a scalar loop
per tile.

Every line mirrors one torch operation of ``LogLayout.fit`` (with ``_through_zero``, the zero
extension and ``sparse_tiles``) in the same fp32 arithmetic, so the step and zero codes are the
reference's bit for bit: fp32 ``+ - * /`` and ``sqrt`` are correctly rounded on both sides, and the
step code, which the reference seeds with an fp32 ``log2``, is settled on both sides to the
canonical one (the largest code whose step covers the tile).
"""

from __future__ import annotations

import numpy as np

from ._common import njit
from ._fastpack import bits_of_f32, div32, f32_of_bits, fma32
from ._portable import tree_sum_buf
from ._simd import lane_sse8x4, tree_sse8x4
from ._tah import load_tile

f32 = np.float32
SPARSE_NONE, SPARSE_COMPUTE, SPARSE_GIVEN = 0, 1, 2


@njit(inline="always")
def _sparse(lo, hi, ss, L, tile, kappa):
    a1 = max(hi, -lo)
    rest = ss - a1 * a1
    if rest < 0:
        rest = f32(0.0)
    rest = div32(rest, f32(max(1, tile - 1)))
    return np.sqrt(rest) < div32(f32(kappa) * (hi - lo), L)


@njit(inline="always")
def _through_zero(lo, hi, L, u, kmin):
    """(use it, j, step) of ``LogLayout._through_zero`` for one tile (its ``sparse`` factor aside)."""
    width = hi - lo if hi > lo else f32(1.0)
    j0 = np.floor(div32(L * (-lo), width))
    if j0 < 1:
        j0 = f32(1.0)
    best_s = f32(0.0)
    best_j = f32(0.0)
    for i in range(2):
        j = j0 + f32(i)
        j = min(j, L - f32(1.0))
        sj = max(div32(-lo, j), div32(hi, L - j))
        if i == 0 or sj < best_s:
            best_s = sj
            best_j = j
    ok = (lo < 0) and (hi > 0) and (L >= 3) and (u <= 1) and (div32(best_j, u) <= -kmin)
    return ok, best_j, best_s


@njit(inline="always")
def _need(l, h, L, kmn, kmx, ss, sp_given, symmetric, sparse_mode, tile, kappa, unit_f, margin):
    """(step needed, grid offset j of a through-zero grid or -1) of one tile: the first half of
    ``LogLayout.fit``, written without branches so that the loop over tiles vectorizes."""
    if symmetric:
        return div32(max(h, -l), np.floor(L * f32(0.5))), f32(-1.0)
    u = (L + f32(1.0)) * unit_f
    nd = div32(h - l, L - u)
    nd = max(nd, div32(l, kmn * u))
    nd = max(nd, div32(h, kmx * u + L))
    if sparse_mode == 0:
        return nd, f32(-1.0)
    if sparse_mode == 1:
        sp = _sparse(l, h, ss, L, tile, kappa)
    else:
        sp = sp_given
    ok, j, sj = _through_zero(l, h, L, u, kmn)
    use = sp & ok
    return (sj * margin if use else nd), (j if use else f32(-1.0))


@njit(inline="always")
def _need_loop(lo, hi, ss, Lt, sparse, kminT, kmaxT, need, jal, n, ext, symmetric, sparse_mode, tile, kappa,
               unit_f, margin, kmin0, kmax0):
    for i in range(n):
        kmn = kminT[i] if ext else f32(kmin0)
        kmx = kmaxT[i] if ext else f32(kmax0)
        spg = sparse[i] if sparse_mode == 2 else False
        ssi = ss[i] if sparse_mode == 1 else f32(0.0)
        nd, j = _need(lo[i], hi[i], Lt[i], kmn, kmx, ssi, spg, symmetric, sparse_mode, tile, kappa, unit_f, margin)
        need[i] = nd
        jal[i] = j


# log2(1 + f) ~ f (L1 + L2 f + L3 f^2 + L4 f^3) on [0, 1) (least squares, error below 2e-4)
L1, L2, L3, L4 = f32(1.43854819), f32(-0.67809125), f32(0.3236499), f32(-0.08429681)


@njit(inline="always")
def _guess(nd, a, per_octave, zero_code):
    """A guess g of a tile's step code from ``per_octave * log2(a / nd)`` (error below 0.01 codes), lowered
    by 0.05 so that the canonical code is g or g + 1 (see :func:`_code`); branch-free, vectorizes. In a tapered
    layout's coarse codes (``log6t``) the guess misses, and :func:`log_fit_rows` settles those tiles' codes one
    step at a time."""
    b = bits_of_f32(div32(a, nd))
    f = f32_of_bits((b & 0x7FFFFF) | 0x3F800000) - f32(1.0)
    lg = f32((b >> 23) & 0xFF) - f32(127.0) + f * (L1 + f * (L2 + f * (L3 + f * L4)))
    q = np.floor(f32(per_octave) * lg - f32(0.05))
    return np.uint8(min(max(q, f32(0.0)), f32(zero_code - 1)))


@njit(inline="always")
def _code(nd, g, P, zero_code):
    """(step code, step, guess missed) of a tile from its guess ``g``: the canonical code is the largest
    c < zero_code with ``P[c] = a * tab[c] >= nd`` (zero_code for a step of 0); the tile is flagged when
    it is neither g nor g + 1."""
    top = np.uint32(zero_code - 1)
    g = np.uint32(g)  # unsigned: indexing needs no wraparound test
    g1 = min(g + np.uint32(1), top)
    g2 = min(g + np.uint32(2), top)
    p0 = P[g]
    p1 = P[g1]
    p2 = P[g2]
    up = (g1 > g) & (p1 >= nd)
    miss = (p0 < nd) | ((g2 > g1) & (p2 >= nd))
    pos = nd > 0
    c = g1 if up else g
    st = p1 if up else p0
    return (c if pos else np.uint32(zero_code)), (st if pos else f32(0.0)), miss & pos


@njit(inline="always")
def _zero(l, h, L, kmn, nd, st, j, kmin0, kmax_, unit_f, align, ext, inv_span, span):
    """(decoded zero, stored zero code, its high part) of one tile: the second half of ``LogLayout.fit``."""
    u = (L + f32(1.0)) * unit_f
    zero = nd <= 0
    us = f32(1.0) if zero else u * st
    k = np.floor(div32(l, us))
    k = min(max(k, kmn), kmax_)
    if (j >= 0) & (not zero):
        k = div32(-j, u)
    if align:
        kal = div32(np.floor(k * u), u)
        if (kal * us + L * st >= h) & (kal >= kmn):
            k = kal
    zz = (k * u) * st
    if zz > l:
        k = max(k - f32(1.0), kmn)
        zz = (k * u) * st
    code = k - f32(kmin0)
    hp = np.floor(code * inv_span) if ext else f32(0.0)
    return zz, code - hp * span, hp


@njit
def log_fit_rows(r0, r1, lo, hi, sumsq, Lt, symmetric, sparse_mode, sparse, ext, kminT, kmaxT, tile, kappa,
                 anchor_rows, per_octave, zero_code, kmin0, kmax0, zero_span, zero_bits, align, tab, tag_mask,
                 need, jal, z, s, ccode, kcode, khigh, anchor):
    """Fit rows r0..r1 (whole anchor blocks; r1 may be the last row) of per-tile ``lo``, ``hi``,
    ``sumsq`` and levels ``Lt`` (all (R, T) fp32): writes ``z``, ``s`` (decoded zero and step),
    ``ccode`` (step code), ``kcode`` (zero code, biased by -kmin) and ``anchor`` per block.

    ``sparse_mode``: 0 no outlier-tile test (symmetric), 1 computed here from ``sumsq``, 2 given in
    ``sparse`` (R, T). ``ext``: zero extension, per-tile code range ``kminT``/``kmaxT`` (R, T) fp32,
    the high part of each zero code into ``khigh`` (R, T) int32. ``need`` and ``jal`` are (R, T) fp32
    scratch (``jal``: the grid offset j of tiles whose grid passes through 0, else -1).

    Each step is a loop over the tiles of a block without branches (a step code whose guess missed
    its window - a tapered layout's coarse codes - is settled one step at a time)."""
    T = lo.shape[1]
    R = lo.shape[0]
    n_all = R * T
    lo1, hi1, ss1, L1 = lo.reshape(n_all), hi.reshape(n_all), sumsq.reshape(n_all), Lt.reshape(n_all)
    sp1, kn1, kx1 = sparse.reshape(sparse.size), kminT.reshape(kminT.size), kmaxT.reshape(kmaxT.size)
    need1, jal1, z1, s1 = need.reshape(n_all), jal.reshape(n_all), z.reshape(n_all), s.reshape(n_all)
    cc1, kc1, kh1 = ccode.reshape(n_all), kcode.reshape(n_all), khigh.reshape(n_all)
    unit_f = f32(zero_span / float(1 << (zero_bits - 1)))
    margin = f32(1.0 + 2.0 ** -20)
    span = f32(1 << zero_bits)
    inv_span = f32(1.0 / (1 << zero_bits))
    P = np.empty(zero_code, dtype=np.float32)
    for b0 in range(r0, r1, anchor_rows):
        b1 = min(b0 + anchor_rows, r1)
        i0 = b0 * T
        n = (b1 - b0) * T
        i1 = i0 + n
        lo_, hi_, ss_, L_ = lo1[i0:i1], hi1[i0:i1], ss1[i0:i1], L1[i0:i1]
        sp_ = sp1[i0:i1] if sparse_mode == 2 else sp1[:0]
        kn_, kx_ = (kn1[i0:i1], kx1[i0:i1]) if ext else (kn1[:0], kx1[:0])
        need_, jal_ = need1[i0:i1], jal1[i0:i1]
        # the constant flags select specialized copies of each loop
        if symmetric:
            _need_loop(lo_, hi_, ss_, L_, sp_, kn_, kx_, need_, jal_, n, False, True, 0, tile, kappa, unit_f,
                       margin, kmin0, kmax0)
        elif ext:
            if sparse_mode == 2:
                _need_loop(lo_, hi_, ss_, L_, sp_, kn_, kx_, need_, jal_, n, True, False, 2, tile, kappa, unit_f,
                           margin, kmin0, kmax0)
            else:
                _need_loop(lo_, hi_, ss_, L_, sp_, kn_, kx_, need_, jal_, n, True, False, sparse_mode, tile, kappa,
                           unit_f, margin, kmin0, kmax0)
        elif sparse_mode == 1:
            _need_loop(lo_, hi_, ss_, L_, sp_, kn_, kx_, need_, jal_, n, False, False, 1, tile, kappa, unit_f,
                       margin, kmin0, kmax0)
        elif sparse_mode == 2:
            _need_loop(lo_, hi_, ss_, L_, sp_, kn_, kx_, need_, jal_, n, False, False, 2, tile, kappa, unit_f,
                       margin, kmin0, kmax0)
        else:
            _need_loop(lo_, hi_, ss_, L_, sp_, kn_, kx_, need_, jal_, n, False, False, 0, tile, kappa, unit_f,
                       margin, kmin0, kmax0)
        a0 = f32(0.0)
        a1 = f32(0.0)
        a2 = f32(0.0)
        a3 = f32(0.0)
        i = 0
        while i + 4 <= n:
            a0 = max(a0, need_[i])
            a1 = max(a1, need_[i + 1])
            a2 = max(a2, need_[i + 2])
            a3 = max(a3, need_[i + 3])
            i += 4
        while i < n:
            a0 = max(a0, need_[i])
            i += 1
        a = max(max(a0, a1), max(a2, a3))
        if tag_mask:  # LogLayout.round_anchor: up to a multiple of tag_mask + 1 units in the last place
            a = f32_of_bits((bits_of_f32(a) + np.int32(tag_mask)) & np.int32(~tag_mask))
        anchor[b0 // anchor_rows] = a
        for c in range(zero_code):
            P[c] = a * tab[c]
        s_, cc_ = s1[i0:i1], cc1[i0:i1]
        bad = 0
        for i in range(n):
            cc_[i] = _guess(need_[i], a, per_octave, zero_code)
        for i in range(n):
            c, st, miss = _code(need_[i], cc_[i], P, zero_code)
            cc_[i] = c
            s_[i] = st
            bad += 1 if miss else 0
        if bad:  # a tapered layout's coarse codes: settle those codes one step at a time
            for i in range(n):
                nd = need_[i]
                if nd <= 0:
                    continue
                c = np.int64(cc_[i])
                while c > 0 and P[c] < nd:
                    c -= 1
                while c + 1 <= zero_code - 1 and P[c + 1] >= nd:
                    c += 1
                cc_[i] = c
                s_[i] = P[c]
        if symmetric:
            z1[i0:i1] = f32(0.0)
            continue
        z_, kc_, kh_ = z1[i0:i1], kc1[i0:i1], kh1[i0:i1]
        if ext:
            for i in range(n):
                zz, code, hp = _zero(lo_[i], hi_[i], L_[i], kn_[i], need_[i], s_[i], jal_[i], kmin0, kx_[i], unit_f,
                                     align, True, inv_span, span)
                z_[i] = zz
                kc_[i] = np.uint8(np.int32(code))
                kh_[i] = np.int32(hp)
        else:
            for i in range(n):
                zz, code, hp = _zero(lo_[i], hi_[i], L_[i], f32(kmin0), need_[i], s_[i], jal_[i], kmin0,
                                     f32(kmax0), unit_f, align, False, inv_span, span)
                z_[i] = zz
                kc_[i] = np.uint8(np.int32(code))


@njit
def log_read(anchor, ar, scale, zero, tab, kmin, zbits, u_hi, u_lo, high, zext, symmetric, z, s):
    """``LogLayout.read`` of every row into ``z``, ``s`` (R, T) fp32: ``s = anchor[r // ar] * tab[code]``
    (a code past the table is the zero step: ``anchor * 0``), ``z = (k * u) * s`` with
    ``k = zero + kmin`` (``+ zext * 2**zbits`` when ``zext`` has columns) and the zero unit ``u = u_hi``
    where ``high`` (or when it has no columns), else ``u_lo``; ``z = 0`` when ``symmetric``."""
    R, T = s.shape
    nt = tab.shape[0]
    per_tile = high.shape[1] > 0
    ext = zext.shape[1] > 0
    span = f32(1 << zbits)
    fk = f32(kmin)
    for r in range(R):
        a = anchor[r // ar]
        sc = scale[r * T: (r + 1) * T]
        for t in range(T):
            c = sc[t]
            s[r, t] = a * (tab[c] if c < nt else f32(0.0))
        if symmetric:
            for t in range(T):
                z[r, t] = f32(0.0)
            continue
        zc = zero[r * T: (r + 1) * T]
        for t in range(T):
            k = f32(zc[t]) + fk
            if ext:
                k = k + f32(zext[r, t]) * span
            u = u_hi if not per_tile or high[r, t] else u_lo
            z[r, t] = (k * u) * s[r, t]


@njit(inline="always")
def _inv_bias(zz, st):
    """``1/st`` (0 where st <= 0) and ``-(zz / st)`` as ``_errors`` computes them."""
    inv = f32(1.0) / st if st > 0 else f32(0.0)
    return inv, -(zz * inv)


@njit(inline="always")
def _errors(x_, e_, zz, st, top):
    """``e_[i] = d * d`` for the values ``x_`` quantized on the asymmetric grid (zz, st) with codes 0..top, as the
    reference computes them: ``quantize_``'s code (``fma(x, 1/s, -z/s)`` clamped, rounded half to even), then
    ``d = x - (z + q s)``. (:func:`~._simd.lane_sse8x4` and :func:`~._simd.tree_sse8`: the same, 8 at a time.)"""
    zero = f32(0.0)
    magic = f32(12582912.0)
    inv, bias = _inv_bias(zz, st)
    for i in range(x_.shape[0]):
        x = x_[i]
        v = fma32(x, inv, bias)
        v = v if v > zero else zero  # (not min/max: these keep the loop from vectorizing)
        v = v if v < top else top
        d = x - (zz + ((v + magic) - magic) * st)
        e_[i] = d * d


@njit(inline="always")
def _lanes(e, G):
    """``e[:G]`` summed as ``LogLayout.tile_sse`` sums it: element i into lane i % 8, in order (lanes a tile of
    fewer than 8 leaves empty hold 0), then ``((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))``. ``e``:
    fp32 scratch of max(G, 8), destroyed."""
    zero = f32(0.0)
    full = G - G % 8
    for i in range(G, 8):
        e[i] = zero
    a_ = e[:8]
    for c0 in range(8, full, 8):
        c_ = e[c0: c0 + 8]
        for j in range(8):
            a_[j] += c_[j]
    if G > 8:
        t_ = e[full: G]
        for j in range(G - full):
            a_[j] += t_[j]
    return ((e[0] + e[4]) + (e[2] + e[6])) + ((e[1] + e[5]) + (e[3] + e[7]))


@njit(inline="always")
def _sse(buf, G, st, top, h, e):
    """Squared error of one tile ``buf[:G]`` quantized on the symmetric grid of step ``st``, as
    ``LogLayout.tile_sse`` computes it (the same fp32 operations in the same order): the codes of ``quantize_``
    (``fma(x, 1/s, h)`` clamped to [0, top], rounded half to even), ``d = x - (q - h) s``, ``d * d`` summed
    by :func:`_lanes`. ``e``: fp32 scratch of max(G, 8). (Asymmetric tiles: :func:`_mse_tile`.)"""
    zero = f32(0.0)
    b_ = buf[:G]
    e_ = e[:G]
    inv = f32(1.0) / st if st > 0 else zero
    magic = f32(12582912.0)
    for i in range(G):
        x = b_[i]
        v = fma32(x, inv, h)
        v = v if v > zero else zero
        v = v if v < top else top
        d = x - (((v + magic) - magic) - h) * st
        e_[i] = d * d
    return _lanes(e, G)


@njit(inline="always")
def _first_lowest(ce, n):
    """Index of the first lowest of ``ce[:n]`` by ``<``, as the reference picks it (nothing is lower than a NaN,
    and a NaN is lower than nothing), without a branch on the values."""
    b, best = 0, ce[0]
    for i in range(1, n):
        v = ce[i]
        lower = v < best
        b = i if lower else b
        best = v if lower else best
    return b


@njit(inline="always")
def _set_grid(P, j, t, zz, st, top):
    """Column ``t`` of grid row ``j`` of ``P`` (5, n, T): (zz, st, 1/st, -(zz/st), top) as :func:`_errors`
    computes them."""
    inv, bias = _inv_bias(zz, st)
    P[0, j, t], P[1, j, t], P[2, j, t], P[3, j, t], P[4, j, t] = zz, st, inv, bias, top


@njit(inline="always")
def _row_grids(T, lo, hi, Lt, live, a, tab, zero_code, fkmin, fkmax, unit_f, finer, shifts, zr, sr, scr, zer,
               P, K, Cc, ok, kc, sc_, cc_):
    """The candidate grids of ``mse_rows`` for the T asymmetric tiles of one row (their ranges ``lo``..``hi``,
    levels ``Lt``, block anchor ``a``; the covering fit's ``zr``, ``sr``, step and zero codes ``scr``,
    ``zer``), in the reference's order: row 0 the covering grid, then per finer step code (``finer``) the
    centred zero and its ``shifts`` (the shifted ones only where a unit is under a step). Writes the grids to
    ``P`` (5, n, T), their zero and step codes to ``K``, ``Cc`` (n, T), and ``ok`` (n, T): whether tile t
    tries grid j (a live tile, the shift allowed, the zero code in range). Each loop runs across the tiles
    (``kc``, ``sc_``, ``cc_``: scratch of T)."""
    half, one = f32(0.5), f32(1.0)
    for t in range(T):
        _set_grid(P, 0, t, zr[t], sr[t], Lt[t])
        K[0, t], Cc[0, t], ok[0, t] = f32(zer[t]) + fkmin, np.int64(scr[t]), live[t]
    j = 1
    for d in finer:
        for t in range(T):
            c = min(np.int64(scr[t]) + d, zero_code - 1)
            sc = a * tab[c]
            L = Lt[t]
            u = (L + one) * unit_f
            kc[t] = np.floor(div32((lo[t] + hi[t]) * half - (L * sc) * half, u * sc) + half)
            sc_[t], cc_[t] = sc, c
        for m in range(shifts.shape[0]):
            sh = f32(shifts[m])
            for t in range(T):
                L = Lt[t]
                u = (L + one) * unit_f
                k = kc[t] + sh
                ok[j, t] = live[t] and (m == 0 or u < one) and not (k < fkmin or k > fkmax)
                _set_grid(P, j, t, (k * u) * sc_[t], sc_[t], L)
                K[j, t], Cc[j, t] = k, cc_[t]
            j += 1


@njit(inline="always")
def _tried(ok, n, t, idx):
    """The rows j < n of the grids tile ``t`` tries (``ok[j, t]``) into ``idx``, in order, and three zeros after
    them; returns their count."""
    m = 0
    for j in range(n):  # (written always, kept where ok: no branch on the flags)
        idx[m] = j
        m += np.int64(ok[j, t])
    for j in range(m, m + 3):
        idx[j] = 0
    return m


@njit(inline="always")
def _pick(src, o, G, t, P, ok, n, idx, ce):
    """The first grid of lowest squared error among the rows j < n of ``P`` where ``ok[j, t]`` for the tile
    ``src[o:o + G]`` (column ``t``; ``ok[0, t]`` holds; G a multiple of 8), each error as ``LogLayout.tile_sse``
    computes it: four grids at a time by :func:`~._simd.lane_sse8x4`. ``idx``, ``ce``: scratch of n + 3."""
    m = _tried(ok, n, t, idx)
    for i0 in range(0, m, 4):
        lane_sse8x4(src, o, G // 8, P, t, P.shape[2], idx, i0, ce)
    return idx[_first_lowest(ce, m)]


@njit
def _pick_scalar(src, o, G, t, P, ok, n, idx, ce, e):
    """:func:`_pick` for any G: :func:`_errors` summed by :func:`_lanes` (``e``: scratch of max(G, 8)). (A branch
    to this inside :func:`_pick` makes the compiled loop of the common case twice as slow.)"""
    m = _tried(ok, n, t, idx)
    for i in range(m):
        _errors(src[o:o + G], e[:G], P[0, idx[i], t], P[1, idx[i], t], P[4, idx[i], t])
        ce[i] = _lanes(e, G)
    return idx[_first_lowest(ce, m)]


@njit
def mse_rows(r0, r1, X, G, lo, hi, Lt, mask, use_mask, symmetric, anchor, ar, tab, zero_code, kmin, kmax, unit_f,
             finer, shifts, z, s, scale, zero):
    """``LogLayout.refine`` (``fit=mse``) of rows r0..r1 in place (``lo``, ``hi``: the tiles' ranges, (R, T)
    fp32): ``z``, ``s`` (R, T) fp32 and the step
    and zero codes ``scale``, ``zero`` (R, T) uint8 (the zero biased by -kmin) that the covering fit wrote.
    Tiles where ``use_mask`` and not ``mask`` (R, T), and zero-step tiles, keep the covering fit. The
    candidates, their order and the first-lowest-error rule are the reference's."""
    C = X.shape[1]
    T = s.shape[1]
    buf = np.empty(G, dtype=np.float32)
    err = np.empty(max(G, 8), dtype=np.float32)
    fkmin, fkmax = f32(kmin), f32(kmax)
    half = f32(0.5)
    if not symmetric:
        n = 1 + finer.shape[0] * shifts.shape[0]
        P = np.empty((5, n, T), dtype=np.float32)
        K, Cc, ok = np.empty((n, T), dtype=np.float32), np.empty((n, T), dtype=np.int64), np.empty((n, T), np.bool_)
        kc, sc_, cc_ = np.empty(T, dtype=np.float32), np.empty(T, dtype=np.float32), np.empty(T, dtype=np.int64)
        live = np.empty(T, dtype=np.bool_)
        idx, ce = np.empty(n + 3, dtype=np.int64), np.empty(n + 3, dtype=np.float32)
        for r in range(r0, r1):
            xr = X[r]
            for t in range(T):
                live[t] = (not use_mask or mask[r, t]) and np.int64(scale[r, t]) < zero_code
            _row_grids(T, lo[r], hi[r], Lt[r], live, anchor[r // ar], tab, zero_code, fkmin, fkmax, unit_f, finer,
                       shifts, z[r], s[r], scale[r], zero[r], P, K, Cc, ok, kc, sc_, cc_)
            for t in range(T):
                if not live[t]:
                    continue
                if (t + 1) * G > C:  # the padded last tile
                    load_tile(xr, t * G, G, C, buf)
                    b = _pick_scalar(buf, 0, G, t, P, ok, n, idx, ce, err)
                elif G % 8 == 0:
                    b = _pick(xr, t * G, G, t, P, ok, n, idx, ce)
                else:
                    b = _pick_scalar(xr, t * G, G, t, P, ok, n, idx, ce, err)
                z[r, t], s[r, t], scale[r, t] = P[0, b, t], P[1, b, t], np.uint8(Cc[b, t])
                zero[r, t] = np.uint8(np.int32(K[b, t] - fkmin))
        return
    for r in range(r0, r1):
        xr = X[r]
        a = anchor[r // ar]
        for t in range(T):
            if use_mask and not mask[r, t]:
                continue
            c0 = np.int64(scale[r, t])
            if c0 >= zero_code:
                continue
            load_tile(xr, t * G, G, C, buf)
            h = np.floor(Lt[r, t] * half)
            top = f32(2.0) * h
            bz, bs, bc = z[r, t], s[r, t], c0
            best = _sse(buf, G, bs, top, h, err)
            for d in finer:  # symmetric grids: the zero stays 0
                c = min(c0 + d, zero_code - 1)
                sc = a * tab[c]
                e = _sse(buf, G, sc, top, h, err)
                if e < best:
                    best, bz, bs, bc = e, f32(0.0), sc, c
            z[r, t] = bz
            s[r, t] = bs
            scale[r, t] = np.uint8(bc)


@njit(inline="always")
def _block_grid(cand, ck, n, zz, st, L, c, k, keep):
    """Row ``n`` of a two-width block's candidate table: ``cand[n]`` = the narrow grid (zz, st / 2, its inverse and
    bias, 2 L + 1 levels) and the wide one (zz, st, ..., L) as :func:`_errors` computes them, ``ck[n]`` = the
    step and zero codes (c, k); returns n + 1 where ``keep``, else n (the row is written either way: no branch
    on ``keep``)."""
    sn = st * f32(0.5)
    cand[n, 0], cand[n, 1], cand[n, 4] = zz, sn, L * f32(2.0) + f32(1.0)
    cand[n, 2], cand[n, 3] = _inv_bias(zz, sn)
    cand[n, 5], cand[n, 6], cand[n, 9] = zz, st, L
    cand[n, 7], cand[n, 8] = _inv_bias(zz, st)
    ck[n, 0], ck[n, 1] = f32(c), k
    return n + np.int64(keep)


@njit(inline="always")
def _block_pick(y, G, nw, cand, n, lv, ce, e):
    """The first of the n candidate grids in ``cand`` (:func:`_block_grid`) of lowest squared error for the
    two-width block ``y[:G]`` (G a power of two, ``2**lv`` runs of 8 where G >= 8), as
    ``LogLayout.refine_blocks`` computes it: the first ``nw`` values on the narrow grid, the others on the wide
    one (``quantize_``'s codes), ``d = y - (z + q step)``, ``d * d`` added pairwise (``portable.tree_sum``; four
    grids at a time by :func:`~._simd.tree_sse8x4` where G >= 8). ``cand`` has n + 3 rows (those from n on are
    overwritten); ``ce``: scratch of n + 3; ``e``: of 4 G."""
    if G >= 8:
        for j in range(n, n + 3):
            for f in range(10):
                cand[j, f] = cand[0, f]
        for g0 in range(0, n, 4):
            tree_sse8x4(y, 0, G // 8, lv, nw, cand, g0, ce, e)
    else:
        for j in range(n):
            _errors(y[:nw], e[:nw], cand[j, 0], cand[j, 1], cand[j, 4])
            _errors(y[nw:G], e[nw:G], cand[j, 5], cand[j, 6], cand[j, 9])
            ce[j] = tree_sum_buf(e, G)
    return _first_lowest(ce, n)


@njit
def mse_blocks_rows(r0, r1, rot, rotpos, G, nw, lo, hi, Lt, anchor, ar, tab, zero_code, lay_kmin, zero_bits, kmin,
                    kmax, has_ext, unit_f, finer, shifts, padded, z, s, scale, zero, khigh, wblk, pb):
    """``LogLayout.refine_blocks`` (``fit_rotated``) of the rotated tiles of rows r0..r1 in place: tile (r, t) is
    rotated where ``rotpos[r, t] >= 0``, its rotated values in ``rot[rotpos[r, t]]``; ``Lt`` its narrow width's
    levels, ``kmin``/``kmax`` (R, T) its zero code's range (``has_ext``: the zero extension, whose high part
    ``khigh`` is read and written; else the layout's own range, ``kmin[0, 0]``/``kmax[0, 0]`` unused). With
    ``padded``, the last tile of each row (padded) keeps its grid. ``wblk`` non-empty (``zero_width=block``):
    row r's rotated tiles have ``G - pb - wblk[r // ar]`` wide elements, not ``nw``. The candidates, their order
    and the first-lowest-error rule are the reference's."""
    T = s.shape[1]
    e = np.empty(4 * G, dtype=np.float32)
    nc = 1 + finer.shape[0] * shifts.shape[0]
    cand, ck, ce = np.empty((nc + 3, 10), np.float32), np.empty((nc, 2), np.float32), np.empty(nc + 3, np.float32)
    lv = 0
    while (8 << lv) < G:
        lv += 1
    half = f32(0.5)
    span = f32(1 << zero_bits)
    fkmin0 = f32(lay_kmin)
    for r in range(r0, r1):
        a = anchor[r // ar]
        nwv = G - pb - wblk[r // ar] if wblk.size else nw
        for t in range(T - 1 if padded else T):
            k_ = rotpos[r, t]
            if k_ < 0:
                continue
            c0 = np.int64(scale[r, t])
            y = rot[k_]
            L = Lt[r, t]
            bk = f32(zero[r, t]) + fkmin0
            if has_ext:
                bk = bk + f32(khigh[r, t]) * span
                lo_k, hi_k = kmin[r, t], kmax[r, t]
            else:
                lo_k, hi_k = fkmin0, f32(lay_kmin + (1 << zero_bits) - 1)
            n = _block_grid(cand, ck, 0, z[r, t], s[r, t], L, c0, bk, True)
            if c0 < zero_code:
                mid = (lo[r, t] + hi[r, t]) * half
                u = (L + f32(1.0)) * unit_f
                for d in finer:
                    c = min(c0 + d, zero_code - 1)
                    sc = a * tab[c]
                    us = u * sc
                    kc = np.floor(div32(mid - (L * sc) * half, us if us != 0 else f32(1.0)) + half)
                    nsh = shifts.shape[0] if u < f32(1.0) else 1  # shifts[0] is 0; the others where u < 1
                    for j in range(nsh):
                        k = kc + f32(shifts[j])
                        n = _block_grid(cand, ck, n, (k * u) * sc, sc, L, c, k, not (k < lo_k or k > hi_k))
            b = _block_pick(y, G, nwv, cand, n, lv, ce, e) if n > 1 else 0
            z[r, t] = cand[b, 5]
            s[r, t] = cand[b, 6]
            scale[r, t] = np.uint8(np.int64(ck[b, 0]))
            code = ck[b, 1] - fkmin0
            if has_ext:
                high = np.floor(code * (f32(1.0) / span))
                khigh[r, t] = np.int32(high)
                code = code - high * span
            zero[r, t] = np.uint8(np.int32(code))
