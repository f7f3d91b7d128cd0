"""Compile the codecs' Triton kernels for an NVIDIA H100/H200 (sm_90a) on a machine without a GPU, and say
what each compiled kernel is made of.

Usage::

    python scripts/compile_for_gpu.py --specs int4,fp8,tahquant [--shape 64,1600] [--dtype float32] [--sass]
    python scripts/compile_for_gpu.py --specs int4,fp8,tahquant --shape 1024,1600 --issue [--json OUT]
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
of them lie in loops), calls of the software 64-bit integer division, barriers, warp shuffles, memory fences and
L1 invalidations (``fences``: what an atomic with acquire-release ordering brings), and global loads and stores by
width (bits). These are counts of the code, not of its execution: a loop's body is counted once
(``in loops`` says how much of the code that is; it runs once per trip); nothing here is timed.
``--json OUT`` writes the rows.

``--issue``: how many instructions each encode and decode makes the GPU issue per input element, per kernel, and
the bound this puts on its ratio to a device copy if each of the GPU's schedulers issued one warp instruction per
clock (``--sms``, ``--clock-ghz``; the copy's rate ``--copy-gbs``: an H200's by default). The codecs run once
more under the interpreter, traced (:class:`_Tracer`): per launch, the programs that did the kernel's work, how
often each ``for`` statement ran per program, and which lines ran at all; each compiled kernel's instructions are
then counted as one thread executes them (:func:`executed`: a loop's body once per trip, a called routine once per
call, a branch's code not at all where its lines never ran, but for the lines marked ``# gpu-only``, which only a
GPU runs) and multiplied by the threads of those programs.
A model of the issue slots a call takes, not a time: it knows nothing of latency, memory or how well the GPU keeps
its schedulers busy (docs/kernels.md compares it with the H200's measurements).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
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
SOURCE = re.compile(r'//## File "(.*)", line (\d+)')  # nvdisasm -g: the source line of the instructions below
ROUTINE = re.compile(r"^(\$__internal_\w+\$__cuda_\w+):")  # a routine the kernel calls (after its own code)
CALL = re.compile(r"CALL\.REL\.NOINC `\((\$__internal_\w+\$__cuda_\w+)\)")
WIDTH = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}
# PTX that rounds otherwise than IEEE arithmetic, which the reference does: approximate functions and divisions,
# and operands or results flushed to zero where subnormal (``.ftz``)
INEXACT = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:(?:div|rcp|sqrt|rsqrt|ex2|lg2|sin|cos|tanh)\.approx|div\.full)[\w.]*"
                     r"|[a-z]\w*(?:\.\w+)*\.ftz[\w.]*)")
PTX_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
PTX_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)")


def record(specs: list[str], shape: tuple[int, ...], dtype: str, calls: list | None = None) -> list[dict]:
    """Each distinct kernel launch of the codecs' encode and decode of a ``shape`` input (must run under the
    interpreter: ``TRITON_INTERPRET=1`` before triton is imported). Bit packing goes through the kernels the Triton
    backend registers for CUDA tensors, as it would on a GPU.

    With ``calls`` (a list), each encode and decode is run once more and appended to it: ``{"spec", "call",
    "elements", "launches"}``, a launch being ``{"record"`` (its index in the records), ``"programs"`` (how many
    ran), ``"active"`` (how many did the kernel's work: not those that returned at once, which ran fewer than half
    the lines of the longest), ``"for"`` (how many times each ``for`` statement of the kernels' modules ran, per
    program, by ``"file:line"``), ``"ran"`` (the lines of those modules that ran at all)``}``: what :func:`executed`
    needs to count the instructions a GPU issues."""
    import torch

    from qwire.codecs import CodecError, get_codec, packing
    from qwire.codecs.kernels.deferred import PendingChecks, deferring
    from qwire.codecs.kernels.gpu import _packing, _refine  # noqa: F401 (_packing: the packing kernels for CUDA)

    packing.DEVICE_KERNELS["cpu"] = packing.DEVICE_KERNELS["cuda"]  # as CUDA tensors would pack
    if calls is not None:
        _refine.INTERPRETER_TILES = _refine.TILES_PER_PROGRAM  # the search's programs as a GPU runs them
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(getattr(torch, dtype))
    tracer = _Tracer()
    with tracer.watching():
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
            if calls is None:
                continue
            for what, fn in (("encode", lambda c=c: c.encode(x)),
                             ("decode", lambda c=c, p=p: c.decode(p, x.shape, x.dtype))):
                pending = PendingChecks()  # as a pipeline stage on a GPU: the checks wait for one read back
                with tracer.tracing() as launches, deferring(pending):
                    fn()
                pending.resolve()
                calls.append({"spec": spec, "call": what, "elements": x.numel(), "launches": launches})
    return tracer.seen.records


@functools.cache
def _kernel_sources() -> dict[str, str]:
    """The source of each of the kernels' modules (``qwire.codecs.kernels.gpu``), by file name: read once."""
    from qwire.codecs.kernels import gpu

    return {f.name: f.read_text() for f in Path(gpu.__file__).parent.glob("*.py")}


