"""A simulated slow link: where the network lab cannot run, delay payloads as a link would.

The real bytes go over loopback at once; each rank records when it posts a
send (and its exact byte count) and when it posts a receive, in a small log
shared by the two ranks of each pair; the receiving rank then computes when
the payload would have arrived over the link and waits until then, right
before it uses it (the start of ``forward_one_chunk`` /
``backward_one_chunk``). Processes on one machine share one monotonic
clock, so this needs no clock synchronisation (and works on one machine only).

The model of one pair of ranks (the default, ``gloo``):

* Each direction is one TCP stream, a FIFO at ``rate`` bits/s: a payload of
  ``n`` bytes occupies it for ``wire_bytes(n) * 8 / rate`` seconds and arrives
  ``delay`` (+- ``jitter``) after it has left. ``wire_bytes`` adds the
  TCP/IPv4/Ethernet framing that ``tc`` counts (66 bytes per 1448-byte
  segment), which is why a real 100 mbit link moves about 95.6 Mbit/s of
  payload. Like the lab's ``tbf``, the stream has a token bucket of ``burst``
  bytes (:func:`qwire.netlab.lab.tbf_params`) that refills while it is idle,
  so the first ``burst`` bytes after a pause leave at once (it matters for
  small payloads on slow links: 15 kB is 60 ms at 2 mbit).
* gloo's rendezvous: a payload starts only once the receiver's "ready to
  receive" note has reached the sender. The receiver sends that note when it
  posts the receive, on its own stream towards the sender, so the note waits
  behind any payload the receiver has already started sending the other way,
  and then takes ``delay`` to arrive. So a transfer cannot overlap with the
  receiver's computation before it posts the receive, and two neighbours
  sending to each other at once take turns.
* ``start = max(send posted, note arrived, previous payload on this stream
  left)``; ``arrival = start + transfer + delay``.

``QWIRE_SIMLINK_MODEL=duplex`` drops the rendezvous (``start = max(send posted,
previous payload left)``): independent full-duplex links, as a bandwidth /
latency model without the transport would assume.

What the model leaves out (docs/netlab.md has the measured difference): TCP
dynamics (slow start, loss recovery, queueing of ACKs behind data), packet
loss (not modelled), the sharing of one uplink by a middle stage's two
streams (each stream gets the full rate here), and the small collectives the
training loop runs outside the pipeline (loss and gradient-norm
all-reduces), which cross the real lab link but are free here.

Hooking it into a pipeline stage is one call after the stage is built::

    from qwire.netlab.simulated import attach_from_env
    attach_from_env(stage)   # no-op unless the launcher asked for a simulated link
"""

from __future__ import annotations

import bisect
import fcntl
import math
import os
import random
import struct
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qwire.netlab.lab import tbf_params
from qwire.netlab.spec import LinkSpec, parse_link

__all__ = ["SimulatedLink", "attach", "attach_from_env", "wire_bytes", "ENV_SPEC", "ENV_DIR", "ENV_MODEL",
           "MODELS", "MSS", "FRAME_OVERHEAD"]

# Environment variables through which a launcher hands the link to its workers.
ENV_SPEC = "QWIRE_SIMLINK"
ENV_LINKS = "QWIRE_LINKS"  # the run's link options, for its workers (whose own config has none: the lab shapes)
ENV_DIR = "QWIRE_SIMLINK_DIR"
ENV_MODEL = "QWIRE_SIMLINK_MODEL"   # "gloo" (default) or "duplex"
MODELS = ("gloo", "duplex")

MSS = 1448            # TCP payload per segment on a 1500-byte MTU link with TCP timestamps
FRAME_OVERHEAD = 66   # Ethernet header 14 + IPv4 20 + TCP 20 + timestamps option 12 (what tc counts per frame)
_SEND, _RECV = 0, 1
_REC = struct.Struct("<BB6xdq")   # kind, direction, time posted, bytes


def wire_bytes(payload: int, mss: int = MSS, overhead: int = FRAME_OVERHEAD) -> int:
    """Bytes a ``payload``-byte message occupies on the link, with per-segment framing."""
    segments = max(1, math.ceil(payload / mss))
    return payload + segments * overhead


