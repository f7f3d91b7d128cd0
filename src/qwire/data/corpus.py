"""Corpora: where training text comes from.

A corpus is named by a spec string:

- ``"stdlib"`` or ``"stdlib:max_mb=8"``: the ``.py`` files of the running Python's standard
  library (no download; test and site-packages folders excluded), in sorted path order.
- ``"PATH"``: a text file, or a folder whose text files (``.txt``, ``.md``, ``.py``, ...) are read
  in sorted path order. A ``.jsonl`` file is read as JSONL with the field ``text``.
- ``"text:PATH[,max_mb=N]"``: the same, with options.
- ``"jsonl:PATH[,field=text][,max_mb=N]"``: JSON lines (a file, or a folder of ``.jsonl`` files);
  each record's ``field`` is one document.

``max_mb`` bounds the text read (in MB of UTF-8); whole documents are taken until the bound is
reached, and a document larger than the whole bound (a corpus of one big file) is cut at a line end
within it. The stdlib corpus is bounded to 24 MB by default.

Files are read as UTF-8; a few invalid bytes become U+FFFD, but a file with NUL bytes or with more than 1% of
its characters undecodable (UTF-16, Latin-1, compressed or binary token files) is refused, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: File extensions read from a folder corpus (``.jsonl`` files in a folder are read as JSONL).
TEXT_EXTENSIONS = (".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cpp", ".js", ".ts", ".tex", ".html")

#: Folder names skipped everywhere (tests and installed packages in the stdlib, caches, VCS).
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", ".git", ".hg", ".svn"}
)

DEFAULT_STDLIB_MAX_MB = 24.0
_PIECE_CHARS = 1 << 20  # long documents are handed to the tokenizer in pieces of about this size

SPEC_HELP = (
    "a corpus is 'stdlib[:max_mb=N]', a path to a text file or folder, "
    "'text:PATH[,max_mb=N]' or 'jsonl:PATH[,field=text][,max_mb=N]'"
)


@dataclass(frozen=True)
class CorpusSpec:
    """A parsed corpus spec string."""

    kind: str  # "stdlib" | "text" | "jsonl"
    path: str | None = None
    field: str = "text"
    max_mb: float | None = None
    spec: str = ""

    @property
    def max_bytes(self) -> int | None:
        return None if self.max_mb is None else int(self.max_mb * 1e6)


def parse_corpus_spec(spec: str) -> CorpusSpec:
    """Parse a corpus spec string (see the module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty corpus spec; {SPEC_HELP}")
    spec = spec.strip()
    kind, sep, rest = spec.partition(":")
    if kind not in ("stdlib", "text", "jsonl") and os.path.exists(os.path.expanduser(spec)):
        kind = "jsonl" if spec.endswith(".jsonl") else "text"
        return CorpusSpec(kind=kind, path=os.path.expanduser(spec), spec=spec)
    if kind == "stdlib" and (not sep or "=" in rest or not rest):
        path, options = None, _parse_options(rest, spec) if rest else {}
    elif kind in ("text", "jsonl") and sep and rest:
        path, _, opts = rest.partition(",")
        path = os.path.expanduser(path)
        options = _parse_options(opts, spec) if opts else {}
    elif kind in ("stdlib", "text", "jsonl"):
        raise ValueError(f"bad corpus spec {spec!r}; {SPEC_HELP}")
    else:
        raise FileNotFoundError(f"corpus path {spec!r} does not exist; {SPEC_HELP}")
    allowed = {"stdlib": {"max_mb"}, "text": {"max_mb"}, "jsonl": {"max_mb", "field"}}[kind]
    unknown = set(options) - allowed
    if unknown:
        raise ValueError(
            f"unknown option(s) {sorted(unknown)} in corpus spec {spec!r}; '{kind}' takes {sorted(allowed)}"
        )
    max_mb: float | None = DEFAULT_STDLIB_MAX_MB if kind == "stdlib" else None
    if "max_mb" in options:
        try:
            max_mb = float(options["max_mb"])
        except ValueError:
            raise ValueError(f"max_mb must be a number in corpus spec {spec!r}") from None
        if not 0 < max_mb < math.inf:
            raise ValueError(f"max_mb must be a finite number > 0 in corpus spec {spec!r}, got {options['max_mb']}")
    if path is not None and not os.path.exists(path):
        raise FileNotFoundError(f"corpus path {path!r} (from spec {spec!r}) does not exist")
    return CorpusSpec(kind=kind, path=path, field=options.get("field", "text"), max_mb=max_mb, spec=spec)


def _parse_options(text: str, spec: str) -> dict[str, str]:
    out = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad option {item!r} in corpus spec {spec!r}; options are key=value, e.g. max_mb=8")
        out[key.strip()] = value.strip()
    return out


def stdlib_root() -> Path:
    """The folder holding the running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _walk_files(root: Path, extensions: tuple[str, ...]) -> list[Path]:
    """Files under ``root`` with one of ``extensions``, depth-first in sorted order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(extensions):
                out.append(Path(dirpath) / name)
    return out


# a file with more than this share of undecodable characters is not UTF-8 text (and never read as one)
MAX_BAD_SHARE = 0.01


def _read_text(path: Path, check: bool = True) -> str:
    text = path.read_bytes().decode("utf-8", errors="replace")
    if check:
        _check_text(path, text)
    return text.replace("\r\n", "\n")


def _check_text(path: Path, text: str) -> None:
    """Refuse what is not UTF-8 text: NUL bytes (UTF-16, binary token files) or many undecodable bytes."""
    if "\x00" in text:
        raise ValueError(f"{path}: holds NUL bytes, so it is not UTF-8 text (UTF-16, compressed or binary data such "
                         "as a token file); give qwire UTF-8 text files or JSONL (convert UTF-16 with "
                         "iconv -f utf-16 -t utf-8)")
    bad = text.count("\ufffd")
    if bad > 16 and bad > MAX_BAD_SHARE * len(text):
        raise ValueError(f"{path}: {bad} of its {len(text)} characters are not valid UTF-8, so it is not UTF-8 text "
                         "(another encoding such as Latin-1, or compressed or binary data); convert it to UTF-8 "
                         "(e.g. iconv -f latin1 -t utf-8), or decompress it")


def _jsonl_records(path: Path, field_name: str) -> Iterator[str]:
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = raw.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {lineno} is not valid JSON ({exc.msg})") from None
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}: line {lineno} is not UTF-8 ({exc.reason} at byte {exc.start}); JSON lines "
                                 "must be UTF-8: convert the file (e.g. iconv -f latin1 -t utf-8)") from None
            if not isinstance(record, dict) or field_name not in record:
                fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}: line {lineno} has no field {field_name!r} (it has {fields}); "
                    f"name the text field with 'jsonl:{path},field=NAME'"
                )
            text = record[field_name]
            if not isinstance(text, str):
                raise ValueError(f"{path}: line {lineno}: field {field_name!r} is {type(text).__name__}, not a string")
            yield text.replace("\r\n", "\n")


