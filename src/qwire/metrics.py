"""What a ``qwire train`` run writes for people: ``metrics.jsonl`` (one record per step), progress lines,
``loss.png`` and ``summary.json`` (rank 0 only).

Bytes on the wire, per step, by where they cross (all counted from the payloads handed to the transport,
summed over ranks):

* ``wire_bytes_fwd`` / ``wire_bytes_bwd``: activations / gradients between pipeline stages;
* ``fp32_bytes``: what those would have been uncompressed;
* ``wire_bytes_tp``: tensor-parallel collectives; ``wire_bytes_dp``: the data-parallel gradient all-reduce.

Memory, the largest over ranks: ``state_bytes_max`` (parameters, gradients and optimizer state a rank
holds, measured from its tensors after the optimizer step, before the gradients are cleared) and
``max_rss_bytes`` (a process's peak resident set size so far).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qwire.checkpoint import RunWriteError, atomic_write, replaced
from qwire.procs import divert_output

WIRE_KEYS = ("fwd", "bwd", "fp32", "tp", "dp")


def _local_nbytes(t: Any) -> int:
    """Bytes this process holds for ``t`` (a DTensor's local shard only)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(params: list[Any], optimizer: Any) -> int:
    """Bytes of training state this rank holds: its parameters (their local shards for sharded
    parameters), their gradients and the optimizer's state tensors, measured from the tensors."""
    n = 0
    for p in params:
        n += _local_nbytes(p)
        if p.grad is not None:
            n += _local_nbytes(p.grad)
    for st in optimizer.state.values():
        n += sum(_local_nbytes(v) for v in st.values() if hasattr(v, "element_size") and v.dim() > 0)
    return n


def _finite(v: Any) -> Any:
    """``v`` with every float that is not finite replaced by None (in dicts, lists and tuples)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path``, all of it or nothing: a write that fails part way (a full disk)
    cuts the file back to where it was, so a reader (a resume) never meets half a record."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def complete_lines(text: str) -> list[str]:
    """The non-empty lines of a file that was appended to line by line, less a last one without its newline (a
    process that died while writing it; the run redoes that step after a resume)."""
    lines = text.split("\n")
    return [ln for ln in lines[:-1] if ln.strip()]


def max_rss_bytes() -> int:
    """This process's peak resident set size so far (0 where the OS does not report it)."""
    try:
        import resource
    except ImportError:
        return 0
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb) * (1 if sys.platform == "darwin" else 1024)


