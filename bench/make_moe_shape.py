"""Reduced mixture-of-experts GGUF files for the MoE race: a true model's layer with fewer layers,
random weights and the embedded model's tokenizer (vocabulary 49152, so every server tokenizes the
same), built the way ../shared/models/make_tinyshape.py builds its 1.1B shape (its metadata copy
and its seeded N(0, 0.02) values, one generator a tensor): an F16 file, then llama-quantize.

- `--shape qwen3moe`: Qwen3-30B-A3B's layer (hidden 2048, 32 query heads and 4 KV heads of 128,
  q/k head norms, 128 experts of width 768, 8 routed a token, renormalised), 6 of 48 layers: a
  ~2.2 GB Q4_K_M file (shapemoe-q4_k_m.gguf).
- `--shape gpt-oss`: gpt-oss-20b's layer (hidden 2880, 64 query heads and 8 KV heads of 64 with
  biases and a sink each, 32 experts of width 2880 with biases, 4 routed a token, a biased
  router, alternating 128-token windows, YaRN x32 from 4096), 4 of 24 layers: MXFP4_MOE (the
  experts MXFP4, as gpt-oss ships them; the rest Q8_0), shapegptoss-mxfp4.gguf.

    .venv/bin/python bench/make_moe_shape.py --out /tmp/shapemoe --llama-bin BINDIR [--shape S]

BINDIR is the folder of the llama-server binary ../shared/peers/llama_server.sh prints
(llama-quantize lies beside it). Run alone on the machine; the F16 file can be deleted after.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from shape_files import quantize, write_tensors

ROOT = Path(__file__).resolve().parent.parent
BUILDER = ROOT.parent / "shared" / "models" / "make_tinyshape.py"
VOCAB = 49152  # the embedded tokenizer's
Tensor = tuple[str, tuple[int, ...], str]  # name, numpy shape, kind


@dataclass(frozen=True)
class Shape:
    """One model's layer: its GGUF architecture, dimensions, the layers kept by default and
    llama-quantize's type for it."""

    arch: str
    file: str  # the quantized file's name
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    used: int
    expert_ffn: int
    layers: int
    quant: str
    gpt_oss: bool = False


SHAPES = {
    "qwen3moe": Shape(
        "qwen3moe", "shapemoe-q4_k_m.gguf", 2048, 32, 4, 128, 128, 8, 768, 6, "Q4_K_M"
    ),
    "gpt-oss": Shape(
        "gpt-oss", "shapegptoss-mxfp4.gguf", 2880, 64, 8, 64, 32, 4, 2880, 4, "MXFP4_MOE", True
    ),
}


def builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_tinyshape", BUILDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def overrides(shape: Shape, layers: int) -> dict[str, tuple[object, GGUFValueType]]:
    u32, f32, text = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    keys: dict[str, tuple[object, GGUFValueType]] = {
        "embedding_length": (shape.hidden, u32),
        "block_count": (layers, u32),
        "expert_feed_forward_length": (shape.expert_ffn, u32),
        "expert_count": (shape.experts, u32),
        "expert_used_count": (shape.used, u32),
        "attention.head_count": (shape.heads, u32),
        "attention.head_count_kv": (shape.kv_heads, u32),
        "attention.key_length": (shape.head_dim, u32),
        "attention.value_length": (shape.head_dim, u32),
    }
    if shape.gpt_oss:  # gpt-oss-20b's config.json
        keys |= {
            "context_length": (131072, u32),
            "feed_forward_length": (shape.expert_ffn, u32),
            "rope.freq_base": (150000.0, f32),
            "attention.layer_norm_rms_epsilon": (1e-5, f32),
            "attention.sliding_window": (128, u32),
            "rope.scaling.type": ("yarn", text),
            "rope.scaling.factor": (32.0, f32),
            "rope.scaling.original_context_length": (4096, u32),
        }
        name = "gpt-oss-20b"
    else:  # Qwen3-30B-A3B's
        keys |= {
            "context_length": (8192, u32),
            "feed_forward_length": (6144, u32),
            "rope.freq_base": (1000000.0, f32),
            "attention.layer_norm_rms_epsilon": (1e-6, f32),
        }
        name = "Qwen3-30B-A3B"
    out = {f"{shape.arch}.{k}": v for k, v in keys.items()}
    out["general.name"] = (
        f"shape-{shape.arch}-random ({name} layer, {layers} layers, SmolLM2 tokenizer)",
        text,
    )
    return out


