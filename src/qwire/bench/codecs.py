"""``qwire bench codecs``: error, bits/element and speed of every codec on real and synthetic tensors.

Inputs
    ``activation`` / ``gradient``: the hidden state crossing the middle pipeline
    boundary of ``llama-tiny`` trained for a few hundred steps on the standard
    library's source, and the gradient sent back across it (captured once by
    :func:`qwire.bench.capture.capture_boundary` into ``.cache/``);
    ``gaussian``: i.i.d. N(0, 1); ``outliers``: Student-t (5 degrees of freedom)
    with 8 channels scaled 20-100x, as LLM activations have.

Per codec and input: bits/element counted from the payload, normalized MSE
``sum (x - y)^2 / sum x^2``, SNR, max abs error and the gap to the Gaussian
rate-distortion bound ``NMSE >= 2^(-2R)`` at the codec's rate R. Then the
TAH-Quant ablations (tau, tile, allocation unit, rotation cap, ratio, metadata
layout), the direct-quantization curve, the codecs' targets with a verdict each,
and encode/decode throughput next to a plain ``y.copy_(x)`` timed in the same run.
Then the outlier-magnitude sweep (:func:`outlier_sweep`): TAH-Quant's error on the
ordinary elements of LLM-like activations (:func:`qwire.codecs.synthetic.llm_like`)
as channel outliers / massive activations grow from 10x to 10^4x the RMS.
Writes ``<out>/codecs.json`` and ``<out>/codecs.md``; ``--only outliers`` runs the
sweep alone and replaces just its section in both files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from qwire.bench import add_out_argument
from qwire.bench.report import bench_command, fmt, machine
from qwire.bench.runner import number_list
from qwire.codecs import available, get_codec, kernels
from qwire.codecs.layouts import LAYOUTS, LogLayout
from qwire.codecs.tahquant import ADAPTIVE, LOG7_DEFAULT, MINMAX_DEFAULT, PREDICTED, PREVIOUS_DEFAULT, ROTATED_FIT

# --------------------------------------------------------------------------------------------- configs
TAH = "tahquant"
PUBLIC = "tahquant-public"  # the public code: G=64, v1 (tokens ranked by entropy), fp16 metadata
# the default before slots=tile: 4/3-bit tiles (80% at 4 bits, ranked by range), pivot slots per token, logx
PREV = PREVIOUS_DEFAULT
MINMAX = MINMAX_DEFAULT  # the default before fit=mse: every tile's grid covers it
LOG7 = LOG7_DEFAULT  # the default before log6t and zero_width=block: log7, every rotated tile's zero 9 bits wider
ROTFIT = ROTATED_FIT  # that default with the rotated tiles' grids searched too (an option)
ADAPT = ADAPTIVE  # and per block the layout (log6/log7) and zero-extension width of lowest error (an option)
PREDICT = PREDICTED  # the same choice predicted from one trial encode (an option)
FIXED = "tahquant:zero_width=fixed"  # the default with every rotated tile's zero 9 bits wider (no choice per block)


def _prev(opts: str) -> str:
    """``PREV`` with options set or replaced (the ablations of the pivot-slot format)."""
    kv = dict(o.split("=", 1) for o in PREV.split(":", 1)[1].split(","))
    kv.update(o.split("=", 1) for o in opts.split(","))
    return "tahquant:" + ",".join(f"{k}={v}" for k, v in kv.items())


# a larger tile with wider codes: the rate-distortion alternative to the previous default (docs/codecs.md,
# "Operating point"): 64-channel tiles, 10% of the tokens at 5 bits and the rest at 4, two slots per 8 tiles
G64 = ("tahquant:tile=64,high_bits=5,low_bits=4,ratio=0.1,unit=token,max_rotated=0.25,slots=token,layout=logx,"
       "zero_ext=8,tau=2.0,fit=minmax")
MAIN = [
    "fp16", "bf16",
    "int2", "int3", "int4", "int5", "int6", "int8",
    "int3:layout=ref", "int4:layout=ref", "int3:symmetric=true", "int4:symmetric=true",
    "int3:tile=64,layout=ref", "int4:tile=64,layout=ref", "int4:layout=log7", "int4:layout=log6",
    "int4:layout=log7,fit=mse", "int4:layout=log6,fit=mse", "int4:fit=mse",
    TAH, LOG7, FIXED, ROTFIT, ADAPT, PREDICT, MINMAX, "tahquant:layout=log6", "tahquant:layout=ref",
    "tahquant:unit=token", PREV,
    _prev("alloc=entropy"),
    _prev("unit=token"), _prev("unit=token,alloc=entropy"), PUBLIC,
    "tahquant:tile=64,layout=ref,max_rotated=1,ratio=0.8,slots=token,tau=2.0",
    "tahquant:rounding=stochastic",
    "perchannel4", "perchannel6", "perchannel8",
]
PREV_NOTE = " (the pivot-slot format: " + PREV + " and variants)"
FIT_ABLATION = ("encoder fit (mse, the default: each tile's grid of lowest squared error; minmax: the grid covers "
                "the tile)")
ABLATIONS: dict[str, list[str]] = {
    FIT_ABLATION: [
        TAH, "tahquant:fit_rotated=false", LOG7, ROTFIT, MINMAX, "tahquant:layout=log6",
        "tahquant:layout=log6,fit=minmax", "tahquant:layout=log",
        "tahquant:layout=log,fit=minmax", "int4:layout=log7,fit=mse", "int4:layout=log7", "int4:layout=log6,fit=mse",
        "int4:layout=log6", "int4:fit=mse", "int4", "int4:layout=ref", "int3:layout=log7,fit=mse", "int3:layout=log7",
        "int5:layout=log7,fit=mse", "int5:layout=log7"],
    "pivot and zero extension: in the rotated tile (slots=tile, the default) or in slots per token": [
        TAH, LOG7, "tahquant:layout=log6", "tahquant:layout=logx", "tahquant:tau=inf", "tahquant:ratio=0.8",
        PREV, "tahquant:slots=token", "int4:layout=log7", "int4:layout=log6", "int3:layout=log7"],
    "tau (the default: every qualifying tile rotated)": [
        "tahquant:tau=0", "tahquant:tau=2", "tahquant:tau=2.25", TAH, "tahquant:tau=2.75", "tahquant:tau=3",
        "tahquant:tau=4", "tahquant:tau=inf", MINMAX, "tahquant:tau=2.5,fit=minmax"],
    "tau, at most 1/4 of a token's tiles rotated" + PREV_NOTE: [
        _prev("tau=0"), PREV, _prev("tau=4"), _prev("tau=inf")],
    "tau, no cap, as in the paper" + PREV_NOTE: [
        _prev("tau=0,max_rotated=1"), _prev("max_rotated=1"), _prev("tau=4,max_rotated=1"), _prev("tau=inf")],
    "tile size G": [f"tahquant:tile={g}" for g in (8, 16, 32, 64, 128)],
    "tile size G, reference layout": [f"tahquant:tile={g},layout=ref,max_rotated=1,ratio=0.8,slots=token,tau=2.0"
                                      for g in (8, 16, 32, 64, 128)],
    "allocation unit (v2 tile / v1 token)" + PREV_NOTE: [
        PREV, _prev("unit=token"), "tahquant:tile=64,layout=ref,max_rotated=1,ratio=0.8,slots=token,tau=2.0",
        "tahquant:tile=64,unit=token,layout=ref,max_rotated=1,ratio=0.8,slots=token,tau=2.0", PUBLIC],
    "allocation criterion (range; entropy: the paper)" + PREV_NOTE: [
        PREV, _prev("alloc=entropy"), _prev("unit=token"), _prev("unit=token,alloc=entropy"),
        _prev("tau=inf"), _prev("tau=inf,alloc=entropy")],
    "rotation cap max_rotated" + PREV_NOTE: [_prev(f"max_rotated={c}") for c in (0.125, 0.25, 0.5, 1.0)],
    "ratio rho (rate)": [f"tahquant:ratio={r}" for r in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)],
    "ratio rho (rate)" + PREV_NOTE: [_prev(f"ratio={r}") for r in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)],
    "ratio rho, reference layout": [f"tahquant:ratio={r},layout=ref,slots=token,tau=2.0" for r in (0.0, 0.4, 0.8, 1.0)],
    "metadata layout" + PREV_NOTE: [
        _prev("layout=ref"), PREV, _prev("layout=log"), _prev("layout=log6"), _prev("layout=log7"),
        _prev("layout=log-z1"), _prev("layout=log-z2"), _prev("layout=log-z8"), _prev("layout=log-q8"),
        _prev("layout=log-q32"), _prev("layout=log-noalign")],
    "metadata layout, direct int4": [
        "int4:layout=ref", "int4:tile=64,layout=ref", "int4", "int4:layout=log6", "int4:layout=log7",
        "int4:layout=log-z1", "int4:layout=log-z2", "int4:layout=log-z8", "int4:layout=log-noalign"],
    "direct quantization curve (G=32)": [f"int{b}" for b in (2, 3, 4, 5, 6)] + [
        f"int{b}:symmetric=true" for b in (3, 4, 5)] + [f"int{b}:layout=ref" for b in (3, 4, 5)] + [
        f"int{b}:layout=log7" for b in (3, 4, 5)] + [f"int{b}:layout=log6" for b in (3, 4, 5)],
    "operating point at <= 4.41 bits/element (direct int4 at G=64 for scale)": [
        TAH, LOG7, PREV, _prev("tile=64,ratio=1.0"), G64, "int4:tile=64"],
    "<= 4.0 bits/element (stretch)": [
        "tahquant:ratio=0.4", "tahquant:ratio=0.4,tau=0", "tahquant:tile=64,ratio=0.6",
        _prev("ratio=0.4"), _prev("ratio=0.4,tau=0"), _prev("ratio=0.4,unit=token,tau=0"),
        _prev("layout=log6,ratio=0.5"), _prev("layout=log6,ratio=0.5,unit=token,tau=0"),
        _prev("tile=64,ratio=0.65,tau=0")],
}
# metadata-layout variants evaluated here only (the shipped layouts are ref, log, log6, log7 and logx)
VARIANTS = {
    "log-z1": LogLayout("log-z1", 8, 16, 8, 1),
    "log-z2": LogLayout("log-z2", 8, 16, 8, 2),
    "log-z8": LogLayout("log-z8", 8, 16, 8, 8),
    "log-q8": LogLayout("log-q8", 8, 8, 8, 4),
    "log-q32": LogLayout("log-q32", 8, 32, 8, 4),
    "log-noalign": LogLayout("log-noalign", 8, 16, 8, 4, align=False),
    "logx-z1": LogLayout("logx-z1", 8, 16, 7, 1),  # logx with half its zero unit (reach 1 tile range)
}
THROUGHPUT = ["fp16", "bf16", "int8", "int4", "int4:layout=log7,fit=mse", "int3", TAH, LOG7, ROTFIT, ADAPT, PREDICT,
              MINMAX,
              PREV, "tahquant:layout=ref", PUBLIC, "perchannel6",
              "perchannel8", "fp8", "fp8plain", "blockwise8", "blockwise4", "fp4"]
# encode + decode at 1 thread on a TARGET_MB tensor, as a fraction of a copy, that each codec's fast
# path should reach
TARGET_MB = 26.0
SPEED_TARGETS = {"int4": 0.25, "perchannel6": 0.25, "fp8": 0.25, "blockwise8": 0.25, TAH: 0.15, PUBLIC: 0.15}
QUICK_MAIN = ["fp16", "int3", "int4", TAH, "tahquant:layout=ref", PUBLIC, "perchannel6"]
QUICK_ABLATIONS = {"tau (the default: every qualifying tile rotated)": ["tahquant:tau=0", "tahquant:tau=2", TAH],
                   "direct quantization curve (G=32)": ["int3", "int4"]}
REAL = ("activation", "gradient")
# outlier-magnitude sweep: TAH-Quant's default against the fp16-metadata layout, no rotation, the
# published configurations and the earlier defaults (before fit=mse, slots=tile, the zero extension)
OUTLIER_SPECS = [TAH, "tahquant:layout=ref", "tahquant:rotate=false", "tahquant-paper", "tahquant-public", LOG7,
                 MINMAX, PREV, _prev("layout=log,zero_ext=0,max_rotated=0.25,alloc=entropy"), FIXED, ROTFIT,
                 "tahquant:layout=log6", ADAPT, PREDICT, G64]
# in the tables, not in the targets: alternative operating points, not baselines
OUTLIER_SHOWN = {G64, FIXED, ROTFIT, "tahquant:layout=log6", ADAPT, PREDICT}
OUTLIER_OPTIONS = (ADAPT, PREDICT)  # options checked against the targets too, beside the default
OUTLIER_MAGNITUDES = (10, 30, 100, 300, 1000, 3000, 10000)
OUTLIER_KINDS = {  # llm_like arguments per kind; the magnitude goes to every outlier of the kind
    "channels": {"massive": 0, "outlier_channels": 4},
    "massive": {"massive": 2, "outlier_channels": 0},
    "both": {"massive": 2, "outlier_channels": 4},
    "pair": {"massive": 0, "outlier_channels": 2, "pairs": 1, "spacing": 32},
}
# kinds in the tables but not in the targets: two outlier channels of similar size in one tile of 32, which
# no configuration here serves (one rotation per tile), shown so that what it costs is on record
OUTLIER_UNTARGETED = {"pair"}
# bases with fewer than 1024 channels (the captured activations have 256: 8 tiles of 32, and the pivot-slot
# format rotates at most 2 tiles per token): fewer outliers, spaced 32 channels apart
OUTLIER_KINDS_SMALL = {
    "channels": {"massive": 0, "outlier_channels": 2},
    "massive": {"massive": 1, "outlier_channels": 0},
    "both": {"massive": 1, "outlier_channels": 1},
    "pair": {"massive": 0, "outlier_channels": 2, "pairs": 1, "spacing": 32},
}
OUTLIERS_BEGIN, OUTLIERS_END = "<!-- outlier-sweep:begin -->", "<!-- outlier-sweep:end -->"
# the choices behind the default's zero extension (docs/codecs.md): the default, the default before
# it, each change alone, and the alternatives that fit the 4.41 bits/element budget
ZERO_EXT_DESIGN = [
    TAH, PREV, _prev("layout=log,zero_ext=0,max_rotated=0.25"), _prev("layout=log,zero_ext=0"),
    _prev("zero_ext=0"), _prev("max_rotated=0.25"), _prev("layout=log,max_rotated=0.1"),
    _prev("zero_ext=9,max_rotated=0.16"), _prev("layout=logx-z1,zero_ext=9,max_rotated=0.16"),
]
ZERO_EXT_CHANNELS = (256, 1024, 1600, 4096)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_argument(p, "folder for codecs.json and codecs.md")
    p.add_argument("--quick", action="store_true", help="small synthetic inputs and few configs (smoke test)")
    p.add_argument("--capture", default=str(Path(".cache") / "codecs" / "boundary-llama-tiny.pt"),
                   help="cache file of the captured boundary activations (made when missing)")
    p.add_argument("--capture-steps", type=int, default=300, help="training steps before the capture")
    p.add_argument("--no-real", action="store_true", help="skip the captured activations and gradients")
    p.add_argument("--sizes-mb", default=None,
                   help="tensor sizes (MB of fp32) for throughput (default: 1,4,16,26,64; with --device cuda "
                        "1,4,16,64,256)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: throughput of every codec on the GPU next to a device-to-device copy, and the "
                        "codecs' share of a GPT2-XL stage's step; writes gpu.json and gpu.md (qwire.bench.gpu)")
    p.add_argument("--stage-layers", type=int, default=6,
                   help="with --device cuda: decoder layers of the GPT2-XL stage the boundary's codec time is "
                        "compared with (48 layers over 8 stages: 6)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions (the best one counts)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("all", "outliers"), default="all",
                   help="outliers: run only the outlier-magnitude sweep and replace its section of "
                        "codecs.json / codecs.md (the rest of the files stays as it is)")


# --------------------------------------------------------------------------------------------- inputs
def synthetic(kind: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """``gaussian`` N(0,1), or ``outliers``: Student-t(5) with 8 channels scaled by U(20, 100)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if kind == "gaussian":
            return torch.randn(shape)
        x = torch.distributions.StudentT(5.0).sample(shape)
        c = shape[-1]
        ch = torch.randperm(c)[: min(8, c)]
        x[..., ch] *= torch.empty(len(ch)).uniform_(20.0, 100.0)
        return x


