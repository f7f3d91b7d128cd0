"""Triton kernels of ``blockwise<b>`` and ``blockfp``/``fp4`` (:mod:`qwire.codecs.blockwise`).

Encode: where a block is a power of two from 8 to 4096 elements (every default), one kernel: each program
reads whole blocks once, takes their absmax (and a NaN/Inf flag), quantizes and bit-packs them; other blocks
take two passes, one kernel per block for the absmax, then one element-wise kernel that quantizes and packs.
Decode: one kernel that unpacks and dequantizes, and reduces the decode check's bound and the values' largest
magnitude. The arithmetic is the reference's, operation by operation (IEEE division, round half to even, the
same lookup tables).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...base import as_shape, check_float_dtype, clamp_to_dtype_, decoded_verdict, nonfinite, numel
from ...blockwise import minifloat_grid
from ...packing import packed_nbytes
from ...tiles import MAX_ABS, check_magnitude
from ...wire import from_bytes
from ..deferred import judge
from ._common import (
    ELEMENT_WARPS,
    GROUPS_PER_PROGRAM,
    cdiv,
    code_groups,
    contiguous_input,
    launch,
    load_codes,
    pack_store,
    program_start,
    register,
    rint,
    runs_of,
    wide_indices,
)

_MAX_ABS = tl.constexpr(MAX_ABS)  # the largest magnitude a quantizing codec takes (qwire.codecs.tiles)

@triton.jit
def _absmax(X, n, A, BAD, BLOCK: tl.constexpr, CH: tl.constexpr, I64: tl.constexpr):
    """Absmax of block ``program_id(0)``; ``BAD`` (int32) set to 1 where the block holds NaN or Inf (its sum of
    ``x * 0`` is NaN) or its absmax is above ``MAX_ABS``. Only such a block takes the atomic, so the blocks do not
    contend for its address."""
    b = program_start(1, I64)
    acc = tl.zeros([CH], tl.float32)
    bad = tl.zeros([CH], tl.float32)
    for c0 in range(0, BLOCK, CH):
        j = c0 + tl.arange(0, CH)
        i = b * BLOCK + j
        m = (j < BLOCK) & (i < n)
        x = tl.load(X + i, mask=m, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
        bad += x * 0.0
    a = tl.max(acc, axis=0)
    tl.store(A + b, a)
    t = tl.sum(bad, axis=0)
    tl.atomic_max(BAD, 1, mask=(t != t) | (a > _MAX_ABS), sem="relaxed")


@triton.jit
def _codes(x, a, m, QMAX, VMAX, INV_STEP, LUT, FLOAT: tl.constexpr, BITS: tl.constexpr):
    """The codes (int32; 0 outside ``m``) of values ``x`` in blocks of absmax ``a`` (broadcast to ``x``)."""
    safe = tl.where(a > 0, a, 1.0)
    if FLOAT:
        v = tl.div_rn(tl.abs(x), safe) * VMAX
        v = tl.where(v < VMAX, v, VMAX)  # NaN too (a NaN input is refused after, by the deferred checks)
        c = tl.math.ceil(v * INV_STEP).to(tl.int32)  # v / step is exact (a power-of-two step)
        idx = tl.load(LUT + c, mask=m, other=0).to(tl.int32)
        q = idx | ((x < 0).to(tl.int32) << (BITS - 1))
    else:
        v = rint(tl.div_rn(x, safe) * QMAX)
        q = (tl.minimum(tl.maximum(v, -QMAX), QMAX) + QMAX).to(tl.int32)
    return tl.where(m, q, 0)


@triton.jit
def _encode(X, n, A, P, off, nbytes, QMAX, VMAX, INV_STEP, LUT, BLOCK: tl.constexpr, FLOAT: tl.constexpr,
            BITS: tl.constexpr, GB: tl.constexpr, I64: tl.constexpr):
    gid, i, m = code_groups(n, GB, I64)
    x = tl.load(X + i, mask=m, other=0.0).to(tl.float32)
    b, bm = runs_of(gid, i, m, n, BLOCK)
    q = _codes(x, tl.load(A + b, mask=bm, other=1.0), m, QMAX, VMAX, INV_STEP, LUT, FLOAT, BITS)
    if BITS == 8:
        tl.store(P + off + i, q.to(tl.uint8), mask=m)
    else:
        pack_store(q, gid, P, off, nbytes, BITS)


@triton.jit
def _encode_blocks(X, n, A, NBLK, BAD, P, off, nbytes, QMAX, VMAX, INV_STEP, LUT, BLOCK: tl.constexpr,
                   NB: tl.constexpr, FLOAT: tl.constexpr, BITS: tl.constexpr, I64: tl.constexpr):
    """``_absmax`` and ``_encode`` in one pass: program ``p`` reads blocks ``p * NB ..`` (of ``NBLK``; ``BLOCK`` a
    power of two and a multiple of 8) once, writes their absmax to ``A``, flags NaN/Inf and magnitudes above
    ``MAX_ABS`` in ``BAD`` as ``_absmax`` does, and packs their codes."""
    b = program_start(NB, I64) + tl.arange(0, NB)
    i = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    m = i < n
    x = tl.load(X + i, mask=m, other=0.0).to(tl.float32)
    a = tl.max(tl.abs(x), axis=1)
    tl.store(A + b, a, mask=b < NBLK)
    t = tl.sum(tl.sum(x * 0.0, axis=1), axis=0)
    tl.atomic_max(BAD, 1, mask=(t != t) | (tl.max(a, axis=0) > _MAX_ABS), sem="relaxed")
    q = _codes(x, a[:, None], m, QMAX, VMAX, INV_STEP, LUT, FLOAT, BITS)
    if BITS == 8:
        tl.store(P + off + i, q.to(tl.uint8), mask=m)
    else:
        GROUPS: tl.constexpr = NB * BLOCK // 8
        gid = program_start(GROUPS, I64) + tl.arange(0, GROUPS)
        pack_store(tl.reshape(q, (GROUPS, 8)), gid, P, off, nbytes, BITS)


FUSED_ELEMS = 2048  # values per program of _encode_blocks (whole blocks; one block where a block is larger)
FUSED_MAX_BLOCK = 4096  # larger blocks take the two passes


@triton.jit
def _decode(P, off, nbytes, n, A, TAB, OUT, BM, BLOCK: tl.constexpr, BITS: tl.constexpr, GB: tl.constexpr,
            I64: tl.constexpr):
    """The values ``TAB[code] * absmax`` of code groups ``gid`` into ``OUT`` (``TAB``: each code's value on a block
    of absmax 1, :func:`_decode_table`), and the decode check's two numbers as atomic maxima of their fp32 bits
    (which order as the magnitudes do, NaN above Inf) into ``BM``: the largest ``|absmax|`` of the blocks read
    (the values' bound is twice that) and the values' largest magnitude."""
    gid, i, m = code_groups(n, GB, I64)
    q = load_codes(P, off, gid, i, m, nbytes, BITS)
    b, bm = runs_of(gid, i, m, n, BLOCK)
    a = tl.load(A + b, mask=bm, other=0.0)
    v = tl.load(TAB + q, mask=m, other=0.0) * a  # a gather from a table of 2^BITS values (cached), not a division
    tl.store(OUT + i, v, mask=m)
    ab = a.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |a|'s bits, a NaN's sign cleared too (abs may keep it)
    tl.atomic_max(BM, tl.max(tl.max(tl.where(bm, ab, 0), axis=1), axis=0), sem="relaxed")
    av = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(BM + 1, tl.max(tl.max(tl.where(m, av, 0), axis=1), axis=0), sem="relaxed")


@functools.lru_cache(maxsize=16)
def _no_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the tables of ``blockfp`` (the kernels of ``blockwise<b>`` never read them), made once per
    device: made per call they were two more operations on the device for each encode and decode."""
    dummy = torch.zeros(1, device=device)
    return dummy.to(torch.uint8), dummy


def _float_args(codec, device: torch.device) -> tuple[bool, float, float, torch.Tensor, torch.Tensor]:
    """(is blockfp, vmax, 1 / LUT step, rounding LUT, signed decode table) of ``codec``."""
    if type(codec).__name__ != "BlockFloat":
        lut, signed = _no_tables(torch.device(device))
        return False, 0.0, 0.0, lut, signed
    grid, signed, lut, inv_step = codec._tab(device)
    vmax = float(minifloat_grid(*codec.layout)[-1])  # = grid[-1], computed on the host: nothing read back
    return True, vmax, float(inv_step), lut, signed


@functools.lru_cache(maxsize=32)
def _int_table(bits: int, device: torch.device) -> torch.Tensor:
    """``blockwise<b>``'s value of every code on a block of absmax 1, ``(code - qmax) / qmax``, computed on the host
    as the reference computes it (an IEEE division: torch on CUDA would multiply by ``1 / qmax`` instead), made
    once per width and device; the decode multiplies it by the block's absmax, as the reference does."""
    qmax = (1 << (bits - 1)) - 1
    return torch.arange(1 << bits, dtype=torch.float32).sub_(qmax).div_(qmax).to(device)


def _decode_table(codec, device: torch.device) -> torch.Tensor:
    """The value of every code of ``codec`` on a block of absmax 1 (fp32, ``2^bits``)."""
    is_float, _, _, _, signed = _float_args(codec, device)
    return signed if is_float else _int_table(codec.bits, torch.device(device))


def encode(codec, x: torch.Tensor) -> torch.Tensor:
    check_float_dtype(x.dtype, codec.name)
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    X = contiguous_input(x)
    nb = codec.n_blocks(n)
    payload = torch.empty(4 * nb + packed_nbytes(n, codec.bits), dtype=torch.uint8, device=x.device)
    absmax = payload[: 4 * nb].view(torch.float32)  # the absmax section, written in place
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    is_float, vmax, inv_step, lut, _ = _float_args(codec, x.device)
    qmax = float((1 << (codec.bits - 1)) - 1)
    B = codec.block
    if 8 <= B <= FUSED_MAX_BLOCK and B & (B - 1) == 0:  # whole blocks per program: one pass
        per = max(1, FUSED_ELEMS // B)
        launch(_encode_blocks, (cdiv(nb, per),), X, n, absmax, nb, bad, payload, 4 * nb,
               packed_nbytes(n, codec.bits), qmax, vmax, inv_step, lut, BLOCK=B, NB=per, FLOAT=is_float,
               BITS=codec.bits, num_warps=ELEMENT_WARPS)
    else:
        launch(_absmax, (nb,), X, n, absmax, bad, BLOCK=B, CH=min(1024, triton.next_power_of_2(B)),
               I64=wide_indices((n + B,)))  # a block of any size: its last lanes reach n + B
        launch(_encode, (cdiv(cdiv(n, 8), GROUPS_PER_PROGRAM),), X, n, absmax, payload, 4 * nb,
               packed_nbytes(n, codec.bits), qmax, vmax, inv_step, lut, BLOCK=B, FLOAT=is_float,
               BITS=codec.bits, GB=GROUPS_PER_PROGRAM, num_warps=ELEMENT_WARPS)
    judge(bad, lambda v: v[0] and _refused(x, codec.name))
    return payload


def _refused(x: torch.Tensor, name: str) -> None:
    """The error of an input a kernel flagged (NaN/Inf, or a block's magnitude above ``MAX_ABS``), as the
    reference raises it."""
    check_magnitude(x, float(x.detach().abs().amax()), name)
    nonfinite(x, name)  # neither any more: x changed since the encode


def decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    shape = as_shape(shape)
    codec.check_payload(payload, shape, dtype)
    n = numel(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=payload.device)
    nb = codec.n_blocks(n)
    head = payload[: 4 * nb]
    aligned = head.is_contiguous() and head.numel() == 4 * nb and head.data_ptr() % 4 == 0
    absmax = head.view(torch.float32) if aligned else from_bytes(payload, torch.float32, nb)  # read in place
    vals = torch.empty(n, device=payload.device)
    bm = torch.zeros(2, dtype=torch.int32, device=payload.device)
    launch(_decode, (cdiv(cdiv(n, 8), GROUPS_PER_PROGRAM),), payload, 4 * nb, packed_nbytes(n, codec.bits), n,
           absmax, _decode_table(codec, payload.device), vals, bm, BLOCK=codec.block, BITS=codec.bits,
           GB=GROUPS_PER_PROGRAM, num_warps=ELEMENT_WARPS)
    # the check (base.check_decoded) on the bound 2 max |absmax| and the values' largest magnitude, both reduced
    # by the kernel: nothing to scan later
    judge(bm.view(torch.float32), lambda v: decoded_verdict(2.0 * v[0], v[1], codec.name))
    if dtype != torch.float32:  # fp32 values cannot overflow an fp32 output (an Inf is refused by the check)
        clamp_to_dtype_(vals, dtype)
    return vals.to(dtype).reshape(shape)


for _name in ("BlockwiseInt", "BlockFloat"):
    register(_name, encode=encode, decode=decode)
