"""Compressed tensor-parallel styles for ``torch.distributed.tensor.parallel.parallelize_module``.

Drop-in counterparts of PyTorch's styles whose collectives go through qwire's
compressed collectives (:mod:`qwire.comm.collectives`), in forward *and*
backward; the model is not changed::

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from qwire.parallel.tp import CompressedColwiseParallel, CompressedRowwiseParallel, apply_tp

    tp_mesh = init_device_mesh("cpu", (2,))           # "cuda" with NCCL
    parallelize_module(model, tp_mesh, {
        "model.layers.0.self_attn.q_proj": CompressedColwiseParallel(codec="fp8"),
        "model.layers.0.self_attn.o_proj": CompressedRowwiseParallel(codec="fp8"),
        ...
    })
    # or, for a Hugging Face Llama / Qwen2 / Qwen3 / Mistral causal LM, torchtitan style:
    apply_tp(model, tp_mesh, codec="fp8")                          # plain TP
    apply_tp(model, tp_mesh, codec="fp8", sequence_parallel=True)  # TP + sequence parallelism

=====================================  ======================================  ==================================
style                                  forward                                 backward
=====================================  ======================================  ==================================
CompressedColwiseParallel (Replicate)  none                                    all-reduce of the input gradient
CompressedColwiseParallel (Shard(1))   all-gather of the input                 reduce-scatter of the input grad
CompressedRowwiseParallel (Replicate)  all-reduce of the output                none
CompressedRowwiseParallel (Shard(1))   reduce-scatter of the output            all-gather of the output grad
CompressedPrepareModuleInput           the colwise input collectives, once     (for q/k/v or gate/up together)
CompressedSequenceParallel             none                                    all-reduce of the weight gradients
=====================================  ======================================  ==================================

How it works (see ``docs/tp.md``): parameters are sharded exactly like
PyTorch's styles do (the same ``_partition_*_fn``, DTensor parameters), and
the module computes with DTensors, but activations enter and leave each module
as *local* tensors through qwire's autograd operators instead of DTensor
redistributions:

* colwise input: ``copy_to_tp_region`` (or ``gather_from_sp_region``), then
  ``DTensor.from_local(x, mesh, [Replicate()], grad_placements=[Partial()])``:
  the input gradient leaves DTensor as a local partial sum and is all-reduced
  (reduce-scattered) by qwire, compressed, not by DTensor;
* rowwise output: the ``Partial`` DTensor's local summand is taken with
  ``to_local(grad_placements=[Replicate()])`` and all-reduced (reduce-scattered)
  by ``reduce_from_tp_region`` (``reduce_scatter_to_sp_region``).

No DTensor redistribution (hence no uncompressed collective) happens in forward
or backward. Compressed all-reduce results are bit-identical on every rank, so
replicated parts of the model (embeddings, norms, head) stay in lockstep with
no extra synchronization; :func:`replicate_remaining` (called by
:func:`apply_tp`) turns their parameters into ``Replicate`` DTensors so that every
parameter is a DTensor (foreach optimizers and ``clip_grad_norm_`` need that).
Checkpoints: :func:`full_state_dict` / :func:`load_full_state_dict`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from qwire.codecs import Codec, CodecError, get_codec
from qwire.codecs.base import FLOAT_DTYPES
from qwire.comm.collectives import (
    all_reduce,
    broadcast,
    check_same_codec,
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_tp_region,
)
from qwire.models.split import LLAMA_LIKE

__all__ = [
    "CompressedColwiseParallel",
    "CompressedPrepareModuleInput",
    "CompressedRowwiseParallel",
    "CompressedSequenceParallel",
    "ReplicateParallel",
    "TPConfigError",
    "apply_tp",
    "full_state_dict",
    "llama_tp_plan",
    "load_full_state_dict",
    "replicate_remaining",
]

CodecLike = Codec | str


class TPConfigError(ValueError):
    """A tensor-parallel configuration that cannot work (the message says what to change)."""


def _codecs(codec: CodecLike, grad_codec: CodecLike | None) -> tuple[Codec, Codec]:
    c = get_codec(codec)
    return c, (get_codec(grad_codec) if grad_codec is not None else c)


# DTensor.from_local's ``grad_placements`` (torch 2.12 on): the placements its input's gradient is handed back
# in. Without it (torch 2.11, as on many GPU images) from_local's backward would redistribute a Partial
# gradient to Replicate, an uncompressed all-reduce; _FromLocal does what the keyword does.
_FROM_LOCAL_GRAD = "grad_placements" in inspect.signature(DTensor.from_local).parameters


class _FromLocal(torch.autograd.Function):
    """``DTensor.from_local(x, mesh, placements)`` whose backward returns the gradient laid out as
    ``grad_placements``, locally (what the ``grad_placements`` keyword does where torch has it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh, placements: tuple, grad_placements: tuple) -> DTensor:
        ctx.mesh, ctx.grad_placements = mesh, tuple(grad_placements)
        return DTensor.from_local(x, mesh, placements, run_check=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if isinstance(grad, DTensor):
            if tuple(grad.placements) != ctx.grad_placements:
                grad = grad.redistribute(ctx.mesh, ctx.grad_placements)
            grad = grad.to_local()
        return grad, None, None, None


def from_local(x: torch.Tensor, mesh: DeviceMesh, placements: tuple, grad_placements: tuple) -> DTensor:
    """``DTensor.from_local(x, mesh, placements, run_check=False, grad_placements=grad_placements)`` on every
    torch qwire supports."""
    if _FROM_LOCAL_GRAD:
        return DTensor.from_local(x, mesh, placements, run_check=False, grad_placements=grad_placements)
    return _FromLocal.apply(x, mesh, tuple(placements), tuple(grad_placements))


def _norm(p: Placement, ndim: int) -> Placement:
    """Shard(-1) -> Shard(ndim - 1), so placements compare equal to what DTensor produces."""
    if isinstance(p, Shard) and p.dim < 0:
        return Shard(p.dim + ndim)
    return p


def _enter_region(x: torch.Tensor, src: Placement, mesh: DeviceMesh, codec: Codec, grad_codec: Codec) -> DTensor:
    """Local tensor laid out as ``src`` -> Replicate DTensor whose (partial) gradient qwire reduces, compressed."""
    group = mesh.get_group()
    if x.is_floating_point():
        src = _norm(src, x.dim())
        if src.is_replicate():
            x = copy_to_tp_region(x, grad_codec, group)
        elif src.is_shard():
            x = gather_from_sp_region(x, src.dim, codec, group, grad_codec)
        else:
            raise TPConfigError(f"cannot take an input laid out as {src}; use Replicate() or Shard(dim)")
        return from_local(x, mesh, (Replicate(),), (Partial(),))
    if not src.is_replicate():  # integer inputs (token ids) carry no gradient and are not communicated
        raise TPConfigError(f"integer inputs must be replicated, got input layout {src}")
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)


