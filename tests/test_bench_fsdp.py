"""`qwire bench fsdp`: the step-time and loss arithmetic, the markdown against the targets, and a --quick run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwire.bench import fsdp
from qwire.cli import main


def _metrics(path: Path, step_s: list[float], dp: int, grad: int = 0, param: int = 0, state: int = 1000) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with (path / "metrics.jsonl").open("w") as f:
        for i, s in enumerate(step_s, 1):
            f.write(json.dumps({"step": i, "loss": 5.0, "tokens": 512 * i, "step_time_s": s, "wire_bytes_dp": dp,
                                "wire_bytes_dp_grad": grad, "wire_bytes_dp_param": param,
                                "state_bytes_max": state + i, "max_rss_bytes": 10 * i}) + "\n")


def test_measure_and_aggregate(tmp_path: Path) -> None:
    _metrics(tmp_path / "a", [9.0, 2.0, 4.0], dp=400, grad=100, param=300)
    _metrics(tmp_path / "b", [9.0, 1.0], dp=400, grad=100, param=300)
    a = fsdp.measure(tmp_path / "a", skip=1)
    assert a["steps_counted"] == 2 and a["step_s"] == pytest.approx(3.0)
    assert a["tokens_per_s"] == pytest.approx(2 * 512 / 6.0)
    assert (a["dp_bytes"], a["dp_grad_bytes"], a["dp_param_bytes"]) == (400, 100, 300)
    assert a["state_bytes_max"] == 1003 and a["max_rss_bytes"] == 30  # the largest over all steps
    b = fsdp.measure(tmp_path / "b", skip=1)
    rows = [{"variant": "fsdp", "link": "50mbit", **a}, {"variant": "fsdp", "link": "50mbit", **b},
            {"variant": "fsdp", "link": "1gbit", "error": "boom"}]
    agg = fsdp.aggregate(rows)
    assert set(agg) == {("50mbit", "fsdp")}
    g = agg[("50mbit", "fsdp")]
    assert g["runs"] == 2 and g["steps_counted"] == 3
    assert g["step_s"] == pytest.approx(7.0 / 3)  # the counted steps of both runs pooled
    assert (g["step_s_min"], g["step_s_max"]) == pytest.approx((1.0, 3.0))


def test_losses_are_means_over_seeds() -> None:
    rows = [{"variant": "fsdp", "seed": 0, "val_loss": 4.0, "timing": {}},
            {"variant": "fsdp", "seed": 1, "val_loss": 5.0, "timing": {}},
            {"variant": "fsdp-g8w8", "seed": 0, "error": "boom"}]
    out = fsdp.losses(rows)
    assert set(out) == {"fsdp"}
    assert out["fsdp"]["mean"] == pytest.approx(4.5) and out["fsdp"]["seeds"] == [0, 1]
    assert (out["fsdp"]["min"], out["fsdp"]["max"]) == (4.0, 5.0)


def test_markdown_judges_the_targets_from_the_numbers() -> None:
    def row(v: str, link: str, step: float, dp: int) -> dict:
        return {"variant": v, "link": link, "repeat": 0, "steps_counted": 1, "step_s": step, "step_times": [step],
                "tokens_per_s": 1.0, "dp_bytes": dp, "dp_grad_bytes": 0, "dp_param_bytes": 0,
                "state_bytes_max": 1, "max_rss_bytes": 1}
    links = ["50mbit,mode=lab", "2gbit,mode=lab"]
    result = {"links": {"shaped": True}, "variants": fsdp.VARIANTS, "settings": {},
              "time": {"steps": 2, "skip": 1, "repeat": 1, "variants": ["fsdp", "fsdp-g8w8"], "rates": links,
                       "runs": [row("fsdp", links[0], 4.0, 400), row("fsdp-g8w8", links[0], 1.0, 100),
                                row("fsdp", links[1], 1.0, 400), row("fsdp-g8w8", links[1], 2.0, 100)]},
              "convergence": {"steps": 4, "seeds": 2, "variants": ["fsdp", "fsdp-g8w8"], "runs": [
                  {"variant": v, "seed": s, "val_loss": loss, "timing": {}}
                  for v, s, loss in (("fsdp", 0, 5.0), ("fsdp", 1, 5.0), ("fsdp-g8w8", 0, 5.2),
                                     ("fsdp-g8w8", 1, 5.2))]}}
    md = fsdp.markdown(result)
    assert "**4.00x fewer** (target >= 3.5x: met)" in md
    assert "**+4.00%** (target within 1%: missed)" in md
    # only the link below 1 Gbit/s counts, and there the compressed run is faster
    assert "50mbit 4.00x (target: faster on every one: met)" in md


def test_bad_arguments_fail_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fsdp", "--variants", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown variant(s) ['nope']" in capsys.readouterr().err
    assert main(["bench", "fsdp", "--links", "fast", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "fsdp.json").exists()


def test_quick_run_without_links(tmp_path: Path) -> None:
    """`--quick --no-links` runs one step-time and one loss run end to end and writes JSON, markdown and plots."""
    rc = main(["bench", "fsdp", "--quick", "--no-links", "--variants", "fsdp-g8w8", "--conv-variants",
               "ddp-quangrad-acc8", "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs")])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "fsdp.json").read_text())
    run = res["time"]["runs"][0]
    assert run["dp_grad_bytes"] > 0 and run["dp_param_bytes"] > 0
    assert run["dp_bytes"] == run["dp_grad_bytes"] + run["dp_param_bytes"]
    conv = res["convergence"]["runs"][0]
    assert 0 < conv["timing"]["grad_accum_peak_bytes"] < 0.3 * conv["timing"]["grad_accum_fp32_bytes"]
    md = (tmp_path / "out" / "fsdp.md").read_text()
    assert "NO LINKS" in md and "Command: `qwire bench fsdp " in md and "--quick --no-links" in md
    assert (tmp_path / "out" / "fsdp_time.png").exists() and (tmp_path / "out" / "fsdp_loss.png").exists()
