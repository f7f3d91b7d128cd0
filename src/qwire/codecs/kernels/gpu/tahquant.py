"""Triton kernels of ``tahquant`` (:mod:`qwire.codecs.tahquant`), nearest rounding, ``alloc=range``.

Encode: one kernel reads every tile once for its statistics (min, max, sum of squares, the first
largest magnitude and its position, the largest magnitude elsewhere); the reference's per-tile
decisions then run in torch on those ``(R, T)`` values (which tiles rotate, the slot order, the
allocation by range, the outlier tiles, the layout's fit), the chosen tiles are rotated by the
reference's own pivot swap + Hadamard transform (about one tile in six or fewer), and a second kernel
quantizes and bit-packs each code stream: the ``high`` stream from the list of high-width tiles in
row-major order, the ``low`` stream from the others, a rotated tile's values read from the rotated copy.
Decode: the reference reads the metadata, one kernel per stream unpacks and dequantizes into the padded
rows, and the rotated tiles are un-rotated by the reference's transform.
With ``slots=tile`` (the default) the blocks of the rotated tiles (pivot, zero extension, codes of two
widths) are written over their codes and read back by the reference's torch code
(``TAHQuant._rotated_blocks``, ``_inline_decode``, ``_inline_values``) on the GPU.

The payload is the reference's, byte for byte (tests/test_kernels_triton.py, under the interpreter on
CPU). ``alloc=entropy`` (the paper's ranking, whose portable logarithm and summation order are not
written in Triton), tiles narrower than 8 or wider than :data:`MAX_TILE` and stochastic rounding run the
torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...base import check_decoded
from ...layouts import LogLayout
from ...packing import pack_bits, unpack_bits
from ...tahquant import TAHQuant, round_count
from ...tiles import store_out, values_bound
from .. import register_kernels
from ._common import (
    GROUPS_PER_PROGRAM,
    INTERPRET,
    cdiv,
    code_groups,
    contiguous_fp32,
    fma32,
    launch,
    load_unpack,
    pack_store,
    rint,
)
from ._fit import fit
from ._read import read
from ._refine import refine
from ._rotate import rotate as rotate_tiles
from ._rotate import unrotate_
from .direct import STATS_ELEMS, checks, tile_block

MAX_TILE = 1024


@triton.jit
def _tah_stats(X, C, T, G, NB, LO, HI, SQ, A1, A2, PIV, BT: tl.constexpr, GP: tl.constexpr):
    """Per tile (:func:`~.direct.tile_block`: ``NB`` blocks of ``BT`` tiles per row): min, max and sum of
    squares, and on the magnitudes of the real elements: the largest ``a1``, the first position holding it
    and the largest magnitude elsewhere ``a2`` (``a1`` again when it occurs twice)."""
    r, t, j, x, valid, mn, mx, sq = tile_block(X, C, T, G, NB, BT, GP)
    a = tl.where(valid, tl.abs(x), 0.0)
    a1 = tl.max(a, axis=1)
    jj = tl.zeros(a.shape, tl.int32) + j[None, :]
    piv = tl.min(tl.where(a == a1[:, None], jj, GP), axis=1)
    a2 = tl.max(tl.where(jj == piv[:, None], 0.0, a), axis=1)
    m = t < T
    o = r * T + t
    tl.store(LO + o, mn, mask=m)
    tl.store(HI + o, mx, mask=m)
    tl.store(SQ + o, sq, mask=m)
    tl.store(A1 + o, a1, mask=m)
    tl.store(A2 + o, a2, mask=m)
    tl.store(PIV + o, tl.where(piv < G, piv, 0), mask=m)


@triton.jit
def _tile_value(X, ROT, ROTPOS, tid, j, C, T, G, m):
    """Element ``j`` of tile ``tid`` (row-major tile id): from the rotated copy when the tile rotated,
    else from the row (the padding of a short last tile repeats the row's last element)."""
    r = tid // T
    t = tid - r * T
    rp = tl.load(ROTPOS + tid, mask=m, other=-1)
    col = tl.minimum(t * G + j, C - 1)
    xv = tl.load(X + r * C + col, mask=m & (rp < 0), other=0.0)
    rv = tl.load(ROT + rp.to(tl.int64) * G + j, mask=m & (rp >= 0), other=0.0)
    return tl.where(rp >= 0, rv, xv)


@triton.jit
def _stream_quant_pack(X, ROT, ROTPOS, TILES, n, C, T, G, Z, S, P, off, nbytes, TOP, BITS: tl.constexpr,
                       GB: tl.constexpr, EXACT64: tl.constexpr):
    """Codes of a stream: code ``i`` is element ``i % G`` of tile ``TILES[i // G]``; ``round((x - z) / s)``
    as ``fma(x, 1/s, -z/s)``, clamped to [0, TOP], packed ``BITS`` bits each (a step of 0 gives 0)."""
    gid, i, m = code_groups(n, GB)
    e = i // G
    j = i - e * G
    tid = tl.load(TILES + e, mask=m, other=0)
    x = _tile_value(X, ROT, ROTPOS, tid, j, C, T, G, m)
    s = tl.load(S + tid, mask=m, other=0.0)
    z = tl.load(Z + tid, mask=m, other=0.0)
    pos = s > 0
    inv = tl.where(pos, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(pos, s, 1.0)), 0.0)
    v = fma32(x, inv, -(z * inv), EXACT64)
    v = tl.minimum(tl.maximum(v, 0.0), TOP)
    q = tl.where(m, rint(v).to(tl.int32), 0)
    pack_store(q, gid, P, off, nbytes, BITS)


