"""The GPU codecs' checks read back later (:mod:`qwire.codecs.kernels.deferred`).

Within ``deferring(pending)`` the Triton paths read nothing back: their checks wait in ``pending`` until
``resolve()``, which raises the error the codec raises without deferral, message for message. Without a GPU they
run on CPU tensors under Triton's interpreter, as in tests/test_kernels_triton.py.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (scripts/setup.sh installs it on Linux x86-64)")

from qwire.codecs import CodecError, NonFiniteError, get_codec  # noqa: E402
from qwire.codecs.kernels.counting import DeviceWork  # noqa: E402
from qwire.codecs.kernels.deferred import PendingChecks, deferring  # noqa: E402
from qwire.codecs.synthetic import llm_like  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (Triton's interpreter)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPECS = ["int4", "int4:layout=log7,fit=mse", "perchannel6", "fp8", "fp8plain", "blockwise8", "fp4", "tahquant",
         "tahquant:tile=64,zero_ext=0"]


@pytest.fixture(autouse=True)
def _pack_as_on_a_gpu(monkeypatch):
    from qwire.codecs import packing
    from qwire.codecs.kernels import gpu  # noqa: F401  (registers the bit packing of CUDA tensors)

    if DEVICE == "cpu":  # pack as CUDA tensors would
        monkeypatch.setitem(packing.DEVICE_KERNELS, "cpu", packing.DEVICE_KERNELS["cuda"])


def _codec(spec: str):
    return get_codec(spec + ("," if ":" in spec else ":") + "impl=triton")


def _x(seed: int = 4) -> torch.Tensor:
    x, _ = llm_like((2, 32, 512), massive=2, outlier_channels=3, magnitude=1e3, seed=seed)
    return x.to(DEVICE)


@pytest.mark.parametrize("spec", SPECS)
def test_deferred_checks_read_nothing_back_and_change_nothing(spec):
    c, x = _codec(spec), _x()
    p_now = c.encode(x)
    y_now = c.decode(p_now, x.shape, x.dtype)
    pending = PendingChecks()
    with deferring(pending):
        with DeviceWork() as w:
            p = c.encode(x)
            y = c.decode(p, x.shape, x.dtype)
    assert w.reads == [], f"{spec} reads back {w.reads}"
    assert len(pending) == 2  # one check each way
    pending.resolve()
    assert len(pending) == 0
    assert torch.equal(p.cpu(), p_now.cpu()) and torch.equal(y.cpu(), y_now.cpu())


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test compares whatever was raised)
        return e
    return None


def _same_error_later(fn) -> Exception:
    """``fn`` raises at once without deferral; within ``deferring`` it raises nothing, and ``resolve()`` raises
    an error of the same type and message."""
    now = _error(fn)
    assert now is not None
    pending = PendingChecks()
    with deferring(pending):
        fn()
    later = _error(pending.resolve)
    assert type(later) is type(now) and str(later) == str(now)
    assert len(pending) == 0  # resolved, even though it raised
    return later


@pytest.mark.parametrize("spec,bad", [(s, float("nan")) for s in SPECS] +  # Inf: one codec of each kernel family
                         [(s, float("inf")) for s in ("int4", "fp8", "fp4", "tahquant")])
def test_non_finite_input_is_refused_at_resolve(spec, bad):
    x = _x()
    x[1, 3, 7] = bad
    assert isinstance(_same_error_later(lambda: _codec(spec).encode(x)), NonFiniteError)


@pytest.mark.parametrize("spec", ["int4", "tahquant", "perchannel6", "perchannel6:layout=fp32"])
def test_out_of_range_input_is_refused_at_resolve(spec):
    x = _x()
    x[0, 2, 9] = 3e38  # beyond the largest magnitude a quantizing codec takes
    e = _same_error_later(lambda: _codec(spec).encode(x))
    assert isinstance(e, CodecError) and "exceeds" in str(e)


def test_a_step_beyond_fp16_is_refused_at_resolve():
    x = _x()
    x[0, 2, 9] = 1e7  # perchannel6's fp16 step would be 1e7 / 31 > 65504
    e = _same_error_later(lambda: _codec("perchannel6").encode(x))
    assert "layout=fp32" in str(e)


def test_fp16_checks_its_overflow_with_the_chunks_other_checks():
    """fp16 is a torch cast on every device; its one check (a finite value that became Inf) waits for the
    chunk's resolve() like the kernels' (a host sync in the middle of a stage's step on a GPU otherwise)."""
    c, x = get_codec("fp16:impl=torch"), _x()
    pending = PendingChecks()
    with deferring(pending):
        with DeviceWork() as w:
            p = c.encode(x)
    assert w.reads == [] and len(pending) == 1
    pending.resolve()
    assert torch.equal(p.cpu(), c.encode(x).cpu())
    x[0, 2, 9] = 1e6
    e = _same_error_later(lambda: c.encode(x))
    assert "magnitude 1e+06 exceeds fp16's range" in str(e)


@pytest.mark.parametrize("spec, sign", [("int4", 0), ("int4", 128), ("tahquant", 0), ("fp8", 0), ("perchannel6", 0),
                                        ("blockwise8", 0), ("blockwise8", 128), ("fp4", 128)])
def test_corrupt_payload_is_refused_at_resolve(spec, sign):
    """A NaN where the payload holds a scale; ``sign`` 128: a NaN with its sign bit set, whose bits, were its sign
    kept by an absolute value, would be a negative int32 that an atomic maximum of the bits passes over."""
    c, x = _codec(spec), _x()
    p = c.encode(x)
    if spec == "fp8":  # the scales follow the codes: set the last group's to NaN
        p[-4:] = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)
    elif spec == "perchannel6":  # fp16 steps first: a NaN step
        p[0:2] = torch.tensor([0, 126], dtype=torch.uint8)
    else:  # the anchor (int4, tahquant) or the first block's fp32 absmax (blockwise8, fp4)
        p[0:4] = torch.tensor([0, 0, 192, 127 + sign], dtype=torch.uint8)
    e = _same_error_later(lambda: c.decode(p, x.shape, x.dtype))
    assert "corrupt payload" in str(e)


