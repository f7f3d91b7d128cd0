"""Token streams cut into fixed-length samples with stable ids, a validation split and batching."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .corpus import CorpusSpec, CorpusStats, corpus_stats, iter_pieces, parse_corpus_spec, skipped_note
from .tokenizer import TextTokenizer, from_tokenizer_json, load_pretrained_tokenizer, train_bpe

CACHE_VERSION = 1
LOCK_TIMEOUT_S = 1800.0  # how long a process waits for another one building the same cache entry


def default_cache_dir() -> Path:
    """``$QWIRE_CACHE`` if set, else ``~/.cache/qwire``; ValueError where that is a file."""
    env = os.environ.get("QWIRE_CACHE")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "qwire"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{'QWIRE_CACHE=' + env if env else path}: the tokenizer and token cache is a directory, "
                         f"and {path} is a file; point QWIRE_CACHE at a directory")
    return path


class TokenDataset(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens over a token stream.

    Window ``w`` holds tokens ``[w * (seq_len + 1), (w + 1) * (seq_len + 1))``; ``w`` is the sample's
    id, stable across runs and processes for the same corpus, tokenizer and ``seq_len``.
    ``dataset[i]`` returns ``(tokens LongTensor[seq_len + 1], sample_id)``.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, sample_ids: np.ndarray, info: dict[str, Any]) -> None:
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.sample_ids = np.asarray(sample_ids, dtype=np.int64)
        self.info = info

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len + 1

    def __len__(self) -> int:
        return len(self.sample_ids)

    def get_by_id(self, sample_id: int) -> torch.Tensor:
        """The tokens of the window with this id (any window of the stream, either split)."""
        n = self.tokens_per_sample
        start = int(sample_id) * n
        if sample_id < 0 or start + n > len(self.tokens):
            raise IndexError(f"sample id {sample_id} is outside the token stream")
        return torch.from_numpy(np.asarray(self.tokens[start : start + n], dtype=np.int64))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        sample_id = int(self.sample_ids[i])
        return self.get_by_id(sample_id), sample_id

    def __repr__(self) -> str:
        return f"TokenDataset(samples={len(self)}, seq_len={self.seq_len}, corpus={self.info.get('corpus')!r})"


# ----------------------------------------------------------------------------- shuffling

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return z ^ (z >> np.uint64(31))


def epoch_order(sample_ids: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """Positions of ``sample_ids`` in the shuffled order for (seed, epoch).

    Samples are sorted by a 64-bit hash of (seed, epoch, sample id): the same order on every
    process and machine, independent of numpy/torch random-number streams.
    """
    key = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    key = _splitmix64(key ^ np.uint64(epoch & 0xFFFFFFFFFFFFFFFF))
    h = _splitmix64(np.asarray(sample_ids, dtype=np.int64).astype(np.uint64) ^ key)
    return np.argsort(h, kind="stable")


def num_batches(dataset: TokenDataset, batch_size: int) -> int:
    """Full batches per epoch (the last incomplete batch is dropped)."""
    return len(dataset) // batch_size


def iterate_batches(
    dataset: TokenDataset,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    start_batch: int = 0,
    shuffle: bool = True,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield ``(input_ids, labels, sample_ids)`` for one epoch.

    ``input_ids`` and ``labels`` are LongTensor[B, seq_len] (labels are the tokens shifted by one),
    ``sample_ids`` LongTensor[B]. The order depends only on (seed, epoch) when ``shuffle``; the last
    incomplete batch is dropped; ``start_batch`` skips the first batches of the epoch (resume).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if start_batch < 0:
        raise ValueError(f"start_batch must be >= 0, got {start_batch}")
    n = len(dataset)
    if n < batch_size:
        raise ValueError(
            f"dataset has {n} samples of {dataset.tokens_per_sample} tokens, fewer than "
            f"batch_size={batch_size}: one batch needs {batch_size * dataset.tokens_per_sample} tokens; "
            "use a bigger corpus, a smaller batch_size or a smaller seq_len"
        )
    order = epoch_order(dataset.sample_ids, seed, epoch) if shuffle else np.arange(n)
    for b in range(start_batch, n // batch_size):
        idx = order[b * batch_size : (b + 1) * batch_size]
        ids = dataset.sample_ids[idx]
        tokens = torch.stack([dataset.get_by_id(int(s)) for s in ids])
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.from_numpy(ids.copy())


# ----------------------------------------------------------------------------- caching


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive lock between processes (no-op where ``fcntl`` is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {timeout_s:.0f}s for the cache lock {path}; another process is building "
                        "the same dataset (or hung): remove the lock file or use another cache_dir"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _slug(spec: CorpusSpec) -> str:
    base = spec.kind if spec.path is None else f"{spec.kind}-{Path(spec.path).name or 'root'}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in base)[:40]


def _get_tokenizer(
    spec: CorpusSpec,
    stats: CorpusStats,
    vocab_size: int,
    tokenizer: str | None,
    train_mb: float,
    cache: Path,
) -> TextTokenizer:
    if tokenizer is not None:
        return load_pretrained_tokenizer(tokenizer)
    key = f"{_slug(spec)}-{stats.fingerprint[:16]}-bpe{vocab_size}-t{train_mb:g}mb-c{CACHE_VERSION}"
    path = cache / "tokenizers" / f"{key}.json"
    if not path.is_file():
        with _file_lock(cache / "locks" / f"{key}.lock"):
            if not path.is_file():
                tok = train_bpe(spec, stats, vocab_size, train_mb)
                _atomic_write(path, lambda tmp: tok.save(tmp))
    return from_tokenizer_json(path)


def _encode_corpus(spec: CorpusSpec, tok: TextTokenizer, dtype: np.dtype) -> np.ndarray:
    chunks: list[np.ndarray] = []
    batch: list[tuple[str, bool]] = []
    size = 0

    def flush() -> None:
        ids = tok.encode_batch([t for t, _ in batch])
        for (_, ends), seq in zip(batch, ids):
            if ends and tok.eos_id is not None:
                seq = seq + [tok.eos_id]
            chunks.append(np.asarray(seq, dtype=dtype))
        batch.clear()

    for piece in iter_pieces(spec):
        batch.append(piece)
        size += len(piece[0])
        if size >= 8_000_000 or len(batch) >= 4096:
            flush()
            size = 0
    if batch:
        flush()
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def _get_tokens(spec: CorpusSpec, stats: CorpusStats, tok: TextTokenizer, cache: Path) -> tuple[np.ndarray, str]:
    key = f"{_slug(spec)}-{stats.fingerprint[:16]}-tok{tok.fingerprint[:16]}-c{CACHE_VERSION}"
    path = cache / "tokens" / f"{key}.npy"
    if not path.is_file():
        with _file_lock(cache / "locks" / f"{key}.lock"):
            if not path.is_file():
                dtype = np.dtype(np.uint16) if tok.vocab_size <= 65536 else np.dtype(np.int32)
                tokens = _encode_corpus(spec, tok, dtype)

                def write(tmp: str) -> None:
                    with open(tmp, "wb") as fh:
                        np.save(fh, tokens)

                _atomic_write(path, write)
    return np.load(path, mmap_mode="r"), key


# ----------------------------------------------------------------------------- building


def split_windows(n_windows: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation window ids: ``round(n * val_fraction)`` (at least 1 when
    ``val_fraction > 0``) validation windows spread evenly over the stream; the rest train."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = 0 if val_fraction == 0 else max(1, round(n_windows * val_fraction))
    val = ((np.arange(n_val, dtype=np.float64) + 0.5) * n_windows / max(1, n_val)).astype(np.int64)
    is_val = np.zeros(n_windows, dtype=bool)
    is_val[val] = True
    all_ids = np.arange(n_windows, dtype=np.int64)
    return all_ids[~is_val], all_ids[is_val]


def build_datasets(
    corpus: str = "stdlib",
    seq_len: int = 128,
    vocab_size: int = 4096,
    seed: int = 0,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike | None = None,
    max_tokens: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    tokenizer_train_mb: float = 4.0,
    model_vocab_size: int | None = None,
) -> tuple[TokenDataset, TokenDataset, TextTokenizer]:
    """Build (train, validation, tokenizer) for a corpus spec (see ``qwire.data.corpus``).

    The tokenizer (a byte-level BPE with ``vocab_size`` ids trained on at most
    ``tokenizer_train_mb`` MB of the corpus, or the local Hugging Face tokenizer at ``tokenizer``)
    and the token stream are cached under ``cache_dir`` (default ``$QWIRE_CACHE`` or
    ``~/.cache/qwire``), keyed by a fingerprint of the corpus content (and the token stream by the
    tokenizer's fingerprint); concurrent processes build each entry once. ``tokenizer`` is a local
    folder (a model directory with ``tokenizer.json`` or files ``AutoTokenizer`` reads offline) or a
    ``tokenizer.json`` file; ``vocab_size`` is then ignored. ``model_vocab_size`` (a pretrained
    model's vocabulary) is checked before anything is encoded: a tokenizer with more ids is a
    ``ValueError``. ``max_tokens`` keeps only the start of the stream. ``seed`` is recorded for
    reference: the split does not depend on it, and shuffling takes its seed in ``iterate_batches``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
    spec = parse_corpus_spec(str(corpus))
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    stats = corpus_stats(spec)
    tok = _get_tokenizer(
        spec, stats, vocab_size, None if tokenizer is None else str(tokenizer), tokenizer_train_mb, cache
    )
    if model_vocab_size is not None and tok.vocab_size > model_vocab_size:
        raise ValueError(
            f"the tokenizer ({tok.source}) has {tok.vocab_size} ids but the model only {model_vocab_size} "
            "embeddings: ids past the model's vocabulary cannot be embedded; use the tokenizer the model was "
            "trained with (a model directory's own tokenizer must fit the vocab_size of its config.json)"
            + (f" or a vocab_size <= {model_vocab_size}" if tokenizer is None else "")
        )
    tokens, cache_key = _get_tokens(spec, stats, tok, cache)
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    n = seq_len + 1
    n_windows = len(tokens) // n
    need = n * (2 if val_fraction > 0 else 1)
    if len(tokens) < need:
        what = "one training and one validation sample" if val_fraction > 0 else "one sample"
        raise ValueError(
            f"corpus {spec.spec!r} is too small: {len(tokens)} tokens, but seq_len={seq_len} needs "
            f"{n} tokens per sample and {need} for {what}; use a bigger corpus, a smaller seq_len"
            + (" or a larger max_tokens" if max_tokens is not None else "") + skipped_note(spec)
        )
    train_ids, val_ids = split_windows(n_windows, val_fraction)
    if len(train_ids) == 0:
        raise ValueError(
            f"val_fraction={val_fraction} leaves no training sample out of {n_windows} "
            f"({len(tokens)} tokens, seq_len={seq_len}); lower val_fraction or use a bigger corpus"
        )
    fingerprint = hashlib.blake2b(
        f"{stats.fingerprint}/{tok.fingerprint}/{len(tokens)}/{seq_len}/{val_fraction}".encode(),
        digest_size=12,
    ).hexdigest()
    info: dict[str, Any] = {
        "corpus": spec.spec,
        "corpus_fingerprint": stats.fingerprint,
        "tokenizer": tok.source,
        "tokenizer_fingerprint": tok.fingerprint,
        "vocab_size": tok.vocab_size,
        "n_documents": stats.n_documents,
        "n_bytes": stats.n_bytes,
        "n_tokens": int(len(tokens)),
        "seq_len": seq_len,
        "n_windows": n_windows,
        "n_train": len(train_ids),
        "n_val": len(val_ids),
        "val_fraction": val_fraction,
        "seed": seed,
        "cache_key": cache_key,
        "fingerprint": fingerprint,
    }
    train = TokenDataset(tokens, seq_len, train_ids, {**info, "split": "train"})
    val = TokenDataset(tokens, seq_len, val_ids, {**info, "split": "val"})
    return train, val, tok
