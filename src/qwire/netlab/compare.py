"""``qwire netlab compare``: the same ``qwire train`` run over lab links and simulated links.

For every link it runs ``qwire train ... --link LINK,mode=lab`` and ``...,mode=sim``
(and once without a link, the compute-only ceiling), then reports training
tokens/s (steps after the first ``--skip`` ones, evaluation excluded) and the
ratio simulated / lab. Writes ``compare.json`` and ``compare.md`` in ``--out``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qwire.netlab.simulated import ENV_MODEL
from qwire.netlab.spec import parse_link
from qwire.procs import die_with_parent, forwarding_stop_signals, request_stop, stop_signal

__all__ = ["compare", "throughput", "MODES"]

# lab: the network lab; sim: the simulated link (gloo model); sim-duplex: simulated, full-duplex model
MODES = ("lab", "sim", "sim-duplex")


def throughput(run_dir: str | Path, skip: int) -> dict[str, float]:
    """Training tokens/s of a finished run from its metrics.jsonl, leaving out the first ``skip`` steps."""
    recs = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    recs = recs[skip:] or recs
    tokens_per_step = recs[0]["tokens"] / recs[0]["step"]
    times = [r["step_time_s"] for r in recs]
    return {"tokens_per_s": tokens_per_step * len(times) / sum(times), "step_s_median": statistics.median(times),
            "steps_counted": len(times), "wire_bytes_per_step": recs[-1]["wire_bytes_fwd"] + recs[-1]["wire_bytes_bwd"]}


def compare(links: list[str], train_args: list[str], out: str | Path, steps: int = 20, skip: int = 3,
            modes: tuple[str, ...] = ("lab", "sim"), baseline: bool = True, repeat: int = 1) -> dict[str, Any]:
    """Run ``qwire train <train_args>`` once per (link, mode) and once without a link, ``repeat`` times
    (interleaved, so that a change in the machine's load hits every configuration alike); see the
    module docstring."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    common = [*train_args, "--steps", str(steps), "--eval-every", "0", "--eval-batches", "1",
              "--checkpoint-every", "0"]
    jobs: list[tuple[str, str, list[str]]] = []
    if baseline:
        jobs.append(("none", "-", []))
    for link in links:
        spec = parse_link(link)
        for mode in modes:
            if mode not in MODES:
                raise ValueError(f"compare modes are {', '.join(MODES)}, got {mode!r}")
            jobs.append((str(spec), mode, ["--link", f"{spec},mode={mode.split('-')[0]}"]))
    rows = []
    for rep, (link, mode, extra) in ((r, j) for r in range(repeat) for j in jobs):
        name = "nolink" if link == "none" else f"{link.replace(',', '_').replace('=', '')}-{mode}"
        run_dir = out / f"{name}-{rep}"
        argv = [sys.executable, "-m", "qwire", "train", *common, *extra, "--out", str(run_dir)]
        print(f"[compare] {' '.join(argv[1:])}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        env = dict(os.environ)
        if mode.startswith("sim"):
            env[ENV_MODEL] = "duplex" if mode == "sim-duplex" else "gloo"
        res = _train(argv, env)
        if stop_signal() is not None:  # SIGTERM/SIGHUP: passed on, the run stopped after its step; so does this
            print(f"[compare] stopped by {signal.Signals(stop_signal()).name}: the run in {run_dir} stopped after "
                  "its step; the runs before it are in --out", file=sys.stderr, flush=True)
            raise SystemExit(128 + stop_signal())
        if res.returncode != 0:
            raise RuntimeError(f"qwire train failed for link {link} mode {mode}:\n{res.stderr[-3000:]}")
        row = {"link": link, "mode": mode, "repeat": rep, "run_dir": str(run_dir),
               "command": "qwire " + " ".join(argv[3:]), "wall_s": time.perf_counter() - t0,
               **throughput(run_dir, skip)}
        rows.append(row)
        print(f"[compare] {link} {mode}: {row['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
    result = {"train_args": train_args, "steps": steps, "skip": skip, "repeat": repeat, "rows": rows}
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    (out / "compare.md").write_text(_markdown(result))
    return result


def _train(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One ``qwire train``: a stop signal to this process is passed on to it (it stops after its step, with its
    checkpoint and lab gone), and it dies with this process (no orphaned run holding a lab)."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          preexec_fn=die_with_parent) as p:
        with forwarding_stop_signals(lambda: [p.pid] if p.poll() is None else [], then=request_stop):
            out, err = p.communicate()
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def _markdown(result: dict[str, Any]) -> str:
    groups: dict[tuple[str, str], list[float]] = {}
    wire: dict[str, int] = {}
    for r in result["rows"]:
        groups.setdefault((r["link"], r["mode"]), []).append(r["tokens_per_s"])
        wire[r["link"]] = r["wire_bytes_per_step"]

    def cell(key: tuple[str, str]) -> str:
        v = groups.get(key)
        if not v:
            return ""
        med = statistics.median(v)
        return f"{med:.0f}" + (f" ({min(v):.0f}-{max(v):.0f})" if len(v) > 1 else "")

    modes = [m for m in MODES if any(r["mode"] == m for r in result["rows"])]
    names = {"lab": "lab", "sim": "simulated", "sim-duplex": "simulated, duplex model"}
    head = "| link | " + " | ".join(f"{names[m]} tokens/s" for m in modes)
    head += "".join(f" | {names[m]} / lab" for m in modes if m != "lab" and "lab" in modes)
    lines = [head + " | wire bytes/step |", "|---|" + "---:|" * (len(head.split("|")) - 1)]
    if ("none", "-") in groups:
        blank = " |" * (len(head.split("|")) - 3)
        lines.append(f"| none (compute only) | {cell(('none', '-'))} |{blank[:-2]} | {wire['none']:,} |")
    for link in dict.fromkeys(r["link"] for r in result["rows"] if r["link"] != "none"):
        row = f"| {link} | " + " | ".join(cell((link, m)) for m in modes)
        lab = groups.get((link, "lab"))
        for m in modes:
            if m != "lab" and "lab" in modes:
                other = groups.get((link, m))
                row += f" | {statistics.median(other) / statistics.median(lab):.2f}" if lab and other else " | "
        lines.append(row + f" | {wire[link]:,} |")
    args = " ".join(result["train_args"])
    rep = f"; median of {result['repeat']} interleaved repeats (min-max)" if result.get("repeat", 1) > 1 else ""
    lines += ["", f"Training tokens/s over steps {result['skip'] + 1}-{result['steps']} (evaluation excluded)"
              f"{rep}; train arguments: `{args}`."]
    return "\n".join(lines) + "\n"
