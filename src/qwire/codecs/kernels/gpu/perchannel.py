"""Triton kernels of ``perchannel<b>`` (:mod:`qwire.codecs.perchannel`), nearest rounding.

The per-channel absmax over all rows is one torch reduction on the device (it reads the input once, with
no temporary). One small kernel then makes the steps as the reference does (an IEEE division, fp16 rounded up
or fp32), writes the stored ones straight into the payload and reduces the two values the input's check reads
(the reference makes a dozen torch operations of it on the channels); then the symmetric quantize + pack and
unpack + dequantize kernels of ``int<b>`` (:mod:`.direct`) with one step per channel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..deferred import check_decoded_later, judge
from ._common import cdiv, contiguous_input, inverse, launch, program_start, register, scan_beyond
from ._read import field, field_view
from .direct import into, quant_pack, store, unpack_dequant

STEP_ELEMS = 1024  # channels per program of _steps


@triton.jit
def _steps(AMAX, n, H, STORED, STEPS, INV, STATS, FP16: tl.constexpr, BLOCK: tl.constexpr, I64: tl.constexpr):
    """Per channel the step ``amax / H`` (IEEE division); with ``FP16`` rounded to fp16 toward +inf (to nearest,
    then one fp16 up where that fell below the quotient: :func:`~qwire.codecs.layouts.round_fp16`) into
    ``STORED``, the stored steps as fp32 into ``STEPS``; the largest absmax and the largest quotient into
    ``STATS`` (int32, zeroed) by atomic maxima on their bits (nonnegative values order as their bits, NaN above
    Inf)."""
    i = program_start(BLOCK, I64) + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(AMAX + i, mask=m, other=0.0)
    need = tl.div_rn(a, tl.full(a.shape, H, tl.float32))
    if FP16:
        h = need.to(tl.float16)
        up = (h.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)  # the next fp16 above h >= 0
        h = tl.where(h.to(tl.float32) < need, up, h)
        tl.store(STORED + i, h, mask=m)
        s = h.to(tl.float32)
        tl.store(STEPS + i, s, mask=m)
    else:
        s = need
        tl.store(STEPS + i, s, mask=m)
    tl.store(INV + i, inverse(s), mask=m)  # the quantize's 1/s, made once per channel instead of once per value
    # |a|'s and |need|'s bits, a NaN's sign cleared too (abs may keep it: a negative int32 would lose the maximum)
    ab = tl.where(m, a, 0.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    nb = tl.where(m, need, 0.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(STATS, tl.max(ab, axis=0), sem="relaxed")
    tl.atomic_max(STATS + 1, tl.max(nb, axis=0), sem="relaxed")


def encode(codec, x: torch.Tensor) -> torch.Tensor:
    g, sec, payload = codec._begin_encode(x)
    if not g.numel:
        return payload
    X = contiguous_input(x)
    # one reduction over the input (abs().amax() wrote |x| in full first); NaN propagates: the checks refuse it
    amax = torch.linalg.vector_norm(X.view(g.rows, g.cols), math.inf, dim=0).float()
    fp16 = codec.layout != "fp32"
    stored = field_view(sec, payload, "scale", g.cols)
    direct = stored is not None
    if not direct:
        stored = torch.empty(g.cols, dtype=torch.float16 if fp16 else torch.float32, device=X.device)
    steps = torch.empty(g.cols, device=X.device) if fp16 else stored
    inv = torch.empty(g.cols, device=X.device)
    stats = torch.zeros(2, dtype=torch.int32, device=X.device)
    launch(_steps, (cdiv(g.cols, STEP_ELEMS),), amax, g.cols, float(codec.levels // 2), stored, steps, inv, stats,
           FP16=fp16, BLOCK=STEP_ELEMS)
    judge(stats.view(torch.float32), codec.steps_verdict(x))
    if not direct:
        sec.put(payload, "scale", 0, stored)
    quant_pack(X, g, None, steps, payload, sec.offsets["codes"], codec.bits, codec.levels, True, per_channel=True,
               inv_steps=inv)
    return payload


def decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    g, sec, out = codec._begin_decode(payload, shape, dtype)
    if not g.numel:
        return out
    s = field(sec, payload, "scale", g.cols).float()
    vals = unpack_dequant(payload, sec.offsets["codes"], g, None, s, codec.bits, codec.levels, True,
                          per_channel=True, into=into(out))
    check_decoded_later(vals, torch.linalg.vector_norm(s, math.inf), codec.name, scale=codec.levels,
                        scan=scan_beyond)
    store(out, vals)
    return out


register("PerChannel", supports=lambda c: c.rounding == "nearest", encode=encode, decode=decode)
