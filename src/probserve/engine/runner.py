"""The model runner: turns scheduled sequences into logits.

`HFRunner` runs any transformers causal LM through its own `forward`, one sequence at a time,
each with its own `DynamicCache`. It returns the logits rows the sampler needs (the last position
of each sequence) and, for sequences that score their prompt, the logits of every prompt
position.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from probserve.engine.scheduler import ScheduledBatch
from probserve.engine.sequence import Sequence


@dataclass
class RunOutput:
    sample_logits: torch.Tensor  # [B, V], rows in the order of ScheduledBatch.seqs
    prompt_logits: dict[str, torch.Tensor] = field(default_factory=dict)  # id -> [p, V]


class HFRunner:
    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self.model = model
        self._cache_cls = DynamicCache
        params = inspect.signature(model.forward).parameters
        self._has_logits_to_keep = "logits_to_keep" in params
        # transformers >= 5.2x names the cache argument `cache`; older ones `past_key_values`
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def _forward(self, seq: Sequence, all_logits: bool) -> torch.Tensor:
        ids = seq.pending_token_ids()
        if seq.cache is None:
            seq.cache = self._cache_cls(config=self.model.config)
        kwargs: dict[str, Any] = {self._cache_arg: seq.cache, "use_cache": True}
        if self._has_logits_to_keep and not all_logits:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=torch.tensor([ids], dtype=torch.long), **kwargs)
        # the cache object is updated in place by the forward
        seq.num_computed += len(ids)
        logits = out.logits[0]
        return logits if all_logits else logits[-1:]

    def run(self, batch: ScheduledBatch, score_prompt: set[str]) -> RunOutput:
        rows: list[torch.Tensor] = []
        prompt_logits: dict[str, torch.Tensor] = {}
        for seq in batch.seqs:
            wants_prompt = not seq.prefilled and seq.request_id in score_prompt
            logits = self._forward(seq, all_logits=wants_prompt)
            if wants_prompt:
                prompt_logits[seq.request_id] = logits[:-1]
            rows.append(logits[-1])
        return RunOutput(torch.stack(rows).float(), prompt_logits)
