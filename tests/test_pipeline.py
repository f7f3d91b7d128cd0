"""Compressed pipeline boundaries on torch.distributed.pipelining (gloo, CPU)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dist_utils import WorkerError, run_distributed
from qwire.parallel.pipeline import BoundaryMismatchError, boundary_bytes, compressed_pipeline_stage

WIDTH, BATCH, MICRO = 16, 8, 4


def _stages(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _pipeline_worker(rank: int, world: int, fwd: str, bwd: str, schedule: str, staging: bool = False,
                     steps: int = 1, defer: bool | None = None, poison: bool = False, graphs: bool = False) -> dict:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from qwire.codecs.kernels.graphs import Rerun

    if graphs:  # the codecs' kernels through the CUDA-graph machinery, with its CPU stand-in
        os.environ["QWIRE_CODEC_GRAPHS"] = "rerun"

    module = _stages(world)[rank]
    x, target = _data()
    if poison:
        x[BATCH - 1, 3] = float("nan")  # the last micro-batch
    stage = compressed_pipeline_stage(module, rank, world, "cpu", input_args=torch.zeros(BATCH // MICRO, WIDTH),
                                      fwd=fwd, bwd=bwd, host_staging=staging, defer_checks=defer)
    sched = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule](stage, MICRO, loss_fn=_mse)
    losses: list[torch.Tensor] = []
    for _ in range(steps):
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            step_losses: list[torch.Tensor] = []
            sched.step(target=target, losses=step_losses)
            losses += step_losses
        else:
            sched.step()
    return {"losses": [float(v.detach()) for v in losses], "grads": [p.grad.clone() for p in module.parameters()],
            "bytes": boundary_bytes(stage), "staged": stage.staged_bytes, "replays": Rerun.replays}


def _reference(world: int) -> tuple[list[float], list[list[torch.Tensor]]]:
    stages = _stages(world)
    x, target = _data()
    losses = []
    for xm, tm in zip(x.chunk(MICRO), target.chunk(MICRO)):
        h = xm
        for s in stages:
            h = s(h)
        loss = _mse(h, tm)
        losses.append(float(loss.detach()))
        (loss / MICRO).backward()
    return losses, [[p.grad for p in s.parameters()] for s in stages]


@pytest.mark.parametrize("world,schedule", [(2, "1f1b"), (4, "1f1b"), (2, "gpipe")])
def test_fp32_boundaries_match_single_process_exactly(world: int, schedule: str) -> None:
    results = run_distributed(_pipeline_worker, world, args=("fp32", "fp32", schedule), timeout=60)
    ref_losses, ref_grads = _reference(world)
    assert results[-1]["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=0)
    for rank, r in enumerate(results):
        for g, rg in zip(r["grads"], ref_grads[rank]):
            torch.testing.assert_close(g, rg, rtol=1e-6, atol=1e-7)


def test_each_direction_sends_exactly_its_own_payload() -> None:
    # fp16 forward (2 B/element), fp32 backward (4 B/element): the carrier is sized for the larger,
    # but each direction must put only its own payload on the wire.
    results = run_distributed(_pipeline_worker, 2, args=("fp16", "fp32", "1f1b"), timeout=60)
    elems = BATCH * WIDTH  # all micro-batches of one step
    assert results[0]["bytes"] == {"fwd": elems * 2, "bwd": 0, "fp32": elems * 4}
    assert results[1]["bytes"] == {"fwd": 0, "bwd": elems * 4, "fp32": elems * 4}
    ref_losses, _ = _reference(2)
    assert results[1]["losses"] == pytest.approx(ref_losses, rel=1e-2)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_host_staging_moves_the_same_payloads_through_host_buffers(schedule: str) -> None:
    """The gloo transport for CUDA tensors (several stages on one GPU): every payload is copied into a
    host buffer before it is sent and out of one after it is received. Forced here on CPU tensors, the
    path is the same but for the device copy: same losses and gradients, the bytes on the wire are
    the payloads', and each staged byte was copied once on each side."""
    plain = run_distributed(_pipeline_worker, 3, args=("tahquant", "perchannel6", schedule, False, 2), timeout=90)
    staged = run_distributed(_pipeline_worker, 3, args=("tahquant", "perchannel6", schedule, True, 2), timeout=90)
    assert staged[-1]["losses"] == plain[-1]["losses"] and len(plain[-1]["losses"]) == 2 * MICRO
    for a, b in zip(plain, staged):
        for ga, gb in zip(a["grads"], b["grads"]):
            assert torch.equal(ga, gb)
        assert a["bytes"] == b["bytes"] and a["staged"] == 0
    wire = sum(r["bytes"]["fwd"] + r["bytes"]["bwd"] for r in staged)
    assert sum(r["staged"] for r in staged) == 2 * wire > 0


TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None or (
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="the Triton kernels need triton, and a CUDA GPU or TRITON_INTERPRET=1 (Triton's interpreter)")


