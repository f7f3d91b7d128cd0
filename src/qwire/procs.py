"""Process helpers shared by the training launcher (``qwire.train``) and the network lab (``qwire.netlab``).

Kept apart so that neither package imports the other's internals.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import time
import traceback
from pathlib import Path


class TrainError(RuntimeError):
    """A training run failed for a reason the user can act on."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exit_reason(code: int | None) -> str:
    """A process exit status in words: ``killed by SIGKILL``, ``exit code 1``."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


# -----------------------------------------------------------------------------------------------
# Error records: when one rank fails, its peers fail a moment later on the broken connection. Each rank
# that raises writes what it raised, with the time, under <run dir>/errors/; launchers report the first
# one, so the last line a user reads is the root cause, not a peer's "Connection closed".

ERRORS_DIR = "errors"


def clear_errors(run_dir: str | Path, rank: int | None = None) -> None:
    """Remove the error records of an earlier launch (one rank's, or all)."""
    d = Path(run_dir) / ERRORS_DIR
    for f in ([d / f"rank{rank}.json"] if rank is not None else sorted(d.glob("rank*.json"))):
        f.unlink(missing_ok=True)


def record_error(run_dir: str | Path, rank: int, exc: BaseException, note: str | None = None) -> None:
    """Write what ``rank`` raised (type, message, traceback, time) as ``errors/rank<k>.json``; ``note`` (what
    the rank knew of its peers when it failed: ``qwire.watchdog``) is reported after the message."""
    try:
        d = Path(run_dir) / ERRORS_DIR
        d.mkdir(parents=True, exist_ok=True)
        rec = {"rank": rank, "time": time.time(), "type": type(exc).__name__, "message": str(exc).strip(),
               "traceback": "".join(traceback.format_exception(exc))}
        root = root_cause(exc)
        if root is not exc and str(root).strip() not in rec["message"]:  # not when the message quotes it
            rec["cause"] = f"{type(root).__name__}: {str(root).strip()}"
        if note:
            rec["note"] = note
        tmp = d / f".rank{rank}.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(rec, indent=1))
        os.replace(tmp, d / f"rank{rank}.json")
    except OSError:  # an unwritable run directory must not hide the error being reported
        pass


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception ``exc`` was raised from (``raise ... from e``): torch's pipeline schedule wraps
    what a stage raised in "Failed to run stage backward: <tensor shapes>", whose message leaves it out."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


TRANSPORT_WORDS = ("timed out", "timeout", "connection", "reset by peer", "broken pipe", "nccl", "gloo")


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the transport's: a collective that timed out or lost its peer (gloo and NCCL raise
    RuntimeError and its subclasses, with words such as "Timed out" or "Connection closed"). The test is on
    the root cause: torch's pipeline schedule re-raises what a stage raised (a TP all-reduce or a DP hook
    inside it, too) as "Failed to run stage backward", and a stage's own error (a NaN a codec refused) is
    not the transport's."""
    root = root_cause(exc)
    return (isinstance(root, RuntimeError) and not isinstance(root, TrainError)
            and any(w in str(root).lower() for w in TRANSPORT_WORDS))


def first_error(run_dir: str | Path) -> dict | None:
    """The earliest error record of the ranks of a run (None if no rank recorded one)."""
    recs = []
    for f in (Path(run_dir) / ERRORS_DIR).glob("rank*.json"):
        try:
            recs.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return min(recs, key=lambda r: (r["time"], r["rank"])) if recs else None


def describe_error(rec: dict, run_dir: str | Path) -> str:
    """``rank 2 failed: FileNotFoundError: ...`` (the message's last line is its own last line), then what it was
    raised from (``caused by ...``) and the note on the ranks it was waiting on, if it has them: the root cause
    comes last."""
    path = Path(run_dir) / ERRORS_DIR / f"rank{rec['rank']}.json"
    cause = f"\ncaused by {rec['cause']}" if rec.get("cause") else ""
    note = f"\n{rec['note']}" if rec.get("note") else ""
    return f"(traceback in {path})\nrank {rec['rank']} failed: {rec['type']}: {rec['message']}{cause}{note}"


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when the process that started it dies, so ranks never
    outlive a killed launcher (and block their peers until the timeout). Safe to call between fork and
    exec. A no-op elsewhere."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux, or no libc: the collective timeouts still stop orphaned ranks
        pass
