"""QuantizedGradAccumulator: exact with fp32, within the accumulated 8-bit bound, memory saved, DDP."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_utils import run_distributed
from qwire.codecs import get_codec
from qwire.comm.grad_accum import QuantizedGradAccumulator


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 300), nn.Tanh(), nn.Linear(300, 7))


def _micro(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(5, 13, generator=g), torch.randn(5, 7, generator=g)


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    x, y = _micro(i)
    return ((model(x) - y) ** 2).mean()


def _reference(k: int) -> list[torch.Tensor]:
    m = _model()
    for i in range(k):
        _loss(m, i).backward()  # autograd's own accumulation into p.grad
    return [p.grad.clone() for p in m.parameters()]


def test_fp32_codec_is_exact():
    k = 4
    ref = _reference(k)
    m = _model()
    acc = QuantizedGradAccumulator(m.parameters(), codec="fp32")
    for i in range(k):
        _loss(m, i).backward()
        acc.accumulate()
        assert all(p.grad is None for p in m.parameters())  # the fp32 grads are freed
    acc.finalize()
    for p, r in zip(m.parameters(), ref):
        assert torch.equal(p.grad, r)


@pytest.mark.parametrize("spec", ["blockwise8:block=256", "blockwise8:block=64", "blockwise4"])
def test_quantized_sum_within_accumulated_bound(spec):
    k = 5
    codec = get_codec(spec)
    m = _model()
    acc = QuantizedGradAccumulator(m.parameters(), codec=spec)
    # reference: the exact sum, and the bound: every requantization of the running sum adds at
    # most error_bound(stored value) per element
    exact = [torch.zeros_like(p) for p in m.parameters()]
    bound = [torch.zeros_like(p) for p in m.parameters()]
    stored = [None] * len(exact)
    for i in range(k):
        _loss(m, i).backward()
        for j, p in enumerate(m.parameters()):
            exact[j] += p.grad
            running = p.grad.clone() if stored[j] is None else stored[j] + p.grad
            stored[j] = codec.decode(codec.encode(running), running.shape, running.dtype)
            bound[j] += codec.error_bound(running).view_as(p)
        acc.accumulate()
    acc.finalize()
    for p, e, b, st in zip(m.parameters(), exact, bound, stored):
        assert torch.equal(p.grad, st)  # dequantize, add, requantize: nothing else
        err = (p.grad - e).abs()
        assert bool((err <= b * (1 + 1e-5) + 1e-7).all())
    # and it is a useful approximation of the sum
    rel = sum(float((p.grad - e).norm()) for p, e in zip(m.parameters(), exact)) / sum(
        float(e.norm()) for e in exact)
    assert rel < (0.02 if "8" in spec else 0.3)


def test_finalize_scale_and_pending_grad():
    m = _model()
    acc = QuantizedGradAccumulator(m.parameters(), codec="fp32")
    _loss(m, 0).backward()
    acc.accumulate()
    _loss(m, 1).backward()  # not accumulated: finalize adds the stored sum to it
    acc.finalize(scale=0.5)
    ref = _reference(2)
    for p, r in zip(m.parameters(), ref):
        torch.testing.assert_close(p.grad, r * 0.5, rtol=1e-6, atol=1e-7)
    assert acc.stored_bytes() == 0


def test_memory_report():
    m = _model()
    acc = QuantizedGradAccumulator(m.parameters())
    mem = acc.memory()
    n = sum(p.numel() for p in m.parameters())
    assert mem.fp32_bytes == 4 * n
    # 8 bits + one fp32 scale per 256 elements (per tensor, rounded up)
    assert n < mem.payload_bytes < 1.1 * n
    assert 0.72 < mem.saved_fraction < 0.75
    _loss(m, 0).backward()
    acc.accumulate()
    assert acc.stored_bytes() == mem.payload_bytes


def _ddp_worker(rank: int, world: int, specs: list[str]) -> dict[str, list[torch.Tensor]]:
    return {spec: _ddp_accumulate(rank, spec) for spec in specs}


def _ddp_accumulate(rank: int, spec: str) -> list[torch.Tensor]:
    """k micro-batches with no_sync; finalize() before the last (synchronizing) backward."""
    k = 3
    ref = DDP(_model())
    with ref.no_sync():
        for i in range(k - 1):
            _loss(ref, 10 * rank + i).backward()
    _loss(ref, 10 * rank + k - 1).backward()
    m = DDP(_model())
    acc = QuantizedGradAccumulator(m.parameters(), codec=spec)
    with m.no_sync():
        for i in range(k - 1):
            _loss(m, 10 * rank + i).backward()
            acc.accumulate()
    acc.finalize()
    _loss(m, 10 * rank + k - 1).backward()
    return [torch.stack([p.grad.reshape(-1).abs().max(), (p.grad - q.grad).abs().max()])
            for p, q in zip(m.parameters(), ref.parameters())]


def test_with_ddp_no_sync():
    tols = {"fp32": 0.0, "blockwise8:block=256": 0.02}
    res = run_distributed(_ddp_worker, 2, args=(list(tols),), timeout=60.0)
    for spec, tol in tols.items():
        for r in res:
            for t in r[spec]:
                scale, err = float(t[0]), float(t[1])
                assert err <= tol * scale, (spec, err, scale)


# ---------------------------------------------------------------------------------------------
# accumulate_in_8bit: the same from post-accumulate-grad hooks

def test_hooks_fp32_exact_and_8bit_close_with_a_quarter_of_the_memory():
    from qwire.comm.grad_accum import accumulate_in_8bit

    k = 4
    ref = _reference(k)
    for spec, tol in (("fp32", 0.0), (None, 0.02)):
        m = _model()
        handle = accumulate_in_8bit(m, codec=spec)
        for i in range(k):
            _loss(m, i).backward()
            assert all(p.grad is None for p in m.parameters())  # freed by the hook, micro-batch by micro-batch
        held = handle.held_bytes()
        assert handle.peak_bytes == held
        handle.finish()
        assert handle.held_bytes() == 0 and handle.peak_bytes == 0 and handle.last_peak_bytes == held
        assert handle.folded == k * len(list(m.parameters()))
        if spec == "fp32":
            assert held == handle.fp32_bytes()
            for p, r in zip(m.parameters(), ref):
                assert torch.equal(p.grad, r)
        else:  # block-wise int8, block 256: 8 bits + one fp32 scale per block
            assert 0.25 <= held / handle.fp32_bytes() < 0.27
            num = sum(float((p.grad - r).norm() ** 2) for p, r in zip(m.parameters(), ref)) ** 0.5
            assert num / sum(float(r.norm() ** 2) for r in ref) ** 0.5 < tol


def test_hooks_finish_scales_only_the_buffer_and_remove():
    from qwire.comm.grad_accum import accumulate_in_8bit

    m = _model()
    handle = accumulate_in_8bit(m, codec="fp32")
    _loss(m, 0).backward()
    handle.remove()
    _loss(m, 1).backward()  # no hook any more: autograd keeps this one in p.grad
    single = _reference(2)
    first = _reference(1)
    handle.finish(scale=0.5)
    for p, r2, r1 in zip(m.parameters(), single, first):
        torch.testing.assert_close(p.grad, (r2 - r1) + 0.5 * r1, rtol=1e-5, atol=1e-7)


def _ddp_hooks_worker(rank: int, world: int, specs: list[str]) -> dict:
    from qwire.comm.grad_accum import accumulate_in_8bit

    k, out = 3, {}
    ref = DDP(_model())
    with ref.no_sync():
        for i in range(k - 1):
            _loss(ref, 10 * rank + i).backward()
    _loss(ref, 10 * rank + k - 1).backward()
    for spec in specs:
        m = DDP(_model())
        handle = accumulate_in_8bit(m, codec=spec)
        with m.no_sync():
            for i in range(k - 1):
                _loss(m, 10 * rank + i).backward()
        held = handle.held_bytes()
        _loss(m, 10 * rank + k - 1).backward()  # synchronizing: the hook hands DDP the whole sum
        assert handle.held_bytes() == 0 and handle.peak_bytes == held
        handle.finish()  # nothing left; harmless
        out[spec] = {"held": held, "fp32": handle.fp32_bytes(),
                     "err": [float((p.grad - q.grad).abs().max()) for p, q in zip(m.parameters(), ref.parameters())],
                     "scale": [float(q.grad.abs().max()) for q in ref.parameters()]}
    return out


def test_hooks_with_ddp_no_sync():
    tols = {"fp32": 0.0, "blockwise8:block=256": 0.02}
    res = run_distributed(_ddp_hooks_worker, 2, args=(list(tols),), timeout=60.0)
    for r in res:
        for spec, tol in tols.items():
            for err, scale in zip(r[spec]["err"], r[spec]["scale"]):
                assert err <= tol * scale, (spec, err, scale)
        assert r["fp32"]["held"] == r["fp32"]["fp32"]
        assert 0.25 <= r["blockwise8:block=256"]["held"] / r["blockwise8:block=256"]["fp32"] < 0.27
