"""``qwire bench pipeline``: pipeline training over real rate-limited links, method against method.

The end-to-end study of compressed pipeline boundaries. Four parts, all in one
invocation, written to ``<out>/pipeline.json``, ``<out>/pipeline.md``,
``<out>/pipeline_throughput.png`` and ``<out>/pipeline_loss.png``:

1. **Throughput sweep.** For every link of ``--rates`` and every method, a
   short ``qwire train`` run (``--steps``, the first ``--skip`` left out) with
   every rank behind a ``tc``-shaped link of that rate (``qwire.netlab``), plus
   ``none``: loopback, the compute-only ceiling. Methods are interleaved within
   a link, so a change in the machine's load hits all of them alike. Records
   tokens/s and the bytes each step puts on the pipeline links.
2. **Paper regime.** ``paper:<rate>`` entries of ``--rates`` are links on which
   FP32's communication-to-compute ratio equals GPT2-XL's in the TAH-Quant
   paper's setting at ``<rate>``. They are worked out from this invocation's
   FP32 run without a link (see :func:`paper_equivalent`).
3. **Convergence.** Runs without a link (the loss does not depend on the
   link: same seed, same data order, deterministic codecs) for ``--conv-steps``
   steps over a training set capped so that they make ``--epochs`` epochs
   (AQ-SGD's cache only pays off when samples come back), one per method and
   seed of ``--seeds`` (default 3; a seed sets the initialization and the data
   order, the same for every method, so per-seed gaps to FP32 are paired).
   ``--ablations`` adds TAH-Quant variants (:data:`ABLATIONS`) on
   ``--ablation-seeds``. ``--only convergence`` runs this part alone and
   replaces its section of an existing ``pipeline.json`` / ``pipeline.md``;
   ``--resume`` reuses the runs of ``pipeline.json`` whose configuration
   (the resolved codec specs and every training setting; a setting added
   since a run was made counts only away from its default) is the same, and
   those of ``pipeline.partial.json``, where an interrupted run keeps what it
   measured (``pipeline.json`` and the page stay as they were until a run
   ends); a resumed run keeps the sections it skips (``--skip-throughput``,
   ``--skip-robustness``) as measured before.
4. **Robustness.** The default training (shortened to ``--robust-steps``) over
   ``--robust-link`` (1% loss, 50 ms delay) against the same run without a link.

The default is 2 stages (``--stages``): on a 2-core machine that is one process per core, so stages
compute in parallel as on separate machines; more stages than cores time-share the cores and charge
every stage for the others' codec work.

Methods (forward codec / backward codec): FP32 ``fp32/fp32``, FP16
``fp16/fp16``, direct int4 ``int4/perchannel8``, AQ-SGD
``aqsgd:inner=int4/perchannel8``, TAH-Quant ``tahquant/perchannel6``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from qwire.bench import add_out_argument
from qwire.bench.report import (
    bench_command,
    finish,
    fmt,
    fmt_mb,
    loadavg,
    machine,
    machine_info,
    md_row,
    md_table,
    plot_train_val,
    pyplot,
    render_saved,
    smooth,
)
from qwire.bench.runner import records as _records
from qwire.bench.runner import train_command as _train_command
from qwire.bench.runner import train_quietly as _train
from qwire.checkpoint import atomic_write

# method -> (label, forward codec, backward codec)
METHODS: dict[str, tuple[str, str, str]] = {
    "fp32": ("FP32", "fp32", "fp32"),
    "fp16": ("FP16", "fp16", "fp16"),
    "int4": ("direct int4", "int4", "perchannel8"),
    "aqsgd": ("AQ-SGD", "aqsgd:inner=int4", "perchannel8"),
    "tahquant": ("TAH-Quant", "tahquant", "perchannel6"),
}
# TAH-Quant ablations of the convergence part (issue: is TAH-Quant's gap to FP32 real, and where from?). The
# ones marked "slots=token" are variants of the previous default (4/3-bit tiles, pivot slots per token, logx),
# pinned so that they keep meaning what they measured.
# qwire.codecs.tahquant.PREVIOUS_DEFAULT, spelled out so that this module imports without torch
# (tests/test_bench_pipeline.py checks they agree)
_PREV = "tahquant:slots=token,ratio=0.8,layout=logx,zero_ext=8,tau=2.0,fit=minmax"
ABLATIONS: dict[str, tuple[str, str, str]] = {
    "tah-prev": ("TAH-Quant before slots=tile (4/3 bits, pivot slots)", _PREV, "perchannel6"),
    "tah-ratio1": ("TAH-Quant slots=token ratio=1.0",
                   "tahquant:slots=token,ratio=1.0,layout=logx,zero_ext=8,tau=2.0,fit=minmax", "perchannel6"),
    "tah-tauinf": ("TAH-Quant tau=inf", "tahquant:tau=inf", "perchannel6"),
    "tah-bwd8": ("TAH-Quant, backward 8-bit", "tahquant", "perchannel8"),
    "tah-rot1": ("TAH-Quant slots=token max_rotated=1", _PREV + ",max_rotated=1", "perchannel6"),
    "tah-sr": ("TAH-Quant stochastic rounding", "tahquant:rounding=stochastic", "perchannel6"),
    "tah-entropy": ("TAH-Quant slots=token alloc=entropy", _PREV + ",alloc=entropy", "perchannel6"),
    # not one change: the G=64 operating point that meets the int3-int4 line (docs/codecs.md)
    "tah-g64": ("TAH-Quant G=64 5/4 bits", "tahquant:tile=64,high_bits=5,low_bits=4,ratio=0.1,unit=token,"
                "max_rotated=0.25,slots=token,layout=logx,zero_ext=8,tau=2.0,fit=minmax", "perchannel6"),
    # the default before fit=mse and tau=2.5: every tile's grid covers it (qwire.codecs.tahquant.MINMAX_DEFAULT)
    "tah-minmax": ("TAH-Quant fit=minmax tau=2", "tahquant:layout=log7,tau=2.0,fit=minmax", "perchannel6"),
    # the default before log6t and zero_width=block (qwire.codecs.tahquant.LOG7_DEFAULT)
    "tah-log7": ("TAH-Quant before log6t (log7, 9-bit zero extension)", "tahquant:layout=log7,fit_rotated=false",
                 "perchannel6"),
    # that default with the rotated tiles' grids searched too (qwire.codecs.tahquant.ROTATED_FIT)
    "tah-fitrot": ("TAH-Quant log7 fit_rotated=true", "tahquant:layout=log7,fit_rotated=true", "perchannel6"),
    # and per block the layout and zero-extension width of lowest error (qwire.codecs.tahquant.ADAPTIVE; an option)
    "tah-adapt": ("TAH-Quant adapt=block", "tahquant:layout=log7,adapt=block,fit_rotated=true", "perchannel6"),
    # the same choice predicted from one trial encode (qwire.codecs.tahquant.PREDICTED; an option)
    "tah-predict": ("TAH-Quant adapt=predict", "tahquant:layout=log7,adapt=predict,fit_rotated=true",
                    "perchannel6"),
}
ALL_METHODS = {**METHODS, **ABLATIONS}
DEFAULT_SEEDS = 3
DEFAULT_RATES = "none,1gbit,paper:1gbps,paper:500mbps,paper:300mbps,paper:100mbps,paper:50mbps"
QUICK_RATES = "none,paper:100mbps"
PARTIAL = "pipeline.partial.json"  # beside pipeline.json: the runs of an interrupted run, for --resume
ROBUST_LINK = "100mbit,delay=50ms,loss=1%"

# The TAH-Quant paper's GPT2-XL setting: 8 stages, micro-batch 1, batch 32,
# sequence 1024, hidden 1600, fp32 activations; published tokens/s per link (FP32, AQ-SGD, TAH-Quant).
PAPER = {
    "model": "GPT2-XL", "stages": 8, "batch": 32, "micro_batch": 1, "seq_len": 1024, "hidden": 1600,
    "bytes_per_element": 4,
    "table": {1000: {"fp32": 2600, "aqsgd": 4749, "tahquant": 5650},
              500: {"fp32": 2482, "aqsgd": 4311, "tahquant": 5749},
              300: {"fp32": 1761, "aqsgd": 4369, "tahquant": 5120},
              100: {"fp32": 751, "aqsgd": 3310, "tahquant": 4045}},
    "targets": {"over_fp32": 4.3, "over_aqsgd": 1.33},
}
# tokens per step, fp32 bytes through one boundary per step (forward activations + backward gradients)
PAPER_TOKENS_PER_STEP = PAPER["batch"] * PAPER["seq_len"]
PAPER_BOUNDARY_BYTES = 2 * PAPER_TOKENS_PER_STEP * PAPER["hidden"] * PAPER["bytes_per_element"]
# Compute-bound rate: the fastest published row (TAH-Quant at 500 Mbps sends ~7x less than FP32 and is
# flat from 500 Mbps to 1 Gbps, so it is close to the compute-only ceiling).
PAPER_COMPUTE_TOKENS_PER_S = 5749.0

QUICK = dict(batch_size=4, microbatches=2, seq_len=32, vocab_size=512, max_tokens=60_000, eval_batches=2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_argument(p, "where pipeline.json, pipeline.md and the plots go")
    p.add_argument("--runs", default="runs/bench-pipeline",
                   help="where the training runs go (one timestamped folder per invocation)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model settings and a few steps (smoke test; rates default to " + QUICK_RATES + ")")
    p.add_argument("--rates", default="",
                   help="comma-separated links: none (loopback: the compute-only ceiling), a rate such as 50mbit, "
                        "or paper:RATE (FP32's comm/compute ratio of GPT2-XL in the paper at RATE, e.g. "
                        f"paper:100mbps; needs none and fp32). Default: {DEFAULT_RATES}")
    p.add_argument("--link-options", default="",
                   help="appended to every link spec, e.g. mode=sim for the simulated link (docs/netlab.md)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--conv-methods", default="", help="methods of the convergence part (default: --methods)")
    p.add_argument("--stages", type=int, default=2,
                   help="pipeline stages of the throughput and convergence runs (default 2: one process per core "
                        "on a 2-core machine)")
    p.add_argument("--steps", type=int, default=0, help="steps per throughput run (default 12; --quick 4)")
    p.add_argument("--skip", type=int, default=-1, help="warm-up steps left out of tokens/s (default 3; --quick 1)")
    p.add_argument("--repeat", type=int, default=1, help="sweeps over all links and methods (median reported)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: every stage on the GPU(s); with fewer GPUs than stages the stages share them over "
                        "gloo, payloads staged through host memory (qwire train --backend auto), e.g. "
                        "--device cuda --model gpt2-xl --seq-len 1024 --batch-size 4 --microbatches 4 --stages 4")
    p.add_argument("--conv-steps", type=int, default=0, help="steps per convergence run (default 300; --quick 8)")
    p.add_argument("--epochs", type=float, default=4.0,
                   help="epochs the convergence runs make: the training set is capped to conv-steps * batch / epochs "
                        "sequences")
    p.add_argument("--eval-every", type=int, default=0, help="validation interval of the convergence runs "
                                                             "(default: conv-steps / 10)")
    p.add_argument("--robust-link", default=ROBUST_LINK, help="link of the robustness run")
    p.add_argument("--robust-steps", type=int, default=0,
                   help="steps of the robustness runs (the default training, shortened; default 100; --quick 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the throughput and robustness runs")
    p.add_argument("--seeds", default="",
                   help="comma-separated seeds of the convergence runs, each for every method (a seed sets the "
                        f"initialization and the data order); default: {DEFAULT_SEEDS} seeds from --seed on "
                        "(--quick: --seed alone)")
    p.add_argument("--ablations", default="",
                   help=f"TAH-Quant variants added to the convergence part: all, or a subset of "
                        f"{', '.join(ABLATIONS)}")
    p.add_argument("--ablation-seeds", default="", help="seeds of the ablation runs (default: the first of --seeds)")
    p.add_argument("--only", choices=("all", "convergence", "robustness"), default="all",
                   help="convergence or robustness: run only that part and replace its section of pipeline.json / "
                        "pipeline.md in --out (the other sections stay as measured)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the convergence runs of <out>/pipeline.json (and of pipeline.partial.json, an "
                        "interrupted run's) whose configuration is the same: codec specs as resolved now and every "
                        "training setting (the page names the machine and torch of reused runs made elsewhere); the "
                        "sections --skip-throughput/--skip-robustness skip stay as measured")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-convergence", action="store_true")
    p.add_argument("--skip-robustness", action="store_true")
    p.add_argument("--render-only", action="store_true",
                   help="re-render pipeline.md and the plots from the pipeline.json in --out (no training)")


# -----------------------------------------------------------------------------------------------
# The run.


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.render_only:
        return render_saved("pipeline", out, "pipeline", render)
    try:
        plan = _plan(args)
    except ValueError as e:
        print(f"qwire bench pipeline: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "pipeline.json"
    try:  # read before anything below overwrites it
        saved: dict[str, Any] = json.loads(jpath.read_text()) if jpath.is_file() else {}
    except ValueError as e:
        if plan["only"] != "all" or plan["resume"]:
            print(f"qwire bench pipeline: {jpath} is not valid JSON ({e}); move it away or run without "
                  "--only/--resume", file=sys.stderr)
            return 2
        saved = {}
    ppath = out / PARTIAL  # what an interrupted run had measured (the complete pipeline.json stays as it was)
    previous = _conv_runs(saved.get("convergence") or {}) if plan["resume"] else []
    if plan["resume"] and ppath.is_file():
        try:
            newer = _conv_runs(json.loads(ppath.read_text()).get("convergence") or {})
        except ValueError:
            newer = []
        keys = {r.get("config_key") for r in newer}
        previous = newer + [r for r in previous if r.get("config_key") not in keys]
    elif saved and not plan["resume"] and plan["only"] == "all":
        print(f"qwire bench pipeline: replacing the results in {jpath} (of "
              f"{(saved.get('meta') or {}).get('started', 'an earlier run')}); --resume would reuse their runs",
              file=sys.stderr, flush=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    runs = Path(args.runs) / stamp
    t0 = time.perf_counter()
    only_conv, only_rob = plan["only"] == "convergence", plan["only"] == "robustness"
    only_part = only_conv or only_rob
    used = dict.fromkeys(plan["methods"] * (not only_part) + plan["conv_methods"] * (not only_rob)
                         + plan["ablations"] * (not only_rob))
    labels = {m: dict(zip(("label", "fwd_codec", "bwd_codec"), ALL_METHODS[m])) for m in used}
    if only_part and saved:  # merge: every other section (and the page's meta) stays as measured
        result: dict[str, Any] = {**saved, "methods": {**saved.get("methods", {}), **labels}}
        result.pop("convergence" if only_conv else "robustness", None)
    else:
        result = {"meta": _meta(args, plan), "paper": _paper_info(), "methods": labels}
        if plan["resume"]:  # a resumed run that skips a section keeps the one measured before
            for section, skipped in (("throughput", args.skip_throughput), ("robustness", args.skip_robustness)):
                if skipped and section in saved:
                    result[section] = saved[section]
                    result["methods"] = {**saved.get("methods", {}), **result["methods"]}
    failures = 0

    def save_partial() -> None:  # what has been measured survives an interrupted run (partial: true)
        part = dict(result)
        if "convergence" in part or previous:
            conv = dict(part.get("convergence") or {"runs": [], "partial": True})
            # the earlier runs this run has not reused yet stay in the file, so that an interrupted --resume
            # loses none of them (the next --resume still finds them)
            done = {r.get("config_key") for r in conv.get("runs", [])}
            earlier = [r for r in previous if r.get("config_key") not in done]
            if earlier:
                conv["earlier_runs"] = earlier
            if only_conv:
                conv["partial"] = True
            part["convergence"] = conv
        if not only_part:
            part["meta"] = {**result["meta"], "partial": True}
        atomic_write(ppath, json.dumps(part, indent=2))
    if not args.skip_throughput and not only_part:
        result["throughput"] = _throughput(plan, runs / "throughput")
        failures += sum(1 for r in result["throughput"]["runs"] if r.get("error"))
        save_partial()
    if (not args.skip_convergence or only_conv) and not only_rob:
        def progress(conv: dict[str, Any]) -> None:
            result["convergence"] = conv
            save_partial()
        started, t_conv = machine_info(), time.perf_counter()  # the machine and its load before the runs
        conv = _convergence(plan, runs / "convergence", previous, progress)
        conv.update(command=bench_command("pipeline", args, add_arguments), **started,
                    duration_s=time.perf_counter() - t_conv, load_average_end=loadavg())
        result["convergence"] = conv
        failures += sum(1 for r in conv["runs"] if r.get("error"))
        save_partial()
    if (not args.skip_robustness and not only_conv) or only_rob:
        started, t_rob = machine_info(), time.perf_counter()
        result["robustness"] = _robustness(plan, runs / "robustness")
        if only_rob:  # its own command and date: the page's header names the full run's
            result["robustness"].update(command=bench_command("pipeline", args, add_arguments),
                                        date=time.strftime("%Y-%m-%d"), duration_s=time.perf_counter() - t_rob,
                                        load_average_start=started.get("load_average_start"))
        failures += 0 if result["robustness"].get("verdict") else 1
    if not (only_part and saved):
        result["meta"]["duration_s"] = time.perf_counter() - t0
        result["meta"]["load_average_end"] = loadavg()
    jpath.write_text(json.dumps(result, indent=2))
    ppath.unlink(missing_ok=True)
    render(result, out)
    print(f"\nwrote {jpath}, {out / 'pipeline.md'} and the plots "
          f"({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
    return 1 if failures else 0


def _seeds(text: str, what: str) -> list[int]:
    try:
        seeds = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{what} takes comma-separated integers, e.g. 0,1,2 (got {text!r})") from None
    if not seeds or any(x < 0 for x in seeds):
        raise ValueError(f"{what} takes non-negative integers, e.g. 0,1,2 (got {text!r})")
    return list(dict.fromkeys(seeds))


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    """Check the arguments and fill in the defaults (--quick aware)."""
    from qwire.netlab import parse_link

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    conv_methods = [m.strip() for m in (args.conv_methods or args.methods).split(",") if m.strip()]
    bad = [m for m in methods + conv_methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
    abl = [a.strip() for a in args.ablations.split(",") if a.strip()]
    ablations = list(ABLATIONS) if abl == ["all"] else abl
    if [a for a in ablations if a not in ABLATIONS]:
        raise ValueError(f"unknown ablation(s) {[a for a in ablations if a not in ABLATIONS]}; choose from all, "
                         f"{', '.join(ABLATIONS)}")
    seeds = (_seeds(args.seeds, "--seeds") if args.seeds.strip()
             else [args.seed] if args.quick else [args.seed + i for i in range(DEFAULT_SEEDS)])
    ablation_seeds = _seeds(args.ablation_seeds, "--ablation-seeds") if args.ablation_seeds.strip() else seeds[:1]
    rates = [r.strip() for r in (args.rates or (QUICK_RATES if args.quick else DEFAULT_RATES)).split(",") if r.strip()]
    links = []
    for tok in rates:
        if tok.lower() == "none":
            links.append({"token": "none", "link": "", "paper_mbps": None})
        elif tok.lower().startswith("paper:"):
            mbps = parse_link(tok.split(":", 1)[1]).rate_bits_per_s / 1e6
            links.append({"token": tok, "link": None, "paper_mbps": mbps})
        else:
            links.append({"token": tok, "link": _with_options(str(parse_link(tok)), args.link_options),
                          "paper_mbps": None})
    if args.link_options:
        parse_link(_with_options("1mbit", args.link_options))  # a bad option fails before anything runs
    only = getattr(args, "only", "all")
    if any(lk["paper_mbps"] for lk in links) and not args.skip_throughput and only != "convergence":
        if "fp32" not in methods or not any(lk["token"] == "none" for lk in links):
            raise ValueError("paper:RATE links are worked out from FP32's run without a link: "
                             "give none in --rates and fp32 in --methods")
        links.sort(key=lambda lk: lk["token"] != "none")  # the ceiling first
    steps = args.steps or (4 if args.quick else 12)
    skip = args.skip if args.skip >= 0 else (1 if args.quick else 3)
    if skip >= steps:
        raise ValueError(f"--skip ({skip}) must be less than --steps ({steps})")
    if args.stages < 2:
        raise ValueError("--stages must be >= 2 (a pipeline boundary is what this benchmark measures)")
    conv_steps = args.conv_steps or (8 if args.quick else 300)
    if args.epochs <= 0:
        raise ValueError("--epochs must be > 0")
    parse_link(args.robust_link)
    device = getattr(args, "device", "cpu")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here; run it on a GPU machine, or drop --device")
    base = dict(stages=args.stages, batch_size=args.batch_size, microbatches=args.microbatches,
                seq_len=args.seq_len, model=args.model, seed=args.seed, device=device)
    if args.quick:
        base.update(QUICK)
    from qwire.train import TrainConfig

    try:  # a setting no run can use fails here, not in every run after the results page is begun
        TrainConfig(**{**base, "fwd_codec": "fp32", "bwd_codec": "fp32"}).validate()
    except ValueError as e:
        raise ValueError(f"the runs' settings: {e}") from None
    return {"args": vars(args), "methods": methods, "conv_methods": conv_methods, "links": links,
            "steps": steps, "skip": skip, "repeat": max(1, args.repeat), "conv_steps": conv_steps,
            "epochs": args.epochs, "eval_every": args.eval_every or max(1, conv_steps // 10),
            "robust_steps": args.robust_steps or (4 if args.quick else 100), "robust_link": args.robust_link,
            "link_options": args.link_options, "quick": args.quick, "base": base, "seeds": seeds,
            "ablations": ablations, "ablation_seeds": ablation_seeds, "only": only,
            "resume": bool(getattr(args, "resume", False))}


def _with_options(link: str, options: str) -> str:
    return f"{link},{options}" if options else link


# -----------------------------------------------------------------------------------------------
# Part 1 and 2: the throughput sweep (and the paper-regime links it includes).


def _throughput(plan: dict[str, Any], runs: Path) -> dict[str, Any]:
    from qwire.train import TrainConfig

    links = [dict(lk) for lk in plan["links"]]
    rows: list[dict[str, Any]] = []
    regime: dict[str, Any] | None = None
    total = len(links) * len(plan["methods"]) * plan["repeat"]
    k = 0
    for rep in range(plan["repeat"]):
        for lk in links:
            if lk["link"] is None:  # paper:RATE, resolved from this invocation's FP32 ceiling
                if regime is None:
                    regime = _regime(rows, plan)
                if regime.get("error"):
                    lk["link"], lk["error"] = "", regime["error"]
                else:
                    rate = paper_equivalent(lk["paper_mbps"] * 1e6, regime)
                    lk["link"] = _with_options(_fmt_rate(rate), plan["link_options"])
                    lk["rate_bits_per_s"] = rate
            if lk.get("error"):
                k += len(plan["methods"])
                continue
            for m in plan["methods"]:
                k += 1
                label, fwd, bwd = METHODS[m]
                name = f"{_slug(lk['token'])}-{m}-r{rep}"
                cfg = TrainConfig(**{**plan["base"], **dict(
                    fwd_codec=fwd, bwd_codec=bwd, steps=plan["steps"], eval_every=0, eval_batches=1,
                    checkpoint_every=0, log_every=plan["steps"], out=str(runs / name), link=lk["link"])})
                row: dict[str, Any] = {"method": m, "token": lk["token"], "link": lk["link"] or "none",
                                       "paper_mbps": lk["paper_mbps"], "repeat": rep, "fwd_codec": fwd,
                                       "bwd_codec": bwd, "run_dir": cfg.out, "command": _train_command(cfg)}
                summary, err, wall = _train(cfg)
                row["wall_s"] = wall
                if err:
                    row["error"] = err
                    print(f"[pipeline {k}/{total}] {label:<11} {row['link']:<22} FAILED: {err.splitlines()[0]}",
                          flush=True)
                else:
                    row.update(_measure(cfg.out, plan["skip"]))
                    row["link_mode"] = summary.get("link_mode", "none") if summary else "none"
                    mb = (row["wire_bytes_fwd_per_step"] + row["wire_bytes_bwd_per_step"]) / 1e6
                    print(f"[pipeline {k}/{total}] {label:<11} {row['link']:<22} {row['tokens_per_s']:8,.0f} tokens/s"
                          f"  {mb:6.3f} MB/step  ({row['link_mode']}, {wall:.0f} s)", flush=True)
                rows.append(row)
    return {"steps": plan["steps"], "skip": plan["skip"], "repeat": plan["repeat"], "methods": plan["methods"],
            "settings": plan["base"], "links": links, "regime": regime, "runs": rows}


def _regime(rows: list[dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    """FP32's compute time and boundary bytes per step here, from the FP32 run(s) without a link."""
    ceil = [r for r in rows if r["method"] == "fp32" and r["token"] == "none" and not r.get("error")]
    if not ceil:
        return {"error": "no successful FP32 run without a link to work out the paper-regime links from"}
    tps = statistics.median(r["tokens_per_s"] for r in ceil)
    tokens_per_step = ceil[0]["tokens_per_step"]
    boundary = ceil[0]["fp32_bytes_per_step"] / (plan["base"]["stages"] - 1)
    return {"compute_step_s": tokens_per_step / tps, "compute_tokens_per_s": tps, "tokens_per_step": tokens_per_step,
            "boundary_bytes_per_step": boundary, **_paper_info()}


