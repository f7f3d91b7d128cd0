"""Where a codec's time goes on a GPU: host work, kernel launches and host syncs per encode + decode.

Usage (on a GPU machine): ``python scripts/gpu_profile.py [--specs int4,tahquant,fp8] [--mb 16] [--out DIR]``

First the cost of one host sync (a ``bool()`` of a 4-element reduction, the device otherwise idle). For each
codec spec: the wall time of one encode and of one decode (10 back-to-back calls, synchronized after
them), then torch.profiler over 3 encode + decode pairs: per pair, the host time, the GPU kernel time, the
kernel launches, the host syncs (``cudaStreamSynchronize``) and the copies (``cudaMemcpyAsync``: a device-to-host
copy, or a host-to-device one from pageable memory, waits for the GPU too). Each codec is measured twice: as
it runs by default, and with its kernels in CUDA graphs (``+graphs``: :mod:`qwire.codecs.kernels.graphs`; a
graph replay counts as one launch, ``cudaGraphLaunch``). With ``--out``, the profiler's tables go to
``DIR/prof_<spec>.txt``.

Per Triton kernel (without graphs): its GPU time per call and, from the bytes it moves by the model of
``--traffic`` (default ``docs/results/traffic.json``, written by ``python scripts/gpu_op_count.py --traffic
--json``), the bandwidth it reached, as a share of a device copy's (``y.copy_(x)`` of the same input, timed in
the same run): a kernel far under the copy's bandwidth is slow for another reason than its bytes. And from the
instructions per element it issues by the model of ``--issue`` (default ``docs/results/issue.json``, written by
``python scripts/compile_for_gpu.py --issue --json``), the rate it issued them at, as a share of the GPU's peak
(its multiprocessors x 4 schedulers x one warp instruction per clock, at the clock the model assumed): a kernel
near that peak is bound by its instructions, not by memory.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from qwire.codecs import get_codec
from qwire.codecs.kernels import graphs

PAIRS = 3
TRAFFIC = Path(__file__).resolve().parent.parent / "docs" / "results" / "traffic.json"
ISSUE = Path(__file__).resolve().parent.parent / "docs" / "results" / "issue.json"


def _copy_gbs(x: torch.Tensor) -> float:
    """GB/s read and written by ``y.copy_(x)`` on the device: the best of 5 runs of 10 copies."""
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            y.copy_(x)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 10 / 1e3)
    return 2 * x.numel() * x.element_size() / best / 1e9


def _kernels(events, model: dict, numel: int, copy_gbs: float, issued: dict[str, float] | None = None,
             peak: float = 0.0) -> None:
    """Per Triton kernel of the models: launches and GPU time per encode + decode, the bandwidth its modelled
    bytes make of that time, and (``issued``: instructions per element by kernel name; ``peak``: the GPU's
    instructions per second at full issue) the rate its modelled instructions make of it."""
    per: dict[str, list[float]] = {}
    for call in ("encode", "decode"):
        for k, v in model.get(call, {}).get("kernels", {}).items():
            p = per.setdefault(k, [0.0, 0.0])
            p[0] += v["launches"]
            p[1] += v["bytes_per_element"] * numel
    for k in issued or {}:
        per.setdefault(k, [0.0, 0.0])
    for k, (launches, nbytes) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        ev = [e for e in events if e.key == k or re.fullmatch(re.escape(k) + r"_[0-9a-z]+", e.key)]
        us = sum(e.self_device_time_total for e in ev) / PAIRS
        if not ev or us <= 0:
            print(f"  {k}: not in the profile (the model is older than the code, or the kernel did not run)")
            continue
        line = f"  {k}: {us:.1f} us"
        if nbytes:
            gbs = nbytes / (us * 1e-6) / 1e9
            share = f", {gbs / copy_gbs:.0%} of the copy's" if copy_gbs else ""
            line = (f"  {k}: {launches:.0f} launches, {us:.1f} us, {nbytes / 2 ** 20:.1f} MB by the model: "
                    f"{gbs:.0f} GB/s{share}")
        if issued and k in issued:
            rate = issued[k] * numel / (us * 1e-6)
            share = f", {rate / peak:.0%} of the peak" if peak else ""
            line += f"; {issued[k]:.1f} instructions per element by the model: {rate:.3g} per s{share}"
        print(line)


def _issued(issue: dict, spec: str) -> dict[str, float]:
    """Instructions per element of ``spec``'s encode + decode by kernel name, from an ``--issue`` JSON."""
    out: dict[str, float] = {}
    for c in issue.get("calls", []):
        if c["spec"] == spec:
            for k, v in c["kernels"].items():
                name = k.rsplit(".", 1)[-1]
                out[name] = out.get(name, 0.0) + v
    return out


