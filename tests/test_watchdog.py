"""The stall watchdog (qwire.watchdog): heartbeats through a shared store, the adaptive deadline, which rank
prints, the ranks a stalled one is waiting on, and a store that never answers. A process stopped for real
in the middle of a training run is in tests/test_faults.py."""

from __future__ import annotations

import io
import threading
import time

import pytest
import torch.distributed as dist

from qwire import watchdog
from qwire.watchdog import GuardedStore, StoreUnreachable, Watchdog


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _dogs(world: int, warn_after: float = 10.0, ranks: tuple[int, ...] | None = None, peer_timeout: float = 0.0,
          gave_up: list | None = None):
    store, clock = dist.HashStore(), Clock()
    dogs = {r: Watchdog(lambda: store, r, world, warn_after, timeout=300, interval=1.0, out=io.StringIO(),
                        clock=clock, wall=clock, store_limit=60, peer_timeout=peer_timeout,
                        give_up=(lambda why, r=r: gave_up.append((r, why))) if gave_up is not None else None)
            for r in (ranks if ranks is not None else range(world))}
    return dogs, clock


def _enter_all(dogs: dict[int, Watchdog], phase: str, step: int) -> None:
    """Every rank enters ``phase`` and heartbeats (on time)."""
    for d in dogs.values():
        d.enter(phase, step)
        d.tick()


def _tick_all(dogs: dict[int, Watchdog], ranks=None) -> None:
    """One round of every rank's thread: all heartbeats first (in a real job they are never more than one
    interval old), then each rank's check."""
    ranks = list(dogs) if ranks is None else ranks
    for r in ranks:
        dogs[r]._beat(dogs[r].clock())
    for r in ranks:
        dogs[r].tick()


def _run_phase(dog: Watchdog, clock: Clock, phase: str, step: int, seconds: float) -> None:
    dog.enter(phase, step)
    clock.t += seconds
    dog.leave()


def test_the_deadline_is_the_floor_or_ten_times_the_phases_median() -> None:
    dogs, clock = _dogs(1, warn_after=5.0)
    d = dogs[0]
    assert d.deadline("step") == 5.0  # no history: the floor
    for s in (0.2, 0.3, 0.25):
        _run_phase(d, clock, "step", 1, s)
    assert d.deadline("step") == 5.0  # 10 x 0.25 = 2.5 is below the floor
    for _ in range(4):
        _run_phase(d, clock, "step", 2, 2.0)
    assert d.deadline("step") == pytest.approx(20.0)  # 10 x the median of 0.2, 0.25, 0.3, 2, 2, 2, 2
    assert d.deadline("evaluation") == 5.0  # each phase has its own history


def test_a_failed_phase_does_not_join_the_history() -> None:
    dogs, clock = _dogs(1, warn_after=1.0)
    d = dogs[0]
    with pytest.raises(RuntimeError):
        with d.watch("step", 1):
            clock.t += 50
            raise RuntimeError("boom")
    assert d.deadline("step") == 1.0


def test_a_silent_rank_is_named_once_by_the_lowest_rank_still_heartbeating() -> None:
    dogs, clock = _dogs(4, warn_after=10.0)
    for d in dogs.values():
        d.enter("step", 7)
        assert d.tick() is None  # on time: heartbeats only
    clock.t += 30
    _tick_all(dogs, (0, 1, 3))  # rank 2 stopped: it sends nothing from now on
    msgs = [dogs[r].warnings for r in (0, 1, 3)]
    assert len(msgs[0]) == 1 and msgs[1] == [] and msgs[2] == []
    msg = msgs[0][0]
    assert "[rank 0] warning: step 7 has run 30 s" in msg
    assert "rank 2 (no heartbeat for 30 s, last in step 7" in msg
    assert "rank 1" not in msg and "rank 3" not in msg
    assert "--timeout 300 s" in msg
    assert "waiting on rank 2" in dogs[0].out.getvalue()


def test_a_rank_that_fell_behind_is_named_and_the_warning_repeats_as_the_wait_doubles() -> None:
    dogs, clock = _dogs(3, warn_after=10.0)
    dogs[0].enter("step", 12)
    dogs[1].enter("step", 12)
    dogs[2].enter("evaluation", 11)  # still evaluating after step 11: the others wait in step 12
    for seconds in (11, 5, 5, 4, 10):  # t = 11, 16, 21, 25, 35 s into step 12
        clock.t += seconds
        _tick_all(dogs)
    assert [w.split(" has run ")[1].split(" s")[0] for w in dogs[0].warnings] == ["11", "25"]
    assert "waiting on rank 2 (still in step 11 (evaluation))" in dogs[0].warnings[0]
    assert dogs[1].warnings == [] and dogs[2].warnings == []


