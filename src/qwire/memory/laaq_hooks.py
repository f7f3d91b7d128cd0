"""LAAQ: layer-aware quantization of the tensors autograd saves for backward.

Everything autograd keeps between forward and backward goes through
``torch.autograd.graph.saved_tensors_hooks``; :class:`LAAQ` installs a pack hook
that decides per saved tensor, under a :class:`LAAQPolicy`:

* parameters and buffers (any tensor sharing storage with one) are kept as is,
  never quantized (``Linear`` saves its weight, or a transposed view of it);
* integer / bool tensors and tensors smaller than ``min_numel`` are kept;
* tensors saved by attention are kept in full precision: the pack hook knows
  which module is running from forward pre/post hooks on every submodule, and
  a tensor counts as "saved by attention" when the innermost running module
  matches ``attention_pattern`` (class or qualified name) -- i.e. the attention
  core (Q, K, V, scores, softmax probabilities, RoPE inputs) but not the
  inputs of the q/k/v/o projections, which are child ``Linear`` modules
  (``attention_scope="module"`` keeps everything under the attention module);
* tensors saved outside the transformer layers (embedding, final norm, LM head,
  loss; layers are modules matching ``layer_pattern``) are kept unless
  ``quantize_outside_layers``: the loss's saved log-softmax does not survive 4 bits;
* everything else is stored block-wise (``fmt="fp"``: sign + minifloat, FP4
  E2M1 at 4 bits; ``fmt="int"``: symmetric absmax integers), block 128, via the
  ``blockfp`` / ``blockwise`` codecs;
* modules matching ``recompute`` (e.g. the MLP) save only their input (through
  the same hook, so quantized) and re-run their forward in backward instead of
  storing their intermediates (SiLU output, gate*up product, GEMM inputs).

The same tensor saved by several ops (the input of q_proj, k_proj and v_proj)
is stored once. Every stored byte is accounted per transformer layer
(:class:`LAAQStats`), with the live total and its peak.

Usage::

    with laaq(model, LAAQPolicy(bits=4, fmt="fp", block=128)) as session:
        loss = model(x).loss
    loss.backward()                      # unpacking works after the block exits
    print(session.stats.per_layer_units(activation_unit(B, S, H)))

    handle = apply_laaq(stage_module, policy)  # every forward of the stage runs under the policy

Not done: the RMSNorm output and the Q/K/V GEMM input are not recomputed on their
own (they are quantized; recompute ``input_layernorm`` to store its input instead),
and recomputed modules must be deterministic (no dropout).
"""

from __future__ import annotations

import math
import re
import warnings
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from qwire.codecs import Codec, get_codec

__all__ = [
    "LAAQ", "LAAQPolicy", "LAAQStats", "activation_unit", "apply_laaq", "in_flight", "laaq", "stage_bits",
]

KINDS = ("quantized", "attention", "small", "kept", "nonfloat")


# --------------------------------------------------------------------------------------------------
# Pipeline-stage-aware bits
# --------------------------------------------------------------------------------------------------
def in_flight(n_stages: int, schedule: str = "1f1b", n_microbatches: int | None = None) -> list[int]:
    """Micro-batches whose activations stage ``i`` (0-based) holds at once at the schedule's peak.

    ``1f1b``: ``min(m, n_stages - i)`` (stage 0 runs ``n_stages`` forwards before its first
    backward). ``gpipe``: every stage holds all ``m`` micro-batches. ``m`` defaults to
    ``n_stages``.
    """
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    m = n_stages if n_microbatches is None else int(n_microbatches)
    if m < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {m}")
    s = schedule.lower().replace("-", "").replace("_", "")
    if s == "1f1b":
        return [min(m, n_stages - i) for i in range(n_stages)]
    if s == "gpipe":
        return [m] * n_stages
    raise ValueError(f"unknown pipeline schedule {schedule!r}; use '1f1b' or 'gpipe'")


