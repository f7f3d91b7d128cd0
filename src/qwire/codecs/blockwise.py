"""Block-wise scaled codecs: symmetric absmax integers and small floats (FP4 E2M1 and kin).

The tensor is flattened and cut into consecutive blocks of ``block`` elements
(the last block is zero-padded for the scale computation only; padding is
never sent). Each block stores its absolute maximum ``a`` as an fp32 scale and
one ``bits``-wide code per element, bit-packed::

    payload = [a_0 .. a_{B-1}: fp32][codes: ceil(n * bits / 8) bytes]

``blockwise`` (symmetric integers, ``qmax = 2**(bits-1) - 1``)::

    code = round(x / a * qmax) in [-qmax, qmax], stored as code + qmax
    x'   = code * a / qmax          |x - x'| <= a / (2 * qmax)

``blockfp`` (a sign bit plus an unsigned ExMy minifloat with subnormals and
no Inf/NaN codes; ``bits=4`` is FP4 E2M1 whose magnitudes are
0, 0.5, 1, 1.5, 2, 3, 4, 6)::

    v    = x / a * vmax   (vmax = 6 for E2M1), rounded to the nearest representable magnitude
    x'   = sign * grid[code] * a / vmax
    |x - x'| <= (half the grid gap around |v|) * a / vmax

Registered names: ``blockwise`` (bits=8, block=256), ``blockwise8`` (block 256,
for gradients), ``blockwise4`` (bits=4, block=128, for activations),
``blockfp`` and ``fp4`` (bits=4 E2M1, block=128).

Policy: NaN/Inf raise :class:`~qwire.codecs.base.NonFiniteError`; an all-zero
block decodes to zeros exactly; the scale is computed and applied in fp32 for
every input dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import ClassVar

import torch

from .base import (
    Codec,
    CodecError,
    Param,
    as_shape,
    check_decoded,
    check_float_dtype,
    clamp_to_dtype_,
    numel,
)
from .kernels import dispatch
from .packing import pack_bits, packed_nbytes, unpack_bits
from .registry import register
from .tiles import MAX_ABS, check_magnitude
from .wire import from_bytes, to_bytes

# bits -> (exponent bits, mantissa bits) of the sign + ExMy minifloat used by ``blockfp``.
FLOAT_LAYOUTS: dict[int, tuple[int, int]] = {3: (1, 1), 4: (2, 1), 5: (2, 2), 6: (2, 3), 7: (3, 3), 8: (4, 3)}


class _Blockwise(Codec):
    """Shared layout: fp32 absmax per block, then ``bits``-wide packed codes.

    Work is done on a ``(n_blocks, block)`` view (zero-padded at the end), so a
    block's scale broadcasts instead of being repeated per element.
    """

    bits: int
    block: int

    def n_blocks(self, n: int) -> int:
        return (n + self.block - 1) // self.block

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        check_float_dtype(dtype, self.name)
        n = numel(as_shape(shape))
        return 4 * self.n_blocks(n) + packed_nbytes(n, self.bits)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x flattened to fp32, zero-padded to whole blocks, as ``(n_blocks, block)``."""
        flat = x.detach().reshape(-1).float()
        pad = (-flat.numel()) % self.block
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        return flat.view(-1, self.block)

    @staticmethod
    def _safe(absmax: torch.Tensor) -> torch.Tensor:
        return torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(1)

    def _codes(self, blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _values(self, codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _bound(self, blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @dispatch
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        check_float_dtype(x.dtype, self.name)
        n = x.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        blocks = self._blocks(x)
        absmax = blocks.abs().amax(dim=1)
        m = float(absmax.amax())  # amax propagates NaN and Inf: one cheap check of both
        if not m <= MAX_ABS:  # a block maximum the decode's check would take for a corrupt payload's
            check_magnitude(x, m, self.name)
        codes = self._codes(blocks, absmax).reshape(-1)[:n]
        return torch.cat([to_bytes(absmax), pack_bits(codes, self.bits)])

    @dispatch
    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        shape = as_shape(shape)
        self.check_payload(payload, shape, dtype)
        n = numel(shape)
        if n == 0:
            return torch.empty(shape, dtype=dtype, device=payload.device)
        nb = self.n_blocks(n)
        absmax = from_bytes(payload, torch.float32, nb)
        codes = unpack_bits(payload[4 * nb:], self.bits, n)
        pad = nb * self.block - n
        if pad:
            codes = torch.nn.functional.pad(codes, (0, pad))
        vals = self._values(codes.view(nb, self.block), absmax)
        bound = 2.0 * float(absmax.abs().amax())  # |code| <= qmax + 1 (int), grid <= vmax (float)
        check_decoded(vals, bound, self.name)
        return clamp_to_dtype_(vals, dtype, bound).reshape(-1)[:n].to(dtype).reshape(shape)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound on ``|x - decode(encode(x))|`` in fp32 (before the cast to x's dtype)."""
        blocks = self._blocks(x)
        absmax = blocks.abs().amax(dim=1)
        return self._bound(blocks, absmax).reshape(-1)[: x.numel()].reshape(x.shape)


class BlockwiseInt(_Blockwise):
    """Symmetric absmax integer quantization per block (bitsandbytes-style block-wise int8/int4)."""

    name = "blockwise"
    params = (
        Param("bits", int, 8, "bits per code, 2..8 (symmetric: codes -qmax..qmax)", lo=2, hi=8),
        Param("block", int, 256, "elements per block sharing one fp32 absmax scale", lo=1, hi=1 << 24),
    )

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def _codes(self, blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        q = torch.div(blocks, self._safe(absmax)).mul_(self.qmax).round_().clamp_(-self.qmax, self.qmax)
        return q.add_(self.qmax).to(torch.uint8)

    def _values(self, codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        # (code - qmax) / qmax * absmax: exact at the extremes, no underflow for tiny absmax
        return codes.float().sub_(self.qmax).div_(self.qmax).mul_(absmax.unsqueeze(1))

    def _bound(self, blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        return (absmax / (2 * self.qmax)).unsqueeze(1).expand_as(blocks)


@functools.lru_cache(maxsize=16)
def minifloat_grid(ebits: int, mbits: int) -> tuple[float, ...]:
    """All non-negative magnitudes of an unsigned ExMy format (bias 2**(e-1)-1, subnormals, no Inf/NaN).

    Index order equals code order, and the grid is increasing.
    """
    bias = (1 << (ebits - 1)) - 1
    out = []
    for e in range(1 << ebits):
        for m in range(1 << mbits):
            if e == 0:
                out.append(m / (1 << mbits) * 2.0 ** (1 - bias))
            else:
                out.append((1 + m / (1 << mbits)) * 2.0 ** (e - bias))
    return tuple(out)


class BlockFloat(_Blockwise):
    """Block-scaled minifloat: sign + ExMy codes, block absmax mapped to the format's largest value.

    ``bits=4`` is FP4 E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6); other widths use
    the layouts in :data:`FLOAT_LAYOUTS` (5: E2M2, 6: E2M3, 8: E4M3 with every code finite).
    """

    name = "blockfp"
    params = (
        Param("bits", int, 4, "bits per code incl. sign: 3..8 (4 = FP4 E2M1)", lo=3, hi=8),
        Param("block", int, 128, "elements per block sharing one fp32 absmax scale", lo=1, hi=1 << 24),
    )
    _tables: ClassVar[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]] = {}

    def _validate(self) -> None:
        if self.bits not in FLOAT_LAYOUTS:
            raise CodecError(f"codec 'blockfp': bits must be one of {sorted(FLOAT_LAYOUTS)}, got {self.bits}")

    @property
    def layout(self) -> tuple[int, int]:
        return FLOAT_LAYOUTS[self.bits]

    def _tab(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """(grid, signed decode table / vmax, rounding LUT, 1 / LUT step) on ``device``.

        Every midpoint between neighbouring grid values is a multiple of
        ``step = 2**(-bias - mbits)``, so the nearest grid index of ``v`` (ties to the
        smaller value) depends only on ``ceil(v / step)``: ``lut[c]`` = number of
        midpoints ``<= (c - 1) * step``. One gather replaces a search.
        """
        key = (self.bits, str(device))
        if key not in self._tables:
            ebits, mbits = self.layout
            g = torch.tensor(minifloat_grid(ebits, mbits), dtype=torch.float64)
            mids = (g[1:] + g[:-1]) / 2
            step = 2.0 ** (-((1 << (ebits - 1)) - 1) - mbits)
            n = int(round(float(g[-1]) / step)) + 1
            c = torch.arange(n + 1, dtype=torch.float64)
            lut = torch.searchsorted(mids, (c - 1) * step, right=True).to(torch.uint8)
            unit = (g / g[-1]).float()
            signed = torch.cat([unit, -unit])  # code = sign << (bits-1) | magnitude index
            self._tables[key] = (g.float().to(device), signed.to(device), lut.to(device), 1.0 / step)
        return self._tables[key]

    def _scaled(self, blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        grid = self._tab(blocks.device)[0]
        vmax = float(grid[-1])
        return torch.div(blocks.abs(), self._safe(absmax)).mul_(vmax).clamp_(max=vmax)

    def _codes(self, blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        _, _, lut, inv_step = self._tab(blocks.device)
        v = self._scaled(blocks, absmax)
        c = v.mul_(inv_step).ceil_().to(torch.int32)  # v / step is exact (power-of-two step)
        idx = lut.index_select(0, c.reshape(-1)).view(c.shape)
        return idx | ((blocks < 0).to(torch.uint8) << (self.bits - 1))

    def _values(self, codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        signed = self._tab(codes.device)[1]
        vals = signed.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)
        return vals.mul_(absmax.unsqueeze(1))

    def _bound(self, blocks: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        grid = self._tab(blocks.device)[0]
        vmax = float(grid[-1])
        v = self._scaled(blocks, absmax)
        i = torch.bucketize(v, grid).clamp(1, grid.numel() - 1)  # grid[i-1] < v <= grid[i]
        return (grid[i] - grid[i - 1]) / 2 * (absmax / vmax).unsqueeze(1)


register("blockwise", BlockwiseInt)
register("blockwise8", BlockwiseInt, bits=8, block=256)
register("blockwise4", BlockwiseInt, bits=4, block=128)
register("blockfp", BlockFloat)
register("fp4", BlockFloat, bits=4, block=128)