def iter_documents(spec: CorpusSpec) -> Iterator[str]:
    """Yield the corpus's documents (non-empty strings) in their fixed order, within ``max_mb``."""
    if spec.kind == "stdlib":
        files = _walk_files(stdlib_root(), (".py",))
        docs: Iterator[str] = (_read_text(p, check=False) for p in files)
    else:
        assert spec.path is not None
        root = Path(spec.path)
        if root.is_dir():
            files = _walk_files(root, _extensions(spec))
        else:
            files = [root]
        docs = _documents_of_files(files, spec)
    budget = spec.max_bytes
    used = 0
    for doc in docs:
        if not doc:
            continue
        if budget is not None and used >= budget:
            return
        data = doc.encode("utf-8")
        if budget is not None and len(data) > budget:  # larger than the whole bound: cut at a line end
            part = data[:budget - used]
            cut = part.rfind(b"\n")
            doc, used = part[:cut + 1 if cut > 0 else len(part)].decode("utf-8", errors="ignore"), budget
        else:
            used += len(data)
        if doc:
            yield doc


def _documents_of_files(files: list[Path], spec: CorpusSpec) -> Iterator[str]:
    for path in files:
        if spec.kind == "jsonl" or path.suffix == ".jsonl":
            yield from _jsonl_records(path, spec.field)
        else:
            yield _read_text(path)


def iter_pieces(spec: CorpusSpec) -> Iterator[tuple[str, bool]]:
    """Yield ``(text, ends_document)``: documents, with long ones cut at line ends into ~1 MB pieces."""
    for doc in iter_documents(spec):
        start = 0
        while len(doc) - start > _PIECE_CHARS:
            cut = doc.rfind("\n", start + _PIECE_CHARS // 2, start + _PIECE_CHARS)
            cut = start + _PIECE_CHARS if cut < 0 else cut + 1
            yield doc[start:cut], False
            start = cut
        yield doc[start:], True


def _extensions(spec: CorpusSpec) -> tuple[str, ...]:
    """The files a folder corpus reads: JSONL files for ``jsonl:``, text and JSONL files otherwise."""
    return (".jsonl",) if spec.kind == "jsonl" else TEXT_EXTENSIONS + (".jsonl",)


def skipped_note(spec: CorpusSpec) -> str:
    """For a folder corpus: the files it holds that were not read (other extensions), if any."""
    if spec.path is None or not Path(spec.path).is_dir():
        return ""
    skipped = [p.name for p in _walk_files(Path(spec.path), ("",)) if not p.name.endswith(_extensions(spec))]
    if not skipped:
        return ""
    fix = ("name JSON Lines files .jsonl, or drop jsonl: to read text files too" if spec.kind == "jsonl"
           else "rename text files to .txt")
    return (f"; it holds {len(skipped)} file(s) of other kinds, not read: {', '.join(skipped[:5])}"
            + (", ..." if len(skipped) > 5 else "") + f" ({fix}, or give one file as the corpus)")


@dataclass(frozen=True)
class CorpusStats:
    """What one pass over a corpus saw."""

    fingerprint: str  # blake2b of the pieces and document boundaries (hex)
    n_documents: int
    n_pieces: int
    n_bytes: int


def corpus_stats(spec: CorpusSpec) -> CorpusStats:
    """Read the whole corpus once: content fingerprint and sizes. Raises if the corpus is empty."""
    h = hashlib.blake2b(digest_size=20)
    n_docs = n_pieces = n_bytes = 0
    for text, ends in iter_pieces(spec):
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
        h.update(b"\x01" if ends else b"\x00")
        n_pieces += 1
        n_docs += ends
        n_bytes += len(data)
    if n_bytes == 0:
        where = "the standard library" if spec.kind == "stdlib" else repr(spec.path)
        what = "JSONL records" if spec.kind == "jsonl" else f"text files ({', '.join(TEXT_EXTENSIONS)})"
        raise ValueError(f"corpus {spec.spec!r} is empty: no text found in {where} (looked for {what})"
                         + skipped_note(spec))
    return CorpusStats(fingerprint=h.hexdigest(), n_documents=n_docs, n_pieces=n_pieces, n_bytes=n_bytes)
