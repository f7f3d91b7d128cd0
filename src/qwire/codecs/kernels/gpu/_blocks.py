"""TAH-Quant's rotated-tile blocks (``slots=tile``) in Triton: what the reference's
:meth:`~qwire.codecs.tahquant.TAHQuant._rotated_blocks` + ``_pack_block`` write and ``_unpack_block`` +
``_inline_values`` + :func:`~qwire.codecs.tahquant.unrotate` read, one launch per code width each way.

A rotated tile of width ``b`` fills the ``G * b`` bits of its place in its code stream with, in stream order
(little-endian, as :mod:`qwire.codecs.packing`): its pivot (``PB = log2 G`` bits), the high part of its zero
code (``EB`` bits, two's complement), its first ``NW = G - PB - EB`` rotated elements coded with ``b`` bits
on half its step, the others with ``b - 1`` bits on its step. ``G >= 8``, so every block is whole bytes. With
``PER_BLOCK`` (``zero_width=block``) ``EB`` is the widest, and a tile's own is its block's width ``WB[tile // TA]``
(``TA`` tiles per block of rows).

- :func:`pack` quantizes the rotated values (the rounding of the stream kernels: ``fma(x, 1/s, -z/s)``,
  clamped, half to even) and writes each block's bytes, bit by bit: bit ``p`` of a block is a bit of the
  header or of the code of one element, whose value is read again for each of its bits (rotated tiles are
  few; the stream kernel has already written every tile's codes, and the blocks replace the rotated ones').
  :func:`pack_listed` does the same for a :class:`DeviceList`, rotating each tile again from the input and
  building its bytes in registers from every code's share of each byte (no copy of the rotated values).
- :func:`heads` reads the pivots and zero-code high parts (the metadata read needs them first).
- :func:`values_` decodes the codes (``z + q * step`` in one rounding), transforms them back (Hadamard
  butterfly, normalization, pivot swap back) and writes them over the stream kernel's values of those tiles.

The rotated tiles come as a list of ids sized on the host (one launch per width, from the reference's
placement), or, with one code width, as a :class:`DeviceList`: ids appended on the GPU by :func:`append`
(an atomic count per program, a prefix sum inside it), their count left on the GPU. The kernels then read
the count, and the programs past it do nothing: no host sync sizes the list. The order of the list varies
from run to run; nothing written depends on it (a block's place follows from its tile's id).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...hadamard import normalization
from ._common import INTERPRET, cdiv, fma32, inverse, launch, listed_at, rint
from ._rotate import _swapped, rotated_tiles
from .fp8 import butterfly

BLOCK_BITS = 4096  # header and code bits of the blocks one program handles (BG blocks of at most G * 8 bits)
COMPACT_TILES = 1024  # flags per program of the list-building kernel
LISTED_SHARES = 4096  # code-by-byte shares a program of the listed block kernel holds (BG x G x bytes per block)


@dataclass
class DeviceList:
    """Ids of tiles (int64, room for every tile) of which the first ``count[0]`` (int32, on the device) are set."""

    ids: torch.Tensor
    count: torch.Tensor


@triton.jit
def append(f, i, m, IDX, POS, CNT, HAS_POS: tl.constexpr):
    """Append the ids ``i`` (1-D; ``m``: which are real) whose flag ``f`` is set to the list ``IDX`` (count
    ``CNT``); with ``HAS_POS``, each one's place in the list into ``POS[i]`` (-1 where not set)."""
    fi = (f & m).to(tl.int32)
    slot = tl.atomic_add(CNT, tl.sum(fi, axis=0), sem="relaxed") + tl.cumsum(fi, axis=0) - 1
    tl.store(IDX + slot, i, mask=f & m)
    if HAS_POS:
        tl.store(POS + i, tl.where(f, slot, -1), mask=m)


