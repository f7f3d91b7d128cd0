"""Process helpers shared by the training launcher (``qwire.train``) and the network lab (``qwire.netlab``).

Kept apart so that neither package imports the other's internals.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import pickle
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class TrainError(RuntimeError):
    """A training run failed for a reason the user can act on."""


def resume_command(run_dir: str | Path) -> str:
    """The command that continues the run in ``run_dir``, its path quoted for a shell (a space, a quote)."""
    return f"qwire train --resume --out {shlex.quote(str(run_dir))}"


class RunStopped(TrainError):
    """A stop signal (:data:`STOP_SIGNALS`) ended the run after a step, whose checkpoint every rank saved;
    ``signum``: the signal this process got (None: it came to another process of the job)."""

    def __init__(self, step: int, run_dir: str, signum: int | None = None) -> None:
        self.step, self.run_dir = step, run_dir
        self.signum = signum if signum is not None else signal.SIGTERM  # the exit status is 128 + this
        by = signal.Signals(signum).name if signum is not None else "a stop signal"
        super().__init__(f"stopped by {by} after step {step}, whose checkpoint is saved; continue with: "
                         f"{resume_command(run_dir)} (or run the same command with --resume auto)")


@contextlib.contextmanager
def handling(signals: tuple[int, ...], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for ``signals`` while the block runs, the earlier handlers back after it. Only the main
    thread can install one; elsewhere the block runs with the handlers as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


# What ends a run after its step, with that step's checkpoint: SIGTERM, which a scheduler sends before it kills a
# job (preemption, a time limit), and SIGHUP, which the terminal's processes get when it goes away (an ssh
# session that dropped); a process that ignores SIGHUP (started under nohup) goes on ignoring it.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
HANGUP_LOG = "hangup.log"  # in the run directory: output for a terminal that hung up (or a pipe whose reader ended)

_stop_signal: int | None = None  # the stop signal this process received, if any


def stop_signals() -> tuple[int, ...]:
    """:data:`STOP_SIGNALS` less those this process ignores (SIGHUP under ``nohup``)."""
    return tuple(s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN)


def stop_signal() -> int | None:
    """The stop signal this process received (:func:`request_stop`), None if none."""
    return _stop_signal


def request_stop(signum: int, run_dir: str | Path | None = None) -> None:
    """Note a stop signal: the run ends after its step. A hang-up first moves this process's output off the
    terminal, to ``run_dir``'s :data:`HANGUP_LOG` (:func:`leave_terminal`)."""
    global _stop_signal
    _stop_signal = signum
    if signum == signal.SIGHUP and run_dir is not None:
        leave_terminal(run_dir)


def leave_terminal(run_dir: str | Path) -> None:
    """Point this process's stdout and stderr that are a terminal at ``run_dir``'s :data:`HANGUP_LOG`: once a
    terminal hangs up (its ssh session is gone) a write to it fails, and would fail the run on its way to the
    checkpoint."""
    divert_output(run_dir, [fd for fd in (1, 2) if _isatty(fd)])


def divert_output(run_dir: str | Path, fds: list[int]) -> None:
    """Point the file descriptors ``fds`` (1: stdout, 2: stderr) at ``run_dir``'s :data:`HANGUP_LOG`, appended to
    (``/dev/null`` where it cannot be opened); what is buffered for them is flushed first, where it can be."""
    if not fds:
        return
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # what is buffered for the terminal: it may be gone already
            f.flush()
    try:
        fd = os.open(Path(run_dir) / HANGUP_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY)
    for t in fds:
        os.dup2(fd, t)
    os.close(fd)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def forwarding_stop_signals(pids: Callable[[], list[int]],
                            then: Callable[[int], None] | None = None) -> contextlib.AbstractContextManager[None]:
    """In a launcher, while the block runs: a stop signal is passed on to the ranks (``pids``: the live ones), which
    end the run after their step, and ``then(signum)`` is called first."""

    def forward(signum: int, frame: Any) -> None:
        if then is not None:
            then(signum)
        for pid in pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    return handling(stop_signals(), forward)


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


