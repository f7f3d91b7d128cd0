"""Shared pieces of the CPU kernels: numba options, tensor <-> array views, the thread pool, bit packing."""

from __future__ import annotations

import functools
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


def np_of(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (no copy)."""
    return t.detach().numpy()


@functools.lru_cache(maxsize=8)
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="qwire-codec")


def threads() -> int:
    return max(1, torch.get_num_threads())


def blocks(n_rows: int, row_elems: int, quantum: int = 1) -> list[tuple[int, int]]:
    """Split ``n_rows`` rows into at most ``threads()`` blocks of whole ``quantum`` s of rows,
    none smaller than MIN_BLOCK_ELEMS elements (except a short tensor's only block)."""
    max_blocks = max(1, min(threads(), (n_rows * max(1, row_elems)) // MIN_BLOCK_ELEMS))
    nq = -(-n_rows // quantum)
    k = max(1, min(max_blocks, nq))
    step = -(-nq // k) * quantum
    return [(r0, min(n_rows, r0 + step)) for r0 in range(0, n_rows, step)]


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
