"""Checks read back later: the GPU codecs' checks, read where the caller waits for the GPU anyway.

On a GPU, reading a value back waits for the queue to drain. The host, which was ahead of the device, stops; the
kernels launched after the read wait for the host, each a few microseconds of idle GPU when the kernels are
short (a codec's are). The GPU codecs compute their checks on the device: the input's NaN/Inf and magnitude, the
bound on the decoded values, and where that bound does not rule the values in, their largest magnitude. They
hand them to :func:`judge`:

- with no :class:`PendingChecks` in force, it reads them at once, and the codec raises where it is called, as on
  the CPU;
- within ``with deferring(pending):``, it queues a copy of them to pinned host memory, and the caller's
  ``pending.resolve()`` waits once, for the last of them, then raises the first error: the same error, with the
  same message, that the codec would have raised when called.

A pipeline stage on a GPU resolves at the end of each forward and backward chunk, before it sends anything
(:class:`qwire.parallel.pipeline.CompressedPipelineStage`). By then every kernel of the chunk is queued, and the
wait ends when the last check is computed, not when the chunk's work is done.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import threading
from collections.abc import Callable, Iterator

import torch

from ..base import DECODE_LIMIT, check_decoded, decoded_verdict

_PENDING: contextvars.ContextVar[PendingChecks | None] = contextvars.ContextVar("qwire_pending_checks",
                                                                               default=None)


class PendingChecks:
    """Checks queued by the codecs called within :func:`deferring`, until :meth:`resolve`. Safe to fill from
    another thread (autograd runs a CUDA backward on its own device threads)."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, Callable[[list], None]]] = []
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}  # one per (device, stream) copied on
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, values: torch.Tensor, verdict: Callable[[list], None]) -> None:
        """Queue ``verdict(values as a list)``, on a copy of ``values`` as they are now (a later call may write
        them again: a CUDA graph's replay); a CUDA ``values`` is copied to pinned host memory without waiting."""
        v = values.detach().reshape(-1)
        if v.device.type != "cuda":
            v = v.clone()
        with self._lock:
            if v.device.type == "cuda":
                host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                host.copy_(v, non_blocking=True)  # queued on the current stream of v's device
                stream = torch.cuda.current_stream(v.device)
                key = (stream.device_index, stream.stream_id)
                if key not in self._events:
                    self._events[key] = torch.cuda.Event()
                self._events[key].record(stream)  # after every copy queued on that stream so far
                v = host
            self._items.append((v, verdict))

    def discard(self) -> None:
        """Forget the queued checks (the caller is being interrupted)."""
        with self._lock:
            self._items = []

    def resolve(self) -> None:
        """Wait for the queued checks' values (once per stream they were copied on) and judge them in order;
        raises the first error."""
        with self._lock:
            items, self._items = self._items, []
            events = list(self._events.values()) if items else []
        for ev in events:
            ev.synchronize()
        for v, verdict in items:
            verdict(v.numpy().tolist())  # host memory: nothing waits for the device here


ENV = "QWIRE_DEFER_CHECKS"


def wanted(device: torch.device | str) -> bool:
    """Whether callers that can (pipeline stages, the compressed collectives) defer the checks of codecs on
    ``device``: on CUDA devices, where a read back waits for the GPU; ``QWIRE_DEFER_CHECKS=1`` (or ``0``)
    decides for every device, which is how the deferred path is tested where there is no GPU."""
    v = os.environ.get(ENV, "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"{ENV}={v!r}: use 1 (defer the codecs' checks on every device), 0 (never) or leave it "
                         "unset (on CUDA devices)")
    return v == "1" if v else torch.device(device).type == "cuda"


@contextlib.contextmanager
def deferring(pending: PendingChecks | None) -> Iterator[PendingChecks | None]:
    """Within the block, the GPU codecs queue their checks in ``pending`` (None: they read them at once)."""
    token = _PENDING.set(pending)
    try:
        yield pending
    finally:
        _PENDING.reset(token)


@contextlib.contextmanager
def resolved(pending: PendingChecks | None) -> Iterator[None]:
    """:func:`deferring` ``pending``, resolved at the end of the block (None: the checks are read where they are
    made). When the block raises and a check of it fails too (e.g. a module failing on a corrupt payload's
    values), the check's error is raised, with the block's as its cause: the root cause is read last."""
    if pending is None:
        with deferring(None):
            yield
        return
    try:
        with deferring(pending):
            yield
    except Exception as e:
        try:
            pending.resolve()
        except Exception as check:
            raise check from e
        raise
    except BaseException:  # KeyboardInterrupt, SystemExit: no waiting for the GPU
        pending.discard()
        raise
    pending.resolve()


def judge(values: torch.Tensor, verdict: Callable[[list], None]) -> None:
    """``verdict(values as a list)`` now (one read back), or at the pending checks' ``resolve()``."""
    pending = _PENDING.get()
    if pending is None:
        verdict(values.reshape(-1).tolist())
    else:
        pending.add(values, verdict)


def check_decoded_later(vals: torch.Tensor, bound: torch.Tensor, codec: str, limit: float = DECODE_LIMIT,
                        scale: float = 1.0, scan: Callable | None = None) -> float:
    """:func:`~qwire.codecs.base.check_decoded` with the bound ``scale * bound`` (a one-element tensor) on the
    device. Read now: one read back, the values scanned only when the bound does not rule them in; returns the
    bound. Deferred: the values' largest magnitude is reduced on the device too (so that nothing needs the
    values later), by ``scan(vals, bound, scale, limit)`` where given (a kernel that reads the values only
    where the bound does not rule them in and returns that magnitude and the bound in one fp32 ``(2,)`` tensor:
    :func:`qwire.codecs.kernels.gpu._common.scan_beyond`), else by one
    more reduction over them; returns ``inf``, since the bound is not known yet (a caller that clamps to the
    output's range then clamps)."""
    if _PENDING.get() is None:
        b = float(bound) * scale
        check_decoded(vals, b, codec, limit)
        return b
    if scan is not None:  # (largest magnitude, bound) in one buffer
        judge(scan(vals, bound, scale, limit), lambda v: decoded_verdict(v[1] * scale, v[0], codec, limit))
        return math.inf
    m = torch.linalg.vector_norm(vals.reshape(-1), math.inf)  # NaN propagates
    judge(torch.stack((bound.reshape(()).float(), m.float())),
          lambda v: decoded_verdict(v[0] * scale, v[1], codec, limit))
    return math.inf
