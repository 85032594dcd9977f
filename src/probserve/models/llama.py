"""The paged forward of the decoder families probserve runs (Llama, Mistral, Qwen2/3, SmolLM,
Gemma 2/3, Phi-3: their differences are parameters, models/family.py) over a paged KV cache.

It runs on the weights transformers loaded (fused into QKV and gate/up matrices once), takes a
packed batch (every token of the step, prefill chunks and decode tokens alike, in one [T, H]
tensor for all the matrix products, through the kernel that is faster on this machine:
models/linear.py) and computes attention per group: all decode tokens in one
batched call, each prefill chunk in its own causal call. RMSNorm (or Gemma's (1 + w)), per-head
q/k norms, RoPE (transformers' rope-scaling variants; one base per layer type), GQA attention with
sliding windows and soft-capping, SwiGLU or GeGLU, tied or untied head.

Deterministic (`kernels` given: `--deterministic`): every operation whose reduction order could
depend on the batch runs on probserve's row-invariant kernels (kernels/invariant.cpp): the linear
layers, RMSNorm, SwiGLU and attention (over the paged cache in place, one key order for prefill,
chunked prefill and decode alike); RoPE's cos/sin come from a table built once in blocks of fixed
size. What torch still does is exact per element (embedding gather, the residual adds, RoPE's
products and sums, the cache writes), so a token's hidden state is the same bits whatever else
the step holds. The layers then run in one native call a step (kernels/layers.py: the same
kernels chained in C++, the same bits); `op_by_op` calls them one by one from Python instead,
the reference the native call is tested against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from probserve.kernels.invariant import InvariantKernels, PackedWeight, QuantizedWeight
from probserve.kernels.layer_ops import LayerOps
from probserve.kernels.layers import LayerWeights, MoEWeights, NativeLayers, Shape
from probserve.models.family import STATIC_ROPE, Family, Unsupported, family, rope_type
from probserve.models.gguf_blocks import QuantizedTensor, Weight, as_float, stack_rows
from probserve.models.linear import Joined, Kernel, Linear, choose_kernel
from probserve.models.moe import Expert, MoE, moe_forward
from probserve.models.skeleton import Rotary

ROPE_BLOCK = 1024  # positions per block of the deterministic cos/sin table


def supports(model: Any) -> bool:
    """True for models of a family this forward reproduces exactly (models/family.py)."""
    try:
        family(model.config)
    except Unsupported:
        return False
    return True


def deterministic_blocker(model: Any) -> str | None:
    """Why this model cannot run the deterministic forward (None: it can)."""
    try:
        fam = family(model.config)
    except Unsupported as exc:
        return f"{type(model).__name__}: {exc}"
    for key in set(fam.rope_keys):
        rope = rope_type(model.config, key)
        if rope not in STATIC_ROPE:
            return f"its RoPE variant {rope!r} rescales with the batch's longest sequence"
    return None


@dataclass
class KVCache:
    """Paged KV storage: slot s = block * block_size + offset. `hidden` keeps each position's
    final-norm hidden state, so prompt logprobs of cached prefixes are recomputed exactly. A
    mixture of experts' cache also keeps each position's routing in its MoE layers (`experts`,
    `expert_weights`: the k experts its row was sent to and their weights), which a request
    that asks for its routed experts reads back (prefix-cached positions included)."""

    k: torch.Tensor  # [layers, slots, kv_heads, head_dim]
    v: torch.Tensor
    hidden: torch.Tensor  # [slots, hidden_size]
    block_size: int
    experts: torch.Tensor | None = None  # int16 [slots, moe_layers, top_k]
    expert_weights: torch.Tensor | None = None  # float32 [slots, moe_layers, top_k]

    @staticmethod
    def bytes_per_token(config: Any) -> int:
        kvh = config.num_key_value_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        moe_layers, top_k = _routing_shape(config)
        routing = (2 + 4) * moe_layers * top_k
        return 4 * (2 * config.num_hidden_layers * kvh * d + config.hidden_size) + routing

    @staticmethod
    def allocate(
        config: Any, num_blocks: int, block_size: int, device: torch.device | None = None
    ) -> KVCache:
        """Memory is taken from the OS as blocks are first written (torch.empty), except block
        0, the null block: zeros, never handed out, where masked key positions point. `device`:
        where it lives (the GPU path's device; default the host)."""
        kvh = config.num_key_value_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        slots = num_blocks * block_size
        shape = (config.num_hidden_layers, slots, kvh, d)
        cache = KVCache(
            torch.empty(shape, device=device),
            torch.empty(shape, device=device),
            torch.empty(slots, config.hidden_size, device=device),
            block_size,
        )
        moe_layers, top_k = _routing_shape(config)
        if moe_layers:
            routing = (slots, moe_layers, top_k)
            cache.experts = torch.zeros(routing, dtype=torch.int16, device=device)
            cache.expert_weights = torch.zeros(routing, device=device)
        cache.k[:, :block_size].zero_()
        cache.v[:, :block_size].zero_()
        cache.hidden[:block_size].zero_()
        return cache

    def routing(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing kept at `slots`: experts int16 [n, moe_layers, k], weights float32."""
        assert self.experts is not None and self.expert_weights is not None
        return self.experts.index_select(0, slots), self.expert_weights.index_select(0, slots)


def moe_layers(config: Any) -> tuple[int, ...]:
    """The layers whose feed-forward is a mixture of experts (none for a dense model, or one
    the paged forward does not run)."""
    try:
        fam = family(config)
    except Unsupported:
        return ()
    return tuple(i for i, sparse in enumerate(fam.sparse) if sparse) if fam.experts else ()


def _routing_shape(config: Any) -> tuple[int, int]:
    """(MoE layers, experts a token) of the routing a cache keeps; (0, 0) for a dense model."""
    layers = moe_layers(config)
    return (len(layers), family(config).top_k) if layers else (0, 0)


@dataclass
class PrefillGroup:
    rows: slice  # this chunk's rows in the packed batch
    keys: torch.Tensor  # [L] slots of every key it attends to (positions 0..end-1)
    mask: torch.Tensor | None  # [n, L] bool (True: attend); None: plain causal (no prefix)
    start: int = 0  # the chunk's first position


@dataclass
class AttentionPlan:
    slots: torch.Tensor  # [T] where each token's K/V go
    decode_rows: torch.Tensor | None = None  # [B] rows of decode tokens
    decode_keys: torch.Tensor | None = None  # [B, L] slots (padded with 0)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L] bool
    decode_len: torch.Tensor | None = None  # [B] keys each decode token attends to
    prefills: list[PrefillGroup] = field(default_factory=list)
    # the deterministic path: every token attends through its sequence's block table
    tables: torch.Tensor | None = None  # [S, width] block ids
    token_seq: torch.Tensor | None = None  # [T] row of `tables`
    token_len: torch.Tensor | None = None  # [T] keys it attends to (its position + 1)
    # the largest position in the step, where the planner knows it on the host (the GPU path:
    # no wait on the device to read it back)
    max_position: int | None = None
    # the SDPA path's masks of windowed or soft-capped layers, built once per step and window
    _masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)

    def decode_mask_for(self, window: int | None) -> torch.Tensor | None:
        """The decode tokens' mask [B, 1, 1, L], within the last `window` keys where given."""
        if not window or self.decode_len is None or self.decode_keys is None:
            return self.decode_mask
        if (-1, window) not in self._masks:
            length = self.decode_keys.shape[1]
            first = (self.decode_len - window).view(-1, 1, 1, 1)
            inside = torch.arange(length).view(1, 1, 1, -1) >= first
            self._masks[(-1, window)] = self.decode_mask & inside  # type: ignore[operator]
        return self._masks[(-1, window)]

    def prefill_mask_for(
        self, index: int, window: int | None, explicit: bool
    ) -> tuple[torch.Tensor | None, bool]:
        """Prefill group `index`'s (mask, is_causal): its own, or (`explicit`: a windowed or
        soft-capped layer, which SDPA's causal flag cannot express) causal within `window`."""
        group = self.prefills[index]
        if not explicit:
            return group.mask, group.mask is None
        if (index, window) not in self._masks:
            n = group.rows.stop - group.rows.start
            q_pos = torch.arange(group.start, group.start + n).unsqueeze(1)
            k_pos = torch.arange(group.keys.numel()).unsqueeze(0)
            mask = k_pos <= q_pos
            if window:
                mask = mask & (k_pos > q_pos - window)
            self._masks[(index, window)] = mask
        return self._masks[(index, window)], False


class _Layer:
    def __init__(
        self,
        config: Any,
        index: int,
        fam: Family,
        weights: Mapping[str, Weight],
        kernel: Kernel,
        kernels: LayerOps | None,
    ) -> None:
        """Layer `index`'s weights (`weights`: every tensor by its parameter name) and constants."""
        prefix = f"model.layers.{index}."

        def linear(*names: str) -> Linear | Joined:
            parts = [weights[f"{prefix}{n}.weight"] for n in names]
            found = [weights.get(f"{prefix}{n}.bias") for n in names]
            biases = [None if b is None else as_float(b) for b in found]  # vectors: float32 already
            if isinstance(kernels, InvariantKernels) and len({_form(w) for w in parts}) > 1:
                # parts in different formats: each in its own blocks, never a float32 copy
                pairs = zip(parts, biases, strict=True)
                return Joined([Linear(w, b, kernel, kernels) for w, b in pairs])
            present = [b for b in biases if b is not None]
            bias = torch.cat(present) if len(present) == len(biases) else None
            return Linear(stack_rows(parts), bias, kernel, kernels)

        def norm(name: str) -> torch.Tensor | None:
            full = f"{prefix}{name}.weight"
            return norm_weight(weights[full], fam) if full in weights else None

        self.ln1 = norm_weight(weights[prefix + "input_layernorm.weight"], fam)
        # Llama: the norm before the MLP; Gemma: the norm of the attention's output
        self.ln2 = norm_weight(weights[prefix + "post_attention_layernorm.weight"], fam)
        self.pre_ff = norm("pre_feedforward_layernorm")
        self.post_ff = norm("post_feedforward_layernorm")
        self.q_norm = norm("self_attn.q_norm")
        self.k_norm = norm("self_attn.k_norm")

        def expert(e: int) -> Expert:
            """Expert e: from transformers' [E, 2I, H] and [E, H, I] parameters (views; gpt-oss's
            are [E, H, 2I] with gate and up interleaved, and biased: rows [gate | up] made of
            them), or a GGUF file's rows of each expert (models/gguf_blocks.py names them per
            expert)."""
            fused = weights.get(f"{prefix}mlp.experts.gate_up_proj")
            if fused is not None:
                gate_up, down = (
                    as_float(fused)[e],
                    as_float(weights[f"{prefix}mlp.experts.down_proj"])[e],
                )
                bias = {
                    name: as_float(weights[f"{prefix}mlp.experts.{name}_bias"])[e]
                    for name in ("gate_up_proj", "down_proj")
                    if f"{prefix}mlp.experts.{name}_bias" in weights
                }
                gu_bias, down_bias = bias.get("gate_up_proj"), bias.get("down_proj")
                if fam.swiglu_limit is not None:  # gpt-oss: x @ W, columns gate, up, gate, ...
                    gate_up = torch.cat([gate_up.T[0::2], gate_up.T[1::2]]).contiguous()
                    down = down.T.contiguous()
                    if gu_bias is not None:
                        gu_bias = torch.cat([gu_bias[0::2], gu_bias[1::2]])
                return Expert(
                    Linear(gate_up, gu_bias, kernel, kernels),
                    Linear(down, down_bias, kernel, kernels),
                )
            at = f"mlp.experts.{e}."
            if f"{prefix}{at}gate_up_proj.weight" in weights:  # a file's fused [gate | up]
                return Expert(linear(at + "gate_up_proj"), linear(at + "down_proj"))
            return Expert(linear(at + "gate_proj", at + "up_proj"), linear(at + "down_proj"))

        if fam.fused:
            self.qkv = linear("self_attn.qkv_proj")
        else:
            self.qkv = linear("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        self.o = linear("self_attn.o_proj")
        # the feed-forward: a mixture of experts, or the dense MLP
        self.moe: MoE | None = None
        self.gate_up: Linear | Joined | None = None
        self.down: Linear | Joined | None = None
        # this layer's place among the MoE layers (the routing a cache keeps)
        self.moe_index = sum(fam.sparse[:index]) if fam.experts else 0
        if fam.experts and fam.sparse[index]:
            router = "mlp.router" if f"{prefix}mlp.router.weight" in weights else "mlp.gate"
            group = getattr(kernels, "group_experts", None)
            if group is not None:  # the GPU path: stacked as they are packed, one at a time

                def parts(e: int) -> tuple[torch.Tensor, Any, torch.Tensor, Any]:
                    ex = expert(e)
                    gu, down = ex.gate_up.packed, ex.down.packed  # type: ignore[union-attr]
                    assert gu is not None and down is not None
                    return gu.panels, gu.bias, down.panels, down.bias

                grouped = group((parts(e) for e in range(fam.experts)), fam.experts)
                self.moe = MoE(linear(router), (), fam.top_k, fam.norm_topk, grouped)
            else:
                experts = tuple(expert(e) for e in range(fam.experts))
                self.moe = MoE(linear(router), experts, fam.top_k, fam.norm_topk)
            self.intermediate = fam.expert_intermediate
        else:
            self.gate_up = (
                linear("mlp.gate_up_proj") if fam.fused else linear("mlp.gate_proj", "mlp.up_proj")
            )
            self.down = linear("mlp.down_proj")
            self.intermediate = int(config.intermediate_size)
        self.window = fam.windows[index]
        self.rope_key = fam.rope_keys[index]
        # gpt-oss: each head's sink logit (float32, contiguous: the kernel reads it)
        sinks = weights.get(prefix + "self_attn.sinks") if fam.sinks else None
        self.sinks = None if sinks is None else as_float(sinks).float().contiguous()


def _parts(linear: Linear | Joined | None) -> list[PackedWeight | QuantizedWeight]:
    """A projection's weights as the native layers read them (invariant kernels only)."""
    if linear is None:
        raise ValueError("a layer's projection is missing")
    found: list[PackedWeight | QuantizedWeight] = []
    for part in linear.parts if isinstance(linear, Joined) else [linear]:
        weight = part.quantized if part.quantized is not None else part.packed
        if weight is None:
            raise ValueError("the native layers read invariant-kernel weights only")
        found.append(weight)
    return found


def _form(weight: Weight) -> int | None:
    """A weight's block format (None: float32)."""
    return weight.ggml_type if isinstance(weight, QuantizedTensor) else None


def norm_weight(weight: Weight, fam: Family) -> torch.Tensor:
    """An RMSNorm's weight as the forward multiplies by it: Gemma's 1 + w (in float32, as
    transformers computes it), else w; a copy (a weight memory-mapped from safetensors may share
    one storage with the whole file, and the runner must not keep that mapping alive)."""
    w = as_float(weight).detach()
    return (1.0 + w.float()) if fam.norm_plus_one else w.clone()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaForward:
    def __init__(
        self,
        model: Any,
        kernel: Kernel | Literal["auto"] = "auto",
        kernels: LayerOps | None = None,
        weights: Mapping[str, Weight] | None = None,
        op_by_op: bool = False,
    ) -> None:
        """`kernel`: the linear layers' matrix kernel (models/linear.py); "auto" times both on
        the first layer's MLP matrix and keeps the faster. `kernels`: run deterministic (the
        row-invariant kernels everywhere; `kernel` is then "invariant"), the decoder layers in
        one native call a step (kernels/layers.py) unless `op_by_op` (the same kernels called one
        by one from Python: the reference the native call is tested against, bit for bit).
        `weights`: the tensors by parameter name where the model holds none of its own (a GGUF
        file's blocks, models/gguf_blocks.py: they stay quantized with `kernels`); default: the
        model's."""
        cfg = model.config
        self.kernels = kernels
        self.family = fam = family(cfg)
        if weights is None:
            weights = dict(model.named_parameters(remove_duplicate=False))
        if kernels is not None:
            blocker = deterministic_blocker(model)
            if blocker:
                raise ValueError(f"this model cannot run deterministic: {blocker}")
            kernel = "invariant"
        elif kernel == "auto":
            first = "model.layers.0.mlp."
            names = (
                (first + "gate_up_proj.weight",)
                if fam.fused
                else (first + "gate_proj.weight", first + "up_proj.weight")
            )
            if fam.experts:  # no dense MLP to time: the first attention's query matrix
                names = ("model.layers.0.self_attn.q_proj.weight",)
            kernel = choose_kernel(as_float(stack_rows([weights[n] for n in names])))
        self.kernel: Kernel = kernel
        self.model = model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = fam.head_dim
        self.eps = float(cfg.rms_norm_eps)
        self.layers = [
            _Layer(cfg, i, fam, weights, kernel, kernels) for i in range(cfg.num_hidden_layers)
        ]
        self.norm = norm_weight(weights["model.norm.weight"], fam)
        self.embed_scale = (
            torch.tensor(fam.embed_scale, dtype=torch.float32) if fam.embed_scale else None
        )
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
        # a rotary embedding per entry of rope_parameters (Gemma 3: one per layer type); the
        # model's own module where its variant is not static (dynamic: torch's path only)
        self.rotary: dict[str | None, Any] = {}
        for key in set(fam.rope_keys):
            static = rope_type(cfg, key) in STATIC_ROPE
            self.rotary[key] = Rotary(cfg, key) if static else model.model.rotary_emb
        self.intermediate = self.layers[0].intermediate
        # the deterministic cos/sin tables, grown ROPE_BLOCK positions at a time
        self._rope_cos = {key: torch.empty((0, self.head_dim)) for key in self.rotary}
        self._rope_sin = {key: torch.empty((0, self.head_dim)) for key in self.rotary}
        self.native: NativeLayers | None = None
        if isinstance(kernels, InvariantKernels) and not op_by_op:
            self.native = self._native_layers(kernels)

    def _native_layers(self, kernels: InvariantKernels) -> NativeLayers:
        """The layers described for the one native call (pointers into the weights held here)."""
        fam, keys = self.family, list(self.rotary)
        widest = max(layer.intermediate for layer in self.layers)
        shape = Shape(
            hidden=int(self.model.config.hidden_size), heads=self.num_heads,
            kv_heads=self.num_kv_heads, head_dim=self.head_dim, intermediate=widest,
            eps=self.eps, scale=float(fam.scale), softcap=float(fam.attn_softcap or 0.0),
            sandwich=fam.sandwich, gelu=fam.activation == "gelu_tanh",
            swiglu_alpha=fam.swiglu_alpha, swiglu_limit=float(fam.swiglu_limit or 0.0),
            qk_full=fam.qk_norm_full,
        )  # fmt: skip

        def mixture(layer: _Layer) -> MoEWeights | None:
            moe = layer.moe
            if moe is None:
                return None
            return MoEWeights(
                router=_parts(moe.router),
                gate_up=[_parts(e.gate_up) for e in moe.experts],
                down=[_parts(e.down) for e in moe.experts],
                top_k=moe.top_k, norm=moe.norm_topk, index=layer.moe_index,
            )  # fmt: skip

        layers = [
            LayerWeights(
                ln1=layer.ln1,
                ln2=layer.ln2,
                qkv=_parts(layer.qkv),
                o=_parts(layer.o),
                gate_up=_parts(layer.gate_up) if layer.moe is None else (),
                down=_parts(layer.down) if layer.moe is None else (),
                pre_ff=layer.pre_ff,
                post_ff=layer.post_ff,
                q_norm=layer.q_norm,
                k_norm=layer.k_norm,
                window=int(layer.window or 0),
                rope=keys.index(layer.rope_key),
                moe=mixture(layer),
                sinks=layer.sinks,
            )
            for layer in self.layers
        ]
        return NativeLayers(kernels, shape, layers)

    def _own_embedding(self, embed: Weight) -> torch.Tensor | QuantizedWeight:
        """An untied embedding: in its blocks where the kernels read them, else float32."""
        if isinstance(embed, QuantizedTensor) and isinstance(self.kernels, InvariantKernels):
            return self.kernels.qpack(embed.blocks, embed.ggml_type)
        own = as_float(embed).detach().clone()
        place = getattr(self.kernels, "place", None)  # the GPU path's: on its device
        return place(own) if place is not None else own

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
        if self.embed_scale is not None:
            h = h * self.embed_scale
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.kernels is not None:
            if plan.max_position is not None:
                need = plan.max_position + 1
            else:
                need = int(positions.max()) + 1 if positions.numel() else 0
            self._rope_table(h, need)
        else:
            rope = {key: self._rope(key, h, positions) for key in self.rotary}  # [T, 1, d]
        if self.native is not None:
            assert plan.tables is not None and plan.token_seq is not None
            assert plan.token_len is not None
            tables = [(self._rope_cos[key], self._rope_sin[key]) for key in self.rotary]
            routed = None
            if cache.experts is not None and cache.expert_weights is not None:
                routed = (cache.experts, cache.expert_weights)
            h = self.native.run(
                h.contiguous(), positions, plan.slots, plan.tables, plan.token_seq,
                plan.token_len, cache.block_size, cache.k, cache.v, tables, routed,
            )  # fmt: skip
            out = self._norm(h, self.norm)
            cache.hidden.index_copy_(0, plan.slots, out)
            return out
        t = input_ids.shape[0]
        for li, layer in enumerate(self.layers):
            x = self._norm(h, layer.ln1)
            qkv = layer.qkv(x)
            if layer.q_norm is not None and layer.k_norm is not None:
                qkv = self._qk_norm(qkv, layer.q_norm, layer.k_norm)
            if self.kernels is not None:  # RoPE and the cache write in one call
                q = self.kernels.rope_cache(
                    qkv, (nq, nkv, d), self._rope_cos[layer.rope_key],
                    self._rope_sin[layer.rope_key], positions, plan.slots,
                    cache.k[li], cache.v[li],
                )  # fmt: skip
            else:
                cos, sin = rope[layer.rope_key]
                q = qkv[:, : nq * d].view(t, nq, d)
                k = qkv[:, nq * d : (nq + nkv) * d].view(t, nkv, d)
                v = qkv[:, (nq + nkv) * d :].view(t, nkv, d)
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
                cache.k[li].index_copy_(0, plan.slots, k)
                cache.v[li].index_copy_(0, plan.slots, v)
            attn = layer.o(self._attention(q, cache, li, plan, layer))
            if self.family.sandwich:
                assert layer.pre_ff is not None and layer.post_ff is not None
                h = h + self._norm(attn, layer.ln2)
                x = self._norm(h, layer.pre_ff)
                h = h + self._norm(self._ffn(layer, x, cache, plan.slots), layer.post_ff)
            else:
                h = h + attn
                x = self._norm(h, layer.ln2)
                h = h + self._ffn(layer, x, cache, plan.slots)
        out = self._norm(h, self.norm)
        cache.hidden.index_copy_(0, plan.slots, out)
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedWeight):
            assert isinstance(self.kernels, InvariantKernels)
            return self.kernels.qrows(self.embed, ids)
        if self.embed is not None:
            return F.embedding(ids, self.embed)
        if self.lm_head.quantized is not None:
            assert isinstance(self.kernels, InvariantKernels)
            return self.kernels.qrows(self.lm_head.quantized, ids)
        if self.lm_head.packed is not None:
            return self.kernels.rows(self.lm_head.packed, ids)  # type: ignore[union-attr]
        return F.embedding(ids, self.lm_head.w)

    def _norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(h, weight, self.eps)
        return F.rms_norm(h, (h.shape[-1],), weight, self.eps)

    def _qk_norm(self, qkv: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
        """qkv with every query and key head RMS-normed over the head dimension (Qwen3, Gemma 3),
        or the whole query and key projections (OLMoE)."""
        t, (nq, nkv, d) = qkv.shape[0], (self.num_heads, self.num_kv_heads, self.head_dim)
        if self.family.qk_norm_full:
            q = self._norm(qkv[:, : nq * d].contiguous(), qw)
            k = self._norm(qkv[:, nq * d : (nq + nkv) * d].contiguous(), kw)
            return torch.cat([q, k, qkv[:, (nq + nkv) * d :]], dim=1)
        q = self._norm(qkv[:, : nq * d].reshape(t * nq, d), qw).view(t, nq * d)
        k = self._norm(qkv[:, nq * d : (nq + nkv) * d].reshape(t * nkv, d), kw).view(t, nkv * d)
        return torch.cat([q, k, qkv[:, (nq + nkv) * d :]], dim=1)

    def _ffn(
        self, layer: _Layer, x: torch.Tensor, cache: KVCache, slots: torch.Tensor
    ) -> torch.Tensor:
        """The feed-forward of normed rows x: the layer's experts (their routing kept at the
        rows' slots), or its MLP."""
        if layer.moe is not None:
            out, ids, weights = moe_forward(layer.moe, x, self._expert_act, self.kernels)
            if cache.experts is not None and cache.expert_weights is not None:
                cache.experts[:, layer.moe_index].index_copy_(0, slots, ids.to(torch.int16))
                cache.expert_weights[:, layer.moe_index].index_copy_(0, slots, weights.float())
            return out
        assert layer.gate_up is not None and layer.down is not None
        return layer.down(self._act(layer.gate_up(x)))

    def _expert_act(self, gu: torch.Tensor) -> torch.Tensor:
        """An expert's gated activation: gpt-oss's clamped SwiGLU, or the family's."""
        limit, alpha = self.family.swiglu_limit, self.family.swiglu_alpha
        if limit is None:
            return self._act(gu)
        if self.kernels is not None:
            return self.kernels.gpt_oss_glu(gu, alpha, limit)
        width = gu.shape[1] // 2
        gate, up = gu[:, :width].clamp(max=limit), gu[:, width:].clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def _act(self, gu: torch.Tensor) -> torch.Tensor:
        """SwiGLU or GeGLU of rows [gate | up]."""
        gelu = self.family.activation == "gelu_tanh"
        if self.kernels is not None:
            return self.kernels.gelu_tanh_mul(gu) if gelu else self.kernels.silu_mul(gu)
        width = gu.shape[1] // 2
        gate, up = gu[:, :width], gu[:, width:]
        return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up

    def _rope(
        self, key: str | None, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, d] at `positions`, from the rotary module (torch's path)."""
        cos, sin = self.rotary[key](h, positions.unsqueeze(0))
        return cos[0].unsqueeze(1), sin[0].unsqueeze(1)

    def rope_tables(self) -> list[torch.Tensor]:
        """The deterministic path's cos and sin tables as they are now (the GPU path's CUDA
        graphs hold them, so the device copies their replays read stay alive)."""
        return [*self._rope_cos.values(), *self._rope_sin.values()]

    def _rope_table(self, h: torch.Tensor, need: int) -> None:
        """Deterministic mode's cos and sin tables, grown to cover positions 0..need-1 in blocks
        of ROPE_BLOCK positions (each block one call of one shape, so a position's row never
        depends on what else is in the step); the kernels read their rows."""
        for key, rotary in self.rotary.items():
            have = self._rope_cos[key].shape[0]
            if have >= need:
                continue
            cos_parts, sin_parts = [self._rope_cos[key]], [self._rope_sin[key]]
            first = h[:1].cpu()  # on the host (the GPU path copies the tables once)
            for start in range(have, need, ROPE_BLOCK):
                at = torch.arange(start, start + ROPE_BLOCK).unsqueeze(0)
                cos, sin = rotary(first, at)
                cos_parts.append(cos[0].float())
                sin_parts.append(sin[0].float())
            self._rope_cos[key] = torch.cat(cos_parts)  # one copy however far it grows
            self._rope_sin[key] = torch.cat(sin_parts)

    def _attention(
        self, q: torch.Tensor, cache: KVCache, li: int, plan: AttentionPlan, layer: _Layer
    ) -> torch.Tensor:
        kc, vc = cache.k[li], cache.v[li]
        scale, softcap = self.family.scale, self.family.attn_softcap
        window, sinks = layer.window, layer.sinks
        if self.kernels is not None:
            assert plan.tables is not None and plan.token_seq is not None
            assert plan.token_len is not None
            return self.kernels.attention(
                q, kc, vc, scale, plan.tables, plan.token_seq, plan.token_len, cache.block_size,
                window, softcap, sinks,
            )  # fmt: skip
        t, nq, d = q.shape
        out = q.new_empty((t, nq * d))
        if plan.decode_rows is not None:
            b, length = plan.decode_keys.shape  # type: ignore[union-attr]
            flat = plan.decode_keys.reshape(-1)  # type: ignore[union-attr]
            keys = kc.index_select(0, flat).view(b, length, -1, d).transpose(1, 2)
            vals = vc.index_select(0, flat).view(b, length, -1, d).transpose(1, 2)
            qd = q.index_select(0, plan.decode_rows).unsqueeze(2)  # [B, nq, 1, d]
            mask = plan.decode_mask_for(window)
            o = _sdpa(qd, keys, vals, mask, False, scale, softcap, sinks)
            out.index_copy_(0, plan.decode_rows, o.reshape(b, nq * d))
        for i, group in enumerate(plan.prefills):
            qp = q[group.rows].transpose(0, 1).unsqueeze(0)  # [1, nq, n, d]
            keys = kc.index_select(0, group.keys).transpose(0, 1).unsqueeze(0)
            vals = vc.index_select(0, group.keys).transpose(0, 1).unsqueeze(0)
            explicit = bool(window or softcap or sinks is not None)
            mask, causal = plan.prefill_mask_for(i, window, explicit)
            o = _sdpa(qp, keys, vals, mask, causal, scale, softcap, sinks)
            out[group.rows] = o[0].transpose(0, 1).reshape(-1, nq * d)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(hidden)
        cap = self.family.final_softcap
        if cap:
            if self.kernels is not None:
                return self.kernels.softcap(out, cap)
            return torch.tanh(out / cap) * cap
        return out


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention [B, nq, n, d] over keys [B, nkv, L, d] (grouped query heads): torch's fused
    kernel, or, with soft-capped scores (Gemma 2) or sinks (gpt-oss: a logit per head beside the
    keys' in the softmax, dropped after it), transformers' eager order of operations."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v
