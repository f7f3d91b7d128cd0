"""``qwire bench adaptive``: does ``auto`` choose the codec a user should have chosen, on real links?

Two pipeline stages (``llama-micro``) train behind the network lab's ``tc``-shaped links with the
activations and their gradients sent by each fixed codec (``fp32``, ``fp16``, ``int8``, ``tahquant``)
and by ``auto``:

(a) **rate grid**: every codec at each of several link rates; a run's time is its mean step time
    after the warm-up steps (``auto``'s measuring and choosing between steps included), the median over
    interleaved repeats (sweeps; every other sweep runs the codecs in the reverse order, so that a drift
    of the machine's speed does not favour one). ``auto`` should be within 5% of the best fixed codec at
    every rate (it cannot beat the best by much: it picks one of them). The page also gives auto's ratio
    within each sweep and how much one codec's runs at a rate differ between sweeps, the noise the 5% is
    read against;
(b) **changing link**: one run per codec in which ``--link-schedule`` changes the rate during the run
    (default 1 Gbit/s, then 20 Mbit/s after step 20, then 200 Mbit/s after step 40). The measure is the
    whole run's tokens per second of step time (every step counted, probes, measurements and switches
    included);
    ``auto`` should beat the best single fixed codec by 1.2x;
(c) **loss**: the train loss at the end of each run of (b) (mean of its last 5 steps), so that what
    ``auto`` saves is seen next to what its codecs cost in accuracy.

The rate change needs a real ``tc`` link: where the network lab cannot run, the benchmark stops and says
why. Results: ``adaptive.json``, ``adaptive.md`` and ``adaptive.png`` (step times of (b) over the steps,
the link rate, and the codec ``auto`` had in force).
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
    fmt,
    lab_mode,
    link_name,
    loadavg,
    machine_info,
    md_table,
    pyplot,
    render_saved,
)
from qwire.bench.runner import check_counts, records, train_command, train_quietly
from qwire.parallel.autotune import SHIFT_JUMP

FIXED = "fp32,fp16,int8,tahquant"
AUTO = "auto"  # as a user gets it: periodic re-measuring every 100 steps (docs/auto.md)
RATES = "1gbit,200mbit,50mbit,20mbit"
SCHEDULE_LINK = "1gbit"
SCHEDULE = "20:20mbit;40:200mbit"
SCHEDULE_STEPS = 60
TARGET_GRID = 0.95      # (a): auto's tokens/s over the best fixed codec's, at every rate
TARGET_SCHEDULE = 1.2   # (b): auto's whole-run tokens/s over the best fixed codec's
LAST = 5                # (c): steps averaged for the final train loss


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_argument(p, "where adaptive.json, adaptive.md and adaptive.png go")
    p.add_argument("--runs", default="runs/bench-adaptive", help="run directories (one subdirectory per invocation)")
    p.add_argument("--quick", action="store_true", help="tiny settings and a few steps (smoke test)")
    p.add_argument("--codecs", default=FIXED, help="the fixed codecs (pipeline forward and backward)")
    p.add_argument("--auto-spec", default=AUTO, help="the auto codec to compare with them")
    p.add_argument("--rates", default=RATES, help="link rates of the grid (a)")
    p.add_argument("--steps", type=int, default=0, help="steps per grid run (default 30; --quick 4)")
    p.add_argument("--skip", type=int, default=-1, help="warm-up steps left out of a grid run (default 3; --quick 1)")
    p.add_argument("--repeat", type=int, default=0, help="interleaved sweeps of the grid (default 5; --quick 1)")
    p.add_argument("--schedule-link", default=SCHEDULE_LINK, help="the link at the start of run (b)")
    p.add_argument("--schedule", default="", help=f"the rate changes of run (b) (default {SCHEDULE!r}; "
                   "--quick '2:20mbit;4:200mbit')")
    p.add_argument("--schedule-steps", type=int, default=0,
                   help=f"steps of run (b) (default {SCHEDULE_STEPS}; --quick 6)")
    p.add_argument("--skip-grid", action="store_true", help="leave out the rate grid (a)")
    p.add_argument("--skip-schedule", action="store_true", help="leave out the changing link (b, c)")
    p.add_argument("--render-only", action="store_true", help="re-render adaptive.md and the plot from adaptive.json")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.render_only:
        return render_saved("adaptive", out, "adaptive", render)
    from qwire.netlab.lab import lab_unavailable_reason

    reason = lab_unavailable_reason()
    if reason:
        print(f"qwire bench adaptive: the network lab cannot run here ({reason}); this benchmark changes the "
              "rate of real tc-shaped links, so it needs the lab (docs/netlab.md, Requirements)", file=sys.stderr)
        return 2
    try:
        plan = make_plan(args)
    except ValueError as e:
        print(f"qwire bench adaptive: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs) / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    t0 = time.perf_counter()
    result: dict[str, Any] = {"meta": {"command": bench_command("adaptive", args, add_arguments), **machine_info(),
                                       "quick": plan["quick"]}, "plan": plan}
    failures = 0
    if not args.skip_grid:
        result["grid"] = grid(plan, runs / "grid")
        failures += sum(1 for r in result["grid"] if r.get("error"))
    if not args.skip_schedule:
        result["schedule"] = changing_link(plan, runs / "schedule")
        failures += sum(1 for r in result["schedule"] if r.get("error"))
    result["meta"]["duration_s"] = time.perf_counter() - t0
    result["meta"]["load_average_end"] = loadavg()
    (out / "adaptive.json").write_text(json.dumps(result, indent=2))
    render(result, out)
    print(f"\nwrote {out / 'adaptive.json'}, {out / 'adaptive.md'} and {out / 'adaptive.png'} "
          f"({result['meta']['duration_s'] / 60:.1f} min)", flush=True)
    return 1 if failures else 0


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    from qwire.codecs import get_codec
    from qwire.netlab.spec import parse_link, parse_link_schedule

    quick = bool(args.quick)
    fixed = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if not fixed:
        raise ValueError("--codecs is empty; give fixed codecs such as fp32,fp16,int8,tahquant")
    for c in [*fixed, args.auto_spec]:
        get_codec(c)  # a bad spec fails here, before any run
    if args.auto_spec.split(":")[0].strip() != "auto":
        raise ValueError(f"--auto-spec must be an auto spec (docs/auto.md), got {args.auto_spec!r}")
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for r in [*rates, args.schedule_link]:
        parse_link(r)
    check_counts(args, "steps", "repeat")
    steps = args.steps or (4 if quick else 30)
    sched_steps = args.schedule_steps or (6 if quick else SCHEDULE_STEPS)
    schedule = args.schedule or ("2:20mbit;4:200mbit" if quick else SCHEDULE)
    parse_link_schedule(schedule, sched_steps)
    settings = {"stages": 2, "model": "llama-micro", "batch_size": 8, "microbatches": 4,
                "seq_len": 64 if quick else 128, "seed": 0, "timeout": 300.0}
    return {"quick": quick, "codecs": [*fixed, args.auto_spec], "fixed": fixed, "auto": args.auto_spec,
            "rates": rates, "steps": steps, "skip": args.skip if args.skip >= 0 else (1 if quick else 3),
            "repeat": args.repeat or (1 if quick else 5), "alternate": True, "auto_time": True,
            "schedule_link": args.schedule_link, "schedule": schedule, "schedule_steps": sched_steps,
            "settings": settings}


def config(plan: dict[str, Any], codec: str, **over: Any) -> Any:
    from qwire.train import TrainConfig

    return TrainConfig(**{**plan["settings"], "fwd_codec": codec, "bwd_codec": codec, "eval_every": 0,
                          "eval_batches": 1, "checkpoint_every": 0, **over})


def per_step(run_dir: str | Path) -> list[dict[str, Any]]:
    """Per step of a finished run: the slowest rank's step time, the train loss and the codecs in force."""
    out = []
    for r in records(run_dir):
        fwd, bwd = r.get("codec_fwd"), r.get("codec_bwd")
        # a step's time: the slowest rank's, plus what auto spent measuring and choosing after it (between
        # steps, outside step_time_s; 0 for a fixed codec)
        auto_s = r.get("auto_time_s", 0.0)
        out.append({"step": r["step"], "s": r.get("step_time_max_s", r["step_time_s"]) + auto_s, "auto_s": auto_s,
                    "loss": r["loss"],
                    "fwd": fwd[0] if isinstance(fwd, list) else fwd, "bwd": bwd[0] if isinstance(bwd, list) else bwd,
                    "tokens": r["tokens"] / r["step"], "wire_bytes": r["wire_bytes_fwd"] + r["wire_bytes_bwd"]})
    return out


