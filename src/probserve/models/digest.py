"""A model's weights digest: SHA-256 of the bytes its numbers come from, for the numerics
fingerprint (engine/fingerprint.py).

A GGUF file is hashed whole (its header, metadata and tensor data); a Hugging Face directory,
its configuration and weight files in name order; a model built in memory (no files: tests),
its tensors. A file's digest is computed once and kept in the probserve cache
(`PROBSERVE_CACHE_DIR/digests`), keyed by the file's path, size and modification time, so a
later start reads 64 bytes instead of the whole file (hashing runs at 1-2 GB/s: the embedded
model's 98 MB in about 0.1 s).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from probserve.cache_dir import cache_root

log = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")
_CHUNK = 1 << 22


def file_digest(path: Path) -> str:
    """The file's SHA-256 (hex), from the cache where this path, size and mtime were hashed."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    kept = cache_root() / "digests" / hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        text = kept.read_text().strip()
        if len(text) == 64:
            return text
    except OSError:
        pass
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".digest-", dir=kept.parent)
        with os.fdopen(fd, "w") as f:
            f.write(digest)
        os.replace(tmp, kept)
    except OSError as exc:  # an unwritable cache: computed again next start
        log.debug("could not keep the digest of %s (%s)", path, exc)
    return digest


def _directory_digest(directory: Path) -> str:
    h = hashlib.sha256()
    files = sorted(
        p for p in directory.iterdir()
        if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json")
    )  # fmt: skip
    for p in files:
        h.update(p.name.encode() + b"\0" + file_digest(p).encode())
    return h.hexdigest()


def _tensors_digest(model: Any, weights: dict[str, Any] | None) -> str:
    """The in-memory model's tensors (a model with no files), by name."""
    import numpy as np
    import torch

    h = hashlib.sha256()
    tensors: dict[str, Any] = dict(model.state_dict()) if hasattr(model, "state_dict") else {}
    tensors.update(weights or {})
    for name in sorted(tensors):
        value = tensors[name]
        h.update(name.encode() + b"\0")
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":
                continue
            value = value.detach().cpu().contiguous().view(torch.uint8).numpy()
        arrays = [getattr(value, f) for f in getattr(value, "_fields", ())] or [value]
        for a in arrays:
            if isinstance(a, np.ndarray):
                h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def model_digest(loaded: Any) -> str:
    """The weights digest of a LoadedModel (models/loader.py): its GGUF file, its directory's
    weight files, or its tensors."""
    source = loaded.source
    if source is not None:
        if source.quantized_file and Path(source.quantized_file).is_file():
            return file_digest(Path(source.quantized_file))
        directory = Path(source.name_or_path)
        if directory.is_dir():
            return _directory_digest(directory)
    return _tensors_digest(loaded.model, loaded.weights)
