"""qwire bench codecs --device cuda (qwire.bench.gpu): its measurements and page, run on the CPU here; the
command itself refuses clearly where there is no GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qwire.bench import gpu


def test_measurements_and_page_on_the_cpu() -> None:
    tp = gpu.device_throughput(["int4", "fp16"], [0.25], repeat=1, device="cpu", inner=1, log=lambda *a: None)
    assert [(r["name"], r["mb"]) for r in tp] == [("int4", 0.25), ("fp16", 0.25)]
    int4 = tp[0]
    assert int4["impl"] in ("cpu", "torch") and int4["payload_bytes"] < 0.25 * 2 ** 20 / 4
    assert all(r["copy_gbs"] > 0 and r["roundtrip_vs_copy"] > 0 for r in tp)
    share = gpu.stage_share(["int4"], layers=1, device="cpu", repeat=1, shape=(1, 16, 64), heads=4,
                            dtype=torch.float32, log=lambda *a: None)
    row = share["rows"][0]
    assert share["stage_s"] > 0 and row["share"] == pytest.approx(row["codec_s"] / share["stage_s"])
    assert row["plain_s"] > 0 and row["in_step_share"] == pytest.approx(row["in_step_s"] / row["plain_s"])
    t = gpu.targets(tp, share)
    names = [x["target"] for x in t]
    assert any("`int4`" in n and "16 MB" in n for n in names)
    assert next(x for x in t if "`int4`" in x["target"] and "copy" in x["target"])["measured"] == "-"  # no 16 MB size
    res = {"meta": {"command": "qwire bench codecs --device cuda", "machine": "m", "date": "d", "seconds": 1},
           "versions": gpu.versions(), "throughput": tp, "stage": share, "targets": t}
    md = gpu.markdown(res)
    assert "qwire bench codecs --device cuda" in md and "## Targets" in md and "`int4`" in md
    assert f"torch {torch.__version__}" in md and "in the step, share" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_device_cuda_without_a_gpu_says_so(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-m", "qwire", "bench", "codecs", "--device", "cuda", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "needs a CUDA GPU" in (res.stdout + res.stderr)
    assert not (tmp_path / "gpu.json").exists()
