"""``qwire train``: train a causal LM with compressed pipeline stage boundaries (and TP/DP, LAAQ, links).

Every :class:`~qwire.config.TrainConfig` field is an option of the same name, ``--config FILE`` reads them
from JSON/TOML, and ``--resume`` continues a run directory. The training itself is ``qwire.train``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from qwire.config import RUNTIME_FIELDS, TrainConfig, field_help, load_config_file
from qwire.procs import (
    ERRORS_DIR,
    HANGUP_LOG,
    RunStopped,
    TrainError,
    first_on_machine,
    resume_command,
    tell_torchrun,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults, helps = TrainConfig(), field_help()
    for f in dataclasses.fields(TrainConfig):
        flags = ["--" + f.name.replace("_", "-")] + (["--pp"] if f.name == "stages" else [])
        d = getattr(defaults, f.name)
        if isinstance(d, bool):  # a switch: --dp-shard turns it on
            p.add_argument(*flags, dest=f.name, action="store_const", const=True, default=None, help=helps[f.name])
            continue
        # a help text that says what its default means (e.g. "(default: even)") is not followed by the raw value
        said = "default:" in helps[f.name] or "the corpus default" in helps[f.name]
        p.add_argument(*flags, dest=f.name, type=type(d), default=None, metavar=type(d).__name__.upper(),
                       help=helps[f.name] + ("" if said else f" (default: {d!r})"))
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a JSON or TOML file of options (keys are the option names, e.g. tp_codec or tp-codec); "
                        "options given on the command line override it")
    p.add_argument("--resume", nargs="?", const=True, default=False, type=_resume_mode, metavar="auto",
                   help="continue the run in --out from its last checkpoint (its config.json is used; "
                        "--steps may be raised, and --timeout, --stall-warn, --peer-timeout, the intervals and "
                        "the links are taken from the command line). '--resume auto': continue it if it has a "
                        "checkpoint of this same configuration, otherwise start it (for commands that are run "
                        "again after a failure: torchrun --max-restarts, a requeued batch job)")


def _resume_mode(value: str) -> str:
    if value != "auto":
        raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', got {value!r}")
    return value


def unused_options(cfg: TrainConfig, given: dict) -> list[str]:
    """The options given (on the command line or in --config) that this mesh has no use for, in words."""
    from qwire.models.source import HUB_PREFIX, model_source

    pp = "--stages 1 has no pipeline boundary" if cfg.stages == 1 else None
    tp = "--tp is 1" if cfg.tp == 1 else None
    dp = "--dp is 1" if cfg.dp == 1 else None
    exact = "--dp-codec fp32 loses nothing to feed back" if cfg.dp_codec == "fp32" else None
    outer = dp or ("--dp-sync-every is 1 (no DiLoCo outer step)" if cfg.dp_sync_every <= 1 else None)
    why = {"fwd_codec": pp, "bwd_codec": pp, "link_pp": pp, "tp_codec": tp, "link_tp": tp, "dp_codec": dp,
           "link_dp": dp, "dp_sync_every": dp, "dp_sync_overlap": outer, "dp_sync_fragments": outer,
           "outer_lr": outer, "outer_momentum": outer,
           "dp_error_feedback": dp or exact,
           "codec_graphs": "CUDA graphs need --device cuda" if cfg.device != "cuda" else None}
    if given.get("vocab_size") and not cfg.model.startswith(HUB_PREFIX) and model_source(cfg.model).pretrained:
        why["vocab_size"] = f"--model {cfg.model} brings its own tokenizer and vocabulary"

    def option(k: str) -> str:
        return f"--{k.replace('_', '-')}" + ("" if given[k] is True else f" {given[k]}")

    return [f"{option(k)} has no effect: {w}" for k, w in why.items() if w and given.get(k)]


class NothingToDo(Exception):
    """--resume of a run that already reached --steps: not an error."""


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, bool]:
    """The run's configuration and whether it resumes one: command line over --config file over defaults,
    or the saved config.json of the run directory with --resume."""
    from qwire.checkpoint import latest_step

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
             if getattr(args, f.name, None) is not None}
    if getattr(args, "config", None):
        given = {**load_config_file(args.config), **given}
    if args.resume == "auto":
        return auto_resume(given)
    if args.resume:
        if not given.get("out"):
            raise ValueError("--resume needs --out RUN_DIR (the directory of the run to continue)")
        saved = Path(given["out"]) / "config.json"
        if not saved.exists():
            raise ValueError(f"--resume: {saved} not found; is {given['out']} a qwire run directory?")
        cfg = TrainConfig(**load_config_file(saved, what="--resume"))  # names the file and what is wrong in it
        cfg = with_runtime_options(cfg, given, "--resume")
        ignored = sorted(k for k in given if k not in ("out", "steps") and given[k] != getattr(cfg, k))
        if ignored:
            print("--resume uses the run's saved config; ignoring "
                  + ", ".join("--" + k.replace("_", "-") for k in ignored), file=sys.stderr)
        if Path(cfg.out).resolve() != Path(given["out"]).resolve():
            # a copied (or moved) run directory: continue the copy, never write into the original
            print(f"--resume: continuing the run in {given['out']} (its config.json names {cfg.out}, where it "
                  "was started)", file=sys.stderr)
        cfg.out = given["out"]
        if "steps" in given:
            cfg.steps = given["steps"]
        done = latest_step(Path(cfg.out))
        if done is None:
            busy = in_use(Path(cfg.out))
            if busy:  # still running, before its first checkpoint
                raise ValueError(busy)
            raise ValueError(f"--resume: {cfg.out} has no checkpoint (the run stopped before its first one; "
                             f"--checkpoint-every was {cfg.checkpoint_every}); start it again without --resume, "
                             "into a new --out")
        return _at(cfg, done, "--resume"), True
    cfg = TrainConfig(**given)
    for note in unused_options(cfg, given) if os.environ.get("RANK", "0") == "0" else []:  # once under torchrun
        print(f"qwire train: note: {note}", file=sys.stderr)
    if not cfg.out:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            raise ValueError("under torchrun, give --out RUN_DIR (each machine's run directory): the default, a "
                             "name made from the time, could differ between the workers of one machine, which "
                             "start moments apart, and between torchrun's restarts of the job")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.out = str(Path("runs") / f"{stamp}-{cfg.fwd_codec.split(':')[0]}")
    return cfg, False


def run(args: argparse.Namespace) -> int:
    from qwire.train import launch

    cfg = None
    since = time.time()
    try:
        cfg, resume = config_from_args(args)
        cfg.validate()
        run_dir = Path(cfg.out)
        with run_dir_lock(run_dir):
            if not resume and args.resume != "auto":  # auto: checked against the run's config, moved aside
                refuse_used_run_dir(run_dir)
            launch(cfg, resume)  # writes config.json (with --resume: the run's, with this --out and --steps)
    except RunStopped as e:  # SIGTERM (a scheduler's preemption), SIGHUP (a hang-up): saved, not finished
        if os.environ.get("RANK", "0") == "0":
            print(f"qwire train: {e}", file=sys.stderr)
        return 128 + e.signum
    except NothingToDo as e:
        print(f"qwire train: nothing to do: {e}", file=sys.stderr)
        return 0
    except (ValueError, TrainError) as e:
        print(f"qwire train: error: {e}", file=sys.stderr)
        if not getattr(e, "reported", False):  # a rank's error is already torchrun's, with its diagnosis
            tell_torchrun(f"qwire train: error: {e}")
        return 1
    except Exception as e:
        if getattr(e, "reported", False) and os.environ.get("TORCHELASTIC_ERROR_FILE"):
            return 1  # under torchrun: the rank printed it in one line, its traceback is in RUN/errors/
        raise
    except KeyboardInterrupt:
        print(f"qwire train: interrupted; {interrupted_hint(cfg)}", file=sys.stderr)
        return 130
    except SystemExit as e:  # a stop signal the ranks could not take (the lab's teardown unwinds with it)
        names = {128 + signal.SIGTERM: "SIGTERM", 128 + signal.SIGHUP: "SIGHUP"}
        if e.code not in names:
            raise
        print(f"qwire train: stopped by {names[e.code]} {_stopped_when(cfg, since)}", file=sys.stderr)
        return int(e.code)
    return 0


RUN_PRODUCTS = ("metrics.jsonl", "summary.json", "checkpoints")  # what a run that trained leaves in its --out


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` for this run while the block runs: an exclusive ``flock`` on the directory itself (no
    file is written), never waited for. A second ``qwire train`` into the same --out (started at the same
    moment, before the first wrote anything that :func:`refuse_used_run_dir` sees, or a second ``--resume`` of
    a run that is going on) fails at once, naming the process that holds it, instead of both writing the same
    metrics and checkpoints. Under torchrun, global rank 0 holds it for the job. The kernel releases it when
    the process ends, however it ends. Where the file system cannot lock a directory (some network file
    systems), the run goes on without it."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {run_dir}: cannot create the run directory there ({e.strerror}: "
                         f"{e.filename}); give an --out in a writable directory") from None
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        busy = _lock(fd, run_dir)
        if busy:
            raise ValueError(busy)
        yield
    finally:
        os.close(fd)


def _lock(fd: int, run_dir: Path) -> str:
    """Take the run directory's lock on ``fd`` (without waiting): "" where it is taken (or cannot be, on a file
    system without flock), else why not (the process that holds it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = lock_holder(os.fstat(fd))
        return (f"{run_dir} is in use by another qwire train{f' ({holder})' if holder else ''}; wait for it to "
                "end, or give another --out")
    except OSError:  # no flock here: refuse_used_run_dir still keeps out a run that has written
        pass
    return ""


def in_use(run_dir: Path) -> str:
    """Why ``run_dir`` is in use by a running qwire train (see :func:`run_dir_lock`), or ""."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return ""
    try:
        return _lock(fd, run_dir)
    finally:
        os.close(fd)  # (a lock taken here goes with it)


def lock_holder(st: os.stat_result) -> str:
    """``"pid N"`` of the process that holds an ``flock`` on the file or directory of ``st`` (``/proc/locks``),
    or ``""`` where that cannot be read."""
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            f = line.split()  # "1: FLOCK  ADVISORY  WRITE 22416 fe:00:260072 0 EOF" (a waiter's has "->" first)
            if len(f) >= 6 and f[1] == "FLOCK" and f[5] == where and f[4].isdigit():
                return f"pid {f[4]}"
    return ""


def run_products(run_dir: Path) -> list[str]:
    """The :data:`RUN_PRODUCTS` that ``run_dir`` holds: a run trained there."""
    return [name for name in RUN_PRODUCTS if (run_dir / name).exists()]


def refuse_used_run_dir(run_dir: Path) -> None:
    """A new run never writes into the directory of one that trained: its metrics would be appended to the
    other run's, and its config would replace the one they belong to. A directory left by a run that failed
    before its first step (a config.json and logs) may be reused."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    hint = (f". torchrun restarted this job (restart {restarted}): for its restarts to continue from the last "
            "checkpoint, start it with --resume auto" if restarted else "")
    if (run_dir / "checkpoints" / "latest.json").exists():
        raise ValueError(f"{run_dir} already holds a run; use --resume to continue it or another --out{hint}")
    found = run_products(run_dir)
    if found:
        raise ValueError(f"{run_dir} already holds the files of a run that has no checkpoint to resume "
                         f"({', '.join(found)}); give another --out (or delete {run_dir} to start over there){hint}")


