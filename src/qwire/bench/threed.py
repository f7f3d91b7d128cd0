"""``qwire bench 3d``: 3D training (pipeline x tensor x data parallel) over two "sites", per dimension.

The mesh is ``--pp 2 --tp 2 --dp 2`` (8 processes). Tensor parallelism stays
inside a node on a fast link (``--link-fast``, default 10gbit); the pipeline
and the data-parallel replicas cross a slow link (``--link-slow``, default
50mbit), every rank behind its own ``tc``-shaped uplink in the network lab
(``qwire.netlab``, docs/netlab.md). Two parts, written to ``<out>/3d.json``,
``<out>/3d.md``, ``<out>/3d_time.png`` and ``<out>/3d_loss.png``:

1. **Throughput and where the time goes.** Five variants: uncompressed (fp32
   on every dimension), fully compressed (TAH-Quant / 6-bit per-channel on the
   pipeline, FP8 on TP, 8-bit block-wise on DP) and one dimension compressed
   at a time. Each is a short ``qwire train`` run (``--steps``, the first
   ``--skip`` left out), the variants interleaved and the sweep repeated
   ``--repeat`` times, so a change in the machine's load hits every variant
   alike. From ``metrics.jsonl``: tokens/s, rank 0's seconds per step in the
   TP collectives (``time_tp_s``) and in the DP gradient all-reduce after
   backward (``time_dp_s``), the rest of the step (compute, pipeline
   transfers and bubbles, optimizer), and the bytes per step on each
   dimension.
2. **Validation loss.** Uncompressed against fully compressed, same seed and
   data, ``--conv-steps`` steps **without links**: the links only change when
   bytes arrive, never what they are, so the loss does not depend on them.
   These runs also give the time breakdown without any link.

Where the network lab cannot run (not root, no ``tc``), or with ``--no-links``,
every run goes without links and the output says so in its first lines: such
times are compute + loopback only and say nothing about a slow network.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from qwire.bench import add_out_argument
from qwire.bench.report import (
    bench_command,
    finish,
    fmt_mb,
    lab_mode,
    link_name,
    link_rate,
    loadavg,
    machine_info,
    md_row,
    plot_train_val,
    pyplot,
    render_saved,
)
from qwire.bench.runner import check_counts
from qwire.bench.runner import records as _records
from qwire.bench.runner import train_command as _train_command
from qwire.bench.runner import train_quietly as _train

UNCOMPRESSED = {"fwd_codec": "fp32", "bwd_codec": "fp32", "tp_codec": "fp32", "dp_codec": "fp32"}
COMPRESSED = {"fwd_codec": "tahquant", "bwd_codec": "perchannel6", "tp_codec": "fp8",
              "dp_codec": "blockwise8:block=256"}
DIM_CODECS = {"pp": ("fwd_codec", "bwd_codec"), "tp": ("tp_codec",), "dp": ("dp_codec",)}
DIMS = ("pp", "tp", "dp")


def _variant(label: str, dims: tuple[str, ...]) -> dict[str, Any]:
    codecs = dict(UNCOMPRESSED)
    for d in dims:
        codecs.update({k: COMPRESSED[k] for k in DIM_CODECS[d]})
    return {"label": label, "compressed": list(dims), "codecs": codecs}


# variant -> label, the dimensions it compresses, its four codecs
VARIANTS: dict[str, dict[str, Any]] = {
    "uncompressed": _variant("uncompressed", ()),
    "pp": _variant("PP compressed", ("pp",)),
    "tp": _variant("TP compressed", ("tp",)),
    "dp": _variant("DP compressed", ("dp",)),
    "full": _variant("fully compressed", DIMS),
}
CONV_VARIANTS = ("uncompressed", "full")
MESH = {"stages": 2, "tp": 2, "dp": 2}
SETTINGS = {"model": "llama-tiny", "seq_len": 64, "batch_size": 8, "microbatches": 2, "schedule": "1f1b"}
QUICK = {"seq_len": 32, "batch_size": 4, "microbatches": 2, "vocab_size": 512, "max_tokens": 60_000,
         "eval_batches": 2}
LINK_SLOW, LINK_FAST = "50mbit", "10gbit"
PAYLOAD_FRACTION = 1448 / 1514  # TCP payload per Ethernet frame as tc counts it (docs/netlab.md)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_argument(p, "where 3d.json, 3d.md and the plots go")
    p.add_argument("--runs", default="runs/bench-3d",
                   help="where the training runs go (one timestamped folder per invocation)")
    p.add_argument("--quick", action="store_true", help="tiny settings and a few steps (smoke test)")
    p.add_argument("--steps", type=int, default=0, help="steps per throughput run (default 10; --quick 3)")
    p.add_argument("--skip", type=int, default=-1, help="warm-up steps left out of the timings (default 3; --quick 1)")
    p.add_argument("--repeat", type=int, default=0,
                   help="interleaved sweeps over the variants (default 2; --quick 1); steps of all sweeps pooled")
    p.add_argument("--conv-steps", type=int, default=0,
                   help="steps of the validation-loss runs, without links (default 120; --quick 4)")
    p.add_argument("--eval-every", type=int, default=0, help="validation interval of those runs (default conv/4)")
    p.add_argument("--link-slow", default=LINK_SLOW, help="link of the pipeline and data-parallel dimensions "
                                                          "(between sites)")
    p.add_argument("--link-fast", default=LINK_FAST, help="link of the tensor-parallel dimension (inside a site)")
    p.add_argument("--no-links", action="store_true",
                   help="run the throughput part without links (loopback; labelled as such in the output)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)} for the throughput part")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-convergence", action="store_true")
    p.add_argument("--render-only", action="store_true",
                   help="re-render 3d.md and the plots from the 3d.json in --out (no training)")


# -----------------------------------------------------------------------------------------------
# The run.


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.render_only:
        return render_saved("3d", out, "3d", render)
    try:
        plan = _plan(args)
    except ValueError as e:
        print(f"qwire bench 3d: {e}", file=sys.stderr)
        return 2
    if plan["links"]["reason"]:
        print(f"qwire bench 3d: {plan['links']['reason']}: the throughput runs go WITHOUT links (loopback), and "
              "the output says so", file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs) / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    t0 = time.perf_counter()
    result: dict[str, Any] = {"meta": _meta(args, plan), "variants": {v: VARIANTS[v] for v in VARIANTS},
                              "settings": plan["settings"], "links": plan["links"]}
    failures = 0
    if not args.skip_throughput:
        result["throughput"] = _throughput(plan, runs / "throughput")
        failures += sum(1 for r in result["throughput"]["runs"] if r.get("error"))
    if not args.skip_convergence:
        result["convergence"] = _convergence(plan, runs / "convergence")
        failures += sum(1 for r in result["convergence"]["runs"].values() if r.get("error"))
    result["meta"]["duration_s"] = time.perf_counter() - t0
    result["meta"]["load_average_end"] = loadavg()
    (out / "3d.json").write_text(json.dumps(result, indent=2))
    render(result, out)
    print(f"\nwrote {out / '3d.json'}, {out / '3d.md'} and the plots ({result['meta']['duration_s'] / 60:.1f} min)",
          flush=True)
    return 1 if failures else 0


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    """Check the arguments and fill in the defaults (--quick aware)."""
    from qwire.netlab import lab_unavailable_reason, parse_link

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    slow, fast = parse_link(args.link_slow), parse_link(args.link_fast)  # a bad spec fails before anything runs
    for spec, name in ((slow, "--link-slow"), (fast, "--link-fast")):
        if spec.mode == "sim":
            raise ValueError(f"{name}: the simulated link models only pipeline traffic; this benchmark needs the "
                             "network lab (or --no-links)")
    check_counts(args, "steps", "repeat", "conv_steps")
    steps = args.steps or (3 if args.quick else 10)
    skip = args.skip if args.skip >= 0 else (1 if args.quick else 3)
    if skip >= steps:
        raise ValueError(f"--skip ({skip}) must be less than --steps ({steps})")
    conv_steps = args.conv_steps or (4 if args.quick else 120)
    settings = {**SETTINGS, **MESH, "seed": args.seed, **(QUICK if args.quick else {})}
    reason = ""
    if args.no_links:
        reason = "--no-links was given"
    elif not args.skip_throughput:
        why = lab_unavailable_reason()
        if why:
            reason = f"the network lab cannot run here ({why})"
    links: dict[str, Any] = {"shaped": not reason, "reason": reason, "slow": lab_mode(str(slow)),
                             "fast": lab_mode(str(fast))}
    links["per_dim"] = {"pp": links["slow"], "tp": links["fast"], "dp": links["slow"]} if not reason else \
        {"pp": "", "tp": "", "dp": ""}
    return {"variants": variants, "steps": steps, "skip": skip, "repeat": args.repeat or (1 if args.quick else 2),
            "conv_steps": conv_steps, "eval_every": args.eval_every or max(1, conv_steps // 4),
            "settings": settings, "links": links, "quick": args.quick}



def _config(plan: dict[str, Any], codecs: dict[str, str], **over: Any) -> Any:
    from qwire.train import TrainConfig

    return TrainConfig(**{**plan["settings"], **codecs, "checkpoint_every": 0, **over})


# -----------------------------------------------------------------------------------------------
# Part 1: throughput and the time per dimension over the two-site links.


def _throughput(plan: dict[str, Any], runs: Path) -> dict[str, Any]:
    lk = plan["links"]["per_dim"]
    rows: list[dict[str, Any]] = []
    total = len(plan["variants"]) * plan["repeat"]
    k = 0
    for rep in range(plan["repeat"]):
        for v in plan["variants"]:
            k += 1
            cfg = _config(plan, VARIANTS[v]["codecs"], steps=plan["steps"], eval_every=0, eval_batches=1,
                          log_every=plan["steps"], out=str(runs / f"{v}-r{rep}"),
                          link_pp=lk["pp"], link_tp=lk["tp"], link_dp=lk["dp"])
            row: dict[str, Any] = {"variant": v, "repeat": rep, "run_dir": cfg.out, "command": _train_command(cfg)}
            summary, err, wall = _train(cfg)
            row["wall_s"] = wall
            label = VARIANTS[v]["label"]
            if err:
                row["error"] = err
                print(f"[3d {k}/{total}] {label:<17} r{rep} FAILED: {err.splitlines()[0]}", flush=True)
                rows.append(row)
                if "network lab cannot run" in err:  # every other run would fail the same way
                    print("qwire bench 3d: the network lab failed to start; the throughput part stops here (run as "
                          "root with iproute2 and the htb/tbf qdiscs, or pass --no-links for unshaped numbers)",
                          file=sys.stderr, flush=True)
                    return {"steps": plan["steps"], "skip": plan["skip"], "repeat": plan["repeat"],
                            "variants": plan["variants"], "runs": rows, "aborted": err.splitlines()[0]}
                continue
            row.update(measure(cfg.out, plan["skip"]))
            row["link_mode"] = summary.get("link_mode", "none") if summary else "none"
            if plan["links"]["shaped"] and row["link_mode"] != "lab":
                row["error"] = f"expected the network lab, the run reported link mode {row['link_mode']!r}"
            w = row["wire_per_step"]
            print(f"[3d {k}/{total}] {label:<17} r{rep} {row['tokens_per_s']:7,.0f} tokens/s  step "
                  f"{row['step_s']:.2f} s (tp {row['tp_s']:.2f}, dp {row['dp_s']:.2f}, rest {row['rest_s']:.2f})  "
                  f"MB/step pp {w['pp'] / 1e6:.2f} tp {w['tp'] / 1e6:.2f} dp {w['dp'] / 1e6:.2f}  "
                  f"({row['link_mode']}, {wall:.0f} s)", flush=True)
            rows.append(row)
    return {"steps": plan["steps"], "skip": plan["skip"], "repeat": plan["repeat"], "variants": plan["variants"],
            "runs": rows}


def measure(run_dir: str | Path, skip: int) -> dict[str, Any]:
    """Timings and bytes of a finished run from its ``metrics.jsonl``, over the steps after the first ``skip``.

    Per step (rank 0's view): ``step_s``; ``tp_s`` in the TP collectives (forward and backward);
    ``dp_s`` in the DP gradient all-reduce after backward; ``rest_s = step_s - tp_s - dp_s`` (compute,
    pipeline transfers and bubbles, optimizer). Means over the counted steps; the per-step lists are kept.
    Bytes per step are summed over all ranks (``wire_per_step``: pp = forward + backward payloads).
    """
    recs = _records(run_dir)
    counted = recs[skip:] or recs
    tokens_per_step = recs[0]["tokens"] / recs[0]["step"]
    step = [r["step_time_s"] for r in counted]
    tp = [r.get("time_tp_s", 0.0) for r in counted]
    dp = [r.get("time_dp_s", 0.0) for r in counted]

    def med(key: str) -> float:
        return float(statistics.median(r.get(key, 0) for r in counted))
    wire = {"pp": med("wire_bytes_fwd") + med("wire_bytes_bwd"), "pp_fwd": med("wire_bytes_fwd"),
            "pp_bwd": med("wire_bytes_bwd"), "tp": med("wire_bytes_tp"), "dp": med("wire_bytes_dp")}
    wire["total"] = wire["pp"] + wire["tp"] + wire["dp"]
    n = len(step)
    return {"tokens_per_step": tokens_per_step, "steps_counted": n, "tokens_per_s": tokens_per_step * n / sum(step),
            "step_s": sum(step) / n, "tp_s": sum(tp) / n, "dp_s": sum(dp) / n,
            "rest_s": (sum(step) - sum(tp) - sum(dp)) / n, "wire_per_step": wire,
            "fp32_pp_per_step": med("fp32_bytes"),
            "per_step": {"step": [r["step"] for r in counted], "step_s": step, "tp_s": tp, "dp_s": dp}}


def aggregate(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant: the counted steps of all its successful runs pooled (tokens/s = tokens / seconds; time
    components are means per step), the per-run tokens/s range, and the bytes per step."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if not r.get("error"):
            by.setdefault(r["variant"], []).append(r)
    agg = {}
    for v, rs in by.items():
        n = sum(r["steps_counted"] for r in rs)
        secs = {k: sum(r[k] * r["steps_counted"] for r in rs) for k in ("step_s", "tp_s", "dp_s", "rest_s")}
        tps = [r["tokens_per_s"] for r in rs]
        agg[v] = {"runs": len(rs), "steps_counted": n,
                  "tokens_per_s": sum(r["tokens_per_step"] * r["steps_counted"] for r in rs) / secs["step_s"],
                  "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
                  **{k: s / n for k, s in secs.items()}, "wire_per_step": rs[0]["wire_per_step"],
                  "fp32_pp_per_step": rs[0]["fp32_pp_per_step"], "link_mode": rs[0].get("link_mode", "")}
    return agg


# -----------------------------------------------------------------------------------------------
# Part 2: validation loss, uncompressed vs fully compressed, without links.


def _convergence(plan: dict[str, Any], runs: Path) -> dict[str, Any]:
    steps = plan["conv_steps"]
    res: dict[str, Any] = {"steps": steps, "eval_every": plan["eval_every"], "skip": plan["skip"], "runs": {}}
    for k, v in enumerate(CONV_VARIANTS, 1):
        cfg = _config(plan, VARIANTS[v]["codecs"], steps=steps, eval_every=plan["eval_every"],
                      log_every=max(1, steps // 10), out=str(runs / v))
        summary, err, wall = _train(cfg)
        r: dict[str, Any] = {"run_dir": cfg.out, "command": _train_command(cfg), "wall_s": wall}
        label = VARIANTS[v]["label"]
        if err:
            r["error"] = err
            print(f"[3d loss {k}/{len(CONV_VARIANTS)}] {label:<17} FAILED: {err.splitlines()[0]}", flush=True)
        else:
            recs = _records(cfg.out)
            r.update(summary=summary, curve=[[x["step"], x["loss"]] for x in recs],
                     val=[[x["step"], x["val_loss"]] for x in recs if "val_loss" in x],
                     timing=measure(cfg.out, min(plan["skip"], steps - 1)))
            r["timing"].pop("per_step")
            print(f"[3d loss {k}/{len(CONV_VARIANTS)}] {label:<17} val loss {summary['val_loss']:.4f}  "
                  f"{r['timing']['tokens_per_s']:,.0f} tokens/s without links  ({wall:.0f} s)", flush=True)
        res["runs"][v] = r
    return res


# -----------------------------------------------------------------------------------------------
# What the JSON says about the run.


def _meta(args: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    return {"command": bench_command("3d", args, add_arguments), **machine_info(), "quick": plan["quick"]}


# -----------------------------------------------------------------------------------------------
# Rendering: markdown and plots from the JSON alone.


def render(result: dict[str, Any], out: Path) -> None:
    """Write ``3d.md`` and the plots from a ``3d.json`` result."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(result.get("throughput", {}).get("runs", []))
    conv = result.get("convergence", {}).get("runs", {})
    # a plot with nothing to show is removed: an earlier run's would stand beside this run's tables
    for name, data, plot in (("3d_time.png", agg, lambda p: _plot_time(result, agg, p)),
                             ("3d_loss.png", any(r.get("curve") for r in conv.values()),
                              lambda p: _plot_loss(result, p))):
        if data:
            plot(out / name)
        else:
            (out / name).unlink(missing_ok=True)
    (out / "3d.md").write_text(markdown(result))


def _label(result: dict[str, Any], v: str) -> str:
    return result.get("variants", {}).get(v, {}).get("label") or VARIANTS.get(v, {}).get("label", v)


def _pct(a: float, b: float) -> str:
    return f"{a / b * 100:.0f}%" if b else "n/a"




def markdown(result: dict[str, Any]) -> str:
    meta, links = result.get("meta", {}), result.get("links", {})
    L = ['# 3D training over two "sites": uncompressed vs compressed, dimension by dimension', ""]
    if result.get("throughput") and not links.get("shaped", False):
        L += [f"**NO LINKS: {links.get('reason') or 'the runs were not shaped'}. Every throughput run below went "
              "over loopback without any rate limit, so its times are compute and local transfers only; they say "
              "nothing about a two-site network.**", ""]
    L += [f"Command: `{meta.get('command', 'qwire bench 3d')}`  ",
          f"Machine: {meta.get('machine', '?')}, torch {meta.get('torch', '?')}; load average "
          f"{meta.get('load_average_start')} at the start, {meta.get('load_average_end')} at the end; "
          f"{(meta.get('duration_s') or 0) / 60:.0f} min in all."
          + (" **Quick smoke-test settings: the numbers mean nothing.**" if meta.get("quick") else ""), ""]
    L += _md_setup(result)
    agg = aggregate(result.get("throughput", {}).get("runs", []))
    L += _md_summary(result, agg)
    if result.get("throughput"):
        L += _md_throughput(result, agg)
        L += _md_bytes(result, agg)
        L += _md_dominates(result, agg)
    if result.get("convergence"):
        L += _md_nolink(result)
        L += _md_loss(result)
    L += _md_notes(result)
    return "\n".join(L) + "\n"


def _md_setup(result: dict[str, Any]) -> list[str]:
    s, links = result.get("settings", {}), result.get("links", {})
    per = links.get("per_dim", {})
    mb = s.get("batch_size", 0) // max(1, s.get("microbatches", 1))
    L = ["## Setup", "",
         f"{s.get('stages')} pipeline stages x {s.get('tp')} tensor-parallel ranks x {s.get('dp')} data-parallel "
         f"replicas = {s.get('stages', 0) * s.get('tp', 0) * s.get('dp', 0)} processes, `{s.get('model')}`, "
         f"{s.get('schedule', '1f1b')} with {s.get('microbatches')} micro-batches of {mb} x {s.get('seq_len')} "
         f"tokens per replica (global batch {s.get('batch_size', 0) * s.get('dp', 0)} sequences), seed "
         f"{s.get('seed')}. Ranks are `(dp * stages + pp) * tp + tp_rank`; every rank has its own network "
         "namespace and a `tc`-shaped uplink, and the traffic between two ranks crosses the link of the dimension "
         "in which they differ (docs/netlab.md). Each pair of TP ranks is one node with a fast link inside it; "
         "every link between nodes, pipeline and data-parallel, is slow: the two \"sites\".", "",
         "| dimension | what crosses it | link | uncompressed | compressed |", "|---|---|---|---|---|"]
    what = {"pp": "activations forward, their gradients back (each TP rank its own copy)",
            "tp": "all-gather / reduce-scatter / all-reduce of the TP layers, forward and backward",
            "dp": "the gradient all-reduce after backward"}
    for d in DIMS:
        unc = " / ".join(f"`{UNCOMPRESSED[k]}`" for k in DIM_CODECS[d])
        comp = " / ".join(f"`{COMPRESSED[k]}`" for k in DIM_CODECS[d])
        link = link_name(per.get(d, "")) if links.get("shaped") else "none (not shaped)"
        L.append(f"| {d} | {what[d]} | {link} | {unc} | {comp} |")
    L.append("")
    return L


def _md_summary(result: dict[str, Any], agg: dict[str, dict[str, Any]]) -> list[str]:
    L: list[str] = []
    u, f = agg.get("uncompressed"), agg.get("full")
    conv = result.get("convergence", {}).get("runs", {})
    cu, cf = (conv.get(v, {}).get("summary") for v in CONV_VARIANTS)
    if not (u or cu):
        return L
    L += ["## Summary", ""]
    where = "over the links" if result.get("links", {}).get("shaped") else "WITHOUT links"
    if u and f:
        L.append(f"- Fully compressed runs at **{f['tokens_per_s'] / u['tokens_per_s']:.2f}x** the uncompressed "
                 f"throughput {where} ({f['tokens_per_s']:,.0f} vs {u['tokens_per_s']:,.0f} tokens/s) and puts "
                 f"{u['wire_per_step']['total'] / max(1.0, f['wire_per_step']['total']):.1f}x fewer bytes on the "
                 "wire.")
    if u:
        parts = {"DP all-reduce": u["dp_s"], "TP collectives": u["tp_s"], "the rest": u["rest_s"]}
        top = max(parts, key=parts.__getitem__)
        L.append(f"- Uncompressed, a step takes {u['step_s']:.2f} s: DP all-reduce {u['dp_s']:.2f} s "
                 f"({_pct(u['dp_s'], u['step_s'])}), TP collectives {u['tp_s']:.2f} s ({_pct(u['tp_s'], u['step_s'])}),"
                 f" the rest (compute, pipeline transfers and bubbles) {u['rest_s']:.2f} s "
                 f"({_pct(u['rest_s'], u['step_s'])}); the largest part is {top}.")
        saved = {d: u["step_s"] - agg[d]["step_s"] for d in DIMS if d in agg}
        if saved:
            L.append("- Compressing one dimension at a time saves " + ", ".join(
                f"{d.upper()} {v:+.2f} s per step ({agg[d]['tokens_per_s'] / u['tokens_per_s']:.2f}x)"
                for d, v in saved.items()) + " (a negative saving is a slowdown)"
                + (f"; all three together save {u['step_s'] - f['step_s']:+.2f} s." if f else "."))
    if cu and cf:
        rel = cf["val_loss"] / cu["val_loss"] - 1
        L.append(f"- Validation loss after {result['convergence']['steps']} steps without links: "
                 f"{cu['val_loss']:.4f} uncompressed, {cf['val_loss']:.4f} fully compressed ({rel * 100:+.2f}%).")
    return L + [""]


def _md_throughput(result: dict[str, Any], agg: dict[str, dict[str, Any]]) -> list[str]:
    tp = result["throughput"]
    links = result.get("links", {})
    base = agg.get("uncompressed")
    modes = sorted({a["link_mode"] for a in agg.values() if a.get("link_mode")})
    L = ["## Throughput and where the time goes", "",
         f"Every variant ran {tp['repeat']} time(s) for {tp['steps']} steps, the variants one after the other in "
         f"each sweep; the first {tp['skip']} steps of each run are left out and the remaining "
         f"{tp['steps'] - tp['skip']} of all its runs pooled. Seconds are means per step from rank 0's view "
         "(stage 0, TP rank 0, replica 0). "
         + (f"Link mode of the runs: {', '.join(f'`{m}`' for m in modes)}." if links.get("shaped")
            else "**No links: loopback.**"), "",
         "| variant | compressed | tokens/s (runs' range) | vs uncompressed | step s | TP collectives s | "
         "DP all-reduce s | rest s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for v in tp["variants"]:
        a = agg.get(v)
        comp = ", ".join(d.upper() for d in result.get("variants", VARIANTS).get(v, {}).get("compressed", [])) or "-"
        if not a:
            L.append(f"| {_label(result, v)} | {comp} | failed | | | | | |")
            continue
        rng = (f" ({a['tokens_per_s_min']:,.0f}-{a['tokens_per_s_max']:,.0f})" if a["runs"] > 1 else "")
        sp = f"{a['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "n/a"
        L.append(f"| {_label(result, v)} | {comp} | {a['tokens_per_s']:,.0f}{rng} | {sp} | {a['step_s']:.3f} | "
                 f"{a['tp_s']:.3f} ({_pct(a['tp_s'], a['step_s'])}) | {a['dp_s']:.3f} ({_pct(a['dp_s'], a['step_s'])})"
                 f" | {a['rest_s']:.3f} ({_pct(a['rest_s'], a['step_s'])}) |")
    L += ["", *(["![time per step by dimension](3d_time.png)", ""] if agg else [])]  # (render() plots it)
    if base:
        saved = {d: base["step_s"] - agg[d]["step_s"] for d in DIMS if d in agg}
        if saved and "full" in agg:
            tot = base["step_s"] - agg["full"]["step_s"]
            L += [f"Attribution: the seconds per step each single-dimension variant saves against uncompressed add up "
                  f"to {sum(saved.values()):+.3f} s; compressing all three saved {tot:+.3f} s. "
                  + ("The savings roughly add up: the dimensions' costs are mostly serial on the critical path."
                     if abs(sum(saved.values()) - tot) <= 0.15 * max(abs(tot), 1e-9) else
                     "They do not add up exactly: the dimensions overlap or wait on each other (a faster DP "
                     "all-reduce, for instance, no longer hides skew between the ranks), and runs vary."), ""]
    if tp.get("aborted"):
        L += [f"**The throughput part stopped early**: {tp['aborted']}", ""]
    failed = [r for r in tp["runs"] if r.get("error")]
    if failed:
        L += ["Failed runs:", ""] + [f"- {_label(result, r['variant'])} (sweep {r['repeat']}): "
                                     f"{r['error'].splitlines()[0]}" for r in failed] + [""]
    return L


def _md_bytes(result: dict[str, Any], agg: dict[str, dict[str, Any]]) -> list[str]:
    tp = result["throughput"]
    base = agg.get("uncompressed")
    L = ["## Bytes on the wire per step", "",
         "Summed over all ranks, per training step; the same on every link and in every sweep. Pipeline = "
         "activations forward + gradients back. The fp32 equivalent of the pipeline is what `fp32_bytes` records; "
         "that of TP and DP is the uncompressed run's bytes (the fp32 codec through the same collectives).", "",
         "| variant | pipeline fwd + bwd | TP collectives | DP all-reduce | total | less than fp32 |",
         "|---|---:|---:|---:|---:|---:|"]
    rows = [(v, agg[v]) for v in tp["variants"] if v in agg]
    for v, a in rows:
        w = a["wire_per_step"]
        less = f"{base['wire_per_step']['total'] / max(1.0, w['total']):.1f}x" if base else "n/a"
        L.append(md_row([_label(result, v), fmt_mb(w["pp"]), fmt_mb(w["tp"]), fmt_mb(w["dp"]), fmt_mb(w["total"]),
                         less]))
    if base:
        b = base["wire_per_step"]
        fp32_pp = base["fp32_pp_per_step"]
        L.append(f"| fp32 equivalent | {fmt_mb(fp32_pp)} | {fmt_mb(b['tp'])} | {fmt_mb(b['dp'])} | "
                 f"{fmt_mb(fp32_pp + b['tp'] + b['dp'])} | 1.0x |")
        comp = {d: next((a["wire_per_step"][d] for v, a in rows if d in VARIANTS[v]["compressed"]), None)
                for d in DIMS}
        red = [f"{d.upper()} {b[d] / c:.1f}x" for d, c in comp.items() if c]
        if red:
            L += ["", "Per dimension, compression sends " + ", ".join(red) + " fewer bytes."]
        per = result.get("links", {}).get("per_dim", {})
        if result.get("links", {}).get("shaped") and all(link_rate(per.get(d, "")) for d in DIMS):
            mine = _per_rank_bytes(result, b)
            L += ["", "Lower bounds on the uncompressed transfer time per step (one rank's bytes over its link at "
                  f"{PAYLOAD_FRACTION * 100:.1f}% payload goodput): "
                  + ", ".join(f"{d.upper()} {fmt_mb(mine[d], 2)} per rank at {link_name(per[d])} = "
                              f"{_bound_s(mine[d], per[d]):.3f} s" for d in DIMS)
                  + " (pipeline: the forward activations of one stage-0 rank; the gradients back are as many)."]
    return L + [""]


def _md_nolink(result: dict[str, Any]) -> list[str]:
    conv = result["convergence"]
    runs = {v: r for v, r in conv["runs"].items() if r.get("timing")}
    if not runs:
        return []
    agg = aggregate(result.get("throughput", {}).get("runs", [])) if result.get("links", {}).get("shaped") else {}
    L = ["## The same steps without links", "",
         f"From the validation-loss runs below ({conv['steps']} steps each, no links, the first {conv.get('skip', 0)} "
         "left out): what the step costs on this machine with communication over loopback, i.e. compute, the "
         f"codecs' own cost, and ranks waiting for each other ({_processes(result)}). They ran after the "
         "throughput sweeps, so a change in the machine's load between the two parts shows up here too."
         + (" The last column is what the links add to the step." if agg else ""), "",
         "| variant | tokens/s | step s | TP collectives s | DP all-reduce s | rest s |"
         + (" over the links: step s added |" if agg else ""),
         "|---|---:|---:|---:|---:|---:|" + ("---:|" if agg else "")]
    for v, r in runs.items():
        t = r["timing"]
        extra = f" {agg[v]['step_s'] - t['step_s']:+.3f} |" if v in agg else (" |" if agg else "")
        L.append(f"| {_label(result, v)} | {t['tokens_per_s']:,.0f} | {t['step_s']:.3f} | {t['tp_s']:.3f} | "
                 f"{t['dp_s']:.3f} | {t['rest_s']:.3f} |{extra}")
    return L + [""]


def _md_loss(result: dict[str, Any]) -> list[str]:
    conv = result["convergence"]
    runs = conv["runs"]
    base = runs.get("uncompressed", {}).get("summary")
    L = ["## Validation loss", "",
         f"Uncompressed and fully compressed, {conv['steps']} steps each from the same seed on the same data, "
         f"validation every {conv['eval_every']} steps, on the same 2 x 2 x 2 mesh **without links**: the links "
         "change only when bytes arrive, never which bytes, so the loss does not depend on them.", "",
         "| variant | final train loss | final val loss | val vs uncompressed | wire bytes (all steps) |",
         "|---|---:|---:|---:|---:|"]
    for v, r in runs.items():
        if r.get("error"):
            L.append(f"| {_label(result, v)} | failed: {r['error'].splitlines()[0]} | | | |")
            continue
        sm = r["summary"]
        rel = f"{(sm['val_loss'] / base['val_loss'] - 1) * 100:+.2f}%" if base else "n/a"
        wire = sm["wire_bytes_fwd"] + sm["wire_bytes_bwd"] + sm.get("wire_bytes_tp", 0) + sm.get("wire_bytes_dp", 0)
        L.append(f"| {_label(result, v)} | {sm['final_loss']:.4f} | {sm['val_loss']:.4f} | {rel} | "
                 f"{fmt_mb(wire, 1)} |")
    curves = any(r.get("curve") for r in runs.values())  # (render() plots them; no plot of another run's)
    L += ["", *(["![loss curves](3d_loss.png)", ""] if curves else []),
          "A difference of a percent or so either way is within run-to-run variation for runs this short; a lower "
          "loss is not a claim that compression helps.", ""]
    return L


def _md_notes(result: dict[str, Any]) -> list[str]:
    L = ["## What the numbers mean", ""]
    L += ["- **TP collectives s** (`time_tp_s`) is rank 0's time inside the tensor-parallel collectives of forward "
          "and backward, codec work included. **DP all-reduce s** (`time_dp_s`) is the gradient all-reduce after "
          "backward (on TP stages it is not overlapped with backward). Both include waiting for the slowest peer "
          f"to arrive at the collective, so skew between ranks ({_processes(result)}) shows up there too; "
          "the no-link table gives that floor.",
          "- **rest** = step - TP - DP: forward and backward compute, the pipeline's send/receive of activations "
          "and gradients (on the slow link), the pipeline bubble, the optimizer and the small whole-world "
          "all-reduce of the step's metrics. The pipeline transfers have no timer of their own; the PP-compressed "
          "variant's change in **rest** is their share.",
          "- Bytes: the pipeline carries one copy of each activation per TP rank (T copies per boundary); DP "
          "bytes are QuanGrad's two-shot all-reduce (all-to-all of shards, then all-gather), the fp32 codec "
          "sending exactly the fp32 bytes.",
          "- The pipeline's data crosses the slow link in both directions; a rank's uplink carries its own "
          "sends only, and TP traffic never leaves the fast link."]
    return L + [""]


def _processes(result: dict[str, Any]) -> str:
    """How many processes the mesh runs on how many cores, e.g. ``8 processes on 2 CPU cores``."""
    s = result.get("settings", {})
    n = s.get("stages", 1) * s.get("tp", 1) * s.get("dp", 1)
    cores = result.get("meta", {}).get("cpu_count")
    return f"{n} processes" + (f" on {cores} CPU cores" if cores else "")


def _per_rank_bytes(result: dict[str, Any], wire: dict[str, float]) -> dict[str, float]:
    """One rank's bytes per step per dimension (pipeline: the forward activations of one stage-0 rank)."""
    s = result.get("settings", {})
    world = max(1, s.get("stages", 1) * s.get("tp", 1) * s.get("dp", 1))
    senders = max(1, world // max(1, s.get("stages", 1)))
    return {"pp": wire["pp_fwd"] / senders, "tp": wire["tp"] / world, "dp": wire["dp"] / world}


def _bound_s(nbytes: float, link: str) -> float | None:
    """Seconds ``nbytes`` of payload take one way over ``link`` (tc counts whole frames: 95.6% goodput)."""
    rate = link_rate(link)
    return nbytes * 8 / (rate * PAYLOAD_FRACTION) if rate else None


def _md_dominates(result: dict[str, Any], agg: dict[str, dict[str, Any]]) -> list[str]:
    """What dominates the step, and why, in words worked out from this result's numbers."""
    u, f = agg.get("uncompressed"), agg.get("full")
    links = result.get("links", {})
    if not u or not links.get("shaped"):
        return []
    per = links.get("per_dim", {})
    mine = _per_rank_bytes(result, u["wire_per_step"])
    bound = {d: _bound_s(mine[d], per.get(d, "")) for d in DIMS}
    L = ["## What dominates, and why", ""]
    parts = {"dp": u["dp_s"], "tp": u["tp_s"], "rest": u["rest_s"]}
    top = max(parts, key=parts.__getitem__)
    name = {"dp": "the DP gradient all-reduce", "tp": "the TP collectives",
            "rest": "the rest of the step (compute, pipeline transfers and bubbles)"}
    L.append(f"- **Uncompressed, {name[top]} dominates**: {parts[top]:.2f} of {u['step_s']:.2f} s per step "
             f"({_pct(parts[top], u['step_s'])}).")
    if bound["dp"]:
        L.append(f"- **DP**: each rank sends {fmt_mb(mine['dp'], 2)} of fp32 gradient shards per step to its "
                 f"replica across the slow link ({link_name(per['dp'])}): at least {bound['dp']:.2f} s one way. The "
                 f"all-reduce took {u['dp_s']:.2f} s, {u['dp_s'] / bound['dp']:.1f}x that bound. Both replicas send "
                 "to each other at once (all-to-all, then all-gather); gloo's TCP transport moves a message only "
                 "after the receiver's ready note arrived, and that note queues behind what the receiver is itself "
                 "sending, so two peers exchanging at once largely take turns (docs/netlab.md), up to 2x the "
                 "bound; waiting for the slower peer adds to it.")
    if bound["pp"] and bound["dp"]:
        L.append(f"- **PP**: a stage-0 rank sends {fmt_mb(mine['pp'], 2)} of activations per step (and receives "
                 f"as many gradients), {mine['dp'] / max(1.0, mine['pp']):.0f}x fewer bytes than its DP shards: "
                 "activations grow with the tokens of a step times the hidden size, gradients with the parameter "
                 f"count. At least {bound['pp']:.2f} s one way per direction"
                 + (f"; compressing PP alone changed the step by {agg['pp']['step_s'] - u['step_s']:+.2f} s."
                    if "pp" in agg else "."))
    if bound["tp"] is not None:
        L.append(f"- **TP**: {fmt_mb(mine['tp'], 2)} per rank per step, but on the fast link "
                 f"({link_name(per.get('tp', ''))}): {bound['tp'] * 1e3:.1f} ms. Its {u['tp_s']:.2f} s are the "
                 f"collectives' own work and waiting for the TP peer ({_processes(result)})"
                 + (f"; compressing TP alone changed the step by {agg['tp']['step_s'] - u['step_s']:+.2f} s: "
                    "FP8's encode/decode costs more here than the bytes it saves on a fast link."
                    if "tp" in agg and agg["tp"]["step_s"] > u["step_s"] else
                    f"; compressing TP alone changed the step by {agg['tp']['step_s'] - u['step_s']:+.2f} s."
                    if "tp" in agg else "."))
    if f:
        fp = {"dp": f["dp_s"], "tp": f["tp_s"], "rest": f["rest_s"]}
        ftop = max(fp, key=fp.__getitem__)
        L.append(f"- **Fully compressed**, {name[ftop]} is the largest part ({fp[ftop]:.2f} of {f['step_s']:.2f} s, "
                 f"{_pct(fp[ftop], f['step_s'])}); the step is {u['step_s'] / f['step_s']:.2f}x shorter than "
                 "uncompressed. A dimension's compression pays where its bytes' time on its link exceeds the "
                 "codec's compute.")
    return L + [""]


def _plot_time(result: dict[str, Any], agg: dict[str, dict[str, Any]], path: Path) -> None:
    vs = [v for v in result["throughput"]["variants"] if v in agg]
    fig, ax = pyplot().subplots(figsize=(7, 4))
    left = [0.0] * len(vs)
    for key, name in (("rest_s", "rest (compute, pipeline, bubbles)"), ("tp_s", "TP collectives"),
                      ("dp_s", "DP all-reduce")):
        vals = [agg[v][key] for v in vs]
        ax.barh([_label(result, v) for v in vs], vals, left=left, label=name)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (rank 0)")
    shaped = result.get("links", {}).get("shaped")
    ax.set_title("3D, 2x2x2: time per step" + ("" if shaped else " (NO LINKS)"))
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    finish(fig, path)


def _plot_loss(result: dict[str, Any], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for v, r in result["convergence"]["runs"].items():
        if r.get("curve"):
            plot_train_val(ax, _label(result, v), r["curve"], r.get("val"))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("3D, 2x2x2, without links")
    ax.grid(alpha=0.3)
    ax.legend()
    finish(fig, path)

