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
    from safetensors import SafetensorError

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            src.path, local_files_only=True, dtype=dtype, attn_implementation=attn_implementation,
            output_loading_info=True, **overrides
        )
    except SafetensorError as exc:
        raise ModelSourceError(f"a weight file in {src.path!r} is incomplete or corrupt ({exc}); copy or "
                               "download it again") from exc
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelSourceError(f"could not load the model in {src.path!r} ({src.spec!r}): {exc}") from exc
    _check_loaded(src, model, info)
    return model


def _check_loaded(src: ModelSource, model: PreTrainedModel, info: dict[str, Any]) -> None:
    """Refuse weights that left part of the model at its random init (missing), or that the model has no place
    for (unexpected): a checkpoint of another architecture, or a headless base model, would otherwise
    train as a random one with no error."""
    tied = {k for k, v in model.state_dict().items() if k.endswith("lm_head.weight")
            and v.data_ptr() == model.get_input_embeddings().weight.data_ptr()}
    missing = sorted(set(info.get("missing_keys") or ()) - tied)
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ())
    if not (missing or unexpected or mismatched):
        return
    total = len(model.state_dict())

    def some(keys: list[str]) -> str:
        return ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")

    parts = [f"{len(missing)} of the model's {total} tensors are not in the weights ({some(missing)})"] if missing \
        else []
    if unexpected:
        parts.append(f"{len(unexpected)} tensors of the weights have no place in the model ({some(unexpected)})")
    if mismatched:
        parts.append(f"{len(mismatched)} have another shape ({some(mismatched)})")
    raise ModelSourceError(
        f"the weights in {src.path!r} do not fit the {src.model_type} causal language model its config.json "
        f"describes: {'; '.join(parts)}. Give a directory saved from a *ForCausalLM model of this config "
        "(model.save_pretrained(DIR)); a base model without its head, or weights of another architecture, "
        "would train from a random init")
