"""qwire codecs: tensor -> bit-packed uint8 payload -> tensor.

>>> from qwire.codecs import get_codec
>>> codec = get_codec("tahquant:tile=32")
"""

from . import floats  # noqa: F401  (registers fp32/fp16/bf16)
from .base import Codec, CodecError, NonFiniteError, Param
from .registry import available, get_codec, parse_spec, register

__all__ = ["Codec", "CodecError", "NonFiniteError", "Param", "available", "get_codec", "parse_spec", "register"]
