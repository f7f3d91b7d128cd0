"""``qwire netlab``: list and clean leftover lab namespaces, and measure a lab link.

::

    qwire netlab list                       # qwire namespaces on this machine and their owners
    qwire netlab clean [--all]              # remove those whose owner is gone (--all: every one)
    qwire netlab linktest --link 100mbit    # 2 ranks, gloo send/recv: achieved Mbit/s and RTT
    qwire netlab compare --links 20mbit,100mbit -- --stages 2 --fwd-codec fp32   # lab vs simulated tokens/s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qwire.netlab.spec import parse_link

__all__ = ["add_arguments", "run", "linktest"]

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
    lt.add_argument("--link", required=True, help="link spec, e.g. 100mbit or 50mbit,delay=10ms")
    lt.add_argument("--mbytes", type=float, default=None,
                    help=f"megabytes to send (default: about {LINKTEST_SECONDS:g} s at the link rate, at most "
                         f"{LINKTEST_MAX_MBYTES:g})")
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
        res = linktest(args.link, mbytes=args.mbytes, timeout=args.timeout)
        print(f"link {res['link']}: {res['goodput_mbit_s']:.2f} Mbit/s of payload "
              f"({res['fraction_of_rate'] * 100:.1f}% of the configured {res['rate_mbit_s']:g} Mbit/s; "
              f"{res['wire_mbit_s']:.2f} Mbit/s with TCP/IP framing), RTT {res['rtt_ms']:.3f} ms "
              f"(min {res['rtt_min_ms']:.3f}); {res['bytes'] / 1e6:.1f} MB in {res['seconds']:.2f} s")
        if res["shaping"].get("delay") == "simulated":
            print("note: this kernel has no netem qdisc, so the link's delay/jitter is not on the wire here "
                  "(qwire train simulates it at the pipeline boundary); the numbers above are without it")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return 0
    except (ValueError, LabError, RuntimeError) as e:
        print(f"qwire netlab: error: {e}", file=sys.stderr)
        return 1


def _split_links(text: str) -> list[str]:
    """``"20mbit,50mbit"`` or ``"20mbit,delay=5ms;50mbit"`` -> a list of link specs."""
    if ";" in text or "=" in text:
        return [p.strip() for p in text.split(";") if p.strip()]
    return [p.strip() for p in text.split(",") if p.strip()]


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
    if mbytes is None:
        mbytes = min(LINKTEST_MAX_MBYTES, max(1.0, spec.rate_bits_per_s / 8 * LINKTEST_SECONDS / 1e6))
    if not 0 < mbytes <= MAX_MBYTES:
        raise ValueError(f"--mbytes must be in (0, {MAX_MBYTES:g}], got {mbytes:g}")
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
