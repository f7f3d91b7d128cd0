"""The Triton kernels of a ``log`` layout's per-tile fit (``kernels/gpu/_fit.py``) against
``LogLayout.fit``: the same zeros, steps and metadata for every layout, bit width mix, outlier-tile choice
(given, or found from the sums of squares in the kernel), zero extension and anchor block, on tiles with
zeros, constant and one-signed tiles and outliers. Runs under Triton's interpreter where there is no GPU
(tests/conftest.py), on CUDA tensors where there is."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from qwire.codecs import get_codec, layouts  # noqa: E402
from qwire.codecs.kernels.gpu._fit import fit  # noqa: E402
from qwire.codecs.tiles import sparse_tiles, sum_squares  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TAH = get_codec("tahquant", impl="torch")
LOG_LAYOUTS = {name: lay for name, lay in {**layouts.LAYOUTS, **layouts.EXTENDED_LAYOUTS}.items()
               if isinstance(lay, layouts.LogLayout)}


def _ranges(R: int, T: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(R, T, 32, generator=g) * torch.exp(torch.randn(R, T, 1, generator=g) * 2)
    x[torch.rand(R, T, generator=g) < 0.1] = 0.0  # all-zero tiles
    x[..., 0] += (torch.rand(R, T, generator=g) < 0.2) * 50 * torch.randn(R, T, generator=g)  # outliers
    pos = torch.rand(R, T, generator=g) < 0.15
    x[pos] = x[pos].abs()  # tiles of one sign
    x[0, 0] = 1.5  # a constant tile
    x[..., 1] += (torch.rand(R, T, generator=g) < 0.2) * 40 * torch.randn(R, T, generator=g)  # a second outlier
    mags = x.abs().topk(2, dim=-1).values
    sq = sum_squares(x).masked_fill(torch.rand(R, T, generator=g) < 0.1, float("inf"))  # rotated tiles: inf
    return x.amin(-1), x.amax(-1), sq, mags[..., 0], mags[..., 1].square()


@pytest.mark.parametrize("name", sorted(LOG_LAYOUTS))
def test_fit_kernels_equal_the_reference(name: str) -> None:
    lay = LOG_LAYOUTS[name]
    g = torch.Generator().manual_seed(0)
    cases = 0
    for R, T in ((5, 7), (70, 33)):
        lo, hi, sq, a1, a2sq = _ranges(R, T, g)
        for sym, outliers, ext, mixed, ar in itertools.product((False, True), ("none", "given", "stats", "two"),
                                                               (False, True), (False, True), (1, 4, 64)):
            if sym and (ext or outliers != "none"):
                continue
            levels = torch.where(torch.rand(R, T, generator=g) < 0.5, 15.0, 7.0) if mixed else 15
            kw = {}
            if ext:  # TAH-Quant's rotated tiles: a wider zero code
                rotated = torch.rand(R, T, generator=g) < 0.3
                span = float(1 << lay.zero_bits)
                kw = {"kmin": torch.where(rotated, lay.kmin - span * 4, float(lay.kmin)),
                      "kmax": torch.where(rotated, lay.kmax + span * 3, float(lay.kmax))}
            kw = {k: v.to(DEVICE) for k, v in kw.items()}
            args = (lo.to(DEVICE), hi.to(DEVICE), levels.to(DEVICE) if mixed else levels, sym, ar)
            if outliers == "stats":  # the int codecs: the outlier tiles from the sums of squares, in the kernel
                sparse = sparse_tiles(sq.to(DEVICE), args[0], args[1], args[2], 32)
                z1, s1, v1 = fit(lay, *args, sq=sq.to(DEVICE), tile=32, **kw)
                assert torch.equal(v1.pop("sparse"), sparse)
            elif outliers == "two":  # TAH-Quant's: one outlier, or two well above the rest
                st = [t.to(DEVICE) for t in (sq, a1, a2sq)]
                sparse = TAH._outlier_tiles(st[0], args[0], args[1], args[2], st[1], st[2], SimpleNamespace(tile=32))
                z1, s1, v1 = fit(lay, *args, sq=st[0], tile=32, a1=st[1], a2sq=st[2], **kw)
                assert torch.equal(v1.pop("sparse"), sparse)
            else:
                sparse = (torch.rand(R, T, generator=g) < 0.5).to(DEVICE) if outliers == "given" else None
                z1, s1, v1 = fit(lay, *args, sparse, **kw)
            z0, s0, v0 = lay.fit(*args, "test", sparse, **kw)
            what = (lay.name, R, T, sym, outliers, ext, mixed, ar)
            assert torch.equal(z1, z0) and torch.equal(s1, s0), what
            assert sorted(v1) == sorted(v0), what
            for k in v0:
                assert v1[k].dtype == v0[k].dtype and torch.equal(v1[k].reshape(-1), v0[k].reshape(-1)), (k, what)
            cases += 1
    assert cases == 2 * 3 * (16 + 2)
