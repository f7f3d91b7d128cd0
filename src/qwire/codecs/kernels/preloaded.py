"""Imported by the fork server that local ranks are forked from (:data:`qwire.procs.PRELOAD`): loads the CPU
codec kernels of :mod:`qwire.codecs.kernels.warm` (float32 input) from numba's disk cache once, so that every
rank forked from the server has them; each rank would otherwise spend most of a second loading them at its
first encode and decode (numba's start-up and one load per kernel).

Only kernels that are already compiled are loaded: where this source tree's kernels are not in the cache yet
(qwire installed without ``scripts/setup.sh``), nothing is done, and each rank compiles the few it uses, as
before, instead of the server compiling all of them before any rank starts. Importing the module anywhere
else does the same, once per process. It never raises (an exception would stop the fork server): a kernel it
could not load is loaded by the rank that first uses it. It runs in one thread (``torch.set_num_threads(1)``
meanwhile), so the server starts no thread pool that its forked ranks would inherit half of.
"""

from __future__ import annotations

import hashlib
import os


def compiled(kernel_dir: str, cache_dir: str) -> bool:
    """Whether numba's cache under ``cache_dir`` holds kernels compiled from the sources in ``kernel_dir`` (the
    directory numba names after that source directory: its name and the SHA-1 of its path)."""
    d = os.path.join(cache_dir, f"{os.path.basename(kernel_dir)}_{hashlib.sha1(kernel_dir.encode()).hexdigest()}")
    try:
        return any(f.endswith(".nbi") for f in os.listdir(d))
    except OSError:
        return False


def _load() -> None:
    try:
        import numba
        import torch

        from qwire.codecs.kernels import cpu
        from qwire.codecs.kernels.warm import warm

        if not compiled(os.path.dirname(os.path.abspath(cpu.__file__)), numba.config.CACHE_DIR):
            return
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            warm(verbose=False, dtypes=(torch.float32,))
        finally:
            torch.set_num_threads(n)
    except Exception:  # noqa: BLE001 - the ranks load what is missing themselves
        pass


_load()
