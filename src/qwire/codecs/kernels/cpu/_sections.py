"""Payload sections read and written with the compiled bit packers.

:class:`FastSections` is a :class:`~qwire.codecs.sections.Sections` whose ``put``/``get`` of bit-packed
fields run :func:`._fastpack.pack`/``unpack`` instead of the vectorized torch packing (the same
bytes: the format of :mod:`qwire.codecs.packing`); on small tensors the per-field torch operations
otherwise cost more than the kernels themselves. Raw fp16/fp32 fields are the reference's code.
"""

from __future__ import annotations

import numpy as np
import torch

from ...packing import packed_nbytes
from ...sections import Sections
from ._fastpack import pack, unpack


class FastSections(Sections):
    @classmethod
    def of(cls, sec: Sections) -> FastSections:
        obj = cls.__new__(cls)
        obj.__dict__.update(sec.__dict__)
        return obj

    def put(self, payload: torch.Tensor, name: str, start: int, values: torch.Tensor) -> None:
        f = self.fields[name]
        if f.dtype is not None or payload.device.type != "cpu":
            return super().put(payload, name, start, values)
        codes = torch.empty(values.numel(), dtype=torch.uint8)  # a fresh, aligned buffer
        codes.copy_(values.reshape(-1))
        pack(payload.numpy(), self._start(f, start), codes.numpy(), f.bits)

    def get(self, payload: torch.Tensor, name: str, start: int, n: int) -> torch.Tensor:
        f = self.fields[name]
        if f.dtype is not None or payload.device.type != "cpu":
            return super().get(payload, name, start, n)
        o = self._start(f, start)
        if payload.numel() < o + packed_nbytes(n, f.bits):
            return super().get(payload, name, start, n)  # the reference's error
        codes = np.empty(n, dtype=np.uint8)
        unpack(payload.numpy(), o, codes, f.bits)
        return torch.from_numpy(codes)
