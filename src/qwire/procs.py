"""Process helpers shared by the training launcher (``qwire.train``) and the network lab (``qwire.netlab``).

Kept apart so that neither package imports the other's internals.
"""

from __future__ import annotations

import signal
import socket


class TrainError(RuntimeError):
    """A training run failed for a reason the user can act on."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exit_reason(code: int | None) -> str:
    """A process exit status in words: ``killed by SIGKILL``, ``exit code 1``."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"

