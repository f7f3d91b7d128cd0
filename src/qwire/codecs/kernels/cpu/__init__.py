"""The ``cpu`` backend: codec kernels compiled with numba.

Why numba: it installs as a wheel with no compiler on the machine (the README's
set-up stays one command), compiles each kernel to machine code on first use
and caches it on disk, and releases the GIL (``nogil=True``), so the kernels
run on ``torch.get_num_threads()`` threads over blocks of rows from a plain
thread pool without a second OpenMP runtime beside torch's.
``qwire bench codecs`` measures it against the torch reference; docs/kernels.md
gives the numbers.

The on-disk cache lives in a directory named after a hash of this package's
sources (under ``$NUMBA_CACHE_DIR``, else ``$XDG_CACHE_HOME/qwire/numba`` or
``~/.cache/qwire/numba``): numba only checks a cached function's own source
file, so a change to a helper it inlines from another module must start a
fresh cache.

Importing this package imports numba (an ImportError makes the backend
unavailable; :mod:`qwire.codecs.kernels` then falls back to the torch
reference and says so once) and every kernel module in it, which register
their kernels.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pkgutil
from pathlib import Path

import numba


def _cache_dir() -> str:
    h = hashlib.sha256(numba.__version__.encode())
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    base = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "qwire", "numba")
    return os.path.join(base, h.hexdigest()[:16])


numba.config.CACHE_DIR = _cache_dir()

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")
