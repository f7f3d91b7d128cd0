"""Eight-lane fp32 building blocks for the CPU kernels, written as numba intrinsics (LLVM IR).

Numba does not vectorize a Walsh-Hadamard butterfly (the index wrap-around checks hide the addresses
from LLVM's alias analysis) and makes 64-bit integers of every int32 expression, so these helpers spell
out the vector operations on runs of 8 consecutive fp32 values (LLVM ``<8 x float>``: one AVX register;
other targets split or scalarize it, with the same results). They are IEEE operations in the order the
docstrings give, without reassociation or fast-math: each result is what the scalar code computes.

Offsets are element indices and counts numbers of 8- or 32-element runs; nothing is bounds-checked
(the callers' loops guarantee the ranges). Boolean arguments (the fp8 format, non-temporal stores)
select between loops specialized at compile time, so the format's constants are immediates.
"""

from __future__ import annotations

import struct

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...portable import _C32, _LN2_32, TINY

I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
V8 = ir.VectorType(F32, 8)
V8I = ir.VectorType(I32, 8)
V8D = ir.VectorType(ir.DoubleType(), 8)
i64, f32 = types.int64, types.float32


# ------------------------------------------------------------------------------ IR helpers
def _ptr(context, builder, arrty, arr, idx, vty=V8):
    """Pointer to ``arr[idx]`` as a ``vty`` pointer."""
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.bitcast(builder.gep(ary.data, [idx]), vty.as_pointer())


def _splat(builder, value, vty=V8):
    if value.type != vty.element:
        value = builder.trunc(value, vty.element) if isinstance(value.type, ir.IntType) else builder.fptrunc(
            value, vty.element)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(V8I, [0] * 8))


def _const(value, vty=V8I):
    if isinstance(vty.element, ir.IntType) and value >= 1 << 31:
        value -= 1 << 32  # the same 32 bits
    return ir.Constant(vty, [value] * 8)


def _each8(builder, n8, body):
    """``body(k)`` for k = 0, 8, ..., 8 * (n8 - 1) (an i64 element offset)."""
    with cgutils.for_range(builder, n8) as loop:
        body(builder.shl(loop.index, ir.Constant(I64, 3)))


def _h8(builder, v):
    """Butterfly stages h = 1, 2, 4 inside one vector: lane c becomes ``v[c] + v[c ^ h]`` when bit h of c is
    clear, else ``v[c ^ h] - v[c]``, computed as ``fma(v, +-1, v[c ^ h])`` (the product is exact, so this is
    the plain sum or difference, rounded once)."""
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8, [V8, V8, V8]), "llvm.fma.v8f32")
    for h in (1, 2, 4):
        t = builder.shuffle_vector(v, v, ir.Constant(V8I, [c ^ h for c in range(8)]))
        v = builder.call(fma, [v, ir.Constant(V8, [-1.0 if c & h else 1.0 for c in range(8)]), t])
    return v


def _store_nt(builder, v, ptr):
    """A non-temporal store (straight to memory, no read of the line first): ``ptr`` 32-byte aligned."""
    st = builder.store(v, ptr, align=32)
    st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(I32, 1)]))


def _prefetch(builder, ptr):
    """Ask for the cache line at ``ptr`` (no fault if it is outside the array)."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, I8.as_pointer()), ir.Constant(I32, 0), ir.Constant(I32, 3),
                      ir.Constant(I32, 1)])


def _maybe_prefetch(context, builder, arrty, arr, at, k, pf):
    """Prefetch ``arr[at + pf]`` once per 64-byte line (every other vector: ``k`` % 16 == 0)."""
    with builder.if_then(builder.icmp_unsigned("==", builder.and_(k, ir.Constant(I64, 15)), ir.Constant(I64, 0))):
        _prefetch(builder, _ptr(context, builder, arrty, arr, builder.add(at, pf)))


@intrinsic
def prefetch(typingctx, arr, at):
    """Ask for the cache line holding ``arr``'s element ``at`` (flat index; no fault outside the array)."""

    def codegen(context, builder, sig, args):
        _prefetch(builder, _ptr(context, builder, sig.args[0], args[0], args[1]))
        return context.get_dummy_value()

    return types.void(arr, i64), codegen


@intrinsic
def store_fence(typingctx):
    """Order this thread's non-temporal stores before anything it does next (a full fence)."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


def _abs_bits(builder, v):
    return builder.and_(builder.bitcast(v, V8I), _const(0x7FFFFFFF))


def _umax(builder, a, b):
    return builder.select(builder.icmp_unsigned(">", a, b), a, b)


def _hmax(builder, m):
    """Largest lane of ``m`` (unsigned), as i64."""
    best = builder.extract_element(m, ir.Constant(I32, 0))
    for k in range(1, 8):
        best = _umax(builder, builder.extract_element(m, ir.Constant(I32, k)), best)
    return builder.zext(best, I64)


# ------------------------------------------------------------------------------ reductions
@intrinsic
def sumsq(typingctx, src, start, n32, pf):
    """Sum of squares of ``src[start:start + 32 * n32]`` in float64 (each square exact; fused multiply-adds).
    Running sums: element ``32 i + 8 j + k`` goes to sum (j, k), in order of i (four independent chains);
    then ``t_k = (s_0k + s_1k) + (s_2k + s_3k)`` and ``((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7))``.
    Prefetches the same range ``pf`` elements further on (the next batch; 0: itself, which is harmless)."""

    def codegen(context, builder, sig, args):
        src, start, n32, pf = args
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8D, [V8D, V8D, V8D]), "llvm.fma.v8f64")
        accs = [cgutils.alloca_once_value(builder, ir.Constant(V8D, [0.0] * 8)) for _ in range(4)]
        with cgutils.for_range(builder, n32) as loop:
            at = builder.add(start, builder.shl(loop.index, ir.Constant(I64, 5)))
            for line in (0, 16):
                _prefetch(builder, _ptr(context, builder, sig.args[0], src, builder.add(at, builder.add(
                    pf, ir.Constant(I64, line)))))
            for j, acc in enumerate(accs):
                p = _ptr(context, builder, sig.args[0], src, builder.add(at, ir.Constant(I64, 8 * j)))
                v = builder.fpext(builder.load(p, align=4), V8D)
                builder.store(builder.call(fma, [v, v, builder.load(acc)]), acc)  # exact square: v * v + acc
        a = [builder.load(acc) for acc in accs]
        t = builder.fadd(builder.fadd(a[0], a[1]), builder.fadd(a[2], a[3]))
        e = [builder.extract_element(t, ir.Constant(I32, k)) for k in range(8)]
        q = [builder.fadd(e[2 * k], e[2 * k + 1]) for k in range(4)]
        return builder.fadd(builder.fadd(q[0], q[1]), builder.fadd(q[2], q[3]))

    return types.float64(src, i64, i64, i64), codegen


def _hreduce(builder, v, op):
    """``op`` folded over the lanes of ``v`` (halves, then quarters, ...): one scalar."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n, 2 * n))))
        v = op(lo, hi)
    return builder.extract_element(v, ir.Constant(I32, 0))


