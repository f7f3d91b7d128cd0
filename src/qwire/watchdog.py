"""Heartbeats and stall warnings: which rank a stalled run is waiting on.

A collective that waits on a peer that stopped (a stopped or swapping process, a frozen machine, a rank
stuck where Python cannot run) gives up only after ``--timeout`` (300 s by default), and its error names
the operation ("Timed out waiting 300000ms for recv operation"), not the peer. So each rank runs a small
thread that publishes a heartbeat every few seconds through the job's rendezvous store (the TCPStore at
``MASTER_ADDR:MASTER_PORT`` that every rank already reaches): the step, the phase it is in (a training
step, ``auto``'s measurements, an evaluation, a checkpoint) and the time.

When this rank's phase has run longer than ``--stall-warn`` seconds and ten times the median of that
phase's earlier durations (an adaptive deadline: a link that is slow all along does not trigger it), the
thread reads every rank's heartbeat and prints one line naming the ranks that went silent or fell behind.
Only the lowest-numbered rank that is still heartbeating prints it, so a job prints it once; it repeats
each time the wait doubles. When a collective then fails, the same diagnosis is appended to that rank's
error, so the last line the user reads names the rank to look at.

Heartbeats are a help, not a reason to fail, unless ``--peer-timeout`` asks for it: then a rank whose phase
is late ends the run once a peer it may be waiting on has sent no heartbeat for that many seconds, or failed
(a rank that ends with an error says so in its last heartbeat), instead of waiting for ``--timeout``; it
records why as its error, the root cause its launcher (or torchrun) reports. Otherwise, if the store cannot
be reached the watchdog says so in its warning and training goes on untouched.

The clock is the wall clock (``time.time``) of each machine; the ages it prints assume clocks that agree
to a second, as NTP keeps them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

from .procs import is_transport_error

STALL_FACTOR = 10.0  # a phase is late after this many times its median duration (and --stall-warn seconds)
HISTORY = 16         # durations per phase the median is taken over
STORE_LIMIT_S = 3.0  # seconds a store request may take before the store counts as not answering, at first
STORE_LIMIT_FACTOR = 3.0  # ... then at least this many times the longest a request took to be answered
STORE_LIMIT_MAX_S = 30.0  # ... and at most this
ENDED = ("exited", "failed")  # the phases of a rank's last heartbeat
STORE_HOST = "qwire train's launcher or torchrun's agent"  # who holds it


def _key(attempt: str, rank: int) -> str:
    """The store key of ``rank``'s heartbeat; under torchrun, one set per attempt of the job (its agents' store
    keeps the keys of the attempts before; :mod:`qwire.rendezvous`)."""
    return f"qwire/heartbeat/{attempt}/{rank}"


@dataclass(frozen=True)
class Beat:
    """One rank's last heartbeat."""

    step: int
    phase: str | None  # None: between phases; "exited": the rank left the run
    t: float           # wall time it was sent
    late: bool = False  # its own phase had passed its deadline (it warns, so the ranks above it need not)

    def where(self) -> str:
        return f"step {self.step}" + (f" ({self.phase})" if self.phase not in (None, "step", *ENDED) else "")


class StoreUnreachable(RuntimeError):
    pass


class PeerTimeout(RuntimeError):
    """A rank gave up on a silent or failed peer (``--peer-timeout``)."""


