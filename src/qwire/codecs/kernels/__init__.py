"""Fast implementations of the codecs, and how a codec chooses one.

Each codec's torch code is its *reference*: the readable spec of what it
computes. A *backend* holds fused kernels for one kind of device that write
the same payload format (byte for byte, except where a codec's module says
otherwise and by how much)::

    backend   device   technology
    "cpu"     cpu      numba-compiled loops, one pass per block of rows, threaded over
                       ``torch.get_num_threads()`` threads (JIT-compiled on first use,
                       cached on disk)
    "triton"  cuda     Triton kernels (compiled for the GPU on first use, cached on disk);
                       with ``TRITON_INTERPRET=1`` they also run on cpu tensors under
                       Triton's interpreter when asked for by name (``impl=triton``), which
                       is how they are tested without a GPU

A codec's ``impl`` option picks the implementation: ``auto`` (default) takes
the backend registered for the tensor's device when it has a kernel for this
codec and configuration, and the torch reference otherwise; ``torch`` always
runs the reference; a backend's name insists on that backend (an error if it
cannot run). ``impl`` is not part of :meth:`~qwire.codecs.Codec.spec`: two
processes may run different implementations of one codec, since the payloads
are the same. The environment variable ``QWIRE_CODEC_IMPL`` (``torch`` or
``auto``) sets the default for codecs built without ``impl``.

If a backend cannot load (e.g. numba or triton is missing), ``auto`` falls back
to the torch reference and says so once, with the reason.

A kernel module registers what it implements::

    register_kernels("cpu", "int", supports=lambda codec: ..., encode=fn, decode=fn)

``encode(codec, x)`` and ``decode(codec, payload, shape, dtype, *args)`` have the codec
methods' signatures with the codec first; ``supports(codec)`` says whether the
configuration is covered (checked once per codec object).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CodecError

IMPLS_FIXED = ("auto", "torch")


@dataclass
class KernelSet:
    supports: Callable[[Any], bool]
    ops: dict[str, Callable[..., Any]]


@dataclass
class Backend:
    """Kernels for one device type, loaded on first use from ``module``."""

    name: str
    device_type: str
    module: str
    hint: str  # how to get the backend back when it cannot load
    interpreter_env: str = ""  # set to 1, this variable lets the kernels run on cpu tensors (an interpreter)
    # a kernel that fails with anything but a CodecError (a compiler error on a GPU it was never run on)
    # is retired with a warning and the reference runs instead, under impl=auto
    retire_on_error: bool = False
    kernels: dict[str, KernelSet] = field(default_factory=dict)
    state: str = "unloaded"  # unloaded | ready | failed
    reason: str = ""

    def load(self) -> bool:
        if self.state == "unloaded":
            try:
                importlib.import_module(self.module)
                self.state = "ready"
            except Exception as e:  # an ImportError, or a compiler that failed at import time
                self.state, self.reason = "failed", f"{type(e).__name__}: {e}"
                warnings.warn(
                    f"qwire: the {self.name!r} codec kernels could not load ({self.reason}); codecs on "
                    f"{self.device_type} tensors run the slower torch reference instead. {self.hint}",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return self.state == "ready"

    def runs_on(self, device: torch.device) -> bool:
        return device.type == self.device_type or (
            device.type == "cpu" and bool(self.interpreter_env) and os.environ.get(self.interpreter_env) == "1")


BACKENDS: dict[str, Backend] = {
    "cpu": Backend("cpu", "cpu", "qwire.codecs.kernels.cpu",
                   "Re-run `bash scripts/setup.sh` (it installs numba) to get them back."),
    "triton": Backend("triton", "cuda", "qwire.codecs.kernels.gpu",
                      "Install triton (`pip install triton`; torch's CUDA wheels bring it) to get them back.",
                      interpreter_env="TRITON_INTERPRET", retire_on_error=True),
}


def impl_choices() -> tuple[str, ...]:
    return IMPLS_FIXED + tuple(BACKENDS)


def default_impl() -> str:
    v = os.environ.get("QWIRE_CODEC_IMPL", "auto").strip().lower() or "auto"
    if v not in impl_choices():
        raise CodecError(f"QWIRE_CODEC_IMPL={v!r} is not one of {', '.join(impl_choices())}")
    return v


def check_impl(codec_name: str, impl: Any) -> str:
    v = str(impl).strip().lower()
    if v not in impl_choices():
        raise CodecError(
            f"codec {codec_name!r}: impl={impl!r} must be one of {', '.join(impl_choices())} "
            "(auto: the fastest implementation for the tensor's device)"
        )
    return v


def register_kernels(backend: str, codec_name: str, *, supports: Callable[[Any], bool] | None = None,
                     **ops: Callable[..., Any]) -> None:
    """Register kernels of ``backend`` for the codec class named ``codec_name``."""
    BACKENDS[backend].kernels[codec_name] = KernelSet(supports or (lambda codec: True), ops)


def backend_for(device: torch.device) -> Backend | None:
    for b in BACKENDS.values():
        if b.device_type == device.type:
            return b
    return None


def select(codec: Any, op: str, t: torch.Tensor) -> Callable[..., Any] | None:
    """The kernel that runs ``op`` for ``codec`` on ``t``'s device, or None for the torch reference."""
    impl = codec.impl
    if impl == "torch" or not isinstance(t, torch.Tensor):
        return None
    b = backend_for(t.device) if impl == "auto" else BACKENDS[impl]
    if b is None:
        return None
    if not b.runs_on(t.device):
        raise CodecError(
            f"codec {codec.name!r}: impl={impl} runs on {b.device_type} tensors, got a {t.device.type} "
            "tensor; use impl=auto"
        )
    if not b.load():
        if impl != "auto":
            raise CodecError(f"codec {codec.name!r}: impl={impl} cannot run here ({b.reason}); use impl=auto")
        return None
    cache = codec.__dict__.setdefault("_kernel_cache", {})
    key = (b.name, op)
    if key not in cache:
        ks = b.kernels.get(type(codec).__name__)
        fn = ks.ops.get(op) if ks is not None and ks.supports(codec) else None
        if fn is None and impl != "auto":
            raise CodecError(
                f"codec {codec.spec()!r}: the {b.name} implementation does not cover this configuration "
                f"({op}); use impl=auto or impl=torch"
            )
        cache[key] = fn
    return cache[key]