class Logger:
    """Writes a run's metrics and prints its progress; inactive (silent) on every rank but rank 0."""

    def __init__(self, run_dir: Path, active: bool):
        self.active = active
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        if active:
            run_dir.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def _writing(self, path: Path) -> Iterator[None]:
        """A failed write of ``path`` (a full disk) as the error a user acts on (:class:`RunWriteError`)."""
        try:
            yield
        except OSError as e:
            raise RunWriteError(self.run_dir, path, e) from e

    def _show(self, text: str) -> None:
        """Print ``text``. Where stdout is gone (a terminal that hung up: EIO; a pipe whose reader ended, as
        ``| tee`` does with the ssh session: EPIPE), stdout goes on in the run directory's ``hangup.log``
        instead of failing the run (and where that cannot be written either, a full disk, nowhere: the run's
        next record names the full disk)."""
        try:
            print(text, flush=True)
        except OSError:
            divert_output(self.run_dir, [1])
            with contextlib.suppress(OSError):
                print(text, flush=True)

    def say(self, msg: str) -> None:
        if self.active:
            self._show(msg)

    def truncate(self, step: int) -> None:
        """Drop the records of steps after ``step`` (they are redone after a resume): the metrics and ``auto``'s
        decisions."""
        for path in (self.path, self.run_dir / "autotune.jsonl"):
            if self.active and path.exists():
                keep = [ln for ln in complete_lines(path.read_text()) if json.loads(ln)["step"] <= step]
                with self._writing(path):
                    atomic_write(path, "".join(ln + "\n" for ln in keep))

    def metric(self, record: dict[str, Any]) -> None:
        if self.active:
            with self._writing(self.path):
                append_line(self.path, json.dumps(record))

    def autotune(self, decision: dict[str, Any]) -> None:
        """Append one decision of ``auto`` (every measurement behind it) to ``autotune.jsonl``; a value that is not
        finite (a loopback probe can fit an unbounded bandwidth) is written as ``null``, so the file stays JSON."""
        if self.active:
            path = self.run_dir / "autotune.jsonl"
            with self._writing(path):
                append_line(path, json.dumps(_finite(decision), allow_nan=False))

    def progress(self, r: dict[str, Any], total: int, elapsed: float, done: int) -> None:
        if not self.active:
            return
        eta = elapsed / max(1, done) * (total - r["step"])
        ratio = r["fp32_bytes"] / max(1, r["wire_bytes_fwd"] + r["wire_bytes_bwd"])
        val = f" | val {r['val_loss']:.3f}" if "val_loss" in r else ""
        vs = f"{ratio:.1f}x less than fp32" if ratio >= 1.05 else "about what fp32 sends"
        pp = (f" | wire fwd {fmt_bytes(r['wire_bytes_fwd'])} bwd {fmt_bytes(r['wire_bytes_bwd'])} per step "
              f"({vs})") if r["fp32_bytes"] else ""
        self._show(f"step {r['step']:>5}/{total} | loss {r['loss']:.3f}{val} | {r['tokens_per_s']:,.0f} tok/s{pp}"
                   f"{_extra_wire(r)} | {hms(elapsed)} elapsed, eta {hms(eta)}")

    def plot(self) -> None:
        """``loss.png``: training and validation loss by step (skipped without matplotlib)."""
        if not self.active:
            return
        try:
            import matplotlib  # optional dependency
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        recs = [json.loads(ln) for ln in complete_lines(self.path.read_text())]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], label="train", lw=1)
        ev = [r for r in recs if "val_loss" in r]
        if ev:
            ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = self.run_dir / "loss.png"
        try:
            with self._writing(path):
                replaced(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
        finally:
            plt.close(fig)

    def summary(self, s: dict[str, Any], out: str) -> None:
        """Print the end-of-run summary and write ``summary.json``."""
        if not self.active:
            return
        wire = s["wire_bytes_fwd"] + s["wire_bytes_bwd"]
        pp = (f"pipeline {fmt_bytes(s['wire_bytes_fwd'])} forward + {fmt_bytes(s['wire_bytes_bwd'])} backward = "
              f"{fmt_bytes(wire)}; fp32 would have sent {fmt_bytes(s['fp32_bytes'])} "
              + (f"({s['fp32_bytes'] / max(1, wire):.1f}x more)" if s["fp32_bytes"] >= 1.05 * wire else
                 "(about the same)") if s["fp32_bytes"] else "no pipeline links")
        auto = (f"  auto: {s['auto_time_s']:.2f} s measuring and choosing between steps "
                f"({s['auto_time_s'] / s['elapsed_s']:.1%} of the run's time), {s['auto_decisions']} decision(s)\n"
                if "auto_time_s" in s and s["elapsed_s"] > 0 else "")
        codecs = (f"  pipeline codecs: {s['codec_time_max_s']:.2f} s encoding and decoding (the busiest rank, summed "
                  f"over steps), {s['codec_time_max_s'] / s['step_time_max_s']:.1%} of the steps' time\n"
                  if s.get("step_time_max_s") else "")
        cache = (f"  AQ-SGD caches: {fmt_bytes(s['aqsgd_cache_bytes'])} over all ranks "
                 f"({s['aqsgd_cached_samples']:,} samples x {fmt_bytes(s['aqsgd_cache_bytes_per_sample'])} "
                 f"per boundary side)\n" if "aqsgd_cache_bytes" in s else "")
        self._show(f"\ndone: {s['steps']} steps in {hms(s['elapsed_s'])}, {s['tokens_per_s']:,.0f} tokens/s\n"
                   f"  final train loss {s['final_loss']:.4f}, validation loss {s['val_loss']:.4f}\n"
                   f"  on the wire: {pp}{_extra_wire(s)}\n{codecs}{auto}{cache}"
                   f"  run directory: {out} ({', '.join(self._products())})")
        with self._writing(self.run_dir / "summary.json"):
            atomic_write(self.run_dir / "summary.json", json.dumps(s, indent=2))

    RUN_FILES = ("config.json", "codecs.json", "metrics.jsonl", "summary.json", "loss.png", "autotune.jsonl",
                 "link_changes.jsonl", "netlab.json")

    def _products(self) -> list[str]:
        """What the run directory holds for the user (summary.json: written next)."""
        names = [n for n in self.RUN_FILES if n == "summary.json" or (self.run_dir / n).exists()]
        return names + [d + "/" for d in ("checkpoints",) if (self.run_dir / d).is_dir()]


def _extra_wire(r: dict[str, Any]) -> str:
    parts = [f"{k} {fmt_bytes(r['wire_bytes_' + k])}" for k in ("tp", "dp") if r.get("wire_bytes_" + k)]
    return (" | " + ", ".join(parts)) if parts else ""


def fmt_bytes(n: float) -> str:
    """``12.35 MB`` / ``4.1 kB``."""
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def fmt_count(n: int) -> str:
    """A parameter count: ``25.3M`` / ``812K``."""
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def hms(sec: float) -> str:
    """``m:ss`` or ``h:mm:ss``."""
    sec = int(sec)
    return f"{sec // 3600}:{sec // 60 % 60:02d}:{sec % 60:02d}" if sec >= 3600 else f"{sec // 60}:{sec % 60:02d}"
