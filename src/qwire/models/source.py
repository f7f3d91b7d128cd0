"""What a model spec names: a preset, a config file, or a local Hugging Face model directory.

``model_source(spec)`` answers without building anything (it reads ``config.json`` and lists
files), so a launcher can check ``--model`` before it starts any process. It never contacts the
Hugging Face hub for a preset, a path or an unknown name; only a name written ``hf:ORG/NAME`` is
downloaded (``huggingface_hub.snapshot_download``) and then used as a local directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .presets import PRESETS, get_preset, list_presets

HUB_PREFIX = "hf:"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# Files that hold a tokenizer's vocabulary (tokenizer_config.json alone does not).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "vocab.json", "vocab.txt")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
_LFS_POINTER = b"version https://git-lfs"


class ModelSourceError(ValueError):
    """A model spec that cannot be used; the message says what to change."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec.

    - ``kind``: ``"preset"`` (new model, random init), ``"config"`` (new model from a
      ``config.json`` file, or a folder holding only one), ``"checkpoint"`` (pretrained weights
      loaded from a local directory).
    - ``path``: the config file or directory (``None`` for a preset).
    - ``tokenizer``: the folder or file of the tokenizer to use, ``None`` to train qwire's own
      BPE. A checkpoint always has one: its own, or the one given explicitly.
    - ``vocab_size``: the vocabulary fixed by pretrained weights (the tokenizer must not have more
      ids), ``None`` when the model's vocabulary follows the tokenizer.
    - ``dtype``: the dtype the checkpoint's ``config.json`` records, if any.
    """

    spec: str
    kind: str
    model_type: str
    path: str | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
    dtype: torch.dtype | None = None

    @property
    def pretrained(self) -> bool:
        return self.kind == "checkpoint"

    def describe(self) -> str:
        """One line for a run's log."""
        if self.kind == "preset":
            what = f"preset {self.spec} (random init)"
        elif self.kind == "config":
            what = f"new {self.model_type} model from {self.path} (random init)"
        else:
            dt = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "unrecorded dtype"
            what = f"pretrained {self.model_type} from {self.path} ({dt} weights, vocabulary {self.vocab_size})"
        tok = f"tokenizer {self.tokenizer}" if self.tokenizer else "qwire's BPE tokenizer"
        return f"{what}, {tok}"


def model_source(
    spec: str | os.PathLike | ModelSource,
    tokenizer: str | os.PathLike | None = None,
    require_tokenizer: bool = True,
) -> ModelSource:
    """Resolve ``spec``: a preset name, a ``config.json`` file, a local model directory, or
    ``hf:ORG/NAME`` (downloaded from the hub; nothing else ever is).

    ``tokenizer`` (a folder or ``tokenizer.json``) replaces the tokenizer the spec brings: none for
    presets and config files, the directory's own for a checkpoint. Raises ``ModelSourceError``
    at once for a name that is neither a preset nor an existing path, and for a directory that
    lacks what is needed (``config.json``, weights, and a tokenizer unless ``require_tokenizer``
    is false: then a checkpoint without one has ``tokenizer=None``).
    """
    if isinstance(spec, ModelSource):
        if tokenizer is None:
            return spec
        return _with_tokenizer(spec, tokenizer)
    spec = os.fspath(spec)
    tok = _check_tokenizer_path(tokenizer)
    if spec in PRESETS:
        if (Path(spec) / "config.json").is_file():  # a model directory of the same name here: which is meant?
            raise ModelSourceError(
                f"model {spec!r} is both a preset (a new model, random init) and the model directory "
                f"{str(Path(spec).resolve())!r}: write ./{spec} for the directory, or run from another folder "
                "for the preset"
            )
        return ModelSource(spec, "preset", get_preset(spec)["model_type"], tokenizer=tok)
    if spec.startswith(HUB_PREFIX):
        return _from_dir(spec, Path(_download(spec[len(HUB_PREFIX):])), tok, require_tokenizer)
    path = Path(spec).expanduser()
    if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES + (".index.json",)):
        raise ModelSourceError(f"model {spec!r} is a weight file; give the model directory that holds it "
                               f"({str(path.parent)!r}), with its config.json and tokenizer")
    if path.is_file():
        cfg = _read_config(path, spec)
        return ModelSource(spec, "config", cfg["model_type"], path=str(path), tokenizer=tok)
    if path.is_dir():
        return _from_dir(spec, path, tok, require_tokenizer)
    looks_like_path = os.sep in spec or "/" in spec or spec.startswith((".", "~"))
    what = "no such file or directory" if looks_like_path else "not a preset, and no such file or directory"
    raise ModelSourceError(
        f"model {spec!r}: {what}. Give a preset ({', '.join(list_presets())}), a local Hugging Face "
        f"model directory (config.json, weights, tokenizer files), a config.json file, or "
        f"{HUB_PREFIX}ORG/NAME to download a model from the Hugging Face hub"
    )


def _with_tokenizer(src: ModelSource, tokenizer: str | os.PathLike) -> ModelSource:
    from dataclasses import replace

    return replace(src, tokenizer=_check_tokenizer_path(tokenizer))


def _check_tokenizer_path(tokenizer: str | os.PathLike | None) -> str | None:
    if tokenizer is None:
        return None
    p = Path(tokenizer).expanduser()
    if not p.exists():
        raise ModelSourceError(f"tokenizer {os.fspath(tokenizer)!r}: no such file or directory")
    if p.is_dir() and not has_tokenizer(p):
        raise ModelSourceError(f"tokenizer folder {str(p)!r} holds none of {', '.join(TOKENIZER_FILES)}")
    return str(p)


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer's vocabulary file."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def weight_files(folder: Path) -> list[Path]:
    """The weight files directly in ``folder`` (safetensors, PyTorch ``.bin``/``.pt``/``.pth``)."""
    return sorted(f for f in folder.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))