def oom_note(before: int | None, rec: dict | None = None) -> str:
    """A line for the end of a failed run's error when the kernel's out-of-memory killer ended processes on this
    machine since :func:`oom_kills` counted ``before`` (at the ranks' start), else "". The killer sends SIGKILL:
    the rank it chose dies without a word, or the fork server the local ranks run from, which takes them along.
    Where the run's first error record (``rec``, :func:`first_error`) is a rank's own error, not a peer's broken
    connection, that is the root cause, and this says nothing."""
    if rec is not None and not rec.get("transport"):
        return ""
    now = oom_kills()
    if before is None or now is None or now <= before:
        return ""
    n = now - before
    return (f"\nthe kernel's out-of-memory killer ended {n} process{'es' if n > 1 else ''} on this machine while the "
            "run ran (oom_kill in /proc/vmstat): the run most likely ran out of memory; give it more, or make the "
            "ranks need less (a smaller --batch-size or --seq-len, more --stages, a smaller --model)")


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended on this machine since it booted (a memory
    cgroup's limit included), from ``/proc/vmstat``; None where that is not known."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


# -----------------------------------------------------------------------------------------------
# Starting local ranks. Importing torch with its distributed pipelining and tensor packages, and the parts of
# transformers that build a model, costs each process seconds of CPU, and loading the CPU codec kernels most of
# another; a fork server does both once and forks every local rank from there, instead of each rank doing them
# itself (``qwire train`` on one machine with 4 ranks: once instead of 4 times).

PRELOAD = ("torch", "torch.distributed", "torch.distributed.pipelining", "torch.distributed.tensor.parallel",
           "transformers.configuration_utils", "transformers.modeling_utils",
           "transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto",
           "qwire.codecs.kernels.preloaded")  # the last one also loads the CPU codec kernels


START_METHOD_ENV = "QWIRE_START_METHOD"


def rank_context(also: tuple[str, ...] = ()) -> Any:
    """The multiprocessing context local ranks start in: a fork server that has imported ``PRELOAD`` (and the
    modules ``also`` names, where this call starts it), or
    ``spawn`` where there is no fork server or ``QWIRE_START_METHOD=spawn`` asks for it (each rank then imports
    everything itself). A rank forked by the server has the server's environment (from when it started), not
    the launcher's: start ranks through :func:`in_launcher_env`."""
    import multiprocessing as mp

    method = os.environ.get(START_METHOD_ENV, "").strip().lower() or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={os.environ[START_METHOD_ENV]!r}: local ranks start with 'forkserver' "
                         "(the default) or 'spawn'; set one of them or unset it")
    try:
        ctx = mp.get_context(method)
    except ValueError:
        return mp.get_context("spawn")
    if method == "spawn":
        return ctx
    ctx.set_forkserver_preload(list(PRELOAD + also))  # no effect once the server runs: it has imported them
    _start_fork_server()
    return ctx


