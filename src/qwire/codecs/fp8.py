"""FP8 codecs for tensor-parallel traffic: TACO's dual-scale Hadamard FP8 and plain per-group FP8.

``fp8`` (TACO, arXiv 2604.24088), per group of ``G`` contiguous elements::

    alpha = clamp(FP8_MAX / sqrt(mean(x^2) + 1e-6), 1e-3, 1e3)      # adaptive pre-scale
    y     = H_G(alpha * x) / sqrt(G)                                 # normalized Hadamard
    s     = clamp(max|y| / FP8_MAX, 1e-12, 1e6)                      # absmax scale
    q     = fp8(clamp(y / s, -FP8_MAX, FP8_MAX))                     # saturating cast, round to nearest even
    decode: x = H_G(q * s) / sqrt(G) / alpha

``fp8plain`` (the baseline): ``s = max|x| / FP8_MAX`` per group, ``q = fp8(x / s)``.

Groups run along the **flattened** tensor (row-major order), so any shape
works; when the last dimension is a multiple of ``G`` (hidden sizes of real
models are) every group lies inside one row, i.e. this is the same as grouping
along the last dimension.  A size that is not a multiple of ``G`` gets one
zero-padded last group.

Formats: ``e4m3`` (``torch.float8_e4m3fn``, max 448, 3 mantissa bits, smallest
subnormal 2^-9) and ``e5m2`` (``torch.float8_e5m2``, max 57344, 2 mantissa bits,
smallest subnormal 2^-16).  Codes are rounded to nearest (ties to even) by
torch's cast; values beyond the format's maximum saturate to +-max.

Wire layout (all sections little-endian, fixed size for a shape and config):

    fp8:      codes uint8 [n_groups * G]  | alpha fp32 [n_groups] | s fp32 [n_groups]
    fp8 with hadamard=false:
              codes uint8 [n]             | alpha fp32 [n_groups] | s fp32 [n_groups]
    fp8plain: codes uint8 [n]             | s fp32 [n_groups]

(the Hadamard mixes a padded group's zeros into every code, so those codes are
sent; without the rotation the padding is not sent).  At G = 128 ``fp8`` costs
8 + 64/128 = 8.5 bits/element (3.76x smaller than fp32), ``fp8plain`` 8.25.

Error bound (exact arithmetic; fp32 rounding adds ~1e-6 relative): the
Hadamard is orthonormal, so per group
``||x_hat - x||_2 <= u * ||x||_2 + (s / alpha) * d * sqrt(G)`` with the
unit roundoff ``u = 2^-(mantissa_bits + 1)`` (1/16 for E4M3, 1/8 for E5M2) and
``d`` half the subnormal spacing (2^-10, 2^-17), as long as nothing saturates.

NaN/Inf policy: refused with :class:`~qwire.codecs.NonFiniteError`.
Input dtypes: float32, float16, bfloat16 (decoded to the same dtype).

Fast path (``impl=auto`` on CPU): qwire/codecs/kernels/cpu/fp8.py, the same payload bytes and
decoded values as this code for every configuration (see docs/kernels.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import (
    Codec,
    CodecError,
    Param,
    as_shape,
    check_decoded,
    check_finite,
    check_float_dtype,
    clamp_to_dtype_,
    div,
    numel,
)
from .hadamard import hadamard_transform, is_power_of_two
from .kernels import dispatch
from .registry import register
from .wire import from_bytes, split_sections

GROUPS = (32, 64, 128, 256, 512)
LAMBDA = 1e-6
ALPHA_MIN, ALPHA_MAX = 1e-3, 1e3
S_MIN, S_MAX = 1e-12, 1e6


@dataclass(frozen=True)
class FP8Format:
    """One FP8 format: torch dtype, largest finite value, mantissa bits, smallest subnormal."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_subnormal: float

    @property
    def unit_roundoff(self) -> float:
        """Largest relative rounding error for normal numbers (round to nearest)."""
        return 2.0 ** -(self.mantissa_bits + 1)


FORMATS: dict[str, FP8Format] = {
    "e4m3": FP8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, 2.0 ** -9),
    "e5m2": FP8Format("e5m2", torch.float8_e5m2, 57344.0, 2, 2.0 ** -16),
}


def _check_group(codec: str, group: int) -> None:
    if not (is_power_of_two(group) and GROUPS[0] <= group <= GROUPS[-1]):
        raise CodecError(
            f"codec {codec!r}: group={group} must be a power of two in {GROUPS[0]}..{GROUPS[-1]} "
            f"(one of {', '.join(map(str, GROUPS))}); write e.g. '{codec}:group=128'"
        )


