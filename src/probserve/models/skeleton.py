"""A Llama-family model's skeleton, built without transformers' modeling code: the configuration,
every parameter's name, shape and ties (on the meta device) and the rotary embedding, which is
all the native forward (llama.py) and the GGUF block reader (gguf_blocks.py) take from a model.

Importing transformers' modeling code takes seconds (it pulls in torch.distributed and dynamo), and
every engine start paid them for a model whose weights come from elsewhere. The names and
constants follow transformers' Llama, Mistral and Qwen2 modules, and `Rotary` computes their
rotary embedding with the same operations in the same order (tests check the two bit for bit).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# transformers' q/k/v and o projection biases, by model type
_ATTENTION_BIAS = {"qwen2": (True, False), "mistral": (False, False)}


class Rotary(nn.Module):
    """transformers' rotary embedding of the static RoPE variants (the forward's only kind)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        params = config.rope_parameters
        self.rope_type = params["rope_type"]
        if self.rope_type == "default":
            dim = getattr(config, "head_dim", None) or (
                config.hidden_size // config.num_attention_heads
            )
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(
            device=x.device, dtype=torch.float
        )
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"))
        self.variance_epsilon = eps


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias, device="meta")


class _Attention(nn.Module):
    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias, o_bias = _ATTENTION_BIAS.get(config.model_type, (bias, bias))
        hidden, heads, kv = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        self.head_dim = head_dim
        self.scaling = head_dim**-0.5
        self.q_proj = _linear(hidden, heads * head_dim, qkv_bias)
        self.k_proj = _linear(hidden, kv * head_dim, qkv_bias)
        self.v_proj = _linear(hidden, kv * head_dim, qkv_bias)
        self.o_proj = _linear(heads * head_dim, hidden, o_bias)


class _MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(hidden, inner, bias)
        self.up_proj = _linear(hidden, inner, bias)
        self.down_proj = _linear(inner, hidden, bias)


class _Layer(nn.Module):
    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        self.self_attn = _Attention(config, head_dim)
        self.mlp = _MLP(config)
        self.input_layernorm = _Norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = _Norm(config.hidden_size, config.rms_norm_eps)


class _Body(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device="meta")
        self.layers = nn.ModuleList(
            _Layer(config, head_dim) for _ in range(config.num_hidden_layers)
        )
        self.norm = _Norm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Rotary(config)


class Skeleton(nn.Module):
    """The model as the native forward sees it: `config`, `generation_config`, `model` (the
    embedding, layers, norm and rotary embedding) and `lm_head`, tied as the config says."""

    def __init__(self, config: Any, generation_config: Any = None) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = _Body(config)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head