def _paper_info() -> dict[str, Any]:
    return {"paper_compute_step_s": PAPER_TOKENS_PER_STEP / PAPER_COMPUTE_TOKENS_PER_S,
            "paper_compute_tokens_per_s": PAPER_COMPUTE_TOKENS_PER_S, "paper_tokens_per_step": PAPER_TOKENS_PER_STEP,
            "paper_boundary_bytes_per_step": PAPER_BOUNDARY_BYTES}


def comm_compute_ratio(boundary_bytes: float, rate_bits_per_s: float, compute_step_s: float) -> float:
    """FP32's communication-to-compute ratio: the time one boundary's fp32 traffic of a step (activations
    forward + gradients back) takes at the link rate, over the compute-only step time."""
    return boundary_bytes * 8 / rate_bits_per_s / compute_step_s


def paper_equivalent(paper_rate_bits_per_s: float, regime: dict[str, Any]) -> float:
    """The link rate here at which FP32's comm/compute ratio equals the paper's at ``paper_rate_bits_per_s``.

    ``rate_here = rate_paper * (B_here / T_here) / (B_paper / T_paper)``: B = fp32 bytes through one boundary
    per step, T = compute-only step time. The ratio counts both directions of a boundary because over one
    TCP connection per direction (gloo) a middle stage's uplink carries both, and the two directions of a
    pair take turns (docs/netlab.md); the paper's FP32 numbers fit ``T_paper + B_paper / rate`` within ~10%
    at 100-500 Mbps.
    """
    here = regime["boundary_bytes_per_step"] / regime["compute_step_s"]
    paper = regime["paper_boundary_bytes_per_step"] / regime["paper_compute_step_s"]
    return paper_rate_bits_per_s * here / paper


