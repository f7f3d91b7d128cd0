"""Splitting a causal LM into pipeline stages: one tensor in, one tensor out.

Stage 0 takes ``input_ids`` LongTensor[B, S] and embeds them; middle stages map hidden states
[B, S, H] to hidden states; the last stage applies the final norm and the LM head and returns
logits [B, S, V]. Every stage builds what its layers need (position ids ``arange(S)``, the causal
mask, rotary cos/sin from its own copy of the rotary module), so only the hidden state crosses a
stage boundary.

A stage's parameter names are the original model's (``model.layers.5.mlp.up_proj.weight``,
``transformer.h.3.attn.c_attn.weight``, ``lm_head.weight``), so the union of the stages' state
dicts loads into the full model.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

# the mask builders' name for the (unused) KV cache: ``cache`` in recent transformers, which warn about the
# older ``past_key_values``; decoder layers default it to None, so the stages leave it out there
_CACHE_KW = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

# decoders laid out as Llama's (model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head), whose
# *ForCausalLM forward adds nothing to the body's output but the head: their stages compose to the model exactly
LLAMA_LIKE = ("llama", "qwen2", "qwen3", "mistral")
GPT2_LIKE = ("gpt2",)
SUPPORTED_MODEL_TYPES = LLAMA_LIKE + GPT2_LIKE


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens, computed in fp32 (labels of -100 are ignored)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def partition_layers(n_layers: int, n_stages: int, split: list[int] | None = None) -> list[int]:
    """Decoder layers per stage: ``split`` validated, or an even division where the first
    ``n_layers % n_stages`` stages get one layer more."""
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    if split is None:
        if n_stages > n_layers:
            raise ValueError(
                f"cannot split {n_layers} decoder layers into {n_stages} stages: every stage needs >= 1 layer"
            )
        base, extra = divmod(n_layers, n_stages)
        return [base + 1 if i < extra else base for i in range(n_stages)]
    counts = [int(c) for c in split]
    if len(counts) != n_stages:
        raise ValueError(f"split {counts} has {len(counts)} entries but n_stages={n_stages}; give one per stage")
    if any(c < 1 for c in counts):
        raise ValueError(f"split {counts}: every stage needs >= 1 decoder layer")
    if sum(counts) != n_layers:
        raise ValueError(f"split {counts} sums to {sum(counts)} but the model has {n_layers} decoder layers")
    return counts


def _model_type(model: PreTrainedModel) -> str:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"splitting {type(model).__name__} (model_type={model_type!r}) is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def _layer_types(config) -> list[str] | None:
    """Each decoder layer's attention (``full_attention`` or ``sliding_attention``) as the model's forward builds its
    masks: the config's ``layer_types`` (Qwen2, Qwen3); for Mistral, which has none, every layer slides when the
    config sets ``sliding_window``; None: every layer attends in full."""
    types = getattr(config, "layer_types", None)
    if types is None and config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * config.num_hidden_layers
    return types


def _is_tied(model: PreTrainedModel) -> bool:
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


class CausalLMStage(nn.Module):
    """Stage ``stage_index`` of a causal LM split into ``n_stages`` (see the module docstring).

    The stage holds the model's own submodules (no copy) except the rotary embedding, which every
    stage owns a copy of, and an untied LM head (see ``split_model``). ``layer_ids`` are the global
    indices of its decoder layers.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        stage_index: int,
        n_stages: int,
        layer_ids: list[int],
        untie_head: bool,
    ) -> None:
        super().__init__()
        self.config = model.config
        self.model_type = _model_type(model)
        self.stage_index = stage_index
        self.n_stages = n_stages
        self.layer_ids = list(layer_ids)
        self.is_first = stage_index == 0
        self.is_last = stage_index == n_stages - 1
        llama = self.model_type in LLAMA_LIKE
        src = model.model if llama else model.transformer
        body = nn.Module()
        if llama:
            self.model = body
            if self.is_first:
                body.embed_tokens = src.embed_tokens
            body.layers = nn.ModuleDict({str(i): src.layers[i] for i in self.layer_ids})
            body.rotary_emb = copy.deepcopy(src.rotary_emb)
            if self.is_last:
                body.norm = src.norm
            self._layer_types = _layer_types(self.config)
        else:
            self.transformer = body
            if self.is_first:
                body.wte, body.wpe, body.drop = src.wte, src.wpe, src.drop
            body.h = nn.ModuleDict({str(i): src.h[i] for i in self.layer_ids})
            if self.is_last:
                body.ln_f = src.ln_f
        if self.is_last:
            self.lm_head = copy.deepcopy(model.lm_head) if untie_head else model.lm_head

    def _body(self) -> nn.Module:
        return self.model if self.model_type in LLAMA_LIKE else self.transformer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``input_ids`` [B, S] (first stage) or hidden states [B, S, H] -> hidden states or logits."""
        body = self._body()
        seq_len = x.shape[1]
        position_ids = torch.arange(seq_len, device=x.device).unsqueeze(0)
        llama = self.model_type in LLAMA_LIKE
        if self.is_first:
            if llama:
                h = body.embed_tokens(x)
            else:
                inputs_embeds = body.wte(x)
                h = body.drop(inputs_embeds + body.wpe(position_ids).to(inputs_embeds.device))
        else:
            h = x
        if self.layer_ids:
            # position_ids=None: positions are a plain arange (no packed sequences), and leaving
            # them out skips a data-dependent check that syncs the device and fails on "meta"
            mask_kwargs = {"config": self.config, "inputs_embeds": h, "attention_mask": None, _CACHE_KW: None}
            masks = {"full_attention": create_causal_mask(**mask_kwargs)}
            if llama:
                layer_types = self._layer_types
                if layer_types is not None and any(layer_types[i] == "sliding_attention" for i in self.layer_ids):
                    masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
                position_embeddings = body.rotary_emb(h, position_ids)
                for i, layer in zip(self.layer_ids, body.layers.values()):
                    kind = layer_types[i] if layer_types is not None else "full_attention"
                    h = layer(
                        h,
                        attention_mask=masks[kind],
                        position_embeddings=position_embeddings,
                        position_ids=position_ids,
                        use_cache=False,
                    )
                    h = h[0] if isinstance(h, tuple) else h  # transformers < 5 returns tuples
            else:
                for block in body.h.values():
                    h = block(h, None, masks["full_attention"], use_cache=False, position_ids=position_ids)
                    h = h[0] if isinstance(h, tuple) else h
        if self.is_last:
            h = self.lm_head(body.norm(h) if llama else body.ln_f(h))
        return h

    def extra_repr(self) -> str:
        return f"stage={self.stage_index}/{self.n_stages}, model_type={self.model_type}, layers={self.layer_ids}"


def split_model(model: PreTrainedModel, n_stages: int, split: list[int] | None = None) -> list[nn.Module]:
    """Split a causal LM (Llama, Qwen2, Qwen3, Mistral, GPT-2) into ``n_stages`` single-tensor stage modules.

    Decoder layers are divided evenly (earlier stages get the extra layers) or by ``split``, a
    list of layer counts per stage (each >= 1, summing to the number of layers). With
    ``n_stages == 1`` the one stage is the whole model (``input_ids`` -> logits).

    Stages share the model's modules (nothing is copied but the rotary module and an untied
    head): keep the stage a process runs and drop the model and the other stages to free their
    memory, or ``copy.deepcopy`` a stage for an independent one. When the model ties its input
    embedding and LM head and they land on different stages, the tie is broken: the last stage
    gets a copy of the shared weight, and the two are trained separately from then on. Stages
    start in the model's train/eval mode.
    """
    model_type = _model_type(model)
    n_layers = len(model.model.layers if model_type in LLAMA_LIKE else model.transformer.h)
    counts = partition_layers(n_layers, n_stages, split)
    untie = n_stages > 1 and _is_tied(model)
    stages: list[nn.Module] = []
    start = 0
    for k, count in enumerate(counts):
        layer_ids = list(range(start, start + count))
        stage = CausalLMStage(model, k, n_stages, layer_ids, untie_head=untie)
        stages.append(stage.train(model.training))
        start += count
    return stages
