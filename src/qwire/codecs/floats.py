"""Float casts: ``fp32``, ``fp16``, ``bf16``.

Policy: NaN and Inf pass through faithfully. A finite value that does not fit
the target format (|x| > 65504 for fp16) is an error, not a silent Inf.
Decoding into a narrower dtype than the wire's (``bf16`` of an fp16 tensor,
``fp32`` of an fp16 or bf16 one) clamps finite values to the output's finite
range: an fp16 value of 65472 sent as bf16 (which rounds it to 65536) decodes
to 65504, not Inf. ``fp32`` of an fp32 tensor is lossless.

A CPU fast path (qwire/codecs/kernels/cpu/floats.py) fuses the conversions that are not a plain
view or copy (e.g. fp32 -> fp16 with its overflow check: one pass instead of five); its payloads and
decoded values are these, bit for bit (NaNs stay NaNs; their bit patterns may differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from .base import Codec, CodecError, as_shape, check_float_dtype, numel
from .kernels import dispatch
from .kernels.deferred import judge
from .registry import register
from .wire import from_bytes, to_bytes


class FloatCast(Codec):
    wire_dtype: ClassVar[torch.dtype]

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        check_float_dtype(dtype, self.name)
        return numel(as_shape(shape)) * self.wire_dtype.itemsize

    @dispatch
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        check_float_dtype(x.dtype, self.name)
        y = x.to(self.wire_dtype)
        if self.wire_dtype == torch.float16 and x.dtype != torch.float16 and x.numel():
            # the largest finite value that became Inf (0 where none did), read now or, in a pipeline stage on
            # a GPU, with the chunk's other checks (no host sync here)
            big = torch.where(torch.isinf(y) & torch.isfinite(x), x.abs(), 0).amax().float().reshape(1)
            judge(big, _fp16_overflow)
        return to_bytes(y)

    @dispatch
    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        shape = as_shape(shape)
        self.check_payload(payload, shape, dtype)
        v = from_bytes(payload, self.wire_dtype, numel(shape))
        y = v.to(dtype)
        if torch.finfo(self.wire_dtype).max > torch.finfo(dtype).max and y.numel():
            over = torch.isinf(y) & torch.isfinite(v)  # finite on the wire, beyond the output's range
            if bool(over.any()):
                m = torch.finfo(dtype).max
                y = torch.where(over, v.float().clamp(-m, m).to(dtype), y)
        return y.reshape(shape)


def _fp16_overflow(v: list) -> None:
    if v[0] > 0:
        raise CodecError(f"codec 'fp16': a finite value of magnitude {v[0]:.3g} exceeds fp16's range (65504) and "
                         "would become Inf; use 'bf16' or 'fp32' for this tensor")


class FP32(FloatCast):
    name = "fp32"
    wire_dtype = torch.float32
    lossless = True


class FP16(FloatCast):
    name = "fp16"
    wire_dtype = torch.float16


class BF16(FloatCast):
    name = "bf16"
    wire_dtype = torch.bfloat16


register("fp32", FP32)
register("fp16", FP16)
register("bf16", BF16)
