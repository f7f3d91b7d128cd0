"""Where bytes cross process boundaries: compressed collectives (and hooks built on them).

>>> from qwire.comm import all_reduce
>>> y = all_reduce(x, "fp8")            # two-shot, decoded and summed in fp32

See :mod:`qwire.comm.collectives` for the guarantees (bit-identical results on
every rank, exactness with the ``fp32`` codec, timeouts).
"""

from .collectives import (
    CollectiveError,
    all_gather,
    all_gather_dim,
    all_gather_into,
    all_reduce,
    all_reduce_future,
    broadcast,
    check_same_codec,
    copy_to_tp_region,
    force_host_staging,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter,
    reduce_scatter_dim,
    reduce_scatter_to_sp_region,
    scatter_to_tp_region,
    staged_bytes,
    submit_ordered,
    wire_bytes,
)

__all__ = [
    "CollectiveError",
    "all_gather",
    "all_gather_dim",
    "all_gather_into",
    "all_reduce",
    "all_reduce_future",
    "broadcast",
    "check_same_codec",
    "copy_to_tp_region",
    "force_host_staging",
    "gather_from_sp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter",
    "reduce_scatter_dim",
    "reduce_scatter_to_sp_region",
    "scatter_to_tp_region",
    "staged_bytes",
    "submit_ordered",
    "wire_bytes",
]
