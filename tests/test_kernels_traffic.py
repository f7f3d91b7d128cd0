"""What the GPU paths move in device memory, counted under Triton's interpreter
(:class:`qwire.codecs.kernels.counting.MemoryTraffic`, ``scripts/gpu_op_count.py --traffic``): the count itself,
and the passes over the input that the kernels were merged to save.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (scripts/setup.sh installs it on Linux x86-64)")

from qwire.codecs import get_codec  # noqa: E402
from qwire.codecs.kernels.counting import MemoryTraffic  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="counts the loads and stores of Triton's interpreter (TRITON_INTERPRET=1)")


@pytest.fixture(autouse=True)
def _pack_as_on_a_gpu(monkeypatch):
    from qwire.codecs import packing
    from qwire.codecs.kernels import gpu  # noqa: F401  (registers the bit packing of CUDA tensors)

    monkeypatch.setitem(packing.DEVICE_KERNELS, "cpu", packing.DEVICE_KERNELS["cuda"])


def _encode_traffic(spec: str, x: torch.Tensor) -> MemoryTraffic:
    from qwire.codecs.kernels.gpu import _launches

    c = get_codec(spec, impl="triton")
    c.encode(x)  # the first call makes what later calls keep (tables)
    m = MemoryTraffic(watch=x)
    with _launches.watching(lambda fn, a, kw: m.launch(fn.__name__)), m:
        c.encode(x)
    return m


def _passes(m: MemoryTraffic, x: torch.Tensor) -> list[str]:
    """The launches that read the whole input."""
    return [name for name, b in m.watched if b >= x.numel() * x.element_size()]


def test_an_fp16_cast_moves_each_byte_once():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    m = _encode_traffic("fp16", x)
    assert [name for name, *_ in m.launches] == ["_to_fp16"]
    read, written, again = m.bytes()
    assert (read, written, again) == (4 * x.numel(), 2 * x.numel(), 0)


@pytest.mark.parametrize("spec", ["tahquant", "int4:fit=mse"])
def test_the_search_packs_the_codes_and_the_input_is_read_twice(spec):
    """``fit=mse`` with one stream of every tile in tile order: the search's kernel packs the codes; the input is
    read by the statistics and the search, not a third time."""
    x = torch.randn(64, 1600, generator=torch.Generator().manual_seed(0))
    assert _passes(_encode_traffic(spec, x), x) == [
        "_tah_stats" if spec == "tahquant" else "_tile_stats", "_refine_log"]


def test_two_code_streams_are_packed_after_the_search():
    """``ratio=0.8``: two streams of tiles, packed by their own kernel, which reads the tiles a third time (but
    for the rotated ones, read from their rotated copy)."""
    x = torch.randn(64, 1600, generator=torch.Generator().manual_seed(0))
    m = _encode_traffic("tahquant:ratio=0.8", x)
    assert _passes(m, x) == ["_tah_stats", "_refine_log"]
    third = sum(b for name, b in m.watched if name == "_stream_quant_pack")
    assert 0.9 * x.numel() * x.element_size() < third <= x.numel() * x.element_size()


@pytest.mark.parametrize("spec, passes", [("blockwise8", ["_encode_blocks"]), ("fp4", ["_encode_blocks"]),
                                          ("blockwise:bits=3,block=100", ["_absmax", "_encode"])])
def test_blockwise_reads_its_input_once(spec, passes):
    """Blocks of a power of two (every default): absmax, codes and packing in one pass."""
    x = torch.randn(50, 512, generator=torch.Generator().manual_seed(0))
    assert _passes(_encode_traffic(spec, x), x) == passes
