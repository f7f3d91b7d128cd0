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


def test_the_deferred_and_graph_ratios_with_a_graph_stand_in(monkeypatch) -> None:
    """The Triton kernels under Triton's interpreter, their graphs played by the stand-in of
    tests/test_codec_graphs.py."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels need TRITON_INTERPRET=1 on CPU tensors")
    from qwire.codecs import packing
    from qwire.codecs.kernels import gpu as triton_kernels  # noqa: F401  (the bit packing of CUDA tensors)
    from qwire.codecs.kernels import graphs
    from qwire.codecs.kernels.graphs import Rerun

    monkeypatch.setitem(packing.DEVICE_KERNELS, "cpu", packing.DEVICE_KERNELS["cuda"])
    monkeypatch.setitem(graphs.FACTORIES, "cpu", Rerun)
    Rerun.captures = Rerun.replays = 0
    tp = gpu.device_throughput(["int4:impl=triton"], [0.01], repeat=1, device="cpu", inner=2, log=lambda *a: None)
    row = tp[0]
    assert row["vs_copy_deferred"] > 0 and row["vs_copy_graphs"] > 0
    assert Rerun.captures == 2 and Rerun.replays == 2 + 2 * 2  # encode, decode: captured + replayed, 2 timed calls
    share = gpu.stage_share(["int4:impl=triton"], layers=1, device="cpu", repeat=1, shape=(1, 16, 64), heads=4,
                            dtype=torch.float32, log=lambda *a: None)
    r = share["rows"][0]
    assert r["in_step_graphs_share"] == pytest.approx(r["in_step_graphs_s"] / r["plain_s"])
    assert r["share_graphs"] == pytest.approx(r["codec_graphs_s"] / share["stage_s"]) and r["codec_graphs_s"] > 0
    t = gpu.targets(tp, share)
    ways = ("(the codecs alone)", "(the codecs alone, CUDA graphs)", "(in the step)", "(in the step, CUDA graphs)")
    stage = [x for x in t if "GPT2-XL boundary" in x["target"]]  # the best of the four ways: which one is timing
    assert len(stage) == 1 and stage[0]["measured"].endswith(ways), stage
    md = gpu.markdown({"meta": {"command": "c", "machine": "m", "date": "d", "seconds": 1},
                       "versions": gpu.versions(), "throughput": tp, "stage": share, "targets": t})
    assert "| graphs |" in md and "graphs: in the step, share" in md and "graphs: codec ms" in md
    assert graphs.enabled() is False  # the benchmark leaves graphs as it found them


def test_gpu_profile_gives_each_kernel_its_bandwidth_by_the_traffic_model(tmp_path, capsys) -> None:
    """``scripts/gpu_profile.py``: per kernel of the model, its GPU time per encode + decode and the bandwidth its
    modelled bytes make of it (a profiler's kernel name may carry a suffix); a kernel the profile lacks is named;
    and the script runs through on the CPU with a model file."""
    import importlib.util
    import json
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_profile.py"
    spec = importlib.util.spec_from_file_location("gpu_profile", path)
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    model = {"encode": {"kernels": {"_enc": {"launches": 1, "bytes_per_element": 5.0}}},
             "decode": {"kernels": {"_dec": {"launches": 1, "bytes_per_element": 5.0},
                                    "_gone": {"launches": 1, "bytes_per_element": 0.1}}}}
    # 2**20 elements, 5 B each: 5.24 MB in 10 us per call (3 pairs profiled) is 524 GB/s, half of a 1048 GB/s copy
    events = [SimpleNamespace(key="_enc", self_device_time_total=30.0),
              SimpleNamespace(key="_dec_0d1d2", self_device_time_total=30.0),
              SimpleNamespace(key="_decide", self_device_time_total=99.0)]
    # and 2**20 elements of 8 instructions each in 10 us: 8.39e11 instructions per s, a quarter of a 3.36e12 peak
    prof._kernels(events, model, 2 ** 20, 1048.576, {"_enc": 8.0, "_decide": 1.0}, 8 * 2 ** 20 / 10e-6 * 4)
    out = capsys.readouterr().out
    assert ("_enc: 1 launches, 10.0 us, 5.0 MB by the model: 524 GB/s, 50% of the copy's; 8.0 instructions per "
            "element by the model: 8.39e+11 per s, 25% of the peak") in out
    assert "_dec: 1 launches, 10.0 us, 5.0 MB by the model: 524 GB/s, 50% of the copy's\n" in out  # no issue model
    assert "_decide: 33.0 us; 1.0 instructions per element" in out  # in the issue model alone
    assert "_gone: not in the profile" in out
    issue = {"calls": [{"spec": "int4", "call": "encode", "kernels": {"direct._quant_pack": 3.0, "_fit._need": 1.0}},
                       {"spec": "int4", "call": "decode", "kernels": {"direct._quant_pack": 0.5}},
                       {"spec": "fp8", "call": "encode", "kernels": {"fp8._encode": 9.0}}]}
    assert prof._issued(issue, "int4") == {"_quant_pack": 3.5, "_need": 1.0}
    traffic = tmp_path / "traffic.json"
    traffic.write_text(json.dumps({"codecs": {"fp16": model}}))
    assert prof.main(["--device", "cpu", "--specs", "fp16", "--mb", "0.05", "--no-graphs", "--traffic",
                      str(traffic)]) == 0
    assert "fp16: encode" in capsys.readouterr().out
