"""``auto`` on pipeline boundaries: choose each boundary's codec from the measured link, the measured
codec cost and an error budget.

At step 1 and every ``probe_every`` steps after it (between steps, so a payload's size never changes
within a step), every pipeline measures:

* each link between neighbouring stages: a short probe (two message sizes, timed round trips with a
  1-byte acknowledgement) gives its bandwidth and latency; with qwire's simulated link, the link's own
  model (rate and delay) is used instead, since a probe would bypass it;
* each candidate codec on the real tensor that crossed the boundary in the last step (the last
  micro-batch's activation going forward, or gradient going back), on the sending rank: encode and
  decode time and the normalized error ``||x - x'||^2 / ||x||^2``.

The controller predicts each candidate's time per step on that boundary, ``micro-batches x (encode +
decode + bytes / bandwidth + latency)``, and puts in force the fastest candidate whose measured error
is within the budget (``fp32`` always is). It keeps the codec in force unless another is predicted to be
faster by more than ``min_gain``. Measurements are all-gathered, and every rank computes the decision
from the same numbers: the ranks at both ends of a boundary switch at the same step. All pipelines
(data- and tensor-parallel replicas) adopt the first pipeline's decisions, so the tensor-parallel ranks
of a stage always decode the same codec.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qwire.codecs import get_codec
from qwire.codecs.auto import Auto
from qwire.parallel.pipeline import Boundary, CompressedPipelineStage

DIRECTIONS = ("fwd", "bwd")
PROBE_SMALL = 4 * 1024       # bytes
PROBE_LARGE = 256 * 1024     # bytes, sent only if the small probe was fast
PROBE_SLOW_S = 0.05          # a small probe slower than this: do not send the large one
PROBE_REPS = 2


@dataclass
class Link:
    bytes_per_s: float
    latency_s: float
    source: str  # "probe" or "simulated link"


def autotuned(stage: CompressedPipelineStage) -> bool:
    """Whether any codec on the stage's boundaries is ``auto``."""
    return any(isinstance(getattr(b, d), Auto) for b in (stage.in_boundary, stage.out_boundary) if b is not None
               for d in DIRECTIONS)


