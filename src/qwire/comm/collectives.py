"""Compressed collectives on any ``torch.distributed`` process group.

Every collective moves codec payloads (1-D ``uint8``), never raw tensors, and
never adds numbers in a compressed format: payloads are decoded and summed in
fp32 (TACO, arXiv 2604.24088; AGoQ's QuanGrad, arXiv 2605.00539)::

    all_gather(x, codec)      encode -> all-gather of payloads -> decode   -> [world, *x.shape]
    reduce_scatter(x, codec)  flatten, pad to world * k, encode each of the world shards,
                              all-to-all of payloads, decode, sum in fp32 in rank order
                              -> this rank's shard, 1-D, k = ceil(numel / world)
    all_reduce(x, codec)      two-shot: reduce_scatter, re-encode the reduced shard,
                              all-gather of payloads, decode         -> x.shape, x.dtype
    all_reduce_future(...)    the same, run in order on a background thread; returns a
                              ``torch.futures.Future`` (a DDP communication hook can return it)

``codec`` is a :class:`~qwire.codecs.Codec` or a spec string (``"fp8"``,
``"fp8:format=e5m2,group=64"``, ``"fp32"``).

What is guaranteed
------------------
* Every rank's own contribution goes through the codec too (it is encoded and
  decoded like the others), so the result depends only on the inputs, not on
  which rank computes it, and ``all_reduce`` / ``all_gather`` return
  **bit-identical tensors on every rank**. Tensor parallelism relies on this:
  replicated activations and gradients must not drift apart.
* With a lossless codec (``fp32`` on fp32 tensors) ``reduce_scatter`` and
  ``all_reduce`` return exactly ``((x_0 + x_1) + x_2) + ...`` evaluated in fp32
  in rank order (then cast to ``x.dtype``), and ``all_gather`` returns the inputs
  exactly. For two ranks that equals ``dist.all_reduce`` bit for bit; for more
  ranks gloo and NCCL sum in another order, so the two agree to fp32 rounding.
* ``op="mean"`` divides the fp32 sum by the world size before casting.
* Sizes that do not divide by ``world x group`` are zero-padded; the padding
  reaches the caller only in ``reduce_scatter``'s shards, which are all
  ``ceil(numel / world)`` long (the last ones end in zeros).

Timeouts and errors
-------------------
Collectives run under the process group's timeout: set it in
``dist.init_process_group(..., timeout=timedelta(seconds=...))`` (or
``new_group(timeout=...)``); a dead or stuck peer then raises instead of
hanging. All ranks must call with the same shape, dtype and codec
configuration; :func:`check_same_codec` verifies that once (e.g. at setup)
and names the ranks that disagree. It is not checked per call (that would
cost a round trip): on gloo a rank whose payload has another size makes gloo
abort the process (SIGABRT), on NCCL the sum is garbage.

An error raised on one rank inside a collective (a ``NonFiniteError`` for NaN
or Inf in its input, refused before anything is sent) is raised on that rank
only: its peers stay in the collective until the group's timeout or that
rank's exit. End the process there (``qwire train`` does); a loop that catches
the error and calls the next collective pairs the ranks' collectives up
wrongly. In an all-reduce of fp16 or bf16 tensors whose fp32 sum exceeds the
dtype, the owner of that shard raises a ``CodecError`` that says so where the
codec refuses non-finite values (the quantizing ones); the float casts
(``fp16``, ``bf16``, ``fp32``) pass the Inf on, as an uncompressed all-reduce
in that dtype would.

The all-to-all is ``dist.all_to_all_single`` on the uint8 payloads, which gloo
supports on CPU (checked with torch 2.13) as well as NCCL.

Transports
----------
NCCL moves CUDA tensors; gloo moves host tensors. On a gloo group, payloads of
CUDA tensors cross through host buffers (pinned): the encoded payload is copied
to the host, gloo moves it, and what arrives is copied back to the GPU before it
is decoded. Only payloads cross to the host, never the tensors they encode, and
the results are the same as without staging. This is what lets several ranks
share one GPU (NCCL refuses two ranks on one device). :func:`staged_bytes` counts
the bytes copied; :func:`force_host_staging` (or ``QWIRE_HOST_STAGING=1`` in the
environment) stages CPU tensors too, to check the path where there is no GPU.
:func:`all_gather_into` and :func:`broadcast` are the uncompressed transfers
(FSDP's mixed-dtype all-gather, replicated parameters at start-up), staged alike.

Autograd
--------
Megatron-style operators, compressed in both directions (the tensor-parallel
styles in :mod:`qwire.parallel.tp` are built from them):

* :func:`copy_to_tp_region`: forward identity; backward all-reduce (sum).
* :func:`reduce_from_tp_region`: forward all-reduce (sum); backward identity.
* :func:`gather_from_sp_region`: forward all-gather along ``dim``; backward reduce-scatter along ``dim``.
* :func:`reduce_scatter_to_sp_region`: forward reduce-scatter along ``dim``; backward all-gather along ``dim``.
* :func:`gather_from_tp_region`: forward all-gather along ``dim``; backward keeps the own chunk (no traffic).
* :func:`scatter_to_tp_region`: forward keeps the own chunk (no traffic); backward all-gather along ``dim``.

The first four expect *partial* gradients downstream (each rank holds a
summand), the last two *replicated* ones (every rank holds the same gradient).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from qwire.codecs import Codec, CodecError, NonFiniteError, get_codec
from qwire.codecs.kernels.deferred import PendingChecks, resolved
from qwire.codecs.kernels.deferred import wanted as deferred_wanted

__all__ = [
    "CollectiveError",
    "all_gather",
    "all_gather_dim",
    "all_gather_into",
    "broadcast",
    "all_reduce",
    "all_reduce_future",
    "check_same_codec",
    "force_host_staging",
    "comm_seconds",
    "sent_bytes",
    "staged_bytes",
    "stages",
    "copy_to_tp_region",
    "gather_from_sp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter",
    "reduce_scatter_dim",
    "reduce_scatter_to_sp_region",
    "scatter_to_tp_region",
    "submit_ordered",
    "wire_bytes",
]

CodecLike = Codec | str
Group = Any  # dist.ProcessGroup | None


class CollectiveError(ValueError):
    """A compressed collective was called with arguments it cannot take (says what to change)."""


# ---------------------------------------------------------------------------------------------
# helpers

def _as_codec(codec: CodecLike) -> Codec:
    return get_codec(codec)


def _world_rank(group: Group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise CollectiveError(
            "torch.distributed is not initialized: call dist.init_process_group(backend, "
            "timeout=timedelta(seconds=...)) on every rank before using qwire's collectives"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise CollectiveError(
            f"this process (rank {dist.get_rank()}) is not in the group it was given: call a group's collectives "
            "only on its members (dist.new_group(ranks) is called on every rank, but only those in ranks use it)"
        )
    return dist.get_world_size(group), rank


def _op(op: Any) -> str:
    if op in ("sum", dist.ReduceOp.SUM):
        return "sum"
    if op in ("mean", "avg", dist.ReduceOp.AVG):
        return "mean"
    raise CollectiveError(f"op must be 'sum' or 'mean', got {op!r}")


# Payload bytes this process has handed to the transport for other ranks, per process group (world - 1
# copies of each payload it contributes to an all-to-all or all-gather), for training metrics; read with
# sent_bytes(group). The DDP hook runs collectives on a background thread, hence the lock.
_SENT: dict[Any, int] = {}
_SENT_LOCK = threading.Lock()
_ALL = object()


def _count_sent(group: Group, nbytes: int) -> None:
    with _SENT_LOCK:
        _SENT[group] = _SENT.get(group, 0) + int(nbytes)


# Seconds the calling thread spent inside the compressed collectives (encode, transfer, decode),
# outermost calls only; read with comm_seconds(). Collectives on qwire's background thread are
# not counted (they overlap with computation).
_TIME = [0.0]
_DEPTH = threading.local()


def comm_seconds() -> float:
    """Seconds spent in compressed collectives on the main thread of this process (for time breakdowns)."""
    return _TIME[0]


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    import functools
    import time

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        depth = getattr(_DEPTH, "n", 0)
        _DEPTH.n = depth + 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH.n = depth
            if depth == 0:
                _TIME[0] += time.perf_counter() - t0
    return wrapper


def sent_bytes(group: Any = _ALL) -> int:
    """Payload bytes this process has handed to the transport for other ranks through qwire's collectives
    so far: on ``group`` (``None``: the default group), or on every group when no group is given."""
    with _SENT_LOCK:
        return sum(_SENT.values()) if group is _ALL else _SENT.get(group, 0)


# ---------------------------------------------------------------------------------------------
# host staging: gloo moves host tensors. A CUDA payload on a gloo group is copied into a host buffer
# (pinned, from torch's caching host allocator) before the transfer, and what arrives is copied back
# to the device after it: only payloads cross to the host, never the tensors they encode. NCCL (and
# gloo with CPU tensors) moves the tensors where they are.

_STAGED = [0]  # payload bytes copied through host buffers by this process, both directions


def staged_bytes() -> int:
    """Payload bytes this process has copied through host buffers for gloo (both directions) so far."""
    with _SENT_LOCK:
        return _STAGED[0]


def force_host_staging(on: bool = True) -> None:
    """Stage every payload through a host buffer, CPU tensors included (process-wide; for checking the
    staging path on a machine without a GPU: the results are the same with and without it)."""
    global _FORCE_STAGING
    _FORCE_STAGING = bool(on)


_FORCE_STAGING: bool | None = None  # None: as QWIRE_HOST_STAGING says when asked (a rank forked from a server
# that imported this module before the launcher set it reads the launcher's environment)


def stages(t: torch.Tensor, group: Group) -> bool:
    """Whether ``t`` crosses ``group`` through a host buffer: a device tensor on a gloo group (or forced)."""
    forced = os.environ.get("QWIRE_HOST_STAGING", "") == "1" if _FORCE_STAGING is None else _FORCE_STAGING
    return forced or (t.device.type != "cpu" and dist.get_backend(group) == "gloo")


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")


def _staged(fn: Callable[..., Any], out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    """``fn(out, inp, group=group)``, through host buffers when :func:`stages` says so (``out is inp``: one
    buffer, for an in-place transfer)."""
    if not stages(inp, group):
        fn(out, inp, group=group)
        return
    h_in = _host_buffer(inp)
    h_in.copy_(inp)  # synchronous: the payload is complete before gloo reads the buffer
    h_out = h_in if out is inp else _host_buffer(out)
    fn(h_out, h_in, group=group)
    out.copy_(h_out, non_blocking=out.device.type == "cuda")
    with _SENT_LOCK:
        _STAGED[0] += inp.numel() * inp.element_size() + out.numel() * out.element_size()


def raw_all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group = None) -> None:
    """torch's all-gather into one tensor, looked up at each call: all_gather_single where torch has it
    (all_gather_into_tensor is deprecated there, with a FutureWarning per call site and rank)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp, group=group)


