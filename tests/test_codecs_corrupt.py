"""Payloads no encoder wrote, and values at the edge of the output dtype's range.

Every codec's decode of a payload of the wrong length raises :class:`CodecError`; of random bytes
of the right length it either raises :class:`CodecError` or returns finite values (the float casts
pass NaN/Inf through by policy: there, every value that is finite on the wire stays finite), never
another exception. Decoding clamps to the output dtype's finite range: an fp16 input near 65504
never decodes to Inf. The compiled kernels (``impl=auto``) and the torch reference agree.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwire.codecs import CodecError, available, get_codec
from qwire.codecs.floats import FloatCast

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# every registered codec plus the configurations that take other decode paths ("auto" sends the payload of
# the codec in force, fp32 until it switches: covered by those codecs)
SPECS = sorted(set(available()) - {"auto"} | {
    "int4:layout=ref", "int3:symmetric=true", "int5:layout=log6", "tahquant:unit=token", "tahquant:layout=log",
    "tahquant:layout=log6,zero_ext=0", "tahquant:max_rotated=1.0,tile=16", "tahquant:layout=log7,adapt=block",
    "tahquant:layout=log7,adapt=predict", "tahquant:layout=log6t,zero_width=block,fit_rotated=true",
    "perchannel8:layout=fp32", "fp8:format=e5m2", "fp8:hadamard=false", "fp8plain:format=e5m2",
    "aqsgd:cache_dtype=fp32",
})
SHAPES = st.lists(st.integers(1, 70), min_size=1, max_size=3).map(tuple)


def _decode(codec, payload, shape, dtype):
    kw = {"sample_ids": None} if codec.stateful else {}
    return codec.decode(payload, shape, dtype, **kw)


def _nbytes_or_skip(codec, shape, dtype) -> int:
    try:
        return codec.payload_nbytes(shape, dtype)
    except CodecError:  # a codec may refuse a shape
        pytest.skip(f"{codec.spec()} does not take shape {shape}")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("impl", ["torch", "auto"])
def test_wrong_length_raises_codec_error(spec, impl):
    for shape in [(3, 40), (2, 5, 64)]:
        for dtype in DTYPES:
            codec = get_codec(spec, impl=impl)
            n = _nbytes_or_skip(codec, shape, dtype)
            for m in {0, n - 1, n + 1, 2 * n + 3} - {n}:
                if m < 0:
                    continue
                with pytest.raises(CodecError, match="bytes"):
                    _decode(codec, torch.zeros(m, dtype=torch.uint8), shape, dtype)
            with pytest.raises(CodecError):  # not a uint8 payload
                _decode(codec, torch.zeros(n, dtype=torch.float32), shape, dtype)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=25, deadline=None)
@given(shape=SHAPES, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1),
       fill=st.sampled_from(["random", "ones", "zeros"]))
def test_random_bytes_decode_finite_or_codec_error(spec, shape, dtype, seed, fill):
    """Random bytes (and all-0xFF / all-zero payloads) of the right length: CodecError or finite values,
    the same from the reference and the kernels."""
    ref, fast = get_codec(spec, impl="torch"), get_codec(spec, impl="auto")
    n = _nbytes_or_skip(ref, shape, dtype)
    if fill == "random":
        payload = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    else:
        payload = torch.full((n,), 255 if fill == "ones" else 0, dtype=torch.uint8)
    results = []
    for codec in (ref, fast):
        try:
            y = _decode(codec, payload.clone(), shape, dtype)
        except CodecError as e:
            assert str(e)
            results.append(None)
            continue
        assert y.shape == torch.Size(shape) and y.dtype == dtype
        if isinstance(codec, FloatCast):  # NaN/Inf pass through; nothing finite becomes Inf
            wire = payload.view(codec.wire_dtype).float()
            assert torch.equal(torch.isfinite(y.float().reshape(-1)), torch.isfinite(wire)), spec
        else:
            assert bool(torch.isfinite(y).all()), f"{codec.spec()} ({codec.impl}) decoded random bytes to Inf/NaN"
        results.append(y)
    a, b = results
    if a is not None and b is not None and not isinstance(ref, FloatCast):
        assert torch.equal(a, b), f"{spec}: the kernels and the reference decode a corrupt payload differently"


@pytest.mark.parametrize("spec", [s for s in SPECS if not get_codec(s).stateful])
@pytest.mark.parametrize("impl", ["torch", "auto"])
def test_fp16_near_max_decodes_finite(spec, impl):
    """fp16 inputs at the top of fp16's range decode to finite values, clamped to +-65504."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=g) * 100
    x[:, ::7] = 65472.0
    x[:, 3::7] = -65472.0
    x[0, :5] = torch.tensor([65504.0, -65504.0, 65440.0, 65000.0, -64000.0])
    x = x.to(torch.float16)
    codec = get_codec(spec, impl=impl)
    try:
        payload = codec.encode(x)
    except CodecError:  # a codec may refuse the range (layout=ref stores fp16 metadata)
        return
    y = codec.decode(payload, x.shape, x.dtype)
    assert bool(torch.isfinite(y).all()), f"{spec} decoded fp16 values near 65504 to Inf"
    assert float(y.float().abs().max()) <= 65504.0


@pytest.mark.parametrize("spec", ["fp8", "taco", "fp8plain", "bf16", "blockwise8"])
def test_issue_case_65472(spec):
    x = torch.full((128,), 65472.0, dtype=torch.float16)
    for impl in ("torch", "auto"):
        codec = get_codec(spec, impl=impl)
        y = codec.decode(codec.encode(x), x.shape, x.dtype)
        assert bool(torch.isfinite(y).all()) and float(y.float().min()) >= 6.4e4


def test_fp32_wire_to_bf16_clamps_finite_values():
    """fp32 codec, bf16 output: a finite fp32 on the wire beyond bf16's range decodes to bf16's max, not Inf;
    Inf and NaN pass through."""
    wire = torch.tensor([3.4e38, -3.4e38, float("inf"), float("nan"), 1.5] + [0.0] * 11)
    payload = wire.view(torch.uint8)
    for impl in ("torch", "auto"):
        y = get_codec("fp32", impl=impl).decode(payload, wire.shape, torch.bfloat16)
        m = torch.finfo(torch.bfloat16).max
        assert y[0].item() == m and y[1].item() == -m
        assert y[2].item() == float("inf") and torch.isnan(y[3]) and y[4].item() == 1.5
