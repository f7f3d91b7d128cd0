"""Every Triton kernel launch the codecs make, seen as it happens and described as Triton's JIT compiles it.

Used to compile the kernels for a GPU on a machine without one (``scripts/compile_for_gpu.py``,
``tests/test_kernels_compile.py``): the codecs run under Triton's interpreter, each launch is recorded, and the
records are compiled later in a process without the interpreter.

A record is what the JIT would build for the same arguments on a GPU: an integer argument equal to 1 becomes a
compile-time constant, and a tensor whose address or an integer that is a multiple of 16 is marked so
(``tt.divisibility``), which is what lets the compiler use 128-bit loads and stores. The launch arguments that
only the interpreter takes are replaced by what a GPU launch passes (``EXACT64``, ``SOFT_FP8``; the search kernel's
tiles per program).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import _common

TYPES = {torch.bool: "*i1", torch.float32: "*fp32", torch.uint8: "*u8", torch.int8: "*i8", torch.int16: "*i16",
         torch.int32: "*i32", torch.int64: "*i64", torch.float16: "*fp16", torch.bfloat16: "*bf16",
         torch.float64: "*fp64"}


@contextmanager
def watching(see: Callable[[Any, tuple, dict], bool | None]) -> Iterator[None]:
    """Within the block, every kernel launch of the Triton backend calls ``see(kernel function, args,
    constexprs)`` before it runs; where ``see`` returns True the launch is skipped (to time the host's work
    alone: ``scripts/gpu_op_count.py --host-time``)."""
    original = _common.launch

    def hooked(kernel, grid, *args, **constexprs):
        constexprs = _common.index_width(kernel, args, constexprs)  # as the launch will pass them
        if see(getattr(kernel, "fn", kernel), args, constexprs):
            return None
        return original(kernel, grid, *args, **constexprs)

    pkg = importlib.import_module(__package__)
    mods = [importlib.import_module(f"{__package__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]
    mods = [m for m in mods if getattr(m, "launch", None) is original]
    for m in mods:
        m.launch = hooked
    try:
        yield
    finally:
        for m in mods:
            m.launch = original


def _arg(v: Any) -> tuple[str, Any]:
    """(type, specialization) of a run-time argument as the JIT sees it: ("constexpr", 1) for the integer 1,
    else (type, True where it is 16-aligned / a multiple of 16)."""
    if isinstance(v, torch.Tensor):
        return TYPES[v.dtype], v.data_ptr() % 16 == 0
    if isinstance(v, bool):
        return "i1", False
    if isinstance(v, int):
        if v == 1:
            return "constexpr", 1
        return ("i32" if -(2 ** 31) <= v < 2 ** 31 else "i64"), v % 16 == 0
    if isinstance(v, float):
        return "fp32", False
    raise TypeError(f"unexpected kernel argument {v!r}")


def describe(fn: Any, args: tuple, constexprs: dict) -> dict:
    """The record of one launch of kernel function ``fn``: its module and name, the run-time arguments' types
    (``signature``), the compile-time constants (``constexprs``), the arguments marked 16-divisible
    (``aligned``) and the warps per program (``num_warps``)."""
    from . import _refine

    constexprs = dict(constexprs)
    warps = constexprs.pop("num_warps", 4)  # a launch option (Triton's default: 4), not a constant
    names = [n for n in fn.__code__.co_varnames[: fn.__code__.co_argcount] if n not in constexprs]
    consts = {k: (v if isinstance(v, (bool, int, float)) else float(v)) for k, v in constexprs.items()}
    for name in ("EXACT64", "SOFT_FP8"):  # the interpreter's exact-rounding workarounds; a GPU compiles without them
        if name in consts:
            consts[name] = False
    if fn.__name__ == "_refine_log":  # the interpreter runs it in few, large programs; a GPU in smaller ones
        consts["BT"] = _refine.TILES_PER_PROGRAM
    if fn.__name__ in ("_tile_stats", "_tah_stats"):  # likewise (direct.stats_tiles)
        from .direct import STATS_TILES

        consts["BT"] = STATS_TILES
    signature, aligned = {}, []
    for name, v in zip(names, args):
        ty, spec = _arg(v)
        if ty == "constexpr":
            consts[name] = spec
            continue
        signature[name] = ty
        if spec:
            aligned.append(name)
    return {"module": fn.__module__, "kernel": fn.__name__, "signature": signature, "constexprs": consts,
            "aligned": aligned, "num_warps": warps}


class Distinct:
    """The distinct launch records (:func:`describe`) seen so far, in order of first sight."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self._index: dict[str, int] = {}

    def add(self, fn: Any, args: tuple, constexprs: dict) -> int:
        """The index of this launch's record in ``records``, appended if it is new."""
        rec = describe(fn, args, constexprs)
        key = json.dumps(rec, sort_keys=True)
        if key not in self._index:
            self._index[key] = len(self.records)
            self.records.append(rec)
        return self._index[key]


@contextmanager
def recording() -> Iterator[list[dict]]:
    """Within the block, each distinct launch's record (:func:`describe`) is appended to the list yielded."""
    seen = Distinct()

    def see(fn, args, constexprs) -> None:  # None: the launch runs (a true value would skip it)
        seen.add(fn, args, constexprs)

    with watching(see):
        yield seen.records
