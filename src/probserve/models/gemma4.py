"""Gemma 4 (text)'s configuration read per layer, into the paged forward's `Family`
(models/family.py) through its entry of models/families.py: what its layers do not share.

- Each layer's head size and KV heads come from `config.per_layer_config[i]` (the global
  `head_dim` is ambiguous: the full-attention layers' heads are wider);
- the last `num_kv_shared_layers` layers compute no K/V of their own: each reads the cache of
  the last earlier layer of its type that does (no second copy: the KV cache holds one layer per
  layer that writes, models/llama.py's `KVCache`);
- sliding and full layers alternate (`layer_types`), each with the RoPE of its type (the full
  layers' "proportional" one rotates a fraction of each head's pairs);
- norms are RMSNorm times w (not Gemma 2/3's 1 + w), around attention and the MLP (sandwich),
  on each query and key head, and on each value head without a weight; attention is unscaled
  (1.0); a per-layer input embedding (`hidden_size_per_layer_input`) and a scalar end each
  layer (models/gemma4_layer.py); the final logits are soft-capped;
- with `enable_moe_block` (26B-A4B) every layer has a mixture of experts beside its dense MLP
  (models/gemma4_layer.py): a router over the residual, GeGLU experts, each branch normed.

Imported by the API process through the family table: no torch here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Gemma4Layout:
    """Gemma 4's layers as the forward reads them, one entry per layer."""

    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    cache_layer: tuple[int, ...]  # the KV cache layer it reads (a shared layer: its source's)
    writes: tuple[bool, ...]  # it computes its K/V and writes them (else reads its source's)
    k_eq_v: tuple[bool, ...]  # its values are its key projection (attention_k_eq_v, full layers)
    per_layer_input: int  # the per-layer input embedding's width (0: none)

    def cache_shapes(self) -> list[tuple[int, int]]:
        """(KV heads, head size) of each cache layer: one per layer that writes."""
        shapes = zip(self.kv_heads, self.head_dims, self.writes, strict=True)
        return [(k, d) for k, d, w in shapes if w]


def missing(config: Any) -> str | None:
    """What the paged forward lacks for this Gemma 4 configuration (None: nothing)."""
    if getattr(config, "enable_moe_block", False):
        experts, k = int(config.num_experts or 0), int(config.top_k_experts or 0)
        if not 0 < k <= experts or not int(config.moe_intermediate_size or 0):
            return (
                f"its mixture-of-experts block routes to {k} of {experts} experts of width "
                f"{config.moe_intermediate_size}"
            )
    if getattr(config, "use_bidirectional_attention", None):
        return "its bidirectional attention is not built"
    types = list(config.layer_types)
    if any(t not in ("full_attention", "sliding_attention") for t in types):
        return f"its layer types {sorted(set(types))} are not all attention layers"
    n = int(config.num_hidden_layers)
    first_shared = n - int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if set(types[first_shared:]) - set(types[:first_shared]):
        return "a layer that shares its KV cache has no earlier layer of its type to share"
    rope = config.rope_parameters or {}
    kinds = {str(rope.get(t, {}).get("rope_type", "default")) for t in set(types)}
    if not kinds <= {"default", "proportional"}:
        return f"its RoPE variants {sorted(kinds)} are not built for Gemma 4"
    if getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh":
        return f"its activation {config.hidden_activation!r} is not built for Gemma 4"
    return None


