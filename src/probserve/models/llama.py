"""The forward pass of the Llama family (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

It runs on the weights transformers loaded (fused into QKV and gate/up matrices once), takes a
packed batch (every token of the step, prefill chunks and decode tokens alike, in one [T, H]
tensor for all the matrix products, through the kernel that is faster on this machine:
models/linear.py) and computes attention per group: all decode tokens in one
batched call, each prefill chunk in its own causal call. RMSNorm, RoPE (the model's own rotary
module, so every rope-scaling variant its config names is honoured), GQA attention, SwiGLU, tied or
untied head.

Deterministic (`kernels` given: `--deterministic`): every operation whose reduction order could
depend on the batch runs on probserve's row-invariant kernels (kernels/invariant.cpp): the linear
layers, RMSNorm, SwiGLU and attention (over the paged cache in place, one key order for prefill,
chunked prefill and decode alike); RoPE's cos/sin come from a table built once in blocks of fixed
size. What torch still does is exact per element (embedding gather, the residual adds, RoPE's
products and sums, the cache writes), so a token's hidden state is the same bits whatever else
the step holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from probserve.kernels.invariant import InvariantKernels, QuantizedWeight
from probserve.models.gguf_blocks import QuantizedTensor, Weight, as_float, stack_rows
from probserve.models.linear import Kernel, Linear, choose_kernel

SUPPORTED_TYPES = frozenset({"llama", "mistral", "qwen2"})
# RoPE variants whose cos/sin depend on the position alone (dynamic and longrope rescale with
# the batch's longest sequence: no per-token invariance)
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})
ROPE_BLOCK = 1024  # positions per block of the deterministic cos/sin table


def supports(model: Any) -> bool:
    """True for Llama-family models this forward reproduces exactly."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED_TYPES:
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return False
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", window is not None)
    return not (window and uses_window and window < cfg.max_position_embeddings)


def deterministic_blocker(model: Any) -> str | None:
    """Why this model cannot run the deterministic forward (None: it can)."""
    if not supports(model):
        return f"{type(model).__name__} does not run on the paged Llama-family forward"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"its RoPE variant {rope!r} rescales with the batch's longest sequence"
    return None


@dataclass
class KVCache:
    """Paged KV storage: slot s = block * block_size + offset. `hidden` keeps each position's
    final-norm hidden state, so prompt logprobs of cached prefixes are recomputed exactly."""

    k: torch.Tensor  # [layers, slots, kv_heads, head_dim]
    v: torch.Tensor
    hidden: torch.Tensor  # [slots, hidden_size]
    block_size: int

    @staticmethod
    def bytes_per_token(config: Any) -> int:
        kvh = config.num_key_value_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 4 * (2 * config.num_hidden_layers * kvh * d + config.hidden_size)

    @staticmethod
    def allocate(config: Any, num_blocks: int, block_size: int) -> KVCache:
        """Memory is taken from the OS as blocks are first written (torch.empty), except block
        0, the null block: zeros, never handed out, where masked key positions point."""
        kvh = config.num_key_value_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        slots = num_blocks * block_size
        shape = (config.num_hidden_layers, slots, kvh, d)
        cache = KVCache(
            torch.empty(shape),
            torch.empty(shape),
            torch.empty(slots, config.hidden_size),
            block_size,
        )
        cache.k[:, :block_size].zero_()
        cache.v[:, :block_size].zero_()
        cache.hidden[:block_size].zero_()
        return cache


@dataclass
class PrefillGroup:
    rows: slice  # this chunk's rows in the packed batch
    keys: torch.Tensor  # [L] slots of every key it attends to (positions 0..end-1)
    mask: torch.Tensor | None  # [n, L] bool (True: attend); None: plain causal (no prefix)


@dataclass
class AttentionPlan:
    slots: torch.Tensor  # [T] where each token's K/V go
    decode_rows: torch.Tensor | None = None  # [B] rows of decode tokens
    decode_keys: torch.Tensor | None = None  # [B, L] slots (padded with 0)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L] bool
    prefills: list[PrefillGroup] = field(default_factory=list)
    # the deterministic path: every token attends through its sequence's block table
    tables: torch.Tensor | None = None  # [S, width] block ids
    token_seq: torch.Tensor | None = None  # [T] row of `tables`
    token_len: torch.Tensor | None = None  # [T] keys it attends to (its position + 1)


