"""A model family as parameters of the one paged forward (models/llama.py): what differs between
Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3 and the mixtures of experts is read from the
configuration once, here, through each type's entry of models/families.py:

- Qwen3 and Gemma 3 normalize each query and key head (RMSNorm over the head dimension) before
  RoPE;
- Gemma scales its RMSNorm by (1 + w), multiplies the embedding by sqrt(hidden), uses GeGLU
  (tanh GELU), norms the attention's and the MLP's outputs too (pre- and post-feed-forward), scales
  queries by query_pre_attn_scalar^-0.5, and Gemma 2 soft-caps attention scores and final logits;
- Gemma 2/3 interleave sliding-window and global layers (Gemma 3 with a RoPE base of each),
  Mistral and Phi-3 window every layer;
- Phi-3 stores QKV and gate/up fused in its checkpoint;
- Qwen3-MoE, OLMoE and Mixtral replace the MLP (in every layer, or Qwen3-MoE's sparse ones) by
  a mixture of experts: a router's softmax, the top k experts of each token (renormalised:
  Qwen3-MoE's norm_topk_prob, always for Mixtral), their SwiGLUs summed by weight
  (models/moe.py); OLMoE RMS-norms the whole query and key projections, not each head;
- gpt-oss: a mixture of experts in every layer whose router has a bias and takes the softmax
  of its k largest logits (the renormalised top k of the full softmax: the same function), its
  experts biased with a clamped SwiGLU ((clamp(up) + 1) * g * sigmoid(1.702 g), g = min(gate,
  7)), attention with biases and a learned sink logit per head, alternating 128-token windows
  and YaRN RoPE;
- Gemma 4 (text): layers of their own shapes, some reading another layer's KV cache, per-layer
  input embeddings, 26B-A4B's experts beside each layer's dense MLP (models/gemma4.py reads its
  configuration, models/gemma4_layer.py runs what its layer adds).
- Qwen3.5 (dense and MoE) and Qwen3-Next are hybrid: most layers are Gated DeltaNet (a
  linear-attention recurrence, models/deltanet.py), the rest full attention with an output gate
  (the query projection doubled per head: [q | gate], attention * sigmoid(gate)), q/k norms and
  RoPE on the first quarter of each head; their norms are (1 + w); their MoE adds a shared
  expert scaled by sigmoid(shared_expert_gate(x)) (Qwen3-Next's in Qwen3-MoE's sparse layers);
  Qwen3-Next packs its linear layers' projections per key head (models/llama.py unpacks the
  rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from probserve.models.families import MISSING, TYPES, ModelType
from probserve.models.gemma4 import Gemma4Layout

SUPPORTED_TYPES = frozenset(TYPES)
_ACTIVATIONS: dict[str, Literal["silu", "gelu_tanh"]] = {
    "silu": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
}
# RoPE variants whose cos/sin depend on the position alone (models/skeleton.py's `Rotary`;
# longrope's short/long factor is chosen per position there); dynamic rescales with the batch
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn", "longrope", "proportional"})


class Unsupported(ValueError):
    """The paged forward does not reproduce this model; the message says why."""


@dataclass(frozen=True)
class Family:
    """One model type's layer, as the forward's parameters."""

    model_type: str
    head_dim: int
    activation: Literal["silu", "gelu_tanh"]
    scale: float  # the attention's query scaling
    windows: tuple[int | None, ...]  # each layer's sliding window (None: global)
    rope_keys: tuple[str | None, ...]  # each layer's entry of rope_parameters (Gemma 3)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w) (Gemma)
    embed_scale: float | None = None  # the embedding's factor (Gemma: sqrt(hidden))
    qk_norm: bool = False  # an RMSNorm over each query and key head (Qwen3, Gemma 3)
    sandwich: bool = False  # norms after attention and around the MLP (Gemma)
    fused: bool = False  # the checkpoint's qkv_proj and gate_up_proj (Phi-3)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    experts: int = 0  # a MoE layer's experts (0: every layer dense)
    top_k: int = 0  # the experts a token is routed to
    norm_topk: bool = False  # the chosen experts' weights renormalised to sum to 1
    expert_intermediate: int = 0  # an expert's SwiGLU width
    sparse: tuple[bool, ...] = ()  # each layer: a MoE feed-forward (else the dense MLP)
    qk_norm_full: bool = False  # q and k RMS-normed over the whole projection (OLMoE)
    sinks: bool = False  # a learned sink logit per attention head (gpt-oss)
    column_experts: bool = False  # its stacked experts stored as x @ W, gate and up columns
    # interleaved (gpt-oss: models/families.py's column_expert_rows)
    # gpt-oss's clamped SwiGLU in its experts: (clamp(up, +-limit) + 1) * g * sigmoid(alpha g),
    # g = min(gate, limit); None: the family's activation
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    gemma4: Gemma4Layout | None = None  # Gemma 4's layers (models/gemma4.py)
    linear: tuple[bool, ...] = ()  # each layer: a Gated DeltaNet (Qwen3.5; else attention)
    rotary_dim: int = 0  # the leading dimensions of a head RoPE rotates (0: all of it)
    attn_gate: bool = False  # attention's output gated by sigmoid of a second query half
    shared_expert: bool = False  # a shared expert beside the routed ones (Qwen3.5-MoE)
    packed_linear: bool = False  # the linear layers' projections packed per key head
    # (Qwen3-Next: [q k v z] and [b a] of each key head's group in turn)

    @property
    def hybrid(self) -> bool:
        """Recurrent layers among the attention ones: each sequence carries their state."""
        return any(self.linear)


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_keys(config: Any) -> tuple[str | None, ...]:
    """Each layer's key into `config.rope_parameters` where it holds one set per layer type
    (Gemma 3), else None for every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None)
    if types and isinstance(params, dict) and all(t in params for t in set(types)):
        return tuple(types)
    return (None,) * config.num_hidden_layers


