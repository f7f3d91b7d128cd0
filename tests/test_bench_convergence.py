"""`qwire bench convergence --quick` writes its JSON, markdown and plot."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qwire.cli import main


def test_quick_convergence_bench_writes_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rc = main(["bench", "convergence", "--quick", "--methods", "fp32,tahquant", "--steps", "3", "--eval-every", "3",
               "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs")])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "convergence.json").read_text())
    assert set(data["results"]) == {"fp32", "tahquant"}
    fp32, tah = (data["results"][m]["summary"] for m in ("fp32", "tahquant"))
    assert fp32["wire_bytes_fwd"] + fp32["wire_bytes_bwd"] == fp32["fp32_bytes"]
    assert tah["wire_bytes_fwd"] < 0.2 * fp32["wire_bytes_fwd"]  # ~4.4 of 32 bits
    md = (tmp_path / "out" / "convergence.md").read_text()
    assert "qwire bench convergence" in md and "| tahquant |" in md
    assert (tmp_path / "out" / "convergence.png").stat().st_size > 1000
    assert os.path.isdir(tmp_path / "runs")


def test_settings_a_run_would_refuse_are_refused_before_the_first_run(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """They were a ValueError traceback (and --quick kept the 300 steps of a full run)."""
    from qwire.bench.convergence import QUICK_STEPS

    assert main(["bench", "convergence", "--steps", "2", "--batch-size", "3", "--out", str(tmp_path / "out"),
                 "--runs", str(tmp_path / "runs")]) == 2
    assert "qwire bench convergence: fp32: --batch-size (3) must be a positive multiple" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
    assert 0 < QUICK_STEPS <= 50
