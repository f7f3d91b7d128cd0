"""`qwire bench convergence --quick` writes its JSON, markdown and plot."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qwire.cli import main


def test_quick_convergence_bench_writes_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWIRE_CACHE", str(tmp_path / "cache"))
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
