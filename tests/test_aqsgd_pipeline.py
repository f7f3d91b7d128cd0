"""AQ-SGD on the training pipeline: sample ids through the schedule, caches on both sides, checkpoints."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from dist_utils import tiny_model_env
from qwire.codecs import CodecError, get_codec
from qwire.parallel.pipeline import Boundary, CompressedStageModule
from qwire.train import TrainConfig, launch


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_model_env(tmp_path_factory.mktemp("aqsgd"), layers=2)


def _cfg(env: dict[str, str], name: str, **kw) -> TrainConfig:
    # A small training set (about 19 batches per epoch, one validation batch), so 40 steps visit every
    # training sample two or three times.
    base = TrainConfig(stages=2, steps=40, batch_size=4, microbatches=2, seq_len=32, model=env["model"],
                       vocab_size=512, max_tokens=2_700, eval_every=20, eval_batches=1, log_every=10,
                       checkpoint_every=0, fwd_codec="fp32", bwd_codec="fp32", timeout=120, lr=1e-3,
                       out=str(Path(env["base"]) / name))
    return dataclasses.replace(base, **kw)


def _metrics(run_dir: str) -> list[dict]:
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _latest_codecs(run_dir: str, rank: int) -> dict:
    latest = json.loads((Path(run_dir) / "checkpoints" / "latest.json").read_text())
    return torch.load(Path(run_dir) / "checkpoints" / latest["dir"] / f"codecs-rank{rank}.pt", weights_only=False)


def test_lossless_aqsgd_reproduces_fp32_and_both_sides_cache_the_same(env: dict[str, str]) -> None:
    ref = _cfg(env, "fp32")
    aq = _cfg(env, "aqsgd-lossless", fwd_codec="aqsgd:inner=fp32,cache_dtype=fp32")
    launch(ref)
    summary = launch(aq)
    a, b = _metrics(ref.out), _metrics(aq.out)
    assert max(r["epoch"] for r in b) >= 2  # samples came back at least twice
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        if "val_loss" in x:
            assert y["val_loss"] == pytest.approx(x["val_loss"], rel=1e-5)
    # sender (stage 0, "out") and receiver (stage 1, "in") hold bit-identical caches of every training sample
    send, recv = _latest_codecs(aq.out, 0)["out"], _latest_codecs(aq.out, 1)["in"]
    assert torch.equal(send["ids"], recv["ids"]) and torch.equal(send["rows"], recv["rows"])
    n = len(send["ids"])
    assert n == summary["aqsgd_cached_samples"] and n >= 19 * 4
    per_sample = 32 * 64 * 4  # seq_len x hidden x fp32
    assert summary["aqsgd_cache_bytes_per_sample"] == per_sample
    assert summary["aqsgd_cache_bytes"] == 2 * n * per_sample  # one boundary, two sides


def test_aqsgd_resume_continues_exactly_with_its_caches(env: dict[str, str]) -> None:
    spec = "aqsgd:inner=int4"
    straight = _cfg(env, "aq-straight", fwd_codec=spec, bwd_codec="perchannel8", checkpoint_every=25, steps=30)
    launch(straight)
    # The same run stopped after its step-25 checkpoint: a copy without the later checkpoint.
    cut = dataclasses.replace(straight, out=str(Path(env["base"]) / "aq-cut"))
    shutil.copytree(straight.out, cut.out)
    ck = Path(cut.out) / "checkpoints"
    shutil.rmtree(ck / "step_0000030")
    (ck / "latest.json").write_text(json.dumps({"step": 25, "dir": "step_0000025"}))
    launch(cut, resume=True)  # steps 26-30 revisit samples cached in epoch 0
    a, b = _metrics(straight.out), _metrics(cut.out)
    assert [r["step"] for r in b] == list(range(1, 31))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    # the 4-bit deltas really are 4-bit: about a quarter of fp16 plus ids and tile metadata
    assert a[-1]["wire_bytes_fwd"] < 0.2 * a[-1]["fp32_bytes"]


def test_warmup_epoch_sends_full_activations_then_deltas(env: dict[str, str]) -> None:
    cfg = _cfg(env, "aq-warmup", fwd_codec="aqsgd:inner=int4,warmup=fp16", bwd_codec="perchannel8", steps=22,
               eval_every=0)
    launch(cfg)
    m = _metrics(cfg.out)
    first = [r["wire_bytes_fwd"] for r in m if r["epoch"] == 0]
    later = [r["wire_bytes_fwd"] for r in m if r["epoch"] >= 1]
    assert first and later
    mb, act = 2, 2 * 32 * 64  # micro-batch rows; fp16 bytes per row
    assert first[0] == 2 * (mb * 8 + mb * act)  # 2 micro-batches of ids + fp16 activations
    assert max(later) < 0.4 * min(first)


def test_stateful_codec_without_sample_ids_is_a_clear_error() -> None:
    b = Boundary(torch.Size([2, 4, 64]), torch.float32, get_codec("aqsgd"), get_codec("perchannel8"))
    stage0 = CompressedStageModule(nn.Identity(), None, b)
    with pytest.raises(CodecError, match="sample ids"):
        stage0(torch.randn(2, 4, 64))
    out = stage0(torch.randn(2, 4, 64), sample_ids=torch.tensor([3, 5]))
    # the next stage reads the ids from the payload; a caller passing others is told so
    recv = CompressedStageModule(nn.Identity(), Boundary(torch.Size([2, 4, 64]), torch.float32, get_codec("aqsgd"),
                                                         get_codec("perchannel8")), None)
    with pytest.raises(CodecError, match="sample ids"):
        recv(out, sample_ids=torch.tensor([3, 6]))
    assert recv(out).shape == (2, 4, 64)


def test_mmap_and_int8_caches_match_sender_and_receiver(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    for spec in (f"aqsgd:store=mmap,dir={tmp_path}", "aqsgd:cache_dtype=int8"):
        send, recv = get_codec(spec), get_codec(spec)
        x = torch.randn(8, 16, 64, generator=g)
        for _ in range(3):
            for rows in (torch.arange(0, 4), torch.arange(4, 8)):
                p = send.encode(x[rows] + 0.01 * torch.randn(4, 16, 64, generator=g), sample_ids=rows)
                recv.decode(p, (4, 16, 64), torch.float32)
        assert sorted(send.cache) == sorted(recv.cache) == list(range(8))
        for k in range(8):
            assert torch.equal(send.cache[k], recv.cache[k])
        assert send.cache_nbytes() == 8 * send.per_sample_nbytes((4, 16, 64))
    assert get_codec("aqsgd:cache_dtype=int8").per_sample_nbytes((1, 16, 64)) < 16 * 64 * 2 * 0.6