def _at(cfg: TrainConfig, done: int, how: str) -> TrainConfig:
    """``cfg``, resumed at checkpoint step ``done``: refused if its --steps would go back; NothingToDo at the end."""
    if cfg.steps < done:
        raise ValueError(f"{how}: the run in {cfg.out} is already at step {done}; --steps {cfg.steps} would "
                         f"go back. Give --steps > {done} to train further (or copy the run to a new --out)")
    if cfg.steps == done:
        raise NothingToDo(f"the run in {cfg.out} is at step {done} and --steps is {cfg.steps}; give --steps > "
                          f"{done} to train further")
    return cfg


def config_differences(saved: TrainConfig, given: TrainConfig) -> list[str]:
    """The options on which two runs' configurations differ, in words: those of what is trained (not --out,
    --steps or the ``RUNTIME_FIELDS``, which a resumed run takes from its command line)."""
    a, b = dataclasses.asdict(saved), dataclasses.asdict(given)
    return [f"--{k.replace('_', '-')} {a[k]!r} there, {b[k]!r} here" for k in a
            if k not in ("out", "steps", *RUNTIME_FIELDS) and a[k] != b[k]]


def with_runtime_options(saved: TrainConfig, given: dict, what: str) -> TrainConfig:
    """``saved`` with the options of how the run runs (``RUNTIME_FIELDS``: --timeout, --link, the intervals)
    that the command line gives, each change said once per machine."""
    changed = {k: given[k] for k in RUNTIME_FIELDS if k in given and given[k] != getattr(saved, k)}
    if changed and first_on_machine():
        print(f"{what}: continuing with " + ", ".join(
            f"--{k.replace('_', '-')} {v!r} (the run had {getattr(saved, k)!r})" for k, v in changed.items()),
            file=sys.stderr)
    return dataclasses.replace(saved, **changed)


