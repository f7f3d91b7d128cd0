"""AQ-SGD (Wang et al., NeurIPS 2022): error-compensated activation compression with a per-sample cache.

Both sides of a boundary keep, per training sample ``xi``, the last
reconstructed activation ``m(xi)``. The sender transmits ``Q(a - m(xi))`` and
both sides set ``m(xi) += Q(a - m(xi))``; the receiver's activation is the new
``m(xi)``. A sample that is not in the cache has ``m(xi) = 0``, so its first
visit is plain direct quantization with the inner codec: there is no warm-up
epoch, and every payload has the same size (``sample ids + inner payload``).

The payload starts with the micro-batch's sample ids (int64, one per row of
the leading dimension), so the receiver can check them against its own
expectation, or take them from the payload.

Memory: one ``cache_dtype`` activation per sample per boundary on *each* side,
reported by :meth:`AQSGD.cache_nbytes`. That memory is what TAH-Quant avoids.
Two instances are needed for one boundary, one for the sender and one for the
receiver, and they stay bit-identical: the sender updates its cache with the
decoded payload, exactly what the receiver computes.
"""

from __future__ import annotations

import math
import os
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .base import Codec, CodecError, Param, as_shape, check_finite, check_float_dtype, clamp_to_dtype_, numel
from .kernels import dispatch
from .registry import get_codec, nested_codec, register
from .wire import from_bytes, to_bytes

ID_BYTES = 8


