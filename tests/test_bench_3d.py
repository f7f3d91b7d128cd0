"""`qwire bench 3d`: the timing arithmetic, --render-only from a synthetic result, and a --quick run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwire.bench import threed
from qwire.cli import main


def _metrics(path: Path, steps: list[tuple[float, float, float]], wire: dict[str, int]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with (path / "metrics.jsonl").open("w") as f:
        for i, (step_s, tp_s, dp_s) in enumerate(steps, 1):
            f.write(json.dumps({"step": i, "loss": 5.0, "tokens": 1024 * i, "tokens_per_s": 1024 / step_s,
                                "step_time_s": step_s, "time_tp_s": tp_s, "time_dp_s": dp_s,
                                "wire_bytes_fwd": wire["fwd"], "wire_bytes_bwd": wire["bwd"],
                                "fp32_bytes": wire["fp32"], "wire_bytes_tp": wire["tp"],
                                "wire_bytes_dp": wire["dp"]}) + "\n")


def test_measure_and_aggregate(tmp_path: Path) -> None:
    wire = {"fwd": 100, "bwd": 200, "fp32": 600, "tp": 1000, "dp": 4000}
    _metrics(tmp_path / "a", [(9.0, 9.0, 9.0), (2.0, 0.5, 1.0), (4.0, 0.5, 3.0)], wire)
    _metrics(tmp_path / "b", [(9.0, 9.0, 9.0), (1.0, 0.2, 0.3)], wire)
    a = threed.measure(tmp_path / "a", skip=1)
    assert a["steps_counted"] == 2 and a["step_s"] == pytest.approx(3.0)
    assert (a["tp_s"], a["dp_s"], a["rest_s"]) == pytest.approx((0.5, 2.0, 0.5))
    assert a["tokens_per_s"] == pytest.approx(2 * 1024 / 6.0)
    assert a["wire_per_step"] == {"pp": 300, "pp_fwd": 100, "pp_bwd": 200, "tp": 1000, "dp": 4000, "total": 5300}
    assert a["fp32_pp_per_step"] == 600
    b = threed.measure(tmp_path / "b", skip=1)
    rows = [{"variant": "full", **a}, {"variant": "full", **b}, {"variant": "tp", "error": "boom"}]
    agg = threed.aggregate(rows)
    assert set(agg) == {"full"}
    g = agg["full"]
    assert g["runs"] == 2 and g["steps_counted"] == 3
    assert g["step_s"] == pytest.approx(7.0 / 3)  # the counted steps of both runs pooled
    assert g["tokens_per_s"] == pytest.approx(3 * 1024 / 7.0)
    assert g["rest_s"] == pytest.approx((0.5 + 0.5 + 0.5) / 3)
    assert (g["tokens_per_s_min"], g["tokens_per_s_max"]) == pytest.approx((1024 / 3, 1024.0))


def test_variants_compress_one_dimension_each() -> None:
    v = threed.VARIANTS
    assert v["uncompressed"]["codecs"] == threed.UNCOMPRESSED and v["full"]["codecs"] == threed.COMPRESSED
    assert v["pp"]["codecs"] == {**threed.UNCOMPRESSED, "fwd_codec": "tahquant", "bwd_codec": "perchannel6"}
    assert v["tp"]["codecs"] == {**threed.UNCOMPRESSED, "tp_codec": "fp8"}
    assert v["dp"]["codecs"] == {**threed.UNCOMPRESSED, "dp_codec": "blockwise8:block=256"}


def _args(*argv: str) -> object:
    import argparse

    p = argparse.ArgumentParser()
    threed.add_arguments(p)
    return p.parse_args(list(argv))


def test_plan_without_the_lab_runs_unshaped_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import qwire.netlab

    monkeypatch.setattr(qwire.netlab, "lab_unavailable_reason", lambda: "the network lab needs root")
    plan = threed._plan(_args())
    assert plan["links"]["shaped"] is False and "needs root" in plan["links"]["reason"]
    assert plan["links"]["per_dim"] == {"pp": "", "tp": "", "dp": ""}
    assert (plan["steps"], plan["skip"], plan["repeat"], plan["conv_steps"]) == (10, 3, 2, 120)
    monkeypatch.setattr(qwire.netlab, "lab_unavailable_reason", lambda: None)
    plan = threed._plan(_args("--link-slow", "20mbit"))
    assert plan["links"]["shaped"] and plan["links"]["per_dim"] == {
        "pp": "20mbit,mode=lab", "tp": "10gbit,mode=lab", "dp": "20mbit,mode=lab"}  # the lab or an error
    plan = threed._plan(_args("--no-links", "--quick"))
    assert not plan["links"]["shaped"] and plan["links"]["reason"] == "--no-links was given"
    assert plan["settings"]["seq_len"] == threed.QUICK["seq_len"] and plan["steps"] == 3


def _row(variant: str, rep: int, step: float, tp: float, dp: float, wire: dict[str, float]) -> dict:
    w = {**wire, "pp_fwd": wire["pp"] / 2, "pp_bwd": wire["pp"] / 2, "total": wire["pp"] + wire["tp"] + wire["dp"]}
    return {"variant": variant, "repeat": rep, "run_dir": f"runs/{variant}-r{rep}", "command": "qwire train ...",
            "wall_s": 30.0, "tokens_per_step": 1024.0, "steps_counted": 7, "tokens_per_s": 1024 / step,
            "step_s": step, "tp_s": tp, "dp_s": dp, "rest_s": step - tp - dp, "wire_per_step": w,
            "fp32_pp_per_step": 4.2e6, "link_mode": "lab", "per_step": {}}


def _synthetic(shaped: bool = True) -> dict:
    fp32 = {"pp": 4.2e6, "tp": 33.5e6, "dp": 58.9e6}
    comp = {"pp": 0.7e6, "tp": 8.9e6, "dp": 15.0e6}
    walls = {"uncompressed": (3.3, 0.25, 2.2, fp32), "pp": (3.2, 0.25, 2.2, {**fp32, "pp": comp["pp"]}),
             "tp": (3.4, 0.35, 2.2, {**fp32, "tp": comp["tp"]}), "dp": (1.7, 0.25, 0.6, {**fp32, "dp": comp["dp"]}),
             "full": (1.6, 0.35, 0.6, comp)}
    runs = [_row(v, rep, *walls[v]) for rep in range(2) for v in walls]
    runs.append({"variant": "tp", "repeat": 2, "run_dir": "x", "command": "y", "wall_s": 1.0,
                 "error": "TrainError: rank 3 died\n  | details"})
    per_dim = {"pp": "50mbit,mode=lab", "tp": "10gbit,mode=lab", "dp": "50mbit,mode=lab"}
    conv = {v: {"run_dir": f"runs/{v}", "command": "qwire train ...", "wall_s": 100.0,
                "summary": {"steps": 150, "final_loss": 4.0 + i * 0.01, "val_loss": 4.5 + i * 0.02,
                            "wire_bytes_fwd": 1e8, "wire_bytes_bwd": 1e8, "wire_bytes_tp": 5e9, "wire_bytes_dp": 9e9},
                "curve": [[s, 8.0 - s * 0.02] for s in range(1, 151)], "val": [[30 * k, 7.0 - k * 0.4] for k in (1, 5)],
                "timing": {"tokens_per_s": 1300.0 - 200 * i, "step_s": 0.8 + 0.2 * i, "tp_s": 0.2, "dp_s": 0.05,
                           "rest_s": 0.55 + 0.2 * i, "steps_counted": 147}}
            for i, v in enumerate(("uncompressed", "full"))}
    return {"meta": {"command": "qwire bench 3d", "machine": "x86_64, 2 CPU cores, Linux", "torch": "2.x",
                     "duration_s": 840.0, "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [8.0, 6.0, 4.0],
                     "quick": False},
            "variants": threed.VARIANTS, "settings": {**threed.SETTINGS, **threed.MESH, "seed": 0},
            "links": {"shaped": shaped, "reason": "" if shaped else "--no-links was given", "slow": per_dim["pp"],
                      "fast": per_dim["tp"], "per_dim": per_dim if shaped else {"pp": "", "tp": "", "dp": ""}},
            "throughput": {"steps": 10, "skip": 3, "repeat": 2, "variants": list(walls), "runs": runs},
            "convergence": {"steps": 150, "eval_every": 30, "skip": 3, "runs": conv}}


def test_render_only_from_synthetic_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "3d.json").write_text(json.dumps(_synthetic()))
    assert main(["bench", "3d", "--render-only", "--out", str(out)]) == 0
    md = (out / "3d.md").read_text()
    for heading in ("## Setup", "## Summary", "## Throughput and where the time goes", "## Bytes on the wire per step",
                    "## The same steps without links", "## Validation loss", "## What the numbers mean"):
        assert heading in md
    assert "Command: `qwire bench 3d`" in md and "NO LINKS" not in md
    assert "| pp | activations forward" in md and "| 50mbit |" in md and "| 10gbit |" in md
    assert "**2.06x** the uncompressed throughput" in md  # 3.3 s / 1.6 s per step
    assert "| uncompressed | - | 310 (310-310) | 1.00x | 3.300 |" in md
    assert ("| fully compressed | PP, TP, DP | 640 (640-640) | 2.06x | 1.600 | 0.350 (22%) | 0.600 (37%) | "
            "0.650 (41%) |") in md
    assert "TrainError: rank 3 died" in md  # failed runs are listed
    assert "| fp32 equivalent | 4.20 MB | 33.50 MB | 58.90 MB |" in md
    assert "PP 6.0x, TP 3.8x, DP 3.9x fewer bytes" in md
    assert "DP 7.36 MB per rank at 50mbit = 1.232 s" in md  # 58.9 MB / 8 ranks over 50 Mbit/s x 95.6%
    assert "| 4.5000 | +0.00% |" in md and "| 4.5200 | +0.44% |" in md
    assert "over the links: step s added" in md and "| +2.500 |" in md
    assert "**Uncompressed, the DP gradient all-reduce dominates**: 2.20 of 3.30 s" in md
    assert "1.8x that bound" in md and "compressing TP alone changed the step by +0.10 s: FP8" in md
    for png in ("3d_loss.png", "3d_time.png"):
        assert (out / png).stat().st_size > 1000


def test_a_page_without_loss_curves_shows_no_plot_of_an_earlier_run(tmp_path: Path) -> None:
    """The loss runs failed: the page embedded 3d_loss.png, the earlier run's plot left in --out."""
    threed.render(_synthetic(), tmp_path)
    assert (tmp_path / "3d_loss.png").exists()
    failed = _synthetic()
    for r in failed["convergence"]["runs"].values():
        r.pop("curve", None)
    threed.render(failed, tmp_path)
    assert not (tmp_path / "3d_loss.png").exists() and "3d_loss.png" not in (tmp_path / "3d.md").read_text()
    assert (tmp_path / "3d_time.png").exists()
    failed["throughput"]["runs"] = []  # ... and the time plot, where no throughput run gave a time
    threed.render(failed, tmp_path)
    assert not (tmp_path / "3d_time.png").exists() and "3d_time.png" not in (tmp_path / "3d.md").read_text()


