"""Rate-limited links between ranks: a network lab (namespaces + ``tc``) and a simulated fallback.

::

    from qwire.netlab import parse_link, Lab, launch_in_lab

    spec = parse_link("100mbit,delay=20ms,loss=0.1%")
    with Lab(2, spec) as lab:            # two namespaces behind shaped veth links
        proc = lab.popen(0, ["python", "-c", "..."])

``qwire train --link SPEC`` (or ``--link-pp/--link-tp/--link-dp``, one link per
parallel dimension; :func:`pair_links` says which link each pair of ranks
crosses) calls :func:`launch_in_lab`; ``qwire netlab``
lists and cleans leftover namespaces and measures a link. See docs/netlab.md.
"""

from __future__ import annotations

import importlib
from typing import Any

# imported on first use: the launcher brings torch (its rendezvous), which the link-spec parser, and so
# ``qwire train --help``, need not load
_EXPORTS = {
    **dict.fromkeys(("Lab", "LabError", "LabUnavailable", "clean_labs", "lab_unavailable_reason", "list_labs"),
                    "qwire.netlab.lab"),
    "launch_in_lab": "qwire.netlab.launch",
    **dict.fromkeys(("SimulatedLink", "attach", "attach_from_env", "wire_bytes"), "qwire.netlab.simulated"),
    **dict.fromkeys(("LinkSpec", "pair_links", "parse_link"), "qwire.netlab.spec"),
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'qwire.netlab' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
