"""A model's sampling defaults: the values its generation_config.json sets for the sampling
fields a request may leave out (temperature, top_p, top_k, min_p, repetition_penalty) and for
the budget of a request that sets none (max_new_tokens), applied by default as vLLM applies
them (`--generation-config`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from probserve.models.sources import ModelLoadError, ModelSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingDefaults:
    """None: the OpenAI default (temperature 1, top_p 1, no top_k or min_p, no penalty), and
    for max_new_tokens the server's (--max-tokens-default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    def named(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


def sampling_defaults(source: ModelSource | None, choice: str) -> SamplingDefaults:
    """`choice` "auto": the source's own generation_config.json (a GGUF file read in place has
    none: its converted directory has the one transformers writes, without sampling values);
    "vllm" or "none": none (the OpenAI defaults); anything else: the generation_config.json of
    that directory. Only what the file sets counts (its `to_diff_dict`, as vLLM reads it)."""
    if choice in ("vllm", "none"):
        return SamplingDefaults()
    if choice == "auto":
        if source is None or source.gguf_file:
            return SamplingDefaults()
        where = source.name_or_path
    elif (Path(choice) / "generation_config.json").is_file():
        where = choice
    else:
        raise ModelLoadError(f"--generation-config {choice}: no generation_config.json there")
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(where)
    except (OSError, ValueError):  # no such file: no defaults
        return SamplingDefaults()
    diff = config.to_diff_dict()
    values: dict[str, Any] = {}
    for f in fields(SamplingDefaults):
        value = diff.get(f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            counts = f.name in ("top_k", "max_new_tokens")
            values[f.name] = int(value) if counts else float(value)
    defaults = SamplingDefaults(**values)
    if values:
        log.info("sampling defaults from %s's generation_config.json: %s", where, defaults.named())
    return defaults
