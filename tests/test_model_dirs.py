"""Local Hugging Face model directories: pretrained weights, dtype and the model's own tokenizer,
loaded offline; clear errors for what a directory lacks; unknown names fail without the hub."""

from __future__ import annotations

import json
import random
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from qwire.data import build_datasets, iter_documents, iterate_batches, load_pretrained_tokenizer, parse_corpus_spec
from qwire.models import ModelSourceError, build_model, lm_loss, model_source, split_model

WORDS = (
    "gradients flow back through pipeline stages while activations travel forward in four bits "
    "over slow links between machines that share one model and one tokenizer"
).split()
TOKENIZER_VOCAB = 300
MODEL_VOCAB = 320  # padded embedding, as real checkpoints often have


class HubCalled(AssertionError):
    pass


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every test here runs with the hub's download functions and network sockets raising if used, and
    fails if any was called (even where the caller caught the error)."""
    import huggingface_hub
    import huggingface_hub.file_download
    import transformers.utils.hub

    calls: list[str] = []

    def hub(*args, **kwargs):
        calls.append(f"{args} {kwargs}")
        raise HubCalled(f"hub called with {args} {kwargs}")

    for mod in (huggingface_hub, huggingface_hub.file_download, transformers.utils.hub):
        for name in ("hf_hub_download", "snapshot_download"):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, hub)
    connect = socket.socket.connect

    def network(sock: socket.socket, *args, **kwargs):  # a local (AF_UNIX) socket is not the network
        return connect(sock, *args, **kwargs) if sock.family == socket.AF_UNIX else hub(sock, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", network)
    monkeypatch.setattr(socket, "create_connection", hub)
    yield calls
    assert not calls, f"the hub or the network was called: {calls}"


def _text(seed: int, n_lines: int) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n_lines)) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(3):
        (root / f"doc{i}.txt").write_text(_text(i, 150))
    return root


def _train_tokenizer(corpus: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([f.read_text() for f in sorted(corpus.iterdir())], trainer=trainer)
    return tok


def _save_model(folder: Path, dtype: torch.dtype = torch.float32, seed: int = 1) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=MODEL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> tuple[Path, LlamaForCausalLM]:
    """A tiny Llama saved by transformers with a tokenizer trained here (eos "</s>", id 1)."""
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    model = _save_model(folder)
    fast = PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(corpus), bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    assert (folder / "tokenizer.json").is_file() and (folder / "model.safetensors").is_file()
    return folder, model


def _copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


# ----------------------------------------------------------------------------- resolving


def test_model_source_of_a_checkpoint_dir(model_dir) -> None:
    folder, _ = model_dir
    src = model_source(str(folder))
    assert (src.kind, src.model_type, src.path, src.tokenizer) == ("checkpoint", "llama", str(folder), str(folder))
    assert src.pretrained and src.vocab_size == MODEL_VOCAB and src.dtype == torch.float32
    assert str(folder) in src.describe() and "vocabulary 320" in src.describe()
    assert model_source("llama-tiny").kind == "preset" and model_source("llama-tiny").tokenizer is None


def test_loaded_weights_are_the_saved_ones(model_dir) -> None:
    folder, saved = model_dir
    loaded = build_model(str(folder))
    assert type(loaded) is type(saved) and loaded.config.vocab_size == MODEL_VOCAB
    ref = saved.state_dict()
    got = loaded.state_dict()
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_checkpoint_dtype(model_dir, tmp_path: Path) -> None:
    folder, _ = model_dir
    bf = _copy(folder, tmp_path / "bf16", skip=("model.safetensors", "config.json"))
    saved = _save_model(bf, dtype=torch.bfloat16)
    src = model_source(str(bf))
    assert src.dtype == torch.bfloat16
    auto = build_model(src, dtype="auto")
    assert auto.lm_head.weight.dtype == torch.bfloat16
    assert all(torch.equal(p, q) for p, q in zip(auto.parameters(), saved.parameters()))
    fp32 = build_model(src)  # the default: fp32 master weights, an exact upcast of the saved ones
    assert fp32.lm_head.weight.dtype == torch.float32
    assert all(torch.equal(p, q.float()) for p, q in zip(fp32.parameters(), saved.parameters()))


# ----------------------------------------------------------------------------- the model's tokenizer


def test_the_models_tokenizer_is_used(model_dir, corpus: Path, tmp_path: Path) -> None:
    folder, _ = model_dir
    src = model_source(str(folder))
    train, val, tok = build_datasets(corpus=str(corpus), seq_len=32, tokenizer=src.tokenizer,
                                     model_vocab_size=src.vocab_size, cache_dir=tmp_path)
    hf = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    assert tok.vocab_size == len(hf) == TOKENIZER_VOCAB and tok.eos_id == hf.eos_token_id == 1
    assert tok.fingerprint == train.info["tokenizer_fingerprint"]
    # the token stream is the model tokenizer's ids, documents separated by its "</s>"
    docs = list(iter_documents(parse_corpus_spec(str(corpus))))
    expected = []
    for text in docs:
        expected += hf(text, add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    assert np.asarray(train.tokens).tolist() == expected
    # the token cache is keyed by the tokenizer: qwire's own BPE on the same corpus is another entry
    build_datasets(corpus=str(corpus), seq_len=32, vocab_size=290, cache_dir=tmp_path)
    assert len(list((tmp_path / "tokens").glob("*.npy"))) == 2


def test_eos_from_the_model_config(model_dir, tmp_path: Path) -> None:
    """A bare tokenizer.json (no tokenizer_config.json): the end-of-text id is the model's eos_token_id."""
    folder, _ = model_dir
    bare = _copy(folder, tmp_path / "bare", skip=("tokenizer_config.json", "special_tokens_map.json"))
    tok = load_pretrained_tokenizer(bare)
    assert tok.eos_id == 1
    assert tok.encode("slow links") == load_pretrained_tokenizer(folder).encode("slow links")


