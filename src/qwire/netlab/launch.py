"""``qwire train --link ...``: start one process per rank behind rate-limited links.

:func:`launch_in_lab` runs each rank in its own network namespace of a
:class:`~qwire.netlab.lab.Lab` (real, ``tc``-shaped links), or, where the lab
cannot run or ``mode=sim`` is asked for, as local processes on loopback with
the simulated link of :mod:`qwire.netlab.simulated`. Both modes start the
ranks the same way (one process per rank, ``stages * tp * dp`` of them, with
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in its environment, as torchrun
would), so they differ only in the link. Each rank is forked from the fork
server of :func:`qwire.procs.rank_context`, which has imported torch, and
enters its namespace itself (:func:`qwire.netlab.lab.enter_namespace`); with
``QWIRE_START_METHOD=spawn`` it is a fresh interpreter (``ip netns exec ...
python -c``) instead.

Each parallel dimension can have its own link (``link_pp``, ``link_tp``,
``link_dp``, falling back to ``link``): in the lab the traffic from one rank
to another is shaped to the link of the dimension in which they differ
(:func:`qwire.netlab.spec.pair_links`); the simulated link models the
pipeline's links only.

Files in the run directory: ``config.json`` (the run's configuration, with
its links), ``netlab.json`` (how the links were realised: lab or simulated,
namespaces, addresses, per-dimension links, the per-pair matrix, the htb
classes of every uplink, tc commands), and ``netlab/`` (the workers' config,
which has no link so they do not launch again, and the log of every rank but
rank 0, whose output goes to this process's stdout/stderr).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qwire.netlab.lab import (
    NETNS_ETC,
    Lab,
    LabError,
    LabUnavailable,
    enter_namespace,
    in_namespace,
    lab_unavailable_reason,
    pid_start,
    signal_session,
)
from qwire.netlab.simulated import ENV_DIR, ENV_LINKS, ENV_MODEL, ENV_SPEC
from qwire.netlab.spec import (
    DIMS,
    LINK_FIELDS,
    LinkSpec,
    dim_links,
    link_mode,
    pair_links,
    parse_link_schedule,
    rank_coords,
    slowest,
    uniform_link,
)
from qwire.procs import (
    TrainError,
    clear_errors,
    describe_error,
    die_with_parent,
    exit_reason,
    first_error,
    forwarding_stop_signals,
    handling,
    in_launcher_env,
    launcher_env,
    oom_kills,
    oom_note,
    rank_context,
    request_stop,
    resume_command,
)
from qwire.rendezvous import LAUNCHER_STORE_ENV, launcher_store

__all__ = ["launch_in_lab"]

WORKER = "qwire.train:main_worker"  # what each rank runs; named, not imported: the lab launches training
MASTER_PORT = 29500      # the job's store, in rank 0's namespace: it is fresh, so any port is free there
LOG_TAIL_LINES = 25      # lines of a failed rank's log quoted in the error
POLL_S = 0.1
SCHEDULE_POLL_S = 0.02  # with --link-schedule: how soon after a step is logged the rate changes
# after a stop signal, how long the ranks have to finish their step and save it before they are killed and the lab
# is removed: within a scheduler's usual grace before its SIGKILL (SLURM's KillWait, 30 s by default), which would
# leave the namespaces behind
STOP_WAIT_S = 25.0


@dataclasses.dataclass
class _Links:
    """A run's links: per dimension, per pair, and which dimensions have both ranks to link and a link."""

    sizes: dict[str, int]
    dims: dict[str, LinkSpec | None]          # per dimension (mode dropped), None: not shaped
    mode: str                                 # auto, lab or sim (see spec.link_mode)
    pairs: dict[tuple[int, int], LinkSpec | None]
    uniform: LinkSpec | None                  # the one link of every pair, if there is one

    @classmethod
    def of(cls, cfg: Any) -> _Links:
        sizes = {"pp": cfg.stages, "tp": getattr(cfg, "tp", 1), "dp": getattr(cfg, "dp", 1)}
        texts = {"link": cfg.link, **{f"link_{d}": getattr(cfg, f"link_{d}", "") for d in DIMS}}
        raw = dim_links(**texts)
        mode = link_mode(raw)
        dims = {d: dataclasses.replace(v, mode="auto") if v is not None else None for d, v in raw.items()}
        pairs = pair_links(sizes["pp"], sizes["tp"], sizes["dp"], **texts)
        uniform = uniform_link(pairs) if pairs else slowest(list(dims.values()))
        return cls(sizes, dims, mode, pairs, uniform)

    @property
    def world(self) -> int:
        return self.sizes["pp"] * self.sizes["tp"] * self.sizes["dp"]

    @property
    def active(self) -> dict[str, LinkSpec]:
        """Dimensions with more than one rank and a link."""
        return {d: s for d, s in self.dims.items() if s is not None and self.sizes[d] > 1}

    def label(self) -> str:
        """``100mbit`` when every pair has that link, else e.g. ``pp=100mbit;tp=10gbit;dp=100mbit``."""
        if self.uniform is not None:
            return str(self.uniform)
        return ";".join(f"{d}={s}" for d, s in self.active.items()) or "none"

    def describe(self) -> str:
        parts = [f"{d} {s.describe() if s else 'not shaped'}" for d, s in self.dims.items() if self.sizes[d] > 1]
        return "; ".join(parts)

    def record(self) -> dict[str, Any]:
        """For netlab.json: per-dimension links and the matrix ``pairs[src][dst]`` ("" = not shaped)."""
        n = self.world
        return {"links": {d: {"size": self.sizes[d], "link": str(s) if s else ""} for d, s in self.dims.items()},
                "rank_layout": "rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank",
                "pairs": [[None if a == b else str(self.pairs[(a, b)] or "") for b in range(n)] for a in range(n)]}


