"""`qwire bench pipeline`: the paper-regime arithmetic, a --quick end-to-end run, and --render-only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qwire.bench import pipeline as bp
from qwire.cli import main
from qwire.data import split_windows
from qwire.netlab import parse_link


def test_rate_formatting_gives_link_specs() -> None:
    assert bp._fmt_rate(9.31e6) == "9.3mbit"
    assert bp._fmt_rate(93.4e6) == "93mbit"
    assert bp._fmt_rate(934e3) == "930kbit"
    assert bp._fmt_rate(1.24e9) == "1.2gbit"
    for r in (9.31e6, 934e3, 1.24e9, 512.0):
        assert parse_link(bp._fmt_rate(r)).rate_bits_per_s == pytest.approx(r, rel=0.06)


def test_paper_regime_arithmetic() -> None:
    info = bp._paper_info()
    # GPT2-XL: 32 x 1024 x 1600 fp32 activations each way through a boundary, 5749 tokens/s of compute
    assert info["paper_boundary_bytes_per_step"] == 2 * 32 * 1024 * 1600 * 4
    r100 = bp.comm_compute_ratio(info["paper_boundary_bytes_per_step"], 100e6, info["paper_compute_step_s"])
    assert r100 == pytest.approx(5.89, abs=0.01)
    # a machine with the paper's bytes per second of compute needs the paper's rates; 10x fewer bytes: 10x slower
    same = {**info, "boundary_bytes_per_step": info["paper_boundary_bytes_per_step"],
            "compute_step_s": info["paper_compute_step_s"]}
    assert bp.paper_equivalent(100e6, same) == pytest.approx(100e6)
    tenth = {**same, "boundary_bytes_per_step": same["boundary_bytes_per_step"] / 10}
    rate = bp.paper_equivalent(100e6, tenth)
    assert rate == pytest.approx(10e6)
    assert bp.comm_compute_ratio(tenth["boundary_bytes_per_step"], rate, tenth["compute_step_s"]) == pytest.approx(r100)


@pytest.mark.parametrize("steps,batch,epochs,whole", [(300, 8, 4.0, True), (240, 8, 3.0, True),
                                                      (100, 16, 3.5, True), (8, 4, 4.0, False)])
def test_convergence_corpus_cap_gives_the_epochs(steps: int, batch: int, epochs: float, whole: bool) -> None:
    seq = 128
    n_windows = bp.conv_max_tokens(steps, batch, epochs, seq) // (seq + 1)
    train, val = split_windows(n_windows, 0.05)
    assert len(val) >= batch  # at least one validation batch (which can make the training set larger)
    if whole:  # the training set is whole batches and the steps make at least `epochs` epochs
        assert len(train) % batch == 0
        assert steps / (len(train) // batch) >= epochs


@pytest.fixture(scope="module")
def data_cache() -> str:
    """The tokenizer and tokens of this module's --quick runs, built before them (~10 s) in the session's
    cache (tests/conftest.py)."""
    from qwire.data import build_datasets

    path = os.environ["QWIRE_CACHE"]
    q = bp.QUICK
    build_datasets(corpus="stdlib", seq_len=q["seq_len"], vocab_size=q["vocab_size"], max_tokens=q["max_tokens"],
                   cache_dir=path)
    return path


def _bytes_per_step(row_or_summary: dict, steps: int | None = None) -> float:
    if steps is None:
        return row_or_summary["wire_bytes_fwd_per_step"] + row_or_summary["wire_bytes_bwd_per_step"]
    return (row_or_summary["wire_bytes_fwd"] + row_or_summary["wire_bytes_bwd"]) / steps


@pytest.mark.slow
def test_quick_pipeline_bench_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_cache: str) -> None:
    """Throughput and convergence on tiny settings with the simulated link: 4 throughput runs (2 methods x
    none and the paper's 100 Mbps regime) and 2 convergence runs (the robustness part: the next test)."""
    monkeypatch.setenv("QWIRE_CACHE", data_cache)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    rc = main(["bench", "pipeline", "--quick", "--rates", "none,paper:100mbps", "--methods", "fp32,tahquant",
               "--conv-methods", "fp16,int4", "--skip-robustness", "--link-options", "mode=sim",
               "--out", str(out), "--runs", str(tmp_path / "runs")])
    assert rc == 0
    data = json.loads((out / "pipeline.json").read_text())
    assert {"meta", "methods", "paper", "throughput", "convergence"} <= set(data) and "robustness" not in data
    assert data["meta"]["command"].startswith("qwire bench pipeline") and " --quick" in data["meta"]["command"]

    tp = data["throughput"]
    rows = {(r["token"], r["method"]): r for r in tp["runs"]}
    assert set(rows) == {(t, m) for t in ("none", "paper:100mbps") for m in ("fp32", "tahquant")}
    assert not any(r.get("error") for r in rows.values())
    paper_link = next(lk for lk in tp["links"] if lk["token"] == "paper:100mbps")
    assert paper_link["link"].endswith(",mode=sim") and paper_link["rate_bits_per_s"] > 0
    assert rows[("paper:100mbps", "fp32")]["link_mode"] == "simulated"
    assert tp["regime"]["compute_step_s"] > 0 and tp["regime"]["boundary_bytes_per_step"] > 0
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["command"].startswith("qwire train")

    # bytes on the wire per step (the same shapes everywhere): fp16 < fp32, int4 and tahquant < fp16
    conv = data["convergence"]
    steps = conv["steps"]
    assert conv["seeds"] == [0]  # --quick: one seed
    assert [(r["method"], r["seed"]) for r in conv["runs"]] == [("fp16", 0), ("int4", 0)]
    conv = {**conv, "runs": {r["method"]: r for r in conv["runs"]}}
    fp32 = _bytes_per_step(rows[("none", "fp32")])
    tah = _bytes_per_step(rows[("none", "tahquant")])
    fp16 = _bytes_per_step(conv["runs"]["fp16"]["summary"], steps)
    int4 = _bytes_per_step(conv["runs"]["int4"]["summary"], steps)
    assert fp32 == rows[("none", "fp32")]["fp32_bytes_per_step"]
    assert fp16 < fp32 and int4 < fp16 and tah < fp16
    assert _bytes_per_step(rows[("paper:100mbps", "tahquant")]) == tah  # the link does not change the bytes
    for m in ("fp16", "int4"):
        r = conv["runs"][m]
        assert r["curve"] and r["val"] and r["summary"]["steps"] == steps

    md = (out / "pipeline.md").read_text()
    for heading in ("## Summary", "## Throughput over rate-limited links", "## The paper's regime",
                    "## Convergence"):
        assert heading in md
    assert "## Robustness" not in md and "One run per method (seed 0)" in md
    assert data["meta"]["command"] in md and "| none (compute only) |" in md
    assert "(= paper 100 Mbps)" in md and "751 / 3,310 / 4,045" in md
    for png in ("pipeline_throughput.png", "pipeline_loss.png"):
        assert (out / png).stat().st_size > 1000


@pytest.mark.slow
def test_quick_robustness_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_cache: str) -> None:
    """The default training over a delayed, lossy (simulated) link and without a link: the same losses."""
    monkeypatch.setenv("QWIRE_CACHE", data_cache)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    rc = main(["bench", "pipeline", "--quick", "--skip-throughput", "--skip-convergence", "--robust-steps", "2",
               "--link-options", "mode=sim", "--out", str(out), "--runs", str(tmp_path / "runs")])
    assert rc == 0
    data = json.loads((out / "pipeline.json").read_text())
    assert "throughput" not in data and "convergence" not in data
    rob = data["robustness"]
    assert rob["ran"] == "100mbit,delay=50ms,loss=1%,mode=sim" and rob["completed"]
    assert rob["verdict"] == "identical"  # same seed and data: the link changes only when bytes arrive
    assert rob["link_mode"] == "simulated" and rob["loss_part"].startswith("ignored")
    md = (out / "pipeline.md").read_text()
    assert "## Robustness" in md and "**identical**" in md and "## Throughput" not in md