@TRITON
def test_deferred_checks_train_the_same_and_refuse_nan_before_sending() -> None:
    """A stage on a GPU reads its codecs' checks back once per chunk (defer_checks, forced here on CPU tensors
    with the Triton kernels under the interpreter): the same payloads, losses and gradients as the CPU kernels
    reading them at once; a NaN activation is refused on the stage that produced it, with the codec's error,
    before its payload is sent."""
    args = ("1f1b", True, 1)
    plain = run_distributed(_pipeline_worker, 2, args=("tahquant", "perchannel6", *args, False), timeout=120)
    later = run_distributed(_pipeline_worker, 2, args=("tahquant:impl=triton", "perchannel6:impl=triton", *args,
                                                       True), timeout=120)
    assert later[-1]["losses"] == plain[-1]["losses"] and len(plain[-1]["losses"]) == MICRO
    for a, b in zip(plain, later):
        assert a["bytes"] == b["bytes"]
        for ga, gb in zip(a["grads"], b["grads"]):
            assert torch.equal(ga, gb)
    with pytest.raises(WorkerError) as e:
        run_distributed(_pipeline_worker, 2, args=("tahquant:impl=triton", "perchannel6:impl=triton", *args, True,
                                                   True), timeout=60)
    first = str(e.value).split("--- rank ")[1]
    assert first.startswith("0 raised") and "NonFiniteError" in first and "NaN/Inf value(s)" in first
    assert ", in resolve" in first  # raised by the chunk's resolve(), not by the encode


def test_codec_graphs_train_the_same() -> None:
    """--codec-graphs (QWIRE_CODEC_GRAPHS=rerun: the graph machinery with a CPU stand-in for the CUDA graph, the
    Triton kernels under Triton's interpreter): each boundary's first encode and decode run as usual, the second
    are captured, the rest replayed; the payloads, losses and gradients are those of the run without graphs,
    with the checks read at once and per chunk."""
    for defer in (False, True):
        args = ("tahquant:impl=triton", "perchannel6:impl=triton", "1f1b", False, 2, defer)
        plain = run_distributed(_pipeline_worker, 2, args=args, timeout=120)
        graphed = run_distributed(_pipeline_worker, 2, args=(*args, False, True), timeout=120)
        assert graphed[-1]["losses"] == plain[-1]["losses"] and len(plain[-1]["losses"]) == 2 * MICRO
        for a, b in zip(plain, graphed):
            assert a["bytes"] == b["bytes"] and a["replays"] == 0
            # per rank, 2 x MICRO encodes and decodes of one signature each: all but the first replayed
            assert b["replays"] == 2 * (2 * MICRO - 1)
            for ga, gb in zip(a["grads"], b["grads"]):
                assert torch.equal(ga, gb)


