"""Metadata layouts of the tile codecs: how each tile's zero point ``z`` and step ``s`` travel.

``ref``  fp16 step + fp16 zero per tile (32 bits per tile; symmetric: the
         step only): the reference implementation's wire format. The zero
         is rounded *down* and the step *up* to fp16 and the codes are
         computed against those stored values, so the tile stays covered
         and fp16 only makes the step slightly larger. |zero| or a step
         beyond 65504 raises :class:`CodecError` naming ``layout=log``;
         steps below fp16's smallest subnormal (6e-8) are stored as that
         subnormal (the error bound still holds, with that step).
``log``  (default) one fp32 *anchor* per block of rows (a block holds at
         least 65536 elements: 0.0005 bits/element), then per tile an
         8-bit step code and an 8-bit zero code: 16 bits per tile
         (symmetric: 8).
         Step: ``s = anchor * 2**(-c/16)``, ``c`` in 0..254 (16 codes per
         octave, 15.9 octaves below the block's largest step; 255 means
         ``s = 0``, an all-zero tile). The encoder takes the smallest code
         that covers the tile, so ``s`` exceeds the needed step by at most
         ``2**(1/16)`` (4.4%).
         Zero: ``z = k * u * s`` with a signed 8-bit ``k`` and a unit of
         ``u = 4 * 2**b / 128`` steps for a ``b``-bit tile (1/4 step at 3
         bits, 1/2 at 4, 8 at 8 bits): relative to the tile's own step, so
         it reaches 4 tile ranges either side of 0 at any scale. That is
         *not* enough for a TAH-Quant rotated tile whose pivot is a large
         outlier (its constant offset is pivot / sqrt(G): ~4 ranges at 100x
         the RMS, G=32); TAH-Quant widens those tiles' zero codes (zero
         extension, see :class:`LogLayout`). The zero is rounded
         down (the step is sized ``s >= (max - min) / (L - u)`` so the tile
         stays covered); among the admissible ``k`` the encoder prefers a
         whole number of steps, which puts 0 exactly on the grid. A tile
         farther than 4 ranges from 0 gets a proportionally larger step.
         Outlier tiles (the RMS of all but the largest element below the
         step, see :func:`~qwire.codecs.tiles.sparse_tiles`) that straddle 0 get the smallest
         step whose grid passes through 0 (``z = -j s``): their small
         elements then round to exactly 0 instead of to a grid point up
         to half a (large) step away. Holds any finite fp32 value.
``log6`` the same with a 6-bit step code (8 per octave, 7.9 octaves) and a
         6-bit zero (``u = 2**b / 32``: 1/2 step at 4 bits): 12 bits per
         tile, for the lowest rates.
``log7`` (TAH-Quant's default) a 7-bit step code (8 per octave: the same 15.9
         octaves as ``log``) and a 5-bit zero with ``u = 2**b / 16`` steps (one
         step at 4 bits, so 0 is always on the grid; reach 1 tile range): 12
         bits per tile, as ``log6``, whose 7.9 octaves a block with one tile of
         two large outliers exceeds.
``logx`` (TAH-Quant's previous default, in :data:`EXTENDED_LAYOUTS`, not offered to
         the ``int`` codecs) the ``log`` step code and the same zero unit
         with a 7-bit zero: 15 bits per tile, reaching 2 tile ranges either
         side of 0 (a tile farther from 0 gets a proportionally larger
         step). The bit saved pays for the zero extension of rotated tiles.

In every layout the codes are computed against the *decoded* metadata:
decoding is ``z + q * s`` and the rounding error of nearest rounding is at
most ``s / 2`` with the decoded ``s`` (stochastic rounding: ``s``).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from .base import FP16_MAX, CodecError, div, full_levels, maybe_any
from .portable import tree_sum
from .sections import Field, Sections

if TYPE_CHECKING:
    from .tiles import Geometry


class Layout:
    """How a tile's zero point and step are stored; see the module docstring."""

    name: str
    help: str

    def fields(self, g: Geometry, symmetric: bool) -> list[Field]:
        raise NotImplementedError

    def fit(self, lo: torch.Tensor, hi: torch.Tensor, levels: torch.Tensor | float, symmetric: bool,
            anchor_rows: int, codec: str, sparse: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Choose stored metadata for tiles ``(r, T)`` with range [lo, hi] and ``levels`` = 2^b - 1.

        ``sparse`` (optional, bool ``(r, T)``) marks tiles whose elements other than the
        largest sit close to 0 (see :func:`~qwire.codecs.tiles.sparse_tiles`); a layout may then prefer a grid
        that passes through 0 exactly.

        Returns the decoded zero ``z`` and step ``s`` (fp32, ``(r, T)``; ``z = 0`` when
        symmetric) and the values of this layout's fields for the chunk.
        Guarantee (up to fp32 rounding): asymmetric ``z <= lo`` and ``z + levels * s >= hi``;
        symmetric ``(levels // 2) * s >= max(|lo|, |hi|)``.
        """
        raise NotImplementedError

    def read(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry,
             symmetric: bool, levels: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded ``(z, s)`` of rows ``r0 .. r0 + r`` (``(r, T)`` fp32) whose tiles have ``levels``."""
        raise NotImplementedError

    @staticmethod
    def put(sec: Sections, payload: torch.Tensor, vals: dict[str, torch.Tensor], r0: int, g: Geometry) -> None:
        """Write the field values ``fit`` returned for the chunk starting at row ``r0``."""
        for name, v in vals.items():
            start = r0 // g.anchor_rows if name == "anchor" else r0 * g.tiles
            sec.put(payload, name, start, v.reshape(-1))


def round_fp16(v: torch.Tensor, up: bool, always: bool = False) -> torch.Tensor:
    """fp32 -> fp16 rounded toward +inf (``up``) or -inf, as fp16. ``always``: apply the correction without
    reading back whether any value needs it (the same result, no host sync)."""
    h = v.to(torch.float16)
    back = h.float()
    bad = back < v if up else back > v
    if always or bool(bad.any()):
        toward = torch.full_like(h, math.inf if up else -math.inf)
        h = torch.where(bad, torch.nextafter(h, toward), h)
    return h


class RefLayout(Layout):
    name = "ref"
    help = "fp16 step + fp16 zero per tile (the reference implementation's wire format)"

    def fields(self, g: Geometry, symmetric: bool) -> list[Field]:
        f = [Field("scale", g.n_tiles, dtype=torch.float16)]
        if not symmetric:
            f.append(Field("zero", g.n_tiles, dtype=torch.float16))
        return f

    def fit(self, lo, hi, levels, symmetric, anchor_rows, codec, sparse=None):
        if symmetric:
            zh = None
            need = div(torch.maximum(hi, -lo), levels // 2)
        else:
            if bool((lo < -FP16_MAX).any() | (lo > FP16_MAX).any()):
                raise self._overflow(codec, float(torch.maximum(lo.abs(), hi.abs()).max()))
            zh = round_fp16(lo, up=False)
            z = zh.float()
            need = div(hi - z, levels)
        sh = round_fp16(need, up=True)
        if bool(torch.isinf(sh).any()):
            raise self._overflow(codec, float(torch.maximum(lo.abs(), hi.abs()).max()))
        s = sh.float()
        vals = {"scale": sh}
        if symmetric:
            return torch.zeros_like(s), s, vals
        vals["zero"] = zh
        return z, s, vals

    @staticmethod
    def _overflow(codec: str, big: float) -> CodecError:
        return CodecError(
            f"codec {codec!r}: layout 'ref' stores zero and step as fp16, but this tensor has values up "
            f"to {big:.3g} whose zero or step exceeds fp16's range (65504); use layout=log, which "
            "holds any finite fp32 value"
        )

    def read(self, sec, payload, r0, r, g, symmetric, levels):
        n, s0 = r * g.tiles, r0 * g.tiles
        s = sec.get(payload, "scale", s0, n).float().view(r, g.tiles)
        if symmetric:
            return torch.zeros_like(s), s
        z = sec.get(payload, "zero", s0, n).float().view(r, g.tiles)
        return z, s


@functools.lru_cache(maxsize=64)
def _log_table(n: int, per_octave: int, device: str, fine: int | None = None, coarse: float = 0.0) -> torch.Tensor:
    """Steps of codes ``0 .. n - 1`` relative to the anchor: ``2^(-c / per_octave)``; tapered (``fine`` < n):
    from code ``fine - 1`` on, ``coarse`` codes per octave."""
    c = torch.arange(n, dtype=torch.float64)
    e = c / per_octave
    if fine is not None and fine < n:
        e = torch.where(c < fine, e, (fine - 1) / per_octave + (c - (fine - 1)) / coarse)
    return torch.exp2(-e).to(torch.float32).to(device)


@functools.lru_cache(maxsize=64)
def _read_table(n: int, per_octave: int, device: str, fine: int | None = None, coarse: float = 0.0) -> torch.Tensor:
    tab = _log_table(n, per_octave, device, fine, coarse)
    return torch.cat([tab, torch.zeros(1, device=tab.device)])


class LogLayout(Layout):
    """Per-block fp32 anchor; per tile a log-coded step and a step-relative zero.

    The zero is ``k * u * s`` with a signed ``zero_bits`` integer ``k`` and the unit
    ``u = zero_span * 2**b / 2**(zero_bits - 1)`` steps (a power of two) for a
    ``b``-bit tile: the zero code reaches ``zero_span`` tile ranges either side of 0
    whatever the bit width.

    Zero extension (optional, used by TAH-Quant for its rotated tiles): :meth:`fit` takes
    per-tile bounds ``kmin``/``kmax`` on ``k`` wider than the layout's own; the stored value
    ``k - self.kmin`` is then split into its low ``zero_bits`` bits (the ``zero`` field, as
    usual) and a signed high part (``vals["zero_ext"]``, ``floor((k - self.kmin) / 2**zero_bits)``,
    0 for every tile whose ``k`` fits the layout's own range) that the caller stores
    elsewhere and hands back to :meth:`read` as ``zero_ext``:
    ``k = zero + 2**zero_bits * zero_ext + self.kmin``. With them the encoder also gives
    the through-zero step (see ``_through_zero``) a few ulps of margin, so that fp32
    rounding cannot push the zero above the tile's minimum and 0 off the grid. Without
    these arguments the layout behaves exactly as it did without them (same bytes).
    """

    def __init__(self, name: str, scale_bits: int, per_octave: int, zero_bits: int, zero_span: int,
                 align: bool = True, fine: int | None = None, coarse: int = 0, tag_bits: int = 0) -> None:
        self.name = name
        self.align = align
        self.scale_bits, self.per_octave = scale_bits, per_octave
        self.zero_bits, self.zero_span = zero_bits, zero_span
        self.zero_code = (1 << scale_bits) - 1  # step code meaning "step 0"
        self.kmin, self.kmax = -(1 << (zero_bits - 1)), (1 << (zero_bits - 1)) - 1
        # tapered: codes from fine - 1 on are coarse per octave (a reach of many octaves at few bits)
        self.fine = self.zero_code if fine is None else fine
        self.coarse = coarse
        # the anchor's lowest tag_bits mantissa bits carry a tag of its block (the fit rounds the anchor up to
        # clear them; read ignores them): TAH-Quant's zero_width=block names the block's zero extension there
        self.tag_bits = tag_bits
        octaves = (self.fine - 1) / per_octave + (self.zero_code - self.fine) / coarse if coarse else \
            (self.zero_code - 1) / per_octave
        self.octaves = octaves
        taper = (f", then {coarse}/octave from code {self.fine - 1}: {octaves:g} octaves"
                 if self.fine < self.zero_code else "")
        self.help = (f"fp32 anchor per >=64K elements; per tile a {scale_bits}-bit log step "
                     f"({per_octave}/octave{taper}) and a {zero_bits}-bit step-relative zero")

    @property
    def tapered(self) -> bool:
        return self.fine < self.zero_code

    def round_anchor(self, anchor: torch.Tensor) -> torch.Tensor:
        """fp32 anchors (>= 0, finite) rounded up to a multiple of ``2^tag_bits`` units in the last place."""
        if not self.tag_bits:
            return anchor
        m = (1 << self.tag_bits) - 1
        return ((anchor.view(torch.int32) + m) & ~m).view(torch.float32)

    def split_anchor(self, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors without their tags, the tags (int64)) of stored anchors."""
        if not self.tag_bits:
            return anchor, torch.zeros(anchor.shape, dtype=torch.int64, device=anchor.device)
        m = (1 << self.tag_bits) - 1
        bits = anchor.contiguous().view(torch.int32)
        return (bits & ~m).view(torch.float32), (bits & m).long()

    def tag_anchor(self, anchor: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        """Rounded anchors (:meth:`round_anchor`) carrying ``tags`` (< ``2^tag_bits``)."""
        return (anchor.view(torch.int32) | tags.to(torch.int32)).view(torch.float32)

    def guess_code(self, ratio: torch.Tensor) -> torch.Tensor:
        """The step code whose step ``a * tab[c]`` is about ``ratio * a`` (fp32 ``log2``; the caller settles
        it to the canonical one, which this is within one of)."""
        lg = -torch.log2(ratio)
        c = torch.floor(self.per_octave * lg)
        if self.tapered:
            top = float(self.fine - 1)
            c = torch.where(c > top, top + torch.floor((lg - top / self.per_octave) * self.coarse), c)
        return c

    def fields(self, g: Geometry, symmetric: bool) -> list[Field]:
        f = [Field("anchor", g.n_blocks, dtype=torch.float32), Field("scale", g.n_tiles, bits=self.scale_bits)]
        if not symmetric:
            f.append(Field("zero", g.n_tiles, bits=self.zero_bits))
        return f

    def unit(self, levels: torch.Tensor | int) -> torch.Tensor | float:
        """Zero-code unit in steps for tiles with ``levels`` = 2^b - 1 (a power of two)."""
        return (levels + 1) * (self.zero_span / float(1 << (self.zero_bits - 1)))

    def _table(self, device: torch.device) -> torch.Tensor:
        return _log_table(self.zero_code, self.per_octave, str(device), self.fine, self.coarse)

    def read_table(self, device: torch.device) -> torch.Tensor:
        """The steps of every code, the zero-step code's 0 included (what :meth:`read` indexes)."""
        return _read_table(self.zero_code, self.per_octave, str(device), self.fine, self.coarse)

    @staticmethod
    def _per_row(block_vals: torch.Tensor, r: int, anchor_rows: int) -> torch.Tensor:
        return block_vals.repeat_interleave(anchor_rows)[:r, None]

    def fit(self, lo, hi, levels, symmetric, anchor_rows, codec, sparse=None,
            kmin: torch.Tensor | None = None, kmax: torch.Tensor | None = None):
        """See :meth:`Layout.fit`; ``kmin``/``kmax`` (fp32 ``(r, T)``, asymmetric only): per-tile
        range of the zero code ``k`` (zero extension, see the class docstring)."""
        r = lo.shape[0]
        aligned = None
        ext = kmin is not None
        kmin_ = kmin if ext else self.kmin
        kmax_ = kmax if ext else self.kmax
        if symmetric:
            need = div(torch.maximum(hi, -lo), levels // 2)
        else:
            u = self.unit(levels)
            need = div(hi - lo, levels - u)  # covers the tile even with the zero rounded down by < u steps
            need = torch.maximum(need, div(lo, kmin_ * u))  # k >= kmin must reach lo
            need = torch.maximum(need, div(hi, kmax_ * u + levels))  # k <= kmax must still cover hi
            if sparse is not None:
                aligned, j, need_al = self._through_zero(lo, hi, levels, u, sparse, kmin_)
                # a few ulps of margin: with the step exactly at need_al (the block's largest step
                # is its anchor), fp32 rounding can put -j * s just above lo, and the correction
                # below (k - 1) would then move 0 off the grid and the grid's top below hi
                need_al = need_al * (1.0 + 2.0 ** -20)
                need = torch.where(aligned, need_al, need)
        # anchor: largest step needed in each block of rows
        nb = -(-r // anchor_rows)
        rowmax = need.amax(dim=1)
        if nb * anchor_rows > r:
            rowmax = torch.cat([rowmax, rowmax.new_zeros(nb * anchor_rows - r)])
        anchor = self.round_anchor(rowmax.view(nb, anchor_rows).amax(dim=1))
        a = self._per_row(anchor, r, anchor_rows)
        tab = self._table(lo.device)
        # smallest step on the grid a * 2^(-c/q) that is >= need: c = floor(-q log2(need / a))
        ratio = torch.where(need > 0, need / torch.where(a > 0, a, torch.ones_like(a)), torch.ones_like(need))
        c = self.guess_code(ratio).clamp_(0, self.zero_code - 1).long()
        s = a * tab[c]
        # fp32 log2 may be off by one code either way: settle on the canonical code, the largest c
        # with a * tab[c] >= need (every implementation reaches the same one)
        short = s < need
        if maybe_any(short):  # the grid fell short: one code up in step
            c = torch.where(short, (c - 1).clamp_(min=0), c)
            s = a * tab[c]
        c1 = (c + 1).clamp_(max=self.zero_code - 1)
        s1 = a * tab[c1]
        longer = (s1 >= need) & (c1 > c)
        if maybe_any(longer):  # the next code down in step still covers the tile
            c = torch.where(longer, c1, c)
            s = torch.where(longer, s1, s)
        zero = need <= 0
        c = torch.where(zero, torch.full_like(c, self.zero_code), c)
        s = torch.where(zero, torch.zeros_like(s), s)
        vals = {"anchor": anchor, "scale": c.to(torch.uint8)}
        if symmetric:
            return torch.zeros_like(s), s, vals
        us = torch.where(zero, torch.ones_like(s), u * s)
        k = torch.floor(lo / us)
        k = k.clamp_(kmin_, kmax_) if not ext else torch.minimum(torch.maximum(k, kmin_), kmax_)
        if aligned is not None:  # zero = -j steps: 0 is a grid point
            k = torch.where(aligned & ~zero, div(-j, u), k)
        if self.align:
            # any k in [ceil((hi - L s) / us), floor(lo / us)] covers the tile; prefer one whose
            # zero is a whole number of steps, so that 0 is a grid point (free when it exists)
            kal = div(torch.floor(k * u), u)
            ok = (kal * us + levels * s >= hi) & (kal >= kmin_)
            k = torch.where(ok, kal, k)
        z = (k * u) * s
        over = z > lo
        if maybe_any(over):  # fp32 rounding put the zero just above the minimum
            k = torch.where(over, torch.maximum(k - 1, kmin_) if ext else (k - 1).clamp_(min=self.kmin), k)
            z = (k * u) * s
        if ext:  # split k - kmin into the zero field's low bits and the signed high part
            code = k - self.kmin
            high = torch.floor(code * (1.0 / (1 << self.zero_bits)))
            vals["zero"] = (code - high * (1 << self.zero_bits)).to(torch.uint8)
            vals["zero_ext"] = high.to(torch.int32)
        else:
            vals["zero"] = (k - self.kmin).to(torch.uint8)
        return z, s, vals

    # fit=mse: the candidate grids tried besides the covering one, as (step codes finer, zero offset)
    MSE_FINER = (1, 2)
    MSE_SHIFTS = (0, -1, 1)  # zero offsets in zero units; -1 and 1 only where a unit is under one step

    def mse_bound(self, levels: torch.Tensor | float, codes: torch.Tensor | None = None) -> torch.Tensor | float:
        """With ``fit=mse``: the bound on ``|x - y|`` in steps of the decoded grid (``levels`` = 2^b - 1).

        A candidate's step is at most ``2^(d/per_octave)`` finer than the covering step ``s0``
        (``d`` <= max :attr:`MSE_FINER`), the tile spans at most ``L s0``, and its centred zero
        is within ``u/2 + |shift| u`` steps of the centre: an end clips by at most
        ``L (2^(d/P) - 1) / 2 + 3u/2`` steps, an element inside the grid errs by ``1/2``.
        A tapered layout's coarse codes are further apart: there the bound is that of the decoded step
        codes ``codes`` (int64, shaped like ``levels``; every code's when None), whose covering code was at most
        ``d`` codes before.
        """
        d = max(self.MSE_FINER)
        if not self.tapered:
            grow = 2.0 ** (d / self.per_octave) - 1.0
        else:
            tab = self._table(codes.device if codes is not None else torch.device("cpu")).double()
            ratio = tab[:-d] / tab[d:]  # a code's step over that d codes later
            if codes is None:
                grow = float(ratio.max()) - 1.0
            else:
                c = codes.clamp(d, self.zero_code - 1) - d
                grow = ratio[c].float() - 1.0
        return 0.5 + levels * grow * 0.5 + 1.5 * self.unit(levels)

    @staticmethod
    def tile_sse(t: torch.Tensor, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
                 h: torch.Tensor | None = None) -> torch.Tensor:
        """Squared error ``(r, T)`` of tiles ``t`` ``(r, T, G)`` decoded from codes ``q`` (fp32) on grids
        ``z``, ``s`` ``(r, T)`` (``h`` given: symmetric, ``(q - h) s``), in an order every implementation
        follows: fp32 ``d = x - (z + q s)``, ``d * d`` summed into 8 lanes (element i into lane
        i % 8, in order), then the lanes as a tree ``((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))``."""
        s3 = s.unsqueeze(-1)
        y = (q - h.unsqueeze(-1)) * s3 if h is not None else z.unsqueeze(-1) + q * s3
        d = t - y
        e = d * d
        G = e.shape[-1]
        if G % 8:
            e = torch.nn.functional.pad(e, (0, 8 - G % 8))
        acc = e[..., 0:8]
        for c in range(8, e.shape[-1], 8):
            acc = acc + e[..., c: c + 8]
        return ((acc[..., 0] + acc[..., 4]) + (acc[..., 2] + acc[..., 6])) + (
            (acc[..., 1] + acc[..., 5]) + (acc[..., 3] + acc[..., 7]))

    def refine(self, t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
               vals: dict[str, torch.Tensor], levels: torch.Tensor | int, symmetric: bool, anchor_rows: int,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``fit=mse``: replace the covering fit of each tile by the grid of lowest squared error.

        ``t`` holds the tiles ``(r, T, G)`` (fp32, not modified), ``lo``/``hi`` their ranges ``(r, T)``
        (tiles outside ``mask`` aside); ``z``/``s``/``vals`` are what
        :meth:`fit` returned for them (``vals`` is updated in place: ``scale`` and ``zero``; the
        anchors stay). Candidates, in order: the covering grid (``fit``'s), then for each step code
        ``c + d`` (``d`` in :attr:`MSE_FINER`, steps 2^(d/per_octave) finer, so the tile's ends
        may clip) the grid centred on the tile, ``k = floor(((lo + hi) / 2 - L s / 2) / (u s) + 1/2)``,
        shifted by :attr:`MSE_SHIFTS` zero units where a unit is under one step (``u < 1``);
        a candidate whose zero code falls outside the layout's range is skipped.
        Each candidate's error is :meth:`tile_sse` with the codes ``q`` that
        :func:`~qwire.codecs.tiles.quantize_` gives; the first candidate of lowest error wins (the
        covering one on ties). Tiles outside ``mask`` (bool ``(r, T)``) and all-zero tiles keep the
        covering fit. Returns the new ``(z, s)``.

        A clipped element errs by at most :meth:`mse_bound` times the step (nearest rounding).
        """
        from .tiles import quantize_  # tiles imports this module

        r, T, _ = t.shape
        L = full_levels(levels, (r, T), t.device)
        c0 = vals["scale"].long()
        live = c0 < self.zero_code
        if mask is not None:
            live = live & mask
        if not maybe_any(live):
            return z, s
        a = self._per_row(vals["anchor"], r, anchor_rows)
        h = torch.floor(L * 0.5)
        lv = L.unsqueeze(-1) if isinstance(levels, torch.Tensor) else levels

        def sse(zc: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
            q = quantize_(t.clone(), zc.unsqueeze(-1), sc.unsqueeze(-1), lv, symmetric, None).float()
            return self.tile_sse(t, q, zc, sc, h if symmetric else None)

        k0 = None if symmetric else vals["zero"].float() + self.kmin
        best_z, best_s, best_c, best_k = self._search(sse, z, s, c0, k0, a, L, lo, hi, live, self.kmin, self.kmax)
        vals["scale"] = best_c.to(torch.uint8)
        if not symmetric:
            vals["zero"] = (best_k - self.kmin).to(torch.uint8)
        return best_z, best_s

    def _search(self, sse, z: torch.Tensor, s: torch.Tensor, c0: torch.Tensor, k0: torch.Tensor | None,
                a: torch.Tensor, L: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, live: torch.Tensor,
                kmin: torch.Tensor | float, kmax: torch.Tensor | float):
        """The candidate grids of :meth:`refine` and :meth:`refine_blocks` and the first of lowest ``sse(z, s)``
        among them, where ``live``: the covering grid ``(z, s)`` (step code ``c0``, zero code ``k0``; None:
        symmetric, zero 0), then per step code ``c0 + d`` (``d`` in :attr:`MSE_FINER`; step ``a`` times the
        table's) the zero centred on ``[lo, hi]`` and, where a unit is under a step, shifted by
        :attr:`MSE_SHIFTS` units; a zero code outside ``kmin .. kmax`` is skipped (a clamped zero would void the
        bound). Returns the chosen ``(z, s, step code, zero code)``."""
        best_e, best_z, best_s, best_c, best_k = sse(z, s), z, s, c0, k0
        tab = self._table(z.device)
        u = self.unit(L)
        for d in self.MSE_FINER:
            c = (c0 + d).clamp_(max=self.zero_code - 1)
            sc = a * tab[c]
            if k0 is None:
                shifts, kc = (0,), None
            else:
                us = u * sc
                kc = torch.floor(((lo + hi) * 0.5 - (L * sc) * 0.5) / torch.where(us != 0, us, torch.ones_like(us))
                                 + 0.5)
                shifts = self.MSE_SHIFTS
            for dk in shifts:
                if kc is None:
                    zc, k = torch.zeros_like(sc), None
                else:
                    k = kc + dk
                    inside = (k >= kmin) & (k <= kmax)
                    k = k.clamp(kmin, kmax)
                    zc = (k * u) * sc
                e = sse(zc, sc)
                ok = live & (e < best_e)
                if k is not None:
                    ok &= inside
                if dk:
                    ok &= u < 1
                best_e = torch.where(ok, e, best_e)
                best_z, best_s = torch.where(ok, zc, best_z), torch.where(ok, sc, best_s)
                best_c = torch.where(ok, c, best_c)
                if k is not None:
                    best_k = torch.where(ok, k, best_k)
        return best_z, best_s, best_c, best_k

    def refine_blocks(self, y: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
                      c0: torch.Tensor, k0: torch.Tensor, a: torch.Tensor, L: torch.Tensor, kmin: torch.Tensor,
                      kmax: torch.Tensor, nw: int | torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``fit=mse`` for blocks of two widths (TAH-Quant's rotated tiles with ``slots=tile``): the first ``nw``
        values of each tile coded with ``2 L + 1`` levels on half the step, the others with ``L`` levels on it
        (``nw`` an int, or per tile ``(n,)``: TAH-Quant's ``zero_width=block``).

        ``y`` ``(n, G)`` (G a power of two; not modified): the tiles' values; ``lo``, ``hi``, the covering grid
        ``z``, ``s``, its step code ``c0`` (int64) and zero code ``k0`` (fp32, the layout's ``kmin`` not
        subtracted, the zero extension included), the anchors ``a``, the levels ``L`` of the narrow width,
        and the range ``kmin`` .. ``kmax`` the zero code may take: ``(n,)`` each. The candidates and the
        rule are :meth:`refine`'s (the covering grid, then the centred ones of the step codes
        :attr:`MSE_FINER` finer, shifted by :attr:`MSE_SHIFTS` units where a unit is under a step; the first
        of lowest error wins); a candidate's error is ``d * d`` of every value, ``d = y - (z + q * step)``
        with the codes of ``quantize_``, added pairwise (:func:`~qwire.codecs.portable.tree_sum`: the second half
        onto the first until one value is left). Zero-step tiles keep the covering grid.
        Returns the chosen ``(z, s, step code, zero code)``.

        Since the rotation is orthonormal, this squared error is the tile's own once un-rotated.
        """
        from .tiles import quantize_  # tiles imports this module

        ww = (L * 2.0 + 1.0).unsqueeze(-1)
        Ln = L.unsqueeze(-1)

        wide = None
        if isinstance(nw, torch.Tensor):  # per tile (TAH-Quant's zero_width=block): the first nw of each are wide
            wide = torch.arange(y.shape[1], device=y.device) < nw.unsqueeze(-1)

        def sse(zc: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
            zz, sn = zc.unsqueeze(-1), sc.unsqueeze(-1)
            sw = sn * 0.5
            if wide is not None:
                qw = quantize_(y.clone(), zz, sw, ww, False, None).float()
                qn = quantize_(y.clone(), zz, sn, Ln, False, None).float()
                d = torch.where(wide, y - (zz + qw * sw), y - (zz + qn * sn))
                return tree_sum(d * d)
            w, nr = y[:, :nw], y[:, nw:]
            qw = quantize_(w.clone(), zz, sw, ww, False, None).float()
            qn = quantize_(nr.clone(), zz, sn, Ln, False, None).float()
            d = torch.cat([w - (zz + qw * sw), nr - (zz + qn * sn)], dim=1)
            return tree_sum(d * d)

        return self._search(sse, z, s, c0, k0, a, L, lo, hi, c0 < self.zero_code, kmin, kmax)

    def _through_zero(self, lo, hi, levels, u, sparse, kmin=None):
        """For tiles straddling 0: the smallest step whose grid ``-j s .. (L - j) s`` covers [lo, hi].

        ``s_j = max(-lo / j, hi / (L - j))`` is minimal near ``j = L * (-lo) / (hi - lo)``; the two
        integers around it are tried. Returns (use it: bool, j, step), only where the zero code
        can say ``-j`` steps exactly (``1/u`` whole, ``j / u`` within the code's range).
        """
        L = levels if isinstance(levels, torch.Tensor) else torch.full_like(lo, float(levels))
        uu = u if isinstance(u, torch.Tensor) else torch.full_like(lo, float(u))
        width = torch.where(hi > lo, hi - lo, torch.ones_like(lo))
        j0 = torch.floor(L * (-lo) / width).clamp_(min=1)
        best_s, best_j = None, None
        for j in (j0, j0 + 1):
            j = torch.minimum(j, L - 1)
            sj = torch.maximum(-lo / j, hi / (L - j))
            if best_s is None:
                best_s, best_j = sj, j
            else:
                better = sj < best_s
                best_s, best_j = torch.where(better, sj, best_s), torch.where(better, j, best_j)
        kmin = self.kmin if kmin is None else kmin  # per-tile with the zero extension
        ok = sparse & (lo < 0) & (hi > 0) & (L >= 3) & (uu <= 1) & (best_j / uu <= -kmin)
        return ok, best_j, best_s

    def read(self, sec, payload, r0, r, g, symmetric, levels, zero_ext: torch.Tensor | None = None):
        """See :meth:`Layout.read`; ``zero_ext`` (integer ``(r, T)``, optional): the high part of
        each tile's zero code (zero extension, see the class docstring)."""
        ar = g.anchor_rows
        n, s0 = r * g.tiles, r0 * g.tiles
        anchor = self.split_anchor(sec.get(payload, "anchor", r0 // ar, -(-r // ar)))[0]
        a = self._per_row(anchor, r, ar)
        c = sec.get(payload, "scale", s0, n).view(r, g.tiles).long()
        tab = self.read_table(payload.device)
        s = a * tab[c]
        if symmetric:
            return torch.zeros_like(s), s
        k = sec.get(payload, "zero", s0, n).view(r, g.tiles).float() + self.kmin
        if zero_ext is not None:
            k = k + zero_ext.float() * (1 << self.zero_bits)
        return (k * self.unit(levels)) * s, s


LAYOUTS: dict[str, Layout] = {
    "ref": RefLayout(),
    "log": LogLayout("log", scale_bits=8, per_octave=16, zero_bits=8, zero_span=4),
    "log6": LogLayout("log6", scale_bits=6, per_octave=8, zero_bits=6, zero_span=1),
    "log7": LogLayout("log7", scale_bits=7, per_octave=8, zero_bits=5, zero_span=1),
}
DEFAULT_LAYOUT = "log"
# Layouts for codecs that widen the zero code of some tiles (TAH-Quant's rotated tiles, see
# LogLayout's zero extension). Kept out of LAYOUTS, so the int codecs (and their kernels) are
# offered exactly the layouts they always had.
EXTENDED_LAYOUTS: dict[str, Layout] = {
    "logx": LogLayout("logx", scale_bits=8, per_octave=16, zero_bits=7, zero_span=2),
    # log6's grid (8 codes per octave, a zero in half steps at 4 bits) for the steps within 6.75 octaves of
    # the block's largest, then one code per octave: 14.75 octaves in all (log6: 7.75), so that a tile far
    # below its block's largest (next to two outliers that share a tile) keeps a step near its own
    "log6t": LogLayout("log6t", scale_bits=6, per_octave=8, zero_bits=6, zero_span=1, fine=55, coarse=1, tag_bits=4),
}
