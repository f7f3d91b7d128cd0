"""The Triton kernels compile for an NVIDIA H100/H200 (sm_90a), checked where there is no GPU.

The interpreter (TRITON_INTERPRET=1) runs the kernels' Python, which accepts things the compiler does not.
Here every kernel launch that a set of codecs makes is recorded as it runs under the interpreter (the
kernel, its arguments' types, its constexprs, which arguments the JIT would mark 16-divisible), then Triton's
compiler and ptxas build each one for sm_90a in a fresh process without the interpreter
(scripts/compile_for_gpu.py). Nothing runs on a GPU: this checks compilation, not results.
The builds are kept in Triton's cache under ``~/.cache/qwire/triton-sm90`` (``$XDG_CACHE_HOME/qwire/...``), and
the recorded launches beside it (``triton-sm90-launches``), under a key of the codecs' sources.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from qwire.codecs import get_codec

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compile_for_gpu.py"
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not PTXAS.exists(),
    reason="records launches under Triton's interpreter and compiles with the ptxas in Triton's wheel")

SPECS = ["int4", "int3:layout=ref", "int4:symmetric=true", "int8:tile=8192", "int2", "blockwise8", "blockwise4",
         "blockwise:bits=3,block=100", "fp4", "blockfp:bits=8", "fp8", "fp8:format=e5m2", "fp8:hadamard=false",
         "fp8:group=32", "fp8plain", "perchannel6", "perchannel4:layout=fp32", "fp16",
         "tahquant:slots=token,ratio=0.8,layout=logx,zero_ext=8",
         "tahquant:tile=8,ratio=1.0,slots=token", "tahquant:tile=256,slots=token",
         "tahquant:tile=64,high_bits=5,low_bits=4,ratio=0.1,unit=token,max_rotated=0.25,slots=token",
         "tahquant", "tahquant:ratio=0.8", "tahquant:tile=8", "tahquant:tile=64,zero_ext=0",
         "tahquant:fit_rotated=true", "tahquant:fit_rotated=true,ratio=0.8"]


def _record() -> list[dict]:
    """Run the codecs' Triton kernels under the interpreter and keep each distinct launch, as a GPU's JIT would
    compile it (:mod:`qwire.codecs.kernels.gpu._launches`)."""
    from qwire.codecs.kernels.gpu import _launches, _packing

    with _launches.recording() as records:
        _run_codecs(_packing)
    return records


def _run_codecs(_packing) -> None:
    g = torch.Generator().manual_seed(0)
    for spec in SPECS:
        c = get_codec(spec + ("," if ":" in spec else ":") + "impl=triton")
        for shape in ((2, 16, 1024), (3, 100)):
            x = torch.randn(shape, generator=g) * 3
            x[..., 0] *= 50  # an outlier per row (tahquant rotates)
            c.decode(c.encode(x), x.shape, x.dtype)
    for spec in ("int4:layout=log7,fit=mse", "blockwise8", "fp8", "perchannel6", "tahquant", "fp16"):  # bf16 as it is
        c = get_codec(spec + ("," if ":" in spec else ":") + "impl=triton")
        x = (torch.randn(2, 16, 1024, generator=g) * 3).to(torch.bfloat16)
        c.decode(c.encode(x), x.shape, x.dtype)
    from qwire.codecs.kernels.deferred import PendingChecks, deferring

    for spec in ("int4", "fp8", "blockwise8"):  # deferred checks: the decoders' conditional scan of their values
        c = get_codec(spec + ":impl=triton")
        x = torch.randn(2, 16, 1024, generator=g)
        with deferring(PendingChecks()) as pending:
            c.decode(c.encode(x), x.shape, x.dtype)
        pending.resolve()
    for bits in range(1, 8):  # the bit packing of CUDA tensors (packing.DEVICE_KERNELS), every width
        codes = torch.randint(0, 1 << bits, (100,), generator=g, dtype=torch.uint8)
        _packing.unpack_bits(_packing.pack_bits(codes, bits), bits, 100)


def _launches() -> list[dict]:
    """The launches :func:`_record` finds, and the FP8 kernels' again as a GPU before sm_89 runs them (no FP8
    conversion there: integer arithmetic, SOFT_FP8)."""
    launches = _record()
    return launches + [{**r, "constexprs": {**r["constexprs"], "SOFT_FP8": True}} for r in launches
                       if "SOFT_FP8" in r["constexprs"]]


def _cached_launches() -> list[dict]:
    """:func:`_launches`, kept beside the compile cache under a key of everything that decides them (the codecs'
    sources, this file, torch's and Triton's versions): recording them under the interpreter takes a minute,
    and the same sources record the same launches."""
    import hashlib

    from qwire.checkpoint import atomic_write

    key = hashlib.sha256(f"{torch.__version__} {triton.__version__}".encode())
    root = Path(__file__).resolve().parents[1]
    for p in sorted([*(root / "src" / "qwire" / "codecs").rglob("*.py"), Path(__file__).resolve()]):
        key.update(p.relative_to(root).as_posix().encode() + p.read_bytes())
    path = Path(_env()["TRITON_CACHE_DIR"] + "-launches") / f"{key.hexdigest()[:32]}.json"
    if path.exists():
        return json.loads(path.read_text())
    launches = _launches()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(launches))  # whole or absent, whichever worker writes it
    return launches


@pytest.mark.timeout(1200)  # a fresh machine compiles every launch (below)
def test_every_kernel_launch_compiles_for_sm90(tmp_path):
    launches = _cached_launches()
    kernels = {r["kernel"] for r in launches}
    assert {"_tile_stats", "_quant_pack", "_unpack_dequant", "_tah_stats", "_stream_quant_pack",
            "_stream_unpack_dequant", "_absmax", "_encode", "_decode", "_refine_log", "_need",
            "_codes", "_pack", "_unpack", "_rotate", "_unrotate", "_read", "_decode_log", "_decide", "_widths",
            "_block_pack", "_compact", "_block_heads", "_block_values", "_scan_beyond"} <= kernels, kernels
    assert any(r["constexprs"].get("SOFT_FP8") for r in launches)
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches))
    # Triton's cache keys a kernel by its source (and its callees'), signature, constexprs, options, target and
    # Triton's version, so a kernel found there compiled before exactly as asked now: only new or changed ones
    # are built again: all of them on a fresh machine (292 launches: 130 s on 2 idle cores, twice that beside
    # another test's processes), 4 s once they are in the cache
    done = subprocess.run([sys.executable, str(SCRIPT), str(path)],
                          capture_output=True, text=True, env=_env(), timeout=1000)
    lines = done.stdout.splitlines()
    failed = [ln for ln in lines if ln.startswith("FAIL")]
    # a compile also fails where its PTX rounds otherwise than IEEE arithmetic (compile_for_gpu.inexact)
    assert not failed and done.returncode == 0, "\n".join(failed) or done.stderr[-3000:]
    assert sum(ln.startswith("OK ") for ln in lines) == len(launches)


def _env() -> dict:
    """The environment of a compile: no interpreter, and Triton's cache where the compile test keeps it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "qwire", "triton-sm90")
    return env


