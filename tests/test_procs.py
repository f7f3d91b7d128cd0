"""How local ranks start (qwire.procs): the fork server, and what a rank takes from its launcher."""

from __future__ import annotations

import os
import pickle
import sys

import pytest
import torch

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


def _kernels_loaded(rank: int, q) -> None:
    """Which of the default codecs' CPU kernels were loaded before this rank encoded anything."""
    from qwire.codecs.kernels.cpu import _tah, perchannel

    q.put((rank, [len(f.signatures) > 0 for f in (_tah.pass_ab, _tah.quant_c, _tah.dequant_d,
                                                 perchannel.quant_pack_rows, perchannel.unpack_dequant_rows)]))


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is tested where qwire's CI runs")
def test_forked_ranks_have_the_codec_kernels_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server loads the CPU codec kernels once (qwire.codecs.kernels.preloaded): a forked rank does
    not load them again at its first encode."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert _one_rank(rank_context(), _kernels_loaded) == (0, [True] * 5)  # tahquant's and perchannel's encoder
    # and decoder kernels


def _one_rank(ctx, fn) -> object:
    """What rank 0, started through ``in_launcher_env`` in ``ctx``, sent back from ``fn(0, queue)``."""
    q = ctx.SimpleQueue()
    p = ctx.Process(target=in_launcher_env, args=(0, launcher_env(), pickle.dumps((fn, ())), q))
    p.start()
    p.join(timeout=120)
    assert p.exitcode == 0
    return q.get()


def test_preloading_the_kernels_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception would stop the fork server: a failed preload leaves the loading to the ranks."""
    import importlib

    import qwire.codecs.kernels.preloaded as preloaded
    import qwire.codecs.kernels.warm as warm

    calls = []

    def broken(**kw):
        calls.append(kw)
        raise RuntimeError("no kernels here")

    import torch

    threads = torch.get_num_threads()
    monkeypatch.setattr(warm, "warm", broken)
    importlib.reload(preloaded)  # runs the preload again, with the broken warm
    assert len(calls) == 1  # the set-up compiled this tree's kernels, so the preload did try to load them
    assert torch.get_num_threads() == threads  # the one thread it loads in is given back


def test_the_preload_loads_only_kernels_that_are_compiled(tmp_path) -> None:
    """Without this tree's kernels in numba's cache (qwire installed without setup.sh) the fork server does not
    compile all of them before any rank starts: each rank compiles the few it uses."""
    import hashlib

    from qwire.codecs.kernels.preloaded import compiled

    src = str(tmp_path / "src" / "cpu")
    assert not compiled(src, str(tmp_path / "cache"))  # no cache at all
    d = tmp_path / "cache" / f"cpu_{hashlib.sha1(src.encode()).hexdigest()}"
    d.mkdir(parents=True)
    assert not compiled(src, str(tmp_path / "cache"))  # an empty one
    (d / "direct.tile_stats-40.py311.nbi").write_bytes(b"")
    assert compiled(src, str(tmp_path / "cache"))
    assert not compiled(str(tmp_path / "elsewhere" / "cpu"), str(tmp_path / "cache"))  # another tree's


def test_the_commands_a_message_hands_over_survive_a_copy_and_paste(tmp_path) -> None:
    """A run directory with a space (or a quote) in its name is quoted in the resume command a message gives, so
    pasting it into a shell continues that run; a plain name stays as it is."""
    import json
    import shlex

    from qwire.checkpoint import CheckpointWriteError
    from qwire.procs import RunStopped

    assert "qwire train --resume --out '/runs/my run' (or" in str(RunStopped(7, "/runs/my run"))
    assert "qwire train --resume --out /runs/r1 (or" in str(RunStopped(7, "/runs/r1"))
    run = tmp_path / "it's my run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"step": 5, "dir": "step_0000005"}))
    said = str(CheckpointWriteError(run, 10, run / "x.pt", OSError(28, "No space left on device")))
    assert said.endswith("continue with: qwire train --resume --out " + shlex.quote(str(run)))
    assert shlex.split(said.rsplit("continue with: ", 1)[1])[-1] == str(run)



def _train_loaded(rank: int, q) -> None:
    q.put("qwire.train" in sys.modules)


def _fresh_server_loads_train(start_early: bool) -> bool:
    """Whether a rank forked from a new fork server had ``qwire.train`` loaded before it unpickled its call."""
    from multiprocessing import forkserver

    from qwire.procs import start_rank_server

    forkserver._forkserver._stop()  # a server an earlier test started: this test needs a new one
    if start_early:
        start_rank_server()
    return _one_rank(rank_context(), _train_loaded)


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is tested where qwire's CI runs")
def test_qwire_trains_fork_server_starts_early_with_the_ranks_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """``qwire train`` starts the fork server before it imports its own modules (start_rank_server), and that
    server imports ``qwire.train`` too, once, where each rank imported it after its fork; a server that a
    library call starts (rank_context alone) does not. A torchrun worker (RANK and WORLD_SIZE set) starts none."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert _fresh_server_loads_train(start_early=True)
    assert not _fresh_server_loads_train(start_early=False)
    from multiprocessing import forkserver

    from qwire.procs import start_rank_server

    forkserver._forkserver._stop()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    start_rank_server()
    assert forkserver._forkserver._forkserver_pid is None


def test_host_staging_is_read_from_the_environment_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """QWIRE_HOST_STAGING set after qwire.comm.collectives loaded (a fork server imported it before the launcher
    set it) still forces the staging, and force_host_staging overrides it."""
    import torch.distributed as dist

    from qwire.comm import collectives

    monkeypatch.setattr(collectives, "_FORCE_STAGING", None)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    x = torch.zeros(2)
    monkeypatch.delenv("QWIRE_HOST_STAGING", raising=False)
    assert not collectives.stages(x, None)
    monkeypatch.setenv("QWIRE_HOST_STAGING", "1")
    assert collectives.stages(x, None)
    collectives.force_host_staging(False)
    assert not collectives.stages(x, None)


def test_the_qwire_command_joins_threads_runs_atexit_and_flushes_before_its_fast_exit(tmp_path) -> None:
    """``qwire`` (cli.entry) ends without the interpreter's teardown, but as the interpreter would end it for
    what a user sees: a non-daemon thread finishes, atexit handlers run, buffered output is written, and the
    exit status is main's (argparse's 2 for a bad option)."""
    import subprocess

    code = ("import atexit, sys, threading, time\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "import qwire.cli as cli\n"
            "returned, main = threading.Event(), cli.main\n"
            "cli.main = lambda: (main(), returned.set())[0]\n"
            "threading.Thread(target=lambda: (returned.wait(), time.sleep(0.3), print('thread done'))).start()\n"
            "sys.stdout.write('buffered ')\n"
            "sys.argv = ['qwire'] + sys.argv[1:]\n"
            "cli.entry()\n")
    done = subprocess.run([sys.executable, "-c", code, "codecs"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("buffered ") and "tahquant" in lines and lines[-2:] == ["thread done", "atexit ran"]
    bad = subprocess.run([sys.executable, "-m", "qwire", "bench", "no-such-bench"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr, bad.stderr
