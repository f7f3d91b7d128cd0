"""The network lab: link specs, the simulated link model, namespaces + tc, link test, `qwire train --link`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dist_utils import tiny_model_env
from lab_utils import lab_reason, needs_lab  # noqa: F401  (lab_reason: needs_lab's condition)
from qwire.netlab import Lab, LinkSpec, SimulatedLink, attach, pair_links, parse_link, wire_bytes
from qwire.netlab import lab as lab_mod
from qwire.netlab.cli import linktest_dims
from qwire.netlab.lab import peer_classes
from qwire.netlab.spec import dim_links, link_mode, rank_coords, slowest, uniform_link

# ----------------------------------------------------------------------------------------------- specs


@pytest.mark.parametrize("text,want", [
    ("100mbit", LinkSpec(100e6)),
    ("100Mbit", LinkSpec(100e6)),
    ("100mbps", LinkSpec(100e6)),               # papers' Mbps: megaBITS (tc would read megabytes)
    ("1gbit", LinkSpec(1e9)),
    ("2.5Gbps", LinkSpec(2.5e9)),
    ("500kbit", LinkSpec(500e3)),
    ("64000bit", LinkSpec(64e3)),
    ("rate=20mbit", LinkSpec(20e6)),
    ("100mbit,delay=20ms,jitter=5ms,loss=0.1%", LinkSpec(100e6, 0.02, 0.005, 0.001)),
    (" 50mbit , delay=500us , loss=1% ", LinkSpec(50e6, 0.0005, 0.0, 0.01)),
    ("10mbit,delay=0.1s,mode=sim", LinkSpec(10e6, 0.1, mode="sim")),
    ("10mbit,mode=LAB", LinkSpec(10e6, mode="lab")),
])
def test_parse_link(text: str, want: LinkSpec) -> None:
    got = parse_link(text)
    for a, b in zip(dataclasses.astuple(got)[:4], dataclasses.astuple(want)[:4]):
        assert a == pytest.approx(b)
    assert got.mode == want.mode
    assert parse_link(str(got)) == got  # the canonical form parses back to the same link


@pytest.mark.parametrize("text,needle", [
    ("", "expected RATE"),
    ("100", "not a number with a unit"),
    ("fast", "not a number with a unit"),
    ("100MB/s", "bits per second"),
    ("0mbit", "> 0"),
    ("delay=20ms", "must start with the rate"),
    ("100mbit,delay=20", "not a time"),
    ("100mbit,delay=-5ms", "not a time"),
    ("100mbit,loss=1", "percent sign"),
    ("100mbit,loss=100%", "[0%, 100%)"),
    ("100mbit,jitter=5ms", "needs a delay"),
    ("100mbit,color=red", "unknown key 'color'"),
    ("100mbit,delay=1ms,delay=2ms", "given twice"),
    ("100mbit,,delay=1ms", "empty field"),
    ("100mbit,delay", "KEY=VALUE"),
    ("100mbit,mode=fast", "auto, lab, sim"),
])
def test_bad_link_specs_say_the_accepted_form(text: str, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_link(text)
    assert needle in str(e.value)


def test_tc_rate_is_never_the_ambiguous_mbps() -> None:
    assert parse_link("100mbps").tc_rate() == "100000000bit"
    assert parse_link("1.5gbit,delay=2ms,jitter=1ms,loss=0.5%").describe() == \
        "1500 Mbit/s, 2 ms delay +- 1 ms, 0.5% loss"


# ----------------------------------------------------------------------------------------------- per-dimension links


def test_rank_coords_follow_the_training_layout() -> None:
    P, T, D = 2, 3, 2
    for rank in range(P * T * D):
        c = rank_coords(rank, P, T, D)
        assert (c["dp"] * P + c["pp"]) * T + c["tp"] == rank
    with pytest.raises(ValueError, match="not in a world"):
        rank_coords(12, P, T, D)


def test_pair_links_use_the_link_of_the_differing_dimension() -> None:
    pairs = pair_links(2, 2, 2, link_pp="100mbit", link_tp="10gbit", link_dp="50mbit,delay=5ms")
    pp, tp, dp = parse_link("100mbit"), parse_link("10gbit"), parse_link("50mbit,delay=5ms")
    assert len(pairs) == 8 * 7
    # rank = (dp * 2 + pp) * 2 + tp: 0 -> 1 differs in tp, 0 -> 2 in pp, 0 -> 4 in dp
    assert (pairs[(0, 1)], pairs[(0, 2)], pairs[(0, 4)]) == (tp, pp, dp)
    assert pairs[(5, 4)] == tp and pairs[(6, 4)] == pp and pairs[(7, 3)] == dp
    assert pairs[(0, 3)] == pp             # pp and tp differ: the slower
    assert pairs[(0, 7)] == dp             # all three differ: the slowest
    assert all(pairs[(a, b)] == pairs[(b, a)] for a, b in pairs)


def test_pair_links_fall_back_to_link_and_leave_the_rest_unshaped() -> None:
    pairs = pair_links(2, 2, 1, link="50mbit", link_tp="1gbit")
    assert pairs[(0, 2)] == parse_link("50mbit") and pairs[(0, 1)] == parse_link("1gbit")
    only_pp = pair_links(2, 2, 1, link_pp="20mbit")
    assert only_pp[(0, 1)] is None                        # tp: no link
    assert only_pp[(0, 2)] == only_pp[(0, 3)] == parse_link("20mbit")   # pp, and pp + tp (unshaped is fastest)
    assert uniform_link(only_pp) is None
    same = pair_links(2, 1, 2, link_pp="20mbit,mode=lab", link_dp="20mbit")   # mode= is not part of the link
    assert uniform_link(same) == parse_link("20mbit")
    assert slowest([None, None]) is None
    assert slowest([parse_link("20mbit"), parse_link("20mbit,delay=1ms")]) == parse_link("20mbit,delay=1ms")


def test_dimension_links_name_the_bad_option_and_modes_must_agree() -> None:
    with pytest.raises(ValueError, match="--link-tp: bad link spec"):
        dim_links(link="10mbit", link_tp="fast")
    assert dim_links(link="10mbit")["dp"] == parse_link("10mbit")
    assert link_mode(dim_links(link="10mbit", link_pp="5mbit,mode=sim")) == "sim"
    assert link_mode(dim_links(link="10mbit")) == "auto"
    with pytest.raises(ValueError, match="different modes"):
        link_mode(dim_links(link_pp="10mbit,mode=lab", link_dp="10mbit,mode=sim"))


def test_lab_plans_one_htb_class_per_distinct_link_of_each_uplink() -> None:
    """Pure: what Lab would build (no namespaces are made before start())."""
    lab = Lab(4, pairs=pair_links(2, 2, 1, link_pp="20mbit", link_tp="200mbit"))
    assert lab.link is None and lab.pairs is not None
    # rank 0: to 1 (tp) 200mbit; to 2 (pp) and 3 (pp + tp) 20mbit; slowest class first
    assert lab.classes[0] == [(parse_link("20mbit"), [2, 3]), (parse_link("200mbit"), [1])]
    assert peer_classes(4, pair_links(2, 2, 1, link_pp="20mbit"))[3] == [(parse_link("20mbit"), [0, 1])]
    uniform = Lab(4, pairs=pair_links(2, 1, 2, link="20mbit"))
    assert uniform.link == parse_link("20mbit") and uniform.pairs is None   # one tbf per uplink, as with --link
    with pytest.raises(ValueError, match="not a pair"):
        Lab(2, pairs={(0, 2): "10mbit"})


def test_simulated_link_covers_only_the_pipeline(tmp_path: Path) -> None:
    """Without the lab the pipeline link is simulated and tp/dp links are named as not simulated; a run
    whose only links are tp/dp ones is refused before anything starts."""
    from qwire.netlab.launch import _Links, _simulated_only_pp, launch_in_lab
    from qwire.train import TrainConfig, TrainError

    cfg = TrainConfig(stages=2, dp=2, link="20mbit", link_dp="200mbit", out=str(tmp_path / "a"))
    pp, note = _simulated_only_pp(_Links.of(cfg), "no lab")
    assert pp == parse_link("20mbit") and "the dp link (200mbit) is NOT" in note
    cfg = TrainConfig(stages=1, dp=2, link_dp="20mbit,mode=sim", out=str(tmp_path / "b"))
    with pytest.raises(TrainError, match="models only the traffic between pipeline stages"):
        launch_in_lab(cfg)
    assert not (tmp_path / "b" / "netlab").exists()   # refused before any rank started


# ----------------------------------------------------------------------------------------------- simulated link


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_wire_bytes_adds_tcp_ip_framing() -> None:
    assert wire_bytes(1) == 1 + 66
    assert wire_bytes(1448) == 1514
    assert wire_bytes(1449) == 1449 + 2 * 66
    assert wire_bytes(10 * 1448) / (10 * 1448) == pytest.approx(1514 / 1448)


def test_simulated_stream_is_a_fifo_with_delay(tmp_path: Path) -> None:
    clock = FakeClock()
    spec = parse_link("8mbit,delay=10ms")  # 1 MB/s of frames
    for model in ("duplex", "gloo"):
        tx = SimulatedLink(spec, tmp_path / model, 0, clock=clock, sleep=clock.sleep, model=model, burst=0)
        rx = SimulatedLink(spec, tmp_path / model, 1, clock=clock, sleep=clock.sleep, model=model, burst=0)
        t0 = clock.t
        t = tx.transfer_time(14480)
        assert t == pytest.approx(wire_bytes(14480) / 1e6)
        rx.recv(0)
        rx.recv(0)
        note = 0.01 if model == "gloo" else 0.0   # gloo: the receiver's ready note must reach the sender first
        tx.send(1, 14480)
        tx.send(1, 14480)             # queued behind the first
        assert rx.arrival(0, 0) == pytest.approx(t0 + note + t + 0.01)
        assert rx.arrival(0, 1) == pytest.approx(t0 + note + 2 * t + 0.01)
        assert rx.wait(0) == pytest.approx(note + t + 0.01)   # held until the first arrives
        clock.t += 1.0                                         # busy long after the second arrived
        assert rx.wait(0) == 0.0
        assert (tx.sent_messages, tx.sent_bytes, rx.missing) == (2, 28960, 0)
        tx.close()
        rx.close()


def test_simulated_gloo_rendezvous_and_turn_taking(tmp_path: Path) -> None:
    """gloo moves a payload only after the receiver's ready note has arrived, and that note waits
    behind the receiver's own payload already on the wire the other way."""
    clock = FakeClock()
    a = SimulatedLink("8mbit,delay=10ms", tmp_path, 0, clock=clock, sleep=clock.sleep, burst=0)
    b = SimulatedLink("8mbit,delay=10ms", tmp_path, 1, clock=clock, sleep=clock.sleep, burst=0)
    t = a.transfer_time(100_000)
    a.send(1, 100_000)              # at 100.0, but b posts its receive only at 100.5
    clock.t = 100.5
    b.recv(0)
    assert b.arrival(0, 0) == pytest.approx(100.5 + 0.01 + t + 0.01)
    clock.t = 100.52                # a's payload is on the wire (since 100.51) when a posts a receive
    a.recv(1)
    b.send(0, 100_000)
    assert a.arrival(1, 0) == pytest.approx(100.51 + t + 0.01 + t + 0.01)   # after a's payload, plus the note
    # the duplex model: no rendezvous, both directions at once
    clock.t = 100.0
    d = tmp_path / "duplex"
    a = SimulatedLink("8mbit,delay=10ms", d, 0, clock=clock, sleep=clock.sleep, model="duplex", burst=0)
    b = SimulatedLink("8mbit,delay=10ms", d, 1, clock=clock, sleep=clock.sleep, model="duplex", burst=0)
    a.send(1, 100_000)
    clock.t = 100.5
    b.recv(0)
    assert b.arrival(0, 0) == pytest.approx(100.0 + t + 0.01)