def start_rank_server() -> None:
    """Start the fork server that local ranks fork from (:func:`rank_context`) now, ahead of ``qwire train``'s
    launch: its imports (seconds of one core) then run while the launcher imports and checks the run, not
    after. It also imports ``qwire.train``, which each rank would otherwise import after its fork (about a
    second each, 4 ranks on 2 cores); a module of it that reads the environment does so when asked, not as it
    loads, so a server started before a change of the environment serves ranks as well. Nothing for a process
    that is a rank itself (``RANK`` and ``WORLD_SIZE`` set, as torchrun starts its workers). An error (a
    ``QWIRE_START_METHOD`` that names no start method) is left for the launch, which reports it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    with contextlib.suppress(Exception):
        rank_context(also=("qwire.train",))


def _start_fork_server() -> None:
    """Start the fork server (if it does not run yet) with the stop signals blocked, as CPython starts its
    resource tracker: a scheduler, ``timeout`` or ``kill -TERM -PGID`` that signals every process of the job
    would otherwise end the server, and with it (``die_with_parent``) every rank mid-step, where the ranks
    should finish their step and save it. The server keeps them blocked for good; each rank unblocks them
    first thing (:func:`in_launcher_env`), so it is signalled as before. It still exits with the launcher
    (:func:`_leave_fork_server`)."""
    from multiprocessing import forkserver, resource_tracker

    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:  # the tracker first (the server would start it): it inherits the mask, then ignores SIGTERM and
        resource_tracker.ensure_running()  # unblocks it, but keeps SIGHUP blocked; here it unblocks SIGTERM too
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Fd:
    """A file descriptor of the launcher, passed to a process it starts (a duplicate arrives, whatever the
    start method: multiprocessing sends it along with the process's arguments)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        return _received, (DupFd(self.fd),)


def _received(dup: Any) -> int:
    return int(dup.detach())


def launcher_env(output: int | None = None) -> tuple[dict[str, str], _Fd | None, _Fd | None]:
    """What :func:`in_launcher_env` gives a rank: this process's environment, stdout and stderr (None for
    one that is closed); with ``output`` (a file descriptor, e.g. of the rank's log), that in place of both."""
    if output is not None:
        return dict(os.environ), _Fd(output), _Fd(output)
    fds = []
    for fd, f in ((1, sys.stdout), (2, sys.stderr)):
        try:
            f.flush()
        except (AttributeError, OSError, ValueError):
            pass
        try:
            os.fstat(fd)
            fds.append(_Fd(fd))
        except OSError:
            fds.append(None)
    return dict(os.environ), fds[0], fds[1]


def _leave_fork_server() -> None:
    """A process forked by the fork server holds the pipe whose closing tells the server that its last
    client is gone. Closing it here lets the server exit with the launcher; and with the server, the ranks
    (``die_with_parent``): ranks never outlive a killed launcher. (A rank that starts processes of its own
    with the fork server then gets a new one.)"""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None or getattr(server, "_forkserver_pid", None) is not None:  # spawned, or this is a launcher
        return
    try:
        os.close(fd)
    except OSError:
        pass
    server._forkserver_alive_fd = None
    server._forkserver_address = None


def die_with_launcher() -> None:
    """A local rank's first step: be killed when the process that started it dies, also when the fork server
    forked it (the server then exits with the launcher, and the rank with the server)."""
    _leave_fork_server()
    die_with_parent()


def in_launcher_env(rank: int, env: tuple[dict[str, str], int | None, int | None], call: bytes, *rest: Any) -> Any:
    """A local rank's entry: die with the launcher; take its environment, stdout and stderr (``env``, from
    :func:`launcher_env`), then run the pickled ``(fn, args)`` as ``fn(rank, *args, *rest)``. ``fn`` and
    ``args`` are unpickled only after the environment is set, so the modules they import read the launcher's
    (``QWIRE_HOST_STAGING``, ``TRITON_INTERPRET``, ...). A rank forked by the fork server starts with the
    stop signals blocked (:func:`_start_fork_server`; a spawned one, blocked by the launcher while it started it)
    and unblocks them here, noting one as a stop request (:func:`request_stop`) until the run takes them over
    (``qwire.train.stop_on_signals``): one sent in the rank's first moments, or already pending, stops the run
    after its first step, as later, instead of killing the rank."""
    for sig in stop_signals():
        signal.signal(sig, lambda signum, frame: request_stop(signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    die_with_launcher()
    environ, out, err = env
    for fd, target in ((out, 1), (err, 2)):
        if fd is not None and fd != target:  # spawned, the launcher's descriptor arrives under its own number
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    if environ.get("PYTHONUNBUFFERED"):  # a forked rank's streams were made before it had this environment
        for f in (sys.stdout, sys.stderr):
            try:
                f.reconfigure(line_buffering=True)
            except (AttributeError, ValueError, OSError):
                pass
    fn, args = pickle.loads(call)
    return fn(rank, *args, *rest)


# -----------------------------------------------------------------------------------------------
# Error records: when one rank fails, its peers fail a moment later on the broken connection. Each rank
# that raises writes what it raised, with the time, under <run dir>/errors/; launchers report the first
# one, so the last line a user reads is the root cause, not a peer's "Connection closed".

ERRORS_DIR = "errors"


def spare_errors_dir(run_dir: str | Path) -> Path:
    """Where a rank records its error when the run directory cannot take it (a full disk, which may well be
    the error): a directory of this run under the system's temporary directory."""
    key = hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"qwire-errors-{os.getuid()}" / key


def _errors_dirs(run_dir: str | Path) -> tuple[Path, Path]:
    return Path(run_dir) / ERRORS_DIR, spare_errors_dir(run_dir)


def clear_errors(run_dir: str | Path, rank: int | None = None) -> None:
    """Remove the error records of an earlier launch (one rank's, or all)."""
    for d in _errors_dirs(run_dir):
        for f in ([d / f"rank{rank}.json"] if rank is not None else sorted(d.glob("rank*.json"))):
            with contextlib.suppress(OSError):
                f.unlink(missing_ok=True)


def record_error(run_dir: str | Path, rank: int, exc: BaseException, note: str | None = None) -> None:
    """Write what ``rank`` raised (type, message, traceback, time) as ``errors/rank<k>.json``, or where the run
    directory cannot take it, in :func:`spare_errors_dir`; ``note`` (what the rank knew of its peers when it
    failed: ``qwire.watchdog``) is reported after the message. Under torchrun, the same words go to its error
    file (:func:`tell_torchrun`)."""
    rec = {"rank": rank, "time": time.time(), "type": type(exc).__name__, "message": str(exc).strip(),
           "traceback": "".join(traceback.format_exception(exc))}
    root = root_cause(exc)
    if root is not exc and str(root).strip() not in rec["message"]:  # not when the message quotes it
        rec["cause"] = f"{type(root).__name__}: {str(root).strip()}"
    if note:
        rec["note"] = note
    transport = is_transport_error(exc)  # a peer's broken connection: the symptom of another rank's failure
    if transport:
        rec["transport"] = True
    for d in _errors_dirs(run_dir):
        tmp = d / f".rank{rank}.json.tmp{os.getpid()}"
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(rec, indent=1))
            os.replace(tmp, d / f"rank{rank}.json")
            break
        except OSError:  # an unwritable run directory must not hide the error being reported
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)  # half a record would take space a peer's record needs
    # torchrun's root cause is the failure with the earliest time, in whole seconds: a peer's broken connection
    # counts one second later, so the error that broke it wins within the same second
    tell_torchrun(describe_error(rec, run_dir), rec["time"] + (1.0 if transport else 0.0))


def tell_torchrun(text: str, when: float | None = None) -> bool:
    """Under torchrun, write ``text`` as this worker's error (the file ``TORCHELASTIC_ERROR_FILE`` names, in
    the format of torch's ``ErrorHandler``): torchrun's closing summary then shows it as the root cause
    (the failure with the earliest time), where it otherwise says "To enable traceback see: ...". Returns
    whether it wrote one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {"message": {"message": text.strip().splitlines()[-1] if text.strip() else text,
                        "extraInfo": {"py_callstack": text, "timestamp": str(int(when or time.time()))}}}
    try:
        Path(path).write_text(json.dumps(data))
    except OSError:
        return False
    return True


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception ``exc`` was raised from (``raise ... from e``): torch's pipeline schedule wraps
    what a stage raised in "Failed to run stage backward: <tensor shapes>", whose message leaves it out. A
    :class:`TrainError` on the way is the end: its message already says what its cause means for the user (a
    full disk, not torch's "unexpected pos 9471680 vs 9471572")."""
    seen = {id(exc)}
    while not isinstance(exc, TrainError) and exc.__cause__ is not None and id(exc.__cause__) not in seen:
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
    for d in _errors_dirs(run_dir):
        for f in d.glob("rank*.json"):
            try:
                recs.append({**json.loads(f.read_text()), "path": str(f)})
            except (OSError, ValueError):
                continue
    return min(recs, key=lambda r: (r["time"], r["rank"])) if recs else None


def describe_error(rec: dict, run_dir: str | Path) -> str:
    """``rank 2 failed: FileNotFoundError: ...`` (the message's last line is its own last line), then what it was
    raised from (``caused by ...``) and the note on the ranks it was waiting on, if it has them: the root cause
    comes last."""
    path = rec.get("path") or Path(run_dir) / ERRORS_DIR / f"rank{rec['rank']}.json"
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


def first_on_machine() -> bool:
    """Whether this process writes what one machine's run directory holds once (its config.json; under torchrun,
    local rank 0 of each machine, as for the checkpoints' pointer; the launcher of local ranks)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0
