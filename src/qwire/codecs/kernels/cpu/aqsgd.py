"""CPU kernels of AQ-SGD's element-wise steps (:mod:`qwire.codecs.aqsgd`), around the inner codec (which has
its own kernels):

``_delta(x, m)``       ``x - m.to(x.dtype)``: the delta the inner codec encodes (one pass, no
                       converted copy of the cache rows), written into a work buffer that the codec
                       keeps for the next call (an activation-sized buffer on the sending side: a
                       fresh one costs ~6400 page faults, 3 ms, per 26 MB call)
``_accumulate(m, d)``  ``m + d.to(m.dtype)``: the new cache rows from the decoded delta, written into
                       ``m`` (a fresh stack of cache rows that the caller owns)

for activations and caches in fp32, fp16 and bf16 (half values travel as their 16-bit patterns). Each
element is computed as torch computes it: conversions round to nearest even, and an fp16/bf16 sum or
difference is the fp32 result of the two widened operands rounded to the narrow type. The results are
the reference's bit for bit - sender and receiver run the same code, so their caches stay identical
whichever implementation each side runs - except for the bit pattern of a NaN, which only arises
from an Inf (a delta or cache row that overflowed its dtype; torch's own conversions disagree there:
0x7FC0 or 0xFFFF for a bf16 NaN depending on the code path).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import types
from numba.extending import overload

from .. import register_kernels
from ._common import blocks, njit, np_of, run_blocks
from ._fastpack import bits_of_f32, f16_of_f32, f32_of_bits, f32_of_f16

KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CHUNK = 1 << 12  # elements per unit of work split between threads


@njit(inline="always")
def _f32_of_bf16(b):
    return f32_of_bits(np.int32(np.uint16(b)) << np.int32(16))


@njit(inline="always")
def _bf16_of_f32(f):
    if f != f:
        return np.int16(0x7FC0)
    u = np.uint32(bits_of_f32(f))
    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.int16(np.uint16(u >> np.uint32(16)))


@njit(inline="always")
def _round(v, kind):
    """fp32 ``v`` rounded to ``kind``'s precision (0: fp32, 1: fp16, 2: bf16), as fp32."""
    if kind == 1:
        return f32_of_f16(f16_of_f32(v))
    if kind == 2:
        return _f32_of_bf16(_bf16_of_f32(v))
    return v


def _load(a, i, kind):  # pragma: no cover - replaced by the overload in compiled code
    raise NotImplementedError


def _store(a, i, v, kind):  # pragma: no cover
    raise NotImplementedError


@overload(_load, inline="always")
def _ol_load(a, i, kind):
    if a.dtype == types.float32:
        def ld32(a, i, kind):
            return a[i]
        return ld32

    def ld16(a, i, kind):
        if kind == 1:
            return f32_of_f16(a[i])
        return _f32_of_bf16(a[i])
    return ld16


@overload(_store, inline="always")
def _ol_store(a, i, v, kind):
    if a.dtype == types.float32:
        def st32(a, i, v, kind):
            a[i] = v
        return st32

    def st16(a, i, v, kind):
        if kind == 1:
            a[i] = f16_of_f32(v)
        else:
            a[i] = _bf16_of_f32(v)
    return st16


@njit
def delta_span(c0, c1, x, xk, m, mk, out):
    """``out = x - round_xk(m)`` (in ``x``'s type ``xk``) over chunks c0..c1."""
    n = x.shape[0]
    e0, e1 = c0 * CHUNK, min(c1 * CHUNK, n)
    xs, ms, os = x[e0:e1], m[e0:e1], out[e0:e1]
    for i in range(e1 - e0):
        mv = _round(_load(ms, i, mk), xk)
        _store(os, i, _load(xs, i, xk) - mv, xk)


@njit
def accumulate_span(c0, c1, m, mk, d, dk):
    """``m = m + round_mk(d)`` (in ``m``'s type ``mk``) over chunks c0..c1."""
    n = m.shape[0]
    e0, e1 = c0 * CHUNK, min(c1 * CHUNK, n)
    ms, ds = m[e0:e1], d[e0:e1]
    for i in range(e1 - e0):
        dv = _round(_load(ds, i, dk), mk)
        _store(ms, i, _load(ms, i, mk) + dv, mk)


def _arr(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of contiguous ``t``: fp32 as float32, fp16/bf16 as their int16 bit patterns."""
    t = t.reshape(-1)
    return np_of(t if t.dtype == torch.float32 else t.view(torch.int16))


def _spans(n: int) -> tuple[tuple[int, int], ...]:
    return blocks(-(-n // CHUNK), CHUNK)


def _fits(*ts: torch.Tensor) -> bool:
    return all(t.dtype in KINDS and t.is_contiguous() for t in ts) and ts[0].shape == ts[1].shape


def delta(codec, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    if not _fits(x, m) or not x.numel():
        return type(codec)._delta.reference(codec, x, m)
    out = codec.__dict__.get("_delta_work")
    if out is None or out.shape != x.shape or out.dtype != x.dtype:
        out = torch.empty_like(x)
        codec._delta_work = out
    run_blocks(delta_span, _spans(x.numel()), _arr(x), KINDS[x.dtype], _arr(m), KINDS[m.dtype], _arr(out))
    return out


def accumulate(codec, m: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    if not _fits(m, d) or not m.numel():
        return type(codec)._accumulate.reference(codec, m, d)
    run_blocks(accumulate_span, _spans(m.numel()), _arr(m), KINDS[m.dtype], _arr(d), KINDS[d.dtype])
    return m


@functools.lru_cache(maxsize=1)
def usable() -> bool:
    """Whether the kernels compile and run here (fp16 conversions need F16C or a runtime helper on x86)."""
    try:
        x, m = torch.tensor([1.5, -2.0]), torch.tensor([0.25, 3.0], dtype=torch.float16)
        out = torch.empty_like(x)
        delta_span(0, 1, _arr(x), 0, _arr(m), 1, _arr(out))
        accumulate_span(0, 1, _arr(m), 1, _arr(out), 0)
        return out.tolist() == [1.25, -5.0] and m.tolist() == [1.5, -2.0]
    except Exception:  # a missing runtime helper surfaces when the kernel is compiled
        return False


register_kernels("cpu", "AQSGD", supports=lambda codec: usable(), _delta=delta, _accumulate=accumulate)
