"""Shared pieces of the Triton kernels: launching, rounding like the reference, bit packing.

Bit packing follows :mod:`qwire.codecs.packing`: code ``i`` of a stream occupies stream bits
``[i * bits, (i + 1) * bits)``, little-endian. Eight codes of ``bits`` bits fill exactly ``bits`` bytes,
so the kernels work on *code groups* of 8: group ``g`` holds codes ``8g .. 8g + 7`` and bytes
``g * bits .. g * bits + bits - 1`` of the stream, whatever the width.
"""

from __future__ import annotations

import contextvars
import functools
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

# Under the interpreter (TRITON_INTERPRET=1, the CPU test path) tl.fma rounds twice and casts to FP8 round
# half up; the kernels take EXACT64 to compute the fused multiply-add in fp64 there instead, and SOFT_FP8 to round
# FP8 codes with integer arithmetic (:func:`to_fp8_bits`). A line only a GPU runs is marked ``# gpu-only`` (for
# scripts/compile_for_gpu.py --issue, which counts the lines that ran under the interpreter).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

GROUPS_PER_PROGRAM = 256  # code groups of 8 per program of the element-wise kernels: 2048 codes
# Warps per program of the kernels that pass over every element (statistics, quantize + pack, unpack +
# dequantize): with 2 instead of Triton's 4 a thread holds twice the elements and repeats its share of a
# program's set-up half as often; compiled for sm_90a, 10-16% fewer instructions per element
# (python scripts/compile_for_gpu.py --sass; docs/kernels.md). Not timed. (The mse search keeps 4: with 2 it
# took 57 barriers instead of 13.)
ELEMENT_WARPS = 2


# A kernel with an ``I64`` parameter computes its indices in int32 unless a tensor it is given holds INDEX_LIMIT
# elements or more, or an integer it is given is that large (:func:`launch` decides): on a GPU an int64 addition or
# comparison is two instructions, a multiplication three or more, and an int64 division by a run-time value calls
# a software routine of tens of instructions; in int32 the division is a short inline sequence. The margin covers
# the indices a last program's lanes compute past the end: at most 2^19 (the search's 64 tiles of up to 8192); a
# kernel whose programs span more (``blockwise``'s absmax of a block of any size) is given ``I64`` by its caller.
INDEX_LIMIT = 2**31 - 2**26
# The kernels' atomics (the checks' maxima, the anchors, a list's slots) are relaxed (``sem="relaxed"``): what they
# reduce is read after the kernel, whose end orders every write. Triton's default (acquire-release) put a memory
# fence and an invalidation of the multiprocessor's L1 cache around each (python scripts/compile_for_gpu.py --sass).
_TAKES_I64: dict[Any, bool] = {}
# Within one codec call (:func:`codec_call`) no kernel is given a tensor of more elements, or an integer larger, than
# CALL_FACTOR times the call's size (the larger of its tensor's elements and the shape it is given) plus CALL_SLACK
# (tables: ``blockfp``'s rounding table has up to 2^19 entries): checked on every launch under the interpreter
# (:func:`index_width`; ``CHECK_CALLS``, which scripts/gpu_op_count.py --host-time turns off to time the host as a GPU
# runs it).
CALL_FACTOR, CALL_SLACK = 8, 1 << 20
CHECK_CALLS = INTERPRET
# The bound of the codec call in progress (None outside one).
_CALL: contextvars.ContextVar[int | None] = contextvars.ContextVar("qwire_triton_call", default=None)


