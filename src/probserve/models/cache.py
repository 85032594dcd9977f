"""The converted-model cache: a GGUF file turned once into a plain float32 Hugging Face directory.

transformers reads a GGUF file's metadata three times per load (tokenizer, config, weights) and
dequantizes every tensor: about 18 s for the embedded 135M model on 2 cores. The converted
directory (safetensors, memory-mapped) loads in a few seconds with the same tensors bit for bit,
so every later start (each engine worker, each test server) is fast. The key is the file's path,
size and modification time; a conversion is written to a temporary folder and renamed into place,
so concurrent starts never see half a directory. `PROBSERVE_CACHE_DIR` moves the cache (default
`~/.cache/probserve`); an unwritable cache falls back to loading the GGUF directly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from probserve.models.loader import LoadedModel, ModelSource

log = logging.getLogger(__name__)

CACHE_ENV = "PROBSERVE_CACHE_DIR"
_DONE = ".complete"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "probserve")


def converted_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "models" / f"{gguf.stem}-{key[:16]}"


def converted(
    source: ModelSource,
    load: Callable[[ModelSource], LoadedModel],
    save: Callable[[LoadedModel, Path], Path],
) -> ModelSource:
    """The cached directory of a GGUF source (converting it now if needed); other sources, or a
    cache that cannot be written, are returned unchanged."""
    from probserve.models.loader import ModelSource

    if not source.gguf_file:
        return source
    gguf = Path(source.name_or_path) / source.gguf_file
    target = converted_dir(gguf)
    as_dir = ModelSource(str(target), None, source.served_name, blocks_file=str(gguf))
    if (target / _DONE).is_file():
        return as_dir
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    except OSError as exc:
        log.warning("model cache %s is not writable (%s): loading the GGUF directly", target, exc)
        return source
    try:
        log.info("converting %s once into %s", source.gguf_file, target)
        save(load(source), tmp)
        (tmp / _DONE).touch()
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: theirs is as good
            if not (target / _DONE).is_file():
                raise
    except OSError as exc:
        log.warning("could not write the model cache (%s): loading the GGUF directly", exc)
        return source
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return as_dir
