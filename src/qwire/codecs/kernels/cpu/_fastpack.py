"""Pieces shared by the ``perchannel`` and block-wise kernels: a true fused multiply-add, and bit packing
with whole groups of codes per step (the format of :mod:`qwire.codecs.packing`, as ``_common.pack_into``).

``fma32`` is LLVM's ``llvm.fma.f32``: ``a * b + c`` with a single rounding to fp32, which is what torch's
``addcmul`` computes on CPU (a fused multiply-add instruction). Emulating it in float64 (round the exact
product's sum to fp64, then to fp32) rounds twice and differs in about one case in 10**7 for general
operands; the intrinsic does not, and it vectorizes to ``vfmadd`` where the CPU has FMA (elsewhere LLVM
calls libm's correctly rounded ``fmaf``).

``f32_of_bits``/``bits_of_f32`` reinterpret fp32 bit patterns, ``f16_of_f32``/``f32_of_f16`` convert to
and from fp16 bit patterns (LLVM ``fptrunc``/``fpext``: ``vcvtps2ph``/``vcvtph2ps`` with F16C, round to
nearest even as torch).

The packers write ``codes`` (uint8, each < 2**bits) from byte ``o`` of ``out`` and return the next byte
offset; the unpackers are their inverse. Widths 8, 6, 4, 3, 2 take whole groups (1, 16, 2, 32, 4 codes) per step,
the others groups of 8 codes in ``bits`` bytes; a tail shorter than a group goes through the bit stream.
``codes`` must start 8-byte aligned (a prefix of a buffer from ``np.empty``): widths 6 and 2 view it as
uint32, width 3 as uint64.
"""

from __future__ import annotations

import sys

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._common import njit, pack_into, unpack_from