def test_render_without_links_says_so(tmp_path: Path) -> None:
    threed.render(_synthetic(shaped=False), tmp_path)
    md = (tmp_path / "3d.md").read_text()
    assert md.splitlines()[2].startswith("**NO LINKS: --no-links was given.")
    assert "none (not shaped)" in md and "over the links: step s added" not in md
    assert "Lower bounds" not in md and "## What dominates" not in md


def test_render_only_needs_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "3d", "--render-only", "--out", str(tmp_path)]) == 2
    assert "run the benchmark first" in capsys.readouterr().err


def test_bad_arguments_fail_before_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "3d", "--variants", "uncompressed,zip", "--out", str(tmp_path)]) == 2
    assert "unknown variant" in capsys.readouterr().err
    assert main(["bench", "3d", "--link-slow", "50mbit,mode=sim", "--out", str(tmp_path)]) == 2
    assert main(["bench", "3d", "--steps", "3", "--skip", "3", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "3d.json").exists()


@pytest.mark.slow
def test_quick_3d_bench_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two 8-rank throughput runs (uncompressed, fully compressed) on tiny settings: over the network lab
    where it can run, else without links (and the output says so). The validation-loss part is left out
    here (two more 8-rank runs); its rendering is covered above."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    rc = main(["bench", "3d", "--quick", "--variants", "uncompressed,full", "--skip-convergence",
               "--out", str(out), "--runs", str(tmp_path / "runs")])
    assert rc == 0
    data = json.loads((out / "3d.json").read_text())
    assert {"meta", "variants", "settings", "links", "throughput"} <= set(data) and "convergence" not in data
    assert data["meta"]["command"].startswith("qwire bench 3d") and " --quick" in data["meta"]["command"]
    assert (data["settings"]["stages"], data["settings"]["tp"], data["settings"]["dp"]) == (2, 2, 2)
    rows = {r["variant"]: r for r in data["throughput"]["runs"]}
    assert set(rows) == {"uncompressed", "full"} and not any(r.get("error") for r in rows.values())
    unc, full = rows["uncompressed"], rows["full"]
    for r in (unc, full):
        assert r["tokens_per_s"] > 0 and r["steps_counted"] == 2 and r["command"].startswith("qwire train")
        assert r["link_mode"] == ("lab" if data["links"]["shaped"] else "none")
        assert r["step_s"] == pytest.approx(r["tp_s"] + r["dp_s"] + r["rest_s"])
        assert r["tp_s"] > 0 and r["dp_s"] > 0  # 3D runs time both collectives
    # every dimension sends fewer bytes compressed; uncompressed sends exactly fp32 on the pipeline
    assert unc["wire_per_step"]["pp"] == unc["fp32_pp_per_step"] > 0
    for d in ("pp", "tp", "dp"):
        assert 0 < full["wire_per_step"][d] < unc["wire_per_step"][d], d
    assert full["wire_per_step"]["pp"] < 0.25 * unc["wire_per_step"]["pp"]
    assert full["wire_per_step"]["dp"] < 0.3 * unc["wire_per_step"]["dp"]
    md = (out / "3d.md").read_text()
    assert data["meta"]["command"] in md and "Quick smoke-test settings" in md
    assert "| uncompressed | - |" in md and "| fully compressed | PP, TP, DP |" in md
    assert ("NO LINKS" in md) == (not data["links"]["shaped"])
    assert (out / "3d_time.png").stat().st_size > 1000
