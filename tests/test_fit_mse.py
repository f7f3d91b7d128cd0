"""``fit=mse``: the encoder's per-tile search for the grid of lowest squared error (log layouts).

Same payload format and decoder as ``fit=minmax``; the error bound widens to
``LogLayout.mse_bound`` steps; each tile's squared error is never above the covering fit's.
Kernels against the reference: test_kernels.py (CPU) and test_kernels_triton.py (Triton).
"""

from __future__ import annotations

import math

import pytest
import torch

from qwire.codecs import CodecError, get_codec
from qwire.codecs.layouts import LAYOUTS
from qwire.codecs.synthetic import llm_like
from qwire.codecs.tiles import geometry, load_tiles

SPECS = ["int4:layout=log7", "int3:layout=log6", "int4", "int2:tile=16", "int4:layout=log7,symmetric=true",
         "tahquant", "tahquant:layout=log6", "tahquant:ratio=0.8",
         "tahquant:slots=token,ratio=0.8,layout=logx,zero_ext=8"]


def _inputs():
    g = torch.Generator().manual_seed(11)
    yield "randn", torch.randn(8, 64, 256, generator=g)
    yield "offset", torch.randn(4, 32, 96, generator=g) * 0.1 + 7.0  # tiles far from 0
    yield "llm", llm_like((2, 64, 1024), magnitude=1e4, channel_magnitude=300.0, seed=2)[0]
    yield "short", torch.randn(5, 7, 100, generator=g) * 3  # padded last tiles


def _tile_sse(x: torch.Tensor, y: torch.Tensor, tile: int) -> torch.Tensor:
    g = geometry(x.shape, tile)
    d = (x.double() - y.double()).reshape(g.rows, g.cols)
    return load_tiles(d.float(), g).double().square().sum(-1)  # padding repeats the last column's error


@pytest.mark.parametrize("spec", SPECS)
def test_mse_lowers_every_tile_error_and_keeps_the_format(spec):
    for name, x in _inputs():
        sep = "," if ":" in spec else ":"
        mm, mse = get_codec(spec + sep + "fit=minmax"), get_codec(spec + sep + "fit=mse")
        p0, p1 = mm.encode(x), mse.encode(x)
        assert p0.numel() == p1.numel() == mse.payload_nbytes(x.shape, x.dtype)
        y0, y1 = mm.decode(p0, x.shape, x.dtype), mse.decode(p1, x.shape, x.dtype)
        # the decoder does not depend on the fit: a minmax codec reads the mse payload alike
        assert torch.equal(mm.decode(p1, x.shape, x.dtype), y1)
        e0, e1 = _tile_sse(x, y0, mm.tile), _tile_sse(x, y1, mse.tile)
        if spec.startswith("tahquant"):  # rotated tiles (searched too) err by a fp32 rotation's rounding: in sum
            e0, e1 = e0.sum(), e1.sum()
        assert bool((e1 <= e0 * (1 + 1e-6) + 1e-30).all()), f"{spec} {name}: a tile got worse"
        if name in ("randn", "short") and not spec.startswith("int2"):  # (2 bits: nothing to gain by clipping)
            assert float(e1.sum()) < 0.95 * float(e0.sum()), f"{spec} {name}: no gain"
        # the widened bound holds (fp32 rounding aside)
        b = mse.error_bound(x, p1)
        assert bool(((x - y1).abs() <= b * (1 + 1e-5) + 1e-6 * x.abs()).all()), f"{spec} {name}: bound"


def test_mse_gain_on_gaussian_tiles():
    """The reason for the option: 4-bit log7 tiles of N(0, 1) lose ~1 dB to the coarse step and zero
    codes; the search wins most of it back (the fp16 layout's min-max fit, 0.6 bits more, for scale)."""
    x = torch.randn(16, 128, 512, generator=torch.Generator().manual_seed(5))

    def db(spec):
        c = get_codec(spec)
        y = c.decode(c.encode(x), x.shape, x.dtype)
        return 10 * math.log10(float(((x - y) ** 2).sum() / (x ** 2).sum()))

    base, mse, ref = db("int4:layout=log7"), db("int4:layout=log7,fit=mse"), db("int4:layout=ref")
    assert mse < base - 0.8
    assert mse < ref + 0.3


