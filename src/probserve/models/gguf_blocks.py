"""A GGUF file's weights in the file's own blocks: what `--weights native` serves.

transformers' GGUF loader dequantizes every tensor to float32; here the tensors of the block
formats probserve's kernels multiply directly (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
MXFP4: kernels/quantized.cpp, their table in kernels/qlayout.py) stay as the file's bytes; the
matrices of other formats are cached as the file's bytes too and dequantized as transformers does
when they are served (`served`), and the vectors (norms) are float32. Names and the q/k row order
come from transformers' own GGUF mapping and tensor processor (the processor's row permutation
moves whole rows, so it applies to rows of blocks unchanged).
So a dequantized `QuantizedTensor` is bit for bit the tensor `from_pretrained(gguf_file=...)`
gives, and the quantized forward computes the float32 forward's numbers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probserve.kernels.qlayout import FORMATS
from probserve.models import gguf_hybrid
from probserve.models.gguf_once import release_pages
from probserve.progress import Stage

log = logging.getLogger(__name__)

# GGML type ids of the block formats the kernels multiply in place: Q4_0, Q4_1, Q5_0, Q5_1,
# Q8_0, Q4_K, Q5_K, Q6_K, MXFP4
NATIVE_TYPES = frozenset(FORMATS)


@dataclass(frozen=True)
class FileRows:
    """A matrix's rows where they lie in a file, read on each use (so only what the forward
    makes of them stays in memory, never the file's copy beside it)."""

    path: str
    offset: int
    shape: tuple[int, int]
    dtype: str  # numpy's name

    def read(self) -> np.ndarray:
        return self[0 : self.shape[0]]

    def __getitem__(self, rows: slice) -> np.ndarray:
        """Rows [start, stop) alone, read from the file (packing reads a matrix so, a chunk
        at a time: kernels/qlayout.py)."""
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("rows of a file are read as one range")
        n, width = max(0, stop - start), self.shape[1]
        at = self.offset + start * width * np.dtype(self.dtype).itemsize
        values = np.fromfile(self.path, dtype=self.dtype, count=n * width, offset=at)
        if values.size != n * width:
            raise OSError(f"{self.path} ends inside a tensor: the file is truncated")
        return values.reshape(n, width)


