"""``qwire netlab``: list and clean leftover lab namespaces, and measure a lab link.

::

    qwire netlab list                       # qwire namespaces on this machine and their owners
    qwire netlab clean [--all]              # remove those whose owner is gone (--all: every one)
    qwire netlab linktest --link 100mbit    # 2 ranks, gloo send/recv: achieved Mbit/s and RTT
    qwire netlab linktest --pp 2 --dp 2 --link-pp 20mbit --link-dp 1gbit   # one TCP transfer per dimension
    qwire netlab compare --links 20mbit,100mbit -- --stages 2 --fwd-codec fp32   # lab vs simulated tokens/s
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qwire.netlab.spec import parse_link

__all__ = ["add_arguments", "run", "linktest", "linktest_dims"]

LINKTEST_SECONDS = 3.0        # default transfer: about this long at the configured rate ...
LINKTEST_MAX_MBYTES = 50.0    # ... but never more than this (and never more than MAX_MBYTES when asked)
MAX_MBYTES = 512.0
CHUNK = 4 << 20               # bytes per gloo send
PINGS = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = sub.add_parser("list", help="list qwire network namespaces on this machine and whether their owner runs")
    ls.add_argument("--json", action="store_true", help="print JSON")
    cl = sub.add_parser("clean", help="delete leftover qwire namespaces (owner process gone)")
    cl.add_argument("--all", action="store_true", help="also delete labs whose owner is still running")
    lt = sub.add_parser("linktest", help="measure the bandwidth and RTT between two ranks over a lab link")
    lt.add_argument("--link", default="", help="link spec, e.g. 100mbit or 50mbit,delay=10ms")
    for dim, what in (("pp", "pipeline stages"), ("tp", "tensor-parallel ranks"), ("dp", "data-parallel replicas")):
        lt.add_argument(f"--link-{dim}", default="", help=f"link between {what} (default: --link); with any "
                        "of --link-pp/--link-tp/--link-dp/--pp/--tp/--dp, rank 0 sends to one peer per dimension "
                        "over TCP instead")
    lt.add_argument("--pp", type=int, default=0, help="pipeline stages of the per-dimension test (default: 2)")
    lt.add_argument("--tp", type=int, default=0, help="tensor-parallel size of the per-dimension test (default: 1, "
                    "2 with --link-tp)")
    lt.add_argument("--dp", type=int, default=0, help="data-parallel size of the per-dimension test (default: 1, "
                    "2 with --link-dp)")
    lt.add_argument("--mbytes", type=float, default=None,
                    help=f"megabytes to send (default: about {LINKTEST_SECONDS:g} s at the link rate, at most "
                         f"{LINKTEST_MAX_MBYTES:g}, or more where the shaper's queue needs it)")
    lt.add_argument("--timeout", type=float, default=120.0, help="seconds before the test is abandoned")
    lt.add_argument("--json", default="", help="also write the result to this JSON file")
    cm = sub.add_parser("compare", help="the same qwire train run over lab and simulated links: tokens/s of each",
                        description="Runs `qwire train TRAIN_ARGS --link LINK,mode=lab|sim` for every link, and "
                                    "once without a link; writes compare.json and compare.md in --out.")
    cm.add_argument("--links", default="20mbit,50mbit,100mbit",
                    help="links separated by ';' or, when they have no options, by ',' (default: %(default)s)")
    cm.add_argument("--modes", default="lab,sim",
                    help="any of lab, sim (gloo model), sim-duplex (full-duplex model) (default: %(default)s)")
    cm.add_argument("--steps", type=int, default=20, help="training steps per run (default: %(default)s)")
    cm.add_argument("--skip", type=int, default=3, help="first steps left out of tokens/s (default: %(default)s)")
    cm.add_argument("--repeat", type=int, default=1, help="repeat everything, interleaved (default: %(default)s)")
    cm.add_argument("--no-baseline", action="store_true", help="skip the run without a link")
    cm.add_argument("--out", default="runs/netlab-compare", help="directory for the runs and the report")
    cm.add_argument("train_args", nargs=argparse.REMAINDER,
                    help="after --: arguments for qwire train (e.g. -- --stages 2 --fwd-codec fp32)")


def run(args: argparse.Namespace) -> int:
    from qwire.netlab.lab import LabError, clean_labs, lab_unavailable_reason, list_labs

    try:
        if args.action == "clean":  # the simulated link's folders, which runs leave where the lab cannot run too
            from qwire.netlab.launch import remove_dead_sim_dirs

            for d in remove_dead_sim_dirs():
                print(f"removed the simulated link's folder {d} (its launcher is gone)")
        if args.action in ("list", "clean"):
            reason = lab_unavailable_reason()
            if reason:
                print(f"qwire netlab: {reason}", file=sys.stderr)
                return 1
        if args.action == "list":
            labs = list_labs()
            if args.json:
                print(json.dumps([vars(x) for x in labs], indent=2))
            elif not labs:
                print("no qwire network namespaces")
            else:
                for info in labs:
                    print(info.describe())
            return 0
        if args.action == "clean":
            removed, kept = clean_labs(include_running=args.all)
            for info in removed:
                print(f"removed {info.describe()}")
            for info in kept:
                print(f"kept {info.describe()} (its owner is running; --all removes it too)")
            if not removed and not kept:
                print("no qwire network namespaces")
            return 0
        if args.action == "compare":
            from qwire.netlab.compare import compare

            links = _split_links(args.links)
            train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
            result = compare(links, train_args, args.out, steps=args.steps, skip=args.skip,
                             modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                             baseline=not args.no_baseline, repeat=args.repeat)
            print((Path(args.out) / "compare.md").read_text(), end="")
            return 0 if result["rows"] else 1
        if args.link_pp or args.link_tp or args.link_dp or args.pp or args.tp or args.dp:
            return _run_linktest_dims(args)
        if not args.link:
            raise ValueError("linktest needs --link (or per-dimension links: --link-pp/--link-tp/--link-dp)")
        res = linktest(args.link, mbytes=args.mbytes, timeout=args.timeout)
        print(f"link {res['link']}: {res['goodput_mbit_s']:.2f} Mbit/s of payload "
              f"({res['fraction_of_rate'] * 100:.1f}% of the configured {res['rate_mbit_s']:g} Mbit/s; "
              f"{res['wire_mbit_s']:.2f} Mbit/s with TCP/IP framing), RTT {res['rtt_ms']:.3f} ms "
              f"(min {res['rtt_min_ms']:.3f}); {res['bytes'] / 1e6:.1f} MB in {res['seconds']:.2f} s")
        if res["shaping"].get("delay") == "simulated":
            print("note: this kernel has no netem qdisc, so the link's delay/jitter is not on the wire here "
                  "(qwire train simulates it at the pipeline boundary); the numbers above are without it")
        note = small_transfer_note(res)
        if note:
            print(note)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return 0
    except (ValueError, LabError, RuntimeError) as e:
        print(f"qwire netlab: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        made = " (the lab it made is removed)" if args.action == "linktest" else ""
        print(f"qwire netlab: interrupted{made}", file=sys.stderr)
        return 130


def _run_linktest_dims(args: argparse.Namespace) -> int:
    sizes = {"pp": args.pp or 2, "tp": args.tp or (2 if args.link_tp else 1),
             "dp": args.dp or (2 if args.link_dp else 1)}
    res = linktest_dims(sizes["pp"], sizes["tp"], sizes["dp"], link=args.link, link_pp=args.link_pp,
                        link_tp=args.link_tp, link_dp=args.link_dp, mbytes=args.mbytes, timeout=args.timeout)
    print(f"{res['world']} ranks ({sizes['pp']} stages x TP {sizes['tp']} x DP {sizes['dp']}), "
          f"{res['lab']['layout'] if 'layout' in res['lab'] else 'no shaping'} layout:")
    for dim, r in res["dims"].items():
        link = r["link"] or "not shaped"
        frac = f" ({r['fraction_of_rate'] * 100:.1f}% of the configured rate)" if r["link"] else ""
        print(f"  {dim}: rank 0 -> rank {r['peer']} over {link}: {r['goodput_mbit_s']:.2f} Mbit/s of payload{frac}; "
              f"{r['bytes'] / 1e6:.1f} MB in {r['seconds']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


# A plain TCP sink and source (no torch: they start at once), run inside lab namespaces by linktest_dims.
_TCP_SINK = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 29600))
s.listen(1)
s.settimeout(TIMEOUT)
print("ready", flush=True)
c, _ = s.accept()
c.settimeout(TIMEOUT)
while c.recv(1 << 16):
    pass
c.sendall(b"k")
"""

