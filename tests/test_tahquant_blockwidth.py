"""TAH-Quant's ``log6t`` layout (log6's grid, tapered to one code per octave far below the anchor, with a tag in
each anchor) and ``zero_width=block`` (each block of rows names its rotated tiles' zero-extension width in its
anchor): the tapered step codes, the tags, the choice of widths, the error on LLM-like inputs, and the compiled
kernels against the reference."""

from __future__ import annotations

import pytest
import torch

from qwire.codecs import CodecError, get_codec
from qwire.codecs.kernels import select
from qwire.codecs.layouts import EXTENDED_LAYOUTS
from qwire.codecs.synthetic import llm_like, ordinary_nmse

BLOCK = "tahquant:layout=log6t,zero_width=block,fit_rotated=true"  # the default, spelled out
LOG7 = "tahquant:layout=log7,fit_rotated=false"  # the default before log6t and zero_width
KINDS = {"channels": dict(massive=0, outlier_channels=4), "massive": dict(massive=2, outlier_channels=0),
         "both": dict(massive=2, outlier_channels=4)}


def _roundtrip(spec: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = get_codec(spec)
    p = c.encode(x)
    assert p.numel() == c.payload_nbytes(x.shape, x.dtype)
    return p, c.decode(p, x.shape, x.dtype)


def _inputs() -> list[torch.Tensor]:
    """Tiles far below their block's largest step (the tapered codes), outliers that need every width."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 64, 1024, generator=g)
    xs = [llm_like(base.shape, base=base, magnitude=m, channel_magnitude=m, massive=0, outlier_channels=2, pairs=1,
                   spacing=32, seed=1)[0] for m in (300.0, 1e4)]
    xs += [llm_like(base.shape, base=base, magnitude=m, channel_magnitude=m, seed=2, **KINDS["both"])[0]
           for m in (10.0, 300.0, 1e4)]
    x = torch.randn(3, 40, 256, generator=g)
    x[0, :, :32] *= 1e-5  # 16.6 octaves below the block's largest: the last code
    x[1, :, 100] = 3e4
    x[2, ::3, 7] = -2e3
    return [*xs, x, torch.randn(5, 100, generator=g)]


# ------------------------------------------------------------------------------ log6t
def test_log6t_steps_are_tapered():
    lay = EXTENDED_LAYOUTS["log6t"]
    tab = lay._table(torch.device("cpu")).double()
    octaves = -torch.log2(tab)
    assert torch.allclose(octaves[:55], torch.arange(55, dtype=torch.float64) / 8)  # log6's grid
    assert torch.allclose(octaves[54:] - octaves[54], torch.arange(9, dtype=torch.float64))  # then 1/octave
    assert lay.octaves == pytest.approx(14.75)
    assert lay.zero_code == 63 and lay.tag_bits == 4


def test_log6t_takes_the_largest_step_code_that_covers():
    """The fit's step code is canonical in the coarse codes too: the largest whose step is >= the tile's need."""
    lay = EXTENDED_LAYOUTS["log6t"]
    g = torch.Generator().manual_seed(3)
    hi = torch.exp2(-torch.rand(64, 16, generator=g) * 17.0)  # 17 octaves of ranges, the largest ~1
    hi[0, 0] = 1.0
    lo = -hi * torch.rand(64, 16, generator=g)
    L = torch.full_like(hi, 15.0)
    z, s, vals = lay.fit(lo, hi, L, False, 64, "t")
    anchor = vals["anchor"]
    assert int(anchor.view(torch.int32)) & 15 == 0  # rounded up to leave room for the tag
    tab = lay._table(torch.device("cpu"))
    c = vals["scale"].long()
    need = (hi - lo) / (L - lay.unit(L))
    covered = anchor * tab[c.clamp(max=62)]
    assert bool((covered >= need).all())
    nxt = anchor * tab[(c + 1).clamp(max=62)]
    assert bool(((nxt < need) | (c == 62)).all())
    assert int(c.max()) > 55  # the coarse codes are used


@pytest.mark.parametrize("spec", ["tahquant:layout=log6t", "tahquant:layout=log6t,fit_rotated=true", BLOCK,
                                  "tahquant:layout=log6t,zero_width=block", "tahquant:layout=log6t,fit=minmax"])
def test_kernels_write_the_references_bytes(spec):
    """The compiled CPU kernels (the tapered codes, the anchors' tags, each block's width) give the reference's
    payload and values."""
    for x in _inputs():
        ref, fast = get_codec(spec + ",impl=torch"), get_codec(spec)
        assert select(fast, "encode", x) is not None
        p = ref.encode(x)
        assert torch.equal(fast.encode(x), p), spec
        assert torch.equal(fast.decode(p, x.shape, x.dtype), ref.decode(p, x.shape, x.dtype))


@pytest.mark.parametrize("spec", [BLOCK, "tahquant:layout=log6t"])
def test_error_within_the_bound(spec):
    """The error bound holds where fit=mse searched a coarse code (the bound of its code, not log6's)."""
    for x in _inputs():
        c = get_codec(spec)
        p = c.encode(x)
        y = c.decode(p, x.shape, x.dtype)
        bound = c.error_bound(x, p)
        assert bool(((x - y).abs() <= bound * (1 + 2.0 ** -12) + 1e-30).all()), spec


def test_log6t_keeps_a_step_near_its_own_far_below_the_anchor():
    """Two outliers of 10^4x in one tile (no rotation serves them) set their block's anchor; the other tiles,
    11-12 octaves below it, keep a step within one octave of theirs: error within 1.3x of the default's (log7,
    15.9 octaves), where log6 (7.9 octaves) loses them."""
    base = torch.randn(2, 64, 1024, generator=torch.Generator().manual_seed(4))
    x, ordinary = llm_like(base.shape, base=base, magnitude=1e4, channel_magnitude=1e4, massive=0,
                           outlier_channels=2, pairs=1, spacing=32, seed=1)
    e = {spec: ordinary_nmse(x, _roundtrip(spec, x)[1], ordinary)
         for spec in ("tahquant", "tahquant:layout=log6", "tahquant:layout=log6t")}
    assert e["tahquant:layout=log6t"] < 1.3 * e["tahquant"] and e["tahquant:layout=log6"] > 10 * e["tahquant"], e


# ------------------------------------------------------------------------------ zero_width=block
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_block_widths_below_the_fp16_layout_at_every_magnitude(kind):
    """At the default's bits, NMSE on the ordinary elements below ``layout=ref`` (fp16 step and zero, 0.62
    bits/element more) and below the default before it (log7) from 10x to 10^4x, and flat in the magnitude."""
    base = torch.randn(2, 128, 1024, generator=torch.Generator().manual_seed(1))
    assert get_codec(BLOCK).bits_per_element(base.shape) <= 4.41
    d = {}
    for mag in (10.0, 100.0, 300.0, 1e3, 1e4):
        x, ordinary = llm_like(base.shape, base=base, magnitude=mag, channel_magnitude=mag, seed=5, **KINDS[kind])
        d[mag] = ordinary_nmse(x, _roundtrip(BLOCK, x)[1], ordinary)
        ref = ordinary_nmse(x, _roundtrip("tahquant:layout=ref", x)[1], ordinary)
        default = ordinary_nmse(x, _roundtrip(LOG7, x)[1], ordinary)
        assert d[mag] < ref and d[mag] < default, (mag, d[mag], ref, default)
    assert d[1e4] <= 1.5 * d[300.0], d


def test_each_block_names_its_width_in_its_anchor():
    """A block without outliers takes no zero extension (its rotated tiles code the most elements at the full
    width); one with outlier channels of 10^4x the widest; one of 30x a width in between. The tag is the width,
    and the payload decodes as the same rows coded with that width alone."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3 * 64, 1024, generator=g)  # three blocks of 64 rows
    x[64:128, 100] *= 1e4 / x[64:128, 100].abs().clamp(min=1e-3)
    x[128:, 300] = 30.0 * x[128:, 300].sign()
    c = get_codec(BLOCK)
    p = c.encode(x)
    g_, sec = c._layout(x.shape)
    anchors = sec.get(p, "anchor", 0, g_.n_blocks)
    tags = (anchors.view(torch.int32) & 15).tolist()
    assert tags[0] == 0 and tags[1] == 9 and 0 < tags[2] < 9, tags
    for b, w in enumerate(tags):
        rows = x[b * 64: (b + 1) * 64]
        alone = get_codec(f"tahquant:layout=log6t,fit_rotated=true,zero_ext={w}")
        y = c.decode(p, x.shape, x.dtype)[b * 64: (b + 1) * 64]
        if w:
            assert torch.equal(y, alone.decode(alone.encode(rows), rows.shape, rows.dtype)), (b, w)


def test_the_choice_never_errs_above_the_widest_width():
    """Per block, the chosen width's squared error is at most that of the widest (zero_ext for every block)."""
    base = torch.randn(4, 64, 1024, generator=torch.Generator().manual_seed(2))
    for mag in (10.0, 30.0, 300.0, 1e4):
        x, _ = llm_like(base.shape, base=base, magnitude=mag, channel_magnitude=mag, seed=3, **KINDS["both"])
        e = {}
        for spec in (BLOCK, "tahquant:layout=log6t,fit_rotated=true"):
            e[spec] = float((x.double() - _roundtrip(spec, x)[1].double()).square().sum())
        assert e[BLOCK] <= e["tahquant:layout=log6t,fit_rotated=true"] * (1 + 1e-6), (mag, e)


def test_a_tag_beyond_zero_ext_is_a_corrupt_payload():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))
    x[:, 3] = 1e3
    c = get_codec(BLOCK)
    p = c.encode(x)
    bits = p[0:4].clone().view(torch.int32)
    p[0:4] = (bits | 15).view(torch.uint8)  # width 15 > zero_ext = 9
    for impl in ("torch", "auto"):
        with pytest.raises(CodecError, match="corrupt payload.*zero extension of 15 bits"):
            get_codec(BLOCK + f",impl={impl}").decode(p, x.shape, x.dtype)


def test_configuration_errors_say_what_to_change():
    assert get_codec("tahquant").spec() == get_codec(BLOCK.replace("zero_width=block", "zero_width=auto")).spec()
    for bad, match in [("tahquant:layout=log7,zero_width=block", "layout with anchor tags"),
                       ("tahquant:layout=log6t,zero_width=block,slots=token", "slots=tile"),
                       ("tahquant:layout=log6t,zero_width=block,zero_ext=0", "zero_ext > 0"),
                       ("tahquant:layout=log6t,zero_width=block,zero_ext=16", "widths 0 .. 15"),
                       ("tahquant:layout=log6t,zero_width=block,adapt=block", "use one of them")]:
        with pytest.raises(CodecError, match=match):
            get_codec(bad)
    # the parameter is new: configurations without per-block widths keep their keys
    assert get_codec("tahquant:layout=log7,zero_width=fixed").spec_key() == get_codec("tahquant:layout=log7").spec_key()
    assert "zero_width" in get_codec("tahquant").spec_key()
