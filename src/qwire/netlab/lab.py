"""The network lab: every rank in its own network namespace, joined by shaped veth links.

Topology of one lab (``<id>`` is 6 random hex digits, unique per lab)::

    qw<id>r0 [qwlink 10.a.b.1/24] --veth-- [r0]                  (tc on qwlink egress)
    qw<id>r1 [qwlink 10.a.b.2/24] --veth-- [r1]  bridge qwbr in qw<id>br
    ...

* Each rank namespace has ``lo`` and one interface ``qwlink`` whose **egress**
  (the rank's uplink) is shaped with ``tc``: ``tbf`` for the rate and, when
  the link asks for delay, jitter or loss, ``netem`` in front of it
  (``netem`` root, ``tbf`` as its child, the layout of the netem
  documentation). Downlinks are not shaped, so a rank receiving from two
  neighbours is limited by their uplinks only.
* Different links to different peers (``Lab(n, pairs={(src, dst): spec})``,
  e.g. slow pipeline links and fast tensor-parallel ones): each uplink gets
  an ``htb`` root with one class per distinct link of that rank, each class
  with the same ``tbf`` (or ``netem`` + ``tbf``) as its only child, and
  ``u32`` filters sending each peer's address to its class; peers without a
  link go to the default class, which does not limit. The ``htb`` classes
  themselves never limit (rate :data:`HTB_RATE`, explicit ``quantum``, so
  ``htb`` does not warn about ``r2q``): the rate is the ``tbf``'s, as with one
  link. When every pair has the same link the single-``tbf`` layout is used.
* The bridge lives in its own namespace, so nothing is added to the host's
  network: addresses exist only inside the lab's namespaces. The /24 is picked
  at random per lab among ``10.128.0.0/9`` (skipping subnets in use by other
  labs or the host), so that two labs are easy to tell apart.
* Kernels without ``netem`` (``CONFIG_NET_SCH_NETEM``): the rate is still
  shaped by ``tbf``; loss is done by ``nft`` rules in the bridge namespace
  (random drops of each rank's packets, per destination address when the
  links differ by peer) if the ``nft`` tool exists; delay and
  jitter are then left to the simulated link inside the workers
  (:attr:`Lab.simulated_delay`), and the launcher says so.

``tbf`` settings (:func:`tbf_params`): ``burst`` = max(10 full frames, 1 ms at
the rate), so the link never bursts much above its rate; queue ``limit`` =
burst + max(50 ms at the rate, 100 full frames), about what a switch port
holds. TCP's own pacing keeps the queue short; a tail-drop here is the loss
TCP uses to find the rate. Measured with ``qwire netlab linktest``, payload
goodput is about 95.5% of the configured rate (the TCP/IP/Ethernet framing,
66 bytes per 1448-byte segment).

Teardown (``close``, ``__exit__``, an ``atexit`` hook and SIGINT/SIGTERM/SIGHUP
handlers) kills the processes the lab started and deletes its namespaces,
which removes their interfaces with them. A lab killed with SIGKILL leaves its
namespaces behind: ``qwire netlab list`` shows them, ``qwire netlab clean``
removes those whose owner process is gone.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from qwire.netlab.spec import LinkSpec, parse_link
from qwire.procs import die_with_parent

__all__ = ["Lab", "LabError", "LabUnavailable", "LabInfo", "lab_unavailable_reason", "list_labs", "clean_labs",
           "tbf_params", "peer_classes", "enter_namespace", "in_namespace", "signal_session", "IFNAME", "HTB_RATE",
           "HTB_QUANTUM"]

T = TypeVar("T")

IFNAME = "qwlink"          # each rank's interface, inside its namespace
BRIDGE = "qwbr"            # the bridge, inside the bridge namespace
PREFIX = "qw"
NS_RE = re.compile(rf"^{PREFIX}(?P<id>[0-9a-f]{{6}})(?:br|r(?P<rank>\d+))$")
NETNS_ETC = Path("/etc/netns")  # per-namespace files that `ip netns exec` mounts over /etc
NETNS_RUN = (Path("/run/netns"), Path("/var/run/netns"))  # where `ip netns add` names a namespace
FRAME = 1514               # bytes tc counts for one full-size frame (1500 MTU + Ethernet header)
CMD_TIMEOUT = 30.0         # seconds any single ip/tc/nft command may take
KILL_GRACE = 3.0           # seconds between SIGTERM and SIGKILL when stopping lab processes
HTB_RATE = "100gbit"       # rate of every htb class: never the limit (the tbf below a class is)
HTB_BURST = 1 << 20        # bytes: htb's own bucket, large so that it never holds a packet back
HTB_QUANTUM = 65536        # bytes per round between htb classes (>= one GSO packet); explicit, so no r2q warning


MAX_RANKS = 254  # the lab's ranks share one /24


def state_dir() -> Path:
    """Where the labs' state files are (``QWIRE_NETLAB_STATE``, read when asked)."""
    return Path(os.environ.get("QWIRE_NETLAB_STATE", "/run/qwire-netlab"))