def layout(config: Any) -> Gemma4Layout:
    """Each layer's shapes, the cache layer it reads and what it computes (transformers'
    `kv_sharing_modes`: a layer at or past num_hidden_layers - num_kv_shared_layers reuses the
    last earlier layer of its type)."""
    n, types = int(config.num_hidden_layers), list(config.layer_types)
    layers = [config.per_layer_config[i] for i in range(n)]
    first_shared = n - int(getattr(config, "num_kv_shared_layers", 0) or 0)
    writes = tuple(i < first_shared for i in range(n))
    cache_layer: list[int] = []
    for i in range(n):
        source = i
        if not writes[i]:
            source = max(j for j in range(first_shared) if types[j] == types[i])
        cache_layer.append(sum(writes[:source]))
    k_eq_v = bool(getattr(config, "attention_k_eq_v", False))
    return Gemma4Layout(
        head_dims=tuple(int(c.head_dim) for c in layers),
        kv_heads=tuple(int(c.num_key_value_heads) for c in layers),
        cache_layer=tuple(cache_layer),
        writes=writes,
        k_eq_v=tuple(k_eq_v and t != "sliding_attention" for t in types),
        per_layer_input=int(getattr(config, "hidden_size_per_layer_input", 0) or 0),
    )


def family_fields(config: Any) -> dict[str, Any]:
    """The forward's `Family` fields of a Gemma 4 configuration (beside its model_type)."""
    shape = layout(config)
    window = int(config.sliding_window)
    types = tuple(config.layer_types)
    return {
        "head_dim": max(shape.head_dims),
        "activation": "gelu_tanh",
        "scale": 1.0,
        "windows": tuple(window if t == "sliding_attention" else None for t in types),
        "rope_keys": types,
        "embed_scale": float(config.hidden_size) ** 0.5,
        "qk_norm": True,
        "sandwich": True,
        "final_softcap": getattr(config, "final_logit_softcapping", None),
        "gemma4": shape,
        **(_experts(config) if getattr(config, "enable_moe_block", False) else {}),
    }


def _experts(config: Any) -> dict[str, Any]:
    """Its mixture of experts (every layer's, beside its dense MLP: models/gemma4_layer.py):
    the renormalised top k of the router's softmax, GeGLU experts."""
    return {
        "experts": int(config.num_experts), "top_k": int(config.top_k_experts), "norm_topk": True,
        "expert_intermediate": int(config.moe_intermediate_size),
        "sparse": (True,) * int(config.num_hidden_layers),
    }  # fmt: skip


# the pairs a full layer's proportional RoPE leaves unrotated: llama.cpp's rope_freqs marks them
# with a frequency factor this large (1e30), the rotated ones with 1.0
_UNROTATED = 1e29


