"""Checkpoints of a ``qwire train`` run: each rank writes its stage atomically; a pointer file names the
last complete one.

Layout of ``<run>/checkpoints/``::

    step_0000100/stage0.pt            # stage 0's model, optimizer, scheduler and RNG (tensor-parallel
    step_0000100/stage1-tp0.pt        #   runs: one file per TP rank); DP replica 0 writes them
    step_0000100/codecs-rank3.pt      # stateful codecs' state (AQ-SGD caches), one per rank
    latest.json                       # {"step": 100, "dir": "step_0000100"}, moved only when all are on disk

The last two checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qwire.procs import TrainError

KEEP = 2  # checkpoints kept on disk


def stage_file(pp_rank: int, tp_rank: int, tp: int) -> str:
    """The file name of one stage (one tensor-parallel shard of it when ``tp > 1``)."""
    return f"stage{pp_rank}.pt" if tp == 1 else f"stage{pp_rank}-tp{tp_rank}.pt"


def save(run_dir: Path, name: str | None, step: int, module: torch.nn.Module, opt: torch.optim.Optimizer,
         sched: Any, codecs: dict[str, Any] | None, rank: int, local_rank: int) -> None:
    """Write this rank's stage as ``name`` (None: a DP replica, whose state equals replica 0's) and the
    state of its stateful codecs (AQ-SGD's caches differ on every rank) as ``codecs-rank<rank>.pt``.
    Collective: every rank calls it at the same step."""
    ckdir = run_dir / "checkpoints" / f"step_{step:07d}"
    ckdir.mkdir(parents=True, exist_ok=True)
    if name is not None:
        state = {"step": step, "model": module.state_dict(), "optimizer": opt.state_dict(),
                 "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}
        atomic_torch_save(state, ckdir / name)
    if codecs:
        atomic_torch_save(codecs, ckdir / f"codecs-rank{rank}.pt")
    dist.barrier()  # every stage of this step is on disk before the pointer moves
    if local_rank == 0:
        atomic_write(run_dir / "checkpoints" / "latest.json", json.dumps({"step": step, "dir": ckdir.name}))
        for old in sorted((run_dir / "checkpoints").glob("step_*"))[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def _latest_dir(run_dir: Path) -> Path:
    pointer = run_dir / "checkpoints" / "latest.json"
    if not pointer.exists():
        raise TrainError(f"--resume: no checkpoint in {run_dir} (expected {pointer}); start without --resume")
    return run_dir / "checkpoints" / json.loads(pointer.read_text())["dir"]


def load(run_dir: Path, name: str, module: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> int:
    """Restore this rank's stage from the last complete checkpoint; returns its step."""
    path = _latest_dir(run_dir) / name
    if not path.exists():
        raise TrainError(f"--resume: {path} is missing; was the run made with a different --stages or --tp?")
    state = torch.load(path, map_location="cpu", weights_only=False)
    module.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def load_codecs(run_dir: Path, rank: int) -> dict[str, Any]:
    """The stateful codecs' state this rank saved with the last complete checkpoint."""
    path = _latest_dir(run_dir) / f"codecs-rank{rank}.pt"
    if not path.exists():
        raise TrainError(f"--resume: {path} (the per-sample caches of the forward codec) is missing")
    return torch.load(path, map_location="cpu", weights_only=False)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary name, then rename: a crash never leaves half a file under ``path``."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a temporary name, then rename."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
