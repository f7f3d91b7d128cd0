"""numba versions of :mod:`qwire.codecs.portable`: the same fp32 operations in the same order."""

from __future__ import annotations

import numpy as np

from ...portable import _C32, _LN2_32, TINY
from ._common import njit

C0, C1, C2, C3, C4, C5, C6 = (np.float32(c) for c in _C32)
LN2 = np.float32(_LN2_32)
TINY32 = np.float32(TINY)


@njit(inline="always")
def log_approx_buf(v, out, n):
    """``out[:n] = log_approx(v[:n])`` (``out`` must not be ``v``)."""
    vb = v.view(np.int32)
    ob = out.view(np.int32)
    for i in range(n):
        ob[i] = (vb[i] & 0x7FFFFF) | 0x3F800000  # the mantissa 1 + f, as fp32
    for i in range(n):
        f = out[i] - np.float32(1.0)
        p = C6
        p = p * f
        p = p + C5
        p = p * f
        p = p + C4
        p = p * f
        p = p + C3
        p = p * f
        p = p + C2
        p = p * f
        p = p + C1
        p = p * f
        p = p + C0
        p = p * f
        e = np.float32(((vb[i] >> 23) & 0xFF) - 127)
        out[i] = e * LN2 + p


@njit(inline="always")
def tree_sum_buf(x, n):
    """Pairwise sum of ``x[:n]`` (n a power of two), destroying ``x``."""
    while n > 1:
        n //= 2
        for i in range(n):
            x[i] = x[i] + x[i + n]
    return x[0]


@njit
def entropy_buf(a, n, p2, w):
    """Entropy of ``a[:n]`` (>= 0) as :func:`qwire.codecs.portable.entropy`; ``p2`` is the next power of
    two >= n; ``w`` is scratch of 3 * p2 fp32."""
    s = w[:p2]
    t = w[p2: 2 * p2]
    lg = w[2 * p2: 3 * p2]
    for i in range(n):
        s[i] = a[i]
        t[i] = max(a[i], TINY32)
    for i in range(n, p2):
        s[i] = np.float32(0.0)
        t[i] = TINY32
    log_approx_buf(t, lg, p2)
    for i in range(p2):
        lg[i] = t[i] * lg[i] if i < n else np.float32(0.0)
    tot = tree_sum_buf(s, p2)
    x = tree_sum_buf(lg, p2)
    if not tot > 0:
        return np.float32(0.0)
    t[0] = tot
    log_approx_buf(t, lg, 1)
    return lg[0] - x / tot
