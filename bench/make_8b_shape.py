"""A dense 8B-parameter GGUF for the race at the size people run: Llama-3-8B's dimensions (hidden
4096, 32 layers, 32 heads of 128, 8 KV heads, FFN 14336, RoPE theta 500000), random weights and
the embedded model's tokenizer (vocabulary 49152, so every server tokenizes the same), built the
way ../shared/models/make_tinyshape.py builds its 1.1B shape (its own writer, with these
dimensions): an F16 file (about 14 GB), then llama-quantize's Q4_K_M (about 4.4 GB).

    .venv/bin/python bench/make_8b_shape.py --out /tmp/shape8b --llama-bin BINDIR

BINDIR is the folder of the llama-server binary ../shared/peers/llama_server.sh prints
(llama-quantize lies beside it). Run alone on the machine; the F16 file can be deleted after.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from gguf import GGUFValueType

ROOT = Path(__file__).resolve().parent.parent
BUILDER = ROOT.parent / "shared" / "models" / "make_tinyshape.py"

# Llama-3-8B's dimensions (its config.json), the embedded tokenizer's vocabulary
SHAPE = {
    "HIDDEN": 4096,
    "LAYERS": 32,
    "HEADS": 32,
    "KV_HEADS": 8,
    "FFN": 14336,
    "CTX": 8192,
    "THETA": 500000.0,
}


def builder() -> ModuleType:
    """make_tinyshape.py with the 8B dimensions in place of its 1.1B ones (its functions read
    the module's constants when they run)."""
    spec = importlib.util.spec_from_file_location("make_tinyshape", BUILDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, value in SHAPE.items():
        setattr(module, name, value)
    module.HEAD_DIM = module.HIDDEN // module.HEADS
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    module.OVERRIDES.update(
        {
            "llama.context_length": (module.CTX, u32),
            "llama.embedding_length": (module.HIDDEN, u32),
            "llama.block_count": (module.LAYERS, u32),
            "llama.feed_forward_length": (module.FFN, u32),
            "llama.attention.head_count": (module.HEADS, u32),
            "llama.attention.head_count_kv": (module.KV_HEADS, u32),
            "llama.rope.freq_base": (module.THETA, f32),
            "llama.rope.dimension_count": (module.HEAD_DIM, u32),
            "general.name": (
                "shape-8b-random (Llama-3-8B shape, SmolLM2 tokenizer)",
                GGUFValueType.STRING,
            ),
            "general.size_label": ("8B", GGUFValueType.STRING),
        }
    )
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder of the files")
    ap.add_argument("--llama-bin", required=True, help="folder holding llama-quantize")
    ap.add_argument("--threads", default="2")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = builder()
    f16 = out / "shape8b-f16.gguf"
    if not f16.exists():
        shape.write_model(shape.default_source(), f16)
    q = out / "shape8b-q4_k_m.gguf"
    exe = str(Path(args.llama_bin) / "llama-quantize")
    subprocess.run([exe, str(f16), str(q), "Q4_K_M", args.threads], check=True)
    print(f"wrote {q} ({q.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