@triton.jit
def _stream_unpack_dequant(P, off, nbytes, n, TILES, G, Z, S, OUT, BITS: tl.constexpr, GB: tl.constexpr,
                           EXACT64: tl.constexpr):
    """Values ``z + q * s`` (one fused multiply-add) of a stream's codes into the padded rows ``OUT``
    (tile ``tid`` at ``tid * G``)."""
    gid, i, m = code_groups(n, GB)
    q = load_unpack(P, off, gid, nbytes, BITS)
    e = i // G
    j = i - e * G
    tid = tl.load(TILES + e, mask=m, other=0).to(tl.int64)
    s = tl.load(S + tid, mask=m, other=0.0)
    z = tl.load(Z + tid, mask=m, other=0.0)
    tl.store(OUT + tid * G + j, fma32(q.to(tl.float32), s, z, EXACT64), mask=m)


def _streams(codec: TAHQuant, high: torch.Tensor | None, k: int, R: int, T: int, device) -> list:
    """(stream name, row-major ids of its tiles, bits, levels) of the non-empty code streams."""
    out = []
    for name, bits in (("high", codec.high_bits), ("low", codec.low_bits)):
        if high is None:
            if (name == "high") != (k > 0):
                continue
            tiles = torch.arange(R * T, device=device)
        else:
            tiles = (high if name == "high" else ~high).reshape(-1).nonzero().squeeze(1)
        if tiles.numel():
            out.append((name, tiles.to(torch.int64).contiguous(), bits, (1 << bits) - 1))
    return out