def _script():
    """scripts/compile_for_gpu.py as a module (its model of the instructions a GPU issues)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compile_for_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_element_kernels_load_wide_and_index_without_64_bit_divisions():
    """The passes over every element (quantize + pack, unpack + dequantize) of an aligned input, as compiled
    for sm_90a: 128-bit loads or stores of the fp32 values, and no call of the 64-bit division (a software
    routine of tens of instructions on a GPU): below 2^31 elements their indices are int32 (there were 8 to 32
    calls for 16 codes when each code was divided in int64, then one per code group of 8). Their atomics (the
    checks' maxima) are relaxed: an acquire-release atomic brought a memory fence and an invalidation of the
    multiprocessor's L1 cache into every program."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        done = subprocess.run([sys.executable, str(SCRIPT), "--specs",
                               "int4,perchannel6,blockwise4,blockwise:block=100,tahquant:fit=minmax",
                               "--shape", "16,1024", "--sass", "--json", out], capture_output=True, text=True,
                              env=_env(), timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        rows = json.loads(Path(out).read_text())
    hot = {"_quant_pack", "_unpack_dequant", "_stream_quant_pack", "_stream_unpack_dequant", "_encode",
           "_encode_blocks", "_decode", "_decode_log", "_tile_stats", "_tah_stats"}
    seen = {r["kernel"] for r in rows if r["kernel"] in hot}
    assert seen == hot, seen
    for r in rows:
        if r["kernel"] in hot:
            assert r["loads"].get("128", 0) + r["stores"].get("128", 0) > 0, r
            assert r["div64_calls"] == 0, r
            assert r["fences"] == 0, r  # the check's atomics are relaxed: no fence, no L1 invalidation


def test_inexact_ptx_is_found_with_its_source_line():
    """``compile_for_gpu.inexact``, which fails a compile (and so the test above) whose PTX rounds otherwise than
    the reference: Triton's fp32 ``/`` (``div.full``), approximate functions, and anything flushing subnormals to
    zero (``.ftz``: what ``tl.floor`` becomes with Triton's default ``enable_reflect_ftz``); IEEE division, square
    root and floor pass. The ``.file`` table comes after the code, as LLVM writes it."""
    ptx = "\n".join([
        "\t.loc\t1 12 5", "\tdiv.rn.f32 \t%r1, %r2, %r3;", "\tsqrt.rn.f32 \t%r4, %r1;",
        "\tcvt.rmi.f32.f32 \t%r5, %r4;", "\tmax.NaN.f32 \t%r5, %r5, %r1;",
        "\t.loc\t2 30 9", "\tdiv.full.f32 \t%r6, %r1, %r2;", "\t@%p1 cvt.rmi.ftz.f32.f32 \t%r7, %r6;",
        "\t.loc\t1 40 1", "\tex2.approx.f32 \t%r8, %r7;", "\tdiv.full.f32 \t%r9, %r8, %r2;",
        "\t.file\t1 \"/src/qwire/codecs/kernels/gpu/_fit.py\"", "\t.file\t2 \"/src/x/_common.py\""])
    assert _script().inexact(ptx) == ["div.full.f32 at _common.py:30", "cvt.rmi.ftz.f32.f32 at _common.py:30",
                                      "ex2.approx.f32 at _fit.py:40", "div.full.f32 at _fit.py:40"]


