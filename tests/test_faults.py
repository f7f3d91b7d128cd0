"""Faults a user meets, injected: a bad corpus or model (the root cause is the last line), a truncated
checkpoint (resume falls back to the one before), a copied run directory (resume continues the copy and
writes nothing outside it), --steps below the checkpoint (refused, nothing overwritten), a killed
launcher (its ranks stop at once; resume continues exactly), and a stopped rank (named while the others
wait, and in the error when their collective times out)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dist_utils import rank_pids, tiny_model_env
from lab_utils import lab_reason, needs_lab  # noqa: F401  (lab_reason: needs_lab's condition)
from qwire.cli import main
from qwire.train import TrainConfig, launch


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_model_env(tmp_path_factory.mktemp("faults"), layers=2)


def _cfg(env: dict[str, str], name: str, **kw) -> TrainConfig:
    base = TrainConfig(stages=2, steps=8, batch_size=8, microbatches=4, seq_len=32, model=env["model"],
                       vocab_size=512, max_tokens=40_000, eval_every=0, eval_batches=2, log_every=1,
                       checkpoint_every=2, fwd_codec="fp32", bwd_codec="fp32", timeout=60,
                       out=str(Path(env["base"]) / name))
    return dataclasses.replace(base, **kw)


def _args(cfg: TrainConfig) -> list[str]:
    out = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, bool):
            out += ["--" + f.name.replace("_", "-")] if v else []
        else:
            out += ["--" + f.name.replace("_", "-"), str(v)]
    return out


def _metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def straight(env: dict[str, str]) -> TrainConfig:
    """An uninterrupted 8-step run, the reference for every resume below."""
    cfg = _cfg(env, "straight")
    launch(cfg)
    return cfg


# ------------------------------------------------------------------------------------- root cause last


def test_missing_corpus_and_model_fail_before_any_rank_starts(env, capfd: pytest.CaptureFixture[str]) -> None:
    for argv, needle in ((["--corpus", "/nonexistent/corpus"], "/nonexistent/corpus"),
                         (["--model", "nosuchdir"], "nosuchdir")):
        out = str(Path(env["base"]) / "never")
        assert main(["train", *argv, "--out", out]) == 1
        last = _last_line(capfd.readouterr().err)
        assert needle in last and "qwire train: error" in last, last
        assert not Path(out).exists()


def test_a_ranks_data_error_is_the_last_line_not_a_peers_connection_error(env) -> None:
    bad = Path(env["base"]) / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(50))
                   + json.dumps({"body": "no text field here"}) + "\n")
    cfg = _cfg(env, "bad-jsonl", corpus=f"jsonl:{bad}", stages=2)
    res = subprocess.run([sys.executable, "-m", "qwire", "train", *_args(cfg)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 1
    last = _last_line(res.stderr)
    assert "line 51 has no field 'text'" in last and last.startswith("rank "), res.stderr[-3000:]
    rank = int(last.split()[1])
    assert (Path(cfg.out) / "errors" / f"rank{rank}.json").is_file()


@pytest.mark.slow
def test_under_torchrun_the_summarys_root_cause_is_the_ranks_error(env) -> None:
    """torchrun closes a failed job with a summary whose "Root Cause" is the earliest error file its workers
    wrote ("To enable traceback see: ..." where there is none); every rank writes qwire's one-line account of
    its failure there, so the data error of one rank is what it shows, not the peer's broken connection, and no
    rank prints a Python traceback of an error it already reported."""
    from dist_utils import free_port

    bad = Path(env["base"]) / "bad-torchrun.jsonl"
    bad.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(50))
                   + json.dumps({"body": "no text field here"}) + "\n")
    cfg = _cfg(env, "bad-jsonl-torchrun", corpus=f"jsonl:{bad}", stages=2)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    res = subprocess.run([*torchrun, "-m", "qwire", "train", *_args(cfg)], capture_output=True, text=True,
                         timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    root = out[out.index("Root Cause (first observed failure)"):]
    assert "failed: ValueError: " in root and "line 51 has no field 'text'" in root, root
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]
    # a run refused before any rank starts: its message, too
    Path(cfg.out, "metrics.jsonl").write_text("")
    again = subprocess.run([*torchrun[:-1], str(free_port()), "-m", "qwire", "train", *_args(cfg)],
                           capture_output=True, text=True, timeout=300)
    root = (again.stdout + again.stderr).split("Root Cause (first observed failure)")[-1]
    assert "qwire train: error: " in root and "already holds the files of a run" in root, root


# ------------------------------------------------------------------------------------- resume


def test_truncated_checkpoint_falls_back_to_the_one_before(env, straight: TrainConfig,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    run = Path(env["base"]) / "truncated"
    shutil.copytree(straight.out, run)
    cfg = dataclasses.replace(straight, out=str(run))
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    latest = run / "checkpoints" / "step_0000008" / "stage1.pt"
    with open(latest, "r+b") as f:
        f.truncate(1000)
    capfd.readouterr()
    summary = launch(cfg, resume=True)
    out = capfd.readouterr().out
    assert "cannot be read on rank 1" in out and "resumed from step 6" in out, out
    assert "holds 1000 bytes but its manifest says" in out and "stage1.pt" in out, out
    assert (run / "checkpoints" / "broken-step_0000008").is_dir()
    got, want = _metrics(run), _metrics(straight.out)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    # the summary covers the whole run, not only the two steps redone
    assert summary["wire_bytes_fwd"] == sum(r["wire_bytes_fwd"] for r in got) > 0


def test_a_flipped_byte_in_a_checkpoint_is_caught_by_its_manifest(env, straight: TrainConfig,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    """A file that still loads but changed after it was written (here one byte in the middle) fails its
    SHA-256 and the run resumes from the checkpoint before, with the same losses as without the fault."""
    run = Path(env["base"]) / "flipped"
    shutil.copytree(straight.out, run)
    cfg = dataclasses.replace(straight, out=str(run))
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    latest = run / "checkpoints" / "step_0000008" / "stage0.pt"
    assert json.loads((latest.parent / "stage0.pt.manifest.json").read_text())["bytes"] == latest.stat().st_size
    with open(latest, "r+b") as f:
        f.seek(latest.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    capfd.readouterr()
    launch(cfg, resume=True)
    out = capfd.readouterr().out
    assert "does not match the SHA-256 in its manifest" in out and "resumed from step 6" in out, out
    assert [r["loss"] for r in _metrics(run)] == [r["loss"] for r in _metrics(straight.out)]


def test_resume_of_a_copied_run_continues_the_copy_only(env, straight: TrainConfig,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    original = Path(straight.out)
    before = _tree_digest(original)
    copy = Path(env["base"]) / "copy"
    shutil.copytree(original, copy)
    # how the run runs (--timeout, the intervals, --link) comes from the command line; what it trains does not
    assert main(["train", "--resume", "--out", str(copy), "--steps", "10", "--timeout", "90", "--log-every", "2",
                 "--lr", "0.5"]) == 0
    captured = capfd.readouterr()
    assert f"resumed from step 8 in {copy}" in captured.out
    assert "the learning rate's decay now spans" not in captured.out  # still in its warm-up: the same rate
    assert ("--resume: continuing with --timeout 90.0 (the run had 60.0), --log-every 2 (the run had 1)"
            in captured.err), captured.err
    assert "--resume uses the run's saved config; ignoring --lr" in captured.err
    assert _tree_digest(original) == before  # nothing written into the original run
    saved = json.loads((copy / "config.json").read_text())
    assert saved["out"] == str(copy) and saved["timeout"] == 90 and saved["lr"] == straight.lr
    got = _metrics(copy)
    assert [r["step"] for r in got] == list(range(1, 11))
    assert got[:8] == _metrics(original)
    summary = json.loads((copy / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["fp32_bytes"] == sum(r["fp32_bytes"] for r in got)
    assert captured.out.count("qwire train:") == 1  # the header is there after a resume too


def test_resume_continues_with_the_codecs_the_run_started_with(env, straight: TrainConfig,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    """codecs.json pins each codec option with every parameter: a resume by a version that builds an option
    otherwise (a default changed since; here, as if --fwd-codec fp32 had built fp16 when the run started)
    continues with the run's codec and says so; a pin it cannot build stops it before any rank starts."""
    pins = json.loads((Path(straight.out) / "codecs.json").read_text())
    assert pins["fwd_codec"] == "fp32" and pins["dp_codec"] == "blockwise:bits=8,block=256", pins
    run = Path(env["base"]) / "pinned"
    shutil.copytree(straight.out, run)
    (run / "codecs.json").write_text(json.dumps({**pins, "fwd_codec": "fp16"}))
    assert main(["train", "--resume", "--out", str(run), "--steps", "10"]) == 0
    err = capfd.readouterr().err
    assert ("--resume: --fwd-codec fp32 builds fp32 (the run: fp16) in this version of qwire; continuing with the "
            "run's codec (codecs.json): fp16") in err, err
    got = _metrics(run)
    assert [r["codec_fwd"] for r in got] == ["fp32"] * 8 + ["fp16"] * 2
    assert got[8]["wire_bytes_fwd"] * 2 == got[7]["wire_bytes_fwd"]  # the pin is what crossed the link
    assert json.loads((run / "config.json").read_text())["fwd_codec"] == "fp32"  # the options as given stay
    assert json.loads((run / "codecs.json").read_text())["fwd_codec"] == "fp16"

    (run / "codecs.json").write_text(json.dumps({"fwd_codec": "fp16:nosuch=1"}))
    before = _tree_digest(run)
    assert main(["train", "--resume", "--out", str(run), "--steps", "12"]) == 1
    last = _last_line(capfd.readouterr().err)
    assert "the run started with --fwd-codec fp16:nosuch=1 (codecs.json of its run directory)" in last, last
    assert "nosuch" in last and "continue it with the version that started it" in last, last
    assert _tree_digest(run) == before

    (run / "codecs.json").unlink()  # a run started by a version that wrote none: pinned as it continues
    assert main(["train", "--resume", "--out", str(run), "--steps", "12"]) == 0
    assert "--resume: --fwd-codec" not in capfd.readouterr().err
    assert json.loads((run / "codecs.json").read_text()) == pins
    assert [r["codec_fwd"] for r in _metrics(run)][-2:] == ["fp32", "fp32"]