def test_an_explicit_tokenizer_replaces_the_dirs(model_dir, tmp_path: Path) -> None:
    folder, _ = model_dir
    other = tmp_path / "tok"
    other.mkdir()
    shutil.copy(folder / "tokenizer.json", other / "tokenizer.json")
    assert model_source(str(folder), tokenizer=other).tokenizer == str(other)
    with pytest.raises(ModelSourceError, match="no such file"):
        model_source(str(folder), tokenizer=tmp_path / "missing")


def test_vocabulary_check(model_dir, corpus: Path, tmp_path: Path) -> None:
    folder, _ = model_dir
    src = model_source(str(folder))
    with pytest.raises(ValueError, match=f"has {TOKENIZER_VOCAB} ids but the model only 200"):
        build_datasets(corpus=str(corpus), seq_len=32, tokenizer=src.tokenizer, model_vocab_size=200,
                       cache_dir=tmp_path)
    assert not (tmp_path / "tokens").exists()  # checked before anything was encoded
    with pytest.raises(ValueError, match="has 400 ids but the model .* only 320; use the model's own tokenizer"):
        build_model(src, vocab_size=400)
    assert build_model(src, vocab_size=TOKENIZER_VOCAB).config.vocab_size == MODEL_VOCAB  # fewer ids: fine


# ----------------------------------------------------------------------------- the first loss


def test_first_loss_equals_the_saved_models_loss(model_dir, corpus: Path, tmp_path: Path) -> None:
    folder, _ = model_dir
    src = model_source(str(folder))
    train, _, tok = build_datasets(corpus=str(corpus), seq_len=32, tokenizer=src.tokenizer,
                                   model_vocab_size=src.vocab_size, cache_dir=tmp_path)
    input_ids, labels, _ = next(iterate_batches(train, batch_size=4, seed=0, epoch=0))
    model = build_model(src, vocab_size=tok.vocab_size, seed=123)  # the seed does not matter: pretrained
    losses = []
    for n_stages in (1, 2):
        h = input_ids
        for stage in split_model(model, n_stages):
            h = stage(h)
        losses.append(lm_loss(h, labels))
    # the reference: the saved model, loaded by transformers alone, on the same windows
    ref_model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    windows = torch.cat([input_ids, labels[:, -1:]], dim=1)
    with torch.no_grad():
        ref = ref_model(input_ids=windows, labels=windows).loss
    for loss in losses:
        torch.testing.assert_close(loss.detach(), ref, rtol=0, atol=1e-5)
    assert abs(float(ref) - float(np.log(MODEL_VOCAB))) < 1.0  # a real loss, not a degenerate one


