"""The shape builders' shared steps: a planned file's tensors written (F16 matrices, float32
vectors) after its metadata, then quantized by llama.cpp's llama-quantize (it lies beside the
llama-server that ../shared/peers/llama_server.sh builds, with its libraries)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Planned = list[tuple[str, tuple[int, ...], str]]  # (name, dims, kind: "matrix", "norm", ...)


def write_tensors(
    writer: Any,
    tensors: Planned,
    write_one: Callable[[int, tuple[int, ...], str], None],
    tmp: Path,
    path: Path,
) -> None:
    """Declare `tensors` (matrices F16, the rest float32), write the header, metadata and infos,
    then each tensor by `write_one(index, dims, kind)` with its progress; `tmp` becomes `path`."""
    for name, dims, kind in tensors:
        dtype = np.dtype(np.float16) if kind == "matrix" else np.dtype(np.float32)
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    t0 = time.time()
    for i, (name, dims, kind) in enumerate(tensors):
        write_one(i, dims, kind)
        print(f"  {name} ({time.time() - t0:.0f}s)", flush=True)
    writer.close()
    os.replace(tmp, path)


def quantize(f16: Path, target: Path, quant: str, llama_bin: str, threads: str) -> int:
    """llama-quantize F16 -> `target` in `quant` (Q4_K_M, ...); its exit status, 0 when written."""
    env = {**os.environ, "LD_LIBRARY_PATH": llama_bin}
    exe = str(Path(llama_bin) / "llama-quantize")
    done = subprocess.run([exe, str(f16), str(target), quant, threads], env=env, check=False)
    if done.returncode == 0:
        print(f"wrote {target} ({target.stat().st_size / 2**30:.2f} GiB)")
    return done.returncode
