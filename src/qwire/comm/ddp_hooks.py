"""QuanGrad: a DDP communication hook with 8-bit block-wise two-shot all-reduce.

Per gradient bucket (AGoQ, arXiv 2605.00539)::

    encode 8-bit (block 256, fp32 absmax per block) each of the world shards
    -> all-to-all of shard payloads -> decode and sum in fp32
    -> re-encode the reduced shard -> all-gather -> decode -> / world

Built on :func:`qwire.comm.collectives.all_reduce_future`, so it runs on gloo and
NCCL, returns bit-identical gradients on every rank, and a bucket whose size does
not divide by the world size or the block is zero-padded (the padding is never
sent as fp32 and never reaches the gradients). Usage is the one of torch's own
hooks::

    state = QuanGradState(process_group=None, codec="blockwise8:block=256")
    ddp_model.register_comm_hook(state, quangrad_hook)
    ...
    print(state.counters())        # wire bytes sent by this rank, vs an fp32 ring all-reduce

Error feedback (``error_feedback=True``; not in the paper): each rank keeps,
per bucket, what quantization lost -- the first-stage error of its own shards
and the second-stage error of the shard it reduced -- and adds it to the next
step's bucket. The first-stage error is that of the payloads actually sent
(decoded locally, not encoded a second time: exact under stochastic rounding).
It costs one fp32 copy of the gradients per rank and one extra local decode
per shard (world per bucket).
"""

from typing import Any

import torch
import torch.distributed as dist

from qwire.codecs import Codec, get_codec

from . import collectives
from .collectives import all_gather, all_reduce_future, check_same_codec, reduce_scatter, wire_bytes

__all__ = ["TORCH_HOOKS", "QuanGradState", "allreduce_gradients", "quangrad_hook", "torch_fp16_hook"]


