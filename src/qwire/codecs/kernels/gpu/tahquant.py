"""Triton kernels of ``tahquant`` (:mod:`qwire.codecs.tahquant`), nearest rounding, ``alloc=range``.

Encode: one kernel reads every tile once for its statistics (min, max, sum of squares, the first
largest magnitude and its position, the largest magnitude elsewhere); the reference's per-tile
decisions then run in torch on those ``(R, T)`` values (which tiles rotate, the slot order, the
allocation by range, the outlier tiles, the layout's fit), the chosen tiles are rotated by the
reference's own pivot swap + Hadamard transform (about one tile in six or fewer), and a second kernel
quantizes and bit-packs each code stream: the ``high`` stream from the list of high-width tiles in
row-major order, the ``low`` stream from the others, a rotated tile's values read from the rotated copy.
With ``fit=mse`` and one stream of every tile (the default), the search's kernel packs that stream itself
(:func:`~._refine.refine`), and the input is read twice instead of three times.
Decode: the reference reads the metadata, one kernel per stream unpacks and dequantizes into the padded
rows, and the rotated tiles are un-rotated by the reference's transform.
With ``slots=tile`` (the default) the blocks of the rotated tiles (pivot, zero extension, codes of two
widths) are written over their codes and read back by the reference's torch code
(``TAHQuant._rotated_blocks``, ``_inline_decode``, ``_inline_values``) on the GPU.

The payload is the reference's, byte for byte (tests/test_kernels_triton.py, under the interpreter on
CPU). ``alloc=entropy`` (the paper's ranking, whose portable logarithm and summation order are not
written in Triton), tiles narrower than 8, wider than :data:`MAX_TILE` or not a multiple of 8 (possible
without the rotation) and stochastic rounding run the torch reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...base import full_levels
from ...layouts import LogLayout
from ...tahquant import ADAPT_TIE, TAHQuant, round_count
from ...tiles import store_out, values_bound
from . import _blocks as blocks
from ._blocks import append
from ._common import (
    ELEMENT_WARPS,
    GROUPS_PER_PROGRAM,
    INTERPRET,
    cdiv,
    code_groups,
    contiguous_input,
    fma32,
    inverse,
    launch,
    load_unpack,
    pack_store,
    program_start,
    register,
    rint_code,
    runs_of,
    widen,
)
from ._fit import TILES_PER_PROGRAM, fit
from ._read import anchors_and_tags, read
from ._refine import packs, refine, refine_blocks
from ._rotate import rotate as rotate_tiles
from ._rotate import rotated_stats, unrotate_
from .direct import check_max, checks, decoded, stats_tiles, tile_block

MAX_TILE = 1024
ZERO_WIDTH_TILES = 1024  # tiles whose flags _zero_widths reads per step of a block's loop (listing the rotated ones)
ZERO_WIDTH_ROTATED = 64  # rotated tiles per step of its errors' loop (times the widths: fp64 values held)


@triton.jit
def _tah_stats(X, C, T, G, N, LO, HI, SQ, A1, A2, PIV, CHK, BT: tl.constexpr, GP: tl.constexpr,
               WHOLE: tl.constexpr, I64: tl.constexpr):
    """Per tile (:func:`~.direct.tile_block`, ``BT`` of the ``N`` a program): min, max and sum of
    squares, and on the magnitudes of the real elements: the largest ``a1``, the first position holding it
    and the largest magnitude elsewhere ``a2`` (``a1`` again when it occurs twice)."""
    o, m, mn, mx, sq, a1, piv, a2 = tile_block(X, C, T, G, N, BT, GP, WHOLE, I64, PIVOT=True)
    tl.store(LO + o, mn, mask=m)
    tl.store(HI + o, mx, mask=m)
    tl.store(SQ + o, sq, mask=m)
    tl.store(A1 + o, a1, mask=m)
    tl.store(A2 + o, a2, mask=m)
    tl.store(PIV + o, tl.where(piv < G, piv, 0), mask=m)
    check_max(CHK, m, mn, mx, sq)


@triton.jit
def _tile_value(X, ROT, ROTPOS, tid, j0, C, T, G: tl.constexpr, m, tm, HAS_ROT: tl.constexpr,
                WHOLE: tl.constexpr, I64: tl.constexpr):
    """Elements ``j0 .. j0 + 7`` of tiles ``tid`` (row-major tile ids, ``(GB, 1)``; ``tm`` where ``tid`` is set,
    ``m`` where the element is): with ``HAS_ROT``, from the rotated copy when the tile rotated, else from the
    row (the padding of a short last tile repeats the row's last element). ``WHOLE``: the rows hold whole
    tiles (``C`` a multiple of ``G``), so the 8 elements are contiguous and start at a multiple of 8 elements,
    which the compiler is told (fp32: two 128-bit loads instead of eight)."""
    r = tid // T
    t = tid - r * T
    k = tl.arange(0, 8)[None, :]
    if WHOLE and not HAS_ROT:
        return tl.load(X + (tl.multiple_of(r * C + t * G + j0, [8, 8]) + k), mask=tm, other=0.0).to(tl.float32)
    col = tl.minimum(t * G + j0 + k, C - 1)
    if HAS_ROT:
        rp = tl.load(ROTPOS + tid, mask=tm, other=-1)
        xv = tl.load(X + r * C + col, mask=m & (rp < 0), other=0.0).to(tl.float32)
        rv = tl.load(ROT + widen(rp, I64) * G + j0 + k, mask=m & (rp >= 0), other=0.0)
        return tl.where(rp >= 0, rv, xv)
    else:
        return tl.load(X + r * C + col, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _stream_groups(n, G: tl.constexpr, GB: tl.constexpr, I64: tl.constexpr):
    """This program's code groups of a stream (:func:`code_groups`), and per group ``(GB, 1)`` the position
    ``e`` of its tile in the stream and whether it is inside the ``n`` codes (``G`` a multiple of 8)."""
    gid, i, m = code_groups(n, GB, I64)
    e, tm = runs_of(gid, i, m, n, G)
    return gid, i, m, e, tm


@triton.jit
def _stream_tile(TILES, e, tm, ALL: tl.constexpr, I64: tl.constexpr):
    """The row-major id (int64 with ``I64``, else int32) of the tile at position ``e`` of a stream: ``TILES[e]``,
    or ``e`` itself where the stream holds every tile (``ALL``); 0 outside the stream (``tm`` not set)."""
    if ALL:
        return widen(tl.where(tm, e, 0), I64)
    else:
        return widen(tl.load(TILES + e, mask=tm, other=0), I64)


@triton.jit
def _stream_quant_pack(X, ROT, ROTPOS, TILES, n, C, T, Z, S, P, off, nbytes, TOP, G: tl.constexpr,
                       BITS: tl.constexpr, GB: tl.constexpr, HAS_ROT: tl.constexpr, WHOLE: tl.constexpr,
                       EXACT64: tl.constexpr, ALL: tl.constexpr, I64: tl.constexpr):
    """Codes of a stream: code ``i`` is element ``i % G`` of tile ``TILES[i // G]`` (``ALL``: of tile ``i // G``,
    every tile in the stream, ``TILES`` not read); ``round((x - z) / s)``
    as ``fma(x, 1/s, -z/s)``, clamped to [0, TOP], packed ``BITS`` bits each (a step of 0 gives 0). Without
    ``HAS_ROT`` every tile is read from the rows (the codes of rotated tiles are then overwritten by their
    blocks). ``G`` is a multiple of 8, so a code group's 8 codes lie in one tile: its id, row and grid are
    read once per group."""
    gid, i, m, e, tm = _stream_groups(n, G, GB, I64)
    tid = _stream_tile(TILES, e, tm, ALL, I64)
    x = _tile_value(X, ROT, ROTPOS, tid, gid[:, None] * 8 - e * G, C, T, G, m, tm, HAS_ROT, WHOLE, I64)
    s = tl.load(S + tid, mask=tm, other=0.0)
    z = tl.load(Z + tid, mask=tm, other=0.0)
    inv = inverse(s)
    v = fma32(x, inv, -(z * inv), EXACT64)
    v = tl.minimum(tl.maximum(v, 0.0), TOP)
    q = tl.where(m, rint_code(v), 0)
    pack_store(q, gid, P, off, nbytes, BITS)


@triton.jit
def _stream_unpack_dequant(P, off, nbytes, n, TILES, Z, S, OUT, G: tl.constexpr, BITS: tl.constexpr,
                           GB: tl.constexpr, EXACT64: tl.constexpr, ALL: tl.constexpr, I64: tl.constexpr):
    """Values ``z + q * s`` (one fused multiply-add) of a stream's codes into the padded rows ``OUT``
    (tile ``tid`` at ``tid * G``; ``ALL`` as in :func:`_stream_quant_pack`)."""
    gid, i, m, e, tm = _stream_groups(n, G, GB, I64)
    q = load_unpack(P, off, gid, nbytes, BITS)
    tid = _stream_tile(TILES, e, tm, ALL, I64)
    s = tl.load(S + tid, mask=tm, other=0.0)
    z = tl.load(Z + tid, mask=tm, other=0.0)
    tl.store(OUT + tid * G + (i - e * G), fma32(q.to(tl.float32), s, z, EXACT64), mask=m)


@triton.jit
def _decide(A1, A2, SQ, n, TAU, FLAGS, P, off, nbytes, IDX, CNT, TAU_GE1: tl.constexpr, LIST: tl.constexpr,
            GB: tl.constexpr, I64: tl.constexpr):
    """:meth:`TAHQuant._choose_rotated` where every candidate rotates (no cap): ``FLAGS`` (uint8) and the
    ``rotflag`` bits at ``P + off``; the rotated tiles' sums of squares ``SQ`` become inf (no outlier-tile
    test for them). ``LIST``: the rotated tiles appended to the device list ``IDX`` (count ``CNT``)."""
    gid, i, m = code_groups(n, GB, I64)
    a1 = tl.load(A1 + i, mask=m, other=0.0)
    if TAU_GE1:
        a2 = tl.load(A2 + i, mask=m, other=0.0)
        f = (a1 > TAU * a2) & (a1 > 0)
    else:
        f = a1 > 0
    f = f & m
    tl.store(FLAGS + i, f.to(tl.uint8), mask=m)
    tl.store(SQ + i, tl.full(i.shape, float("inf"), tl.float32), mask=f)
    pack_store(f.to(tl.int32), gid, P, off, nbytes, 1)
    if LIST:
        append(tl.reshape(f, (GB * 8,)), tl.reshape(i, (GB * 8,)), tl.reshape(m, (GB * 8,)), IDX, IDX, CNT, False)


@triton.jit
def _widths(FLAGS, LV, LVC, A2, n, NLV, KMN, A2SQ, BLV, KMIN0, KMAX0, KMINR, KMAXR, HAS_LV: tl.constexpr,
            NARROW: tl.constexpr, EXT: tl.constexpr, BOUND: tl.constexpr, BT: tl.constexpr, I64: tl.constexpr):
    """Per tile: its levels, one bit narrower where rotated (:meth:`TAHQuant._narrow`); with ``EXT`` the range
    of its zero code (:meth:`TAHQuant._ext_range`, kmin then kmax in ``KMN``) and its second largest magnitude
    squared; with ``BOUND`` (and ``NARROW``) the levels that bound its values in ``BLV`` (a rotated tile's
    narrowed levels + 0.5, as the decode's reference has them)."""
    i = program_start(BT, I64) + tl.arange(0, BT)
    m = i < n
    f = tl.load(FLAGS + i, mask=m, other=0) != 0
    if NARROW:
        if HAS_LV:
            lv = tl.load(LV + i, mask=m, other=0.0)
        else:
            lv = tl.full(i.shape, LVC, tl.float32)
        nlv = tl.where(f, (lv + 1.0) * 0.5 - 1.0, lv)
        tl.store(NLV + i, nlv, mask=m)
        if BOUND:
            tl.store(BLV + i, tl.where(f, nlv + 0.5, nlv), mask=m)
    if EXT:
        tl.store(KMN + i, tl.where(f, KMINR, KMIN0), mask=m)
        tl.store(KMN + n + i, tl.where(f, KMAXR, KMAX0), mask=m)
        a2 = tl.load(A2 + i, mask=m, other=0.0)
        tl.store(A2SQ + i, a2 * a2, mask=m)


@triton.jit
def _zero_widths(FLAGS, S, ZC, ZE, LV, KMN, TAB, WIDTHS, LIST, n, BLOCK_TILES, SPAN, LKMIN, W: tl.constexpr,
                 WP: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, I64: tl.constexpr):
    """:meth:`TAHQuant._block_widths` and :meth:`TAHQuant._block_reach` of one block of rows (``BLOCK_TILES``
    tiles, row-major from ``program_id * BLOCK_TILES``, of the ``n``): the modelled squared error of its rotated
    tiles (``FLAGS``; steps ``S``, zero codes from the fit's ``ZC`` and high parts ``ZE`` as
    :meth:`TAHQuant._zero_codes`, narrow levels ``LV``) at every width 0 .. ``W - 1``, in fp64 as the reference's;
    the narrowest width within its tie of the lowest into ``WIDTHS`` (int32); then the rotated tiles' zero-code
    ranges in ``KMN`` (kmin, then kmax, ``n`` each) become that width's reach. ``TAB`` (fp64): the reach by width
    (kmin, then kmax, ``W`` each; fp32 values), each width's factor ``(G - n) / 4 + n``, then the zero-code
    unit per level and ``1 + ADAPT_TIE``. The block's rotated tiles are listed first, in order, in its part of
    ``LIST`` (int32, ``n``: their places in the block), ``BT`` flags at a time; the errors are then computed for
    them alone, ``BR`` at a time (where every tile took a division per width, rotated or not). The tiles' errors
    are summed in another order than the reference's ``index_add_`` (the tie covers the difference)."""
    b = program_start(1, I64)
    first = b * BLOCK_TILES
    last = tl.minimum(first + BLOCK_TILES, n)
    cnt = b * 0  # the block's rotated tiles so far
    for start in range(first, last, BT):
        i = start + tl.arange(0, BT)
        m = i < last
        f = ((tl.load(FLAGS + i, mask=m, other=0) != 0) & m).to(tl.int32)
        at = first + cnt + tl.cumsum(f, axis=0) - f  # each rotated tile's place in the list, in tile order
        tl.store(LIST + at, (i - first).to(tl.int32), mask=f != 0)
        cnt += tl.sum(f, axis=0)
    tl.debug_barrier()  # the list's stores, by every thread of the program, before its loads
    w = tl.arange(0, WP)
    wm = w < W
    kmin_w = tl.load(TAB + w, mask=wm, other=-1.0)[None, :]
    kmax_w = tl.load(TAB + W + w, mask=wm, other=1.0)[None, :]
    fac = tl.load(TAB + 2 * W + w, mask=wm, other=0.0)[None, :]
    unit_f = tl.load(TAB + 3 * W)
    tie = tl.load(TAB + 3 * W + 1)
    E = tl.zeros((WP,), tl.float64)
    for start in range(0, cnt, BR):
        r = start + tl.arange(0, BR)
        m = r < cnt
        i = first + tl.load(LIST + first + r, mask=m, other=0, cache_modifier=".cg")
        k = (tl.load(ZC + i, mask=m, other=0).to(tl.float32) + tl.load(ZE + i, mask=m, other=0).to(tl.float32) * SPAN
             + LKMIN)
        kk = k.to(tl.float64)[:, None]
        L = tl.load(LV + i, mask=m, other=1.0).to(tl.float64)[:, None]
        u = (L + 1.0) * unit_f
        below, above = kk < kmin_w, kk > kmax_w  # the growth kk / kmin, or (kk u + L) / (kmax u + L), or 1:
        num = tl.where(below, kk, tl.where(above, kk * u + L, 1.0))  # one fp64 division (a long sequence) per
        den = tl.where(below, kmin_w, tl.where(above, kmax_w * u + L, 1.0))  # tile and width, not two
        grow = num / den
        x = tl.load(S + i, mask=m, other=0.0).to(tl.float64)[:, None] * grow
        E += tl.sum(tl.where(m[:, None], (x * x) * fac, 0.0), axis=0)
    E = tl.where(wm, E, float("inf"))
    lim = tl.min(E, axis=0) * tie
    c = tl.min(tl.where(wm & (E <= lim), w, WP), axis=0)
    tl.store(WIDTHS + b, c.to(tl.int32))
    rmin = tl.load(TAB + c).to(tl.float32)
    rmax = tl.load(TAB + W + c).to(tl.float32)
    for start in range(0, cnt, BR):
        r = start + tl.arange(0, BR)
        m = r < cnt
        i = first + tl.load(LIST + first + r, mask=m, other=0, cache_modifier=".cg")
        tl.store(KMN + i, tl.full(i.shape, 0.0, tl.float32) + rmin, mask=m)
        tl.store(KMN + n + i, tl.full(i.shape, 0.0, tl.float32) + rmax, mask=m)


def _streams(codec: TAHQuant, high: torch.Tensor | None, k: int, R: int, T: int) -> list:
    """(stream name, row-major ids of its tiles or None where it holds every tile, their number, bits, levels)
    of the non-empty code streams."""
    out = []
    for name, bits in (("high", codec.high_bits), ("low", codec.low_bits)):
        if high is None:
            if (name == "high") != (k > 0):
                continue
            tiles, n = None, R * T
        else:
            tiles = (high if name == "high" else ~high).reshape(-1).nonzero().squeeze(1).to(torch.int64).contiguous()
            n = tiles.numel()
        if n:
            out.append((name, tiles, n, bits, (1 << bits) - 1))
    return out


def encode(codec: TAHQuant, x: torch.Tensor) -> torch.Tensor:
    g, sec, payload = codec._begin_encode(x)
    if not g.numel:
        return payload
    R, T, G = g.rows, g.tiles, g.tile
    X = contiguous_input(x)
    dev = X.device
    lo, hi, sq, a1, a2 = (torch.empty(R, T, device=dev) for _ in range(5))
    piv = torch.empty(R, T, dtype=torch.int64, device=dev)
    gp = triton.next_power_of_2(G)
    bt = stats_tiles(R * T)
    chk = torch.zeros(2, device=dev)
    launch(_tah_stats, (cdiv(R * T, bt),), X, g.cols, T, G, R * T, lo, hi, sq, a1, a2, piv, chk, BT=bt, GP=gp,
           WHOLE=gp == G and g.cols % G == 0, num_warps=ELEMENT_WARPS)
    checks(x, chk, codec.name)
    n, _, _ = codec._units(g)
    k = round_count(codec.ratio, n)
    mixed = 0 < k < n
    flags = order = None
    dense = _dense(codec, k, n)
    rot = torch.empty(0, G, device=dev)
    rotpos = rot if dense else torch.full((R * T,), -1, dtype=torch.int32, device=dev)  # dense: not read
    lst = None
    if codec.rotates:  # TAHQuant._rotate_ on the statistics
        m = codec.slot_count(g)
        if m >= T:  # every candidate rotates: one kernel (and, dense, the list of them on the GPU, and rotpos)
            fl = torch.empty(R, T, dtype=torch.uint8, device=dev)
            if dense:
                lst = blocks.DeviceList(torch.empty(R * T, dtype=torch.int64, device=dev),
                                        torch.zeros(1, dtype=torch.int32, device=dev))
            launch(_decide, (cdiv(cdiv(R * T, 8), GROUPS_PER_PROGRAM),), a1, a2, sq, R * T, float(codec.tau), fl,
                   payload, sec.offsets["rotflag"], cdiv(R * T, 8), lst.ids if dense else fl,
                   lst.count if dense else fl, TAU_GE1=codec.tau >= 1, LIST=dense, GB=GROUPS_PER_PROGRAM)
            flags = fl.view(torch.bool)
        else:
            flags = codec._choose_rotated(a1, a2, g)
            sq = sq.masked_fill(flags, float("inf"))
            sec.put(payload, "rotflag", 0, flags)
        if dense:  # the listed tiles' lo, hi once rotated (their blocks rotate them again); no host sync
            rotated_stats(X, g, lst, piv, lo, hi)
        else:
            idx = flags.view(-1).nonzero().squeeze(1)
            pk = piv.view(-1)[idx]
            if idx.numel():
                rot = rotate_tiles(X, g, idx, pk, lo, hi, rotpos)  # and the rotated tiles' lo, hi
        if not codec.inline:
            order = codec._slot_order(flags, m)
            sec.put(payload, "pivot", 0, torch.gather(torch.where(flags, piv, 0), 1, order))
    high = codec._put_alloc(sec, payload, 0, codec._range_rank(lo, hi), k, g) if mixed else None
    levels = codec._levels(high, k)
    a2sq = kmn = None
    if codec.inline or codec.extends:  # a rotated tile's metadata is that of one bit less; its zero reaches farther
        levels, kmn, a2sq = _widths_of(codec, flags, levels, a2)
    lay = codec.lay
    ext = None
    widths = None
    if isinstance(lay, LogLayout):  # gpu/_fit.py: the outlier tiles and the fit in two kernels
        z, s, vals = fit(lay, lo, hi, levels, False, g.anchor_rows, kmn=kmn, sq=sq, tile=G, a1=a1, a2sq=a2sq)
        sparse = vals.pop("sparse")
        if codec.extends:
            ext = vals.pop("zero_ext")
            if not codec.inline:
                codec._put_ext(ext, flags, order, sec, payload, 0, g)
        if codec.per_block:  # as TAHQuant._encode_chunk: each block's zero extension, the fit again with its reach
            widths = _zero_widths_of(codec, flags, s, vals["zero"], ext, levels, kmn, g)
            # the outlier tiles do not depend on the zero's reach: the first fit's, read
            z, s, vals = fit(lay, lo, hi, levels, False, g.anchor_rows, sparse=sparse, kmn=kmn)
            ext = vals.pop("zero_ext")
    else:  # layout=ref (fp16 metadata): the reference
        sparse = codec._outlier_tiles(sq, lo, hi, levels, a1, a2sq, g)
        z, s, vals = lay.fit(lo, hi, levels, False, g.anchor_rows, codec.name, sparse)
    streams = _streams(codec, high, k, R, T)
    packed = None  # the one stream of every tile, packed by the search's kernel with the grids it chose
    if (codec.searches and isinstance(lay, LogLayout) and packs(lay, False, G) and len(streams) == 1
            and streams[0][1] is None and (dense or not rot.shape[0])):  # no rotated copy to read tiles from
        name, _, n_tiles, bits, top = streams[0]
        packed = (payload, sec.offsets[name], (n_tiles * G * bits + 7) // 8, top, bits)
    if codec.searches:  # the reference's search (gpu/_refine.py) for the unrotated tiles
        z, s = refine(lay, X, g, lo, hi, z, s, vals, levels, False, g.anchor_rows,  # not rotated or outlier tiles
                      (sparse,) if flags is None else (flags, sparse), pack=packed)
    if codec.searches_rotated:  # and the rotated tiles' (gpu/_refine.py), in place
        z, s, ext = z.contiguous(), s.contiguous(), ext.contiguous() if ext is not None else None
        vals["scale"], vals["zero"] = vals["scale"].contiguous(), vals["zero"].contiguous()
        refine_blocks(codec, X, g, lst, None if dense else idx, rot, piv, lo, hi, z, s, vals, ext,
                      full_levels(levels, (R, T), dev).contiguous(), widths)
    lay.put(sec, payload, vals if widths is None else {**vals, "anchor": lay.tag_anchor(vals["anchor"], widths)},
            0, g)
    z, s = z.contiguous(), s.contiguous()
    for name, tiles, n_tiles, bits, top in streams if packed is None else ():
        nc = n_tiles * G
        launch(_stream_quant_pack, (cdiv(cdiv(nc, 8), GROUPS_PER_PROGRAM),), X, rot, rotpos,
               z if tiles is None else tiles, nc, g.cols, T, z, s, payload, sec.offsets[name], (nc * bits + 7) // 8,
               float(top), G=G, BITS=bits, GB=GROUPS_PER_PROGRAM, HAS_ROT=not dense, WHOLE=g.cols % G == 0,
               EXACT64=INTERPRET, ALL=tiles is None, num_warps=ELEMENT_WARPS)
    pb, eb = codec._block_fields()
    wb = None if widths is None else (widths.to(torch.int32).contiguous(), T * g.anchor_rows)
    if dense:  # the rotated tiles' blocks replace the codes the streams got for them
        name, b = _one_width(codec, k)
        blocks.pack_listed(payload, X, g, lst, sec.offsets[name], piv, ext, z, s, b, pb, eb, wb)
    elif codec.inline and rot.shape[0]:
        for pos, b, ids, offs in _block_places(codec, sec, g, idx, high, k):
            rows = torch.arange(idx.numel(), device=dev) if pos is None else pos
            blocks.pack(payload, rot, rows, ids, offs, pk if pos is None else pk[pos], ext, z, s, b, pb, eb, wb)
    return payload


def _dense(codec: TAHQuant, k: int, n: int) -> bool:
    """Whether the rotated tiles are listed on the GPU (:class:`~._blocks.DeviceList`, one code width and pivots
    in the tiles: a block's place follows from its tile's id) instead of by ``nonzero`` (whose size takes a
    host sync)."""
    return (codec.inline and not (0 < k < n)
            and blocks.listed_fits(codec.tile, _one_width(codec, k)[1]))


def _one_width(codec: TAHQuant, k: int) -> tuple[str, int]:
    """The code stream and width of every tile when all have one (``k`` high-width units per group: 0 or all)."""
    return ("high", codec.high_bits) if k else ("low", codec.low_bits)


def _widths_of(codec: TAHQuant, flags: torch.Tensor, levels: torch.Tensor | int, a2: torch.Tensor | None = None,
               bound: bool = False) -> tuple[torch.Tensor | int, torch.Tensor | None, torch.Tensor | None]:
    """(the tiles' levels, narrowed where rotated with ``slots=tile``; with ``a2`` and zero extension, their zero
    codes' ranges ``(2, R, T)`` and their second largest magnitudes squared; with ``bound`` instead, the levels that
    bound their values), in one kernel."""
    R, T = flags.shape
    n, dev = R * T, flags.device
    narrow, ext = codec.inline, codec.extends and a2 is not None
    nlv = torch.empty(R, T, device=dev) if narrow else None
    kmn = torch.empty(2, R, T, device=dev) if ext else None
    a2sq = torch.empty(R, T, device=dev) if ext else None
    bound = bound and narrow
    blv = torch.empty(R, T, device=dev) if bound else None
    has_lv = isinstance(levels, torch.Tensor)
    consts = (0.0, 0.0, 0.0, 0.0)
    if ext:
        lay = codec.lay
        half, span = float(1 << (codec.ext_bits - 1)), float(1 << lay.zero_bits)
        consts = (float(lay.kmin), float(lay.kmax), lay.kmin - span * half, lay.kmax + span * (half - 1))
    some = flags if nlv is None else nlv
    launch(_widths, (cdiv(n, TILES_PER_PROGRAM),), flags, levels.contiguous() if has_lv else some,
           0.0 if has_lv else float(levels), some if a2 is None else a2, n, some, some if kmn is None else kmn,
           some if a2sq is None else a2sq, some if blv is None else blv, *consts, HAS_LV=has_lv, NARROW=narrow,
           EXT=ext, BOUND=bound, BT=TILES_PER_PROGRAM)
    return (nlv if narrow else levels), kmn, (blv if bound else a2sq)


def _zero_widths_of(codec: TAHQuant, flags: torch.Tensor, s: torch.Tensor, zc: torch.Tensor, ze: torch.Tensor,
                    levels: torch.Tensor, kmn: torch.Tensor, g) -> torch.Tensor:
    """``zero_width=block``: each block of rows' zero-extension width (int32), :meth:`TAHQuant._block_widths` of the
    first fit's steps ``s``, zero fields ``zc`` and high parts ``ze``; the rotated tiles' ranges in ``kmn`` (``(2,
    R, T)``, contiguous) become their block's reach (:meth:`TAHQuant._block_reach`), in place: one kernel, where
    the reference's model is some fifty torch operations."""
    R, T = flags.shape
    dev = flags.device
    tabs = codec.__dict__.setdefault("_zero_width_tables", {})
    tab = tabs.get(dev)
    if tab is None:  # made once per device: no copy from the host per encode
        lay = codec.lay
        w = torch.arange(codec.ext_bits + 1)
        kmin, kmax = codec._width_reach(w)
        n = (int(math.log2(codec.tile)) + w).double()
        consts = torch.tensor([float(lay.unit(0)), 1.0 + ADAPT_TIE], dtype=torch.float64)
        tab = tabs[dev] = torch.cat([kmin.double(), kmax.double(), (codec.tile - n) / 4 + n, consts]).to(dev)
    widths = torch.empty(g.n_blocks, dtype=torch.int32, device=dev)
    W = codec.ext_bits + 1
    lay = codec.lay
    listed = torch.empty(R * T, dtype=torch.int32, device=dev)  # each block's rotated tiles, in its own part
    launch(_zero_widths, (g.n_blocks,), flags.contiguous().view(torch.uint8), s.contiguous(), zc.contiguous(),
           ze.contiguous(), levels.contiguous(), kmn, tab, widths, listed, R * T, T * g.anchor_rows,
           float(1 << lay.zero_bits), float(lay.kmin), W=W, WP=triton.next_power_of_2(W), BT=ZERO_WIDTH_TILES,
           BR=ZERO_WIDTH_ROTATED)
    return widths


def _block_places(codec: TAHQuant, sec, g, idx: torch.Tensor, high: torch.Tensor | None, k: int) -> list:
    """Per code width ``b`` of the rotated tiles ``idx``: (their positions among ``idx``, or None for all of
    them, ``b``, their ids, the byte offsets of their blocks in the payload)."""
    if high is None:  # one width: a tile's place in its stream is its row-major id
        name, b = _one_width(codec, k)
        return [(None, b, idx, sec.offsets[name] + idx * (g.tile * b // 8))]
    return [(pos, b, idx[pos], start) for pos, b, start in codec._block_places(sec, g, idx, high, True)]


def decode(codec: TAHQuant, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    g, sec, out = codec._begin_decode(payload, shape, dtype)
    if not g.numel:
        return out
    R, T, G = g.rows, g.tiles, g.tile
    high, k = codec._alloc(sec, payload, 0, R, g)
    levels = codec._levels(high, k)
    idx = piv = ext = parts = grows = anchor = None
    bound_levels = levels
    dev = payload.device
    if codec.inline:  # the rotated tiles' pivots and zero extensions are in their blocks
        flags = sec.get(payload, "rotflag", 0, R * T).view(R, T).view(torch.bool)  # codes 0 and 1: TAHQuant._flags
        levels, _, bound_levels = _widths_of(codec, flags, levels, bound=True)
        pb, eb = codec._block_fields()
        wb = None
        if codec.per_block:  # each block's zero extension, its anchor's tag (one beyond zero_ext: NaN values)
            anchor, tags = anchors_and_tags(codec.lay, sec, payload, g, codec.ext_bits)
            wb = (tags, T * g.anchor_rows)
        ext = torch.zeros(R, T, dtype=torch.int32, device=dev) if codec.extends else None  # zero_ext bits, signed
        if _dense(codec, k, codec._units(g)[0]):  # the rotated tiles listed on the GPU: no host sync
            name, b = _one_width(codec, k)
            parts = [(None, b, blocks.listed(flags), sec.offsets[name])]
            piv = [torch.empty(R * T, dtype=torch.int64, device=dev)]
            grows = flags
        else:
            idx = flags.view(-1).nonzero().squeeze(1)
            parts = _block_places(codec, sec, g, idx, high, k)
            piv = [torch.empty(ids.numel(), dtype=torch.int64, device=dev) for _, _, ids, _ in parts]
        for (_, b, ids, offs), p in zip(parts, piv):
            blocks.heads(payload, offs, ids, p, ext, G, b, pb, eb, wb)
    elif codec.rotates:
        idx, piv, ext = codec._rotation(sec, payload, 0, R, g)
    rotated = idx is not None and idx.numel() > 0
    if isinstance(codec.lay, LogLayout):  # gpu/_read.py: the metadata and the values' bound in one kernel
        z, s, bound, scale = read(codec.lay, sec, payload, g, False, levels, zero_ext=ext,
                                  bound_levels=bound_levels, growth=G if rotated or grows is not None else 1,
                                  grows=grows, anchor=anchor)
    else:
        if grows is not None:
            rotated = bool(grows.any())
        z, s = codec.lay.read(sec, payload, 0, R, g, False, levels)
        bound, scale = values_bound(z, s, bound_levels, G if rotated else 1), 1.0
    z, s = z.contiguous(), s.contiguous()
    direct = dtype == torch.float32 and g.padded == g.cols  # decode straight into the output
    vals = out.view(R, T, G) if direct else torch.empty(R, T, G, device=payload.device)
    for name, tiles, n_tiles, bits, _ in _streams(codec, high, k, R, T):
        nc = n_tiles * G
        launch(_stream_unpack_dequant, (cdiv(cdiv(nc, 8), GROUPS_PER_PROGRAM),), payload, sec.offsets[name],
               (nc * bits + 7) // 8, nc, z if tiles is None else tiles, z, s, vals, G=G, BITS=bits,
               GB=GROUPS_PER_PROGRAM, EXACT64=INTERPRET, ALL=tiles is None, num_warps=ELEMENT_WARPS)
    if parts:  # the rotated tiles' values, un-rotated
        for (_, b, ids, offs), p in zip(parts, piv):
            blocks.values_(vals, payload, offs, ids, p, z, s, b, pb, eb, wb)
    elif rotated:
        unrotate_(vals, idx, piv)
    decoded(vals, bound, scale, codec.name)
    if not direct:
        store_out(out.view(R, g.cols), 0, vals, g)
    return out


def _supports(codec: TAHQuant) -> bool:
    """Nearest rounding, 8 <= G <= MAX_TILE with G a multiple of 8, and the range allocation (or one width for
    every unit)."""
    return (codec.rounding == "nearest" and 8 <= codec.tile <= MAX_TILE and codec.tile % 8 == 0
            and (codec.alloc == "range" or codec.ratio in (0.0, 1.0)))


# the fields adapt=predict reads: the reference's unpacking (a few small fields, on the device)
register("TAHQuant", supports=_supports, encode=encode, decode=decode,
                 read_fields=TAHQuant.read_fields.reference)
