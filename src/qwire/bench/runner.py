"""Shared pieces of the benchmarks that run things: one ``qwire train`` job quietly, its metrics, and
a function on several local gloo ranks. What they write about it is in :mod:`qwire.bench.report`."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import pickle
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from qwire.procs import in_launcher_env, launcher_env, rank_context

__all__ = ["log_tail", "output_to", "progress_lines", "records", "spawn_world", "train_command", "train_quietly"]

PROGRESS_EVERY = 60.0  # seconds between the progress lines of a quiet training run


def check_counts(args: Any, *names: str) -> None:
    """Raise ValueError for a count option (``--repeat``, ``--seeds``, ``--steps``...) below 0 (0: its default):
    a sweep of no runs would still write its results page."""
    for name in names:
        value = getattr(args, name, 0)
        if isinstance(value, int) and value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (0: the default), got {value}")


def number_list(text: Any, option: str, kind: type = float) -> list[Any]:
    """``"1,2.5"`` as a list of finite numbers > 0 (``kind``: float or int); ValueError naming ``option`` and the
    part it cannot take."""
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            v = kind(part)
        except ValueError:
            raise ValueError(f"{option} takes comma-separated {'whole ' if kind is int else ''}numbers, got {part!r} "
                             f"in {str(text)!r}") from None
        if not 0 < v < math.inf:
            raise ValueError(f"{option}: each value must be a finite number > 0, got {part!r}")
        out.append(v)
    if not out:
        raise ValueError(f"{option} names no value")
    return out


def records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-step records of a run's ``metrics.jsonl``."""
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def train_quietly(cfg: Any) -> tuple[dict[str, Any] | None, str | None, float]:
    """Run ``cfg`` with its output in ``<run>/train.log``; (summary, None, wall) or (None, error, wall). A stop
    signal (SIGTERM, SIGHUP) that stopped the run is raised (:class:`~qwire.procs.RunStopped`): it stops the
    benchmark, whose later runs would otherwise each stop after their first step and count as failed."""
    from qwire.procs import RunStopped
    from qwire.train import TrainError, launch

    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    t0 = time.perf_counter()
    sys.stdout.flush()
    try:
        with os.fdopen(os.dup(1), "w") as terminal, progress_lines(run_dir, cfg.steps, PROGRESS_EVERY, terminal), \
                output_to(run_dir / "train.log"):
            summary = launch(cfg)
    except RunStopped:
        raise
    except (TrainError, ValueError, RuntimeError, OSError) as e:
        tail = log_tail(run_dir / "train.log", 8)
        return None, f"{type(e).__name__}: {e}" + (f"\n{tail}" if tail else ""), time.perf_counter() - t0
    if not summary:
        return None, f"the run wrote no summary (see {run_dir / 'train.log'})", time.perf_counter() - t0
    return summary, None, time.perf_counter() - t0


def last_step(run_dir: Path) -> int:
    """The step of the last whole record in a run's ``metrics.jsonl`` (0 before the first)."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):  # the last one may still be being written
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


@contextlib.contextmanager
def progress_lines(run_dir: Path, steps: int, every: float, out: TextIO) -> Iterator[None]:
    """While the block runs, a line on ``out`` every ``every`` seconds with the run's last logged step, so that a
    benchmark whose runs are quiet (their output in ``train.log``) still shows that it is moving."""
    stop, t0 = threading.Event(), time.perf_counter()

    def beat() -> None:
        while not stop.wait(every):
            out.write(f"    ... {run_dir.name}: step {last_step(run_dir)}/{steps} after "
                      f"{time.perf_counter() - t0:.0f} s\n")
            out.flush()

    thread = threading.Thread(target=beat, name="qwire-bench-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


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


def spawn_world(fn: Callable[..., Any], world: int, args: tuple = (), kwargs: dict[str, Any] | None = None,
                timeout: float = 600.0, threads: int | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args, **kwargs)`` on ``world`` local gloo ranks; their results by rank.

    ``fn`` must be a module-level function. Each rank joins a process group with ``timeout``; a rank
    that raises or dies fails the whole call with its traceback or exit code, and everything is killed
    when the ranks have not finished within ``timeout`` + 60 s. ``threads``: torch threads per rank
    (default: the cores shared among the ranks).
    """
    import queue
    import tempfile

    ctx = rank_context()  # one process imports torch, the workers fork from it
    q = ctx.Queue()
    n_threads = threads or max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory(prefix="qwire-bench-") as tmp:
        init = "file://" + os.path.join(tmp, "store")
        call = pickle.dumps((_rank_entry, (fn, world, init, timeout, args, kwargs or {}, n_threads)))
        env = launcher_env()
        procs = [ctx.Process(target=in_launcher_env, args=(r, env, call, q), daemon=True) for r in range(world)]
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout + 60
        failed = True
        started = next_note = time.monotonic()
        try:
            for p in procs:
                p.start()
            while len(out) < world:
                if time.monotonic() - next_note >= PROGRESS_EVERY:  # a long phase still shows that it moves
                    next_note = time.monotonic()
                    print(f"    ... {fn.__name__} on {world} ranks: {next_note - started:.0f} s, {len(out)} finished",
                          flush=True)
                try:
                    rank, ok, data = q.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{fn.__name__}: the ranks did not finish within {timeout:.0f} s") from None
                    dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"{fn.__name__}: rank {dead[0]} died with exit code "
                                           f"{procs[dead[0]].exitcode}") from None
                    continue
                if not ok:
                    raise RuntimeError(f"{fn.__name__}: rank {rank} raised:\n{data}")
                import io

                import torch
                out[rank] = torch.load(io.BytesIO(data), weights_only=False)
            failed = False
        finally:
            for p in procs:
                if p.pid is None:  # (not started: Ctrl-C came while the others started)
                    continue
                p.join(timeout=0 if failed else 5)  # after an error or Ctrl-C: the ranks go at once
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return [out[r] for r in range(world)]


def _rank_entry(rank: int, fn: Callable[..., Any], world: int, init: str, timeout: float, args: tuple,
                kwargs: dict[str, Any], threads: int, q: Any) -> None:
    import io
    import traceback

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the benchmark's to handle: it ends the ranks
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            # every rank past the group's set-up before any runs fn: a rank whose fn ends at once would otherwise
            # close its connections while a peer is still making its own, and that peer would report the
            # closed connection instead of what fn raised
            dist.barrier()
            result = fn(rank, world, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(result, buf)
        q.put((rank, True, buf.getvalue()))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
