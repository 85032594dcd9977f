"""Constrained decoding in the engine: one llguidance matcher per sequence with a grammar,
the tokens it allows at each step as a boolean row over the model's vocabulary, and the
tokens it consumes as they are sampled.

The matcher's state is the sequence's output tokens, which outlive preemption (recompute
keeps them), so nothing needs replaying; the stop ids (EOS, stop_token_ids) are allowed
wherever the grammar may end."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from probserve.engine.grammar import llguidance_tokenizer
from probserve.engine.types import RequestError


class Grammars:
    """The model's llguidance tokenizer (built once, on first use: ~0.3 s) and the matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._lltok: Any = None

    def tokenizer(self) -> Any:
        if self._lltok is None:
            self._lltok = llguidance_tokenizer(self._hf, self.vocab_size, self._eos)
        return self._lltok

    def matcher(self, grammar: str) -> Any:
        """A matcher at the grammar's start; a grammar llguidance refuses is a RequestError."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"the grammar is not valid: {matcher.get_error()}", "grammar")
        return matcher

    def allowed(self, matcher: Any, stop_ids: frozenset[int]) -> torch.Tensor:
        """bool [vocab]: the tokens the grammar allows next (the stop ids where it may end)."""
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if matcher.is_accepting():
            mask[[t for t in stop_ids if t < self.vocab_size]] = True
        return torch.from_numpy(mask)