def _one(plan: dict[str, Any], codec: str, tag: str, **over: Any) -> dict[str, Any]:
    cfg = config(plan, codec, **over)
    row: dict[str, Any] = {"codec": codec, "run_dir": cfg.out, "command": train_command(cfg)}
    summary, err, wall = train_quietly(cfg)
    row["wall_s"] = wall
    if err:
        row["error"] = err
        print(f"[adaptive] {tag} {codec}: FAILED: {err.splitlines()[0]}", flush=True)
        return row
    row["link_mode"] = (summary or {}).get("link_mode", "none")
    if row["link_mode"] != "lab":
        row["error"] = f"expected the network lab, the run reported link mode {row['link_mode']!r}"
    row["steps"] = per_step(cfg.out)
    return row


# -----------------------------------------------------------------------------------------------
# (a) the rate grid.


def grid(plan: dict[str, Any], runs: Path) -> list[dict[str, Any]]:
    rows = []
    total, k = len(plan["rates"]) * plan["repeat"] * len(plan["codecs"]), 0
    for rep in range(plan["repeat"]):
        for rate in plan["rates"]:
            for codec in plan["codecs"] if rep % 2 == 0 or not plan.get("alternate") else plan["codecs"][::-1]:
                k += 1
                name = f"{link_name(rate)}-{codec.split(':')[0]}-r{rep}"
                row = _one(plan, codec, f"{k}/{total}", steps=plan["steps"], log_every=plan["steps"],
                           link=lab_mode(rate), out=str(runs / name))
                row.update(rate=rate, repeat=rep)
                if "steps" in row:
                    counted = row["steps"][plan["skip"]:] or row["steps"]
                    row["step_s"] = statistics.fmean(s["s"] for s in counted)
                    row["tokens_per_s"] = counted[0]["tokens"] / row["step_s"]
                    row["in_force"] = f"{row['steps'][-1]['fwd']}/{row['steps'][-1]['bwd']}"
                    print(f"[adaptive {k}/{total}] {link_name(rate):>8} {codec:<22} mean step "
                          f"{row['step_s']:.3f} s  {row['tokens_per_s']:,.0f} tok/s  (in force at the end: "
                          f"{row['in_force']})", flush=True)
                rows.append(row)
    return rows


