"""The ``cpu`` backend: codec kernels compiled with numba.

Why numba: it installs as a wheel with no compiler on the machine (the README's
set-up stays one command), compiles each kernel to machine code on first use
and caches it on disk (``cache=True``), and releases the GIL (``nogil=True``),
so the kernels run on ``torch.get_num_threads()`` threads over blocks of rows
from a plain thread pool without a second OpenMP runtime beside torch's.
``qwire bench codecs`` measures it against the torch reference; docs/codecs.md
gives the numbers.

Importing this package imports numba (an ImportError makes the backend
unavailable; :mod:`qwire.codecs.kernels` then falls back to the torch
reference and says so once) and every kernel module in it, which register
their kernels.
"""

from __future__ import annotations

import importlib
import pkgutil

import numba  # noqa: F401 - the backend is unavailable without it

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")
