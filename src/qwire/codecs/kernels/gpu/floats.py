"""The float casts ``fp16``/``bf16``/``fp32`` (:mod:`qwire.codecs.floats`) on a GPU.

* Encode to ``fp16`` from fp32 or bf16: one Triton kernel casts each value (to nearest, ties to even, as torch's
  cast) and takes the largest magnitude of the finite values that became Inf by an atomic maximum, which the
  reference's overflow check then judges (now, or with a pipeline stage's deferred checks). The reference makes
  ten torch operations of it, each a pass over the tensor (``isinf(y) & isfinite(x)``, ``abs``, ``where``,
  ``amax``).
* Decode into a dtype whose range holds the wire's (``fp16`` into fp32 or bf16, ``bf16`` into fp32): the payload's
  bytes are read in place and cast once; the reference first copies them (an aligned buffer).

Every other cast is one torch operation already (or none: a view of the tensor's bytes) and runs the reference.
Payloads and decoded values are the reference's, bit for bit, NaN bit patterns aside.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...base import as_shape, check_float_dtype, numel
from ...floats import _fp16_overflow
from ...kernels.deferred import judge
from ._common import cdiv, launch, program_start, register

CAST_ELEMS = 4096  # values per program of the cast


@triton.jit
def _to_fp16(X, Y, BIG, n, BLOCK: tl.constexpr, I64: tl.constexpr):
    """``Y = X`` as fp16; the largest ``|x|`` of finite values that became Inf, as an atomic maximum on its bits
    into ``BIG`` (int32, zeroed; nonnegative fp32 values order as their bits do), taken only where one did."""
    i = program_start(BLOCK, I64) + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(X + i, mask=m, other=0.0).to(tl.float32)
    y = x.to(tl.float16)
    tl.store(Y + i, y, mask=m)
    a = tl.abs(x)
    over = (tl.abs(y.to(tl.float32)) == float("inf")) & (a < float("inf"))
    big = tl.max(tl.where(over, a, 0.0), axis=0)
    if big > 0.0:
        tl.atomic_max(BIG, big.to(tl.int32, bitcast=True), sem="relaxed")


def encode(codec, x: torch.Tensor) -> torch.Tensor:
    check_float_dtype(x.dtype, codec.name)
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.numel():
        return type(codec).encode.reference(codec, x)
    X = x.detach().reshape(-1).contiguous()
    n = X.numel()
    out = torch.empty(n, dtype=torch.float16, device=X.device)
    big = torch.zeros(1, dtype=torch.int32, device=X.device)
    launch(_to_fp16, (cdiv(n, CAST_ELEMS),), X, out, big, n, BLOCK=CAST_ELEMS)
    judge(big.view(torch.float32), _fp16_overflow)
    return out.view(torch.uint8)


def decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    shape = as_shape(shape)
    check_float_dtype(dtype, codec.name)
    w = codec.wire_dtype
    if (dtype == w  # the reference's copy is the decoded tensor: a view would share the payload's memory
            or torch.finfo(dtype).max < torch.finfo(w).max  # the reference clamps what does not fit
            or payload.dtype != torch.uint8 or payload.dim() != 1 or payload.data_ptr() % w.itemsize):
        return type(codec).decode.reference(codec, payload, shape, dtype)
    codec.check_payload(payload, shape, dtype)
    return payload[: numel(shape) * w.itemsize].view(w).to(dtype).reshape(shape)


encode.graphs = decode.graphs = False  # one kernel or none: a CUDA graph would only add its copies in and out
register("FP16", encode=encode, decode=decode)
for _name in ("BF16", "FP32"):  # their encodes are one torch operation or none: the reference, named as such
    register(_name, decode=decode)
