"""The paged forward of the decoder families probserve runs (Llama, Mistral, Qwen2/3, SmolLM,
Gemma 2/3/4, Phi-3, the mixtures of experts: their differences are parameters, models/family.py;
what Gemma 4's layer adds: models/gemma4_layer.py)
over a paged KV cache, on one backend's operations (kernels/layer_ops.py), which it never asks
about: torch's, the row-invariant kernels', or the GPU path's.

It takes a packed batch (every token of the step, prefill chunks and decode tokens alike, in one
[T, H] tensor for all the matrix products, each weight held as its backend packs it:
models/linear.py) and attends as the step's plan lays it out (kernels/attention_plan.py).
RMSNorm (or Gemma's (1 + w)), per-head q/k norms, RoPE (transformers' rope-scaling variants;
one base per layer type) with the cache write, GQA attention with sliding windows, soft-capping
and sinks, SwiGLU or GeGLU, a mixture of experts' router and experts, tied or untied head.

On the row-invariant kernels (`--deterministic`) every operation whose reduction order could
depend on the batch runs on probserve's kernels (kernels/invariant.cpp), attention reads the
paged cache in place (one key order for prefill, chunked prefill and decode alike), and RoPE's
cos/sin come from a table built once in blocks of fixed size (every backend reads those tables;
a dynamic RoPE, torch's only, is computed at the step's positions). What torch still does is
exact per element (embedding gather, the residual adds, the cache writes), so a token's hidden
state is the same bits whatever else the step holds. There the layers run in one native call a
step (`LayerOps.chain`, kernels/layers.py: the same kernels chained in C++, the same bits);
`op_by_op` calls them one by one from Python instead, the reference the native call is tested
against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from probserve.kernels.attention_plan import AttentionPlan, LayerAttention, LayerKV, Rope
from probserve.kernels.experts import Activation, Expert
from probserve.kernels.layer_ops import LayerOps
from probserve.kernels.layers import LayerWeights, MoEWeights, Shape
from probserve.kernels.weights import Packed
from probserve.models.deltanet import GatedDeltaNet, Span, StateShape, sigmoid_rows
from probserve.models.families import TYPES, column_expert_rows
from probserve.models.family import STATIC_ROPE, Family, Unsupported, family, rope_type
from probserve.models.gemma4_layer import Gemma4Layers
from probserve.models.gguf_blocks import Weight, as_float, stack_rows
from probserve.models.gguf_hybrid import TiledInput
from probserve.models.linear import Joined, Linear, projection
from probserve.models.moe import MoE
from probserve.models.skeleton import Rotary

ROPE_BLOCK = 1024  # positions per block of the cos/sin tables


def fit(model: Any) -> tuple[bool, str | None]:
    """Whether this forward runs `model` (a family it reproduces exactly: models/family.py),
    and why it cannot run it deterministically (None: it can), from one reading of its family."""
    try:
        fam = family(model.config)
    except Unsupported as exc:
        return False, f"{type(model).__name__}: {exc}"
    for key in set(fam.rope_keys):
        rope = rope_type(model.config, key)
        if rope not in STATIC_ROPE:
            return True, f"its RoPE variant {rope!r} rescales with the batch's longest sequence"
    return True, None


def paged_only(model: Any) -> bool:
    """A type no other runner serves (models/families.py): where the paged forward lacks a
    part of it, the model is refused."""
    kind = TYPES.get(getattr(model.config, "model_type", None) or "")
    return kind is not None and kind.paged_only


def deterministic_blocker(model: Any) -> str | None:
    """Why this model cannot run the deterministic forward (None: it can)."""
    return fit(model)[1]


@dataclass
class KVCache:
    """Paged KV storage: slot s = block * block_size + offset. `hidden` keeps each position's
    final-norm hidden state, so prompt logprobs of cached prefixes are recomputed exactly. A
    mixture of experts' cache also keeps each position's routing in its MoE layers (`experts`,
    `expert_weights`: the k experts its row was sent to and their weights), which a request
    that asks for its routed experts reads back (prefix-cached positions included). Where
    its layers differ in shape (Gemma 4), K and V are one tensor per cache layer."""

    k: torch.Tensor | list[torch.Tensor]  # [layers, slots, kv_heads, head_dim]
    v: torch.Tensor | list[torch.Tensor]
    hidden: torch.Tensor  # [slots, hidden_size]
    block_size: int
    experts: torch.Tensor | None = None  # int16 [slots, moe_layers, top_k]
    expert_weights: torch.Tensor | None = None  # float32 [slots, moe_layers, top_k]

    @staticmethod
    def bytes_per_token(config: Any) -> int:
        kv = sum(kvh * d for kvh, d in kv_shapes(config))
        moe_layers, top_k = _routing_shape(config)
        routing = (2 + 4) * moe_layers * top_k
        return 4 * (2 * kv + config.hidden_size) + routing

    @staticmethod
    def allocate(
        config: Any, num_blocks: int, block_size: int, device: torch.device | None = None
    ) -> KVCache:
        """Memory is taken from the OS as blocks are first written (torch.empty), except block
        0, the null block: zeros, never handed out, where masked key positions point. `device`:
        where it lives (the GPU path's device; default the host)."""
        slots = num_blocks * block_size
        shapes = kv_shapes(config)
        k: torch.Tensor | list[torch.Tensor]
        v: torch.Tensor | list[torch.Tensor]
        if len(set(shapes)) == 1:
            k, v = (torch.empty((len(shapes), slots, *shapes[0]), device=device) for _ in "kv")
        else:  # one tensor per cache layer
            k, v = ([torch.empty((slots, *s), device=device) for s in shapes] for _ in "kv")
        cache = KVCache(k, v, torch.empty(slots, config.hidden_size, device=device), block_size)
        moe_layers, top_k = _routing_shape(config)
        if moe_layers:
            routing = (slots, moe_layers, top_k)
            cache.experts = torch.zeros(routing, dtype=torch.int16, device=device)
            cache.expert_weights = torch.zeros(routing, device=device)
        for layer in [*cache.k, *cache.v]:
            layer[:block_size].zero_()
        cache.hidden[:block_size].zero_()
        return cache

    def routing(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing kept at `slots`: experts int16 [n, moe_layers, k], weights float32."""
        assert self.experts is not None and self.expert_weights is not None
        return self.experts.index_select(0, slots), self.expert_weights.index_select(0, slots)


def kv_shapes(config: Any) -> list[tuple[int, int]]:
    """(KV heads, head size) of each layer the cache keeps: every layer, a hybrid model's
    attention layers (its linear layers carry a recurrent state per sequence instead:
    models/deltanet.py), or (Gemma 4) each that writes its own K/V."""
    try:
        fam: Family | None = family(config)
    except Unsupported:
        fam = None
    if fam is not None and fam.gemma4 is not None:
        return fam.gemma4.cache_shapes()
    layers = fam.linear.count(False) if fam is not None and fam.linear else config.num_hidden_layers
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return [(int(config.num_key_value_heads), int(d))] * int(layers)


def state_shape(config: Any) -> StateShape | None:
    """A hybrid model's recurrent state (None: every layer attends over the KV cache)."""
    fam = family(config)
    return StateShape.of(config, fam.linear) if fam.hybrid else None


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


class _Tensors:
    """Layer `index`'s tensors by their names under its prefix, made the forward's own: norms
    copied, matrices packed by the backend."""

    def __init__(self, weights: Mapping[str, Weight], index: int, fam: Family, ops: LayerOps):
        self.weights, self.prefix, self.fam, self.ops = weights, f"model.layers.{index}.", fam, ops

    def has(self, name: str) -> bool:
        return self.prefix + name in self.weights

    def __getitem__(self, name: str) -> Weight:
        return self.weights[self.prefix + name]

    def norm(self, name: str) -> torch.Tensor | None:
        """The RMSNorm `name` as the forward multiplies by it (None: the layer has none)."""
        return norm_weight(self[name + ".weight"], self.fam) if self.has(name + ".weight") else None

    def vector(self, name: str) -> torch.Tensor | None:
        """A float32 vector (a bias, gpt-oss's sinks: contiguous, the kernels read it)."""
        return as_float(self[name]).float().contiguous() if self.has(name) else None

    def linear(self, *names: str) -> Linear | Joined:
        """The layers `names` as one projection, their rows one after another."""
        biases = [self.vector(f"{n}.bias") for n in names]
        return projection([self[f"{n}.weight"] for n in names], biases, self.ops)


def _expert(t: _Tensors, e: int, under: str) -> Expert:
    """Expert e: from transformers' stacked [E, 2I, H] and [E, H, I] parameters (views; a
    family whose checkpoints store them as columns has them made rows: models/families.py), or
    a GGUF file's rows of each expert (models/gguf_blocks.py names them per expert); `under`:
    their module ("mlp.experts.", Gemma 4's "experts.")."""
    if t.has(f"{under}gate_up_proj"):
        gate_up = as_float(t[f"{under}gate_up_proj"])[e]
        down = as_float(t[f"{under}down_proj"])[e]
        gu_bias, down_bias = (
            as_float(t[f"{under}{name}_bias"])[e] if t.has(f"{under}{name}_bias") else None
            for name in ("gate_up_proj", "down_proj")
        )
        if t.fam.column_experts:
            gate_up, gu_bias, down = column_expert_rows(gate_up, gu_bias, down)
        return Expert(Linear(gate_up, gu_bias, t.ops), Linear(down, down_bias, t.ops))
    at = f"{under}{e}."
    if t.has(f"{at}gate_up_proj.weight"):  # a file's fused [gate | up]
        return Expert(t.linear(at + "gate_up_proj"), t.linear(at + "down_proj"))
    return Expert(t.linear(at + "gate_proj", at + "up_proj"), t.linear(at + "down_proj"))


def _mixture(t: _Tensors) -> MoE:
    """A sparse layer's router and experts, the experts held as the backend runs them (taken
    one at a time: the GPU path stacks each as it is packed); Gemma 4's beside its dense MLP,
    its router's per-expert factor."""
    fam = t.fam
    if fam.gemma4 is not None:
        scale = t.vector("router.per_expert_scale")
        assert scale is not None
        under, router, factor = "experts.", t.linear("router.proj"), t.ops.place(scale.clone())
    else:
        under, factor = "mlp.experts.", None
        router = t.linear("mlp.router" if t.has("mlp.router.weight") else "mlp.gate")
    experts: Iterator[Expert] = (_expert(t, e, under) for e in range(fam.experts))
    run = t.ops.experts(experts, fam.experts)
    return MoE(router, run, fam.top_k, fam.norm_topk, factor)


class _Layer:
    def __init__(self, config: Any, index: int, t: _Tensors) -> None:
        """Layer `index`'s weights and constants."""
        fam = t.fam
        self.ln1 = norm_weight(t["input_layernorm.weight"], fam)
        # Llama: the norm before the MLP; Gemma: the norm of the attention's output
        self.ln2 = norm_weight(t["post_attention_layernorm.weight"], fam)
        self.pre_ff = t.norm("pre_feedforward_layernorm")
        self.post_ff = t.norm("post_feedforward_layernorm")
        self.window, self.rope_key = fam.windows[index], fam.rope_keys[index]
        # a hybrid model's linear layer (its recurrence in place of attention), or attention
        self.deltanet = _deltanet(config, index, t) if fam.linear and fam.linear[index] else None
        self.kv_index = index - sum(fam.linear[:index])  # its place among the K/V layers
        self.q_norm, self.k_norm = t.norm("self_attn.q_norm"), t.norm("self_attn.k_norm")
        self.qkv: Linear | Joined | None = None
        self.o: Linear | Joined | None = None
        if self.deltanet is None:
            # (a Gemma 4 layer reading another's cache has no k/v, one whose values are its
            # keys no v)
            qkv = [f"self_attn.{n}_proj" for n in "qkv" if t.has(f"self_attn.{n}_proj.weight")]
            self.qkv = t.linear("self_attn.qkv_proj") if fam.fused else t.linear(*qkv)
            self.o = t.linear("self_attn.o_proj")
        # gpt-oss: each head's sink logit
        sinks = t.vector("self_attn.sinks") if fam.sinks else None
        self.attention = LayerAttention(fam.scale, self.window, fam.attn_softcap, sinks)
        # the feed-forward: a mixture of experts, or the dense MLP
        self.moe: MoE | None = None
        self.gate_up: Linear | Joined | None = None
        self.down: Linear | Joined | None = None
        # this layer's place among the layers, and among the MoE layers (the routing a cache
        # keeps)
        self.index, self.moe_index = index, sum(fam.sparse[:index]) if fam.experts else 0
        # Qwen3.5-MoE: a shared expert's [gate | up], down, and its gate's single row
        self.shared: tuple[Linear | Joined, Linear | Joined, Linear | Joined] | None = None
        if fam.experts and fam.sparse[index]:
            self.moe = _mixture(t)
            self.intermediate = fam.expert_intermediate
            if fam.shared_expert:
                at = "mlp.shared_expert."
                self.shared = (
                    t.linear(at + "gate_proj", at + "up_proj"), t.linear(at + "down_proj"),
                    t.linear("mlp.shared_expert_gate"),
                )  # fmt: skip
        if self.moe is None or fam.gemma4 is not None:  # (Gemma 4's beside its experts)
            gate_up = ("mlp.gate_up_proj",) if fam.fused else ("mlp.gate_proj", "mlp.up_proj")
            self.gate_up, self.down = t.linear(*gate_up), t.linear("mlp.down_proj")
            self.intermediate = int(config.intermediate_size)

    def described(self, rope: int) -> LayerWeights:
        """This layer as the native call reads it (`rope`: its RoPE table's index)."""
        moe = self.moe
        assert self.qkv is not None and self.o is not None  # (no hybrid runs the native call)
        mixture = None
        if moe is not None:
            mixture = MoEWeights(
                moe.router.weights, moe.run, moe.top_k, moe.norm_topk, self.moe_index
            )
        return LayerWeights(
            ln1=self.ln1, ln2=self.ln2, qkv=self.qkv.weights, o=self.o.weights,
            gate_up=_weights(self.gate_up), down=_weights(self.down), pre_ff=self.pre_ff,
            post_ff=self.post_ff, q_norm=self.q_norm, k_norm=self.k_norm,
            window=int(self.window or 0), rope=rope, moe=mixture, sinks=self.attention.sinks,
        )  # fmt: skip


def _deltanet(config: Any, index: int, t: _Tensors) -> GatedDeltaNet:
    """Layer `index`'s Gated DeltaNet: its projections [q k v | z | b | a] held as one (Qwen3-
    Next's packed rows put in that order)."""
    fam, at = t.fam, "linear_attn."
    if fam.packed_linear and not t.has(at + "in_proj_qkv.weight"):  # (a GGUF file's: unpacked)
        qkvz, ba = _packed_rows(config)
        weights = [
            as_float(t[at + "in_proj_qkvz.weight"])[qkvz], as_float(t[at + "in_proj_ba.weight"])[ba]
        ]  # fmt: skip
        proj = projection(weights, [None, None], t.ops)
    else:
        proj = t.linear(at + "in_proj_qkv", at + "in_proj_z", at + "in_proj_b", at + "in_proj_a")
    out: Callable[[torch.Tensor], torch.Tensor] = t.linear(at + "out_proj")
    if getattr(config, "gguf_value_heads", None) == "tiled":  # its input in the file's order
        out = TiledInput(out, config)
    return GatedDeltaNet(
        sum(fam.linear[:index]), StateShape.of(config, fam.linear), proj,
        out, as_float(t[at + "conv1d.weight"]), as_float(t[at + "A_log"]),
        as_float(t[at + "dt_bias"]), as_float(t[at + "norm.weight"]), float(config.rms_norm_eps),
        t.ops,
    )  # fmt: skip


def _packed_rows(config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of Qwen3-Next's in_proj_qkvz (each key head's [q k v z], v and z its r = nv / nk
    value heads') in the order [q | k | v | z], and of in_proj_ba ([b a] per key head) as
    [b | a]: row permutations, the weights' values untouched."""
    nk, nv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
    r = nv // nk

    def part(width: int, at: int, size: int) -> torch.Tensor:
        return (torch.arange(nk)[:, None] * width + at + torch.arange(size)).reshape(-1)

    g, rv = 2 * dk + 2 * r * dv, r * dv
    qkvz = [part(g, 0, dk), part(g, dk, dk), part(g, 2 * dk, rv), part(g, 2 * dk + rv, rv)]
    return torch.cat(qkvz), torch.cat([part(2 * r, 0, r), part(2 * r, r, r)])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _weights(linear: Linear | Joined | None) -> list[Packed]:
    """A dense MLP's projection as the native call reads it (none in a mixture of experts)."""
    return [] if linear is None else linear.weights


def norm_weight(weight: Weight, fam: Family) -> torch.Tensor:
    """An RMSNorm's weight as the forward multiplies by it: Gemma's 1 + w (in float32, as
    transformers computes it), else w; a copy (a weight memory-mapped from safetensors may share
    one storage with the whole file, and the runner must not keep that mapping alive)."""
    w = as_float(weight).detach()
    return (1.0 + w.float()) if fam.norm_plus_one else w.clone()


def sample_matrix(model: Any, weights: Mapping[str, Weight] | None = None) -> torch.Tensor:
    """The matrix `--linear auto` times torch's products on: the first layer's MLP (a mixture
    of experts: its first attention's query matrix)."""
    fam = family(model.config)
    if weights is None:
        weights = dict(model.named_parameters(remove_duplicate=False))
    first = "model.layers.0.mlp."
    names = [first + "gate_proj.weight", first + "up_proj.weight"]
    if fam.fused:
        names = [first + "gate_up_proj.weight"]
    if fam.experts:  # (a hybrid model's first attention layer)
        first_attention = fam.linear.index(False) if fam.hybrid else 0
        names = [f"model.layers.{first_attention}.self_attn.q_proj.weight"]
    return as_float(stack_rows([weights[n] for n in names]))


class LlamaForward:
    def __init__(
        self,
        model: Any,
        ops: LayerOps,
        weights: Mapping[str, Weight] | None = None,
        op_by_op: bool = False,
    ) -> None:
        """`ops`: the backend's operations (kernels/layer_ops.py); where it chains the decoder
        layers in one native call a step (the row-invariant kernels), they run so unless
        `op_by_op` (the same kernels called one by one from Python: the reference the native
        call is tested against, bit for bit). `weights`: the tensors by parameter name where
        the model holds none of its own (a GGUF file's blocks, models/gguf_blocks.py: the
        backend keeps them or dequantizes them); default: the model's."""
        cfg = model.config
        self.ops = ops
        self.family = fam = family(cfg)
        if weights is None:  # (Gemma 4's layer scalars are buffers)
            weights = dict(model.named_buffers()) | dict(
                model.named_parameters(remove_duplicate=False)
            )
        self.model = model
        self.num_heads = cfg.num_attention_heads
        self.head_dim = fam.head_dim
        self.eps = float(cfg.rms_norm_eps)
        self.gemma4: Gemma4Layers | None = None
        if fam.gemma4 is not None:
            self.gemma4 = Gemma4Layers(
                weights, fam.gemma4, self.num_heads, int(cfg.hidden_size), self.eps, ops,
                experts=bool(fam.experts),
            )  # fmt: skip
        else:
            self.num_kv_heads = cfg.num_key_value_heads
        self.layers = [
            _Layer(cfg, i, _Tensors(weights, i, fam, ops)) for i in range(cfg.num_hidden_layers)
        ]
        self.norm = norm_weight(weights["model.norm.weight"], fam)
        self.embed_scale = (
            torch.tensor(fam.embed_scale, dtype=torch.float32) if fam.embed_scale else None
        )
        self._head(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
        self._rotaries(model)
        self.intermediate = self.layers[0].intermediate
        gelu = fam.activation == "gelu_tanh"
        self._act: Activation = ops.gelu_tanh_mul if gelu else ops.silu_mul
        self._expert_act: Activation = self._act
        if fam.swiglu_limit is not None:  # gpt-oss's clamped SwiGLU in its experts
            glu = partial(ops.gpt_oss_glu, alpha=fam.swiglu_alpha, limit=fam.swiglu_limit)
            self._expert_act = glu
        keys = list(self.rotary)
        self.native = None
        if not op_by_op and self.gemma4 is None and not fam.hybrid:  # (Gemma 4's layers, and a
            # hybrid model's recurrent ones, run op by op)
            described = [layer.described(keys.index(layer.rope_key)) for layer in self.layers]
            self.native = ops.chain(self._shape(), described)
        # a partial rotary (Qwen3.5) is applied here; the backend's RoPE then an identity
        d = self.head_dim
        self._identity = (ops.place(torch.ones(1, d)), ops.place(torch.zeros(1, d)))

    def _head(self, head: Weight, embed: Weight) -> None:
        """The head, and the embedding: a tied one is read from the head's own copy (dense,
        packed panels or blocks: the weight is held once) where the backend reads its rows;
        an untied one (or beside oneDNN's blocked head) keeps its own, in its blocks where the
        backend keeps blocks, else a float32 table where the operations run."""
        self.lm_head = Linear(head, None, self.ops)
        same = head is embed or (
            isinstance(head, torch.Tensor)
            and isinstance(embed, torch.Tensor)
            and head.data_ptr() == embed.data_ptr()
        )
        self.tied = same and self.ops.reads_rows
        self.embed: torch.Tensor | Packed | None = None
        blocks = self.ops.keeps_blocks and not isinstance(embed, torch.Tensor)
        if not self.tied and blocks:
            self.embed = self.ops.pack(embed)  # its own blocks, read by `rows`
        elif not self.tied:
            self.embed = self.ops.place(as_float(embed).detach().clone())
        self.vocab_size = self.lm_head.out_features

    def _rotaries(self, model: Any) -> None:
        """A rotary embedding per entry of rope_parameters (Gemma 3: one per layer type); the
        model's own module where its variant is not static (dynamic: computed at each step's
        positions), else cos/sin tables grown ROPE_BLOCK positions at a time."""
        cfg = model.config
        self.rotary: dict[str | None, Any] = {}
        self._dynamic: set[str | None] = set()
        dims: dict[str | None, int] = {}
        for key in set(self.family.rope_keys):
            # Gemma 4: each layer type's view of the configuration (its head size)
            source = cfg.per_layer_config[key] if self.gemma4 is not None else cfg
            dims[key] = self.head_dim
            if rope_type(cfg, key) in STATIC_ROPE:
                self.rotary[key] = Rotary(source, key)
                dims[key] = 2 * self.rotary[key].inv_freq.numel()
            else:
                self.rotary[key] = model.model.rotary_emb
                self._dynamic.add(key)
        widths = {key: self.family.rotary_dim or dims[key] for key in self.rotary}
        self._rope_cos = {key: torch.empty((0, widths[key])) for key in self.rotary}
        self._rope_sin = {key: torch.empty((0, widths[key])) for key in self.rotary}

    def _shape(self) -> Shape:
        fam = self.family
        return Shape(
            hidden=int(self.model.config.hidden_size), heads=self.num_heads,
            kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate=max(layer.intermediate for layer in self.layers), eps=self.eps,
            scale=float(fam.scale), softcap=float(fam.attn_softcap or 0.0),
            sandwich=fam.sandwich, gelu=fam.activation == "gelu_tanh",
            swiglu_alpha=fam.swiglu_alpha, swiglu_limit=float(fam.swiglu_limit or 0.0),
            qk_full=fam.qk_norm_full,
        )  # fmt: skip

    def release_source(self) -> None:
        """Drop the transformers model: every weight the forward uses is a copy held here (the
        rotary module alone is kept, and it holds no weights)."""
        self.model = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        cache: KVCache,
        spans: Sequence[Span] = (),
    ) -> torch.Tensor:
        """Runs the packed tokens; writes their K/V and final hidden states into `cache`;
        returns the final-norm hidden states [T, H]. `spans`: a hybrid model's sequences in the
        step, each with its recurrent state (models/deltanet.py), carried past its rows."""
        h = self._embed(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        rope = self._rope(h, positions, plan)
        per_layer = self.gemma4.inputs(input_ids, h) if self.gemma4 is not None else None
        if self.native is not None:
            assert isinstance(cache.k, torch.Tensor) and isinstance(cache.v, torch.Tensor)
            routed = None
            if cache.experts is not None and cache.expert_weights is not None:
                routed = (cache.experts, cache.expert_weights)
            h = self.native.run(
                h.contiguous(), positions, plan.slots, *plan.by_table(), cache.block_size,
                cache.k, cache.v, [(cos, sin) for cos, sin, _ in rope.values()], routed,
            )  # fmt: skip
        else:
            for li, layer in enumerate(self.layers):
                h = self._layer(h, li, layer, rope[layer.rope_key], plan, cache, spans)
                if self.gemma4 is not None:
                    h = self.gemma4.after(h, li, per_layer)
        out = self._norm(h, self.norm)
        cache.hidden.index_copy_(0, plan.slots, out)
        return out

    def _layer(
        self,
        h: torch.Tensor,
        li: int,
        layer: _Layer,
        rope: Rope,
        plan: AttentionPlan,
        cache: KVCache,
        spans: Sequence[Span],
    ) -> torch.Tensor:
        """One decoder layer over the step's rows h, its K/V written at their slots (a linear
        layer: its sequences' states carried past their rows)."""
        x = self._norm(h, layer.ln1)
        if layer.deltanet is not None:
            attn = layer.deltanet(x, spans)
        else:
            attn = self._attention(x, li, layer, rope, plan, cache)
        if self.family.sandwich:
            assert layer.pre_ff is not None and layer.post_ff is not None
            h = h + self._norm(attn, layer.ln2)
            x = self._norm(h, layer.pre_ff)
            return h + self._norm(self._ffn(layer, x, cache, plan.slots, h), layer.post_ff)
        h = h + attn
        return h + self._ffn(layer, self._norm(h, layer.ln2), cache, plan.slots, h)

    def _attention(
        self,
        x: torch.Tensor,
        li: int,
        layer: _Layer,
        rope: Rope,
        plan: AttentionPlan,
        cache: KVCache,
    ) -> torch.Tensor:
        """Layer li's attention output for normed rows x (Gemma 4's: its own shapes, perhaps
        another layer's cache; Qwen3.5's: its output gated, RoPE on part of each head)."""
        assert layer.qkv is not None and layer.o is not None
        if self.gemma4 is not None:
            kv = self.gemma4.kv(li, cache.k, cache.v, cache.block_size)
            q = self.gemma4.queries(x, li, layer, rope, plan.slots, kv)
            return layer.o(self.ops.attend(q, kv, plan, layer.attention))
        qkv = layer.qkv(x)
        gate = None
        if self.family.attn_gate:
            qkv, gate = self._split_gate(qkv)
        if layer.q_norm is not None and layer.k_norm is not None:
            qkv = self._qk_norm(qkv, layer.q_norm, layer.k_norm)
        kv = LayerKV(cache.k[layer.kv_index], cache.v[layer.kv_index], cache.block_size)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        if 0 < self.family.rotary_dim < self.head_dim:
            qkv = self._partial_rope(qkv, rope)
            rows = torch.zeros(qkv.shape[0], dtype=torch.long, device=qkv.device)
            rope = (*self._identity, rows)
        q = self.ops.rotate(qkv, heads, rope, plan.slots, kv)
        out = self.ops.attend(q, kv, plan, layer.attention)
        if gate is not None:
            out = out * sigmoid_rows(gate)
        return layer.o(out)

    def _split_gate(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A gated query projection's [q_h | gate_h] per head: (q k v, the gates [T, nq d])."""
        t, nq, d = qkv.shape[0], self.num_heads, self.head_dim
        both = qkv[:, : 2 * nq * d].reshape(t, nq, 2 * d)
        q, gate = both[..., :d].reshape(t, nq * d), both[..., d:].reshape(t, nq * d)
        return torch.cat([q, qkv[:, 2 * nq * d :]], dim=1), gate

    def _partial_rope(self, qkv: torch.Tensor, rope: Rope) -> torch.Tensor:
        """RoPE on the first `rotary_dim` dimensions of each query and key head (exact per
        element: x * cos + rotate_half(x) * sin), the rest as they are."""
        t, nq, nkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        r = self.family.rotary_dim
        cos, sin, positions = rope
        c = cos.to(qkv.device).index_select(0, positions).unsqueeze(1)
        s = sin.to(qkv.device).index_select(0, positions).unsqueeze(1)
        qk = qkv[:, : (nq + nkv) * d].reshape(t, nq + nkv, d)
        part = qk[..., :r]
        turned = torch.cat([part * c + _rotate_half(part) * s, qk[..., r:]], dim=-1)
        return torch.cat([turned.reshape(t, -1), qkv[:, (nq + nkv) * d :]], dim=1)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids' rows: the head's (a tied embedding), the embedding's float32 table, or its
        own packed blocks."""
        if self.embed is None:
            return self.ops.rows(self.lm_head.held, ids)
        if isinstance(self.embed, torch.Tensor):
            return F.embedding(ids, self.embed)
        return self.ops.rows(self.embed, ids)

    def _norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(h, weight, self.eps)

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
        self, layer: _Layer, x: torch.Tensor, cache: KVCache, slots: torch.Tensor, h: torch.Tensor
    ) -> torch.Tensor:
        """The feed-forward of normed rows x (h: the residual they were normed from): the
        layer's experts (their routing kept at the rows' slots; Gemma 4's beside its MLP), or
        its MLP."""
        if layer.moe is None:
            return self._mlp(layer, x)
        rows, routed = x, None
        if self.gemma4 is not None:  # its experts and router read the residual, normed anew
            rows, routed = self.gemma4.expert_rows(h, layer.index)
        out, ids, weights = layer.moe(rows, self._expert_act, self.ops, routed)
        if cache.experts is not None and cache.expert_weights is not None:
            cache.experts[:, layer.moe_index].index_copy_(0, slots, ids.to(torch.int16))
            cache.expert_weights[:, layer.moe_index].index_copy_(0, slots, weights.float())
        if layer.shared is not None:  # + sigmoid(gate(x)) * the shared expert's SwiGLU
            gate_up, down, gate = layer.shared
            out = out + sigmoid_rows(gate(x)) * down(self._act(gate_up(x)))
        if self.gemma4 is not None:
            return self.gemma4.beside(self._mlp(layer, x), out, layer.index)
        return out

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        assert layer.gate_up is not None and layer.down is not None
        return layer.down(self._act(layer.gate_up(x)))

    def _rope(
        self, h: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan
    ) -> dict[str | None, Rope]:
        """Each rotary's (cos, sin, rows) for the step: its tables and the tokens' positions, or
        (a dynamic RoPE) the step's own rows, computed at its positions."""
        if plan.max_position is not None:  # no wait on the device to read it back
            need = plan.max_position + 1
        else:
            need = int(positions.max()) + 1 if positions.numel() else 0
        self._rope_table(h, need)
        found = {}
        for key, rotary in self.rotary.items():
            if key in self._dynamic:
                cos, sin = rotary(h, positions.unsqueeze(0))
                found[key] = (cos[0], sin[0], torch.arange(positions.numel()))
            else:
                found[key] = (self._rope_cos[key], self._rope_sin[key], positions)
        return found

    def rope_tables(self) -> list[torch.Tensor]:
        """The cos and sin tables as they are now (the GPU path's CUDA graphs hold them, so the
        device copies their replays read stay alive)."""
        return [*self._rope_cos.values(), *self._rope_sin.values()]

    def _rope_table(self, h: torch.Tensor, need: int) -> None:
        """The static rotaries' cos and sin tables, grown to cover positions 0..need-1 in blocks
        of ROPE_BLOCK positions (each block one call of one shape, so a position's row never
        depends on what else is in the step); the operations read their rows."""
        for key, rotary in self.rotary.items():
            have = self._rope_cos[key].shape[0]
            if have >= need or key in self._dynamic:
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

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(hidden)
        cap = self.family.final_softcap
        return self.ops.softcap(out, cap) if cap else out