def test_nothing_pending_outside_deferring():
    pending = PendingChecks()
    with deferring(pending):
        with deferring(None):  # an inner block without deferral reads at once
            x = _x()
            x[0, 0, 0] = float("nan")
            with pytest.raises(NonFiniteError):
                _codec("int4").encode(x)
    assert len(pending) == 0


def test_who_defers(monkeypatch):
    from qwire.codecs.kernels.deferred import ENV, wanted

    monkeypatch.delenv(ENV, raising=False)
    assert wanted("cuda") and not wanted("cpu")
    monkeypatch.setenv(ENV, "1")
    assert wanted("cpu")
    monkeypatch.setenv(ENV, "0")
    assert not wanted("cuda")
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match="QWIRE_DEFER_CHECKS='yes': use 1"):
        wanted("cpu")


def test_the_deferred_value_scan_reads_the_values_only_where_the_bound_does_not_rule_them_in():
    """``scan_beyond``: with a bound under the limit nothing is read (the result stays 0, although the values are
    not); otherwise the largest magnitude, NaN where a value is NaN (not dropped as a floating-point maximum
    would drop it), Inf where one is Inf; beside it, the bound as given (unscaled), for the check to read both
    at once."""
    from qwire.codecs.kernels.gpu._common import scan_beyond

    g = torch.Generator().manual_seed(0)
    vals = (torch.randn(10_000, generator=g) * 5).to(DEVICE)
    one = torch.ones((), device=DEVICE)

    def scan(v, bound, scale, limit):
        m, b = scan_beyond(v, bound, scale, limit).tolist()
        assert b == float(bound) or (math.isnan(b) and math.isnan(float(bound)))
        return m

    assert scan(vals, one, 2.0, 100.0) == 0.0  # 2 * 1 < 100: ruled in, not read
    assert scan(vals, one * 60, 2.0, 100.0) == float(vals.abs().max())  # 120: read
    assert scan(vals, one * float("nan"), 1.0, float("inf")) == float(vals.abs().max())
    assert scan(vals, (one * 60).half(), 2.0, 100.0) == float(vals.abs().max())  # an fp16 bound, widened
    bad = vals.clone()
    bad[1234] = float("nan")
    bad[77] = float("-inf")
    assert math.isnan(scan(bad, one * 1e30, 1.0, 100.0))
    bad[1234] = 3.0
    assert scan(bad, one * 1e30, 1.0, 100.0) == float("inf")
    assert scan(bad[:0], one * 1e30, 1.0, 100.0) == 0.0
