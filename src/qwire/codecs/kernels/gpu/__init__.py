"""The ``triton`` backend: codec kernels written in Triton, for CUDA tensors.

Why Triton: it ships as a wheel beside torch on every Linux GPU install (no
CUDA toolkit or compiler step for the user), compiles each kernel for the
GPU at hand on first use and caches it on disk, and the same kernel source
runs on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), which is
how the tests check its payloads on machines without a GPU.

The kernels write the payload format of each codec's torch reference. Where
the work per tile is small and irregular (a ``log`` metadata layout's fit),
it stays in torch on the GPU; the passes over the elements (statistics,
quantize + bit-pack, unpack + dequantize, the Hadamard butterfly) are Triton.

Arithmetic that must round like the reference: every division is
``tl.div_rn`` and every square root ``tl.sqrt_rn`` (IEEE, not the fast
approximations), kernels are compiled without multiply-add contraction and
use ``tl.fma`` where the reference's ``addcmul`` is fused. FP8 codes are
the hardware's conversions on GPUs from sm_89 on (round to nearest even and
saturating, as torch's cast after the reference's clamp); on older GPUs,
which have none, and under the interpreter, whose cast rounds half up, they
are computed with integer arithmetic
(:func:`~qwire.codecs.kernels.gpu._common.soft_fp8`). Under the
interpreter, whose ``fma`` rounds twice, the fused multiply-add is computed
in fp64 and rounded once (exact for these operands but for ties of
probability ~2^-29).

Importing this package imports triton (an ImportError makes the backend
unavailable: :mod:`qwire.codecs.kernels` then runs the torch reference on
CUDA tensors and says so once) and every kernel module in it.
"""

from __future__ import annotations

import importlib
import pkgutil

import triton  # noqa: F401  (the backend is unavailable without it)

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")
importlib.import_module(f"{__name__}._packing")  # bit packing of CUDA tensors (qwire.codecs.packing.DEVICE_KERNELS)
importlib.import_module("qwire.codecs.kernels.graphs")  # their kernels may run as CUDA graphs (--codec-graphs)
