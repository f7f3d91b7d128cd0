"""Compressed pipeline-stage boundaries on ``torch.distributed.pipelining``.

What crosses a process boundary is the codec payload, nothing else:

* at the end of stage k, ``_Encode`` turns the activation into the forward
  codec's payload; its backward decodes the gradient payload coming back;
* at the start of stage k+1, ``_Decode`` turns the payload back into the
  activation; its backward encodes the activation's gradient with the
  backward codec.

PyTorch's schedules (GPipe, 1F1B, interleaved) move the payloads with their
own P2P ops. Their receive buffers must require grad, so the payload travels
as a 1-D float32 tensor whose bytes are the uint8 payload (no arithmetic is
ever done on it). One buffer serves both directions, so it is as long as the
larger of the two payloads; :class:`CompressedPipelineStage` narrows every
send and receive to the real payload of that direction, so the forward
carries exactly the forward payload and the backward exactly the gradient
payload (rounded up to whole 4-byte words).

Public API::

    stage = compressed_pipeline_stage(module, stage_index, num_stages, device,
                                      input_args=example_microbatch_input,
                                      fwd="tahquant", bwd="perchannel6")
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)

``module`` is any ``nn.Module`` you would hand to ``PipelineStage`` (one
tensor in, one tensor out).
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from qwire.codecs import Codec, CodecError, get_codec
from qwire.codecs.auto import Auto
from qwire.codecs.kernels.deferred import PendingChecks, deferring, resolved
from qwire.codecs.kernels.deferred import wanted as deferred_wanted

WORD = 4  # bytes of the float32 carrier
CHUNK_TIMES = 64  # forward and backward chunk times a stage keeps (the latest)


class CodecClock:
    """Seconds this rank's boundary codecs take (every encode and decode, with their checks), as they run in the
    pipeline: host time on the CPU; on CUDA, a pair of events around each call, read by :meth:`take` once the
    step has waited for the GPU. Measured codec throughputs come from loops over one hot tensor; here the codec
    runs between the stage's kernels, on tensors that have left the caches."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.host_s = 0.0
        self.calls = 0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def timed(self):
        self.calls += 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.host_s += time.perf_counter() - t0

    def take(self) -> float:
        """The seconds since the last call (0 when nothing ran), and start counting again."""
        seconds = self.host_s
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
        self.host_s, self.calls, self._events = 0.0, 0, []
        return seconds


def _timed(b: Boundary) -> Any:
    return b.clock.timed() if b.clock is not None else contextlib.nullcontext()


class BoundaryMismatchError(RuntimeError):
    """Two neighbouring stages disagree on a boundary's codecs, shape or dtype."""


