"""Checkpoints of a ``qwire train`` run: each rank writes its stage atomically; a pointer file names the
last complete one.

Layout of ``<run>/checkpoints/``::

    step_0000100/stage0.pt            # stage 0's model, optimizer, scheduler and RNG (tensor-parallel
    step_0000100/stage1-tp0.pt        #   runs: one file per TP rank); DP replica 0 writes them
    step_0000100/codecs-rank3.pt      # stateful codecs' state (AQ-SGD caches), one per rank
    step_0000100/stage0.pt.manifest.json   # beside every file: its size and SHA-256, checked before loading
    latest.json                       # {"step": 100, "dir": "step_0000100"}, moved only when all are on disk

The last two checkpoints are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from qwire.procs import TrainError, resume_command

KEEP = 2  # checkpoints kept on disk
_STEP_DIR = re.compile(r"step_\d{7}")


def stage_file(pp_rank: int, tp_rank: int, tp: int, dp_rank: int | None = None) -> str:
    """The file name of one stage (one tensor-parallel shard of it when ``tp > 1``; one data-parallel
    shard or replica of that when ``dp_rank`` is given: FSDP's replicas hold different shards, DiLoCo's differ
    between their meetings)."""
    name = f"stage{pp_rank}" if tp == 1 else f"stage{pp_rank}-tp{tp_rank}"
    return name + (f"-dp{dp_rank}" if dp_rank is not None else "") + ".pt"


def _to_local(obj: Any) -> Any:
    """A state with every DTensor replaced by this rank's local shard (what this rank must save)."""
    if isinstance(obj, DTensor):
        return obj.to_local().clone()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _like(saved: Any, live: Any) -> Any:
    """``saved`` (a local shard) as a DTensor laid out like ``live`` when ``live`` is one."""
    if isinstance(live, DTensor) and not isinstance(saved, DTensor):
        return DTensor.from_local(saved.to(live.device), live.device_mesh, live.placements, run_check=False,
                                  shape=live.shape, stride=live.stride())
    return saved


def save(run_dir: Path, name: str | None, step: int, module: torch.nn.Module, opt: torch.optim.Optimizer,
         sched: Any, codecs: dict[str, Any] | None, rank: int, local_rank: int,
         totals: dict[str, float] | None = None, extra: dict[str, Any] | None = None) -> None:
    """Write this rank's stage as ``name`` (None: a DP replica, whose state equals replica 0's) and the
    state of its stateful codecs (AQ-SGD's caches differ on every rank) as ``codecs-rank<rank>.pt``;
    ``totals`` are the run's counters so far (bytes, seconds), the same on every rank; ``extra``: more entries
    of the stage file's state (e.g. ``autotune``: the codecs ``auto`` has in force).
    Collective: every rank calls it at the same step."""
    ckdir = _step_dir(run_dir, step)
    target = ckdir
    try:
        ckdir.mkdir(parents=True, exist_ok=True)
        if name is not None:
            state = {"step": step, "model": _to_local(module.state_dict()),
                     "optimizer": _to_local(opt.state_dict()), "scheduler": sched.state_dict(),
                     "rng": torch.get_rng_state(), "totals": dict(totals or {}), **_cuda_rng(module), **(extra or {})}
            target = ckdir / name
            save_verified(state, target)
        if codecs:
            target = ckdir / f"codecs-rank{rank}.pt"
            save_verified(codecs, target)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError of its zip writer
        failed = CheckpointWriteError(run_dir, step, target, e)  # the free space before the removal below
        if _readable_latest(run_dir) != step:  # the pointer never names it: the other ranks' parts go too
            shutil.rmtree(ckdir, ignore_errors=True)
        raise failed from e
    dist.barrier()  # every stage of this step is on disk before the pointer moves
    if local_rank == 0:
        atomic_write(run_dir / "checkpoints" / "latest.json", json.dumps({"step": step, "dir": ckdir.name}))
        for old in step_dirs(run_dir)[KEEP:]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


