"""Benchmarks: each writes machine-readable JSON and a markdown table."""

from __future__ import annotations

import argparse

RESULTS = "docs/results"            # where a benchmark writes by default: the published results
QUICK_OUT = "runs/bench-quick"      # ... and with --quick (``qwire.cli``), which must not replace them


def add_out_argument(p: argparse.ArgumentParser, what: str) -> None:
    """A benchmark's ``--out``: ``what`` says which files go there."""
    p.add_argument("--out", default=RESULTS,
                   help=f"{what} (default: {RESULTS}, the published results; with --quick: {QUICK_OUT})")