def auto_resume(given: dict) -> tuple[TrainConfig, bool]:
    """``--resume auto``: the same command run again after a failure (a restart by torchrun, a requeued batch
    job) continues its run from the last checkpoint, and starts it when there is none. The run in --out must
    have this configuration (--steps may be raised); a run that stopped before its first checkpoint starts
    over, its files moved to ``attempts/<n>/`` in the run directory (by the first process of each machine; no
    rank can have written there since, as every rank's first write follows the rendezvous)."""
    from qwire.checkpoint import latest_step

    if not given.get("out"):
        raise ValueError("--resume auto needs --out RUN_DIR (the directory the command's runs share)")
    cfg = TrainConfig(**given)
    run_dir = Path(cfg.out)
    saved_file = run_dir / "config.json"
    done = latest_step(run_dir)
    found = run_products(run_dir)
    if done is None and not found:
        return cfg, False  # nothing ran there yet (or a run that failed before its first step)
    saved = TrainConfig(**load_config_file(saved_file, what="--resume auto")) if saved_file.exists() else None
    differ = config_differences(saved, cfg) if saved is not None else ["its config.json is missing"]
    if differ:
        raise ValueError(f"--resume auto: {run_dir} holds a run of another configuration ({'; '.join(differ)}); "
                         "give another --out, or --resume without 'auto' to continue that run as it was")
    if done is not None:
        assert saved is not None
        cfg = dataclasses.replace(with_runtime_options(saved, given, "--resume auto"), out=cfg.out, steps=cfg.steps)
        if first_on_machine():
            print(f"--resume auto: continuing the run in {run_dir} from its checkpoint of step {done}",
                  file=sys.stderr)
        return _at(cfg, done, "--resume auto"), True
    if first_on_machine():  # each machine's run directory (on a shared one, whichever machine comes first)
        attempts = run_dir / "attempts"
        keep = attempts / str(1 + sum(1 for _ in attempts.glob("*")) if attempts.exists() else 1)
        keep.mkdir(parents=True, exist_ok=True)
        for name in (*found, "loss.png", ERRORS_DIR, HANGUP_LOG):  # with its plot, its ranks' errors, its output
            with contextlib.suppress(FileNotFoundError):  # another machine moved it first
                (run_dir / name).rename(keep / name)
        if any(keep.iterdir()):
            print(f"--resume auto: the run in {run_dir} stopped before its first checkpoint; starting it again "
                  f"(its files are in {keep})", file=sys.stderr)
        else:
            keep.rmdir()
    return cfg, False


def _stopped_when(cfg: TrainConfig | None, since: float) -> str:
    """When a stop signal that no rank took reached the launcher: before the ranks started, or after they had
    finished (the run's summary written since ``since``), as the network lab was taken down."""
    try:
        finished = cfg is not None and (Path(cfg.out) / "summary.json").stat().st_mtime >= since
    except OSError:
        finished = False
    if finished:
        return f"after the run had finished, as its network lab was taken down (its results are in {cfg.out})"
    return f"before the ranks started; {interrupted_hint(cfg)}"


def interrupted_hint(cfg: TrainConfig | None) -> str:
    """What an interrupted run can do next: resume from its last checkpoint, if it wrote one."""
    from qwire.checkpoint import latest_step

    if cfg is None or not cfg.out:
        return "nothing was started"
    try:
        done = latest_step(Path(cfg.out))
    except (OSError, ValueError):
        done = None
    if done is None:
        return (f"it stopped before its first checkpoint (--checkpoint-every {cfg.checkpoint_every}), so there is "
                "nothing to resume; start it again into a new --out")
    return f"continue from step {done} with: {resume_command(cfg.out)}"
