"""Model layer: resolving a model spec and loading weights and tokenizer through transformers."""

from probserve.models.loader import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelLoadError,
    ModelSource,
    load_model,
    load_tokenizer,
    prepared_source,
    resolve_model,
    save_hf_directory,
)

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "ModelLoadError",
    "ModelSource",
    "load_model",
    "load_tokenizer",
    "prepared_source",
    "resolve_model",
    "save_hf_directory",
]