def _read_config(path: Path, spec: str) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"model {spec!r}: cannot read {str(path)!r} as a JSON model config: {exc}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise ModelSourceError(
            f"model {spec!r}: {str(path)!r} is not a Hugging Face model config (no \"model_type\")"
        )
    return cfg


def _config_dtype(cfg: dict[str, Any]) -> torch.dtype | None:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if isinstance(name, str):
        dt = getattr(torch, name.removeprefix("torch."), None)
        if isinstance(dt, torch.dtype):
            return dt
    return None


def _from_dir(spec: str, path: Path, tokenizer: str | None, require_tokenizer: bool) -> ModelSource:
    names = sorted(f.name for f in path.iterdir())
    config = path / "config.json"
    weights = weight_files(path)
    if not config.is_file():
        found = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "nothing"
        cache = ("; this is a Hugging Face cache folder: give its snapshot, "
                 f"{str(path / 'snapshots')!r}/<revision>" if (path / "snapshots").is_dir() else "")
        raise ModelSourceError(
            f"model directory {str(path)!r} has no config.json (it holds {found}); a model directory is "
            "what transformers' save_pretrained writes: config.json, model.safetensors (or shards and "
            f"their index) and the tokenizer files{cache}"
        )
    cfg = _read_config(config, spec)
    own_tokenizer = has_tokenizer(path)
    if not weights:
        if _has_weight_index(path):
            _check_weight_index(path)  # names the missing shards
        if own_tokenizer and tokenizer is None:
            raise ModelSourceError(
                f"model directory {str(path)!r} has config.json and a tokenizer but no weights "
                f"(no *{', *'.join(WEIGHT_SUFFIXES)} file); copy the weights there "
                "(model.save_pretrained(DIR)) to fine-tune it, or pass its config.json file to train a "
                "new model from that configuration"
            )
        # a folder with only a config: a new model, as with the config file itself
        return ModelSource(spec, "config", cfg["model_type"], path=str(path), tokenizer=tokenizer)
    _check_weights(path, weights)
    if tokenizer is None and own_tokenizer:
        tokenizer = str(path)
    elif tokenizer is None and require_tokenizer:
        raise ModelSourceError(
            f"model directory {str(path)!r} has weights but no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}); pretrained embeddings only make sense with the tokenizer "
            "they were trained with: save it into the directory (tokenizer.save_pretrained(DIR))"
        )
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int):
        vocab = _vocab_from_autoconfig(path, spec)
    return ModelSource(spec, "checkpoint", cfg["model_type"], path=str(path), tokenizer=tokenizer,
                       vocab_size=vocab, dtype=_config_dtype(cfg))


def _vocab_from_autoconfig(path: Path, spec: str) -> int:
    from transformers import AutoConfig

    try:
        vocab = getattr(AutoConfig.from_pretrained(str(path), local_files_only=True), "vocab_size", None)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelSourceError(f"model {spec!r}: cannot read {str(path / 'config.json')!r}: {exc}") from None
    if not isinstance(vocab, int):
        raise ModelSourceError(f"model {spec!r}: {str(path / 'config.json')!r} has no vocab_size")
    return vocab


def _has_weight_index(path: Path) -> bool:
    return any(f.name.endswith(".index.json") for f in path.iterdir())


def _check_weight_index(path: Path) -> None:
    for index in sorted(path.glob("*.index.json")):
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            raise ModelSourceError(f"weight index {str(index)!r} is not valid JSON") from None
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelSourceError(
                f"model directory {str(path)!r}: {index.name} names {len(shards)} weight files but "
                f"{len(missing)} are missing ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})"
            )


# What transformers' from_pretrained reads from a directory: one file of these names, or the shards an index names.
LOADABLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _check_weights(path: Path, weights: list[Path]) -> None:
    if not any((path / n).is_file() for n in LOADABLE_WEIGHTS + WEIGHT_INDEXES):
        names = ", ".join(f.name for f in weights[:4]) + (", ..." if len(weights) > 4 else "")
        shards = any("-of-" in f.name for f in weights)
        raise ModelSourceError(
            f"model directory {str(path)!r} holds weights ({names}) that transformers cannot load: it reads "
            f"{' or '.join(LOADABLE_WEIGHTS)}, or shards with their index ({' or '.join(WEIGHT_INDEXES)}); "
            + ("copy the index that came with these shards there" if shards else
               "save the model with model.save_pretrained(DIR) (a raw state dict is not a model directory)")
        )
    for f in weights:
        if f.stat().st_size < 1024:
            with open(f, "rb") as fh:
                if fh.read(len(_LFS_POINTER)) == _LFS_POINTER:
                    raise ModelSourceError(
                        f"weight file {str(f)!r} is a Git LFS pointer, not the weights; fetch them "
                        "(git lfs pull) or download the model again"
                    )
    _check_weight_index(path)


def _download(name: str) -> str:
    """A hub model's snapshot folder (config, safetensors weights, tokenizer files)."""
    if not name or name.startswith("/"):
        raise ModelSourceError(f"{HUB_PREFIX}{name!r}: give a hub model name, e.g. {HUB_PREFIX}ORG/NAME")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=name, allow_patterns=_HUB_PATTERNS)
    except Exception as exc:  # network, authentication, unknown repo: all end here
        raise ModelSourceError(f"model {HUB_PREFIX}{name}: download from the Hugging Face hub failed: {exc}") from exc