def launch_in_lab(cfg: Any, resume: bool = False, saved: Any = None) -> dict[str, Any]:
    """Run ``cfg`` (a :class:`qwire.train.TrainConfig` with ``link`` or ``link_pp``/``link_tp``/``link_dp``
    set) with one process per rank (``cfg.stages * cfg.tp * cfg.dp`` of them) behind rate-limited links;
    returns rank 0's summary (``summary.json``) plus ``link``, ``links`` and ``link_mode``. The run directory's
    ``config.json`` is ``saved`` (default ``cfg``: a resumed run keeps the options as given, where ``cfg``
    holds the codecs it started with, :func:`qwire.train.resumed_codecs`).

    In the network lab the traffic between two ranks crosses the link of the dimension in which they
    differ (:func:`qwire.netlab.spec.pair_links`). The simulated link (no lab) models the pipeline's
    stage-to-stage traffic only: tensor- and data-parallel links are then not simulated (the launcher
    says so), and a run whose only links are tensor- or data-parallel ones is refused.

    Raises:
        qwire.train.TrainError: a rank failed (the message names it and quotes its log), ``mode=lab``
            was asked for where the lab cannot run, or only tensor-/data-parallel links were asked for
            where only the simulated link can run.
        ValueError: a bad link spec, or links asking for different modes.
    """

    links = _Links.of(cfg)
    if not any(links.dims.values()):
        raise ValueError("launch_in_lab needs a link: set link, link_pp, link_tp or link_dp")
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(run_dir / "config.json", json.dumps(dataclasses.asdict(saved or cfg), indent=2))
    clear_errors(run_dir)  # records of an earlier launch would be taken for this one's
    if getattr(cfg, "link_schedule", "") and links.mode == "sim":
        raise ValueError("--link-schedule changes the rate of the network lab's links (tc); it cannot be used "
                         "with mode=sim")
    if links.mode == "sim":
        with _exit_on_terminate():
            return _launch(cfg, resume, links, lab=None, why="mode=sim was asked for")
    reason = lab_unavailable_reason()
    lab: Lab | None = None
    if reason is None:
        try:
            if links.pairs:
                lab = Lab(links.world, pairs=links.pairs).start()
            else:  # a single rank: nothing to shape between ranks
                lab = Lab(links.world, links.uniform).start()
        except LabUnavailable as e:
            if any(spec.loss_frac for spec in links.active.values()):  # the lab runs here, its loss does not: the
                raise TrainError(f"--link {links.label()}: {e}") from None  # simulated link would drop no packet
            reason = str(e)
        except LabError as e:  # tc or ip refused what the lab asked of it: one line, with what they said
            raise TrainError(f"the network lab could not be built for --link {links.label()}: {e}") from None
    if lab is None:
        if links.mode == "lab":
            raise TrainError(f"--link {links.label()}: mode=lab, but the network lab cannot run here: {reason}")
        if getattr(cfg, "link_schedule", ""):
            raise TrainError(f"--link-schedule changes the rate of real tc-shaped links, but the network lab cannot "
                             f"run here: {reason}")
        with _exit_on_terminate():
            return _launch(cfg, resume, links, lab=None, why=f"the network lab cannot run here: {reason}")
    with lab:
        return _launch(cfg, resume, links, lab=lab, why="")