def test_simulated_token_bucket_lets_a_burst_through_after_a_pause(tmp_path: Path) -> None:
    clock = FakeClock()
    tx = SimulatedLink("8mbit", tmp_path, 0, clock=clock, sleep=clock.sleep, model="duplex", burst=20_000)
    rx = SimulatedLink("8mbit", tmp_path, 1, clock=clock, sleep=clock.sleep, model="duplex", burst=20_000)
    n = 50 * 1448                                   # 75,700 bytes on the wire
    for _ in range(3):
        rx.recv(0)
    tx.send(1, n)                                   # bucket full: 20 kB leave at once
    tx.send(1, n)                                   # right behind it: no tokens left
    first = 100.0 + (wire_bytes(n) - 20_000) / 1e6
    assert rx.arrival(0, 0) == pytest.approx(first)
    assert rx.arrival(0, 1) == pytest.approx(first + wire_bytes(n) / 1e6)
    clock.t = rx.arrival(0, 1) + 0.005              # a 5 ms pause refills 5 kB
    tx.send(1, n)
    assert rx.arrival(0, 2) == pytest.approx(clock.t + (wire_bytes(n) - 5_000) / 1e6)


def test_simulated_link_jitter_keeps_payloads_in_order(tmp_path: Path) -> None:
    clock = FakeClock()
    tx = SimulatedLink("1gbit,delay=20ms,jitter=15ms", tmp_path, 0, clock=clock, sleep=clock.sleep, seed=1,
                       model="duplex")
    rx = SimulatedLink("1gbit,delay=20ms,jitter=15ms", tmp_path, 1, clock=clock, sleep=clock.sleep, seed=1,
                       model="duplex")
    for _ in range(200):
        rx.recv(0)
        tx.send(1, 100)
        clock.t += 0.001
    arrivals = [rx.arrival(0, k) for k in range(200)]
    assert arrivals == sorted(arrivals)
    delays = [a - (100.0 + 0.001 * i) for i, a in enumerate(arrivals)]
    assert min(delays) >= 0.005 - 1e-9 and max(delays) <= 0.035 + 1e-3
    assert max(delays) - min(delays) > 0.01  # it does vary