def codec_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A codec's kernel entry (``fn(codec, tensor, *args)``: encode, decode, ...) that decides two things once for
    all the launches it makes, where :func:`launch` decided them per launch (about 2 us each on the host): int32
    indices wherever its size (``CALL_FACTOR``) rules out 2^31, and the current CUDA device, the tensor's."""

    @functools.wraps(fn)
    def run(codec: Any, t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        size = t.numel()
        if args and isinstance(args[0], (tuple, list, torch.Size)):  # a shape: decode, read_fields
            try:
                size = max(size, math.prod(int(d) for d in args[0]))
            except (TypeError, ValueError):  # the codec's own check says what is wrong with it
                size = INDEX_LIMIT
        token = _CALL.set(CALL_FACTOR * size + CALL_SLACK)
        try:
            if INTERPRET or t.device.type != "cuda":
                return fn(codec, t, *args, **kwargs)
            with torch.cuda.device(t.device):
                return fn(codec, t, *args, **kwargs)
        finally:
            _CALL.reset(token)

    return run


def register(codec_name: str, *, supports: Callable[[Any], bool] | None = None, **ops: Callable[..., Any]) -> None:
    """Register Triton kernels for the codec class named ``codec_name`` (:func:`qwire.codecs.kernels.register_kernels`),
    each op a :func:`codec_call`."""
    from .. import register_kernels

    register_kernels("triton", codec_name, supports=supports, **{op: codec_call(fn) for op, fn in ops.items()})


def wide_indices(args: tuple) -> bool:
    """Whether a kernel given ``args`` must compute its indices in int64 (see ``INDEX_LIMIT``)."""
    for a in args:  # on the host for every launch: kept short (about a microsecond)
        if type(a) is int:
            if not -INDEX_LIMIT < a < INDEX_LIMIT:
                return True
        elif isinstance(a, torch.Tensor) and a.numel() >= INDEX_LIMIT:
            return True
    return False


def index_width(kernel: Any, args: tuple, constexprs: dict) -> dict:
    """``constexprs`` (a launch's keyword arguments, its own dict) with ``I64`` set (:func:`wide_indices`) where
    ``kernel`` takes it and it is not given."""
    takes = _TAKES_I64.get(kernel)
    if takes is None:
        takes = _TAKES_I64[kernel] = "I64" in kernel.arg_names
    if takes and "I64" not in constexprs:
        bound = _CALL.get()
        if bound is None or bound >= INDEX_LIMIT:  # outside a codec call, or one too large for the rule
            constexprs["I64"] = wide_indices(args)
        else:
            constexprs["I64"] = False
            if CHECK_CALLS:
                _within(kernel, args, bound)
    return constexprs


def _within(kernel: Any, args: tuple, bound: int) -> None:
    """Raise if a launch within a codec call is given more than the call's bound (``CALL_FACTOR``)."""
    for a in args:
        k = abs(a) if type(a) is int else a.numel() if isinstance(a, torch.Tensor) else 0
        if k > bound:
            raise AssertionError(f"{kernel.fn.__name__}: an argument of {k} elements is beyond the codec call's "
                                 f"bound {bound} (CALL_FACTOR); its indices would be ruled int32 without a check")


# How every kernel is compiled (by :func:`launch`, and by scripts/compile_for_gpu.py): no multiply-add contraction
# (the reference rounds every product and sum on its own; explicit ``tl.fma`` stays fused), and no flushing of
# subnormal operands to zero in the math library's functions (Triton's default flushes them: ``tl.floor`` of
# -1e-40 would be -0, where the reference's is -1).
COMPILE_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


# Within a CUDA graph's capture (kernels/graphs.py), the tensors every launch is given, kept as long as the graph:
# a graph holds their addresses, and a table from a bounded cache could otherwise be freed and its memory reused
KEEP: contextvars.ContextVar[list | None] = contextvars.ContextVar("qwire_graph_keep", default=None)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
    """Run ``kernel`` over ``grid``, compiled with :data:`COMPILE_OPTIONS`, on the device of its first tensor
    argument (Triton launches on the current device, which need not be the tensors'). A kernel with an ``I64``
    parameter is given it here (:func:`index_width`)."""
    constexprs = index_width(kernel, args, constexprs)
    keep = KEEP.get()
    if keep is not None:
        keep.extend(a for a in args if isinstance(a, torch.Tensor))
    if INTERPRET:
        kernel[grid](*args, **constexprs)
        return
    if _CALL.get() is not None:  # within a codec call (:func:`codec_call`), the tensors' device is the current one
        kernel[grid](*args, **COMPILE_OPTIONS, **constexprs)
        return
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    with torch.cuda.device(dev):
        kernel[grid](*args, **COMPILE_OPTIONS, **constexprs)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def contiguous_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened and contiguous (a view when it already is), fp32, fp16 or bf16 as it comes: the kernels
    load it and widen each value to fp32 (exactly), so a half-precision input is read at half the bytes and
    never copied to fp32 first."""
    x = x.detach().reshape(-1)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x = x.to(torch.float32)
    return x.contiguous()


@triton.jit
def listed_at(IDX, PIV, k, cnt):
    """Entries ``k`` of a list of tile ids on the device (``cnt`` set): which are set, their ids, their pivots."""
    m = k < cnt
    ti = tl.load(IDX + k, mask=m, other=0)
    return m, ti, tl.load(PIV + ti, mask=m, other=0).to(tl.int64)


@triton.jit
def fma32(a, b, c, EXACT64: tl.constexpr):
    """``a * b + c`` rounded once to fp32, as torch's fused ``addcmul``."""
    if EXACT64:
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(a, b, c)  # gpu-only


@triton.jit
def inverse(s):
    """``1/s`` (an IEEE division) where ``s > 0``, else 0: the quantizers' reciprocal of a step (a step of 0 or
    NaN maps every value to the grid's zero)."""
    pos = s > 0
    return tl.where(pos, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(pos, s, 1.0)), 0.0)