def _simulated_only_pp(links: _Links, why: str) -> tuple[LinkSpec | None, str]:
    """Without the lab: the pipeline link to simulate (None if there is none) and a note on the links left
    out (tensor-/data-parallel ones); a run whose only links are such ones is refused."""

    pp = links.active.get("pp")
    others = {d: s for d, s in links.active.items() if d != "pp"}
    what = " and ".join(f"the {d} link ({s})" for d, s in others.items())
    if others and pp is None:
        drop = "drop mode=sim and " if links.mode == "sim" else ""
        raise TrainError(f"{why}, and the simulated link models only the traffic between pipeline stages, so "
                         f"{what} cannot be simulated; {drop}run where the network lab can (Linux, root, iproute2), "
                         "or give a pipeline link with --stages > 1 (docs/netlab.md)")
    note = ""
    if others:
        note = (f"qwire netlab: only the pipeline links are SIMULATED; {what} is NOT: that traffic goes over "
                "loopback at full speed (the network lab shapes every dimension)")
    return pp, note


# -----------------------------------------------------------------------------------------------


SIM_PREFIX = "qwire-simlink-"  # the simulated link's shared folder of a run (in /dev/shm where there is one)


def _sim_root() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def remove_dead_sim_dirs() -> list[Path]:
    """Remove the simulated link's folders whose launcher is gone (killed by SIGKILL, it could not remove its
    own); returns them. A launcher holds a lock on its folder's ``owner`` file (:func:`_own_sim_dir`) for as
    long as it runs: a lock that can be taken has no holder. (A lock, not the pid the file names: /dev/shm is
    often shared with containers of other pid namespaces, where a running launcher's pid means nothing.)"""
    import fcntl

    removed = []
    for d in Path(_sim_root() or tempfile.gettempdir()).glob(SIM_PREFIX + "*"):
        try:
            f = (d / "owner").open()
        except OSError:
            continue  # not one this version wrote, or being made
        with f:
            if len(f.read().split()) != 2:
                continue  # being written (its launcher locks it first)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its launcher runs
            shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
    return removed


def _own_sim_dir(simdir: Path) -> Any:
    """Lock ``simdir``'s ``owner`` file for this launcher, then name it there (pid and start time, for a person
    looking); the lock goes with the returned file, which the launcher keeps open while it runs."""
    import fcntl

    f = (simdir / "owner").open("w")
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write(f"{os.getpid()} {pid_start(os.getpid())}")
    f.flush()
    return f