class GuardedStore:
    """A store whose every request runs in a helper thread that is given up on after ``limit`` seconds.

    A store whose process is stopped accepts the connection and never answers, and torch's client then
    waits regardless of its own timeout; so a request that does not return in time is abandoned, the
    connection it holds is never used again (a late answer would be read as the next request's), and the
    next request opens a new one. While an abandoned request is still waiting no new one is started, so
    at most one thread waits on a silent store.

    The limit grows to ``STORE_LIMIT_FACTOR`` times the longest any request took to be answered (an
    abandoned one that was answered late included), up to ``max_limit``: on a link whose queue holds
    seconds of training traffic, a store that answers slowly is not taken for one that does not answer."""

    def __init__(self, connect: Callable[[], Any], limit: float = 3.0,
                 max_limit: float = STORE_LIMIT_MAX_S) -> None:
        self.connect, self.limit, self.max_limit = connect, limit, max(limit, max_limit)
        self._client: Any = None
        self._gen = 0
        self._waiting: threading.Thread | None = None
        self._waiting_box: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _took(self, seconds: float) -> None:
        self.limit = min(self.max_limit, max(self.limit, STORE_LIMIT_FACTOR * seconds))

    def call(self, fn: Callable[[Any], Any]) -> Any:
        with self._lock:
            if self._waiting is not None:
                if self._waiting.is_alive():
                    raise StoreUnreachable(f"a request sent more than {self.limit:g} s ago is still unanswered")
                if "value" in self._waiting_box:  # answered after it was given up on: slow, not gone
                    self._took(self._waiting_box["took"])
                self._waiting, self._waiting_box = None, {}
            gen, client, box = self._gen, self._client, {}

            def run() -> None:
                t0 = time.monotonic()
                try:
                    c = client if client is not None else self.connect()
                    value = fn(c)
                    box["took"], box["client"] = time.monotonic() - t0, c
                    box["value"] = value
                except Exception as e:  # noqa: BLE001 - reported to the caller as StoreUnreachable
                    box["error"] = e

            t = threading.Thread(target=run, name="qwire-watchdog-store", daemon=True)
            t.start()
            t.join(self.limit)
            if t.is_alive():
                self._waiting, self._waiting_box, self._client, self._gen = t, box, None, gen + 1
                raise StoreUnreachable(f"no answer in {self.limit:g} s")
            if "error" in box:
                self._client = None
                raise StoreUnreachable(str(box["error"]))
            self._client = box["client"]
            self._took(box["took"])
            return box["value"]

    def close(self) -> None:
        with self._lock:
            self._client = None