@dataclass(frozen=True)
class QuantizedTensor:
    """A [N, K] weight as rows of GGUF blocks: uint8 [N, K / block length * block bytes] (32
    weights a block, 256 for the K-quants), or half-precision values [N, K]; in memory, or where
    they lie in a file."""

    data: np.ndarray | FileRows
    ggml_type: int
    k: int

    @property
    def blocks(self) -> np.ndarray:
        return self.data.read() if isinstance(self.data, FileRows) else self.data

    @property
    def block_rows(self) -> np.ndarray | FileRows:
        """The rows as they are held: an array, or rows in a file, read a slice at a time."""
        return self.data

    @property
    def n(self) -> int:
        return int(self.data.shape[0])

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        """Rows `ids` [T] as float32 [T, K], dequantized alone (a table gathered per token:
        the rest is neither read nor expanded); each row the bits `dequantize` gives it."""
        from gguf import GGMLQuantizationType, dequantize

        data = self.data
        table = (
            np.memmap(data.path, dtype=data.dtype, mode="r", offset=data.offset, shape=data.shape)
            if isinstance(data, FileRows)
            else data
        )
        picked = np.ascontiguousarray(table[ids])
        kind = GGMLQuantizationType(self.ggml_type)
        values = dequantize(picked, kind).astype(np.float32, copy=False)
        return torch.from_numpy(np.ascontiguousarray(values).reshape(len(ids), self.k))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, as gguf (and so transformers) computes it."""
        from gguf import GGMLQuantizationType, dequantize

        kind = GGMLQuantizationType(self.ggml_type)
        values = dequantize(self.blocks, kind).astype(np.float32, copy=False)
        return torch.from_numpy(np.ascontiguousarray(values).reshape(self.n, self.k))


Weight = torch.Tensor | QuantizedTensor


def stack_rows(parts: Sequence[Weight]) -> Weight:
    """The weights' rows one after another (a fused QKV or gate/up matrix): blocks stay blocks
    where every part has the same format; otherwise all become float32."""
    first = parts[0]
    if isinstance(first, QuantizedTensor) and all(
        isinstance(p, QuantizedTensor) and p.ggml_type == first.ggml_type for p in parts
    ):
        blocks = np.concatenate([p.blocks for p in parts])  # type: ignore[union-attr]
        return QuantizedTensor(blocks, first.ggml_type, first.k)
    return torch.cat([as_float(p) for p in parts])


def as_float(weight: Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight


def load_weights(path: str | Path, skeleton: Any) -> dict[str, Weight]:
    """`read_weights`, through a cache: reading a GGUF file's metadata takes seconds (its
    tokenizer's vocabulary is hundreds of thousands of fields), so the weights are written once,
    as they come out of the file (every matrix as its file rows, vectors float32), into a
    safetensors file beside the converted model directory (models/cache.py; beside, not in it:
    whatever loads that directory reads every *.safetensors file it holds). Its matrices are
    read from it one at a time as the forward takes them (`FileRows`)."""
    from probserve.models.cache import converted_dir

    converted = converted_dir(Path(path))
    cache = converted.with_name(f"{converted.name}.blocks.safetensors")
    if not cache.is_file():
        weights = read_weights(path, skeleton)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        size = Path(path).stat().st_size / 2**20
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            what = f"caching the weight blocks of {Path(path).name}"
            once = f"later starts read {cache}"
            with Stage(log, what, once, total=size, unit="MiB") as stage:
                _write_cache(weights, tmp, lambda n: stage.advance(n / 2**20))
            os.replace(tmp, cache)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            log.warning("could not cache the GGUF blocks (%s): reading the file each start", exc)
            return served(weights)
        del weights  # the file's mapping: the cache is read instead
        release_pages(path)  # and a parse kept for the rest of the load holds no pages
    return served(_from_cache(cache, skeleton))


_NP_TO_ST = {"uint8": "U8", "float16": "F16", "float32": "F32", "int8": "I8", "int16": "I16"}


def _write_cache(
    weights: dict[str, Weight], path: Path, written: Callable[[int], None] | None = None
) -> None:
    """The weights as a safetensors file, written a tensor at a time (safetensors' own writer
    holds a copy of every tensor's bytes at once: the file's size again in memory). Blocks carry
    their format and row length in the header's metadata; a tied twin is stored once."""
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, str] = {}
    seen: set[int] = set()
    for name, value in weights.items():
        if id(value) in seen:  # restored from its first name on load (`_with_ties`)
            continue
        seen.add(id(value))
        if isinstance(value, QuantizedTensor):
            arrays[name] = value.blocks
            meta[name] = f"{value.ggml_type},{value.k}"
        else:
            arrays[name] = value.numpy()
    header: dict[str, Any] = {"__metadata__": meta}
    at = 0
    for name, array in arrays.items():
        header[name] = {
            "dtype": _NP_TO_ST[array.dtype.name],
            "shape": list(array.shape),
            "data_offsets": [at, at + array.nbytes],
        }
        at += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for array in arrays.values():
            f.write(np.ascontiguousarray(array).data)
            if written is not None:
                written(array.nbytes)


def _from_cache(cache: Path, skeleton: Any) -> dict[str, Weight]:
    """The cached weights: vectors read now, matrices as `FileRows` (read when used)."""
    with cache.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    meta = header.pop("__metadata__", None) or {}
    start = 8 + size
    dtypes = {v: k for k, v in _NP_TO_ST.items()}
    out: dict[str, Weight] = {}
    for name, info in header.items():
        begin, _ = info["data_offsets"]
        shape, dtype = tuple(info["shape"]), dtypes[info["dtype"]]
        if name in meta:
            ggml_type, k = (int(v) for v in meta[name].split(","))
            rows = FileRows(str(cache), start + begin, (shape[0], shape[1]), dtype)
            out[name] = QuantizedTensor(rows, ggml_type, k)
        else:
            count = int(np.prod(shape)) if shape else 1
            values = np.fromfile(cache, dtype=dtype, count=count, offset=start + begin)
            out[name] = torch.from_numpy(values.reshape(shape).copy())
    return _with_ties(out, skeleton, cache.name)


# tables the forward reads a row of per token (Gemma 4's per-layer input embedding: billions of
# values): kept in the file's format, whatever it is, each token's row dequantized alone
GATHERED = ("embed_tokens_per_layer.weight",)


def served(weights: dict[str, Weight]) -> dict[str, Weight]:
    """The weights as the forward holds them: blocks of the native formats stay blocks, and so
    does a table of GATHERED in any format; any other quantized or half-precision tensor becomes
    float32 (one warning per format, with the memory that costs). Tied names keep sharing one
    tensor."""
    out: dict[str, Weight] = {}
    done: dict[int, Weight] = {}
    cost: dict[str, int] = {}
    for name, value in weights.items():
        kept = name.endswith(GATHERED)
        if isinstance(value, QuantizedTensor) and value.ggml_type not in NATIVE_TYPES and not kept:
            if id(value) not in done:
                done[id(value)] = value.dequantize()
                cost[value.type_name] = cost.get(value.type_name, 0) + value.n * value.k * 4
            out[name] = done[id(value)]
        else:
            out[name] = value
    for kind, size in sorted(cost.items()):
        if kind not in ("F16", "BF16"):
            log.warning("%s is not served natively: %.2f GB as float32", kind, size / 2**30)
    return out


