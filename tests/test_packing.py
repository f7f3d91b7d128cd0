"""Bit packing: round trips for every width 1..8 and the documented stream layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwire.codecs import CodecError
from qwire.codecs.packing import pack_bits, packed_nbytes, unpack_bits


def _reference_pack(codes: list[int], bits: int) -> list[int]:
    """Code i occupies stream bits [i*bits, (i+1)*bits); stream bit j is bit j % 8 of byte j // 8."""
    out = [0] * ((len(codes) * bits + 7) // 8)
    for i, c in enumerate(codes):
        for b in range(bits):
            if c >> b & 1:
                j = i * bits + b
                out[j // 8] |= 1 << (j % 8)
    return out


@pytest.mark.parametrize("bits", range(1, 9))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_matches_reference_layout(bits, data):
    n = data.draw(st.integers(0, 67))
    codes = data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=n, max_size=n))
    t = torch.tensor(codes, dtype=torch.uint8)
    p = pack_bits(t, bits)
    assert p.dtype == torch.uint8 and p.dim() == 1
    assert p.numel() == packed_nbytes(n, bits) == (n * bits + 7) // 8
    assert p.tolist() == _reference_pack(codes, bits)
    assert torch.equal(unpack_bits(p, bits, n), t)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 65, 1001, 4099])
def test_round_trip_odd_lengths(bits, n):
    g = torch.Generator().manual_seed(bits * 10_000 + n)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)
    p = pack_bits(codes, bits)
    assert p.numel() == packed_nbytes(n, bits)
    assert torch.equal(unpack_bits(p, bits, n), codes)
    # a longer buffer (e.g. a payload slice) unpacks the same first n codes
    assert torch.equal(unpack_bits(torch.cat([p, torch.full((5,), 255, dtype=torch.uint8)]), bits, n), codes)


def test_shapes_and_dtypes_accepted():
    codes = torch.randint(0, 8, (3, 5, 7))
    p = pack_bits(codes, 3)  # any integer dtype, any shape: row-major order
    assert torch.equal(unpack_bits(p, 3, codes.numel()), codes.reshape(-1).to(torch.uint8))
    nc = torch.randint(0, 16, (40, 6), dtype=torch.uint8).t()  # non-contiguous
    assert torch.equal(unpack_bits(pack_bits(nc, 4), 4, nc.numel()), nc.reshape(-1))
    assert pack_bits(torch.empty(0, dtype=torch.uint8), 5).numel() == 0
    assert unpack_bits(torch.empty(0, dtype=torch.uint8), 5, 0).numel() == 0


def test_errors():
    for bad in (0, 9, 2.5):
        with pytest.raises(CodecError, match="bit width"):
            pack_bits(torch.zeros(4, dtype=torch.uint8), bad)
    with pytest.raises(CodecError, match="need 2 bytes"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 3, 5)
    with pytest.raises(CodecError, match="must be uint8"):
        unpack_bits(torch.zeros(4, dtype=torch.int32), 3, 5)
