"""LLM-like activations with outliers, for tests and ``qwire bench codecs``.

Pretrained LLMs carry two kinds of outliers in the hidden state that crosses a
pipeline boundary (Dettmers et al. 2022, "LLM.int8()"; Sun et al. 2024,
"Massive activations in large language models"):

- **persistent outlier channels**: a few channels that are 20-100x the RMS in
  (almost) every token;
- **massive activations**: a few channels of a few tokens (the first token and
  delimiter-like positions) that are hundreds to ~10^4 times the RMS.

:func:`llm_like` puts both on top of a base tensor (real captured activations,
or N(0, 1)) and returns the tensor and a mask of the *ordinary* elements (the
ones it did not touch), on which a codec's error should not depend on the
outliers' magnitude.

Placement (the assumptions are explicit, not hidden): every outlier channel
lies alone in its own aligned block of ``spacing`` channels, so for any tile
size ``G <= spacing`` that divides ``spacing`` (powers of two: 2 .. 64 at the
default) each tile holds at most one outlier channel. A token then has at most
``massive + outlier_channels`` outlier tiles (massive tokens) or
``outlier_channels`` (the others). TAH-Quant rotates at most
``ceil(max_rotated * T)`` tiles per token (``T = C / G``); outlier tiles beyond
that cap, and tiles holding *two* outliers of similar size (``|largest| <=
tau * |second|``, so not rotated), are quantized with a step set by the
outliers, and their ordinary elements lose most of their precision. Neither
case is generated here unless asked for (``spacing`` smaller than ``G``, or
more outlier channels than the cap).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _magnitudes(spec: float | tuple[float, float], n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` magnitudes: the value itself, or log-uniform in ``[lo, hi]``."""
    if isinstance(spec, (int, float)):
        return torch.full((n,), float(spec), dtype=torch.float64)
    lo, hi = float(spec[0]), float(spec[1])
    if not 0 < lo <= hi:
        raise ValueError(f"a magnitude range must be 0 < lo <= hi, got {spec!r}")
    u = torch.rand(n, generator=g, dtype=torch.float64)
    return torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))


