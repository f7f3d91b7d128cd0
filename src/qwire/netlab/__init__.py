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

from qwire.netlab.lab import Lab, LabError, LabUnavailable, clean_labs, lab_unavailable_reason, list_labs
from qwire.netlab.launch import launch_in_lab
from qwire.netlab.simulated import SimulatedLink, attach, attach_from_env, wire_bytes
from qwire.netlab.spec import LinkSpec, pair_links, parse_link

__all__ = ["Lab", "LabError", "LabUnavailable", "LinkSpec", "SimulatedLink", "attach", "attach_from_env",
           "clean_labs", "lab_unavailable_reason", "launch_in_lab", "list_labs", "pair_links", "parse_link",
           "wire_bytes"]
