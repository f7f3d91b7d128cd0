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


def _lookup(name: str) -> tuple[type[Codec], dict[str, Any]]:
    """The class and preset parameters registered as ``name``; CodecError with close names where there is none."""
    if name not in _CODECS:
        close = difflib.get_close_matches(name, _CODECS, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise CodecError(f"unknown codec {name!r}.{hint} Available: {', '.join(available())}")
    return _CODECS[name]


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
    cls, preset = _lookup(name)
    clash = set(spec_kwargs) & set(kwargs)
    if clash:
        raise CodecError(f"codec {name!r}: {', '.join(sorted(clash))} given both in the spec and as keywords")
    return cls(**{**preset, **spec_kwargs, **kwargs})


def nested_codec(text: str, what: str, **kwargs: Any) -> Codec:
    """The codec a :attr:`Codec.nested` parameter names (``text``: a spec whose options are joined by ';'),
    with a hint where they were given without the ':' that starts them."""
    try:
        return get_codec(text.replace(";", ","), **kwargs)
    except CodecError as e:
        if ";" in text and ":" not in text:
            name = text.split(";")[0]
            raise CodecError(f"{what} {text!r}: the options of a codec named inside another follow a ':' and are "
                             f"joined by ';', e.g. {name}:{text.split(';', 1)[1]} ({e})") from None
        raise


def _nested(cls: type[Codec], kw: dict[str, str], each: Any) -> dict[str, str]:
    """``kw`` with every codec named inside a codec of class ``cls`` (its :attr:`Codec.nested` parameters; the
    options of each joined by ';') replaced by ``each(spec)`` (options joined by ','; a result of None leaves
    the parameter as it is)."""
    out = dict(kw)
    for key, kind in cls.nested.items():
        v = kw.get(key, "")
        if v.strip().lower() in ("", "none"):
            continue
        subs = [t.strip() for t in v.split("+") if t.strip()] if kind == "plus" else [v]
        done = [each(t.replace(";", ",")) for t in subs]
        if all(d is not None and "+" not in d and ";" not in d for d in done):
            out[key] = "+".join(d.replace(",", ";") for d in done)
    return out


def pin_spec(spec: str, nested: bool = True) -> str | None:
    """``spec`` with every parameter written out (:meth:`Codec.spec`): the codec it builds in this version,
    whatever later versions make of its short form; a codec named inside another (``aqsgd``'s ``inner``,
    ``auto``'s candidates) pinned as well, its options joined by ';' (``nested=False``: those stay as written,
    as pins before they were pinned). None where ``spec`` names no codec that this string builds again (a DDP
    hook, ``fp8:group=auto``)."""
    try:
        codec = get_codec(spec)
        name, kw = parse_spec(codec.spec())
        full = _spec_string(name, _nested(type(codec), kw, pin_spec) if nested else kw)
        again = get_codec(full)
    except CodecError:
        return None
    return full if type(again) is type(codec) and again.spec() == full else None


def _spec_string(name: str, kw: dict[str, str]) -> str:
    return f"{name}:" + ",".join(f"{k}={v}" for k, v in kw.items()) if kw else name


def unpin_spec(pin: str, nested: bool = True) -> str:
    """The spec that builds, in this version, the codec that :func:`pin_spec` wrote as ``pin`` (perhaps in an
    earlier version): the parameters ``pin`` does not name, added since, at their ``legacy`` value (the value
    that reproduces the codec from before they existed), in the codecs named inside it too (``nested=False``:
    a pin that left those as written; they stay so). Raises :class:`CodecError` where this version cannot
    build it (a parameter or codec it no longer has)."""
    name, kw = parse_spec(pin)
    cls, preset = _lookup(name)
    added = {p.name: p.legacy for p in cls.params if p.legacy is not None and p.name not in kw and p.name not in preset}
    codec = get_codec(name, **added, **(_nested(cls, kw, unpin_spec) if nested else kw))
    name, kw = parse_spec(codec.spec())
    return _spec_string(name, _nested(type(codec), kw, pin_spec) if nested else kw)