def _kernel_modules() -> set[str]:
    """The file names of the kernels' modules."""
    return set(_kernel_sources())


def inexact(ptx: str) -> list[str]:
    """The instructions of ``ptx`` that round otherwise than IEEE arithmetic (:data:`INEXACT`), as ``"op at
    file:line"`` of their source."""
    files = {m.group(1): Path(m.group(2)).name for m in map(PTX_FILE.match, ptx.splitlines()) if m}  # listed last
    where, out = "?", []
    for line in ptx.splitlines():
        loc = PTX_LOC.match(line)
        if loc:
            where = f"{files.get(loc.group(1), '?')}:{loc.group(2)}"
            continue
        m = INEXACT.match(line)
        if m and f"{m.group(1)} at {where}" not in out:
            out.append(f"{m.group(1)} at {where}")
    return out


def _gpu_only_lines() -> set[str]:
    """The lines of the kernels' modules marked ``# gpu-only`` (``"file:line"``): a constant branch a GPU compiles and
    the interpreter never takes (Triton's FP8 cast, ``tl.fma``), counted wherever the compiled kernel holds them."""
    return {f"{name}:{k}" for name, text in _kernel_sources().items()
            for k, line in enumerate(text.splitlines(), 1) if line.rstrip().endswith("# gpu-only")}


class _Tracer:
    """Records each distinct launch (:func:`qwire.codecs.kernels.gpu._launches.describe`); within
    :meth:`tracing`, also follows the kernels' Python under the interpreter, one launch at a time: the programs it
    runs, the lines each program runs, and how often each ``for`` statement of the kernels' modules runs."""

    def __init__(self) -> None:
        import ast
        import pkgutil

        import triton

        from qwire.codecs.kernels import gpu
        from qwire.codecs.kernels.gpu import _launches

        self.seen = _launches.Distinct()
        self.launches: list[dict] | None = None
        self.fors = {f"{name}:{node.lineno}" for name, text in _kernel_sources().items()
                     for node in ast.walk(ast.parse(text)) if isinstance(node, ast.For)}
        self.jitted = set()  # the kernels' and their helpers' functions, (file, name), in the kernels' modules
        for m in pkgutil.iter_modules(gpu.__path__):
            mod = importlib.import_module(f"{gpu.__name__}.{m.name}")
            for v in vars(mod).values():
                fn = getattr(v, "fn", None)
                if isinstance(v, triton.runtime.KernelInterface) and fn is not None:  # JIT or interpreted
                    self.jitted.add((fn.__code__.co_filename, fn.__code__.co_name))
        self.kernel: tuple[str, str] | None = None
        self.lines: list[int] = []
        self.count: collections.Counter = collections.Counter()
        self.ran: set[str] = set()

    def see(self, fn, args, constexprs) -> None:
        index = self.seen.add(fn, args, constexprs)
        if self.launches is not None:
            self.kernel = (fn.__code__.co_filename, fn.__code__.co_name)
            self.lines, self.count, self.ran = [], collections.Counter(), set()
            self.launches.append({"record": index, "lines": self.lines, "for": self.count, "ran": self.ran})

    @contextlib.contextmanager
    def watching(self):
        from qwire.codecs.kernels.gpu import _launches

        with _launches.watching(self.see):
            yield

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines[-1] += 1
            where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
            self.ran.add(where)
            if where in self.fors:
                self.count[where] += 1
        return self._local

    def _call(self, frame, event, arg):
        code = frame.f_code
        if self.kernel is None or (code.co_filename, code.co_name) not in self.jitted:
            return None
        if (code.co_filename, code.co_name) == self.kernel:  # the interpreter runs the kernel once per program
            self.lines.append(0)
        elif not self.lines:
            return None
        return self._local

    @contextlib.contextmanager
    def tracing(self):
        self.launches = launches = []
        sys.settrace(self._call)
        try:
            yield launches
        finally:
            sys.settrace(None)
            self.launches, self.kernel = None, None
        for ln in launches:
            lines = ln.pop("lines")
            ln["programs"] = len(lines)
            ln["active"] = sum(n >= max(lines) / 2 for n in lines)
            ln["for"] = {k: v / max(1, len(lines)) for k, v in ln["for"].items()}
            ln["ran"] = sorted(ln["ran"])


