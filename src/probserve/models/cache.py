"""The converted-model cache: what a GGUF file holds besides its weights, written once as a plain
Hugging Face directory, and a float32 copy of its weights only where float32 is what is served.

transformers reads a GGUF file's metadata three times per load (tokenizer, config, weights), and
its tokenizer's vocabulary alone takes seconds to parse. So the first start writes the file's
configuration, generation configuration, tokenizer and chat template into a directory (a few MB;
no weights: `--weights native` reads the blocks from the file itself, models/gguf_blocks.py), and
every later start (each engine worker, each test server) reads that. A float32 copy of the weights
(`<directory>.float32`, safetensors, memory-mapped) is written only when float32 is served
(`--weights float32`, a model without a native path) or exported. The key is the file's
content (its SHA-256, models/digest.py, itself kept by path, size and modification time), so
the same file in a second virtual environment, checkout or download reuses the entries instead
of writing another copy; each directory is written to a temporary folder and renamed into
place, so concurrent starts never see half of one. `PROBSERVE_CACHE_DIR` moves the cache (default
`~/.cache/probserve`); an unwritable cache falls back to reading the GGUF directly.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from probserve.cache_dir import cache_root
from probserve.models.digest import file_digest
from probserve.progress import Stage

log = logging.getLogger(__name__)

_DONE = ".complete"
_LAYOUT = "metadata-v3"  # what a directory holds: a change writes new directories
FLOAT32_SUFFIX = ".float32"


def converted_dir(gguf: Path) -> Path:
    """The metadata directory of a GGUF file (its float32 copy and its blocks sit beside it),
    named by the file's content: one entry however many paths and names hold the same bytes
    (the first name written stays: `<stem>-<digest>`)."""
    key = f"{file_digest(gguf)}|{_LAYOUT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    models = cache_root() / "models"
    try:  # another name's entry for the same bytes (the suffixed copies end otherwise)
        kept = sorted(p for p in models.glob(f"*-{digest}") if p.is_dir())
    except OSError:
        kept = []
    return kept[0] if kept else models / f"{gguf.stem}-{digest}"


def float32_dir(gguf: Path) -> Path:
    converted = converted_dir(gguf)
    return converted.with_name(converted.name + FLOAT32_SUFFIX)


def written(target: Path, write: Callable[[Path], None], what: str) -> Path | None:
    """`target`, written now by `write(folder)` unless it is already complete; None where the
    cache cannot be written (a warning says why)."""
    if (target / _DONE).is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    except OSError as exc:
        log.warning("model cache %s is not writable (%s)", target, exc)
        return None
    try:
        with Stage(log, f"writing {what}", once=f"kept in {target} for later starts"):
            write(tmp)
        (tmp / _DONE).touch()
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: theirs is as good
            if not (target / _DONE).is_file():
                raise
    except OSError as exc:
        log.warning("could not write the model cache (%s)", exc)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
