"""A Gemma 4 GGUF file for measuring: Gemma 4 E2B's text model at its true dimensions (hidden
1536, 35 layers of which the last 20 read an earlier layer's KV cache, four sliding layers of 8
query heads and 1 KV head of 256 to each full layer of 512, MLPs of 6144 doubled in the shared
layers, per-layer input embeddings of 256 a layer, soft-capped logits), random weights and the
embedded model's tokenizer (vocabulary 49152, so every server tokenizes the same; the true
vocabulary is 262144), written the way llama.cpp's converter writes Gemma 4 (arch `gemma4`:
its metadata keys and arrays, a rope_freqs tensor marking the full layers' unrotated pairs,
gguf's tensor names for transformers', norms as they are) as an F16 file with
../shared/models/make_tinyshape.py's seeded N(0, 0.02) values, then quantized to Q4_K_M with
llama-quantize (shapegemma4-q4_k_m.gguf).

    .venv/bin/python bench/make_gemma4_shape.py --out /tmp/shapegemma4 --llama-bin BINDIR

BINDIR is the folder of the llama-server binary ../shared/peers/llama_server.sh prints
(llama-quantize lies beside it). Run alone on the machine; the F16 file can be deleted after.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
from gguf import MODEL_ARCH, GGUFReader, GGUFValueType, GGUFWriter, get_tensor_name_map
from shape_files import quantize, write_tensors

ROOT = Path(__file__).resolve().parent.parent
BUILDER = ROOT.parent / "shared" / "models" / "make_tinyshape.py"
VOCAB = 49152  # the embedded tokenizer's
FILE = "shapegemma4-q4_k_m.gguf"

# google/gemma-4-E2B's text_config
HIDDEN, LAYERS, HEADS, KV_HEADS = 1536, 35, 8, 1
HEAD_DIM, GLOBAL_HEAD_DIM, FFN, PER_LAYER = 256, 512, 6144, 256
SHARED_KV, WINDOW, SOFTCAP, EPS = 20, 512, 30.0, 1e-6
TYPES = (["sliding_attention"] * 4 + ["full_attention"]) * 7
ROPE_THETA, ROPE_THETA_SWA, FULL_ROTARY = 1_000_000.0, 10_000.0, 0.25
Tensor = tuple[str, tuple[int, ...], str]  # gguf name, numpy shape, kind


def builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_tinyshape", BUILDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def overrides() -> dict[str, tuple[object, GGUFValueType]]:
    """The converter's scalar gemma4.* keys (its per-layer arrays: `arrays`)."""
    u32, f32, text = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    keys: dict[str, tuple[object, GGUFValueType]] = {
        "block_count": (LAYERS, u32),
        "context_length": (131072, u32),
        "embedding_length": (HIDDEN, u32),
        "attention.head_count": (HEADS, u32),
        "attention.head_count_kv": (KV_HEADS, u32),
        "rope.freq_base": (ROPE_THETA, f32),
        "rope.freq_base_swa": (ROPE_THETA_SWA, f32),
        "attention.layer_norm_rms_epsilon": (EPS, f32),
        "attention.key_length": (GLOBAL_HEAD_DIM, u32),
        "attention.value_length": (GLOBAL_HEAD_DIM, u32),
        "attention.key_length_swa": (HEAD_DIM, u32),
        "attention.value_length_swa": (HEAD_DIM, u32),
        "final_logit_softcapping": (SOFTCAP, f32),
        "attention.sliding_window": (WINDOW, u32),
        "attention.shared_kv_layers": (SHARED_KV, u32),
        "embedding_length_per_layer_input": (PER_LAYER, u32),
        "rope.dimension_count": (GLOBAL_HEAD_DIM, u32),
        "rope.dimension_count_swa": (HEAD_DIM, u32),
    }
    out = {f"gemma4.{k}": v for k, v in keys.items()}
    out["general.name"] = (
        f"shape-gemma4-random (Gemma 4 E2B text, {LAYERS} layers, SmolLM2 tokenizer)",
        text,
    )
    return out


def arrays() -> dict[str, list[int] | list[bool]]:
    """The converter's per-layer arrays: each layer's sliding flag, and each layer's MLP width
    (use_double_wide_mlp: the shared layers' doubled)."""
    first_shared = LAYERS - SHARED_KV
    return {
        "gemma4.attention.sliding_window_pattern": [t == "sliding_attention" for t in TYPES],
        "gemma4.feed_forward_length": [
            FFN * (2 if i >= first_shared else 1) for i in range(LAYERS)
        ],
    }


