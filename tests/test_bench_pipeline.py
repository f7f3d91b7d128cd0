"""`qwire bench pipeline`: the paper-regime arithmetic, a --quick end-to-end run, and --render-only."""

from __future__ import annotations

import json
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
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One tokenizer and token cache for the --quick runs of this module (built once, ~10 s)."""
    from qwire.data import build_datasets

    path = str(tmp_path_factory.mktemp("pipeline-cache"))
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
    assert "## Robustness" not in md
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
