"""Normalized Sylvester Hadamard transform and the pivot swap of TAH-Quant.

``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``; ``H_n / sqrt(n)`` is
orthogonal and symmetric, so the normalized transform is its own inverse.
Column 0 of ``H_n`` is all ones: an element moved to position 0 before the
transform adds the same value to every output.

This is the one Hadamard of the codecs (``tahquant``'s rotated tiles, ``fp8``'s groups) and of
their compiled kernels. On fp32 values its order of operations is part of the payload format:
the butterfly's fixed sequence of fp32 additions, then one multiplication by
:func:`normalization` (fp32 ``1/sqrt(n)``); the kernels repeat both bit for bit.
"""

from __future__ import annotations

import functools
import math

import torch

from .base import CodecError


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


@functools.lru_cache(maxsize=32)
def _sylvester_cpu(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=32)
def normalization(n: int) -> float:
    """The normalizing factor ``1/sqrt(n)`` rounded to fp32 (as a Python float): what the normalized
    transform of fp32 values multiplies by, and what the compiled kernels multiply by."""
    return float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    normalized: bool = True) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order ``n`` (a power of two), optionally / sqrt(n)."""
    if not is_power_of_two(n):
        raise CodecError(f"Hadamard size must be a power of two (1, 2, 4, ..., 512), got {n}")
    h = _sylvester_cpu(n)
    if normalized:
        h = h / math.sqrt(n)
    return h.to(device=device, dtype=dtype)


def hadamard_transform(x: torch.Tensor, normalized: bool = True) -> torch.Tensor:
    """Apply the (normalized) Hadamard transform along the last dimension (a power of two).

    Uses the fast butterfly (log2 n vectorized stages), then one multiplication by ``1/sqrt(n)``
    (in fp32 that is :func:`normalization`); computes in fp32 for half-precision inputs and
    returns x's dtype. Self-inverse when normalized.
    """
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise CodecError(f"Hadamard size must be a power of two, got last dimension {n}")
    dtype = x.dtype
    y = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    lead = y.shape[:-1]
    y = y.reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(*lead, n)
    if normalized:
        y = y * (1.0 / math.sqrt(n))
    return y.to(dtype)


def pivot_swap(x: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    """Swap element ``pivot[...]`` with element 0 along the last dimension (its own inverse).

    ``pivot`` has x's shape without the last dimension (integer indices).
    """
    idx = pivot.long().unsqueeze(-1)
    first = x[..., :1]
    at_pivot = torch.gather(x, -1, idx)
    y = x.clone()
    y.scatter_(-1, idx, first)
    y[..., :1] = at_pivot
    return y