def _synthetic() -> dict:
    """A small result as the benchmark writes it: 3 links x 5 methods, convergence, robustness."""
    info = bp._paper_info()
    methods = list(bp.METHODS)
    fwd = {"fp32": 1_048_576, "fp16": 524_288, "int4": 147_000, "aqsgd": 147_100, "tahquant": 142_000}
    bwd = {"fp32": 1_048_576, "fp16": 524_288, "int4": 264_000, "aqsgd": 264_000, "tahquant": 199_000}
    compute = {"fp32": 0.30, "fp16": 0.31, "int4": 0.33, "aqsgd": 0.36, "tahquant": 0.40}
    links = [{"token": "none", "link": "", "paper_mbps": None},
             {"token": "1gbit", "link": "1gbit", "paper_mbps": None},
             {"token": "paper:100mbps", "link": "9.3mbit", "paper_mbps": 100.0, "rate_bits_per_s": 9.3e6}]
    runs = []
    for lk in links:
        rate = parse_link(lk["link"]).rate_bits_per_s if lk["link"] else None
        for m in methods:
            step = compute[m] + ((fwd[m] + bwd[m]) * 8 / rate if rate else 0.0)
            runs.append({"method": m, "token": lk["token"], "link": lk["link"] or "none",
                         "paper_mbps": lk["paper_mbps"], "repeat": 0, "fwd_codec": bp.METHODS[m][1],
                         "bwd_codec": bp.METHODS[m][2], "run_dir": f"runs/x/{m}", "command": "qwire train ...",
                         "wall_s": 10.0, "tokens_per_s": 1024 / step, "step_s_median": step, "steps_counted": 9,
                         "tokens_per_step": 1024, "wire_bytes_fwd_per_step": fwd[m],
                         "wire_bytes_bwd_per_step": bwd[m], "fp32_bytes_per_step": 2_097_152,
                         "link_mode": "lab" if rate else "none"})
    runs[-1] = {**runs[-1], "error": "TrainError: rank 1 failed (exit code 1)"}
    regime = {"compute_step_s": 0.30, "compute_tokens_per_s": 1024 / 0.30, "tokens_per_step": 1024,
              "boundary_bytes_per_step": 2_097_152, **info}

    def conv_run(m: str, val: float) -> dict:
        s = {"steps": 300, "final_loss": val - 0.1, "val_loss": val, "tokens_per_s": 3000.0,
             "wire_bytes_fwd": 300.0 * fwd[m], "wire_bytes_bwd": 300.0 * bwd[m], "fp32_bytes": 300.0 * 2_097_152}
        if m == "aqsgd":
            s.update(aqsgd_cache_bytes=157_286_400, aqsgd_cache_bytes_per_sample=65_536, aqsgd_cached_samples=600)
        return {"fwd_codec": bp.METHODS[m][1], "bwd_codec": bp.METHODS[m][2], "run_dir": f"runs/c/{m}",
                "command": "qwire train ...", "wall_s": 100.0, "summary": s,
                "curve": [[i, 8.0 - i / 60] for i in range(1, 301)], "val": [[i, 8.0 - i / 55] for i in (150, 300)]}

    return {
        "meta": {"command": "qwire bench pipeline", "machine": "x86_64, 2 CPU cores, Linux", "torch": "2.x",
                 "network_lab": "available", "load_average_start": [1.0, 1.0, 1.0],
                 "load_average_end": [1.5, 1.2, 1.0], "duration_s": 1500.0, "quick": False},
        "paper": info,
        "methods": {m: dict(zip(("label", "fwd_codec", "bwd_codec"), bp.METHODS[m])) for m in methods},
        "throughput": {"steps": 12, "skip": 3, "repeat": 1, "methods": methods, "links": links, "regime": regime,
                       "settings": {"stages": 2, "batch_size": 8, "microbatches": 4, "seq_len": 128,
                                    "model": "llama-tiny", "seed": 0}, "runs": runs},
        "convergence": {"steps": 300, "eval_every": 30, "epochs": 4.0,
                        "settings": {"stages": 2, "batch_size": 8, "microbatches": 4, "seq_len": 128,
                                     "model": "llama-tiny", "seed": 0, "max_tokens": 81_528},
                        "data": {"max_tokens": 81_528, "n_train": 600, "n_val": 32, "corpus": "stdlib"},
                        "runs": {"fp32": conv_run("fp32", 5.30), "aqsgd": conv_run("aqsgd", 5.32),
                                 "tahquant": conv_run("tahquant", 5.35),
                                 "int4": {"fwd_codec": "int4", "bwd_codec": "perchannel8", "run_dir": "runs/c/int4",
                                          "command": "qwire train ...", "wall_s": 3.0, "error": "TrainError: boom"}}},
        "robustness": {"steps": 100, "wanted_link": "100mbit,delay=50ms,loss=1%",
                       "settings": {"stages": 4, "fwd_codec": "tahquant", "bwd_codec": "perchannel6", "batch_size": 8,
                                    "microbatches": 4, "seq_len": 128, "steps": 100},
                       "attempts": [{"link": "100mbit,delay=50ms,loss=1%,mode=lab", "run_dir": "runs/r/link-0",
                                     "command": "qwire train ...", "wall_s": 150.0, "link_mode": "lab+simulated-delay",
                                     "summary": {"tokens_per_s": 800.0, "val_loss": 5.9, "steps": 100}}],
                       "baseline": {"link": "none", "summary": {"tokens_per_s": 1200.0, "val_loss": 5.9}},
                       "ran": "100mbit,delay=50ms,loss=1%,mode=lab", "link_mode": "lab+simulated-delay",
                       "steps_compared": 100, "max_abs_train_loss_diff": 0.0, "val_loss_link": 5.9,
                       "val_loss_nolink": 5.9, "val_loss_rel_diff": 0.0, "completed": True, "verdict": "identical",
                       "shaping": {"rate": "tbf", "delay": "simulated", "loss": "nft"},
                       "loss_part": "applied (by nft)"},
    }


