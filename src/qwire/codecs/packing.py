"""Bit packing of unsigned integer codes of any width 1..8, vectorized torch ops.

``pack_bits(codes, bits)`` stores ``n`` codes in ``ceil(n * bits / 8)`` bytes,
little-endian within the stream: code ``i`` occupies stream bits
``[i*bits, (i+1)*bits)``, bit ``j`` of the stream is bit ``j % 8`` of byte
``j // 8``.  Works on any device; no Python loop over elements.
"""

from __future__ import annotations

import torch

from .base import CodecError


def packed_nbytes(n: int, bits: int) -> int:
    _check_bits(bits)
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise CodecError(f"bit width must be an int in 1..8, got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` into a 1-D uint8 tensor."""
    _check_bits(bits)
    flat = codes.reshape(-1)
    n = flat.numel()
    nbytes = packed_nbytes(n, bits)
    if bits == 8:
        return flat.to(torch.uint8)
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=codes.device)
    if bits in (1, 2, 4):
        # Whole codes per byte: a reshape and a weighted sum, no bit matrix.
        per = 8 // bits
        pad = (-n) % per
        c = flat.to(torch.uint8)
        if pad:
            c = torch.cat([c, c.new_zeros(pad)])
        c = c.view(-1, per)
        out = c[:, 0].clone()
        for k in range(1, per):  # at most 7 iterations over columns, not elements
            out |= c[:, k] << (k * bits)
        return out
    # General widths (3, 5, 6, 7): group 8 codes = `bits` bytes, via a bit matrix.
    pad = (-n) % 8
    c = flat.to(torch.int32)
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    c = c.view(-1, 8)  # (groups, 8 codes) -> one 64-bit-or-less word per group
    shifts = torch.arange(bits, device=c.device, dtype=torch.int32)
    bitmat = (c.unsqueeze(-1) >> shifts) & 1  # (groups, 8, bits)
    bitmat = bitmat.reshape(-1, bits, 8)  # (groups, bytes, 8 stream bits)
    weights = (1 << torch.arange(8, device=c.device, dtype=torch.int32))
    out = (bitmat * weights).sum(-1).to(torch.uint8).reshape(-1)
    return out[:nbytes]


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: return ``n`` codes as uint8."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise CodecError(f"packed data must be uint8, got {packed.dtype}")
    flat = packed.reshape(-1)
    need = packed_nbytes(n, bits)
    if flat.numel() < need:
        raise CodecError(f"{n} codes of {bits} bits need {need} bytes, got {flat.numel()}")
    if bits == 8:
        return flat[:n].clone()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=packed.device)
    if bits in (1, 2, 4):
        per = 8 // bits
        nb = (n + per - 1) // per
        b = flat[:nb]
        mask = (1 << bits) - 1
        cols = [(b >> (k * bits)) & mask for k in range(per)]
        return torch.stack(cols, dim=1).reshape(-1)[:n]
    groups = (n + 7) // 8
    b = flat[:need]
    if b.numel() < groups * bits:
        b = torch.cat([b, b.new_zeros(groups * bits - b.numel())])
    b = b.to(torch.int32).view(groups, bits)
    shifts = torch.arange(8, device=b.device, dtype=torch.int32)
    bitmat = (b.unsqueeze(-1) >> shifts) & 1  # (groups, bytes, 8)
    bitmat = bitmat.reshape(groups, 8, bits)  # (groups, codes, bits)
    weights = (1 << torch.arange(bits, device=b.device, dtype=torch.int32))
    return (bitmat * weights).sum(-1).to(torch.uint8).reshape(-1)[:n]