LITTLE = sys.byteorder == "little"  # the word-at-a-time paths read 4 byte-codes as one uint32


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` (fp32 operands) rounded once to fp32."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def div32(typingctx, a, b):
    """``a / b`` (fp32 operands), the IEEE quotient (x / 0 is +-Inf or NaN), as numba's ``/`` computes it but
    without its check for a zero divisor, whose branch keeps a loop from vectorizing."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fdiv(args[0], args[1])

    return sig, codegen


U64 = np.uint64
U32 = np.uint32
U16 = np.uint16
# Loops index with plain range variables over sliced views: numba checks a computed index such as
# ``o + i`` for wraparound (negative values), which keeps LLVM from vectorizing the loop (10x slower).


@njit
def _copy(dst, src):
    for i in range(src.shape[0]):
        dst[i] = src[i]


@njit
def pack(out, o, codes, bits):
    n = codes.shape[0]
    if bits == 8:
        _copy(out[o: o + n], codes)
        return o + n
    if bits == 4 and LITTLE:
        m = n // 2
        u = codes[: 2 * m].view(U16)
        dst = out[o: o + m]
        for i in range(m):
            x = u[i]
            dst[i] = np.uint8((x & U16(0xF)) | ((x >> U16(4)) & U16(0xF0)))
        return pack_into(out, o + m, codes[2 * m:], bits)
    if bits == 6 and LITTLE:
        # 16 codes at a time: each uint32 of 4 byte-codes becomes a 24-bit word (vectorized), then
        # 4 words -> 3 uint32, whose 12 bytes are copied out (``out`` may be unaligned)
        m = n // 16
        u = codes[: 16 * m].view(U32)
        w = np.empty((m, 4), dtype=U32)
        wf = w.reshape(4 * m)
        for i in range(4 * m):
            x = u[i]
            wf[i] = (x & U32(0x3F)) | ((x >> U32(2)) & U32(0xFC0)) | ((x >> U32(4)) & U32(0x3F000)) | \
                ((x >> U32(6)) & U32(0xFC0000))
        p = np.empty((m, 3), dtype=U32)
        for j in range(m):
            p[j, 0] = w[j, 0] | (w[j, 1] << U32(24))
            p[j, 1] = (w[j, 1] >> U32(8)) | (w[j, 2] << U32(16))
            p[j, 2] = (w[j, 2] >> U32(16)) | (w[j, 3] << U32(8))
        _copy(out[o: o + 12 * m], p.reshape(3 * m).view(np.uint8))
        return pack_into(out, o + 12 * m, codes[16 * m:], bits)
    if bits == 3 and LITTLE:
        # 32 codes at a time: each uint64 of 8 byte-codes becomes a 24-bit word (vectorized), then
        # 4 words -> 3 uint32, as for 6 bits
        m = n // 32
        u = codes[: 32 * m].view(U64)
        w = np.empty((m, 4), dtype=U32)
        wf = w.reshape(4 * m)
        for i in range(4 * m):
            x = u[i]
            wf[i] = U32((x & U64(0x7)) | ((x >> U64(5)) & U64(0x38)) | ((x >> U64(10)) & U64(0x1C0)) |
                        ((x >> U64(15)) & U64(0xE00)) | ((x >> U64(20)) & U64(0x7000)) |
                        ((x >> U64(25)) & U64(0x38000)) | ((x >> U64(30)) & U64(0x1C0000)) |
                        ((x >> U64(35)) & U64(0xE00000)))
        p = np.empty((m, 3), dtype=U32)
        for j in range(m):
            p[j, 0] = w[j, 0] | (w[j, 1] << U32(24))
            p[j, 1] = (w[j, 1] >> U32(8)) | (w[j, 2] << U32(16))
            p[j, 2] = (w[j, 2] >> U32(16)) | (w[j, 3] << U32(8))
        _copy(out[o: o + 12 * m], p.reshape(3 * m).view(np.uint8))
        return pack_into(out, o + 12 * m, codes[32 * m:], bits)
    if bits == 2 and LITTLE:
        m = n // 4
        u = codes[: 4 * m].view(U32)
        dst = out[o: o + m]
        for i in range(m):
            x = u[i]
            dst[i] = np.uint8((x & U32(3)) | ((x >> U32(6)) & U32(0xC)) | ((x >> U32(12)) & U32(0x30)) |
                              ((x >> U32(18)) & U32(0xC0)))
        return pack_into(out, o + m, codes[4 * m:], bits)
    m = n // 8
    c8 = codes[: 8 * m].reshape((m, 8))
    dst = out[o: o + bits * m].reshape((m, bits))
    for i in range(m):
        acc = np.uint64(0)
        for j in range(8):
            acc |= np.uint64(c8[i, j]) << np.uint64(j * bits)
        for k in range(bits):
            dst[i, k] = np.uint8((acc >> np.uint64(8 * k)) & np.uint64(255))
    return pack_into(out, o + bits * m, codes[8 * m:], bits)


@njit
def unpack(src, o, codes, bits):
    n = codes.shape[0]
    if bits == 8:
        _copy(codes, src[o: o + n])
        return
    if bits == 4 and LITTLE:
        m = n // 2
        u = codes[: 2 * m].view(U16)
        s = src[o: o + m]
        for i in range(m):
            x = U16(s[i])
            u[i] = (x & U16(0xF)) | ((x << U16(4)) & U16(0xF00))
        unpack_from(src, o + m, codes[2 * m:], bits)
        return
    if bits == 6 and LITTLE:
        m = n // 16
        p = np.empty((m, 3), dtype=U32)
        _copy(p.reshape(3 * m).view(np.uint8), src[o: o + 12 * m])
        w = np.empty((m, 4), dtype=U32)
        for j in range(m):
            w[j, 0] = p[j, 0] & U32(0xFFFFFF)
            w[j, 1] = (p[j, 0] >> U32(24)) | ((p[j, 1] & U32(0xFFFF)) << U32(8))
            w[j, 2] = (p[j, 1] >> U32(16)) | ((p[j, 2] & U32(0xFF)) << U32(16))
            w[j, 3] = p[j, 2] >> U32(8)
        wf = w.reshape(4 * m)
        u = codes[: 16 * m].view(U32)
        for i in range(4 * m):
            x = wf[i]
            u[i] = (x & U32(0x3F)) | ((x << U32(2)) & U32(0x3F00)) | ((x << U32(4)) & U32(0x3F0000)) | \
                ((x << U32(6)) & U32(0x3F000000))
        unpack_from(src, o + 12 * m, codes[16 * m:], bits)
        return
    if bits == 3 and LITTLE:
        m = n // 32
        p = np.empty((m, 3), dtype=U32)
        _copy(p.reshape(3 * m).view(np.uint8), src[o: o + 12 * m])
        w = np.empty((m, 4), dtype=U32)
        for j in range(m):
            w[j, 0] = p[j, 0] & U32(0xFFFFFF)
            w[j, 1] = (p[j, 0] >> U32(24)) | ((p[j, 1] & U32(0xFFFF)) << U32(8))
            w[j, 2] = (p[j, 1] >> U32(16)) | ((p[j, 2] & U32(0xFF)) << U32(16))
            w[j, 3] = p[j, 2] >> U32(8)
        wf = w.reshape(4 * m)
        u = codes[: 32 * m].view(U64)
        for i in range(4 * m):
            x = U64(wf[i])
            u[i] = (x & U64(0x7)) | ((x & U64(0x38)) << U64(5)) | ((x & U64(0x1C0)) << U64(10)) | \
                ((x & U64(0xE00)) << U64(15)) | ((x & U64(0x7000)) << U64(20)) | ((x & U64(0x38000)) << U64(25)) | \
                ((x & U64(0x1C0000)) << U64(30)) | ((x & U64(0xE00000)) << U64(35))
        unpack_from(src, o + 12 * m, codes[32 * m:], bits)
        return
    if bits == 2 and LITTLE:
        m = n // 4
        u = codes[: 4 * m].view(U32)
        s = src[o: o + m]
        for i in range(m):
            x = U32(s[i])
            u[i] = (x & U32(3)) | ((x << U32(6)) & U32(0x300)) | ((x << U32(12)) & U32(0x30000)) | \
                ((x << U32(18)) & U32(0x3000000))
        unpack_from(src, o + m, codes[4 * m:], bits)
        return
    m = n // 8
    mask = np.uint64((1 << bits) - 1)
    s2 = src[o: o + bits * m].reshape((m, bits))
    c8 = codes[: 8 * m].reshape((m, 8))
    for i in range(m):
        acc = np.uint64(0)
        for k in range(bits):
            acc |= np.uint64(s2[i, k]) << np.uint64(8 * k)
        for j in range(8):
            c8[i, j] = np.uint8((acc >> np.uint64(j * bits)) & mask)
    unpack_from(src, o + bits * m, codes[8 * m:], bits)


@intrinsic
def f32_of_bits(typingctx, i):
    """The fp32 value whose bit pattern is the int32 ``i``."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def bits_of_f32(typingctx, f):
    """The int32 bit pattern of the fp32 ``f``."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def f32_of_f16(typingctx, h):
    """The fp16 value with bit pattern ``h`` (int16), widened to fp32 (exact)."""
    sig = types.float32(types.int16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def f16_of_f32(typingctx, f):
    """The bit pattern (int16) of ``f`` rounded to fp16, to nearest even (as torch's ``.to(torch.float16)``)."""
    sig = types.int16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen
