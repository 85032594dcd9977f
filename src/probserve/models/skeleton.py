"""A model's skeleton, built without transformers' modeling code: the configuration, every
parameter's name, shape and ties (on the meta device) and the rotary embedding, which is all the
native forward (llama.py) and the GGUF block reader (gguf_blocks.py) take from a model.

Importing transformers' modeling code takes seconds (it pulls in torch.distributed and dynamo), and
every engine start paid them for a model whose weights come from elsewhere. The names follow
transformers' modules of the families the forward runs (models/family.py: Llama, Mistral, Qwen2,
Qwen3, Gemma 2, Gemma 3, Gemma 4, Phi-3, the mixtures of experts, Qwen3.5's Gated DeltaNet
layers), and `Rotary` computes their rotary embedding with the same operations in the same order
(tests check the two bit for bit).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from probserve.models.families import TYPES
from probserve.models.family import (
    Family,
    family,
    head_dim,
    rope_params,
    rope_type,
)
from probserve.models.gemma4 import Gemma4Layout


class Rotary(nn.Module):
    """transformers' rotary embedding of the static RoPE variants (the forward's only kind), of
    one entry of the configuration's `rope_parameters` (`key`: a layer type, for Gemma 3).
    LongRoPE's factors are chosen per position: the short ones below the original context
    (original_max_position_embeddings), the long ones from it on (transformers chooses for a
    whole forward by its longest position, which would make a token's numbers depend on its
    batch: the two agree for every sequence within the original context)."""

    def __init__(self, config: Any, key: str | None = None) -> None:
        super().__init__()
        params = rope_params(config, key)
        self.rope_type = rope_type(config, key)
        self.original: int | None = None
        if self.rope_type == "default":  # (Qwen3.5: the first partial_rotary_factor of a head)
            dim = int(head_dim(config) * float(params.get("partial_rotary_factor", 1.0) or 1.0))
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            init = ROPE_INIT_FUNCTIONS[self.rope_type]
            extra = {"layer_type": key} if key is not None else {}
            inv_freq, self.attention_scaling = init(config, None, **extra)
            if self.rope_type == "longrope":
                self.original = int(params["original_max_position_embeddings"])
                long, _ = init(config, None, seq_len=self.original + 1, **extra)
                self.long_inv_freq = nn.Buffer(long, persistent=False)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inv = self.inv_freq.to(device=x.device, dtype=torch.float)
        if self.original is not None:
            late = (position_ids >= self.original)[..., None]
            inv = torch.where(late, self.long_inv_freq.to(device=x.device), inv)
        freqs = position_ids[..., None].float() * inv
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


def _embedding(rows: int, width: int) -> nn.Embedding:
    """A table on the meta device, given its (empty) weight: torch's own initialization of a
    meta embedding (`normal_`) goes through torch._refs, which imports torch._dynamo and with
    it Triton (~100 MB of the engine's resident memory on a host that never runs either)."""
    return nn.Embedding(rows, width, _weight=torch.empty(rows, width, device="meta"))


class _Attention(nn.Module):
    def __init__(self, config: Any, fam: Family) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias, o_bias = TYPES[config.model_type].attention_bias or (bias, bias)
        hidden, heads, kv = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        d = fam.head_dim
        self.head_dim = d
        self.scaling = fam.scale
        if fam.fused:
            self.qkv_proj = _linear(hidden, (heads + 2 * kv) * d, qkv_bias)
        else:
            q = heads * d * (2 if fam.attn_gate else 1)  # (Qwen3.5: [query | gate] per head)
            self.q_proj = _linear(hidden, q, qkv_bias)
            self.k_proj = _linear(hidden, kv * d, qkv_bias)
            self.v_proj = _linear(hidden, kv * d, qkv_bias)
        self.o_proj = _linear(heads * d, hidden, o_bias)
        if fam.qk_norm:
            self.q_norm = _Norm(d, config.rms_norm_eps)
            self.k_norm = _Norm(d, config.rms_norm_eps)
        if fam.qk_norm_full:  # OLMoE: over the whole projections
            self.q_norm = _Norm(heads * d, config.rms_norm_eps)
            self.k_norm = _Norm(kv * d, config.rms_norm_eps)
        if fam.sinks:  # gpt-oss: a sink logit per head
            self.sinks = nn.Parameter(torch.empty(heads, device="meta"))


class _MLP(nn.Module):
    def __init__(self, config: Any, fam: Family) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        hidden, inner = config.hidden_size, config.intermediate_size
        if fam.fused:
            self.gate_up_proj = _linear(hidden, 2 * inner, bias)
        else:
            self.gate_proj = _linear(hidden, inner, bias)
            self.up_proj = _linear(hidden, inner, bias)
        self.down_proj = _linear(inner, hidden, bias)


class _Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, inner: int, gpt_oss: bool) -> None:
        super().__init__()

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, device="meta"))

        if gpt_oss:  # x @ W layouts, biased
            self.gate_up_proj = empty(experts, hidden, 2 * inner)
            self.gate_up_proj_bias = empty(experts, 2 * inner)
            self.down_proj = empty(experts, inner, hidden)
            self.down_proj_bias = empty(experts, hidden)
        else:
            self.gate_up_proj = empty(experts, 2 * inner, hidden)
            self.down_proj = empty(experts, hidden, inner)


