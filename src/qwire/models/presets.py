"""Model presets: plain dicts of ``transformers`` config values.

Tiny presets are for CPU runs and tests (untied embeddings, no dropout, 1024 positions); the
others are the published configurations of the models the papers train. ``vocab_size`` is the
preset's default and is normally replaced by the tokenizer's.
"""

from __future__ import annotations

import copy
from typing import Any

# what the published GPT-2 configurations share (openai-community/gpt2-*), dropout off
_GPT2 = dict(
    model_type="gpt2",
    vocab_size=50257,
    n_positions=1024,
    activation_function="gelu_new",
    layer_norm_epsilon=1e-5,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=50256,
    eos_token_id=50256,
    tie_word_embeddings=True,
)

PRESETS: dict[str, dict[str, Any]] = {
    # ---- tiny, for CPU ------------------------------------------------------------------------
    "llama-tiny": dict(
        model_type="llama",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # llama-tiny at half the width (head dim 32): benchmarks that train many short runs on CPU
    "llama-micro": dict(
        model_type="llama",
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "qwen2-tiny": dict(
        model_type="qwen2",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        use_sliding_window=False,
        tie_word_embeddings=False,
    ),
    # Qwen3: Qwen2's layout without q/k/v biases, with an RMSNorm of each query and key head
    "qwen3-tiny": dict(
        model_type="qwen3",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        use_sliding_window=False,
        tie_word_embeddings=False,
    ),
    # Mistral: Llama's layout with grouped-query attention (and, where sliding_window is set, a sliding window)
    "mistral-tiny": dict(
        model_type="mistral",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "gpt2-tiny": dict(
        model_type="gpt2",
        vocab_size=4096,
        n_embd=256,
        n_layer=4,
        n_head=4,
        n_positions=1024,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    ),
    "llama-small": dict(
        model_type="llama",
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # ---- published configurations ------------------------------------------------------------
    # openai-community/gpt2-medium and gpt2-xl (dropout off: qwire trains from scratch without it)
    "gpt2-medium": dict(_GPT2, n_embd=1024, n_layer=24, n_head=16),
    "gpt2-xl": dict(_GPT2, n_embd=1600, n_layer=48, n_head=25),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=128000,
        eos_token_id=128001,
        tie_word_embeddings=True,
    ),
    # Qwen/Qwen2.5-3B
    "qwen2.5-3b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        sliding_window=32768,
        use_sliding_window=False,
        max_window_layers=36,
        hidden_act="silu",
        bos_token_id=151643,
        eos_token_id=151643,
        tie_word_embeddings=True,
    ),
}


def list_presets() -> list[str]:
    """Names of the built-in presets."""
    return sorted(PRESETS)


def get_preset(name: str) -> dict[str, Any]:
    """A copy of a preset's config values (``model_type`` included)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; presets: {', '.join(list_presets())}")
    return copy.deepcopy(PRESETS[name])