def _bin(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _sass(cubin: bytes) -> dict:
    """The static make-up of one compiled kernel (see the module's docstring), and what :func:`executed` needs:
    ``main`` (the instructions of the kernel's own code, before the routines it calls), ``lines`` (how many of them
    come from each source line, ``"file:line"``), ``loops`` (per loop: the source line its backward branch comes
    from, its length in instructions and where it starts), ``calls`` (per call of a routine: its name and
    position) and ``routines`` (each routine's length)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        code = subprocess.run([_bin("nvdisasm"), "-g", "-c", path], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
    ops: collections.Counter = collections.Counter()
    loads: collections.Counter = collections.Counter()
    stores: collections.Counter = collections.Counter()
    sites: list[list] = []  # the kernel's calls of routines: [routine, position]
    labels: dict[str, int] = {}  # label -> instructions before it
    routines: dict[str, int] = {}  # routine -> instructions before it, then its length
    loops: list[list] = []
    by_line: collections.Counter = collections.Counter()  # the kernel's own instructions per source line
    n = looped = 0  # looped: instructions inside loops, a backward branch's span (a branch to itself excluded)
    where = ""
    for line in code.splitlines():
        src = SOURCE.search(line)
        if src:
            where = f"{Path(src.group(1)).name}:{src.group(2)}"
            continue
        lab = LABEL.match(line)
        if lab:
            labels[lab.group(1)] = n
            continue
        sub = ROUTINE.match(line)
        if sub:
            routines[sub.group(1)] = n
            continue
        m = OPCODE.match(line)
        if not m or m.group(1) == "NOP":
            continue
        op, mods = m.group(1), m.group(2).split(".")[1:]
        ops[op] += 1
        n += 1
        if not routines:
            by_line[where] += 1
        target = BRANCH.search(line) if op == "BRA" else None
        if target and target.group(1) in labels and n - labels[target.group(1)] > 1:
            looped += n - labels[target.group(1)]
            if not routines:
                loops.append([where, n - labels[target.group(1)], labels[target.group(1)]])
        call = CALL.search(line) if op == "CALL" else None
        if call and not routines:
            sites.append([call.group(1), n])
        if op in ("LDG", "STG"):
            bits = next((WIDTH[x] for x in mods if x in WIDTH), 32)
            (loads if op == "LDG" else stores)[bits] += 1
    starts = sorted(routines.items(), key=lambda kv: kv[1]) + [("", n)]
    lengths = {name: starts[i + 1][1] - at for i, (name, at) in enumerate(starts[:-1])}

    def field(name: str) -> int:
        m = re.search(rf"{name}:(\d+)", usage)
        return int(m.group(1)) if m else -1

    return {"registers": field("REG"), "stack": field("STACK"), "instructions": n, "in_loops": looped,
            "div64_calls": len(DIV64.findall(code)), "barriers": ops["BAR"], "shuffles": ops["SHFL"],
            "fences": ops["MEMBAR"] + ops["CCTL"],
            "loads": dict(sorted(loads.items())), "stores": dict(sorted(stores.items())),
            "main": starts[0][1], "loops": loops, "calls": sites, "routines": lengths, "lines": dict(by_line)}


def compile_one(job: tuple[dict, bool]) -> tuple[bool, str, dict]:
    """Compile one record; (ok, the line to print, its --sass row)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qwire.codecs.kernels.gpu._common import COMPILE_OPTIONS

    rec, sass = job
    fn = getattr(importlib.import_module(rec["module"]), rec["kernel"])
    consts = rec["constexprs"]
    label = f"{rec['kernel']}[{','.join(f'{k}={v}' for k, v in sorted(consts.items()))}]"
    sig = {name: ("constexpr" if name in consts else rec["signature"][name]) for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in rec.get("aligned", [])}
    try:  # Triton lowers to PTX and assembles it with its own ptxas into a cubin for the target
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options={**COMPILE_OPTIONS, "num_warps": rec.get("num_warps", 4)})
        if not k.asm.get("cubin"):
            raise RuntimeError("no cubin")
        bad = inexact(k.asm["ptx"])
        if bad:
            raise RuntimeError(f"arithmetic the reference does not do (its payload bytes would differ on a GPU): "
                               f"{'; '.join(bad)}; divide with tl.div_rn, take square roots with tl.sqrt_rn, "
                               f"and compile with COMPILE_OPTIONS (gpu/_common.py)")
        row = {"kernel": rec["kernel"], "module": rec["module"].rsplit(".", 1)[-1], "constexprs": consts,
               "aligned": len(rec.get("aligned", [])), "warps": rec.get("num_warps", 4),
               "shared": k.metadata.shared}
        if sass:
            row.update(_sass(k.asm["cubin"]))
        return True, f"OK {label} cubin={len(k.asm['cubin'])} bytes shared={k.metadata.shared}", row
    except Exception as e:  # report every failure, not only the first
        return False, f"FAIL {label}: {type(e).__name__}: {str(e)[:800]}", {}


