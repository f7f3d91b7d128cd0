"""qwire.data: corpora, tokenizer caching, stable sample ids, splits and batching."""

from __future__ import annotations

import json
import random
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pytest
import torch

import qwire.data.dataset as dataset_mod
from qwire.data import (
    build_datasets,
    epoch_order,
    iter_documents,
    iterate_batches,
    load_pretrained_tokenizer,
    num_batches,
    parse_corpus_spec,
    split_windows,
)
from qwire.data.corpus import iter_pieces

WORDS = (
    "the quick brown fox jumps over a lazy dog while packets cross slow links and "
    "pipeline stages exchange compressed activations with fewer bits on the wire"
).split()


def _text(seed: int, n_lines: int) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n_lines)) + "\n"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(_text(1, 120))
    (root / "b.md").write_text(_text(2, 120))
    (root / "sub" / "c.py").write_text(_text(3, 120))
    (root / "skip.bin").write_bytes(b"\x00\x01 not text")
    (root / "tests").mkdir()
    (root / "tests" / "ignored.txt").write_text("never read\n")
    return root


def _build(corpus, cache: Path, **kw):
    args = dict(seq_len=32, vocab_size=320, val_fraction=0.1, cache_dir=cache)
    args.update(kw)
    return build_datasets(corpus=str(corpus), **args)


# ----------------------------------------------------------------------------- specs and corpora