# ----------------------------------------------------------------------------- errors


def test_dir_without_config_json(model_dir, tmp_path: Path) -> None:
    folder, _ = model_dir
    d = _copy(folder, tmp_path / "noconfig", skip=("config.json",))
    with pytest.raises(ModelSourceError, match="has no config.json"):
        model_source(str(d))
    with pytest.raises(ModelSourceError, match="has no config.json"):
        build_model(str(d))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match="has no config.json .*holds nothing"):
        build_model(str(empty))


def test_dir_without_weights(model_dir, tmp_path: Path) -> None:
    folder, _ = model_dir
    d = _copy(folder, tmp_path / "noweights", skip=("model.safetensors",))
    with pytest.raises(ModelSourceError, match="has config.json and a tokenizer but no weights"):
        model_source(str(d))
    with pytest.raises(ModelSourceError, match="no weights"):
        build_model(str(d))
    # the config file itself: a new model from that configuration, with the directory's tokenizer if asked
    src = model_source(str(d / "config.json"), tokenizer=d)
    assert (src.kind, src.tokenizer, src.vocab_size) == ("config", str(d), None)
    # a folder holding only a config.json (no tokenizer, no weights) stays a new model, as before
    only_config = _copy(folder, tmp_path / "config-only", skip=tuple(f.name for f in folder.iterdir()
                                                                      if f.name != "config.json"))
    assert model_source(str(only_config)).kind == "config"


