"""Imported by the fork server that local ranks are forked from (:data:`qwire.procs.PRELOAD`): loads the CPU
codec kernels of :mod:`qwire.codecs.kernels.warm` (float32 input) from numba's disk cache once, so that every
rank forked from the server has them; each rank would otherwise spend most of a second loading them at its
first encode and decode (numba's start-up and one load per kernel).

Importing it anywhere else does the same, once per process. It never raises (an exception would stop the fork
server): a kernel it could not load is loaded, as before, by the rank that first uses it. It runs in one
thread (``torch.set_num_threads(1)`` meanwhile), so the server starts no thread pool that its forked ranks
would inherit half of.
"""

from __future__ import annotations


def _load() -> None:
    try:
        import torch

        from qwire.codecs.kernels.warm import warm

        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            warm(verbose=False, dtypes=(torch.float32,))
        finally:
            torch.set_num_threads(n)
    except Exception:  # noqa: BLE001 - the ranks load what is missing themselves
        pass


_load()
