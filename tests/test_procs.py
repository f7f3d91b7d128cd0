"""How local ranks start (qwire.procs): the fork server, and what a rank takes from its launcher."""

from __future__ import annotations

import os
import pickle
import sys

import pytest

from qwire.procs import START_METHOD_ENV, in_launcher_env, launcher_env, rank_context


def _report(rank: int, tag: str, q) -> None:
    """A rank's work in these tests: print to stdout and stderr, and send back what it sees."""
    print(f"rank {rank} says {tag} on stdout", flush=True)
    print(f"rank {rank} says {tag} on stderr", file=sys.stderr, flush=True)
    q.put((rank, os.environ.get("QWIRE_PROCS_TEST"), os.getpid() != os.getppid()))


def _start(ctx, tag: str, ranks: int = 2) -> list[tuple]:
    q = ctx.SimpleQueue()
    call = pickle.dumps((_report, (tag,)))
    procs = [ctx.Process(target=in_launcher_env, args=(r, launcher_env(), call, q)) for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * ranks
    return sorted(q.get() for _ in range(ranks))


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is tested where qwire's CI runs")
def test_forked_ranks_take_the_launchers_environment_and_output(monkeypatch: pytest.MonkeyPatch,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    ctx = rank_context()
    assert ctx.get_start_method() == "forkserver"
    monkeypatch.setenv("QWIRE_PROCS_TEST", "first")
    assert _start(ctx, "a") == [(0, "first", True), (1, "first", True)]
    # the fork server runs on with the environment it started with; the next ranks still see the launcher's
    monkeypatch.setenv("QWIRE_PROCS_TEST", "second")
    assert _start(ctx, "b") == [(0, "second", True), (1, "second", True)]
    out, err = capfd.readouterr()
    for tag in ("a", "b"):
        for r in (0, 1):
            assert f"rank {r} says {tag} on stdout" in out and f"rank {r} says {tag} on stderr" in err


def test_spawn_can_be_asked_for_and_a_bad_start_method_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    ctx = rank_context()
    assert ctx.get_start_method() == "spawn"
    monkeypatch.setenv("QWIRE_PROCS_TEST", "spawned")
    assert _start(ctx, "c", ranks=1) == [(0, "spawned", True)]
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="QWIRE_START_METHOD='fork': local ranks start with 'forkserver'"):
        rank_context()
