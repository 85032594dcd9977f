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
  layer (models/gemma4_layer.py); the final logits are soft-capped.

Imported by the API process through the family table: no torch here."""

from __future__ import annotations

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
        return "its mixture-of-experts block (router scales, experts beside the MLP) is not built"
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
    }