def _launch(cfg: Any, resume: bool, links: _Links, lab: Lab | None, why: str) -> dict[str, Any]:
    # What the workers simulate at the pipeline boundary: the whole pipeline link without the lab; its
    # delay (and rate, which the lab then also enforces) in a lab on a kernel without netem.
    sim_spec: LinkSpec | None = None
    not_simulated: list[str] = []
    note = ""
    if lab is None:
        sim_spec, note = _simulated_only_pp(links, why)
    elif lab.simulated_delay:
        delayed = {d: s for d, s in links.active.items() if s.delay_s}
        sim_spec = delayed.get("pp")
        not_simulated = [d for d in delayed if d != "pp"]
    run_dir = Path(cfg.out)
    wdir = run_dir / "netlab"
    wdir.mkdir(parents=True, exist_ok=True)
    worker_cfg = dataclasses.asdict(cfg)
    links_given = {}
    for key in LINK_FIELDS:  # the workers train, not launch
        if key in worker_cfg:
            links_given[key], worker_cfg[key] = worker_cfg[key], ""
    cfg_path = wdir / "worker-config.json"
    _atomic_write(cfg_path, json.dumps(worker_cfg, indent=2))
    world, P, T = links.world, links.sizes["pp"], links.sizes["tp"]

    simdir: Path | None = None
    env_common = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "PYTHONUNBUFFERED": "1",
                  ENV_LINKS: json.dumps(links_given), LAUNCHER_STORE_ENV: "1"}
    if sim_spec is not None:
        remove_dead_sim_dirs()
        simdir = Path(tempfile.mkdtemp(prefix=SIM_PREFIX, dir=_sim_root()))
        owner = _own_sim_dir(simdir)
        env_common.update({ENV_SPEC: str(sim_spec), "QWIRE_SIMLINK_SEED": str(cfg.seed)})
    if lab is None:
        info: dict[str, Any] = {"mode": "simulated", "link": str(sim_spec) if sim_spec else "", "reason": why,
                                "model": os.environ.get(ENV_MODEL) or "gloo",
                                "simulated": ["pp"] if sim_spec else [],
                                "not_simulated": [d for d in links.active if d != "pp"]}
        addr = ["127.0.0.1"] * world
        store = launcher_store(cfg.timeout)  # held here for the run: it outlives any rank
        port = store.port
        ifname = None
        if sim_spec is not None:
            extra = " (packet loss is not simulated)" if sim_spec.loss_frac else ""
            print(f"qwire netlab: {why}; using a SIMULATED link instead{extra}: every payload between stages "
                  f"takes bytes / {sim_spec.rate_bits_per_s / 1e6:g} Mbit/s"
                  f"{f' + {sim_spec.delay_s * 1e3:g} ms' if sim_spec.delay_s else ''}, modelled at the pipeline "
                  "boundary, while the real traffic goes over loopback (docs/netlab.md)", file=sys.stderr, flush=True)
        else:
            print(f"qwire netlab: {why}; there is no link between ranks to simulate", file=sys.stderr, flush=True)
        if note:
            print(note, file=sys.stderr, flush=True)
    else:
        info = lab.describe()
        addr = lab.addresses
        port = MASTER_PORT
        # held here, at rank 0's address in its namespace, for the run: a rank that dies takes no store with it
        store = in_namespace(lab.netns_file(0), lambda: launcher_store(cfg.timeout, addr[0], port),
                             etc_dir=NETNS_ETC / lab.namespaces[0])
        ifname = lab.ifname
        how = ", ".join(f"{k} by {v}" for k, v in lab.shaping.items())
        names = f"{lab.namespaces[0]}..{lab.namespaces[-1]}"
        if lab.pairs is None:
            each = f"each uplink {links.uniform.describe()}" if links.uniform else "no shaping"
            print(f"qwire netlab: {world} ranks in network namespaces {names}, {each} ({how})",
                  file=sys.stderr, flush=True)
        else:
            print(f"qwire netlab: {world} ranks ({P} stages x TP {T} x DP {links.sizes['dp']}) in network "
                  f"namespaces {names}; links: {links.describe()} (per-destination htb classes, each with a "
                  f"tbf: {how})", file=sys.stderr, flush=True)
        if sim_spec is not None:
            print(f"qwire netlab: this kernel has no netem qdisc, so the {sim_spec.delay_s * 1e3:g} ms delay"
                  f"{' and jitter' if sim_spec.jitter_s else ''} of the pipeline link is SIMULATED at the pipeline "
                  "boundary (the rate is real)", file=sys.stderr, flush=True)
        if not_simulated:
            print(f"qwire netlab: this kernel has no netem qdisc, and the delay of the {' and '.join(not_simulated)} "
                  f"link{'s' if len(not_simulated) > 1 else ''} is NOT simulated (only the pipeline boundary has a "
                  "simulated link; the rate is real)",
                  file=sys.stderr, flush=True)
        if lab.simulated_delay:
            info["delay"] = {d: ("simulated" if d == "pp" else "not simulated (no netem)")
                             for d, s in links.active.items() if s.delay_s}
    info.update(links.record())
    ctx = rank_context()
    forked = ctx.get_start_method() == "forkserver"
    info["rank_start"] = "forkserver" if forked else "spawn"  # how the ranks started (QWIRE_START_METHOD)
    if getattr(cfg, "link_schedule", ""):
        info["link_schedule"] = [{"after_step": st, "link": str(LinkSpec(r))}
                                 for st, r in parse_link_schedule(cfg.link_schedule, cfg.steps)]
    _atomic_write(run_dir / "netlab.json", json.dumps(info, indent=2))

    # Each rank runs qwire.train's worker (WORKER) from the saved config; it attaches the simulated link itself
    # when QWIRE_SIMLINK is set. Ranks fork from the fork server of qwire.procs (which has imported torch) and
    # enter their namespace themselves; with QWIRE_START_METHOD=spawn each is a fresh interpreter started by
    # `ip netns exec`.
    module, name = WORKER.split(":")
    code = f"from {module} import {name}; {name}({str(cfg_path)!r}, {bool(resume)!r})"

    procs: list[Any] = []
    logs = []
    stopped: list[float] = []  # when a stop signal (SIGTERM, SIGHUP) came: the ranks end the run after their step
    stop_signum: list[int] = []

    def stop(signum: int) -> None:
        stopped.append(time.monotonic())
        stop_signum.append(signum)
        request_stop(signum, run_dir)

    forward = forwarding_stop_signals(lambda: [p.pid for p in procs if p.poll() is None], then=stop)
    oom_before = oom_kills()
    try:
        with forward:  # the ranks get SIGTERM and end after their step; the lab stays until they have
            for k in range(world):
                env = dict(env_common, RANK=str(k), LOCAL_RANK=str(k), MASTER_ADDR=addr[0], MASTER_PORT=str(port))
                if simdir is not None:  # one directory per pipeline (ranks with the same dp and tp coordinates)
                    c = rank_coords(k, P, T, links.sizes["dp"])
                    env[ENV_DIR] = str(simdir / f"dp{c['dp']}-tp{c['tp']}")
                if ifname:
                    env["GLOO_SOCKET_IFNAME"] = ifname
                    if cfg.device == "cuda":  # NCCL too: over the shaped interface, not shared memory or NVLink
                        env.update(NCCL_SOCKET_IFNAME=ifname, NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1",
                                   NCCL_IB_DISABLE="1")
                log = None
                if k != 0:  # rank 0 talks to the user
                    log = open(wdir / f"rank{k}.log", "w")  # closed below
                    logs.append(log)
                if forked:
                    environ, out_fd, err_fd = launcher_env(log.fileno() if log is not None else None)
                    where = (lab.netns_file(k), str(NETNS_ETC / lab.namespaces[k])) if lab is not None else None
                    call = pickle.dumps((_rank_main, (where, WORKER, str(cfg_path), bool(resume))))
                    p = ctx.Process(target=in_launcher_env, args=(k, ({**environ, **env}, out_fd, err_fd), call),
                                    name=f"qwire-rank{k}")
                    p.start()
                    procs.append(_Forked(p))
                    continue
                argv = ["env", *(f"{key}={val}" for key, val in sorted(env.items())), sys.executable, "-c", code]
                out, err = (log, subprocess.STDOUT) if log is not None else (None, None)
                if lab is not None:
                    procs.append(lab.popen(k, argv, stdout=out, stderr=err))
                else:
                    procs.append(_popen_local(argv, stdout=out, stderr=err))
            if stop_signum:  # it came while the ranks were starting: passed on to the ones that existed then
                for p in procs:  # only; every rank gets it now (again: the same request)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, stop_signum[-1])
            schedule = _RateSchedule.of(cfg, lab, run_dir)
            _wait_all(procs, wdir, run_dir, schedule, stopped, oom_before)
        try:  # evidence that the loss was applied: what nft saw and dropped (a finished run never fails here)
            drops = lab.loss_counters() if lab is not None else None
        except LabError as e:
            drops = None
            print(f"qwire netlab: could not read the loss counters ({e})", file=sys.stderr, flush=True)
        if drops is not None:
            info["loss_counters"] = drops
            _atomic_write(run_dir / "netlab.json", json.dumps(info, indent=2))
            seen = drops["seen_packets"]
            print(f"qwire netlab: nft dropped {drops['dropped_packets']:,} of the {seen:,} packets sent over lossy "
                  f"links ({drops['dropped_packets'] / seen * 100 if seen else 0:.2f}%); TCP sent them again",
                  file=sys.stderr, flush=True)
    finally:
        _stop(procs)
        del store  # not kept by a traceback: its socket would keep the lab's namespace alive after the lab is closed
        for log in logs:
            log.close()
        if simdir is not None:
            attached = len(list(simdir.glob("*/attached-*")))
            shutil.rmtree(simdir, ignore_errors=True)
            owner.close()
    if simdir is not None and P > 1 and attached < world:
        raise TrainError(f"the simulated link was attached on {attached} of {world} ranks; "
                         "the timings of this run do not include the link")
    summary_path = run_dir / "summary.json"
    at = _checkpoint_step(run_dir) if stopped and not summary_path.exists() else None
    if at is not None:  # the ranks ended the run after a step, with its checkpoint
        return {"stopped_at": at, "run_dir": str(run_dir)}
    if not summary_path.exists():
        raise TrainError(f"rank 0 finished without writing {summary_path}")
    summary = json.loads(summary_path.read_text())
    summary["link"] = links.label()
    summary["links"] = {d: str(s) if s else "" for d, s in links.dims.items()}
    summary["link_mode"] = info["mode"] if not (lab and sim_spec) else "lab+simulated-delay"
    return summary


