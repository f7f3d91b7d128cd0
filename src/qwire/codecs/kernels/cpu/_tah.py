"""numba passes of TAH-Quant (:mod:`qwire.codecs.tahquant`), each repeating the reference's fp32
operations in its order.

A: per tile ``lo``, ``hi``, sum of squares, ``a1`` = largest magnitude, its first position, ``a2`` =
   the largest magnitude elsewhere, and the entropy of the magnitudes (tile unit) or per token.
B: the reference's per-tile decisions on A's statistics, row by row (``decide_b``): which tiles
   rotate (rotated, pivot swap then the Sylvester butterfly of
   :func:`qwire.codecs.hadamard.hadamard_transform`, into a side buffer, with their new range), the
   slot order, the allocation, the levels, the outlier tiles and the zero-code range.
   ``pass_ab`` runs A and B on a few rows at a time, so that B finds the rows in cache.
C: quantize every tile against its zero and step with its own width and pack the codes into
   the ``high`` and ``low`` streams.
D: unpack, dequantize, un-rotate.
"""

from __future__ import annotations

import numpy as np

from ._common import njit
from ._fastpack import bits_of_f32, f32_of_bits, fma32, pack, unpack
from ._portable import TINY32, entropy_buf, log_approx_buf
from ._simd import entropy_sums8, minmax_sumsq8, mul_h32, pivot8, stages
from ._tiles import minmax_sumsq

SUB = 8


@njit(inline="always")
def load_tile(xr, c0, G, C, buf):
    """Tile starting at channel c0 of row xr into buf[:G] (padding repeats the row's last element);
    returns the number of real channels."""
    n = min(G, C - c0)
    for i in range(n):
        buf[i] = xr[c0 + i]
    for i in range(n, G):
        buf[i] = xr[C - 1]
    return n