@intrinsic
def minmax_sumsq8(typingctx, src, start, n8):
    """(min, max, sum of squares) of ``src[start:start + 8 * n8]`` (fp32; n8 >= 1): min and max by compare and
    select (a NaN may be lost: the sum of squares keeps it), the squares exact in float64 and summed in an
    order of their own (the float64 sum is rounded once to fp32 by the caller, see
    :func:`qwire.codecs.tiles.sum_squares`)."""

    def codegen(context, builder, sig, args):
        src, start, n8 = args
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8D, [V8D, V8D, V8D]), "llvm.fma.v8f64")
        first = builder.load(_ptr(context, builder, sig.args[0], src, start), align=4)
        mn = cgutils.alloca_once_value(builder, first)
        mx = cgutils.alloca_once_value(builder, first)
        acc = cgutils.alloca_once_value(builder, ir.Constant(V8D, [0.0] * 8))

        def body(k):
            v = builder.load(_ptr(context, builder, sig.args[0], src, builder.add(start, k)), align=4)
            a, b = builder.load(mn), builder.load(mx)
            builder.store(builder.select(builder.fcmp_ordered("<", v, a), v, a), mn)
            builder.store(builder.select(builder.fcmp_ordered(">", v, b), v, b), mx)
            d = builder.fpext(v, V8D)
            builder.store(builder.call(fma, [d, d, builder.load(acc)]), acc)

        _each8(builder, n8, body)
        lo = _hreduce(builder, builder.load(mn), lambda a, b: builder.select(builder.fcmp_ordered("<", b, a), b, a))
        hi = _hreduce(builder, builder.load(mx), lambda a, b: builder.select(builder.fcmp_ordered(">", b, a), b, a))
        sq = _hreduce(builder, builder.load(acc), builder.fadd)
        return context.make_tuple(builder, sig.return_type, [lo, hi, sq])

    return types.Tuple((f32, f32, types.float64))(src, i64, i64), codegen


@intrinsic
def absmax_bits(typingctx, src, start, n8, pf):
    """Largest ``bits(x) & 0x7fffffff`` over ``src[start:start + 8 * n8]`` (fp32): the bits of max|x|, or
    >= 0x7f800000 when there is an Inf or NaN. Prefetches ``pf`` elements ahead as :func:`sumsq`."""

    def codegen(context, builder, sig, args):
        src, start, n8, pf = args
        acc = cgutils.alloca_once_value(builder, _const(0))

        def body(k):
            at = builder.add(start, k)
            _maybe_prefetch(context, builder, sig.args[0], src, at, k, pf)
            v = builder.load(_ptr(context, builder, sig.args[0], src, at), align=4)
            builder.store(_umax(builder, _abs_bits(builder, v), builder.load(acc)), acc)

        _each8(builder, n8, body)
        return _hmax(builder, builder.load(acc))

    return i64(src, i64, i64, i64), codegen


