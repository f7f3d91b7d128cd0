"""TAH-Quant (arXiv 2506.01352): tile-wise asymmetric quantization with Hadamard
rotation of outlier tiles and entropy-guided mixed bit widths. Registered as ``tahquant``.

Per tensor of shape ``(..., S, C)`` (channels last; the second-to-last
dimension is the sequence for ``unit=token``), in this order:

1. **Tiles** of ``tile`` = G channels per token (G a power of two); a short last
   tile is padded by repeating the token's last channel and travels whole.
2. **Allocation** on the un-rotated input. For a unit ``u`` (``unit=tile``: a tile,
   ranked within its token, the paper's v2 and the default; ``unit=token``: a
   token, ranked within its sequence, v1 / the public code)
   ``p_k = |a_k| / sum|a|`` and ``H(u) = -sum p_k log p_k`` (natural log,
   ``0 log 0 = 0``, padding excluded). In each group of ``n`` units the
   ``k = floor(ratio * n)`` units of highest entropy get ``high_bits``, the
   others ``low_bits`` (ties broken by ``torch.topk``). ``k`` depends only on the
   shape, so the payload size is fixed, and rounding down means the code bits
   never exceed ``ratio * high_bits + (1 - ratio) * low_bits`` per element: at
   ratio 0.8, 8 tiles per token give 6 high tiles (3.75 code bits/element), 16
   give 12 (3.75), 50 give 40 (3.8); a token of a single tile gets low_bits.
3. **Rotation** (``rotate=true`` and ``tau`` finite): with ``a1 >= a2`` the two
   largest magnitudes of a tile, the tile is an outlier tile when
   ``a1 > tau * a2`` (``r = a1 / a2 > tau``; ``tau=0`` flags every non-zero tile).
   At most ``m = ceil(max_rotated * T)`` tiles of a token's ``T`` are rotated:
   when more qualify, those with the largest ``r`` are rotated and the rest are
   quantized unrotated. A rotated tile has its pivot (argmax |x|) swapped to
   position 0 and is multiplied by the normalized Sylvester Hadamard matrix;
   the decoder applies the Hadamard transform again and swaps back.
   ``max_rotated=1`` rotates every qualifying tile (the reference behaviour).
4. **Asymmetric quantization** of every (rotated) tile with its own width ``b``:
   ``zero <= min``, ``step >= (max - zero) / (2^b - 1)`` stored in the metadata
   ``layout`` (``log`` by default, ``ref`` = fp16 + fp16 as in the reference; see
   :mod:`qwire.codecs.tiles`), ``q = clamp(round((x - zero) / step), 0, 2^b - 1)``
   against the decoded zero and step. ``rounding=stochastic`` is unbiased.

Payload sections, in order (each bit-packed, row-major; all sizes depend only
on the shape and the configuration):

``[layout metadata][alloc: 1 bit per unit][rotflag: 1 bit per tile]``
``[pivot: m slots of log2(G) bits per token][high codes][low codes]``

``alloc`` is left out when every unit has the same width (``k`` is 0 or ``n``);
``rotflag`` and ``pivot`` when rotation is off. Pivot slot ``j`` of a token holds
the pivot of its ``j``-th rotated tile in channel order (unused slots are 0).
``high`` holds the codes of all high-width units in row-major order, ``low`` the
others.

Error bound (nearest rounding): half the decoded step for an unrotated tile;
``sqrt(G)`` times that for a rotated one (the inverse Hadamard adds the per-element
errors of the tile with weights ``1/sqrt(G)``). Stochastic rounding: twice these.

Policy: float32/float16/bfloat16 in, the same dtype out; NaN/Inf raise
:class:`~qwire.codecs.base.NonFiniteError`; an empty tensor has a 0-byte payload.
``unit=token`` processes the whole tensor in one piece (tokens are ranked within
a sequence); ``unit=tile`` works in cache-sized chunks of tokens.
"""

from __future__ import annotations