def test_resume_on_other_data_is_refused(env, straight: TrainConfig, capfd: pytest.CaptureFixture[str]) -> None:
    """A relative --corpus resumed from another folder read other text and trained on with no word: the
    checkpoint records the data's fingerprint, and a resume on other data stops, naming the cause."""
    run = Path(env["base"]) / "otherdata"
    shutil.copytree(straight.out, run)
    cfg = dataclasses.replace(straight, out=str(run), max_tokens=30_000)  # (as another file would read)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    before = _tree_digest(run)
    assert main(["train", "--resume", "--out", str(run), "--steps", "10"]) == 1
    last = _last_line(capfd.readouterr().err)
    assert f"the data differ from those the run in {run} trained on up to step 8" in last, last
    assert "resume from the folder the run started in, or give the same files again" in last, last
    after = _tree_digest(run)
    assert {k: v for k, v in after.items() if k.startswith(("checkpoints", "metrics"))} == \
        {k: v for k, v in before.items() if k.startswith(("checkpoints", "metrics"))}


def test_each_steps_record_holds_the_rate_it_trained_at(straight: TrainConfig) -> None:
    """metrics.jsonl's lr was read after the scheduler's step: the next step's rate."""
    import torch

    from qwire.train import build_optimizer

    opt, sched = build_optimizer(straight, [torch.nn.Parameter(torch.zeros(1))])
    want = []
    for _ in range(straight.steps):
        want.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert [r["lr"] for r in _metrics(straight.out)] == pytest.approx(want, rel=1e-12)


def test_steps_below_the_checkpoint_are_refused(env, straight: TrainConfig,
                                                capfd: pytest.CaptureFixture[str]) -> None:
    run = Path(env["base"]) / "below"
    shutil.copytree(straight.out, run)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(dataclasses.replace(straight, out=str(run)))))
    before = _tree_digest(run)
    assert main(["train", "--resume", "--out", str(run), "--steps", "5"]) == 1
    last = _last_line(capfd.readouterr().err)
    assert "already at step 8" in last and "--steps > 8" in last, last
    assert _tree_digest(run) == before  # summary.json and metrics.jsonl untouched
    assert main(["train", "--resume", "--out", str(run), "--steps", "8"]) == 0  # nothing to do: not an error
    assert _last_line(capfd.readouterr().err) == (f"qwire train: nothing to do: the run in {run} is at step 8 and "
                                                  "--steps is 8; give --steps > 8 to train further")
    assert main(["train", "--resume", "--out", str(run)]) == 0  # the saved --steps: the same
    assert "nothing to do" in capfd.readouterr().err
    assert _tree_digest(run) == before
    assert json.loads((run / "summary.json").read_text()) == json.loads((Path(straight.out) / "summary.json")
                                                                         .read_text())


def test_resume_without_a_checkpoint_or_with_a_damaged_config_fails_before_any_rank_starts(
        env, straight: TrainConfig, capfd: pytest.CaptureFixture[str]) -> None:
    run = Path(env["base"]) / "no-checkpoint"
    run.mkdir()
    saved = dataclasses.asdict(dataclasses.replace(straight, out=str(run), checkpoint_every=0))
    (run / "config.json").write_text(json.dumps(saved))
    assert main(["train", "--resume", "--out", str(run), "--steps", "20"]) == 1
    last = _last_line(capfd.readouterr().err)
    assert last.startswith(f"qwire train: error: --resume: {run} has no checkpoint") and "without --resume" in last
    assert not (run / "errors").exists()  # refused before any rank started
    for damage, needle in (({**saved, "old_option": 1}, "unknown option 'old_option'"),
                           ({**saved, "stages": "2"}, "stages must be int, got '2'")):
        (run / "config.json").write_text(json.dumps(damage))
        assert main(["train", "--resume", "--out", str(run)]) == 1
        last = _last_line(capfd.readouterr().err)
        assert last.startswith("qwire train: error: --resume: ") and needle in last and str(run) in last, last
    (run / "config.json").write_text(json.dumps(saved)[:40])
    assert main(["train", "--resume", "--out", str(run)]) == 1
    last = _last_line(capfd.readouterr().err)
    assert f"{run / 'config.json'} is not valid JSON" in last, last