class _Pair:
    """The shared log of one pair of ranks ``a < b`` and the model computed from it.

    Direction 0 is ``a -> b``, direction 1 is ``b -> a``. The k-th send of a direction is
    the k-th receive of that direction (one tag, in order, as the pipeline schedules use them).
    Records are appended under an exclusive lock with the time taken inside it, so the log is
    in time order, and a record missing when it is read was posted later than that.
    """

    def __init__(self, path: Path, spec: LinkSpec, model: str, seed: int, clock: Callable[[], float],
                 burst: float) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self.spec, self.model, self.seed, self.clock = spec, model, seed, clock
        self.sends: tuple[list[float], list[float]] = ([], [])   # posting times, per direction
        self.nbytes: tuple[list[int], list[int]] = ([], [])
        self.recvs: tuple[list[float], list[float]] = ([], [])
        self._read = 0
        self._start: tuple[dict[int, float], dict[int, float]] = ({}, {})
        self._finish: tuple[dict[int, float], dict[int, float]] = ({}, {})
        self._tokens: tuple[dict[int, float], dict[int, float]] = ({}, {})
        self.burst = burst
        self._arrival: tuple[dict[int, float], dict[int, float]] = ({}, {})

    def post(self, kind: int, direction: int, nbytes: int = 0) -> float:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            t = self.clock()
            os.write(self.fd, _REC.pack(kind, direction, t, nbytes))
            self._refresh()
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        return t

    def arrival(self, d: int, k: int) -> float | None:
        """When payload ``k`` of direction ``d`` arrives, or None if it was never sent."""
        fcntl.flock(self.fd, fcntl.LOCK_SH)
        try:
            self._refresh()
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        if k >= len(self.sends[d]) or k >= len(self.recvs[d]):
            return None
        for i in range(len(self._arrival[d]), k + 1):  # in order: each one queues behind the one before
            finish = self.finish(d, i)
            arrival = finish + self.spec.delay_s
            if self.spec.jitter_s:
                arrival += random.Random(hash((self.seed, d, i))).uniform(-self.spec.jitter_s, self.spec.jitter_s)
            self._arrival[d][i] = max(arrival, finish, self._arrival[d].get(i - 1, 0.0))  # one stream: in order
        return self._arrival[d][k]

    def transfer_time(self, nbytes: int) -> float:
        return wire_bytes(nbytes) * 8 / self.spec.rate_bits_per_s

    def start(self, d: int, k: int) -> float:
        """When payload ``k`` of direction ``d`` starts to leave (both its send and receive are posted)."""
        memo = self._start[d]
        if k in memo:
            return memo[k]
        for i in range(max(memo, default=-1) + 1, k):  # the stream's earlier payloads first (keeps recursion short)
            self.start(d, i)
        s = self.sends[d][k]
        if k > 0:
            s = max(s, self._finish[d][k - 1])
        if self.model == "gloo":
            s = max(s, self._note_leaves(1 - d, self.recvs[d][k]) + self.spec.delay_s)
        # Token bucket, as the lab's tbf: tokens (bytes) refill at the rate up to `burst` while the
        # stream is idle, and that many bytes of a payload leave at once.
        rate = self.spec.rate_bits_per_s / 8
        tokens = self.burst if k == 0 else min(self.burst, self._tokens[d][k - 1] + (s - self._finish[d][k - 1]) * rate)
        wire = wire_bytes(self.nbytes[d][k])
        memo[k] = s
        self._finish[d][k] = s + max(0.0, wire - tokens) / rate
        self._tokens[d][k] = max(0.0, tokens - wire)
        return s

    def finish(self, d: int, k: int) -> float:
        """When the last byte of payload ``k`` of direction ``d`` has left."""
        self.start(d, k)
        return self._finish[d][k]

    def _lower_bound(self, d: int, k: int) -> float:
        lb = self.sends[d][k]
        return max(lb, self.recvs[d][k] + self.spec.delay_s) if self.model == "gloo" else lb

    def _note_leaves(self, e: int, t: float) -> float:
        """A note posted at ``t`` on stream ``e`` leaves after the payloads that started on ``e`` before ``t``."""
        j = min(bisect.bisect_left(self.sends[e], t), len(self.recvs[e])) - 1  # candidates: posted before t
        while j >= 0:
            if self._lower_bound(e, j) < t:
                st = self.start(e, j)
                if st < t:  # the last payload that started before t: the stream is FIFO, it leaves last
                    return max(t, self._finish[e][j])
            j -= 1
        return t

    def _refresh(self) -> None:
        size = os.fstat(self.fd).st_size
        n = (size - self._read) // _REC.size
        if n <= 0:
            return
        data = os.pread(self.fd, n * _REC.size, self._read)
        self._read += n * _REC.size
        for kind, d, t, nbytes in _REC.iter_unpack(data):
            if kind == _SEND:
                self.sends[d].append(t)
                self.nbytes[d].append(nbytes)
            else:
                self.recvs[d].append(t)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class SimulatedLink:
    """One rank's end of the simulated links to its pipeline neighbours.

    Args:
        spec: the link (rate, delay, jitter; loss is ignored).
        directory: a directory shared by all ranks of one pipeline, holding one small
            log per pair of stages (``pair-<a>-<b>.log``). With data or tensor
            parallelism each pipeline (the ranks with the same dp and tp coordinates)
            needs its own directory, since stages are named by their index.
        me: this rank's stage index.
        clock, sleep: injectable for tests (default ``time.monotonic``, ``time.sleep``).
        seed: seeds the jitter (every rank must use the same).
        model: ``gloo`` (default) or ``duplex``; see the module docstring.
        burst: token bucket size in bytes (default: the lab's tbf burst for this rate; 0: none).

    Call :meth:`send` before a payload's send is posted, :meth:`recv` before a
    receive is posted, and :meth:`wait` once the payload is about to be used.
    """

    def __init__(self, spec: LinkSpec | str, directory: str | os.PathLike[str], me: int, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 seed: int = 0, model: str = "gloo", burst: float | None = None) -> None:
        if model not in MODELS:
            raise ValueError(f"simulated link model must be one of {', '.join(MODELS)}, got {model!r}")
        self.model = model
        self.spec = parse_link(spec)
        self.burst = float(tbf_params(self.spec.rate_bits_per_s)[0] if burst is None else burst)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.me = me
        self.seed = seed
        self.clock, self.sleep = clock, sleep
        self._pairs: dict[int, _Pair] = {}
        self._waits: dict[int, int] = {}
        self.sent_messages = 0
        self.sent_bytes = 0
        self.waited_s = 0.0
        self.missing = 0

    def _pair(self, peer: int) -> tuple[_Pair, int, int]:
        """The pair with ``peer``, and the directions me -> peer and peer -> me."""
        p = self._pairs.get(peer)
        a, b = sorted((self.me, peer))
        if p is None:
            p = self._pairs[peer] = _Pair(self.dir / f"pair-{a}-{b}.log", self.spec, self.model, self.seed,
                                          self.clock, self.burst)
        out = 0 if self.me == a else 1
        return p, out, 1 - out

    def transfer_time(self, nbytes: int) -> float:
        """Seconds one ``nbytes`` payload occupies the link."""
        return wire_bytes(nbytes) * 8 / self.spec.rate_bits_per_s

    def send(self, dst: int, nbytes: int) -> None:
        """Record that a payload of ``nbytes`` for rank ``dst`` is being posted now."""
        p, out, _ = self._pair(dst)
        p.post(_SEND, out, nbytes)
        self.sent_messages += 1
        self.sent_bytes += nbytes

    def recv(self, src: int) -> None:
        """Record that a receive of the next payload from rank ``src`` is being posted now."""
        p, _, inc = self._pair(src)
        p.post(_RECV, inc)

    def arrival(self, src: int, k: int) -> float | None:
        """When the ``k``-th payload from rank ``src`` arrives (None if it was not sent and received)."""
        p, _, inc = self._pair(src)
        return p.arrival(inc, k)

    def wait(self, src: int) -> float:
        """Block until the next payload from rank ``src`` has arrived over the link; returns seconds slept."""
        k = self._waits.get(src, 0)
        self._waits[src] = k + 1
        arrival = self.arrival(src, k)
        if arrival is None:
            self.missing += 1
            if self.missing == 1:
                warnings.warn(f"simulated link: no record of payload {k} from rank {src} to rank {self.me}; is the "
                              "simulated link attached on every rank?", RuntimeWarning, stacklevel=2)
            return 0.0
        delay = arrival - self.clock()
        if delay > 0:
            self.sleep(delay)
            self.waited_s += delay
            return delay
        return 0.0

    def stats(self) -> dict[str, Any]:
        return {"rank": self.me, "sent_messages": self.sent_messages, "sent_bytes": self.sent_bytes,
                "waited_s": self.waited_s, "missing_records": self.missing}

    def close(self) -> None:
        for p in self._pairs.values():
            p.close()
        self._pairs.clear()

    def __del__(self) -> None:
        self.close()


