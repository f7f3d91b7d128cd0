"""Shared pieces of the benchmarks that launch ``qwire train`` jobs: running one job quietly,
reading its metrics, and describing the machine and the command for the JSON they write."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["bench_command", "loadavg", "log_tail", "machine_info", "output_to", "records", "train_command",
           "train_quietly"]


def records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-step records of a run's ``metrics.jsonl``."""
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def train_quietly(cfg: Any) -> tuple[dict[str, Any] | None, str | None, float]:
    """Run ``cfg`` with its output in ``<run>/train.log``; (summary, None, wall) or (None, error, wall)."""
    from qwire.train import TrainError, launch

    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    t0 = time.perf_counter()
    try:
        with output_to(run_dir / "train.log"):
            summary = launch(cfg)
    except (TrainError, ValueError, RuntimeError, OSError) as e:
        tail = log_tail(run_dir / "train.log", 8)
        return None, f"{type(e).__name__}: {e}" + (f"\n{tail}" if tail else ""), time.perf_counter() - t0
    if not summary:
        return None, f"the run wrote no summary (see {run_dir / 'train.log'})", time.perf_counter() - t0
    return summary, None, time.perf_counter() - t0


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """Send this process's stdout/stderr, and so its child processes', to ``path`` (file descriptors 1 and 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(path, "ab") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])


def log_tail(path: Path, n: int) -> str:
    """The last ``n`` non-empty lines of a log, indented for quoting in an error."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return "\n".join("  | " + ln for ln in lines[-n:])


def train_command(cfg: Any) -> str:
    """The ``qwire train`` command line of ``cfg`` (options that differ from the defaults)."""
    from qwire.train import TrainConfig

    default = TrainConfig()
    parts = ["qwire", "train"]
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v != getattr(default, f.name):
            parts += [f"--{f.name.replace('_', '-')}", shlex.quote(str(v))]
    return " ".join(parts)


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """Machine, versions, start time and load, for a benchmark's JSON."""
    import torch

    return {"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, "
                       f"{platform.system()} {platform.release().split('-')[0]}",
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"), "load_average_start": loadavg()}


def bench_command(name: str, args: argparse.Namespace,
                  add_arguments: Callable[[argparse.ArgumentParser], None]) -> str:
    """``qwire bench <name>`` with the options of ``args`` that differ from their defaults."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    defaults = vars(p.parse_args([]))
    parts = ["qwire", "bench", name]
    for k, v in vars(args).items():
        if k.startswith("_") or k not in defaults or v == defaults[k] or k == "render_only":
            continue
        flag = "--" + k.replace("_", "-")
        parts += [flag] if v is True else [flag, shlex.quote(str(v))]
    return " ".join(parts)