def stage_bits(n_stages: int, schedule: str = "1f1b", n_microbatches: int | None = None, *,
               base_bits: int = 4, max_bits: int = 8, rounding: str = "floor") -> list[int]:
    """Per-stage activation bits ``b_i = max(base, base * N_1 / N_i)``, rounded, capped at ``max_bits``.

    ``N_i`` is :func:`in_flight`. The stage holding the most micro-batches (stage 0
    under 1F1B) gets ``base_bits``; a stage holding fewer gets proportionally more
    bits, so every stage's activation memory stays at or below stage 0's.
    ``rounding="floor"`` (default) keeps that invariant (``N_i * b_i <= N_1 * base``);
    ``"nearest"`` and ``"ceil"`` are offered for comparison.

    For 4 stages under 1F1B (``N = 4, 3, 2, 1``) the formula gives 4, 5.33, 8, 16, i.e.
    ``[4, 5, 8, 8]`` with floor and the 8-bit cap. (The 4/5/6/8 example quoted with
    the formula does not follow from it for any rounding.)
    """
    n = in_flight(n_stages, schedule, n_microbatches)
    rnd = {"floor": math.floor, "ceil": math.ceil, "nearest": lambda v: math.floor(v + 0.5)}
    if rounding not in rnd:
        raise ValueError(f"rounding must be one of {sorted(rnd)}, got {rounding!r}")
    out = []
    for ni in n:
        b = base_bits * n[0] / ni
        b = rnd[rounding](b + 1e-9 if rounding == "floor" else b - 1e-9 if rounding == "ceil" else b)
        out.append(int(min(max_bits, max(base_bits, b))))
    return out


def activation_unit(batch: int, seq: int, hidden: int) -> int:
    """The paper's unit of saved-activation memory, ``U = B * S * H * 2`` bytes (one bf16 hidden state)."""
    return batch * seq * hidden * 2


# --------------------------------------------------------------------------------------------------
# Policy and accounting
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LAAQPolicy:
    """What to do with each tensor autograd saves.

    Attributes:
        bits: bits per element of quantized tensors (3..8 for ``fp``, 2..8 for ``int``).
        fmt: ``"fp"`` (block-scaled minifloat, FP4 E2M1 at 4 bits), ``"int"`` (absmax
            integers) or ``"none"`` (keep everything: accounting only, bit-exact).
            ``"fp4"`` / ``"int4"`` are accepted as aliases when they agree with ``bits``.
        block: elements per block sharing one fp32 scale.
        keep_attention: keep tensors saved by attention in full precision (the AGoQ rule);
            False quantizes them too (the "uniform 4-bit" ablation).
        attention_pattern: regex matched against the class name and the qualified name
            of the innermost running module.
        attention_scope: ``"innermost"`` (only the attention module's own ops) or
            ``"module"`` (everything under it, including its projections).
        layer_pattern: regex on qualified module names naming a transformer layer, for
            per-layer accounting (outermost match wins).
        min_numel: tensors with fewer elements are kept.
        recompute: regexes on qualified module names of modules to recompute in backward
            from their (quantized) input; they must take and return one tensor.
        quantize_outside_layers: also quantize tensors saved outside the transformer layers
            (embedding, final norm, LM head, loss). Off by default: the loss's log-softmax
            output is far too sensitive for 4 bits (its exp gives the softmax in backward).
    """

    bits: int = 4
    fmt: str = "fp"
    block: int = 128
    keep_attention: bool = True
    attention_pattern: str = r"(?i)attention$|(^|\.)(self_)?attn$"
    attention_scope: str = "innermost"
    layer_pattern: str = r"(^|\.)(layers|h|blocks|layer)\.\d+$"
    min_numel: int = 1024
    recompute: tuple[str, ...] = ()
    quantize_outside_layers: bool = False

    def __post_init__(self) -> None:
        fmt = self.fmt.lower()
        m = re.fullmatch(r"(fp|int)(\d+)", fmt)
        if m:
            if int(m.group(2)) != self.bits and self.bits != 4:
                raise ValueError(f"LAAQPolicy: fmt={self.fmt!r} disagrees with bits={self.bits}")
            object.__setattr__(self, "bits", int(m.group(2)))
            fmt = m.group(1)
        if fmt not in ("fp", "int", "none"):
            raise ValueError(f"LAAQPolicy: fmt must be 'fp', 'int' or 'none', got {self.fmt!r}")
        object.__setattr__(self, "fmt", fmt)
        if self.attention_scope not in ("innermost", "module"):
            raise ValueError("LAAQPolicy: attention_scope must be 'innermost' or 'module'")
        if isinstance(self.recompute, str):
            object.__setattr__(self, "recompute", (self.recompute,))
        if fmt != "none":
            self.codec()  # validate bits / block now

    def codec(self) -> Codec | None:
        """The codec quantized tensors are stored with (None for ``fmt="none"``)."""
        if self.fmt == "none":
            return None
        name = "blockfp" if self.fmt == "fp" else "blockwise"
        return get_codec(name, bits=self.bits, block=self.block)

    def for_stage(self, stage: int, n_stages: int, schedule: str = "1f1b",
                  n_microbatches: int | None = None, **kwargs: Any) -> LAAQPolicy:
        """This policy with ``bits`` from :func:`stage_bits` for pipeline stage ``stage`` (0-based)."""
        bits = stage_bits(n_stages, schedule, n_microbatches, base_bits=self.bits, **kwargs)[stage]
        return replace(self, bits=bits)

    def describe(self) -> str:
        if self.fmt == "none":
            return "full precision (no quantization)"
        c = self.codec()
        att = "attention kept" if self.keep_attention else "attention quantized"
        rc = f", recompute {'|'.join(self.recompute)}" if self.recompute else ""
        out = ", outside layers too" if self.quantize_outside_layers else ""
        return f"{c.spec()}, {att}{rc}{out}"


