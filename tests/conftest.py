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
    One worker more than the cores (many tests wait seconds on rank processes of their own), at most 4. Idle
    workers take tests queued for busy ones (``--dist worksteal``), so one slow test at the end holds up a
    single worker only.
    One process, as without xdist, where a worker could not do what was asked: a debugger (``--pdb``,
    ``--trace``), output shown as it comes (``-s``), or no tests to run (``--collect-only``, ``--fixtures``);
    and where the command line names xdist's own ``--tx`` or ``--dist``."""
    o = config.option
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput") or o.numprocesses is not None
            or o.tx or o.dist != "no" or o.usepdb or o.trace or o.capture == "no" or o.collectonly
            or o.showfixtures or o.show_fixtures_per_test):
        return
    workers = min(4, CORES + 1) if CORES > 1 else 1  # one more than the cores: tests spend seconds waiting on ranks
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


# The longest tests, longest first (from `pytest --durations=0` on 2 cores; a scheduling hint, nothing depends on
# it): they start before the rest, so that the run does not end with one worker finishing one of them alone.
FIRST = (
    "test_kernels_compile.py::test_every_kernel_launch_compiles_for_sm90",  # on a fresh machine (4-8 minutes)
    "test_faults.py::test_torchrun_restarts_continue_from_the_last_checkpoint_with_resume_auto",
    "test_bench_adaptive.py::test_quick_run_over_the_lab_writes_the_page",
    "test_3d.py::test_2x2x2_lossless_matches_one_process_and_compressed_sends_less",
    "test_faults.py::test_sigterm_ends_the_run_after_a_step_with_its_checkpoint_and_resume_continues_it",
    "test_kernels_triton.py::test_tahquant_same_payload_and_values_as_the_reference",
    "test_3d.py::test_two_torchrun_launches_form_one_3d_mesh",
    "test_faults.py::test_a_stopped_rank_is_named_while_the_others_wait_and_in_the_error",
    "test_kernels_fit.py::test_fit_kernels_equal_the_reference",
    "test_train.py::test_killed_rank_fails_fast_and_resume_continues_exactly",
    "test_faults.py::test_a_rank_that_never_joins_the_process_group_is_named",
    "test_bench_3d.py::test_quick_3d_bench_end_to_end",
    "test_kernels_compile.py::test_the_element_kernels_load_wide_and_index_without_64_bit_divisions",
    "test_pipeline.py::test_codec_graphs_train_the_same",
    "test_bench_pipeline.py::test_quick_pipeline_bench_end_to_end",
    "test_faults.py::test_killed_launcher_stops_its_ranks_and_resume_continues_exactly",
    "test_pipeline.py::test_plain_module_example_runs",
    "test_faults.py::test_with_peer_timeout_a_stopped_rank_ends_the_run_before_timeout_naming_it",
)


def _first(item) -> int:
    return FIRST.index(name) if (name := item.nodeid.split("/")[-1].split("[")[0]) in FIRST else len(FIRST)


def _longest_first(items: list, workers: int) -> list:
    """``items`` with the longest (:data:`FIRST`) at the heads of the runs of tests that pytest-xdist hands its
    ``workers`` at the start (``--dist worksteal`` cuts the collection into equal consecutive runs, one per
    worker), dealt out in turn, longest first; the rest keep their order."""
    long = sorted((i for i in items if _first(i) < len(FIRST)), key=_first)
    rest = [i for i in items if _first(i) == len(FIRST)]
    heads: list[list] = [long[w::workers] for w in range(workers)]
    out, left = [], len(items)
    for w in range(workers):
        size = left // (workers - w)  # as xdist's scheduler cuts them
        run = heads[w] + rest[:max(0, size - len(heads[w]))]
        del rest[:len(run) - len(heads[w])]
        out += run
        left -= len(run)
    return out + rest


def pytest_collection_modifyitems(config, items):
    """The longest tests first (:func:`_longest_first`). Tests marked ``cuda`` need a CUDA GPU: skipped, with
    the reason, where torch sees none."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    items[:] = _longest_first(items, workers)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); on a GPU machine run "
                                   "`.venv/bin/python -m pytest -m cuda`")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