def rope_params(config: Any, key: str | None) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    return dict(params[key] if key is not None else params)


def rope_type(config: Any, key: str | None) -> str:
    """The RoPE variant of one entry of the configuration's rope_parameters."""
    return str(rope_params(config, key).get("rope_type", "default"))


def _windows(config: Any, kind: ModelType) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    n = config.num_hidden_layers
    if not window:
        return (None,) * n
    types = getattr(config, "layer_types", None)
    if kind.window_asked and not getattr(config, "use_sliding_window", False):
        return (None,) * n
    if types:
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (int(window),) * n


def family(config: Any) -> Family:
    """The forward's parameters for `config`; raises Unsupported, saying why, for a model the
    paged forward does not reproduce."""
    name = getattr(config, "model_type", None)
    if name in MISSING:
        raise Unsupported(f"{name} does not run on the paged forward: {MISSING[name]}")
    if name not in TYPES:
        raise Unsupported(f"{name} does not run on the paged forward")
    kind = TYPES[name]
    lacks = kind.missing(config) if kind.missing else None
    if lacks:
        raise Unsupported(f"{name} does not run on the paged forward: {lacks}")
    if kind.own is not None:
        return Family(model_type=name, **kind.own(config))
    if getattr(config, "clip_qkv", None) is not None:
        raise Unsupported("its clip_qkv (clamped q/k/v) is not one the paged forward has")
    gemma = kind.gemma
    act_name = getattr(config, "hidden_activation", None) if gemma else None
    act_name = act_name or getattr(config, "hidden_act", "silu")
    activation = _ACTIVATIONS.get(act_name) if act_name is not None else None
    if activation is None:
        raise Unsupported(f"its activation {act_name!r} is not one the paged forward has")
    _check(config, kind)
    d = head_dim(config)
    hybrid = _hybrid(config, d) if kind.hybrid else {}
    return Family(
        model_type=name,
        head_dim=d,
        activation=activation,
        scale=float(config.query_pre_attn_scalar) ** -0.5 if gemma else d**-0.5,
        norm_plus_one=gemma or kind.hybrid,
        embed_scale=float(config.hidden_size) ** 0.5 if gemma else None,
        qk_norm=kind.qk_norm == "head",
        qk_norm_full=kind.qk_norm == "projection",
        sandwich=gemma,
        fused=kind.fused,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        windows=_windows(config, kind),
        rope_keys=rope_keys(config),
        column_experts=kind.column_experts,
        **(kind.experts(config) if kind.experts else {}),
        **hybrid,
    )


def _hybrid(config: Any, d: int) -> dict[str, Any]:
    """Qwen3.5's layer kinds (`layer_types`, else every `full_attention_interval`-th layer full
    attention), its partial rotary and its attention's output gate."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if not types:
        every = int(getattr(config, "full_attention_interval", 4) or 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    factor = rope_params(config, None).get("partial_rotary_factor")
    factor = float(factor or getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    return {
        "linear": tuple(t == "linear_attention" for t in types),
        "rotary_dim": int(d * factor), "attn_gate": True,
        "packed_linear": TYPES[config.model_type].packed_linear,
    }  # fmt: skip


def _check(config: Any, kind: ModelType) -> None:
    """What no family of the forward has: a partial rotary embedding (but Qwen3.5's),
    bidirectional attention, layers other than attention (but Qwen3.5's linear ones)."""
    partial = float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0
    if partial and not kind.hybrid:
        raise Unsupported("its partial rotary embedding is not one the paged forward has")
    if getattr(config, "use_bidirectional_attention", False):
        raise Unsupported("its attention is bidirectional (an embedding model)")
    types = getattr(config, "layer_types", None) or []
    layers = ("full_attention", "sliding_attention")
    if kind.hybrid:
        layers = ("full_attention", "linear_attention")
    if any(t not in layers for t in types):
        raise Unsupported(f"its layer types {sorted(set(types))} are not all attention layers")