def _zero_kinds() -> dict[str, int]:
    return dict.fromkeys(KINDS, 0)


@dataclass
class LAAQStats:
    """Bytes held by saved tensors, per layer and kind, counted once per unique tensor.

    ``stored[layer][kind]`` is what the pack hook kept (payload bytes for quantized
    tensors, storage bytes for kept ones); ``raw[layer]`` what the same tensors take
    unquantized. Parameters are not counted. ``live_bytes`` is what is held now,
    ``peak_bytes`` its maximum since the last :meth:`reset`.
    """

    stored: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(_zero_kinds))
    raw: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    live_bytes: int = 0
    peak_bytes: int = 0

    def reset(self) -> None:
        """Forget the totals (``live_bytes`` keeps tracking what is still held)."""
        self.stored = defaultdict(_zero_kinds)
        self.raw = defaultdict(int)
        self.counts = defaultdict(int)
        self.peak_bytes = self.live_bytes

    def _add(self, layer: str, kind: str, stored: int, raw: int) -> None:
        self.stored[layer][kind] += stored
        self.raw[layer] += raw
        self.counts[kind] += 1
        self.live_bytes += stored
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def layer_bytes(self) -> dict[str, int]:
        """Total stored bytes per layer."""
        return {k: sum(v.values()) for k, v in self.stored.items()}

    def total_bytes(self) -> int:
        return sum(self.layer_bytes().values())

    def per_layer_units(self, unit: int, layers_only: bool = True) -> dict[str, float]:
        """Stored bytes per layer divided by ``unit`` (see :func:`activation_unit`)."""
        return {k: v / unit for k, v in self.layer_bytes().items() if not layers_only or k != "other"}

    def mean_layer_units(self, unit: int) -> float:
        """Average over transformer layers (excluding "other") of stored bytes / ``unit``."""
        vals = list(self.per_layer_units(unit).values())
        return sum(vals) / len(vals) if vals else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"stored": {k: dict(v) for k, v in self.stored.items()}, "raw": dict(self.raw),
                "counts": dict(self.counts), "peak_bytes": self.peak_bytes, "live_bytes": self.live_bytes}


