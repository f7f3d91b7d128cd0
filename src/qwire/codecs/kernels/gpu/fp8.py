"""Triton kernels of ``fp8`` (TACO's dual-scale Hadamard FP8) and ``fp8plain`` (:mod:`qwire.codecs.fp8`).

One program holds whole groups (``G`` = 32..512 elements) in registers: encode computes the group's
scales, the Hadamard butterfly (the reference's order of fp32 additions), and the FP8 codes in one pass
over the input; decode reads each code once and casts it. The per-group scales
travel through small side tensors that torch places in the payload.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...base import as_shape, check_float_dtype, nonfinite, numel
from ...fp8 import ALPHA_MAX, ALPHA_MIN, LAMBDA, S_MAX, S_MIN, bound_scale
from ...hadamard import normalization
from ...wire import from_bytes, split_sections, to_bytes
from ..deferred import check_decoded_later, judge
from ._common import (
    cdiv,
    contiguous_input,
    from_fp8_bits,
    launch,
    program_start,
    register,
    scan_beyond,
    soft_fp8,
    to_fp8_bits,
)

# Elements per program (whole groups), in one warp: the butterfly's exchanges between a group's elements then
# stay within the warp (shuffles), where with four warps and 2048 elements they went through shared memory
# with a barrier each. Compiled for sm_90a at G = 128 (python scripts/compile_for_gpu.py --specs fp8 --sass;
# docs/kernels.md): encode 68 instructions per element instead of 89, 4 barriers instead of 22. Not timed.
GROUP_ELEMS = 1024
WARPS = 1
TINY = float(torch.finfo(torch.float32).tiny)


@triton.jit
def butterfly(y, BG: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr):
    """The unnormalized Hadamard transform of each row of ``y`` ``(BG, G)``: stage ``h = 1, 2, 4, ..``
    replaces each pair ``(a, b)`` at distance ``h`` by ``(a + b, a - b)``, as the reference does."""
    for st in tl.static_range(LOG2G):
        y = tl.reshape(y, (BG, G // (2 << st), 2, 1 << st))
        a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        y = tl.reshape(y, (BG, G))
    return y


@triton.jit
def _encode(X, n, ng, P, ALPHA, S, SCR, BAD, FMAX, NORM, TACO: tl.constexpr, HADAMARD: tl.constexpr,
            LAMBDA: tl.constexpr, ALPHA_MIN: tl.constexpr, ALPHA_MAX: tl.constexpr, S_MIN: tl.constexpr,
            S_MAX: tl.constexpr, TINY: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
            SUBSCALE: tl.constexpr, BG: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr, I64: tl.constexpr,
            SOFT_FP8: tl.constexpr):
    grp = program_start(BG, I64) + tl.arange(0, BG)
    i = grp[:, None] * G + tl.arange(0, G)[None, :]
    x = tl.load(X + i, mask=i < n, other=0.0).to(tl.float32)
    gm = grp < ng
    if TACO:
        xd = x.to(tl.float64)
        sq = tl.sum(xd * xd, axis=1)
        # NaN or Inf where a group holds NaN or Inf (fp64 squares of finite fp32 values cannot overflow)
        bad = sq - sq
        tl.atomic_max(BAD, tl.max(tl.where(gm & (bad != bad), 1, 0), axis=0), sem="relaxed")
        # each group's scalars once, by one thread (a thread holds a few values of every group of the program):
        # through memory (SCR, a value per group) into a layout of a group per thread, and back
        gc = program_start(BG, I64) + tl.arange(0, BG)
        gcm = gc < ng
        tl.store(SCR + grp, sq, mask=gm)
        tl.debug_barrier()
        sqc = tl.load(SCR + gc, mask=gcm, other=0.0)
        alpha = FMAX / tl.sqrt(sqc / G + LAMBDA)  # fp64: division and square root are IEEE (no fast variants)
        alpha = tl.minimum(tl.maximum(alpha, ALPHA_MIN), ALPHA_MAX).to(tl.float32)
        tl.store(ALPHA + gc, alpha, mask=gcm)
        tl.debug_barrier()
        y = x * tl.load(ALPHA + grp, mask=gm, other=0.0)[:, None]
        if HADAMARD:
            y = butterfly(y, BG, G, LOG2G) * NORM
        amax = tl.max(tl.abs(y), axis=1)
        tl.store(SCR + grp, amax.to(tl.float64), mask=gm)
        tl.debug_barrier()
        amc = tl.load(SCR + gc, mask=gcm, other=0.0).to(tl.float32)
        tl.debug_barrier()  # every group's amax read before 1/s overwrites it
        sc = tl.minimum(tl.maximum(tl.div_rn(amc, tl.full(amc.shape, FMAX, tl.float32)), S_MIN), S_MAX)
        tl.store(S + gc, sc, mask=gcm)
        tl.store(SCR + gc, tl.div_rn(tl.full(sc.shape, 1.0, tl.float32), sc).to(tl.float64), mask=gcm)
        tl.debug_barrier()
        v = y * tl.load(SCR + grp, mask=gm, other=0.0).to(tl.float32)[:, None]
    else:
        bad = tl.sum(x * 0.0, axis=1)  # NaN where a group holds NaN or Inf
        tl.atomic_max(BAD, tl.max(tl.where(gm & (bad != bad), 1, 0), axis=0), sem="relaxed")
        amax = tl.max(tl.abs(x), axis=1)
        s = tl.maximum(tl.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32)), TINY)
        v = tl.div_rn(x, s[:, None] + tl.zeros_like(x))
        tl.store(S + grp, s, mask=gm)
    code = to_fp8_bits(v, FMAX, MBITS, BIAS, SUBSCALE, SOFT_FP8)
    cm = (grp[:, None] < ng) if (TACO and HADAMARD) else (i < n)  # the rotated padding is sent
    tl.store(P + i, code, mask=cm)


@triton.jit
def _decode(P, n, ncodes, ng, ALPHA, S, SCR, OUT, SMAX, CLAMP, NORM, TACO: tl.constexpr, HADAMARD: tl.constexpr,
            MBITS: tl.constexpr, BIAS: tl.constexpr, BG: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr,
            I64: tl.constexpr, SOFT_FP8: tl.constexpr):
    """Values of groups ``grp`` into ``OUT`` (the output's dtype: clamped to +-``CLAMP`` first, its largest
    finite value, as :func:`~qwire.codecs.base.clamp_to_dtype_`), and the largest ``|scale|`` (NaN as inf)
    as an atomic maximum into ``SMAX``."""
    grp = program_start(BG, I64) + tl.arange(0, BG)
    i = grp[:, None] * G + tl.arange(0, G)[None, :]
    gm = grp < ng
    q = tl.load(P + i, mask=i < ncodes, other=0)
    y = from_fp8_bits(q, MBITS, BIAS, SOFT_FP8)
    if TACO:
        if HADAMARD:
            y = butterfly(y, BG, G, LOG2G) * NORM
        # each group's scale once, by one thread (as the encode's scalars), through SCR
        gc = program_start(BG, I64) + tl.arange(0, BG)
        gcm = gc < ng
        sc = tl.div_rn(tl.load(S + gc, mask=gcm, other=0.0), tl.load(ALPHA + gc, mask=gcm, other=1.0))
        _scale_max(SMAX, sc, gcm)
        tl.store(SCR + gc, sc, mask=gcm)
        tl.debug_barrier()
        s = tl.load(SCR + grp, mask=gm, other=0.0)
    else:
        s = tl.load(S + grp, mask=gm, other=0.0)
        _scale_max(SMAX, s, gm)
    v = y * s[:, None]
    # clamped, a NaN kept NaN (max.NaN and min.NaN: one instruction each)
    v = tl.minimum(tl.maximum(v, -CLAMP, propagate_nan=tl.PropagateNan.ALL), CLAMP, propagate_nan=tl.PropagateNan.ALL)
    tl.store(OUT + i, v.to(OUT.dtype.element_ty), mask=i < n)


@triton.jit
def _scale_max(SMAX, s, m):
    """The largest ``|s|`` where ``m`` (NaN as inf), as an atomic maximum into ``SMAX``."""
    a = tl.abs(s)
    tl.atomic_max(SMAX, tl.max(tl.where(m, tl.where(a == a, a, float("inf")), 0.0), axis=0), sem="relaxed")


def _fmt_args(fmt) -> dict:
    ebits = 7 - fmt.mantissa_bits
    return {"MBITS": fmt.mantissa_bits, "BIAS": (1 << (ebits - 1)) - 1, "SUBSCALE": 1.0 / fmt.min_subnormal}


def _shape(codec) -> dict:
    g = codec.group
    return {"BG": max(1, GROUP_ELEMS // g), "G": g, "LOG2G": int(math.log2(g)), "num_warps": WARPS}


def _taco(codec) -> tuple[bool, bool]:
    taco = type(codec).__name__ == "FP8"
    return taco, bool(taco and codec.hadamard)


def _sections(payload: torch.Tensor, ncodes: int, ng: int, taco: bool):
    """The codes (uint8) and the fp32 ``alpha`` (TACO) and ``s`` sections of ``payload`` as views, where the
    scales start 4-byte aligned (always with the Hadamard transform: the codes fill whole groups); else None."""
    if ncodes % 4:
        return None
    k = 2 if taco else 1
    scales = payload[ncodes: ncodes + 4 * k * ng].view(torch.float32)
    return payload[:ncodes], (scales[:ng] if taco else None), scales[(k - 1) * ng:]


def encode(codec, x: torch.Tensor) -> torch.Tensor:
    check_float_dtype(x.dtype, codec.name)
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    taco, had = _taco(codec)
    g = codec.group
    ng = cdiv(n, g)
    X = contiguous_input(x)
    ncodes = ng * g if had else n
    payload = torch.empty(ncodes + (8 if taco else 4) * ng, dtype=torch.uint8, device=x.device)
    views = _sections(payload, ncodes, ng, taco)  # written in place: no concatenation after
    if views is None:
        codes = torch.empty(ncodes, dtype=torch.uint8, device=x.device)
        alpha, s = torch.empty(ng, device=x.device), torch.empty(ng, device=x.device)
    else:
        codes, alpha, s = views
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    sh = _shape(codec)
    scr = torch.empty(ng, dtype=torch.float64, device=x.device) if taco else s  # (not read without TACO)
    launch(_encode, (cdiv(ng, sh["BG"]),), X, n, ng, codes, s if alpha is None else alpha, s, scr, bad,
           codec.fmt.max, normalization(g), TACO=taco, HADAMARD=had, LAMBDA=LAMBDA, ALPHA_MIN=ALPHA_MIN,
           ALPHA_MAX=ALPHA_MAX, S_MIN=S_MIN, S_MAX=S_MAX, TINY=TINY, SOFT_FP8=soft_fp8(x.device),
           **_fmt_args(codec.fmt), **sh)
    judge(bad, lambda v: v[0] and nonfinite(x, codec.name))
    if views is None:
        payload = torch.cat([codes, to_bytes(alpha), to_bytes(s)] if taco else [codes, to_bytes(s)])
    return payload


def decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    shape = as_shape(shape)
    check_float_dtype(dtype, codec.name)
    codec.check_payload(payload, shape, dtype)
    n = numel(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=payload.device)
    taco, had = _taco(codec)
    g = codec.group
    ng = cdiv(n, g)
    ncodes = ng * g if had else n
    views = _sections(payload, ncodes, ng, taco) if payload.storage_offset() % 4 == 0 else None
    if views is not None:
        codes, alpha, s = views
    elif taco:
        codes, a_bytes, s_bytes = split_sections(payload, (ncodes, 4 * ng, 4 * ng))
        alpha, s = from_bytes(a_bytes, torch.float32, ng), from_bytes(s_bytes, torch.float32, ng)
    else:
        codes, s_bytes = split_sections(payload, (ncodes, 4 * ng))
        alpha, s = None, from_bytes(s_bytes, torch.float32, ng)
    # fp32 and fp16 are written as they are; bf16 is cast by torch (Triton's interpreter truncates to bf16)
    out = torch.empty(n, dtype=dtype if dtype != torch.bfloat16 else torch.float32, device=payload.device)
    smax = torch.zeros(1, device=payload.device)
    sh = _shape(codec)
    scr = torch.empty(ng, device=payload.device) if taco else s  # (not read without TACO)
    launch(_decode, (cdiv(ng, sh["BG"]),), codes, n, ncodes, ng, s if alpha is None else alpha, s, scr, out, smax,
           torch.finfo(dtype).max, normalization(g), TACO=taco, HADAMARD=had, MBITS=codec.fmt.mantissa_bits,
           BIAS=_fmt_args(codec.fmt)["BIAS"], SOFT_FP8=soft_fp8(payload.device), **sh)
    check_decoded_later(out, smax, codec.name, limit=math.inf, scale=bound_scale(codec.fmt, g, had),
                        scan=scan_beyond)
    return out.to(dtype).reshape(shape)


register("FP8", encode=encode, decode=decode)
register("FP8Plain", encode=encode, decode=decode)
