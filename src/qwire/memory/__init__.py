"""Memory compression: what autograd keeps for backward (LAAQ)."""

from .laaq_hooks import (
    LAAQ,
    LAAQHandle,
    LAAQPolicy,
    LAAQStats,
    activation_unit,
    apply_laaq,
    in_flight,
    laaq,
    stage_bits,
)

__all__ = ["LAAQ", "LAAQHandle", "LAAQPolicy", "LAAQStats", "activation_unit", "apply_laaq", "in_flight",
           "laaq", "stage_bits"]
