"""TAH-Quant with ``slots=tile`` (the default): a rotated tile carries its pivot and the high part of its
zero code in its own code bits, coding ``log2(G) + zero_ext`` of its elements one bit narrower."""

from __future__ import annotations

import pytest
import torch

from qwire.codecs import CodecError, get_codec
from qwire.codecs.synthetic import llm_like, ordinary_nmse

SLOT_DEFAULT = "tahquant:slots=token,ratio=0.8,layout=logx,zero_ext=8"  # the default before slots=tile
LOG7 = "tahquant:layout=log7,fit_rotated=false"  # the default before log6t and zero_width


def _nmse(spec: str, x: torch.Tensor, ordinary: torch.Tensor) -> float:
    c = get_codec(spec)
    return ordinary_nmse(x, c.decode(c.encode(x), x.shape, x.dtype), ordinary)


def test_default_is_slots_tile_at_4_bits():
    c = get_codec("tahquant")
    assert (c.slots, c.ratio, c.layout, c.zero_ext, c.high_bits) == ("tile", 1.0, "log6t", 9, 4)
    assert c.per_block and c.searches_rotated
    assert c.narrowed == 5 + 9  # the widest a block takes
    # 4-bit codes + 6-bit step + 6-bit zero + 1 rotation flag per tile of 32, + one fp32 per >= 65536 elements
    for C in (256, 1024, 1600, 4096):
        shape = (8, 128, C)
        want = 4 + 13 / 32 + 32 * c.geometry(shape).n_blocks / (8 * 128 * C)
        assert c.bits_per_element(shape) == pytest.approx(want, abs=1e-9)
        assert c.bits_per_element(shape) <= 4.41


def test_flags_pivots_and_zero_extension_travel_in_the_blocks():
    """Every tile with a1 > tau * a2 rotates (no cap); the block of each holds its pivot and zero
    extension; the decoded tensor is within the bound."""
    G = 32
    c = get_codec("tahquant")
    x, ordinary = llm_like((2, 16, 512), massive=2, outlier_channels=4, magnitude=1e4, channel_magnitude=1e3,
                           seed=4, spacing=64)
    p = c.encode(x)
    g = c.geometry(x.shape)
    sec = c.sections(g)
    assert "pivot" not in sec.fields and not any(f.startswith("zext") for f in sec.fields)
    flags = sec.get(p, "rotflag", 0, g.n_tiles).view(g.rows, g.tiles).bool()
    t = x.reshape(g.rows, g.tiles, G).abs()
    top2 = t.topk(2, -1).values
    assert torch.equal(flags, top2[..., 0] > c.tau * top2[..., 1])
    assert int(flags.sum(1).max()) > get_codec(SLOT_DEFAULT).slot_count(g)  # more than the old cap
    codes = c._codes(sec, p, 0, g.rows, g, None, 1)
    levels = c._narrow(torch.full((g.rows, g.tiles), 15.0), flags)
    idx, piv, ext, _ = c._inline_decode(codes, flags, levels)
    assert torch.equal(piv, t.argmax(-1).view(-1)[idx])
    outlier_tiles = (~ordinary).reshape(g.rows, g.tiles, G).any(-1)
    assert bool(flags[outlier_tiles].all())
    assert bool((ext[outlier_tiles] != 0).all())  # offsets of 10^3-10^4 x RMS are beyond the 5-bit zero
    assert bool((ext[~flags] == 0).all())
    y = c.decode(p, x.shape, x.dtype)
    assert bool(((y - x).abs() <= c.error_bound(x, p) * (1 + 1e-5) + 1e-5).all())


@pytest.mark.parametrize("b", [2, 3, 4, 8])
def test_block_pack_round_trip(b):
    c = get_codec(f"tahquant:high_bits={b},low_bits={b}")
    g = torch.Generator().manual_seed(b)
    n, G, nn = 7, c.tile, c.narrowed
    piv = torch.randint(0, G, (n,), generator=g)
    ext = torch.randint(-(1 << (c.ext_bits - 1)), 1 << (c.ext_bits - 1), (n,), generator=g)
    qw = torch.randint(0, 1 << b, (n, G - nn), generator=g)
    qn = torch.randint(0, 1 << (b - 1), (n, nn), generator=g)
    block = c._pack_block(piv, ext, qw, qn, b)
    assert block.shape == (n, G) and int(block.max()) < (1 << b)
    p2, e2, w2, n2 = c._unpack_block(block, b)
    assert torch.equal(p2, piv) and torch.equal(e2, ext) and torch.equal(w2, qw) and torch.equal(n2, qn)