def test_render_only_from_synthetic_json(tmp_path: Path) -> None:
    (tmp_path / "pipeline.json").write_text(json.dumps(_synthetic()))
    assert main(["bench", "pipeline", "--render-only", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "pipeline.md").read_text()
    assert "| 9.3mbit (= paper 100 Mbps) |" in md and "| none (compute only) |" in md
    tokens = md.split("**Tokens/s**")[1].split("**Speedup over FP32")[0]
    assert tokens.count("failed") == 1  # the failed TAH-Quant run at 9.3mbit
    # speedups come from the same link's runs: at 1gbit AQ-SGD (0.36 + 0.003 s) vs FP32 (0.30 + 0.017 s)
    speed = md.split("**Speedup over FP32 (same link)**")[1].split("**Speedup over AQ-SGD")[0]
    row_1g = next(ln for ln in speed.splitlines() if ln.startswith("| 1gbit |"))
    expect = (0.30 + 2_097_152 * 8 / 1e9) / (0.36 + 411_100 * 8 / 1e9)
    assert f"{expect:.2f}x" in row_1g
    assert "## The paper's regime" in md and "| 100 Mbps | 9.3mbit | 5.89 |" in md
    assert "failed: TrainError: boom" in md  # the failed convergence run is shown, not dropped
    assert "157.3 MB" in md and "45.9 GB per 1,000 training samples" in md
    assert "**identical**" in md and "applied (by nft)" in md
    assert (tmp_path / "pipeline_throughput.png").stat().st_size > 1000
    assert (tmp_path / "pipeline_loss.png").stat().st_size > 1000


def test_render_only_without_json_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "pipeline", "--render-only", "--out", str(tmp_path)]) == 2
    assert "run the benchmark first" in capsys.readouterr().err


