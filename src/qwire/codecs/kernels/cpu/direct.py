"""CPU kernels of ``int<b>`` (:mod:`qwire.codecs.direct`). ``log`` layouts: one pass over the input,
an anchor block at a time (tile statistics, the numba mirror of the layout's fit, quantize + pack,
while the block is in cache; ``fit=mse``: statistics, then fit, search and quantize + pack per
block); other layouts: two passes (statistics, then quantize + pack) with the
layout's reference fit in between."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ...base import FP16_MAX, check_decoded, check_finite
from ...layouts import LAYOUTS, LogLayout
from ...tiles import MAX_ABS, SPARSE_KAPPA, check_range, sparse_tiles, values_bound
from .. import register_kernels
from ._common import Workspace, blocks, njit, np_of, run_blocks, workspace
from ._layouts import SPARSE_COMPUTE, SPARSE_GIVEN, SPARSE_NONE, log_fit_rows, log_read, mse_rows
from ._sections import FastSections
from ._tiles import SUB, quant_pack_rows, tile_stats, unpack_dequant_rows


def rows_fp32(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` as a contiguous fp32 (rows, cols) tensor (a view when it already is one)."""
    return x.detach().reshape(rows, cols).to(torch.float32).contiguous()


def stats_checks(x: torch.Tensor, sumsq: torch.Tensor, a1: torch.Tensor, name: str) -> None:
    """The codecs' input checks from per-tile statistics: NaN/Inf (they propagate into the sums of
    squares; squares beyond fp32 send the decision to the exact check) and the largest magnitude."""
    if not bool(torch.isfinite(sumsq).all()):
        check_finite(x, name)
    check_range(x, a1, name)


