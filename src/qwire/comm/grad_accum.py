"""QuanGrad's 8-bit gradient accumulation buffer, independent of the optimizer.

With gradient accumulation over ``k`` micro-batches, the fp32 ``p.grad`` of
every parameter lives for the whole step. :class:`QuantizedGradAccumulator`
keeps the running sum as a codec payload instead (default block-wise int8,
block 256, one fp32 scale per block: 8.125 bits per element instead of 32)::

    acc = QuantizedGradAccumulator(model.parameters())
    for micro in micro_batches:
        loss_fn(model(micro)).backward()
        acc.accumulate()          # sum += p.grad (dequantize, add in fp32, requantize); p.grad = None
    acc.finalize()                # p.grad = dequantized sum
    optimizer.step(); optimizer.zero_grad()

Each requantization adds at most half a quantization step of the running sum
(block absmax / 254 per element for int8), so the error after ``k`` micro-batches
is bounded by the sum of those ``k`` half-steps; with the lossless ``fp32``
codec the result is bit-identical to autograd's own accumulation.

With DDP, run the first ``k-1`` micro-batches under ``ddp.no_sync()`` with
``accumulate()`` after each, call ``finalize()`` *before* the last micro-batch's
backward (so autograd adds the last gradient to the restored sum and DDP
all-reduces the total), then step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from qwire.codecs import Codec, get_codec


@dataclass(frozen=True)
class AccumulatorMemory:
    """Bytes of the accumulation buffer: as fp32 tensors vs as codec payloads."""

    fp32_bytes: int
    payload_bytes: int

    @property
    def saved_bytes(self) -> int:
        return self.fp32_bytes - self.payload_bytes

    @property
    def saved_fraction(self) -> float:
        return self.saved_bytes / self.fp32_bytes if self.fp32_bytes else 0.0


class QuantizedGradAccumulator:
    """Holds the sum of gradients over micro-batches as compressed payloads.

    Args:
        params: the parameters whose ``.grad`` to accumulate (those without
            ``requires_grad`` are skipped).
        codec: codec or spec string for the stored sum (``"fp32"`` is exact).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 codec: str | Codec = "blockwise8:block=256") -> None:
        self.params = [p for p in params if p.requires_grad]
        self.codec = get_codec(codec)
        self._payloads: list[torch.Tensor | None] = [None] * len(self.params)
        self.micro_batches = 0

    def accumulate(self) -> None:
        """Add every ``p.grad`` to the stored sum, requantize, and free ``p.grad``."""
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise TypeError("QuantizedGradAccumulator does not take sparse gradients")
            stored = self._payloads[i]
            if stored is None:
                total = g.detach()
            else:
                total = self.codec.decode(stored, g.shape, torch.float32).add_(g.detach())
            self._payloads[i] = self.codec.encode(total)
            p.grad = None
        self.micro_batches += 1

    def finalize(self, scale: float | None = None) -> None:
        """Write the dequantized sum (times ``scale`` if given, e.g. ``1/k``) to ``p.grad`` and reset.

        A parameter that has a ``.grad`` already (e.g. from a micro-batch not yet
        accumulated) gets the stored sum added to it.
        """
        for i, p in enumerate(self.params):
            stored = self._payloads[i]
            if stored is None:
                continue
            total = self.codec.decode(stored, p.shape, torch.float32)
            if p.grad is not None:
                total.add_(p.grad.detach())
            if scale is not None:
                total.mul_(scale)
            p.grad = total.to(p.dtype)
            self._payloads[i] = None
        self.micro_batches = 0

    def reset(self) -> None:
        """Drop the stored sum without touching ``p.grad``."""
        self._payloads = [None] * len(self.params)
        self.micro_batches = 0

    def memory(self) -> AccumulatorMemory:
        """Buffer size for all parameters: fp32 gradients vs the codec's payloads."""
        fp32 = sum(p.numel() * 4 for p in self.params)
        payload = sum(self.codec.payload_nbytes(p.shape, torch.float32) for p in self.params)
        return AccumulatorMemory(fp32, payload)

    def stored_bytes(self) -> int:
        """Bytes currently held by the stored payloads."""
        return sum(int(t.numel()) for t in self._payloads if t is not None)
