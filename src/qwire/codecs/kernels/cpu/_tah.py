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

from ._common import njit, pack_into, unpack_from
from ._portable import entropy_buf

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
    entropies (into ``H`` (R, T) for the tile unit, ``Hrow`` (R,) for the token unit)."""
    C = X.shape[1]
    T = lo.shape[1]
    P = T * G
    p2t = 1
    while p2t < G:
        p2t *= 2
    p2r = 1
    while p2r < P:
        p2r *= 2
    tb = np.empty(G, dtype=np.float32)
    ab = np.empty(P, dtype=np.float32)
    w = np.empty(3 * max(p2t, p2r), dtype=np.float32)
    for r in range(r0, r1):
        xr = X[r]
        for t in range(T):
            n = load_tile(xr, t * G, G, C, tb)
            mn = tb[0]
            mx = tb[0]
            ss = 0.0
            best = np.float32(-1.0)
            bi = 0
            for i in range(G):
                v = tb[i]
                mn = min(mn, v)
                mx = max(mx, v)
                d = np.float64(v)
                ss += d * d
                av = abs(v) if i < n else np.float32(0.0)
                ab[t * G + i] = av
                if av > best:
                    best = av
                    bi = i
            sec = np.float32(0.0)
            for i in range(G):
                if i != bi:
                    sec = max(sec, ab[t * G + i])
            lo[r, t] = mn + np.float32(0.0)
            hi[r, t] = mx + np.float32(0.0)
            sumsq[r, t] = np.float32(ss)
            a1[r, t] = max(hi[r, t], -lo[r, t])
            a2[r, t] = sec
            piv[r, t] = bi
            if want_h and unit_tile:
                H[r, t] = entropy_buf(ab[t * G: t * G + G], G, p2t, w)
        if want_h and not unit_tile:
            Hrow[r] = entropy_buf(ab, P, p2r, w)


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
    for k in range(idx.shape[0]):
        r = idx[k] // T
        t = idx[k] % T
        y = rot[k]
        load_tile(X[r], t * G, G, C, y)
        p = pivots[k]
        v = y[p]
        y[p] = y[0]
        y[0] = v
        butterfly(y, G)
        mn = y[0] * scale
        mx = mn
        for i in range(G):
            y[i] = y[i] * scale
            mn = min(mn, y[i])
            mx = max(mx, y[i])
        lo[idx[k]] = mn + np.float32(0.0)
        hi[idx[k]] = mx + np.float32(0.0)


@njit(inline="always")
def _codes(src, o, G, st, zz, top, dst, d0):
    """Asymmetric codes of src[o:o+G] for zero zz and step st into dst[d0:d0+G] (see _tiles)."""
    zero = np.float32(0.0)
    inv = np.float32(1.0) / st if st > 0 else zero
    bias = -(zz * inv)
    inv64 = np.float64(inv)
    b64 = np.float64(bias)
    magic = np.float32(12582912.0)
    for i in range(G):
        v = np.float32(np.float64(src[o + i]) * inv64 + b64)
        v = min(max(v, zero), top)
        dst[d0 + i] = np.uint8(np.int32((v + magic) - magic))


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
            pack_into(out, off_h + (hpos * hb) // 8, bh[:nh], hb)
        if nl:
            pack_into(out, off_l + (lpos * lb) // 8, bl[:nl], lb)
        hpos += nh
        lpos += nl


@njit
def dequant_d(r0, r1, src, G, z, s, high, rotpiv, hb, lb, off_h, off_l, h_start, l_start, scale, out):
    """Pass D: values of rows r0..r1 into ``out`` (R, T * G) fp32 (padded), un-rotating tiles whose
    ``rotpiv[r, t]`` (their pivot) is >= 0."""
    T = s.shape[1]
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
            unpack_from(src, off_h + (hpos * hb) // 8, bh[:nh], hb)
        if nl:
            unpack_from(src, off_l + (lpos * lb) // 8, bl[:nl], lb)
        ih = 0
        il = 0
        for r in range(a, b):
            yr = out[r]
            for t in range(T):
                s64 = np.float64(s[r, t])
                z64 = np.float64(z[r, t])
                o = t * G
                if high[r, t]:
                    for i in range(G):
                        yr[o + i] = np.float32(np.float64(bh[ih + i]) * s64 + z64)
                    ih += G
                else:
                    for i in range(G):
                        yr[o + i] = np.float32(np.float64(bl[il + i]) * s64 + z64)
                    il += G
                p = rotpiv[r, t]
                if p >= 0:
                    y = yr[o: o + G]
                    butterfly(y, G)
                    for i in range(G):
                        y[i] = y[i] * scale
                    v = y[p]
                    y[p] = y[0]
                    y[0] = v
        hpos += nh
        lpos += nl