import functools
import math

import torch

from .base import CodecError, Param
from .hadamard import hadamard_matrix, is_power_of_two, pivot_swap
from .registry import register
from .tiles import (
    DEFAULT_LAYOUT,
    LAYOUTS,
    ROUNDING,
    Field,
    Geometry,
    Sections,
    TileCodec,
    as_rows,
    check_range,
    dequantize,
    load_tiles,
    quantize_,
    sparse_tiles,
    sum_squares,
    store_out,
)

_TINY = torch.finfo(torch.float32).tiny


def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    return _hadamard_cached(n, str(device))


@functools.lru_cache(maxsize=32)
def _hadamard_cached(n: int, device: str) -> torch.Tensor:
    return hadamard_matrix(n, torch.float32, device)


def rotate(tiles: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    """Pivot swap, then the normalized Hadamard transform, of tiles ``(n, G)`` fp32."""
    return pivot_swap(tiles, pivots) @ _hadamard(tiles.shape[-1], tiles.device)


def unrotate(tiles: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate`: the Hadamard transform (its own inverse), then the swap back."""
    return pivot_swap(tiles @ _hadamard(tiles.shape[-1], tiles.device), pivots)


def round_count(ratio: float, n: int) -> int:
    """Number of high-width units among ``n``: ``floor(ratio * n)`` (never more than the ratio)."""
    return min(n, max(0, math.floor(ratio * n + 1e-9)))


def entropy_(a: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of ``p = a / sum(a)`` along the last dim; 0 where ``sum(a) = 0``.

    ``a >= 0``; it is overwritten (zeros become the smallest normal fp32, 1.2e-38, whose
    ``a log a`` is 1e-36: negligible). Uses ``H = log S - sum(a log a) / S``.
    """
    tot = a.sum(dim=-1)
    a.clamp_min_(_TINY)
    x = torch.linalg.vecdot(a, torch.log(a))
    safe = torch.where(tot > 0, tot, torch.ones_like(tot))
    return torch.where(tot > 0, torch.log(safe) - x / safe, torch.zeros_like(tot))


class TAHQuant(TileCodec):
    """TAH-Quant with every knob of the paper and the public code; see the module docstring."""

    name = "tahquant"
    params = (
        Param("tile", int, 32, "channels per tile G, a power of two (64 = the public code)", lo=2, hi=1 << 12),
        Param("high_bits", int, 4, "bit width of the high-entropy units", lo=1, hi=8),
        Param("low_bits", int, 3, "bit width of the other units", lo=1, hi=8),
        Param("ratio", float, 0.8, "fraction rho of units that get high_bits", lo=0.0, hi=1.0),
        Param("tau", float, 2.0, "rotate a tile when |largest| > tau * |second largest| (inf: never)", lo=0.0),
        Param("unit", str, "tile", "allocation unit: tile (paper v2) or token (v1 / public code)",
              choices=("tile", "token")),
        Param("rotate", bool, True, "Hadamard rotation of outlier tiles on/off"),
        Param("max_rotated", float, 0.25, "at most ceil(max_rotated * tiles) rotated tiles per token "
              "(1 = no cap)", lo=1e-9, hi=1.0),
        Param("rounding", str, "nearest", "nearest or stochastic", choices=ROUNDING),
        Param("seed", int, 0, "seed of stochastic rounding", lo=0, hi=(1 << 63) - 1),
        Param("layout", str, DEFAULT_LAYOUT, "metadata layout: " + ", ".join(LAYOUTS), choices=tuple(LAYOUTS)),
    )
    high_bits: int
    low_bits: int
    ratio: float
    tau: float
    unit: str
    rotate: bool
    max_rotated: float
    layout: str

    def _validate(self) -> None:
        if self.low_bits > self.high_bits:
            raise CodecError(
                f"codec 'tahquant': low_bits={self.low_bits} is larger than high_bits={self.high_bits}; "
                "the high-entropy units get high_bits, so choose low_bits <= high_bits"
            )
        if self.rotates and not is_power_of_two(self.tile):
            raise CodecError(
                f"codec 'tahquant': tile={self.tile} must be a power of two (2, 4, ..., 4096) for the "
                "Hadamard rotation; choose e.g. tile=32 or tile=64, or set rotate=false"
            )

    # -- configuration-derived sizes ------------------------------------------------------------
    @property
    def rotates(self) -> bool:
        return bool(self.rotate) and math.isfinite(self.tau)

    def slots(self, g: Geometry) -> int:
        """Rotated tiles (pivot slots) per token."""
        return min(g.tiles, max(1, math.ceil(self.max_rotated * g.tiles - 1e-9)))

    def _units(self, g: Geometry) -> tuple[int, int, int]:
        """(units per group, groups, elements per unit) of the allocation."""
        if self.unit == "tile":
            return g.tiles, g.rows, g.tile
        return g.seq, g.rows // g.seq if g.seq else 0, g.padded

    def sections(self, g: Geometry) -> Sections:
        n, groups, size = self._units(g)
        k = round_count(self.ratio, n)
        fields = list(LAYOUTS[self.layout].fields(g, False))
        if 0 < k < n:
            fields.append(Field("alloc", n * groups, bits=1))
        if self.rotates:
            fields.append(Field("rotflag", g.n_tiles, bits=1))
            fields.append(Field("pivot", g.rows * self.slots(g), bits=int(math.log2(self.tile))))
        fields.append(Field("high", k * groups * size, bits=self.high_bits))
        fields.append(Field("low", (n - k) * groups * size, bits=self.low_bits))
        return Sections(fields)

    # -- encode ----------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        g, sec, payload = self._begin_encode(x)
        if not g.numel:
            return payload
        X = as_rows(x, g)
        gen = self._generator(x.device)
        if self.unit == "token":
            self._encode_chunk(x, X, 0, g.rows, g, sec, payload, gen)
        else:
            rpc = g.chunk_rows(8, x.device)
            for r0 in range(0, g.rows, rpc):
                self._encode_chunk(x, X, r0, min(rpc, g.rows - r0), g, sec, payload, gen)
        return payload

    def _levels(self, high: torch.Tensor | None, k: int) -> torch.Tensor | int:
        lh, ll = (1 << self.high_bits) - 1, (1 << self.low_bits) - 1
        if high is None:
            return lh if k else ll
        return torch.where(high, float(lh), float(ll))

    def _encode_chunk(self, x, X, r0, r, g, sec, payload, gen) -> None:
        t = load_tiles(X[r0: r0 + r], g)  # (r, T, G) fp32, our own copy
        lo, hi = t.amin(dim=-1), t.amax(dim=-1)  # padding repeats a real value: ranges unchanged
        a1 = torch.maximum(hi, -lo)
        check_range(x, a1, self.name)
        sumsq = sum_squares(t)  # for the outlier-tile test (rotated tiles are excluded from it)
        n, _, _ = self._units(g)
        k = round_count(self.ratio, n)
        mixed = 0 < k < n
        a = None
        if mixed or self.rotates:
            a = t.abs()
            if g.padded > g.cols:  # padding takes no part in the entropy or the outlier test
                a[:, -1, g.cols - (g.tiles - 1) * g.tile:] = 0
        # rotation of outlier tiles (in place), decided on the un-rotated input
        if self.rotates:
            flags, slots = self._rotate_(t, a, a1, lo, hi, g)
            sumsq.masked_fill_(flags, math.inf)
            sec.put(payload, "rotflag", r0 * g.tiles, flags)
            sec.put(payload, "pivot", r0 * self.slots(g), slots)
        # allocation, on the un-rotated input
        high = None
        if mixed:
            if self.unit == "tile":
                h = entropy_(a)  # (r, T)
                high = torch.zeros_like(h, dtype=torch.bool).scatter_(1, h.topk(k, dim=1).indices, True)
                sec.put(payload, "alloc", r0 * g.tiles, high)
            else:
                h = entropy_(a.view(r, g.padded)).view(-1, n)  # (sequences, S)
                tok = torch.zeros_like(h, dtype=torch.bool).scatter_(1, h.topk(k, dim=1).indices, True).view(r)
                sec.put(payload, "alloc", r0, tok)
                high = tok.unsqueeze(1).expand(r, g.tiles)
        del a
        # asymmetric quantization with per-tile widths
        levels = self._levels(high, k)
        lv = levels.unsqueeze(-1) if isinstance(levels, torch.Tensor) else levels
        lay = LAYOUTS[self.layout]
        sparse = sparse_tiles(sumsq, lo, hi, levels, g.tile)
        z, s, vals = lay.fit(lo, hi, levels, False, g.anchor_rows, self.name, sparse)
        lay.put(sec, payload, vals, r0, g)
        q = quantize_(t, z.unsqueeze(-1), s.unsqueeze(-1), lv, False, gen)
        if high is None:
            sec.put(payload, "high" if k else "low", r0 * g.padded, q)
        else:
            tile_unit = self.unit == "tile"
            sec.put(payload, "high", r0 * k * g.tile if tile_unit else 0, q[high])
            sec.put(payload, "low", r0 * (g.padded - k * g.tile) if tile_unit else 0, q[~high])

    def _rotate_(self, t: torch.Tensor, a: torch.Tensor, a1: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the chosen outlier tiles of ``t`` in place and update their ``lo``/``hi``.

        A tile is a candidate when ``a1 > tau * a2`` (``a1 >= a2`` its two largest
        magnitudes): for ``tau >= 1`` that is "only the largest reaches ``a1 / tau``" (a tie
        for the largest gives two), tested as ``sum(max(|x| - a1/tau, 0)) <= a1 - a1/tau``.
        Returns (flags (r, T), pivot slots (r, m)).
        """
        r, m, G = t.shape[0], self.slots(g), g.tile
        if self.tau >= 1:  # sum of the excesses over a1 / tau is a1 - a1 / tau iff only the max exceeds
            thr = a1 / self.tau
            excess = (a - thr.unsqueeze(-1)).clamp_(min=0).sum(dim=-1)
            cand = (excess <= a1 - thr) & (a1 > 0)
        else:
            cand = a1 > 0
        av = a.view(-1, G)
        piv = torch.zeros(r * g.tiles, dtype=torch.long, device=t.device)
        if m < g.tiles:  # more candidates than slots: keep those with the largest r = a1 / a2
            ci = cand.view(-1).nonzero().squeeze(1)
            sub = av[ci]
            p = sub.argmax(dim=-1, keepdim=True)
            a2 = sub.scatter_(1, p, 0.0).amax(dim=-1)
            piv[ci] = p.squeeze(1)
            score = torch.full((r * g.tiles,), -1.0, device=t.device)
            score[ci] = a1.view(-1)[ci] / a2.clamp_min(_TINY)
            best = score.view(r, g.tiles).topk(m, dim=1)
            flags = torch.zeros_like(cand).scatter_(1, best.indices, best.values >= 0)
            idx = flags.view(-1).nonzero().squeeze(1)
            p = piv[idx]
        else:
            flags = cand
            idx = flags.view(-1).nonzero().squeeze(1)
            p = av[idx].argmax(dim=-1)
            piv[idx] = p
        if idx.numel():
            tv = t.view(-1, G)
            rot = rotate(tv[idx], p)
            tv[idx] = rot
            lo.view(-1)[idx] = rot.amin(dim=-1)
            hi.view(-1)[idx] = rot.amax(dim=-1)
        order = self._slot_order(flags, m)
        return flags, torch.gather(piv.view(r, g.tiles), 1, order)

    @staticmethod
    def _slot_order(flags: torch.Tensor, m: int) -> torch.Tensor:
        """Per token, the indices of its rotated tiles in channel order, then the others; first m."""
        return torch.sort((~flags).to(torch.uint8), dim=1, stable=True).indices[:, :m]

    # -- decode ----------------------------------------------------------------------------------
    def decode(self, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
        g, sec, out = self._begin_decode(payload, shape, dtype)
        if not g.numel:
            return out
        O = out.view(g.rows, g.cols)
        direct = dtype == torch.float32 and g.padded == g.cols  # decode straight into the output
        rpc = g.rows if self.unit == "token" else g.chunk_rows(8, payload.device)
        for r0 in range(0, g.rows, rpc):
            r = min(rpc, g.rows - r0)
            dst = O[r0: r0 + r].view(r, g.tiles, g.tile) if direct else None
            vals = self._decode_chunk(sec, payload, r0, r, g, dst)
            if not direct:
                store_out(O, r0, vals, g)
        return out

    def _alloc(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry):
        n, _, _ = self._units(g)
        k = round_count(self.ratio, n)
        if "alloc" not in sec:
            return None, k
        if self.unit == "tile":
            return sec.get(payload, "alloc", r0 * g.tiles, r * g.tiles).view(r, g.tiles).bool(), k
        return sec.get(payload, "alloc", r0, r).bool().unsqueeze(1).expand(r, g.tiles), k

    def _rotation(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry):
        """(flat indices of rotated tiles, their pivots) of rows r0 .. r0 + r."""
        m = self.slots(g)
        flags = sec.get(payload, "rotflag", r0 * g.tiles, r * g.tiles).view(r, g.tiles).bool()
        slots = sec.get(payload, "pivot", r0 * m, r * m).view(r, m).long()
        piv = torch.zeros(r, g.tiles, dtype=torch.long, device=payload.device)
        piv.scatter_(1, self._slot_order(flags, m), slots)
        idx = flags.view(-1).nonzero().squeeze(1)
        return idx, piv.view(-1)[idx]

    def _decode_chunk(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        high, k = self._alloc(sec, payload, r0, r, g)
        levels = self._levels(high, k)
        z, s = LAYOUTS[self.layout].read(sec, payload, r0, r, g, False, levels)
        if high is None:
            codes = sec.get(payload, "high" if k else "low", r0 * g.padded, r * g.padded)
            codes = codes.view(r, g.tiles, g.tile)
        else:
            if self.unit == "tile":
                nh = r * k * g.tile
                hstart, lstart = r0 * k * g.tile, r0 * (g.padded - k * g.tile)
            else:  # one chunk: the whole tensor
                nh, hstart, lstart = r // g.seq * k * g.padded, 0, 0
            codes = torch.empty(r, g.tiles, g.tile, dtype=torch.uint8, device=payload.device)
            codes[high] = sec.get(payload, "high", hstart, nh).view(-1, g.tile)
            codes[~high] = sec.get(payload, "low", lstart, r * g.padded - nh).view(-1, g.tile)
        vals = dequantize(codes, z.unsqueeze(-1), s.unsqueeze(-1), None, False, out=out)
        if self.rotates:
            idx, piv = self._rotation(sec, payload, r0, r, g)
            if idx.numel():
                vv = vals.view(-1, g.tile)
                vv[idx] = unrotate(vv[idx], piv)
        return vals

    def _tile_bound(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry) -> torch.Tensor:
        high, k = self._alloc(sec, payload, r0, r, g)
        _, s = LAYOUTS[self.layout].read(sec, payload, r0, r, g, False, self._levels(high, k))
        b = s * (1.0 if self.rounding == "stochastic" else 0.5)
        if self.rotates:
            idx, _ = self._rotation(sec, payload, r0, r, g)
            b.view(-1)[idx] *= math.sqrt(g.tile)
        return b.unsqueeze(-1).expand(r, g.tiles, g.tile)


register("tahquant", TAHQuant)
