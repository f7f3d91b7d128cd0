"""qwire codecs: tensor -> bit-packed uint8 payload -> tensor.

>>> from qwire.codecs import get_codec
>>> codec = get_codec("tahquant:tile=32")

Every module in this package registers its codecs on import; importing the
package imports them all, so a new codec module needs no edit here.
"""

import importlib
import pkgutil

from .base import Codec, CodecError, NonFiniteError, Param
from .registry import available, get_codec, parse_spec, pin_spec, register, unpin_spec

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Codec", "CodecError", "NonFiniteError", "Param", "available", "get_codec", "parse_spec", "pin_spec",
           "register", "unpin_spec"]
