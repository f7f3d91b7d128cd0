"""``auto``: a codec that is one of several candidates at a time, chosen from measurements.

``auto`` itself measures nothing: it holds the candidate codecs and the one in force (``current``).
A controller that sees both ends of a link (:mod:`qwire.parallel.autotune`: pipeline boundaries, and the
data- and tensor-parallel collectives) measures the link and each candidate on the real tensors, and
switches every end to the same candidate at a step boundary. For collectives, :meth:`Auto.watch` makes
the codec keep (a copy of) the largest tensor it encodes and count what it encodes until
:meth:`Auto.watched`: the controller measures the candidates on that tensor. It may also set a size
(:meth:`Auto.small`) below which tensors go as ``fp32``.

Until the first decision the codec in force is the first candidate (by default ``fp32``, exact).
Payloads are those of the codec in force; ``max_payload_nbytes`` is the largest candidate's, so
buffers sized once hold any of them.

Spec: ``auto[:max_nmse=0.02,candidates=fp32+fp16+int8+tahquant,probe_every=100,shift=0.3,min_gain=0.05,
link=measured]``.
``candidates`` are codec names or presets joined by ``+``; ``fp32`` is always a candidate (so a
budget can always be met). The default candidates depend on the role (:data:`ROLE_CANDIDATES`, see
:func:`auto_for`). ``link=RATE`` (e.g. ``link=100mbit``; default ``measured``) makes the controller assume
a link of that rate (and no latency) instead of measuring one.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .base import Codec, CodecError, Param
from .registry import get_codec, nested_codec, parse_spec, register

DEFAULT_CANDIDATES = "fp32+fp16+int8+tahquant"
UNCONTROLLED_WARN_AFTER = 64  # encodes by an `auto` no controller drives before it says so
# The candidates of a bare ``auto`` by where it is used: pipeline activations and their gradients (the
# spec's own default), data-parallel gradients (QuanGrad's 8-bit blocks), FSDP's weight all-gather and the
# tensor-parallel collectives (TACO's fp8).
ROLE_CANDIDATES = {"pipeline": DEFAULT_CANDIDATES, "dp": "fp32+fp16+blockwise8", "dp_param": "fp32+bf16+fp8",
                   "tp": "fp32+bf16+fp8"}


def shared_option(autos: list[Any], key: str) -> Any:
    """The value of ``key`` (``link``, ``probe_every``, ``shift``) for one controller that serves several ``auto``
    codecs (a pipeline stage's two directions): the value given on any of them (one that is not the default),
    else the default. Two different given values raise a :class:`CodecError`."""
    default = next(p.default for p in Auto.params if p.name == key)
    given = sorted({getattr(a, key) for a in autos} - {default}, key=str)
    if len(given) > 1:
        raise CodecError(f"one controller measures a stage's links and decides both directions, so their {key} "
                         f"must agree: {', '.join(f'{key}={v}' for v in given)}; give one value (on one "
                         "direction, it serves both)")
    return given[0] if given else default


class Auto(Codec):
    name = "auto"
    nested = {"candidates": "plus"}
    params = (
        Param("max_nmse", float, 0.02, "error budget: largest normalized MSE (||x - x'||^2 / ||x||^2) accepted",
              lo=0.0),
        Param("candidates", str, DEFAULT_CANDIDATES, "codecs to choose from, joined by '+' (a candidate's "
              "options joined by ';', e.g. fp8:format=e4m3;group=64)"),
        Param("probe_every", int, 100, "steps between re-measurements (0: only at the start)", lo=0),
        Param("shift", float, 0.3, "also re-measure when the step time (slowest rank) moves by more than this "
              "fraction from its level after the last decision, two steps in a row, or one step by more than twice it "
              "(0: off)", lo=0.0),
        Param("min_gain", float, 0.05, "candidates predicted within this fraction of the fastest are a tie: "
              "the codec in force stays, else the lowest-error one of them is chosen", lo=0.0, hi=1.0),
        Param("link", str, "measured", "the link rate to assume, e.g. 100mbit (measured: probe the link)"),
        Param("rule", str, "time", "time: the fastest candidate within the budget; shape: the smallest payload "
              "whose error is within shape_tol of the lowest (TACO's group shape, see fp8:group=auto)",
              choices=("time", "shape")),
        Param("shape_tol", float, 0.25, "rule=shape: error allowed above the lowest candidate's, as a fraction",
              lo=0.0),
    )

    def _validate(self) -> None:
        names = [c.strip() for c in self.candidates.split("+") if c.strip()]
        if not names:
            raise CodecError("codec 'auto': candidates is empty; give codec names joined by '+', e.g. fp32+int8")
        if self.rule == "shape" and not [n for n in names if n.split(":")[0].strip() != "fp32"]:
            raise CodecError("codec 'auto': rule=shape chooses among the candidates other than fp32, and there is "
                             "none; give them, e.g. candidates=fp8:group=64+fp8:group=128")
        if "fp32" not in names:  # rule=shape chooses among the shapes: fp32 only for tiny tensors, never first
            names.insert(len(names) if self.rule == "shape" else 0, "fp32")
        if self.link != "measured":
            link_bits_per_s(self.link)  # a bad rate fails here
        self.labels: list[str] = names  # as the user named them (for logs); choices[i] is labels[i]'s codec
        self.choices: list[Codec] = []
        for n in names:
            if n.split(":")[0] == "auto":
                raise CodecError("codec 'auto': auto cannot be its own candidate")
            c = nested_codec(n, "codec 'auto': candidate")
            if c.stateful:
                raise CodecError(f"codec 'auto': candidate {n!r} keeps per-sample state (AQ-SGD); "
                                 "choose stateless candidates")
            self.choices.append(c)
        self.current: Codec = self.choices[0]
        self.exact: Codec = self.choices[names.index("fp32")]
        self.min_numel = 0  # tensors with fewer elements are sent by fp32 (set by a controller, see small())
        self._watch: dict[str, Any] | None = None  # see watch()
        self._lock = threading.Lock()  # DDP's hook encodes on a background thread
        self.controlled = False  # a controller of qwire.parallel.autotune switches it (see encode)
        self._encodes = 0

    # What crosses (for the controllers of collectives) ---------------------------------
    def watch(self) -> None:
        """From now on keep a copy of the largest tensor encoded and count the encodes (until :meth:`watched`)."""
        with self._lock:
            self._watch = {"x": None, "elements": 0, "calls": 0, "decoded": 0}

    def watched(self) -> dict[str, Any]:
        """Stop watching; ``{"x": largest tensor encoded or None, "elements": ..., "calls": ..., "decoded": ...}``
        (elements encoded, encodes, elements decoded)."""
        with self._lock:
            out, self._watch = self._watch or {"x": None, "elements": 0, "calls": 0, "decoded": 0}, None
        return out

    # The codec in force ----------------------------------------------------------------
    def switch(self, spec: str) -> None:
        """Put the candidate ``spec`` in force (both ends of a link must switch at the same step)."""
        for c in self.choices:
            if c.spec() == spec:
                self.current = c
                return
        raise CodecError(f"codec 'auto': {spec!r} is not one of its candidates "
                         f"({', '.join(c.spec() for c in self.choices)})")

    def in_force(self) -> str:
        return self.current.spec()

    def small(self, min_numel: int) -> None:
        """From now on send tensors of fewer than ``min_numel`` elements with ``fp32`` (0: none); like
        :meth:`switch`, every end of a link must do it at the same step."""
        self.min_numel = max(0, int(min_numel))

    def _for(self, shape: Sequence[int]) -> Codec:
        if self.min_numel and math.prod(int(d) for d in shape) < self.min_numel:
            return self.exact
        return self.current

    def label(self, spec: str) -> str:
        """The name the user gave a candidate (``int8`` for ``int:bits=8,...``)."""
        for lab, c in zip(self.labels, self.choices):
            if c.spec() == spec:
                return lab
        return spec

    # The contract: the codec in force -----------------------------------------------
    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return self._for(shape).payload_nbytes(shape, dtype)

    def max_payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return max(c.payload_nbytes(shape, dtype) for c in self.choices)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self._watch is not None:
            with self._lock:
                w = self._watch
                if w is not None:
                    w["elements"] += x.numel()
                    w["calls"] += 1
                    if w["x"] is None or x.numel() > w["x"].numel():
                        w["x"] = x.detach().clone()
        if not self.controlled:
            self._encodes += 1
            if self._encodes == UNCONTROLLED_WARN_AFTER:
                warnings.warn(
                    f"codec 'auto' has encoded {UNCONTROLLED_WARN_AFTER} tensors with no controller to choose among "
                    f"its candidates, so it sends all of them with its first one ({self.labels[0]}): auto is "
                    "driven by `qwire train`, or in a training loop of your own by qwire.parallel.autotune's "
                    "PipelineAutotune / CollectiveAutotune (docs/auto.md); otherwise name a fixed codec",
                    RuntimeWarning, stacklevel=2)
        return self._for(x.shape).encode(x)

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if self._watch is not None:  # an all-gather decodes every rank's payload: more than it encodes
            with self._lock:
                if self._watch is not None:
                    self._watch["decoded"] += math.prod(int(d) for d in shape)
        return self._for(shape).decode(payload, shape, dtype)


register("auto", Auto)


RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def link_bits_per_s(rate: str) -> float:
    """``"100mbit"`` -> 1e8 (units: bit, kbit, mbit, gbit, as tc writes them)."""
    r = rate.strip().lower()
    for unit in sorted(RATE_UNITS, key=len, reverse=True):
        if r.endswith(unit):
            try:
                v = float(r[: -len(unit)])
            except ValueError:
                break
            if v > 0:
                return v * RATE_UNITS[unit]
            break
    raise CodecError(f"codec 'auto': link={rate!r} is not a rate like 100mbit or 1gbit (or 'measured')")


FP8_GROUPS = (32, 64, 128, 256, 512)


def fp8_group_auto(spec: str) -> Auto | None:
    """``fp8[:...,]group=auto`` (TACO's data-driven reshaping): an :class:`Auto` over the fp8 codec with
    every group size of :data:`FP8_GROUPS` (the spec's other options kept), ``rule=shape``: after the
    first step the group is chosen from the error measured on the real tensor, the largest group (fewest
    scale bytes) whose error is within ``shape_tol`` of the smallest-error group's; the group of 128 is
    in force until then. None for any other spec."""
    name, opts = parse_spec(spec)
    if name not in ("fp8", "taco") or opts.get("group", "").lower() != "auto":
        return None
    rest = "".join(f"{k}={v}," for k, v in opts.items() if k != "group")
    groups = (128, *(g for g in FP8_GROUPS if g != 128))
    return Auto(candidates="+".join(f"fp8:{rest}group={g}" for g in groups), rule="shape", probe_every=0,
                shift=0.0, link="100gbit")


def auto_for(spec: str | Codec, role: str) -> str | Codec:
    """``spec`` as a codec for ``role`` (a key of :data:`ROLE_CANDIDATES`): an ``auto`` spec becomes its
    :class:`Auto` object, with the role's default candidates unless it names its own (one object for all
    the collectives of a role, so that switching it switches them all); ``fp8:group=auto`` becomes the
    :class:`Auto` of :func:`fp8_group_auto`; any other spec is returned as is."""
    if isinstance(spec, str) and (shaped := fp8_group_auto(spec)) is not None:
        return shaped
    if isinstance(spec, Codec) or parse_spec(spec)[0] != "auto":
        return spec
    if "candidates" in parse_spec(spec)[1]:
        return get_codec(spec)
    return get_codec(spec, candidates=ROLE_CANDIDATES[role])


def flat_bits(codec: Any) -> float | None:
    """The bits per element ``codec`` sends on the flat 1-D shards collectives code, where that is more than
    bf16's 16 (fp32, the exact reference, aside); else None. (``perchannel`` codes each column of the last
    dimension with its own step, and in a 1-D shard every element is a column: 22-24 bits.)"""
    n = 4096
    bits = codec.payload_nbytes((n,), torch.float32) * 8 / n
    return bits if bits > 16 and codec.name != "fp32" else None


FLAT_ADVICE = "use blockwise8 (8.125 bits), int8 or fp8"


def check_flat_candidates(codec: Auto, what: str) -> None:
    """Every candidate of ``codec`` must take the 1-D float32 shards collectives hand it (of any length), and
    send fewer bits there than bf16 (:func:`flat_bits`); raises a :class:`CodecError` naming the candidate and
    ``what`` (the option) otherwise."""
    x = torch.linspace(-1.0, 1.0, 1001)
    for lab, c in zip(codec.labels, codec.choices):
        try:
            y = c.decode(c.encode(x), x.shape, x.dtype)
            if y.shape != x.shape:
                raise CodecError(f"decoded shape {tuple(y.shape)}")
        except Exception as e:  # noqa: BLE001 - any failure means: not a candidate for collectives
            raise CodecError(f"{what}: auto candidate {lab!r} cannot encode the 1-D shards a collective sends "
                             f"({type(e).__name__}: {e}); remove it from candidates=") from None
        bits = flat_bits(c)
        if bits is not None:
            raise CodecError(f"{what}: auto candidate {lab!r} sends {bits:g} bits per element on the flat 1-D "
                             f"shards collectives code, more than bf16's 16; remove it from candidates= "
                             f"({FLAT_ADVICE})")