class CompressedColwiseParallel(ColwiseParallel):
    """:class:`~torch.distributed.tensor.parallel.ColwiseParallel` with compressed collectives.

    Args:
        codec: codec (or spec string) for forward traffic (the all-gather of a
            sequence-sharded input); default ``"fp8"``.
        grad_codec: codec for backward traffic (the all-reduce / reduce-scatter of
            the input gradient); default: ``codec``.
        input_layouts: ``Replicate()`` (default) or ``Shard(dim)`` (sequence parallelism).
        output_layouts: ``Shard(-1)`` (default) or ``Replicate()`` (compressed all-gather of
            the output; backward keeps the local chunk).
        use_local_output: return a local tensor (default) or a DTensor.

    An input that is already a ``Replicate`` DTensor (made by
    :class:`CompressedPrepareModuleInput`) is used as is.
    """

    def __init__(self, *, codec: CodecLike = "fp8", grad_codec: CodecLike | None = None,
                 input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self.codec, self.grad_codec = _codecs(codec, grad_codec)
        out = self.output_layouts[0]
        if not (out.is_replicate() or (isinstance(out, Shard) and out.dim == -1)):
            raise TPConfigError(
                f"CompressedColwiseParallel: output_layouts must be Shard(-1) or Replicate(), got {out}")

    def _input_fn(self, mod: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        x, rest = inputs[0], inputs[1:]
        if isinstance(x, DTensor):
            if x.placements != (Replicate(),):
                raise TPConfigError(f"CompressedColwiseParallel got a DTensor input laid out as {x.placements}; "
                                    "pass a local tensor (or a Replicate DTensor)")
            return (x, *rest)
        return (_enter_region(x, self.input_layouts[0], device_mesh, self.codec, self.grad_codec), *rest)

    def _output_fn(self, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
        last = outputs.dim() - 1
        if outputs.placements != (Shard(last),):  # not expected for Linear / Embedding
            raise TPConfigError(f"unexpected colwise output layout {outputs.placements}")
        if self.output_layouts[0].is_replicate():
            local = outputs.to_local()
            full = gather_from_tp_region(local, last, self.codec, device_mesh.get_group())
            return full if self.use_local_output else from_local(full, device_mesh, (Replicate(),), (Replicate(),))
        return outputs.to_local() if self.use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        if isinstance(module, nn.Linear):
            partition_fn = self._partition_linear_fn
        elif isinstance(module, nn.Embedding):
            partition_fn = self._partition_embedding_fn
        else:
            raise TPConfigError(
                f"CompressedColwiseParallel takes nn.Linear or nn.Embedding, got {type(module).__name__}")
        _check_param_dtypes(module, self.codec)
        return distribute_module(module, device_mesh, partition_fn, self._input_fn, self._output_fn)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(codec={self.codec.spec()!r}, grad_codec={self.grad_codec.spec()!r}, "
                f"input_layouts={self.input_layouts}, output_layouts={self.output_layouts})")


class CompressedRowwiseParallel(RowwiseParallel):
    """:class:`~torch.distributed.tensor.parallel.RowwiseParallel` with compressed collectives.

    Args:
        codec: codec for the forward all-reduce (or reduce-scatter) of the output; default ``"fp8"``.
        grad_codec: codec for backward traffic (the all-gather of the output
            gradient with sequence parallelism); default: ``codec``.
        input_layouts: ``Shard(-1)`` (default) for Linear; ``Replicate()`` for Embedding.
        output_layouts: ``Replicate()`` (default: all-reduce) or ``Shard(dim)``
            (sequence parallelism: reduce-scatter along ``dim``).

    The output is always a local tensor (``use_local_output=True``).
    """

    def __init__(self, *, codec: CodecLike = "fp8", grad_codec: CodecLike | None = None,
                 input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        if not use_local_output:
            raise TPConfigError("CompressedRowwiseParallel returns local tensors; use_local_output=False would "
                                "let DTensor redistribute (uncompressed) later")
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=True)
        self.codec, self.grad_codec = _codecs(codec, grad_codec)

    def _input_fn(self, mod: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        x, rest = inputs[0], inputs[1:]
        src = _norm(self.input_layouts[0], x.dim())
        want = _norm(self.desired_input_layouts[0], x.dim())
        if isinstance(x, DTensor):
            if x.placements != (want,):
                raise TPConfigError(f"CompressedRowwiseParallel got a DTensor laid out as {x.placements}, "
                                    f"needs {want}; pass a local tensor")
            return (x, *rest)
        if src != want:
            raise TPConfigError(f"CompressedRowwiseParallel: input_layouts {src} differ from the layout the "
                                f"module computes with ({want}); only {want} is supported")
        return (DTensor.from_local(x, device_mesh, (src,), run_check=False), *rest)

    def _output_fn(self, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
        group = device_mesh.get_group()
        (p,) = outputs.placements
        if p.is_replicate():  # nothing to reduce (not expected for Linear / Embedding)
            local = outputs.to_local()
        elif p.is_partial() and getattr(p, "reduce_op", "sum") == "sum":
            local = outputs.to_local(grad_placements=(Replicate(),))
        else:
            raise TPConfigError(f"unexpected rowwise output layout {outputs.placements}")
        out = _norm(self.output_layouts[0], local.dim())
        if not p.is_partial():
            if out.is_replicate():
                return local
            return scatter_to_tp_region(local, out.dim, self.grad_codec, group)
        if out.is_replicate():
            return reduce_from_tp_region(local, self.codec, group)
        if out.is_shard():
            return reduce_scatter_to_sp_region(local, out.dim, self.codec, group, self.grad_codec)
        raise TPConfigError(f"CompressedRowwiseParallel: output_layouts must be Replicate() or Shard(dim), got {out}")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        if isinstance(module, nn.Linear):
            partition_fn = self._partition_linear_fn
            self.desired_input_layouts = (Shard(-1),)
        elif isinstance(module, nn.Embedding):
            partition_fn = self._partition_embedding_fn
            self.desired_input_layouts = (Replicate(),)
            if self.input_layouts == (Shard(-1),):  # the Linear default makes no sense for token ids
                self.input_layouts = (Replicate(),)
        else:
            raise TPConfigError(
                f"CompressedRowwiseParallel takes nn.Linear or nn.Embedding, got {type(module).__name__}")
        _check_param_dtypes(module, self.codec)
        return distribute_module(module, device_mesh, partition_fn, self._input_fn, self._output_fn)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(codec={self.codec.spec()!r}, grad_codec={self.grad_codec.spec()!r}, "
                f"input_layouts={self.input_layouts}, output_layouts={self.output_layouts})")


class CompressedPrepareModuleInput(ParallelStyle):
    """Lay out one input of a module once, for all the colwise layers inside it (q/k/v, gate/up).

    The input is the first positional argument, or the keyword argument
    ``kwarg`` (default ``"hidden_states"``) when there is none. Transitions:

    * ``Replicate -> Replicate`` (``use_local_output=False``): a Replicate
      DTensor whose partial gradient (summed over q, k and v) is all-reduced once,
      compressed: one backward all-reduce per attention block instead of three.
    * ``Shard(d) -> Replicate`` (``use_local_output=False``): compressed all-gather;
      backward compressed reduce-scatter (entering a TP region with sequence parallelism).
    * ``Shard(d) -> Replicate`` (``use_local_output=True``): compressed all-gather
      into a plain tensor whose gradient is replicated; backward keeps the local
      chunk (leaving sequence parallelism, e.g. before the final norm).
    * ``Replicate -> Shard(d)`` (``use_local_output=True``): keep the local chunk;
      backward compressed all-gather (entering sequence parallelism).
    """

    def __init__(self, *, input_layouts: Placement | None = None, desired_input_layouts: Placement | None = None,
                 use_local_output: bool = False, codec: CodecLike = "fp8", grad_codec: CodecLike | None = None,
                 kwarg: str = "hidden_states") -> None:
        self.src = input_layouts or Replicate()
        self.dst = desired_input_layouts or Replicate()
        self.use_local_output = use_local_output
        self.codec, self.grad_codec = _codecs(codec, grad_codec)
        self.kwarg = kwarg
        ok = ((self.dst.is_replicate() and (self.src.is_replicate() or self.src.is_shard()))
              or (self.dst.is_shard() and self.src.is_replicate() and use_local_output))
        if not ok:
            raise TPConfigError(f"CompressedPrepareModuleInput: unsupported transition {self.src} -> {self.dst} "
                                f"(use_local_output={use_local_output})")

    def _prepare(self, x: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        group = mesh.get_group()
        src, dst = _norm(self.src, x.dim()), _norm(self.dst, x.dim())
        if dst.is_shard():
            return scatter_to_tp_region(x, dst.dim, self.grad_codec, group)
        if not self.use_local_output:
            return _enter_region(x, src, mesh, self.codec, self.grad_codec)
        if src.is_shard():
            return gather_from_tp_region(x, src.dim, self.codec, group)
        return x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (self._prepare(args[0], device_mesh), *args[1:]), kwargs
            if self.kwarg in kwargs:
                kwargs = dict(kwargs)
                kwargs[self.kwarg] = self._prepare(kwargs[self.kwarg], device_mesh)
                return args, kwargs
            raise TPConfigError(f"{type(mod).__name__} was called without positional arguments and without "
                                f"the keyword {self.kwarg!r}; set CompressedPrepareModuleInput(kwarg=...)")

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.src} -> {self.dst}, use_local_output={self.use_local_output}, "
                f"codec={self.codec.spec()!r})")


def _replicate_module(module: nn.Module, mesh: DeviceMesh,
                      converted: dict[int, nn.Parameter] | None = None) -> list[nn.Parameter]:
    """Make ``module``'s own plain parameters Replicate DTensors and let it run on local tensors.

    Inputs are wrapped as Replicate DTensors (no traffic; gradients come back as
    local tensors) and DTensor outputs are unwrapped, so the module sits in the
    local-tensor residual stream like before while every parameter of the model
    is a DTensor (optimizers' foreach paths and ``clip_grad_norm_`` need that).
    ``converted`` maps ``id(plain parameter)`` to its DTensor replacement, so a
    parameter shared by several modules (tied embeddings) stays shared.
    Returns the parameters this call created.
    """
    converted = {} if converted is None else converted
    new, touched = [], False
    for name, p in list(module.named_parameters(recurse=False)):
        if isinstance(p, DTensor):
            continue
        touched = True
        if id(p) not in converted:
            converted[id(p)] = nn.Parameter(DTensor.from_local(p.detach(), mesh, (Replicate(),), run_check=False),
                                            requires_grad=p.requires_grad)
            new.append(converted[id(p)])
        module.register_parameter(name, converted[id(p)])
    if not touched:
        return new

    def wrap(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            return DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
        return t

    def unwrap(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}

    def post(mod: nn.Module, args: tuple, out: Any) -> Any:
        if isinstance(out, (tuple, list)):
            return type(out)(unwrap(o) for o in out)
        return unwrap(out)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post)
    return new


class ReplicateParallel(ParallelStyle):
    """Keep a module replicated (embedding, norms, LM head without sequence parallelism).

    Its parameters become ``Replicate`` DTensors and it computes on the same
    local tensors as before; no communication: with qwire's bit-identical
    collectives every rank computes the same values and the same gradients.
    :func:`apply_tp` applies this to every module the plan leaves out.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_module(module, device_mesh)
        return module


class CompressedSequenceParallel(ParallelStyle):
    """Sequence parallelism for norms (RMSNorm, LayerNorm, Dropout): compute on the local sequence shard.

    Parameters become ``Replicate`` DTensors and the module runs on the local,
    sequence-sharded activation; no forward traffic. Each rank's weight gradient
    covers only its part of the sequence, so a gradient hook all-reduces it with
    ``grad_codec`` (default lossless ``"fp32"``: these tensors are tiny).
    """

    def __init__(self, *, sequence_dim: int = 1, grad_codec: CodecLike = "fp32") -> None:
        self.sequence_dim = sequence_dim
        self.grad_codec = get_codec(grad_codec)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        codec = self.grad_codec

        def reduce(g: torch.Tensor) -> torch.Tensor:
            local = g.to_local() if isinstance(g, DTensor) else g
            out = all_reduce(local.contiguous(), codec, group)
            return DTensor.from_local(out, device_mesh, (Replicate(),), run_check=False) if isinstance(
                g, DTensor) else out

        for p in _replicate_module(module, device_mesh):
            if p.requires_grad:
                p.register_hook(reduce)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_dim={self.sequence_dim}, grad_codec={self.grad_codec.spec()!r})"


# ---------------------------------------------------------------------------------------------
# Hugging Face Llama / Qwen2 / Qwen3 / Mistral

def _check_param_dtypes(module: nn.Module, codec: Codec) -> None:
    for name, p in module.named_parameters():
        if p.is_floating_point() and p.dtype not in FLOAT_DTYPES:
            raise TPConfigError(
                f"parameter {name!r} is {p.dtype}; compressed tensor parallelism (codec {codec.spec()!r}) "
                "takes float32, bfloat16 or float16 models: convert with model.float() or model.bfloat16()"
            )


TP_MODEL_TYPES = LLAMA_LIKE  # the decoders llama_tp_plan splits (the `model_type` of their configs)


def check_tp_divides(cfg: Any, tp_size: int) -> None:
    """Raise TPConfigError unless ``tp_size`` ranks can share the heads and the MLP of a model with config
    ``cfg`` equally (whole heads, equal MLP slices)."""
    checks = [("num_attention_heads", getattr(cfg, "num_attention_heads", None)),
              ("num_key_value_heads", getattr(cfg, "num_key_value_heads", None)
               or getattr(cfg, "num_attention_heads", None)),
              ("intermediate_size", getattr(cfg, "intermediate_size", None))]
    for name, value in checks:
        if isinstance(value, int) and value % tp_size:
            raise TPConfigError(
                f"{name}={value} is not divisible by the tensor-parallel size {tp_size}: each rank must "
                f"hold whole heads / equal MLP slices; choose a TP size dividing {value}"
            )


def _decoder(model: nn.Module) -> tuple[str, nn.Module]:
    """(prefix, module holding .layers) for a *ForCausalLM (``model.layers``) or a bare *Model (``layers``)."""
    # A pipeline stage (qwire.models.split_model) keeps its layers in a ModuleDict keyed by
    # their index in the whole model, so both containers are accepted.
    layer_types = (nn.ModuleList, nn.ModuleDict)
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(getattr(inner, "layers", None), layer_types):
        return "model.", inner
    if isinstance(getattr(model, "layers", None), layer_types):
        return "", model
    raise TPConfigError(f"{type(model).__name__} has no decoder layer list at .model.layers or .layers; "
                        "llama_tp_plan handles Hugging Face Llama-style models (Llama, Qwen2, Qwen3, Mistral)")


def llama_tp_plan(model: nn.Module, codec: CodecLike = "fp8", *, tp_size: int | None = None,
                  grad_codec: CodecLike | None = None, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Tensor-parallel plan for a Hugging Face Llama, Qwen2, Qwen3 or Mistral (e.g. LlamaForCausalLM or LlamaModel).

    q/k/v/gate/up are colwise, o/down rowwise; each attention and MLP block
    lays out its input once (:class:`CompressedPrepareModuleInput`). With
    ``sequence_parallel`` the residual stream between blocks is sharded along the
    sequence (split at the first layer, gathered before the final norm), norms
    use :class:`CompressedSequenceParallel` and o/down reduce-scatter. Embedding,
    final norm and LM head stay replicated. ``tp_size`` (when given) is checked
    against the head counts and the MLP width.
    """
    prefix, dec = _decoder(model)
    cfg = getattr(model, "config", None)
    if tp_size is not None:
        if not isinstance(tp_size, int) or tp_size < 1:
            raise TPConfigError(f"tp_size must be a positive int, got {tp_size!r}")
        if cfg is not None:
            check_tp_divides(cfg, tp_size)
    c, g = _codecs(codec, grad_codec)
    plan: dict[str, ParallelStyle] = {}
    seq = Shard(1)
    n = len(dec.layers)
    for i, (name, layer) in enumerate(dec.layers.named_children()):
        p = f"{prefix}layers.{name}"
        for attr in ("self_attn", "mlp"):
            if not hasattr(layer, attr):
                raise TPConfigError(f"{p} has no .{attr}; llama_tp_plan expects Llama-style decoder layers")
        if sequence_parallel:
            if i == 0:
                plan[p] = CompressedPrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=seq,
                                                       use_local_output=True, codec=c, grad_codec=g)
            plan[f"{p}.input_layernorm"] = CompressedSequenceParallel()
            plan[f"{p}.post_attention_layernorm"] = CompressedSequenceParallel()
        src = seq if sequence_parallel else Replicate()
        out = seq if sequence_parallel else Replicate()
        plan[f"{p}.self_attn"] = CompressedPrepareModuleInput(input_layouts=src, codec=c, grad_codec=g)
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.self_attn.{proj}"] = CompressedColwiseParallel(codec=c, grad_codec=g)
        plan[f"{p}.self_attn.o_proj"] = CompressedRowwiseParallel(codec=c, grad_codec=g, output_layouts=out)
        plan[f"{p}.mlp"] = CompressedPrepareModuleInput(input_layouts=src, codec=c, grad_codec=g)
        for proj in ("gate_proj", "up_proj"):
            plan[f"{p}.mlp.{proj}"] = CompressedColwiseParallel(codec=c, grad_codec=g)
        plan[f"{p}.mlp.down_proj"] = CompressedRowwiseParallel(codec=c, grad_codec=g, output_layouts=out)
    if sequence_parallel and n:
        if not hasattr(dec, "norm"):
            raise TPConfigError("sequence_parallel needs a final .norm to gather the sequence before")
        plan[f"{prefix}norm"] = CompressedPrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate(),
                                                             use_local_output=True, codec=c, grad_codec=g)
    return plan


def replicate_remaining(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Apply :class:`ReplicateParallel` to every module that still owns plain (non-DTensor) parameters.

    Afterwards every parameter is a DTensor, as torchtitan's models are, so
    foreach optimizers and ``torch.nn.utils.clip_grad_norm_`` work. Parameters
    shared between modules (tied embeddings) stay shared.
    """
    converted: dict[int, nn.Parameter] = {}
    for mod in list(model.modules()):
        _replicate_module(mod, tp_mesh, converted)
    return model


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, codec: CodecLike = "fp8", *,
             grad_codec: CodecLike | None = None, sequence_parallel: bool = False,
             plan: dict[str, ParallelStyle] | None = None, sync_replicated: bool = True) -> nn.Module:
    """Apply compressed tensor parallelism to a Hugging Face Llama, Qwen2, Qwen3 or Mistral model in place
    (torchtitan style).

    Args:
        model: the unchanged model, identical on every rank of ``tp_mesh``.
        tp_mesh: a 1-D ``DeviceMesh`` (``init_device_mesh("cpu", (tp,))``; the process
            group's timeout applies to every collective).
        codec / grad_codec: forward / backward codecs (spec strings or codecs).
        sequence_parallel: shard the residual stream along the sequence (the
            sequence length must then divide by the TP size).
        plan: a custom plan instead of :func:`llama_tp_plan`'s.
        sync_replicated: broadcast the parameters and buffers that stay replicated
            from the mesh's first rank (one uncompressed broadcast at setup), so
            ranks built with different seeds still agree.

    Checks the configuration first (head counts divisible by the TP size, float
    parameters of a supported dtype, the same codecs on every rank) and raises
    :class:`TPConfigError` / :class:`~qwire.codecs.CodecError` saying what to change.
    Afterwards every parameter is a DTensor (sharded or ``Replicate``); create the
    optimizer after this call. Every rank must then feed the same batch.
    """
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise TPConfigError(f"tp_mesh must be a 1-D DeviceMesh, got {tp_mesh!r}; "
                            "e.g. init_device_mesh('cpu', (tp,)) or mesh['tp'] of a larger mesh")
    c, g = _codecs(codec, grad_codec)
    _check_param_dtypes(model, c)
    tp = tp_mesh.size()
    if plan is None:
        plan = llama_tp_plan(model, c, tp_size=tp, grad_codec=g, sequence_parallel=sequence_parallel)
    group = tp_mesh.get_group()
    try:
        check_same_codec(c, group)
        check_same_codec(g, group)
    except CodecError as e:
        raise CodecError(f"apply_tp: {e}") from None
    if sync_replicated and tp > 1:
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                broadcast(t.data, src, group)  # staged through the host on gloo
    parallelize_module(model, tp_mesh, plan)
    replicate_remaining(model, tp_mesh)
    model.qwire_tp = {"tp": tp, "codec": c.spec(), "grad_codec": g.spec(),  # type: ignore[assignment]
                      "sequence_parallel": sequence_parallel}
    return model


# ---------------------------------------------------------------------------------------------
# checkpoints

def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a TP model (what the single-process model would have), on every rank.

    DTensor entries are gathered with ``full_tensor()`` (an uncompressed all-gather:
    checkpoints are exact). Collective: call it on every rank of the TP mesh.
    """
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor().detach().clone() if isinstance(v, DTensor) else v.detach().clone()
    return out


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (e.g. from :func:`full_state_dict` or a single-process model) into a TP model.

    Each rank copies its own shard; no communication.
    """
    from torch.distributed.tensor import distribute_tensor

    own = model.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:  # as load_state_dict(strict=True): a state dict of another model loads no part of it
        raise KeyError("the state dict does not fit the model: " + "; ".join(
            f"{what} {len(keys)} entries, e.g. {keys[:3]}" for what, keys in (("it lacks", missing),
                                                                               ("the model has no", extra)) if keys))
    for k, v in own.items():
        shape = tuple(v.shape)  # a DTensor's is the full tensor's
        if tuple(state[k].shape) != shape:
            raise ValueError(f"state dict entry {k!r} has shape {tuple(state[k].shape)}, the model's {shape}: load "
                             "the state dict of this model")
    with torch.no_grad():
        for k, v in own.items():
            src = state[k].to(device=v.device, dtype=v.dtype)  # (cast, as load_state_dict does)
            if isinstance(v, DTensor):
                # src_data_rank=None: every rank already holds the full tensor, slice locally
                local = distribute_tensor(src, v.device_mesh, v.placements, src_data_rank=None).to_local()
                v.to_local().copy_(local)
            else:
                v.copy_(src)