@triton.jit
def rint(v):
    """Round fp32 ``v`` (|v| < 2**22) half to even, as torch's ``round``: adding and subtracting
    1.5 * 2**23 leaves no fraction bits."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def program_start(SIZE, I64: tl.constexpr):
    """``program_id(0) * SIZE``: in int64 with ``I64``, else in int32 (``INDEX_LIMIT``)."""
    if I64:
        return tl.program_id(0).to(tl.int64) * SIZE
    else:
        return tl.program_id(0) * SIZE


@triton.jit
def widen(v, I64: tl.constexpr):
    """Integer indices ``v`` in int64 with ``I64``, else as they are (int32)."""
    if I64:
        return v.to(tl.int64)
    else:
        return v


@triton.jit
def code_groups(n, GB: tl.constexpr, I64: tl.constexpr):
    """This program's ``GB`` code groups: their ids ``(GB,)``, the element indices ``(GB, 8)`` of their
    codes and which of those are inside the ``n`` elements (int64 indices with ``I64``, else int32)."""
    gid = program_start(GB, I64) + tl.arange(0, GB)
    i = gid[:, None] * 8 + tl.arange(0, 8)[None, :]
    return gid, i, i < n


@triton.jit
def runs_of(gid, i, m, n, SIZE: tl.constexpr):
    """The run of ``SIZE`` consecutive codes (a block, a stream's tile) of each code of code groups ``gid``, and
    which are inside the ``n`` codes; per group ``(GB, 1)`` where ``SIZE`` is a multiple of 8 (a group's 8 codes
    lie in one run, whose metadata is then read once per group). ``SIZE`` is a compile-time constant: the
    division is a shift or a multiplication."""
    if SIZE % 8 == 0:
        e0 = gid * 8
        return (e0 // SIZE)[:, None], (e0 < n)[:, None]
    else:
        return i // SIZE, m


@triton.jit
def group_tiles(gid, i, m, n, C, T, G: tl.constexpr, ROWS8: tl.constexpr):
    """The tile id ``r * T + c // G`` of each code of code groups ``gid`` (element ``i = r * C + c``), and which
    are inside the ``n`` elements. With ``ROWS8`` (``C`` a multiple of 8) a group's 8 codes lie in one row:
    one division by ``C`` per group instead of one per code; where ``G`` is a multiple of 8 too they lie in
    one tile, and the ids and mask come per group, ``(GB, 1)``, so that each tile's metadata is loaded once
    per group. ``G`` is a compile-time constant: dividing by it is a shift or a multiplication (a 64-bit
    division by a run-time value is a software routine of tens of instructions on a GPU)."""
    if ROWS8:
        e0 = gid * 8
        r = e0 // C
        c0 = e0 - r * C
        if G % 8 == 0:
            return (r * T + c0 // G)[:, None], (e0 < n)[:, None]
        else:
            return r[:, None] * T + (c0[:, None] + tl.arange(0, 8)[None, :]) // G, m
    else:
        r = i // C
        return r * T + (i - r * C) // G, m


@triton.jit
def pack_store(q, gid, out, off, nbytes, BITS: tl.constexpr):
    """Store int32 codes ``q`` ``(GB, 8)`` of code groups ``gid`` ``(GB,)`` as ``BITS`` bytes per group at
    ``out + off + gid * BITS`` (bytes at or beyond ``nbytes`` of the stream are not written). A group's word is
    uint32 where its 8 codes fit 32 bits (``BITS`` <= 4), else int64 (on a GPU an int64 shift or addition is
    two instructions or more)."""
    store_words(group_word(q, 0, BITS), gid, out, off, nbytes, BITS)


@triton.jit
def group_word(q, first: tl.constexpr, BITS: tl.constexpr):
    """The word ``(GB,)`` of int32 codes ``q`` ``(GB, K)``, codes ``first .. first + K - 1`` of their groups of 8:
    code ``i`` in bits ``i * BITS ..`` (uint32 where ``BITS`` <= 4, else int64); words of disjoint codes add up
    to the word of them all."""
    k = first + tl.arange(0, q.shape[1])
    if BITS <= 4:
        return tl.sum(q.to(tl.uint32) << (k * BITS).to(tl.uint32)[None, :], axis=1)  # disjoint bit fields: an OR
    else:
        return tl.sum(q.to(tl.int64) << (k * BITS).to(tl.int64)[None, :], axis=1)


@triton.jit
def store_words(w, gid, out, off, nbytes, BITS: tl.constexpr):
    """Store words ``w`` (:func:`group_word`) of code groups ``gid`` as :func:`pack_store` stores them."""
    for j in tl.static_range(BITS):
        pos = gid * BITS + j
        tl.store(out + off + pos, ((w >> (8 * j)) & 255).to(tl.uint8), mask=pos < nbytes)


@triton.jit
def rint_code(v):
    """``rint(v)`` as int32 for fp32 ``v`` in [0, 2**22]: the low bits of ``v + 1.5 * 2**23``, whose exponent
    leaves no fraction bits (an integer subtraction where a cast would take a conversion)."""
    return (v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def load_unpack(src, off, gid, nbytes, BITS: tl.constexpr):
    """The int32 codes ``(GB, 8)`` of code groups ``gid`` of the stream at ``src + off`` (the group's word as in
    :func:`pack_store`)."""
    k = tl.arange(0, 8)
    if BITS <= 4:
        w = tl.zeros(gid.shape, tl.uint32)
        for j in tl.static_range(BITS):
            pos = gid * BITS + j
            w = w | (tl.load(src + off + pos, mask=pos < nbytes, other=0).to(tl.uint32) << (8 * j))
        return ((w[:, None] >> (k * BITS).to(tl.uint32)[None, :]) & ((1 << BITS) - 1)).to(tl.int32)
    else:
        w = tl.zeros(gid.shape, tl.int64)
        for j in tl.static_range(BITS):
            pos = gid * BITS + j
            w = w | (tl.load(src + off + pos, mask=pos < nbytes, other=0).to(tl.int64) << (8 * j))
        return ((w[:, None] >> (k * BITS).to(tl.int64)[None, :]) & ((1 << BITS) - 1)).to(tl.int32)


@triton.jit
def load_codes(P, off, gid, i, m, nbytes, BITS: tl.constexpr):
    """The int32 codes ``(GB, 8)`` of code groups ``gid`` (elements ``i``, inside where ``m``) of the stream at
    ``P + off``: 8-bit codes loaded as they lie, narrower ones unpacked (:func:`load_unpack`)."""
    if BITS == 8:
        return tl.load(P + off + i, mask=m, other=0).to(tl.int32)
    else:
        return load_unpack(P, off, gid, nbytes, BITS)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def soft_fp8(device: torch.device) -> bool:
    """Whether the kernels on ``device`` compute FP8 casts with integer arithmetic (:func:`to_fp8_bits`,
    :func:`from_fp8_bits`): under the interpreter, whose cast rounds half up, and on GPUs before sm_89 (Ada,
    Hopper), which have no FP8 conversion (Triton has no e4m3 type there)."""
    if INTERPRET or device.type != "cuda":
        return True
    return _capability(torch.cuda.current_device() if device.index is None else device.index) < (8, 9)


@triton.jit
def to_fp8_bits(v, FMAX, MBITS: tl.constexpr, BIAS: tl.constexpr, SUBSCALE: tl.constexpr, SOFT: tl.constexpr):
    """FP8 codes (uint8) of fp32 ``v``, as the reference's clamp to the format's largest finite value ``FMAX`` and
    torch's cast (round to nearest, ties to even): ``MBITS`` mantissa bits (3: e4m3fn, 2: e5m2), exponent bias
    ``BIAS``, ``SUBSCALE`` = 2**(BIAS - 1 + MBITS), the inverse of the subnormal spacing. Triton's cast, which
    saturates (``cvt.rn.satfinite``: one instruction per two values; a NaN, which the encoders refuse, stays NaN);
    with ``SOFT`` (:func:`soft_fp8`), a clamp and integer arithmetic on the bits."""
    if SOFT:
        v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
        u = v.to(tl.int32, bitcast=True)
        sign = (u >> 31) & 1
        a = u & 0x7FFFFFFF
        SHIFT: tl.constexpr = 23 - MBITS
        # normal numbers: round the fp32 mantissa to MBITS bits (a carry moves into the exponent), rebias
        rnd = a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)
        normal = (rnd >> SHIFT) - ((127 - BIAS) << MBITS)
        # subnormals: |v| in units of the subnormal spacing (an exact power-of-two scaling), rounded half to
        # even; 2**MBITS units is the smallest normal number, whose code is the same integer
        f = tl.abs(v) * SUBSCALE
        sub = rint(f).to(tl.int32)
        code = tl.where(a >= ((128 - BIAS) << 23), normal, sub)
        return (code | (sign << 7)).to(tl.uint8)
    else:
        FP8: tl.constexpr = tl.float8e4nv if MBITS == 3 else tl.float8e5  # gpu-only
        return v.to(FP8, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)  # gpu-only


@triton.jit
def from_fp8_bits(q, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFT: tl.constexpr):
    """fp32 values of FP8 codes ``q`` (uint8; ``MBITS`` mantissa bits: 3 for e4m3fn, 2 for e5m2; exponent bias
    ``BIAS``), exactly as torch's cast, except that the codes no encoder writes (NaN; Inf in e5m2) decode as 0, as
    :func:`qwire.codecs.fp8._lut` has them: where a lookup in that 256-entry table made a gather from memory per
    value, Triton's cast (two codes per instruction to fp16, exactly, then to fp32). With ``SOFT``
    (:func:`soft_fp8`), computed on the bits: the code's exponent and mantissa bits, put where fp32 keeps its own,
    are the fp32 ``2^(e - 127) (1 + m / 2^MBITS)`` (for ``e = 0`` the subnormal ``m 2^(-126 - MBITS)``), which times
    ``2^(127 - BIAS)`` is the code's value, exactly (a power of two; fp32 subnormals are kept: no ``ftz``)."""
    if SOFT:
        qi = q.to(tl.int32)
        bits = ((qi & 127) << (23 - MBITS)) | ((qi & 128) << 24)
        SCALE: tl.constexpr = 2.0 ** (127 - BIAS)
        v = bits.to(tl.float32, bitcast=True) * SCALE
    else:
        FP8: tl.constexpr = tl.float8e4nv if MBITS == 3 else tl.float8e5  # gpu-only
        v = q.to(FP8, bitcast=True).to(tl.float32)  # gpu-only
    if MBITS == 3:  # e4m3fn: the one NaN pattern (all exponent and mantissa bits), no infinity
        special = (q & 127) == 127
    else:  # e5m2: the top exponent is Inf or NaN
        special = (q & 124) == 124
    return tl.where(special, 0.0, v)


SCAN_ELEMS = 4096  # values per program of the deferred decode check


@triton.jit
def _scan_beyond(V, n, B, M, SCALE, LIMIT, BLOCK: tl.constexpr, I64: tl.constexpr):
    """The largest ``|value|`` of ``V`` as an atomic maximum into ``M`` (int32, zeroed: the bits of an fp32), only
    where the bound ``SCALE * B[0]`` does not rule the values in (is not below ``LIMIT``, or is NaN); otherwise a
    program reads the bound and nothing else. The maximum is taken on the bits of ``|value|``, which order as
    the magnitudes do, with NaN above Inf: a NaN value gives a NaN maximum, as a reduction of the values would
    (a floating-point atomic maximum would drop it). Program 0 also copies the bound ``B[0]`` (fp32, unscaled) into
    ``M[1]``, so that the check reads both numbers from one buffer."""
    braw = tl.load(B).to(tl.float32)
    tl.store(M + 1, braw.to(tl.int32, bitcast=True), mask=tl.program_id(0) == 0)
    b = braw * SCALE
    if not (b < LIMIT):
        i = program_start(BLOCK, I64) + tl.arange(0, BLOCK)
        a = tl.load(V + i, mask=i < n, other=0.0).to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |v|
        tl.atomic_max(M, tl.max(a, axis=0), sem="relaxed")


def scan_beyond(vals: torch.Tensor, bound: torch.Tensor, scale: float, limit: float) -> torch.Tensor:
    """The decoded values' largest magnitude for a deferred decode check
    (:func:`qwire.codecs.kernels.deferred.check_decoded_later`), read on the device only where the bound
    ``scale * bound`` does not already rule the values in: a payload an encoder wrote from ordinary values
    costs no pass over the decoded values (a reduction over them read every value of every decode), and 0 is
    given, which the check does not look at then. Returns fp32 ``(2,)`` on the device: that magnitude, and
    ``bound`` as fp32 (copied by the kernel: the check needs no stack of the two)."""
    mb = torch.zeros(2, dtype=torch.int32, device=vals.device)
    n = vals.numel()
    launch(_scan_beyond, (max(1, cdiv(n, SCAN_ELEMS)),), vals.reshape(-1), n, bound.reshape(1), mb, float(scale),
           float(limit), BLOCK=SCAN_ELEMS)
    return mb.view(torch.float32)
