"""The errors codecs raise (kept apart so that every codec module, and the kernels, can raise them
without importing the base class)."""

from __future__ import annotations


class CodecError(ValueError):
    """A codec was misconfigured or handed an input it cannot take.

    The message always says what to change.
    """


class NonFiniteError(CodecError):
    """The input holds NaN or Inf and the codec's policy is to refuse it."""
