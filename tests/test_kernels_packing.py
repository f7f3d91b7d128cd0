"""The Triton bit packing (``kernels/gpu/_packing.py``) against ``qwire.codecs.packing``: the same bytes and
codes for every width, length and code dtype; the dispatch through ``packing.DEVICE_KERNELS`` and its fallback
when a registered kernel fails. Under Triton's interpreter where there is no GPU, on CUDA tensors where there
is."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from qwire.codecs import get_codec, packing  # noqa: E402
from qwire.codecs.kernels.gpu import _packing  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7])
def test_pack_and_unpack_give_the_torch_versions_bytes(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    for n in (1, 7, 8, 9, 100, 4099):
        codes = torch.randint(0, 1 << bits, (n,), generator=g)
        for dtype in (torch.uint8, torch.int32, torch.int64) + ((torch.bool,) if bits == 1 else ()):
            c = codes.to(dtype)
            want = packing.pack_bits(c, bits)
            got = _packing.pack_bits(c.to(DEVICE), bits)
            assert got.dtype == torch.uint8 and torch.equal(got.cpu(), want), (bits, n, dtype)
        back = _packing.unpack_bits(want.to(DEVICE), bits, n)
        assert back.dtype == torch.uint8 and torch.equal(back.cpu(), packing.unpack_bits(want, bits, n))
        assert torch.equal(back.cpu().long(), codes)
        longer = torch.cat([want, torch.full((5,), 255, dtype=torch.uint8)])  # bytes past the stream are ignored
        assert torch.equal(_packing.unpack_bits(longer.to(DEVICE), bits, n).cpu().long(), codes)


def test_codecs_pack_through_a_registered_kernel_with_the_same_bytes(monkeypatch) -> None:
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(0))
    x[:, 5] *= 40
    specs = ["tahquant", "int4:layout=log7", "int3:layout=log6"]
    plain = [get_codec(s, impl="torch").encode(x) for s in specs]
    calls = []

    def pack(flat, bits):
        calls.append(bits)
        return _packing.pack_bits(flat, bits)

    monkeypatch.setitem(packing.DEVICE_KERNELS, "cpu", (pack, _packing.unpack_bits))
    for s, p in zip(specs, plain):
        c = get_codec(s, impl="torch")
        assert torch.equal(c.encode(x), p), s
        ref = get_codec(s, impl="torch")
        monkeypatch.delitem(packing.DEVICE_KERNELS, "cpu")
        want = ref.decode(p, x.shape, x.dtype)
        monkeypatch.setitem(packing.DEVICE_KERNELS, "cpu", (pack, _packing.unpack_bits))
        assert torch.equal(c.decode(p, x.shape, x.dtype), want), s
    assert calls  # the fields of 1, 6 and 7 bits went through the kernel


def test_a_failing_kernel_is_dropped_and_torch_packs(monkeypatch) -> None:
    def broken(*args):
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(packing.DEVICE_KERNELS, "cpu", (broken, broken))
    codes = torch.tensor([1, 2, 3, 0, 1])
    with pytest.warns(RuntimeWarning, match="bit-packing kernels failed"):
        packed = packing.pack_bits(codes, 2)
    assert "cpu" not in packing.DEVICE_KERNELS
    assert torch.equal(packing.unpack_bits(packed, 2, 5).long(), codes)


@pytest.mark.parametrize("bits", [1, 3, 6, 7])
def test_packing_into_a_payloads_field_writes_its_bytes_and_no_others(bits: int, monkeypatch) -> None:
    """``packing.pack_bits_into``: through the device's kernel straight into the slice (no packed copy first), or,
    with no such kernel registered, packed and copied; the same bytes either way, the bytes around untouched."""
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (37,), generator=g)
    want = packing.pack_bits(codes, bits)
    into = []

    def pack_into(flat, b, out):
        into.append(b)
        return _packing.pack_bits(flat, b, out=out)

    for kernels in [(_packing.pack_bits, _packing.unpack_bits, pack_into), (_packing.pack_bits, _packing.unpack_bits)]:
        monkeypatch.setitem(packing.DEVICE_KERNELS, DEVICE, kernels)
        buf = torch.full((want.numel() + 6,), 255, dtype=torch.uint8, device=DEVICE)
        packing.pack_bits_into(codes.to(DEVICE), bits, buf[3: 3 + want.numel()])
        assert torch.equal(buf[3: 3 + want.numel()].cpu(), want)
        assert (buf[:3] == 255).all() and (buf[3 + want.numel():] == 255).all()
    assert into == [bits]  # the kernel that writes in place ran once, with it registered
    monkeypatch.setitem(packing.DEVICE_KERNELS, DEVICE, (_packing.pack_bits, _packing.unpack_bits, pack_into))
    with pytest.raises(RuntimeError):  # a field of the wrong size: the copy says so; the kernels stay registered
        packing.pack_bits_into(codes.to(DEVICE), bits, torch.empty(want.numel() + 1, dtype=torch.uint8,
                                                                      device=DEVICE))
    assert into == [bits] and DEVICE in packing.DEVICE_KERNELS
    with pytest.raises(ValueError, match="contiguous bytes"):
        _packing.pack_bits(codes.to(DEVICE), bits, out=torch.empty(want.numel() + 1, dtype=torch.uint8,
                                                                   device=DEVICE))
