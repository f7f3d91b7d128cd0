"""Triton kernels of ``perchannel<b>`` (:mod:`qwire.codecs.perchannel`), nearest rounding.

The per-channel absmax over all rows is one torch reduction on the device (it reads the input once, with
no temporary); the steps are the reference's (fp16 rounded up, or fp32); then the symmetric quantize + pack and unpack +
dequantize kernels of ``int<b>`` (:mod:`.direct`) with one step per channel.
"""

from __future__ import annotations

import math

import torch

from .. import register_kernels
from ..deferred import check_decoded_later
from ._common import contiguous_input, scan_beyond
from .direct import into, quant_pack, store, unpack_dequant


def encode(codec, x: torch.Tensor) -> torch.Tensor:
    g, sec, payload = codec._begin_encode(x)
    if not g.numel:
        return payload
    X = contiguous_input(x)
    # one reduction over the input (abs().amax() wrote |x| in full first); NaN propagates: the checks refuse it
    amax = torch.linalg.vector_norm(X.view(g.rows, g.cols), math.inf, dim=0).float()
    steps = codec._steps_of(x, amax, later=True)
    sec.put(payload, "scale", 0, steps)
    quant_pack(X, g, None, steps.float(), payload, sec.offsets["codes"], codec.bits, codec.levels, True,
               per_channel=True)
    return payload


def decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    g, sec, out = codec._begin_decode(payload, shape, dtype)
    if not g.numel:
        return out
    s = sec.get(payload, "scale", 0, g.cols).float()
    vals = unpack_dequant(payload, sec.offsets["codes"], g, None, s, codec.bits, codec.levels, True,
                          per_channel=True, into=into(out))
    check_decoded_later(vals, torch.linalg.vector_norm(s, math.inf), codec.name, scale=codec.levels,
                        scan=scan_beyond)
    store(out, vals)
    return out


register_kernels("triton", "PerChannel", supports=lambda c: c.rounding == "nearest", encode=encode, decode=decode)
