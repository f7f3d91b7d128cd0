"""3D parallel training: pipeline x tensor x data parallel on one DeviceMesh, a codec per dimension."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port, tiny_model_env
from qwire.train import TrainConfig, launch


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_model_env(tmp_path_factory.mktemp("3d"), layers=4)


def _cfg(env: dict[str, str], name: str, **kw) -> TrainConfig:
    base = TrainConfig(stages=2, tp=2, dp=2, steps=3, batch_size=8, microbatches=2, seq_len=32, model=env["model"],
                       vocab_size=512, max_tokens=40_000, eval_every=0, eval_batches=1, log_every=1,
                       checkpoint_every=0, fwd_codec="fp32", bwd_codec="fp32", tp_codec="fp32", dp_codec="fp32",
                       timeout=120, out=str(Path(env["base"]) / name))
    return dataclasses.replace(base, **kw)


def _metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _lossless(env: dict[str, str]) -> TrainConfig:
    """The 3-step 2x2x2 run with exact codecs (made once, shared by the tests)."""
    cfg = _cfg(env, "lossless-2x2x2")
    if not (Path(cfg.out) / "summary.json").exists():
        launch(cfg)
    return cfg


def test_2x2x2_lossless_matches_one_process_and_compressed_sends_less(env: dict[str, str]) -> None:
    mesh = _lossless(env)
    # one process, the same global batch: the two DP replicas' batches are consecutive batches of 8
    single = _cfg(env, "single", stages=1, tp=1, dp=1, batch_size=16, microbatches=4)
    launch(single)
    a, b = _metrics(mesh.out), _metrics(single.out)
    assert [r["step"] for r in a] == [1, 2, 3]
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    assert all(a[0][f"wire_bytes_{k}"] > 0 for k in ("fwd", "bwd", "tp", "dp"))
    assert "time_tp_s" in a[0] and "time_dp_s" in a[0]

    # the same mesh with every dimension compressed: each dimension sends far fewer bytes, and it trains
    comp = _cfg(env, "compressed-2x2x2", fwd_codec="tahquant", bwd_codec="perchannel6", tp_codec="fp8",
                dp_codec="blockwise8:block=256", steps=6, lr=1e-2)
    launch(comp)
    c = _metrics(comp.out)
    assert c[-1]["loss"] < c[0]["loss"]
    first = c[0]
    assert first["wire_bytes_fwd"] < 0.2 * a[0]["wire_bytes_fwd"]
    assert first["wire_bytes_tp"] < 0.35 * a[0]["wire_bytes_tp"]   # fp8 + scales vs fp32
    assert first["wire_bytes_dp"] < 0.35 * a[0]["wire_bytes_dp"]   # 8-bit blocks vs fp32


def test_3d_through_host_buffers_trains_exactly_the_same(env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """The gloo transport of ranks that share a GPU stages every payload of every dimension (pipeline sends,
    TP and DP collectives, the replicated weights at start-up) through host buffers. Forced on CPU tensors
    (QWIRE_HOST_STAGING=1), the 2x2x2 mesh computes exactly what it computes without it."""
    plain = _lossless(env)
    capfd.readouterr()
    monkeypatch.setenv("QWIRE_HOST_STAGING", "1")
    staged = _cfg(env, "staged-2x2x2")
    launch(staged)
    assert "on cpu with gloo (payloads staged through host memory)" in capfd.readouterr().out
    a, b = _metrics(plain.out), _metrics(staged.out)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert (x["loss"], x["grad_norm"]) == (y["loss"], y["grad_norm"])
        assert all(x[f"wire_bytes_{k}"] == y[f"wire_bytes_{k}"] > 0 for k in ("fwd", "bwd", "tp", "dp"))


def _train_argv(env: dict[str, str], out: Path, *extra: str) -> list[str]:
    return ["-m", "qwire", "train", "--pp", "2", "--tp", "2", "--dp", "2", "--steps", "2", "--batch-size", "4",
            "--microbatches", "2", "--seq-len", "32", "--model", env["model"], "--vocab-size", "512",
            "--max-tokens", "40000", "--eval-every", "0", "--eval-batches", "1", "--timeout", "60",
            "--out", str(out), *extra]


def test_two_torchrun_launches_form_one_3d_mesh(env: dict[str, str]) -> None:
    port = free_port()
    out = Path(env["base"]) / "torchrun-3d"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    procs = [subprocess.Popen(torchrun + ["--node-rank", str(i)] + _train_argv(env, out), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(o[-3000:] for o in outs)
    recs = _metrics(out)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(recs[0][f"wire_bytes_{k}"] > 0 for k in ("fwd", "bwd", "tp", "dp"))


def _ranks(env: dict[str, str], argvs: list[list[str]]) -> list[tuple[int, str]]:
    """Start one `qwire train` process per argv as ranks 0..n-1 of one job; (exit code, output) of each."""
    port = free_port()
    procs = []
    for r, argv in enumerate(argvs):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(len(argvs)), LOCAL_RANK=str(r),
                 LOCAL_WORLD_SIZE=str(len(argvs)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, *argv], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        return [(p.wait(timeout=200), p.stdout.read()) for p in procs]  # type: ignore[union-attr]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_ranks_with_different_codecs_fail_at_start_up(env: dict[str, str]) -> None:
    out = Path(env["base"]) / "mismatch"
    base = ["-m", "qwire", "train", "--pp", "2", "--steps", "1", "--batch-size", "4", "--microbatches", "2",
            "--seq-len", "32", "--model", env["model"], "--vocab-size", "512", "--max-tokens", "40000",
            "--timeout", "60", "--out", str(out)]
    res = _ranks(env, [base + ["--dp-codec", "fp32"], base + ["--dp-codec", "blockwise8"]])
    for code, text in res:
        assert code != 0
        assert "different settings" in text and "--dp-codec" in text, text[-2000:]


def test_mesh_larger_than_the_job_is_a_clear_error(env: dict[str, str]) -> None:
    out = Path(env["base"]) / "too-small"
    argv = _train_argv(env, out)
    res = _ranks(env, [argv, argv])
    for code, text in res:
        assert code != 0
        assert "needs 8 processes" in text and "WORLD_SIZE is 2" in text, text[-2000:]


def test_config_file_gives_a_codec_per_dimension(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qwire.cli import main
    from qwire.train import load_config_file

    root = Path(__file__).resolve().parents[1]
    cfg = load_config_file(root / "examples" / "3d_two_sites.toml")
    assert (cfg["stages"], cfg["tp"], cfg["dp"]) == (2, 2, 2)
    assert cfg["tp_codec"] == "fp8" and cfg["dp_codec"].startswith("blockwise8") and cfg["link_pp"] == "100mbit"
    TrainConfig(**cfg).validate()
    bad = tmp_path / "bad.toml"
    bad.write_text('tp_codek = "fp8"\n')
    assert main(["train", "--config", str(bad)]) != 0
    assert "unknown option 'tp_codek'" in capsys.readouterr().err
    bad.write_text('tp = "two"\n')
    assert main(["train", "--config", str(bad)]) != 0
    assert "tp must be int" in capsys.readouterr().err
