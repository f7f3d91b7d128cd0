"""Compressed collectives on gloo: exact with fp32, within the codec's bound with fp8, error cases.

Each test starts one small gloo group (world 2-4, tiny tensors) and runs many
checks inside it; assertions fail inside the workers and come back with the
worker's traceback.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import WorkerError, run_distributed
from qwire.codecs import CodecError, get_codec
from qwire.codecs.fp8 import FORMATS
from qwire.comm import (
    CollectiveError,
    all_gather,
    all_gather_dim,
    all_gather_into,
    all_reduce,
    all_reduce_future,
    broadcast,
    check_same_codec,
    copy_to_tp_region,
    force_host_staging,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter,
    reduce_scatter_dim,
    reduce_scatter_to_sp_region,
    staged_bytes,
    wire_bytes,
)
from qwire.comm.collectives import sent_bytes

SHAPES = [(1,), (7,), (3, 5, 11), (2, 3, 129)]


def _inputs(rank: int, shape, dtype=torch.float32, std=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + sum(shape))
    return (torch.randn(shape, generator=g) * std).to(dtype)


def _raw_gather(x: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return parts


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc


def _exact_fp32_worker(rank: int, world: int) -> dict:
    out = {}
    for shape in SHAPES:
        x = _inputs(rank, shape)
        parts = _raw_gather(x)
        ref_sum = _rank_order_sum(parts)
        numel = x.numel()
        k = -(-numel // world)

        g = all_gather(x, "fp32")
        assert g.shape == (world, *shape) and torch.equal(g, torch.stack(parts))

        for op in ("sum", "mean"):
            ref = ref_sum if op == "sum" else ref_sum / world
            rs = reduce_scatter(x, "fp32", op=op)
            padded = torch.cat([ref.reshape(-1), ref.new_zeros(world * k - numel)])
            assert rs.shape == (k,) and rs.dtype == x.dtype
            assert torch.equal(rs, padded[rank * k:(rank + 1) * k]), (shape, op)
            ar = all_reduce(x, "fp32", op=op)
            assert ar.shape == x.shape and ar.dtype == x.dtype
            assert torch.equal(ar, ref), (shape, op)

        # against torch's own collectives
        ar_torch = x.clone()
        dist.all_reduce(ar_torch)
        ar = all_reduce(x, "fp32")
        if world == 2:
            assert torch.equal(ar, ar_torch)
        else:
            torch.testing.assert_close(ar, ar_torch, rtol=1e-6, atol=1e-6)
        if numel % world == 0:
            rs_torch = torch.empty(numel // world)
            dist.reduce_scatter_tensor(rs_torch, x.reshape(-1).clone())
            torch.testing.assert_close(reduce_scatter(x, "fp32"), rs_torch, rtol=1e-6, atol=1e-6)
        out[str(shape)] = ar

    # async variants give the same bits; several in flight complete in order
    # (no other collective on the group until they are done: the background thread issues them)
    futs = [all_reduce_future(x * i, "fp32") for i in range(3)]
    got = [fut.wait() for fut in futs]
    for i in range(3):
        assert torch.equal(got[i], all_reduce(x * i, "fp32"))
    assert torch.equal(all_reduce_future(x, get_codec("fp32"), background=False).wait(), ar)

    # bf16 tensors through the fp32 codec: summed in fp32, cast once
    xb = _inputs(rank, (5, 9), torch.bfloat16)
    arb = all_reduce(xb, "fp32")
    assert arb.dtype == torch.bfloat16
    assert torch.equal(arb, _rank_order_sum(_raw_gather(xb)).to(torch.bfloat16))

    # dim-wise variants (sequence parallelism)
    x = _inputs(rank, (2, 4 * world, 3))
    parts = _raw_gather(x)
    assert torch.equal(all_gather_dim(x, 1, "fp32"), torch.cat(parts, 1))
    assert torch.equal(reduce_scatter_dim(x, 1, "fp32"), _rank_order_sum(parts).chunk(world, 1)[rank])

    # empty tensors
    e = torch.empty(0, 3)
    assert all_reduce(e, "fp8").shape == (0, 3)
    assert reduce_scatter(e, "fp8").shape == (0,)
    return out


def _fp8_worker(rank: int, world: int) -> dict:
    out = {}
    for spec in ("fp8", "fp8:format=e5m2,group=32", "fp8plain", "bf16"):
        codec = get_codec(spec)
        u = FORMATS[codec.format].unit_roundoff if hasattr(codec, "format") else 2.0 ** -8
        for shape in SHAPES[1:]:
            for std in (1.0, 1e-3):
                x = _inputs(rank, shape, std=std)
                parts = _raw_gather(x)
                exact = _rank_order_sum(parts)
                norms = sum(float(p.norm()) for p in parts)
                ar = all_reduce(x, codec)
                assert ar.shape == x.shape and ar.dtype == x.dtype and torch.isfinite(ar).all()
                # out=: the same bits written into a given tensor, x itself included (read before written)
                dst = torch.full_like(x, float("nan"))
                assert all_reduce(x, codec, out=dst) is dst and torch.equal(dst, ar), (spec, shape)
                y = x.clone()
                assert torch.equal(all_reduce_future(y, codec, out=y).wait(), ar) and torch.equal(y, ar)
                # two quantizations: every contribution, then the sum (norm-wise, fp32 slack included)
                bound = (u * (1 + u) * norms + u * float(exact.norm())) * 1.01 + 1e-6 * std
                assert float((ar - exact).norm()) <= bound, (spec, shape, std)
                g = all_gather(x, codec)
                for r in range(world):
                    assert float((g[r] - parts[r]).norm()) <= u * float(parts[r].norm()) * 1.01 + 1e-6 * std
                out[f"{spec}{shape}{std}"] = ar
                # reduce_scatter: one quantization per contribution
                k = -(-x.numel() // world)
                rs = reduce_scatter(x, codec)
                ref = torch.cat([exact.reshape(-1), exact.new_zeros(world * k - x.numel())])[rank * k:(rank + 1) * k]
                assert float((rs - ref).norm()) <= u * norms * 1.01 + 1e-6 * std
    for bad in (torch.empty(3), torch.empty(7, dtype=torch.float64), torch.empty(14)[::2]):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            all_reduce(_inputs(rank, (7,)), "fp8", out=bad)
    # bf16 tensor, fp8 on the wire
    xb = _inputs(rank, (3, 256), torch.bfloat16)
    arb = all_reduce(xb, "fp8")
    exact = _rank_order_sum(_raw_gather(xb))
    assert arb.dtype == torch.bfloat16
    assert float((arb.float() - exact).norm() / exact.norm()) < 0.1
    return out


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fp32_is_exact(world):
    results = run_distributed(_exact_fp32_worker, world, timeout=60)
    for key in results[0]:
        for r in range(1, world):
            assert torch.equal(results[r][key], results[0][key])  # bit-identical on every rank


@pytest.mark.parametrize("world", [3, 4])
def test_fp8_within_bound(world):
    results = run_distributed(_fp8_worker, world, timeout=60)
    for key in results[0]:
        for r in range(1, world):
            assert torch.equal(results[r][key], results[0][key])


def _staging_worker(rank: int, world: int, staged: bool) -> dict:
    force_host_staging(staged)
    out: dict = {}
    for spec in ("fp8", "int4", "fp32"):
        x = _inputs(rank, (3, 5, 11))
        out[f"all_reduce {spec}"] = all_reduce(x, spec)
        out[f"all_gather {spec}"] = all_gather(x, spec)
        out[f"reduce_scatter {spec}"] = reduce_scatter(x, spec, op="mean")
    raw = torch.full((6,), float(rank))
    gathered = torch.empty(6 * world)
    all_gather_into(gathered, raw)  # raw bytes, as FSDP's mixed-dtype all-gather sends them
    out["all_gather_into"] = gathered
    t = torch.arange(4.0) + rank
    broadcast(t, 0)
    out["broadcast"] = t
    out["sent"], out["staged"] = sent_bytes(), staged_bytes()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_host_staging_gives_the_same_results_through_host_buffers(world):
    """The gloo transport for CUDA tensors (ranks sharing a GPU): every payload goes through a host
    buffer. Forced here on CPU tensors, the path is the same but for the device copy: the results are
    bit-identical to the plain path's, the bytes sent are the same, and the bytes copied are exactly the
    payloads (each one out and what arrives back in) and the raw transfers."""
    plain = run_distributed(_staging_worker, world, args=(False,), timeout=60)
    staged = run_distributed(_staging_worker, world, args=(True,), timeout=60)
    for a, b in zip(plain, staged):
        for key in a:
            if key not in ("sent", "staged"):
                assert torch.equal(a[key], b[key]), key
        assert a["sent"] == b["sent"] > 0 and a["staged"] == 0
    # per rank: an all-gather copies its payload out and world payloads back, an all-to-all (inside the
    # reduce-scatter) world payloads each way; all_reduce = reduce-scatter + all-gather of the shard
    n = 3 * 5 * 11
    k = -(-n // world)
    expect = 0
    for spec in ("fp8", "int4", "fp32"):
        c = get_codec(spec)
        full, shard = c.payload_nbytes((3, 5, 11), torch.float32), c.payload_nbytes((k,), torch.float32)
        rs = 2 * world * shard
        expect += (rs + shard * (1 + world)) + full * (1 + world) + rs
    expect += 6 * 4 * (1 + world) + 2 * 4 * 4
    assert [r["staged"] for r in staged] == [expect] * world


def _sent_worker(rank: int, world: int) -> dict:
    """reduce_scatter(sent=...) with stochastic rounding: what this rank's payloads decode to, from the very
    payloads sent (a second encode would draw other random numbers)."""
    codec = get_codec("int4:rounding=stochastic,seed=" + str(rank))
    x = _inputs(rank, (1001,))
    k = -(-1001 // world)
    sent = torch.empty(world, k)
    shard = reduce_scatter(x, codec, None, sent=sent)
    again = reduce_scatter(x, codec, None)  # the codec's generator has moved on: other draws
    with pytest.raises(ValueError, match="sent must be"):
        reduce_scatter(x, codec, None, sent=torch.empty(world, k + 1))
    return {"sent": sent, "shard": shard, "again": again}


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_reports_what_its_payloads_decode_to(world):
    res = run_distributed(_sent_worker, world, timeout=60)
    k = -(-1001 // world)
    for r in range(world):  # rank r's shard is the rank-order fp32 sum of what every rank sent it
        expect = _rank_order_sum([res[q]["sent"][r] for q in range(world)])
        assert torch.equal(res[r]["shard"], expect)
        assert not torch.equal(res[r]["again"], expect)  # stochastic: a second encode differs
    pad = torch.cat([_inputs(0, (1001,)), torch.zeros(world * k - 1001)]).view(world, k)
    assert float((res[0]["sent"] - pad).abs().max()) > 0  # quantized, not the input itself


def _autograd_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)  # same w on every rank
    w = torch.randn(2, 2 * world, 3)
    x = _inputs(rank, (2, 2 * world, 3)).requires_grad_()

    # reduce_from_tp_region: forward sum, backward identity
    y = reduce_from_tp_region(x, "fp32")
    assert torch.equal(y.detach(), _rank_order_sum(_raw_gather(x.detach())))
    (y * w).sum().backward()
    assert torch.equal(x.grad, w)
    x.grad = None

    # copy_to_tp_region: forward identity, backward sum of every rank's gradient
    y = copy_to_tp_region(x, "fp32")
    assert torch.equal(y.detach(), x.detach())
    (y * w * (rank + 1)).sum().backward()
    assert torch.equal(x.grad, w * sum(range(1, world + 1)))
    x.grad = None

    # gather along dim 1 forward; reduce-scatter backward
    xs = _inputs(rank, (2, 2, 3)).requires_grad_()
    y = gather_from_sp_region(xs, 1, "fp32")
    assert y.shape == (2, 2 * world, 3)
    (y * w).sum().backward()
    torch.testing.assert_close(xs.grad, world * w.chunk(world, 1)[rank], rtol=0, atol=1e-6)

    # reduce-scatter along dim 1 forward; all-gather backward
    y = reduce_scatter_to_sp_region(x, 1, "fp32")
    assert y.shape == (2, 2, 3)
    (y * w.chunk(world, 1)[rank]).sum().backward()
    assert torch.equal(x.grad, w)

    # the fp8 versions run and stay close
    x.grad = None
    y = reduce_from_tp_region(copy_to_tp_region(x, "fp8"), "fp8")
    (y * w).sum().backward()
    assert float((x.grad - world * w).norm() / (world * w).norm()) < 0.1


def test_autograd_operators():
    run_distributed(_autograd_worker, 2, timeout=60)


def _ddp_hook(state, bucket):
    return all_reduce_future(bucket.buffer(), state, op="mean")


def _ddp_worker(rank: int, world: int) -> list:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    grads = {}
    for name, codec in (("plain", None), ("fp32", "fp32"), ("fp8", "fp8")):
        model = DDP(torch.nn.Sequential(*[m for m in base]), bucket_cap_mb=1e-4)  # several buckets
        if codec is not None:
            model.register_comm_hook(codec, _ddp_hook)
        model.zero_grad()
        x = _inputs(rank, (4, 5))
        model(x).square().sum().backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    for a, b, c in zip(grads["plain"], grads["fp32"], grads["fp8"]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        assert float((c - a).norm()) <= 0.1 * float(a.norm()) + 1e-6
    return grads["fp32"]


def test_usable_as_ddp_comm_hook():
    g = run_distributed(_ddp_worker, 2, timeout=60)
    for a, b in zip(g[0], g[1]):
        assert torch.equal(a, b)


def _mismatch_worker(rank: int, world: int) -> str:
    spec = "fp8:format=e4m3" if rank == 0 else "fp8:format=e5m2"
    check_same_codec("fp8", shape=(3, 4), dtype=torch.float32)  # agreeing ranks pass
    try:
        check_same_codec(spec)
    except CodecError as e:
        msg = str(e)
    else:
        raise AssertionError("mismatch not detected")
    try:
        check_same_codec("fp8", shape=(3, 4 + rank))
    except CodecError as e:
        assert "shape=(3, 5)" in str(e)
    else:
        raise AssertionError("shape mismatch not detected")
    # argument errors raise before any communication
    x = torch.ones(3, 5)
    only_0 = dist.new_group([0])
    for call, match in (
        (lambda: all_reduce(x, "fp8", op="max"), "op must be"),
        (lambda: reduce_scatter_dim(x, 0, "fp8"), "not divisible by the world size"),
        (lambda: all_reduce(x, "fp8:group=48"), "power of two"),
        (lambda: all_reduce(x.double(), "fp8"), "float32, float16 or bfloat16"),
        (lambda: all_reduce(x, "nosuchcodec"), "unknown codec"),
        *([(lambda: all_reduce(x, "fp8", group=only_0), r"this process \(rank 1\) is not in the group")]
          if rank == 1 else []),  # was an "invalid shape dimension" from the shard arithmetic
    ):
        with pytest.raises((CodecError, CollectiveError), match=match):
            call()
    bad = torch.ones(4)
    bad[1] = float("nan")
    fut = all_reduce_future(bad, "fp8")
    with pytest.raises(Exception, match="NaN"):
        fut.wait()
    return msg


def test_mismatched_codecs_and_bad_arguments():
    msgs = run_distributed(_mismatch_worker, 2, timeout=60)
    for m in msgs:
        assert "rank 0: fp8:format=e4m3,group=128,hadamard=true" in m
        assert "rank 1: fp8:format=e5m2,group=128,hadamard=true" in m


def _timeout_worker(rank: int, world: int) -> str:
    if rank == 1:
        time.sleep(4)  # never joins the collective
        return "idle"
    try:
        all_reduce(torch.ones(8), "fp8")
    except Exception as e:  # gloo reports the timeout as a (DistBackend) RuntimeError
        return type(e).__name__
    raise AssertionError("collective with a missing peer returned")


def test_missing_peer_times_out():
    res = run_distributed(_timeout_worker, 2, timeout=1.5)
    assert res[1] == "idle" and res[0]


def _failing_worker(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


def test_run_distributed_propagates_worker_errors():
    with pytest.raises(WorkerError, match="boom on rank 1"):
        run_distributed(_failing_worker, 2, timeout=5)


def test_not_initialized_and_wire_bytes():
    with pytest.raises(CollectiveError, match="init_process_group"):
        all_reduce(torch.ones(4), "fp32")
    fp32 = wire_bytes("all_reduce", (1024,), torch.float32, "fp32", 4)
    fp8 = wire_bytes("all_reduce", (1024,), torch.float32, "fp8", 4)
    assert fp32 == {"steps": 2, "bytes_per_step": 3 * 1024, "bytes_total": 6 * 1024, "payload_per_shard": 1024}
    assert fp8["payload_per_shard"] == 256 + 16
    assert wire_bytes("all_gather", (4, 64), torch.float32, "bf16", 2)["bytes_total"] == 512
    with pytest.raises(CollectiveError):
        wire_bytes("broadcast", (4,), torch.float32, "fp32", 2)


def test_bench_taco_quick_writes_reports(tmp_path):
    import argparse
    import json

    from qwire.bench import taco

    parser = argparse.ArgumentParser()
    taco.add_arguments(parser)
    args = parser.parse_args(["--quick", "--out", str(tmp_path)])
    assert taco.run(args) == 0
    res = json.loads((tmp_path / "taco.json").read_text())
    md = (tmp_path / "taco.md").read_text()
    assert res["meta"]["command"].startswith("qwire bench taco --quick")
    assert {r["spec"] for r in res["codec_error"]["main"]} >= {"fp8:format=e4m3,group=128", "bf16"}
    assert {r["spec"] for r in res["collectives"]} >= {"fp32", "bf16", "fp8"}
    fp8 = next(r for r in res["collectives"] if r["spec"] == "fp8" and r["kind"] == "all_reduce")
    fp32 = next(r for r in res["collectives"] if r["spec"] == "fp32" and r["kind"] == "all_reduce")
    assert fp8["wire"]["bytes_total"] < fp32["wire"]["bytes_total"] / 3.5
    assert "Command: `qwire bench taco --quick" in md and "simulated" in md.lower()
    # the project's own model preset and corpus tokens
    assert res["meta"]["model_name"] == "llama-micro" and res["meta"]["data"].startswith("corpus 'stdlib'")
    assert res["codec_error"]["tensors"]["row-parallel outputs"]["numel"] == 2 * 4 * 32 * 128  # 2 per layer


def _deferred_worker(rank: int, world: int, impl: str, defer: bool, poison: bool = False) -> dict:
    import os

    os.environ["QWIRE_DEFER_CHECKS"] = "1" if defer else "0"
    out: dict = {}
    for spec in ("int4", "fp8", "perchannel6"):
        codec = f"{spec}:impl={impl}"
        x = _inputs(rank, (3, 5, 64))
        if poison and rank == 0:
            x[1, 2, 3] = float("nan")
        out[f"all_reduce {spec}"] = all_reduce(x, codec)
        out[f"all_gather {spec}"] = all_gather(x, codec)
        out[f"reduce_scatter {spec}"] = reduce_scatter(x, codec, op="mean")
    return out


TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None or (
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="the Triton kernels need triton, and a CUDA GPU or TRITON_INTERPRET=1 (Triton's interpreter)")


@TRITON
def test_deferred_checks_give_the_same_results_and_refuse_nan_before_sending():
    """On a GPU the collectives read their codecs' checks back once for the encodes (before sending) and once
    for the decodes (QWIRE_DEFER_CHECKS=1 forces it here, with the Triton kernels under the interpreter): the
    results are bit-identical to the CPU kernels' reading them at once, and a NaN is refused by the rank that
    has it, from the deferred checks' resolve()."""
    plain = run_distributed(_deferred_worker, 2, args=("auto", False), timeout=120)
    later = run_distributed(_deferred_worker, 2, args=("triton", True), timeout=120)
    for a, b in zip(plain, later):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    with pytest.raises(WorkerError) as e:
        run_distributed(_deferred_worker, 2, args=("triton", True, True), timeout=60)
    first = str(e.value).split("--- rank ")[1]
    assert first.startswith("0 raised") and "NonFiniteError" in first and ", in resolve" in first


