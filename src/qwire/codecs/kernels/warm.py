"""Compile every CPU codec kernel once, so that later processes load them from numba's disk cache.

``python -m qwire.codecs.kernels.warm`` (``scripts/setup.sh`` runs it) encodes and decodes a small
tensor of each dtype with one configuration per kernel path. Without it each new process compiles
the kernels it uses on first use (seconds each), which several training ranks starting at once
would otherwise all do in parallel.
"""

from __future__ import annotations

import sys
import time

import torch

from . import BACKENDS

# one configuration per compiled path (the kernels specialise on argument types, not on values)
SPECS = (
    "int4", "int3:symmetric=true", "int4:layout=ref", "tahquant", "tahquant:unit=token", "tahquant-public",
    "tahquant:layout=log6,zero_ext=0", "perchannel6", "perchannel8:layout=fp32", "blockwise8", "blockwise4",
    "fp4", "fp8", "fp8:hadamard=false", "fp8plain", "fp16", "bf16", "aqsgd:inner=int4",
)


def warm(verbose: bool = True, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
         ) -> float:
    """Encode and decode a small tensor of each of ``dtypes`` with every configuration of ``SPECS`` on the CPU
    kernels (compiling them, or loading them from numba's disk cache); returns the seconds it took."""
    from qwire.codecs import get_codec

    t0 = time.perf_counter()
    if not BACKENDS["cpu"].load():
        return 0.0
    for spec in SPECS:
        for dtype in dtypes:
            x = torch.randn(2, 8, 256).to(dtype)
            codec = get_codec(spec)
            kw = {"sample_ids": torch.arange(2)} if codec.stateful else {}
            p = codec.encode(x, **kw)
            codec.decode(p, x.shape, x.dtype, **kw)
    dt = time.perf_counter() - t0
    if verbose:
        print(f"qwire: codec kernels ready ({dt:.0f} s)", file=sys.stderr)
    return dt


if __name__ == "__main__":
    warm()
