"""Compile the codecs' Triton kernels for an NVIDIA H100/H200 (sm_90a) on a machine without a GPU, and say
what each compiled kernel is made of.

Usage::

    python scripts/compile_for_gpu.py --specs int4,fp8,tahquant [--shape 64,1600] [--dtype float32] [--sass]
    python scripts/compile_for_gpu.py LAUNCHES.json [--sass]

The first form runs each codec's encode and decode under Triton's interpreter on a CPU tensor of that shape
(in a child process), records every kernel launch as Triton's JIT would compile it on a GPU
(:mod:`qwire.codecs.kernels.gpu._launches`: the arguments' types, the compile-time constants, which pointers
and integers are 16-divisible), then compiles each distinct launch with Triton's compiler and the ptxas in its
wheel, one process per core. The second compiles records written by ``_launches.describe`` (as
tests/test_kernels_compile.py does). Prints ``OK <kernel>[constants] ...`` or ``FAIL <kernel>: <error>`` per
record; exits 1 if any failed.

``--sass``: a table of each compiled kernel's static make-up, from its machine code (nvdisasm and cuobjdump in
Triton's wheel): registers per thread, stack bytes (register spills), shared memory, instructions (and how many
of them lie in loops), calls of the software 64-bit integer division, barriers, warp shuffles, and global loads
and stores by width (bits). These are counts of the code, not of its execution: a loop's body is counted once
(``in loops`` says how much of the code that is; it runs once per trip); nothing here is timed.
``--json OUT`` writes the rows.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

DIV64 = re.compile(r"CALL\.REL\.NOINC `\(\$__internal_\d+_\$__cuda_sm20_(?:div|rem)_[su]64\)")
OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
WIDTH = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}


def record(specs: list[str], shape: tuple[int, ...], dtype: str) -> list[dict]:
    """Each distinct kernel launch of the codecs' encode and decode of a ``shape`` input (must run under the
    interpreter: ``TRITON_INTERPRET=1`` before triton is imported)."""
    import torch

    from qwire.codecs import CodecError, get_codec
    from qwire.codecs.kernels.gpu import _launches

    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(getattr(torch, dtype))
    with _launches.recording() as records:
        for spec in specs:
            c = get_codec(spec, impl="triton")
            try:
                p = c.encode(x)
            except CodecError as e:
                if "does not cover" not in str(e):
                    raise
                print(f"{spec}: no Triton kernels (it runs the torch reference on CUDA tensors)", file=sys.stderr)
                continue
            c.decode(p, x.shape, x.dtype)
    return records


def _bin(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _sass(cubin: bytes) -> dict:
    """The static make-up of one compiled kernel (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        code = subprocess.run([_bin("nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
    ops: collections.Counter = collections.Counter()
    loads: collections.Counter = collections.Counter()
    stores: collections.Counter = collections.Counter()
    labels: dict[str, int] = {}  # label -> instructions before it
    n = looped = 0  # looped: instructions inside loops, a backward branch's span (a branch to itself excluded)
    for line in code.splitlines():
        lab = LABEL.match(line)
        if lab:
            labels[lab.group(1)] = n
        m = OPCODE.match(line)
        if not m or m.group(1) == "NOP":
            continue
        op, mods = m.group(1), m.group(2).split(".")[1:]
        ops[op] += 1
        n += 1
        target = BRANCH.search(line) if op == "BRA" else None
        if target and target.group(1) in labels and n - labels[target.group(1)] > 1:
            looped += n - labels[target.group(1)]
        if op in ("LDG", "STG"):
            bits = next((WIDTH[x] for x in mods if x in WIDTH), 32)
            (loads if op == "LDG" else stores)[bits] += 1

    def field(name: str) -> int:
        m = re.search(rf"{name}:(\d+)", usage)
        return int(m.group(1)) if m else -1

    return {"registers": field("REG"), "stack": field("STACK"), "instructions": n, "in_loops": looped,
            "div64_calls": len(DIV64.findall(code)), "barriers": ops["BAR"], "shuffles": ops["SHFL"],
            "loads": dict(sorted(loads.items())), "stores": dict(sorted(stores.items()))}


def compile_one(job: tuple[dict, bool]) -> tuple[bool, str, dict]:
    """Compile one record; (ok, the line to print, its --sass row)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rec, sass = job
    fn = getattr(importlib.import_module(rec["module"]), rec["kernel"])
    consts = rec["constexprs"]
    label = f"{rec['kernel']}[{','.join(f'{k}={v}' for k, v in sorted(consts.items()))}]"
    sig = {name: ("constexpr" if name in consts else rec["signature"][name]) for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in rec.get("aligned", [])}
    try:  # Triton lowers to PTX and assembles it with its own ptxas into a cubin for the target
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"enable_fp_fusion": False, "num_warps": rec.get("num_warps", 4)})
        if not k.asm.get("cubin"):
            raise RuntimeError("no cubin")
        row = {"kernel": rec["kernel"], "module": rec["module"].rsplit(".", 1)[-1], "constexprs": consts,
               "aligned": len(rec.get("aligned", [])), "warps": rec.get("num_warps", 4),
               "shared": k.metadata.shared}
        if sass:
            row.update(_sass(k.asm["cubin"]))
        return True, f"OK {label} cubin={len(k.asm['cubin'])} bytes shared={k.metadata.shared}", row
    except Exception as e:  # report every failure, not only the first
        return False, f"FAIL {label}: {type(e).__name__}: {str(e)[:800]}", {}


def _widths(c: dict) -> str:
    return " + ".join(f"{n}x{b}" for b, n in c.items()) or "-"


def table(rows: list[dict]) -> str:
    """The --sass rows as a markdown table."""
    shown = ("G", "BG", "BT", "GB", "BITS", "BLOCK", "ROWS8", "SYM", "TACO", "HADAMARD", "FLOAT", "NCH")
    out = ["| kernel | constants | warps | registers | stack B | shared B | instructions | in loops | 64-bit divisions "
           "| barriers | shuffles | global loads | global stores |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        cx = ",".join(f"{k}={v}" for k, v in r["constexprs"].items() if k in shown)
        out.append(f"| {r['module']}.{r['kernel']} | {cx} | {r['warps']} | {r['registers']} | {r['stack']} "
                   f"| {r['shared']} | {r['instructions']} | {r['in_loops']} | {r['div64_calls']} | {r['barriers']} "
                   f"| {r['shuffles']} | {_widths(r['loads'])} | {_widths(r['stores'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("launches", nargs="?", help="a JSON list of launch records (instead of --specs)")
    ap.add_argument("--specs", help="codecs whose kernels to record and compile, comma-separated")
    ap.add_argument("--shape", default="64,1600", help="the input's shape (default 64,1600)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--sass", action="store_true", help="print each kernel's static make-up as a table")
    ap.add_argument("--json", help="write the --sass rows here")
    ap.add_argument("--record-to", help=argparse.SUPPRESS)  # the child process of --specs
    args = ap.parse_args(argv)
    if args.record_to:
        shape = tuple(int(v) for v in args.shape.split(","))
        Path(args.record_to).write_text(json.dumps(record(args.specs.split(","), shape, args.dtype)))
        return 0
    if bool(args.launches) == bool(args.specs):
        ap.error("give either a LAUNCHES.json file or --specs")
    if args.specs:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "launches.json")
            env = dict(os.environ, TRITON_INTERPRET="1")
            subprocess.run([sys.executable, __file__, "--specs", args.specs, "--shape", args.shape, "--dtype",
                            args.dtype, "--record-to", path], env=env, check=True)
            records = json.loads(Path(path).read_text())
    else:
        records = json.loads(Path(args.launches).read_text())
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("compiling needs TRITON_INTERPRET unset (the kernels must be Triton's JIT functions)")
    workers = max(1, min(len(records), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:  # the compiles are independent: one per core
        results = list(pool.map(compile_one, [(r, args.sass) for r in records]))
    for _, line, _ in results:
        print(line)
    rows = [row for ok, _, row in results if ok]
    if args.sass:
        print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(ok for ok, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
