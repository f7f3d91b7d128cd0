"""``qwire bench fsdp``: sharded data parallelism (FSDP2) with compressed collectives over slow links.

Two data-parallel replicas (``--dp 2``, one pipeline stage each), every rank behind its own
``tc``-shaped uplink in the network lab (``qwire.netlab``, docs/netlab.md). The variants are
``qwire train`` runs that differ only in how the replicas exchange gradients and weights:

* FSDP2 uncompressed (``--dp-shard --dp-codec fp32``): gradients reduce-scattered and weights
  all-gathered in fp32, through qwire's collectives so their bytes are counted;
* FSDP2 with 8-bit gradients (``--dp-codec blockwise8:block=256``), and with 8-bit weights too
  (``--dp-param-codec blockwise8:block=256``, ZeRO++'s qwZ idea; the master weights stay exact);
* the same two with ``--dp-keep-weights`` (FSDP's ``reshard_after_forward=False``: the weights are
  gathered once per step and held until its end, instead of once per forward and again per backward);
* two DDP reference rows: PyTorch's own ``fp16_compress_hook`` (``--dp-codec torch-fp16``) and
  qwire's QuanGrad 8-bit all-reduce;
* for the loss part, QuanGrad DDP with AGoQ's 8-bit gradient accumulation (``--grad-accum-bits 8``).

Two parts, written to ``<out>/fsdp.json``, ``fsdp.md``, ``fsdp_time.png`` and ``fsdp_loss.png``:

1. **Step time over the links.** Each variant runs ``--steps`` steps (the first ``--skip`` left out)
   at each rate of ``--links``; the variants interleaved within a rate and the sweep repeated
   ``--repeat`` times, so a change in the machine's load hits every variant alike. From
   ``metrics.jsonl``: seconds per step, tokens/s, the DP bytes per step (gradients and weights,
   counted from the payloads), and the training state a rank holds (``state_bytes_max``) and its
   peak resident memory (``max_rss_bytes``).
2. **Validation loss** after ``--conv-steps`` steps for ``--seeds`` seeds (model init and data
   order) per variant, **without links**: a link changes when bytes arrive, never what they are.

Where the network lab cannot run (not root, no ``tc``), or with ``--no-links``, the step-time part
runs without links and the output says so in its first lines.
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
    fmt_bytes,
    fmt_mb,
    lab_mode,
    link_name,
    link_rate,
    loadavg,
    machine_info,
    md_table,
    pyplot,
    render_saved,
)
from qwire.bench.runner import check_counts, records, train_command, train_quietly

BW8 = "blockwise8:block=256"
# variant -> label and the qwire train options that make it
VARIANTS: dict[str, dict[str, Any]] = {
    "fsdp": {"label": "FSDP2 uncompressed", "dp_shard": True, "dp_codec": "fp32", "dp_param_codec": ""},
    "fsdp-g8": {"label": "FSDP2, 8-bit gradients", "dp_shard": True, "dp_codec": BW8, "dp_param_codec": ""},
    "fsdp-g8w8": {"label": "FSDP2, 8-bit gradients + weights", "dp_shard": True, "dp_codec": BW8,
                  "dp_param_codec": BW8},
    "fsdp-keep": {"label": "FSDP2 uncompressed, weights kept", "dp_shard": True, "dp_codec": "fp32",
                  "dp_param_codec": "", "dp_keep_weights": True},
    "fsdp-g8w8-keep": {"label": "FSDP2, 8-bit grads + weights, kept", "dp_shard": True, "dp_codec": BW8,
                       "dp_param_codec": BW8, "dp_keep_weights": True},
    "ddp-fp16": {"label": "DDP, PyTorch fp16 hook", "dp_shard": False, "dp_codec": "torch-fp16",
                 "dp_param_codec": ""},
    "ddp-quangrad": {"label": "DDP, QuanGrad 8-bit", "dp_shard": False, "dp_codec": BW8, "dp_param_codec": ""},
    "ddp-quangrad-acc8": {"label": "DDP, QuanGrad 8-bit + 8-bit accumulation", "dp_shard": False, "dp_codec": BW8,
                          "dp_param_codec": "", "grad_accum_bits": 8},
}
BASE = "fsdp"  # what the compressed variants are compared with
TIME_VARIANTS = ("fsdp", "fsdp-g8", "fsdp-g8w8", "fsdp-keep", "fsdp-g8w8-keep", "ddp-fp16", "ddp-quangrad")
CONV_VARIANTS = ("fsdp", "fsdp-g8", "fsdp-g8w8", "ddp-fp16", "ddp-quangrad", "ddp-quangrad-acc8")
LINKS = "50mbit,200mbit,1gbit"
SETTINGS = {"model": "llama-tiny", "stages": 1, "dp": 2, "seq_len": 128, "batch_size": 8, "microbatches": 2,
            "fwd_codec": "fp32", "bwd_codec": "fp32"}
QUICK = {"seq_len": 32, "batch_size": 4, "microbatches": 2, "vocab_size": 512, "max_tokens": 60_000,
         "eval_batches": 2}
OPTION_KEYS = ("dp_shard", "dp_codec", "dp_param_codec", "dp_keep_weights", "grad_accum_bits")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_argument(p, "where fsdp.json, fsdp.md and the plots go")
    p.add_argument("--runs", default="runs/bench-fsdp",
                   help="where the training runs go (one timestamped folder per invocation)")
    p.add_argument("--quick", action="store_true", help="tiny settings and a few steps (smoke test)")
    p.add_argument("--links", default=LINKS, help="comma-separated link rates of the step-time part")
    p.add_argument("--no-links", action="store_true",
                   help="run the step-time part once without links (loopback; labelled as such in the output)")
    p.add_argument("--steps", type=int, default=0, help="steps per step-time run (default 8; --quick 3)")
    p.add_argument("--skip", type=int, default=-1, help="warm-up steps left out of the timings (default 2; --quick 1)")
    p.add_argument("--repeat", type=int, default=0, help="interleaved sweeps over the variants at each rate "
                                                         "(default 2; --quick 1); steps of all sweeps pooled")
    p.add_argument("--conv-steps", type=int, default=0,
                   help="steps of the validation-loss runs, without links (default 200; --quick 4)")
    p.add_argument("--seeds", type=int, default=0, help="seeds per variant in the loss part (default 2; --quick 1)")
    p.add_argument("--variants", default=",".join(TIME_VARIANTS),
                   help=f"variants of the step-time part, from {', '.join(VARIANTS)}")
    p.add_argument("--conv-variants", default=",".join(CONV_VARIANTS), help="variants of the loss part")
    p.add_argument("--skip-time", action="store_true", help="leave out the step-time part")
    p.add_argument("--skip-convergence", action="store_true", help="leave out the loss part")
    p.add_argument("--render-only", action="store_true",
                   help="re-render fsdp.md and the plots from the fsdp.json in --out (no training)")


# -----------------------------------------------------------------------------------------------
# The run.


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.render_only:
        return render_saved("fsdp", out, "fsdp", render)
    try:
        plan = make_plan(args)
    except ValueError as e:
        print(f"qwire bench fsdp: {e}", file=sys.stderr)
        return 2
    if plan["links"]["reason"]:
        print(f"qwire bench fsdp: {plan['links']['reason']}: the step-time runs go WITHOUT links (loopback), and "
              "the output says so", file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs) / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    t0 = time.perf_counter()
    result: dict[str, Any] = {"meta": {"command": bench_command("fsdp", args, add_arguments), **machine_info(),
                                       "quick": plan["quick"]},
                              "variants": VARIANTS, "settings": plan["settings"], "links": plan["links"]}
    failures = 0
    if not args.skip_time:
        result["time"] = step_times(plan, runs / "time")
        failures += sum(1 for r in result["time"]["runs"] if r.get("error"))
    if not args.skip_convergence:
        result["convergence"] = convergence(plan, runs / "convergence")
        failures += sum(1 for r in result["convergence"]["runs"] if r.get("error"))
    result["meta"]["duration_s"] = time.perf_counter() - t0
    result["meta"]["load_average_end"] = loadavg()
    (out / "fsdp.json").write_text(json.dumps(result, indent=2))
    render(result, out)
    print(f"\nwrote {out / 'fsdp.json'}, {out / 'fsdp.md'} and the plots ({result['meta']['duration_s'] / 60:.1f} "
          "min)", flush=True)
    return 1 if failures else 0


def _names(text: str, what: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        raise ValueError(f"{what}: unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    return names


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Check the arguments and fill in the defaults (--quick aware)."""
    from qwire.netlab import lab_unavailable_reason, parse_link

    variants, conv_variants = _names(args.variants, "--variants"), _names(args.conv_variants, "--conv-variants")
    rates = [x.strip() for x in args.links.split(",") if x.strip()]
    for r in rates:
        if parse_link(r).mode == "sim":  # a bad spec fails here, before anything runs
            raise ValueError(f"--links {r}: the simulated link models only pipeline traffic; this benchmark needs "
                             "the network lab (or --no-links)")
    if not rates and not args.no_links:
        raise ValueError("--links is empty; give link rates such as 50mbit,1gbit or pass --no-links")
    check_counts(args, "steps", "repeat", "seeds", "conv_steps")
    steps = args.steps or (3 if args.quick else 8)
    skip = args.skip if args.skip >= 0 else (1 if args.quick else 2)
    if skip >= steps:
        raise ValueError(f"--skip ({skip}) must be less than --steps ({steps})")
    reason = ""
    if args.no_links:
        reason = "--no-links was given"
    elif not args.skip_time:
        why = lab_unavailable_reason()
        if why:
            reason = f"the network lab cannot run here ({why})"
    links = {"shaped": not reason, "reason": reason,
             "rates": [lab_mode(r) for r in rates] if not reason else [""]}
    conv_steps = args.conv_steps or (4 if args.quick else 200)
    return {"variants": variants, "conv_variants": conv_variants, "steps": steps, "skip": skip,
            "repeat": args.repeat or (1 if args.quick else 2), "conv_steps": conv_steps,
            "seeds": args.seeds or (1 if args.quick else 2), "links": links, "quick": args.quick,
            "settings": {**SETTINGS, **(QUICK if args.quick else {})}}