def test_paper_links_need_the_ceiling(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "pipeline", "--rates", "paper:100mbps", "--skip-convergence", "--skip-robustness"]) == 2
    assert "give none in --rates and fp32 in --methods" in capsys.readouterr().err
    assert main(["bench", "pipeline", "--methods", "fp32,nope"]) == 2


def _conv_result(vals: dict[str, list[float]], seeds: list[int], ablations: dict[str, list[float]] | None = None,
                 ablation_seeds: list[int] | None = None) -> dict:
    """A convergence section with one run per method and seed (final validation losses ``vals[m][i]`` at
    ``seeds[i]``), as the benchmark writes it."""
    def run(m: str, seed: int, val: float) -> dict:
        s = {"steps": 300, "final_loss": val - 0.2, "val_loss": val, "wire_bytes_fwd": 3e7, "wire_bytes_bwd": 6e7,
             "fp32_bytes": 6.29e8}
        fwd, bwd = bp.ALL_METHODS[m][1:]
        return {"method": m, "seed": seed, "fwd_codec": fwd, "bwd_codec": bwd, "config_key": f"{m}/{seed}",
                "run_dir": f"runs/c/{m}-s{seed}", "command": "qwire train ...", "wall_s": 100.0, "summary": s,
                "final_loss": s["final_loss"], "val_loss": val,
                "curve": [[i, 8.0 - i / 60 + seed * 0.01] for i in range(1, 301)],
                "val": [[i, val + (300 - i) / 100] for i in (30, 150, 300)]}
    runs = [run(m, x, v[i]) for x_i, x in enumerate(seeds) for m, v in vals.items() for i in [x_i]]
    for m, v in (ablations or {}).items():
        runs += [run(m, x, v[i]) for i, x in enumerate(ablation_seeds or seeds[:1])]
    return {"steps": 300, "eval_every": 30, "epochs": 4.0, "seeds": seeds, "methods": list(vals),
            "ablations": list(ablations or {}), "ablation_seeds": ablation_seeds or seeds[:1],
            "settings": {"stages": 2, "batch_size": 8, "microbatches": 4, "seq_len": 128, "model": "llama-tiny",
                         "seed": 0, "max_tokens": 81_528},
            "data": {"max_tokens": 81_528, "n_train": 600, "n_val": 32, "corpus": "stdlib"}, "runs": runs,
            "command": "qwire bench pipeline --only convergence", "machine": "x86_64, 2 CPU cores, Linux",
            "torch": "2.x", "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [1.0, 1.0, 1.0],
            "duration_s": 3000.0}