def plan() -> list[Tensor]:
    """(gguf name, numpy shape, kind) of every tensor, named through gguf's map from
    transformers' names as the converter maps them; kind "norm" (1.0, float32: the norms and
    layer scalars), "freqs" (rope_freqs) or "matrix" (F16)."""
    names = get_tensor_name_map(MODEL_ARCH.GEMMA4, LAYERS)
    first_shared = LAYERS - SHARED_KV
    hf: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (VOCAB, HIDDEN), "matrix"),
        ("model.embed_tokens_per_layer.weight", (VOCAB, LAYERS * PER_LAYER), "matrix"),
        ("model.per_layer_model_projection.weight", (LAYERS * PER_LAYER, HIDDEN), "matrix"),
        ("model.per_layer_projection_norm.weight", (PER_LAYER,), "norm"),
    ]
    for i, kind in enumerate(TYPES):
        at = f"model.layers.{i}."
        d = GLOBAL_HEAD_DIM if kind == "full_attention" else HEAD_DIM
        ffn = FFN * (2 if i >= first_shared else 1)
        hf += [
            (at + "input_layernorm.weight", (HIDDEN,), "norm"),
            (at + "self_attn.q_proj.weight", (HEADS * d, HIDDEN), "matrix"),
            (at + "self_attn.q_norm.weight", (d,), "norm"),
        ]
        if i < first_shared:  # the shared layers have no K/V of their own
            hf += [
                (at + "self_attn.k_proj.weight", (KV_HEADS * d, HIDDEN), "matrix"),
                (at + "self_attn.k_norm.weight", (d,), "norm"),
                (at + "self_attn.v_proj.weight", (KV_HEADS * d, HIDDEN), "matrix"),
            ]
        hf += [
            (at + "self_attn.o_proj.weight", (HIDDEN, HEADS * d), "matrix"),
            (at + "post_attention_layernorm.weight", (HIDDEN,), "norm"),
            (at + "pre_feedforward_layernorm.weight", (HIDDEN,), "norm"),
            (at + "mlp.gate_proj.weight", (ffn, HIDDEN), "matrix"),
            (at + "mlp.up_proj.weight", (ffn, HIDDEN), "matrix"),
            (at + "mlp.down_proj.weight", (HIDDEN, ffn), "matrix"),
            (at + "post_feedforward_layernorm.weight", (HIDDEN,), "norm"),
            (at + "per_layer_input_gate.weight", (PER_LAYER, HIDDEN), "matrix"),
            (at + "per_layer_projection.weight", (HIDDEN, PER_LAYER), "matrix"),
            (at + "post_per_layer_input_norm.weight", (HIDDEN,), "norm"),
            (at + "layer_scalar.weight", (1,), "norm"),  # (the converter adds .weight)
        ]
    hf.append(("model.norm.weight", (HIDDEN,), "norm"))
    out: list[Tensor] = [("rope_freqs.weight", (GLOBAL_HEAD_DIM // 2,), "freqs")]
    for name, dims, kind in hf:
        base, _, suffix = name.rpartition(".")
        mapped = names.get_name(base)
        if mapped is None:
            raise KeyError(f"gguf has no gemma4 name for {name}")
        out.append((f"{mapped}.{suffix}", dims, kind))
    return out  # (tied: no output.weight)


def rope_freqs() -> np.ndarray:
    """1.0 for each pair the full layers' proportional RoPE rotates, 1e30 for the others."""
    half = GLOBAL_HEAD_DIM // 2
    rotated = int(GLOBAL_HEAD_DIM * FULL_ROTARY / 2)
    return np.array([1.0] * rotated + [1e30] * (half - rotated), dtype=np.float32)


def write_f16(maker: ModuleType, path: Path) -> None:
    fields = GGUFReader(maker.default_source()).fields
    setattr(maker, "OVERRIDES", overrides())  # noqa: B010 (its module constant)
    tmp = path.with_name(f".{path.name}.tmp")
    writer = GGUFWriter(str(tmp), arch="gemma4")
    # tokenizer.* and general.* (but the source's architecture: the writer's), then the overrides
    kept = {k: v for k, v in fields.items() if k != "general.architecture"}
    maker.copy_metadata(SimpleNamespace(fields=kept), writer, 1)
    for key, values in arrays().items():
        writer.add_array(key, values)
    tensors = plan()

    def write_one(i: int, dims: tuple[int, ...], kind: str) -> None:
        freqs = kind == "freqs"
        values = rope_freqs() if freqs else maker.tensor_values(i, dims, kind == "norm")
        writer.write_tensor_data(values.astype(np.float16) if kind == "matrix" else values)

    write_tensors(writer, tensors, write_one, tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder of the files")
    ap.add_argument("--llama-bin", required=True, help="folder holding llama-quantize")
    ap.add_argument("--threads", default="2")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "shapegemma4-f16.gguf"
    if not f16.exists():
        write_f16(builder(), f16)
    target = out / FILE
    return quantize(f16, target, "Q4_K_M", args.llama_bin, args.threads)


if __name__ == "__main__":
    sys.exit(main())
