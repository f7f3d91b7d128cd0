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
from ._fastpack import bits_of_f32

f32 = np.float32
SPARSE_NONE, SPARSE_COMPUTE, SPARSE_GIVEN = 0, 1, 2


@njit(inline="always")
def _sparse(lo, hi, ss, L, tile, kappa):
    a1 = max(hi, -lo)
    rest = ss - a1 * a1
    if rest < 0:
        rest = f32(0.0)
    rest = rest / f32(max(1, tile - 1))
    return np.sqrt(rest) < (f32(kappa) * (hi - lo)) / L


@njit(inline="always")
def _through_zero(lo, hi, L, u, kmin):
    """(use it, j, step) of ``LogLayout._through_zero`` for one tile (its ``sparse`` factor aside)."""
    width = hi - lo if hi > lo else f32(1.0)
    j0 = np.floor((L * (-lo)) / width)
    if j0 < 1:
        j0 = f32(1.0)
    best_s = f32(0.0)
    best_j = f32(0.0)
    for i in range(2):
        j = j0 + f32(i)
        j = min(j, L - f32(1.0))
        sj = max((-lo) / j, hi / (L - j))
        if i == 0 or sj < best_s:
            best_s = sj
            best_j = j
    ok = (lo < 0) and (hi > 0) and (L >= 3) and (u <= 1) and (best_j / u <= -kmin)
    return ok, best_j, best_s


@njit
def log_fit_rows(r0, r1, lo, hi, sumsq, Lt, symmetric, sparse_mode, sparse, ext, kminT, kmaxT, tile, kappa,
                 anchor_rows, per_octave, zero_code, kmin0, kmax0, zero_span, zero_bits, align, tab,
                 need, jal, z, s, ccode, kcode, khigh, anchor):
    """Fit rows r0..r1 (whole anchor blocks; r1 may be the last row) of per-tile ``lo``, ``hi``,
    ``sumsq`` and levels ``Lt`` (all (R, T) fp32): writes ``z``, ``s`` (decoded zero and step),
    ``ccode`` (step code), ``kcode`` (zero code, biased by -kmin) and ``anchor`` per block.

    ``sparse_mode``: 0 no outlier-tile test (symmetric), 1 computed here from ``sumsq``, 2 given in
    ``sparse`` (R, T). ``ext``: zero extension, per-tile code range ``kminT``/``kmaxT`` (R, T) fp32,
    the high part of each zero code into ``khigh`` (R, T) int32. ``need`` and ``jal`` are (R, T) fp32
    scratch (``jal``: the grid offset j of tiles whose grid passes through 0, else -1)."""
    T = lo.shape[1]
    unit_f = f32(zero_span / float(1 << (zero_bits - 1)))
    margin = f32(1.0 + 2.0 ** -20)
    span = f32(1 << zero_bits)
    inv_span = f32(1.0 / (1 << zero_bits))
    for b0 in range(r0, r1, anchor_rows):
        b1 = min(b0 + anchor_rows, r1)
        amax = f32(0.0)
        for r in range(b0, b1):
            for t in range(T):
                l, h, L = lo[r, t], hi[r, t], Lt[r, t]
                jal[r, t] = f32(-1.0)
                if symmetric:
                    nd = max(h, -l) / f32(np.floor(L / 2))
                else:
                    kmn = kminT[r, t] if ext else f32(kmin0)
                    kmx = kmaxT[r, t] if ext else f32(kmax0)
                    u = (L + f32(1.0)) * unit_f
                    nd = (h - l) / (L - u)
                    nd = max(nd, l / (kmn * u))
                    nd = max(nd, h / (kmx * u + L))
                    sp = False
                    if sparse_mode == 1:
                        sp = _sparse(l, h, sumsq[r, t], L, tile, kappa)
                    elif sparse_mode == 2:
                        sp = sparse[r, t]
                    if sp:
                        ok, j, sj = _through_zero(l, h, L, u, kmn)
                        if ok:
                            nd = sj * margin
                            jal[r, t] = j
                need[r, t] = nd
                amax = max(amax, nd)
        anchor[b0 // anchor_rows] = amax
        a = amax
        a_safe = a if a > 0 else f32(1.0)
        for r in range(b0, b1):
            for t in range(T):
                nd = need[r, t]
                l, h, L = lo[r, t], hi[r, t], Lt[r, t]
                if nd <= 0:
                    c = zero_code
                    st = f32(0.0)
                else:
                    # a first guess from the bit patterns (bits(x) / 2**23 - 127 is log2(x) within
                    # 0.09), then the canonical code exactly, as the reference settles on it
                    d = np.int64(bits_of_f32(a_safe)) - np.int64(bits_of_f32(nd))
                    c = min(max((d * per_octave) >> 23, 0), zero_code - 1)
                    while c > 0 and a * tab[c] < nd:
                        c -= 1
                    while c + 1 <= zero_code - 1 and a * tab[c + 1] >= nd:
                        c += 1
                    st = a * tab[c]
                ccode[r, t] = c
                s[r, t] = st
                if symmetric:
                    z[r, t] = f32(0.0)
                    continue
                kmn = kminT[r, t] if ext else f32(kmin0)
                kmx = kmaxT[r, t] if ext else f32(kmax0)
                u = (L + f32(1.0)) * unit_f
                zero = nd <= 0
                us = f32(1.0) if zero else u * st
                k = np.floor(l / us)
                k = min(max(k, kmn), kmx)
                if jal[r, t] >= 0 and not zero:
                    k = (-jal[r, t]) / u
                if align:
                    kal = np.floor(k * u) / u
                    if (kal * us + L * st >= h) and (kal >= kmn):
                        k = kal
                zz = (k * u) * st
                if zz > l:
                    k = max(k - f32(1.0), kmn)
                    zz = (k * u) * st
                z[r, t] = zz
                code = k - f32(kmin0)
                if ext:
                    hp = np.floor(code * inv_span)
                    kcode[r, t] = np.uint8(int(code - hp * span))
                    khigh[r, t] = int(hp)
                else:
                    kcode[r, t] = np.uint8(int(code))
