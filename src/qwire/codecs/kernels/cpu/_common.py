"""Shared pieces of the CPU kernels: numba options, tensor <-> array views, the thread pool, bit packing."""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np
import torch

# Every kernel: machine code cached on disk, GIL released (threads run in parallel), IEEE
# arithmetic (no fastmath: the payload must match the torch reference bit for bit).
JIT = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")
njit = functools.partial(numba.njit, **JIT)

MIN_BLOCK_ELEMS = 1 << 16  # do not split work into blocks smaller than this (thread hand-off costs ~20 us)


WORKSPACE_NUMEL = 1 << 20  # tensors up to this many elements keep their scratch buffers between calls
WORKSPACES_KEPT = 32       # (codec, operation, shape, thread) workspaces kept, the least recently used dropped


def np_of(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (no copy)."""
    return (t.detach() if t.requires_grad else t).numpy()


class Workspace:
    """The scratch tensors of one kernel call, with their numpy views, kept for the next call of the same
    codec, operation, shape and thread (:func:`workspace`): on the small tensors of a pipeline boundary,
    allocating two dozen buffers and taking their views per call costs as much as a kernel. Each buffer is
    named; asking again for a name gives the same tensor (its contents those the last call left, except
    from :meth:`zeros`/:meth:`full`). Nothing a call returns may alias a buffer. ``const`` holds values
    derived from the codec and the shape alone, computed at the first call."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._views: dict[int, np.ndarray] = {}
        self.const: dict[str, Any] = {}

    def empty(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self._bufs.get(name)
        if t is None or t.shape != shape or t.dtype != dtype:
            if t is not None:
                del self._views[id(t)]
            t = self._bufs[name] = torch.empty(shape, dtype=dtype)
            self._views[id(t)] = t.numpy()
        return t

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.empty(name, shape, dtype).zero_()

    def full(self, name: str, shape: tuple[int, ...], value: float, dtype: torch.dtype = torch.float32
             ) -> torch.Tensor:
        return self.empty(name, shape, dtype).fill_(value)

    def np(self, t: torch.Tensor) -> np.ndarray:
        """The numpy view of ``t``: the one kept for a buffer of this workspace, else :func:`np_of`."""
        v = self._views.get(id(t))
        return v if v is not None else np_of(t)


_workspaces: OrderedDict[tuple, tuple[weakref.ref, Workspace]] = OrderedDict()
_workspaces_lock = threading.Lock()


def workspace(codec: Any, op: str, shape: tuple[int, ...], numel: int) -> Workspace:
    """The :class:`Workspace` of ``codec``'s ``op`` on ``shape`` in this thread: the one the last such call
    used when ``numel`` is at most :data:`WORKSPACE_NUMEL` (a large tensor's call costs far more than its
    allocations: it gets a fresh one, freed after it), at most :data:`WORKSPACES_KEPT` kept in all, and none
    after its codec is gone."""
    if numel > WORKSPACE_NUMEL:
        return Workspace()
    key = (id(codec), op, shape, threading.get_ident())
    with _workspaces_lock:
        hit = _workspaces.get(key)
        if hit is not None and hit[0]() is codec:
            _workspaces.move_to_end(key)
            return hit[1]
        ws = Workspace()
        # (the codec's end drops it: one pop, atomic under the GIL, so no lock a collection could find held)
        _workspaces[key] = (weakref.ref(codec, lambda _, key=key: _workspaces.pop(key, None)), ws)
        while len(_workspaces) > WORKSPACES_KEPT:
            _workspaces.popitem(last=False)
        return ws


@functools.lru_cache(maxsize=8)
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="qwire-codec")


def threads() -> int:
    return max(1, torch.get_num_threads())


def blocks(n_rows: int, row_elems: int, quantum: int = 1) -> tuple[tuple[int, int], ...]:
    """Split ``n_rows`` rows into at most ``threads()`` blocks of whole ``quantum`` s of rows,
    none smaller than MIN_BLOCK_ELEMS elements (except a short tensor's only block)."""
    return _blocks(n_rows, row_elems, quantum, threads())


@functools.lru_cache(maxsize=256)
def _blocks(n_rows: int, row_elems: int, quantum: int, n_threads: int) -> tuple[tuple[int, int], ...]:
    max_blocks = max(1, min(n_threads, (n_rows * max(1, row_elems)) // MIN_BLOCK_ELEMS))
    nq = -(-n_rows // quantum)
    k = max(1, min(max_blocks, nq))
    step = -(-nq // k) * quantum
    return tuple((r0, min(n_rows, r0 + step)) for r0 in range(0, n_rows, step))


def run_blocks(fn: Callable[..., Any], spans: Sequence[tuple[int, int]], *args: Any) -> None:
    """Call ``fn(r0, r1, *args)`` for every block, on the thread pool when there is more than one."""
    if len(spans) == 1:
        fn(spans[0][0], spans[0][1], *args)
        return
    futures = [_pool(len(spans)).submit(fn, r0, r1, *args) for r0, r1 in spans]
    for f in futures:
        f.result()


@njit
def pack_into(out, o, codes, bits):
    """Bit-pack ``codes`` (uint8, each < 2**bits) into ``out`` from byte ``o`` (qwire.codecs.packing's
    format: little-endian bit stream); returns the next byte offset. The last byte may be partial."""
    n = codes.shape[0]
    if bits == 8:
        for i in range(n):
            out[o + i] = codes[i]
        return o + n
    if bits == 4:
        m = n // 2
        for i in range(m):
            out[o + i] = codes[2 * i] | (codes[2 * i + 1] << 4)
        if n % 2:
            out[o + m] = codes[n - 1]
            return o + m + 1
        return o + m
    acc = np.uint64(0)
    nacc = 0
    for i in range(n):
        acc |= np.uint64(codes[i]) << np.uint64(nacc)
        nacc += bits
        if nacc >= 8:
            out[o] = np.uint8(acc & np.uint64(255))
            acc >>= np.uint64(8)
            nacc -= 8
            o += 1
    if nacc > 0:
        out[o] = np.uint8(acc & np.uint64(255))
        o += 1
    return o


@njit
def unpack_from(src, o, codes, bits):
    """Inverse of :func:`pack_into`: fill ``codes`` (uint8) from the bit stream starting at byte ``o``."""
    n = codes.shape[0]
    if bits == 8:
        for i in range(n):
            codes[i] = src[o + i]
        return
    if bits == 4:
        m = n // 2
        for i in range(m):
            b = src[o + i]
            codes[2 * i] = b & 15
            codes[2 * i + 1] = b >> 4
        if n % 2:
            codes[n - 1] = src[o + m] & 15
        return
    mask = np.uint64((1 << bits) - 1)
    acc = np.uint64(0)
    nacc = 0
    for i in range(n):
        while nacc < bits:
            acc |= np.uint64(src[o]) << np.uint64(nacc)
            o += 1
            nacc += 8
        codes[i] = np.uint8(acc & mask)
        acc >>= np.uint64(bits)
        nacc -= bits
