"""``qwire bench codecs --quick`` writes its JSON and markdown (a smoke test; no timing asserts)."""

from __future__ import annotations

import json

import pytest

from qwire.bench.codecs import interp_db, measure, synthetic
from qwire.cli import main


def test_quick_bench_writes_json_and_markdown(tmp_path):
    assert main(["bench", "codecs", "--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "codecs.json").read_text())
    assert {"meta", "inputs", "quality", "ablations", "throughput", "targets"} <= set(res)
    rows = res["quality"]["outliers"]
    tah = next(r for r in rows if r["name"] == "tahquant")
    assert 4.0 < tah["bits"] <= 4.41 and tah["nmse"] > 0
    assert res["throughput"] and all(r["copy_gbs"] > 0 and r["encode_gbs"] > 0 for r in res["throughput"])
    md = (tmp_path / "codecs.md").read_text()
    assert "`qwire bench codecs --out " in md and " --quick`" in md
    assert "## Targets" in md and "| `tahquant` |" in md


def test_quick_without_out_writes_to_a_scratch_folder_not_the_published_results(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs" / "results").mkdir(parents=True)
    assert main(["bench", "codecs", "--quick"]) == 0
    assert (tmp_path / "runs" / "bench-quick" / "codecs.json").is_file()
    assert not any((tmp_path / "docs" / "results").iterdir())
    assert "writing to runs/bench-quick" in capsys.readouterr().err


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    assert main(["bench"]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in ("codecs", "convergence", "taco", "agoq", "pipeline", "3d", "fsdp", "adaptive"))
    assert main(["bench", "--help"]) == 0 and "adaptive" in capsys.readouterr().out


def test_metrics_and_interpolation():
    x = synthetic("gaussian", (4, 64, 128), 0)
    r = measure("int8", x)
    # 8 code bits + 16 metadata bits per 32-element tile + one fp32 anchor
    assert r["bits"] == pytest.approx(8.5 + 32 / x.numel(), abs=1e-4)
    assert 40 < r["snr_db"] < 50 and r["rd_gap_db"] > 0  # a scalar quantizer sits above the bound
    assert interp_db([(3.0, -10.0), (4.0, -16.0)], 3.5) == -13.0
    assert interp_db([(3.0, -10.0), (4.0, -16.0)], 4.5) is None
