"""What a piece of code asks of the device, counted without one: :class:`DeviceWork` sees every torch operation
(on a GPU, each is a kernel launch) and every read of values back to the host (on a GPU, each waits for the
queue to drain). Used by ``scripts/gpu_op_count.py`` and the tests of the Triton kernels, which run them on
CPU tensors under Triton's interpreter.
"""

from __future__ import annotations

import collections
import os
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operations that launch nothing (views, allocations)
FREE = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "as_strided", "t",
        "permute", "detach", "alias", "empty", "empty_like", "empty_strided", "lift_fresh"}
# operations that wait for the device: a value read back, or an output sized by the values
READS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
         "is_nonzero", "equal"}


_ACTIVE = threading.local()  # the DeviceWork blocks open in this thread (``Tensor.tolist`` dispatches nothing)
_TOLIST = torch.Tensor.tolist
_OPEN = [0]  # DeviceWork blocks open in all threads: torch.Tensor.tolist is wrapped while there are any
_LOCK = threading.Lock()


def _tolist(t, *a, **kw):
    for work in getattr(_ACTIVE, "works", ()):
        work.reads.append("tolist")
    return _TOLIST(t, *a, **kw)


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a copy copies a CUDA tensor to the host and waits for it (a blocking copy, or one into pageable
    memory): what a CUDA graph's capture cannot hold."""
    if name == "_to_copy" and args and isinstance(args[0], torch.Tensor):
        dev = kwargs.get("device")
        return args[0].is_cuda and dev is not None and torch.device(dev).type == "cpu"
    if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        dst, src = args[0], args[1]
        quiet = (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) and dst.is_pinned()
        return src.is_cuda and not dst.is_cuda and not quiet
    return False


class DeviceWork(TorchDispatchMode):
    """Within ``with DeviceWork() as w:`` (in this thread): ``w.ops`` counts the operations that launch
    something, by the qwire function that made them (``file:function``; not with ``where=False``), leaving out
    those made inside a Triton launch helper (``launch`` of ``kernels/gpu/_common.py``); ``w.reads`` lists the
    reads back to the host: the operations of :data:`READS`, boolean indexing, ``Tensor.tolist`` (which
    dispatches no operation) and copies of CUDA tensors to the host that wait for them."""

    def __init__(self, where: bool = True) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.reads: list[str] = []
        self.where = where

    def __enter__(self):
        with _LOCK:  # the wrapper reports to the blocks open in the thread that calls it
            if not _OPEN[0]:
                torch.Tensor.tolist = _tolist
            _OPEN[0] += 1
        _ACTIVE.works = (*getattr(_ACTIVE, "works", ()), self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.works = tuple(w for w in _ACTIVE.works if w is not self)
        with _LOCK:
            _OPEN[0] -= 1
            if not _OPEN[0]:
                torch.Tensor.tolist = _TOLIST
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READS or (name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                     for i in (args[1] if len(args) > 1 else ()) if i is not None)
                             ) or _to_host(name, args, kwargs or {}):
            self.reads.append(name)
        if name not in FREE and self.where:
            stack = traceback.extract_stack()
            if not any(f.filename.endswith("_common.py") and f.name == "launch" for f in stack):
                where = [f for f in stack if f"{os.sep}qwire{os.sep}" in f.filename and f.filename != __file__]
                self.ops[f"{where[-1].filename.split(os.sep + 'qwire' + os.sep)[-1]}:{where[-1].name}" if where
                         else "?"] += 1
        return func(*args, **(kwargs or {}))


SECTOR = 32  # bytes: the unit in which a GPU's memory serves loads and stores


