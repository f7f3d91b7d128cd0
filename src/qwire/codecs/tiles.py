"""Shared machinery of the per-tile quantizers (``int``, ``tahquant``): tiling, input checks,
per-tile statistics, quantization of a chunk of tiles and the codec plumbing.

Tiling
    A tensor of shape ``(..., C)`` is viewed as ``R`` rows (tokens) of ``C``
    channels; each row is cut into ``T = ceil(C / G)`` tiles of ``G`` channels.
    When ``C`` is not a multiple of ``G`` the last tile is padded by repeating
    the row's last element (so the padding never widens the tile's range). A
    0-d tensor is one row of one channel.

How each tile's zero and step travel is a metadata layout
(:mod:`qwire.codecs.layouts`); the byte layout of a payload is a sequence of
sections (:mod:`qwire.codecs.sections`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .base import FP16_MAX, Codec, CodecError, as_shape, check_finite, check_float_dtype, div, numel
from .sections import Sections

CHUNK_ELEMS = 1 << 18  # elements per processing chunk on CPU (~1 MB of fp32: stays in L2)
ANCHOR_ELEMS = 1 << 16  # a log-layout anchor covers at least this many elements
MAX_ABS = 2.0 ** 120  # quantizing codecs take finite values up to ~1.3e36 in magnitude


# ---------------------------------------------------------------------------------------------
# geometry
@dataclass(frozen=True)
class Geometry:
    """Rows, channels and tiles of a tensor shape for tile size ``tile`` (derived sizes computed once: a codec
    keeps the geometry of each shape it meets)."""

    rows: int
    cols: int
    tile: int
    seq: int = 1  # size of the second-to-last dimension (1 for 0-d and 1-d tensors)

    @functools.cached_property
    def tiles(self) -> int:
        return -(-self.cols // self.tile)

    @functools.cached_property
    def padded(self) -> int:
        return self.tiles * self.tile

    @property
    def n_tiles(self) -> int:
        return self.rows * self.tiles

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @functools.cached_property
    def anchor_rows(self) -> int:
        """Rows per log-layout anchor block: a power of two holding >= ANCHOR_ELEMS elements."""
        need = max(1, -(-ANCHOR_ELEMS // max(1, self.padded)))
        return 1 << (need - 1).bit_length()

    @functools.cached_property
    def n_blocks(self) -> int:
        return -(-self.rows // self.anchor_rows)

    def chunk_rows(self, quantum: int, device: torch.device) -> int:
        """Rows per processing chunk: a multiple of ``quantum`` and of the anchor block."""
        q = math.lcm(quantum, self.anchor_rows)
        if device.type != "cpu":  # accelerators: few large kernels beat cache-sized chunks
            return max(q, -(-self.rows // q) * q)
        return max(q, (CHUNK_ELEMS // max(1, self.padded)) // q * q)


def geometry(shape: Sequence[int], tile: int) -> Geometry:
    cols = int(shape[-1]) if len(shape) else 1
    n = numel(shape)
    return Geometry(rows=n // cols if cols else 0, cols=cols, tile=tile,
                    seq=int(shape[-2]) if len(shape) >= 2 else 1)


def as_rows(x: torch.Tensor, g: Geometry) -> torch.Tensor:
    return x.detach().reshape(g.rows, g.cols)


def load_tiles(rows: torch.Tensor, g: Geometry) -> torch.Tensor:
    """Copy rows ``(r, C)`` into a fresh fp32 ``(r, T, G)`` buffer, padding by repeating the last column."""
    r = rows.shape[0]
    buf = torch.empty(r, g.padded, dtype=torch.float32, device=rows.device)
    buf[:, : g.cols] = rows
    if g.padded > g.cols:
        buf[:, g.cols:] = rows[:, g.cols - 1: g.cols]
    return buf.view(r, g.tiles, g.tile)


def check_range(x: torch.Tensor, mag: torch.Tensor, codec: str) -> None:
    """Raise for NaN/Inf (via :func:`check_finite` on the whole input) or values beyond MAX_ABS.

    ``mag`` holds per-tile magnitudes of a chunk (e.g. ``max(hi, -lo)``); NaN and Inf
    propagate into it, so one small reduction checks the chunk.
    """
    check_magnitude(x, float(mag.amax()) if mag.numel() else 0.0, codec)


def check_magnitude(x: torch.Tensor, m: float, codec: str) -> None:
    """:func:`check_range` given the largest per-tile magnitude ``m`` (NaN or Inf when ``x`` holds them)."""
    if not math.isfinite(m):
        check_finite(x, codec)
    if not m <= MAX_ABS:  # also catches a NaN that check_finite could not see
        raise CodecError(
            f"codec {codec!r}: input magnitude {m:.3g} exceeds the largest value a quantizing codec takes "
            f"({MAX_ABS:.3g}); rescale the tensor or use a float codec such as 'fp32'"
        )


# ---------------------------------------------------------------------------------------------
# per-tile statistics
def sum_squares(t: torch.Tensor) -> torch.Tensor:
    """Per-tile sum of squares of fp32 tiles ``(..., G)``, accumulated in fp64 and rounded once to fp32,
    so that the result does not depend on the order of summation (every implementation agrees)."""
    d = t.double()
    return torch.linalg.vecdot(d, d).float()


SPARSE_KAPPA = 1.0  # measured: 0.25-1 help outlier tiles alike; 2 starts to cost on dense tiles


def sparse_tiles(sumsq: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: torch.Tensor | int,
                 tile: int) -> torch.Tensor:
    """Tiles whose elements other than the largest are small next to the step.

    ``sumsq`` is each tile's sum of squares. True where the RMS of the tile without its
    largest magnitude is below ``SPARSE_KAPPA`` (1) times the unconstrained step
    ``(hi - lo) / levels``: an outlier tile, whose other elements mostly round to the grid
    point nearest 0 - which should then be 0 itself.
    """
    a1 = torch.maximum(hi, -lo)
    rest = div((sumsq - a1 * a1).clamp_(min=0), max(1, tile - 1))
    return rest.sqrt_() < div(SPARSE_KAPPA * (hi - lo), levels)


# ---------------------------------------------------------------------------------------------
# quantization of a chunk of tiles
def quantize_(t: torch.Tensor, z: torch.Tensor | None, s: torch.Tensor, levels: torch.Tensor | int,
              symmetric: bool, gen: torch.Generator | None) -> torch.Tensor:
    """Codes (uint8) of ``t`` (fp32, overwritten) for decoded zero ``z`` and step ``s``.

    ``z``, ``s`` and a tensor ``levels`` broadcast against ``t`` (e.g. ``(r, T, 1)``
    for tiles ``(r, T, G)``). Asymmetric codes are ``round((x - z) / s)`` in ``[0, levels]``;
    symmetric ones ``round(x / s) + h`` in ``[0, 2h]``, ``h = levels // 2``. With ``gen``:
    stochastic rounding ``floor(v + u)``, ``u ~ U[0, 1)`` drawn from ``gen``, clamped to the
    range. A step of 0 (an all-zero or constant tile) gives code 0 (symmetric: ``h``).

    Codes are clamped to the range: the metadata covers the tile (``z <= min``,
    ``z + levels * s >= max`` up to fp32 rounding), so the clamp only catches fp32 rounding at
    the ends of the range and never lets a code spill into its neighbour's bits.
    """
    pos = s > 0
    inv = torch.where(pos, 1.0 / torch.where(pos, s, torch.ones_like(s)), torch.zeros_like(s))
    if symmetric:
        bias = torch.full_like(inv, float(levels // 2))
    else:
        bias = -(z * inv)
    torch.addcmul(bias, t, inv, out=t)  # (x - z) / s, or x / s + h
    top = 2 * (levels // 2) if symmetric else levels
    if gen is None:  # the clamp only guards against fp32 rounding at the range's ends
        t.round_()
        if isinstance(top, torch.Tensor):
            t.clamp_(min=0)
            torch.minimum(t, top.to(t.dtype), out=t)
        else:
            t.clamp_(0, top)
    else:
        t.add_(torch.rand(t.shape, generator=gen, device=t.device, dtype=t.dtype)).floor_()
        hi = 2 * (levels // 2) if symmetric else levels
        if isinstance(hi, torch.Tensor):
            t.clamp_(min=0)
            torch.minimum(t, hi.to(t.dtype), out=t)
        else:
            t.clamp_(0, hi)
    return t.to(torch.uint8)


def dequantize(codes: torch.Tensor, z: torch.Tensor | None, s: torch.Tensor, levels: int | None,
               symmetric: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """Values ``z + q * s`` (symmetric: ``(q - h) * s``) of uint8 codes as fp32; z and s broadcast.

    ``out`` (fp32, the codes' shape) receives the values when given.
    """
    q = codes.to(torch.float32) if out is None else out.copy_(codes)
    if symmetric:
        return torch.addcmul(-(levels // 2) * s, q, s, out=q)
    return torch.addcmul(z, q, s, out=q)


def generator(seed: int, call: int, device: torch.device) -> torch.Generator:
    """The generator of the ``call``-th stochastic encode of a codec seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + call) % (1 << 63))
    return g


