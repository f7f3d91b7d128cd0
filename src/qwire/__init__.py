"""qwire: fewer bits on the wire for distributed training over slow networks.

The main entry points are re-exported here (imported lazily)::

    from qwire import get_codec, compressed_pipeline_stage, boundary_bytes
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "get_codec": "qwire.codecs",
    "compressed_pipeline_stage": "qwire.parallel.pipeline",
    "boundary_bytes": "qwire.parallel.pipeline",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'qwire' has no attribute {name!r}")


__all__ = ["__version__", *_EXPORTS]
