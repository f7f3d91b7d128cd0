"""The codec contract every qwire codec follows.

A codec turns a tensor into a 1-D ``torch.uint8`` payload whose length depends
only on the tensor's shape, dtype and the codec's configuration, and back::

    n = codec.payload_nbytes(x.shape, x.dtype)
    payload = codec.encode(x)                    # uint8, length n, same device as x
    y = codec.decode(payload, x.shape, x.dtype)  # same shape / dtype / device as x

Codecs are pure tensor code: no torch.distributed, no global state.  A codec
also has a canonical :meth:`Codec.spec` string; two processes that must agree
on a codec (the two sides of a pipeline boundary) compare those strings.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .errors import CodecError, NonFiniteError
from .kernels import check_impl, default_impl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP16_MAX = 65504.0  # the largest finite fp16
# Decoded fp32 values below this bound are finite with room to spare: no payload of a finite input a
# quantizing codec takes decodes to more (their inputs are at most 2**120 in magnitude).
DECODE_LIMIT = 2.0 ** 127


def as_shape(shape: Sequence[int] | torch.Size) -> torch.Size:
    try:
        s = torch.Size([int(d) for d in shape])
    except (TypeError, ValueError) as e:
        raise CodecError(f"shape must be a sequence of ints, got {shape!r}") from e
    if any(d < 0 for d in s):
        raise CodecError(f"shape has a negative dimension: {tuple(s)}")
    return s


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def check_float_dtype(dtype: torch.dtype, codec: str) -> None:
    if not isinstance(dtype, torch.dtype):
        raise CodecError(f"codec {codec!r}: dtype must be a torch.dtype (torch.float32, torch.float16 or "
                         f"torch.bfloat16), got {type(dtype).__name__} {dtype!r}")
    if dtype not in FLOAT_DTYPES:
        raise CodecError(
            f"codec {codec!r} takes float32, float16 or bfloat16 tensors, got {dtype}; "
            "cast the tensor first (e.g. x.float())"
        )


def maybe_any(mask: torch.Tensor) -> bool:
    """``bool(mask.any())`` for a CPU tensor; True on an accelerator without asking it. For a branch whose
    work leaves the tensors unchanged where ``mask`` is False: on a GPU the host sync that would skip it
    costs more than the masked work."""
    return mask.device.type != "cpu" or bool(mask.any())


def full_levels(levels: torch.Tensor | int | float, shape: torch.Size | tuple[int, ...],
                device: torch.device | str) -> torch.Tensor:
    """``levels`` (a number, or a tensor that broadcasts to ``shape``) as fp32 of ``shape``. A number is filled in
    on the device: ``torch.as_tensor(number, device=cuda)`` copies it from pageable host memory, which waits for
    the GPU."""
    if isinstance(levels, torch.Tensor):
        return levels.to(device=device, dtype=torch.float32).expand(shape)
    return torch.full(tuple(shape), float(levels), device=device)


def div(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """``a / b`` rounded as IEEE division on every device. torch on CUDA divides a tensor by a Python number
    (or a CPU scalar) as a multiplication by the number's reciprocal, which can differ from the CPU's quotient
    in the last bit and move a tile's grid by one code: a CUDA encoder would then write other bytes than the
    CPU's. Divided by a tensor, both devices round the quotient once."""
    if a.device.type == "cpu" or (isinstance(b, torch.Tensor) and b.dim() > 0):
        return a / b
    if isinstance(b, torch.Tensor):
        return a / b.to(a.device)
    return a / torch.full_like(a, b)


_NONFINITE = (": quantized codes cannot represent them. This usually means training diverged (lower the learning "
              "rate, check the loss scale); a float codec such as 'fp32' passes them through.")


