"""Tokenizers: a byte-level BPE trained on the corpus, or a local Hugging Face tokenizer."""

from __future__ import annotations

import hashlib
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

    @property
    def vocab_size(self) -> int:
        if self._fast:
            return self._backend.get_vocab_size(with_added_tokens=True)
        return len(self._backend)

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


def from_tokenizer_json(path: str | Path, eos_token: str | None = EOS_TOKEN) -> TextTokenizer:
    """Load a ``tokenizer.json`` file written by ``tokenizers``."""
    text = Path(path).read_text(encoding="utf-8")
    tok = Tokenizer.from_str(text)
    eos_id = tok.token_to_id(eos_token) if eos_token else None
    return TextTokenizer(tok, eos_id, _fingerprint_json(text), str(path))


def load_pretrained_tokenizer(path: str | Path) -> TextTokenizer:
    """Load a local Hugging Face tokenizer: a folder (``tokenizer.json`` or anything ``AutoTokenizer``
    reads) or a ``tokenizer.json`` file. Nothing is downloaded."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    if p.is_file():
        return from_tokenizer_json(p, eos_token=EOS_TOKEN)
    eos_token = _eos_from_config(p)
    if (p / "tokenizer.json").is_file():
        return from_tokenizer_json(p / "tokenizer.json", eos_token=eos_token)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    vocab = sorted(hf.get_vocab().items())
    fp = _fingerprint_json(json.dumps([type(hf).__name__, vocab]))
    return TextTokenizer(hf, hf.eos_token_id, fp, str(p))


def _eos_from_config(folder: Path) -> str | None:
    cfg = folder / "tokenizer_config.json"
    if not cfg.is_file():
        return EOS_TOKEN
    eos = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
    if isinstance(eos, dict):  # older files store an AddedToken as a dict
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


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
