"""Sharded data parallelism (FSDP2's ``fully_shard``) with qwire's compressed collectives.

``apply_fsdp`` is the sharded counterpart of :func:`qwire.parallel.dp.apply_dp`, written the way
torchtitan applies FSDP: ``fully_shard`` on every decoder block, then on the root module, and the
model itself is left unchanged. What crosses the data-parallel group goes through the seam FSDP2
offers for it, ``FSDPModule.set_custom_reduce_scatter`` / ``set_custom_all_gather``::

    gradients   (reduce-scatter, QuanGrad's recipe)  encode each destination shard with grad_codec ->
                all-to-all of the shard payloads -> decode and sum in fp32 in rank order
    parameters  (all-gather, ZeRO++ qwZ's idea)      encode this rank's shard with param_codec ->
                all-gather of the payloads -> decode every rank's shard (this rank's own too)

Both are :func:`qwire.comm.collectives.reduce_scatter` / :func:`~qwire.comm.collectives.all_gather`,
so :func:`~qwire.comm.collectives.sent_bytes` of the data-parallel group counts their payload bytes,
and :func:`fsdp_sent_bytes` splits them by collective.

What stays exact
----------------
* The sharded parameters (the master weights the optimizer updates) are never encoded: only the
  all-gathered copy that forward and backward compute with is. FSDP2 copies the shards into the
  all-gather buffer before the collective, so decoding into it leaves the shards untouched.
* Gradients are never added in a compressed format: every rank's payload is decoded and the sum
  is taken in fp32 in rank order, so it is deterministic and the same on every rank.
* With ``grad_codec="fp32"`` and ``param_codec=None`` (fp32 parameters) the step is plain FSDP2's,
  to fp32 rounding (bit for bit with two ranks, where the sum has one order).

Limits
------
* One data-parallel dimension: a 1-D ``DeviceMesh`` or a process group (HSDP's replicate
  all-reduce would be FSDP's own, uncompressed: refused rather than half-compressed).
* FSDP hands the collectives one flat buffer per FSDP module and destination rank (the shards of
  all the module's parameters, concatenated). A lossy codec encodes each parameter's piece of it
  on its own (the sizes come from the module's FSDP parameter group), so a block-wise scale never
  spans a norm weight (~1) and a linear weight (~0.02). When the buffer does not match those
  sizes (a backward in which some parameters got no gradient) the buffer is encoded as a whole.
* Only ``SUM`` and ``AVG`` reductions (FSDP2's defaults); a custom ``set_gradient_divide_factor``
  (``PREMUL_SUM``) raises.
* ``param_codec=None`` sends the parameters losslessly in their own dtype (``fp32``/``bf16``/``fp16``
  codec, i.e. the raw bytes, counted like the rest); parameters of mixed dtypes fall back to FSDP2's
  own all-gather, whose bytes are not counted.
* Stateful codecs (AQ-SGD) cannot be used: the collectives carry no sample identities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from qwire.codecs import Codec, get_codec
from qwire.codecs.base import as_shape, numel
from qwire.comm.collectives import all_gather, all_gather_into, check_same_codec, reduce_scatter, sent_bytes

__all__ = [
    "CompressedAllGather",
    "CompressedReduceScatter",
    "FSDPError",
    "apply_fsdp",
    "decoder_blocks",
    "fsdp_sent_bytes",
]

# Where the decoder blocks live: HF Llama/Qwen2/Qwen3/Mistral (``model.layers``), GPT-2 (``transformer.h``) and
# qwire's pipeline stages (the same names, as a ModuleDict), then common names of plain models.
BLOCK_PATHS = ("model.layers", "transformer.h", "layers", "h", "blocks")

_LOSSLESS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class FSDPError(ValueError):
    """``apply_fsdp`` was called with arguments it cannot take (says what to change)."""


def _reduce_op(op: Any) -> str:
    if op in (dist.ReduceOp.SUM, dist.ReduceOp.RedOpType.SUM):
        return "sum"
    if op in (dist.ReduceOp.AVG, dist.ReduceOp.RedOpType.AVG):
        return "mean"
    raise FSDPError(f"qwire's compressed reduce-scatter takes SUM or AVG, FSDP asked for {op!r}; "
                    "leave FSDP's gradient divide factor at its default")


class _Segmented(Codec):
    """``inner`` applied to consecutive pieces of a flat tensor (one per parameter), payloads concatenated.

    A tensor whose size is not ``sum(sizes)`` is encoded as a whole. Every rank builds the same
    sizes from the same module, so payload sizes agree across ranks.
    """

    name = "segmented"

    def __init__(self, inner: Codec, sizes: Sequence[int]) -> None:  # noqa: D107 - no Codec params of its own
        self.inner, self.sizes = inner, [int(s) for s in sizes if int(s) > 0]
        self.impl, self.config = inner.impl, {}

    def _fits(self, shape: Sequence[int]) -> bool:
        return len(self.sizes) > 1 and numel(as_shape(shape)) == sum(self.sizes)

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        if not self._fits(shape):
            return self.inner.payload_nbytes(shape, dtype)
        return sum(self.inner.payload_nbytes((n,), dtype) for n in self.sizes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fits(x.shape):
            return self.inner.encode(x)
        return torch.cat([self.inner.encode(piece) for piece in x.reshape(-1).split(self.sizes)])

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if not self._fits(shape):
            return self.inner.decode(payload, shape, dtype)
        lengths = [self.inner.payload_nbytes((n,), dtype) for n in self.sizes]
        pieces = [self.inner.decode(p, (n,), dtype) for p, n in zip(payload.split(lengths), self.sizes)]
        return torch.cat(pieces).reshape(as_shape(shape))

    def spec(self) -> str:
        return self.inner.spec()


def _per_parameter(codec: Codec, module: nn.Module) -> Codec:
    """``codec`` per parameter of an FSDP module (lossless codecs as they are: nothing to gain)."""
    if codec.lossless:
        return codec
    try:  # FSDP2 internals: the module's parameter group and each parameter's padded shard
        groups = module._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
        sizes = [math.prod(fp.padded_sharded_param_size) for g in groups for fp in g.fsdp_params]
    except AttributeError:
        return codec
    return _Segmented(codec, sizes)


class _Counted:
    """Tallies the payload bytes this collective handed to the transport (read from qwire's own counter)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.sent_bytes = 0
        self.calls = 0

    def _run(self, fn: Any) -> Any:
        before = sent_bytes(self.group)
        out = fn()
        self.sent_bytes += sent_bytes(self.group) - before
        self.calls += 1
        return out

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CompressedReduceScatter(_Counted, ReduceScatter):
    """FSDP2 reduce-scatter through :func:`qwire.comm.collectives.reduce_scatter` with ``codec``.

    FSDP hands it the flat gradient buffer ``[world * k]`` (chunk ``r`` goes to rank ``r``) and a
    ``[k]`` output; the collective runs synchronously on the current stream and returns ``None``.
    """

    def __init__(self, codec: str | Codec, group: Any) -> None:
        super().__init__(group)
        self.codec = get_codec(codec)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        how = _reduce_op(op)
        out = self._run(lambda: reduce_scatter(input_tensor, self.codec, self.group, op=how))
        output_tensor.copy_(out)
        return None


class CompressedAllGather(_Counted, AllGather):
    """FSDP2 all-gather through :func:`qwire.comm.collectives.all_gather` with ``codec``.

    FSDP hands it the ``[world * n]`` output buffer and this rank's ``[n]`` input (a view into the
    output). Every rank's slot, this rank's own included, is overwritten with the decoded payload,
    so all ranks compute with the same unsharded parameters. ``codec=None``: lossless in the
    buffer's own dtype. Runs synchronously and returns ``None`` (FSDP then treats it as done).
    """

    def __init__(self, codec: str | Codec | None, group: Any) -> None:
        super().__init__(group)
        self.codec = None if codec is None else get_codec(codec)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        codec = self.codec
        if codec is None:
            name = _LOSSLESS.get(input_tensor.dtype)
            if name is None:  # mixed parameter dtypes: FSDP packs bytes; send them as they are
                all_gather_into(output_tensor, input_tensor, group)  # staged through the host on gloo
                return None
            codec = get_codec(name)
        elif not input_tensor.dtype.is_floating_point:
            raise FSDPError(f"param_codec {codec.spec()!r} needs floating-point parameters of one dtype; this "
                            f"FSDP module all-gathers {input_tensor.dtype} (parameters of mixed dtypes): "
                            "use param_codec=None or give every parameter the same dtype")
        world = output_tensor.numel() // max(input_tensor.numel(), 1)
        gathered = self._run(lambda: all_gather(input_tensor, codec, self.group))
        output_tensor.view(world, -1).copy_(gathered.view(world, -1))
        return None


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of an HF Llama/Qwen2/Qwen3/Mistral/GPT-2 model or a qwire pipeline stage, in order: the
    children of the first ModuleList/ModuleDict whose name is, or ends with, one of
    :data:`BLOCK_PATHS` (so wrappers such as a compressed stage module are looked through);
    empty when there is none."""
    named = dict(model.named_modules())
    for path in BLOCK_PATHS:
        for name, found in named.items():
            if (name == path or name.endswith("." + path)) and isinstance(found, (nn.ModuleList, nn.ModuleDict)):
                return list(found.children())
    return []


def _mesh(mesh_or_group: Any, model: nn.Module) -> tuple[DeviceMesh, Any]:
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise FSDPError(f"apply_fsdp takes a 1-D DeviceMesh (one data-parallel dimension), got "
                            f"{mesh_or_group.ndim} dimensions {mesh_or_group.mesh_dim_names}; pass mesh['dp'] "
                            "(HSDP's replicate all-reduce would go uncompressed)")
        return mesh_or_group, mesh_or_group.get_group()
    if not dist.is_available() or not dist.is_initialized():
        raise FSDPError("torch.distributed is not initialized: call dist.init_process_group(backend, "
                        "timeout=timedelta(seconds=...)) on every rank before apply_fsdp")
    group = mesh_or_group if mesh_or_group is not None else dist.group.WORLD
    param = next(model.parameters(), None)
    device_type = param.device.type if param is not None and param.device.type != "meta" else (
        "cuda" if dist.get_backend(group) == "nccl" else "cpu")
    return DeviceMesh.from_group(group, device_type), group


def apply_fsdp(model: nn.Module, mesh_or_group: Any = None, grad_codec: str | Codec | None = "blockwise8:block=256",
               param_codec: str | Codec | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` over the data-parallel group with FSDP2, with compressed collectives.

    ``fully_shard`` is applied to each decoder block (:func:`decoder_blocks`), then to ``model``
    (which keeps the rest: embeddings, final norm, LM head). Gradients are reduce-scattered with
    ``grad_codec`` (``None`` or ``"fp32"``: exact), parameters all-gathered with ``param_codec``
    (``None``: uncompressed, in the parameters' dtype). ``mesh_or_group`` is a 1-D ``DeviceMesh``,
    a process group (create it with a timeout: every collective runs under it) or ``None`` for the
    default group.

    Collective: every rank of the group must call it, with the same codecs; a rank whose codec
    differs makes every rank raise :class:`~qwire.codecs.CodecError` here, before any training.
    Returns ``model``, now an ``FSDPModule`` (its parameters are sharded DTensors: build the
    optimizer after this call).
    """
    mesh, group = _mesh(mesh_or_group, model)
    dtypes = {p.dtype for p in model.parameters()}
    lossless = _LOSSLESS.get(next(iter(dtypes))) if len(dtypes) == 1 else None
    grad = get_codec(grad_codec if grad_codec is not None else (lossless or "fp32"))
    param = get_codec(param_codec) if param_codec is not None else None
    for role, codec in (("grad_codec", grad), ("param_codec", param)):
        if codec is not None and codec.stateful:
            raise FSDPError(f"{role} {codec.spec()!r} is stateful (it needs sample identities); "
                            "use a stateless codec such as 'blockwise8' or 'fp8'")
    # start-up check: every rank must use the same codecs (a mismatch would garble or hang the collectives)
    check_same_codec(grad, group)
    if param is not None or lossless:
        check_same_codec(param if param is not None else lossless, group)
    else:  # FSDP's own all-gather of mixed-dtype parameters, as raw bytes
        check_same_codec("fp32", group, dtype=torch.uint8)

    modules = [*decoder_blocks(model), model]
    _check_one_dtype_per_module(model, modules)
    for module in modules:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    comms: list[_Counted] = []
    for module in modules:  # one pair per FSDP module: its codecs know its parameters' sizes
        assert isinstance(module, FSDPModule)
        comms.append(CompressedReduceScatter(_per_parameter(grad, module), group))
        module.set_custom_reduce_scatter(comms[-1])
        if param is not None or lossless:
            comms.append(CompressedAllGather(_per_parameter(param, module) if param is not None else None, group))
            module.set_custom_all_gather(comms[-1])
    model._qwire_fsdp_comms = comms  # type: ignore[assignment]
    return model


def _check_one_dtype_per_module(model: nn.Module, modules: list[nn.Module]) -> None:
    """FSDP2 shards the parameters each sharded module owns (those no inner sharded module owns) as one group,
    which needs one dtype; FSDP's own message was an AssertionError at the first forward."""
    names = {id(m): n or type(model).__name__ for n, m in model.named_modules()}
    taken: set[int] = set()
    for module in modules:
        own = [(n, p) for n, p in module.named_parameters() if id(p) not in taken]
        taken.update(id(p) for _, p in own)
        dtypes = sorted({str(p.dtype).replace("torch.", "") for _, p in own})
        if len(dtypes) > 1:
            first = {d: next(n for n, p in own if str(p.dtype).replace("torch.", "") == d) for d in dtypes}
            raise FSDPError(f"FSDP shards the parameters of {names[id(module)]!r} as one group, which needs one "
                            f"dtype, but they are {' and '.join(f'{d} ({first[d]}, ...)' for d in dtypes)}: give them "
                            "one dtype, or put the parameters of the other dtype in a module sharded on its own "
                            "(apply_fsdp shards each decoder block, then the root)")


def fsdp_sent_bytes(model: nn.Module) -> dict[str, int]:
    """Payload bytes this rank has sent through ``apply_fsdp``'s collectives so far:
    ``{"reduce_scatter": gradients, "all_gather": parameters}`` (their sum is the data-parallel
    group's :func:`~qwire.comm.collectives.sent_bytes` when nothing else runs on that group)."""
    comms = getattr(model, "_qwire_fsdp_comms", None)
    if comms is None:
        raise FSDPError("this module was not sharded by qwire.parallel.fsdp.apply_fsdp")
    return {"reduce_scatter": sum(c.sent_bytes for c in comms if isinstance(c, CompressedReduceScatter)),
            "all_gather": sum(c.sent_bytes for c in comms if isinstance(c, CompressedAllGather))}
