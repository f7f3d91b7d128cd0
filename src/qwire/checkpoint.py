"""Checkpoints of a ``qwire train`` run: each rank writes its stage atomically; a pointer file names the
last complete one.

Layout of ``<run>/checkpoints/``::

    step_0000100/stage0.pt            # stage 0's model, optimizer, scheduler and RNG (tensor-parallel
    step_0000100/stage1-tp0.pt        #   runs: one file per TP rank); DP replica 0 writes them
    step_0000100/codecs-rank3.pt      # stateful codecs' state (AQ-SGD caches), one per rank
    step_0000100/stage0.pt.manifest.json   # beside every file: its size and SHA-256, checked before loading
    latest.json                       # {"step": 100, "dir": "step_0000100"}, moved only when all are on disk

The last two checkpoints are kept. On machines that do not share the run directory, each machine's holds what
its ranks wrote; a rank that finds no copy of its stage file there (a data-parallel replica whose replica 0 is on
another machine) gets the stage from a rank that read it (:func:`load`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import platform
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
        pointer = _pointer(run_dir)
        try:
            atomic_write(pointer, json.dumps({"step": step, "dir": ckdir.name}))
        except OSError as e:
            failed = CheckpointWriteError(run_dir, step, pointer, e)
            if _readable_latest(run_dir) != step:  # complete, but nothing points to it (on a shared file system
                shutil.rmtree(ckdir, ignore_errors=True)  # another machine's pointer may have reached it)
            raise failed from e
        _rotate(run_dir, step)
    dist.barrier()


def _rotate(run_dir: Path, step: int) -> None:
    """After the checkpoint of ``step``: keep the last :data:`KEEP` up to it. Directories of later steps are what
    an earlier attempt of this run left (a save cut short, or the steps after the checkpoint a resume went back
    to): they go too, and never count among the kept."""
    for i, old in enumerate(d for d in step_dirs(run_dir) if _step_of(d) <= step):
        if i >= KEEP:
            shutil.rmtree(old, ignore_errors=True)
    for later in (d for d in step_dirs(run_dir) if _step_of(d) > step):
        shutil.rmtree(later, ignore_errors=True)
    _remove_dead_temps(run_dir / "checkpoints")


def _remove_dead_temps(folder: Path) -> None:
    """The temporary files (:func:`replaced`) that processes of this machine which no longer run left in
    ``folder`` (a process killed while it wrote the pointer). A live process's stay: two jobs' agents on one
    machine may share the run directory."""
    node = platform.node()
    for tmp in folder.glob(f"*.tmp-{node}-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:  # alive, another user's
            continue


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


def _step_of(ckdir: Path) -> int:
    return int(ckdir.name[5:])


def _pointer(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "latest.json"


def step_dirs(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories, newest first."""
    found = [d for d in (run_dir / "checkpoints").glob("step_*") if _STEP_DIR.fullmatch(d.name)]
    return sorted(found, key=_step_of, reverse=True)


def latest_step(run_dir: Path) -> int | None:
    """The step of the last complete checkpoint (the pointer file), or None if there is none. Raises ValueError
    naming the file, and what to write there, where it cannot be read."""
    pointer = _pointer(run_dir)
    if not pointer.exists():
        return None
    try:
        return int(json.loads(pointer.read_text())["step"])
    except (ValueError, KeyError, TypeError) as e:
        dirs = step_dirs(run_dir)
        have = (f"its directory holds {', '.join(d.name for d in dirs)}; write the newest complete one's step there, "
                f'e.g. {{"step": {_step_of(dirs[0])}, "dir": "{dirs[0].name}"}}' if dirs
                else "its directory holds no step_* checkpoint; start the run again without --resume")
        why = "it is empty" if isinstance(e, ValueError) and not pointer.read_text().strip() else \
            f"{type(e).__name__}: {e}"
        raise ValueError(f"the checkpoint pointer {pointer} cannot be read ({why}): it names the run's last "
                         f'complete checkpoint as {{"step": N, "dir": "step_NNNNNNN"}}; {have}') from None