SHIFT_NOISE = (0.2, 0.25, 0.3, 0.5)  # fractions of a run's median step that the step-noise count tries


def shift_noise(rows: list[dict[str, Any]], fixed: list[str], skip: int, in_a_row: int = 2) -> dict[str, Any]:
    """How often steady steps would trip ``auto``'s ``shift`` rule on their own: over the fixed codecs' grid
    runs (a fixed link, one codec throughout), the runs in which ``in_a_row`` steps in a row after the first
    ``skip`` lie more than each fraction of :data:`SHIFT_NOISE` away from that run's median step, or one step
    more than :data:`~qwire.parallel.autotune.SHIFT_JUMP` times that fraction.
    ``{"runs": n, "tripped": {fraction: runs}}``."""
    runs = [[s["s"] for s in r["steps"][skip:]] for r in rows
            if r["codec"] in fixed and "steps" in r and not r.get("error")]
    tripped = {}
    for frac in SHIFT_NOISE:
        n = 0
        for times in runs:
            level, out = statistics.median(times), 0
            for t in times:
                off = abs(t / level - 1)
                out = out + 1 if off > frac else 0
                if out >= in_a_row or off > SHIFT_JUMP * frac:
                    n += 1
                    break
        tripped[frac] = n
    return {"runs": len(runs), "tripped": tripped}