class _Stored:
    """What the pack hook returns: the kept tensor, or a payload to decode."""

    __slots__ = ("tensor", "version", "payload", "shape", "dtype", "codec", "nbytes", "stats", "__weakref__")

    def __init__(self, tensor: torch.Tensor | None, payload: torch.Tensor | None, shape: torch.Size,
                 dtype: torch.dtype, codec: Codec | None, nbytes: int, stats: LAAQStats) -> None:
        self.tensor, self.payload, self.shape, self.dtype = tensor, payload, shape, dtype
        self.codec, self.nbytes, self.stats = codec, nbytes, stats
        self.version = tensor._version if tensor is not None else 0

    def unpack(self) -> torch.Tensor:
        if self.tensor is not None:
            if self.tensor._version != self.version:  # autograd's own check, which a saved-tensor hook bypasses
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: a {self.dtype} tensor of shape {list(self.shape)} that LAAQ kept as it was saved "
                    f"is at version {self.tensor._version}; expected version {self.version} instead. Write to a "
                    "copy (x = x.clone()) or out of place after the forward that saved it")
            return self.tensor
        return self.codec.decode(self.payload, self.shape, self.dtype)

    def __del__(self) -> None:
        self.stats._release(self.nbytes)


def _passthrough(t: torch.Tensor) -> torch.Tensor:
    return t


# --------------------------------------------------------------------------------------------------
# Recomputation
# --------------------------------------------------------------------------------------------------
def _recompute_forward(module: nn.Module, fn: Any) -> Any:
    params = tuple(p for p in module.parameters() if p.requires_grad)

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or not isinstance(x, torch.Tensor):
            raise TypeError(f"LAAQ recompute: {type(module).__name__} must take a single tensor argument")
        if not torch.is_grad_enabled():
            return fn(x)
        return _RecomputeCall.apply(fn, params, x, *params)

    return forward


class _RecomputeCall(torch.autograd.Function):
    """Run ``fn(x)`` saving only ``x`` (through the active hooks); re-run ``fn`` in backward."""

    @staticmethod
    def forward(ctx: Any, fn: Any, params: tuple, x: torch.Tensor,
                *flat_params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.fn_params = fn, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            y = fn(x)
        if not isinstance(y, torch.Tensor):
            raise TypeError("LAAQ recompute: the module must return a single tensor")
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]  # x, then params
        x_ = x.detach().requires_grad_(needs[0])
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_passthrough, _passthrough):
            y = ctx.fn(x_)
        inputs = [x_, *ctx.fn_params]
        want = [i for i, n in enumerate(needs) if n]
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        if want and y.requires_grad:
            got = torch.autograd.grad(y, [inputs[i] for i in want], gy, allow_unused=True)
            for i, g in zip(want, got):
                grads[i] = g
        return (None, None, *grads)