def read_weights(path: str | Path, skeleton: Any) -> dict[str, Weight]:
    """The file's tensors by transformers parameter name (`skeleton`: the model, on the meta
    device, whose names they take), as the file holds them: every matrix in its own rows (blocks
    of any format, or half-precision values; `served` makes float32 of those without a kernel),
    float32 ones and every vector (a norm: the tensor processor may change its values) as
    float32; tied weights appear under each of their names."""
    from gguf import MODEL_ARCH_NAMES, GGUFReader, dequantize, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch_name = bytes(field.parts[field.data[0]]).decode()
    arch = next((a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise KeyError(f"gguf does not know the architecture {arch_name!r}")
    cfg = skeleton.config
    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(
        config={
            "num_attention_heads": cfg.num_attention_heads,
            # (a model whose layers differ, Gemma 4: its first layer's; its processor reads none)
            "num_key_value_heads": (
                cfg.per_layer_config[0] if hasattr(cfg, "per_layer_config") else cfg
            ).num_key_value_heads,
        }
    )
    # transformers' mapping (get_gguf_hf_weights_map), for the top-level names alone
    name_map = get_tensor_name_map(arch, cfg.num_hidden_layers)
    names: dict[str, str] = {}
    for hf_name, _ in skeleton.named_parameters(remove_duplicate=False):
        base, _, suffix = processor.preprocess_name(hf_name).rpartition(".")
        if suffix in ("sinks", "layer_scalar"):  # a parameter of its own (gpt-oss's sinks,
            # Gemma 4's layer scalars): the file's attn_sinks.weight, layer_output_scale.weight
            base, suffix = hf_name, "weight"
        tail = hf_name.split(".", 3)[-1]  # (model.layers.N.<tail>)
        if tail in SCALES:  # Gemma 4's router scales: named after the tensors they scale
            stem, suffix = SCALES[tail]
            base = hf_name[: -len(tail)] + stem
        if suffix in gguf_hybrid.NAMES:  # Qwen3.5's A_log (ssm_a), dt_bias (ssm_dt.bias)
            stem, suffix = gguf_hybrid.NAMES[suffix]
            base = f"{base}.{stem}"
        if gguf_hybrid.unpacked(hf_name):  # Qwen3-Next: its packed projections' parts
            names.update(gguf_hybrid.unpacked_names(name_map, hf_name.split(".linear_attn")[0]))
            continue
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            names.setdefault(f"{gguf_name}.{suffix}" if suffix else gguf_name, hf_name)
    out: dict[str, Weight] = {}
    under = EXPERTS_UNDER.get(arch_name, "mlp.experts")
    for tensor in reader.tensors:
        stacked = _EXPERTS.fullmatch(tensor.name)
        if stacked is not None:  # [experts, rows, row bytes]: each expert a view
            layer, which, kind = int(stacked[1]), stacked[2], stacked[3]
            if layer >= cfg.num_hidden_layers:  # a multi-token-prediction layer: not served
                continue
            for e in range(tensor.data.shape[0]):
                held = _expert_weight(tensor, tensor.data[e])
                out[_expert_name(layer, e, which, kind, under)] = held
            continue
        one = _ONE_EXPERT.fullmatch(tensor.name)  # an older file: each expert its own tensor
        if one is not None:
            expert = _expert_name(int(one[1]), int(one[3]), one[2], "weight", under)
            out[expert] = _expert_weight(tensor, tensor.data)
            continue
        name = names.get(tensor.name)
        if name is None:
            continue
        kind = tensor.tensor_type
        if kind.name == "F32" or (kind not in NATIVE_TYPES and len(tensor.shape) < 2):
            values = dequantize(tensor.data, kind)
            values = processor.process(weights=values, name=tensor.name).weights
            out[name] = torch.from_numpy(np.array(values, dtype=np.float32))
        else:  # the file's rows as they are (a native format, or one `served` dequantizes)
            rows = processor.process(weights=tensor.data, name=tensor.name).weights
            out[name] = QuantizedTensor(rows, int(kind), int(tensor.shape[0]))
    gguf_hybrid.restore(out, cfg)
    return _with_ties(out, skeleton, Path(path).name)


# a mixture of experts' stacked tensor: [experts, rows, row bytes] (llama.cpp's ffn_*_exps; newer
# converters may write gate and up as one ffn_gate_up_exps, rows [gate | up], and its bias);
# one expert's matrix in an older file (Mixtral's first GGUFs: blk.N.ffn_gate.E.weight)
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias)")
_ONE_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# the module of a layer's experts where it is not `mlp.experts` (transformers' Gemma 4 holds
# them beside its MLP), by GGUF architecture
EXPERTS_UNDER = {"gemma4": "experts"}
# Gemma 4's router vectors (a layer's parameter -> the tensor whose file name they take, and
# their suffix there): llama.cpp's converter writes router.scale as ffn_gate_inp.scale and
# router.per_expert_scale as ffn_down_exps.scale
SCALES = {
    "router.scale": ("router.proj", "scale"),
    "router.per_expert_scale": ("experts.down_proj", "scale"),
}


def _expert_name(layer: int, expert: int, which: str, kind: str, under: str) -> str:
    """Expert `expert`'s matrix (or bias: gpt-oss) under its own name (the forward's
    per-expert weights), in the layer's module `under`."""
    return f"model.layers.{layer}.{under}.{expert}.{which}_proj.{kind}"


def _expert_weight(tensor: Any, rows: np.ndarray) -> Weight:
    """One expert's rows of `tensor` as a view of the file's: blocks stay blocks, float32 is
    read as float32 (K: the tensor's first dimension, ggml's order), as is a bias of any
    precision."""
    if tensor.tensor_type.name == "F32" or rows.ndim < 2:
        from gguf import dequantize

        return torch.from_numpy(np.array(dequantize(rows, tensor.tensor_type), dtype=np.float32))
    return QuantizedTensor(rows, int(tensor.tensor_type), int(tensor.shape[0]))


def _held_per_expert(name: str, out: dict[str, Weight]) -> bool:
    """A skeleton's stacked expert parameter (transformers' mlp.experts.gate_up_proj or
    down_proj, Gemma 4's experts.*) the weights hold per expert instead."""
    parts = {
        "gate_up_proj": (("gate_proj", "up_proj"), ("gate_up_proj",)),
        "down_proj": (("down_proj",),),
    }
    for stacked, layouts in parts.items():
        for kind, tail in (("weight", ""), ("bias", "_bias")):
            if name.endswith(f".experts.{stacked}{tail}"):
                head = name[: -len(stacked + tail)]
                return any(
                    all(f"{head}0.{part}.{kind}" in out for part in names) for names in layouts
                )
    return False


def _held_unpacked(name: str, out: dict[str, Weight]) -> bool:
    """A Qwen3-Next packed projection the weights hold as its parts (a GGUF file's)."""
    parts = name.replace("in_proj_qkvz.", "in_proj_qkv.").replace("in_proj_ba.", "in_proj_b.")
    return gguf_hybrid.unpacked(name) and parts in out


def _with_ties(out: dict[str, Weight], skeleton: Any, source: str) -> dict[str, Weight]:
    """Tied parameters (one Parameter under several names) share one tensor; every parameter
    must have one."""
    params = list(skeleton.named_parameters(remove_duplicate=False))
    for name, param in params:
        if name not in out:
            twin = next((o for o, p in params if o in out and p is param), None)
            if twin is not None:
                out[name] = out[twin]
    missing = sorted(
        n
        for n, _ in params
        if n not in out and not _held_per_expert(n, out) and not _held_unpacked(n, out)
    )
    if missing:
        raise KeyError(f"{source} has no tensor for {', '.join(missing[:3])}")
    return out


def blocks_share(weights: dict[str, Weight]) -> tuple[float, str]:
    """The fraction of the parameters held in blocks, and how they split by format
    ("Q5_0 62%, Q4_K 25%, Q6_K 9%, float32 4% (12 MB)"); tied weights counted once."""
    counts: dict[str, int] = {}
    float_bytes = 0
    for value in {id(v): v for v in weights.values()}.values():
        if isinstance(value, QuantizedTensor):
            name, n = value.type_name, value.n * value.k  # (its shape: no rows read)
        else:
            name, n = "float32", value.numel()
            float_bytes += n * 4
        counts[name] = counts.get(name, 0) + n
    total = sum(counts.values()) or 1
    parts = []
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        size = f" ({float_bytes / 2**20:.0f} MB)" if name == "float32" else ""
        parts.append(f"{name} {100 * n / total:.0f}%{size}")
    return 1 - counts.get("float32", 0) / total, ", ".join(parts)


def block_formats(weights: dict[str, Weight]) -> list[str]:
    """The block formats among the weights, by name ("Q4_K", "Q6_K")."""
    return sorted({w.type_name for w in weights.values() if isinstance(w, QuantizedTensor)})
