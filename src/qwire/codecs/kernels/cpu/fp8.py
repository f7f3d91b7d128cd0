"""CPU kernels of ``fp8``/``taco`` and ``fp8plain`` (:mod:`qwire.codecs.fp8`).

Encode works on batches of whole groups small enough to stay in L1 (BATCH elements), pass by pass:
float64 sums of squares -> alpha (prefetching the next batch meanwhile); ``x * alpha`` -> Walsh-Hadamard
butterfly (stages 1..16 while loading, then radix-4 passes) -> max|y| -> s; ``(y * h) * (1 / s)`` ->
saturating fp32 -> fp8 cast (round to nearest even, on the bits: :func:`._simd._fp8_codes`). Decode,
per group: the codes' values (bit arithmetic; the 256-entry table for Inf/NaN codes), butterfly,
``(y * h) * (s / alpha)``; outputs of 8 MiB or more are written with non-temporal stores. A partial
last group is padded by the caller into a group of its own. Threads run over blocks of whole groups;
the vector code is in :mod:`._simd`.

Against the torch reference: the same payload bytes and the same decoded values, bit for bit, for
every format and group (the same fp32 operations in the same order). The reference's rotation is the
same butterfly (:func:`qwire.codecs.hadamard.hadamard_transform`, unnormalized) followed by one
multiplication by 1/sqrt(G) in fp32. ``alpha``: both sides sum the (exact) squares in float64 and
compute alpha in float64 with the same operations (torch's ``max / t`` is ``reciprocal(t) * max``),
rounded once to fp32; the two float64 sums add in different orders, so the fp32 alpha could only
differ if a sum lay within a few float64 ulps of a point where alpha's fp32 rounding flips (about
1e-8 per group; never seen in the tests). The fp32 -> fp8 cast was compared with torch's
``clamp(-max, max).to(float8_*)`` on every non-NaN fp32 bit pattern: no difference.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ...base import as_shape, check_decoded, check_finite, check_float_dtype, clamp_to_dtype_, numel
from ...fp8 import ALPHA_MAX, ALPHA_MIN, FORMATS, LAMBDA, S_MAX, S_MIN, FP8Format, _lut, bound
from ...hadamard import normalization
from ...wire import from_bytes, split_sections
from .. import register_kernels
from ._common import blocks, njit, np_of, run_blocks
from ._simd import (
    E4M3,
    E5M2,
    FORMATS8,
    absmax_bits,
    f32_from_bits,
    fp8_div,
    fp8_h32,
    fp8_h32_out,
    fp8_mul2,
    fp8_scale,
    mul_h32,
    mul_h32_max,
    scale_absmax,
    stages,
    stages_max,
    stages_out,
    store_fence,
    sumsq,
)

F32_TINY = float(torch.finfo(torch.float32).tiny)
BATCH = 2048  # elements per batch of groups (8 KiB of fp32: stays in L1)
STREAM_BYTES = 8 << 20  # decoded outputs at least this large are written with non-temporal stores


def fmt_id(fmt: FP8Format) -> int:
    """The :mod:`._simd` id of ``fmt`` (checked against its bias, mantissa bits and max)."""
    fid = {"e4m3": E4M3, "e5m2": E5M2}[fmt.name]
    bias, m, fmax, _ = FORMATS8[fid]
    assert (m, fmax, fmt.min_subnormal) == (fmt.mantissa_bits, fmt.max, 2.0 ** (1 - bias - m)), fmt
    return fid


# ------------------------------------------------------------------------------ the bare casts (for the tests)
@njit
def _cast(vals, codes, e5):
    fp8_mul2(vals, 0, np.float32(1.0), np.float32(1.0), codes, 0, vals.shape[0] >> 5, e5)


@njit
def _values_of(lut, codes, out, e5):
    fp8_scale(lut, codes, 0, np.float32(1.0), out, 0, codes.shape[0] >> 5, e5, False)


def cast_fp8(v: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """The kernels' saturating fp32 -> fp8 cast of the fp32 values ``v``, as uint8 codes."""
    flat = v.reshape(-1).to(torch.float32)
    n = flat.numel()
    padded = torch.cat([flat, flat.new_zeros((-n) % 32)])
    out = torch.empty(padded.numel(), dtype=torch.uint8)
    _cast(np_of(padded), np_of(out), fmt_id(fmt) == E5M2)
    return out[:n]