class _Layer:
    def __init__(
        self,
        layer: Any,
        prefix: str,
        weights: Mapping[str, Weight],
        kernel: Kernel,
        kernels: InvariantKernels | None,
    ) -> None:
        """`layer`: the transformers module (its sizes and constants; on the meta device when
        the weights come from elsewhere); `weights`: every tensor by its parameter name."""
        attn, mlp = layer.self_attn, layer.mlp

        def tensor(name: str) -> torch.Tensor:
            # copies: a weight memory-mapped from safetensors may share one storage with the
            # whole file, and the packed runner must not keep that mapping alive (release_source)
            return as_float(weights[prefix + name]).detach().clone()

        def linear(*names: str) -> Linear:
            weight = stack_rows([weights[f"{prefix}{n}.weight"] for n in names])
            biases = [weights.get(f"{prefix}{n}.bias") for n in names]
            bias = None if any(b is None for b in biases) else torch.cat(biases)  # type: ignore[misc]
            return Linear(weight, bias, kernel, kernels)

        self.ln1 = tensor("input_layernorm.weight")
        self.ln2 = tensor("post_attention_layernorm.weight")
        self.eps1 = float(layer.input_layernorm.variance_epsilon)
        self.eps2 = float(layer.post_attention_layernorm.variance_epsilon)
        self.qkv = linear("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        self.o = linear("self_attn.o_proj")
        self.gate_up = linear("mlp.gate_proj", "mlp.up_proj")
        self.down = linear("mlp.down_proj")
        self.scale = float(getattr(attn, "scaling", attn.head_dim**-0.5))
        self.intermediate = int(mlp.down_proj.in_features)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaForward:
    def __init__(
        self,
        model: Any,
        kernel: Kernel | Literal["auto"] = "auto",
        kernels: InvariantKernels | None = None,
        weights: Mapping[str, Weight] | None = None,
    ) -> None:
        """`kernel`: the linear layers' matrix kernel (models/linear.py); "auto" times both on
        the first layer's MLP matrix and keeps the faster. `kernels`: run deterministic (the
        row-invariant kernels everywhere; `kernel` is then "invariant"). `weights`: the tensors
        by parameter name where the model holds none of its own (a GGUF file's blocks,
        models/gguf_blocks.py: they stay quantized with `kernels`); default: the model's."""
        cfg = model.config
        self.kernels = kernels
        if weights is None:
            weights = dict(model.named_parameters(remove_duplicate=False))
        if kernels is not None:
            blocker = deterministic_blocker(model)
            if blocker:
                raise ValueError(f"this model cannot run deterministic: {blocker}")
            kernel = "invariant"
        elif kernel == "auto":
            gate_up = ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
            kernel = choose_kernel(as_float(stack_rows([weights[n] for n in gate_up])))
        self.kernel: Kernel = kernel
        self.model = model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.layers = [
            _Layer(layer, f"model.layers.{i}.", weights, kernel, kernels)
            for i, layer in enumerate(model.model.layers)
        ]
        self.norm = as_float(weights["model.norm.weight"]).detach().clone()
        self.norm_eps = float(model.model.norm.variance_epsilon)
        head, embed = weights["lm_head.weight"], weights["model.embed_tokens.weight"]
        self.lm_head = Linear(head, None, kernel, kernels)
        # a tied embedding is read from the head's own copy (dense, packed panels or blocks):
        # the weight is held once; an untied one (or oneDNN's blocked head) keeps its own copy
        same = head is embed or (
            isinstance(head, torch.Tensor)
            and isinstance(embed, torch.Tensor)
            and head.data_ptr() == embed.data_ptr()
        )
        self.tied = same and kernel != "onednn"
        self.embed: torch.Tensor | QuantizedWeight | None = None
        if not self.tied:
            self.embed = self._own_embedding(embed)
        self.vocab_size = self.lm_head.out_features
        self.rotary = model.model.rotary_emb
        self.intermediate = self.layers[0].intermediate
        # the deterministic cos/sin table, grown ROPE_BLOCK positions at a time
        self._rope_cos = torch.empty((0, self.head_dim))
        self._rope_sin = torch.empty((0, self.head_dim))

    def _own_embedding(self, embed: Weight) -> torch.Tensor | QuantizedWeight:
        """An untied embedding: in its blocks where the kernels read them, else float32."""
        if isinstance(embed, QuantizedTensor) and self.kernels is not None:
            return self.kernels.qpack(embed.blocks, embed.ggml_type)
        return as_float(embed).detach().clone()

    def release_source(self) -> None:
        """Drop the transformers model: every weight the forward uses is a copy held here (the
        rotary module alone is kept, and it holds no weights)."""
        self.model = None

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan, cache: KVCache
    ) -> torch.Tensor:
        """Runs the packed tokens; writes their K/V and final hidden states into `cache`;
        returns the final-norm hidden states [T, H]."""
        h = self._embed(input_ids)
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.kernels is not None:
            self._rope_table(h, int(positions.max()) + 1 if positions.numel() else 0)
        else:
            cos, sin = self._rope(h, positions)  # [T, 1, d]
        t = input_ids.shape[0]
        for li, layer in enumerate(self.layers):
            x = self._norm(h, layer.ln1, layer.eps1)
            qkv = layer.qkv(x)
            if self.kernels is not None:  # RoPE and the cache write in one call
                q = self.kernels.rope_cache(
                    qkv, (nq, nkv, d), self._rope_cos, self._rope_sin, positions, plan.slots,
                    cache.k[li], cache.v[li],
                )  # fmt: skip
            else:
                q = qkv[:, : nq * d].view(t, nq, d)
                k = qkv[:, nq * d : (nq + nkv) * d].view(t, nkv, d)
                v = qkv[:, (nq + nkv) * d :].view(t, nkv, d)
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
                cache.k[li].index_copy_(0, plan.slots, k)
                cache.v[li].index_copy_(0, plan.slots, v)
            attn = self._attention(q, cache, li, plan, layer.scale)
            h = h + layer.o(attn)
            x = self._norm(h, layer.ln2, layer.eps2)
            h = h + layer.down(self._swiglu(layer.gate_up(x)))
        out = self._norm(h, self.norm, self.norm_eps)
        cache.hidden.index_copy_(0, plan.slots, out)
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedWeight):
            return self.kernels.qrows(self.embed, ids)  # type: ignore[union-attr]
        if self.embed is not None:
            return F.embedding(ids, self.embed)
        if self.lm_head.quantized is not None:
            return self.kernels.qrows(self.lm_head.quantized, ids)  # type: ignore[union-attr]
        if self.lm_head.packed is not None:
            return self.kernels.rows(self.lm_head.packed, ids)  # type: ignore[union-attr]
        return F.embedding(ids, self.lm_head.w)

    def _norm(self, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(h, weight, eps)
        return F.rms_norm(h, (h.shape[-1],), weight, eps)

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_mul(gu)
        return F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate :]

    def _rope(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, d] at `positions`, from the rotary module (torch's path)."""
        cos, sin = self.rotary(h, positions.unsqueeze(0))
        return cos[0].unsqueeze(1), sin[0].unsqueeze(1)

    def _rope_table(self, h: torch.Tensor, need: int) -> None:
        """Deterministic mode's cos and sin tables, grown to cover positions 0..need-1 in blocks
        of ROPE_BLOCK positions (each block one call of one shape, so a position's row never
        depends on what else is in the step); the kernels read their rows."""
        while self._rope_cos.shape[0] < need:
            start = self._rope_cos.shape[0]
            cos, sin = self.rotary(h[:1], torch.arange(start, start + ROPE_BLOCK).unsqueeze(0))
            self._rope_cos = torch.cat([self._rope_cos, cos[0].float()])
            self._rope_sin = torch.cat([self._rope_sin, sin[0].float()])

    def _attention(
        self, q: torch.Tensor, cache: KVCache, layer: int, plan: AttentionPlan, scale: float
    ) -> torch.Tensor:
        kc, vc = cache.k[layer], cache.v[layer]
        if self.kernels is not None:
            assert plan.tables is not None and plan.token_seq is not None
            assert plan.token_len is not None
            return self.kernels.attention(
                q, kc, vc, scale, plan.tables, plan.token_seq, plan.token_len, cache.block_size
            )
        t, nq, d = q.shape
        out = q.new_empty((t, nq * d))
        if plan.decode_rows is not None:
            b, length = plan.decode_keys.shape  # type: ignore[union-attr]
            flat = plan.decode_keys.reshape(-1)  # type: ignore[union-attr]
            keys = kc.index_select(0, flat).view(b, length, -1, d).transpose(1, 2)
            vals = vc.index_select(0, flat).view(b, length, -1, d).transpose(1, 2)
            qd = q.index_select(0, plan.decode_rows).unsqueeze(2)  # [B, nq, 1, d]
            o = F.scaled_dot_product_attention(
                qd, keys, vals, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True
            )
            out.index_copy_(0, plan.decode_rows, o.reshape(b, nq * d))
        for group in plan.prefills:
            qp = q[group.rows].transpose(0, 1).unsqueeze(0)  # [1, nq, n, d]
            keys = kc.index_select(0, group.keys).transpose(0, 1).unsqueeze(0)
            vals = vc.index_select(0, group.keys).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp,
                keys,
                vals,
                attn_mask=group.mask,
                is_causal=group.mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[group.rows] = o[0].transpose(0, 1).reshape(-1, nq * d)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
