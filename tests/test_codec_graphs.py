"""CUDA graphs of the codecs' kernels (:mod:`qwire.codecs.kernels.graphs`).

Without a GPU the Triton kernels run on CPU tensors under Triton's interpreter, and a stand-in plays the graph
(:class:`qwire.codecs.kernels.graphs.Rerun`): its capture runs the call once and keeps what it returned (and fails
where the call reads a value back, as a CUDA capture does); its replay runs the call again on the graph's input
buffer and writes the results into the captured tensors, as a CUDA graph replay overwrites its output. That
checks everything around the graph: the warm-up call, the input copied in, the output copied out before the
next replay overwrites it, the checks forwarded to the caller's pending checks or read at once, the fallback when
a capture fails, the cap on graphs. The real CUDA graphs are checked by the ``cuda`` test at the end.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import pytest
import torch

from qwire.codecs import CodecError, NonFiniteError, get_codec
from qwire.codecs.kernels import graphs
from qwire.codecs.kernels.deferred import PendingChecks, deferring
from qwire.codecs.kernels.graphs import Rerun
from qwire.codecs.synthetic import llm_like


@pytest.fixture
def on(monkeypatch):
    """Graphs on, with the stand-in, for the Triton kernels on CPU tensors (packing as on a GPU)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels need TRITON_INTERPRET=1 on CPU tensors")
    from qwire.codecs import packing
    from qwire.codecs.kernels import gpu  # noqa: F401  (registers the bit packing of CUDA tensors)

    monkeypatch.setitem(packing.DEVICE_KERNELS, "cpu", packing.DEVICE_KERNELS["cuda"])
    monkeypatch.setitem(graphs.FACTORIES, "cpu", Rerun)
    monkeypatch.setattr(graphs, "_enabled", True)
    monkeypatch.setattr(graphs, "_WARNED", set())
    Rerun.captures = Rerun.replays = 0


def _inputs(n: int = 3, shape=(1, 8, 256)) -> list[torch.Tensor]:
    return [llm_like(shape, massive=1, outlier_channels=2, magnitude=300.0, seed=s)[0] for s in range(n)]


