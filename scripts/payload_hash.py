"""One SHA-256 over the payloads and decoded values of a fixed set of codecs and inputs, for checking that a
change keeps every codec's bytes: run it at two commits (``PYTHONPATH=<checkout>/src``) and compare.

Usage: ``python scripts/payload_hash.py [--device cpu|cuda]``; prints the digest and the number of payloads.
Inputs: LLM-like activations with massive outliers (2 x 64 x 1600), an odd-shaped Gaussian (3 x 100 x 257), and
the first in fp16; codecs as listed in SPECS, each with ``impl=torch`` and ``impl=auto``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch

from qwire.codecs import get_codec
from qwire.codecs.synthetic import llm_like

# the TAH-Quant configurations before log6t became the default keep their bytes (pinned to log7), then the default
SPECS = ["int4", "int8", "int3:layout=log7,fit=mse", "int4:symmetric=true", "int4:layout=ref", "perchannel6",
         "blockwise8", "fp8", "fp16", "tahquant:layout=log7,fit_rotated=false",
         "tahquant:layout=log7,fit=minmax,tau=2.0", "tahquant-public",
         "tahquant:slots=token,ratio=0.8,layout=logx,zero_ext=8,tau=2.0,fit=minmax",
         "tahquant:tile=64,layout=log7,fit_rotated=false", "tahquant:layout=log7,fit_rotated=true",
         "tahquant:layout=log7,adapt=block,fit_rotated=true", "tahquant:layout=log7,adapt=predict,fit_rotated=true",
         "tahquant", "tahquant:tile=64", "tahquant:zero_width=fixed"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--specs", default=";".join(SPECS),
                    help="codec specs separated by semicolons (default: the fixed set above)")
    ap.add_argument("--each", action="store_true",
                    help="also print a short digest of each payload and of its decode, one line per codec, impl "
                         "and input, to find where two runs differ")
    args = ap.parse_args(argv)
    specs = [s.strip() for s in args.specs.split(";") if s.strip()]
    x, _ = llm_like((2, 64, 1600), seed=3)
    y = torch.randn(3, 100, 257, generator=torch.Generator().manual_seed(1)) * 2
    h, n = hashlib.sha256(), 0
    for spec in specs:
        for impl in ("torch", "auto"):
            c = get_codec(spec, impl=impl)
            for name, t in (("llm", x), ("odd", y), ("llm-fp16", x.half())):
                pt = c.encode(t.to(args.device))
                p = pt.cpu().numpy().tobytes()
                d = c.decode(pt, t.shape, t.dtype).float().cpu().numpy().tobytes()
                h.update(p)
                h.update(d)
                n += 1
                if args.each:
                    print(f"{spec} {impl} {name}: payload {hashlib.sha256(p).hexdigest()[:12]} "
                          f"decode {hashlib.sha256(d).hexdigest()[:12]}")
    print(f"{h.hexdigest()}  ({n} payloads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