def dispatch(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a codec's ``encode``/``decode``: run the selected kernel, else the reference.

    The undecorated reference stays reachable as ``method.reference``.
    """
    op = method.__name__

    @functools.wraps(method)
    def wrapper(self: Any, t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        fn = select(self, op, t)
        if fn is None:
            return method(self, t, *args, **kwargs)
        if op == "decode" and not t.is_contiguous():  # a strided payload view: the kernels read flat bytes
            t = t.contiguous()
        try:
            if through is None:
                return fn(self, t, *args, **kwargs)
            return through(self, op, fn, t, *args, **kwargs)  # directly, or through a CUDA graph
        except CodecError:
            raise
        except Exception as e:
            b = backend_for(t.device) if self.impl == "auto" else None
            if b is None or not b.retire_on_error or not _kernel_fault(e):
                raise
            _retire(self, b, op, e)
            return method(self, t, *args, **kwargs)

    wrapper.reference = method  # type: ignore[attr-defined]
    return wrapper


# How a selected kernel is called: set by :mod:`qwire.codecs.kernels.graphs` when it is imported (by the Triton
# backend, or by whoever enables graphs) to run it through a CUDA graph where graphs are on; None: directly.
through: Callable[..., Any] | None = None


_RETIRED: set[tuple[str, str, str]] = set()
# errors that say nothing about the kernel: the device is out of memory (the reference would need memory
# too), or the CUDA context is broken (a fault is sticky: the reference would fail as well, less clearly)
_NOT_THE_KERNEL = ("out of memory", "illegal memory access", "unspecified launch failure", "device-side assert",
                   "misaligned address", "an illegal instruction")


def _kernel_fault(e: Exception) -> bool:
    """Whether ``e`` from a kernel is the kernel's own failure (a compiler error, a refused launch), which
    running the reference instead works around; not for out-of-memory or a broken CUDA context."""
    if isinstance(e, torch.OutOfMemoryError):
        return False
    text = str(e).lower()
    return not any(s in text for s in _NOT_THE_KERNEL)


def _retire(codec: Any, b: Backend, op: str, e: Exception) -> None:
    """Stop using backend ``b``'s ``op`` kernel of this codec class (every instance), and say so once."""
    ks = b.kernels.get(type(codec).__name__)
    if ks is not None:
        ks.ops.pop(op, None)
    codec.__dict__.get("_kernel_cache", {}).pop((b.name, op), None)
    key = (b.name, type(codec).__name__, op)
    if key not in _RETIRED:
        _RETIRED.add(key)
        warnings.warn(
            f"qwire: the {b.name} {op} kernel of codec {codec.name!r} failed ({type(e).__name__}: {e}); "
            f"{b.device_type} tensors run the torch reference of {codec.name!r} {op} from now on",
            RuntimeWarning,
            stacklevel=3,
        )


def implementation(codec: Any, device: torch.device | str = "cpu") -> str:
    """Name of the implementation ``codec`` runs on ``device``'s tensors ("torch" or a backend); a codec made of
    others (``candidates``: TAH-Quant's ``adapt=block``) runs theirs."""
    parts = getattr(codec, "candidates", None)
    if parts:
        return implementation(parts[0], device)
    t = torch.empty(0, device=device)
    fn = select(codec, "encode", t)
    return "torch" if fn is None else backend_for(t.device).name  # type: ignore[union-attr]