def test_convergence_stats_mean_spread_and_paired_gaps() -> None:
    conv = _conv_result({"fp32": [3.70, 3.80, 3.60], "tahquant": [3.74, 3.83, 3.65], "fp16": [3.69, 3.82, 3.60]},
                        [0, 1, 2])
    st = bp.convergence_stats(conv["runs"])
    assert st["fp32"]["val_loss"]["mean"] == pytest.approx(3.70)
    assert st["fp32"]["val_loss"]["std"] == pytest.approx(0.1)
    assert (st["tahquant"]["val_loss"]["min"], st["tahquant"]["val_loss"]["max"]) == (3.65, 3.83)
    assert st["tahquant"]["gap_of_means_pct"] == pytest.approx((3.74 / 3.70 - 1) * 100)
    gaps = [3.74 / 3.70 - 1, 3.83 / 3.80 - 1, 3.65 / 3.60 - 1]
    assert st["tahquant"]["paired_gap_pct"]["1"] == pytest.approx(gaps[1] * 100)
    p = st["tahquant"]["paired"]
    assert p["mean"] == pytest.approx(sum(gaps) / 3 * 100)
    import statistics
    assert p["ci95"] == pytest.approx(4.303 * statistics.stdev(g * 100 for g in gaps) / 3 ** 0.5)
    assert "paired" not in st["fp32"]
    # the gap of the means (1.1%) is within the spread (FP32's range: 5.4%), but every seed's paired gap is
    # positive and their interval excludes zero: the pairing sees what the spread hides
    v = bp.gap_verdict(st, "tahquant")
    assert not v["larger_than_spread"] and v["paired_same_sign"] and v["paired_ci_excludes_zero"]
    tight = bp.convergence_stats(_conv_result({"fp32": [3.70, 3.71, 3.70], "tahquant": [3.80, 3.81, 3.79]},
                                              [0, 1, 2])["runs"])
    assert bp.gap_verdict(tight, "tahquant")["larger_than_spread"]
    one = bp.convergence_stats(_conv_result({"fp32": [3.7], "tahquant": [3.8]}, [0])["runs"])
    assert bp.gap_verdict(one, "tahquant") is None and one["tahquant"]["paired"]["ci95"] is None
    # a failed run counts nowhere; a seed without FP32 has no paired gap
    runs = conv["runs"] + [{"method": "int4", "seed": 0, "error": "TrainError: boom"}]
    runs = [r for r in runs if not (r["method"] == "fp32" and r["seed"] == 2)]
    st = bp.convergence_stats(runs)
    assert "int4" not in st and set(st["tahquant"]["paired_gap_pct"]) == {"0", "1"}