class MemoryTraffic:
    """The bytes a piece of code moves to and from device memory, counted under Triton's interpreter on CPU
    tensors (a model of a GPU's traffic, not a measurement).

    Within ``with MemoryTraffic() as m:``, call ``m.launch(name)`` as each Triton kernel starts (e.g. from
    ``gpu._launches.watching``); every load, store and atomic of the interpreter is then recorded for that
    launch, as the 32-byte sectors it touches (``watch``: a tensor whose sectors each launch read are also
    counted, in ``m.watched``). ``m.launches`` lists, per launch, ``(name, sectors read, sectors
    written, sector accesses beyond the first of each)``: the distinct sectors are what the launch must move at
    least, whatever the caches hold; the accesses beyond are what it moves again where a cache does not keep
    them. Torch operations outside the launches are counted by :class:`TorchTraffic`.
    """

    def __init__(self, watch: torch.Tensor | None = None) -> None:
        self.launches: list[tuple[str, int, int, int]] = []
        self.watched: list[tuple[str, int]] = []  # with ``watch``: per launch, the bytes of ``watch`` it read
        self._watch = watch
        self._name: str | None = None
        self._reads: list = []
        self._writes: list = []

    def launch(self, name: str) -> None:
        self._close()
        self._name = name

    def _close(self) -> None:
        import numpy as np

        if self._name is None:
            return
        r = np.concatenate(self._reads) if self._reads else np.zeros(0, np.uint64)
        w = np.concatenate(self._writes) if self._writes else np.zeros(0, np.uint64)
        ur, uw = np.unique(r), np.unique(w)
        self.launches.append((self._name, len(ur), len(uw), len(r) + len(w) - len(ur) - len(uw)))
        if self._watch is not None:
            lo = self._watch.data_ptr()
            hi = lo + self._watch.numel() * self._watch.element_size()
            inside = (ur >= lo // SECTOR) & (ur <= (hi - 1) // SECTOR)
            self.watched.append((self._name, SECTOR * int(inside.sum())))
        self._name, self._reads, self._writes = None, [], []

    def _record(self, into: list, ptrs, mask) -> None:
        import numpy as np

        if self._name is None:
            return
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        if mask is not None:
            addr = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)]
        addr = addr.ravel()
        first, last = addr // SECTOR, (addr + np.uint64(size - 1)) // SECTOR
        # a program's accesses to one sector in one instruction are one access
        into.append(np.unique(np.concatenate([first, last[last != first]])))

    def __enter__(self) -> MemoryTraffic:
        from triton.runtime import interpreter as ti

        b = ti.interpreter_builder
        self._saved = {k: b.__dict__.get(k) for k in ("create_masked_load", "create_masked_store",
                                                      "create_atomic_rmw", "create_atomic_cas")}
        load, store = b.create_masked_load, b.create_masked_store
        rmw, cas = b.create_atomic_rmw, b.create_atomic_cas

        def masked_load(ptrs, mask, *a, **kw):
            self._record(self._reads, ptrs, mask)
            return load(ptrs, mask, *a, **kw)

        def masked_store(ptrs, value, mask, *a, **kw):
            self._record(self._writes, ptrs, mask)
            return store(ptrs, value, mask, *a, **kw)

        def atomic_rmw(op, ptr, val, mask, *a, **kw):
            self._record(self._reads, ptr, mask)
            self._record(self._writes, ptr, mask)
            return rmw(op, ptr, val, mask, *a, **kw)

        def atomic_cas(ptr, cmp, val, *a, **kw):
            self._record(self._reads, ptr, None)
            self._record(self._writes, ptr, None)
            return cas(ptr, cmp, val, *a, **kw)

        b.create_masked_load, b.create_masked_store = masked_load, masked_store
        b.create_atomic_rmw, b.create_atomic_cas = atomic_rmw, atomic_cas
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime import interpreter as ti

        self._close()
        b = ti.interpreter_builder
        for k, v in self._saved.items():
            if v is None:
                b.__dict__.pop(k, None)
            else:
                setattr(b, k, v)

    def per_kernel(self) -> dict[str, tuple[int, int, int]]:
        """Per kernel name: (launches, bytes read and written, bytes accessed again), over its launches."""
        out: dict[str, tuple[int, int, int]] = {}
        for name, r, w, a in self.launches:
            n, b, again = out.get(name, (0, 0, 0))
            out[name] = (n + 1, b + SECTOR * (r + w), again + SECTOR * a)
        return out

    def bytes(self) -> tuple[int, int, int]:
        """(bytes read, bytes written, bytes accessed again) over every launch recorded."""
        return tuple(SECTOR * sum(rec[i] for rec in self.launches) for i in (1, 2, 3))  # type: ignore[return-value]


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes an operation moves reading or writing ``t`` once (a broadcast view: its storage's)."""
    if t.device.type == "meta":
        return 0
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0) if t.numel() else 0
    return min(span, t.numel()) * t.element_size()


class TorchTraffic(DeviceWork):
    """:class:`DeviceWork` that also sums, in ``traffic``, the bytes of the tensors each counted operation reads
    and writes (its tensor inputs, and its outputs): on a GPU, each is a kernel moving at least that much."""

    def __init__(self) -> None:
        super().__init__()
        self.traffic = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.ops.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if sum(self.ops.values()) > before:
            flat = list(args) + list((kwargs or {}).values())
            flat += list(out) if isinstance(out, (tuple, list)) else [out]
            for a in flat:
                for t in (a if isinstance(a, (tuple, list)) else [a]):
                    if isinstance(t, torch.Tensor):
                        self.traffic += tensor_bytes(t)
        return out