@njit
def stats_a(r0, r1, X, G, unit_tile, want_h, lo, hi, sumsq, a1, a2, piv, H, Hrow):
    """Pass A over rows r0..r1 of X (R, C) fp32 (see the module docstring). ``want_h``: compute
    entropies (into ``H`` (R, T) for the tile unit, ``Hrow`` (R,) for the token unit).

    A tile's entropy sums run eight lanes at a time (``entropy_sums8``) when G is a power of two >= 8;
    then the logarithms of the T tile sums are one loop over the row's tiles."""
    C = X.shape[1]
    T = lo.shape[1]
    P = T * G
    p2t = 1
    while p2t < G:
        p2t *= 2
    p2r = 1
    while p2r < P:
        p2r *= 2
    ab = np.empty(max(P, p2r), dtype=np.float32)  # magnitudes in channel order (padding 0)
    ib = ab.view(np.int32)
    lg = np.empty(T, dtype=np.float32)
    hb = np.empty(3 * max(p2r, p2t), dtype=np.float32)
    eb = np.empty(2 * G, dtype=np.float32)
    xs = np.empty(T, dtype=np.float32)
    ent8 = G >= 8 and G == p2t and G % 8 == 0
    lv8 = 0
    while (8 << lv8) < G:
        lv8 += 1
    tot = np.empty(T, dtype=np.float32)
    ltot = np.empty(T, dtype=np.float32)
    zero = np.float32(0.0)
    vec = G % 8 == 0
    Xf = X.reshape(X.size)
    need_ab = want_h or not vec or C % G != 0  # the magnitudes feed the entropy and the scalar pivot search
    for r in range(r0, r1):
        xr = X[r]
        if need_ab:
            for c in range(C):
                ab[c] = abs(xr[c])
            for c in range(C, P):
                ab[c] = zero
        for t in range(T):
            c0 = t * G
            n = min(G, C - c0)
            if vec and n == G:
                l, h, sq = minmax_sumsq8(Xf, r * C + c0, G // 8)
                l = l + zero
                h = h + zero
            else:
                l, h, sq = minmax_sumsq(xr[c0: c0 + n], n, G, xr[C - 1])
            lo[r, t] = l
            hi[r, t] = h
            sumsq[r, t] = np.float32(sq)
            big = max(h, -l)
            a1[r, t] = big
            # on the bit patterns of the magnitudes (ordered as the values): the first position of the
            # largest, and the largest elsewhere (the largest itself when it occurs twice), branch-free
            bb = np.int32(bits_of_f32(big))
            if vec and n == G:
                b, cnt, m2 = pivot8(Xf, r * C + c0, G // 8, np.int64(bb))
            else:
                ib_ = ib[c0: c0 + G]
                b = G
                m2 = 0
                cnt = 0
                for j in range(G):
                    v = ib_[j]
                    eq = v == bb
                    b = min(b, j if eq else G)
                    m2 = max(m2, v if v < bb else 0)
                    cnt += 1 if eq else 0
            a2[r, t] = big if cnt >= 2 else f32_of_bits(np.int32(m2))
            piv[r, t] = b if b < G else 0
        if not want_h:
            continue
        if unit_tile:
            for t in range(T):
                c0 = t * G
                if ent8 and c0 + G <= C:
                    s_, x_ = entropy_sums8(Xf, r * C + c0, G // 8, lv8, eb, 0)
                    tot[t] = s_
                    xs[t] = x_
                else:  # a short last tile (its padding is 0) or G not a power-of-two multiple of 8
                    tot[t] = np.float32(0.0)
                    xs[t] = entropy_buf(ab[c0: c0 + G], G, p2t, hb)
            for t in range(T):
                ltot[t] = tot[t] if tot[t] > 0 else np.float32(1.0)
            log_approx_buf(ltot, lg, T)
            for t in range(T):
                if tot[t] > 0:
                    H[r, t] = lg[t] - xs[t] / tot[t]
                elif ent8 and t * G + G <= C:
                    H[r, t] = zero
                else:
                    H[r, t] = xs[t]
        else:
            for j in range(P, p2r):
                ab[j] = zero
            Hrow[r] = entropy_buf(ab, P, p2r, hb)


@njit(inline="always")
def butterfly(y, G):
    """In place: the normalized Sylvester Hadamard transform of y[:G], in the order of
    :func:`qwire.codecs.hadamard.hadamard_transform`."""
    h = 1
    while h < G:
        for blk in range(0, G, 2 * h):
            for j in range(blk, blk + h):
                a = y[j]
                b = y[j + h]
                y[j] = a + b
                y[j + h] = a - b
        h *= 2


@njit(inline="always")
def _rotate_tile(X, r, t, G, p, sc, rot, k):
    """Tile t of row r of X, pivot ``p`` swapped to position 0 and transformed, into ``rot[k]``;
    returns its (min, max) (+0 for -0)."""
    C = X.shape[1]
    y = rot[k]
    load_tile(X[r], t * G, G, C, y)
    v = y[p]
    y[p] = y[0]
    y[0] = v
    if 32 <= G <= 512:  # eight-lane butterfly: the same additions in the same order (x * 1 is exact)
        mul_h32(rot, k * G, np.float32(1.0), rot, k * G, G // 32)
        stages(rot, k * G, G)
    else:
        butterfly(y, G)
    for i in range(G):
        y[i] = y[i] * sc
    mn, mx, _ = minmax_sumsq8(rot.reshape(rot.size), k * G, G // 8) if G % 8 == 0 else minmax_sumsq(y, G, G, y[0])
    return mn + np.float32(0.0), mx + np.float32(0.0)


@njit(inline="always")
def _top_mask(v, k, out, keys):
    """``out[t]`` = whether ``v[t]`` (no NaN) is among the ``k`` (0 < k < T) largest of ``v`` by the rule of
    :func:`qwire.codecs.tahquant.top_k` (ties: the earlier first). The k-th largest value is found by
    bisection on the values' ordered integer keys (32 counting loops over v, not a sort); every value
    above it is in, and of those equal to it the first ones until there are k. ``keys``: int32 scratch."""
    T = v.shape[0]
    lo = np.int32(0x7FFFFFFF)
    hi = np.int32(-0x80000000)
    for t in range(T):
        b = bits_of_f32(v[t] + np.float32(0.0))  # -0 -> +0: equal values, equal keys
        kk = b ^ np.int32(0x7FFFFFFF) if b < 0 else b  # ordered like the values
        keys[t] = kk
        lo = min(lo, kk)
        hi = max(hi, kk)
    while lo < hi:  # the largest key with at least k keys >= it
        mid = np.int32((np.int64(lo) + np.int64(hi) + 1) >> 1)
        c = 0
        for t in range(T):
            c += 1 if keys[t] >= mid else 0
        if c >= k:
            lo = mid
        else:
            hi = mid - 1
    need = k
    for t in range(T):
        need -= 1 if keys[t] > lo else 0
    for t in range(T):
        kk = keys[t]
        eq = kk == lo and need > 0
        need -= 1 if eq else 0
        out[t] = kk > lo or eq


@njit
def decide_b(r0, r1, X, G, lo, hi, sumsq, a1, a2, piv, H, by_range, rotates, tau, m, flags, order, pslot, rot, rotpos,
             scale, local, k, mixed, lh, ll, kappa, two_out, extends, kext, high, levels, sq2, sparse, kmin, kmax):
    """Pass B over rows r0..r1, after pass A: the reference's per-tile decisions of each row.

    Rotation (``rotates``; ``TAHQuant._choose_rotated``, ``_rotate_``, ``_slot_order``): the flags,
    the slot order and pivot slots ``(R, m)``, each rotated tile into ``rot[r * m + j]`` (slot j) with
    ``rotpos[r, t]`` pointing there and its new ``lo``/``hi``; ``sq2`` is ``sumsq`` with +inf for them.
    ``local`` (the tile unit, or one width for all): the allocation (``_top_units`` on ``H``, or with
    ``by_range`` on each tile's range after the rotation, ``hi - lo``), the
    levels, the outlier tiles (``_outlier_tiles``; ``two_out`` > 0: the two-outlier test with that
    factor, which the reference runs when ``extends``) and the zero-code range ``kmin``/``kmax``
    (``_ext_range``; ``kext`` = the layout's (kmin, kmax) then the rotated tiles')."""
    T = lo.shape[1]
    sc = np.float32(scale)
    tau32 = np.float32(tau)
    tiny = TINY32
    score = np.empty(T, dtype=np.float32)
    keys = np.empty(T, dtype=np.int32)
    f = np.empty(T, dtype=np.bool_)
    zero = np.float32(0.0)
    d1 = np.float32(max(1, G - 1))
    d2 = np.float32(max(1, G - 2))
    kap = np.float32(kappa)
    two2 = np.float32(two_out * two_out)
    flh = np.float32(lh)
    fll = np.float32(ll)
    for r in range(r0, r1):
        if rotates:
            nc = 0
            for t in range(T):
                x1 = a1[r, t]
                c = (x1 > tau32 * a2[r, t]) and x1 > 0 if tau >= 1 else x1 > 0
                f[t] = c
                nc += 1 if c else 0
                score[t] = x1 / max(a2[r, t], tiny) if c else np.float32(-1.0)
            if nc > m:  # at most m: those with the largest ratio (the others have score -1 < 0)
                _top_mask(score, m, f, keys)
            j = 0
            for t in range(T):
                flags[r, t] = f[t]
                rotpos[r, t] = -1
                sq2[r, t] = sumsq[r, t]
                if f[t]:
                    order[r, j] = t
                    p = piv[r, t]
                    pslot[r, j] = p
                    rotpos[r, t] = r * m + j
                    lo[r, t], hi[r, t] = _rotate_tile(X, r, t, G, p, sc, rot, r * m + j)
                    sq2[r, t] = np.inf
                    j += 1
            for t in range(T):
                if j < m and not f[t]:
                    order[r, j] = t
                    pslot[r, j] = 0
                    j += 1
        else:
            for t in range(T):
                sq2[r, t] = sumsq[r, t]
        if not local:
            continue
        if mixed and by_range:
            for t in range(T):
                score[t] = hi[r, t] - lo[r, t]
            _top_mask(score, k, high[r], keys)
        elif mixed:
            _top_mask(H[r], k, high[r], keys)
        for t in range(T):
            hh = high[r, t] if mixed else k > 0
            high[r, t] = hh
            L = flh if hh else fll
            levels[r, t] = L
            l_ = lo[r, t]
            h_ = hi[r, t]
            q = sq2[r, t]
            b = max(h_, -l_)
            rng = (kap * (h_ - l_)) / L
            rest = max(q - b * b, zero) / d1
            sp = np.sqrt(rest) < rng
            if two_out > 0:
                x2 = a2[r, t] * a2[r, t]
                x1 = a1[r, t]
                rest2 = q - x2
                ms = max(rest2 - x1 * x1, zero) / d2
                rest2b = max(rest2 - b * b, zero) / d2
                sp = sp or (np.sqrt(rest2b) < rng and x2 > two2 * ms)
            sparse[r, t] = sp
            if extends:
                rt = rotates and flags[r, t]
                kmin[r, t] = kext[2] if rt else kext[0]
                kmax[r, t] = kext[3] if rt else kext[1]


@njit
def pass_ab(r0, r1, X, G, unit_tile, want_h, lo, hi, sumsq, a1, a2, piv, H, Hrow, by_range, rotates, tau, m, flags,
            order, pslot, rot, rotpos, scale, local, k, mixed, lh, ll, kappa, two_out, extends, kext, high, levels, sq2,
            sparse, kmin, kmax):
    """Passes A and B over rows r0..r1, SUB rows at a time (B reads the rows A just read, from cache).
    ``want_h``: A computes the entropies (the entropy allocation); ``by_range``: B allocates by range."""
    for a in range(r0, r1, SUB):
        b = min(a + SUB, r1)
        stats_a(a, b, X, G, unit_tile, want_h, lo, hi, sumsq, a1, a2, piv, H, Hrow)
        decide_b(a, b, X, G, lo, hi, sumsq, a1, a2, piv, H, by_range, rotates, tau, m, flags, order, pslot, rot, rotpos,
                 scale, local, k, mixed, lh, ll, kappa, two_out, extends, kext, high, levels, sq2, sparse, kmin, kmax)


@njit(inline="always")
def _codes(src, o, G, st, zz, top, dst, d0):
    """Asymmetric codes of src[o:o+G] for zero zz and step st into dst[d0:d0+G] (see _tiles)."""
    zero = np.float32(0.0)
    inv = np.float32(1.0) / st if st > 0 else zero
    bias = -(zz * inv)
    magic = np.float32(12582912.0)
    s_ = src[o: o + G]  # sliced views: a computed index would be checked for wraparound (no vectors)
    d_ = dst[d0: d0 + G]
    for i in range(G):
        v = fma32(s_[i], inv, bias)
        v = min(max(v, zero), top)
        d_[i] = np.uint8(np.int32((v + magic) - magic))


@njit(inline="always")
def _block(src, o, G, st, zz, b, p, e, pb, eb, nw, tmp, dst, d0):
    """slots=tile: the block of a rotated tile (``TAHQuant._rotated_blocks``) as G codes of b bits in
    dst[d0:d0+G]: its pivot p (pb bits), zero-code high part e (eb bits), the first nw elements with
    b bits on step st / 2, the others with b - 1 bits on step st. A bit writer: values go in at the
    top of ``buf``, b-bit codes come out at its bottom."""
    _codes(src, o, nw, st * np.float32(0.5), zz, np.float32((1 << b) - 1), tmp, 0)
    _codes(src, o + nw, G - nw, st, zz, np.float32((1 << (b - 1)) - 1), tmp, nw)
    mb = (np.int64(1) << b) - 1
    head = (p & ((np.int64(1) << pb) - 1)) | ((e & ((np.int64(1) << eb) - 1)) << pb)
    buf = head
    nb = pb + eb
    k = d0
    for i in range(G):
        w = b if i < nw else b - 1
        buf |= np.int64(tmp[i]) << nb
        nb += w
        while nb >= b:
            dst[k] = np.uint8(buf & mb)
            k += 1
            buf >>= b
            nb -= b


@njit(inline="always")
def _unblock(c_, G, b, skip, nw, st, zz, y_):
    """Inverse of :func:`_block` into values: the codes c_ (G of b bits) as a bit stream, skipping the
    head (``skip`` bits), ``z + q * st / 2`` for the first nw elements, ``z + q * st`` for the others."""
    half = st * np.float32(0.5)
    j = skip // b  # the code holding the first bit after the head
    buf = np.int64(c_[j]) >> (skip % b)
    nb = b - skip % b
    j += 1
    for i in range(G):
        w = b if i < nw else b - 1
        while nb < w:
            buf |= np.int64(c_[j]) << nb
            nb += b
            j += 1
        q = np.float32(buf & ((np.int64(1) << w) - 1))
        buf >>= w
        nb -= w
        y_[i] = fma32(q, half if i < nw else st, zz)


@njit
def quant_c(r0, r1, X, G, z, s, high, rotpos, rot, hb, lb, out, off_h, off_l, h_start, l_start,
            inl, nw, pb, eb, piv, ext, wblk, ar):
    """Pass C over rows r0..r1 (r0 a multiple of 8 rows, or of 8 sequences for the token unit):
    codes of each tile (rotated tiles from ``rot`` at ``rotpos[r, t]`` >= 0) with width hb where
    ``high`` else lb, packed into the high stream at code index ``h_start`` and the low one at
    ``l_start`` (both byte aligned). ``inl`` (slots=tile): a rotated tile's codes are its block
    (:func:`_block`, pivot from ``piv``, zero-code high part from ``ext`` when ``eb``). ``wblk`` non-empty
    (``zero_width=block``): the zero extension of row r's rotated tiles is ``wblk[r // ar]`` bits, not ``eb``,
    and ``G - pb - wblk[r // ar]`` of their elements are wide, not ``nw``."""
    C = X.shape[1]
    T = s.shape[1]
    bh = np.empty(SUB * T * G, dtype=np.uint8)
    bl = np.empty(SUB * T * G, dtype=np.uint8)
    tb = np.empty(G, dtype=np.float32)
    tq = np.empty(G, dtype=np.uint8)
    th = np.float32((1 << hb) - 1)
    tl = np.float32((1 << lb) - 1)
    hpos = h_start
    lpos = l_start
    for a in range(r0, r1, SUB):
        b = min(a + SUB, r1)
        nh = 0
        nl = 0
        for r in range(a, b):
            xr = X[r]
            for t in range(T):
                rp = rotpos[r, t]
                o = 0
                if rp >= 0:
                    src = rot[rp]
                elif (t + 1) * G <= C:  # a whole tile: straight from the row
                    src = xr
                    o = t * G
                else:
                    load_tile(xr, t * G, G, C, tb)
                    src = tb
                if inl and rp >= 0:
                    ebv, nwv = eb, nw
                    if wblk.size:
                        ebv = wblk[r // ar]
                        nwv = G - pb - ebv
                    e = ext[r, t] if ebv else 0
                    if high[r, t]:
                        _block(src, o, G, s[r, t], z[r, t], hb, piv[r, t], e, pb, ebv, nwv, tq, bh, nh)
                        nh += G
                    else:
                        _block(src, o, G, s[r, t], z[r, t], lb, piv[r, t], e, pb, ebv, nwv, tq, bl, nl)
                        nl += G
                elif high[r, t]:
                    _codes(src, o, G, s[r, t], z[r, t], th, bh, nh)
                    nh += G
                else:
                    _codes(src, o, G, s[r, t], z[r, t], tl, bl, nl)
                    nl += G
        if nh:
            pack(out, off_h + (hpos * hb) // 8, bh[:nh], hb)
        if nl:
            pack(out, off_l + (lpos * lb) // 8, bl[:nl], lb)
        hpos += nh
        lpos += nl


@njit
def rotation_meta(flags, slots, ext_lo, ext_hi, zero_ext, rotpiv, ext):
    """Decode side of the rotation metadata (``TAHQuant._rotation``): the pivot ``rotpiv[r, t]`` of each
    rotated tile (-1 for the others) and, with ``zero_ext`` > 0, the high part ``ext[r, t]`` of its zero
    code (``zero_ext``-bit two's complement: low 8 bits from ``ext_lo``, the rest from ``ext_hi``;
    0 for the others). Slot j of a row belongs to its j-th rotated tile. Returns the largest number of
    rotated tiles in a row (the caller checks it against the slots)."""
    R, T = flags.shape
    m = slots.shape[1]
    worst = 0
    for r in range(R):
        j = 0
        for t in range(T):
            if flags[r, t]:
                if j < m:
                    rotpiv[r, t] = slots[r, j]
                    if zero_ext > 0:
                        e = np.int64(ext_lo[r, j])
                        if zero_ext > 8:
                            e |= np.int64(ext_hi[r, j]) << 8
                        e -= (e >> (zero_ext - 1)) << zero_ext
                        ext[r, t] = e
                j += 1
            else:
                rotpiv[r, t] = -1
                if zero_ext > 0:
                    ext[r, t] = 0
        worst = max(worst, j)
    return worst


@njit
def dequant_d(r0, r1, src, G, z, s, high, rotpiv, hb, lb, off_h, off_l, h_start, l_start, scale, out,
              inl, nw, skip, wblk, ar, pb):
    """Pass D: values of rows r0..r1 into ``out`` (R, T * G) fp32 (padded), un-rotating tiles whose
    ``rotpiv[r, t]`` (their pivot) is >= 0. Returns the largest ``|z| + levels * |s|`` over the rows'
    tiles (:func:`qwire.codecs.tiles.values_bound`; NaN if some z or s is NaN). ``inl`` (slots=tile): a
    rotated tile's codes are its block: ``skip`` bits of pivot and zero extension, ``nw`` codes of its
    width on half its step, the others one bit narrower on its step; ``wblk`` non-empty (``zero_width=block``):
    ``pb`` bits of pivot and ``wblk[r // ar]`` of zero extension in row r's, ``G - pb - wblk[r // ar]`` wide."""
    T = s.shape[1]
    sc = np.float32(scale)
    bh = np.empty(SUB * T * G, dtype=np.uint8)
    bl = np.empty(SUB * T * G, dtype=np.uint8)
    th = np.float32((1 << hb) - 1)
    tl = np.float32((1 << lb) - 1)
    of = out.reshape(out.size)
    W = out.shape[1]
    bound = np.float32(0.0)
    hpos = h_start
    lpos = l_start
    for a in range(r0, r1, SUB):
        b = min(a + SUB, r1)
        nh = 0
        for r in range(a, b):
            for t in range(T):
                if high[r, t]:
                    nh += G
        nl = (b - a) * T * G - nh
        if nh:
            unpack(src, off_h + (hpos * hb) // 8, bh[:nh], hb)
        if nl:
            unpack(src, off_l + (lpos * lb) // 8, bl[:nl], lb)
        ih = 0
        il = 0
        for r in range(a, b):
            yr = out[r]
            for t in range(T):
                st = s[r, t]
                zz = z[r, t]
                o = t * G
                y_ = yr[o: o + G]  # sliced views: a computed index would be checked for wraparound
                if high[r, t]:
                    c_ = bh[ih: ih + G]
                    ih += G
                    v = abs(zz) + abs(st) * th
                else:
                    c_ = bl[il: il + G]
                    il += G
                    v = abs(zz) + abs(st) * tl
                if not v <= bound:  # NaN sticks
                    bound = v if not bound != bound else bound
                p = rotpiv[r, t]
                if inl and p >= 0:
                    if wblk.size:
                        wv = wblk[r // ar]
                        _unblock(c_, G, hb if high[r, t] else lb, pb + wv, G - pb - wv, st, zz, y_)
                    else:
                        _unblock(c_, G, hb if high[r, t] else lb, skip, nw, st, zz, y_)
                else:
                    for i in range(G):
                        y_[i] = fma32(np.float32(c_[i]), st, zz)
                if p >= 0:
                    if 32 <= G <= 512:  # eight-lane butterfly: the same additions in the same order
                        mul_h32(of, r * W + o, np.float32(1.0), of, r * W + o, G // 32)
                        stages(of, r * W + o, G)
                    else:
                        butterfly(y_, G)
                    for i in range(G):
                        y_[i] = y_[i] * sc
                    v = y_[p]
                    y_[p] = y_[0]
                    y_[0] = v
        hpos += nh
        lpos += nl
    return bound


@njit
def block_widths(flags, s, zero, khigh, span, kmin, L, ar, G, log2g, kmin_w, kmax_w, unit_f, tie, out):
    """``TAHQuant._block_widths`` (``zero_width=block``): per block of ``ar`` rows, into ``out``, the width w of
    lowest modelled error of its rotated tiles (``flags`` (R, T); their steps ``s`` and narrow levels ``L``,
    fp32; their zero codes from the fit's ``zero`` field and high parts ``khigh`` as ``TAHQuant._zero_codes``:
    ``zero + khigh * span + kmin`` in fp32), the first within a relative ``tie`` of the lowest. The model's
    operations in fp64, in the reference's order, the tiles summed in row-major order (as its ``index_add_``)."""
    R, T = flags.shape
    W = kmin_w.shape[0]
    E = np.zeros((out.shape[0], W))
    for r in range(R):
        b = r // ar
        for t in range(T):
            if not flags[r, t]:
                continue
            kk = np.float64(np.float32(zero[r, t]) + np.float32(khigh[r, t]) * span + kmin)
            Lv = np.float64(L[r, t])
            u = (Lv + 1.0) * unit_f
            sf = np.float64(s[r, t])
            for w in range(W):
                if kk < kmin_w[w]:
                    g = kk / kmin_w[w]
                elif kk > kmax_w[w]:
                    g = (kk * u + Lv) / (kmax_w[w] * u + Lv)
                else:
                    g = 1.0
                n = np.float64(log2g + w)
                x = sf * g
                E[b, w] += (x * x) * ((G - n) / 4.0 + n)
    for b in range(out.shape[0]):
        m = E[b, 0]
        for w in range(1, W):
            m = min(m, E[b, w])
        lim = m * (1.0 + tie)
        c = 0
        while E[b, c] > lim:
            c += 1
        out[b] = c


@njit
def block_reach(flags, widths, ar, wmin, wmax, kmin, kmax):
    """``TAHQuant._block_reach`` after :func:`block_widths`, in place: each rotated tile's (``flags``) zero-code
    range ``kmin``/``kmax`` becomes the reach ``wmin``/``wmax`` (fp32, by width) of its block's width."""
    R, T = flags.shape
    for r in range(R):
        w = widths[r // ar]
        for t in range(T):
            if flags[r, t]:
                kmin[r, t] = wmin[w]
                kmax[r, t] = wmax[w]
