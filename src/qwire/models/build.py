"""Building causal LMs from presets, config files or local checkpoints."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .presets import get_preset
from .source import ModelSource, ModelSourceError, model_source

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


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


def model_config(src: ModelSource) -> PretrainedConfig | None:
    """The config ``src`` names, read without building the model (None where it cannot be read here, e.g. a
    ``model_type`` this ``transformers`` does not know: building the model then says why)."""
    try:
        if src.kind == "preset":
            return make_config(src.spec)
        if src.path is None:
            return None
        return AutoConfig.from_pretrained(src.path, local_files_only=True)
    except Exception:  # noqa: BLE001 - only a help for early checks
        return None


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
    preset_or_path: str | os.PathLike | ModelSource,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
    device: str | torch.device | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """Build a causal LM.

    ``preset_or_path`` is anything ``model_source`` takes (or what it returned): a preset name
    (see ``list_presets()``), a ``config.json`` file or a folder holding only one (random init), a
    local checkpoint folder (``config.json`` + weights + tokenizer, loaded offline with
    ``from_pretrained``), or ``hf:ORG/NAME``. A name that is none of these fails at once, without
    contacting the hub. Random init is seeded by ``seed`` and identical on every process;
    ``overrides`` replace config values (e.g. ``num_hidden_layers=2``). ``vocab_size`` sets a new
    model's vocabulary; a pretrained model must already have at least that many ids.
    ``dtype="auto"`` keeps a checkpoint's saved dtype (float32 for new models).
    """
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")
    if isinstance(dtype, str) and dtype != "auto":
        raise ValueError(f"dtype must be a torch.dtype or 'auto', got {dtype!r}")
    src = model_source(preset_or_path, require_tokenizer=False)
    new_dtype = torch.float32 if dtype == "auto" else dtype
    if src.kind == "preset":
        config = make_config(src.spec, vocab_size, **overrides)
        model = _from_config(config, seed, new_dtype, attn_implementation)
    elif src.kind == "config":
        assert src.path is not None
        config = AutoConfig.from_pretrained(src.path, local_files_only=True, **overrides)
        if vocab_size is not None:
            config.vocab_size = int(vocab_size)
        model = _from_config(config, seed, new_dtype, attn_implementation)
    else:
        if vocab_size is not None and src.vocab_size is not None and vocab_size > src.vocab_size:
            raise ModelSourceError(
                f"the tokenizer has {vocab_size} ids but the model {src.spec!r} only {src.vocab_size}; "
                f"use the model's own tokenizer ({src.tokenizer})"
            )
        model = _load_pretrained(src, dtype, attn_implementation, overrides)
    if device is not None:
        model = model.to(device)
    return model


def _load_pretrained(
    src: ModelSource, dtype: torch.dtype | str, attn_implementation: str, overrides: dict[str, Any]
) -> PreTrainedModel:
    """Pretrained weights from a local directory: never a hub call."""
    assert src.path is not None
    try:
        return AutoModelForCausalLM.from_pretrained(
            src.path, local_files_only=True, dtype=dtype, attn_implementation=attn_implementation, **overrides
        )
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelSourceError(f"could not load the model in {src.path!r} ({src.spec!r}): {exc}") from exc
