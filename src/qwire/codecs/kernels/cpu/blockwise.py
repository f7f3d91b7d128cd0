"""CPU kernels of the block-wise codecs (:mod:`qwire.codecs.blockwise`): ``blockwise<b>`` (class
``BlockwiseInt``) and ``blockfp``/``fp4`` (class ``BlockFloat``).

One fused pass per block of the codec: encode takes the block's absolute maximum (over the fp32 bit
patterns with the sign cleared, which order like the magnitudes and put NaN above Inf), writes it as the
block's fp32 scale and quantizes the block (still in L1) into a buffer of codes that is bit-packed every
8192 codes; decode unpacks and scales. Threads take runs of whole blocks that start on a byte of the
code stream.

Every operation is the reference's, in fp32 and in the same order. ``blockwise``: ``round((x / a) *
qmax)`` and ``((q - qmax) / qmax) * a``. ``blockfp``: ``ceil(min((|x| / a) * vmax, vmax) * (1 / step))``
looked up in the codec's own rounding table (with the sign bit folded into the index) and ``signed[q] *
a`` with the codec's own decode table. Payload bytes and decoded values are the reference's, bit for
bit. Half-precision inputs are converted to fp32 by torch first and half outputs are converted from
fp32 by torch, as in the reference.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...base import as_shape, check_decoded, check_float_dtype, clamp_to_dtype_, numel
from ...tiles import MAX_ABS, check_magnitude
from ...wire import from_bytes
from .. import register_kernels
from ._common import blocks, njit, np_of, run_blocks
from ._fastpack import f32_of_bits, pack, unpack

CAP = 1 << 13  # codes per pack call: a multiple of 8, so every flush ends on a byte of the stream
FINITE = 0x7F800000  # bit patterns (sign cleared) at or above this are Inf or NaN


@njit(inline="always")
def _absmax_bits(xi):
    mask = np.int32(0x7FFFFFFF)
    m = np.int32(0)
    for i in range(xi.shape[0]):
        m = max(m, np.int32(xi[i] & mask))
    return m


@njit(inline="always")
def _int_codes(x, sa, qf, dst):
    lo = -qf
    for i in range(x.shape[0]):
        q = np.rint(x[i] / sa * qf)
        q = q if q > lo else lo
        q = q if q < qf else qf
        dst[i] = np.uint8(np.int32(q + qf))


@njit(inline="always")
def _fp_codes(x, sa, vmax, inv_step, lut2, neg, tmp, dst):
    # two loops: the arithmetic vectorizes; the table look-up (sign folded into the index) is a gather
    for i in range(x.shape[0]):
        v = x[i]
        m = abs(v) / sa * vmax
        m = m if m < vmax else vmax
        tmp[i] = np.int32(np.ceil(m * inv_step)) + (neg if v < 0 else np.int32(0))
    for i in range(x.shape[0]):
        dst[i] = lut2[np.uint32(tmp[i])]


@njit
def encode_blocks(b0, b1, X, Xi, block, isfp, qf, vmax, inv_step, lut2, scales, out, off, bits):
    """Scales and codes of blocks b0..b1 (``b0 * block * bits`` a multiple of 8). A block holding NaN/Inf
    gets its NaN/Inf scale and zero codes (the caller raises). ``lut2``: the rounding table, then the
    same with the sign bit set (blockfp)."""
    n = X.shape[0]
    qf, vmax, inv_step = np.float32(qf), np.float32(vmax), np.float32(inv_step)  # fp32 arithmetic, as torch's
    neg = np.int32(lut2.shape[0] // 2)
    buf = np.empty(CAP, dtype=np.uint8)
    tmp = np.empty(CAP, dtype=np.int32)
    o = off + (b0 * block * bits) // 8
    fill = 0
    for b in range(b0, b1):
        s = b * block
        t = min(s + block, n)
        m = _absmax_bits(Xi[s:t])
        a = f32_of_bits(m)
        scales[b] = a
        sa = a if a > 0 else np.float32(1.0)
        i = s
        while i < t:
            if bits == 8:  # the codes are the payload bytes
                take = min(t - i, CAP)
                dst = out[off + i: off + i + take]
            else:
                take = min(t - i, CAP - fill)
                dst = buf[fill: fill + take]
            if m >= FINITE:
                dst[:] = 0
            elif isfp:
                _fp_codes(X[i: i + take], sa, vmax, inv_step, lut2, neg, tmp, dst)
            else:
                _int_codes(X[i: i + take], sa, qf, dst)
            i += take
            if bits != 8:
                fill += take
                if fill == CAP:
                    o = pack(out, o, buf, bits)
                    fill = 0
    if fill:
        pack(out, o, buf[:fill], bits)


@njit
def decode_blocks(b0, b1, src, off, bits, block, n, scales, isfp, qf, table, out):
    """Blocks b0..b1 into ``out`` (fp32, n): ``table[q] * scale`` (blockfp), ``((q - qmax) / qmax) * scale``
    (blockwise: the division vectorizes, a table look-up does not)."""
    qf = np.float32(qf)
    buf = np.empty(CAP, dtype=np.uint8)
    e = b0 * block
    e1 = min(b1 * block, n)
    o = off + (e * bits) // 8
    while e < e1:
        take = min(CAP, e1 - e)
        if bits == 8:
            q = src[o: o + take]
        else:
            q = buf[:take]
            unpack(src, o, q, bits)
        o += (take * bits) // 8  # whole bytes except at the end of the stream
        j = e
        while j < e + take:
            b = j // block
            t = min((b + 1) * block, e + take)
            a = scales[b]
            qs = q[j - e: t - e]
            dst = out[j: t]
            if isfp:
                for k in range(t - j):
                    dst[k] = table[qs[k]] * a
            else:
                for k in range(t - j):
                    dst[k] = (np.float32(qs[k]) - qf) / qf * a
            j = t
        e += take


def _quantum(codec) -> int:
    """Blocks per byte-aligned run of the code stream."""
    return 8 // math.gcd(codec.block * codec.bits, 8)


_SIGNED_LUTS: dict[int, np.ndarray] = {}


def _signed_lut(codec) -> np.ndarray:
    """blockfp's rounding table (``BlockFloat._tab``), then the same codes with the sign bit set."""
    lut = _SIGNED_LUTS.get(codec.bits)
    if lut is None:
        base = codec._tab(torch.device("cpu"))[2].numpy()
        lut = _SIGNED_LUTS[codec.bits] = np.concatenate([base, base | np.uint8(1 << (codec.bits - 1))])
    return lut