class QuanGradState:
    """State of :func:`quangrad_hook`: the group, the codec, error feedback, and byte counters.

    Args:
        process_group: group to reduce over (None: the default group).
        codec: codec or spec string; ``"blockwise8:block=256"`` is QuanGrad, ``"fp32"`` is exact.
        error_feedback: keep each bucket's quantization error and add it back next step.
        background: run the collectives on qwire's ordered background thread (overlapping
            the rest of backward) instead of inline in the hook.
    """

    def __init__(self, process_group: Any = None, codec: str | Codec = "blockwise8:block=256",
                 error_feedback: bool = False, background: bool = True) -> None:
        self.process_group = process_group
        self.codec = get_codec(codec)
        self.error_feedback = bool(error_feedback)
        self.background = bool(background)
        self.residuals: dict[int, torch.Tensor] = {}
        self.peers_checked = False
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the byte and call counters."""
        self.wire_bytes = 0
        self.fp32_ring_bytes = 0
        self.elements = 0
        self.buckets = 0
        self.steps = 0

    def counters(self) -> dict[str, float]:
        """Bytes this rank sent through the hook and what an fp32 ring all-reduce would have sent."""
        ratio = self.fp32_ring_bytes / self.wire_bytes if self.wire_bytes else 0.0
        return {"wire_bytes": self.wire_bytes, "fp32_ring_bytes": self.fp32_ring_bytes,
                "compression": ratio, "elements": self.elements, "buckets": self.buckets,
                "steps": self.steps, "codec": self.codec.spec()}

    def residual_bytes(self) -> int:
        """Memory held by the error-feedback residuals."""
        return sum(r.numel() * r.element_size() for r in self.residuals.values())

    def check_peers(self, buf: torch.Tensor) -> None:
        """Once, at the first bucket: every rank of the group must reduce it with the same codec and size (a
        rank with another codec or model would otherwise end in gloo aborting the process, or, on NCCL, in
        garbled gradients). Collective; raises :class:`~qwire.codecs.CodecError` naming the ranks."""
        if self.peers_checked:
            return
        check_same_codec(self.codec, self.process_group, shape=buf.shape, dtype=buf.dtype,
                         what="the data-parallel gradient all-reduce (its first bucket)",
                         fix="Give every rank the same codec and the same model.")
        self.peers_checked = True

    def _count(self, buf: torch.Tensor, world: int) -> None:
        self.wire_bytes += wire_bytes("all_reduce", buf.shape, buf.dtype, self.codec, world)["bytes_total"]
        self.fp32_ring_bytes += 2 * (world - 1) * (-(-buf.numel() // world)) * 4
        self.elements += buf.numel()
        self.buckets += 1


def _local_roundtrip(x: torch.Tensor, codec: Codec, world: int) -> torch.Tensor:
    """What this rank's first stage delivers of ``x``: decode(encode(shard)) shard by shard, as sent."""
    n = x.numel()
    k = -(-n // world)
    flat = x.reshape(-1)
    if world * k - n:
        flat = torch.cat([flat, flat.new_zeros(world * k - n)])
    shards = flat.view(world, k)
    out = torch.stack([codec.decode(codec.encode(shards[r]), (k,), x.dtype) for r in range(world)])
    return out.reshape(-1)[:n]


def _all_reduce_ef(x: torch.Tensor, codec: Codec, group: Any, world: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Two-shot sum via reduce-scatter + all-gather; also returns the new residual (fp32)."""
    n = x.numel()
    k = -(-n // world)
    sent = torch.empty(world, k, dtype=x.dtype, device=x.device)
    # fp32 sum of the decoded shards; `sent`: what this rank's payloads decode to (encoded once)
    shard = reduce_scatter(x, codec, group, op="sum", sent=sent)
    residual = x - sent.view(-1)[:n].view(x.shape)  # first-stage error of what this rank sent
    gathered = all_gather(shard, codec, group)  # [world, k]; row `rank` is decode(encode(shard))
    lo, hi = rank * k, min((rank + 1) * k, n)
    if hi > lo:
        residual[lo:hi] += (shard - gathered[rank])[: hi - lo]  # second-stage error, owned by this rank
    total = gathered.reshape(-1)[:n]
    return total / world, residual


def quangrad_hook(state: QuanGradState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compressed two-shot all-reduce of the bucket, averaged over the group.

    Register with ``ddp_model.register_comm_hook(QuanGradState(...), quangrad_hook)``.
    """
    group = state.process_group
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    if not state.peers_checked:  # in the order of the group's other collectives, and before this bucket's
        if state.background:
            collectives.submit_ordered(lambda: state.check_peers(buf)).wait()
        else:
            state.check_peers(buf)
    state._count(buf, world)
    if bucket.is_last():
        state.steps += 1

    def write_back(fut: torch.futures.Future) -> torch.Tensor:
        buf.copy_(fut.value())
        return buf

    if not state.error_feedback:  # the mean is decoded straight into the bucket
        return all_reduce_future(buf, state.codec, group, op="mean", background=state.background,
                                 out=buf).then(lambda fut: fut.value())

    rank = dist.get_rank(group)
    idx = bucket.index()
    x = buf.detach().to(torch.float32, copy=True)
    r = state.residuals.get(idx)
    if r is not None and r.shape == x.shape:  # DDP rebuilds its buckets after the first step
        x += r
    codec = state.codec

    def run() -> torch.Tensor:
        mean, residual = _all_reduce_ef(x, codec, group, world, rank)
        state.residuals[idx] = residual
        return mean.to(buf.dtype)

    if state.background:
        return collectives.submit_ordered(run).then(write_back)
    fut: torch.futures.Future = torch.futures.Future()
    try:
        fut.set_result(run())
    except Exception as e:
        fut.set_exception(e)
    return fut.then(write_back)


def allreduce_gradients(params: list[torch.nn.Parameter], state: QuanGradState,
                        bucket_bytes: int = 25 * 1024 * 1024) -> float:
    """Average the gradients of ``params`` over ``state.process_group`` with the QuanGrad all-reduce,
    after backward (for modules that are not wrapped in DDP, e.g. tensor-parallel stages whose
    parameters are DTensors: their local shards are reduced, so the group must hold the ranks with the
    same tensor-parallel coordinate).

    Gradients are packed into fp32 buckets of about ``bucket_bytes`` in parameter order, every bucket
    is reduced with the same two-shot collective as :func:`quangrad_hook`, and the averages are written
    back. A parameter without a gradient contributes zeros (so every rank sends the same buckets).
    Returns the seconds spent (encode, communication, decode).
    """
    import time

    t0 = time.perf_counter()
    group = state.process_group
    world = dist.get_world_size(group)
    # (has a gradient, the local gradient tensor) per parameter, in parameter order
    grads: list[tuple[bool, torch.Tensor]] = []
    for p in params:
        g = p.grad
        if g is None:
            grads.append((False, torch.zeros_like(p.to_local() if hasattr(p, "to_local") else p)))
        else:
            grads.append((True, g.to_local() if hasattr(g, "to_local") else g))
    buckets: list[list[tuple[bool, torch.Tensor]]] = [[]]
    size = 0
    for item in grads:
        if size >= bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += item[1].numel() * 4
    for idx, bucket in enumerate(b for b in buckets if b):
        buf = torch.cat([g.reshape(-1).to(torch.float32) for _, g in bucket])
        state.check_peers(buf)
        state._count(buf, world)
        if state.error_feedback:  # residuals keyed by the bucket's position, the same every step
            r = state.residuals.get(idx)
            if r is not None and r.shape == buf.shape:
                buf += r
            mean, state.residuals[idx] = _all_reduce_ef(buf, state.codec, group, world, dist.get_rank(group))
        else:
            mean = all_reduce_future(buf, state.codec, group, op="mean", background=False, out=buf).wait()
        off = 0
        for has_grad, g in bucket:
            if has_grad:
                g.copy_(mean[off: off + g.numel()].view_as(g).to(g.dtype))
            off += g.numel()
    state.steps += 1
    return time.perf_counter() - t0


def torch_fp16_hook(state: QuanGradState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's own ``fp16_compress_hook`` (cast to fp16, all-reduce summing in fp16, cast back), as a
    reference to compare QuanGrad with; only ``state.process_group`` is used.

    Its all-reduce bypasses qwire's collectives, so its bytes are counted here as what a ring all-reduce of
    the fp16 buffer hands to the transport per rank, ``2 (world - 1) / world`` times the buffer: the same
    convention as QuanGrad's all-to-all + all-gather, whose payloads are counted as they are sent.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    group = state.process_group
    world = dist.get_world_size(group)
    collectives._count_sent(group, 2 * (world - 1) * bucket.buffer().numel() * 2 // world)
    return fp16_compress_hook(group, bucket)


# ``--dp-codec`` names that select one of torch's own DDP hooks instead of QuanGrad with a qwire codec
TORCH_HOOKS = {"torch-fp16": torch_fp16_hook}