def check_finite(x: torch.Tensor, codec: str) -> None:
    """Raise :class:`NonFiniteError` if ``x`` holds NaN or Inf (quantizing codecs' policy)."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteError(f"codec {codec!r} got a tensor with {bad} NaN/Inf value(s) of {x.numel()}{_NONFINITE}")


def nonfinite(x: torch.Tensor, codec: str) -> None:
    """Raise :class:`NonFiniteError`: a kernel found NaN or Inf in ``x`` (counted by :func:`check_finite`; the
    message says less if ``x`` has changed since)."""
    check_finite(x, codec)
    raise NonFiniteError(f"codec {codec!r} got a tensor with NaN/Inf values{_NONFINITE}")


def corrupt(codec: str, what: str) -> CodecError:
    """The error of a decoder handed a payload that no encoder of its configuration writes."""
    return CodecError(
        f"codec {codec!r}: corrupt payload or a codec configuration that does not match the sender's: {what} "
        "(compare codec.spec() on both sides)"
    )


def check_decoded(vals: torch.Tensor, bound: float, codec: str, limit: float = DECODE_LIMIT) -> None:
    """Raise :class:`CodecError` if the decoded fp32 ``vals`` hold NaN or magnitudes above ``limit``
    (:data:`DECODE_LIMIT`; codecs that take any finite fp32 pass ``math.inf`` and clamp what overflows).

    ``bound`` bounds ``|vals|`` from the payload's metadata (scales, steps, zeros; NaN if they are
    NaN). Only when it does not already rule the values in (never for a payload an encoder wrote
    from a tensor of ordinary magnitudes) are the values themselves scanned, so the check costs
    nothing on the usual path.
    """
    if bound < limit or not vals.numel():
        return
    decoded_verdict(bound, float(vals.abs().amax()), codec, limit)  # NaN propagates


def decoded_verdict(bound: float, m: float, codec: str, limit: float = DECODE_LIMIT) -> None:
    """:func:`check_decoded` given the decoded values' largest magnitude ``m`` (NaN if they hold NaN)."""
    if bound < limit:
        return
    if math.isnan(m) or m > limit:
        raise corrupt(codec, f"it decodes to values of magnitude {m:.3g}, which no encoded tensor holds")


def clamp_to_dtype_(vals: torch.Tensor, dtype: torch.dtype, bound: float = math.inf) -> torch.Tensor:
    """Clamp decoded fp32 ``vals`` (in place) to the finite range of the output ``dtype``, so that a value
    within a codec's error of the largest finite number (65504 for fp16) does not become Inf in the
    cast. Nothing to do when ``bound``, a bound on ``|vals|``, already fits."""
    m = torch.finfo(dtype).max
    if not bound <= m:
        vals.clamp_(-m, m)
    return vals


@dataclass(frozen=True)
class Param:
    """One configuration knob of a codec, with its type, default and a check."""

    name: str
    type: type
    default: Any
    help: str = ""
    choices: tuple | None = None
    lo: float | None = None
    hi: float | None = None
    # the value that reproduces the codec from before this parameter existed (None: it always did);
    # Codec.spec_key() leaves the parameter out at that value, so keys made by older versions still match
    legacy: Any = None

    def coerce(self, codec: str, value: Any) -> Any:
        t = self.type
        try:
            if t is bool and isinstance(value, str):
                low = value.strip().lower()
                if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(value)
                v: Any = low in ("1", "true", "yes", "on")
            elif t is float and isinstance(value, str):
                v = float(value.strip())  # accepts "inf"
            elif t is int and isinstance(value, float):
                if value != int(value):
                    raise ValueError(value)
                v = int(value)
            else:
                v = t(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError, OverflowError) as e:  # OverflowError: int(inf)
            raise CodecError(
                f"codec {codec!r}: parameter {self.name}={value!r} is not a valid {t.__name__}"
                + (f" ({self.help})" if self.help else "")
            ) from e
        if t is float and math.isnan(v):
            raise CodecError(f"codec {codec!r}: parameter {self.name} cannot be NaN")
        if self.choices is not None and v not in self.choices:
            raise CodecError(
                f"codec {codec!r}: parameter {self.name}={v!r} must be one of {list(self.choices)}"
            )
        if self.lo is not None and v < self.lo or self.hi is not None and v > self.hi:
            raise CodecError(
                f"codec {codec!r}: parameter {self.name}={v!r} must lie in [{self.lo}, {self.hi}]"
            )
        return v


