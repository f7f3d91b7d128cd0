"""The ``qwire`` command line.

Each verb lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up, importing lazily so that
``qwire --help`` is fast.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import signal
import sys
import threading

from qwire.bench import QUICK_OUT, RESULTS
from qwire.procs import RunStopped, start_rank_server

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "train": ("qwire.train_cli", "train a causal LM with compressed pipeline stage boundaries"),
    "netlab": ("qwire.netlab.cli", "rate-limited network lab: list/clean namespaces, measure a link"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "codecs": ("qwire.bench.codecs", "codec error, bits/element and throughput on real and synthetic tensors"),
    "convergence": ("qwire.bench.convergence", "fp32 vs int4 vs TAH-Quant training curves on the default setting"),
    "taco": ("qwire.bench.taco", "FP8 tensor-parallel codec error, collective time and TP training"),
    "agoq": ("qwire.bench.agoq", "8-bit DP gradients (QuanGrad) and low-bit saved activations (LAAQ)"),
    "pipeline": ("qwire.bench.pipeline", "FP32/FP16/int4/AQ-SGD/TAH-Quant pipeline training over rate-limited links"),
    "3d": ("qwire.bench.threed", "3D (PP x TP x DP) training over two sites: throughput, bytes and time per dimension"),
    "fsdp": ("qwire.bench.fsdp", "FSDP2 with 8-bit gradients/weights vs uncompressed and DDP, over rate-limited links"),
    "adaptive": ("qwire.bench.adaptive", "auto vs fixed codecs over a grid of link rates and a changing link"),
    "diloco": ("qwire.bench.diloco", "DiLoCo (replicas meeting every H steps) vs DDP over a rate-limited link"),
}


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qwire", description="Fewer bits on the wire for distributed training.")
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    for verb, (mod, help_) in VERBS.items():
        sp = sub.add_parser(verb, help=help_, description=help_)
        sp.set_defaults(_module=mod)
    bench = sub.add_parser("bench", help="benchmarks (each writes JSON and a markdown table)",
                           description="Benchmarks: each writes JSON and a markdown table to --out (default "
                                       f"{RESULTS}, the published results; with --quick, {QUICK_OUT}). "
                                       "qwire bench BENCH --help lists a benchmark's options.")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")
    for name, (mod, help_) in BENCHES.items():
        sp = bsub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(_module=mod)
    sub.add_parser("codecs", help="list the available codecs").set_defaults(_module=None)
    p.set_defaults(_bench_parser=bench)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    # Parse the verb first, then let the verb's module add its own arguments.
    # --help is answered by the verb's own parser, so keep it out of the first pass.
    helps = [a for a in argv if a in ("-h", "--help")]
    head = [a for a in argv if a not in ("-h", "--help")]
    if not head:
        parser.print_help()
        return 0 if helps else 2
    known, _ = parser.parse_known_args(head)
    if getattr(known, "verb", None) is None:
        parser.print_help()
        return 2
    if known.verb == "bench" and known.bench is None:  # list the benchmarks
        known._bench_parser.print_help()
        return 0 if helps else 2
    if known.verb == "codecs" and helps:
        print("qwire codecs: list the available codec names (codec options: docs/codecs.md)")
        return 0
    if known.verb == "codecs":
        from qwire.codecs import available
        print("\n".join(available()))
        return 0
    if known.verb == "train" and not helps:  # its imports run beside this process's (below) on another core
        start_rank_server()
    mod = importlib.import_module(known._module)
    skip = 2 if known.verb == "bench" else 1
    full = argparse.ArgumentParser(prog="qwire " + " ".join(head[:skip]), description=(mod.__doc__ or "").strip()
                                   .split("\n")[0])
    mod.add_arguments(full)
    args = full.parse_args(head[skip:] + helps)
    if known.verb == "bench" and getattr(args, "quick", False) and not any(
            a == "--out" or a.startswith("--out=") for a in head[skip:]):
        args.out = QUICK_OUT  # a smoke test never replaces the published results
        print(f"qwire bench {known.bench} --quick: writing to {QUICK_OUT} (--out {RESULTS} would replace the "
              "published results)", file=sys.stderr)
    if known.verb != "bench":
        return int(mod.run(args) or 0)
    try:
        return int(mod.run(args) or 0)
    except (KeyboardInterrupt, RunStopped) as e:  # one line, not a traceback (or a training run's resume advice)
        signum = e.signum if isinstance(e, RunStopped) else signal.SIGINT
        print(f"\nqwire bench {known.bench}: stopped by {signal.Signals(signum).name}; the runs finished so far are "
              f"under its --runs folder, and a results page it had not finished was not written (an earlier one in "
              f"--out stays; where the benchmark has --resume, the same command with --resume reuses the finished "
              "runs)", file=sys.stderr, flush=True)
        return 128 + int(signum)


def entry() -> None:
    """The ``qwire`` command (and ``python -m qwire``): :func:`main`, then exit without the interpreter's
    teardown. Once torch, its distributed packages and transformers are imported, the last garbage collection
    of that teardown takes seconds (2.6-3.1 s after ``qwire train --steps 1`` on 2 cores) and frees nothing
    the exit would not. What the teardown does that matters is done first: non-daemon threads are joined, the
    ``atexit`` handlers run (multiprocessing's, logging's, torch's) and stdout and stderr are flushed. An
    exception other than ``SystemExit`` ends the usual way, with its traceback."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # as sys.exit("message"): printed, exit status 1
        print(code, file=sys.stderr)
        code = 1
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe (qwire codecs | head -1): nothing more to say
            f.flush()
    os._exit(code & 0xFF)


if __name__ == "__main__":
    entry()