@dataclass
class Restored:
    step: int
    state: dict[str, Any]           # model, optimizer, scheduler, rng, totals
    codecs: dict[str, Any] | None   # the stateful codecs' state (None: not asked for)
    skipped: list[str]              # checkpoints that could not be read, and why
    path: Path | None = None        # the stage file the state came from (on this machine or a peer's)


# errors that say a checkpoint's files are damaged or missing (their directory is set aside as broken-...);
# any other (a MemoryError, an unpickling error of a class this version lacks) only moves on to the one before
_DAMAGED = (OSError, ValueError, EOFError, pickle.UnpicklingError, RuntimeError)


def load(run_dir: Path, name: str, rank: int, with_codecs: bool, say: Any = print) -> Restored:
    """Read this rank's part of the newest checkpoint that *every* rank can read (collective).

    A checkpoint is tried only if the pointer file has reached it (older ones are complete by
    construction); if any rank fails to read its files (truncated, missing, corrupt), all ranks fall back
    to the one before, the unreadable directory is renamed ``broken-step_...`` so it is never mistaken for a
    good one, and the pointer names the checkpoint loaded. A rank whose machine holds no copy of its stage file
    ``name`` (run directories not shared between machines: only data-parallel replica 0 writes a replicated
    stage) gets the stage from a rank that read the same file. Raises TrainError if no checkpoint is readable
    on all ranks."""
    newest = latest_step(run_dir)
    mine = [_step_of(d) for d in step_dirs(run_dir) if newest is not None and _step_of(d) <= newest]
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (newest, mine))  # every rank tries the same steps, in the same order
    pointed = [n for n, _ in seen if n is not None]
    if not pointed:
        raise TrainError(f"--resume: no checkpoint in {run_dir} (expected {_pointer(run_dir)}); start without "
                         "--resume")
    steps = sorted({s for _, got in seen for s in got if s <= min(pointed)}, reverse=True)
    if not steps:
        raise TrainError(f"--resume: {_pointer(run_dir)} names step {min(pointed)}, but {run_dir / 'checkpoints'} "
                         "holds no step_* directory up to it on every machine; start the run again without --resume "
                         "(into a new --out)")
    skipped: list[str] = []
    for step in steps:
        ckdir = _step_dir(run_dir, step)
        state, codecs, why, damaged = None, None, "", False
        missing = not (ckdir / name).exists() and not _manifest(ckdir / name).exists()
        try:
            if not missing:
                state = load_verified(ckdir / name)
            if with_codecs:
                path = ckdir / f"codecs-rank{rank}.pt"
                if not path.exists():
                    raise FileNotFoundError(f"{path} (the per-sample caches of the forward codec) is missing")
                codecs = load_verified(path)
        except Exception as e:  # any unreadable file: this checkpoint is not usable
            why, damaged = f"{type(e).__name__}: {e}", isinstance(e, _DAMAGED)
        verdicts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, (name, missing, why, damaged))
        read = {}  # stage file -> the first rank that read it
        for r, (n, lacks, w, _) in enumerate(verdicts):
            if not lacks and not w:
                read.setdefault(n, r)
        bad = {r: (w or f"FileNotFoundError: {ckdir / n} is missing on every rank that needs it", d or not w)
               for r, (n, lacks, w, d) in enumerate(verdicts) if w or (lacks and n not in read)}
        if not bad:
            got = _share_stages(verdicts, read, rank, state)
            state = got if got is not None else state
            lacking = [str(r) for r, v in enumerate(verdicts) if v[1]]
            if lacking:
                say(f"--resume: {ckdir.name}: no copy of the stage file on the machine of rank"
                    f"{'s' if len(lacking) > 1 else ''} {', '.join(lacking)}; got it from a rank that read it")
            if skipped and int(os.environ.get("LOCAL_RANK", rank)) == 0:  # the pointer names what was loaded
                atomic_write(_pointer(run_dir), json.dumps({"step": step, "dir": ckdir.name}))
            return Restored(int(state["step"]), state, codecs, skipped,
                            ckdir / name if not missing else None)
        r, (w, _) = next(iter(bad.items()))
        skipped.append(f"{ckdir.name}: rank {r}: {w}")
        say(f"--resume: checkpoint {ckdir} cannot be read on rank{'s' if len(bad) > 1 else ''} "
            f"{', '.join(map(str, bad))} (rank {r}: {w}); trying the one before")
        dist.barrier()
        if int(os.environ.get("LOCAL_RANK", rank)) == 0 and any(d for _, d in bad.values()):
            _set_aside(ckdir)
        dist.barrier()
    raise TrainError(f"--resume: no checkpoint in {run_dir} can be read on every rank:\n  " + "\n  ".join(skipped)
                     + "\nstart the run again without --resume (into a new --out)")


