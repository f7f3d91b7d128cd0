"""Link specifications: ``"100mbit,delay=20ms,jitter=5ms,loss=0.1%"`` -> :class:`LinkSpec`.

The grammar is ``RATE[,delay=TIME][,jitter=TIME][,loss=PERCENT%][,mode=auto|lab|sim]``:

* ``RATE``: a number and a unit of *bits* per second: ``bit``, ``kbit``, ``mbit``,
  ``gbit`` (as ``tc`` writes them) or ``bps``, ``kbps``, ``mbps``, ``gbps`` (as
  papers write them; note that ``tc`` itself reads ``mbps`` as megabytes, qwire
  never does). Units are case-insensitive and decimal (1 mbit = 10^6 bit/s).
* ``TIME``: a number with ``us``, ``ms`` or ``s`` (``usec``, ``msec``, ``sec`` too).
* ``PERCENT``: packet loss, with the ``%`` sign (``loss=0.1%``).
* ``mode``: ``auto`` (default: the network lab where it can run, else the
  simulated link), ``lab`` (the lab or an error) or ``sim`` (always simulated).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LinkSpec", "parse_link", "FORM"]

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
        if self.delay_s < 0 or self.jitter_s < 0:
            raise ValueError("link delay and jitter must be >= 0")
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


def _parse_rate(text: str, spec: str) -> float:
    m = _RATE_RE.match(text)
    unit = m.group("unit").lower() if m else ""
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