def build_inputs(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    info: dict[str, Any] = {}
    shape = (2, 64, 512) if args.quick else (8, 128, 1600)
    inputs = {}
    if not (args.quick or args.no_real):
        from qwire.bench.capture import load_or_capture
        cap = load_or_capture(args.capture, steps=args.capture_steps)
        inputs["activation"] = cap["activation"].float()
        inputs["gradient"] = cap["gradient"].float()
        info["capture"] = cap["meta"]
    inputs["gaussian"] = synthetic("gaussian", shape, args.seed)
    inputs["outliers"] = synthetic("outliers", shape, args.seed + 1)
    info["shapes"] = {k: list(v.shape) for k, v in inputs.items()}
    return inputs, info


# --------------------------------------------------------------------------------------------- metrics
def make_codec(spec: str):
    """``get_codec(spec)``, also for the benchmark-only layout variants in :data:`VARIANTS`."""
    for k in VARIANTS:
        if f"layout={k}" in spec:  # the codec's Param would refuse the name: build with log, then swap
            codec = get_codec(spec.replace(f"layout={k}", "layout=log"))
            codec.layout = k
            codec.config["layout"] = k
            return codec
    return get_codec(spec)


def measure(spec: str, x: torch.Tensor) -> dict[str, Any]:
    """Round trip ``x`` through ``spec``: bits/element (from the payload), NMSE, SNR, max error, RD gap."""
    codec = make_codec(spec)
    p = codec.encode(x)
    y = codec.decode(p, x.shape, x.dtype)
    bpe = 8.0 * p.numel() / x.numel()
    err = y.double() - x.double()
    nmse = float((err ** 2).sum() / (x.double() ** 2).sum())
    db = 10 * math.log10(nmse) if nmse > 0 else -math.inf
    return {"spec": codec.spec(), "name": spec, "bits": round(bpe, 4), "nmse": nmse, "nmse_db": round(db, 3),
            "snr_db": round(-db, 3), "max_abs_err": float(err.abs().max()),
            "rd_gap_db": round(db + 20 * math.log10(2) * bpe, 3)}


def interp_db(points: list[tuple[float, float]], bits: float) -> float | None:
    """NMSE (dB) of a curve of (bits, dB) points at ``bits``: linear in dB between neighbours."""
    pts = sorted(points)
    for (b0, d0), (b1, d1) in zip(pts, pts[1:]):
        if b0 <= bits <= b1:
            return d0 + (d1 - d0) * (bits - b0) / (b1 - b0) if b1 > b0 else min(d0, d1)
    return None


# --------------------------------------------------------------------------------------------- throughput
def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def throughput(specs: list[str], sizes_mb: list[float], repeat: int, seed: int,
               log: Any = print) -> list[dict[str, Any]]:
    """Encode / decode GB/s (of fp32 input) per size, implementation and thread count, next to
    ``y.copy_(x)`` timed in the same loop (with the same number of threads).

    Each codec runs as the torch reference (``impl=torch``, 1 thread) and as the default
    implementation (``impl=auto``: the compiled kernel where the codec has one) with 1 thread and
    with every thread torch has."""
    rows = []
    cols = 2048
    all_threads = torch.get_num_threads()
    runs = [("torch", 1), ("auto", 1)] + ([("auto", all_threads)] if all_threads > 1 else [])
    try:
        for mb in sizes_mb:
            n_rows = max(1, int(mb * 2 ** 20 / 4 / cols))
            x = synthetic("outliers", (n_rows, cols), seed)
            y = torch.empty_like(x)
            nbytes = x.numel() * 4
            for spec in specs:
                for impl, threads in runs:
                    torch.set_num_threads(threads)
                    codec = get_codec(spec, impl=impl)
                    ran = kernels.implementation(codec)
                    if impl == "auto" and ran == "torch":
                        continue  # no kernel for this codec: the reference row says it all
                    if impl == "torch" and getattr(codec, "candidates", None):
                        continue  # a codec made of others (adapt=block): its reference is theirs, many times over
                    p = codec.encode(x)  # warm-up (and the kernels' first compilation)
                    codec.decode(p, x.shape, x.dtype)
                    y.copy_(x)
                    t_copy = t_enc = t_dec = math.inf
                    for _ in range(repeat):  # interleaved, so that load on the machine hits all three alike
                        t_copy = min(t_copy, _time(lambda x=x, y=y: y.copy_(x)))
                        t_enc = min(t_enc, _time(lambda x=x, c=codec: c.encode(x)))
                        t_dec = min(t_dec, _time(lambda x=x, c=codec, p=p: c.decode(p, x.shape, x.dtype)))
                    row = {"spec": codec.spec(), "name": spec, "impl": ran, "threads": threads,
                           "mb": round(nbytes / 2 ** 20, 2),
                           "copy_gbs": nbytes / t_copy / 1e9, "encode_gbs": nbytes / t_enc / 1e9,
                           "decode_gbs": nbytes / t_dec / 1e9, "roundtrip_gbs": nbytes / (t_enc + t_dec) / 1e9,
                           "roundtrip_vs_copy": t_copy / (t_enc + t_dec)}
                    rows.append(row)
                    log(f"throughput {row['mb']:6.2f} MB {spec:45s} {ran:5s} x{threads} enc "
                        f"{row['encode_gbs']:6.3f} dec {row['decode_gbs']:6.3f} copy {row['copy_gbs']:6.2f} GB/s  "
                        f"ratio {row['roundtrip_vs_copy']:.3f}")
    finally:
        torch.set_num_threads(all_threads)
    return rows


# --------------------------------------------------------------------------------------------- outliers
def outlier_sweep(bases: dict[str, torch.Tensor], specs: list[str] | None = None,
                  magnitudes: tuple[float, ...] = OUTLIER_MAGNITUDES, seed: int = 0,
                  log: Any = print) -> dict[str, Any]:
    """NMSE on the ordinary elements of :func:`~qwire.codecs.synthetic.llm_like` inputs per magnitude.

    For each base tensor, each kind of :data:`OUTLIER_KINDS` and each magnitude (a multiple of
    the base's RMS): the outliers are put on the base, every spec round-trips the tensor, and
    the error is measured on the elements the generator left alone. Magnitude 0 is the base
    itself (no outliers). On a base with fewer than 1024 channels the outliers are those of
    :data:`OUTLIER_KINDS_SMALL`, spaced 32 channels apart (distinct tiles for G <= 32).
    """
    from qwire.codecs.synthetic import llm_like, ordinary_nmse

    specs = list(specs or OUTLIER_SPECS)
    rows: list[dict[str, Any]] = []
    for bname, base in bases.items():
        small = base.shape[-1] < 1024
        for kind, kw in (OUTLIER_KINDS_SMALL if small else OUTLIER_KINDS).items():
            for mag in (0, *magnitudes):
                if mag == 0 and kind != "channels":
                    continue  # the outlier-free base once per base
                args = {"spacing": 32 if small else 64, **kw} if mag else {"massive": 0, "outlier_channels": 0}
                x, ordinary = llm_like(tuple(base.shape), base=base, magnitude=float(mag or 1),
                                       channel_magnitude=float(mag or 1), seed=seed, **args)
                for spec in specs:
                    codec = get_codec(spec)
                    y = codec.decode(codec.encode(x), x.shape, x.dtype)
                    e = ordinary_nmse(x, y, ordinary)
                    rows.append({"base": bname, "kind": kind if mag else "none", "magnitude": mag, "name": spec,
                                 "spec": codec.spec(), "bits": round(codec.bits_per_element(x.shape), 4),
                                 "nmse": e, "nmse_db": round(10 * math.log10(e), 3) if e > 0 else -math.inf,
                                 **kw})
            log(f"outliers: {bname} {kind} done")
    return {"specs": specs, "magnitudes": list(magnitudes), "kinds": OUTLIER_KINDS,
            "shapes": {k: list(v.shape) for k, v in bases.items()}, "rows": rows,
            "targets": outlier_targets(rows, specs),
            # the same tests for the options that reach them, beside the targets (not one of them)
            "options": [{"spec": o, "checks": outlier_targets(rows, specs, o)} for o in OUTLIER_OPTIONS if o in specs]}


def outlier_targets(rows: list[dict[str, Any]], specs: list[str], who: str = TAH) -> dict[str, Any]:
    """Per base and kind: ``who``'s (the default's) NMSE at 10^4x within 1.5x of its NMSE at 300x, and whether
    it is at or below each other spec's at every magnitude (within 0.1%: ties are the same quantization
    up to a tile or two). The default is not compared with the options of :data:`OUTLIER_SHOWN`; an option
    with every other spec."""
    out: dict[str, Any] = {}
    for b in dict.fromkeys(r["base"] for r in rows):
        for kind in OUTLIER_KINDS:
            if kind in OUTLIER_UNTARGETED:
                continue
            sel = [r for r in rows if r["base"] == b and r["kind"] == kind]
            d = {r["magnitude"]: r["nmse"] for r in sel if r["name"] == who}
            if 300 not in d or 10000 not in d:
                continue
            res: dict[str, Any] = {"ratio_1e4_over_300": d[10000] / d[300], "flat": d[10000] <= 1.5 * d[300]}
            for spec in specs:
                if spec != who and (who != TAH or spec not in OUTLIER_SHOWN):
                    o = {r["magnitude"]: r["nmse"] for r in sel if r["name"] == spec}
                    res[f"<= {spec}"] = all(d[m] <= 1.001 * o[m] for m in d if m in o)
            out[f"{b}/{kind}"] = res
    return out


def outlier_markdown(sw: dict[str, Any], command_line: str | None = None) -> list[str]:
    """The sweep's section of codecs.md (between the outlier-sweep markers)."""
    specs = sw["specs"]
    L = [OUTLIERS_BEGIN, "## Outlier magnitude sweep (TAH-Quant)", ""]
    if command_line:
        L += [f"Produced by `{command_line}`" + (f", {sw['date']}, {sw['seconds']} s" if "date" in sw else "")
              + ".", ""]
    L += ["NMSE on the *ordinary* elements (`sum (x - y)^2 / sum x^2` over the elements the generator left "
          "alone) of `qwire.codecs.synthetic.llm_like` inputs: `channels` = outlier channels in every "
          "token, `massive` = massive activations (first token + 3 random positions per sequence, a few "
          "channels), `both` = the two together, every outlier at the given multiple of the base's RMS "
          "(massive ones 0.5-1x of it) and alone in its tile; `pair` = two outlier channels in one tile of 32 "
          "(each 0.75-1.25x of the magnitude per element, so never one far above the other: no tile is "
          "rotated), which one rotation per tile cannot serve; it is not a target. Row `0` is the base "
          "without outliers. The header gives each configuration's bits/element.", ""]
    for b, shape in sw["shapes"].items():
        for kind in OUTLIER_KINDS:
            sel = [r for r in sw["rows"] if r["base"] == b and r["kind"] in (kind, "none")]
            first = next((r for r in sel if r["kind"] == kind), None)
            if first is None:
                continue
            what = ", ".join(f"{k}={first[k]}" for k in ("massive", "outlier_channels", "pairs") if k in first)
            bits = {r["name"]: r["bits"] for r in sel}
            L += [f"### {b} {shape}, {kind} ({what})", "",
                  "| magnitude | " + " | ".join(f"`{s}` ({bits.get(s, 0):.3f} b)" for s in specs) + " |",
                  "|---|" + "---|" * len(specs)]
            for mag in [0, *sw["magnitudes"]]:
                cells = {r["name"]: r["nmse"] for r in sel if r["magnitude"] == mag}
                if cells:
                    L.append(f"| {mag} | " + " | ".join(fmt(cells.get(s), digits=4) for s in specs) + " |")
            L.append("")
    L += ["Targets (the default `tahquant`): NMSE at 10^4x within 1.5x of that at 300x; at or below (within "
          "0.1%) each other configuration at every magnitude:", ""]
    L += _outlier_checks(sw["targets"])
    for opt in sw.get("options") or ([sw["option"]] if sw.get("option") else []):
        L += ["", f"The same tests for `{opt['spec']}`, an option at the default's bits/element, against "
                  "every other configuration of the tables (not a target; docs/codecs.md says why it is not the "
                  "default):", ""]
        L += _outlier_checks(opt["checks"])
    if sw.get("design"):
        L += ["", *zero_ext_markdown(sw["design"])]
    L += ["", OUTLIERS_END]
    return L


def _outlier_checks(targets: dict[str, Any]) -> list[str]:
    """One line per input of :func:`outlier_targets`' verdicts."""
    L = []
    for key, t in targets.items():
        parts = [f"10^4x / 300x = {t['ratio_1e4_over_300']:.3f} {_verdict(t['flat'])}"]
        parts += [f"<= `{k[3:]}` {_verdict(v)}" for k, v in t.items() if k.startswith("<= ")]
        L.append(f"- {key}: " + "; ".join(parts))
    return L


def zero_ext_design(args: argparse.Namespace, specs: list[str] | None = None) -> dict[str, Any]:
    """NMSE (dB) of the zero-extension design choices on the benchmark's inputs, tiles far from 0
    (N(0, 1) + 10 and + 20: 2 and 4 tile ranges away) and LLM-like inputs at 10^4x (ordinary
    elements), with bits/element at :data:`ZERO_EXT_CHANNELS` channels."""
    from qwire.codecs.synthetic import llm_like, ordinary_nmse

    specs = list(specs or ZERO_EXT_DESIGN)
    inputs, _ = build_inputs(args)
    with torch.random.fork_rng():
        torch.manual_seed(args.seed + 11)
        shape = (2, 64, 512) if args.quick else (4, 64, 1024)
        off = torch.randn(shape)
    cases: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {k: (v, None) for k, v in inputs.items()}
    cases["offset +10"], cases["offset +20"] = (off + 10, None), (off + 20, None)
    for kind in ("channels", "both"):
        x, o = llm_like(shape, magnitude=1e4, channel_magnitude=1e4, seed=args.seed, **OUTLIER_KINDS[kind])
        cases[f"{kind} 1e4 (ordinary)"] = (x, o)
    rows = []
    for spec in specs:
        codec = make_codec(spec)
        row: dict[str, Any] = {"name": spec, "spec": codec.spec(),
                               "bits": {str(c): round(codec.bits_per_element((8, 128, c)), 4)
                                        for c in ZERO_EXT_CHANNELS}, "nmse_db": {}}
        for k, (x, o) in cases.items():
            y = codec.decode(codec.encode(x), x.shape, x.dtype)
            e = ordinary_nmse(x, y, o if o is not None else torch.ones_like(x, dtype=torch.bool))
            row["nmse_db"][k] = round(10 * math.log10(e), 3) if e > 0 else -math.inf
        rows.append(row)
    return {"inputs": {k: list(v[0].shape) for k, v in cases.items()}, "rows": rows}


def zero_ext_markdown(d: dict[str, Any]) -> list[str]:
    names = list(d["inputs"])
    L = ["### Zero extension: the choices behind the default", "",
         "NMSE in dB (lower is better) on the benchmark's inputs, on tiles far from 0 (N(0, 1) + 10 / + 20, "
         "2 and 4 tile ranges away) and on the ordinary elements of LLM-like inputs at 10^4x (4 outlier "
         "channels; + 2 massive channels); bits/element at C = "
         + "/".join(str(c) for c in ZERO_EXT_CHANNELS) + " (limit 4.41).", "",
         "| configuration | bits/element | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in d["rows"]:
        bits = "/".join(f"{v:.3f}" for v in r["bits"].values())
        L.append(f"| `{r['name']}` | {bits} | " + " | ".join(fmt(r["nmse_db"].get(k), digits=2) for k in names) + " |")
    return L + [""]


def _outlier_bases(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(args.seed + 7)
        bases = {"randn": torch.randn((2, 64, 512) if args.quick else (4, 256, 1024))}
    if not (args.quick or args.no_real):
        from qwire.bench.capture import load_or_capture
        bases["activation"] = load_or_capture(args.capture, steps=args.capture_steps)["activation"].float()
    return bases


def _run_outliers(args: argparse.Namespace, t0: float) -> int:
    """``--only outliers``: run the sweep and replace its section of codecs.json and codecs.md."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sw = outlier_sweep(_outlier_bases(args), seed=args.seed)
    sw["design"] = zero_ext_design(args)
    sw.update(command=bench_command("codecs", args, add_arguments), date=time.strftime("%Y-%m-%d"),
              seconds=round(time.time() - t0, 1))
    jpath, mpath = out / "codecs.json", out / "codecs.md"
    res = json.loads(jpath.read_text()) if jpath.is_file() else {}
    res["outlier_sweep"] = sw
    jpath.write_text(json.dumps(res, indent=1, default=str))
    section = "\n".join(outlier_markdown(sw, sw["command"]))
    md = mpath.read_text() if mpath.is_file() else "# Codec benchmark\n"
    if OUTLIERS_BEGIN in md and OUTLIERS_END in md:
        head, rest = md.split(OUTLIERS_BEGIN, 1)
        md = head + section + rest.split(OUTLIERS_END, 1)[1]
    else:
        md = md.rstrip("\n") + "\n\n" + section + "\n"
    mpath.write_text(md)
    print(f"wrote the outlier sweep into {jpath} and {mpath} ({time.time() - t0:.0f} s)")
    return 0


# --------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    if args.sizes_mb is not None:  # before the measurements that come first
        try:
            number_list(args.sizes_mb, "--sizes-mb")
        except ValueError as e:
            print(f"qwire bench codecs: {e}", file=sys.stderr)
            return 2
    if getattr(args, "device", "cpu") == "cuda":
        from qwire.bench import gpu

        return gpu.run(args, add_arguments)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    LAYOUTS.update(VARIANTS)  # benchmark-only layout variants (see make_codec)
    try:
        return _run(args, t0)
    finally:
        for k in VARIANTS:
            LAYOUTS.pop(k, None)


def _run(args: argparse.Namespace, t0: float) -> int:
    if getattr(args, "only", "all") == "outliers":
        return _run_outliers(args, t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    inputs, info = build_inputs(args)
    main = QUICK_MAIN if args.quick else MAIN
    if not args.quick:  # every other registered codec at its defaults
        seen = {get_codec(s).spec() for s in main}
        for name in available():
            c = get_codec(name)
            if not c.stateful and c.spec() not in seen:
                seen.add(c.spec())
                main.append(name)
    quality: dict[str, list[dict[str, Any]]] = {}
    for iname, x in inputs.items():
        rows = []
        for spec in main:
            rows.append(measure(spec, x))
        quality[iname] = rows
        print(f"quality: {iname} {tuple(x.shape)}: {len(rows)} codecs ({time.time() - t0:.0f} s)", flush=True)
    ablations: dict[str, dict[str, list[dict[str, Any]]]] = {}
    abl_inputs = [k for k in ("activation", "outliers", "gaussian") if k in inputs]
    for title, specs in (QUICK_ABLATIONS if args.quick else ABLATIONS).items():
        ablations[title] = {k: [measure(s, inputs[k]) for s in specs] for k in abl_inputs}
        print(f"ablation: {title} ({time.time() - t0:.0f} s)", flush=True)
    sizes = [1.0] if args.quick else [float(s) for s in (args.sizes_mb or "1,4,16,26,64").split(",") if s.strip()]
    load_before = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    tp = throughput(QUICK_MAIN[:4] if args.quick else THROUGHPUT, sizes, 1 if args.quick else args.repeat,
                    args.seed)
    targets = evaluate_targets(quality, ablations, tp, inputs)
    t_sweep = time.time()
    sweep = outlier_sweep(_outlier_bases(args), seed=args.seed)
    sweep["design"] = zero_ext_design(args)
    sweep.update(date=time.strftime("%Y-%m-%d"), seconds=round(time.time() - t_sweep, 1))
    meta = {
        "command": bench_command("codecs", args, add_arguments),
        "machine": machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0, 1), "quick": bool(args.quick),
        "load_avg_before_throughput": load_before,
    }
    result = {"meta": meta, "inputs": info, "quality": quality, "ablations": ablations, "throughput": tp,
              "targets": targets, "outlier_sweep": sweep}
    (out / "codecs.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "codecs.md").write_text(markdown(result))
    print(f"wrote {out / 'codecs.json'} and {out / 'codecs.md'} ({time.time() - t0:.0f} s)")
    return 0


# --------------------------------------------------------------------------------------------- targets
def _row(rows: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["name"] == name), None)


# the direct-quantization curves TAH-Quant's default is compared with, per metadata layout
DIRECT_CURVES = {"asymmetric, log layout": ["int3", "int4", "int5"],
                 "asymmetric, ref layout": ["int3:layout=ref", "int4:layout=ref", "int5:layout=ref"],
                 "symmetric, log layout": ["int3:symmetric=true", "int4:symmetric=true", "int5:symmetric=true"],
                 "asymmetric, log7 layout": ["int3:layout=log7", "int4:layout=log7", "int5:layout=log7"],
                 "asymmetric, log6 layout (the default's grid)": ["int3:layout=log6", "int4:layout=log6",
                                                                  "int5:layout=log6"]}
# shown next to them, not judged: direct quantization with the default's own encoder search (fit=mse), which
# the paper's baseline does not have
DIRECT_SHOWN = {"asymmetric, log6 layout, fit=mse": ["int3:layout=log6,fit=mse", "int4:layout=log6,fit=mse",
                                                     "int5:layout=log6,fit=mse"]}


def evaluate_targets(quality, ablations, tp, inputs) -> dict[str, Any]:
    """The codecs' targets (bits, error against direct quantization and the reference layout, speed), each with
    the numbers behind it and a verdict."""
    t: dict[str, Any] = {}
    # 1. default TAH-Quant cost <= 4.41 bits/element
    costs = {k: _row(rows, TAH)["bits"] for k, rows in quality.items() if _row(rows, TAH)}
    t["tah_default_bits"] = {"bits": costs, "limit": 4.41, "met": all(b <= 4.41 for b in costs.values())}
    # 2. lower error than direct quantization at equal bits (int3..int4 curve at G=32), real + outliers
    per = {}
    curve_name = "direct quantization curve (G=32)"
    for k in ("activation", "outliers"):
        if k not in quality:
            continue
        tah = _row(quality[k], TAH)
        rows = ablations.get(curve_name, {}).get(k) or quality[k]
        res = {"tah_bits": tah["bits"], "tah_db": tah["nmse_db"]}
        fit_rows = ablations.get(FIT_ABLATION, {}).get(k) or []
        for label, names in {**DIRECT_CURVES, **DIRECT_SHOWN}.items():
            pts = [(r["bits"], r["nmse_db"]) for n in names
                   if (r := _row(rows, n) or _row(quality[k], n) or _row(fit_rows, n))]
            at = interp_db(pts, tah["bits"]) if len(pts) >= 2 else None
            if at is None and len(pts) >= 2:  # outside the curve: extrapolate from its two nearest points
                (b0, d0), (b1, d1) = sorted(pts, key=lambda p: abs(p[0] - tah["bits"]))[:2]
                at = d0 + (d1 - d0) * (tah["bits"] - b0) / (b1 - b0)
            res[label] = None if at is None else round(at, 3)
        # what mixing int3 and int4 tiles reaches at the same rate (its MSE is the mix of theirs); shown,
        # not judged: the curve above interpolates in dB, which no mix of the two widths reaches
        ends = sorted((r["bits"], r["nmse"]) for n in ("int3", "int4") if (r := _row(rows, n) or _row(quality[k], n)))
        if len(ends) == 2:
            (b0, e0), (b1, e1) = ends
            lam = min(1.0, max(0.0, (tah["bits"] - b0) / (b1 - b0)))
            res["int3/int4 tile mix"] = round(10 * math.log10(lam * e1 + (1 - lam) * e0), 3)
        res["met"] = all(v is None or tah["nmse_db"] < v for kk, v in res.items() if kk in DIRECT_CURVES)
        per[k] = res
    t["tah_vs_direct"] = per
    # 3. cheaper layout beats ref at equal bits. Layout-only comparisons (the same method, the log
    # layout at equal or fewer bits, within the 0.001 bits/element of its anchors), then whole
    # configurations against the public code's, shown but not part of the verdict.
    pairs = [("int4", "int4:tile=64,layout=ref", True), ("int3", "int3:tile=64,layout=ref", True),
             (PREV, "tahquant:tile=64,layout=ref,max_rotated=1,ratio=0.8,slots=token,tau=2.0", True),
             (_prev("unit=token,alloc=entropy"), PUBLIC, False), (TAH, PUBLIC, False)]
    lay = {}
    for k in quality:
        res = []
        for cheap, ref, layout_only in pairs:
            a, b = _row(quality[k], cheap), _row(quality[k], ref)
            if a and b:
                res.append({"log": cheap, "ref": ref, "log_bits": a["bits"], "ref_bits": b["bits"],
                            "log_db": a["nmse_db"], "ref_db": b["nmse_db"], "layout_only": layout_only,
                            "met": a["bits"] <= b["bits"] + 1e-3 and a["nmse_db"] < b["nmse_db"]})
        # same tile size, rate-distortion curves over rho: interpolate log's curve at ref's rate
        rr = ablations.get("ratio rho (rate)" + PREV_NOTE, {}).get(k)
        rf = ablations.get("ratio rho, reference layout", {}).get(k)
        if rr and rf:
            curve = [(r["bits"], r["nmse_db"]) for r in rr]
            for r in rf:
                at = interp_db(curve, r["bits"])
                if at is not None:
                    res.append({"log": f"{PREV}, rho curve at G=32", "ref": r["name"], "log_bits": r["bits"],
                                "ref_bits": r["bits"], "log_db": round(at, 3), "ref_db": r["nmse_db"],
                                "layout_only": True, "met": at < r["nmse_db"]})
        lay[k] = res
    t["layout_vs_ref"] = lay
    only = [r["met"] for rows in lay.values() for r in rows if r["layout_only"]]
    t["layout_vs_ref_met"] = all(only) if only else None
    # stretch: <= 4.0 bits with error no worse than the reference layout at 4.41 (the public code's config)
    stretch = {}
    for k, rows in ablations.get("<= 4.0 bits/element (stretch)", {}).items():
        ref = _row(quality[k], PUBLIC)
        ok = [r for r in rows if r["bits"] <= 4.0]
        best = min(ok, key=lambda r: r["nmse_db"]) if ok else None
        stretch[k] = {"ref": PUBLIC, "ref_bits": ref["bits"], "ref_db": ref["nmse_db"],
                      "best": best and best["name"], "best_bits": best and best["bits"],
                      "best_db": best and best["nmse_db"],
                      "met": bool(best) and best["nmse_db"] <= ref["nmse_db"]}
    t["stretch_4bits"] = stretch
    # throughput: encode+decode at 1 thread vs a copy, the default implementation, every size
    thr: dict[str, dict[str, float]] = {}
    for r in tp:  # rows come reference first, so the default implementation's row is the last one written
        if r["name"] in SPEED_TARGETS and r.get("threads", 1) == 1:
            thr.setdefault(r["name"], {})[str(r["mb"])] = round(r["roundtrip_vs_copy"], 4)
    # judged at the size nearest TARGET_MB (the other sizes are in the table)
    at = {k: min(d, key=lambda mb: abs(float(mb) - TARGET_MB)) for k, d in thr.items()}
    t["throughput_ratio"] = {"limits": SPEED_TARGETS, "ratios": thr, "mb": {k: float(v) for k, v in at.items()},
                             "met": {k: d[at[k]] >= SPEED_TARGETS[k] for k, d in thr.items()}}
    return t


# --------------------------------------------------------------------------------------------- analysis
def _abl(res: dict[str, Any], title: str, inp: str, name: str) -> dict[str, Any] | None:
    return _row(res["ablations"].get(title, {}).get(inp, []), name)


def analysis(res: dict[str, Any]) -> list[str]:
    """Why the targets came out as they did, with the numbers of this run."""
    t = res["targets"]
    L = ["### Why", ""]
    tv = t["tah_vs_direct"]
    missed = [k for k, r in tv.items() if not r["met"]]
    if missed:
        k = missed[0]
        sl = "pivot and zero extension: in the rotated tile (slots=tile, the default) or in slots per token"
        d, i7 = _abl(res, sl, k, TAH), _abl(res, sl, k, "int4:layout=log6")
        inf, prev, l7 = _abl(res, sl, k, "tahquant:tau=inf"), _abl(res, sl, k, PREV), _abl(res, sl, k, LOG7)
        behind = [lab for lab, v in tv[k].items() if "layout" in lab and v is not None and tv[k]["tah_db"] >= v]
        text = (f"- TAH-Quant vs direct quantization on `{k}`: the default is behind the "
                + ", ".join(f"{lab} line ({tv[k][lab]:.2f} dB)" for lab in behind)
                + f" at its {tv[k]['tah_bits']:.3f} bits ({tv[k]['tah_db']:.2f} dB).")
        if d and i7:
            text += (f" Without outliers it codes every tile on the grid of direct `int4:layout=log6` "
                     f"({i7['nmse_db']:.2f} dB at {i7['bits']:.3f} bits) and adds one rotation flag per tile "
                     f"({d['bits'] - i7['bits']:.3f} bits/element), which buys nothing on outlier-free input, while "
                     "the direct curves rise from int4 toward int5 over those bits")
            if inf:
                text += f" (`tau=inf`, never rotating: {inf['nmse_db']:.2f} dB at {inf['bits']:.3f} bits)"
            text += "."
        if prev:
            text += (f" The previous default (`{PREV}`, 4/3-bit tiles with pivot slots per token) reaches "
                     f"{prev['nmse_db']:.2f} dB at {prev['bits']:.3f} bits.")
        if l7:
            text += f" The default before `log6t` (`{LOG7}`) reaches {l7['nmse_db']:.2f} dB at {l7['bits']:.3f} bits."
        L.append(text + " On outlier-heavy inputs the rotation dominates and TAH-Quant is far ahead.")
    L += _operating_point(res)
    st = t["stretch_4bits"]
    if st and not all(r["met"] for r in st.values()):
        L.append("- Stretch (<= 4.0 bits): at G=32 the 4/3-bit codes alone cost 3.8 bits at rho=0.8, so 4.0 "
                 "bits all included forces rho down to ~0.4 (more 3-bit tiles) or G up to 64 (coarser tiles); "
                 "the cheaper metadata wins back ~0.5 dB of that, not the ~1.5 dB the extra 3-bit tiles cost.")
    span = {}
    for r in res["throughput"]:
        if r.get("threads", 1) == 1:
            key = (r["name"], r.get("impl", "torch"))
            lo_hi = span.setdefault(key, [math.inf, 0.0])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], r["roundtrip_vs_copy"]), max(lo_hi[1], r["roundtrip_vs_copy"])
    if span:
        ranges = ", ".join(f"`{k}` {impl} {a:.3f}-{b:.3f}" for (k, impl), (a, b) in span.items())
        L.append("- Throughput at 1 thread (ratio to the copy, smallest-largest over the sizes): " + ranges
                 + ". `torch` rows are the eager reference (one pass over memory per operation); `cpu` rows "
                 "the compiled kernels (see docs/kernels.md for what bounds each).")
    L.append("")
    return L


def _operating_point(res: dict[str, Any]) -> list[str]:
    """The G=64 5/4-bit operating point (the alternative to the previous default) against the int3-int4 line
    on the outlier-free activation, against the default there, and in the outlier sweep."""
    op = "operating point at <= 4.41 bits/element (direct int4 at G=64 for scale)"
    curve = "direct quantization curve (G=32)"
    k = "activation"
    g, d, i64 = _abl(res, op, k, G64), _abl(res, op, k, TAH), _abl(res, op, k, "int4:tile=64")
    pts = [(r["bits"], r["nmse_db"]) for n in ("int3", "int4") if (r := _abl(res, curve, k, n))]
    if not (g and d and i64 and len(pts) == 2):
        return []
    (b0, d0), (b1, d1) = sorted(pts)
    line = d0 + (d1 - d0) * (g["bits"] - b0) / (b1 - b0)
    go, do = _abl(res, op, "outliers", G64), _abl(res, op, "outliers", TAH)
    text = (f"- Operating point: at G=64 the metadata costs half as much per element, which pays for 4-bit codes "
            f"everywhere and 5 bits on the widest 10% of the tokens: `{G64}` reaches {g['nmse_db']:.2f} dB at "
            f"{g['bits']:.3f} bits on `{k}`, {'below' if g['nmse_db'] < line else 'above'} the int3-int4 line "
            f"there ({line:.2f} dB), where the default "
            f"reaches {d['nmse_db']:.2f} dB at {d['bits']:.3f} bits; direct `int4:tile=64` alone: "
            f"{i64['nmse_db']:.2f} dB at {i64['bits']:.3f} bits")
    if go and do:
        text += f"; on `outliers` {go['nmse_db']:.2f} dB against the default's {do['nmse_db']:.2f} dB"
    text += ("."
             " It is not the default: a 64-channel tile holds two outlier channels more often than a 32-channel one,"
             " and one rotation (one pivot) serves one outlier")
    rows = (res.get("outlier_sweep") or {}).get("rows", [])
    worst = None
    for r in rows:
        if r["name"] == G64 and r["magnitude"] == max(OUTLIER_MAGNITUDES):
            mine = next((q for q in rows if q["name"] == TAH and q["base"] == r["base"] and q["kind"] == r["kind"]
                         and q["magnitude"] == r["magnitude"]), None)
            if mine and (worst is None or r["nmse"] / mine["nmse"] > worst[0]["nmse"] / worst[1]["nmse"]):
                worst = (r, mine)
    if worst:
        r, mine = worst
        text += (f": in the outlier sweep below ({r['base']}, {r['kind']}, at {r['magnitude']}x) its NMSE on the "
                 f"ordinary elements is {r['nmse']:.4f} against the default's {mine['nmse']:.4f}")
    return [text + "."]


# --------------------------------------------------------------------------------------------- markdown
def _table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| codec | bits/elem | NMSE | SNR dB | max abs err | gap to RD bound dB |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| `{r['name']}` | {fmt(r['bits'])} | {fmt(r['nmse'])} | {fmt(r['snr_db'], digits=2)} | "
                   f"{fmt(r['max_abs_err'])} | {fmt(r['rd_gap_db'], digits=2)} |")
    return out


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    threads = f"{m['threads']} thread" + ("s" if m["threads"] != 1 else "")
    L = ["# Codec benchmark", "",
         f"Produced by `{m['command']}` on {m['machine']} (torch {m['torch']}, {threads}), "
         f"{m['date']}, {m['seconds']} s; 1-minute load average before the throughput runs: "
         f"{m.get('load_avg_before_throughput')} (other jobs share the machine)."
         + (" **Quick smoke run: small synthetic inputs only.**" if m["quick"] else ""), ""]
    cap = res["inputs"].get("capture")
    L += ["## Inputs", ""]
    if cap:
        L.append(f"- `activation` / `gradient` {res['inputs']['shapes'].get('activation')}: the hidden state at "
                 f"the middle pipeline boundary ({cap['boundary']}) of `{cap['preset']}` trained {cap['steps']} "
                 f"steps (batch {cap['batch_size']} x {cap['seq_len']} tokens, lr {cap['lr']}) on the "
                 f"`{cap['corpus']}` "
                 f"corpus (train loss {cap['train_loss_first']:.2f} -> {cap['train_loss_last10']:.2f}, "
                 f"validation {cap['val_loss']:.2f}), and the gradient of the loss sent back across it; "
                 "validation batches.")
    L.append(f"- `gaussian` {res['inputs']['shapes']['gaussian']}: N(0, 1).")
    L.append(f"- `outliers` {res['inputs']['shapes']['outliers']}: Student-t (5 d.o.f.) with 8 channels "
             "scaled 20-100x.")
    L += ["", "NMSE is `sum (x - y)^2 / sum x^2`; bits/element are counted from the payload length "
          "(codes, scales, bitmaps, pivots, anchors: everything sent); the gap to the Gaussian "
          "rate-distortion bound is `10 log10(NMSE) + 6.02 R` dB at the codec's rate R (0 dB = the bound; "
          "only meaningful for the Gaussian input).", ""]
    # targets
    t = res["targets"]
    L += ["## Targets", ""]
    tb = t["tah_default_bits"]
    L.append(f"1. TAH-Quant's default configuration (`{TAH}`: G=32, 4-bit tiles, `log6t` metadata, pivots and "
             f"each block's width of zero extension in the rotated tiles) costs at most 4.41 "
             f"bits/element all included: {_verdict(tb['met'])} - "
             + ", ".join(f"{k} {v:.3f}" for k, v in tb["bits"].items()) + ".")
    tv = t["tah_vs_direct"]
    if tv:
        parts = []
        for k, r in tv.items():
            curves = ", ".join(f"{lab} {fmt(r.get(lab), digits=2)} dB" for lab in DIRECT_CURVES if lab in r)
            parts.append(f"{k}: TAH-Quant {r['tah_db']:.2f} dB at {r['tah_bits']:.3f} bits vs the direct curves "
                         f"at that rate: {curves} -> {_verdict(r['met'])}"
                         + (f" (int3 and int4 tiles mixed at that rate, for scale: {r['int3/int4 tile mix']:.2f} dB)"
                            if r.get("int3/int4 tile mix") is not None else "")
                         + "".join(f" (not judged: {lab}, the default's encoder search on direct quantization, "
                                   f"{fmt(r[lab], digits=2)} dB)" for lab in DIRECT_SHOWN if r.get(lab) is not None))
        L.append("2. TAH-Quant's default has lower error (NMSE) than direct quantization at equal bits/element "
                 "on the real and outlier inputs (the int3-int4-int5 curve at G=32 of each metadata layout, linear "
                 "in dB): " + "; ".join(parts)
                 + ".")
    lv = t["layout_vs_ref"]
    lines = []
    for k, rows in lv.items():
        for r in rows:
            kind = "layout" if r["layout_only"] else "configuration"
            lines.append(f"| {k} | {kind} | `{r['log']}` | {r['log_bits']:.3f} | {r['log_db']:.2f} | `{r['ref']}` | "
                         f"{r['ref_bits']:.3f} | {r['ref_db']:.2f} | {_verdict(r['met'])} |")
    L.append("3. The cheaper metadata layout (`log`, 16 bits per tile) beats the reference layout (`ref`, fp16 "
             "step + fp16 zero) at equal or fewer bits/element (same method; comparisons in the table below "
             "marked *layout*): " + ("not measured (quick run)" if t["layout_vs_ref_met"] is None
                                     else _verdict(t["layout_vs_ref_met"])) + ".")
    st = t["stretch_4bits"]
    if st:
        parts = [f"{k}: best `{r['best']}` {fmt(r['best_db'], digits=2)} dB at {fmt(r['best_bits'])} bits vs "
                 f"`{r['ref']}` {r['ref_db']:.2f} dB at {r['ref_bits']:.3f} bits -> {_verdict(r['met'])}"
                 for k, r in st.items()]
        L.append("4. Stretch: a configuration at <= 4.0 bits/element with error no worse than the reference "
                 "layout at 4.41 (the public code's configuration): " + "; ".join(parts) + ".")
    tr = t["throughput_ratio"]
    L.append(f"5. Encode + decode at 1 thread on a {TARGET_MB:.0f} MB tensor, default implementation, as a "
             "fraction of a plain copy timed in the same loop: "
             + ", ".join(f"`{k}` {tr['ratios'][k][str(tr['mb'][k])]:.3f} (target {tr['limits'][k]}) "
                         f"{_verdict(v)}" for k, v in tr["met"].items())
             + " (every size in the throughput table below).")
    L += ["", "| input | compares | log | bits | NMSE dB | ref | bits | NMSE dB | log better |",
          "|---|---|---|---|---|---|---|---|---|", *lines, ""]
    L += analysis(res)
    # main tables
    L += ["## Every codec", ""]
    for k, rows in res["quality"].items():
        L += [f"### {k}", "", *_table(rows), ""]
    L += ["## TAH-Quant ablations", ""]
    for title, per in res["ablations"].items():
        L += [f"### {title}", ""]
        for k, rows in per.items():
            L += [f"{k}:", "", *_table(rows), ""]
    L += ["## Throughput", "",
          "Encode and decode of a Student-t tensor with outlier channels, `[rows, 2048]` fp32; GB/s of "
          "fp32 input; the best of the repetitions. `copy` is `y.copy_(x)` of the same tensor timed in "
          "the same loop; `ratio` is copy time / (encode + decode time).", "",
          "| codec | impl | threads | MB | encode GB/s | decode GB/s | enc+dec GB/s | copy GB/s | ratio |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in res["throughput"]:
        L.append(f"| `{r['name']}` | {r.get('impl', 'torch')} | {r.get('threads', m['threads'])} | {r['mb']:g} | "
                 f"{r['encode_gbs']:.3f} | {r['decode_gbs']:.3f} | {r['roundtrip_gbs']:.3f} | {r['copy_gbs']:.2f} | "
                 f"{r['roundtrip_vs_copy']:.3f} |")
    L.append("")
    if res.get("outlier_sweep"):
        L += outlier_markdown(res["outlier_sweep"], m["command"]) + [""]
    return "\n".join(L)