def _share_stages(verdicts: list[Any], read: dict[str, int], rank: int, state: Any) -> Any:
    """The stage of each rank that lacks its file (``verdicts``: per rank its file, whether it lacks it, ...),
    sent by the rank that read the same file (``read``), in rank order on every rank. Returns what this rank
    received (None where it lacked nothing)."""
    got = None
    for r, (n, lacks, _, _) in enumerate(verdicts):
        if not lacks:
            continue
        if rank == read[n]:
            dist.send_object_list([state], dst=r)
        elif rank == r:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=read[n])
            got = box[0]
    return got


def _set_aside(ckdir: Path) -> None:
    """Rename an unreadable checkpoint ``broken-step_...`` (``.2``, ``.3``... where that name is taken); on a
    shared file system another machine's rank may have renamed it first."""
    target, n = ckdir.with_name("broken-" + ckdir.name), 1
    while target.exists():
        n += 1
        target = ckdir.with_name(f"broken-{ckdir.name}.{n}")
    with contextlib.suppress(OSError):
        ckdir.rename(target)


def apply(restored: Restored, module: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    """Put a restored state into this rank's stage, optimizer, scheduler and RNG (saved shards become
    DTensors laid out like the live parameters again)."""
    live = module.state_dict()
    try:
        module.load_state_dict({k: _like(v, live.get(k)) for k, v in restored.state["model"].items()})
        params = [p for g in opt.param_groups for p in g["params"]]
        saved = restored.state["optimizer"]
        ids = [i for g in saved["param_groups"] for i in g["params"]]
        by_id = dict(zip(ids, params))
        saved = {**saved, "state": {i: {k: (_like(v, by_id[i]) if isinstance(v, torch.Tensor) and v.dim() else v)
                                        for k, v in st.items()} for i, st in saved["state"].items()}}
        opt.load_state_dict(saved)
    except (RuntimeError, ValueError, KeyError) as e:  # load_state_dict's size and key mismatches
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        what = "; ".join(lines[1:3] if len(lines) > 1 else lines[:1]) or type(e).__name__
        where = restored.path or "the checkpoint"
        raise TrainError(f"--resume: {where} (step {restored.step}) does not fit this rank's stage ({what}): the "
                         "run's config.json does not describe the model the checkpoint was saved from; put back the "
                         "config.json of the run that wrote it, or start the run again without --resume (into a "
                         "new --out)") from None
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
    """``write(tmp)`` to a temporary name beside ``path`` (the machine's and the process's, unique on a shared file
    system), flushed to the disk, then rename it to ``path`` and flush the directory: neither a crash nor a
    power loss leaves half a file (or an empty one) under ``path``, and a write that fails (a full disk) removes
    what it wrote."""
    tmp = path.with_name(f"{path.name}.tmp-{platform.node()}-{os.getpid()}")
    try:
        write(tmp)
        _flush(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # a file system whose directories cannot be opened has nothing to flush
        _flush(path.parent)


def _flush(path: Path) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