def test_int32_indices_issue_fewer_instructions_than_int64(tmp_path, monkeypatch):
    """The premise of the kernels' ``I64``: the same launches recorded with int64 indices (``INDEX_LIMIT`` at 0)
    compile to code that calls the 64-bit division and issues more instructions per thread (by the model of
    ``compile_for_gpu.executed``) than with int32 indices."""
    from qwire.codecs.kernels.gpu import _common, _launches

    x = torch.randn(16, 1024)
    c = get_codec("int4:impl=triton")
    with _launches.recording() as narrow:
        c.decode(c.encode(x), x.shape, x.dtype)
    monkeypatch.setattr(_common, "INDEX_LIMIT", 0)
    with _launches.recording() as wide:
        c.decode(c.encode(x), x.shape, x.dtype)
    monkeypatch.undo()
    assert {r["constexprs"].get("I64") for r in narrow} == {False} and {r["constexprs"]["I64"] for r in wide} == {True}
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(narrow + wide))
    rows = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(path), "--sass", "--json", str(rows)],
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    got = json.loads(rows.read_text())
    script = _script()
    by = {(r["kernel"], r["constexprs"]["I64"]): r for r in got}
    for kernel in ("_tile_stats", "_quant_pack", "_decode_log"):
        n32, _ = script.executed(by[kernel, False], {})
        n64, _ = script.executed(by[kernel, True], {})
        assert n32 < n64, (kernel, n32, n64)
    assert by["_decode_log", False]["div64_calls"] == 0 < by["_decode_log", True]["div64_calls"]


def test_the_issue_model_counts_loops_calls_and_lines_that_ran():
    """``executed``: the kernel's own instructions but those of lines of the kernels' modules that never ran, a
    loop's body once per trip, a routine per call and trip of the loops around it, the rare slow paths never."""
    script = _script()
    row = {"lines": {"_common.py:1": 100, "_common.py:2": 30, "standard.py:9": 5},
           "loops": [["_common.py:1", 20, 50]],
           "calls": [["$__internal_0_$__cuda_sm20_div_s64", 60], ["$__internal_1_$__cuda_sm20_div_s64", 200],
                     ["$__internal_2_$__cuda_sm3x_div_rn_noftz_f32_slowpath", 10]],
           "routines": {"$__internal_0_$__cuda_sm20_div_s64": 40, "$__internal_1_$__cuda_sm20_div_s64": 40,
                        "$__internal_2_$__cuda_sm3x_div_rn_noftz_f32_slowpath": 99}}
    # the for statement ran 5 times per program: 4 trips, the body 3 times more; the call at 60 is in the loop
    n, unknown = script.executed(row, {"_common.py:1": 5.0}, {"_common.py:1", "standard.py:9"})
    assert unknown == []
    assert n == 100 + 5 + 20 * 3 + 40 * 4 + 40  # line 2 never ran; the slow path is not counted
    n, unknown = script.executed(row, {}, None)  # no trace: every line, each loop once
    assert unknown == ["_common.py:1"] and n == 135 + 40 + 40


def test_the_issue_model_of_a_codec_end_to_end(tmp_path):
    """``compile_for_gpu.py --issue``: per encode and decode, the instructions per element of each kernel, every
    loop's trips found in the trace (tahquant's search loops over its tiles' chunks), and the table."""
    out = tmp_path / "issue.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--specs", "int4,tahquant", "--shape", "4,512", "--issue",
                           "--json", str(out)], capture_output=True, text=True, env=_env(), timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "| codec | encode, instructions per element |" in done.stdout
    got = json.loads(out.read_text())
    calls = {(c["spec"], c["call"]): c for c in got["calls"]}
    assert set(calls) == {("int4", "encode"), ("int4", "decode"), ("tahquant", "encode"), ("tahquant", "decode")}
    assert set(calls["int4", "decode"]["kernels"]) == {"direct._decode_log"}
    assert "_refine._refine_log" in calls["tahquant", "encode"]["kernels"]
    for c in calls.values():
        assert c["per_element"] > 0 and c["loops_not_traced"] == [], c
        assert abs(sum(c["kernels"].values()) - c["per_element"]) < 1e-6


if __name__ == "__main__":  # TRITON_INTERPRET=1 python tests/test_kernels_compile.py OUT.json: the launches, to
    # compile with another Triton (python scripts/compile_for_gpu.py OUT.json)
    found = _launches()
    Path(sys.argv[1]).write_text(json.dumps(found))
    print(f"{len(found)} launches written to {sys.argv[1]}")