def gguf_config(config: Any, read: Callable[[str], Any]) -> Any:
    """The configuration of a GGUF file of Gemma 4 (`read`: its metadata field by key, or its
    tensor by name; None where it has neither), rebuilt from the file: each layer's type (the
    sliding pattern), head size (key_length: the full layers', key_length_swa: the sliding
    ones') and KV heads, the layers sharing KV, the per-layer input width and vocabulary, the
    double-wide MLPs of the shared layers, keys as values (full layers without attn_v), each
    layer type's RoPE (the full layers' rotated share from rope_freqs), the final soft-cap, a
    mixture of experts (its count, the experts a token and their width) and the end-of-turn
    tokens the vocabulary holds. transformers reads the file as Gemma 4 with its defaults."""
    from transformers import Gemma4TextConfig

    def key(name: str) -> Any:
        return read(f"gemma4.{name}")

    n = int(key("block_count"))
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, int):  # every pattern-th layer is a full one
        sliding = [(i + 1) % pattern != 0 for i in range(n)]
    else:
        sliding = [bool(s) for s in pattern] if pattern is not None else [True] * n
    types = ["sliding_attention" if s else "full_attention" for s in sliding]
    full_dim = int(key("attention.key_length"))
    swa_dim = int(key("attention.key_length_swa") or full_dim)
    kv = _per_layer(key("attention.head_count_kv"), n)
    ffn = _per_layer(key("feed_forward_length"), n)
    shared = int(key("attention.shared_kv_layers") or 0)
    first_shared = n - shared
    writers = [i for i in range(first_shared) if not sliding[i]]
    k_eq_v = bool(writers) and all(read(f"blk.{i}.attn_v.weight") is None for i in writers)
    per_layer = {
        i: {"head_dim": full_dim if not sliding[i] else swa_dim, "num_key_value_heads": kv[i]}
        for i in range(n)
    }
    width = int(key("embedding_length_per_layer_input") or 0)
    table = read("per_layer_token_embd.weight")
    embed = read("token_embd.weight")
    fields = {
        k: v for k, v in config.to_dict().items()
        if k not in ("per_layer_config", "transformers_version", "architectures")
    }  # fmt: skip
    fields.update(
        num_hidden_layers=n, layer_types=types, head_dim=swa_dim,
        num_key_value_heads=kv[sliding.index(True)] if any(sliding) else kv[0],
        intermediate_size=ffn[0], use_double_wide_mlp=any(f != ffn[0] for f in ffn),
        num_kv_shared_layers=shared, attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=width,
        vocab_size_per_layer_input=int(table.shape[1]) if table is not None else 0,
        sliding_window=int(key("attention.sliding_window") or config.sliding_window),
        final_logit_softcapping=_float(key("final_logit_softcapping")),
        rope_parameters=_rope(read, full_dim, swa_dim),
        eos_token_id=_end_tokens(read),
    )  # fmt: skip
    if embed is not None:
        fields["vocab_size"] = int(embed.shape[1])
    experts = key("expert_count")
    if experts:
        fields.update(
            enable_moe_block=True, num_experts=int(experts),
            top_k_experts=int(key("expert_used_count") or 0),
            moe_intermediate_size=int(key("expert_feed_forward_length") or 0),
        )  # fmt: skip
    return Gemma4TextConfig(**fields, per_layer_config=per_layer)  # type: ignore[call-arg]


def _per_layer(value: Any, n: int) -> list[int]:
    """A metadata value given once for every layer or once a layer."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _rope(read: Callable[[str], Any], full_dim: int, swa_dim: int) -> dict[str, Any]:
    """Each layer type's RoPE: the sliding layers' default one (rotating dimension_count_swa
    of each head), the full layers' proportional one (rotating the pairs rope_freqs marks)."""
    theta = float(read("gemma4.rope.freq_base") or 1e6)
    swa_theta = float(read("gemma4.rope.freq_base_swa") or 1e4)
    freqs = read("rope_freqs.weight")
    if freqs is not None:
        values = [float(v) for v in freqs.data.reshape(-1)]
        rotated = sum(1 for v in values if v < _UNROTATED)
        factor = 2 * rotated / full_dim
    else:
        factor = int(read("gemma4.rope.dimension_count") or full_dim) / full_dim
    sliding: dict[str, Any] = {"rope_type": "default", "rope_theta": swa_theta}
    swa_rotated = int(read("gemma4.rope.dimension_count_swa") or swa_dim)
    if swa_rotated != swa_dim:
        sliding["partial_rotary_factor"] = swa_rotated / swa_dim
    return {
        "sliding_attention": sliding,
        "full_attention": {
            "rope_type": "proportional", "partial_rotary_factor": factor, "rope_theta": theta,
        },
    }  # fmt: skip


# the tokens that end a Gemma 4 turn besides the vocabulary's end of sequence (transformers'
# generation configuration of Gemma 4 lists them with it)
END_TOKENS = ("<eos>", "<turn|>", "<|tool_response>")


def _end_tokens(read: Callable[[str], Any]) -> list[int]:
    """The file's end-of-sequence token and those of END_TOKENS its vocabulary holds."""
    ids = []
    eos = read("tokenizer.ggml.eos_token_id")
    if eos is not None:
        ids.append(int(eos))
    tokens = read("tokenizer.ggml.tokens") or []
    index = {t: i for i, t in enumerate(tokens) if t in END_TOKENS}
    ids += [index[t] for t in END_TOKENS if t in index and index[t] not in ids]
    return ids
