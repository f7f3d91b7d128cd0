"""``fit=mse`` in one Triton kernel: :meth:`~qwire.codecs.layouts.LogLayout.refine` for asymmetric tiles.

Each program takes ``BT`` tiles (row-major, across rows) and tries the reference's candidate grids on them: the covering
grid, then the step codes one and two finer, centred on the tile, each also one zero unit either side where
a unit is under a step. A candidate's squared error is computed as :meth:`LogLayout.tile_sse` computes it
(the codes of ``quantize_``, ``d = x - (z + q s)``, ``d * d`` summed into 8 lanes in element order, the lanes
then as the same tree), so the first grid of lowest error is the reference's, bit for bit. The tile is read
from the rows where it lies (a short last tile repeats the row's last element, as ``load_tiles`` pads it);
the reference builds a padded copy of the rows and quantizes a copy of it per candidate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...base import full_levels
from ._common import INTERPRET, cdiv, fma32, launch, rint

TILES_PER_PROGRAM = 64  # tiles per program; each pass over a candidate reads them 8 elements at a time


@triton.jit
def _sse(row, C, t, tin, last, z, s, L, G, NCH: tl.constexpr, BT: tl.constexpr, EXACT64: tl.constexpr):
    """Squared error ``(BT,)`` of tiles ``t`` of ``row`` quantized on grids ``(z, s)`` with ``L`` levels."""
    lane = tl.arange(0, 8)
    pos = s > 0
    inv = tl.where(pos, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(pos, s, 1.0)), 0.0)
    bias = -(z * inv)
    acc = tl.zeros((BT, 8), tl.float32)
    for ch in range(0, NCH):  # in element order: element i into lane i % 8
        j = ch * 8 + lane
        cols = t[:, None] * G + j[None, :]
        inb = tin[:, None] & (j[None, :] < G)
        x = tl.load(row[:, None] + cols, mask=inb & (cols < C), other=0.0).to(tl.float32)
        x = tl.where(inb & (cols >= C), last[:, None], x)
        v = fma32(x, inv[:, None], bias[:, None], EXACT64)
        v = tl.minimum(tl.maximum(v, 0.0), L[:, None])
        d = x - (z[:, None] + rint(v) * s[:, None])
        acc = acc + tl.where(inb, d * d, 0.0)
    # each lane on its own (the other seven terms are +0, so the sums are exact), then the reference's tree
    l0 = tl.sum(tl.where(lane[None, :] == 0, acc, 0.0), axis=1)
    l1 = tl.sum(tl.where(lane[None, :] == 1, acc, 0.0), axis=1)
    l2 = tl.sum(tl.where(lane[None, :] == 2, acc, 0.0), axis=1)
    l3 = tl.sum(tl.where(lane[None, :] == 3, acc, 0.0), axis=1)
    l4 = tl.sum(tl.where(lane[None, :] == 4, acc, 0.0), axis=1)
    l5 = tl.sum(tl.where(lane[None, :] == 5, acc, 0.0), axis=1)
    l6 = tl.sum(tl.where(lane[None, :] == 6, acc, 0.0), axis=1)
    l7 = tl.sum(tl.where(lane[None, :] == 7, acc, 0.0), axis=1)
    return ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))


@triton.jit
def _refine_log(X, C, T, N, G, LO, HI, Z, S, SCALE, ZC, LV, SKIP1, SKIP2, ANCH, AR, TAB, ZCODE, KMIN, KMAX,
                UNIT_F, OZ, OS, OSCALE, OZC, NCH: tl.constexpr, NSKIP: tl.constexpr, BT: tl.constexpr,
                EXACT64: tl.constexpr):
    """Program ``b``: tiles ``b * BT ..`` of the ``N`` (row-major ids; tile ``t`` of row ``r`` is ``r * T + t``).
    In: the covering fit (``Z``, ``S``, step code ``SCALE`` and zero code ``ZC``, uint8), levels ``LV``, the tiles
    not to search (set in ``SKIP1`` or, with ``NSKIP = 2``, ``SKIP2``; none with ``NSKIP = 0``), the anchors
    ``ANCH`` (one per ``AR`` rows) and the step table ``TAB``. Out: the chosen grid ``OZ``, ``OS`` and its codes
    ``OSCALE``, ``OZC`` (uint8)."""
    ti = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
    tin = ti < N
    r = ti // T
    t = ti - r * T
    row = X + r * C
    last = tl.load(row + C - 1, mask=tin, other=0.0).to(tl.float32)
    lo = tl.load(LO + ti, mask=tin, other=0.0)
    hi = tl.load(HI + ti, mask=tin, other=0.0)
    z = tl.load(Z + ti, mask=tin, other=0.0)
    s = tl.load(S + ti, mask=tin, other=0.0)
    c0 = tl.load(SCALE + ti, mask=tin, other=0).to(tl.int32)
    k0 = tl.load(ZC + ti, mask=tin, other=0).to(tl.float32) + KMIN
    L = tl.load(LV + ti, mask=tin, other=1.0)
    live = tin & (c0 < ZCODE)
    if NSKIP > 0:
        live = live & (tl.load(SKIP1 + ti, mask=tin, other=0) == 0)
    if NSKIP > 1:
        live = live & (tl.load(SKIP2 + ti, mask=tin, other=0) == 0)
    a = tl.load(ANCH + r // AR, mask=tin, other=0.0)
    best = _sse(row, C, t, tin, last, z, s, L, G, NCH, BT, EXACT64)
    bz, bs, bc, bk = z, s, c0, k0
    u = (L + 1.0) * UNIT_F
    mid = (lo + hi) * 0.5
    for d in tl.static_range(1, 3):  # LogLayout.MSE_FINER
        c = tl.minimum(c0 + d, ZCODE - 1)
        sc = a * tl.load(TAB + c, mask=tin, other=0.0)
        us = u * sc
        kc = tl.floor(tl.div_rn(mid - (L * sc) * 0.5, tl.where(us != 0, us, 1.0)) + 0.5)
        for j in tl.static_range(3):  # LogLayout.MSE_SHIFTS: 0, -1, 1
            if j == 0:
                k = kc
            elif j == 1:
                k = kc - 1.0
            else:
                k = kc + 1.0
            inside = (k >= KMIN) & (k <= KMAX)
            k = tl.minimum(tl.maximum(k, KMIN), KMAX)
            zc = (k * u) * sc
            e = _sse(row, C, t, tin, last, zc, sc, L, G, NCH, BT, EXACT64)
            ok = live & (us != 0) & inside & (e < best)
            if j > 0:
                ok = ok & (u < 1.0)
            best = tl.where(ok, e, best)
            bz = tl.where(ok, zc, bz)
            bs = tl.where(ok, sc, bs)
            bc = tl.where(ok, c, bc)
            bk = tl.where(ok, k, bk)
    tl.store(OZ + ti, bz, mask=tin)
    tl.store(OS + ti, bs, mask=tin)
    tl.store(OSCALE + ti, bc.to(tl.uint8), mask=tin)
    tl.store(OZC + ti, (bk - KMIN).to(tl.int32).to(tl.uint8), mask=tin)


def refine(lay, X: torch.Tensor, g, lo: torch.Tensor, hi: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
           vals: dict[str, torch.Tensor], levels: torch.Tensor | int, symmetric: bool, anchor_rows: int,
           skip: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``lay.refine`` (a :class:`~qwire.codecs.layouts.LogLayout`) of the flat rows ``X`` of geometry ``g``, with
    the same arguments and results (``vals``' ``scale`` and ``zero`` updated), the tiles set in any of ``skip``
    (bool ``(R, T)``, at most two) left out of the search; symmetric grids run the reference."""
    R, T, dev = g.rows, g.tiles, X.device
    if symmetric or lay.MSE_FINER != (1, 2) or lay.MSE_SHIFTS != (0, -1, 1):  # the candidates the kernel has
        from ...tiles import load_tiles

        mask = None
        for k in skip:
            mask = ~k if mask is None else mask & ~k
        return lay.refine(load_tiles(X.view(g.rows, g.cols), g), lo, hi, z, s, vals, levels, symmetric,
                          anchor_rows, mask)
    if len(skip) > 2:
        raise ValueError("refine: at most two skip masks")
    sk = [k.expand(R, T).contiguous() for k in skip] + [lo, lo]
    oz, os_ = torch.empty(R, T, device=dev), torch.empty(R, T, device=dev)
    oc = torch.empty(R, T, dtype=torch.uint8, device=dev)
    ozc = torch.empty(R, T, dtype=torch.uint8, device=dev)
    n = R * T
    bt = triton.next_power_of_2(min(n, 1 << 14)) if INTERPRET else TILES_PER_PROGRAM  # the interpreter: few programs
    launch(_refine_log, (cdiv(n, bt),), X, g.cols, T, n, g.tile, lo.contiguous(), hi.contiguous(),
           z.contiguous(), s.contiguous(), vals["scale"].contiguous(), vals["zero"].contiguous(),
           full_levels(levels, (R, T), dev).contiguous(), sk[0], sk[1], vals["anchor"].contiguous(), anchor_rows,
           lay._table(dev), lay.zero_code, float(lay.kmin), float(lay.kmax), float(lay.unit(0)), oz, os_, oc, ozc,
           NCH=cdiv(g.tile, 8), NSKIP=len(skip), BT=bt, EXACT64=INTERPRET)
    vals["scale"] = oc
    vals["zero"] = ozc
    return oz, os_
