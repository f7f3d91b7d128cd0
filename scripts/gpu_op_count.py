"""Count what a codec's GPU path launches, without a GPU.

Usage: ``python scripts/gpu_op_count.py [--specs int4,tahquant] [--shape 64,1600]``

Runs each codec's Triton implementation under Triton's interpreter on CPU tensors and counts, per encode and
per decode, the torch operations it makes outside the Triton kernels (on a GPU each is a kernel launch, or a
host sync where it reads a value back), the host syncs among them (reading a value back, or an output whose
size depends on the values: ``nonzero``, ``unique``, boolean indexing) and the Triton kernel launches, with the
functions that make the most operations.
Bit packing goes through the kernels the Triton backend registers for CUDA tensors, as it would on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from qwire.codecs import get_codec  # noqa: E402

# operations that launch nothing (views, allocations)
FREE = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "as_strided", "t",
        "permute", "detach", "alias", "empty", "empty_like", "empty_strided", "lift_fresh"}
# operations that wait for the GPU: a value read back, or an output sized by the values
SYNCS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
         "is_nonzero", "equal"}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.kernels = 0
        self.syncs = 0

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def tolist(t, *a, **kw):  # reads the values back without dispatching an operation
            self.syncs += 1
            return self._tolist(t, *a, **kw)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCS or (name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                     for i in (args[1] if len(args) > 1 else ()) if i is not None)):
            self.syncs += 1
        stack = traceback.extract_stack()
        in_kernel = any(f.filename.endswith(("_common.py",)) and f.name == "launch" for f in stack)
        if name not in FREE and not in_kernel:
            where = [f for f in stack if f"{os.sep}qwire{os.sep}" in f.filename]
            self.ops[f"{where[-1].filename.split(os.sep + 'qwire' + os.sep)[-1]}:{where[-1].name}" if where
                     else "?"] += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default="int4,fp8,tahquant")
    ap.add_argument("--shape", default="64,1600")
    args = ap.parse_args(argv)
    from qwire.codecs.kernels.gpu import _common

    original = _common.launch
    counter: list[_Count] = []

    def counting(kernel, grid, *a, **kw):
        if counter:
            counter[-1].kernels += 1
        return original(kernel, grid, *a, **kw)

    import importlib
    import pkgutil

    import qwire.codecs.kernels.gpu as gpu

    for m in pkgutil.iter_modules(gpu.__path__):
        mod = importlib.import_module(f"{gpu.__name__}.{m.name}")
        if getattr(mod, "launch", None) is original:
            mod.launch = counting
    from qwire.codecs import packing

    packing.DEVICE_KERNELS["cpu"] = packing.DEVICE_KERNELS["cuda"]  # as CUDA tensors would pack
    shape = tuple(int(v) for v in args.shape.split(","))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for spec in [s.strip() for s in args.specs.split(",") if s.strip()]:
        c = get_codec(spec, impl="triton")
        p = c.encode(x)
        c.decode(p, x.shape, x.dtype)
        for what, fn in (("encode", lambda c=c: c.encode(x)), ("decode", lambda c=c, p=p: c.decode(p, x.shape,
                                                                                                  x.dtype))):
            n = _Count()
            counter.append(n)
            with n:
                fn()
            counter.pop()
            top = ", ".join(f"{w} {k}" for w, k in n.ops.most_common(4))
            print(f"{spec} {what}: {n.kernels} Triton launches, {sum(n.ops.values())} torch operations, "
                  f"{n.syncs} host syncs; most from {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