def test_a_new_run_never_writes_into_a_run_that_trained_without_a_checkpoint(
        env, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A run interrupted before its first checkpoint leaves its config and metrics; a second run into the same
    --out appended its steps to those metrics and replaced the config. It is refused, and nothing is touched."""
    run = tmp_path / "interrupted"
    run.mkdir()
    (run / "config.json").write_text('{"steps": 200}')
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 8.3}\n')
    before = {f.name: f.read_bytes() for f in run.iterdir()}
    assert main(["train", "--model", "llama-tiny", "--steps", "2", "--out", str(run)]) == 1
    last = _last_line(capfd.readouterr().err)
    assert last == (f"qwire train: error: {run} already holds the files of a run that has no checkpoint to resume "
                    f"(metrics.jsonl); give another --out (or delete {run} to start over there)"), last
    assert {f.name: f.read_bytes() for f in run.iterdir()} == before


def test_a_checkpoint_that_does_not_fit_on_the_disk_says_so_and_leaves_the_last_complete_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk made torch.save fail with its zip writer's "unexpected pos ...": the rank's error said nothing
    a user could act on, and the half-written files stayed, taking the space a resume needs. Now the error names
    the file, says the file system is full, and names the checkpoint to resume from; the step's incomplete
    files are gone and the pointer still names the last complete checkpoint."""
    from types import SimpleNamespace

    import torch

    from qwire import checkpoint

    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000005").mkdir(parents=True)
    (run / "checkpoints" / "step_0000005" / "stage0.pt").write_bytes(b"x" * 1_500_000)
    checkpoint.atomic_write(run / "checkpoints" / "latest.json", json.dumps({"step": 5, "dir": "step_0000005"}))

    def full(obj, path) -> None:
        Path(path).write_bytes(b"x" * 1000)  # part of it went to disk
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 10350144 vs 10350036")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: SimpleNamespace(free=0))
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(checkpoint.CheckpointWriteError) as got:
        checkpoint.save(run, "stage0.pt", 10, model, opt, sched, None, 0, 0)
    assert str(got.value) == (
        f"checkpoint of step 10: writing {run}/checkpoints/step_0000010/stage0.pt failed (the file system is full; "
        f"0.0 MB free there); the step's incomplete checkpoint is removed; a checkpoint of this run takes 1.5 MB, "
        f"and the last 2 stay while the next is written; the last complete checkpoint is step 5; make room, then "
        f"continue with: qwire train --resume --out {run}")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest.json", "step_0000005"]
    assert checkpoint.latest_step(run) == 5


def test_a_full_disk_under_the_metrics_says_so_cuts_no_record_in_half_and_the_error_record_finds_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk under metrics.jsonl ended the run with a traceback of a plain OSError, left half a record
    that the resume's json.loads then failed on, and rank 0's error record (on the same disk) went missing, so
    the launcher named rank 1's broken connection as the root cause. Now the error names the file and the
    checkpoint to continue from; the file is cut back to its last whole record; the record that did not fit
    in the run directory is found in the spare directory."""
    import errno
    from types import SimpleNamespace

    from qwire import checkpoint, metrics
    from qwire.procs import clear_errors, describe_error, first_error, record_error, spare_errors_dir

    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000040").mkdir(parents=True)
    checkpoint.atomic_write(run / "checkpoints" / "latest.json", json.dumps({"step": 40, "dir": "step_0000040"}))
    log = metrics.Logger(run, active=True)
    log.metric({"step": 41, "loss": 6.5})
    real_write = metrics.os.write

    def full(fd: int, data: bytes) -> int:  # the kernel takes part of it, then the disk is full
        if len(data) > 20:
            return real_write(fd, data[:20])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics.os, "write", full)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: SimpleNamespace(free=0))
    with pytest.raises(checkpoint.RunWriteError) as got:
        log.metric({"step": 42, "loss": 6.4})
    assert str(got.value) == (
        f"writing {run}/metrics.jsonl failed (No space left on device; 0.0 MB free there); the last complete "
        f"checkpoint is step 40; make room, then continue with: qwire train --resume --out {run}")
    assert (run / "metrics.jsonl").read_text() == json.dumps({"step": 41, "loss": 6.5}) + "\n"
    monkeypatch.undo()

    (run / "metrics.jsonl").write_text('{"step": 41}\n{"step": 42}\n{"st')  # a process killed while writing
    log.truncate(41)
    assert (run / "metrics.jsonl").read_text() == '{"step": 41}\n'

    errors = run / "errors"
    errors.write_text("a file where the directory goes: the run directory cannot take a record")
    clear_errors(run)
    try:
        record_error(run, 0, got.value)
        record_error(run, 1, RuntimeError("Connection closed by peer"))
        rec = first_error(run)
        assert rec is not None and rec["rank"] == 0 and rec["type"] == "RunWriteError"
        assert "cause" not in rec  # its message says what the OSError means: the root cause is read last
        assert rec["path"] == str(spare_errors_dir(run) / "rank0.json")
        assert describe_error(rec, run).splitlines()[0] == f"(traceback in {spare_errors_dir(run)}/rank0.json)"
    finally:
        clear_errors(run)
    assert first_error(run) is None


def test_a_run_directory_in_use_is_refused_at_once_and_free_again_when_its_holder_dies(
        env, capfd: pytest.CaptureFixture[str]) -> None:
    """Two runs started into one --out at the same moment both trained there (neither had written anything the
    other could see), their steps interleaved in one metrics.jsonl and their checkpoints overwriting each other.
    The run that holds the directory now keeps the others out: they fail at once, naming it, and write nothing;
    once its process is gone (here SIGKILL, which no code of it sees), the directory is free."""
    cfg = _cfg(env, "held", steps=2)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from qwire.train_cli import run_dir_lock\n"
         "with run_dir_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(120)", cfg.out],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert main(["train", *_args(cfg)]) == 1
        last = _last_line(capfd.readouterr().err)
        assert last == (f"qwire train: error: {cfg.out} is in use by another qwire train (pid {holder.pid}); wait "
                        "for it to end, or give another --out"), last
        assert list(Path(cfg.out).iterdir()) == []
        # a --resume of it, before its first checkpoint, was told it "stopped before its first one"
        (Path(cfg.out) / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        assert main(["train", "--resume", "--out", cfg.out]) == 1
        assert _last_line(capfd.readouterr().err) == last
        (Path(cfg.out) / "config.json").unlink()
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", *_args(cfg)]) == 0
    assert [r["step"] for r in _metrics(cfg.out)] == [1, 2]


def _auto(argv: list[str]):
    """config_from_args of ``qwire train ARGV --resume auto``: (config, whether it resumes)."""
    import argparse

    from qwire.train_cli import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args([*argv, "--resume", "auto"]))


def test_resume_auto_starts_continues_or_refuses_another_configuration(
        env, straight: TrainConfig, tmp_path: Path, monkeypatch, capfd: pytest.CaptureFixture[str]) -> None:
    """`--resume auto` is for a command that runs again after a failure (torchrun --max-restarts, a requeued
    job): it starts a run where there is none, continues one of the same configuration from its checkpoint,
    starts over one that stopped before its first checkpoint (keeping its files), and refuses anything else."""
    from qwire.train_cli import NothingToDo, refuse_used_run_dir

    args = _args(straight)
    run = tmp_path / "run"
    shutil.copytree(straight.out, run)
    same = [a if a != straight.out else str(run) for a in args]
    with pytest.raises(NothingToDo, match="is at step 8 and --steps is 8"):  # at its last step already
        _auto(same)
    cfg, resume = _auto([*same, "--steps", "20"])
    assert resume and cfg.steps == 20 and cfg.out == str(run)
    assert "--resume auto: continuing the run in" in capfd.readouterr().err
    # how the run runs may change (a requeued job on another network, a longer --timeout): it continues so
    cfg, resume = _auto([*same, "--steps", "20", "--timeout", "90", "--link", "50mbit,mode=sim"])
    assert resume and (cfg.timeout, cfg.link, cfg.fwd_codec, cfg.steps) == (90, "50mbit,mode=sim", "fp32", 20)
    assert ("--resume auto: continuing with --timeout 90.0 (the run had 60.0), --link '50mbit,mode=sim' (the run "
            "had '')") in capfd.readouterr().err
    with pytest.raises(ValueError) as e:  # another configuration: refused, naming the difference
        _auto([*same, "--steps", "20", "--fwd-codec", "int4", "--lr", "0.01"])
    assert "holds a run of another configuration (--fwd-codec 'fp32' there, 'int4' here; --lr" in str(e.value)
    assert "--resume without 'auto'" in str(e.value)

    fresh = tmp_path / "fresh"
    cfg, resume = _auto([*args[:-2], "--out", str(fresh)])  # nothing there yet: a new run
    assert not resume and cfg.out == str(fresh)

    early = tmp_path / "early"  # a run that stopped before its first checkpoint: started over, its files kept
    shutil.copytree(straight.out, early)
    shutil.rmtree(early / "checkpoints")
    metrics = (early / "metrics.jsonl").read_bytes()
    (early / "hangup.log").write_text("step 1/8\n")  # its output after a hang-up goes with it
    (early / "config.json").write_text(json.dumps(dataclasses.asdict(dataclasses.replace(straight, out=str(early)))))
    cfg, resume = _auto([a if a != straight.out else str(early) for a in args])
    assert not resume and not (early / "metrics.jsonl").exists()
    assert (early / "attempts" / "1" / "metrics.jsonl").read_bytes() == metrics
    assert (early / "attempts" / "1" / "hangup.log").read_text() == "step 1/8\n"
    assert "stopped before its first checkpoint; starting it again" in capfd.readouterr().err

    with pytest.raises(ValueError, match=r"--resume auto needs --out"):
        _auto(["--steps", "2"])
    # the default --out is made from the time: under torchrun two workers of one machine could each make their own
    import argparse

    from qwire.train_cli import add_arguments, config_from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--steps", "2"]))[0].out.startswith("runs/")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^under torchrun, give --out RUN_DIR \(each machine's run directory\)"):
        config_from_args(parser.parse_args(["--steps", "2"]))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    # torchrun restarts its workers with the same command: without `auto` a restart is refused, and says why
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ValueError, match=r"already holds a run; .*torchrun restarted this job \(restart 1\): "
                                         r"for its restarts to continue from the last checkpoint, start it with "
                                         r"--resume auto"):
        refuse_used_run_dir(run)


@pytest.mark.slow
@pytest.mark.parametrize("machines", [1, 2], ids=["static-one-agent", "c10d-two-agents"])
def test_torchrun_restarts_continue_from_the_last_checkpoint_with_resume_auto(env, machines: int) -> None:
    """torchrun --max-restarts restarts every worker with the same command after one dies: with --resume auto
    the restart continues from the last checkpoint, every step appears once, and the losses are those of an
    uninterrupted run. Also as on two machines through the c10d rendezvous, where the agent whose worker is
    well restarts it without counting a restart (so the machines' restart counts differ)."""
    from dist_utils import _children, free_port

    cfg = _cfg(env, f"restarted{machines}", steps=60, checkpoint_every=5, log_every=10)
    straight = dataclasses.replace(cfg, out=str(Path(env["base"]) / f"restarted{machines}-straight"))
    launch(straight)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1"]
    if machines == 1:
        torchrun += ["--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                     "--master-port", str(free_port())]
    else:
        torchrun += ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"restarted{machines}"]
    procs = [subprocess.Popen([*torchrun, "-m", "qwire", "train", *_args(cfg), "--resume", "auto"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(machines)]
    try:
        pointer = Path(cfg.out) / "checkpoints" / "latest.json"
        deadline = time.time() + 180
        while time.time() < deadline and not (pointer.exists() and json.loads(pointer.read_text())["step"] >= 10):
            for p in procs:
                assert p.poll() is None, p.communicate()[0][-3000:]
            time.sleep(0.05)
        workers = sorted(_children(procs[-1].pid))
        assert len(workers) == 2 // machines, workers
        os.kill(workers[-1], signal.SIGKILL)
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    out = "".join(outs)
    assert "--resume auto: continuing the run in" in out and "resumed from step" in out, out[-3000:]
    got, want = _metrics(cfg.out), _metrics(straight.out)
    assert [r["step"] for r in got] == list(range(1, 61))  # every step exactly once
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), a["step"]


@pytest.mark.parametrize("argv, needle", [
    (["--batch-size", "0"], "--batch-size (0) must be a positive multiple"),
    (["--microbatches", "0"], "--microbatches must be >= 1, got 0"),
    (["--log-every", "0"], "--log-every must be >= 1, got 0"),
    (["--eval-batches", "-1"], "--eval-batches must be >= 0 (0: no validation), got -1"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--seq-len", "1"], "--seq-len must be >= 2, got 1"),
    # a sequence past the model's positions ran its first forward for minutes, printing nothing
    (["--seq-len", "4096"], "--seq-len 4096 is longer than llama-tiny's context of 1024 positions "
                            "(max_position_embeddings in its config); give --seq-len 1024 or less"),
    (["--seq-len", "2048", "--model", "gpt2-tiny"], "gpt2-tiny's context of 1024 positions (n_positions in its"),
    (["--timeout", "0"], "--timeout must be > 0 seconds and at most 2592000 (30 days), got 0.0"),
    # an infinite wait ended in timedelta's OverflowError, after the run directory was written
    (["--timeout", "inf"], "--timeout must be > 0 seconds and at most 2592000 (30 days), got inf"),
    (["--stall-warn", "nan"], "--stall-warn must be >= 0 seconds (0 turns the stall warnings off) and at most"),
    (["--config", "/"], "--config: / cannot be read as a JSON or TOML file of options (Is a directory)"),
    (["--corpus", "stdlib:max_mb=inf"], "max_mb must be a finite number > 0 in corpus spec 'stdlib:max_mb=inf'"),
    (["--lr", "-1"], "--lr must be >= 0, got -1.0"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
    (["--grad-clip", "-1"], "--grad-clip must be >= 0 (0 disables it), got -1.0"),
    (["--warmup", "-5"], "--warmup must be >= 0, got -5"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0 (0: only at the end), got -1"),
    (["--max-tokens", "-1"], "--max-tokens must be >= 0 (0: the corpus default), got -1"),
    (["--stall-warn", "-1"], "--stall-warn must be >= 0 seconds"),
    (["--peer-timeout", "-1"], "--peer-timeout must be >= 0 seconds (0: off) and below --timeout (300), got -1"),
    (["--peer-timeout", "300"], "--peer-timeout must be >= 0 seconds (0: off) and below --timeout (300), got 300"),
    (["--peer-timeout", "30", "--stall-warn", "0"], "--peer-timeout acts on the heartbeats that --stall-warn 0 turns"),
    # it never fired: a step is looked at only once it is --stall-warn late
    (["--peer-timeout", "10", "--timeout", "30"], "--peer-timeout acts once a step is --stall-warn (60 s) late, and "
                                                  "--timeout (30 s) ends the wait before that; give --stall-warn below "
                                                  "--timeout (e.g. 10) or --peer-timeout 0"),
    (["--vocab-size", "10"], "--vocab-size must be >= 257"),
    (["--stages", "2", "--split", "3,3"], "split [3, 3] sums to 6 but the model has 4 decoder layers"),
    (["--stages", "8", "--microbatches", "8"], "cannot split 4 decoder layers into 8 stages"),
    (["--stages", "1", "--tp", "3"], "--tp 3: llama-tiny: num_attention_heads=4 is not divisible by the tensor-"),
    (["--stages", "1", "--tp", "2", "--model", "gpt2-tiny"], "gpt2-tiny is a gpt2 model; use --tp 1 or one of those"),
    (["--bwd-codec", "aqsgd:inner=int4"], "--bwd-codec aqsgd:inner=int4: AQ-SGD keeps a cache per training sample"),
    (["--stages", "1", "--dp", "2", "--dp-codec", "aqsgd"], "--dp-codec aqsgd: AQ-SGD keeps a cache"),
    (["--stages", "1", "--tp", "2", "--tp-codec", "aqsgd"], "--tp-codec aqsgd: AQ-SGD keeps a cache"),
    # a step per column, and a flat shard is all columns: 24 bits per element, more than bf16's
    (["--stages", "1", "--dp", "2", "--dp-codec", "perchannel8"], "--dp-codec perchannel8: the all-reduces and "
                                                                  "reduce-scatters code flat 1-D shards, where this "
                                                                  "codec sends 24 bits per element"),
    (["--stages", "1", "--tp", "2", "--tp-codec", "perchannel6"], "22 bits per element, more than bf16's 16"),
    # ... also as a candidate of auto, which took it
    (["--stages", "1", "--dp", "2", "--dp-codec", "auto:candidates=fp32+perchannel8"],
     "--dp-codec: auto candidate 'perchannel8' sends 24 bits per element on the flat 1-D shards collectives code, "
     "more than bf16's 16; remove it from candidates= (use blockwise8"),
])
def test_options_a_run_cannot_use_fail_before_any_rank_starts(env, argv, needle,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    out = Path(env["base"]) / "never-started"
    assert main(["train", "--model", "llama-tiny", *argv, "--out", str(out)]) == 1
    last = _last_line(capfd.readouterr().err)
    assert last.startswith("qwire train: error: ") and needle in last, last
    assert not out.exists()


def test_a_model_family_qwire_does_not_split_fails_before_any_rank_starts(env, tmp_path: Path,
                                                                         capfd: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("gemma2", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=16).save_pretrained(tmp_path / "gemma2")
    out = tmp_path / "never-started"
    assert main(["train", "--model", str(tmp_path / "gemma2" / "config.json"), "--out", str(out)]) == 1
    last = _last_line(capfd.readouterr().err)
    assert last == (f"qwire train: error: --model {tmp_path / 'gemma2' / 'config.json'} is a gemma2 model, which "
                    "qwire does not train (it splits llama, qwen2, qwen3, mistral, gpt2 models into stages); give a "
                    "model of one of those"), last
    assert not out.exists()


def test_options_this_mesh_has_no_use_for_are_noted(env, capfd: pytest.CaptureFixture[str]) -> None:
    out = Path(env["base"]) / "noted"
    argv = ["train", "--stages", "1", "--fwd-codec", "int4", "--dp-codec", "int4", "--tp-codec", "fp8",
            "--codec-graphs", "--steps", "0", "--out", str(out)]
    assert main(argv) == 1  # (--steps 0 stops it before anything starts)
    notes = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("qwire train: note:")]
    assert notes == ["qwire train: note: --fwd-codec int4 has no effect: --stages 1 has no pipeline boundary",
                     "qwire train: note: --tp-codec fp8 has no effect: --tp is 1",
                     "qwire train: note: --dp-codec int4 has no effect: --dp is 1",
                     "qwire train: note: --codec-graphs has no effect: CUDA graphs need --device cuda"]
    assert main(["train", "--stages", "2", "--tp", "2", "--dp", "2", "--fwd-codec", "int4", "--dp-codec", "int4",
                 "--tp-codec", "fp8", "--steps", "0", "--out", str(out)]) == 1
    assert "note:" not in capfd.readouterr().err
    # DiLoCo's outer step without DiLoCo: its options (bad values included) went unchecked and unsaid
    assert main(["train", "--stages", "1", "--dp", "2", "--outer-lr", "nan", "--outer-momentum", "5", "--steps", "0",
                 "--out", str(out)]) == 1
    notes = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("qwire train: note:")]
    assert notes == ["qwire train: note: --outer-lr nan has no effect: --dp-sync-every is 1 (no DiLoCo outer step)",
                     "qwire train: note: --outer-momentum 5.0 has no effect: --dp-sync-every is 1 (no DiLoCo outer "
                     "step)"], notes


def test_the_error_names_what_a_wrapped_error_was_raised_from_and_a_resume_failure_gets_no_resume_hint(
        tmp_path: Path) -> None:
    from qwire.codecs.errors import NonFiniteError
    from qwire.procs import describe_error, first_error, record_error
    from qwire.train import failure_message

    try:
        try:
            raise NonFiniteError("codec 'perchannel' got a tensor with 4 NaN/Inf value(s) of 4")
        except NonFiniteError as inner:  # what torch's schedule does with a stage's error
            raise RuntimeError("Failed to run stage backward:\n  Stage output: Tensor(...)") from inner
    except RuntimeError as e:
        record_error(tmp_path, 1, e)
    text = describe_error(first_error(tmp_path), tmp_path)
    assert _last_line(text) == "caused by NonFiniteError: codec 'perchannel' got a tensor with 4 NaN/Inf value(s) of 4"
    try:
        try:
            raise OSError("tokenizer.json: truncated")
        except OSError as inner:  # a message that already quotes its cause gets no second line
            raise ValueError(f"cannot load the tokenizer of the model: {inner}") from inner
    except ValueError as e:
        record_error(tmp_path / "quoted", 0, e)
    assert "caused by" not in describe_error(first_error(tmp_path / "quoted"), tmp_path / "quoted")
    # a run with a checkpoint whose resume itself failed: the hint would send the user round in a circle
    cfg = _cfg({"base": str(tmp_path), "model": "llama-tiny"}, "resume-failed")
    (Path(cfg.out) / "checkpoints").mkdir(parents=True)
    (Path(cfg.out) / "checkpoints" / "latest.json").write_text(json.dumps({"step": 4}))
    from qwire.procs import TrainError
    record_error(cfg.out, 0, TrainError("--resume: no checkpoint of step 4 could be read; start the run again "
                                        "without --resume (into a new --out)"))
    msg = failure_message(cfg, RuntimeError("rank 0 failed"))
    assert "Continue from the last checkpoint" not in msg and _last_line(msg).endswith("(into a new --out)")
    (Path(cfg.out) / "errors" / "rank0.json").unlink()
    record_error(cfg.out, 0, ValueError("corpus.jsonl: line 3 has no field 'text'"))
    assert "Continue from the last checkpoint with: qwire train --resume" in failure_message(cfg, RuntimeError())


def test_the_interrupt_message_says_whether_there_is_a_checkpoint_to_resume(tmp_path: Path) -> None:
    from qwire.train_cli import interrupted_hint

    cfg = _cfg({"base": str(tmp_path), "model": "llama-tiny"}, "interrupted")
    assert "stopped before its first checkpoint (--checkpoint-every 2), so there is nothing to resume" in \
        interrupted_hint(cfg)
    (Path(cfg.out) / "checkpoints").mkdir(parents=True)
    (Path(cfg.out) / "checkpoints" / "latest.json").write_text(json.dumps({"step": 6}))
    assert interrupted_hint(cfg) == f"continue from step 6 with: qwire train --resume --out {cfg.out}"


def test_a_stop_signal_while_the_lab_is_taken_down_after_the_run_does_not_say_before_the_ranks(tmp_path) -> None:
    """A SIGTERM that the lab's launcher took itself came before the ranks started, or after they finished,
    as the lab was taken down: that one was reported as "before the ranks started" too."""
    import time

    from qwire.train_cli import _stopped_when

    cfg = _cfg({"base": str(tmp_path), "model": "llama-tiny"}, "stopped")
    Path(cfg.out).mkdir(parents=True)
    since = time.time()
    assert _stopped_when(cfg, since).startswith("before the ranks started; it stopped before its first checkpoint")
    (Path(cfg.out) / "summary.json").write_text("{}")
    os.utime(Path(cfg.out) / "summary.json", (since - 60, since - 60))  # an earlier run's
    assert _stopped_when(cfg, since).startswith("before the ranks started")
    os.utime(Path(cfg.out) / "summary.json", (since + 1, since + 1))  # this run's
    assert _stopped_when(cfg, since) == (f"after the run had finished, as its network lab was taken down (its "
                                         f"results are in {cfg.out})")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to find the worker processes")
def test_killed_launcher_stops_its_ranks_and_resume_continues_exactly(env) -> None:
    ref = _cfg(env, "launcher-straight", steps=24, checkpoint_every=0)
    launch(ref)
    cfg = dataclasses.replace(ref, out=str(Path(env["base"]) / "launcher-killed"), checkpoint_every=1)
    proc = subprocess.Popen([sys.executable, "-m", "qwire", "train", *_args(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pointer = Path(cfg.out) / "checkpoints" / "latest.json"
        deadline = time.time() + 180
        while time.time() < deadline and not (pointer.exists() and json.loads(pointer.read_text())["step"] >= 3):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        workers = rank_pids(proc.pid)
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        deadline = time.time() + 30  # well below the 60 s collective timeout: they die with the launcher
        while time.time() < deadline and any(_alive(k) for k in workers):
            time.sleep(0.1)
        assert not any(_alive(k) for k in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = json.loads(pointer.read_text())["step"]
    assert 3 <= done < 24
    launch(cfg, resume=True)
    got, want = _metrics(cfg.out), _metrics(ref.out)
    assert [r["step"] for r in got] == list(range(1, 25))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


def _started(cfg: TrainConfig, err: Path, logged: int) -> tuple[subprocess.Popen, list[int]]:
    """``qwire train`` of ``cfg`` (its stderr in ``err``) once ``logged`` steps are in its metrics (0: as soon as
    its ranks exist): the launcher's process and its two ranks' pids, in the order it started them (rank 0,
    then 1)."""
    with err.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "qwire", "train", *_args(cfg)], stdout=subprocess.DEVNULL,
                                stderr=f, text=True, start_new_session=True)  # its own group, as a job's
    try:
        metrics = Path(cfg.out) / "metrics.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and not (
                len(rank_pids(proc.pid)) == 2 if not logged else
                metrics.exists() and len(metrics.read_text().splitlines()) >= logged):
            assert proc.poll() is None, err.read_text()
            time.sleep(0.005 if not logged else 0.05)
        workers = rank_pids(proc.pid)
        assert len(workers) == 2
    except BaseException:
        proc.kill()
        raise
    return proc, workers


@contextlib.contextmanager
def _rank_1_stopped_mid_run(cfg: TrainConfig, err: Path, logged: int = 5):
    """``qwire train`` of ``cfg`` (its stderr in ``err``) with rank 1 stopped (SIGSTOP) once ``logged`` steps are
    logged (0: as soon as it exists); yields the launcher's process. Rank 1 is continued on the way out, so the
    launcher's SIGTERM takes effect."""
    proc, workers = _started(cfg, err, logged)
    stopped = workers[1]
    os.kill(stopped, signal.SIGSTOP)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):  # the launcher may have ended it already
            os.kill(stopped, signal.SIGCONT)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to find the worker processes")
def test_a_stopped_rank_is_named_while_the_others_wait_and_in_the_error(env) -> None:
    """SIGSTOP one rank mid-run: the other warns within seconds, naming it (not after --timeout, and not
    with gloo's "Timed out waiting ... for send operation" alone), and the error's last line names it."""
    # the deadline is 10x the median step (and >= 3 s): a --timeout well above it even on a loaded machine
    cfg = _cfg(env, "stopped-rank", steps=100_000, checkpoint_every=0, log_every=1000, timeout=30, stall_warn=3)
    err = Path(env["base"]) / "stopped-rank.err"
    with _rank_1_stopped_mid_run(cfg, err) as proc:
        deadline = time.time() + 90
        while time.time() < deadline and "[rank 0] error" not in err.read_text():
            time.sleep(0.1)
        text = err.read_text()
        warnings = [ln for ln in text.splitlines() if ln.startswith("[rank 0] warning:")]
        named = [ln for ln in warnings if "waiting on rank 1 (no heartbeat for" in ln]
        assert named, text[-3000:]
        assert "Collectives give up after --timeout 30 s" in named[0]
        assert "[rank 0] error" in text, text[-3000:]
        assert text.index(named[0]) < text.index("[rank 0] error")  # named while waiting, before the timeout
    proc.wait(timeout=90)
    assert proc.returncode == 1
    text = err.read_text()
    last = _last_line(text)
    assert last.startswith("It was waiting on rank 1 (no heartbeat for"), text[-3000:]
    assert "rank 0 failed: RuntimeError" in text
    rec = json.loads((Path(cfg.out) / "errors" / "rank0.json").read_text())
    assert rec["note"] == last


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to find the worker processes")
def test_with_peer_timeout_a_stopped_rank_ends_the_run_before_timeout_naming_it(env) -> None:
    """--peer-timeout: once the waiting rank is late and the stopped one has sent no heartbeat that long, the
    run ends with that as its root cause, instead of gloo's timeout after --timeout."""
    cfg = _cfg(env, "stopped-peer-timeout", steps=100_000, checkpoint_every=0, log_every=1000, timeout=120,
               stall_warn=3, peer_timeout=6)
    err = Path(env["base"]) / "stopped-peer-timeout.err"
    with _rank_1_stopped_mid_run(cfg, err) as proc:
        try:
            proc.wait(timeout=100)  # well before --timeout would end it (120 s, and the launcher's own wait)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1
    text = err.read_text()
    last = _last_line(text)
    assert last.startswith("rank 0 failed: PeerTimeout: step "), text[-3000:]
    assert " waiting on rank 1 (no heartbeat for " in last
    assert last.endswith("gave up after --peer-timeout 6 s instead of waiting for --timeout 120 s")
    assert json.loads((Path(cfg.out) / "errors" / "rank0.json").read_text())["type"] == "PeerTimeout"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to find the worker processes")
@pytest.mark.parametrize("who,link", [
    ("launcher", ""), ("every-process", ""),
    ("launcher", "50mbit,mode=sim"),  # the network lab's launcher, with its simulated link
    pytest.param("launcher", "1gbit,mode=lab", marks=needs_lab),  # ... with every rank in its own namespace
    pytest.param("every-process", "1gbit,mode=lab", marks=needs_lab),
])
def test_sigterm_ends_the_run_after_a_step_with_its_checkpoint_and_resume_continues_it(env, who: str,
                                                                                      link: str) -> None:
    """SIGTERM (a scheduler's preemption or time limit), to the launcher alone (which passes it on) or to every
    process of the job (its process group, as ``timeout`` or ``kill -TERM -PGID`` send it: the fork server and
    the resource tracker too, and the ranks, which the lab starts in sessions of their own): every rank finishes
    its step, saves that step's checkpoint, and the command exits 143 saying how to continue; the resumed run
    ends with the losses of an uninterrupted one. The same through the network lab's launcher (``--link``),
    which keeps the lab until the ranks have saved."""
    name = f"sigterm-{who}" + (f"-{link.split('=')[-1]}" if link else "")
    cfg = _cfg(env, name, steps=100_000, checkpoint_every=0, log_every=1000, link=link)
    err = Path(env["base"]) / f"{name}.err"
    proc, workers = _started(cfg, err, 3)
    try:
        if who == "every-process":
            os.killpg(proc.pid, signal.SIGTERM)
        for pid in [proc.pid, *(workers if who == "every-process" else [])]:
            os.kill(pid, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    step = json.loads((Path(cfg.out) / "checkpoints" / "latest.json").read_text())["step"]
    assert _last_line(text) == (f"qwire train: stopped by SIGTERM after step {step}, whose checkpoint is saved; "
                                f"continue with: qwire train --resume --out {cfg.out} (or run the same command "
                                "with --resume auto)")
    assert [r["step"] for r in _metrics(cfg.out)] == list(range(1, step + 1))
    assert not (Path(cfg.out) / "summary.json").exists()  # the run is not over
    assert main(["train", "--resume", "--out", cfg.out, "--steps", str(step + 2)]) == 0
    straight = dataclasses.replace(cfg, steps=step + 2, link="", out=str(Path(env["base"]) / f"{name}-straight"))
    launch(straight)
    assert [r["loss"] for r in _metrics(cfg.out)] == [r["loss"] for r in _metrics(straight.out)]


def test_sigterm_in_the_ranks_first_moments_stops_the_run_after_step_1(env) -> None:
    """SIGTERM to every process of the job as soon as the ranks exist (before a rank set up its handlers, it
    killed the rank, and the run ended as a crash with exit 1): the run stops after its first step with that
    step's checkpoint, and exits 143."""
    cfg = _cfg(env, "sigterm-at-start", steps=100_000, checkpoint_every=0, log_every=1000)
    err = Path(env["base"]) / "sigterm-at-start.err"
    proc, _ = _started(cfg, err, 0)
    _stops_after_step_1(proc, err, lambda: os.killpg(proc.pid, signal.SIGTERM))


def _stops_after_step_1(proc: subprocess.Popen, err: Path, stop: Callable[[], None]) -> None:
    """``stop()`` (a SIGTERM) ends the run of ``proc`` (its stderr in ``err``) after step 1, with its checkpoint."""
    try:
        stop()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert _last_line(text).startswith("qwire train: stopped by SIGTERM after step 1, whose checkpoint is saved")


@needs_lab
def test_sigterm_to_the_lab_launcher_while_its_ranks_start_stops_the_run_after_step_1(env) -> None:
    """A stop that reached the lab's launcher before its ranks existed was passed on to none of them: they
    trained on, were killed 25 s later as if stuck, and no checkpoint was saved."""
    cfg = _cfg(env, "sigterm-lab-start", steps=100_000, checkpoint_every=0, log_every=1000, link="1gbit,mode=lab")
    err = Path(env["base"]) / "sigterm-lab-start.err"
    with err.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "qwire", "train", *_args(cfg)], stdout=subprocess.DEVNULL,
                                stderr=f, text=True, start_new_session=True)

    def stop() -> None:
        deadline = time.time() + 120
        while "ranks in network namespaces" not in err.read_text() and time.time() < deadline:
            assert proc.poll() is None, err.read_text()
            time.sleep(0.005)
        time.sleep(0.2)  # (its handlers are in place a moment after that line; the ranks take seconds to start)
        os.kill(proc.pid, signal.SIGTERM)  # the launcher alone, as it starts the ranks

    _stops_after_step_1(proc, err, stop)


def test_a_rank_that_never_joins_the_process_group_is_named(env) -> None:
    """A rank stopped before it joined the process group: the others' error named only torch's store keys
    (``wait timeout after 8000ms, keys: /0//cpu//0/1``); it now names the rank that never came, last."""
    cfg = _cfg(env, "never-joined", steps=50, timeout=8)
    path = Path(env["base"]) / "never-joined.err"
    with _rank_1_stopped_mid_run(cfg, path, logged=0) as proc:
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    err = path.read_text()
    assert proc.returncode == 1, err
    last = _last_line(err)
    assert "did not all join within --timeout 8 s (DistStoreError: " in last, err
    assert last.endswith("): rank 1 never came (a process that was stopped, froze, or is still starting on a loaded "
                         "machine; its log may say more)"), err


def test_a_process_started_by_hand_whose_peers_never_come_says_what_to_start(env) -> None:
    """RANK and WORLD_SIZE set by hand (torch's env:// rendezvous) and the other process never started: a
    traceback of torch's DistStoreError before; now one line saying what to start."""
    from dist_utils import free_port

    cfg = _cfg(env, "by-hand", stages=2, timeout=5)
    port = free_port()
    res = subprocess.run([sys.executable, "-m", "qwire", "train", *_args(cfg)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                           "MASTER_PORT": str(port)})
    assert res.returncode == 1
    last = _last_line(res.stderr)
    assert last.startswith("qwire train: error: the job's processes did not all join within --timeout 5 s (Dist"), last
    assert last.endswith(f"start all WORLD_SIZE=2 processes with the same MASTER_ADDR and MASTER_PORT "
                         f"(127.0.0.1:{port}), or launch with torchrun"), last
    assert "Traceback" not in res.stderr, res.stderr[-3000:]


def test_torchruns_workers_end_with_their_agent(env) -> None:
    """An agent killed by SIGKILL (its machine's job step cancelled) left its workers training to the end, in
    sessions of their own, holding the run directory's lock; they now end with it, as local ranks end with the
    launcher."""
    from dist_utils import _children, free_port

    cfg = _cfg(env, "torchrun-agent-killed", steps=100_000, checkpoint_every=0, log_every=1000)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    agent = subprocess.Popen([*torchrun, "-m", "qwire", "train", *_args(cfg)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    workers: list[int] = []
    try:
        metrics = Path(cfg.out) / "metrics.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            assert agent.poll() is None
            time.sleep(0.05)
        workers = _children(agent.pid)
        assert len(workers) == 2, workers
        agent.kill()
        agent.wait(timeout=30)
        deadline = time.time() + 30
        while time.time() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers)
    finally:
        if agent.poll() is None:
            agent.kill()
        for w in workers:  # orphans, where they outlived it
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)


@needs_lab
def test_in_the_lab_a_killed_rank_0_takes_no_store_with_it(env) -> None:
    """The network lab's launcher holds the job's store, in rank 0's namespace at its address, as the local launcher
    and torchrun's agent hold theirs: when rank 0 dies, rank 1 still reads the heartbeats and names it. (When rank
    0 held the store, rank 1 said only that the store did not answer, after torch's C++ stack of its socket.)"""
    cfg = _cfg(env, "lab-rank0-killed", steps=100_000, checkpoint_every=0, log_every=1000, link="1gbit,mode=lab")
    err = Path(env["base"]) / "lab-rank0-killed.err"
    proc, workers = _started(cfg, err, 3)
    try:
        os.kill(workers[0], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert proc.returncode != 0 and "rank 0 failed (killed by SIGKILL)" in text, text[-3000:]
    rank1 = (Path(cfg.out) / "netlab" / "rank1.log").read_text()
    assert "[rank 1] It was waiting on rank 0 (" in rank1, rank1[-3000:]
    assert "does not answer" not in rank1 and "TCPStore.cpp" not in rank1, rank1[-3000:]


def test_under_nohup_a_hang_up_is_no_stop_signal() -> None:
    """A process that ignores SIGHUP (started under nohup, as its ranks are then) goes on ignoring it."""
    from qwire.procs import stop_signals

    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert stop_signals() == (signal.SIGTERM,)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert stop_signals() == (signal.SIGTERM, signal.SIGHUP)
    finally:
        signal.signal(signal.SIGHUP, old)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to find the worker processes")
def test_a_hang_up_ends_the_run_after_a_step_with_its_checkpoint(env) -> None:
    """The terminal of a run went away (an ssh session that dropped): SIGHUP to every process of the job ended it
    mid-step with nothing saved, and the output left for the terminal would have failed any process that
    survived it. Now a hang-up is a stop signal as SIGTERM is: every rank finishes its step and saves it, and
    what every process would have printed on the terminal goes to RUN/hangup.log, which ends with how to
    continue."""
    import pty
    import threading

    cfg = _cfg(env, "sighup", steps=100_000, checkpoint_every=0, log_every=1)
    master, tty = pty.openpty()
    seen = bytearray()

    def drain() -> None:  # what the terminal shows, until it goes away
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 4096):
                seen.extend(chunk)

    # SIGHUP as a login shell leaves it (set: the tests may run under nohup, which ignores it)
    proc = subprocess.Popen([sys.executable, "-m", "qwire", "train", *_args(cfg)], stdout=tty, stderr=tty,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    os.close(tty)
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    metrics = Path(cfg.out) / "metrics.jsonl"

    def logged() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    try:
        deadline = time.time() + 180
        while time.time() < deadline and logged() < 3:
            assert proc.poll() is None, seen.decode(errors="replace")
            time.sleep(0.05)
        assert len(rank_pids(proc.pid)) == 2
        os.killpg(proc.pid, signal.SIGHUP)  # what the kernel sends the terminal's processes when it hangs up
        time.sleep(2)
        os.close(master)  # the terminal is gone: a write to it now fails
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(OSError):
            os.close(master)
    step = json.loads((Path(cfg.out) / "checkpoints" / "latest.json").read_text())["step"]
    assert [r["step"] for r in _metrics(cfg.out)] == list(range(1, step + 1))
    text = (Path(cfg.out) / "hangup.log").read_text()
    assert proc.returncode == 128 + signal.SIGHUP, (seen.decode(errors="replace")[-2000:], text[-2000:])
    assert _last_line(text) == (f"qwire train: stopped by SIGHUP after step {step}, whose checkpoint is saved; "
                                f"continue with: qwire train --resume --out {cfg.out} (or run the same command "
                                "with --resume auto)")
    assert "stopped by SIGHUP" not in seen.decode(errors="replace")
    assert main(["train", "--resume", "--out", cfg.out, "--steps", str(step + 1)]) == 0


def test_progress_whose_reader_is_gone_goes_on_in_the_run_directory(tmp_path: Path) -> None:
    """`qwire train ... | tee log` over ssh: a dropped session ends tee, and the next progress line rank 0 printed
    failed with BrokenPipeError, ending the run mid-step. Now stdout goes on in RUN/hangup.log."""
    code = ("import sys, time; from pathlib import Path; from qwire.metrics import Logger\n"
            "log = Logger(Path(sys.argv[1]), True)\n"
            "time.sleep(0.5)\n"  # the reader is gone by now
            "for k in range(3): log.say(f'line {k}')\n"
            "print('the end', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert (tmp_path / "hangup.log").read_text() == "line 0\nline 1\nline 2\nthe end\n"


def test_a_rank_nccls_watchdog_aborted_is_explained(env) -> None:
    """On NCCL a collective past --timeout does not raise: torch's watchdog aborts the rank (SIGABRT), which
    leaves no error of its own; the run's error says what that means. Not on gloo, where the wait raises."""
    import dataclasses

    import torch.multiprocessing as mp

    from qwire.train import failure_message

    cfg = dataclasses.replace(_cfg(env, "nccl-abort"), backend="nccl", timeout=42.0)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    aborted = mp.ProcessExitedException("process 1 terminated with signal SIGABRT", 1, 123, -6, "SIGABRT")
    assert failure_message(cfg, aborted) == (
        "rank 1 died (killed by SIGABRT: on NCCL, torch's watchdog aborts a rank whose collective outlasts "
        "--timeout (42 s), so a peer most likely stopped or fell far behind); the other ranks were stopped.")
    gloo = dataclasses.replace(cfg, backend="gloo")
    assert failure_message(gloo, aborted) == "rank 1 died (killed by SIGABRT); the other ranks were stopped."


def test_a_run_the_out_of_memory_killer_ended_says_so_last(env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The out-of-memory killer's SIGKILL leaves no error behind: the run said "rank 0 died (killed by SIGKILL)",
    or, when it chose the fork server, "process 0 terminated with exit code 255". Where /proc/vmstat counted
    out-of-memory kills since the ranks started, the error now ends saying so; a rank's own error stays last."""
    import torch.multiprocessing as mp

    from qwire import procs
    from qwire.procs import record_error
    from qwire.train import failure_message

    cfg = _cfg(env, "oom-words")
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(procs, "oom_kills", lambda: 7)
    oom = ("the kernel's out-of-memory killer ended 2 processes on this machine while the run ran (oom_kill in "
           "/proc/vmstat): the run most likely ran out of memory; give it more, or make the ranks need less (a "
           "smaller --batch-size or --seq-len, more --stages, a smaller --model)")
    killed = mp.ProcessExitedException("process 0 terminated with signal SIGKILL", 0, 123, -9, "SIGKILL")
    text = failure_message(cfg, killed, oom_before=5)
    assert text.splitlines() == ["rank 0 died (killed by SIGKILL); the other ranks were stopped.", oom]
    assert failure_message(cfg, killed, oom_before=7) == ("rank 0 died (killed by SIGKILL); the other ranks were "
                                                          "stopped.")
    assert failure_message(cfg, killed, oom_before=None).splitlines()[-1].startswith("rank 0 died")
    server = mp.ProcessExitedException("process 3 terminated with exit code 255", 3, 123, 255)
    assert failure_message(cfg, server, oom_before=5).splitlines()[-2:] == [
        "rank 3 failed: process 3 terminated with exit code 255", oom]
    record_error(cfg.out, 1, RuntimeError("Connection closed by peer [127.0.0.1]:4018"))  # a symptom only
    assert failure_message(cfg, server, oom_before=5).splitlines()[-1] == oom
    own = dataclasses.replace(cfg, out=str(Path(env["base"]) / "oom-words-own"))
    record_error(own.out, 0, ValueError("a rank's own error"))  # the root cause, whatever else happened
    record_error(own.out, 1, RuntimeError("Connection closed by peer [127.0.0.1]:4018"))
    assert failure_message(own, server, oom_before=5).splitlines()[-1] == ("rank 0 failed: ValueError: a rank's "
                                                                          "own error")