class Watchdog:
    """Publishes this rank's heartbeat and warns when a phase stalls; see the module docstring.

    ``connect`` returns a ``torch.distributed.Store`` every rank shares (it is called again after a request
    went unanswered). Phase durations use ``clock`` (monotonic), heartbeats ``wall`` (comparable across
    machines); both, ``out`` and ``store_limit`` exist for tests.
    Call :meth:`start` for the background thread, or :meth:`tick` to run one round by hand."""

    def __init__(self, connect: Callable[[], Any], rank: int, world: int, warn_after: float, timeout: float = 300.0, *,
                 interval: float | None = None, where: str = "", out: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 store_limit: float = STORE_LIMIT_S, attempt: str = "0", peer_timeout: float = 0.0,
                 give_up: Callable[[str], None] | None = None) -> None:
        if warn_after <= 0:
            raise ValueError(f"warn_after must be > 0 seconds, got {warn_after}")
        self.rank, self.world, self.attempt = rank, world, attempt
        self.warn_after, self.timeout = float(warn_after), float(timeout)
        self.interval = interval if interval is not None else min(5.0, max(0.2, warn_after / 4))
        self.stale_after = max(3 * self.interval, 2.0)  # a heartbeat older than this: the rank went silent
        self.store = GuardedStore(connect, limit=store_limit)
        self.where = where  # the store's address, for the message when it does not answer
        self.out, self.clock, self.wall = out, clock, wall
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._seq = 0  # counts the phases entered, so a round that outlived its phase says nothing
        self._step = 0
        self._since = clock()
        self._warned = 0.0  # how long the current phase had run at its last warning
        self._hist: dict[str, deque[float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.warnings: list[str] = []
        self.peer_timeout = float(peer_timeout)  # 0: never give up (see the module docstring)
        self.give_up = give_up  # called with the reason, after it was printed and published
        self._store_down_since: float | None = None
        self._failed = False  # this rank ends with an error: its last heartbeat says "failed"

    # ------------------------------------------------------------------------------ this rank's phases

    def enter(self, phase: str, step: int) -> None:
        with self._lock:
            self._phase, self._step, self._since, self._warned = phase, step, self.clock(), 0.0
            self._seq += 1

    def leave(self, completed: bool = True) -> None:
        """End the current phase; a completed one joins its phase's durations (a failed one does not)."""
        with self._lock:
            if self._phase is not None and completed:
                self._hist.setdefault(self._phase, deque(maxlen=HISTORY)).append(self.clock() - self._since)
            self._phase, self._since = None, self.clock()

    @contextmanager
    def watch(self, phase: str, step: int) -> Iterator[None]:
        self.enter(phase, step)
        try:
            yield
        except BaseException:
            self.leave(completed=False)
            raise
        self.leave()

    def deadline(self, phase: str) -> float:
        """Seconds ``phase`` may run before it counts as stalled: --stall-warn, or 10x its median if longer,
        but never more than half of --timeout on account of the median (a warning must come before the
        collective gives up)."""
        hist = self._hist.get(phase)
        if not hist:
            return self.warn_after
        return max(self.warn_after, min(STALL_FACTOR * statistics.median(hist), self.timeout / 2))

    # ------------------------------------------------------------------------------ heartbeats

    def _beat(self, now: float, phase: str | None = None, read: bool = False,
              late: bool = False) -> dict[int, Beat | None] | None:
        """Send this rank's heartbeat (``now``: wall time) and, with ``read``, return every other rank's last one
        (None: none yet); raises StoreUnreachable. Two requests when every rank has sent one (a check and one
        multi_get), so that links with a long round trip still answer within the limit."""
        with self._lock:
            msg = json.dumps({"step": self._step, "phase": phase if phase is not None else self._phase, "t": now,
                              "late": late})
        others = [r for r in range(self.world) if r != self.rank]
        keys = [_key(self.attempt, r) for r in others]

        def go(store: Any) -> dict[int, Beat | None] | None:
            store.set(_key(self.attempt, self.rank), msg)
            if not read:
                return None
            if keys and store.check(keys) and hasattr(store, "multi_get"):
                vals: list[bytes | None] = list(store.multi_get(keys))
            else:
                vals = [store.get(k) if store.check([k]) else None for k in keys]
            got: dict[int, Beat | None] = {}
            for r, v in zip(others, vals, strict=True):
                d = json.loads(v) if v is not None else None
                got[r] = Beat(int(d["step"]), d["phase"], float(d["t"]), bool(d.get("late"))) if d else None
            return got

        return self.store.call(go)

    def suspects(self, peers: dict[int, Beat | None], now: float, failed: bool = False) -> list[str]:
        """The ranks this one may be waiting on, each in words: silent, gone, or behind (``failed``: after a
        collective failed, when a peer that died a moment ago has a heartbeat less than a second old: none is
        said to be "still" anywhere)."""
        return [words for _, words in self._suspects(peers, now, failed)]

    def _suspects(self, peers: dict[int, Beat | None], now: float, failed: bool = False) -> list[tuple[int, str]]:
        with self._lock:
            mine = self._step
        fresh = {r: b for r, b in peers.items() if b is not None and b.phase not in ENDED
                 and now - b.t <= self.stale_after}
        ahead = max([mine, *(b.step for b in fresh.values())])
        out = []
        for r, b in sorted(peers.items()):
            if b is None:
                out.append((r, f"rank {r} (no heartbeat at all)"))
            elif b.phase == "exited":
                out.append((r, f"rank {r} (left the run in {b.where()})"))
            elif b.phase == "failed":
                out.append((r, f"rank {r} (failed in {b.where()})"))
            elif r not in fresh:
                out.append((r, f"rank {r} (no heartbeat for {now - b.t:.0f} s, last in {b.where()}: a stopped or "
                               "frozen process, its machine, or a rank stuck where Python cannot run)"))
            elif b.step < ahead:  # a heartbeat seconds old tells where the rank was then, not that it is still there
                age = now - b.t
                out.append((r, f"rank {r} (still in {b.where()})" if age < 1 and not failed else
                            f"rank {r} (in {b.where()} at its last heartbeat, {age:.{1 if age < 1 else 0}f} s ago)"))
        return out

    def _hopeless(self, peers: dict[int, Beat | None] | None, now: float, wall: float, elapsed: float) -> str | None:
        """With --peer-timeout: why this late rank's wait is in vain (peers silent that long, a peer that failed,
        a store that has not answered that long), in words; None while there is hope."""
        pt = self.peer_timeout
        if peers is None:
            since = self._store_down_since
            if since is None or now - since < pt:
                return None
            at = f" at {self.where}" if self.where else ""
            return (f"the rendezvous store{at}, which has not answered for {now - since:.0f} s (it runs in "
                    f"{STORE_HOST}: that process or its machine may be stopped)")
        gone = {r for r, b in peers.items() if (b is None and elapsed >= pt) or (
            b is not None and (b.phase == "failed" or (b.phase != "exited" and wall - b.t >= pt)))}
        names = [words for r, words in self._suspects(peers, wall) if r in gone]
        return "; ".join(names) if names else None

    def _reports(self, peers: dict[int, Beat | None], now: float) -> bool:
        """Whether this rank prints: no lower rank is heartbeating that is late itself (and so prints; a lower
        rank that is not late, e.g. busy outside a watched phase, does not silence this one)."""
        return not any(b is not None and b.late and b.phase != "exited" and now - b.t <= self.stale_after
                       for r, b in peers.items() if r < self.rank)

    # ------------------------------------------------------------------------------ one round

    def tick(self) -> str | None:
        """Send the heartbeat; if the current phase is late, return (and print) the warning."""
        now, wall = self.clock(), self.wall()
        with self._lock:
            phase, step, elapsed, warned, seq = self._phase, self._step, now - self._since, self._warned, self._seq
        late = phase is not None and elapsed >= self.deadline(phase)
        due = late and not (warned and elapsed < 2 * warned)
        check = late and self.peer_timeout > 0
        unreachable, peers = None, None
        try:
            peers = self._beat(wall, read=due or check, late=late)
            self._store_down_since = None
        except StoreUnreachable as e:
            unreachable = e
            self._store_down_since = self._store_down_since if self._store_down_since is not None else now
        if check:
            why = self._hopeless(peers, now, wall, elapsed)
            with self._lock:
                current = self._seq == seq
            if why is not None and current:
                return self._give_up(f"{Beat(step, phase, wall).where()} has run {elapsed:.0f} s waiting on "
                                     f"{why}; gave up after --peer-timeout {self.peer_timeout:g} s instead of "
                                     f"waiting for --timeout {self.timeout:g} s")
        if not due:
            return None
        with self._lock:
            if self._seq != seq:  # the phase ended while the store answered: nothing to say about it
                return None
            self._warned = elapsed
        hist = self._hist.get(phase)
        typical = f"its median so far {statistics.median(hist):.2g} s" if hist else "its first time"
        head = (f"[rank {self.rank}] warning: {Beat(step, phase, wall).where()} has run {elapsed:.0f} s "
                f"({typical}); ")
        tail = f". Collectives give up after --timeout {self.timeout:g} s" + (
            "." if self.peer_timeout else " (--peer-timeout S: end the run when a peer is silent S seconds).")
        if unreachable is not None or peers is None:
            msg = head + self._unreachable_words(either=False) + tail
        else:
            if not self._reports(peers, wall):
                return None
            names = self.suspects(peers, wall)
            msg = head + ("waiting on " + "; ".join(names) if names else
                          f"every rank is heartbeating in step {step}: this is slow work, or one rank is stuck "
                          "inside a collective, or the link got much slower") + tail
        self.warnings.append(msg)
        print(msg, file=self.out or sys.stderr, flush=True)
        return msg

    def _give_up(self, why: str) -> str:
        """Print ``why`` as this rank's error, tell the others (a "failed" heartbeat), then ``give_up``."""
        msg = f"[rank {self.rank}] error: {why}"
        self.warnings.append(msg)
        print(msg, file=self.out or sys.stderr, flush=True)
        self._failed = True
        with contextlib.suppress(StoreUnreachable):
            self._beat(self.wall(), phase="failed")
        if self.give_up is not None:
            self.give_up(why)
        return msg

    def failed(self) -> None:
        """This rank ends with an error: its last heartbeat (:meth:`close`) says so, for --peer-timeout."""
        self._failed = True

    def _unreachable_words(self, either: bool) -> str:
        at = f" at {self.where}" if self.where else ""
        return (f"the rendezvous store{at} does not answer{' either' if either else ''} (it runs in {STORE_HOST}): "
                "that process or its machine may be stopped")

    def diagnose(self) -> str | None:
        """After a collective failed: the ranks this one was waiting on, as the last line of its error
        (None when every rank was heartbeating in the same step, i.e. nothing to add)."""
        wall = self.wall()
        try:
            names = self.suspects(self._beat(wall, read=True) or {}, wall, failed=True)
        except StoreUnreachable:
            return "T" + self._unreachable_words(either=True)[1:] + "."
        if not names:
            return None
        return "It was waiting on " + "; ".join(names) + "."

    # ------------------------------------------------------------------------------ the thread

    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._run, name=f"qwire-watchdog-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._beat(self.wall())  # the first heartbeat at once: "no heartbeat at all" means no watchdog
        except StoreUnreachable:
            pass
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a bug here must not take training down
                pass

    def close(self) -> None:
        """Stop the thread and tell the others this rank left (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.store.limit + 1)
        try:
            self._beat(self.wall(), phase="failed" if self._failed else "exited")
        except StoreUnreachable:
            pass
        self.store.close()


# ---------------------------------------------------------------------------------- one per process

_ACTIVE: Watchdog | None = None


def start(rank: int, world: int, warn_after: float, timeout: float, attempt: str = "0", peer_timeout: float = 0.0,
          run_dir: str = "") -> Watchdog | None:
    """Start this process's watchdog on the job's rendezvous store (MASTER_ADDR:MASTER_PORT, as torchrun and
    qwire's launchers set them), with the heartbeats of ``attempt`` (the name of this attempt of a torchrun
    job); None when it is off (``warn_after`` 0) or there is no such store. With ``peer_timeout``, a rank that
    gives up on its peers records why in ``run_dir`` (its launcher's root cause) and exits 1 at once: its main
    thread waits inside a collective that nothing else ends."""
    global _ACTIVE
    stop()
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if warn_after <= 0 or world < 2 or not host or not port:  # one rank waits on nobody
        return None
    import torch.distributed as dist

    def connect() -> Any:
        return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))

    def give_up(why: str) -> None:
        from .procs import record_error

        try:
            record_error(run_dir, rank, PeerTimeout(why))
        finally:
            os._exit(1)

    _ACTIVE = Watchdog(connect, rank, world, warn_after, timeout, where=f"{host}:{port}", attempt=attempt,
                       peer_timeout=peer_timeout, give_up=give_up).start()
    return _ACTIVE


def active() -> Watchdog | None:
    return _ACTIVE


def stop() -> None:
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.close()
        _ACTIVE = None


@contextmanager
def watch(phase: str, step: int) -> Iterator[None]:
    """``with watch("step", 12): ...``: the phase this rank is in, for the active watchdog (if any)."""
    if _ACTIVE is None:
        yield
        return
    with _ACTIVE.watch(phase, step):
        yield


def failed() -> None:
    """This process ends with an error: its last heartbeat says so (see :meth:`Watchdog.failed`)."""
    if _ACTIVE is not None:
        _ACTIVE.failed()


def note_for(exc: BaseException) -> str | None:
    """The diagnosis to append to ``exc``'s error, for errors of the transport (``procs.is_transport_error``);
    None for the others."""
    if _ACTIVE is None or not is_transport_error(exc):
        return None
    try:
        return _ACTIVE.diagnose()
    except Exception:  # noqa: BLE001
        return None