class _LinearAttention(nn.Module):
    """A Gated DeltaNet layer's parameters (Qwen3.5: models/deltanet.py): the q/k/v, z, b and a
    projections (Qwen3-Next's packed per key head: in_proj_qkvz, in_proj_ba), the depthwise conv
    [C, 1, K], A_log and dt_bias per value head, the gated norm [dv] and out_proj."""

    def __init__(self, config: Any, fam: Family) -> None:
        super().__init__()
        hidden = config.hidden_size
        nk, nv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        qkv = 2 * nk * dk + nv * dv
        if fam.packed_linear:
            self.in_proj_qkvz = _linear(hidden, qkv + nv * dv, False)
            self.in_proj_ba = _linear(hidden, 2 * nv, False)
        else:
            self.in_proj_qkv = _linear(hidden, qkv, False)
            self.in_proj_z = _linear(hidden, nv * dv, False)
            self.in_proj_b = _linear(hidden, nv, False)
            self.in_proj_a = _linear(hidden, nv, False)
        kernel = int(config.linear_conv_kernel_dim)
        self.conv1d = nn.Conv1d(qkv, qkv, kernel, groups=qkv, bias=False, device="meta")
        self.A_log = nn.Parameter(torch.empty(nv, device="meta"))
        self.dt_bias = nn.Parameter(torch.empty(nv, device="meta"))
        self.norm = _Norm(dv, config.rms_norm_eps)
        self.out_proj = _linear(nv * dv, hidden, False)


class _SharedExpert(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, inner, False)
        self.up_proj = _linear(hidden, inner, False)
        self.down_proj = _linear(inner, hidden, False)


class _MoE(nn.Module):
    """A mixture of experts' parameters under transformers' names: the router `gate` [E, H], the
    experts' stacked gate/up [E, 2I, H] and down [E, H, I]; gpt-oss's router (biased), and its
    experts' [E, H, 2I] and [E, I, H] with their biases; Qwen3.5's shared expert and its gate."""

    def __init__(self, config: Any, fam: Family) -> None:
        super().__init__()
        gpt_oss = fam.column_experts
        if gpt_oss:
            self.router = _linear(config.hidden_size, fam.experts, True)
        else:
            self.gate = _linear(config.hidden_size, fam.experts, False)
        self.experts = _Experts(fam.experts, config.hidden_size, fam.expert_intermediate, gpt_oss)
        if fam.shared_expert:
            hidden = config.hidden_size
            self.shared_expert = _SharedExpert(hidden, int(config.shared_expert_intermediate_size))
            self.shared_expert_gate = _linear(hidden, 1, False)


class _Layer(nn.Module):
    def __init__(self, config: Any, fam: Family, index: int) -> None:
        super().__init__()
        if fam.linear and fam.linear[index]:
            self.linear_attn = _LinearAttention(config, fam)
        else:
            self.self_attn = _Attention(config, fam)
        sparse = fam.experts and fam.sparse[index]
        self.mlp = _MoE(config, fam) if sparse else _MLP(config, fam)
        eps = config.rms_norm_eps
        self.input_layernorm = _Norm(config.hidden_size, eps)
        self.post_attention_layernorm = _Norm(config.hidden_size, eps)
        if fam.sandwich:
            self.pre_feedforward_layernorm = _Norm(config.hidden_size, eps)
            self.post_feedforward_layernorm = _Norm(config.hidden_size, eps)