def fp8_values(codes: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """The kernels' fp8 -> fp32 decode of uint8 ``codes`` (a multiple of 32 of them)."""
    out = torch.empty(codes.numel())
    _values_of(_lut_np(fmt), np_of(codes.reshape(-1).contiguous()), np_of(out), fmt_id(fmt) == E5M2)
    return out


@njit
def fwht(buf, g):
    """In-place Walsh-Hadamard transform of ``buf[:g]`` (g a power of two in 32 .. 512; Sylvester order,
    unnormalized: ``y @ H`` for the +-1 matrix H), as the kernels compute it."""
    mul_h32(buf, 0, np.float32(1.0), buf, 0, g >> 5)
    stages(buf, 0, g)


# ------------------------------------------------------------------------------ the kernels
# They loop over whole groups only (the caller pads a partial last group into a group of its own) and
# call no numba function with array arguments in their loops: such a call costs two atomic reference
# count updates per array, and those would also drain the non-temporal stores each time.
@njit(inline="always")
def _alpha(ss, g, fmax):
    """The reference's alpha from a float64 sum of squares: ``clamp(max / sqrt(ss / g + LAMBDA))`` in
    float64 (torch computes ``max / t`` as ``reciprocal(t) * max``), rounded once to fp32."""
    a = (1.0 / math.sqrt(ss / g + LAMBDA)) * fmax
    a = ALPHA_MIN if a < ALPHA_MIN else (ALPHA_MAX if a > ALPHA_MAX else a)
    return np.float32(a)


@njit(error_model="numpy")  # (no zero-division checks: no divisor here can be 0)
def fp8_encode_groups(r0, r1, X, g, had, h, e5, codes, alpha_out, s_out):
    """Groups r0..r1 of the flat fp32 ``X`` (whole groups): alpha, s and the codes (at the elements' flat
    positions); ``h`` = 1/sqrt(g) in fp32, ``e5``: e5m2, else e4m3. In batches of groups (BATCH elements,
    kept in L1), pass by pass, so that the per-group chains (sum -> alpha -> rotation -> max -> s) of
    neighbouring groups overlap and the scalar steps run as vector loops; the next batch is prefetched
    while this one is summed. Stops (alpha NaN) at a group with NaN/Inf."""
    nb = max(1, BATCH // g)
    buf = np.empty(nb * g, np.float32)
    tmp = np.empty(nb, np.float64)
    fmax = 57344.0 if e5 else 448.0
    f_max = np.float32(fmax)
    hf = np.float32(h) if had else np.float32(1.0)
    s_lo, s_hi = np.float32(S_MIN), np.float32(S_MAX)
    for b0 in range(r0, r1, nb):
        k = min(nb, r1 - b0)
        finite = True
        for i in range(k):
            tmp[i] = sumsq(X, (b0 + i) * g, g >> 5, nb * g)
            finite &= math.isfinite(tmp[i])
        if not finite:  # NaN/Inf: the caller refuses the tensor
            alpha_out[b0] = np.nan
            return
        for i in range(k):
            alpha_out[b0 + i] = _alpha(tmp[i], g, fmax)
        for i in range(k):  # max|y| (with the rotation: max|y * h| = max|y| * h, rounding being monotone)
            if not had:
                tmp[i] = f32_from_bits(scale_absmax(X, (b0 + i) * g, alpha_out[b0 + i], buf, i * g, g >> 3))
            elif g == 32:
                tmp[i] = f32_from_bits(mul_h32_max(X, (b0 + i) * g, alpha_out[b0 + i], buf, i * g, 1))
            else:
                mul_h32(X, (b0 + i) * g, alpha_out[b0 + i], buf, i * g, g >> 5)
                tmp[i] = f32_from_bits(stages_max(buf, i * g, g))
        for i in range(k):
            s = (np.float32(tmp[i]) * hf) / f_max
            s = s_lo if s < s_lo else (s_hi if s > s_hi else s)
            s_out[b0 + i] = s
            tmp[i] = np.float32(1.0) / s
        for i in range(k):
            fp8_mul2(buf, i * g, hf, np.float32(tmp[i]), codes, (b0 + i) * g, g >> 5, e5)


@njit(error_model="numpy")
def fp8_decode_groups(r0, r1, codes, g, had, h, e5, lut, scale, out, nt):
    """Values of the whole groups r0..r1 into the flat fp32 ``out``: ``(H(q) * h) * scale`` (``had``), else
    ``q * scale``, with ``scale = s / alpha`` per group; ``nt``: non-temporal stores (``out`` 32-byte
    aligned)."""
    buf = np.empty(g, np.float32)
    hf = np.float32(h)
    for grp in range(r0, r1):
        if not had:
            fp8_scale(lut, codes, grp * g, scale[grp], out, grp * g, g >> 5, e5, nt)
        elif g == 32:
            fp8_h32_out(lut, codes, grp * g, hf, scale[grp], out, grp * g, 1, e5, nt)
        else:
            fp8_h32(lut, codes, grp * g, buf, 0, g >> 5, e5)
            stages_out(buf, 0, g, hf, scale[grp], out, grp * g, nt)
    if nt:
        store_fence()


@njit(error_model="numpy")
def plain_encode_groups(r0, r1, X, g, e5, codes, s_out):
    """``fp8plain``, whole groups: s = max|x| / max (at least the smallest normal fp32), codes of ``x / s``; in
    batches as :func:`fp8_encode_groups`."""
    nb = max(1, BATCH // g)
    f_max = np.float32(57344.0 if e5 else 448.0)
    f_tiny = np.float32(F32_TINY)
    for b0 in range(r0, r1, nb):
        k = min(nb, r1 - b0)
        finite = True
        for i in range(k):
            mx = absmax_bits(X, (b0 + i) * g, g >> 3, nb * g)
            finite &= mx < 0x7F800000
            s_out[b0 + i] = f32_from_bits(mx)
        if not finite:  # NaN/Inf: the caller refuses the tensor
            s_out[b0] = np.nan
            return
        for i in range(k):
            s = s_out[b0 + i] / f_max
            s_out[b0 + i] = f_tiny if s < f_tiny else s
        for i in range(k):
            fp8_div(X, (b0 + i) * g, s_out[b0 + i], codes, (b0 + i) * g, g >> 5, e5)


@njit(error_model="numpy")
def plain_decode_groups(r0, r1, codes, g, e5, lut, s, out, nt):
    """``fp8plain``, whole groups: ``value(code) * s`` (``nt`` as in :func:`fp8_decode_groups`)."""
    for grp in range(r0, r1):
        fp8_scale(lut, codes, grp * g, s[grp], out, grp * g, g >> 5, e5, nt)
    if nt:
        store_fence()


# ------------------------------------------------------------------------------ the codec entry points
def _flat_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened, fp32, contiguous (a view of an fp32 contiguous tensor: no copy)."""
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def _stream(out: torch.Tensor) -> bool:
    """Write ``out`` with non-temporal stores: when it is larger than the caches would keep anyway (the
    stores then skip reading each line first) and aligned for them."""
    return out.numel() * 4 >= STREAM_BYTES and out.data_ptr() % 32 == 0


@functools.lru_cache(maxsize=8)
def _lut_np(fmt: FP8Format) -> np.ndarray:
    return np_of(_lut(fmt, torch.device("cpu")))


def _tail(X: torch.Tensor, full: int, g: int) -> torch.Tensor:
    """The partial last group of the flat ``X``, zero-padded to ``g``."""
    pad = X.new_zeros(g)
    pad[: X.numel() - full * g] = X[full * g:]
    return pad


def fp8_encode(codec, x: torch.Tensor) -> torch.Tensor:
    check_float_dtype(x.dtype, codec.name)
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    g, had, e5 = codec.group, codec.hadamard, fmt_id(codec.fmt) == E5M2
    ncodes, na, ns = codec._sections(n)
    ng, full = na // 4, n // g
    X = _flat_fp32(x)
    payload = torch.empty(ncodes + na + ns, dtype=torch.uint8)
    alpha, s = torch.empty(ng), torch.empty(ng)
    if full:
        run_blocks(fp8_encode_groups, blocks(full, g), np_of(X), g, had, normalization(g), e5, np_of(payload),
                   np_of(alpha), np_of(s))
    if full < ng:  # the zero-padded last group; the codes of its padding are sent only with the rotation
        cb = torch.empty(g, dtype=torch.uint8)
        fp8_encode_groups(0, 1, np_of(_tail(X, full, g)), g, had, normalization(g), e5, np_of(cb), np_of(alpha[full:]),
                          np_of(s[full:]))
        m = g if had else n - full * g
        payload[full * g: full * g + m] = cb[:m]
    if not bool(torch.isfinite(alpha).all()):
        check_finite(x, codec.name)  # raises: a float64 sum of squares of finite fp32 values is finite
    payload[ncodes: ncodes + na] = alpha.view(torch.uint8)
    payload[ncodes + na:] = s.view(torch.uint8)
    return payload


def fp8_decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    shape = as_shape(shape)
    check_float_dtype(dtype, codec.name)
    codec.check_payload(payload, shape, dtype)
    n = numel(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=payload.device)
    g, had, e5 = codec.group, codec.hadamard, fmt_id(codec.fmt) == E5M2
    ng, full = -(-n // g), n // g
    codes, a_bytes, s_bytes = split_sections(payload.contiguous(), codec._sections(n))
    scale = from_bytes(s_bytes, torch.float32, ng) / from_bytes(a_bytes, torch.float32, ng)
    out = torch.empty(n)
    lut = _lut_np(codec.fmt)
    if full:
        run_blocks(fp8_decode_groups, blocks(full, g), np_of(codes), g, had, normalization(g), e5, lut, np_of(scale),
                   np_of(out), _stream(out))
    if full < ng:  # the last group, decoded whole (its padding's codes are zeros without the rotation)
        cb = torch.zeros(g, dtype=torch.uint8)
        cb[: codes.numel() - full * g] = codes[full * g:]
        tail = torch.empty(g)
        fp8_decode_groups(0, 1, np_of(cb), g, had, normalization(g), e5, lut, np_of(scale[full:]), np_of(tail), False)
        out[full * g:] = tail[: n - full * g]
    b = bound(scale, codec.fmt, g, had)
    check_decoded(out, b, codec.name, limit=math.inf)
    return clamp_to_dtype_(out, dtype, b).to(dtype).reshape(shape)


def plain_encode(codec, x: torch.Tensor) -> torch.Tensor:
    check_float_dtype(x.dtype, codec.name)
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    g, e5 = codec.group, fmt_id(codec.fmt) == E5M2
    ng, full = -(-n // g), n // g
    X = _flat_fp32(x)
    payload = torch.empty(n + 4 * ng, dtype=torch.uint8)
    s = torch.empty(ng)
    if full:
        run_blocks(plain_encode_groups, blocks(full, g), np_of(X), g, e5, np_of(payload), np_of(s))
    if full < ng:
        cb = torch.empty(g, dtype=torch.uint8)
        plain_encode_groups(0, 1, np_of(_tail(X, full, g)), g, e5, np_of(cb), np_of(s[full:]))
        payload[full * g: n] = cb[: n - full * g]
    if not bool(torch.isfinite(s).all()):
        check_finite(x, codec.name)  # raises
    payload[n:] = s.view(torch.uint8)
    return payload


def plain_decode(codec, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    shape = as_shape(shape)
    check_float_dtype(dtype, codec.name)
    codec.check_payload(payload, shape, dtype)
    n = numel(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=payload.device)
    g, e5 = codec.group, fmt_id(codec.fmt) == E5M2
    ng, full = -(-n // g), n // g
    codes, s_bytes = split_sections(payload.contiguous(), (n, 4 * ng))
    s = from_bytes(s_bytes, torch.float32, ng)
    out = torch.empty(n)
    lut = _lut_np(codec.fmt)
    if full:
        run_blocks(plain_decode_groups, blocks(full, g), np_of(codes), g, e5, lut, np_of(s), np_of(out), _stream(out))
    if full < ng:
        cb = torch.zeros(g, dtype=torch.uint8)
        cb[: n - full * g] = codes[full * g:]
        tail = torch.empty(g)
        plain_decode_groups(0, 1, np_of(cb), g, e5, lut, np_of(s[full:]), np_of(tail), False)
        out[full * g:] = tail[: n - full * g]
    b = bound(s, codec.fmt, g, False)
    check_decoded(out, b, codec.name, limit=math.inf)
    return clamp_to_dtype_(out, dtype, b).to(dtype).reshape(shape)


def _supported(codec) -> bool:
    return codec.format in ("e4m3", "e5m2") and codec.group % 32 == 0


assert set(FORMATS) == {"e4m3", "e5m2"}
register_kernels("cpu", "FP8", supports=_supported, encode=fp8_encode, decode=fp8_decode)
register_kernels("cpu", "FP8Plain", supports=_supported, encode=plain_encode, decode=plain_decode)