class RunWriteError(TrainError):
    """A rank could not write a file of its run (a full disk, a read-only or vanished file system): the error
    names the file, why, the free space there and the checkpoint to continue from."""

    def __init__(self, run_dir: Path, path: Path, error: BaseException, what: str = "", done: str = "") -> None:
        try:
            free: int | None = shutil.disk_usage(run_dir).free
        except OSError:
            free = None
        if isinstance(error, OSError) and error.strerror:
            why = error.strerror
        elif free is not None and free < 64 << 20:  # torch.save's zip writer says "unexpected pos ..."
            why = "the file system is full"
        else:
            why = (str(error).splitlines() or [type(error).__name__])[0]
        space = f"; {free / 1e6:,.1f} MB free there" if free is not None else ""
        last = _readable_latest(run_dir)
        then = (f"the last complete checkpoint is step {last}; make room, then continue with: "
                f"{resume_command(run_dir)}" if last is not None else
                "no checkpoint was complete before it; make room and start the run again")
        super().__init__(f"{what}writing {path} failed ({why}{space}); {done}{then}")


class CheckpointWriteError(RunWriteError):
    """A rank could not write its part of a checkpoint; the step's incomplete files are removed."""

    def __init__(self, run_dir: Path, step: int, path: Path, error: BaseException) -> None:
        size = _checkpoint_bytes(run_dir)
        need = (f"a checkpoint of this run takes {size / 1e6:,.1f} MB, and the last {KEEP} stay while the next "
                f"is written; " if size else "")
        super().__init__(run_dir, path, error, what=f"checkpoint of step {step}: ",
                         done=f"the step's incomplete checkpoint is removed; {need}")


def _checkpoint_bytes(run_dir: Path) -> int:
    """The size of the run's last complete checkpoint (0 where there is none, or it cannot be read)."""
    done = _readable_latest(run_dir)
    try:
        return sum(f.stat().st_size for f in _step_dir(run_dir, done).iterdir()) if done is not None else 0
    except OSError:
        return 0


def _readable_latest(run_dir: Path) -> int | None:
    """:func:`latest_step`, None where the pointer cannot be read either (a file system that went away)."""
    try:
        return latest_step(run_dir)
    except (OSError, ValueError, KeyError):
        return None


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:07d}"