class _Gemma4Attention(nn.Module):
    """Gemma 4's attention of one layer: its own head size and KV heads; a layer reading
    another's cache has no k/v, one whose values are its keys no v (models/gemma4.py)."""

    def __init__(self, config: Any, layout: Gemma4Layout, i: int) -> None:
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_attention_heads, config.rms_norm_eps
        d, kv = layout.head_dims[i], layout.kv_heads[i]
        self.q_proj = _linear(hidden, heads * d, False)
        self.q_norm = _Norm(d, eps)
        if layout.writes[i]:
            self.k_proj = _linear(hidden, kv * d, False)
            self.k_norm = _Norm(d, eps)
            if not layout.k_eq_v[i]:
                self.v_proj = _linear(hidden, kv * d, False)
        self.o_proj = _linear(heads * d, hidden, False)


class _Gemma4Layer(nn.Module):
    def __init__(self, config: Any, fam: Family, layout: Gemma4Layout, i: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = _Gemma4Attention(config, layout, i)
        inner = int(config.intermediate_size)
        if config.use_double_wide_mlp and not layout.writes[i]:
            inner *= 2
        mlp = nn.Module()
        mlp.gate_proj, mlp.up_proj = _linear(hidden, inner, False), _linear(hidden, inner, False)
        mlp.down_proj = _linear(inner, hidden, False)
        self.mlp = mlp
        for name in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):  # fmt: skip
            setattr(self, name, _Norm(hidden, eps))
        self.layer_scalar = nn.Parameter(torch.empty(1, device="meta"))  # (a buffer there)
        if fam.experts:  # its mixture of experts beside the MLP, each branch with its norms
            router = nn.Module()
            router.proj = _linear(hidden, fam.experts, False)
            router.scale = nn.Parameter(torch.empty(hidden, device="meta"))
            router.per_expert_scale = nn.Parameter(torch.empty(fam.experts, device="meta"))
            self.router = router
            self.experts = _Experts(fam.experts, hidden, fam.expert_intermediate, False)
            for name in (
                "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_2",
            ):  # fmt: skip
                setattr(self, name, _Norm(hidden, eps))
        width = layout.per_layer_input
        if width:
            self.per_layer_input_gate = _linear(hidden, width, False)
            self.per_layer_projection = _linear(width, hidden, False)
            self.post_per_layer_input_norm = _Norm(hidden, eps)


class _Gemma4Body(nn.Module):
    """Gemma 4 (text)'s parameters under transformers' names, each layer of its own shape, and
    the per-layer input embedding's table, projection and norm."""

    def __init__(self, config: Any, fam: Family) -> None:
        super().__init__()
        layout = fam.gemma4
        assert layout is not None
        hidden, n = config.hidden_size, config.num_hidden_layers
        self.embed_tokens = _embedding(config.vocab_size, hidden)
        width = layout.per_layer_input
        if width:
            self.embed_tokens_per_layer = _embedding(config.vocab_size_per_layer_input, n * width)
            self.per_layer_model_projection = _linear(hidden, n * width, False)
            self.per_layer_projection_norm = _Norm(width, config.rms_norm_eps)
        self.layers = nn.ModuleList(_Gemma4Layer(config, fam, layout, i) for i in range(n))
        self.norm = _Norm(hidden, config.rms_norm_eps)
        key = fam.rope_keys[0]
        self.rotary_emb = Rotary(config.per_layer_config[config.layer_types.index(key)], key)


class _Body(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        fam = family(config)
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Layer(config, fam, i) for i in range(config.num_hidden_layers))
        self.norm = _Norm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Rotary(config, fam.rope_keys[0])


class Skeleton(nn.Module):
    """The model as the native forward sees it: `config`, `generation_config`, `model` (the
    embedding, layers, norm and rotary embedding) and `lm_head`, tied as the config says."""

    def __init__(self, config: Any, generation_config: Any = None) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        fam = family(config)
        self.model = _Gemma4Body(config, fam) if fam.gemma4 is not None else _Body(config)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head
