"""The benchmarks' shared process runner."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qwire.bench.runner import spawn_world


def _sum_ranks(rank: int, world: int, scale: float = 1.0) -> torch.Tensor:
    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    return t


def _fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 is broken")
    return rank


def test_spawn_world_returns_results_by_rank_and_reports_a_failing_rank() -> None:
    out = spawn_world(_sum_ranks, 3, kwargs={"scale": 2.0}, timeout=60)
    assert [float(t) for t in out] == [12.0, 12.0, 12.0]
    with pytest.raises(RuntimeError, match="rank 1 raised(.|\n)*rank 1 is broken"):
        spawn_world(_fails_on_rank_1, 2, timeout=30)


def _naps(rank: int, world: int) -> int:
    import time

    time.sleep(1.5 + rank)
    return rank


def test_ranks_that_run_long_show_that_they_move(monkeypatch, capsys) -> None:
    """agoq's DP phase and taco's TP steps printed nothing for minutes."""
    import qwire.bench.runner as runner

    monkeypatch.setattr(runner, "PROGRESS_EVERY", 0.5)
    assert spawn_world(_naps, 2, timeout=30) == [0, 1]
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("    ... _naps on 2 ranks: ")]
    assert notes and notes[-1].endswith(" finished") and len(notes) >= 2


def test_a_quiet_run_shows_its_last_step_every_so_often(tmp_path) -> None:
    import io
    import json
    import time

    from qwire.bench.runner import last_step, progress_lines

    run = tmp_path / "run-s0"
    run.mkdir()
    assert last_step(run) == 0  # no metrics yet
    out = io.StringIO()
    with progress_lines(run, 300, 0.05, out):
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
        deadline = time.monotonic() + 10
        while "step 3/300" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
    assert "    ... run-s0: step 3/300 after " in out.getvalue()
    lines = len(out.getvalue().splitlines())
    time.sleep(0.2)
    assert len(out.getvalue().splitlines()) == lines  # it stops with the run
    (run / "metrics.jsonl").write_text('{"step": 7}\n{"step": 8, "lo')  # a line still being written
    assert last_step(run) == 7


def test_a_benchmarks_command_names_the_codec_variables_that_are_set(monkeypatch) -> None:
    import argparse

    from qwire.bench.report import bench_command

    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--steps", type=int, default=3)

    args = argparse.Namespace(steps=5)
    for k in ("QWIRE_CODEC_GRAPHS", "QWIRE_CODEC_IMPL", "QWIRE_DEFER_CHECKS", "QWIRE_HOST_STAGING"):
        monkeypatch.delenv(k, raising=False)
    assert bench_command("pipeline", args, add) == "qwire bench pipeline --steps 5"
    monkeypatch.setenv("QWIRE_CODEC_GRAPHS", "1")
    monkeypatch.setenv("QWIRE_DEFER_CHECKS", "")
    assert bench_command("pipeline", args, add) == "QWIRE_CODEC_GRAPHS=1 qwire bench pipeline --steps 5"


@pytest.mark.parametrize("argv, needle", [
    (["3d", "--repeat", "-1", "--skip-convergence", "--no-links"], "qwire bench 3d: --repeat must be >= 1 (0: the "
                                                                    "default), got -1"),
    (["fsdp", "--seeds", "-1"], "qwire bench fsdp: --seeds must be >= 1 (0: the default), got -1"),
    (["diloco", "--outer", "0.7:5"], "qwire bench diloco: --outer '0.7:5': each LR must be > 0 and each MOMENTUM >= 0 "
                                     "and < 1, got 0.7:5"),
    (["diloco", "--steps", "-3"], "qwire bench diloco: --steps must be >= 1 (0: the default), got -3"),
    (["adaptive", "--repeat", "-2"], "qwire bench adaptive: --repeat must be >= 1 (0: the default), got -2"),
    (["pipeline", "--batch-size", "7", "--rates", "none", "--methods", "fp32", "--skip-convergence",
      "--skip-robustness"], "qwire bench pipeline: the runs' settings: --batch-size (7) must be a positive multiple"),
    (["taco", "--bandwidths", "abc"], "qwire bench taco: --bandwidths takes comma-separated numbers, got 'abc'"),
    (["taco", "--worlds", "2,x"], "qwire bench taco: --worlds takes comma-separated whole numbers, got 'x' in '2,x'"),
    (["agoq", "--bandwidths-gbps", "1,inf"], "qwire bench agoq: --bandwidths-gbps: each value must be a finite "
                                             "number > 0, got 'inf'"),
    (["agoq", "--corpus", "/nonexistent"], "qwire bench agoq: corpus path '/nonexistent' does not exist"),
    (["agoq", "--world", "0"], "qwire bench agoq: --world must be >= 2 (data-parallel ranks), got 0"),
    (["agoq", "--model", "nosuch"], "qwire bench agoq: model 'nosuch': not a preset, and no such file"),
    (["taco", "--model", "nosuch"], "qwire bench taco: model 'nosuch': not a preset, and no such file"),
    # --quick replaced these with its own sizes, unchecked, while the page named them
    (["taco", "--quick", "--worlds", "1"], "qwire bench taco: --worlds: each world size must be >= 2, got '1'"),
    (["agoq", "--quick", "--sizes-mb", "abc"], "qwire bench agoq: --sizes-mb takes comma-separated numbers, got 'abc'"),
    (["codecs", "--sizes-mb", "1,abc"], "qwire bench codecs: --sizes-mb takes comma-separated numbers, got 'abc'"),
])
def test_a_benchmarks_arguments_are_checked_before_anything_runs_or_is_written(tmp_path, capfd, argv, needle):
    """A negative count ran no variant and still wrote the results page; a setting no run can use failed in
    every run, after the page was begun; a malformed list or a missing corpus ended in a traceback."""
    from qwire.cli import main

    out = tmp_path / "out"
    assert main(["bench", *argv, "--out", str(out), "--runs", str(tmp_path / "runs")]
                if argv[0] not in ("taco", "agoq", "codecs") else ["bench", *argv, "--out", str(out)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(needle), err
    assert not out.exists()
