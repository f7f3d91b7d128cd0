"""Bit packing in Triton for CUDA tensors: :func:`qwire.codecs.packing.pack_bits` and ``unpack_bits`` in one
launch each, the same bytes (code ``i`` at stream bits ``[i * bits, (i + 1) * bits)``, little-endian; codes
taken modulo 256 as the torch version's ``to(uint8)`` takes them). Registered in
:data:`qwire.codecs.packing.DEVICE_KERNELS` for ``cuda`` when the Triton backend is imported."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import packing
from ._common import GROUPS_PER_PROGRAM, cdiv, code_groups, launch, load_unpack, pack_store


@triton.jit
def _pack(C, n, OUT, nbytes, BITS: tl.constexpr, GB: tl.constexpr, I64: tl.constexpr):
    gid, i, m = code_groups(n, GB, I64)
    q = tl.load(C + i, mask=m, other=0).to(tl.int32) & 255
    pack_store(q, gid, OUT, 0, nbytes, BITS)


@triton.jit
def _unpack(P, n, nbytes, OUT, BITS: tl.constexpr, GB: tl.constexpr, I64: tl.constexpr):
    gid, i, m = code_groups(n, GB, I64)
    q = load_unpack(P, 0, gid, nbytes, BITS)
    tl.store(OUT + i, q.to(tl.uint8), mask=m)


def pack_bits(flat: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` codes of the 1-D ``flat`` (any integer or bool dtype) packed into ``ceil(n * bits / 8)`` bytes: a
    new tensor, or ``out`` (contiguous uint8 of that size, e.g. a payload's field, written in place)."""
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    flat = flat.contiguous()
    n = flat.numel()
    nbytes = packing.packed_nbytes(n, bits)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    elif out.dtype != torch.uint8 or out.numel() != nbytes or not out.is_contiguous():
        raise ValueError(f"pack_bits: out must be {nbytes} contiguous bytes, got {out.numel()} x {out.dtype}")
    launch(_pack, (cdiv(cdiv(n, 8), GROUPS_PER_PROGRAM),), flat, n, out, nbytes, BITS=bits, GB=GROUPS_PER_PROGRAM)
    return out


def unpack_bits(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` codes (uint8) packed in the 1-D uint8 ``data`` (at least ``ceil(n * bits / 8)`` bytes)."""
    data = data.contiguous()
    out = torch.empty(n, dtype=torch.uint8, device=data.device)
    launch(_unpack, (cdiv(cdiv(n, 8), GROUPS_PER_PROGRAM),), data, n, packing.packed_nbytes(n, bits), out,
           BITS=bits, GB=GROUPS_PER_PROGRAM)
    return out


packing.DEVICE_KERNELS["cuda"] = (pack_bits, unpack_bits, pack_bits)