def _params(codec):
    """(isfp, qmax, vmax, 1 / step, signed rounding LUT, decode table) of ``codec``."""
    if type(codec).__name__ == "BlockFloat":
        grid, signed, _, inv_step = codec._tab(torch.device("cpu"))
        return True, 0.0, float(grid[-1]), float(inv_step), _signed_lut(codec), np_of(signed)
    return False, float(codec.qmax), 0.0, 0.0, np.zeros(2, np.uint8), np.zeros(1, np.float32)


def encode(codec, x: torch.Tensor) -> torch.Tensor:
    check_float_dtype(x.dtype, codec.name)
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    nb = codec.n_blocks(n)
    payload = torch.empty(codec.payload_nbytes(x.shape, x.dtype), dtype=torch.uint8)
    X = x.detach().reshape(-1).to(torch.float32).contiguous()
    scales = payload[: 4 * nb].view(torch.float32)
    isfp, qf, vmax, inv_step, lut2, _ = _params(codec)
    run_blocks(encode_blocks, blocks(nb, codec.block, _quantum(codec)), np_of(X), np_of(X.view(torch.int32)),
               codec.block, isfp, qf, vmax, inv_step, lut2, np_of(scales), np_of(payload), 4 * nb, codec.bits)
    m = float(scales.amax())  # as the reference: the absmax propagates NaN and Inf
    if not m <= MAX_ABS:
        check_magnitude(x, m, codec.name)
    return payload


def decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    shape = as_shape(shape)
    codec.check_payload(payload, shape, dtype)
    n = numel(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=payload.device)
    nb = codec.n_blocks(n)
    absmax = from_bytes(payload, torch.float32, nb)
    isfp, qf, _, _, _, table = _params(codec)
    vals = torch.empty(shape if dtype == torch.float32 else (n,), dtype=torch.float32)
    run_blocks(decode_blocks, blocks(nb, codec.block, _quantum(codec)), np_of(payload.contiguous()), 4 * nb,
               codec.bits, codec.block, n, np_of(absmax), isfp, qf, table, np_of(vals.view(-1)))
    bound = 2.0 * float(absmax.abs().amax())  # as the reference
    check_decoded(vals, bound, codec.name)
    return vals if dtype == torch.float32 else clamp_to_dtype_(vals, dtype, bound).to(dtype).reshape(shape)


register_kernels("cpu", "BlockwiseInt", encode=encode, decode=decode)
register_kernels("cpu", "BlockFloat", encode=encode, decode=decode)
