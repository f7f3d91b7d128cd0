"""CPU kernels of ``tahquant`` (:mod:`qwire.codecs.tahquant`): the passes of
:mod:`qwire.codecs.kernels.cpu._tah`. Pass A+B computes each row's tile statistics and then, while
the row is in cache, the reference's per-tile decisions (``_choose_rotated``, ``_slot_order``, the
rotation, ``_top_units`` for the tile unit, ``_outlier_tiles``, ``_ext_range``) with the same tie
rule (:func:`~qwire.codecs.tahquant.top_k`); the token unit ranks its tokens with the reference's
torch code. The ``log``/``logx`` fit is the numba mirror of :class:`~qwire.codecs.layouts.LogLayout`.
With ``slots=tile`` pass C writes each rotated tile's block (pivot, zero extension, codes of two widths)
in place of its codes and pass D reads it back; the pivots and zero extensions for the metadata come from
the blocks' first bytes (``TAHQuant._block_heads``).

Same payload bytes and decoded values as the reference for every configuration with nearest
rounding (stochastic rounding runs the reference): every fp32 operation is repeated in the
reference's order, and the entropy and the Hadamard transform are the portable ones the reference
uses.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...base import check_decoded
from ...hadamard import normalization
from ...layouts import LogLayout
from ...tahquant import ADAPT_TIE, TWO_OUTLIERS, TAHQuant, round_count
from ...tiles import SPARSE_KAPPA, store_out
from .. import register_kernels
from ._common import blocks, np_of, run_blocks, workspace
from ._layouts import mse_blocks_rows
from ._sections import FastSections
from ._tah import SUB, block_reach, block_widths, dequant_d, pass_ab, quant_c, rotation_meta
from .direct import fit_buffers, fit_log, lay_table, mse_steps, read_log, refine_log, rows_fp32, stats_checks


def _quantum(codec: TAHQuant, g) -> int:
    """Rows per block that keep both code streams byte aligned at every block start."""
    return SUB if codec.unit == "tile" else SUB * max(1, g.seq)


def _stream_starts(codec: TAHQuant, g, r0: int, k: int, mixed: bool) -> tuple[int, int]:
    """Code index of rows r0.. in the high and low streams."""
    if not mixed:
        return (r0 * g.padded, 0) if k else (0, r0 * g.padded)
    if codec.unit == "tile":
        return r0 * k * g.tile, r0 * (g.padded - k * g.tile)
    seqs = r0 // g.seq
    return seqs * k * g.padded, seqs * (g.seq - k) * g.padded


def refine_blocks(codec: TAHQuant, rot: torch.Tensor, rotpos: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  Lt: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, g, r0: int, r1: int,
                  fit: dict[str, torch.Tensor], wblk: torch.Tensor, view=np_of) -> None:
    """``TAHQuant._refine_rotated`` of rows r0..r1 after the fit wrote ``fit``: the rotated tiles' (``rotpos``,
    their values in ``rot``; geometry ``g``) ``z``, ``s``, step and zero codes and zero-code high parts in place
    (``wblk``: each block's zero-extension width with ``zero_width=block``, else empty; ``view``: a tensor's
    numpy view, as :meth:`Workspace.np`)."""
    lay, v = codec.lay, view
    mse_blocks_rows(r0, r1, v(rot), v(rotpos), codec.tile, codec.tile - codec.narrowed, v(lo), v(hi), v(Lt),
                    v(fit["anchor"]), g.anchor_rows, lay_table(lay), lay.zero_code, lay.kmin, lay.zero_bits, v(kmin),
                    v(kmax), codec.extends, np.float32(lay.zero_span / float(1 << (lay.zero_bits - 1))),
                    *mse_steps(lay), g.padded > g.cols, v(fit["z"]), v(fit["s"]), v(fit["scale"]), v(fit["zero"]),
                    v(fit["khigh"]), v(wblk), int(math.log2(codec.tile)))


def _encode_const(codec: TAHQuant, g, sec) -> dict:
    """What an encode of geometry ``g`` derives from the codec and the shape alone (kept in its workspace)."""
    n, _, _ = codec._units(g)
    k = round_count(codec.ratio, n)
    kext = torch.zeros(4)
    if codec.extends:
        lay = codec.lay
        assert isinstance(lay, LogLayout)
        half, span = float(1 << (codec.ext_bits - 1)), float(1 << lay.zero_bits)
        kext = torch.tensor([lay.kmin, lay.kmax, lay.kmin - span * half, lay.kmax + span * (half - 1)])
    reach = reach32 = None
    if codec.per_block:
        wmin, wmax = codec._width_reach(torch.arange(codec.ext_bits + 1))
        reach = (np_of(wmin.double()), np_of(wmax.double()))
        reach32 = (np_of(wmin.contiguous()), np_of(wmax.contiguous()))
    return {"sec": FastSections.of(sec), "k": k, "mixed": 0 < k < n, "kext": np_of(kext), "reach": reach,
            "reach32": reach32, "m": codec.slot_count(g) if codec.rotates else 0, "norm": normalization(g.tile)}


def encode(codec: TAHQuant, x: torch.Tensor) -> torch.Tensor:
    g, sec, payload = codec._begin_encode(x)
    if not g.numel:
        return payload
    ws = workspace(codec, "encode", tuple(x.shape), g.numel)
    if not ws.const:
        ws.const.update(_encode_const(codec, g, sec))
    c = ws.const
    sec, k, mixed, m, N = c["sec"], c["k"], c["mixed"], c["m"], ws.np
    R, T, G = g.rows, g.tiles, g.tile
    X = rows_fp32(x, R, g.cols)
    Xn = np_of(X)
    unit_tile = codec.unit == "tile"
    lo, hi, sumsq, a1, a2, sq2 = (ws.empty(name, (R, T)) for name in ("lo", "hi", "sumsq", "a1", "a2", "sq2"))
    piv = ws.empty("piv", (R, T), torch.int64)
    by_range = codec.alloc == "range"
    want_h = mixed and not by_range
    H = ws.empty("H", (R, T if unit_tile and want_h else 0))
    Hrow = ws.empty("Hrow", (R if want_h and not unit_tile else 0,))
    rotates = codec.rotates
    flags = ws.zeros("flags", (R, T), torch.bool)
    order = ws.empty("order", (R, m), torch.int64)
    pslot = ws.empty("pslot", (R, m), torch.int64)
    rot = ws.empty("rot", (R * m, G))
    rotpos = ws.full("rotpos", (R, T), -1, torch.int32)
    local = unit_tile or not mixed  # the allocation, levels and outlier tiles of a row depend on that row only
    high_t = ws.empty("high_t", (R, T), torch.bool)
    Lt, kmin, kmax = (ws.empty(name, (R, T)) for name in ("Lt", "kmin", "kmax"))
    sparse = ws.empty("sparse", (R, T), torch.bool)
    lay = codec.lay
    lh, ll = (1 << codec.high_bits) - 1, (1 << codec.low_bits) - 1
    two_out = TWO_OUTLIERS if codec.extends else 0.0
    fit = fit_buffers(g, ws) if isinstance(lay, LogLayout) else None
    off_h, off_l = sec.offsets["high"], sec.offsets["low"]
    run_blocks(pass_ab, blocks(R, g.cols), Xn, G, unit_tile, want_h, N(lo), N(hi), N(sumsq), N(a1), N(a2), N(piv),
               N(H), N(Hrow), by_range, rotates, float(codec.tau), m, N(flags), N(order), N(pslot), N(rot), N(rotpos),
               c["norm"], local, k, mixed, lh, ll, SPARSE_KAPPA, two_out, codec.extends, c["kext"], N(high_t), N(Lt),
               N(sq2), N(sparse), N(kmin), N(kmax))
    stats_checks(x, sumsq, a1, codec.name)
    inline = codec.inline
    if rotates:
        sec.put(payload, "rotflag", 0, flags)
        if not inline:
            sec.put(payload, "pivot", 0, pslot)
    high = None
    if mixed:
        if unit_tile:
            high = high_t
            sec.put(payload, "alloc", 0, high)
        else:
            high = codec._put_alloc(sec, payload, 0, codec._range_rank(lo, hi) if by_range else Hrow, k, g)
    levels = codec._levels(high, k)
    if not local:
        Lt = levels.contiguous()
        sparse = codec._outlier_tiles(sq2, lo, hi, levels, a1, a2.square() if codec.extends else None, g)
        if codec.extends:
            kmin, kmax = (v.contiguous() for v in codec._ext_range(flags))
    if inline:  # the rotated tiles' metadata is that of their narrower width
        Lt = codec._narrow(Lt, flags).contiguous()
    widths = torch.zeros(0, dtype=torch.int64)  # zero_width=block: each block's zero extension
    if fit is not None:
        kx = (kmin, kmax) if codec.extends else (None, None)

        def fit_all() -> None:
            run_blocks(lambda r0, r1: fit_log(lay, lo, hi, sq2, Lt, False, g, r0, r1, fit, sparse=sparse,
                                              kmin=kx[0], kmax=kx[1], view=N),
                       blocks(R, g.cols, g.anchor_rows))

        fit_all()
        if codec.per_block:  # as TAHQuant._encode_chunk: each block's zero extension, the fit again with its reach
            widths = ws.empty("widths", (-(-R // g.anchor_rows),), torch.int64)
            wmin, wmax = c["reach"]
            block_widths(N(flags), N(fit["s"]), N(fit["zero"]), N(fit["khigh"]), np.float32(1 << lay.zero_bits),
                         np.float32(lay.kmin), N(Lt), g.anchor_rows, G, int(math.log2(G)), wmin, wmax,
                         lay.zero_span / float(1 << (lay.zero_bits - 1)), ADAPT_TIE, N(widths))
            if not local:  # kmin, kmax: fresh tensors of _ext_range, else this call's scratch: in place either way
                kmin, kmax = kmin.clone(), kmax.clone()
            block_reach(N(flags), N(widths), g.anchor_rows, *c["reach32"], N(kmin), N(kmax))
            kx = (kmin, kmax)
            fit_all()
        if codec.searches:  # the unrotated tiles' grids of lowest squared error
            Lc = Lt.contiguous()
            mask = codec._searched(flags if rotates else None, sparse).contiguous()
            run_blocks(lambda r0, r1: refine_log(lay, Xn, g, lo, hi, Lc, False, r0, r1, fit, mask, view=N),
                       blocks(R, g.cols))
        if codec.searches_rotated:  # and the rotated tiles' (LogLayout.refine_blocks)
            run_blocks(lambda r0, r1: refine_blocks(codec, rot, rotpos, lo, hi, Lt, kmin, kmax, g, r0, r1, fit,
                                                    widths, N), blocks(R, g.cols))
        z, s = fit["z"], fit["s"]
        anchor = lay.tag_anchor(fit["anchor"], widths) if codec.per_block else fit["anchor"]
        lay.put(sec, payload, {"anchor": anchor, "scale": fit["scale"], "zero": fit["zero"]}, 0, g)
        khigh = fit["khigh"] if codec.extends else None
        if codec.extends and not inline:
            codec._put_ext(khigh, flags, order, sec, payload, 0, g)
    else:
        z, s, vals = lay.fit(lo, hi, Lt if inline else levels, False, g.anchor_rows, codec.name, sparse)
        khigh = None
        lay.put(sec, payload, vals, 0, g)
        z, s = z.contiguous(), s.contiguous()
    hmask = (high if high is not None else high_t if local else torch.full((R, T), k > 0)).contiguous()
    pb, eb = codec._block_fields() if inline else (0, 0)
    nw = G - codec.narrowed if inline else 0
    ext = khigh.to(torch.int64).contiguous() if inline and khigh is not None else torch.zeros(1, 1, dtype=torch.int64)

    def block(r0: int, r1: int) -> None:
        hs, ls = _stream_starts(codec, g, r0, k, mixed)
        quant_c(r0, r1, Xn, G, N(z), N(s), N(hmask), N(rotpos), N(rot), codec.high_bits, codec.low_bits,
                np_of(payload), off_h, off_l, hs, ls, inline, nw, pb, eb, N(piv), np_of(ext), np_of(widths),
                g.anchor_rows)

    run_blocks(block, blocks(R, g.cols, _quantum(codec, g)))
    return payload


def decode(codec: TAHQuant, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    g, sec, out = codec._begin_decode(payload, shape, dtype)
    sec = FastSections.of(sec)
    if not g.numel:
        return out
    R, T, G = g.rows, g.tiles, g.tile
    high, k = codec._alloc(sec, payload, 0, R, g)
    mixed = high is not None
    levels = codec._levels(high, k)
    rotpiv = torch.full((R, T), -1, dtype=torch.int32)
    ext = None
    rotated = False
    inline = codec.inline
    widths = torch.zeros(0, dtype=torch.int64)
    hmask = (high if high is not None else torch.full((R, T), k > 0)).contiguous()
    if inline:  # the rotated tiles' pivots and zero extensions are in their blocks
        flags = sec.get(payload, "rotflag", 0, R * T).view(R, T).bool()
        idx = flags.view(-1).nonzero().squeeze(1)
        if codec.per_block:  # each block's zero extension, named by its anchor (read once, for the fit's read too)
            anchor, tags = codec.lay.split_anchor(sec.get(payload, "anchor", 0, g.n_blocks))
            widths = codec._anchor_widths(sec, payload, 0, R, g, tags=tags)[0].contiguous()
            wi = widths[idx // (T * g.anchor_rows)]  # each rotated tile's block's: _tile_widths(...)[idx]
            rpiv, e = torch.zeros_like(idx), torch.zeros_like(idx)
            for w in (torch.unique(wi).tolist() if idx.numel() else ()):
                at = (wi == w).nonzero().squeeze(1)
                rpiv[at], e[at] = codec._block_heads(sec, payload, g, idx[at], hmask, mixed, eb=w)
        else:
            rpiv, e = codec._block_heads(sec, payload, g, idx, hmask, mixed)
        rotpiv.view(-1)[idx] = rpiv.to(torch.int32)
        if codec.extends:
            ext = torch.zeros(R * T, dtype=torch.int64)
            ext[idx] = e
            ext = ext.view(R, T)
        rotated = idx.numel() > 0
    elif codec.rotates:
        m = codec.slot_count(g)
        flags = sec.get(payload, "rotflag", 0, R * T).view(R, T).bool()
        slots = sec.get(payload, "pivot", 0, R * m).view(R, m)
        ze = codec.zero_ext if codec.extends else 0
        lo8 = sec.get(payload, "zext", 0, R * m).view(R, m) if ze else slots
        hi8 = sec.get(payload, "zext_hi", 0, R * m).view(R, m) if ze > 8 else lo8
        ext = torch.empty(R, T if ze else 0, dtype=torch.int64)
        worst = rotation_meta(np_of(flags), np_of(slots), np_of(lo8), np_of(hi8), ze, np_of(rotpiv), np_of(ext))
        if worst > m:
            codec._check_count(flags, m, "rotated tiles per token", exact=False)
        rotated = bool(flags.any())
        ext = ext if ze else None
    lh, ll = (1 << codec.high_bits) - 1, (1 << codec.low_bits) - 1
    if inline and not mixed and isinstance(codec.lay, LogLayout):  # two widths: the tiles' and the narrowed
        lv = (lh, (lh + 1) // 2 - 1) if k else (ll, (ll + 1) // 2 - 1)
        z, s = read_log(codec.lay, sec, payload, g, False, lv, ~flags, ext, anchor if codec.per_block else None)
    elif inline:  # the rotated tiles' metadata is that of their narrower width
        z, s = codec.lay.read(sec, payload, 0, R, g, False, codec._narrow(levels, flags),
                              **({} if ext is None else {"zero_ext": ext}))
    elif isinstance(codec.lay, LogLayout):
        lv = (lh, ll) if mixed else (levels, levels)
        z, s = read_log(codec.lay, sec, payload, g, False, lv, high if mixed else None, ext)
    elif ext is not None:
        z, s = codec.lay.read(sec, payload, 0, R, g, False, levels, zero_ext=ext)
    else:
        z, s = codec.lay.read(sec, payload, 0, R, g, False, levels)
    z, s = z.contiguous(), s.contiguous()
    direct = dtype == torch.float32 and g.padded == g.cols
    vals = out.view(R, g.cols) if direct else torch.empty(R, g.padded)
    off_h, off_l = sec.offsets["high"], sec.offsets["low"]
    scale = normalization(G)
    nw = G - codec.narrowed if inline else 0
    skip = sum(codec._block_fields()) if inline else 0

    bounds = []

    def block(r0: int, r1: int) -> None:
        hs, ls = _stream_starts(codec, g, r0, k, mixed)
        bounds.append(float(dequant_d(r0, r1, np_of(payload), G, np_of(z), np_of(s), np_of(hmask), np_of(rotpiv),
                                      codec.high_bits, codec.low_bits, off_h, off_l, hs, ls, scale, np_of(vals),
                                      inline, nw, skip, np_of(widths), g.anchor_rows, int(math.log2(G)))))

    run_blocks(block, blocks(R, g.padded, _quantum(codec, g)))
    bound = math.nan if any(math.isnan(b) for b in bounds) else max(bounds)  # tiles.values_bound
    check_decoded(vals, bound * (G if rotated else 1), codec.name)
    if not direct:
        store_out(out.view(R, g.cols), 0, vals.view(R, T, G), g)
    return out


def read_fields(codec: TAHQuant, payload: torch.Tensor, shape, names: tuple[str, ...]) -> list[torch.Tensor]:
    """``TAHQuant.read_fields`` with the compiled unpacking of :class:`FastSections`."""
    sec = FastSections.of(codec._layout(tuple(shape))[1])
    return [sec.get(payload, n, 0, sec.fields[n].count) for n in names]


register_kernels("cpu", "TAHQuant", supports=lambda c: c.rounding == "nearest" and (c.tile >= 8 or not c.inline),
                 encode=encode, decode=decode, read_fields=read_fields)