def test_render_multi_seed_convergence(tmp_path: Path) -> None:
    data = _synthetic()
    data["convergence"] = _conv_result(
        {"fp32": [3.70, 3.71, 3.70], "fp16": [3.71, 3.70, 3.70], "tahquant": [3.80, 3.81, 3.79]}, [0, 1, 2],
        ablations={"tah-bwd8": [3.75], "tah-ratio1": [3.72]})
    data["convergence"]["runs"][0].update(reused=True, machine=data["convergence"]["machine"],
                                          torch=data["convergence"]["torch"])
    (tmp_path / "pipeline.json").write_text(json.dumps(data))
    assert main(["bench", "pipeline", "--render-only", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "pipeline.md").read_text()
    conv = md.split("## Convergence")[1].split("## Robustness")[0]
    assert "Command: `qwire bench pipeline --only convergence`" in conv and "(1 run reused" in conv
    assert "of them on" not in conv  # reused from this invocation's machine: nothing more to say
    # runs reused from another machine, or from before runs recorded theirs, are named on the header line
    here = data["convergence"]["machine"]
    for r, where in zip(data["convergence"]["runs"], ({"machine": "CPU B", "torch": "2.13.0"}, {}, {}, {})):
        r.update({"reused": True, "machine": here, "torch": data["convergence"]["torch"], **where})
    del data["convergence"]["runs"][1]["machine"]
    (tmp_path / "pipeline.json").write_text(json.dumps(data))
    assert main(["bench", "pipeline", "--render-only", "--out", str(tmp_path)]) == 0
    conv2 = (tmp_path / "pipeline.md").read_text().split("## Convergence")[1]
    assert ("(4 runs reused from an earlier invocation with the same configuration; 1 of them on CPU B, torch 2.13.0; "
            "1 of them on a machine not recorded)") in conv2
    data["convergence"]["command"] = data["meta"]["command"]  # one invocation: the page's header is the runs'
    (tmp_path / "pipeline.json").write_text(json.dumps(data))
    assert main(["bench", "pipeline", "--render-only", "--out", str(tmp_path)]) == 0
    conv3 = (tmp_path / "pipeline.md").read_text().split("## Convergence")[1]
    assert "Command:" not in conv3 and ("Not trained by this invocation: 4 runs reused from an earlier invocation "
                                        "with the same configuration; 1 of them on CPU B") in conv3
    assert "3 runs per method (seeds 0, 1, 2)" in conv
    row = next(ln for ln in conv.splitlines() if ln.startswith("| TAH-Quant |"))
    assert "| 3 | 3.8000 +- 0.0100 | 3.7900-3.8100 |" in row
    assert f"{(3.80 / (11.11 / 3) - 1) * 100:+.2f}%" in row  # mean vs FP32's mean
    assert f"{(3.81 / 3.71 - 1) * 100:+.2f}%" in row  # the paired gap at seed 1
    assert "**larger than the seed-to-seed spread**" in conv and "the same sign on every seed" in conv
    assert "for scale, FP16, a cast that loses almost nothing, is +0.00% from FP32" in conv
    assert "**larger than the seed-to-seed spread**" in md.split("## Summary")[1].split("##")[0]
    abl = conv.split("### TAH-Quant ablation")[1]
    row = next(ln for ln in abl.splitlines() if ln.startswith("| TAH-Quant, backward 8-bit |"))
    assert f"{(3.75 / 3.80 - 1) * 100:+.2f}%" in row and f"{(3.75 / 3.70 - 1) * 100:+.2f}%" in row
    assert "## Throughput over rate-limited links" in md  # the other sections render as before
    assert (tmp_path / "pipeline_loss.png").stat().st_size > 1000


def test_config_key_tells_configurations_apart() -> None:
    from qwire.train import TrainConfig

    a = TrainConfig(fwd_codec="tahquant", bwd_codec="perchannel6", steps=300, seed=1, out="runs/a", log_every=30)
    assert bp.conv_config_key(a) == bp.conv_config_key(TrainConfig(**{**a.__dict__, "out": "runs/b",
                                                                      "log_every": 7}))
    for change in ({"seed": 2}, {"steps": 301}, {"fwd_codec": "tahquant:ratio=0.8"}, {"max_tokens": 1000}):
        assert bp.conv_config_key(a) != bp.conv_config_key(TrainConfig(**{**a.__dict__, **change}))
    # the transport does not change the numbers (runs made before --backend existed stay reusable)
    assert bp.conv_config_key(a) == bp.conv_config_key(TrainConfig(**{**a.__dict__, "backend": "gloo"}))
    # codecs are compared as resolved specs: a default spelled out is the same configuration
    full = bp.conv_config_key(TrainConfig(**{**a.__dict__, "bwd_codec": "perchannel:bits=6"}))
    assert full == bp.conv_config_key(a)
    # a run made before a setting existed (its key lacks it) is the same run while the setting is at its default
    older = json.loads(bp.conv_config_key(a))
    del older["codec_graphs"], older["outer_lr"]
    assert bp.same_run(json.dumps(older)) == bp.same_run(bp.conv_config_key(a))
    changed = TrainConfig(**{**a.__dict__, "codec_graphs": True})
    assert bp.same_run(json.dumps(older)) != bp.same_run(bp.conv_config_key(changed))
    assert bp.same_run(bp.conv_config_key(a)) != bp.same_run(bp.conv_config_key(TrainConfig(**{**a.__dict__,
                                                                                               "seed": 2})))


def test_bad_seeds_and_ablations_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "pipeline", "--seeds", "0,x"]) == 2
    assert "--seeds takes comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "pipeline", "--ablations", "tah-nope"]) == 2
    assert "unknown ablation" in capsys.readouterr().err