def _plain(spec: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The payload and decoded values of ``spec`` without graphs."""
    with graphs.turned(False):
        c = get_codec(spec)
        p = c.encode(x)
        return p, c.decode(p, x.shape, x.dtype)


SPECS = ["int4", "tahquant", "perchannel6", "fp8", "blockwise8"]


def _same_as_without(spec: str, xs: list[torch.Tensor]):
    """Encode and decode each of ``xs`` with one codec object of ``spec`` (graphs as set), the checks read at once
    and deferred in turns: each payload and decoded tensor equals the one made without graphs, and still does
    after the later calls (each call's output is its own). Returns the codec."""
    c = get_codec(spec)
    seen = []
    for i, x in enumerate(xs):
        pending = PendingChecks() if i % 2 else None
        with deferring(pending):
            p = c.encode(x)
            y = c.decode(p, x.shape, x.dtype)
        if pending is not None:
            pending.resolve()
        ref, yref = _plain(spec, x)
        assert torch.equal(p, ref) and torch.equal(y, yref)
        seen.append((p, y, ref, yref))
    for p, y, ref, yref in seen:
        assert torch.equal(p, ref) and torch.equal(y, yref)
    return c


@pytest.mark.parametrize("spec", SPECS)
def test_graphs_give_the_kernels_bytes_and_values_call_after_call(on, spec):
    _same_as_without(spec + ":impl=triton", _inputs(4))
    # calls 1: as usual, 2: captured and replayed, 3 and 4: replayed; for encode and for decode
    assert Rerun.captures == 2 and Rerun.replays == 6


def test_the_float_casts_are_not_captured(on):
    """fp16's cast is one kernel: a graph would only add its copies in and out, so none is made."""
    _same_as_without("fp16:impl=triton", _inputs(3))
    assert Rerun.captures == 0 and Rerun.replays == 0


def test_a_replays_checks_raise_as_the_kernels_do(on):
    c = get_codec("int4:impl=triton")
    xs = _inputs(2)
    for x in xs:
        c.encode(x)  # as usual, then captured
    bad = xs[0].clone()
    bad[0, 3, 5] = float("nan")
    replays = Rerun.replays
    with pytest.raises(NonFiniteError) as replayed:  # read at once: no pending checks
        c.encode(bad)
    with graphs.turned(False), pytest.raises(NonFiniteError) as plain:
        get_codec("int4:impl=triton").encode(bad)
    assert str(replayed.value) == str(plain.value)
    pending = PendingChecks()  # deferred: raised by resolve(), as the kernels' own deferred checks are
    with deferring(pending):
        c.encode(bad)
    assert len(pending) == 1
    with pytest.raises(NonFiniteError):
        pending.resolve()
    assert Rerun.replays == replays + 2


def test_a_path_that_reads_back_is_not_captured(on):
    """tahquant with two code widths (ratio < 1) lists its tiles with nonzero, a read back: no capture (the
    stand-in refuses it as CUDA does), one warning, and the kernels' own bytes."""
    spec = "tahquant:ratio=0.8,impl=triton"
    c = get_codec(spec)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        outs = [(x, c.encode(x)) for x in _inputs(3)]
    said = [str(m.message) for m in w if "CUDA graph" in str(m.message)]
    assert len(said) == 1 and "reads values back: nonzero" in said[0], said
    assert Rerun.captures == 0
    assert all(torch.equal(p, _plain(spec, x)[0]) for x, p in outs)


def test_a_capture_that_fails_runs_without_a_graph_and_says_so_once(on, monkeypatch):
    class Broken(Rerun):
        def capture(self, body):
            raise RuntimeError("operation failed during capture")

    monkeypatch.setitem(graphs.FACTORIES, "cpu", Broken)
    c = get_codec("int4:impl=triton")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        outs = [(x, c.encode(x)) for x in _inputs(4)]
    said = [str(m.message) for m in w if "CUDA graph" in str(m.message)]
    assert len(said) == 1 and "operation failed during capture" in said[0]
    assert all(torch.equal(p, _plain("int4:impl=triton", x)[0]) for x, p in outs)


def test_graphs_are_off_by_default_and_the_variable_is_checked(on, monkeypatch):
    monkeypatch.setattr(graphs, "_enabled", None)
    monkeypatch.delenv(graphs.ENV, raising=False)
    c = get_codec("int4:impl=triton")
    for x in _inputs(3):
        c.encode(x)
    assert Rerun.captures == 0
    monkeypatch.setenv(graphs.ENV, "yes")
    with pytest.raises(CodecError, match="QWIRE_CODEC_GRAPHS='yes': use 1"):
        c.encode(_inputs(1)[0])
    monkeypatch.setenv(graphs.ENV, "1")
    for x in _inputs(2):
        c.encode(x)
    assert Rerun.captures == 1


def test_one_graph_per_signature_and_at_most_max_graphs(on, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    c = get_codec("int4:impl=triton")
    shapes = [(1, 8, 256), (2, 8, 256), (3, 8, 256)]
    for _ in range(3):
        for s in shapes:
            x = torch.randn(s)
            assert torch.equal(c.encode(x), _plain("int4:impl=triton", x)[0])
    assert Rerun.captures == 2  # the third shape runs without a graph
    assert len(c.__dict__["_graphs"].graphs) == 2


def test_the_reference_the_cpu_kernels_and_stateful_codecs_take_no_graph(on):
    for spec in ("int4:impl=torch", "int4:rounding=stochastic,impl=auto", "int4:impl=cpu"):
        c = get_codec(spec)
        for x in _inputs(3):
            c.encode(x)
    aq = get_codec("aqsgd")
    assert aq.stateful
    assert Rerun.captures == 0


@pytest.mark.cuda
@pytest.mark.parametrize("spec", ["int4", "tahquant", "perchannel6", "fp8", "blockwise8"])
def test_cuda_graphs_give_the_kernels_bytes(spec):
    """On a GPU: CUDA graph replays write the payloads and values the kernels write without one, with the checks
    deferred (as a pipeline stage runs them) and read at once."""
    with graphs.turned(True):
        xs = [x.cuda() for x in _inputs(4, (2, 64, 1600))]
        c = _same_as_without(spec, xs)
        assert len(c.__dict__["_graphs"].graphs) == 2  # encode and decode captured
        bad = xs[0].clone()
        bad[0, 0, 0] = float("inf")
        with pytest.raises(NonFiniteError):
            c.encode(bad)


@pytest.mark.cuda
def test_cuda_graphs_used_from_two_streams_give_each_call_its_own_bytes():
    """On a GPU: one codec's graph replayed from two streams in turn, with a large input so that a replay still
    runs when the other stream's call is queued; every payload equals the one made without graphs."""
    with graphs.turned(True):
        xs = [x.cuda() for x in _inputs(6, (4, 1024, 1600))]
        c = get_codec("int4:impl=triton")
        streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
        got = []
        for i, x in enumerate(xs):
            streams[i % 2].wait_stream(streams[0])  # the input was made on the first
            with torch.cuda.stream(streams[i % 2]):
                got.append(c.encode(x))
        torch.cuda.synchronize()
        assert len(c.__dict__["_graphs"].graphs) == 1
        for x, p in zip(xs, got, strict=True):
            assert torch.equal(p, _plain("int4:impl=triton", x)[0])


@pytest.mark.parametrize("spec", SPECS)
def test_a_deferred_check_judges_its_own_calls_input_after_later_replays(on, spec):
    """The checks of several replays of one graph, deferred to one ``resolve()`` (as a pipeline stage's chunk
    of micro-batches): a NaN in the first call's input is refused with its count, though the next replay wrote
    a finite input over the graph's input buffer, which the captured checks read (they passed it, or gave
    another error); the replays after are unharmed."""
    spec += ":impl=triton"
    c = get_codec(spec)
    xs = _inputs(5)
    for x in xs[:2]:  # as usual, then captured
        c.encode(x)
    bad = xs[2].clone()
    bad[0, 1, 3] = float("nan")
    pending = PendingChecks()
    with deferring(pending):
        c.encode(bad)
        p = c.encode(xs[3])
    with pytest.raises(NonFiniteError, match="1 NaN/Inf value"):
        pending.resolve()
    assert torch.equal(p, _plain(spec, xs[3])[0])
    assert torch.equal(c.encode(xs[4]), _plain(spec, xs[4])[0])
    assert Rerun.replays >= 3


def test_a_graph_keeps_every_tensor_its_captured_launches_read(on, monkeypatch):
    """A graph holds the addresses its launches were given: the graph keeps those tensors (a layout's table
    from a bounded cache, evicted and freed, would otherwise leave a replay reading reused memory)."""
    from qwire.codecs.kernels.gpu import _launches

    monkeypatch.setattr(Rerun, "replay", lambda self: None)  # as a CUDA replay, it launches nothing here
    c = get_codec("int4:layout=log7,impl=triton")
    xs = _inputs(2)
    c.encode(xs[0])
    given: list[torch.Tensor] = []
    with _launches.watching(lambda fn, args, kw: given.extend(a for a in args if isinstance(a, torch.Tensor))):
        c.encode(xs[1])  # captured: the stand-in runs the call once
    (g,) = c.__dict__["_graphs"].graphs.values()
    kept = {id(k) for k in g.keep}
    assert given and all(id(a) in kept for a in given)


class _FakeCuda:
    """What :class:`graphs.CudaGraph` asks of ``torch.cuda``, recorded in ``calls``, without a GPU."""

    def __init__(self, monkeypatch, end_fails: bool = False) -> None:
        self.calls: list = []
        fake = self

        class Stream:
            def wait_stream(self, other):
                if fake.named:  # which of the named streams waited for which
                    fake.calls.append(("wait", fake.named[id(self)], fake.named[id(other)]))
                else:
                    fake.calls.append(("wait", "main" if other is fake.main else "side", self is fake.main))

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode=None):
                fake.calls.append(("begin", pool, capture_error_mode))

            def capture_end(self):
                fake.calls.append(("end",))
                if end_fails:
                    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

        self.main = self.current = Stream()
        self.named: dict[int, str] = {}
        self.Stream = Stream
        for name, value in {"CUDAGraph": Graph, "Stream": Stream, "current_stream": lambda device=None: self.current,
                            "device": lambda d: contextlib.nullcontext(), "stream": lambda s: contextlib.nullcontext(),
                            "graph_pool_handle": lambda: (0, 7), "current_device": lambda: 0}.items():
            monkeypatch.setattr(torch.cuda, name, value)
        for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
            monkeypatch.setattr(torch._C, name, lambda d, p, name=name: self.calls.append((name, d, p)),
                                raising=False)


def test_a_cuda_capture_is_refused_before_it_begins_where_the_warm_up_reads_back(monkeypatch):
    """A call that reads a value back (``nonzero`` here, as ``tahquant`` with two code widths lists its tiles)
    is refused after its warm-up run, before any capture begins: a capture that fails leaves torch's allocator
    routing the side stream's allocations to its pool. The current stream waits for the side stream all the
    same."""
    fake = _FakeCuda(monkeypatch)
    x = torch.tensor([0.0, 1.0, 2.0])
    with pytest.raises(RuntimeError, match="reads values back: nonzero"):
        graphs.CudaGraph(torch.device("cpu")).capture(lambda: x.nonzero())
    assert fake.calls == [("wait", "main", False), ("wait", "side", True)]
    fake.calls.clear()
    out = graphs.CudaGraph(torch.device("cpu")).capture(lambda: x * 2)
    assert torch.equal(out, x * 2)
    assert fake.calls == [("wait", "main", False), ("begin", (0, 7), "thread_local"), ("end",),
                          ("wait", "side", True)]


def test_a_cuda_capture_that_fails_hands_its_pool_back(monkeypatch):
    """A capture that fails all the same (its body raised): torch's ``capture_end`` raises before it ends the
    pool's allocations, so the pool is ended and released by hand; the body's error is what the caller gets."""
    fake = _FakeCuda(monkeypatch, end_fails=True)
    runs = []

    def body():
        runs.append(1)
        if len(runs) == 2:  # the captured run
            raise ValueError("the body's own error")
        return torch.zeros(1)

    with pytest.raises(ValueError, match="the body's own error"):
        graphs.CudaGraph(torch.device("cpu")).capture(body)
    assert fake.calls == [("wait", "main", False), ("begin", (0, 7), "thread_local"), ("end",),
                          ("_cuda_endAllocateToPool", 0, (0, 7)), ("_cuda_releasePool", 0, (0, 7)),
                          ("wait", "side", True)]


def test_a_graph_used_from_another_stream_waits_for_the_last_one(monkeypatch):
    """A graph's buffers are one set per graph: a replay (its input copied in) or a deferred verdict (its input
    copied back) on another stream than the last use first waits for that stream, whose replay and copy out
    may not have run yet; on the same stream nothing waits."""
    fake = _FakeCuda(monkeypatch)
    cg = graphs.CudaGraph(torch.device("cpu"))
    out = cg.capture(lambda: torch.zeros(3))  # on stream a
    a, b = fake.current, fake.Stream()
    fake.named = {id(a): "a", id(b): "b"}
    cg.replay = lambda: None
    fake.calls.clear()
    g = graphs._Graph(cg, torch.zeros(3), out, [])
    lock = threading.RLock()
    verdicts = []
    judged = graphs._on_input(g, torch.ones(3), 1, verdicts.append, lock)
    for stream in (a, a, b, b, a):
        fake.current = stream
        graphs._replay(g, torch.full((3,), 2.0), lock)
    assert fake.calls == [("wait", "b", "a"), ("wait", "a", "b")]
    fake.current = b
    judged(["values"])  # replay 1's input back, after stream a's last replay
    assert fake.calls[2:] == [("wait", "b", "a")] and torch.equal(g.inp, torch.ones(3)) and verdicts == [["values"]]


@pytest.mark.cuda
def test_cuda_a_path_that_reads_back_runs_without_a_graph_and_leaves_the_allocator_whole():
    """On a GPU: ``tahquant`` with two code widths reads back (``nonzero``): refused before a capture begins, it
    runs without a graph, with the kernels' bytes, and the allocator can still empty its cache (a failed capture
    left torch's allocator thinking a capture was under way)."""
    with graphs.turned(True), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        xs = [x.cuda() for x in _inputs(4, (2, 64, 1600))]
        c = _same_as_without("tahquant:ratio=0.5", xs)
        assert [k[0] for k in c.__dict__["_graphs"].graphs] in ([], ["decode"])  # the encode was not captured
        torch.cuda.empty_cache()
        y = torch.empty(1 << 20, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            z = y * 2
        torch.cuda.current_stream().wait_stream(s)
        assert torch.equal(z, y * 2)


def test_a_call_that_raises_is_not_captured_next_time(on):
    """A call refused by the codec (here: an integer tensor) warms nothing up: the same call again is refused the
    same way, with no capture tried (and no warning about one)."""
    c = get_codec("int4:impl=triton")
    bad = torch.zeros(1, 8, 256, dtype=torch.int32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):
            with pytest.raises(CodecError, match="int32"):
                c.encode(bad)
    assert not [m for m in w if "CUDA graph" in str(m.message)]
    assert Rerun.captures == 0


def test_qwire_train_refuses_a_wrong_variable_before_anything_starts(monkeypatch, tmp_path, capfd):
    from qwire.cli import main

    monkeypatch.setenv(graphs.ENV, "on")
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "never")]) == 1
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("qwire train: error: QWIRE_CODEC_GRAPHS='on': use 1"), last
    assert not (tmp_path / "never").exists()