def test_parse_corpus_spec(folder: Path, tmp_path: Path) -> None:
    s = parse_corpus_spec("stdlib")
    assert s.kind == "stdlib" and s.max_mb == 24.0
    assert parse_corpus_spec("stdlib:max_mb=2").max_mb == 2.0
    assert parse_corpus_spec(str(folder)).kind == "text"
    j = tmp_path / "d.jsonl"
    j.write_text('{"text": "hi"}\n')
    assert parse_corpus_spec(str(j)).kind == "jsonl"
    s = parse_corpus_spec(f"jsonl:{j},field=body,max_mb=0.5")
    assert (s.kind, s.path, s.field, s.max_mb) == ("jsonl", str(j), "body", 0.5)
    with pytest.raises(ValueError, match="unknown option"):
        parse_corpus_spec("stdlib:field=x")
    with pytest.raises(ValueError, match="key=value"):
        parse_corpus_spec(f"text:{folder},oops")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_corpus_spec(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_corpus_spec(f"jsonl:{tmp_path / 'missing.jsonl'}")


def test_folder_documents_sorted_and_filtered(folder: Path) -> None:
    docs = list(iter_documents(parse_corpus_spec(str(folder))))
    assert docs == [_text(1, 120), _text(2, 120), _text(3, 120)]  # a.txt, b.md, sub/c.py; no .bin, no tests/
    sizes = [len(d.encode()) for d in docs]  # whole documents until the bound is reached
    limited = list(iter_documents(parse_corpus_spec(f"text:{folder},max_mb={(sizes[0] + 1) / 1e6}")))
    assert len(limited) == 2 and limited[0] == docs[0] and docs[1].startswith(limited[1])  # (cut if larger)
    limited = list(iter_documents(parse_corpus_spec(f"text:{folder},max_mb=0.000001")))
    assert limited == [docs[0][:1]]  # a document larger than the whole bound is cut


def test_max_mb_cuts_a_corpus_of_one_big_file(tmp_path: Path) -> None:
    """max_mb did nothing for a single file: its one document was taken whole."""
    (tmp_path / "big.txt").write_text(_text(4, 20_000))
    docs = list(iter_documents(parse_corpus_spec(f"text:{tmp_path / 'big.txt'},max_mb=0.1")))
    assert len(docs) == 1 and 0.09e6 < len(docs[0].encode()) <= 0.1e6 and docs[0].endswith("\n")


def test_files_that_are_not_utf8_text_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Binary token files, UTF-16 and Latin-1 text were trained on as replacement characters and NULs."""
    (tmp_path / "tokens.bin").write_bytes(np.arange(5000, dtype=np.uint16).tobytes())
    (tmp_path / "utf16.txt").write_text(_text(5, 50), encoding="utf-16")
    (tmp_path / "latin1.txt").write_bytes(("caf\u00e9 na\u00efve " * 400).encode("latin-1"))
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    for name, why in (("tokens.bin", "NUL bytes"), ("utf16.txt", "NUL bytes"), ("latin1.txt", "not valid UTF-8"),
                      ("bad.jsonl", "line 2 is not UTF-8")):
        with pytest.raises(ValueError, match=f"{name}: .*{why}"):
            list(iter_documents(parse_corpus_spec(str(tmp_path / name))))
    (tmp_path / "few.txt").write_bytes(b"mostly fine text \xff here\n" * 3)  # a few bad bytes: replaced
    assert "\ufffd" in list(iter_documents(parse_corpus_spec(str(tmp_path / "few.txt"))))[0]
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ in a corpus path, as in --model
    assert parse_corpus_spec("text:~/few.txt").path == str(tmp_path / "few.txt")
    assert parse_corpus_spec("~/few.txt").path == str(tmp_path / "few.txt")


def test_a_folder_corpus_too_small_names_the_files_it_did_not_read(tmp_path: Path) -> None:
    """A folder of .csv files (and one small .txt) said only 'too small: 11 tokens'."""
    (tmp_path / "a.csv").write_text(_text(6, 200))
    (tmp_path / "notes").write_text(_text(7, 200))
    (tmp_path / "b.txt").write_text("a few words\n")
    with pytest.raises(ValueError, match=r"too small: .*it holds 2 file\(s\) of other kinds, not read: a.csv, notes"):
        build_datasets(str(tmp_path), seq_len=64, vocab_size=300, cache_dir=tmp_path / ".cache")
    (tmp_path / "b.txt").unlink()
    with pytest.raises(ValueError, match=r"is empty: .*not read: a.csv, notes \(rename text files to .txt"):
        build_datasets(str(tmp_path), seq_len=64, vocab_size=300, cache_dir=tmp_path / ".cache")
    # jsonl: reads .jsonl files only: renaming to .txt would not make them read
    with pytest.raises(ValueError, match=r"not read: a.csv, notes \(name JSON Lines files .jsonl, or drop jsonl: "):
        build_datasets(f"jsonl:{tmp_path}", seq_len=64, vocab_size=300, cache_dir=tmp_path / ".cache")


def test_long_documents_are_cut_at_line_ends(tmp_path: Path) -> None:
    doc = _text(4, 60_000)  # about 2.6 MB in one file
    (tmp_path / "big.txt").write_text(doc)
    pieces = list(iter_pieces(parse_corpus_spec(str(tmp_path / "big.txt"))))
    assert len(pieces) >= 3 and "".join(t for t, _ in pieces) == doc
    assert [e for _, e in pieces] == [False] * (len(pieces) - 1) + [True]
    assert all(t.endswith("\n") for t, _ in pieces)


def test_stdlib_corpus_small(tmp_path: Path) -> None:
    train, val, tok = build_datasets("stdlib:max_mb=0.5", seq_len=64, vocab_size=512, cache_dir=tmp_path)
    assert tok.vocab_size == 512
    assert len(train) > 100 and len(val) >= 1
    assert "import" in tok.decode(train.tokens[:5000].tolist())
    assert train.info["n_bytes"] >= 500_000


# ----------------------------------------------------------------------------- tokenizer and caching


def test_tokenizer_roundtrip_and_eos(folder: Path, tmp_path: Path) -> None:
    train, _, tok = _build(folder, tmp_path)
    assert 257 <= tok.vocab_size <= 320
    s = "the quick brown fox\n  jumps ünïcode ✓"
    assert tok.decode(tok.encode(s)) == s
    assert tok.eos_id is not None
    # documents are separated by the end-of-text token
    assert int((np.asarray(train.tokens) == tok.eos_id).sum()) == 3
    assert int(train.tokens.max()) < tok.vocab_size


def test_cache_is_reused(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a_train, _, a_tok = _build(folder, tmp_path)
    assert list((tmp_path / "tokenizers").glob("*.json")) and list((tmp_path / "tokens").glob("*.npy"))

    def boom(*args, **kwargs):
        raise AssertionError("cache miss: tokenizer or corpus encoded again")

    monkeypatch.setattr(dataset_mod, "train_bpe", boom)
    monkeypatch.setattr(dataset_mod, "_encode_corpus", boom)
    b_train, _, b_tok = _build(folder, tmp_path)
    assert a_tok.fingerprint == b_tok.fingerprint
    assert np.array_equal(np.asarray(a_train.tokens), np.asarray(b_train.tokens))
    # a changed corpus is a different cache entry
    (folder / "a.txt").write_text(_text(9, 120))
    monkeypatch.undo()
    c_train, _, _ = _build(folder, tmp_path)
    assert c_train.info["corpus_fingerprint"] != a_train.info["corpus_fingerprint"]


def test_local_hf_tokenizer_dir(folder: Path, tmp_path: Path) -> None:
    _, _, tok = _build(folder, tmp_path / "c1")
    tdir = tmp_path / "tok"
    tdir.mkdir()
    tok.save(tdir / "tokenizer.json")
    (tdir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    loaded = load_pretrained_tokenizer(tdir)
    assert loaded.vocab_size == tok.vocab_size and loaded.eos_id == tok.eos_id
    train, _, tok2 = _build(folder, tmp_path / "c2", tokenizer=tdir, vocab_size=9999)  # vocab_size ignored
    assert tok2.fingerprint == tok.fingerprint
    assert train.info["tokenizer_fingerprint"] == tok.fingerprint


def _worker(args: tuple[str, str]) -> tuple[str, list[int]]:
    corpus, cache = args
    train, _, tok = build_datasets(corpus, seq_len=32, vocab_size=320, cache_dir=cache)
    return tok.fingerprint, train.sample_ids.tolist()


@pytest.mark.slow
def test_concurrent_builds_agree(folder: Path, tmp_path: Path) -> None:
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(_worker, [(str(folder), str(tmp_path))] * 2))
    assert results[0] == results[1]
    assert len(list((tmp_path / "tokens").glob("*.npy"))) == 1
    assert not list((tmp_path / "tokens").glob("*.tmp"))


# ----------------------------------------------------------------------------- samples, splits, batches


def test_samples_have_stable_ids(folder: Path, tmp_path: Path) -> None:
    a_train, a_val, _ = _build(folder, tmp_path / "a")
    b_train, b_val, _ = _build(folder, tmp_path / "b")  # a separate cache: built from scratch
    assert np.array_equal(a_train.sample_ids, b_train.sample_ids)
    assert np.array_equal(a_val.sample_ids, b_val.sample_ids)
    stream = np.asarray(a_train.tokens, dtype=np.int64)
    n = a_train.tokens_per_sample
    for i in (0, 3, len(a_train) - 1):
        tokens, sid = a_train[i]
        assert tokens.dtype == torch.long and tokens.shape == (33,)
        assert torch.equal(tokens, torch.from_numpy(stream[sid * n : (sid + 1) * n]))
        assert torch.equal(tokens, b_train[i][0]) and sid == b_train[i][1]


def test_train_val_disjoint(folder: Path, tmp_path: Path) -> None:
    train, val, _ = _build(folder, tmp_path)
    tr, va = set(train.sample_ids.tolist()), set(val.sample_ids.tolist())
    assert not tr & va
    assert tr | va == set(range(train.info["n_windows"]))
    assert len(va) == round(train.info["n_windows"] * 0.1)
    t, v = split_windows(100, 0.05)
    assert v.tolist() == [10, 30, 50, 70, 90] and len(t) == 95
    assert len(split_windows(10, 0.0)[1]) == 0


def test_shuffle_is_deterministic_per_epoch(folder: Path, tmp_path: Path) -> None:
    train, _, _ = _build(folder, tmp_path)

    def ids(**kw) -> list[int]:
        return torch.cat([s for _, _, s in iterate_batches(train, 4, **kw)]).tolist()

    e0 = ids(seed=0, epoch=0)
    assert e0 == ids(seed=0, epoch=0)
    assert e0 != ids(seed=0, epoch=1)
    assert e0 != ids(seed=1, epoch=0)
    assert len(e0) == num_batches(train, 4) * 4 and len(set(e0)) == len(e0)
    assert set(e0) <= set(train.sample_ids.tolist())
    assert ids(shuffle=False) == train.sample_ids[: len(e0)].tolist()
    # the order depends only on the ids, seed and epoch: a pure function anyone can recompute
    order = epoch_order(train.sample_ids, 0, 0)
    assert train.sample_ids[order][: len(e0)].tolist() == e0


def test_batches_labels_and_start_batch(folder: Path, tmp_path: Path) -> None:
    train, _, _ = _build(folder, tmp_path)
    full = list(iterate_batches(train, 3, seed=5, epoch=2))
    assert len(full) == len(train) // 3  # the incomplete batch is dropped
    x, y, sid = full[0]
    assert x.shape == y.shape == (3, 32) and x.dtype == y.dtype == sid.dtype == torch.long
    for row in range(3):
        tokens, s = train[int(np.where(train.sample_ids == int(sid[row]))[0][0])]
        assert s == int(sid[row])
        assert torch.equal(x[row], tokens[:-1]) and torch.equal(y[row], tokens[1:])
    resumed = list(iterate_batches(train, 3, seed=5, epoch=2, start_batch=4))
    assert len(resumed) == len(full) - 4
    for (a, b, c), (d, e, f) in zip(resumed, full[4:]):
        assert torch.equal(a, d) and torch.equal(b, e) and torch.equal(c, f)
    assert list(iterate_batches(train, 3, start_batch=len(full))) == []


def test_max_tokens(folder: Path, tmp_path: Path) -> None:
    train, val, _ = _build(folder, tmp_path, max_tokens=33 * 10, val_fraction=0.2)
    assert train.info["n_tokens"] == 330 and len(train) == 8 and len(val) == 2


# ----------------------------------------------------------------------------- jsonl


def test_jsonl_corpus(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    rows = [{"content": _text(i, 30), "id": i} for i in range(8)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    spec = parse_corpus_spec(f"jsonl:{path},field=content")
    assert list(iter_documents(spec)) == [r["content"] for r in rows]
    train, val, tok = build_datasets(
        f"jsonl:{path},field=content", seq_len=16, vocab_size=300, cache_dir=tmp_path / "c"
    )
    assert len(train) > 10 and len(val) >= 1
    assert int((np.asarray(train.tokens) == tok.eos_id).sum()) == 8
    with pytest.raises(ValueError, match="no field 'text'"):
        build_datasets(str(path), seq_len=16, vocab_size=300, cache_dir=tmp_path / "c")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        build_datasets(str(bad), seq_len=16, vocab_size=300, cache_dir=tmp_path / "c")


# ----------------------------------------------------------------------------- errors


def test_errors(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _build(tmp_path / "nope", tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        _build(empty, tmp_path)
    small = tmp_path / "small.txt"
    small.write_text("just a few words here\n")
    with pytest.raises(ValueError, match=r"too small: \d+ tokens, but seq_len=128 needs 129 tokens"):
        _build(small, tmp_path, seq_len=128, vocab_size=300)
    with pytest.raises(ValueError, match="too small"):
        _build(folder, tmp_path, max_tokens=40)
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        _build(folder, tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="val_fraction"):
        _build(folder, tmp_path, val_fraction=1.0)
    train, _, _ = _build(folder, tmp_path)
    with pytest.raises(ValueError, match=rf"{len(train)} samples .* batch_size={len(train) + 1}"):
        next(iterate_batches(train, len(train) + 1))


def test_a_cache_directory_that_is_a_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """QWIRE_CACHE pointing at a file ended every rank in NotADirectoryError (.../afile/locks) without naming the
    variable."""
    from qwire.data.dataset import default_cache_dir

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("QWIRE_CACHE", str(tmp_path / "afile"))
    with pytest.raises(ValueError, match=f"QWIRE_CACHE={tmp_path}/afile: the tokenizer and token cache is a "
                                         "directory, and .* is a file; point QWIRE_CACHE at a directory"):
        default_cache_dir()