class Codec(ABC):
    """Base class: subclasses declare ``name``, ``params`` and implement the three methods.

    ``lossless`` is True when decode(encode(x)) == x bit for bit for every finite
    input of a supported dtype. ``stateful`` is True for codecs whose encode and decode
    take the sample identities (``sample_ids=``) and keep a cache across calls (AQ-SGD);
    transports check it instead of probing for methods.
    """

    name: ClassVar[str]
    params: ClassVar[tuple[Param, ...]] = ()
    lossless: ClassVar[bool] = False
    stateful: ClassVar[bool] = False
    # parameters that name other codecs, each a spec with its options joined by ';' ("one"), or several such
    # specs joined by '+' ("plus"): pinned and unpinned with them (qwire.codecs.registry.pin_spec)
    nested: ClassVar[dict[str, str]] = {}

    def __init__(self, **kwargs: Any) -> None:
        # ``impl`` picks the implementation (see qwire.codecs.kernels); it is not part of the
        # wire configuration, so spec() leaves it out.
        self.impl: str = check_impl(self.name, kwargs.pop("impl")) if "impl" in kwargs else default_impl()
        known = {p.name: p for p in self.params}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            valid = ", ".join([*known, "impl"])
            raise CodecError(
                f"codec {self.name!r} has no parameter(s) {', '.join(unknown)}; valid parameters: {valid}"
            )
        self.config: dict[str, Any] = {}
        for p in self.params:
            self.config[p.name] = p.coerce(self.name, kwargs[p.name]) if p.name in kwargs else p.default
        for k, v in self.config.items():
            setattr(self, k, v)
        self._validate()

    def _validate(self) -> None:  # noqa: B027 - an optional hook, not an abstract method
        """Cross-parameter checks; raise :class:`CodecError`."""

    # -- the contract ---------------------------------------------------------------
    @abstractmethod
    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Exact payload length in bytes for a tensor of this shape and dtype."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Return a 1-D uint8 tensor of length ``payload_nbytes(x.shape, x.dtype)`` on x's device."""

    @abstractmethod
    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`encode`; returns a tensor of ``shape`` and ``dtype`` on payload's device."""

    def max_payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """The largest payload this codec sends for this shape and dtype: what a receive buffer must
        hold. The payload size itself unless it changes between phases (AQ-SGD's warm-up)."""
        return self.payload_nbytes(shape, dtype)

    # -- helpers shared by all codecs ----------------------------------------------
    def spec(self) -> str:
        """Canonical spec string: every parameter, in declaration order."""
        if not self.params:
            return self.name
        return f"{self.name}:" + ",".join(part for _, part in self._spec_parts())

    def _spec_parts(self) -> list[tuple[Param, str]]:
        """Each parameter with its ``name=value`` as :meth:`spec` writes it."""
        parts = []
        for p in self.params:
            v = self.config[p.name]
            if isinstance(v, bool):
                v = str(v).lower()
            elif isinstance(v, float):
                v = repr(v)
            parts.append((p, f"{p.name}={v}"))
        return parts

    def spec_key(self) -> str:
        """:meth:`spec` without the parameters added later that are at their ``legacy`` value: the same
        string as an older version's ``spec()`` for the same codec (for keys stored across versions,
        e.g. benchmark runs to reuse). Not a spec to build a codec from: the defaults may differ."""
        at_legacy = {p.name for p in self.params if p.legacy is not None and self._at_legacy(p)}
        if not at_legacy:
            return self.spec()  # (also a wrapper whose spec() is its inner codec's)
        return f"{self.name}:" + ",".join(part for p, part in self._spec_parts() if p.name not in at_legacy)

    def _at_legacy(self, p: Param) -> bool:
        """Whether parameter ``p`` (which has a ``legacy`` value) builds the codec its older versions built:
        at its legacy value (a codec may also say so where the parameter makes no difference)."""
        return self.config[p.name] == p.legacy

    def bits_per_element(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> float:
        """Everything on the wire (codes + scales + bitmaps + indices) per tensor element."""
        n = numel(shape)
        return 8.0 * self.payload_nbytes(shape, dtype) / n if n else 0.0

    def compression_ratio(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> float:
        """Bytes of the raw tensor in ``dtype`` over bytes of the payload."""
        n = numel(shape)
        p = self.payload_nbytes(shape, dtype)
        return (n * dtype.itemsize / p) if p else 1.0

    def check_payload(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> None:
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            got = f"{payload.dtype} tensor of shape {tuple(payload.shape)}" if isinstance(
                payload, torch.Tensor) else type(payload).__name__
            raise CodecError(f"codec {self.name!r}: payload must be a 1-D uint8 tensor, got {got}")
        want = self.payload_nbytes(shape, dtype)
        if payload.numel() != want:
            raise CodecError(
                f"codec {self.name!r}: payload has {payload.numel()} bytes but shape {tuple(shape)} "
                f"{dtype} needs {want}; sender and receiver disagree on the shape or the codec "
                f"configuration (this side: {self.spec()})"
            )

    def __repr__(self) -> str:
        return f"<codec {self.spec()}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.spec() == self.spec()

    def __hash__(self) -> int:
        return hash(self.spec())
