"""Building causal LMs from presets, config files or local checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .presets import PRESETS, get_preset, list_presets

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def make_config(preset: str, vocab_size: int | None = None, **overrides: Any) -> PretrainedConfig:
    """The ``transformers`` config of a preset, with ``vocab_size`` and other values overridden."""
    values = get_preset(preset)
    model_type = values.pop("model_type")
    if vocab_size is not None:
        values["vocab_size"] = int(vocab_size)
    values.update(overrides)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        # a preset's special ids mean nothing for another tokenizer's vocabulary
        if isinstance(values.get(key), int) and values[key] >= values["vocab_size"] and key not in overrides:
            values[key] = None
    return AutoConfig.for_model(model_type, **values)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def _from_config(config: PretrainedConfig, seed: int, dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    """Random init, identical on every process for the same seed (the global RNG is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype)


def build_model(
    preset_or_path: str,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device: str | torch.device | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """Build a causal LM.

    ``preset_or_path`` is a preset name (see ``list_presets()``), a ``config.json`` file or a
    folder holding one (random init), a local checkpoint folder (``config.json`` + safetensors,
    loaded with ``from_pretrained``), or a Hugging Face hub name (where the hub is reachable).
    Random init is seeded by ``seed`` and identical on every process; ``overrides`` replace
    config values (e.g. ``num_hidden_layers=2``). ``vocab_size`` sets a new model's vocabulary;
    a loaded model must already have at least that many ids.
    """
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")
    if preset_or_path in PRESETS:
        config = make_config(preset_or_path, vocab_size, **overrides)
        model = _from_config(config, seed, dtype, attn_implementation)
    else:
        path = Path(preset_or_path)
        if path.is_file() or (path.is_dir() and not _has_weights(path)):
            if path.is_dir() and not (path / "config.json").is_file():
                raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
            config = AutoConfig.from_pretrained(str(path), **overrides)
            if vocab_size is not None:
                config.vocab_size = int(vocab_size)
            model = _from_config(config, seed, dtype, attn_implementation)
        else:
            model = _load_pretrained(preset_or_path, dtype, attn_implementation, overrides)
            if vocab_size is not None and vocab_size > model.config.vocab_size:
                raise ValueError(
                    f"the tokenizer has {vocab_size} ids but the model {preset_or_path!r} only "
                    f"{model.config.vocab_size}; use the model's own tokenizer"
                )
    if device is not None:
        model = model.to(device)
    return model


def _has_weights(folder: Path) -> bool:
    return any(f.name.endswith(_WEIGHT_SUFFIXES) for f in folder.iterdir())


def _load_pretrained(
    name: str, dtype: torch.dtype, attn_implementation: str, overrides: dict[str, Any]
) -> PreTrainedModel:
    local = os.path.isdir(name)
    try:
        return AutoModelForCausalLM.from_pretrained(
            name, dtype=dtype, attn_implementation=attn_implementation, **overrides
        )
    except OSError as exc:
        where = "local checkpoint" if local else "preset, local path or reachable hub model"
        raise ValueError(
            f"could not load model {name!r} as a {where}: {exc}. Presets: {', '.join(list_presets())}"
        ) from exc