def plan(shape: Shape, layers: int) -> list[Tensor]:
    """(name, numpy shape, kind): kind "norm" (1.0, float32), "vector" (a router, bias or sink:
    float32) or "matrix" (F16), in llama.cpp's names."""
    h, e, f = shape.hidden, shape.experts, shape.expert_ffn
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: list[Tensor] = [("token_embd.weight", (VOCAB, h), "matrix")]
    for i in range(layers):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (h,), "norm"),
            (p + "attn_q.weight", (q, h), "matrix"),
            (p + "attn_k.weight", (kv, h), "matrix"),
            (p + "attn_v.weight", (kv, h), "matrix"),
            (p + "attn_output.weight", (h, q), "matrix"),
        ]
        if shape.gpt_oss:
            out += [
                (p + "attn_q.bias", (q,), "vector"),
                (p + "attn_k.bias", (kv,), "vector"),
                (p + "attn_v.bias", (kv,), "vector"),
                (p + "attn_output.bias", (h,), "vector"),
                (p + "attn_sinks.weight", (shape.heads,), "vector"),
                (p + "post_attention_norm.weight", (h,), "norm"),
                (p + "ffn_gate_inp.weight", (e, h), "vector"),
                (p + "ffn_gate_inp.bias", (e,), "vector"),
            ]
        else:
            out += [
                (p + "attn_q_norm.weight", (shape.head_dim,), "norm"),
                (p + "attn_k_norm.weight", (shape.head_dim,), "norm"),
                (p + "ffn_norm.weight", (h,), "norm"),
                (p + "ffn_gate_inp.weight", (e, h), "vector"),
            ]
        for which, dims in (("gate", (f, h)), ("up", (f, h)), ("down", (h, f))):
            out.append((p + f"ffn_{which}_exps.weight", (e, *dims), "matrix"))
            if shape.gpt_oss:
                out.append((p + f"ffn_{which}_exps.bias", (e, dims[0]), "vector"))
    out += [("output_norm.weight", (h,), "norm"), ("output.weight", (VOCAB, h), "matrix")]
    return out


def write_f16(maker: ModuleType, shape: Shape, path: Path, layers: int) -> None:
    fields = GGUFReader(maker.default_source()).fields
    setattr(maker, "OVERRIDES", overrides(shape, layers))  # noqa: B010 (its module constant)
    tmp = path.with_name(f".{path.name}.tmp")
    writer = GGUFWriter(str(tmp), arch=shape.arch)
    # tokenizer.* and general.* (but the source's architecture: the writer's), then the overrides
    kept = {k: v for k, v in fields.items() if k != "general.architecture"}
    source = SimpleNamespace(fields=kept)
    maker.copy_metadata(source, writer, 1)
    tensors = plan(shape, layers)

    def write_one(i: int, dims: tuple[int, ...], kind: str) -> None:
        values = maker.tensor_values(i, dims, kind == "norm")
        writer.write_tensor_data(values.astype(np.float16) if kind == "matrix" else values)

    write_tensors(writer, tensors, write_one, tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder of the files")
    ap.add_argument("--llama-bin", required=True, help="folder holding llama-quantize")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3moe")
    ap.add_argument("--layers", type=int, help="layers kept (default: the shape's)")
    ap.add_argument("--threads", default="2")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    layers = args.layers or shape.layers
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"{shape.file.split('-')[0]}-f16.gguf"
    if not f16.exists():
        write_f16(builder(), shape, f16, layers)
    target = out / shape.file
    return quantize(f16, target, shape.quant, args.llama_bin, args.threads)


if __name__ == "__main__":
    sys.exit(main())
