"""Causal LMs (Llama, Qwen2, GPT-2 from ``transformers``) and their pipeline stages.

```python
from qwire.models import build_model, split_model, lm_loss
model = build_model("llama-tiny", vocab_size=tokenizer.vocab_size, seed=0)
stages = split_model(model, n_stages=4)          # stage 0: input_ids -> hidden; last: hidden -> logits
```
"""

from .build import ATTN_IMPLEMENTATIONS, build_model, count_parameters, make_config
from .presets import PRESETS, get_preset, list_presets
from .split import SUPPORTED_MODEL_TYPES, CausalLMStage, lm_loss, partition_layers, split_model

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "CausalLMStage",
    "build_model",
    "count_parameters",
    "get_preset",
    "list_presets",
    "lm_loss",
    "make_config",
    "partition_layers",
    "split_model",
]
