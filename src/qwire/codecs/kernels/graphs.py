"""CUDA graphs of the codecs' GPU kernels: one graph replay per encode or decode instead of its host work.

On a GPU a codec's kernels take microseconds, and the Python around them (the layout's geometry, a dozen
kernel launches and small torch operations) takes longer than they do: the host, not the GPU, sets a codec's
cost (docs/kernels.md, *The second run on the H200*). A CUDA graph records the kernels of one call once and
replays them with one launch, so what is left on the host per call is a copy of the input into the graph's
own buffer, the replay, and a copy of the output out of it.

With graphs on (``QWIRE_CODEC_GRAPHS=1``, ``qwire train --codec-graphs``, or :func:`enable`), for a codec that
runs a Triton kernel on a CUDA tensor (``impl=auto`` or ``triton``; stateless codecs only; the CPU kernels are
never captured, nor a kernel function marked ``graphs = False``: the float casts, one kernel each, which a graph's
copies in and out would only slow), per call signature (the operation, the input's shape and dtype, the
decode's output shape and dtype):

- the first call runs the kernels as usual (it compiles and warms them up);
- the second runs them once more on a side stream, then captures them there into a graph, with the codec's
  checks collected rather than read (:mod:`qwire.codecs.kernels.deferred`: a capture cannot read values
  back), then replays it;
- every later call copies its input into the graph's input buffer, replays, hands the checks' values to the
  caller's pending checks (or reads them at once when there are none, as without graphs), and returns a copy
  of the graph's output (the next replay overwrites it).

The payload bytes and decoded values are those of the kernels run without a graph: the same kernels run on
the same values. What the host decides from the shapes alone (the payload's layout, the kernels' grids) is
decided once, at capture; nothing the kernels compute is read by the host before a check is judged, and a
path that would read one back cannot be captured. A capture that fails is reported once (per codec class and
operation), and that signature runs without a graph from then on (so that an error of the input's is raised
by the kernels as without graphs). A codec object keeps at most
:data:`MAX_GRAPHS` graphs, each with its own memory pool (its input, output and intermediate buffers stay
allocated while the codec object lives); further signatures run without one.

Not yet run on a GPU: the capture and replay of torch's ``CUDAGraph`` are exercised on CPU by a stand-in that
re-runs the captured call (tests/test_codec_graphs.py), the real ones by the ``cuda`` tests.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import kernels
from ..errors import CodecError
from .deferred import PendingChecks, deferring, judge

ENV = "QWIRE_CODEC_GRAPHS"
MAX_GRAPHS = 16  # per codec object

_enabled: bool | None = None  # set by enable(); None: the environment decides
# graph class per device type: CUDA's own; with QWIRE_CODEC_GRAPHS=rerun, Rerun for cpu tensors
FACTORIES: dict[str, Callable[[torch.device], Any]] = {}


def enable(on: bool | None) -> None:
    """Turn graphs on or off for this process (None: :data:`ENV` decides, off unless it is ``1`` or ``rerun``)."""
    global _enabled
    _enabled = on


@contextlib.contextmanager
def turned(on: bool | None) -> Iterator[None]:
    """:func:`enable` ``on`` within the block, and the setting it found back after it."""
    global _enabled
    before = _enabled
    _enabled = on
    try:
        yield
    finally:
        _enabled = before


def _env() -> str:
    v = os.environ.get(ENV, "").strip()
    if v not in ("", "0", "1", "rerun"):
        raise CodecError(f"{ENV}={v!r}: use 1 (capture the codecs' GPU kernels in CUDA graphs), 0 (never), or "
                         "rerun (also the Triton kernels on CPU tensors under Triton's interpreter, through a "
                         "stand-in that runs the call again: for tests)")
    return v


def enabled() -> bool:
    if _enabled is not None:
        return _enabled
    return _env() in ("1", "rerun")


def _factory(device: torch.device) -> Any:
    f = FACTORIES.get(device.type)
    if f is None and device.type == "cpu" and _env() == "rerun":
        return Rerun
    return f


class _Collected(PendingChecks):
    """The checks of a call being captured: their values stay where the kernels write them (no copy, no read)."""

    def add(self, values: torch.Tensor, verdict: Callable[[list], None]) -> None:
        self._items.append((values.detach().reshape(-1), verdict))

    def items(self) -> list[tuple[torch.Tensor, Callable[[list], None]]]:
        return list(self._items)


def _no_reads(body: Callable[[], Any]) -> Any:
    """``body()``, refused (RuntimeError) where it read a value back to the host (:class:`~.counting.DeviceWork`:
    ``item``, ``nonzero``, boolean indexing, a blocking copy to the host...): what a CUDA graph cannot capture."""
    from .counting import DeviceWork

    with DeviceWork(where=False) as work:
        out = body()
    if work.reads:
        raise RuntimeError(f"operation not permitted when stream is capturing (the call reads values back: "
                           f"{', '.join(sorted(set(work.reads)))})")
    return out


class CudaGraph:
    """torch's ``CUDAGraph``, captured on a side stream after one warm-up run there (first launches happen outside
    the capture; a call that reads a value back is refused there, before any capture: :func:`_no_reads`), in
    ``thread_local`` mode (other threads' CUDA calls are not the capture's business), without the device-wide
    synchronize of ``torch.cuda.graph`` (it would wait for a pipeline's posted NCCL receives, which may wait for
    this rank); replayed on the current stream. A capture that fails all the same hands its memory pool back
    to the allocator (torch's ``capture_end`` raises before it does so, and the allocator would go on routing
    the side stream's allocations to a dead capture). The graph's buffers are used on one stream at a time
    (:meth:`order`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graph = torch.cuda.CUDAGraph()
        self.stream: Any = None  # the stream that last used the graph's buffers

    def order(self) -> None:
        """Put the current stream's next work after everything the last stream that used the graph's buffers
        (its input, output and intermediates) has queued so far, where that stream was another: a call from
        a second stream (another thread's, a side stream's) would otherwise copy its input in, or replay over
        the output, while the first stream's replay or copy out has not run yet. The same stream costs
        nothing (its work runs in order)."""
        current = torch.cuda.current_stream(self.device)
        if self.stream is not None and self.stream != current:
            current.wait_stream(self.stream)
        self.stream = current

    def capture(self, body: Callable[[], Any]) -> Any:
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())  # the input buffer's copy
            try:
                with torch.cuda.stream(side):
                    _no_reads(body)
                    self.pool = torch.cuda.graph_pool_handle()  # its own memory pool, named to hand it back
                    self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    try:
                        out = body()
                    except BaseException:
                        self._abandon()
                        raise
                    self.graph.capture_end()
            finally:
                torch.cuda.current_stream().wait_stream(side)
        self.stream = torch.cuda.current_stream(self.device)  # the capture's warm-up wrote the buffers on side
        return out

    def _abandon(self) -> None:
        """End a capture that failed, and return its pool (torch's private calls, where this torch has them)."""
        try:
            self.graph.capture_end()
        except Exception:  # noqa: BLE001 - the capture is void; the body's own error says more
            for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
                call = getattr(torch._C, name, None)
                if call is not None:
                    with contextlib.suppress(Exception):
                        call(torch.cuda.current_device(), self.pool)

    def replay(self) -> None:
        self.graph.replay()


FACTORIES["cuda"] = CudaGraph


class Rerun:
    """A stand-in for a CUDA graph on CPU tensors (the Triton kernels under Triton's interpreter), for tests of
    everything around the graph (``QWIRE_CODEC_GRAPHS=rerun``): its capture runs the call once and keeps what it
    returned, and refuses a call that reads a value back to the host as :class:`CudaGraph` does (:func:`_no_reads`:
    ``item``, ``nonzero``, boolean indexing...); its replay runs the call again
    on the graph's input buffer and writes the results into the captured tensors, as a CUDA graph replay
    overwrites its output. Counts its captures and replays."""

    captures = 0
    replays = 0

    def __init__(self, device: torch.device) -> None:
        self.body: Callable[[], Any] | None = None

    def capture(self, body: Callable[[], Any]) -> Any:
        self.out, self.checks = _no_reads(body)
        Rerun.captures += 1
        self.body = body
        return self.out, self.checks

    def order(self) -> None:
        """A CPU tensor's work runs in the order it is called."""

    def replay(self) -> None:
        Rerun.replays += 1
        out, checks = self.body()
        self.out.copy_(out)
        for (v, _), (w, _) in zip(self.checks, checks, strict=True):
            v.copy_(w)


@dataclass
class _Graph:
    graph: Any
    inp: torch.Tensor  # the buffer a call's input is copied into
    out: torch.Tensor  # where a replay writes the output
    checks: list[tuple[torch.Tensor, Callable[[list], None]]]
    keep: list[torch.Tensor] = field(default_factory=list)  # every tensor a captured launch was given
    calls: int = 0  # replays so far
    holds: int = 0  # the replay whose input ``inp`` holds


@dataclass
class _Store:
    """A codec object's graphs, by call signature."""

    graphs: dict[tuple, _Graph] = field(default_factory=dict)
    seen: set[tuple] = field(default_factory=set)  # signatures run once (the warm-up)
    eager: set[tuple] = field(default_factory=set)  # signatures whose capture failed
    lock: threading.RLock = field(default_factory=threading.RLock)


_WARNED: set[tuple[str, str]] = set()
_GPU = __name__.rpartition(".")[0] + ".gpu"  # the Triton kernels' package: the kernels that are captured


def _signature(op: str, t: torch.Tensor, args: tuple) -> tuple | None:
    """The call's signature: what the host work of a call depends on; None when an argument is not plain."""
    out = [op, t.device, t.dtype, tuple(t.shape)]
    for a in args:
        if isinstance(a, torch.Size | list | tuple):
            a = tuple(a)
        if not isinstance(a, int | float | str | bool | tuple | torch.dtype | torch.device) and a is not None:
            return None
        out.append(a)
    try:
        hash(tuple(out))
    except TypeError:
        return None
    return tuple(out)


def run(codec: Any, op: str, fn: Callable[..., Any], t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``fn(codec, t, *args, **kwargs)``, the kernel of ``codec``'s ``op``: through a graph where graphs are on
    and the call can take one, else directly."""
    factory = _factory(t.device)
    if (kwargs or factory is None or getattr(codec, "stateful", False) or not fn.__module__.startswith(_GPU)
            or not getattr(fn, "graphs", True) or not enabled()):
        return fn(codec, t, *args, **kwargs)
    key = _signature(op, t, args)
    if key is None:
        return fn(codec, t, *args)
    store = codec.__dict__.setdefault("_graphs", _Store())
    with store.lock:
        g = store.graphs.get(key)
        if g is None:
            if key not in store.seen or key in store.eager or len(store.graphs) >= MAX_GRAPHS:
                out = fn(codec, t, *args)
                store.seen.add(key)  # a call that raised (e.g. on a wrong dtype) warms nothing up
                return out
            g = _capture(codec, op, fn, t, args, factory)
            if g is None:
                store.eager.add(key)
                return fn(codec, t, *args)
            store.graphs[key] = g
        return _replay(g, t, store.lock)


def _capture(codec: Any, op: str, fn: Callable[..., Any], t: torch.Tensor, args: tuple, factory: Any
             ) -> _Graph | None:
    from .gpu._common import KEEP  # imported already: fn is one of its kernels

    inp = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    inp.copy_(t)  # a capture runs nothing on a GPU; a stand-in that runs the call reads it
    keep: list[torch.Tensor] = []  # the tensors the last run of body gave its launches: the captured one

    def body() -> tuple[torch.Tensor, list]:
        nonlocal keep
        checks, keep = _Collected(), []
        token = KEEP.set(keep)
        try:
            with torch.no_grad(), deferring(checks):
                out = fn(codec, inp, *args)
        finally:
            KEEP.reset(token)
        return out, checks.items()

    try:
        graph = factory(t.device)
        out, checks = graph.capture(body)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the {op} kernel returned a {type(out).__name__}, not a tensor")
    except Exception as e:  # noqa: BLE001 - the call runs without a graph, which raises what is the input's fault
        warn = (type(codec).__name__, op)
        if warn not in _WARNED:
            _WARNED.add(warn)
            warnings.warn(f"qwire: the {op} of codec {codec.name!r} could not be captured in a CUDA graph "
                          f"({type(e).__name__}: {e}); that call shape runs without one", RuntimeWarning,
                          stacklevel=4)
        return None
    return _Graph(graph, inp, out, checks, keep)


def _replay(g: _Graph, t: torch.Tensor, lock: threading.RLock) -> torch.Tensor:
    g.graph.order()
    g.inp.copy_(t)
    g.graph.replay()
    g.calls += 1
    g.holds = g.calls
    for values, verdict in g.checks:  # into the caller's pending checks (a copy), or read now
        judge(values, _on_input(g, t, g.calls, verdict, lock))
    return g.out.clone()


def _on_input(g: _Graph, t: torch.Tensor, call: int, verdict: Callable[[list], None], lock: threading.RLock
              ) -> Callable[[list], None]:
    """``verdict`` of replay ``call`` of ``g``, judged on that call's input ``t``: the captured verdicts read the
    graph's input buffer (a non-finite input's count, its magnitudes), which later replays overwrite before
    deferred checks are resolved; so the buffer gets ``t`` back first where a later replay wrote it."""

    def judged(values: list) -> None:
        with lock:
            g.graph.order()  # the verdict may read the buffer, perhaps on another stream than the replay's
            if g.holds != call:
                g.inp.copy_(t)
                g.holds = call
            verdict(values)

    return judged


kernels.through = run  # every selected kernel is called through run() from now on