def test_tahquant_rotated_tiles_are_searched_with_fit_rotated():
    """``fit_rotated=true``: each rotated tile's grid is searched too, on its two widths; the error of every rotated
    tile is at most the covering grid's, and lower in sum. ``fit_rotated=false`` keeps their covering fit and
    searches the same unrotated tiles alike (all with ``layout=log7`` and a fixed zero extension: the same widths)."""
    x, _ = llm_like((2, 64, 1024), massive=2, outlier_channels=4, magnitude=1e3, channel_magnitude=1e3, seed=1)
    mm, off, on = (get_codec(f"tahquant:layout=log7,{o}") for o in ("fit=minmax", "fit_rotated=false",
                                                                    "fit_rotated=true"))
    g = mm.geometry(x.shape)
    sec = mm.sections(g)
    p0, p1, p2 = mm.encode(x), off.encode(x), on.encode(x)
    flags = mm._flags(sec, p0, 0, g.rows, g)
    assert bool(flags.any())
    assert torch.equal(flags, mm._flags(sec, p1, 0, g.rows, g)) and torch.equal(flags, mm._flags(sec, p2, 0, g.rows, g))
    s0, s1, s2 = (sec.get(p, "scale", 0, g.n_tiles).view(g.rows, g.tiles) for p in (p0, p1, p2))
    assert torch.equal(s0[flags], s1[flags])
    assert not torch.equal(s0[~flags], s1[~flags])
    assert torch.equal(s1[~flags], s2[~flags])
    assert not torch.equal(s1[flags], s2[flags])
    e1 = _tile_sse(x, off.decode(p1, x.shape, x.dtype), 32)[flags]
    e2 = _tile_sse(x, on.decode(p2, x.shape, x.dtype), 32)[flags]
    assert bool((e2 <= e1 * (1 + 1e-4) + 1e-6).all())  # (the same error, up to the fp32 rotation's rounding)
    assert float(e2.sum()) < 0.9 * float(e1.sum())
    b = on.error_bound(x, p2)
    y2 = on.decode(p2, x.shape, x.dtype)
    assert bool(((x - y2).abs() <= b * (1 + 1e-5) + 1e-6 * x.abs()).all())


def test_refine_leaves_zero_and_masked_tiles_alone():
    lay = LAYOUTS["log7"]
    t = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(3))
    t[0, 1] = 0.0
    lo, hi = t.amin(-1), t.amax(-1)
    z, s, vals = lay.fit(lo, hi, 15, False, 8, "t")
    before = {k: v.clone() for k, v in vals.items()}
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 2] = False
    z2, s2 = lay.refine(t, lo, hi, z, s, vals, 15, False, 8, mask)
    assert s2[0, 1] == 0 and vals["scale"][0, 1] == before["scale"][0, 1]
    assert s2[1, 2] == s[1, 2] and vals["zero"][1, 2] == before["zero"][1, 2]
    assert torch.equal(vals["anchor"], before["anchor"])
    assert bool((s2 <= s).all())  # candidates are only ever finer


@pytest.mark.parametrize("spec", ["int4:layout=ref", "tahquant:layout=ref", "int4:rounding=stochastic",
                                  "tahquant:rounding=stochastic"])
def test_mse_applies_only_where_it_can(spec):
    """fit=mse (tahquant's default) searches log layouts with nearest rounding; layout=ref keeps the
    reference's min-max fit and stochastic rounding keeps every tile covered (clipping would bias it)."""
    x = torch.randn(4, 16, 96, generator=torch.Generator().manual_seed(2))
    a, b = get_codec(spec + ",fit=mse"), get_codec(spec + ",fit=minmax")
    assert not a.searches and not b.searches
    assert torch.equal(a.encode(x), b.encode(x))
    assert torch.equal(a.error_bound(x), b.error_bound(x))


def test_fit_choices_and_defaults():
    assert get_codec("tahquant").fit == "mse" and get_codec("tahquant").searches
    assert get_codec("int4").fit == "minmax" and not get_codec("int4").searches
    for preset in ("tahquant-paper", "tahquant-public"):
        assert get_codec(preset).fit == "minmax"
    with pytest.raises(CodecError, match="fit"):
        get_codec("int4:fit=best")


def test_spec_key_leaves_out_the_legacy_fit():
    old = "int:bits=4,tile=32,symmetric=false,rounding=nearest,seed=0,layout=log"
    c = get_codec("int4")
    assert c.spec() == old + ",fit=minmax" and c.spec_key() == old
    assert get_codec(c.spec()) == c  # the full spec still builds the same codec
    m = get_codec("int4:fit=mse")
    assert m.spec_key() == m.spec() and m.spec_key() != c.spec_key()
    assert get_codec("fp32").spec_key() == "fp32"