def _all_gather_bytes(out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    _count_sent(group, inp.numel() * (dist.get_world_size(group) - 1))
    _staged(raw_all_gather, out, inp, group)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Group = None) -> None:
    """``dist.all_gather_into_tensor(out, inp)`` of raw bytes (uncompressed), staged through host memory
    on a gloo group when the tensors are on a GPU (see :func:`stages`); counted in :func:`sent_bytes`."""
    _all_gather_bytes(out, inp, group)


def broadcast(t: torch.Tensor, src: int, group: Group = None) -> None:
    """``dist.broadcast(t, src)`` (``src`` a global rank), in place, staged like the collectives."""
    _staged(lambda out, inp, group: dist.broadcast(out, src=src, group=group), t, t, group)


def _checks(x: torch.Tensor) -> PendingChecks | None:
    """The codecs' checks of one side of a collective (the encodes, before anything is sent; the decodes, at the
    end), read back together on a GPU (:mod:`qwire.codecs.kernels.deferred`); elsewhere where they are made."""
    return PendingChecks() if deferred_wanted(x.device) else None


def _encode(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    p = codec.encode(x)
    want = codec.payload_nbytes(x.shape, x.dtype)
    if p.numel() != want:  # a broken codec would desynchronize the ranks: refuse loudly
        raise CodecError(f"codec {codec.spec()!r} produced {p.numel()} bytes, payload_nbytes says {want}")
    return p


def _shard_len(numel: int, world: int) -> int:
    return -(-numel // world)


# ---------------------------------------------------------------------------------------------
# collectives

@_timed
def all_gather(x: torch.Tensor, codec: CodecLike, group: Group = None) -> torch.Tensor:
    """Compressed all-gather: returns ``[world, *x.shape]`` in ``x.dtype`` (same on every rank).

    Entry ``r`` is ``decode(encode(x on rank r))``, this rank's own entry included.
    """
    codec = _as_codec(codec)
    world, _ = _world_rank(group)
    gathered, n = _gather_payloads(codec, x, group, world)
    with resolved(_checks(x)):
        return torch.stack([codec.decode(gathered[r * n:(r + 1) * n], x.shape, x.dtype) for r in range(world)])


def _gather_payloads(codec: Codec, x: torch.Tensor, group: Group, world: int) -> tuple[torch.Tensor, int]:
    """Every rank's payload of ``x``, concatenated in rank order, and the length of one."""
    with resolved(_checks(x)):
        p = _encode(codec, x)
    n = p.numel()
    gathered = torch.empty(world * n, dtype=torch.uint8, device=x.device)
    if n:
        _all_gather_bytes(gathered, p, group)
    return gathered, n


def _reduce_scatter_fp32(x: torch.Tensor, codec: Codec, group: Group, op: str,
                         sent: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 sum (or mean) of this rank's shard; ``sent`` (``(world, k)``, ``x``'s dtype), if given, receives
    what the payloads this rank sent decode to, shard by shard (error feedback's first-stage error, from the
    very payloads sent: no second encode, and the same draws under stochastic rounding)."""
    world, _ = _world_rank(group)
    k = _shard_len(x.numel(), world)
    flat = x.reshape(-1)
    pad = world * k - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if k == 0:
        return torch.zeros(0, dtype=torch.float32, device=x.device)
    shards = flat.view(world, k)
    with resolved(_checks(x)):
        send = torch.cat([_encode(codec, shards[r]) for r in range(world)])
        n = send.numel() // world
        if sent is not None:
            for r in range(world):
                sent[r].copy_(codec.decode(send[r * n:(r + 1) * n], (k,), x.dtype))
    recv = torch.empty_like(send)
    if n:
        _count_sent(group, n * (world - 1))
        _staged(dist.all_to_all_single, recv, send, group)
    # the sum in place (the first decoded shard is this function's own tensor): no fresh buffer per rank
    with resolved(_checks(x)):
        acc = codec.decode(recv[:n], (k,), x.dtype).to(torch.float32)
        for r in range(1, world):  # fixed rank order: deterministic and identical on every rank
            acc.add_(codec.decode(recv[r * n:(r + 1) * n], (k,), x.dtype).to(torch.float32))
    if op == "mean":
        acc.div_(world)
    return acc


@_timed
def reduce_scatter(x: torch.Tensor, codec: CodecLike, group: Group = None, op: str = "sum",
                   sent: torch.Tensor | None = None) -> torch.Tensor:
    """Compressed reduce-scatter of the flattened ``x``: this rank's 1-D shard, length ``ceil(numel/world)``.

    Rank ``r`` gets elements ``[r*k, (r+1)*k)`` of the flattened, zero-padded sum
    (``op="sum"``) or mean (``op="mean"``); summed in fp32, returned in ``x.dtype``. ``sent``, a
    ``(world, k)`` tensor of ``x``'s dtype and device, receives what this rank's payloads decode to
    (row ``r``: the shard it sent to rank ``r``), for error feedback.
    """
    if sent is not None:
        k = _shard_len(x.numel(), _world_rank(group)[0])
        if tuple(sent.shape) != (_world_rank(group)[0], k) or sent.dtype != x.dtype or sent.device != x.device:
            raise ValueError(f"reduce_scatter: sent must be a {x.dtype} tensor of shape ({_world_rank(group)[0]}, {k}) "
                             f"on {x.device}, got {sent.dtype} {tuple(sent.shape)} on {sent.device}")
    return _reduce_scatter_fp32(x, _as_codec(codec), group, _op(op), sent=sent).to(x.dtype)


@_timed
def all_reduce(x: torch.Tensor, codec: CodecLike, group: Group = None, op: str = "sum",
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Two-shot compressed all-reduce; same shape and dtype as ``x``, bit-identical on every rank.

    ``out`` (a contiguous tensor of ``x``'s shape and dtype, ``x`` itself allowed) receives the result,
    which is then returned: the decoded shards are written into it, so a large bucket needs no fresh
    buffer (whose first touch of every page costs more than the copy on a CPU).
    """
    codec = _as_codec(codec)
    world, _ = _world_rank(group)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous()
                            or out.device != x.device):
        raise ValueError(f"all_reduce: out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)} on "
                         f"{x.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if x.numel() == 0:
        return x.clone() if out is None else out
    shard = _reduce_scatter_fp32(x, codec, group, _op(op)).to(x.dtype)
    try:
        if out is None:
            full = all_gather(shard, codec, group)  # [world, k]
            return full.reshape(-1)[: x.numel()].reshape(x.shape)
        gathered, m = _gather_payloads(codec, shard, group, world)  # all_gather, decoding into out
    except NonFiniteError:
        # the reduce-scatter's encode refused non-finite inputs (this codec refuses them): an Inf here is a sum past
        # the dtype
        if x.dtype != torch.float32 and not bool(torch.isfinite(shard).all()):
            raise CodecError(f"all_reduce: the {op} over the ranks of these {x.dtype} tensors exceeds the dtype's "
                             f"range ({torch.finfo(x.dtype).max:g}) in {int((~torch.isfinite(shard)).sum())} "
                             "elements, though every input was finite; all-reduce them in float32 (or scale them "
                             "down). This rank stops here and its peers in the collective wait for it: end the "
                             "process") from None
        raise
    flat, k, n = out.view(-1), shard.numel(), x.numel()
    with resolved(_checks(x)):
        for r in range(world):
            lo, hi = r * k, min((r + 1) * k, n)
            if hi > lo:
                flat[lo:hi].copy_(codec.decode(gathered[r * m:(r + 1) * m], shard.shape, x.dtype)[: hi - lo])
    return out


def all_gather_dim(x: torch.Tensor, dim: int, codec: CodecLike, group: Group = None) -> torch.Tensor:
    """Compressed all-gather concatenating the ranks' tensors along ``dim`` (like DTensor Shard(dim) -> Replicate)."""
    parts = all_gather(x, codec, group)
    return torch.cat(parts.unbind(0), dim=dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, codec: CodecLike, group: Group = None,
                       op: str = "sum") -> torch.Tensor:
    """Compressed reduce-scatter along ``dim``: rank ``r`` gets chunk ``r`` of the sum (Partial -> Shard(dim)).

    ``x.shape[dim]`` must be divisible by the world size.
    """
    world, _ = _world_rank(group)
    dim = dim % x.dim()
    if x.shape[dim] % world:
        raise CollectiveError(
            f"reduce_scatter along dim {dim}: size {x.shape[dim]} is not divisible by the world size {world}; "
            f"pad that dimension to a multiple of {world} (e.g. the sequence length for sequence parallelism)"
        )
    moved = x.movedim(dim, 0).contiguous()
    out = reduce_scatter(moved, codec, group, op)
    return out.view(x.shape[dim] // world, *moved.shape[1:]).movedim(0, dim)


# ---------------------------------------------------------------------------------------------
# async

class _OrderedWorker:
    """One background thread running submitted jobs strictly in submission order.

    Collectives on a group must be issued in the same order on every rank; a
    single FIFO thread keeps the order in which the caller submitted them.
    A job runs on the CUDA stream (and so the device) that was current where it
    was submitted, as if the submitter had run it: a new thread's own would be
    GPU 0's default stream, which need not be the rank's GPU, nor the stream
    whose kernels made the job's tensors.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="qwire-collectives", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, stream, fut = self._q.get()
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    fut.set_result(fn())
            except BaseException as e:  # delivered to whoever waits on the future
                fut.set_exception(e)

    def submit(self, fn: Callable[[], torch.Tensor]) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
        self._q.put((fn, stream, fut))
        return fut


_worker: _OrderedWorker | None = None
_worker_lock = threading.Lock()


def _get_worker() -> _OrderedWorker:
    global _worker
    with _worker_lock:
        if _worker is None or not _worker._thread.is_alive():
            _worker = _OrderedWorker()
        return _worker


def submit_ordered(fn: Callable[[], Any]) -> torch.futures.Future:
    """Run ``fn()`` on qwire's ordered background thread (the one :func:`all_reduce_future` uses).

    Jobs run one at a time in submission order, so collectives inside ``fn`` keep
    the order in which every rank submitted them. Returns a future of ``fn()``'s
    result (or its exception).
    """
    return _get_worker().submit(fn)


def all_reduce_future(x: torch.Tensor, codec: CodecLike, group: Group = None, op: str = "sum", *,
                      background: bool = True, out: torch.Tensor | None = None) -> torch.futures.Future:
    """:func:`all_reduce` returning a ``torch.futures.Future[Tensor]`` (usable as a DDP comm hook's result).

    With ``background=True`` the collective runs on one qwire thread that executes
    every submitted collective in submission order, so ranks that submit in the
    same order (DDP does, bucket by bucket) issue the same sequence of collectives.
    Do not issue *other* collectives on the same group from another thread until
    the returned futures are done (DDP waits for all hook futures at the end of
    backward), and do not modify ``x`` before the future is done (it is read when the job runs).
    ``background=False`` runs inline and returns a completed future. ``out``: as for :func:`all_reduce`
    (written when the job runs; ``x`` itself is allowed, it is read before it is written).
    Errors (a codec error, a peer timing out) are set on the future and raised by ``wait()``.
    """
    codec = _as_codec(codec)
    op = _op(op)
    _world_rank(group)
    if not background:
        fut: torch.futures.Future = torch.futures.Future()
        try:
            fut.set_result(all_reduce(x, codec, group, op, out=out))
        except Exception as e:
            fut.set_exception(e)
        return fut
    return _get_worker().submit(lambda: all_reduce(x, codec, group, op, out=out))


# ---------------------------------------------------------------------------------------------
# configuration check

def check_same_codec(codec: CodecLike, group: Group = None, *, shape: Sequence[int] | None = None,
                     dtype: torch.dtype | None = None, what: str = "a collective",
                     fix: str = "Pass the same codec spec (and tensor shape) on every rank.") -> str:
    """All-gather this rank's codec spec (and shape/dtype if given); raise if any rank differs.

    Returns the common spec. Raises :class:`~qwire.codecs.CodecError` naming the
    ranks and their specs when they disagree (``what``: the collective, ``fix``: what to change).
    Collective: call it on every rank.
    """
    codec = _as_codec(codec)
    world, _ = _world_rank(group)
    mine = codec.spec()
    if shape is not None:
        mine += f" shape={tuple(int(d) for d in shape)}"
    if dtype is not None:
        mine += f" dtype={str(dtype).replace('torch.', '')}"
    specs: list[Any] = [None] * world
    dist.all_gather_object(specs, mine, group=group)
    if len(set(specs)) > 1:
        by_spec: dict[str, list[int]] = {}
        for r, s in enumerate(specs):
            by_spec.setdefault(s, []).append(r)
        detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {s}"
                           for s, rs in by_spec.items())
        raise CodecError(f"ranks disagree on the codec configuration of {what}: {detail}. {fix}")
    return mine


# ---------------------------------------------------------------------------------------------
# wire accounting

def wire_bytes(kind: str, shape: Sequence[int], dtype: torch.dtype, codec: CodecLike,
               world: int) -> dict[str, int]:
    """Bytes one rank sends in a compressed collective, per step and in total.

    ``kind`` is ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``. The
    all-to-all and all-gather steps each send ``world - 1`` payloads (a shard
    payload for reduce-scatter and the two-shot all-reduce, the whole tensor's
    payload for all-gather).
    """
    codec = _as_codec(codec)
    n = 1
    for d in shape:
        n *= int(d)
    k = _shard_len(n, world)
    shard = codec.payload_nbytes((k,), dtype)
    if kind == "all_gather":
        steps = [(world - 1) * codec.payload_nbytes(tuple(shape), dtype)]
    elif kind == "reduce_scatter":
        steps = [(world - 1) * shard]
    elif kind == "all_reduce":
        steps = [(world - 1) * shard, (world - 1) * shard]
    else:
        raise CollectiveError(f"kind must be all_gather, reduce_scatter or all_reduce, got {kind!r}")
    return {"steps": len(steps), "bytes_per_step": steps[0], "bytes_total": sum(steps),
            "payload_per_shard": shard}


# ---------------------------------------------------------------------------------------------
# autograd-aware operators (Megatron's f / g and their sequence-parallel counterparts)

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, codec, group):  # type: ignore[override]
        ctx.codec, ctx.group = codec, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return all_reduce(grad.contiguous(), ctx.codec, ctx.group), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, codec, group):  # type: ignore[override]
        return all_reduce(x.contiguous(), codec, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, codec, grad_codec, group):  # type: ignore[override]
        ctx.dim, ctx.codec, ctx.group = dim, grad_codec, group
        return all_gather_dim(x.contiguous(), dim, codec, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return reduce_scatter_dim(grad.contiguous(), ctx.dim, ctx.codec, ctx.group), None, None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, codec, grad_codec, group):  # type: ignore[override]
        ctx.dim, ctx.codec, ctx.group = dim, grad_codec, group
        return reduce_scatter_dim(x.contiguous(), dim, codec, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return all_gather_dim(grad.contiguous(), ctx.dim, ctx.codec, ctx.group), None, None, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, codec, group):  # type: ignore[override]
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x.contiguous(), dim, codec, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        world, rank = _world_rank(ctx.group)
        return grad.chunk(world, ctx.dim)[rank].contiguous(), None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, grad_codec, group):  # type: ignore[override]
        world, rank = _world_rank(group)
        if x.shape[dim] % world:
            raise CollectiveError(f"cannot split dim {dim} of size {x.shape[dim]} evenly over {world} ranks; "
                                  f"pad it to a multiple of {world} (e.g. the sequence length)")
        ctx.dim, ctx.codec, ctx.group = dim, grad_codec, group
        return x.chunk(world, dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return all_gather_dim(grad.contiguous(), ctx.dim, ctx.codec, ctx.group), None, None, None


def gather_from_tp_region(x: torch.Tensor, dim: int, codec: CodecLike, group: Group = None) -> torch.Tensor:
    """Compressed all-gather along ``dim`` in forward; backward keeps this rank's chunk of the (replicated) gradient."""
    return _GatherFromTP.apply(x, dim % x.dim(), _as_codec(codec), group)


def scatter_to_tp_region(x: torch.Tensor, dim: int, grad_codec: CodecLike, group: Group = None) -> torch.Tensor:
    """Keep this rank's chunk along ``dim`` in forward (no traffic); compressed all-gather of the gradient
    in backward."""
    return _ScatterToTP.apply(x, dim % x.dim(), _as_codec(grad_codec), group)


def copy_to_tp_region(x: torch.Tensor, codec: CodecLike, group: Group = None) -> torch.Tensor:
    """Identity in forward; compressed all-reduce (sum) of the gradient with ``codec`` in backward."""
    return _CopyToTP.apply(x, _as_codec(codec), group)


def reduce_from_tp_region(x: torch.Tensor, codec: CodecLike, group: Group = None) -> torch.Tensor:
    """Compressed all-reduce (sum) in forward; identity in backward."""
    return _ReduceFromTP.apply(x, _as_codec(codec), group)


def gather_from_sp_region(x: torch.Tensor, dim: int, codec: CodecLike, group: Group = None,
                          grad_codec: CodecLike | None = None) -> torch.Tensor:
    """Compressed all-gather along ``dim`` in forward; compressed reduce-scatter along ``dim`` in backward."""
    c = _as_codec(codec)
    return _GatherFromSP.apply(x, dim, c, _as_codec(grad_codec) if grad_codec is not None else c, group)


def reduce_scatter_to_sp_region(x: torch.Tensor, dim: int, codec: CodecLike, group: Group = None,
                                grad_codec: CodecLike | None = None) -> torch.Tensor:
    """Compressed reduce-scatter along ``dim`` in forward; compressed all-gather along ``dim`` in backward."""
    c = _as_codec(codec)
    return _ReduceScatterToSP.apply(x, dim, c, _as_codec(grad_codec) if grad_codec is not None else c, group)
