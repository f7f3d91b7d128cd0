import os

import torch

# The test machine has few cores and several tests start worker processes.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_sessionstart(session):
    """Compile the CPU codec kernels once, before any test starts worker processes that would
    otherwise all compile them at the same time (a no-op when scripts/setup.sh already did)."""
    from qwire.codecs.kernels.warm import warm

    warm(verbose=False)