def config(plan: dict[str, Any], variant: str, **over: Any) -> Any:
    """The ``qwire train`` configuration of ``variant`` with the plan's settings."""
    from qwire.train import TrainConfig

    opts = {k: v for k, v in VARIANTS[variant].items() if k in OPTION_KEYS}
    return TrainConfig(**{**plan["settings"], **opts, "checkpoint_every": 0, **over})


# -----------------------------------------------------------------------------------------------
# Part 1: step time at each link rate.


def step_times(plan: dict[str, Any], runs: Path) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    rates = plan["links"]["rates"]
    total, k = len(rates) * plan["repeat"] * len(plan["variants"]), 0
    for link in rates:
        for rep in range(plan["repeat"]):
            for v in plan["variants"]:
                k += 1
                name = link_name(link)
                cfg = config(plan, v, steps=plan["steps"], eval_every=0, eval_batches=1, log_every=plan["steps"],
                             link_dp=link, out=str(runs / f"{name}-{v}-r{rep}"))
                row: dict[str, Any] = {"variant": v, "link": link, "repeat": rep, "run_dir": cfg.out,
                                       "command": train_command(cfg)}
                summary, err, wall = train_quietly(cfg)
                row["wall_s"] = wall
                if err:
                    row["error"] = err
                    print(f"[fsdp {k}/{total}] {name:>8} {VARIANTS[v]['label']:<34} FAILED: {err.splitlines()[0]}",
                          flush=True)
                    rows.append(row)
                    continue
                row.update(measure(cfg.out, plan["skip"]))
                row["link_mode"] = summary.get("link_mode", "none") if summary else "none"
                if plan["links"]["shaped"] and row["link_mode"] != "lab":
                    row["error"] = f"expected the network lab, the run reported link mode {row['link_mode']!r}"
                print(f"[fsdp {k}/{total}] {name:>8} {VARIANTS[v]['label']:<34} step {row['step_s']:.2f} s  "
                      f"DP {row['dp_bytes'] / 1e6:.1f} MB/step  state {fmt_bytes(row['state_bytes_max'])}/rank  "
                      f"({wall:.0f} s)", flush=True)
                rows.append(row)
    return {"steps": plan["steps"], "skip": plan["skip"], "repeat": plan["repeat"], "variants": plan["variants"],
            "rates": rates, "runs": rows}