def grid_table(rows: list[dict[str, Any]], fixed: list[str], auto: str) -> list[dict[str, Any]]:
    """Per rate: each codec's tokens/s (median over repeats), the best fixed codec and auto's ratio to it,
    what auto had in force at the end of its runs; ``per_sweep``: auto's ratio to the best fixed codec of
    the same sweep, sweep by sweep; ``spread``: the largest difference between two sweeps of one fixed
    codec, as a fraction of its median (the run-to-run noise of this machine at that rate)."""
    out = []
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    for rate in rates:
        tps: dict[str, float] = {}
        sweeps: dict[int, dict[str, float]] = {}
        chose: list[str] = []
        spread = 0.0
        for codec in [*fixed, auto]:
            ok = [r for r in rows if r["rate"] == rate and r["codec"] == codec and "tokens_per_s" in r
                  and not r.get("error")]
            vals = [r["tokens_per_s"] for r in ok]
            for r in ok:
                sweeps.setdefault(r.get("repeat", 0), {})[codec] = r["tokens_per_s"]
            if vals:
                tps[codec] = statistics.median(vals)
                if codec != auto:
                    spread = max(spread, (max(vals) - min(vals)) / tps[codec])
            if codec == auto:
                chose = [r["in_force"] for r in rows if r["rate"] == rate and r["codec"] == codec and "in_force" in r]
        best = max((c for c in fixed if c in tps), key=lambda c: tps[c], default=None)
        ratio = tps[auto] / tps[best] if best is not None and auto in tps else None
        per_sweep = [v[auto] / max(v[c] for c in fixed if c in v) for _, v in sorted(sweeps.items())
                     if auto in v and any(c in v for c in fixed)]
        out.append({"rate": rate, "tokens_per_s": tps, "best_fixed": best, "auto_ratio": ratio,
                    "auto_chose": chose, "met": ratio is not None and ratio >= TARGET_GRID,
                    "per_sweep": per_sweep, "spread": spread})
    return out


# -----------------------------------------------------------------------------------------------
# (b) and (c): the changing link.


def changing_link(plan: dict[str, Any], runs: Path) -> list[dict[str, Any]]:
    rows = []
    n = len(plan["codecs"])
    for k, codec in enumerate(plan["codecs"], start=1):
        row = _one(plan, codec, f"{k}/{n}", steps=plan["schedule_steps"], log_every=10,
                   link=lab_mode(plan["schedule_link"]), link_schedule=plan["schedule"],
                   out=str(runs / codec.split(":")[0]))
        if "steps" in row:
            changes = Path(row["run_dir"]) / "link_changes.jsonl"
            row["link_changes"] = [json.loads(ln) for ln in changes.read_text().splitlines()] if changes.exists() \
                else []
            row.update(schedule_summary(row["steps"]))
            print(f"[adaptive schedule {k}/{n}] {codec:<22} {row['total_s']:.1f} s of steps, "
                  f"{row['tokens_per_s']:,.0f} tok/s, final loss {row['final_loss']:.4f}", flush=True)
        rows.append(row)
    return rows


def schedule_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Whole-run numbers of a changing-link run: every step counted."""
    total = sum(s["s"] for s in steps)
    tail = steps[-LAST:]
    return {"total_s": total, "tokens_per_s": sum(s["tokens"] for s in steps) / total,
            "final_loss": sum(s["loss"] for s in tail) / len(tail),
            "wire_bytes": sum(s["wire_bytes"] for s in steps)}


def schedule_table(rows: list[dict[str, Any]], fixed: list[str], auto: str,
                   phases: list[tuple[int, int, str]] | None = None) -> dict[str, Any]:
    """``auto``'s whole-run tokens/s over the best fixed codec's, and the target's verdict. With ``phases``,
    also the ceiling (:func:`phase_ceiling`) over that codec: ``auto`` only chooses among the fixed codecs and
    pays for its measuring, so a ratio above the ceiling is the run's noise (one codec's run slower or faster
    than another's for the same steps), not ``auto``; such a run shows nothing (``above_ceiling``, not met)."""
    ok = {r["codec"]: r for r in rows if "total_s" in r and not r.get("error")}
    best = max((c for c in fixed if c in ok), key=lambda c: ok[c]["tokens_per_s"], default=None)
    ratio = ok[auto]["tokens_per_s"] / ok[best]["tokens_per_s"] if best is not None and auto in ok else None
    ceil = phase_ceiling(rows, fixed, phases) if phases else None
    ceiling = ceil["tokens_per_s"] / ok[best]["tokens_per_s"] if ceil and ceil["tokens_per_s"] and best else None
    above = ratio is not None and ceiling is not None and ratio > ceiling
    return {"best_fixed": best, "auto_ratio": ratio, "ceiling_ratio": ceiling, "above_ceiling": above,
            "met": ratio is not None and ratio >= TARGET_SCHEDULE and not above}


