"""numba passes of TAH-Quant (:mod:`qwire.codecs.tahquant`); the per-tile decisions between them
(which tiles rotate, which units get the high width, the metadata) stay the reference's torch code
on per-tile tensors, so they are the reference's by construction.

A: per tile ``lo``, ``hi``, sum of squares, ``a1`` = largest magnitude, its first position, ``a2`` =
   the largest magnitude elsewhere, and the entropy of the magnitudes (tile unit) or per token.
B: rotate the chosen tiles (pivot swap, then the Sylvester butterfly of
   :func:`qwire.codecs.hadamard.hadamard_transform`) into a side buffer, with their new range.
C: quantize every tile against its zero and step with its own width and pack the codes into
   the ``high`` and ``low`` streams.
D: unpack, dequantize, un-rotate.
"""

from __future__ import annotations

import numpy as np

from ._common import njit
from ._fastpack import bits_of_f32, f32_of_bits, fma32, pack, unpack
from ._portable import entropy_buf, log_approx_buf
from ._simd import entropy_sums8, minmax_sumsq8, mul_h32, prefetch, stages
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
    for r in range(r0, r1):
        xr = X[r]
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
            ib_ = ib[c0: c0 + G]
            bb = np.int32(bits_of_f32(big))
            b = G
            m2 = 0
            cnt = 0
            for j in range(G):
                v = ib_[j]
                eq = v == bb
                b = min(b, j if eq else G)
                m2 = max(m2, v if v < bb else 0)
                cnt += 1 if eq else 0
            a2[r, t] = big if cnt >= 2 else f32_of_bits(m2)
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


@njit
def rotate_b(X, G, idx, pivots, scale, rot, lo, hi):
    """Pass B: tiles ``idx`` (flat r * T + t) of X, pivot swapped and transformed, into ``rot`` (n, G),
    their new min/max into lo/hi (flat views)."""
    C = X.shape[1]
    T = -(-C // G)
    sc = np.float32(scale)
    Xf = X.reshape(X.size)
    n = idx.shape[0]
    AHEAD = 16  # the tiles are scattered: ask for the lines of the tile this many ahead
    for k in range(n):
        if k + AHEAD < n:
            f = idx[k + AHEAD]
            o = (f // T) * C + (f % T) * G
            prefetch(Xf, o)
            prefetch(Xf, o + min(G, C - (f % T) * G) - 1)
        r = idx[k] // T
        t = idx[k] % T
        y = rot[k]
        load_tile(X[r], t * G, G, C, y)
        p = pivots[k]
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
        lo[idx[k]] = mn + np.float32(0.0)
        hi[idx[k]] = mx + np.float32(0.0)


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


@njit
def quant_c(r0, r1, X, G, z, s, high, rotpos, rot, hb, lb, out, off_h, off_l, h_start, l_start):
    """Pass C over rows r0..r1 (r0 a multiple of 8 rows, or of 8 sequences for the token unit):
    codes of each tile (rotated tiles from ``rot`` at ``rotpos[r, t]`` >= 0) with width hb where
    ``high`` else lb, packed into the high stream at code index ``h_start`` and the low one at
    ``l_start`` (both byte aligned)."""
    C = X.shape[1]
    T = s.shape[1]
    bh = np.empty(SUB * T * G, dtype=np.uint8)
    bl = np.empty(SUB * T * G, dtype=np.uint8)
    tb = np.empty(G, dtype=np.float32)
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
                if rp >= 0:
                    src = rot[rp]
                else:
                    load_tile(xr, t * G, G, C, tb)
                    src = tb
                if high[r, t]:
                    _codes(src, 0, G, s[r, t], z[r, t], th, bh, nh)
                    nh += G
                else:
                    _codes(src, 0, G, s[r, t], z[r, t], tl, bl, nl)
                    nl += G
        if nh:
            pack(out, off_h + (hpos * hb) // 8, bh[:nh], hb)
        if nl:
            pack(out, off_l + (lpos * lb) // 8, bl[:nl], lb)
        hpos += nh
        lpos += nl


@njit
def dequant_d(r0, r1, src, G, z, s, high, rotpiv, hb, lb, off_h, off_l, h_start, l_start, scale, out):
    """Pass D: values of rows r0..r1 into ``out`` (R, T * G) fp32 (padded), un-rotating tiles whose
    ``rotpiv[r, t]`` (their pivot) is >= 0."""
    T = s.shape[1]
    sc = np.float32(scale)
    bh = np.empty(SUB * T * G, dtype=np.uint8)
    bl = np.empty(SUB * T * G, dtype=np.uint8)
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
                else:
                    c_ = bl[il: il + G]
                    il += G
                for i in range(G):
                    y_[i] = fma32(np.float32(c_[i]), st, zz)
                p = rotpiv[r, t]
                if p >= 0:
                    y = yr[o: o + G]
                    butterfly(y, G)
                    for i in range(G):
                        y[i] = y[i] * sc
                    v = y[p]
                    y[p] = y[0]
                    y[0] = v
        hpos += nh
        lpos += nl
