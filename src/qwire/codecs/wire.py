"""Helpers to lay typed sections into a uint8 payload and read them back."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a tensor's memory as a flat uint8 tensor (copies only if not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Read ``n`` elements of ``dtype`` from the start of uint8 tensor ``b``."""
    size = dtype.itemsize
    chunk = b[: n * size]
    if chunk.numel() != n * size:
        raise ValueError(f"need {n * size} bytes for {n} x {dtype}, got {chunk.numel()}")
    # .clone() gives an aligned buffer so .view() to a wider dtype is legal.
    return chunk.clone().view(dtype)


def split_sections(payload: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Split a payload into consecutive sections of the given byte sizes."""
    out, off = [], 0
    for s in sizes:
        out.append(payload[off: off + s])
        off += s
    if off != payload.numel():
        raise ValueError(f"sections cover {off} bytes, payload has {payload.numel()}")
    return out