def _nbytes(ops: list[Any]) -> int:
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops)


def attach(stage: Any, link: SimulatedLink) -> Any:
    """Make a pipeline stage's payloads cross ``link``: sends and receives are recorded as they
    are posted (sends with their exact byte counts), and each received payload is held back
    until its simulated arrival.

    Works on any ``torch.distributed.pipelining`` stage with one stage per rank
    (``stage.stage_index`` talks to ``stage_index +- 1``) under the GPipe and
    1F1B schedules; wraps six methods of this stage object only.
    """
    idx, n = stage.stage_index, stage.num_stages
    fwd_send, bwd_send = stage.get_fwd_send_ops, stage.get_bwd_send_ops
    fwd_recv, bwd_recv = stage.get_fwd_recv_ops, stage.get_bwd_recv_ops
    fwd_chunk, bwd_chunk = stage.forward_one_chunk, stage.backward_one_chunk

    def get_fwd_send_ops(*args: Any, **kwargs: Any) -> list[Any]:
        ops = fwd_send(*args, **kwargs)
        if ops:
            link.send(idx + 1, _nbytes(ops))
        return ops

    def get_bwd_send_ops(*args: Any, **kwargs: Any) -> list[Any]:
        ops = bwd_send(*args, **kwargs)
        if ops:
            link.send(idx - 1, _nbytes(ops))
        return ops

    def get_fwd_recv_ops(*args: Any, **kwargs: Any) -> list[Any]:
        ops = fwd_recv(*args, **kwargs)
        if ops:
            link.recv(idx - 1)
        return ops

    def get_bwd_recv_ops(*args: Any, **kwargs: Any) -> list[Any]:
        ops = bwd_recv(*args, **kwargs)
        if ops:
            link.recv(idx + 1)
        return ops

    def forward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        if idx > 0:
            link.wait(idx - 1)
        return fwd_chunk(*args, **kwargs)

    def backward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        if idx < n - 1 and getattr(stage, "has_backward", True):  # eval() calls it but receives nothing
            link.wait(idx + 1)
        return bwd_chunk(*args, **kwargs)

    stage.get_fwd_send_ops = get_fwd_send_ops
    stage.get_bwd_send_ops = get_bwd_send_ops
    stage.get_fwd_recv_ops = get_fwd_recv_ops
    stage.get_bwd_recv_ops = get_bwd_recv_ops
    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.simulated_link = link
    return stage


def attach_from_env(stage: Any) -> SimulatedLink | None:
    """Attach a simulated link if the launcher set ``QWIRE_SIMLINK`` (the link spec) and
    ``QWIRE_SIMLINK_DIR`` (a directory shared by the ranks of this rank's pipeline; the launcher gives each
    pipeline of a data- or tensor-parallel run its own); otherwise do nothing. Only the traffic between
    pipeline stages is simulated, never tensor- or data-parallel collectives.

    Call it on every rank right after building the stage (a second call is a no-op).
    """
    spec, directory = os.environ.get(ENV_SPEC), os.environ.get(ENV_DIR)
    if not spec or not directory:
        return None
    if getattr(stage, "simulated_link", None) is not None:  # already attached
        return stage.simulated_link
    link = SimulatedLink(spec, directory, stage.stage_index, seed=int(os.environ.get("QWIRE_SIMLINK_SEED", "0")),
                         model=os.environ.get(ENV_MODEL) or "gloo")
    attach(stage, link)
    (Path(directory) / f"attached-{stage.stage_index}").touch()  # lets the launcher check the hook is wired
    return link