@triton.jit
def _compact(FLAGS, n, IDX, CNT, BT: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
    m = i < n
    append(tl.load(FLAGS + i, mask=m, other=0) != 0, i, m, IDX, IDX, CNT, False)


@triton.jit
def _tile_eb(WB, ti, m, TA, EB: tl.constexpr, PER_BLOCK: tl.constexpr):
    """The zero-extension bits of tiles ``ti``: their block's ``WB[ti // TA]`` with ``PER_BLOCK``, else ``EB``."""
    if PER_BLOCK:
        return tl.load(WB + ti // TA, mask=m, other=0).to(tl.int64)
    else:
        return tl.zeros(ti.shape, tl.int64) + EB


@triton.jit
def _block_codes(x, wide, z, s, BITS: tl.constexpr, EXACT64: tl.constexpr):
    """Codes (int64) of rotated values ``x`` of a block: ``BITS`` bits on half the step ``s`` where ``wide``, else
    ``BITS - 1`` bits on ``s``; the stream kernels' rounding (``fma(x, 1/step, -z/step)``, clamped, half to even)."""
    step = tl.where(wide, s * 0.5, s)
    inv = inverse(step)
    v = fma32(x, inv, -(z * inv), EXACT64)
    top = tl.where(wide, (1 << BITS) - 1, (1 << (BITS - 1)) - 1).to(tl.float32)
    return rint(tl.minimum(tl.maximum(v, 0.0), top)).to(tl.int64)


@triton.jit
def _pack_body(ROT, row, ti, off, head, m, EXT, Z, S, P, WB, TA, G: tl.constexpr, BITS: tl.constexpr,
               PB: tl.constexpr, EB: tl.constexpr, NBP: tl.constexpr, BG: tl.constexpr, PER_BLOCK: tl.constexpr,
               EXACT64: tl.constexpr):
    eb = _tile_eb(WB, ti, m, TA, EB, PER_BLOCK)
    NN = (PB + eb)[:, None]
    NW = G - NN
    W0 = NN + NW * BITS
    NBITS: tl.constexpr = G * BITS
    if EB > 0:
        e = tl.load(EXT + ti, mask=m, other=0).to(tl.int64)
        head = head | ((e & ((1 << eb) - 1)) << PB)
    z = tl.load(Z + ti, mask=m, other=0.0)[:, None]
    s = tl.load(S + ti, mask=m, other=0.0)[:, None]
    bit = tl.arange(0, NBP)[None, :]
    wide = (bit >= NN) & (bit < W0)
    narrow = (bit >= W0) & (bit < NBITS)
    rw = tl.maximum(bit - NN, 0)  # (header lanes: 0, then discarded)
    ew = rw // BITS
    rn = tl.maximum(bit - W0, 0)
    en = rn // (BITS - 1)
    elem = tl.where(wide, ew, tl.where(narrow, NW + en, 0))
    shift = tl.where(wide, rw - ew * BITS, rn - en * (BITS - 1))
    x = tl.load(ROT + row[:, None] * G + elem, mask=m[:, None] & (wide | narrow), other=0.0)
    q = _block_codes(x, wide, z, s, BITS, EXACT64)
    hb = (head[:, None] >> tl.minimum(bit, 62).to(tl.int64)) & 1
    b = tl.where(bit < NN, hb, (q >> shift.to(tl.int64)) & 1)
    b = tl.where(bit < NBITS, b, 0)
    b = tl.reshape(b, (BG, NBP // 8, 8))
    byte = tl.sum(b << tl.arange(0, 8).to(tl.int64)[None, None, :], axis=2)
    j = tl.arange(0, NBP // 8)[None, :]
    tl.store(P + off[:, None] + j, byte.to(tl.uint8), mask=m[:, None] & (j < NBITS // 8))


@triton.jit
def _block_pack(ROT, ROW, IDX, OFF, n, PIV, EXT, Z, S, P, WB, TA, G: tl.constexpr, BITS: tl.constexpr,
                PB: tl.constexpr, EB: tl.constexpr, NBP: tl.constexpr, BG: tl.constexpr, PER_BLOCK: tl.constexpr,
                EXACT64: tl.constexpr):
    """Blocks ``k < n``: tile ``IDX[k]`` (row-major id, for its zero, step and zero extension), its rotated
    values in row ``ROW[k]`` of ``ROT`` ``(*, G)``, its pivot ``PIV[k]``, its block's first byte at ``P + OFF[k]``.
    ``NBP``: ``G * BITS`` rounded up to a power of two."""
    k = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG).to(tl.int64)
    m = k < n
    ti = tl.load(IDX + k, mask=m, other=0).to(tl.int64)
    row = tl.load(ROW + k, mask=m, other=0).to(tl.int64)
    off = tl.load(OFF + k, mask=m, other=0).to(tl.int64)
    head = tl.load(PIV + k, mask=m, other=0).to(tl.int64)
    _pack_body(ROT, row, ti, off, head, m, EXT, Z, S, P, WB, TA, G, BITS, PB, EB, NBP, BG, PER_BLOCK, EXACT64)


@triton.jit
def _block_pack_listed(X, C, T, IDX, CNT, OFF0, PIV, EXT, Z, S, P, NORM, WB, TA, G: tl.constexpr,
                       LOG2G: tl.constexpr, BITS: tl.constexpr, PB: tl.constexpr, EB: tl.constexpr, NB2: tl.constexpr,
                       BG: tl.constexpr, PER_BLOCK: tl.constexpr, EXACT64: tl.constexpr):
    """The blocks of the tiles of the device list ``IDX`` (count ``CNT``), each rotated again from the rows ``X``
    (pivot ``PIV[tile]``) and quantized in registers; a block's bytes are assembled from every code's share of
    each (``(BG, NB2, G)``, ``NB2``: ``G * BITS / 8`` rounded up to a power of two), at ``P + OFF0 + tile *
    G * BITS / 8``."""
    NBYTES: tl.constexpr = G * BITS // 8
    k = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG).to(tl.int64)
    cnt = tl.load(CNT)
    if tl.program_id(0) * BG < cnt:
        m, ti, p = listed_at(IDX, PIV, k, cnt)
        eb = _tile_eb(WB, ti, m, TA, EB, PER_BLOCK)
        NN = (PB + eb)[:, None]
        NW = G - NN
        head = p
        if EB > 0:
            e = tl.load(EXT + ti, mask=m, other=0).to(tl.int64)
            head = head | ((e & ((1 << eb) - 1)) << PB)
        y = rotated_tiles(X, C, T, ti, p, m, NORM, BG, G, LOG2G)
        z = tl.load(Z + ti, mask=m, other=0.0)[:, None]
        s = tl.load(S + ti, mask=m, other=0.0)[:, None]
        j = tl.arange(0, G).to(tl.int64)[None, :]
        wide = j < NW
        q = _block_codes(y, wide, z, s, BITS, EXACT64)
        o = tl.where(wide, NN + j * BITS, NN + NW * BITS + (j - NW) * (BITS - 1))  # each code's first bit
        w = tl.where(wide, BITS, BITS - 1)
        bb = tl.arange(0, NB2).to(tl.int64)
        sh = o[:, None, :] - 8 * bb[None, :, None]  # (1, NB2, G): where the code starts, from the byte's bit 0
        part = tl.where(sh >= 0, q[:, None, :] << tl.maximum(sh, 0), q[:, None, :] >> tl.maximum(-sh, 0)) & 255
        byte = tl.sum(tl.where((sh < 8) & (sh > -w[:, None, :]), part, 0), axis=2)  # disjoint bits: sum = OR
        b8 = 8 * bb[None, :]
        byte = byte | tl.where(b8 < NN, (head[:, None] >> tl.minimum(b8, 62)) & 255, 0)
        dst = OFF0 + ti * NBYTES
        tl.store(P + dst[:, None] + bb[None, :], byte.to(tl.uint8), mask=m[:, None] & (bb[None, :] < NBYTES))


@triton.jit
def _heads_body(P, off, ti, m, pslot, PIV, EXT, WB, TA, PB: tl.constexpr, EB: tl.constexpr, HB: tl.constexpr,
                BG: tl.constexpr, PER_BLOCK: tl.constexpr):
    w = tl.zeros((BG,), tl.int64)
    for j in tl.static_range(HB):
        w = w | (tl.load(P + off + j, mask=m, other=0).to(tl.int64) << (8 * j))
    tl.store(PIV + pslot, w & ((1 << PB) - 1), mask=m)
    if EB > 0:
        eb = _tile_eb(WB, ti, m, TA, EB, PER_BLOCK)
        e = (w >> PB) & ((1 << eb) - 1)
        sign = tl.where(eb > 0, (e >> tl.maximum(eb - 1, 0)) & 1, 0)
        tl.store(EXT + ti, e - (sign << eb), mask=m)


@triton.jit
def _block_heads(P, OFF, OFF0, IDX, CNT, n, PIV, EXT, WB, TA, NBYTES: tl.constexpr, PB: tl.constexpr,
                 EB: tl.constexpr, HB: tl.constexpr, BG: tl.constexpr, ONDEV: tl.constexpr, PER_BLOCK: tl.constexpr):
    """Block ``k``'s pivot into ``PIV[k]``, its zero-code high part into ``EXT[IDX[k]]`` (``EB > 0``); ``HB``
    bytes hold both. ``ONDEV``: ``k`` below the count ``CNT`` of the device list ``IDX``, the block at
    ``P + OFF0 + IDX[k] * NBYTES``, the pivot into ``PIV[IDX[k]]``."""
    k = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG).to(tl.int64)
    if ONDEV:
        cnt = tl.load(CNT)
        if tl.program_id(0) * BG < cnt:
            m = k < cnt
            ti = tl.load(IDX + k, mask=m, other=0)
            _heads_body(P, OFF0 + ti * NBYTES, ti, m, ti, PIV, EXT, WB, TA, PB, EB, HB, BG, PER_BLOCK)
    else:
        m = k < n
        ti = tl.load(IDX + k, mask=m, other=0).to(tl.int64)
        _heads_body(P, tl.load(OFF + k, mask=m, other=0).to(tl.int64), ti, m, k, PIV, EXT, WB, TA, PB, EB, HB, BG,
                    PER_BLOCK)


@triton.jit
def _values_body(P, off, ti, p, m, Z, S, V, NORM, WB, TA, G: tl.constexpr, LOG2G: tl.constexpr, BITS: tl.constexpr,
                 PB: tl.constexpr, EB: tl.constexpr, BG: tl.constexpr, PER_BLOCK: tl.constexpr,
                 EXACT64: tl.constexpr):
    eb = _tile_eb(WB, ti, m, TA, EB, PER_BLOCK)
    NN = (PB + eb)[:, None]
    NW = G - NN
    NBYTES: tl.constexpr = G * BITS // 8
    z = tl.load(Z + ti, mask=m, other=0.0)[:, None]
    s = tl.load(S + ti, mask=m, other=0.0)[:, None]
    j = tl.arange(0, G).to(tl.int64)[None, :]
    wide = j < NW
    o = tl.where(wide, NN + j * BITS, NN + NW * BITS + (j - NW) * (BITS - 1))
    width = tl.where(wide, BITS, BITS - 1)
    at = off[:, None] + o // 8
    mm = m[:, None] & (j >= 0)
    lo = tl.load(P + at, mask=mm, other=0).to(tl.int64)
    hi = tl.load(P + at + 1, mask=mm & (o // 8 + 1 < NBYTES), other=0).to(tl.int64)
    q = ((lo | (hi << 8)) >> (o % 8)) & ((1 << width) - 1)
    y = fma32(q.to(tl.float32), tl.where(wide, s * 0.5, s), z, EXACT64)
    y = butterfly(y, BG, G, LOG2G) * NORM
    tl.store(V + ti[:, None] * G + _swapped(tl.arange(0, G).to(tl.int64), p), y, mask=mm)


@triton.jit
def _block_values(P, OFF, OFF0, IDX, CNT, PIV, n, Z, S, V, NORM, WB, TA, G: tl.constexpr, LOG2G: tl.constexpr,
                  BITS: tl.constexpr, PB: tl.constexpr, EB: tl.constexpr, BG: tl.constexpr, ONDEV: tl.constexpr,
                  PER_BLOCK: tl.constexpr, EXACT64: tl.constexpr):
    """Rows ``IDX[k]`` of ``V`` ``(*, G)``: block ``k``'s values, un-rotated (pivot ``PIV[k]``). ``ONDEV``: as in
    :func:`_block_heads` (the pivot ``PIV[IDX[k]]``)."""
    k = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG).to(tl.int64)
    if ONDEV:
        cnt = tl.load(CNT)
        if tl.program_id(0) * BG < cnt:
            m, ti, p = listed_at(IDX, PIV, k, cnt)
            _values_body(P, OFF0 + ti * (G * BITS // 8), ti, p, m, Z, S, V, NORM, WB, TA, G, LOG2G, BITS, PB, EB, BG,
                         PER_BLOCK, EXACT64)
    else:
        m = k < n
        ti = tl.load(IDX + k, mask=m, other=0).to(tl.int64)
        p = tl.load(PIV + k, mask=m, other=0).to(tl.int64)
        _values_body(P, tl.load(OFF + k, mask=m, other=0).to(tl.int64), ti, p, m, Z, S, V, NORM, WB, TA, G, LOG2G,
                     BITS, PB, EB, BG, PER_BLOCK, EXACT64)


def _blocks_per_program(G: int, bits: int) -> int:
    return max(1, BLOCK_BITS // triton.next_power_of_2(G * bits))


def listed(flags: torch.Tensor) -> DeviceList:
    """The ids of the set ``flags`` (bool, any shape, contiguous), as a :class:`DeviceList` (no host sync)."""
    n = flags.numel()
    out = DeviceList(torch.empty(n, dtype=torch.int64, device=flags.device),
                     torch.zeros(1, dtype=torch.int32, device=flags.device))
    if n:
        launch(_compact, (cdiv(n, COMPACT_TILES),), flags.reshape(-1).view(torch.uint8), n, out.ids, out.count,
               BT=COMPACT_TILES)
    return out


def _args(idx: torch.Tensor | DeviceList, offs: torch.Tensor | int) -> tuple:
    """(the launch's size, ids, count, offsets, first offset, on the device) for either kind of list."""
    if isinstance(idx, DeviceList):
        return idx.ids.numel(), idx.ids, idx.count, idx.count, int(offs), True
    return idx.numel(), idx, idx, offs, 0, False


def pack(payload: torch.Tensor, rot: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, offs: torch.Tensor,
         piv: torch.Tensor, ext: torch.Tensor | None, z: torch.Tensor, s: torch.Tensor, bits: int, pb: int,
         eb: int, wb: tuple[torch.Tensor, int] | None = None) -> None:
    """Write the blocks of width ``bits`` of the rotated tiles ``idx`` (row-major ids; their rotated values:
    rows ``rows`` of ``rot``; pivots ``piv``; blocks at byte offsets ``offs`` of ``payload``); ``z``, ``s``
    (and ``ext``, the zero codes' high parts) per tile, contiguous; ``wb``: (each block of rows' zero-extension
    bits, int32, tiles per block) with ``zero_width=block`` (``eb`` the widest)."""
    n, G = idx.numel(), rot.shape[1]
    if n:
        bg = _blocks_per_program(G, bits)
        launch(_block_pack, (cdiv(n, bg),), rot, rows, idx, offs, n, piv, ext if ext is not None else z, z, s,
               payload, *(wb or (idx, 1)), G=G, BITS=bits, PB=pb, EB=eb, NBP=triton.next_power_of_2(G * bits), BG=bg,
               PER_BLOCK=wb is not None, EXACT64=INTERPRET)


def listed_fits(G: int, bits: int) -> bool:
    """Whether :func:`pack_listed` takes tiles of ``G`` elements and ``bits`` bits (its registers hold every
    code's share of every byte of a block: ``G * G * bits / 8`` values)."""
    return G * triton.next_power_of_2(G * bits // 8) <= LISTED_SHARES


def pack_listed(payload: torch.Tensor, X: torch.Tensor, g, lst: DeviceList, off0: int, piv: torch.Tensor,
                ext: torch.Tensor | None, z: torch.Tensor, s: torch.Tensor, bits: int, pb: int, eb: int,
                wb: tuple[torch.Tensor, int] | None = None) -> None:
    """Write the blocks of the tiles of ``lst`` (one width ``bits``; their places from byte ``off0``, the start
    of their stream), each rotated again from the flat rows ``X`` (geometry ``g``) with its pivot ``piv[tile]``:
    no copy of the rotated values, no host sync."""
    G, n = g.tile, lst.ids.numel()
    if n:
        nb2 = triton.next_power_of_2(G * bits // 8)
        bg = max(1, LISTED_SHARES // (G * nb2))
        launch(_block_pack_listed, (cdiv(n, bg),), X, g.cols, g.tiles, lst.ids, lst.count, off0, piv,
               ext if ext is not None else z, z, s, payload, normalization(G), *(wb or (lst.ids, 1)), G=G,
               LOG2G=G.bit_length() - 1, BITS=bits, PB=pb, EB=eb, NB2=nb2, BG=bg, PER_BLOCK=wb is not None,
               EXACT64=INTERPRET)


def heads(payload: torch.Tensor, offs: torch.Tensor | int, idx: torch.Tensor | DeviceList, piv: torch.Tensor,
          ext: torch.Tensor | None, G: int, bits: int, pb: int, eb: int,
          wb: tuple[torch.Tensor, int] | None = None) -> None:
    """Read the pivots (into ``piv``, per block) and zero-code high parts (into ``ext[idx]``, per tile) at the
    head of the blocks at ``offs``; or, as in :func:`pack`, of the listed tiles' blocks (pivots per tile)."""
    n, ids, cnt, offs, off0, ondev = _args(idx, offs)
    if n:
        launch(_block_heads, (cdiv(n, 1024),), payload, offs, off0, ids, cnt, n, piv,
               ext if ext is not None else piv, *(wb or (piv, 1)), NBYTES=G * bits // 8, PB=pb, EB=eb,
               HB=-(-(pb + eb) // 8), BG=1024, ONDEV=ondev, PER_BLOCK=wb is not None)


def values_(vals: torch.Tensor, payload: torch.Tensor, offs: torch.Tensor | int, idx: torch.Tensor | DeviceList,
            piv: torch.Tensor, z: torch.Tensor, s: torch.Tensor, bits: int, pb: int, eb: int,
            wb: tuple[torch.Tensor, int] | None = None) -> None:
    """Decode the blocks of width ``bits`` at ``offs`` into rows ``idx`` of ``vals`` (contiguous fp32, last dim
    ``G``), un-rotated with pivots ``piv``; or, as in :func:`pack`, the listed tiles' blocks into their rows."""
    n, ids, cnt, offs, off0, ondev = _args(idx, offs)
    G = vals.shape[-1]
    if n:
        bg = max(1, 4096 // G)
        launch(_block_values, (cdiv(n, bg),), payload, offs, off0, ids, cnt, piv, n, z, s, vals, normalization(G),
               *(wb or (piv, 1)), G=G, LOG2G=G.bit_length() - 1, BITS=bits, PB=pb, EB=eb, BG=bg, ONDEV=ondev,
               PER_BLOCK=wb is not None, EXACT64=INTERPRET)