def _fmt_rate(bits_per_s: float) -> str:
    """Two significant digits, as a link spec: 9.3mbit, 930kbit, 1.2gbit."""
    r = float(f"{bits_per_s:.2g}")
    for unit, f in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if r >= f:
            return f"{r / f:g}{unit}"
    return f"{r:g}bit"


def _measure(run_dir: str | Path, skip: int) -> dict[str, Any]:
    """Training tokens/s over the steps after the first ``skip`` (evaluation is never inside a step's time)
    and the bytes per step on the pipeline links."""
    recs = _records(run_dir)
    counted = recs[skip:] or recs
    tokens_per_step = recs[0]["tokens"] / recs[0]["step"]
    times = [r["step_time_s"] for r in counted]

    def med(key: str) -> float:
        return float(statistics.median(r[key] for r in counted))
    return {"tokens_per_s": tokens_per_step * len(times) / sum(times), "step_s_median": statistics.median(times),
            "steps_counted": len(times), "tokens_per_step": tokens_per_step,
            "wire_bytes_fwd_per_step": med("wire_bytes_fwd"), "wire_bytes_bwd_per_step": med("wire_bytes_bwd"),
            "fp32_bytes_per_step": med("fp32_bytes")}


# -----------------------------------------------------------------------------------------------
# Part 3: convergence over several epochs, no link.


def conv_max_tokens(steps: int, batch: int, epochs: float, seq_len: int, val_fraction: float = 0.05) -> int:
    """The corpus cap (tokens) whose training split holds ``floor(steps / epochs)`` whole batches, so that
    ``steps`` steps make at least ``epochs`` epochs (``qwire.data.split_windows``' rounding)."""
    n_train = max(1, int(steps / epochs)) * batch
    n = n_train
    while n - max(1, round(n * val_fraction)) < n_train:
        n += 1
    n = max(n, math.ceil(batch / val_fraction))  # at least one validation batch
    return n * (seq_len + 1)


