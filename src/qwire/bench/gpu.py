"""``qwire bench codecs --device cuda``: codec throughput on a GPU, and the codecs' share of a stage's step.

1. Throughput: encode and decode of every codec at 1-256 MB of fp32 next to a device-to-device copy
   (``y.copy_(x)``) timed in the same loop, with CUDA events; the best of ``--repeat`` repetitions, each
   the mean of ``INNER`` back-to-back calls. ``impl`` says what ran (``triton``: the Triton kernels of
   :mod:`qwire.codecs.kernels.gpu`; ``torch``: the reference, for codecs without a kernel).
2. The GPT2-XL pipeline boundary (one micro-batch of 1 x 1024 x 1600): one encode + decode of the
   activation and one of its gradient, against the forward + backward of the stage that produces it
   (``--stage-layers`` decoder layers of GPT2-XL's width in bf16, :class:`torch.nn.TransformerEncoderLayer`).

Writes ``<out>/gpu.json`` and ``<out>/gpu.md`` (with the GPU, driver, torch and Triton versions).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from qwire.bench.report import bench_command, machine, md_table
from qwire.codecs import get_codec, kernels
from qwire.codecs.kernels import graphs
from qwire.codecs.kernels.deferred import PendingChecks, deferring

# tahquant:layout=log7,fit_rotated=false: TAH-Quant's default before log6t and zero_width=block
SPECS = ["fp16", "bf16", "int8", "int4", "int3", "tahquant", "tahquant:layout=log7,fit_rotated=false",
         "tahquant-public", "perchannel6", "fp8", "fp8plain", "blockwise8", "blockwise4", "fp4"]
SIZES_MB = (1.0, 4.0, 16.0, 64.0, 256.0)
INNER = 10  # back-to-back calls per timed repetition
TARGETS = {"int4": 0.5, "perchannel6": 0.5, "fp8": 0.5, "blockwise8": 0.5, "tahquant": 0.3}  # of the copy, >= 16 MB
TARGET_MIN_MB = 16.0
BOUNDARY = (1, 1024, 1600)  # GPT2-XL: one micro-batch of 1024 tokens, hidden size 1600
BOUNDARY_SPECS = ["tahquant", "int4", "fp8", "fp16"]
STAGE_SHARE = 0.02  # codec time per micro-batch at most this share of the stage's compute


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timer(device: torch.device, fn, inner: int, after=None) -> float:
    """Mean seconds per call of ``fn`` over ``inner`` back-to-back calls (CUDA events on a GPU); ``after()`` (e.g.
    resolving the calls' deferred checks) runs once after them, inside the timed span."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        if after is not None:
            after()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    if after is not None:
        after()
    return (time.perf_counter() - t0) / inner


class _Deferred:
    """Calls whose codec checks wait in one :class:`PendingChecks`, resolved once after a timed run of them (as a
    pipeline stage resolves once per chunk)."""

    def __init__(self) -> None:
        self.pending = PendingChecks()

    def __call__(self, fn):
        def call() -> None:
            with deferring(self.pending):
                fn()
        return call

    def resolve(self) -> None:
        self.pending.resolve()


def _with_graphs(device: torch.device) -> bool:
    """Whether this device's codec kernels can run in graphs (CUDA; a stand-in where a test put one)."""
    return device.type in graphs.FACTORIES


def device_throughput(specs: list[str], sizes_mb: list[float], repeat: int, device: torch.device | str,
                      seed: int = 0, inner: int = INNER, log: Any = print) -> list[dict[str, Any]]:
    """Encode / decode GB/s (of fp32 input) of each codec on ``device`` (impl=auto), next to ``y.copy_(x)``."""
    device = torch.device(device)
    rows = []
    cols = 2048
    g = torch.Generator().manual_seed(seed)
    for mb in sizes_mb:
        n_rows = max(1, int(mb * 2 ** 20 / 4 / cols))
        x = torch.randn(n_rows, cols, generator=g)
        x[:, :: cols // 8] *= 50  # outlier channels
        x = x.to(device)
        y = torch.empty_like(x)
        nbytes = x.numel() * 4
        for spec in specs:
            codec = get_codec(spec)
            p = codec.encode(x)  # warm-up: the kernels' first compilation
            codec.decode(p, x.shape, x.dtype)
            _sync(device)
            t_copy = t_enc = t_dec = math.inf
            for _ in range(repeat):  # interleaved, so that whatever else runs hits all three alike
                t_copy = min(t_copy, _timer(device, lambda x=x, y=y: y.copy_(x), inner))
                t_enc = min(t_enc, _timer(device, lambda x=x, c=codec: c.encode(x), inner))
                t_dec = min(t_dec, _timer(device, lambda x=x, c=codec, p=p: c.decode(p, x.shape, x.dtype), inner))
            row = {"name": spec, "spec": codec.spec(), "impl": kernels.implementation(codec, device),
                   "mb": round(nbytes / 2 ** 20, 2), "payload_bytes": int(p.numel()),
                   "copy_gbs": nbytes / t_copy / 1e9, "encode_gbs": nbytes / t_enc / 1e9,
                   "decode_gbs": nbytes / t_dec / 1e9, "roundtrip_gbs": nbytes / (t_enc + t_dec) / 1e9,
                   "roundtrip_vs_copy": t_copy / (t_enc + t_dec)}
            row.update(_deferred_ratios(spec, x, p, t_copy, repeat, device, inner))
            rows.append(row)
            more = "".join(f"  {k.removeprefix('vs_copy_')} {row[k]:.3f}" for k in ("vs_copy_deferred",
                                                                                  "vs_copy_graphs") if k in row)
            log(f"[gpu] {row['mb']:7.1f} MB {spec:18s} {row['impl']:6s} enc {row['encode_gbs']:8.1f} "
                f"dec {row['decode_gbs']:8.1f} copy {row['copy_gbs']:8.1f} GB/s  ratio {row['roundtrip_vs_copy']:.3f}"
                + more)
    return rows


def _deferred_ratios(spec: str, x: torch.Tensor, p: torch.Tensor, t_copy: float, repeat: int, device: torch.device,
                     inner: int) -> dict[str, float]:
    """Copy time over encode + decode time with the checks resolved once per ``inner`` calls, as a pipeline stage
    runs the codecs: without graphs (``vs_copy_deferred``) and with the kernels in CUDA graphs
    (``vs_copy_graphs``, where the device has them)."""
    out = {}
    modes = [("deferred", False)] + ([("graphs", True)] if _with_graphs(device) else [])
    for name, on in modes:
        with graphs.turned(on):
            c, d = get_codec(spec), _Deferred()
            enc, dec = d(lambda c=c: c.encode(x)), d(lambda c=c: c.decode(p, x.shape, x.dtype))
            for _ in range(2):  # warm-up; with graphs: the call run as usual, then the capture
                enc(), dec()
            d.resolve()
            _sync(device)
            t = math.inf
            for _ in range(repeat):
                t = min(t, _timer(device, enc, inner, d.resolve) + _timer(device, dec, inner, d.resolve))
        out[f"vs_copy_{name}"] = t_copy / t
    return out


def stage_share(specs: list[str], layers: int, device: torch.device | str, repeat: int, shape=BOUNDARY,
                heads: int = 25, dtype: torch.dtype = torch.bfloat16, log: Any = print) -> dict[str, Any]:
    """Codec time per micro-batch (encode + decode of the activation and of its gradient, both of
    ``shape``) against the forward + backward of ``layers`` decoder layers of that width."""
    device = torch.device(device)
    width = shape[-1]
    torch.manual_seed(0)
    stage = torch.nn.Sequential(*[
        torch.nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True, norm_first=True)
        for _ in range(layers)]).to(device=device, dtype=dtype)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        stage(x).float().square().mean().backward()

    step()
    _sync(device)
    t_stage = min(_timer(device, step, 3) for _ in range(repeat))
    act = torch.randn(shape, device=device)
    grad = torch.randn(shape, device=device).to(dtype)

    def plain() -> None:  # a middle stage's micro-batch without codecs: forward, backward from a gradient
        stage(x).backward(grad)

    rows = []
    for spec in specs:
        c = get_codec(spec)
        p = c.encode(act)
        c.decode(p, act.shape, act.dtype)
        pb = c.encode(grad)

        def roundtrip(c=c) -> None:
            c.decode(c.encode(act), act.shape, act.dtype)

        def chunks(c=c, pb=pb) -> None:
            """The same micro-batch with the codecs where a middle stage has them, the checks read back once
            per chunk (as CompressedPipelineStage does on a GPU): decode the input, forward, encode the output;
            decode the gradient, backward, encode the input's gradient."""
            pending = PendingChecks()
            with deferring(pending):
                h = c.decode(pb, shape, dtype).requires_grad_()
                out = stage(h)
                c.encode(out.detach())
            pending.resolve()
            with deferring(pending):
                out.backward(c.decode(pb, shape, dtype))
                c.encode(h.grad)
            pending.resolve()

        _sync(device)
        t = 2 * min(_timer(device, roundtrip, INNER) for _ in range(repeat))  # activation + gradient
        chunks()
        _sync(device)
        t_plain = t_with = t_graphs = math.inf
        with_graphs = _with_graphs(device)
        if with_graphs:  # the same with the codecs' kernels in CUDA graphs (their own codec objects)
            cg, pbg = get_codec(spec), pb.clone()
            d = _Deferred()
            with graphs.turned(True):
                for _ in range(2):  # the calls run as usual, then captured
                    chunks(cg, pbg)
                    d(lambda cg=cg: roundtrip(cg))()
                d.resolve()
                _sync(device)  # the codecs alone, their checks read once per INNER round trips
                t_alone = 2 * min(_timer(device, d(lambda cg=cg: roundtrip(cg)), INNER, d.resolve)
                                  for _ in range(repeat))
        for _ in range(repeat):  # interleaved, so that a change of the GPU's clocks hits all alike
            t_plain = min(t_plain, _timer(device, plain, 3))
            t_with = min(t_with, _timer(device, chunks, 3))
            if with_graphs:
                with graphs.turned(True):
                    t_graphs = min(t_graphs, _timer(device, lambda cg=cg, pbg=pbg: chunks(cg, pbg), 3))
        row = {"name": spec, "impl": kernels.implementation(c, device), "codec_s": t, "share": t / t_stage,
               "plain_s": t_plain, "in_step_s": t_with - t_plain, "in_step_share": (t_with - t_plain) / t_plain}
        if with_graphs:
            row.update(codec_graphs_s=t_alone, share_graphs=t_alone / t_stage, in_step_graphs_s=t_graphs - t_plain,
                       in_step_graphs_share=(t_graphs - t_plain) / t_plain)
        rows.append(row)
        log(f"[gpu] boundary {tuple(shape)} {spec:12s} {rows[-1]['impl']:6s} {t * 1e3:.3f} ms = "
            f"{100 * t / t_stage:.2f}% of the stage's {t_stage * 1e3:.2f} ms; in the step "
            f"{(t_with - t_plain) * 1e3:+.3f} ms = {100 * (t_with - t_plain) / t_plain:+.2f}%"
            + (f"; with graphs {(t_graphs - t_plain) * 1e3:+.3f} ms" if with_graphs else ""))
    return {"shape": list(shape), "layers": layers, "dtype": str(dtype).replace("torch.", ""),
            "stage_s": t_stage, "rows": rows}


RATIOS = {"roundtrip_vs_copy": "checks per call", "vs_copy_deferred": "checks per chunk",
          "vs_copy_graphs": "CUDA graphs"}


def _best_ratio(row: dict[str, Any]) -> tuple[float, str]:
    """The row's best copy ratio among the ways it was run, and that way."""
    return max((row[k], how) for k, how in RATIOS.items() if k in row)


def targets(tp: list[dict[str, Any]], share: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target, judged on the best way each size was run (checks per call, per chunk, CUDA graphs: the
    row says which), since a pipeline stage may run either of the last two."""
    out = []
    for name, limit in TARGETS.items():
        r = [_best_ratio(x) for x in tp if x["name"] == name and x["mb"] >= TARGET_MIN_MB]
        worst = min(r) if r else None
        out.append({"target": f"`{name}` encode+decode >= {limit:.0%} of the copy at >= {TARGET_MIN_MB:g} MB",
                    "measured": "-" if worst is None else f"worst {worst[0]:.2g} ({worst[1]})",
                    "met": worst is not None and worst[0] >= limit})
    for r in share.get("rows", []):
        ways = [(r["share"], "the codecs alone")] + [(r[k], how) for k, how in (
            ("share_graphs", "the codecs alone, CUDA graphs"), ("in_step_share", "in the step"),
            ("in_step_graphs_share", "in the step, CUDA graphs")) if k in r]
        best = min(ways)
        out.append({"target": f"`{r['name']}` at the GPT2-XL boundary <= {STAGE_SHARE:.0%} of the stage's compute",
                    "measured": f"{100 * best[0]:.2f}% ({best[1]})", "met": best[0] <= STAGE_SHARE})
    return out


def versions() -> dict[str, Any]:
    v: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        v.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2 ** 30, 1), capability=f"{p.major}.{p.minor}")
        try:
            import subprocess

            v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            v["driver"] = None
    return v


def markdown(res: dict[str, Any]) -> str:
    m, v = res["meta"], res["versions"]
    L = ["# Codecs on a GPU", "",
         f"Command: `{m['command']}`  ",
         f"GPU: {v.get('gpu', '-')} ({v.get('gpu_memory_gib', '-')} GiB, compute capability "
         f"{v.get('capability', '-')}), "
         f"driver {v.get('driver') or '-'}, CUDA {v.get('cuda') or '-'}, torch {v['torch']}, Triton "
         f"{v.get('triton') or '-'}; host: {m['machine']}; {m['date']}, {m['seconds']} s.", "",
         "## Targets", ""]
    L += md_table(["target", "measured", ""], [[t["target"], t["measured"], "**met**" if t["met"] else "**missed**"]
                                              for t in res["targets"]])
    s = res["stage"]
    L += ["", "## Throughput", "",
          f"Encode and decode of fp32 input on the GPU, `impl=auto`; the best of the repetitions, each the mean of "
          f"{INNER} back-to-back calls timed with CUDA events. `copy` is `y.copy_(x)` on the device, timed in the "
          "same loop; `ratio` is copy time / (encode + decode time), each call reading its checks back. `impl` is "
          "what ran: `triton` (the Triton kernels) or `torch` (the reference). *per chunk*: the same ratio with "
          "the checks read once after the calls, as a pipeline stage "
          "reads them once per chunk; *graphs*: that, with the kernels in CUDA graphs (`--codec-graphs`; the "
          "input copied in and the output out of the graph counted). `-`: not measured in this run.", ""]

    def ratio(r: dict[str, Any], k: str) -> str:
        return f"{r[k]:.3f}" if k in r else "-"

    L += md_table(["codec", "impl", "MB", "encode GB/s", "decode GB/s", "enc+dec GB/s", "copy GB/s", "ratio",
                   "per chunk", "graphs"],
                  [[f"`{r['name']}`", r["impl"], f"{r['mb']:g}", f"{r['encode_gbs']:.1f}", f"{r['decode_gbs']:.1f}",
                    f"{r['roundtrip_gbs']:.1f}", f"{r['copy_gbs']:.1f}", ratio(r, "roundtrip_vs_copy"),
                    ratio(r, "vs_copy_deferred"), ratio(r, "vs_copy_graphs")]
                   for r in res["throughput"]])
    L += ["", "## At the GPT2-XL pipeline boundary", "",
          f"One micro-batch {tuple(s['shape'])}: encode + decode of the activation and of its gradient (fp32), "
          f"against forward + backward of {s['layers']} decoder layers of width {s['shape'][-1]} in {s['dtype']} "
          f"(`torch.nn.TransformerEncoderLayer`, 25 heads, MLP 4x): {s['stage_s'] * 1e3:.2f} ms.", ""]
    L += ["`codec ms` times the two encodes and decodes alone, back to back. *In the step*: the same micro-batch "
          "of a middle stage with the codecs where a pipeline stage has them (decode the input, forward, encode "
          "the output; decode the gradient, backward from it, encode the input's gradient; the checks read back "
          "once per chunk, as `CompressedPipelineStage` does on a GPU), minus the same forward and backward "
          "without them (the two timed in turns, the best of each): what the codecs add to a stage's step, where "
          "the GPU can run them while the host queues the next kernels. *Graphs*: the codecs' kernels in CUDA "
          "graphs (`--codec-graphs`): the codecs alone (their checks read once per "
          f"{INNER} round trips), and in the step.", ""]

    def cell(r: dict[str, Any], k: str, fmt: str) -> str:
        return format(r[k] * (1e3 if k.endswith("_s") else 100), fmt) + ("%" if not k.endswith("_s") else "") \
            if k in r else "-"

    L += md_table(["codec", "impl", "codec ms per micro-batch", "share of the stage", "in the step, ms",
                   "in the step, share", "graphs: codec ms", "graphs: share", "graphs: in the step, share"],
                  [[f"`{r['name']}`", r["impl"], cell(r, "codec_s", ".3f"), cell(r, "share", ".2f"),
                    cell(r, "in_step_s", "+.3f"), cell(r, "in_step_share", "+.2f"), cell(r, "codec_graphs_s", ".3f"),
                    cell(r, "share_graphs", ".2f"), cell(r, "in_step_graphs_share", "+.2f")]
                   for r in s["rows"]])
    return "\n".join(L) + "\n"


def run(args: argparse.Namespace, add_arguments: Any) -> int:
    if not torch.cuda.is_available():
        print("qwire bench codecs: --device cuda needs a CUDA GPU, and torch sees none "
              "(torch.cuda.is_available() is False); run it on a GPU machine, or drop --device cuda",
              flush=True)
        return 2
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [float(s) for s in args.sizes_mb.split(",")] if args.sizes_mb else list(SIZES_MB)
    if args.quick:
        sizes = [1.0, 16.0]
    specs = SPECS[:6] if args.quick else SPECS
    repeat = 2 if args.quick else args.repeat
    tp = device_throughput(specs, sizes, repeat, "cuda", args.seed)
    share = stage_share(BOUNDARY_SPECS, args.stage_layers, "cuda", repeat)
    res = {"meta": {"command": bench_command("codecs", args, add_arguments), "machine": machine(),
                    "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0, 1), "quick": args.quick},
           "versions": versions(), "throughput": tp, "stage": share, "targets": targets(tp, share)}
    (out / "gpu.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "gpu.md").write_text(markdown(res))
    print(f"wrote {out / 'gpu.json'} and {out / 'gpu.md'} ({time.time() - t0:.0f} s)")
    return 0
