"""`qwire bench diloco`: the time, bytes and loss arithmetic, the markdown, and a --quick run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwire.bench import diloco
from qwire.cli import main


def _metrics(path: Path, step_s: list[float], dp: list[int], val: dict[int, float]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with (path / "metrics.jsonl").open("w") as f:
        for i, (s, b) in enumerate(zip(step_s, dp), 1):
            f.write(json.dumps({"step": i, "loss": 5.0, "tokens": 100 * i, "step_time_s": s, "wire_bytes_dp": b,
                                **({"val_loss": val[i]} if i in val else {})}) + "\n")
    return path


def test_measure_sums_the_steps_and_places_validations_on_the_training_time(tmp_path: Path) -> None:
    m = diloco.measure(_metrics(tmp_path / "a", [1.0, 0.5, 2.0, 0.5], [0, 0, 300, 300], {2: 6.0, 4: 5.0}))
    assert m["train_s"] == pytest.approx(4.0) and m["tokens_per_s"] == pytest.approx(400 / 4.0)
    assert m["dp_bytes"] == 600 and m["meetings"] == 2
    assert m["val"] == [[2, 1.5, 6.0], [4, 4.0, 5.0]]


def test_summary_and_markdown_compare_with_ddp() -> None:
    def row(h: int, seed: int, train_s: float, val: float) -> dict:
        return {"every": h, "outer": [] if h == 1 else [1.0, 0.0], "seed": seed, "train_s": train_s,
                "tokens_per_s": 1000 / train_s, "dp_bytes": 800 // h,
                "meetings": 8 // h, "val": [[4, train_s / 2, 6.0], [8, train_s, val]], "val_loss": val}
    runs = [row(1, 0, 40.0, 5.0), row(1, 1, 40.0, 5.2), row(4, 0, 30.0, 5.1), row(4, 1, 30.0, 5.3),
            {"every": 4, "outer": [1.0, 0.0], "seed": 2, "error": "TrainError: boom"}]
    assert diloco.at_time(runs[0]["val"], 30.0) == pytest.approx(5.5)  # half way from 6.0 (20 s) to 5.0 (40 s)
    assert diloco.at_time(runs[0]["val"], 10.0) is None  # before DDP's first validation
    assert diloco.ddp_at(runs, 30.0) == pytest.approx((5.5 + 5.6) / 2)
    s = diloco.summarize(runs)
    bw8 = diloco.BW8
    assert list(s) == [(1, 0, bw8, False, 1), (4, 0, bw8, False, 1, 1.0, 0.0)]
    d = s[(4, 0, bw8, False, 1, 1.0, 0.0)]
    assert d["seeds"] == [0, 1]
    assert d["val_mean"] == pytest.approx(5.2) and (d["val_min"], d["val_max"]) == (5.1, 5.3)
    md = diloco.markdown({"meta": {"command": "qwire bench diloco"}, "settings": dict(diloco.SETTINGS), "steps": 8,
                          "link": {"shaped": True, "spec": "20mbit,mode=lab"}, "runs": runs})
    lines = md.splitlines()
    ddp = next(ln for ln in lines if ln.startswith("| DDP"))
    assert "| 1.00x |" in ddp and "+0.00%" in ddp
    dl = next(ln for ln in lines if ln.startswith("| DiLoCo every 4 steps, outer lr 1, momentum 0 |"))
    assert "| 1.33x |" in dl and "+1.96%" in dl and "5.2000 [5.1000, 5.3000]" in dl and dl.endswith("| 5.5500 |")
    assert ddp.endswith("| - |")
    assert "**1 run(s) failed:** diloco-4-lr1-m0 seed 2: TrainError: boom" in md
    assert "| waiting on DP |" in md and dl.split("|")[5].strip() == "-"  # results without the wait: no number
    overlapped = dict(row(4, 0, 24.0, 5.1), overlap=2, dp_wait_s=0.5)
    md = diloco.markdown({"meta": {}, "settings": dict(diloco.SETTINGS), "steps": 8, "link": {"shaped": True,
                          "spec": "20mbit,mode=lab"}, "runs": [*runs[:4], overlapped]})
    ov = next(ln for ln in md.splitlines() if ln.startswith("| DiLoCo every 4 steps, outer lr 1, momentum 0, "
                                                             "landing 2 steps later |"))
    assert "| 0.5 s |" in ov and "| 1.67x |" in ov
    four = dict(row(4, 0, 20.0, 5.0), dp_codec="blockwise4:block=256", error_feedback=True, dp_bytes=100_000)
    md = diloco.markdown({"meta": {}, "settings": dict(diloco.SETTINGS), "steps": 8, "link": {"shaped": True,
                          "spec": "20mbit,mode=lab"}, "runs": [*runs[:4], four]})
    ef = next(ln for ln in md.splitlines() if ln.startswith("| DiLoCo every 4 steps, outer lr 1, momentum 0, "
                                                             "`blockwise4:block=256`, error feedback |"))
    assert "| 2.00x |" in ef and "| 0.10 MB |" in ef, ef
    assert diloco.variant(4, **diloco.describe(four)) == "diloco-4-lr1-m0-blockwise4-block-256-ef"
    streamed = dict(row(4, 0, 20.0, 5.0), fragments=2, overlap=1)
    assert diloco.label(4, **diloco.describe(streamed)) == ("DiLoCo every 4 steps, outer lr 1, momentum 0, "
                                                            "2 fragments in turn, landing 1 step later")
    assert diloco.variant(4, **diloco.describe(streamed)) == "diloco-4-lr1-m0-f2-overlap1"
    assert "NO LINKS" not in md


REFUSED = [  # (arguments, what the error says)
    (["--every", "1,x"], "--every '1,x': give whole numbers of steps"),
    (["--every", "0"], "every H must be >= 1"),
    (["--outer", "0.7"], "--outer '0.7': give LR:MOMENTUM pairs"),
    (["--every", "8,32", "--overlap", "0,8"],
     "--overlap '0,8': every K must be >= 0 and smaller than every H > 1 of --every (8,32)"),
    (["--every", "8", "--fragments", "3"],
     "--fragments '3': every F must be >= 1 and divide every H > 1 of --every (8)"),
    (["--every", "8", "--fragments", "1,4", "--overlap", "2"],
     "smaller than every H > 1 of --every (8) divided by every F of --fragments (1,4)"),
    (["--dp-codecs", "blockwise8;aqsgd"], "--dp-codecs 'aqsgd': DiLoCo needs a stateless codec that is not auto"),
    (["--dp-codecs", " AUTO:candidates=fp32+int8"], "DiLoCo needs a stateless codec that is not auto"),
    (["--error-feedback", "yes"], "--error-feedback 'yes': give 0, 1 or 0,1 (off, on)"),
]


def test_bad_arguments_are_refused_before_anything_runs(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    for args, said in REFUSED:
        assert main(["bench", "diloco", *args, "--out", str(tmp_path)]) == 2, args
        assert said in capfd.readouterr().err, args


@pytest.mark.slow
def test_quick_run_writes_the_results(tmp_path: Path) -> None:
    out = tmp_path / "out"
    bw4 = "blockwise4:block=256"
    assert main(["bench", "diloco", "--quick", "--no-links", "--every", "4", "--overlap", "2", "--dp-codecs",
                 f"{diloco.BW8};{bw4}", "--error-feedback", "1", "--out", str(out),
                 "--runs", str(tmp_path / "runs")]) == 0
    result = json.loads((out / "diloco.json").read_text())
    runs = {(r["every"], r["overlap"], r["dp_codec"], r["error_feedback"]): r for r in result["runs"]}
    assert set(runs) == {(1, 0, diloco.BW8, False), (4, 2, diloco.BW8, True), (4, 2, bw4, True)}
    assert not any(r.get("error") for r in runs.values())
    ddp, eight, four = runs[1, 0, diloco.BW8, False], runs[4, 2, diloco.BW8, True], runs[4, 2, bw4, True]
    assert ddp["meetings"] == 8 and eight["meetings"] == 2 and four["meetings"] == 2  # landing after 6 and 8
    assert eight["dp_bytes"] == pytest.approx(ddp["dp_bytes"] / 4)  # the same all-reduce, 1/4 as often
    assert four["dp_bytes"] < 0.55 * eight["dp_bytes"]  # 4 bits and a scale per 256 elements instead of 8
    md = (out / "diloco.md").read_text()
    assert "NO LINKS: --no-links was given" in md and (out / "diloco.png").exists()


def test_a_stop_signal_stops_the_benchmark_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    """SIGTERM stopped the training run, and the benchmark went on: every later run stopped after its first step
    (the stop request stays set), counted as failed, and the half-failed page replaced a complete one."""
    import signal

    import qwire.train
    from qwire.cli import main
    from qwire.procs import RunStopped

    calls = []

    def stopped(cfg, *args, **kwargs):
        calls.append(cfg.out)
        raise RunStopped(1, cfg.out, signal.SIGTERM)

    monkeypatch.setattr(qwire.train, "launch", stopped)
    out = tmp_path / "out"
    code = main(["bench", "diloco", "--quick", "--out", str(out), "--runs", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM and len(calls) == 1, (code, calls)
    assert "qwire bench diloco: stopped by SIGTERM; the runs finished so far are under its --runs folder" in err
    assert "Traceback" not in err and not (out / "diloco.json").exists()


def test_meetings_that_come_only_after_the_last_step_are_pointed_out(capsys) -> None:
    """--quick's 8 steps with H = 8 and 32: two rows of the same run, with nothing said."""
    import argparse

    from qwire.bench import diloco

    p = argparse.ArgumentParser()
    diloco.add_arguments(p)
    diloco.make_plan(p.parse_args(["--quick", "--no-links"]))
    assert ("with 8 steps, H = 8, 32 of --every meet only after the last step, so their runs are the same; give "
            "--steps above 32") in capsys.readouterr().err
    diloco.make_plan(p.parse_args(["--quick", "--no-links", "--steps", "40"]))
    assert capsys.readouterr().err == ""
    # in fragments, H meets every H / F steps: H = 8 in 4 fragments meets at steps 2, 4, 6 (said it did not)
    diloco.make_plan(p.parse_args(["--quick", "--no-links", "--every", "1,8,32", "--fragments", "1,4"]))
    assert ("with 8 steps, H = 8, 32 of --every in 1 fragment; H = 32 of --every in 4 fragments meet only after "
            "the last step, so their runs are the same; give --steps above 32") in capsys.readouterr().err
