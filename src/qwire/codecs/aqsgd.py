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

from collections.abc import Sequence

import torch

from .base import Codec, CodecError, Param, as_shape, check_finite, check_float_dtype, numel
from .registry import get_codec, register
from .wire import from_bytes, to_bytes

ID_BYTES = 8


class AQSGD(Codec):
    name = "aqsgd"
    params = (
        Param("inner", str, "int4", "spec of the codec for the deltas (its options joined with ';')"),
        Param("cache_dtype", str, "fp16", "dtype of the cached activations", choices=("fp16", "bf16", "fp32")),
    )
    stateful = True

    def _validate(self) -> None:
        spec = self.config["inner"].replace(";", ",")
        if spec.split(":")[0].strip().lower() == self.name:
            raise CodecError("aqsgd: the inner codec cannot be aqsgd itself")
        self.inner_codec = get_codec(spec)
        if self.inner_codec.stateful:
            raise CodecError(f"aqsgd: the inner codec must be stateless, got {spec!r}")
        self._dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[self.cache_dtype]
        self.cache: dict[int, torch.Tensor] = {}

    # -- the contract -----------------------------------------------------------------------------
    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        shape = as_shape(shape)
        check_float_dtype(dtype, self.name)
        if len(shape) < 1:
            raise CodecError("aqsgd needs a leading sample dimension (one sample id per row)")
        return shape[0] * ID_BYTES + self.inner_codec.payload_nbytes(shape, dtype)

    def encode(self, x: torch.Tensor, sample_ids: torch.Tensor | Sequence[int] | None = None,
               update: bool = True) -> torch.Tensor:
        """Encode ``x`` (rows = samples) as ``ids + Q(x - m(ids))``; update the cache unless ``update`` is False."""
        check_float_dtype(x.dtype, self.name)
        check_finite(x, self.name)
        ids = self._ids(sample_ids, x.shape)
        delta = x - self._lookup(ids, x).to(x.dtype)
        inner = self.inner_codec.encode(delta)
        if update:  # the receiver will compute exactly this from the payload
            self._store(ids, self._lookup(ids, x) + self.inner_codec.decode(inner, x.shape, x.dtype).to(self._dtype))
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
        delta = self.inner_codec.decode(payload[n:], shape, dtype)
        out = self._lookup(ids, delta) + delta.to(self._dtype)
        if update:
            self._store(ids, out)
        return out.to(dtype)

    def decode_ids(self, payload: torch.Tensor, rows: int) -> torch.Tensor:
        """The sample ids at the start of a payload."""
        return from_bytes(payload[: rows * ID_BYTES], torch.int64, rows).cpu()

    # -- the cache ------------------------------------------------------------------------------
    def cache_nbytes(self) -> int:
        """Bytes held by this side's cache."""
        return sum(t.numel() * t.element_size() for t in self.cache.values())

    def per_sample_nbytes(self, shape: Sequence[int]) -> int:
        """Cache bytes one sample costs on one side of one boundary, for an activation of ``shape``."""
        shape = as_shape(shape)
        return numel(shape[1:]) * torch.empty((), dtype=self._dtype).element_size()

    def _ids(self, sample_ids: torch.Tensor | Sequence[int] | None, shape: Sequence[int]) -> torch.Tensor:
        if sample_ids is None:
            raise CodecError("aqsgd is stateful: pass sample_ids (one id per row of the leading dimension)")
        ids = torch.as_tensor(sample_ids, dtype=torch.int64).reshape(-1).cpu()
        if ids.numel() != shape[0]:
            raise CodecError(f"aqsgd: {ids.numel()} sample ids for a tensor with {shape[0]} rows")
        if len(set(ids.tolist())) != ids.numel():
            raise CodecError(f"aqsgd: sample ids in one call must be distinct, got {ids.tolist()}")
        return ids

    def _lookup(self, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        rows = []
        for i in ids.tolist():
            m = self.cache.get(i)
            rows.append(m.to(like.device) if m is not None else
                        torch.zeros(like.shape[1:], dtype=self._dtype, device=like.device))
        return torch.stack(rows) if rows else torch.zeros(like.shape, dtype=self._dtype, device=like.device)

    def _store(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        for i, v in zip(ids.tolist(), values.to(self._dtype)):
            self.cache[i] = v.detach().clone()


register("aqsgd", AQSGD)
