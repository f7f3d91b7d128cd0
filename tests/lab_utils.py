"""Whether the network lab can run here, for the tests that need it (computed once per test session)."""

from __future__ import annotations

import functools

import pytest

from qwire.netlab import Lab, LabUnavailable
from qwire.netlab import lab as lab_mod

__all__ = ["lab_reason", "needs_lab"]


@functools.cache
def lab_reason() -> str | None:
    """None where a lab can be built here, else why not."""
    reason = lab_mod.lab_unavailable_reason()
    if reason is None:
        try:
            with Lab(1, "100mbit"):
                pass
        except LabUnavailable as e:
            reason = str(e)
    return reason


# the condition is a string, evaluated when the test runs, in the test module (which imports lab_reason)
needs_lab = pytest.mark.skipif("lab_reason() is not None",
                               reason="the network lab needs root, iproute2 (ip, tc) and network namespaces")