def values_bound(z: torch.Tensor, s: torch.Tensor, levels: torch.Tensor | int, growth: float = 1.0) -> float:
    """A bound on the magnitude of the values decoded with zeros ``z`` and steps ``s`` (``(r, T)``) for
    codes up to ``levels``: ``|z| + levels * |s|``, times ``growth`` (``G`` where the values then go
    through a Hadamard butterfly, which adds ``G`` of them). NaN when the metadata is (see
    :func:`~qwire.codecs.base.check_decoded`)."""
    if not z.numel():
        return 0.0
    return float((z.abs() + s.abs() * levels).amax()) * growth


def store_out(out: torch.Tensor, r0: int, vals: torch.Tensor, g: Geometry) -> None:
    """Write fp32 tiles ``(r, T, G)`` of rows r0.. into the output ``(R, C)`` (drops padding, casts)."""
    v = vals.view(vals.shape[0], g.padded)[:, : g.cols]
    if out.dtype == torch.float16:
        v = v.clamp(-FP16_MAX, FP16_MAX)  # a code within s/2 of a value <= 65504 must not become Inf
    out[r0: r0 + vals.shape[0]] = v


# ---------------------------------------------------------------------------------------------
# common codec plumbing
ROUNDING = ("nearest", "stochastic")
FITS = ("minmax", "mse")
FIT_HELP = ("how the encoder fits each tile's grid: minmax (the grid covers the tile: error <= step/2) or mse "
            "(the grid of lowest squared error among a few finer ones, whose ends may clip; with a log layout "
            "and nearest rounding, else minmax)")