@dataclass
class Boundary:
    """One stage boundary: the activation's per-micro-batch shape/dtype and the two codecs."""

    shape: torch.Size
    dtype: torch.dtype
    fwd: Codec
    bwd: Codec
    # Bytes this process really sent on this boundary, by direction, and what fp32 would have sent.
    fwd_sent: int = field(default=0, init=False)
    bwd_sent: int = field(default=0, init=False)
    fp32_sent: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.shape = torch.Size(self.shape)
        self._bwd_bytes = self.bwd.payload_nbytes(self.shape, self.dtype)
        self._fwd_bytes = self.fwd.payload_nbytes(self.shape, self.dtype)
        # A codec may send payloads of different sizes at different steps (AQ-SGD's warm-up, the codec
        # `auto` chooses): the shared buffer holds the largest, every message is narrowed to the size
        # of the codec in force.
        max_fwd = self.fwd.max_payload_nbytes(self.shape, self.dtype)
        max_bwd = self.bwd.max_payload_nbytes(self.shape, self.dtype)
        self.words = max(-(-max_fwd // WORD), -(-max_bwd // WORD), 1)
        # The last tensor sent each way ("fwd": an activation, "bwd": a gradient), kept when `capture`
        # is set, for measuring codecs on real tensors (qwire.parallel.autotune).
        self.capture = False
        self.last_sent: dict[str, torch.Tensor] = {}
        # The checks of the stage that owns this boundary, when it defers them: the codecs called in a backward
        # run on autograd's device thread for CUDA tensors, which does not see the chunk's deferring() block.
        self.pending: PendingChecks | None = None
        # where the stage that owns this boundary counts its codecs' seconds (None: not counted)
        self.clock: CodecClock | None = None

    @property
    def stateful(self) -> bool:
        return bool(self.fwd.stateful)

    @property
    def fwd_bytes(self) -> int:
        return self.fwd.payload_nbytes(self.shape, self.dtype) if self._varies(self.fwd) else self._fwd_bytes

    @property
    def bwd_bytes(self) -> int:
        return self.bwd.payload_nbytes(self.shape, self.dtype) if self._varies(self.bwd) else self._bwd_bytes

    @staticmethod
    def _varies(codec: Codec) -> bool:
        return codec.stateful or isinstance(codec, Auto)

    @property
    def fwd_words(self) -> int:
        return -(-self.fwd_bytes // WORD)

    @property
    def bwd_words(self) -> int:
        return -(-self.bwd_bytes // WORD)

    @property
    def fp32_bytes(self) -> int:
        return math.prod(self.shape) * 4

    def describe(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch."),
                "fwd": self.fwd.spec(), "bwd": self.bwd.spec()}

    # payload <-> float32 carrier ------------------------------------------------
    def to_carrier(self, payload: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.words * WORD, dtype=torch.uint8, device=payload.device)
        out[: payload.numel()] = payload
        return out.view(torch.float32)

    @staticmethod
    def from_carrier(carrier: torch.Tensor, nbytes: int) -> torch.Tensor:
        return carrier.detach().contiguous().view(torch.uint8)[:nbytes]


def _check_activation(x: torch.Tensor, b: Boundary, where: str) -> None:
    if x.shape != b.shape or x.dtype != b.dtype:
        raise CodecError(
            f"{where}: the stage produced a {x.dtype} tensor of shape {tuple(x.shape)} but the boundary "
            f"was set up for {b.dtype} {tuple(b.shape)}; pass the stage's real micro-batch shape "
            "(input_args/output_args) when building the stage"
        )


class _Encode(torch.autograd.Function):
    """End of a stage: activation -> forward payload; gradient payload -> activation gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, b: Boundary,  # type: ignore[override]
                sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        _check_activation(x, b, "pipeline boundary (send)")
        ctx.b = b
        if b.capture:
            b.last_sent["fwd"] = x.detach()
        with _timed(b):
            if b.stateful:
                return b.to_carrier(b.fwd.encode(x.detach(), sample_ids=sample_ids))
            return b.to_carrier(b.fwd.encode(x.detach()))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        b: Boundary = ctx.b
        with deferring(b.pending), _timed(b):
            grad = b.bwd.decode(Boundary.from_carrier(g, b.bwd_bytes), b.shape, b.dtype)
        return grad, None, None


class _Decode(torch.autograd.Function):
    """Start of a stage: forward payload -> activation; activation gradient -> gradient payload."""

    @staticmethod
    def forward(ctx: Any, carrier: torch.Tensor, b: Boundary) -> torch.Tensor:  # type: ignore[override]
        ctx.b = b
        with _timed(b):
            return b.fwd.decode(Boundary.from_carrier(carrier, b.fwd_bytes), b.shape, b.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        b: Boundary = ctx.b
        g = g.to(b.dtype)
        if b.capture:
            b.last_sent["bwd"] = g.detach()
        with deferring(b.pending), _timed(b):
            return b.to_carrier(b.bwd.encode(g.contiguous())), None


class CompressedStageModule(nn.Module):
    """Wraps a stage module so its input arrives as a payload and its output leaves as one."""

    def __init__(self, module: nn.Module, in_boundary: Boundary | None, out_boundary: Boundary | None):
        super().__init__()
        self.module = module
        self.in_boundary = in_boundary
        self.out_boundary = out_boundary

    def forward(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``sample_ids`` (one per row) are needed only by a stateful forward codec (AQ-SGD) and only
        on the first stage: later stages read them from the payload, where the codec puts them."""
        ib, ob = self.in_boundary, self.out_boundary
        if ib is not None:
            if ib.stateful:
                ids = ib.fwd.decode_ids(Boundary.from_carrier(x, ib.fwd_bytes), ib.shape[0])
                if sample_ids is not None and not torch.equal(ids, torch.as_tensor(sample_ids).cpu()):
                    raise CodecError(f"stage input carries sample ids {ids.tolist()}, but "
                                     f"{torch.as_tensor(sample_ids).tolist()} were passed")
                sample_ids = ids
            x = _Decode.apply(x, ib)
        y = self.module(x)
        if ob is not None:
            if ob.stateful and sample_ids is None:
                raise CodecError(
                    f"the forward codec {ob.fwd.name!r} keeps a per-sample cache and needs each micro-batch's "
                    "sample ids: pass them to the first stage, e.g. schedule.step(x, sample_ids=ids)")
            y = _Encode.apply(y, ob, sample_ids)
        return y


def _narrow(ops: list[dist.P2POp], words: int) -> list[dist.P2POp]:
    out = []
    for op in ops:
        t = op.tensor
        if t.dim() != 1 or t.numel() < words:
            raise RuntimeError(f"unexpected pipeline buffer of shape {tuple(t.shape)} (want >= {words} words)")
        out.append(dist.P2POp(op.op, t[:words], op.peer, op.group, op.tag))
    return out


class CompressedPipelineStage(PipelineStage):
    """A ``PipelineStage`` whose P2P ops carry exactly each direction's payload.

    The schedules are PyTorch's own; only the four ``get_*_ops`` methods are
    narrowed, because one carrier tensor serves both directions and the two
    payloads differ in size.

    ``host_staging``: the payloads cross through host memory, for a transport that cannot send device
    tensors point to point (gloo with CUDA tensors, e.g. several stages sharing one GPU, which NCCL
    refuses). A send copies the payload (only the payload: the activation is already encoded on the
    device) into a host buffer, pinned when CUDA is available, and sends that; a receive lands in a
    host buffer and is copied to the device carrier just before the stage reads it. Buffers are kept
    per direction and micro-batch and reused every step.

    ``defer_checks`` (default: on CUDA devices): the GPU codecs' checks (the input's NaN/Inf and magnitude, the
    decoded values' bound) are read back once at the end of each forward and backward chunk, before its
    payloads are sent, instead of once per encode and decode (:mod:`qwire.codecs.kernels.deferred`).
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device, input_args: Any, output_args: Any,
                 group: dist.ProcessGroup | None = None, in_boundary: Boundary | None = None,
                 out_boundary: Boundary | None = None, host_staging: bool = False,
                 defer_checks: bool | None = None) -> None:
        super().__init__(submodule, stage_index, num_stages, device, input_args=input_args,
                         output_args=output_args, group=group)
        self.in_boundary = in_boundary
        self.out_boundary = out_boundary
        self.host_staging = bool(host_staging)
        # the GPU codecs' checks, read back once at the end of each chunk (qwire.codecs.kernels.deferred)
        defer = deferred_wanted(device) if defer_checks is None else bool(defer_checks)
        self.pending_checks = PendingChecks() if defer else None
        # seconds of this rank's boundary codecs (qwire train reports them per step: codec_time_max_s)
        self.codec_clock = CodecClock(device)
        for b in (in_boundary, out_boundary):
            if b is not None:
                b.pending = self.pending_checks
                b.clock = self.codec_clock
        self.staged_bytes = 0  # payload bytes copied through host memory (both directions)
        # seconds of the latest forward and backward chunks (compute, with the codecs' encode and decode in
        # them; waiting for a receive is not): how much of a transfer the schedule can hide (auto's model)
        self.chunk_s: dict[str, collections.deque[float]] = {d: collections.deque(maxlen=CHUNK_TIMES)
                                                             for d in ("fwd", "bwd")}
        self._host: dict[tuple[str, int, int], torch.Tensor] = {}
        self._landing: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._copying: dict[int, torch.cuda.Event] = {}  # host buffers a device copy may still read, by id

    # torch's start-up handshakes between neighbouring stages (the warm-up of the communicators in torch 2.11,
    # the static/dynamic vote in later versions) send one-element tensors made on the stage's device; with host
    # staging they are made on the host instead (gloo's send of a device tensor reads device memory as host
    # memory: "writev ... Bad address", and the rank aborts)
    @contextlib.contextmanager
    def _handshake_on_host(self):
        device = self.device
        if self.host_staging:
            self.device = torch.device("cpu")
        try:
            yield
        finally:
            self.device = device

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        with self._handshake_on_host():
            return super()._get_init_p2p_neighbors_ops()

    def _warmup_forward_vote(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._handshake_on_host():
            return super()._warmup_forward_vote(*args, **kwargs)

    def _warmup_backward_result(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._handshake_on_host():
            return super()._warmup_backward_result(*args, **kwargs)

    @staticmethod
    def _sent(ops: list[dist.P2POp], b: Boundary, attr: str, words: int) -> list[dist.P2POp]:
        ops = _narrow(ops, words)
        setattr(b, attr, getattr(b, attr) + len(ops) * words * WORD)
        b.fp32_sent += len(ops) * b.fp32_bytes
        return ops

    def _host_buffer(self, kind: str, chunk: int, i: int, like: torch.Tensor) -> torch.Tensor:
        key = (kind, chunk, i)
        buf = self._host.get(key)
        if buf is None or buf.numel() != like.numel():
            if buf is not None:
                self._copied(buf)
            buf = torch.empty(like.numel(), dtype=like.dtype, pin_memory=torch.cuda.is_available())
            self._host[key] = buf
        return buf

    def _copied(self, buf: torch.Tensor) -> None:
        """Wait until the device copy out of host buffer ``buf`` (:meth:`_land`), if one is in flight, has read it."""
        copying = self._copying.pop(id(buf), None)
        if copying is not None:
            copying.synchronize()

    def _stage_sends(self, ops: list[dist.P2POp], kind: str, chunk: int) -> list[dist.P2POp]:
        if not self.host_staging:
            return ops
        out = []
        for i, op in enumerate(ops):
            buf = self._host_buffer(kind, chunk, i, op.tensor)
            with torch.no_grad():
                buf.copy_(op.tensor.detach())  # synchronous: the bytes are on the host before the send starts
            self.staged_bytes += buf.numel() * buf.element_size()
            out.append(dist.P2POp(op.op, buf, op.peer, op.group, op.tag))
        return out

    def _stage_recvs(self, ops: list[dist.P2POp], kind: str, chunk: int) -> list[dist.P2POp]:
        if not self.host_staging:
            return ops
        out, landing = [], []
        for i, op in enumerate(ops):
            buf = self._host_buffer(kind, chunk, i, op.tensor)
            self._copied(buf)  # the copy of what it received last (long done, as a rule) must have read it
            landing.append((buf, op.tensor))
            out.append(dist.P2POp(op.op, buf, op.peer, op.group, op.tag))
        self._landing[(kind, chunk)] = landing
        return out

    def _land(self, kind: str, chunk: int) -> None:
        """Copy the payloads received into host buffers for ``chunk`` onto the device carriers."""
        for buf, dst in self._landing.pop((kind, chunk), ()):
            with torch.no_grad():
                if dst.is_cuda and buf.is_pinned():
                    # queued behind the chunk's kernels, without waiting for them (a copy from pinned memory
                    # that blocks waits for every kernel queued before it); the buffer is not received into
                    # again before this copy has read it (_stage_recvs)
                    dst.detach().copy_(buf, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(dst.device))
                    self._copying[id(buf)] = ev
                else:
                    dst.detach().copy_(buf)
            self.staged_bytes += buf.numel() * buf.element_size()

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        b = self.out_boundary
        ops = self._sent(ops, b, "fwd_sent", b.fwd_words) if b is not None and ops else ops
        return self._stage_sends(ops, "fwd_send", fwd_chunk_id)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        b = self.in_boundary
        ops = _narrow(ops, b.fwd_words) if b is not None and ops else ops
        return self._stage_recvs(ops, "fwd_recv", fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        b = self.in_boundary
        ops = self._sent(ops, b, "bwd_sent", b.bwd_words) if b is not None and ops else ops
        return self._stage_sends(ops, "bwd_send", bwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        b = self.out_boundary
        ops = _narrow(ops, b.bwd_words) if b is not None and ops else ops
        return self._stage_recvs(ops, "bwd_recv", bwd_chunk_id)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self._checked(super().forward_one_chunk, *args, **kwargs)
        self.chunk_s["fwd"].append(time.perf_counter() - t0)
        return out

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self._checked(super().backward_one_chunk, *args, **kwargs)
        self.chunk_s["bwd"].append(time.perf_counter() - t0)
        return out

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._checked(super().backward_weight_one_chunk, *args, **kwargs)

    def _checked(self, chunk: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a chunk with the codecs' checks deferred to its end (``pending_checks``; None: read where they
        are made): one wait for the GPU, after the chunk's kernels are queued and before anything it produced
        is sent. A check that fails is the error raised, and the root cause read last when the chunk itself
        failed too (e.g. on a corrupt payload's values)."""
        with resolved(self.pending_checks):
            return chunk(*args, **kwargs)

    # the schedule has waited for the receives when it asks the stage for what arrived
    def _retrieve_recv_activations(self, fwd_chunk_id: int):
        self._land("fwd_recv", fwd_chunk_id)
        return super()._retrieve_recv_activations(fwd_chunk_id)

    def _retrieve_recv_grads(self, bwd_chunk_id: int):
        self._land("bwd_recv", bwd_chunk_id)
        return super()._retrieve_recv_grads(bwd_chunk_id)


def _example(args: Any, device: torch.device) -> torch.Tensor:
    if isinstance(args, torch.Tensor):
        return args.to(device)
    raise TypeError(
        "input_args must be an example micro-batch tensor (what this stage's module takes), "
        f"got {type(args).__name__}"
    )


def compressed_pipeline_stage(
    module: nn.Module,
    stage_index: int,
    num_stages: int,
    device: torch.device | str,
    input_args: torch.Tensor,
    output_args: torch.Tensor | None = None,
    fwd: str | Codec = "tahquant",
    bwd: str | Codec = "perchannel6",
    group: dist.ProcessGroup | None = None,
    check: bool = True,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    host_staging: bool = False,
    defer_checks: bool | None = None,
) -> CompressedPipelineStage:
    """Make a pipeline stage whose boundaries are compressed with the named codecs.

    Args:
        module: the stage's module (one tensor in, one tensor out), as for ``PipelineStage``.
        input_args: an example micro-batch input *of the module* (token ids for
            stage 0, an activation for later stages) — only its shape and dtype are used.
        output_args: an example output; if omitted, the module is run once on
            ``input_args`` under ``no_grad`` to find it (stages other than the
            first may get a zero activation of the given shape).
        fwd, bwd: codecs (spec strings or objects) for activations going forward
            and gradients going back; every rank must pass the same ones.
        check: exchange the boundary configuration with the other stages and
            raise :class:`BoundaryMismatchError` if neighbours disagree (a
            collective over ``group``: every stage must call this function).
        wrap: applied to the compressed stage module before it is handed to
            ``PipelineStage``, e.g. ``lambda m: DistributedDataParallel(m, ...)``
            (the pipelining engine handles DDP's no-sync across micro-batches).
        host_staging: send and receive the payloads through host buffers (see
            :class:`CompressedPipelineStage`): for gloo with CUDA tensors.
        defer_checks: read the GPU codecs' checks back once at the end of each forward and backward chunk
            instead of where each codec makes them (:mod:`qwire.codecs.kernels.deferred`); the errors are
            the same, raised before the chunk's payloads are sent. Default (None): on CUDA devices
            (``QWIRE_DEFER_CHECKS=1``/``0`` decides for every device).
    """
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index must be in [0, num_stages) = [0, {num_stages}), got {stage_index}")
    device = torch.device(device)
    fwd_c, bwd_c = get_codec(fwd), get_codec(bwd)
    x = _example(input_args, device)
    if output_args is None:
        with torch.no_grad():
            output_args = module(x)
    y = _example(output_args, device)
    is_first, is_last = stage_index == 0, stage_index == num_stages - 1
    # A stateful codec (AQ-SGD) keeps one cache per boundary and side: never share an instance.
    in_b = None if is_first else Boundary(x.shape, x.dtype, _own(fwd_c), _own(bwd_c))
    out_b = None if is_last else Boundary(y.shape, y.dtype, _own(fwd_c), _own(bwd_c))
    wrapped = CompressedStageModule(module, in_b, out_b)
    # The carriers must be marked as requiring grad: the static metadata records it,
    # and without it the schedule neither receives nor sends gradients.
    in_example = x if is_first else torch.zeros(in_b.words, device=device, requires_grad=True)
    out_example = y.detach().requires_grad_(True) if is_last else torch.zeros(
        out_b.words, device=device, requires_grad=True)
    if check and num_stages > 1:
        check_boundaries(stage_index, num_stages, in_b, out_b, group)
    submodule = wrap(wrapped) if wrap is not None else wrapped
    return CompressedPipelineStage(submodule, stage_index, num_stages, device, in_example, out_example, group,
                                   in_b, out_b, host_staging=host_staging, defer_checks=defer_checks)


def _own(c: Codec) -> Codec:
    # a stateful codec keeps a cache per boundary side, and `auto` a codec in force per boundary
    return get_codec(c.spec()) if c.stateful or isinstance(c, Auto) else c


def stateful_codecs(stage: CompressedPipelineStage) -> dict[str, Codec]:
    """The stage's stateful forward codecs by side: ``"in"`` (receiver of the previous boundary),
    ``"out"`` (sender of the next)."""
    out = {}
    for side, b in (("in", stage.in_boundary), ("out", stage.out_boundary)):
        if b is not None and b.stateful:
            out[side] = b.fwd
    return out


def set_codec_phase(stage: CompressedPipelineStage, *, use_cache: bool | None = None,
                    warming: bool | None = None) -> None:
    """Switch the stage's stateful codecs: ``use_cache=False`` for validation (no cache reads or
    writes), ``warming`` for AQ-SGD's warm-up epoch. Every stage must switch at the same step."""
    for c in stateful_codecs(stage).values():
        if use_cache is not None:
            c.use_cache = use_cache  # type: ignore[attr-defined]
        if warming is not None:
            c.warming = warming  # type: ignore[attr-defined]


def codec_cache_nbytes(stage: CompressedPipelineStage) -> dict[str, int]:
    """Bytes held by the stage's per-sample caches (``total``), and what one sample costs on one side
    of one boundary (``per_sample``)."""
    total, per = 0, 0
    for side, c in stateful_codecs(stage).items():
        b = stage.in_boundary if side == "in" else stage.out_boundary
        assert b is not None
        total += c.cache_nbytes()  # type: ignore[attr-defined]
        per = max(per, c.per_sample_nbytes(b.shape))  # type: ignore[attr-defined]
    return {"total": total, "per_sample": per}


def codec_state(stage: CompressedPipelineStage) -> dict[str, Any]:
    """The state of the stage's stateful codecs, for checkpoints."""
    return {side: c.state_dict() for side, c in stateful_codecs(stage).items()}  # type: ignore[attr-defined]


def load_codec_state(stage: CompressedPipelineStage, state: dict[str, Any]) -> None:
    codecs = stateful_codecs(stage)
    if set(codecs) != set(state):
        raise CodecError(f"checkpoint holds codec state for {sorted(state)} but this stage has stateful codecs "
                         f"on {sorted(codecs)}; resume with the run's own --fwd-codec")
    for side, c in codecs.items():
        c.load_state_dict(state[side])  # type: ignore[attr-defined]


# descriptions gathered so far where each rank holds several stages, by group: one exchange per stage made
_GATHERED: dict[Any, list[dict[str, Any]]] = {}


def check_boundaries(stage_index: int, num_stages: int, in_b: Boundary | None, out_b: Boundary | None,
                     group: dist.ProcessGroup | None = None) -> None:
    """All stages exchange their boundary descriptions; neighbours must agree exactly.

    One exchange (a collective over ``group``) per call. With one stage per rank the check runs at once; with
    several (interleaved and V-shaped schedules: ``num_stages`` a multiple of the group's size), every rank makes
    its stages in turn, as many on each rank, and the check runs at the last of them.
    """
    mine = {"stage": stage_index, "in": in_b.describe() if in_b else None,
            "out": out_b.describe() if out_b else None}
    world = dist.get_world_size(group)
    if num_stages < world or num_stages % world:
        raise BoundaryMismatchError(f"{num_stages} stages over the {world} ranks of the pipeline group: give each rank "
                                    f"as many stages (a multiple of {world}), or a group of {num_stages} ranks")
    got: list[Any] = [None] * world
    dist.all_gather_object(got, mine, group=group)
    key = id(group) if group is not None else None
    allv = _GATHERED.pop(key, []) + got
    if len(allv) < num_stages:
        _GATHERED[key] = allv
        return
    held = sorted(d["stage"] for d in allv)
    if held != list(range(num_stages)):
        twice = sorted({k for k in held if held.count(k) > 1})
        raise BoundaryMismatchError(f"the ranks of the pipeline group made stages {held} of {num_stages}: "
                                    + (f"stage(s) {twice} on more than one rank; " if twice else "")
                                    + "give every stage index in [0, num_stages) to one rank")
    allv.sort(key=lambda d: d["stage"])
    problems = []
    for k in range(num_stages - 1):
        a, b = allv[k]["out"], allv[k + 1]["in"]
        if a != b:
            diff = {key: (a.get(key), b.get(key)) for key in a if a.get(key) != b.get(key)} if a and b else (a, b)
            problems.append(f"boundary {k}->{k + 1}: stage {k} sends {a}, stage {k + 1} expects {b} (differs: {diff})")
    if problems:
        raise BoundaryMismatchError(
            "pipeline stages disagree on their boundaries; give every rank the same --fwd-codec/--bwd-codec, "
            "micro-batch size and sequence length:\n  " + "\n  ".join(problems)
        )


def boundary_bytes(stage: CompressedPipelineStage) -> dict[str, int]:
    """Bytes this stage has sent so far, from the real payloads: forward activations,
    backward gradients, and what the same messages would have been in fp32."""
    out = {"fwd": 0, "bwd": 0, "fp32": 0}
    for b in (stage.in_boundary, stage.out_boundary):
        if b is not None:
            out["fwd"] += b.fwd_sent
            out["bwd"] += b.bwd_sent
            out["fp32"] += b.fp32_sent
    return out


__all__: Sequence[str] = [
    "Boundary", "BoundaryMismatchError", "CodecClock", "CompressedPipelineStage", "CompressedStageModule",
    "boundary_bytes", "check_boundaries", "codec_cache_nbytes", "codec_state", "compressed_pipeline_stage",
    "load_codec_state", "set_codec_phase", "stateful_codecs",
]
