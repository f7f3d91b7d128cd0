"""TAH-Quant's rotation of the chosen tiles in Triton: :func:`qwire.codecs.tahquant.rotate` (pivot swap, then
the normalized Hadamard transform) of tiles gathered from the rows, and :func:`~qwire.codecs.tahquant.unrotate`
in place on the decoded values. The butterfly is the ``fp8`` kernels' (the reference's order of fp32 additions),
then one multiplication by ``hadamard.normalization(G)``; the swap is done by reading (or writing) the pivot's
element at position 0 and element 0 at the pivot's position, exactly."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...hadamard import normalization
from ._common import cdiv, launch, listed_at
from .fp8 import butterfly

ROT_ELEMS = 4096  # elements per program: BG tiles of G


@triton.jit
def _swapped(j, p):
    """Positions ``j`` ``(G,)`` of tiles whose element ``p`` ``(BG,)`` trades places with element 0: ``(BG, G)``."""
    return tl.where(j[None, :] == 0, p[:, None], tl.where(j[None, :] == p[:, None], 0, j[None, :]))


@triton.jit
def rotated_tiles(X, C, T, ti, p, m, NORM, BG: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr):
    """Tiles ``ti`` ``(BG,)`` (row-major ids; ``m``: which are real) of the flat rows ``X`` (``C`` columns, ``T``
    tiles per row; a short last tile repeats the row's last element), element ``p`` swapped with element 0,
    Hadamard-transformed: ``(BG, G)`` fp32, as :func:`qwire.codecs.tahquant.rotate` computes them."""
    r = ti // T
    t = ti - r * T
    src = _swapped(tl.arange(0, G).to(tl.int64), p)
    col = tl.minimum(t[:, None] * G + src, C - 1)
    y = tl.load(X + r[:, None] * C + col, mask=m[:, None], other=0.0).to(tl.float32)
    return butterfly(y, BG, G, LOG2G) * NORM


@triton.jit
def _rotate_body(X, C, T, k, ti, p, m, OUT, NORM, LO, HI, POS, BG: tl.constexpr, G: tl.constexpr,
                 LOG2G: tl.constexpr, STATS: tl.constexpr, HAS_POS: tl.constexpr, STORE: tl.constexpr):
    y = rotated_tiles(X, C, T, ti, p, m, NORM, BG, G, LOG2G)
    if STORE:
        j = tl.arange(0, G).to(tl.int64)
        tl.store(OUT + k[:, None] * G + j[None, :], y, mask=m[:, None])
    if STATS:
        tl.store(LO + ti, tl.min(y, axis=1) + 0.0, mask=m)
        tl.store(HI + ti, tl.max(y, axis=1) + 0.0, mask=m)
        if HAS_POS:
            tl.store(POS + ti, k.to(tl.int32), mask=m)


@triton.jit
def _rotate(X, C, T, IDX, CNT, PIV, n, OUT, NORM, LO, HI, POS, BG: tl.constexpr, G: tl.constexpr,
            LOG2G: tl.constexpr, STATS: tl.constexpr, HAS_POS: tl.constexpr, ONDEV: tl.constexpr):
    """Rows ``k`` of ``OUT`` ``(n, G)``: the tile ``IDX[k]`` (row-major id; a short last tile repeats the row's
    last element) with element ``PIV[k]`` swapped with element 0, Hadamard-transformed. With ``STATS``: the
    rotated tile's min and max (``+ 0``: no -0) into ``LO``, ``HI`` and (``HAS_POS``) ``k`` into ``POS``, at
    ``IDX[k]``. ``ONDEV``: ``k`` below the count ``CNT`` of the device list ``IDX`` (:mod:`._blocks`), the pivot
    ``PIV[IDX[k]]``, only the min and max written (the block kernel rotates the tiles again)."""
    k = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG).to(tl.int64)
    if ONDEV:
        cnt = tl.load(CNT)
        if tl.program_id(0) * BG < cnt:
            m, ti, p = listed_at(IDX, PIV, k, cnt)
            _rotate_body(X, C, T, k, ti, p, m, OUT, NORM, LO, HI, POS, BG, G, LOG2G, True, False, False)
    else:
        m = k < n
        ti = tl.load(IDX + k, mask=m, other=0).to(tl.int64)
        p = tl.load(PIV + k, mask=m, other=0).to(tl.int64)
        _rotate_body(X, C, T, k, ti, p, m, OUT, NORM, LO, HI, POS, BG, G, LOG2G, STATS, HAS_POS, True)


@triton.jit
def _unrotate(V, IDX, PIV, n, NORM, BG: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr):
    """Rows ``IDX[k]`` of ``V`` ``(*, G)`` in place: Hadamard-transformed, then element 0 and element ``PIV[k]``
    swapped back."""
    k = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG).to(tl.int64)
    m = k < n
    ti = tl.load(IDX + k, mask=m, other=0).to(tl.int64)
    p = tl.load(PIV + k, mask=m, other=0).to(tl.int64)
    j = tl.arange(0, G).to(tl.int64)
    y = tl.load(V + ti[:, None] * G + j[None, :], mask=m[:, None], other=0.0)
    y = butterfly(y, BG, G, LOG2G) * NORM
    dst = _swapped(j, p)
    tl.store(V + ti[:, None] * G + dst, y, mask=m[:, None])


def _shape(G: int) -> tuple[int, int]:
    return max(1, ROT_ELEMS // G), G.bit_length() - 1


def rotate(X: torch.Tensor, g, idx: torch.Tensor, piv: torch.Tensor, lo: torch.Tensor | None = None,
           hi: torch.Tensor | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
    """``tahquant.rotate(tiles, piv)`` of the tiles ``idx`` (row-major ids) of the flat rows ``X`` of geometry
    ``g`` (a short last tile padded with the row's last element): ``(n, G)`` fp32. With ``lo`` and ``hi`` (and
    ``pos``; contiguous, one value per tile): each rotated tile's min and max (no -0) (and its row in the
    result) are written at its id."""
    G, n = g.tile, idx.numel()
    out = torch.empty(n, G, device=X.device)
    if n:
        bg, log2g = _shape(G)
        stats = lo is not None
        launch(_rotate, (cdiv(n, bg),), X, g.cols, g.tiles, idx.contiguous(), idx, piv.reshape(-1).contiguous(), n,
               out, normalization(G), lo if stats else out, hi if stats else out, pos if pos is not None else out,
               BG=bg, G=G, LOG2G=log2g, STATS=stats, HAS_POS=pos is not None, ONDEV=False)
    return out


def rotated_stats(X: torch.Tensor, g, lst, piv: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """The min and max (no -0) of the tiles of the :class:`~._blocks.DeviceList` ``lst`` once rotated (``piv``:
    every tile's pivot), written at their ids in ``lo`` and ``hi``; no host sync (the grid has room for every
    tile, the programs past the list's count do nothing)."""
    G, n = g.tile, lst.ids.numel()
    if n:
        bg, log2g = _shape(G)
        launch(_rotate, (cdiv(n, bg),), X, g.cols, g.tiles, lst.ids, lst.count, piv.reshape(-1).contiguous(), n,
               lo, normalization(G), lo, hi, lo, BG=bg, G=G, LOG2G=log2g, STATS=True, HAS_POS=False, ONDEV=True)


def unrotate_(vals: torch.Tensor, idx: torch.Tensor, piv: torch.Tensor) -> None:
    """``v[idx] = tahquant.unrotate(v[idx], piv)`` in place, ``v = vals.view(-1, G)`` (contiguous fp32)."""
    G, n = vals.shape[-1], idx.numel()
    if n:
        bg, log2g = _shape(G)
        launch(_unrotate, (cdiv(n, bg),), vals, idx.contiguous(), piv.reshape(-1).contiguous(), n,
               normalization(G), BG=bg, G=G, LOG2G=log2g)