def test_a_rank_behind_is_placed_where_its_last_heartbeat_was_not_said_to_be_there_still() -> None:
    """Heartbeats come every few seconds: one seconds old tells where the rank was then (a rank that died after
    it, between two heartbeats, is not still in that step)."""
    dogs, clock = _dogs(2)
    _enter_all(dogs, "step", 3)
    dogs[0].enter("step", 17)  # rank 0 went on; rank 1's last heartbeat, 3 s old, was sent in step 3
    clock.t += 3
    assert dogs[0].suspects(dogs[0]._beat(clock(), read=True), clock()) == [
        "rank 1 (in step 3 at its last heartbeat, 3 s ago)"]
    dogs[1]._beat(clock())  # a fresh one from the same step: it is still there
    assert dogs[0].suspects(dogs[0]._beat(clock(), read=True), clock()) == ["rank 1 (still in step 3)"]
    clock.t += 0.4  # ... unless a collective failed since: the peer may have died after that heartbeat
    assert dogs[0].diagnose() == "It was waiting on rank 1 (in step 3 at its last heartbeat, 0.4 s ago)."


def test_when_every_rank_heartbeats_in_the_same_step_the_warning_says_so() -> None:
    dogs, clock = _dogs(2, warn_after=3.0)
    for d in dogs.values():
        d.enter("checkpoint", 5)
        d.tick()
    clock.t += 4
    _tick_all(dogs)
    assert "every rank is heartbeating in step 5" in dogs[0].warnings[0]
    assert dogs[0].diagnose() is None  # nothing to add to an error


def test_diagnose_names_silent_gone_and_missing_ranks() -> None:
    dogs, clock = _dogs(4, warn_after=10.0, ranks=(0, 1, 2))  # rank 3 never started its watchdog
    _enter_all(dogs, "step", 3)
    dogs[2].close()  # rank 2 left the run
    clock.t += 100
    note = dogs[0].diagnose()
    assert note.startswith("It was waiting on ")
    assert "rank 1 (no heartbeat for 100 s, last in step 3" in note
    assert "rank 2 (left the run in step 3)" in note
    assert "rank 3 (no heartbeat at all)" in note


