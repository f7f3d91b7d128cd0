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

:func:`accumulate_in_8bit` does the same from inside backward, with post-accumulate-grad hooks, so
it also works where the caller does not run the micro-batches itself (a pipeline schedule)::

    handle = accumulate_in_8bit(model)            # a plain module, a DDP module, or an FSDP2 module
    for micro in micro_batches:
        loss_fn(model(micro)).backward()          # each gradient is folded into the buffer, p.grad freed
    handle.finish()                               # p.grad = dequantized sum (+ whatever p.grad holds)
    optimizer.step(); optimizer.zero_grad()

* Plain module: every micro-batch is folded; ``finish()`` writes the sum back.
* DDP: DDP's reducer reads ``p.grad`` right after the post-accumulate-grad hooks (checked with
  torch 2.13). Run every micro-batch but the last under ``ddp.no_sync()``: those are folded; in
  the synchronizing backward the hook instead adds the stored sum to ``p.grad`` in place, so DDP
  all-reduces the total and ``finish()`` has nothing left to do. The fp32 memory saved is
  ``p.grad``'s; DDP's own bucket buffers (a second fp32 copy, unless ``gradient_as_bucket_view``)
  stay. Without ``no_sync`` every micro-batch is reduced and nothing is held (correct, no saving).
* FSDP2 (``fully_shard``, gradient sync on in every micro-batch, FSDP2's default): FSDP calls the
  hooks of the *sharded* parameters after each reduce-scatter, so the buffer holds the reduced
  gradient shards (1/world of the model each). With ``set_requires_gradient_sync(False)``, which
  ``torch.distributed.pipelining`` uses for all micro-batches of a stage, FSDP2 accumulates the
  unsharded gradients in its own fp32 buffer and reduce-scatters once: the hooks then fire once
  per step and there is nothing to save.
* A pipeline schedule that scales gradients by ``1/n_microbatches`` after the last backward
  (``scale_grads=True``) skips parameters whose ``p.grad`` is None, i.e. those in the buffer:
  pass ``finish(scale=1/n_microbatches)`` then (it scales only what comes from the buffer, so it
  is also right for DDP, whose sum is already back in ``p.grad``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

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
            self._fold(i, g)
            p.grad = None
        self.micro_batches += 1

    def _fold(self, i: int, g: torch.Tensor) -> None:
        """stored[i] = encode(decode(stored[i]) + g): dequantize, add in fp32, requantize."""
        if g.is_sparse:
            raise TypeError("QuantizedGradAccumulator does not take sparse gradients")
        stored = self._payloads[i]
        if stored is None:
            total = g.detach()
        else:
            total = self.codec.decode(stored, g.shape, torch.float32).add_(g.detach())
        self._payloads[i] = self.codec.encode(total)

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


# ---------------------------------------------------------------------------------------------
# the same, from inside backward

def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a DTensor's local shard (what this rank stores)."""
    return t.to_local() if hasattr(t, "to_local") else t


class GradAccumHandle:
    """Post-accumulate-grad hooks that keep a module's gradients in a codec buffer across micro-batches
    (see the module docstring); made by :func:`accumulate_in_8bit`."""

    def __init__(self, module: nn.Module, codec: str | Codec) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self._ddp = module if isinstance(module, DistributedDataParallel) else None
        inner = module.module if self._ddp is not None else module
        self.acc = QuantizedGradAccumulator(inner.parameters(), codec)
        # what finish() needs to rebuild a gradient: this rank's shape, and a DTensor's layout
        self._layout: list[Any] = [None] * len(self.acc.params)
        self._hooks = [p.register_post_accumulate_grad_hook(partial(self._hook, i))
                       for i, p in enumerate(self.acc.params)]
        self.folded = 0  # gradients folded into the buffer (parameters x micro-batches), for tests and logs
        self._held = 0  # bytes of the payloads now held (kept up to date by _fold / _add_stored_into)
        self.peak_bytes = 0  # most bytes held since the last finish()
        self.last_peak_bytes = 0  # peak_bytes of the step that the last finish() ended

    @property
    def codec(self) -> Codec:
        return self.acc.codec

    def _hook(self, i: int, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        if self._ddp is not None and self._ddp.require_backward_grad_sync:
            # DDP reduces p.grad right after this hook: hand it the total instead of folding
            self._add_stored_into(i, p, scale=None)
            return
        local = _local(g)
        if local is not g:
            self._layout[i] = (g.device_mesh, g.placements, g.shape, g.stride())
        old = self.acc._payloads[i]
        self.acc._fold(i, local)
        new = self.acc._payloads[i]
        self._held += _nbytes(new) - (_nbytes(old) if old is not None else 0)
        self.peak_bytes = max(self.peak_bytes, self._held)
        self.folded += 1
        p.grad = None

    def _add_stored_into(self, i: int, p: torch.Tensor, scale: float | None) -> None:
        stored = self.acc._payloads[i]
        if stored is None:
            return
        self.acc._payloads[i] = None
        self._held -= _nbytes(stored)
        g = p.grad
        layout = self._layout[i]
        total = self.codec.decode(stored, _local(p).shape, torch.float32)
        if scale is not None:
            total.mul_(scale)
        if g is not None:
            with torch.no_grad():
                _local(g).add_(total.to(g.dtype))
            return
        total = total.to(p.dtype)
        if layout is not None:
            from torch.distributed.tensor import DTensor

            mesh, placements, full_shape, stride = layout
            p.grad = DTensor.from_local(total, mesh, placements, shape=full_shape, stride=stride)
        else:
            p.grad = total

    def finish(self, scale: float | None = None) -> None:
        """Write the dequantized sum into ``p.grad`` (added to a ``p.grad`` that is there) and empty the
        buffer. ``scale`` multiplies only what comes from the buffer (see the module docstring)."""
        for i, p in enumerate(self.acc.params):
            self._add_stored_into(i, p, scale)
        self.acc.micro_batches = 0
        self.last_peak_bytes, self.peak_bytes = self.peak_bytes, 0

    def held_bytes(self) -> int:
        """Bytes the buffer holds now, measured from its payload tensors. (``peak_bytes``: the most held
        since the last :meth:`finish`; ``last_peak_bytes``: that of the step the last ``finish`` ended.
        With DDP the buffer is emptied inside the synchronizing backward, so read the peak.)"""
        return sum(_nbytes(t) for t in self.acc._payloads if t is not None)

    def fp32_bytes(self) -> int:
        """Bytes the same gradients would take as fp32 tensors on this rank (local shards for DTensors)."""
        return sum(_local(p).numel() * 4 for p in self.acc.params)

    def remove(self) -> None:
        """Remove the hooks (the buffer is kept until :meth:`finish`)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def accumulate_in_8bit(module: nn.Module, bits: int = 8, block: int = 256,
                       codec: str | Codec | None = None) -> GradAccumHandle:
    """Keep ``module``'s gradients in a block-wise ``bits``-bit buffer across micro-batches (AGoQ).

    Hooks every parameter that requires grad: after each micro-batch's gradient is accumulated
    into ``p.grad`` it is folded into the buffer and ``p.grad`` is freed. Call
    :meth:`GradAccumHandle.finish` before the optimizer step (and before a data-parallel
    reduction that runs after backward). ``module`` may be a plain module, a
    ``DistributedDataParallel`` (micro-batches but the last under ``no_sync()``) or an FSDP2
    module. ``codec`` overrides ``bits``/``block`` (``"fp32"`` is exact).
    """
    return GradAccumHandle(module, codec if codec is not None else f"blockwise:bits={bits},block={block}")