def _earlier_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_cache: str) -> tuple[Path, dict]:
    """An --out folder holding a complete earlier result (the synthetic one), for the --only runs to merge into."""
    monkeypatch.setenv("QWIRE_CACHE", data_cache)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    old = _synthetic()
    (out / "pipeline.json").write_text(json.dumps(old))
    return out, old


@pytest.mark.slow
def test_only_convergence_merges_and_resume_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   data_cache: str) -> None:
    """--only convergence replaces the convergence section of an existing result and keeps the rest; --resume
    trains only the runs whose configuration is not in it."""
    out, old = _earlier_result(tmp_path, monkeypatch, data_cache)
    common = ["bench", "pipeline", "--quick", "--only", "convergence", "--conv-methods", "fp32,tahquant",
              "--conv-steps", "2", "--out", str(out), "--runs", str(tmp_path / "runs")]
    assert main([*common, "--seeds", "0,1"]) == 0
    data = json.loads((out / "pipeline.json").read_text())
    assert data["throughput"] == old["throughput"] and data["robustness"] == old["robustness"]
    assert data["meta"] == old["meta"]
    conv = data["convergence"]
    assert [(r["method"], r["seed"]) for r in conv["runs"]] == [("fp32", 0), ("tahquant", 0), ("fp32", 1),
                                                                ("tahquant", 1)]
    assert not any(r.get("reused") or r.get("error") for r in conv["runs"])
    assert all(r["machine"] == conv["machine"] and r["torch"] == conv["torch"] for r in conv["runs"])  # where it ran
    assert "--only convergence" in conv["command"] and "partial" not in conv
    assert set(conv["stats"]) == {"fp32", "tahquant"} and conv["stats"]["tahquant"]["paired"]["n"] == 2
    md = (out / "pipeline.md").read_text()
    assert "## Throughput over rate-limited links" in md and "2 runs per method (seeds 0, 1)" in md

    assert main([*common, "--seeds", "0,1", "--resume", "--ablations", "tah-bwd8"]) == 0
    conv2 = json.loads((out / "pipeline.json").read_text())["convergence"]
    assert [r.get("reused", False) for r in conv2["runs"]] == [True] * 4 + [False]
    assert [r["val_loss"] for r in conv2["runs"][:4]] == [r["val_loss"] for r in conv["runs"]]
    assert conv2["runs"][4]["method"] == "tah-bwd8" and conv2["runs"][4]["seed"] == 0
    assert "### TAH-Quant ablation" in (out / "pipeline.md").read_text()

    # an interrupted --resume keeps the earlier runs it had not reused yet: the next --resume still finds them
    import qwire.bench.pipeline as bpm

    real = bpm._train
    calls = []

    def stop_at_first_training(cfg):
        calls.append(cfg.seed)
        raise KeyboardInterrupt

    monkeypatch.setattr(bpm, "_train", stop_at_first_training)
    # seed 0 reused (saved as it goes), then seed 2 must train: Ctrl-C there ends the bench in one line
    assert main([*common, "--seeds", "0,2", "--resume", "--ablations", "tah-bwd8"]) == 130
    assert json.loads((out / "pipeline.json").read_text())["convergence"] == conv2  # the complete result stays
    part = json.loads((out / "pipeline.partial.json").read_text())["convergence"]
    assert part["partial"] and calls == [2] and [r["seed"] for r in part["runs"]] == [0, 0]
    assert sorted((r["method"], r["seed"]) for r in part["runs"] + part["earlier_runs"]) == sorted(
        (r["method"], r["seed"]) for r in conv2["runs"])
    monkeypatch.setattr(bpm, "_train", real)
    assert main([*common, "--seeds", "0,1", "--resume", "--ablations", "tah-bwd8"]) == 0
    conv3 = json.loads((out / "pipeline.json").read_text())["convergence"]
    assert all(r.get("reused") for r in conv3["runs"]) and "earlier_runs" not in conv3
    assert not (out / "pipeline.partial.json").exists()
    # the resume command docs/codecs.md gives (no --only): the sections it skips stay as measured (they were dropped)
    whole = [a for a in common if a not in ("--only", "convergence")]
    assert main([*whole, "--seeds", "0,1", "--resume", "--ablations", "tah-bwd8", "--skip-throughput",
                 "--skip-robustness"]) == 0
    data = json.loads((out / "pipeline.json").read_text())
    assert data["throughput"] == old["throughput"] and data["robustness"] == old["robustness"]
    assert all(r.get("reused") for r in data["convergence"]["runs"])


