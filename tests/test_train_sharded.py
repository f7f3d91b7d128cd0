"""`qwire train --dp N --dp-shard` (FSDP2 with qwire's collectives inside each pipeline stage) and
`--grad-accum-bits 8` (AGoQ's 8-bit gradient accumulation), end to end."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from dist_utils import tiny_model_env
from qwire.train import TrainConfig, launch


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_model_env(tmp_path_factory.mktemp("sharded"), layers=4)


def _cfg(env: dict[str, str], name: str, **kw) -> TrainConfig:
    base = TrainConfig(stages=2, dp=2, steps=4, batch_size=8, microbatches=4, seq_len=32, model=env["model"],
                       vocab_size=512, max_tokens=40_000, eval_every=0, eval_batches=2, log_every=1,
                       checkpoint_every=0, fwd_codec="fp32", bwd_codec="fp32", dp_codec="fp32", timeout=120,
                       out=str(Path(env["base"]) / name))
    return dataclasses.replace(base, **kw)


def _metrics(cfg: TrainConfig) -> list[dict]:
    return [json.loads(ln) for ln in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _fsdp_fp32(env: dict[str, str]) -> TrainConfig:
    """The 4-step FSDP run with exact collectives (made once, shared by the tests)."""
    cfg = _cfg(env, "fsdp", dp_shard=True)
    if not (Path(cfg.out) / "summary.json").exists():
        launch(cfg)
    return cfg


def test_fsdp_with_fp32_collectives_trains_like_ddp(env) -> None:
    ddp = _cfg(env, "ddp")
    launch(ddp)
    fsdp = _fsdp_fp32(env)
    a, b = _metrics(ddp), _metrics(fsdp)
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    # FSDP's data-parallel bytes, counted from the payloads, split into gradients and weights
    assert all(r["wire_bytes_dp"] == r["wire_bytes_dp_grad"] + r["wire_bytes_dp_param"] > 0 for r in b)
    assert b[0]["codec_dp_param"] == "uncompressed"


def test_fsdp_through_host_buffers_trains_exactly_the_same(env, monkeypatch: pytest.MonkeyPatch,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    """FSDP's weight all-gathers and gradient reduce-scatters staged through host buffers (the gloo
    transport of ranks sharing a GPU; forced on CPU tensors with QWIRE_HOST_STAGING=1): the same numbers."""
    monkeypatch.setenv("QWIRE_HOST_STAGING", "1")
    staged = _cfg(env, "fsdp-staged", dp_shard=True)
    launch(staged)
    assert "on cpu with gloo (payloads staged through host memory)" in capfd.readouterr().out
    a, b = _metrics(_fsdp_fp32(env)), _metrics(staged)
    assert len(a) == len(b) == 4
    for x, y in zip(a, b, strict=True):
        assert (x["loss"], x["grad_norm"], x["wire_bytes_dp"]) == (y["loss"], y["grad_norm"], y["wire_bytes_dp"])


def test_keeping_the_gathered_weights_gathers_once_per_step(env) -> None:
    """--dp-keep-weights (FSDP's reshard_after_forward=False): the same losses, and the weights cross once per step
    (4 micro-batches: without it, once per micro-batch's forward and again for its backward)."""
    keep = _cfg(env, "fsdp-keep", dp_shard=True, dp_keep_weights=True)
    launch(keep)
    a, b = _metrics(_fsdp_fp32(env)), _metrics(keep)
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6)
        assert y["wire_bytes_dp_grad"] == x["wire_bytes_dp_grad"]
        assert y["wire_bytes_dp_param"] < 0.5 * x["wire_bytes_dp_param"]
        # once per step: the weights' bytes equal the gradients' (both fp32, one shard of each per rank)
        assert y["wire_bytes_dp_param"] == y["wire_bytes_dp_grad"]
    with pytest.raises(ValueError, match="add --dp-shard"):
        TrainConfig(dp=2, dp_keep_weights=True).validate()


def test_fsdp_compressed_gradients_and_weights_and_resume(env) -> None:
    cfg = _cfg(env, "fsdp8", dp_shard=True, dp_codec="blockwise8:block=256", dp_param_codec="fp8", steps=6,
               checkpoint_every=2)
    launch(cfg)
    recs = _metrics(cfg)
    plain = _metrics(_fsdp_fp32(env))[0]  # fp32 gradients and weights, same model and batch
    assert recs[0]["wire_bytes_dp_grad"] < 0.3 * plain["wire_bytes_dp_grad"]
    assert recs[0]["wire_bytes_dp_param"] < 0.3 * plain["wire_bytes_dp_param"]
    assert recs[0]["loss"] == pytest.approx(plain["loss"], rel=0.01)
    assert recs[-1]["loss"] < recs[0]["loss"]
    ck = Path(cfg.out) / "checkpoints"
    assert sorted(p.name for p in (ck / "step_0000006").glob("stage*.pt")) == [
        "stage0-dp0.pt", "stage0-dp1.pt", "stage1-dp0.pt", "stage1-dp1.pt"]  # every replica its own shards
    # resume from step 4: the same losses as the uninterrupted run
    shutil.rmtree(ck / "step_0000006")
    (ck / "latest.json").write_text(json.dumps({"step": 4, "dir": "step_0000004"}))
    launch(cfg, resume=True)
    again = _metrics(cfg)
    assert [r["step"] for r in again] == list(range(1, 7))
    assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in recs], rel=1e-6)


def test_8bit_gradient_accumulation_holds_a_quarter_and_trains(env) -> None:
    """On FSDP shards inside pipeline stages (DDP's no-sync micro-batches: tests/test_grad_accum.py)."""
    ref = _fsdp_fp32(env)
    acc = _cfg(env, "acc8", steps=4, grad_accum_bits=8, dp_shard=True)
    launch(acc)
    a, b = _metrics(ref), _metrics(acc)
    assert b[0]["loss"] == pytest.approx(a[0]["loss"], rel=1e-6)  # the first forward is the same
    assert b[-1]["loss"] == pytest.approx(a[-1]["loss"], rel=0.02)
    for r in b:
        assert 0 < r["grad_accum_peak_bytes"] < 0.3 * r["grad_accum_fp32_bytes"]


def test_fsdp_composes_with_tensor_parallelism(env) -> None:
    """--tp 2 --dp 2 --dp-shard: FSDP over "dp" of the DeviceMesh whose "tp" the TP styles use; with exact
    collectives every step's loss equals the DDP run's."""
    kw = dict(stages=1, tp=2, tp_codec="fp32", steps=3, batch_size=4, microbatches=2, schedule="gpipe")
    ddp, fsdp = _cfg(env, "tp-ddp", **kw), _cfg(env, "tp-fsdp", dp_shard=True, **kw)
    launch(ddp)
    launch(fsdp)
    for x, y in zip(_metrics(ddp), _metrics(fsdp)):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
        assert y["wire_bytes_tp"] == x["wire_bytes_tp"] > 0


def test_torch_fp16_hook_is_refused_where_ddp_does_not_run() -> None:
    """`--dp-codec torch-fp16` (PyTorch's own DDP hook, a reference) needs plain DDP: FSDP and TP stages refuse it
    at validation, naming the alternative."""
    for over in ({"dp_shard": True}, {"tp": 2}):
        with pytest.raises(ValueError, match="PyTorch's own DDP hook.*fp16"):
            TrainConfig(dp=2, dp_codec="torch-fp16", **over).validate()
    TrainConfig(dp=2, dp_codec="torch-fp16").validate()
