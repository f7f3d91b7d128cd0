"""``auto``: a codec that is one of several candidates at a time, chosen from measurements.

``auto`` itself measures nothing: it holds the candidate codecs and the one in force (``current``).
A controller that sees both ends of a link (for pipeline boundaries: :mod:`qwire.parallel.autotune`)
measures the link and each candidate on the real tensors, and switches both ends to the same candidate
at a step boundary. Until the first decision the codec in force is the first candidate (by default
``fp32``, exact). Payloads are those of the codec in force; ``max_payload_nbytes`` is the largest
candidate's, so buffers sized once hold any of them.

Spec: ``auto[:max_nmse=0.02,candidates=fp32+fp16+int8+tahquant,probe_every=100,min_gain=0.05]``.
``candidates`` are codec names or presets joined by ``+``; ``fp32`` is always a candidate (so a
budget can always be met).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Codec, CodecError, Param
from .registry import get_codec, register

DEFAULT_CANDIDATES = "fp32+fp16+int8+tahquant"


class Auto(Codec):
    name = "auto"
    params = (
        Param("max_nmse", float, 0.02, "error budget: largest normalized MSE (||x - x'||^2 / ||x||^2) accepted",
              lo=0.0),
        Param("candidates", str, DEFAULT_CANDIDATES, "codecs to choose from, joined by '+'"),
        Param("probe_every", int, 100, "steps between re-measurements (0: only at the start)", lo=0),
        Param("min_gain", float, 0.05, "switch only if the predicted time drops by more than this fraction",
              lo=0.0, hi=1.0),
    )

    def _validate(self) -> None:
        names = [c.strip() for c in self.candidates.split("+") if c.strip()]
        if not names:
            raise CodecError("codec 'auto': candidates is empty; give codec names joined by '+', e.g. fp32+int8")
        if "fp32" not in names:
            names.insert(0, "fp32")
        self.labels: list[str] = names  # as the user named them (for logs); choices[i] is labels[i]'s codec
        self.choices: list[Codec] = []
        for n in names:
            if n.split(":")[0] == "auto":
                raise CodecError("codec 'auto': auto cannot be its own candidate")
            c = get_codec(n)
            if c.stateful:
                raise CodecError(f"codec 'auto': candidate {n!r} keeps per-sample state (AQ-SGD); "
                                 "choose stateless candidates")
            self.choices.append(c)
        self.current: Codec = self.choices[0]

    # The codec in force ----------------------------------------------------------------
    def switch(self, spec: str) -> None:
        """Put the candidate ``spec`` in force (both ends of a link must switch at the same step)."""
        for c in self.choices:
            if c.spec() == spec:
                self.current = c
                return
        raise CodecError(f"codec 'auto': {spec!r} is not one of its candidates "
                         f"({', '.join(c.spec() for c in self.choices)})")

    def in_force(self) -> str:
        return self.current.spec()

    def label(self, spec: str) -> str:
        """The name the user gave a candidate (``int8`` for ``int:bits=8,...``)."""
        for lab, c in zip(self.labels, self.choices):
            if c.spec() == spec:
                return lab
        return spec

    # The contract: the codec in force -----------------------------------------------
    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return self.current.payload_nbytes(shape, dtype)

    def max_payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return max(c.payload_nbytes(shape, dtype) for c in self.choices)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.current.encode(x)

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return self.current.decode(payload, shape, dtype)


register("auto", Auto)
