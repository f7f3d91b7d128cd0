"""Count what a codec's GPU path launches, without a GPU.

Usage: ``python scripts/gpu_op_count.py [--specs int4,tahquant] [--shape 64,1600] [--dtype bfloat16]``

Runs each codec's Triton implementation under Triton's interpreter on CPU tensors and counts, per encode and
per decode, the torch operations it makes outside the Triton kernels (on a GPU each is a kernel launch, or a
host sync where it reads a value back), the host syncs among them (reading a value back, or an output whose
size depends on the values: ``nonzero``, ``unique``, boolean indexing) and the Triton kernel launches, with the
functions that make the most operations.
A codec or configuration with no Triton path (e.g. ``aqsgd``) runs its torch reference, as on a GPU.
Bit packing goes through the kernels the Triton backend registers for CUDA tensors, as it would on a GPU.
``--deferred``: each encode and decode runs with its checks deferred (:mod:`qwire.codecs.kernels.deferred`, as in
a pipeline stage on a GPU), and the count says how many checks wait for the one read back of ``resolve()``.
``--traffic``: also the bytes each call moves to and from the GPU's memory, per Triton kernel launch (the distinct
addresses its loads, stores and atomics touch, counted under the interpreter: what a launch must move at least,
whatever the caches do) and per torch operation (its tensor inputs and outputs), against a copy of the input (which
reads and writes each element once); the lower bound this puts on a codec's time, at the bandwidth of the copy, is
the best ratio to the copy's time ``qwire bench codecs`` could measure on a GPU: a model, not a measurement. Use an
input of the size that matters (``--shape 1024,1600``: the GPT2-XL boundary), so that the per-block and per-tile
parts weigh what they weigh there.
``--host-time``: also the host time of each encode and decode besides its Triton launches, measured here with
every launch replaced by nothing (the best of 5 runs of 50 calls; the torch operations run on CPU tensors, so a
small ``--shape`` keeps their own work small): the Python and torch calls a GPU's host makes per call on top of
the launches (results written by skipped launches are garbage; with ``--deferred`` nothing reads them).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from qwire.codecs import get_codec  # noqa: E402
from qwire.codecs.kernels.counting import MemoryTraffic, TorchTraffic  # noqa: E402


class _Count(TorchTraffic):
    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default="int4,fp8,tahquant")
    ap.add_argument("--shape", default="64,1600")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the input's dtype, and the decoded one")
    ap.add_argument("--deferred", action="store_true", help="defer the checks, as a pipeline stage on a GPU does")
    ap.add_argument("--host-time", action="store_true",
                    help="also time each call's host work besides its launches (launches skipped; use --deferred)")
    ap.add_argument("--traffic", action="store_true",
                    help="also count the bytes each call moves in device memory, and the bound they put on the "
                         "ratio to a copy (a model)")
    ap.add_argument("--json", default="",
                    help="with --traffic: write the bytes per element of each call and kernel to this file (read "
                         "by scripts/gpu_profile.py --traffic)")
    args = ap.parse_args(argv)
    from qwire.codecs.kernels.deferred import PendingChecks, deferring
    from qwire.codecs.kernels.gpu import _launches

    counter: list[_Count] = []
    skip = [False]
    traffic: list[MemoryTraffic] = []
    model: dict[str, dict] = {}

    def counting(fn, a, kw) -> bool:
        if counter:
            counter[-1].kernels += 1
        if traffic:
            traffic[-1].launch(fn.__name__)
        return skip[0]  # True: the launch is skipped (--host-time)

    from qwire.codecs import packing

    packing.DEVICE_KERNELS["cpu"] = packing.DEVICE_KERNELS["cuda"]  # as CUDA tensors would pack
    shape = tuple(int(v) for v in args.shape.split(","))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(getattr(torch, args.dtype))
    from qwire.codecs import CodecError

    with _launches.watching(counting):
        for spec in [s.strip() for s in args.specs.split(",") if s.strip()]:
            c = get_codec(spec, impl="triton")
            try:
                p = c.encode(x)
            except CodecError as e:  # no Triton path for this codec: the reference runs on CUDA tensors
                if "does not cover" not in str(e):
                    raise
                c = get_codec(spec, impl="torch")
                p = c.encode(x)
            c.decode(p, x.shape, x.dtype)
            calls = (("encode", lambda c=c: c.encode(x)), ("decode", lambda c=c, p=p: c.decode(p, x.shape, x.dtype)))
            moved = 0
            record = model.setdefault(spec, {})
            for what, fn in calls:
                n = _Count()
                counter.append(n)
                if args.traffic:
                    traffic.append(MemoryTraffic())
                pending = PendingChecks() if args.deferred else None
                with deferring(pending), n, (traffic[-1] if traffic else contextlib.nullcontext()):
                    fn()
                counter.pop()
                top = ", ".join(f"{w} {k}" for w, k in n.ops.most_common(4))
                later = f" ({len(pending)} check(s) deferred to one resolve())" if pending is not None else ""
                dt = "" if x.dtype == torch.float32 else f" ({args.dtype})"
                print(f"{spec} {what}{dt}: {n.kernels} Triton launches, {sum(n.ops.values())} torch operations, "
                      f"{len(n.reads)} host syncs{later}; most from {top}")
                if traffic:
                    m = traffic.pop()
                    moved += _print_traffic(f"{spec} {what}", m, n.traffic, x.numel())
                    record[what] = _per_element(m, n.traffic, x.numel())
                if pending is not None:
                    pending.resolve()
                if args.host_time:
                    us = _host_us(fn, args.deferred, skip)
                    print(f"{spec} {what}{dt}: host work besides the launches {us:.1f} us")
            if args.traffic:
                copy = 2 * x.numel() * x.element_size()
                print(f"{spec}: encode + decode move {moved / x.numel():.2f} B per element, a copy of the input "
                      f"{copy / x.numel():.0f}: at the copy's bandwidth their time is at least {moved / copy:.2f} "
                      f"copies, a ratio to the copy of at most {copy / moved:.3f}")
                record["ratio_bound"] = round(copy / moved, 4)
    if args.json:
        import json
        from pathlib import Path

        cmd = "python scripts/gpu_op_count.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
        Path(args.json).write_text(json.dumps({
            "command": cmd, "shape": list(shape), "dtype": args.dtype,
            "about": "bytes per input element each encode and decode moves in device memory, per Triton kernel "
                     "(distinct 32-byte sectors, counted under Triton's interpreter) and in torch operations: a "
                     "model, not a measurement", "codecs": model}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _per_element(m: MemoryTraffic, torch_bytes: int, numel: int) -> dict:
    """What one call moved, per element of the input: in all, per kernel (launches and bytes), in torch
    operations."""
    read, written, _ = m.bytes()
    kernels = {k: {"launches": n, "bytes_per_element": round(b / numel, 4)} for k, (n, b, _) in m.per_kernel().items()}
    return {"bytes_per_element": round((read + written + torch_bytes) / numel, 4),
            "torch_bytes_per_element": round(torch_bytes / numel, 4), "kernels": kernels}


def _print_traffic(what: str, m: MemoryTraffic, torch_bytes: int, numel: int) -> int:
    """Print what one call moved (:class:`MemoryTraffic` of its launches, ``torch_bytes`` of its torch
    operations), per element of the input and per kernel; return the bytes."""
    read, written, _ = m.bytes()
    top = sorted(m.per_kernel().items(), key=lambda kv: -kv[1][1])
    kernels = ", ".join(f"{k} x{n} {b / numel:.2f}" + (f" (+{a / numel:.2f} again)" if a >= numel / 100 else "")
                        for k, (n, b, a) in top)
    total = read + written + torch_bytes
    print(f"{what}: moves {total / numel:.2f} B per element (Triton kernels read {read / numel:.2f}, write "
          f"{written / numel:.2f}; torch operations {torch_bytes / numel:.2f}); per kernel: {kernels or 'none'}")
    return total


def _host_us(fn, deferred: bool, skip: list) -> float:
    """Microseconds per call of ``fn`` with every Triton launch skipped: the best of 5 runs of 50 calls."""
    import time

    from qwire.codecs.kernels.deferred import PendingChecks, deferring
    from qwire.codecs.kernels.gpu import _common

    checking = _common.CHECK_CALLS
    skip[0], _common.CHECK_CALLS = True, False  # the interpreter's check of each launch's sizes: not a GPU's work
    try:
        best = float("inf")
        for _ in range(5):
            pending = PendingChecks() if deferred else None
            t0 = time.perf_counter()
            for _ in range(50):
                with deferring(pending):
                    fn()
            best = min(best, (time.perf_counter() - t0) / 50)
            if pending is not None:
                pending.discard()  # computed from skipped launches: not judged
        return best * 1e6
    finally:
        skip[0], _common.CHECK_CALLS = False, checking


if __name__ == "__main__":
    sys.exit(main())
