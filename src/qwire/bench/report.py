"""What every benchmark writes next to its numbers: the machine, the command line that made a result,
numbers and bytes as text, markdown tables, the common parts of the plots, and ``--render-only``.

Nothing here measures anything; the benchmarks call these helpers so that every results page
describes its machine and its command the same way and renders from its JSON alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["bench_command", "finish", "fmt", "fmt_bytes", "fmt_mb", "lab_mode", "link_name", "link_rate", "loadavg",
           "machine", "machine_info", "md_row", "md_table", "model_summary", "plot_train_val", "pyplot",
           "render_saved", "smooth"]


# --------------------------------------------------------------------------------------------------
# The machine and the command.


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """One line: CPU model, core count, OS and architecture, and the GPU torch sees (or "no GPU")."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{_cpu_name()}, {os.cpu_count()} CPU cores, {platform.system()} {platform.machine()}, {gpu}"


def machine_info() -> dict[str, Any]:
    """Machine, versions, start time and load, for a benchmark's JSON (``meta``)."""
    import torch

    return {"machine": machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_average_start": loadavg()}


def model_summary(model: Any) -> str:
    """One line about a ``transformers`` causal LM: its shape from the config, and its parameter count."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    shape = [f"hidden {c.hidden_size}"] if hasattr(c, "hidden_size") else []
    if hasattr(c, "intermediate_size"):
        shape.append(f"FFN {c.intermediate_size}")
    shape.append(f"{c.num_hidden_layers} layers")
    if hasattr(c, "num_attention_heads"):
        kv = getattr(c, "num_key_value_heads", None)
        shape.append(f"{c.num_attention_heads} heads" + (f" ({kv} KV)" if kv is not None else ""))
    return ", ".join([*shape, f"vocab {c.vocab_size}", f"{n:,} parameters"])


# environment variables that change how the codecs run (and so the numbers): a command names those that are set
ENV_SHOWN = ("QWIRE_CODEC_GRAPHS", "QWIRE_CODEC_IMPL", "QWIRE_DEFER_CHECKS", "QWIRE_HOST_STAGING")


def option_defaults(add_arguments: Callable[[argparse.ArgumentParser], None]) -> dict[str, Any]:
    """Each option's default, by its ``args`` name, from a benchmark's ``add_arguments``."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return vars(p.parse_args([]))


def bench_command(name: str, args: argparse.Namespace,
                  add_arguments: Callable[[argparse.ArgumentParser], None]) -> str:
    """``qwire bench <name>`` with the options of ``args`` that differ from their defaults, in the parser's order
    (``--render-only`` left out: it makes no result), after the variables of :data:`ENV_SHOWN` that are set
    (``QWIRE_CODEC_GRAPHS=1 qwire bench pipeline ...``)."""
    defaults = option_defaults(add_arguments)
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ENV_SHOWN if os.environ.get(k, "").strip()]
    parts = [*env, "qwire", "bench", name]
    for k, v in vars(args).items():
        if k.startswith("_") or k not in defaults or v == defaults[k] or k == "render_only":
            continue
        flag = "--" + k.replace("_", "-")
        parts += [flag] if v is True else [flag, shlex.quote(str(v))]
    return " ".join(parts)


def render_saved(bench: str, out: Path, stem: str, render: Callable[[dict[str, Any], Path], None]) -> int:
    """``--render-only``: re-render ``<out>/<stem>.md`` (and the plots) from ``<out>/<stem>.json``."""
    path = Path(out) / f"{stem}.json"
    if not path.exists():
        print(f"qwire bench {bench}: --render-only needs {path}; run the benchmark first", file=sys.stderr)
        return 2
    render(json.loads(path.read_text()), Path(out))
    print(f"wrote {Path(out) / f'{stem}.md'}")
    return 0


# --------------------------------------------------------------------------------------------------
# Link specs of the network lab.


def lab_mode(link: str) -> str:
    """The spec with ``mode=lab``: the network lab or an error, never the simulated link (which shapes only the
    pipeline's traffic)."""
    return ",".join([p for p in link.split(",") if p and not p.startswith("mode=")] + ["mode=lab"])


def link_name(link: str) -> str:
    """A link spec without its ``mode=`` part, for tables (``none`` for no link)."""
    return ",".join(p for p in link.split(",") if not p.startswith("mode=")) or "none"


def link_rate(link: str) -> float | None:
    """The link's rate in bits/s (None for no link)."""
    if not link:
        return None
    from qwire.netlab import parse_link

    return parse_link(link).rate_bits_per_s


# --------------------------------------------------------------------------------------------------
# Numbers and bytes as text.


def fmt(x: Any, spec: str | None = None, digits: int = 3, missing: str = "-") -> str:
    """A value for a table: ``format(x, spec)``, or without ``spec`` a float with ``digits`` decimals (scientific
    notation below 1e-3 and from 1e5 on) and anything else as ``str``; ``missing`` for None, and for NaN when a
    ``spec`` is given."""
    if x is None:
        return missing
    if spec is not None:
        return missing if isinstance(x, float) and math.isnan(x) else format(x, spec)
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
            return f"{x:.2e}"
        return f"{x:.{digits}f}"
    return str(x)


def fmt_bytes(n: float, digits: int = 1) -> str:
    """``n`` bytes in the largest binary unit (B, KiB, MiB, GiB) that keeps the number at 1 or more."""
    for unit, d in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= d:
            return f"{n / d:.{digits}f} {unit}"
    return f"{n:.0f} B"


def fmt_mb(n: float, digits: int = 2) -> str:
    """``n`` bytes in decimal megabytes (10^6 bytes), e.g. ``12.35 MB``."""
    return f"{n / 1e6:,.{digits}f} MB"


# --------------------------------------------------------------------------------------------------
# Markdown.


def md_row(cells: Iterable[Any]) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_table(header: Sequence[str], rows: Iterable[Iterable[Any]], align: str = "") -> list[str]:
    """A markdown table as lines: the header, the separator and the rows. ``align`` has one letter per column,
    ``l`` or ``r`` (right-aligned, for numbers); missing letters mean ``l``."""
    sep = "|" + "".join("---:|" if align[i:i + 1] == "r" else "---|" for i in range(len(header)))
    return [md_row(header), sep, *(md_row(r) for r in rows)]


# --------------------------------------------------------------------------------------------------
# Plots.


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (imported on first use: rendering needs no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def smooth(v: Sequence[float], k: int) -> list[float]:
    """The trailing mean over the last ``k`` values (fewer at the start)."""
    out: list[float] = []
    for i in range(len(v)):
        w = v[max(0, i - k + 1):i + 1]
        out.append(sum(w) / len(w))
    return out


def plot_train_val(ax: Any, label: str, curve: Sequence[Sequence[float]], val: Sequence[Sequence[float]] | None,
                   color: str | None = None, lw: float = 1.2, **val_style: Any) -> None:
    """One run on a loss plot: the training loss per step (``curve``: ``[step, loss]`` pairs) as a line, lightly
    smoothed (a trailing mean over 1/50 of the steps), and the validation loss (``val``) as dots joined by
    dashes in the same colour."""
    steps, losses = zip(*curve)
    line, = ax.plot(steps, smooth(losses, max(1, len(losses) // 50) + 1), lw=lw, color=color,
                    label=f"{label} (train)")
    if val:
        vs, vl = zip(*val)
        ax.plot(vs, vl, "o--", color=line.get_color(), label=f"{label} (validation)", **val_style)


def finish(fig: Any, path: Path) -> None:
    """Lay out, save (110 dpi) and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