def fit_searches(fit: str, layout: str, rounding: str) -> bool:
    """Whether ``fit=mse`` applies: it searches the log layouts' step codes (``layout=ref`` keeps the reference's
    min-max fit) and clips, which stochastic rounding must not (it would bias the codes)."""
    return fit == "mse" and layout != "ref" and rounding == "nearest"


LAYOUTS_KEPT = 64  # shapes whose geometry and sections a codec object keeps


class TileCodec(Codec):
    """Shared plumbing of the tile codecs: geometry, sections, empty tensors, stochastic seeds.

    Stochastic rounding is reproducible: the ``k``-th call to :meth:`encode` of a
    codec object draws its noise from a ``torch.Generator`` on the input's device
    seeded with ``(seed * 1000003 + k) mod 2**63``. Two codec objects built from
    the same spec produce the same sequence of payloads for the same inputs on
    the same kind of device.
    """

    tile: int
    rounding: str
    seed: int

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._calls = 0

    def geometry(self, shape: Sequence[int]) -> Geometry:
        return geometry(as_shape(shape), self.tile)

    def sections(self, g: Geometry) -> Sections:
        raise NotImplementedError

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        check_float_dtype(dtype, self.name)
        g, sec = self._layout(shape)
        return sec.nbytes if g.numel else 0

    def _layout(self, shape: Sequence[int]) -> tuple[Geometry, Sections]:
        """The geometry and payload sections of ``shape``, made once per shape (both are read only): a codec
        meets the same few shapes call after call, and on a GPU this host work is part of every call's cost."""
        key = tuple(shape)
        cache = self.__dict__.setdefault("_layouts", {})
        hit = cache.get(key)
        if hit is None:
            if len(cache) >= LAYOUTS_KEPT:
                cache.clear()
            g = self.geometry(key)
            hit = cache[key] = (g, self.sections(g))
        return hit

    def _begin_encode(self, x: torch.Tensor) -> tuple[Geometry, Sections, torch.Tensor]:
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"codec {self.name!r} encodes torch tensors, got {type(x).__name__}")
        check_float_dtype(x.dtype, self.name)
        g, sec = self._layout(x.shape)
        return g, sec, torch.empty(sec.nbytes if g.numel else 0, dtype=torch.uint8, device=x.device)

    def _begin_decode(self, payload: torch.Tensor, shape: Sequence[int],
                      dtype: torch.dtype) -> tuple[Geometry, Sections, torch.Tensor]:
        shape = as_shape(shape)
        check_float_dtype(dtype, self.name)
        self.check_payload(payload, shape, dtype)
        g, sec = self._layout(shape)
        make = torch.empty if g.numel else torch.zeros  # decoders write every element
        return g, sec, make(shape, dtype=dtype, device=payload.device)

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.rounding != "stochastic":
            return None
        gen = generator(self.seed, self._calls, device)
        self._calls += 1
        return gen

    def error_bound(self, x: torch.Tensor, payload: torch.Tensor | None = None) -> torch.Tensor:
        """Per-element bound on ``|x - decode(encode(x))|`` (fp32, x's shape), from the decoded metadata.

        Nearest rounding: half the tile's decoded step; stochastic: one step. Exact
        arithmetic; the fp32 evaluation and the final cast to x's dtype add their
        own rounding on top. ``payload`` defaults to a fresh ``encode(x)``.
        """
        if payload is None:
            payload = self.encode(x)
        g, sec, _ = self._begin_decode(payload, x.shape, x.dtype)
        out = torch.zeros(g.rows, g.cols, dtype=torch.float32, device=payload.device)
        if g.numel:
            rpc = g.chunk_rows(8, payload.device)
            for r0 in range(0, g.rows, rpc):
                b = self._tile_bound(sec, payload, r0, min(rpc, g.rows - r0), g)
                out[r0: r0 + b.shape[0]] = b.reshape(b.shape[0], g.padded)[:, : g.cols]
        return out.reshape(x.shape)

    def _tile_bound(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry) -> torch.Tensor:
        raise NotImplementedError