def _convergence(plan: dict[str, Any], runs: Path, previous: list[dict[str, Any]] | None = None,
                 progress: Any = None) -> dict[str, Any]:
    """Every method of ``conv_methods`` at every seed of ``seeds`` (seed by seed, so a change in the machine's
    load hits the methods alike), then the ablations at ``ablation_seeds``; ``previous`` runs with the same
    configuration are reused instead of trained again; ``progress(result)`` after every run."""
    from qwire.train import TrainConfig

    base = dict(plan["base"])
    steps = plan["conv_steps"]
    max_tokens = conv_max_tokens(steps, base["batch_size"], plan["epochs"], base["seq_len"])
    base["max_tokens"] = max_tokens
    data = _data_info(base)
    res: dict[str, Any] = {"steps": steps, "eval_every": plan["eval_every"], "settings": base, "data": data,
                           "epochs": steps / max(1, data.get("n_train", 0) // base["batch_size"])
                           if data.get("n_train") else None, "seeds": plan["seeds"],
                           "methods": plan["conv_methods"], "ablations": plan["ablations"],
                           "ablation_seeds": plan["ablation_seeds"] if plan["ablations"] else [], "runs": []}
    jobs = [(m, seed) for seed in plan["seeds"] for m in plan["conv_methods"]]
    jobs += [(m, seed) for seed in plan["ablation_seeds"] for m in plan["ablations"]]
    reusable = {same_run(r["config_key"]): r for r in (previous or []) if r.get("config_key") and not r.get("error")}
    import torch

    here, torch_version = machine(), torch.__version__
    for k, (m, seed) in enumerate(jobs, 1):
        label, fwd, bwd = ALL_METHODS[m]
        tag = f"[pipeline convergence {k}/{len(jobs)}] {label:<11} seed {seed}"
        cfg = TrainConfig(**{**base, **dict(fwd_codec=fwd, bwd_codec=bwd, steps=steps, eval_every=plan["eval_every"],
                                            checkpoint_every=0, log_every=max(1, steps // 10), seed=seed,
                                            out=str(runs / f"{m}-s{seed}"))})
        key = conv_config_key(cfg)
        old = reusable.get(same_run(key))
        if old is not None:
            res["runs"].append({**old, "method": m, "seed": seed, "reused": True})
            print(f"{tag} reused (same configuration): val loss {old['summary']['val_loss']:.4f}", flush=True)
            if progress:
                progress(res)
            continue
        summary, err, wall = _train(cfg)
        # where it ran, so that a page of runs reused by a later --resume can say so
        r: dict[str, Any] = {"method": m, "seed": seed, "fwd_codec": fwd, "bwd_codec": bwd,
                             "config_key": key, "run_dir": cfg.out, "command": _train_command(cfg), "wall_s": wall,
                             "machine": here, "torch": torch_version}
        if err:
            r["error"] = err
            print(f"{tag} FAILED: {err.splitlines()[0]}", flush=True)
        else:
            recs = _records(cfg.out)
            r.update(final_loss=summary["final_loss"], val_loss=summary["val_loss"], summary=summary,
                     curve=[[x["step"], x["loss"]] for x in recs],
                     val=[[x["step"], x["val_loss"]] for x in recs if "val_loss" in x])
            print(f"{tag} val loss {summary['val_loss']:.4f}  "
                  f"{fmt_mb(summary['wire_bytes_fwd'] + summary['wire_bytes_bwd'], 1)}"
                  + (f"  AQ-SGD cache {fmt_mb(summary['aqsgd_cache_bytes'], 1)}" if "aqsgd_cache_bytes" in summary
                     else "") + f"  ({wall:.0f} s)", flush=True)
        res["runs"].append(r)
        if progress:
            progress(res)
    res["stats"] = convergence_stats(res["runs"])
    res["tahquant_vs_fp32"] = gap_verdict(res["stats"], "tahquant")
    return res


def conv_config_key(cfg: Any) -> str:
    """What makes two convergence runs the same: every training setting but where the run is written and how
    often it logs, with the codecs as their fully resolved specs (a changed default changes the key; a parameter
    added later counts only away from the value that reproduces the older codec, see ``Codec.spec_key``)."""
    from qwire.codecs import get_codec

    d = dataclasses.asdict(cfg)
    # the transport and warnings, not the numbers
    for k in ("out", "log_every", "checkpoint_every", "backend", "stall_warn", "peer_timeout"):
        d.pop(k, None)
    for k in ("fwd_codec", "bwd_codec"):
        try:
            d[k] = get_codec(d[k]).spec_key()
        except Exception:  # noqa: BLE001 - the run itself reports a bad spec
            pass
    return json.dumps(d, sort_keys=True, default=str)


def same_run(key: str) -> str:
    """A :func:`conv_config_key` with the settings at :class:`~qwire.config.TrainConfig`'s defaults left out: two
    runs are the same configuration when these agree. A key holds every setting there was when its run was made,
    so a setting added since (absent from an older key) counts only away from its default, and a value keeps
    counting when a default changes (the key spells it out)."""
    from qwire.config import TrainConfig

    try:
        d = json.loads(key)
    except ValueError:
        return key
    if not isinstance(d, dict):
        return key
    defaults = {f.name: json.loads(json.dumps(f.default, default=str)) for f in dataclasses.fields(TrainConfig)
                if f.default is not dataclasses.MISSING}
    return json.dumps({k: v for k, v in d.items() if not (k in defaults and defaults[k] == v)}, sort_keys=True)


def _conv_runs(conv: dict[str, Any]) -> list[dict[str, Any]]:
    """The convergence runs as a list of ``{method, seed, ...}`` (older results kept one run per method in a
    dict, at the settings' seed)."""
    runs = conv.get("runs") or []
    if isinstance(runs, dict):
        seed = (conv.get("settings") or {}).get("seed", 0)
        return [{**r, "method": m, "seed": r.get("seed", seed)} for m, r in runs.items()]
    return list(runs) + list(conv.get("earlier_runs") or [])  # + what an interrupted --resume had not reused


# two-sided 95% Student t quantiles by degrees of freedom (1-30; 1.96 beyond)
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    return _T95[df - 1] if 1 <= df <= len(_T95) else 1.96


def _spread(vals: list[float]) -> dict[str, Any]:
    n = len(vals)
    mean = sum(vals) / n
    std = statistics.stdev(vals) if n > 1 else None
    return {"n": n, "mean": mean, "std": std, "min": min(vals), "max": max(vals),
            "ci95": t95(n - 1) * std / math.sqrt(n) if std is not None else None}


def convergence_stats(runs: list[dict[str, Any]], ref: str = "fp32") -> dict[str, Any]:
    """Per method over its successful seeds: the final validation (and training) loss's mean, standard deviation,
    min and max; the gap of the mean to ``ref``'s mean (%); and the paired gaps, seed by seed (%, same seed =
    same initialization and data order), with their mean, spread and 95% confidence half-width."""
    ok: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        s = r.get("summary")
        if s and not r.get("error"):
            ok.setdefault(r["method"], {})[r["seed"]] = s
    base = ok.get(ref, {})
    base_mean = statistics.fmean(s["val_loss"] for s in base.values()) if base else None
    out: dict[str, Any] = {}
    for m, by_seed in ok.items():
        seeds = sorted(by_seed)
        val = _spread([by_seed[x]["val_loss"] for x in seeds])
        st: dict[str, Any] = {"seeds": seeds, "val_loss": val,
                              "train_loss": _spread([by_seed[x]["final_loss"] for x in seeds]),
                              "val_loss_per_seed": {str(x): by_seed[x]["val_loss"] for x in seeds}}
        if base_mean:
            st["gap_of_means_pct"] = (val["mean"] / base_mean - 1) * 100
            st["range_pct"] = (val["max"] - val["min"]) / base_mean * 100
        paired = {x: (by_seed[x]["val_loss"] / base[x]["val_loss"] - 1) * 100 for x in seeds if x in base}
        if paired and m != ref:
            st["paired_gap_pct"] = {str(x): g for x, g in paired.items()}
            st["paired"] = _spread(list(paired.values()))
        out[m] = st
    return out


def gap_verdict(stats: dict[str, Any], m: str, ref: str = "fp32") -> dict[str, Any] | None:
    """Is ``m``'s gap to ``ref`` larger than the seed-to-seed spread? The gap of the means against the larger of
    the two methods' min-max ranges over seeds, and the paired gaps' sign and 95% interval."""
    a, b = stats.get(m), stats.get(ref)
    if not a or not b or "gap_of_means_pct" not in a or a["val_loss"]["n"] < 2 or b["val_loss"]["n"] < 2:
        return None
    spread = max(a["range_pct"], b["range_pct"])
    gap = a["gap_of_means_pct"]
    p = a.get("paired") or {}
    same_sign = bool(p) and (p["min"] > 0 or p["max"] < 0)
    ci = p.get("ci95")
    excludes_zero = ci is not None and abs(p["mean"]) > ci
    return {"gap_pct": gap, "spread_pct": spread, "larger_than_spread": abs(gap) > spread,
            "paired_same_sign": same_sign, "paired_mean_pct": p.get("mean"), "paired_ci95_pct": ci,
            "paired_ci_excludes_zero": excludes_zero, "n_paired": p.get("n", 0),
            "fp16_paired": (stats.get("fp16") or {}).get("paired") if m != "fp16" else None}


def _data_info(base: dict[str, Any]) -> dict[str, Any]:
    """Training/validation sizes of the capped corpus (the same call every rank makes)."""
    from qwire.train import TrainConfig

    cfg = TrainConfig(**base)
    try:
        from qwire.data import build_datasets
        train, val, _tok = build_datasets(corpus=cfg.corpus, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                                          seed=cfg.seed, max_tokens=cfg.max_tokens or None)
    except Exception as e:  # the runs report the same problem with more context
        return {"error": f"{type(e).__name__}: {e}"}
    return {"max_tokens": cfg.max_tokens, "n_train": len(train), "n_val": len(val), "corpus": cfg.corpus}


# -----------------------------------------------------------------------------------------------
# Part 4: robustness, the default training over a lossy, delayed link.


def _robustness(plan: dict[str, Any], runs: Path) -> dict[str, Any]:
    from qwire.train import TrainConfig

    steps = plan["robust_steps"]
    over = dict(steps=steps, eval_every=max(1, steps // 2), checkpoint_every=0, log_every=max(1, steps // 10),
                seed=plan["base"]["seed"])
    if plan["quick"]:
        over.update(QUICK, stages=2)
    default = TrainConfig()
    wanted = plan["robust_link"]
    parts = [p for p in wanted.split(",") if p.strip()]
    no_loss = ",".join(p for p in parts if not p.strip().lower().startswith("loss="))
    opts = plan["link_options"]
    candidates = [_with_options(wanted, opts or "mode=lab")]
    if no_loss != wanted:
        candidates.append(_with_options(no_loss, opts or "mode=lab"))
    if not opts:
        candidates.append(_with_options(no_loss, "mode=sim"))
    res: dict[str, Any] = {"steps": steps, "wanted_link": wanted, "settings": {
        k: getattr(dataclasses.replace(default, **over), k) for k in
        ("stages", "fwd_codec", "bwd_codec", "batch_size", "microbatches", "seq_len", "steps")}, "attempts": []}
    linked = None
    for i, link in enumerate(candidates):
        cfg = dataclasses.replace(default, **over, out=str(runs / f"link-{i}"), link=link)
        summary, err, wall = _train(cfg)
        att = {"link": link, "run_dir": cfg.out, "command": _train_command(cfg), "wall_s": wall}
        if err:
            att["error"] = err
            print(f"[pipeline robustness] {link}: refused or failed: {err.splitlines()[0]}", flush=True)
            res["attempts"].append(att)
            continue
        att.update(summary=summary, link_mode=summary.get("link_mode", ""))
        res["attempts"].append(att)
        linked = att
        print(f"[pipeline robustness] {link} ({att['link_mode']}): val loss {summary['val_loss']:.4f} ({wall:.0f} s)",
              flush=True)
        break
    cfg = dataclasses.replace(default, **over, out=str(runs / "nolink"))
    summary, err, wall = _train(cfg)
    res["baseline"] = {"link": "none", "run_dir": cfg.out, "command": _train_command(cfg), "wall_s": wall}
    if err:
        res["baseline"]["error"] = err
        print(f"[pipeline robustness] no link: FAILED: {err.splitlines()[0]}", flush=True)
        return res
    res["baseline"]["summary"] = summary
    print(f"[pipeline robustness] no link: val loss {summary['val_loss']:.4f} ({wall:.0f} s)", flush=True)
    if linked is None:
        return res
    a, b = _records(linked["run_dir"]), _records(cfg.out)
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]
    va, vb = linked["summary"]["val_loss"], summary["val_loss"]
    rel = abs(va - vb) / abs(vb) if vb else float("inf")
    res.update(ran=linked["link"], link_mode=linked["link_mode"], steps_compared=len(diffs),
               max_abs_train_loss_diff=max(diffs) if diffs else None, val_loss_link=va, val_loss_nolink=vb,
               val_loss_rel_diff=rel, completed=linked["summary"]["steps"] == steps,
               verdict=("identical" if diffs and max(diffs) == 0 and va == vb else
                        "same" if rel <= 1e-3 else "different"))
    # how the lab made the link (rate by tbf; delay by netem or simulated; loss by netem or nft)
    try:
        lab_info = json.loads((Path(linked["run_dir"]) / "netlab.json").read_text())
    except (OSError, ValueError):
        lab_info = {}
    shaping = lab_info.get("shaping") or {}
    res["shaping"] = shaping
    drops = lab_info.get("loss_counters")
    refusal = next((a["error"].splitlines()[0] for a in res["attempts"] if a.get("error")), "")
    if "loss=" not in wanted:
        res["loss_part"] = "not asked for"
    elif "loss=" in linked["link"] and shaping.get("loss"):
        res["loss_part"] = f"applied (by {shaping['loss']})"
        if drops and drops.get("seen_packets"):
            res["loss_counters"] = drops
            res["loss_part"] += (f": {drops['dropped_packets']:,} of {drops['seen_packets']:,} packets dropped "
                                 f"({drops['dropped_packets'] / drops['seen_packets'] * 100:.2f}%)")
    elif linked["link_mode"] == "simulated":
        res["loss_part"] = "ignored (the simulated link drops no packets)"
    else:
        res["loss_part"] = "not applied" + (f": {refusal}" if refusal else "")
    return res


def _slug(token: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in token.replace("paper:", "paper-"))


# -----------------------------------------------------------------------------------------------
# What the JSON says about the run.


def _meta(args: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    try:
        from qwire.netlab import lab_unavailable_reason
        lab = lab_unavailable_reason() or "available"
    except Exception as e:  # noqa: BLE001 - informational only
        lab = f"unknown ({type(e).__name__})"
    return {"command": bench_command("pipeline", args, add_arguments), **machine_info(), "network_lab": lab,
            "nft": shutil.which("nft") is not None,
            "quick": plan["quick"]}


# -----------------------------------------------------------------------------------------------
# Rendering: markdown and plots from the JSON alone.


def _agg(result: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[tuple[str, str], dict[str, Any]]]:
    """Links in table order (none first, then fastest to slowest) and the median row per (link token, method)."""
    tp = result.get("throughput") or {}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in tp.get("runs", []):
        if not r.get("error"):
            groups.setdefault((r["token"], r["method"]), []).append(r)
    agg = {}
    for key, rs in groups.items():
        vals = [r["tokens_per_s"] for r in rs]
        agg[key] = {**rs[0], "tokens_per_s": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(rs)}
    links = [lk for lk in tp.get("links", []) if not lk.get("error")]
    links.sort(key=lambda lk: (lk["token"] != "none", -_rate_of(lk)))
    return links, agg


def _rate_of(lk: dict[str, Any]) -> float:
    if lk["token"] == "none" or not lk.get("link"):
        return math.inf
    from qwire.netlab import parse_link
    return parse_link(lk["link"]).rate_bits_per_s


def _link_label(lk: dict[str, Any]) -> str:
    if lk["token"] == "none":
        return "none (compute only)"
    name = lk["link"].split(",")[0]
    return f"{name} (= paper {lk['paper_mbps']:g} Mbps)" if lk.get("paper_mbps") else name


def render(result: dict[str, Any], out: Path) -> None:
    """Write ``pipeline.md`` and the plots from a ``pipeline.json`` result."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if result.get("throughput"):
        _plot_throughput(result, out / "pipeline_throughput.png")
    if result.get("convergence"):
        _plot_loss(result, out / "pipeline_loss.png")
    (out / "pipeline.md").write_text(_markdown(result))


def _label(result: dict[str, Any], m: str) -> str:
    return result.get("methods", {}).get(m, {}).get("label") or ALL_METHODS.get(m, (m,))[0]


def _markdown(result: dict[str, Any]) -> str:
    meta = result.get("meta", {})
    L = ["# Pipeline training over slow links: FP32, FP16, direct int4, AQ-SGD, TAH-Quant", ""]
    L += [f"Command: `{meta.get('command', 'qwire bench pipeline')}`  ",
          f"Machine: {meta.get('machine', '?')}, torch {meta.get('torch', '?')}; network lab: "
          f"{meta.get('network_lab', '?')}; load average {meta.get('load_average_start')} at the start, "
          f"{meta.get('load_average_end')} at the end; {(meta.get('duration_s') or 0) / 60:.0f} min in all."
          + (" **Quick smoke-test settings: the numbers mean nothing.**" if meta.get("quick") else "")
          + (" **Partial: the run was interrupted.**" if meta.get("partial") else ""), ""]
    methods = result.get("methods", {})
    L += md_table(["method", "forward codec", "backward codec"],
                  ([v["label"], f"`{v['fwd_codec']}`", f"`{v['bwd_codec']}`"] for v in methods.values()))
    L += ["", "AQ-SGD runs without a warm-up epoch (a sample's first visit is direct int4; the payload size never "
          "changes). Direct int4 is per tile of 32 channels, asymmetric (`int4`, qwire's default layout).", ""]
    L += _md_headline(result)
    if result.get("throughput"):
        L += _md_throughput(result)
        L += _md_paper(result)
    if result.get("convergence"):
        L += _md_convergence(result)
    if result.get("robustness"):
        L += _md_robustness(result)
    return "\n".join(L) + "\n"


def _n(x: float | None) -> str:
    """A count for the text: thousands separated, no decimals; n/a when unknown."""
    return fmt(x, ",.0f", missing="n/a")


def _md_headline(result: dict[str, Any]) -> list[str]:
    links, agg = _agg(result)
    L: list[str] = []
    best: dict[str, tuple[float, str]] = {}
    for lk in links:
        if lk["token"] == "none":
            continue
        t, f, a = (agg.get((lk["token"], m)) for m in ("tahquant", "fp32", "aqsgd"))
        if t and f:
            best["fp32"] = max(best.get("fp32", (0.0, "")), (t["tokens_per_s"] / f["tokens_per_s"], _link_label(lk)))
        if t and a:
            best["aqsgd"] = max(best.get("aqsgd", (0.0, "")), (t["tokens_per_s"] / a["tokens_per_s"], _link_label(lk)))
    if not best and not result.get("convergence"):
        return L
    L += ["## Summary", ""]
    tg = PAPER["targets"]
    if "fp32" in best:
        L.append(f"- TAH-Quant over FP32: up to **{best['fp32'][0]:.2f}x** (at {best['fp32'][1]}); "
                 f"paper: up to {tg['over_fp32']}x.")
    if "aqsgd" in best:
        L.append(f"- TAH-Quant over AQ-SGD: up to **{best['aqsgd'][0]:.2f}x** (at {best['aqsgd'][1]}); "
                 f"paper: up to {tg['over_aqsgd']}x.")
    conv = result.get("convergence") or {}
    st = _stats(conv)
    if st.get("fp32") and "gap_of_means_pct" in st["fp32"]:
        order = [m for m in conv.get("methods") or METHODS if m in st and m != "fp32"]
        n = st["fp32"]["val_loss"]["n"]
        rel = []
        for m in order:
            cell = f"{_label(result, m)} {st[m]['gap_of_means_pct']:+.1f}%"
            p = st[m].get("paired")
            if p and p["n"] > 1:
                cell += f" (per seed {p['min']:+.1f}% to {p['max']:+.1f}%)"
            rel.append(cell)
        if rel:
            L.append("- Validation loss after the convergence budget, relative to FP32"
                     + (f" (means over {n} seeds; per seed: paired with FP32's run of that seed)" if n > 1
                        else " (one seed each)") + f": {', '.join(rel)}.")
        v = gap_verdict(st, "tahquant")
        if v:
            L.append(f"- {_verdict_text(v)}")
    rob = result.get("robustness") or {}
    if rob.get("verdict"):
        L.append(f"- Robustness: over `{rob['ran']}` ({rob['link_mode']}) the training completed with "
                 f"{rob['verdict']} loss as without a link (packet loss {rob['loss_part']}).")
    return L + [""]


def _md_throughput(result: dict[str, Any]) -> list[str]:
    tp = result["throughput"]
    links, agg = _agg(result)
    methods = tp["methods"]
    s = tp["settings"]
    L = ["## Throughput over rate-limited links", "",
         f"Every cell is one `qwire train` run of {tp['steps']} steps ({s['model']}, {s['stages']} stages, "
         f"{s['microbatches']} micro-batches of {s['batch_size'] // s['microbatches']} x {s['seq_len']} tokens, "
         f"1F1B): training tokens/s over steps {tp['skip'] + 1}-{tp['steps']}, evaluation excluded"
         + (f"; median of {tp['repeat']} sweeps" if tp["repeat"] > 1 else "")
         + ". Within a link the methods ran one after the other, then the next link; a link is every "
           "rank's uplink shaped by `tc` in its own network namespace (the network lab, docs/netlab.md), "
           "`none` is loopback without any link: the compute-only ceiling.", ""]
    cores = result.get("meta", {}).get("cpu_count")
    if cores and s["stages"] <= cores:
        L += [f"{s['stages']} stages on {cores} CPU cores: one process per core, so the stages' compute runs in "
              "parallel as on separate machines and one stage's codec time does not slow another stage down "
              "(with more stages than cores the processes time-share the cores, which no real pipeline does).", ""]
    modes = sorted({r.get("link_mode", "") for r in tp["runs"] if not r.get("error") and r["token"] != "none"})
    if modes:
        L += [f"Link modes used: {', '.join(f'`{m}`' for m in modes)}.", ""]

    def table(title: str, cell: Any) -> list[str]:
        return [f"**{title}**", "", *md_table(["link", *(_label(result, m) for m in methods)],
                                             ([_link_label(lk), *(cell(lk, m) for m in methods)] for lk in links),
                                             "l" + "r" * len(methods)), ""]

    def tps(lk: dict[str, Any], m: str) -> str:
        a = agg.get((lk["token"], m))
        if not a:
            return "failed" if any(r["token"] == lk["token"] and r["method"] == m for r in tp["runs"]) else ""
        return f"{a['tokens_per_s']:,.0f}" + (f" ({a['min']:,.0f}-{a['max']:,.0f})" if a["n"] > 1 else "")

    def ratio(ref: str) -> Any:
        def cell(lk: dict[str, Any], m: str) -> str:
            a, b = agg.get((lk["token"], m)), agg.get((lk["token"], ref))
            return f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x" if a and b else ""
        return cell

    ceiling = agg.get(("none", "fp32"))

    def frac(lk: dict[str, Any], m: str) -> str:
        a = agg.get((lk["token"], m))
        return f"{a['tokens_per_s'] / ceiling['tokens_per_s'] * 100:.0f}%" if a and ceiling else ""

    L += table("Tokens/s", tps)
    if "fp32" in methods:
        L += table("Speedup over FP32 (same link)", ratio("fp32"))
    if "aqsgd" in methods:
        L += table("Speedup over AQ-SGD (same link)", ratio("aqsgd"))
    if ceiling:
        L += table("Fraction of the compute-only ceiling (FP32 without a link)", frac)
    # FP32's slowdown from the fastest link to the slowest: the grid's span
    real = [lk for lk in links if lk["token"] != "none" and agg.get((lk["token"], "fp32"))]
    if len(real) >= 2:
        fast, slow = agg[(real[0]["token"], "fp32")], agg[(real[-1]["token"], "fp32")]
        span = fast["tokens_per_s"] / slow["tokens_per_s"]
        L += [f"FP32 runs {span:.1f}x slower at {_link_label(real[-1])} than at {_link_label(real[0])} "
              f"(the links span compute-bound to communication-bound when this is at least 5x: "
              f"{'met' if span >= 5 else 'not met'})"
              + (f"; at {_link_label(real[0])} FP32 reaches "
                 f"{fast['tokens_per_s'] / ceiling['tokens_per_s'] * 100:.0f}% of the compute-only ceiling."
                 if ceiling else "."), ""]
    # bytes per step: the same on every link
    L += ["**Bytes on the pipeline links per step** (all boundaries, both directions; the same on every link)", "",
          *md_table(["method", "forward", "backward", "total", "FP32 would send", "less than FP32",
                     "forward bits/element"], [], "lrrrrrr")]
    for m in methods:
        a = next((v for (tok, mm), v in agg.items() if mm == m), None)
        if not a:
            continue
        f, b, ref = a["wire_bytes_fwd_per_step"], a["wire_bytes_bwd_per_step"], a["fp32_bytes_per_step"]
        bits = f * 8 / (ref / 8) if ref else float("nan")
        L.append(md_row([_label(result, m), fmt_mb(f, 3), fmt_mb(b, 3), fmt_mb(f + b, 3), fmt_mb(ref, 3),
                         f"{ref / max(1.0, f + b):.1f}x", f"{bits:.2f}"]))
    L += ["", "Forward bits/element count everything a forward payload carries (codes, scales, bitmaps, pivots, "
          "AQ-SGD's sample ids) rounded up to whole 4-byte words per message.", "",
          "![throughput vs bandwidth](pipeline_throughput.png)", ""]
    aq = [r for r in tp["runs"] if r["method"] == "aqsgd" and not r.get("error")]
    if aq:
        L += [f"AQ-SGD's throughput runs are {tp['steps']} steps long, so samples do not come back within them; "
              "its payload size is fixed, so bytes and time per step are those of later epochs too "
              "(the cache update is included).", ""]
    failed = [r for r in tp["runs"] if r.get("error")]
    if failed:
        L += ["Failed runs:", ""] + [f"- {_label(result, r['method'])} at `{r['link']}`: "
                                     f"{r['error'].splitlines()[0]}" for r in failed] + [""]
    return L


def _md_paper(result: dict[str, Any]) -> list[str]:
    tp = result["throughput"]
    reg = tp.get("regime")
    links, agg = _agg(result)
    paper_links = [lk for lk in links if lk.get("paper_mbps")]
    if not reg or reg.get("error") or not paper_links:
        return []
    ceiling = reg["compute_tokens_per_s"]
    pb, pt_s = reg["paper_boundary_bytes_per_step"], reg["paper_compute_step_s"]
    paper_rates = sorted(PAPER["table"], reverse=True)
    factor = (reg["boundary_bytes_per_step"] / reg["compute_step_s"]) / (
        reg["paper_boundary_bytes_per_step"] / reg["paper_compute_step_s"])
    L = ["## The paper's regime", "",
         f"The paper trains GPT2-XL on {PAPER['stages']} stages with micro-batch {PAPER['micro_batch']}, batch "
         f"{PAPER['batch']} and sequence {PAPER['seq_len']}: each step sends {PAPER['batch']} x "
         f"{PAPER['seq_len']} x {PAPER['hidden']} fp32 activations (6.55 MB per micro-batch) forward through each "
         f"boundary and as many gradients back, **B = {fmt_mb(reg['paper_boundary_bytes_per_step'], 1)} per "
         f"boundary per step**. Its compute-bound rate is taken as the fastest published row, TAH-Quant at 500 "
         f"Mbps ({PAPER_COMPUTE_TOKENS_PER_S:,.0f} tokens/s; TAH-Quant sends ~7x less than FP32 and is flat from "
         f"500 Mbps to 1 Gbps): **T = {reg['paper_compute_step_s']:.2f} s of compute per step**. FP32's "
         "communication-to-compute ratio at link rate R is `r = B * 8 / R / T`: "
         + ", ".join(f"{comm_compute_ratio(pb, mb * 1e6, pt_s):.2f} at {mb:g} Mbps" for mb in paper_rates) + ".", "",
         f"Here, FP32 without a link ran at {ceiling:,.0f} tokens/s ({reg['tokens_per_step']:,.0f} tokens per step: "
         f"**T = {reg['compute_step_s']:.3f} s**) and sends **B = {fmt_mb(reg['boundary_bytes_per_step'], 3)} per "
         "boundary per step**. The same ratio therefore needs `R_here = R_paper * (B_here / T_here) / "
         f"(B_paper / T_paper)` = R_paper x {factor:.4f}: this machine's pipeline moves {1 / factor:.0f}x fewer "
         "bytes per second of compute than GPT2-XL's, so its links must be that much slower to be equally "
         "communication-bound. Both directions count because gloo's two directions of a pair take turns "
         "(docs/netlab.md), like a middle stage's single uplink in the paper; as a check, "
         "`T + B * 8 / R` predicts the paper's FP32 numbers at 100/300/500 Mbps ("
         + ", ".join(f"{PAPER_TOKENS_PER_STEP / (pt_s + pb * 8 / (mb * 1e6)):,.0f} vs {PAPER['table'][mb]['fp32']:,}"
                     for mb in (100, 300, 500)) + " tokens/s).", ""]
    L += ["| paper link | here | FP32 comm/compute | paper FP32 / AQ-SGD / TAH-Quant tokens/s | paper: TAH over FP32, "
          "over AQ-SGD | paper FP32 of ceiling | here FP32 / AQ-SGD / TAH-Quant tokens/s | here: TAH over FP32, "
          "over AQ-SGD | here FP32 of ceiling |", "|---|---|---:|---|---|---:|---|---|---:|"]
    for lk in sorted(paper_links, key=lambda lk: -lk["paper_mbps"]):
        mb = lk["paper_mbps"]
        pt = PAPER["table"].get(int(mb)) if float(mb).is_integer() else None
        here = {m: agg.get((lk["token"], m)) for m in ("fp32", "aqsgd", "tahquant")}
        r = comm_compute_ratio(reg["paper_boundary_bytes_per_step"], mb * 1e6, reg["paper_compute_step_s"])
        if pt:
            p_cells = (f"{pt['fp32']:,} / {pt['aqsgd']:,} / {pt['tahquant']:,} | "
                       f"{pt['tahquant'] / pt['fp32']:.2f}x, {pt['tahquant'] / pt['aqsgd']:.2f}x | "
                       f"{pt['fp32'] / PAPER_COMPUTE_TOKENS_PER_S * 100:.0f}%")
        else:
            p_cells = "(not published) | | "
        h = [_n(here[m]["tokens_per_s"]) if here[m] else "n/a" for m in ("fp32", "aqsgd", "tahquant")]
        sp = [f"{here['tahquant']['tokens_per_s'] / here[m]['tokens_per_s']:.2f}x"
              if here["tahquant"] and here[m] else "n/a" for m in ("fp32", "aqsgd")]
        fr = f"{here['fp32']['tokens_per_s'] / ceiling * 100:.0f}%" if here["fp32"] else "n/a"
        L.append(f"| {mb:g} Mbps | {lk['link'].split(',')[0]} | {r:.2f} | {p_cells} | {' / '.join(h)} | "
                 f"{', '.join(sp)} | {fr} |")
    L += ["", "Paper numbers: the TAH-Quant paper's GPT2-XL throughput table (as transcribed by a secondary "
          "source; the paper's abstract claims up to 4.3x over FP32 and 1.33x over AQ-SGD). If the regimes match, "
          "FP32's fraction of its ceiling is similar in both; the compressed methods' columns then differ mainly "
          "by their codecs' compute cost, which is small on the paper's GPUs; the none row above shows it here "
          "(docs/kernels.md says what bounds each codec).", ""]
    return L


def _stats(conv: dict[str, Any]) -> dict[str, Any]:
    """The convergence statistics, worked out from the runs (so older results render too)."""
    return convergence_stats(_conv_runs(conv)) if conv else {}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _pct(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:+.{digits}f}%"


def _verdict_text(v: dict[str, Any]) -> str:
    """TAH-Quant's gap against the seed-to-seed spread, in words, from the measurements."""
    t = (f"TAH-Quant's gap to FP32 ({_pct(v['gap_pct'])} of the mean validation loss) is "
         + ("**larger than the seed-to-seed spread**" if v["larger_than_spread"] else "**within the seed-to-seed "
            "spread**")
         + f" (the larger min-max range of the two methods over seeds: {v['spread_pct']:.2f}% of FP32's mean)")
    if v["n_paired"] > 1:
        t += (f"; paired by seed, the gap is {_pct(v['paired_mean_pct'])} on average (95% interval "
              f"+-{v['paired_ci95_pct']:.2f}%, {v['n_paired']} seeds), "
              + ("the same sign on every seed" if v["paired_same_sign"] else "of both signs across seeds")
              + (", so the gap is real at this budget" if v["paired_ci_excludes_zero"] and v["paired_same_sign"]
                 else ", so these seeds do not establish a gap" if not v["paired_ci_excludes_zero"] else ""))
    f16 = v.get("fp16_paired")
    if f16 and f16["n"] > 1:
        t += (f"; for scale, FP16, a cast that loses almost nothing, is {_pct(f16['mean'])} from FP32 paired by seed "
              f"({_pct(f16['min'])} to {_pct(f16['max'])}): the paired noise floor of this training")
    return t + "."


def _reused_note(runs: list[dict[str, Any]], here: str | None, torch_version: str | None) -> str:
    """``N runs reused from an earlier invocation ...``, naming where the reused runs ran when that is not this
    invocation's machine and torch (runs from before the machine was recorded: "not recorded"); empty without
    reused runs."""
    reused = [r for r in runs if r.get("reused")]
    if not reused:
        return ""
    where: dict[str, int] = {}
    for r in reused:
        if r.get("machine") is None:
            w = "a machine not recorded"
        elif r["machine"] != here or r.get("torch") != torch_version:
            w = f"{r['machine']}, torch {r.get('torch', '?')}"
        else:
            continue
        where[w] = where.get(w, 0) + 1
    note = f"{_count(len(reused), 'run')} reused from an earlier invocation with the same configuration"
    return note + "".join(f"; {n} of them on {w}" for w, n in where.items())


def _md_convergence(result: dict[str, Any]) -> list[str]:
    conv = result["convergence"]
    s, data = conv["settings"], conv.get("data", {})
    runs = _conv_runs(conv)
    st = _stats(conv)
    ep = conv.get("epochs")
    seeds = conv.get("seeds") or sorted({r["seed"] for r in runs})
    main = [m for m in (conv.get("methods") or dict.fromkeys(r["method"] for r in runs if r["method"] in METHODS))]
    abl = [m for m in conv.get("ablations") or [] if m not in main]
    L = ["## Convergence", ""]
    if conv.get("command") and conv["command"] != result.get("meta", {}).get("command"):
        L += [f"Command: `{conv['command']}`  ",
              f"Machine: {conv.get('machine', '?')}, torch {conv.get('torch', '?')}; load average "
              f"{conv.get('load_average_start')} at the start, {conv.get('load_average_end')} at the end; "
              f"{(conv.get('duration_s') or 0) / 60:.0f} min"
              + (f" ({note})" if (note := _reused_note(runs, conv.get("machine"), conv.get("torch"))) else "") + "."
              + (" **Partial: the run was interrupted.**" if conv.get("partial") else ""), ""]
    elif any(r.get("reused") for r in runs):  # the page's header gives the machine and time: say what they cover
        L += [f"Not trained by this invocation: {_reused_note(runs, conv.get('machine'), conv.get('torch'))}. "
              "The header's machine and time are those of the others.", ""]
    L += [(f"{len(seeds)} runs per method (seeds {', '.join(map(str, seeds))})" if len(seeds) > 1
           else f"One run per method (seed {seeds[0]})" if seeds else "One run per method")
          + f" without a link: {conv['steps']} steps of {s['batch_size']} x {s['seq_len']} tokens "
          f"on {s['stages']} stages, validation every {conv['eval_every']} steps. A seed sets the initialization and "
          "the data order, the same for every method, so a method's gap to FP32 at one seed is paired: it cancels "
          "the seed-to-seed variance; the validation set is the same for every run. The training set is capped at "
          f"{_n(data.get('max_tokens'))} corpus tokens ({_n(data.get('n_train'))} training / "
          f"{_n(data.get('n_val'))} validation sequences), so the budget makes "
          f"{fmt(ep, '.2f', missing='n/a')} epochs: AQ-SGD sends deltas against its cache from the second visit of "
          "a sample on. "
          "The loss does not depend on the link (same seed, same data order, deterministic codecs: the links change "
          "only when bytes arrive; the robustness run below checks this), so these runs use none.", ""]
    multi = len(seeds) > 1
    if multi:
        head = ["method", "seeds", "final val loss: mean +- std", "min-max", "mean vs FP32's mean",
                "paired gap per seed (" + ", ".join(f"s{x}" for x in seeds) + ")", "paired gap: mean +- 95%",
                "final train loss (mean)", "bytes on the wire (per run)", "AQ-SGD cache"]
    else:
        head = ["method", "final train loss", "final val loss", "val vs FP32", "bytes on the wire", "AQ-SGD cache"]
    L += md_table(head, [], "l" + "r" * (len(head) - 1))
    first = {}
    for r in runs:
        if r.get("summary") and not r.get("error"):
            first.setdefault(r["method"], r["summary"])
    for m in main:
        a = st.get(m)
        fails = [r for r in runs if r["method"] == m and r.get("error")]
        if not a:
            err = fails[0]["error"].splitlines()[0] if fails else "no run"
            L.append(md_row([_label(result, m), f"failed: {err}"] + [""] * (len(head) - 2)))
            continue
        sm = first[m]
        cache = (fmt_mb(sm["aqsgd_cache_bytes"], 1) if "aqsgd_cache_bytes" in sm
                 else ("not reported" if m == "aqsgd" else "none"))
        wire = fmt_mb(sm["wire_bytes_fwd"] + sm["wire_bytes_bwd"], 1)
        v = a["val_loss"]
        if multi:
            pg = a.get("paired_gap_pct", {})
            per = ", ".join(_pct(pg.get(str(x))) if str(x) in pg else "-" for x in seeds) if m != "fp32" else "0"
            p = a.get("paired")
            pm = (f"{p['mean']:+.2f}% +- {p['ci95']:.2f}%" if p and p.get("ci95") is not None
                  else _pct(p["mean"]) if p else ("0" if m == "fp32" else "n/a"))
            std = f" +- {v['std']:.4f}" if v["std"] is not None else ""
            L.append(md_row([_label(result, m), f"{v['n']}" + (f" ({len(fails)} failed)" if fails else ""),
                             f"{v['mean']:.4f}{std}", f"{v['min']:.4f}-{v['max']:.4f}",
                             _pct(a.get("gap_of_means_pct")), per, pm, f"{a['train_loss']['mean']:.4f}", wire,
                             cache]))
        else:
            L.append(md_row([_label(result, m), f"{a['train_loss']['mean']:.4f}", f"{v['mean']:.4f}",
                             _pct(a.get("gap_of_means_pct")), wire, cache]))
    L += [""]
    if multi:
        L += ["Gaps in %: `mean vs FP32's mean` compares the means over seeds; a `paired gap` is the method's final "
              "validation loss over FP32's at the same seed, minus 1, and `+- 95%` the half-width of the 95% "
              "interval of their mean (Student t over seeds).", ""]
        v = gap_verdict(st, "tahquant")
        if v:
            L += [_verdict_text(v), ""]
    failed = [r for r in runs if r.get("error")]
    if failed:
        L += ["Failed runs:", ""] + [f"- {_label(result, r['method'])}, seed {r['seed']}: "
                                     f"{r['error'].splitlines()[0]}" for r in failed] + [""]
    L += ["![loss curves](pipeline_loss.png)", ""]
    if multi:
        L += ["The plot shows the mean over seeds with a band from the lowest to the highest seed: training loss "
              "(smoothed), validation loss, and the paired validation gap to FP32 (same seed).", ""]
    if abl:
        L += _md_ablation(result, abl, runs, st)
    aq = first.get("aqsgd") or {}
    if "aqsgd_cache_bytes" in aq:
        per = aq.get("aqsgd_cache_bytes_per_sample")
        n = aq.get("aqsgd_cached_samples")
        xl = PAPER["seq_len"] * PAPER["hidden"] * 2
        L += [f"AQ-SGD's cache: {fmt_mb(aq['aqsgd_cache_bytes'], 1)} in all ranks"
              + (f" ({n:,} samples x {per / 1e3:.1f} kB per sample, per boundary, on each side)" if per and n else "")
              + f". TAH-Quant and the other methods keep nothing. At GPT2-XL's scale the cache is "
              f"{fmt_mb(xl, 2)} (fp16) per sample per boundary per side: with {PAPER['stages']} stages, "
              f"{2 * (PAPER['stages'] - 1) * xl * 1000 / 1e9:.1f} GB per 1,000 training samples.", ""]
    elif "aqsgd" in main:
        L += ["AQ-SGD's run reported no cache size.", ""]
    return L


def _md_ablation(result: dict[str, Any], abl: list[str], runs: list[dict[str, Any]],
                 st: dict[str, Any]) -> list[str]:
    """TAH-Quant variants, each against TAH-Quant and FP32 at the same seeds."""
    seeds = sorted({r["seed"] for r in runs if r["method"] in abl})
    tah = {r["seed"]: r["summary"]["val_loss"] for r in runs if r["method"] == "tahquant" and r.get("summary")}
    L = ["### TAH-Quant ablation", "",
         "Each variant changes one thing of the default TAH-Quant"
         + (" (but the G=64 5/4 row, the operating point of docs/codecs.md: 64-channel tiles, 4 bits with 5 on "
            "the widest 10% of tokens)" if "tah-g64" in abl else "")
         + f", at seed{'s' if len(seeds) > 1 else ''} "
         f"{', '.join(map(str, seeds))}; gaps are paired with TAH-Quant's and FP32's runs of the same seed (mean "
         "over those seeds).", ""]
    L += md_table(["variant", "forward codec", "backward codec", "forward bits/element", "seeds", "final val loss",
                   "vs TAH-Quant (paired)", "vs FP32 (paired)"], [], "lllrrrrr")
    rows = ["tahquant", *abl] if "tahquant" in st else abl
    for m in rows:
        label, fwd, bwd = ALL_METHODS.get(m, (m, "?", "?"))
        a = st.get(m)
        if not a:
            err = next((r["error"].splitlines()[0] for r in runs if r["method"] == m and r.get("error")), "no run")
            L.append(md_row([label, f"`{fwd}`", f"`{bwd}`", "", "", f"failed: {err}", "", ""]))
            continue
        sm = next(r["summary"] for r in runs if r["method"] == m and r.get("summary"))
        bits = sm["wire_bytes_fwd"] * 8 / (sm["fp32_bytes"] / 2 / 4) if sm.get("fp32_bytes") else None
        per = a["val_loss_per_seed"]
        used = [x for x in seeds if str(x) in per]
        vs_t = [per[str(x)] / tah[x] - 1 for x in used if x in tah]
        pg = a.get("paired_gap_pct", {})
        vs_f = [pg[str(x)] for x in used if str(x) in pg]
        L.append(md_row([label, f"`{fwd}`", f"`{bwd}`", fmt(bits, ".2f", missing="n/a"),
                         ", ".join(map(str, used)),
                         f"{statistics.fmean(per[str(x)] for x in used):.4f}" if used else "n/a",
                         _pct(statistics.fmean(vs_t) * 100) if vs_t and m != "tahquant" else "-",
                         _pct(statistics.fmean(vs_f)) if vs_f else "n/a"]))
    return L + [""]


def _md_robustness(result: dict[str, Any]) -> list[str]:
    rob = result["robustness"]
    s = rob["settings"]
    L = ["## Robustness: a lossy, delayed link", "",
         f"The default training ({s['stages']} stages, `{s['fwd_codec']}` / `{s['bwd_codec']}`, "
         f"{s['microbatches']} micro-batches of {s['batch_size'] // s['microbatches']} x {s['seq_len']} tokens), "
         f"shortened to {rob['steps']} steps, over `{rob['wanted_link']}` against the same run without a link."
         + (f" This section: `{rob['command']}`, {rob['date']}." if rob.get("command") else ""), ""]
    for a in rob.get("attempts", []):
        if a.get("error"):
            L.append(f"- `{a['link']}`: refused: {a['error'].splitlines()[0]}")
        else:
            L.append(f"- `{a['link']}`: ran ({a.get('link_mode', '')}), {a['summary']['tokens_per_s']:,.0f} tokens/s, "
                     f"final val loss {a['summary']['val_loss']:.4f}")
    b = rob.get("baseline", {})
    if b.get("summary"):
        L.append(f"- no link: {b['summary']['tokens_per_s']:,.0f} tokens/s, final val loss "
                 f"{b['summary']['val_loss']:.4f}")
    elif b.get("error"):
        L.append(f"- no link: failed: {b['error'].splitlines()[0]}")
    L.append("")
    if rob.get("verdict"):
        L += [f"Result: **{rob['verdict']}** loss over {rob['steps_compared']} steps (largest per-step train-loss "
              f"difference {rob['max_abs_train_loss_diff']:.3g}; final val loss {rob['val_loss_link']:.4f} vs "
              f"{rob['val_loss_nolink']:.4f}); the run {'completed' if rob.get('completed') else 'did NOT complete'}"
              f" all its steps. Packet loss: {rob['loss_part']}"
              + ("; TCP retransmits lost packets, so loss costs time, not correctness"
                 if rob["loss_part"].startswith("applied") else "")
              + (f". Link made by: {', '.join(f'{k} {v}' for k, v in rob['shaping'].items())}."
                 if rob.get("shaping") else "."), ""]
    return L


def _color(m: str) -> str:
    """The same colour for a method in every plot."""
    names = list(ALL_METHODS)
    return f"C{names.index(m) % 10}" if m in names else "C9"


def _plot_throughput(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    tp = result["throughput"]
    links, agg = _agg(result)
    real = [lk for lk in links if lk["token"] != "none"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for m in tp["methods"]:
        pts = [(_rate_of(lk) / 1e6, agg[(lk["token"], m)]["tokens_per_s"]) for lk in real if (lk["token"], m) in agg]
        color = _color(m)
        if pts:
            axes[0].plot(*zip(*pts), "o-", color=color, label=_label(result, m))
        if "fp32" in tp["methods"] and m != "fp32":
            sp = [(_rate_of(lk) / 1e6, agg[(t, m)]["tokens_per_s"] / agg[(t, "fp32")]["tokens_per_s"])
                  for lk in real if (t := lk["token"], m) in agg and (t, "fp32") in agg]
            if sp:
                axes[1].plot(*zip(*sp), "o-", color=color, label=_label(result, m))
    ceiling = agg.get(("none", "fp32"))
    if ceiling:
        axes[0].axhline(ceiling["tokens_per_s"], color="k", ls="--", lw=1, label="compute-only ceiling (FP32)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("link rate (Mbit/s)")
        ax.grid(alpha=0.3, which="both")
        for lk in real:
            if lk.get("paper_mbps"):
                ax.axvline(_rate_of(lk) / 1e6, color="grey", ls=":", lw=0.8)
                ax.text(_rate_of(lk) / 1e6, 0.98, f" paper {lk['paper_mbps']:g} Mbps",
                        transform=ax.get_xaxis_transform(), rotation=90, va="top", ha="right", fontsize=7,
                        color="grey")
    axes[0].set_ylabel("training tokens/s")
    axes[0].set_ylim(bottom=0)
    axes[0].set_title("throughput vs link rate")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_ylabel("speedup over FP32 (same link)")
    axes[1].set_title("speedup over FP32")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    finish(fig, path)


def _band(series: list[list[list[float]]]) -> tuple[list[float], list[float], list[float], list[float]]:
    """Steps common to every run of ``series`` (``[step, value]`` pairs per run), and the mean, min and max
    over runs at each."""
    maps = [dict((int(a), b) for a, b in run) for run in series]
    steps = sorted(set.intersection(*(set(mp) for mp in maps))) if maps else []
    vals = [[mp[x] for mp in maps] for x in steps]
    return ([float(x) for x in steps], [sum(v) / len(v) for v in vals], [min(v) for v in vals],
            [max(v) for v in vals])


def _plot_loss(result: dict[str, Any], path: Path) -> None:
    conv = result["convergence"]
    runs = [r for r in _conv_runs(conv) if r.get("curve") and not r.get("error")]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["method"], []).append(r)
    main = [m for m in by if m in METHODS]
    abl = [m for m in by if m not in METHODS]
    multi = any(len(v) > 1 for v in by.values())
    if not multi and not abl:  # one run per method: the curves as they are
        fig, ax = pyplot().subplots(figsize=(7.5, 4.6))
        for m in main:
            r = by[m][0]
            plot_train_val(ax, _label(result, m), r["curve"], r.get("val"), color=_color(m), lw=1.1, ms=4)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        finish(fig, path)
        return
    fig, axes = pyplot().subplots(1, 3, figsize=(16, 4.8))
    for m in main:
        rs, c = by[m], _color(m)
        n = len(rs)
        k = max(1, len(rs[0]["curve"]) // 50) + 1
        curves = [[[a, b] for (a, _), b in zip(r["curve"], smooth([x[1] for x in r["curve"]], k))] for r in rs]
        x, mean, lo, hi = _band(curves)
        axes[0].plot(x, mean, color=c, lw=1.1, label=f"{_label(result, m)} (n={n})")
        axes[0].fill_between(x, lo, hi, color=c, alpha=0.18, lw=0)
        vals = [r["val"] for r in rs if r.get("val")]
        if vals:
            x, mean, lo, hi = _band(vals)
            axes[1].plot(x, mean, "o-", color=c, lw=1.1, ms=3, label=f"{_label(result, m)} (n={n})")
            axes[1].fill_between(x, lo, hi, color=c, alpha=0.18, lw=0)
    ref = {r["seed"]: dict((int(a), b) for a, b in r.get("val") or []) for r in by.get("fp32", [])}
    for m in main + abl:
        if m == "fp32" or not ref:
            continue
        gaps = []
        for r in by[m]:
            base = ref.get(r["seed"])
            if base and r.get("val"):
                gaps.append([[a, (b / base[int(a)] - 1) * 100] for a, b in r["val"] if int(a) in base])
        if not gaps:
            continue
        x, mean, lo, hi = _band(gaps)
        style = "o-" if m in METHODS else "x--"
        axes[2].plot(x, mean, style, color=_color(m), lw=1.1, ms=3, label=f"{_label(result, m)} (n={len(gaps)})")
        if len(gaps) > 1:
            axes[2].fill_between(x, lo, hi, color=_color(m), alpha=0.15, lw=0)
    axes[2].axhline(0.0, color="k", lw=0.8)
    titles = ("training loss (smoothed): mean, min-max band", "validation loss: mean, min-max band",
              "validation loss vs FP32, same seed (%)")
    for ax, t in zip(axes, titles):
        ax.set_title(t, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0].set_ylabel("loss")
    if axes[1].lines:  # zoom in on the later part, where the methods differ
        ys = [y for ln in axes[1].lines for y in ln.get_ydata()[len(ln.get_ydata()) // 3:]]
        if ys:
            pad = (max(ys) - min(ys)) * 0.1 or 0.05
            axes[1].set_ylim(min(ys) - pad, max(ys) + pad)
    finish(fig, path)
