"""CPU kernels of the float casts ``fp16``/``bf16``/``fp32`` (:mod:`qwire.codecs.floats`): one pass per tensor.

The torch reference is already a single pass (or no pass at all) where the tensor's dtype is the
wire dtype: encode is then a view of the tensor's bytes and decode one copy, and those run the
reference here too. The kernels cover the conversions:

* encode to ``fp16`` from fp32/bf16: the cast and the overflow check (a finite value that becomes
  Inf) in one pass. The reference's ``isinf(y) & isfinite(x)`` and ``any()`` cost ~12x the cast on CPU
  (measured: 27 ms against 2 ms for 26 MB of fp32); the error itself is raised by the reference code,
  so its message is the same.
* encode to ``bf16`` from fp16 (through fp32, exact), and every decode whose output dtype is not the wire
  dtype: read the payload bytes in place (the reference first copies them) and convert. A finite value
  that becomes Inf (a narrower output dtype) sends the decode to the reference, which clamps it.

Encode to ``fp32`` from fp16/bf16 and to ``bf16`` from fp32 stay with torch: single passes already.
Rounding: to nearest, ties to even, as torch (fp16 by the hardware conversion, as torch's vector code;
bf16 on the bits). Results are the reference's bit for bit, except the bits of NaNs: both give a NaN,
but torch itself writes different NaN patterns in its vector loop and in its scalar tail.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...base import as_shape, check_float_dtype, numel
from .. import register_kernels
from ._common import blocks, njit, np_of, run_blocks
from ._simd import I32, I64, V8, V8I, _const

F32, F16, BF16 = 0, 1, 2  # element kinds, as literal arguments of :func:`convert`
KIND = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}
SIZE = {F32: 4, F16: 2, BF16: 2}
I16 = ir.IntType(16)
V8H = ir.VectorType(ir.HalfType(), 8)
V8S = ir.VectorType(I16, 8)


def _load(builder, ptr, kind):
    """8 elements of ``kind`` at the byte pointer ``ptr`` (any alignment), as exact fp32."""
    if kind == F32:
        return builder.load(builder.bitcast(ptr, V8.as_pointer()), align=1)
    raw = builder.load(builder.bitcast(ptr, V8S.as_pointer()), align=1)
    if kind == F16:
        return builder.fpext(builder.bitcast(raw, V8H), V8)
    return builder.bitcast(builder.shl(builder.zext(raw, V8I), _const(16)), V8)  # bf16: the high half of an fp32


def _store(builder, v, ptr, kind):
    """``v`` (fp32) as ``kind`` at the byte pointer ``ptr``, rounded to nearest even; returns the stored bits
    (i16 lanes) for fp16/bf16."""
    if kind == F32:
        builder.store(v, builder.bitcast(ptr, V8.as_pointer()), align=1)
        return None
    if kind == F16:  # the hardware conversion (F16C), as torch's vector loop
        bits = builder.bitcast(builder.fptrunc(v, V8H), V8S)
    else:  # bf16: round the low 16 bits away, ties to even; NaN -> 0x7fc0 as torch's scalar code
        b = builder.bitcast(v, V8I)
        lsb = builder.and_(builder.lshr(b, _const(16)), _const(1))
        r = builder.lshr(builder.add(builder.add(b, _const(0x7FFF)), lsb), _const(16))
        nan = builder.icmp_unsigned(">", builder.and_(b, _const(0x7FFFFFFF)), _const(0x7F800000))
        bits = builder.trunc(builder.select(nan, _const(0x7FC0), r), V8S)
    builder.store(bits, builder.bitcast(ptr, V8S.as_pointer()), align=1)
    return bits


@intrinsic(prefer_literal=True)
def convert(typingctx, src, so, dst, do, n8, skind, dkind):
    """Convert ``8 * n8`` elements from byte ``so`` of the byte array ``src`` (element kind ``skind``) to byte
    ``do`` of ``dst`` (kind ``dkind``). Returns the number of finite inputs that became +-Inf (fp16, bf16)."""
    for k in (skind, dkind):
        if not isinstance(k, types.IntegerLiteral):
            raise TypeError("convert: the element kinds must be literal constants")

    def codegen(context, builder, sig, args):
        src, so, dst, do, n8 = args[:5]
        sk, dk = sig.args[5].literal_value, sig.args[6].literal_value
        sdata = context.make_array(sig.args[0])(context, builder, src).data
        ddata = context.make_array(sig.args[2])(context, builder, dst).data
        acc = cgutils.alloca_once_value(builder, _const(0))
        with cgutils.for_range(builder, n8) as loop:
            k = loop.index
            sp = builder.gep(sdata, [builder.add(so, builder.mul(k, ir.Constant(I64, 8 * SIZE[sk])))])
            dp = builder.gep(ddata, [builder.add(do, builder.mul(k, ir.Constant(I64, 8 * SIZE[dk])))])
            v = _load(builder, sp, sk)
            bits = _store(builder, v, dp, dk)
            if dk != F32:
                inf = builder.icmp_unsigned("==", builder.and_(bits, ir.Constant(V8S, [0x7FFF] * 8)),
                                            ir.Constant(V8S, [0x7C00 if dk == F16 else 0x7F80] * 8))
                fin = builder.icmp_unsigned("<", builder.and_(builder.bitcast(v, V8I), _const(0x7FFFFFFF)),
                                            _const(0x7F800000))
                over = builder.zext(builder.and_(inf, fin), V8I)
                builder.store(builder.add(builder.load(acc), over), acc)
        a = builder.load(acc)
        total = builder.extract_element(a, ir.Constant(I32, 0))
        for j in range(1, 8):
            total = builder.add(total, builder.extract_element(a, ir.Constant(I32, j)))
        return builder.zext(total, I64)

    return types.int64(src, types.int64, dst, types.int64, types.int64, skind, dkind), codegen


def _kernel(sk: int, dk: int):
    """A block kernel converting elements r0..r1 (kinds sk -> dk) between two byte arrays; the tail of the
    last block (< 8 elements) through an 8-element buffer. Adds its overflow count to ``over[r0 // step]``."""
    ss, ds = SIZE[sk], SIZE[dk]

    @njit
    def run(r0, r1, src, so, dst, do, over, step):
        n8 = (r1 - r0) >> 3
        cnt = convert(src, so + r0 * ss, dst, do + r0 * ds, n8, sk, dk)
        rest = r1 - r0 - 8 * n8
        if rest:
            sb = np.zeros(8 * ss, np.uint8)
            db = np.zeros(8 * ds, np.uint8)
            a = so + (r1 - rest) * ss
            sb[:rest * ss] = src[a:a + rest * ss]
            cnt += convert(sb, 0, db, 0, 1, sk, dk)
            b = do + (r1 - rest) * ds
            dst[b:b + rest * ds] = db[:rest * ds]
        over[r0 // step] = cnt

    return run


KERNELS = {(s, d): _kernel(s, d) for s in (F32, F16, BF16) for d in (F32, F16, BF16) if s != d}


def _bytes(t: torch.Tensor) -> np.ndarray:
    return np_of(t.reshape(-1).view(torch.uint8))


def _run(sk: int, dk: int, src: np.ndarray, so: int, dst: np.ndarray, n: int) -> int:
    spans = blocks(n, 1, 8)
    step = max(1, spans[0][1] - spans[0][0])
    over = np.zeros(len(spans) + 1, np.int64)
    run_blocks(KERNELS[(sk, dk)], spans, src, so, dst, 0, over, step)
    return int(over.sum())


def encode(codec, x: torch.Tensor) -> torch.Tensor:
    check_float_dtype(x.dtype, codec.name)
    sk, dk = KIND[x.dtype], KIND[codec.wire_dtype]
    reference = type(codec).encode.reference
    if sk == dk or not x.numel() or (sk, dk) not in ENCODES:
        return reference(codec, x)
    n = x.numel()
    out = torch.empty(n, dtype=codec.wire_dtype)
    if _run(sk, dk, _bytes(x.detach().contiguous()), 0, _bytes(out), n):
        return reference(codec, x)  # a finite value overflowed fp16: the reference raises its error
    return out.view(torch.uint8)


def decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    shape = as_shape(shape)
    check_float_dtype(dtype, codec.name)
    sk, dk = KIND[codec.wire_dtype], KIND[dtype]
    if sk == dk or payload.dtype != torch.uint8 or payload.dim() != 1:
        return type(codec).decode.reference(codec, payload, shape, dtype)
    codec.check_payload(payload, shape, dtype)
    n = numel(shape)
    out = torch.empty(n, dtype=dtype)
    if n and _run(sk, dk, _bytes(payload.contiguous()), 0, _bytes(out), n):
        # a finite value beyond the output's range: the reference clamps it
        return type(codec).decode.reference(codec, payload, shape, dtype)
    return out.reshape(shape)


# encodes worth a kernel (see the module docstring); the others run the reference
ENCODES = {(F32, F16), (BF16, F16), (F16, BF16)}
for _name in ("FP16", "BF16", "FP32"):
    register_kernels("cpu", _name, encode=encode, decode=decode)
