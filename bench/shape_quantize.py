"""The shape builders' last step: an F16 GGUF file quantized by llama.cpp's llama-quantize (it
lies beside the llama-server that ../shared/peers/llama_server.sh builds, with its libraries)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def quantize(f16: Path, target: Path, quant: str, llama_bin: str, threads: str) -> int:
    """llama-quantize F16 -> `target` in `quant` (Q4_K_M, ...); its exit status, 0 when written."""
    env = {**os.environ, "LD_LIBRARY_PATH": llama_bin}
    exe = str(Path(llama_bin) / "llama-quantize")
    done = subprocess.run([exe, str(f16), str(target), quant, threads], env=env, check=False)
    if done.returncode == 0:
        print(f"wrote {target} ({target.stat().st_size / 2**30:.2f} GiB)")
    return done.returncode