def encode(codec: TAHQuant, x: torch.Tensor) -> torch.Tensor:
    g, sec, payload = codec._begin_encode(x)
    if not g.numel:
        return payload
    R, T, G = g.rows, g.tiles, g.tile
    X = contiguous_fp32(x)
    dev = X.device
    lo, hi, sq, a1, a2 = (torch.empty(R, T, device=dev) for _ in range(5))
    piv = torch.empty(R, T, dtype=torch.int64, device=dev)
    gp = triton.next_power_of_2(G)
    bt = max(1, STATS_ELEMS // gp)
    nb = cdiv(T, bt)
    launch(_tah_stats, (R * nb,), X, g.cols, T, G, nb, lo, hi, sq, a1, a2, piv, BT=bt, GP=gp)
    checks(x, lo, hi, sq, codec.name)
    n, _, _ = codec._units(g)
    k = round_count(codec.ratio, n)
    mixed = 0 < k < n
    flags = order = None
    rot = torch.empty(0, G, device=dev)
    rotpos = torch.full((R * T,), -1, dtype=torch.int32, device=dev)
    if codec.rotates:  # TAHQuant._rotate_ on the statistics
        m = codec.slot_count(g)
        flags = codec._choose_rotated(a1, a2, g)
        idx = flags.view(-1).nonzero().squeeze(1)
        if idx.numel():
            rot = rotate_tiles(X, g, idx, piv.view(-1)[idx])
            lo.view(-1)[idx] = rot.amin(dim=-1).add_(0.0)
            hi.view(-1)[idx] = rot.amax(dim=-1).add_(0.0)
            rotpos[idx] = torch.arange(idx.numel(), dtype=torch.int32, device=dev)
        order = codec._slot_order(flags, m)
        sq = sq.masked_fill(flags, float("inf"))
        sec.put(payload, "rotflag", 0, flags)
        if not codec.inline:
            sec.put(payload, "pivot", 0, torch.gather(torch.where(flags, piv, 0), 1, order))
    high = codec._put_alloc(sec, payload, 0, codec._range_rank(lo, hi), k, g) if mixed else None
    a2sq = a2.square() if codec.extends else None
    levels = codec._levels(high, k)
    if codec.inline:  # a rotated tile's metadata is that of one bit less
        levels = codec._narrow(levels, flags)
    lay = codec.lay
    ext = None
    if isinstance(lay, LogLayout):  # gpu/_fit.py: the outlier tiles and the fit in two kernels
        kmin, kmax = codec._ext_range(flags) if codec.extends else (None, None)
        z, s, vals = fit(lay, lo, hi, levels, False, g.anchor_rows, kmin=kmin, kmax=kmax, sq=sq, tile=G, a1=a1,
                         a2sq=a2sq)
        sparse = vals.pop("sparse")
        if codec.extends:
            ext = vals.pop("zero_ext")
            if not codec.inline:
                codec._put_ext(ext, flags, order, sec, payload, 0, g)
    else:  # layout=ref (fp16 metadata): the reference
        sparse = codec._outlier_tiles(sq, lo, hi, levels, a1, a2sq, g)
        z, s, vals = lay.fit(lo, hi, levels, False, g.anchor_rows, codec.name, sparse)
    if codec.searches:  # the reference's search (gpu/_refine.py) for the unrotated tiles
        z, s = refine(lay, X, g, lo, hi, z, s, vals, levels, False, g.anchor_rows, codec._searched(flags, sparse))
    lay.put(sec, payload, vals, 0, g)
    z, s = z.contiguous(), s.contiguous()
    for name, tiles, bits, top in _streams(codec, high, k, R, T, dev):
        nc = tiles.numel() * G
        launch(_stream_quant_pack, (cdiv(cdiv(nc, 8), GROUPS_PER_PROGRAM),), X, rot, rotpos, tiles, nc, g.cols,
               T, G, z, s, payload, sec.offsets[name], (nc * bits + 7) // 8, float(top),
               BITS=bits, GB=GROUPS_PER_PROGRAM, EXACT64=INTERPRET)
    if codec.inline and rot.shape[0]:  # the rotated tiles' blocks replace the codes the streams got for them
        codes = codec._rotated_blocks(rot, idx, z, s, levels, piv, ext, None)
        hmask = high if high is not None else torch.full((R, T), k > 0, device=dev)
        for pos, b, at in codec._block_bytes(sec, g, idx, hmask, mixed):
            payload[at] = pack_bits(codes[pos], b).view(at.shape)
    return payload


def decode(codec: TAHQuant, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    g, sec, out = codec._begin_decode(payload, shape, dtype)
    if not g.numel:
        return out
    R, T, G = g.rows, g.tiles, g.tile
    high, k = codec._alloc(sec, payload, 0, R, g)
    levels = codec._levels(high, k)
    idx = piv = ext = parts = None
    bound_levels = levels
    if codec.inline:  # the rotated tiles' pivots and zero extensions are in their blocks
        flags = codec._flags(sec, payload, 0, R, g)
        levels = codec._narrow(levels, flags)
        bound_levels = torch.where(flags, levels + 0.5, levels)
        idx = flags.view(-1).nonzero().squeeze(1)
        hmask = high if high is not None else torch.full((R, T), k > 0, device=payload.device)
        blk = torch.empty(idx.numel(), G, dtype=torch.uint8, device=payload.device)
        for pos, b, at in codec._block_bytes(sec, g, idx, hmask, high is not None):
            blk[pos] = unpack_bits(payload[at].reshape(-1), b, pos.numel() * G).view(-1, G)
        _, piv, e, parts = codec._inline_decode(blk.view(-1, 1, G), torch.ones(idx.numel(), 1, dtype=torch.bool,
                                                device=payload.device), levels.view(-1)[idx].view(-1, 1))
        if e is not None:
            ext = torch.zeros(R * T, dtype=torch.int64, device=payload.device)
            ext[idx] = e.view(-1)
            ext = ext.view(R, T)
    elif codec.rotates:
        idx, piv, ext = codec._rotation(sec, payload, 0, R, g)
    rotated = idx is not None and idx.numel() > 0
    if isinstance(codec.lay, LogLayout):  # gpu/_read.py: the metadata and the values' bound in one kernel
        z, s, bound = read(codec.lay, sec, payload, g, False, levels, zero_ext=ext, bound_levels=bound_levels,
                           growth=G if rotated else 1)
    else:
        z, s = codec.lay.read(sec, payload, 0, R, g, False, levels)
        bound = values_bound(z, s, bound_levels, G if rotated else 1)
    z, s = z.contiguous(), s.contiguous()
    vals = torch.empty(R, T, G, device=payload.device)
    for name, tiles, bits, _ in _streams(codec, high, k, R, T, payload.device):
        nc = tiles.numel() * G
        launch(_stream_unpack_dequant, (cdiv(cdiv(nc, 8), GROUPS_PER_PROGRAM),), payload, sec.offsets[name],
               (nc * bits + 7) // 8, nc, tiles, G, z, s, vals, BITS=bits, GB=GROUPS_PER_PROGRAM, EXACT64=INTERPRET)
    if parts:
        codec._inline_values(vals, idx, parts, z, s)
    if rotated:
        unrotate_(vals, idx, piv)
    check_decoded(vals, bound, codec.name)
    store_out(out.view(R, g.cols), 0, vals, g)
    return out


def _supports(codec: TAHQuant) -> bool:
    """Nearest rounding, 8 <= G <= MAX_TILE, and the range allocation (or one width for every unit)."""
    return (codec.rounding == "nearest" and 8 <= codec.tile <= MAX_TILE
            and (codec.alloc == "range" or codec.ratio in (0.0, 1.0)))


register_kernels("triton", "TAHQuant", supports=_supports, encode=encode, decode=decode)