class LabError(RuntimeError):
    """A network-lab command failed."""


class LabUnavailable(LabError):
    """The network lab cannot run here (not root, no iproute2, namespaces not permitted)."""


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        p = Path(d) / name
        if p.exists() and os.access(p, os.X_OK):
            return str(p)
    return None


def lab_unavailable_reason() -> str | None:
    """Why the lab cannot run on this machine, or None if it should (not yet tried)."""
    if not sys.platform.startswith("linux"):
        return "the network lab needs Linux (network namespaces and tc)"
    if os.geteuid() != 0:
        return "the network lab needs root (it creates network namespaces and runs tc); run as root or use sudo"
    for tool in ("ip", "tc"):
        if _tool(tool) is None:
            return f"'{tool}' was not found; install iproute2 (apt-get install iproute2)"
    return None


def tbf_params(rate_bits_per_s: float) -> tuple[int, int]:
    """``(burst, limit)`` in bytes for a ``tbf`` at this rate (see the module docstring)."""
    rate_bytes = rate_bits_per_s / 8
    burst = max(10 * FRAME, int(rate_bytes * 1e-3))
    limit = burst + max(100 * FRAME, int(rate_bytes * 0.05))
    return burst, limit


def peer_classes(n_ranks: int, pairs: dict[tuple[int, int], LinkSpec | None]) -> list[list[tuple[LinkSpec, list[int]]]]:
    """Per rank, the distinct links of its uplink and the peers behind each: ``classes[src]`` is a list of
    ``(link, [dst, ...])``, slowest link first; peers whose pair has no link (None, or missing) are in no
    class (the default, unshaped one)."""
    out: list[list[tuple[LinkSpec, list[int]]]] = []
    for src in range(n_ranks):
        groups: dict[LinkSpec, list[int]] = {}
        for dst in range(n_ranks):
            spec = pairs.get((src, dst)) if dst != src else None
            if spec is not None:
                groups.setdefault(spec, []).append(dst)
        out.append(sorted(groups.items(), key=lambda kv: (kv[0].rate_bits_per_s, -kv[0].delay_s,
                                                          -kv[0].loss_frac, -kv[0].jitter_s, str(kv[0]))))
    return out


def _run(argv: Sequence[str], check: bool = True, timeout: float = CMD_TIMEOUT,
         input: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input)
    except FileNotFoundError as e:
        raise LabUnavailable(f"'{argv[0]}' was not found; install iproute2") from e
    except subprocess.TimeoutExpired as e:
        raise LabError(f"'{' '.join(argv)}' did not finish in {timeout:.0f} s") from e
    if check and res.returncode != 0:
        raise LabError(f"'{' '.join(argv)}' failed: {(res.stderr or res.stdout).strip()}")
    return res


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run([_tool("ip") or "ip", *args], check=check)


def _netns_list() -> list[str]:
    res = _ip("netns", "list", check=False)
    return [ln.split()[0] for ln in res.stdout.splitlines() if ln.strip()]


