"""``auto``: choose a codec from the measured link, the measured codec cost and an error budget, on
pipeline boundaries (:class:`PipelineAutotune`) and on the data- and tensor-parallel collectives
(:class:`CollectiveAutotune`). Both are :class:`StepAutotune` controllers: the training loop calls
:meth:`~StepAutotune.arm` before a step and :meth:`~StepAutotune.decide` after it when
:meth:`~StepAutotune.due`, on every rank in the same order. They share the link fit, the measurement of a
candidate on a real tensor (:func:`measure`) and the choice rule (:func:`choose`).

Pipeline boundaries
-------------------

At step 1, every ``probe_every`` steps after it, and when the step time shifts (see
:meth:`StepAutotune.observe`), between steps (so a payload's size never changes within a step), every
pipeline measures:

* each link between neighbouring stages: a short probe (a 64-byte ping, then messages of doubling size
  until one takes 5 ms longer than the ping, best of two, timed round trips with a 1-byte
  acknowledgement) gives its bandwidth and latency; with qwire's simulated link, the link's own model
  (rate and delay) is used instead, since a probe would bypass it;
* each candidate codec on the real tensor that crossed the boundary in the last step (the last
  micro-batch's activation going forward, or gradient going back), on the sending rank: encode and
  decode time and the normalized error ``||x - x'||^2 / ||x||^2``.

The controller predicts each candidate's time per step on that boundary (:func:`predict`: every encode
and decode, and the transfers the schedule cannot hide: under ``1f1b`` every transfer, under ``gpipe``
the first and what each later one takes beyond the stages' measured seconds per chunk; see
:func:`hidden_s`), and puts in force the fastest candidate whose measured error is within the
budget (``fp32`` always is). Candidates predicted within ``min_gain`` of the fastest are a tie: the
codec in force stays if it is one of them, else the one with the lowest measured error is put in force
(:func:`choose`). Measurements are all-gathered, and every rank computes the decision
from the same numbers: the ranks at both ends of a boundary switch at the same step. All pipelines
(data- and tensor-parallel replicas) adopt the first pipeline's decisions, so the tensor-parallel ranks
of a stage always decode the same codec.

Collectives
-----------
For ``--dp-codec``/``--dp-param-codec``/``--tp-codec auto`` one :class:`~qwire.codecs.auto.Auto` object
serves every collective of that dimension on a rank. In a step that is measured, it keeps a copy of the
largest tensor (shard) it encodes and counts the elements it encodes; the controller counts the bytes
the dimension's collectives sent in that step. After the step it measures each candidate on that tensor
(encode, decode, bytes, error) and the group's link (timed all-gathers of growing sizes over the group, or
``auto:link=RATE``), scales the measurements to the step (codec seconds by elements encoded / elements
measured; wire bytes by the bytes sent with the codec in force times the candidate's payload ratio; one
latency per encode), and chooses with :func:`choose`. The decision is per pipeline stage, from the
measurements of the first group of that stage (the data-parallel group of tensor-parallel rank 0, the
tensor-parallel group of replica 0), worst case over its ranks; every group of the stage follows it, and
it takes effect at the next step on every rank.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qwire.codecs import CodecError, get_codec
from qwire.codecs.auto import Auto, link_bits_per_s, shared_option
from qwire.comm.collectives import raw_all_gather
from qwire.parallel.pipeline import Boundary, CompressedPipelineStage

DIRECTIONS = ("fwd", "bwd")
# a 64-byte ping (the latency), then 4 KiB to 256 KiB, doubling: sent in turn while they stay fast
PROBE_SIZES = (64, *(4096 << i for i in range(7)))
PROBE_SLOW_S = 0.005         # a size whose best time is this much longer than the ping's is the last one sent
PROBE_REPS = 2               # times each size is sent (the best time counts)
SHIFT_SKIP = 1               # steps right after a decision that switched codecs left out of the level (a new
                             # codec's first step is slow); none after one that kept every codec
SHIFT_SETTLE = 3             # steps after those whose median step time is the level a shift is measured from
SHIFT_STEPS = 2              # consecutive steps beyond ``shift`` that trigger a re-measurement
SHIFT_JUMP = 2.0             # one step beyond this many times ``shift`` triggers it alone (a link that dropped)
SMALL_NUMEL = 4096           # at most this many elements of the measured tensor time a small message's codec cost
LINK_MEMORY = 3              # probes of one link whose median a periodic decision uses (see StepAutotune.steady)
LINK_JUMP = 2.0              # a periodic probe this many times off that median is probed again (StepAutotune.jumped)


@dataclass
class Link:
    bytes_per_s: float
    latency_s: float
    source: str  # "probe" or "simulated link"


def fit_link(times: dict[int, float], source: str, round_trip: bool) -> Link:
    """Bandwidth and latency from the best seconds of transfers of the smallest size (the ping: its time is
    the latency) and the largest (bytes -> seconds), the line through them; one size alone gives the
    bandwidth with latency taken as 0. The sizes between are left out: a shaped link lets a transfer through
    at the speed of its token bucket until the probe drains it (the lab's 20 Mbit/s link passed 8 KiB in
    0.4-1.6 ms from its 15 KB bucket, then 16 KiB in 7 ms), so a line through the two largest sizes fitted
    half its rate; the largest size, sent after the others, goes at the rate. ``round_trip``: each time
    includes an acknowledgement, so the latency is half the intercept."""
    if len(times) == 1:
        (n, t), = times.items()
        return Link(n / t if t > 0 else math.inf, 0.0, source)
    (n1, t1), *_, (n2, t2) = sorted(times.items())
    bw = (n2 - n1) / (t2 - t1) if t2 > t1 else math.inf
    lat = max(0.0, (t1 - (n1 / bw if math.isfinite(bw) else 0.0)) / (2 if round_trip else 1))
    return Link(bw, lat, source)


def probe_ladder(transfer: Callable[[int], float], scale: int = 1) -> dict[int, float]:
    """The best seconds of each size a probe sends (``scale`` times the size of :data:`PROBE_SIZES`, the
    bytes each transfer puts on the link -> seconds): ``transfer(size)`` sends one message of ``size`` bytes
    and returns its seconds, the same on every rank taking part. The sizes go in turn, :data:`PROBE_REPS`
    times each (the best time counts); the first whose best time is more than :data:`PROBE_SLOW_S` longer
    than the ping's (the smallest size) is the last. A link's latency, however long, does not end the probe
    before a transfer has measured its rate (ending at the first size slower than 5 ms, a 40 ms round trip
    took the 4 KiB message over it for the rate); and one transfer held up on a busy machine (a 4 KiB round
    trip of 5.5 ms on the lab's 1 Gbit/s link, with the ranks sharing 2 cores) does not end it either, as it
    did when the size that ended the probe went once."""
    times: dict[int, float] = {}
    for size in PROBE_SIZES:
        n = size * scale
        for _ in range(PROBE_REPS):
            times[n] = min(times.get(n, math.inf), transfer(size))
        if times[n] - times[PROBE_SIZES[0] * scale] > PROBE_SLOW_S:
            break
    return times


def assumed_link(codecs: list[Auto]) -> Link | None:
    """The link the ``auto`` codecs say to assume (``auto:link=RATE``), or None: measure it."""
    link = shared_option(codecs, "link") if codecs else "measured"
    return None if link == "measured" else Link(link_bits_per_s(link) / 8, 0.0, f"assumed (auto:link={link})")


def over_budget(what: str, entry: dict[str, Any]) -> str | None:
    """The warning for a decision ``entry`` whose codec in force had an error above the budget (or None)."""
    now = next((c for c in entry["candidates"] if c["codec"] == entry["was"]), None)
    if now is None or now["nmse"] <= entry["max_nmse"]:
        return None
    if "refused" in now:
        return f"auto: {entry['was_label']}, in force on {what}, cannot code its last tensor ({now['refused']})"
    return f"auto: the error of {entry['was_label']} on {what} is {now['nmse']:.2e}, above the budget " \
           f"{entry['max_nmse']:g}"


def probe_device(group: Any, device: torch.device | str) -> torch.device:
    """Where a link probe's tensors live: the rank's GPU ``device`` under NCCL (which sends device tensors
    only), the host under gloo (which sends host tensors only, whatever the rank's device)."""
    return torch.device(device) if dist.get_backend(group) == "nccl" else torch.device("cpu")


class StepAutotune:
    """What the ``auto`` controllers share with the training loop: when to measure, and the records.

    Every rank calls, for each controller in the same order: :meth:`arm` before a step that is
    :meth:`due` (or the first step of a run), :meth:`decide` after it (a collective over the job), then
    :meth:`summary` for the metrics and the console; :meth:`in_force` names the codecs in force."""

    probe_every: int = 0
    shift: float = 0.0
    # steps between the one whose time arms a shift-triggered measurement and the measurement: 1 where the
    # tensors to measure are only kept in a step that was armed before it ran (the collectives), 0 where the
    # last ones that crossed are always kept (the pipeline boundaries): measured right after that step, which
    # was not armed, so a controller with arm_ahead 0 must need nothing from arm()
    arm_ahead: int = 1
    history: list[dict[str, Any]]
    _times: list[float]
    _out: int = 0
    _shift_at: int = 0     # the step after which a shift-triggered measurement is due (0: none)
    _shift_from: float = 0.0
    _switched: bool = True  # the last decision put another codec in force somewhere (set by decide())
    _skip: int = SHIFT_SKIP  # steps after the last decision left out of the level

    def due(self, step: int) -> bool:
        return step == 1 or bool(self.probe_every and step % self.probe_every == 0) or step == self._shift_at

    def trigger(self, step: int, first: bool) -> str:
        """Why a measurement happens after ``step``: ``start``, ``every`` (``probe_every``) or ``shift``."""
        if first or step == 1:
            return "start"
        return "shift" if step == self._shift_at else "every"

    def observe(self, step: int, seconds: float, decided: bool) -> None:
        """After every step, on every rank: ``seconds`` is the step time of the slowest rank (the same number
        on every rank, so every rank arms the same step). The first :data:`SHIFT_SETTLE` steps after a
        decision (after :data:`SHIFT_SKIP`) set the level. A measurement is armed, :attr:`arm_ahead` steps
        after this one, when :data:`SHIFT_STEPS` steps in a row then differ from the level by more than
        ``shift`` (a fraction; the link or the load changed), or when the first :data:`SHIFT_STEPS` settling
        steps are all more than ``shift`` above the level before the decision, or the level they set is (a
        decision should not slow the steps down: the link changed while it was measured). One step beyond
        :data:`SHIFT_JUMP` times ``shift`` (from the level, or above the level before the decision, the
        skipped step included: a new codec's first step is slower by less than that) arms it alone: a link
        that dropped far costs one step on the old codec, not two. The
        :data:`SHIFT_SKIP` steps are skipped only after a decision that switched a codec: after one that kept
        them all, the first step is already at the level (a link that changed as it was measured is seen a
        step sooner)."""
        if not hasattr(self, "_times") or decided:
            before = self._level() if decided and hasattr(self, "_times") else None
            self._times, self._out, self._before = [], 0, before
            self._skip = SHIFT_SKIP if not decided or self._switched else 0
            if decided:
                return
        if not self.shift or not math.isfinite(seconds) or self._shift_at > step:
            return
        times = self._times
        if len(times) < self._skip + SHIFT_SETTLE:
            times.append(seconds)
            settled, level = times[self._skip:], self._level()
            if self._before and ((len(settled) >= SHIFT_STEPS and min(settled) > self._before * (1 + self.shift))
                                 or (level is not None and level > self._before * (1 + self.shift))
                                 or seconds > self._before * (1 + SHIFT_JUMP * self.shift)):
                self._arm_shift(step, self._before)
            return
        level = self._level()
        off = abs(seconds / level - 1) if level > 0 else 0.0
        self._out = self._out + 1 if off > self.shift else 0
        if self._out >= SHIFT_STEPS or off > SHIFT_JUMP * self.shift:
            self._arm_shift(step, level)

    def _level(self) -> float | None:
        """The median of the settled step times since the last decision (None until they are all in)."""
        times = getattr(self, "_times", [])
        if len(times) < self._skip + SHIFT_SETTLE:
            return None
        settled = sorted(times[self._skip:])
        return settled[len(settled) // 2]

    def _off(self, key: Any, probe: Link | None) -> float:
        """How many times the bandwidth of ``probe`` is above (> 1) or below (< 1) the median of the probes
        remembered for link ``key`` (1.0 when there is nothing to compare)."""
        hist = self.__dict__.get("_probes", {}).get(key)
        if probe is None or probe.source != "probe" or not hist:
            return 1.0
        med = statistics.median(v.bytes_per_s for v in hist)
        return probe.bytes_per_s / med if med > 0 else 1.0

    def jumped(self, key: Any, probe: Link | None, step: int) -> bool:
        """Whether this periodic ``probe`` of link ``key`` is more than :data:`LINK_JUMP` times off the median of
        the remembered probes: the link changed, or the probe was noisy; the controller then probes that link
        once more and passes the second probe to :meth:`steady`. Pure: every rank computes the same answer."""
        off = self._off(key, probe)
        return step != self._shift_at and not 1 / LINK_JUMP <= off <= LINK_JUMP

    def steady(self, key: Any, probe: Link | None, step: int, again: Link | None = None) -> Link | None:
        """The link to decide with from this decision's ``probe`` of link ``key``: the probe alone at the first
        decision and at a shift-triggered one (the link may just have changed), else the median bandwidth and
        latency of the last :data:`LINK_MEMORY` probes since then, so that one noisy probe of an unchanged link
        does not switch codecs. ``again``: the second probe of a link that :meth:`jumped`; when it is off the
        median on the same side, the link changed: the two new probes replace the old ones (so a link that
        changes without moving the step time is followed at the next periodic decision); when it is not, the
        first probe was noise and counts as one of the last probes. Measured links only: a simulated or assumed
        one is its own model. Every rank calls this with the same gathered probes, so every rank decides with
        the same link."""
        if probe is None or probe.source != "probe":
            return probe
        memory = self.__dict__.setdefault("_probes", {})
        hist = memory.setdefault(key, [])
        off, again_off = self._off(key, probe), self._off(key, again)
        changed = again is not None and ((off > LINK_JUMP and again_off > LINK_JUMP)
                                         or (off < 1 / LINK_JUMP and again_off < 1 / LINK_JUMP))
        if step == self._shift_at or not hist or changed:
            hist.clear()
        if changed:
            hist.append(again)
        hist.append(probe)
        del hist[:-LINK_MEMORY]
        if len(hist) == 1:
            return probe
        return Link(statistics.median(v.bytes_per_s for v in hist), statistics.median(v.latency_s for v in hist),
                    f"probe, median of the last {len(hist)}")

    def _arm_shift(self, step: int, level: float) -> None:
        self._shift_at, self._shift_from = step + self.arm_ahead, level
        self._times, self._out, self._before, self._skip = [], 0, None, SHIFT_SKIP

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the decisions: the codecs in force."""
        return {"kind": type(self).__name__, "now": copy.deepcopy(self.now), "now_label": copy.deepcopy(self.now_label)}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Put the codecs of ``state`` in force (a resumed run goes on with the decisions made before its
        checkpoint); False, changing nothing, when the state is not this controller's."""
        if state.get("kind") != type(self).__name__ or type(state.get("now")) is not type(self.now) or len(
                state["now"]) != len(self.now) or (isinstance(self.now, dict) and set(state["now"]) != set(self.now)):
            return False
        self._restore(state)
        return True

    def _restore(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def arm(self) -> None:
        """Before a step that will be decided on: start capturing what crosses (nothing by default)."""

    def decide(self, step: int) -> dict[str, Any]:
        raise NotImplementedError

    def summary(self, decision: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """Metrics fields of a decision (``auto_next``, ``nmse_*``) and console lines (warnings first)."""
        raise NotImplementedError

    def in_force(self) -> dict[str, Any]:
        """The codecs in force, as metrics fields (``codec_fwd``, ``codec_dp``, ...)."""
        raise NotImplementedError


def autotuned(stage: CompressedPipelineStage) -> bool:
    """Whether any codec on the stage's boundaries is ``auto``."""
    return any(isinstance(getattr(b, d), Auto) for b in (stage.in_boundary, stage.out_boundary) if b is not None
               for d in DIRECTIONS)


class PipelineAutotune(StepAutotune):
    """Measures and switches the ``auto`` codecs of one rank's pipeline stage (see the module docstring).

    ``group`` is the pipeline's process group (None: the default group); every rank of the job must call
    :meth:`decide` at the same step.
    """

    def __init__(self, stage: CompressedPipelineStage, group: Any, pp_rank: int, stages: int, microbatches: int,
                 lead: bool, fwd: str, bwd: str, schedule: str = "1f1b") -> None:
        if schedule not in OVERLAPPING_SCHEDULES + EXPOSING_SCHEDULES:
            raise ValueError(f"auto: no transfer model for the pipeline schedule {schedule!r}; "
                             f"known: {', '.join(OVERLAPPING_SCHEDULES + EXPOSING_SCHEDULES)}")
        self.stage, self.group, self.pp_rank, self.stages = stage, group, pp_rank, stages
        self.schedule = schedule
        # the codec in force on every boundary of the pipeline ("0fwd", "0bwd", ...), this rank's or not
        start = {}
        for d, spec in (("fwd", fwd), ("bwd", bwd)):
            c = get_codec(spec)
            start[d] = (c.in_force(), c.label(c.in_force())) if isinstance(c, Auto) else (c.spec(), spec)
        self.now = {f"{k}{d}": start[d][0] for k in range(stages - 1) for d in DIRECTIONS}
        self.now_label = {f"{k}{d}": start[d][1] for k in range(stages - 1) for d in DIRECTIONS}
        self.microbatches = microbatches
        self.lead = lead  # this rank belongs to the first pipeline, whose measurements decide
        codecs = [getattr(b, d) for b in (stage.in_boundary, stage.out_boundary) if b is not None
                  for d in DIRECTIONS]
        autos = [c for c in codecs if isinstance(c, Auto)]
        for a in autos:
            a.controlled = True
        self.probe_every = shared_option(autos, "probe_every") if autos else 0  # (an option given on one
        self.shift = shared_option(autos, "shift") if autos else 0.0  # direction serves both)
        for b in (stage.in_boundary, stage.out_boundary):
            if b is not None:
                b.capture = True  # keep the last tensor each direction sent, for measuring
        # a shift is measured right after the step that shows it: nothing needs arming before a measured step
        # (arm() is a no-op here), since the boundaries keep the last tensors that crossed
        self.arm_ahead = 0
        self.assumed = assumed_link(autos)
        self.history = []

    # -- measuring --------------------------------------------------------------------------------
    def _peer(self, pp_index: int) -> int:
        return pp_index if self.group is None else dist.get_global_rank(self.group, pp_index)

    def _probe(self, only: set[int] | None = None) -> dict[int, Link]:
        """Link estimates for the boundaries this rank sends on (boundary k = stage k -> k+1), measured by
        stage k with stage k+1 echoing; boundaries are probed one after the other (``only``: just these)."""
        out: dict[int, Link] = {}
        if self.assumed is not None:  # auto:link=RATE
            if self.stage.out_boundary is not None:
                out[self.pp_rank] = self.assumed
            return out
        sim = getattr(self.stage, "simulated_link", None)
        if sim is not None:  # the simulated link delays payloads at the boundary only: use its model
            spec = sim.spec
            if self.stage.out_boundary is not None:
                out[self.pp_rank] = Link(spec.rate_bits_per_s / 8, spec.delay_s, "simulated link")
            return out
        for k in range(self.stages - 1):
            if only is not None and k not in only:
                continue
            if self.pp_rank == k:
                out[k] = self._probe_as_sender(self._peer(k + 1))
            elif self.pp_rank == k + 1:
                self._probe_as_echo(self._peer(k))
        return out

    def _probe_device(self) -> torch.device:
        return probe_device(self.group, self.stage.device)

    def _probe_as_sender(self, peer: int) -> Link:
        """The sizes of :func:`probe_ladder`, each a round trip with a 1-byte acknowledgement. Before each
        transfer the echo is told its size (0: stop)."""
        dev = self._probe_device()
        buf = torch.zeros(PROBE_SIZES[-1], dtype=torch.uint8, device=dev)
        ack = torch.zeros(1, dtype=torch.uint8, device=dev)

        def round_trip(size: int) -> float:
            dist.send(torch.tensor([size], dtype=torch.int64, device=dev), peer, group=self.group)
            t0 = time.perf_counter()
            dist.send(buf[:size], peer, group=self.group)
            dist.recv(ack, peer, group=self.group)
            if dev.type == "cuda":  # NCCL's P2P is asynchronous on the stream
                torch.cuda.synchronize(dev)
            return time.perf_counter() - t0

        times = probe_ladder(round_trip)
        dist.send(torch.tensor([0], dtype=torch.int64, device=dev), peer, group=self.group)
        return fit_link(times, "probe", round_trip=True)

    def _probe_as_echo(self, peer: int) -> None:
        dev = self._probe_device()
        buf = torch.zeros(PROBE_SIZES[-1], dtype=torch.uint8, device=dev)
        ack = torch.zeros(1, dtype=torch.uint8, device=dev)
        go = torch.zeros(1, dtype=torch.int64, device=dev)
        while True:
            dist.recv(go, peer, group=self.group)
            size = int(go)
            if size <= 0 or size > buf.numel():
                return
            dist.recv(buf[:size], peer, group=self.group)
            dist.send(ack, peer, group=self.group)

    def _chunk_s(self) -> dict[str, float]:
        """This stage's mean seconds per forward and per backward chunk in the last step (the schedule
        hides a transfer behind them), or nothing at the first decision of a process: that step's chunks
        also load code and allocate, so they would hide too much."""
        if not self.history:
            return {}
        out = {}
        for d in DIRECTIONS:
            times = list(self.stage.chunk_s[d])[-self.microbatches:]
            if times:
                out[d] = statistics.fmean(times)
        return out

    def _sent_here(self) -> list[tuple[int, str, Boundary]]:
        """(boundary index, direction, boundary) for what this rank encodes: activations forward on its
        output boundary, gradients back on its input boundary."""
        out = []
        if self.stage.out_boundary is not None:
            out.append((self.pp_rank, "fwd", self.stage.out_boundary))
        if self.stage.in_boundary is not None:
            out.append((self.pp_rank - 1, "bwd", self.stage.in_boundary))
        return out

    def _measure(self) -> dict[str, list[dict[str, Any]]]:
        """Each auto codec's candidates on the last tensor this rank sent through it."""
        out: dict[str, list[dict[str, Any]]] = {}
        with torch.random.fork_rng(devices=[]):  # a stochastic candidate must not move the training RNG
            for k, d, b in self._sent_here():
                codec, x = getattr(b, d), b.last_sent.get(d)
                if not isinstance(codec, Auto) or x is None:
                    continue
                out[f"{k}{d}"] = [dict(measure(c, x), label=lab) for lab, c in zip(codec.labels, codec.choices)]
        return out

    # -- deciding -------------------------------------------------------------------------------
    def decide(self, step: int) -> dict[str, Any]:
        """Measure, gather, decide and switch (collective over the job). Returns the decision record."""
        links = self._probe()
        measured = self._measure()
        mine = {"lead": self.lead, "links": {k: vars(v) for k, v in links.items()}, "codecs": measured,
                "stage": self.pp_rank, "chunk_s": self._chunk_s()}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        lead = [m for m in everyone if m["lead"]]
        probes = {int(k): Link(**v) for m in lead for k, v in m["links"].items()}
        chunk = {m["stage"]: m["chunk_s"] for m in lead}
        again = self._probe_again(probes, step)
        link_of = {k: self.steady(k, v, step, again.get(k)) for k, v in sorted(probes.items())}
        cands = {key: v for m in lead for key, v in m["codecs"].items()}
        in_force = dict(self.now)
        record: dict[str, Any] = {"step": step, "boundaries": {}}
        for key in sorted(cands):
            k = int(key[:-3])
            link = link_of.get(k)
            budget = self._budget(key)
            d = key[-3:]
            hide = hidden_s(self.schedule, [chunk.get(k, {}).get(d), chunk.get(k + 1, {}).get(d)])
            choice = choose(cands[key], link, self.microbatches, budget.max_nmse, budget.min_gain, in_force[key],
                            hide)
            record["boundaries"][key] = {"link": vars(link) if link else None, "schedule": self.schedule,
                                         "hide_s": hide,
                                         "probe": vars(probes[k]) if k in probes else None, "candidates": cands[key],
                                         "max_nmse": budget.max_nmse, "was": in_force[key],
                                         "was_label": self.now_label[key], **choice,
                                         **({"probe_again": vars(again[k])} if k in again else {})}
            self._switch(k, key[-3:], choice["codec"])
            self.now[key], self.now_label[key] = choice["codec"], choice["label"]
        self._switched = self.now != in_force  # the whole pipeline's: the same on every rank
        self.history.append(record)
        return record

    def _probe_again(self, probes: dict[int, Link], step: int) -> dict[int, Link]:
        """The second probes of the boundaries whose probe :meth:`jumped` (gathered: every rank gets the first
        pipeline's); none, and no collective, when no probe did (the same answer on every rank)."""
        jumps = {k for k, v in probes.items() if self.jumped(k, v, step)}
        if not jumps:
            return {}
        mine = {"lead": self.lead, "links": {k: vars(v) for k, v in self._probe(jumps).items()}}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {int(k): Link(**v) for m in everyone if m["lead"] for k, v in m["links"].items()}

    def _budget(self, key: str) -> Auto:
        """The auto codec of boundary ``key`` (the same spec on every rank, so any side's options do)."""
        for k, d, b in self._all_sides():
            if f"{k}{d}" == key and isinstance(getattr(b, d), Auto):
                return getattr(b, d)
        # this rank holds no side of that boundary: the spec is the job's, the same for every boundary
        for _, d, b in self._all_sides():
            if d == key[-3:] and isinstance(getattr(b, d), Auto):
                return getattr(b, d)
        return Auto()

    def _all_sides(self) -> list[tuple[int, str, Boundary]]:
        out = []
        for k, b in ((self.pp_rank - 1, self.stage.in_boundary), (self.pp_rank, self.stage.out_boundary)):
            if b is not None:
                out += [(k, d, b) for d in DIRECTIONS]
        return out

    def _switch(self, k: int, d: str, spec: str) -> None:
        for kk, dd, b in self._all_sides():
            if (kk, dd) == (k, d) and isinstance(getattr(b, d), Auto):
                getattr(b, d).switch(spec)

    def _restore(self, state: dict[str, Any]) -> None:
        for key, spec in state["now"].items():
            self._switch(int(key[:-3]), key[-3:], spec)
            self.now[key], self.now_label[key] = spec, state["now_label"][key]

    def in_force(self) -> dict[str, list[str]]:
        """The codec in force on every boundary of the pipeline (0, 1, ...), by direction (for metrics)."""
        return {f"codec_{d}": [self.now_label[f"{k}{d}"] for k in range(self.stages - 1)] for d in DIRECTIONS}

    def summary(self, decision: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        fields: dict[str, Any] = {"auto_next": {key: b["label"] for key, b in decision["boundaries"].items()}}
        lines = []
        for key, b in decision["boundaries"].items():
            now = next((c for c in b["candidates"] if c["codec"] == b["was"]), None)
            if now is not None:
                fields.setdefault("nmse_" + key[-3:], {})[key[:-3]] = now["nmse"]
            warn = over_budget(f"boundary {key[:-3]} ({key[-3:]})", b)
            if warn:
                lines.append(warn)
        lines.append(f"auto after step {decision['step']}: " + ", ".join(
            f"boundary {key[:-3]} {key[-3:]} -> {b['label']} (predicted {b['predicted_s'] * 1e3:.1f} ms/step, "
            f"fp32 {b['predicted_fp32_s'] * 1e3:.1f} ms)" for key, b in decision["boundaries"].items()))
        return fields, lines


class CollectiveAutotune(StepAutotune):
    """Measures and switches the ``auto`` codec of one collective dimension (``"dp"``: data-parallel
    gradients, ``"dp_param"``: FSDP's weight all-gather, ``"tp"``: tensor-parallel collectives) on one rank
    (see the module docstring).

    ``codec`` is the :class:`~qwire.codecs.auto.Auto` object every collective of the dimension on this rank
    encodes with; ``group`` the dimension's process group (its link is probed); ``index`` this rank's
    pipeline stage, ``count`` the number of stages (one decision each); ``lead``: this rank's group is the
    one of its stage whose measurements decide; ``sent``: payload bytes this rank's collectives of the
    dimension have sent so far; ``device``: this rank's device (the probe uses it under NCCL, the host under gloo).
    """

    def __init__(self, dim: str, codec: Auto, group: Any, index: int, count: int, lead: bool,
                 sent: Callable[[], int], device: torch.device) -> None:
        self.dim, self.codec, self.group, self.index, self.count = dim, codec, group, index, count
        codec.controlled = True
        self.lead, self.sent, self.device = lead, sent, probe_device(group, device)
        self.now = [codec.in_force()] * count
        self.now_label = [codec.label(codec.in_force())] * count
        self.probe_every = codec.probe_every
        self.shift = codec.shift
        self.assumed = assumed_link([codec])
        self._sent0 = 0
        self.history = []

    def arm(self) -> None:
        self.codec.watch()
        self._sent0 = self.sent()

    def _probe(self) -> Link:
        """Timed all-gathers over the group (every rank of it takes part) of the sizes of
        :func:`probe_ladder`, each after a barrier; each transfer's time is the slowest rank's, so every rank
        of the group fits the same link (and agrees on when to stop)."""
        world = dist.get_world_size(self.group)
        buf = torch.zeros(PROBE_SIZES[-1], dtype=torch.uint8, device=self.device)
        out = torch.empty(world * PROBE_SIZES[-1], dtype=torch.uint8, device=self.device)

        def all_gather(size: int) -> float:
            dist.barrier(group=self.group)
            t0 = time.perf_counter()
            raw_all_gather(out[:world * size], buf[:size], group=self.group)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
            return float(slowest)

        return fit_link(probe_ladder(all_gather, scale=world - 1), "probe", round_trip=False)

    def _mine(self) -> dict[str, Any]:
        """What this rank measured in the armed step: its link, and each candidate on the largest tensor it
        encoded, scaled to the step."""
        seen = self.codec.watched()
        wire = self.sent() - self._sent0
        link = self.assumed if self.assumed is not None else self._probe()
        mine: dict[str, Any] = {"lead": self.lead, "index": self.index, "link": vars(link), "candidates": []}
        x = seen["x"]
        if not self.lead or x is None or x.numel() == 0:
            return mine
        piece = x.reshape(-1)[: max(1, min(SMALL_NUMEL, x.numel() // 16))]  # for the size threshold
        with torch.random.fork_rng(devices=[]):  # a stochastic candidate must not move the training RNG
            cands = [dict(measure(c, x), label=lab, small=measure(c, piece))
                     for lab, c in zip(self.codec.labels, self.codec.choices)]
        now_bytes = next(c["bytes"] for c in cands if c["codec"] == self.codec.in_force())
        # the tensor measured -> the whole step: encodes by the elements encoded, decodes by those decoded (an
        # all-gather decodes world payloads per encode, an all-reduce's two stages about (2 world - 1) / world)
        scale, dscale = seen["elements"] / x.numel(), seen.get("decoded", seen["elements"]) / x.numel()
        for c in cands:
            small = c.pop("small")
            c.update(measured_bytes=c["bytes"], measured_numel=x.numel(), measured_s=c["encode_s"] + c["decode_s"],
                     small_numel=piece.numel(), small_s=small["encode_s"] + small["decode_s"],
                     bytes=round(wire * c["bytes"] / now_bytes) if now_bytes else 0,
                     encode_s=c["encode_s"] * scale, decode_s=c["decode_s"] * dscale)
        encoded = seen["elements"] * now_bytes / x.numel()  # payload bytes encoded in the step, about
        mine.update(candidates=cands, calls=seen["calls"], elements=seen["elements"], decoded=seen["decoded"],
                    wire_bytes=wire, fanout=wire / encoded if encoded else 0.0)
        return mine

    def decide(self, step: int) -> dict[str, Any]:
        """Measure, gather (over the job), decide per stage and switch (collective over the job)."""
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self._mine())
        record: dict[str, Any] = {"step": step, "dim": self.dim, "groups": {}}
        was = list(self.now)  # every rank's view of every stage: the same on every rank, as _switched must be
        lead = {k: [m for m in everyone if m["lead"] and m["index"] == k and m["candidates"]]
                for k in range(self.count)}
        probes = {k: slowest(Link(**m["link"]) for m in members) for k, members in lead.items() if members}
        again = self._probe_again(probes, step)
        for k in range(self.count):
            members = lead[k]
            if not members:
                continue
            cands = [{**first, **{f: max(m["candidates"][i][f] for m in members)
                                  for f in ("bytes", "encode_s", "decode_s", "nmse")}}
                     for i, first in enumerate(members[0]["candidates"])]
            probe = probes[k]
            slow = self.steady(k, probe, step, again.get(k))
            calls = max(m["calls"] for m in members)
            link = Link(slow.bytes_per_s, slow.latency_s * calls, slow.source)  # a latency per encode
            if self.codec.rule == "shape":  # fp8:group=auto: the group from the measured error, once
                choice, threshold = choose_shape(cands, link, self.codec.shape_tol), 0
                record["groups"][f"{k}{self.dim}"] = {
                    "index": k, "link": vars(slow), "probe": vars(probe), "calls": calls, "candidates": cands,
                    "rule": "shape",
                    "shape_tol": self.codec.shape_tol, "max_nmse": math.inf, "was": self.now[k],
                    "was_label": self.now_label[k], **choice, "min_numel": 0}
                self.now[k], self.now_label[k] = choice["codec"], choice["label"]
                if k == self.index:
                    self.codec.switch(choice["codec"])
                continue
            choice = choose(cands, link, 1, self.codec.max_nmse, self.codec.min_gain, self.now[k])
            threshold = max(size_threshold(
                next(c for c in m["candidates"] if c["codec"] == "fp32"),
                next(c for c in m["candidates"] if c["codec"] == choice["codec"]), m["fanout"], slow)
                for m in members)
            record["groups"][f"{k}{self.dim}"] = {
                "index": k, "link": vars(slow), "probe": vars(probe), "calls": calls, "candidates": cands,
                **({"probe_again": vars(again[k])} if k in again else {}), "max_nmse": self.codec.max_nmse,
                "was": self.now[k], "was_label": self.now_label[k], **choice, "min_numel": threshold}
            self.now[k], self.now_label[k] = choice["codec"], choice["label"]
            if k == self.index:
                self.codec.switch(choice["codec"])
                self.codec.small(threshold)
        self._switched = self.now != was
        self.history.append(record)
        return record

    def _probe_again(self, probes: dict[int, Link], step: int) -> dict[int, Link]:
        """The second probes of the stages whose probe :meth:`jumped`: every group of such a stage probes its
        link again (a collective over the group), and the job gathers them; none, and no collective, when no
        probe jumped (the same answer on every rank)."""
        jumps = {k for k, v in probes.items() if self.jumped(k, v, step)}
        if not jumps:
            return {}
        link = self._probe() if self.index in jumps and self.assumed is None else None
        mine = {"lead": self.lead, "index": self.index, "link": vars(link) if link else None}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        out = {}
        for k in jumps:
            links = [Link(**m["link"]) for m in everyone if m["lead"] and m["index"] == k and m["link"]]
            if links:
                out[k] = slowest(links)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dim": self.dim, "min_numel": self.codec.min_numel}

    def _restore(self, state: dict[str, Any]) -> None:
        self.now, self.now_label = list(state["now"]), list(state["now_label"])
        self.codec.switch(self.now[self.index])
        self.codec.small(int(state.get("min_numel", 0)))

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        return state.get("dim") == self.dim and super().load_state_dict(state)

    def in_force(self) -> dict[str, list[str]]:
        return {f"codec_{self.dim}": list(self.now_label)}

    def summary(self, decision: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        what = {"dp": "data-parallel gradients", "dp_param": "data-parallel weights",
                "tp": "tensor-parallel collectives"}[self.dim]
        groups = decision["groups"]
        fields: dict[str, Any] = {"auto_next": {key: g["label"] for key, g in groups.items()}}
        lines = []
        for g in groups.values():
            now = next((c for c in g["candidates"] if c["codec"] == g["was"]), None)
            if now is not None:
                fields.setdefault(f"nmse_{self.dim}", {})[str(g["index"])] = now["nmse"]
            warn = over_budget(f"the {what} of stage {g['index']}", g)
            if warn:
                lines.append(warn)
        if groups:
            lines.append(f"auto after step {decision['step']}: " + ", ".join(
                f"{what} of stage {g['index']} -> {g['label']} (predicted {g['predicted_s'] * 1e3:.1f} ms/step, "
                f"fp32 {g['predicted_fp32_s'] * 1e3:.1f} ms"
                + (f"; fp32 under {g['min_numel']} elements" if g["min_numel"] else "") + ")"
                for g in groups.values()))
        return fields, lines


def slowest(links: Any) -> Link:
    """The slowest of some links (the lowest bandwidth; of equal ones, the highest latency)."""
    return min(links, key=lambda v: (v.bytes_per_s, -v.latency_s))


def size_threshold(exact: dict[str, Any], chosen: dict[str, Any], fanout: float, link: Link) -> int:
    """Elements below which one tensor is predicted to cross faster as ``fp32`` (``exact``) than with the
    ``chosen`` codec: each codec's seconds per tensor as ``overhead + per-element x n``, fitted through its
    times on a small piece and on the whole measured tensor (``small_numel``/``small_s``,
    ``measured_numel``/``measured_s``); the transfer per element from the payloads and ``fanout`` (wire
    bytes per payload byte encoded). 0 when compression pays at every size (or nothing says otherwise);
    at most the measured tensor's size."""
    if chosen["codec"] == exact["codec"] or not (0 < link.bytes_per_s < math.inf):
        return 0

    def fit(c: dict[str, Any]) -> tuple[float, float]:
        n1, t1, n2, t2 = c["small_numel"], c["small_s"], c["measured_numel"], c["measured_s"]
        per = max(0.0, (t2 - t1) / (n2 - n1)) if n2 > n1 else 0.0
        return max(0.0, t1 - per * n1), per

    (o_e, a_e), (o_c, a_c) = fit(exact), fit(chosen)
    n = chosen["measured_numel"]
    saving = a_e - a_c + (exact["measured_bytes"] - chosen["measured_bytes"]) / n * fanout / link.bytes_per_s
    if o_c <= o_e or saving <= 0:
        return 0
    return min(math.ceil((o_c - o_e) / saving), n)


def measure(codec: Any, x: torch.Tensor, reps: int = 2) -> dict[str, Any]:
    """Encode/decode seconds (best of ``reps``), payload bytes and normalized error of ``codec`` on ``x``. A
    candidate that refuses ``x`` (a value past fp16's range, NaN or Inf where its policy refuses them) gets
    an infinite error, which keeps it out of the decision, and its reason (``refused``): trying it must not
    stop a run that trains on with the codec in force."""
    enc = dec = math.inf
    y = x
    for _ in range(reps):
        t0 = time.perf_counter()
        try:
            p = codec.encode(x)
        except CodecError as exc:
            return {"codec": codec.spec(), "bytes": int(codec.payload_nbytes(x.shape, x.dtype)), "encode_s": 0.0,
                    "decode_s": 0.0, "nmse": math.inf, "refused": str(exc)}
        t1 = time.perf_counter()
        y = codec.decode(p, x.shape, x.dtype)
        t2 = time.perf_counter()
        enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
    ref = float(x.double().pow(2).sum())
    err = float((x.double() - y.double()).pow(2).sum())
    nmse = err / ref if ref > 0 else (0.0 if err == 0 else math.inf)
    return {"codec": codec.spec(), "bytes": int(p.numel()), "encode_s": enc, "decode_s": dec, "nmse": nmse}


# Pipeline schedules by what their transfers overlap with (qwire.train.SCHEDULES; torch's implementations).
# ScheduleGPipe fires each micro-batch's send and waits for all of them only after the last forward (backward)
# chunk, so a transfer runs while the sender computes the next micro-batches. Schedule1F1B waits for each send
# together with the next receive before its next chunk ("fwd_send_bwd_recv", "bwd_send_fwd_recv"): in the
# steady state a stage's forward output crosses, the next stage computes, its gradient crosses back, and only
# then does the first stage go on, so every transfer lies on the step's critical path. (Measured on the network
# lab, qwire bench adaptive: a 2-stage 1f1b pipeline of llama-micro at 200 Mbit/s ran 15-25 ms per step slower
# with fp32 than with fp16 over six runs, median 19 ms, against 21 ms for the eight transfers' difference in
# full and 5 ms for the first transfer of each direction alone.)
OVERLAPPING_SCHEDULES = ("gpipe",)
EXPOSING_SCHEDULES = ("1f1b",)


def hidden_s(schedule: str, sides: list[float | None]) -> float:
    """Seconds of each transfer after the first that ``schedule`` hides behind compute on a boundary: under a
    schedule that overlaps sends with the next chunks (``gpipe``), the slower of the boundary's two stages'
    mean seconds per chunk in that direction (``sides``; 0 while either is unknown, as at a process's first
    decision, whose chunks also load code); under ``1f1b``, 0 (it waits for every send before its next chunk,
    see :data:`EXPOSING_SCHEDULES`)."""
    if schedule in EXPOSING_SCHEDULES or any(v is None for v in sides):
        return 0.0
    return max(v for v in sides if v is not None)


def predict(c: dict[str, Any], link: Link | None, microbatches: int, hide_s: float = 0.0) -> float:
    """Predicted seconds per step of a measured candidate: ``microbatches x (encode + decode)`` plus the
    transfers the schedule cannot hide. A schedule that sends micro-batch i while the stages compute the next
    ones (``gpipe``), with ``hide_s`` seconds of compute per micro-batch (:func:`hidden_s`), adds only the first
    transfer and what each later one takes beyond ``hide_s``: ``transfer + (microbatches - 1) x max(0,
    transfer - hide_s)``; ``hide_s`` 0 (``1f1b``, which waits for each transfer; nothing known yet; or one
    tensor per step as on the collectives) adds every transfer: ``microbatches x (encode + decode +
    transfer)``."""
    wire = 0.0
    if link is not None:
        x = c["bytes"] / link.bytes_per_s + link.latency_s if link.bytes_per_s > 0 else math.inf
        wire = x + (microbatches - 1) * max(0.0, x - hide_s)
    return microbatches * (c["encode_s"] + c["decode_s"]) + wire


def choose_shape(cands: list[dict[str, Any]], link: Link | None, tol: float) -> dict[str, Any]:
    """TACO's data-driven reshaping (``rule=shape``): among the non-fp32 candidates (one codec at several
    group sizes), the smallest payload whose measured error is within ``tol`` of the lowest error, so a
    larger group is kept unless smaller groups buy a real drop in error (outliers the group's scale must
    follow). Pure: every rank computes the same answer."""
    shapes = [c for c in cands if c["codec"] != "fp32"]
    lowest = min(c["nmse"] for c in shapes)
    ok = [c for c in shapes if c["nmse"] <= lowest * (1 + tol) + 1e-30]
    pick = min(ok, key=lambda c: (c["bytes"], c["nmse"], c["codec"]))
    return {"codec": pick["codec"], "label": pick.get("label", pick["codec"]), "lowest_nmse": lowest,
            "predicted_s": predict(pick, link, 1),
            "predicted_fp32_s": next((predict(c, link, 1) for c in cands if c["codec"] == "fp32"), math.nan)}


def choose(cands: list[dict[str, Any]], link: Link | None, microbatches: int, max_nmse: float, min_gain: float,
           current: str, hide_s: float = 0.0) -> dict[str, Any]:
    """A candidate within the error budget whose predicted seconds per step (:func:`predict`) are within
    ``min_gain`` of the fastest's: ``current`` if it is one of them, else the one of them with the lowest
    measured error (the fastest when ``min_gain`` is 0). A prediction closer than ``min_gain`` is a tie,
    and a tie buys no speed worth more error: on the network lab's 200 Mbit/s link ``tahquant`` and
    ``int8`` were predicted 3-8% apart, and either ran the faster, depending on the run (``qwire bench
    adaptive``). Pure: every rank computes the same answer."""
    def predicted(c: dict[str, Any]) -> float:
        return predict(c, link, microbatches, hide_s)

    ok = [c for c in cands if c["nmse"] <= max_nmse or c["codec"] == "fp32"]
    fastest = min(predicted(c) for c in ok)
    near = [c for c in ok if predicted(c) <= fastest * (1 + min_gain)]
    now = next((c for c in near if c["codec"] == current), None)
    pick = now if now is not None else min(near, key=lambda c: (c["nmse"], predicted(c), c["codec"]))
    return {"codec": pick["codec"], "label": pick.get("label", pick["codec"]), "predicted_s": predicted(pick),
            "predicted_fp32_s":
            next((predicted(c) for c in cands if c["codec"] == "fp32"), math.nan)}
