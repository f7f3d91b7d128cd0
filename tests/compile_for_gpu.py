"""Compile recorded Triton kernel launches for an NVIDIA H100/H200 (sm_90a) on a machine without a GPU.

Usage: ``python tests/compile_for_gpu.py LAUNCHES.json`` where the file holds a list of
``{"module", "kernel", "signature", "constexprs"}`` records (see tests/test_kernels_compile.py). Must run
without ``TRITON_INTERPRET`` (the kernels must be ``JITFunction`` objects). Prints one line per record:
``OK <label> ...`` or ``FAIL <label>: <error>``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(rec: dict) -> tuple[bool, str]:
    """Compile one recorded launch; (ok, the line to print)."""
    fn = getattr(importlib.import_module(rec["module"]), rec["kernel"])
    label = f"{rec['kernel']}[{','.join(f'{k}={v}' for k, v in sorted(rec['constexprs'].items()))}]"
    sig = {name: ("constexpr" if name in rec["constexprs"] else rec["signature"][name]) for name in fn.arg_names}
    try:  # Triton lowers to PTX and assembles it with its own ptxas into a cubin for the target
        k = triton.compile(ASTSource(fn, sig, rec["constexprs"]), target=TARGET,
                           options={"enable_fp_fusion": False, "num_warps": 4})
        if not k.asm.get("cubin"):
            raise RuntimeError("no cubin")
        return True, f"OK {label} cubin={len(k.asm['cubin'])} bytes shared={k.metadata.shared}"
    except Exception as e:  # report every failure, not only the first
        return False, f"FAIL {label}: {type(e).__name__}: {str(e)[:800]}"


def main(path: str) -> int:
    records = json.load(open(path))
    workers = max(1, min(len(records), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:  # the compiles are independent: one per core
        results = list(pool.map(compile_one, records))
    for _, line in results:
        print(line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