def test_device_cuda_without_a_gpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/test_cuda.py covers the GPU runs")
    assert main(["bench", "pipeline", "--device", "cuda", "--quick"]) == 2
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_only_robustness_replaces_its_section_and_keeps_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 data_cache: str) -> None:
    out, old = _earlier_result(tmp_path, monkeypatch, data_cache)
    assert main(["bench", "pipeline", "--quick", "--only", "robustness", "--robust-steps", "2", "--link-options",
                 "mode=sim", "--out", str(out), "--runs", str(tmp_path / "runs")]) == 0
    data = json.loads((out / "pipeline.json").read_text())
    assert data["throughput"] == old["throughput"] and data["convergence"] == old["convergence"]
    assert data["meta"] == old["meta"]
    rob = data["robustness"]
    assert rob != old["robustness"] and rob["verdict"] == "identical" and rob["steps"] == 2
    assert "--only robustness" in rob["command"]
    md = (out / "pipeline.md").read_text()
    assert "## Throughput over rate-limited links" in md and f"This section: `{rob['command']}`" in md


def test_previous_default_spelled_as_the_codec_module_does() -> None:
    from qwire.codecs import get_codec
    from qwire.codecs.tahquant import ADAPTIVE, LOG7_DEFAULT, MINMAX_DEFAULT, PREDICTED, PREVIOUS_DEFAULT, ROTATED_FIT

    assert bp._PREV == PREVIOUS_DEFAULT
    assert bp.ABLATIONS["tah-prev"][1] == PREVIOUS_DEFAULT
    assert bp.ABLATIONS["tah-minmax"][1] == MINMAX_DEFAULT
    # the runs of the defaults made before the fit and fit_rotated parameters existed are reused by --resume
    assert bp.ABLATIONS["tah-fitrot"][1] == ROTATED_FIT and bp.ABLATIONS["tah-adapt"][1] == ADAPTIVE
    assert bp.ABLATIONS["tah-predict"][1] == PREDICTED and bp.ABLATIONS["tah-log7"][1] == LOG7_DEFAULT
    assert "fit=" not in get_codec(MINMAX_DEFAULT).spec_key() and "fit=" not in get_codec(PREVIOUS_DEFAULT).spec_key()
    for spec in (MINMAX_DEFAULT, PREVIOUS_DEFAULT, LOG7_DEFAULT, "tahquant:layout=log7,fit=minmax,fit_rotated=true"):
        assert "fit_rotated" not in get_codec(spec).spec_key(), spec  # (no difference where nothing is searched)
        assert "zero_width" not in get_codec(spec).spec_key(), spec  # (nor per-block widths where not per block)
    assert get_codec(ROTATED_FIT).spec_key() == get_codec(LOG7_DEFAULT).spec_key() + ",fit_rotated=true"
    # the default before log6t keeps the key its runs were stored under (before the parameters existed)
    old = ("tahquant:tile=32,high_bits=4,low_bits=3,ratio=1.0,tau=2.5,unit=tile,alloc=range,rotate=true,"
           "max_rotated=0.175,rounding=nearest,seed=0,layout=log7,zero_ext=9,slots=tile,fit=mse")
    assert get_codec(LOG7_DEFAULT).spec_key() == old and get_codec("tahquant").spec_key() != old