class _RateSchedule:
    """``--link-schedule``: follows rank 0's ``metrics.jsonl`` and, once a scheduled step has finished,
    changes the rate of every link of the lab; each change is appended to ``link_changes.jsonl``."""

    def __init__(self, lab: Lab, entries: list[tuple[int, float]], run_dir: Path) -> None:
        assert lab.link is not None
        self.lab, self.entries, self.base = lab, entries, lab.link.rate_bits_per_s
        self.rate, self.step, self.offset = self.base, 0, 0
        self.metrics, self.log = run_dir / "metrics.jsonl", run_dir / "link_changes.jsonl"
        self.t0 = time.perf_counter()

    @classmethod
    def of(cls, cfg: Any, lab: Lab | None, run_dir: Path) -> _RateSchedule | None:
        text = getattr(cfg, "link_schedule", "")
        if not text or lab is None:
            return None
        return cls(lab, parse_link_schedule(text, cfg.steps), run_dir)

    def poll(self) -> None:
        """Read the steps rank 0 logged since the last poll; change the rate if a scheduled step was passed."""
        try:
            with open(self.metrics, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return  # not written yet
        end = chunk.rfind(b"\n") + 1  # complete lines only
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                self.step = max(self.step, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
        target = self.base
        after = 0
        for step, rate in self.entries:
            if step <= self.step:
                target, after = rate, step
        if target == self.rate:
            return
        self.lab.set_rate(target)
        self.rate = target
        spec = LinkSpec(target)
        rec = {"after_step": after, "seen_at_step": self.step, "link": str(spec), "rate_bits_per_s": target,
               "time_s": round(time.perf_counter() - self.t0, 3)}
        with open(self.log, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"qwire netlab: step {self.step} done; the links now run at {spec.describe()} (--link-schedule)",
              file=sys.stderr, flush=True)


def _wait_all(procs: list[Any], wdir: Path, run_dir: Path, schedule: _RateSchedule | None = None,
              stopped: list[float] | None = None, oom_before: int | None = None) -> None:
    """Until every rank has exited 0; raises :class:`TrainError` for the first that failed, or when the ranks are
    still running ``STOP_WAIT_S`` after a stop signal (``stopped``: when it came); ``oom_before``: the machine's
    out-of-memory kills when the ranks started (:func:`~qwire.procs.oom_note`)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [k for k, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # A rank that raised exits 1; its peers then fail on the broken connection. Prefer the former. A rank
            # killed by a signal records nothing: a peer's broken connection to it is then no root cause.
            killed = [r for r in failed if codes[r] is not None and codes[r] < 0]
            k = min(killed) if killed else min(failed, key=lambda r: (codes[r] != 1, r))
            _stop(procs)
            rec = first_error(run_dir) if any(codes[r] == 1 for r in failed) else None
            if rec is not None and killed and rec.get("transport"):
                rec = None
            if rec is not None:  # the first error any rank recorded is the root cause: say it last
                raise TrainError(f"the other ranks were stopped (logs in {wdir}).\n{describe_error(rec, run_dir)}"
                                 f"{oom_note(oom_before, rec)}")
            tail = ""
            if k != 0:
                log = wdir / f"rank{k}.log"
                lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:] if log.exists() else []
                tail = (f"\nlast lines of its log ({log}):\n  | " + "\n  | ".join(lines) if lines
                        else f"\nits log ({log}) is empty (only rank 0 reports progress)")
            raise TrainError(f"rank {k} failed ({exit_reason(codes[k])}); the other ranks were stopped.{tail}\n"
                             f"Continue from the last checkpoint with: {resume_command(run_dir)}{oom_note(oom_before)}")
        if all(c == 0 for c in codes):
            return
        if stopped and time.monotonic() - stopped[0] > STOP_WAIT_S:
            running = [k for k, c in enumerate(codes) if c is None]
            _stop(procs)
            at = _checkpoint_step(run_dir)
            raise TrainError(f"rank{'s' if len(running) > 1 else ''} {', '.join(map(str, running))} had not ended "
                             f"{STOP_WAIT_S:g} s after the stop signal (a rank ends the run after its step; a step "
                             f"this long, or a rank stuck in a collective) and {'were' if len(running) > 1 else 'was'} "
                             f"killed (logs in {wdir}). "
                             + (f"Continue from the last checkpoint (step {at}) with: {resume_command(run_dir)}"
                                if at is not None else "No checkpoint was saved yet."))
        if schedule is not None:
            schedule.poll()
        time.sleep(POLL_S if schedule is None else SCHEDULE_POLL_S)


def _checkpoint_step(run_dir: Path) -> int | None:
    from qwire.checkpoint import latest_step  # imports torch, which the lab's own commands do without

    return latest_step(run_dir)


def _exit_on_terminate() -> contextlib.AbstractContextManager[None]:
    """SIGTERM/SIGHUP unwind like an exception (so the ranks are stopped and files removed), then exit."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return handling((signal.SIGTERM, signal.SIGHUP), handler)


def _popen_local(argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent, **kwargs)


def _rank_main(rank: int, where: tuple[str, str] | None, worker: str, cfg_path: str, resume: bool) -> None:
    """A forked rank (through :func:`qwire.procs.in_launcher_env`): its own session, as a rank started with
    ``start_new_session`` has (the launcher stops it with its process group); its network namespace, if it
    has one (``where``: the namespace's file and its /etc files); then ``worker`` (:data:`WORKER`)."""
    import importlib

    os.setsid()
    if where is not None:
        enter_namespace(*where)  # still single-threaded: nothing has run yet
    module, name = worker.split(":")
    try:
        getattr(importlib.import_module(module), name)(cfg_path, resume)
    except Exception as e:
        if getattr(e, "reported", False):  # printed as one line and recorded (qwire.train.worker): not again as
            sys.exit(1)  # multiprocessing's traceback of an uncaught error, as a local rank exits
        raise


class _Forked:
    """A rank started with the fork server, with the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self.pid = proc.pid

    def poll(self) -> int | None:
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        """Signal the rank alone (before it has made its session), unless it has exited."""
        if self.proc.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        return self.proc.exitcode


def _stop(procs: list[Any]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        signal_session(p, signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_session(p, signal.SIGKILL)
            p.wait()



def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