_TCP_SOURCE = """
import socket, sys, time
buf = b"x" * (1 << 16)
c = socket.create_connection((sys.argv[1], 29600), timeout=TIMEOUT)
t0 = time.perf_counter()
left = int(sys.argv[2])
while left > 0:
    c.sendall(buf[:min(left, len(buf))])
    left -= len(buf)
c.shutdown(socket.SHUT_WR)
assert c.recv(1) == b"k"
print(time.perf_counter() - t0, flush=True)
"""


def tcp_transfer(lab: Any, src: int, dst: int, nbytes: int, timeout: float = 60.0) -> float:
    """Seconds one TCP connection takes to move ``nbytes`` from rank ``src`` to rank ``dst`` of a started
    :class:`~qwire.netlab.lab.Lab` (until the receiver has them all); bounded by ``timeout``."""
    t = f"{timeout:g}"
    sink = lab.popen(dst, [sys.executable, "-c", _TCP_SINK.replace("TIMEOUT", t)], stdout=subprocess.PIPE,
                     text=True)
    try:
        ready = sink.stdout.readline().strip() if sink.stdout else ""
        if ready != "ready":
            raise RuntimeError(f"the TCP sink in rank {dst}'s namespace did not start")
        source = lab.popen(src, [sys.executable, "-c", _TCP_SOURCE.replace("TIMEOUT", t), lab.addresses[dst],
                                 str(nbytes)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = source.communicate(timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the transfer from rank {src} to rank {dst} did not finish in {timeout:g} s") from None
        if source.returncode != 0:
            raise RuntimeError(f"the transfer from rank {src} to rank {dst} failed: {err[-2000:]}")
        return float(out.strip())
    finally:
        lab.stop_processes()


def _lab_links_only(specs: dict[str, Any]) -> None:
    """linktest measures links of the network lab: a ``mode=sim`` spec (a training run's simulated link, which
    linktest would otherwise have measured as a lab link without a word) is refused."""
    for option, spec in specs.items():
        if spec is not None and spec.mode == "sim":
            raise ValueError(f"linktest measures a link of the network lab, and {option} {spec} asks for the "
                             "simulated one, which only a training run has (qwire netlab "
                             "compare measures a run over both): drop mode=sim")


def linktest_dims(stages: int = 2, tp: int = 1, dp: int = 1, link: str = "", link_pp: str = "", link_tp: str = "",
                  link_dp: str = "", mbytes: float | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """A lab of ``stages * tp * dp`` ranks with a link per dimension (:func:`qwire.netlab.spec.pair_links`);
    for each dimension with more than one rank, rank 0 sends ``mbytes`` (default: about 3 s at that link's
    rate, at most 50 MB; 50 MB when unshaped) to its first neighbour in that dimension over one TCP
    connection. Returns per dimension the peer, its link and the achieved payload rate.

    Raises:
        LabUnavailable: the lab cannot run here. ``RuntimeError``: a transfer failed or timed out.
    """
    from qwire.netlab.lab import Lab, LabUnavailable, lab_unavailable_reason
    from qwire.netlab.spec import dim_links, pair_links

    sizes = {"pp": stages, "tp": tp, "dp": dp}
    own = {"pp": link_pp, "tp": link_tp, "dp": link_dp}
    _lab_links_only({f"--link-{d}" if own[d] else "--link": spec
                     for d, spec in dim_links(link, link_pp, link_tp, link_dp).items()})
    pairs = pair_links(stages, tp, dp, link=link, link_pp=link_pp, link_tp=link_tp, link_dp=link_dp)
    if not any(pairs.values()):
        raise ValueError("linktest: no dimension with more than one rank has a link")
    if mbytes is not None and not 0 < mbytes <= MAX_MBYTES:
        raise ValueError(f"--mbytes must be in (0, {MAX_MBYTES:g}], got {mbytes:g}")
    _check_timeout(timeout)
    reason = lab_unavailable_reason()
    if reason:
        raise LabUnavailable(reason)
    stride = {"tp": 1, "pp": tp, "dp": stages * tp}   # rank = (dp_rank * stages + pp_rank) * tp + tp_rank
    dims: dict[str, Any] = {}
    with Lab(stages * tp * dp, pairs=pairs) as lab:
        for dim in ("pp", "tp", "dp"):
            if sizes[dim] < 2:
                continue
            peer = stride[dim]
            spec = pairs[(0, peer)]
            mb = mbytes or (default_mbytes(spec.rate_bits_per_s) if spec else LINKTEST_MAX_MBYTES)
            nbytes = int(mb * 1e6)
            seconds = tcp_transfer(lab, 0, peer, nbytes, timeout)
            goodput = nbytes * 8 / seconds
            dims[dim] = {"peer": peer, "link": str(spec) if spec else "", "bytes": nbytes, "seconds": seconds,
                         "goodput_mbit_s": goodput / 1e6,
                         "fraction_of_rate": goodput / spec.rate_bits_per_s if spec else None}
        info = lab.describe()
    info.pop("commands", None)
    return {"world": stages * tp * dp, "sizes": sizes, "dims": dims, "lab": info}


def _split_links(text: str) -> list[str]:
    """``"20mbit,50mbit"`` or ``"20mbit,delay=5ms;50mbit"`` -> a list of link specs."""
    if ";" in text or "=" in text:
        return [p.strip() for p in text.split(";") if p.strip()]
    return [p.strip() for p in text.split(",") if p.strip()]


def _check_timeout(timeout: float) -> None:
    """A link test's ``--timeout``: seconds, more than none and at most a qwire run's longest wait."""
    from qwire.config import MAX_WAIT_S

    if not 0 < timeout <= MAX_WAIT_S:
        raise ValueError(f"--timeout must be > 0 seconds and at most {MAX_WAIT_S} (30 days), got {timeout:g}")


# a transfer shorter than this many times the tbf's burst and queue measures them more than the rate
SMALL_TRANSFER = 5


def default_mbytes(rate_bits_per_s: float) -> float:
    """linktest's transfer when --mbytes is not given: about ``LINKTEST_SECONDS`` at the rate, at most
    ``LINKTEST_MAX_MBYTES``; but at least ``SMALL_TRANSFER`` times the tbf's burst and queue, which leave at the
    line's speed (from about 1.6 gbit on), as far as ``MAX_MBYTES`` allows."""
    from qwire.netlab.lab import tbf_params

    burst, limit = tbf_params(rate_bits_per_s)
    timed = min(LINKTEST_MAX_MBYTES, max(1.0, rate_bits_per_s / 8 * LINKTEST_SECONDS / 1e6))
    return min(MAX_MBYTES, max(timed, math.ceil(SMALL_TRANSFER * (burst + limit) / 1e5) / 10))


def small_transfer_note(res: dict[str, Any]) -> str:
    """A note for a :func:`linktest` result whose transfer was too short to measure the rate, else ""."""
    queued = res["tbf_burst_bytes"] + res["tbf_limit_bytes"]
    if res["bytes"] >= SMALL_TRANSFER * queued:
        return ""
    head = (f"note: {res['bytes'] / 1e6:g} MB is not much more than the tbf's burst and queue ({queued / 1e3:.0f} "
            "kB), which leave at the line's speed, so the rate above over-states the link")
    need = math.ceil(SMALL_TRANSFER * queued / 1e5) / 10  # MB, rounded up: that much is enough
    if need > MAX_MBYTES:
        return f"{head}; at this rate even the most linktest sends ({MAX_MBYTES:g} MB) is too little to measure it"
    return f"{head}; give --mbytes {need:g} or more (or leave it out: the default is long enough)"


def linktest(link: str, mbytes: float | None = None, timeout: float = 120.0) -> dict[str, Any]:
    """Two ranks in a lab behind ``link``: median RTT of small messages, then rank 0 sends
    ``mbytes`` to rank 1 with gloo; returns the achieved payload rate and the RTT.

    Bounded: at most ``MAX_MBYTES`` megabytes and ``timeout`` seconds (then the ranks are killed).

    Raises:
        LabUnavailable: the lab cannot run here. ``RuntimeError``: the test failed or timed out.
    """
    from qwire.netlab.lab import Lab, LabUnavailable, lab_unavailable_reason
    from qwire.netlab.simulated import wire_bytes

    spec = parse_link(link)
    _lab_links_only({"--link": spec})
    if mbytes is None:
        mbytes = default_mbytes(spec.rate_bits_per_s)
    if not 0 < mbytes <= MAX_MBYTES:
        raise ValueError(f"--mbytes must be in (0, {MAX_MBYTES:g}], got {mbytes:g}")
    _check_timeout(timeout)
    nbytes = int(mbytes * 1e6)
    reason = lab_unavailable_reason()
    if reason:
        raise LabUnavailable(reason)
    with Lab(2, spec) as lab:
        code = "from qwire.netlab.cli import _linktest_rank; _linktest_rank()"
        procs = []
        for k in range(2):
            env = {"RANK": str(k), "WORLD_SIZE": "2", "MASTER_ADDR": lab.addresses[0], "MASTER_PORT": "29500",
                   "GLOO_SOCKET_IFNAME": lab.ifname, "QWIRE_LINKTEST_BYTES": str(nbytes),
                   "QWIRE_LINKTEST_TIMEOUT": str(timeout)}
            procs.append(lab.popen(k, [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout + 30  # start-up (importing torch) on top of the transfer
        outs = []
        for k, p in enumerate(procs):
            try:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                lab.stop_processes()
                raise RuntimeError(f"linktest rank {k} did not finish in {timeout + 30:.0f} s") from None
        for k, p in enumerate(procs):
            if p.returncode != 0:
                raise RuntimeError(f"linktest rank {k} failed (exit {p.returncode}):\n{outs[k][1][-3000:]}")
        res = json.loads(outs[0][0].strip().splitlines()[-1])
        shaping = lab.describe()
    seconds = res["seconds"]
    goodput = nbytes * 8 / seconds
    frames = wire_bytes(CHUNK) / CHUNK
    return {"link": str(spec), "rate_mbit_s": spec.rate_bits_per_s / 1e6, "bytes": nbytes, "seconds": seconds,
            "goodput_mbit_s": goodput / 1e6, "wire_mbit_s": goodput * frames / 1e6,
            "fraction_of_rate": goodput / spec.rate_bits_per_s, "rtt_ms": res["rtt_s"] * 1e3,
            "rtt_min_ms": res["rtt_min_s"] * 1e3, "shaping": shaping["shaping"],
            "tbf_burst_bytes": shaping["tbf_burst_bytes"], "tbf_limit_bytes": shaping["tbf_limit_bytes"]}


def _linktest_rank() -> None:
    """One rank of the link test (run inside a lab namespace by :func:`linktest`)."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    nbytes = int(os.environ["QWIRE_LINKTEST_BYTES"])
    timeout = float(os.environ["QWIRE_LINKTEST_TIMEOUT"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout))
    peer = 1 - rank
    small = torch.zeros(1)
    rtts = []
    for i in range(PINGS + 3):  # round trips of a 4-byte message; the first 3 warm up
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(small, peer)
            dist.recv(small, peer)
        else:
            dist.recv(small, peer)
            dist.send(small, peer)
        if i >= 3:
            rtts.append(time.perf_counter() - t0)
    buf = torch.zeros(CHUNK // 4)
    warm = torch.zeros(min(CHUNK, max(1, nbytes // 20)) // 4 + 1)  # open the congestion window a little first
    (dist.send if rank == 0 else dist.recv)(warm, peer)
    dist.barrier()
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        n = min(CHUNK, left)
        t = buf[: (n + 3) // 4]
        (dist.send if rank == 0 else dist.recv)(t, peer)
        left -= n
    (dist.recv if rank == 0 else dist.send)(small, peer)  # the receiver's "got it all"
    elapsed = time.perf_counter() - t0
    rtt = statistics.median(rtts)
    if rank == 0:
        # elapsed = transfer + last byte's one-way trip + the ack's: take one RTT off
        print(json.dumps({"seconds": max(elapsed - rtt, 1e-9), "raw_seconds": elapsed, "rtt_s": rtt,
                          "rtt_min_s": min(rtts)}), flush=True)
    dist.destroy_process_group()
