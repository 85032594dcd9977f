"""A reduced Qwen3-30B-A3B GGUF for the mixture-of-experts race: the true model's layer (hidden
2048, 32 query heads and 4 KV heads of 128, q/k head norms, 128 experts of width 768, 8 routed a
token, renormalised), fewer layers (6 of 48: a ~2 GB Q4_K_M file that fits this machine beside a
peer), random weights and the embedded model's tokenizer (vocabulary 49152, so every server
tokenizes the same), built the way ../shared/models/make_tinyshape.py builds its 1.1B shape (its
metadata copy and its seeded N(0, 0.02) values, one generator a tensor): an F16 file, then
llama-quantize's Q4_K_M.

    .venv/bin/python bench/make_moe_shape.py --out /tmp/shapemoe --llama-bin BINDIR [--layers 6]

BINDIR is the folder of the llama-server binary ../shared/peers/llama_server.sh prints
(llama-quantize lies beside it). Run alone on the machine; the F16 file can be deleted after.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

ROOT = Path(__file__).resolve().parent.parent
BUILDER = ROOT.parent / "shared" / "models" / "make_tinyshape.py"

# Qwen3-30B-A3B's config.json, the embedded tokenizer's vocabulary
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, USED, EXPERT_FFN, CTX, THETA, EPS, VOCAB = 128, 8, 768, 8192, 1000000.0, 1e-6, 49152


def builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_tinyshape", BUILDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def overrides(layers: int) -> dict[str, tuple[object, GGUFValueType]]:
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    return {
        "qwen3moe.context_length": (CTX, u32),
        "qwen3moe.embedding_length": (HIDDEN, u32),
        "qwen3moe.block_count": (layers, u32),
        "qwen3moe.feed_forward_length": (6144, u32),
        "qwen3moe.expert_feed_forward_length": (EXPERT_FFN, u32),
        "qwen3moe.expert_count": (EXPERTS, u32),
        "qwen3moe.expert_used_count": (USED, u32),
        "qwen3moe.attention.head_count": (HEADS, u32),
        "qwen3moe.attention.head_count_kv": (KV_HEADS, u32),
        "qwen3moe.attention.key_length": (HEAD_DIM, u32),
        "qwen3moe.attention.value_length": (HEAD_DIM, u32),
        "qwen3moe.rope.freq_base": (THETA, f32),
        "qwen3moe.attention.layer_norm_rms_epsilon": (EPS, f32),
        "general.name": (
            f"shape-qwen3moe-random (Qwen3-30B-A3B layer, {layers} layers, SmolLM2 tokenizer)",
            GGUFValueType.STRING,
        ),
    }


def plan(layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind): kind "norm" (1.0, float32), "router" (float32) or "matrix"
    (F16), in llama.cpp's names."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (VOCAB, HIDDEN), "matrix")]
    for i in range(layers):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (HIDDEN,), "norm"),
            (p + "attn_q.weight", (q, HIDDEN), "matrix"),
            (p + "attn_k.weight", (kv, HIDDEN), "matrix"),
            (p + "attn_v.weight", (kv, HIDDEN), "matrix"),
            (p + "attn_output.weight", (HIDDEN, q), "matrix"),
            (p + "attn_q_norm.weight", (HEAD_DIM,), "norm"),
            (p + "attn_k_norm.weight", (HEAD_DIM,), "norm"),
            (p + "ffn_norm.weight", (HIDDEN,), "norm"),
            (p + "ffn_gate_inp.weight", (EXPERTS, HIDDEN), "router"),
            (p + "ffn_gate_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), "matrix"),
            (p + "ffn_up_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), "matrix"),
            (p + "ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FFN), "matrix"),
        ]
    out += [("output_norm.weight", (HIDDEN,), "norm"), ("output.weight", (VOCAB, HIDDEN), "matrix")]
    return out


def write_f16(shape: ModuleType, path: Path, layers: int) -> None:
    fields = GGUFReader(shape.default_source()).fields
    setattr(shape, "OVERRIDES", overrides(layers))  # noqa: B010 (its module constant)
    tmp = path.with_name(f".{path.name}.tmp")
    writer = GGUFWriter(str(tmp), arch="qwen3moe")
    # tokenizer.* and general.* (but the source's architecture: the writer's), then the overrides
    kept = {k: v for k, v in fields.items() if k != "general.architecture"}
    source = SimpleNamespace(fields=kept)
    shape.copy_metadata(source, writer, 1)
    tensors = plan(layers)
    for name, dims, kind in tensors:
        dtype = np.dtype(np.float16) if kind == "matrix" else np.dtype(np.float32)
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    t0 = time.time()
    for i, (name, dims, kind) in enumerate(tensors):
        values = shape.tensor_values(i, dims, kind == "norm")
        writer.write_tensor_data(values.astype(np.float16) if kind == "matrix" else values)
        del values
        print(f"  {name} ({time.time() - t0:.0f}s)", flush=True)
    writer.close()
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder of the files")
    ap.add_argument("--llama-bin", required=True, help="folder holding llama-quantize")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", default="2")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "shapemoe-f16.gguf"
    if not f16.exists():
        write_f16(builder(), f16, args.layers)
    target = out / "shapemoe-q4_k_m.gguf"
    env = {**os.environ, "LD_LIBRARY_PATH": args.llama_bin}
    quantize = [str(Path(args.llama_bin) / "llama-quantize"), str(f16), str(target), "Q4_K_M"]
    done = subprocess.run([*quantize, args.threads], env=env, check=False)
    if done.returncode != 0:
        return done.returncode
    print(f"wrote {target} ({target.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