def step_dirs(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories, newest first."""
    found = [d for d in (run_dir / "checkpoints").glob("step_*") if _STEP_DIR.fullmatch(d.name)]
    return sorted(found, key=lambda d: int(d.name[5:]), reverse=True)


def latest_step(run_dir: Path) -> int | None:
    """The step of the last complete checkpoint (the pointer file), or None if there is none."""
    pointer = run_dir / "checkpoints" / "latest.json"
    return int(json.loads(pointer.read_text())["step"]) if pointer.exists() else None


@dataclass
class Restored:
    step: int
    state: dict[str, Any]           # model, optimizer, scheduler, rng, totals
    codecs: dict[str, Any] | None   # the stateful codecs' state (None: not asked for)
    skipped: list[str]              # checkpoints that could not be read, and why


def load(run_dir: Path, name: str, rank: int, with_codecs: bool, say: Any = print) -> Restored:
    """Read this rank's part of the newest checkpoint that *every* rank can read (collective).

    A checkpoint is tried only if the pointer file has reached it (older ones are complete by
    construction); if any rank fails to read its files (truncated, missing, corrupt), all ranks fall back
    to the one before, and the unreadable directory is renamed ``broken-step_...`` so it is never
    mistaken for a good one. Raises TrainError if no checkpoint is readable on all ranks."""
    newest = latest_step(run_dir)
    if newest is None:
        raise TrainError(f"--resume: no checkpoint in {run_dir} (expected {run_dir / 'checkpoints' / 'latest.json'});"
                         " start without --resume")
    skipped: list[str] = []
    for ckdir in [d for d in step_dirs(run_dir) if int(d.name[5:]) <= newest]:
        state, codecs, why = None, None, ""
        try:
            state = load_verified(ckdir / name)
            if with_codecs:
                path = ckdir / f"codecs-rank{rank}.pt"
                if not path.exists():
                    raise FileNotFoundError(f"{path} (the per-sample caches of the forward codec) is missing")
                codecs = load_verified(path)
        except Exception as e:  # any unreadable file: this checkpoint is not usable
            why = f"{type(e).__name__}: {e}"
        verdicts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, why)
        bad = {r: w for r, w in enumerate(verdicts) if w}
        if not bad:
            return Restored(int(state["step"]), state, codecs, skipped)
        r, w = next(iter(bad.items()))
        skipped.append(f"{ckdir.name}: rank {r}: {w}")
        say(f"--resume: checkpoint {ckdir} cannot be read on rank{'s' if len(bad) > 1 else ''} "
            f"{', '.join(map(str, bad))} (rank {r}: {w}); trying the one before")
        dist.barrier()
        if int(os.environ.get("LOCAL_RANK", rank)) == 0:
            try:
                ckdir.rename(ckdir.with_name("broken-" + ckdir.name))
            except OSError:  # another machine's rank 0 renamed it first (a shared file system)
                pass
        dist.barrier()
    raise TrainError(f"--resume: no checkpoint in {run_dir} can be read on every rank:\n  " + "\n  ".join(skipped)
                     + "\nstart the run again without --resume (into a new --out)")


def apply(restored: Restored, module: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    """Put a restored state into this rank's stage, optimizer, scheduler and RNG (saved shards become
    DTensors laid out like the live parameters again)."""
    live = module.state_dict()
    module.load_state_dict({k: _like(v, live.get(k)) for k, v in restored.state["model"].items()})
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = restored.state["optimizer"]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    by_id = dict(zip(ids, params))
    saved = {**saved, "state": {i: {k: (_like(v, by_id[i]) if isinstance(v, torch.Tensor) and v.dim() else v)
                                    for k, v in st.items()} for i, st in saved["state"].items()}}
    opt.load_state_dict(saved)
    sched.load_state_dict(restored.state["scheduler"])
    torch.set_rng_state(restored.state["rng"])
    dev = _device_of(module)
    if "cuda_rng" in restored.state and dev.type == "cuda":  # a CPU checkpoint resumed on a GPU keeps its seed
        torch.cuda.set_rng_state(restored.state["cuda_rng"], dev)


def _device_of(module: torch.nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _cuda_rng(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The GPU generator's state of a stage on a GPU (dropout there draws from it), else nothing."""
    dev = _device_of(module)
    return {"cuda_rng": torch.cuda.get_rng_state(dev)} if dev.type == "cuda" else {}


def replaced(path: Path, write: Any) -> None:
    """``write(tmp)`` to a temporary name beside ``path``, then rename it to ``path``: a crash never leaves half a
    file under ``path``, and a write that fails (a full disk) removes what it wrote."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary name, then rename (:func:`replaced`)."""
    replaced(path, lambda tmp: torch.save(obj, tmp))


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(path: Path) -> Path:
    return path.with_name(path.name + ".manifest.json")


def save_verified(obj: Any, path: Path) -> None:
    """:func:`atomic_torch_save`, then the file's size and SHA-256 beside it (``<file>.manifest.json``)."""
    atomic_torch_save(obj, path)
    atomic_write(_manifest(path), json.dumps({"file": path.name, "bytes": path.stat().st_size,
                                              "sha256": _digest(path)}))


def load_verified(path: Path) -> Any:
    """``torch.load`` of a checkpoint file after checking it against its manifest (size, then SHA-256);
    a file without a manifest (written before manifests existed) is only loaded. Raises ValueError naming
    the file when it does not match."""
    man = _manifest(path)
    if man.exists():
        want = json.loads(man.read_text())
        size = path.stat().st_size
        if size != want["bytes"]:
            raise ValueError(f"{path} holds {size} bytes but its manifest says {want['bytes']} (truncated or "
                             "overwritten)")
        if _digest(path) != want["sha256"]:
            raise ValueError(f"{path} does not match the SHA-256 in its manifest (the file changed after it "
                             "was written)")
    return torch.load(path, map_location="cpu", weights_only=False)


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a temporary name, then rename (:func:`replaced`)."""
    replaced(path, lambda tmp: tmp.write_text(text))