class AQSGD(Codec):
    name = "aqsgd"
    params = (
        Param("inner", str, "int4", "spec of the codec for the deltas (its options joined with ';')"),
        Param("cache_dtype", str, "fp16", "how cached activations are stored: fp16, bf16, fp32, or int8 "
              "(per-tile 8-bit codes: half of fp16's memory, identical on both sides)",
              choices=("fp16", "bf16", "fp32", "int8")),
        Param("warmup", str, "none", "codec of the warm-up phase (e.g. fp32 or fp16; none: no warm-up): while "
              ":attr:`warming` is set, the full activation is sent with it and cached"),
        Param("store", str, "memory", "memory, or mmap: the cache lives in a memory-mapped file in --dir "
              "(for data sets whose cache does not fit in RAM)", choices=("memory", "mmap")),
        Param("dir", str, "tmp", "directory of the memory-mapped cache files (store=mmap; tmp: a temporary one)"),
    )
    stateful = True
    nested = {"inner": "one", "warmup": "one"}

    def _validate(self) -> None:
        self.inner_codec = self._sub_codec(self.config["inner"], "inner")
        warm = self.config["warmup"]
        self.warmup_codec = self._sub_codec(warm, "warmup") if warm not in ("", "none") else None
        self._int8 = self.cache_dtype == "int8"
        self._dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
                       "int8": torch.float32}[self.cache_dtype]
        self._row_codec = get_codec("int8:tile=64,symmetric=false", impl=self._sub_impl()) if self._int8 else None
        if self.store == "mmap":
            self.cache: _Store = _MmapStore(None if self.config["dir"] in ("", "tmp") else self.config["dir"])
        else:
            self.cache = _MemoryStore()
        self.warming = False   # set on both sides together (e.g. during the first epoch)
        self.use_cache = True  # False: m = 0 and nothing is stored (validation on unseen samples)

    def _sub_impl(self) -> str:
        """``impl`` of the sub-codecs: this codec's (``torch`` runs every reference; a backend's name
        insists on AQ-SGD's own kernels only, the sub-codecs take theirs where they have them)."""
        return self.impl if self.impl in ("auto", "torch") else "auto"

    def _sub_codec(self, text: str, what: str) -> Codec:
        spec = text.replace(";", ",")
        if spec.split(":")[0].strip().lower() == self.name:
            raise CodecError(f"aqsgd: the {what} codec cannot be aqsgd itself")
        c = nested_codec(text, f"aqsgd: {what}", impl=self._sub_impl())
        if c.stateful:
            raise CodecError(f"aqsgd: the {what} codec must be stateless, got {spec!r}")
        return c

    # -- the contract -----------------------------------------------------------------------------
    def _body(self) -> Codec:
        return self.warmup_codec if (self.warming and self.warmup_codec is not None) else self.inner_codec

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Payload size in the current phase (warm-up or deltas)."""
        return self._nbytes(self._body(), shape, dtype)

    def max_payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """The larger payload of the two phases: what a receive buffer must hold."""
        bodies = [self.inner_codec] + ([self.warmup_codec] if self.warmup_codec is not None else [])
        return max(self._nbytes(c, shape, dtype) for c in bodies)

    def _nbytes(self, body: Codec, shape: Sequence[int], dtype: torch.dtype) -> int:
        shape = as_shape(shape)
        check_float_dtype(dtype, self.name)
        if len(shape) < 1:
            raise CodecError("aqsgd needs a leading sample dimension (one sample id per row)")
        return shape[0] * ID_BYTES + body.payload_nbytes(shape, dtype)

    def encode(self, x: torch.Tensor, sample_ids: torch.Tensor | Sequence[int] | None = None,
               update: bool = True) -> torch.Tensor:
        """Encode ``x`` (rows = samples) as ``ids + Q(x - m(ids))``; update the cache unless ``update`` is False.

        In the warm-up phase the body is ``W(x)`` (the warm-up codec) and ``m(ids)`` becomes its decoding.
        """
        check_float_dtype(x.dtype, self.name)
        # one reduction: a finite tensor has a finite sum unless it overflows (then the exact scan decides)
        if x.numel() and not math.isfinite(float(x.sum(dtype=torch.float32))):
            check_finite(x, self.name)
        ids = self._ids(sample_ids, x.shape)
        body = self._body()
        if body is self.inner_codec:
            m = self._lookup(ids, x)
            inner = body.encode(self._delta(x, m))
            new = self._accumulate(m, body.decode(inner, x.shape, x.dtype))
        else:
            inner = body.encode(x)
            new = body.decode(inner, x.shape, x.dtype).to(self._dtype)
        if update and self.use_cache:  # the receiver will compute exactly this from the payload
            self._store(ids, new)
        return torch.cat([to_bytes(ids.to(device=x.device, dtype=torch.int64)), inner])

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
               sample_ids: torch.Tensor | Sequence[int] | None = None, update: bool = True) -> torch.Tensor:
        """Reconstruct ``m(ids) + Q(delta)``; ``sample_ids``, when given, must match the payload's."""
        shape = as_shape(shape)
        self.check_payload(payload, shape, dtype)
        n = shape[0] * ID_BYTES
        ids = from_bytes(payload[:n], torch.int64, shape[0]).cpu()
        if sample_ids is not None:
            want = self._ids(sample_ids, shape)
            if not torch.equal(want, ids):
                raise CodecError(
                    f"aqsgd: the payload carries sample ids {ids.tolist()} but this side expected "
                    f"{want.tolist()}; both sides must walk the data in the same order (same --seed)"
                )
        elif len(set(ids.tolist())) != ids.numel():
            raise CodecError(f"aqsgd: the payload carries repeated sample ids {ids.tolist()}; "
                             "is the other side configured with the same codec?")
        body = self._body()
        decoded = body.decode(payload[n:], shape, dtype)
        if body is self.inner_codec:
            out = self._accumulate(self._lookup(ids, decoded), decoded)
        else:
            out = decoded.to(self._dtype)
        if update and self.use_cache:
            self._store(ids, out)
        res = out.to(dtype)
        if res.numel() and not bool(torch.isfinite(res).all()):
            if not bool(torch.isfinite(out).all()):
                raise CodecError(
                    f"aqsgd: the reconstruction m + delta is not finite in the {self.cache_dtype} cache: a corrupt "
                    "payload, a codec configuration that does not match the sender's, or values beyond the cache "
                    "dtype's range (use cache_dtype=fp32)"
                )
            res = clamp_to_dtype_(out.float(), dtype).to(dtype)  # finite in the cache, beyond the output dtype
        return res

    @dispatch
    def _delta(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """What the inner codec encodes: ``x`` minus the cached rows ``m`` (as ``x``'s dtype). Only read by
        the inner encode: a kernel may return a work buffer that it overwrites on the next call."""
        return x - m.to(x.dtype)

    @dispatch
    def _accumulate(self, m: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """The new cache rows: ``m`` plus the decoded delta ``d`` (as the cache dtype). ``m`` is a fresh
        stack of cache rows owned by the caller; a kernel may write the result into it."""
        return m + d.to(m.dtype)

    def decode_ids(self, payload: torch.Tensor, rows: int) -> torch.Tensor:
        """The sample ids at the start of a payload."""
        return from_bytes(payload[: rows * ID_BYTES], torch.int64, rows).cpu()

    # -- the cache ------------------------------------------------------------------------------
    def cache_nbytes(self) -> int:
        """Bytes held by this side's cache."""
        return self.cache.nbytes()

    def per_sample_nbytes(self, shape: Sequence[int]) -> int:
        """Cache bytes one sample costs on one side of one boundary, for an activation of ``shape``."""
        shape = as_shape(shape)
        if self._int8:
            assert self._row_codec is not None
            return self._row_codec.payload_nbytes((1, *shape[1:]), torch.float32)
        return numel(shape[1:]) * torch.empty((), dtype=self._dtype).element_size()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The cache as two tensors (ids and stacked rows), for checkpoints."""
        return self.cache.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load what :meth:`state_dict` gave (fp16/bf16/fp32 rows load into any of those cache dtypes)."""
        if not isinstance(state, dict) or "ids" not in state or (len(state["ids"]) and "rows" not in state):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CodecError(f"aqsgd: a cache state is {{'ids': ..., 'rows': ...}} (what state_dict() gives), got "
                             f"{got}")
        rows = state.get("rows")
        if rows is not None and len(rows) and (rows.dtype == torch.uint8) != self._int8:
            had = "int8 (payloads)" if rows.dtype == torch.uint8 else str(rows.dtype).replace("torch.", "")
            raise CodecError(f"aqsgd: the state's cached rows are {had}, this codec's cache_dtype is "
                             f"{self.cache_dtype}: load it into an aqsgd with the cache_dtype that saved it")
        if rows is not None and not self._int8:
            state = {**state, "rows": rows.to(self._dtype)}
        self.cache.load_state_dict(state)

    def _ids(self, sample_ids: torch.Tensor | Sequence[int] | None, shape: Sequence[int]) -> torch.Tensor:
        if sample_ids is None:
            raise CodecError("aqsgd is stateful: pass sample_ids (one id per row of the leading dimension)")
        if not shape:
            raise CodecError("aqsgd: a 0-d tensor has no rows; give a tensor whose leading dimension is the "
                             "samples, one sample id per row")
        try:
            ids = torch.as_tensor(sample_ids, dtype=torch.int64).reshape(-1).cpu()
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise CodecError(f"aqsgd: sample ids must be integers that fit in int64 ({e})") from None
        if ids.numel() != shape[0]:
            hint = ("; in a pipeline schedule's step(), pass them as a tensor (the schedule splits tensors into "
                    "micro-batches, not lists)" if ids.numel() > shape[0] and ids.numel() % shape[0] == 0 else "")
            raise CodecError(f"aqsgd: {ids.numel()} sample ids for a tensor with {shape[0]} rows{hint}")
        if len(set(ids.tolist())) != ids.numel():
            raise CodecError(f"aqsgd: sample ids in one call must be distinct, got {ids.tolist()}")
        return ids

    def _lookup(self, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        rows = []
        for i in ids.tolist():
            m = self.cache.get(i) if self.use_cache else None
            if m is not None and not self._fits(m, like.shape[1:]):
                was = "another shape" if self._int8 else f"shape {tuple(m.shape)}"
                raise CodecError(f"aqsgd: sample {i} is cached with a row of {was}, this call's rows are "
                                 f"{tuple(like.shape[1:])}: a sample's activation must keep its shape from epoch "
                                 "to epoch (the same sequence length and width)")
            if m is not None and self._int8:
                assert self._row_codec is not None
                m = self._row_codec.decode(m, (1, *like.shape[1:]), torch.float32)[0]
            rows.append(m.to(like.device, self._dtype, non_blocking=True) if m is not None else
                        torch.zeros(like.shape[1:], dtype=self._dtype, device=like.device))
        return torch.stack(rows) if rows else torch.zeros(like.shape, dtype=self._dtype, device=like.device)

    def _fits(self, m: torch.Tensor, row_shape: Sequence[int]) -> bool:
        """Whether the cached row ``m`` (an int8 cache's: a payload) is one of ``row_shape``."""
        if self._int8:
            assert self._row_codec is not None
            return m.numel() == self._row_codec.payload_nbytes((1, *row_shape), torch.float32)
        return tuple(m.shape) == tuple(row_shape)

    def _store(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        for i, v in zip(ids.tolist(), values.detach().to(self._dtype)):
            if self._int8:
                assert self._row_codec is not None
                v = self._row_codec.encode(v.float().unsqueeze(0).cpu())
            self.cache.put(i, v)


class _Store:
    """Sample id -> cached row."""

    def get(self, i: int) -> torch.Tensor | None:
        raise NotImplementedError

    def put(self, i: int, v: torch.Tensor) -> None:
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError

    def keys(self) -> list[int]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.keys())

    def __iter__(self) -> Iterator[int]:
        return iter(self.keys())

    def __getitem__(self, i: int) -> torch.Tensor:
        v = self.get(i)
        if v is None:
            raise KeyError(i)
        return v

    def state_dict(self) -> dict[str, torch.Tensor]:
        keys = sorted(self.keys())
        if not keys:
            return {"ids": torch.zeros(0, dtype=torch.int64)}
        return {"ids": torch.tensor(keys, dtype=torch.int64), "rows": torch.stack([self[k] for k in keys]).cpu()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, row in zip(state["ids"].tolist(), state.get("rows", [])):
            self.put(int(i), row)


class _MemoryStore(_Store):
    """Rows in host memory, whatever the activation's device (the cache grows with the data set, and
    accelerator memory is for the model): rows of a CUDA activation go to pinned host buffers with
    asynchronous copies, ordered on the current stream with the copies that read them back."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}
        self._pinned: set[int] = set()  # the rows in pinned buffers (a checkpoint's rows load pageable)
        self._pending = False  # asynchronous device-to-host copies may still be running

    def get(self, i: int) -> torch.Tensor | None:
        return self.rows.get(i)

    def put(self, i: int, v: torch.Tensor) -> None:
        v = v.detach()
        if v.device.type == "cpu":
            self.rows[i] = v.clone()
            self._pinned.discard(i)
            return
        row = self.rows.get(i)
        if row is None or row.shape != v.shape or row.dtype != v.dtype or i not in self._pinned:
            row = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)  # (a non-blocking copy into pageable
            self.rows[i] = row                                           # memory would block the host)
            self._pinned.add(i)
        row.copy_(v, non_blocking=True)
        self._pending = True

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self._pending and torch.cuda.is_available():
            torch.cuda.synchronize()  # the host rows are complete before they are read on the host
            self._pending = False
        return super().state_dict()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rows.values())

    def keys(self) -> list[int]:
        return list(self.rows)


class _MmapStore(_Store):
    """Rows in one memory-mapped file (grown by doubling), so the OS pages the cache in and out."""

    def __init__(self, directory: str | None) -> None:
        self._tmp = None
        if directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="qwire-aqsgd-")
            directory = self._tmp.name
        try:
            os.makedirs(directory, exist_ok=True)
            fd, self.path = tempfile.mkstemp(prefix="aqsgd-cache-", suffix=".bin", dir=directory)
        except OSError as e:
            raise CodecError(f"aqsgd: store=mmap cannot keep its cache file in dir={directory} "
                             f"({e.strerror or e}); give a writable directory") from None
        os.close(fd)
        self.index: dict[int, int] = {}
        self.buf: torch.Tensor | None = None
        self.row_shape: tuple[int, ...] = ()
        self.dtype: torch.dtype | None = None
        self._finalizer = weakref.finalize(self, _remove, self.path, self._tmp)

    def _grow(self, capacity: int) -> None:
        assert self.dtype is not None
        row = numel(self.row_shape)
        old = self.buf
        size = capacity * row
        with open(self.path, "r+b") as f:
            f.truncate(size * torch.empty((), dtype=self.dtype).element_size())
        new = torch.from_file(self.path, shared=True, size=size, dtype=self.dtype).view(capacity, *self.row_shape)
        if old is not None:
            new[: old.shape[0]].copy_(old)
        self.buf = new

    def get(self, i: int) -> torch.Tensor | None:
        k = self.index.get(i)
        return None if k is None or self.buf is None else self.buf[k].clone()

    def put(self, i: int, v: torch.Tensor) -> None:
        v = v.detach().cpu()
        if self.buf is None:
            self.row_shape, self.dtype = tuple(v.shape), v.dtype
            self._grow(64)
        elif tuple(v.shape) != self.row_shape or v.dtype != self.dtype:
            raise CodecError(f"aqsgd: cached rows are {self.dtype} {self.row_shape}, got {v.dtype} {tuple(v.shape)}")
        k = self.index.get(i)
        if k is None:
            k = len(self.index)
            assert self.buf is not None
            if k >= self.buf.shape[0]:
                self._grow(2 * self.buf.shape[0])
            self.index[i] = k
        assert self.buf is not None
        self.buf[k].copy_(v)

    def nbytes(self) -> int:
        """Bytes of cached rows (held in the file, paged in by the OS as needed)."""
        if self.buf is None:
            return 0
        return len(self.index) * self.buf[0].numel() * self.buf.element_size()

    def keys(self) -> list[int]:
        return list(self.index)


def _remove(path: str, tmp: Any) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
    if tmp is not None:
        tmp.cleanup()


register("aqsgd", AQSGD)
