"""Link specifications: ``"100mbit,delay=20ms,jitter=5ms,loss=0.1%"`` -> :class:`LinkSpec`.

The grammar is ``RATE[,delay=TIME][,jitter=TIME][,loss=PERCENT%][,mode=auto|lab|sim]``:

* ``RATE``: a number and a unit of *bits* per second: ``bit``, ``kbit``, ``mbit``,
  ``gbit`` (as ``tc`` writes them) or ``bps``, ``kbps``, ``mbps``, ``gbps`` (as
  papers write them; note that ``tc`` itself reads ``mbps`` as megabytes, qwire
  never does). Units are case-insensitive and decimal (1 mbit = 10^6 bit/s), except that a capital B
  (``MBps``, ``GBps``) reads as bytes and is refused. At least ``8bit``; delay and jitter at most 10 s.
* ``TIME``: a number with ``us``, ``ms`` or ``s`` (``usec``, ``msec``, ``sec`` too).
* ``PERCENT``: packet loss, with the ``%`` sign (``loss=0.1%``).
* ``mode``: ``auto`` (default: the network lab where it can run, else the
  simulated link), ``lab`` (the lab or an error) or ``sim`` (always simulated).

A run with pipeline (``pp``), tensor-parallel (``tp``) and data-parallel
(``dp``) dimensions can give each dimension its own link (``--link-pp``,
``--link-tp``, ``--link-dp``; an empty one falls back to ``--link``, and a
dimension with neither is not shaped). :func:`pair_links` says which link the
traffic from one rank to another crosses::

    pair_links(2, 1, 2, link_pp="20mbit", link_dp="200mbit")
    # {(0, 1): 20mbit (pp), (0, 2): 200mbit (dp), (0, 3): 20mbit (pp and dp differ: the slower), ...}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

__all__ = ["LinkSpec", "parse_link", "FORM", "DIMS", "LINK_FIELDS", "rank_coords", "dim_links", "link_mode", "slowest",
           "pair_links", "uniform_link", "parse_link_schedule", "SCHEDULE_FORM"]

FORM = ("RATE[,delay=TIME][,jitter=TIME][,loss=PERCENT%][,mode=auto|lab|sim], "
        "e.g. '100mbit', '1gbit,delay=20ms,jitter=5ms,loss=0.1%' (rate units: bit, kbit, mbit, gbit or "
        "bps, kbps, mbps, gbps, all bits per second; times in us, ms or s)")

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9,
               "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
_TIME_UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0}
_NUM = r"(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
_RATE_RE = re.compile(rf"^(?P<num>{_NUM})\s*(?P<unit>[a-z/]+)$", re.IGNORECASE)
_TIME_RE = re.compile(rf"^(?P<num>{_NUM})\s*(?P<unit>[a-z]+)$", re.IGNORECASE)
_MODES = ("auto", "lab", "sim")
MIN_RATE = 8.0  # bit/s: tc counts whole bytes per second
MAX_DELAY_S = 10.0


@dataclass(frozen=True)
class LinkSpec:
    """One rate-limited link, the same for every rank's uplink.

    Attributes:
        rate_bits_per_s: link rate in bits per second (of frames on the wire, as ``tc`` counts them).
        delay_s: one-way delay added to every packet (lab) or payload (simulated link).
        jitter_s: random variation of the delay, +- this much.
        loss_frac: fraction of packets dropped (0.001 = 0.1%); only the lab can do this.
        mode: ``auto``, ``lab`` or ``sim`` (see the module docstring).
    """

    rate_bits_per_s: float
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss_frac: float = 0.0
    mode: str = "auto"

    def __post_init__(self) -> None:
        if not self.rate_bits_per_s > 0 or self.rate_bits_per_s == float("inf"):
            raise ValueError(f"link rate must be a positive number of bits per second, got {self.rate_bits_per_s}")
        if self.rate_bits_per_s < MIN_RATE:
            raise ValueError(f"link rate {self.rate_bits_per_s:g} bit/s is below {MIN_RATE:g}bit, one byte per "
                             "second, the least tc's shaping can hold; give 8bit or more")
        if self.delay_s < 0 or self.jitter_s < 0:
            raise ValueError("link delay and jitter must be >= 0")
        if not (self.delay_s <= MAX_DELAY_S and self.jitter_s <= MAX_DELAY_S):  # (NaN and Inf too)
            raise ValueError(f"link delay and jitter must be at most {MAX_DELAY_S:g} s (the Earth-Moon round trip "
                             f"is 2.6 s), got delay {self.delay_s:g} s, jitter {self.jitter_s:g} s")
        if self.jitter_s > 0 and self.delay_s == 0:
            raise ValueError("link jitter needs a delay (e.g. delay=20ms,jitter=5ms)")
        if not 0 <= self.loss_frac < 1:
            raise ValueError(f"link loss must be in [0%, 100%), got {self.loss_frac * 100:g}%")
        if self.mode not in _MODES:
            raise ValueError(f"link mode must be one of {', '.join(_MODES)}, got {self.mode!r}")

    @property
    def needs_netem(self) -> bool:
        """Whether the link needs more than a rate limit (delay, jitter or loss)."""
        return self.delay_s > 0 or self.jitter_s > 0 or self.loss_frac > 0

    def tc_rate(self) -> str:
        """The rate in ``tc`` syntax (integer bits per second, never the ambiguous ``mbps``)."""
        return f"{round(self.rate_bits_per_s)}bit"

    def __str__(self) -> str:
        parts = [_fmt_rate(self.rate_bits_per_s)]
        if self.delay_s:
            parts.append(f"delay={_fmt_time(self.delay_s)}")
        if self.jitter_s:
            parts.append(f"jitter={_fmt_time(self.jitter_s)}")
        if self.loss_frac:
            parts.append(f"loss={self.loss_frac * 100:g}%")
        if self.mode != "auto":
            parts.append(f"mode={self.mode}")
        return ",".join(parts)

    def describe(self) -> str:
        """Human-readable, e.g. ``100 Mbit/s, 20 ms delay +- 5 ms, 0.1% loss``."""
        out = f"{self.rate_bits_per_s / 1e6:g} Mbit/s"
        if self.delay_s:
            out += f", {self.delay_s * 1e3:g} ms delay"
            if self.jitter_s:
                out += f" +- {self.jitter_s * 1e3:g} ms"
        if self.loss_frac:
            out += f", {self.loss_frac * 100:g}% loss"
        return out


def parse_link(spec: str | LinkSpec) -> LinkSpec:
    """Parse a link spec string such as ``"100mbit,delay=20ms,jitter=5ms,loss=0.1%"``.

    Raises:
        ValueError: the spec is malformed; the message shows the accepted form.
    """
    if isinstance(spec, LinkSpec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty link spec; expected {FORM}")
    parts = [p.strip() for p in spec.split(",")]
    if any(not p for p in parts):
        raise ValueError(f"bad link spec {spec!r}: empty field; expected {FORM}")
    first = parts[0]
    if "=" in first:
        key, _, value = first.partition("=")
        if key.strip().lower() != "rate":
            raise ValueError(f"bad link spec {spec!r}: it must start with the rate; expected {FORM}")
        first = value.strip()
    kw: dict[str, float | str] = {"rate_bits_per_s": _parse_rate(first, spec)}
    for p in parts[1:]:
        key, eq, value = p.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or not value:
            raise ValueError(f"bad link spec {spec!r}: {p!r} is not KEY=VALUE; expected {FORM}")
        if key in ("delay", "jitter"):
            name = f"{key}_s"
        elif key == "loss":
            name = "loss_frac"
        elif key == "mode":
            name = "mode"
        else:
            raise ValueError(f"bad link spec {spec!r}: unknown key {key!r} (known: delay, jitter, loss, mode); "
                             f"expected {FORM}")
        if name in kw:
            raise ValueError(f"bad link spec {spec!r}: {key} given twice")
        if key == "loss":
            kw[name] = _parse_loss(value, spec)
        elif key == "mode":
            kw[name] = value.lower()
        else:
            kw[name] = _parse_time(value, key, spec)
    try:
        return LinkSpec(**kw)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"bad link spec {spec!r}: {e}") from None


SCHEDULE_FORM = "STEP:RATE[;STEP:RATE...], e.g. '20:20mbit;40:200mbit' (after step 20 the link runs at 20 Mbit/s)"


def parse_link_schedule(text: str, steps: int | None = None) -> list[tuple[int, float]]:
    """Parse a link schedule ``"20:20mbit;40:200mbit"`` -> ``[(20, 20e6), (40, 200e6)]``: after step
    ``STEP`` has finished, every shaped link runs at ``RATE`` (delay and loss stay the link's).

    Raises:
        ValueError: malformed entry, steps not increasing, a step < 1 or (with ``steps``) not before the
            run's last step; the message shows the accepted form.
    """
    out: list[tuple[int, float]] = []
    for entry in (e.strip() for e in text.split(";")):
        step_text, colon, rate_text = entry.partition(":")
        if not entry or not colon:
            raise ValueError(f"bad link schedule {text!r}: entry {entry!r} is not STEP:RATE; expected {SCHEDULE_FORM}")
        try:
            step = int(step_text.strip())
        except ValueError:
            raise ValueError(f"bad link schedule {text!r}: {step_text.strip()!r} is not a step number; "
                             f"expected {SCHEDULE_FORM}") from None
        rate = _parse_rate(rate_text.strip(), f"{text} (entry {entry})")
        if step < 1:
            raise ValueError(f"bad link schedule {text!r}: steps start at 1, got {step}")
        if out and step <= out[-1][0]:
            raise ValueError(f"bad link schedule {text!r}: the steps must increase ({out[-1][0]}, then {step})")
        if steps is not None and step >= steps:
            raise ValueError(f"bad link schedule {text!r}: step {step} is not before the run's last step "
                             f"(--steps {steps}), so the change would never take effect")
        out.append((step, rate))
    return out


def _parse_rate(text: str, spec: str) -> float:
    m = _RATE_RE.match(text)
    unit = m.group("unit").lower() if m else ""
    if m and unit.endswith("bps") and "B" in m.group("unit"):  # MBps, GBps: megabytes, as tc and most tools read
        num, prefix = float(m.group("num")), unit[:-3]
        raise ValueError(f"bad link spec {spec!r}: rate {text!r} with a capital B reads as bytes per second, and "
                         f"qwire takes bits: write {num * 8:g}{prefix}bit for {num:g} {prefix.upper()}B/s, or "
                         f"{num:g}{prefix}bit for {num:g} {prefix.upper()}bit/s")
    if not m or unit not in _RATE_UNITS:
        hint = ""
        if m and ("byte" in unit or unit in ("b/s", "kb/s", "mb/s", "gb/s") or text.rstrip().endswith(("B", "Bps"))):
            hint = " (give bits per second; qwire takes no byte-rate units)"
        raise ValueError(f"bad link spec {spec!r}: rate {text!r} is not a number with a unit{hint}; expected {FORM}")
    rate = float(m.group("num")) * _RATE_UNITS[unit]
    if rate <= 0:
        raise ValueError(f"bad link spec {spec!r}: the rate must be > 0")
    return rate


def _parse_time(text: str, key: str, spec: str) -> float:
    m = _TIME_RE.match(text)
    unit = m.group("unit").lower() if m else ""
    if not m or unit not in _TIME_UNITS:
        raise ValueError(f"bad link spec {spec!r}: {key}={text!r} is not a time like 20ms, 500us or 0.1s; "
                         f"expected {FORM}")
    return float(m.group("num")) * _TIME_UNITS[unit]


def _parse_loss(text: str, spec: str) -> float:
    if not text.endswith("%"):
        raise ValueError(f"bad link spec {spec!r}: loss={text!r} needs a percent sign, e.g. loss=0.1%")
    try:
        pct = float(text[:-1].strip())
    except ValueError:
        raise ValueError(f"bad link spec {spec!r}: loss={text!r} is not a percentage like 0.1%") from None
    if not 0 <= pct < 100:
        raise ValueError(f"bad link spec {spec!r}: loss must be in [0%, 100%), got {text}")
    return pct / 100


def _fmt_rate(bits: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale and (bits / scale) == round(bits / scale, 6):
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


def _fmt_time(sec: float) -> str:
    if sec >= 1:
        return f"{sec:g}s"
    if sec * 1e3 == round(sec * 1e3, 6):
        return f"{sec * 1e3:g}ms"
    return f"{sec * 1e6:g}us"



# ----------------------------------------------------------------------------------------------- dimensions

DIMS = ("pp", "tp", "dp")
# the run options that name links (TrainConfig fields): the network lab shapes them, its workers only train
LINK_FIELDS = ("link", "link_pp", "link_tp", "link_dp", "link_schedule")


def rank_coords(rank: int, P: int, T: int, D: int) -> dict[str, int]:
    """``{"pp": ..., "tp": ..., "dp": ...}`` of ``rank`` in qwire's layout
    ``rank = (dp_rank * P + pp_rank) * T + tp_rank``."""
    if not 0 <= rank < P * T * D:
        raise ValueError(f"rank {rank} is not in a world of {P} x {T} x {D} = {P * T * D} ranks")
    return {"pp": rank // T % P, "tp": rank % T, "dp": rank // (P * T)}


def dim_links(link: str = "", link_pp: str = "", link_tp: str = "", link_dp: str = "") -> dict[str, LinkSpec | None]:
    """The link of each dimension: its own spec, else ``link``, else None (not shaped).

    The specs keep their ``mode=``; :func:`link_mode` combines the modes, :func:`pair_links` drops them.
    """
    own = {"pp": link_pp, "tp": link_tp, "dp": link_dp}
    out: dict[str, LinkSpec | None] = {}
    for dim in DIMS:
        text = (own[dim] or link or "").strip()
        try:
            out[dim] = parse_link(text) if text else None
        except ValueError as e:
            raise ValueError(f"--link-{dim}: {e}" if own[dim] else f"--link: {e}") from None
    return out


def link_mode(links: dict[str, LinkSpec | None]) -> str:
    """The one ``mode`` of a run's links: ``auto`` unless some spec says ``lab`` or ``sim``.

    Raises:
        ValueError: two specs ask for different modes.
    """
    modes = {spec.mode for spec in links.values() if spec is not None and spec.mode != "auto"}
    if len(modes) > 1:
        raise ValueError(f"the links ask for different modes ({', '.join(sorted(modes))}); give mode= on one "
                         "link or the same on all")
    return modes.pop() if modes else "auto"


def _slow_key(spec: LinkSpec) -> tuple[float, float, float, float]:
    return (spec.rate_bits_per_s, -spec.delay_s, -spec.loss_frac, -spec.jitter_s)


def slowest(specs: list[LinkSpec | None]) -> LinkSpec | None:
    """The slowest of some links: the lowest rate (then the longest delay, the most loss); None (not shaped)
    counts as infinitely fast, so the result is None only when every one is None."""
    shaped = [s for s in specs if s is not None]
    return min(shaped, key=_slow_key) if shaped else None


def pair_links(P: int, T: int = 1, D: int = 1, link: str = "", link_pp: str = "", link_tp: str = "",
               link_dp: str = "") -> dict[tuple[int, int], LinkSpec | None]:
    """The link crossed by traffic from rank ``src`` to rank ``dst``, for every ordered pair of the
    ``P x T x D`` ranks (layout ``rank = (dp_rank * P + pp_rank) * T + tp_rank``).

    A pair whose ranks differ in one coordinate uses that dimension's link (:func:`dim_links`); a pair
    that differs in several uses the slowest of those dimensions' links (:func:`slowest`); None means
    not shaped. The specs come without their ``mode=`` (see :func:`link_mode`), so two dimensions with
    the same link compare equal.
    """
    if min(P, T, D) < 1:
        raise ValueError(f"pipeline, tensor- and data-parallel sizes must be >= 1, got {P}, {T}, {D}")
    dims = {d: (replace(s, mode="auto") if s is not None else None)
            for d, s in dim_links(link, link_pp, link_tp, link_dp).items()}
    n = P * T * D
    coords = [rank_coords(r, P, T, D) for r in range(n)]
    out: dict[tuple[int, int], LinkSpec | None] = {}
    for a in range(n):
        for b in range(n):
            if a != b:
                out[(a, b)] = slowest([dims[d] for d in DIMS if coords[a][d] != coords[b][d]])
    return out


def uniform_link(pairs: dict[tuple[int, int], LinkSpec | None]) -> LinkSpec | None:
    """The link of every pair if all pairs have the same one (and it is shaped), else None."""
    values = set(pairs.values())
    if len(values) == 1:
        return values.pop()
    return None