class _Silent:
    """A store that accepts requests and never answers them (as one in a stopped process)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def set(self, key: str, value: str) -> None:
        self.release.wait()

    def check(self, keys: list[str]) -> bool:
        self.release.wait()
        return False


def test_a_store_that_never_answers_is_given_up_on_and_a_new_connection_is_opened() -> None:
    release = threading.Event()
    connects = []

    def connect():
        connects.append(1)
        return _Silent(release) if len(connects) == 1 else dist.HashStore()

    g = GuardedStore(connect, limit=0.3)
    t = time.monotonic()
    with pytest.raises(StoreUnreachable, match="no answer in 0.3 s"):
        g.call(lambda s: s.set("k", "v"))
    assert time.monotonic() - t < 5
    with pytest.raises(StoreUnreachable, match="still unanswered"):  # at most one request waits on it
        g.call(lambda s: s.set("k", "v"))
    assert len(connects) == 1
    release.set()
    deadline = time.monotonic() + 5
    while g._waiting.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    g.call(lambda s: s.set("k", "v"))  # the abandoned connection is never used again
    assert len(connects) == 2
    assert g.call(lambda s: s.get("k")) == b"v"


class _Slow:
    """A store that answers every request after ``delay`` seconds (one behind a full link's queue)."""

    def __init__(self, delay: float) -> None:
        self.delay, self.inner = delay, dist.HashStore()

    def set(self, key: str, value: str) -> None:
        time.sleep(self.delay)
        self.inner.set(key, value)


def test_a_store_that_answers_late_is_given_longer_from_then_on() -> None:
    g = GuardedStore(lambda: _Slow(0.4), limit=0.3)
    with pytest.raises(StoreUnreachable, match="no answer in 0.3 s"):
        g.call(lambda s: s.set("k", "v"))
    g._waiting.join(5)  # it was answered after 0.4 s: the store is slow, not gone
    g.call(lambda s: s.set("k", "v"))
    assert 3 * 0.4 <= g.limit <= 30
    capped = GuardedStore(lambda: _Slow(1.0), limit=0.3, max_limit=0.5)
    capped._took(1.0)
    assert capped.limit == 0.5  # a store that slow is still not waited on forever


def test_a_stalled_rank_whose_store_does_not_answer_says_so_without_blocking() -> None:
    release = threading.Event()
    clock = Clock()
    d = Watchdog(lambda: _Silent(release), 1, 2, 2.0, timeout=60, interval=0.3, where="10.0.0.1:29500",
                 out=io.StringIO(), clock=clock, wall=clock, store_limit=0.5)
    d.enter("step", 4)
    clock.t += 3
    t = time.monotonic()
    msg = d.tick()
    assert time.monotonic() - t < 5
    assert "the rendezvous store at 10.0.0.1:29500 does not answer" in msg
    assert d.diagnose().startswith("The rendezvous store at 10.0.0.1:29500 does not answer either")
    release.set()


def test_watch_and_note_for_are_no_ops_without_an_active_watchdog() -> None:
    watchdog.stop()
    with watchdog.watch("step", 1):
        pass
    assert watchdog.note_for(RuntimeError("Timed out")) is None
    assert watchdog.start(0, 2, 0.0, 60.0) is None  # --stall-warn 0: off


def test_the_median_never_pushes_the_deadline_past_half_the_timeout() -> None:
    dogs, clock = _dogs(1, warn_after=5.0)
    d = dogs[0]
    for _ in range(3):
        _run_phase(d, clock, "step", 1, 40.0)  # 10 x 40 s would be past --timeout 300
    assert d.deadline("step") == 150.0


def test_a_lower_rank_that_is_not_late_itself_does_not_silence_the_warning() -> None:
    dogs, clock = _dogs(3, warn_after=10.0)
    dogs[1].enter("step", 9)
    dogs[2].enter("step", 9)  # rank 0 is busy outside any watched phase (heartbeating, not late)
    clock.t += 12
    _tick_all(dogs)
    assert dogs[0].warnings == [] and len(dogs[1].warnings) == 1 and dogs[2].warnings == []
    assert "[rank 1] warning: step 9 has run 12 s" in dogs[1].warnings[0]


def test_a_round_whose_phase_ended_while_the_store_answered_says_nothing() -> None:
    clock = Clock()
    store = dist.HashStore()
    switched = []

    class Slow:  # the phase ends (once) while this rank waits for the others' heartbeats
        def set(self, k, v):
            store.set(k, v)

        def check(self, keys):
            if not switched:
                switched.append(1)
                d.leave(completed=False)  # (kept out of the history, so the deadline stays 2 s)
                d.enter("step", 6)
            return store.check(keys)

        def get(self, k):
            return store.get(k)

        def multi_get(self, keys):
            return store.multi_get(keys)

    d = Watchdog(lambda: Slow(), 0, 2, 2.0, interval=1.0, out=io.StringIO(), clock=clock, wall=clock,
                 store_limit=60)
    d.enter("step", 5)
    clock.t += 3
    assert d.tick() is None and d.warnings == []
    clock.t += 3  # the new phase is late in its own right: reported, timed from its own start
    assert "step 6 has run 3 s" in d.tick()


def test_note_for_names_the_peer_of_a_transport_error_even_wrapped_by_the_schedule() -> None:
    dogs, clock = _dogs(2, warn_after=10.0)
    for d in dogs.values():
        d.enter("step", 4)
    _tick_all(dogs)
    clock.t += 60
    watchdog._ACTIVE = dogs[0]
    try:
        try:
            try:
                raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv")
            except RuntimeError as inner:  # a TP all-reduce inside a stage: torch's schedule wraps it
                raise RuntimeError("Failed to run stage backward:\n  Stage output: ...") from inner
        except RuntimeError as e:
            note = watchdog.note_for(e)
        assert note == ("It was waiting on rank 1 (no heartbeat for 60 s, last in step 4: a stopped or frozen "
                        "process, its machine, or a rank stuck where Python cannot run).")
        assert watchdog.note_for(RuntimeError("Failed to run stage backward")) is None  # not a transport error
        try:
            try:
                raise ValueError("codec 'perchannel' got a tensor with 4 NaN/Inf value(s) of 4")
            except ValueError as inner:
                raise RuntimeError("Failed to run stage backward (connection ...)") from inner
        except RuntimeError as e:
            assert watchdog.note_for(e) is None  # the stage's own error, not a peer's
    finally:
        watchdog._ACTIVE = None


def test_transport_errors_are_told_from_a_stages_own_errors() -> None:
    from qwire.procs import TrainError, is_transport_error

    def wrapped(inner: BaseException) -> BaseException:
        try:
            try:
                raise inner
            except BaseException as e:
                raise RuntimeError("Failed to run stage backward:\n  Stage output: ...") from e
        except RuntimeError as outer:
            return outer

    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 300000ms for send")
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:41700")
    assert is_transport_error(timeout) and is_transport_error(closed) and is_transport_error(wrapped(timeout))
    assert not is_transport_error(wrapped(ValueError("codec 'perchannel' got a tensor with 4 NaN/Inf value(s)")))
    assert not is_transport_error(TrainError("--resume: the rendezvous timed out? no: a qwire error"))
    assert not is_transport_error(RuntimeError("CUDA out of memory"))


def test_peer_timeout_gives_up_on_a_silent_rank_only_once_it_has_been_silent_that_long() -> None:
    gave_up: list = []
    dogs, clock = _dogs(3, warn_after=10.0, peer_timeout=40.0, gave_up=gave_up)
    _enter_all(dogs, "step", 7)
    clock.t += 30
    _tick_all(dogs, (0, 1))  # rank 2 stopped: late, silent 30 s, not yet 40
    assert gave_up == [] and "--peer-timeout" not in dogs[0].warnings[0]
    clock.t += 11
    _tick_all(dogs, (0, 1))  # silent 41 s: every late rank that waits gives up, naming it
    assert [r for r, _ in gave_up] == [0, 1]
    why = gave_up[0][1]
    assert why.startswith("step 7 has run 41 s waiting on rank 2 (no heartbeat for 41 s, last in step 7")
    assert why.endswith("gave up after --peer-timeout 40 s instead of waiting for --timeout 300 s")
    assert "[rank 0] error: step 7 has run 41 s" in dogs[0].out.getvalue()
    # the ranks that gave up say so in their heartbeat: a rank still waiting names them as failed
    third = Watchdog(lambda: dogs[0].store.connect(), 2, 3, 10.0, timeout=300, interval=1.0, out=io.StringIO(),
                     clock=clock, wall=clock, store_limit=60)
    assert "rank 0 (failed in step 7)" in third.suspects(third._beat(clock(), read=True), clock())


def test_peer_timeout_gives_up_at_once_on_a_failed_rank_but_never_when_not_late_or_off() -> None:
    gave_up: list = []
    dogs, clock = _dogs(2, warn_after=10.0, peer_timeout=100.0, gave_up=gave_up)
    _enter_all(dogs, "step", 3)
    dogs[1].failed()
    dogs[1].close()  # rank 1 ended with an error: its last heartbeat says "failed"
    clock.t += 5
    dogs[0].tick()
    assert gave_up == []  # rank 0 is not late yet: it may still get the transport's own error
    clock.t += 6
    dogs[0].tick()
    assert gave_up == [(0, "step 3 has run 11 s waiting on rank 1 (failed in step 3); gave up after "
                           "--peer-timeout 100 s instead of waiting for --timeout 300 s")]
    # off (the default): a silent rank is named, never given up on; the warning says how to
    off: list = []
    dogs, clock = _dogs(2, warn_after=10.0, gave_up=off)
    _enter_all(dogs, "step", 3)
    clock.t += 1000
    _tick_all(dogs, (0,))
    assert off == [] and "(--peer-timeout S: end the run when a peer is silent S seconds)" in dogs[0].warnings[0]
    # a rank that left the run at its end (not failed) is not given up on
    ended: list = []
    dogs, clock = _dogs(2, warn_after=10.0, peer_timeout=20.0, gave_up=ended)
    _enter_all(dogs, "checkpoint", 9)
    dogs[1].close()
    clock.t += 15
    dogs[0].tick()
    assert ended == []


def test_peer_timeout_gives_up_on_a_store_that_has_not_answered_that_long() -> None:
    release, clock, gave_up = threading.Event(), Clock(), []
    d = Watchdog(lambda: _Silent(release), 1, 2, 2.0, timeout=60, interval=0.3, where="10.0.0.1:29500",
                 out=io.StringIO(), clock=clock, wall=clock, store_limit=0.3, peer_timeout=10.0,
                 give_up=gave_up.append)
    try:
        d.enter("step", 4)
        clock.t += 3
        d.tick()  # late; the store does not answer: counted from now
        clock.t += 5
        d.tick()
        assert gave_up == []
        clock.t += 6
        d.tick()
        assert gave_up == ["step 4 has run 14 s waiting on the rendezvous store at 10.0.0.1:29500, which has not "
                           "answered for 11 s (it runs in qwire train's launcher or torchrun's agent: that "
                           "process or its machine may be stopped); gave up after "
                           "--peer-timeout 10 s instead of waiting for "
                           "--timeout 60 s"]
    finally:
        release.set()
