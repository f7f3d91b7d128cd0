"""On a CUDA GPU: codecs give the same payloads as on the CPU, and AQ-SGD's cache stays in pinned host
memory. Marked ``cuda``: skipped where torch sees no GPU; on a GPU machine, `python -m pytest -m cuda`."""

from __future__ import annotations

import pytest
import torch

from qwire.codecs import get_codec

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _no_kernel_retired():
    """Under impl=auto a kernel that fails to compile or launch is retired with a warning and the reference
    runs instead, so payload comparisons alone would pass; on a GPU every kernel has to run."""
    from qwire.codecs import kernels

    yield
    assert not kernels._RETIRED, f"kernels retired after failing on the GPU: {sorted(kernels._RETIRED)}"

# deterministic codecs whose payload does not depend on the device
SPECS = ["fp32", "fp16", "bf16", "int4", "int8", "perchannel6", "blockwise8", "fp8", "fp8plain", "tahquant",
         "tahquant-public", "tahquant:layout=log7,fit_rotated=false", "tahquant:layout=log7,fit_rotated=true",
         "tahquant:layout=log7,adapt=block,fit_rotated=true", "tahquant:layout=log7,adapt=predict,fit_rotated=true",
         "tahquant:zero_width=fixed"]


@pytest.mark.parametrize("spec", SPECS)
def test_cuda_payloads_equal_cpu_payloads(spec: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 128, 256, generator=g)
    x[:, :, 7] *= 50  # an outlier channel
    cpu = get_codec(spec, impl="torch")
    dev = get_codec(spec)  # impl=auto: whatever runs on CUDA tensors
    p_cpu = cpu.encode(x)
    p_dev = dev.encode(x.cuda())
    assert p_dev.device.type == "cuda" and p_dev.numel() == p_cpu.numel()
    assert torch.equal(p_dev.cpu(), p_cpu), spec
    y = dev.decode(p_dev, x.shape, x.dtype)
    assert y.device.type == "cuda"
    torch.testing.assert_close(y.cpu(), cpu.decode(p_cpu, x.shape, x.dtype), rtol=0, atol=0)


