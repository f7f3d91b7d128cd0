"""``qwire bench diloco``: DiLoCo (``--dp-sync-every H``) against data parallelism that averages every step,
over a slow data-parallel link.

Two replicas (``--dp 2``, one pipeline stage each), every rank in its own network namespace behind a
``tc``-shaped uplink (``--link-dp``, docs/netlab.md). The variants differ only in how often the replicas
meet: ``H = 1`` is DDP with QuanGrad's 8-bit gradient all-reduce at every step; each other ``H`` of
``--every`` is DiLoCo with an all-reduce of the pseudo-gradients every ``H`` steps (and after the last),
then the outer Nesterov step (docs/diloco.md), at each ``--overlap K`` (``--dp-sync-overlap``: the meeting's
all-reduce overlaps the next ``K`` steps; 0 waits for it), in each number of fragments of ``--fragments``
(``--dp-sync-fragments``: Streaming DiLoCo's fragments meeting in turn), with each codec of ``--dp-codecs``
(the same 8-bit one by default), with and without error feedback (``--error-feedback``:
``--dp-error-feedback``). Every run trains ``--steps`` steps on the same batches (per seed, ``--seeds``), the
variants interleaved within a seed so that a change in the machine's load hits them alike.

From each run's ``metrics.jsonl``: the training time (the sum of the steps' times, evaluations left out),
tokens/s, the data-parallel bytes of the whole run (summed over ranks, counted from the payloads), the
validation loss every ``--eval-every`` steps and at the end. Written to ``<out>/diloco.json``,
``diloco.md`` and ``diloco.png`` (validation loss against training time).

Where the network lab cannot run (not root, no ``tc``), or with ``--no-links``, the runs go over loopback
and the output says so in its first lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
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
    loadavg,
    machine_info,
    md_table,
    pyplot,
    render_saved,
)
from qwire.bench.runner import check_counts, records, train_command, train_quietly

BW8 = "blockwise8:block=256"
SETTINGS = {"model": "llama-micro", "stages": 1, "dp": 2, "seq_len": 128, "batch_size": 8, "microbatches": 2,
            "fwd_codec": "fp32", "bwd_codec": "fp32", "dp_codec": BW8}
QUICK = {"seq_len": 32, "batch_size": 4, "vocab_size": 512, "max_tokens": 60_000, "eval_batches": 2}
EVERY = "1,8,32"
LINK = "50mbit"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_argument(p, "where diloco.json, diloco.md and diloco.png go")
    p.add_argument("--runs", default="runs/bench-diloco",
                   help="where the training runs go (one timestamped folder per invocation)")
    p.add_argument("--quick", action="store_true", help="tiny settings and a few steps (smoke test)")
    p.add_argument("--every", default=EVERY, help="comma-separated H of --dp-sync-every (1, every step, the DDP "
                                                  "reference, is always run)")
    p.add_argument("--outer", default="", help="comma-separated LR:MOMENTUM of the outer SGD, each run at every H > 1 "
                                               "(default: qwire train's --outer-lr and --outer-momentum)")
    p.add_argument("--overlap", default="0", help="comma-separated K of --dp-sync-overlap, each run at every H > 1 "
                                                 "(0: the replicas wait for each meeting; K < every H)")
    p.add_argument("--fragments", default="1", help="comma-separated F of --dp-sync-fragments, each run at every "
                                                   "H > 1 (F must divide every H, and every K be < H / F)")
    p.add_argument("--dp-codecs", default=BW8, help="semicolon-separated --dp-codec specs of the pseudo-gradients, "
                                                     "each run at every H > 1 (DDP keeps " + BW8 + "), e.g. "
                                                     "'" + BW8 + ";blockwise4:block=256'")
    p.add_argument("--error-feedback", default="0", help="comma-separated 0 (off) and 1 (--dp-error-feedback), each "
                                                         "run at every H > 1")
    p.add_argument("--link", default=LINK, help="rate of every rank's uplink (the data-parallel link)")
    p.add_argument("--no-links", action="store_true", help="run over loopback (labelled as such in the output)")
    p.add_argument("--steps", type=int, default=0, help="steps per run (default 300; --quick 8)")
    p.add_argument("--eval-every", type=int, default=0, help="steps between validations (default 50; --quick 4)")
    p.add_argument("--seeds", type=int, default=0, help="seeds (model init and data order) per variant "
                                                        "(default 2; --quick 1)")
    p.add_argument("--render-only", action="store_true",
                   help="re-render diloco.md and diloco.png from the diloco.json in --out (no training)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.render_only:
        return render_saved("diloco", out, "diloco", render)
    try:
        plan = make_plan(args)
    except ValueError as e:
        print(f"qwire bench diloco: {e}", file=sys.stderr)
        return 2
    if plan["link"]["reason"]:
        print(f"qwire bench diloco: {plan['link']['reason']}: the runs go WITHOUT links (loopback), and the output "
              "says so", file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs) / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    t0 = time.perf_counter()
    result: dict[str, Any] = {"meta": {"command": bench_command("diloco", args, add_arguments), **machine_info(),
                                       "quick": plan["quick"]},
                              "settings": plan["settings"], "link": plan["link"], "every": plan["every"],
                              "overlap": plan["overlap"], "fragments": plan["fragments"],
                              "dp_codecs": plan["dp_codecs"],
                              "error_feedback": plan["error_feedback"], "steps": plan["steps"], "seeds": plan["seeds"],
                              "runs": train_all(plan, runs)}
    result["meta"]["duration_s"] = time.perf_counter() - t0
    result["meta"]["load_average_end"] = loadavg()
    (out / "diloco.json").write_text(json.dumps(result, indent=2))
    render(result, out)
    print(f"\nwrote {out / 'diloco.json'}, {out / 'diloco.md'} and {out / 'diloco.png'} "
          f"({result['meta']['duration_s'] / 60:.1f} min)", flush=True)
    return 1 if any(r.get("error") for r in result["runs"]) else 0


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Check the arguments and fill in the defaults (--quick aware)."""
    from qwire.netlab import lab_unavailable_reason, parse_link

    try:
        every = sorted({1, *(int(h) for h in args.every.split(",") if h.strip())})
    except ValueError:
        raise ValueError(f"--every {args.every!r}: give whole numbers of steps, e.g. 1,8,32") from None
    if every[0] < 1:
        raise ValueError(f"--every {args.every!r}: every H must be >= 1")
    try:
        outer = [tuple(float(x) for x in o.split(":")) for o in args.outer.split(",") if o.strip()]
    except ValueError:
        outer = [()]
    if any(len(o) != 2 for o in outer):
        raise ValueError(f"--outer {args.outer!r}: give LR:MOMENTUM pairs, e.g. 1.0:0.0,0.7:0.9")
    for lr, momentum in outer:  # as qwire train checks --outer-lr and --outer-momentum, before any run
        if not (0 < lr < math.inf and 0 <= momentum < 1):
            raise ValueError(f"--outer {args.outer!r}: each LR must be > 0 and each MOMENTUM >= 0 and < 1, got "
                             f"{lr:g}:{momentum:g}")
    try:
        overlap = sorted({int(k) for k in args.overlap.split(",") if k.strip()}) or [0]
    except ValueError:
        raise ValueError(f"--overlap {args.overlap!r}: give whole numbers of steps, e.g. 0,4") from None
    from qwire.codecs import get_codec, parse_spec

    codecs = [c.strip() for c in args.dp_codecs.split(";") if c.strip()]
    if not codecs:
        raise ValueError(f"--dp-codecs is empty; give codecs such as '{BW8};blockwise4:block=256'")
    for c in codecs:
        if parse_spec(c)[0] == "auto" or get_codec(c).stateful:  # a bad spec fails here, before any run
            raise ValueError(f"--dp-codecs {c!r}: DiLoCo needs a stateless codec that is not auto")
    feedback = sorted({k.strip() for k in args.error_feedback.split(",") if k.strip()})
    if not feedback or not set(feedback) <= {"0", "1"}:
        raise ValueError(f"--error-feedback {args.error_feedback!r}: give 0, 1 or 0,1 (off, on)")
    try:
        fragments = sorted({int(k) for k in args.fragments.split(",") if k.strip()}) or [1]
    except ValueError:
        raise ValueError(f"--fragments {args.fragments!r}: give whole numbers, e.g. 1,4") from None
    diloco_h = [h for h in every if h > 1]
    if fragments[0] < 1 or any(h % f for h in diloco_h for f in fragments):
        raise ValueError(f"--fragments {args.fragments!r}: every F must be >= 1 and divide every H > 1 of --every "
                         f"({','.join(map(str, diloco_h))})")
    if overlap[0] < 0 or (diloco_h and overlap[-1] >= min(diloco_h) // fragments[-1]):
        raise ValueError(f"--overlap {args.overlap!r}: every K must be >= 0 and smaller than every H > 1 of --every "
                         f"({','.join(map(str, diloco_h))})" + (f" divided by every F of --fragments "
                                                               f"({','.join(map(str, fragments))})"
                                                               if fragments != [1] else ""))
    if parse_link(args.link).mode == "sim":  # a bad spec fails here, before anything runs
        raise ValueError(f"--link {args.link}: the simulated link models only pipeline traffic; this benchmark "
                         "needs the network lab (or --no-links)")
    reason = "--no-links was given" if args.no_links else ""
    if not reason and (why := lab_unavailable_reason()):
        reason = f"the network lab cannot run here ({why})"
    check_counts(args, "steps", "seeds")
    steps = args.steps or (8 if args.quick else 300)
    for name in ("steps", "eval_every", "seeds"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: the default)")
    # F fragments of H meet every H / F steps: where that is the whole run, they meet once, after the last step,
    # and runs of such H with the same F are the same run
    late = {f: [h for h in diloco_h if h // f >= steps] for f in fragments}
    late = {f: hs for f, hs in late.items() if hs}
    if late:
        split = {f: f" in {f} fragment{'s' if f > 1 else ''}" if fragments != [1] else "" for f in late}
        what = "; ".join(f"H = {', '.join(map(str, hs))} of --every{split[f]}" for f, hs in late.items())
        one = len(late) == 1 and len(next(iter(late.values()))) == 1
        print(f"qwire bench diloco: with {steps} steps, {what} meet{'s' if one else ''} only after the last step"
              + (", so their runs are the same" if any(len(hs) > 1 for hs in late.values()) else "")
              + f"; give --steps above {max(h // f for f, hs in late.items() for h in hs)} to see them differ",
              file=sys.stderr, flush=True)
    from qwire.train import TrainConfig

    outer = outer or [(TrainConfig.outer_lr, TrainConfig.outer_momentum)]
    return {"every": every, "outer": outer, "overlap": overlap, "fragments": fragments, "dp_codecs": codecs,
            "error_feedback": [k == "1" for k in feedback], "steps": steps,
            "eval_every": args.eval_every or (4 if args.quick else 50),
            "seeds": args.seeds or (1 if args.quick else 2), "quick": args.quick,
            "link": {"shaped": not reason, "reason": reason, "spec": "" if reason else lab_mode(args.link)},
            "settings": {**SETTINGS, **(QUICK if args.quick else {})}}


def variant(h: int, outer: tuple[float, float] | list[float] = (), overlap: int = 0, codec: str = BW8,
            feedback: bool = False, fragments: int = 1) -> str:
    """A run's folder name."""
    slug = "".join(ch if ch.isalnum() else "-" for ch in codec)
    return "ddp" if h == 1 else (f"diloco-{h}" + (f"-lr{outer[0]:g}-m{outer[1]:g}" if outer else "")
                                 + (f"-f{fragments}" if fragments != 1 else "")
                                 + (f"-overlap{overlap}" if overlap else "") + (f"-{slug}" if codec != BW8 else "")
                                 + ("-ef" if feedback else ""))


def label(h: int, outer: tuple[float, float] | list[float] = (), overlap: int = 0, codec: str = BW8,
          feedback: bool = False, fragments: int = 1) -> str:
    if h == 1:
        return "DDP, 8-bit gradients every step"
    return (f"DiLoCo every {h} steps" + (f", outer lr {outer[0]:g}, momentum {outer[1]:g}" if outer else "")
            + (f", {fragments} fragments in turn" if fragments != 1 else "")
            + (f", landing {overlap} step{'s' if overlap != 1 else ''} later" if overlap else "")
            + (f", `{codec}`" if codec != BW8 else "") + (", error feedback" if feedback else ""))


def key(r: dict[str, Any]) -> tuple[Any, ...]:
    """A run's variant: ``(H, overlap, DP codec, error feedback, fragments, *outer)``."""
    return (r["every"], r.get("overlap", 0), r.get("dp_codec", BW8), r.get("error_feedback", False),
            r.get("fragments", 1), *r.get("outer", ()))


def describe(r: dict[str, Any]) -> dict[str, Any]:
    """A run's variant as the keyword arguments of :func:`label` and :func:`variant`."""
    return {"outer": r.get("outer", ()), "overlap": r.get("overlap", 0), "codec": r.get("dp_codec", BW8),
            "feedback": r.get("error_feedback", False), "fragments": r.get("fragments", 1)}


def train_all(plan: dict[str, Any], runs: Path) -> list[dict[str, Any]]:
    from qwire.train import TrainConfig

    rows: list[dict[str, Any]] = []
    jobs = [(seed, h, {"outer": o, "overlap": ov, "codec": c, "feedback": ef, "fragments": f})
            for seed in range(plan["seeds"]) for h in plan["every"]
            for o in ([()] if h == 1 else plan["outer"]) for f in ([1] if h == 1 else plan.get("fragments", [1]))
            for ov in ([0] if h == 1 else plan.get("overlap", [0]))
            for c in ([BW8] if h == 1 else plan.get("dp_codecs", [BW8]))
            for ef in ([False] if h == 1 else plan.get("error_feedback", [False]))]
    steps = plan["steps"]
    for k, (seed, h, v) in enumerate(jobs, 1):
        o = v["outer"]
        outer = dict(outer_lr=o[0], outer_momentum=o[1]) if o else {}
        settings = {**plan["settings"], "dp_codec": v["codec"]}
        cfg = TrainConfig(**settings, dp_sync_every=h, dp_sync_overlap=v["overlap"], dp_error_feedback=v["feedback"],
                          dp_sync_fragments=v["fragments"],
                          **outer, steps=steps, seed=seed, eval_every=plan["eval_every"],
                          log_every=max(1, steps // 10), warmup=min(30, max(1, steps // 10)), checkpoint_every=0,
                          link_dp=plan["link"]["spec"], out=str(runs / f"{variant(h, **v)}-s{seed}"))
        row: dict[str, Any] = {"every": h, "outer": list(o), "overlap": v["overlap"], "dp_codec": v["codec"],
                               "error_feedback": v["feedback"], "fragments": v["fragments"], "seed": seed,
                               "run_dir": cfg.out,
                               "command": train_command(cfg)}
        summary, err, wall = train_quietly(cfg)
        row["wall_s"] = wall
        if not err and plan["link"]["shaped"] and summary.get("link_mode") != "lab":
            err = f"expected the network lab, the run reported link mode {summary.get('link_mode')!r}"
        if err:
            row["error"] = err
            print(f"[diloco {k}/{len(jobs)}] {label(h, **v):<52} seed {seed} FAILED: {err.splitlines()[0]}",
                  flush=True)
        else:
            row.update(measure(cfg.out), val_loss=summary["val_loss"])
            print(f"[diloco {k}/{len(jobs)}] {label(h, **v):<52} seed {seed} train {row['train_s']:.0f} s  "
                  f"DP {row['dp_bytes'] / 1e6:.1f} MB  val loss {row['val_loss']:.4f}  ({wall:.0f} s)", flush=True)
        rows.append(row)
    return rows


def measure(run_dir: str | Path) -> dict[str, Any]:
    """From a finished run's ``metrics.jsonl``: training seconds (the steps' times summed), tokens/s, the DP bytes
    of the run, how many times the replicas met, the seconds rank 0's steps waited for data-parallel traffic, and
    the validation losses against the training seconds so far."""
    recs = records(run_dir)
    seconds, val = 0.0, []
    for r in recs:
        seconds += r["step_time_s"]
        if "val_loss" in r:
            val.append([r["step"], seconds, r["val_loss"]])
    return {"train_s": seconds, "tokens_per_s": recs[-1]["tokens"] / seconds,
            "dp_bytes": sum(r.get("wire_bytes_dp", 0) for r in recs),
            "meetings": sum(1 for r in recs if r.get("wire_bytes_dp", 0) > 0),
            "dp_wait_s": sum(r.get("time_dp_s", 0.0) for r in recs), "val": val}


def summarize(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Per variant (:func:`key`, in the order the runs first name them): the means over its seeds of the
    training time, tokens/s, DP bytes and the time waited for them; the validation loss's mean, smallest and
    largest; the seeds counted."""
    by: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        if not r.get("error"):
            by.setdefault(key(r), []).append(r)
    out = {}
    for h, rs in by.items():
        out[h] = {k: statistics.fmean(r[k] for r in rs) for k in ("train_s", "tokens_per_s", "dp_bytes", "meetings")}
        waits = [r["dp_wait_s"] for r in rs if "dp_wait_s" in r]
        out[h]["dp_wait_s"] = statistics.fmean(waits) if len(waits) == len(rs) else None
        out[h].update(val_mean=statistics.fmean(r["val_loss"] for r in rs), val_min=min(r["val_loss"] for r in rs),
                      val_max=max(r["val_loss"] for r in rs), seeds=sorted(r["seed"] for r in rs))
    return out


def at_time(val: list[list[float]], seconds: float) -> float | None:
    """A run's validation loss at ``seconds`` of training, linear between its validations (``[step, seconds,
    loss]``); None outside them."""
    for (_, t0, v0), (_, t1, v1) in zip(val, val[1:]):
        if t0 <= seconds <= t1:
            return v0 + (v1 - v0) * (seconds - t0) / (t1 - t0) if t1 > t0 else v1
    return val[0][2] if val and val[0][1] == seconds else None


def ddp_at(rows: list[dict[str, Any]], seconds: float) -> float | None:
    """DDP's validation loss after ``seconds`` of training, the mean over its seeds (None where a seed's
    validations do not reach that time)."""
    got = [at_time(r["val"], seconds) for r in rows if r["every"] == 1 and not r.get("error")]
    return statistics.fmean(got) if got and None not in got else None


def render(result: dict[str, Any], out: Path) -> None:
    """Write ``diloco.md`` and ``diloco.png`` from a ``diloco.json`` result."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(r.get("val") for r in result.get("runs", [])):
        _plot(result, out / "diloco.png")
    (out / "diloco.md").write_text(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    meta, link, s = result.get("meta", {}), result.get("link", {}), result.get("settings", {})
    L = ["# DiLoCo: replicas that meet every H steps, against averaging every step", ""]
    if not link.get("shaped", False):
        L += [f"**NO LINKS: {link.get('reason') or 'the runs were not shaped'}. The runs went over loopback without "
              "any rate limit: their times are compute and local transfers only.**", ""]
    L += [f"Command: `{meta.get('command', 'qwire bench diloco')}`  ",
          f"Machine: {meta.get('machine', '?')}, torch {meta.get('torch', '?')}; load average "
          f"{meta.get('load_average_start')} at the start, {meta.get('load_average_end')} at the end; "
          f"{(meta.get('duration_s') or 0) / 60:.0f} min in all."
          + (" **Quick smoke-test settings: the numbers mean nothing.**" if meta.get("quick") else ""), ""]
    mb = s.get("batch_size", 0) // max(1, s.get("microbatches", 1))
    L += [f"{s.get('dp')} data-parallel replicas of `{s.get('model')}` (one process each), {s.get('microbatches')} "
          f"micro-batches of {mb} x {s.get('seq_len')} tokens per replica and step, {result.get('steps')} steps, "
          f"`--dp-codec {s.get('dp_codec')}` (unless a variant names another); every rank behind its own uplink of "
          f"{link_name(link.get('spec', '')) if link.get('shaped') else 'no link'} (`tc`, docs/netlab.md). "
          "Training time is the sum of the steps' times (evaluations left out); DP bytes are the whole run's, "
          "summed over ranks; the validation loss is the mean over the seeds, with the smallest and largest in "
          "brackets. The runs' commands are in `diloco.json`.", ""]
    runs = result.get("runs", [])
    summ = summarize(runs)
    ref = summ.get((1, 0, BW8, False, 1))
    rows = []
    for (h, ov, codec, feedback, fragments, *o), a in summ.items():
        speed = f"{ref['train_s'] / a['train_s']:.2f}x" if ref else "-"
        delta = f"{(a['val_mean'] / ref['val_mean'] - 1) * 100:+.2f}%" if ref else "-"
        same_time = ddp_at(runs, a["train_s"]) if h != 1 else None
        wait = a.get("dp_wait_s")
        rows.append([label(h, o, ov, codec, feedback, fragments), f"{a['meetings']:.0f}", fmt_mb(a["dp_bytes"]),
                     f"{a['train_s']:.1f} s",
                     f"{wait:.1f} s" if wait is not None and h != 1 else "-", f"{a['tokens_per_s']:,.0f}", speed,
                     f"{a['val_mean']:.4f} [{a['val_min']:.4f}, {a['val_max']:.4f}]", delta,
                     f"{same_time:.4f}" if same_time is not None else "-"])
    L += md_table(["variant", "meetings", "DP bytes", "training time", "waiting on DP", "tokens/s", "faster than DDP",
                   "validation loss", "vs DDP", "DDP after as much training time"], rows, "lrrrrrrrrr")
    L += ["", "*Waiting on DP*: the seconds rank 0's steps spent waiting for DiLoCo's meetings (a meeting's "
          "all-reduce, or the wait for an overlapped one to land), part of the training time; DDP's all-reduces run "
          "inside backward and are not timed apart (`-`). *Meetings*: the steps with data-parallel bytes (a meeting "
          "that lands on the last step counts with the last one; with fragments, each fragment's meeting counts). "
          "*DDP after as much training time*: DDP's "
          "validation loss (mean over its seeds, linear between its "
          "validations) after the training time this variant took for all its steps; `-` where DDP's first "
          "validation came later."]
    failed = [r for r in result.get("runs", []) if r.get("error")]
    if failed:
        L += ["", f"**{len(failed)} run(s) failed:** " + "; ".join(
            f"{variant(r['every'], **describe(r))} seed {r['seed']}: "
            f"{r['error'].splitlines()[0]}"
            for r in failed)]
    L += ["", "![validation loss against training time](diloco.png)"]
    return "\n".join(L) + "\n"


def _plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors: dict[tuple[Any, ...], str] = {}
    for r in result["runs"]:
        if r.get("error") or not r.get("val"):
            continue
        k = key(r)
        _, secs, vals = zip(*r["val"])
        line, = ax.plot(secs, vals, "o-", ms=3, lw=1.2, color=colors.get(k),
                        label=label(r["every"], **describe(r)) if k not in colors else None,
                        alpha=1.0 if r["seed"] == 0 else 0.5)
        colors.setdefault(k, line.get_color())
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{result['settings'].get('model')}, 2 replicas, "
                 f"{link_name(result['link'].get('spec', '')) if result['link'].get('shaped') else 'no link'}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    finish(fig, path)
