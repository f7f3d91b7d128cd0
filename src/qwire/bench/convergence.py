"""``qwire bench convergence``: the default training setting with fp32, direct int4 and TAH-Quant.

Every method trains the same model on the same data for the same steps from
the same seed; only the forward codec differs (the backward codec is fp32
for the fp32 run, 6-bit per-channel otherwise). Writes
``<out>/convergence.json``, ``<out>/convergence.md`` and ``<out>/convergence.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from qwire.train import TrainConfig, launch

METHODS = {
    "fp32": ("fp32", "fp32"),
    "int4": ("int4", "perchannel6"),
    "tahquant": ("tahquant", "perchannel6"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--stages", type=int, default=TrainConfig.stages)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/results", help="where the JSON, markdown and plot go")
    p.add_argument("--runs", default="runs/convergence", help="where the training runs go")
    p.add_argument("--quick", action="store_true", help="a few steps on a small corpus (smoke test)")


def run(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        print(f"unknown method(s) {bad}; choose from {list(METHODS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for m in methods:
        fwd, bwd = METHODS[m]
        cfg = TrainConfig(stages=args.stages, steps=args.steps, eval_every=args.eval_every, seed=args.seed,
                          fwd_codec=fwd, bwd_codec=bwd, out=str(Path(args.runs) / f"{m}-{int(time.time())}"),
                          checkpoint_every=0, log_every=max(1, args.steps // 10))
        if args.quick:
            cfg = dataclasses.replace(cfg, batch_size=4, microbatches=2, seq_len=32, max_tokens=60_000,
                                      eval_batches=2, vocab_size=512)
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        print(f"== {m}: fwd {fwd}, bwd {bwd}", flush=True)
        summary = launch(cfg)
        recs = [json.loads(ln) for ln in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        results[m] = {"fwd": fwd, "bwd": bwd, "summary": summary,
                      "curve": [[r["step"], r["loss"]] for r in recs],
                      "val": [[r["step"], r["val_loss"]] for r in recs if "val_loss" in r]}
    command = "qwire bench convergence " + " ".join(shlex.quote(a) for a in sys.argv[3:])
    meta = {"command": command.strip(), "machine": _machine(), "torch": torch.__version__}
    (out / "convergence.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    _plot(results, out / "convergence.png")
    (out / "convergence.md").write_text(_markdown(results, meta))
    print((out / "convergence.md").read_text())
    return 0


def _machine() -> str:
    import os
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}"


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, r in results.items():
        steps, losses = zip(*r["curve"])
        k = max(1, len(losses) // 50)  # light smoothing for readability
        sm = [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1]) for i in range(len(losses))]
        line, = ax.plot(steps, sm, lw=1.2, label=f"{m} (train)")
        if r["val"]:
            vs, vl = zip(*r["val"])
            ax.plot(vs, vl, "o--", color=line.get_color(), label=f"{m} (validation)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    base = results.get("fp32", {}).get("summary", {}).get("val_loss")
    lines = [
        "# Convergence: fp32 vs direct int4 vs TAH-Quant on the default training setting",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}, torch {meta['torch']}.",
        "",
        "| method | fwd codec | bwd codec | final train loss | final val loss | vs fp32 | wire bytes / fp32 bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in results.items():
        s = r["summary"]
        wire = s["wire_bytes_fwd"] + s["wire_bytes_bwd"]
        rel = f"{(s['val_loss'] / base - 1) * 100:+.2f}%" if base else "n/a"
        lines.append(f"| {m} | `{r['fwd']}` | `{r['bwd']}` | {s['final_loss']:.4f} | {s['val_loss']:.4f} | {rel} | "
                     f"{wire / max(1, s['fp32_bytes']):.3f} |")
    lines += ["", "![loss curves](convergence.png)", ""]
    if base and "tahquant" in results:
        rel = results["tahquant"]["summary"]["val_loss"] / base - 1
        verdict = "met" if rel <= 0.02 else "missed"
        lines.append(f"Target: TAH-Quant's final validation loss within 2% of fp32 — **{verdict}** "
                     f"({rel * 100:+.2f}%).")
    return "\n".join(lines) + "\n"