def measure(run_dir: str | Path, skip: int) -> dict[str, Any]:
    """Step time and bytes of a finished run from its ``metrics.jsonl``, over the steps after the first ``skip``:
    the mean step time, tokens/s, DP bytes per step summed over ranks (the median over the counted steps; split
    into gradients and weights for FSDP) and the memory of the largest rank."""
    recs = records(run_dir)
    counted = recs[skip:] or recs
    step = [r["step_time_s"] for r in counted]
    tokens_per_step = recs[0]["tokens"] / recs[0]["step"]

    def med(key: str) -> float:
        return float(statistics.median(r.get(key, 0) for r in counted))
    return {"steps_counted": len(step), "step_s": sum(step) / len(step),
            "tokens_per_s": tokens_per_step * len(step) / sum(step), "dp_bytes": med("wire_bytes_dp"),
            "dp_grad_bytes": med("wire_bytes_dp_grad"), "dp_param_bytes": med("wire_bytes_dp_param"),
            "state_bytes_max": max(r.get("state_bytes_max", 0) for r in recs),
            "max_rss_bytes": max(r.get("max_rss_bytes", 0) for r in recs),
            "grad_accum_peak_bytes": max((r.get("grad_accum_peak_bytes", 0) for r in recs), default=0),
            "grad_accum_fp32_bytes": max((r.get("grad_accum_fp32_bytes", 0) for r in recs), default=0),
            "step_times": step}