RARE = ("slowpath", "mediumpath", "_full")  # routines for the operands a fast path inline leaves (subnormal, huge)


def executed(row: dict, trips: dict[str, float], ran: set[str] | None = None,
             modules: set[str] | None = None) -> tuple[float, list[str]]:
    """The instructions one thread of a program of the compiled kernel ``row`` (:func:`_sass`) issues, with
    ``trips`` the times each ``for`` statement ran per program under the interpreter (``"file:line"``) and ``ran``
    the lines of the kernels' modules that ran there at all: its own code, but for the instructions of lines of
    those modules that never ran (a branch not taken: such as a scan the bound made needless); each loop's body once
    more per trip past the first; each routine once per call (and per trip of the loops around the call), but the
    ``RARE`` ones, which the inline fast path skips for ordinary operands (floating-point divisions and square roots
    by a subnormal or huge number). Also the loops whose trips the trace did not give (counted once). A model: a
    branch taken by some programs and not others counts in full, and the compiler's peeled loop iterations twice.
    ``modules``: the kernels' modules' file names (:func:`_kernel_modules`, found here if not given)."""
    modules = _kernel_modules() if modules is None else modules
    ours = {w for w in row["lines"] if w.split(":")[0] in modules}
    n = float(sum(k for w, k in row["lines"].items() if ran is None or w not in ours or w in ran))
    copies = collections.Counter(loop[0] for loop in row["loops"])
    unknown = []
    times = []  # per loop: (start, end, runs of its body per program)
    for where, span, start in row["loops"]:
        if where in trips:  # a statement in a helper inlined k times runs k times as often, once per copy
            t = max(1.0, trips[where] / copies[where] - 1)  # a for statement runs trips + 1 times
            n += span * (t - 1)
            times.append((start, start + span, t))
        elif ran is None or where in ran:
            unknown.append(where)
    for name, at in row["calls"]:
        if not any(r in name for r in RARE):
            k = 1.0
            for start, end, t in times:
                if start <= at <= end:
                    k *= t
            n += k * row["routines"].get(name, 0)
    return n, unknown


def issue(rows: list[dict], calls: list[dict]) -> list[dict]:
    """Per encode and decode of ``calls`` (:func:`record`), the instructions a GPU issues per input element, per
    kernel and in all: each launch's instructions per thread (:func:`executed`) times its threads and its active
    programs, over the input's elements."""
    out = []
    modules, gpu_only = _kernel_modules(), _gpu_only_lines()
    for c in calls:
        per: dict[str, float] = collections.defaultdict(float)
        unknown: set[str] = set()
        for ln in c["launches"]:
            row = rows[ln["record"]]
            if not row:  # it did not compile
                continue
            n, u = executed(row, ln["for"], set(ln["ran"]) | gpu_only, modules)
            unknown.update(u)
            per[f"{row['module']}.{row['kernel']}"] += n * 32 * row["warps"] * ln["active"] / c["elements"]
        out.append({"spec": c["spec"], "call": c["call"], "per_element": sum(per.values()),
                    "kernels": dict(sorted(per.items(), key=lambda kv: -kv[1])), "loops_not_traced": sorted(unknown)})
    return out


