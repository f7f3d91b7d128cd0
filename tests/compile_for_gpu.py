"""Compile recorded Triton kernel launches for an NVIDIA H100/H200 (sm_90a) on a machine without a GPU.

Usage: ``python tests/compile_for_gpu.py LAUNCHES.json`` where the file holds a list of
``{"module", "kernel", "signature", "constexprs"}`` records (see tests/test_kernels_compile.py). Must run
without ``TRITON_INTERPRET`` (the kernels must be ``JITFunction`` objects). Prints one line per record:
``OK <label> ...`` or ``FAIL <label>: <error>``.
"""

from __future__ import annotations

import importlib
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def main(path: str) -> int:
    failed = 0
    for rec in json.load(open(path)):
        fn = getattr(importlib.import_module(rec["module"]), rec["kernel"])
        label = f"{rec['kernel']}[{','.join(f'{k}={v}' for k, v in sorted(rec['constexprs'].items()))}]"
        sig = {name: ("constexpr" if name in rec["constexprs"] else rec["signature"][name]) for name in fn.arg_names}
        try:  # Triton lowers to PTX and assembles it with its own ptxas into a cubin for the target
            k = triton.compile(ASTSource(fn, sig, rec["constexprs"]), target=TARGET,
                               options={"enable_fp_fusion": False, "num_warps": 4})
            if not k.asm.get("cubin"):
                raise RuntimeError("no cubin")
            print(f"OK {label} cubin={len(k.asm['cubin'])} bytes shared={k.metadata.shared}")
        except Exception as e:  # report every failure, not only the first
            failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e)[:800]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