def llm_like(shape: Sequence[int], *, massive: int = 2, massive_tokens: int = 4,
             magnitude: float | tuple[float, float] = 1000.0, outlier_channels: int = 4,
             channel_magnitude: float | tuple[float, float] = (20.0, 100.0),
             base: torch.Tensor | None = None, spacing: int = 64, pairs: int = 0, seed: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 tensor of ``shape`` ``(..., S, C)`` with LLM-like outliers, and its ordinary-element mask.

    - ``base``: the tensor to start from (copied, cast to fp32; e.g. captured activations);
      default N(0, 1) drawn from ``seed``. Magnitudes are multiples of ``rms``, the base's
      root mean square.
    - ``outlier_channels`` persistent outlier channels: in every token, channel ``c`` holds
      ``sign_c * m_c * rms * f`` with ``m_c`` from ``channel_magnitude`` (a number, or a
      ``(lo, hi)`` range drawn log-uniformly per channel), a fixed random sign per channel and
      ``f`` uniform in [0.75, 1.25] per element.
    - ``massive`` massive channels on ``massive_tokens`` tokens of every sequence (the first
      token and ``massive_tokens - 1`` other random positions, like delimiters): value
      ``sign_c * magnitude * rms * f``, ``f`` uniform in [0.5, 1] (``magnitude`` may also be a
      ``(lo, hi)`` range per channel). Outlier channels keep their values on these tokens.
    - Every outlier channel sits alone in an aligned block of ``spacing`` channels (see the
      module docstring for what that guarantees, and what breaks TAH-Quant); ``C`` must hold
      ``massive + outlier_channels`` such blocks. Except with ``pairs``: the first ``2 * pairs``
      persistent outlier channels go two to a block (two outliers in one tile for any
      ``G >= spacing``; of similar size with a fixed ``channel_magnitude``, the case TAH-Quant's
      one rotation per tile cannot serve, while a range may make one far larger, and rotated).

    The outlier elements *replace* the base's values. Returns ``(x, ordinary)``: ``ordinary``
    is a bool tensor of ``shape``, False exactly at the elements set here.
    Deterministic for a given ``seed`` (the global RNG is not touched).
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 1:
        raise ValueError("llm_like needs a tensor of at least one dimension (channels last)")
    C = shape[-1]
    S = shape[-2] if len(shape) >= 2 else 1
    n_out = massive + outlier_channels
    if massive < 0 or outlier_channels < 0 or massive_tokens < 0 or spacing < 1 or pairs < 0:
        raise ValueError("massive, outlier_channels, massive_tokens, pairs must be >= 0 and spacing >= 1")
    if 2 * pairs > outlier_channels or (pairs and spacing < 2):
        raise ValueError(f"pairs={pairs} needs {2 * pairs} outlier channels (got outlier_channels="
                         f"{outlier_channels}) and spacing >= 2 (got {spacing})")
    n_blocks = n_out - pairs  # a pair shares its block
    if n_blocks * spacing > C:
        raise ValueError(f"{n_out} outlier channels in {n_blocks} distinct blocks of {spacing} channels need C >= "
                         f"{n_blocks * spacing}, got C={C}; lower spacing or the number of outliers")
    g = torch.Generator().manual_seed(seed)
    if base is None:
        x = torch.randn(shape, generator=g, dtype=torch.float32)
    else:
        if tuple(base.shape) != shape:
            raise ValueError(f"base has shape {tuple(base.shape)}, expected {shape}")
        x = base.detach().to(torch.float32, copy=True).cpu()
    rms = float(x.double().pow(2).mean().sqrt()) if x.numel() else 1.0
    rms = rms if rms > 0 else 1.0
    ordinary = torch.ones(shape, dtype=torch.bool)
    if n_out == 0 or x.numel() == 0:
        return x, ordinary
    if not pairs:
        blocks = torch.randperm(C // spacing, generator=g)[:n_out]
        chans = blocks * spacing + torch.randint(0, spacing, (n_out,), generator=g)
    else:  # blocks: the massive channels', then one per pair (two channels in it), then the others'
        blocks = torch.randperm(C // spacing, generator=g)[:n_blocks]
        within = [torch.randperm(spacing, generator=g)[:2] for _ in range(pairs)]
        single = torch.randint(0, spacing, (n_blocks - pairs,), generator=g)
        chans = torch.cat([blocks[:massive] * spacing + single[:massive],
                           *(blocks[massive + i] * spacing + w for i, w in enumerate(within)),
                           blocks[massive + pairs:] * spacing + single[massive:]])
    signs = torch.where(torch.rand(n_out, generator=g) < 0.5, -1.0, 1.0).double()
    xs, om = x.view(-1, S, C), ordinary.view(-1, S, C)
    B = xs.shape[0]
    if outlier_channels:
        ch = chans[massive:]
        mag = _magnitudes(channel_magnitude, outlier_channels, g) * signs[massive:] * rms
        f = 0.75 + 0.5 * torch.rand(B, S, outlier_channels, generator=g, dtype=torch.float64)
        xs[:, :, ch] = (f * mag).float()
        om[:, :, ch] = False
    if massive and massive_tokens:
        ch = chans[:massive]
        mag = _magnitudes(magnitude, massive, g) * signs[:massive] * rms
        k = min(massive_tokens, S)
        for b in range(B):
            toks = torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(S - 1, generator=g)[: k - 1]])
            f = 0.5 + 0.5 * torch.rand(k, massive, generator=g, dtype=torch.float64)
            sub = xs[b, toks]  # (k, C) copy
            sub[:, ch] = (f * mag).float()
            xs[b, toks] = sub
            mo = om[b, toks]
            mo[:, ch] = False
            om[b, toks] = mo
    return x, ordinary


def ordinary_nmse(x: torch.Tensor, y: torch.Tensor, ordinary: torch.Tensor) -> float:
    """``sum (x - y)^2 / sum x^2`` over the ordinary elements only (fp64)."""
    d = (y.double() - x.double())[ordinary]
    ref = x.double()[ordinary]
    den = float((ref * ref).sum())
    return float((d * d).sum()) / den if den > 0 else 0.0
