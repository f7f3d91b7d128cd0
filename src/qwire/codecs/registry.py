"""Codec registry and spec strings.

A spec string is ``name`` or ``name:key=value,key=value``, e.g. ``"fp32"``,
``"int6"``, ``"int4:tile=64,symmetric=true"``, ``"tahquant:tile=32,ratio=0.8"``.
Aliases carry preset parameters (``int4`` is ``int`` with ``bits=4``); explicit
parameters in the spec or keyword arguments override the preset.
"""

from __future__ import annotations

import difflib
from typing import Any

from .base import Codec, CodecError

_CODECS: dict[str, tuple[type[Codec], dict[str, Any]]] = {}


def register(name: str, cls: type[Codec], **preset: Any) -> None:
    """Make ``cls`` available under ``name`` (with preset parameters)."""
    if name in _CODECS and _CODECS[name][0] is not cls:
        raise RuntimeError(f"codec name {name!r} registered twice")
    _CODECS[name] = (cls, dict(preset))


def available() -> list[str]:
    return sorted(_CODECS)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:k=v,k=v"`` into ``(name, {k: v})`` (values stay strings)."""
    if not isinstance(spec, str) or not spec.strip():
        raise CodecError(f"a codec spec must be a non-empty string like 'int4' or 'tahquant:tile=32', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    kwargs: dict[str, str] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key or not value.strip():
                raise CodecError(
                    f"bad codec spec {spec!r}: {item.strip()!r} is not key=value "
                    "(write e.g. 'tahquant:tile=32,ratio=0.8')"
                )
            if key in kwargs:
                raise CodecError(f"bad codec spec {spec!r}: {key!r} given twice")
            kwargs[key] = value.strip()
    return name, kwargs


def get_codec(spec: str | Codec, **kwargs: Any) -> Codec:
    """Build a codec from a name or spec string (or return a codec as is).

    ``get_codec("tahquant", tile=32)`` and ``get_codec("tahquant:tile=32")`` are
    the same codec.
    """
    if isinstance(spec, Codec):
        if kwargs:
            raise CodecError("get_codec: keyword arguments cannot be applied to an existing codec object")
        return spec
    name, spec_kwargs = parse_spec(spec)
    if name not in _CODECS:
        close = difflib.get_close_matches(name, _CODECS, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise CodecError(f"unknown codec {name!r}.{hint} Available: {', '.join(available())}")
    cls, preset = _CODECS[name]
    clash = set(spec_kwargs) & set(kwargs)
    if clash:
        raise CodecError(f"codec {name!r}: {', '.join(sorted(clash))} given both in the spec and as keywords")
    return cls(**{**preset, **spec_kwargs, **kwargs})
