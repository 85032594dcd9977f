"""HFRunner: any transformers causal LM, one sequence at a time, through its own forward with a
DynamicCache per sequence (the engine's blocks then only account for its memory)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from probserve.engine.core import prompt_scoring
from probserve.engine.core.row_math import RowMath, TorchRowMath
from probserve.engine.core.sequence import Sequence
from probserve.engine.core.step import Chunk, RunOutput, ScoreRows, empty_logits
from probserve.engine.types import RoutedExperts
from probserve.models.loader import LoadedModel


class HFRunner:
    """Any transformers causal LM, one sequence at a time, through its own forward."""

    prefix_caching = False
    speculates = False  # its per-sequence caches are never rolled back: no proposals

    @staticmethod
    def kv_bytes_per_token(config: Any) -> int:
        """float32 K and V of every layer; any config transformers knows (GPT-2's n_layer and
        n_head are aliased to the standard names), key/value heads default to the heads."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n = int(text.num_hidden_layers)
        try:
            heads = int(text.num_attention_heads)
            kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
            head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        except RuntimeError:  # shapes by layer (Gemma 4: transformers refuses the global ones)
            layers = [text.per_layer_config[i] for i in range(n)]
            return 4 * 2 * sum(int(c.num_key_value_heads) * int(c.head_dim) for c in layers)
        return 4 * 2 * n * kv_heads * head_dim

    @staticmethod
    def state_bytes_per_sequence(config: Any) -> int:
        return 0  # (its per-sequence caches are transformers', counted per token above)

    @staticmethod
    def routing_shape(config: Any) -> tuple[tuple[int, ...], int]:
        """None: transformers' forward keeps no routing (a request asking is refused)."""
        return (), 0

    keeps_hidden = False  # (its caches are transformers', per sequence)

    def routing(self, seq: Sequence, start: int, end: int) -> RoutedExperts:
        raise RuntimeError("the transformers runner keeps no routing")

    def hidden(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        raise RuntimeError("the transformers runner keeps no hidden states")

    def __init__(
        self, loaded: LoadedModel, num_blocks: int = 0, config: Any = None, backend: Any = None
    ) -> None:
        """(`num_blocks`, `config`, `backend`: the runner contract's; transformers' forward
        sizes its own caches and runs on the host.)"""
        from transformers import DynamicCache

        self.model = model = loaded.model
        self._cache_cls = DynamicCache
        params = inspect.signature(model.forward).parameters
        # transformers >= 5.2x names the cache argument `cache`; older ones `past_key_values`
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        self.row_math: RowMath = TorchRowMath()

    def warm(self) -> None:
        """Nothing to prepare: transformers' forward builds its caches per sequence."""

    def release_source_weights(self) -> None:
        """Nothing to drop: transformers' forward runs on the model's own weights."""

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> RunOutput:
        rows: list[torch.Tensor] = []
        prompt_rows: dict[str, ScoreRows] = {}
        for ch in chunks:
            seq = ch.seq
            if seq.runner_state is None:
                seq.runner_state = self._cache_cls(config=self.model.config)
            ids = torch.tensor([seq.token_ids[ch.start : ch.end]], dtype=torch.long)
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: seq.runner_state})
            logits = out.logits[0].float()
            a, b = prompt_scoring.score_range(ch)
            if b > a:
                prompt_rows[seq.request_id] = ScoreRows(logits[a - ch.start : b - ch.start])
            if ch.samples:
                rows.append(logits[-1])
        sample = torch.stack(rows) if rows else empty_logits(self.vocab)
        return RunOutput(sample, prompt_rows)