def pid_start(pid: int) -> str | None:
    """The start time of a process (field 22 of /proc/PID/stat), to tell a live owner from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@dataclass
class LabInfo:
    """A lab found on this machine (for ``qwire netlab list`` / ``clean``)."""

    id: str
    namespaces: list[str]
    owner_pid: int | None
    alive: bool
    link: str
    subnet: str
    created: float | None

    def describe(self) -> str:
        owner = (f"owner pid {self.owner_pid} {'running' if self.alive else 'gone'}" if self.owner_pid
                 else "no owner record")
        when = time.strftime(" created %Y-%m-%d %H:%M:%S", time.localtime(self.created)) if self.created else ""
        link = f" link {self.link}" if self.link else ""
        subnet = f" {self.subnet}" if self.subnet else ""
        return f"qw{self.id}: {len(self.namespaces)} namespaces ({', '.join(self.namespaces)}),{link}{subnet}, " \
               f"{owner}{when}"


class Lab:
    """Network namespaces for ``n_ranks`` ranks joined by a bridge, each uplink shaped to ``link``,
    or, with ``pairs``, the traffic from rank ``src`` to rank ``dst`` shaped to ``pairs[(src, dst)]``.

    Use as a context manager::

        with Lab(2, "100mbit,delay=10ms") as lab:
            p = lab.popen(0, [sys.executable, "-c", "..."], env={...})
            ...
        # every namespace (and its interfaces and processes) is gone here

        with Lab(4, pairs=pair_links(2, 1, 2, link_pp="20mbit", link_dp="200mbit")) as lab:
            ...   # rank 0 -> 1 at 20 mbit, rank 0 -> 2 at 200 mbit

    Attributes (after entering): ``id``, ``namespaces`` (one per rank),
    ``bridge_ns``, ``addresses`` (rank -> IPv4 address), ``ifname``,
    ``link`` (the one link of every pair, or None), ``pairs`` (the per-pair
    links when they differ, else None), ``classes`` (:func:`peer_classes`),
    ``shaping`` (what does rate/delay/loss: ``tbf``, ``netem``, ``nft`` or
    ``simulated``), ``netem`` (whether the kernel's netem did delay/loss) and
    ``simulated_delay`` (True when delay/jitter must be added by the simulated
    link in the workers because the kernel lacks netem).
    """

    def __init__(self, n_ranks: int, link: LinkSpec | str | None = None,
                 pairs: dict[tuple[int, int], LinkSpec | str | None] | None = None) -> None:
        if n_ranks < 1:
            raise ValueError(f"a lab needs at least one rank, got {n_ranks}")
        if n_ranks > MAX_RANKS:
            raise ValueError(f"a lab holds at most {MAX_RANKS} ranks (one /24 subnet: addresses .1 to .254), got "
                             f"{n_ranks}; run fewer ranks, or the simulated link (mode=sim)")
        self.n = n_ranks
        self.link = parse_link(link) if link else None
        self.pairs: dict[tuple[int, int], LinkSpec | None] | None = None
        if pairs is not None:
            if link:
                raise ValueError("give a Lab either one link or per-pair links, not both")
            full: dict[tuple[int, int], LinkSpec | None] = {}
            for (a, b), spec in pairs.items():
                if not (0 <= a < n_ranks and 0 <= b < n_ranks) or a == b:
                    raise ValueError(f"pair ({a}, {b}) is not a pair of two of the lab's {n_ranks} ranks")
                full[(a, b)] = replace(parse_link(spec), mode="auto") if spec else None
            full = {(a, b): full.get((a, b)) for a in range(n_ranks) for b in range(n_ranks) if a != b}
            values = set(full.values())
            if len(values) == 1 and None not in values:
                self.link = values.pop()       # the same link everywhere: one tbf per uplink
            elif values - {None}:
                self.pairs = full              # htb + per-destination classes
        self.classes = peer_classes(n_ranks, self.pairs) if self.pairs is not None else []
        self.netem = False
        self.id = ""
        self.namespaces: list[str] = []
        self.bridge_ns = ""
        self.addresses: list[str] = []
        self.subnet = ""
        self.ifname = IFNAME
        self.shaping: dict[str, str] = {}
        self.simulated_delay = False
        self.commands: list[str] = []
        self.rate_changes: list[dict[str, Any]] = []   # set_rate() calls: time and new rate
        self._tbfs: list[tuple[str, list[str], float]] = []  # (namespace, where in the qdisc tree, rate)
        self._procs: list[subprocess.Popen[Any]] = []
        self._created: list[str] = []
        self._closed = False
        self._old_handlers: dict[int, Any] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Lab:
        if not self.id:  # `with Lab(...).start() as lab` is fine too
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Lab:
        """Create the namespaces, bridge, veth pairs, addresses and shaping."""
        if self.id:
            raise LabError(f"lab qw{self.id} was already started")
        reason = lab_unavailable_reason()
        if reason:
            raise LabUnavailable(reason)
        existing = set(_netns_list())
        used_ids = {m.group("id") for m in map(NS_RE.match, existing) if m}
        while True:
            self.id = f"{random.SystemRandom().getrandbits(24):06x}"
            if self.id not in used_ids:
                break
        self.bridge_ns = f"{PREFIX}{self.id}br"
        self.namespaces = [f"{PREFIX}{self.id}r{k}" for k in range(self.n)]
        self.subnet = self._pick_subnet()
        net = ipaddress.ip_network(self.subnet)
        self.addresses = [str(net.network_address + k + 1) for k in range(self.n)]
        self._write_state()
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop the lab's processes and delete its namespaces (idempotent, never raises)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        masked = _ignore_signals()  # a second Ctrl-C must not interrupt the teardown
        try:
            self.stop_processes()
        finally:
            try:
                for ns in reversed(self._created):
                    _kill_ns_pids(ns)  # processes the lab did not start (ranks that entered it themselves)
                    _ip("netns", "del", ns, check=False)
                    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
                if self._created:
                    present = set(_netns_list())
                    for ns in (ns for ns in self._created if ns in present):
                        _kill_ns_pids(ns)  # processes we did not start may still be inside
                        _ip("netns", "del", ns, check=False)
                self._created.clear()
                try:
                    (state_dir() / f"{self.id}.json").unlink()
                except OSError:
                    pass
            finally:
                for sig, handler in masked.items():
                    signal.signal(sig, handler)
                self._restore_signal_handlers()
                atexit.unregister(self.close)

    # ------------------------------------------------------------------ running things inside
    def netns_file(self, rank: int) -> str:
        """The file that names rank ``rank``'s namespace (what :func:`enter_namespace` enters)."""
        ns = self.namespaces[rank]
        for d in NETNS_RUN:
            if (d / ns).exists():
                return str(d / ns)
        raise LabError(f"namespace {ns} of rank {rank} has no file under {' or '.join(map(str, NETNS_RUN))}: "
                       "was the lab closed?")

    def exec_prefix(self, rank: int) -> list[str]:
        """The argv prefix that runs a command in rank ``rank``'s namespace."""
        return [_tool("ip") or "ip", "netns", "exec", self.namespaces[rank]]

    def popen(self, rank: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in rank ``rank``'s namespace (own session, killed if this process dies).

        ``env`` is added to this process's environment. The process is stopped by :meth:`close`.
        """
        full_env = dict(os.environ)
        full_env.update(env or {})
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen([*self.exec_prefix(rank), *argv], env=full_env, preexec_fn=die_with_parent, **kwargs)
        self._procs.append(p)
        return p

    def stop_processes(self) -> None:
        """SIGTERM, then SIGKILL after a grace period, every process started with :meth:`popen`."""
        alive = [p for p in self._procs if p.poll() is None]
        for p in alive:
            signal_session(p, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_session(p, signal.SIGKILL)
                try:
                    p.wait(timeout=KILL_GRACE)
                except subprocess.TimeoutExpired:
                    pass

    def set_rate(self, rate_bits_per_s: float) -> None:
        """Change the rate of every shaped link of the running lab (``tc qdisc change`` on each ``tbf``;
        delay and loss stay as they are). Traffic in flight is not interrupted: packets already queued
        leave at the new rate."""
        if not self.id or self._closed:
            raise LabError("set_rate needs a started, open lab")
        if not self._tbfs:
            raise LabError("this lab shapes no link, so there is no rate to change")
        new = LinkSpec(rate_bits_per_s)
        tc = _tool("tc") or "tc"
        for i, (ns, where, _) in enumerate(self._tbfs):
            self._cmd(_tool("ip") or "ip", "netns", "exec", ns, tc, "qdisc", "change", "dev", IFNAME, *where,
                      *_tbf_args(new))
            self._tbfs[i] = (ns, where, rate_bits_per_s)
        if self.link is not None:
            self.link = replace(self.link, rate_bits_per_s=rate_bits_per_s)
        self.rate_changes.append({"time": time.time(), "rate_bits_per_s": rate_bits_per_s})

    def describe(self) -> dict[str, Any]:
        """What this lab is, for run directories and reports.

        With per-pair links, ``link`` is empty and ``classes`` lists, per rank, the ``htb`` classes of its
        uplink: ``{"classid", "link", "peers", "tbf_burst_bytes", "tbf_limit_bytes"}`` (peers in no class
        go through the unshaped default class ``1:1``).
        """
        burst, limit = tbf_params(self.link.rate_bits_per_s) if self.link else (0, 0)
        if self.pairs is not None:
            burst = limit = None  # one per class, below
        out: dict[str, Any] = {
            "mode": "lab", "id": self.id, "link": str(self.link) if self.link else "",
            "namespaces": self.namespaces, "bridge_namespace": self.bridge_ns, "addresses": self.addresses,
            "interface": self.ifname, "shaping": self.shaping, "tbf_burst_bytes": burst, "tbf_limit_bytes": limit,
            "simulated_delay": self.simulated_delay}
        if self.pairs is not None:
            out["layout"] = "htb"
            out["classes"] = [
                {"rank": src, "default_class": "1:1",
                 "unshaped_peers": [d for d in range(self.n) if d != src and self.pairs[(src, d)] is None],
                 "classes": [{"classid": _classid(i), "link": str(spec), "peers": peers,
                              "tbf_burst_bytes": tbf_params(spec.rate_bits_per_s)[0],
                              "tbf_limit_bytes": tbf_params(spec.rate_bits_per_s)[1]}
                             for i, (spec, peers) in enumerate(self.classes[src])]}
                for src in range(self.n)]
        elif self.link is not None:
            out["layout"] = "tbf"
        out["commands"] = self.commands
        return out

    def link_description(self) -> str:
        """``100mbit`` (one link), ``per-peer: 20mbit, 200mbit``, or empty (no shaping)."""
        if self.pairs is not None:
            distinct = sorted({s for s in self.pairs.values() if s is not None}, key=lambda s: s.rate_bits_per_s)
            return "per-peer: " + ", ".join(map(str, distinct))
        return str(self.link) if self.link else ""

    # ------------------------------------------------------------------ building
    def _cmd(self, *args: str) -> None:
        self.commands.append(" ".join(args))
        _run(args)

    def _ns_add(self, ns: str) -> None:
        res = _ip("netns", "add", ns, check=False)
        if res.returncode != 0:
            msg = (res.stderr or res.stdout).strip()
            hint = ("; making network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN; in a container, "
                    "--privileged or those capabilities), or use the simulated link (mode=sim)"
                    if "not permitted" in msg.lower() else "")
            raise LabUnavailable(f"cannot create network namespace {ns}: {msg}{hint}")
        self._created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _build(self) -> None:
        ip = _tool("ip") or "ip"
        self._ns_add(self.bridge_ns)
        self._cmd(ip, "-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge", "forward_delay", "0",
                  "stp_state", "0")
        self._cmd(ip, "-n", self.bridge_ns, "link", "set", BRIDGE, "up")
        for k, ns in enumerate(self.namespaces):
            self._ns_add(ns)
            port = f"r{k}"
            self._cmd(ip, "-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", IFNAME,
                      "netns", ns)
            self._cmd(ip, "-n", self.bridge_ns, "link", "set", port, "master", BRIDGE)
            self._cmd(ip, "-n", self.bridge_ns, "link", "set", port, "up")
            self._cmd(ip, "-n", ns, "addr", "add", f"{self.addresses[k]}/24", "dev", IFNAME)
            self._cmd(ip, "-n", ns, "link", "set", IFNAME, "up")
        self._write_hosts()
        if self.pairs is not None:
            self._shape_per_peer()
        elif self.link is not None:
            self._shape()

    def _write_hosts(self) -> None:
        """Name the lab's addresses in /etc/netns/<ns>/hosts (``ip netns exec`` mounts it over /etc/hosts),
        so reverse lookups of peers (gloo and c10d do them) answer at once instead of asking a DNS server
        the namespace cannot reach."""
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        for a, ns in zip(self.addresses, self.namespaces):
            lines += [f"{a} {ns}", f"::ffff:{a} {ns}"]  # servers listening on :: see peers as mapped addresses
        for ns in self.namespaces:
            try:
                d = NETNS_ETC / ns
                d.mkdir(parents=True, exist_ok=True)
                (d / "hosts").write_text("\n".join(lines) + "\n")
            except OSError:
                pass  # only cosmetic: lookups then fail (quickly) and c10d logs a warning

    def _shape(self) -> None:
        link = self.link
        assert link is not None
        tc = _tool("tc") or "tc"
        self.shaping = {"rate": "tbf"}
        use_netem = link.needs_netem and self._has_netem()
        for ns in self.namespaces:
            pre = [_tool("ip") or "ip", "netns", "exec", ns, tc, "qdisc", "add", "dev", IFNAME]
            if use_netem:
                self._cmd(*pre, "root", "handle", "1:", *_netem_args(link))
                self._cmd(*pre, "parent", "1:1", "handle", "10:", *_tbf_args(link))
                self._tbfs.append((ns, ["parent", "1:1", "handle", "10:"], link.rate_bits_per_s))
            else:
                self._cmd(*pre, "root", "handle", "1:", *_tbf_args(link))
                self._tbfs.append((ns, ["root", "handle", "1:"], link.rate_bits_per_s))
        self._finish_shaping({link}, use_netem)

    def _shape_per_peer(self) -> None:
        """htb root, one class per distinct link of each uplink (tbf, or netem + tbf, below it), u32 filters."""
        assert self.pairs is not None
        tc = _tool("tc") or "tc"
        specs = {s for s in self.pairs.values() if s is not None}
        self.shaping = {"rate": "tbf", "classify": "htb+u32"}
        use_netem = any(s.needs_netem for s in specs) and self._has_netem()
        htb = ["htb", "rate", HTB_RATE, "ceil", HTB_RATE, "burst", str(HTB_BURST), "cburst", str(HTB_BURST),
               "quantum", str(HTB_QUANTUM)]
        for k, ns in enumerate(self.namespaces):
            pre = [_tool("ip") or "ip", "netns", "exec", ns, tc]
            self._cmd(*pre, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", "htb", "default", "1")
            self._cmd(*pre, "class", "add", "dev", IFNAME, "parent", "1:", "classid", "1:1", *htb)
            for i, (spec, peers) in enumerate(self.classes[k]):
                classid = _classid(i)
                handle = classid.split(":")[1]  # class 1:10 -> its qdisc 10: (and 11: below a netem)
                self._cmd(*pre, "class", "add", "dev", IFNAME, "parent", "1:", "classid", classid, *htb)
                if use_netem and spec.needs_netem:
                    self._cmd(*pre, "qdisc", "add", "dev", IFNAME, "parent", classid, "handle", f"{handle}:",
                              *_netem_args(spec))
                    where = ["parent", f"{handle}:1", "handle", f"{int(handle, 16) + 1:x}:"]
                else:
                    where = ["parent", classid, "handle", f"{handle}:"]
                self._cmd(*pre, "qdisc", "add", "dev", IFNAME, *where, *_tbf_args(spec))
                self._tbfs.append((ns, where, spec.rate_bits_per_s))
                for dst in peers:
                    self._cmd(*pre, "filter", "add", "dev", IFNAME, "parent", "1:", "protocol", "ip", "prio", "1",
                              "u32", "match", "ip", "dst", f"{self.addresses[dst]}/32", "flowid", classid)
        self._finish_shaping(specs, use_netem)

    def _finish_shaping(self, specs: set[LinkSpec], use_netem: bool) -> None:
        """Record what does delay and loss; loss with nft where there is no netem."""
        delay = any(s.delay_s for s in specs)
        loss = any(s.loss_frac for s in specs)
        self.netem = use_netem
        if use_netem:
            if delay:
                self.shaping["delay"] = "netem"
            if loss:
                self.shaping["loss"] = "netem"
            return
        if delay:
            self.simulated_delay = True
            self.shaping["delay"] = "simulated"
        if loss:
            worst = max(s.loss_frac for s in specs)
            if _tool("nft") is None:
                raise LabUnavailable(
                    f"loss={worst * 100:g}% needs the netem qdisc (not in this kernel) or nftables "
                    "(apt-get install nftables); install nftables or drop loss= from the link")
            self._nft_loss()
            self.shaping["loss"] = "nft"

    def _has_netem(self) -> bool:
        """Whether this kernel has the netem qdisc (tried on the first rank's loopback)."""
        tc = _tool("tc") or "tc"
        probe = [_tool("ip") or "ip", "netns", "exec", self.namespaces[0], tc, "qdisc"]
        res = _run([*probe, "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
        if res.returncode == 0:
            _run([*probe, "del", "dev", "lo", "root"], check=False)
            return True
        return False

    def _nft_loss(self) -> None:
        """Drop packets at the bridge (kernels without netem): with one link, ``loss`` of everything each
        rank sends; with per-pair links, ``loss`` of the pair's link for each (rank, destination address)."""
        rules = []
        if self.pairs is None:
            assert self.link is not None
            rules = [(f'iifname "r{k}"', self.link.loss_frac) for k in range(self.n)]
        else:
            rules = [(f'iifname "r{a}" ip daddr {self.addresses[b]}', spec.loss_frac)
                     for (a, b), spec in sorted(self.pairs.items()) if spec is not None and spec.loss_frac]
        # (the chain must not be called "fwd": that is an nft keyword, and the script would not parse)
        lines = ["table bridge qwloss {", "  chain qwdrop {", "    type filter hook forward priority 0; policy accept;"]
        for match, frac in rules:
            if frac:  # count what comes by, then drop a fraction of it: loss_counters() reports both
                lines += [f"    {match} counter",
                          f"    {match} numgen random mod 1000000 < {max(1, round(frac * 1_000_000))} counter drop"]
        lines += ["  }", "}"]
        script = "\n".join(lines) + "\n"
        self.commands.append(f"nft -f - <<< {script!r}")
        _run([_tool("ip") or "ip", "netns", "exec", self.bridge_ns, _tool("nft") or "nft", "-f", "-"], input=script)

    def loss_counters(self) -> dict[str, int] | None:
        """Packets (and bytes) the ``nft`` loss rules saw and dropped so far, over every rank; None where
        loss is not done by nft here or the counters cannot be read."""
        if self.shaping.get("loss") != "nft":
            return None
        res = _run([_tool("ip") or "ip", "netns", "exec", self.bridge_ns, _tool("nft") or "nft", "-j", "list",
                    "table", "bridge", "qwloss"], check=False)
        if res.returncode != 0:
            return None
        try:
            items = json.loads(res.stdout).get("nftables", [])
        except ValueError:
            return None
        out = {"seen_packets": 0, "seen_bytes": 0, "dropped_packets": 0, "dropped_bytes": 0}
        for it in items:
            expr = (it.get("rule") or {}).get("expr") or []
            counter = next((e["counter"] for e in expr if isinstance(e, dict) and "counter" in e), None)
            if counter is None:
                continue
            kind = "dropped" if any(isinstance(e, dict) and "drop" in e for e in expr) else "seen"
            out[f"{kind}_packets"] += int(counter.get("packets", 0))
            out[f"{kind}_bytes"] += int(counter.get("bytes", 0))
        return out

    def _pick_subnet(self) -> str:
        used: set[str] = set()
        for info in _read_states():
            if info.get("subnet"):
                used.add(info["subnet"])
        res = _ip("-o", "-4", "addr", "show", check=False)
        for m in re.finditer(r"inet (\d+\.\d+\.\d+)\.\d+/", res.stdout):
            used.add(f"{m.group(1)}.0/24")
        rng = random.SystemRandom()
        for _ in range(1000):
            subnet = f"10.{rng.randint(128, 255)}.{rng.randint(0, 255)}.0/24"
            if subnet not in used:
                return subnet
        raise LabError("no free 10.128.0.0/9 subnet for the lab")

    # ------------------------------------------------------------------ bookkeeping
    def _write_state(self) -> None:
        try:
            state_dir().mkdir(parents=True, exist_ok=True)
            state = {"id": self.id, "pid": os.getpid(), "pid_start": pid_start(os.getpid()),
                     "created": time.time(), "namespaces": [self.bridge_ns, *self.namespaces],
                     "subnet": self.subnet, "link": self.link_description()}
            (state_dir() / f"{self.id}.json").write_text(json.dumps(state))
        except OSError:
            pass  # bookkeeping only: list/clean then see the namespaces as having no owner record

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            try:
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, old)
            except (ValueError, OSError):
                pass
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Unwind through the `with` block (its __exit__ tears the lab down), then behave as the
        # signal would have: Ctrl-C is a KeyboardInterrupt, SIGTERM/SIGHUP exit with 128+signum.
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


def _classid(i: int) -> str:
    """The htb class of the ``i``-th link of an uplink: 1:10, 1:20, ... (minor ids are hex)."""
    return f"1:{(i + 1) * 0x10:x}"


def _tbf_args(link: LinkSpec) -> list[str]:
    burst, limit = tbf_params(link.rate_bits_per_s)
    return ["tbf", "rate", link.tc_rate(), "burst", str(burst), "limit", str(limit)]


def _netem_args(link: LinkSpec) -> list[str]:
    netem = ["netem", "limit", "100000"]
    if link.delay_s:
        netem += ["delay", f"{link.delay_s * 1e6:.0f}us"]
        if link.jitter_s:
            netem += [f"{link.jitter_s * 1e6:.0f}us"]
    if link.loss_frac:
        netem += ["loss", f"{link.loss_frac * 100:g}%"]
    return netem


def _ignore_signals() -> dict[int, Any]:
    saved: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                saved[sig] = signal.signal(sig, signal.SIG_IGN)
            except (ValueError, OSError):
                pass
    return saved


def signal_session(p: Any, sig: int) -> None:
    """Send ``sig`` to the session of process ``p`` (a ``subprocess.Popen``, or anything with its ``pid`` and
    ``send_signal``), or to ``p`` alone where it has no session of its own (yet)."""
    try:
        os.killpg(p.pid, sig)  # the process and anything it started in its session
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_MS_RDONLY, _MS_BIND, _MS_REC, _MS_SLAVE, _MNT_DETACH = 0x1, 0x1000, 0x4000, 0x80000, 0x2


def enter_namespace(netns_file: str, etc_dir: str | Path | None = None) -> None:
    """Move the calling process into the network namespace named by ``netns_file`` (``Lab.netns_file``), as
    ``ip netns exec`` does for the command it runs: the namespace's own view of ``/sys``, and each file under
    ``etc_dir`` (``/etc/netns/<ns>``: the lab's ``hosts``) mounted over the same name in ``/etc``, in a mount
    namespace of this process only. Lets a process forked from an interpreter that has imported torch start
    a lab rank, instead of a fresh interpreter (``ip netns exec python ...``) importing it again.

    Linux, root, and a single-threaded caller (the kernel refuses a new mount namespace to a process with
    threads; a namespace entered by one thread would not be the other threads')."""
    import ctypes

    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise LabError(f"enter_namespace must run before the process starts threads (it has {threads}): call it "
                       "first thing in a freshly forked process")
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise LabError(f"cannot enter network namespace {netns_file}: {what}: {os.strerror(err)}")

    fd = os.open(netns_file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # mounts made here must not propagate back to the host's mount namespace
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    readonly = _MS_RDONLY if not os.access("/sys", os.W_OK) else 0
    if libc.umount2(b"/sys", _MNT_DETACH) == 0:  # sysfs shows the namespace's interfaces only when mounted in it
        check(libc.mount(os.path.basename(netns_file).encode(), b"/sys", b"sysfs", readonly, None), "mount /sys")
    _mount_etc(libc, etc_dir, check)


def _mount_etc(libc: Any, etc_dir: str | Path | None, check: Callable[[int, str], None]) -> None:
    """Each file under ``etc_dir`` (``/etc/netns/<ns>``) mounted over the same name in ``/etc``, in the caller's
    own mount namespace (made, not propagated back, before)."""
    if etc_dir is not None and Path(etc_dir).is_dir():
        for f in sorted(Path(etc_dir).iterdir()):
            target = Path("/etc") / f.name
            if target.exists():
                check(libc.mount(str(f).encode(), str(target).encode(), None, _MS_BIND, None), f"bind {f} on {target}")


def in_namespace(netns_file: str, make: Callable[[], T], etc_dir: str | Path | None = None) -> T:
    """``make()`` in a helper thread moved into the network namespace named by ``netns_file`` (``Lab.netns_file``):
    the sockets it opens, and the threads it starts, belong to that namespace, while the caller's threads stay in
    theirs (a network namespace, unlike a mount namespace, can be entered by one thread of many). How the
    launcher holds the job's store at rank 0's address without being rank 0. With ``etc_dir`` the thread also
    gets a mount namespace of its own (a thread may unshare one) with that directory's files (the lab's
    ``hosts``) over ``/etc``'s, which the threads it starts share: the store's reverse lookups of the ranks then
    answer from the lab's names (without them, c10d warned that a client's hostname could not be retrieved).
    That part is cosmetic: where the kernel refuses it, the thread goes on without it."""
    import ctypes

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(netns_file, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise LabError(f"cannot enter network namespace {netns_file}: setns: "
                                   f"{os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
            if etc_dir is not None and libc.unshare(_CLONE_NEWNS) == 0 and \
                    libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) == 0:
                _mount_etc(libc, etc_dir, lambda rc, what: None)  # (a file not bound: the lookups fail, as before)
            box["value"] = make()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="qwire-lab-namespace", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _kill_ns_pids(ns: str) -> None:
    """SIGKILL every process inside namespace ``ns`` (and give the kernel a moment if there were any)."""
    res = _ip("netns", "pids", ns, check=False)
    killed = 0
    for tok in res.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
            killed += 1
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    if killed:
        time.sleep(0.1)


def _read_states() -> list[dict[str, Any]]:
    out = []
    if state_dir().is_dir():
        for f in state_dir().glob("*.json"):
            try:
                out.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                pass
    return out


def list_labs() -> list[LabInfo]:
    """Every qwire lab whose namespaces exist on this machine, with its owner's state."""
    groups: dict[str, list[str]] = {}
    for ns in _netns_list():
        m = NS_RE.match(ns)
        if m:
            groups.setdefault(m.group("id"), []).append(ns)
    states = {s.get("id"): s for s in _read_states()}
    labs = []
    for lab_id, names in sorted(groups.items()):
        st = states.get(lab_id, {})
        pid = st.get("pid")
        alive = bool(pid) and pid_start(int(pid)) is not None and pid_start(int(pid)) == st.get("pid_start")
        labs.append(LabInfo(lab_id, sorted(names), pid, alive, st.get("link", ""), st.get("subnet", ""),
                            st.get("created")))
    # state files of labs whose namespaces are all gone are stale
    for lab_id, st in states.items():
        if lab_id not in groups:
            pid = st.get("pid")
            if not (pid and pid_start(int(pid)) == st.get("pid_start")):
                try:
                    (state_dir() / f"{lab_id}.json").unlink()
                except OSError:
                    pass
    return labs


def clean_labs(include_running: bool = False) -> tuple[list[LabInfo], list[LabInfo]]:
    """Delete leftover labs (their owner is gone); ``include_running`` deletes every qwire lab.

    Returns ``(removed, kept)``.
    """
    removed, kept = [], []
    for info in list_labs():
        if info.alive and not include_running:
            kept.append(info)
            continue
        for ns in info.namespaces:
            _kill_ns_pids(ns)
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        try:
            (state_dir() / f"{info.id}.json").unlink()
        except OSError:
            pass
        removed.append(info)
    return removed, kept
