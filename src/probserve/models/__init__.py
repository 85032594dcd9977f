"""Model layer: resolving a model spec (sources.py) and loading weights and tokenizer through
transformers (loader.py)."""

from probserve.models.loader import (
    LoadedModel,
    load_model,
    load_tokenizer,
    prepared_source,
    save_hf_directory,
)
from probserve.models.record import ModelRecord
from probserve.models.sources import (
    DEFAULT_MODEL,
    MODEL_HELP,
    ModelLoadError,
    ModelSource,
    resolve_model,
)

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_HELP",
    "LoadedModel",
    "ModelLoadError",
    "ModelRecord",
    "ModelSource",
    "load_model",
    "load_tokenizer",
    "prepared_source",
    "resolve_model",
    "save_hf_directory",
]
