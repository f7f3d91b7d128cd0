"""Tokenizers: a byte-level BPE trained on the corpus, or a local Hugging Face tokenizer."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import CorpusSpec, CorpusStats, iter_pieces

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 257  # 256 byte symbols + the end-of-text token


class TextTokenizer:
    """A thin wrapper with the few methods qwire needs.

    ``vocab_size`` counts every id the tokenizer can produce (special tokens included), so a model
    with that many embedding rows accepts all of them. ``eos_id`` separates documents in the
    token stream (``None`` when the tokenizer has no end-of-text token).
    """

    def __init__(self, backend: Any, eos_id: int | None, fingerprint: str, source: str) -> None:
        self._backend = backend  # a tokenizers.Tokenizer or a transformers tokenizer
        self._fast = isinstance(backend, Tokenizer)
        self.eos_id = eos_id
        self.fingerprint = fingerprint
        self.source = source
        self._vocab_size: int | None = None

    @property
    def vocab_size(self) -> int:
        """One more than the largest id the tokenizer can produce (ids need not be contiguous;
        the end-of-text id counts too)."""
        if self._vocab_size is None:
            vocab = self._backend.get_vocab(with_added_tokens=True) if self._fast else self._backend.get_vocab()
            count = self._backend.get_vocab_size(with_added_tokens=True) if self._fast else len(self._backend)
            eos = [self.eos_id + 1] if self.eos_id is not None else []
            self._vocab_size = max([count, *eos, *(i + 1 for i in vocab.values())])
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        if self._fast:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self._backend.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several texts (parallel for ``tokenizers`` backends)."""
        if self._fast:
            return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens kept, so that decode(encode(s)) == s)."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    @property
    def backend(self) -> Any:
        """The underlying ``tokenizers.Tokenizer`` (or transformers tokenizer)."""
        return self._backend

    def save(self, path: str | Path) -> None:
        """Write a ``tokenizer.json`` (byte-level BPE / fast tokenizers only)."""
        if not self._fast:
            raise TypeError("only a tokenizers-based tokenizer can be saved with TextTokenizer.save")
        self._backend.save(str(path))

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, source={self.source!r})"


def _fingerprint_json(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=20).hexdigest()


def from_tokenizer_json(
    path: str | Path, eos_token: str | None = EOS_TOKEN, eos_id: int | None = None
) -> TextTokenizer:
    """Load a ``tokenizer.json`` file written by ``tokenizers``.

    The end-of-text id is ``eos_id`` if given, else the id of ``eos_token`` (``None`` if the
    tokenizer lacks it). An end-of-text id other than that of ``<|endoftext|>`` is part of the
    fingerprint (it changes the token stream).
    """
    text = Path(path).read_text(encoding="utf-8")
    tok = Tokenizer.from_str(text)
    if eos_id is None and eos_token:
        eos_id = tok.token_to_id(eos_token)
    fingerprint = _fingerprint_json(text)
    if eos_id != tok.token_to_id(EOS_TOKEN):
        fingerprint = _fingerprint_json(f"{fingerprint}/eos={eos_id}")
    return TextTokenizer(tok, eos_id, fingerprint, str(path))


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                    "vocab.json", "vocab.txt", "merges.txt", "tokenizer_config.json",
                    "special_tokens_map.json", "added_tokens.json")


def load_pretrained_tokenizer(path: str | Path) -> TextTokenizer:
    """Load a local Hugging Face tokenizer: a folder (``tokenizer.json`` or anything ``AutoTokenizer``
    reads offline) or a ``tokenizer.json`` file. Nothing is downloaded.

    The end-of-text token (appended to every document) is the folder's ``eos_token``
    (``tokenizer_config.json`` or ``special_tokens_map.json``), else the model's ``eos_token_id``
    (``config.json`` or ``generation_config.json`` in the same folder), else ``<|endoftext|>`` if
    the vocabulary has it; ``eos_id`` is ``None`` when none of these exists.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    if p.is_file():
        return from_tokenizer_json(p, eos_token=EOS_TOKEN)
    eos_token, eos_id = _eos_from_folder(p)
    if (p / "tokenizer.json").is_file():
        tok = from_tokenizer_json(p / "tokenizer.json", eos_token=eos_token, eos_id=eos_id)
        if tok.eos_id is None and eos_token is not None:
            tok = from_tokenizer_json(p / "tokenizer.json", eos_token=EOS_TOKEN, eos_id=_model_eos_id(p))
        return tok
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, ImportError, TypeError) as exc:
        sp = [n for n in ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model") if (p / n).is_file()]
        hint = ""
        if sp and importlib.util.find_spec("sentencepiece") is None:  # transformers blames tiktoken there
            hint = (f"; {sp[0]} is a SentencePiece model, which needs the sentencepiece package (pip install "
                    "sentencepiece), or save the tokenizer as tokenizer.json (tokenizer.save_pretrained(DIR) "
                    "with a fast tokenizer)")
        raise ValueError(f"cannot load a tokenizer from the folder {str(p)!r} (offline): {exc}{hint}") from exc
    if eos_id is None:
        eos_id = hf.eos_token_id if hf.eos_token_id is not None else _model_eos_id(p)
    digest = hashlib.blake2b(type(hf).__name__.encode(), digest_size=20)
    for name in _TOKENIZER_FILES:
        if (p / name).is_file():
            digest.update(f"/{name}/".encode())
            digest.update((p / name).read_bytes())
    digest.update(f"/eos={eos_id}".encode())
    return TextTokenizer(hf, eos_id, digest.hexdigest(), str(p))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _eos_from_folder(folder: Path) -> tuple[str | None, int | None]:
    """(eos token, eos id): the token named by the tokenizer's files, else the model's id."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        eos = _read_json(folder / name).get("eos_token")
        if isinstance(eos, dict):  # older files store an AddedToken as a dict
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos, None
    model_eos = _model_eos_id(folder)
    return (None, model_eos) if model_eos is not None else (EOS_TOKEN, None)


def _model_eos_id(folder: Path) -> int | None:
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(folder / name).get("eos_token_id")
        if isinstance(eos, list) and eos and all(isinstance(i, int) for i in eos):
            eos = eos[0]
        if isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0:
            return eos
    return None


def _training_texts(spec: CorpusSpec, stats: CorpusStats, max_bytes: int) -> Iterator[str]:
    """Pieces spread evenly over the corpus (every k-th piece), up to ``max_bytes``."""
    stride = max(1, math.ceil(stats.n_bytes / max(1, max_bytes)))
    used = 0
    for i, (text, _) in enumerate(iter_pieces(spec)):
        if i % stride:
            continue
        if used >= max_bytes:
            return
        used += len(text)
        yield text


def train_bpe(spec: CorpusSpec, stats: CorpusStats, vocab_size: int, train_mb: float = 4.0) -> TextTokenizer:
    """Train a byte-level BPE (with ``<|endoftext|>``) on at most ``train_mb`` MB of the corpus."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs >= {MIN_VOCAB_SIZE}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(spec, stats, int(train_mb * 1e6)), trainer=trainer)
    text = tok.to_str()
    return TextTokenizer(tok, tok.token_to_id(EOS_TOKEN), _fingerprint_json(text), f"bpe:{spec.spec}")
