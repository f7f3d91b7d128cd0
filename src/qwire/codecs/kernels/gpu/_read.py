"""A ``log`` layout's metadata read in one Triton kernel: :meth:`~qwire.codecs.layouts.LogLayout.read` (each
tile's step ``a * 2^(-c/P)`` on its row block's anchor and its zero ``(k * u) * s``, from step and zero codes read
where they lie in the payload, bit-packed or not) and, in the same pass, the
decoders' bound :func:`~qwire.codecs.tiles.values_bound` (``max |z| + levels * |s|``, reduced with an atomic
maximum; a NaN, which that maximum would lose, counts as infinite, so a corrupt payload's values are still
scanned). The reference reads them with a dozen torch operations and reduces the bound with four more."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...base import full_levels
from ._common import cdiv, launch, program_start

TILES_PER_PROGRAM = 1024


@triton.jit
def _code(P, off, i, m, BITS: tl.constexpr):
    """Codes ``i`` (int32) of a field of ``BITS``-bit codes at byte ``off`` of ``P``: bytes (``BITS`` = 8), or
    bit-packed as :mod:`qwire.codecs.packing` packs them (code ``i`` at bits ``i * BITS ..``, little-endian), read
    in place from the one or two bytes that hold each."""
    if BITS == 8:
        return tl.load(P + off + i, mask=m, other=0).to(tl.int32)
    else:
        bit = i * BITS
        byte = off + bit // 8
        sh = (bit % 8).to(tl.int32)
        lo = tl.load(P + byte, mask=m, other=0).to(tl.int32)
        hi = tl.load(P + byte + 1, mask=m & (sh + BITS > 8), other=0).to(tl.int32)  # only where the code spans two
        return ((lo | (hi << 8)) >> sh) & ((1 << BITS) - 1)


@triton.jit
def step_and_code(A, TAB, C, COFF, K, KOFF, i, m, TA, KMIN, SYM: tl.constexpr, CB: tl.constexpr, KB: tl.constexpr):
    """Tiles ``i``'s step ``a * TAB[c]`` on their block's anchor ``A[i // TA]`` and (but for ``SYM``) their zero code
    plus ``KMIN`` (fp32), from the step codes (``CB``-bit field at byte ``COFF`` of ``C``) and zero codes (``KB``-bit,
    at ``KOFF`` of ``K``) where they lie (:func:`_code`)."""
    a = tl.load(A + i // TA, mask=m, other=0.0)
    s = a * tl.load(TAB + _code(C, COFF, i, m, CB), mask=m, other=0.0)
    if SYM:
        k = tl.zeros_like(s)
    else:
        k = _code(K, KOFF, i, m, KB).to(tl.float32) + KMIN
    return s, k


@triton.jit
def _read(C, COFF, K, KOFF, E, A, TAB, LV, BL, LVC, BLC, FL, GROW, N, TA, KMIN, ZSPAN, UNIT_F, Z, S, B,
          SYM: tl.constexpr, HAS_EXT: tl.constexpr, HAS_FL: tl.constexpr, HAS_LV: tl.constexpr,
          HAS_BL: tl.constexpr, BT: tl.constexpr, CB: tl.constexpr, KB: tl.constexpr, I64: tl.constexpr):
    """Each tile's step and zero, and the atomic maximum of the values' bound into ``B``; the levels per tile
    (``LV``, ``BL`` for the bound) or, without ``HAS_LV``/``HAS_BL``, one number for every tile (``LVC``,
    ``BLC``). The step codes are the ``CB``-bit field at byte ``COFF`` of ``C``, the zero codes the ``KB``-bit
    field at ``KOFF`` of ``K`` (:func:`_code`: 6-bit fields are read where they lie in the payload)."""
    i = program_start(BT, I64) + tl.arange(0, BT)
    m = i < N
    s, k = step_and_code(A, TAB, C, COFF, K, KOFF, i, m, TA, KMIN, SYM, CB, KB)
    if HAS_BL:
        bl = tl.load(BL + i, mask=m, other=0.0)
    else:
        bl = tl.full(s.shape, BLC, tl.float32)
    if SYM:
        z = tl.zeros_like(s)
    else:
        if HAS_EXT:
            k = k + tl.load(E + i, mask=m, other=0).to(tl.float32) * ZSPAN
        if HAS_LV:
            u = (tl.load(LV + i, mask=m, other=0.0) + 1.0) * UNIT_F
        else:
            u = tl.full(s.shape, LVC + 1.0, tl.float32) * UNIT_F
        z = (k * u) * s
    b = tl.abs(z) + tl.abs(s) * bl
    if HAS_FL:  # the tiles whose values then go through a Hadamard butterfly
        b = tl.where(tl.load(FL + i, mask=m, other=0) != 0, b * GROW, b)
    b = tl.where(b == b, b, float("inf"))
    tl.atomic_max(B, tl.max(tl.where(m, b, 0.0), axis=0), sem="relaxed")
    tl.store(Z + i, z, mask=m)
    tl.store(S + i, s, mask=m)


def field_view(sec, payload: torch.Tensor, name: str, n: int) -> torch.Tensor | None:
    """The first ``n`` values of a payload field as a view of the payload's bytes (to read, or to write in place),
    where the field needs no unpacking (8-bit codes; a dtype field whose bytes are aligned); else None."""
    f, o = sec.fields[name], sec.offsets[name]
    if not payload.is_contiguous():
        return None
    if f.dtype is None:
        return payload[o: o + n] if f.bits == 8 else None
    if (payload.data_ptr() + o) % f.dtype.itemsize:
        return None
    return payload[o: o + n * f.dtype.itemsize].view(f.dtype)


def codes_in_place(sec, payload: torch.Tensor, name: str, n: int) -> tuple[torch.Tensor, int, int]:
    """The first ``n`` codes of a payload field as ``(tensor, byte offset, bits)`` for :func:`_code`: 8-bit codes as a
    view (:func:`field_view`), narrower ones where they lie in the payload; else (a field of another kind, or a
    payload that is not contiguous) unpacked into bytes (:func:`field`)."""
    f = sec.fields[name]
    if f.dtype is None and f.bits < 8 and payload.is_contiguous():
        return payload, sec.offsets[name], f.bits
    return field(sec, payload, name, n), 0, 8


def field(sec, payload: torch.Tensor, name: str, n: int) -> torch.Tensor:
    """The first ``n`` values of a payload field, read in place where that needs no work (:func:`field_view`), else
    unpacked or copied (:meth:`~qwire.codecs.sections.Sections.get`)."""
    v = field_view(sec, payload, name, n)
    return v if v is not None else sec.get(payload, name, 0, n).contiguous()


@triton.jit
def _tags(A, n, MOST, ANCH, TAGS, TAG_BITS: tl.constexpr, BT: tl.constexpr):
    """The stored anchors ``A`` (int32 bits) split into the anchors ``ANCH`` (fp32, NaN where the tag names more than
    ``MOST``) and their tags ``TAGS`` (int32, at most ``MOST``)."""
    i = tl.program_id(0) * BT + tl.arange(0, BT)
    m = i < n
    bits = tl.load(A + i, mask=m, other=0)
    tag = bits & ((1 << TAG_BITS) - 1)
    a = (bits & ~((1 << TAG_BITS) - 1)).to(tl.float32, bitcast=True)
    tl.store(ANCH + i, tl.where(tag > MOST, float("nan"), a), mask=m)
    tl.store(TAGS + i, tl.minimum(tag, MOST), mask=m)


def anchors_and_tags(lay, sec, payload: torch.Tensor, g, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tagged ``log`` layout's anchors, without their tags, and the tags (int32), per block of rows, in one kernel:
    :meth:`~qwire.codecs.layouts.LogLayout.split_anchor` and ``TAHQuant._anchor_widths`` without its read back: a
    tag beyond ``most`` (a corrupt payload) is clamped, and its block's anchor is NaN, so that its steps and
    values are, which the check of the decoded values reports."""
    nb = g.n_blocks
    stored = field(sec, payload, "anchor", nb).view(torch.int32)
    anchor = torch.empty(nb, device=payload.device)
    tags = torch.empty(nb, dtype=torch.int32, device=payload.device)
    launch(_tags, (cdiv(nb, TILES_PER_PROGRAM),), stored, nb, int(most), anchor, tags, TAG_BITS=lay.tag_bits,
           BT=TILES_PER_PROGRAM)
    return anchor, tags


def anchors(lay, sec, payload: torch.Tensor, g) -> torch.Tensor:
    """A ``log`` layout's anchors (fp32, one per block of rows; a tagged layout's without their tags), in place
    where they lie aligned in the payload."""
    a = field(sec, payload, "anchor", g.n_blocks)
    return a if not lay.tag_bits else lay.split_anchor(a)[0].contiguous()


def read(lay, sec, payload: torch.Tensor, g, symmetric: bool, levels: torch.Tensor | int,
         zero_ext: torch.Tensor | None = None, bound_levels: torch.Tensor | int | None = None,
         growth: float = 1.0, grows: torch.Tensor | None = None, anchor: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``z, s = lay.read(sec, payload, 0, g.rows, g, symmetric, levels, zero_ext)`` and
    ``values_bound(z, s, bound_levels, growth)`` (``bound_levels`` defaults to ``levels``) as ``(b, scale)``: the
    bound is ``scale * b``, ``b`` a one-element tensor on the device (for
    :func:`~qwire.codecs.kernels.deferred.check_decoded_later`: no host sync here).
    With ``grows`` (bool ``(R, T)``): only those tiles' bounds are multiplied by ``growth``, which bounds the
    values as well and needs no host sync to know whether any tile grows (the bound only decides whether
    :func:`~qwire.codecs.base.check_decoded` scans the values, so the errors it raises are the same). ``anchor``:
    the blocks' anchors without their tags, where the caller has them (:func:`anchors_and_tags`)."""
    R, T = g.rows, g.tiles
    n, dev = R * T, payload.device
    if anchor is None:
        anchor = anchors(lay, sec, payload, g)
    c = codes_in_place(sec, payload, "scale", n)
    k = codes_in_place(sec, payload, "zero", n) if not symmetric else c
    e = zero_ext.reshape(-1).contiguous() if zero_ext is not None else c[0]
    bound_levels = levels if bound_levels is None else bound_levels
    per_tile = [isinstance(v, torch.Tensor) for v in (levels, bound_levels)]
    L, bl = (full_levels(v, (R, T), dev).contiguous() if t else c[0]
             for v, t in zip((levels, bound_levels), per_tile))
    z, s = torch.empty(R, T, device=dev), torch.empty(R, T, device=dev)
    bound = torch.zeros(1, device=dev)
    fl = grows.reshape(-1).view(torch.uint8) if grows is not None else c[0]
    consts = (0.0 if t else float(v) for v, t in zip((levels, bound_levels), per_tile))
    launch(_read, (cdiv(n, TILES_PER_PROGRAM),), c[0], c[1], k[0], k[1], e, anchor, lay.read_table(dev), L, bl,
           *consts, fl, float(growth), n, T * g.anchor_rows, float(lay.kmin), float(1 << lay.zero_bits),
           float(lay.unit(0)), z, s, bound, SYM=symmetric, HAS_EXT=zero_ext is not None, HAS_FL=grows is not None,
           HAS_LV=per_tile[0], HAS_BL=per_tile[1], BT=TILES_PER_PROGRAM, CB=c[2], KB=k[2])
    return z, s, bound, (1.0 if grows is not None else float(growth))