def _count(events, name: str) -> int:
    return sum(e.count for e in events if e.key == name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default="int4,tahquant,tahquant:fit=minmax,fp8,perchannel6,blockwise8,fp16")
    ap.add_argument("--mb", type=float, default=16.0, help="size of the fp32 input in MB (rows of 1600)")
    ap.add_argument("--out", default="", help="folder for the profiler's tables")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check the script where there is no GPU")
    ap.add_argument("--no-graphs", action="store_true", help="leave out the runs with CUDA graphs")
    ap.add_argument("--traffic", default=str(TRAFFIC),
                    help="the bytes per element each kernel moves (python scripts/gpu_op_count.py --traffic --json)")
    ap.add_argument("--issue", default=str(ISSUE),
                    help="the instructions per element each kernel issues (python scripts/compile_for_gpu.py --issue "
                         "--json)")
    args = ap.parse_args(argv)
    model = json.loads(Path(args.traffic).read_text())["codecs"] if Path(args.traffic).is_file() else {}
    issue = json.loads(Path(args.issue).read_text()) if Path(args.issue).is_file() else {}
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: torch sees no CUDA device; run this on a GPU machine", file=sys.stderr)
        return 2
    rows = max(1, int(args.mb * 2 ** 20 / 4) // 1600)
    x = torch.randn(rows, 1600, device=dev)
    small = torch.zeros(4, device=dev)
    for _ in range(10):
        bool(torch.isfinite(small).all())
    t0 = time.perf_counter()
    for _ in range(200):  # a read-back of a 4-element reduction: one host sync, the GPU otherwise idle
        bool(torch.isfinite(small).all())
    sync_us = (time.perf_counter() - t0) / 200 * 1e6
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    copy_gbs = _copy_gbs(x) if dev.type == "cuda" else 0.0
    peak = 0.0
    if dev.type == "cuda" and issue:  # this GPU's multiprocessors at the clock the model assumed
        peak = torch.cuda.get_device_properties(dev).multi_processor_count * 4 * 32 * issue["gpu"]["clock_ghz"] * 1e9
    print(f"{name}, torch {torch.__version__}; input {tuple(x.shape)} fp32 "
          f"({x.numel() * 4 / 2 ** 20:.1f} MB); one host sync: {sync_us:.1f} us; a device copy of it: "
          f"{copy_gbs:.0f} GB/s read + written")
    modes = [False] if args.no_graphs else [False, True]
    for spec, with_graphs in [(s.strip(), g) for s in args.specs.split(",") if s.strip() for g in modes]:
        graphs.enable(with_graphs)
        c = get_codec(spec)
        for _ in range(3):  # compile, warm the caches
            c.decode(c.encode(x), x.shape, x.dtype)
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            p = c.encode(x)
        sync()
        enc = (time.perf_counter() - t0) / 10
        t0 = time.perf_counter()
        for _ in range(10):
            c.decode(p, x.shape, x.dtype)
        sync()
        dec = (time.perf_counter() - t0) / 10
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(PAIRS):
                c.decode(c.encode(x), x.shape, x.dtype)
            sync()
        ev = prof.key_averages()
        launches = (_count(ev, "cudaLaunchKernel") + _count(ev, "cuLaunchKernelEx") + _count(ev, "cuLaunchKernel")
                    + _count(ev, "cudaGraphLaunch"))
        gpu_us = sum(e.self_device_time_total for e in ev) / PAIRS
        host_us = sum(e.self_cpu_time_total for e in ev) / PAIRS
        label = spec + ("+graphs" if with_graphs else "")
        print(f"{label}: encode {enc * 1e3:.3f} ms, decode {dec * 1e3:.3f} ms; per encode + decode: host "
              f"{host_us / 1e3:.2f} ms, GPU kernels {gpu_us / 1e3:.3f} ms, {launches / PAIRS:.0f} launches, "
              f"{_count(ev, 'cudaStreamSynchronize') / PAIRS:.0f} syncs, "
              f"{_count(ev, 'cudaMemcpyAsync') / PAIRS:.0f} copies")
        if dev.type == "cuda" and not with_graphs and (spec in model or _issued(issue, spec)):
            _kernels(ev, model.get(spec, {}), x.numel(), copy_gbs, _issued(issue, spec), peak)
        if out:
            name = re.sub(r"[^A-Za-z0-9._-]", "_", label)
            (out / f"prof_{name}.txt").write_text(
                ev.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70) + "\n\n"
                + ev.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70) + "\n")
    graphs.enable(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