@intrinsic
def scale_absmax(typingctx, src, so, c, dst, do, n8):
    """``dst[do + i] = src[so + i] * c`` for i < 8 * n8 (fp32 products); returns :func:`absmax_bits` of them."""

    def codegen(context, builder, sig, args):
        src, so, c, dst, do, n8 = args
        cv = _splat(builder, c)
        acc = cgutils.alloca_once_value(builder, _const(0))

        def body(k):
            v = builder.fmul(builder.load(_ptr(context, builder, sig.args[0], src, builder.add(so, k)), align=4), cv)
            builder.store(v, _ptr(context, builder, sig.args[3], dst, builder.add(do, k)), align=4)
            builder.store(_umax(builder, _abs_bits(builder, v), builder.load(acc)), acc)

        _each8(builder, n8, body)
        return _hmax(builder, builder.load(acc))

    return i64(src, i64, f32, dst, i64, i64), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """The fp32 number whose bit pattern is the low 32 bits of ``bits``."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.trunc(args[0], I32), F32)

    return f32(i64), codegen


# ------------------------------------------------------------------------------ Walsh-Hadamard transform
def _h32(builder, v):
    """Stages h = 8 and 16 across four consecutive vectors (32 elements), after :func:`_h8` on each: the radix-4
    butterfly ``s0, d0 = v0 + v1, v0 - v1; s1, d1 = v2 + v3, v2 - v3`` -> ``s0 + s1, d0 + d1, s0 - s1, d0 - d1``."""
    v = [_h8(builder, x) for x in v]
    s0, d0 = builder.fadd(v[0], v[1]), builder.fsub(v[0], v[1])
    s1, d1 = builder.fadd(v[2], v[3]), builder.fsub(v[2], v[3])
    return [builder.fadd(s0, s1), builder.fadd(d0, d1), builder.fsub(s0, s1), builder.fsub(d0, d1)]


def _make_mul_h32(want_max: bool):
    def fn(typingctx, src, so, a, dst, do, n32):
        def codegen(context, builder, sig, args):
            src, so, a, dst, do, n32 = args
            av = _splat(builder, a)
            acc = cgutils.alloca_once_value(builder, _const(0))
            with cgutils.for_range(builder, n32) as loop:
                k = builder.shl(loop.index, ir.Constant(I64, 5))
                x = [builder.fmul(builder.load(_ptr(context, builder, sig.args[0], src, builder.add(
                    so, builder.add(k, ir.Constant(I64, 8 * j)))), align=4), av) for j in range(4)]
                for j, y in enumerate(_h32(builder, x)):
                    builder.store(y, _ptr(context, builder, sig.args[3], dst, builder.add(
                        do, builder.add(k, ir.Constant(I64, 8 * j)))), align=4)
                    if want_max:
                        builder.store(_umax(builder, _abs_bits(builder, y), builder.load(acc)), acc)
            return _hmax(builder, builder.load(acc)) if want_max else context.get_dummy_value()

        return (i64 if want_max else types.void)(src, i64, f32, dst, i64, i64), codegen

    fn.__name__ = "mul_h32_max" if want_max else "mul_h32"
    fn.__doc__ = """``dst[do:do + 32 * n32]`` <- 32 elements at a time, butterfly stages h = 1 .. 16 of
    ``src[so:so + 32 * n32] * a`` (fp32 products); ``_max`` returns :func:`absmax_bits` of the results."""
    return intrinsic(fn)


mul_h32, mul_h32_max = _make_mul_h32(False), _make_mul_h32(True)


def _pass(context, builder, arrty, buf, o, g, h, radix, mode, acc=None, out=None):
    """Emit one pass of butterfly stages over the group ``buf[o:o + g]``: radix 2 is stage h, radix 4 is stages
    h and 2h together (``s0, d0 = a + b, a - b; s1, d1 = c + d, c - d`` then ``s0 + s1, d0 + d1, s0 - s1,
    d0 - d1``: what two radix-2 passes compute); ``h`` a constant >= 8. ``mode``: ``store`` writes the
    results back; ``max`` too, folding their absolute bits into the vector ``acc``; ``out`` / ``out_nt``
    writes ``(y * c1) * c2`` to ``arr[oo:oo + g]`` instead (``out = (arrty, arr, oo, c1, c2)``;
    ``out_nt``: non-temporal stores)."""
    lh, lr = (h >> 3).bit_length() - 1, radix.bit_length() - 1
    count = builder.lshr(g, ir.Constant(I64, 3 + lr))
    with cgutils.for_range(builder, count) as loop:
        t = loop.index
        vec = builder.add(builder.shl(builder.lshr(t, ir.Constant(I64, lh)), ir.Constant(I64, lh + lr)),
                          builder.and_(t, ir.Constant(I64, (1 << lh) - 1)))
        e = builder.shl(vec, ir.Constant(I64, 3))  # the first of the radix vectors, in the group
        offs = [builder.add(e, ir.Constant(I64, h * k)) for k in range(radix)]
        ptrs = [_ptr(context, builder, arrty, buf, builder.add(o, off)) for off in offs]
        x = [builder.load(p, align=4) for p in ptrs]
        if radix == 2:
            y = [builder.fadd(x[0], x[1]), builder.fsub(x[0], x[1])]
        else:
            s0, d0 = builder.fadd(x[0], x[1]), builder.fsub(x[0], x[1])
            s1, d1 = builder.fadd(x[2], x[3]), builder.fsub(x[2], x[3])
            y = [builder.fadd(s0, s1), builder.fadd(d0, d1), builder.fsub(s0, s1), builder.fsub(d0, d1)]
        for p, off, v in zip(ptrs, offs, y):
            if mode.startswith("out"):
                out_t, arr, oo, c1, c2 = out
                q = _ptr(context, builder, out_t, arr, builder.add(oo, off))
                r = builder.fmul(builder.fmul(v, c1), c2)
                _store_nt(builder, r, q) if mode == "out_nt" else builder.store(r, q, align=4)
                continue
            builder.store(v, p, align=4)
            if mode == "max":
                builder.store(_umax(builder, _abs_bits(builder, v), builder.load(acc)), acc)


# The stages after the first 32 elements' (h = 32, ...): (h, radix) of each pass, by group size.
PASSES = {32: (), 64: ((32, 2),), 128: ((32, 4),), 256: ((32, 4), (128, 2)), 512: ((32, 4), (128, 4))}


def _stages_codegen(last: str, nt_arg: bool):
    def codegen(context, builder, sig, args):
        buf, o, g = args[:3]
        arrty = sig.args[0]
        acc = cgutils.alloca_once_value(builder, _const(0))
        out = None
        if last.startswith("out"):
            out = (sig.args[5], args[5], args[6], _splat(builder, args[3]), _splat(builder, args[4]))
        for size, passes in PASSES.items():
            with builder.if_then(builder.icmp_signed("==", g, ir.Constant(I64, size))):
                for i, (h, radix) in enumerate(passes):
                    if i < len(passes) - 1:
                        _pass(context, builder, arrty, buf, o, g, h, radix, "store")
                    elif last == "out":  # non-temporal stores or not, by the runtime flag
                        with builder.if_else(builder.icmp_signed("!=", args[7], ir.Constant(args[7].type, 0))) as (
                                yes, no):
                            with yes:
                                _pass(context, builder, arrty, buf, o, g, h, radix, "out_nt", out=out)
                            with no:
                                _pass(context, builder, arrty, buf, o, g, h, radix, "out", out=out)
                    else:
                        _pass(context, builder, arrty, buf, o, g, h, radix, last, acc=acc)
        return _hmax(builder, builder.load(acc)) if last == "max" else context.get_dummy_value()

    return codegen


@intrinsic
def stages(typingctx, buf, o, g):
    """Butterfly stages h = 32, 64, ..., g/2 of the group ``buf[o:o + g]`` (g in 32 .. 512) in place, in passes
    of two stages (radix 4) and a radix-2 pass where log2(g) is even (stages 1 .. 16 are done on loading)."""
    return types.void(buf, i64, i64), _stages_codegen("store", False)


@intrinsic
def stages_max(typingctx, buf, o, g):
    """:func:`stages`, returning the :func:`absmax_bits` of the results (0 when g == 32: no stage)."""
    return i64(buf, i64, i64), _stages_codegen("max", False)


@intrinsic
def stages_out(typingctx, buf, o, g, c1, c2, out, oo, nt):
    """:func:`stages`, the last pass writing ``(y * c1) * c2`` to ``out[oo:oo + g]`` instead (``nt``: with
    non-temporal stores, ``out + oo`` 32-byte aligned; end with :func:`store_fence`). Not for g == 32."""
    return types.void(buf, i64, i64, f32, f32, out, i64, types.boolean), _stages_codegen("out", True)


def _make_scale2(nt: bool):
    def fn(typingctx, src, so, c1, c2, dst, do, n8):
        def codegen(context, builder, sig, args):
            src, so, c1, c2, dst, do, n8 = args
            cv1, cv2 = _splat(builder, c1), _splat(builder, c2)

            def body(k):
                v = builder.load(_ptr(context, builder, sig.args[0], src, builder.add(so, k)), align=4)
                v = builder.fmul(builder.fmul(v, cv1), cv2)
                p = _ptr(context, builder, sig.args[4], dst, builder.add(do, k))
                _store_nt(builder, v, p) if nt else builder.store(v, p, align=4)

            _each8(builder, n8, body)
            return context.get_dummy_value()

        return types.void(src, i64, f32, f32, dst, i64, i64), codegen

    fn.__name__ = "scale2_nt" if nt else "scale2"
    fn.__doc__ = """``dst[do + i] = (src[so + i] * c1) * c2`` for i < 8 * n8 (fp32 products; ``_nt``: non-temporal
    stores, ``dst + do`` 32-byte aligned, end with :func:`store_fence`)."""
    return intrinsic(fn)


scale2, scale2_nt = _make_scale2(False), _make_scale2(True)


# ------------------------------------------------------------------------------ fp32 <-> fp8
# The two formats (1 sign bit; exponent bias, mantissa bits, largest finite value, first magnitude code that
# is Inf/NaN), by the id the intrinsics take as a literal argument (so that the constants are immediates).
E4M3, E5M2 = 0, 1
FORMATS8 = {E4M3: (7, 3, 448.0, 0x7F), E5M2: (15, 2, 57344.0, 0x7C)}


def cast_constants(fid: int) -> tuple[int, int, int, int, int]:
    """(bits of max, bits of 2^emin (the smallest normal), mantissa shift ``23 - m``, bits of 2^(23 - m), the
    code offset) of the fp32 -> fp8 cast of format ``fid``; see :func:`_fp8_codes`."""
    bias, m, fmax, _ = FORMATS8[fid]
    max_bits = int.from_bytes(struct.pack("<f", fmax), "little")
    e_min = (127 + 1 - bias) << 23
    sh = 23 - m
    return max_bits, e_min, sh, sh << 23, (sh << 23) + (e_min >> sh)


def decode_constants(fid: int) -> tuple[int, int, int, float, int]:
    """(mantissa shift, exponent rebias, first normal magnitude code, smallest subnormal, first Inf/NaN
    magnitude code) of the fp8 -> fp32 decode of format ``fid``."""
    bias, m, _, special = FORMATS8[fid]
    return 23 - m, (127 - bias) << 23, 1 << m, 2.0 ** (1 - bias - m), special


def _unswitch(builder, flag, emit):
    """``emit(True)`` where the runtime boolean ``flag`` holds, else ``emit(False)``: a loop emitted by ``emit``
    is then specialized on the flag (its constants are immediates) instead of testing it per element."""
    with builder.if_else(builder.icmp_signed("!=", flag, ir.Constant(flag.type, 0))) as (yes, no):
        with yes:
            emit(True)
        with no:
            emit(False)


def _fp8_codes(builder, v, fid):
    """FP8 codes (i32 lanes, each < 256) of ``v`` (no NaN), saturated to +-max and rounded to nearest, ties to
    even. With ``a = min(|v|, max)`` and ``E = max(exponent bits of a, those of 2^emin)``: the fp32 sum
    ``t = a + M``, ``M = 2^(23 - m) * 2^e`` (whose ulp is the fp8 spacing at a, subnormals included), is
    rounded by the fp32 adder to the fp8 grid, and ``bits(t) - bits(M)`` counts grid steps, to which the
    exponent field (``(E - emin) >> (23 - m)``) is added. M is a normal number, so flush-to-zero modes do not
    matter (only fp32 subnormal inputs, far below the fp8 range, could be read as zero: the same code)."""
    max_bits, e_min, sh, m_off, c_off = cast_constants(fid)
    b = builder.bitcast(v, V8I)
    a = builder.and_(b, _const(0x7FFFFFFF))
    a = builder.select(builder.icmp_signed("<", a, _const(max_bits)), a, _const(max_bits))
    e = builder.and_(a, _const(0x7F800000))
    e = builder.select(builder.icmp_signed(">", e, _const(e_min)), e, _const(e_min))
    t = builder.bitcast(builder.fadd(builder.bitcast(a, V8), builder.bitcast(builder.add(e, _const(m_off)), V8)), V8I)
    code = builder.add(builder.sub(t, builder.add(e, _const(c_off))), builder.lshr(e, _const(sh)))
    return builder.or_(code, builder.and_(builder.lshr(b, _const(24)), _const(0x80)))


def _fp8_store_codegen(op: str):
    def codegen(context, builder, sig, args):
        ci = 3 if op == "div" else 4  # index of ``codes`` in the arguments
        src, so = args[:2]
        cvs = [_splat(builder, c) for c in args[2:ci]]
        codes, co, n32, e5 = args[ci:ci + 4]
        v16, v32, v32b = ir.VectorType(I32, 16), ir.VectorType(I32, 32), ir.VectorType(I8, 32)

        def emit(is_e5):
            fid = E5M2 if is_e5 else E4M3
            with cgutils.for_range(builder, n32) as loop:
                k = builder.shl(loop.index, ir.Constant(I64, 5))
                q = []
                for j in range(4):
                    at = builder.add(so, builder.add(k, ir.Constant(I64, 8 * j)))
                    v = builder.load(_ptr(context, builder, sig.args[0], src, at), align=4)
                    v = builder.fdiv(v, cvs[0]) if op == "div" else builder.fmul(builder.fmul(v, cvs[0]), cvs[1])
                    q.append(_fp8_codes(builder, v, fid))
                lo = builder.shuffle_vector(q[0], q[1], ir.Constant(v16, list(range(16))))
                hi = builder.shuffle_vector(q[2], q[3], ir.Constant(v16, list(range(16))))
                q32 = builder.shuffle_vector(lo, hi, ir.Constant(v32, list(range(32))))
                out = _ptr(context, builder, sig.args[ci], codes, builder.add(co, k), v32b)
                builder.store(builder.trunc(q32, v32b), out, align=1)

        _unswitch(builder, e5, emit)
        return context.get_dummy_value()

    return codegen


@intrinsic
def fp8_mul2(typingctx, src, so, c1, c2, codes, co, n32, e5):
    """``codes[co + i]`` <- FP8 code (e5m2 if ``e5``, else e4m3) of ``(src[so + i] * c1) * c2`` (fp32 products) for
    i < 32 * n32: saturated to +-max, rounded to nearest even (:func:`_fp8_codes`)."""
    return types.void(src, i64, f32, f32, codes, i64, i64, types.boolean), _fp8_store_codegen("mul2")


@intrinsic
def fp8_div(typingctx, src, so, c, codes, co, n32, e5):
    """As :func:`fp8_mul2` for ``src[so + i] / c`` (fp32 quotients)."""
    return types.void(src, i64, f32, codes, i64, i64, types.boolean), _fp8_store_codegen("div")


def _fp8_values32(context, builder, lut_t, lut, codes_t, codes, at, fid):
    """fp32 values of the codes ``codes[at:at + 32]``, as four vectors: sign | ((mag << dsh) + drebias) for
    normal codes, ``mag * 2^-k`` for subnormal ones (exact), and the table ``lut`` when one of the 32 is an
    Inf/NaN code (never written by the encoders), so that every code decodes exactly as the table says."""
    dsh, drebias, sub_lim, sub_scale, special = decode_constants(fid)
    v32b = ir.VectorType(I8, 32)
    cb32 = builder.load(_ptr(context, builder, codes_t, codes, at, v32b), align=1)
    spec = builder.icmp_unsigned(">=", builder.and_(cb32, ir.Constant(v32b, [0x7F] * 32)),
                                 ir.Constant(v32b, [special] * 32))
    res = [cgutils.alloca_once(builder, V8) for _ in range(4)]
    for j in range(4):
        cb = builder.shuffle_vector(cb32, cb32, ir.Constant(V8I, list(range(8 * j, 8 * j + 8))))
        c = builder.zext(cb, V8I)
        mag = builder.and_(c, _const(0x7F))
        sign = builder.shl(builder.and_(c, _const(0x80)), _const(24))
        nrm = builder.add(builder.shl(mag, _const(dsh)), _const(drebias))
        sub = builder.bitcast(builder.fmul(builder.sitofp(mag, V8), _const(sub_scale, V8)), V8I)
        bits = builder.or_(builder.select(builder.icmp_unsigned("<", mag, _const(sub_lim)), sub, nrm), sign)
        builder.store(builder.bitcast(bits, V8), res[j])
    with builder.if_then(builder.icmp_unsigned("!=", builder.bitcast(spec, I32), ir.Constant(I32, 0)), likely=False):
        lut_data = context.make_array(lut_t)(context, builder, lut).data
        for j in range(4):
            v = ir.Constant(V8, ir.Undefined)
            for k in range(8):
                idx = builder.zext(builder.extract_element(cb32, ir.Constant(I32, 8 * j + k)), I64)
                v = builder.insert_element(v, builder.load(builder.gep(lut_data, [idx]), align=4), ir.Constant(I32, k))
            builder.store(v, res[j])
    return [builder.load(r) for r in res]


def _fp8_h32_codegen(out: bool):
    def codegen(context, builder, sig, args):
        if out:
            lut, codes, co, c1, c2, dst, do, n32, e5, nt = args
            dst_t = sig.args[5]
            cv1, cv2 = _splat(builder, c1), _splat(builder, c2)
        else:
            lut, codes, co, dst, do, n32, e5 = args
            dst_t = sig.args[3]

        def emit(is_e5, streamed=False):
            fid = E5M2 if is_e5 else E4M3
            with cgutils.for_range(builder, n32) as loop:
                k = builder.shl(loop.index, ir.Constant(I64, 5))
                x = _fp8_values32(context, builder, sig.args[0], lut, sig.args[1], codes, builder.add(co, k), fid)
                for j, y in enumerate(_h32(builder, x)):
                    p = _ptr(context, builder, dst_t, dst, builder.add(do, builder.add(k, ir.Constant(I64, 8 * j))))
                    if not out:
                        builder.store(y, p, align=4)
                    elif streamed:
                        _store_nt(builder, builder.fmul(builder.fmul(y, cv1), cv2), p)
                    else:
                        builder.store(builder.fmul(builder.fmul(y, cv1), cv2), p, align=4)

        if out:
            _unswitch(builder, e5, lambda f: _unswitch(builder, nt, lambda n: emit(f, n)))
        else:
            _unswitch(builder, e5, emit)
        return context.get_dummy_value()

    return codegen


@intrinsic
def fp8_h32(typingctx, lut, codes, co, dst, do, n32, e5):
    """``dst[do:do + 32 * n32]`` <- 32 elements at a time, butterfly stages h = 1 .. 16 of the values of the codes
    ``codes[co:co + 32 * n32]`` (e5m2 if ``e5``, else e4m3; ``lut``: the 256 values, for Inf/NaN codes)."""
    return types.void(lut, codes, i64, dst, i64, i64, types.boolean), _fp8_h32_codegen(False)


@intrinsic
def fp8_h32_out(typingctx, lut, codes, co, c1, c2, dst, do, n32, e5, nt):
    """:func:`fp8_h32` writing ``(y * c1) * c2`` (``nt``: with non-temporal stores, ``dst + do`` 32-byte aligned;
    end with :func:`store_fence`)."""
    return types.void(lut, codes, i64, f32, f32, dst, i64, i64, types.boolean, types.boolean), _fp8_h32_codegen(True)


@intrinsic
def fp8_scale(typingctx, lut, codes, co, c, dst, do, n32, e5, nt):
    """``dst[do + i]`` <- value of the code ``codes[co + i]`` (e5m2 if ``e5``, else e4m3) times ``c`` (fp32
    products) for i < 32 * n32 (``nt``: non-temporal stores, ``dst + do`` 32-byte aligned; end with
    :func:`store_fence`)."""

    def codegen(context, builder, sig, args):
        lut, codes, co, c, dst, do, n32, e5, nt = args
        cv = _splat(builder, c)

        def emit(is_e5, streamed):
            fid = E5M2 if is_e5 else E4M3
            with cgutils.for_range(builder, n32) as loop:
                k = builder.shl(loop.index, ir.Constant(I64, 5))
                x = _fp8_values32(context, builder, sig.args[0], lut, sig.args[1], codes, builder.add(co, k), fid)
                for j, v in enumerate(x):
                    at = builder.add(do, builder.add(k, ir.Constant(I64, 8 * j)))
                    p, r = _ptr(context, builder, sig.args[4], dst, at), builder.fmul(v, cv)
                    _store_nt(builder, r, p) if streamed else builder.store(r, p, align=4)

        _unswitch(builder, e5, lambda f: _unswitch(builder, nt, lambda n: emit(f, n)))
        return context.get_dummy_value()

    return types.void(lut, codes, i64, f32, dst, i64, i64, types.boolean, types.boolean), codegen


# ------------------------------------------------------------------------------ TAH-Quant's entropy
@intrinsic
def entropy_sums8(typingctx, src, start, n8, levels, buf, bo):
    """``(S, X)`` of the tile ``a = |src[start:start + 8 * n8]|`` (n8 = 2**levels): ``S`` = :func:`tree_sum`
    of ``a`` and ``X`` = :func:`tree_sum` of ``a' * log_approx(a')``, ``a' = max(a, tiny)``, as
    :func:`qwire.codecs.portable.entropy` computes them: the polynomial one rounded fp32 operation at a
    time, and each level of the pairwise sums adds the second half onto the first (the vectors while
    more than one is left, then the halves of the last one). ``buf[bo:bo + 16 * n8]`` is scratch."""
    cs, ln2, tiny = _C32, _LN2_32, TINY  # fp32 values (exact as the IR's float constants)

    def codegen(context, builder, sig, args):
        src, start, n8, levels, buf, bo = args
        bt = sig.args[4]
        one = ir.Constant(V8, [1.0] * 8)
        tv = ir.Constant(V8, [tiny] * 8)
        xo = builder.add(bo, builder.shl(n8, ir.Constant(I64, 3)))  # the second half of the scratch

        def body(k):
            v = builder.load(_ptr(context, builder, sig.args[0], src, builder.add(start, k)), align=4)
            a = builder.bitcast(_abs_bits(builder, v), V8)
            builder.store(a, _ptr(context, builder, bt, buf, builder.add(bo, k)), align=4)
            t = builder.select(builder.fcmp_ordered("<", a, tv), tv, a)
            bits = builder.bitcast(t, V8I)
            m = builder.bitcast(builder.or_(builder.and_(bits, _const(0x7FFFFF)), _const(0x3F800000)), V8)
            f = builder.fsub(m, one)
            p = ir.Constant(V8, [cs[6]] * 8)
            for c in cs[5::-1]:
                p = builder.fadd(builder.fmul(p, f), ir.Constant(V8, [c] * 8))
            p = builder.fmul(p, f)
            e = builder.sub(builder.and_(builder.lshr(bits, _const(23)), _const(0xFF)), _const(127))
            lg = builder.fadd(builder.fmul(builder.sitofp(e, V8), ir.Constant(V8, [ln2] * 8)), p)
            builder.store(builder.fmul(t, lg), _ptr(context, builder, bt, buf, builder.add(xo, k)), align=4)

        _each8(builder, n8, body)
        with cgutils.for_range(builder, levels) as lv:  # h = n8 / 2, n8 / 4, ..., 1 vectors
            h = builder.lshr(n8, builder.add(lv.index, ir.Constant(I64, 1)))
            h8 = builder.shl(h, ir.Constant(I64, 3))
            with cgutils.for_range(builder, h) as loop:
                k = builder.shl(loop.index, ir.Constant(I64, 3))
                for base in (bo, xo):
                    p0 = _ptr(context, builder, bt, buf, builder.add(base, k))
                    p1 = _ptr(context, builder, bt, buf, builder.add(base, builder.add(k, h8)))
                    builder.store(builder.fadd(builder.load(p0, align=4), builder.load(p1, align=4)), p0, align=4)
        s = _hreduce(builder, builder.load(_ptr(context, builder, bt, buf, bo), align=4), builder.fadd)
        x = _hreduce(builder, builder.load(_ptr(context, builder, bt, buf, xo), align=4), builder.fadd)
        return context.make_tuple(builder, sig.return_type, [s, x])

    return types.UniTuple(f32, 2)(src, i64, i64, i64, buf, i64), codegen


@intrinsic
def pivot8(typingctx, src, start, n8, big):
    """For ``a = bits(|src[start:start + 8 * n8]|)`` (fp32 magnitudes as int32: ordered like the values) and
    ``big`` (the bits of their largest): ``(first i with a[i] == big, or 8 * n8 if none; how many equal
    big; the largest a[i] below big, or 0)``, eight lanes at a time (integer operations: exact)."""

    def codegen(context, builder, sig, args):
        src, start, n8, big = args
        bv = _splat(builder, builder.trunc(big, I32), V8I)
        none = builder.trunc(builder.shl(n8, ir.Constant(I64, 3)), I32)
        first = cgutils.alloca_once_value(builder, _splat(builder, none, V8I))
        cnt = cgutils.alloca_once_value(builder, _const(0))
        m2 = cgutils.alloca_once_value(builder, _const(0))
        lanes = ir.Constant(V8I, list(range(8)))

        def body(k):
            v = builder.load(_ptr(context, builder, sig.args[0], src, builder.add(start, k)), align=4)
            a = _abs_bits(builder, v)
            eq = builder.icmp_signed("==", a, bv)
            idx = builder.add(lanes, _splat(builder, builder.trunc(k, I32), V8I))
            f = builder.load(first)
            cand = builder.select(eq, idx, f)
            builder.store(builder.select(builder.icmp_signed("<", cand, f), cand, f), first)
            builder.store(builder.sub(builder.load(cnt), builder.sext(eq, V8I)), cnt)
            below = builder.select(builder.icmp_signed("<", a, bv), a, _const(0))
            mm = builder.load(m2)
            builder.store(builder.select(builder.icmp_signed(">", below, mm), below, mm), m2)

        _each8(builder, n8, body)
        fi = _hreduce(builder, builder.load(first), lambda a, b: builder.select(builder.icmp_signed("<", b, a), b, a))
        ct = _hreduce(builder, builder.load(cnt), builder.add)
        mx = _hreduce(builder, builder.load(m2), lambda a, b: builder.select(builder.icmp_signed(">", b, a), b, a))
        return context.make_tuple(builder, sig.return_type, [builder.sext(v, I64) for v in (fi, ct, mx)])

    return types.UniTuple(i64, 3)(src, i64, i64, i64), codegen


# ------------------------------------------------------------------------------ a grid's squared error
def _grid_sq(builder, x, zz, st, inv, bias, top):
    """``d * d`` of the values ``x`` on the asymmetric grid (zz, st) with codes 0..top, as the CPU kernels'
    scalar ``_errors`` computes it: ``v = fma(x, inv, bias)`` (``inv = 1/st``, ``bias = -(zz * inv)``, given),
    ``v > 0 ? v : 0``, ``v < top ? v : top``, rounded half to even (as adding and subtracting 1.5 * 2^23), then
    ``d = x - (zz + q * st)``: one rounding per operation, nothing fused but the first."""
    vt = x.type  # <8 x float>, or two candidates' eight lanes side by side in <16 x float>
    tag = f"v{vt.count}f32"
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.{tag}")
    even = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt]), f"llvm.roundeven.{tag}")
    zero = ir.Constant(vt, [0.0] * vt.count)
    v = builder.call(fma, [x, inv, bias])
    v = builder.select(builder.fcmp_ordered(">", v, zero), v, zero)
    v = builder.select(builder.fcmp_ordered("<", v, top), v, top)
    q = builder.call(even, [v])  # = (v + 1.5 * 2^23) - 1.5 * 2^23 for 0 <= v < 2^22 (top: a count of levels)
    d = builder.fsub(x, builder.fadd(zz, builder.fmul(q, st)))
    return builder.fmul(d, d)


@intrinsic
def lane_sse8x4(typingctx, src, start, n8, grids, t, nt, idx, i0, out):
    """Squared errors of ``src[start:start + 8 * n8]`` on four grids at once, written to ``out[i0:i0 + 4]``:
    grid m is column ``t`` of row ``idx[i0 + m]`` of ``grids`` ((5, n, nt) fp32: zz, st, inv, bias, top of
    :func:`_grid_sq` for n grids of nt tiles). Each is summed as ``LogLayout.tile_sse`` sums it (element i
    into lane i % 8, in order, then ``((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))``); the four sums
    are independent chains, so their operations overlap."""

    def codegen(context, builder, sig, args):
        src, start, n8, grids, t, nt, idx, i0, out = args
        ga = context.make_array(sig.args[3])(context, builder, grids)
        gd = ga.data
        id_ = context.make_array(sig.args[6])(context, builder, idx).data
        od = context.make_array(sig.args[8])(context, builder, out).data
        field = builder.mul(nt, builder.extract_value(ga.shape, 1))  # n * nt: one field's plane
        p = []
        for m in range(4):
            j = builder.load(builder.gep(id_, [builder.add(i0, ir.Constant(I64, m))]))
            at = builder.add(builder.mul(j, nt), t)
            p.append([_splat(builder, builder.load(builder.gep(gd, [builder.add(at, builder.mul(
                field, ir.Constant(I64, f)))]))) for f in range(5)])
        # two grids per <16 x float> (one AVX-512 register where there is one; else two of 8)
        both = ir.Constant(ir.VectorType(I32, 16), list(range(16)))
        twice = ir.Constant(ir.VectorType(I32, 16), list(range(8)) * 2)
        pp = [[builder.shuffle_vector(p[m][f], p[m + 1][f], both) for f in range(5)] for m in (0, 2)]
        V16 = ir.VectorType(F32, 16)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(V16, [0.0] * 16)) for _ in range(2)]

        def body(k):
            x = builder.load(_ptr(context, builder, sig.args[0], src, builder.add(start, k)), align=4)
            x2 = builder.shuffle_vector(x, x, twice)
            for m in range(2):
                builder.store(builder.fadd(builder.load(accs[m]), _grid_sq(builder, x2, *pp[m])), accs[m])

        _each8(builder, n8, body)
        for m in range(4):
            a = builder.load(accs[m // 2])
            ln = [builder.extract_element(a, ir.Constant(I32, 8 * (m % 2) + q)) for q in range(8)]
            v = builder.fadd(builder.fadd(builder.fadd(ln[0], ln[4]), builder.fadd(ln[2], ln[6])),
                             builder.fadd(builder.fadd(ln[1], ln[5]), builder.fadd(ln[3], ln[7])))
            builder.store(v, builder.gep(od, [builder.add(i0, ir.Constant(I64, m))]))
        return context.get_dummy_value()

    return types.void(src, i64, i64, grids, i64, i64, idx, i64, out), codegen


@intrinsic
def tree_sse8x4(typingctx, src, start, n8, levels, nw, grids, g0, out, buf):
    """Squared errors of the two-width block ``src[start:start + 8 * n8]`` (n8 = 2**levels) on four grids at once,
    rows ``g0`` .. ``g0 + 3`` of ``grids`` ((n, 10) fp32; n >= g0 + 4), written to ``out[g0:g0 + 4]``: element i
    on the grid ``row[0:5]`` = (zz, st, inv, bias, top) of :func:`_grid_sq` where i < ``nw``, else on
    ``row[5:10]``; each grid's squares added pairwise as :func:`qwire.codecs.portable.tree_sum` (the second half
    onto the first, vectors while more than one is left, then the halves of the last). ``buf[:32 * n8]`` is
    scratch."""

    def codegen(context, builder, sig, args):
        src, start, n8, levels, nw, grids, g0, out, buf = args
        bt = sig.args[8]
        gd = context.make_array(sig.args[5])(context, builder, grids).data
        od = context.make_array(sig.args[7])(context, builder, out).data
        base = builder.mul(g0, ir.Constant(I64, 10))
        g = [[_splat(builder, builder.load(builder.gep(gd, [builder.add(base, ir.Constant(I64, 10 * m + f))])))
              for f in range(10)] for m in range(4)]
        wide = _splat(builder, builder.trunc(nw, I32), V8I)
        lanes = ir.Constant(V8I, list(range(8)))
        n = builder.shl(n8, ir.Constant(I64, 3))
        bases = [builder.mul(n, ir.Constant(I64, m)) for m in range(4)]

        def body(k):
            x = builder.load(_ptr(context, builder, sig.args[0], src, builder.add(start, k)), align=4)
            first = builder.icmp_signed("<", builder.add(lanes, _splat(builder, builder.trunc(k, I32), V8I)), wide)
            for m in range(4):
                p = [builder.select(first, g[m][f], g[m][f + 5]) for f in range(5)]
                builder.store(_grid_sq(builder, x, *p), _ptr(context, builder, bt, buf, builder.add(bases[m], k)),
                              align=4)

        _each8(builder, n8, body)
        with cgutils.for_range(builder, levels) as lv:
            h = builder.lshr(n8, builder.add(lv.index, ir.Constant(I64, 1)))
            h8 = builder.shl(h, ir.Constant(I64, 3))
            with cgutils.for_range(builder, h) as loop:
                k = builder.shl(loop.index, ir.Constant(I64, 3))
                for m in range(4):
                    p0 = _ptr(context, builder, bt, buf, builder.add(bases[m], k))
                    p1 = _ptr(context, builder, bt, buf, builder.add(bases[m], builder.add(k, h8)))
                    builder.store(builder.fadd(builder.load(p0, align=4), builder.load(p1, align=4)), p0, align=4)
        for m in range(4):
            v = _hreduce(builder, builder.load(_ptr(context, builder, bt, buf, bases[m]), align=4), builder.fadd)
            builder.store(v, builder.gep(od, [builder.add(g0, ir.Constant(I64, m))]))
        return context.get_dummy_value()

    return types.void(src, i64, i64, i64, i64, grids, i64, out, buf), codegen