def _to_fp8(v: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Saturating cast of fp32 values to FP8 codes, returned as uint8 bytes (clamps ``v`` in place)."""
    return v.clamp_(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)


@functools.lru_cache(maxsize=16)
def _lut(fmt: FP8Format, device: torch.device | str) -> torch.Tensor:
    """fp32 value of each of the 256 codes (a table lookup decodes faster than the cast on CPU). The codes
    no encoder writes (NaN; Inf in e5m2: the cast saturates) decode as 0, so that a corrupt payload
    cannot put NaN into a decoded tensor. Made once per format and device (read only): on a GPU, copying
    it from pageable host memory at every decode made the stream wait, and cannot be captured in a graph."""
    return _lut_on(fmt, torch.device(device))


@functools.lru_cache(maxsize=16)
def _lut_on(fmt: FP8Format, device: torch.device) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = codes.view(fmt.dtype).to(torch.float32)
    return torch.where(torch.isfinite(v), v, 0.0).to(device)


def bound(scale: torch.Tensor, fmt: FP8Format, group: int, hadamard: bool) -> float:
    """A bound on the decoded values' magnitudes for per-group scales ``scale`` (``s / alpha``, or ``s``):
    the normalized Hadamard of ``G`` codes is at most ``sqrt(G)`` times the largest code."""
    return float(scale.abs().amax()) * bound_scale(fmt, group, hadamard) if scale.numel() else 0.0


def bound_scale(fmt: FP8Format, group: int, hadamard: bool) -> float:
    """:func:`bound` over the largest scale."""
    return fmt.max * (math.sqrt(group) if hadamard else 1.0)


def _from_fp8(codes: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    return _lut(fmt, codes.device).index_select(0, codes.reshape(-1).to(torch.int32))


def _rotate(y: torch.Tensor) -> torch.Tensor:
    """Normalized Hadamard of each row of fp32 ``y`` (n_groups, G); self-inverse. The butterfly (a fixed
    order of fp32 additions, which the fast kernels repeat: the same payload bytes), then one
    multiplication by fp32 ``1/sqrt(G)`` (:func:`~qwire.codecs.hadamard.normalization`)."""
    return hadamard_transform(y)


def _groups(x: torch.Tensor, g: int) -> torch.Tensor:
    """Flatten to fp32 and zero-pad to a multiple of ``g``; shape (n_groups, g)."""
    flat = x.reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % g
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, g)


class _FP8Base(Codec):
    params = (
        Param("format", str, "e4m3", "FP8 format: e4m3 (max 448) or e5m2 (max 57344)", choices=tuple(FORMATS)),
        Param("group", int, 128, "elements per scale group: a power of two in 32..512"),
    )

    def _validate(self) -> None:
        _check_group(self.name, self.group)
        self.fmt = FORMATS[self.format]

    def _ngroups(self, n: int) -> int:
        return -(-n // self.group)


class FP8(_FP8Base):
    """TACO's dual-scale FP8: per-group RMS pre-scale alpha, Hadamard rotation, absmax scale s."""

    name = "fp8"
    params = _FP8Base.params + (
        Param("hadamard", bool, True, "rotate each group with the normalized Hadamard transform"),
    )

    def _sections(self, n: int) -> tuple[int, int, int]:
        ng = self._ngroups(n)
        ncodes = ng * self.group if self.hadamard else n
        return ncodes, 4 * ng, 4 * ng

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        check_float_dtype(dtype, self.name)
        return sum(self._sections(numel(as_shape(shape))))

    @dispatch
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        check_float_dtype(x.dtype, self.name)
        n = x.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        fmt, g = self.fmt, self.group
        xg = _groups(x, g)
        # float64: the squares are exact and the sum is all but exact (the fast path computes alpha
        # the same way; only the summation order may differ), and finite for any finite input.
        sumsq = xg.double().square_().sum(dim=1)
        if not bool(torch.isfinite(sumsq).all()):  # NaN/Inf: the exact check decides
            check_finite(x, self.name)
        alpha = (fmt.max / torch.sqrt(sumsq / g + LAMBDA)).clamp_(ALPHA_MIN, ALPHA_MAX).float()
        y = xg * alpha[:, None]
        if self.hadamard:
            y = _rotate(y)
        lo, hi = torch.aminmax(y, dim=1)
        s = div(torch.maximum(hi, -lo), fmt.max).clamp_(S_MIN, S_MAX)
        codes = _to_fp8(y.mul_((1.0 / s)[:, None]), fmt).reshape(-1)
        if not self.hadamard:
            codes = codes[:n]
        return torch.cat([codes, alpha.view(torch.uint8), s.view(torch.uint8)])

    @dispatch
    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        shape = as_shape(shape)
        check_float_dtype(dtype, self.name)
        self.check_payload(payload, shape, dtype)
        n = numel(shape)
        if n == 0:
            return torch.empty(shape, dtype=dtype, device=payload.device)
        fmt, g = self.fmt, self.group
        ng = self._ngroups(n)
        codes, a_bytes, s_bytes = split_sections(payload, self._sections(n))
        alpha = from_bytes(a_bytes, torch.float32, ng)
        s = from_bytes(s_bytes, torch.float32, ng)
        q = _from_fp8(codes, fmt)
        if not self.hadamard and q.numel() != ng * g:
            q = torch.cat([q, q.new_zeros(ng * g - q.numel())])
        y = q.view(ng, g)
        if self.hadamard:  # H(q * s) / alpha == H(q) * (s / alpha): one scaling pass after the rotation
            y = _rotate(y)
        scale = s / alpha
        x = y.mul_(scale[:, None])
        b = bound(scale, fmt, g, self.hadamard)
        check_decoded(x, b, self.name, limit=math.inf)
        return clamp_to_dtype_(x, dtype, b).reshape(-1)[:n].to(dtype).reshape(shape)


class FP8Plain(_FP8Base):
    """Plain per-group FP8: one absmax scale per group, no pre-scale, no rotation (a baseline)."""

    name = "fp8plain"

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        check_float_dtype(dtype, self.name)
        n = numel(as_shape(shape))
        return n + 4 * self._ngroups(n)

    @dispatch
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        check_float_dtype(x.dtype, self.name)
        n = x.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        fmt = self.fmt
        xg = _groups(x, self.group)
        lo, hi = torch.aminmax(xg, dim=1)
        amax = torch.maximum(hi, -lo)
        if not bool(torch.isfinite(amax).all()):
            check_finite(x, self.name)
        # The smallest normal fp32 as a floor keeps x / s finite for all-zero (and subnormal) groups.
        s = div(amax, fmt.max).clamp_min_(torch.finfo(torch.float32).tiny)
        codes = _to_fp8(xg / s[:, None], fmt).reshape(-1)[:n]
        return torch.cat([codes, s.view(torch.uint8)])

    @dispatch
    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        shape = as_shape(shape)
        check_float_dtype(dtype, self.name)
        self.check_payload(payload, shape, dtype)
        n = numel(shape)
        if n == 0:
            return torch.empty(shape, dtype=dtype, device=payload.device)
        g = self.group
        ng = self._ngroups(n)
        codes, s_bytes = split_sections(payload, (n, 4 * ng))
        s = from_bytes(s_bytes, torch.float32, ng)
        q = _from_fp8(codes, self.fmt)
        if q.numel() != ng * g:
            q = torch.cat([q, q.new_zeros(ng * g - q.numel())])
        x = q.view(ng, g).mul_(s[:, None])
        b = bound(s, self.fmt, g, False)
        check_decoded(x, b, self.name, limit=math.inf)
        return clamp_to_dtype_(x, dtype, b).reshape(-1)[:n].to(dtype).reshape(shape)


def error_bound(codec: Codec, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-group bound on ``||decode(encode(x)) - x||_2`` for an ``fp8``/``fp8plain`` codec.

    Returns one bound per group (fp32, shape ``(n_groups,)``), assuming nothing
    saturates, computed from the format's unit roundoff and subnormal spacing
    plus a small allowance for fp32 arithmetic and for rounding the result to
    the output ``dtype`` (default ``x.dtype``; pass the original dtype when
    ``x`` was upcast for the computation): its relative step and, for tiny
    values, its subnormal spacing.
    """
    if not isinstance(codec, _FP8Base):
        raise CodecError(f"error_bound takes an fp8 or fp8plain codec, got {codec!r}")
    fmt, g = codec.fmt, codec.group
    xg = _groups(x, g)
    norm = xg.norm(dim=1)
    half_sub = fmt.min_subnormal / 2
    if isinstance(codec, FP8):
        alpha = (fmt.max / torch.sqrt(xg.square().mean(dim=1) + LAMBDA)).clamp(ALPHA_MIN, ALPHA_MAX)
        # max|y| <= ||y||_2 = alpha ||x||_2, so s / alpha <= max(||x|| / FP8_MAX, S_MIN / alpha).
        s_over_alpha = torch.maximum(norm / fmt.max, S_MIN / alpha)
        floor = s_over_alpha * half_sub * math.sqrt(g)
    else:
        s = (xg.abs().amax(dim=1) / fmt.max).clamp_min(torch.finfo(torch.float32).tiny)
        floor = s * half_sub * math.sqrt(g)
    out = dtype or x.dtype
    out_eps, out_floor = 0.0, 0.0
    if out != torch.float32:
        fi = torch.finfo(out)
        out_eps = fi.eps
        out_floor = fi.smallest_normal * fi.eps / 2 * math.sqrt(g)  # half a subnormal step per element
    return (fmt.unit_roundoff + out_eps + 1e-5) * norm + floor + out_floor + 1e-30


register("fp8", FP8)
register("taco", FP8)
register("fp8plain", FP8Plain)
