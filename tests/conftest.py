import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run, so a CI result is reproducible; set
# HYPOTHESIS_PROFILE=explore to draw fresh random examples (failures are replayed from .hypothesis/).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Without a GPU the Triton codec kernels run under Triton's interpreter (tests/test_kernels_triton.py);
# set before anything imports triton, which reads it when the kernels are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The cores this process may use (all of them where the platform cannot say).
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

# The test machine has few cores and several tests start worker processes; pytest-xdist's workers
# share the cores between them.
torch.set_num_threads(max(1, min(2, CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads these options
def pytest_cmdline_main(config):
    """Spread the tests over the machine's cores with pytest-xdist, where it is installed (scripts/setup.sh
    installs it), unless the command line chooses: ``-n 0`` runs them in this process, ``-n N`` in N workers.
    At most 4 workers: many tests start several rank processes of their own. Idle workers take tests queued
    for busy ones (``--dist worksteal``), so one slow test at the end holds up a single worker only.
    One process, as without xdist, where a worker could not do what was asked: a debugger (``--pdb``,
    ``--trace``), output shown as it comes (``-s``), or no tests to run (``--collect-only``, ``--fixtures``);
    and where the command line names xdist's own ``--tx`` or ``--dist``."""
    o = config.option
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput") or o.numprocesses is not None
            or o.tx or o.dist != "no" or o.usepdb or o.trace or o.capture == "no" or o.collectonly
            or o.showfixtures or o.show_fixtures_per_test):
        return
    workers = min(4, CORES)
    if workers > 1:
        o.numprocesses, o.dist = workers, "worksteal"


def pytest_sessionstart(session):
    """Compile the CPU codec kernels once, before any test starts worker processes that would
    otherwise all compile them at the same time (a no-op when scripts/setup.sh already did). Under
    pytest-xdist the controller does it before it starts the workers, which then need not.

    And one tokenizer and token cache (``QWIRE_CACHE``) for the whole session, which the workers and every
    process a test starts inherit: the tests never touch the user's cache, and a tokenizer (about 20 s to
    train on a 2-core machine) is trained once per setting, not once per test module. Tests of the cache
    itself point ``QWIRE_CACHE`` or ``cache_dir`` elsewhere."""
    if hasattr(session.config, "workerinput"):
        return
    session.config._qwire_cache = os.environ["QWIRE_CACHE"] = tempfile.mkdtemp(prefix="qwire-test-cache-")
    from qwire.codecs.kernels.warm import warm

    warm(verbose=False)


def pytest_sessionfinish(session):
    """The session's tokenizer and token cache goes with it (the controller's, under pytest-xdist)."""
    cache = getattr(session.config, "_qwire_cache", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a CUDA GPU: skipped, with the reason, where torch sees none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); on a GPU machine run "
                                   "`.venv/bin/python -m pytest -m cuda`")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
