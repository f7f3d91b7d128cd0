"""TAH-Quant (arXiv 2506.01352): tile-wise asymmetric quantization with Hadamard
rotation of outlier tiles and mixed bit widths. Registered as ``tahquant``;
``tahquant-paper`` and ``tahquant-public`` are the published configurations (below).

Per tensor of shape ``(..., S, C)`` (channels last; the second-to-last
dimension is the sequence for ``unit=token``), in this order:

1. **Tiles** of ``tile`` = G channels per token (G a power of two); a short last
   tile is padded by repeating the token's last channel and travels whole.
2. **Allocation**. A unit ``u`` is a tile, ranked within its token (``unit=tile``,
   the paper's v2 and the default), or a token, ranked within its sequence
   (``unit=token``, v1 / the public code). In each group of ``n`` units the
   ``k = floor(ratio * n)`` units ranked first get ``high_bits``, the others
   ``low_bits`` (ties: the unit that comes first, see :func:`top_k`). The rank:
   ``alloc=range`` (the default), the unit's range as it is quantized - a tile's
   ``max - min`` after its rotation (step 3), a token's widest tile - since a
   unit's squared error grows with its range squared, the widest units gain
   most from the extra bit; ``alloc=entropy`` (the paper), the entropy of the
   un-rotated input, ``p_k = |a_k| / sum|a|`` and ``H(u) = -sum p_k log p_k``
   (natural log, ``0 log 0 = 0``, padding excluded). ``k`` depends only on the
   shape, so the payload size is fixed, and rounding down means the code bits
   never exceed ``ratio * high_bits + (1 - ratio) * low_bits`` per element: at
   ratio 0.8, 8 tiles per token give 6 high tiles (3.75 code bits/element), 16
   give 12 (3.75), 50 give 40 (3.8); a token of a single tile gets low_bits.
3. **Rotation** (``rotate=true`` and ``tau`` finite): with ``a1 >= a2`` the two
   largest magnitudes of a tile, the tile is an outlier tile when
   ``a1 > tau * a2`` (``r = a1 / a2 > tau``; ``tau=0`` flags every non-zero tile).
   With ``slots=token``, at most ``m = ceil(max_rotated * T)`` tiles of a token's ``T`` are rotated:
   when more qualify, those with the largest ``r`` are rotated (ties: the tile that comes first)
   and the rest are quantized unrotated. A rotated tile has its pivot (argmax |x|) swapped to
   position 0 and is multiplied by the normalized Sylvester Hadamard matrix;
   the decoder applies the Hadamard transform again and swaps back.
   ``max_rotated=1`` rotates every qualifying tile (the reference behaviour).
4. **Asymmetric quantization** of every (rotated) tile with its own width ``b``:
   ``zero <= min``, ``step >= (max - zero) / (2^b - 1)`` stored in the metadata
   ``layout`` (``log7`` by default, ``ref`` = fp16 + fp16 as in the reference; see
   :mod:`qwire.codecs.layouts`), ``q = clamp(round((x - zero) / step), 0, 2^b - 1)``
   against the decoded zero and step. ``rounding=stochastic`` is unbiased.
   **Encoder fit** (``fit=mse``, the default; log layouts, nearest rounding): each
   unrotated tile that is not an outlier tile takes, instead of the covering grid
   above, the grid of lowest squared error among it and a few finer ones centred
   on the tile, whose ends may clip (:meth:`~qwire.codecs.layouts.LogLayout.refine`;
   the format and the decoder are the same). With ``slots=tile`` and ``fit_rotated=true`` (an
   option; see docs/codecs.md for why it is not the default) the rotated tiles' grids are searched
   alike on their two widths
   (:meth:`~qwire.codecs.layouts.LogLayout.refine_blocks`; the rotation keeps a tile's squared
   error); a padded last tile keeps its covering grid. ``fit=minmax`` keeps every grid covering.
   **Zero extension** (log layouts, ``zero_ext`` > 0, rotation on): the pivot swap
   gives a rotated tile a constant offset ``pivot / sqrt(G)``, far outside the
   reach of the step-relative zero code (``k * u * step``, a few tile ranges) when
   the pivot is a massive activation. A rotated tile's ``k`` therefore has
   ``zero_ext`` more (high, signed) bits, sent in its pivot slot: its zero reaches
   ``2^zero_ext`` times farther at the same step-level precision, so the step is
   set by the tile's ordinary elements however large the outlier (``logx`` +
   8 bits: a 15-bit ``k``, 512 tile ranges, outliers up to ~10^4 x the RMS at
   G=32; beyond, the step grows in proportion).

**Pivots in the tile** (``slots=tile``, the default): every candidate tile rotates (no cap). A rotated
tile's metadata is that of one bit less; its first ``G - narrowed`` elements (rotated order) are coded
with its width on half that step, the last ``narrowed = log2(G) + zero_ext`` with one bit less, and the
bits this frees carry its pivot and the high part of its zero code: the tile's ``G * b`` code bits
hold, in stream order, pivot (log2 G bits), zero extension (``zero_ext`` bits, two's complement), the
wide codes, the narrow codes. A rotated tile costs what any tile does, so there are no pivot/zext
sections. ``zero_ext`` is capped at ``G - log2(G)``; every width must be >= 2 bits.

Payload sections, in order (each bit-packed, row-major; all sizes depend only
on the shape and the configuration):

``[layout metadata][alloc: 1 bit per unit][rotflag: 1 bit per tile]``
``[pivot: m slots of log2(G) bits per token][zext: m slots of min(zero_ext, 8) bits per token]``
``[zext_hi: m slots of zero_ext - 8 bits per token][high codes][low codes]``

``alloc`` is left out when every unit has the same width (``k`` is 0 or ``n``);
``pivot`` and ``zext*`` with ``slots=tile``;
``rotflag``, ``pivot`` and ``zext*`` when rotation is off; ``zext*`` with
``layout=ref`` or ``zero_ext=0``, ``zext_hi`` when ``zero_ext <= 8``. Slot ``j``
of a token holds the pivot of its ``j``-th rotated tile in channel order and the
high part of that tile's zero code (``zero_ext``-bit two's complement, its low 8
bits in ``zext``, the rest in ``zext_hi``): the tile's ``k`` is
``zero + 2^zero_bits * ext + kmin`` (see :class:`~qwire.codecs.layouts.LogLayout`).
Unused slots are 0 and ignored by the decoder.
``high`` holds the codes of all high-width units in row-major order, ``low`` the
others.

Error bound (nearest rounding): half the decoded step for an unrotated tile (``fit=mse``:
:meth:`~qwire.codecs.layouts.LogLayout.mse_bound` steps); ``sqrt(G)`` times that of its
elements for a rotated one (the inverse Hadamard adds the per-element errors of the tile with
weights ``1/sqrt(G)``). Stochastic rounding: twice these.

Policy: float32/float16/bfloat16 in, the same dtype out; NaN/Inf raise
:class:`~qwire.codecs.base.NonFiniteError`; an empty tensor has a 0-byte payload;
a payload whose allocation or rotation bits cannot come from this configuration
(a corrupt payload, or a mismatched spec) raises :class:`~qwire.codecs.base.CodecError`.
``unit=token`` processes the whole tensor in one piece (tokens are ranked within
a sequence); ``unit=tile`` works in cache-sized chunks of tokens.
"""

from __future__ import annotations

import math

import torch

from .base import CodecError, Param, as_shape, check_decoded, check_float_dtype, corrupt, div, full_levels
from .hadamard import hadamard_transform, is_power_of_two, pivot_swap
from .kernels import dispatch
from .layouts import EXTENDED_LAYOUTS, LAYOUTS, Layout, LogLayout
from .packing import unpack_bits
from .portable import entropy
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

_TINY = torch.finfo(torch.float32).tiny
# a tile holds two outliers when its second largest magnitude exceeds this many times the RMS of
# the rest (measured: 8 leaves the benchmark's outlier-free and real inputs bit for bit alone; 4
# already changes a few heavy-tailed tiles of the real activations, -0.01 dB)
TWO_OUTLIERS = 8.0
TAH_LAYOUTS = (*LAYOUTS, *EXTENDED_LAYOUTS)
# adapt=block: the layouts of 12 metadata bits per tile it chooses between, and the zero-extension widths
# below the configured one that it tries
ADAPT_LAYOUTS = ("log7", "log6")
ADAPT_WIDTHS = (6, 4, 2, 0)
ADAPT_TIE = 1e-5  # squared errors within this relative margin of the lowest count as a tie (the first wins)


