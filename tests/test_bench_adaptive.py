"""qwire bench adaptive: the tables and targets from given rows, and a quick run over the network lab."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab_utils import lab_reason, needs_lab  # noqa: F401  (lab_reason: needs_lab's condition)
from qwire.bench import adaptive

AUTO = "auto"


def _row(codec: str, rate: str, tps: float, rep: int = 0, chose: str = "") -> dict:
    return {"codec": codec, "rate": rate, "repeat": rep, "tokens_per_s": tps, "in_force": chose or f"{codec}/{codec}"}


def test_grid_table_takes_the_median_over_repeats_and_compares_with_the_best_fixed_codec() -> None:
    rows = [_row("fp32", "1gbit", 100), _row("fp32", "1gbit", 120, 1), _row("int8", "1gbit", 90),
            _row(AUTO, "1gbit", 112, chose="fp32/fp32"), _row(AUTO, "1gbit", 116, 1, chose="fp32/fp32"),
            _row("fp32", "20mbit", 20), _row("int8", "20mbit", 50), _row(AUTO, "20mbit", 45, chose="int8/int8"),
            {**_row("int8", "20mbit", 999, 1), "error": "boom"}]  # a failed run counts for nothing
    t = {r["rate"]: r for r in adaptive.grid_table(rows, ["fp32", "int8"], AUTO)}
    assert t["1gbit"]["tokens_per_s"]["fp32"] == 110 and t["1gbit"]["best_fixed"] == "fp32"
    assert t["1gbit"]["auto_ratio"] == pytest.approx(114 / 110) and t["1gbit"]["met"]
    assert t["20mbit"]["best_fixed"] == "int8" and t["20mbit"]["auto_ratio"] == pytest.approx(0.9)
    assert not t["20mbit"]["met"] and t["20mbit"]["auto_chose"] == ["int8/int8"]
    # within each sweep, auto against that sweep's best; the spread is fp32's 100 vs 120 over its median 110
    assert t["1gbit"]["per_sweep"] == pytest.approx([112 / 100, 116 / 120])
    assert t["1gbit"]["spread"] == pytest.approx(20 / 110) and t["20mbit"]["spread"] == 0.0
    assert t["20mbit"]["per_sweep"] == pytest.approx([0.9])


def test_schedule_summary_counts_every_step_and_the_target_needs_1_2x() -> None:
    steps = [{"step": i, "s": s, "loss": 9 - i, "tokens": 1000, "wire_bytes": 10, "fwd": "fp32", "bwd": "fp32"}
             for i, s in enumerate([2.0, 1.0, 1.0, 1.0, 1.0, 1.0], start=1)]
    summ = adaptive.schedule_summary(steps)
    assert summ["total_s"] == 7.0 and summ["tokens_per_s"] == pytest.approx(6000 / 7)
    assert summ["final_loss"] == pytest.approx(sum(9 - i for i in range(2, 7)) / 5) and summ["wire_bytes"] == 60
    rows = [{"codec": "fp32", "total_s": 7, "tokens_per_s": 100.0}, {"codec": "int8", "total_s": 5,
                                                                       "tokens_per_s": 140.0},
            {"codec": AUTO, "total_s": 4, "tokens_per_s": 167.0}]
    st = adaptive.schedule_table(rows, ["fp32", "int8"], AUTO)
    assert st["best_fixed"] == "int8" and st["auto_ratio"] == pytest.approx(167 / 140) and not st["met"]
    rows[2]["tokens_per_s"] = 168.0
    assert adaptive.schedule_table(rows, ["fp32", "int8"], AUTO)["met"]


def test_a_changing_link_run_above_the_ceiling_of_switching_shows_nothing() -> None:
    """auto only chooses among the fixed codecs: over a run where each phase's fastest fixed codec adds up to
    1.1x the best single one, a 1.25x is noise (one codec's steps slower in its own run), and is not met."""
    def run(codec: str, times: list[float]) -> dict:
        steps = [{"step": i, "s": s, "tokens": 100, "loss": 1.0, "wire_bytes": 1} for i, s in enumerate(times, 1)]
        return {"codec": codec, "steps": steps, **adaptive.schedule_summary(steps)}

    phases = [(1, 2, "1gbit"), (3, 4, "20mbit")]
    fixed = [run("fp32", [1.0, 1.0, 4.0, 4.0]), run("int8", [1.2, 1.2, 2.0, 2.0])]  # int8 best: 6.4 s
    ceiling = 6.4 / 6.0  # fp32's 2.0 s on the fast link, int8's 4.0 s on the slow one
    st = adaptive.schedule_table([*fixed, run(AUTO, [0.8, 0.8, 1.8, 1.7])], ["fp32", "int8"], AUTO, phases)
    assert st["ceiling_ratio"] == pytest.approx(ceiling) and st["auto_ratio"] == pytest.approx(6.4 / 5.1)
    assert st["above_ceiling"] and not st["met"]
    st = adaptive.schedule_table([*fixed, run(AUTO, [1.0, 1.0, 2.1, 2.1])], ["fp32", "int8"], AUTO, phases)
    assert not st["above_ceiling"] and st["auto_ratio"] == pytest.approx(6.4 / 6.2) and not st["met"]


def test_a_steps_time_includes_what_auto_spent_after_it(tmp_path: Path) -> None:
    """per_step(): the slowest rank's step time plus auto's measuring and choosing after the step (recorded
    outside the step time); a fixed codec's records have no auto time."""
    base = {"loss": 5.0, "tokens": 1024, "wire_bytes_fwd": 10, "wire_bytes_bwd": 20, "step_time_s": 0.09}
    recs = [{**base, "step": 1, "step_time_max_s": 0.1, "auto_time_s": 0.7, "codec_fwd": ["fp32"]},
            {**base, "step": 2, "step_time_max_s": 0.1, "auto_time_s": 0.001, "codec_fwd": ["int8"]},
            {**base, "step": 3, "step_time_max_s": 0.2, "codec_fwd": "fp16"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    steps = adaptive.per_step(tmp_path)
    assert [s["s"] for s in steps] == pytest.approx([0.8, 0.101, 0.2])
    assert [s["auto_s"] for s in steps] == [0.7, 0.001, 0.0] and [s["fwd"] for s in steps] == ["fp32", "int8", "fp16"]
    assert adaptive.schedule_summary(steps)["total_s"] == pytest.approx(1.101)


def test_shift_noise_counts_runs_whose_steady_steps_would_trip_the_shift_rule() -> None:
    """shift_noise(): per fixed-codec run (auto's runs and failed runs left out), two steps in a row after the
    skipped ones more than a fraction away from the run's median step, or one step more than SHIFT_JUMP times
    that fraction; one step between the two alone does not count."""
    from qwire.parallel.autotune import SHIFT_JUMP

    def run(codec: str, times: list[float], **extra) -> dict:
        return {"codec": codec, "steps": [{"s": s} for s in times], **extra}

    rows = [run("fp32", [9.0, 1.0, 1.0, 1.26, 1.26, 1.0, 1.0]),   # two in a row 26% off: trips 0.2 and 0.25
            run("int8", [9.0, 1.0, 1.35, 1.0, 1.35, 1.0, 1.0]),   # 35% off, never twice in a row
            run("int8", [9.0, 1.0, 1.0, 1.7, 1.0, 1.0]),          # one step 70% off: over 2 x 0.2, 0.25, 0.3
            run(AUTO, [1.0, 1.0, 3.0, 3.0, 1.0, 1.0, 1.0]),
            run("fp16", [1.0, 1.0, 3.0, 3.0, 1.0], error="boom")]
    got = adaptive.shift_noise(rows, ["fp32", "int8", "fp16"], skip=1)
    assert SHIFT_JUMP == 2.0
    assert got == {"runs": 3, "tripped": {0.2: 2, 0.25: 2, 0.3: 1, 0.5: 0}}


def test_rate_phases_follow_the_schedule() -> None:
    plan = {"schedule_link": "1gbit", "schedule": "20:20mbit;40:200mbit", "schedule_steps": 60}
    assert adaptive.rate_phases(plan) == [(1, 20, "1gbit"), (21, 40, "20mbit"), (41, 60, "200mbit")]


def test_bad_options_are_refused_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qwire.cli import main

    for argv, needle in [(["--codecs", ""], "--codecs is empty"), (["--auto-spec", "int8"], "--auto-spec must be"),
                         (["--schedule", "9:20mbit", "--quick"], "never take effect"),
                         (["--codecs", "nosuch"], "nosuch")]:
        code = main(["bench", "adaptive", "--out", str(tmp_path), *argv])
        err = capsys.readouterr().err
        assert code == 2 and needle in err, err[-2000:]
    assert not (tmp_path / "adaptive.json").exists()


@needs_lab
def test_quick_run_over_the_lab_writes_the_page(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "qwire", "bench", "adaptive", "--quick", "--codecs", "fp32,tahquant",
                          "--rates", "20mbit", "--out", str(out), "--runs", str(tmp_path / "runs")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    result = json.loads((out / "adaptive.json").read_text())
    command = result["meta"]["command"]
    assert command.startswith("qwire bench adaptive ") and "--quick" in command.split()
    assert [(r["codec"], r["rate"]) for r in result["grid"]] == [("fp32", "20mbit"), ("tahquant", "20mbit"),
                                                                  (AUTO, "20mbit")]
    assert all(r["link_mode"] == "lab" and len(r["steps"]) == 4 for r in result["grid"])
    sched = {r["codec"]: r for r in result["schedule"]}
    assert set(sched) == {"fp32", "tahquant", AUTO}
    for r in sched.values():  # every run saw both rate changes, after the scheduled steps
        assert [(c["after_step"], c["link"]) for c in r["link_changes"]] == [(2, "20mbit"), (4, "200mbit")]
        assert len(r["steps"]) == 6 and r["total_s"] == pytest.approx(sum(s["s"] for s in r["steps"]))
    assert sched["tahquant"]["wire_bytes"] < sched["fp32"]["wire_bytes"] / 4
    md = (out / "adaptive.md").read_text()
    assert command in md and "Quick smoke-test settings" in md
    assert all(f"`{c}`" in md for c in ("fp32", "tahquant", AUTO)) and "## Targets" in md
    assert (out / "adaptive.png").stat().st_size > 1000
    before = md
    (out / "adaptive.md").unlink()
    res = subprocess.run([sys.executable, "-m", "qwire", "bench", "adaptive", "--render-only", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and (out / "adaptive.md").read_text() == before


def test_phase_ceiling_takes_each_phases_fastest_fixed_codec() -> None:
    def run(codec: str, times: list[float]) -> dict:
        return {"codec": codec, "steps": [{"step": i, "s": s, "tokens": 100} for i, s in enumerate(times, start=1)]}

    phases = [(1, 2, "1gbit"), (3, 4, "20mbit")]
    rows = [run("fp32", [1.0, 1.0, 5.0, 5.0]), run("int8", [1.5, 1.5, 2.0, 2.0]), run(AUTO, [0.1] * 4),
            {**run("fp16", [0.1] * 4), "error": "boom"}]  # auto and a failed run are not candidates
    c = adaptive.phase_ceiling(rows, ["fp32", "int8", "fp16"], phases)
    assert c["codecs"] == ["fp32", "int8"] and c["total_s"] == pytest.approx(6.0) and c["phase_s"] == [2.0, 4.0]
    assert c["tokens_per_s"] == pytest.approx(400 / 6.0)
    assert adaptive.phase_ceiling([], ["fp32"], phases) is None
