"""``qwire bench convergence``: the same training with and without compression, side by side.

Suites (``--suite``):

* ``pipeline`` — the default training setting (4 stages) with fp32, direct
  int4 and TAH-Quant on the stage boundaries;
* ``tp`` — 2 tensor-parallel ranks (1 stage) with fp32 and FP8 (TACO) collectives;
* ``dp`` — 2 data-parallel replicas (1 stage) with an fp32 and an 8-bit
  (QuanGrad) gradient all-reduce.

Every method of a suite trains the same model on the same data for the same
steps from the same seed; only the codecs differ. Writes
``<out>/<name>.json``, ``<out>/<name>.md`` and ``<out>/<name>.png`` where
``<name>`` is ``convergence`` for the pipeline suite and ``train_<suite>`` otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from qwire.bench import add_out_argument
from qwire.bench.report import bench_command, finish, fmt_mb, machine_info, plot_train_val, pyplot, render_saved
from qwire.train import TrainConfig, launch

# suite -> method -> TrainConfig overrides
SUITES: dict[str, dict[str, dict[str, Any]]] = {
    "pipeline": {
        "fp32": {"fwd_codec": "fp32", "bwd_codec": "fp32"},
        "int4": {"fwd_codec": "int4", "bwd_codec": "perchannel6"},
        "tahquant": {"fwd_codec": "tahquant", "bwd_codec": "perchannel6"},
    },
    "tp": {
        "tp2-fp32": {"stages": 1, "tp": 2, "tp_codec": "fp32", "microbatches": 1},
        "tp2-fp8": {"stages": 1, "tp": 2, "tp_codec": "fp8", "microbatches": 1},
    },
    "dp": {
        "dp2-fp32": {"stages": 1, "dp": 2, "dp_codec": "fp32", "microbatches": 1},
        "dp2-quangrad8": {"stages": 1, "dp": 2, "dp_codec": "blockwise8:block=256", "microbatches": 1},
    },
}
QUICK_STEPS = 20  # --quick's training steps per method
TARGETS = {"pipeline": ("fp32", "tahquant", 0.02), "tp": ("tp2-fp32", "tp2-fp8", 0.0025),
           "dp": ("dp2-fp32", "dp2-quangrad8", 0.01)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", default="pipeline", choices=sorted(SUITES))
    p.add_argument("--methods", default="", help="comma-separated subset of the suite's methods (default: all)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps per method (default {TrainConfig.steps}; with --quick {QUICK_STEPS})")
    p.add_argument("--eval-every", type=int, default=50, help="steps between validations (at most --steps)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"sequences per step (default {TrainConfig.batch_size}; with --quick 4)")
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p, "where the JSON, markdown and plot go")
    p.add_argument("--runs", default="runs/convergence", help="where the training runs go")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke test: {QUICK_STEPS} steps (unless --steps), a small corpus, model and batch")
    p.add_argument("--render-only", action="store_true",
                   help="re-render the suite's markdown and plot from its JSON in --out (no training)")


def run(args: argparse.Namespace) -> int:
    suite = SUITES[args.suite]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] or list(suite)
    bad = [m for m in methods if m not in suite]
    if bad:
        print(f"unknown method(s) {bad} for suite {args.suite}; choose from {list(suite)}", file=sys.stderr)
        return 2
    name = "convergence" if args.suite == "pipeline" else f"train_{args.suite}"
    out = Path(args.out)
    if args.render_only:
        return render_saved("convergence", out, name, lambda data, o: render(args.suite, name, data, o))
    steps = args.steps if args.steps is not None else QUICK_STEPS if args.quick else TrainConfig.steps
    cfgs = {}
    for m in methods:  # every configuration checked before the first run
        cfg = TrainConfig(steps=steps, eval_every=min(args.eval_every, max(1, steps)), seed=args.seed,
                          batch_size=args.batch_size or TrainConfig.batch_size,
                          out=str(Path(args.runs) / f"{m}-{int(time.time())}"), checkpoint_every=0,
                          log_every=max(1, steps // 10))
        cfg = dataclasses.replace(cfg, **suite[m])
        if args.quick:
            cfg = dataclasses.replace(cfg, stages=min(2, cfg.stages), batch_size=args.batch_size or 4,
                                      microbatches=min(2, cfg.microbatches), seq_len=32, max_tokens=60_000,
                                      eval_batches=2, vocab_size=512)
        try:
            cfg.validate()
        except ValueError as e:
            print(f"qwire bench convergence: {m}: {e}", file=sys.stderr)
            return 2
        cfgs[m] = cfg
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for m, cfg in cfgs.items():
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        print(f"== {m}: {suite[m]}", flush=True)
        summary = launch(cfg)
        recs = [json.loads(ln) for ln in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        results[m] = {"config": {k: getattr(cfg, k) for k in ("stages", "tp", "dp", "fwd_codec", "bwd_codec",
                                                               "tp_codec", "dp_codec")},
                      "summary": summary, "median_tokens_per_s": _median([r["tokens_per_s"] for r in recs]),
                      "curve": [[r["step"], r["loss"]] for r in recs],
                      "val": [[r["step"], r["val_loss"]] for r in recs if "val_loss" in r]}
    meta = {"command": bench_command("convergence", args, add_arguments), **machine_info()}
    data = {"meta": meta, "results": results}
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
    render(args.suite, name, data, out)
    print((out / f"{name}.md").read_text())
    return 0


def render(suite: str, name: str, data: dict[str, Any], out: Path) -> None:
    """Write ``<name>.md`` and ``<name>.png`` from a suite's JSON (``meta`` and ``results``)."""
    _plot(data["results"], out / f"{name}.png")
    (out / f"{name}.md").write_text(_markdown(suite, name, data["results"], data["meta"]))


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _plot(results: dict[str, Any], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for m, r in results.items():
        plot_train_val(ax, m, r["curve"], r["val"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    finish(fig, path)


TITLES = {"pipeline": "Convergence: fp32 vs direct int4 vs TAH-Quant on the pipeline stage boundaries",
          "tp": "Tensor-parallel training (TP=2): fp32 vs FP8 (TACO) collectives",
          "dp": "Data-parallel training (DP=2): fp32 vs 8-bit (QuanGrad) gradient all-reduce"}


def _markdown(suite: str, name: str, results: dict[str, Any], meta: dict[str, Any]) -> str:
    ref_name, test_name, tol = TARGETS[suite]
    base = results.get(ref_name, {}).get("summary", {})
    lines = [
        f"# {TITLES[suite]}",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}, torch {meta['torch']}. Throughput is the median step's tokens/s; "
        "the runs of one table ran one after the other in the same invocation.",
        "",
        "| method | codecs | final train loss | final val loss | val vs " + ref_name
        + " | median tokens/s | speed vs " + ref_name + " | bytes on the wire (pp fwd+bwd / tp / dp) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, r in results.items():
        s, c = r["summary"], r["config"]
        codecs = ", ".join(f"{k}=`{c[k]}`" for k in ("fwd_codec", "bwd_codec") if c["stages"] > 1) or ""
        codecs += (f" tp=`{c['tp_codec']}`" if c["tp"] > 1 else "") + (f" dp=`{c['dp_codec']}`" if c["dp"] > 1 else "")
        rel = f"{(s['val_loss'] / base['val_loss'] - 1) * 100:+.2f}%" if base else "n/a"
        speed = (f"{r['median_tokens_per_s'] / results[ref_name]['median_tokens_per_s']:.2f}x"
                 if ref_name in results else "n/a")
        wire = (f"{fmt_mb(s['wire_bytes_fwd'] + s['wire_bytes_bwd'], 1)} / {fmt_mb(s.get('wire_bytes_tp', 0), 1)} / "
                f"{fmt_mb(s.get('wire_bytes_dp', 0), 1)}")
        lines.append(f"| {m} | {codecs.strip()} | {s['final_loss']:.4f} | {s['val_loss']:.4f} | {rel} | "
                     f"{r['median_tokens_per_s']:,.0f} | {speed} | {wire} |")
    lines += ["", f"![loss curves]({name}.png)", ""]
    if base and test_name in results:
        rel = results[test_name]["summary"]["val_loss"] / base["val_loss"] - 1
        verdict = "met" if rel <= tol else "missed"
        lines.append(f"Target: {test_name}'s final validation loss at most {tol * 100:g}% above {ref_name}'s — "
                     f"**{verdict}** ({rel * 100:+.2f}%). Differences of a few percent either way are within "
                     "run-to-run variation for runs this short; a lower loss is not a claim that compression helps.")
    return "\n".join(lines) + "\n"
