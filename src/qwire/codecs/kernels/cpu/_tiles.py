"""Kernels of the per-tile quantizers (``int``, ``tahquant``): tile statistics, quantize + pack, unpack +
dequantize.

torch's ``addcmul`` on CPU is a fused multiply-add (``a * b + c`` rounded once to fp32); the kernels
use LLVM's ``fma`` (``_fastpack.fma32``), which reproduces the reference's codes and values.
"""

from __future__ import annotations

import numpy as np

from ._common import njit
from ._fastpack import fma32, pack, unpack
from ._simd import minmax_sumsq8

SUB = 8  # rows per inner chunk: 8 rows of codes always end on a byte boundary


@njit(inline="always")
def minmax_sumsq(xs, n, G, last):
    """(min, max, fp64 sum of squares) of ``xs[:n]`` padded to ``G`` elements with ``last`` (the row's
    last element, as the reference's ``load_tiles`` pads). Min and max are +0 for a signed zero; four
    independent accumulators keep the loop from waiting on one dependency chain."""
    v = xs[0]
    mn0 = v
    mn1 = v
    mx0 = v
    mx1 = v
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    i = 0
    while i + 4 <= n:
        v0 = xs[i]
        v1 = xs[i + 1]
        v2 = xs[i + 2]
        v3 = xs[i + 3]
        mn0 = min(mn0, min(v0, v1))
        mn1 = min(mn1, min(v2, v3))
        mx0 = max(mx0, max(v0, v1))
        mx1 = max(mx1, max(v2, v3))
        d0 = np.float64(v0)
        d1 = np.float64(v1)
        d2 = np.float64(v2)
        d3 = np.float64(v3)
        s0 += d0 * d0
        s1 += d1 * d1
        s2 += d2 * d2
        s3 += d3 * d3
        i += 4
    while i < n:
        v0 = xs[i]
        mn0 = min(mn0, v0)
        mx0 = max(mx0, v0)
        d0 = np.float64(v0)
        s0 += d0 * d0
        i += 1
    sq = (s0 + s1) + (s2 + s3)
    if n < G:
        d0 = np.float64(last)
        sq += (G - n) * (d0 * d0)
    zero = np.float32(0.0)
    return min(mn0, mn1) + zero, max(mx0, mx1) + zero, sq


@njit
def tile_stats(r0, r1, X, tile, lo, hi, sumsq):
    """Per tile of rows r0..r1 of ``X`` (R, C) fp32: min, max and sum of squares (padding repeats the
    row's last element, as the reference's ``load_tiles`` does); the sum of squares accumulates in fp64
    and is rounded once, as :func:`qwire.codecs.tiles.sum_squares`. NaN/Inf propagate into ``sumsq``.
    Whole tiles of a multiple of 8 channels go through the eight-lane :func:`minmax_sumsq8`."""
    C = X.shape[1]
    T = lo.shape[1]
    zero = np.float32(0.0)
    vec = tile % 8 == 0
    Xf = X.reshape(X.size)
    for r in range(r0, r1):
        xr = X[r]
        for t in range(T):
            c0 = t * tile
            n = min(tile, C - c0)
            if vec and n == tile:
                mn, mx, sq = minmax_sumsq8(Xf, r * C + c0, tile // 8)
                mn = mn + zero
                mx = mx + zero
            else:
                mn, mx, sq = minmax_sumsq(xr[c0: c0 + n], n, tile, xr[C - 1])
            lo[r, t] = mn
            hi[r, t] = mx
            sumsq[r, t] = np.float32(sq)


@njit
def quant_pack_rows(r0, r1, X, tile, z, s, bias_sym, qmax, out, off, bits):
    """Codes of rows r0..r1 (row-major, padding not sent) packed into ``out`` from byte
    ``off + r0 * C * bits / 8`` (``r0`` a multiple of 8). Asymmetric when ``bias_sym < 0``:
    ``round((x - z) / s)``, else ``round(x / s) + bias_sym``; a step of 0 gives the bias.

    The value is clamped to [0, qmax] before rounding (the same codes as rounding first), and
    rounded half to even by adding and subtracting 1.5 * 2**23 (exact for |v| < 2**22)."""
    C = X.shape[1]
    T = s.shape[1]
    buf = np.empty(SUB * C, dtype=np.uint8)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    top = np.float32(qmax)
    magic = np.float32(12582912.0)
    for a in range(r0, r1, SUB):
        b = min(a + SUB, r1)
        for r in range(a, b):
            xr = X[r]
            br = buf[(r - a) * C: (r - a + 1) * C]
            for t in range(T):
                st = s[r, t]
                inv = one / st if st > 0 else zero
                bias = -(z[r, t] * inv) if bias_sym < 0 else np.float32(bias_sym)
                c0 = t * tile
                n = min(tile, C - c0)
                xt = xr[c0: c0 + n]
                bt = br[c0: c0 + n]
                for c in range(n):
                    v = fma32(xt[c], inv, bias)
                    v = min(max(v, zero), top)
                    bt[c] = np.uint8(np.int32((v + magic) - magic))
        pack(out, off + (a * C * bits) // 8, buf[: (b - a) * C], bits)


@njit
def unpack_dequant_rows(r0, r1, src, off, bits, tile, z, s, sym_h, out):
    """Values ``z + q * s`` (symmetric, ``sym_h >= 0``: ``(-h * s) + q * s``) of rows r0..r1 into
    ``out`` (R, C) fp32, from codes packed at ``off + r0 * C * bits / 8``."""
    C = out.shape[1]
    T = s.shape[1]
    buf = np.empty(SUB * C, dtype=np.uint8)
    for a in range(r0, r1, SUB):
        b = min(a + SUB, r1)
        unpack(src, off + (a * C * bits) // 8, buf[: (b - a) * C], bits)
        for r in range(a, b):
            yr = out[r]
            br = buf[(r - a) * C: (r - a + 1) * C]
            for t in range(T):
                st = s[r, t]
                zz = np.float32(-sym_h) * st if sym_h >= 0 else z[r, t]
                c0 = t * tile
                n = min(tile, C - c0)
                yt = yr[c0: c0 + n]
                bt = br[c0: c0 + n]
                for c in range(n):
                    yt[c] = fma32(np.float32(bt[c]), st, zz)
