"""Checkpoints (:mod:`qwire.checkpoint`) on small modules: run directories not shared between machines, what a
save or resume cut short leaves behind, a pointer that cannot be read, a checkpoint of another model."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from qwire import checkpoint
from qwire.metrics import Logger
from qwire.procs import TrainError


def _stage(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _save(run: Path, step: int, m, opt, sched, name: str | None = "stage0.pt", rank: int = 0) -> None:
    checkpoint.save(run, name, step, m, opt, sched, None, rank, 0)


def _replicas_on_two_machines(rank: int, world: int, base: str) -> dict:
    """Two data-parallel replicas of one stage, each on its own machine with its own run directory: replica 0
    writes the stage file (replica 1's state equals it), and each machine's local rank 0 its pointer."""
    os.environ["LOCAL_RANK"] = "0"
    run = Path(base) / f"machine{rank}"
    m, opt, sched = _stage(0)
    for step in (2, 4):
        _save(run, step, m, opt, sched, "stage0.pt" if rank == 0 else None, rank)
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    said: list[str] = []
    m2, opt2, sched2 = _stage(rank + 10)  # a fresh process's stage, before the checkpoint is applied
    got = checkpoint.load(run, "stage0.pt", rank, with_codecs=False, say=said.append)
    checkpoint.apply(got, m2, opt2, sched2)
    same = all(torch.equal(m2.state_dict()[k], v) for k, v in saved.items())
    return {"step": got.step, "same": same, "said": said, "skipped": got.skipped,
            "dirs": sorted(p.name for p in (run / "checkpoints").iterdir())}


def test_replicas_whose_machines_do_not_share_the_run_directory_resume_from_the_stage_a_peer_read(tmp_path):
    """Machine 1 holds no stage file (replica 0 wrote it on machine 0): its rank gets the stage from the rank
    that read it, and no good checkpoint is set aside as broken (each machine's were renamed before)."""
    r0, r1 = run_distributed(_replicas_on_two_machines, 2, (str(tmp_path),))
    for r in (r0, r1):
        assert r["step"] == 4 and r["same"] and not r["skipped"], r
        assert r["dirs"] == ["latest.json", "step_0000002", "step_0000004"], r
    note = "step_0000004: no copy of the stage file on the machine of rank 1; got it from"
    assert any(note in s for s in r0["said"]), r0


def _one_rank(rank: int, world: int, fn, *args):
    os.environ["LOCAL_RANK"] = "0"
    return fn(*args)


def _rotation(base: str) -> list[str]:
    """A resume went back to step 6 after a save of step 9 was cut short (one file of it on disk): the saves
    after it keep the last two complete checkpoints up to them, and remove what the earlier attempt left."""
    run = Path(base)
    m, opt, sched = _stage(0)
    for step in (3, 6):
        _save(run, step, m, opt, sched)
    partial = run / "checkpoints" / "step_0000009"
    partial.mkdir()
    (partial / "stage0.pt").write_bytes(b"half")
    _save(run, 7, m, opt, sched)
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_a_save_keeps_two_complete_checkpoints_and_drops_what_an_earlier_attempt_left(tmp_path):
    (got,) = run_distributed(_one_rank, 1, (_rotation, str(tmp_path)))
    assert got == ["latest.json", "step_0000006", "step_0000007"]


def _pointer_write_fails(base: str) -> tuple[str, list[str], int | None]:
    run = Path(base)
    m, opt, sched = _stage(0)
    _save(run, 3, m, opt, sched)
    real = checkpoint.atomic_write

    def full(path: Path, text: str) -> None:
        if path.name == "latest.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, text)

    checkpoint.atomic_write = full
    try:
        _save(run, 6, m, opt, sched)
    except checkpoint.CheckpointWriteError as e:
        return str(e), sorted(p.name for p in (run / "checkpoints").iterdir()), checkpoint.latest_step(run)
    finally:
        checkpoint.atomic_write = real
    raise AssertionError("the save did not fail")


def test_a_pointer_that_cannot_be_written_is_a_checkpoint_write_error_and_its_step_goes(tmp_path):
    """The pointer is the last write of a save: where it fails (a full disk), the user reads which file, why and
    what to continue from, and the step's files, complete but named by nothing, are removed."""
    (got,) = run_distributed(_one_rank, 1, (_pointer_write_fails, str(tmp_path)))
    message, dirs, latest = got
    assert "checkpoint of step 6: writing" in message and "latest.json failed (No space left on device" in message
    assert "the last complete checkpoint is step 3" in message, message
    assert dirs == ["latest.json", "step_0000003"] and latest == 3


def _fallback(base: str) -> dict:
    """Step 6's stage file truncated, and a broken-step_0000006 left by an earlier fallback of the same step."""
    run = Path(base)
    m, opt, sched = _stage(0)
    for step in (3, 6):
        _save(run, step, m, opt, sched)
    (run / "checkpoints" / "broken-step_0000006").mkdir()
    with open(run / "checkpoints" / "step_0000006" / "stage0.pt", "r+b") as f:
        f.truncate(100)
    got = checkpoint.load(run, "stage0.pt", 0, with_codecs=False, say=lambda s: None)
    return {"step": got.step, "latest": checkpoint.latest_step(run),
            "dirs": sorted(p.name for p in (run / "checkpoints").iterdir())}


def test_a_fallback_moves_the_pointer_to_what_it_loaded_and_keeps_every_broken_directory(tmp_path):
    (got,) = run_distributed(_one_rank, 1, (_fallback, str(tmp_path)))
    assert got["step"] == 3 and got["latest"] == 3
    assert got["dirs"] == ["broken-step_0000006", "broken-step_0000006.2", "latest.json", "step_0000003"]


def _not_damaged(base: str) -> dict:
    """An error that says nothing about the files (here a MemoryError while loading): the checkpoint before is
    tried, but the directory is not set aside."""
    run = Path(base)
    m, opt, sched = _stage(0)
    for step in (3, 6):
        _save(run, step, m, opt, sched)
    real = checkpoint.load_verified

    def short_of_memory(path: Path):
        if "step_0000006" in str(path):
            raise MemoryError("no room for the state")
        return real(path)

    checkpoint.load_verified = short_of_memory
    try:
        got = checkpoint.load(run, "stage0.pt", 0, with_codecs=False, say=lambda s: None)
    finally:
        checkpoint.load_verified = real
    return {"step": got.step, "skipped": got.skipped, "dirs": sorted(p.name for p in (run / "checkpoints").iterdir())}


def test_an_error_that_is_not_the_files_falls_back_without_setting_the_checkpoint_aside(tmp_path):
    (got,) = run_distributed(_one_rank, 1, (_not_damaged, str(tmp_path)))
    assert got["step"] == 3 and "MemoryError: no room for the state" in got["skipped"][0]
    assert got["dirs"] == ["latest.json", "step_0000003", "step_0000006"]


@pytest.mark.parametrize("text, why", [("", "it is empty"), ('{"dir": "step_0000006"}', "KeyError: 'step'"),
                                       ("[6]", "TypeError")])
def test_a_pointer_that_cannot_be_read_names_itself_and_what_to_write(tmp_path, text, why):
    (tmp_path / "checkpoints" / "step_0000006").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest.json").write_text(text)
    with pytest.raises(ValueError) as got:
        checkpoint.latest_step(tmp_path)
    msg = str(got.value)
    assert f"{tmp_path / 'checkpoints' / 'latest.json'} cannot be read ({why}" in msg, msg
    assert msg.endswith('write the newest complete one\'s step there, e.g. {"step": 6, "dir": "step_0000006"}'), msg


def test_a_checkpoint_of_another_model_says_so_without_a_traceback():
    """A stage file whose shapes do not fit the stage (the run's config.json edited, or another run's
    checkpoint): the user reads the file, the parameter, and what to do; not load_state_dict's traceback."""
    m, opt, sched = _stage(0)
    state = {"step": 6, "model": m.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "rng": torch.get_rng_state()}
    other = torch.nn.Linear(4, 2)
    other_opt = torch.optim.AdamW(other.parameters())
    restored = checkpoint.Restored(6, state, None, [], Path("run/checkpoints/step_0000006/stage0.pt"))
    with pytest.raises(TrainError) as got:
        checkpoint.apply(restored, other, other_opt, torch.optim.lr_scheduler.LambdaLR(other_opt, lambda s: 1.0))
    msg = str(got.value)
    assert msg.startswith("--resume: run/checkpoints/step_0000006/stage0.pt (step 6) does not fit this rank's "
                          "stage (size mismatch for weight: copying a param with shape torch.Size([3, 4])"), msg
    assert "put back the config.json of the run that wrote it" in msg and "Traceback" not in msg


def test_a_resume_drops_autotunes_decisions_after_its_step_as_it_does_the_metrics(tmp_path):
    log = Logger(tmp_path, active=True)
    for step in (1, 2, 4, 6):
        log.metric({"step": step})
        log.autotune({"step": step, "trigger": "every"})
    log.truncate(3)
    for name in ("metrics.jsonl", "autotune.jsonl"):
        assert [json.loads(ln)["step"] for ln in (tmp_path / name).read_text().splitlines()] == [1, 2], name


def test_a_resume_with_more_steps_says_how_the_learning_rate_moves():
    """The cosine decay spans --steps: a resume that raises it changes the next step's rate, and says so (the
    checkpoint records the length it decayed over); during the warm-up nothing changes and nothing is said."""
    from qwire.train import TrainConfig, schedule_note

    cfg = TrainConfig(steps=600, warmup=20, lr=1e-3)
    # 1e-3 (0.1 + 0.45 (1 + cos(pi 280 / 580))) against the end of the decay, lr / 10
    assert schedule_note(cfg, 300, 300) == ("--resume: --steps 600, where the checkpoint's run had 300: the "
                                            "learning rate's decay now spans 600 steps, so step 301 trains at "
                                            "0.000574 instead of 0.0001")
    assert schedule_note(cfg, 10, 300) == "" and schedule_note(cfg, 300, 600) == ""
    assert schedule_note(cfg, 300, None) == ""  # a checkpoint written before the length was recorded



def test_a_save_removes_the_pointer_temp_files_of_this_machines_dead_processes_only(tmp_path: Path) -> None:
    """A process killed while writing latest.json left latest.json.tmp-HOST-PID for good; another live process's
    (two agents on one machine sharing the run directory) is in flight and stays, as does another machine's."""
    import platform
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    node = platform.node()
    names = {"dead": f"latest.json.tmp-{node}-{dead.pid}", "alive": f"latest.json.tmp-{node}-{os.getppid()}",
             "other": f"latest.json.tmp-elsewhere-{dead.pid}"}
    for n in names.values():
        (folder / n).write_text("{}")
    checkpoint._rotate(tmp_path, 4)
    assert sorted(p.name for p in folder.iterdir()) == sorted([names["alive"], names["other"]])