def test_dir_with_missing_or_placeholder_weights(model_dir, tmp_path: Path) -> None:
    folder, _ = model_dir
    lfs = _copy(folder, tmp_path / "lfs", skip=("model.safetensors",))
    (lfs / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n")
    with pytest.raises(ModelSourceError, match="Git LFS pointer"):
        model_source(str(lfs))
    sharded = _copy(folder, tmp_path / "sharded", skip=("model.safetensors",))
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors",
                                            "model.norm.weight": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(folder / "model.safetensors", sharded / "model-00001-of-00002.safetensors")
    with pytest.raises(ModelSourceError, match="2 weight files but 1 are missing .*00002-of-00002"):
        model_source(str(sharded))


def test_weights_that_do_not_fit_the_model_or_cannot_load(model_dir, tmp_path: Path) -> None:
    """Weights of a base model without its head (or of another architecture) loaded with part of the model at
    its random init and trained with no error; a raw state dict or shards without their index passed the
    directory check and failed later; a cut safetensors file was a bare SafetensorError."""
    from transformers import LlamaModel

    folder, saved = model_dir
    base = _copy(folder, tmp_path / "base", skip=("model.safetensors",))
    LlamaModel(saved.config).save_pretrained(tmp_path / "base-weights")
    shutil.copy(tmp_path / "base-weights" / "model.safetensors", base / "model.safetensors")
    with pytest.raises(ModelSourceError, match=r"1 of the model's \d+ tensors are not in the weights \(lm_head"):
        build_model(str(base))
    raw = _copy(folder, tmp_path / "raw", skip=("model.safetensors",))
    torch.save(saved.state_dict(), raw / "model.pt")
    with pytest.raises(ModelSourceError, match=r"holds weights \(model.pt\) that transformers cannot load"):
        model_source(str(raw))
    with pytest.raises(ModelSourceError, match=r"is a weight file; give the model directory that holds it"):
        model_source(str(folder / "model.safetensors"))
    (tmp_path / "models--org--name" / "snapshots" / "abc").mkdir(parents=True)
    with pytest.raises(ModelSourceError, match=r"a Hugging Face cache folder: give its snapshot"):
        model_source(str(tmp_path / "models--org--name"))
    cut = _copy(folder, tmp_path / "cut", skip=("model.safetensors",))
    data = (folder / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelSourceError, match="incomplete or corrupt"):
        build_model(str(cut))


def test_a_preset_name_that_is_also_a_model_dir_here(model_dir, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory named like a preset was silently ignored: the preset trained, from a random init."""
    folder, _ = model_dir
    _copy(folder, tmp_path / "llama-tiny")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match=r"both a preset .* write ./llama-tiny for the directory"):
        model_source("llama-tiny")
    assert model_source("./llama-tiny").kind == "checkpoint"


def test_dir_with_weights_but_no_tokenizer(model_dir, tmp_path: Path) -> None:
    folder, saved = model_dir
    d = _copy(folder, tmp_path / "notok", skip=("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"))
    with pytest.raises(ModelSourceError, match="has weights but no tokenizer"):
        model_source(str(d))
    # building the model alone needs no tokenizer
    assert model_source(str(d), require_tokenizer=False).tokenizer is None
    assert torch.equal(build_model(str(d)).lm_head.weight, saved.lm_head.weight)


@pytest.mark.parametrize("name", ["nosuchdir", "some-org/some-model", "./models/missing"])
def test_unknown_name_fails_fast_without_the_hub(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for call in (lambda: model_source(name), lambda: build_model(name, vocab_size=300)):
        with pytest.raises(ModelSourceError) as err:
            call()
        msg = str(err.value)
        assert repr(name) in msg and "llama-tiny" in msg and "hf:ORG/NAME" in msg
        assert not no_network


def test_hub_only_with_the_prefix(model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    folder, _ = model_dir
    calls = []

    def fake_snapshot(repo_id: str, **kwargs) -> str:
        calls.append(repo_id)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    src = model_source("hf:some-org/tiny-llama")
    assert calls == ["some-org/tiny-llama"]
    assert (src.kind, src.path, src.tokenizer, src.spec) == ("checkpoint", str(folder), str(folder),
                                                            "hf:some-org/tiny-llama")
    with pytest.raises(ModelSourceError):
        model_source("some-org/tiny-llama")  # without the prefix: no hub
    assert calls == ["some-org/tiny-llama"]


def test_qwire_train_fine_tunes_a_model_dir(model_dir, corpus: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`qwire train --model DIR` end to end: 2 pipeline stages train the saved weights on ids from the
    model's own tokenizer; the first step's loss is the saved model's loss on the first batch."""
    from qwire.train import TrainConfig, launch

    folder, _ = model_dir
    monkeypatch.setenv("QWIRE_CACHE", str(tmp_path / "cache"))
    cfg = TrainConfig(model=str(folder), corpus=str(corpus), stages=2, steps=2, batch_size=4, microbatches=2,
                      seq_len=32, fwd_codec="fp32", bwd_codec="fp32", eval_every=0, eval_batches=1,
                      checkpoint_every=0, timeout=120, out=str(tmp_path / "run"))
    launch(cfg)
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    src = model_source(str(folder))
    train, _, _ = build_datasets(corpus=str(corpus), seq_len=32, tokenizer=src.tokenizer,
                                 model_vocab_size=src.vocab_size, cache_dir=tmp_path / "cache2")
    input_ids, labels, _ = next(iterate_batches(train, batch_size=4, seed=0, epoch=0))
    ref_model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    windows = torch.cat([input_ids, labels[:, -1:]], dim=1)
    with torch.no_grad():
        ref = float(ref_model(input_ids=windows, labels=windows).loss)
    assert first["step"] == 1 and first["loss"] == pytest.approx(ref, rel=1e-5)


def test_a_sentencepiece_tokenizer_without_its_package_names_it(tmp_path: Path) -> None:
    """transformers' error for a folder with only tokenizer.model asked for tiktoken."""
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is not None:
        pytest.skip("sentencepiece is installed here")
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05hello")
    with pytest.raises(ValueError, match="tokenizer.model is a SentencePiece model, which needs the sentencepiece"):
        load_pretrained_tokenizer(tmp_path)
