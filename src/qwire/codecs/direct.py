"""Direct (naive) per-tile integer quantization: ``int`` and ``int2`` .. ``int8``.

Each row (token) of ``C`` channels is cut into tiles of ``tile`` channels
(the last dimension; a short last tile is fine). Per tile, with ``L = 2**bits - 1``:

- asymmetric (default): ``zero = min``, ``step = (max - min) / L``,
  ``q = clamp(round((x - zero) / step), 0, L)``, decoded as ``zero + q * step``;
- ``symmetric=true``: ``step = absmax / h`` with ``h = 2**(bits-1) - 1``,
  ``q = clamp(round(x / step), -h, h) + h``, decoded as ``(q - h) * step``.

Zero and step travel in the chosen metadata ``layout`` (see
:mod:`qwire.codecs.layouts`: ``ref`` = fp16 + fp16 per tile, ``log`` = 16 bits
per tile, ``log6`` = 12 bits per tile) and the codes are computed against the
decoded metadata, so nearest rounding is off by at most half the decoded step.
``rounding=stochastic`` rounds ``v`` up with probability ``v - floor(v)``
(unbiased, error below one step), seeded by ``seed`` (see
:class:`~qwire.codecs.tiles.TileCodec`). ``fit=mse`` (log layouts, nearest
rounding) lets the encoder pick, per tile, a finer grid that clips the tile's
ends when that lowers its squared error (see
:meth:`~qwire.codecs.layouts.LogLayout.refine`); the format and the decoder
are the same.

Payload: ``[layout metadata][codes: C * bits bits per row, row-major, bit-packed]``
(the padding of a short last tile is not sent).

Policy: float32/float16/bfloat16 in, the same dtype out; NaN/Inf raise
:class:`~qwire.codecs.base.NonFiniteError`; an empty tensor has a 0-byte
payload; all-zero tiles decode to exact zeros.
"""

from __future__ import annotations

import torch

from .base import Param, check_decoded
from .kernels import dispatch
from .layouts import DEFAULT_LAYOUT, LAYOUTS
from .registry import register
from .sections import Field, Sections
from .tiles import (
    FIT_HELP,
    FITS,
    ROUNDING,
    Geometry,
    TileCodec,
    as_rows,
    check_range,
    dequantize,
    fit_searches,
    load_tiles,
    quantize_,
    sparse_tiles,
    store_out,
    sum_squares,
    values_bound,
)


class DirectInt(TileCodec):
    """Per-tile ``bits``-bit quantization along the last dimension, no rotation, no allocation."""

    name = "int"
    params = (
        Param("bits", int, 8, "bits per code, 2..8", lo=2, hi=8),
        Param("tile", int, 32, "channels per tile (last dimension) sharing one zero and step", lo=1, hi=1 << 20),
        Param("symmetric", bool, False, "true: zero-centred codes, step = absmax / (2^(bits-1) - 1)"),
        Param("rounding", str, "nearest", "nearest or stochastic", choices=ROUNDING),
        Param("seed", int, 0, "seed of stochastic rounding", lo=0, hi=(1 << 63) - 1),
        Param("layout", str, DEFAULT_LAYOUT, "metadata layout: " + ", ".join(LAYOUTS), choices=tuple(LAYOUTS)),
        Param("fit", str, "minmax", FIT_HELP, choices=FITS, legacy="minmax"),
    )
    bits: int
    symmetric: bool
    layout: str
    fit: str

    @property
    def searches(self) -> bool:
        """Whether the encoder searches each tile's grid (``fit=mse`` where it applies, see
        :func:`~qwire.codecs.tiles.fit_searches`)."""
        return fit_searches(self.fit, self.layout, self.rounding)

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def geometry(self, shape) -> Geometry:
        g = super().geometry(shape)
        # a tile wider than the row is the whole row (the padding would not change the range)
        return g if g.cols >= g.tile or not g.cols else Geometry(g.rows, g.cols, g.cols, g.seq)

    def sections(self, g: Geometry) -> Sections:
        meta = LAYOUTS[self.layout].fields(g, self.symmetric)
        return Sections([*meta, Field("codes", g.numel, bits=self.bits)])

    @dispatch
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        g, sec, payload = self._begin_encode(x)
        if not g.numel:
            return payload
        lay = LAYOUTS[self.layout]
        X = as_rows(x, g)
        gen = self._generator(x.device)
        rpc = g.chunk_rows(8, x.device)
        for r0 in range(0, g.rows, rpc):
            t = load_tiles(X[r0: r0 + rpc], g)
            r = t.shape[0]
            lo, hi = t.amin(dim=-1).add_(0.0), t.amax(dim=-1).add_(0.0)  # + 0: no signed zeros
            check_range(x, torch.maximum(hi, -lo), self.name)
            sumsq = None if self.symmetric else sum_squares(t)
            sparse = None if self.symmetric else sparse_tiles(sumsq, lo, hi, self.levels, g.tile)
            z, s, vals = lay.fit(lo, hi, self.levels, self.symmetric, g.anchor_rows, self.name, sparse)
            if self.searches:  # outlier tiles keep the covering grid: the search would clip their outliers
                outl = sparse if sparse is not None else sparse_tiles(sum_squares(t), lo, hi, self.levels, g.tile)
                z, s = lay.refine(t, lo, hi, z, s, vals, self.levels, self.symmetric, g.anchor_rows, ~outl)
            lay.put(sec, payload, vals, r0, g)
            q = quantize_(t, z.unsqueeze(-1), s.unsqueeze(-1), self.levels, self.symmetric, gen).view(r, g.padded)
            sec.put(payload, "codes", r0 * g.cols, q[:, : g.cols] if g.padded > g.cols else q)
        return payload

    @dispatch
    def decode(self, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
        g, sec, out = self._begin_decode(payload, shape, dtype)
        if not g.numel:
            return out
        lay = LAYOUTS[self.layout]
        O = out.view(g.rows, g.cols)
        direct = dtype == torch.float32 and g.padded == g.cols  # decode straight into the output
        rpc = g.chunk_rows(8, payload.device)
        for r0 in range(0, g.rows, rpc):
            r = min(rpc, g.rows - r0)
            z, s = lay.read(sec, payload, r0, r, g, self.symmetric, self.levels)
            codes = sec.get(payload, "codes", r0 * g.cols, r * g.cols).view(r, g.cols)
            if g.padded > g.cols:
                full = torch.zeros(r, g.padded, dtype=torch.uint8, device=payload.device)
                full[:, : g.cols] = codes
                codes = full
            dst = O[r0: r0 + r].view(r, g.tiles, g.tile) if direct else None
            vals = dequantize(codes.view(r, g.tiles, g.tile), z.unsqueeze(-1), s.unsqueeze(-1), self.levels,
                              self.symmetric, out=dst)
            check_decoded(vals, values_bound(z, s, self.levels), self.name)
            if not direct:
                store_out(O, r0, vals, g)
        return out

    def _tile_bound(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry) -> torch.Tensor:
        lay = LAYOUTS[self.layout]
        _, s = lay.read(sec, payload, r0, r, g, self.symmetric, self.levels)
        half = 1.0 if self.rounding == "stochastic" else 0.5
        if self.searches:
            half = lay.mse_bound(float(self.levels))
        return (s * half).unsqueeze(-1).expand(r, g.tiles, g.tile)


register("int", DirectInt)
for _b in range(2, 9):
    register(f"int{_b}", DirectInt, bits=_b)