def stats(x: torch.Tensor, X: torch.Tensor, g, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tile (min, max, sum of squares) of ``X``, with the codecs' range checks."""
    lo = torch.empty(g.rows, g.tiles)
    hi, sumsq = torch.empty_like(lo), torch.empty_like(lo)
    run_blocks(tile_stats, blocks(g.rows, g.cols), np_of(X), g.tile, np_of(lo), np_of(hi), np_of(sumsq))
    stats_checks(x, sumsq, torch.maximum(hi, -lo), name)
    return lo, hi, sumsq


def store(out: torch.Tensor, vals: torch.Tensor) -> None:
    if out.dtype == torch.float16:
        vals.clamp_(-FP16_MAX, FP16_MAX)
    out.view(vals.shape).copy_(vals)


def lay_table(lay) -> np.ndarray:
    """The numpy view of a log layout's table of step values (the layout keeps the tensor)."""
    return np_of(lay._table(torch.device("cpu")))


@functools.cache
def mse_steps(lay) -> tuple[np.ndarray, np.ndarray]:
    """A log layout's ``MSE_FINER`` and ``MSE_SHIFTS`` as the int64 arrays the searches take (shared: not to
    be written; not flagged read only, which would make numba compile the searches again for that type)."""
    return np.array(lay.MSE_FINER, dtype=np.int64), np.array(lay.MSE_SHIFTS, dtype=np.int64)


def _fit_args(lay, lo, hi, sumsq, levels, symmetric, g, out, sparse=None, kmin=None, kmax=None, view=np_of) -> tuple:
    """The arguments of :func:`~qwire.codecs.kernels.cpu._layouts.log_fit_rows` after ``r0, r1`` (``view``: a
    tensor's numpy view, as :meth:`~qwire.codecs.kernels.cpu._common.Workspace.np`)."""
    mode = SPARSE_GIVEN if sparse is not None else (SPARSE_COMPUTE if sumsq is not None else SPARSE_NONE)
    ext = kmin is not None
    dummy, v = out["need"], view
    return (v(lo), v(hi), v(sumsq if sumsq is not None else lo), v(levels), symmetric, mode,
            v(sparse if sparse is not None else out["scale"].bool()), ext, v(kmin if ext else dummy),
            v(kmax if ext else dummy), g.tile, SPARSE_KAPPA, g.anchor_rows, lay.per_octave, lay.zero_code,
            lay.kmin, lay.kmax, lay.zero_span, lay.zero_bits, lay.align, lay_table(lay), (1 << lay.tag_bits) - 1,
            v(out["need"]), v(out["jal"]), v(out["z"]), v(out["s"]), v(out["scale"]), v(out["zero"]), v(out["khigh"]),
            v(out["anchor"]))


@njit
def fused_rows(r0, r1, step, X, tile, lo, hi, sumsq, max_abs, fit, z, s, bias, qmax, out, off, bits):
    """Rows r0..r1, ``step`` rows at a time (whole anchor blocks, a multiple of 8 rows): the tile
    statistics, the log fit (``fit``: the arguments of ``log_fit_rows`` after r0, r1), then quantize +
    pack, while the block is in cache. Stops before fitting a block whose statistics hold a non-finite
    sum of squares or a magnitude beyond ``max_abs`` and returns its first row (the caller then runs the
    checks on the whole input); -1 when every row is done."""
    T = lo.shape[1]
    for b0 in range(r0, r1, step):
        b1 = min(b0 + step, r1)
        tile_stats(b0, b1, X, tile, lo, hi, sumsq)
        for r in range(b0, b1):
            for t in range(T):
                if not (np.isfinite(sumsq[r, t]) and max(hi[r, t], -lo[r, t]) <= max_abs):
                    return b0
        log_fit_rows(b0, b1, *fit)
        quant_pack_rows(b0, b1, X, tile, z, s, bias, qmax, out, off, bits)
    return -1


def fit_log(lay, lo: torch.Tensor, hi: torch.Tensor, sumsq: torch.Tensor | None, levels: torch.Tensor,
            symmetric: bool, g, r0: int, r1: int, out: dict[str, torch.Tensor], sparse: torch.Tensor | None = None,
            kmin: torch.Tensor | None = None, kmax: torch.Tensor | None = None, view=np_of) -> None:
    """``LogLayout.fit`` for rows r0..r1 (whole anchor blocks) into the arrays of ``out``
    (see :func:`qwire.codecs.kernels.cpu._layouts.log_fit_rows`). ``sparse`` given: the outlier-tile
    flags as the caller computed them; else computed here from ``sumsq`` (None: no test)."""
    log_fit_rows(r0, r1, *_fit_args(lay, lo, hi, sumsq, levels, symmetric, g, out, sparse, kmin, kmax, view))


def refine_log(lay, Xn: np.ndarray, g, lo: torch.Tensor, hi: torch.Tensor, levels: torch.Tensor,
               symmetric: bool, r0: int, r1: int, out: dict[str, torch.Tensor],
               mask: torch.Tensor | None = None, view=np_of) -> None:
    """``LogLayout.refine`` (``fit=mse``) of rows r0..r1 after :func:`fit_log` wrote ``out``: the tiles'
    ``z``, ``s``, step and zero codes in place (``mask``: the tiles it may change, default all)."""
    v = view
    none = np.empty((g.rows, 0), dtype=np.bool_)
    mse_rows(r0, r1, Xn, g.tile, v(lo), v(hi), v(levels), v(mask) if mask is not None else none, mask is not None,
             symmetric, v(out["anchor"]), g.anchor_rows, lay_table(lay), lay.zero_code, lay.kmin, lay.kmax,
             np.float32(lay.zero_span / float(1 << (lay.zero_bits - 1))), *mse_steps(lay), v(out["z"]), v(out["s"]),
             v(out["scale"]), v(out["zero"]))


@functools.lru_cache(maxsize=64)
def _zero_units(lay, levels_hl: tuple[float, float]) -> tuple[np.float32, np.float32]:
    u = lay.unit(torch.tensor(levels_hl, dtype=torch.float32))  # the reference's fp32 unit
    return np.float32(u[0]), np.float32(u[1])


def read_log(lay, sec, payload: torch.Tensor, g, symmetric: bool, levels_hl: tuple[float, float],
             high: torch.Tensor | None = None, zero_ext: torch.Tensor | None = None,
             anchor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``LogLayout.read`` of the whole payload (zeros, steps ``(R, T)``) in one compiled loop: the levels
    are ``levels_hl[0]`` where ``high`` (every tile when None), else ``levels_hl[1]``. ``anchor``: the
    anchors without their tags, when the caller has read them already."""
    R, T = g.rows, g.tiles
    if anchor is None:
        anchor = lay.split_anchor(sec.get(payload, "anchor", 0, g.n_blocks))[0]
    scale = sec.get(payload, "scale", 0, R * T)
    zero = scale if symmetric else sec.get(payload, "zero", 0, R * T)
    u0, u1 = _zero_units(lay, tuple(float(v) for v in levels_hl))
    z, s = torch.empty(R, T), torch.empty(R, T)
    none = np.empty((R, 0), dtype=np.bool_)
    log_read(np_of(anchor.contiguous()), g.anchor_rows, np_of(scale), np_of(zero), lay_table(lay), lay.kmin,
             lay.zero_bits, u0, u1, np_of(high.contiguous()) if high is not None else none,
             np_of(zero_ext) if zero_ext is not None else np.empty((R, 0), dtype=np.int64), symmetric, np_of(z),
             np_of(s))
    return z, s


def fit_buffers(g, ws: Workspace | None = None) -> dict[str, torch.Tensor]:
    """The arrays :func:`fit_log` writes, for geometry ``g`` (from ``ws`` when given: scratch kept there)."""
    ws = ws if ws is not None else Workspace()
    shape = (g.rows, g.tiles)
    return {"need": ws.empty("fit.need", shape), "jal": ws.empty("fit.jal", shape), "z": ws.empty("fit.z", shape),
            "s": ws.empty("fit.s", shape), "scale": ws.empty("fit.scale", shape, torch.uint8),
            "zero": ws.empty("fit.zero", shape, torch.uint8), "khigh": ws.empty("fit.khigh", shape, torch.int32),
            "anchor": ws.empty("fit.anchor", (g.n_blocks,))}


def put_log(lay, sec, payload: torch.Tensor, fit: dict[str, torch.Tensor], symmetric: bool, g) -> None:
    vals = {"anchor": fit["anchor"], "scale": fit["scale"]}
    if not symmetric:
        vals["zero"] = fit["zero"]
    lay.put(sec, payload, vals, 0, g)


def encode(codec, x: torch.Tensor) -> torch.Tensor:
    g, sec, payload = codec._begin_encode(x)
    sec = FastSections.of(sec)
    if not g.numel:
        return payload
    X = rows_fp32(x, g.rows, g.cols)
    lay, L, sym = LAYOUTS[codec.layout], codec.levels, codec.symmetric
    bias = float(L // 2) if sym else -1.0
    top = float(2 * (L // 2) if sym else L)  # the largest code (symmetric: 2h, as the reference clamps)
    Xn, pn, off = np_of(X), np_of(payload), sec.offsets["codes"]
    if isinstance(lay, LogLayout):
        # one pass: statistics, fit, quantize + pack per anchor block (the block stays in cache)
        ws = workspace(codec, "encode", tuple(x.shape), g.numel)
        fit = fit_buffers(g, ws)
        levels = ws.full("levels", (g.rows, g.tiles), float(L))
        zn, sn = ws.np(fit["z"]), ws.np(fit["s"])
        lo, hi, sumsq = (ws.empty(name, (g.rows, g.tiles)) for name in ("lo", "hi", "sumsq"))
        args = _fit_args(lay, lo, hi, None if sym else sumsq, levels, sym, g, fit, view=ws.np)
        step = math.lcm(SUB, g.anchor_rows)
        stopped = []

        def fused(r0: int, r1: int) -> None:
            if fused_rows(r0, r1, step, Xn, g.tile, ws.np(lo), ws.np(hi), ws.np(sumsq), MAX_ABS, args, zn, sn,
                          bias, top, pn, off, codec.bits) >= 0:
                stopped.append(r0)

        if not codec.searches:  # (fit=mse: statistics, covering fit, the search, then quantize + pack, below)
            run_blocks(fused, blocks(g.rows, g.cols, step))
        if stopped or codec.searches:  # the checks on the whole input (they raise for NaN/Inf, out-of-range) ...
            lo, hi, sumsq = stats(x, X, g, codec.name)
            # fit=mse: outlier tiles keep the covering grid (the search would clip their outliers)
            keep = (~sparse_tiles(sumsq, lo, hi, L, g.tile)).contiguous() if codec.searches else None

            def block(r0: int, r1: int) -> None:  # ... and the passes one after the other if they pass
                fit_log(lay, lo, hi, None if sym else sumsq, levels, sym, g, r0, r1, fit, view=ws.np)
                if codec.searches:
                    refine_log(lay, Xn, g, lo, hi, levels, sym, r0, r1, fit, keep, view=ws.np)
                quant_pack_rows(r0, r1, Xn, g.tile, zn, sn, bias, top, pn, off, codec.bits)

            run_blocks(block, blocks(g.rows, g.cols, step))
        put_log(lay, sec, payload, fit, sym, g)
        return payload
    lo, hi, sumsq = stats(x, X, g, codec.name)
    sparse = None if sym else sparse_tiles(sumsq, lo, hi, L, g.tile)
    z, s, vals = lay.fit(lo, hi, L, sym, g.anchor_rows, codec.name, sparse)
    lay.put(sec, payload, vals, 0, g)
    run_blocks(quant_pack_rows, blocks(g.rows, g.cols, SUB), Xn, g.tile, np_of(z.contiguous()),
               np_of(s.contiguous()), bias, top, pn, off, codec.bits)
    return payload


def decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    g, sec, out = codec._begin_decode(payload, shape, dtype)
    sec = FastSections.of(sec)
    if not g.numel:
        return out
    lay = LAYOUTS[codec.layout]
    if isinstance(lay, LogLayout):
        z, s = read_log(lay, sec, payload, g, codec.symmetric, (codec.levels, codec.levels))
    else:
        z, s = lay.read(sec, payload, 0, g.rows, g, codec.symmetric, codec.levels)
    direct = dtype == torch.float32
    vals = out.view(g.rows, g.cols) if direct else torch.empty(g.rows, g.cols)
    h = codec.levels // 2 if codec.symmetric else -1
    run_blocks(unpack_dequant_rows, blocks(g.rows, g.cols, SUB), np_of(payload), sec.offsets["codes"], codec.bits,
               g.tile, np_of(z.contiguous()), np_of(s.contiguous()), h, np_of(vals))
    check_decoded(vals, values_bound(z, s, codec.levels), codec.name)
    if not direct:
        store(out, vals)
    return out


register_kernels("cpu", "DirectInt", supports=lambda c: c.rounding == "nearest", encode=encode, decode=decode)
