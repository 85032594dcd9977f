"""Where probserve keeps what it builds or converts once (the kernels' library, a GGUF file's
metadata and blocks): `PROBSERVE_CACHE_DIR`, default `~/.cache/probserve`. A ground-floor module:
every layer may ask it."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PROBSERVE_CACHE_DIR"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "probserve")
