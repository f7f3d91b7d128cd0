"""Run a function on N local ranks of a torch.distributed group, for tests.

>>> from dist_utils import run_distributed
>>> def worker(rank, world_size, scale):
...     x = torch.full((3,), float(rank) * scale)
...     dist.all_reduce(x)
...     return x
>>> run_distributed(worker, 2, args=(1.0,))      # [tensor([1., 1., 1.]), tensor([1., 1., 1.])]

* Every worker calls ``init_process_group`` with a rendezvous through a fresh
  file (``rendezvous="file"``, the default) or TCP on 127.0.0.1 with a free
  port (``rendezvous="tcp"``), and with ``timeout`` as the process group's
  timeout, so no collective in the worker can block longer than that.
* ``fn(rank, world_size, *args)`` must be a module-level function (it is
  pickled by reference).  Its return value is serialized with ``torch.save``,
  so tensors and plain Python objects both come back; the parent receives a
  list of results indexed by rank.
* A worker that raises makes ``run_distributed`` raise :class:`WorkerError`
  with the worker's rank and traceback; the other workers are terminated.
  Workers that have not finished after ``timeout`` seconds (plus a start-up
  allowance) are killed and :class:`TimeoutError` is raised.  Nothing hangs.
* Processes start with the ``forkserver`` method (torch is imported once by
  the fork server, not by every worker), falling back to ``spawn`` where
  forkserver is unavailable.  Each worker uses ``threads`` intra-op threads.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from qwire.procs import die_with_launcher, rank_context

__all__ = ["WorkerError", "free_port", "rank_pids", "run_distributed"]

# Seconds allowed for starting the workers (importing torch, rendezvous) on top of `timeout`.
STARTUP_ALLOWANCE = 60.0
# Seconds to wait for the other ranks' reports once one rank has failed.
ERROR_GRACE = 2.0


class WorkerError(RuntimeError):
    """A worker raised; the message holds its rank and traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def rank_pids(launcher: int) -> list[int]:
    """Linux: the processes a ``qwire train`` launcher (pid) started for its local ranks, in the order it
    started them: the children of its fork server (or, where ranks are spawned, its children that run
    ``spawn_main``)."""
    servers = [k for k in _children(launcher) if "multiprocessing.forkserver" in _cmdline(k)]
    if servers:
        return sorted(k for s in servers for k in _children(s))
    return sorted(k for k in _children(launcher) if "spawn_main" in _cmdline(k))


def _worker(fn: Callable[..., Any], rank: int, world_size: int, args: Sequence[Any], init_method: str,
            backend: str, timeout: float, threads: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    die_with_launcher()  # a killed test run takes its workers with it
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        # every rank past the group's set-up first: a rank whose fn ends at once would otherwise close its
        # connections while a peer is still making its own (qwire.bench.runner does the same)
        dist.barrier()
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything (before tearing down, so the root cause arrives first)
        results.put((rank, False, traceback.format_exc()))
    finally:
        # No barrier here: a peer that failed must not keep this rank waiting.
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *,
                    timeout: float = 60.0, backend: str = "gloo", rendezvous: str = "file",
                    threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank."""
    import torch

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    tmpdir = None
    if rendezvous == "file":
        tmpdir = tempfile.mkdtemp(prefix="qwire-rdzv-")
        init_method = "file://" + os.path.join(tmpdir, "store")
    elif rendezvous == "tcp":
        init_method = f"tcp://127.0.0.1:{free_port()}"
    else:
        raise ValueError(f"rendezvous must be 'file' or 'tcp', got {rendezvous!r}")

    ctx = rank_context()  # the fork server qwire's launches and benchmarks in this process use too
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, tuple(args), init_method, backend, timeout,
                                          threads, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout + STARTUP_ALLOWANCE
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
                                   f"(+{STARTUP_ALLOWANCE:.0f} s start-up)")
            try:
                rank, ok, data = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in out and p.exitcode is not None and p.exitcode != 0]
                if dead:
                    # Give a dying worker's report a moment to arrive before blaming the exit code.
                    try:
                        rank, ok, data = results.get(timeout=2.0)
                    except queue.Empty:
                        raise WorkerError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                          "without reporting a result") from None
                else:
                    continue
            if not ok:
                # Peers of a failed rank usually fail too ("connection closed"); collect their
                # reports for a moment so the message shows every failing rank, first report first.
                errors = [(rank, data)]
                grace = time.monotonic() + ERROR_GRACE
                while time.monotonic() < grace and len(errors) + len(out) < world_size:
                    try:
                        r2, ok2, d2 = results.get(timeout=max(0.05, grace - time.monotonic()))
                    except queue.Empty:
                        break
                    if not ok2:
                        errors.append((r2, d2))
                    else:
                        out[r2] = None
                text = "\n".join(f"--- rank {r} raised:\n{d}" for r, d in errors)
                raise WorkerError(f"{len(errors)} of {world_size} ranks failed; first report first\n{text}")
            out[rank] = torch.load(io.BytesIO(data), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(out) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
        if tmpdir is not None:
            for name in os.listdir(tmpdir):
                try:
                    os.remove(os.path.join(tmpdir, name))
                except OSError:
                    pass
            try:
                os.rmdir(tmpdir)
            except OSError:
                pass
    return [out[r] for r in range(world_size)]


def tiny_model_env(base: Any, layers: int = 4) -> dict[str, str]:
    """A tiny Llama config in ``base``: ``{"base": ..., "model": <model directory>}`` for training tests
    (their tokenizer and tokens go to the session's ``QWIRE_CACHE``, tests/conftest.py)."""
    from pathlib import Path

    from qwire.models import make_config

    base = Path(base)
    cfg = make_config("llama-tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2)
    cfg.save_pretrained(base / "tiny-llama")
    return {"base": str(base), "model": str(base / "tiny-llama")}