def test_a_background_job_runs_on_the_stream_current_where_it_was_submitted(monkeypatch):
    """The ordered background thread runs each job on the CUDA stream (and so the device) that was current where
    it was submitted: a new thread's own would be GPU 0's default stream. Here with a stand-in for torch.cuda."""
    import contextlib
    import threading

    from qwire.comm.collectives import submit_ordered

    current = threading.local()

    @contextlib.contextmanager
    def stream(s):
        current.s = s
        try:
            yield
        finally:
            del current.s

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "the stage's stream")
    monkeypatch.setattr(torch.cuda, "stream", stream)
    assert submit_ordered(lambda: getattr(current, "s", None)).wait() == "the stage's stream"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert submit_ordered(lambda: getattr(current, "s", "none entered")).wait() == "none entered"


def _fp16_overflow_worker(rank: int, world: int) -> str:
    x = torch.zeros(1000, dtype=torch.float16)
    x[100] = x[900] = 40000.0  # finite here, 80000 summed: past fp16 in both ranks' shards
    try:
        all_reduce(x, "int8")
    except CodecError as e:
        return str(e)
    return "no error"


def test_a_sum_past_fp16_of_finite_inputs_says_so() -> None:
    """The owner of a shard whose fp16 sum overflowed re-encoded Inf and blamed a diverged training."""
    for msg in run_distributed(_fp16_overflow_worker, 2, timeout=60):
        assert "the sum over the ranks of these torch.float16 tensors exceeds the dtype's range (65504) in 1 " \
               "elements, though every input was finite; all-reduce them in float32" in msg, msg
