"""CPU kernels of ``perchannel<b>`` (:mod:`qwire.codecs.perchannel`), nearest rounding.

Encode: pass 1 takes the per-channel absolute maximum over all rows (threads over blocks of rows, one
partial maximum per block, combined with max: the result does not depend on the blocking). The maximum
is taken over the fp32 bit patterns with the sign cleared, which order like the magnitudes and put NaN
above Inf, so a NaN or Inf reaches the same check as in the reference. The steps (C values) are then
chosen by the codec's own torch code (``PerChannel._steps_of``), and pass 2 quantizes (``round(x * (1 /
s) + h)`` with one fused multiply-add, as ``addcmul`` in the reference) and bit-packs, threaded over
blocks of rows. Decode: unpack and ``q * s + (-h * s)`` (fused), fp16 output clamped to +-65504 as in
the reference. Payload bytes and decoded values are the reference's, bit for bit.

A tensor with an fp32 step (``layout=fp32``) so small that ``1 / s`` overflows to Inf (subnormal channel
maxima) is encoded by the torch reference: its codes there come from torch's conversion of Inf/NaN to
uint8, which is not reproduced here.
"""

from __future__ import annotations

import numpy as np
import torch

from ...base import FP16_MAX, check_decoded
from .. import register_kernels
from ._common import blocks, njit, np_of, run_blocks
from ._fastpack import fma32, pack, unpack

SUB_ELEMS = 1 << 13  # codes buffered per pack call (rows of a chunk: a multiple of 8, so chunks start on a byte)


def _sub_rows(cols: int) -> int:
    return max(8, (SUB_ELEMS // max(1, cols)) // 8 * 8)


@njit
def absmax_bits(r0, r1, Xi, part):
    """``part[c]`` = max over rows r0..r1 of ``Xi[r, c] & 0x7fffffff`` (``Xi``: the fp32 data as int32)."""
    C = Xi.shape[1]
    mask = np.int32(0x7FFFFFFF)
    part[:] = 0
    for r in range(r0, r1):
        row = Xi[r]
        for c in range(C):
            part[c] = max(part[c], np.int32(row[c] & mask))


@njit(inline="always")
def _quant_row(row, inv, hf, dst):
    for c in range(row.shape[0]):
        dst[c] = np.uint8(np.int32(np.rint(fma32(row[c], inv[c], hf))))


@njit
def quant_pack_rows(r0, r1, X, inv, h, out, off, bits, sub):
    """Codes ``round(fma(x, inv_c, h))`` of rows r0..r1 (r0 a multiple of 8) packed from byte
    ``off + r0 * C * bits / 8``."""
    C = X.shape[1]
    hf = np.float32(h)
    if bits == 8:  # the codes are the payload bytes
        for r in range(r0, r1):
            _quant_row(X[r], inv, hf, out[off + r * C: off + (r + 1) * C])
        return
    buf = np.empty(sub * C, dtype=np.uint8)
    for a in range(r0, r1, sub):
        b = min(a + sub, r1)
        for r in range(a, b):
            _quant_row(X[r], inv, hf, buf[(r - a) * C: (r - a + 1) * C])
        pack(out, off + (a * C * bits) // 8, buf[: (b - a) * C], bits)


@njit(inline="always")
def _dequant_row(q, s, zz, dst):
    for c in range(dst.shape[0]):
        dst[c] = fma32(np.float32(q[c]), s[c], zz[c])


@njit
def unpack_dequant_rows(r0, r1, src, off, bits, s, zz, out, sub):
    """``fma(q, s_c, zz_c)`` of rows r0..r1 into ``out`` (R, C) fp32."""
    C = out.shape[1]
    if bits == 8:
        for r in range(r0, r1):
            _dequant_row(src[off + r * C: off + (r + 1) * C], s, zz, out[r])
        return
    buf = np.empty(sub * C, dtype=np.uint8)
    for a in range(r0, r1, sub):
        b = min(a + sub, r1)
        unpack(src, off + (a * C * bits) // 8, buf[: (b - a) * C], bits)
        for r in range(a, b):
            _dequant_row(buf[(r - a) * C: (r - a + 1) * C], s, zz, out[r])


def rows_fp32(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` as a contiguous fp32 (rows, cols) tensor (a view when it already is one)."""
    return x.detach().reshape(rows, cols).to(torch.float32).contiguous()


def channel_absmax(X: torch.Tensor) -> torch.Tensor:
    """Per-column max of ``|X|`` (fp32; NaN where a column holds a NaN, else Inf where it holds an Inf)."""
    R, C = X.shape
    spans = blocks(R, C)
    parts = np.empty((len(spans), C), dtype=np.int32)
    Xi = np_of(X.view(torch.int32))
    if len(spans) == 1:
        absmax_bits(0, R, Xi, parts[0])
    else:
        index = {r0: k for k, (r0, _) in enumerate(spans)}
        run_blocks(lambda r0, r1: absmax_bits(r0, r1, Xi, parts[index[r0]]), spans)
    return torch.from_numpy(parts.max(axis=0)).view(torch.float32)


def encode(codec, x: torch.Tensor) -> torch.Tensor:
    g, sec, payload = codec._begin_encode(x)
    if not g.numel:
        return payload
    X = rows_fp32(x, g.rows, g.cols)
    steps = codec._steps_of(x, channel_absmax(X))  # raises for NaN/Inf and out-of-range values
    s = steps.float()
    pos = s > 0  # as tiles.quantize_
    inv = torch.where(pos, 1.0 / torch.where(pos, s, torch.ones_like(s)), torch.zeros_like(s))
    if bool(torch.isinf(inv).any()):
        return type(codec).encode.reference(codec, x)
    sec.put(payload, "scale", 0, steps)
    run_blocks(quant_pack_rows, blocks(g.rows, g.cols, 8), np_of(X), np_of(inv), float(codec.levels // 2),
               np_of(payload), sec.offsets["codes"], codec.bits, _sub_rows(g.cols))
    return payload


def decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    g, sec, out = codec._begin_decode(payload, shape, dtype)
    if not g.numel:
        return out
    s = sec.get(payload, "scale", 0, g.cols).float()
    zz = -(codec.levels // 2) * s  # as tiles.dequantize
    direct = dtype == torch.float32
    vals = out.view(g.rows, g.cols) if direct else torch.empty(g.rows, g.cols)
    run_blocks(unpack_dequant_rows, blocks(g.rows, g.cols, 8), np_of(payload.contiguous()), sec.offsets["codes"],
               codec.bits, np_of(s), np_of(zz), np_of(vals), _sub_rows(g.cols))
    check_decoded(vals, float(s.abs().amax()) * codec.levels, codec.name)
    if not direct:
        if dtype == torch.float16:  # within step/2 of a value <= 65504: must not become Inf
            vals.clamp_(-FP16_MAX, FP16_MAX)
        out.view(g.rows, g.cols).copy_(vals)
    return out


register_kernels("cpu", "PerChannel", supports=lambda c: c.rounding == "nearest", encode=encode, decode=decode)