# --------------------------------------------------------------------------------------------------
# The session
# --------------------------------------------------------------------------------------------------
class LAAQ:
    """Saved-tensor compression for one model (or pipeline stage) under a policy.

    Use as a context manager (``with LAAQ(model, policy) as s:``, or :func:`laaq`),
    or via :func:`apply_laaq` to run every forward of a module under it. Tensors
    packed while active are unpacked in backward even after the block exits.
    """

    def __init__(self, model: nn.Module, policy: LAAQPolicy | None = None) -> None:
        self.model = model
        self.policy = policy or LAAQPolicy()
        self.codec = self.policy.codec()
        self.stats = LAAQStats()
        self._att = re.compile(self.policy.attention_pattern)
        self._layer = re.compile(self.policy.layer_pattern)
        self._rc = [re.compile(p) for p in self.policy.recompute]
        self._stack: list[nn.Module] = []
        self._handles: list[Any] = []
        self._patched: list[nn.Module] = []
        self._names: dict[int, str] = {}
        self._is_attn: dict[int, bool] = {}
        self._param_ptrs: set[int] = set()
        self._seen: dict[tuple, tuple[weakref.ref, int, _Stored]] = {}
        self._kept_storages: dict[int, weakref.ref] = {}
        self._hooks: list[Any] = []
        self._attached = 0
        self._warned = False

    # -- module bookkeeping ---------------------------------------------------------------------
    def attach(self) -> None:
        """Install the module-stack hooks and the recompute wrappers (idempotent, counted)."""
        self._attached += 1
        if self._attached > 1:
            return
        for name, mod in self.model.named_modules():
            self._names[id(mod)] = name
            cls = type(mod).__name__
            self._is_attn[id(mod)] = bool(self._att.search(cls) or (name and self._att.search(name)))
            self._handles.append(mod.register_forward_pre_hook(self._push))
            self._handles.append(mod.register_forward_hook(self._pop, always_call=True))
            if name and any(r.search(name) for r in self._rc):
                self._patch(mod, name)

    def detach(self) -> None:
        """Undo :meth:`attach`."""
        self._attached -= 1
        if self._attached > 0:
            return
        self._attached = 0
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mod in self._patched:
            del mod.forward
        self._patched.clear()
        self._stack.clear()

    def _patch(self, mod: nn.Module, name: str) -> None:
        for sub in mod.modules():
            if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
                raise ValueError(f"LAAQ recompute: {name} contains dropout (p={sub.p}); recomputation "
                                 "would draw a different mask. Drop it from policy.recompute.")
        if "forward" in mod.__dict__:
            raise ValueError(f"LAAQ recompute: {name}.forward is already patched")
        mod.forward = _recompute_forward(mod, type(mod).forward.__get__(mod))
        self._patched.append(mod)

    def _push(self, mod: nn.Module, args: Any) -> None:
        self._stack.append(mod)

    def _pop(self, mod: nn.Module, args: Any, out: Any) -> None:
        # pop up to and including mod (robust to a module whose forward raised inside)
        while self._stack:
            if self._stack.pop() is mod:
                break

    def _scope(self) -> tuple[str, bool]:
        layer = "other"
        for m in self._stack:
            name = self._names.get(id(m), "")
            if name and self._layer.search(name):
                layer = name
                break
        if not self._stack:
            return layer, False
        if self.policy.attention_scope == "module":
            attn = any(self._is_attn.get(id(m), False) for m in self._stack)
        else:
            attn = self._is_attn.get(id(self._stack[-1]), False)
        return layer, attn

    # -- activation ----------------------------------------------------------------------------
    def activate(self) -> None:
        """Start routing saved tensors through the policy (needs :meth:`attach`)."""
        self._param_ptrs = set()
        for t in [*self.model.parameters(), *self.model.buffers()]:
            try:
                self._param_ptrs.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                pass
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._hooks.append(ctx)

    def deactivate(self) -> None:
        """Stop routing saved tensors (already-packed ones still unpack)."""
        ctx = self._hooks.pop()
        ctx.__exit__(None, None, None)
        self._seen.clear()
        self._kept_storages.clear()
        p = self.policy
        if (self.codec is not None and not p.quantize_outside_layers and not self._warned
                and set(self.stats.stored) == {"other"} and self.stats.stored["other"]["kept"]):
            self._warned = True
            warnings.warn(f"LAAQ: no module of {type(self.model).__name__} matched layer_pattern "
                          f"{p.layer_pattern!r}, so nothing was quantized (tensors outside transformer "
                          "layers are kept). Set LAAQPolicy(layer_pattern=...) to name your layers, or "
                          "quantize_outside_layers=True.", stacklevel=2)

    def __enter__(self) -> LAAQ:
        self.attach()
        try:
            self.activate()
        except BaseException:
            self.detach()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.deactivate()
        finally:
            self.detach()

    # -- the hooks -----------------------------------------------------------------------------
    def _held_by_running_module(self, sptr: int) -> bool:
        """Whether a module whose forward is running holds a parameter in that storage: FSDP2 gathers the
        weights into new storages for the forward only, which the parameters seen at :meth:`activate` lack."""
        for m in self._stack:
            for p in m.parameters(recurse=False):
                try:
                    if p.untyped_storage().data_ptr() == sptr:
                        return True
                except (RuntimeError, NotImplementedError):
                    continue
        return False

    def _pack(self, t: torch.Tensor) -> Any:
        try:
            storage = t.untyped_storage()
            sptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            return t  # no plain storage (sparse, subclass): leave it to autograd
        if sptr in self._param_ptrs or self._held_by_running_module(sptr):
            self.stats.counts["param"] += 1
            return t
        key = (sptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        hit = self._seen.get(key)
        if hit is not None:
            ref, version, stored = hit
            # the storage's Python object lives exactly as long as the storage, so a live
            # weak reference means the address was not reused; the version counter catches
            # in-place writes between the two saves
            if ref() is not None and version == t._version:
                self.stats.counts["dedup"] += 1
                return stored
        layer, attn = self._scope()
        raw = t.numel() * t.element_size()
        if not t.is_floating_point():
            kind = "nonfloat"
        elif t.numel() < self.policy.min_numel:
            kind = "small"
        elif self.codec is None:
            kind = "kept"
        elif attn and self.policy.keep_attention:
            kind = "attention"
        elif layer == "other" and not self.policy.quantize_outside_layers:
            kind = "kept"
        elif type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
            kind = "kept"
        else:
            kind = "quantized"
        if kind == "quantized":
            payload = self.codec.encode(t)
            nbytes = int(payload.numel())
            stored = _Stored(None, payload, t.shape, t.dtype, self.codec, nbytes, self.stats)
        else:
            prev = self._kept_storages.get(sptr)
            if prev is not None and prev() is not None:
                nbytes = 0  # this storage is already held (another view of it was saved)
            else:
                nbytes = storage.nbytes()
                self._kept_storages[sptr] = weakref.ref(storage)
            stored = _Stored(t, None, t.shape, t.dtype, None, nbytes, self.stats)
        self.stats._add(layer, kind, nbytes, raw)
        self._seen[key] = (weakref.ref(storage), t._version, stored)
        if len(self._seen) > 4096:
            self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
        return stored

    @staticmethod
    def _unpack(stored: Any) -> torch.Tensor:
        if isinstance(stored, _Stored):
            return stored.unpack()
        return stored


@contextmanager
def laaq(model: nn.Module, policy: LAAQPolicy | None = None) -> Iterator[LAAQ]:
    """Context manager: saved tensors of ``model``'s forward inside the block follow ``policy``.

    Yields the :class:`LAAQ` session (``session.stats`` has the accounting).
    """
    session = LAAQ(model, policy)
    with session:
        yield session


class LAAQHandle:
    """Returned by :func:`apply_laaq`; ``.stats`` accounts every forward, ``.remove()`` undoes it."""

    def __init__(self, session: LAAQ, hooks: list[Any]) -> None:
        self.session = session
        self._hooks = hooks

    @property
    def stats(self) -> LAAQStats:
        return self.session.stats

    @property
    def policy(self) -> LAAQPolicy:
        return self.session.policy

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.session.detach()


def apply_laaq(module: nn.Module, policy: LAAQPolicy | None = None) -> LAAQHandle:
    """Make every forward of ``module`` (e.g. a pipeline stage) save tensors under ``policy``.

    The module is unchanged (no wrapper, same ``state_dict``); its backward, run
    later by autograd or a pipeline schedule, unpacks what was stored.
    """
    session = LAAQ(module, policy)
    session.attach()

    def pre(mod: nn.Module, args: Any) -> None:
        session.activate()

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        session.deactivate()

    hooks = [module.register_forward_pre_hook(pre, prepend=True),
             module.register_forward_hook(post, always_call=True)]
    return LAAQHandle(session, hooks)