def aggregate(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (link, variant): the counted steps of all its successful runs pooled (mean seconds per step), the
    runs' range, and the bytes and memory of its first run."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if not r.get("error"):
            by.setdefault((r["link"], r["variant"]), []).append(r)
    out = {}
    for key, rs in by.items():
        steps = [t for r in rs for t in r["step_times"]]
        per_run = [r["step_s"] for r in rs]
        out[key] = {**{k: rs[0][k] for k in ("dp_bytes", "dp_grad_bytes", "dp_param_bytes", "state_bytes_max",
                                             "max_rss_bytes")},
                    "runs": len(rs), "steps_counted": len(steps), "step_s": sum(steps) / len(steps),
                    "step_s_min": min(per_run), "step_s_max": max(per_run),
                    "tokens_per_s": sum(r["tokens_per_s"] * r["steps_counted"] for r in rs) / len(steps)}
    return out


# -----------------------------------------------------------------------------------------------
# Part 2: validation loss, without links.


def convergence(plan: dict[str, Any], runs: Path) -> dict[str, Any]:
    steps, rows = plan["conv_steps"], []
    jobs = [(seed, v) for seed in range(plan["seeds"]) for v in plan["conv_variants"]]
    for k, (seed, v) in enumerate(jobs, 1):
        cfg = config(plan, v, steps=steps, seed=seed, eval_every=max(1, steps // 4), log_every=max(1, steps // 10),
                     warmup=min(20, max(1, steps // 10)), out=str(runs / f"{v}-s{seed}"))
        row: dict[str, Any] = {"variant": v, "seed": seed, "run_dir": cfg.out, "command": train_command(cfg)}
        summary, err, wall = train_quietly(cfg)
        row["wall_s"] = wall
        label = VARIANTS[v]["label"]
        if err:
            row["error"] = err
            print(f"[fsdp loss {k}/{len(jobs)}] {label:<40} seed {seed} FAILED: {err.splitlines()[0]}", flush=True)
        else:
            recs = records(cfg.out)
            row.update(val_loss=summary["val_loss"], final_loss=summary["final_loss"],
                       curve=[[r["step"], r["loss"]] for r in recs],
                       val=[[r["step"], r["val_loss"]] for r in recs if "val_loss" in r],
                       timing=measure(cfg.out, min(plan["skip"], steps - 1)))
            row["timing"].pop("step_times")
            print(f"[fsdp loss {k}/{len(jobs)}] {label:<40} seed {seed} val loss {summary['val_loss']:.4f}  "
                  f"({wall:.0f} s)", flush=True)
        rows.append(row)
    return {"steps": steps, "seeds": plan["seeds"], "variants": plan["conv_variants"], "runs": rows}


def losses(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant: the mean, smallest and largest validation loss over its seeds, and the seeds counted."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if not r.get("error"):
            by.setdefault(r["variant"], []).append(r)
    return {v: {"mean": statistics.fmean(r["val_loss"] for r in rs), "min": min(r["val_loss"] for r in rs),
                "max": max(r["val_loss"] for r in rs), "seeds": sorted(r["seed"] for r in rs),
                "timing": rs[0]["timing"]} for v, rs in by.items()}


# -----------------------------------------------------------------------------------------------
# Rendering: markdown and plots from the JSON alone.


def render(result: dict[str, Any], out: Path) -> None:
    """Write ``fsdp.md`` and the plots from an ``fsdp.json`` result."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(result.get("time", {}).get("runs", []))
    if agg:
        _plot_time(result, agg, out / "fsdp_time.png")
    if any(r.get("curve") for r in result.get("convergence", {}).get("runs", [])):
        _plot_loss(result, out / "fsdp_loss.png")
    (out / "fsdp.md").write_text(markdown(result))


def _label(result: dict[str, Any], v: str) -> str:
    return result.get("variants", {}).get(v, {}).get("label") or VARIANTS.get(v, {}).get("label", v)




def markdown(result: dict[str, Any]) -> str:
    meta, links = result.get("meta", {}), result.get("links", {})
    L = ["# Sharded data parallelism (FSDP2) with compressed collectives", ""]
    if result.get("time") and not links.get("shaped", False):
        L += [f"**NO LINKS: {links.get('reason') or 'the runs were not shaped'}. The step-time runs below went over "
              "loopback without any rate limit: their times are compute and local transfers only.**", ""]
    L += [f"Command: `{meta.get('command', 'qwire bench fsdp')}`  ",
          f"Machine: {meta.get('machine', '?')}, torch {meta.get('torch', '?')}; load average "
          f"{meta.get('load_average_start')} at the start, {meta.get('load_average_end')} at the end; "
          f"{(meta.get('duration_s') or 0) / 60:.0f} min in all."
          + (" **Quick smoke-test settings: the numbers mean nothing.**" if meta.get("quick") else ""), ""]
    L += _md_setup(result)
    agg = aggregate(result.get("time", {}).get("runs", []))
    loss = losses(result.get("convergence", {}).get("runs", []))
    L += _md_targets(result, agg, loss)
    if result.get("time"):
        L += _md_time(result, agg)
        L += _md_bytes(result, agg)
    if result.get("convergence"):
        L += _md_loss(result, loss)
    L += _md_notes()
    return "\n".join(L) + "\n"


def _md_setup(result: dict[str, Any]) -> list[str]:
    s = result.get("settings", {})
    mb = s.get("batch_size", 0) // max(1, s.get("microbatches", 1))
    L = ["## Setup", "",
         f"{s.get('dp')} data-parallel replicas of `{s.get('model')}` ({s.get('stages')} pipeline stage each, one "
         f"process per replica), {s.get('microbatches')} micro-batches of {mb} x {s.get('seq_len')} tokens per "
         f"replica and step. Each rank has its own network namespace and a `tc`-shaped uplink (docs/netlab.md). "
         "FSDP2 shards each decoder block and the root over the replicas; the pipeline schedule reduce-scatters "
         "the gradients once per step and gathers the weights for the micro-batches' forward and again for their "
         "backward, or once per step with `--dp-keep-weights` (the gradients / weights split below shows how many "
         "times a step gathers them; docs/fsdp.md).", ""]
    rows = []
    for d in result.get("variants", VARIANTS).values():
        opts = ["--dp-shard"] if d.get("dp_shard") else []
        opts += [f"--dp-codec {d['dp_codec']}"]
        opts += [f"--dp-param-codec {d['dp_param_codec']}"] if d.get("dp_param_codec") else []
        opts += ["--dp-keep-weights"] if d.get("dp_keep_weights") else []
        opts += [f"--grad-accum-bits {d['grad_accum_bits']}"] if d.get("grad_accum_bits") else []
        rows.append([d["label"], f"`{' '.join(opts)}`"])
    return L + md_table(["variant", "qwire train options"], rows) + [""]


def _md_targets(result: dict[str, Any], agg: dict[tuple[str, str], dict[str, Any]],
                loss: dict[str, dict[str, Any]]) -> list[str]:
    L = ["## Against the targets", ""]
    spread = max((a["max"] / a["min"] - 1 for a in loss.values() if len(a["seeds"]) > 1), default=None)
    noise = (f"; the seeds of one variant differ by up to {spread * 100:.1f}%, so this is within run-to-run "
             "variation" if spread else "")
    rates = result.get("time", {}).get("rates", [])
    base_bytes = next((agg[(r, BASE)]["dp_bytes"] for r in rates if (r, BASE) in agg), None)
    full = next((agg[(r, "fsdp-g8w8")] for r in rates if (r, "fsdp-g8w8") in agg), None)
    if base_bytes and full:
        red = base_bytes / max(1.0, full["dp_bytes"])
        L.append(f"- DP bytes per step, both collectives compressed: {fmt_mb(full['dp_bytes'])} vs "
                 f"{fmt_mb(base_bytes)} uncompressed, **{red:.2f}x fewer** (target >= 3.5x: "
                 f"{'met' if red >= 3.5 else 'missed'}).")
    keep = next((agg[(r, "fsdp-g8w8-keep")] for r in rates if (r, "fsdp-g8w8-keep") in agg), None)
    if base_bytes and keep:
        L.append(f"- With the gathered weights kept for the step (`--dp-keep-weights`): {fmt_mb(keep['dp_bytes'])}, "
                 f"{base_bytes / max(1.0, keep['dp_bytes']):.2f}x fewer than uncompressed FSDP2 with its default "
                 "resharding.")
    if BASE in loss and "fsdp-g8w8" in loss:
        b, c = loss[BASE], loss["fsdp-g8w8"]
        rel = c["mean"] / b["mean"] - 1
        n = min(len(b["seeds"]), len(c["seeds"]))
        L.append(f"- Validation loss, both compressed: {c['mean']:.4f} vs {b['mean']:.4f} uncompressed (mean of "
                 f"{n} seed(s)), **{rel * 100:+.2f}%** (target within 1%: "
                 f"{'met' if abs(rel) <= 0.01 and n >= 2 else 'missed' if abs(rel) > 0.01 else 'not shown: < 2 seeds'}"
                 f"{noise if abs(rel) > 0.01 and spread and abs(rel) < spread else ''}).")
    if result.get("links", {}).get("shaped"):
        slow = [r for r in rates if (link_rate(r) or 0) < 1e9 and (r, BASE) in agg and (r, "fsdp-g8w8") in agg]
        if slow:
            parts = [f"{link_name(r)} {agg[(r, BASE)]['step_s'] / agg[(r, 'fsdp-g8w8')]['step_s']:.2f}x"
                     for r in slow]
            ok = all(agg[(r, "fsdp-g8w8")]["step_s"] < agg[(r, BASE)]["step_s"] for r in slow)
            L.append("- Step-time speed-up of both compressed over uncompressed FSDP2 on the links slower than "
                     f"1 Gbit/s: {', '.join(parts)} (target: faster on every one: {'met' if ok else 'missed'}).")
    else:
        L.append("- Step time over slow links: not measured in this run (no links).")
    acc = next((r["timing"] for r in result.get("convergence", {}).get("runs", [])
                if r.get("variant") == "ddp-quangrad-acc8" and r.get("timing")), None)
    if acc and acc.get("grad_accum_fp32_bytes"):
        saved = 1 - acc["grad_accum_peak_bytes"] / acc["grad_accum_fp32_bytes"]
        line = (f"- 8-bit gradient accumulation: the 8-bit buffers held at most "
                f"{fmt_bytes(acc['grad_accum_peak_bytes'])} against {fmt_bytes(acc['grad_accum_fp32_bytes'])} of "
                f"fp32 gradients, **{saved * 100:.0f}% less** (target >= 70%: {'met' if saved >= 0.7 else 'missed'})")
        if "ddp-quangrad" in loss and "ddp-quangrad-acc8" in loss:
            rel = loss["ddp-quangrad-acc8"]["mean"] / loss["ddp-quangrad"]["mean"] - 1
            line += (f"; validation loss {rel * 100:+.2f}% against the same run accumulating in fp32 (target within "
                     f"1%: {'met' if abs(rel) <= 0.01 else 'missed'}"
                     f"{noise if abs(rel) > 0.01 and spread and abs(rel) < spread else ''})")
        L.append(line + ".")
    return L + [""]


def _md_time(result: dict[str, Any], agg: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    t = result["time"]
    shaped = result.get("links", {}).get("shaped")
    L = ["## Step time", "",
         f"Every variant ran {t['repeat']} time(s) for {t['steps']} steps at each link rate, the variants one after "
         f"the other in each sweep; the first {t['skip']} steps of each run are left out and the rest pooled. "
         "Seconds per step are rank 0's; *vs FSDP2* is uncompressed FSDP2's step time over the variant's at the "
         "same rate." + ("" if shaped else " **No links: loopback.**"), ""]
    rows = []
    for link in t["rates"]:
        base = agg.get((link, BASE))
        for v in t["variants"]:
            a = agg.get((link, v))
            if not a:
                rows.append([link_name(link), _label(result, v), "failed", "", "", ""])
                continue
            rng = f" ({a['step_s_min']:.2f}-{a['step_s_max']:.2f})" if a["runs"] > 1 else ""
            sp = f"{base['step_s'] / a['step_s']:.2f}x" if base else "n/a"
            rows.append([link_name(link), _label(result, v), f"{a['step_s']:.3f}{rng}", sp,
                         f"{a['tokens_per_s']:,.0f}", fmt_mb(a["dp_bytes"])])
    L += md_table(["link", "variant", "s per step (runs' range)", "vs FSDP2", "tokens/s", "DP bytes per step"],
                  rows, "llrrrr")
    L += ["", "![step time per link rate](fsdp_time.png)", ""]
    failed = [r for r in t["runs"] if r.get("error")]
    if failed:
        L += ["Failed runs:", ""] + [f"- {_label(result, r['variant'])} at {link_name(r['link'])} (sweep "
                                     f"{r['repeat']}): {r['error'].splitlines()[0]}" for r in failed] + [""]
    return L


def _md_bytes(result: dict[str, Any], agg: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    t = result["time"]
    first = {v: next((agg[(r, v)] for r in t["rates"] if (r, v) in agg), None) for v in t["variants"]}
    base = first.get(BASE)
    L = ["## Bytes and memory per rank", "",
         "DP bytes per step are summed over the ranks, counted from the payloads qwire's collectives hand to the "
         "transport (PyTorch's fp16 hook: its ring all-reduce's share, `2 (w - 1) / w` of the fp16 buffer). "
         "*Training state* is the largest rank's parameters, gradients and optimizer state, measured from its "
         "tensors after the optimizer step; *peak RSS* is the largest rank's peak resident memory (the whole "
         "process: Python, torch, data).", ""]
    rows = []
    for v, a in first.items():
        if not a:
            continue
        split = (f"{fmt_mb(a['dp_grad_bytes'])} / {fmt_mb(a['dp_param_bytes'])}"
                 if a["dp_grad_bytes"] or a["dp_param_bytes"] else "all-reduce")
        less = f"{base['dp_bytes'] / max(1.0, a['dp_bytes']):.2f}x" if base else "n/a"
        rows.append([_label(result, v), fmt_mb(a["dp_bytes"]), split, less, fmt_bytes(a["state_bytes_max"]),
                     fmt_bytes(a["max_rss_bytes"])])
    L += md_table(["variant", "DP bytes per step", "gradients / weights", "fewer than FSDP2", "training state",
                   "peak RSS"], rows, "lrrrrr")
    return L + [""]


def _md_loss(result: dict[str, Any], loss: dict[str, dict[str, Any]]) -> list[str]:
    conv = result["convergence"]
    base = loss.get(BASE)
    L = ["## Validation loss", "",
         f"{conv['steps']} steps per run, {conv['seeds']} seed(s) per variant (the seed sets the model's "
         "initialization and the data order), **without links**: a link changes when bytes arrive, never which "
         "bytes, so the loss does not depend on it.", ""]
    rows = []
    for v in conv["variants"]:
        a = loss.get(v)
        if not a:
            rows.append([_label(result, v), "failed", "", ""])
            continue
        rel = f"{(a['mean'] / base['mean'] - 1) * 100:+.2f}%" if base else "n/a"
        rows.append([_label(result, v), f"{a['mean']:.4f}", f"{a['min']:.4f}-{a['max']:.4f}", rel])
    L += md_table(["variant", "val loss (mean)", "seeds' range", "vs FSDP2 uncompressed"], rows, "lrrr")
    L += ["", "`--dp-keep-weights` changes when weights are gathered, not their values: its losses are those of the "
          "same run without it (`tests/test_train_sharded.py` checks that step by step), so it has no rows here."]
    spread = [a["max"] - a["min"] for a in loss.values() if len(a["seeds"]) > 1]
    if spread and base:
        L += ["", f"The seeds of one variant differ by up to {max(spread) / base['mean'] * 100:.2f}% of the loss: "
              "differences between variants smaller than that are within run-to-run variation."]
    failed = [r for r in conv["runs"] if r.get("error")]
    if failed:
        L += ["", "Failed runs:", ""] + [f"- {_label(result, r['variant'])} seed {r['seed']}: "
                                         f"{r['error'].splitlines()[0]}" for r in failed]
    return L + ["", "![validation loss](fsdp_loss.png)", ""]


def _md_notes() -> list[str]:
    return ["## What the numbers mean", "",
            "- FSDP2 moves more bytes than DDP: each replica gathers the weights for forward and again for "
            "backward, besides reduce-scattering the gradients; DDP all-reduces gradients once per step. What "
            "FSDP2 buys is memory (the training state above), and compressing both collectives is what brings its "
            "traffic back down.",
            "- *weights kept* (`--dp-keep-weights`): the stage's full weights stay gathered from the first forward "
            "to the end of the step, so the weights cross once per step (the bytes of one copy, like the gradients) "
            "while a rank holds them unsharded during the step; the optimizer state and the gradients stay sharded "
            "(ZeRO-2's trade). The training-state column is measured after the step, when the weights are sharded "
            "again.",
            "- Step time includes the codecs' own work and waiting for the peer; with two processes on a shared "
            "machine, runs vary by tens of percent (the range column), so compare rates within one sweep.",
            "- The loss runs and the step-time runs are separate runs of the same configurations.", ""]


def _plot_time(result: dict[str, Any], agg: dict[tuple[str, str], dict[str, Any]], path: Path) -> None:
    t = result["time"]
    fig, ax = pyplot().subplots(figsize=(7, 4))
    n = len(t["variants"])
    width = 0.8 / max(1, n)
    for i, v in enumerate(t["variants"]):
        xs = [j + (i - (n - 1) / 2) * width for j, r in enumerate(t["rates"]) if (r, v) in agg]
        ys = [agg[(r, v)]["step_s"] for r in t["rates"] if (r, v) in agg]
        ax.bar(xs, ys, width, label=_label(result, v))
    ax.set_xticks(range(len(t["rates"])), [link_name(r) for r in t["rates"]])
    ax.set_xlabel("link rate (each rank's uplink)")
    ax.set_ylabel("seconds per step")
    ax.set_yscale("log")
    ax.set_title("DP=2: step time" + ("" if result.get("links", {}).get("shaped") else " (NO LINKS)"))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    finish(fig, path)


def _plot_loss(result: dict[str, Any], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    colors: dict[str, Any] = {}
    for r in result["convergence"]["runs"]:
        if not r.get("val"):
            continue
        steps, vals = zip(*r["val"])
        first = r["variant"] not in colors
        line, = ax.plot(steps, vals, "o-" if r["seed"] == 0 else "s--", color=colors.get(r["variant"]), ms=3,
                        lw=1, label=_label(result, r["variant"]) if first else None)
        colors.setdefault(r["variant"], line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("DP=2, without links (one line per seed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    finish(fig, path)