def subnormal_input() -> torch.Tensor:
    """Values, tile minima and quotients below fp32's smallest normal number: rows of subnormals, and tiles of
    positive values but one of -1e-40 or -1e-45 (a zero code from ``floor(lo / step)``, a quotient that is
    subnormal)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, 256, generator=g)
    x[0] *= 1e-39
    x[1:3] = x[1:3].abs()
    x[1, :, ::32] = -1e-40
    x[2] *= 1e-30
    x[2, :, 5::32] = -1e-45
    return x


@pytest.mark.parametrize("spec", ["int4", "int4:fit=mse", "int8", "perchannel6", "blockwise8", "fp8", "fp8plain",
                                  "tahquant", "tahquant:layout=log7,fit_rotated=true", "fp16"])
def test_subnormal_inputs_give_the_cpu_payloads(spec: str) -> None:
    """Nothing flushes a subnormal to zero on the GPU: Triton compiles its math functions flushing them by
    default (``tl.floor(-1e-40)`` was -0, the reference's -1); the kernels are compiled without
    (``gpu/_common.py: COMPILE_OPTIONS``), and scripts/compile_for_gpu.py refuses PTX that flushes."""
    x = subnormal_input()
    cpu = get_codec(spec, impl="torch")
    dev = get_codec(spec)
    p_cpu = cpu.encode(x)
    p_dev = dev.encode(x.cuda())
    assert torch.equal(p_dev.cpu(), p_cpu), spec
    y = dev.decode(p_dev, x.shape, x.dtype)
    assert torch.equal(y.cpu(), cpu.decode(p_cpu, x.shape, x.dtype)), spec


def test_division_by_a_number_rounds_as_on_the_cpu() -> None:
    """The codecs' reference arithmetic divides through ``base.div``: on CUDA, torch turns ``t / 14.5`` into a
    multiplication by the reciprocal, whose last bit can differ from the CPU's quotient."""
    from qwire.codecs.base import div

    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    for d in (14.5, 31, 3.0, torch.tensor(7.25)):
        assert torch.equal(div(x.cuda(), d).cpu(), x / d), d


def test_aqsgd_cache_lives_in_pinned_host_memory() -> None:
    codec = get_codec("aqsgd:inner=int4")
    x = torch.randn(2, 16, 64, device="cuda")
    ids = torch.tensor([3, 5])
    p = codec.encode(x, sample_ids=ids)
    rows = codec.state_dict()["rows"]
    assert rows.device.type == "cpu"
    assert all(codec.cache.get(i).is_pinned() for i in (3, 5))
    again = codec.encode(x, sample_ids=ids)  # second visit: a delta against the cached rows
    assert again.device.type == "cuda" and again.numel() == p.numel()
    resumed = get_codec("aqsgd:inner=int4")
    resumed.load_state_dict(codec.state_dict())  # a checkpoint's rows load pageable ...
    resumed.encode(x, sample_ids=ids)
    assert all(resumed.cache.get(i).is_pinned() for i in (3, 5))  # ... and are pinned again at their next visit


@pytest.mark.parametrize("spec", ["int4", "int4:fit=mse", "int8", "blockwise8", "blockwise4", "fp4", "fp8", "fp8plain",
                                  "perchannel6", "tahquant", "tahquant:unit=token", "tahquant:ratio=0.8",
                                  "tahquant:ratio=0.8,slots=token,layout=logx,zero_ext=8"])
def test_triton_kernels_run_on_cuda_tensors(spec: str) -> None:
    """impl=auto picks the Triton kernels for CUDA tensors where triton is installed (it comes with torch's
    CUDA wheels), and they give the CPU reference's payloads on an LLM-like input with massive outliers."""
    pytest.importorskip("triton")
    from qwire.codecs import kernels
    from qwire.codecs.synthetic import llm_like

    c = get_codec(spec)
    assert kernels.implementation(c, "cuda") == "triton"
    x, _ = llm_like((2, 256, 1600), seed=3)
    p = c.encode(x.cuda())
    ref = get_codec(spec, impl="torch")
    assert torch.equal(p.cpu(), ref.encode(x)), spec
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        y = c.decode(c.encode(xd.cuda()), x.shape, dtype)
        assert torch.equal(y.cpu(), ref.decode(ref.encode(xd), x.shape, dtype)), (spec, dtype)


@pytest.fixture(scope="module")
def tiny_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from dist_utils import tiny_model_env

    return tiny_model_env(tmp_path_factory.mktemp("cuda-train"), layers=4)


def _train_cfg(env: dict[str, str], name: str, **kw):
    import dataclasses
    from pathlib import Path

    from qwire.train import TrainConfig

    base = TrainConfig(stages=2, steps=3, batch_size=8, microbatches=4, seq_len=32, model=env["model"],
                       vocab_size=512, max_tokens=40_000, eval_every=0, eval_batches=2, log_every=1,
                       checkpoint_every=0, fwd_codec="tahquant", bwd_codec="perchannel6", timeout=120,
                       out=str(Path(env["base"]) / name))
    return dataclasses.replace(base, **kw)


def _losses(cfg) -> list[float]:
    import json
    from pathlib import Path

    return [json.loads(ln)["loss"] for ln in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _cuda_tracks_cpu(env: dict[str, str], name: str, out: str, **kw) -> None:
    """The same 3-step run on cpu and on cuda over gloo: the header names the staging, and the losses track the
    CPU run's (the codecs give the same payloads on both devices; the model's own arithmetic differs by
    rounding). ``out``: what the runs printed (capfd's reader)."""
    from qwire.train import launch

    runs = {dev: _train_cfg(env, f"{name}-{dev}", device=dev, backend="gloo", **kw) for dev in ("cpu", "cuda")}
    for cfg in runs.values():
        launch(cfg)
    assert "on cuda with gloo (payloads staged through host memory)" in out()
    loss = {dev: _losses(cfg) for dev, cfg in runs.items()}
    assert len(loss["cuda"]) == 3
    assert loss["cuda"] == pytest.approx(loss["cpu"], rel=2e-2)


def test_pipeline_training_on_cuda_stages_sharing_a_gpu(tiny_env, capfd: pytest.CaptureFixture[str]) -> None:
    """qwire train --device cuda --backend gloo: two stages on one GPU, the payloads staged through pinned
    host memory."""
    _cuda_tracks_cpu(tiny_env, "pp", lambda: capfd.readouterr().out)
    import json
    from pathlib import Path

    rows = [json.loads(ln) for ln in (Path(tiny_env["base"]) / "pp-cuda" / "metrics.jsonl").read_text().splitlines()]
    # the codecs' seconds come from CUDA events around each encode and decode, read at the step's end
    assert all(0 < r["codec_time_max_s"] < r["step_time_max_s"] for r in rows), rows


def test_codec_graphs_train_as_the_kernels_do(tiny_env, capfd: pytest.CaptureFixture[str]) -> None:
    """qwire train --device cuda --codec-graphs (2 stages, tahquant forward, perchannel6 back, ranks sharing the
    GPU): the same payloads, so the same wire bytes and losses as the run without graphs (up to the GPU's own
    run-to-run differences in the model's backward)."""
    import json
    from pathlib import Path

    from qwire.train import launch

    rows = {}
    for graphs in (False, True):
        cfg = _train_cfg(tiny_env, f"graphs-{graphs}", device="cuda", backend="gloo", codec_graphs=graphs)
        launch(cfg)
        rows[graphs] = [json.loads(ln) for ln in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert "codec kernels in CUDA graphs" in capfd.readouterr().out
    for key in ("wire_bytes_fwd", "wire_bytes_bwd"):
        assert [r[key] for r in rows[True]] == [r[key] for r in rows[False]], key
    assert [r["loss"] for r in rows[True]] == pytest.approx([r["loss"] for r in rows[False]], rel=1e-4)


def test_the_codec_clock_times_cuda_codecs_with_events() -> None:
    from qwire.parallel.pipeline import CodecClock

    clock, codec = CodecClock("cuda"), get_codec("tahquant")
    x = torch.randn(4, 1024, 1024, device="cuda")
    with clock.timed():
        y = codec.decode(codec.encode(x), x.shape, x.dtype)
    assert clock.calls == 1 and y.device.type == "cuda"
    assert clock.take() > 0 and clock.take() == 0.0 and clock.calls == 0


@pytest.mark.parametrize("mesh", [
    {"stages": 1, "tp": 2},                    # TACO's fp8 tensor parallelism, two ranks on one GPU
    {"stages": 1, "dp": 2},                    # DDP with QuanGrad's 8-bit all-reduce
    {"stages": 2, "dp": 2, "dp_shard": True},  # FSDP2 with compressed gradients and weights, under the pipeline
    {"stages": 2, "tp": 2, "dp": 2},           # 3D: eight ranks on one GPU
    {"stages": 2, "dp": 2, "dp_sync_every": 2},  # DiLoCo: anchors in pinned host memory, meetings at steps 2 and 3
    {"stages": 2, "dp": 2, "dp_sync_every": 2, "dp_sync_overlap": 1},  # its meeting's all-reduce in a thread
    {"stages": 1, "tp": 2, "dp": 2, "dp_sync_every": 2, "dp_sync_fragments": 2,  # TP shards meeting in 2 fragments,
     "dp_error_feedback": True},                                              # residuals on the GPU
], ids=["tp", "ddp", "fsdp", "3d", "diloco", "diloco-overlap", "diloco-tp-fragments"])
def test_every_parallel_dimension_on_cuda_ranks_sharing_a_gpu(tiny_env, mesh,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    """--device cuda --backend gloo with tensor and data parallelism: the collectives' payloads cross through
    pinned host buffers (NCCL refuses two ranks on one GPU)."""
    name = "-".join(f"{k}{v}" for k, v in mesh.items())
    _cuda_tracks_cpu(tiny_env, name, lambda: capfd.readouterr().out, **mesh, tp_codec="fp8",
                     dp_codec="blockwise8:block=256", dp_param_codec="fp8" if mesh.get("dp_shard") else "")


def test_aqsgd_laaq_checkpoint_and_resume_on_cuda(tiny_env) -> None:
    """AQ-SGD (its caches in pinned host memory) and LAAQ's low-bit saved activations on two stages sharing
    a GPU; a run stopped after its step-2 checkpoint and resumed ends with the uninterrupted run's losses."""
    import dataclasses
    import json
    import shutil
    from pathlib import Path

    from qwire.train import launch

    straight = _train_cfg(tiny_env, "aq-laaq-cuda", device="cuda", backend="gloo", steps=4, checkpoint_every=2,
                          fwd_codec="aqsgd:inner=int4", bwd_codec="perchannel8", laaq="agoq")
    launch(straight)
    cut = dataclasses.replace(straight, out=straight.out + "-cut")
    shutil.copytree(straight.out, cut.out)
    ck = Path(cut.out) / "checkpoints"
    shutil.rmtree(ck / "step_0000004")
    (ck / "latest.json").write_text(json.dumps({"step": 2, "dir": "step_0000002"}))
    launch(cut, resume=True)

    assert len(_losses(straight)) == 4
    assert _losses(cut) == pytest.approx(_losses(straight), rel=1e-5)


def test_nccl_under_torchrun(tiny_env) -> None:
    """torchrun, one rank with its own GPU: --backend auto takes NCCL, the process group joins through the
    attempt's store prefix, and the step's collectives (the byte counts summed over ranks) run on it."""
    import subprocess
    import sys
    from pathlib import Path

    from dist_utils import free_port

    cfg = _train_cfg(tiny_env, "nccl-torchrun", device="cuda", stages=1, fwd_codec="fp32", bwd_codec="fp32",
                     dp_codec="fp32")
    argv = ["--model", cfg.model, "--vocab-size", str(cfg.vocab_size), "--max-tokens", str(cfg.max_tokens),
            "--stages", "1", "--steps", "3", "--batch-size", "8", "--microbatches", "4", "--seq-len", "32",
            "--eval-every", "0", "--log-every", "1", "--device", "cuda", "--timeout", "120", "--out", cfg.out]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "qwire", "train",
                          *argv], capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "on cuda with nccl" in out, out[-3000:]
    assert len(_losses(cfg)) == 3
    assert Path(cfg.out, "metrics.jsonl").exists()
