"""Payload sections: the byte layout the tile codecs write.

A payload is a fixed sequence of sections (:class:`Field`), each either a run of
fp16/fp32 values or of bit-packed unsigned codes, in row-major order. Encoders
fill them chunk by chunk (chunks of whole rows, sized to stay in cache); the
format does not depend on the chunking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .packing import pack_bits_into, packed_nbytes, unpack_bits
from .wire import from_bytes, to_bytes


@dataclass(frozen=True)
class Field:
    """One payload section: ``count`` values, bit-packed with ``bits`` or raw ``dtype``."""

    name: str
    count: int
    bits: int = 0
    dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        if self.dtype is not None:
            return self.count * self.dtype.itemsize
        return packed_nbytes(self.count, self.bits)


class Sections:
    """Byte offsets of consecutive :class:`Field` s, and chunk-wise put/get of their values."""

    def __init__(self, fields: Sequence[Field]) -> None:
        self.fields: dict[str, Field] = {}
        self.offsets: dict[str, int] = {}
        off = 0
        for f in fields:
            if f.name in self.fields:
                raise RuntimeError(f"duplicate payload field {f.name!r}")
            self.fields[f.name] = f
            self.offsets[f.name] = off
            off += f.nbytes
        self.nbytes = off

    def __contains__(self, name: str) -> bool:
        return name in self.fields and self.fields[name].count > 0

    def _start(self, f: Field, start: int) -> int:
        if f.dtype is not None:
            return self.offsets[f.name] + start * f.dtype.itemsize
        bit = start * f.bits
        if bit % 8:
            raise RuntimeError(f"field {f.name!r}: chunk start {start} is not byte aligned")
        return self.offsets[f.name] + bit // 8

    def put(self, payload: torch.Tensor, name: str, start: int, values: torch.Tensor) -> None:
        f = self.fields[name]
        o = self._start(f, start)
        if (values.dtype == (f.dtype or torch.uint8) and (f.dtype is not None or f.bits == 8)
                and values.device == payload.device and values.is_contiguous() and payload.is_contiguous()
                and values.data_ptr() == payload.data_ptr() + o):
            return  # written in place already (a GPU fit writes 8-bit codes and anchors into their fields)
        if f.dtype is None:  # packed straight into the payload where the device has a kernel for it
            pack_bits_into(values, f.bits, payload[o: o + packed_nbytes(values.numel(), f.bits)])
            return
        b = to_bytes(values.to(f.dtype))
        payload[o: o + b.numel()] = b

    def get(self, payload: torch.Tensor, name: str, start: int, n: int) -> torch.Tensor:
        f = self.fields[name]
        o = self._start(f, start)
        if f.dtype is not None:
            return from_bytes(payload[o:], f.dtype, n)
        return unpack_bits(payload[o: o + packed_nbytes(n, f.bits)], f.bits, n)