def phase_ceiling(rows: list[dict[str, Any]], fixed: list[str], phases: list[tuple[int, int, str]]
                  ) -> dict[str, Any] | None:
    """What switching among the fixed codecs could reach at best: each phase of the schedule run with the
    codec that was fastest in that phase (its measured step times, warm-up included), switched for free at
    the rate change. ``codecs`` names each phase's fastest and ``phase_s`` its seconds there; ``tokens_per_s``
    is over the whole run. Only the
    fixed runs that finished count (a failed one is no candidate); None when none did."""
    ok = [r for r in rows if r["codec"] in fixed and "steps" in r and not r.get("error")]
    if not ok or not phases:
        return None
    tokens, codecs, phase_s = 0.0, [], []
    for a, b, _ in phases:
        times = {r["codec"]: sum(s["s"] for s in r["steps"] if a <= s["step"] <= b) for r in ok}
        c = min(times, key=lambda k: times[k])
        codecs.append(c)
        phase_s.append(times[c])
        tokens += sum(s["tokens"] for s in next(r for r in ok if r["codec"] == c)["steps"] if a <= s["step"] <= b)
    total = sum(phase_s)
    return {"codecs": codecs, "phase_s": phase_s, "total_s": total,
            "tokens_per_s": tokens / total if total > 0 else None}


def rate_phases(plan: dict[str, Any]) -> list[tuple[int, int, str]]:
    """(first step, last step, link) of each phase of run (b)."""
    from qwire.netlab.spec import LinkSpec, parse_link_schedule

    points = [(0, plan["schedule_link"])] + [(s, str(LinkSpec(r))) for s, r in
                                              parse_link_schedule(plan["schedule"], plan["schedule_steps"])]
    ends = [s for s, _ in points[1:]] + [plan["schedule_steps"]]
    return [(s + 1, e, link) for (s, link), e in zip(points, ends)]


# -----------------------------------------------------------------------------------------------
# The page.


