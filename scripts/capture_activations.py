#!/usr/bin/env python3
"""Train a tiny causal LM briefly and save the activations and gradients at its middle pipeline boundary.

    .venv/bin/python scripts/capture_activations.py [--steps 300] [--out .cache/codecs/boundary-llama-tiny.pt]

``qwire bench codecs`` runs this itself when the cache file is missing; the
file is not committed (``.cache/`` is ignored).
"""

from __future__ import annotations

import argparse

from qwire.bench.capture import DEFAULT_CAPTURE, capture_boundary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_CAPTURE), help="where to save the tensors (torch.save)")
    p.add_argument("--steps", type=int, default=300, help="training steps before the capture")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--model", default="llama-tiny", help="model preset")
    p.add_argument("--corpus", default="stdlib", help="corpus spec (see qwire.data)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    capture_boundary(a.out, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, preset=a.model,
                     corpus=a.corpus, seed=a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