def test_attach_records_exact_bytes_and_waits_before_use(tmp_path: Path) -> None:
    """A middle stage: activations go to stage 2, gradients to stage 0; it waits for stage 0's
    activations before forward and stage 2's gradients before backward (not in eval)."""
    clock = FakeClock()
    calls: list[str] = []

    def op(nbytes: int) -> SimpleNamespace:
        return SimpleNamespace(tensor=torch.zeros(nbytes // 4))

    stage = SimpleNamespace(stage_index=1, num_stages=3, has_backward=True,
                            get_fwd_send_ops=lambda i: [op(4000)], get_bwd_send_ops=lambda i: [op(800)],
                            get_fwd_recv_ops=lambda i: [op(4000)], get_bwd_recv_ops=lambda i: [op(800)],
                            forward_one_chunk=lambda i, *a, **k: calls.append(f"F{i}"),
                            backward_one_chunk=lambda i, **k: calls.append(f"B{i}"))
    me = SimulatedLink("8mbit", tmp_path, 1, clock=clock, sleep=clock.sleep, burst=0)
    prev = SimulatedLink("8mbit", tmp_path, 0, clock=clock, sleep=clock.sleep, burst=0)
    nxt = SimulatedLink("8mbit", tmp_path, 2, clock=clock, sleep=clock.sleep, burst=0)
    attach(stage, me)
    prev.send(1, 4000)
    stage.get_fwd_recv_ops(0)
    arrival = me.arrival(0, 0)
    assert arrival == pytest.approx(100.0 + me.transfer_time(4000))
    stage.forward_one_chunk(0)
    assert calls == ["F0"] and clock.t == pytest.approx(arrival)
    stage.get_fwd_send_ops(0)
    stage.get_bwd_send_ops(0)
    assert (me.sent_messages, me.sent_bytes) == (2, 4800)
    stage.get_bwd_recv_ops(0)
    nxt.send(1, 800)
    arrival = me.arrival(2, 0)
    stage.backward_one_chunk(0, loss=None)
    assert calls == ["F0", "B0"] and clock.t == pytest.approx(arrival)
    stage.has_backward = False  # schedule.eval(): backward_one_chunk is a no-op that receives nothing
    stage.backward_one_chunk(1)
    assert me.missing == 0


# ----------------------------------------------------------------------------------------------- the lab

def _ns() -> set[str]:
    return set(lab_mod._netns_list())


def _in_ns(ns: str, *argv: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=30,
                          check=True).stdout


@needs_lab
def test_lab_builds_shaped_namespaces_and_removes_them() -> None:
    with Lab(3, "50mbit") as lab:
        names = [lab.bridge_ns, *lab.namespaces]
        assert set(names) <= _ns() and len(set(lab.addresses)) == 3
        assert all(lab_mod.NS_RE.match(n) for n in names)
        qdisc = _in_ns(lab.namespaces[1], "tc", "qdisc", "show", "dev", lab.ifname)
        assert "tbf" in qdisc and "50Mbit" in qdisc
        addrs = _in_ns(lab.namespaces[2], "ip", "-o", "-4", "addr", "show", "dev", lab.ifname)
        assert lab.addresses[2] in addrs
        # rank 1 reaches rank 2 through the bridge (a refused connection proves the path)
        code = (f"import socket\ntry:\n socket.create_connection(('{lab.addresses[2]}', 9), timeout=5)\n"
                "except ConnectionRefusedError:\n print('reached')")
        assert "reached" in _in_ns(lab.namespaces[1], sys.executable, "-c", code)
        assert any(info.id == lab.id and info.alive for info in lab_mod.list_labs())
    assert not set(names) & _ns()
    assert not any((lab_mod.NETNS_ETC / n).exists() for n in names)


@needs_lab
def test_lab_is_removed_when_the_with_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with Lab(2, "10mbit") as lab:
            names = [lab.bridge_ns, *lab.namespaces]
            p = lab.popen(0, ["sleep", "60"])
            raise RuntimeError("boom")
    assert not set(names) & _ns()
    assert p.poll() is not None  # the lab's processes were stopped too


@needs_lab
def test_two_labs_at_once_do_not_collide() -> None:
    with Lab(2, "20mbit") as a, Lab(2, "30mbit") as b:
        assert a.id != b.id and a.subnet != b.subnet
        assert not set(a.namespaces) & set(b.namespaces)
        assert {*a.namespaces, *b.namespaces} <= _ns()
        b.close()
        assert set(a.namespaces) <= _ns() and not set(b.namespaces) & _ns()
        assert "20Mbit" in _in_ns(a.namespaces[0], "tc", "qdisc", "show", "dev", a.ifname)
    assert not {*a.namespaces, *b.namespaces} & _ns()


_HOLDER = """
import sys, time
from qwire.netlab import Lab
lab = Lab(2, "10mbit").start()
print(" ".join([lab.bridge_ns, *lab.namespaces]), flush=True)
time.sleep(60)
"""


def _holder() -> tuple[subprocess.Popen[str], list[str]]:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline() if p.stdout else ""
    assert line, "the lab holder did not start"
    return p, line.split()


@needs_lab
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_lab_is_removed_on_sigterm_and_ctrl_c(sig: int) -> None:
    p, names = _holder()
    try:
        assert set(names) <= _ns()
        p.send_signal(sig)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert not set(names) & _ns()


@needs_lab
def test_netlab_list_and_clean_remove_only_orphans() -> None:
    from qwire.cli import main

    p, names = _holder()
    p.kill()  # SIGKILL: no teardown, the namespaces are left behind
    p.wait(timeout=30)
    with Lab(1, "10mbit") as live:
        orphan = next(i for i in lab_mod.list_labs() if i.namespaces == sorted(names))
        assert not orphan.alive and orphan.owner_pid == p.pid
        assert main(["netlab", "clean"]) == 0
        assert not set(names) & _ns()
        assert set(live.namespaces) <= _ns()  # a running lab is kept
        assert main(["netlab", "list"]) == 0


@needs_lab
def test_linktest_achieves_the_configured_rate() -> None:
    from qwire.netlab.cli import linktest

    res = linktest("50mbit", mbytes=8, timeout=60)
    # Payload goodput is about 95.6% of the rate (TCP/IP framing); generous bounds: a property of the link.
    assert 0.85 * 50 < res["goodput_mbit_s"] < 1.05 * 50, res
    assert 0 < res["rtt_ms"] < 50, res


@needs_lab
def test_lab_shapes_each_dimension_to_its_link() -> None:
    """P=2 x D=2: pipeline pairs at 20 mbit, data-parallel pairs at 200 mbit, through htb classes + tbf."""
    pairs = pair_links(2, 1, 2, link_pp="20mbit", link_dp="200mbit")
    with Lab(4, pairs=pairs) as lab:
        info = lab.describe()
        assert info["layout"] == "htb" and info["shaping"]["classify"] == "htb+u32"
        r0 = info["classes"][0]
        assert [(c["classid"], c["link"], c["peers"]) for c in r0["classes"]] == \
            [("1:10", "20mbit", [1, 3]), ("1:20", "200mbit", [2])]
        ns = lab.namespaces[0]
        qdisc = _in_ns(ns, "tc", "qdisc", "show", "dev", lab.ifname)
        assert "qdisc htb 1: root" in qdisc and "default 0x1" in qdisc
        assert "tbf 10: parent 1:10 rate 20Mbit" in qdisc and "tbf 20: parent 1:20 rate 200Mbit" in qdisc
        classes = _in_ns(ns, "tc", "class", "show", "dev", lab.ifname)
        assert all(f"class htb {c} root" in classes for c in ("1:1", "1:10", "1:20"))
        filters = _in_ns(ns, "tc", "filter", "show", "dev", lab.ifname)
        hexes = {k: "".join(f"{int(x):02x}" for x in lab.addresses[k].split(".")) for k in (1, 2, 3)}
        for k, flow in ((1, "1:10"), (2, "1:20"), (3, "1:10")):   # rank 3 differs in pp and dp: the slower
            assert re.search(rf"flowid {flow} .*\n\s*match {hexes[k]}/ffffffff at 16", filters), filters
    assert not {lab.bridge_ns, *lab.namespaces} & _ns()
    # one bounded TCP transfer per dimension, from rank 0: to rank 1 (pp) and to rank 2 (dp)
    res = linktest_dims(2, 1, 2, link_pp="20mbit", link_dp="200mbit", mbytes=1.5, timeout=30)
    pp, dp = res["dims"]["pp"], res["dims"]["dp"]
    assert (pp["peer"], pp["link"], dp["peer"], dp["link"]) == (1, "20mbit", 2, "200mbit")
    assert 0.5 * 20 < pp["goodput_mbit_s"] < 1.1 * 20, res["dims"]
    assert pp["goodput_mbit_s"] < 0.6 * dp["goodput_mbit_s"], res["dims"]


# ----------------------------------------------------------------------------------------------- qwire train --link


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_model_env(tmp_path_factory.mktemp("netlab"), layers=4)


def _train_argv(tiny: dict[str, str], name: str, link: str) -> list[str]:
    return ["train", "--link", link, "--stages", "2", "--model", tiny["model"], "--max-tokens", "40000",
            "--vocab-size", "512", "--seq-len", "32", "--batch-size", "8", "--microbatches", "4", "--steps", "3",
            "--eval-batches", "2", "--fwd-codec", "tahquant", "--bwd-codec", "perchannel6", "--timeout", "120",
            "--out", str(Path(tiny["base"]) / name)]


def _qwire(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qwire", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def _probe_namespace(rank: int, where: tuple[str, str], q) -> None:
    """A forked rank's first step in the lab (qwire.netlab.launch): enter its namespace; report what it sees."""
    from qwire.netlab.lab import enter_namespace

    enter_namespace(*where)
    q.put((rank, sorted(n for _, n in socket.if_nameindex()), sorted(os.listdir("/sys/class/net")),
           Path("/etc/hosts").read_text(), os.readlink("/proc/self/ns/net")))


def _threaded_enter_rank(rank: int, where: tuple[str, str], q) -> None:
    """The same, after starting a thread: refused."""
    import threading

    from qwire.netlab.lab import LabError, enter_namespace

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        enter_namespace(*where)
        q.put("entered")
    except LabError as e:
        q.put(str(e))
    finally:
        stop.set()
        t.join()


@needs_lab
def test_a_forked_rank_enters_its_namespace_as_ip_netns_exec_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a lab rank forked from the fork server does first: its network namespace (interfaces, /sys), the
    lab's hosts file over /etc/hosts, none of it visible outside; refused once the process has threads."""
    import pickle

    from qwire.netlab.lab import NETNS_ETC
    from qwire.procs import START_METHOD_ENV, in_launcher_env, launcher_env, rank_context

    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    ctx = rank_context()
    hosts_before = Path("/etc/hosts").read_text()
    with Lab(2, "100mbit") as lab:
        q = ctx.SimpleQueue()
        procs = []
        for k in range(2):
            where = (lab.netns_file(k), str(NETNS_ETC / lab.namespaces[k]))
            call = pickle.dumps((_probe_namespace, (where,)))
            procs.append(ctx.Process(target=in_launcher_env, args=(k, launcher_env(), call, q)))
            procs[-1].start()
        for p in procs:
            p.join(timeout=60)
        assert [p.exitcode for p in procs] == [0, 0]
        seen = sorted(q.get() for _ in range(2))
        inodes = {k: _in_ns(ns, "readlink", "/proc/self/ns/net").strip() for k, ns in enumerate(lab.namespaces)}
        for k, ifaces, sysfs, hosts, inode in seen:
            assert ifaces == sysfs == ["lo", lab.ifname]
            assert inode == inodes[k] and inode != os.readlink("/proc/self/ns/net")
            assert f"{lab.addresses[1 - k]} {lab.namespaces[1 - k]}" in hosts
        q2 = ctx.SimpleQueue()
        call = pickle.dumps((_threaded_enter_rank, ((lab.netns_file(0), str(NETNS_ETC / lab.namespaces[0])),)))
        p = ctx.Process(target=in_launcher_env, args=(0, launcher_env(), call, q2))
        p.start()
        p.join(timeout=60)
        assert "must run before the process starts threads (it has 2)" in q2.get()
    assert Path("/etc/hosts").read_text() == hosts_before  # the bind mount stayed in the ranks


@needs_lab
def test_train_over_a_lab_link(tiny: dict[str, str]) -> None:
    res = _qwire(_train_argv(tiny, "lab", "200mbit"))
    assert res.returncode == 0, res.stderr[-3000:]
    run = Path(tiny["base"]) / "lab"
    assert "network namespaces" in res.stderr and "SIMULATED" not in res.stderr
    # the store at rank 0's address looks its clients up in the lab's hosts file: no "[c10d] The hostname of the
    # client socket cannot be retrieved" (the launcher's /etc/hosts does not name the lab's addresses)
    assert "[c10d]" not in res.stderr, res.stderr[:2000]
    assert json.loads((run / "config.json").read_text())["link"] == "200mbit"      # the run records its link
    assert json.loads((run / "netlab" / "worker-config.json").read_text())["link"] == ""  # workers don't relaunch
    info = json.loads((run / "netlab.json").read_text())
    assert info["mode"] == "lab" and info["shaping"]["rate"] == "tbf"
    assert info["layout"] == "tbf" and "classes" not in info   # one link for every pair: one tbf per uplink
    assert info["links"]["pp"] == {"size": 2, "link": "200mbit"} and info["pairs"] == [[None, "200mbit"],
                                                                                       ["200mbit", None]]
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [r["step"] for r in recs] == [1, 2, 3] and recs[0]["wire_bytes_fwd"] > 0
    assert info["rank_start"] == "forkserver"  # forked from the fork server, each entered its namespace itself
    assert not set(info["namespaces"]) & _ns()  # nothing left behind


def test_train_falls_back_to_a_simulated_link(tiny: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    """Where the lab cannot run, `--link` runs on loopback with the simulated link, and says so. Runs
    everywhere; the launcher fails if the simulated link was not attached on every rank."""
    import qwire.netlab.launch
    from qwire.train import TrainConfig, launch

    monkeypatch.setattr(qwire.netlab.launch, "lab_unavailable_reason", lambda: "no lab in this test")
    cfg = TrainConfig(stages=2, steps=3, batch_size=8, microbatches=4, seq_len=32, model=tiny["model"],
                      vocab_size=512, max_tokens=40_000, eval_every=0, eval_batches=2, timeout=120,
                      link="100mbit,delay=2ms", out=str(Path(tiny["base"]) / "sim"))
    summary = launch(cfg)
    err = capfd.readouterr().err
    assert "no lab in this test" in err and "SIMULATED" in err
    assert summary["steps"] == 3 and summary["link_mode"] == "simulated" and summary["wire_bytes_fwd"] > 0
    info = json.loads((Path(cfg.out) / "netlab.json").read_text())
    assert info["mode"] == "simulated" and info["simulated"] == ["pp"] and info["not_simulated"] == []


def test_a_failing_rank_is_named_and_the_others_stopped(tiny: dict[str, str]) -> None:
    from qwire.netlab import launch_in_lab
    from qwire.train import TrainConfig, TrainError

    cfg = TrainConfig(stages=2, steps=3, batch_size=8, microbatches=4, seq_len=32, model=tiny["model"],
                      vocab_size=512, max_tokens=40_000, eval_every=0, fwd_codec="fp32", bwd_codec="fp32",
                      timeout=60, link="50mbit,mode=sim", out=str(Path(tiny["base"]) / "fails"))
    with pytest.raises(TrainError) as e:
        launch_in_lab(cfg, resume=True)  # no checkpoint to resume from: the ranks fail
    msg = str(e.value)
    assert "rank" in msg and "failed" in msg and "--resume" in msg


def test_ranks_still_running_after_a_stop_signal_are_killed_in_time(tmp_path: Path) -> None:
    """After SIGTERM the launcher waits STOP_WAIT_S for the ranks to save their step, then kills them and says so
    (a scheduler's SIGKILL would otherwise leave the lab's namespaces behind)."""
    import time

    from qwire.netlab import launch as launch_mod
    from qwire.procs import TrainError

    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
             for _ in range(2)]
    try:
        with pytest.raises(TrainError) as e:
            launch_mod._wait_all(ranks, tmp_path, tmp_path, stopped=[time.monotonic() - launch_mod.STOP_WAIT_S - 1])
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert [p.poll() for p in ranks] == [-signal.SIGTERM] * 2  # stopped, not left running
    assert str(e.value) == (
        f"ranks 0, 1 had not ended {launch_mod.STOP_WAIT_S:g} s after the stop signal (a rank ends the run after its "
        f"step; a step this long, or a rank stuck in a collective) and were killed (logs in {tmp_path}). No "
        "checkpoint was saved yet.")


# ----------------------------------------------------------------------------------------------- --link-schedule


def test_parse_link_schedule() -> None:
    from qwire.netlab.spec import parse_link_schedule

    assert parse_link_schedule("20:20mbit;40:200mbit") == [(20, 20e6), (40, 200e6)]
    assert parse_link_schedule(" 5 : 1gbit ", steps=6) == [(5, 1e9)]
    for text, needle in [("20mbit", "not STEP:RATE"), ("x:20mbit", "not a step number"),
                         ("20:fast", "not a number with a unit"), ("0:20mbit", "steps start at 1"),
                         ("20:20mbit;10:1gbit", "must increase"), ("20:20mbit;", "not STEP:RATE")]:
        with pytest.raises(ValueError, match=needle):
            parse_link_schedule(text)
    with pytest.raises(ValueError, match="never take effect"):
        parse_link_schedule("10:20mbit", steps=10)


def test_link_schedule_options_are_checked_before_anything_starts() -> None:
    from qwire.train import TrainConfig

    with pytest.raises(ValueError, match="give --link"):
        TrainConfig(link_schedule="2:20mbit", steps=5).validate()
    with pytest.raises(ValueError, match="give --link"):
        TrainConfig(link="1gbit", link_dp="20mbit", link_schedule="2:20mbit", steps=5).validate()
    with pytest.raises(ValueError, match="--link-schedule: .*never take effect"):
        TrainConfig(link="1gbit", link_schedule="5:20mbit", steps=5).validate()


@needs_lab
def test_lab_set_rate_changes_every_tbf() -> None:
    with Lab(2, "50mbit") as lab:
        lab.set_rate(7e6)
        for ns in lab.namespaces:
            qdisc = _in_ns(ns, "tc", "qdisc", "show", "dev", lab.ifname)
            assert "tbf" in qdisc and "7Mbit" in qdisc and "50Mbit" not in qdisc
        assert str(lab.link) == "7mbit" and lab.rate_changes[-1]["rate_bits_per_s"] == 7e6
    with Lab(4, pairs=pair_links(2, 1, 2, link_pp="20mbit", link_dp="200mbit")) as lab:  # htb: one tbf per class
        lab.set_rate(3e6)
        qdisc = _in_ns(lab.namespaces[0], "tc", "qdisc", "show", "dev", lab.ifname)
        assert qdisc.count("rate 3Mbit") == 2 and "20Mbit" not in qdisc and "200Mbit" not in qdisc


@needs_lab
def test_train_follows_the_link_schedule(tiny: dict[str, str]) -> None:
    argv = _train_argv(tiny, "sched", "500mbit")
    argv[argv.index("--steps") + 1] = "5"
    # each rank a fresh interpreter started by `ip netns exec`, as with QWIRE_START_METHOD=spawn
    res = _qwire([*argv, "--link-schedule", "2:30mbit;4:100mbit"], env={"QWIRE_START_METHOD": "spawn"})
    assert res.returncode == 0, res.stderr[-3000:]
    run = Path(tiny["base"]) / "sched"
    assert json.loads((run / "netlab.json").read_text())["rank_start"] == "spawn"
    changes = [json.loads(ln) for ln in (run / "link_changes.jsonl").read_text().splitlines()]
    assert [(c["after_step"], c["link"]) for c in changes] == [(2, "30mbit"), (4, "100mbit")]
    assert all(c["seen_at_step"] >= c["after_step"] for c in changes)
    assert "the links now run at 30 Mbit/s" in res.stderr
    info = json.loads((run / "netlab.json").read_text())
    assert info["link_schedule"] == [{"after_step": 2, "link": "30mbit"}, {"after_step": 4, "link": "100mbit"}]
    assert json.loads((run / "netlab" / "worker-config.json").read_text())["link_schedule"] == ""


@needs_lab
def test_lab_packet_loss_is_applied_and_counted() -> None:
    """loss=5%: where the kernel has no netem, nft drops packets at the bridge and its counters say how many
    of those the ranks sent it dropped (the evidence a run records in netlab.json)."""
    import shutil

    try:
        lab = Lab(2, "100mbit,loss=5%").start()
    except lab_mod.LabUnavailable as e:  # neither netem nor nft here
        pytest.skip(str(e))
    with lab:
        if lab.shaping.get("loss") != "nft":
            assert lab.loss_counters() is None  # netem does the loss: nothing of nft's to read
            pytest.skip(f"loss is done by {lab.shaping.get('loss')} on this kernel, not nft")
        assert shutil.which("nft") or lab_mod._tool("nft")
        code = (f"import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"for i in range(3000):\n s.sendto(b'x' * 100, ('{lab.addresses[1]}', 9))")
        _in_ns(lab.namespaces[0], sys.executable, "-c", code)
        c = lab.loss_counters()
        assert c is not None and c["seen_packets"] >= 3000
        assert 0.025 < c["dropped_packets"] / c["seen_packets"] < 0.08, c


@needs_lab
def test_loss_the_lab_cannot_apply_is_refused_not_simulated(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Where the lab runs but has neither netem nor nft, loss= fell back to the simulated link, which drops no
    packet and shapes nothing real; a tc failure (a rate it cannot take) was a traceback."""
    from qwire.cli import main

    try:
        Lab(2, "100mbit,loss=1%").start().close()
        pytest.skip("this machine can apply loss= in the lab")
    except lab_mod.LabUnavailable:
        pass
    out = tmp_path / "run"
    assert main(["train", "--model", "llama-micro", "--stages", "2", "--steps", "1", "--link", "10mbit,loss=1%",
                 "--out", str(out)]) == 1
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("qwire train: error: --link 10mbit,loss=1%: loss=1% needs the netem qdisc"), last
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("text,needle", [
    ("4bit", "below 8bit, one byte per second"),
    ("10mbit,delay=1e400ms", "at most 10 s"),
    ("10mbit,jitter=1e400ms,delay=1ms", "at most 10 s"),
    ("100MBps", "write 800mbit for 100 MB/s, or 100mbit for 100 Mbit/s"),
])
def test_rates_tc_cannot_hold_endless_delays_and_byte_units_are_refused(text: str, needle: str) -> None:
    """4bit reached tc as a traceback, an infinite delay reached the ranks (as 'infs', which did not parse
    back), and 100MBps ran as 100 Mbit/s, 8 times slower than meant."""
    with pytest.raises(ValueError, match=re.escape(needle)):
        parse_link(text)


@pytest.mark.parametrize("timeout", [-5.0, 0.0, float("inf"), float("nan")])
def test_a_link_tests_timeout_must_be_a_finite_number_of_seconds(timeout):
    """A negative --timeout ended in a dump of torch's C++ frames, an infinite one in an OverflowError, a NaN in
    "did not finish in nan s": each is refused before any lab starts."""
    from qwire.netlab.cli import linktest

    with pytest.raises(ValueError, match=r"--timeout must be > 0 seconds and at most 2592000 \(30 days\), got"):
        linktest("100mbit", 1.0, timeout=timeout)
    with pytest.raises(ValueError, match=r"--timeout must be > 0 seconds and at most 2592000"):
        linktest_dims(2, 1, 1, link_pp="100mbit", timeout=timeout)


def test_linktest_refuses_a_simulated_link_it_would_have_measured_as_a_lab_link() -> None:
    """``mode=sim`` was ignored: linktest built a lab link and measured it. It is refused before any lab starts,
    naming the option that asked for it; mode=lab is taken."""
    from qwire.netlab.cli import linktest

    with pytest.raises(ValueError, match=r"--link 100mbit,mode=sim asks for the simulated one.*drop mode=sim$"):
        linktest("100mbit,mode=sim", 1.0)
    with pytest.raises(ValueError, match=r"--link-dp 1gbit,mode=sim asks for the simulated one"):
        linktest_dims(2, 1, 2, link="100mbit", link_dp="1gbit,mode=sim")
    with pytest.raises(ValueError, match=r"and --link 1gbit,mode=sim asks"):
        linktest_dims(2, 1, 1, link="1gbit,mode=sim", link_dp="10mbit")
    with pytest.raises(ValueError, match=r"--mbytes must be in"):  # mode=lab passes that check
        linktest("100mbit,mode=lab", -1.0)


def test_a_lab_of_more_ranks_than_its_subnet_holds_is_refused() -> None:
    """255 ranks: rank 254 got the /24's broadcast address and the 256th one outside it."""
    with pytest.raises(ValueError, match=r"a lab holds at most 254 ranks \(one /24 subnet"):
        Lab(255, "10mbit")


def test_compare_passes_a_stop_signal_on_to_the_run_it_waits_for(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM to `qwire netlab compare` ended it at once and left its `qwire train` (and that run's lab)
    going on alone."""
    import threading

    from qwire import procs
    from qwire.netlab import compare

    monkeypatch.setattr(procs, "_stop_signal", None)  # (restored after: request_stop sets it in this process)
    ready = tmp_path / "ready"
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda s, f: (print('stopped by', s), sys.exit(0)))\n"
            f"open({str(ready)!r}, 'w').close()\n"
            "time.sleep(60)\n")

    def stop_when_ready() -> None:
        while not ready.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    # were the signal not taken over, this handler (not pytest's death) would take it, and the child would sleep
    # its 60 s and print nothing
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        threading.Thread(target=stop_when_ready, daemon=True).start()
        res = compare._train([sys.executable, "-c", code], dict(os.environ))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert res.stdout.strip() == f"stopped by {int(signal.SIGTERM)}", res
    assert procs.stop_signal() == signal.SIGTERM


def test_a_link_test_too_short_to_measure_the_rate_says_so() -> None:
    """--mbytes 0.01 at 100mbit reported 265% of the configured rate with no word: the tbf's burst and queue
    leave at the line's speed."""
    from qwire.netlab.cli import default_mbytes
    from qwire.netlab.cli import small_transfer_note as note
    from qwire.netlab.lab import tbf_params

    burst, limit = tbf_params(100e6)
    assert "over-states the link; give --mbytes 3.3 or more" in note(
        {"bytes": 10_000, "tbf_burst_bytes": burst, "tbf_limit_bytes": limit})
    for rate in (1e6, 10e6, 100e6, 1e9, 2e9, 10e9):  # the default size is long enough (at 2gbit the 3 s capped
        burst, limit = tbf_params(rate)  # at 50 MB were not)
        default = default_mbytes(rate) * 1e6
        assert note({"bytes": default, "tbf_burst_bytes": burst, "tbf_limit_bytes": limit}) == "", rate
    burst, limit = tbf_params(20e9)  # beyond what linktest sends at most, the note says so instead of advice
    assert default_mbytes(20e9) == 512 and "even the most linktest sends (512 MB) is too little" in note(
        {"bytes": 512e6, "tbf_burst_bytes": burst, "tbf_limit_bytes": limit})
    burst, limit = tbf_params(1e9)  # advice rounded up: following it silences the note (32.5 printed as 32)
    assert "give --mbytes 32.5 or more" in note({"bytes": 1e6, "tbf_burst_bytes": burst, "tbf_limit_bytes": limit})


def test_a_simulated_links_folder_left_by_a_killed_launcher_is_removed(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher killed by SIGKILL left its /dev/shm/qwire-simlink-* folder, which nothing removed. Whether
    its launcher runs is the lock it holds on the folder's owner file, not the pid written there: a launcher
    of another pid namespace sharing /dev/shm (a container) has a pid that means nothing here, and its
    folder stays; a folder whose owner file is being written, or is not this version's, stays too."""
    import shutil
    import tempfile

    from qwire.netlab import launch as launch_mod
    from qwire.netlab.launch import SIM_PREFIX, remove_dead_sim_dirs

    # the folders in a root of this test's own: a launch in another test process sweeps /dev/shm too
    monkeypatch.setattr(launch_mod, "_sim_root", lambda: str(tmp_path))
    holder = ("import fcntl, sys, time\n"
              "f = open(sys.argv[1] + '/owner', 'w'); fcntl.flock(f, fcntl.LOCK_EX); f.write('999999 0'); f.flush()\n"
              "print('locked', flush=True); time.sleep(120)\n")
    dirs = [Path(tempfile.mkdtemp(prefix=SIM_PREFIX, dir=tmp_path)) for _ in range(4)]
    dead, live, partial, foreign = dirs
    alive = None
    try:
        killed = subprocess.Popen([sys.executable, "-c", holder, str(dead)], stdout=subprocess.PIPE, text=True)
        alive = subprocess.Popen([sys.executable, "-c", holder, str(live)], stdout=subprocess.PIPE, text=True)
        assert killed.stdout.readline() == alive.stdout.readline() == "locked\n"
        killed.kill()
        killed.wait()
        (partial / "owner").write_text("")
        (foreign / "owner").write_text("not ours at all")
        removed = remove_dead_sim_dirs()
        assert dead in removed and not dead.exists()
        assert live.exists() and partial.exists() and foreign.exists() and live not in removed
    finally:
        if alive is not None:
            alive.kill()
            alive.wait()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_netlab_clean_removes_dead_simulated_link_folders_where_the_lab_cannot_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The simulated link runs where the lab cannot, and that is where its folders pile up: clean removed them
    only after it had found the lab usable, so there it never did."""
    import argparse
    import shutil
    import tempfile

    from qwire.netlab import cli
    from qwire.netlab import launch as launch_mod
    from qwire.netlab.launch import SIM_PREFIX

    monkeypatch.setattr(launch_mod, "_sim_root", lambda: str(tmp_path))  # as above: a root of its own
    dead = Path(tempfile.mkdtemp(prefix=SIM_PREFIX, dir=tmp_path))
    try:
        (dead / "owner").write_text("999999 0")  # no process holds its lock
        monkeypatch.setattr(lab_mod, "lab_unavailable_reason", lambda: "no lab on this machine (test)")
        assert cli.run(argparse.Namespace(action="clean", all=False)) == 1
        out, err = capsys.readouterr()
        assert f"removed the simulated link's folder {dead} (its launcher is gone)" in out and not dead.exists()
        assert "no lab on this machine (test)" in err
    finally:
        shutil.rmtree(dead, ignore_errors=True)


def test_a_namespace_the_kernel_refuses_says_what_the_lab_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CAP_SYS_ADMIN the error was ip's 'mount --make-shared /run/netns failed: Operation not permitted'
    alone."""
    failed = subprocess.CompletedProcess([], 1, "", "mount --make-shared /run/netns failed: Operation not permitted")
    monkeypatch.setattr(lab_mod, "_ip", lambda *a, **k: failed)
    with pytest.raises(lab_mod.LabUnavailable, match=r"Operation not permitted; making network namespaces needs "
                                                      r"root .* or use the simulated link \(mode=sim\)"):
        Lab(2, "10mbit")._ns_add("qwtest")