def render(result: dict[str, Any], out: Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any("steps" in r for r in result.get("schedule", [])):
        _plot(result, out / "adaptive.png")
    (out / "adaptive.md").write_text(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    meta, plan = result.get("meta", {}), result["plan"]
    fixed, auto = plan["fixed"], plan["auto"]
    s = plan["settings"]
    mb = s["batch_size"] // s["microbatches"]
    L = ["# `auto` on changing links", "",
         f"Command: `{meta.get('command', 'qwire bench adaptive')}`  ",
         f"Machine: {meta.get('machine', '?')}, torch {meta.get('torch', '?')}; load average "
         f"{meta.get('load_average_start')} at the start, {meta.get('load_average_end')} at the end; "
         f"{(meta.get('duration_s') or 0) / 60:.0f} min in all."
         + (" **Quick smoke-test settings: the numbers mean nothing.**" if plan.get("quick") else ""), "",
         "## Setup", "",
         f"{s['stages']} pipeline stages of `{s['model']}` (one process each, each in its own network namespace "
         f"with a `tc`-shaped uplink: the network lab, docs/netlab.md), {s['microbatches']} micro-batches of {mb} x "
         f"{s['seq_len']} tokens per step, seed {s['seed']}. The same codec carries the activations forward and "
         f"their gradients back: the fixed codecs {', '.join(f'`{c}`' for c in fixed)}, and `{auto}` "
         "(docs/auto.md: it measures the link and each candidate on the real tensors after step 1, every "
         "`probe_every` steps and when the step time shifts, and puts the fastest within its error budget in "
         "force; candidates predicted within `min_gain` of the fastest are a tie, which goes to the codec in force "
         "or else to the lowest error). A step's time is the slowest rank's (`step_time_max_s`)"
         + (", plus, for `auto`, the seconds it spent measuring and choosing after the step (`auto_time_s`: "
            "probes, each candidate's encode and decode on the real tensors, its first calls included)"
            if plan.get("auto_time") else "") + ".", ""]
    L += _md_targets(result)
    if result.get("grid"):
        L += _md_grid(result)
    if result.get("schedule"):
        L += _md_schedule(result)
    L += ["## Notes", "",
          "- `auto` can only choose among its candidates, so on a fixed link its best is the best fixed codec; "
          "what it adds is choosing without being told the link, and following the link when it changes.",
          ("- The probes and measurements `auto` makes count in its step times (the step after which it measures "
           "is longer); the runs of (b) count every step." if plan.get("auto_time") else
           "- The probes and measurements `auto` makes after a step are not in these step times (they were "
           "recorded outside `step_time_max_s`; a later run of this benchmark counts them)."),
          "- The loss of (c) is one seed's train loss at the end of a short run: it shows the order of magnitude "
          "of what a codec costs, not a converged comparison (docs/results/pipeline.md has that for the fixed "
          "codecs).", ""]
    return "\n".join(L) + "\n"


def _md_targets(result: dict[str, Any]) -> list[str]:
    plan = result["plan"]
    rows = []
    if result.get("grid"):
        table = grid_table(result["grid"], plan["fixed"], plan["auto"])
        worst = min((t for t in table if t["auto_ratio"] is not None), key=lambda t: t["auto_ratio"], default=None)
        ok = bool(table) and all(t["met"] for t in table)
        rows.append([f"(a) `auto` within 5% of the best fixed codec at every rate (>= {TARGET_GRID:.2f}x)",
                     f"worst {fmt(worst['auto_ratio'], '.2f')}x at {link_name(worst['rate'])}" if worst else "-",
                     "**met**" if ok else "**missed**"])
    if result.get("schedule"):
        st = schedule_table(result["schedule"], plan["fixed"], plan["auto"], rate_phases(plan))
        reach = ""
        if st["ceiling_ratio"] is not None:
            reach = (f" (the ceiling of switching among the fixed codecs, each phase's fastest: "
                     f"{st['ceiling_ratio']:.2f}x"
                     + ("; above it, so this run's noise decides the ratio, not `auto`" if st["above_ceiling"]
                        else "") + ")")
        rows.append([f"(b) `auto` >= {TARGET_SCHEDULE}x the best fixed codec over the changing-link run",
                     f"{fmt(st['auto_ratio'], '.2f')}x over `{st['best_fixed']}`{reach}",
                     "**not shown**" if st["above_ceiling"] else "**met**" if st["met"] else "**missed**"])
        over = _over_budget(result["schedule"], plan["auto"])
        rows.append(["monitored error of `auto`'s codecs within its budget throughout",
                     over or "no decision measured an error above the budget",
                     "**missed**" if over else "**met**"])
    return ["## Targets", "", *md_table(["target", "measured", ""], rows), ""]


def _over_budget(rows: list[dict[str, Any]], auto: str) -> str:
    """A description of the first decision at which the codec in force had an error above the budget, or ""."""
    for r in rows:
        if r["codec"] != auto or "steps" not in r:
            continue
        path = Path(r["run_dir"]) / "autotune.jsonl"
        if not path.exists():
            return ""
        for ln in path.read_text().splitlines():
            d = json.loads(ln)
            for key, b in d.get("boundaries", {}).items():
                now = next((c for c in b["candidates"] if c["codec"] == b["was"]), None)
                if now is not None and now["nmse"] is not None and now["nmse"] > b["max_nmse"]:
                    return f"step {d['step']}, boundary {key}: {b['was_label']} at NMSE {now['nmse']:.2e}"
    return ""


def _md_grid(result: dict[str, Any]) -> list[str]:
    plan = result["plan"]
    fixed, auto = plan["fixed"], plan["auto"]
    table = grid_table(result["grid"], fixed, auto)
    head = ["link", *(f"`{c}`" for c in fixed), f"`{auto}`", "best fixed", "auto / best", "auto chose",
            "auto / best, per sweep", "spread between sweeps"]
    rows = []
    for t in table:
        tps = t["tokens_per_s"]
        rows.append([link_name(t["rate"]), *(fmt(tps.get(c), ",.0f") for c in [*fixed, auto]),
                     f"`{t['best_fixed']}`" if t["best_fixed"] else "-", f"{fmt(t['auto_ratio'], '.2f')}x",
                     ", ".join(sorted(set(t["auto_chose"]))) or "-",
                     ", ".join(f"{v:.2f}" for v in t.get("per_sweep", [])) or "-",
                     f"{t['spread']:.0%}" if t.get("spread") else "-"])
    errors = [r for r in result["grid"] if r.get("error")]
    noise = shift_noise(result["grid"], fixed, plan["skip"])
    return ["## (a) Fixed links: tokens/s", "",
            f"Each codec ran {plan['steps']} steps at each rate, {plan['repeat']} interleaved sweep(s)"
            f"{' (every other one in the reverse order of codecs)' if plan.get('alternate') else ''}; a run's time "
            f"is its {'mean' if plan.get('auto_time') else 'median'} step after the first {plan['skip']}, "
            "then the median over the sweeps. *auto chose*: the forward/backward codecs in force at the end of "
            "`auto`'s runs. *per sweep*: `auto`'s tokens/s over the best fixed codec's in the same sweep. *spread*: "
            "the largest difference between two sweeps of one fixed codec at that rate, over its median: how much "
            "the same run varies on this machine, the noise the 5% of target (a) is read against.", "",
            *md_table(head, rows), "",
            *([f"Steady steps and `auto`'s `shift` rule (two steps in a row more than `shift` away from the level, "
               f"or one step more than {SHIFT_JUMP:g} times `shift`, re-measure): of the {noise['runs']} fixed-codec "
               f"runs above, steps {plan['skip'] + 1} on, the runs with two steps in a row (or one step "
               f"{SHIFT_JUMP:g} times as far) more than " + ", ".join(
                   f"{frac:.0%}" for frac in noise["tripped"]) + " away from their run's median step: "
               + ", ".join(str(n) for n in noise["tripped"].values()) + ".", ""] if noise["runs"] else []),
            *([f"{len(errors)} run(s) failed: " + "; ".join(f"{r['codec']} at {r['rate']}: "
                                                             f"{r['error'].splitlines()[0]}" for r in errors), ""]
              if errors else [])]


def _md_schedule(result: dict[str, Any]) -> list[str]:
    plan = result["plan"]
    fixed, auto = plan["fixed"], plan["auto"]
    phases = rate_phases(plan)
    ok = {r["codec"]: r for r in result["schedule"] if "total_s" in r and not r.get("error")}
    ref = ok.get("fp32")
    head = ["codec", "steps' time s", *(f"steps {a}-{b} at {link_name(link)} s" for a, b, link in phases),
            "tokens/s", "vs best fixed", "wire MB", "final train loss", "vs fp32"]
    st = schedule_table(result["schedule"], fixed, auto)
    best = ok.get(st["best_fixed"]) if st["best_fixed"] else None
    rows = []
    for codec in [*fixed, auto]:
        r = ok.get(codec)
        if r is None:
            rows.append([f"`{codec}`", "failed", *["-"] * (len(phases) + 5)])
            continue
        per_phase = [sum(s["s"] for s in r["steps"] if a <= s["step"] <= b) for a, b, _ in phases]
        rows.append([f"`{codec}`", f"{r['total_s']:.1f}", *(f"{x:.1f}" for x in per_phase),
                     f"{r['tokens_per_s']:,.0f}",
                     f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}x" if best else "-",
                     f"{r['wire_bytes'] / 1e6:,.1f}", f"{r['final_loss']:.4f}",
                     f"{(r['final_loss'] / ref['final_loss'] - 1) * 100:+.2f}%" if ref else "-"])
    ceil = phase_ceiling(result["schedule"], fixed, phases)
    if ceil and ceil["tokens_per_s"]:
        times = [f"{t:.1f} (`{c}`)" for t, c in zip(ceil["phase_s"], ceil["codecs"])]
        rows.append(["*each phase's fastest fixed codec*", f"{ceil['total_s']:.1f}", *times,
                     f"{ceil['tokens_per_s']:,.0f}",
                     f"{ceil['tokens_per_s'] / best['tokens_per_s']:.2f}x" if best else "-", "-", "-", "-"])
    L = ["## (b) A link that changes during the run", "",
         f"`--link {plan['schedule_link']} --link-schedule \"{plan['schedule']}\"`, {plan['schedule_steps']} steps, "
         "one run per codec; every step counted (warm-up and switches included"
         + (", and `auto`'s measuring between steps" if plan.get("auto_time") else "") + "). (c): the "
         f"train loss is the mean of the last {LAST} steps (one seed). The last row is not a run: it adds up, "
         "phase by phase, the time of the fixed codec that was fastest in that phase, as if a controller had "
         "known the schedule and switched for free at each rate change: about the most that a controller choosing "
         "among these codecs can reach on this run (up to step-to-step noise). Where one fixed codec is close to "
         "the fastest in every phase (its codec cost small next to a step's compute, and the link slow enough "
         "that it pays), that row is close to it, and no controller can gain much.", "",
         *md_table(head, rows), ""]
    a = ok.get(auto)
    if a is not None:
        spans: list[list[Any]] = []
        for s in a["steps"]:
            label = s["fwd"] if s["fwd"] == s["bwd"] else f"{s['fwd']}/{s['bwd']}"
            if spans and spans[-1][2] == label:
                spans[-1][1] = s["step"]
            else:
                spans.append([s["step"], s["step"], label])
        L += ["What `auto` had in force (forward/backward), by steps: " + ", ".join(
            (f"{b0}-{b1}" if b1 > b0 else f"{b0}") + f": `{lab}`" for b0, b1, lab in spans) + ".", ""]
        spent = [(s["step"], s.get("auto_s", 0.0)) for s in a["steps"]]
        if plan.get("auto_time") and spent:
            first = spent[0][1]
            L += [f"Of its {a['total_s']:.1f} s, {sum(t for _, t in spent):.2f} s were `auto` measuring and choosing "
                  f"between steps ({first:.2f} s after step {spent[0][0]}, where each candidate is called for the "
                  "first time).", ""]
        changes = a.get("link_changes", [])
        if changes:
            L += ["Rate changes (`link_changes.jsonl` of that run): " + ", ".join(
                f"after step {c['after_step']} (seen at step {c['seen_at_step']}) -> {c['link']}" for c in changes)
                + ".", ""]
        decisions = Path(a["run_dir"]) / "autotune.jsonl"
        if decisions.exists():
            trig = [json.loads(ln) for ln in decisions.read_text().splitlines()]
            L += ["Its decisions: " + ", ".join(f"after step {d['step']} ({d.get('trigger', '?')})" for d in trig)
                  + ".", ""]
    L += ["![step time per step of each codec, the link rate and auto's codec](adaptive.png)", ""]
    return L


def _plot(result: dict[str, Any], path: Path) -> None:
    plan = result["plan"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    auto = plan["auto"]
    for r in result["schedule"]:
        if "steps" not in r:
            continue
        xs = [s["step"] for s in r["steps"]]
        ys = [s["s"] for s in r["steps"]]
        if r["codec"] == auto:
            ax.plot(xs, ys, "-", color="black", lw=1.5, label=f"{auto}", zorder=3)
            names = list(dict.fromkeys(s["fwd"] for s in r["steps"]))
            marks = "os^Dv<>"
            for i, name in enumerate(names):
                pts = [(s["step"], s["s"]) for s in r["steps"] if s["fwd"] == name]
                ax.scatter(*zip(*pts), marker=marks[i % len(marks)], s=18, zorder=4, label=f"auto: {name} in force")
        else:
            ax.plot(xs, ys, "-", lw=1, alpha=0.8, label=r["codec"])
    ax.set_xlabel("step")
    ax.set_ylabel("step time, s (slowest rank)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    from qwire.netlab.spec import parse_link

    px, py = [], []
    for a, b, link in rate_phases(plan):
        px += [a - 0.5, b + 0.5]
        py += [parse_link(link).rate_bits_per_s / 1e6] * 2
    ax2.plot(px, py, color="grey", lw=2, alpha=0.4, ls="--", label="link rate")
    ax2.set_yscale("log")
    ax2.set_ylabel("link rate, Mbit/s (dashed)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    ax.set_title("changing link: " + plan["schedule_link"] + " then " + plan["schedule"])
    finish(fig, path)
