"""Data parallelism for one pipeline stage, with QuanGrad's compressed gradient all-reduce.

``apply_dp`` is the data-parallel counterpart of :func:`qwire.parallel.tp.apply_tp`: it decides how the
stage's gradients are averaged over its data-parallel group, in one of two ways:

* a plain stage: ``DistributedDataParallel`` with :func:`qwire.comm.ddp_hooks.quangrad_hook` as its
  communication hook, so buckets are reduced while backward still runs (:meth:`DataParallel.wrap` is
  handed to the pipeline stage builder, which wraps the module it runs);
* a tensor-parallel stage (DTensor parameters, which DDP cannot take): the local gradient shards are
  reduced after backward, bucket by bucket, with the same collective (:meth:`DataParallel.sync`).

Either way the collectives run on the data-parallel process group, whose payload bytes
:func:`qwire.comm.collectives.sent_bytes` counts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from qwire.codecs import Codec
from qwire.comm.ddp_hooks import TORCH_HOOKS, QuanGradState, allreduce_gradients, quangrad_hook


class DataParallel:
    """How one stage's gradients are averaged over its data-parallel replicas."""

    def __init__(self, group: Any, codec: str | Codec, after_backward: bool) -> None:
        self.group = group
        torch_hook = isinstance(codec, str) and codec in TORCH_HOOKS
        self.hook = TORCH_HOOKS[codec] if torch_hook else quangrad_hook
        if torch_hook and after_backward:
            raise ValueError(f"--dp-codec {codec} is one of PyTorch's DDP hooks, which need a DDP module; with "
                             "--tp the gradients are reduced after backward: name a qwire codec (e.g. fp16)")
        self.state = QuanGradState(process_group=group, codec="fp16" if torch_hook else codec)
        self.after_backward = after_backward

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module the pipeline stage should run: DDP with the QuanGrad hook (or the module itself
        when gradients are reduced after backward)."""
        if self.after_backward:
            return module
        ddp = DistributedDataParallel(module, process_group=self.group)
        ddp.register_comm_hook(self.state, self.hook)
        return ddp

    def sync(self, params: list[torch.nn.Parameter]) -> float:
        """After backward: average the gradients over the replicas if the hook did not (tensor-parallel
        stages). Returns the seconds it took (0.0 when DDP's hook already did it during backward)."""
        return allreduce_gradients(params, self.state) if self.after_backward else 0.0


def apply_dp(group: Any, codec: str | Codec, tensor_parallel: bool) -> DataParallel:
    """Data parallelism over ``group`` with gradients all-reduced through ``codec`` (QuanGrad's recipe:
    encode, all-to-all of shard payloads, decode and sum in fp32, all-gather of the re-encoded sums), or
    ``codec="torch-fp16"``: PyTorch's own ``fp16_compress_hook``, a reference (plain DDP stages only).
    ``tensor_parallel``: the stage's parameters are DTensors, so gradients are reduced after backward.
    ``codec`` may be a codec object: an :class:`~qwire.codecs.auto.Auto` is used as it is, so that its
    controller (:class:`qwire.parallel.autotune.CollectiveAutotune`) switches every bucket's codec at once."""
    return DataParallel(group, codec, after_backward=tensor_parallel)
