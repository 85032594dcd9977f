"""`ModelRecord`: a model as the API process holds it, without weights: its tokenizer (and
chat template), its name, EOS ids, context length and vocabulary size, and where it came from.
The engine's `LoadedModel` holds the weights; the API builds a record from the engine's hello
(a worker's, a Ray replica's) or, for an inline engine, from the loaded model (`of`): two types,
so no API code holds a model with its weights missing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from probserve.models.sources import ModelSource

if TYPE_CHECKING:
    from probserve.models.loader import LoadedModel


@dataclass(frozen=True)
class ModelRecord:
    tokenizer: Any  # a transformers tokenizer
    name: str
    eos_token_ids: frozenset[int]
    context_length: int
    vocab_size: int
    chat_template: str | None = None
    source: ModelSource | None = field(default=None, repr=False)

    @classmethod
    def of(cls, loaded: LoadedModel) -> ModelRecord:
        """The record of a model loaded in this process (an inline engine's)."""
        return cls(
            loaded.tokenizer, loaded.name, loaded.eos_token_ids, loaded.context_length,
            loaded.vocab_size, loaded.chat_template, loaded.source,
        )  # fmt: skip
