"""``qwire train --link ...``: start one process per rank behind rate-limited links.

:func:`launch_in_lab` runs each rank in its own network namespace of a
:class:`~qwire.netlab.lab.Lab` (real, ``tc``-shaped links), or, where the lab
cannot run or ``mode=sim`` is asked for, as local processes on loopback with
the simulated link of :mod:`qwire.netlab.simulated`. Both modes start the
ranks the same way (one ``python -c`` process per rank with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in its environment, as torchrun would), so they
differ only in the link.

Files in the run directory: ``config.json`` (the run's configuration, with
its ``link``), ``netlab.json`` (how the link was realised: lab or simulated,
namespaces, addresses, tc commands), and ``netlab/`` (the workers' config,
which has no link so they do not launch again, and the log of every rank but
rank 0, whose output goes to this process's stdout/stderr).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qwire.netlab.lab import Lab, LabUnavailable, lab_unavailable_reason
from qwire.netlab.simulated import ENV_DIR, ENV_MODEL, ENV_SPEC
from qwire.netlab.spec import LinkSpec, parse_link
from qwire.train import _exit_reason, _free_port

__all__ = ["launch_in_lab", "run_rank"]

MASTER_PORT = 29500      # rank 0's namespace is fresh, so any port is free there
LOG_TAIL_LINES = 25      # lines of a failed rank's log quoted in the error
POLL_S = 0.1


def launch_in_lab(cfg: Any, resume: bool = False) -> dict[str, Any]:
    """Run ``cfg`` (a :class:`qwire.train.TrainConfig` with ``link`` set) with one process per stage
    behind rate-limited links; returns rank 0's summary (``summary.json``) plus ``link`` and ``link_mode``.

    Raises:
        qwire.train.TrainError: a rank failed (the message names it and quotes its log), or
            ``mode=lab`` was asked for where the lab cannot run.
        ValueError: a bad ``cfg.link`` spec.
    """
    from qwire.train import TrainError

    spec = parse_link(cfg.link)
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(run_dir / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    if spec.mode == "sim":
        with _exit_on_terminate():
            return _launch(cfg, resume, spec, lab=None, why="mode=sim was asked for")
    reason = lab_unavailable_reason()
    lab: Lab | None = None
    if reason is None:
        try:
            lab = Lab(cfg.stages, spec).start()
        except LabUnavailable as e:
            reason = str(e)
    if lab is None:
        if spec.mode == "lab":
            raise TrainError(f"--link {cfg.link}: mode=lab, but the network lab cannot run here: {reason}")
        with _exit_on_terminate():
            return _launch(cfg, resume, spec, lab=None, why=f"the network lab cannot run here: {reason}")
    with lab:
        return _launch(cfg, resume, spec, lab=lab, why="")


def run_rank(config_path: str, resume: bool = False) -> dict[str, Any]:
    """One rank's entry point: ``qwire.train.main_worker``, with the simulated link attached to the
    pipeline stage when the launcher asked for one (``QWIRE_SIMLINK`` in the environment)."""
    import qwire.train as train

    if os.environ.get(ENV_SPEC):
        import qwire.parallel.pipeline as pipeline
        from qwire.netlab.simulated import attach_from_env

        build = pipeline.compressed_pipeline_stage

        def compressed_pipeline_stage(*args: Any, **kwargs: Any) -> Any:
            stage = build(*args, **kwargs)
            if getattr(stage, "simulated_link", None) is None:
                attach_from_env(stage)
            return stage

        compressed_pipeline_stage.__doc__ = build.__doc__
        pipeline.compressed_pipeline_stage = compressed_pipeline_stage  # train imports it when a worker starts
    return train.main_worker(config_path, resume)


# -----------------------------------------------------------------------------------------------


def _launch(cfg: Any, resume: bool, spec: LinkSpec, lab: Lab | None, why: str) -> dict[str, Any]:
    from qwire.train import TrainError

    run_dir = Path(cfg.out)
    wdir = run_dir / "netlab"
    wdir.mkdir(parents=True, exist_ok=True)
    worker_cfg = dataclasses.asdict(cfg)
    worker_cfg["link"] = ""  # the workers train; they must not launch again
    cfg_path = wdir / "worker-config.json"
    _atomic_write(cfg_path, json.dumps(worker_cfg, indent=2))

    simulate = lab is None or lab.simulated_delay
    simdir: Path | None = None
    env_common = {"WORLD_SIZE": str(cfg.stages), "LOCAL_WORLD_SIZE": str(cfg.stages), "PYTHONUNBUFFERED": "1"}
    if simulate:
        shm = Path("/dev/shm")
        simdir = Path(tempfile.mkdtemp(prefix="qwire-simlink-", dir=shm if shm.is_dir() else None))
        env_common.update({ENV_SPEC: str(spec), ENV_DIR: str(simdir), "QWIRE_SIMLINK_SEED": str(cfg.seed)})
    if lab is None:
        info: dict[str, Any] = {"mode": "simulated", "link": str(spec), "reason": why,
                                "model": os.environ.get(ENV_MODEL) or "gloo"}
        addr = ["127.0.0.1"] * cfg.stages
        port = _free_port()
        ifname = None
        extra = " (packet loss is not simulated)" if spec.loss_frac else ""
        print(f"qwire netlab: {why}; using a SIMULATED link instead{extra}: every payload between stages "
              f"takes bytes / {spec.rate_bits_per_s / 1e6:g} Mbit/s"
              f"{f' + {spec.delay_s * 1e3:g} ms' if spec.delay_s else ''}, modelled at the pipeline boundary, "
              "while the real traffic goes over loopback (docs/netlab.md)", file=sys.stderr, flush=True)
    else:
        info = lab.describe()
        addr = lab.addresses
        port = MASTER_PORT
        ifname = lab.ifname
        how = ", ".join(f"{k} by {v}" for k, v in lab.shaping.items())
        print(f"qwire netlab: {cfg.stages} ranks in network namespaces {lab.namespaces[0]}..{lab.namespaces[-1]}, "
              f"each uplink {spec.describe()} ({how})", file=sys.stderr, flush=True)
        if lab.simulated_delay:
            print(f"qwire netlab: this kernel has no netem qdisc, so the {spec.delay_s * 1e3:g} ms delay"
                  f"{' and jitter' if spec.jitter_s else ''} is SIMULATED at the pipeline boundary "
                  "(the rate is real)", file=sys.stderr, flush=True)
    _atomic_write(run_dir / "netlab.json", json.dumps(info, indent=2))

    code = f"from qwire.netlab.launch import run_rank; run_rank({str(cfg_path)!r}, {bool(resume)!r})"
    procs: list[subprocess.Popen[Any]] = []
    logs = []
    try:
        for k in range(cfg.stages):
            env = dict(env_common, RANK=str(k), LOCAL_RANK=str(k), MASTER_ADDR=addr[0], MASTER_PORT=str(port))
            if ifname:
                env["GLOO_SOCKET_IFNAME"] = ifname
                if cfg.device == "cuda":  # NCCL too: over the shaped interface, not shared memory or NVLink
                    env.update(NCCL_SOCKET_IFNAME=ifname, NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1",
                               NCCL_IB_DISABLE="1")
            argv = ["env", *(f"{key}={val}" for key, val in sorted(env.items())), sys.executable, "-c", code]
            if k == 0:
                out = err = None  # rank 0 talks to the user
            else:
                log = open(wdir / f"rank{k}.log", "w")  # closed below
                logs.append(log)
                out, err = log, subprocess.STDOUT
            if lab is not None:
                procs.append(lab.popen(k, argv, stdout=out, stderr=err))
            else:
                procs.append(_popen_local(argv, stdout=out, stderr=err))
        _wait_all(procs, wdir, run_dir)
    finally:
        _stop(procs)
        for log in logs:
            log.close()
        if simdir is not None:
            attached = len(list(simdir.glob("attached-*")))
            shutil.rmtree(simdir, ignore_errors=True)
    if simdir is not None and cfg.stages > 1 and attached < cfg.stages:
        raise TrainError(f"the simulated link was attached on {attached} of {cfg.stages} ranks; "
                         "the timings of this run do not include the link")
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise TrainError(f"rank 0 finished without writing {summary_path}")
    summary = json.loads(summary_path.read_text())
    summary["link"] = str(spec)
    summary["link_mode"] = info["mode"] if not (lab and lab.simulated_delay) else "lab+simulated-delay"
    return summary


def _wait_all(procs: list[subprocess.Popen[Any]], wdir: Path, run_dir: Path) -> None:
    from qwire.train import TrainError

    while True:
        codes = [p.poll() for p in procs]
        failed = [k for k, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # A rank that raised exits 1; its peers then fail on the broken connection. Prefer the former.
            k = min(failed, key=lambda r: (codes[r] != 1, r))
            _stop(procs)
            tail = ""
            if k != 0:
                lines = (wdir / f"rank{k}.log").read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                tail = "\n  | " + "\n  | ".join(lines) if lines else ""
                tail = f"\nlast lines of its log ({wdir / f'rank{k}.log'}):{tail}"
            raise TrainError(f"rank {k} failed ({_exit_reason(codes[k])}); the other ranks were stopped.{tail}\n"
                             f"Continue from the last checkpoint with: qwire train --resume --out {run_dir}")
        if all(c == 0 for c in codes):
            return
        time.sleep(POLL_S)


@contextlib.contextmanager
def _exit_on_terminate() -> Iterator[None]:
    """SIGTERM/SIGHUP unwind like an exception (so the ranks are stopped and files removed), then exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _popen_local(argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    from qwire.netlab.lab import _set_pdeathsig

    return subprocess.Popen(argv, start_new_session=True, preexec_fn=_set_pdeathsig, **kwargs)


def _stop(procs: list[subprocess.Popen[Any]]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 3.0
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()



def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