def issue_table(per_call: list[dict], lanes_per_s: float, copy_elements_per_s: float) -> str:
    """The --issue results as a markdown table: per codec, the instructions per element of its encode and decode,
    the kernels that issue most, and the bound that issuing them puts on the ratio to a copy."""
    by: dict[str, dict] = collections.defaultdict(dict)
    for c in per_call:
        by[c["spec"]][c["call"]] = c
    out = ["| codec | encode, instructions per element | decode | most from | bound on the ratio to a copy |",
           "|---|---:|---:|---|---:|"]
    for spec, calls in by.items():
        enc, dec = calls.get("encode"), calls.get("decode")
        total = sum(c["per_element"] for c in calls.values())
        kernels: collections.Counter = collections.Counter()
        for c in calls.values():
            kernels.update(c["kernels"])
        top = ", ".join(f"`{k.split('.')[-1]}` {v:.0f}" for k, v in kernels.most_common(3))
        bound = lanes_per_s / total / copy_elements_per_s if total else float("inf")
        out.append(f"| `{spec}` | {enc['per_element'] if enc else 0:.1f} | {dec['per_element'] if dec else 0:.1f} "
                   f"| {top} | {bound:.2f} |")
    return "\n".join(out)


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
    ap.add_argument("--issue", action="store_true",
                    help="with --specs: the instructions each encode and decode issues per element on the GPU, and "
                         "the bound issuing them puts on the ratio to a copy (a model)")
    ap.add_argument("--sms", type=int, default=132, help="--issue: the GPU's multiprocessors (H200: 132)")
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="--issue: their clock (H200: 1.98 GHz)")
    ap.add_argument("--copy-gbs", type=float, default=2077.0,
                    help="--issue: a device copy's rate, GB of input per second (H200, docs/results/gpu.md: 2077)")
    ap.add_argument("--json", help="write the --sass rows here (with --issue, also the counts per call)")
    ap.add_argument("--record-to", help=argparse.SUPPRESS)  # the child process of --specs
    args = ap.parse_args(argv)
    if args.record_to:
        shape = tuple(int(v) for v in args.shape.split(","))
        calls: list | None = [] if args.issue else None
        records = record(args.specs.split(","), shape, args.dtype, calls)
        Path(args.record_to).write_text(json.dumps({"records": records, "calls": calls}))
        return 0
    if bool(args.launches) == bool(args.specs):
        ap.error("give either a LAUNCHES.json file or --specs")
    if args.issue and not args.specs:
        ap.error("--issue needs --specs (it runs the codecs)")
    calls = None
    if args.specs:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "launches.json")
            env = dict(os.environ, TRITON_INTERPRET="1")
            subprocess.run([sys.executable, __file__, "--specs", args.specs, "--shape", args.shape, "--dtype",
                            args.dtype, "--record-to", path] + (["--issue"] if args.issue else []), env=env,
                           check=True)
            got = json.loads(Path(path).read_text())
            records, calls = got["records"], got["calls"]
    else:
        records = json.loads(Path(args.launches).read_text())
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("compiling needs TRITON_INTERPRET unset (the kernels must be Triton's JIT functions)")
    workers = max(1, min(len(records), os.cpu_count() or 1))
    sass = args.sass or args.issue
    from qwire.procs import die_with_parent

    # the compiles are independent: one per core; a worker ends with this process (a test's timeout kills it)
    with ProcessPoolExecutor(workers, initializer=die_with_parent) as pool:
        results = list(pool.map(compile_one, [(r, sass) for r in records]))
    for _, line, _ in results:
        print(line)
    rows = [row for ok, _, row in results if ok]
    if args.sass:
        print(table(rows))
    out: object = rows
    if args.issue:
        per_call = issue([row for _, _, row in results], calls)
        lanes = args.sms * 4 * 32 * args.clock_ghz * 1e9  # 4 schedulers per SM, a warp's instruction per clock
        import torch

        copy = args.copy_gbs * 1e9 / torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
        print(issue_table(per_call, lanes, copy))
        missing = sorted({w for c in per_call for w in c["loops_not_traced"]})
        if missing:
            print(f"loops whose trips were not traced (counted once): {', '.join(missing)}")
        cmd = "python scripts/compile_for_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
        out = {"command": cmd, "shape": [int(v) for v in args.shape.split(",")], "dtype": args.dtype,
               "gpu": {"sms": args.sms, "clock_ghz": args.clock_ghz, "copy_gbs": args.copy_gbs},
               "about": "instructions the GPU issues per input element (each thread's executed instructions of the "
                        "compiled kernel, loops by the trips traced under Triton's interpreter, times the threads "
                        "of the programs that did work), and the bound on the ratio to a copy if the GPU issued "
                        "one instruction per scheduler and clock: a model, not a measurement",
               "calls": per_call, "kernels": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(ok for ok, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
