"""The reference's backward-gradient codec: ``perchannel`` and ``perchannel2`` .. ``perchannel8``.

Symmetric fixed-point quantization with one absmax scale per channel (the
last dimension), taken over every leading dimension (all tokens of the batch):
with ``h = 2**(bits-1) - 1``,

    step_c = max over (B, S) of |x[..., c]| / h
    q = clamp(round(x / step_c), -h, h) + h        # bits-wide, bit-packed
    x' = (q - h) * step_c                          # |x - x'| <= step_c / 2

``bits`` defaults to 6 ("fw ~4 bits, bw 6 bits" in the TAH-Quant code); any
2..8 works. ``layout=ref`` stores the steps as fp16 (the reference), rounded
*up* so the channel is still covered; a step beyond fp16's range raises
:class:`~qwire.codecs.base.CodecError` naming ``layout=fp32``, and a step below
fp16's smallest subnormal (6e-8) is stored as that subnormal (the error bound
still holds with the stored step). ``layout=fp32`` stores fp32 steps.
``rounding=stochastic`` is unbiased and seeded like the tile codecs.

Payload: ``[steps: C x fp16|fp32][codes: numel x bits bits, row-major]``.
Policy: NaN/Inf raise :class:`~qwire.codecs.base.NonFiniteError`; an empty
tensor has a 0-byte payload; an all-zero channel decodes to exact zeros.
"""

from __future__ import annotations

import torch

from .base import FP16_MAX, CodecError, Param, check_decoded, div
from .kernels import dispatch
from .layouts import round_fp16
from .registry import register
from .sections import Field, Sections
from .tiles import ROUNDING, Geometry, TileCodec, as_rows, check_magnitude, dequantize, quantize_


class PerChannel(TileCodec):
    """Symmetric per-channel absmax quantization over all leading dimensions."""

    name = "perchannel"
    params = (
        Param("bits", int, 6, "bits per code, 2..8", lo=2, hi=8),
        Param("rounding", str, "nearest", "nearest or stochastic", choices=ROUNDING),
        Param("seed", int, 0, "seed of stochastic rounding", lo=0, hi=(1 << 63) - 1),
        Param("layout", str, "ref", "step storage: ref (fp16, the reference) or fp32", choices=("ref", "fp32")),
    )
    tile = 1  # geometry: one "tile" per channel
    bits: int
    layout: str

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def sections(self, g: Geometry) -> Sections:
        dt = torch.float16 if self.layout == "ref" else torch.float32
        return Sections([Field("scale", g.cols, dtype=dt), Field("codes", g.numel, bits=self.bits)])

    def _steps(self, x: torch.Tensor, X: torch.Tensor, rpc: int) -> torch.Tensor:
        amax = torch.zeros(X.shape[1], dtype=torch.float32, device=X.device)
        for r0 in range(0, X.shape[0], rpc):
            torch.maximum(amax, X[r0: r0 + rpc].abs().amax(dim=0).float(), out=amax)
        return self._steps_of(x, amax)

    def _steps_of(self, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """Stored steps (fp16 or fp32) for the per-channel absolute maxima ``amax`` (fp32) of ``x``, after the checks
        (:meth:`steps_verdict`; the GPU kernel makes the steps and queues the checks itself)."""
        need = div(amax, self.levels // 2)  # not amax / n: CUDA multiplies by 1 / n (see base.div)
        verdict = self.steps_verdict(x)
        if not amax.numel():
            verdict([0.0, 0.0])
        else:
            verdict(torch.stack((amax.amax(), need.amax())).tolist())
        return round_fp16(need, up=True) if self.layout != "fp32" else need

    def steps_verdict(self, x: torch.Tensor):
        """The check of the steps of ``x``, on ``[largest absmax, largest step before rounding]``: a non-finite or
        out-of-range input, or (layout ``ref``) a step beyond fp16's range, raises."""
        def verdict(v: list) -> None:
            m, top = v
            check_magnitude(x, m, self.name)
            if self.layout != "fp32" and top > FP16_MAX:
                raise CodecError(
                    f"codec {self.name!r}: layout 'ref' stores per-channel steps as fp16 but this tensor has "
                    f"values up to {m:.3g}, whose step exceeds 65504; use layout=fp32"
                )

        return verdict

    @dispatch
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        g, sec, payload = self._begin_encode(x)
        if not g.numel:
            return payload
        X = as_rows(x, g)
        rpc = g.chunk_rows(8, x.device)
        steps = self._steps(x, X, rpc)
        sec.put(payload, "scale", 0, steps)
        s = steps.float().unsqueeze(0)
        gen = self._generator(x.device)
        for r0 in range(0, g.rows, rpc):
            t = X[r0: r0 + rpc].to(torch.float32, copy=True)
            sec.put(payload, "codes", r0 * g.cols, quantize_(t, None, s, self.levels, True, gen))
        return payload

    @dispatch
    def decode(self, payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
        g, sec, out = self._begin_decode(payload, shape, dtype)
        if not g.numel:
            return out
        O = out.view(g.rows, g.cols)
        s = sec.get(payload, "scale", 0, g.cols).float().unsqueeze(0)
        rpc = g.chunk_rows(8, payload.device)
        for r0 in range(0, g.rows, rpc):
            r = min(rpc, g.rows - r0)
            codes = sec.get(payload, "codes", r0 * g.cols, r * g.cols).view(r, g.cols)
            vals = dequantize(codes, None, s, self.levels, True)
            check_decoded(vals, float(s.abs().amax()) * self.levels, self.name)
            if dtype == torch.float16:  # within step/2 of a value <= 65504: must not become Inf
                vals.clamp_(-FP16_MAX, FP16_MAX)
            O[r0: r0 + r] = vals
        return out

    def _tile_bound(self, sec: Sections, payload: torch.Tensor, r0: int, r: int, g: Geometry) -> torch.Tensor:
        s = sec.get(payload, "scale", 0, g.cols).float()
        half = 1.0 if self.rounding == "stochastic" else 0.5
        return (s * half).expand(r, g.cols).unsqueeze(-1)


register("perchannel", PerChannel)
for _b in range(2, 9):
    register(f"perchannel{_b}", PerChannel, bits=_b)
