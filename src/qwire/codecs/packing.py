"""Bit packing of unsigned integer codes of any width 1..8, vectorized torch ops.

``pack_bits(codes, bits)`` stores ``n`` codes in ``ceil(n * bits / 8)`` bytes,
little-endian within the stream: code ``i`` occupies stream bits
``[i*bits, (i+1)*bits)``, bit ``j`` of the stream is bit ``j % 8`` of byte
``j // 8``.  Works on any device; no Python loop over elements.

A kernel backend may register kernels that write the same bytes for its device in
:data:`DEVICE_KERNELS` (the Triton backend does for CUDA tensors: one launch where the torch
operations below make ten to twenty). A registered kernel that fails is dropped with a warning and
the torch operations run from then on.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import torch

from .base import CodecError

# device type -> (pack(flat codes, bits) -> uint8 bytes, unpack(flat bytes, bits, n) -> uint8 codes, and optionally
# pack into(flat codes, bits, out bytes) -> out: pack written into a given buffer)
DEVICE_KERNELS: dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor],
                                Callable[[torch.Tensor, int, int], torch.Tensor],
                                Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]]] = {}


def _on_device(which: int, t: torch.Tensor, *args: int | torch.Tensor) -> torch.Tensor | None:
    """The registered kernel ``which`` (0 pack, 1 unpack, 2 pack into) for ``t``'s device, or None (none, or it
    failed)."""
    kernels = DEVICE_KERNELS.get(t.device.type)
    if kernels is None or len(kernels) <= which:  # none, or not this one
        return None
    try:
        return kernels[which](t, *args)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run leaves the torch operations
        DEVICE_KERNELS.pop(t.device.type, None)
        warnings.warn(f"qwire: the {t.device.type} bit-packing kernels failed ({type(e).__name__}: {e}); packing "
                      "with torch operations from now on", RuntimeWarning, stacklevel=3)
        return None


def packed_nbytes(n: int, bits: int) -> int:
    _check_bits(bits)
    return (n * bits + 7) // 8


_LITTLE = sys.byteorder == "little"


def _word_layout(bits: int) -> tuple[int, int, torch.dtype, int]:
    """Codes per group, bytes per group, word dtype and word bytes for a width of 1..7 bits.

    Widths 1, 2, 4 put whole codes in one byte; 6 puts 4 codes in 3 bytes; 3, 5, 7
    put 8 codes in ``bits`` bytes.
    """
    if bits in (1, 2, 4):
        return 8 // bits, 1, torch.uint8, 1
    gs = 4 if bits == 6 else 8
    nb = gs * bits // 8
    return (gs, nb, torch.int32, 4) if nb <= 4 else (gs, nb, torch.int64, 8)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise CodecError(f"bit width must be an int in 1..8, got {bits!r}")


def _shr(w: torch.Tensor, s: int) -> torch.Tensor:
    """``w >> s``; on the CPU a same-dtype tensor shift amount takes PyTorch's vectorized path (a Python int does
    not); elsewhere the int is passed to the kernel (a tensor made from it would be copied from the host, which
    waits for the device)."""
    if not s:
        return w
    if w.device.type != "cpu":
        return torch.bitwise_right_shift(w, s)
    return torch.bitwise_right_shift(w, torch.tensor(s, dtype=w.dtype))


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
    done = _on_device(0, flat, bits)
    if done is not None:
        return done
    # A group of ``gs`` codes fills ``nb = gs * bits / 8`` whole bytes. The codes occupy
    # disjoint bits, so OR-ing them into one word per group is a sum of code * 2**(k*bits);
    # the word's low ``nb`` bytes (little-endian) are the packed stream.
    gs, nb, wt, ws = _word_layout(bits)
    pad = (-n) % gs
    c = flat.to(torch.uint8)
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    c = c.view(-1, gs)
    w = torch.empty(c.shape[0], dtype=wt, device=c.device)
    w.copy_(c[:, 0])
    for k in range(1, gs):  # at most 7 iterations over columns, not elements
        w.add_(c[:, k], alpha=1 << (k * bits))
    if ws == 1:
        return w
    if _LITTLE:
        out = w.view(torch.uint8).view(-1, ws)[:, :nb]
    else:  # pragma: no cover - big-endian hosts
        out = torch.stack([(_shr(w, 8 * j) & 255).to(torch.uint8) for j in range(nb)], dim=1)
    return out.reshape(-1)[:nbytes]


def pack_bits_into(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """:func:`pack_bits` written into ``out`` (contiguous uint8, ``packed_nbytes(n, bits)`` bytes, e.g. a payload's
    field): by the device's kernel straight into it where one is registered, else packed, then copied."""
    flat = codes.reshape(-1)
    fits = (out.device == flat.device and out.dtype == torch.uint8 and out.is_contiguous()
            and out.numel() == packed_nbytes(flat.numel(), bits))  # else the copy below says what is wrong
    if bits < 8 and flat.numel() and fits and _on_device(2, flat, bits, out) is not None:
        return
    out.copy_(pack_bits(codes, bits))


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
    done = _on_device(1, flat[:need], bits, n)
    if done is not None:
        return done
    gs, nb, wt, ws = _word_layout(bits)
    groups = (n + gs - 1) // gs
    b = flat[:need]
    if b.numel() < groups * nb:
        b = torch.cat([b, b.new_zeros(groups * nb - b.numel())])
    if ws == 1:
        w = b
    elif _LITTLE:
        b = b.view(groups, nb)
        w = torch.cat([b, b.new_zeros(groups, ws - nb)], dim=1).view(wt).reshape(-1)
    else:  # pragma: no cover - big-endian hosts
        b = b.view(groups, nb)
        w = b[:, 0].to(wt)
        for j in range(1, nb):
            w.add_(b[:, j], alpha=1 << (8 * j))
    # at most 8 columns, not elements; masking after the narrowing to uint8 is the fast path
    cols = [_shr(w, k * bits).to(torch.uint8) for k in range(gs)]
    return torch.stack(cols, dim=1).bitwise_and_((1 << bits) - 1).reshape(-1)[:n]