def test_lower_error_than_the_slot_default_at_the_same_rate():
    """Outlier-free input: all-4-bit tiles with 13 bits of metadata beat the 4/3-bit mix with pivot slots
    (0.02 bits more); with outlier channels and massive activations, lower on the ordinary elements."""
    x = torch.randn(4, 64, 1024, generator=torch.Generator().manual_seed(2))
    ones = torch.ones_like(x, dtype=torch.bool)
    new, old = _nmse("tahquant", x, ones), _nmse(SLOT_DEFAULT, x, ones)
    assert new < 0.85 * old, (new, old)
    bn, bo = get_codec("tahquant").bits_per_element(x.shape), get_codec(SLOT_DEFAULT).bits_per_element(x.shape)
    assert bn - bo < 0.03
    for kw in (dict(massive=2, outlier_channels=0), dict(massive=0, outlier_channels=4),
               dict(massive=2, outlier_channels=4)):
        for mag in (30.0, 1e4):
            xo, o = llm_like(x.shape, base=x, magnitude=mag, channel_magnitude=mag, seed=5, **kw)
            assert _nmse("tahquant", xo, o) < _nmse(SLOT_DEFAULT, xo, o), (kw, mag)


def test_two_outliers_in_one_tile_do_not_spoil_the_block():
    """A tile with two outliers of 10^4 x the RMS is not rotated and sets a step 10^4 times the others': the
    default's ``log6t`` step (14.75 octaves, coarse beyond 6.75) and ``log7``'s (15.9 octaves) still code the
    other tiles' steps, where ``log6`` (7.9 octaves) does not."""
    x = torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(3))
    xp, o = llm_like(x.shape, base=x, magnitude=1e4, channel_magnitude=1e4, seed=0, massive=0, outlier_channels=2,
                     pairs=1, spacing=32)
    clean = torch.ones_like(x, dtype=torch.bool)
    assert _nmse("tahquant", xp, o) < 0.2  # the pair's own tile loses its small elements (1/8 of the energy)
    assert _nmse(LOG7, xp, o) < 0.2
    assert _nmse("tahquant:layout=log6", xp, o) > 0.5  # 7.9 octaves: the whole block's steps grow
    assert _nmse("tahquant", x, clean) < 0.95 * _nmse(LOG7, x, clean)  # what log6's grid buys without them


def test_narrow_widths_and_small_tiles():
    with pytest.raises(CodecError, match="low_bits=1.*slots=token"):
        get_codec("tahquant:ratio=0.5,high_bits=2,low_bits=1")
    get_codec("tahquant:ratio=0.5,high_bits=2,low_bits=1,slots=token")
    c8 = get_codec("tahquant:tile=8")
    assert c8.ext_bits == 5 and c8.narrowed == 8  # the zero extension is capped at tile - log2(tile)
    for spec in ("tahquant:tile=8", "tahquant:tile=4", "tahquant:tile=2", "tahquant:ratio=0.5,unit=token"):
        c = get_codec(spec)
        x, _ = llm_like((2, 8, 64), massive=1, outlier_channels=1, magnitude=300.0, channel_magnitude=50.0,
                        spacing=32, seed=1)
        p = c.encode(x)
        y = c.decode(p, x.shape, x.dtype)
        assert bool(((y - x).abs() <= c.error_bound(x, p) * (1 + 1e-5) + 1e-5).all()), spec


def test_mismatched_slots_between_ranks_is_caught_or_decodes_to_finite():
    """A receiver configured with slots=token reading a slots=tile payload: the sizes differ, which the
    transport's spec check reports; the spec strings say which side differs."""
    a, b = get_codec("tahquant"), get_codec("tahquant:slots=token")
    assert a.spec() != b.spec() and "slots=tile" in a.spec() and "slots=token" in b.spec()
    assert a.payload_nbytes((4, 64, 256), torch.float32) != b.payload_nbytes((4, 64, 256), torch.float32)