def rotate(tiles: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    """Pivot swap, then the normalized Hadamard transform (the fast butterfly, whose fixed order of
    fp32 operations every implementation repeats), of tiles ``(n, G)`` fp32."""
    return hadamard_transform(pivot_swap(tiles, pivots))


def unrotate(tiles: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate`: the Hadamard transform (its own inverse), then the swap back."""
    return pivot_swap(hadamard_transform(tiles), pivots)


def round_count(ratio: float, n: int) -> int:
    """Number of high-width units among ``n``: ``floor(ratio * n)`` (never more than the ratio)."""
    return min(n, max(0, math.floor(ratio * n + 1e-9)))


def top_k(v: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest values in each row of ``v`` (2-D, no NaN). Among equal values the
    one that comes first wins: the first ``k`` of a stable sort in descending order, so every
    implementation picks the same set (``torch.topk`` leaves ties to its algorithm)."""
    return torch.sort(v, dim=1, descending=True, stable=True).indices[:, :k]


def _bits(v: torch.Tensor, w: int) -> torch.Tensor:
    """The ``w`` low bits of integers ``v`` (...), least significant first: ``(..., w)`` int64."""
    return (v.long().unsqueeze(-1) >> torch.arange(w, device=v.device)) & 1


def _value(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_bits`: the integers whose bits (least significant first) are the last dim."""
    return (bits << torch.arange(bits.shape[-1], device=bits.device)).sum(dim=-1)


def _signed(v: torch.Tensor, bits: int) -> torch.Tensor:
    """``bits``-bit two's complement values ``v`` (non-negative integers) as signed integers."""
    return v - ((v >> (bits - 1)) << bits)


def _by_width(wide_levels: torch.Tensor):
    """Group rotated tiles by width: (their positions in ``wide_levels`` (``2^b - 1`` per tile), ``b``)."""
    for lv in torch.unique(wide_levels).tolist():
        yield (wide_levels == lv).nonzero().squeeze(1), int(lv + 1).bit_length() - 1


def entropy_(a: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of ``p = a / sum(a)`` along the last dim (``a >= 0``); 0 where
    ``sum(a) = 0``. :func:`qwire.codecs.portable.entropy`: pairwise sums and a polynomial
    logarithm (absolute error < 3e-6), so every implementation ranks the units alike."""
    return entropy(a)


class TAHQuant(TileCodec):
    """TAH-Quant with every knob of the paper and the public code; see the module docstring."""

    name = "tahquant"
    params = (
        Param("tile", int, 32, "channels per tile G, a power of two (64 = the public code)", lo=2, hi=1 << 12),
        Param("high_bits", int, 4, "bit width of the units ranked first by alloc", lo=1, hi=8),
        Param("low_bits", int, 3, "bit width of the other units", lo=1, hi=8),
        Param("ratio", float, 1.0, "fraction rho of units that get high_bits", lo=0.0, hi=1.0),
        Param("tau", float, 2.5, "rotate a tile when |largest| > tau * |second largest| (inf: never)", lo=0.0),
        Param("unit", str, "tile", "allocation unit: tile (paper v2) or token (v1 / public code)",
              choices=("tile", "token")),
        Param("alloc", str, "range", "allocation criterion: range (each unit's range as it is quantized, "
              "after the rotation: the widest units, whose error is largest, get high_bits) or entropy (the paper)",
              choices=("entropy", "range")),
        Param("rotate", bool, True, "Hadamard rotation of outlier tiles on/off"),
        Param("max_rotated", float, 0.175, "at most ceil(max_rotated * tiles) rotated tiles per token "
              "(1 = no cap)", lo=1e-9, hi=1.0),
        Param("rounding", str, "nearest", "nearest or stochastic", choices=ROUNDING),
        Param("seed", int, 0, "seed of stochastic rounding", lo=0, hi=(1 << 63) - 1),
        Param("layout", str, "log6t", "metadata layout: " + ", ".join(TAH_LAYOUTS), choices=TAH_LAYOUTS),
        Param("zero_ext", int, 9, "extra zero-code bits of each rotated tile, sent in the tile's own bits "
              "(slots=tile) or in its pivot slot (slots=token) (log layouts; 0 = none; ignored by layout=ref)",
              lo=0, hi=16),
        Param("slots", str, "tile", "where a rotated tile's pivot and zero extension travel: token "
              "(ceil(max_rotated * tiles) slots per token, the paper's format) or tile (in the tile's own code "
              "bits: log2(tile) + zero_ext of its elements are coded one bit narrower; no cap)",
              choices=("token", "tile")),
        Param("fit", str, "mse", FIT_HELP + "; rotated tiles as fit_rotated says", choices=FITS,
              legacy="minmax"),
        Param("fit_rotated", bool, True, "with fit=mse and slots=tile, search the rotated tiles' grids too "
              "(false: they keep their covering grid)", legacy=False),
        Param("zero_width", str, "auto", "with slots=tile: fixed (every rotated tile extends its zero code by "
              "zero_ext bits), block (each block of rows takes the width 0 .. zero_ext of lowest modelled "
              "error for its rotated tiles, named in its anchor's low bits; a layout with anchor tags: log6t) or "
              "auto (block where the layout has anchor tags, else fixed)",
              choices=("auto", "fixed", "block"), legacy="fixed"),
        Param("adapt", str, "none", "block: per block of >= 64K elements the encoder also tries the other 12-bit "
              "log layout (log6 / log7) and narrower zero extensions (6, 4, 2, 0 bits), and sends the "
              "configuration of lowest squared error, a byte per block saying which (slots=tile, layout log6 or "
              "log7; the encoder tries every candidate: about 20x the default's encode time); predict: the same "
              "payload, each block's configuration predicted from one trial encode with log6 and no zero "
              "extension (a second one for the blocks it cannot predict)",
              choices=("none", "block", "predict"),
              legacy="none"),
    )
    high_bits: int
    low_bits: int
    ratio: float
    tau: float
    unit: str
    alloc: str
    rotate: bool
    max_rotated: float
    layout: str
    zero_ext: int
    slots: str
    fit: str
    fit_rotated: bool
    zero_width: str
    adapt: str

    def __new__(cls, **kwargs: object) -> TAHQuant:
        # adapt=block is a container of per-block payloads of this codec's configurations: its own class
        if cls is TAHQuant and str(kwargs.get("adapt", "none")).strip().lower() != "none":
            return super().__new__(AdaptiveTAHQuant)
        return super().__new__(cls)

    def _validate(self) -> None:
        if self.low_bits > self.high_bits:
            raise CodecError(
                f"codec 'tahquant': low_bits={self.low_bits} is larger than high_bits={self.high_bits}; "
                "the units ranked first get high_bits, so choose low_bits <= high_bits"
            )
        if self.rotates and not is_power_of_two(self.tile):
            raise CodecError(
                f"codec 'tahquant': tile={self.tile} must be a power of two (2, 4, ..., 4096) for the "
                "Hadamard rotation; choose e.g. tile=32 or tile=64, or set rotate=false"
            )
        if self.zero_width == "block":
            tags = getattr(self.lay, "tag_bits", 0)
            if not (self.inline and self.extends and tags):
                raise CodecError(
                    "codec 'tahquant': zero_width=block names each block's zero-extension width in its anchor and "
                    "extends the rotated tiles' zero codes in their own bits: it needs a layout with anchor tags "
                    f"(log6t), slots=tile, rotation on and zero_ext > 0; got layout={self.layout}, "
                    f"slots={self.slots}, zero_ext={self.zero_ext}: set those, or zero_width=fixed"
                )
            if self.zero_ext >= 1 << tags:
                raise CodecError(
                    f"codec 'tahquant': with zero_width=block the anchor names widths 0 .. {(1 << tags) - 1}, got "
                    f"zero_ext={self.zero_ext}: lower it"
                )
            if self.adapt != "none":
                raise CodecError(
                    f"codec 'tahquant': adapt={self.adapt} and zero_width=block both choose each block's zero "
                    "extension: use one of them (adapt=none or zero_width=fixed)"
                )
        if self.adapt != "none" and self.unit == "token" and self.ratio < 1:
            raise CodecError(
                "codec 'tahquant': adapt=block codes blocks of rows apart, and unit=token with ratio < 1 ranks the "
                "tokens of a whole sequence: use unit=tile (the default), ratio=1, or adapt=none"
            )
        if self.adapt != "none" and not (self.inline and self.layout in ADAPT_LAYOUTS):
            raise CodecError(
                f"codec 'tahquant': adapt={self.adapt} chooses per block between the layouts "
                f"{' and '.join(ADAPT_LAYOUTS)} and among zero extensions of rotated tiles with slots=tile; got "
                f"layout={self.layout}, slots={self.slots}, rotate={str(self.rotate).lower()}, tau={self.tau!r}: "
                "use layout=log7 (or log6), slots=tile, rotation on, or adapt=none (the default, layout=log6t, "
                "chooses each block's zero extension itself: zero_width)"
            )
        if self.inline:
            narrow = min(self.high_bits, self.low_bits if self.ratio < 1 else self.high_bits)
            if narrow < 2:
                raise CodecError(
                    f"codec 'tahquant': with slots=tile a rotated tile codes some of its elements one bit narrower "
                    f"(their bits carry its pivot and zero extension), so every width must be >= 2 bits; got "
                    f"{'low_bits' if narrow == self.low_bits else 'high_bits'}={narrow}: raise it, or use slots=token"
                )

    # -- configuration-derived sizes ------------------------------------------------------------
    @property
    def rotates(self) -> bool:
        return bool(self.rotate) and math.isfinite(self.tau)

    @property
    def searches(self) -> bool:
        """Whether the encoder searches the tiles' grids (``fit=mse`` where it applies: log layouts,
        nearest rounding; see :func:`~qwire.codecs.tiles.fit_searches`)."""
        return fit_searches(self.fit, self.layout, self.rounding)

    @property
    def searches_rotated(self) -> bool:
        """Whether the encoder also searches the rotated tiles' grids (``fit_rotated``; ``slots=tile`` only,
        whose rotated tiles code two widths: :meth:`~qwire.codecs.layouts.LogLayout.refine_blocks`)."""
        return self.searches and self.inline and self.fit_rotated

    def _at_legacy(self, p: Param) -> bool:
        """``fit_rotated`` makes no difference where the rotated tiles are not searched (``searches_rotated``
        aside from it), ``zero_width`` where it is not per block: the earlier codec's key stays."""
        if p.name == "fit_rotated" and not (self.searches and self.inline):
            return True
        if p.name == "zero_width" and not self.per_block:
            return True
        return super()._at_legacy(p)

    @property
    def inline(self) -> bool:
        """Whether rotated tiles carry their pivot and zero extension in their own codes (``slots=tile``)."""
        return self.rotates and self.slots == "tile"

    @property
    def narrowed(self) -> int:
        """With ``slots=tile``: the elements of a rotated tile coded one bit narrower (its last ones, in
        the rotated order), whose bits hold the pivot and the zero extension."""
        return int(math.log2(self.tile)) + self.ext_bits

    @property
    def per_block(self) -> bool:
        """Whether each block of rows chooses its rotated tiles' zero-extension width (``zero_width=block``, or
        ``auto`` with a layout whose anchors carry tags)."""
        tags = getattr(self.lay, "tag_bits", 0) > 0
        return (self.zero_width == "block" or (self.zero_width == "auto" and tags)) and self.inline and self.extends

    def _width_reach(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The range (kmin, kmax) of the zero code of rotated tiles extended by ``w`` bits (int64 tensor, 0 ..
        :attr:`ext_bits`; 0: the layout's own), fp32, shaped like ``w``."""
        tab = self._reach_table(w.device)
        return tab[w, 0], tab[w, 1]

    def _reach_table(self, device: torch.device) -> torch.Tensor:
        """:meth:`_width_reach` of every width 0 .. :attr:`ext_bits`, as rows (kmin, kmax): contiguous fp32
        ``(ext_bits + 1, 2)``, made once per device."""
        cache = self.__dict__.setdefault("_reach_tables", {})
        tab = cache.get(device)
        if tab is None:
            lay = self.lay
            assert isinstance(lay, LogLayout)
            span = 1 << lay.zero_bits
            ends = [(lay.kmin - span * (1 << v >> 1), lay.kmax + span * ((1 << v >> 1) - 1)) if v else
                    (lay.kmin, lay.kmax) for v in range(self.ext_bits + 1)]
            tab = cache[device] = torch.tensor(ends, dtype=torch.float32, device=device)
        return tab

    def _block_widths(self, flags: torch.Tensor, s: torch.Tensor, k: torch.Tensor, levels: torch.Tensor,
                      g: Geometry, sync_free: bool = False) -> torch.Tensor:
        """``zero_width=block``: per block of the rows, the zero-extension width 0 .. ``zero_ext`` of lowest
        modelled squared error of its rotated tiles (``flags``; their covering steps ``s``, zero codes ``k``
        (fp32, ``kmin`` included) and narrow ``levels``, ``(r, T)``, from a fit that reaches every zero); the
        narrowest within a relative :data:`ADAPT_TIE` of the lowest (so that the rounding of the sums, which
        differs between devices, cannot change the choice of a clear winner). The model: a rotated tile's
        elements err uniformly over their step, ``s'^2 ((G - n) / 4 + n)`` with ``n = log2 G + w`` narrowed
        elements and ``s'`` its step, grown where its zero is beyond the width's reach (as the covering fit grows
        it). On a GPU (or ``sync_free``) every tile takes part (0 where not rotated: no host sync), elsewhere the
        rotated ones (the same sums)."""
        r = flags.shape[0]
        nb = -(-r // g.anchor_rows)
        lay = self.lay
        assert isinstance(lay, LogLayout)
        w = torch.arange(self.ext_bits + 1, device=flags.device)
        kmin, kmax = (v.double() for v in self._width_reach(w))
        if flags.is_cuda or sync_free:
            idx = torch.arange(flags.numel(), device=flags.device)
            sf = torch.where(flags, s, 0.0).reshape(-1)
        else:
            idx = flags.reshape(-1).nonzero().squeeze(1)
            sf = s.reshape(-1)[idx]
        kk = k.reshape(-1)[idx].double().unsqueeze(1)
        L = levels.reshape(-1)[idx].double().unsqueeze(1)
        u = lay.unit(L)
        grow = torch.where(kk < kmin, kk / kmin, torch.where(kk > kmax, (kk * u + L) / (kmax * u + L),
                                                            torch.ones_like(kk)))
        n = (int(math.log2(self.tile)) + w).double()
        e = (sf.double().unsqueeze(1) * grow).square() * ((self.tile - n) / 4 + n)
        tb = idx // g.tiles // g.anchor_rows
        E = torch.zeros(nb, w.numel(), dtype=torch.float64, device=flags.device).index_add_(0, tb, e)
        near = E <= E.amin(dim=1, keepdim=True) * (1.0 + ADAPT_TIE)
        return near.to(torch.uint8).argmax(dim=1)

    def _tile_widths(self, widths: torch.Tensor, r: int, g: Geometry) -> torch.Tensor:
        """Per tile ``(r, T)``: the width of its block of rows (``widths`` per block)."""
        return widths.repeat_interleave(g.anchor_rows)[:r].unsqueeze(1).expand(r, g.tiles)

    def _zero_codes(self, zero: torch.Tensor, ext: torch.Tensor) -> torch.Tensor:
        """The zero codes ``k`` (fp32, ``kmin`` included) of a fit's ``zero`` field and zero-extension high parts."""
        lay = self.lay
        assert isinstance(lay, LogLayout)
        return zero.float() + ext.float() * float(1 << lay.zero_bits) + lay.kmin

    def _block_reach(self, wt: torch.Tensor, flags: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The zero codes' ranges per tile: the reach of its block's width ``wt`` (per tile) where rotated
        (``flags``), ``kmin``/``kmax`` elsewhere: what the fit takes once each block's width is chosen."""
        wmin, wmax = self._width_reach(wt)
        return torch.where(flags, wmin, kmin), torch.where(flags, wmax, kmax)

    @property
    def ext_bits(self) -> int:
        """Zero-extension bits of a rotated tile: ``zero_ext`` (0 without extension); with ``slots=tile``
        at most ``tile - log2(tile)`` (5 at tile=8), what the narrowed elements can hold."""
        if not self.extends:
            return 0
        if self.slots == "tile":
            return min(self.zero_ext, self.tile - int(math.log2(self.tile)))
        return self.zero_ext

    @property
    def lay(self) -> Layout:
        """The metadata layout object."""
        return LAYOUTS[self.layout] if self.layout in LAYOUTS else EXTENDED_LAYOUTS[self.layout]

    @property
    def extends(self) -> bool:
        """Whether rotated tiles carry ``zero_ext`` extra zero-code bits (a log layout, rotation on)."""
        return self.rotates and self.zero_ext > 0 and isinstance(self.lay, LogLayout)

    def _ext_range(self, flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-tile range (kmin, kmax) of the zero code: the layout's own, widened by ``zero_ext``
        high bits for the rotated tiles (``flags``)."""
        lay = self.lay
        kmin, kmax = self._rotated_reach()
        return torch.where(flags, kmin, float(lay.kmin)), torch.where(flags, kmax, float(lay.kmax))

    def _rotated_reach(self) -> tuple[float, float]:
        """The range (kmin, kmax) of a rotated tile's zero code: the layout's own, widened by the zero
        extension's ``ext_bits`` high bits (when it extends)."""
        lay = self.lay
        assert isinstance(lay, LogLayout)
        if not self.extends:
            return float(lay.kmin), float(lay.kmax)
        half = float(1 << (self.ext_bits - 1))
        span = float(1 << lay.zero_bits)
        return lay.kmin - span * half, lay.kmax + span * (half - 1)

    def _ext_fields(self) -> list[tuple[str, int, int]]:
        """(field, bits, shift) of the zero extension: its low 8 bits in ``zext``, the rest in ``zext_hi``."""
        e = self.zero_ext
        return [("zext", min(e, 8), 0)] + ([("zext_hi", e - 8, 8)] if e > 8 else [])

    def slot_count(self, g: Geometry) -> int:
        """Rotated tiles per token: the pivot slots of ``slots=token``; every tile with ``slots=tile``."""
        if self.slots == "tile":
            return g.tiles
        return min(g.tiles, max(1, math.ceil(self.max_rotated * g.tiles - 1e-9)))

    def _units(self, g: Geometry) -> tuple[int, int, int]:
        """(units per group, groups, elements per unit) of the allocation."""
        if self.unit == "tile":
            return g.tiles, g.rows, g.tile
        return g.seq, g.rows // g.seq if g.seq else 0, g.padded

    def sections(self, g: Geometry) -> Sections:
        n, groups, size = self._units(g)
        k = round_count(self.ratio, n)
        fields = list(self.lay.fields(g, False))
        if 0 < k < n:
            fields.append(Field("alloc", n * groups, bits=1))
        if self.rotates:
            fields.append(Field("rotflag", g.n_tiles, bits=1))
        if self.rotates and not self.inline:
            fields.append(Field("pivot", g.rows * self.slot_count(g), bits=int(math.log2(self.tile))))
            if self.extends:
                fields += [Field(name, g.rows * self.slot_count(g), bits=b) for name, b, _ in self._ext_fields()]
        fields.append(Field("high", k * groups * size, bits=self.high_bits))
        fields.append(Field("low", (n - k) * groups * size, bits=self.low_bits))
        return Sections(fields)

    # -- encode ----------------------------------------------------------------------------------
    @dispatch
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
        # padding repeats a real value: ranges unchanged; + 0 turns -0 into +0 (no signed-zero ranges)
        lo, hi = t.amin(dim=-1).add_(0.0), t.amax(dim=-1).add_(0.0)
        a1 = torch.maximum(hi, -lo)
        check_range(x, a1, self.name)
        sumsq = sum_squares(t)  # for the outlier-tile test (rotated tiles are excluded from it)
        n, _, _ = self._units(g)
        k = round_count(self.ratio, n)
        mixed = 0 < k < n
        a = None
        if (mixed and self.alloc == "entropy") or self.rotates:
            a = t.abs()
            if g.padded > g.cols:  # padding takes no part in the entropy or the outlier test
                a[:, -1, g.cols - (g.tiles - 1) * g.tile:] = 0
        # rotation of outlier tiles (in place), decided on the un-rotated input
        flags = order = piv = None
        if self.rotates:
            flags, piv, order = self._rotate_(t, a, a1, lo, hi, g)
            sumsq.masked_fill_(flags, math.inf)
            sec.put(payload, "rotflag", r0 * g.tiles, flags)
            if not self.inline:
                sec.put(payload, "pivot", r0 * self.slot_count(g), torch.gather(piv, 1, order))
        # allocation: entropy of the un-rotated input, or the range of each tile as it is quantized
        high = None
        if mixed:
            if self.alloc == "range":
                crit = self._range_rank(lo, hi)
            else:
                crit = entropy_(a) if self.unit == "tile" else entropy_(a.view(r, g.padded))
            high = self._put_alloc(sec, payload, r0, crit, k, g)
        a2sq = None
        if a is not None and self.extends:  # second largest magnitude, for the outlier-tile test below
            a2sq = a.topk(2, dim=-1).values[..., 1].square_()
        del a
        # asymmetric quantization with per-tile widths (slots=tile: a rotated tile's metadata is that of
        # its narrower width)
        levels = self._levels(high, k)
        if self.inline:
            levels = self._narrow(levels, flags)
        lv = levels.unsqueeze(-1) if isinstance(levels, torch.Tensor) else levels
        lay = self.lay
        sparse = self._outlier_tiles(sumsq, lo, hi, levels, a1, a2sq, g)
        ext = None
        if self.extends:  # rotated tiles: a zero code zero_ext bits wider, its high part in the slot
            kmin, kmax = self._ext_range(flags)
            z, s, vals = lay.fit(lo, hi, levels, False, g.anchor_rows, self.name, sparse, kmin=kmin, kmax=kmax)
            ext = vals.pop("zero_ext")
            if not self.inline:
                self._put_ext(ext, flags, order, sec, payload, r0, g)
        else:
            z, s, vals = lay.fit(lo, hi, levels, False, g.anchor_rows, self.name, sparse)
        widths = wt = None
        if self.per_block:  # each block's zero extension, then the fit again with its reach
            widths = self._block_widths(flags, s, self._zero_codes(vals["zero"], ext), levels, g)
            wt = self._tile_widths(widths, r, g)
            kmin, kmax = self._block_reach(wt, flags, kmin, kmax)
            z, s, vals = lay.fit(lo, hi, levels, False, g.anchor_rows, self.name, sparse, kmin=kmin, kmax=kmax)
            ext = vals.pop("zero_ext")
        if self.searches:  # the unrotated tiles' grids of lowest squared error
            z, s = lay.refine(t, lo, hi, z, s, vals, levels, False, g.anchor_rows, self._searched(flags, sparse))
        if self.searches_rotated:  # and the rotated tiles' (their values are rotated in t)
            self._refine_rotated(t, flags, lo, hi, z, s, vals, ext, levels, g, wt)
        lay.put(sec, payload, vals if widths is None else {**vals, "anchor": lay.tag_anchor(vals["anchor"], widths)},
                r0, g)
        blocks = None
        if self.inline:  # the rotated tiles' blocks, before quantize_ overwrites t
            idx = flags.view(-1).nonzero().squeeze(1)
            if idx.numel():
                blocks = self._rotated_blocks(t.view(-1, g.tile)[idx], idx, z, s, levels, piv, ext, gen,
                                              None if wt is None else wt.reshape(-1)[idx])
        q = quantize_(t, z.unsqueeze(-1), s.unsqueeze(-1), lv, False, gen)
        if blocks is not None:
            q.view(-1, g.tile)[idx] = blocks
        if high is None:
            sec.put(payload, "high" if k else "low", r0 * g.padded, q)
        else:
            tile_unit = self.unit == "tile"
            sec.put(payload, "high", r0 * k * g.tile if tile_unit else 0, q[high])
            sec.put(payload, "low", r0 * (g.padded - k * g.tile) if tile_unit else 0, q[~high])

    @staticmethod
    def _searched(flags: torch.Tensor | None, sparse: torch.Tensor) -> torch.Tensor:
        """The tiles ``fit=mse`` may refit: neither rotated (``flags``) nor outlier tiles (``sparse``: their
        grid passes through 0, and a finer one would clip the outliers)."""
        return ~sparse if flags is None else ~(flags | sparse)

    def _rotate_(self, t: torch.Tensor, a: torch.Tensor, a1: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 g: Geometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotate the chosen outlier tiles of ``t`` in place and update their ``lo``/``hi``.

        A tile is a candidate when ``a1 > tau * a2`` (``a1`` its largest magnitude, at its first
        position, ``a2`` the largest magnitude elsewhere: a tie for the largest gives ``a2 = a1``;
        for ``tau < 1`` every non-zero tile).
        Returns (flags (r, T), the pivot of each tile (r, T), 0 where not rotated, slot order (r, m):
        the tile of each slot).
        """
        r, m, G = t.shape[0], self.slot_count(g), g.tile
        av = a.view(-1, G)
        piv = av.argmax(dim=-1)  # the first largest magnitude
        a2 = av.clone().scatter_(1, piv.unsqueeze(1), 0.0).amax(dim=-1).view(r, g.tiles)
        flags = self._choose_rotated(a1, a2, g)
        idx = flags.view(-1).nonzero().squeeze(1)
        if idx.numel():
            tv = t.view(-1, G)
            rot = rotate(tv[idx], piv[idx])
            tv[idx] = rot
            lo.view(-1)[idx] = rot.amin(dim=-1).add_(0.0)
            hi.view(-1)[idx] = rot.amax(dim=-1).add_(0.0)
        order = self._slot_order(flags, m)
        piv = torch.where(flags.view(-1), piv, 0)  # unused slots hold 0
        return flags, piv.view(r, g.tiles), order

    def _choose_rotated(self, a1: torch.Tensor, a2: torch.Tensor, g: Geometry) -> torch.Tensor:
        """Which tiles rotate (bool (r, T)), from each tile's largest magnitude ``a1`` and the largest
        elsewhere ``a2``: the candidates ``a1 > tau * a2``, at most ``slots`` per token (those with
        the largest ``a1 / a2``)."""
        m = self.slot_count(g)
        cand = (a1 > self.tau * a2) & (a1 > 0) if self.tau >= 1 else a1 > 0
        if m >= g.tiles:
            return cand
        score = torch.where(cand, a1 / a2.clamp_min(_TINY), torch.full_like(a1, -1.0))
        best = top_k(score, m)
        return torch.zeros_like(cand).scatter_(1, best, torch.gather(score, 1, best) >= 0)

    def _range_rank(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """What ``alloc=range`` ranks, from the tiles' ranges as quantized ``(r, T)``: each tile's range
        (tile unit), or each token's largest (token unit, ``(r,)``)."""
        return hi - lo if self.unit == "tile" else (hi - lo).amax(dim=1)

    def _put_alloc(self, sec: Sections, payload: torch.Tensor, r0: int, crit: torch.Tensor, k: int,
                   g: Geometry) -> torch.Tensor:
        """The allocation of rows r0.. from their ranking ``crit`` (per tile ``(r, T)``, or per token ``(r,)``,
        ranked within its sequence): the ``k`` first units of each group get the high width. Writes the
        ``alloc`` bits; returns which tiles are high ``(r, T)``."""
        if self.unit == "tile":
            high = self._top_units(crit, k)
            sec.put(payload, "alloc", r0 * g.tiles, high)
            return high
        r = crit.shape[0]
        tok = self._top_units(crit.view(-1, self._units(g)[0]), k).view(r)  # (sequences, S)
        sec.put(payload, "alloc", r0, tok)
        return tok.unsqueeze(1).expand(r, g.tiles)

    @staticmethod
    def _top_units(h: torch.Tensor, k: int) -> torch.Tensor:
        """The ``k`` units of highest entropy in each row of ``h`` (ties: the unit that comes first)."""
        return torch.zeros_like(h, dtype=torch.bool).scatter_(1, top_k(h, k), True)

    def _outlier_tiles(self, sumsq: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels, a1: torch.Tensor,
                       a2sq: torch.Tensor | None, g: Geometry) -> torch.Tensor:
        """Tiles whose grid should pass through 0 (see :func:`~qwire.codecs.tiles.sparse_tiles`):
        one outlier, or (with ``a2sq``, the squared second largest magnitude) two outliers well above
        the rest. Rotated tiles carry ``sumsq = inf`` and are never chosen."""
        sparse = sparse_tiles(sumsq, lo, hi, levels, g.tile)
        if a2sq is not None:  # a tile with two outliers (not rotated): the same test without both of them
            rest2 = sumsq - a2sq
            ms = div((rest2 - a1 * a1).clamp_(min=0), max(1, g.tile - 2))  # mean square of the rest
            sparse |= sparse_tiles(rest2, lo, hi, levels, g.tile - 1) & (a2sq > TWO_OUTLIERS ** 2 * ms)
        return sparse

    def _put_ext(self, zero_ext: torch.Tensor, flags: torch.Tensor, order: torch.Tensor, sec: Sections,
                 payload: torch.Tensor, r0: int, g: Geometry) -> None:
        """Write the high parts of the rotated tiles' zero codes into their slots."""
        zhi = zero_ext * flags  # 0 for the others (and the unused slots)
        v = torch.gather(zhi, 1, order) & ((1 << self.zero_ext) - 1)  # two's complement, zero_ext bits
        for name, b, shift in self._ext_fields():
            sec.put(payload, name, r0 * self.slot_count(g), (v >> shift) & ((1 << b) - 1))

    @staticmethod
    def _slot_order(flags: torch.Tensor, m: int) -> torch.Tensor:
        """Per token, the indices of its rotated tiles in channel order, then the others; first m."""
        return torch.sort((~flags).to(torch.uint8), dim=1, stable=True).indices[:, :m]

    # -- slots=tile: a rotated tile's block ---------------------------------------------------------
    @staticmethod
    def _narrow(levels: torch.Tensor | int, flags: torch.Tensor) -> torch.Tensor:
        """Per-tile levels ``(r, T)`` with the rotated tiles (``flags``) one bit narrower."""
        lv = full_levels(levels, flags.shape, flags.device)
        return torch.where(flags, (lv + 1.0) * 0.5 - 1.0, lv)

    def _rotated_blocks(self, tr: torch.Tensor, idx: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
                        levels: torch.Tensor, piv: torch.Tensor, ext: torch.Tensor | None,
                        gen: torch.Generator | None, wt: torch.Tensor | None = None) -> torch.Tensor:
        """The codes ``(n, G)`` uint8 of the rotated tiles ``idx`` (flat tile indices; ``tr``: their
        rotated values, fp32, may be overwritten). A rotated tile of width ``b`` (``levels`` ``(r, T)`` holds its
        narrow width's) codes its first ``G - narrowed`` elements with ``b`` bits on half its step, the
        others with ``b - 1`` bits on its step; its block of ``G * b`` bits is, in stream order, the
        pivot (log2 G bits), the high part of the zero code (``zero_ext`` bits, two's complement), the
        wide codes, the narrow codes (read as ``G`` codes of ``b`` bits, it fills the tile's place).
        ``wt``: each tile's zero-extension width (``zero_width=block``; ``log2(G) + wt`` elements narrowed)."""
        G, nw = self.tile, self.tile - self.narrowed
        zf, sf = z.reshape(-1)[idx].unsqueeze(1), s.reshape(-1)[idx].unsqueeze(1)
        nl = levels.reshape(-1)[idx].unsqueeze(1)  # 2^(b-1) - 1
        wl = nl * 2.0 + 1.0  # 2^b - 1
        e = ext.reshape(-1)[idx] if ext is not None else None
        p = piv.reshape(-1)[idx]
        out = torch.empty(idx.numel(), G, dtype=torch.uint8, device=tr.device)
        if wt is not None:  # per width of zero extension, in order
            for w in torch.unique(wt).tolist():
                at = (wt == w).nonzero().squeeze(1)
                nw = G - int(math.log2(G)) - w
                qw = quantize_(tr[at, :nw].contiguous(), zf[at], sf[at] * 0.5, wl[at], False, gen)
                qn = quantize_(tr[at, nw:].contiguous(), zf[at], sf[at], nl[at], False, gen)
                for sel, bits in _by_width(wl[at].squeeze(1)):
                    out[at[sel]] = self._pack_block(p[at][sel], e[at][sel], qw[sel], qn[sel], bits, eb=w)
            return out
        qw = quantize_(tr[:, :nw].contiguous(), zf, sf * 0.5, wl, False, gen)
        qn = quantize_(tr[:, nw:].contiguous(), zf, sf, nl, False, gen)
        for sel, bits in _by_width(wl.squeeze(1)):
            out[sel] = self._pack_block(p[sel], None if e is None else e[sel], qw[sel], qn[sel], bits)
        return out

    def _refine_rotated(self, t: torch.Tensor, flags: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                        z: torch.Tensor, s: torch.Tensor, vals: dict[str, torch.Tensor], ext: torch.Tensor | None,
                        levels: torch.Tensor, g: Geometry, wt: torch.Tensor | None = None) -> None:
        """``fit_rotated``: the grid of lowest squared error of each rotated tile (``flags``; ``t``: their rotated
        values, ``lo``/``hi`` their ranges, ``levels`` ``(r, T)`` their narrow width's), in place in ``z``, ``s``,
        ``vals``' ``scale`` and ``zero`` and the zero codes' high parts ``ext`` (``zero_ext`` > 0). A padded last
        tile keeps the covering grid: the error of its padding, which nobody reads, would steer the search."""
        if g.padded > g.cols:
            flags = flags.clone()
            flags[:, -1] = False
        idx = flags.reshape(-1).nonzero().squeeze(1)
        if not idx.numel():
            return
        lay = self.lay
        assert isinstance(lay, LogLayout)
        r = t.shape[0]
        span = float(1 << lay.zero_bits)
        k0 = vals["zero"].reshape(-1)[idx].float() + lay.kmin
        nw: int | torch.Tensor = self.tile - self.narrowed
        if wt is not None:  # zero_width=block: each tile's block's reach and narrowed elements
            k0 = k0 + ext.reshape(-1)[idx].float() * span
            wi = wt.reshape(-1)[idx]
            kmin, kmax = self._width_reach(wi)
            nw = self.tile - int(math.log2(self.tile)) - wi
        elif ext is not None:
            k0 = k0 + ext.reshape(-1)[idx].float() * span
            kmin, kmax = (v.reshape(-1)[idx] for v in self._ext_range(flags))
        else:
            kmin = torch.full_like(k0, float(lay.kmin))
            kmax = torch.full_like(k0, float(lay.kmax))
        a = lay._per_row(vals["anchor"], r, g.anchor_rows).expand(r, g.tiles).reshape(-1)[idx]
        zc, sc, c, k = lay.refine_blocks(
            t.reshape(-1, g.tile)[idx], lo.reshape(-1)[idx], hi.reshape(-1)[idx], z.reshape(-1)[idx],
            s.reshape(-1)[idx], vals["scale"].reshape(-1)[idx].long(), k0, a, levels.reshape(-1)[idx], kmin, kmax,
            nw)
        z.view(-1)[idx] = zc
        s.view(-1)[idx] = sc
        vals["scale"].view(-1)[idx] = c.to(torch.uint8)
        code = k - lay.kmin
        if ext is not None:
            high = torch.floor(code * (1.0 / span))
            code = code - high * span
            ext.view(-1)[idx] = high.to(ext.dtype)
        vals["zero"].view(-1)[idx] = code.to(torch.uint8)

    def _block_fields(self) -> tuple[int, int]:
        """(pivot bits, zero-extension bits) at the start of a rotated tile's block."""
        return int(math.log2(self.tile)), self.ext_bits

    def _pack_block(self, piv: torch.Tensor, ext: torch.Tensor | None, qw: torch.Tensor, qn: torch.Tensor,
                    b: int, eb: int | None = None) -> torch.Tensor:
        """The blocks of ``n`` rotated tiles of width ``b`` as ``G`` codes of ``b`` bits each ``(n, G)``
        (``eb``: their zero-extension bits, :attr:`ext_bits` when None)."""
        pb, eb0 = self._block_fields()
        eb = eb0 if eb is None else eb
        n = piv.shape[0]
        parts = [_bits(piv, pb)]
        if eb:
            parts.append(_bits(ext & ((1 << eb) - 1), eb))
        parts += [_bits(qw, b).flatten(1), _bits(qn, b - 1).flatten(1)]
        stream = torch.cat(parts, dim=1).view(n, self.tile, b)
        return _value(stream).to(torch.uint8)

    def _unpack_block(self, codes: torch.Tensor, b: int, eb: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`_pack_block`: (pivots, zero-extension high parts or None, wide codes, narrow codes)."""
        pb, eb0 = self._block_fields()
        eb = eb0 if eb is None else eb
        n, G, nn = codes.shape[0], self.tile, pb + eb
        stream = _bits(codes, b).flatten(1)
        piv = _value(stream[:, :pb])
        ext = None
        if eb:
            ext = _signed(_value(stream[:, pb: pb + eb]), eb)
        w0 = pb + eb + (G - nn) * b
        qw = _value(stream[:, pb + eb: w0].reshape(n, G - nn, b))
        qn = _value(stream[:, w0:].reshape(n, nn, b - 1))
        return piv, ext, qw, qn

    def _inline_decode(self, codes: torch.Tensor, flags: torch.Tensor, levels: torch.Tensor,
                       wt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list]:
        """Parse the blocks of the rotated tiles (``flags`` ``(r, T)``; ``levels``: narrowed, ``(r, T)``) of
        ``codes`` ``(r, T, G)``. Returns (their flat indices, pivots, the zero-code high part of every tile
        ``(r, T)`` (0 where not rotated; None without zero extension), per width: (positions among idx,
        wide codes, narrow codes))."""
        idx = flags.reshape(-1).nonzero().squeeze(1)
        piv = torch.zeros(idx.numel(), dtype=torch.long, device=codes.device)
        ext = torch.zeros(flags.shape, dtype=torch.long, device=codes.device) if self.extends else None
        parts = []
        cv = codes.reshape(-1, self.tile)
        wi = None if wt is None else wt.reshape(-1)[idx]  # zero_width=block: each block's width
        for sel, bits in _by_width(levels.reshape(-1)[idx] * 2.0 + 1.0):
            groups = [(sel, None)] if wi is None else \
                [(sel[wi[sel] == w], w) for w in torch.unique(wi[sel]).tolist()]
            for at, w in groups:
                p, e, qw, qn = self._unpack_block(cv[idx[at]], bits, w)
                piv[at] = p
                if ext is not None and e is not None:
                    ext.view(-1)[idx[at]] = e
                parts.append((at, qw, qn))
        return idx, piv, ext, parts

    def _block_places(self, sec: Sections, g: Geometry, idx: torch.Tensor, hmask: torch.Tensor, mixed: bool
                      ) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """Where the rotated tiles ``idx`` (flat) sit in the code streams (``hmask`` ``(R, T)``: which tiles
        are in the high one): per width ``b``, (their positions among ``idx``, ``b``, the byte offset of
        each one's block in the payload). For the kernels, which write whole streams (G >= 8: blocks are
        whole bytes)."""
        G = g.tile
        hflat = hmask.reshape(-1)
        hi = hflat[idx]
        if mixed:  # a tile's index in its stream: the tiles of the same width before it
            before = torch.where(hi, torch.cumsum(hflat, 0)[idx] - 1, torch.cumsum(~hflat, 0)[idx] - 1)
        else:
            before = idx
        out = []
        for stream, b, sel in (("high", self.high_bits, hi), ("low", self.low_bits, ~hi)):
            pos = sel.nonzero().squeeze(1)
            if pos.numel():
                out.append((pos, b, sec.offsets[stream] + before[pos] * (G * b // 8)))
        return out

    def _block_bytes(self, sec: Sections, g: Geometry, idx: torch.Tensor, hmask: torch.Tensor, mixed: bool,
                     nbytes: int | None = None) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """:meth:`_block_places` with the payload index of every byte of each block ``(n, bytes)`` (the first
        ``nbytes`` of each when given)."""
        out = []
        for pos, b, start in self._block_places(sec, g, idx, hmask, mixed):
            n = g.tile * b // 8 if nbytes is None else nbytes
            out.append((pos, b, start.unsqueeze(1) + torch.arange(n, device=start.device)))
        return out

    def _block_heads(self, sec: Sections, payload: torch.Tensor, g: Geometry, idx: torch.Tensor,
                     hmask: torch.Tensor, mixed: bool, eb: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The pivots and zero-code high parts (two's complement) at the head of the rotated tiles' blocks
        (``eb`` bits of it: :attr:`ext_bits` when None)."""
        pb, eb0 = self._block_fields()
        eb = eb0 if eb is None else eb
        nbytes = -(-(pb + eb) // 8)
        piv = torch.zeros(idx.numel(), dtype=torch.int64, device=payload.device)
        ext = torch.zeros(idx.numel(), dtype=torch.int64, device=payload.device)
        for pos, _, at in self._block_bytes(sec, g, idx, hmask, mixed, nbytes):
            v = (payload[at].long() << (8 * torch.arange(nbytes, device=payload.device))).sum(dim=1)
            piv[pos] = v & ((1 << pb) - 1)
            if eb:
                ext[pos] = _signed((v >> pb) & ((1 << eb) - 1), eb)
        return piv, ext

    def _inline_values(self, vals: torch.Tensor, idx: torch.Tensor, parts: list, z: torch.Tensor,
                       s: torch.Tensor) -> None:
        """Write the (still rotated) values of the rotated tiles into ``vals`` ``(r, T, G)``: ``z + q * s / 2``
        for the wide codes, ``z + q * s`` for the narrow ones."""
        vv = vals.view(-1, self.tile)
        zf, sf = z.reshape(-1)[idx].unsqueeze(1), s.reshape(-1)[idx].unsqueeze(1)
        for sel, qw, qn in parts:
            nw = qw.shape[1]  # the wide codes (with zero_width=block, per block)
            i = idx[sel]
            vv[i, :nw] = dequantize(qw.to(torch.uint8), zf[sel], sf[sel] * 0.5, None, False)
            vv[i, nw:] = dequantize(qn.to(torch.uint8), zf[sel], sf[sel], None, False)

    @dispatch
    def read_fields(self, payload: torch.Tensor, shape, names: tuple[str, ...]) -> list[torch.Tensor]:
        """The values of fields ``names`` of this configuration's payload for a tensor of ``shape``, each field
        whole (:meth:`Sections.get`; the CPU kernels unpack them compiled): what ``adapt=predict`` reads."""
        sec = self._layout(as_shape(shape))[1]
        return [sec.get(payload, n, 0, sec.fields[n].count) for n in names]

    # -- decode ----------------------------------------------------------------------------------
    @dispatch
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
            high = sec.get(payload, "alloc", r0 * g.tiles, r * g.tiles).view(r, g.tiles).bool()
            self._check_count(high, k, "high-width tiles per token")
            return high, k
        tok = sec.get(payload, "alloc", r0, r).bool()
        self._check_count(tok.view(-1, n), k, "high-width tokens per sequence")
        return tok.unsqueeze(1).expand(r, g.tiles), k

    def _check_count(self, bits: torch.Tensor, k: int, what: str, exact: bool = True) -> None:
        """A payload from a matching encoder has exactly (at most) ``k`` set bits per row of ``bits``."""
        cnt = bits.sum(dim=1)
        if bool(((cnt != k) if exact else (cnt > k)).any()):
            raise CodecError(f"codec {self.name!r}: corrupt payload or a codec configuration that does not "
                             f"match the sender's: {int(cnt.max())} {what}, expected "
                             f"{'' if exact else 'at most '}{k} (compare codec.spec() on both sides)")

    def _rotation(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry):
        """(flat indices of rotated tiles, their pivots, zero-code high parts ``(r, T)`` or None)
        of rows r0 .. r0 + r."""
        m = self.slot_count(g)
        flags = self._flags(sec, payload, r0, r, g)
        self._check_count(flags, m, "rotated tiles per token", exact=False)
        slots = sec.get(payload, "pivot", r0 * m, r * m).view(r, m).long()
        order = self._slot_order(flags, m)
        piv = torch.zeros(r, g.tiles, dtype=torch.long, device=payload.device)
        piv.scatter_(1, order, slots)
        idx = flags.view(-1).nonzero().squeeze(1)
        ext = None
        if self.extends:  # two's complement zero_ext-bit values; unused slots are ignored
            e = torch.zeros(r, m, dtype=torch.long, device=payload.device)
            for name, _, shift in self._ext_fields():
                e |= sec.get(payload, name, r0 * m, r * m).view(r, m).long() << shift
            e = _signed(e, self.zero_ext)
            ext = torch.zeros(r, g.tiles, dtype=torch.long, device=payload.device).scatter_(1, order, e) * flags
        return idx, piv.view(-1)[idx], ext

    def _decode_chunk(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        high, k = self._alloc(sec, payload, r0, r, g)
        levels = self._levels(high, k)
        codes = self._codes(sec, payload, r0, r, g, high, k)
        idx = piv = ext = parts = None
        bound_levels = levels
        if self.inline:
            flags = self._flags(sec, payload, r0, r, g)
            levels = self._narrow(levels, flags)
            wt = self._read_widths(sec, payload, r0, r, g) if self.per_block else None
            idx, piv, ext, parts = self._inline_decode(codes, flags, levels, wt)
            bound_levels = torch.where(flags, levels + 0.5, levels)  # the wide codes reach (2^b - 1) * s / 2
        elif self.rotates:
            idx, piv, ext = self._rotation(sec, payload, r0, r, g)
        if ext is not None:
            z, s = self.lay.read(sec, payload, r0, r, g, False, levels, zero_ext=ext)
        else:
            z, s = self.lay.read(sec, payload, r0, r, g, False, levels)
        vals = dequantize(codes, z.unsqueeze(-1), s.unsqueeze(-1), None, False, out=out)
        if parts:
            self._inline_values(vals, idx, parts, z, s)
        rotated = idx is not None and idx.numel() > 0
        if rotated:
            vv = vals.view(-1, g.tile)
            vv[idx] = unrotate(vv[idx], piv)
        check_decoded(vals, values_bound(z, s, bound_levels, g.tile if rotated else 1), self.name)
        return vals

    def _codes(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry,
               high: torch.Tensor | None, k: int) -> torch.Tensor:
        """The codes of rows r0 .. r0 + r, ``(r, T, G)`` uint8, from the high and low streams."""
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
        return codes

    def _anchor_widths(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry,
                       check: bool = True, tags: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``zero_width=block``: per block of rows r0 .. r0 + r, its zero-extension width (its anchor's tag),
        clamped to :attr:`ext_bits`, and whether one was larger (a one-element bool tensor). With ``check``, a
        larger one raises :class:`CodecError` (corrupt payload) here, reading the tags back; the GPU kernels
        instead decode such a payload to NaN, which their check of the values reports, with no read back.
        ``tags``: those blocks' tags, when the caller has read the anchors already."""
        ar = g.anchor_rows
        if tags is None:
            tags = self.lay.split_anchor(sec.get(payload, "anchor", r0 // ar, -(-r // ar)))[1]
        most = self.ext_bits
        bad = (tags > most).any().reshape(1)
        if check and bool(bad):
            raise corrupt(self.name, f"a block names a zero extension of {int(tags.max())} bits, at most {most} "
                          f"with zero_ext={self.zero_ext}")
        return tags.clamp(max=most), bad

    def _read_widths(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry) -> torch.Tensor:
        """``zero_width=block``: per tile of rows r0 .. r0 + r, its block's zero-extension width."""
        return self._tile_widths(self._anchor_widths(sec, payload, r0, r, g)[0], r, g)

    @staticmethod
    def _flags(sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry) -> torch.Tensor:
        """The rotation flags of rows r0 .. r0 + r, ``(r, T)`` bool."""
        return sec.get(payload, "rotflag", r0 * g.tiles, r * g.tiles).view(r, g.tiles).bool()

    def _tile_bound(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry) -> torch.Tensor:
        high, k = self._alloc(sec, payload, r0, r, g)
        levels = self._levels(high, k)
        if self.inline:
            flags = self._flags(sec, payload, r0, r, g)
            levels = self._narrow(levels, flags)
            idx = flags.reshape(-1).nonzero().squeeze(1)
        elif self.rotates:
            idx, _, _ = self._rotation(sec, payload, r0, r, g)
        _, s = self.lay.read(sec, payload, r0, r, g, False, levels)
        half = 1.0 if self.rounding == "stochastic" else 0.5
        codes = None  # a tapered layout's bound depends on the step code
        if self.searches and getattr(self.lay, "tapered", False):
            codes = sec.get(payload, "scale", r0 * g.tiles, r * g.tiles).view(r, g.tiles).long()
        if self.searches:  # unrotated tiles may clip (see LogLayout.mse_bound)
            lv = full_levels(levels, s.shape, s.device)
            b = s * self.lay.mse_bound(lv, codes)
        else:
            b = s * half
        if self.rotates:  # sqrt(G) times a rotated element's bound (the inverse Hadamard sums them)
            per = half
            if self.searches_rotated:
                per = self.lay.mse_bound(full_levels(levels, s.shape, s.device).view(-1)[idx],
                                         None if codes is None else codes.view(-1)[idx])
            b.view(-1)[idx] = s.view(-1)[idx] * per * math.sqrt(g.tile)
        return b.unsqueeze(-1).expand(r, g.tiles, g.tile)


class AdaptiveTAHQuant(TAHQuant):
    """``tahquant:adapt=block`` and ``adapt=predict``: each of the tensor's blocks of rows (the log layouts' anchor
    blocks, >= 64K elements) coded by one of :attr:`candidates`: this configuration with ``adapt=none``, its
    ``layout`` and then the other of :data:`ADAPT_LAYOUTS`, each with ``zero_ext`` and the narrower widths of
    :data:`ADAPT_WIDTHS`.

    - ``block`` (measured): a block takes the first candidate whose squared error on it
      (``(x - decode(encode(x)))^2`` summed over each row in fp32, the rows in fp64) is within a relative
      :data:`ADAPT_TIE` of the lowest, so that the rounding of the sums, which differs between devices, cannot
      change the choice of a clear winner. Every candidate encodes and decodes the whole tensor once.
    - ``predict``: the same choice from a model of the error read off a trial encode with ``log6`` and no zero
      extension, which is the payload where every block keeps it, and for the blocks it cannot predict a
      second one at the configured width (:meth:`_predicted`); 1.6x the default's codec time in the Quickstart's
      run, up to 6.4x its encode time on outlier-heavy input, against 20x for ``block`` (docs/codecs.md). Its
      payload is that of ``block`` (the decoder is the same).

    Payload: ``[candidate index: 1 byte per block]``, then for each candidate in order, where blocks chose it,
    its payload of those blocks' rows (in order, as one tensor), then zeros up to the size of the shape: the
    blocks' largest candidate payloads added up. Every candidate codes 12 bits of metadata per tile and a
    rotated tile in the size of the others, so their payloads differ at most by their sections' rounding to
    whole bytes, and the rows of several blocks never take more than those blocks alone. Every block is coded
    as it would be alone (its own anchor; each tile's fit is its own), so a candidate's error on a block is
    the same in the trial encode of the whole tensor and in the payload.

    Narrow extensions code more of a rotated tile's elements at the full width (``tile - log2(tile) -
    width`` of them) where its zero stays within their reach (outliers up to ~30x the RMS at width 0, ~10^4x
    at 9); ``log6`` gives a finer zero than ``log7`` where a block's steps span under 7.9 octaves."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        cfg = {**self.config, "adapt": "none"}
        layouts = (self.layout, *(lay for lay in ADAPT_LAYOUTS if lay != self.layout))
        widths = (self.zero_ext, *(w for w in ADAPT_WIDTHS if w < self.zero_ext))
        self.candidates = [TAHQuant(**{**cfg, "layout": lay, "zero_ext": w}, impl=self.impl)
                           for lay in layouts for w in widths]

    def _blocks(self, shape) -> tuple[Geometry, int, int]:
        """The geometry, the number of blocks and the payload's size (0 for an empty tensor)."""
        g = self._layout(shape)[0]
        if not g.numel:
            return g, 0, 0
        full, last = divmod(g.rows, g.anchor_rows)
        size = full + bool(last)
        for r, n in ((g.anchor_rows, full), (last, 1 if last else 0)):
            if n:
                size += n * max(c.payload_nbytes((r, g.cols), torch.float32) for c in self.candidates)
        return g, full + bool(last), size

    def payload_nbytes(self, shape, dtype: torch.dtype) -> int:
        check_float_dtype(dtype, self.name)
        return self._blocks(shape)[2]

    def _groups(self, choice: list[int], g: Geometry, device: torch.device):
        """Per candidate that some block chose: (its index, the row indices of those blocks, in order)."""
        rows = torch.arange(g.rows, device=device)
        block = rows // g.anchor_rows
        pick = torch.tensor(choice, device=device)[block]
        return [(i, rows[pick == i]) for i in sorted(set(choice))]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        g = self._begin_encode(x)[0]  # (its payload is that of one configuration)
        _, nb, size = self._blocks(x.shape)
        payload = torch.zeros(size, dtype=torch.uint8, device=x.device)
        if not g.numel:
            return payload
        X = as_rows(x, g)
        block = torch.arange(g.rows, device=x.device) // g.anchor_rows
        if self.adapt == "predict":
            choice, trials = self._predicted(X, g, nb, block)
        else:
            choice, trials = self._measured(X, g, nb, block), {}
        payload[:nb] = choice.to(torch.uint8)
        off = nb
        for i, rows in self._groups(choice.tolist(), g, x.device):
            trial = trials.get(i)  # a trial of this configuration on exactly these rows is their payload
            if trial is not None and trial[1].numel() == rows.numel() and bool((trial[1] == rows).all()):
                p = trial[0]
            else:
                p = self.candidates[i].encode(X if rows.numel() == g.rows else X[rows])
            payload[off: off + p.numel()] = p
            off += p.numel()
        return payload

    @staticmethod
    def _first_lowest(E: torch.Tensor) -> torch.Tensor:
        """Per column of ``E`` (options, blocks): the first option within a relative :data:`ADAPT_TIE` of the
        lowest."""
        near = E <= E.amin(dim=0) * (1.0 + ADAPT_TIE)
        return near.to(torch.uint8).argmax(dim=0)

    def _measured(self, X: torch.Tensor, g: Geometry, nb: int, block: torch.Tensor) -> torch.Tensor:
        """``adapt=block``: each candidate's squared error per block, from one trial of the whole tensor; the
        index of the first of lowest error per block."""
        Xf = X.float()
        errs: list[torch.Tensor] = []
        rotated = True
        for c in self.candidates:
            if not rotated and c.zero_ext != self.zero_ext:  # no tile rotates: every width codes the same
                errs.append(errs[-1])
                continue
            p = c.encode(X)
            if c is self.candidates[0]:
                gc, sec = c._layout(X.shape)
                rotated = bool(c._flags(sec, p, 0, gc.rows, gc).any())
            d = Xf - c.decode(p, X.shape, X.dtype).float()
            row = torch.linalg.vecdot(d, d).double()  # rows summed in fp32, blocks in fp64
            errs.append(torch.zeros(nb, dtype=torch.float64, device=X.device).index_add_(0, block, row))
        return self._first_lowest(torch.stack(errs))  # (candidates, blocks) -> blocks

    def _predicted(self, X: torch.Tensor, g: Geometry, nb: int, block: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """``adapt=predict``: per block, the index of the candidate of lowest predicted error.

        A first trial encodes the whole tensor with ``log6`` and no zero extension; its payload predicts each
        width's error for the blocks it can (:meth:`_from_narrow`), which take the width of lowest prediction
        (the narrowest of a tie). The rest - a block with a rotated tile whose zero that trial clamped and
        whose step it grew more than twofold, or with a tile at ``log6``'s smallest step (its steps may span
        more than ``log6``'s 7.9 octaves) - are tried again with ``log6`` at the configured width, whose zero
        codes and steps predict each width's error (:meth:`_estimates`), and, where a block has a tile at
        ``log6``'s smallest step, with ``log7``, which that block takes where its prediction is lower.
        Returns the indices and, per candidate tried, (its payload, the rows it coded)."""
        six = [i for i, c in enumerate(self.candidates) if c.layout == "log6"]  # configured width first
        rows = torch.arange(g.rows, device=X.device)
        p0 = self.candidates[six[-1]].encode(X)
        trials = {six[-1]: (p0, rows)}
        E, unsure = self._from_narrow(six, p0, g, nb, block)
        narrow_first = torch.tensor(six[::-1], device=X.device)
        choice = narrow_first[self._first_lowest(E.flip(0))]
        if not bool(unsure.any()):
            return choice, trials
        sub = unsure[block]  # those blocks' rows, coded as a tensor of their own (each block as it would be alone)
        Xs, rs = X[sub], rows[sub]
        gs = self._layout(Xs.shape)[0]
        bs = torch.arange(gs.rows, device=X.device) // gs.anchor_rows
        best = picks = edge6 = None
        for lay in ("log6", "log7"):
            ids = [i for i, c in enumerate(self.candidates) if c.layout == lay]  # its configured width first
            p = self.candidates[ids[0]].encode(Xs)
            trials[ids[0]] = (p, rs)
            E, unrotated, edge = self._estimates(ids, p, gs, gs.n_blocks, bs)
            w = self._first_lowest(E)
            pred = E.gather(0, w.unsqueeze(0)).squeeze(0) + unrotated
            pick = torch.tensor(ids, device=X.device)[w]
            if best is None:
                best, picks, edge6 = pred, pick, edge
                if not bool(edge.any()):
                    break
            else:
                picks = torch.where(edge6 & (pred < best), pick, picks)
        choice[unsure] = picks
        return choice, trials

    def _from_narrow(self, six: list[int], p: torch.Tensor, g: Geometry, nb: int, block: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted squared errors ``(len(six), nb)`` of the rotated tiles under each ``log6`` width ``six``
        (as :meth:`_estimates`), from ``p``, the payload of the narrowest (no zero extension) for the whole
        tensor, and which blocks it cannot predict ``(nb,)``. A rotated tile whose zero code is within that
        width's reach has the same grid at every width. One whose zero is at an end of it may have been clamped
        there, its step grown to reach: its codes' span gives the step its range needs, ``s0 = span s / (L - u)``,
        and its lowest code the zero ``k0`` that step would take; a step grown more than twofold (the codes then
        tell little of the range) leaves its block unpredicted, as does a tile at ``log6``'s smallest step."""
        c = self.candidates[six[-1]]
        lay = c.lay
        assert isinstance(lay, LogLayout) and not c.extends
        sec, flags, high, k, levels, steps, zero, edge = self._trial_fields(c, p, g, nb, block)
        unsure = edge.long()
        idx = flags.view(-1).nonzero().squeeze(1)
        if not idx.numel():
            return torch.zeros(len(six), nb, dtype=torch.float64, device=p.device), edge
        s = steps.view(-1)[idx]
        kk = (zero.view(-1)[idx] + lay.kmin).double()
        L = levels.reshape(-1)[idx].double()
        u, tb = lay.unit(L), block[idx // g.tiles]
        s0, k0 = s.clone(), kk.clone()
        ci = ((kk <= lay.kmin) | (kk >= lay.kmax)).nonzero().squeeze(1)
        if ci.numel():
            span = self._code_span(c, sec, p, g, idx[ci], high, k)
            if span is None:  # blocks whose codes are not whole bytes: tried again
                unsure.index_add_(0, tb[ci], torch.ones_like(tb[ci]))
            else:
                lo_h, hi_h = span
                sc, Lc, uc = s[ci], L[ci], u[ci]
                need = sc * ((hi_h - lo_h) * 0.5).clamp(min=1.0) / (Lc - uc)
                unsure.index_add_(0, tb[ci], (sc > 2.0 * need).long())
                s0[ci] = need
                k0[ci] = torch.floor((kk[ci] * uc * sc + lo_h * 0.5 * sc) / (uc * need))
        # the trial's own width: its grids as they are
        return self._width_errors(six, s0, k0, u, L, tb, nb, own=(six[-1], s)), unsure > 0

    @staticmethod
    def _code_span(c: TAHQuant, sec: Sections, p: torch.Tensor, g: Geometry, tiles: torch.Tensor,
                   high: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The lowest and highest code of each rotated tile ``tiles`` (flat indices) of payload ``p``, in half
        steps (its wide codes are on half the step); None where a tile's block is not whole bytes."""
        if any(c.tile * b % 8 for b in (c.high_bits, c.low_bits)):
            return None
        hmask = high if high is not None else torch.full((g.rows, g.tiles), k > 0, device=p.device)
        lo = torch.zeros(tiles.numel(), dtype=torch.float64, device=p.device)
        hi = torch.zeros_like(lo)
        for pos, b, at in c._block_bytes(sec, g, tiles, hmask, high is not None):
            vals = unpack_bits(p[at].reshape(-1), b, pos.numel() * c.tile).view(-1, c.tile).long()
            _, _, qw, qn = c._unpack_block(vals, b)
            h = torch.cat([qw, qn * 2], dim=1).double()
            lo[pos], hi[pos] = h.amin(dim=1), h.amax(dim=1)
        return lo, hi

    def _estimates(self, ids: list[int], p: torch.Tensor, g: Geometry, nb: int, block: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Predicted squared errors per block (fp64, in units of 1/12) from ``p``, the payload of
        ``candidates[ids[0]]`` for the whole tensor, for the candidates ``ids`` (one layout, its zero-extension
        widths), modelling an element's error as uniform over its step:

        - ``(len(ids), nb)``: the rotated tiles under each width: ``s'^2 ((G - n) / 4 + n)`` per tile, with
          ``n`` the width's narrowed elements (the others code on half the step ``s``) and ``s'`` the tile's
          step ``s``, grown where its zero code ``k`` is beyond the width's reach (below ``kmin``: by
          ``k / kmin``; above ``kmax``: by ``(k u + L) / (kmax u + L)``, what the covering fit would need);
        - ``(nb,)``: the other tiles, ``G s^2`` each;
        - ``(nb,)`` bool: whether a tile of the block is at the layout's smallest step (its range may be short).
        """
        c = self.candidates[ids[0]]
        lay = c.lay
        assert isinstance(lay, LogLayout)
        sec, flags, high, k, levels, s, zero, edge = self._trial_fields(c, p, g, nb, block)
        unrotated = torch.zeros(nb, dtype=torch.float64, device=p.device).index_add_(
            0, block, (s.square() * c.tile).masked_fill_(flags, 0.0).sum(dim=1))
        idx = flags.view(-1).nonzero().squeeze(1)
        if not idx.numel():
            return torch.zeros(len(ids), nb, dtype=torch.float64, device=p.device), unrotated, edge
        hmask = high if high is not None else torch.full_like(flags, k > 0)
        ext = c._block_heads(sec, p, g, idx, hmask, high is not None)[1]
        kk = (zero.view(-1)[idx] + ext * (1 << lay.zero_bits) + lay.kmin).double()
        L = levels.reshape(-1)[idx].double()
        return self._width_errors(ids, s.view(-1)[idx], kk, lay.unit(L), L, block[idx // g.tiles], nb), \
            unrotated, edge

    @staticmethod
    def _trial_fields(c: TAHQuant, p: torch.Tensor, g: Geometry, nb: int, block: torch.Tensor):
        """What a trial payload ``p`` of candidate ``c`` for the whole tensor says, per tile ``(R, T)``: (its
        sections, the rotation flags, the allocation (``high``, ``k`` of :meth:`_alloc`), the levels (rotated
        tiles one bit narrower), the decoded steps (fp64, as :meth:`LogLayout.read`), the zero codes' fields
        (int64)), and per block ``(nb,)`` whether a tile is at the layout's smallest step."""
        lay = c.lay
        assert isinstance(lay, LogLayout)
        sec = c._layout((g.rows, g.cols))[1]
        code, zero, rotflag = c.read_fields(p, (g.rows, g.cols), ("scale", "zero", "rotflag"))
        flags = rotflag.view(g.rows, g.tiles).bool()
        code = code.view(g.rows, g.tiles).long()
        high, k = c._alloc(sec, p, 0, g.rows, g)
        levels = c._narrow(c._levels(high, k), flags)
        anchor = sec.get(p, "anchor", 0, g.n_blocks)
        steps = (anchor[block].unsqueeze(1) * lay.read_table(p.device)[code]).double()
        edge = torch.zeros(nb, dtype=torch.int64, device=p.device).index_add_(
            0, block, (code == lay.zero_code - 1).sum(dim=1)) > 0
        return sec, flags, high, k, levels, steps, zero.view(g.rows, g.tiles).long(), edge

    def _width_errors(self, ids: list[int], s: torch.Tensor, k: torch.Tensor, u: torch.Tensor, L: torch.Tensor,
                      tb: torch.Tensor, nb: int, own: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
        """The model's squared errors ``(len(ids), nb)`` of rotated tiles (steps ``s`` and zero codes ``k`` of a
        covering fit that reaches them, units ``u``, levels ``L``, blocks ``tb``) coded by each candidate
        ``ids``: ``s'^2 ((G - n) / 4 + n)``, ``s'`` = ``s`` grown where ``k`` is beyond the candidate's reach;
        ``own`` = (a candidate, its steps as they are) for the trial's own width."""
        E = torch.zeros(len(ids), nb, dtype=torch.float64, device=s.device)
        for n, i in enumerate(ids):
            cw = self.candidates[i]
            if own is not None and i == own[0]:
                sw = own[1]
            else:
                kmin, kmax = cw._rotated_reach()
                sw = s * torch.where(k < kmin, k / kmin,
                                     torch.where(k > kmax, (k * u + L) / (kmax * u + L), torch.ones_like(k)))
            nn = cw.narrowed
            E[n].index_add_(0, tb, sw.square() * ((cw.tile - nn) / 4 + nn))
        return E

    def _parts(self, payload: torch.Tensor, shape, dtype: torch.dtype):
        """The geometry and, per candidate some block chose, (its codec, the rows, its payload)."""
        shape = as_shape(shape)
        check_float_dtype(dtype, self.name)
        self.check_payload(payload, shape, dtype)
        g, nb, _ = self._blocks(shape)
        if not g.numel:
            return g, []
        choice = payload[:nb].tolist()
        if max(choice) >= len(self.candidates):
            raise corrupt(self.name, f"a block names configuration {max(choice)}, of {len(self.candidates)}")
        parts, off = [], nb
        for i, rows in self._groups(choice, g, payload.device):
            c = self.candidates[i]
            n = c.payload_nbytes((rows.numel(), g.cols), dtype)
            parts.append((c, rows, payload[off: off + n]))
            off += n
        return g, parts

    def decode(self, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
        g, parts = self._parts(payload, shape, dtype)
        if len(parts) == 1:  # one configuration for every block
            c, _, p = parts[0]
            return c.decode(p, (g.rows, g.cols), dtype).reshape(as_shape(shape))
        out = torch.empty(g.rows, g.cols, dtype=dtype, device=payload.device)
        for c, rows, p in parts:
            out[rows] = c.decode(p, (rows.numel(), g.cols), dtype)
        return out.reshape(as_shape(shape))

    def error_bound(self, x: torch.Tensor, payload: torch.Tensor | None = None) -> torch.Tensor:
        """Each block's bound, from the configuration that coded it (:meth:`TileCodec.error_bound`)."""
        if payload is None:
            payload = self.encode(x)
        g, parts = self._parts(payload, x.shape, x.dtype)
        out = torch.zeros(g.rows, g.cols, dtype=torch.float32, device=payload.device)
        for c, rows, p in parts:
            out[rows] = c.error_bound(as_rows(x, g)[rows], p)
        return out.reshape(x.shape)


register("tahquant", TAHQuant)
# the default before slots=tile (4/3-bit tiles ranked by range, pivot slots per token, logx), spelled out
PREVIOUS_DEFAULT = "tahquant:slots=token,ratio=0.8,layout=logx,zero_ext=8,tau=2.0,fit=minmax"
# the default before fit=mse (every tile's grid covers it) and tau=2.5
MINMAX_DEFAULT = "tahquant:layout=log7,tau=2.0,fit=minmax"
# the default before log6t and zero_width=block (log7 metadata, every rotated tile's zero extended by 9 bits,
# their grids not searched)
LOG7_DEFAULT = "tahquant:layout=log7,fit_rotated=false"
# that default with the search of the rotated tiles' grids too
ROTATED_FIT = "tahquant:layout=log7,fit_rotated=true"
# and per block the layout and zero-extension width of lowest error (an option: docs/codecs.md)
ADAPTIVE = "tahquant:layout=log7,adapt=block,fit_rotated=true"
# the same choice predicted from one trial encode (an option; docs/codecs.md)
PREDICTED = "tahquant:layout=log7,adapt=predict,fit_rotated=true"
# The published configurations, pinned whatever the defaults above become (see docs/codecs.md):
# the paper (v2: G=32, tiles ranked within each token, no rotation cap, fp16 step + zero) and the
# authors' public code (G=64, tokens ranked within each sequence, fp16 step + zero).
_PUBLISHED = dict(high_bits=4, low_bits=3, ratio=0.8, tau=2.0, rotate=True, max_rotated=1.0, layout="ref",
                  rounding="nearest", alloc="entropy", slots="token", fit="minmax")
register("tahquant-paper", TAHQuant, tile=32, unit="tile", **_PUBLISHED)
register("tahquant-public", TAHQuant, tile=64, unit="token", **_PUBLISHED)