def _handshake_worker(rank: int, world: int) -> dict:
    """A staged stage whose device gloo cannot send from (``meta`` stands in for CUDA here): torch's start-up
    handshakes between neighbours must still cross as host tensors."""
    module = _stages(world)[rank]
    stage = compressed_pipeline_stage(module, rank, world, "cpu", input_args=torch.zeros(BATCH // MICRO, WIDTH),
                                      fwd="fp32", bwd="fp32", host_staging=True)
    stage.device = torch.device("meta")
    out = {"init": sorted({op.tensor.device.type for op in stage._get_init_p2p_neighbors_ops()})}
    if hasattr(stage, "_warmup_forward_vote"):  # torch 2.12 on: the static/dynamic vote, sent stage to stage
        acc = stage._warmup_forward_vote(True)
        res = stage._warmup_backward_result(acc if stage.is_last else None)
        out["vote"] = (acc.device.type, res.device.type, int(res.item()))
    out["device"] = stage.device.type
    return out


def test_host_staging_sends_torchs_start_up_handshakes_from_the_host() -> None:
    results = run_distributed(_handshake_worker, 2, timeout=60)
    for r in results:
        assert r["init"] == ["cpu"] and r["device"] == "meta"  # the stage's own device is left as it was
        if "vote" in r:
            assert r["vote"][:2] == ("cpu", "cpu") and r["vote"][2] in (0, 1)


def _mismatch_worker(rank: int, world: int) -> None:
    module = _stages(world)[rank]
    compressed_pipeline_stage(module, rank, world, "cpu", input_args=torch.zeros(2, WIDTH),
                              fwd="fp16" if rank == 0 else "bf16", bwd="fp32")


def _interleaved_worker(rank: int, world: int, case: str) -> Any:
    """Two stages per rank (ScheduleInterleaved1F1B: stages r and r + world), checked at the second."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    n = 2 * world
    modules, (x, target) = _stages(n), _data()
    mine = [rank, rank + world]
    try:
        stages = [compressed_pipeline_stage(
            modules[k], k, n, "cpu", input_args=torch.zeros(BATCH // MICRO, WIDTH), fwd="fp32",
            bwd="bf16" if case == "codec" and k == n - 1 else "fp32") for k in mine]
    except BoundaryMismatchError as e:
        return str(e)
    sched = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=_mse)
    losses: list[torch.Tensor] = []
    if rank == 0:
        sched.step(x)
    else:  # rank world - 1 holds the last stage
        sched.step(target=target, losses=losses)
    return [float(v.detach()) for v in losses]


def test_interleaved_schedules_check_their_boundaries_at_each_ranks_last_stage() -> None:
    """Several stages per rank: the check refused them ('4 stages need 4 ranks'), so only check=False ran."""
    got = run_distributed(_interleaved_worker, 2, ("same",), timeout=60)
    x, target = _data()
    seq = nn.Sequential(*_stages(4))
    with torch.no_grad():
        ref = [float(_mse(seq(a), b)) for a, b in zip(x.chunk(MICRO), target.chunk(MICRO))]
    assert got[1] == pytest.approx(ref, abs=1e-6)  # fp32 codecs: the single-process losses
    for msg in run_distributed(_interleaved_worker, 2, ("codec",), timeout=60):
        assert msg.startswith("pipeline stages disagree on their boundaries") and "boundary 2->3" in msg, msg


def test_stages_with_different_codecs_fail_at_start_up_with_a_clear_error() -> None:
    with pytest.raises(WorkerError) as e:
        run_distributed(_mismatch_worker, 2, timeout=60)
    msg = str(e.value)
    assert BoundaryMismatchError.__name__ in msg and "fp16" in msg and "bf16" in msg and "--fwd-codec" in msg


def test_plain_module_example_runs() -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "pipeline_plain_module.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    # both ranks print to the same pipe, so a line of one may be cut by the other's: find the losses anywhere
    losses = [float(v) for v in re.findall(r"step +\d+ loss (\d+\.\d{4})", out.stdout)]
    assert len(losses) >= 3 and losses[-1] < losses[0], out.stdout
    assert "sent" in out.stdout


def test_a_failed_check_is_the_root_cause_of_a_failed_chunk() -> None:
    """A chunk that fails while a deferred check of it would fail too (e.g. a module failing on a corrupt
    payload's values) raises the check's error, with the chunk's as its cause: the root cause is read last."""
    import types

    from qwire.codecs import CodecError
    from qwire.codecs.kernels.deferred import PendingChecks, judge
    from qwire.parallel.pipeline import CompressedPipelineStage

    def verdict(v: list) -> None:
        raise CodecError(f"check failed on {v}")

    def chunk() -> None:
        judge(torch.tensor([2.0]), verdict)
        raise RuntimeError("the chunk failed")

    stub = types.SimpleNamespace(pending_checks=PendingChecks())
    with pytest.raises(CodecError, match=r"check failed on \[2.0\]") as e:
        CompressedPipelineStage._checked(stub, chunk)
    assert isinstance(e.value.__cause__, RuntimeError) and len(stub.pending_checks) == 0
    stub.pending_checks = None  # no deferral: the check raises where it is made
    with pytest.raises(CodecError, match="check failed"):
        CompressedPipelineStage._checked(stub, chunk)


@TRITON
def test_backward_codecs_defer_their_checks_from_autograds_threads() -> None:
    """For CUDA tensors autograd runs a backward on its own device thread, which does not see the chunk's
    deferring() block: the boundary carries its stage's pending checks, and the gradient's decode (at the end of
    a stage) and encode (at its start) queue their checks there from any thread."""
    import threading

    from qwire.codecs import get_codec
    from qwire.codecs.kernels.deferred import PendingChecks
    from qwire.parallel.pipeline import Boundary, _Decode, _Encode

    shape = (2, 64)
    b = Boundary(torch.Size(shape), torch.float32, get_codec("int4:impl=triton"), get_codec("int4:impl=triton"))
    b.pending = PendingChecks()
    x = torch.randn(shape, requires_grad=True)
    sent = _Encode.apply(x, b)  # the end of one stage: its output's payload, carried as float32
    carrier = sent.detach().requires_grad_()
    y = _Decode.apply(carrier, b)  # the start of the next: the activation again
    assert len(b.pending) == 0  # the forward ran outside any deferring() block: read at once
    grads: dict[str, torch.Tensor] = {}

    def backward() -> None:  # as autograd's device thread: no deferring() block in force
        y.backward(torch.randn(shape))  # _Decode.backward encodes the gradient
        sent.backward(carrier.grad)  # _Encode.backward decodes it
        grads["x"] = x.grad

    t = threading.Thread(target=backward)
    t.start()
    t.join()
    assert len(b.pending) == 2  # the gradient's encode and decode, queued, not read
    b.pending.resolve()
    assert grads["x"].shape == x.shape and bool(torch.isfinite(grads["x"]).all())


def test_a_stage_index_outside_the_pipeline_is_refused() -> None:
    """stage_index -1 gave a stage that was neither first nor last, without a word."""
    with pytest.raises(ValueError, match=r"stage_index must be in \[0, num_stages\) = \[0, 2\), got -1"):
        compressed_pipeline_stage(torch.nn.Linear(4, 4), -1, 2, "cpu", input_args=torch.zeros(2, 4))