class PipelineAutotune:
    """Measures and switches the ``auto`` codecs of one rank's pipeline stage (see the module docstring).

    ``group`` is the pipeline's process group (None: the default group); every rank of the job must call
    :meth:`decide` at the same step.
    """

    def __init__(self, stage: CompressedPipelineStage, group: Any, pp_rank: int, stages: int, microbatches: int,
                 lead: bool, fwd: str, bwd: str) -> None:
        self.stage, self.group, self.pp_rank, self.stages = stage, group, pp_rank, stages
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
        self.probe_every = min((a.probe_every for a in autos), default=0)
        for b in (stage.in_boundary, stage.out_boundary):
            if b is not None:
                b.capture = True  # keep the last tensor each direction sent, for measuring
        self.history: list[dict[str, Any]] = []

    def due(self, step: int) -> bool:
        return step == 1 or bool(self.probe_every and step % self.probe_every == 0)

    # -- measuring --------------------------------------------------------------------------------
    def _peer(self, pp_index: int) -> int:
        return pp_index if self.group is None else dist.get_global_rank(self.group, pp_index)

    def _probe(self) -> dict[int, Link]:
        """Link estimates for the boundaries this rank sends on (boundary k = stage k -> k+1), measured by
        stage k with stage k+1 echoing; boundaries are probed one after the other."""
        out: dict[int, Link] = {}
        sim = getattr(self.stage, "simulated_link", None)
        if sim is not None:  # the simulated link delays payloads at the boundary only: use its model
            spec = sim.spec
            if self.stage.out_boundary is not None:
                out[self.pp_rank] = Link(spec.rate_bits_per_s / 8, spec.delay_s, "simulated link")
            return out
        for k in range(self.stages - 1):
            if self.pp_rank == k:
                out[k] = self._probe_as_sender(self._peer(k + 1))
            elif self.pp_rank == k + 1:
                self._probe_as_echo(self._peer(k))
        return out

    def _probe_as_sender(self, peer: int) -> Link:
        buf = torch.zeros(PROBE_LARGE, dtype=torch.uint8)
        ack = torch.zeros(1, dtype=torch.uint8)
        times: dict[int, float] = {}
        for size in (PROBE_SMALL, PROBE_LARGE):
            go = torch.tensor([size], dtype=torch.int64)
            dist.send(go, peer, group=self.group)  # tells the echo what comes (0: stop)
            best = math.inf
            for _ in range(PROBE_REPS):
                t0 = time.perf_counter()
                dist.send(buf[:size], peer, group=self.group)
                dist.recv(ack, peer, group=self.group)
                best = min(best, time.perf_counter() - t0)
            times[size] = best
            if best > PROBE_SLOW_S:
                break
        dist.send(torch.tensor([0], dtype=torch.int64), peer, group=self.group)
        if len(times) == 1:  # a slow link: the small probe alone, latency unknown (taken as 0)
            return Link(PROBE_SMALL / times[PROBE_SMALL], 0.0, "probe")
        dt = times[PROBE_LARGE] - times[PROBE_SMALL]
        bw = (PROBE_LARGE - PROBE_SMALL) / dt if dt > 0 else math.inf
        lat = max(0.0, (times[PROBE_SMALL] - (PROBE_SMALL / bw if math.isfinite(bw) else 0.0)) / 2)
        return Link(bw, lat, "probe")

    def _probe_as_echo(self, peer: int) -> None:
        buf = torch.zeros(PROBE_LARGE, dtype=torch.uint8)
        ack = torch.zeros(1, dtype=torch.uint8)
        go = torch.zeros(1, dtype=torch.int64)
        while True:
            dist.recv(go, peer, group=self.group)
            size = int(go)
            if size == 0:
                return
            for _ in range(PROBE_REPS):
                dist.recv(buf[:size], peer, group=self.group)
                dist.send(ack, peer, group=self.group)

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
        mine = {"lead": self.lead, "links": {k: vars(v) for k, v in links.items()}, "codecs": measured}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        lead = [m for m in everyone if m["lead"]]
        link_of = {int(k): Link(**v) for m in lead for k, v in m["links"].items()}
        cands = {key: v for m in lead for key, v in m["codecs"].items()}
        in_force = dict(self.now)
        record: dict[str, Any] = {"step": step, "boundaries": {}}
        for key in sorted(cands):
            k = int(key[:-3])
            link = link_of.get(k)
            budget = self._budget(key)
            choice = choose(cands[key], link, self.microbatches, budget.max_nmse, budget.min_gain, in_force[key])
            record["boundaries"][key] = {"link": vars(link) if link else None, "candidates": cands[key],
                                         "max_nmse": budget.max_nmse, "was": in_force[key],
                                         "was_label": self.now_label[key], **choice}
            self._switch(k, key[-3:], choice["codec"])
            self.now[key], self.now_label[key] = choice["codec"], choice["label"]
        self.history.append(record)
        return record

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

    def in_force(self) -> dict[str, list[str]]:
        """The codec in force on every boundary of the pipeline (0, 1, ...), by direction (for metrics)."""
        return {d: [self.now_label[f"{k}{d}"] for k in range(self.stages - 1)] for d in DIRECTIONS}


def measure(codec: Any, x: torch.Tensor, reps: int = 2) -> dict[str, Any]:
    """Encode/decode seconds (best of ``reps``), payload bytes and normalized error of ``codec`` on ``x``."""
    enc = dec = math.inf
    y = x
    for _ in range(reps):
        t0 = time.perf_counter()
        p = codec.encode(x)
        t1 = time.perf_counter()
        y = codec.decode(p, x.shape, x.dtype)
        t2 = time.perf_counter()
        enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
    ref = float(x.double().pow(2).sum())
    err = float((x.double() - y.double()).pow(2).sum())
    nmse = err / ref if ref > 0 else (0.0 if err == 0 else math.inf)
    return {"codec": codec.spec(), "bytes": int(p.numel()), "encode_s": enc, "decode_s": dec, "nmse": nmse}


def choose(cands: list[dict[str, Any]], link: Link | None, microbatches: int, max_nmse: float, min_gain: float,
           current: str) -> dict[str, Any]:
    """The fastest candidate within the error budget (predicted seconds per step), keeping ``current``
    unless another is faster by more than ``min_gain``. Pure: every rank computes the same answer."""
    def predicted(c: dict[str, Any]) -> float:
        wire = 0.0
        if link is not None:
            wire = c["bytes"] / link.bytes_per_s + link.latency_s if link.bytes_per_s > 0 else math.inf
        return microbatches * (c["encode_s"] + c["decode_s"] + wire)

    ok = [c for c in cands if c["nmse"] <= max_nmse or c["codec"] == "fp32"]
    best = min(ok, key=lambda c: (predicted(c), c["codec"]))
    now = next((c for c in ok if c["codec"] == current), None)
    pick = now if now is not None and predicted(now) <= predicted(best) * (1 + min_gain) else best
    return {"codec": pick["codec"], "label": pick.get("label", pick["codec"]), "predicted_s": predicted(pick),
            "predicted_fp32_s":
            next((predicted(c) for c in cands if c["codec"] == "fp32"), math.nan)}
