"""Causal LMs (Llama, Qwen2, Qwen3, Mistral, GPT-2 from ``transformers``) and their pipeline stages.

```python
from qwire.models import build_model, split_model, lm_loss
model = build_model("llama-tiny", vocab_size=tokenizer.vocab_size, seed=0)
stages = split_model(model, n_stages=4)          # stage 0: input_ids -> hidden; last: hidden -> logits
```

``model_source(spec)`` tells, without building anything, what ``spec`` names (preset, config
file, or a local model directory with its weights and tokenizer); it never contacts the
Hugging Face hub except for names written ``hf:ORG/NAME``.
"""

from .build import ATTN_IMPLEMENTATIONS, build_model, count_parameters, make_config
from .presets import PRESETS, get_preset, list_presets
from .source import HUB_PREFIX, ModelSource, ModelSourceError, model_source
from .split import SUPPORTED_MODEL_TYPES, CausalLMStage, lm_loss, partition_layers, split_model

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "HUB_PREFIX",
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "CausalLMStage",
    "ModelSource",
    "ModelSourceError",
    "build_model",
    "count_parameters",
    "get_preset",
    "list_presets",
    "lm_loss",
    "make_config",
    "model_source",
    "partition_layers",
    "split_model",
]
